"""attention's hostile input (the machinery: tests/hostile.py): bad calls to ops.attention with
every backend forced, bad arguments to the C++ attention_fwd / attention_bwd (in a child process),
the strided views the C++ op must read right, and empty batches, heads and sequences."""
import math

import pytest
import torch

from fastformer import ops
from fastformer.ops import reference
import hostile
from hostile import strided as _strided, tensor as _t
from utils import kernel_backends, skip_without_kernels


# ------------------------------------------------------------------- bad input to ops.attention
def _qkv(B=2, H=2, Sq=3, Sk=5, D=8):
    return _t(B, H, Sq, D), _t(B, H, Sk, D), _t(B, H, Sk, D)


def _attn(**over):
    q, k, v = _qkv()
    args = dict(q=q, k=k, v=v)
    args.update(over)
    q, k, v = args.pop("q"), args.pop("k"), args.pop("v")
    return lambda: ops.attention(q, k, v, **args)


ATTENTION = {
    "q_3d": (_attn(q=_t(2, 3, 8)), ValueError, "q must have 4 dimensions"),
    "k_5d": (_attn(k=_t(1, 2, 2, 5, 8)), ValueError, "k must have 4 dimensions"),
    "q_list": (_attn(q=[[1.0]]), TypeError, "q must be a torch.Tensor"),
    "q_int": (_attn(q=_t(2, 2, 3, 8, dtype=torch.int64)), TypeError, "q must be a floating"),
    "v_bool": (_attn(v=torch.ones(2, 2, 5, 8, dtype=torch.bool)), TypeError, "v must be a floating"),
    "k_batch": (_attn(k=_t(3, 2, 5, 8)), ValueError, "k must have shape"),
    "k_head_dim": (_attn(k=_t(2, 2, 5, 7)), ValueError, "k must have shape"),
    "v_length": (_attn(v=_t(2, 2, 4, 8)), ValueError, "v must have shape"),
    "k_dtype": (_attn(k=_t(2, 2, 5, 8, dtype=torch.float64)), TypeError, "k has dtype"),
    "v_dtype": (_attn(v=_t(2, 2, 5, 8, dtype=torch.bfloat16)), TypeError, "v has dtype"),
    "k_device": (_attn(k=_t(2, 2, 5, 8, device="meta")), ValueError, "k is on meta"),
    "head_dim_0": (_attn(q=_t(2, 2, 3, 0), k=_t(2, 2, 5, 0), v=_t(2, 2, 5, 0)), ValueError, "head dim"),
    "kpm_shape": (_attn(key_padding_mask=torch.zeros(2, 3, dtype=torch.bool)), ValueError,
                  "key_padding_mask must have shape"),
    "kpm_transposed": (_attn(key_padding_mask=torch.zeros(5, 2, dtype=torch.bool)), ValueError,
                       "key_padding_mask must have shape"),
    "kpm_3d": (_attn(key_padding_mask=torch.zeros(2, 1, 5, dtype=torch.bool)), ValueError,
               "key_padding_mask must have 2 dimensions"),
    "kpm_float": (_attn(key_padding_mask=torch.zeros(2, 5)), TypeError, "key_padding_mask must be a bool"),
    "kpm_int": (_attn(key_padding_mask=torch.zeros(2, 5, dtype=torch.int64)), TypeError,
                "key_padding_mask must be a bool"),
    "kpm_list": (_attn(key_padding_mask=[[False] * 5] * 2), TypeError, "key_padding_mask must be a torch.Tensor"),
    "kpm_device": (_attn(key_padding_mask=torch.zeros(2, 5, dtype=torch.bool, device="meta")), ValueError,
                   "key_padding_mask is on meta"),
    "mask_shape": (_attn(attn_mask=torch.zeros(3, 4, dtype=torch.bool)), ValueError, "attn_mask of shape"),
    "mask_5d": (_attn(attn_mask=torch.zeros(1, 2, 2, 3, 5)), ValueError, "attn_mask"),
    "mask_int": (_attn(attn_mask=torch.zeros(3, 5, dtype=torch.int32)), TypeError, "attn_mask must be bool"),
    "mask_list": (_attn(attn_mask=[[0.0] * 5] * 3), TypeError, "attn_mask must be a torch.Tensor"),
    "mask_device": (_attn(attn_mask=torch.zeros(3, 5, device="meta")), ValueError, "attn_mask is on meta"),
    "dropout_neg": (_attn(dropout_p=-0.1), ValueError, "dropout_p must be a number in \\[0, 1\\), got -0.1"),
    "dropout_one": (_attn(dropout_p=1.0), ValueError, "dropout_p"),
    "dropout_nan": (_attn(dropout_p=float("nan")), ValueError, "dropout_p"),
    "dropout_str": (_attn(dropout_p="0.1"), ValueError, "dropout_p"),
    "scale_zero": (_attn(scale=0.0), ValueError, "scale must be a positive"),
    "scale_neg": (_attn(scale=-1.0), ValueError, "scale"),
    "scale_inf": (_attn(scale=math.inf), ValueError, "scale"),
    "scale_nan": (_attn(scale=float("nan")), ValueError, "scale"),
    "is_causal_str": (_attn(is_causal="yes"), TypeError, "is_causal must be a bool"),
}


BAD_INPUT = {"attention": ATTENTION}
test_bad_input_raises_naming_the_argument = hostile.bad_input_test(**BAD_INPUT)


# ----------------------------------------------------------------- bad arguments to the C++ ops
attention_fwd = hostile.kernel_call("attention_fwd", lambda: dict(
    q=_t(2, 3, 5, 8), k=_t(2, 3, 7, 8), v=_t(2, 3, 7, 8), key_padding_mask=None, attn_mask=None, is_causal=False,
    scale=0.35, dropout_p=0.0))
attention_bwd = hostile.kernel_call("attention_bwd", lambda: dict(
    dout=_t(2, 3, 5, 8), q=_t(2, 3, 5, 8), k=_t(2, 3, 7, 8), v=_t(2, 3, 7, 8), out=_t(2, 3, 5, 8), lse=_t(2, 3, 5),
    key_padding_mask=None, attn_mask=None, is_causal=False, scale=0.35, dropout_p=0.0))

BAD_KERNEL_ARGS = {  # group -> {case: (thunk, text the TORCH_CHECK message must contain)}
    "attention": {
        "q_3d": (lambda: attention_fwd(q=_t(2, 5, 8)), "q must be 4-D"),
        "q_int": (lambda: attention_fwd(q=_t(2, 3, 5, 8, dtype=torch.int64)), "q must be float32, float64 or bfloat16"),
        "q_half": (lambda: attention_fwd(q=_t(2, 3, 5, 8, dtype=torch.float16)), "q must be float32"),
        "k_dtype": (lambda: attention_fwd(k=_t(2, 3, 7, 8, dtype=torch.float64)), "k has dtype Double"),
        "k_heads": (lambda: attention_fwd(k=_t(2, 2, 7, 8)), "k has 2 heads, which must divide q's 3 heads"),
        "k_head_dim": (lambda: attention_fwd(k=_t(2, 3, 7, 9)), "k must have shape"),
        "v_length": (lambda: attention_fwd(v=_t(2, 3, 6, 8)), "v must have k's shape"),
        "q_strided_last_dim": (lambda: attention_fwd(q=_strided(2, 3, 5, 8)), "q must have a contiguous last"),
        "v_strided_last_dim": (lambda: attention_fwd(v=_strided(2, 3, 7, 8)), "v must have a contiguous last"),
        "head_dim_300": (lambda: attention_fwd(q=_t(1, 1, 2, 300), k=_t(1, 1, 2, 300), v=_t(1, 1, 2, 300)),
                         "head dim D must be in [1, 256]"),
        "head_dim_0": (lambda: attention_fwd(q=_t(2, 3, 5, 0), k=_t(2, 3, 7, 0), v=_t(2, 3, 7, 0)), "head dim D"),
        "scale_nan": (lambda: attention_fwd(scale=float("nan")), "scale must be finite"),
        "scale_inf": (lambda: attention_fwd(scale=float("inf")), "scale must be finite"),
        "dropout_one": (lambda: attention_fwd(dropout_p=1.0), "dropout_p must be in [0, 1)"),
        "dropout_nan": (lambda: attention_fwd(dropout_p=float("nan")), "dropout_p must be in [0, 1)"),
        "seed_neg": (lambda: attention_fwd(seed=-1), "the philox seed philox[0] must be >= 0, got -1"),
        "offset_neg": (lambda: attention_fwd(offset=-4), "the philox offset philox[1] must be >= 0, got -4"),
        "philox_int32": (lambda: attention_fwd(philox=torch.zeros(2, dtype=torch.int32)), "philox must be int64"),
        "philox_float": (lambda: attention_fwd(philox=torch.zeros(2)), "philox must be int64"),
        "philox_3": (lambda: attention_fwd(philox=torch.zeros(3, dtype=torch.int64)),
                     "philox must have shape (2,) = (seed, offset), got [3]"),
        "philox_2d": (lambda: attention_fwd(philox=torch.zeros(1, 2, dtype=torch.int64)), "philox must have shape (2,)"),
        "philox_0d": (lambda: attention_fwd(philox=torch.tensor(5)), "philox must have shape (2,)"),
        "philox_strided": (lambda: attention_fwd(philox=torch.zeros(4, dtype=torch.int64)[::2]),
                           "philox must be contiguous"),
        "bwd_philox_3": (lambda: attention_bwd(philox=torch.zeros(3, dtype=torch.int64)), "philox must have shape (2,)"),
        "kpm_float": (lambda: attention_fwd(key_padding_mask=_t(2, 7)), "key_padding_mask must be bool"),
        "kpm_shape": (lambda: attention_fwd(key_padding_mask=_t(2, 5, dtype=torch.bool)),
                      "key_padding_mask must have shape (B, Sk) = (2, 7)"),
        "kpm_3d": (lambda: attention_fwd(key_padding_mask=_t(2, 1, 7, dtype=torch.bool)), "key_padding_mask must have"),
        "mask_bool": (lambda: attention_fwd(attn_mask=_t(1, 1, 5, 7, dtype=torch.bool)), "attn_mask must be float32"),
        "mask_double": (lambda: attention_fwd(attn_mask=_t(1, 1, 5, 7, dtype=torch.float64)), "attn_mask must be float32"),
        "mask_2d": (lambda: attention_fwd(attn_mask=_t(5, 7)), "attn_mask must be a 4-D view"),
        "mask_size": (lambda: attention_fwd(attn_mask=_t(1, 1, 5, 6)), "does not broadcast to (B, H, Sq, Sk)"),
        "mask_too_big": (lambda: attention_fwd(attn_mask=_t(2, 3, 6, 7)), "does not broadcast"),
        "bwd_dout_shape": (lambda: attention_bwd(dout=_t(2, 3, 4, 8)), "dout must have q's shape"),
        "bwd_dout_dtype": (lambda: attention_bwd(dout=_t(2, 3, 5, 8, dtype=torch.bfloat16)), "dout has dtype"),
        "bwd_out_shape": (lambda: attention_bwd(out=_t(2, 3, 5, 7)), "out must have q's shape"),
        "bwd_out_strided": (lambda: attention_bwd(out=_strided(2, 3, 5, 8)), "out must have a contiguous last"),
        "bwd_lse_shape": (lambda: attention_bwd(lse=_t(2, 3, 4)), "lse must have shape (B, H, Sq)"),
        "bwd_lse_2d": (lambda: attention_bwd(lse=_t(6, 5)), "lse must have shape"),
        "bwd_lse_double": (lambda: attention_bwd(lse=_t(2, 3, 5, dtype=torch.float64)), "lse must be float32"),
        "bwd_kpm_shape": (lambda: attention_bwd(key_padding_mask=_t(3, 7, dtype=torch.bool)), "key_padding_mask"),
    },
}
test_cpp_ops_reject_bad_arguments = hostile.cpp_checks_test(__name__)


@pytest.mark.parametrize("backend", kernel_backends("cpu"))
def test_cpp_attention_reads_strided_inputs_correctly(backend):
    """Strided q, k, v and outputs with a contiguous last dimension are valid input (head views of
    a (B, S, H, D) projection): the result equals the contiguous call's, in forward and backward."""
    from fastformer import _ext

    assert _ext.load_error() is None
    B, H, Sq, Sk, D = 2, 3, 5, 7, 8
    q, k, v = (torch.randn(B, S, H, D).transpose(1, 2) for S in (Sq, Sk, Sk))  # (B, H, S, D) views
    assert not q.is_contiguous()
    out, lse = attention_fwd(q=q, k=k, v=v, is_causal=True)
    ref_out, ref_lse = attention_fwd(q=q.contiguous(), k=k.contiguous(), v=v.contiguous(), is_causal=True)
    torch.testing.assert_close(out, ref_out, atol=0, rtol=0)
    torch.testing.assert_close(lse, ref_lse, atol=0, rtol=0)
    dout = torch.randn(B, Sq, H, D).transpose(1, 2)
    grads = attention_bwd(dout=dout, q=q, k=k, v=v, out=out, lse=lse, is_causal=True)
    ref = attention_bwd(dout=dout.contiguous(), q=q.contiguous(), k=k.contiguous(), v=v.contiguous(),
                        out=ref_out, lse=ref_lse, is_causal=True)
    for g, r in zip(grads, ref):
        torch.testing.assert_close(g, r, atol=0, rtol=0)


# ---------------------------------------------------------------------------------- empty input

ATTENTION_SHAPES = {  # (B, H, Sq, Sk, D)
    "B0": (0, 2, 3, 5, 8),
    "H0": (2, 0, 3, 5, 8),
    "Sq0": (2, 2, 0, 5, 8),
    "Sk0": (2, 2, 3, 0, 8),  # no key at all: every row sees nothing and outputs 0
    "Sq0_Sk0": (2, 2, 0, 0, 8),
}


@pytest.mark.parametrize("backend", hostile.BACKENDS)
@pytest.mark.parametrize("case", list(ATTENTION_SHAPES))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_empty_input(backend, case, causal):
    skip_without_kernels(backend, "attention")
    B, H, Sq, Sk, D = ATTENTION_SHAPES[case]
    leaves = hostile.leaves((B, H, Sq, D), (B, H, Sk, D), (B, H, Sk, D))
    kpm = torch.zeros(B, Sk, dtype=torch.bool)
    mask = torch.zeros(Sq, Sk)

    def fn(q, k, v):
        return ops.attention(q, k, v, key_padding_mask=kpm, attn_mask=mask, is_causal=causal)

    def ref(q, k, v):
        return reference.attention(q, k, v, key_padding_mask=kpm, attn_mask=mask, is_causal=causal)
    hostile.assert_like_reference(backend, fn, ref, leaves)
    out, _ = hostile.run(backend, fn, leaves)
    assert out.shape == (B, H, Sq, D)
    if case == "Sk0":
        assert (out == 0).all(), "a query with no key must output 0"
