// HYBRID_SHARD and _HYBRID_SHARD_ZERO2 (Note [Hybrid sharding]): sharded
// within a node's group, replicated across nodes. Each layout (nodes x ranks
// per node) trains like plain LibTorch on the concatenation of every rank's
// different batch, compared every step; the cross-node traffic is exactly one
// all-reduce of each shard per unit and step; dropping that all-reduce breaks
// parity (the control); checkpoints written by a hybrid job load at other
// world sizes and strategies and go on training identically.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <unistd.h>

#include <string>
#include <utility>
#include <vector>

#include <fsdp/fsdp.h>

#include "comm/counting_process_group.h"
#include "core/flat_parameter.h"
#include "detail/posix_files.h"
#include "detail/torch_compat.h"
#include "error_of.h"
#include "multi_rank.h"
#include "test_models.h"

namespace fsdp::testing {
namespace test_hybrid_shard {

struct Layout {
  int nodes;
  int per_node;
  int world() const { return nodes * per_node; }
  std::string name() const {
    return std::to_string(nodes) + " nodes x " + std::to_string(per_node) + " ranks";
  }
};

// Joins the job as rank `rank` of a job laid out as `layout` (ranks numbered
// node by node, as the launchers do).
void init_layout(int rank, const Layout& layout) {
  torch::set_num_threads(1);
  init_process_group(ProcessGroupOptions()
                         .local_rank(rank % layout.per_node)
                         .local_world_size(layout.per_node)
                         .timeout(std::chrono::seconds(30)));
}

std::unique_ptr<torch::optim::Optimizer> make_optimizer(const std::string& kind,
                                                        std::vector<torch::Tensor> params) {
  if (kind == "sgd") {
    return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(0.1).momentum(0.9));
  }
  return std::make_unique<torch::optim::AdamW>(params,
                                               torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
}

// Step `step`'s global batch: 12 rows, so that it splits at 1, 2, 3 and 4 ranks.
std::pair<torch::Tensor, torch::Tensor> global_batch(int step) {
  torch::manual_seed(1000 + step);
  torch::Tensor x = torch::randn({12, 7});
  return {x, torch::randn({12, 3})};
}

using Root = FullyShardedDataParallel<NetImpl>;

Root make_root(const FSDPOptions& options) {
  return Root(std::make_shared<NetImpl>(true, options), options);
}

torch::Tensor local_loss(Root& root, int step) {
  auto [x, target] = global_batch(step);
  return torch::mse_loss(root->forward(local_block(x)), local_block(target));
}

// The largest difference between `root`'s full parameters and `reference`'s.
double max_param_diff(Root& root, Net& reference) {
  SummonFullParams full(*root.ptr());
  double diff = 0;
  auto mine = root->named_parameters(), theirs = reference->named_parameters();
  for (const auto& p : theirs) {
    diff = std::max(diff, (mine[p.key()] - p.value()).abs().max().item<double>());
  }
  return diff;
}

// Trains an FSDP Net and plain LibTorch side by side for `steps` steps;
// checks every step (or, with `expect_equal` false, returns the largest
// difference seen without checking).
double train_against_reference(const FSDPOptions& options, const std::string& optimizer, int steps,
                               bool expect_equal, const std::string& what) {
  torch::manual_seed(0);
  Net reference(false, FSDPOptions());
  torch::manual_seed(0);
  Root root = make_root(options);
  auto ref_opt = make_optimizer(optimizer, reference->parameters());
  auto opt = make_optimizer(optimizer, root->parameters());
  double worst = 0;
  for (int step = 0; step < steps; ++step) {
    auto [x, target] = global_batch(step);
    ref_opt->zero_grad();
    torch::mse_loss(reference->forward(x), target).backward();
    ref_opt->step();
    opt->zero_grad();
    torch::mse_loss(root->forward(local_block(x)), local_block(target)).backward();
    opt->step();
    if (expect_equal) {
      expect_same_after_step(*root.ptr(), *reference.ptr(), what, step);
    } else {
      worst = std::max(worst, max_param_diff(root, reference));
    }
  }
  return worst;
}

const std::vector<Layout>& layouts() {
  static const std::vector<Layout> all = {{1, 1}, {2, 1}, {1, 2}, {3, 1}, {2, 2}};
  return all;
}

TEST(HybridShard, TrainsLikePlainLibTorchAtEveryLayout) {
  for (const Layout& layout : layouts()) {
    run_ranks_ok(layout.world(), [layout](int rank, int) {
      init_layout(rank, layout);
      for (auto strategy : {ShardingStrategy::kHybridShard, ShardingStrategy::kHybridShardZero2}) {
        for (const char* optimizer : {"sgd", "adamw"}) {
          const std::string what =
              std::string(to_string(strategy)) + " " + optimizer + " at " + layout.name();
          train_against_reference(FSDPOptions().sharding_strategy(strategy), optimizer, 4, true,
                                  what);
        }
      }
      // Parameter groups, prefetch and the post-backward prefetch change when
      // and how parameters are gathered, never the result.
      train_against_reference(FSDPOptions()
                                  .sharding_strategy(ShardingStrategy::kHybridShard)
                                  .use_orig_params(true)
                                  .forward_prefetch(true)
                                  .backward_prefetch(BackwardPrefetch::kBackwardPost),
                              "adamw", 3, true, "HYBRID_SHARD orig params at " + layout.name());
    });
  }
}

// Ranks numbered round the nodes (srun --distribution=cyclic): node = rank %
// 2. The shard groups are the launcher's nodes (they were runs of
// consecutive ranks, each spanning both nodes, and the replicate groups
// inside one: every gather crossed the nodes, silently; found by a review),
// and training still matches plain LibTorch.
TEST(HybridShard, GroupsFollowTheLaunchersNodes) {
  run_ranks_ok(4, [](int rank, int) {
    setenv("LOCAL_WORLD_SIZE", "2", 1);
    setenv("LOCAL_RANK", std::to_string(rank / 2).c_str(), 1);
    setenv("GROUP_RANK", std::to_string(rank % 2).c_str(), 1);
    setenv("GROUP_WORLD_SIZE", "2", 1);
    torch::set_num_threads(1);
    init_process_group(ProcessGroupOptions().timeout(std::chrono::seconds(30)));
    ASSERT_EQ(rank_info().node_rank, rank % 2);
    const auto options = FSDPOptions().sharding_strategy(ShardingStrategy::kHybridShard);
    Root root = make_root(options);
    const auto groups = root->fsdp_options().hybrid_groups();
    ASSERT_TRUE(groups.has_value());
    const auto nodes = [](ProcessGroup& g) {
      at::Tensor mine = at::full({1}, static_cast<double>(rank_info().node_rank), at::kDouble);
      at::Tensor all = at::empty({g.size()}, at::kDouble);
      g.all_gather_into_tensor(all, mine).wait();
      return all;
    };
    EXPECT_TRUE(torch::equal(nodes(*groups->shard), at::full({2}, rank % 2, at::kDouble)))
        << "a shard group spans nodes";
    EXPECT_TRUE(torch::equal(nodes(*groups->replicate), at::arange(2, at::kDouble)))
        << "a replicate group is not one rank per node";
    train_against_reference(options, "adamw", 3, true, "HYBRID_SHARD, ranks round the nodes");
  });
}

// Every shard once, also where the units mix strategies (a hybrid root over
// NO_SHARD or FULL_SHARD children, a FULL_SHARD root over hybrid ones):
// the pieces of a node's group count once per job, not once per replica.
// The same with LibTorch's own clip_grad_norm_ of the original parameters
// (Note [LibTorch's clipping of a unit made in place]), one at a time.
TEST(HybridShard, ClipGradNormCountsEachShardOnce) {
  const Layout layout{2, 2};
  run_ranks_ok(layout.world(), [layout](int rank, int) {
    init_layout(rank, layout);
    const auto hybrid = FSDPOptions().sharding_strategy(ShardingStrategy::kHybridShard);
    const std::vector<std::pair<FSDPOptions, FSDPOptions>> roots_and_children = {
        {hybrid, hybrid},
        {hybrid, FSDPOptions().sharding_strategy(ShardingStrategy::kNoShard)},
        {hybrid, FSDPOptions()},
        {FSDPOptions(), hybrid}};
    for (size_t i = 0; i < 2 * roots_and_children.size(); ++i) {
      const size_t c = i % roots_and_children.size();
      const bool libtorch = i >= roots_and_children.size();
      const auto& [root_options, child_options] = roots_and_children[c];
      torch::manual_seed(0);
      Net reference(false, FSDPOptions());
      torch::manual_seed(0);
      Root root(std::make_shared<NetImpl>(true, child_options), root_options);
      torch::optim::SGD ref_opt(reference->parameters(), torch::optim::SGDOptions(0.1));
      torch::optim::SGD opt(root->parameters(), torch::optim::SGDOptions(0.1));
      for (int step = 0; step < 3; ++step) {
        auto [x, target] = global_batch(step);
        ref_opt.zero_grad();
        torch::mse_loss(reference->forward(x), target).backward();
        const double want = torch::nn::utils::clip_grad_norm_(reference->parameters(), 0.05);
        ref_opt.step();
        opt.zero_grad();
        torch::mse_loss(root->forward(local_block(x)), local_block(target)).backward();
        const double got =
            libtorch ? torch::nn::utils::clip_grad_norm_(root->named_parameters().values(), 0.05)
                     : root->clip_grad_norm_(0.05);
        opt.step();
        EXPECT_NEAR(got, want, 1e-6 * want)
            << "case " << c << (libtorch ? " LibTorch's clip" : "") << ", step " << step;
        expect_same_after_step(*root.ptr(), *reference.ptr(), "clipped, case " + std::to_string(c),
                               step);
      }
    }
  });
}

// Forwards everything to `inner` but the all-reduce, which it drops: what a
// HYBRID_SHARD that forgot the cross-node reduction would do.
class DroppingAllReduce : public CountingProcessGroup {
 public:
  using CountingProcessGroup::CountingProcessGroup;
  Work all_reduce(const at::Tensor& t, ReduceOp op) override {
    ++all_reduces;
    return barrier();
  }
};

TEST(HybridShard, CrossNodeTrafficIsOneAllReduceOfEachShard) {
  const Layout layout{2, 2};
  run_ranks_ok(layout.world(), [layout](int rank, int) {
    init_layout(rank, layout);
    HybridGroups groups = new_hybrid_groups(default_process_group(), layout.per_node);
    auto shard = std::make_shared<CountingProcessGroup>(groups.shard);
    auto replicate = std::make_shared<CountingProcessGroup>(groups.replicate);
    const auto options = FSDPOptions()
                             .sharding_strategy(ShardingStrategy::kHybridShard)
                             .hybrid_groups(HybridGroups{groups.world, shard, replicate});
    const int steps = 3;
    torch::manual_seed(0);
    Root root = make_root(options);
    // Making the units checks the groups given (one small all-gather each
    // over the replicate group); the steps move what is counted below.
    const int64_t checks = replicate->all_gathers.load();
    auto opt = make_optimizer("sgd", root->parameters());
    for (int step = 0; step < steps; ++step) {
      opt->zero_grad();
      local_loss(root, step).backward();
      opt->step();
    }
    // Three units (fc1, block, the root); each shard is half of its unit
    // (padded to the node's 2 ranks).
    int64_t shard_bytes = 0, units = 0;
    for (const auto& m : root->modules()) {
      auto* unit = dynamic_cast<Unit*>(m.get());
      if (unit == nullptr || unit->flat_param() == nullptr) continue;
      ++units;
      shard_bytes += unit->flat_param()->shard().numel() * 4;
    }
    EXPECT_EQ(units, 3);
    EXPECT_EQ(replicate->all_reduces.load(), units * steps);
    EXPECT_EQ(replicate->all_reduced_bytes.load(), shard_bytes * steps);
    EXPECT_EQ(checks, units);
    EXPECT_EQ(replicate->all_gathers.load() - checks + replicate->reduce_scatters.load() +
                  replicate->broadcasts.load(),
              0);
    // Inside the node: every unit's gradient reduce-scattered once a step.
    EXPECT_EQ(shard->reduce_scatters.load(), units * steps);
    EXPECT_EQ(shard->reduced_bytes.load(), 2 * shard_bytes * steps);
  });
}

TEST(HybridShard, WithoutTheCrossNodeAllReduceParityFails) {
  // The control for the parity test: the same training with the cross-node
  // all-reduce dropped is measurably off (each node steps with its own
  // nodes' average), so the parity test would catch a broken reduction.
  const Layout layout{2, 1};
  run_ranks_ok(layout.world(), [layout](int rank, int) {
    init_layout(rank, layout);
    HybridGroups groups = new_hybrid_groups(default_process_group(), layout.per_node);
    auto dropping = std::make_shared<DroppingAllReduce>(groups.replicate);
    const auto options = FSDPOptions()
                             .sharding_strategy(ShardingStrategy::kHybridShard)
                             .hybrid_groups(HybridGroups{groups.world, groups.shard, dropping});
    const double diff = train_against_reference(options, "sgd", 3, false, "dropped all-reduce");
    EXPECT_GT(dropping->all_reduces.load(), 0);
    EXPECT_GT(diff, 1e-3) << "dropping the cross-node all-reduce went unnoticed";
  });
}

// Whether every gradient among `params` is still unset or zero (what the
// optimizer's zero_grad() leaves, in every LibTorch version).
bool grads_cleared(const std::vector<torch::Tensor>& params) {
  for (const auto& p : params) {
    if (p.grad().defined() && p.grad().abs().max().item<double>() != 0) return false;
  }
  return true;
}

// Unit::set_requires_all_reduce (Note [Accumulating within the node]): three
// micro-batches a step, the first two reduced within the node only, train
// like plain LibTorch accumulating all three (compared every step), leave
// .grad as zero_grad() left it until the last, and cross the nodes once per
// unit and step (reduce-scattering within the node every micro-batch).
TEST(HybridShard, AccumulatingWithinTheNodeTrainsLikePlainLibTorch) {
  for (const Layout layout : {Layout{2, 1}, Layout{2, 2}}) {
    run_ranks_ok(layout.world(), [layout](int rank, int) {
      init_layout(rank, layout);
      for (auto strategy : {ShardingStrategy::kHybridShard, ShardingStrategy::kHybridShardZero2}) {
        // AdamW after backward, and fsdp::optim's stepping during the last
        // micro-batch's backward (the kept sum handed over early).
        for (const bool during : {false, true}) {
          const std::string what = std::string(to_string(strategy)) + " at " + layout.name() +
                                   (during ? ", stepped during backward" : "");
          HybridGroups groups = new_hybrid_groups(default_process_group(), layout.per_node);
          auto shard = std::make_shared<CountingProcessGroup>(groups.shard);
          auto replicate = std::make_shared<CountingProcessGroup>(groups.replicate);
          const auto options = FSDPOptions().sharding_strategy(strategy).hybrid_groups(
              HybridGroups{groups.world, shard, replicate});
          torch::manual_seed(0);
          Net reference(false, FSDPOptions());
          torch::manual_seed(0);
          Root root = make_root(options);
          auto ref_opt = make_optimizer("adamw", reference->parameters());
          std::unique_ptr<torch::optim::Optimizer> opt;
          if (during) {
            auto fused = std::make_unique<optim::FusedAdamW>(
                root->parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
            fused->step_during_backward(*root.ptr());
            opt = std::move(fused);
          } else {
            opt = make_optimizer("adamw", root->parameters());
          }
          const int64_t all_reduces = replicate->all_reduces.load();
          const int steps = 3, micro_batches = 3, units = 3;
          for (int step = 0; step < steps; ++step) {
            ref_opt->zero_grad();
            opt->zero_grad();
            for (int m = 0; m < micro_batches; ++m) {
              auto [x, target] = global_batch(step * micro_batches + m);
              torch::mse_loss(reference->forward(x), target).backward();
              root->set_requires_all_reduce(m == micro_batches - 1);
              local_loss(root, step * micro_batches + m).backward();
              if (m < micro_batches - 1) {
                EXPECT_TRUE(grads_cleared(root->parameters())) << what << ", micro-batch " << m;
              }
            }
            ref_opt->step();
            opt->step();
            expect_same_after_step(*root.ptr(), *reference.ptr(), what, step);
          }
          EXPECT_EQ(replicate->all_reduces.load() - all_reduces, units * steps) << what;
          EXPECT_EQ(shard->reduce_scatters.load(), units * steps * micro_batches) << what;
        }
      }
    });
  }
}

std::vector<torch::Tensor> full_params(Root& root) {
  SummonFullParams full(*root.ptr());
  std::vector<torch::Tensor> out;
  for (const auto& p : root->named_parameters()) out.push_back(p.value().detach().clone());
  return out;
}

// How a step's micro-batches reach the optimizer in
// AccumulatingWithinTheNodeUnderLowPrecision.
enum class Accumulation {
  kSync,        // every micro-batch reduced across the nodes
  kWithinNode,  // set_requires_all_reduce(last)
  kDropFirst,   // the same, with the model's zero_grad() after micro-batch 0
};

// Full parameters after three steps of three micro-batches each, SGD; the
// all-reduces across the nodes are counted into `across`.
std::vector<torch::Tensor> train_accumulating(FSDPOptions options, Accumulation how, int per_node,
                                              int64_t& across) {
  HybridGroups groups = new_hybrid_groups(default_process_group(), per_node);
  auto replicate = std::make_shared<CountingProcessGroup>(groups.replicate);
  options.hybrid_groups(HybridGroups{groups.world, groups.shard, replicate});
  torch::manual_seed(0);
  Root root = make_root(options);
  torch::optim::SGD opt(root->parameters(), torch::optim::SGDOptions(0.1));
  for (int step = 0; step < 3; ++step) {
    opt.zero_grad();
    for (int m = 0; m < 3; ++m) {
      root->set_requires_all_reduce(how == Accumulation::kSync || m == 2);
      auto [x, target] = global_batch(step * 3 + m);
      // The output in float32 for the loss, as LibTorch 1.13's mse_loss
      // does not promote.
      torch::mse_loss(root->forward(local_block(x)).to(torch::kFloat), local_block(target))
          .backward();
      if (how == Accumulation::kDropFirst && m == 0) root->zero_grad();
    }
    opt.step();
  }
  across = replicate->all_reduces.load();
  return full_params(root);
}

double max_diff(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  double diff = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff = std::max(diff, (a[i] - b[i]).abs().max().item<double>());
  }
  return diff;
}

// Accumulating within the node under mixed precision: the micro-batches
// reduce-scattered in `dtype` (float16 divided before they are added: Note
// [Averaging float16 gradients]) are kept in float32 and rounded once, for
// the all-reduce across the nodes, which runs once a step instead of once a
// micro-batch. The result differs from reducing every micro-batch by that
// rounding only (seen: 2.4e-4 in bf16, 4.3e-5 in float16), far less than a
// step that lost a micro-batch (0.028; the control, which the tolerance
// must catch).
void expect_accumulation_within_the_node_under(at::ScalarType dtype, double tolerance) {
  const Layout layout{2, 2};
  run_ranks_ok(layout.world(), [layout, dtype, tolerance](int rank, int) {
    init_layout(rank, layout);
    const std::string what = c10::toString(dtype);
    const auto options =
        FSDPOptions()
            .sharding_strategy(ShardingStrategy::kHybridShard)
            .mixed_precision(MixedPrecision().param_dtype(dtype).reduce_dtype(dtype));
    int64_t sync_across = 0, within_across = 0, dropped_across = 0;
    const auto sync =
        train_accumulating(options, Accumulation::kSync, layout.per_node, sync_across);
    const auto within =
        train_accumulating(options, Accumulation::kWithinNode, layout.per_node, within_across);
    const auto dropped =
        train_accumulating(options, Accumulation::kDropFirst, layout.per_node, dropped_across);
    const int units = 3, steps = 3, micro_batches = 3;
    EXPECT_EQ(sync_across, units * steps * micro_batches) << what;
    EXPECT_EQ(within_across, units * steps) << what;
    EXPECT_LT(max_diff(within, sync), tolerance) << what;
    EXPECT_GT(max_diff(dropped, sync), 5 * tolerance) << what << ": the control";
  });
}

TEST(HybridShard, AccumulatingWithinTheNodeUnderBf16) {
  expect_accumulation_within_the_node_under(at::kBFloat16, 2e-3);
}

TEST(HybridShard, AccumulatingWithinTheNodeUnderFloat16) {
  try {
    (void)torch::ones({2, 2}, torch::kHalf).mm(torch::ones({2, 2}, torch::kHalf));
  } catch (const c10::Error&) {
    GTEST_SKIP() << "this LibTorch has no float16 matrix product on the CPU";
  }
  expect_accumulation_within_the_node_under(at::kHalf, 5e-4);
}

// The model's zero_grad() between micro-batches drops what was kept within
// the node, as it drops what no_sync accumulated: the step is that of the
// micro-batches after it alone, as in plain LibTorch. Wrappers with flat
// shards, and fully_shard with use_orig_params (its zero_grad reaches the
// units through the pieces' gradients).
// Three micro-batches a step, the window given up after the first with the
// model's zero_grad() (and plain LibTorch's), the last crossing the nodes;
// `model` (FSDP, units of `root`) against `reference` every step.
template <typename Reference, typename Model>
void train_giving_up_a_window(Reference& reference, Model& model, Unit& root,
                              const std::string& what) {
  auto ref_opt = make_optimizer("sgd", reference->parameters());
  auto opt = make_optimizer("sgd", root.flat_parameters());
  for (int step = 0; step < 2; ++step) {
    for (int m = 0; m < 3; ++m) {
      if (m < 2) {
        reference->zero_grad();
        model->zero_grad();
      }
      auto [x, target] = global_batch(step * 3 + m);
      torch::mse_loss(reference->forward(x), target).backward();
      root.set_requires_all_reduce(m == 2);
      torch::mse_loss(model->forward(local_block(x)), local_block(target)).backward();
    }
    ref_opt->step();
    opt->step();
    SummonFullParams full(*model.ptr());
    expect_same_params(*model.ptr(), *reference.ptr(), what + " step " + std::to_string(step));
  }
}

// The model's zero_grad() between micro-batches drops what was kept within
// the node, as it drops what no_sync accumulated: the step is that of the
// micro-batches after it alone, as in plain LibTorch. Wrappers with flat
// shards, and fully_shard with use_orig_params (its zero_grad reaches the
// units through the pieces' gradients).
TEST(HybridShard, ZeroGradDropsWhatWasKeptWithinTheNode) {
  const Layout layout{2, 1};
  run_ranks_ok(layout.world(), [layout](int rank, int) {
    init_layout(rank, layout);
    const auto options = FSDPOptions().sharding_strategy(ShardingStrategy::kHybridShard);
    {
      torch::manual_seed(0);
      Net reference(false, FSDPOptions());
      torch::manual_seed(0);
      Root root = make_root(options);
      train_giving_up_a_window(reference, root, *root.ptr(), "wrappers");
    }
    const auto seeded = [] {
      torch::manual_seed(0);
      return torch::nn::Sequential(torch::nn::Linear(7, 16), torch::nn::ReLU(),
                                   torch::nn::Linear(16, 3));
    };
    torch::nn::Sequential reference = seeded();
    torch::nn::Sequential model = seeded();
    const auto orig = FSDPOptions(options).use_orig_params(true);
    fully_shard(*model->ptr(0), orig);
    Unit& root = fully_shard(*model, orig);
    train_giving_up_a_window(reference, model, root, "fully_shard, use_orig_params");
  });
}

// set_requires_all_reduce(false) on a model with no hybrid unit changes
// nothing (as in FSDP2) and says so once, naming what accumulates without
// communicating.
TEST(HybridShard, RequiresAllReduceWithoutAHybridUnitIsWarned) {
  run_ranks_ok(2, [](int rank, int) {
    init_layout(rank, Layout{1, 2});
    torch::manual_seed(0);
    Root root = make_root(FSDPOptions());
    compat::WarningCollector warnings;
    root->set_requires_all_reduce(false);
    root->set_requires_all_reduce(false);
    size_t warned = 0;
    for (const std::string& m : warnings.messages) {
      warned +=
          m.find("set_requires_all_reduce(false) changes nothing here") != std::string::npos &&
          m.find("set_requires_gradient_sync(false)") != std::string::npos;
    }
    EXPECT_EQ(warned, 1u) << (warnings.messages.empty() ? "" : warnings.messages[0]);
  });
}

// Unit::set_gradient_divide_factor under hybrid sharding (Note [A gradient
// divide factor]): the sum over every rank of both nodes divided by the
// factor, with micro-batches accumulated within the node too.
TEST(HybridShard, ADivideFactorDividesTheSumAcrossTheNodes) {
  const Layout layout{2, 2};
  run_ranks_ok(layout.world(), [layout](int rank, int) {
    init_layout(rank, layout);
    const double factor = 2;
    const auto options = FSDPOptions().sharding_strategy(ShardingStrategy::kHybridShard);
    torch::manual_seed(0);
    Net reference(false, FSDPOptions());
    torch::manual_seed(0);
    Root root = make_root(options);
    root->set_gradient_divide_factor(factor, /*recurse=*/true);
    auto ref_opt = make_optimizer("sgd", reference->parameters());
    auto opt = make_optimizer("sgd", root->parameters());
    for (int step = 0; step < 3; ++step) {
      ref_opt->zero_grad();
      opt->zero_grad();
      for (int m = 0; m < 2; ++m) {
        auto [x, target] = global_batch(step * 2 + m);
        (torch::mse_loss(reference->forward(x), target) * (layout.world() / factor)).backward();
        root->set_requires_all_reduce(m == 1);
        local_loss(root, step * 2 + m).backward();
      }
      ref_opt->step();
      opt->step();
      expect_same_after_step(*root.ptr(), *reference.ptr(), "divided by 2", step);
    }
  });
}

// Two heads, the second used only while `both` is set; with `wrap_b` the
// second is a unit of its own.
struct TwoHeadsImpl : torch::nn::Module {
  explicit TwoHeadsImpl(bool wrap_b = false, const FSDPOptions& o = {})
      : a(register_module("a", torch::nn::Linear(7, 3))) {
    torch::nn::Linear plain_b(7, 3);
    b = wrap_b ? torch::nn::AnyModule(FullyShardedDataParallel<torch::nn::LinearImpl>(plain_b, o))
               : torch::nn::AnyModule(plain_b);
    register_module("b", b.ptr());
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return both ? a(x) + b.forward<torch::Tensor>(x) : a(x);
  }
  torch::nn::Linear a;
  torch::nn::AnyModule b;
  bool both = true;
};
TORCH_MODULE(TwoHeads);

// A parameter used only in a micro-batch whose reduction stayed within the
// node keeps that gradient when the last micro-batch, which does not use it,
// crosses the nodes: with use_orig_params in the root's unit it is stepped
// (AdamW) as plain LibTorch steps it, not left as one no rank gave a
// gradient (with flat shards the root's unit got one anyway); as a unit of
// its own, which the last forward never reached, it still reduces what it
// kept.
TEST(HybridShard, AGradientKeptWithinTheNodeCountsAtTheLastMicroBatch) {
  const Layout layout{2, 1};
  run_ranks_ok(layout.world(), [layout](int rank, int) {
    init_layout(rank, layout);
    for (const bool orig : {true, false}) {
      for (const bool wrap_b : {false, true}) {
        const auto options = FSDPOptions()
                                 .sharding_strategy(ShardingStrategy::kHybridShard)
                                 .hybrid_groups(new_hybrid_groups(default_process_group(), 1))
                                 .use_orig_params(orig);
        const std::string what = std::string("b used in micro-batch 0 only") +
                                 (wrap_b ? ", a unit of its own" : "") +
                                 (orig ? ", use_orig_params" : ", flat shards");
        torch::manual_seed(0);
        TwoHeads reference;
        torch::manual_seed(0);
        FullyShardedDataParallel<TwoHeadsImpl> root(std::make_shared<TwoHeadsImpl>(wrap_b, options),
                                                    options);
        auto ref_opt = make_optimizer("adamw", reference->parameters());
        auto opt = make_optimizer("adamw", root->parameters());
        for (int step = 0; step < 2; ++step) {
          ref_opt->zero_grad();
          opt->zero_grad();
          for (int m = 0; m < 2; ++m) {
            auto [x, target] = global_batch(step * 2 + m);
            reference->both = root->module().both = m == 0;
            torch::mse_loss(reference->forward(x), target).backward();
            root->set_requires_all_reduce(m == 1);
            torch::mse_loss(root->forward(local_block(x)), local_block(target)).backward();
          }
          ref_opt->step();
          opt->step();
          expect_same_after_step(*root.ptr(), *reference.ptr(), what, step);
        }
      }
    }
  });
}

// The full original parameters of `root`, in named_parameters() order (the
// same at every layout and strategy), for comparisons across runs.
TEST(HybridShard, CheckpointsLoadAtOtherLayoutsAndStrategies) {
  MultiRankOptions with_dir;
  const std::string dir = shared_temp_dir(with_dir, "hybrid_ckpt");
  ASSERT_FALSE(dir.empty());
  // Written by a 2 x 2 HYBRID_SHARD job after 2 AdamW steps, sharded and
  // full; the job's parameters after a third step are the expectation.
  const Layout written{2, 2};
  run_ranks_ok(
      written.world(),
      [&](int rank, int) {
        init_layout(rank, written);
        const auto options = FSDPOptions().sharding_strategy(ShardingStrategy::kHybridShard);
        torch::manual_seed(0);
        Root root = make_root(options);
        auto opt = make_optimizer("adamw", root->parameters());
        Checkpointer ckpt(*root.ptr(), opt.get());
        for (int step = 0; step < 3; ++step) {
          if (step == 2) {
            ckpt.save(dir + "/sharded", step, StateDictType::kSharded);
            ckpt.save(dir + "/full", step, StateDictType::kFull);
          }
          opt->zero_grad();
          local_loss(root, step).backward();
          opt->step();
        }
        const auto after = full_params(root);
        if (rank == 0) torch::save(after, dir + "/expected.pt");
      },
      with_dir);
  ASSERT_TRUE(detail::path_exists(dir + "/expected.pt"));
  // A shard is saved once, by its copy on the first node: the second node's
  // files hold headers only.
  if (!is_rank_process()) {
    const auto size = [&](int r) {
      std::error_code ec;
      const int64_t bytes =
          detail::file_size(dir + "/sharded/model-rank" + std::to_string(r) + ".safetensors", ec);
      EXPECT_FALSE(ec) << ec.message();
      return bytes;
    };
    EXPECT_GT(size(0), 1000);
    EXPECT_LT(size(2), 200);
    EXPECT_LT(size(3), 200);
  }
  for (const char* strategy_name : {"HYBRID_SHARD", "FULL_SHARD", "NO_SHARD"}) {
    for (int world : {1, 2, 4}) {
      if (std::string(strategy_name) == "HYBRID_SHARD" && world != 4) continue;
      const Layout layout{world == 4 ? 2 : 1, world == 4 ? 2 : world};
      for (const char* kind : {"sharded", "full"}) {
        run_ranks_ok(
            layout.world(),
            [&](int rank, int) {
              init_layout(rank, layout);
              const std::string s = strategy_name;
              const auto strategy = s == "HYBRID_SHARD" ? ShardingStrategy::kHybridShard
                                    : s == "FULL_SHARD" ? ShardingStrategy::kFullShard
                                                        : ShardingStrategy::kNoShard;
              const auto options = FSDPOptions().sharding_strategy(strategy);
              torch::manual_seed(1);  // other initial values: the load must replace them
              Root root = make_root(options);
              auto opt = make_optimizer("adamw", root->parameters());
              Checkpointer ckpt(*root.ptr(), opt.get());
              EXPECT_EQ(ckpt.load(dir + "/" + kind), 2);
              opt->zero_grad();
              local_loss(root, 2).backward();
              opt->step();
              std::vector<torch::Tensor> expected;
              torch::load(expected, dir + "/expected.pt");
              const auto got = full_params(root);
              ASSERT_EQ(got.size(), expected.size());
              for (size_t i = 0; i < got.size(); ++i) {
                EXPECT_TRUE(torch::allclose(got[i], expected[i], 1.3e-6, 1e-5))
                    << kind << " checkpoint of 2 x 2 HYBRID_SHARD loaded by " << s << " at "
                    << layout.name() << ": parameter " << i << " max diff "
                    << (got[i] - expected[i]).abs().max().item<double>();
              }
            },
            with_dir);
      }
    }
  }
  std::error_code ignored;
  if (!is_rank_process() && !HasFailure()) detail::remove_tree(dir, ignored);
}

// hybrid_groups under a strategy that ignores them (an easy slip: the job
// shards over the whole world, every gather crossing nodes) is warned,
// naming the fix.
TEST(HybridShard, GroupsWithoutAHybridStrategyAreWarned) {
  run_ranks_ok(2, [](int rank, int) {
    init_layout(rank, Layout{1, 2});
    HybridGroups groups = new_hybrid_groups(default_process_group(), 2);
    compat::WarningCollector warnings;
    torch::manual_seed(0);
    Root root = make_root(FSDPOptions().hybrid_groups(groups));
    size_t warned = 0;
    for (const std::string& m : warnings.messages) {
      warned +=
          m.find("sharding_strategy is FULL_SHARD, which does not use them") != std::string::npos &&
          m.find("sharding_strategy(ShardingStrategy::kHybridShard)") != std::string::npos;
    }
    EXPECT_EQ(warned, 1u) << (warnings.messages.empty() ? "" : warnings.messages[0]);
  });
}

TEST(HybridShard, InconsistentGroupsAreRefused) {
  run_ranks_ok(2, [](int rank, int) {
    init_layout(rank, Layout{1, 2});
    HybridGroups groups = new_hybrid_groups(default_process_group(), 2);
    // A replicate group that does not complete the shard group to the world.
    HybridGroups wrong{groups.world, groups.shard, groups.shard};
    torch::manual_seed(0);
    try {
      Root root = make_root(
          FSDPOptions().sharding_strategy(ShardingStrategy::kHybridShard).hybrid_groups(wrong));
      ADD_FAILURE() << "inconsistent hybrid groups were accepted";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what_without_backtrace()).find("!= world size 2"), std::string::npos)
          << e.what_without_backtrace();
    }
  });
  // Sizes that fit, but replicate groups that pair rank 0 of one node's
  // shard group with rank 1 of the other's: refused on every rank.
  run_ranks_ok(4, [](int rank, int) {
    init_layout(rank, Layout{2, 2});
    const auto world = default_process_group();
    std::shared_ptr<ProcessGroup> shard, replicate;
    for (const std::vector<int>& ranks :
         std::vector<std::vector<int>>{{0, 1}, {2, 3}, {0, 3}, {1, 2}}) {
      auto group = world->new_subgroup(ranks);
      if (!group) continue;
      (ranks == std::vector<int>{0, 1} || ranks == std::vector<int>{2, 3} ? shard : replicate) =
          group;
    }
    const std::string msg = error_of([&] {
      make_root(FSDPOptions()
                    .sharding_strategy(ShardingStrategy::kHybridShard)
                    .hybrid_groups(HybridGroups{world, shard, replicate}));
    });
    EXPECT_NE(msg.find("a replicate group holds ranks at different places"), std::string::npos)
        << msg;
  });
  // A shard group made for rank 0 alone: rank 1 has none and fails, and
  // rank 0 with it at once, not in the replicate group's agreement at the
  // timeout (found by review).
  run_ranks_ok(2, [](int rank, int) {
    init_layout(rank, Layout{1, 2});
    const auto world = default_process_group();
    auto shard = world->new_subgroup({0});
    auto replicate = world->new_subgroup({0, 1});
    const auto t0 = std::chrono::steady_clock::now();
    const std::string msg = error_of([&] {
      make_root(FSDPOptions()
                    .sharding_strategy(ShardingStrategy::kHybridShard)
                    .hybrid_groups(HybridGroups{world, shard, replicate}));
    });
    EXPECT_NE(msg.find(rank == 0 ? "refused on another rank" : "this rank got none"),
              std::string::npos)
        << msg;
    EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(10));
  });
  // Nodes told different numbers of ranks (LOCAL_WORLD_SIZE 2, 2, 1, 1): the
  // same error on every rank at once, not subgroups that wait on each other.
  run_ranks_ok(4, [](int rank, int) {
    torch::set_num_threads(1);
    init_process_group(ProcessGroupOptions()
                           .local_rank(rank < 2 ? rank : 0)
                           .local_world_size(rank < 2 ? 2 : 1)
                           .timeout(std::chrono::seconds(30)));
    const auto t0 = std::chrono::steady_clock::now();
    const std::string msg = error_of(
        [] { make_root(FSDPOptions().sharding_strategy(ShardingStrategy::kHybridShard)); });
    EXPECT_NE(msg.find("ranks per node differ"), std::string::npos) << msg;
    EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(10));
  });
}

}  // namespace test_hybrid_shard
}  // namespace fsdp::testing

namespace fsdp::testing {
namespace test_hybrid_shard {

// SummonFullParams with rank0_only keeps the full parameters on the job's
// rank 0 only: not on the first rank of every node (rank 0 of its shard
// group), which would hold a whole model's worth of memory for nothing.
TEST(HybridShard, Rank0OnlySummonsOnTheJobsRank0Only) {
  const Layout layout{2, 2};
  run_ranks_ok(layout.world(), [layout](int rank, int) {
    init_layout(rank, layout);
    const auto options = FSDPOptions().sharding_strategy(ShardingStrategy::kHybridShard);
    Root root = make_root(options);
    SummonFullParams full(*root.ptr(), SummonOptions().rank0_only(true));
    for (const auto& m : root->modules()) {
      const Unit* unit = unit_of(*m);
      if (unit == nullptr || unit->flat_param() == nullptr) continue;
      EXPECT_EQ(unit->flat_param()->holds_full_values(), rank == 0) << "rank " << rank;
    }
  });
}

}  // namespace test_hybrid_shard
}  // namespace fsdp::testing
