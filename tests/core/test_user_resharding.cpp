// FSDP2's knobs over when a unit gathers and frees its parameters (Note
// [Resharding as the user says]): set_reshard_after_forward,
// set_reshard_after_backward, unshard() and reshard(). Each saves the
// all-gathers it should (counted per unit) and trains as plain LibTorch on
// the ranks' different rows, every step, with wrappers and with fully_shard.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include <fsdp/fsdp.h>

#include "core/flat_parameter.h"
#include "error_of.h"
#include "multi_rank.h"
#include "resharding_twins.h"
#include "test_models.h"

namespace fsdp::testing {
namespace test_user_resharding {

using namespace resharding_twins;  // NOLINT(google-build-using-namespace): the file's subject

// Runs `body` at 2 ranks on the Twins of each build and of each of
// `strategies` (its first step is the body's; `what` names the build, and
// the strategy where there are several).
void for_each_twins(
    const std::vector<ShardingStrategy>& strategies,
    const std::function<void(Twins&, Build, ShardingStrategy, const std::string&)>& body) {
  run_ranks_ok(2, [&](int, int) {
    init_process_group(ProcessGroupOptions().timeout(std::chrono::seconds(30)));
    for (Build build : {Build::kWrappers, Build::kFullyShard}) {
      for (ShardingStrategy strategy : strategies) {
        std::string what = to_string(build);
        if (strategies.size() > 1) what += std::string(" ") + to_string(strategy);
        Twins t(build, FSDPOptions().sharding_strategy(strategy));
        body(t, build, strategy, what);
      }
    }
  });
}

// Gradient accumulation as FSDP2 users write it: the micro-batches before
// the last do not sync and keep their units gathered after backward, so
// each forward after the first finds them gathered; the last, which syncs,
// frees them (a step follows). Per step of three micro-batches,
// FULL_SHARD's units gather 4 times instead of 6 (each backward still
// gathers: the forward freed them), a wrapper whose forward ends last
// (gathered into its backward, Note [The first unit of backward stays
// gathered]) once instead of 3 times; SHARD_GRAD_OP's once instead of 3.
// What unshard() gathered before a step is gathered anew.
TEST(UserResharding, NoReshardAfterBackwardSavesTheNextForwardsGathers) {
  for_each_twins(
      {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp},
      [](Twins& t, Build build, ShardingStrategy strategy, const std::string& what) {
        t.step(0, 3, nullptr, what + " plain accumulation");  // also agrees on the forward order
        const bool full = strategy == ShardingStrategy::kFullShard;
        t.after_step = [&] {
          for (Unit* unit : t.units) {
            EXPECT_EQ(unit->flat_param()->state(), State::kSharded)
                << what << ": a synchronising backward frees the unit";
          }
        };
        for (bool keep : {false, true}) {
          // Kept on through the last micro-batch, which synchronises.
          t.root->set_reshard_after_backward(!keep);
          for (int s = 1; s <= 2; ++s) {
            const auto before = t.gathers();
            t.step(
                s, 3, [&](int m) { t.root->set_requires_gradient_sync(m == 2); },
                what + (keep ? " kept" : " freed"));
            const auto gathered = since(t, before);
            for (int i = 0; i < kLayers; ++i) {
              const bool last = i + 1 == kLayers;
              // + 1: the parity check's SummonFullParams.
              const bool kept_into_backward = last && build == Build::kWrappers;
              const int64_t expected =
                  1 + (!full || kept_into_backward ? (keep ? 1 : 3) : (keep ? 4 : 6));
              EXPECT_EQ(gathered[static_cast<size_t>(i)], expected)
                  << what << (keep ? " kept" : " freed") << " step " << s << " unit " << i;
            }
          }
        }
        // Still set, with gradients synchronised every step, LibTorch's SGD
        // (no version moves) and zero_grad() between forward and backward:
        // no sign of the step reaches a unit kept past backward, so none is.
        t.zero_grad_after_forward = true;
        for (int s = 3; s <= 4; ++s) t.step(s, 1, nullptr, what + " zero_grad after forward");
        t.zero_grad_after_forward = false;
        t.after_step = nullptr;
        t.root->set_reshard_after_backward(true);
        // unshard() after a step, then zero_grad(): gathered anew.
        t.step(5, 1, nullptr, what, /*check=*/false);
        for (Unit* unit : t.units) unit->unshard();
        t.opt->zero_grad();
        const auto before = t.gathers();
        for (Unit* unit : t.units) unit->unshard();
        EXPECT_EQ(since(t, before), std::vector<int64_t>(kLayers, 1)) << what;
        t.step(6, 1, nullptr, what + " unsharded after a step");
      });
}

// unshard() before the forward makes the forward's all-gather, waited for
// or not (the forward waits); so does one issued inside the enclosing
// forward for the next layer (a prefetch the user schedules). Either way
// each unit gathers once per forward, and training is plain LibTorch's.
// reshard() frees what unshard() gathered.
TEST(UserResharding, UnshardMakesTheForwardsGatherAheadOfIt) {
  for_each_twins({ShardingStrategy::kFullShard},
                 [](Twins& t, Build build, ShardingStrategy, const std::string& what) {
                   t.step(0, 1, nullptr, what);
                   // Per unit in a step of one micro-batch: the forward's gather (or the
                   // unshard() that replaced it), the backward's (not for a wrapper
                   // whose forward ends last: Note [The first unit of backward stays
                   // gathered]) and the parity check's SummonFullParams.
                   std::vector<int64_t> per_step(kLayers, 3);
                   if (build == Build::kWrappers) per_step.back() = 2;
                   // Ahead of the forward (after the optimizer's zero_grad(), which
                   // would make them stale): units 0 and 1 waited for, 2 and 3 not.
                   auto before = t.gathers();
                   std::vector<Unit::UnshardHandle> handles;
                   t.step(
                       1, 1,
                       [&](int) {
                         for (int i = 0; i < kLayers; ++i)
                           handles.push_back(t.units[i]->unshard(i >= 1));
                         handles[1].wait();
                         for (int i = 0; i < 2; ++i) {
                           EXPECT_EQ(t.units[i]->flat_param()->state(), State::kUnsharded)
                               << what << " unit " << i;
                         }
                         EXPECT_EQ(since(t, before), std::vector<int64_t>(kLayers, 1)) << what;
                         t.units[0]->unshard();  // gathered already: nothing
                         EXPECT_EQ(since(t, before), std::vector<int64_t>(kLayers, 1)) << what;
                       },
                       what + " unsharded ahead");
                   EXPECT_EQ(since(t, before), per_step) << what;
                   handles[3].wait();  // its forward took it over: nothing to wait for

                   // Inside the root's forward, before layer i, the user starts layer
                   // i + 1's gather.
                   t.layers->before_layer = [&](size_t i, const torch::Tensor&) {
                     if (i + 1 < t.units.size()) t.units[i + 1]->unshard(/*async_op=*/true);
                   };
                   before = t.gathers();
                   t.step(2, 1, nullptr, what + " prefetched by hand");
                   EXPECT_EQ(since(t, before), per_step) << what;
                   t.layers->before_layer = nullptr;

                   // reshard() frees it.
                   t.units[2]->unshard();
                   t.units[2]->reshard();
                   EXPECT_EQ(t.units[2]->flat_param()->state(), State::kSharded) << what;
                   // A step after unshard() changes the shards without a sign (LibTorch's
                   // SGD, the gradients kept): torch::save gathers anew what it saves
                   // (outside SummonFullParams a wrapper's save gathers; fully_shard's
                   // modules save under one), and so does the next forward, after
                   // zero_grad().
                   for (Unit* unit : t.units) unit->unshard();
                   t.ref_opt->step();  // both take a momentum-only step on the last gradients
                   t.opt->step();
                   std::stringstream saved;
                   if (build == Build::kWrappers) {
                     torch::save(t.model, saved);
                   } else {
                     SummonFullParams full(*t.model);
                     torch::save(t.model, saved);
                   }
                   Layers loaded(Build::kPlain, t.groups, FSDPOptions());
                   torch::load(loaded, saved);
                   expect_same_params(*loaded, *t.reference, what + " saved after a step");
                   t.step(3, 1, nullptr, what + " unsharded before a step");
                 });
}

// set_reshard_after_forward replaces the strategy's choice: FULL_SHARD kept
// gathered gathers as SHARD_GRAD_OP does (once a step), SHARD_GRAD_OP freed
// as FULL_SHARD does (again in backward), a wrapper root set true frees its
// own head too; evaluation forwards under false gather once, and reshard()
// frees them after (the root's too).
TEST(UserResharding, ReshardAfterForwardOverridesTheStrategy) {
  for_each_twins(
      {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp},
      [](Twins& t, Build build, ShardingStrategy strategy, const std::string& what) {
        t.step(0, 1, nullptr, what);
        const bool full = strategy == ShardingStrategy::kFullShard;
        t.root->set_reshard_after_forward(!full);  // the other strategy's choice
        t.root->set_reshard_after_forward(true, /*recurse=*/false);
        auto before = t.gathers();
        const int64_t root_before = t.root_group->all_gathers;
        t.step(1, 1, nullptr, what + " swapped");
        // Per unit: the forward's gather, the backward's where the forward
        // freed it (not for a wrapper whose forward ends last), and the
        // parity check's SummonFullParams.
        std::vector<int64_t> expected(kLayers, full ? 2 : 3);
        if (!full && build == Build::kWrappers) expected.back() = 2;
        EXPECT_EQ(since(t, before), expected) << what;
        // The root's head: gathered again for backward where its forward
        // ends before it (a wrapper's; fully_shard's ends as its backward
        // begins, so it is kept as the first unit of backward).
        EXPECT_EQ(t.root_group->all_gathers - root_before, build == Build::kWrappers ? 3 : 2)
            << what << ": the root's head";

        // Evaluation: two forwards without grad mode gather once, and the
        // units stay gathered until reshard().
        t.root->set_reshard_after_forward(false);
        before = t.gathers();
        {
          torch::NoGradGuard no_grad;
          for (int e = 0; e < 2; ++e) t.forward(torch::randn({3, 32}));
        }
        EXPECT_EQ(since(t, before), std::vector<int64_t>(kLayers, 1)) << what;
        std::vector<Unit*> all = t.units;
        all.push_back(t.root);
        for (Unit* unit : all) {
          EXPECT_EQ(unit->flat_param()->state(), State::kUnsharded) << what;
          unit->reshard();
          EXPECT_EQ(unit->flat_param()->state(), State::kSharded) << what;
        }
        t.root->set_reshard_after_forward(full);
        t.step(2, 1, nullptr, what + " after evaluation");
      });
}

// unshard() and reshard() inside SummonFullParams are refused, and so is
// reshard() of a wrapper in its forward (the wrapped forward reads the
// parameters directly), on every rank, naming the unit. A unit fully_shard
// made may be freed in its forward (SHARD_GRAD_OP's, which would stay
// gathered): its backward gathers it again, and training is unchanged.
TEST(UserResharding, ReshardInsideAForward) {
  for_each_twins({ShardingStrategy::kShardGradOp}, [](Twins& t, Build build, ShardingStrategy,
                                                      const std::string& what) {
    t.step(0, 1, nullptr, what);
    {
      SummonFullParams full(*t.model);
      EXPECT_CONTAINS(error_of([&] { t.units[1]->unshard(); }), "inside SummonFullParams");
      EXPECT_CONTAINS(error_of([&] { t.units[1]->reshard(); }), "inside SummonFullParams");
    }
    if (build == Build::kWrappers) {
      t.layers->before_layer = [&](size_t i, const torch::Tensor&) {
        if (i == 2) t.root->reshard();
      };
      EXPECT_CONTAINS(error_of([&] {
                        t.forward(torch::randn({2, 32}));
                      }),
                      "reshard() on the root FSDP unit in its forward state");
      t.layers->before_layer = nullptr;
      t.step(1, 1, nullptr, what + " after the refusal");
      return;
    }
    // Before layer 2 runs, layer 1's forward is still under way (it ends
    // as the next unit's begins).
    // Gathered again at once (async_op), an operator on it waits for the
    // gather (its views look gathered while it arrives).
    double seen = 0, read_again = 1;
    t.layers->before_layer = [&](size_t i, const torch::Tensor&) {
      if (i != 2) return;
      const torch::Tensor weight = t.layers->layers[1].ptr()->parameters()[0];
      seen = weight.sum().item<double>();
      t.units[1]->reshard();
      t.units[1]->unshard(/*async_op=*/true);
      read_again = weight.sum().item<double>();
      t.units[1]->reshard();
    };
    const auto before = t.gathers();
    t.step(1, 1, nullptr, what + " freed in its forward");
    EXPECT_EQ(read_again, seen) << what;
    // The forward's gathers (layer 1's twice), layer 1's again for
    // backward, the parity check's SummonFullParams.
    EXPECT_EQ(since(t, before), (std::vector<int64_t>{2, 4, 2, 2})) << what;
    t.layers->before_layer = nullptr;
  });
}

// FSDP2's prefetch lists: a unit's forward starts the gathers of the units
// it lists (layer 0 those of layers 1 and 2: layer 2 is gathered before
// layer 1 runs), its backward those of its list instead of the next one
// (layer 3's backward layers 2 and 1: layer 1 is gathered while layer 3's
// backward still runs). One gather per unit and use all the same, and
// training is plain LibTorch's. A list holding no unit is refused.
TEST(UserResharding, PrefetchListsGatherTheListedUnitsAhead) {
  for_each_twins({ShardingStrategy::kFullShard}, [](Twins& t, Build build, ShardingStrategy,
                                                    const std::string& what) {
    // Layer 2's state before layer 1's forward, layer 1's when layer 3's
    // backward computed its input's gradient.
    State layer2_ahead = State::kSummoned, layer1_in_backward = State::kSummoned;
    t.layers->before_layer = [&](size_t i, const torch::Tensor& x) {
      if (i == 1) layer2_ahead = t.units[2]->flat_param()->state();
      if (i == 3 && x.requires_grad()) {
        x.register_hook(
            [&](const torch::Tensor&) { layer1_in_backward = t.units[1]->flat_param()->state(); });
      }
    };
    t.step(0, 1, nullptr, what);
    EXPECT_EQ(layer2_ahead, State::kSharded) << what << ": prefetched without a list";
    EXPECT_EQ(layer1_in_backward, State::kSharded) << what << ": prefetched without a list";
    t.units[0]->set_modules_to_forward_prefetch({t.units[1], t.units[2]});
    t.units[3]->set_modules_to_backward_prefetch({t.units[2], t.units[1]});
    const auto before = t.gathers();
    t.step(1, 1, nullptr, what + " with lists");
    EXPECT_NE(layer2_ahead, State::kSharded) << what;
    EXPECT_NE(layer1_in_backward, State::kSharded) << what;
    // Per unit: forward, backward (not for a wrapper whose forward ends
    // last), the parity check's SummonFullParams.
    std::vector<int64_t> per_step(kLayers, 3);
    if (build == Build::kWrappers) per_step.back() = 2;
    EXPECT_EQ(since(t, before), per_step) << what;
    EXPECT_CONTAINS(error_of([&] { t.units[0]->set_modules_to_forward_prefetch({nullptr}); }),
                    "set_modules_to_forward_prefetch's entry 0 is null");
  });
}

// Unit::set_unshard_in_backward(false) (Note [Units backward does not
// gather]): a token embedding made a unit by fully_shard gathers once per
// step instead of twice (its backward needs only the indices), and set on a
// Linear unit, whose backward reads its weight, that read gathers it: both
// train like plain LibTorch on the ranks' different rows, every step, at
// 1-3 ranks. A wrapper refuses it.
TEST(UserResharding, UnitsBackwardDoesNotGather) {
  for (const int world : {1, 2, 3}) {
    run_ranks_ok(world, [world](int, int) {
      init_process_group(ProcessGroupOptions().timeout(std::chrono::seconds(30)));
      const auto seeded = [] {
        torch::manual_seed(0);
        return torch::nn::Sequential(torch::nn::Embedding(20, 8), torch::nn::Linear(8, 8),
                                     torch::nn::Tanh(), torch::nn::Linear(8, 3));
      };
      for (const int skipped : {0, 1}) {  // the embedding, or the Linear after it
        const std::string what = std::string(skipped == 0 ? "embedding" : "linear") +
                                 " not gathered in backward, world " + std::to_string(world);
        torch::nn::Sequential reference = seeded();
        torch::nn::Sequential model = seeded();
        std::vector<std::shared_ptr<CountingGroup>> groups;
        for (int i = 0; i < 2; ++i) {
          groups.push_back(std::make_shared<CountingGroup>(default_process_group()));
          fully_shard(*model->ptr(static_cast<size_t>(i)),
                      FSDPOptions().process_group(groups.back()));
        }
        Unit& root = fully_shard(*model);
        unit_of(*model->ptr(static_cast<size_t>(skipped)))->set_unshard_in_backward(false);
        torch::optim::SGD ref_opt(reference->parameters(),
                                  torch::optim::SGDOptions(0.1).momentum(0.9));
        torch::optim::SGD opt(root.flat_parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
        const int steps = 3;
        for (int step = 0; step < steps; ++step) {
          torch::manual_seed(100 + step);
          const torch::Tensor ids = torch::randint(20, {2 * world, 5});
          const torch::Tensor target = torch::randn({2 * world, 5, 3});
          ref_opt.zero_grad();
          torch::mse_loss(reference->forward(ids), target).backward();
          ref_opt.step();
          opt.zero_grad();
          torch::mse_loss(model->forward(local_block(ids)), local_block(target)).backward();
          opt.step();
          SummonFullParams full(*model);
          expect_same_params(*model, *reference, what + " step " + std::to_string(step));
        }
        if (world > 1) {
          // Per step: the forward's gather, the backward's where it reads
          // (the Linear's, even when told not to), the comparison's summon.
          EXPECT_EQ(groups[0]->all_gathers.load(), (skipped == 0 ? 2 : 3) * steps) << what;
          EXPECT_EQ(groups[1]->all_gathers.load(), 3 * steps) << what;
        }
      }
      FullyShardedDataParallel<torch::nn::LinearImpl> wrapper(torch::nn::Linear(4, 4));
      EXPECT_NE(error_of([&] {
                  wrapper->set_unshard_in_backward(false);
                }).find("is a FullyShardedDataParallel wrapper"),
                std::string::npos);
    });
  }
}

}  // namespace test_user_resharding
}  // namespace fsdp::testing
