"""Skipping padding (fastformer.nn.packing): the packed layout's moves, the packed attention and
layers against the padded ones at the real rows, and Seq2SeqTransformer.loss with
``skip_padding`` against the padded computation (loss and every gradient)."""
import pytest
import torch

import fastformer
from fastformer.models import Seq2SeqTransformer
from fastformer.nn import MultiheadAttention, TransformerDecoderLayer, TransformerEncoderLayer
from fastformer.nn.packing import Packing
from seq2seq_models import perturbed_model
from utils import assert_close, kernel_backends

pytestmark = pytest.mark.usefixtures("one_thread_module")  # tiny shapes

BACKENDS = ["reference"] + kernel_backends("cpu")
TOL = {"out": (2e-5, 1e-4), "grad": (5e-5, 5e-4)}
E, H = 24, 3


def padding(lengths, S):
    """(B, S) bool, True after each row's length (rows may be empty)."""
    return torch.arange(S)[None, :] >= torch.tensor(lengths)[:, None]


# ------------------------------------------------------------------------------------- moves
def test_pack_and_unpack_move_the_real_rows_only():
    mask = torch.tensor([[False, False, True, True], [True, False, True, False], [True, True, True, True]])
    packing = Packing(mask)
    assert packing.num_tokens == 4 and not packing.dense
    assert packing.positions.tolist() == [0, 1, 1, 3]
    x = torch.randn(3, 4, 5)
    packed = packing.pack(x)  # (4, 5)
    assert torch.equal(packed, x[~mask])
    back = packing.unpack(packed)
    assert torch.equal(back[~mask], x[~mask]) and torch.equal(back[mask], torch.zeros(int(mask.sum()), 5))
    heads = torch.randn(3, 2, 4, 5).transpose(1, 2)  # a (B, S, H, D) view of (B, H, S, D), not contiguous
    assert torch.equal(packing.pack(heads), heads[~mask])


def test_pack_and_unpack_pass_gradients_to_the_real_rows():
    packing = Packing(padding([2, 3], 3))
    x = torch.randn(2, 3, 4, requires_grad=True)
    w = torch.randn(5, 4)
    (packing.pack(x) @ w.t()).pow(2).sum().backward()
    want = torch.where(~packing.padding_mask[..., None], 2 * (x @ w.t()) @ w, torch.zeros(()))
    assert_close("grad through pack", x.grad, want.detach(), 1e-6, 1e-6)
    y = torch.randn(packing.num_tokens, 4, requires_grad=True)
    g = torch.randn(2, 3, 4)
    packing.unpack(y).backward(g)
    assert torch.equal(y.grad, g[~packing.padding_mask])


def test_without_padding_the_moves_are_views():
    packing = Packing(torch.zeros(2, 3, dtype=torch.bool))
    assert packing.dense and packing.num_tokens == 6
    x = torch.randn(2, 3, 4)
    assert packing.pack(x).data_ptr() == x.data_ptr() and packing.pack(x).shape == (6, 4)
    assert packing.unpack(packing.pack(x)).data_ptr() == x.data_ptr()


@pytest.mark.parametrize("bad", [torch.zeros(2, 3), torch.zeros(6, dtype=torch.bool), "mask"])
def test_a_bad_padding_mask_is_a_clear_error(bad):
    with pytest.raises(ValueError, match="padding_mask must be a \\(B, S\\) bool tensor"):
        Packing(bad)


def test_wrong_shapes_are_clear_errors():
    packing = Packing(padding([1, 2], 2))
    with pytest.raises(ValueError, match="x must have shape \\(B, S, ...\\) = \\(2, 2, ...\\)"):
        packing.pack(torch.randn(2, 3, 4))
    with pytest.raises(ValueError, match="one row per real token, 3"):
        packing.unpack(torch.randn(4, 4))


# ---------------------------------------------------------------------------- packed modules
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["self", "causal", "cross"])
def test_packed_attention_equals_padded_attention_at_the_real_rows(backend, kind):
    torch.manual_seed(0)
    attn = MultiheadAttention(E, H, batch_first=True)
    q_mask, kv_mask = padding([5, 2, 4], 5), padding([3, 0, 6], 6) if kind == "cross" else None
    kv_mask = q_mask if kv_mask is None else kv_mask
    q_packing, kv_packing = Packing(q_mask), Packing(kv_mask)
    x = torch.randn(3, 5, E, requires_grad=True)
    mem = torch.randn(3, kv_mask.shape[1], E, requires_grad=True) if kind == "cross" else x
    causal = kind == "causal"
    with fastformer.use_backend(backend):
        want = attn(x, mem, mem, key_padding_mask=kv_mask, need_weights=False, is_causal=causal,
                    attn_mask=None)[0][~q_mask]
        xp = q_packing.pack(x)
        memp = xp if kind != "cross" else kv_packing.pack(mem)
        got = attn(xp, memp, memp, need_weights=False, is_causal=causal, packing=(q_packing, kv_packing))[0]
    assert got.shape == (q_packing.num_tokens, E)
    assert_close("packed attention", got, want, *TOL["out"])
    g = torch.randn_like(got)
    want_grads = torch.autograd.grad(want, [x, attn.in_proj_weight, attn.out_proj.weight], g)
    got_grads = torch.autograd.grad(got, [x, attn.in_proj_weight, attn.out_proj.weight], g)
    for name, a, b in zip(("input", "in_proj_weight", "out_proj.weight"), got_grads, want_grads):
        assert_close(f"grad {name}", a, b, *TOL["grad"])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("norm_first", [False, True], ids=["post_ln", "pre_ln"])
def test_packed_layers_equal_padded_layers_at_the_real_rows(backend, norm_first):
    torch.manual_seed(0)
    enc = TransformerEncoderLayer(E, H, 40, dropout=0.0, batch_first=True, norm_first=norm_first)
    dec = TransformerDecoderLayer(E, H, 40, dropout=0.0, batch_first=True, norm_first=norm_first)
    src_mask, tgt_mask = padding([6, 3], 6), padding([2, 4], 4)
    src_p, tgt_p = Packing(src_mask), Packing(tgt_mask)
    src, tgt = torch.randn(2, 6, E), torch.randn(2, 4, E)
    with fastformer.use_backend(backend):
        memory = enc(src, src_key_padding_mask=src_mask)
        out = dec(tgt, memory, tgt_key_padding_mask=tgt_mask, memory_key_padding_mask=src_mask, tgt_is_causal=True)
        memory_p = enc(src_p.pack(src), packing=src_p)
        out_p = dec(tgt_p.pack(tgt), memory_p, tgt_is_causal=True, packing=(tgt_p, src_p))
    assert_close("encoder", memory_p, memory[~src_mask], *TOL["out"])
    assert_close("decoder", out_p, out[~tgt_mask], *TOL["out"])


def test_packed_inputs_are_checked():
    enc = TransformerEncoderLayer(E, H, 40, batch_first=True)
    packing = Packing(padding([2, 1], 3))
    with pytest.raises(ValueError, match="one row per real token, 3"):
        enc(torch.randn(4, E), packing=packing)
    with pytest.raises(ValueError, match="src_key_padding_mask must be None with packing"):
        enc(torch.randn(3, E), src_key_padding_mask=packing.padding_mask, packing=packing)
    with pytest.raises(ValueError, match="src must have 2 dimensions"):
        enc(torch.randn(1, 3, E), packing=packing)
    with pytest.raises(TypeError, match="packing must be a fastformer.nn.packing.Packing"):
        enc(torch.randn(3, E), packing=packing.padding_mask)
    with pytest.raises(ValueError, match="need_weights False"):
        enc.self_attn(torch.randn(3, E), torch.randn(3, E), torch.randn(3, E), packing=(packing, packing))


# ------------------------------------------------------------------------------------ the model
def model_and_batch(dropout=0.0, norm_first=False, lengths=((7, 3, 5), (6, 2, 4))):
    g = torch.Generator().manual_seed(1)  # the parameters' moves, then the batch
    model = perturbed_model(17, 19, generator=g, d_model=E, nhead=H, num_encoder_layers=2, num_decoder_layers=2,
                            dim_feedforward=40, dropout=dropout, norm_first=norm_first)
    src_len, tgt_len = lengths
    src = torch.randint(3, 17, (3, 7), generator=g).masked_fill(padding(src_len, 7), 0)
    tgt = torch.randint(3, 19, (3, 7), generator=g).masked_fill(padding(tgt_len, 7), 0)
    tgt[:, 0] = 1
    return model, src, tgt


def loss_and_grads(model, src, tgt, skip_padding, seed=0):
    model.skip_padding = skip_padding
    torch.manual_seed(seed)
    loss = model.loss(src, tgt, label_smoothing=0.1)
    return loss.detach(), torch.autograd.grad(loss, list(model.parameters()))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("norm_first", [False, True], ids=["post_ln", "pre_ln"])
def test_loss_skipping_padding_equals_the_padded_loss(backend, norm_first):
    model, src, tgt = model_and_batch(norm_first=norm_first)
    with fastformer.use_backend(backend):
        got_loss, got = loss_and_grads(model, src, tgt, True)
        want_loss, want = loss_and_grads(model, src, tgt, False)
    assert_close("loss", got_loss, want_loss, *TOL["out"])
    for (name, _), a, b in zip(model.named_parameters(), got, want):
        assert_close(f"grad {name}", a, b, *TOL["grad"])


@pytest.mark.parametrize("backend", BACKENDS)
def test_without_padding_skipping_changes_nothing_even_with_dropout(backend):
    """No padding: the packed rows are the padded rows in the same order, so even the dropout
    masks (drawn over the element order) and thus the loss and gradients are the same bits."""
    model, src, tgt = model_and_batch(dropout=0.2, lengths=((7, 7, 7), (7, 7, 7)))
    with fastformer.use_backend(backend):
        got_loss, got = loss_and_grads(model, src, tgt, True, seed=3)
        want_loss, want = loss_and_grads(model, src, tgt, False, seed=3)
    assert torch.equal(got_loss, want_loss)
    for (name, _), a, b in zip(model.named_parameters(), got, want):
        assert torch.equal(a, b), f"grad {name} differs by {(a - b).abs().max().item():.3e}"


def test_with_dropout_the_packed_loss_is_repeatable_and_trains_every_parameter():
    model, src, tgt = model_and_batch(dropout=0.2)
    first_loss, first = loss_and_grads(model, src, tgt, True, seed=5)
    again_loss, again = loss_and_grads(model, src, tgt, True, seed=5)
    other_loss, _ = loss_and_grads(model, src, tgt, True, seed=6)
    assert torch.equal(first_loss, again_loss) and all(torch.equal(a, b) for a, b in zip(first, again))
    assert not torch.equal(first_loss, other_loss), "another seed must draw other dropout masks"
    for (name, _), g in zip(model.named_parameters(), first):
        assert torch.isfinite(g).all() and g.abs().sum() > 0, f"{name} got no gradient"


def test_skip_padding_must_be_a_bool():
    with pytest.raises(TypeError, match="skip_padding must be a bool"):
        Seq2SeqTransformer(11, 11, d_model=E, nhead=H, skip_padding="yes")
