// What a unit does between uses: FULL_SHARD keeps only shards outside a
// unit's forward and backward (measured with memory_stats), and each unit
// issues exactly the collectives FSDP needs (counted).

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <tuple>

#include <ATen/record_function.h>

#include <fsdp/fsdp.h>

#include "comm/counting_process_group.h"
#include "core/flat_parameter.h"
#include "error_of.h"
#include "multi_rank.h"
#include "test_models.h"

namespace fsdp::testing {
namespace test_unit_runtime {

using CountingGroup = CountingProcessGroup;

// A root without parameters around four big units, one counting group each.
struct WideImpl : torch::nn::Module {
  WideImpl(const std::vector<std::shared_ptr<CountingGroup>>& groups, ShardingStrategy strategy,
           BackwardPrefetch prefetch = BackwardPrefetch::kBackwardPre) {
    for (size_t i = 0; i < groups.size(); ++i) {
      auto o = FSDPOptions().sharding_strategy(strategy).process_group(groups[i]).backward_prefetch(
          prefetch);
      units.push_back(register_module(
          "u" + std::to_string(i),
          FullyShardedDataParallel<torch::nn::LinearImpl>(torch::nn::Linear(512, 512), o)));
    }
  }
  torch::Tensor forward(torch::Tensor x) {
    for (auto& u : units) x = torch::relu(u->forward(x));
    return x;
  }
  std::vector<FullyShardedDataParallel<torch::nn::LinearImpl>> units;
};
TORCH_MODULE(Wide);

constexpr int64_t kUnitBytes = (512 * 512 + 512) * 4;

TEST(UnitRuntime, CollectivesPerUnitPerStep) {
  run_ranks_ok(2, [](int, int) {
    auto world = init_process_group(ProcessGroupOptions().timeout(std::chrono::seconds(30)));
    for (auto strategy : {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp,
                          ShardingStrategy::kNoShard}) {
      std::vector<std::shared_ptr<CountingGroup>> groups;
      for (int i = 0; i < 4; ++i) groups.push_back(std::make_shared<CountingGroup>(world));
      auto root_group = std::make_shared<CountingGroup>(world);
      auto o = FSDPOptions().sharding_strategy(strategy).process_group(root_group);
      FullyShardedDataParallel<WideImpl> model(Wide(groups, strategy), o);
      torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
      const int steps = 3;
      for (int s = 0; s < steps; ++s) {
        opt.zero_grad();
        model->forward(torch::randn({2, 512})).sum().backward();
        opt.step();
      }
      for (auto& g : groups) {
        if (strategy == ShardingStrategy::kNoShard) {
          EXPECT_EQ(g->all_gathers, 0) << to_string(strategy);
          EXPECT_EQ(g->all_reduces, steps) << to_string(strategy);
        } else {
          // FULL_SHARD gathers before forward and again before backward,
          // except the unit whose forward ends last (Note [The first unit of
          // backward stays gathered]).
          const bool twice = strategy == ShardingStrategy::kFullShard && g != groups.back();
          const int gathers = twice ? 2 * steps : steps;
          EXPECT_EQ(g->all_gathers, gathers) << to_string(strategy);
          EXPECT_EQ(g->reduce_scatters, steps) << to_string(strategy);
        }
      }
      // A root without parameters communicates only the first iteration's
      // forward-order agreement (one tiny all-gather per unit and one at the
      // end of forward, Note [Forward order]) and, once per backward, the
      // small all-reduce of which units got gradients (Note [Reduction order]).
      EXPECT_EQ(root_group->all_gathers, 4 + 1) << to_string(strategy);
      EXPECT_EQ(root_group->all_reduces, steps) << to_string(strategy);
      EXPECT_EQ(root_group->reduce_scatters, 0)
          << "a root without parameters communicates nothing else";
    }
  });
}

// Wide with a root that holds parameters of its own (a head).
struct HeadedWideImpl : torch::nn::Module {
  HeadedWideImpl(const std::vector<std::shared_ptr<CountingGroup>>& groups,
                 ShardingStrategy strategy) {
    body = register_module("body", Wide(groups, strategy));
    head = register_module("head", torch::nn::Linear(512, 4));
  }
  torch::Tensor forward(torch::Tensor x) { return head(body(x)); }
  Wide body{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(HeadedWide);

// Two forwards before one backward (siamese pairs, summed micro-batches):
// the second gathers what it would anyway and nothing the first left
// gathered (the root; SHARD_GRAD_OP's units), as no step came between them
// (Note [Gathered before a step]). A review found a first version gathering
// those anew at every forward.
TEST(UnitRuntime, ASecondForwardBeforeBackwardGathersNothingLeftGathered) {
  run_ranks_ok(2, [](int, int) {
    auto world = init_process_group(ProcessGroupOptions().timeout(std::chrono::seconds(30)));
    for (auto strategy : {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp}) {
      std::vector<std::shared_ptr<CountingGroup>> groups;
      for (int i = 0; i < 4; ++i) groups.push_back(std::make_shared<CountingGroup>(world));
      auto root_group = std::make_shared<CountingGroup>(world);
      auto o = FSDPOptions().sharding_strategy(strategy).process_group(root_group);
      FullyShardedDataParallel<HeadedWideImpl> model(HeadedWide(groups, strategy), o);
      torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
      auto step = [&](int forwards) {
        opt.zero_grad();
        torch::Tensor loss = model->forward(torch::randn({2, 512})).sum();
        if (forwards == 2) loss = loss + model->forward(torch::randn({2, 512})).sum();
        loss.backward();
        opt.step();
      };
      step(1);  // the first iteration also agrees on the forward order
      std::vector<int64_t> before;
      for (auto& g : groups) before.push_back(g->all_gathers);
      const int64_t root_before = root_group->all_gathers;
      const int steps = 2;
      for (int s = 0; s < steps; ++s) step(2);
      EXPECT_EQ(root_group->all_gathers - root_before, steps) << to_string(strategy);
      for (size_t i = 0; i < groups.size(); ++i) {
        // FULL_SHARD: each forward, then backward but for the unit whose
        // forward ended last (Note [The first unit of backward stays
        // gathered]); SHARD_GRAD_OP: the first forward only.
        const bool last = i + 1 == groups.size();
        const int per_step = strategy == ShardingStrategy::kShardGradOp ? 1 : last ? 2 : 3;
        EXPECT_EQ(groups[i]->all_gathers - before[i], steps * per_step)
            << to_string(strategy) << " unit " << i;
      }
    }
  });
}

// Note [Backward with respect to inputs]: a backward that
// differentiates only the input (FGSM's adversarial example) gathers what it
// must (FULL_SHARD's units again) and reduces nothing: no reduce-scatter or
// all-reduce of zeros per unit, only the small all-reduce of the agreement,
// and every .grad stays as the step before left it. The input's gradient is
// the one a full backward gives.
TEST(UnitRuntime, InputGradientsAloneReduceNothing) {
  run_ranks_ok(2, [](int rank, int) {
    auto world = init_process_group(ProcessGroupOptions().timeout(std::chrono::seconds(30)));
    for (auto strategy : {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp,
                          ShardingStrategy::kNoShard}) {
      SCOPED_TRACE(to_string(strategy));
      std::vector<std::shared_ptr<CountingGroup>> groups;
      for (int i = 0; i < 4; ++i) groups.push_back(std::make_shared<CountingGroup>(world));
      auto root_group = std::make_shared<CountingGroup>(world);
      auto o = FSDPOptions().sharding_strategy(strategy).process_group(root_group);
      torch::manual_seed(0);
      FullyShardedDataParallel<WideImpl> model(Wide(groups, strategy), o);
      torch::manual_seed(10 + rank);
      const torch::Tensor x = torch::randn({2, 512}).requires_grad_(true);
      model->forward(x).pow(2).sum().backward();  // the .grad the next backward must keep
      const torch::Tensor full_backward_grad = x.grad().clone();
      std::vector<torch::Tensor> grads;
      for (const auto& p : model->parameters()) grads.push_back(p.grad().clone());
      const auto count = [&](const std::shared_ptr<CountingGroup>& g) {
        return std::vector<int64_t>{g->all_gathers, g->reduce_scatters, g->all_reduces};
      };
      std::vector<std::vector<int64_t>> before;
      for (const auto& g : groups) before.push_back(count(g));
      const int64_t agreements = root_group->all_reduces;

      // torch::autograd::grad, then backward with `inputs`.
      const torch::Tensor input = x.detach().requires_grad_(true);
      const torch::Tensor g =
          torch::autograd::grad({model->forward(input).pow(2).sum()}, {input})[0];
      EXPECT_TRUE(torch::allclose(g, full_backward_grad, 1e-5, 1e-6));
      torch::autograd::backward({model->forward(input).pow(2).sum()}, {}, {}, false, {input});
      EXPECT_TRUE(torch::allclose(input.grad(), full_backward_grad, 1e-5, 1e-6));

      EXPECT_EQ(root_group->all_reduces, agreements + 2) << "one agreement per backward";
      for (size_t u = 0; u < groups.size(); ++u) {
        const std::vector<int64_t> now = count(groups[u]);
        EXPECT_EQ(now[1], before[u][1]) << "unit " << u << " reduce-scattered zeros";
        EXPECT_EQ(now[2], before[u][2]) << "unit " << u << " all-reduced zeros";
        // FULL_SHARD gathers again in backward, but for the unit kept
        // gathered (Note [The first unit of backward stays gathered]).
        const bool regathers = strategy == ShardingStrategy::kFullShard && u + 1 < groups.size();
        const int64_t forward_gathers = strategy == ShardingStrategy::kNoShard ? 0 : 1;
        EXPECT_EQ(now[0] - before[u][0], 2 * (forward_gathers + (regathers ? 1 : 0)))
            << "unit " << u;
        if (strategy != ShardingStrategy::kNoShard) {
          EXPECT_EQ(model->module().units[u]->flat_param()->state(), FlatParameter::State::kSharded)
              << "unit " << u << " is sharded again after backward";
        }
      }
      const auto params = model->parameters();
      for (size_t i = 0; i < params.size(); ++i) {
        EXPECT_TRUE(torch::equal(params[i].grad(), grads[i])) << "parameter " << i;
      }

      // backward with `inputs` naming the first unit's parameters: it
      // reduces (adding to .grad, as LibTorch's backward does), the units
      // behind which it is reduced reduce nothing, and it does not wait for them.
      for (size_t u = 0; u < groups.size(); ++u) before[u] = count(groups[u]);
      auto& first = model->module().units.front()->module();
      torch::autograd::backward({model->forward(input).pow(2).sum()}, {}, {}, false,
                                {first.weight, first.bias});
      for (size_t u = 0; u < groups.size(); ++u) {
        const std::vector<int64_t> now = count(groups[u]);
        EXPECT_EQ(now[1] + now[2], before[u][1] + before[u][2] + (u == 0 ? 1 : 0)) << "unit " << u;
      }
      for (size_t i = 0; i < params.size(); ++i) {
        const torch::Tensor want = i == 0 ? 2 * grads[i] : grads[i];
        EXPECT_TRUE(torch::allclose(params[i].grad(), want, 1e-5, 1e-6)) << "parameter " << i;
      }
    }
  });
}

// The gradients of two fresh Wide models (one counting group per unit),
// after `backwards(model, groups, with)` with `with` false, then true: the
// same backwards without and with what `with` adds.
template <typename Backwards>
std::vector<std::vector<torch::Tensor>> grads_without_and_with(
    const std::shared_ptr<ProcessGroup>& world, ShardingStrategy strategy, int rank,
    const Backwards& backwards) {
  std::vector<std::vector<torch::Tensor>> grads;
  for (const bool with : {false, true}) {
    std::vector<std::shared_ptr<CountingGroup>> groups;
    for (int i = 0; i < 4; ++i) groups.push_back(std::make_shared<CountingGroup>(world));
    torch::manual_seed(0);
    FullyShardedDataParallel<WideImpl> model(Wide(groups, strategy),
                                             FSDPOptions().sharding_strategy(strategy));
    torch::manual_seed(10 + rank);
    backwards(model, groups, with);
    grads.emplace_back();
    for (const auto& p : model->parameters()) grads.back().push_back(p.grad().clone());
  }
  return grads;
}

// An input's gradient taken with retain_graph (a saliency map logged), then
// backward through the same graph: the first reduces nothing, the second
// reduces once per unit and gives the gradients of a backward alone.
TEST(UnitRuntime, InputGradientThenBackwardThroughTheSameGraph) {
  run_ranks_ok(2, [](int rank, int) {
    auto world = init_process_group(ProcessGroupOptions().timeout(std::chrono::seconds(30)));
    for (auto strategy : {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp,
                          ShardingStrategy::kNoShard}) {
      SCOPED_TRACE(to_string(strategy));
      const auto grads = grads_without_and_with(
          world, strategy, rank, [](auto& model, const auto& groups, bool input_grad_first) {
            const torch::Tensor x = torch::randn({2, 512}).requires_grad_(true);
            const torch::Tensor loss = model->forward(x).pow(2).sum();
            if (input_grad_first) {
              torch::autograd::grad({loss}, {x}, {}, /*retain_graph=*/true);
              for (const auto& g : groups) EXPECT_EQ(g->reduce_scatters + g->all_reduces, 0);
            }
            loss.backward();
            for (const auto& g : groups) EXPECT_EQ(g->reduce_scatters + g->all_reduces, 1);
          });
      ASSERT_EQ(grads[0].size(), grads[1].size());
      for (size_t i = 0; i < grads[0].size(); ++i) {
        EXPECT_TRUE(torch::equal(grads[1][i], grads[0][i])) << "parameter " << i;
      }
    }
  });
}

// What no_sync() accumulated is reduced by the next backward that gives
// the units gradients, not dropped nor reduced early by a backward with
// respect to the input in between: the gradients equal those of the same
// backwards without it.
TEST(UnitRuntime, InputGradientsKeepWhatNoSyncAccumulated) {
  run_ranks_ok(2, [](int rank, int) {
    auto world = init_process_group(ProcessGroupOptions().timeout(std::chrono::seconds(30)));
    for (auto strategy : {ShardingStrategy::kFullShard, ShardingStrategy::kNoShard}) {
      SCOPED_TRACE(to_string(strategy));
      const auto grads = grads_without_and_with(
          world, strategy, rank, [](auto& model, const auto& groups, bool input_grad_between) {
            const torch::Tensor a = torch::randn({2, 512}), b = torch::randn({2, 512});
            {
              auto no_sync = model->no_sync();
              model->forward(a).pow(2).sum().backward();
            }
            if (input_grad_between) {
              const torch::Tensor input = b.detach().requires_grad_(true);
              torch::autograd::grad({model->forward(input).sum()}, {input});
              for (const auto& g : groups) EXPECT_EQ(g->reduce_scatters + g->all_reduces, 0);
            }
            model->forward(b).pow(2).sum().backward();
            for (const auto& g : groups) EXPECT_EQ(g->reduce_scatters + g->all_reduces, 1);
          });
      ASSERT_EQ(grads[0].size(), grads[1].size());
      for (size_t i = 0; i < grads[0].size(); ++i) {
        EXPECT_TRUE(torch::allclose(grads[1][i], grads[0][i], 1e-5, 1e-6)) << "parameter " << i;
      }
    }
  });
}

TEST(UnitRuntime, FullShardHoldsOnlyShardsAfterForward) {
  run_ranks_ok(2, [](int, int) {
    enable_memory_tracking();
    auto world = init_process_group(ProcessGroupOptions().timeout(std::chrono::seconds(30)));
    for (auto strategy : {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp}) {
      std::vector<std::shared_ptr<CountingGroup>> groups;
      for (int i = 0; i < 4; ++i) groups.push_back(std::make_shared<CountingGroup>(world));
      for (auto prefetch : {BackwardPrefetch::kBackwardPre, BackwardPrefetch::kNone}) {
        auto o = FSDPOptions().sharding_strategy(strategy).backward_prefetch(prefetch);
        FullyShardedDataParallel<WideImpl> model(Wide(groups, strategy, prefetch), o);
        torch::Tensor x = torch::randn({1, 512});
        const int64_t before = memory_stats().current_bytes;
        torch::Tensor loss = model->forward(x).sum();
        const int64_t grown = memory_stats().current_bytes - before;
        if (strategy == ShardingStrategy::kShardGradOp) {
          EXPECT_GE(grown, 4 * kUnitBytes) << "SHARD_GRAD_OP should keep all four units gathered";
        } else if (prefetch == BackwardPrefetch::kNone) {
          // Activations of batch 1 are a few KiB; one unsharded unit is 1 MiB.
          EXPECT_LT(grown, kUnitBytes / 2) << "FULL_SHARD kept unsharded parameters after forward";
        } else {
          // Only the unit whose backward comes first (Note [The first unit of
          // backward stays gathered]).
          EXPECT_GE(grown, kUnitBytes) << "the last unit should stay gathered for backward";
          EXPECT_LT(grown, kUnitBytes + kUnitBytes / 2) << "FULL_SHARD kept more than one unit";
        }
        loss.backward();
        EXPECT_LT(memory_stats().current_bytes - before, 4 * kUnitBytes)
            << "units should be sharded again after backward";
      }
    }
  });
}

// Note [The first unit of backward stays gathered]: the unit whose forward
// ends last keeps its parameters into backward (one all-gather fewer per
// step), and nothing else changes: the same model trained with
// FSDP's schedule (no backward prefetch) gives bit-equal losses and
// parameters, with a grad-mode forward that no backward follows (validation
// without NoGradGuard) between each backward and optimizer step.
TEST(UnitRuntime, FirstUnitOfBackwardStaysGatheredAndChangesNoResult) {
  run_ranks_ok(2, [](int rank, int) {
    auto world = init_process_group(ProcessGroupOptions().timeout(std::chrono::seconds(30)));
    struct Run {
      std::vector<double> losses;
      std::vector<at::Tensor> params;
      std::vector<int64_t> gathers;
    };
    auto train = [&](int units, BackwardPrefetch prefetch) {
      std::vector<std::shared_ptr<CountingGroup>> groups;
      for (int i = 0; i < units; ++i) groups.push_back(std::make_shared<CountingGroup>(world));
      torch::manual_seed(0);
      auto o = FSDPOptions().backward_prefetch(prefetch);
      FullyShardedDataParallel<WideImpl> model(Wide(groups, ShardingStrategy::kFullShard, prefetch),
                                               o);
      torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-2));
      Run run;
      torch::manual_seed(100 + rank);
      for (int step = 0; step < 4; ++step) {
        torch::Tensor x = torch::randn({3, 512});
        opt.zero_grad();
        torch::Tensor loss = model->forward(x).pow(2).mean();
        const bool kept = prefetch != BackwardPrefetch::kNone;
        const auto& wrapped = model->module().units;
        EXPECT_EQ(wrapped.back()->flat_param()->state() != FlatParameter::State::kSharded, kept)
            << "step " << step;
        for (size_t i = 0; i + 1 < wrapped.size(); ++i) {
          EXPECT_EQ(wrapped[i]->flat_param()->state(), FlatParameter::State::kSharded) << i;
        }
        loss.backward();
        for (const auto& u : model->module().units) {
          EXPECT_EQ(u->flat_param()->state(), FlatParameter::State::kSharded)
              << "every unit is sharded again after backward";
        }
        // A forward that no backward follows, between backward and step:
        // whatever it keeps gathered must not outlive the step's update.
        model->forward(torch::randn({3, 512})).sum();
        opt.step();
        run.losses.push_back(loss.item<double>());
      }
      for (const auto& p : model->parameters()) run.params.push_back(p.detach().clone());
      for (const auto& g : groups) run.gathers.push_back(g->all_gathers);
      return run;
    };
    // One unit: the kept unit is also the first of the next forward.
    for (int units : {4, 1}) {
      SCOPED_TRACE(std::to_string(units) + " units");
      const Run fsdp = train(units, BackwardPrefetch::kNone);
      const Run kept = train(units, BackwardPrefetch::kBackwardPre);
      EXPECT_EQ(fsdp.losses, kept.losses);
      ASSERT_EQ(fsdp.params.size(), kept.params.size());
      for (size_t i = 0; i < fsdp.params.size(); ++i) {
        EXPECT_TRUE(torch::equal(fsdp.params[i], kept.params[i])) << "parameter " << i;
      }
      // 4 training forwards and 4 without backward: FSDP's schedule gathers 8 + 4
      // times per unit; the last unit skips every backward gather. (Kept after
      // a forward without backward, it is gathered afresh by the next forward:
      // the optimizer step may have changed its shard.)
      std::vector<int64_t> expected(units, 12);
      EXPECT_EQ(fsdp.gathers, expected);
      expected.back() = 8;
      EXPECT_EQ(kept.gathers, expected);
    }
  });
}

// Every all-gather of one unit's group, in program order, into a shared log.
class LoggingGroup : public CountingProcessGroup {
 public:
  LoggingGroup(std::shared_ptr<ProcessGroup> inner, std::string name, std::vector<std::string>* log)
      : CountingProcessGroup(std::move(inner)), name_(std::move(name)), log_(log) {}
  Work all_gather_into_tensor(const at::Tensor& flat, const at::Tensor& shard) override {
    log_->push_back("gather " + name_);
    return CountingProcessGroup::all_gather_into_tensor(flat, shard);
  }

 private:
  std::string name_;
  std::vector<std::string>* log_;
};

// A Linear that logs its forward ("forward uN") and, when its output's
// gradient arrives, its backward ("backward uN"), before FSDP's own hook.
struct LoggedLinearImpl : torch::nn::Module {
  LoggedLinearImpl(std::string name, std::function<void(const std::string&)> log)
      : name(std::move(name)), log(std::move(log)) {
    fc = register_module("fc", torch::nn::Linear(64, 64));
  }
  torch::Tensor forward(torch::Tensor x) {
    log("forward " + name);
    torch::Tensor out = torch::relu(fc(x));
    out.register_hook([this](const torch::Tensor&) { log("backward " + name); });
    return out;
  }
  std::string name;
  std::function<void(const std::string&)> log;
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(LoggedLinear);

// Four units registered u0..u3 but run u2, u0, u1, u3: the recorded order
// differs from the registration order.
struct ShuffledImpl : torch::nn::Module {
  ShuffledImpl(const std::shared_ptr<ProcessGroup>& world, const FSDPOptions& o,
               std::vector<std::string>* log, const std::function<void(const std::string&)>& on) {
    for (int i = 0; i < 4; ++i) {
      const std::string name = "u" + std::to_string(i);
      auto unit_options =
          FSDPOptions(o).process_group(std::make_shared<LoggingGroup>(world, name, log));
      units.push_back(register_module(
          name, FullyShardedDataParallel<LoggedLinearImpl>(LoggedLinear(name, on), unit_options)));
    }
  }
  torch::Tensor forward(torch::Tensor x) {
    for (int i : {2, 0, 1, 3}) x = units[i]->forward(x);
    return x;
  }
  std::vector<FullyShardedDataParallel<LoggedLinearImpl>> units;
};

// Note [Forward order] and prefetch: from the second iteration on, forward
// prefetch gathers the next unit of the recorded order before the current
// unit computes, BACKWARD_PRE gathers the recorded predecessor before the
// current unit's backward, and the unit whose forward ends last keeps its
// parameters from forward into backward (Note [The first unit of backward
// stays gathered]); never more than two units are unsharded at once, three while a
// prefetch is in flight.
TEST(UnitRuntime, PrefetchFollowsTheRecordedOrderAndBoundsUnshardedUnits) {
  run_ranks_ok(2, [](int, int) {
    auto world = init_process_group(ProcessGroupOptions().timeout(std::chrono::seconds(30)));
    for (bool prefetch : {false, true}) {
      SCOPED_TRACE(prefetch ? "prefetch" : "no prefetch");
      std::vector<std::string> log;
      std::vector<Unit*> units;
      int max_unsharded = 0;
      auto on = [&](const std::string& event) {
        int n = 0;
        for (Unit* u : units) {
          // Unsharded, or gathering (a prefetch in flight): its buffer is allocated.
          n += u->flat_param()->state() != FlatParameter::State::kSharded ? 1 : 0;
        }
        max_unsharded = std::max(max_unsharded, n);
        log.push_back(event);
      };
      const auto o = FSDPOptions().forward_prefetch(prefetch).backward_prefetch(
          prefetch ? BackwardPrefetch::kBackwardPre : BackwardPrefetch::kNone);
      FullyShardedDataParallel<ShuffledImpl> model(
          std::make_shared<ShuffledImpl>(world, o, &log, on), o);
      for (auto& u : model->module().units) units.push_back(u.get());
      for (int iteration = 0; iteration < 2; ++iteration) {
        log.clear();
        max_unsharded = 0;
        model->forward(torch::randn({2, 64})).sum().backward();
      }
      const std::vector<std::string> expected =
          prefetch
              ? std::vector<std::string>{"gather u2",   "gather u0", "forward u2",  "gather u1",
                                         "forward u0",  "gather u3", "forward u1",  "forward u3",
                                         "backward u3", "gather u1", "backward u1", "gather u0",
                                         "backward u0", "gather u2", "backward u2"}
              : std::vector<std::string>{"gather u2",   "forward u2", "gather u0",   "forward u0",
                                         "gather u1",   "forward u1", "gather u3",   "forward u3",
                                         "backward u3", "gather u3",  "backward u1", "gather u1",
                                         "backward u0", "gather u0",  "backward u2", "gather u2"};
      EXPECT_EQ(log, expected);
      EXPECT_LE(max_unsharded, prefetch ? 3 : 2);
      if (prefetch) EXPECT_GE(max_unsharded, 2) << "prefetch never overlapped two units";
    }
  });
}

TEST(UnitRuntime, WrappingTwiceIsAnErrorOnEveryRank) {
  run_ranks_ok(2, [](int, int) {
    init_process_group(ProcessGroupOptions().timeout(std::chrono::seconds(30)));
    torch::nn::Linear plain(4, 4);
    FullyShardedDataParallel<torch::nn::LinearImpl> unit(plain);
    // The wrapper itself, wrapped again (by either wrapper type).
    using Wrapped = FullyShardedDataParallelImpl<torch::nn::LinearImpl>;
    for (const std::string& msg :
         {error_of([&] { AnyUnit again{torch::nn::AnyModule(unit)}; }),
          error_of([&] { FullyShardedDataParallel<Wrapped> again(unit); })}) {
      EXPECT_NE(msg.find("already an FSDP unit (FullyShardedDataParallel around a "
                         "torch::nn::Linear"),
                std::string::npos)
          << msg;
    }
    // The same plain module handed to a second wrapper.
    const std::string msg =
        error_of([&] { FullyShardedDataParallel<torch::nn::LinearImpl> second(plain); });
    EXPECT_NE(msg.find("cannot wrap torch::nn::Linear"), std::string::npos) << msg;
    EXPECT_NE(msg.find("its parameter 'weight' already belongs to another FSDP unit (around a "
                       "torch::nn::Linear"),
              std::string::npos)
        << msg;
    // A null module: the error names it and the fix.
    const std::string null_msg = error_of([] {
      FullyShardedDataParallel<torch::nn::LinearImpl> none(
          std::shared_ptr<torch::nn::LinearImpl>{});
    });
    EXPECT_NE(null_msg.find("] fsdp(wrap): cannot wrap a null module"), std::string::npos)
        << null_msg;
    // The refused wrapper changed nothing: the first unit still trains.
    unit->forward(torch::randn({2, 4})).sum().backward();
  });
}

// A unit whose forward returns two tensors (a tuple): backward must gather its
// parameters again (FULL_SHARD resharded them after forward) whichever output
// the gradient arrives through.
struct TwoHeadsImpl : torch::nn::Module {
  TwoHeadsImpl() {
    a = register_module("a", torch::nn::Linear(6, 5));
    b = register_module("b", torch::nn::Linear(6, 5));
  }
  std::tuple<torch::Tensor, torch::Tensor> forward(torch::Tensor x) {
    return {torch::tanh(a(x)), b(x)};
  }
  torch::nn::Linear a{nullptr}, b{nullptr};
};
TORCH_MODULE(TwoHeads);

// A forward returning a type whose tensors libfsdp cannot see.
struct OpaqueOutput {
  torch::Tensor value;
};
struct OpaqueImpl : torch::nn::Module {
  OpaqueImpl() { fc = register_module("fc", torch::nn::Linear(6, 6)); }
  OpaqueOutput forward(torch::Tensor x) { return {fc(x)}; }
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(Opaque);

template <typename Heads>
struct TupleNetImpl : torch::nn::Module {
  explicit TupleNetImpl(Heads h) : heads(register_module("heads", h)) {
    head = register_module("head", torch::nn::Linear(5, 2));
  }
  torch::Tensor forward(torch::Tensor x) {
    auto [p, q] = heads->forward(x);
    // Only the second output carries some of the gradient into `head`.
    return head(p) + q.sum(-1, /*keepdim=*/true);
  }
  Heads heads;
  torch::nn::Linear head{nullptr};
};

struct OpaqueNetImpl : torch::nn::Module {
  explicit OpaqueNetImpl(const FSDPOptions& o) {
    unit = register_module("unit", FullyShardedDataParallel<OpaqueImpl>(Opaque(), o));
  }
  torch::Tensor forward(torch::Tensor x) { return unit->forward(x).value; }
  FullyShardedDataParallel<OpaqueImpl> unit{nullptr};
};

TEST(UnitRuntime, TupleOutputsGatherForBackwardAndOpaqueOutputsAreRefused) {
  run_ranks_ok(2, [](int, int) {
    init_process_group(ProcessGroupOptions().timeout(std::chrono::seconds(30)));
    for (auto strategy : {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp}) {
      SCOPED_TRACE(to_string(strategy));
      const auto o = FSDPOptions().sharding_strategy(strategy);
      torch::manual_seed(0);
      auto reference = std::make_shared<TupleNetImpl<TwoHeads>>(TwoHeads());
      torch::manual_seed(0);
      using Wrapped = FullyShardedDataParallel<TwoHeadsImpl>;
      auto inner = std::make_shared<TupleNetImpl<Wrapped>>(Wrapped(TwoHeads(), o));
      FullyShardedDataParallel<TupleNetImpl<Wrapped>> model(inner, o);
      expect_same_training(*reference, *model.ptr(), {4, 6}, 3, 0.0, "tuple outputs");
    }
    // An output type that hides its tensors: refused at forward, naming it.
    const auto o = FSDPOptions();
    FullyShardedDataParallel<OpaqueNetImpl> model(std::make_shared<OpaqueNetImpl>(o), o);
    const std::string msg = error_of([&] { model->forward(torch::randn({2, 6})); });
    EXPECT_NE(msg.find("the forward of FSDP unit 'unit' ("), std::string::npos) << msg;
    EXPECT_NE(msg.find("OpaqueImpl) returns "), std::string::npos) << msg;
    EXPECT_NE(msg.find("Return at::Tensor, std::vector<at::Tensor>, or a std::tuple"),
              std::string::npos)
        << msg;
    // Without gradients (evaluation) the type does not matter.
    FullyShardedDataParallel<OpaqueNetImpl> eval_model(std::make_shared<OpaqueNetImpl>(o), o);
    torch::NoGradGuard no_grad;
    EXPECT_EQ(eval_model->forward(torch::randn({2, 6})).sizes(), torch::IntArrayRef({2, 6}));
  });
}

TEST(UnitRuntime, TrainAndEvalReachWrappedModules) {
  run_ranks_ok(1, [](int, int) {
    init_process_group();
    FullyShardedDataParallel<torch::nn::DropoutImpl> dropout(torch::nn::Dropout(0.5));
    dropout->eval();
    EXPECT_FALSE(dropout->module().is_training());
    torch::Tensor x = torch::ones({1000});
    EXPECT_TRUE(torch::equal(dropout->forward(x), x)) << "dropout still active in eval()";
    dropout->train();
    EXPECT_TRUE(dropout->module().is_training());
  });
}

// Profiler labels: a user's profile (anything listening to RecordFunction,
// as torch::autograd::profiler does) shows each unit's all-gathers,
// reductions and hooks under its module path.
std::mutex g_labels_mutex;
std::set<std::string> g_labels;
std::unique_ptr<at::ObserverContext> record_label(const at::RecordFunction& fn) {
  const std::string name = fn.name();
  if (name.rfind("fsdp::", 0) == 0) {
    std::lock_guard<std::mutex> lock(g_labels_mutex);
    g_labels.insert(name);
  }
  return nullptr;
}

TEST(UnitRuntime, ProfilerLabelsNameEachUnitsCollectivesAndHooks) {
  run_ranks_ok(2, [](int, int) {
    auto world = init_process_group(ProcessGroupOptions().timeout(std::chrono::seconds(30)));
    for (auto strategy : {ShardingStrategy::kFullShard, ShardingStrategy::kNoShard}) {
      std::vector<std::shared_ptr<CountingGroup>> groups;
      for (int i = 0; i < 2; ++i) groups.push_back(std::make_shared<CountingGroup>(world));
      FullyShardedDataParallel<WideImpl> model(Wide(groups, strategy),
                                               FSDPOptions().sharding_strategy(strategy));
      {
        std::lock_guard<std::mutex> lock(g_labels_mutex);
        g_labels.clear();
      }
      const auto handle = at::addGlobalCallback(
          at::RecordFunctionCallback(record_label).scopes({at::RecordScope::USER_SCOPE}));
      model->forward(torch::randn({2, 512})).sum().backward();
      at::removeCallback(handle);
      std::set<std::string> want = {"fsdp::pre_forward (root)", "fsdp::pre_forward (u1)",
                                    "fsdp::post_forward (u1)",  "fsdp::pre_backward (u0)",
                                    "fsdp::pre_backward (u1)",  "fsdp::end_of_backward"};
      if (strategy == ShardingStrategy::kFullShard) {
        want.insert({"fsdp::all_gather (u0)", "fsdp::all_gather (u1)", "fsdp::reduce_scatter (u0)",
                     "fsdp::reduce_scatter (u1)"});
      } else {
        want.insert({"fsdp::all_reduce (u0)", "fsdp::all_reduce (u1)"});
      }
      std::lock_guard<std::mutex> lock(g_labels_mutex);
      for (const auto& label : want) EXPECT_EQ(g_labels.count(label), 1u) << label;
    }
  });
}

// Another layer reaches a unit's parameters only through the unit, which
// refuses while it is inside its forward or backward.
struct ProbeImpl : torch::nn::Module {
  ProbeImpl() : fc(register_module("fc", torch::nn::Linear(4, 4))) {}
  torch::Tensor forward(torch::Tensor x) {
    if (during) during();
    return fc(x);
  }
  torch::nn::Linear fc;
  std::function<void()> during;
};
TORCH_MODULE(Probe);

TEST(UnitRuntime, FullParametersAreRefusedInsideForwardOnEveryRank) {
  run_ranks_ok(2, [](int, int) {
    init_process_group(ProcessGroupOptions().timeout(std::chrono::seconds(30)));
    Probe probe;
    FullyShardedDataParallel<ProbeImpl> unit(probe);
    probe->during = [&] { SummonFullParams full(*unit); };
    const std::string msg = error_of([&] { unit->forward(torch::randn({2, 4})); });
    EXPECT_NE(msg.find("fsdp(root): cannot gather the full parameters while the unit is in "
                       "its forward state"),
              std::string::npos)
        << msg;
    // Outside forward and backward the same guard works.
    probe->during = nullptr;
    unit->forward(torch::randn({2, 4})).sum().backward();
    SummonFullParams full(*unit);
    EXPECT_EQ(probe->fc->weight.numel(), 16);
  });
}

}  // namespace test_unit_runtime
}  // namespace fsdp::testing
