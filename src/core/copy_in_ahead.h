#pragma once

// Note [Copy-in at the step]
// Under CPU offload the first unit of a forward (the root: GPT's token
// embedding) is copied to the GPU when the forward begins, while the GPU has
// nothing else to run: 79 MB of bf16 for GPT-2 small's root, about 3 ms at
// the H200 machine's 26.7 GB/s, every step. Its host step, the last of the
// step beside backward (its gradient is the last backward makes), writes
// the compute-dtype host copy each unshard sends (Note [A host copy in the
// compute dtype]) part by part as the gradient lands (Note [Stepping a
// gradient as it lands]). So each part's new values are sent to the device
// as soon as they are written, on the copy-in stream, while the host steps
// the next part, and the next forward's unshard takes that device copy
// instead of copying: the copy runs beside the step it used to follow. It
// is taken only if nothing wrote the shard or its host copy since its last
// part (the two version counters, as for the host copy itself); otherwise
// it is dropped and the unshard copies as before. One unit's worth of
// compute-dtype shard stays on the device between the step and the next
// forward; only the unit the forward order (Note [Forward order]) puts first
// does it. FSDP_COPY_IN_AT_STEP=0 turns it off (an A/B in
// bench/gpu_step.sh). On the CPU the same copies run between host buffers:
// the reference path.

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/Event.h>

#include <cstdint>
#include <mutex>
#include <optional>

namespace fsdp::detail {

/// Whether units copy the next forward's first unit in at the step
/// (FSDP_COPY_IN_AT_STEP, on unless "0").
bool copy_in_at_step_enabled();

/// A shard's compute-dtype host copy sent to the device range by range as
/// the optimizer writes it, for the next unshard. Thread-safe: filled on the
/// optimizer's thread, taken on the one that unshards.
class CopyInAhead {
 public:
  /// kEmpty: nothing sent. kFilling: the ranges from 0 up to filled() are
  /// queued. kReady: the whole copy is queued, its event recorded after it.
  enum class State { kEmpty, kFilling, kReady };
  /// The version counters of a shard and of its host copy.
  struct Versions {
    int64_t shard = 0;
    int64_t copy = 0;
    bool operator==(const Versions& o) const { return shard == o.shard && copy == o.copy; }
  };

  /// For copies to `device` (a GPU, or the CPU's reference path).
  explicit CopyInAhead(c10::Device device);

  /// Queues elements [begin, end) of `source` (the host copy, 1-D) to the
  /// device, on the copy-in stream, without the host waiting. Ranges come in
  /// order from 0; a range starting at 0 starts again, one out of order
  /// empties it, and so does one whose `versions` (those after the range
  /// was written) are not one write of each past the range before it's, or
  /// for the first range past `handed_over` (the versions when the
  /// gradient was handed over, before any range was stepped). At the range
  /// that ends `source`, records the event.
  void send(const at::Tensor& source, int64_t begin, int64_t end, Versions versions,
            Versions handed_over);
  /// The device copy if it is ready and `now` equals the versions recorded
  /// at its last range; the current stream then waits for it. Empty after.
  std::optional<at::Tensor> take(Versions now);
  /// Current state.
  State state() const;
  /// How many times take() returned the copy.
  int64_t taken() const;

 private:
  c10::Device device_;
  mutable std::mutex mutex_;
  State state_ = State::kEmpty;
  at::Tensor copy_;  // on device_, source's size and dtype
  int64_t filled_ = 0;
  std::optional<c10::Event> sent_;  // after the last range, on a GPU
  Versions versions_;
  int64_t taken_ = 0;
};

/// The name of a CopyInAhead state, for messages.
const char* to_string(CopyInAhead::State state);

}  // namespace fsdp::detail
