"""fastformer.nn twins against the torch.nn originals: same initialisation, outputs and every
gradient (fp32, dropout off) for masks, causal hints, layouts, pre/post-LN, activations and
whole stacks; state_dicts that move both ways; attention weights; one fused op per block."""
import pytest
import torch
import torch.nn.functional as F

import fastformer
from fastformer import nn as fnn
from utils import assert_close

# torch's own modules warn about mask types and nested tensors; the twins do not.
pytestmark = [pytest.mark.filterwarnings("ignore:Support for mismatched:UserWarning"),
              pytest.mark.filterwarnings("ignore:enable_nested_tensor is True:UserWarning"),
              pytest.mark.usefixtures("one_thread_module")]  # tiny shapes

# Every twin runs on the reference backend and on whatever "auto" picks here (the C++ CPU
# kernels once built). fp32 tolerances (atol, rtol) for outputs and for gradients.
BACKENDS = ["reference", "auto"]
TOL = {
    "reference": {"out": (2e-5, 1e-4), "grad": (5e-5, 1e-4)},
    "auto": {"out": (5e-5, 1e-4), "grad": (2e-4, 1e-3)},
}


def twins(torch_cls, twin_cls, *args, seed=0, **kwargs):
    """torch's module and fastformer's twin, each built right after torch.manual_seed(seed)."""
    torch.manual_seed(seed)
    ref = torch_cls(*args, **kwargs)
    torch.manual_seed(seed)
    twin = twin_cls(*args, **kwargs)
    ref_sd, twin_sd = ref.state_dict(), twin.state_dict()
    assert list(ref_sd) == list(twin_sd), "state_dict keys differ"
    for key in ref_sd:
        assert torch.equal(ref_sd[key], twin_sd[key]), f"{key}: the twin's initial value differs from torch's"
    perturb(ref, seed + 100)
    perturb(twin, seed + 100)
    return ref, twin


def perturb(module, seed):
    """Move every parameter off its initial value (zero biases, unit norms, cloned layers), the
    same way for torch's module and the twin, so that a swapped or ignored parameter shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))


def outputs_and_grads(module, fn, inputs):
    """fn(module, *inputs)'s outputs, the gradients of every parameter and floating input."""
    xs = [x.detach().clone().requires_grad_() for x in inputs]
    module.zero_grad(set_to_none=True)
    outs = fn(module, *xs)
    outs = [o for o in (outs if isinstance(outs, tuple) else (outs,)) if o is not None]
    g = torch.Generator().manual_seed(1234)
    loss = sum((o * torch.randn(o.shape, generator=g)).sum() for o in outs)
    loss.backward()
    grads = {name: p.grad for name, p in module.named_parameters()}
    grads.update({f"input{i}": x.grad for i, x in enumerate(xs)})
    return [o.detach() for o in outs], grads


def check_same(ref, twin, fn, inputs, backend):
    """Outputs and all gradients of the twin (on ``backend``) equal torch's."""
    want_out, want_grads = outputs_and_grads(ref, fn, inputs)
    with fastformer.use_backend(backend):
        got_out, got_grads = outputs_and_grads(twin, fn, inputs)
    assert len(got_out) == len(want_out)
    for i, (a, b) in enumerate(zip(got_out, want_out)):
        assert torch.isfinite(b).all(), "the torch output itself is not finite: bad test case"
        assert_close(f"output {i}", a, b, *TOL[backend]["out"])
    assert set(got_grads) == set(want_grads)
    for name, want in want_grads.items():
        got = got_grads[name]
        assert (got is None) == (want is None), f"{name}: gradient presence differs"
        if want is not None:
            assert_close(f"grad {name}", got, want, *TOL[backend]["grad"])


def right_padding(B, S, lengths):
    """(B, S) bool key padding mask, True after each row's length."""
    return torch.arange(S)[None, :] >= torch.tensor(lengths)[:, None]


def causal_float(S):
    return torch.nn.Transformer.generate_square_subsequent_mask(S)


def as_layout(x, batch_first):
    """(B, S, E) test tensors -> the layout a module with ``batch_first`` expects."""
    return x if batch_first else x.transpose(0, 1).contiguous()


# ----------------------------------------------------------------------------- MultiheadAttention
B, L, S, E, H = 3, 7, 5, 24, 3  # head dim 8; query length 7 vs key length 5 for cross-attention

MHA_MASKS = {
    "none": lambda: dict(),
    "kpm_bool": lambda: dict(key_padding_mask=right_padding(B, S, [5, 3, 1])),
    "kpm_float": lambda: dict(key_padding_mask=torch.where(right_padding(B, S, [5, 2, 4]), float("-inf"), 0.0)),
    "attn_bool_2d": lambda: dict(attn_mask=torch.rand(L, S) < 0.3 * (torch.arange(S) > 0)),
    "attn_float_2d": lambda: dict(attn_mask=torch.randn(L, S)),
    "attn_float_3d": lambda: dict(attn_mask=torch.randn(B * H, L, S)),
    "attn_bool_3d_and_kpm": lambda: dict(attn_mask=torch.rand(B * H, L, S) < 0.3 * (torch.arange(S) > 0),
                                         key_padding_mask=right_padding(B, S, [5, 4, 2])),
    "attn_float_and_kpm_bool": lambda: dict(attn_mask=torch.randn(L, S),
                                            key_padding_mask=right_padding(B, S, [2, 5, 3])),
    "attn_float_and_kpm_float": lambda: dict(attn_mask=torch.randn(B * H, L, S), key_padding_mask=torch.where(
        right_padding(B, S, [1, 5, 3]), float("-inf"), torch.randn(B, S))),
    "attn_bool_and_kpm_float": lambda: dict(attn_mask=torch.rand(L, S) < 0.3 * (torch.arange(S) > 0),
                                            key_padding_mask=torch.randn(B, S)),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("batch_first", [True, False], ids=["batch_first", "seq_first"])
@pytest.mark.parametrize("masks", list(MHA_MASKS))
def test_mha_cross_attention_masks(backend, batch_first, masks):
    ref, twin = twins(torch.nn.MultiheadAttention, fnn.MultiheadAttention, E, H, batch_first=batch_first)
    kw = MHA_MASKS[masks]()
    q, kv = torch.randn(B, L, E), torch.randn(B, S, E)

    def fn(m, q, kv):
        return m(q, kv, kv, need_weights=False, **kw)[0]
    check_same(ref, twin, fn, [as_layout(q, batch_first), as_layout(kv, batch_first)], backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("batch_first", [True, False], ids=["batch_first", "seq_first"])
@pytest.mark.parametrize("mode", ["is_causal_hint_float", "is_causal_hint_bool", "explicit_float",
                                  "explicit_bool", "hint_with_kpm"])
def test_mha_self_attention_causal(backend, batch_first, mode):
    T = 7
    ref, twin = twins(torch.nn.MultiheadAttention, fnn.MultiheadAttention, E, H, batch_first=batch_first)
    mask = causal_float(T) if "float" in mode or mode == "hint_with_kpm" else causal_float(T).isinf()
    kw = dict(attn_mask=mask, is_causal=mode.startswith("is_causal") or mode == "hint_with_kpm")
    if mode == "hint_with_kpm":
        kw["key_padding_mask"] = right_padding(B, T, [7, 4, 1])

    def fn(m, x):
        return m(x, x, x, need_weights=False, **kw)[0]
    check_same(ref, twin, fn, [as_layout(torch.randn(B, T, E), batch_first)], backend)


def test_mha_is_causal_without_mask_is_the_causal_mask():
    """torch requires a mask with is_causal; the twin accepts the hint alone."""
    torch.manual_seed(0)
    m = fnn.MultiheadAttention(E, H, batch_first=True)
    x = torch.randn(B, 6, E)
    a = m(x, x, x, need_weights=False, is_causal=True)[0]
    b = m(x, x, x, need_weights=False, attn_mask=causal_float(6))[0]
    assert_close("is_causal alone", a, b, 1e-6, 1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("config", ["kdim_vdim", "no_bias", "bias_kv", "zero_attn", "bias_kv_zero_attn_kpm"])
def test_mha_constructor_options(backend, config):
    kwargs = {"kdim_vdim": dict(kdim=10, vdim=14), "no_bias": dict(bias=False),
              "bias_kv": dict(add_bias_kv=True), "zero_attn": dict(add_zero_attn=True),
              "bias_kv_zero_attn_kpm": dict(add_bias_kv=True, add_zero_attn=True)}[config]
    ref, twin = twins(torch.nn.MultiheadAttention, fnn.MultiheadAttention, E, H, batch_first=True, **kwargs)
    kdim, vdim = kwargs.get("kdim", E), kwargs.get("vdim", E)
    kw = dict(key_padding_mask=right_padding(B, S, [5, 1, 3])) if "kpm" in config else {}
    if config in ("bias_kv", "zero_attn"):
        kw["attn_mask"] = torch.randn(L, S)

    def fn(m, q, k, v):
        return m(q, k, v, need_weights=False, **kw)[0]
    check_same(ref, twin, fn, [torch.randn(B, L, E), torch.randn(B, S, kdim), torch.randn(B, S, vdim)], backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_mha_unbatched(backend):
    ref, twin = twins(torch.nn.MultiheadAttention, fnn.MultiheadAttention, E, H)
    kpm = right_padding(1, S, [3])[0]

    def fn(m, q, kv):
        return m(q, kv, kv, key_padding_mask=kpm, need_weights=False)[0]
    check_same(ref, twin, fn, [torch.randn(L, E), torch.randn(S, E)], backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("average", [True, False], ids=["averaged", "per_head"])
@pytest.mark.parametrize("masks", ["none", "attn_float_and_kpm_bool", "attn_bool_3d_and_kpm"])
def test_mha_need_weights(backend, average, masks):
    ref, twin = twins(torch.nn.MultiheadAttention, fnn.MultiheadAttention, E, H, batch_first=True)
    kw = MHA_MASKS[masks]()

    def fn(m, q, kv):
        return m(q, kv, kv, need_weights=True, average_attn_weights=average, **kw)
    out, w = fn(twin, torch.randn(B, L, E), torch.randn(B, S, E))
    assert w.shape == ((B, L, S) if average else (B, H, L, S))
    check_same(ref, twin, fn, [torch.randn(B, L, E), torch.randn(B, S, E)], backend)


def test_mha_need_weights_with_dropout_returns_the_weights_used():
    """In training with dropout the returned (dropped-out) weights are exactly the ones applied."""
    torch.manual_seed(0)
    m = fnn.MultiheadAttention(E, H, dropout=0.5, batch_first=True)
    q, kv = torch.randn(B, L, E), torch.randn(B, S, E)
    out, w = m(q, kv, kv, need_weights=True, average_attn_weights=False)  # (B, H, L, S)
    assert (w == 0).any(), "dropout 0.5 dropped nothing"
    v = F.linear(kv, m.in_proj_weight[2 * E:], m.in_proj_bias[2 * E:]).view(B, S, H, E // H).transpose(1, 2)
    heads = torch.matmul(w, v).transpose(1, 2).reshape(B, L, E)
    assert_close("output from returned weights", out, m.out_proj(heads), 1e-5, 1e-5)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_mha_need_weights_drops_what_the_fused_op_drops(backend):
    """With the same generator state the weights path (dropout applied to returned weights) and the
    fused op drop the same probabilities: the output is the same either way."""
    m = fnn.MultiheadAttention(E, H, dropout=0.3, batch_first=True)
    q, kv = torch.randn(B, L, E), torch.randn(B, S, E)
    with fastformer.use_backend(backend):
        torch.manual_seed(5)
        with_weights = m(q, kv, kv, need_weights=True)[0]
        torch.manual_seed(5)
        fused = m(q, kv, kv, need_weights=False)[0]
        torch.manual_seed(6)
        other = m(q, kv, kv, need_weights=False)[0]
    assert_close("output, weights path vs fused", with_weights, fused, 1e-5, 1e-5)
    assert not torch.allclose(fused, other), "another seed dropped the same probabilities"


def test_mha_errors_name_the_argument():
    m = fnn.MultiheadAttention(E, H, batch_first=True)
    q = torch.randn(B, L, E)
    with pytest.raises(ValueError, match="attn_mask"):
        m(q, q, q, attn_mask=torch.zeros(L, L + 1))
    with pytest.raises(ValueError, match="key_padding_mask"):
        m(q, q, q, key_padding_mask=torch.zeros(B, L + 1, dtype=torch.bool))
    with pytest.raises(TypeError, match="attn_mask"):
        m(q, q, q, attn_mask=torch.zeros(L, L, dtype=torch.int32))
    with pytest.raises(ValueError, match="embed_dim"):
        m(torch.randn(B, L, E + 1), q, q)


# ------------------------------------------------------------------------------------- layers
D_MODEL, NHEAD, FF = 32, 4, 48


def _layer_matrix(masks):
    """The layer tests' matrix: every backend, post- and pre-LN, ReLU and GELU, batch- and
    sequence-first, and the given ``masks`` cases."""
    marks = [pytest.mark.parametrize("masks", masks),
             pytest.mark.parametrize("batch_first", [True, False], ids=["batch_first", "seq_first"]),
             pytest.mark.parametrize("activation", ["relu", "gelu"]),
             pytest.mark.parametrize("norm_first", [False, True], ids=["post_ln", "pre_ln"]),
             pytest.mark.parametrize("backend", BACKENDS)]

    def decorate(test):
        for mark in marks:
            test = mark(test)
        return test
    return decorate


@_layer_matrix(masks=["kpm", "causal_hint_and_kpm", "float_mask"])
def test_encoder_layer(backend, norm_first, activation, batch_first, masks):
    ref, twin = twins(torch.nn.TransformerEncoderLayer, fnn.TransformerEncoderLayer, D_MODEL, NHEAD, FF,
                      dropout=0.0, activation=activation, batch_first=batch_first, norm_first=norm_first)
    T = 7
    kw = {"kpm": dict(src_key_padding_mask=right_padding(B, T, [7, 5, 2])),
          "causal_hint_and_kpm": dict(src_mask=causal_float(T), is_causal=True,
                                      src_key_padding_mask=right_padding(B, T, [7, 3, 6])),
          "float_mask": dict(src_mask=torch.randn(T, T))}[masks]

    def fn(m, x):
        return m(x, **kw)
    check_same(ref, twin, fn, [as_layout(torch.randn(B, T, D_MODEL), batch_first)], backend)


@_layer_matrix(masks=["causal_hint_paddings", "explicit_bool_causal", "memory_float_mask"])
def test_decoder_layer(backend, norm_first, activation, batch_first, masks):
    ref, twin = twins(torch.nn.TransformerDecoderLayer, fnn.TransformerDecoderLayer, D_MODEL, NHEAD, FF,
                      dropout=0.0, activation=activation, batch_first=batch_first, norm_first=norm_first)
    T, Sm = 6, 9
    kw = {"causal_hint_paddings": dict(tgt_mask=causal_float(T), tgt_is_causal=True,
                                       tgt_key_padding_mask=right_padding(B, T, [6, 2, 4]),
                                       memory_key_padding_mask=right_padding(B, Sm, [9, 1, 5])),
          "explicit_bool_causal": dict(tgt_mask=causal_float(T).isinf(),
                                       memory_key_padding_mask=right_padding(B, Sm, [3, 9, 8])),
          "memory_float_mask": dict(tgt_mask=causal_float(T), memory_mask=torch.randn(T, Sm))}[masks]

    def fn(m, x, mem):
        return m(x, mem, **kw)
    check_same(ref, twin, fn, [as_layout(torch.randn(B, T, D_MODEL), batch_first),
                               as_layout(torch.randn(B, Sm, D_MODEL), batch_first)], backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("norm_first", [False, True], ids=["post_ln", "pre_ln"])
@pytest.mark.parametrize("final_norm", [True, False], ids=["final_norm", "no_final_norm"])
@pytest.mark.parametrize("causal", ["detected", "none"])
def test_encoder_stack(backend, norm_first, final_norm, causal):
    def build(layer_cls, stack_cls, norm_cls):
        torch.manual_seed(0)
        layer = layer_cls(D_MODEL, NHEAD, FF, dropout=0.0, batch_first=True, norm_first=norm_first)
        stack = stack_cls(layer, 3, norm_cls(D_MODEL) if final_norm else None, enable_nested_tensor=False)
        perturb(stack, 1)
        return stack
    ref = build(torch.nn.TransformerEncoderLayer, torch.nn.TransformerEncoder, torch.nn.LayerNorm)
    twin = build(fnn.TransformerEncoderLayer, fnn.TransformerEncoder, fnn.LayerNorm)
    T = 8
    kw = dict(src_key_padding_mask=right_padding(B, T, [8, 6, 1]))
    if causal == "detected":  # is_causal=None: both detect the causal float mask
        kw["mask"] = causal_float(T)

    def fn(m, x):
        return m(x, **kw)
    check_same(ref, twin, fn, [torch.randn(B, T, D_MODEL)], backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("norm_first", [False, True], ids=["post_ln", "pre_ln"])
@pytest.mark.parametrize("final_norm", [True, False], ids=["final_norm", "no_final_norm"])
def test_decoder_stack(backend, norm_first, final_norm):
    def build(layer_cls, stack_cls, norm_cls):
        torch.manual_seed(0)
        layer = layer_cls(D_MODEL, NHEAD, FF, dropout=0.0, batch_first=False, norm_first=norm_first,
                          activation="gelu")
        stack = stack_cls(layer, 2, norm_cls(D_MODEL) if final_norm else None)
        perturb(stack, 2)
        return stack
    ref = build(torch.nn.TransformerDecoderLayer, torch.nn.TransformerDecoder, torch.nn.LayerNorm)
    twin = build(fnn.TransformerDecoderLayer, fnn.TransformerDecoder, fnn.LayerNorm)
    T, Sm = 5, 7
    kw = dict(tgt_mask=causal_float(T), tgt_key_padding_mask=right_padding(B, T, [5, 5, 2]),
              memory_key_padding_mask=right_padding(B, Sm, [7, 2, 4]))

    def fn(m, x, mem):
        return m(x, mem, **kw)
    check_same(ref, twin, fn, [torch.randn(T, B, D_MODEL), torch.randn(Sm, B, D_MODEL)], backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("norm_first", [False, True], ids=["post_ln", "pre_ln"])
@pytest.mark.parametrize("batch_first", [True, False], ids=["batch_first", "seq_first"])
def test_transformer(backend, norm_first, batch_first):
    ref, twin = twins(torch.nn.Transformer, fnn.Transformer, D_MODEL, NHEAD, 2, 2, FF, dropout=0.0,
                      batch_first=batch_first, norm_first=norm_first)
    Ss, St = 7, 5
    kw = dict(tgt_mask=causal_float(St), src_key_padding_mask=right_padding(B, Ss, [7, 4, 6]),
              memory_key_padding_mask=right_padding(B, Ss, [7, 4, 6]),
              tgt_key_padding_mask=right_padding(B, St, [5, 3, 1]))

    def fn(m, src, tgt):
        return m(src, tgt, **kw)
    check_same(ref, twin, fn, [as_layout(torch.randn(B, Ss, D_MODEL), batch_first),
                               as_layout(torch.randn(B, St, D_MODEL), batch_first)], backend)


def test_twins_are_torch_subclasses_with_twin_children():
    t = fnn.Transformer(D_MODEL, NHEAD, 1, 1, FF)
    assert isinstance(t, torch.nn.Transformer)
    kinds = {type(m) for m in t.modules()}
    for torch_cls in (torch.nn.MultiheadAttention, torch.nn.LayerNorm, torch.nn.TransformerEncoderLayer,
                      torch.nn.TransformerDecoderLayer, torch.nn.TransformerEncoder, torch.nn.TransformerDecoder):
        assert torch_cls not in kinds, f"a plain {torch_cls.__name__} was left inside fastformer.nn.Transformer"
    assert fnn.MultiheadAttention in kinds and fnn.LayerNorm in kinds


# ------------------------------------------------------------------------------ state_dict
def test_state_dict_moves_both_ways():
    torch.manual_seed(1)
    ref = torch.nn.Transformer(D_MODEL, NHEAD, 2, 2, FF, dropout=0.0, batch_first=True)
    torch.manual_seed(2)
    twin = fnn.Transformer(D_MODEL, NHEAD, 2, 2, FF, dropout=0.0, batch_first=True)
    src, tgt = torch.randn(2, 6, D_MODEL), torch.randn(2, 4, D_MODEL)
    assert not torch.allclose(ref(src, tgt), twin(src, tgt)), "different seeds should differ before loading"
    twin.load_state_dict(ref.state_dict(), strict=True)
    assert_close("torch -> twin", twin(src, tgt), ref(src, tgt), 2e-5, 1e-4)

    torch.manual_seed(3)
    twin2 = fnn.Transformer(D_MODEL, NHEAD, 2, 2, FF, dropout=0.0, batch_first=True)
    ref.load_state_dict(twin2.state_dict(), strict=True)
    assert_close("twin -> torch", ref(src, tgt), twin2(src, tgt), 2e-5, 1e-4)


# ------------------------------------------------------------------------------- LayerNorm
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("config", ["default", "two_dims", "no_affine", "no_bias"])
def test_layer_norm(backend, config):
    shape, kwargs = {"default": (23, {}), "two_dims": ((3, 5), {}), "no_affine": (23, dict(elementwise_affine=False)),
                     "no_bias": (23, dict(bias=False))}[config]
    ref, twin = twins(torch.nn.LayerNorm, fnn.LayerNorm, shape, **kwargs)
    x = torch.randn(4, 6, *((3, 5) if config == "two_dims" else (23,)))
    check_same(ref, twin, lambda m, x: m(x), [x], backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("config", ["default", "two_dims", "no_affine", "default_eps"])
def test_rms_norm(backend, config):
    """The RMSNorm twin (add_layer_norm's rms_norm) against torch.nn.RMSNorm."""
    shape, kwargs = {"default": (23, dict(eps=1e-6)), "two_dims": ((3, 5), dict(eps=1e-5)),
                     "no_affine": (23, dict(eps=1e-6, elementwise_affine=False)), "default_eps": (23, {})}[config]
    ref, twin = twins(torch.nn.RMSNorm, fnn.RMSNorm, shape, **kwargs)
    x = torch.randn(4, 6, *((3, 5) if config == "two_dims" else (23,)))
    check_same(ref, twin, lambda m, x: m(x), [x], backend)


# -------------------------------------------------------------------------- training mode
def test_dropout_only_in_training():
    torch.manual_seed(0)
    ref = torch.nn.TransformerEncoderLayer(D_MODEL, NHEAD, FF, dropout=0.3, batch_first=True)
    twin = fnn.TransformerEncoderLayer(D_MODEL, NHEAD, FF, dropout=0.3, batch_first=True)
    twin.load_state_dict(ref.state_dict())
    x = torch.randn(B, 6, D_MODEL, requires_grad=True)  # requires grad: torch takes its plain path
    ref.eval()
    twin.eval()
    assert_close("eval", twin(x), ref(x), 2e-5, 1e-4)
    twin.train()
    a, b = twin(x), twin(x)
    assert not torch.allclose(a, b), "training-mode dropout gave identical outputs twice"
    a.sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in twin.parameters())


# ---------------------------------------------------------------------- fusion: op counts
class _Counter:
    def __init__(self, monkeypatch):
        self.calls = {}
        for name in ("attention", "add_layer_norm", "feed_forward"):
            original = getattr(fastformer.ops, name)
            monkeypatch.setattr(fastformer.ops, name, self._wrap(name, original))

    def _wrap(self, name, fn):
        def counted(*args, **kwargs):
            self.calls[name] = self.calls.get(name, 0) + 1
            return fn(*args, **kwargs)
        return counted


@pytest.mark.parametrize("norm_first", [False, True], ids=["post_ln", "pre_ln"])
def test_one_fused_op_per_block(monkeypatch, norm_first):
    enc = fnn.TransformerEncoderLayer(D_MODEL, NHEAD, FF, batch_first=True, norm_first=norm_first)
    dec = fnn.TransformerDecoderLayer(D_MODEL, NHEAD, FF, batch_first=True, norm_first=norm_first)
    x, mem = torch.randn(2, 5, D_MODEL), torch.randn(2, 6, D_MODEL)
    counter = _Counter(monkeypatch)
    enc(x)
    # post-LN: two add+norms; pre-LN: norm1, then add+norm2 (the layer's last add has no norm)
    assert counter.calls == {"attention": 1, "add_layer_norm": 2, "feed_forward": 1}
    counter.calls.clear()
    dec(x, mem)
    assert counter.calls == {"attention": 2, "add_layer_norm": 3, "feed_forward": 1}
    counter.calls.clear()
    stack = fnn.TransformerEncoder(enc, 3, fnn.LayerNorm(D_MODEL) if norm_first else None,
                                   enable_nested_tensor=False)
    stack(x)
    # pre-LN stacks carry each layer's last residual add into the next norm: 2 per layer + final
    assert counter.calls == {"attention": 3, "add_layer_norm": 6 + int(norm_first), "feed_forward": 3}


def test_unsupported_activation_is_a_clear_error():
    with pytest.raises(ValueError, match="relu.*gelu"):
        fnn.TransformerEncoderLayer(D_MODEL, NHEAD, FF, activation=torch.tanh)
    with pytest.raises(ValueError, match="relu.*gelu"):
        fnn.TransformerDecoderLayer(D_MODEL, NHEAD, FF, activation=torch.nn.GELU(approximate="tanh"))
    layer = fnn.TransformerEncoderLayer(D_MODEL, NHEAD, FF, activation=torch.nn.ReLU())
    assert layer(torch.randn(3, 2, D_MODEL)).shape == (3, 2, D_MODEL)


@pytest.mark.parametrize("backend", BACKENDS)
def test_silu_callables_fuse_as_torch_computes(monkeypatch, backend):
    """torch's layers take F.silu / nn.SiLU() (not the string "silu"): the twins, and convert() of
    torch's layers, run them as one feed_forward(activation="silu") with torch's results."""
    seen = []
    original = fastformer.ops.feed_forward
    monkeypatch.setattr(fastformer.ops, "feed_forward",
                        lambda *a, **kw: seen.append(kw["activation"]) or original(*a, **kw))
    with pytest.raises(RuntimeError, match="silu"):
        torch.nn.TransformerEncoderLayer(D_MODEL, NHEAD, FF, activation="silu")
    ref, twin = twins(torch.nn.TransformerEncoderLayer, fnn.TransformerEncoderLayer, D_MODEL, NHEAD, FF,
                      dropout=0.0, activation=F.silu, batch_first=True)
    x = torch.randn(B, 7, D_MODEL)
    check_same(ref, twin, lambda m, x: m(x), [x], backend)
    ref, twin = twins(torch.nn.TransformerDecoderLayer, fnn.TransformerDecoderLayer, D_MODEL, NHEAD, FF,
                      dropout=0.0, activation=torch.nn.SiLU(), batch_first=True, norm_first=True)
    mem = torch.randn(B, 5, D_MODEL)
    check_same(ref, twin, lambda m, x, mem: m(x, mem), [x, mem], backend)
    # not copy=True: torch's TransformerDecoderLayer.__setstate__ turns a module activation into F.relu
    converted = fastformer.convert(ref)
    assert type(converted) is fnn.TransformerDecoderLayer
    check_same(ref, converted, lambda m, x, mem: m(x, mem), [x, mem], backend)
    assert seen and set(seen) == {"silu"}


@pytest.mark.parametrize("norm_first", [False, True], ids=["post_ln", "pre_ln"])
def test_stacks_call_their_layers_through_module_hooks(norm_first):
    """The stacks call each layer as a module (not a private method), so forward hooks fire, as
    FSDP's per-layer all-gathers and activation checkpointing wrappers need; the pre-LN fusion of a
    layer's last residual add into the next layer's first norm survives it."""
    torch.manual_seed(0)
    model = fnn.Transformer(D_MODEL, NHEAD, 2, 2, FF, dropout=0.0, batch_first=True, norm_first=norm_first)
    calls = []
    for stack in (model.encoder, model.decoder):
        for i, layer in enumerate(stack.layers):
            layer.register_forward_pre_hook(lambda m, args, i=i: calls.append((type(m).__name__, i)))
    src, tgt = torch.randn(B, 6, D_MODEL), torch.randn(B, 5, D_MODEL)
    out = model(src, tgt)
    assert calls == [("TransformerEncoderLayer", 0), ("TransformerEncoderLayer", 1),
                     ("TransformerDecoderLayer", 0), ("TransformerDecoderLayer", 1)]
    # the same numbers as torch's own Transformer with the same weights
    ref = torch.nn.Transformer(D_MODEL, NHEAD, 2, 2, FF, dropout=0.0, batch_first=True, norm_first=norm_first)
    ref.load_state_dict(model.state_dict())
    assert_close("out", out, ref(src, tgt), atol=1e-5, rtol=1e-5)
