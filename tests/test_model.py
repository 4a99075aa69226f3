"""Seq2SeqTransformer: the whole model against the same computation written with torch.nn modules,
its masks (padding never leaks, the future never leaks), its fused loss against F.cross_entropy,
tying/sharing, initialisation, positional encoding, errors; and the Noam schedule."""
import math

import pytest
import torch
import torch.nn.functional as F

import fastformer
from fastformer.models import Seq2SeqTransformer
from fastformer.optim import NoamScheduler, make_optimizer, noam_lambda
from seq2seq_models import perturbed_model
from utils import assert_close

pytestmark = pytest.mark.usefixtures("one_thread_module")  # tiny shapes

BACKENDS = ["reference", "auto"]
TOL = {"reference": {"out": (5e-5, 1e-4), "grad": (1e-4, 1e-4)},
       "auto": {"out": (1e-4, 1e-3), "grad": (5e-4, 1e-3)}}
PAD, BOS, EOS = 0, 1, 2
SRC_V, TGT_V, D, NHEAD, FF = 23, 19, 32, 4, 48


def make_model(seed=0, **kwargs):
    args = dict(d_model=D, nhead=NHEAD, num_encoder_layers=2, num_decoder_layers=2, dim_feedforward=FF,
                dropout=0.0)
    args.update(kwargs)
    return perturbed_model(SRC_V, TGT_V, seed=seed, **args)


def batch(B=3, Ss=9, St=7, seed=0, src_lengths=(9, 6, 2), tgt_lengths=(7, 4, 5)):
    """Right-padded source and target ids; targets start with bos and end with eos."""
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(3, SRC_V, (B, Ss), generator=g)
    tgt = torch.randint(3, TGT_V, (B, St), generator=g)
    tgt[:, 0] = BOS
    for i in range(B):
        src[i, src_lengths[i]:] = PAD
        tgt[i, tgt_lengths[i] - 1] = EOS
        tgt[i, tgt_lengths[i]:] = PAD
    return src, tgt


def sinusoid(length, d):
    """The paper's table, element by element."""
    pe = torch.zeros(length, d)
    for pos in range(length):
        for i in range(d):
            angle = pos / 10000 ** ((i - i % 2) / d)
            pe[pos, i] = math.sin(angle) if i % 2 == 0 else math.cos(angle)
    return pe


def torch_logits(model, src, tgt, norm_first):
    """The model's computation written with torch.nn's own modules and the model's weights."""
    N = len(model.encoder.layers)
    enc = torch.nn.TransformerEncoder(
        torch.nn.TransformerEncoderLayer(D, NHEAD, FF, dropout=0.0, batch_first=True, norm_first=norm_first),
        N, torch.nn.LayerNorm(D) if norm_first else None, enable_nested_tensor=False)
    dec = torch.nn.TransformerDecoder(
        torch.nn.TransformerDecoderLayer(D, NHEAD, FF, dropout=0.0, batch_first=True, norm_first=norm_first),
        N, torch.nn.LayerNorm(D) if norm_first else None)
    enc.load_state_dict(model.encoder.state_dict())
    dec.load_state_dict(model.decoder.state_dict())
    pe = sinusoid(max(src.shape[1], tgt.shape[1]), D)
    x = F.embedding(src, model.src_embed.weight) * math.sqrt(D) + pe[:src.shape[1]]
    memory = enc(x, src_key_padding_mask=src == PAD)
    y = F.embedding(tgt, model.tgt_embed.weight) * math.sqrt(D) + pe[:tgt.shape[1]]
    causal = torch.ones(tgt.shape[1], tgt.shape[1], dtype=torch.bool).triu(1)
    h = dec(y, memory, tgt_mask=causal, tgt_key_padding_mask=tgt == PAD, memory_key_padding_mask=src == PAD)
    return F.linear(h, model.output_proj.weight)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("norm_first", [False, True], ids=["post_ln", "pre_ln"])
def test_forward_equals_torch_modules(backend, norm_first):
    model = make_model(norm_first=norm_first)
    src, tgt = batch()
    with fastformer.use_backend(backend):
        logits = model(src, tgt)
    assert logits.shape == (3, 7, TGT_V)
    assert (model.encoder.norm is not None) == norm_first and (model.decoder.norm is not None) == norm_first
    real = tgt != PAD  # padding is skipped: zero logits there, the torch modules' logits elsewhere
    want = torch_logits(model, src, tgt, norm_first)
    assert_close("logits", logits[real], want[real], *TOL[backend]["out"])
    assert not logits[~real].any() and (~real).any()
    model.skip_padding = False  # every position computed, padded ones included
    with fastformer.use_backend(backend):
        assert_close("logits", model(src, tgt), want, *TOL[backend]["out"])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_loss_equals_cross_entropy_on_the_logits(backend, label_smoothing):
    src, tgt = batch()
    model = make_model(activation="gelu")
    model.zero_grad()
    with fastformer.use_backend(backend):
        loss = model.loss(src, tgt, label_smoothing=label_smoothing)
        loss.backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    logits = model(src, tgt[:, :-1])
    want = F.cross_entropy(logits.reshape(-1, TGT_V), tgt[:, 1:].reshape(-1), ignore_index=PAD,
                           label_smoothing=label_smoothing)
    want.backward()
    assert_close("loss", loss, want, *TOL[backend]["out"])
    for n, p in model.named_parameters():
        assert_close(f"grad {n}", got[n], p.grad, *TOL[backend]["grad"])


def test_loss_never_materialises_full_logits(monkeypatch):
    """loss() goes through linear_cross_entropy, never through the output projection module."""
    model = make_model()
    src, tgt = batch()
    called = []
    model.output_proj.register_forward_hook(lambda *a: called.append(1))
    lce = fastformer.ops.linear_cross_entropy
    monkeypatch.setattr(fastformer.ops, "linear_cross_entropy", lambda *a, **k: called.append("lce") or lce(*a, **k))
    model.loss(src, tgt)
    assert called == ["lce"]


def test_padding_does_not_leak():
    model = make_model()
    src, tgt = batch()
    logits = model(src, tgt)
    for i, n in enumerate((9, 6, 2)):  # each row alone, without its padding
        alone = model(src[i:i + 1, :n], tgt[i:i + 1])
        assert_close(f"row {i} alone", logits[i:i + 1], alone, 2e-5, 1e-4)
    more_pad = torch.cat([src, torch.full((3, 4), PAD)], dim=1)
    assert_close("extra pad columns", model(more_pad, tgt), logits, 2e-5, 1e-4)


def test_future_targets_do_not_change_earlier_logits():
    model = make_model(norm_first=True)
    src, tgt = batch(tgt_lengths=(7, 7, 7))
    logits = model(src, tgt)
    changed = tgt.clone()
    changed[:, 4:] = torch.randint(3, TGT_V, (3, 3))
    changed_logits = model(src, changed)
    assert_close("positions before 4", changed_logits[:, :4], logits[:, :4], 1e-6, 1e-6)
    assert not torch.allclose(changed_logits[:, 4:], logits[:, 4:])


def test_tying_and_sharing():
    model = Seq2SeqTransformer(SRC_V, TGT_V, d_model=D, nhead=NHEAD, num_encoder_layers=1, num_decoder_layers=1)
    assert model.output_proj.weight is model.tgt_embed.weight and model.src_embed is not model.tgt_embed
    untied = Seq2SeqTransformer(SRC_V, TGT_V, d_model=D, nhead=NHEAD, num_encoder_layers=1, num_decoder_layers=1,
                                tie_output=False)
    assert untied.output_proj.weight is not untied.tgt_embed.weight
    shared = Seq2SeqTransformer(SRC_V, SRC_V, d_model=D, nhead=NHEAD, num_encoder_layers=1, num_decoder_layers=1,
                                share_embeddings=True)
    assert shared.src_embed is shared.tgt_embed and shared.output_proj.weight is shared.src_embed.weight
    assert len(list(shared.parameters())) == len(list(untied.parameters())) - 2


def test_initialisation():
    d = 64
    torch.manual_seed(0)
    model = Seq2SeqTransformer(1000, 1000, d_model=d, nhead=4, num_encoder_layers=2, num_decoder_layers=2,
                               dim_feedforward=256, tie_output=False)
    for emb in (model.src_embed, model.tgt_embed):
        assert abs(emb.weight.std().item() - d ** -0.5) < 0.05 * d ** -0.5
        assert abs(emb.weight.mean().item()) < 0.01
    for name, p in model.named_parameters():
        if "embed" in name:
            continue
        if "norm" in name:
            assert torch.all(p == (1.0 if name.endswith("weight") else 0.0)), name
        elif p.dim() == 1:
            assert torch.all(p == 0), f"{name}: biases start at 0"
        else:
            bound = math.sqrt(6.0 / (p.shape[0] + p.shape[1]))
            assert p.abs().max() <= bound, f"{name} exceeds the Xavier bound"
            assert abs(p.std().item() - bound / math.sqrt(3)) < 0.1 * bound / math.sqrt(3), name


def test_positional_encoding_any_length():
    pe = fastformer.models.SinusoidalPositionalEncoding(D, max_len=4)
    assert_close("table", pe(30), sinusoid(30, D), 1e-5, 1e-5)
    assert_close("offset", pe(3, offset=40), sinusoid(43, D)[40:], 1e-5, 1e-5)
    odd = fastformer.models.SinusoidalPositionalEncoding(7, max_len=2)
    assert_close("odd d_model", odd(5), sinusoid(5, 7), 1e-5, 1e-5)
    small = make_model(max_len=3)
    big = make_model(max_len=1024)
    assert "positional.table" not in big.state_dict()
    src, tgt = batch()
    assert_close("grown buffer", small(src, tgt), big(src, tgt), 1e-6, 1e-6)


def test_embeddings_are_scaled_and_dropout_only_in_training():
    model = make_model(dropout=0.3)
    tokens = torch.tensor([[5, 7, 9]])
    model.eval()
    want = model.src_embed.weight[tokens] * math.sqrt(D) + sinusoid(3, D)
    assert_close("scaled embedding + PE", model.embed(model.src_embed, tokens), want, 1e-5, 1e-5)
    src, tgt = batch()
    assert torch.equal(model(src, tgt), model(src, tgt))
    model.train()
    assert not torch.allclose(model(src, tgt), model(src, tgt))


def test_bad_arguments_are_clear_errors():
    with pytest.raises(ValueError, match="share_embeddings"):
        Seq2SeqTransformer(10, 12, d_model=D, nhead=NHEAD, share_embeddings=True)
    with pytest.raises(ValueError, match="distinct"):
        Seq2SeqTransformer(10, 12, d_model=D, nhead=NHEAD, bos_idx=0)
    with pytest.raises(ValueError, match="eos_idx"):
        Seq2SeqTransformer(10, 12, d_model=D, nhead=NHEAD, eos_idx=11)
    model = make_model()
    src, tgt = batch()
    with pytest.raises(ValueError, match="src"):
        model(src[0], tgt)
    with pytest.raises(TypeError, match="tgt"):
        model(src, tgt.float())
    with pytest.raises(ValueError, match="batch size"):
        model(src, tgt[:2])
    with pytest.raises(ValueError, match="tgt"):
        model.loss(src, tgt[:, :1])


# ------------------------------------------------------------------------------------ Noam
def noam(step, d_model, warmup):
    return d_model ** -0.5 * min(step ** -0.5, step * warmup ** -1.5)


def test_noam_lambda_against_the_formula():
    f = noam_lambda(512, 4000)
    for step in (1, 2, 100, 3999, 4000, 4001, 100_000):
        assert f(step - 1) == pytest.approx(noam(step, 512, 4000), rel=1e-12)
    assert max(range(1, 10_000), key=lambda s: f(s - 1)) == 4000  # the peak is at the end of warm-up


def test_noam_scheduler_sets_the_lr_of_each_step():
    model = torch.nn.Linear(4, 4)
    opt = make_optimizer(model)
    assert opt.defaults["betas"] == (0.9, 0.98) and opt.defaults["eps"] == 1e-9
    sched = NoamScheduler(opt, d_model=64, warmup=10, factor=2.0)
    used = []
    for _ in range(25):
        used.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    for step, lr in enumerate(used, start=1):
        assert lr == pytest.approx(2.0 * noam(step, 64, 10), rel=1e-12)

    state = sched.state_dict()
    opt2 = make_optimizer(torch.nn.Linear(4, 4))
    sched2 = NoamScheduler(opt2, d_model=64, warmup=10, factor=2.0)
    sched2.load_state_dict(state)
    assert sched2.last_epoch == 25
    opt2.step()
    sched2.step()
    assert opt2.param_groups[0]["lr"] == pytest.approx(2.0 * noam(27, 64, 10), rel=1e-12)
    with pytest.raises(ValueError, match="warmup"):
        noam_lambda(64, 0)


def test_public_names_and_no_triton_at_import():
    assert fastformer.Seq2SeqTransformer is Seq2SeqTransformer
    assert callable(fastformer.convert) and fastformer.nn.Transformer and fastformer.optim.NoamScheduler
    assert fastformer.models.Seq2SeqTransformer is Seq2SeqTransformer
    import subprocess
    import sys
    code = ("import sys, fastformer; bad = [m for m in sys.modules if m.split('.')[0] in ('triton', 'triton_kernels') "
            "or m.startswith('fastformer.triton_kernels')]; "
            "print(bad); sys.exit(1 if bad else 0)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"import fastformer imported {done.stdout.strip()} {done.stderr[-500:]}"
