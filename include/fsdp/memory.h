#pragma once

#include <cstdint>
#include <string>

namespace fsdp {

/// A size as libfsdp's messages write it: "512 B", "1.5 MiB", "12.3 GiB".
std::string format_bytes(int64_t bytes);

/// Bytes of CPU tensor storage, as counted by libfsdp's tracking allocator.
///
/// Only storages allocated through LibTorch's CPU allocator after
/// enable_memory_tracking() are counted: a storage allocated earlier keeps the
/// allocator it was created with (also for later resizes of that storage), so
/// neither its bytes nor its frees appear here. Memory LibTorch takes without
/// the CPU allocator (from_blob, mmap'ed files, oneDNN scratch, the heap of
/// TensorImpl objects themselves) is not counted either.
struct MemoryStats {
  /// Bytes held right now by counted storages.
  int64_t current_bytes = 0;
  /// Highest current_bytes since tracking began or the last
  /// reset_peak_memory_stats().
  int64_t peak_bytes = 0;
  /// Counted allocations of more than 0 bytes since tracking began.
  int64_t allocations = 0;
  /// Frees of counted allocations since tracking began.
  int64_t frees = 0;
  /// Bytes of freed blocks that the CPU block cache keeps for reuse (resident
  /// memory beyond current_bytes; see enable_cpu_block_cache()).
  int64_t cached_bytes = 0;
  /// The process's resident memory now (VmRSS), and its highest so far
  /// (getrusage's ru_maxrss): what `top` shows, beside the tensor bytes
  /// above. -1 where the OS does not tell.
  int64_t resident_bytes = -1;
  /// See resident_bytes.
  int64_t peak_resident_bytes = -1;
  /// Whether the tracking allocator is LibTorch's CPU allocator right now; false
  /// if it could not be installed or was displaced by a later
  /// c10::SetCPUAllocator() with a higher priority.
  bool tracking = false;
};

/// Installs the tracking allocator in front of LibTorch's current CPU
/// allocator. Idempotent and thread-safe; memory_stats() and
/// reset_peak_memory_stats() call it the first time, so calling it explicitly
/// only matters to start counting before the first query. Call it early
/// (before the storages you want counted exist, ideally before starting
/// threads that allocate tensors): storages allocated before installation are
/// never counted, and freeing them later leaves the counts untouched.
void enable_memory_tracking();

/// Current counts (installs tracking on first use). The fields are read one by
/// one, so under concurrent allocation they are not a single snapshot.
MemoryStats memory_stats();

/// Sets peak_bytes to current_bytes (installs tracking on first use), so a
/// benchmark or test can measure the peak of one phase.
void reset_peak_memory_stats();

/// Serves LibTorch's CPU allocations of 1 MiB and more from libfsdp's block
/// cache: a freed block is kept and reused for the next request of its size,
/// as PyTorch's CUDA caching allocator does for device memory, and cached
/// blocks are returned to the OS whenever keeping them would make the cache
/// larger than the peak of blocks in use so far (plus 1/16). Steps then fault
/// in no fresh pages, and the process's resident memory follows what the
/// tensors need (after sharding, FSDP's unit-sized buffers) instead of
/// malloc's heap. FSDP turns it on when its first unit is constructed; set
/// FSDP_CPU_BLOCK_CACHE=0 to keep LibTorch's own allocator for those. Calling
/// it explicitly turns it on regardless (e.g. for a model without FSDP).
/// Process-wide and idempotent. Returns whether libfsdp's allocator is
/// LibTorch's CPU allocator now (false if a later c10::SetCPUAllocator() of
/// higher priority displaced it). See Note [CPU block cache].
bool enable_cpu_block_cache();

/// Returns every block the CPU block cache keeps for reuse to the OS, like
/// torch.cuda.empty_cache(); the blocks in use stay. For instance after a
/// phase whose peak the training steps never reach again.
void empty_cpu_block_cache();

/// Kept for code written before the CPU block cache: it now calls
/// enable_cpu_block_cache() and returns its result. It used to make glibc
/// keep all freed memory for reuse (faster steps, but resident memory stuck at
/// its peak); the block cache reuses large blocks as well without that cost,
/// and FSDP units turn it on anyway. See Note [CPU block cache].
bool keep_freed_cpu_memory();

}  // namespace fsdp
