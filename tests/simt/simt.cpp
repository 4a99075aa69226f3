// The SIMT harness's scheduler: each block's threads as cooperative fibers on the launching OS
// thread (see simt.h for what is modelled and what is not).
#include "simt.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#if !defined(__x86_64__) || defined(FF_SIMT_UCONTEXT)
#define FF_SIMT_USE_UCONTEXT 1
#include <ucontext.h>
#endif

// ---------------------------------------------------------------- context switch
#ifndef FF_SIMT_USE_UCONTEXT
// ff_simt_switch(save, to): saves the callee-saved registers, MXCSR and the x87 control word on
// the current stack, stores the stack pointer in *save, switches to the stack `to` (saved the same
// way, or prepared by prepare_stack) and restores from it.
extern "C" void ff_simt_switch(void** save, void* to);
__asm__(
    ".text\n"
    ".p2align 4\n"
    ".globl ff_simt_switch\n"
    ".hidden ff_simt_switch\n"
    ".type ff_simt_switch,@function\n"
    "ff_simt_switch:\n"
    "  pushq %rbp\n"
    "  pushq %rbx\n"
    "  pushq %r12\n"
    "  pushq %r13\n"
    "  pushq %r14\n"
    "  pushq %r15\n"
    "  subq $8, %rsp\n"
    "  stmxcsr (%rsp)\n"
    "  fnstcw 4(%rsp)\n"
    "  movq %rsp, (%rdi)\n"
    "  movq %rsi, %rsp\n"
    "  ldmxcsr (%rsp)\n"
    "  fldcw 4(%rsp)\n"
    "  addq $8, %rsp\n"
    "  popq %r15\n"
    "  popq %r14\n"
    "  popq %r13\n"
    "  popq %r12\n"
    "  popq %rbx\n"
    "  popq %rbp\n"
    "  ret\n"
    ".size ff_simt_switch, .-ff_simt_switch\n");
#endif

namespace ff_simt {
namespace {

constexpr int kMaxThreads = 1024;

enum class State : uint8_t { kReady, kBlock, kWarp, kDone };

// A cp.async whose group has not been waited for: the source bytes, read at issue.
struct PendingCopy {
  unsigned char* dst;
  int bytes;
  int group;  // the number of commit_group calls before it: its group's index
  unsigned char data[16];
};

struct Fiber {
#ifdef FF_SIMT_USE_UCONTEXT
  ucontext_t ctx;
#else
  void* sp = nullptr;
#endif
  State state = State::kReady;
  // the barrier or warp intrinsic this fiber waits at
  int op = 0;
  unsigned mask = 0;
  int param = 0;
  int width = 32;
  uint64_t value = 0;
  uint64_t result = 0;
  const char* name = nullptr;  // a warp-collective instruction's name (op kCollective)
  // cp.async: the copies not yet completed, and the number of groups committed so far
  std::vector<PendingCopy> pending;
  int committed = 0;
};

struct Launch {
  const char* name = "";
  void (*body)(void*) = nullptr;
  void* ctx = nullptr;
  int nthreads = 0;
  int current = -1;
  Fiber fibers[kMaxThreads];
#ifdef FF_SIMT_USE_UCONTEXT
  ucontext_t sched;
#else
  void* sched_sp = nullptr;
#endif
  int schedule = kForward;  // the launch's Schedule
  bool failed = false;
  std::string error;
  unsigned char* smem = nullptr;
  size_t smem_bytes = 0;
  uint3 block_index{0, 0, 0};
  uint32_t warp_scratch[kMaxThreads / 32][kWarpScratchWords];  // ff_simt::warp_scratch()
};

std::mutex g_launch_mutex;  // launches are serialised: the indices are plain globals
Launch* g_launch = nullptr;
// cudaFuncAttributeMaxDynamicSharedMemorySize per kernel function (guarded by g_launch_mutex);
// a kernel not in the map has the default limit.
std::map<const void*, size_t> g_smem_limit;
int g_schedule = -1;  // the Schedule of the next launch: -1 not decided yet (FF_SIMT_SCHEDULE)
std::string g_bad_schedule;  // an FF_SIMT_SCHEDULE value that names no schedule: launches fail
int g_sm_count = 4;  // the modelled device's SM count (set_sm_count)

constexpr const char* kScheduleNames[] = {"forward", "reverse", "warp_ahead", "warp_ahead_reverse"};

// The schedule of the next launch (FF_SIMT_SCHEDULE unless set_schedule said otherwise); -1 for
// an FF_SIMT_SCHEDULE that names none (g_bad_schedule holds it).
int current_schedule() {
  if (g_schedule < 0 && g_bad_schedule.empty()) {
    const char* env = std::getenv("FF_SIMT_SCHEDULE");
    g_schedule = kForward;
    if (env != nullptr && *env != '\0') {
      g_schedule = -1;
      for (int s = 0; s < 4; ++s) {
        if (std::strcmp(env, kScheduleNames[s]) == 0) g_schedule = s;
      }
      if (g_schedule < 0) g_bad_schedule = env;
    }
  }
  return g_schedule;
}

bool warp_ahead(int schedule) { return schedule == kWarpAhead || schedule == kWarpAheadReverse; }

// The last error (cudaGetLastError resets it; the message stays valid until the next error).
thread_local cudaError_t g_last_error = cudaSuccess;
thread_local std::string g_last_message;

void set_error(cudaError_t err, const std::string& message) {
  g_last_error = err;
  g_last_message = message;
}

// ---- fiber stacks: one pool of kMaxThreads stacks, a PROT_NONE guard page below each
constexpr size_t kStackBytes = 128 * 1024;

unsigned char* stack_pool(size_t* stride) {
  static unsigned char* pool = nullptr;
  static size_t page = 0;
  if (pool == nullptr) {
    page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    const size_t bytes = (kStackBytes + page) * kMaxThreads;
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) {
      std::fprintf(stderr, "ff_simt: cannot map %zu bytes of fiber stacks\n", bytes);
      std::abort();
    }
    pool = static_cast<unsigned char*>(p);
    for (int t = 0; t < kMaxThreads; ++t) mprotect(pool + t * (kStackBytes + page), page, PROT_NONE);
  }
  *stride = kStackBytes + page;
  return pool;
}

// ---- the switch between the scheduler and fiber t
void to_scheduler(Launch* L) {
  Fiber& f = L->fibers[L->current];
#ifdef FF_SIMT_USE_UCONTEXT
  swapcontext(&f.ctx, &L->sched);
#else
  ff_simt_switch(&f.sp, L->sched_sp);
#endif
}

void run_fiber(Launch* L, int t) {
  L->current = t;
  const unsigned bx = blockDim.x, by = blockDim.y;
  const unsigned ut = static_cast<unsigned>(t);
  threadIdx = uint3{ut % bx, (ut / bx) % by, ut / (bx * by)};
#ifdef FF_SIMT_USE_UCONTEXT
  swapcontext(&L->sched, &L->fibers[t].ctx);
#else
  ff_simt_switch(&L->sched_sp, L->fibers[t].sp);
#endif
  L->current = -1;
}

[[noreturn]] void fiber_main() {
  Launch* L = g_launch;
  L->body(L->ctx);
  L->fibers[L->current].state = State::kDone;
  to_scheduler(L);
  std::abort();  // a finished fiber is never resumed
}

#ifdef FF_SIMT_USE_UCONTEXT
void fiber_main_uctx() { fiber_main(); }
#endif

void prepare_fiber(Launch* L, int t) {
  size_t stride = 0;
  unsigned char* pool = stack_pool(&stride);
  unsigned char* lo = pool + t * stride + (stride - kStackBytes);  // above the guard page
  Fiber& f = L->fibers[t];
  std::vector<PendingCopy> pending = std::move(f.pending);  // keeps its capacity
  pending.clear();
  f = Fiber();
  f.pending = std::move(pending);
#ifdef FF_SIMT_USE_UCONTEXT
  getcontext(&f.ctx);
  f.ctx.uc_stack.ss_sp = lo;
  f.ctx.uc_stack.ss_size = kStackBytes;
  f.ctx.uc_link = nullptr;
  makecontext(&f.ctx, fiber_main_uctx, 0);
#else
  // The frame ff_simt_switch pops: [mxcsr, fpu cw][r15 r14 r13 r12 rbx rbp][return address],
  // placed so that fiber_main starts with the stack aligned as after a call.
  uintptr_t top = reinterpret_cast<uintptr_t>(lo + kStackBytes) & ~uintptr_t{15};
  uint64_t* sp = reinterpret_cast<uint64_t*>(top - 72);
  uint32_t mxcsr = 0;
  uint16_t fpucw = 0;
  __asm__ __volatile__("stmxcsr %0" : "=m"(mxcsr));
  __asm__ __volatile__("fnstcw %0" : "=m"(fpucw));
  sp[0] = static_cast<uint64_t>(mxcsr) | (static_cast<uint64_t>(fpucw) << 32);
  for (int i = 1; i <= 6; ++i) sp[i] = 0;
  sp[7] = reinterpret_cast<uint64_t>(&fiber_main);
  sp[8] = 0;  // the fake caller's return address
  f.sp = sp;
#endif
}

// ---- messages
std::string thread_list(const std::vector<int>& ts) {
  std::string s;
  size_t i = 0;
  int shown = 0;
  while (i < ts.size()) {
    size_t j = i;
    while (j + 1 < ts.size() && ts[j + 1] == ts[j] + 1) ++j;
    if (shown == 8) {
      s += ", ...";
      break;
    }
    if (!s.empty()) s += ", ";
    s += std::to_string(ts[i]);
    if (j > i) s += "-" + std::to_string(ts[j]);
    ++shown;
    i = j + 1;
  }
  return s;
}

const char* warp_op_name(int op) {
  switch (op) {
    case kShflIdx: return "__shfl_sync";
    case kShflXor: return "__shfl_xor_sync";
    case kShflUp: return "__shfl_up_sync";
    case kShflDown: return "__shfl_down_sync";
    case kBallot: return "__ballot_sync";
    case kAny: return "__any_sync";
    case kAll: return "__all_sync";
    default: return "__syncwarp";
  }
}

// The name of the intrinsic or instruction fiber f waits at.
const char* op_name(const Fiber& f) {
  return f.op == kCollective && f.name != nullptr ? f.name : warp_op_name(f.op);
}

bool same_warp_op(const Fiber& a, const Fiber& b) {
  if (a.op != b.op || a.mask != b.mask || a.width != b.width) return false;
  return a.op != kCollective || std::strcmp(a.name, b.name) == 0;
}

std::string where(const Launch* L) {
  char buf[160];
  std::snprintf(buf, sizeof(buf), "kernel %s, block (%u, %u, %u) of (%u, %u, %u), %d threads: ",
                L->name, L->block_index.x, L->block_index.y, L->block_index.z, gridDim.x,
                gridDim.y, gridDim.z, L->nthreads);
  return "ff_simt: " + std::string(buf);
}

void stop(Launch* L, const std::string& message) {
  if (L->failed) return;
  L->failed = true;
  L->error = where(L) + message;
}

// ---- warp intrinsics: complete every warp whose lanes have all arrived
std::string hex(unsigned v) {
  char buf[16];
  std::snprintf(buf, sizeof(buf), "0x%08x", v);
  return buf;
}

// Releases the warp whose lanes start at thread `base` if its lanes named in the mask (those that
// exist) all wait at the same warp intrinsic. Returns true if it was released or the launch failed.
bool release_warp(Launch* L, int base) {
  const int lanes = L->nthreads - base < 32 ? L->nthreads - base : 32;
  Fiber* f = L->fibers + base;
  int first = -1;
  for (int l = 0; l < lanes && first < 0; ++l) {
    if (f[l].state == State::kWarp) first = l;
  }
  if (first < 0) return false;
  const Fiber& ref = f[first];
  // the messages' parts, built only for a message
  const auto warp = [base] { return "warp " + std::to_string(base / 32) + ": "; };
  const char* const op = op_name(ref);
  bool all_arrived = true;
  std::vector<int> exited;
  unsigned part = 0;  // the lanes that take part: existing, named, waiting here
  for (int l = 0; l < lanes; ++l) {
    const bool named = (ref.mask >> l) & 1u;
    if (f[l].state == State::kWarp) {
      if (!same_warp_op(f[l], ref)) {
        stop(L, warp() + "lane " + std::to_string(first) + " is at " + op + " (mask " +
                    hex(ref.mask) + ", width " + std::to_string(ref.width) + ") but lane " +
                    std::to_string(l) + " at " + op_name(f[l]) + " (mask " +
                    hex(f[l].mask) + ", width " + std::to_string(f[l].width) +
                    "): the lanes of a warp must meet at the same intrinsic with the same mask");
        return true;
      }
      if (!named) {
        stop(L, warp() + "lane " + std::to_string(l) + " calls " + op + " with mask " +
                    hex(ref.mask) + ", which does not name it");
        return true;
      }
      part |= 1u << l;
    } else if (named && f[l].state == State::kDone) {
      exited.push_back(base + l);
    } else if (named) {
      all_arrived = false;  // at __syncthreads: the deadlock report names it if nothing moves
    }
  }
  if (!exited.empty()) {
    stop(L, warp() + op + " (mask " + hex(ref.mask) + ") reached by only part of the warp: threads " +
                thread_list(exited) + " named in its mask have exited");
    return true;
  }
  if (ref.op == kCollective && lanes < 32) {
    // a warp-collective instruction is .aligned: every lane of a full warp executes it
    stop(L, warp() + op + " needs all 32 lanes of the warp, but the block has " +
                std::to_string(L->nthreads) + " threads, so this warp has " +
                std::to_string(lanes));
    return true;
  }
  if (!all_arrived) return false;
  const int width = ref.width;
  if (width < 1 || width > 32 || (width & (width - 1)) != 0) {
    stop(L, warp() + op + ": width must be a power of two in [1, 32], got " + std::to_string(width));
    return true;
  }
  if (ref.op == kSyncWarp || ref.op == kCollective || ref.op == kBallot || ref.op == kAny ||
      ref.op == kAll) {
    unsigned ballot = 0;
    for (int l = 0; l < lanes; ++l) {
      if (((part >> l) & 1u) && f[l].value != 0) ballot |= 1u << l;
    }
    for (int l = 0; l < lanes; ++l) {
      if (!((part >> l) & 1u)) continue;
      if (ref.op == kBallot) f[l].result = ballot;
      if (ref.op == kAny) f[l].result = ballot != 0;
      if (ref.op == kAll) f[l].result = ballot == part;
      f[l].state = State::kReady;
    }
    return true;
  }
  // shuffles: every lane reads its source lane's value; all values were stored before any
  // result is written (results go to a separate field)
  for (int l = 0; l < lanes; ++l) {
    if (!((part >> l) & 1u)) continue;
    const int seg = l & ~(width - 1), pos = l & (width - 1), param = f[l].param;
    int src = l;
    switch (ref.op) {
      case kShflIdx: src = seg + (param & (width - 1)); break;
      case kShflXor: src = ((l ^ param) & ~(width - 1)) == seg ? (l ^ param) : l; break;
      case kShflUp: src = pos >= param ? l - param : l; break;
      default: src = pos + param < width ? l + param : l; break;
    }
    if (src < 0 || src >= 32 || !((part >> src) & 1u)) {
      stop(L, warp() + op + " in thread " + std::to_string(base + l) + " reads lane " +
                  std::to_string(src) +
                  (src >= lanes ? ", which does not exist (the block has " +
                                      std::to_string(L->nthreads) + " threads)"
                                : ", which is not in the mask " + hex(ref.mask)));
      return true;
    }
    f[l].result = f[src].value;
  }
  for (int l = 0; l < lanes; ++l) {
    if ((part >> l) & 1u) f[l].state = State::kReady;
  }
  return true;
}

// Releases every warp that release_warp can. Returns true if some warp was released or the launch
// failed.
bool release_warps(Launch* L) {
  bool released = false;
  for (int base = 0; base < L->nthreads; base += 32) {
    if (release_warp(L, base)) {
      if (L->failed) return true;
      released = true;
    }
  }
  return released;
}

// ---- the block barrier: released when every thread of the block waits at it
bool release_block(Launch* L) {
  std::vector<int> at_barrier, exited, at_warp;
  for (int t = 0; t < L->nthreads; ++t) {
    switch (L->fibers[t].state) {
      case State::kBlock: at_barrier.push_back(t); break;
      case State::kDone: exited.push_back(t); break;
      case State::kWarp: at_warp.push_back(t); break;
      default: break;
    }
  }
  if (at_barrier.empty()) return false;
  if (!exited.empty()) {
    stop(L, "__syncthreads reached by threads " + thread_list(at_barrier) + " but threads " +
                thread_list(exited) + " have exited without reaching it");
    return true;
  }
  if (!at_warp.empty()) return false;  // the deadlock report names both groups
  const int op = L->fibers[0].op;
  int count = 0;
  for (int t = 0; t < L->nthreads; ++t) {
    if (L->fibers[t].op != op) {
      stop(L, "threads 0 and " + std::to_string(t) +
                  " wait at different kinds of block barrier (__syncthreads / _count / _and / _or)");
      return true;
    }
    count += L->fibers[t].value != 0;
  }
  const int result = op == kSyncCount ? count
                     : op == kSyncAnd ? (count == L->nthreads)
                     : op == kSyncOr  ? (count > 0)
                                      : 0;
  for (int t = 0; t < L->nthreads; ++t) {
    L->fibers[t].result = static_cast<uint64_t>(result);
    L->fibers[t].state = State::kReady;
  }
  return true;
}

void report_deadlock(Launch* L) {
  std::vector<int> at_barrier, at_warp, exited;
  for (int t = 0; t < L->nthreads; ++t) {
    const State s = L->fibers[t].state;
    if (s == State::kBlock) at_barrier.push_back(t);
    if (s == State::kWarp) at_warp.push_back(t);
    if (s == State::kDone) exited.push_back(t);
  }
  std::string msg = "no thread can continue (a barrier or warp intrinsic reached by only part of "
                    "the threads):";
  if (!at_warp.empty()) {
    msg += " threads " + thread_list(at_warp) + " wait at " + op_name(L->fibers[at_warp[0]]) + ";";
  }
  if (!at_barrier.empty()) msg += " threads " + thread_list(at_barrier) + " wait at __syncthreads;";
  if (!exited.empty()) msg += " threads " + thread_list(exited) + " have exited;";
  msg.pop_back();
  stop(L, msg);
}

// The warp_ahead schedules: between two block barriers each warp runs alone until every lane has
// reached the next __syncthreads (or exited), its warp intrinsics released as its own lanes
// arrive; warp 0 first and lanes in order, or (reverse) the last warp first and lanes last to
// first. Then the barrier completes and the next phase starts with the same warp.
void run_block_warp_ahead(Launch* L, bool reverse) {
  const int warps = (L->nthreads + 31) / 32;
  for (;;) {
    bool any_live = false;
    for (int i = 0; i < warps; ++i) {
      const int base = 32 * (reverse ? warps - 1 - i : i);
      const int lanes = L->nthreads - base < 32 ? L->nthreads - base : 32;
      do {
        for (int j = 0; j < lanes; ++j) {
          const int t = base + (reverse ? lanes - 1 - j : j);
          if (L->fibers[t].state == State::kReady) {
            run_fiber(L, t);
            if (L->failed) return;
          }
        }
      } while (release_warp(L, base) && !L->failed);
      if (L->failed) return;
      for (int l = 0; l < lanes; ++l) any_live |= L->fibers[base + l].state != State::kDone;
    }
    if (!any_live) return;
    if (release_block(L)) {
      if (L->failed) return;
      continue;
    }
    report_deadlock(L);
    return;
  }
}

void run_block(Launch* L) {
  for (int t = 0; t < L->nthreads; ++t) prepare_fiber(L, t);
  if (L->smem_bytes) std::memset(L->smem, 0xFF, L->smem_bytes);
  if (warp_ahead(L->schedule)) {
    run_block_warp_ahead(L, L->schedule == kWarpAheadReverse);
    return;
  }
  const bool reverse = L->schedule == kReverse;
  for (;;) {
    bool any_live = false;
    for (int i = 0; i < L->nthreads; ++i) {
      const int t = reverse ? L->nthreads - 1 - i : i;
      if (L->fibers[t].state == State::kReady) {
        run_fiber(L, t);
        if (L->failed) return;
      }
      any_live |= L->fibers[t].state != State::kDone;
    }
    if (!any_live) return;
    if (release_warps(L)) {
      if (L->failed) return;
      continue;
    }
    if (release_block(L)) {
      if (L->failed) return;
      continue;
    }
    report_deadlock(L);
    return;
  }
}

Launch* running(const char* what) {
  Launch* L = g_launch;
  if (L == nullptr || L->current < 0) {
    std::fprintf(stderr, "ff_simt: %s called outside a kernel launch\n", what);
    std::abort();
  }
  return L;
}

}  // namespace

void run_grid(const char* name, const void* kernel, dim3 grid, dim3 block, size_t smem_bytes,
              void (*body)(void*), void* ctx) {
  std::lock_guard<std::mutex> lock(g_launch_mutex);
  const uint64_t threads = uint64_t{block.x} * block.y * block.z;
  char cfg[200];
  std::snprintf(cfg, sizeof(cfg), " (kernel %s, grid (%u, %u, %u), block (%u, %u, %u), %zu bytes of dynamic shared memory)",
                name, grid.x, grid.y, grid.z, block.x, block.y, block.z, smem_bytes);
  if (grid.x == 0 || grid.y == 0 || grid.z == 0 || block.x == 0 || block.y == 0 || block.z == 0 ||
      block.x > 1024 || block.y > 1024 || block.z > 64 || threads > kMaxThreads ||
      grid.x > 0x7FFFFFFFu || grid.y > 65535 || grid.z > 65535) {
    set_error(cudaErrorInvalidConfiguration, std::string("invalid configuration argument") + cfg);
    return;
  }
  const auto limit_it = g_smem_limit.find(kernel);
  const size_t limit = limit_it == g_smem_limit.end() ? kMaxDynamicSmemDefault : limit_it->second;
  if (smem_bytes > limit) {
    std::string why = "invalid argument: more dynamic shared memory than the kernel's limit of " +
                      std::to_string(limit) + " bytes";
    why += limit_it == g_smem_limit.end()
               ? " (48 KiB without opt-in: raise it with cudaFuncSetAttribute(kernel, "
                 "cudaFuncAttributeMaxDynamicSharedMemorySize, bytes), up to " +
                     std::to_string(kMaxDynamicSmemOptIn) + ")"
               : " (set by cudaFuncSetAttribute)";
    set_error(cudaErrorInvalidValue, why + cfg);
    return;
  }
  const int schedule = current_schedule();
  if (schedule < 0) {
    set_error(cudaErrorInvalidValue, "invalid argument: FF_SIMT_SCHEDULE=" + g_bad_schedule +
                                         " names no schedule (forward, reverse, warp_ahead, "
                                         "warp_ahead_reverse)" + cfg);
    return;
  }
  static Launch launch_state;  // about 200 KiB of fiber records and warp scratch, reused
  Launch* L = &launch_state;
  L->name = name;
  L->body = body;
  L->ctx = ctx;
  L->nthreads = static_cast<int>(threads);
  L->schedule = schedule;
  L->failed = false;
  L->error.clear();
  std::vector<unsigned char> smem_buf(smem_bytes + 16);
  L->smem = smem_buf.data() + ((16 - reinterpret_cast<uintptr_t>(smem_buf.data()) % 16) % 16);
  L->smem_bytes = smem_bytes;
  g_launch = L;
  gridDim = grid;
  blockDim = block;
  for (unsigned z = 0; z < grid.z && !L->failed; ++z) {
    for (unsigned y = 0; y < grid.y && !L->failed; ++y) {
      for (unsigned x = 0; x < grid.x && !L->failed; ++x) {
        blockIdx = uint3{x, y, z};
        L->block_index = blockIdx;
        run_block(L);
      }
    }
  }
  g_launch = nullptr;
  if (L->failed) set_error(cudaErrorLaunchFailure, L->error);
}

int block_barrier(BlockOp op, int pred) {
  Launch* L = running("__syncthreads");
  Fiber& f = L->fibers[L->current];
  if (warp_ahead(L->schedule)) {
    // the latest moment before the other warps run: the thread's copies land now, the earliest
    // the scheduler can show them to another warp (see simt.h)
    for (const PendingCopy& c : f.pending) std::memcpy(c.dst, c.data, static_cast<size_t>(c.bytes));
    f.pending.clear();
  }
  f.state = State::kBlock;
  f.op = op;
  f.value = pred != 0;
  to_scheduler(L);
  return static_cast<int>(L->fibers[L->current].result);
}

uint64_t warp_op(WarpOp op, unsigned mask, uint64_t value, int param, int width) {
  Launch* L = running(warp_op_name(op));
  Fiber& f = L->fibers[L->current];
  f.state = State::kWarp;
  f.op = op;
  f.mask = mask;
  f.value = value;
  f.param = param;
  f.width = width;
  to_scheduler(L);
  return L->fibers[L->current].result;
}

void* dynamic_smem() { return running("dynamic shared memory")->smem; }

int lane() { return running("ff_simt::lane")->current % 32; }

void warp_collective(const char* instruction) {
  Launch* L = running(instruction);
  Fiber& f = L->fibers[L->current];
  f.state = State::kWarp;
  f.op = kCollective;
  f.mask = 0xffffffffu;
  f.width = 32;
  f.value = 0;
  f.name = instruction;
  to_scheduler(L);
}

uint32_t* warp_scratch() {
  Launch* L = running("ff_simt::warp_scratch");
  return L->warp_scratch[L->current / 32];
}

void cp_async(void* dst, const void* src, int bytes, int src_bytes) {
  Launch* L = running("cp.async");
  char msg[200];
  if (bytes != 4 && bytes != 8 && bytes != 16) {
    std::snprintf(msg, sizeof(msg), "thread %d: cp.async copies 4, 8 or 16 bytes, not %d",
                  L->current, bytes);
    fail(msg);
  }
  if (src_bytes < 0 || src_bytes > bytes) {
    std::snprintf(msg, sizeof(msg), "thread %d: cp.async src-size %d is not in [0, %d]", L->current,
                  src_bytes, bytes);
    fail(msg);
  }
  if (reinterpret_cast<uintptr_t>(dst) % bytes != 0 || reinterpret_cast<uintptr_t>(src) % bytes != 0) {
    std::snprintf(msg, sizeof(msg), "thread %d: cp.async of %d bytes from %p to %p: both addresses "
                  "must be %d-byte aligned", L->current, bytes, src, dst, bytes);
    fail(msg);
  }
  Fiber& f = L->fibers[L->current];
  PendingCopy c{static_cast<unsigned char*>(dst), bytes, f.committed, {}};
  // only src_bytes are read: a zero-fill copy of an out-of-bounds row may name any address
  std::memcpy(c.data, src, static_cast<size_t>(src_bytes));
  std::memset(c.data + src_bytes, 0, static_cast<size_t>(bytes - src_bytes));
  f.pending.push_back(c);
}

void cp_async_commit() {
  Launch* L = running("cp.async.commit_group");
  ++L->fibers[L->current].committed;
}

void cp_async_wait(int n) {
  Launch* L = running("cp.async.wait_group");
  Fiber& f = L->fibers[L->current];
  // groups 0 .. committed - 1 exist; all but the n most recent complete (uncommitted copies stay)
  size_t kept = 0;
  for (const PendingCopy& c : f.pending) {
    if (c.group < f.committed - n) {
      std::memcpy(c.dst, c.data, static_cast<size_t>(c.bytes));
    } else {
      f.pending[kept++] = c;
    }
  }
  f.pending.resize(kept);
}

cudaError_t set_func_attribute(const void* kernel, cudaFuncAttribute attr, int value) {
  std::lock_guard<std::mutex> lock(g_launch_mutex);
  bool ok = false;
  if (attr == cudaFuncAttributeMaxDynamicSharedMemorySize) {
    ok = value >= 0 && static_cast<size_t>(value) <= kMaxDynamicSmemOptIn;
    if (ok) g_smem_limit[kernel] = static_cast<size_t>(value);
  } else if (attr == cudaFuncAttributePreferredSharedMemoryCarveout) {
    ok = value >= -1 && value <= 100;
  }
  if (ok) return cudaSuccess;
  // like the runtime, the error is returned and also left for cudaGetLastError
  set_error(cudaErrorInvalidValue,
            "invalid argument: cudaFuncSetAttribute(attribute " + std::to_string(attr) + ", value " +
                std::to_string(value) + ")" +
                (attr == cudaFuncAttributeMaxDynamicSharedMemorySize
                     ? ": the dynamic shared memory limit must be in [0, " +
                           std::to_string(kMaxDynamicSmemOptIn) + "] bytes"
                     : ""));
  return cudaErrorInvalidValue;
}

void set_reverse_schedule(bool reverse) { set_schedule(reverse ? kReverse : kForward); }

Schedule set_schedule(Schedule schedule) {
  std::lock_guard<std::mutex> lock(g_launch_mutex);
  const int previous = current_schedule();
  g_schedule = schedule;
  g_bad_schedule.clear();
  return previous < 0 ? kForward : static_cast<Schedule>(previous);
}

void fail(const char* message) {
  Launch* L = running("ff_simt::fail");
  stop(L, message);
  L->fibers[L->current].state = State::kDone;
  to_scheduler(L);
  std::abort();
}

int set_sm_count(int n) {
  std::lock_guard<std::mutex> lock(g_launch_mutex);
  const int previous = g_sm_count;
  if (n >= 1) g_sm_count = n;
  return previous;
}

}  // namespace ff_simt

cudaError_t cudaGetDevice(int* device) {
  *device = 0;
  return cudaSuccess;
}

cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device) {
  if (device != 0 || attr != cudaDevAttrMultiProcessorCount) {
    ff_simt::set_error(cudaErrorInvalidValue,
                       "invalid argument (the SIMT harness models device 0's SM count only)");
    return cudaErrorInvalidValue;
  }
  *value = ff_simt::g_sm_count;
  return cudaSuccess;
}

cudaError_t cudaGetLastError() {
  const cudaError_t err = ff_simt::g_last_error;
  ff_simt::g_last_error = cudaSuccess;
  return err;
}

cudaError_t cudaPeekAtLastError() { return ff_simt::g_last_error; }

const char* cudaGetErrorString(cudaError_t err) {
  if (err == cudaSuccess) return "no error";
  // the message of the last error set on this thread (cudaGetLastError keeps it)
  return ff_simt::g_last_message.empty() ? "unknown error" : ff_simt::g_last_message.c_str();
}
