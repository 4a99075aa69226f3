// The pool of large CPU output buffers (large_buffers.h).
#include "large_buffers.h"

#include <ATen/EmptyTensor.h>
#include <ATen/Context.h>
#include <c10/core/CPUAllocator.h>
#include <ATen/native/TensorFactories.h>
#include <ATen/ops/empty_native.h>
#include <c10/core/Allocator.h>
#include <c10/util/Exception.h>
#include <sys/mman.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <vector>

namespace fastformer {
namespace {

constexpr size_t kHugePage = size_t{2} << 20;
constexpr int64_t kDefaultCapMiB = 1024;

// FASTFORMER_CPU_POOL_MB as bytes; the default when unset.
size_t cap_from_env() {
  const char* env = std::getenv("FASTFORMER_CPU_POOL_MB");
  if (env == nullptr || *env == '\0') return static_cast<size_t>(kDefaultCapMiB) << 20;
  char* end = nullptr;
  errno = 0;
  const long long mib = std::strtoll(env, &end, 10);
  TORCH_CHECK(errno == 0 && *end == '\0' && mib >= 0 && mib < (1LL << 40),
              "FASTFORMER_CPU_POOL_MB must be a whole number of MiB >= 0 (the most memory the "
              "CPU buffer pool keeps free), got '", env, "'");
  return static_cast<size_t>(mib) << 20;
}

struct Block {
  void* ptr;
  size_t bytes;  // a multiple of kHugePage
};

class Pool final : public c10::Allocator {
 public:
  static Pool& instance();

  c10::DataPtr allocate(size_t nbytes) override {
    size_t bytes = (std::max<size_t>(nbytes, 1) + kHugePage - 1) / kHugePage * kHugePage;
    void* ptr = nullptr;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      init_locked();
      // the smallest kept block that fits, if it is at most a quarter larger (shapes that vary from
      // batch to batch still find blocks; a small tensor never pins a much larger one, which would
      // count against the peak memory)
      auto it = free_.lower_bound(bytes);
      if (it != free_.end() && it->first <= bytes + bytes / 4) {
        bytes = it->first;
        ptr = it->second.ptr;
        free_.erase(it);
        cached_ -= bytes;
        ++hits_;
      } else {
        ++misses_;
      }
      in_use_ += bytes;  // counted before mapping: a failed mapping takes it back below
    }
    if (ptr == nullptr) ptr = map_block(bytes);
    report(ptr, static_cast<int64_t>(bytes));
    return {ptr, new Block{ptr, bytes}, &Pool::release, c10::Device(c10::DeviceType::CPU)};
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  PoolStats stats() {
    std::lock_guard<std::mutex> lock(mutex_);
    init_locked();
    return {static_cast<int64_t>(in_use_), static_cast<int64_t>(cached_),
            static_cast<int64_t>(cap_), hits_, misses_};
  }

  int64_t empty_cache() {
    std::vector<Block> drop;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      for (const auto& [bytes, kept] : free_) drop.push_back({kept.ptr, bytes});
      free_.clear();
      cached_ = 0;
    }
    int64_t total = 0;
    for (const Block& b : drop) {
      std::free(b.ptr);
      total += static_cast<int64_t>(b.bytes);
    }
    return total;
  }

 private:
  void init_locked() {
    if (!cap_read_) {
      cap_ = cap_from_env();
      cap_read_ = true;
    }
  }

  // A new 2 MiB-aligned block of `bytes`, marked for transparent huge pages.
  void* map_block(size_t bytes) {
    void* ptr = nullptr;
    const int rc = posix_memalign(&ptr, kHugePage, bytes);
    if (rc != 0 || ptr == nullptr) {
      {
        std::lock_guard<std::mutex> lock(mutex_);
        in_use_ -= bytes;
      }
      TORCH_CHECK_WITH(OutOfMemoryError, false, "fastformer CPU buffer pool: could not allocate ",
                       bytes, " bytes (posix_memalign: ", std::strerror(rc), ")");
    }
    // Advice only: where transparent huge pages are off the block works with 4 KiB pages.
    (void)madvise(ptr, bytes, MADV_HUGEPAGE);
    return ptr;
  }

  void report(void* ptr, int64_t delta) {
    if (!c10::memoryProfilingEnabled()) return;
    size_t in_use, reserved;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      in_use = in_use_;
      reserved = in_use_ + cached_;
    }
    c10::reportMemoryUsageToProfiler(ptr, delta, in_use, reserved, c10::Device(c10::DeviceType::CPU));
  }

  // A tensor's block comes back: kept for reuse, making room under the cap by freeing the blocks
  // kept longest (shapes no longer asked for); a block larger than the cap itself is freed.
  static void release(void* ctx) {
    Block* block = static_cast<Block*>(ctx);
    Pool& pool = instance();
    std::vector<void*> evicted;
    bool keep;
    {
      std::lock_guard<std::mutex> lock(pool.mutex_);
      pool.in_use_ -= block->bytes;
      keep = block->bytes <= pool.cap_;
      if (keep) {
        while (pool.cached_ + block->bytes > pool.cap_) {
          auto oldest = std::min_element(pool.free_.begin(), pool.free_.end(), [](const auto& a, const auto& b) {
            return a.second.stamp < b.second.stamp;
          });
          evicted.push_back(oldest->second.ptr);
          pool.cached_ -= oldest->first;
          pool.free_.erase(oldest);
        }
        pool.free_.emplace(block->bytes, Kept{block->ptr, ++pool.clock_});
        pool.cached_ += block->bytes;
      }
    }
    pool.report(block->ptr, -static_cast<int64_t>(block->bytes));
    if (!keep) std::free(block->ptr);
    for (void* p : evicted) std::free(p);
    delete block;
  }

  struct Kept {
    void* ptr;
    uint64_t stamp;  // when it was kept: the smallest is evicted first
  };

  std::mutex mutex_;
  std::multimap<size_t, Kept> free_;  // kept blocks by size (a multiple of kHugePage)
  uint64_t clock_ = 0;
  size_t in_use_ = 0, cached_ = 0, cap_ = 0;
  bool cap_read_ = false;
  int64_t hits_ = 0, misses_ = 0;
};

Pool& Pool::instance() {
  // Never destroyed: tensors freed during interpreter shutdown still find their pool.
  static Pool* pool = new Pool();
  return *pool;
}

}  // namespace

// A small contiguous CPU tensor of nbytes (computed by the caller): at::empty's CPU kernel
// (at::native::empty_cpu -> at::detail::empty_generic) step by step -- the CPU allocator (its
// profiler reporting included), the StorageImpl, the TensorImpl, the sizes, torch's deterministic
// fill of empty memory -- without what a contiguous tensor of known size does not need there (the
// optional arguments' unpacking, the size computed again, the strides set a second time by
// empty_tensor_restride): ~0.1k instructions of ~0.9k an allocation, a tiny op's host cost.
static at::Tensor empty_small(at::IntArrayRef sizes, at::ScalarType dtype, size_t nbytes) {
  at::detail::check_size_nonnegative(sizes);
  c10::Allocator* allocator = c10::GetCPUAllocator();
  auto storage = c10::make_intrusive<c10::StorageImpl>(c10::StorageImpl::use_byte_size_t(), nbytes,
                                                       allocator->allocate(nbytes), allocator, /*resizable=*/true);
  at::Tensor t = at::detail::make_tensor<c10::TensorImpl>(std::move(storage), c10::DispatchKeySet(c10::DispatchKey::CPU),
                                                          c10::scalarTypeToTypeMeta(dtype));
  if (sizes.size() != 1 || sizes[0] != 0) t.unsafeGetTensorImpl()->set_sizes_contiguous(sizes);  // (made as [0])
  if (C10_UNLIKELY(at::globalContext().deterministicAlgorithms() &&
                   at::globalContext().deterministicFillUninitializedMemory())) {
    at::native::fill_empty_deterministic_(t);
  }
  return t;
}

at::Tensor empty_large(at::IntArrayRef sizes, const at::TensorOptions& options) {
  TORCH_CHECK(options.device().is_cpu(), "empty_large: CPU tensors only, got device ",
              options.device());
  const at::ScalarType dtype = c10::typeMetaToScalarType(options.dtype());
  const size_t nbytes = at::detail::computeStorageNbytesContiguous(sizes, c10::elementSize(dtype));
  if (nbytes < kPoolMinBytes) {
    // at::empty's CPU kernel without its two dispatcher hops (BackendSelect, CPU), its steps
    // written out where the tensor is a plain one (empty_small)
    if (options.layout() == at::kStrided && !options.pinned_memory()) return empty_small(sizes, dtype, nbytes);
    return at::native::empty_cpu(sizes, dtype, options.layout(), options.device(), options.pinned_memory(),
                                 c10::nullopt);
  }
  return at::detail::empty_generic(sizes, &Pool::instance(), c10::DispatchKeySet(c10::DispatchKey::CPU), dtype,
                                   c10::nullopt);
}

at::Tensor empty_large_like(const at::Tensor& t) { return empty_large(t.sizes(), t.options()); }

PoolStats pool_stats() { return Pool::instance().stats(); }

int64_t pool_empty_cache() { return Pool::instance().empty_cache(); }

}  // namespace fastformer
