#include "core/device_storage.h"

#include <ATen/Context.h>
#include <ATen/native/Resize.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/TensorOptions.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#if FSDP_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#endif

#include <algorithm>
#include <limits>
#include <sstream>
#include <utility>

#include "core/device_streams.h"
#include "detail/torch_compat.h"
#include "memory/host_available.h"

namespace fsdp::detail {

bool unit_device_supported(c10::Device device) {
  return device.is_cpu() ||
         (device.is_cuda() && at::hasCUDA() &&
          (!device.has_index() || static_cast<size_t>(device.index()) < at::getNumGPUs()));
}

void resize_storage_bytes(c10::StorageImpl* storage, size_t bytes) {
  const c10::Device device = storage->device();
  // The device type only: resolve_unit_device checked the device itself
  // once, and this runs at every unshard and reshard.
  TORCH_INTERNAL_ASSERT(device.is_cpu() || device.is_cuda(), "fsdp: no storage resize on ", device);
  if (device.is_cpu()) {
    at::native::resize_bytes_cpu(storage, bytes);
  } else {
    resize_with_allocator(storage, bytes);
  }
}

void resize_with_allocator(c10::StorageImpl* storage, size_t bytes) {
  const size_t old_bytes = storage->nbytes();
  if (old_bytes == bytes) return;
  c10::Allocator* allocator = storage->allocator();
  TORCH_INTERNAL_ASSERT(allocator != nullptr, "fsdp: a storage without an allocator on ",
                        storage->device());
  const c10::Device device = storage->device();
  const c10::DeviceGuard guard(device);
  at::DataPtr fresh = allocator->allocate(bytes);
  const size_t keep = std::min(old_bytes, bytes);
  if (keep > 0) {
    // On the device's current stream, which orders it after the kernels
    // that wrote the old bytes and before the old memory's reuse.
    const auto as_bytes = at::TensorOptions().dtype(at::kByte).device(device);
    const auto n = static_cast<int64_t>(keep);
    at::from_blob(fresh.get(), {n}, as_bytes)
        .copy_(at::from_blob(storage->data_ptr().get(), {n}, as_bytes));
  }
  storage->set_data_ptr_noswap(std::move(fresh));
  storage->set_nbytes(bytes);
}

at::Tensor host_buffer(int64_t numel, c10::ScalarType dtype, bool pinned,
                       const std::string& owner) {
  const auto options = at::TensorOptions().dtype(dtype).device(c10::kCPU);
  if (!pinned) return at::empty({numel}, options);
  try {
    return at::empty({numel}, options.pinned_memory(true));
  } catch (const c10::Error& e) {
    const int64_t bytes = numel * static_cast<int64_t>(c10::elementSize(dtype));
    TORCH_CHECK(false, "fsdp: ", owner, ": could not pin ", bytes,
                " bytes of host memory for its offloaded shard (", e.what_without_backtrace(),
                "); raise the locked-memory limit (`ulimit -l`, a container's memlock) or pass "
                "CPUOffload().pin_memory(false)");
  }
}

// Note [Gradients to host memory]
// Under CPU offload each reduced gradient shard goes to host memory before
// the optimizer reads it. A plain .to(kCPU) per unit made the host wait for
// the GPU at every unit, into fresh pageable memory (page faults on every
// step): on an H100 forward and backward of a 163 M-parameter model took
// 363 ms offloaded against 62 ms a whole step without. So each copy goes
// into pinned memory without the host waiting (start_host_copy), and the
// host waits once, at the end of backward, after the gradients agreement,
// before the shards get their .grad. Where the reduction runs on a GPU stream
// (NCCL), the copy is queued as soon as the reduction is launched, on a
// copy-out stream that waits for it (device_streams.h), so it runs beside
// the backward kernels that follow, as FSDP2 copies on its reduction
// stream; the reduced shard on the GPU is kept until its copy has run (an
// event, looked at each time a later unit queues its copy; the end of
// backward waits for the rest), so the GPU holds only the shards whose
// copies are still queued, not every unit's (RootState::release_copied_out).
// Otherwise the end of backward queues it on the compute stream. A unit
// stepped beside backward copies on a stream of its own, the step-copy
// stream, so its copy does not queue behind the backward kernels issued
// since: queued at the hand-over behind the reduction where a stream can
// wait for it (Note [Copies queued at the hand-over] in
// src/runtime/unit_hooks.cpp), else by the optimizer's thread after its
// host wait (finished_to_host).
at::Tensor start_host_copy(const at::Tensor& t, c10::ScalarType dtype) {
  at::Tensor host =
      at::empty(t.sizes(), at::TensorOptions().dtype(dtype).device(c10::kCPU).pinned_memory(true));
  host.copy_(t, /*non_blocking=*/true);
  return host;
}

at::Tensor staged_for_cast(const at::Tensor& host, c10::Device device, c10::ScalarType dtype,
                           bool non_blocking) {
  if (!device.is_cuda() || !host.device().is_cpu() || host.scalar_type() == dtype) return host;
  return host.to(device, host.scalar_type(), non_blocking);
}

void wait_for_device(c10::Device device) {
#if FSDP_WITH_CUDA
  if (device.is_cuda()) c10::cuda::getCurrentCUDAStream(device.index()).synchronize();
#else
  (void)device;
#endif
}

at::Tensor finished_to_host(const at::Tensor& t, c10::ScalarType dtype) {
  if (t.is_cuda()) {
    // The step-copy side stream, so the host waits for this copy, not for
    // the backward kernels queued since on the compute stream. (Like every
    // side stream it comes from LibTorch's pool, which after 32 draws may
    // hand it to another user, c10d's NCCL streams included: the wait then
    // covers their work too.)
    const SideStreamScope step_copy(t.device(), SideStream::kStepCopy, /*wait_for_current=*/false);
    at::Tensor host = start_host_copy(t, dtype);
    wait_for_device(t.device());  // the scope's stream, or the current one without side streams
    return host;
  }
  return t.to(c10::kCPU, dtype);
}

HostCopyInParts::HostCopyInParts(std::vector<at::Tensor> dsts,
                                 std::vector<std::vector<Segment>> parts)
    : dsts_(std::move(dsts)), parts_(std::move(parts)) {}

HostCopyInParts::~HostCopyInParts() {
  // The copies read src_ on the step-copy stream, not the stream its memory
  // was allocated on: it goes back to the allocator only after they ran.
  try {
    if (!landed_.empty()) compat::synchronize_event(landed_.back());
  } catch (...) {  // NOLINT(bugprone-empty-catch): a destructor; the device failed already
  }
}

void HostCopyInParts::start(const at::Tensor& src) {
  TORCH_INTERNAL_ASSERT(state_ == State::kIdle, "fsdp: HostCopyInParts started twice");
  state_ = State::kCopying;
  src_ = src;
  if (!src_.is_cuda()) {
    // Copied part by part in wait(), as parts land from a GPU: a read
    // before its part's wait() sees NaN, not the values (only the tests
    // cut gradients of CPU units into parts: FSDP_GRAD_PART_ELEMENTS).
    for (at::Tensor& dst : dsts_) {
      if (at::isFloatingType(dst.scalar_type()))
        dst.fill_(std::numeric_limits<double>::quiet_NaN());
    }
    return;
  }
  // As finished_to_host: the step-copy stream, so the copies wait for
  // nothing queued on the compute stream.
  const SideStreamScope step_copy(src_.device(), SideStream::kStepCopy,
                                  /*wait_for_current=*/false);
  const c10::impl::VirtualGuardImpl impl(src_.device().type());
  const c10::Stream stream = impl.getStream(src_.device());
  landed_.reserve(parts_.size() + 1);
  try {
    for (const auto& part : parts_) {
      copy_part(part, /*non_blocking=*/true);
      landed_.emplace_back(src_.device().type());
      landed_.back().record(stream);
    }
  } catch (...) {
    // A part queued in half (a cast's temporary out of memory): the
    // destructor's wait must come after what it queued, which reads src_.
    state_ = State::kFailed;
    landed_.emplace_back(src_.device().type());
    landed_.back().record(stream);
    throw;
  }
}

void HostCopyInParts::wait(size_t i) {
  TORCH_INTERNAL_ASSERT(state_ != State::kIdle && i < parts_.size(), "fsdp: HostCopyInParts::wait(",
                        i, ") before start() or past the parts");
  TORCH_CHECK(state_ != State::kFailed,
              "fsdp: a gradient's copy to host memory failed to start; its parts hold no values");
  for (; waited_ <= i; ++waited_) {
    if (src_.is_cuda()) {
      compat::synchronize_event(landed_[waited_]);
    } else {
      copy_part(parts_[waited_], /*non_blocking=*/false);
    }
  }
  if (waited_ == parts_.size() && state_ == State::kCopying) {
    state_ = State::kLanded;
    src_ = at::Tensor();  // every copy of it ran
  }
}

void HostCopyInParts::copy_part(const std::vector<Segment>& part, bool non_blocking) {
  for (const Segment& s : part) {
    dsts_[s.dst]
        .view({-1})
        .narrow(0, s.dst_offset, s.numel)
        .copy_(src_.narrow(0, s.src_offset, s.numel), non_blocking);
  }
}

void HostCopyInParts::wait_all() {
  if (!parts_.empty()) wait(parts_.size() - 1);
}

int64_t device_free_bytes(c10::Device device) {
  if (device.is_cpu()) return host_available_bytes();
#if FSDP_WITH_CUDA
  if (device.is_cuda() && unit_device_supported(device)) {
    const c10::cuda::CUDAGuard guard(device);
    size_t free = 0;
    size_t total = 0;
    if (cudaMemGetInfo(&free, &total) != cudaSuccess) {
      (void)cudaGetLastError();  // leave no sticky error for LibTorch's next call
      return -1;
    }
    const compat::CudaMemory held = compat::cuda_memory(device.index());
    return static_cast<int64_t>(free) + (held.reserved - held.allocated);
  }
#endif
  return -1;
}

bool conversion_keeps(c10::Device device, c10::ScalarType dtype,
                      c10::optional<c10::Device> to_device,
                      c10::optional<c10::ScalarType> to_dtype) {
  if (to_dtype && *to_dtype != dtype) return false;
  if (!to_device) return true;
  if (to_device->type() != device.type()) return false;
  if (device.is_cpu() || to_device->index() == device.index()) return true;
  // Only a GPU's unit asks its runtime for the current device.
  return !to_device->has_index() &&
         c10::impl::VirtualGuardImpl(device.type()).getDevice().index() == device.index();
}

std::string conversion_refusal(const std::string& change, const std::string& what,
                               c10::Device device, c10::ScalarType dtype) {
  std::ostringstream out;
  out << change << " " << what << " (on " << device << ", " << dtype << "): a unit's parameters "
      << "stay on the device and in the dtype they were wrapped with. Move or convert the module "
      << "before wrapping it (module->to(...) before the wrapper or fsdp::fully_shard), or wrap it "
      << "with FSDPOptions().device_id(device), which moves it there";
  return out.str();
}

c10::DispatchKey dense_backend_key(c10::Device device) {
  return c10::computeDispatchKey(c10::nullopt, c10::kStrided, device);
}

}  // namespace fsdp::detail
