#include <fsdp/memory.h>

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include "detail/env.h"
#include "detail/torch_compat.h"
#include "memory/block_cache.h"
#include "memory/cpu_allocator.h"

#include <sys/resource.h>
#include <unistd.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <memory>
#include <mutex>
#include <unordered_map>

namespace fsdp {
namespace detail {
namespace {

/// The process-wide counters behind MemoryStats.
struct MemoryCounters {
  std::atomic<int64_t> current{0};
  std::atomic<int64_t> peak{0};
  std::atomic<int64_t> allocations{0};
  std::atomic<int64_t> frees{0};
};

/// Never destroyed: storages held by static objects (or leaked) are freed
/// during or after static destruction, and their deleter still updates these.
MemoryCounters& counters() {
  static MemoryCounters* counters = new MemoryCounters();
  return *counters;
}

/// Deleter context of a counted allocation. A DataPtr has a single context
/// word, so the inner allocator's context and deleter travel in here with the
/// size the free must subtract.
struct TrackedContext {
  void* inner_context = nullptr;
  c10::DeleterFnPtr inner_deleter = nullptr;
  int64_t nbytes = 0;
};

void record_allocation(int64_t nbytes) {
  MemoryCounters& c = counters();
  c.allocations.fetch_add(1, std::memory_order_relaxed);
  const int64_t now = c.current.fetch_add(nbytes, std::memory_order_relaxed) + nbytes;
  // A CAS loop rather than a store: another thread may have raised the peak
  // past `now` in the meantime, and a plain store would lower it again.
  int64_t peak = c.peak.load(std::memory_order_relaxed);
  while (peak < now && !c.peak.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
  }
}

void delete_tracked(void* context) {
  std::unique_ptr<TrackedContext> tracked(static_cast<TrackedContext*>(context));
  if (tracked->inner_deleter != nullptr) tracked->inner_deleter(tracked->inner_context);
  MemoryCounters& c = counters();
  c.current.fetch_sub(tracked->nbytes, std::memory_order_relaxed);
  c.frees.fetch_add(1, std::memory_order_relaxed);
}

/// A live allocation of the raw-compatible path: the bytes asked for, and
/// the size of its cache block (0: the inner allocator's memory).
struct RawEntry {
  int64_t nbytes = 0;
  size_t block_bytes = 0;
};

// Live allocations made through the raw-compatible path, by data pointer:
// LibTorch's raw interface (used by oneDNN, e.g. for at::gelu) hands the
// deleter only the data pointer.
struct RawSizes {
  std::mutex mutex;
  std::unordered_map<void*, RawEntry> entries;
  c10::DeleterFnPtr inner_deleter = nullptr;  // constant once installed
};

RawSizes& raw_sizes() {
  static RawSizes* sizes = new RawSizes();  // never destroyed, as counters()
  return *sizes;
}

BlockCache& block_cache() {
  static BlockCache* cache = new BlockCache();  // never destroyed, as counters()
  return *cache;
}

int64_t resident_bytes() {
  long pages = 0, resident = 0;
  FILE* f = std::fopen("/proc/self/statm", "r");
  if (f == nullptr) return -1;
  const int n = std::fscanf(f, "%ld %ld", &pages, &resident);
  std::fclose(f);
  return n == 2 ? static_cast<int64_t>(resident) * sysconf(_SC_PAGESIZE) : -1;
}

int64_t peak_resident_bytes() {
  rusage usage{};
  if (getrusage(RUSAGE_SELF, &usage) != 0) return -1;
  return static_cast<int64_t>(usage.ru_maxrss) * 1024;  // KiB on Linux
}

/// Whether large allocations come from block_cache() (Note [CPU block cache]).
std::atomic<bool>& cache_enabled() {
  static std::atomic<bool> enabled{false};
  return enabled;
}

void delete_raw_tracked(void* data) {
  RawSizes& sizes = raw_sizes();
  RawEntry entry;
  {
    std::lock_guard<std::mutex> lock(sizes.mutex);
    auto it = sizes.entries.find(data);
    if (it != sizes.entries.end()) {
      entry = it->second;
      sizes.entries.erase(it);
    }
  }
  if (entry.block_bytes > 0) {
    block_cache().give_back(data, entry.block_bytes);
  } else {
    sizes.inner_deleter(data);
  }
  if (entry.nbytes > 0) {
    const int64_t nbytes = entry.nbytes;
    MemoryCounters& c = counters();
    c.current.fetch_sub(nbytes, std::memory_order_relaxed);
    c.frees.fetch_add(1, std::memory_order_relaxed);
  }
}

/// libfsdp's CPU allocator: counts the bytes of every non-empty allocation,
/// serves the large ones from the block cache once it is enabled, and
/// forwards the rest to the CPU allocator that was installed before it.
///
/// When the inner allocator supports LibTorch's raw interface (the default
/// CPU allocator does: its context is the data pointer), so does this one,
/// with the size kept in a table; oneDNN kernels allocate through it and
/// abort on an allocator without it. Otherwise the size travels in a
/// TrackedContext and raw_deleter() stays nullptr. Cache blocks always take
/// the table, whatever the inner allocator.
class CpuAllocator final : public c10::Allocator {
 public:
  explicit CpuAllocator(c10::Allocator* inner) : inner_(inner) {
    raw_sizes().inner_deleter = inner_->raw_deleter();
  }

  FSDP_ALLOCATOR_COPY_DATA

  c10::DataPtr allocate(size_t nbytes) FSDP_ALLOCATE_CONST override {
    const c10::Device device(c10::DeviceType::CPU);
    const auto size = static_cast<int64_t>(nbytes);
    // A size past PTRDIFF_MAX (a negative one cast) would wrap in the page
    // rounding: the inner allocator refuses it with c10's message.
    if (nbytes >= BlockCache::kMinBytes && nbytes <= static_cast<size_t>(PTRDIFF_MAX) &&
        cache_enabled().load(std::memory_order_relaxed)) {
      size_t block_bytes = 0;
      void* data = block_cache().take(nbytes, block_bytes);
      add_entry(data, RawEntry{size, block_bytes});
      record_allocation(size);
      return c10::DataPtr(data, data, &delete_raw_tracked, device);
    }
    c10::DataPtr inner = inner_->allocate(nbytes);
    // Empty storages hold no memory; passing them through untouched keeps
    // allocations/frees about real memory and saves a context allocation.
    if (nbytes == 0) return inner;
    void* data = inner.get();
    if (raw_compatible(inner)) {
      add_entry(data, RawEntry{size, 0});
      inner.release_context();
      record_allocation(size);
      return c10::DataPtr(data, data, &delete_raw_tracked, inner.device());
    }
    // Allocated before the inner context is released, so a bad_alloc here
    // still frees the inner allocation through `inner`.
    auto tracked = std::make_unique<TrackedContext>();
    tracked->inner_deleter = inner.get_deleter();
    tracked->nbytes = size;
    tracked->inner_context = inner.release_context();
    record_allocation(size);
    return c10::DataPtr(data, tracked.release(), &delete_tracked, inner.device());
  }

  c10::DeleterFnPtr raw_deleter() const override {
    return raw_sizes().inner_deleter != nullptr ? &delete_raw_tracked : nullptr;
  }

 private:
  static void add_entry(void* data, RawEntry entry) {
    RawSizes& sizes = raw_sizes();
    std::lock_guard<std::mutex> lock(sizes.mutex);
    sizes.entries[data] = entry;
  }

  bool raw_compatible(const c10::DataPtr& inner) const {
    return raw_sizes().inner_deleter != nullptr && inner.get_context() == inner.get() &&
           inner.get_deleter() == raw_sizes().inner_deleter;
  }

  c10::Allocator* inner_;
};

/// Only higher or equal priorities replace an allocator; the maximum makes
/// installation succeed over whatever is there (which we wrap, so nothing is
/// lost) and keeps a later default-priority SetCPUAllocator() from silently
/// cutting the counts off.
constexpr uint8_t kTrackingPriority = std::numeric_limits<uint8_t>::max();

/// Installs the tracking allocator once and returns it. Never destroyed, for
/// the same reason as counters().
CpuAllocator* installed_allocator() {
  static CpuAllocator* instance = [] {
    counters();  // constructed before any storage can reference it
    auto* allocator = new CpuAllocator(c10::GetCPUAllocator());
    c10::SetCPUAllocator(allocator, kTrackingPriority);
    return allocator;
  }();
  return instance;
}

}  // namespace
}  // namespace detail

void enable_memory_tracking() { detail::installed_allocator(); }

bool enable_cpu_block_cache() {
  detail::CpuAllocator* allocator = detail::installed_allocator();
  detail::cache_enabled().store(true);
  return c10::GetCPUAllocator() == allocator;
}

void empty_cpu_block_cache() { detail::block_cache().release_cached(); }

namespace detail {

BlockCache::Stats block_cache_stats() { return block_cache().stats(); }

void enable_cpu_block_cache_by_default() {
  static const bool wanted = env_switch_on("FSDP_CPU_BLOCK_CACHE");
  if (wanted) enable_cpu_block_cache();
}

}  // namespace detail

MemoryStats memory_stats() {
  detail::CpuAllocator* allocator = detail::installed_allocator();
  const detail::MemoryCounters& c = detail::counters();
  MemoryStats stats;
  stats.current_bytes = c.current.load(std::memory_order_relaxed);
  stats.peak_bytes = c.peak.load(std::memory_order_relaxed);
  stats.allocations = c.allocations.load(std::memory_order_relaxed);
  stats.frees = c.frees.load(std::memory_order_relaxed);
  stats.cached_bytes = detail::block_cache().cached_bytes();
  stats.resident_bytes = detail::resident_bytes();
  stats.peak_resident_bytes = detail::peak_resident_bytes();
  stats.tracking = c10::GetCPUAllocator() == allocator;
  return stats;
}

void reset_peak_memory_stats() {
  detail::installed_allocator();
  detail::MemoryCounters& c = detail::counters();
  c.peak.store(c.current.load(std::memory_order_relaxed), std::memory_order_relaxed);
}

}  // namespace fsdp
