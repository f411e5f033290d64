// Getting started: your own model with libfsdp. The README shows this file
// verbatim (tests/examples/check_readme_code.py keeps the two equal); ctest
// runs it at 2 ranks:  build/bin/fsdprun --nproc-per-node 2 build/bin/getting_started
#include <torch/torch.h>

#include <iostream>
#include <string>
#include <vector>

#include <fsdp/fsdp.h>

namespace nn = torch::nn;

// 1. Your model as usual. A layer you want sharded on its own (gathered just
//    before it runs, freed after) is held as fsdp::FullyShardedDataParallel<Impl>:
//    the same forward and parameter names as the module it wraps.
struct BlockImpl : nn::Module {
  explicit BlockImpl(int64_t width) {
    norm = register_module("norm", nn::LayerNorm(nn::LayerNormOptions({width})));
    fc = register_module("fc", nn::Linear(width, 4 * width));
    proj = register_module("proj", nn::Linear(4 * width, width));
  }
  torch::Tensor forward(torch::Tensor x) { return x + proj(torch::gelu(fc(norm(x)))); }
  nn::LayerNorm norm{nullptr};
  nn::Linear fc{nullptr}, proj{nullptr};
};
TORCH_MODULE(Block);

struct ModelImpl : nn::Module {
  ModelImpl(int64_t width, int64_t depth, const fsdp::FSDPOptions& options) {
    in = register_module("in", nn::Linear(16, width));
    for (int64_t i = 0; i < depth; ++i) {
      blocks.push_back(
          register_module("block" + std::to_string(i),
                          fsdp::FullyShardedDataParallel<BlockImpl>(Block(width), options)));
    }
    out = register_module("out", nn::Linear(width, 1));  // `in` and `out`: the root unit's
  }
  torch::Tensor forward(torch::Tensor x) {
    x = in(x);
    for (auto& block : blocks) x = block(x);
    return out(x);
  }
  nn::Linear in{nullptr}, out{nullptr};
  std::vector<fsdp::FullyShardedDataParallel<BlockImpl>> blocks;
};
TORCH_MODULE(Model);

int main() try {
  // 2. Join the job: fsdprun (or torchrun) sets RANK, WORLD_SIZE, MASTER_ADDR, ...
  auto pg = fsdp::init_process_group();
  torch::set_num_threads(1);

  // 3. The same initial weights on every rank, then wrap the whole model (the root).
  //    use_orig_params: the optimizer sees each parameter's shard under its own name.
  auto options = fsdp::FSDPOptions()
                     .sharding_strategy(fsdp::ShardingStrategy::kFullShard)
                     .use_orig_params(true);
  torch::manual_seed(0);
  fsdp::FullyShardedDataParallel<ModelImpl> model(Model(64, 4, options), options);

  // 4. Parameter groups by name: no weight decay on biases and LayerNorm.
  std::vector<torch::Tensor> decay, no_decay;
  for (const auto& p : model->named_flat_parameters()) {
    const bool plain =
        p.key().find("bias") != std::string::npos || p.key().find("norm") != std::string::npos;
    (plain ? no_decay : decay).push_back(p.value());
  }
  using torch::optim::AdamWOptions;
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(decay, std::make_unique<AdamWOptions>(AdamWOptions(1e-3).weight_decay(0.1)));
  groups.emplace_back(no_decay, std::make_unique<AdamWOptions>(AdamWOptions(1e-3).weight_decay(0)));
  torch::optim::AdamW optimizer(std::move(groups), AdamWOptions(1e-3));

  // 5. Train as with plain LibTorch; each rank on its own data (data parallel).
  torch::manual_seed(100 + pg->rank());
  torch::Tensor x = torch::randn({64, 16});
  torch::Tensor y = x.sum(1, /*keepdim=*/true).sin();
  double first = 0, last = 0;
  for (int step = 0; step < 60; ++step) {
    optimizer.zero_grad();
    torch::Tensor loss = torch::mse_loss(model->forward(x), y);
    loss.backward();
    model->clip_grad_norm_(1.0);  // over all ranks' shards
    optimizer.step();
    (step == 0 ? first : last) = loss.item<double>();
  }
  if (pg->rank() == 0) std::cout << "loss " << first << " -> " << last << std::endl;
  return last < 0.5 * first ? 0 : 1;
} catch (const std::exception& e) {  // e.g. a rank that died: one line on every rank
  std::cerr << fsdp::error_message(e) << std::endl;
  return 1;
}
