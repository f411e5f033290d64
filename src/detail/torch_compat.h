#pragma once

// Every difference between LibTorch 1.13 and 2.x that libfsdp meets lives here.
// 1.13: c10d::ProcessGroupGloo derives from c10d::ProcessGroup.
// 2.x:  it derives from c10d::Backend and is wrapped in a c10d::ProcessGroup.
// Builds without Gloo (FSDP_WITH_GLOO=0, pip's wheel: Note [Gloo or not] in
// src/comm/gloo_engine.h) cannot include c10d's ProcessGroupGloo.hpp, which
// includes Gloo's headers.

#include <torch/version.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#if FSDP_WITH_GLOO
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include <gloo/transport/tcp/device.h>
#endif

#if FSDP_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

#include <ATen/autocast_mode.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/_amp_foreach_non_finite_check_and_unscale.h>
#include <c10/core/Event.h>
#include <c10/core/StorageImpl.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>

#include <chrono>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#define FSDP_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) ||       \
   (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

// The dispatch key that marks sharded placeholders (Note [Sharded
// placeholders]): a functionality key ordered before autograd that LibTorch
// registers nothing for (it exists for torchdistX's deferred init).
#define FSDP_PLACEHOLDER_DISPATCH_KEY DeferredInit

// c10::Allocator::allocate is const in 1.13 and not in 2.x; 2.x adds a pure
// copy_data(). Use as `c10::DataPtr allocate(size_t n) FSDP_ALLOCATE_CONST override`.
#if FSDP_TORCH_AT_LEAST(2, 0)
#define FSDP_ALLOCATE_CONST
#define FSDP_ALLOCATOR_COPY_DATA                                                  \
  void copy_data(void* dest, const void* src, std::size_t count) const override { \
    default_copy_data(dest, src, count);                                          \
  }
#else
#define FSDP_ALLOCATE_CONST const
#define FSDP_ALLOCATOR_COPY_DATA
#endif

// c10d::Store::clone() is pure in 2.x and absent in 1.13: a store declares
// `clone() FSDP_STORE_CLONE_OVERRIDE;`.
#if FSDP_TORCH_AT_LEAST(2, 0)
#define FSDP_STORE_CLONE_OVERRIDE override
#else
#define FSDP_STORE_CLONE_OVERRIDE
#endif

namespace fsdp::compat {

/// Turns autocast on the CPU on or off: at::autocast's per-device calls
/// (2.4+) or set_cpu_enabled (before).
inline void set_cpu_autocast(bool on) {
#if FSDP_TORCH_AT_LEAST(2, 4)
  at::autocast::set_autocast_enabled(at::kCPU, on);
#else
  at::autocast::set_cpu_enabled(on);
#endif
  if (!on) at::autocast::clear_cache();
}

/// Autocast's settings on this thread for the CPU and CUDA.
struct AutocastState {
  bool cpu = false;
  bool cuda = false;
  at::ScalarType cpu_dtype = at::kBFloat16;
  at::ScalarType cuda_dtype = at::kHalf;
};

/// This thread's autocast settings: at::autocast's per-device calls (2.4+)
/// or the CPU's and the GPU's own (before).
inline AutocastState autocast_state() {
  AutocastState s;
#if FSDP_TORCH_AT_LEAST(2, 4)
  s.cpu = at::autocast::is_autocast_enabled(at::kCPU);
  s.cuda = at::autocast::is_autocast_enabled(at::kCUDA);
  s.cpu_dtype = at::autocast::get_autocast_dtype(at::kCPU);
  s.cuda_dtype = at::autocast::get_autocast_dtype(at::kCUDA);
#else
  s.cpu = at::autocast::is_cpu_enabled();
  s.cuda = at::autocast::is_enabled();
  s.cpu_dtype = at::autocast::get_autocast_cpu_dtype();
  s.cuda_dtype = at::autocast::get_autocast_gpu_dtype();
#endif
  return s;
}

/// Sets this thread's autocast settings (see autocast_state()).
inline void set_autocast_state(const AutocastState& s) {
#if FSDP_TORCH_AT_LEAST(2, 4)
  at::autocast::set_autocast_enabled(at::kCPU, s.cpu);
  at::autocast::set_autocast_enabled(at::kCUDA, s.cuda);
  at::autocast::set_autocast_dtype(at::kCPU, s.cpu_dtype);
  at::autocast::set_autocast_dtype(at::kCUDA, s.cuda_dtype);
#else
  at::autocast::set_cpu_enabled(s.cpu);
  at::autocast::set_enabled(s.cuda);
  at::autocast::set_autocast_cpu_dtype(s.cpu_dtype);
  at::autocast::set_autocast_gpu_dtype(s.cuda_dtype);
#endif
}

/// Whether refuse_data_reads can make a storage's data reads an error (2.4+).
constexpr bool kRefusesDataReads = FSDP_TORCH_AT_LEAST(2, 4);

/// Makes every read of `storage`'s data (data_ptr(), which torch::save and
/// torch::pickle_save use, reaching no operator) an error saying `message`,
/// where LibTorch can (kRefusesDataReads); before 2.4 such a read sees the
/// storage as it is.
inline void refuse_data_reads(c10::StorageImpl& storage, std::string message) {
#if FSDP_TORCH_AT_LEAST(2, 4)
  storage.release_data_and_set_meta_custom_data_ptr_error_msg_(std::move(message));
#else
  (void)storage;
  (void)message;
#endif
}

/// Blocks the host until `event` has passed: c10::Event::synchronize() where
/// LibTorch has it (2.x), else a poll of query() (1.13, whose builds here
/// have no GPU to wait for).
inline void synchronize_event(const c10::Event& event) {
#if FSDP_TORCH_AT_LEAST(2, 5)
  event.synchronize();
#else
  while (!event.query()) std::this_thread::yield();
#endif
}

/// What the CUDA caching allocator holds on one device, in bytes.
struct CudaMemory {
  int64_t allocated = 0;       ///< handed out now
  int64_t peak_allocated = 0;  ///< handed out at most since the last reset_cuda_peak()
  int64_t reserved = 0;        ///< taken from the driver (cached included)
  int64_t peak_reserved = 0;   ///< taken at most since the last reset_cuda_peak()
};

/// The CUDA caching allocator's statistics for `device` (all 0 in builds of
/// LibTorch without CUDA).
inline CudaMemory cuda_memory(c10::DeviceIndex device) {
#if FSDP_WITH_CUDA
  const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device);
  // Index 0: StatType::AGGREGATE, both pools together.
  return {stats.allocated_bytes[0].current, stats.allocated_bytes[0].peak,
          stats.reserved_bytes[0].current, stats.reserved_bytes[0].peak};
#else
  (void)device;
  return {};
#endif
}

/// Starts cuda_memory()'s peak afresh on `device` (nothing without CUDA).
inline void reset_cuda_peak(c10::DeviceIndex device) {
#if FSDP_WITH_CUDA
  c10::cuda::CUDACachingAllocator::resetPeakStats(device);
#else
  (void)device;
#endif
}

#if FSDP_WITH_GLOO
/// A c10d Gloo process group listening on `listen_addr`.
inline c10::intrusive_ptr<c10d::ProcessGroup> make_c10d_gloo_group(
    const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
    std::chrono::milliseconds timeout, const std::string& listen_addr) {
  auto options = c10d::ProcessGroupGloo::Options::create(timeout);
  gloo::transport::tcp::attr attr;
  attr.hostname = listen_addr;
  options->devices.push_back(gloo::transport::tcp::CreateDevice(attr));
#if FSDP_TORCH_AT_LEAST(2, 0)
  auto backend = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, options);
  auto group = c10::make_intrusive<c10d::ProcessGroup>(store, rank, size);
  group->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::GLOO, backend);
  group->setDefaultBackend(c10d::ProcessGroup::BackendType::GLOO);
  return group;
#else
  return c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, options);
#endif
}
#endif  // FSDP_WITH_GLOO

/// Collects the messages of TORCH_WARN while alive (the handler interface
/// and the guard's namespace changed in 2.x). Not thread-safe: warnings are
/// expected on the thread that runs the model.
class WarningCollector : public c10::WarningHandler {
 public:
  /// Collects into `messages`, or into `*sink` when given.
  explicit WarningCollector(std::vector<std::string>* sink = nullptr)
      : sink_(sink != nullptr ? sink : &messages), guard_(this) {}
#if FSDP_TORCH_AT_LEAST(2, 0)
  void process(const c10::Warning& warning) override { sink_->push_back(warning.msg()); }
#else
  void process(const c10::SourceLocation&, const std::string& msg, const bool) override {
    sink_->push_back(msg);
  }
#endif
  /// Every message seen, in order (unless a sink was given).
  std::vector<std::string> messages;

 private:
  std::vector<std::string>* sink_;
#if FSDP_TORCH_AT_LEAST(2, 0)
  c10::WarningUtils::WarningHandlerGuard guard_;
#else
  c10::Warning::WarningHandlerGuard guard_;
#endif
};

/// Zeroes an optimizer's gradients in place, keeping the tensors, as 1.13's
/// Optimizer::zero_grad() always does (2.x drops them unless told not to).
template <typename Optimizer>
void zero_grad_in_place(Optimizer& optimizer) {
#if FSDP_TORCH_AT_LEAST(2, 0)
  optimizer.zero_grad(/*set_to_none=*/false);
#else
  optimizer.zero_grad();
#endif
}

/// Waits for a c10d collective with a limit (the Work type moved in 2.x).
template <typename WorkPtr>
void wait_work(const WorkPtr& work, std::chrono::milliseconds timeout) {
  work->wait(timeout);
}

/// Multiplies each of `grads` (floating, all on `found_inf`'s device) by
/// `inv_scale` in place, and sets `found_inf` (one float32) to 1 where one
/// holds inf or NaN: LibTorch's AMP kernel, which has a CPU version from 2.3
/// on; 1.13's CPU builds do the same with tensor operations.
inline void unscale_and_check_(std::vector<at::Tensor>& grads, at::Tensor& found_inf,
                               const at::Tensor& inv_scale) {
#if !FSDP_TORCH_AT_LEAST(2, 3)
  if (found_inf.device().is_cpu()) {
    // As the kernel: the check on the values before, the product in float32
    // for float16 and bfloat16 (float64 for float64).
    const double inv = inv_scale.item<float>();
    for (at::Tensor& g : grads) {
      if (!g.isfinite().all().item<bool>()) found_inf.fill_(1.0);
      if (g.scalar_type() == at::kHalf || g.scalar_type() == at::kBFloat16) {
        g.copy_(g.to(at::kFloat).mul_(inv));
      } else {
        g.mul_(inv);
      }
    }
    return;
  }
#endif
  at::_amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale);
}

/// Makes `acc` (from try_get_grad_accumulator) `param`'s gradient
/// accumulator again, after set_data to another dtype made autograd forget
/// it: autograd refers to it weakly, through a std::weak_ptr in 1.13 and a
/// c10::weak_intrusive_ptr in later releases.
template <typename Ref>
void set_grad_accumulator(const at::Tensor& param, const Ref& acc) {
  using Node = torch::autograd::Node;
  using Weak = std::conditional_t<std::is_same_v<Ref, std::shared_ptr<Node>>, std::weak_ptr<Node>,
                                  c10::weak_intrusive_ptr<Node>>;
  torch::autograd::impl::set_grad_accumulator(param, Weak(acc));
}

/// The key torch::optim keeps a parameter's state under in `state` (the
/// optimizer's state() map): the TensorImpl address, as text in 1.13
/// (c10::guts::to_string), as a void* in later 2.x releases.
template <typename StateMap>
typename StateMap::key_type optim_state_key(const StateMap&, const at::Tensor& param) {
  using Key = typename StateMap::key_type;
  if constexpr (std::is_same_v<Key, std::string>) {
    std::ostringstream s;
    s << param.unsafeGetTensorImpl();
    return s.str();
  } else {
    return static_cast<Key>(param.unsafeGetTensorImpl());
  }
}

/// Bytes of a GPU generator's state that a checkpoint keeps: its seed and
/// offset, the last 16 bytes of get_state() (all of it from LibTorch 2.1
/// on; 1.13 and 2.0 put 800 unused bytes before them), so that a state saved
/// by one release restores in another.
constexpr int64_t kCudaRngStateBytes = 16;
/// The kept part of a GPU generator's get_state().
inline at::Tensor portable_cuda_rng_state(const at::Tensor& state) {
  return state.narrow(0, state.numel() - kCudaRngStateBytes, kCudaRngStateBytes).clone();
}
/// What this release's set_state takes for `portable`: `current` (the
/// generator's get_state()) with its seed and offset replaced.
inline at::Tensor native_cuda_rng_state(const at::Tensor& portable, const at::Tensor& current) {
  at::Tensor out = current.clone();
  out.narrow(0, out.numel() - kCudaRngStateBytes, kCudaRngStateBytes).copy_(portable);
  return out;
}

}  // namespace fsdp::compat
