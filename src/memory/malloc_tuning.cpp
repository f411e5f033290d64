#include <fsdp/memory.h>

#include "memory/malloc_tuning.h"

#include <climits>
#include <mutex>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace fsdp {

/// Note [Reusing freed CPU memory]
/// glibc serves blocks above its mmap threshold (128 KiB at first, raised
/// only as far as the largest block freed so far) with fresh mmap()s, and
/// returns the top of the heap to the OS once more than twice that is free.
/// A training step allocates and frees large blocks all the time: FSDP's
/// unsharded flat buffers and gradient buffers (a block's worth each), and
/// the optimizer's temporaries, which over a flat parameter are as large as
/// the unit. Each such block comes back as zeroed pages, one page fault per
/// 4 KiB: measured on GPT-mini (2 blocks, 1 rank), AdamW's step took 131 ms
/// over flat buffers and 39 ms over separate tensors, and 12 ms for both once
/// glibc kept its freed memory; the whole FULL_SHARD step went from 939 to
/// 502 ms (local: 663 to 475 ms). PyTorch users get the same effect from
/// jemalloc or tcmalloc; this is the same idea with the C library's own knobs:
/// serve blocks up to 32 MiB (glibc's largest threshold) from the heap, and
/// keep up to 1 GiB of freed heap for reuse. Setting them also turns glibc's
/// dynamic threshold off, so both are always set together.
///
/// Superseded by the CPU block cache (Note [CPU block cache]), which gets
/// the same reuse without keeping resident memory at its peak: the public
/// keep_freed_cpu_memory() now turns the cache on, and this glibc tuning
/// stays for the benchmarks' comparison (BENCH_CPU_MEMORY=kept).
bool detail::keep_freed_heap_memory() {
#if defined(__GLIBC__)
  static const bool ok = [] {
    const bool mmap_ok = mallopt(M_MMAP_THRESHOLD, 32 << 20) == 1;
    const bool trim_ok = mallopt(M_TRIM_THRESHOLD, 1 << 30) == 1;
    return mmap_ok && trim_ok;
  }();
  return ok;
#else
  return false;
#endif
}

bool keep_freed_cpu_memory() { return enable_cpu_block_cache(); }

}  // namespace fsdp
