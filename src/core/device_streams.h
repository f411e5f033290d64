#pragma once

// Note [Copy-in on a stream of its own]
// On a GPU a unit's unshard (the unsharded buffer's memory, the shard's copy
// from host memory under offload or its cast to the compute dtype, and the
// start of the all-gather, which NCCL orders after the stream current when
// it is issued) is queued on a copy-in stream of the device's own, as FSDP2
// does, so that it runs beside the previous unit's kernels instead of
// queueing behind them on the compute stream; the compute stream waits for
// the all-gather (Work::block_current_stream), never the host. Two orders
// must still hold, and both are kept with events, never recordStream:
// - The copy-in stream reads the shards, which the optimizer and the user
//   write on the compute stream: it waits for the compute stream at the
//   start of every forward, and at every unshard outside forward and
//   backward (checkpoints, summon_full_params).
// - The unsharded buffers are the copy-in stream's memory: the caching
//   allocator hands a freed block to that stream's next allocation at once,
//   while kernels on the compute stream may still read it. So inside forward
//   and backward a resharded unit's memory is held (HeldMemory: an event
//   recorded on the compute stream when it was resharded) and handed back
//   only after the copy-in stream waited for that event. A unit's own
//   unshard keeps the newest held buffer (its kernels are likely still
//   running: waiting for them would put the unshard behind them again) and
//   releases the older ones; a prefetch, which runs a unit ahead, releases
//   them all, so at most two units' gathered parameters are alive either
//   way, and which buffer is freed when depends on the schedule only, not on
//   the GPU's timing, so their peak is the same every step (not so the
//   all-gather's input under offload or mixed precision, a temporary freed
//   when the collective completes). The end of forward and of backward, and
//   the root's end, release everything held.
// The CPU has no streams: everything here does nothing for it, and its units
// free their buffers at once (the reference path).

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/Event.h>
#include <c10/core/StorageImpl.h>
#include <c10/core/Stream.h>
#include <c10/core/StreamGuard.h>

#include <optional>

namespace fsdp::detail {

/// Whether units on `device` queue work on side streams (a GPU, unless
/// FSDP_SIDE_STREAMS=0 keeps it all on the compute stream). The CPU's run
/// it on the calling thread.
bool has_streams(c10::Device device);

/// The streams a unit on a GPU queues work on beside the compute stream.
enum class SideStream {
  kCopyIn,    ///< unshards (Note [Copy-in on a stream of its own])
  kCopyOut,   ///< reduced gradients to host memory (Note [Gradients to host memory])
  kStepCopy,  ///< a gradient stepped beside backward, to host memory (finished_to_host)
  kChained,   ///< none queued: issues a collective whose input is ready (hybrid's all-reduce)
};

/// While alive, `device`'s `side` stream is the current stream of this
/// thread (the previous one is restored at the end), first made to wait for
/// the current stream where `wait_for_current`. Nothing for the CPU.
class SideStreamScope {
 public:
  SideStreamScope(c10::Device device, SideStream side, bool wait_for_current);
  ~SideStreamScope();
  SideStreamScope(const SideStreamScope&) = delete;
  SideStreamScope& operator=(const SideStreamScope&) = delete;

 private:
  std::optional<c10::Stream> previous_;
};

/// Blocks the host until what `device`'s `side` stream has queued has run;
/// nothing for the CPU.
void wait_for_side_stream(c10::Device device, SideStream side);

/// Blocks the host until what this thread's current stream on `device` has
/// queued has run; nothing for the CPU.
void wait_for_current_stream(c10::Device device);

/// This thread's current stream on `device`; the CPU's default stream for
/// the CPU.
c10::Stream current_stream(c10::Device device);

/// While alive, `stream` (another thread's current_stream()) is this
/// thread's current stream and its device the current device, so that what
/// this thread queues is ordered as that thread's work is; the previous ones
/// come back at the end. Nothing for the CPU.
class OnStream {
 public:
  explicit OnStream(c10::Stream stream);
  OnStream(const OnStream&) = delete;
  OnStream& operator=(const OnStream&) = delete;

 private:
  c10::OptionalStreamGuard guard_;
};

/// Makes `device`'s `side` stream wait for what the current stream has
/// queued, without blocking the host.
void side_stream_waits_for_current(c10::Device device, SideStream side);

/// Makes `stream` wait for what this thread's current stream on its device
/// has queued, without blocking the host; nothing for the CPU.
void stream_waits_for_current(c10::Stream stream);

/// While alive, `stream` is this thread's current stream, once it has waited
/// for the current one; at the end the current one waits for what was queued
/// on `stream` and is current again. Work moved so is ordered, for whatever
/// follows on the caller's stream (memory it frees there included), as if it
/// had run there. Nothing for the CPU, or when `stream` is current already.
class Detour {
 public:
  explicit Detour(c10::Stream stream);
  ~Detour();
  Detour(const Detour&) = delete;
  Detour& operator=(const Detour&) = delete;

 private:
  std::optional<c10::Stream> previous_;
  c10::OptionalStreamGuard guard_;
};

/// A unit's unsharded memory, taken from its storage while kernels queued on
/// the current stream may still read it, and handed back to the allocator by
/// release() once the copy-in stream, which reuses it, waits for them.
class HeldMemory {
 public:
  /// Takes `storage`'s memory (the storage is left with 0 bytes) and marks
  /// the current stream's position. `storage` is on a device with streams.
  explicit HeldMemory(c10::StorageImpl* storage);
  HeldMemory(HeldMemory&&) = default;
  HeldMemory& operator=(HeldMemory&&) = default;
  /// Frees the memory at once if release() was not called: only where no
  /// copy-in work can follow (the model is gone).
  ~HeldMemory() = default;

  /// Makes the copy-in stream wait for the marked position, then frees the
  /// memory.
  void release();

 private:
  at::DataPtr memory_;
  c10::Event resharded_;
};

}  // namespace fsdp::detail
