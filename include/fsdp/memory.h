#pragma once

#include <cstdint>

namespace fsdp {

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

/// Makes the C library keep freed CPU memory for reuse instead of returning it
/// to the OS and faulting it in again page by page at the next allocation
/// (glibc: blocks up to 32 MiB come from the heap, and up to 1 GiB of freed
/// heap is kept). Training steps allocate and free blocks the size of a unit
/// all the time: on GPT-mini (2 blocks, 1 rank) this made steps 28% (plain
/// LibTorch) to 47% (FULL_SHARD) shorter. The cost is that the process's resident memory stays near
/// its peak. Process-wide and idempotent; call it once, early. Returns false where the C library
/// has no such setting (then nothing changed). See Note [Reusing freed CPU memory].
bool keep_freed_cpu_memory();

}  // namespace fsdp
