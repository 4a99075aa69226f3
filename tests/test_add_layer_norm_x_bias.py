"""add_layer_norm's ``x_bias`` (the producing linear layer's bias, added before the dropout): every
backend against the reference, forward and every gradient; the cpu kernels' fused overloads
(gradcheck, argument checks; opcheck is in test_add_layer_norm.py) against the host-side add the
other backends use; and the layer twins handing their out_proj / linear2 biases to it."""
import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import fastformer
from fastformer import backends, philox
from fastformer.ops import add_layer_norm, reference
from utils import assert_close, assert_close_lowp, device_for, forward_backward, kernel_backends

BACKENDS = kernel_backends("cpu", "triton", "cuda")
CPU = kernel_backends("cpu")
SHAPES = {"cpu": [(1, 64), (7, 1023), (3, 5, 256), (9, 7)], "triton": [(3, 5, 256), (9, 7)],
          "cuda": [(7, 1023), (9, 7)]}
# name: (has residual, prenorm, dropout_p)
CONFIGS = {"post": (True, False, 0.0), "post_dropout": (True, False, 0.3), "no_residual_dropout": (False, False, 0.2),
           "prenorm_dropout": (True, True, 0.25)}
NAMES = ("x", "residual", "weight", "bias", "x_bias")


def _cases():
    for backend in BACKENDS:
        for shape in SHAPES[backend.values[0]]:
            for config in CONFIGS:
                yield pytest.param(backend.values[0], shape, config, marks=backend.marks,
                                   id=f"{backend.id}-{'x'.join(map(str, shape))}-{config}")


def _case(backend, shape, config, dtype):
    has_res, prenorm, p = CONFIGS[config]
    d, C = device_for(backend), shape[-1]
    inputs = [torch.randn(shape, device=d), torch.randn(shape, device=d) if has_res else None,
              1 + 0.5 * torch.randn(C, device=d), 0.5 * torch.randn(C, device=d), torch.randn(C, device=d)]
    upstream = [torch.randn(shape, device=d), torch.randn(shape, device=d)]
    torch.manual_seed(7)
    rng = philox.next_seed()

    def kernel(x, r, w, b, xb):
        torch.manual_seed(7)  # the Function draws rng again
        with fastformer.use_backend(backend):
            return add_layer_norm(x, r, w, b, 1e-5, p, prenorm=prenorm, x_bias=xb)

    def ref(x, r, w, b, xb):
        return reference.add_layer_norm(x, r, w, b, 1e-5, p, prenorm=prenorm, rng=rng, x_bias=xb)

    def cast(ts, dt):
        return [None if t is None else t.to(dt) for t in ts]
    return (forward_backward(kernel, cast(inputs, dtype), cast(upstream, dtype), NAMES),
            forward_backward(ref, cast(inputs, dtype), cast(upstream, dtype), NAMES),
            forward_backward(ref, cast(inputs, torch.float32), cast(upstream, torch.float32), NAMES))


@pytest.mark.parametrize("backend,shape,config", list(_cases()))
def test_fp32_forward_and_every_gradient(backend, shape, config):
    (outs, grads), _, (ref_outs, ref_grads) = _case(backend, shape, config, torch.float32)
    for name, o, r in zip(("y", "h"), outs, ref_outs):
        assert_close(name, o, r, atol=2e-5, rtol=1e-5)
    assert set(grads) == set(ref_grads) and "x_bias" in grads
    for name in ref_grads:
        assert_close(f"d{name}", grads[name], ref_grads[name], atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("backend,shape,config", list(_cases()))
def test_bf16_forward_and_every_gradient(backend, shape, config):
    (outs, grads), (lp_outs, lp_grads), (ref_outs, ref_grads) = _case(backend, shape, config, torch.bfloat16)
    factor = 4.0 if backend == "triton" and not torch.cuda.is_available() else 2.0  # see test_add_layer_norm
    for name, o, lp, r in zip(("y", "h"), outs, lp_outs, ref_outs):
        assert o.dtype == torch.bfloat16
        assert_close_lowp(name, o, r, lp, factor=factor)
    for name in ref_grads:
        assert grads[name].dtype == torch.bfloat16
        # the column sum of dx over up to 35 rows: bf16 rounding of each dx adds up
        assert_close_lowp(f"d{name}", grads[name], ref_grads[name], lp_grads[name], factor=factor, atol=2e-2)


def test_reference_is_layer_norm_of_the_biased_input():
    x, r, xb = torch.randn(6, 33), torch.randn(6, 33), torch.randn(33)
    w, b = torch.randn(33), torch.randn(33)
    want = F.layer_norm(r + F.linear(x, torch.eye(33), xb), (33,), w, b, 1e-5)
    torch.testing.assert_close(reference.add_layer_norm(x, r, w, b, x_bias=xb), want)


@pytest.mark.parametrize("backend", CPU)
def test_cpu_fuses_what_the_host_path_computes(backend, monkeypatch):
    """The cpu backend's .x_bias overloads against its plain kernels with the bias added on the host
    (what triton and cuda do): same dropout mask, same h bit for bit, every gradient close."""
    kern = backends.Kernels(backend)
    assert kern.add_layer_norm_fwd_x_bias is torch.ops.fastformer.add_layer_norm_fwd.x_bias
    x, r, w, b, xb = torch.randn(37, 300), torch.randn(37, 300), torch.randn(300), torch.randn(300), torch.randn(300)
    dy = torch.randn(37, 300)
    pk = philox.pack(3, 11)
    y, h, mean, rstd = kern.add_layer_norm_fwd_x_bias(x, r, w, b, 1e-5, 0.3, pk, xb)
    y2, h2, _, _ = kern.add_layer_norm_fwd(x + xb, r, w, b, 1e-5, 0.3, pk)
    assert torch.equal(h, h2)
    torch.testing.assert_close(y, y2)
    dx, dres, dw, db, dxb = kern.add_layer_norm_bwd_x_bias(dy, None, h, w, mean, rstd, 0.3, pk, True)
    want = kern.add_layer_norm_bwd(dy, None, h, w, mean, rstd, 0.3, pk, True)
    for got, ref in zip((dx, dres, dw, db), want):
        assert torch.equal(got, ref)
    torch.testing.assert_close(dxb, dx.sum(0), atol=1e-4, rtol=1e-5)
    assert 0 < (dx == 0).float().mean() < 0.5  # the dropout mask is in dx, hence in dx_bias

    # the Function without the overloads (the host path) gives the same gradients
    leaves = [t.clone().requires_grad_() for t in (x, r, w, b, xb)]

    def grads():
        for leaf in leaves:
            leaf.grad = None
        torch.manual_seed(0)
        add_layer_norm(*leaves[:4], 1e-5, 0.3, x_bias=leaves[4]).backward(dy)
        return [leaf.grad.clone() for leaf in leaves]
    fused = grads()
    monkeypatch.setattr(backends.select("add_layer_norm", x.device, x.dtype), "add_layer_norm_fwd_x_bias", None)
    for got, ref in zip(fused, grads()):
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("prenorm", [False, True])
@pytest.mark.parametrize("p", [0.0, 0.3])
@pytest.mark.parametrize("backend", CPU)
def test_gradcheck_float64(backend, p, prenorm):
    x, r = (torch.randn(4, 9, dtype=torch.float64, requires_grad=True) for _ in range(2))
    w, b, xb = (torch.randn(9, dtype=torch.float64, requires_grad=True) for _ in range(3))

    def fn(x, r, w, b, xb):
        torch.manual_seed(3)  # the same mask on every evaluation
        with fastformer.use_backend(backend):
            return add_layer_norm(x, r, w, b, 1e-5, p, prenorm=prenorm, x_bias=xb)
    assert torch.autograd.gradcheck(fn, (x, r, w, b, xb), eps=1e-6, atol=1e-5, rtol=1e-3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_x_bias_raises_clear_errors(backend):
    d = device_for(backend)
    x, w = torch.randn(4, 8, device=d), torch.randn(8, device=d)
    with fastformer.use_backend(backend):
        with pytest.raises(ValueError, match="x_bias must have shape"):
            add_layer_norm(x, None, w, None, x_bias=torch.randn(7, device=d))
        with pytest.raises(ValueError, match="x_bias must have 1 dimensions"):
            add_layer_norm(x, None, w, None, x_bias=torch.randn(1, 8, device=d))
        with pytest.raises(TypeError, match="x_bias must be a floating-point tensor"):
            add_layer_norm(x, None, w, None, x_bias=torch.ones(8, dtype=torch.long, device=d))


@pytest.mark.parametrize("backend", CPU)
def test_kernel_checks_name_x_bias(backend):
    ops = torch.ops.fastformer
    x, w = torch.randn(4, 8), torch.randn(8)
    pk = philox.pack(0, 0)
    for xb, match in ((torch.randn(7), r"x_bias must have shape \(8,\)"),
                      (torch.randn(8, dtype=torch.float64), "x_bias must have the dtype of x"),
                      (torch.randn(16)[::2], "x_bias must be contiguous")):
        with pytest.raises(RuntimeError, match=match):
            ops.add_layer_norm_fwd.x_bias(x, None, w, w, 1e-5, 0.0, pk, xb)


class _Calls(TorchDispatchMode):
    """Records every op overload run, with its arguments."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls.append((str(func), args))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("norm_first", [False, True])
def test_layers_hand_their_output_biases_to_add_layer_norm(norm_first):
    """A training step of an encoder and a decoder layer: the bias that ends each sub-layer (out_proj,
    linear2) goes through add_layer_norm's x_bias, never through a linear layer's addmm, and every
    parameter's gradient equals torch's own layers'."""
    torch.manual_seed(0)
    kw = dict(d_model=32, nhead=4, dim_feedforward=64, dropout=0.0, batch_first=True, norm_first=norm_first)
    ours = [fastformer.nn.TransformerEncoderLayer(**kw), fastformer.nn.TransformerDecoderLayer(**kw)]
    theirs = [torch.nn.TransformerEncoderLayer(**kw), torch.nn.TransformerDecoderLayer(**kw)]
    for a, b in zip(ours, theirs):
        b.load_state_dict(a.state_dict())
    src, tgt = torch.randn(2, 5, 32), torch.randn(2, 4, 32)

    def step(enc, dec):
        dec(tgt, enc(src)).square().sum().backward()

    with _Calls() as mode:
        step(*ours)
    deferred = {m.out_proj.bias.data_ptr() for layer in ours for m in layer.modules()
                if isinstance(m, torch.nn.MultiheadAttention)} | {layer.linear2.bias.data_ptr() for layer in ours}
    fused = [args for name, args in mode.calls if name == "fastformer.add_layer_norm_fwd.x_bias"]
    # post-LN: 2 + 3 sub-layers; pre-LN: the attentions' (the feed-forwards' end a layer, finished by a plain add)
    assert len(fused) == (3 if norm_first else 5)
    assert {args[7].data_ptr() for args in fused} <= deferred
    assert len([n for n, _ in mode.calls if n == "fastformer.add_layer_norm_bwd.x_bias"]) == len(fused)
    addmm_biases = {args[0].data_ptr() for name, args in mode.calls if name.startswith("aten.addmm")}
    assert addmm_biases and not addmm_biases & deferred
    step(*theirs)
    for a, b in zip(ours, theirs):
        for (name, p), q in zip(a.named_parameters(), b.parameters()):
            torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")


def test_attention_with_forward_hooks_keeps_its_bias():
    """A self_attn with a forward hook (a user's, or FSDP's when sharded on its own) returns torch's
    output, bias included, and the layer stays equal to torch's."""
    torch.manual_seed(0)
    kw = dict(d_model=32, nhead=4, dim_feedforward=64, dropout=0.0, batch_first=True)
    ours, theirs = fastformer.nn.TransformerEncoderLayer(**kw), torch.nn.TransformerEncoderLayer(**kw)
    theirs.load_state_dict(ours.state_dict())
    with torch.no_grad():
        ours.self_attn.out_proj.bias.normal_()
        theirs.self_attn.out_proj.bias.copy_(ours.self_attn.out_proj.bias)
    seen = []
    ours.self_attn.register_forward_hook(lambda module, args, out: seen.append(out[0]))
    src = torch.randn(2, 5, 32)
    with _Calls() as mode:
        out = ours(src)
    want = theirs.self_attn(src, src, src, need_weights=False)[0]
    torch.testing.assert_close(seen[0], want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, theirs(src), atol=1e-5, rtol=1e-5)
    fused = [args[7] for name, args in mode.calls if name == "fastformer.add_layer_norm_fwd.x_bias"]
    assert len(fused) == 1 and fused[0] is ours.linear2.bias  # the feed-forward's only
