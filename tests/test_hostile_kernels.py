"""The C++ ops called directly (``torch.ops.fastformer.<op>``, bypassing the Python checks) with
wrong ranks, dtypes, shapes, non-contiguous tensors and impossible scalars: each raises a
RuntimeError from a TORCH_CHECK that names what is wrong; none crashes or reads out of bounds.

Each op's cases run in a child process, so a segfault fails that op's test instead of killing
pytest. The seed and offset arguments are passed as the schema declares them: two ints
(philox_bits) or the dropout ops' ``philox`` tensor, int64 CPU (2,) = (seed, offset)."""
import json
import os
import subprocess
import sys

import pytest
import torch

from utils import kernel_backends

pytestmark = pytest.mark.parametrize("backend", kernel_backends("cpu"))

HERE = os.path.dirname(os.path.abspath(__file__))


def call(name, **kw):
    """``torch.ops.fastformer.<name>`` with keyword arguments in schema order; where the schema
    takes a ``philox`` tensor, the int ``seed`` and ``offset`` become ``tensor([seed, offset])``
    unless a ``philox`` argument is given."""
    op = getattr(torch.ops.fastformer, name).default
    names = [a.name for a in op._schema.arguments]
    if "philox" in names:
        seed, offset = kw.pop("seed"), kw.pop("offset")
        kw.setdefault("philox", torch.tensor([seed, offset], dtype=torch.int64))
    args = [kw.pop(n) for n in names]
    assert not kw, f"{name} has no arguments {sorted(kw)}"
    return op(*args)


def _r(*shape, dtype=torch.float32):
    if dtype.is_floating_point:
        return torch.randn(shape).to(dtype)
    return torch.zeros(shape, dtype=dtype)


def _strided(*shape):
    """A tensor of ``shape`` whose last dimension has stride 2 (not contiguous)."""
    return torch.randn(*shape[:-1], 2 * shape[-1])[..., ::2]


RNG = dict(seed=0, offset=0)


# ---------------------------------------------------------------------------- good arguments
def attention_fwd(**over):
    kw = dict(q=_r(2, 3, 5, 8), k=_r(2, 3, 7, 8), v=_r(2, 3, 7, 8), key_padding_mask=None, attn_mask=None,
              is_causal=False, scale=0.35, dropout_p=0.0, **RNG)
    kw.update(over)
    return call("attention_fwd", **kw)


def attention_bwd(**over):
    kw = dict(dout=_r(2, 3, 5, 8), q=_r(2, 3, 5, 8), k=_r(2, 3, 7, 8), v=_r(2, 3, 7, 8), out=_r(2, 3, 5, 8),
              lse=_r(2, 3, 5), key_padding_mask=None, attn_mask=None, is_causal=False, scale=0.35,
              dropout_p=0.0, **RNG)
    kw.update(over)
    return call("attention_bwd", **kw)


def add_layer_norm_fwd(**over):
    kw = dict(x=_r(4, 6), residual=_r(4, 6), weight=_r(6), bias=_r(6), eps=1e-5, dropout_p=0.0, **RNG)
    kw.update(over)
    return call("add_layer_norm_fwd", **kw)


def add_layer_norm_bwd(**over):
    kw = dict(dy=_r(4, 6), dh=None, h=_r(4, 6), weight=_r(6), mean=_r(4), rstd=_r(4).abs(), dropout_p=0.0,
              has_residual=True, **RNG)
    kw.update(over)
    return call("add_layer_norm_bwd", **kw)


def feed_forward_fwd(**over):
    kw = dict(x=_r(3, 6), w1=_r(10, 6), b1=_r(10), w2=_r(6, 10), b2=_r(6), activation="relu", dropout_p=0.0,
              **RNG)
    kw.update(over)
    return call("feed_forward_fwd", **kw)


def feed_forward_bwd(**over):
    kw = dict(dout=_r(3, 6), x=_r(3, 6), w1=_r(10, 6), w2=_r(6, 10), pre=_r(3, 10), has_b1=True, has_b2=True,
              activation="gelu", dropout_p=0.0, **RNG)
    kw.update(over)
    return call("feed_forward_bwd", **kw)


def cross_entropy_fwd(**over):
    kw = dict(logits=_r(4, 7), target=torch.tensor([0, 6, 3, -100]), label_smoothing=0.1, ignore_index=-100,
              reduction=1, compute_grad=True)
    kw.update(over)
    return call("cross_entropy_fwd", **kw)


def linear_cross_entropy_fwd(**over):
    kw = dict(hidden=_r(4, 6), weight=_r(9, 6), bias=_r(9), target=torch.tensor([0, 8, 3, -100]),
              label_smoothing=0.1, ignore_index=-100, reduction=1, compute_grad=True)
    kw.update(over)
    return call("linear_cross_entropy_fwd", **kw)


def linear_cross_entropy_bwd(**over):
    kw = dict(grad_loss=_r(4), hidden=_r(4, 6), weight=_r(9, 6), bias=_r(9), target=torch.tensor([0, 8, 3, 1]),
              label_smoothing=0.0, ignore_index=-100)
    kw.update(over)
    return call("linear_cross_entropy_bwd", **kw)


def philox_bits(**over):
    kw = dict(n=8, **RNG)
    kw.update(over)
    return call("philox_bits", **kw)


# -------------------------------------------------------------------------------- bad calls
# op -> {case: (thunk, substring the TORCH_CHECK message must contain)}
CASES = {
    "attention": {
        "q_3d": (lambda: attention_fwd(q=_r(2, 5, 8)), "q must be 4-D"),
        "q_int": (lambda: attention_fwd(q=_r(2, 3, 5, 8, dtype=torch.int64)), "q must be float32, float64 or bfloat16"),
        "q_half": (lambda: attention_fwd(q=_r(2, 3, 5, 8, dtype=torch.float16)), "q must be float32"),
        "k_dtype": (lambda: attention_fwd(k=_r(2, 3, 7, 8, dtype=torch.float64)), "k has dtype Double"),
        "k_heads": (lambda: attention_fwd(k=_r(2, 2, 7, 8)), "k must have shape (B, H, Sk, D)"),
        "k_head_dim": (lambda: attention_fwd(k=_r(2, 3, 7, 9)), "k must have shape"),
        "v_length": (lambda: attention_fwd(v=_r(2, 3, 6, 8)), "v must have k's shape"),
        "q_strided_last_dim": (lambda: attention_fwd(q=_strided(2, 3, 5, 8)), "q must have a contiguous last"),
        "v_strided_last_dim": (lambda: attention_fwd(v=_strided(2, 3, 7, 8)), "v must have a contiguous last"),
        "head_dim_300": (lambda: attention_fwd(q=_r(1, 1, 2, 300), k=_r(1, 1, 2, 300), v=_r(1, 1, 2, 300)),
                         "head dim D must be in [1, 256]"),
        "head_dim_0": (lambda: attention_fwd(q=_r(2, 3, 5, 0), k=_r(2, 3, 7, 0), v=_r(2, 3, 7, 0)), "head dim D"),
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
        "kpm_float": (lambda: attention_fwd(key_padding_mask=_r(2, 7)), "key_padding_mask must be bool"),
        "kpm_shape": (lambda: attention_fwd(key_padding_mask=_r(2, 5, dtype=torch.bool)),
                      "key_padding_mask must have shape (B, Sk) = (2, 7)"),
        "kpm_3d": (lambda: attention_fwd(key_padding_mask=_r(2, 1, 7, dtype=torch.bool)), "key_padding_mask must have"),
        "mask_bool": (lambda: attention_fwd(attn_mask=_r(1, 1, 5, 7, dtype=torch.bool)), "attn_mask must be float32"),
        "mask_double": (lambda: attention_fwd(attn_mask=_r(1, 1, 5, 7, dtype=torch.float64)), "attn_mask must be float32"),
        "mask_2d": (lambda: attention_fwd(attn_mask=_r(5, 7)), "attn_mask must be a 4-D view"),
        "mask_size": (lambda: attention_fwd(attn_mask=_r(1, 1, 5, 6)), "does not broadcast to (B, H, Sq, Sk)"),
        "mask_too_big": (lambda: attention_fwd(attn_mask=_r(2, 3, 6, 7)), "does not broadcast"),
        "bwd_dout_shape": (lambda: attention_bwd(dout=_r(2, 3, 4, 8)), "dout must have q's shape"),
        "bwd_dout_dtype": (lambda: attention_bwd(dout=_r(2, 3, 5, 8, dtype=torch.bfloat16)), "dout has dtype"),
        "bwd_out_shape": (lambda: attention_bwd(out=_r(2, 3, 5, 7)), "out must have q's shape"),
        "bwd_out_strided": (lambda: attention_bwd(out=_strided(2, 3, 5, 8)), "out must have a contiguous last"),
        "bwd_lse_shape": (lambda: attention_bwd(lse=_r(2, 3, 4)), "lse must have shape (B, H, Sq)"),
        "bwd_lse_2d": (lambda: attention_bwd(lse=_r(6, 5)), "lse must have shape"),
        "bwd_lse_double": (lambda: attention_bwd(lse=_r(2, 3, 5, dtype=torch.float64)), "lse must be float32"),
        "bwd_kpm_shape": (lambda: attention_bwd(key_padding_mask=_r(3, 7, dtype=torch.bool)), "key_padding_mask"),
    },
    "add_layer_norm": {
        "x_1d": (lambda: add_layer_norm_fwd(x=_r(6), residual=None), "x must be 2-D (N, C)"),
        "x_3d": (lambda: add_layer_norm_fwd(x=_r(2, 2, 6), residual=None), "x must be 2-D"),
        "x_int": (lambda: add_layer_norm_fwd(x=_r(4, 6, dtype=torch.int32), residual=None), "x must be"),
        "x_strided": (lambda: add_layer_norm_fwd(x=_strided(4, 6)), "x must be contiguous"),
        "x_transposed": (lambda: add_layer_norm_fwd(x=_r(6, 4).t(), residual=None), "x must be contiguous"),
        "residual_shape": (lambda: add_layer_norm_fwd(residual=_r(4, 5)), "residual must have the shape of x"),
        "residual_rows": (lambda: add_layer_norm_fwd(residual=_r(3, 6)), "residual must have the shape of x"),
        "residual_dtype": (lambda: add_layer_norm_fwd(residual=_r(4, 6, dtype=torch.float64)), "residual must have the dtype"),
        "residual_strided": (lambda: add_layer_norm_fwd(residual=_strided(4, 6)), "residual must be contiguous"),
        "weight_shape": (lambda: add_layer_norm_fwd(weight=_r(5)), "weight must have shape"),
        "weight_2d": (lambda: add_layer_norm_fwd(weight=_r(1, 6)), "weight must have shape"),
        "weight_dtype": (lambda: add_layer_norm_fwd(weight=_r(6, dtype=torch.bfloat16)), "weight must have the dtype"),
        "weight_strided": (lambda: add_layer_norm_fwd(weight=_strided(6)), "weight must be contiguous"),
        "bias_shape": (lambda: add_layer_norm_fwd(bias=_r(7)), "bias must have shape"),
        "eps_zero": (lambda: add_layer_norm_fwd(eps=0.0), "eps must be"),
        "eps_neg": (lambda: add_layer_norm_fwd(eps=-1.0), "eps must be"),
        "eps_nan": (lambda: add_layer_norm_fwd(eps=float("nan")), "eps must be"),
        "eps_inf": (lambda: add_layer_norm_fwd(eps=float("inf")), "eps must be"),
        "dropout_one": (lambda: add_layer_norm_fwd(dropout_p=1.0), "dropout_p must be in [0, 1)"),
        "seed_neg": (lambda: add_layer_norm_fwd(seed=-1), "the philox seed philox[0] must be >= 0"),
        "philox_int32": (lambda: add_layer_norm_fwd(philox=torch.zeros(2, dtype=torch.int32)), "philox must be int64"),
        "philox_1": (lambda: add_layer_norm_fwd(philox=torch.zeros(1, dtype=torch.int64)), "philox must have shape (2,)"),
        "bwd_philox_strided": (lambda: add_layer_norm_bwd(philox=torch.zeros(4, dtype=torch.int64)[::2]),
                               "philox must be contiguous"),
        "bwd_offset_neg": (lambda: add_layer_norm_bwd(offset=-2), "the philox offset philox[1] must be >= 0"),
        "bwd_dy_shape": (lambda: add_layer_norm_bwd(dy=_r(4, 5)), "dy must have the shape of h"),
        "bwd_dy_dtype": (lambda: add_layer_norm_bwd(dy=_r(4, 6, dtype=torch.float64)), "dy must have the dtype"),
        "bwd_dh_shape": (lambda: add_layer_norm_bwd(dh=_r(5, 6)), "dh must have the shape of h"),
        "bwd_h_strided": (lambda: add_layer_norm_bwd(h=_strided(4, 6)), "h must be contiguous"),
        "bwd_mean_shape": (lambda: add_layer_norm_bwd(mean=_r(3)), "mean must have shape"),
        "bwd_rstd_dtype": (lambda: add_layer_norm_bwd(rstd=_r(4, dtype=torch.float64)), "rstd must be float32"),
        "bwd_weight_shape": (lambda: add_layer_norm_bwd(weight=_r(4)), "weight must have shape"),
        "bwd_dropout_neg": (lambda: add_layer_norm_bwd(dropout_p=-0.5), "dropout_p must be in [0, 1)"),
    },
    "feed_forward": {
        "x_3d": (lambda: feed_forward_fwd(x=_r(1, 3, 6)), "x must be 2-D (N, E)"),
        "x_int": (lambda: feed_forward_fwd(x=_r(3, 6, dtype=torch.int64)), "x must be"),
        "x_strided": (lambda: feed_forward_fwd(x=_strided(3, 6)), "x must be contiguous"),
        "w1_shape": (lambda: feed_forward_fwd(w1=_r(10, 7)), "w1 must have shape"),
        "w1_1d": (lambda: feed_forward_fwd(w1=_r(60)), "w1 must have shape"),
        "w1_dtype": (lambda: feed_forward_fwd(w1=_r(10, 6, dtype=torch.float64)), "w1 must have the dtype of x"),
        "w1_transposed": (lambda: feed_forward_fwd(w1=_r(6, 10).t()), "w1 must be contiguous"),
        "w2_shape": (lambda: feed_forward_fwd(w2=_r(10, 6)), "w2 must have shape"),
        "b1_shape": (lambda: feed_forward_fwd(b1=_r(6)), "b1 must have shape"),
        "b2_dtype": (lambda: feed_forward_fwd(b2=_r(6, dtype=torch.bfloat16)), "b2 must have the dtype of x"),
        "b2_strided": (lambda: feed_forward_fwd(b2=_strided(6)), "b2 must be contiguous"),
        "activation": (lambda: feed_forward_fwd(activation="tanh"), "activation"),
        "dropout_neg": (lambda: feed_forward_fwd(dropout_p=-0.1), "dropout_p must be in [0, 1)"),
        "offset_neg": (lambda: feed_forward_fwd(offset=-1), "the philox offset philox[1] must be >= 0"),
        "philox_float": (lambda: feed_forward_fwd(philox=torch.zeros(2, dtype=torch.float64)), "philox must be int64"),
        "philox_empty": (lambda: feed_forward_fwd(philox=torch.zeros(0, dtype=torch.int64)), "philox must have shape (2,)"),
        "bwd_seed_neg": (lambda: feed_forward_bwd(seed=-5), "the philox seed philox[0] must be >= 0"),
        "bwd_philox_2d": (lambda: feed_forward_bwd(philox=torch.zeros(2, 1, dtype=torch.int64)), "philox must have shape"),
        "bwd_dout_shape": (lambda: feed_forward_bwd(dout=_r(3, 7)), "dout must have shape"),
        "bwd_dout_rows": (lambda: feed_forward_bwd(dout=_r(4, 6)), "dout must have shape"),
        "bwd_pre_shape": (lambda: feed_forward_bwd(pre=_r(3, 9)), "pre must have shape"),
        "bwd_pre_dtype": (lambda: feed_forward_bwd(pre=_r(3, 10, dtype=torch.float64)), "pre must have the dtype"),
        "bwd_pre_strided": (lambda: feed_forward_bwd(pre=_strided(3, 10)), "pre must be contiguous"),
        "bwd_w2_shape": (lambda: feed_forward_bwd(w2=_r(6, 11)), "w2 must have shape"),
        "bwd_activation": (lambda: feed_forward_bwd(activation=""), "activation"),
    },
    "cross_entropy": {
        "logits_1d": (lambda: cross_entropy_fwd(logits=_r(7)), "logits must have 2 dimensions"),
        "logits_int": (lambda: cross_entropy_fwd(logits=_r(4, 7, dtype=torch.int64)), "logits must be"),
        "logits_strided": (lambda: cross_entropy_fwd(logits=_strided(4, 7)), "logits must be contiguous"),
        "classes_0": (lambda: cross_entropy_fwd(logits=_r(4, 0)), "at least one class"),
        "target_shape": (lambda: cross_entropy_fwd(target=torch.tensor([0, 1, 2])), "target must have shape (4"),
        "target_2d": (lambda: cross_entropy_fwd(target=torch.zeros(4, 1, dtype=torch.long)), "target must have shape"),
        "target_int32": (lambda: cross_entropy_fwd(target=torch.zeros(4, dtype=torch.int32)), "target must be int64"),
        "target_float": (lambda: cross_entropy_fwd(target=torch.zeros(4)), "target must be int64"),
        "target_strided": (lambda: cross_entropy_fwd(target=torch.zeros(8, dtype=torch.long)[::2]),
                           "target must be contiguous"),
        "target_too_big": (lambda: cross_entropy_fwd(target=torch.tensor([0, 7, 1, 1])), "target[1] = 7"),
        "target_negative": (lambda: cross_entropy_fwd(target=torch.tensor([0, 1, -1, 1])), "target[2] = -1"),
        "target_huge": (lambda: cross_entropy_fwd(target=torch.tensor([0, 1, 1, 2 ** 40])), "target[3]"),
        "smoothing_big": (lambda: cross_entropy_fwd(label_smoothing=1.5), "label_smoothing"),
        "smoothing_nan": (lambda: cross_entropy_fwd(label_smoothing=float("nan")), "label_smoothing"),
        "reduction_3": (lambda: cross_entropy_fwd(reduction=3), "reduction"),
        "reduction_neg": (lambda: cross_entropy_fwd(reduction=-1), "reduction"),
    },
    "linear_cross_entropy": {
        "hidden_3d": (lambda: linear_cross_entropy_fwd(hidden=_r(1, 4, 6)), "hidden must have 2 dimensions"),
        "hidden_strided": (lambda: linear_cross_entropy_fwd(hidden=_strided(4, 6)), "hidden must be contiguous"),
        "weight_shape": (lambda: linear_cross_entropy_fwd(weight=_r(9, 5)), "weight must have shape (V, 6)"),
        "weight_dtype": (lambda: linear_cross_entropy_fwd(weight=_r(9, 6, dtype=torch.float64)), "weight has dtype"),
        "weight_transposed": (lambda: linear_cross_entropy_fwd(weight=_r(6, 9).t()), "weight must be contiguous"),
        "weight_rows_0": (lambda: linear_cross_entropy_fwd(weight=_r(0, 6), bias=None,
                                                            target=torch.full((4,), -100)), "at least one row"),
        "bias_shape": (lambda: linear_cross_entropy_fwd(bias=_r(8)), "bias must have shape (9,)"),
        "bias_dtype": (lambda: linear_cross_entropy_fwd(bias=_r(9, dtype=torch.bfloat16)), "bias has dtype"),
        "target_shape": (lambda: linear_cross_entropy_fwd(target=torch.tensor([0, 1])), "target must have shape"),
        "target_too_big": (lambda: linear_cross_entropy_fwd(target=torch.tensor([0, 9, 1, 1])), "target[1] = 9"),
        "target_negative": (lambda: linear_cross_entropy_fwd(target=torch.tensor([-7, 1, 1, 1])), "target[0] = -7"),
        "grad_with_none": (lambda: linear_cross_entropy_fwd(reduction=0), "compute_grad needs reduction mean"),
        "smoothing_neg": (lambda: linear_cross_entropy_fwd(label_smoothing=-0.1), "label_smoothing"),
        "bwd_grad_loss_shape": (lambda: linear_cross_entropy_bwd(grad_loss=_r(3)), "grad_loss must have shape (4,)"),
        "bwd_grad_loss_int": (lambda: linear_cross_entropy_bwd(grad_loss=_r(4, dtype=torch.int64)),
                              "grad_loss must be a floating-point"),
        "bwd_target_too_big": (lambda: linear_cross_entropy_bwd(target=torch.tensor([0, 1, 2, 100])), "target[3]"),
        "bwd_hidden_int": (lambda: linear_cross_entropy_bwd(hidden=_r(4, 6, dtype=torch.int32)), "hidden must be"),
    },
    "philox_bits": {
        "n_neg": (lambda: philox_bits(n=-1), "n must be >= 0"),
        "seed_neg": (lambda: philox_bits(seed=-1), "seed must be >= 0"),
        "offset_neg": (lambda: philox_bits(offset=-1), "offset must be >= 0"),
    },
}


def _child(group: str) -> None:
    """Run one op's cases here (a child process) and print one JSON line per case."""
    from fastformer import _ext

    assert _ext.load_error() is None, _ext.load_error()
    for name, (thunk, _) in CASES[group].items():
        try:
            thunk()
            result = {"case": name, "error": None, "message": ""}
        except Exception as e:  # report every exception type: the test asserts RuntimeError
            result = {"case": name, "error": type(e).__name__, "message": str(e).splitlines()[0]}
        print(json.dumps(result), flush=True)


@pytest.mark.parametrize("group", list(CASES))
def test_cpp_ops_reject_bad_arguments(backend, group):
    code = f"import sys; sys.path.insert(0, {HERE!r}); import test_hostile_kernels as t; t._child({group!r})"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ))
    assert proc.returncode == 0, f"{group}: the child died (status {proc.returncode}):\n{proc.stderr[-3000:]}"
    results = {r["case"]: r for r in map(json.loads, proc.stdout.splitlines())}
    assert set(results) == set(CASES[group]), f"cases missing from the child's report: {proc.stderr[-2000:]}"
    bad = []
    for name, (_, want) in CASES[group].items():
        r = results[name]
        if r["error"] != "RuntimeError" or want not in r["message"]:
            bad.append(f"{name}: {r['error']}: {r['message']!r} (want RuntimeError containing {want!r})")
    assert not bad, "\n".join(bad)


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
