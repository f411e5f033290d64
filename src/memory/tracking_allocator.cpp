#include <fsdp/memory.h>

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include "detail/torch_compat.h"

#include <atomic>
#include <cstddef>
#include <cstdint>
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

// Sizes of live allocations made through the raw-compatible path, by data
// pointer: LibTorch's raw interface (used by oneDNN, e.g. for at::gelu)
// hands the deleter only the data pointer.
struct RawSizes {
  std::mutex mutex;
  std::unordered_map<void*, int64_t> bytes;
  c10::DeleterFnPtr inner_deleter = nullptr;  // constant once installed
};

RawSizes& raw_sizes() {
  static RawSizes* sizes = new RawSizes();  // never destroyed, as counters()
  return *sizes;
}

void delete_raw_tracked(void* data) {
  RawSizes& sizes = raw_sizes();
  int64_t nbytes = 0;
  {
    std::lock_guard<std::mutex> lock(sizes.mutex);
    auto it = sizes.bytes.find(data);
    if (it != sizes.bytes.end()) {
      nbytes = it->second;
      sizes.bytes.erase(it);
    }
  }
  sizes.inner_deleter(data);
  if (nbytes > 0) {
    MemoryCounters& c = counters();
    c.current.fetch_sub(nbytes, std::memory_order_relaxed);
    c.frees.fetch_add(1, std::memory_order_relaxed);
  }
}

/// Counts the bytes of every non-empty allocation and forwards to the CPU
/// allocator that was installed before it.
///
/// When the inner allocator supports LibTorch's raw interface (the default
/// CPU allocator does: its context is the data pointer), so does this one,
/// with the size kept in a table; oneDNN kernels allocate through it and
/// abort on an allocator without it. Otherwise the size travels in a
/// TrackedContext and raw_deleter() stays nullptr.
class TrackingAllocator final : public c10::Allocator {
 public:
  explicit TrackingAllocator(c10::Allocator* inner) : inner_(inner) {
    raw_sizes().inner_deleter = inner_->raw_deleter();
  }

  FSDP_ALLOCATOR_COPY_DATA

  c10::DataPtr allocate(size_t nbytes) FSDP_ALLOCATE_CONST override {
    c10::DataPtr inner = inner_->allocate(nbytes);
    // Empty storages hold no memory; passing them through untouched keeps
    // allocations/frees about real memory and saves a context allocation.
    if (nbytes == 0) return inner;
    void* data = inner.get();
    const c10::Device device = inner.device();
    const auto size = static_cast<int64_t>(nbytes);
    if (raw_compatible(inner)) {
      {
        RawSizes& sizes = raw_sizes();
        std::lock_guard<std::mutex> lock(sizes.mutex);
        sizes.bytes[data] = size;
      }
      inner.release_context();
      record_allocation(size);
      return c10::DataPtr(data, data, &delete_raw_tracked, device);
    }
    // Allocated before the inner context is released, so a bad_alloc here
    // still frees the inner allocation through `inner`.
    auto tracked = std::make_unique<TrackedContext>();
    tracked->inner_deleter = inner.get_deleter();
    tracked->nbytes = size;
    tracked->inner_context = inner.release_context();
    record_allocation(size);
    return c10::DataPtr(data, tracked.release(), &delete_tracked, device);
  }

  c10::DeleterFnPtr raw_deleter() const override {
    return raw_sizes().inner_deleter != nullptr ? &delete_raw_tracked : nullptr;
  }

 private:
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
TrackingAllocator* installed_allocator() {
  static TrackingAllocator* instance = [] {
    counters();  // constructed before any storage can reference it
    auto* allocator = new TrackingAllocator(c10::GetCPUAllocator());
    c10::SetCPUAllocator(allocator, kTrackingPriority);
    return allocator;
  }();
  return instance;
}

}  // namespace
}  // namespace detail

void enable_memory_tracking() { detail::installed_allocator(); }

MemoryStats memory_stats() {
  detail::TrackingAllocator* allocator = detail::installed_allocator();
  const detail::MemoryCounters& c = detail::counters();
  MemoryStats stats;
  stats.current_bytes = c.current.load(std::memory_order_relaxed);
  stats.peak_bytes = c.peak.load(std::memory_order_relaxed);
  stats.allocations = c.allocations.load(std::memory_order_relaxed);
  stats.frees = c.frees.load(std::memory_order_relaxed);
  stats.tracking = c10::GetCPUAllocator() == allocator;
  return stats;
}

void reset_peak_memory_stats() {
  detail::installed_allocator();
  detail::MemoryCounters& c = detail::counters();
  c.peak.store(c.current.load(std::memory_order_relaxed), std::memory_order_relaxed);
}

}  // namespace fsdp
