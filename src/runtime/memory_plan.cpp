#include <fsdp/runtime/memory_plan.h>

#include <fsdp/memory.h>

#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include <algorithm>
#include <functional>
#include <string>
#include <vector>

#include "comm/agreement.h"
#include "core/device_storage.h"
#include "detail/error.h"
#include "detail/torch_compat.h"
#include "memory/host_available.h"
#include "runtime/root_state.h"
#include "runtime/unit_runtime.h"

// Note [Memory plan]
// A model that does not fit should fail before its first step, naming the
// bytes, not with an out-of-memory error deep in backward (or, with CPU
// offload, the kernel's OOM killer). What a step will still allocate is
// known from the units alone, per rank and per memory (the units' device,
// and host memory for offloaded shards):
// - the gradients of the shards (or of use_orig_params' pieces) that have
//   none yet, where the shard lives;
// - the optimizer's state that is not made yet: a count of shard-sized
//   tensors per parameter known for torch::optim's optimizers (AdamW and
//   Adam two, three with amsgrad; SGD one with momentum; RMSprop one, plus
//   one with momentum and one centered); other optimizers count nothing;
// - libfsdp's working set at a step's peak, in backward: two units gathered
//   (the current one and the prefetched one, the two largest that free
//   their buffer) and kMaxReductionsInFlight + 1 unsharded gradients with
//   their reduced shards (Note [Reductions in flight]), at the largest
//   unit's size.
// Activations are the model's, not counted: the check is a floor, so it
// never refuses a model that would train. What is free: cudaMemGetInfo's
// free memory plus the bytes the CUDA caching allocator holds unused for a
// GPU; MemAvailable within the cgroup's room for the host (units on the CPU
// count everything there). Every rank shares its four numbers (one small
// all-gather), so every rank fails alike, naming the first rank short.

namespace fsdp {

namespace {

// Shard-sized tensors of state per parameter for `optimizer`'s known types.
int64_t state_tensors_per_param(const torch::optim::Optimizer& optimizer,
                                const torch::optim::OptimizerOptions& options) {
  using namespace torch::optim;
  if (dynamic_cast<const AdamW*>(&optimizer) != nullptr) {
    return static_cast<const AdamWOptions&>(options).amsgrad() ? 3 : 2;
  }
  if (dynamic_cast<const Adam*>(&optimizer) != nullptr) {
    return static_cast<const AdamOptions&>(options).amsgrad() ? 3 : 2;
  }
  if (dynamic_cast<const SGD*>(&optimizer) != nullptr) {
    return static_cast<const SGDOptions&>(options).momentum() != 0 ? 1 : 0;
  }
  if (dynamic_cast<const RMSprop*>(&optimizer) != nullptr) {
    const auto& o = static_cast<const RMSpropOptions&>(options);
    return 1 + (o.momentum() > 0 ? 1 : 0) + (o.centered() ? 1 : 0);
  }
  return 0;  // Adagrad makes its state at construction; others are unknown
}

std::string describe_need(const MemoryPool& pool) {
  std::string parts;
  const auto add = [&parts](int64_t bytes, const std::string& what) {
    if (bytes == 0) return;
    parts += (parts.empty() ? "" : ", ") + what + " " + format_bytes(bytes);
  };
  add(pool.gradients, "gradient shards");
  add(pool.optimizer_state, "optimizer state");
  add(pool.working_set, "gathered units and gradients being reduced");
  return parts;
}

}  // namespace

MemoryPlan plan_memory(const torch::nn::Module& model, const torch::optim::Optimizer* optimizer) {
  MemoryPlan plan;
  std::vector<const detail::UnitRuntime*> units;
  for (const detail::UnitRuntime* unit : detail::UnitRuntime::all_in(model)) {
    if (unit->flat() == nullptr) continue;
    units.push_back(unit);
    if (!plan.group) plan.group = unit->options().process_group();
  }
  if (units.empty()) return plan;
  plan.device = units.front()->flat()->unsharded().device();
  const auto pool_of = [&plan](c10::Device where) -> MemoryPool& {
    return where.is_cpu() ? plan.on_host : plan.on_device;
  };
  // Gradients still to come, and the largest buffers of the working set.
  int64_t gathered[2] = {0, 0};
  int64_t reducing = 0;
  for (const detail::UnitRuntime* unit : units) {
    const FlatParameter& flat = *unit->flat();
    for (const at::Tensor& p : unit->optim_params()) {
      if (p.requires_grad() && !p.grad().defined())
        pool_of(p.device()).gradients += static_cast<int64_t>(p.nbytes());
    }
    const int64_t padded = flat.padded_numel();
    if (flat.frees_unsharded()) {
      const int64_t bytes = padded * static_cast<int64_t>(c10::elementSize(flat.param_dtype()));
      if (bytes > gathered[0]) {
        gathered[1] = gathered[0];
        gathered[0] = bytes;
      } else {
        gathered[1] = std::max(gathered[1], bytes);
      }
    }
    const int64_t shard = flat.keeps_unsharded() ? 0 : flat.shard().numel();
    reducing = std::max(
        reducing, (padded + shard) * static_cast<int64_t>(c10::elementSize(flat.grad_dtype())));
  }
  const auto in_flight = static_cast<int64_t>(detail::RootState::kMaxReductionsInFlight + 1);
  pool_of(plan.device).working_set = gathered[0] + gathered[1] + in_flight * reducing;
  if (optimizer != nullptr) {
    for (const auto& group : optimizer->param_groups()) {
      const int64_t per_param = state_tensors_per_param(*optimizer, group.options());
      if (per_param == 0) continue;
      for (const at::Tensor& p : group.params()) {
        const auto& state = optimizer->state();
        if (state.find(compat::optim_state_key(state, p)) != state.end()) continue;
        pool_of(p.device()).optimizer_state += per_param * static_cast<int64_t>(p.nbytes());
      }
    }
  }
  plan.on_host.free = detail::host_available_bytes();
  if (!plan.device.is_cpu()) plan.on_device.free = detail::device_free_bytes(plan.device);
  return plan;
}

void check_memory(const MemoryPlan& plan) {
  // Per rank: the device's need and room, then the host's.
  const std::vector<int64_t> mine = {plan.on_device.needed(), plan.on_device.free,
                                     plan.on_host.needed(), plan.on_host.free};
  const std::vector<int64_t> all = detail::agree_gather(plan.group.get(), mine);
  const int my_rank = plan.group ? plan.group->rank() : 0;
  for (size_t r = 0; r * mine.size() < all.size(); ++r) {
    for (int host = 0; host < 2; ++host) {
      const int64_t needed = all[r * mine.size() + 2 * host];
      const int64_t free = all[r * mine.size() + 2 * host + 1];
      if (free < 0 || needed <= free) continue;
      const bool on_cpu = host == 1;
      const std::string where =
          on_cpu ? std::string("host memory") : "GPU memory on " + plan.device.str();
      const std::string fix =
          on_cpu ? (plan.device.is_cpu()
                        ? "shard over more ranks or nodes, use a smaller model or batch, or give "
                          "the process more memory (the container's limit)"
                        : "give the process more host memory (the container's limit), shard over "
                          "more ranks or nodes, or leave the parameters on the GPU (no "
                          "cpu_offload)")
                 : "shard over more ranks, keep the shards in host memory with "
                   "FSDPOptions().cpu_offload(fsdp::CPUOffload().offload_params(true)), or use "
                   "a smaller model";
      // Only this rank knows how its need is made up.
      const MemoryPool& pool = on_cpu ? plan.on_host : plan.on_device;
      const std::string parts =
          static_cast<int>(r) == my_rank ? " (" + describe_need(pool) + ")" : "";
      FSDP_FAIL(my_rank, "check_memory", "rank ", r, " needs ", format_bytes(needed), " more ",
                where, " to train", parts, " but ", format_bytes(free),
                " is free (activations not counted); ", fix);
    }
  }
}

void check_memory(const torch::nn::Module& model, const torch::optim::Optimizer* optimizer) {
  check_memory(plan_memory(model, optimizer));
}

}  // namespace fsdp
