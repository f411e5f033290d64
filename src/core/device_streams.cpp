#include "core/device_streams.h"

#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>

#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <utility>

#include "detail/env.h"

namespace fsdp::detail {

namespace {

// One stream per GPU and purpose, taken from LibTorch's pool once. The
// copy-in stream has high priority: a forward waits for its all-gathers, as
// for FSDP2's.
c10::Stream side_stream(c10::Device device, SideStream side) {
  static std::mutex mutex;
  static std::map<std::pair<c10::DeviceIndex, SideStream>, c10::Stream> streams;
  const c10::impl::VirtualGuardImpl impl(device.type());
  const c10::DeviceIndex index = device.has_index() ? device.index() : impl.getDevice().index();
  std::lock_guard<std::mutex> lock(mutex);
  const auto key = std::make_pair(index, side);
  auto it = streams.find(key);
  if (it == streams.end()) {
    it = streams
             .emplace(key,
                      impl.getStreamFromGlobalPool(c10::Device(device.type(), index),
                                                   /*isHighPriority=*/side == SideStream::kCopyIn))
             .first;
  }
  return it->second;
}

// FSDP_FAULT_COPY_IN_NO_WAIT=1 drops the copy-in stream's waits for the
// compute stream, =held only the one before held memory is handed back: a
// GPU test shows that its buffers are then overwritten while kernels still
// read them (tests/core/test_cuda_streams.cpp).
bool skip_wait(bool for_held) {
  const char* env = std::getenv("FSDP_FAULT_COPY_IN_NO_WAIT");
  if (env == nullptr) return false;
  return std::strcmp(env, "1") == 0 || (for_held && std::strcmp(env, "held") == 0);
}

// Makes `side` wait for `event` (the copy-in stream not, under the fault).
void side_waits(c10::Device device, SideStream side, const c10::Event& event,
                bool for_held = false) {
  if (side == SideStream::kCopyIn && skip_wait(for_held)) return;
  event.block(side_stream(device, side));
}

}  // namespace

bool has_streams(c10::Device device) {
  // FSDP_SIDE_STREAMS=0 keeps everything on the compute stream, as before
  // the side streams: bench/gpu_step.sh measures what they bring.
  static const bool enabled = env_switch_on("FSDP_SIDE_STREAMS");
  return enabled && device.is_cuda();
}

SideStreamScope::SideStreamScope(c10::Device device, SideStream side, bool wait_for_current) {
  if (!has_streams(device)) return;
  if (wait_for_current) side_stream_waits_for_current(device, side);
  const c10::impl::VirtualGuardImpl impl(device.type());
  previous_ = impl.exchangeStream(side_stream(device, side));
}

SideStreamScope::~SideStreamScope() {
  if (!previous_) return;
  const c10::impl::VirtualGuardImpl impl(previous_->device_type());
  impl.exchangeStream(*previous_);
}

void wait_for_side_stream(c10::Device device, SideStream side) {
  if (has_streams(device)) side_stream(device, side).synchronize();
}

void wait_for_current_stream(c10::Device device) {
  if (!device.is_cpu()) current_stream(device).synchronize();
}

c10::Stream current_stream(c10::Device device) {
  if (device.is_cpu()) return c10::Stream(c10::Stream::DEFAULT, device);
  const c10::impl::VirtualGuardImpl impl(device.type());
  return impl.getStream(device.has_index() ? device : impl.getDevice());
}

OnStream::OnStream(c10::Stream stream) {
  if (!stream.device().is_cpu()) guard_.reset_stream(stream);
}

void side_stream_waits_for_current(c10::Device device, SideStream side) {
  if (!has_streams(device)) return;
  c10::Event event(device.type());
  event.record(current_stream(device));
  side_waits(device, side, event);
}

void stream_waits_for_current(c10::Stream stream) {
  if (stream.device().is_cpu()) return;
  c10::Event event(stream.device_type());
  event.record(current_stream(stream.device()));
  stream.wait(event);
}

Detour::Detour(c10::Stream stream) {
  if (stream.device().is_cpu() || stream == current_stream(stream.device())) return;
  previous_ = current_stream(stream.device());
  stream_waits_for_current(stream);
  guard_.reset_stream(stream);
}

Detour::~Detour() {
  if (previous_) stream_waits_for_current(*previous_);  // current: still the detour's
}

HeldMemory::HeldMemory(c10::StorageImpl* storage)
    : memory_(storage->set_data_ptr(at::DataPtr(nullptr, storage->device()))),
      resharded_(storage->device_type()) {
  TORCH_INTERNAL_ASSERT(has_streams(storage->device()), "fsdp: held memory on ", storage->device());
  storage->set_nbytes(0);
  resharded_.record(current_stream(storage->device()));
}

void HeldMemory::release() {
  if (memory_.get() == nullptr) return;
  side_waits(memory_.device(), SideStream::kCopyIn, resharded_, /*for_held=*/true);
  memory_.clear();
}

}  // namespace fsdp::detail
