// Resharding on load: a sharded checkpoint saved at one world size loads at
// another (4 -> 1, 2, 3 and 1 -> 2), each rank reading the pieces of its new
// shard from whichever files hold them. The gathered parameters and optimizer
// state are compared bit for bit with what was saved, through the full
// checkpoints each run writes (identical files mean identical tensors).

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <fsdp/fsdp.h>

#include "state_test_util.h"

namespace fsdp::testing {
namespace test_reshard {

FSDPOptions options_for(bool orig) { return FSDPOptions().use_orig_params(orig); }

// Trains, then saves a sharded checkpoint "s<tag>" and a full one "f<tag>".
void train_and_save(const std::string& dir, const std::string& tag, bool orig) {
  auto model = make_model(options_for(orig));
  auto opt = make_optimizer("adamw", model->parameters());
  torch::manual_seed(3);
  train(*model, *opt, 3);
  Checkpointer ckpt(*model, opt.get());
  ckpt.save(dir + "/s" + tag, 3, StateDictType::kSharded);
  ckpt.save(dir + "/f" + tag, 3, StateDictType::kFull);
}

// Loads "s<from>" and saves what it holds as the full checkpoint "f<to>".
void load_and_resave(const std::string& dir, const std::string& from, const std::string& to,
                     bool orig) {
  auto model = make_model(options_for(orig), /*seed=*/21);
  auto opt = make_optimizer("adamw", model->parameters());
  Checkpointer ckpt(*model, opt.get());
  EXPECT_EQ(ckpt.load(dir + "/s" + from), 3);
  ckpt.save(dir + "/f" + to, 3, StateDictType::kFull);
}

void expect_same_full(const std::string& dir, const std::string& a, const std::string& b) {
  for (const char* file : {"model.safetensors", "optim.safetensors"}) {
    const std::string x = file_bytes(dir + "/f" + a + "/" + file);
    EXPECT_GT(x.size(), 100u);
    EXPECT_TRUE(x == file_bytes(dir + "/f" + b + "/" + file))
        << file << " of " << b << " differs from " << a << "'s";
  }
}

void reshard_case(bool orig) {
  const std::string dir = test_dir();
  const auto env = with_dir(dir);
  auto init = [] { init_process_group(ProcessGroupOptions().timeout(std::chrono::seconds(60))); };
  run_ranks_ok(
      4,
      [&](int, int) {
        init();
        train_and_save(dir, "4", orig);
      },
      env);
  for (int world : {1, 2, 3}) {
    const std::string to = "4to" + std::to_string(world);
    run_ranks_ok(
        world,
        [&](int, int) {
          init();
          load_and_resave(dir, "4", to, orig);
        },
        env);
    if (!is_rank_process()) expect_same_full(dir, "4", to);
  }
  run_ranks_ok(
      1,
      [&](int, int) {
        init();
        train_and_save(dir, "1", orig);
      },
      env);
  run_ranks_ok(
      2,
      [&](int, int) {
        init();
        load_and_resave(dir, "1", "1to2", orig);
      },
      env);
  if (!is_rank_process()) expect_same_full(dir, "1", "1to2");
  remove_test_dir(dir);
}

TEST(Reshard, FlatShards) { reshard_case(false); }

TEST(Reshard, OrigParams) { reshard_case(true); }

}  // namespace test_reshard
}  // namespace fsdp::testing
