"""The tile helpers every flash-attention kernel shares: the forward (attention.py) and the two
backward kernels (attention_backward.py) load and store head rows, apply the masks (key padding,
bottom-right causal, additive) to a score tile, regenerate the dropout keep-mask, bound the causal
key range and set up a program's sequence and head pointers through these, so the three kernels
see one definition of the masks and the dropout stream, for the padded (B, H, S, D) layout and
the packed varlen one alike. Scores live in log2 units (``s * log2(e)``).

A relative position bias by distance (``HAS_REL``, csrc/schemas.h's ``rel_bias``: ``(H, 2R + 1)``
fp32) is added in masked_scores: query i (at position ``i + pos0``, ``pos0 = Lk - Lq + rel_shift``)
and key j read ``rel_bias[h, clamp(j - i - pos0, -R, R) + R]`` from the head's row (rel_row), a
gather from a small vector that stays in cache; no (Sq, Sk) bias exists.
"""
import triton
import triton.language as tl

from .utils import INTERPRET

LOG2E = tl.constexpr(1.4426950408889634)  # log2(e)
LN2 = tl.constexpr(0.6931471805599453)  # ln(2)
FLT_MAX = tl.constexpr(3.4028234663852886e38)
# Additive-mask values below this are finite but would overflow to -inf once turned into log2
# units; they are clamped to -FLT_MAX (still finite, so the key stays "visible" as in the reference).
MASK_FLOOR = tl.constexpr(-3.4028234663852886e38 / 1.4426950408889634)
# The interpreter's tl.dot multiplies bf16 storage as integers: widen bf16 operands there.
_WIDEN_DOT = tl.constexpr(INTERPRET)  # see dot and cast


@triton.jit
def dot(a, b, acc, INPUT_PRECISION: tl.constexpr):
    """``acc + a @ b`` with fp32 accumulation. fp32 operands are multiplied with
    ``INPUT_PRECISION``: "ieee" (full fp32, torch's default matmul) or "tf32" (tensor cores, when
    torch allows tf32 matmuls: triton_kernels.matmul.input_precision); fp16 / bf16 go to the
    tensor cores."""
    if _WIDEN_DOT:
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    elif a.dtype == tl.float32:
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def cast(x, dtype: tl.constexpr):
    """``x.to(dtype)`` rounding to nearest even, as the GPU converts fp32 -> bf16. The interpreter
    truncates instead (a whole bf16 ulp, always towards zero: P just below 1 became 0.996 and
    dV, a sum of such P, drifted), so there the rounding is done on the fp32 bits first."""
    if _WIDEN_DOT:
        if dtype == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = bits + 0x7FFF + ((bits >> 16) & 1)
            x = ((bits >> 16) << 16).to(tl.float32, bitcast=True)
    return x.to(dtype)


@triton.jit
def load_rows(base, rows, stride_row, offs_d, n_rows, D, EVEN_D: tl.constexpr, LARGE_OFFSETS: tl.constexpr):
    """Rows ``rows`` (R,) of a (n_rows, D) matrix -> (R, BLOCK_D) tile, zero outside. Row
    offsets in int64 with LARGE_OFFSETS (``n_rows * stride_row`` passes 2**31 within one head;
    int32 otherwise: int64 offsets cost the heavy configs registers, up to spilling)."""
    if LARGE_OFFSETS:
        rows = rows.to(tl.int64)
    ptrs = base + rows[:, None] * stride_row + offs_d[None, :]
    if EVEN_D:
        tile = tl.load(ptrs, mask=rows[:, None] < n_rows, other=0.0)
    else:
        tile = tl.load(ptrs, mask=(rows[:, None] < n_rows) & (offs_d[None, :] < D), other=0.0)
    return tile


@triton.jit
def store_rows(base, tile, rows, stride_row, offs_d, n_rows, D, EVEN_D: tl.constexpr,
                LARGE_OFFSETS: tl.constexpr):
    """Store a (R, BLOCK_D) tile into rows ``rows`` of a (n_rows, D) matrix (int64 row offsets
    with LARGE_OFFSETS, as load_rows)."""
    if LARGE_OFFSETS:
        rows = rows.to(tl.int64)
    ptrs = base + rows[:, None] * stride_row + offs_d[None, :]
    if EVEN_D:
        tl.store(ptrs, tile, mask=rows[:, None] < n_rows)
    else:
        tl.store(ptrs, tile, mask=(rows[:, None] < n_rows) & (offs_d[None, :] < D))


@triton.jit
def masked_scores(qk,  # fp32 tile of q.k dot products, (BM, BN) or transposed (BN, BM)
                   qi,  # query indices, broadcastable to qk's shape
                   kj,  # key indices, broadcastable to qk's shape
                   kpm_base,  # key padding mask row of this batch (u8, 1 = padded)
                   stride_kpm_n,  # its key stride
                   am_base,  # additive mask of this (b, h), fp32
                   stride_am_m,  # its query stride (0 when broadcast)
                   stride_am_n,  # its key stride (0 when broadcast)
                   Sq,  # number of queries
                   Sk,  # number of keys
                   qk_scale,  # scale * log2(e)
                   rel_base,  # rel_bias row of this head (fp32, 2R + 1 values; see rel_row)
                   R,  # the bias's largest distance
                   pos0,  # query i's position is i + pos0 (Lk - Lq + rel_shift)
                   MASK_EDGE: tl.constexpr,  # apply the causal and key-bound masks (edge tiles)
                   HAS_KPM: tl.constexpr,  # apply the key padding mask
                   HAS_MASK: tl.constexpr,  # add the additive mask
                   IS_CAUSAL: tl.constexpr,  # bottom-right causal masking
                   HAS_REL: tl.constexpr,  # add the relative position bias
                   LARGE_OFFSETS: tl.constexpr):  # int64 mask offsets (the mask passes 2**31)
    """Scores in log2 units with the bias added and every mask applied: -inf where key ``kj`` is
    hidden from ``qi``."""
    s = qk * qk_scale
    if HAS_REL:  # the clamp keeps every index in [0, 2R], also for rows and columns past Sq / Sk
        rel = tl.minimum(tl.maximum(kj - qi - pos0, -R), R) + R
        s = s + tl.load(rel_base + rel) * LOG2E
    if HAS_MASK:
        # -inf hides the key whatever its score (also a NaN score: NaN + -inf would stay NaN); tile
        # rows and columns past Sq / Sk read -inf, so a NaN key never leaks into a padding row's P
        if LARGE_OFFSETS:  # the (Sq, Sk) mask of one head spans more than 2**31 elements
            am_ptrs = am_base + qi.to(tl.int64) * stride_am_m + kj.to(tl.int64) * stride_am_n
        else:
            am_ptrs = am_base + qi * stride_am_m + kj * stride_am_n
        am = tl.load(am_ptrs, mask=(qi < Sq) & (kj < Sk), other=float("-inf"))
        s = tl.where(am == float("-inf"), float("-inf"), s + tl.maximum(am, MASK_FLOOR) * LOG2E)
    if MASK_EDGE:
        visible = kj < Sk
        if IS_CAUSAL:
            visible = visible & (kj <= qi + (Sk - Sq))
        s = tl.where(visible, s, float("-inf"))
    if HAS_KPM:
        kpm_off = kj.to(tl.int64) * stride_kpm_n if LARGE_OFFSETS else kj * stride_kpm_n
        padded = tl.load(kpm_base + kpm_off, mask=kj < Sk, other=1)
        s = tl.where(padded == 0, s, float("-inf"))
    return s


@triton.jit
def dropout_rng_base(rng_offset, b64, H, h, Sq, Sk):
    """Philox counter of head (b, h)'s first dropout tile: the probabilities are cut into 16 x 32
    tiles, ``ceil(Sq / 16) * ceil(Sk / 32)`` of them a head, 32 counters a tile (fastformer/philox.py,
    attention's dropout (v3)). Packed sequences (VARLEN) take the padded op's counters: ``Sq``,
    ``Sk`` the longest lengths."""
    return rng_offset + (b64 * H + h) * (tl.cdiv(Sq, 16).to(tl.int64) * tl.cdiv(Sk, 32) * 32)


@triton.jit
def _keep_bytes(w, threshold):
    """The four keep decisions of one Philox word, (..., 2, 2): [hi, e] is byte 2 * hi + e."""
    k0 = (w & 0xFF).to(tl.int32) >= threshold
    k1 = ((w >> 8) & 0xFF).to(tl.int32) >= threshold
    k2 = ((w >> 16) & 0xFF).to(tl.int32) >= threshold
    k3 = (w >> 24).to(tl.int32) >= threshold
    return tl.join(tl.join(k0, k2), tl.join(k1, k3))  # join appends an axis: [i, j] = k_{2i + j}


@triton.jit
def _word_bytes(w):
    """(..., 2, 2): the word ``w`` at the places [hi, e] of its four bytes 2 * hi + e (one register
    referenced four times), and those bytes' shifts 8 * (2 * hi + e) (constants)."""
    z = tl.zeros_like(w)
    # join appends an axis: join(join(a, b), join(c, d))[i, j] is a, b, c, d at [0, 0], [1, 0], [0, 1], [1, 1]
    return tl.join(tl.join(w, w), tl.join(w, w)), tl.join(tl.join(z, z + 16), tl.join(z + 8, z + 24))


@triton.jit
def keep_tile(seed, rng_base, start_m, start_n, Sk, threshold, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              KEYS_FIRST: tl.constexpr, LATE: tl.constexpr):
    """Keep-mask of queries ``start_m + arange(BLOCK_M)`` and keys ``start_n + arange(BLOCK_N)``:
    (BLOCK_M, BLOCK_N), or its transpose (BLOCK_N, BLOCK_M) with KEYS_FIRST (dK/dV's tiles).
    ``start_m`` and ``start_n`` are multiples of the blocks, themselves multiples of 16 (BLOCK_N 16:
    half a 32-key tile, whose other half's words go unused); ``rng_base`` from :func:`dropout_rng_base`
    and ``Sk`` the dropout rows' width, as there. Rows and columns past the sequence get bits of
    other counters: callers mask them.

    One Philox call per lane (a, q) = (r % 8, (c % 8) // 2) of each 16 x 32 tile, on counters of
    shape (key tiles, query tiles, 8, 4); each element's word (and its byte's shift) is joined into
    trailing (hi, e, t) axes (r = 8 hi + a, c = 8 t + 2 q + e) and permuted into place, which only
    relabels registers where the scores have the m16n8 accumulator layout; with LATE (tensor-core
    dots) the bytes are compared there, so 4 registers a call stay live instead of 16 decisions;
    without (fp32 FMA dots: no such layout to match, and moving words spilled) the decisions are
    made first and moved (DROPOUT.md)."""
    tl.static_assert(BLOCK_M % 16 == 0, "keep_tile: BLOCK_M must be a multiple of 16")
    tl.static_assert(BLOCK_N % 16 == 0, "keep_tile: BLOCK_N must be a multiple of 16")
    QT: tl.constexpr = BLOCK_M // 16  # 16-query tiles
    KT: tl.constexpr = BLOCK_N // 32 if BLOCK_N >= 32 else 1  # 32-key tiles (BLOCK_N 16: half of one)
    # (KT, QT, 8, 4): Triton's default layout of this shape puts lane 4a + q on (a, q), as the
    # m16n8 accumulator does, and the warps on the query tiles first, then the key tiles
    tiles = ((start_n // 32 + tl.arange(0, KT))[:, None]
             + (start_m // 16 + tl.arange(0, QT)).to(tl.int64)[None, :] * tl.cdiv(Sk, 32))  # (KT, QT)
    lanes = 4 * tl.arange(0, 8)[:, None] + tl.arange(0, 4)[None, :]  # (8, 4): lane 4a + q
    ctr = (rng_base + tiles * 32)[:, :, None, None] + lanes[None, None, :, :]
    w0, w1, w2, w3 = tl.randint4x(seed, ctr)
    if BLOCK_N < 32:
        upper = (start_n % 32) != 0  # keys 16 .. 31 of the tile: words 2 and 3
        w0 = tl.where(upper, w2, w0)
        w1 = tl.where(upper, w3, w1)
    if not LATE:
        if BLOCK_N >= 32:
            keep = tl.join(tl.join(_keep_bytes(w0, threshold), _keep_bytes(w2, threshold)),
                           tl.join(_keep_bytes(w1, threshold), _keep_bytes(w3, threshold)))
            keep = tl.reshape(keep, (KT, QT, 8, 4, 2, 2, 4))  # (kt, qt, a, q, hi, e, t)
        else:
            keep = tl.join(_keep_bytes(w0, threshold), _keep_bytes(w1, threshold))
        if KEYS_FIRST:
            keep = tl.reshape(tl.permute(keep, (0, 6, 3, 5, 1, 4, 2)), (BLOCK_N, BLOCK_M))
        else:
            keep = tl.reshape(tl.permute(keep, (1, 4, 2, 0, 6, 3, 5)), (BLOCK_M, BLOCK_N))
        return keep
    b0, sh = _word_bytes(w0)
    b1, _ = _word_bytes(w1)
    if BLOCK_N >= 32:
        # word t holds keys 8t .. 8t + 7 of the tile: [.., hi, e, t1, t0] with t = 2 t1 + t0
        b2, _ = _word_bytes(w2)
        b3, _ = _word_bytes(w3)
        words = tl.reshape(tl.join(tl.join(b0, b2), tl.join(b1, b3)), (KT, QT, 8, 4, 2, 2, 4))
        shifts = tl.reshape(tl.join(tl.join(sh, sh), tl.join(sh, sh)), (KT, QT, 8, 4, 2, 2, 4))
    else:
        words = tl.join(b0, b1)  # (kt, qt, a, q, hi, e, t % 2)
        shifts = tl.join(sh, sh)
    if KEYS_FIRST:
        words = tl.reshape(tl.permute(words, (0, 6, 3, 5, 1, 4, 2)), (BLOCK_N, BLOCK_M))  # (kt, t, q, e, qt, hi, a)
        shifts = tl.reshape(tl.permute(shifts, (0, 6, 3, 5, 1, 4, 2)), (BLOCK_N, BLOCK_M))
    else:
        words = tl.reshape(tl.permute(words, (1, 4, 2, 0, 6, 3, 5)), (BLOCK_M, BLOCK_N))  # (qt, hi, a, kt, t, q, e)
        shifts = tl.reshape(tl.permute(shifts, (1, 4, 2, 0, 6, 3, 5)), (BLOCK_M, BLOCK_N))
    return ((words >> shifts) & 0xFF).to(tl.int32) >= threshold


@triton.jit
def causal_key_bounds(start_m, Sq, Sk, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       IS_CAUSAL: tl.constexpr):
    """For the query tile starting at ``start_m``: (full_hi, hi) such that key tiles in
    [0, full_hi) are entirely visible to every query of the tile (no causal or bound mask)
    and keys >= hi are hidden from all of them (whole tiles skipped)."""
    if IS_CAUSAL:
        hi = tl.minimum(Sk, start_m + BLOCK_M + Sk - Sq)
        full_hi = tl.maximum(tl.minimum(start_m + Sk - Sq + 1, Sk), 0) // BLOCK_N * BLOCK_N
    else:
        hi = Sk
        full_hi = Sk // BLOCK_N * BLOCK_N
    return full_hi, hi


@triton.jit
def program_ids(n_rows, H, BLOCK: tl.constexpr, REVERSE: tl.constexpr):
    """(start, h, b64, h64) of this program on the one-axis grid of ``cdiv(n_rows, BLOCK) * H * B``
    programs (attention.attention_grid): the first row of its tile and its head and batch entry
    (int64 copies for pointer offsets). Program ``pid = (b * H + h) * tiles + tile``: a head's tiles
    are neighbours (they run together and share its k / v in L2, as the (tiles, H, B) grid ran
    them), and the batch is bounded by axis 0's 2**31 - 1 programs, not by axis 2's 65,535 (a
    packed batch of more sequences). REVERSE takes each head's tiles last first: under causal
    masking the last query tiles see the most keys, heaviest first."""
    tiles = tl.cdiv(n_rows, BLOCK)
    pid = tl.program_id(0)
    bh = pid // tiles
    tile = pid - bh * tiles
    if REVERSE:
        tile = tiles - 1 - tile
    b = bh // H
    h = bh - b * H
    return tile * BLOCK, h, b.to(tl.int64), h.to(tl.int64)


@triton.jit
def sequence(CuSeqlensQ, CuSeqlensK, b64, Sq, Sk, total_q, total_k, VARLEN: tl.constexpr):
    """(q0, k0, Lq, Lk) of batch entry b: its first query and key row and its numbers of queries
    and keys. Padded layout: 0, 0, Sq, Sk (the batch strides address b). VARLEN: from the int32
    cumulative lengths, clamped (the host reads none of them: that would synchronise) so that
    every row lies in [0, total) and no length passes its maximum Sq / Sk (the grid's and the
    dropout rows' bound); q0, k0 in int64."""
    if VARLEN:
        q0 = tl.minimum(tl.maximum(tl.load(CuSeqlensQ + b64), 0), total_q)
        q1 = tl.minimum(tl.maximum(tl.load(CuSeqlensQ + b64 + 1), q0), total_q)
        k0 = tl.minimum(tl.maximum(tl.load(CuSeqlensK + b64), 0), total_k)
        k1 = tl.minimum(tl.maximum(tl.load(CuSeqlensK + b64 + 1), k0), total_k)
        return q0.to(tl.int64), k0.to(tl.int64), tl.minimum(q1 - q0, Sq), tl.minimum(k1 - k0, Sk)
    else:
        return 0, 0, Sq, Sk


@triton.jit
def program_sequence(CuSeqlensQ, CuSeqlensK, H, Sq, Sk, total_q, total_k, BLOCK: tl.constexpr,
                     KEY_TILES: tl.constexpr, REVERSE: tl.constexpr, VARLEN: tl.constexpr):
    """:func:`program_ids` (tiles of ``BLOCK`` keys with KEY_TILES, as dK/dV's grid, else of
    queries) and then :func:`sequence` of its batch entry, the set-up every kernel starts with:
    (start, h, b64, h64, q0, k0, Lq, Lk)."""
    start, h, b64, h64 = program_ids(Sk if KEY_TILES else Sq, H, BLOCK, REVERSE)
    q0, k0, Lq, Lk = sequence(CuSeqlensQ, CuSeqlensK, b64, Sq, Sk, total_q, total_k, VARLEN)
    return start, h, b64, h64, q0, k0, Lq, Lk


@triton.jit
def head_base(X, b64, h64, stride_b, stride_h, row0, stride_row):
    """Pointer to the first row of head h of batch entry b: ``b * stride_b`` into a (B, H, S, D)
    tensor (``row0`` the constant 0, which folds away), or row ``row0`` of a packed (total, H, D)
    one (``stride_b`` 0). Offsets in int64."""
    return X + b64 * stride_b + h64 * stride_h + row0 * stride_row


@triton.jit
def tma_rows(base, n_rows, D, stride_row, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, VARLEN: tl.constexpr):
    """A device-side tensor descriptor (sm_90's TMA, the kernels' ``TMA``) of the (n_rows, D) matrix
    at ``base`` (head_base's pointer: with VARLEN the sequence's first row), rows ``stride_row``
    apart, loaded in (BLOCK_R, BLOCK_D) tiles: ``.load([row, 0])`` is load_rows' tile, zero past
    n_rows and D. A packed sequence may have no rows: its descriptor gets one (a tensor map with a
    0-long dimension is not a valid one), and the kernels load no tile of it."""
    if VARLEN:
        n_rows = tl.maximum(n_rows, 1)
    return tl.make_tensor_descriptor(base, shape=[n_rows, D], strides=[stride_row, 1], block_shape=[BLOCK_R, BLOCK_D])


@triton.jit
def stats_row(X, b64, h, H, Sq, q0, total_q, VARLEN: tl.constexpr):
    """Pointer to the first entry of head h of batch entry b in a contiguous per-row statistic
    (lse, delta): (B, H, Sq), or with VARLEN the schema's (H, total_q) from packed row q0."""
    if VARLEN:
        return X + h.to(tl.int64) * total_q + q0
    else:
        return X + (b64 * H + h) * Sq


@triton.jit
def mask_bases(KPM, AM, rng_offset, b64, h, h64, H, Sq, Sk, stride_kpm_b, stride_am_b, stride_am_h):
    """(key padding mask row, additive mask of head (b, h), Philox counter of its first group).
    ``Sq``, ``Sk``: the dropout rows' shape (the longest sequence's with VARLEN). An absent mask
    (launched as None) gets ``b64`` in its place, never read (HAS_KPM / HAS_MASK are off): a None
    cannot be passed on to the tile functions."""
    kpm_base = b64
    if KPM is not None:
        kpm_base = KPM + b64 * stride_kpm_b
    am_base = b64
    if AM is not None:
        am_base = head_base(AM, b64, h64, stride_am_b, stride_am_h, 0, 0)
    return kpm_base, am_base, dropout_rng_base(rng_offset, b64, H, h, Sq, Sk)


@triton.jit
def rel_row(RelBias, b64, h64, R):
    """The relative position bias of query head h: row h of the (H, 2R + 1) ``RelBias``; ``b64``
    in its place without one (launched as None, never read: HAS_REL is off), as mask_bases."""
    rel_base = b64
    if RelBias is not None:
        rel_base = RelBias + h64 * (2 * R + 1)
    return rel_base


@triton.jit
def key_bases(K, V, KPM, AM, rng_offset, b64, h, h64, H, Sq, Sk, k0, stride_kb, stride_kh, stride_kn, stride_vb,
              stride_vh, stride_vn, stride_kpm_b, stride_am_b, stride_am_h, KV_GROUP: tl.constexpr):
    """The key side of query head (b, h), which every kernel reads: (k rows, v rows, key padding
    mask row, additive mask, Philox counter), as head_base and mask_bases give them; k and v of
    the k/v head h // KV_GROUP (grouped-query attention), masks and counters of query head h."""
    k_base = head_base(K, b64, h64 // KV_GROUP, stride_kb, stride_kh, k0, stride_kn)
    v_base = head_base(V, b64, h64 // KV_GROUP, stride_vb, stride_vh, k0, stride_vn)
    kpm_base, am_base, rng_base = mask_bases(KPM, AM, rng_offset, b64, h, h64, H, Sq, Sk, stride_kpm_b,
                                             stride_am_b, stride_am_h)
    return k_base, v_base, kpm_base, am_base, rng_base


@triton.jit
def key_tile_scores(q, start_n, offs_m, offs_n, offs_d, k_base, stride_kn, v_base, stride_vn, kpm_base,
                    stride_kpm_n, am_base, stride_am_m, stride_am_n, Sq, Sk, D, qk_scale, rel_base, R, pos0,
                    MASK_EDGE: tl.constexpr, EVEN_D: tl.constexpr, HAS_KPM: tl.constexpr, HAS_MASK: tl.constexpr,
                    IS_CAUSAL: tl.constexpr, HAS_REL: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                    LARGE_OFFSETS: tl.constexpr):
    """Key tile ``start_n`` of a query tile ``q`` (BM, BD), the head of the forward's and dQ's
    loop steps: its keys and values (BN, BD) and the masked scores (BM, BN) in log2 units."""
    kn = start_n + offs_n
    k = load_rows(k_base, kn, stride_kn, offs_d, Sk, D, EVEN_D, LARGE_OFFSETS)  # (BN, BD)
    v = load_rows(v_base, kn, stride_vn, offs_d, Sk, D, EVEN_D, LARGE_OFFSETS)  # (BN, BD)
    qk = dot(q, tl.trans(k), tl.zeros([q.shape[0], k.shape[0]], dtype=tl.float32), INPUT_PRECISION)  # (BM, BN)
    s = masked_scores(qk, offs_m[:, None], kn[None, :], kpm_base, stride_kpm_n, am_base,
                      stride_am_m, stride_am_n, Sq, Sk, qk_scale, rel_base, R, pos0, MASK_EDGE, HAS_KPM,
                      HAS_MASK, IS_CAUSAL, HAS_REL, LARGE_OFFSETS)
    return k, v, s
