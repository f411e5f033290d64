#pragma once

namespace fsdp::detail {

/// Tunes glibc to keep freed heap memory for reuse (blocks up to 32 MiB from
/// the heap, up to 1 GiB of it kept): what keep_freed_cpu_memory() did before
/// the CPU block cache. Process-wide, idempotent; false where the C library
/// has no such setting. See Note [Reusing freed CPU memory].
bool keep_freed_heap_memory();

}  // namespace fsdp::detail
