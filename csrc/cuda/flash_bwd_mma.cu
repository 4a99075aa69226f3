// Attention backward on tensor cores: FlashAttention-2's backward with mma.sync m16n8k16 (bf16 /
// fp16 inputs, fp32 accumulation), ldmatrix and cp.async (mma.cuh; fragment layouts in its
// header). Launcher declared in flash_mma.h; the definitions are the gradients of
// fastformer/ops/reference.py::attention and ::attention_varlen, whose glue (attention.cpp,
// attention_varlen.cpp) runs their 16-bit backwards here where flash_bwd_mma_why_not allows. The
// forward is flash_fwd_mma.cu; the tile helpers both use (swz, LdOffsets, load_tile, pack2) are in
// flash_tiles.cuh. Notes and compiler output: flash_bwd_mma.md.
//
// Varlen, as the forward: a block's (b, h, tile) addresses sequence b's rows from cu_seqlens
// (flash_tiles.cuh's seq_rows); Sq / Sk in the kernels are that sequence's lengths (causal
// bottom-right per sequence, the tile counts), p.Sq / p.Sk the maxima that size the grids and
// number the dropout counters (so the bits are the forward's). lse and Dsum are read and written
// in the forward's lse layout ((H, total_q) for varlen). A block whose owned tile starts past its
// sequence's length exits before any barrier; rows no sequence owns are not written (the glue
// zeroes them).
//
// Two backwards, both deterministic. Every head dim (cp.async variant at D 64): the one-kernel
// backward, FlashAttention-2's 5 products a tile (at D 256 too: the two warps of a key group
// split S^T and dP^T over the head dim, as below) (the dK dV kernel below with kFused: dQ_tile =
// dS K after dK, dV; the dQ partial sums of a query tile added in key-block order to an fp32
// accumulator, a counter a query tile, the last key block writing dQ; flash_bwd_mma.md's last
// section). Else
// (the plain-load variant at D 64, Sk = 0, no workspace given) the two-kernel backward: three
// launches, no atomics, every gradient element written by one lane:
//   delta   Dsum = rowsum(dO * O) in fp32 (lse's layout), a warp a row (the FMA backward computes
//           the same inside its dQ kernel; here both kernels below read it).
//   dK dV   a block owns kOwn keys of one (b, h) and streams the query tiles that can see them
//           (kStream rows; Q, dO, lse, Dsum and the dropout bits double-buffered, cp.async). A
//           warp computes, for its 16 keys, S^T = K Q^T and dP^T = V dO^T (keys are the mma's M
//           rows, queries its N columns), P^T = exp2(S^T scale log2 e + mask log2 e - lse log2 e),
//           dS^T = P^T (dP^T z - Dsum) (z: 256 / (256 - T8) where kept, 0 where dropped), then
//           dV += (P z)^T dO and dK += dS^T Q with P z and dS^T straight from the accumulators as
//           A fragments (the C layout of two adjacent n8 tiles is one k16 A fragment, as the
//           forward's P), dO and Q as k-major B through ldmatrix .trans.
//   dQ      a block owns kOwn queries and streams the key tiles they can see (K, V and the
//           hidden-key bits double-buffered): S = Q K^T, dP = dO V^T, dS as above, dQ += dS K.
// dK and dQ are scaled by `scale` once at the end.
//
// Head dims: buckets kD = 64, 128, 256 (columns past D zero-filled, never stored). The dK / dV
// accumulators of 16 rows take kD / 4 + kD / 4 floats a lane (dQ: kD / 4): at kD = 256 two warps
// share 16 owned rows (kSplit = 2), each accumulating one half of the head dim. The dK dV kernel
// (and so the one-kernel backward) splits S^T and dP^T the same way, each warp multiplying its
// half of the head dim, the pair adding its partial sums through shared memory (one barrier a
// tile); the dQ kernel has both warps compute the full S and dP tiles (the mma work of those two
// products done twice; the price of staying under 255 registers without staging through shared
// memory).
//
// Masks exactly as the forward: causal bottom-right, key tiles (dQ) / query tiles (dK dV) no pair
// of which is visible are not visited, masks are evaluated per element only in tiles that need
// them. A hidden key has x = -inf: P = exp2(-inf - lse) = 0 (NaN in a NaN row, lse NaN, as the
// FMA kernel and the reference give for dV) and dS = 0 exactly. Rows with no visible key have
// lse = +inf: P = 0, zero gradients. Query rows past Sq are hidden in the dK dV kernel (they
// would add to dK / dV); in the dQ kernel they are never stored.
//
// Dropout: the forward's bits (attention's v3, philox.cuh: 16 x 32 tiles of head-row b H + h of
// the padded op's (p.Sq, p.Sk), a byte a probability, kept iff >= T8, scaled by 256 / (256 - T8)).
// The dQ kernel's S has the queries as the mma's M side, 16-aligned a warp, and key tiles at
// multiples of 32, so each lane makes its own elements' bits, one Philox call a 16 x 32 tile, in
// registers (FlashAttention-2's price). The dK dV kernel's S^T has the keys as M (a lane's elements
// are other lanes' calls) and, under causal, query tiles from n0 - (Sk - Sq): each streamed tile's
// keep bytes (a byte per query and 8-key group) are made into shared memory with its copies by
// ff_attn_dropout_keep_tile, the calls spread over the block.
#include "common.cuh"
#include "flash_mma.h"
#include "flash_tiles.cuh"
#include "mma.cuh"
#include "philox.cuh"

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * kFfWarpSize;
static_assert(kThreads == ff_flash::kThreads, "the shared tile helpers copy with 4 warps");
using ff_flash::LdOffsets;
using ff_flash::load_tile;
using ff_flash::pack2;
using ff_flash::SeqRows;
using ff_flash::head_row;
using ff_flash::seq_rows;
using ff_flash::swz;
constexpr float kLog2e = 1.4426950408889634f;

template <int kD>
struct Cfg {
  static_assert(kD == 64 || kD == 128 || kD == 256, "head-dim buckets are 64, 128, 256");
  static constexpr int kSplit = kD == 256 ? 2 : 1;   // warps sharing 16 owned rows
  static constexpr int kDW = kD / kSplit;            // head dims a warp accumulates
  static constexpr int kOwn = 16 * kWarps / kSplit;  // rows a block owns: 64, 64, 32
  static constexpr int kStream = kD == 64 ? 64 : 32; // rows a streamed tile
  static constexpr int kOwnElems = kOwn * kD, kStreamElems = kStream * kD;
  // the owned rows' A fragments (K, V in dK dV; Q, dO in dQ) held in registers across the
  // streamed tiles: 2 x kD / 16 x 4 registers a lane, room for them only at kD = 64 (32)
  static constexpr bool kKeepA = kD == 64;
  // dK dV: K, V; Q, dO (2 stages); lse, Dsum (2 x kStream fp32); keep (2 x kStream x kOwn / 8)
  static constexpr size_t kDkdvBase =
      (2 * kOwnElems + 4 * kStreamElems) * 2 + 2 * 2 * kStream * 4 + 2 * kStream * (kOwn / 8);
  // kSplit 2: the two warps of a key group each multiply half of the head dim for S^T and dP^T
  // (split-K) and exchange the partial sums: a slot a warp, its s and dp accumulators (2 x
  // kStream / 8 x 4 fp32 a lane), lane-major (16 KB at kD 256)
  static constexpr int kXchgSlot = kSplit == 2 ? 2 * (kStream / 8) * 4 * kFfWarpSize : 0;  // floats
  static constexpr size_t kDkdvSmem = kDkdvBase + size_t{kWarps} * kXchgSlot * 4;
  // dQ: Q, dO; K, V (2 stages); hidden-key words (2 x kStream / 32) (its dropout bits are the
  // lanes' own, in registers)
  static constexpr size_t kDqSmem = (2 * kOwnElems + 4 * kStreamElems) * 2 + 2 * (kStream / 32) * 4;
  // the one-kernel backward (every bucket): the dK dV kernel's plus dS^T (kOwn keys x kStream
  // queries, 16-bit; rows padded by 8 elements: 16-byte aligned for ldmatrix, 4 banks apart).
  // kSplit 2: each 16-key group's rows lie in the exchange slot of its dpart-1 warp (warp 2 kg + 1),
  // which only the rows' writer (warp 2 kg) reads: no extra memory (2 blocks an SM on H100 need
  // <= 115,712 B), no extra barrier. kDsGroup: elements from one 16-key group's rows to the next
  static constexpr bool kFusable = true;
  static constexpr int kDsPitch = kStream + 8;
  static constexpr int kDsGroup = kSplit == 2 ? 2 * kXchgSlot * 2 : 16 * kDsPitch;
  static constexpr size_t kFusedSmem = kSplit == 2 ? kDkdvSmem : kDkdvSmem + size_t{kOwn} * kDsPitch * 2;
  static_assert(kSplit == 1 || 16 * kDsPitch * 2 <= kXchgSlot * 4, "a group's dS^T rows fit in a slot");
  static_assert(kDkdvBase % 16 == 0, "dS^T's rows and the exchange slots start 16-byte aligned");
  static_assert(kDkdvSmem <= 166912 && kDqSmem <= 166912 && kFusedSmem <= 166912,
                "fits sm_80's opt-in maximum");
  static_assert(kDkdvSmem <= 233472 / 2 - 1024 && kFusedSmem <= 233472 / 2 - 1024,
                "2 blocks an SM on H100 (228 KB an SM, 1 KB reserved a block), as the registers allow");
  static_assert(kStream % 32 == 0 && kOwn % 16 == 0, "whole warps flag keys; 16-row mma tiles");
};

struct Params {
  const void* q;
  const void* k;
  const void* v;
  const void* dout;
  int64_t q_sb, q_sh, q_ss, k_sb, k_sh, k_ss, v_sb, v_sh, v_ss, do_sb, do_sh, do_ss;
  int64_t H, Sq, Sk, D, tiles;  // tiles: blocks a (b, h)
  int64_t kv_group;  // query head h reads k/v head h / kv_group; dK / dV are per query head
  int causal, dropout, pairs;   // pairs: gradients stored as 32-bit pairs (4-byte aligned rows)
  float scale, scale_log2, keep_scale;
  const bool* kpm;
  int64_t kpm_sb;
  const float* am;
  int64_t am_sb, am_sh, am_sq;  // the key stride is 1
  uint32_t threshold;
  uint64_t seed, offset;
  const int64_t* philox;  // device (seed, offset), read by fill_keep instead, or null
  const float* lse;  // the forward's, (b, h, i) at b lse_sb + h lse_sh + i (rows contiguous)
  float* delta;      // laid out as lse
  int64_t lse_sb, lse_sh;
  float* dq_acc;      // the one-kernel backward: fp32 dQ partial sums, (b H + h, query tile, kStream, kD)
  int32_t* dq_count;  // and a counter a (b H + h, query tile): the key blocks that have added
  const int32_t* cu_q;  // varlen: sequence b's rows from cu_q[b]; null for the padded op
  const int32_t* cu_k;
  int64_t total_q, total_k;
  void* dq;
  void* dk;
  void* dv;
  int64_t dq_sb, dq_sh, dq_ss, dk_sb, dk_sh, dk_ss, dv_sb, dv_sh, dv_ss;
};

// ---- this file's helpers

// keep[i (kCols / 8) + c], bit e: key k0 + 8 c + e kept for query q0 + i of (b, h) (0 past the
// sequence's Sq or Sk). The counters are the padded op's on (B, H, p.Sq, p.Sk) (varlen: the
// maxima), as the forward's. k0 is a multiple of 8. Every thread calls it.
template <int kRows, int kCols>
FF_DEVICE void fill_keep(uint8_t* keep, const Params& p, int64_t b, int64_t h, int q0, int k0,
                         int Sq, int Sk) {
  ff_attn_dropout_keep_tile<kRows, kCols, kThreads>(keep, p.seed, p.offset, p.philox, p.threshold, b, h, p.H, p.Sq,
                                                    p.Sk, q0, Sq, k0, Sk);
}

// Rows [row0, row0 + 16) x head dims [col0, col0 + 8 kDT) of a gradient from C-layout
// accumulators acc[d] (row g / g + 8, columns 8 d + 2 t, + 1) times mul; rows >= rows_valid and
// columns >= D are not stored.
template <typename T, int kDT>
FF_DEVICE void store_rows(void* base, int64_t stride, int row0, int rows_valid, int col0,
                          const float (&acc)[kDT][4], float mul, const Params& p) {
  const int lane = threadIdx.x % kFfWarpSize, g = lane / 4, t = lane % 4;
  uint16_t* const out = static_cast<uint16_t*>(base);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = row0 + g + 8 * r;
    if (row >= rows_valid) continue;
    uint16_t* const o = out + row * stride;
#pragma unroll
    for (int d = 0; d < kDT; ++d) {
      const int col = col0 + 8 * d + 2 * t;
      if (col >= p.D) continue;
      const uint32_t w = pack2(acc[d][2 * r] * mul, acc[d][2 * r + 1] * mul, static_cast<T*>(nullptr));
      if (p.pairs) {
        *reinterpret_cast<uint32_t*>(o + col) = w;  // D even: col + 1 < D too
      } else {
        o[col] = static_cast<uint16_t>(w & 0xFFFFu);
        if (col + 1 < p.D) o[col + 1] = static_cast<uint16_t>(w >> 16);
      }
    }
  }
}

// The ordered dQ accumulation's flag (a counter a query tile): thread 0 of key block n waits for
// it to reach n (acquire: key block n - 1's adds are then visible), and sets it to n + 1 (release)
// after every thread of its block has added and fenced. The harness runs blocks one at a time in
// blockIdx order: there the flag is already set, or never will be (its spin stops the launch).
FF_DEVICE void wait_count(const int32_t* count, int target) {
#ifdef FF_SIMT
  ff_simt::spin_until_at_least(count, target);
#else
  int v;
  do {
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(count) : "memory");
  } while (v < target);
#endif
}
FF_DEVICE void set_count(int32_t* count, int value) {
#ifdef FF_SIMT
  *count = value;
#else
  asm volatile("st.release.gpu.global.b32 [%0], %1;\n" ::"l"(count), "r"(value) : "memory");
#endif
}

// ------------------------------------------------------------------ Dsum = rowsum(dO * O)
template <typename T>
__global__ void __launch_bounds__(kThreads)
flash_bwd_delta_kernel(Params p, const void* out, int64_t o_sb, int64_t o_sh, int64_t o_ss,
                       int64_t rows) {
  const int warp = threadIdx.x / kFfWarpSize, lane = threadIdx.x % kFfWarpSize;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + warp;  // (b H + h) Sq + i
  if (row >= rows) return;  // whole warps, no barrier follows
  const int64_t i = row % p.Sq, bh = row / p.Sq, h = bh % p.H, b = bh / p.H;
  const SeqRows sq = seq_rows(p.cu_q, b, p.total_q, p.Sq);
  if (i >= sq.len) return;  // past a varlen sequence's end
  const int64_t r = sq.start + i;
  const T* const dor = static_cast<const T*>(p.dout) + b * p.do_sb + h * p.do_sh + r * p.do_ss;
  const T* const orow = static_cast<const T*>(out) + b * o_sb + h * o_sh + r * o_ss;
  float acc = 0.0f;
  for (int d = lane; d < p.D; d += kFfWarpSize) acc = fmaf(ff_to_float(dor[d]), ff_to_float(orow[d]), acc);
  acc = ff_warp_sum(acc);
  if (lane == 0) p.delta[b * p.lse_sb + h * p.lse_sh + r] = acc;
}

// ------------------------------------------------------------------ dK, dV (kFused: and dQ)
// kFused (the one-kernel backward, every bucket): each streamed tile's dS^T also goes to shared
// memory as 16-bit, and the block computes the tile's dQ partial dS K over its BN keys (4 warps:
// 16 queries x kD / kDq head dims each, in chunks of 32 head dims), added to p.dq_acc in
// key-block order (the tile's counter) and, by the last key block that sees the tile, written
// x scale in the dtype. Query tiles then
// start at multiples of BM (the accumulator's tiles). 5 products a tile: S^T, dP^T, dV, dK, dQ
// (at kD 256 too: each warp of a key group does S^T and dP^T over its half of the head dim, the
// pair exchanging the partial sums).
template <typename T, int kD, bool kAligned, bool kFused>
__global__ void __launch_bounds__(kThreads) flash_bwd_dkdv_kernel(Params p) {
  using C = Cfg<kD>;
  static_assert(!kFused || C::kFusable, "a bucket without the one-kernel backward");
  constexpr int BN = C::kOwn;     // keys a block
  constexpr int BM = C::kStream;  // queries a tile
  constexpr int kNT = BM / 8;     // n8 tiles of S^T (queries)
  constexpr int kQK = kD / 16;    // k16 steps over the head dim
  constexpr int kDT = C::kDW / 8; // n8 tiles of a warp's dK / dV
  constexpr int kPV = BM / 16;    // k16 steps over the queries
  constexpr int kKG = BN / 8;     // 8-key dropout groups a block
  FF_DYNAMIC_SMEM(uint16_t, smem);
  uint16_t* const ks = smem;
  uint16_t* const vs = ks + C::kOwnElems;
  uint16_t* const qs = vs + C::kOwnElems;            // 2 stages
  uint16_t* const dos = qs + 2 * C::kStreamElems;    // 2 stages
  float* const lse_s = reinterpret_cast<float*>(dos + 2 * C::kStreamElems);  // 2 x BM, natural log
  float* const dl_s = lse_s + 2 * BM;                                        // 2 x BM
  uint8_t* const keep_s = reinterpret_cast<uint8_t*>(dl_s + 2 * BM);         // 2 x BM x kKG
  // kSplit 2: the exchange slots (C::kXchgSlot floats a warp); kFused: dS^T, BN x kDsPitch (kSplit
  // 2: 16-key group kg's rows C::kDsGroup elements apart, in warp 2 kg + 1's slot)
  float* const xs = reinterpret_cast<float*>(keep_s + 2 * BM * kKG);
  uint16_t* const ds_s = C::kSplit == 2 ? reinterpret_cast<uint16_t*>(xs + C::kXchgSlot)
                                        : reinterpret_cast<uint16_t*>(keep_s + 2 * BM * kKG);
  constexpr int kQW = BM / 16;            // kFused: 16-query groups of a tile's dQ
  constexpr int kDq = kWarps / kQW;       // and head-dim parts (1 at kD 64, 2 at 128 and 256)
  constexpr int kDTq = kD / kDq / 8;      // n8 tiles of a warp's dQ partial
  static_assert(!kFused || kWarps % kQW == 0, "whole warps a 16-query group");

  const int64_t bh = blockIdx.x / p.tiles, h = bh % p.H, b = bh / p.H;
  const int n0 = static_cast<int>(blockIdx.x % p.tiles) * BN;
  // the sequence's rows; Sq and Sk below are its lengths, p.Sq and p.Sk the maxima
  const SeqRows sq = seq_rows(p.cu_q, b, p.total_q, p.Sq), sk = seq_rows(p.cu_k, b, p.total_k, p.Sk);
  const int Sq = sq.len, Sk = sk.len, D = static_cast<int>(p.D);
  const int shift = Sk - Sq;
  // causal: query i sees key n0 iff i >= n0 - shift; earlier queries see none of the block's keys
  // (rounded down to a multiple of 16, the dropout tiles' rows: each tile's keep bytes are then
  // whole 16 x 32 tiles, one Philox call per 16 decisions; kFused: of BM, the dQ accumulator's
  // tiles; the rows added are hidden by causal, so they add exact zeros)
  int i_begin = p.causal ? (kFused ? (n0 - shift) / BM * BM : (n0 - shift) & ~(kAttnDropRowsCu - 1)) : 0;
  if (i_begin < 0) i_begin = 0;
  if (kFused && n0 == 0) {
    // dQ rows no key block visits (causal, before key block 0's first tile; all when a varlen
    // sequence has no keys) are 0: key block 0 writes them (16-bit zero is all-zero bits)
    const int z_rows = Sk > 0 && i_begin < Sq ? i_begin : Sq;
    uint16_t* const dqz = static_cast<uint16_t*>(p.dq) + b * p.dq_sb + h * p.dq_sh + sq.start * p.dq_ss;
    for (int e = static_cast<int>(threadIdx.x); e < z_rows * D; e += kThreads) dqz[(e / D) * p.dq_ss + e % D] = 0;
  }
  if (n0 >= Sk) return;  // a varlen sequence shorter than the grid: the whole block, no barrier yet
  const int warp = threadIdx.x / kFfWarpSize, lane = threadIdx.x % kFfWarpSize;
  const int g = lane / 4, t = lane % 4, i8 = lane / 8;
  const int kg = warp / C::kSplit, dpart = warp % C::kSplit;  // 16-key group, head-dim part
  const int qgrp = warp / kDq, qpart = warp % kDq;              // kFused: the warp's dQ part
  const int nb = n0 / BN;                                       // key block index
  const int m_tiles = i_begin < Sq ? (Sq - i_begin + BM - 1) / BM : 0;

  const uint16_t* const qg = head_row(p.q, b, h, sq.start, p.q_sb, p.q_sh, p.q_ss);
  const uint16_t* const kgl = head_row(p.k, b, h / p.kv_group, sk.start, p.k_sb, p.k_sh, p.k_ss);
  const uint16_t* const vg = head_row(p.v, b, h / p.kv_group, sk.start, p.v_sb, p.v_sh, p.v_ss);
  const uint16_t* const dog = head_row(p.dout, b, h, sq.start, p.do_sb, p.do_sh, p.do_ss);
  const float* const lse_g = p.lse + b * p.lse_sb + h * p.lse_sh + sq.start;
  const float* const dl_g = p.delta + b * p.lse_sb + h * p.lse_sh + sq.start;

  // the lane's keys (rows g, g + 8 of its warp's 16) and whether a mask other than causal / am
  // leaves them visible
  const int key_r[2] = {n0 + 16 * kg + g, n0 + 16 * kg + g + 8};
  bool key_ok[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    key_ok[r] = key_r[r] < Sk && !(p.kpm != nullptr && p.kpm[b * p.kpm_sb + key_r[r]]);
  }
  const float* const am_bh = p.am != nullptr ? p.am + b * p.am_sb + h * p.am_sh : nullptr;

  // ldmatrix offsets: A (K or V rows 16 kg + lane % 16, parity lane / 16), B^T (Q or dO rows
  // 8 (i / 2) + lane % 8 of a 16-query pair of n8 tiles, parity i % 2), B k-major for .trans
  // (Q or dO rows 8 (i % 2) + lane % 8 of a k16 step, parity i / 2)
  const LdOffsets<kD> a_at(lane % 16, lane / 16);
  const LdOffsets<kD> b_at(8 * (i8 / 2) + lane % 8, i8 % 2);
  const LdOffsets<kD> t_at(8 * (i8 % 2) + lane % 8, i8 / 2);

  // kFused: the dQ phase needs the registers of the kept K, V fragments (ptxas spilled 44-104 B
  // at kD 64 with them)
  constexpr bool kKeepA = C::kKeepA && !kFused;
  constexpr int kKeptA = kKeepA ? kQK : 1;
  uint32_t kf[kKeptA][4], vf[kKeptA][4];  // kKeepA: the warp's K, V A fragments, all tiles
  float dk[kDT][4], dv[kDT][4];
#pragma unroll
  for (int d = 0; d < kDT; ++d) {
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[d][e] = dv[d][e] = 0.0f;
  }

  auto load_q = [&](int tile, int stage) {
    const int i0 = i_begin + tile * BM;
    load_tile<kD, BM, kAligned>(qs + stage * C::kStreamElems, qg + i0 * p.q_ss, p.q_ss, Sq - i0, D);
    load_tile<kD, BM, kAligned>(dos + stage * C::kStreamElems, dog + i0 * p.do_ss, p.do_ss, Sq - i0, D);
    // lse and Dsum by cp.async with the tile (a thread a value; no load waited on here). Rows
    // past Sq get 0: they are hidden (need_mask holds for a tile that reaches past Sq)
    if (static_cast<int>(threadIdx.x) < 2 * BM) {
      const int e = static_cast<int>(threadIdx.x) % BM;
      const bool is_dl = static_cast<int>(threadIdx.x) >= BM, in = i0 + e < Sq;
      ff_cp_async_4_zfill((is_dl ? dl_s : lse_s) + stage * BM + e, (is_dl ? dl_g : lse_g) + (in ? i0 + e : 0),
                          in ? 4 : 0);
    }
    if (p.dropout) fill_keep<BM, BN>(keep_s + stage * BM * kKG, p, b, h, i0, n0, Sq, Sk);
    ff_cp_async_commit();
  };

  if (m_tiles > 0) {
    load_tile<kD, BN, kAligned>(ks, kgl + n0 * p.k_ss, p.k_ss, Sk - n0, D);
    load_tile<kD, BN, kAligned>(vs, vg + n0 * p.v_ss, p.v_ss, Sk - n0, D);
    load_q(0, 0);  // K, V and query tile 0: one group
  }

  for (int it = 0; it < m_tiles; ++it) {
    const int stage = it & 1, i0 = i_begin + it * BM;
    if (it + 1 < m_tiles) {
      load_q(it + 1, stage ^ 1);  // its stage was released by the barrier ending tile it - 1
    } else {
      ff_cp_async_commit();  // empty: wait_group 1 still means "tile it"
    }
    ff_cp_async_wait<1>();
    __syncthreads();  // every thread's copies, lse / Dsum and keep bytes of tile it are visible
    const uint16_t* const qt = qs + stage * C::kStreamElems;
    const uint16_t* const dot = dos + stage * C::kStreamElems;

    // ---- S^T = K Q^T, dP^T = V dO^T (16 keys x BM queries a warp)
    float s[kNT][4], dp[kNT][4];
#pragma unroll
    for (int j = 0; j < kNT; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) s[j][e] = dp[j][e] = 0.0f;
    }
    if (kKeepA && it == 0) {  // K and V came with query tile 0
#pragma unroll
      for (int kk = 0; kk < kQK; ++kk) {
        ff_ldmatrix_x4(kf[kk], ks + a_at(kk, 16 * kg));
        ff_ldmatrix_x4(vf[kk], vs + a_at(kk, 16 * kg));
      }
    }
    // kSplit 2: this warp's half of the head dim only (k16 steps kk0 ..), the partner's half below
    // (kk0 + k2 rather than a pointer offset for the half: with the offset ptxas spilled 8 B in
    // the sm_80 plain-load one kernel)
    const int kk0 = dpart * (kQK / C::kSplit);
#pragma unroll
    for (int k2 = 0; k2 < kQK / C::kSplit; ++k2) {
      const int kk = kk0 + k2;
      uint32_t ak[4], av[4];
      if (kKeepA) {
#pragma unroll
        for (int e = 0; e < 4; ++e) ak[e] = kf[kk % kKeptA][e], av[e] = vf[kk % kKeptA][e];
      } else {
        ff_ldmatrix_x4(ak, ks + a_at(kk, 16 * kg));
        ff_ldmatrix_x4(av, vs + a_at(kk, 16 * kg));
      }
#pragma unroll
      for (int jp = 0; jp < kNT / 2; ++jp) {
        uint32_t bf[4];
        ff_ldmatrix_x4(bf, qt + b_at(kk, 16 * jp));
        const uint32_t b0[2] = {bf[0], bf[1]}, b1[2] = {bf[2], bf[3]};
        ff_mma_m16n8k16<T>(s[2 * jp], ak, b0);
        ff_mma_m16n8k16<T>(s[2 * jp + 1], ak, b1);
        ff_ldmatrix_x4(bf, dot + b_at(kk, 16 * jp));
        const uint32_t d0[2] = {bf[0], bf[1]}, d1[2] = {bf[2], bf[3]};
        ff_mma_m16n8k16<T>(dp[2 * jp], av, d0);
        ff_mma_m16n8k16<T>(dp[2 * jp + 1], av, d1);
      }
    }
    if constexpr (C::kSplit == 2) {
      // the pair's exchange: each warp's partial sums to its slot (float2 a lane, lane-major: a
      // store or load instruction covers 256 consecutive bytes, no bank conflict; with float4
      // ptxas spilled 8 B in the sm_80 plain-load one kernel), then its partner's (warp ^ 1)
      // added. own + partner here, partner + own there: fp32 addition commutes, so both warps
      // hold the same S^T and dP^T, bit for bit. The slots are rewritten next tile only after
      // this tile's last barrier, when the partner has read them
      float2* const mine = reinterpret_cast<float2*>(xs + warp * C::kXchgSlot) + lane;
      const float2* const theirs = reinterpret_cast<const float2*>(xs + (warp ^ 1) * C::kXchgSlot) + lane;
#pragma unroll
      for (int j = 0; j < kNT; ++j) {
        mine[(2 * j) * kFfWarpSize] = make_float2(s[j][0], s[j][1]);
        mine[(2 * j + 1) * kFfWarpSize] = make_float2(s[j][2], s[j][3]);
        mine[(2 * kNT + 2 * j) * kFfWarpSize] = make_float2(dp[j][0], dp[j][1]);
        mine[(2 * kNT + 2 * j + 1) * kFfWarpSize] = make_float2(dp[j][2], dp[j][3]);
      }
      __syncthreads();  // the partners' partial sums are in
#pragma unroll
      for (int j = 0; j < kNT; ++j) {
        const float2 o = theirs[(2 * j) * kFfWarpSize], o2 = theirs[(2 * j + 1) * kFfWarpSize];
        const float2 od = theirs[(2 * kNT + 2 * j) * kFfWarpSize];
        const float2 od2 = theirs[(2 * kNT + 2 * j + 1) * kFfWarpSize];
        s[j][0] += o.x, s[j][1] += o.y, s[j][2] += o2.x, s[j][3] += o2.y;
        dp[j][0] += od.x, dp[j][1] += od.y, dp[j][2] += od2.x, dp[j][3] += od2.y;
      }
      // kFused: warp 2 kg's dS^T rows overwrite the slot it has just read; its other lanes first
      if constexpr (kFused) __syncwarp();
    }

    // ---- masks, P z (into s) and dS (into dp)
    const bool need_mask = p.kpm != nullptr || p.am != nullptr || n0 + BN > Sk || i0 + BM > Sq ||
                           (p.causal && n0 + BN - 1 > i0 + shift);  // block-uniform
#pragma unroll
    for (int j = 0; j < kNT; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int il = 8 * j + 2 * t + e, i = i0 + il;
        const float nlse2 = lse_s[stage * BM + il] * -kLog2e, dl = dl_s[stage * BM + il];
        uint32_t kb = 0u;
        if (p.dropout) kb = keep_s[stage * BM * kKG + il * kKG + 2 * kg];  // keys 16 kg .. + 7
        uint32_t kb8 = 0u;
        if (p.dropout) kb8 = keep_s[stage * BM * kKG + il * kKG + 2 * kg + 1];  // + 8 .. + 15
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          float x = s[j][2 * r + e] * p.scale_log2;
          if (need_mask) {
            bool vis = key_ok[r] && i < Sq && (!p.causal || key_r[r] <= i + shift);
            if (vis && am_bh != nullptr) {
              const float add = am_bh[static_cast<int64_t>(i) * p.am_sq + key_r[r]];
              vis = add != -INFINITY;
              x = fmaf(add, kLog2e, x);
            }
            if (!vis) x = -INFINITY;
          }
          const float pr = exp2f(x + nlse2);  // hidden: 0 (NaN in a NaN row); no visible key: 0
          float z = 1.0f;
          if (p.dropout) z = (((r ? kb8 : kb) >> g) & 1u) ? p.keep_scale : 0.0f;
          s[j][2 * r + e] = pr * z;
          dp[j][2 * r + e] = x == -INFINITY ? 0.0f : pr * (dp[j][2 * r + e] * z - dl);
        }
      }
    }

    // ---- dV += (P z)^T dO, dK += dS^T Q (A from the accumulators, B k-major via .trans)
#pragma unroll
    for (int kk = 0; kk < kPV; ++kk) {
      const uint32_t pa[4] = {pack2(s[2 * kk][0], s[2 * kk][1], static_cast<T*>(nullptr)),
                              pack2(s[2 * kk][2], s[2 * kk][3], static_cast<T*>(nullptr)),
                              pack2(s[2 * kk + 1][0], s[2 * kk + 1][1], static_cast<T*>(nullptr)),
                              pack2(s[2 * kk + 1][2], s[2 * kk + 1][3], static_cast<T*>(nullptr))};
      const uint32_t da[4] = {pack2(dp[2 * kk][0], dp[2 * kk][1], static_cast<T*>(nullptr)),
                              pack2(dp[2 * kk][2], dp[2 * kk][3], static_cast<T*>(nullptr)),
                              pack2(dp[2 * kk + 1][0], dp[2 * kk + 1][1], static_cast<T*>(nullptr)),
                              pack2(dp[2 * kk + 1][2], dp[2 * kk + 1][3], static_cast<T*>(nullptr))};
      if (kFused && dpart == 0) {
        // dS^T (keys x queries) to shared memory for dQ: these words, keys 16 kg + g (+ 8),
        // queries 16 kk + 2 t (+ 8) (kSplit 2: both warps of the key group hold the same; one writes)
        uint16_t* d0;
        if constexpr (C::kSplit == 2) {
          d0 = ds_s + kg * C::kDsGroup + g * C::kDsPitch + 16 * kk + 2 * t;
        } else {
          d0 = ds_s + (16 * kg + g) * C::kDsPitch + 16 * kk + 2 * t;
        }
        *reinterpret_cast<uint32_t*>(d0) = da[0];
        *reinterpret_cast<uint32_t*>(d0 + 8 * C::kDsPitch) = da[1];
        *reinterpret_cast<uint32_t*>(d0 + 8) = da[2];
        *reinterpret_cast<uint32_t*>(d0 + 8 * C::kDsPitch + 8) = da[3];
      }
#pragma unroll
      for (int dd = 0; dd < kDT / 2; ++dd) {
        const int c = dpart * (kDT / 2) + dd;  // 16-column pair of the full head dim
        uint32_t bf[4];
        ff_ldmatrix_x4_trans(bf, dot + t_at(c, 16 * kk));
        const uint32_t b0[2] = {bf[0], bf[1]}, b1[2] = {bf[2], bf[3]};
        ff_mma_m16n8k16<T>(dv[2 * dd], pa, b0);
        ff_mma_m16n8k16<T>(dv[2 * dd + 1], pa, b1);
        ff_ldmatrix_x4_trans(bf, qt + t_at(c, 16 * kk));
        const uint32_t q0[2] = {bf[0], bf[1]}, q1[2] = {bf[2], bf[3]};
        ff_mma_m16n8k16<T>(dk[2 * dd], da, q0);
        ff_mma_m16n8k16<T>(dk[2 * dd + 1], da, q1);
      }
    }

    // ---- kFused: dQ_tile = dS K over the block's keys, added in key-block order
    int n_last = 0;  // the last key block that sees this query tile (kFused)
    int32_t* count = nullptr;
    if constexpr (kFused) {
      __syncthreads();  // every warp's dS^T rows are in
      // key blocks 0 .. n_last see the tile (causal: a prefix, as key n0 is seen by queries
      // >= n0 - shift); this one (nb) adds after nb - 1: deterministic, one fixed order of adds
      const int q_last = (i0 + BM < Sq ? i0 + BM : Sq) - 1;  // q_last + shift >= n0: see above
      n_last = (Sk - 1) / BN;
      if (p.causal && (q_last + shift) / BN < n_last) n_last = (q_last + shift) / BN;
      const int64_t qtiles = (p.Sq + BM - 1) / BM, tile = (b * p.H + h) * qtiles + i0 / BM;
      count = p.dq_count + tile;
      const int row0 = 16 * qgrp;
      // the lane's accumulator words: rows row0 + g (+ 8), head dims col0 + 8 d + 2 t (+ 1)
      float* const acc = p.dq_acc + tile * (BM * kD) + (row0 + g) * kD + 2 * t;  // tile: BM x kD
      // in chunks of the warp's head dims (kDH = 4 n8 tiles, 16 floats a lane: registers; 2 chunks
      // at kD 64 / 128, 4 at 256, where dK and dV hold 128 floats a lane throughout)
      constexpr int kDH = 4, kChunks = kDTq / kDH;
      static_assert(kDTq % kDH == 0, "whole chunks");
#pragma unroll
      for (int half = 0; half < kChunks; ++half) {
        const int col0 = qpart * (kD / kDq) + 8 * kDH * half;
        // dS (queries as M, keys as k) through ldmatrix .trans of dS^T: matrix i8 = 8-query half
        // i8 % 2 of 8-key half i8 / 2; K k-major through .trans as dK's Q
        float dqt[kDH][4];
#pragma unroll
        for (int d = 0; d < kDH; ++d) dqt[d][0] = dqt[d][1] = dqt[d][2] = dqt[d][3] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
          uint32_t a[4];
          if constexpr (C::kSplit == 2) {
            ff_ldmatrix_x4_trans(a, ds_s + kk * C::kDsGroup + (8 * (i8 / 2) + lane % 8) * C::kDsPitch + row0 +
                                        8 * (i8 % 2));
          } else {
            ff_ldmatrix_x4_trans(a, ds_s + (16 * kk + 8 * (i8 / 2) + lane % 8) * C::kDsPitch + row0 + 8 * (i8 % 2));
          }
#pragma unroll
          for (int dd = 0; dd < kDH / 2; ++dd) {
            uint32_t bf[4];
            ff_ldmatrix_x4_trans(bf, ks + t_at(col0 / 16 + dd, 16 * kk));
            const uint32_t b0[2] = {bf[0], bf[1]}, b1[2] = {bf[2], bf[3]};
            ff_mma_m16n8k16<T>(dqt[2 * dd], a, b0);
            ff_mma_m16n8k16<T>(dqt[2 * dd + 1], a, b1);
          }
        }
        if (nb > 0 && half == 0) {
          if (threadIdx.x == 0) wait_count(count, nb);
          __syncthreads();  // key block nb - 1's adds are visible to the whole block
        }
#pragma unroll
        for (int r = 0; r < 2; ++r) {
#pragma unroll
          for (int d = 0; d < kDH; ++d) {
            // .cg: past L1, which may hold this SM's earlier block's copy of the line
            float2* const at = reinterpret_cast<float2*>(acc + 8 * r * kD + col0 + 8 * d);
            if (nb > 0) {
              const float2 o = __ldcg(at);
              dqt[d][2 * r] = o.x + dqt[d][2 * r];
              dqt[d][2 * r + 1] = o.y + dqt[d][2 * r + 1];
            }
            if (nb < n_last) __stcg(at, make_float2(dqt[d][2 * r], dqt[d][2 * r + 1]));
          }
        }
        if (nb == n_last) {
          store_rows<T, kDH>(static_cast<uint16_t*>(p.dq) + b * p.dq_sb + h * p.dq_sh + sq.start * p.dq_ss,
                             p.dq_ss, i0 + row0, Sq, col0, dqt, p.scale, p);
        }
      }
      if (nb < n_last) __threadfence();  // the adds reach the GPU before the counter's release (below)
    }
    __syncthreads();  // every warp is done with this stage before tile it + 2 refills it
    if (kFused && nb < n_last && threadIdx.x == 0) set_count(count, nb + 1);
  }

  const int row0 = n0 + 16 * kg, col0 = dpart * C::kDW;
  store_rows<T, kDT>(static_cast<uint16_t*>(p.dk) + b * p.dk_sb + h * p.dk_sh + sk.start * p.dk_ss,
                     p.dk_ss, row0, Sk, col0, dk, p.scale, p);
  store_rows<T, kDT>(static_cast<uint16_t*>(p.dv) + b * p.dv_sb + h * p.dv_sh + sk.start * p.dv_ss,
                     p.dv_ss, row0, Sk, col0, dv, 1.0f, p);
}

// ------------------------------------------------------------------ dQ
// minBlocks 1: without it ptxas held the sm_90 build to 168 registers and spilled 8-16 bytes
template <typename T, int kD, bool kAligned>
__global__ void __launch_bounds__(kThreads, 1) flash_bwd_dq_kernel(Params p) {
  using C = Cfg<kD>;
  constexpr int BM = C::kOwn;     // queries a block
  constexpr int BN = C::kStream;  // keys a tile
  constexpr int kNT = BN / 8;
  constexpr int kQK = kD / 16;
  constexpr int kDT = C::kDW / 8;
  constexpr int kPV = BN / 16;
  FF_DYNAMIC_SMEM(uint16_t, smem);
  uint16_t* const qs = smem;
  uint16_t* const dos = qs + C::kOwnElems;
  uint16_t* const ks = dos + C::kOwnElems;          // 2 stages
  uint16_t* const vs = ks + 2 * C::kStreamElems;    // 2 stages
  uint32_t* const hid = reinterpret_cast<uint32_t*>(vs + 2 * C::kStreamElems);  // 2 x BN / 32

  const int64_t bh = blockIdx.x / p.tiles, h = bh % p.H, b = bh / p.H;
  // the last query tiles first: under causal they see the most keys
  const int m0 = static_cast<int>(p.tiles - 1 - blockIdx.x % p.tiles) * BM;
  const SeqRows sq = seq_rows(p.cu_q, b, p.total_q, p.Sq), sk = seq_rows(p.cu_k, b, p.total_k, p.Sk);
  const int Sq = sq.len, Sk = sk.len, D = static_cast<int>(p.D);
  if (m0 >= Sq) return;  // a varlen sequence shorter than the grid: the whole block, no barrier yet
  const int warp = threadIdx.x / kFfWarpSize, lane = threadIdx.x % kFfWarpSize;
  const int g = lane / 4, t = lane % 4, i8 = lane / 8;
  const int qg16 = warp / C::kSplit, dpart = warp % C::kSplit;
  const int shift = Sk - Sq;
  const int q_last = (m0 + BM < Sq ? m0 + BM : Sq) - 1;
  int n_end = Sk;
  if (p.causal && q_last + shift + 1 < n_end) n_end = q_last + shift + 1;
  const int n_tiles = n_end > 0 ? (n_end + BN - 1) / BN : 0;

  const uint16_t* const qg = head_row(p.q, b, h, sq.start, p.q_sb, p.q_sh, p.q_ss);
  const uint16_t* const kgl = head_row(p.k, b, h / p.kv_group, sk.start, p.k_sb, p.k_sh, p.k_ss);
  const uint16_t* const vg = head_row(p.v, b, h / p.kv_group, sk.start, p.v_sb, p.v_sh, p.v_ss);
  const uint16_t* const dog = head_row(p.dout, b, h, sq.start, p.do_sb, p.do_sh, p.do_ss);

  const int row_i[2] = {m0 + 16 * qg16 + g, m0 + 16 * qg16 + g + 8};
  float lse2[2], dl[2];
  const int64_t stat0 = b * p.lse_sb + h * p.lse_sh + sq.start;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const bool in = row_i[r] < Sq;
    lse2[r] = in ? p.lse[stat0 + row_i[r]] * kLog2e : INFINITY;
    dl[r] = in ? p.delta[stat0 + row_i[r]] : 0.0f;
  }
  // ldmatrix offsets: A (Q or dO rows 16 qg16 + lane % 16), B^T (K or V rows), B k-major (K, .trans)
  const LdOffsets<kD> a_at(lane % 16, lane / 16);
  const LdOffsets<kD> b_at(8 * (i8 / 2) + lane % 8, i8 % 2);
  const LdOffsets<kD> t_at(8 * (i8 % 2) + lane % 8, i8 / 2);

  constexpr int kKeptA = C::kKeepA ? kQK : 1;
  uint32_t qf[kKeptA][4], df[kKeptA][4];  // kKeepA: the warp's Q, dO A fragments, all tiles
  float dq[kDT][4];
#pragma unroll
  for (int d = 0; d < kDT; ++d) dq[d][0] = dq[d][1] = dq[d][2] = dq[d][3] = 0.0f;

  auto load_kv = [&](int tile, int stage) {
    const int n0 = tile * BN;
    load_tile<kD, BN, kAligned>(ks + stage * C::kStreamElems, kgl + n0 * p.k_ss, p.k_ss, Sk - n0, D);
    load_tile<kD, BN, kAligned>(vs + stage * C::kStreamElems, vg + n0 * p.v_ss, p.v_ss, Sk - n0, D);
    if (static_cast<int>(threadIdx.x) < BN) {  // warp-uniform
      const int key = n0 + static_cast<int>(threadIdx.x);
      const bool hidden = key >= Sk || (p.kpm != nullptr && p.kpm[b * p.kpm_sb + key]);
      const unsigned bits = __ballot_sync(kFfFullMask, hidden);
      if (lane == 0) hid[stage * (BN / 32) + warp] = bits;
    }
    ff_cp_async_commit();
  };

  if (n_tiles > 0) {
    load_tile<kD, BM, kAligned>(qs, qg + m0 * p.q_ss, p.q_ss, Sq - m0, D);
    load_tile<kD, BM, kAligned>(dos, dog + m0 * p.do_ss, p.do_ss, Sq - m0, D);
    load_kv(0, 0);  // Q, dO and key tile 0: one group
  }

  for (int it = 0; it < n_tiles; ++it) {
    const int stage = it & 1, n0 = it * BN;
    if (it + 1 < n_tiles) {
      load_kv(it + 1, stage ^ 1);
    } else {
      ff_cp_async_commit();
    }
    ff_cp_async_wait<1>();
    __syncthreads();
    const uint16_t* const kt = ks + stage * C::kStreamElems;
    const uint16_t* const vt = vs + stage * C::kStreamElems;

    // ---- S = Q K^T, dP = dO V^T (16 queries x BN keys a warp)
    float s[kNT][4], dp[kNT][4];
#pragma unroll
    for (int j = 0; j < kNT; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) s[j][e] = dp[j][e] = 0.0f;
    }
    if (C::kKeepA && it == 0) {  // Q and dO came with key tile 0
#pragma unroll
      for (int kk = 0; kk < kQK; ++kk) {
        ff_ldmatrix_x4(qf[kk], qs + a_at(kk, 16 * qg16));
        ff_ldmatrix_x4(df[kk], dos + a_at(kk, 16 * qg16));
      }
    }
#pragma unroll
    for (int kk = 0; kk < kQK; ++kk) {
      uint32_t aq[4], ad[4];
      if (C::kKeepA) {
#pragma unroll
        for (int e = 0; e < 4; ++e) aq[e] = qf[kk % kKeptA][e], ad[e] = df[kk % kKeptA][e];
      } else {
        ff_ldmatrix_x4(aq, qs + a_at(kk, 16 * qg16));
        ff_ldmatrix_x4(ad, dos + a_at(kk, 16 * qg16));
      }
#pragma unroll
      for (int jp = 0; jp < kNT / 2; ++jp) {
        uint32_t bf[4];
        ff_ldmatrix_x4(bf, kt + b_at(kk, 16 * jp));
        const uint32_t b0[2] = {bf[0], bf[1]}, b1[2] = {bf[2], bf[3]};
        ff_mma_m16n8k16<T>(s[2 * jp], aq, b0);
        ff_mma_m16n8k16<T>(s[2 * jp + 1], aq, b1);
        ff_ldmatrix_x4(bf, vt + b_at(kk, 16 * jp));
        const uint32_t d0[2] = {bf[0], bf[1]}, d1[2] = {bf[2], bf[3]};
        ff_mma_m16n8k16<T>(dp[2 * jp], ad, d0);
        ff_mma_m16n8k16<T>(dp[2 * jp + 1], ad, d1);
      }
    }

    // ---- dropout bits, the lane's own (v3): the warp's 16 queries are one 16-row tile block
    // (m0 + 16 qg16 a multiple of 16) and n0 a multiple of 32, so lane l's call of each 16 x 32
    // tile decides exactly the 16 elements it holds of S (bit 4 (j % 4) + 2 r + e of n8 tile j):
    // one call a lane and 32 keys, no shared memory, no barrier. Rows past Sq and keys past Sk get
    // bits too; they are never stored / hidden.
    uint32_t keep[kNT / 4] = {};
    if (p.dropout) {
      uint64_t key = p.seed, first = p.offset;
      ff_philox_resolve(p.philox, key, first);
      const int64_t QB = (p.Sq + kAttnDropRowsCu - 1) / kAttnDropRowsCu;
      const int64_t KB = (p.Sk + kAttnDropColsCu - 1) / kAttnDropColsCu;
#pragma unroll
      for (int c = 0; c < kNT / 4; ++c) {
        const uint64_t n = ff_attn_dropout_counter(first, b * p.H + h, (m0 + 16 * qg16) / kAttnDropRowsCu,
                                                   (n0 + 32 * c) / kAttnDropColsCu, QB, KB);
        keep[c] = ff_attn_dropout_keep16(key, n + static_cast<uint64_t>(lane), p.threshold);
      }
    }

    // ---- masks (as the forward), dS into dp
    const bool need_mask = p.kpm != nullptr || p.am != nullptr || n0 + BN > Sk ||
                           (p.causal && n0 + BN - 1 > m0 + shift);  // block-uniform
    uint32_t hw[BN / 32];
#pragma unroll
    for (int w = 0; w < BN / 32; ++w) hw[w] = hid[stage * (BN / 32) + w] >> (2 * t);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int lim = p.causal ? row_i[r] + shift - n0 : BN;
      const float* am_row = nullptr;
      if (p.am != nullptr && row_i[r] < Sq) {
        am_row = p.am + b * p.am_sb + h * p.am_sh + row_i[r] * p.am_sq + (n0 + 2 * t);
      }
#pragma unroll
      for (int j = 0; j < kNT; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float x = s[j][2 * r + e] * p.scale_log2;
          if (need_mask) {
            const int c = 8 * j + 2 * t + e;
            bool vis = !((hw[j / 4] >> (8 * (j % 4) + e)) & 1u) && c <= lim;
            if (vis && am_row != nullptr) {
              const float add = am_row[8 * j + e];
              vis = add != -INFINITY;
              x = fmaf(add, kLog2e, x);
            }
            if (!vis) x = -INFINITY;
          }
          const float pr = exp2f(x - lse2[r]);
          float z = 1.0f;
          if (p.dropout) z = ((keep[j / 4] >> (4 * (j % 4) + 2 * r + e)) & 1u) ? p.keep_scale : 0.0f;
          dp[j][2 * r + e] = x == -INFINITY ? 0.0f : pr * (dp[j][2 * r + e] * z - dl[r]);
        }
      }
    }

    // ---- dQ += dS K (A from the accumulators, K k-major via .trans)
#pragma unroll
    for (int kk = 0; kk < kPV; ++kk) {
      const uint32_t da[4] = {pack2(dp[2 * kk][0], dp[2 * kk][1], static_cast<T*>(nullptr)),
                              pack2(dp[2 * kk][2], dp[2 * kk][3], static_cast<T*>(nullptr)),
                              pack2(dp[2 * kk + 1][0], dp[2 * kk + 1][1], static_cast<T*>(nullptr)),
                              pack2(dp[2 * kk + 1][2], dp[2 * kk + 1][3], static_cast<T*>(nullptr))};
#pragma unroll
      for (int dd = 0; dd < kDT / 2; ++dd) {
        const int c = dpart * (kDT / 2) + dd;
        uint32_t bf[4];
        ff_ldmatrix_x4_trans(bf, kt + t_at(c, 16 * kk));
        const uint32_t b0[2] = {bf[0], bf[1]}, b1[2] = {bf[2], bf[3]};
        ff_mma_m16n8k16<T>(dq[2 * dd], da, b0);
        ff_mma_m16n8k16<T>(dq[2 * dd + 1], da, b1);
      }
    }
    __syncthreads();  // every warp is done with this stage before tile it + 2 refills it
  }

  store_rows<T, kDT>(static_cast<uint16_t*>(p.dq) + b * p.dq_sb + h * p.dq_sh + sq.start * p.dq_ss,
                     p.dq_ss, m0 + 16 * qg16, Sq, dpart * C::kDW, dq, p.scale, p);
}

bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }
bool aligned4(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 4 == 0; }

template <typename Kernel>
const char* launch_one(Kernel* kernel, size_t smem, int64_t blocks, void* stream, const Params& p) {
  if (smem > 48 * 1024 &&
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           static_cast<int>(smem)) != cudaSuccess) {
    return ff_last_error();
  }
  if (blocks == 0) return nullptr;
  FF_LAUNCH(kernel, dim3(static_cast<unsigned>(blocks)), dim3(kThreads), smem, stream, p);
  return ff_last_error();
}

template <typename T, int kD, bool kAligned>
const char* launch_bucket(Params p, int64_t B, void* stream) {
  using C = Cfg<kD>;
  p.tiles = (p.Sk + C::kOwn - 1) / C::kOwn;
  // the plain-load variant at kD 64 stays on two kernels: one-kernel, ptxas spilled 16 B on sm_90
  if constexpr (C::kFusable && (kAligned || kD != 64)) {
    // one kernel: blockIdx = (b H + h) tiles + key block, so key block n - 1 of a (b, h) is
    // launched before n, which waits on it (blocks are dispatched in index order, so the one
    // waited on is resident or done: progress, as FlashAttention-3's deterministic backward)
    if (p.dq_acc != nullptr && p.dq_count != nullptr) {
      return launch_one(&flash_bwd_dkdv_kernel<T, kD, kAligned, true>, C::kFusedSmem, p.tiles * B * p.H,
                        stream, p);
    }
  }
  if (const char* err = launch_one(&flash_bwd_dkdv_kernel<T, kD, kAligned, false>, C::kDkdvSmem,
                                   p.tiles * B * p.H, stream, p)) {
    return err;
  }
  p.tiles = (p.Sq + C::kOwn - 1) / C::kOwn;
  return launch_one(&flash_bwd_dq_kernel<T, kD, kAligned>, C::kDqSmem, p.tiles * B * p.H, stream, p);
}

template <typename T>
const char* launch_dtype(const FfFlashBwdArgs& a, Params& p, bool aligned, void* stream) {
  // Dsum first: both kernels read it
  const int64_t rows = a.f.B * a.f.H * a.f.Sq;
  if (rows > 0) {
    auto* kernel = &flash_bwd_delta_kernel<T>;
    FF_LAUNCH(kernel, dim3(static_cast<unsigned>((rows + kWarps - 1) / kWarps)), dim3(kThreads), 0,
              stream, p, a.out, a.o_sb, a.o_sh, a.o_ss, rows);
    if (const char* err = ff_last_error()) return err;
  }
  const int64_t B = a.f.B;
  if (a.f.D <= 64) {
    return aligned ? launch_bucket<T, 64, true>(p, B, stream) : launch_bucket<T, 64, false>(p, B, stream);
  }
  if (a.f.D <= 128) {
    return aligned ? launch_bucket<T, 128, true>(p, B, stream) : launch_bucket<T, 128, false>(p, B, stream);
  }
  return aligned ? launch_bucket<T, 256, true>(p, B, stream) : launch_bucket<T, 256, false>(p, B, stream);
}

// cp.async needs every row start 16-byte aligned (pointers, strides multiples of 8 elements)
bool rows_aligned16(const FfFlashBwdArgs& a) {
  const FfFlashFwdArgs& f = a.f;
  return aligned16(f.q) && aligned16(f.k) && aligned16(f.v) && aligned16(a.dout) &&
         (f.q_sb | f.q_sh | f.q_ss | f.k_sb | f.k_sh | f.k_ss | f.v_sb | f.v_sh | f.v_ss | a.do_sb |
          a.do_sh | a.do_ss) % 8 == 0;
}

// Whether the call runs the one-kernel backward (given its workspace): every head-dim bucket but
// the plain-load variant at D 64 (launch_bucket), queries and keys (Sk = 0: the dQ kernel writes
// dQ = 0). The workspace's size and the launch both ask this.
bool one_kernel(const FfFlashBwdArgs& a) {
  const FfFlashFwdArgs& f = a.f;
  if (f.D < 1 || f.D > 256 || f.B <= 0 || f.H <= 0 || f.Sq <= 0 || f.Sk <= 0) return false;
  return f.D > 64 || rows_aligned16(a);
}
}  // namespace

const char* flash_bwd_mma_why_not(const FfFlashFwdArgs& a) {
  if (a.dtype != 1 && a.dtype != 2) {
    return "flash_bwd_mma: dtype must be 1 (float16) or 2 (bfloat16): tensor cores take 16-bit inputs";
  }
  if (a.D < 1 || a.D > 256) return "flash_bwd_mma: head dim must be in [1, 256]";
  if (a.B < 0 || a.H < 0 || a.Sq < 0 || a.Sk < 0) return "flash_bwd_mma: negative size";
  if (!(a.dropout_p >= 0.0 && a.dropout_p < 1.0)) return "flash_bwd_mma: dropout_p must be in [0, 1)";
  if (a.am != nullptr && a.am_sk != 1) {
    return "flash_bwd_mma: attn_mask needs a unit key stride (am_sk == 1): make its last dim contiguous";
  }
  if (a.Sq >= (int64_t{1} << 30) || a.Sk >= (int64_t{1} << 30)) {
    return "flash_bwd_mma: Sq and Sk must be below 2^30";  // the kernels' 32-bit row arithmetic
  }
  if ((a.lse_sb | a.lse_sh | a.lse_ss) != 0 && a.lse_ss != 1) {
    return "flash_bwd_mma: lse (and delta) rows must be contiguous (lse_ss == 1)";
  }
  if ((a.cu_seqlens_q == nullptr) != (a.cu_seqlens_k == nullptr)) {
    return "flash_bwd_mma: cu_seqlens_q and cu_seqlens_k come together (varlen) or not at all";
  }
  if (a.rel_bias != nullptr) return "flash_bwd_mma: a relative position bias: the FMA kernels take it";
  if (a.cu_seqlens_q != nullptr && (a.kpm != nullptr || a.am != nullptr)) {
    return "flash_bwd_mma: varlen rows (cu_seqlens) take no key_padding_mask or attn_mask";
  }
#ifndef FF_SIMT
  int major = 0;
  if (const char* err = ff_flash::current_device_major(&major)) return err;
  if (major < 8) return "flash_bwd_mma: mma.sync bf16 / f16 and cp.async need sm_80 or newer";
#endif
  return nullptr;
}

void flash_bwd_mma_workspace(const FfFlashBwdArgs& a, int64_t* acc_floats, int64_t* counters) {
  *acc_floats = *counters = 0;
  if (!one_kernel(a)) return;  // the two-kernel backward needs none: nothing to allocate
  const int64_t kd = a.f.D <= 64 ? 64 : (a.f.D <= 128 ? 128 : 256);
  const int64_t bm = kd == 64 ? Cfg<64>::kStream : (kd == 128 ? Cfg<128>::kStream : Cfg<256>::kStream);
  *counters = a.f.B * a.f.H * ((a.f.Sq + bm - 1) / bm);
  *acc_floats = *counters * bm * kd;
}

const char* launch_flash_bwd_mma(const FfFlashBwdArgs& a, void* stream) {
  const FfFlashFwdArgs& f = a.f;
  if (const char* why = flash_bwd_mma_why_not(f)) return why;
  if (f.B == 0 || f.H == 0) return nullptr;  // Sq = 0 still writes dK = dV = 0 (Sk = 0: dQ = 0)
  // blocks: ceil(S / 32) * B * H at most (a block owns 32 or 64 rows; Dsum's 4 rows a block)
  const int64_t limit = (int64_t{1} << 31) - 1;
  const int64_t tiles = ((f.Sq > f.Sk ? f.Sq : f.Sk) + 31) / 32;
  if (tiles > limit / f.B || tiles * f.B > limit / f.H || f.Sq > limit / f.B / f.H) {
    return "flash_bwd_mma: ceil(max(Sq, Sk) / 32) * B * H blocks exceed the grid's 2^31 - 1";
  }
  const bool aligned = rows_aligned16(a);
  Params p{};
  p.q = f.q;
  p.k = f.k;
  p.v = f.v;
  p.dout = a.dout;
  p.q_sb = f.q_sb, p.q_sh = f.q_sh, p.q_ss = f.q_ss;
  p.k_sb = f.k_sb, p.k_sh = f.k_sh, p.k_ss = f.k_ss;
  p.v_sb = f.v_sb, p.v_sh = f.v_sh, p.v_ss = f.v_ss;
  p.do_sb = a.do_sb, p.do_sh = a.do_sh, p.do_ss = a.do_ss;
  p.H = f.H;
  p.kv_group = f.kv_group;
  p.Sq = f.Sq;
  p.Sk = f.Sk;
  p.D = f.D;
  p.causal = f.causal ? 1 : 0;
  p.threshold = ff_attn_dropout_threshold(f.dropout_p);
  p.dropout = p.threshold != 0u ? 1 : 0;
  p.pairs = f.D % 2 == 0 && aligned4(a.dq) && aligned4(a.dk) && aligned4(a.dv) &&
                    (a.dq_sb | a.dq_sh | a.dq_ss | a.dk_sb | a.dk_sh | a.dk_ss | a.dv_sb | a.dv_sh |
                     a.dv_ss) % 2 == 0
                ? 1
                : 0;
  p.scale = static_cast<float>(f.scale);
  p.scale_log2 = static_cast<float>(f.scale * 1.4426950408889634);
  p.keep_scale = ff_attn_dropout_scale(f.dropout_p);
  p.kpm = f.kpm;
  p.kpm_sb = f.kpm_sb;
  p.am = f.am;
  p.am_sb = f.am_sb, p.am_sh = f.am_sh, p.am_sq = f.am_sq;
  p.seed = f.seed;
  p.offset = f.offset;
  p.philox = f.dropout_p > 0.0 ? f.philox : nullptr;
  p.lse = a.lse;
  p.delta = a.delta;
  // lse / delta strides: the forward's given ones (varlen: (H, total_q)), or (all 0) the padded
  // op's contiguous (B, H, Sq); rows contiguous either way
  const bool lse_given = (f.lse_sb | f.lse_sh | f.lse_ss) != 0;
  p.lse_sb = lse_given ? f.lse_sb : f.H * f.Sq;
  p.lse_sh = lse_given ? f.lse_sh : f.Sq;
  p.cu_q = f.cu_seqlens_q;
  p.cu_k = f.cu_seqlens_k;
  p.total_q = f.total_q;
  p.total_k = f.total_k;
  p.dq = a.dq;
  p.dk = a.dk;
  p.dv = a.dv;
  p.dq_sb = a.dq_sb, p.dq_sh = a.dq_sh, p.dq_ss = a.dq_ss;
  p.dk_sb = a.dk_sb, p.dk_sh = a.dk_sh, p.dk_ss = a.dk_ss;
  p.dv_sb = a.dv_sb, p.dv_sh = a.dv_sh, p.dv_ss = a.dv_ss;
  // the one-kernel backward where the call takes it and the glue gave its workspace
  // (flash_bwd_mma_workspace)
  const bool fused = a.dq_acc != nullptr && a.dq_count != nullptr && one_kernel(a);
  p.dq_acc = fused ? a.dq_acc : nullptr;
  p.dq_count = fused ? a.dq_count : nullptr;
  return f.dtype == 1 ? launch_dtype<__half>(a, p, aligned, stream)
                      : launch_dtype<__nv_bfloat16>(a, p, aligned, stream);
}
