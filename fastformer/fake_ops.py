"""Fake (meta) implementations of the shared op schemas (csrc/schemas.h), written once: each
returns empty tensors of the shapes and dtypes every backend's kernel returns. torch.compile
traces the ops through them without a graph break.

``register(namespace)`` attaches them to one namespace's ops: ``fastformer`` (the C++ extension,
done by ``_ext.load_error`` once it is loaded); the Triton kernels take them from ``FAKES``
(``fastformer/triton_kernels/registration.py``).
"""
from typing import Callable, Dict

import torch

FAKES: Dict[str, Callable] = {}


def _fake(fn: Callable) -> Callable:
    FAKES[fn.__name__] = fn
    return fn


def _empty(t, *shape, dtype=None):
    return t.new_empty(shape, dtype=dtype or t.dtype)


def _stat_dtype(t):
    """The per-row statistics' dtype (log-sum-exp, mean, rstd): fp32, fp64 for fp64 inputs."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


@_fake
def philox_bits(n, seed, offset):
    return torch.empty(n, dtype=torch.int64)


def _rel_bias_grad(q, rel_bias):
    """The backward's fourth result: rel_bias's gradient, or an empty (0,) tensor without one."""
    if rel_bias is None:
        return _empty(q, 0, dtype=_stat_dtype(q))
    return torch.empty_like(rel_bias)


@_fake
def attention_fwd(q, k, v, key_padding_mask, attn_mask, is_causal, scale, dropout_p, philox, rel_bias=None,
                  rel_shift=0):
    B, H, Sq, D = q.shape
    return _empty(q, B, H, Sq, D), _empty(q, B, H, Sq, dtype=_stat_dtype(q))


@_fake
def attention_bwd(dout, q, k, v, out, lse, key_padding_mask, attn_mask, is_causal, scale, dropout_p, philox,
                  rel_bias=None, rel_shift=0):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), _rel_bias_grad(q, rel_bias)


@_fake
def attention_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal, scale,
                         dropout_p, philox, rel_bias=None):
    total_q, H, D = q.shape
    return _empty(q, total_q, H, D), _empty(q, H, total_q, dtype=_stat_dtype(q))


@_fake
def attention_varlen_bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                         is_causal, scale, dropout_p, philox, rel_bias=None):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), _rel_bias_grad(q, rel_bias)


def attention_varlen_bwd_into(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                             is_causal, scale, dropout_p, philox, rel_bias=None, *, dq, dk, dv):
    return _rel_bias_grad(q, rel_bias)


FAKES["attention_varlen_bwd.into"] = attention_varlen_bwd_into  # an overload: "<op>.<overload>"


@_fake
def add_layer_norm_fwd(x, residual, weight, bias, eps, dropout_p, philox, rms_norm=False):
    # rms_norm: mean is still (N,) (zeros: RMSNorm has none), so the shapes do not depend on it
    N = x.shape[0]
    return (torch.empty_like(x), torch.empty_like(x), _empty(x, N, dtype=_stat_dtype(x)),
            _empty(x, N, dtype=_stat_dtype(x)))


@_fake
def add_layer_norm_bwd(dy, dh, h, weight, mean, rstd, dropout_p, philox, has_residual, rms_norm=False):
    dres = torch.empty_like(h) if (has_residual and dropout_p > 0.0) else _empty(h, 0)
    return torch.empty_like(h), dres, torch.empty_like(weight), torch.empty_like(weight)


def add_layer_norm_fwd_x_bias(x, residual, weight, bias, eps, dropout_p, philox, x_bias, rms_norm=False):
    return add_layer_norm_fwd(x, residual, weight, bias, eps, dropout_p, philox)


def add_layer_norm_bwd_x_bias(dy, dh, h, weight, mean, rstd, dropout_p, philox, has_residual, rms_norm=False):
    return (*add_layer_norm_bwd(dy, dh, h, weight, mean, rstd, dropout_p, philox, has_residual),
            torch.empty_like(weight))


FAKES["add_layer_norm_fwd.x_bias"] = add_layer_norm_fwd_x_bias
FAKES["add_layer_norm_bwd.x_bias"] = add_layer_norm_bwd_x_bias


@_fake
def feed_forward_fwd(x, w1, b1, w2, b2, activation, dropout_p, philox, w3=None, b3=None):
    hidden = w1.shape[0] if w3 is None else 2 * w1.shape[0]  # gated: [gate | up]
    return _empty(x, x.shape[0], w2.shape[0]), _empty(x, x.shape[0], hidden)


@_fake
def feed_forward_bwd(dout, x, w1, w2, pre, has_b1, has_b2, activation, dropout_p, philox, w3=None, has_b3=False):
    if w3 is not None:  # gated: [dw1; dw3] (2F, E), [db1; db3] (2F,)
        F_ = w1.shape[0]
        db1 = _empty(w1, 2 * F_) if has_b1 or has_b3 else _empty(w1, 0)
        dw1 = _empty(w1, 2 * F_, w1.shape[1])
    else:
        db1 = _empty(w1, w1.shape[0]) if has_b1 else _empty(w1, 0)
        dw1 = torch.empty_like(w1)
    db2 = _empty(w2, w2.shape[0]) if has_b2 else _empty(w2, 0)
    return torch.empty_like(x), dw1, db1, torch.empty_like(w2), db2


@_fake
def cross_entropy_fwd(logits, target, label_smoothing, ignore_index, reduction, compute_grad, class_weight=None):
    loss = _empty(logits, logits.shape[0]) if reduction == 0 else _empty(logits)
    grad = torch.empty_like(logits) if compute_grad else _empty(logits, 0)
    return loss, grad


@_fake
def linear_cross_entropy_fwd(hidden, weight, bias, target, label_smoothing, ignore_index, reduction,
                             compute_grad, class_weight=None):
    loss = _empty(hidden, hidden.shape[0]) if reduction == 0 else _empty(hidden)
    if not compute_grad:
        return loss, _empty(hidden, 0), _empty(weight, 0), _empty(weight, 0)
    db = _empty(weight, weight.shape[0]) if bias is not None else _empty(weight, 0)
    return loss, torch.empty_like(hidden), torch.empty_like(weight), db


@_fake
def linear_cross_entropy_bwd(grad_loss, hidden, weight, bias, target, label_smoothing, ignore_index,
                             class_weight=None):
    db = _empty(weight, weight.shape[0]) if bias is not None else _empty(weight, 0)
    return torch.empty_like(hidden), torch.empty_like(weight), db


@_fake
def embedding_fwd(input, weight, positional, positions, scale, dropout_p, philox):
    return _empty(weight, input.shape[0], weight.shape[1])


@_fake
def embedding_bwd(grad, input, positions, num_weights, num_positions, weight_grad, positional_grad, padding_idx,
                  scale, dropout_p, philox):
    D = grad.shape[1]
    return (_empty(grad, num_weights, D) if weight_grad else _empty(grad, 0),
            _empty(grad, num_positions, D) if positional_grad else _empty(grad, 0))


def defined(namespace: str, name: str) -> bool:
    """Whether ``namespace`` (loaded) defines the op ``name`` (``"<op>"`` or ``"<op>.<overload>"``)."""
    op, _, overload = name.partition(".")
    ops = getattr(torch.ops, namespace)
    return hasattr(ops, op) and (not overload or overload in getattr(ops, op).overloads())


def register(namespace: str) -> None:
    """Attach every fake to the op of the same name in ``namespace`` (its library must be loaded).
    An op the library does not define (a build older than this package) is left out: that op then
    has no kernel there, and the backends say so, instead of the whole library failing to load
    (tests/test_fake_ops.py checks that a fresh build defines every name here)."""
    for name, fn in FAKES.items():
        if defined(namespace, name):
            torch.library.register_fake(f"{namespace}::{name}", fn)
