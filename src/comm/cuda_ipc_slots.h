#pragma once

// Note [Ranks sharing a GPU]
// NCCL before 2.30 refuses two ranks on one GPU ("Duplicate GPU"), and the
// staged path (Note [Tensors on other devices than the engine's]) moves every
// collective's bytes over PCIe to the host, through the CPU engine and back,
// synchronously: two ranks of GPT-2 small sharing an H100 took 288 ms a step
// against 62 ms at world 1. Processes on one GPU can read each other's memory
// instead. Each rank allocates two slots with cudaMalloc (outside the caching
// allocator, so a slot never moves), exports them with cudaIpcGetMemHandle,
// and its peers map them with cudaIpcOpenMemHandle, the handles passing
// through the group's store. The rounds of Note [Shared memory for same-host
// ranks] then run unchanged: their control words (posted, done, descriptors,
// the abort word, the peers' pids) stay in the host segment, and only the
// slots move to the GPU (ShmLinks' SlotMemory). A round's writes and reads are
// device-to-device copies and ATen kernels on the group's own stream, which
// first waits for an event recorded on the caller's stream when the
// collective was issued; the stream is synchronised before a round is posted
// and before it is marked read, so a peer never sees half-written bytes and a
// slot is never overwritten while read. Results are the same bits on every
// rank, as over host shared memory (all-reduce sums the slots in rank order).
// Only ranks whose devices have the same UUID use it (different GPUs have
// NCCL); a failing CUDA call on any rank gives every rank "no".

#include <c10/core/Device.h>

#include "comm/shm_links.h"

namespace fsdp::detail {

/// Bytes of one GPU slot (two per rank): large enough that a transformer
/// block's all-gather or reduce-scatter is one round.
constexpr int64_t kGpuSlotBytes = int64_t{32} << 20;

/// Opens the slots of Note [Ranks sharing a GPU] on `device` for
/// ShmLinks::connect(); the opener returns nullptr where this rank cannot (a
/// build without CUDA, another GPU than a peer's, a failing CUDA call).
SlotOpener cuda_ipc_slot_opener(c10::Device device);

}  // namespace fsdp::detail
