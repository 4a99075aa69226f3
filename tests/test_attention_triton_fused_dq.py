"""The Triton attention backward with dQ made in the dK/dV kernel (attention.FUSED_DQ, BACKWARD.md
in fastformer/triton_kernels): each key block adds dS K to one fp32 accumulator a query tile, in
key-block order. Against the reference's gradients (fp32 and bf16, causal with Sq < Sk and
Sq > Sk, key padding, dropout with the reference's bits, several key tiles a query tile), the same
bits run to run, and the dQ kernel not launched.

Without a GPU everything runs in Triton's interpreter on CPU tensors (tests/conftest.py), where
the programs run one at a time in id order: a key block whose turn has not come makes its tiles' dQ
NaN (a wrong order fails there instead of spinning). The ordering between concurrent key
blocks is exercised on a GPU only (test_fused_dq_ordering_on_gpu: skipped in the interpreter)."""
import pytest
import torch

from fastformer import philox
from test_attention_triton import LOWP_FACTOR, _check_fp32, _inputs, _kernels, _reference
from utils import assert_close, assert_close_lowp, kernel_backends

pytestmark = list(kernel_backends("triton")[0].marks)  # skipped, with the reason, where triton cannot run
A = pytest.importorskip("fastformer.triton_kernels.attention", reason="triton is not installed")


@pytest.fixture
def fused(monkeypatch, small_blocks):
    """FUSED_DQ on, 16 x 16 tiles in the interpreter (several key tiles add to each query tile);
    yields the kinds of the kernels each backward launches."""
    monkeypatch.setattr(A, "FUSED_DQ", True)
    kinds = []
    launch = A._launch

    def spy(kind, *args, **kwargs):
        kinds.append(kind)
        return launch(kind, *args, **kwargs)

    monkeypatch.setattr(A, "_launch", spy)
    yield kinds


# (B, H, Sq, Sk, D, causal, kpm_frac, p): Sk of 3-7 key tiles; causal Sq > Sk leaves query
# tiles no key block sees (key block 0 zeroes them), Sq < Sk key blocks that see no query
CASES = {
    "plain": (1, 2, 37, 50, 16, False, 0.0, 0.0),
    "causal_sq_lt_sk": (1, 1, 40, 70, 24, True, 0.0, 0.0),
    "causal_sq_gt_sk": (2, 1, 75, 33, 16, True, 0.3, 0.0),
    "kpm_dropout": (1, 2, 45, 60, 16, False, 0.3, 0.2),
    "causal_dropout": (1, 1, 50, 47, 32, True, 0.2, 0.3),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_fused_dq_matches_reference(case, fused):
    B, H, Sq, Sk, D, causal, kpm_frac, p = CASES[case]
    q, k, v, kpm, am, dout = _inputs(B, H, Sq, Sk, D, kpm_frac=kpm_frac, seed=3)
    got = _kernels(q, k, v, kpm, am, dout, causal, 0.25, p, 7, 2**32 - 5)
    assert "dq" not in fused and "dkdv_dq" in fused, f"launched {fused}"
    # dropout: the reference draws the same bits (philox.py's v3 convention), so any bit the fused
    # kernel made differently from the forward shows up in dq, dk or dv
    _check_fp32(got, _reference(q, k, v, kpm, am, dout, causal, 0.25, p, 7, 2**32 - 5))


def test_fused_dq_bf16(fused):
    """bf16 inputs: FlashAttention's rule against the fp32 reference; dQ is written in bf16 by
    each query tile's last key block."""
    B, H, Sq, Sk, D = 1, 2, 45, 61, 40
    q, k, v, kpm, am, dout = _inputs(B, H, Sq, Sk, D, dtype=torch.bfloat16, kpm_frac=0.2)
    got = _kernels(q, k, v, kpm, am, dout, True, 0.15, 0.1, 11, 0)
    assert "dq" not in fused
    want32 = _reference(q, k, v, kpm, am, dout, True, 0.15, 0.1, 11, 0, dtype=torch.float32)
    wantlp = _reference(q, k, v, kpm, am, dout, True, 0.15, 0.1, 11, 0, dtype=torch.bfloat16)
    for i, name in ((2, "dq"), (3, "dk"), (4, "dv")):
        assert got[i].dtype == torch.bfloat16, name
        assert_close_lowp(name, got[i].float(), want32[i], wantlp[i].float(), factor=LOWP_FACTOR)


def test_fused_dq_deterministic_and_equal_to_two_kernels(fused, monkeypatch):
    """Two runs give the same bits; the two-kernel backward (dQ kernel) agrees to rounding."""
    B, H, Sq, Sk, D = 1, 1, 33, 50, 16
    q, k, v, kpm, am, dout = _inputs(B, H, Sq, Sk, D, kpm_frac=0.1, seed=5)
    first = _kernels(q, k, v, kpm, am, dout, True, 0.3, 0.25, 1, 2)
    second = _kernels(q, k, v, kpm, am, dout, True, 0.3, 0.25, 1, 2)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), first, second):
        assert torch.equal(a, b), f"{name}: two runs differ"
    monkeypatch.setattr(A, "FUSED_DQ", False)
    fused.clear()
    two = _kernels(q, k, v, kpm, am, dout, True, 0.3, 0.25, 1, 2)
    assert "dq" in fused and "dkdv_dq" not in fused, f"launched {fused}"
    for name, a, b in zip(("dq", "dk", "dv"), first[2:], two[2:]):
        assert_close(name, a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("feature", ["gqa", "rel_bias"])
def test_fused_dq_gqa_and_rel_bias_equal_two_kernels(feature, fused, monkeypatch):
    """Grouped-query heads (dQ per query head, k / v shared by two) and a relative position bias
    (its gradient from the same dS^T): the fused backward gives the two-kernel one's gradients
    (those are checked against the reference in test_attention_gqa.py / test_attention_rel_bias.py)."""
    B, H, Sq, Sk, D = 1, 2, 24, 40, 16
    g = torch.Generator().manual_seed(9)
    hk = H // 2 if feature == "gqa" else H
    q, dout = (torch.randn(B, H, Sq, D, generator=g) for _ in range(2))
    k, v = (torch.randn(B, hk, Sk, D, generator=g) for _ in range(2))
    kw = dict(rel_bias=torch.randn(H, 2 * 7 + 1, generator=g), rel_shift=3) if feature == "rel_bias" else {}
    results = []
    for on in (True, False):
        monkeypatch.setattr(A, "FUSED_DQ", on)
        out, lse = A.attention_fwd(q, k, v, None, None, True, 0.3, 0.2, philox.pack(1, 2), **kw)
        results.append(A.attention_bwd(dout, q, k, v, out, lse, None, None, True, 0.3, 0.2, philox.pack(1, 2), **kw))
    assert fused.count("dkdv_dq") == 1 and fused.count("dq") == 1, f"launched {fused}"
    names = ("dq", "dk", "dv", "drel") if feature == "rel_bias" else ("dq", "dk", "dv")
    for name, a, b in zip(names, *results):
        assert_close(name, a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(A.INTERPRET, reason="the interpreter runs the programs one at a time in id order: the "
                                        "ordered hand-over between concurrent key blocks needs a GPU")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_fused_dq_ordering_on_gpu(dtype, fused, monkeypatch):
    """Many concurrent key blocks a query tile (causal, dropout, 1024 x 1024): 20 backward runs give
    the first run's bits (a block that read the partial sums before its turn, or saw a stale copy,
    would change them), and the two-kernel backward's dQ to rounding."""
    B, H, S, D = 2, 4, 1024, 64
    q, k, v, kpm, am, dout = _inputs(B, H, S, S, D, dtype=dtype, kpm_frac=0.1, seed=1)
    out, lse = A.attention_fwd(q, k, v, kpm, None, True, 0.125, 0.1, philox.pack(3, 4))
    first = A.attention_bwd(dout, q, k, v, out, lse, kpm, None, True, 0.125, 0.1, philox.pack(3, 4))
    for run in range(20):
        again = A.attention_bwd(dout, q, k, v, out, lse, kpm, None, True, 0.125, 0.1, philox.pack(3, 4))
        for name, a, b in zip(("dq", "dk", "dv"), first, again):
            assert torch.equal(a, b), f"run {run + 1}: {name} differs from the first run's"
    monkeypatch.setattr(A, "FUSED_DQ", False)
    two = A.attention_bwd(dout, q, k, v, out, lse, kpm, None, True, 0.125, 0.1, philox.pack(3, 4))
    assert "dq" in fused and "dkdv_dq" in fused, f"launched {fused}"
    for name, a, b in zip(("dq", "dk", "dv"), first, two):
        assert_close(name, a.float(), b.float(), atol=2e-2, rtol=2e-2)


def test_fused_dq_very_negative_scores_ragged_keys(fused):
    """Every score near -280 and Sk not a multiple of the key tile: past Sk, P = exp2(0 - lse)
    overflows to inf in the dK/dV tile (harmless there, those keys are never stored); dQ must
    not turn it into inf x 0 = NaN."""
    B, H, Sq, Sk, D = 1, 1, 20, 40, 16
    g = torch.Generator().manual_seed(4)
    q = torch.full((B, H, Sq, D), 4.0)
    k = -torch.rand(B, H, Sk, D, generator=g) - 4.0
    v, dout = torch.randn(B, H, Sk, D, generator=g), torch.randn(B, H, Sq, D, generator=g)
    got = _kernels(q, k, v, None, None, dout, False, 1.0)
    assert "dq" not in fused
    _check_fp32(got, _reference(q, k, v, None, None, dout, False, 1.0))
