// Round trips of model and optimizer state through full state dicts and
// through full and sharded checkpoints, for FULL_SHARD, SHARD_GRAD_OP and NO_SHARD,
// flat shards and use_orig_params, SGD with momentum and AdamW: what is loaded
// equals what was saved bit for bit, and training continues identically.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <fsdp/fsdp.h>

#include "state_test_util.h"

namespace fsdp::testing {
namespace {

TEST(StateDict, FullStateDictUsesOriginalNamesAndRank0Only) {
  run_ranks_ok(2, [](int rank, int) {
    init_process_group(ProcessGroupOptions().timeout(std::chrono::seconds(30)));
    torch::manual_seed(0);
    Net reference(false, FSDPOptions());
    auto model = make_model(FSDPOptions());
    auto sd = full_state_dict(*model);
    ASSERT_EQ(sd.size(), reference->named_parameters().size());
    for (const auto& p : reference->named_parameters()) {
      const torch::Tensor* t = sd.find(p.key());
      ASSERT_NE(t, nullptr) << p.key();
      EXPECT_TRUE(torch::equal(*t, p.value())) << p.key();
    }
    auto only = full_state_dict(*model, StateDictOptions().rank0_only(true));
    EXPECT_EQ(only.size(), rank == 0 ? sd.size() : 0u);
    // In memory, into a differently initialised model.
    auto other = make_model(FSDPOptions(), /*seed=*/9);
    load_full_state_dict(*other, sd);
    expect_bitwise_equal(full_state_dict(*other), sd, "loaded");
    // A wrong shape is refused with the parameter's name.
    auto bad = sd;
    bad["head.weight"] = torch::zeros({3, 15});
    try {
      load_full_state_dict(*other, bad);
      ADD_FAILURE() << "a wrong shape was accepted";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("head.weight"), std::string::npos) << e.what();
    }
  });
}

TEST(StateDict, FullSaveGathersOneUnitAtATime) {
  const std::string dir = test_dir();
  run_ranks_ok(
      2,
      [&](int, int) {
        enable_memory_tracking();
        init_process_group(ProcessGroupOptions().timeout(std::chrono::seconds(30)));
        torch::manual_seed(0);
        torch::nn::Sequential seq;
        for (int i = 0; i < 6; ++i) seq->push_back(torch::nn::Linear(128, 128));
        for (size_t i = 0; i < seq->size(); ++i) wrap_sequential_entry(seq, i);
        FullyShardedDataParallel<torch::nn::SequentialImpl> model(seq);
        torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(1e-3));
        opt.zero_grad();
        model->forward(torch::randn({2, 128})).sum().backward();
        opt.step();
        const int64_t unit_bytes = 128 * 129 * 4, model_bytes = 6 * unit_bytes;
        const int64_t before = memory_stats().current_bytes;
        reset_peak_memory_stats();
        Checkpointer(*model, &opt).save(dir + "/full", 1, StateDictType::kFull);
        const int64_t extra = memory_stats().peak_bytes - before;
        // A unit's parameters and one gathered optimizer state at a time (plus
        // small temporaries), far below the model's full size.
        EXPECT_LT(extra, 3 * unit_bytes) << "peak " << extra << " bytes, model " << model_bytes;
      },
      with_dir(dir));
  remove_test_dir(dir);
}

struct Case {
  ShardingStrategy strategy;
  bool orig;
  std::string optim;
  StateDictType type;
  std::string name() const {
    return std::string(to_string(strategy)) + (orig ? "-orig-" : "-flat-") + optim + "-" +
           fsdp::to_string(type);
  }
};

std::vector<Case> all_cases() {
  std::vector<Case> out;
  for (auto s :
       {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp, ShardingStrategy::kNoShard})
    for (bool orig : {false, true})
      for (const char* o : {"sgd", "adamw"})
        for (auto t : {StateDictType::kFull, StateDictType::kSharded})
          out.push_back({s, orig, o, t});
  return out;
}

TEST(StateDict, CheckpointRoundTripsAndTrainingContinues) {
  const std::string dir = test_dir();
  run_ranks_ok(
      2,
      [&](int, int) {
        init_process_group(ProcessGroupOptions().timeout(std::chrono::seconds(30)));
        for (const Case& c : all_cases()) {
          const auto o = FSDPOptions().sharding_strategy(c.strategy).use_orig_params(c.orig);
          auto model = make_model(o);
          auto opt = make_optimizer(c.optim, model->parameters());
          torch::manual_seed(3);
          train(*model, *opt, 3);
          Checkpointer(*model, opt.get()).save(dir + "/" + c.name(), 3, c.type);

          auto other = make_model(o, /*seed=*/11);
          auto other_opt = make_optimizer(c.optim, other->parameters());
          EXPECT_EQ(Checkpointer(*other, other_opt.get()).load(dir + "/" + c.name()), 3);
          expect_bitwise_equal(full_state_dict(*other), full_state_dict(*model), c.name());
          const auto saved_optim = full_optim_state_dict(*model, *opt);
          EXPECT_FALSE(saved_optim.is_empty()) << c.name();
          expect_bitwise_equal(full_optim_state_dict(*other, *other_opt), saved_optim, c.name());
          // In memory as well.
          auto third = make_model(o, /*seed=*/12);
          auto third_opt = make_optimizer(c.optim, third->parameters());
          load_full_state_dict(*third, full_state_dict(*model));
          load_full_optim_state_dict(*third, *third_opt, saved_optim);

          torch::manual_seed(4);
          train(*model, *opt, 2);
          torch::manual_seed(4);
          train(*other, *other_opt, 2);
          torch::manual_seed(4);
          train(*third, *third_opt, 2);
          const auto after = full_state_dict(*model);
          expect_bitwise_equal(full_state_dict(*other), after, c.name() + " after training");
          expect_bitwise_equal(full_state_dict(*third), after, c.name() + " in memory");
        }
      },
      with_dir(dir));
  remove_test_dir(dir);
}

}  // namespace
}  // namespace fsdp::testing
