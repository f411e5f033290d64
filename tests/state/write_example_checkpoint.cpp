// Writes a full checkpoint of the test model (wrapped, AdamW after two
// steps) to argv[1]; run under fsdprun. check_safetensors_header.py then
// reads it with nothing but Python's standard library.

#include <torch/torch.h>

#include <iostream>

#include <fsdp/fsdp.h>

#include "test_models.h"

int main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: write_example_checkpoint DIR\n";
    return 2;
  }
  fsdp::init_process_group();
  torch::manual_seed(0);
  const auto o = fsdp::FSDPOptions();
  fsdp::FullyShardedDataParallel<fsdp::testing::NetImpl> model(
      std::make_shared<fsdp::testing::NetImpl>(true, o), o);
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-2));
  for (int step = 0; step < 2; ++step) {
    opt.zero_grad();
    torch::mse_loss(model->forward(torch::randn({4, 7})), torch::ones({4, 3})).backward();
    opt.step();
  }
  fsdp::Checkpointer(*model, &opt).save(argv[1], 2, fsdp::StateDictType::kFull);
  return 0;
}
