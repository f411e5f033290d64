#include "comm/device_routed.h"

#include <ATen/ops/empty.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <functional>
#include <vector>

#include "comm/work_state.h"
#include "detail/error.h"

namespace fsdp::detail {

namespace {

// An empty host tensor shaped like `t`, pinned when `t` is on a CUDA device.
at::Tensor host_like(const at::Tensor& t) {
  return at::empty(t.sizes(),
                   at::TensorOptions().dtype(t.scalar_type()).pinned_memory(t.is_cuda()));
}

at::Tensor host_copy(const at::Tensor& t) {
  at::Tensor h = host_like(t);
  h.copy_(t);
  return h;
}

// `work` (the engine's, on host buffers) followed by copying `result` back
// into `dst`; `keep` stays alive until then. The copy runs on the thread
// that completes `work`, whose current stream is its device's default one,
// so it is queued on the stream current when the collective was issued
// instead: after what the issuer queued there (the copy-in stream's wait
// for the kernels that last read `dst`'s memory, Note [Copy-in on a stream
// of its own]), whatever stream the user computes on. As before, the copy
// blocks until it ran.
Work copied_back(const Work& work, const at::Tensor& dst, const at::Tensor& result,
                 std::vector<at::Tensor> keep) {
  const c10::Stream issuing =
      c10::impl::VirtualGuardImpl(dst.device().type()).getStream(dst.device());
  return then_run(
      work,
      [dst, result, issuing] {
        const c10::StreamGuard on_issuing(issuing);
        dst.copy_(result);
      },
      "staged " + work.describe(), std::move(keep));
}

// A collective in place on `tensor` (all-reduce, broadcast), issued by
// `issue` on a host copy of it.
Work staged_in_place(const at::Tensor& tensor,
                     const std::function<Work(const at::Tensor&)>& issue) {
  const at::Tensor host = host_copy(tensor);
  return copied_back(issue(host), tensor, host, {tensor, host});
}

}  // namespace

DeviceRoutedProcessGroup::DeviceRoutedProcessGroup(std::shared_ptr<ProcessGroup> host,
                                                   bool stage_cpu_tensors,
                                                   std::shared_ptr<ProcessGroup> cuda)
    : ProcessGroup(host->rank(), host->size(), host->timeout()),
      host_(std::move(host)),
      stage_cpu_tensors_(stage_cpu_tensors),
      cuda_(std::move(cuda)) {}

DeviceRoutedProcessGroup::Route DeviceRoutedProcessGroup::route(const char* op, const at::Tensor& a,
                                                                const at::Tensor& b) const {
  FSDP_CHECK(a.device() == b.device(), rank(), "process group", op,
             ": the tensors are on different devices, ", a.device(), " and ", b.device(),
             ". Move both to one device first.");
  if (a.is_cpu()) return stage_cpu_tensors_ ? Route::kStaged : Route::kHost;
  return cuda_ && a.is_cuda() ? Route::kCuda : Route::kStaged;
}

Work DeviceRoutedProcessGroup::all_gather_into_tensor(const at::Tensor& flat,
                                                      const at::Tensor& shard) {
  const Route to = route("all_gather", flat, shard);
  if (to == Route::kHost) return host_->all_gather_into_tensor(flat, shard);
  if (to == Route::kCuda) return cuda_->all_gather_into_tensor(flat, shard);
  check_all_gather(flat, shard);
  // The in-place form on the host: this rank's shard copied into its slot.
  const at::Tensor host_flat = host_like(flat);
  const at::Tensor host_shard =
      host_flat.view(-1).narrow(0, rank() * shard.numel(), shard.numel()).view(shard.sizes());
  host_shard.copy_(shard);
  return copied_back(host_->all_gather_into_tensor(host_flat, host_shard), flat, host_flat,
                     {flat, shard, host_flat});
}

Work DeviceRoutedProcessGroup::reduce_scatter_tensor(const at::Tensor& shard,
                                                     const at::Tensor& flat, ReduceOp op) {
  const Route to = route("reduce_scatter", shard, flat);
  if (to == Route::kHost) return host_->reduce_scatter_tensor(shard, flat, op);
  if (to == Route::kCuda) return cuda_->reduce_scatter_tensor(shard, flat, op);
  check_reduce_scatter(shard, flat, op);
  const at::Tensor host_flat = host_copy(flat);
  const at::Tensor host_shard = host_like(shard);
  return copied_back(host_->reduce_scatter_tensor(host_shard, host_flat, op), shard, host_shard,
                     {shard, flat, host_flat, host_shard});
}

Work DeviceRoutedProcessGroup::all_reduce(const at::Tensor& tensor, ReduceOp op) {
  const Route to = route("all_reduce", tensor, tensor);
  if (to == Route::kHost) return host_->all_reduce(tensor, op);
  if (to == Route::kCuda) return cuda_->all_reduce(tensor, op);
  check_single("all_reduce", tensor);
  return staged_in_place(tensor,
                         [&](const at::Tensor& host) { return host_->all_reduce(host, op); });
}

Work DeviceRoutedProcessGroup::broadcast(const at::Tensor& tensor, int root) {
  const Route to = route("broadcast", tensor, tensor);
  if (to == Route::kHost) return host_->broadcast(tensor, root);
  if (to == Route::kCuda) return cuda_->broadcast(tensor, root);
  check_single("broadcast", tensor);
  check_root(root);
  return staged_in_place(tensor,
                         [&](const at::Tensor& host) { return host_->broadcast(host, root); });
}

std::shared_ptr<ProcessGroup> DeviceRoutedProcessGroup::new_subgroup(
    const std::vector<int>& ranks) {
  // Every rank makes both, in one order, member or not.
  auto sub = host_->new_subgroup(ranks);
  auto cuda_sub = cuda_ ? cuda_->new_subgroup(ranks) : nullptr;
  return sub ? std::make_shared<DeviceRoutedProcessGroup>(std::move(sub), stage_cpu_tensors_,
                                                          std::move(cuda_sub))
             : nullptr;
}

ProcessGroup& engine_of(ProcessGroup& group) {
  auto* routed = dynamic_cast<DeviceRoutedProcessGroup*>(&group);
  return routed ? *routed->host_group() : group;
}

}  // namespace fsdp::detail
