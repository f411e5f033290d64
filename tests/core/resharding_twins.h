#pragma once

// Twins for the tests of FSDP2's resharding controls (Note [Resharding as
// the user says]): a model of four layers, each a unit with a counting
// group of its own, beside its plain reference; on the CPU
// (test_user_resharding.cpp) and on a GPU (test_cuda_units.cpp).

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <fsdp/fsdp.h>

#include "comm/counting_process_group.h"
#include "core/flat_parameter.h"
#include "test_models.h"

namespace fsdp::testing::resharding_twins {

using CountingGroup = CountingProcessGroup;
using State = FlatParameter::State;

enum class Build { kPlain, kWrappers, kFullyShard };
inline const char* to_string(Build build) {
  return build == Build::kWrappers ? "wrappers" : "fully_shard";
}

constexpr int kLayers = 4;

// Four 32x32 layers and a head, the layers each a unit (a wrapper or made
// by fully_shard) with a counting group of its own; the plain build is the
// reference, with the same initial weights.
struct LayersImpl : torch::nn::Module {
  LayersImpl(Build build, const std::vector<std::shared_ptr<CountingGroup>>& groups,
             const FSDPOptions& options) {
    for (int i = 0; i < kLayers; ++i) {
      torch::nn::Linear linear(32, 32);
      const std::string name = "l" + std::to_string(i);
      const FSDPOptions own = FSDPOptions(options).process_group(
          build == Build::kPlain ? nullptr : groups[static_cast<size_t>(i)]);
      if (build == Build::kWrappers) {
        FullyShardedDataParallel<torch::nn::LinearImpl> unit(linear, own);
        layers.emplace_back(register_module(name, unit));
      } else {
        layers.emplace_back(register_module(name, linear));
        if (build == Build::kFullyShard) fully_shard(linear, own);
      }
    }
    head = register_module("head", torch::nn::Linear(32, 2));
  }
  torch::Tensor forward(torch::Tensor x) {
    for (size_t i = 0; i < layers.size(); ++i) {
      if (before_layer) before_layer(i, x);
      x = torch::tanh(layers[i].forward(x));
    }
    return head(x);
  }
  std::vector<torch::nn::AnyModule> layers;
  torch::nn::Linear head{nullptr};
  // Called before each layer's forward with its input (a hand-scheduled
  // prefetch, a hook on the input).
  std::function<void(size_t, const torch::Tensor&)> before_layer;
};
TORCH_MODULE(Layers);

// A Layers model of `build`, its root a unit of the same options on a
// counting group of its own, beside the plain reference.
struct Twins {
  // On `device` (a GPU: the units' device_id, the reference moved there).
  Twins(Build build, const FSDPOptions& given, torch::Device on = torch::kCPU) : device(on) {
    const FSDPOptions options =
        device.is_cuda() ? FSDPOptions(given).device_id(device) : FSDPOptions(given);
    auto world = default_process_group();
    for (int i = 0; i < kLayers; ++i) groups.push_back(std::make_shared<CountingGroup>(world));
    root_group = std::make_shared<CountingGroup>(world);
    torch::manual_seed(0);
    reference = Layers(Build::kPlain, groups, options);
    reference->to(device);
    torch::manual_seed(0);
    const FSDPOptions root_options = FSDPOptions(options).process_group(root_group);
    if (build == Build::kWrappers) {
      FullyShardedDataParallel<LayersImpl> wrapped(Layers(build, groups, options), root_options);
      layers = &wrapped->module();
      root = wrapped.ptr().get();
      model = wrapped.ptr();
      forward_ = [wrapped](const torch::Tensor& x) mutable { return wrapped->forward(x); };
    } else {
      Layers plain(build, groups, options);
      root = &fully_shard(plain, root_options);
      layers = plain.get();
      model = plain.ptr();
      forward_ = [plain](const torch::Tensor& x) mutable { return plain->forward(x); };
    }
    for (auto& layer : layers->layers) units.push_back(unit_of(*layer.ptr()));
    opt = std::make_unique<torch::optim::SGD>(root->flat_parameters(),
                                              torch::optim::SGDOptions(0.05).momentum(0.9));
    ref_opt = std::make_unique<torch::optim::SGD>(reference->parameters(),
                                                  torch::optim::SGDOptions(0.05).momentum(0.9));
  }
  torch::Tensor forward(const torch::Tensor& x) { return forward_(x); }
  // One step of `micro` micro-batches of 4 rows per rank, `before_micro(m)`
  // called before each; the reference takes the same step on every rank's
  // rows at once, and the two must agree after it.
  void step(int s, int micro, const std::function<void(int)>& before_micro, const std::string& what,
            bool check = true) {
    const int world = default_process_group()->size();
    torch::manual_seed(100 + s);
    const torch::Tensor x = torch::randn({4 * micro * world, 32}).to(device);
    const torch::Tensor y = torch::randn({4 * micro * world, 2}).to(device);
    ref_opt->zero_grad();
    torch::mse_loss(reference->forward(x), y).backward();
    ref_opt->step();
    const torch::Tensor mx = local_block(x), my = local_block(y);
    if (!zero_grad_after_forward) opt->zero_grad();
    for (int m = 0; m < micro; ++m) {
      if (before_micro) before_micro(m);
      const torch::Tensor loss =
          torch::mse_loss(forward(mx.narrow(0, 4 * m, 4)), my.narrow(0, 4 * m, 4)) / micro;
      if (zero_grad_after_forward && m == 0) opt->zero_grad();
      loss.backward();
    }
    opt->step();
    if (after_step) after_step();
    if (!check) return;  // the summon would free what the units hold
    SummonFullParams full(*model);
    expect_same_params(*model, *reference.ptr(), what + " step " + std::to_string(s));
  }
  std::vector<int64_t> gathers() const {
    std::vector<int64_t> out;
    for (const auto& g : groups) out.push_back(g->all_gathers);
    return out;
  }

  torch::Device device;
  std::vector<std::shared_ptr<CountingGroup>> groups;
  std::shared_ptr<CountingGroup> root_group;
  Layers reference{nullptr};
  std::shared_ptr<torch::nn::Module> model;
  LayersImpl* layers = nullptr;
  Unit* root = nullptr;
  std::vector<Unit*> units;
  std::unique_ptr<torch::optim::SGD> opt, ref_opt;
  // The optimizer's zero_grad() between the first forward and its backward
  // (a loop's order some users write), not before the forward.
  bool zero_grad_after_forward = false;
  std::function<void()> after_step;  // after the optimizer step, before the check

 private:
  std::function<torch::Tensor(const torch::Tensor&)> forward_;  // through the root
};

// The all-gathers each layer's unit issued since `before`.
inline std::vector<int64_t> since(const Twins& t, const std::vector<int64_t>& before) {
  std::vector<int64_t> now = t.gathers();
  for (size_t i = 0; i < now.size(); ++i) now[i] -= before[i];
  return now;
}

}  // namespace fsdp::testing::resharding_twins
