"""Fake (meta) implementations of the C++ ops, so torch.compile traces them without a graph
break. Each returns empty tensors of the shapes and dtypes the real kernel returns."""
import torch

_lib = "fastformer::"


def _empty(t, *shape, dtype=None):
    return t.new_empty(shape, dtype=dtype or t.dtype)


@torch.library.register_fake(_lib + "philox_bits")
def _philox_bits(n, seed, offset):
    return torch.empty(n, dtype=torch.int64)


@torch.library.register_fake(_lib + "attention_fwd")
def _attention_fwd(q, k, v, key_padding_mask, attn_mask, is_causal, scale, dropout_p, philox):
    B, H, Sq, D = q.shape
    return _empty(q, B, H, Sq, D), _empty(q, B, H, Sq, dtype=torch.float32)


@torch.library.register_fake(_lib + "attention_bwd")
def _attention_bwd(dout, q, k, v, out, lse, key_padding_mask, attn_mask, is_causal, scale, dropout_p,
                   philox):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


@torch.library.register_fake(_lib + "add_layer_norm_fwd")
def _add_layer_norm_fwd(x, residual, weight, bias, eps, dropout_p, philox):
    N = x.shape[0]
    return (torch.empty_like(x), torch.empty_like(x), _empty(x, N, dtype=torch.float32),
            _empty(x, N, dtype=torch.float32))


@torch.library.register_fake(_lib + "add_layer_norm_bwd")
def _add_layer_norm_bwd(dy, dh, h, weight, mean, rstd, dropout_p, philox, has_residual):
    dres = torch.empty_like(h) if (has_residual and dropout_p > 0.0) else _empty(h, 0)
    return torch.empty_like(h), dres, torch.empty_like(weight), torch.empty_like(weight)


@torch.library.register_fake(_lib + "feed_forward_fwd")
def _feed_forward_fwd(x, w1, b1, w2, b2, activation, dropout_p, philox):
    return _empty(x, x.shape[0], w2.shape[0]), _empty(x, x.shape[0], w1.shape[0])


@torch.library.register_fake(_lib + "feed_forward_bwd")
def _feed_forward_bwd(dout, x, w1, w2, pre, has_b1, has_b2, activation, dropout_p, philox):
    db1 = _empty(w1, w1.shape[0]) if has_b1 else _empty(w1, 0)
    db2 = _empty(w2, w2.shape[0]) if has_b2 else _empty(w2, 0)
    return torch.empty_like(x), torch.empty_like(w1), db1, torch.empty_like(w2), db2


@torch.library.register_fake(_lib + "cross_entropy_fwd")
def _cross_entropy_fwd(logits, target, label_smoothing, ignore_index, reduction, compute_grad):
    loss = _empty(logits, logits.shape[0]) if reduction == 0 else _empty(logits)
    grad = torch.empty_like(logits) if compute_grad else _empty(logits, 0)
    return loss, grad


@torch.library.register_fake(_lib + "linear_cross_entropy_fwd")
def _linear_cross_entropy_fwd(hidden, weight, bias, target, label_smoothing, ignore_index, reduction,
                              compute_grad):
    loss = _empty(hidden, hidden.shape[0]) if reduction == 0 else _empty(hidden)
    if not compute_grad:
        return loss, _empty(hidden, 0), _empty(weight, 0), _empty(weight, 0)
    db = _empty(weight, weight.shape[0]) if bias is not None else _empty(weight, 0)
    return loss, torch.empty_like(hidden), torch.empty_like(weight), db


@torch.library.register_fake(_lib + "linear_cross_entropy_bwd")
def _linear_cross_entropy_bwd(grad_loss, hidden, weight, bias, target, label_smoothing, ignore_index):
    db = _empty(weight, weight.shape[0]) if bias is not None else _empty(weight, 0)
    return torch.empty_like(hidden), torch.empty_like(weight), db
