// A LibTorch user's own program, built against the installed library: it
// sums one per rank, then trains with fsdp::fully_shard a ModuleList model whose classes know
// nothing of FSDP, fsdp::optim::FusedAdamW with weight decay stepping each unit beside backward
// after fsdp::check_memory, model->zero_grad(), and torch::save of the full model under
// SummonFullParams loaded into a plain twin.
#include <fsdp/fsdp.h>
#include <torch/torch.h>

#include <cstdio>
#include <iostream>
#include <string>

#include <unistd.h>

struct BlockImpl : torch::nn::Module {
  BlockImpl() { fc = register_module("fc", torch::nn::Linear(16, 16)); }
  torch::Tensor forward(torch::Tensor x) { return x + torch::tanh(fc(x)); }
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(Block);

struct NetImpl : torch::nn::Module {
  NetImpl() {
    blocks = register_module("blocks", torch::nn::ModuleList(Block(), Block(), Block()));
    head = register_module("head", torch::nn::Linear(16, 1));
  }
  torch::Tensor forward(torch::Tensor x) {
    for (const auto& b : *blocks) x = b->as<BlockImpl>()->forward(x);
    return head(x);
  }
  torch::nn::ModuleList blocks{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(Net);

int main() try {
  auto pg = fsdp::init_process_group();
  at::Tensor ones = at::ones({1});
  pg->all_reduce(ones).wait();
  std::cout << "consumer rank " << pg->rank() << " counted " << ones.item<float>() << std::endl;
  if (ones.item<float>() != pg->size()) return 1;
  torch::manual_seed(0);
  Net model;
  fsdp::Unit& root = fsdp::fully_shard(model, fsdp::module_type_policy<BlockImpl>());
  fsdp::optim::FusedAdamW opt(root.flat_parameters(),
                              torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
  fsdp::check_memory(*model, &opt);  // fits: the plan is collective and says nothing
  opt.step_during_backward(*model);  // each unit stepped as its gradient arrives
  torch::manual_seed(10 + pg->rank());
  const torch::Tensor x = torch::randn({8, 16});
  const torch::Tensor y = x.sum(1, true).sin();
  double first = 0, last = 0;
  for (int step = 0; step < 30; ++step) {
    model->zero_grad();
    torch::Tensor loss = torch::mse_loss(model->forward(x), y);
    loss.backward();
    opt.step();
    (step == 0 ? first : last) = loss.item<double>();
  }
  const std::string path = "/tmp/fsdp_consumer_fully_shard_" + std::to_string(getppid()) + ".pt";
  bool same = true;
  {
    fsdp::SummonFullParams full(*model);
    if (pg->rank() == 0) torch::save(model, path);
    pg->barrier().wait();
    Net plain;
    torch::load(plain, path);
    const auto want = model->named_parameters();
    for (const auto& p : plain->named_parameters())
      same = same && torch::equal(p.value(), want[p.key()]);
  }
  pg->barrier().wait();
  if (pg->rank() == 0) std::remove(path.c_str());
  std::cout << "fully_shard app rank " << pg->rank() << (same ? " saved" : " MISMATCH") << " loss "
            << first << " -> " << last << std::endl;
  return same && last < 0.5 * first ? 0 : 1;
} catch (const std::exception& e) {
  std::cerr << fsdp::error_message(e) << std::endl;
  return 1;
}
