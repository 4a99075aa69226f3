"""The C++ autograd ops (csrc/autograd/{attention,attention_varlen,cross_entropy,linear_cross_entropy}.cpp)
against the Python Functions they reproduce (fastformer/autograd/*.py) on the cpu backend: bit-equal
outputs and input gradients, every option, odd shapes, under no_grad and inference_mode, and one case
each against fastformer/ops/reference.py.

Each C++ op ``torch.ops.fastformer.<op>`` takes the Function's ``apply`` arguments without ``kernels``;
the attention ops take the caller's ``philox`` tensor in its place (the Functions draw it inside:
here ``philox.draw`` is made to hand both the same ``philox.pack(seed, 0)``)."""
import math

import pytest
import torch

from fastformer import _ext, autograd, backends, philox
from fastformer.ops import reference
from fastformer.ops.attention import _attn_mask_as_additive
from utils import assert_close

OPS = ("attention", "attention_varlen", "cross_entropy", "linear_cross_entropy")


def _has_cpp_ops():
    if _ext.load_error() is not None:
        return False
    names = set(torch._C._dispatch_get_all_op_names())
    return all(f"fastformer::{op}" in names for op in OPS)


pytestmark = pytest.mark.skipif(not _has_cpp_ops(), reason="the C++ library lacks the fastformer::<op> autograd ops")

FF = torch.ops.fastformer


@pytest.fixture(scope="module")
def kernels():
    return backends.BACKENDS["cpu"].kernels("cpu")


@pytest.fixture
def fixed_draw(monkeypatch):
    """Make the Functions' philox.draw(p) hand out ``rng`` (for p > 0), as the C++ op's caller passes it."""
    rng = philox.pack(20261202, 0)
    monkeypatch.setattr(philox, "draw", lambda p, *args: rng if p > 0.0 else philox.no_dropout())
    return rng


def assert_bit_equal(name, got, want):
    if want is None or got is None:
        assert got is None and want is None, f"{name}: {got} vs {want}"
        return
    assert got.dtype == want.dtype, f"{name}: dtype {got.dtype} != {want.dtype}"
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert got.device == want.device
    same = (got == want) | (got.isnan() & want.isnan()) if got.is_floating_point() else got == want
    assert bool(same.all()), f"{name}: not bit-equal, max diff {(got.double() - want.double()).abs().max()}"


def run(fn, inputs, grad_of, upstream):
    """fn(*leaves)'s output and the gradients of the inputs named by index in ``grad_of``."""
    leaves = [t.detach().clone().requires_grad_(i in grad_of) if isinstance(t, torch.Tensor) else t
              for i, t in enumerate(inputs)]
    out = fn(*leaves)
    grads = torch.autograd.grad(out, [leaves[i] for i in grad_of], upstream, allow_unused=True)
    return out.detach(), grads


def check_equal(py_fn, cpp_fn, inputs, grad_of, upstream):
    """Bit-equal outputs and gradients with grad, and bit-equal outputs (no graph) under no_grad and
    inference_mode."""
    out_py, g_py = run(py_fn, inputs, grad_of, upstream)
    out_cpp, g_cpp = run(cpp_fn, inputs, grad_of, upstream)
    assert_bit_equal("out", out_cpp, out_py)
    for i, a, b in zip(grad_of, g_cpp, g_py):
        assert_bit_equal(f"grad of input {i}", a, b)
    leaves = [t.detach().clone().requires_grad_(i in grad_of) if isinstance(t, torch.Tensor) else t
              for i, t in enumerate(inputs)]
    for mode in (torch.no_grad, torch.inference_mode):
        with mode():
            a, b = cpp_fn(*leaves), py_fn(*leaves)
        assert a.grad_fn is None and not a.requires_grad
        assert a.is_inference() == b.is_inference()
        assert_bit_equal(f"out under {mode.__name__}", a, b)
    return out_cpp, g_cpp


# ------------------------------------------------------------------------------------------ attention
ATTENTION_CASES = [
    # B, H, Sq, Sk, D, causal, key padding mask, attn_mask (None, "bool", "float", "float2d")
    (2, 3, 5, 5, 16, False, False, None),
    (1, 2, 7, 7, 33, True, False, None),
    (2, 1, 3, 11, 24, True, True, None),  # Sq != Sk, bottom-right causal
    (3, 2, 9, 4, 8, False, True, "bool"),
    (2, 2, 6, 13, 40, True, True, "float"),
    (1, 3, 17, 17, 65, False, False, "float2d"),
]


def attention_inputs(B, H, Sq, Sk, D, kpm, mask, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, Sq, D, generator=gen).to(dtype)
    k = torch.randn(B, H, Sk, D, generator=gen).to(dtype)
    v = torch.randn(B, H, Sk, D, generator=gen).to(dtype)
    key_padding_mask = None
    if kpm:
        key_padding_mask = torch.rand(B, Sk, generator=gen) < 0.3
        key_padding_mask[0, :] = True  # batch entry 0 sees no key at all: zero rows, zero gradients
    attn_mask = None
    if mask == "bool":
        attn_mask = _attn_mask_as_additive(torch.rand(Sq, Sk, generator=gen) < 0.3, B, H, Sq, Sk)
    elif mask == "float":
        attn_mask = _attn_mask_as_additive(torch.randn(B, H, Sq, Sk, generator=gen), B, H, Sq, Sk)
    elif mask == "float2d":
        attn_mask = _attn_mask_as_additive(torch.randn(Sq, Sk, generator=gen).double(), B, H, Sq, Sk)
    # an upstream gradient whose last dim is not contiguous: the backward's contiguous() path
    dout = torch.randn(B, H, D, Sq, generator=gen).to(dtype).transpose(-1, -2)
    return q, k, v, key_padding_mask, attn_mask, dout


# every case in fp32, one in bf16 and fp64; each without and with dropout
@pytest.mark.parametrize("p", [0.0, 0.1])
@pytest.mark.parametrize("case,dtype", [(c, torch.float32) for c in ATTENTION_CASES]
                         + [(ATTENTION_CASES[4], d) for d in (torch.bfloat16, torch.float64)],
                         ids=lambda x: str(x).replace(" ", "") if isinstance(x, tuple) else str(x))
def test_attention_matches_python_function(kernels, fixed_draw, case, p, dtype):
    B, H, Sq, Sk, D, causal, kpm, mask = case
    q, k, v, key_padding_mask, attn_mask, dout = attention_inputs(B, H, Sq, Sk, D, kpm, mask, dtype)
    scale = 0.7 / math.sqrt(D)

    def py(q, k, v):
        return autograd.AttentionFunction.apply(q, k, v, key_padding_mask, attn_mask, causal, scale, p, kernels)

    def cpp(q, k, v):
        return FF.attention(q, k, v, key_padding_mask, attn_mask, causal, scale, p, philox.draw(p))

    check_equal(py, cpp, (q, k, v), (0, 1, 2), dout)


def test_attention_some_inputs_need_grad_and_retained_graph(kernels, fixed_draw):
    q, k, v, kpm, am, dout = attention_inputs(2, 2, 5, 9, 16, True, "float", torch.float32)
    q.requires_grad_()
    v.requires_grad_()
    outs = []
    for fn in (lambda: autograd.AttentionFunction.apply(q, k, v, kpm, am, True, 0.25, 0.1, kernels),
               lambda: FF.attention(q, k, v, kpm, am, True, 0.25, 0.1, philox.draw(0.1))):
        out = fn()
        g1 = torch.autograd.grad(out, (q, v), dout, retain_graph=True)
        g2 = torch.autograd.grad(out, (q, v), 2 * dout)
        outs.append((out.detach(), *g1, *g2))
    for a, b in zip(*outs):
        assert_bit_equal("attention", a, b)


def test_attention_matches_reference(fixed_draw):
    q, k, v, kpm, am, dout = attention_inputs(2, 3, 7, 10, 32, True, "float", torch.float32)
    rng = philox.draw(0.1)

    def cpp(q, k, v):
        return FF.attention(q, k, v, kpm, am, True, 0.3, 0.1, rng)

    def ref(q, k, v):
        return reference.attention(q, k, v, key_padding_mask=kpm, attn_mask=am, is_causal=True, scale=0.3,
                                   dropout_p=0.1, rng=rng)

    got = run(cpp, (q, k, v), (0, 1, 2), dout)
    want = run(ref, (q.double(), k.double(), v.double()), (0, 1, 2), dout.double())
    for name, a, b in zip(("out", "dq", "dk", "dv"), (got[0], *got[1]), (want[0], *want[1])):
        assert_close(name, a.double(), b, atol=1e-5, rtol=1e-4)


# ------------------------------------------------------------------------------------ attention_varlen
def cu(lengths):
    c = [0]
    for n in lengths:
        c.append(c[-1] + n)
    return torch.tensor(c, dtype=torch.int32)


VARLEN_CASES = [
    # layout, query lengths, key lengths (None: the queries'), causal
    ("q,k,v", [3, 0, 7, 5], [4, 2, 9, 1], False),
    ("q,k,v", [5, 1, 9], None, True),
    ("qkv", [6, 0, 11, 3], None, True),
    ("qkv", [2, 13], None, False),
    ("q,kv", [4, 7, 1], [9, 3, 5], True),
    ("q,kv", [3, 8], None, False),
]


def varlen_inputs(layout, lq, lk, H, D, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    lk = lq if lk is None else lk
    tq, tk = sum(lq), sum(lk)
    if layout == "qkv":
        tensors = (torch.randn(tq, 3, H, D, generator=gen).to(dtype),)
    elif layout == "q,kv":
        tensors = (torch.randn(tq, H, D, generator=gen).to(dtype), torch.randn(tk, 2, H, D, generator=gen).to(dtype))
    else:
        tensors = tuple(torch.randn(n, H, D, generator=gen).to(dtype) for n in (tq, tk, tk))
    # an upstream gradient whose last dim is not contiguous: the backward's contiguous() path
    dout = torch.randn(D, H, tq, generator=gen).to(dtype).permute(2, 1, 0)
    return tensors, dout


# every case in fp32, one in bf16; each without and with dropout
@pytest.mark.parametrize("p", [0.0, 0.1])
@pytest.mark.parametrize("case,dtype", [(c, torch.float32) for c in VARLEN_CASES] + [(VARLEN_CASES[4], torch.bfloat16)],
                         ids=lambda x: str(x).replace(" ", "") if isinstance(x, tuple) else str(x))
def test_attention_varlen_matches_python_function(kernels, fixed_draw, case, p, dtype):
    layout, lq, lk, causal = case
    H, D = 3, 24
    tensors, dout = varlen_inputs(layout, lq, lk, H, D, dtype)
    cu_q = cu(lq)
    cu_k = None if lk is None else cu(lk)
    mq, mk = max(lq), max(lk or lq)
    scale = 0.9 / math.sqrt(D)

    def py(*xs):
        return autograd.AttentionVarlenFunction.apply(layout, cu_q, cu_k, mq, mk, causal, scale, p, kernels, None, *xs)

    def cpp(*xs):
        return FF.attention_varlen(layout, cu_q, cu_k, mq, mk, causal, scale, p, philox.draw(p), *xs)

    check_equal(py, cpp, tensors, tuple(range(len(tensors))), dout)


def test_attention_varlen_matches_reference(fixed_draw):
    lq, lk = [3, 0, 7, 5], [4, 2, 9, 1]
    (q, kv), dout = varlen_inputs("q,kv", lq, lk, 2, 16, torch.float32)
    rng = philox.draw(0.1)
    cu_q, cu_k = cu(lq), cu(lk)

    def cpp(q, kv):
        return FF.attention_varlen("q,kv", cu_q, cu_k, 7, 9, True, 0.25, 0.1, rng, q, kv)

    def ref(q, kv):
        return reference.attention_varlen(q, *kv.unbind(1), cu_q, cu_k, 7, 9, is_causal=True, scale=0.25,
                                          dropout_p=0.1, rng=rng)

    got = run(cpp, (q, kv), (0, 1), dout)
    want = run(ref, (q.double(), kv.double()), (0, 1), dout.double())
    for name, a, b in zip(("out", "dq", "dkv"), (got[0], *got[1]), (want[0], *want[1])):
        assert_close(name, a.double(), b, atol=1e-5, rtol=1e-4)


# ------------------------------------------------------------------------------------------ cross_entropy
REDUCTION_CODE = {"none": 0, "mean": 1, "sum": 2}


def ce_inputs(N, V, dtype, ignore_index, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(N, V, generator=gen)).to(dtype)
    target = torch.randint(0, V, (N,), generator=gen)
    if ignore_index is not None and N > 2:
        target[1] = ignore_index
        if 0 <= ignore_index < V:
            target[N - 1] = ignore_index
    return logits, target


# upstream gradients of a scalar loss: exactly 1 (no scaling), a factor (in place), 0 and inf (out of place)
SCALAR_UPSTREAMS = [1.0, 2.5, 0.0, float("inf")]


# every shape in fp32, one in bf16 and fp64
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
@pytest.mark.parametrize("ignore_index", [-100, 3])
@pytest.mark.parametrize("shape,dtype", [((1, 1), torch.float32), ((7, 13), torch.float32), ((33, 101), torch.float32),
                                         ((7, 13), torch.bfloat16), ((7, 13), torch.float64)], ids=str)
def test_cross_entropy_matches_python_function(kernels, reduction, label_smoothing, ignore_index, shape, dtype):
    N, V = shape
    logits, target = ce_inputs(N, V, dtype, ignore_index)
    code = REDUCTION_CODE[reduction]

    def py(logits):
        return autograd.CrossEntropyFunction.apply(logits, target, label_smoothing, ignore_index, code, kernels)

    def cpp(logits):
        return FF.cross_entropy(logits, target, label_smoothing, ignore_index, code)

    if reduction == "none":
        upstreams = [torch.randn(N, generator=torch.Generator().manual_seed(1)).to(dtype)]
    else:
        upstreams = [torch.tensor(u, dtype=dtype) for u in SCALAR_UPSTREAMS]
    for upstream in upstreams:
        check_equal(py, cpp, (logits,), (0,), upstream)


@pytest.mark.parametrize("first,second", [(2.5, 4.0), (1.0, 3.0), (0.0, 2.0), (-1.5, 1.0)])
def test_cross_entropy_retained_graph(kernels, first, second):
    """A second backward through a retained graph: the first scaled the stored gradient in place
    (or not: 1, 0), the second multiplies by the ratio; the first's gradient is left as it was."""
    logits, target = ce_inputs(9, 17, torch.float32, -100)
    results = []
    for fn in (lambda x: autograd.CrossEntropyFunction.apply(x, target, 0.1, -100, 1, kernels),
               lambda x: FF.cross_entropy(x, target, 0.1, -100, 1)):
        x = logits.clone().requires_grad_()
        loss = fn(x)
        (g1,) = torch.autograd.grad(loss, x, torch.tensor(first), retain_graph=True)
        g1_copy = g1.clone()
        (g2,) = torch.autograd.grad(loss, x, torch.tensor(second))
        assert_bit_equal("first gradient kept", g1, g1_copy)
        results.append((loss.detach(), g1, g2))
    for a, b in zip(*results):
        assert_bit_equal("cross_entropy", a, b)


def test_cross_entropy_accumulates_into_grad(kernels):
    """loss.backward() twice into .grad (a fresh graph each time), as a training step does."""
    logits, target = ce_inputs(5, 11, torch.float32, -100)
    grads = []
    for fn in (lambda x: autograd.CrossEntropyFunction.apply(x, target, 0.0, -100, 2, kernels),
               lambda x: FF.cross_entropy(x, target, 0.0, -100, 2)):
        x = logits.clone().requires_grad_()
        fn(x).backward()
        (fn(x) * 0.5).backward()
        grads.append(x.grad)
    assert_bit_equal("accumulated grad", *grads)


@pytest.mark.parametrize("code", [0, 1, 2])
def test_no_input_requires_grad_builds_no_graph(kernels, code):
    logits, target = ce_inputs(5, 11, torch.float32, -100)
    loss = FF.cross_entropy(logits, target, 0.1, -100, code)
    assert loss.grad_fn is None
    assert_bit_equal("loss", loss, autograd.CrossEntropyFunction.apply(logits, target, 0.1, -100, code, kernels))
    hidden, weight, b, target = lce_inputs(5, 8, 11, torch.float32, True, -100)
    loss = FF.linear_cross_entropy(hidden, weight, b, target, 0.1, -100, code)
    assert loss.grad_fn is None
    assert_bit_equal("loss", loss, autograd.LinearCrossEntropyFunction.apply(hidden, weight, b, target, 0.1, -100,
                                                                             code, kernels))


def test_cross_entropy_matches_reference():
    logits, target = ce_inputs(13, 29, torch.float32, -100)

    def cpp(x):
        return FF.cross_entropy(x, target, 0.1, -100, 1)

    def ref(x):
        return reference.cross_entropy(x, target, label_smoothing=0.1, ignore_index=-100, reduction="mean")

    got = run(cpp, (logits,), (0,), torch.tensor(1.5))
    want = run(ref, (logits.double(),), (0,), torch.tensor(1.5, dtype=torch.float64))
    assert_close("loss", got[0].double(), want[0], atol=1e-6, rtol=1e-5)
    assert_close("dlogits", got[1][0].double(), want[1][0], atol=1e-6, rtol=1e-5)


# ----------------------------------------------------------------------------------- linear_cross_entropy
def lce_inputs(N, D, V, dtype, bias, ignore_index, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, D, generator=gen).to(dtype)
    weight = (torch.randn(V, D, generator=gen) / math.sqrt(D)).to(dtype)
    b = torch.randn(V, generator=gen).to(dtype) if bias else None
    target = torch.randint(0, V, (N,), generator=gen)
    if N > 2:
        target[1] = ignore_index
    return hidden, weight, b, target


# every option on every shape in fp32 with every input requiring grad; bf16 and subsets of the
# inputs requiring grad (hidden only, weight only: the bias never) on one shape
LCE_CASES = ([(shape, torch.float32, ls, ii, (0, 1, 2)) for shape in ((1, 3, 2), (11, 19, 37), (67, 24, 301))
              for ls in (0.0, 0.1) for ii in (-100, -(2 ** 63))]
             + [((11, 19, 37), torch.bfloat16, 0.1, -100, (0, 1, 2))]
             + [((11, 19, 37), torch.float32, 0.0, -100, grad_of) for grad_of in ((0,), (1,))])


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape,dtype,label_smoothing,ignore_index,grad_of", LCE_CASES, ids=str)
def test_linear_cross_entropy_matches_python_function(kernels, reduction, label_smoothing, bias, ignore_index,
                                                      grad_of, shape, dtype):
    N, D, V = shape
    hidden, weight, b, target = lce_inputs(N, D, V, dtype, bias, ignore_index)
    grad_of = tuple(i for i in grad_of if i != 2 or bias)
    code = REDUCTION_CODE[reduction]

    def py(hidden, weight, b):
        return autograd.LinearCrossEntropyFunction.apply(hidden, weight, b, target, label_smoothing, ignore_index,
                                                         code, kernels)

    def cpp(hidden, weight, b):
        return FF.linear_cross_entropy(hidden, weight, b, target, label_smoothing, ignore_index, code)

    if reduction == "none":
        upstreams = [torch.randn(N, generator=torch.Generator().manual_seed(1)).to(dtype)]
    else:
        upstreams = [torch.tensor(u, dtype=dtype) for u in SCALAR_UPSTREAMS]
    for upstream in upstreams:
        check_equal(py, cpp, (hidden, weight, b), grad_of, upstream)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_linear_cross_entropy_retained_graph(kernels, reduction):
    hidden, weight, b, target = lce_inputs(10, 16, 23, torch.float32, True, -100)
    code = REDUCTION_CODE[reduction]
    up = [torch.tensor(2.5), torch.tensor(-3.0)] if code else [torch.rand(10), torch.rand(10)]
    results = []
    for fn in (lambda *xs: autograd.LinearCrossEntropyFunction.apply(*xs, target, 0.1, -100, code, kernels),
               lambda *xs: FF.linear_cross_entropy(*xs, target, 0.1, -100, code)):
        xs = [t.clone().requires_grad_() for t in (hidden, weight, b)]
        loss = fn(*xs)
        g1 = torch.autograd.grad(loss, xs, up[0], retain_graph=True)
        g2 = torch.autograd.grad(loss, xs, up[1])
        results.append((loss.detach(), *g1, *g2))
    for a, b_ in zip(*results):
        assert_bit_equal("linear_cross_entropy", a, b_)


def test_linear_cross_entropy_matches_reference():
    hidden, weight, b, target = lce_inputs(11, 19, 37, torch.float32, True, -100)

    def cpp(h, w, b):
        return FF.linear_cross_entropy(h, w, b, target, 0.1, -100, 1)

    def ref(h, w, b):
        return reference.linear_cross_entropy(h, w, target, linear_bias=b, label_smoothing=0.1, ignore_index=-100,
                                              reduction="mean")

    got = run(cpp, (hidden, weight, b), (0, 1, 2), torch.tensor(0.7))
    want = run(ref, (hidden.double(), weight.double(), b.double()), (0, 1, 2), torch.tensor(0.7, dtype=torch.float64))
    for name, x, y in zip(("loss", "dh", "dw", "db"), (got[0], *got[1]), (want[0], *want[1])):
        assert_close(name, x.double(), y, atol=1e-5, rtol=1e-4)


# ------------------------------------------------------------------------------------------- class weights
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
def test_class_weights_match_python_functions(kernels, reduction, dtype):
    """torch's class weights (fp32, fp64 for fp64) through both C++ ops, every gradient bit-equal."""
    code = REDUCTION_CODE[reduction]
    w = (0.1 + torch.rand(37, generator=torch.Generator().manual_seed(3))).to(
        torch.float64 if dtype == torch.float64 else torch.float32)
    logits, target = ce_inputs(11, 37, dtype, -100)
    hidden, weight, b, lce_target = lce_inputs(11, 19, 37, dtype, True, -100)
    pairs = [
        (lambda x: autograd.CrossEntropyFunction.apply(x, target, 0.1, -100, code, kernels, w),
         lambda x: FF.cross_entropy(x, target, 0.1, -100, code, w), (logits,), (0,)),
        (lambda *xs: autograd.LinearCrossEntropyFunction.apply(*xs, lce_target, 0.1, -100, code, kernels, w),
         lambda *xs: FF.linear_cross_entropy(*xs, lce_target, 0.1, -100, code, w), (hidden, weight, b), (0, 1, 2)),
    ]
    upstream = (torch.randn(11, generator=torch.Generator().manual_seed(1)).to(dtype) if reduction == "none"
                else torch.tensor(2.5, dtype=dtype))
    for py, cpp, inputs, grad_of in pairs:
        check_equal(py, cpp, inputs, grad_of, upstream)


# ------------------------------------------------------------------------------------------- the schemas
def test_schemas_take_the_functions_arguments():
    """Each op's arguments: the Function's apply arguments without kernels (philox in its place)."""
    names = {op: [a.name for a in getattr(FF, op).default._schema.arguments] for op in OPS}
    assert names["attention"] == ["q", "k", "v", "key_padding_mask", "attn_mask", "is_causal", "scale", "dropout_p",
                                  "philox"]
    assert names["attention_varlen"] == ["layout", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k",
                                         "is_causal", "scale", "dropout_p", "philox", "x0", "x1", "x2"]
    assert names["cross_entropy"] == ["logits", "target", "label_smoothing", "ignore_index", "reduction_code",
                                      "class_weight"]
    assert names["linear_cross_entropy"] == ["hidden", "weight", "bias", "target", "label_smoothing",
                                             "ignore_index", "reduction_code", "class_weight"]
    for op in OPS:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"fastformer::{op}", "CompositeImplicitAutograd")


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_probability_targets_match_python_function(kernels, reduction):
    """Class probabilities (not requiring grad) as the target of both C++ ops, with class weights:
    bit-equal to the Functions (those that require grad take the Functions: test_*_soft.py)."""
    hidden, weight, b, _ = lce_inputs(11, 19, 37, torch.float32, True, -100)
    gen = torch.Generator().manual_seed(2)
    q = torch.softmax(torch.randn(11, 37, generator=gen), -1)
    cw = torch.rand(37, generator=gen) + 0.5
    code = REDUCTION_CODE[reduction]
    up = torch.randn(11, generator=gen) if reduction == "none" else torch.tensor(2.5)
    check_equal(lambda h, w, bb: autograd.LinearCrossEntropyFunction.apply(h, w, bb, q, 0.1, -100, code, kernels, cw),
                lambda h, w, bb: FF.linear_cross_entropy(h, w, bb, q, 0.1, -100, code, cw), (hidden, weight, b),
                (0, 1, 2), up)
    logits = hidden @ weight.t()
    check_equal(lambda x: autograd.CrossEntropyFunction.apply(x, q, 0.1, -100, code, kernels, cw),
                lambda x: FF.cross_entropy(x, q, 0.1, -100, code, cw), (logits,), (0,), up)
