"""Triton-only checks of add_layer_norm, cross_entropy and linear_cross_entropy that the per-op
files do not make: the masked path of non-power-of-two hidden sizes, V across several BLOCK_V
steps, rows across the dweight/dbias partial-sum boundaries, linear_cross_entropy across row
chunks, the registered torch ops under opcheck / torch.compile, and the host functions' errors.
Without a GPU the kernels run in Triton's interpreter on CPU tensors (small shapes)."""
import math

import pytest
import torch
import torch.nn.functional as F

from fastformer import backends, philox
from fastformer.ops import reference
from utils import assert_close, assert_close_lowp, device_for

if not backends.availability("triton", device_for("triton")):
    pytest.skip(f"triton cannot run here: {backends.availability('triton', device_for('triton')).reason}",
                allow_module_level=True)

from fastformer.triton_kernels import add_layer_norm as aln  # noqa: E402
from fastformer.triton_kernels import cross_entropy as ce  # noqa: E402

DEVICE = device_for("triton")
# The interpreter rounds fp32 -> bf16/fp16 by truncation (a whole ulp, not half): twice the factor.
LOWP_FACTOR = 2.0 if torch.cuda.is_available() else 4.0
REDUCTION = {0: "none", 1: "mean", 2: "sum"}


def _rand(*shape, dtype=torch.float32, scale=1.0):
    return (scale * torch.randn(*shape, device=DEVICE)).to(dtype)


# ---------------------------------------------------------------- add_layer_norm


def _ln_reference(x, r, w, b, p, rng, dy, dh):
    """Reference y, h and the gradients of (x, r, w, b) in float64, for upstream dy (and dh)."""
    leaves = [t.double().requires_grad_() for t in (x, r, w, b)]
    y, h = reference.add_layer_norm(*leaves, 1e-5, p, prenorm=True, rng=rng)
    loss = (y * dy.double()).sum() + ((h * dh.double()).sum() if dh is not None else 0.0)
    return (y.detach(), h.detach()), torch.autograd.grad(loss, leaves)


@pytest.mark.parametrize("C", [1, 7, 100, 1023])
@pytest.mark.parametrize("p", [0.0, 0.3])
def test_add_layer_norm_masked_columns(C, p):
    """C below the power-of-two block: mean and variance over the C real columns only, and the
    forward and every gradient as the reference (fp32, the kernel functions directly)."""
    N, seed, offset = 6, 2**41 + 5, 13
    x, r = _rand(N, C, scale=2.0), _rand(N, C)
    w, b = 1.0 + _rand(C), _rand(C)
    y, h, mean, rstd = aln.add_layer_norm_fwd(x, r, w, b, 1e-5, p, philox.pack(seed, offset))
    var, mu = torch.var_mean(h.double(), dim=1, unbiased=False)
    assert_close("mean", mean.double(), mu, atol=1e-6, rtol=1e-6)
    assert_close("rstd", rstd.double(), torch.rsqrt(var + 1e-5), atol=1e-5, rtol=1e-5)
    dy, dh = _rand(N, C), _rand(N, C)
    (y_ref, h_ref), grads = _ln_reference(x, r, w, b, p, (seed, offset), dy, dh)
    assert_close("y", y.double(), y_ref, atol=2e-5, rtol=1e-5)
    assert_close("h", h.double(), h_ref, atol=1e-6, rtol=1e-6)
    dx, dres, dw, db = aln.add_layer_norm_bwd(dy, dh, h, w, mean, rstd, p, philox.pack(seed, offset), True)
    if p == 0.0:
        assert dres.numel() == 0  # the residual's gradient is dx
        dres = dx
    for name, got, want in zip(("dx", "dresidual", "dweight", "dbias"), (dx, dres, dw, db), grads):
        assert_close(name, got.double(), want, atol=1e-4, rtol=1e-5)


def test_add_layer_norm_partial_rows_policy():
    """The interpreter's backward uses 4 row blocks: 10 rows split 3 + 3 + 3 + 1, 5 rows 2 + 2 + 1
    (no empty program), fewer rows than blocks one row each."""
    cpu = torch.device("cpu")
    assert aln._partial_rows(10, cpu) == (3, 4)
    assert aln._partial_rows(5, cpu) == (2, 3)
    assert aln._partial_rows(3, cpu) == (1, 3)
    assert aln._partial_rows(1, cpu) == (1, 1)


@pytest.mark.parametrize("N,C,partial", [(10, 9, None), (5, 130, None), (70, 200, (1, 70)),
                                         (37, 33, (2, 19))])
def test_add_layer_norm_dweight_dbias_across_partial_blocks(monkeypatch, N, C, partial):
    """Rows split unevenly over the per-program partial sums; with more partial rows than the
    reduction's BLOCK_G (70, 19 + its tail) and more columns than its BLOCK_N (130, 200)."""
    if partial is not None:
        monkeypatch.setattr(aln, "_partial_rows", lambda n, device: partial)
    x, w, b = _rand(N, C), 1.0 + _rand(C), _rand(C)
    _, h, mean, rstd = aln.add_layer_norm_fwd(x, None, w, b, 1e-5, 0.0, philox.pack(0, 0))
    dy = _rand(N, C)
    dx, dres, dw, db = aln.add_layer_norm_bwd(dy, None, h, w, mean, rstd, 0.0, philox.pack(0, 0), False)
    assert dres.numel() == 0
    _, (gx, _, gw, gb) = _ln_reference(x, torch.zeros_like(x), w, b, 0.0, None, dy, None)
    assert_close("dx", dx.double(), gx, atol=1e-4, rtol=1e-5)
    assert_close("dweight", dw.double(), gw, atol=1e-4, rtol=1e-5)
    assert_close("dbias", db.double(), gb, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("N,C,chunk", [(7, 100, 32), (3, 45, 16)])
def test_add_layer_norm_wide_rows_chunked_backward(monkeypatch, N, C, chunk):
    """Rows with BLOCK_C >= SPLIT_BLOCK_C (16384 on a GPU) take the column-chunked backward (row
    sums over the chunks, then dx chunk by chunk, the dropout mask regenerated per chunk) and the
    separate dweight/dbias partials kernel. Forced here on small rows with a ragged last chunk,
    with a residual, dropout and dh; the row kernel is made unusable so the test fails if taken."""
    monkeypatch.setattr(aln, "SPLIT_BLOCK_C", 16)
    monkeypatch.setattr(aln, "_CHUNK_C", chunk)
    monkeypatch.setattr(aln, "_PART_BLOCK_N", 32)
    monkeypatch.setattr(aln, "_add_layer_norm_bwd", None)
    monkeypatch.setattr(aln, "_partial_rows", lambda n, device: (2, math.ceil(n / 2)))
    p, seed, offset = 0.25, 2**33 + 1, 2**32 - 3
    x, r = _rand(N, C, scale=2.0), _rand(N, C)
    w, b = 1.0 + _rand(C), _rand(C)
    y, h, mean, rstd = aln.add_layer_norm_fwd(x, r, w, b, 1e-5, p, philox.pack(seed, offset))
    dy, dh = _rand(N, C), _rand(N, C)
    _, grads = _ln_reference(x, r, w, b, p, (seed, offset), dy, dh)
    dx, dres, dw, db = aln.add_layer_norm_bwd(dy, dh, h, w, mean, rstd, p, philox.pack(seed, offset),
                                                          True)
    for name, got, want in zip(("dx", "dresidual", "dweight", "dbias"), (dx, dres, dw, db), grads):
        assert_close(name, got.double(), want, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_add_layer_norm_low_precision_dtypes(dtype):
    """fp16 and bf16 storage, fp32 statistics (fp32 mean/rstd, dweight in the weight dtype)."""
    N, C, p, rng = 5, 77, 0.2, (99, 0)
    x, r = _rand(N, C, dtype=dtype), _rand(N, C, dtype=dtype)
    w, b = (1.0 + _rand(C)).to(dtype), _rand(C, dtype=dtype)
    dy = _rand(N, C, dtype=dtype)
    y, h, mean, rstd = aln.add_layer_norm_fwd(x, r, w, b, 1e-5, p, philox.pack(*rng))
    assert (y.dtype, h.dtype, mean.dtype, rstd.dtype) == (dtype, dtype, torch.float32, torch.float32)
    dx, dres, dw, db = aln.add_layer_norm_bwd(dy, None, h, w, mean, rstd, p, philox.pack(*rng), True)
    assert dw.dtype == dtype and db.dtype == dtype

    def ref(dt):
        leaves = [t.to(dt).requires_grad_() for t in (x, r, w, b)]
        out = reference.add_layer_norm(*leaves, 1e-5, p, rng=rng)
        return (out.detach(),) + torch.autograd.grad(out, leaves, dy.to(dt))

    ref32, ref_lp = ref(torch.float32), ref(dtype)
    for name, got, want, lp in zip(("y", "dx", "dresidual", "dweight", "dbias"),
                                   (y, dx, dres, dw, db), ref32, ref_lp):
        assert_close_lowp(name, got.float(), want, lp.float(), factor=LOWP_FACTOR, atol=1e-3)


def test_add_layer_norm_zero_rows():
    x, w = _rand(0, 16), _rand(16)
    y, h, mean, rstd = aln.add_layer_norm_fwd(x, None, w, w, 1e-5, 0.1, philox.pack(1, 0))
    assert y.shape == h.shape == (0, 16) and mean.shape == rstd.shape == (0,)
    dx, dres, dw, db = aln.add_layer_norm_bwd(x, None, h, w, mean, rstd, 0.1, philox.pack(1, 0), True)
    assert dx.shape == (0, 16) and dres.shape == (0, 16)
    assert torch.equal(dw, torch.zeros_like(w)) and torch.equal(db, torch.zeros_like(w))


def test_add_layer_norm_host_errors_name_the_argument():
    x, w = _rand(4, 8), _rand(8)
    with pytest.raises(ValueError, match="x must be 2-D"):
        aln.add_layer_norm_fwd(_rand(8), None, w, w, 1e-5, 0.0, philox.pack(0, 0))
    with pytest.raises(TypeError, match="x must be fp16, bf16 or fp32"):
        aln.add_layer_norm_fwd(x.double(), None, w, w, 1e-5, 0.0, philox.pack(0, 0))
    with pytest.raises(ValueError, match="x must be contiguous"):
        aln.add_layer_norm_fwd(_rand(8, 4).t(), None, w[:4], w[:4], 1e-5, 0.0, philox.pack(0, 0))
    with pytest.raises(ValueError, match="residual must have shape"):
        aln.add_layer_norm_fwd(x, _rand(4, 7), w, w, 1e-5, 0.0, philox.pack(0, 0))
    with pytest.raises(ValueError, match=r"weight must have shape \(8,\)"):
        aln.add_layer_norm_fwd(x, None, _rand(7), w, 1e-5, 0.0, philox.pack(0, 0))
    with pytest.raises(ValueError, match=f"hidden sizes up to {aln.MAX_C}"):
        aln.add_layer_norm_fwd(_rand(1, aln.MAX_C + 1), None, _rand(aln.MAX_C + 1),
                                          _rand(aln.MAX_C + 1), 1e-5, 0.0, philox.pack(0, 0))
    with pytest.raises(ValueError, match=r"dropout_p must be in \[0, 1\)"):
        aln.add_layer_norm_fwd(x, None, w, w, 1e-5, 1.0, philox.pack(0, 0))
    _, h, mean, rstd = aln.add_layer_norm_fwd(x, None, w, w, 1e-5, 0.0, philox.pack(0, 0))
    with pytest.raises(TypeError, match="mean must have dtype torch.float32"):
        aln.add_layer_norm_bwd(x, None, h, w, mean.double(), rstd, 0.0, philox.pack(0, 0), False)
    with pytest.raises(ValueError, match="dh must have shape"):
        aln.add_layer_norm_bwd(x, _rand(3, 8), h, w, mean, rstd, 0.0, philox.pack(0, 0), False)


# ---------------------------------------------------------------- cross_entropy


def _ce_reference(logits, target, ls, ignore_index, reduction):
    """torch's own F.cross_entropy in float64: the loss and d(sum of the loss)/d(logits)."""
    lg = logits.double().requires_grad_()
    loss = F.cross_entropy(lg, target, label_smoothing=ls, ignore_index=ignore_index,
                           reduction=REDUCTION[reduction])
    (grad,) = torch.autograd.grad(loss.sum(), lg)
    return loss.detach(), grad


@pytest.mark.parametrize("reduction", [0, 1, 2])
@pytest.mark.parametrize("V,block", [(37, 16), (48, 16), (5000, None), (3, None)])
def test_cross_entropy_v_across_blocks(monkeypatch, V, block, reduction):
    """V over several BLOCK_V steps, the last one partial (37 = 16 + 16 + 5; 5000 > 4096), the
    row maximum in a later block than the first (the online log-sum-exp rescales), smoothing and
    ignored rows; loss and gradient as torch's F.cross_entropy."""
    if block is not None:
        monkeypatch.setattr(ce, "MAX_BLOCK_V", block)
    N, ls = 6, 0.1
    logits = _rand(N, V, scale=3.0)
    logits[0, -1] = 60.0  # the first row's maximum sits in its last block
    logits[1, 0] = -60.0
    target = torch.randint(0, V, (N,), device=DEVICE)
    target[2] = -100
    loss, grad = ce.cross_entropy_fwd(logits, target, ls, -100, reduction, True)
    loss_ref, grad_ref = _ce_reference(logits, target, ls, -100, reduction)
    assert loss.dtype == logits.dtype and loss.shape == loss_ref.shape
    assert_close("loss", loss.double(), loss_ref, atol=2e-5, rtol=1e-5)
    assert_close("grad", grad.double(), grad_ref, atol=1e-6, rtol=1e-5)
    assert torch.equal(grad[2], torch.zeros_like(grad[2]))  # ignored row


def test_cross_entropy_ignore_index_inside_the_classes_and_all_ignored():
    """ignore_index may be a real class (padding id 0); every row ignored gives mean = nan (as
    torch) with a zero gradient, sum = 0."""
    logits = _rand(4, 10)
    target = torch.tensor([0, 3, 0, 9], device=DEVICE)
    for reduction in (0, 1, 2):
        loss, grad = ce.cross_entropy_fwd(logits, target, 0.2, 0, reduction, True)
        loss_ref, grad_ref = _ce_reference(logits, target, 0.2, 0, reduction)
        assert_close("loss", loss.double(), loss_ref, atol=2e-5, rtol=1e-5)
        assert_close("grad", grad.double(), grad_ref, atol=1e-6, rtol=1e-5)
    all_ignored = torch.zeros(4, dtype=torch.int64, device=DEVICE)
    loss, grad = ce.cross_entropy_fwd(logits, all_ignored, 0.0, 0, 1, True)
    assert math.isnan(loss.item()) and math.isnan(F.cross_entropy(logits, all_ignored, ignore_index=0).item())
    assert torch.equal(grad, torch.zeros_like(grad))
    loss, _ = ce.cross_entropy_fwd(logits, all_ignored, 0.0, 0, 2, False)
    assert loss.item() == 0.0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cross_entropy_low_precision(dtype):
    """16-bit logits, fp32 softmax: the loss in the logits dtype, within the low-precision rule."""
    logits, target = _rand(5, 300, dtype=dtype, scale=4.0), torch.randint(0, 300, (5,), device=DEVICE)
    loss, grad = ce.cross_entropy_fwd(logits, target, 0.1, -100, 1, True)
    assert loss.dtype == dtype and grad.dtype == dtype
    ref32 = _ce_reference(logits.float(), target, 0.1, -100, 1)
    lg = logits.clone().requires_grad_()
    ref_lp = reference.cross_entropy(lg, target, label_smoothing=0.1)
    (g_lp,) = torch.autograd.grad(ref_lp, lg)
    assert_close_lowp("loss", loss.double(), ref32[0], ref_lp.detach().double(), factor=LOWP_FACTOR, atol=1e-3)
    assert_close_lowp("grad", grad.double(), ref32[1], g_lp.double(), factor=LOWP_FACTOR, atol=1e-4)


def test_cross_entropy_without_grad_and_zero_rows():
    logits, target = _rand(3, 11), torch.tensor([1, 2, 3], device=DEVICE)
    loss, grad = ce.cross_entropy_fwd(logits, target, 0.0, -100, 1, False)
    assert grad.numel() == 0
    assert_close("loss", loss.double(), _ce_reference(logits, target, 0.0, -100, 1)[0], atol=2e-5, rtol=1e-5)
    empty = _rand(0, 11)
    loss, grad = ce.cross_entropy_fwd(empty, target[:0], 0.0, -100, 0, True)
    assert loss.shape == (0,) and grad.shape == (0, 11)
    loss, _ = ce.cross_entropy_fwd(empty, target[:0], 0.0, -100, 2, True)
    assert loss.item() == 0.0


def test_cross_entropy_host_errors_name_the_argument():
    logits, target = _rand(3, 11), torch.tensor([1, 2, 3], device=DEVICE)
    with pytest.raises(ValueError, match="logits must have 2 dimensions"):
        ce.cross_entropy_fwd(_rand(11), target, 0.0, -100, 1, True)
    with pytest.raises(TypeError, match="target must have dtype torch.int64"):
        ce.cross_entropy_fwd(logits, target.int(), 0.0, -100, 1, True)
    with pytest.raises(ValueError, match="target must have shape"):
        ce.cross_entropy_fwd(logits, target[:2], 0.0, -100, 1, True)
    with pytest.raises(ValueError, match="reduction must be 0"):
        ce.cross_entropy_fwd(logits, target, 0.0, -100, 3, True)


# ---------------------------------------------------------------- linear_cross_entropy


def _lce_reference(hidden, weight, bias, target, ls, reduction, grad_loss):
    leaves = [t.double().requires_grad_() for t in (hidden, weight) + ((bias,) if bias is not None else ())]
    logits = leaves[0] @ leaves[1].t() + (leaves[2] if bias is not None else 0.0)
    loss = F.cross_entropy(logits, target, label_smoothing=ls, reduction=REDUCTION[reduction])
    grads = torch.autograd.grad((loss * grad_loss.double()).sum(), leaves)
    return loss.detach(), grads


@pytest.mark.parametrize("reduction", [0, 1, 2])
@pytest.mark.parametrize("has_bias", [True, False])
@pytest.mark.parametrize("rows", [3, 4, 64])
def test_linear_cross_entropy_across_chunks(monkeypatch, rows, has_bias, reduction):
    """10 rows in chunks of 3 (3 + 3 + 3 + 1), 4 and one chunk; an ignored row; V = 37 over
    several BLOCK_V steps. mean/sum: the gradients from the forward; none: the backward kernel
    with per-row upstream gradients."""
    monkeypatch.setattr(ce, "_chunk_rows", lambda N, D, V: rows)
    monkeypatch.setattr(ce, "MAX_BLOCK_V", 16)
    N, D, V, ls = 10, 13, 37, 0.1
    hidden, weight = _rand(N, D), _rand(V, D, scale=0.5)
    bias = _rand(V) if has_bias else None
    target = torch.randint(0, V, (N,), device=DEVICE)
    target[4] = -100
    grad_loss = _rand(N) if reduction == 0 else torch.ones((), device=DEVICE)
    loss_ref, grads_ref = _lce_reference(hidden, weight, bias, target, ls, reduction, grad_loss)
    if reduction == 0:
        loss, dh, dw, db = ce.linear_cross_entropy_fwd(hidden, weight, bias, target, ls, -100, 0, False)
        assert dh.numel() == dw.numel() == db.numel() == 0
        dh, dw, db = ce.linear_cross_entropy_bwd(grad_loss, hidden, weight, bias, target, ls, -100)
    else:
        loss, dh, dw, db = ce.linear_cross_entropy_fwd(hidden, weight, bias, target, ls, -100,
                                                                   reduction, True)
    assert_close("loss", loss.double(), loss_ref, atol=2e-5, rtol=1e-5)
    assert_close("dhidden", dh.double(), grads_ref[0], atol=1e-5, rtol=1e-5)
    assert_close("dweight", dw.double(), grads_ref[1], atol=1e-5, rtol=1e-5)
    if has_bias:
        assert_close("dbias", db.double(), grads_ref[2], atol=1e-5, rtol=1e-5)
    else:
        assert db.numel() == 0


def test_linear_cross_entropy_chunk_policy_never_builds_the_full_logits():
    """A chunk's logits hold about as many elements as hidden (at least 2**23): for a large
    vocabulary the (N, V) logits are never built."""
    N, D, V = 8192, 512, 32000
    rows = ce._chunk_rows(N, D, V)
    assert rows >= 1 and rows < N and rows * V <= max(N * D, ce._CHUNK_ELEMENTS)
    assert ce._chunk_rows(5, 8, 11) == 5  # small problems: one chunk
    assert ce._chunk_rows(3, 4, 2**25) == 1  # even one row's logits over budget: one row


def _lce_loss_and_grads(hidden, weight, bias, target, dtype):
    """The reference's loss (label smoothing 0.1) and its gradients, computed in ``dtype``."""
    leaves = [t.to(dtype).requires_grad_() for t in (hidden, weight, bias)]
    out = reference.linear_cross_entropy(leaves[0], leaves[1], target, linear_bias=leaves[2], label_smoothing=0.1)
    return (out.detach(),) + torch.autograd.grad(out, leaves)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_linear_cross_entropy_low_precision(monkeypatch, dtype):
    """16-bit hidden/weight, fp32 dweight accumulation across chunks, against fp32 and 16-bit references."""
    monkeypatch.setattr(ce, "_chunk_rows", lambda N, D, V: 4)
    N, D, V = 9, 16, 40
    hidden, weight, bias = _rand(N, D, dtype=dtype), _rand(V, D, dtype=dtype, scale=0.5), _rand(V, dtype=dtype)
    target = torch.randint(0, V, (N,), device=DEVICE)
    loss, dh, dw, db = ce.linear_cross_entropy_fwd(hidden, weight, bias, target, 0.1, -100, 1, True)
    assert loss.dtype == dh.dtype == dw.dtype == db.dtype == dtype
    ref32, ref_lp = (_lce_loss_and_grads(hidden, weight, bias, target, dt) for dt in (torch.float32, dtype))
    for name, got, want, lp in zip(("loss", "dhidden", "dweight", "dbias"), (loss, dh, dw, db), ref32, ref_lp):
        assert_close_lowp(name, got.float(), want, lp.float(), factor=LOWP_FACTOR, atol=1e-3)


def test_linear_cross_entropy_zero_rows_and_errors():
    hidden, weight, target = _rand(0, 8), _rand(5, 8), torch.zeros(0, dtype=torch.int64, device=DEVICE)
    loss, dh, dw, db = ce.linear_cross_entropy_fwd(hidden, weight, None, target, 0.0, -100, 2, True)
    assert loss.item() == 0.0 and dh.shape == (0, 8) and torch.equal(dw, torch.zeros_like(weight))
    with pytest.raises(ValueError, match=r"weight must have shape \(V, 8\)"):
        ce.linear_cross_entropy_fwd(_rand(2, 8), _rand(5, 7), None, target, 0.0, -100, 1, True)
    with pytest.raises(ValueError, match="bias must have shape"):
        ce.linear_cross_entropy_fwd(_rand(2, 8), weight, _rand(4), target[:0].new_zeros(2),
                                                0.0, -100, 1, True)
    with pytest.raises(ValueError, match="grad_loss must have shape"):
        ce.linear_cross_entropy_bwd(_rand(3), _rand(2, 8), weight, None,
                                                torch.zeros(2, dtype=torch.int64, device=DEVICE), 0.0, -100)


# ---------------------------------------------------------------- registered torch ops


def test_opcheck_registered_ops():
    """Schemas, fake implementations and the dispatcher path of every registered triton op."""
    x, r, w, b = _rand(5, 37), _rand(5, 37), _rand(37), _rand(37)
    for residual, p in ((r, 0.2), (None, 0.0)):
        torch.library.opcheck(aln.add_layer_norm_fwd.op, (x, residual, w, b, 1e-5, p, philox.pack(7, 3)))
        _, h, mean, rstd = aln.add_layer_norm_fwd(x, residual, w, b, 1e-5, p, philox.pack(7, 3))
        torch.library.opcheck(aln.add_layer_norm_bwd.op,
                              (_rand(5, 37), _rand(5, 37), h, w, mean, rstd, p, philox.pack(7, 3),
                               residual is not None))
    logits, target = _rand(4, 21), torch.tensor([0, 5, -100, 20], device=DEVICE)
    for reduction, grad in ((0, True), (1, True), (2, False)):
        torch.library.opcheck(ce.cross_entropy_fwd.op, (logits, target, 0.1, -100, reduction, grad))
    hidden, weight, bias = _rand(4, 6), _rand(21, 6), _rand(21)
    for b_, reduction, grad in ((bias, 1, True), (None, 0, False)):
        torch.library.opcheck(ce.linear_cross_entropy_fwd.op,
                              (hidden, weight, b_, target, 0.1, -100, reduction, grad))
    torch.library.opcheck(ce.linear_cross_entropy_bwd.op,
                          (_rand(4), hidden, weight, bias, target, 0.1, -100))


def test_registered_op_compiles_without_graph_break():
    x, w = _rand(6, 40), _rand(40)

    def fn(x, w):
        y, h, _, _ = aln.add_layer_norm_fwd(x, x, w, w, 1e-5, 0.1, philox.pack(2**40, 0))
        return y * 2 + h

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    assert_close("compiled", compiled(x, w), fn(x, w), atol=0, rtol=0)


# ---------------------------------------------------------------- real GPU only


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("C", [512, 1000, 4096, 8192, 16384])
def test_gpu_add_layer_norm_large_hidden(dtype, C):
    """The compiled kernels at every BLOCK_C / num_warps the host picks, with dropout."""
    N, p, rng = 300, 0.1, (123, 456)
    x, r = _rand(N, C, dtype=dtype), _rand(N, C, dtype=dtype)
    w, b = (1 + _rand(C)).to(dtype), _rand(C, dtype=dtype)
    dy = _rand(N, C, dtype=dtype)
    y, h, mean, rstd = aln.add_layer_norm_fwd(x, r, w, b, 1e-5, p, philox.pack(*rng))
    dx, dres, dw, db = aln.add_layer_norm_bwd(dy, None, h, w, mean, rstd, p, philox.pack(*rng), True)

    def ref(dt):
        leaves = [t.to(dt).requires_grad_() for t in (x, r, w, b)]
        out = reference.add_layer_norm(*leaves, 1e-5, p, rng=rng)
        return (out.detach(),) + torch.autograd.grad(out, leaves, dy.to(dt))

    for name, got, want, lp in zip(("y", "dx", "dresidual", "dweight", "dbias"), (y, dx, dres, dw, db),
                                   ref(torch.float32), ref(dtype)):
        assert_close_lowp(name, got.float(), want, lp.float(), factor=2.0, atol=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_gpu_linear_cross_entropy_large_vocab(dtype):
    """Several chunks of a 32000-class vocabulary, cuBLAS fp32-accumulated dweight."""
    N, D, V = 2048, 256, 32000
    hidden, weight = _rand(N, D, dtype=dtype), _rand(V, D, dtype=dtype, scale=0.05)
    bias, target = _rand(V, dtype=dtype), torch.randint(0, V, (N,), device=DEVICE)
    target[::7] = -100
    assert ce._chunk_rows(N, D, V) < N
    loss, dh, dw, db = ce.linear_cross_entropy_fwd(hidden, weight, bias, target, 0.1, -100, 1, True)
    ref32, ref_lp = (_lce_loss_and_grads(hidden, weight, bias, target, dt) for dt in (torch.float32, dtype))
    for name, got, want, lp in zip(("loss", "dhidden", "dweight", "dbias"), (loss, dh, dw, db), ref32, ref_lp):
        if dtype == torch.float32:
            assert_close(name, got, want, atol=1e-4, rtol=1e-3)
        else:
            assert_close_lowp(name, got.float(), want, lp.float(), factor=2.0, atol=1e-4)
