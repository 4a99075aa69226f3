"""Split-K in the Triton feed-forward GEMMs (fastformer/triton_kernels/matmul.py): a GEMM whose (M, N) tiles
cannot fill the GPU's SMs cuts K into slices, writes one fp32 partial per slice and sums them in
a fixed order in a second kernel that applies the epilogue. Checked here: the feed-forward's
forward and every gradient with the split forced on every GEMM (odd shapes, biases, dropout, fp32
and 16-bit) against the reference, the split taken automatically for a long-K weight gradient,
bit-identical results run to run, and the chooser's split counts. Without a GPU the kernels run
in Triton's interpreter (32x32x32 tiles; the SM count is taken as an H100's 132)."""
import math

import pytest
import torch

from fastformer import backends, philox
from fastformer.ops import reference
from utils import assert_close, assert_close_lowp, device_for

if not backends.availability("triton", device_for("triton")):
    pytest.skip(f"triton cannot run here: {backends.availability('triton', device_for('triton')).reason}",
                allow_module_level=True)

from fastformer.triton_kernels import feed_forward as ff  # noqa: E402
from fastformer.triton_kernels import matmul  # noqa: E402

DEVICE = device_for("triton")
NAMES = ("x", "w1", "b1", "w2", "b2")


def _inputs(N, E, F, has_b1, has_b2, dtype):
    x = torch.randn(N, E, device=DEVICE)
    w1 = torch.randn(F, E, device=DEVICE) / math.sqrt(E)
    b1 = 0.5 * torch.randn(F, device=DEVICE) if has_b1 else None
    w2 = torch.randn(E, F, device=DEVICE) / math.sqrt(F)
    b2 = 0.5 * torch.randn(E, device=DEVICE) if has_b2 else None
    return tuple(None if t is None else t.to(dtype) for t in (x, w1, b1, w2, b2))


def _reference(inputs, dout, activation, p, rng, dtype):
    leaves = [None if t is None else t.detach().to(dtype).requires_grad_() for t in inputs]
    out = reference.feed_forward(*leaves, activation=activation, dropout_p=p, rng=rng)
    present = [t for t in leaves if t is not None]
    grads = iter(torch.autograd.grad(out, present, dout.to(dtype)))
    return out.detach(), {n: next(grads) for n, t in zip(NAMES, leaves) if t is not None}


@pytest.fixture
def launches(monkeypatch):
    """Records (K, slices) of every matmul.launch the feed-forward host functions make."""
    calls = []
    original = matmul.launch

    def recording(a, b, c, **kwargs):
        splits = original(a, b, c, **kwargs)
        calls.append((a.shape[1], splits))
        return splits

    monkeypatch.setattr(matmul, "launch", recording)
    return calls


def _run(inputs, dout, activation, p, seed, offset):
    x, w1, b1, w2, b2 = inputs
    out, pre = ff.feed_forward_fwd(x, w1, b1, w2, b2, activation, p, philox.pack(seed, offset))
    dx, dw1, db1, dw2, db2 = ff.feed_forward_bwd(dout, x, w1, w2, pre, b1 is not None, b2 is not None,
                                                 activation, p, philox.pack(seed, offset))
    grads = {"x": dx, "w1": dw1, "w2": dw2}
    if b1 is not None:
        grads["b1"] = db1
    if b2 is not None:
        grads["b2"] = db2
    return out, pre, grads


# (N tokens, E, F, dtype, activation, dropout_p, has_b1, has_b2): N = 1 (weight gradients with K = 1
# cannot split), 7, 259 and 1023 (long token reductions); E and F off the tile sizes.
FORCED = [
    (1, 33, 70, torch.float32, "gelu", 0.25, True, True),
    (7, 40, 97, torch.bfloat16, "relu", 0.3, True, True),
    (259, 24, 40, torch.float32, "relu", 0.5, True, False),
    (1023, 19, 45, torch.float16, "gelu", 0.1, False, True),
    (7, 33, 50, torch.bfloat16, "silu", 0.2, True, True),
]


@pytest.mark.parametrize("N,E,F,dtype,activation,p,has_b1,has_b2", FORCED,
                         ids=[f"{n}x{e}x{f}-{str(dt)[6:]}-{a}-p{p}-b1{int(b1)}-b2{int(b2)}"
                              for n, e, f, dt, a, p, b1, b2 in FORCED])
@pytest.mark.slow
def test_forced_split_forward_and_every_gradient(monkeypatch, launches, N, E, F, dtype, activation, p,
                                                  has_b1, has_b2):
    """FORCE_SPLIT_K = 3 on all six GEMMs: each one with K longer than one BLOCK_K step runs 2 or 3
    slices (whole BLOCK_K steps, none empty), and every output matches the reference."""
    monkeypatch.setattr(matmul, "FORCE_SPLIT_K", 3)
    inputs = _inputs(N, E, F, has_b1, has_b2, dtype)
    dout = torch.randn(N, E, device=DEVICE).to(dtype)
    seed, offset = 2**33 + 5, 77
    out, pre, grads = _run(inputs, dout, activation, p, seed, offset)

    block_k = matmul.split_k_config(dtype).kwargs["BLOCK_K"]
    # forward: K = E, F; backward: dpre (K = E), dw2 and dw1 (K = N tokens), dx (K = F)
    assert [k for k, _ in launches] == [E, F, E, N, N, F]
    for k, splits in launches:
        assert splits == 1 if k <= block_k else 2 <= splits <= 3, (k, splits)
    assert any(s > 1 for _, s in launches)

    x, w1, b1 = inputs[:3]
    pre_ref = x.double() @ w1.double().t() + (b1.double() if b1 is not None else 0.0)
    if dtype == torch.float32:
        assert_close("pre", pre.double(), pre_ref, atol=1e-5, rtol=1e-5)
        ref, ref_grads = _reference(inputs, dout, activation, p, (seed, offset), torch.float64)
        assert_close("out", out.double(), ref, atol=1e-4, rtol=1e-5)
        assert set(grads) == set(ref_grads)
        for name, g in grads.items():
            assert_close(f"d{name}", g.double(), ref_grads[name], atol=2e-4, rtol=1e-5)
    else:
        ref32, grads32 = _reference(inputs, dout, activation, p, (seed, offset), torch.float32)
        ref_lp, grads_lp = _reference(inputs, dout, activation, p, (seed, offset), dtype)
        assert out.dtype == dtype and pre.dtype == dtype
        assert_close_lowp("out", out, ref32, ref_lp)
        assert set(grads) == set(grads32)
        for name, g in grads.items():
            assert g.dtype == dtype
            assert_close_lowp(f"d{name}", g, grads32[name], grads_lp[name])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_long_token_weight_gradient_splits_by_itself(dtype):
    """No override: dW = dY^T A with 4099 tokens (K) and a 24 x 40 weight (two 32 x 32 tiles) splits
    on 132 SMs into as many >= 256-long slices as K holds, and the bias gradient fused into it
    (the row sums of dY^T) is still right."""
    N, E, F = 4099, 24, 40
    dy = torch.randn(N, E, device=DEVICE).to(dtype)
    a = torch.randn(N, F, device=DEVICE).to(dtype)
    dw = torch.empty(E, F, device=DEVICE, dtype=dtype)
    db = torch.empty(E, device=DEVICE, dtype=dtype)
    splits = matmul.launch(dy.t(), a, dw, rowsum=db)
    # 2 tiles would want 66 slices on 132 SMs; K = 4099 holds 16 of >= 256, fewer once cut to whole
    # BLOCK_K steps
    assert 12 <= splits <= 16, splits
    want_dw, want_db = dy.double().t() @ a.double(), dy.double().sum(0)
    if dtype == torch.float32:
        assert_close("dW", dw.double(), want_dw, atol=1e-3, rtol=1e-5)
        assert_close("db", db.double(), want_db, atol=1e-3, rtol=1e-5)
    else:  # the reference in bf16 sums 4099 products in bf16: its error is the yardstick
        assert_close_lowp("dW", dw, want_dw.float(), (dy.t() @ a).float())
        assert_close_lowp("db", db, want_db.float(), dy.sum(0).float())


def test_split_results_are_bit_identical_run_to_run(monkeypatch):
    """The partial sums are added in slice order by one program per output block (no atomics):
    two runs give the same bits."""
    monkeypatch.setattr(matmul, "FORCE_SPLIT_K", 4)
    inputs = _inputs(100, 24, 72, True, True, torch.bfloat16)
    dout = torch.randn(100, 24, device=DEVICE).to(torch.bfloat16)
    first = _run(inputs, dout, "gelu", 0.2, 11, 3)
    second = _run(inputs, dout, "gelu", 0.2, 11, 3)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    for name in first[2]:
        assert torch.equal(first[2][name], second[2][name]), name


def test_split_matmul_with_empty_reduction_and_a_single_slice():
    """K = 0 with a split asked for: no slices, C = bias and row sums 0. K within one BLOCK_K
    step: one slice, so no split (the plain kernel)."""
    bias = torch.randn(7, device=DEVICE)
    c = torch.full((5, 7), float("nan"), device=DEVICE)
    rowsum = torch.full((5,), float("nan"), device=DEVICE)
    assert matmul.launch(torch.empty(5, 0, device=DEVICE), torch.empty(0, 7, device=DEVICE), c, bias=bias,
                         rowsum=rowsum, split_k=4) == 1
    assert torch.equal(c, bias.expand(5, 7)) and torch.equal(rowsum, torch.zeros(5, device=DEVICE))
    a, b = torch.randn(5, 9, device=DEVICE), torch.randn(9, 7, device=DEVICE)
    assert matmul.launch(a, b, c, split_k=4) == 1
    assert_close("C", c.double(), a.double() @ b.double(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("M,N,K,sms,want", [
    # dw1 of E = 512, F = 2048: 64 tiles. 3 slices = 192 programs, a second wave of 60 on 132 SMs
    # (as slow as two full waves); 4 slices = 256 programs fill two waves to 97 %
    (2048, 512, 4096, 132, 4),
    (512, 2048, 65536, 108, 3),  # dw2 on an A100's 108 SMs: 3 x 64 = 192 programs, 89 % of 2 waves
    (640, 1280, 65536, 132, 5),  # 50 tiles: 3 (57 %) and 4 (76 %) leave waves empty, 5 fill 95 %
    (2048, 2048, 65536, 132, 1),  # 256 tiles already fill 132 SMs
    (512, 512, 300, 132, 1),  # 16 tiles but K = 300 holds a single 256-long slice
    (128, 128, 1024, 132, 4),  # one tile; K = 1024 holds at most 4 slices of 256
    (1408, 1408, 65536, 1024, 8),  # 121 tiles want 9 slices; 64 MiB of workspace holds 8
])
def test_chooser(M, N, K, sms, want):
    splits = matmul.choose_split_k(M, N, K, sms, 128, 128, 64)
    assert splits == want
    if splits > 1:
        assert splits * 4 * M * N <= matmul.SPLIT_K_WORKSPACE_BYTES
        assert K / splits >= matmul.MIN_K_PER_SPLIT


def test_sm_count_of_cpu_tensors_is_an_h100s():
    assert matmul.sm_count(torch.device("cpu")) == 132


def test_aot_specs_cover_the_split_k_launches():
    """fastformer.triton_kernels.aot compiles both split-K passes at the configs the host launches: the first
    pass in each operand layout (TN with row sums for the weight gradients), the second pass for
    each epilogue, in bf16 and fp32, every argument typed."""
    specs = [s for s in ff.aot_specs() if s["fn"] in (matmul._matmul_split_k, matmul._split_k_reduce)]
    for spec in specs:
        assert set(spec["signature"]) == set(spec["fn"].arg_names), spec["name"]
        assert all(spec["signature"][k] == "constexpr" for k in spec["constexprs"]), spec["name"]
    for dt, config in (("*bf16", matmul.SPLIT_K_CONFIG_16BIT), ("*fp32", matmul.SPLIT_K_CONFIG_32BIT)):
        partial = [s for s in specs if s["fn"] is matmul._matmul_split_k and s["signature"]["a_ptr"] == dt]
        assert all((s["num_warps"], s["num_stages"]) == (config.num_warps, config.num_stages)
                   and {k: s["constexprs"][k] for k in config.kwargs} == config.kwargs for s in partial)
        layouts = {(s["signature"]["stride_am"], s["signature"]["stride_bn"], s["constexprs"]["ROW_SUM_A"])
                   for s in partial}
        # TN (A column-major) with row sums; NT (B = W^T: stride_bn not 1); NN
        assert layouts == {("constexpr", "constexpr", True), ("i32", "i32", False),
                           ("i32", "constexpr", False)}
        reduce = [s["constexprs"] for s in specs
                  if s["fn"] is matmul._split_k_reduce and s["signature"]["c_ptr"] == dt]
        assert {(c["EPILOGUE"], c["HAS_BIAS"], c["ROW_SUM_A"]) for c in reduce} == {
            ("none", False, True), ("none", True, False), ("act_fwd", True, False), ("act_bwd", False, False)}
        red = matmul.REDUCE_CONFIG.kwargs
        assert all({k: c[k] for k in red} == red for c in reduce)


def test_reduce_blocks_hold_whole_dropout_groups():
    """The second pass draws the dropout mask per block of columns starting at pid_n * BLOCK_N:
    one Philox call per 8 columns, so BLOCK_N must be a multiple of 8."""
    for config in (matmul.REDUCE_CONFIG, matmul.REDUCE_CONFIG_INTERPRET):
        assert config.kwargs["BLOCK_N"] % 8 == 0, config
