"""Hostile input to every public op of ``fastformer.ops``, on every backend: wrong ranks,
mismatched sizes, masks of the wrong shape or dtype, mixed devices and dtypes, integer inputs,
out-of-range targets and impossible scalars each raise a ValueError / TypeError whose message
names the argument (checked with ``match``). The op checks run before a backend is chosen, and
each case runs with every backend forced, so no backend lets one through to its kernels.

Mixed devices use the ``meta`` device, which exists on every machine."""
import math

import pytest
import torch

import fastformer
from fastformer import ops
from utils import kernel_backends

BACKENDS = [pytest.param("reference", id="reference")] + kernel_backends()


def _t(*shape, dtype=torch.float32, device="cpu"):
    if dtype in (torch.int64, torch.int32):
        return torch.zeros(shape, dtype=dtype, device=device)
    return torch.randn(shape, device=device).to(dtype)


# ------------------------------------------------------------------------------ attention
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


# ----------------------------------------------------------------------- attention_varlen
def _cu(*lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def _varlen(**over):
    args = dict(q=_t(5, 2, 8), k=_t(7, 2, 8), v=_t(7, 2, 8), cu_seqlens_q=_cu(2, 3), cu_seqlens_k=_cu(4, 3),
                max_seqlen_q=3, max_seqlen_k=4)
    args.update(over)
    positional = [args.pop(n) for n in ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")]
    return lambda: ops.attention_varlen(*positional, **args)


ATTENTION_VARLEN = {
    "q_4d": (_varlen(q=_t(1, 5, 2, 8)), ValueError, "q must have 3 dimensions"),
    "q_int": (_varlen(q=_t(5, 2, 8, dtype=torch.int64)), TypeError, "q must be a floating"),
    "k_heads": (_varlen(k=_t(7, 3, 8), v=_t(7, 3, 8)), ValueError, "k must have shape"),
    "v_rows": (_varlen(v=_t(6, 2, 8)), ValueError, "v must have shape"),
    "head_dim_0": (_varlen(q=_t(5, 2, 0), k=_t(7, 2, 0), v=_t(7, 2, 0)), ValueError, "head dim"),
    "cu_int64": (_varlen(cu_seqlens_q=_cu(2, 3).long()), TypeError, "cu_seqlens_q must be an int32"),
    "cu_float": (_varlen(cu_seqlens_k=_cu(4, 3).float()), TypeError, "cu_seqlens_k must be an int32"),
    "cu_2d": (_varlen(cu_seqlens_q=_cu(2, 3)[None]), ValueError, "cu_seqlens_q must have 1 dimension"),
    "cu_empty": (_varlen(cu_seqlens_q=_cu()[:0], cu_seqlens_k=_cu()[:0]), ValueError, r"must have shape \(B \+ 1,\)"),
    "cu_batches_differ": (_varlen(cu_seqlens_k=_cu(4, 3, 0)), ValueError, "cu_seqlens_k must have cu_seqlens_q's shape"),
    "cu_not_from_zero": (_varlen(cu_seqlens_q=_cu(2, 3) + 1), ValueError, r"cu_seqlens_q\[0\] must be 0"),
    "cu_decreasing": (_varlen(cu_seqlens_k=torch.tensor([0, 8, 7], dtype=torch.int32), max_seqlen_k=8), ValueError,
                      "non-decreasing"),
    "cu_total": (_varlen(cu_seqlens_q=_cu(2, 2)), ValueError, "must equal total_q"),
    "max_too_small": (_varlen(max_seqlen_k=3), ValueError, "max_seqlen_k is 3 but cu_seqlens_k holds a sequence of 4"),
    "max_negative": (_varlen(max_seqlen_q=-1), ValueError, "max_seqlen_q must be an int >= 0"),
    "max_float": (_varlen(max_seqlen_q=3.0), TypeError, "max_seqlen_q must be an int"),
    "cu_device": (_varlen(cu_seqlens_k=_cu(4, 3).to("meta")), ValueError, "cu_seqlens_k is on meta"),
    "dropout_one": (_varlen(dropout_p=1.0), ValueError, "dropout_p"),
    "scale_nan": (_varlen(scale=float("nan")), ValueError, "scale"),
    "is_causal_int": (_varlen(is_causal=1), TypeError, "is_causal must be a bool"),
}


ATTENTION_VARLEN_QKVPACKED = {
    "qkv_3d": (lambda: ops.attention_varlen_qkvpacked(_t(5, 3, 8), _cu(2, 3), 3), ValueError, "qkv must have 4 dimensions"),
    "qkv_two": (lambda: ops.attention_varlen_qkvpacked(_t(5, 2, 2, 8), _cu(2, 3), 3), ValueError,
                r"qkv must have shape \(total, 3, H, D\)"),
    "qkv_int": (lambda: ops.attention_varlen_qkvpacked(_t(5, 3, 2, 8, dtype=torch.int64), _cu(2, 3), 3), TypeError,
                "qkv must be a floating"),
    "cu_total": (lambda: ops.attention_varlen_qkvpacked(_t(6, 3, 2, 8), _cu(2, 3), 3), ValueError, "must equal total_q"),
}

ATTENTION_VARLEN_KVPACKED = {
    "kv_3d": (lambda: ops.attention_varlen_kvpacked(_t(5, 2, 8), _t(7, 2, 8), _cu(2, 3), _cu(4, 3), 3, 4), ValueError,
              "kv must have 4 dimensions"),
    "kv_heads": (lambda: ops.attention_varlen_kvpacked(_t(5, 2, 8), _t(7, 2, 3, 8), _cu(2, 3), _cu(4, 3), 3, 4),
                 ValueError, "kv must have shape"),
    "kv_dtype": (lambda: ops.attention_varlen_kvpacked(_t(5, 2, 8), _t(7, 2, 2, 8).double(), _cu(2, 3), _cu(4, 3), 3, 4),
                 TypeError, "kv has dtype"),
    "max_too_small": (lambda: ops.attention_varlen_kvpacked(_t(5, 2, 8), _t(7, 2, 2, 8), _cu(2, 3), _cu(4, 3), 3, 3),
                      ValueError, "max_seqlen_k is 3"),
}


# ------------------------------------------------------------------------- add_layer_norm
def _aln(x=None, residual="same", weight="ok", bias="ok", **kw):
    x = _t(4, 6) if x is None else x
    residual = _t(*x.shape) if isinstance(residual, str) else residual
    weight = _t(6) if isinstance(weight, str) else weight
    bias = _t(6) if isinstance(bias, str) else bias
    return lambda: ops.add_layer_norm(x, residual, weight, bias, **kw)


ADD_LAYER_NORM = {
    "x_0d": (_aln(x=torch.tensor(1.0), residual=None, weight=None, bias=None), ValueError,
             "x must have at least 1 dimensions"),
    "x_list": (lambda: ops.add_layer_norm([1.0], None, None, None), TypeError, "x must be a torch.Tensor"),
    "x_int": (_aln(x=_t(4, 6, dtype=torch.int64), residual=None), TypeError, "x must be a floating"),
    "residual_int": (_aln(residual=_t(4, 6, dtype=torch.int64)), TypeError, "residual must be a floating"),
    "residual_shape": (_aln(residual=_t(4, 5)), ValueError, "residual must have shape"),
    "residual_broadcast": (_aln(residual=_t(1, 6)), ValueError, "residual must have shape"),
    "residual_dtype": (_aln(residual=_t(4, 6, dtype=torch.float64)), TypeError, "residual has dtype"),
    "residual_device": (_aln(residual=_t(4, 6, device="meta")), ValueError, "residual is on meta"),
    "weight_shape": (_aln(weight=_t(5)), ValueError, "weight must have shape"),
    "weight_2d": (_aln(weight=_t(1, 6)), ValueError, "weight must have 1 dimensions"),
    "weight_int": (_aln(weight=torch.ones(6, dtype=torch.int64)), TypeError, "weight must be a floating"),
    "weight_device": (_aln(weight=_t(6, device="meta")), ValueError, "weight is on meta"),
    "bias_shape": (_aln(bias=_t(7)), ValueError, "bias must have shape"),
    "hidden_0": (_aln(x=_t(4, 0), residual=None, weight=None, bias=None), ValueError, "x's last dimension"),
    "eps_zero": (_aln(eps=0.0), ValueError, "eps must be a positive"),
    "eps_neg": (_aln(eps=-1e-5), ValueError, "eps must be a positive number \\(and finite\\), got -1e-05"),
    "eps_nan": (_aln(eps=float("nan")), ValueError, "eps"),
    "eps_inf": (_aln(eps=math.inf), ValueError, "eps"),
    "dropout_neg": (_aln(dropout_p=-0.5), ValueError, "dropout_p"),
    "dropout_one": (_aln(dropout_p=1.0), ValueError, "dropout_p"),
    "prenorm_str": (_aln(prenorm="no"), TypeError, "prenorm must be a bool"),
}


# --------------------------------------------------------------------------- feed_forward
def _ffn(x=None, w1=None, b1="ok", w2=None, b2="ok", **kw):
    E, F = 6, 10
    x = _t(3, E) if x is None else x
    w1 = _t(F, E) if w1 is None else w1
    w2 = _t(E, F) if w2 is None else w2
    b1 = _t(F) if isinstance(b1, str) else b1
    b2 = _t(E) if isinstance(b2, str) else b2
    return lambda: ops.feed_forward(x, w1, b1, w2, b2, **kw)


FEED_FORWARD = {
    "x_0d": (_ffn(x=torch.tensor(1.0)), ValueError, "x must have at least 1 dimensions"),
    "x_int": (_ffn(x=_t(3, 6, dtype=torch.int64)), TypeError, "x must be a floating"),
    "x_width": (_ffn(x=_t(3, 5)), ValueError, "w1 must have shape"),
    "w1_1d": (_ffn(w1=_t(60)), ValueError, "w1 must have 2 dimensions"),
    "w1_int": (_ffn(w1=torch.ones(10, 6, dtype=torch.int64)), TypeError, "w1 must be a floating"),
    "w2_shape": (_ffn(w2=_t(10, 6)), ValueError, "w2 must have shape"),
    "w2_list": (_ffn(w2=[[0.0]]), TypeError, "w2 must be a torch.Tensor"),
    "b1_shape": (_ffn(b1=_t(6)), ValueError, "b1 must have shape"),
    "b2_shape": (_ffn(b2=_t(10)), ValueError, "b2 must have shape"),
    "b2_2d": (_ffn(b2=_t(1, 6)), ValueError, "b2 must have 1 dimensions"),
    "width_0": (_ffn(x=_t(3, 0), w1=_t(10, 0), w2=_t(0, 10), b2=_t(0)), ValueError, "x's last dimension"),
    "w1_dtype": (_ffn(w1=_t(10, 6, dtype=torch.float64)), TypeError, "w1 has dtype"),
    "b2_dtype": (_ffn(b2=_t(6, dtype=torch.bfloat16)), TypeError, "b2 has dtype"),
    "w2_device": (_ffn(w2=_t(6, 10, device="meta")), ValueError, "w2 is on meta"),
    "b1_device": (_ffn(b1=_t(10, device="meta")), ValueError, "b1 is on meta"),
    "activation": (_ffn(activation="tanh"), ValueError, "activation must be one of"),
    "activation_none": (_ffn(activation=None), ValueError, "activation must be one of"),
    "dropout_neg": (_ffn(dropout_p=-0.1), ValueError, "dropout_p"),
    "dropout_big": (_ffn(dropout_p=2), ValueError, "dropout_p"),
}


# -------------------------------------------------------------------------- cross_entropy
def _ce(logits=None, target=None, **kw):
    logits = _t(4, 7) if logits is None else logits
    target = torch.tensor([0, 3, 6, 1]) if target is None else target
    return lambda: ops.cross_entropy(logits, target, **kw)


CROSS_ENTROPY = {
    "logits_0d": (_ce(logits=torch.tensor(1.0), target=torch.tensor(0)), ValueError,
                  "logits must have at least 1 dimensions"),
    "logits_int": (_ce(logits=torch.ones(4, 7, dtype=torch.int64)), TypeError, "logits must be a floating"),
    "logits_list": (_ce(logits=[[0.0] * 7] * 4), TypeError, "logits must be a torch.Tensor"),
    "classes_0": (_ce(logits=_t(4, 0), target=torch.full((4,), -100)), ValueError, "at least one class"),
    "target_float": (_ce(target=torch.zeros(4)), TypeError, "target must hold class indices as int64"),
    "target_int32": (_ce(target=torch.zeros(4, dtype=torch.int32)), TypeError, "target must hold class"),
    "target_probs": (_ce(target=torch.full((4, 7), 1 / 7)), TypeError, "target must hold class"),
    "target_list": (_ce(target=[0, 1, 2, 3]), TypeError, "target must be a torch.Tensor"),
    "target_shape": (_ce(target=torch.zeros(5, dtype=torch.long)), ValueError, "target must have shape"),
    "target_2d": (_ce(target=torch.zeros(4, 1, dtype=torch.long)), ValueError, "target must have shape"),
    "target_negative": (_ce(target=torch.tensor([0, -1, 2, 3])), ValueError, "target values must be in \\[0, 7\\)"),
    "target_too_big": (_ce(target=torch.tensor([0, 7, 2, 3])), ValueError, "got values in \\[0, 7\\]"),
    "target_device": (_ce(target=torch.zeros(4, dtype=torch.long, device="meta")), ValueError, "target is on meta"),
    "smoothing_neg": (_ce(label_smoothing=-0.1), ValueError, "label_smoothing must be a number in \\[0, 1\\]"),
    "smoothing_big": (_ce(label_smoothing=1.5), ValueError, "label_smoothing"),
    "smoothing_nan": (_ce(label_smoothing=float("nan")), ValueError, "label_smoothing"),
    "smoothing_str": (_ce(label_smoothing="0.1"), ValueError, "label_smoothing"),
    "reduction": (_ce(reduction="avg"), ValueError, "reduction must be one of"),
    "ignore_index_float": (_ce(ignore_index=-100.0), TypeError, "ignore_index must be an int"),
}


# -------------------------------------------------------------------- linear_cross_entropy
def _lce(hidden=None, weight=None, bias="ok", target=None, class_weight=None, **kw):
    hidden = _t(4, 6) if hidden is None else hidden
    weight = _t(9, 6) if weight is None else weight
    bias = _t(9) if isinstance(bias, str) else bias
    target = torch.tensor([0, 3, 8, 1]) if target is None else target
    return lambda: ops.linear_cross_entropy(hidden, weight, target, linear_bias=bias, weight=class_weight, **kw)


LINEAR_CROSS_ENTROPY = {
    "hidden_0d": (_lce(hidden=torch.tensor(1.0), target=torch.tensor(0)), ValueError,
                  "input must have at least 1 dimensions"),
    "hidden_int": (_lce(hidden=torch.ones(4, 6, dtype=torch.int64)), TypeError, "input must be a floating"),
    "hidden_width": (_lce(hidden=_t(4, 5)), ValueError, "input's last dimension must equal"),
    "hidden_width_0": (_lce(hidden=_t(4, 0), weight=_t(9, 0)), ValueError, "input's last dimension \\(the hidden"),
    "weight_1d": (_lce(weight=_t(54)), ValueError, "linear_weight must have 2 dimensions"),
    "weight_int": (_lce(weight=torch.ones(9, 6, dtype=torch.int32)), TypeError, "linear_weight must be a floating"),
    "weight_rows_0": (_lce(weight=_t(0, 6), bias=None, target=torch.full((4,), -100)), ValueError,
                      "at least one class"),
    "weight_dtype": (_lce(weight=_t(9, 6, dtype=torch.float64)), TypeError, "linear_weight has dtype"),
    "weight_device": (_lce(weight=_t(9, 6, device="meta")), ValueError, "linear_weight is on meta"),
    "bias_shape": (_lce(bias=_t(6)), ValueError, "linear_bias must have shape"),
    "bias_dtype": (_lce(bias=_t(9, dtype=torch.bfloat16)), TypeError, "linear_bias has dtype"),
    "target_float": (_lce(target=torch.zeros(4)), TypeError, "target must hold class indices"),
    "target_shape": (_lce(target=torch.zeros(3, dtype=torch.long)), ValueError, "target must have shape"),
    "target_negative": (_lce(target=torch.tensor([0, -5, 1, 1])), ValueError, "target values must be in"),
    "target_too_big": (_lce(target=torch.tensor([0, 9, 1, 1])), ValueError, "target values must be in \\[0, 9\\)"),
    "target_device": (_lce(target=torch.zeros(4, dtype=torch.long, device="meta")), ValueError,
                      "target is on meta"),
    "smoothing_big": (_lce(label_smoothing=1.01), ValueError, "label_smoothing"),
    "reduction": (_lce(reduction=None), ValueError, "reduction must be one of"),
    "class_weight": (_lce(weight=None, class_weight=_t(9)), ValueError, "weight \\(per-class rescaling"),
}

# ------------------------------------------------------------------------------ embedding
def _emb(**over):
    args = dict(input=torch.tensor([[0, 3, 1]]), weight=_t(4, 5))
    args.update(over)
    ids, weight = args.pop("input"), args.pop("weight")
    return lambda: ops.embedding(ids, weight, **args)


EMBEDDING = {
    "input_float": (_emb(input=_t(1, 3)), TypeError, "input must hold integer ids"),
    "input_list": (_emb(input=[0, 1]), TypeError, "input must be a torch.Tensor"),
    "input_too_big": (_emb(input=torch.tensor([0, 4])), ValueError, "input must be in \\[0, 4\\)"),
    "input_negative": (_emb(input=torch.tensor([-1, 2])), ValueError, "input must be in \\[0, 4\\)"),
    "input_device": (_emb(input=torch.zeros(3, dtype=torch.long, device="meta")), ValueError, "is on meta"),
    "weight_1d": (_emb(weight=_t(5)), ValueError, "weight must have 2 dimensions"),
    "weight_int": (_emb(weight=_t(4, 5, dtype=torch.int64)), TypeError, "weight must be a floating"),
    "positional_width": (_emb(positional=_t(3, 4)), ValueError, "positional must have shape"),
    "positional_short": (_emb(positional=_t(2, 5)), ValueError, "positional has 2 rows"),
    "positional_dtype": (_emb(positional=_t(3, 5, dtype=torch.bfloat16)), TypeError, "positional has dtype"),
    "positions_alone": (_emb(positions=torch.zeros(1, 3, dtype=torch.long)), ValueError,
                        "positions were given without a positional table"),
    "positions_shape": (_emb(positional=_t(3, 5), positions=torch.zeros(3, dtype=torch.long)), ValueError,
                        "positions must have shape"),
    "positions_float": (_emb(positional=_t(3, 5), positions=_t(1, 3)), TypeError, "positions must hold integer ids"),
    "positions_too_big": (_emb(positional=_t(3, 5), positions=torch.tensor([[0, 1, 3]])), ValueError,
                          "positions must be in \\[0, 3\\)"),
    "padding_idx_big": (_emb(padding_idx=4), ValueError, "padding_idx must be in"),
    "padding_idx_float": (_emb(padding_idx=0.0), TypeError, "padding_idx must be an int"),
    "dropout_one": (_emb(dropout_p=1.0), ValueError, "dropout_p"),
    "scale_nan": (_emb(scale=math.nan), ValueError, "scale must be a finite number"),
}

ALL = {"attention": ATTENTION, "attention_varlen": ATTENTION_VARLEN,
       "attention_varlen_qkvpacked": ATTENTION_VARLEN_QKVPACKED, "attention_varlen_kvpacked": ATTENTION_VARLEN_KVPACKED,
       "add_layer_norm": ADD_LAYER_NORM, "feed_forward": FEED_FORWARD,
       "cross_entropy": CROSS_ENTROPY, "linear_cross_entropy": LINEAR_CROSS_ENTROPY, "embedding": EMBEDDING}


def test_every_public_op_has_hostile_cases():
    public = [name for name in ops.__all__ if callable(getattr(ops, name))]
    assert sorted(public) == sorted(ALL), f"ops.__all__ {public} and the hostile cases {sorted(ALL)} differ"


def _cases():
    params = []
    for op, cases in ALL.items():
        for name, (call, exc, match) in cases.items():
            params.append(pytest.param(call, exc, match, id=f"{op}-{name}"))
    return params


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("call, exc, match", _cases())
def test_bad_input_raises_naming_the_argument(backend, call, exc, match):
    with fastformer.use_backend(backend), pytest.raises(exc, match=match):
        call()
