#pragma once

// The per-unit overhead model (bench_overhead, bench_exec_order): `units`
// layers of Linear(width, width) + ReLU in a row, each one an FSDP unit when
// built with options, so a step's time is mostly FSDP's bookkeeping.

#include <torch/torch.h>

#include <optional>
#include <string>
#include <vector>

#include <fsdp/fsdp.h>

namespace bench {

/// One unit's module: Linear + ReLU.
class LayerImpl : public torch::nn::Module {
 public:
  explicit LayerImpl(int64_t width) : fc_(register_module("fc", torch::nn::Linear(width, width))) {}
  at::Tensor forward(at::Tensor x) { return at::relu(fc_->forward(x)); }

 private:
  torch::nn::Linear fc_;
};
TORCH_MODULE(Layer);

/// `units` layers in a row; with `options`, each one is an FSDP unit. Both
/// variants call their layers through AnyModule, so the dispatch cost cancels.
class NetImpl : public torch::nn::Module {
 public:
  NetImpl(int64_t units, int64_t width, std::optional<fsdp::FSDPOptions> options) {
    for (int64_t i = 0; i < units; ++i) {
      Layer layer(width);
      const std::string name = "l" + std::to_string(i);
      if (options) {
        fsdp::FullyShardedDataParallel<LayerImpl> unit(layer, *options);
        register_module(name, unit);
        layers_.emplace_back(unit);
      } else {
        register_module(name, layer);
        layers_.emplace_back(layer);
      }
    }
  }
  at::Tensor forward(at::Tensor x) {
    for (auto& layer : layers_) x = layer.forward(x);
    return x;
  }

 private:
  std::vector<torch::nn::AnyModule> layers_;
};
TORCH_MODULE(Net);

}  // namespace bench
