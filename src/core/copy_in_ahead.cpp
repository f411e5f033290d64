#include "core/copy_in_ahead.h"

#include <ATen/ATen.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include "core/device_streams.h"
#include "detail/env.h"

// See Note [Copy-in at the step] in copy_in_ahead.h.

namespace fsdp::detail {

bool copy_in_at_step_enabled() { return env_switch_on("FSDP_COPY_IN_AT_STEP"); }

CopyInAhead::CopyInAhead(c10::Device device) : device_(device) {}

void CopyInAhead::send(const at::Tensor& source, int64_t begin, int64_t end, Versions versions,
                       Versions handed_over) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (begin == 0) {
    state_ = State::kFilling;
    filled_ = 0;
    sent_.reset();
    versions_ = handed_over;
  }
  // Each range was written by its own step of the range, which bumps both
  // counters once (fsdp::optim::FusedAdamW): anything else (a range not
  // written, as a first range whose step waits for the last; another write
  // in between) and what was sent may not be the values, so nothing is.
  const bool in_order = state_ == State::kFilling && begin == filled_ && end <= source.numel() &&
                        versions == Versions{versions_.shard + 1, versions_.copy + 1};
  if (!in_order) {
    state_ = State::kEmpty;
    copy_ = at::Tensor();
    return;
  }
  versions_ = versions;
  const SideStreamScope copy_in(device_, SideStream::kCopyIn, /*wait_for_current=*/false);
  if (!copy_.defined() || copy_.numel() != source.numel()) {
    copy_ = at::empty({source.numel()},
                      at::TensorOptions().dtype(source.scalar_type()).device(device_));
  }
  copy_.narrow(0, begin, end - begin)
      .copy_(source.narrow(0, begin, end - begin), /*non_blocking=*/true);
  filled_ = end;
  if (end < source.numel()) return;
  state_ = State::kReady;
  if (!device_.is_cpu()) {  // the CPU's copies ran already
    const c10::impl::VirtualGuardImpl impl(device_.type());
    sent_.emplace(device_.type());
    sent_->record(impl.getStream(device_));
  }
}

std::optional<at::Tensor> CopyInAhead::take(Versions now) {
  std::lock_guard<std::mutex> lock(mutex_);
  std::optional<at::Tensor> out;
  if (state_ == State::kReady && versions_ == now) {
    if (sent_) {
      const c10::impl::VirtualGuardImpl impl(device_.type());
      sent_->block(impl.getStream(device_));
    }
    out = copy_;
    ++taken_;
  }
  state_ = State::kEmpty;
  copy_ = at::Tensor();
  filled_ = 0;
  sent_.reset();
  return out;
}

CopyInAhead::State CopyInAhead::state() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return state_;
}

int64_t CopyInAhead::taken() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return taken_;
}

const char* to_string(CopyInAhead::State state) {
  switch (state) {
    case CopyInAhead::State::kEmpty:
      return "kEmpty";
    case CopyInAhead::State::kFilling:
      return "kFilling";
    case CopyInAhead::State::kReady:
      return "kReady";
  }
  return "?";
}

}  // namespace fsdp::detail
