// The README's "Sharding a model" code, compiled and run by the tests:
//   build/bin/fsdprun --nproc-per-node 2 build/bin/sharded_mlp

#include <torch/torch.h>

#include <iostream>

#include <fsdp/fsdp.h>

namespace nn = torch::nn;

struct NetImpl : nn::Module {
  NetImpl(const fsdp::FSDPOptions& o) {
    // A unit where the parent calls it: same forward signature, same names.
    fc1 = register_module("fc1",
                          fsdp::FullyShardedDataParallel<nn::LinearImpl>(nn::Linear(784, 1024), o));
    head = register_module("head", nn::Linear(1024, 10));  // managed by the root unit
  }
  torch::Tensor forward(torch::Tensor x) { return head(torch::relu(fc1(x))); }
  fsdp::FullyShardedDataParallel<nn::LinearImpl> fc1{nullptr};
  nn::Linear head{nullptr};
};
TORCH_MODULE(Net);

int run() {
  torch::set_num_threads(1);
  fsdp::init_process_group();
  auto o = fsdp::FSDPOptions()
               .sharding_strategy(fsdp::ShardingStrategy::kFullShard)
               .forward_prefetch(true)
               .backward_prefetch(fsdp::BackwardPrefetch::kBackwardPre);
  torch::manual_seed(0);  // the same initial weights on every rank
  fsdp::FullyShardedDataParallel<NetImpl> model(Net(o), o);  // the root
  torch::optim::AdamW opt(model->parameters(),
                          torch::optim::AdamWOptions(3e-4));  // the flat shards

  // A fixed synthetic task: learn to map random images to fixed labels.
  torch::manual_seed(1);
  torch::Tensor x = torch::randn({32, 784});
  torch::Tensor y = torch::randint(0, 10, {32});
  double first = 0, last = 0;
  for (int step = 0; step < 30; ++step) {
    auto loss = torch::nll_loss(torch::log_softmax(model->forward(x), 1), y);
    opt.zero_grad();
    loss.backward();
    model->clip_grad_norm_(1.0);
    opt.step();
    (step == 0 ? first : last) = loss.item<double>();
  }
  std::cout << "loss " << first << " -> " << last << std::endl;
  return last < 0.5 * first ? 0 : 1;
}

// Errors in one line: a c10::Error's what() carries a C++ backtrace
// (TORCH_SHOW_CPP_STACKTRACES=1 shows it).
int main() {
  try {
    return run();
  } catch (const std::exception& e) {
    std::cerr << fsdp::error_message(e) << std::endl;
    return 1;
  }
}
