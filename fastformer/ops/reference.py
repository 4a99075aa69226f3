"""The pure-PyTorch definitions of fastformer's ops: the test oracle and the last fallback.

Every kernel backend is checked against these functions. They are written out
explicitly (no ``F.scaled_dot_product_attention``, ``F.layer_norm`` or
``F.cross_entropy`` inside) so the tests can check them, in turn, against those
independent torch implementations.

Low-precision inputs keep statistics and softmax in fp32, as the kernels do.
Dropout uses the shared Philox mask (:mod:`fastformer.philox`): pass the
``rng=(seed, offset)`` a kernel used (two ints, or the kernel's ``(2,)`` philox tensor) and the
reference drops exactly the same elements; leave it ``None`` and a fresh pair is drawn from
torch's generator by ``torch.ops.fastformer.next_seed()``, as the kernels' Functions draw it.
The drawn pair stays a tensor (no ``.item()``), so ``torch.compile`` traces the reference with
dropout in one graph.
"""
import math
from typing import Tuple, Union

import torch

from .. import philox
from . import relative_position

_REDUCTIONS = ("none", "mean", "sum")


def _rng(dropout_p: float, rng: Union[None, Tuple[int, int], torch.Tensor], device: torch.device):
    """(seed, offset) for :func:`philox.dropout`: the given ints, or the two 0-d halves of a
    philox tensor (given, or drawn here when ``rng`` is None and ``dropout_p > 0``)."""
    if rng is None:
        rng = philox.draw(dropout_p, device)
    if isinstance(rng, torch.Tensor):
        return rng[0], rng[1]
    return rng


def attention(q, k, v, *, key_padding_mask=None, attn_mask=None, is_causal=False, scale=None,
              dropout_p=0.0, rng=None, relative_attention_bias=None, bidirectional=True,
              relative_attention_max_distance=128, query_offset=None):
    """``softmax(q k^T * scale + mask) v`` with q ``(B, H, Sq, D)``, k/v ``(B, H_kv, Sk, D)``.

    ``H_kv`` divides ``H`` (grouped-query attention): query head h reads k/v head
    ``h // (H // H_kv)``, as if k and v were repeated ``H // H_kv`` times along the heads.

    ``key_padding_mask`` ``(B, Sk)`` bool, True = padded key. ``attn_mask`` bool (True =
    masked out) or float (added; -inf hides the key exactly as True does), broadcastable to
    ``(B, H, Sq, Sk)``. ``is_causal``: query i sees key j iff ``j <= i + Sk - Sq``
    (bottom-right aligned). ``relative_attention_bias``: T5's ``(num_buckets, H)`` table, whose
    bucketed bias (query i at position ``i + query_offset``, default ``Sk - Sq``) is added to the
    scaled scores, built here as a dense ``(H, Sq, Sk)`` tensor (relative_position.dense_bias).
    Dropout acts on the probabilities. A query row with no visible key
    (by the masks) outputs 0 (whatever v holds) and gets zero gradient; a NaN or +inf score makes
    its row NaN. A non-finite value of v reaches every row that sees its key; at a key hidden from
    a row it meets a weight of exactly 0, and this definition then gives NaN (0 * NaN), which the
    kernels need not: see :func:`fastformer.ops.attention` for the contract.
    """
    B, H, Sq, D = q.shape
    Sk = k.shape[-2]
    k, v = _repeat_kv(k, v, H, 1)
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    stat_dtype = torch.promote_types(q.dtype, torch.float32)  # fp32 statistics, fp64 stays fp64
    s = torch.matmul(q, k.transpose(-2, -1)).to(stat_dtype) * scale  # (B, H, Sq, Sk)
    hidden = torch.zeros((1, 1, Sq, Sk), dtype=torch.bool, device=q.device)
    if is_causal:
        i = torch.arange(Sq, device=q.device)[:, None]
        j = torch.arange(Sk, device=q.device)[None, :]
        hidden = hidden | (j > i + (Sk - Sq))
    if key_padding_mask is not None:
        hidden = hidden | key_padding_mask.bool()[:, None, None, :]
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            hidden = hidden | attn_mask
        else:  # -inf hides a key exactly as True does in a bool mask (even where the score is NaN)
            minus_inf = attn_mask == float("-inf")
            hidden = hidden | minus_inf
            s = s + attn_mask.masked_fill(minus_inf, 0.0).to(stat_dtype)
    if relative_attention_bias is not None:
        offset = Sk - Sq if query_offset is None else query_offset
        s = s + relative_position.dense_bias(relative_attention_bias, Sq, Sk, offset, bidirectional,
                                             relative_attention_max_distance).to(stat_dtype)
    keep = None
    if dropout_p > 0.0:
        seed, offset = _rng(dropout_p, rng, q.device)
        keep = philox.attention_keep_mask(s.shape, dropout_p, seed, offset, device=s.device)
    return _masked_softmax_v(s, hidden, v, dropout_p, keep)


def _repeat_kv(k, v, H, dim):
    """k and v with each of their ``H_kv`` heads (dimension ``dim``) repeated ``H // H_kv`` times
    in a row, so head h holds k/v head ``h // (H // H_kv)``: grouped-query attention written as
    plain attention (differentiable: the repeats' gradients sum back)."""
    if k.shape[dim] == H:
        return k, v
    group = H // k.shape[dim]
    return k.repeat_interleave(group, dim=dim), v.repeat_interleave(group, dim=dim)


def _masked_softmax_v(s, hidden, v, dropout_p, keep):
    """``dropout(softmax(s with hidden keys at -inf)) v`` for scores ``s`` (..., Sq, Sk) and the
    bool ``hidden`` broadcast to them; ``keep`` the dropout's keep-mask of ``s``'s shape."""
    Sk = s.shape[-1]
    s = s.masked_fill(hidden, float("-inf"))
    # a row's visibility comes from the masks alone, never from the scores: a NaN score must give
    # a NaN row (as F.scaled_dot_product_attention does), not pass for "no visible key"
    visible = ~hidden
    row_visible = visible.any(dim=-1, keepdim=True).expand(*s.shape[:-1], 1)  # (..., Sq, 1)
    s = torch.where(row_visible, s, torch.zeros_like(s))
    if Sk > 0:  # no key at all: every row sees nothing, and amax has nothing to reduce
        s = s - s.amax(dim=-1, keepdim=True)
    e = torch.exp(s)
    p = e / e.sum(dim=-1, keepdim=True) * row_visible
    if keep is not None:
        p = p * keep.to(p.dtype) * philox.attention_keep_scale(dropout_p)  # 1 / the realised keep rate
    # a row with no visible key is 0 even where v holds NaN or inf (its weights are all 0)
    return torch.where(row_visible, torch.matmul(p.to(v.dtype), v), 0.0)


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, is_causal=False,
                     scale=None, dropout_p=0.0, rng=None, relative_attention_bias=None, bidirectional=True,
                     relative_attention_max_distance=128):
    """Attention within each sequence of packed rows (FlashAttention's varlen layout).

    q ``(total_q, H, D)``, k/v ``(total_k, H_kv, D)`` (``H_kv`` divides ``H``: query head h reads
    k/v head ``h // (H // H_kv)``, as :func:`attention`); sequence b owns query rows
    ``cu_seqlens_q[b] : cu_seqlens_q[b + 1]`` and key rows ``cu_seqlens_k[b] : cu_seqlens_k[b + 1]``
    (int32 ``(B + 1,)``). ``is_causal``: its query i sees its key j iff ``j <= i + Lk - Lq``.
    Dropout drops exactly what :func:`attention` drops on the same sequences right-padded to
    ``(B, H, max_seqlen_q, max_seqlen_k)``: sequence b's rows take the padded op's counters.
    ``relative_attention_bias``: as :func:`attention`'s, per sequence, its query i at position
    ``i + Lk - Lq``.
    """
    total_q, H, D = q.shape
    k, v = _repeat_kv(k, v, H, 1)
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    stat_dtype = torch.promote_types(q.dtype, torch.float32)
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    per_seq = philox.attention_counters_used((H, max_seqlen_q, max_seqlen_k))  # a padded sequence's counters
    if dropout_p > 0.0:
        seed, offset = _rng(dropout_p, rng, q.device)
    pieces = []  # each sequence's (Lq, H, D) rows, in order: together the (total_q, H, D) output
    for b in range(len(cq) - 1):
        Lq, Lk = cq[b + 1] - cq[b], ck[b + 1] - ck[b]
        if Lq == 0:
            continue
        qb, kb, vb = (t[c[b]:c[b + 1]].transpose(0, 1) for t, c in ((q, cq), (k, ck), (v, ck)))  # (H, L, D)
        s = torch.matmul(qb, kb.transpose(-2, -1)).to(stat_dtype) * scale  # (H, Lq, Lk)
        hidden = torch.zeros((1, Lq, Lk), dtype=torch.bool, device=q.device)
        if is_causal:
            i = torch.arange(Lq, device=q.device)[:, None]
            j = torch.arange(Lk, device=q.device)[None, :]
            hidden = hidden | (j > i + (Lk - Lq))
        if relative_attention_bias is not None:
            s = s + relative_position.dense_bias(relative_attention_bias, Lq, Lk, Lk - Lq, bidirectional,
                                                 relative_attention_max_distance).to(stat_dtype)
        keep = None
        if dropout_p > 0.0:  # the padded op's rows (b, h, i < Lq) of (B, H, max_seqlen_q, max_seqlen_k)
            keep = philox.attention_keep_mask((H, max_seqlen_q, max_seqlen_k), dropout_p, seed,
                                              offset + b * per_seq, device=q.device)[:, :Lq, :Lk]
        pieces.append(_masked_softmax_v(s, hidden, vb, dropout_p, keep).transpose(0, 1))
    if not pieces:  # no query row at all: an empty output that is still part of the graph
        return q.new_zeros(q.shape[:2] + v.shape[2:]) + 0.0 * (q.sum() + k.sum() + v.sum())
    return torch.cat(pieces)


def add_layer_norm(x, residual, weight, bias, eps=1e-5, dropout_p=0.0, *, prenorm=False, rng=None,
                   x_bias=None, rms_norm=False):
    """Post-LN ``LayerNorm(residual + dropout(x + x_bias))`` over the last dimension.

    ``residual`` may be None (then ``h = dropout(x)``); ``weight``/``bias`` may be None
    (no affine); ``x_bias`` (the bias of the linear layer that produced x) may be None.
    With ``prenorm=True`` returns ``(LayerNorm(h), h)`` with ``h = residual + dropout(x)``,
    so a pre-LN block can reuse ``h`` as its next residual.

    ``rms_norm=True``: RMSNorm instead (T5LayerNorm, LlamaRMSNorm): no mean, ``rstd = 1 /
    sqrt(mean(h^2) + eps)`` in fp32 (fp64 for fp64), ``xhat = h * rstd`` rounded to x's dtype (T5's
    cast before the weight multiply; a no-op in fp32 / fp64), then ``weight * xhat (+ bias)`` rounded
    once. A bias is allowed (added after the weight multiply, as FlashAttention's RMSNorm does).
    """
    h = x if x_bias is None else x + x_bias
    if dropout_p > 0.0:
        seed, offset = _rng(dropout_p, rng, x.device)
        h = philox.dropout(h, dropout_p, seed, offset)
    if residual is not None:
        h = h + residual
    hf = h.to(torch.promote_types(h.dtype, torch.float32))
    if rms_norm:
        y = hf * torch.rsqrt(hf.pow(2).mean(dim=-1, keepdim=True) + eps)
        y = y.to(x.dtype).to(hf.dtype)  # T5's cast of the normalised value (identity for autograd)
    else:
        mean = hf.mean(dim=-1, keepdim=True)
        var = ((hf - mean) ** 2).mean(dim=-1, keepdim=True)
        y = (hf - mean) * torch.rsqrt(var + eps)
    if weight is not None:
        y = y * weight.to(hf.dtype)
    if bias is not None:
        y = y + bias.to(hf.dtype)
    y = y.to(x.dtype)
    return (y, h) if prenorm else y


def _activation(pre: torch.Tensor, activation: str) -> torch.Tensor:
    pf = pre.to(torch.promote_types(pre.dtype, torch.float32))
    if activation == "relu":
        a = torch.relu(pf)
    elif activation == "gelu":
        a = 0.5 * pf * (1.0 + torch.erf(pf * (1.0 / math.sqrt(2.0))))
    elif activation == "silu":  # x sigmoid(x), as F.silu (transformers' "swish" / "silu")
        a = pf * torch.sigmoid(pf)
    elif activation == "gelu_tanh":  # F.gelu(approximate="tanh"); transformers' "gelu_new" / "gelu_pytorch_tanh"
        a = 0.5 * pf * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (pf + 0.044715 * pf * pf * pf)))
    else:
        raise ValueError(f"activation must be 'relu', 'gelu', 'silu' or 'gelu_tanh', got {activation!r}")
    return a.to(pre.dtype)


def _gated(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    """act(gate) * up, computed in fp32 (fp64 for fp64) and rounded once, as _activation."""
    uf = up.to(torch.promote_types(up.dtype, torch.float32))
    gf = gate.to(uf.dtype)
    return (_activation(gf, activation) * uf).to(up.dtype)


def feed_forward(x, w1, b1, w2, b2, *, activation="relu", dropout_p=0.0, rng=None, w3=None, b3=None):
    """``linear(dropout(act(linear(x, w1, b1))), w2, b2)``, weights in ``nn.Linear`` layout.

    Gated (``w3`` (F, E) given, ``b3`` (F,) or None): ``linear(dropout(act(linear(x, w1, b1)) *
    linear(x, w3, b3)), w2, b2)`` (GeGLU / ReGLU / SwiGLU; T5's ``T5DenseGatedActDense`` with w1 =
    wi_0, w3 = wi_1, w2 = wo). The product is computed in fp32 and rounded once. Dropout views the
    (..., F) hidden tensor as rows of F, as the plain form."""
    pre = torch.matmul(x, w1.t())  # (..., F)
    if b1 is not None:
        pre = pre + b1
    if w3 is None:
        if b3 is not None:
            raise ValueError("b3 was given without w3 (b3 is the gated form's up-projection bias)")
        a = _activation(pre, activation)
    else:
        up = torch.matmul(x, w3.t())  # (..., F)
        if b3 is not None:
            up = up + b3
        a = _gated(pre, up, activation)
    if dropout_p > 0.0:
        seed, offset = _rng(dropout_p, rng, x.device)
        a = philox.dropout(a, dropout_p, seed, offset)
    out = torch.matmul(a, w2.t())  # (..., E)
    if b2 is not None:
        out = out + b2
    return out


def _cross_entropy_rows(logits2d, target1d, label_smoothing, ignore_index, weight=None):
    """Per-row smoothed loss (fp32, 0 for ignored rows), the valid-row mask and the rows' share of
    the mean's divisor (``weight[target]``, or 1, for valid rows; 0 for ignored ones).

    With class weights ``w`` (torch's definition): ``(1 - eps) * w[t] * nll + (eps / C) *
    sum_c w_c * (-log p_c)``."""
    lf = logits2d.to(torch.promote_types(logits2d.dtype, torch.float32))
    m = lf.amax(dim=-1, keepdim=True)
    lse = m + torch.log(torch.exp(lf - m).sum(dim=-1, keepdim=True))
    logp = lf - lse  # (N, V)
    valid = target1d != ignore_index
    safe_target = torch.where(valid, target1d, torch.zeros_like(target1d))
    nll = -logp.gather(1, safe_target[:, None]).squeeze(1)
    if weight is None:
        w_t = valid.to(lf.dtype)
        loss = nll
        if label_smoothing > 0.0:
            loss = (1.0 - label_smoothing) * nll + label_smoothing * (-logp.mean(dim=-1))
    else:
        w = weight.to(lf.dtype)
        w_t = torch.where(valid, w[safe_target], torch.zeros((), dtype=lf.dtype, device=lf.device))
        loss = w_t * nll
        if label_smoothing > 0.0:
            smooth = -(logp * w).sum(dim=-1) / logp.shape[-1]
            loss = (1.0 - label_smoothing) * loss + label_smoothing * smooth
    return torch.where(valid, loss, torch.zeros_like(loss)), valid, w_t


def _soft_cross_entropy_rows(logits2d, probs2d, label_smoothing, weight=None):
    """Per-row loss (fp32) for class probabilities ``probs2d`` (N, C) (torch's "soft" targets):
    ``-sum_c w_c q_c log p_c`` with ``q = (1 - eps) probs + eps / C`` (``w = 1`` without weights).
    Every row counts 1 in the mean (torch divides by the row count, weights or not)."""
    lf = logits2d.to(torch.promote_types(logits2d.dtype, torch.float32))
    m = lf.amax(dim=-1, keepdim=True)
    logp = lf - (m + torch.log(torch.exp(lf - m).sum(dim=-1, keepdim=True)))
    q = probs2d.to(lf.dtype)
    if label_smoothing > 0.0:
        q = (1.0 - label_smoothing) * q + label_smoothing / lf.shape[-1]
    if weight is not None:
        q = q * weight.to(lf.dtype)
    return -(q * logp).sum(dim=-1), torch.ones(lf.shape[0], dtype=lf.dtype, device=lf.device)


def _reduce(loss_rows, w_t, reduction, shape, dtype):
    if reduction == "none":
        return loss_rows.reshape(shape).to(dtype)
    if reduction == "sum":
        return loss_rows.sum().to(dtype)
    # mean: over the valid rows' weights (their count without class weights); a zero divisor is
    # NaN, as torch (0 / 0 without weights)
    total = w_t.sum()
    return torch.where(total != 0, loss_rows.sum() / total, torch.full_like(total, math.nan)).to(dtype)


def _class_last(logits, target):
    """F.cross_entropy layouts -> (M, C) logits and (M,) targets, plus the per-element shape."""
    if logits.dim() == 1:
        return logits[None, :], target.reshape(1), target.shape
    if logits.dim() > 2:
        C = logits.shape[1]
        return logits.movedim(1, -1).reshape(-1, C), target.reshape(-1), target.shape
    return logits, target, target.shape


def _soft_class_last(logits, probs):
    """F.cross_entropy layouts with class probabilities of the logits' shape -> (M, C) logits and
    (M, C) probabilities, plus the per-element shape."""
    C = logits.shape[1] if logits.dim() > 1 else logits.shape[0]
    logits2d, probs2d = ((t.movedim(1, -1).reshape(-1, C) if t.dim() > 1 else t[None]) for t in (logits, probs))
    return logits2d, probs2d, (probs.shape[0],) + tuple(probs.shape[2:]) if probs.dim() > 1 else ()


def cross_entropy(logits, target, *, weight=None, label_smoothing=0.0, ignore_index=-100, reduction="mean"):
    """``F.cross_entropy(logits, target, weight=weight, ...)`` semantics: class dim 1, class weights
    ``weight`` (C,) or None, smoothing, ignore_index; ``mean`` divides by the valid rows' sum of
    ``weight[target]``. A floating ``target`` of the logits' shape holds class probabilities (torch's
    soft targets: no ignore_index, ``mean`` divides by the row count)."""
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    if target.is_floating_point():  # (N, C, d...) probabilities as the logits -> (M, C) rows
        logits2d, probs2d, shape = _soft_class_last(logits, target)
        rows, w_t = _soft_cross_entropy_rows(logits2d, probs2d, label_smoothing, weight)
        return _reduce(rows, w_t, reduction, shape, logits.dtype)
    logits2d, target1d, shape = _class_last(logits, target)
    rows, valid, w_t = _cross_entropy_rows(logits2d, target1d, label_smoothing, ignore_index, weight)
    return _reduce(rows, w_t, reduction, shape, logits.dtype)


def linear_cross_entropy(input, linear_weight, target, *, linear_bias=None, weight=None, reduction="mean",
                         ignore_index=-100, label_smoothing=0.0):
    """``cross_entropy(linear(input, linear_weight, linear_bias), target, weight=weight)`` with input
    ``(..., D)`` (the arguments of torch's ``F.linear_cross_entropy``)."""
    logits = torch.matmul(input, linear_weight.t())
    if linear_bias is not None:
        logits = logits + linear_bias
    logits2d = logits.reshape(-1, linear_weight.shape[0])
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    if target.is_floating_point():  # class probabilities (..., V)
        rows, w_t = _soft_cross_entropy_rows(logits2d, target.reshape(logits2d.shape), label_smoothing, weight)
        return _reduce(rows, w_t, reduction, target.shape[:-1], input.dtype)
    rows, valid, w_t = _cross_entropy_rows(logits2d, target.reshape(-1), label_smoothing, ignore_index, weight)
    return _reduce(rows, w_t, reduction, target.shape, input.dtype)


def embedding(input, weight, *, scale=1.0, positional=None, positions=None, dropout_p=0.0, padding_idx=None,
              rng=None):
    """``dropout(weight[input] * scale + positional[positions])`` -> ``input.shape + (D,)``.

    ``input`` integer ids of any shape ``(..., S)`` into ``weight`` ``(V, D)``; ``positional`` an
    optional ``(P, D)`` table and ``positions`` its integer rows, of ``input``'s shape (default
    ``arange(S)`` along the last dimension). ``padding_idx`` as ``F.embedding``'s: that row of
    ``weight`` gets no gradient (the positional table still does). Computed in fp32 (fp64 for fp64)
    and rounded once to ``weight``'s dtype. Dropout views the output as rows of D columns, one row
    per id in row-major order (:mod:`fastformer.philox`).
    """
    acc = torch.promote_types(weight.dtype, torch.float32)
    if padding_idx is not None:
        if padding_idx < 0:
            padding_idx += weight.shape[0]
        # F.embedding's rule: the padding row's lookups carry no gradient into it
        w = weight.to(acc)
        not_pad = (torch.arange(weight.shape[0], device=weight.device) != padding_idx)[:, None]
        w = torch.where(not_pad, w, w.detach())
    else:
        w = weight.to(acc)
    x = w[input] * scale
    if positional is not None:
        if positions is None:  # arange(S) along the last dimension (a 0-d id is position 0)
            positions = (torch.arange(input.shape[-1], device=input.device).expand(input.shape) if input.dim()
                         else torch.zeros((), dtype=torch.int64, device=input.device))
        x = x + positional.to(acc)[positions]
    if dropout_p > 0.0:
        seed, offset = _rng(dropout_p, rng, x.device)
        x = philox.dropout(x, dropout_p, seed, offset)
    return x.to(weight.dtype)
