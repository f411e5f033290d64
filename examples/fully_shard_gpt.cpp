// fully_shard: a model whose classes you cannot or do not want to change (its
// blocks in a torch::nn::ModuleList, cast back with as<BlockImpl>()) sharded
// with a few lines outside it. The README shows this file verbatim; ctest runs
// it at 2 ranks:  build/bin/fsdprun --nproc-per-node 2 build/bin/fully_shard_gpt
#include <torch/torch.h>

#include <iostream>

#include <fsdp/fsdp.h>

namespace nn = torch::nn;

// The model as written without FSDP: nothing below knows about it.
struct BlockImpl : nn::Module {
  explicit BlockImpl(int64_t d) {
    ln = register_module("ln", nn::LayerNorm(nn::LayerNormOptions({d})));
    fc = register_module("fc", nn::Linear(d, 4 * d));
    proj = register_module("proj", nn::Linear(4 * d, d));
  }
  torch::Tensor forward(torch::Tensor x) { return x + proj(torch::gelu(fc(ln(x)))); }
  nn::LayerNorm ln{nullptr};
  nn::Linear fc{nullptr}, proj{nullptr};
};
TORCH_MODULE(Block);

struct GptImpl : nn::Module {
  GptImpl(int64_t vocab, int64_t d, int64_t depth) {
    wte = register_module("wte", nn::Embedding(vocab, d));
    blocks = register_module("blocks", nn::ModuleList());
    for (int64_t i = 0; i < depth; ++i) blocks->push_back(Block(d));
    head = register_module("head", nn::Linear(d, vocab));
  }
  torch::Tensor forward(torch::Tensor idx) {
    torch::Tensor x = wte(idx);
    for (const auto& block : *blocks) x = block->as<BlockImpl>()->forward(x);
    return head(x);
  }
  nn::Embedding wte{nullptr};
  nn::ModuleList blocks{nullptr};
  nn::Linear head{nullptr};
};
TORCH_MODULE(Gpt);

int main() try {
  auto pg = fsdp::init_process_group();
  torch::manual_seed(0);  // the same initial weights on every rank
  Gpt model(32, 64, 4);

  // The FSDP part: every BlockImpl becomes a unit in place, the model the root.
  fsdp::Unit& fsdp_root = fsdp::fully_shard(model, fsdp::module_type_policy<BlockImpl>());
  torch::optim::AdamW optimizer(fsdp_root.flat_parameters(), torch::optim::AdamWOptions(3e-3));

  torch::manual_seed(100 + pg->rank());  // each rank on its own data: counting mod 32
  torch::Tensor tokens = (torch::randint(0, 32, {8, 1}) + torch::arange(16)).remainder(32);
  torch::Tensor next = (tokens + 1).remainder(32);
  double first = 0, last = 0;
  for (int step = 0; step < 40; ++step) {
    model->zero_grad();
    torch::Tensor logits = model->forward(tokens).reshape({-1, 32});
    torch::Tensor loss = torch::nn::functional::cross_entropy(logits, next.reshape({-1}));
    loss.backward();
    fsdp_root.clip_grad_norm_(1.0);
    optimizer.step();
    (step == 0 ? first : last) = loss.item<double>();
  }
  if (pg->rank() == 0) std::cout << "loss " << first << " -> " << last << std::endl;
  return last < 0.5 * first ? 0 : 1;
} catch (const std::exception& e) {
  std::cerr << fsdp::error_message(e) << std::endl;
  return 1;
}
