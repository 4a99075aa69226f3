"""attention_varlen_qkvpacked / attention_varlen_kvpacked (FlashAttention's packed varlen layouts):
the same outputs, gradients and dropout bits as attention_varlen on the unbound views, on every
backend; one gradient buffer written in place where the backend has attention_varlen_bwd.into
(cpu, cuda), copied in elsewhere; the .into op's opcheck and its checks of the given gradients."""
import pytest
import torch

import fastformer
from fastformer import _ext, backends, philox
from fastformer.ops import attention_varlen, attention_varlen_kvpacked, attention_varlen_qkvpacked
from utils import assert_close, device_for, kernel_backends, skip_without_kernels

BACKENDS = ["reference"] + kernel_backends("cpu", "triton", "cuda")
INTO = kernel_backends("cpu", "cuda")  # the backends with attention_varlen_bwd.into

LQ, LK = [7, 0, 30, 1], [5, 3, 30, 9]  # an empty query sequence, Lq != Lk
H, D = 2, 40


def cu(lengths, device):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=device)


def _run(backend, fn, leaves, dout, seed=5):
    leaves = [t.detach().clone().requires_grad_() for t in leaves]
    torch.manual_seed(seed)  # the Function draws its (seed, offset) from torch's generator
    with fastformer.use_backend(backend):
        out = fn(*leaves)
    return [out.detach(), *torch.autograd.grad(out, leaves, dout)]


def _device(backend):
    return device_for(backend) if backend != "reference" else "cpu"


@pytest.mark.parametrize("p", [0.0, 0.25])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("backend", BACKENDS)
def test_qkvpacked_is_attention_varlen_of_the_views(backend, causal, p):
    skip_without_kernels(backend, "attention_varlen")
    device = _device(backend)
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(sum(LK), 3, H, D, generator=gen).to(device)
    dout = torch.randn(sum(LK), H, D, generator=gen).to(device)
    c, m = cu(LK, device), max(LK)
    options = dict(is_causal=causal, dropout_p=p)
    packed = _run(backend, lambda t: attention_varlen_qkvpacked(t, c, m, **options), [qkv], dout)
    views = _run(backend, lambda t: attention_varlen(*t.unbind(1), c, c, m, m, **options), [qkv], dout)
    # the same kernels on the same rows (dropout bits included): equal, not just close
    for name, got, want in zip(("out", "dqkv"), packed, views):
        assert torch.equal(got, want), f"{name}: packed and unbound views differ"
    assert packed[1].shape == qkv.shape and packed[1].is_contiguous()
    if backend != "reference" and p == 0.0:  # and both are the reference's
        ref = _run("reference", lambda t: attention_varlen_qkvpacked(t, c.cpu(), m, is_causal=causal),
                   [qkv.cpu().double()], dout.cpu().double())
        for name, got, want in zip(("out", "dqkv"), packed, ref):
            assert_close(name, got.cpu().double(), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("backend", BACKENDS)
def test_kvpacked_is_attention_varlen_of_the_views(backend, causal, dtype):
    skip_without_kernels(backend, "attention_varlen")
    device = _device(backend)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(sum(LQ), H, D, generator=gen).to(device, dtype)
    kv = torch.randn(sum(LK), 2, H, D, generator=gen).to(device, dtype)
    dout = torch.randn(sum(LQ), H, D, generator=gen).to(device, dtype)
    cq, ck = cu(LQ, device), cu(LK, device)
    options = dict(is_causal=causal, dropout_p=0.2)
    packed = _run(backend, lambda a, b: attention_varlen_kvpacked(a, b, cq, ck, max(LQ), max(LK), **options),
                  [q, kv], dout)
    views = _run(backend, lambda a, b: attention_varlen(a, *b.unbind(1), cq, ck, max(LQ), max(LK), **options),
                 [q, kv], dout)
    for name, got, want in zip(("out", "dq", "dkv"), packed, views):
        assert torch.equal(got, want), f"{name}: packed and unbound views differ"


def _backward_ops(backend, device):
    qkv = torch.randn(sum(LK), 3, H, D, device=device, requires_grad=True)
    c = cu(LK, device)
    with fastformer.use_backend(backend):
        out = attention_varlen_qkvpacked(qkv, c, max(LK), dropout_p=0.1)
    with torch.profiler.profile() as prof:
        out.sum().backward()
    return {e.name for e in prof.events()}


@pytest.mark.parametrize("backend", INTO)
def test_one_gradient_buffer_written_in_place(backend):
    """The backward writes dq, dk, dv into the slices of one (total, 3, H, D) gradient: no stack."""
    skip_without_kernels(backend, "attention_varlen")
    device = device_for(backend)
    with fastformer.use_backend(backend):
        kernels = backends.select("attention_varlen", torch.device(device), torch.float32)
    assert getattr(kernels, "attention_varlen_bwd_into", None) is not None
    names = _backward_ops(backend, device)
    assert not {"aten::stack", "aten::cat"} & names, sorted(names)


def test_a_backend_without_the_out_op_stacks_its_gradients(monkeypatch):
    """The fallback (e.g. triton): the functional backward, its three gradients stacked into one."""
    skip_without_kernels("cpu", "attention_varlen")
    with fastformer.use_backend("cpu"):
        kernels = backends.select("attention_varlen", torch.device("cpu"), torch.float32)
    monkeypatch.delattr(kernels, "attention_varlen_bwd_into")
    assert "aten::stack" in _backward_ops("cpu", "cpu")


# ---------------------------------------------------------------- the C++ .into op


def _bwd_args(device, dtype=torch.float32):
    gen = torch.Generator().manual_seed(2)
    qkv = torch.randn(sum(LK), 3, H, D, generator=gen).to(device, dtype)
    q, k, v = qkv.unbind(1)
    c = cu(LK, device)
    fwd_args = (q, k, v, c, c, max(LK), max(LK), True, 0.3, 0.2, philox.pack(7, 3))
    return qkv, fwd_args


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", kernel_backends("cpu"))
def test_opcheck_into(backend, dtype):
    assert _ext.load_error() is None
    ops = torch.ops.fastformer
    qkv, args = _bwd_args("cpu", dtype)
    out, lse = ops.attention_varlen_fwd(*args)
    bwd_args = (torch.randn_like(out), *args[:3], out, lse, *args[3:])
    dqkv = torch.empty_like(qkv)
    dq, dk, dv = dqkv.unbind(1)
    torch.library.opcheck(ops.attention_varlen_bwd.into, bwd_args, dict(dq=dq, dk=dk, dv=dv))
    ops.attention_varlen_bwd.into(*bwd_args, dq=dq, dk=dk, dv=dv)
    for got, want in zip((dq, dk, dv), ops.attention_varlen_bwd(*bwd_args)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("backend", INTO)
def test_into_checks_the_gradients_it_writes(backend):
    skip_without_kernels(backend, "attention_varlen")
    device = device_for(backend)
    with fastformer.use_backend(backend):
        into = backends.select("attention_varlen", torch.device(device), torch.float32).attention_varlen_bwd_into
    qkv, args = _bwd_args(device)
    with fastformer.use_backend(backend):
        out, lse = backends.select("attention_varlen", torch.device(device), torch.float32).attention_varlen_fwd(*args)
    bwd_args = (torch.randn_like(out), *args[:3], out, lse, *args[3:])
    g = torch.empty_like(qkv)
    dq, dk, dv = g.unbind(1)
    wide = torch.empty(sum(LK), H, 2 * D, device=device)
    cases = [
        (dict(dq=dq[:-1], dk=dk, dv=dv), "dq must have q's shape"),
        (dict(dq=dq.double(), dk=dk, dv=dv), "dq must have the dtype of q"),
        (dict(dq=dq, dk=wide[..., ::2], dv=dv), r"dk must be \(total, H, D\) rows"),
        (dict(dq=dq, dk=dq, dv=dv), "dq and dk share memory"),
        (dict(dq=dq, dk=dk, dv=g.flatten(1)[:, H * D + D:2 * H * D + D].view(-1, H, D)), "dk and dv share memory"),
        (dict(dq=dq, dk=dk, dv=bwd_args[3]), "dv must not share memory with the op's inputs"),
    ]
    for outs, message in cases:
        with pytest.raises(RuntimeError, match=message):
            into(*bwd_args, **outs)
    into(*bwd_args, dq=dq, dk=dk, dv=dv)  # the packed slices themselves pass


# ---------------------------------------------------------------- the Python ops' checks


def test_bad_packed_input_raises_clear_errors():
    c = cu([2, 3], "cpu")
    with pytest.raises(ValueError, match=r"qkv must have shape \(total, 3, H, D\)"):
        attention_varlen_qkvpacked(torch.randn(5, 2, 2, 8), c, 3)
    with pytest.raises(ValueError, match="qkv must have 4 dimensions"):
        attention_varlen_qkvpacked(torch.randn(5, 3, 8), c, 3)
    with pytest.raises(ValueError, match="kv has 3 heads, which must divide q's 2 heads"):
        attention_varlen_kvpacked(torch.randn(5, 2, 8), torch.randn(5, 2, 3, 8), c, c, 3, 3)
    with pytest.raises(TypeError, match="kv has dtype"):
        attention_varlen_kvpacked(torch.randn(5, 2, 8), torch.randn(5, 2, 2, 8).double(), c, c, 3, 3)
    with pytest.raises(ValueError, match=r"cu_seqlens_q\[-1\] must equal total_q"):
        attention_varlen_qkvpacked(torch.randn(6, 3, 2, 8), c, 3)


@pytest.mark.slow
def test_torch_compile_traces_the_packed_backward():
    skip_without_kernels("cpu", "attention_varlen")
    qkv = torch.randn(sum(LK), 3, H, D)
    c = cu(LK, "cpu")

    def loss(t):
        return attention_varlen_qkvpacked(t, c, max(LK), is_causal=True).square().sum()

    want = torch.autograd.grad(loss(qkv.requires_grad_()), qkv)[0]
    torch._dynamo.reset()
    got = torch.autograd.grad(torch.compile(loss, fullgraph=True)(qkv), qkv)[0]
    assert_close("dqkv", got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("layout", ["q,k,v", "q,kv", "qkv"])
def test_torch_compile_traces_each_layout_without_grad(layout):
    """Inference under torch.compile: with no input requiring grad dynamo runs the Function's
    forward inline, where torch 2.13 bound a ``*inputs`` parameter to one tensor of q and kv."""
    skip_without_kernels("cpu", "attention_varlen")
    g = torch.Generator().manual_seed(7)
    q = torch.randn(sum(LQ), H, D, generator=g)
    kv = torch.randn(sum(LK), 2, H, D, generator=g)
    cq, ck = cu(LQ, "cpu"), cu(LK, "cpu")
    calls = {"q,k,v": lambda q, kv: attention_varlen(q, kv[:, 0], kv[:, 1], cq, ck, max(LQ), max(LK)),
             "q,kv": lambda q, kv: attention_varlen_kvpacked(q, kv, cq, ck, max(LQ), max(LK)),
             "qkv": lambda q, kv: attention_varlen_qkvpacked(torch.stack([kv[:, 0], kv[:, 0], kv[:, 1]], 1), ck,
                                                             max(LK))}
    want = calls[layout](q, kv)
    torch._dynamo.reset()
    got = torch.compile(calls[layout], fullgraph=True, backend="eager")(q, kv)
    assert_close("out", got, want, atol=1e-6, rtol=1e-6)
