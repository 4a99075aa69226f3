"""Training a converted Hugging Face model: with dropout it learns a copy task; under bf16 autocast it
stays close to fp32; gradient checkpointing and label smoothing work as in transformers; an activation
fastformer lacks keeps transformers' code with one warning (the transformers versions taken:
test_hf_versions.py)."""
import copy
import sys
import warnings

import pytest

transformers = pytest.importorskip("transformers", reason="the Hugging Face integration tests need transformers")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import fastformer  # noqa: E402
from fastformer.hf import loss as hf_loss  # noqa: E402
import hf_models as H  # noqa: E402
from utils import assert_close  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread_module")  # tiny shapes


def _grad_rel_err(model, ref):
    num = sum(((p.grad - q.grad).double() ** 2).sum() for p, q in zip(model.parameters(), ref.parameters())
              if q.grad is not None)
    den = sum((q.grad.double() ** 2).sum() for q in ref.parameters() if q.grad is not None)
    return (num / den).sqrt().item()


def _assert_same_step(model, ref, batch):
    """One forward + backward of each: the same loss and gradients."""
    got = model(**batch).loss
    got.backward()
    want = ref(**batch).loss
    want.backward()
    assert_close("loss", got, want, 2e-5, 1e-4)
    assert _grad_rel_err(model, ref) < 1e-5


@pytest.mark.parametrize("model_type", ["bart", "mbart"])  # post-LN and pre-LN
def test_dropout_training_learns_a_copy_task(model_type):
    """Dropout 0.1 everywhere (residual, attention, activation): fused dropout is random in training
    (two forwards differ) yet training converges: 60 Adam steps copy 3 tokens of 6."""
    torch.manual_seed(0)
    model = H.convert(H.build(model_type, dropout=0.1, attention_dropout=0.1, activation_dropout=0.1,
                              scale_embedding=False)).train()
    g = torch.Generator().manual_seed(0)
    probe = torch.randint(4, 10, (8, 3), generator=g)
    a, b = (model(input_ids=probe, labels=probe).loss.item() for _ in range(2))
    assert a != b
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(60):
        src = torch.randint(4, 10, (32, 3), generator=g)
        loss = model(input_ids=src, attention_mask=torch.ones_like(src), labels=src).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[0] > 3.0 and sum(losses[-5:]) / 5 < 0.4, losses
    model.eval()
    with torch.no_grad():
        assert model(input_ids=probe, labels=probe).loss.item() < 0.4


@pytest.mark.parametrize("model_type", H.MODEL_TYPES + H.T5_TYPES)
def test_bf16_autocast_is_close_to_fp32(model_type):
    ref = H.build(model_type).train()
    plain = copy.deepcopy(ref)
    model = H.convert(copy.deepcopy(ref))
    batch = H.batch(model_type)
    want = ref(**batch).loss
    want.backward()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = model(**batch).loss
        plain(**batch).loss.backward()
    got.backward()
    # the fused loss comes back in bf16 (resolution 2^-8 relative): 0.03 at a loss of ~4
    assert abs(got.item() - want.item()) < 0.03
    # the gradients: 3% of their norm, or where transformers' own autocast is further from fp32 (T5: unscaled
    # scores, unit-variance embeddings; 2-4%), 3x its distance (the fused residual stream is bf16, its fp32)
    assert _grad_rel_err(model, ref) < max(0.03, 3 * _grad_rel_err(plain, ref))


@pytest.mark.parametrize("model_type", ["bart", "whisper", "t5", "umt5"])
def test_gradient_checkpointing(model_type):
    ref = H.build(model_type).train()
    model = H.convert(copy.deepcopy(ref))
    model.activation_checkpointing_enable()
    layers = [m for n, m in model.named_modules() if n.split(".")[-2:-1] in (["layers"], ["block"])]
    assert layers and all(m.gradient_checkpointing for m in layers)
    _assert_same_step(model, ref, H.batch(model_type))


@pytest.mark.parametrize("model_type", ["marian", "m2m_100", "t5"])
def test_label_smoothing_is_fused(model_type, monkeypatch):
    """convert(model, label_smoothing=0.1): the fused loss equals cross-entropy with smoothing 0.1 over
    the unconverted model's logits, gradients too; in eval mode the (logits') loss is smoothed as well."""
    ref = H.build(model_type).train()
    model = copy.deepcopy(ref)
    H.convert(model, label_smoothing=0.1)
    batch = H.batch(model_type)
    calls, _ = H.count_op_calls(monkeypatch)
    got = model(**batch).loss
    got.backward()
    assert calls["linear_cross_entropy"] == 1
    logits = ref(**batch).logits
    want = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1), label_smoothing=0.1)
    want.backward()
    assert_close("loss", got, want, 2e-5, 1e-4)
    assert _grad_rel_err(model, ref) < 1e-4
    model.eval(), ref.eval()
    with torch.no_grad():
        out, logits = model(**batch), ref(**batch).logits
    assert_close("eval logits", out.logits, logits, 2e-5, 1e-4)
    assert_close("eval loss", out.loss, F.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                        batch["labels"].reshape(-1), label_smoothing=0.1), 2e-5, 1e-4)


def test_trainer_label_smoothing_factor_warns(tmp_path, monkeypatch):
    """A Trainer with label_smoothing_factor > 0 calls the model without labels (and smooths from the
    logits): the fused loss cannot run, and a warning says what to do instead."""
    model = H.convert(H.build("bart"))
    batch = H.batch("bart")
    batch["decoder_input_ids"] = H.decoder_inputs(model, batch["labels"])  # as DataCollatorForSeq2Seq adds
    args = transformers.TrainingArguments(output_dir=str(tmp_path), label_smoothing_factor=0.1, report_to="none",
                                          use_cpu=True)
    trainer = transformers.Trainer(model=model, args=args)
    model.train()
    with pytest.warns(UserWarning, match="label_smoothing_factor=0") as record:
        trainer.compute_loss(model, dict(batch))
    assert "fastformer.convert(model, label_smoothing=0.1)" in str(record[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trainer.compute_loss(model, dict(batch))  # once per model
    # without the Trainer's smoothing, its loss is the fused one
    trainer = transformers.Trainer(model=model, args=transformers.TrainingArguments(
        output_dir=str(tmp_path), report_to="none", use_cpu=True))
    calls, _ = H.count_op_calls(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        trainer.compute_loss(model, dict(batch))
    assert calls["linear_cross_entropy"] == 1
    assert "label_smoothing_factor=0" in hf_loss.SMOOTHING_ADVICE


@pytest.mark.parametrize("name", ["gelu_new", "gelu_pytorch_tanh"])
def test_tanh_gelu_layers_are_fused_as_gelu_tanh(name, monkeypatch):
    """transformers' tanh-approximate GELUs run as feed_forward's "gelu_tanh": every layer fused, no
    warning, the unconverted model's loss and gradients."""
    ref = H.build("bart", activation_function=name).train()
    model = copy.deepcopy(ref)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fastformer.convert(model)
    real, activations = fastformer.ops.feed_forward, []

    def feed_forward(*args, **kwargs):
        activations.append(kwargs.get("activation"))
        return real(*args, **kwargs)
    monkeypatch.setattr(fastformer.ops, "feed_forward", feed_forward)
    _assert_same_step(model, ref, H.batch("bart"))
    assert activations == ["gelu_tanh"] * (model.config.encoder_layers + model.config.decoder_layers)


def test_unknown_activation_keeps_transformers_code_with_one_warning(monkeypatch):
    """quick_gelu (x * sigmoid(1.702 x)) is not fastformer's: its layers keep transformers' forward, with
    one warning naming it however many layers use it; attention and loss are still fused."""
    ref = H.build("bart", activation_function="quick_gelu").train()
    model = copy.deepcopy(ref)
    layer_types = {n: type(m) for n, m in model.named_modules() if n.endswith(tuple(f"layers.{i}" for i in (0, 1)))}
    with pytest.warns(UserWarning) as record:
        fastformer.convert(model)
    mine = [str(w.message) for w in record if "fastformer" in str(w.message)]
    assert len(mine) == 1 and "'quick_gelu'" in mine[0]
    assert all(type(m) is layer_types[n] for n, m in model.named_modules() if n in layer_types)
    batch = H.batch("bart")
    calls, _ = H.count_op_calls(monkeypatch)
    got = model(**batch).loss
    got.backward()
    want = ref(**batch).loss
    want.backward()
    E, L = model.config.encoder_layers, model.config.decoder_layers
    assert dict(calls) == {"attention": E + 2 * L, "linear_cross_entropy": 1}
    assert_close("loss", got, want, 2e-5, 1e-4)
    assert _grad_rel_err(model, ref) < 1e-5


@pytest.mark.parametrize("failure", ["refused", "wrong"])
def test_marian_swish_without_a_silu_kernel_keeps_transformers_code(failure, monkeypatch):
    """A feed_forward that refuses silu (an extension built before it) or disagrees with its reference
    is found out at convert(): Marian's layers keep transformers' code, with one warning naming "swish"."""
    from fastformer.hf import patch

    real = fastformer.ops.feed_forward

    def feed_forward(*args, activation="relu", **kwargs):
        if activation == "silu" and failure == "refused":
            raise RuntimeError('feed_forward_fwd: activation must be "relu" or "gelu", got "silu"')
        out = real(*args, activation=activation, **kwargs)
        return out + 1.0 if activation == "silu" else out

    monkeypatch.setattr(fastformer.ops, "feed_forward", feed_forward)
    monkeypatch.setattr(patch, "_probed", {})
    ref = H.build("marian").train()
    assert ref.config.activation_function == "swish"
    model = copy.deepcopy(ref)
    with pytest.warns(UserWarning) as record:
        fastformer.convert(model)
    mine = [str(w.message) for w in record if "fastformer" in str(w.message)]
    assert len(mine) == 1 and "'swish'" in mine[0] and "'silu'" in mine[0]
    assert not any(n.endswith("layers.0") and type(m).__module__.startswith("fastformer") for n, m in
                   model.named_modules())
    _assert_same_step(model, ref, H.batch("marian"))
