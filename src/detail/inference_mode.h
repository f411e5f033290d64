#pragma once

// Leaving c10::InferenceMode for what libfsdp makes (Note [Inference mode]).

#include <c10/core/GradMode.h>
#include <c10/core/InferenceMode.h>

#include <optional>

namespace fsdp::detail {

// Note [Inference mode]
// c10::InferenceMode, LibTorch's guard for inference, makes every tensor
// created under it an inference tensor: no autograd-recording operator may
// use it, and nothing may write it in place outside the mode. A unit's
// forward hooks run under the user's guard, but what they make outlives it:
// a unit's first forward allocates its buffers (gathered parameters, compute
// copies), and the tensors of a collective are written by the communication
// thread, outside the mode. Made as inference tensors, the next training
// forward could not use them, and the collective failed ("Inplace update to
// inference tensor outside InferenceMode"). So the hooks leave the mode,
// with gradients still off as it had them, and make normal tensors; the
// module's own operators still run under it. Collectives issued under the
// mode anywhere else (a state dict taken in it) run under it on the
// communication thread too (CommThread), so it may write what they return.

/// While it lives, the thread is out of c10::InferenceMode if it was in it,
/// with gradients off; otherwise it changes nothing.
class OutsideInferenceMode {
 public:
  OutsideInferenceMode() {
    if (!c10::InferenceMode::is_enabled()) return;
    mode_.emplace(false);
    grad_.emplace(false);
  }
  OutsideInferenceMode(const OutsideInferenceMode&) = delete;
  OutsideInferenceMode& operator=(const OutsideInferenceMode&) = delete;

 private:
  std::optional<c10::InferenceMode> mode_;  // destroyed last: restores the whole state
  std::optional<c10::AutoGradMode> grad_;
};

}  // namespace fsdp::detail
