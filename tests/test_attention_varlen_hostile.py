"""attention_varlen's bad input with every backend forced, for the op and its packed forms
attention_varlen_qkvpacked / attention_varlen_kvpacked (the machinery: tests/hostile.py; the
C++ kernel's checks and more cases on the default backend: tests/test_attention_varlen.py)."""
import torch

from fastformer import ops
import hostile
from hostile import cu_seqlens as _cu, tensor as _t


def _varlen(**over):
    args = dict(q=_t(5, 2, 8), k=_t(7, 2, 8), v=_t(7, 2, 8), cu_seqlens_q=_cu(2, 3), cu_seqlens_k=_cu(4, 3),
                max_seqlen_q=3, max_seqlen_k=4)
    args.update(over)
    positional = [args.pop(n) for n in ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")]
    return lambda: ops.attention_varlen(*positional, **args)


ATTENTION_VARLEN = {
    "q_4d": (_varlen(q=_t(1, 5, 2, 8)), ValueError, "q must have 3 dimensions"),
    "q_int": (_varlen(q=_t(5, 2, 8, dtype=torch.int64)), TypeError, "q must be a floating"),
    "k_heads": (_varlen(k=_t(7, 3, 8), v=_t(7, 3, 8)), ValueError, "k has 3 heads, which must divide"),
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
                 ValueError, "kv has 3 heads, which must divide"),
    "kv_dtype": (lambda: ops.attention_varlen_kvpacked(_t(5, 2, 8), _t(7, 2, 2, 8).double(), _cu(2, 3), _cu(4, 3), 3, 4),
                 TypeError, "kv has dtype"),
    "max_too_small": (lambda: ops.attention_varlen_kvpacked(_t(5, 2, 8), _t(7, 2, 2, 8), _cu(2, 3), _cu(4, 3), 3, 3),
                      ValueError, "max_seqlen_k is 3"),
}



BAD_INPUT = {"attention_varlen": ATTENTION_VARLEN, "attention_varlen_qkvpacked": ATTENTION_VARLEN_QKVPACKED,
             "attention_varlen_kvpacked": ATTENTION_VARLEN_KVPACKED}
test_bad_input_raises_naming_the_argument = hostile.bad_input_test(**BAD_INPUT)
