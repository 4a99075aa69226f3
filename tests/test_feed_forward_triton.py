"""Triton-only checks of feed_forward that tests/test_feed_forward.py does not make: N, E, F off
the tile sizes (masked tails) and across several tiles, every epilogue of the shared GEMM
(fastformer/triton_kernels/matmul.py) with transposed operands, every GPU autotune config, the bf16
rounding of the stores, the registered torch ops under opcheck / torch.compile, and the host
functions' errors. Without a GPU the kernels run in Triton's interpreter on CPU tensors
(tile 32x32x32 there, so the shapes below cross tile edges with few programs)."""
import math

import pytest
import torch

import fastformer
from fastformer import backends, philox
from fastformer.ops import feed_forward, reference
from utils import assert_close, assert_close_lowp, device_for

if not backends.availability("triton", device_for("triton")):
    pytest.skip(f"triton cannot run here: {backends.availability('triton', device_for('triton')).reason}",
                allow_module_level=True)

from fastformer.triton_kernels import feed_forward as ff  # noqa: E402
from fastformer.triton_kernels import matmul  # noqa: E402

DEVICE = device_for("triton")
GPU = torch.cuda.is_available()
NAMES = ("x", "w1", "b1", "w2", "b2")


def _inputs(N, E, F, has_b1=True, has_b2=True, dtype=torch.float32, device=DEVICE):
    x = torch.randn(N, E, device=device)
    w1 = torch.randn(F, E, device=device) / math.sqrt(E)
    b1 = 0.5 * torch.randn(F, device=device) if has_b1 else None
    w2 = torch.randn(E, F, device=device) / math.sqrt(F)
    b2 = 0.5 * torch.randn(E, device=device) if has_b2 else None
    return tuple(None if t is None else t.to(dtype) for t in (x, w1, b1, w2, b2))


def _reference(inputs, dout, activation, p, rng, dtype=torch.float64):
    """Reference output and gradients (a dict per present input) computed in ``dtype``."""
    leaves = [None if t is None else t.detach().to(dtype).requires_grad_() for t in inputs]
    out = reference.feed_forward(*leaves, activation=activation, dropout_p=p, rng=rng)
    present = [t for t in leaves if t is not None]
    grads = iter(torch.autograd.grad(out, present, dout.to(dtype)))
    return out.detach(), {n: next(grads) for n, t in zip(NAMES, leaves) if t is not None}


def _kernels(inputs, dout, activation, p, seed, offset):
    x, w1, b1, w2, b2 = inputs
    out, pre = ff.feed_forward_fwd(x, w1, b1, w2, b2, activation, p, philox.pack(seed, offset))
    dx, dw1, db1, dw2, db2 = ff.feed_forward_bwd(dout, x, w1, w2, pre, b1 is not None, b2 is not None,
                                                 activation, p, philox.pack(seed, offset))
    grads = {"x": dx, "w1": dw1, "w2": dw2}
    if b1 is not None:
        grads["b1"] = db1
    else:
        assert db1.numel() == 0
    if b2 is not None:
        grads["b2"] = db2
    else:
        assert db2.numel() == 0
    return out, pre, grads


# (N, E, F): one partial tile; tails in every dimension across several tiles; exact multiples of
# the interpreter tile (no tail); more rows than columns with F past the second tile.
TAIL_SHAPES = [(1, 33, 31), (45, 70, 97), (64, 64, 96), (67, 17, 130)]
# (activation, dropout_p, has_b1, has_b2)
EPILOGUES = [("relu", 0.0, True, True), ("gelu", 0.25, True, False), ("relu", 0.5, False, True),
             ("silu", 0.2, False, False)]


@pytest.mark.parametrize("activation,p,has_b1,has_b2", EPILOGUES,
                         ids=[f"{a}-p{p}-b1{int(b1)}-b2{int(b2)}" for a, p, b1, b2 in EPILOGUES])
@pytest.mark.parametrize("N,E,F", TAIL_SHAPES, ids=["x".join(map(str, s)) for s in TAIL_SHAPES])
def test_tails_fp32_forward_and_every_gradient(N, E, F, activation, p, has_b1, has_b2):
    inputs = _inputs(N, E, F, has_b1, has_b2)
    dout = torch.randn(N, E, device=DEVICE)
    seed, offset = 2**40 + 17, 1000
    out, pre, grads = _kernels(inputs, dout, activation, p, seed, offset)
    x, w1, b1 = inputs[:3]
    pre_ref = x.double() @ w1.double().t() + (b1.double() if b1 is not None else 0.0)
    assert_close("pre", pre.double(), pre_ref, atol=1e-5, rtol=1e-5)
    ref, ref_grads = _reference(inputs, dout, activation, p, (seed, offset))
    assert_close("out", out.double(), ref, atol=1e-4, rtol=1e-5)
    assert set(grads) == set(ref_grads)
    for name, g in grads.items():
        assert_close(f"d{name}", g.double(), ref_grads[name], atol=2e-4, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("activation,p", [("relu", 0.3), ("gelu", 0.0), ("silu", 0.2)])
def test_tails_low_precision(dtype, activation, p):
    """FlashAttention's rule: the kernel's error against the fp32 reference (same low-precision
    inputs) is at most twice the error of the reference computed in the low precision."""
    inputs = _inputs(45, 70, 97, dtype=dtype)
    dout = torch.randn(45, 70, device=DEVICE).to(dtype)
    out, _, grads = _kernels(inputs, dout, activation, p, 77, 3)
    ref32, grads32 = _reference(inputs, dout, activation, p, (77, 3), torch.float32)
    ref_lp, grads_lp = _reference(inputs, dout, activation, p, (77, 3), dtype)
    assert out.dtype == dtype
    assert_close_lowp("out", out, ref32, ref_lp)
    for name, g in grads.items():
        assert g.dtype == dtype
        assert_close_lowp(f"d{name}", g, grads32[name], grads_lp[name])


def test_bf16_stores_round_to_nearest_even():
    """Integer operands make the fp32 accumulator exact, so every stored bf16 must equal torch's
    round-to-nearest-even of it: on a GPU the hardware conversion, in the interpreter (which
    truncates) the kernel's emulation."""
    gen = torch.Generator().manual_seed(5)
    a = torch.randint(-9, 10, (37, 64), generator=gen).to(DEVICE, torch.bfloat16)
    b = torch.randint(-9, 10, (64, 45), generator=gen).to(DEVICE, torch.bfloat16)
    bias = torch.randint(-50, 50, (45,), generator=gen).to(DEVICE, torch.bfloat16)
    exact = a.double() @ b.double() + bias.double()
    assert exact.abs().max() > 256  # values with more significant bits than bf16 keeps
    c = torch.empty(37, 45, device=DEVICE, dtype=torch.bfloat16)
    matmul.launch(a, b, c, bias=bias)
    assert torch.equal(c, exact.float().to(torch.bfloat16))
    pre, d = torch.empty_like(c), torch.empty_like(c)
    matmul.launch(a, b, pre, d=d, bias=bias, epilogue="act_fwd", activation="relu")
    assert torch.equal(pre, exact.float().to(torch.bfloat16))
    assert torch.equal(d, pre.clamp_min(0))


def _epilogue_expectations(a, b, bias, pre, activation, p, seed, offset):
    """fp64 expectations of C and D for each epilogue of matmul.launch."""
    acc = a.double() @ b.double() + (bias.double() if bias is not None else 0.0)
    keep = philox.keep_mask(acc.shape, p, seed, offset, device=acc.device).double() / (1 - p)
    act = {"relu": lambda v: v.clamp_min(0),
           "gelu": lambda v: 0.5 * v * (1 + torch.erf(v / math.sqrt(2))),
           "silu": lambda v: v * torch.sigmoid(v)}[activation]
    act_grad = {"relu": lambda v: (v >= 0).double(),
                "gelu": lambda v: 0.5 * (1 + torch.erf(v / math.sqrt(2)))
                + v * torch.exp(-0.5 * v * v) / math.sqrt(2 * math.pi),
                "silu": lambda v: torch.sigmoid(v) * (1 + v * (1 - torch.sigmoid(v)))}[activation]
    pre64 = pre.double()
    return {
        "none": (acc, None),
        "act_fwd": (acc, act(acc.to(a.dtype).double()) * keep),
        "act_bwd": (acc * act_grad(pre64) * keep, act(pre64) * keep),
    }


def _configs():
    for dtype, configs in ((torch.bfloat16, matmul.CONFIGS_16BIT), (torch.float32, matmul.CONFIGS_32BIT)):
        for config in configs:
            kw = config.kwargs
            yield pytest.param(dtype, config, id=f"{str(dtype)[6:]}-{kw['BLOCK_M']}x{kw['BLOCK_N']}x"
                                                 f"{kw['BLOCK_K']}-w{config.num_warps}-s{config.num_stages}")


@pytest.mark.parametrize("dtype,config", list(_configs()))
def test_every_autotune_config_and_epilogue(dtype, config):
    """Each GPU autotune config, forced, on a problem one row and one column past its tile, for
    every epilogue, operand layout (NT, NN, TN) and the fused row sums (the bias gradient)."""
    kw = config.kwargs
    M, N, K = kw["BLOCK_M"] + 1, kw["BLOCK_N"] + 3, 2 * kw["BLOCK_K"] + 5
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-4, rtol=1e-5)
    if GPU and dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32:
        tol = dict(atol=2e-2, rtol=2e-2)
    a = torch.randn(M, K, device=DEVICE).to(dtype)
    w = torch.randn(N, K, device=DEVICE).to(dtype) / math.sqrt(K)  # B = w^T: the NT layout
    bias = torch.randn(N, device=DEVICE).to(dtype)
    pre = torch.randn(M, N, device=DEVICE).to(dtype)
    seed, offset, p = 99, 5, 0.4
    want = _epilogue_expectations(a, w.t(), bias, pre, "gelu", p, seed, offset)
    for epilogue in ("none", "act_fwd", "act_bwd"):
        c = torch.empty(M, N, device=DEVICE, dtype=dtype)
        d = torch.empty_like(c) if epilogue != "none" else None
        matmul.launch(a, w.t(), c, d=d, pre=pre if epilogue == "act_bwd" else None,
                      bias=bias if epilogue != "act_bwd" else None, epilogue=epilogue,
                      activation="gelu", dropout_p=p, seed=seed, offset=offset, config=config)
        if epilogue == "act_bwd":  # no bias in this epilogue: recompute the expectation without
            want_c, want_d = _epilogue_expectations(a, w.t(), None, pre, "gelu", p, seed, offset)[epilogue]
        else:
            want_c, want_d = want[epilogue]
        assert_close(f"{epilogue} C", c.double(), want_c, **tol)
        if want_d is not None:
            assert_close(f"{epilogue} D", d.double(), want_d, **tol)
    # TN with row sums: C = Y^T X, rowsum = Y.sum(0) (the weight and bias gradients)
    y = torch.randn(K, M, device=DEVICE).to(dtype)
    x = torch.randn(K, N, device=DEVICE).to(dtype)
    c = torch.empty(M, N, device=DEVICE, dtype=dtype)
    rowsum = torch.empty(M, device=DEVICE, dtype=dtype)
    matmul.launch(y.t(), x, c, rowsum=rowsum, config=config)
    assert_close("TN C", c.double(), y.double().t() @ x.double(), **tol)
    assert_close("row sums", rowsum.double(), y.double().sum(0), **tol)
    # NN: C = A @ B with both row-major
    bnn = torch.randn(K, N, device=DEVICE).to(dtype)
    matmul.launch(a, bnn, c, config=config)
    assert_close("NN C", c.double(), a.double() @ bnn.double(), **tol)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # the interpreter's numpy
def test_silu_epilogue_saturates_without_nan():
    """silu's sigmoid is 1 / (1 + exp(-x)): far below 0, exp(-x) overflows to inf and the
    activation and its gradient go to 0 (not NaN); far above 0, to x and 1."""
    vals = torch.randn(16, 40, generator=torch.Generator().manual_seed(3)).bfloat16().float()
    vals[0, :8] = torch.tensor([-1000.0, -100.0, -88.5, -20.0, 20.0, 88.5, 100.0, 1000.0])
    # C = I vals = vals exactly, in tf32 too (bf16 values)
    vals, eye = vals.to(DEVICE), torch.eye(16, device=DEVICE)
    seed, offset, p = 7, 3, 0.25
    c, d = torch.empty_like(vals), torch.empty_like(vals)
    matmul.launch(eye, vals, c, d=d, epilogue="act_fwd", activation="silu", dropout_p=p, seed=seed,
                  offset=offset)
    want_c, want_d = _epilogue_expectations(eye, vals, None, vals, "silu", p, seed, offset)["act_fwd"]
    assert_close("act_fwd C", c.double(), want_c, atol=1e-5, rtol=1e-5)
    assert_close("act_fwd D", d.double(), want_d, atol=1e-5, rtol=1e-5)
    dd = torch.ones_like(vals)  # C = I 1: the gradient factor itself
    matmul.launch(eye, dd, c, d=d, pre=vals, epilogue="act_bwd", activation="silu", dropout_p=p,
                  seed=seed, offset=offset)
    want_c, want_d = _epilogue_expectations(eye, dd, None, vals, "silu", p, seed, offset)["act_bwd"]
    assert not c.isnan().any() and not d.isnan().any()
    assert_close("act_bwd C", c.double(), want_c, atol=1e-5, rtol=1e-5)
    assert_close("act_bwd D", d.double(), want_d, atol=1e-5, rtol=1e-5)


def test_empty_reduction_gives_bias_and_zero_row_sums():
    """K = 0 still launches: C = bias, row sums 0 (the weight gradients of zero tokens)."""
    a = torch.empty(5, 0, device=DEVICE)
    b = torch.empty(0, 7, device=DEVICE)
    bias = torch.randn(7, device=DEVICE)
    c = torch.full((5, 7), float("nan"), device=DEVICE)
    rowsum = torch.full((5,), float("nan"), device=DEVICE)
    matmul.launch(a, b, c, bias=bias, rowsum=rowsum)
    assert torch.equal(c, bias.expand(5, 7))
    assert torch.equal(rowsum, torch.zeros(5, device=DEVICE))


def test_zero_rows_through_the_functional_op():
    x = torch.randn(0, 8, device=DEVICE, requires_grad=True)
    w1 = torch.randn(16, 8, device=DEVICE, requires_grad=True)
    b1 = torch.randn(16, device=DEVICE, requires_grad=True)
    w2 = torch.randn(8, 16, device=DEVICE, requires_grad=True)
    b2 = torch.randn(8, device=DEVICE, requires_grad=True)
    with fastformer.use_backend("triton"):
        out = feed_forward(x, w1, b1, w2, b2, activation="gelu", dropout_p=0.1)
    (out.sum() + 0.0).backward()
    assert out.shape == (0, 8)
    for t in (w1, b1, w2, b2):
        assert torch.equal(t.grad, torch.zeros_like(t))


def test_functional_op_runs_the_triton_kernels():
    """use_backend("triton") reaches these kernels (the result carries their pre-activation
    rounding only in low precision, so check the backend choice and the values)."""
    x, w1, b1, w2, b2 = _inputs(9, 24, 40)
    assert backends.resolve("feed_forward", x.device, x.dtype) in ("cpu", "triton", "reference")
    with fastformer.use_backend("triton"):
        assert backends.resolve("feed_forward", x.device, x.dtype) == "triton"
        torch.manual_seed(8)
        out = feed_forward(x, w1, b1, w2, b2, activation="gelu", dropout_p=0.2)
    torch.manual_seed(8)
    rng = philox.next_seed()
    ref = reference.feed_forward(x, w1, b1, w2, b2, activation="gelu", dropout_p=0.2, rng=rng)
    assert_close("out", out, ref, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- registered ops


def _op_args(dtype, biases, activation, p):
    x, w1, b1, w2, b2 = _inputs(6, 24, 40, biases, biases, dtype=dtype)
    fwd = (x, w1, b1, w2, b2, activation, p, philox.pack(5, 2))
    _, pre = ff.feed_forward_fwd(*fwd)
    bwd = (torch.randn_like(x), x, w1, w2, pre, biases, biases, activation, p, philox.pack(5, 2))
    return fwd, bwd


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation,p,biases", [("relu", 0.2, True), ("gelu", 0.0, False)])
def test_registered_ops_opcheck(dtype, activation, p, biases):
    ops = torch.ops.fastformer_triton
    fwd, bwd = _op_args(dtype, biases, activation, p)
    torch.library.opcheck(ops.feed_forward_fwd.default, fwd)
    torch.library.opcheck(ops.feed_forward_bwd.default, bwd)


def test_registered_ops_compile_without_graph_breaks():
    """torch.compile(fullgraph=True) traces both ops (interpreter: the custom_op's fake; GPU:
    triton_op) and gives the eager results."""
    ops = torch.ops.fastformer_triton
    fwd, bwd = _op_args(torch.float32, True, "gelu", 0.3)

    def both(x, w1, b1, w2, b2, dout):
        out, pre = ops.feed_forward_fwd(x, w1, b1, w2, b2, "gelu", 0.3, philox.pack(5, 2))
        grads = ops.feed_forward_bwd(dout, x, w1, w2, pre, True, True, "gelu", 0.3, philox.pack(5, 2))
        return (out * 2.0, *grads)

    torch._dynamo.reset()
    compiled = torch.compile(both, fullgraph=True, backend="inductor" if GPU else "aot_eager")
    args = (*fwd[:5], bwd[0])
    for got, want in zip(compiled(*args), both(*args)):
        assert_close("compiled", got, want, atol=1e-6, rtol=1e-6)


# ---------------------------------------------------------------- host errors, AOT specs


def test_host_functions_name_the_bad_argument():
    x, w1, b1, w2, b2 = _inputs(4, 8, 16)
    with pytest.raises(ValueError, match="w1 must be"):
        ff.feed_forward_fwd(x, w1[:, :5], b1, w2, b2, "relu", 0.0, philox.pack(0, 0))
    with pytest.raises(ValueError, match="w2 must be"):
        ff.feed_forward_fwd(x, w1, b1, w2.t(), b2, "relu", 0.0, philox.pack(0, 0))
    with pytest.raises(ValueError, match="b1 must be"):
        ff.feed_forward_fwd(x, w1, b2, w2, b2, "relu", 0.0, philox.pack(0, 0))
    with pytest.raises(TypeError, match="w2 is torch.bfloat16"):
        ff.feed_forward_fwd(x, w1, b1, w2.bfloat16(), b2, "relu", 0.0, philox.pack(0, 0))
    with pytest.raises(TypeError, match="x must be float32, float16 or bfloat16"):
        ff.feed_forward_fwd(x.double(), w1.double(), None, w2.double(), None, "relu", 0.0, philox.pack(0, 0))
    with pytest.raises(ValueError, match="activation must be one of"):
        ff.feed_forward_fwd(x, w1, b1, w2, b2, "tanh", 0.0, philox.pack(0, 0))
    with pytest.raises(ValueError, match=r"dropout_p must be in \[0, 1\)"):
        ff.feed_forward_fwd(x, w1, b1, w2, b2, "relu", 1.0, philox.pack(0, 0))
    with pytest.raises(ValueError, match=r"the philox offset philox\[1\] must be >= 0, got -3"):
        ff.feed_forward_fwd(x, w1, b1, w2, b2, "relu", 0.5, torch.tensor([0, -3]))
    with pytest.raises(TypeError, match="philox must be an int64 CPU tensor"):
        ff.feed_forward_fwd(x, w1, b1, w2, b2, "relu", 0.5, torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"philox must have shape \(2,\)"):
        ff.feed_forward_fwd(x, w1, b1, w2, b2, "relu", 0.5, torch.zeros(1, 2, dtype=torch.int64))
    _, pre = ff.feed_forward_fwd(x, w1, b1, w2, b2, "relu", 0.0, philox.pack(0, 0))
    with pytest.raises(ValueError, match="pre must be"):
        ff.feed_forward_bwd(x, x, w1, w2, pre[:, :3], True, True, "relu", 0.0, philox.pack(0, 0))
    with pytest.raises(ValueError, match="dout must be"):
        ff.feed_forward_bwd(x[:2], x, w1, w2, pre, True, True, "relu", 0.0, philox.pack(0, 0))


def test_aot_specs_cover_every_autotune_config():
    """fastformer.triton_kernels.aot compiles these: every GPU config of bf16 and fp32 for the four kernels
    that differ in code, each spec typing every argument of the kernel."""
    specs = ff.aot_specs()
    for spec in specs:
        assert set(spec["signature"]) == set(spec["fn"].arg_names), spec["name"]
        assert all(spec["signature"][k] == "constexpr" for k in spec["constexprs"]), spec["name"]
        assert spec["num_warps"] in (4, 8) and spec["num_stages"] >= 1
    for dtype, configs in (("bf16", matmul.CONFIGS_16BIT), ("fp32", matmul.CONFIGS_32BIT)):
        for config in configs:
            kw = config.kwargs
            tile = f"{kw['BLOCK_M']}x{kw['BLOCK_N']}x{kw['BLOCK_K']},w{config.num_warps},s{config.num_stages}"
            for kernel in ("linear1_gelu", "dpre_gelu", "linear2", "dweight_dbias"):
                assert any(kernel in s["name"] and f"[{dtype},{tile}]" in s["name"] for s in specs), \
                    (kernel, dtype, tile)
    epilogues = [s["constexprs"] for s in specs if s["constexprs"].get("EPILOGUE", "none") != "none"]
    assert {c["ACTIVATION"] for c in epilogues} == set(ff.ACTIVATIONS)  # every activation's epilogue
    glu = {(s["fn"].fn.__name__ if hasattr(s["fn"], "fn") else s["fn"].__name__) for s in specs if "glu" in s["name"]}
    assert glu == {"_glu_fwd", "_glu_bwd"}, glu  # the gated form's elementwise kernels
    assert {s["signature"]["a_ptr"] for s in specs if "a_ptr" in s["signature"]} == {"*fp32", "*fp16", "*bf16"}


def test_every_column_tile_holds_whole_dropout_groups():
    """The dropout epilogue draws one Philox call per 8 columns of a tile starting at
    pid_n * BLOCK_N: every config's BLOCK_N (GPU and interpreter) must be a multiple of 8."""
    for config in matmul.CONFIGS_16BIT + matmul.CONFIGS_32BIT + matmul.CONFIGS_INTERPRET:
        assert config.kwargs["BLOCK_N"] % 8 == 0, config


# ---------------------------------------------------------------- GPU only


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_transformer_sizes_low_precision(dtype):
    """Autotuned compiled kernels at training sizes (tokens off the tile sizes)."""
    inputs = _inputs(2053, 1024, 4096, dtype=dtype, device="cuda")
    dout = torch.randn(2053, 1024, device="cuda").to(dtype)
    out, _, grads = _kernels(inputs, dout, "gelu", 0.1, 123, 0)
    ref32, grads32 = _reference(inputs, dout, "gelu", 0.1, (123, 0), torch.float32)
    ref_lp, grads_lp = _reference(inputs, dout, "gelu", 0.1, (123, 0), dtype)
    assert_close_lowp("out", out, ref32, ref_lp)
    for name, g in grads.items():
        assert_close_lowp(f"d{name}", g, grads32[name], grads_lp[name])


@pytest.mark.gpu
@pytest.mark.parametrize("allow_tf32", [False, True])
def test_gpu_fp32_matmul_precision(allow_tf32):
    """fp32 follows torch.backends.cuda.matmul.allow_tf32: ieee by default, tf32 when allowed."""
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = allow_tf32
    try:
        inputs = _inputs(1031, 512, 2048, device="cuda")
        dout = torch.randn(1031, 512, device="cuda")
        out, _, grads = _kernels(inputs, dout, "relu", 0.0, 0, 0)
        ref, ref_grads = _reference(inputs, dout, "relu", 0.0, (0, 0))
        tol = dict(atol=5e-2, rtol=1e-2) if allow_tf32 else dict(atol=1e-3, rtol=1e-4)
        assert_close("out", out.double(), ref, **tol)
        for name, g in grads.items():
            assert_close(f"d{name}", g.double(), ref_grads[name], **tol)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous
