// Port of PyTorch's test_fsdp_exec_order (seed 004): the forward order of
// units is agreed across ranks in the first iteration (an error on every rank
// when it differs), compared locally later (one warning), and not checked in
// eval mode without gradients. See Note [Forward order].

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>
#include <vector>

#include <fsdp/fsdp.h>

#include "detail/torch_compat.h"
#include "multi_rank.h"
#include "seed_ports.h"
#include "test_models.h"

namespace fsdp::testing {
namespace test_exec_order {

namespace nn = torch::nn;

constexpr const char* kAcrossRanks = "Forward order differs across ranks";
constexpr const char* kLaterPrefix = "Forward order differs from that of the first iteration";

// The seed's model: layer0 -> layer1 (normal) or layer0 -> layer2 (alternate),
// where layer1 and layer2 both have 36 elements, so their collectives would
// pair up silently. layer1 and layer2 are units; layer0 belongs to the root.
// kNone (not in the seed) runs layer0 only.
enum class Path { kNormal, kAlternate, kNone };

struct SeedModelImpl : nn::Module {
  explicit SeedModelImpl(const FSDPOptions& o) {
    layer0 = register_module("layer0", nn::Linear(5, 6));
    layer1 = register_module("layer1", FullyShardedDataParallel<nn::LinearImpl>(
                                           nn::Linear(nn::LinearOptions(6, 6).bias(false)), o));
    // layer2 is frozen before wrapping, as in the seed; flip_path() unfreezes
    // it through its shard.
    nn::Sequential alt(nn::Linear(nn::LinearOptions(6, 3).bias(false)), nn::ReLU(),
                       nn::Linear(nn::LinearOptions(3, 6).bias(false)));
    for (auto& p : alt->parameters()) p.set_requires_grad(false);
    layer2 = register_module("layer2", FullyShardedDataParallel<nn::SequentialImpl>(alt, o));
  }
  torch::Tensor forward(torch::Tensor x) {
    torch::Tensor z = torch::relu(layer0(x));
    switch (path) {
      case Path::kNormal:
        return torch::relu(layer1(z));
      case Path::kAlternate:
        return torch::relu(layer2(z));
      case Path::kNone:
        return z;
    }
    return z;
  }
  static void set_trainable(const std::vector<torch::Tensor>& shards, bool on) {
    for (torch::Tensor p : shards) p.set_requires_grad(on);
  }
  // Swaps the path and which of layer1 / layer2 is trainable, as the seed does.
  void flip_path() {
    const bool alt = path == Path::kAlternate;
    set_trainable(layer1->parameters(), alt);
    set_trainable(layer2->parameters(), !alt);
    path = alt ? Path::kNormal : Path::kAlternate;
  }

  nn::Linear layer0{nullptr};
  FullyShardedDataParallel<nn::LinearImpl> layer1{nullptr};
  FullyShardedDataParallel<nn::SequentialImpl> layer2{nullptr};
  Path path = Path::kNormal;
};
TORCH_MODULE(SeedModel);

using Root = FullyShardedDataParallel<SeedModelImpl>;

// `device` other than the CPU: the units' device_id, which moves the model
// built on the CPU there.
Root wrap(ShardingStrategy strategy, const torch::Device& device = torch::kCPU) {
  torch::manual_seed(0);  // the same model on every rank
  auto o = FSDPOptions().sharding_strategy(strategy);
  if (!device.is_cpu()) o.device_id(device);
  return Root(SeedModel(o), o);
}

void train_step(Root& model, const torch::Device& device = torch::kCPU) {
  model->forward(torch::randn({8, 5}).to(device)).sum().backward();
}

std::vector<std::string> with_prefix(const std::vector<std::string>& messages,
                                     const std::string& prefix) {
  std::vector<std::string> out;
  for (const auto& m : messages) {
    if (m.rfind(prefix, 0) == 0) out.push_back(m);
  }
  return out;
}

// Every rank runs its forward (in eval mode: `eval`) and expects the
// agreement error, naming what each rank was about to do.
void expect_first_iteration_error(int rank, int world, Path others,
                                  const std::vector<std::string>& expected_parts,
                                  const torch::Device& device = torch::kCPU, bool eval = false) {
  init_process_group(ProcessGroupOptions().timeout(std::chrono::seconds(30)));
  for (const ShardingStrategy strategy : parity_strategies()) {
    Root model = wrap(strategy, device);
    if (eval) model->eval();
    if (rank != 0) {
      if (others == Path::kAlternate) model->module().flip_path();
      if (others == Path::kNone) model->module().path = Path::kNone;
    }
    torch::manual_seed(100 + rank);
    try {
      train_step(model, device);
      ADD_FAILURE() << to_string(strategy) << ": no error on rank " << rank;
    } catch (const c10::Error& e) {
      const std::string msg = e.what_without_backtrace();
      EXPECT_EQ(msg.rfind(kAcrossRanks, 0), 0u) << msg;
      for (const auto& part : expected_parts) {
        EXPECT_NE(msg.find(part), std::string::npos) << "missing '" << part << "' in: " << msg;
      }
    }
  }
  // The group is still usable: the agreement itself completed.
  at::Tensor t = at::ones({1});
  default_process_group()->all_reduce(t).wait();
  EXPECT_EQ(t.item<float>(), static_cast<float>(world));
}

}  // namespace test_exec_order

void check_first_iteration_order_error(const torch::Device& device, int world) {
  using namespace test_exec_order;
  run_ranks_ok(world, [device](int rank, int ranks) {
    expect_first_iteration_error(rank, ranks, Path::kAlternate,
                                 {"rank 0 was about to all-gather unit `layer1`",
                                  ranks == 2 ? "rank 1 was about to all-gather unit `layer2`"
                                             : "ranks 1, 2 were about to all-gather unit `layer2`"},
                                 device);
  });
}

namespace test_exec_order {

TEST(ExecOrder, DifferentUnitInFirstIterationIsAnErrorOnEveryRank) {
  check_first_iteration_order_error(torch::kCPU, 2);
}

TEST(ExecOrder, DifferentUnitInFirstIterationThreeRanks) {
  check_first_iteration_order_error(torch::kCPU, 3);
}

// Fine-tuning in eval mode (dropout off, BatchNorm statistics frozen) with
// gradients on is a training iteration: its order is agreed and recorded
// (for prefetch) as PyTorch's FSDP records it whatever the mode.
TEST(ExecOrder, TrainingInEvalModeIsAgreedToo) {
  run_ranks_ok(2, [](int rank, int world) {
    expect_first_iteration_error(rank, world, Path::kAlternate,
                                 {"rank 0 was about to all-gather unit `layer1`",
                                  "rank 1 was about to all-gather unit `layer2`"},
                                 torch::kCPU, /*eval=*/true);
  });
}

// A rank that runs fewer units would otherwise wait in a backward collective
// while the others gather: the end-of-forward mark catches it.
TEST(ExecOrder, FewerUnitsOnOneRankIsAnErrorOnEveryRank) {
  run_ranks_ok(2, [](int rank, int world) {
    expect_first_iteration_error(rank, world, Path::kNone,
                                 {"rank 0 was about to all-gather unit `layer1`",
                                  "rank 1 was at the end of its forward after 1 unit"});
  });
}

TEST(ExecOrder, OrderChangedAfterFirstIterationWarnsOnceOnTheChangedRanks) {
  run_ranks_ok(2, [](int rank, int) {
    init_process_group(ProcessGroupOptions().timeout(std::chrono::seconds(30)));
    for (auto strategy : {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp}) {
      for (int iters_before_change : {1, 3}) {
        const std::string what = std::string(to_string(strategy)) + " after " +
                                 std::to_string(iters_before_change) + " iteration(s)";
        Root model = wrap(strategy);
        torch::manual_seed(100 + rank);
        compat::WarningCollector warnings;
        for (int i = 0; i < iters_before_change; ++i) train_step(model);
        EXPECT_TRUE(with_prefix(warnings.messages, "Forward order differs").empty()) << what;
        if (rank != 0) model->module().flip_path();
        train_step(model);
        auto warned = with_prefix(warnings.messages, "Forward order differs");
        if (rank == 0) {
          EXPECT_TRUE(warned.empty()) << what << ": " << (warned.empty() ? "" : warned[0]);
        } else {
          ASSERT_EQ(warned.size(), 1u) << what;
          const std::string expected =
              std::string(kLaterPrefix) + " on rank " + std::to_string(rank) +
              ". Collectives are unchecked and may give incorrect results or hang";
          EXPECT_EQ(warned[0].rfind(expected, 0), 0u) << warned[0];
          EXPECT_NE(warned[0].find("unit `layer1`"), std::string::npos) << warned[0];
          EXPECT_NE(warned[0].find("unit `layer2`"), std::string::npos) << warned[0];
          // layer2, frozen when wrapped, was unfrozen through its shard.
          EXPECT_TRUE(model->module().layer2->parameters()[0].grad().defined()) << what;
        }
        // One more iteration: no new warning.
        train_step(model);
        EXPECT_EQ(with_prefix(warnings.messages, "Forward order differs").size(),
                  rank == 0 ? 0u : 1u)
            << what;
      }
    }
  });
}

TEST(ExecOrder, TrainAndEvalEpochsGiveNoWarning) {
  run_ranks_ok(2, [](int rank, int) {
    init_process_group(ProcessGroupOptions().timeout(std::chrono::seconds(30)));
    for (auto strategy : {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp,
                          ShardingStrategy::kNoShard}) {
      Root model = wrap(strategy);
      torch::manual_seed(100 + rank);
      compat::WarningCollector warnings;
      for (int epoch = 0; epoch < 2; ++epoch) {
        model->train();
        for (int i = 0; i < 3; ++i) train_step(model);
        model->eval();
        for (int i = 0; i < 3; ++i) model->forward(torch::randn({8, 5})).sum();
      }
      auto warned = with_prefix(warnings.messages, "Forward order differs");
      EXPECT_TRUE(warned.empty()) << to_string(strategy) << ": " << warned[0];
    }
  });
}

// A validation pass in eval mode without NoGradGuard (a common habit) is
// recorded for want of a training one, but does not decide the order: the
// first training forward records again, and later eval passes on another
// path are not compared.
TEST(ExecOrder, EvalWithGradientsBeforeTrainingDoesNotDecideTheOrder) {
  run_ranks_ok(2, [](int rank, int) {
    init_process_group(ProcessGroupOptions().timeout(std::chrono::seconds(30)));
    Root model = wrap(ShardingStrategy::kFullShard);
    torch::manual_seed(100 + rank);
    compat::WarningCollector warnings;
    for (int epoch = 0; epoch < 2; ++epoch) {
      model->eval();
      model->module().path = Path::kNone;  // validation skips the units
      model->forward(torch::randn({8, 5})).sum();
      model->train();
      model->module().path = Path::kNormal;
      for (int i = 0; i < 2; ++i) train_step(model);
    }
    auto warned = with_prefix(warnings.messages, "Forward order differs");
    EXPECT_TRUE(warned.empty()) << warned[0];
  });
}

// Eval mode checks nothing: ranks may even run different paths there (the
// seed's model would then exchange parameters of the wrong unit, but the
// check must not be what fails).
TEST(ExecOrder, EvalModeIsNotChecked) {
  run_ranks_ok(2, [](int rank, int) {
    init_process_group(ProcessGroupOptions().timeout(std::chrono::seconds(30)));
    Root model = wrap(ShardingStrategy::kShardGradOp);
    compat::WarningCollector warnings;
    model->eval();
    if (rank != 0) model->module().flip_path();
    torch::NoGradGuard no_grad;
    for (int i = 0; i < 2; ++i) model->forward(torch::randn({8, 5}));
    EXPECT_TRUE(with_prefix(warnings.messages, "Forward order differs").empty());
  });
}

// Debug mode (FSDP_DEBUG=detail) changes no result: training with prefetch
// in both directions equals plain LibTorch, every collective fingerprinted.
TEST(ExecOrder, TrainingInDebugModeMatchesPlainLibTorch) {
  MultiRankOptions options;
  options.env["FSDP_DEBUG"] = "detail";
  for (const int world : parity_world_sizes()) {
    SCOPED_TRACE("world " + std::to_string(world));
    run_ranks_ok(
        world,
        [](int, int) {
          auto pg = init_process_group(ProcessGroupOptions().timeout(std::chrono::seconds(30)));
          if (pg->size() > 1) ASSERT_TRUE(pg->debug_collectives());  // nothing to fingerprint alone
          for (auto strategy : {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp,
                                ShardingStrategy::kNoShard}) {
            torch::manual_seed(0);
            Net reference(false, FSDPOptions());
            torch::manual_seed(0);
            auto o = FSDPOptions().sharding_strategy(strategy).forward_prefetch(true);
            FullyShardedDataParallel<NetImpl> model(std::make_shared<NetImpl>(true, o), o);
            // Each rank its own block of every step's batch, compared every step.
            expect_same_training(*reference.ptr(), *model.ptr(), {4, 7}, 3, 0.0,
                                 to_string(strategy));
          }
        },
        options);
  }
}

}  // namespace test_exec_order
}  // namespace fsdp::testing
