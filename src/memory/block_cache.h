#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <set>
#include <utility>

namespace fsdp::detail {

/// Note [CPU block cache]
/// A training step allocates and frees the same large CPU blocks over and
/// over: FSDP's unsharded flat parameters and gradients (a unit's worth each),
/// reduce-scatter outputs, the optimizer's temporaries over a flat shard, and
/// activations. Left to glibc, each such block either comes from a fresh
/// mmap (its pages faulted in and zeroed again every step: up to 2x slower
/// steps, Note [Reusing freed CPU memory]) or, once glibc raises its mmap
/// threshold, from the heap, which fragments and keeps the freed blocks of
/// every size it has seen: FULL_SHARD then used as much resident memory as no
/// sharding at all (issue 18). keep_freed_cpu_memory() chose the first cost's
/// opposite, resident memory stuck at its peak.
///
/// The cache owns those blocks instead, as PyTorch's CUDA caching allocator
/// does for device memory. Every CPU allocation of at least kMinBytes is a
/// range of whole pages of private anonymous memory. A freed range is kept,
/// merged with free neighbours (adjacent addresses), and serves later
/// requests: the smallest free range that is large enough, split when larger
/// (the rest stays free). A step that repeats the last one's sizes therefore
/// faults in nothing, and since ranges split and merge, no request holds
/// more pages than it asked for. What bounds resident memory is the limit on
/// new memory: when no free range is large enough, the ranges in use, the
/// free ones and the new one together may be at most the peak of bytes in
/// use so far (counting the new request) plus 1/16 of it; free ranges are
/// unmapped, least recently freed first, until the new mapping fits. So the
/// cache never holds more than the largest working set the program has shown
/// (+1/16), whatever sizes it cycles through. Blocks below kMinBytes stay
/// with malloc, whose heap they cannot fragment much.
///
/// Under AddressSanitizer a free range is poisoned, so a use after free of a
/// large tensor is still reported.
class BlockCache {
 public:
  /// Smallest request served by the cache.
  static constexpr size_t kMinBytes = size_t{1} << 20;

  /// A page-rounded block of at least `bytes` (>= kMinBytes): part or all of
  /// a free range, or a new mapping. Throws c10::Error when no memory can be
  /// mapped. Returns the block's size in `block_bytes`, for give_back().
  void* take(size_t bytes, size_t& block_bytes);

  /// Keeps a block from take() for reuse.
  void give_back(void* data, size_t block_bytes);

  /// Unmaps every free range.
  void release_cached();

  /// Bytes of the free ranges kept for reuse.
  int64_t cached_bytes() const;

  /// Counts since the process started, for benchmarks and tests.
  struct Stats {
    int64_t reused = 0;        // requests served from a free range
    int64_t split = 0;         // of those, from a larger one (the rest stays free)
    int64_t mapped = 0;        // requests served by a new mapping
    int64_t evicted = 0;       // free ranges unmapped to make room
    int64_t peak_in_use = 0;   // highest bytes in use at once
    int64_t mapped_bytes = 0;  // bytes mapped now (in use + free)
    int64_t cached_bytes = 0;  // of those, free
  };
  /// Current counts.
  Stats stats() const;

 private:
  /// A free range.
  struct Range {
    size_t bytes = 0;
    uint64_t age = 0;  // when it was last freed or merged: larger is more recent
  };

  /// Adds a free range. REQUIRES: mutex_ held.
  void insert_free(char* data, size_t bytes);
  /// Removes the free range at `it` from every index. REQUIRES: mutex_ held.
  void erase_free(std::map<char*, Range>::iterator it);
  /// Unmaps the least recently freed range. REQUIRES: mutex_ held, one free.
  void evict_oldest();

  mutable std::mutex mutex_;
  // State below is protected by mutex_.
  size_t in_use_ = 0;       // bytes handed out and not given back
  size_t peak_in_use_ = 0;  // highest in_use_ so far
  size_t cached_ = 0;       // bytes of the free ranges
  uint64_t next_age_ = 0;
  Stats stats_;
  /// Free ranges by address (for merging), by (size, address) (for the best
  /// fit) and by age (for eviction).
  std::map<char*, Range> by_addr_;
  std::set<std::pair<size_t, char*>> by_size_;
  std::map<uint64_t, char*> by_age_;
};

}  // namespace fsdp::detail
