// Unit methods for mixed precision, CPU offload and deferred initialisation, kept apart
// from the forward/backward runtime in unit.cpp.

#include <ATen/ATen.h>

#include "runtime/root_state.h"
#include "runtime/unit_init.h"
#include "runtime/unit_runtime.h"

namespace fsdp::detail {

FlatParamConfig UnitRuntime::flat_param_config(UnitInit& init, c10::Device device) {
  FlatParamConfig config;
  config.keep_unsharded(keeps_unsharded(options_.sharding_strategy())).device(device);
  if (const CPUOffload& offload = options_.cpu_offload(); offload.offload_params()) {
    // See Note [Shards in host memory].
    config.offload_shard(true).pin_shard(offload.pin_memory() && device.is_cuda());
  }
  if (const auto& mp = options_.mixed_precision()) {
    config.param_dtype(mp->param_dtype()).reduce_dtype(mp->reduce_dtype());
  }
  if (init.needs_fill()) {
    config.fill([&init](const at::Tensor& unsharded) { init.fill(unsharded); });
  }
  config.use_listener(use_listener());  // See Note [Units driven by dispatch].
  return config;
}

at::TensorOptions UnitRuntime::shard_grad_options() const {
  const auto& mp = options_.mixed_precision();
  const at::Tensor& shard = flat_->shard();
  // As PyTorch's FSDP1 (prepare_gradient_for_optim, not its docstring):
  // kept in the dtype forward and backward computed in, whatever the
  // reduction's (a review found float32 gradients under bf16 parameters
  // reduced in float32: the option saved nothing).
  const bool keep_dtype = mp && mp->keep_low_precision_grads();
  return at::TensorOptions()
      .device(shard.device())
      .dtype(keep_dtype ? mp->param_dtype().value_or(shard.scalar_type()) : shard.scalar_type());
}

at::Tensor UnitRuntime::grad_for_shard(const at::Tensor& reduced) const {
  // Under CPU offload, into host memory too: a copy the host waits for, so
  // the optimizer never steps ahead of it (Note [Shards in host memory]).
  const at::TensorOptions to = shard_grad_options();
  return reduced.to(to.device(), to.dtype().toScalarType());
}

c10::optional<at::ScalarType> UnitRuntime::forward_input_dtype() const {
  if (full_precision_override_) {
    return flat_ ? flat_->param_dtype() : at::kFloat;
  }
  const auto& mp = options_.mixed_precision();
  if (!mp || !mp->param_dtype()) return c10::nullopt;
  // As PyTorch's FSDP does (not as its docstring reads): cast_forward_inputs
  // casts every unit's inputs, the root's included.
  const bool cast = mp->cast_forward_inputs() || (is_root() && mp->cast_root_forward_inputs());
  return cast ? mp->param_dtype() : c10::nullopt;
}

}  // namespace fsdp::detail
