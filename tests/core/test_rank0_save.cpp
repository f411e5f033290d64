// PyTorch's habit of saving a full model from rank 0 only:
//     { fsdp::SummonFullParams full(*model); if (rank == 0) torch::save(model, path); }
// for every sharding strategy, for wrapped (FullyShardedDataParallel,
// auto_wrap) and fully_shard models, at 1-3 ranks, with and without
// rank0_only. Rank 0's save issues no collective (see Note [Saving a
// unit]), so the group stays intact; the file loads into the plain model,
// under mixed precision too (the full-precision values). What still needs
// one is an error on the saving rank, issuing nothing.

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <fsdp/fsdp.h>

#include "error_of.h"
#include "multi_rank.h"
#include "test_models.h"

namespace fsdp::testing {
namespace test_rank0_save {

namespace nn = torch::nn;

void init() {
  torch::set_num_threads(1);
  init_process_group(ProcessGroupOptions().timeout(std::chrono::seconds(30)));
}

// Where rank 0 saves: one file per process tree and configuration.
std::string save_path(const std::string& what) {
  return "/tmp/fsdp_rank0_save_" + std::to_string(is_rank_process() ? getppid() : getpid()) + "_" +
         what + ".pt";
}

nn::Sequential make_seq() {
  return nn::Sequential(nn::Linear(7, 16), nn::ReLU(), nn::Linear(16, 16), nn::ReLU(),
                        nn::Linear(16, 3));
}

// A sharded model (`module` is what torch::save and SummonFullParams take,
// `forward` runs it, `params` is what the optimizer steps) and its plain
// twin, made with the same initial weights, to load the saved file into.
struct Case {
  std::shared_ptr<nn::Module> module;
  std::function<torch::Tensor(const torch::Tensor&)> forward;
  std::vector<torch::Tensor> params;
  std::shared_ptr<nn::Module> plain;
  std::function<torch::Tensor(const torch::Tensor&)> plain_forward;
};

Case make_case(const std::string& kind, const FSDPOptions& options) {
  Case c;
  torch::manual_seed(0);
  if (kind == "wrapped") {  // nested units fc1 and block inside the root unit
    auto model = std::make_shared<FullyShardedDataParallelImpl<NetImpl>>(
        std::make_shared<NetImpl>(true, options), options);
    c.module = model;
    c.forward = [model](const torch::Tensor& x) { return model->forward(x); };
    c.params = model->parameters();
    auto plain = std::make_shared<NetImpl>(false, FSDPOptions());
    c.plain = plain;
    c.plain_forward = [plain](const torch::Tensor& x) { return plain->forward(x); };
  } else if (kind == "auto_wrap") {  // Sequential entries made units, in a root unit
    nn::Sequential seq = make_seq();
    auto_wrap(seq, module_type_policy<nn::LinearImpl>(), options);
    auto model =
        std::make_shared<FullyShardedDataParallelImpl<nn::SequentialImpl>>(seq.ptr(), options);
    c.module = model;
    c.forward = [model](const torch::Tensor& x) { return model->forward(x); };
    c.params = model->parameters();
    std::shared_ptr<nn::SequentialImpl> plain = make_seq().ptr();
    c.plain = plain;
    c.plain_forward = [plain](const torch::Tensor& x) { return plain->forward(x); };
  } else {  // fully_shard: Linear units and the root, in place
    auto model = std::make_shared<NetImpl>(false, FSDPOptions());
    Unit& root = fully_shard(*model, module_type_policy<nn::LinearImpl>(), options);
    c.module = model;
    c.forward = [model](const torch::Tensor& x) { return model->forward(x); };
    c.params = root.flat_parameters();
    auto plain = std::make_shared<NetImpl>(false, FSDPOptions());
    c.plain = plain;
    c.plain_forward = [plain](const torch::Tensor& x) { return plain->forward(x); };
  }
  return c;
}

// One SGD step on this rank's own data (different on every rank).
void train_step(Case& c, torch::optim::Optimizer& opt, int rank, int step) {
  torch::manual_seed(100 + 10 * rank + step);
  opt.zero_grad();
  c.forward(torch::randn({4, 7})).pow(2).mean().backward();
  opt.step();
}

// The habit, as PyTorch users write it, on `world` ranks.
void save_on_rank0_under_summon(int world) {
  run_ranks_ok(world, [](int rank, int world) {
    init();
    for (ShardingStrategy strategy : {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp,
                                      ShardingStrategy::kNoShard, ShardingStrategy::kHybridShard}) {
      for (const char* kind : {"wrapped", "auto_wrap", "fully_shard"}) {
        for (bool rank0_only : {false, true}) {
          const std::string what = std::string(kind) + "_" + to_string(strategy) +
                                   (rank0_only ? "_rank0_only" : "") + "_world" +
                                   std::to_string(world);
          SCOPED_TRACE(what);
          Case c = make_case(kind, FSDPOptions().sharding_strategy(strategy));
          torch::optim::SGD opt(c.params, torch::optim::SGDOptions(0.1));
          for (int step = 0; step < 2; ++step) train_step(c, opt, rank, step);
          const std::string path = save_path(what);
          std::vector<std::pair<std::string, torch::Tensor>> want;
          {
            SummonFullParams full(*c.module, SummonOptions().rank0_only(rank0_only));
            if (rank == 0) torch::save(c.module, path);
            if (rank == 0) {
              for (const auto& p : c.module->named_parameters())
                want.emplace_back(p.key(), p.value().detach().clone());
            }
          }
          // The group is intact: a barrier, a forward and a training step.
          default_process_group()->barrier().wait();
          torch::Tensor out;
          {
            torch::NoGradGuard no_grad;
            out = c.forward(torch::ones({5, 7}) * 0.3);
          }
          train_step(c, opt, rank, 2);
          default_process_group()->barrier().wait();
          if (rank != 0) continue;
          // Rank 0's file is the plain model after the same training.
          torch::load(c.plain, path);
          std::remove(path.c_str());
          const auto got = c.plain->named_parameters();
          ASSERT_EQ(got.size(), want.size());
          for (const auto& [name, value] : want) {
            const torch::Tensor* g = got.find(name);
            ASSERT_NE(g, nullptr) << name;
            EXPECT_TRUE(torch::equal(*g, value)) << name;
          }
          torch::NoGradGuard no_grad;
          EXPECT_TRUE(torch::allclose(c.plain_forward(torch::ones({5, 7}) * 0.3), out, 1e-5, 1e-6));
        }
      }
    }
  });
}

// A file of another model (its head of another shape) is refused on every
// rank, naming the parameter, and changes nothing: the nested units and the
// root's parameters read before the mismatch keep their values (Note
// [Loading a unit]). The same file's model then loads.
TEST(Rank0Save, ALoadThatDoesNotFitChangesNothing) {
  run_ranks_ok(2, [](int rank, int) {
    init();
    NetTwins twins = make_net_twins(FSDPOptions());
    Net other(false, FSDPOptions());
    other->head = other->replace_module("head", nn::Linear(16, 4));
    {
      torch::NoGradGuard no_grad;
      for (auto& p : other->parameters()) p.fill_(9.0);
    }
    const std::string path = save_path("does_not_fit");
    if (rank == 0) torch::save(other, path);
    default_process_group()->barrier().wait();
    const auto values = [&] {
      SummonFullParams full(*twins.model);
      std::vector<torch::Tensor> out;
      for (const auto& p : twins.model->parameters()) out.push_back(p.detach().clone());
      return out;
    };
    const std::vector<torch::Tensor> before = values();
    const std::string msg = error_of([&] { torch::load(twins.model, path); });
    EXPECT_NE(msg.find("'head.weight' of shape [3, 16]"), std::string::npos) << msg;
    const std::vector<torch::Tensor> after = values();
    ASSERT_EQ(after.size(), before.size());
    for (size_t i = 0; i < before.size(); ++i) {
      EXPECT_TRUE(torch::equal(after[i], before[i])) << "parameter " << i << " changed";
    }
    // A file that fits loads, as before.
    default_process_group()->barrier().wait();
    if (rank == 0) {
      std::remove(path.c_str());
      torch::save(twins.reference, path);
    }
    default_process_group()->barrier().wait();
    torch::load(twins.model, path);
    default_process_group()->barrier().wait();
    if (rank == 0) std::remove(path.c_str());
  });
}

// A wrapper root over units made in place (fully_shard): torch::save writes
// the in-place units' full values too, as the plain model's file, and
// torch::load reads them back into every rank's shards.
TEST(Rank0Save, AWrapperOverFullyShardUnitsSavesAndLoadsFullValues) {
  run_ranks_ok(2, [](int rank, int) {
    init();
    torch::manual_seed(0);
    Net reference(false, FSDPOptions());
    torch::manual_seed(0);
    auto net = std::make_shared<NetImpl>(false, FSDPOptions());
    fully_shard(net->plain_block);
    FullyShardedDataParallel<NetImpl> model(net, FSDPOptions());
    const std::string path = save_path("over_in_place_" + std::to_string(rank));
    torch::save(model, path);  // every rank, outside SummonFullParams
    Net plain(false, FSDPOptions());
    torch::load(plain, path);
    for (const auto& p : reference->named_parameters()) {
      EXPECT_TRUE(torch::equal(plain->named_parameters()[p.key()], p.value())) << p.key();
    }
    {
      torch::NoGradGuard no_grad;
      for (auto& p : plain->parameters()) p.mul_(2);
    }
    torch::save(plain, path);
    torch::load(model, path);
    std::remove(path.c_str());
    SummonFullParams full(*model);
    for (const auto& p : plain->named_parameters()) {
      EXPECT_TRUE(torch::equal(model->named_parameters()[p.key()], p.value())) << p.key();
    }
  });
}

TEST(Rank0Save, UnderSummonFullParamsAtOneRank) { save_on_rank0_under_summon(1); }
TEST(Rank0Save, UnderSummonFullParamsAtTwoRanks) { save_on_rank0_under_summon(2); }
TEST(Rank0Save, UnderSummonFullParamsAtThreeRanks) { save_on_rank0_under_summon(3); }

// What would need an all-gather inside SummonFullParams is an error on the
// saving rank that issues nothing: a rank without the full parameters
// (rank0_only). The group goes on.
TEST(Rank0Save, WhatNeedsACollectiveIsAnErrorOnTheSavingRankOnly) {
  run_ranks_ok(2, [](int rank, int) {
    init();
    Case c = make_case("wrapped", FSDPOptions());
    torch::optim::SGD opt(c.params, torch::optim::SGDOptions(0.1));
    train_step(c, opt, rank, 0);
    const std::string path = save_path(std::string("refused_") + std::to_string(rank));
    std::string msg, dict_msg;
    {
      SummonFullParams full(*c.module, SummonOptions().rank0_only(true));
      if (rank == 1) msg = error_of([&] { torch::save(c.module, path); });
      // full_state_dict on every rank: rank 0 needs no gather under
      // rank0_only, so the others must not issue one either.
      if (rank == 1) dict_msg = error_of([&] { full_state_dict(*c.module); });
      if (rank == 0) {
        EXPECT_EQ(full_state_dict(*c.module).size(), c.plain->named_parameters().size());
      }
    }
    if (rank == 1) {
      EXPECT_NE(dict_msg.find("[rank 1] fsdp(root): expected the full parameters on this rank "
                              "inside SummonFullParams, got this rank's shard only"),
                std::string::npos)
          << dict_msg;
      EXPECT_NE(msg.find("[rank 1] fsdp(root): expected the full parameters on this rank to "
                         "save them inside SummonFullParams, got this rank's shard only"),
                std::string::npos)
          << msg;
      EXPECT_NE(msg.find("on rank 0 only"), std::string::npos) << msg;
    }
    std::remove(path.c_str());
    default_process_group()->barrier().wait();
    train_step(c, opt, rank, 1);
    // Outside SummonFullParams every rank saves (one all-gather per unit).
    torch::save(c.module, path);
    std::remove(path.c_str());
    default_process_group()->barrier().wait();
  });
}

// Under mixed precision SummonFullParams shows the full-precision values, as
// PyTorch's FSDP1 does (Note [Summoning in full precision]), not the bf16
// compute copies: they are the shards' values in float32; rank 0's
// torch::save writes them (a fully_shard model wrote the bf16 copies under
// float32 metadata, a file LibTorch could not load); writeback keeps float32
// changes exactly; a forward inside the guard is refused on every rank; and
// after the guard training goes on as in a twin that never summoned. With
// and without CPU offload (the shards in host memory).
TEST(Rank0Save, UnderMixedPrecisionTheFullPrecisionValues) {
  run_ranks_ok(2, [](int rank, int) {
    init();
    for (ShardingStrategy strategy : {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp,
                                      ShardingStrategy::kNoShard, ShardingStrategy::kHybridShard}) {
      for (const char* kind : {"wrapped", "auto_wrap", "fully_shard"}) {
        for (bool offload : {false, true}) {
          const std::string what =
              std::string(kind) + "_" + to_string(strategy) + "_bf16" + (offload ? "_offload" : "");
          SCOPED_TRACE(what);
          const FSDPOptions options =
              FSDPOptions()
                  .sharding_strategy(strategy)
                  .mixed_precision(MixedPrecision().param_dtype(at::kBFloat16))
                  .cpu_offload(CPUOffload().offload_params(offload));
          // `ref` gives the values (full_state_dict summons it too); `twin`
          // is never summoned before the end.
          Case c = make_case(kind, options), ref = make_case(kind, options),
               twin = make_case(kind, options);
          torch::optim::SGD opt(c.params, torch::optim::SGDOptions(0.1));
          torch::optim::SGD ref_opt(ref.params, torch::optim::SGDOptions(0.1));
          torch::optim::SGD twin_opt(twin.params, torch::optim::SGDOptions(0.1));
          for (int step = 0; step < 2; ++step) {
            train_step(c, opt, rank, step);
            train_step(ref, ref_opt, rank, step);
            train_step(twin, twin_opt, rank, step);
          }
          {  // a forward without backward: SHARD_GRAD_OP keeps its bf16 copies gathered
            torch::NoGradGuard no_grad;
            c.forward(torch::ones({2, 7}));
          }
          // The shards, gathered in fp32 (offload_to_cpu changes nothing on the CPU).
          const auto reference =
              full_state_dict(*ref.module, StateDictOptions().offload_to_cpu(offload));
          const std::string path = save_path(what);
          {
            SummonFullParams full(*c.module, SummonOptions().offload_to_cpu(offload));
            for (const auto& p : c.module->named_parameters()) {
              EXPECT_EQ(p.value().scalar_type(), at::kFloat) << p.key();
              EXPECT_TRUE(torch::equal(p.value(), reference[p.key()])) << p.key();
            }
            if (rank == 0) torch::save(c.module, path);
            if (std::string(kind) != "fully_shard") {
              const std::string msg = error_of([&] { c.forward(torch::ones({2, 7})); });
              EXPECT_NE(
                  msg.find("inside SummonFullParams: its parameters hold their full-precision"),
                  std::string::npos)
                  << msg;
            }
          }
          // Writeback in float32: a change bf16 could not hold lasts exactly.
          auto changed = reference;
          {
            SummonFullParams full(*c.module, SummonOptions().writeback(true));
            torch::NoGradGuard no_grad;
            for (const auto& p : c.module->named_parameters()) {
              p.value().add_(1e-4);
              changed[p.key()] = reference[p.key()] + 1e-4;
            }
          }
          const auto written = full_state_dict(*c.module);
          for (const auto& p : changed) {
            EXPECT_TRUE(torch::equal(written[p.key()], p.value())) << p.key();
          }
          load_full_state_dict(*twin.module, changed);
          train_step(c, opt, rank, 2);
          train_step(twin, twin_opt, rank, 2);
          // After the guards the unit's gradient hooks still run (set_data to
          // float32 and back made autograd forget them): the step moved c as
          // it moved the twin.
          const auto got = full_state_dict(*c.module), want = full_state_dict(*twin.module);
          for (const auto& p : want) {
            EXPECT_TRUE(torch::equal(got[p.key()], p.value())) << p.key();
            EXPECT_FALSE(torch::equal(p.value(), changed[p.key()])) << p.key() << " did not train";
          }
          default_process_group()->barrier().wait();
          if (rank != 0) continue;
          torch::load(c.plain, path);
          std::remove(path.c_str());
          for (const auto& p : c.plain->named_parameters()) {
            EXPECT_EQ(p.value().scalar_type(), at::kFloat) << p.key();
            EXPECT_TRUE(torch::equal(p.value(), reference[p.key()])) << p.key();
          }
        }
      }
    }
  });
}

}  // namespace test_rank0_save
}  // namespace fsdp::testing
