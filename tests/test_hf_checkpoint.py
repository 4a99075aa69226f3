"""A converted Hugging Face model keeps every parameter object, its state_dict keys and its config;
an optimizer made before convert() trains it; save_pretrained writes a checkpoint that plain
transformers (no fastformer imported) loads; copies and pickles stay fused."""
import copy
import io
import json
import os
import subprocess
import sys
import textwrap

import pytest

transformers = pytest.importorskip("transformers", reason="the Hugging Face integration tests need transformers")

import torch  # noqa: E402

import fastformer  # noqa: E402
import hf_models as H  # noqa: E402
from utils import assert_close  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread_module")  # tiny shapes


def _eval_logits(model, batch):
    batch = dict(batch)
    labels = batch.pop("labels")
    batch["decoder_input_ids"] = H.decoder_inputs(model, labels)
    with torch.no_grad():
        return model.eval()(**batch).logits


@pytest.mark.parametrize("bare", [False, True], ids=["lm", "bare"])
@pytest.mark.parametrize("model_type", H.MODEL_TYPES + H.T5_TYPES)
def test_parameters_state_dict_and_config_are_kept(model_type, bare):
    model = H.build(model_type, bare=bare)
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    keys = list(model.state_dict())
    config = model.config
    config_dict = config.to_dict()
    assert H.convert(model) is model
    assert {n: id(p) for n, p in model.named_parameters()} == {n: id(p) for n, p in params.items()}
    assert {n: id(b) for n, b in model.named_buffers()} == {n: id(b) for n, b in buffers.items()}
    assert list(model.state_dict()) == keys
    assert model.config is config and model.config.to_dict() == config_dict


def test_optimizer_made_before_convert_trains_the_converted_model():
    ref = H.build("mbart").train()
    model = copy.deepcopy(ref)
    # SGD: Adam would blow the rounding noise of gradients that are zero in exact arithmetic (the key
    # projection's bias) up to full steps
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.9) for m in (model, ref))
    H.convert(model)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    for step in range(3):
        batch = H.batch("mbart", seed=step)
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            m(**batch).loss.backward()
            o.step()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_close(name, p, q, 1e-5, 1e-4)
    moved = [n for n, p in model.named_parameters() if not torch.equal(p, start[n])]
    assert len(moved) >= len(start) - 2 * model.config.encoder_layers - 4 * model.config.decoder_layers


def test_copy_true_leaves_the_model_alone():
    model = H.build("bart")
    cls, impl = type(model), model.config._attn_implementation
    out = fastformer.convert(model, copy=True)
    assert out is not model and type(model) is cls and model.config._attn_implementation == impl
    assert type(out) is not cls and out.config._attn_implementation == "fastformer"
    assert all(a is not b for a, b in zip(out.parameters(), model.parameters()))


def test_deepcopy_pickle_and_second_convert_stay_fused(monkeypatch):
    model = H.convert(H.build("m2m_100"))
    batch = H.batch("m2m_100")
    want = _eval_logits(model, batch)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    copies = [copy.deepcopy(model), torch.load(buf, weights_only=False),
              fastformer.convert(model, label_smoothing=0.1)]
    assert copies[2] is model and model._fastformer_label_smoothing == 0.1
    for c in copies:
        assert type(c) is type(model)
        calls, _ = H.count_op_calls(monkeypatch)
        c.train()
        c(**batch).loss.backward()
        assert calls["linear_cross_entropy"] == 1 and calls["feed_forward"] == 4
        assert_close("logits", _eval_logits(c, batch), want, 1e-6, 1e-6)


_LOAD = textwrap.dedent("""
    import json, sys
    import torch
    import transformers
    out = {}
    for name, path in json.loads(sys.argv[1]).items():
        cls = getattr(transformers, name)
        model = cls.from_pretrained(path).eval()
        batch = torch.load(path + "/batch.pt")
        with torch.no_grad():
            out[name] = [type(model).__module__, model(**batch).logits.tolist()]
    assert not any(m == "fastformer" or m.startswith("fastformer.") for m in sys.modules)
    print(json.dumps(out))
""")


def test_save_pretrained_loads_in_plain_transformers(tmp_path):
    """Save each converted model; a fresh Python with transformers only loads it by its class name and
    gives the unconverted model's logits."""
    paths, want = {}, {}
    for model_type in H.MODEL_TYPES + ("t5", "mt5", "umt5"):  # one of each class name (t5_v1_0's is t5's)
        ref = H.build(model_type)
        model = H.convert(copy.deepcopy(ref))
        model.train()
        model(**H.batch(model_type)).loss  # a training step's forward on the way: nothing saved changes
        path = str(tmp_path / model_type)
        model.save_pretrained(path)
        saved = json.load(open(os.path.join(path, "config.json")))
        name = type(ref).__name__
        assert saved["architectures"] == [name] and "fastformer" not in json.dumps(saved)
        batch = H.batch(model_type)
        batch["decoder_input_ids"] = H.decoder_inputs(ref, batch.pop("labels"))
        torch.save(batch, os.path.join(path, "batch.pt"))
        with torch.no_grad():
            want[name] = ref.eval()(**batch).logits
        paths[name] = path
        # in this process too: the plain class loads every tensor as saved
        loaded = type(ref).from_pretrained(path)
        assert type(loaded) is type(ref) and loaded.config._attn_implementation == "sdpa"
        for (k, a), b in zip(loaded.state_dict().items(), model.state_dict().values()):
            assert torch.equal(a, b), k
        # and from_pretrained + convert: the fused model from the checkpoint gives the same logits
        refused = H.convert(type(ref).from_pretrained(path)).eval()
        with torch.no_grad():
            assert_close(f"{name} logits, loaded and converted", refused(**batch).logits, want[name], 1e-5, 1e-5)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", _LOAD, json.dumps(paths)], capture_output=True, text=True,
                          env=env, cwd=str(tmp_path), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, (module, logits) in got.items():
        assert module.startswith("transformers.models."), module
        assert_close(f"{name} logits", torch.tensor(logits), want[name], 1e-5, 1e-5)
