// Attention forward on tensor cores: FlashAttention-2's algorithm with mma.sync m16n8k16 (bf16 /
// fp16 inputs, fp32 accumulation), or m16n8k8 .tf32 for fp32 inputs when torch allows tf32 (see
// ElemCfg below), ldmatrix and cp.async (the wrappers of mma.cuh, whose header
// gives the PTX fragment layouts used below). Launcher declared in flash_mma.h; the definitions are
// fastformer/ops/reference.py::attention and ::attention_varlen, whose glue (attention.cpp,
// attention_varlen.cpp) runs their 16-bit forwards here where flash_fwd_mma_why_not allows.
//
// Varlen: a block's (b, h, query tile) addresses sequence b's rows from cu_seqlens (clamped as
// attention.cu does); Sq / Sk in the kernel are that sequence's lengths (causal bottom-right per
// sequence), p.Sq / p.Sk the maxima that size the grid and number the dropout counters as the
// padded op's. A block whose query tile starts past its sequence exits before any barrier.
//
// Tiling (FlashAttention-2's shape). A block of kWarps = 4 warps owns kBlockM query rows of one
// (b, h), kWarpRows = 16 kMG a warp in kMG m16 row groups (warp w: rows m0 + kWarpRows w ..):
// kMG = 2 (32 rows a warp, kBlockM = 128) for the 16-bit buckets 64 and 128, so that every K and
// V fragment (one ldmatrix .x4) feeds 4 products; kMG = 1 (64 rows) for 256 (its 16 x 256 fp32
// output accumulator alone takes 128 registers a lane) and for tf32. It streams the keys in tiles
// of kBlockN rows (64 for the bucket 64, 32 for 128 on 32 rows a warp and for 256, 64 for tf32's
// 128) through shared memory: K and V tiles double-buffered
// (tile n + 1 is copied with cp.async while tile n is computed; wait_group 1 + __syncthreads
// before a tile is read, __syncthreads after, before its stage is refilled). The Q tile is copied
// once; in the 64 bucket each warp keeps its Q rows as mma A fragments in registers (loaded with
// ldmatrix once), in the others it re-reads them from shared memory each k-step.
//
// Per key tile and warp (lane = 4 g + t: groupID g, threadID_in_group t):
// (each row group mg of a warp as below: the arrays carry a leading [kMG]; a K or V fragment is
// loaded once for both groups)
//   S = Q K^T    16 x kBlockN fp32 in kBlockN / 8 accumulators s[j][4] (the C layout: s[j][0..1]
//                = row g, keys 8 j + 2 t, + 1; s[j][2..3] = row g + 8, the same keys). A = Q
//                (ldmatrix .x4 of the row-major tile), B = K^T "col": K's rows (key-major, head
//                dim contiguous) are B^T, read with plain ldmatrix .x4 (two n8 tiles x two k
//                halves a call).
//   softmax      in the log2 domain, FlashAttention-2's: each lane holds two rows (g, g + 8) and
//                2 kBlockN / 8 keys of each: the row max is its own max (of the raw scores in a
//                tile without masks) then __shfl_xor_sync over the quad (xor 1, 2). Running max m
//                (quad-uniform) and a lane-partial sum l (reduced over the quad once, at the end);
//                p = ex2.approx(s sl - m) in one FFMA and one MUFU.EX2 a score (sl = scale log2 e
//                on raw scores; 1 where the masked path scaled them already); one -inf guard a row
//                (m = -inf: subtract 0); the accumulator and l are rescaled by exp2(m_old - m_new).
//   O += P V     P stays in registers: the C fragments of two adjacent n8 score tiles are exactly
//                the A fragment of one k16 step (a[0] = s[2k][0..1], a[1] = s[2k][2..3], a[2] =
//                s[2k+1][0..1], a[3] = s[2k+1][2..3]), rounded to 16 bits; B = V, stored k-major
//                (key rows, head dim contiguous), read with ldmatrix .x4.trans. O: kD / 8
//                accumulators o[d][4] in the C layout (row g / g + 8, head-dim 8 d + 2 t, + 1).
//   end          out = O / l rounded to 16 bits, staged through the warp's own Q rows of shared
//                memory and stored as 16-byte row chunks; lse = (m + log2 l) ln 2 per row.
// No (Sq, Sk) buffer exists anywhere: a tile's scores live in registers only.
//
// Shared memory (dynamic, opt-in above 48 KiB): Q kBlockM x kD, K and V 2 x kBlockN x kD, 16-bit,
// and a bit per key of each stage (1 = hidden: past Sk or padded; a warp's __ballot_sync). Rows
// are swizzled in 16-byte chunks, chunk c of row r at chunk c ^ (r % 8), so the eight row
// addresses of an ldmatrix matrix (consecutive rows, one chunk column) fall in eight different
// bank groups (kD >= 64: at least 8 chunks a row); LdOffsets keeps those addresses in 4 registers
// per operand. 16-bit: kD 64 48 KiB, 128 64 KiB, 256 96 KiB (tf32: 40 / 80 / 96 KiB), + 8 or 16
// bytes of key bits: under sm_80's 163 KiB opt-in (static_assert). Registers (ptxas -v, CUDA 13,
// sm_80 / sm_90): 16-bit 64: 240-255, 128: 250-255, 256: 241-249; tf32: 128-185; no spill
// (tests/test_cuda_compile.py); 128 threads a block, 2 blocks (8 warps) an SM. Counts and the
// expected speed: flash_fwd_mma.md; tests/test_cuda_sass_fwd.py checks the instruction mix.
// Key padding: a thread's flag of key n0 + x is loaded a tile ahead of its __ballot_sync, so the
// byte load never holds the warp.
// Edges: rows past Sq / Sk and columns past D are zero-filled (cp.async src-size), never stored;
// zero V rows keep P = 0 at hidden keys from meeting garbage. Rows that are not 16-byte aligned
// (a D not a multiple of 8, an odd view) take plain loads into the same layout (kAligned false).
//
// Masks, as the reference: causal is bottom-right (key j visible to query i iff j <= i + Sk - Sq);
// key tiles no row of the block sees are not visited at all (so a NaN in V there reaches no row;
// in a visited tile it meets P = 0 and makes its column NaN in the rows that do not see it: the
// op's contract leaves that open); masks are evaluated per element only in tiles that need them
// (past Sk, a padding or additive mask, crossing the causal diagonal). A row with no visible key
// gives out 0 (a select, whatever V holds) and lse +inf; a NaN score at a visible key makes its
// row NaN (exp2 of NaN reaches l and O); a row whose visible scores are all -inf, or that has a
// +inf one, is NaN. "Visible" comes from the masks alone: a per-row flag, OR-ed over the quad at the end.
// The additive mask is added to the scaled score (scale s + am); am = -inf hides the key. Its key
// stride must be 1: a lane's 32 mask loads a tile then share one base address (immediate
// offsets); with per-element addresses ptxas kept ~60 more registers live.
//
// Relative position bias (T5's by distance, FfFlashFwdArgs::rel_bias; a kRel template flag, so the
// kernels without one are unchanged): every tile takes the masked path, where a key's score gains
// rel_bias[h, clamp(j - pos_i, -R, R) + R] log2 e (pos_i = i + Sk - Sq + rel_shift; after the
// attn_mask, as attention.cu). A tile's (row, key) pairs lie on kBlockM + BN - 1 diagonals of one
// distance each: the block writes that window of the bias to shared memory before the tile's
// barrier (kRelBytes more), and a lane reads it at one base a row plus immediate offsets (per-element
// global loads and clamps spilled at kD = 128). The backward of such a call runs the FMA kernels.
//
// Dropout (attention's v3, philox.cuh): the probabilities of head-row b H + h in 16 x 32 tiles of
// the padded op's (p.Sq, p.Sk) rows (varlen: the maxima), tile (qb, kb) making 32 Philox calls
// whose lane l decides the 16 elements lane l holds in an m16 x n32 accumulator slab. A warp's 16
// rows (m0 + 16 warp, a multiple of 16) and a 32-key chunk of the tile are one such tile: each
// lane makes its own call and tests its bits in registers (bit 4 (j % 4) + 2 hi + e of score
// s[j][2 hi + e]), kept iff the byte >= T8. l sums the kept and dropped probabilities alike; kept
// ones enter O unscaled and O is scaled by 256 / (256 - T8) once.
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
constexpr float kLn2 = 0.6931471805599453f;

// T: the element type (float: tf32, see ElemCfg), kD: the head-dim bucket in 16-bit halves.
template <typename T, int kD>
struct Cfg {
  static_assert(kD == 64 || kD == 128 || kD == 256, "head-dim buckets are 64, 128, 256");
  static constexpr bool kTf32 = std::is_same<T, float>::value;
  // m16 row groups a warp: 2 (FlashAttention-2's 32 rows, each K / V fragment feeding 4 products)
  // where the accumulators fit: the 16-bit buckets 64 and 128. 256: its 16 x 256 fp32 output alone
  // takes 128 registers a lane; tf32: its B fragments are plain loads, not the ldmatrix shared here
  static constexpr int kMG = kD <= 128 && !kTf32 ? 2 : 1;
  static constexpr int kWarpRows = 16 * kMG;
  static constexpr int kBlockM = kWarpRows * kWarps;   // query rows a block
  // keys a tile: 64, and 32 where the scores' registers are needed elsewhere: 256 (its output),
  // 128 on 32 rows a warp (2 x 64 output accumulators: 64 keys spilled), as FlashAttention-2's
  // 128 x 32 tiles at head dim 128
  static constexpr int kBlockN = kD == 64 || (kD == 128 && kMG == 1) ? 64 : 32;
  static constexpr int kChunks = kD / 8;               // 16-byte chunks a row
  // Q's fragments in registers: 32 a lane at most (64: 2 x 4 k-steps x 4); 128's 64 would not fit
  // beside its 2 x 64 output accumulators (tf32: the 128 bucket spilled)
  static constexpr bool kQInRegs = !kTf32 && kMG * kD <= 128;
  // __launch_bounds__'s minimum blocks an SM: 1 for tf32 (without it ptxas chose 128 registers
  // and spilled in the 64 bucket), none for 16-bit (with it the 128 bucket spilled on sm_90)
  static constexpr int kMinBlocks = kTf32 ? 1 : 0;
  static constexpr int kQElems = kBlockM * kD, kKVElems = kBlockN * kD;
  static constexpr size_t kSmemBytes = (kQElems + 4 * kKVElems) * 2 + 2 * (kBlockN / 32) * 4;
  static constexpr size_t kRelBytes = (kBlockM + kBlockN - 1) * 4;  // kRel: a tile's bias window
  static_assert(kSmemBytes + kRelBytes <= 166912, "a block's shared memory fits sm_80's opt-in maximum");
};


struct Params {
  const void* q;
  const void* k;
  const void* v;
  int64_t q_sb, q_sh, q_ss, k_sb, k_sh, k_ss, v_sb, v_sh, v_ss;
  int64_t H, Sq, Sk, D, m_tiles;
  int64_t kv_group;  // query head h reads k/v head h / kv_group (grouped-query attention)
  int causal, dropout, out_vec;  // out_vec: out rows take 16-byte stores (D % 8 == 0)
  float scale_log2, keep_scale;  // scale log2(e); 256 / (256 - T8)
  const bool* kpm;
  int64_t kpm_sb;
  const float* am;
  int64_t am_sb, am_sh, am_sq;  // the key stride is 1
  uint32_t threshold;       // dropout v3: T8 = round(256 p)
  int64_t drop_qb, drop_kb;  // its 16 x 32 tiles a head-row: ceil(p.Sq / 16) x ceil(p.Sk / 32)
  uint64_t seed, offset;
  const int64_t* philox;  // device (seed, offset), read per Philox call below instead, or null
  void* out;
  float* lse;
  int64_t out_sb, out_sh, out_ss, lse_sb, lse_sh, lse_ss;
  const int32_t* cu_q;  // varlen: sequence b's rows from cu_q[b]; null for the padded op
  const int32_t* cu_k;
  int64_t total_q, total_k;
  const float* rel;  // relative position bias (H, 2 rel_R + 1) by distance (kRel kernels), or null
  int64_t rel_R, rel_shift;
};

FF_DEVICE float bits_float(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}


// tf32 (T = float): fp32 rows are handled as rows of twice as many 16-bit halves (kD, D and every
// stride in halves, the launcher doubles them), so the tiles, swizzle, cp.async and ldmatrix of Q
// and K stay as they are: a 16-half k-step is an 8-float k-step of mma m16n8k8 .tf32, whose A and B
// fragments (a[0] = A[g][t], a[1] = A[g + 8][t], a[2] = A[g][t + 4], a[3] = A[g + 8][t + 4];
// b[0] = B[t][g], b[1] = B[t + 4][g]) are exactly what ldmatrix .x4 of the 8 x 4-float blocks
// gives (lane (g, t): row g, halves 2t, 2t + 1 = float t). Operands are rounded to tf32 (cvt.rna)
// as they enter the mma. P V runs its k8 steps over one n8 score tile each with the keys in the
// order 0, 2, 4, 6, 1, 3, 5, 7: lane (g, t) already holds P[g][2t], P[g][2t + 1], which are then
// A[g][t], A[g][t + 4] (no shuffle); V is read with the same order, by plain 32-bit loads (ldmatrix
// .trans would transpose halves). Output floats are staged in the Q tile as the halves are.
template <typename T>
struct ElemCfg {
  static constexpr bool kTf32 = std::is_same<T, float>::value;
  static constexpr int kHalves = kTf32 ? 2 : 1;  // 16-bit halves an element
};

// 2^x by the MUFU unit (ex2.approx.ftz: about 2 ulp, subnormal results flushed to 0; exp2(-inf) =
// 0, NaN stays NaN), as FlashAttention-2: the probabilities are rounded to 16 bits right after,
// and the tests hold the kernel to at most ~2x the 16-bit reference's error. The harness: exp2f.
FF_DEVICE float ex2_approx(float x) {
#if defined(__CUDA_ARCH__) && !defined(FF_SIMT)
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#else
  return exp2f(x);
#endif
}

template <typename T, int kD, bool kAligned, bool kRel>
// kMinBlocks: ptxas's register budget differs with it (see Cfg)
__global__ void __launch_bounds__(kThreads, (Cfg<T, kD>::kMinBlocks)) flash_fwd_mma_kernel(Params p) {
  using C = Cfg<T, kD>;
  constexpr bool kTf32 = C::kTf32;
  constexpr int BN = C::kBlockN;
  constexpr int kMG = C::kMG;              // m16 row groups a warp
  constexpr int kBlockM = C::kBlockM;
  constexpr int kNT = BN / 8;    // n8 score tiles a key tile
  constexpr int kDT = kD / 8 / ElemCfg<T>::kHalves;  // n8 output tiles (head-dim columns / 8)
  constexpr int kQK = kD / 16;   // k16 steps of Q K^T (tf32: k8 steps)
  constexpr int kPV = BN / 16;   // k16 steps of P V (16-bit)
  constexpr bool kQInRegs = C::kQInRegs;
  FF_DYNAMIC_SMEM(uint16_t, smem);
  uint16_t* const qs = smem;
  uint16_t* const ks = qs + C::kQElems;       // 2 stages
  uint16_t* const vs = ks + 2 * C::kKVElems;  // 2 stages
  uint32_t* const hid = reinterpret_cast<uint32_t*>(vs + 2 * C::kKVElems);  // 2 x BN / 32 words
  float* const rel_w = reinterpret_cast<float*>(hid + 2 * (BN / 32));  // kRel: kBlockM + BN - 1

  // sizes fit 32 bits (the launcher checks Sq, Sk < 2^30); addresses are 64-bit
  const int64_t bh = blockIdx.x / p.m_tiles, h = bh % p.H, b = bh / p.H;
  // the last query tiles first: under causal they see the most keys, so the longest blocks start
  // early and the short ones fill in behind them
  const int m0 = static_cast<int>(p.m_tiles - 1 - blockIdx.x % p.m_tiles) * kBlockM;
  // the sequence's rows (varlen) or the padded op's [0, Sq) and [0, Sk); Sq and Sk below are its
  // lengths, p.Sq and p.Sk the maxima (the grid, the dropout counters)
  const SeqRows sq = seq_rows(p.cu_q, b, p.total_q, p.Sq), sk = seq_rows(p.cu_k, b, p.total_k, p.Sk);
  const int Sq = sq.len, Sk = sk.len, D = static_cast<int>(p.D);
  if (m0 >= Sq) return;  // a varlen sequence shorter than the grid: the whole block, no barrier yet
  const int warp = threadIdx.x / kFfWarpSize, lane = threadIdx.x % kFfWarpSize;
  const int g = lane / 4, t = lane % 4;
  const int shift = Sk - Sq;
  // the keys any row of the block can see: [0, n_end)
  const int q_last = (m0 + kBlockM < Sq ? m0 + kBlockM : Sq) - 1;
  int n_end = Sk;
  if (p.causal && q_last + shift + 1 < n_end) n_end = q_last + shift + 1;
  const int n_tiles = n_end > 0 ? (n_end + BN - 1) / BN : 0;

  const uint16_t* const qg = head_row(p.q, b, h, sq.start, p.q_sb, p.q_sh, p.q_ss);
  const uint16_t* const kg = head_row(p.k, b, h / p.kv_group, sk.start, p.k_sb, p.k_sh, p.k_ss);
  const uint16_t* const vg = head_row(p.v, b, h / p.kv_group, sk.start, p.v_sb, p.v_sh, p.v_ss);

  // The warp's rows start at w0 (block row wr0); the lane's rows of group mg: the query of
  // accumulator half r is w0 + 16 mg + g + 8 r.
  const int wr0 = C::kWarpRows * warp, w0 = m0 + wr0;
  // ldmatrix offsets: Q (A: rows wr0 + lane % 16 (+ 16 mg), chunk parity lane / 16), K (B: key rows
  // 8 (i / 2) + lane % 8 of a 16-key pair of n8 tiles, parity i % 2), V (B, .trans: key rows
  // 8 (i % 2) + lane % 8 of a k16 step, parity i / 2), i = lane / 8 the matrix
  const int i8 = lane / 8;
  const LdOffsets<kD> q_at(wr0 + lane % 16, lane / 16);
  const LdOffsets<kD> k_at(8 * (i8 / 2) + lane % 8, i8 % 2);
  const LdOffsets<kD> v_at(8 * (i8 % 2) + lane % 8, i8 / 2);

  float o[kMG][kDT][4];
#pragma unroll
  for (int mg = 0; mg < kMG; ++mg) {
#pragma unroll
    for (int d = 0; d < kDT; ++d) o[mg][d][0] = o[mg][d][1] = o[mg][d][2] = o[mg][d][3] = 0.0f;
  }
  // m: the running row max in the log2 domain (quad-uniform), l: the lane's partial row sum
  float m[kMG][2], l[kMG][2];
  bool seen[kMG][2];
#pragma unroll
  for (int mg = 0; mg < kMG; ++mg) {
    m[mg][0] = m[mg][1] = -INFINITY;
    l[mg][0] = l[mg][1] = 0.0f;
    seen[mg][0] = seen[mg][1] = false;
  }
  uint32_t qf[kQInRegs ? kMG : 1][kQInRegs ? kQK : 1][4];

  // The key-padding flag of thread x < BN for key n0 + x, loaded a tile ahead of its ballot
  // (load_kv(n) ballots what the call for tile n - 1 loaded): the byte load's latency hides behind
  // a tile's products instead of holding the warp at the ballot.
  bool pad_next = false;
  auto kpm_at = [&](int tile) {
    const int key = tile * BN + static_cast<int>(threadIdx.x);
    return key < Sk && p.kpm[b * p.kpm_sb + key];
  };
  auto load_kv = [&](int tile, int stage) {
    const int n0 = tile * BN;
    load_tile<kD, BN, kAligned>(ks + stage * C::kKVElems, kg + n0 * p.k_ss, p.k_ss, Sk - n0, D);
    load_tile<kD, BN, kAligned>(vs + stage * C::kKVElems, vg + n0 * p.v_ss, p.v_ss, Sk - n0, D);
    static_assert(BN % kFfWarpSize == 0 && BN <= kThreads, "whole warps flag the keys");
    if (static_cast<int>(threadIdx.x) < BN) {  // warp-uniform
      const int key = n0 + static_cast<int>(threadIdx.x);
      bool hidden = key >= Sk;
      if (p.kpm != nullptr) {
        hidden = hidden || pad_next;
        if (tile + 1 < n_tiles) pad_next = kpm_at(tile + 1);
      }
      const unsigned bits = __ballot_sync(kFfFullMask, hidden);
      if (lane == 0) hid[stage * (BN / 32) + warp] = bits;
    }
    ff_cp_async_commit();
  };

  if (n_tiles > 0) {
    load_tile<kD, kBlockM, kAligned>(qs, qg + m0 * p.q_ss, p.q_ss, Sq - m0, D);
    ff_cp_async_commit();
    if (p.kpm != nullptr && static_cast<int>(threadIdx.x) < BN) pad_next = kpm_at(0);
    load_kv(0, 0);
    if constexpr (kQInRegs) {
      ff_cp_async_wait<1>();  // Q has landed (tile 0 may still be in flight)
      __syncthreads();        // every thread's chunks of it
#pragma unroll
      for (int mg = 0; mg < kMG; ++mg) {
#pragma unroll
        for (int kk = 0; kk < kQK; ++kk) ff_ldmatrix_x4(qf[mg][kk], qs + q_at(kk, 16 * mg));
      }
    }
  }

  for (int it = 0; it < n_tiles; ++it) {
    const int stage = it & 1, n0 = it * BN;
    if (it + 1 < n_tiles) {
      load_kv(it + 1, stage ^ 1);  // its stage was released by the barrier that ended tile it - 1
    } else {
      ff_cp_async_commit();  // an empty group: wait_group 1 below still means "tile it"
    }
    if constexpr (kRel) {
      // the tile's bias window (x log2 e): row m0 + i and key n0 + c at distance d0 + c - i +
      // kBlockM - 1 read rel_w[c - i + kBlockM - 1]; the barrier that ended tile it - 1 released it
      const int64_t R = p.rel_R, d0 = static_cast<int64_t>(n0) - m0 - shift - p.rel_shift - (kBlockM - 1);
      const float* rel_h = p.rel + h * (2 * R + 1) + R;
      for (int x = threadIdx.x; x < kBlockM + BN - 1; x += kThreads) {
        const int64_t d = d0 + x;
        rel_w[x] = rel_h[d < -R ? -R : (d > R ? R : d)] * kLog2e;
      }
    }
    ff_cp_async_wait<1>();
    __syncthreads();  // every thread's copies (and key flags) of tile it are visible
    const uint16_t* const kt = ks + stage * C::kKVElems;
    const uint16_t* const vt = vs + stage * C::kKVElems;

    // ---- S = Q K^T: each K fragment (ldmatrix .x4: two n8 tiles) feeds 2 kMG products
    float s[kMG][kNT][4];
#pragma unroll
    for (int mg = 0; mg < kMG; ++mg) {
#pragma unroll
      for (int j = 0; j < kNT; ++j) s[mg][j][0] = s[mg][j][1] = s[mg][j][2] = s[mg][j][3] = 0.0f;
    }
#pragma unroll
    for (int kk = 0; kk < kQK; ++kk) {
      uint32_t a[kMG][4];
#pragma unroll
      for (int mg = 0; mg < kMG; ++mg) {
        if constexpr (kQInRegs) {
#pragma unroll
          for (int r = 0; r < 4; ++r) a[mg][r] = qf[mg][kk][r];
        } else {
          ff_ldmatrix_x4(a[mg], qs + q_at(kk, 16 * mg));
        }
      }
#pragma unroll
      for (int jp = 0; jp < kNT / 2; ++jp) {
        // matrices: keys 16 jp + 8 (i / 2) .., head dims 16 kk + 8 (i % 2) .. -> n8 tiles 2 jp
        // (b[0], b[1]) and 2 jp + 1 (b[2], b[3])
        uint32_t bf[4];
        ff_ldmatrix_x4(bf, kt + k_at(kk, 16 * jp));
        const uint32_t b0[2] = {bf[0], bf[1]}, b1[2] = {bf[2], bf[3]};
#pragma unroll
        for (int mg = 0; mg < kMG; ++mg) {
          if constexpr (kTf32) {
            uint32_t at[4];
#pragma unroll
            for (int r = 0; r < 4; ++r) at[r] = ff_float_to_tf32(bits_float(a[mg][r]));
            const uint32_t t0[2] = {ff_float_to_tf32(bits_float(b0[0])),
                                    ff_float_to_tf32(bits_float(b0[1]))};
            const uint32_t t1[2] = {ff_float_to_tf32(bits_float(b1[0])),
                                    ff_float_to_tf32(bits_float(b1[1]))};
            ff_mma_m16n8k8_tf32(s[mg][2 * jp], at, t0, s[mg][2 * jp]);
            ff_mma_m16n8k8_tf32(s[mg][2 * jp + 1], at, t1, s[mg][2 * jp + 1]);
          } else {
            ff_mma_m16n8k16<T>(s[mg][2 * jp], a[mg], b0);
            ff_mma_m16n8k16<T>(s[mg][2 * jp + 1], a[mg], b1);
          }
        }
      }
    }

    // ---- masks (log2 domain), and the relative position bias. Unmasked tiles keep the raw
    // scores: the scale enters the exponent's FFMA below (sl = scale log2 e); masked ones are
    // scaled here (sl = 1). A negative scale takes the masked path (the max of raw scores would be
    // the wrong end).
    const bool need_mask = kRel || p.kpm != nullptr || p.am != nullptr || n0 + BN > Sk ||
                           p.scale_log2 < 0.0f ||
                           (p.causal && n0 + BN - 1 > m0 + shift);  // block-uniform
    const float sl = need_mask ? 1.0f : p.scale_log2;
    if (!need_mask) {
#pragma unroll
      for (int mg = 0; mg < kMG; ++mg) seen[mg][0] = seen[mg][1] = true;
    } else {
      // the hidden-key bits of this lane's keys 8 j + 2 t + e: bit 8 (j % 4) + e of hw[j / 4]
      uint32_t hw[BN / 32];
#pragma unroll
      for (int w = 0; w < BN / 32; ++w) hw[w] = hid[stage * (BN / 32) + w] >> (2 * t);
#pragma unroll
      for (int mg = 0; mg < kMG; ++mg) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int row = w0 + 16 * mg + g + 8 * r;
          // key n0 + c is causally visible to the row iff c <= lim
          const int lim = p.causal ? row + shift - n0 : BN;
          // the row's additive mask at key n0 + 2 t (unit key stride: one base, immediate offsets)
          const float* am_row = nullptr;
          if (p.am != nullptr && row < Sq) {
            am_row = p.am + b * p.am_sb + h * p.am_sh + row * p.am_sq + (n0 + 2 * t);
          }
          // kRel: the bias of key n0 + 8 j + 2 t + e at rel_row[8 j + e] (the tile's window, see above)
          [[maybe_unused]] const float* rel_row = rel_w + (kBlockM - 1 + 2 * t - (row - m0));
#pragma unroll
          for (int j = 0; j < kNT; ++j) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int c = 8 * j + 2 * t + e;
              bool vis = !((hw[j / 4] >> (8 * (j % 4) + e)) & 1u) && c <= lim;
              float x = s[mg][j][2 * r + e] * p.scale_log2;
              if (vis && am_row != nullptr) {
                const float add = am_row[8 * j + e];
                vis = add != -INFINITY;
                x = fmaf(add, kLog2e, x);
              }
              if constexpr (kRel) x += rel_row[8 * j + e];
              s[mg][j][2 * r + e] = vis ? x : -INFINITY;
              seen[mg][r] = seen[mg][r] || vis;
            }
          }
        }
      }
    }

    // ---- dropout keep bits (v3): the warp's 16 rows of group mg and a 32-key chunk of the tile
    // are one 16 x 32 dropout tile, whose lane-l Philox call makes exactly this lane's 16
    // decisions (bit 4 (j % 4) + 2 hi + e for s[mg][j][2 hi + e]): one call a lane, no exchange
    uint32_t keep[kMG][BN / 32];
    if (p.dropout) {
#pragma unroll
      for (int mg = 0; mg < kMG; ++mg) {
        const int r0 = w0 + 16 * mg;  // a multiple of 16: query block r0 / 16 of the padded rows
#pragma unroll
        for (int c = 0; c < BN / 32; ++c) {
          keep[mg][c] = 0xFFFFu;
          const int key = n0 + 32 * c;
          if (r0 < Sq && key < Sk) {
            // a device philox is read right here, per Philox call (two volatile loads, L1 hits):
            // the unrolled calls then keep no shared round keys live, as with p.seed, which
            // ptxas rematerialises from parameter space (read once before the loop: +39 registers
            // on sm_80 for D <= 64, and spills on sm_90)
            uint64_t rng_seed = p.seed, rng_offset = p.offset;
            ff_philox_resolve(p.philox, rng_seed, rng_offset);
            const uint64_t n = ff_attn_dropout_counter(rng_offset, bh, r0 / 16, key / 32, p.drop_qb, p.drop_kb);
            keep[mg][c] = ff_attn_dropout_keep16(rng_seed, n + static_cast<uint64_t>(lane), p.threshold);
          }
        }
      }
    }

    // ---- online softmax, FlashAttention-2's: per score one FMNMX, one FFMA (the scale and the
    // max folded in) and one MUFU.EX2; the -inf guard is per row
#pragma unroll
    for (int mg = 0; mg < kMG; ++mg) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float mt = fmaxf(s[mg][0][2 * r], s[mg][0][2 * r + 1]);
#pragma unroll
        for (int j = 1; j < kNT; ++j) mt = fmaxf(mt, fmaxf(s[mg][j][2 * r], s[mg][j][2 * r + 1]));
        // fmaxf drops NaN: a NaN score reaches l and O through the exponential below
        mt = fmaxf(mt, __shfl_xor_sync(kFfFullMask, mt, 1));
        mt = fmaxf(mt, __shfl_xor_sync(kFfFullMask, mt, 2));
        const float mn = fmaxf(m[mg][r], mt * sl);
        // every score so far hidden (-inf): subtract 0, so that exp2(-inf - -inf) is not NaN
        const float mb = mn == -INFINITY ? 0.0f : mn;
        const float alpha = ex2_approx(m[mg][r] - mb);  // m = -inf: 0
        m[mg][r] = mn;
        l[mg][r] *= alpha;
#pragma unroll
        for (int d = 0; d < kDT; ++d) {
          o[mg][d][2 * r] *= alpha;
          o[mg][d][2 * r + 1] *= alpha;
        }
#pragma unroll
        for (int j = 0; j < kNT; ++j) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float pe = ex2_approx(fmaf(s[mg][j][2 * r + e], sl, -mb));
            l[mg][r] += pe;
            s[mg][j][2 * r + e] = pe;
          }
        }
      }
    }
    if (p.dropout) {
#pragma unroll
      for (int mg = 0; mg < kMG; ++mg) {
#pragma unroll
        for (int j = 0; j < kNT; ++j) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            if (!((keep[mg][j / 4] >> (4 * (j % 4) + e)) & 1u)) s[mg][j][e] = 0.0f;
          }
        }
      }
    }

    // ---- O += P V, P's A fragments straight from the score accumulators
    if constexpr (kTf32) {
      static_assert(kMG == 1, "tf32 runs one row group a warp");
      // k8 step j: score tile j, keys in the order 0, 2, 4, 6, 1, 3, 5, 7 (see above)
#pragma unroll
      for (int j = 0; j < kNT; ++j) {
        const uint32_t pa[4] = {ff_float_to_tf32(s[0][j][0]), ff_float_to_tf32(s[0][j][2]),
                                ff_float_to_tf32(s[0][j][1]), ff_float_to_tf32(s[0][j][3])};
        // V's keys 8 j + 2 t and + 1 (rows), head-dim float 8 d + g: halves 2 (8 d + g) of the row
        const int k0 = 8 * j + 2 * t;
#pragma unroll
        for (int d = 0; d < kDT; ++d) {
          const int c = 8 * d + g;  // the float column
          const int off = ((c & 3) << 1);
          const uint32_t bv[2] = {
              ff_float_to_tf32(*reinterpret_cast<const float*>(vt + swz<kD>(k0, c >> 2) + off)),
              ff_float_to_tf32(*reinterpret_cast<const float*>(vt + swz<kD>(k0 + 1, c >> 2) + off))};
          ff_mma_m16n8k8_tf32(o[0][d], pa, bv, o[0][d]);
        }
      }
    } else {
#pragma unroll
      for (int kk = 0; kk < kPV; ++kk) {
        uint32_t pa[kMG][4];
#pragma unroll
        for (int mg = 0; mg < kMG; ++mg) {
          pa[mg][0] = pack2(s[mg][2 * kk][0], s[mg][2 * kk][1], static_cast<T*>(nullptr));
          pa[mg][1] = pack2(s[mg][2 * kk][2], s[mg][2 * kk][3], static_cast<T*>(nullptr));
          pa[mg][2] = pack2(s[mg][2 * kk + 1][0], s[mg][2 * kk + 1][1], static_cast<T*>(nullptr));
          pa[mg][3] = pack2(s[mg][2 * kk + 1][2], s[mg][2 * kk + 1][3], static_cast<T*>(nullptr));
        }
#pragma unroll
        for (int dp = 0; dp < kDT / 2; ++dp) {
          // matrices: keys 16 kk + 8 (i % 2) .., head dims 16 dp + 8 (i / 2) .. -> n8 tiles 2 dp
          // (b[0], b[1]) and 2 dp + 1 (b[2], b[3]); each fragment feeds 2 kMG products
          uint32_t bf[4];
          ff_ldmatrix_x4_trans(bf, vt + v_at(dp, 16 * kk));
          const uint32_t b0[2] = {bf[0], bf[1]}, b1[2] = {bf[2], bf[3]};
#pragma unroll
          for (int mg = 0; mg < kMG; ++mg) {
            ff_mma_m16n8k16<T>(o[mg][2 * dp], pa[mg], b0);
            ff_mma_m16n8k16<T>(o[mg][2 * dp + 1], pa[mg], b1);
          }
        }
      }
    }
    __syncthreads();  // every warp is done with this stage before tile it + 2's copies refill it
  }

  // ---- epilogue: the quad's partial sums and flags, out = O / l, lse
  // the sequence's first row read again rather than kept in registers through the key loop (the
  // 64 bucket's plain-load variant spilled on sm_80)
  const int64_t q_start = seq_rows(p.cu_q, b, p.total_q, p.Sq).start;
  float* const lse_row = p.lse + b * p.lse_sb + h * p.lse_sh + q_start * p.lse_ss;
  // The warp's own rows of the Q tile hold its output rows: no other warp reads them, and its
  // own last ldmatrix of them (a warp-collective) is behind it.
  uint16_t* const os = qs + wr0 * kD;
#pragma unroll
  for (int mg = 0; mg < kMG; ++mg) {
    float inv[2];
    bool sees[2];  // a visible key (by the masks): else out is 0 by a select (P = 0 times a NaN in V is NaN)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float lr = l[mg][r];
      lr += __shfl_xor_sync(kFfFullMask, lr, 1);
      lr += __shfl_xor_sync(kFfFullMask, lr, 2);
      int sr = seen[mg][r] ? 1 : 0;
      sr |= __shfl_xor_sync(kFfFullMask, sr, 1);
      sr |= __shfl_xor_sync(kFfFullMask, sr, 2);
      sees[r] = sr != 0;
      float row_lse;
      if (!sr) {
        inv[r] = 0.0f;
        row_lse = INFINITY;
      } else if (m[mg][r] == -INFINITY) {  // every visible score -inf: the reference's exp(s - max) is NaN
        inv[r] = NAN;
        row_lse = NAN;
      } else {
        inv[r] = (p.dropout ? p.keep_scale : 1.0f) / lr;
        row_lse = m[mg][r] * kLn2 + logf(lr);
      }
      const int row = w0 + 16 * mg + g + 8 * r;
      if (t == 0 && row < Sq) lse_row[row * p.lse_ss] = row_lse;
    }
#pragma unroll
    for (int d = 0; d < kDT; ++d) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = 16 * mg + g + 8 * r;  // (wr0 + row) % 8 == row % 8: the tile's swizzle
        const float lo = sees[r] ? o[mg][d][2 * r] * inv[r] : 0.0f;
        const float hi = sees[r] ? o[mg][d][2 * r + 1] * inv[r] : 0.0f;
        if constexpr (kTf32) {  // floats 8 d + 2 t, + 1: halves 16 d + 4 t .. + 3
          *reinterpret_cast<float2*>(os + swz<kD>(row, 2 * d + (t >> 1)) + 4 * (t & 1)) =
              make_float2(lo, hi);
        } else {
          *reinterpret_cast<uint32_t*>(os + swz<kD>(row, d) + 2 * t) =
              pack2(lo, hi, static_cast<T*>(nullptr));
        }
      }
    }
  }
  __syncwarp();
  uint16_t* const og = static_cast<uint16_t*>(p.out) + b * p.out_sb + h * p.out_sh +
                       (q_start + w0) * p.out_ss;
  constexpr int kChunks = C::kChunks;
  for (int c = lane; c < C::kWarpRows * kChunks; c += kFfWarpSize) {
    const int row = c / kChunks, col = 8 * (c % kChunks);
    if (w0 + row >= Sq || col >= D) continue;
    const uint16_t* src = os + swz<kD>(row, c % kChunks);
    uint16_t* dst = og + row * p.out_ss + col;
    if (p.out_vec) {
      *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
    } else {
      for (int e = 0; e < 8 && col + e < D; ++e) dst[e] = src[e];
    }
  }
}

bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

template <typename T, int kD, bool kAligned, bool kRel>
const char* launch(const FfFlashFwdArgs& a, Params p, void* stream) {
  using C = Cfg<T, kD>;
  p.m_tiles = (a.Sq + C::kBlockM - 1) / C::kBlockM;  // varlen: Sq = max_seqlen_q
  if (p.m_tiles == 0 || a.B == 0 || a.H == 0) return nullptr;
  const int64_t limit = (int64_t{1} << 31) - 1;
  if (p.m_tiles > limit / a.B || p.m_tiles * a.B > limit / a.H) {
    return "flash_fwd_mma: ceil(Sq / block rows) * B * H blocks exceed the grid's 2^31 - 1";
  }
  const int64_t blocks = p.m_tiles * a.B * a.H;
  const size_t smem = C::kSmemBytes + (kRel ? C::kRelBytes : 0);
  auto* flash_fwd_mma = &flash_fwd_mma_kernel<T, kD, kAligned, kRel>;
  if (smem > 48 * 1024 &&
      cudaFuncSetAttribute(flash_fwd_mma, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           static_cast<int>(smem)) != cudaSuccess) {
    return ff_last_error();
  }
  FF_LAUNCH(flash_fwd_mma, dim3(static_cast<unsigned>(blocks)), dim3(kThreads), smem, stream, p);
  return ff_last_error();
}

template <int kD>
const char* launch_bucket(const FfFlashFwdArgs& a, const Params& p, bool aligned, void* stream) {
  const auto pick = [&](auto* elem) {
    using T = std::remove_pointer_t<decltype(elem)>;
    if (p.rel != nullptr) {
      return aligned ? launch<T, kD, true, true>(a, p, stream) : launch<T, kD, false, true>(a, p, stream);
    }
    return aligned ? launch<T, kD, true, false>(a, p, stream) : launch<T, kD, false, false>(a, p, stream);
  };
  if (a.dtype == 0) return pick(static_cast<float*>(nullptr));
  if (a.dtype == 1) return pick(static_cast<__half*>(nullptr));
  return pick(static_cast<__nv_bfloat16*>(nullptr));
}

}  // namespace


const char* flash_fwd_mma_why_not(const FfFlashFwdArgs& a) {
  if (a.dtype == 0 && !a.allow_tf32) {
    return "flash_fwd_mma: float32 runs on tensor cores only as tf32, and allow_tf32 is false";
  }
  if (a.dtype != 0 && a.dtype != 1 && a.dtype != 2) {
    return "flash_fwd_mma: dtype must be 1 (float16), 2 (bfloat16) or 0 (float32 as tf32)";
  }
  if (a.D < 1 || a.D > 256) return "flash_fwd_mma: head dim must be in [1, 256]";
  if (a.dtype == 0 && a.D > 128) {
    return "flash_fwd_mma: tf32 takes head dims up to 128 (a 256-wide fp32 tile exceeds shared memory)";
  }
  if (a.B < 0 || a.H < 0 || a.Sq < 0 || a.Sk < 0) return "flash_fwd_mma: negative size";
  if (!(a.dropout_p >= 0.0 && a.dropout_p < 1.0)) return "flash_fwd_mma: dropout_p must be in [0, 1)";
  if (a.am != nullptr && a.am_sk != 1) {
    // one base address a row and immediate key offsets keep the mask's loads out of registers
    return "flash_fwd_mma: attn_mask needs a unit key stride (am_sk == 1): make its last dim contiguous";
  }
  if (a.Sq >= (int64_t{1} << 30) || a.Sk >= (int64_t{1} << 30)) {
    return "flash_fwd_mma: Sq and Sk must be below 2^30";  // the kernel's 32-bit row arithmetic
  }
  if ((a.cu_seqlens_q == nullptr) != (a.cu_seqlens_k == nullptr)) {
    return "flash_fwd_mma: cu_seqlens_q and cu_seqlens_k come together (varlen) or not at all";
  }
  if (a.cu_seqlens_q != nullptr && (a.kpm != nullptr || a.am != nullptr)) {
    return "flash_fwd_mma: varlen rows (cu_seqlens) take no key_padding_mask or attn_mask";
  }
#ifndef FF_SIMT
  int major = 0;
  if (const char* err = ff_flash::current_device_major(&major)) return err;
  if (major < 8) return "flash_fwd_mma: mma.sync bf16 / f16 and cp.async need sm_80 or newer";
#endif
  return nullptr;
}

const char* launch_flash_fwd_mma(const FfFlashFwdArgs& a, void* out, float* lse, void* stream) {
  if (const char* why = flash_fwd_mma_why_not(a)) return why;
  // the kernel counts in 16-bit halves: an fp32 (tf32) element is two, its D and strides double
  const int64_t w = a.dtype == 0 ? 2 : 1;
  // cp.async needs every row start 16-byte aligned: the pointers and all strides (in 2-byte
  // halves) multiples of 8; otherwise the kernel's plain-load variant runs
  const bool aligned = aligned16(a.q) && aligned16(a.k) && aligned16(a.v) &&
                       (w * (a.q_sb | a.q_sh | a.q_ss | a.k_sb | a.k_sh | a.k_ss | a.v_sb | a.v_sh |
                             a.v_ss)) % 8 == 0;
  Params p{};
  p.q = a.q;
  p.k = a.k;
  p.v = a.v;
  p.q_sb = w * a.q_sb;
  p.q_sh = w * a.q_sh;
  p.q_ss = w * a.q_ss;
  p.k_sb = w * a.k_sb;
  p.k_sh = w * a.k_sh;
  p.k_ss = w * a.k_ss;
  p.v_sb = w * a.v_sb;
  p.v_sh = w * a.v_sh;
  p.v_ss = w * a.v_ss;
  p.H = a.H;
  p.kv_group = a.kv_group;
  p.Sq = a.Sq;
  p.Sk = a.Sk;
  p.D = w * a.D;
  p.causal = a.causal ? 1 : 0;
  p.threshold = ff_attn_dropout_threshold(a.dropout_p);
  p.drop_qb = (a.Sq + kAttnDropRowsCu - 1) / kAttnDropRowsCu;
  p.drop_kb = (a.Sk + kAttnDropColsCu - 1) / kAttnDropColsCu;
  p.dropout = p.threshold != 0u ? 1 : 0;
  // out / lse strides: the given ones, or (all 0) the padded op's contiguous layout
  const bool out_given = (a.out_sb | a.out_sh | a.out_ss) != 0;
  p.out_sb = w * (out_given ? a.out_sb : a.H * a.Sq * a.D);
  p.out_sh = w * (out_given ? a.out_sh : a.Sq * a.D);
  p.out_ss = w * (out_given ? a.out_ss : a.D);
  const bool lse_given = (a.lse_sb | a.lse_sh | a.lse_ss) != 0;
  p.lse_sb = lse_given ? a.lse_sb : a.H * a.Sq;
  p.lse_sh = lse_given ? a.lse_sh : a.Sq;
  p.lse_ss = lse_given ? a.lse_ss : 1;
  p.cu_q = a.cu_seqlens_q;
  p.cu_k = a.cu_seqlens_k;
  p.total_q = a.total_q;
  p.total_k = a.total_k;
  p.out_vec = p.D % 8 == 0 && aligned16(out) && (p.out_sb | p.out_sh | p.out_ss) % 8 == 0 ? 1 : 0;
  p.scale_log2 = static_cast<float>(a.scale * 1.4426950408889634);
  p.keep_scale = ff_attn_dropout_scale(a.dropout_p);
  p.kpm = a.kpm;
  p.kpm_sb = a.kpm_sb;
  p.am = a.am;
  p.am_sb = a.am_sb;
  p.am_sh = a.am_sh;
  p.am_sq = a.am_sq;
  p.seed = a.seed;
  p.offset = a.offset;
  p.philox = a.dropout_p > 0.0 ? a.philox : nullptr;
  p.out = out;
  p.lse = lse;
  p.rel = a.rel_bias;
  p.rel_R = a.rel_R;
  p.rel_shift = a.rel_shift;
  if (p.D <= 64) return launch_bucket<64>(a, p, aligned, stream);
  if (p.D <= 128) return launch_bucket<128>(a, p, aligned, stream);
  return launch_bucket<256>(a, p, aligned, stream);
}
