// The task scheduler of the CPU attention kernels (attention_kernel_fwd.cpp,
// attention_kernel_bwd.cpp): threads take tasks one at a time from a shared counter, heaviest
// first (TaskList, parallel_tasks), so sequences of different lengths do not leave a thread
// waiting for another.
#pragma once
#ifndef CPU_CAPABILITY
#error "included only by the per-ISA kernel sources csrc/cpu/*_kernel*.cpp (see isa.h)"
#endif
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

namespace fastformer {
namespace CPU_CAPABILITY {
// Internal linkage, as when all of this was one file: each per-ISA source keeps its own copy.
namespace {

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
inline int64_t round_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }

// at::parallel_for grain for tasks of about `work` multiply-adds each: a thread gets at least
// ~2^17 of them, so tiny problems (gradcheck sizes) run inline instead of waking threads.
inline int64_t grain_for(int64_t work) {
  return std::max<int64_t>(1, (int64_t{1} << 17) / std::max<int64_t>(1, work));
}

// Tasks handed out one at a time from a shared counter (see parallel_tasks).
class TaskQueue {
 public:
  explicit TaskQueue(int64_t n) : n_(n) {}
  // The next task not yet taken by any thread; false when none is left.
  bool pop(int64_t& task) {
    task = next_.fetch_add(1, std::memory_order_relaxed);
    return task < n_;
  }

 private:
  const int64_t n_;
  std::atomic<int64_t> next_{0};
};

// Runs fn(queue) on as many of at::parallel_for's threads as tasks [0, n) of `work` multiply-adds
// in all keep busy (~2^17 each; one thread, inline, for small problems); each thread sets up its
// scratch once and then pops tasks until none is left. at::parallel_for alone hands each thread
// one contiguous range of tasks, and with sequences of different lengths (key padding, packed
// sequences) or a causal mask one range can hold much more work than another while the other
// threads wait at the barrier. Each task writes only its own rows, so which thread runs it does
// not change a bit of the result.
template <typename Fn>
void parallel_tasks(int64_t n, int64_t work, const Fn& fn) {
  if (n <= 0) return;
  const int64_t threads = std::clamp<int64_t>(ceil_div(work, int64_t{1} << 17), 1,
                                              std::min<int64_t>(n, at::get_num_threads()));
  TaskQueue queue(n);
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) { fn(queue); });
}

// The tasks of one pass: items (sequence b, block) each run for every one of H heads, task
// h * items + item. Each head's items go heaviest first (longest processing time first): with
// the dynamic queue the last tasks are light ones, so a long sequence among short ones is started
// early instead of being the last thing one thread works on while the others wait. Head-major:
// threads working at once take different sequences of one head, not neighbouring heads of one
// sequence, whose pieces of the packed rows (H D apart) lie side by side.
class TaskList {
 public:
  struct Item {
    int64_t b, block, work;  // block: a query or key block index, or kWholeHead
  };
  static constexpr int64_t kWholeHead = -1;

  explicit TaskList(int64_t H) : H_(H) {}
  void add(int64_t b, int64_t block, int64_t work) {
    items_.push_back({b, block, work});
    work_ += work;
  }
  // Call once every item is added.
  void sort() {
    std::stable_sort(items_.begin(), items_.end(),
                     [](const Item& x, const Item& y) { return x.work > y.work; });
  }
  int64_t size() const { return static_cast<int64_t>(items_.size()) * H_; }
  int64_t work() const { return work_ * H_; }  // multiply-adds of all tasks
  const Item& item(int64_t task, int64_t& h) const {
    const int64_t n = static_cast<int64_t>(items_.size());
    h = task / n;
    return items_[task % n];
  }

 private:
  int64_t H_, work_ = 0;
  std::vector<Item> items_;
};

}  // namespace
}  // namespace CPU_CAPABILITY
}  // namespace fastformer
