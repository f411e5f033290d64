#pragma once

#include <c10/core/Device.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <memory>

#include <fsdp/comm/process_group.h>

namespace fsdp {

/// What one memory (a GPU's, or the host's) must still provide for a
/// training step of an FSDP model, in bytes, beside what it has free. Only
/// what libfsdp and the optimizer will allocate is counted: activations are
/// the model's and are not (Note [Memory plan] in src/runtime/memory_plan.cpp).
struct MemoryPool {
  /// Gradients of the sharded parameters that are not allocated yet.
  int64_t gradients = 0;
  /// Optimizer state that is not allocated yet (AdamW's two moments, SGD's
  /// momentum buffer, ...), known for torch::optim's optimizers.
  int64_t optimizer_state = 0;
  /// libfsdp's buffers at a step's peak: gathered units and unsharded
  /// gradients being reduced.
  int64_t working_set = 0;
  /// Free now: on a GPU, the driver's free memory plus what the CUDA caching
  /// allocator holds unused; on the host, MemAvailable within the cgroup's
  /// limit. -1 when unknown.
  int64_t free = -1;
  /// gradients + optimizer_state + working_set.
  int64_t needed() const { return gradients + optimizer_state + working_set; }
  /// Whether needed() fits in free (true when free is unknown).
  bool fits() const { return free < 0 || needed() <= free; }
};

/// One rank's memory plan for training an FSDP model (plan_memory()).
struct MemoryPlan {
  /// The units' device.
  c10::Device device = c10::Device(c10::kCPU);
  /// On `device`; all zero when `device` is the CPU (then `host` has it all).
  MemoryPool on_device;
  /// In host memory: with CPU offload the shards' gradients and optimizer
  /// state; everything when the units are on the CPU.
  MemoryPool on_host;
  /// The ranks that check together (the model's process group); null for a
  /// model without units.
  std::shared_ptr<ProcessGroup> group;
};

/// This rank's plan for training `model` (an FSDP root, after wrapping)
/// with `optimizer` (null: no optimizer state counted): what its first
/// steps will still allocate, on the units' device and in host memory, and
/// what is free there now. Local: no collective.
MemoryPlan plan_memory(const torch::nn::Module& model,
                       const torch::optim::Optimizer* optimizer = nullptr);

/// Fails, before the first step instead of with an out-of-memory error deep
/// in backward, when a rank's plan does not fit: a one-line error on every
/// rank naming the rank, the memory, the bytes needed (by kind) against the
/// bytes free, and what to change. Collective over `plan.group`.
void check_memory(const MemoryPlan& plan);

/// check_memory(plan_memory(model, optimizer)). Call it on every rank after
/// wrapping and making the optimizer, before the first forward.
void check_memory(const torch::nn::Module& model,
                  const torch::optim::Optimizer* optimizer = nullptr);

}  // namespace fsdp
