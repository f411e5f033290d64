#pragma once

// Note [One seam for devices]
// Everything libfsdp does differently by device lives behind these functions:
// which devices a unit may live on, how a flat buffer's storage is freed and
// refilled in place, and which backend a placeholder dispatches as. The rest
// of the library carries a unit's device (FSDPOptions::device_id, resolved by
// resolve_unit_device in runtime/unit_init.h) into every tensor it makes, so a
// new device is added here, and the CPU path stays the reference.

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/DispatchKey.h>
#include <c10/core/Event.h>
#include <c10/core/ScalarType.h>
#include <c10/core/StorageImpl.h>
#include <c10/util/Optional.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace fsdp::detail {

/// Whether a unit's flat parameter may live on `device`: the CPU, and the
/// CUDA devices this process sees.
bool unit_device_supported(c10::Device device);

/// Resizes `storage` in place to `bytes` on its own device (0 frees it), so
/// that every view of it, autograd's saved ones included, sees the change.
/// The CPU's goes through LibTorch's CPU resize (and so libfsdp's block
/// cache); every other device's through resize_with_allocator().
void resize_storage_bytes(c10::StorageImpl* storage, size_t bytes);

/// The device-neutral resize: new memory from the storage's own allocator
/// (the CUDA caching allocator for a CUDA tensor) on the storage's device,
/// the first min(old, new) bytes copied over on the device, the old memory
/// handed back to that allocator. Tested on the CPU, where it behaves as on
/// any device.
void resize_with_allocator(c10::StorageImpl* storage, size_t bytes);

/// An uninitialised host tensor of `numel` elements for `owner`'s offloaded
/// shard (Note [Shards in host memory]), page-locked where `pinned`: memory
/// that cannot be pinned is an error naming the bytes, the owner and the
/// setting to change, not LibTorch's bare allocator message.
at::Tensor host_buffer(int64_t numel, c10::ScalarType dtype, bool pinned, const std::string& owner);

/// `t` (on a GPU) copied into new page-locked host memory of `dtype`,
/// queued on the current stream behind what produces `t`: the host does not
/// wait, and reads the copy only after wait_for_device(t.device()). LibTorch's
/// caching host allocator keeps the pinned blocks from step to step (Note
/// [Gradients to host memory]).
at::Tensor start_host_copy(const at::Tensor& t, c10::ScalarType dtype);

/// `host` (a host tensor), or, where it goes to a GPU in another dtype, its
/// copy there in its own dtype (queued on the current stream), which the
/// caller then casts on the GPU: LibTorch's copy of a host tensor to a GPU
/// tensor of another dtype casts on the host, into pageable memory, and
/// copies from there, a copy the host waits for.
at::Tensor staged_for_cast(const at::Tensor& host, c10::Device device, c10::ScalarType dtype,
                           bool non_blocking);

/// Blocks the host until what was queued on `device`'s current stream has
/// run; nothing for the CPU.
void wait_for_device(c10::Device device);

/// `t`, whose producers have finished (a collective waited for on the host),
/// copied into page-locked host memory of `dtype` on a stream of its own, so
/// the copy waits for nothing else queued on the device; returns once it is
/// done. `t` itself for a CPU tensor of that dtype.
at::Tensor finished_to_host(const at::Tensor& t, c10::ScalarType dtype);

/// A finished flat tensor's elements copied into host tensors in parts, each
/// part with its own completion, so that the host can read the first part
/// while the others are still in flight (Note [Stepping a gradient as it
/// lands] in src/runtime/reduced_grad.cpp). From a GPU the copies run on the
/// step-copy stream, an event after each part; from the CPU each part is
/// copied when waited for, the host tensors NaN until then.
class HostCopyInParts {
 public:
  /// `numel` elements of the source from `src_offset` go to `dsts[dst]`'s
  /// elements from `dst_offset`.
  struct Segment {
    size_t dst = 0;
    int64_t dst_offset = 0;
    int64_t src_offset = 0;
    int64_t numel = 0;
  };

  /// `dsts`: contiguous host tensors; `parts`: each part's segments.
  HostCopyInParts(std::vector<at::Tensor> dsts, std::vector<std::vector<Segment>> parts);
  /// Waits for the copies still in flight: the source stays alive until then.
  ~HostCopyInParts();
  HostCopyInParts(const HostCopyInParts&) = delete;
  HostCopyInParts& operator=(const HostCopyInParts&) = delete;

  /// Queues every part's copies from `src` (1-D, its producers finished: a
  /// collective waited for on the host, or on a GPU the step-copy stream
  /// made to wait for them). Once.
  void start(const at::Tensor& src);
  /// Blocks the host until part `i` has landed (after start()). Once every
  /// part has, the source goes back to its allocator: a unit's reduced
  /// gradient on a GPU is not held while the host steps what it brought.
  void wait(size_t i);
  /// Blocks the host until every part has landed (after start()).
  void wait_all();
  /// The host tensors.
  const std::vector<at::Tensor>& dsts() const { return dsts_; }

 private:
  enum class State : uint8_t {
    kIdle,     // before start()
    kCopying,  // src_ held until every part has landed
    kLanded,   // every part waited for; src_ released
    kFailed,   // start() threw with parts queued in half: no part may be read
  };

  void copy_part(const std::vector<Segment>& part, bool non_blocking);

  std::vector<at::Tensor> dsts_;
  std::vector<std::vector<Segment>> parts_;
  State state_ = State::kIdle;
  at::Tensor src_;
  std::vector<c10::Event> landed_;  // one per part, from a GPU only
  size_t waited_ = 0;               // parts known to have landed (copied, from the CPU)
};

/// Bytes `device` can still provide: for a GPU, the driver's free memory plus
/// what the CUDA caching allocator holds unused; for the CPU, the host's
/// available memory (memory/host_available.h). -1 when unknown.
int64_t device_free_bytes(c10::Device device);

/// Whether Tensor::to(to_device, to_dtype) (either left out, as Module::to
/// passes them) would leave a tensor on `device` in `dtype` as it is: a
/// device without an index is the current one of its type, as in ATen.
bool conversion_keeps(c10::Device device, c10::ScalarType dtype,
                      c10::optional<c10::Device> to_device,
                      c10::optional<c10::ScalarType> to_dtype);

/// The error for `change` ("to(cuda:0) would move or convert") refused to
/// `what` (a unit, or its parameter) on `device` in `dtype`: Note [Module::to
/// on a sharded model] in src/runtime/unit_conversion.cpp.
std::string conversion_refusal(const std::string& change, const std::string& what,
                               c10::Device device, c10::ScalarType dtype);

/// The dispatch key of dense tensors on `device` (a placeholder's backend).
c10::DispatchKey dense_backend_key(c10::Device device);

}  // namespace fsdp::detail
