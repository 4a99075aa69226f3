"""Backward kernels of the flash attention in attention.py (FlashAttention-2), on the tile helpers
of attention_tiles.py that the forward kernel shares.

With P = softmax(S) recomputed from the saved lse, Z the dropout keep-mask scaled by
attention_keep_scale(p) = 256 / (256 - round(256 p)), and O = (P * Z) V:

    delta = rowsum(dO * O)                      (_attention_bwd_preprocess)
    dV = (P * Z)^T dO,  dP = (dO V^T) * Z,  dS = P * (dP - delta)
    dK = scale * dS^T Q                         (_attention_bwd_dkdv, one program per key tile)
    dQ = scale * dS K                           (_attention_bwd_dq,   one program per query tile)

The masks (padding, bottom-right causal, additive, dropout) and the relative position bias are
regenerated exactly as the forward made them; rows with lse = +inf (nothing visible) get P = 0,
hence zero gradients.

The bias's gradient (HAS_REL) is the sum of dS over each distance, clamped to [-R, R]. Each dK/dV
program (one key tile, its query tiles in order) sums it privately, without atomics: a query
tile's dS turns into its diagonal sums (one tl.gather), held in a register window of REL_W
distances that only moves down as the query tiles advance (_rel_grad_tile); a distance leaving
the window is final and stored once to the program's own row of an fp32 scratch
(B, H, key tiles, 2R + 1), the clamped ones summed into the two end bins. The host sums the rows
in a fixed order (attention.backward): the same bits every run.
With VARLEN the kernels run on packed sequences (attention_varlen.py), as the forward does; the
preprocess needs no such mode (it runs on the packed rows as one sequence of total_q rows).

With FUSED_DQ (attention.FUSED_DQ: the default, padded and packed; FASTFORMER_TRITON_FUSED_DQ=0
turns it off; BACKWARD.md) the dK/dV kernel also makes dQ, adding each query tile's dS K to one
fp32 accumulator in key-block order (_dq_tile_add), and the dQ kernel does not run: the dropout
bits are made twice a training step instead of three times.

With TMA (attention.tma_eligible: FASTFORMER_TRITON_TMA=1 on sm_90) the dK/dV kernel loads its K / V
tile and each step's Q and dO tiles through device-side tensor descriptors (attention_tiles.tma_rows,
one per tensor and program, the sequence's rows with VARLEN); the dQ kernel stays on cp.async.
"""
import triton
import triton.language as tl

from .attention_tiles import (FLT_MAX, LOG2E, cast, causal_key_bounds, dot, head_base, keep_tile, key_bases,
                              key_tile_scores, load_rows, mask_bases, masked_scores, program_ids, program_sequence,
                              rel_row, stats_row, store_rows, tma_rows)
from .utils import INTERPRET, load_philox

_SEQUENTIAL = tl.constexpr(INTERPRET)  # programs run one at a time, in id order (_dq_tile_add)


@triton.jit
def _attention_bwd_preprocess(
    Out,  # (B, H, Sq, D) forward output
    DO,  # (B, H, Sq, D) gradient of the output
    Delta,  # (B, H, Sq) fp32 contiguous: rowsum(dO * O)
    stride_ob,  # out batch stride
    stride_oh,  # out head stride
    stride_om,  # out row stride
    stride_dob,  # dout batch stride
    stride_doh,  # dout head stride
    stride_dom,  # dout row stride
    H,  # number of heads
    Sq,  # number of queries
    D,  # head dim
    BLOCK_M: tl.constexpr,  # rows per program
    BLOCK_D: tl.constexpr,  # head dim padded to a power of two
    EVEN_D: tl.constexpr,  # D == BLOCK_D
    LARGE_OFFSETS: tl.constexpr,  # a row offset of one head passes 2**31: int64 offsets
):
    start_m, h, b, _ = program_ids(Sq, H, BLOCK_M, False)  # the forward's grid of query tiles
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    o = load_rows(Out + b * stride_ob + h * stride_oh, offs_m, stride_om, offs_d, Sq, D, EVEN_D, LARGE_OFFSETS)
    do = load_rows(DO + b * stride_dob + h * stride_doh, offs_m, stride_dom, offs_d, Sq, D, EVEN_D, LARGE_OFFSETS)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)  # (BM,)
    tl.store(Delta + (b * H + h) * Sq + offs_m, delta, mask=offs_m < Sq)


@triton.jit
def _load_row_stats(lse_row, delta_row, rows, Sq):
    """lse in log2 units (+inf outside the rows, so they contribute nothing) and delta."""
    lse = tl.load(lse_row + rows, mask=rows < Sq, other=float("inf"))
    # a huge negative lse (an all-masked row with a large finite additive mask) stays finite; a NaN
    # lse (a NaN score in the forward) stays NaN, so the row's gradients are NaN as the reference's
    lse2 = tl.maximum(lse * LOG2E, -FLT_MAX, propagate_nan=tl.PropagateNan.ALL)
    delta = tl.load(delta_row + rows, mask=rows < Sq, other=0.0)
    return lse2, delta


@triton.jit
def _attention_bwd_dkdv_tile(dk, dv, k, v, start_m, start_n, offs_m, offs_n, offs_d,
                             q_base, stride_qm, do_base, stride_dom, lse_row, delta_row,
                             kpm_base, stride_kpm_n, am_base, stride_am_m, stride_am_n,
                             Sq, Sk, D, qk_scale, seed, rng_base, drop_cols, drop_threshold, drop_scale,
                             rel_base, R, pos0,
                             MASK_EDGE: tl.constexpr, EVEN_D: tl.constexpr, HAS_KPM: tl.constexpr,
                             HAS_MASK: tl.constexpr, IS_CAUSAL: tl.constexpr,
                             HAS_DROPOUT: tl.constexpr, HAS_REL: tl.constexpr,
                INPUT_PRECISION: tl.constexpr, LARGE_OFFSETS: tl.constexpr, TMA: tl.constexpr = False):
    """Accumulate one query tile's contribution to this key tile's dK and dV (``Sq``, ``Sk``: this
    sequence's lengths; ``drop_cols``: the dropout rows' width); also returns the tile's dS^T
    (BN, BM), which the relative position bias's gradient reads (unused, it folds away). With TMA
    ``q_base`` / ``do_base`` are the sequence's (Sq, D) tensor descriptors (block (BM, BD))."""
    qm = start_m + offs_m
    if TMA:  # the descriptors zero-fill rows past Sq and columns past D, as load_rows' masks do
        q = q_base.load([start_m, 0])  # (BM, BD)
        do = do_base.load([start_m, 0])  # (BM, BD)
    else:
        q = load_rows(q_base, qm, stride_qm, offs_d, Sq, D, EVEN_D, LARGE_OFFSETS)  # (BM, BD)
        do = load_rows(do_base, qm, stride_dom, offs_d, Sq, D, EVEN_D, LARGE_OFFSETS)  # (BM, BD)
    lse2, delta = _load_row_stats(lse_row, delta_row, qm, Sq)  # (BM,)
    qk_t = dot(k, tl.trans(q), tl.zeros([k.shape[0], q.shape[0]], dtype=tl.float32), INPUT_PRECISION)  # (BN, BM)
    s_t = masked_scores(qk_t, qm[None, :], offs_n[:, None], kpm_base, stride_kpm_n, am_base,
                         stride_am_m, stride_am_n, Sq, Sk, qk_scale, rel_base, R, pos0, MASK_EDGE, HAS_KPM,
                         HAS_MASK, IS_CAUSAL, HAS_REL, LARGE_OFFSETS)
    p_t = tl.exp2(s_t - lse2[None, :])  # (BN, BM)
    dp_t = dot(v, tl.trans(do), tl.zeros([k.shape[0], q.shape[0]], dtype=tl.float32), INPUT_PRECISION)  # (BN, BM)
    if HAS_DROPOUT:
        # the forward's tile of queries qm and keys from start_n, transposed: (BN, BM)
        keep = keep_tile(seed, rng_base, start_m, start_n, drop_cols, drop_threshold, q.shape[0], k.shape[0], True,
                         q.dtype != tl.float32)
        dv = dot(cast(tl.where(keep, p_t * drop_scale, 0.0), do.dtype), do, dv, INPUT_PRECISION)
        dp_t = tl.where(keep, dp_t * drop_scale, 0.0)
    else:
        dv = dot(cast(p_t, do.dtype), do, dv, INPUT_PRECISION)
    ds_t = p_t * (dp_t - delta[None, :])  # (BN, BM)
    dk = dot(cast(ds_t, q.dtype), q, dk, INPUT_PRECISION)
    return dk, dv, ds_t


@triton.jit
def _dq_tile_add(ds_t, k, start_m, key_block, last, offs_m, offs_n, offs_d, dq_base, stride_dqm, acc_base, lock, Sq,
                 Sk, D, scale, EVEN_D: tl.constexpr, INPUT_PRECISION: tl.constexpr, LARGE_OFFSETS: tl.constexpr):
    """FUSED_DQ: add this key tile's dQ_tile = dS K (``ds_t`` the (BN, BM) dS^T, ``k`` the (BN, BD)
    keys) to query tile ``start_m``'s fp32 accumulator, in key-block order (BACKWARD.md): key block
    ``key_block`` (the tile's visitors are key blocks 0 .. L) waits until the tile's counter
    ``lock`` is key_block, adds its product to the partial sums (key block 0 stores, reads none),
    and either stores them and sets the counter to key_block + 1, or (``last``: key block L) writes
    dQ x scale in DQ's dtype. A fixed order of fp32 adds: the same bits every run, no atomics on
    the data. The product is made before the wait, so the wait overlaps nothing but the adds."""
    # keys past Sk: their K rows are zero but their dS is unmasked (the dK/dV tile never stores
    # them) and can be inf (P = exp2(0 - lse) for a row of very negative scores): inf x 0 = NaN
    ds_t = tl.where(offs_n[:, None] < Sk, ds_t, 0.0)
    part = dot(tl.trans(cast(ds_t, k.dtype)), k, tl.zeros([offs_m.shape[0], offs_d.shape[0]], dtype=tl.float32),
               INPUT_PRECISION)  # (BM, BD)
    rows = start_m + offs_m
    if LARGE_OFFSETS:
        rows = rows.to(tl.int64)
    # the accumulator is (Sq, D) contiguous per head; .cg: past L1, which other blocks' reads of
    # this tile may have filled with older partial sums
    acc_ptrs = acc_base + rows[:, None] * D + offs_d[None, :]
    acc_mask = (rows[:, None] < Sq) & (offs_d[None, :] < D)
    if key_block > 0:
        # a scalar atomic: one thread spins, the result reaches every thread (acquire: the
        # previous block's stores, released with its counter, are visible to the loads below)
        if _SEQUENTIAL:
            # the interpreter runs the programs one at a time in id order: the counter is already
            # key_block, or the order is wrong and a spin would never end; then the tile's dQ turns
            # NaN (device_assert checks nothing there unless debug is on)
            part = tl.where(tl.atomic_add(lock, 0) == key_block, part, float("nan"))
        else:
            while tl.atomic_add(lock, 0, sem="acquire", scope="gpu") != key_block:
                pass
        part += tl.load(acc_ptrs, mask=acc_mask, other=0.0, cache_modifier=".cg")
    if last:
        store_rows(dq_base, cast(part * scale, dq_base.dtype.element_ty), rows, stride_dqm, offs_d, Sq, D, EVEN_D,
                   LARGE_OFFSETS)
    else:
        tl.store(acc_ptrs, part, mask=acc_mask, cache_modifier=".cg")
        # every thread's partial sums are stored before the counter says so: a barrier, then one
        # thread's release (CUTLASS's Semaphore::release)
        if _SEQUENTIAL:
            tl.debug_barrier()
            turn = key_block + 1
        else:
            # the barrier as inline asm: Triton's pipeliner skips a loop holding a gpu.barrier
            # (debug_barrier), which cost the query-tile loop its cp.async pipelining; the asm's
            # output is the counter's new value, so the release cannot move above the barrier
            turn = tl.inline_asm_elementwise("bar.sync 0;\n\tmov.b32 $0, $1;", "=r,r", [key_block + 1],
                                             dtype=tl.int32, is_pure=False, pack=1)
        tl.atomic_xchg(lock, turn, sem="release", scope="gpu")


@triton.jit
def _rel_flush(acc, win, below, drel_row, R, lo, hi, REL_W: tl.constexpr):
    """Store the distances of the window ``acc`` (slot u holds the distance d = u mod REL_W in
    [win, win + REL_W)) that the window starting at ``below`` no longer holds (d >= below + REL_W):
    each to its bin d + R of ``drel_row``, those at or past a clamp added to ``lo`` / ``hi``
    instead (the end bins, stored once at the end). Returns (acc with those slots zeroed, lo, hi)."""
    d = win + ((tl.arange(0, REL_W) - win) & (REL_W - 1))
    out = d >= below + REL_W
    tl.store(drel_row + d + R, acc, mask=out & (d > -R) & (d < R))
    lo += tl.sum(tl.where(out & (d <= -R), acc, 0.0), 0)
    hi += tl.sum(tl.where(out & (d >= R) & (d > -R), acc, 0.0), 0)  # R == 0: d = 0 is lo's
    return tl.where(out, 0.0, acc), lo, hi


@triton.jit
def _rel_grad_tile(acc, win, lo, hi, ds_t, drel_row, start_m, start_n, offs_n, Sk, R, pos0,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, REL_W: tl.constexpr):
    """Add one (BN, BM) dS^T tile (keys ``offs_n``, queries from ``start_m``) to the relative
    position bias's gradient by distance d = j - i - pos0: tiles wholly past a clamp add their
    sum to ``lo`` / ``hi``; the others move the window down to the tile's smallest distance
    (flushing what leaves it, _rel_flush) and add their diagonal sums, one per distance, at the
    slots d mod REL_W. Returns the new (acc, win, lo, hi)."""
    ds_t = tl.where(offs_n[:, None] < Sk, ds_t, 0.0)  # keys past Sk: never stored, their dS unmasked
    d0 = start_n - (start_m + BLOCK_M - 1) - pos0  # the tile's smallest distance
    if d0 >= R:
        hi += tl.sum(tl.sum(ds_t, 1), 0)
    elif d0 + BLOCK_M + BLOCK_N - 2 <= -R:
        lo += tl.sum(tl.sum(ds_t, 1), 0)
    else:
        acc, lo, hi = _rel_flush(acc, win, d0, drel_row, R, lo, hi, REL_W)
        win = d0
        # slot u gets distance d0 + w: query i's key on that diagonal is j = w + i - (BM - 1)
        w = (tl.arange(0, REL_W) - d0) & (REL_W - 1)
        j = w[:, None] + tl.arange(0, BLOCK_M)[None, :] - (BLOCK_M - 1)  # (REL_W, BM)
        on = (j >= 0) & (j < BLOCK_N)
        diag = tl.gather(ds_t, tl.minimum(tl.maximum(j, 0), BLOCK_N - 1), 0)  # diag[u, i] = dS^T[j, i]
        acc += tl.sum(tl.where(on, diag, 0.0), 1)
    return acc, win, lo, hi


@triton.jit(do_not_specialize=["seed", "rng_offset", "drop_threshold", "rel_shift"])
def _attention_bwd_dkdv(
    Q,  # (B, H, Sq, D) queries; VARLEN: (total_q, H, D) packed sequences
    K,  # (B, H, Sk, D) keys; VARLEN: (total_k, H, D)
    V,  # (B, H, Sk, D) values; VARLEN: (total_k, H, D)
    DO,  # (B, H, Sq, D) gradient of the output; VARLEN: (total_q, H, D)
    Lse,  # fp32 forward log-sum-exp: (B, H, Sq); VARLEN: (H, total_q)
    Delta,  # fp32 rowsum(dO * O), laid out as Lse
    KPM,  # (B, Sk) u8 key padding mask, nonzero = padded (None without HAS_KPM)
    AM,  # fp32 additive mask viewed as (B, H, Sq, Sk) (None without HAS_MASK)
    RelBias,  # (H, 2R + 1) fp32 contiguous relative position bias by distance (None without HAS_REL)
    CuSeqlensQ,  # VARLEN: (B + 1,) int32 first query row of each sequence (None otherwise)
    CuSeqlensK,  # VARLEN: (B + 1,) int32 first key row of each sequence (None otherwise)
    DK,  # (B, H, Sk, D) gradient of k per query head; VARLEN: (total_k, H, D) (a group's summed after)
    DV,  # (B, H, Sk, D) gradient of v per query head; VARLEN: (total_k, H, D)
    DRel,  # (B, H, rel_tiles, 2R + 1) fp32 zeros: each program's gradient of RelBias (None without HAS_REL)
    DQ,  # FUSED_DQ: (B, H, Sq, D) gradient of q; VARLEN: (total_q, H, D) (None otherwise)
    DQAcc,  # FUSED_DQ: (B, H, Sq, D) fp32 contiguous, uninitialised: dQ's partial sums; VARLEN: (H, total_q, D) (None otherwise)
    DQLock,  # FUSED_DQ: (B, H, cdiv(Sq, 16)) int32 zeros: each query tile's counter, at start_m // 16 (None otherwise)
    stride_qb,  # q batch stride (0 with VARLEN)
    stride_qh,  # q head stride
    stride_qm,  # q row stride
    stride_kb,  # k batch stride (0 with VARLEN)
    stride_kh,  # k head stride
    stride_kn,  # k row stride
    stride_vb,  # v batch stride (0 with VARLEN)
    stride_vh,  # v head stride
    stride_vn,  # v row stride
    stride_dob,  # dout batch stride (0 with VARLEN)
    stride_doh,  # dout head stride
    stride_dom,  # dout row stride
    stride_kpm_b,  # key padding mask batch stride
    stride_kpm_n,  # key padding mask key stride
    stride_am_b,  # additive mask batch stride (0 when broadcast)
    stride_am_h,  # additive mask head stride (0 when broadcast)
    stride_am_m,  # additive mask query stride (0 when broadcast)
    stride_am_n,  # additive mask key stride (0 when broadcast)
    stride_dkb,  # dk / dv batch stride (0 with VARLEN)
    stride_dkh,  # dk / dv head stride
    stride_dkn,  # dk / dv row stride
    stride_dqb,  # FUSED_DQ: dq batch stride (0 otherwise)
    stride_dqh,  # FUSED_DQ: dq head stride
    stride_dqm,  # FUSED_DQ: dq row stride
    H,  # number of heads
    Sq,  # number of queries (VARLEN: max_seqlen_q), the dropout rows per head
    Sk,  # number of keys (VARLEN: max_seqlen_k), the dropout rows' width
    total_q,  # VARLEN: rows of q (every sequence is clamped into them) and of each head of lse; unused otherwise
    total_k,  # VARLEN: rows of k and v; unused otherwise
    D,  # head dim (<= BLOCK_D)
    scale,  # fp32 score scale
    Philox,  # int64 (2,) = (seed, offset) on the device, loaded once; None: the two scalars below
    seed,  # i64 dropout Philox seed (without Philox)
    rng_offset,  # i64 dropout Philox counter of element 0 (without Philox)
    drop_threshold,  # i32 round(dropout_p * 2**16)
    drop_scale,  # fp32 1 / (1 - dropout_p)
    R,  # the relative position bias's largest distance (0 without HAS_REL)
    rel_shift,  # query i of a sequence is at position i + Lk - Lq + rel_shift (0 with VARLEN)
    rel_tiles,  # DRel's rows per head (>= the key tiles of the grid)
    TUNE_SQ,  # autotune key only: Sq bucket (power of two)
    TUNE_SK,  # autotune key only: Sk bucket (power of two)
    BLOCK_M: tl.constexpr,  # queries per loop step
    BLOCK_N: tl.constexpr,  # keys per program
    BLOCK_D: tl.constexpr,  # head dim padded to a power of two >= 16
    EVEN_D: tl.constexpr,  # D == BLOCK_D (no head-dim masking)
    HAS_KPM: tl.constexpr,  # a key padding mask is given
    HAS_MASK: tl.constexpr,  # an additive mask is given
    IS_CAUSAL: tl.constexpr,  # bottom-right causal masking
    HAS_DROPOUT: tl.constexpr,  # dropout_p > 0
    HAS_REL: tl.constexpr,  # a relative position bias is given
    INPUT_PRECISION: tl.constexpr,  # tl.dot precision of fp32 operands: "ieee" | "tf32"
    LARGE_OFFSETS: tl.constexpr,  # some row or mask offset of one head passes 2**31: int64 offsets
    VARLEN: tl.constexpr,  # packed sequences: entry b of the grid is sequence b of the cu_seqlens
    KV_GROUP: tl.constexpr,  # query heads per k/v head: query head h reads k/v head h // KV_GROUP
    FUSED_DQ: tl.constexpr = False,  # also make dQ (DQ, DQAcc, DQLock), ordered by key block: no dQ kernel
    TMA: tl.constexpr = False,  # Q / dO tiles and K / V through device-side tensor descriptors (attention.tma_eligible)
):
    start_n, h, b64, h64, q0, k0, Lq, Lk = program_sequence(CuSeqlensQ, CuSeqlensK, H, Sq, Sk, total_q, total_k,
                                                           BLOCK_N, True, False, VARLEN)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    if VARLEN:
        if start_n >= Lk:  # the grid covers the longest sequence: this one ends before the tile
            if FUSED_DQ:
                if start_n == 0:
                    # Lk = 0: no key block makes this sequence's dQ; its key block 0 zeroes the Lq
                    # rows (only those: a host memset would write all of dq once more)
                    for start_m in range(0, Lq, BLOCK_M):
                        store_rows(head_base(DQ, b64, h64, stride_dqb, stride_dqh, q0, stride_dqm),
                                   tl.zeros([BLOCK_M, BLOCK_D], dtype=DQ.dtype.element_ty), start_m + offs_m,
                                   stride_dqm, offs_d, Lq, D, EVEN_D, LARGE_OFFSETS)
            return

    # not key_bases: the mask bases come after the loads here, and moving them changes the code
    if TMA:
        # the sequence's (Lk, D) keys and values, its (Lq, D) queries and output gradients as
        # device-side descriptors (128 B of the launch's global scratch each, as the forward's):
        # K / V once, a Q and a dO tile each step by cp.async.bulk.tensor (HOPPER.md)
        k = tma_rows(head_base(K, b64, h64 // KV_GROUP, stride_kb, stride_kh, k0, stride_kn), Lk, D, stride_kn,
                     BLOCK_N, BLOCK_D, VARLEN).load([start_n, 0])
        v = tma_rows(head_base(V, b64, h64 // KV_GROUP, stride_vb, stride_vh, k0, stride_vn), Lk, D, stride_vn,
                     BLOCK_N, BLOCK_D, VARLEN).load([start_n, 0])
        q_base = tma_rows(head_base(Q, b64, h64, stride_qb, stride_qh, q0, stride_qm), Lq, D, stride_qm, BLOCK_M,
                          BLOCK_D, VARLEN)
        do_base = tma_rows(head_base(DO, b64, h64, stride_dob, stride_doh, q0, stride_dom), Lq, D, stride_dom,
                           BLOCK_M, BLOCK_D, VARLEN)
    else:
        k = load_rows(head_base(K, b64, h64 // KV_GROUP, stride_kb, stride_kh, k0, stride_kn), offs_n, stride_kn,
                      offs_d, Lk, D, EVEN_D, LARGE_OFFSETS)
        v = load_rows(head_base(V, b64, h64 // KV_GROUP, stride_vb, stride_vh, k0, stride_vn), offs_n, stride_vn,
                      offs_d, Lk, D, EVEN_D, LARGE_OFFSETS)
        q_base = head_base(Q, b64, h64, stride_qb, stride_qh, q0, stride_qm)
        do_base = head_base(DO, b64, h64, stride_dob, stride_doh, q0, stride_dom)
    lse_row = stats_row(Lse, b64, h, H, Sq, q0, total_q, VARLEN)
    delta_row = stats_row(Delta, b64, h, H, Sq, q0, total_q, VARLEN)
    seed, rng_offset = load_philox(Philox, seed, rng_offset)
    kpm_base, am_base, rng_base = mask_bases(KPM, AM, rng_offset, b64, h, h64, H, Sq, Sk, stride_kpm_b,
                                             stride_am_b, stride_am_h)
    rel_base = rel_row(RelBias, b64, h64, R)
    pos0 = Lk - Lq + rel_shift
    qk_scale = scale * LOG2E

    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    if FUSED_DQ:
        # this block is visitor number key_block of each query tile it sees (the visitors of a
        # tile are key blocks 0 .. L: causal, query i sees key j iff i >= j - (Lk - Lq), so a tile
        # block n sees, block n - 1 sees too); it is the last one (L) of the tiles before dq_last,
        # those key block n + 1 does not see (causal: before its first tile; every tile, for the
        # last key block; none otherwise)
        key_block = start_n // BLOCK_N
        if IS_CAUSAL:
            dq_last = tl.maximum(start_n + BLOCK_N + Lq - Lk, 0) // BLOCK_M * BLOCK_M
        else:
            dq_last = Lq * 0
        dq_last = tl.where(start_n + BLOCK_N < Lk, dq_last, Lq)
        dq_base = head_base(DQ, b64, h64, stride_dqb, stride_dqh, q0, stride_dqm)
        if VARLEN:  # (H, total_q, D): the sequence's rows of head h
            dq_acc = DQAcc + (h64 * total_q + q0) * D
        else:
            dq_acc = DQAcc + (b64 * H + h64) * Sq * D
        dq_lock = DQLock + (b64 * H + h64) * tl.cdiv(Sq, 16)
    if HAS_REL:
        # the window holds every distance of a tile (BM + BN - 1), a power of two
        REL_W: tl.constexpr = 2 * BLOCK_M if BLOCK_M > BLOCK_N else 2 * BLOCK_N
        drel_row = DRel + ((b64 * H + h) * rel_tiles + start_n // BLOCK_N) * (2 * R + 1)
        rel_acc = tl.zeros([REL_W], dtype=tl.float32)
        rel_win = start_n - (BLOCK_M - 1) - pos0  # no tile's distances start above it: the window only descends
        rel_lo = tl.zeros([], dtype=tl.float32)  # dS at distances <= -R
        rel_hi = tl.zeros([], dtype=tl.float32)  # dS at distances >= R (> -R)
    if IS_CAUSAL:
        # query i sees key j iff i >= j - (Lk - Lq): earlier query tiles are skipped whole, and
        # from full_lo on every query of a tile sees every key of this tile
        lo = tl.maximum(start_n + Lq - Lk, 0) // BLOCK_M * BLOCK_M
        full_lo = tl.maximum(tl.cdiv(start_n + BLOCK_N - 1 + Lq - Lk, BLOCK_M) * BLOCK_M, lo)
        if FUSED_DQ:
            if key_block == 0:  # the query tiles no key block sees (Lq > Lk): zero gradient
                for start_m in range(0, lo, BLOCK_M):
                    store_rows(dq_base, tl.zeros([BLOCK_M, BLOCK_D], dtype=DQ.dtype.element_ty), start_m + offs_m,
                               stride_dqm, offs_d, Lq, D, EVEN_D, LARGE_OFFSETS)
        for start_m in range(lo, tl.minimum(full_lo, Lq), BLOCK_M):
            dk, dv, ds_t = _attention_bwd_dkdv_tile(
                dk, dv, k, v, start_m, start_n, offs_m, offs_n, offs_d, q_base, stride_qm, do_base, stride_dom,
                lse_row, delta_row, kpm_base, stride_kpm_n, am_base, stride_am_m, stride_am_n, Lq, Lk, D,
                qk_scale, seed, rng_base, Sk, drop_threshold, drop_scale, rel_base, R, pos0, True, EVEN_D, HAS_KPM,
                HAS_MASK, IS_CAUSAL, HAS_DROPOUT, HAS_REL, INPUT_PRECISION, LARGE_OFFSETS, TMA)
            if FUSED_DQ:
                _dq_tile_add(ds_t, k, start_m, key_block, start_m < dq_last, offs_m, offs_n, offs_d, dq_base,
                             stride_dqm, dq_acc, dq_lock + start_m // 16, Lq, Lk, D, scale, EVEN_D, INPUT_PRECISION,
                             LARGE_OFFSETS)
            if HAS_REL:
                rel_acc, rel_win, rel_lo, rel_hi = _rel_grad_tile(
                    rel_acc, rel_win, rel_lo, rel_hi, ds_t, drel_row, start_m, start_n, offs_n, Lk, R, pos0,
                    BLOCK_M, BLOCK_N, REL_W)
    else:
        full_lo = 0
    # query rows past Lq have lse = +inf (P = 0) and keys past Lk are never stored: no edge mask
    for start_m in range(full_lo, Lq, BLOCK_M):
        dk, dv, ds_t = _attention_bwd_dkdv_tile(
            dk, dv, k, v, start_m, start_n, offs_m, offs_n, offs_d, q_base, stride_qm, do_base, stride_dom,
            lse_row, delta_row, kpm_base, stride_kpm_n, am_base, stride_am_m, stride_am_n, Lq, Lk, D,
            qk_scale, seed, rng_base, Sk, drop_threshold, drop_scale, rel_base, R, pos0, False, EVEN_D, HAS_KPM,
            HAS_MASK, IS_CAUSAL, HAS_DROPOUT, HAS_REL, INPUT_PRECISION, LARGE_OFFSETS, TMA)
        if FUSED_DQ:
            _dq_tile_add(ds_t, k, start_m, key_block, start_m < dq_last, offs_m, offs_n, offs_d, dq_base,
                         stride_dqm, dq_acc, dq_lock + start_m // 16, Lq, Lk, D, scale, EVEN_D, INPUT_PRECISION,
                         LARGE_OFFSETS)
        if HAS_REL:
            rel_acc, rel_win, rel_lo, rel_hi = _rel_grad_tile(
                rel_acc, rel_win, rel_lo, rel_hi, ds_t, drel_row, start_m, start_n, offs_n, Lk, R, pos0,
                BLOCK_M, BLOCK_N, REL_W)
    if HAS_REL:  # what the window still holds, then the two end bins
        rel_acc, rel_lo, rel_hi = _rel_flush(rel_acc, rel_win, rel_win - REL_W, drel_row, R, rel_lo, rel_hi, REL_W)
        if R == 0:
            tl.store(drel_row, rel_lo + rel_hi)
        else:
            tl.store(drel_row, rel_lo)
            tl.store(drel_row + 2 * R, rel_hi)

    dk = dk * scale
    store_rows(head_base(DK, b64, h64, stride_dkb, stride_dkh, k0, stride_dkn), cast(dk, DK.dtype.element_ty),
               offs_n, stride_dkn, offs_d, Lk, D, EVEN_D, LARGE_OFFSETS)
    store_rows(head_base(DV, b64, h64, stride_dkb, stride_dkh, k0, stride_dkn), cast(dv, DV.dtype.element_ty),
               offs_n, stride_dkn, offs_d, Lk, D, EVEN_D, LARGE_OFFSETS)


@triton.jit
def _attention_bwd_dq_tile(dq, q, do, lse2, delta, start_m, start_n, offs_m, offs_n, offs_d,
                           k_base, stride_kn, v_base, stride_vn, kpm_base, stride_kpm_n,
                           am_base, stride_am_m, stride_am_n, Sq, Sk, D, qk_scale,
                           seed, rng_base, drop_cols, drop_threshold, drop_scale, rel_base, R, pos0,
                           MASK_EDGE: tl.constexpr, EVEN_D: tl.constexpr, HAS_KPM: tl.constexpr,
                           HAS_MASK: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_DROPOUT: tl.constexpr,
                           HAS_REL: tl.constexpr, INPUT_PRECISION: tl.constexpr, LARGE_OFFSETS: tl.constexpr):
    """Accumulate one key tile's contribution to this query tile's dQ (``Sq``, ``Sk``: this
    sequence's lengths; ``drop_cols``: the dropout rows' width)."""
    if HAS_DROPOUT:
        # first, while neither P nor dP is live: made after dP, the keep tile's layout conversions
        # (the m16n8 accumulators of dQ's launches split the keys over the warps) spilled the
        # heavy dQ at d128 and d256 on sm_80
        keep = keep_tile(seed, rng_base, start_m, start_n, drop_cols, drop_threshold, q.shape[0], offs_n.shape[0],
                         False, q.dtype != tl.float32)  # (BM, BN)
    k, v, s = key_tile_scores(q, start_n, offs_m, offs_n, offs_d, k_base, stride_kn, v_base, stride_vn, kpm_base,
                              stride_kpm_n, am_base, stride_am_m, stride_am_n, Sq, Sk, D, qk_scale, rel_base, R,
                              pos0, MASK_EDGE, EVEN_D, HAS_KPM, HAS_MASK, IS_CAUSAL, HAS_REL, INPUT_PRECISION,
                              LARGE_OFFSETS)
    p = tl.exp2(s - lse2[:, None])  # (BM, BN)
    dp = dot(do, tl.trans(v), tl.zeros([q.shape[0], k.shape[0]], dtype=tl.float32), INPUT_PRECISION)  # (BM, BN)
    if HAS_DROPOUT:
        dp = tl.where(keep, dp * drop_scale, 0.0)
    ds = p * (dp - delta[:, None])  # (BM, BN)
    return dot(cast(ds, k.dtype), k, dq, INPUT_PRECISION)


@triton.jit(do_not_specialize=["seed", "rng_offset", "drop_threshold", "rel_shift"])
def _attention_bwd_dq(
    Q,  # (B, H, Sq, D) queries; VARLEN: (total_q, H, D) packed sequences
    K,  # (B, H, Sk, D) keys; VARLEN: (total_k, H, D)
    V,  # (B, H, Sk, D) values; VARLEN: (total_k, H, D)
    DO,  # (B, H, Sq, D) gradient of the output; VARLEN: (total_q, H, D)
    Lse,  # fp32 forward log-sum-exp: (B, H, Sq); VARLEN: (H, total_q)
    Delta,  # fp32 rowsum(dO * O), laid out as Lse
    KPM,  # (B, Sk) u8 key padding mask, nonzero = padded (None without HAS_KPM)
    AM,  # fp32 additive mask viewed as (B, H, Sq, Sk) (None without HAS_MASK)
    RelBias,  # (H, 2R + 1) fp32 contiguous relative position bias by distance (None without HAS_REL)
    CuSeqlensQ,  # VARLEN: (B + 1,) int32 first query row of each sequence (None otherwise)
    CuSeqlensK,  # VARLEN: (B + 1,) int32 first key row of each sequence (None otherwise)
    DQ,  # (B, H, Sq, D) gradient of q; VARLEN: (total_q, H, D)
    stride_qb,  # q batch stride (0 with VARLEN)
    stride_qh,  # q head stride
    stride_qm,  # q row stride
    stride_kb,  # k batch stride (0 with VARLEN)
    stride_kh,  # k head stride
    stride_kn,  # k row stride
    stride_vb,  # v batch stride (0 with VARLEN)
    stride_vh,  # v head stride
    stride_vn,  # v row stride
    stride_dob,  # dout batch stride (0 with VARLEN)
    stride_doh,  # dout head stride
    stride_dom,  # dout row stride
    stride_kpm_b,  # key padding mask batch stride
    stride_kpm_n,  # key padding mask key stride
    stride_am_b,  # additive mask batch stride (0 when broadcast)
    stride_am_h,  # additive mask head stride (0 when broadcast)
    stride_am_m,  # additive mask query stride (0 when broadcast)
    stride_am_n,  # additive mask key stride (0 when broadcast)
    stride_dqb,  # dq batch stride (0 with VARLEN)
    stride_dqh,  # dq head stride
    stride_dqm,  # dq row stride
    H,  # number of heads
    Sq,  # number of queries (VARLEN: max_seqlen_q), the dropout rows per head
    Sk,  # number of keys (VARLEN: max_seqlen_k), the dropout rows' width
    total_q,  # VARLEN: rows of q (every sequence is clamped into them) and of each head of lse; unused otherwise
    total_k,  # VARLEN: rows of k and v; unused otherwise
    D,  # head dim (<= BLOCK_D)
    scale,  # fp32 score scale
    Philox,  # int64 (2,) = (seed, offset) on the device, loaded once; None: the two scalars below
    seed,  # i64 dropout Philox seed (without Philox)
    rng_offset,  # i64 dropout Philox counter of element 0 (without Philox)
    drop_threshold,  # i32 round(dropout_p * 2**16)
    drop_scale,  # fp32 1 / (1 - dropout_p)
    R,  # the relative position bias's largest distance (0 without HAS_REL)
    rel_shift,  # query i of a sequence is at position i + Lk - Lq + rel_shift (0 with VARLEN)
    TUNE_SQ,  # autotune key only: Sq bucket (power of two)
    TUNE_SK,  # autotune key only: Sk bucket (power of two)
    BLOCK_M: tl.constexpr,  # queries per program
    BLOCK_N: tl.constexpr,  # keys per loop step
    BLOCK_D: tl.constexpr,  # head dim padded to a power of two >= 16
    EVEN_D: tl.constexpr,  # D == BLOCK_D (no head-dim masking)
    HAS_KPM: tl.constexpr,  # a key padding mask is given
    HAS_MASK: tl.constexpr,  # an additive mask is given
    IS_CAUSAL: tl.constexpr,  # bottom-right causal masking
    HAS_DROPOUT: tl.constexpr,  # dropout_p > 0
    HAS_REL: tl.constexpr,  # a relative position bias is given
    INPUT_PRECISION: tl.constexpr,  # tl.dot precision of fp32 operands: "ieee" | "tf32"
    LARGE_OFFSETS: tl.constexpr,  # some row or mask offset of one head passes 2**31: int64 offsets
    VARLEN: tl.constexpr,  # packed sequences: entry b of the grid is sequence b of the cu_seqlens
    KV_GROUP: tl.constexpr,  # query heads per k/v head: query head h reads k/v head h // KV_GROUP
):
    start_m, h, b64, h64, q0, k0, Lq, Lk = program_sequence(CuSeqlensQ, CuSeqlensK, H, Sq, Sk, total_q, total_k,
                                                           BLOCK_M, False, IS_CAUSAL, VARLEN)
    if VARLEN:
        if start_m >= Lq:  # the grid covers the longest sequence: this one ends before the tile
            return
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)

    q = load_rows(head_base(Q, b64, h64, stride_qb, stride_qh, q0, stride_qm), offs_m, stride_qm, offs_d, Lq, D,
                  EVEN_D, LARGE_OFFSETS)
    do = load_rows(head_base(DO, b64, h64, stride_dob, stride_doh, q0, stride_dom), offs_m, stride_dom, offs_d, Lq,
                   D, EVEN_D, LARGE_OFFSETS)
    lse2, delta = _load_row_stats(stats_row(Lse, b64, h, H, Sq, q0, total_q, VARLEN),
                                  stats_row(Delta, b64, h, H, Sq, q0, total_q, VARLEN), offs_m, Lq)
    seed, rng_offset = load_philox(Philox, seed, rng_offset)
    k_base, v_base, kpm_base, am_base, rng_base = key_bases(
        K, V, KPM, AM, rng_offset, b64, h, h64, H, Sq, Sk, k0, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh,
        stride_vn, stride_kpm_b, stride_am_b, stride_am_h, KV_GROUP)
    rel_base = rel_row(RelBias, b64, h64, R)
    pos0 = Lk - Lq + rel_shift
    qk_scale = scale * LOG2E

    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    full_hi, hi = causal_key_bounds(start_m, Lq, Lk, BLOCK_M, BLOCK_N, IS_CAUSAL)
    for start_n in range(0, full_hi, BLOCK_N):  # tiles every query of the block sees whole
        dq = _attention_bwd_dq_tile(
            dq, q, do, lse2, delta, start_m, start_n, offs_m, offs_n, offs_d, k_base, stride_kn, v_base, stride_vn,
            kpm_base, stride_kpm_n, am_base, stride_am_m, stride_am_n, Lq, Lk, D, qk_scale, seed,
            rng_base, Sk, drop_threshold, drop_scale, rel_base, R, pos0, False, EVEN_D, HAS_KPM, HAS_MASK,
            IS_CAUSAL, HAS_DROPOUT, HAS_REL, INPUT_PRECISION, LARGE_OFFSETS)
    for start_n in range(full_hi, hi, BLOCK_N):  # the causal diagonal and the ragged key tail
        dq = _attention_bwd_dq_tile(
            dq, q, do, lse2, delta, start_m, start_n, offs_m, offs_n, offs_d, k_base, stride_kn, v_base, stride_vn,
            kpm_base, stride_kpm_n, am_base, stride_am_m, stride_am_n, Lq, Lk, D, qk_scale, seed,
            rng_base, Sk, drop_threshold, drop_scale, rel_base, R, pos0, True, EVEN_D, HAS_KPM, HAS_MASK,
            IS_CAUSAL, HAS_DROPOUT, HAS_REL, INPUT_PRECISION, LARGE_OFFSETS)

    dq = dq * scale
    store_rows(head_base(DQ, b64, h64, stride_dqb, stride_dqh, q0, stride_dqm), cast(dq, DQ.dtype.element_ty),
               offs_m, stride_dqm, offs_d, Lq, D, EVEN_D, LARGE_OFFSETS)
