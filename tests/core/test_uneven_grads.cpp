// Units whose parameters get gradients on some ranks and not on others
// (Note [Reduction order]): an auxiliary head whose loss only some ranks'
// data uses, and (with use_orig_params) a unit with a layer only those ranks
// run. Every rank must still launch the same reductions in the same order,
// and the result must be plain LibTorch's on all ranks' data: the parameters
// get the mean over ranks, zeros from the ranks that did not use them, and
// keep no gradient in a step where no rank used them. AdamW with weight
// decay, so a zero gradient where plain LibTorch has none would show.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>
#include <cstdlib>
#include <functional>
#include <iostream>
#include <string>
#include <utility>
#include <vector>

#include <fsdp/fsdp.h>

#include "multi_rank.h"
#include "test_models.h"

namespace fsdp::testing {
namespace test_uneven_grads {

namespace nn = torch::nn;

// A layer that runs its second Linear only when asked: with use_orig_params
// one unit whose parameters get gradients in part.
struct PairImpl : nn::Module {
  PairImpl() {
    p = register_module("p", nn::Linear(8, 8));
    q = register_module("q", nn::Linear(8, 8));
  }
  torch::Tensor forward(torch::Tensor x, torch::Tensor use_q) {
    x = torch::relu(p(x));
    return use_q.item<bool>() ? q(x) : x;
  }
  nn::Linear p{nullptr}, q{nullptr};
};
TORCH_MODULE(Pair);

// trunk, aux, other and pair are units inside an EnableWrap scope (plain
// modules outside one); head belongs to the root. aux and other have the
// same size, so reductions paired with the wrong unit would not fail by size.
struct BranchyImpl : nn::Module {
  explicit BranchyImpl(bool with_pair) {
    trunk = register_module("trunk", wrap(nn::Linear(6, 8)));
    aux = register_module("aux", wrap(nn::Linear(8, 8)));
    other = register_module("other", wrap(nn::Linear(8, 8)));
    if (with_pair) pair = register_module("pair", wrap(Pair()));
    head = register_module("head", nn::Linear(8, 2));
  }
  // The main output and the auxiliary one (computed on every rank, as every
  // rank runs every unit; only some ranks' losses use it).
  std::pair<torch::Tensor, torch::Tensor> forward(torch::Tensor x, bool use) {
    torch::Tensor h = torch::relu(trunk(x));
    torch::Tensor side = aux(h);
    h = torch::relu(other(h));
    if (pair) h = pair(h, torch::tensor(use));
    return {head(h), side};
  }
  FullyShardedDataParallel<nn::LinearImpl> trunk{nullptr}, aux{nullptr}, other{nullptr};
  FullyShardedDataParallel<PairImpl> pair{nullptr};
  nn::Linear head{nullptr};
};
TORCH_MODULE(Branchy);

// Which ranks use the auxiliary loss (and the pair's q) at each step: some,
// none, another one, all.
bool uses(int rank, int step) {
  switch (step % 4) {
    case 0:
      return rank == 1;
    case 1:
      return false;
    case 2:
      return rank == 0;
    default:
      return true;
  }
}

torch::Tensor loss_of(const std::pair<torch::Tensor, torch::Tensor>& out, const torch::Tensor& y,
                      bool use) {
  torch::Tensor loss = torch::mse_loss(out.first, y.slice(1, 0, 2));
  return use ? loss + torch::mse_loss(out.second, y) : loss;
}

// `two_backwards`: the auxiliary loss's own backward through the main
// one's retained graph (on ranks that do not use it, a zero loss of the
// main output: its second backward reaches other units).
void train_and_compare(ShardingStrategy strategy, bool orig_params, bool two_backwards = false) {
  const auto [rank, world] = rank_and_world();
  const std::string what =
      std::string(to_string(strategy)) + (orig_params ? " use_orig_params" : " flat shards");
  const auto options = FSDPOptions().sharding_strategy(strategy).use_orig_params(orig_params);
  torch::manual_seed(0);
  Branchy reference(orig_params);  // outside a scope: plain modules
  torch::manual_seed(0);
  Branchy inner = [&] {
    EnableWrap scope(options);
    return Branchy(orig_params);
  }();
  FullyShardedDataParallel<BranchyImpl> model(inner, options);
  using torch::optim::AdamWOptions;
  torch::optim::AdamW ref_opt(reference->parameters(), AdamWOptions(1e-2).weight_decay(0.1));
  torch::optim::AdamW opt(model->parameters(), AdamWOptions(1e-2).weight_decay(0.1));
  for (int step = 0; step < 4; ++step) {
    torch::manual_seed(100 + step);
    const torch::Tensor x = torch::randn({4 * world, 6});
    const torch::Tensor y = torch::randn({4 * world, 8});
    // Plain LibTorch on every rank's block: the mean of the ranks' losses.
    ref_opt.zero_grad();
    torch::Tensor ref_loss = torch::zeros({});
    for (int r = 0; r < world; ++r) {
      const torch::Tensor xr = x.chunk(world, 0)[r], yr = y.chunk(world, 0)[r];
      ref_loss = ref_loss + loss_of(reference->forward(xr, uses(r, step)), yr, uses(r, step));
    }
    (ref_loss / world).backward();
    ref_opt.step();
    opt.zero_grad();
    const bool use = uses(rank, step);
    const auto out = model->forward(local_block(x), use);
    if (two_backwards) {
      const torch::Tensor main = loss_of(out, local_block(y), false);
      main.backward({}, /*retain_graph=*/true);
      (use ? torch::mse_loss(out.second, local_block(y)) : main * 0).backward();
    } else {
      loss_of(out, local_block(y), use).backward();
    }
    opt.step();
    expect_same_after_step(*model.ptr(), *reference.ptr(), what, step);
  }
}

// Runs `body(strategy, orig_params)` for each of `strategies`, with flat
// shards and with use_orig_params, at 2 and 3 ranks (real processes).
void at_two_and_three_ranks(const std::vector<ShardingStrategy>& strategies,
                            const std::function<void(ShardingStrategy, bool)>& body) {
  for (const int world : {2, 3}) {
    SCOPED_TRACE("world " + std::to_string(world));
    run_ranks_ok(world, [&](int, int) {
      torch::set_num_threads(1);
      init_process_group(ProcessGroupOptions().timeout(std::chrono::seconds(30)));
      for (const bool orig_params : {false, true}) {
        for (const ShardingStrategy strategy : strategies) body(strategy, orig_params);
      }
    });
  }
}

// SHARD_GRAD_OP and NO_SHARD gather no parameters in backward, so ordering
// the reductions (Note [Reduction order]) is all it takes.
TEST(UnevenGradients, ShardGradOpAndNoShardTrainLikePlainLibTorch) {
  at_two_and_three_ranks({ShardingStrategy::kShardGradOp, ShardingStrategy::kNoShard},
                         [](ShardingStrategy strategy, bool orig_params) {
                           train_and_compare(strategy, orig_params);
                         });
}

// A second backward through the first one's retained graph has no forward
// of its own: it keeps the first one's reduction order. Launched as each
// rank's gradients came, the auxiliary head reduced on the ranks that used
// it and nowhere else. NO_SHARD only: the first backward's end reshards
// SHARD_GRAD_OP's units too, so the second gathers where it reaches their
// outputs, which here differs between ranks (as FULL_SHARD's every backward).
TEST(UnevenGradients, ASecondBackwardThroughARetainedGraphKeepsTheOrder) {
  run_ranks_ok(2, [](int, int) {
    torch::set_num_threads(1);
    init_process_group(ProcessGroupOptions().timeout(std::chrono::seconds(30)));
    for (const bool orig_params : {false, true}) {
      train_and_compare(ShardingStrategy::kNoShard, orig_params, /*two_backwards=*/true);
    }
  });
}

// FULL_SHARD gathers a unit's parameters again when backward reaches its
// outputs, and only there: a rank whose loss does not use a unit's output
// issues one all-gather fewer. Not supported (nor by PyTorch's FSDP); it
// must fail at once on every rank, never hang or train on swapped data.
TEST(UnevenGradients, FullShardFailsAtOnceOnEveryRank) {
  const auto start = std::chrono::steady_clock::now();
  const auto outcomes = run_ranks(2, [](int, int) {
    torch::set_num_threads(1);
    init_process_group(ProcessGroupOptions().timeout(std::chrono::seconds(60)));
    for (const bool orig_params : {false, true}) {
      try {
        train_and_compare(ShardingStrategy::kFullShard, orig_params);
      } catch (const std::exception& e) {
        std::cerr << error_message(e) << std::endl;
        std::exit(3);
      }
    }
  });
  const auto took = std::chrono::steady_clock::now() - start;
  EXPECT_LT(took, std::chrono::seconds(30)) << "not at once: the collective timeout is 60 s";
  for (const auto& outcome : outcomes) {
    EXPECT_FALSE(outcome.killed_at_deadline) << describe(outcome);
    EXPECT_NE(outcome.exit_code, 0) << describe(outcome);
    // The check at the end of backward, or the collectives' own, whichever fails first.
    const bool named = outcome.output.find("on some ranks but not on others") != std::string::npos;
    const bool mismatch = outcome.output.find("issued different collectives") != std::string::npos;
    EXPECT_TRUE(named || mismatch) << describe(outcome);
  }
}

// Units whose outputs every rank's backward reaches but part of whose
// parameters only some ranks' data uses (an expert no token went to): each
// rank's unit is complete when the gradients its backward computes have
// arrived (Note [Gradients a backward computes]). Counting every parameter
// instead held the unit back to the end of backward on the ranks that left
// the expert unused, so under FULL_SHARD their reductions paired with the
// others' backward all-gathers: the blocks have one size, so nothing failed
// and the parameters trained on exchanged data.
struct ExpertBlockImpl : nn::Module {
  ExpertBlockImpl() {
    lin = register_module("lin", nn::Linear(8, 8));
    expert = register_module("expert", nn::Linear(8, 8));
  }
  torch::Tensor forward(torch::Tensor x, bool use) {
    x = torch::relu(lin(x));
    return use ? x + expert(x) : x;
  }
  nn::Linear lin{nullptr}, expert{nullptr};
};
TORCH_MODULE(ExpertBlock);

struct ExpertsImpl : nn::Module {
  ExpertsImpl() {
    for (int i = 0; i < 3; ++i)
      blocks.push_back(register_module("b" + std::to_string(i), wrap(ExpertBlock())));
    head = register_module("head", nn::Linear(8, 2));
  }
  torch::Tensor forward(torch::Tensor x, int rank, int step) {
    for (size_t i = 0; i < blocks.size(); ++i)
      x = blocks[i](x, uses(rank, step + static_cast<int>(i)));
    return head(x);
  }
  std::vector<FullyShardedDataParallel<ExpertBlockImpl>> blocks;
  nn::Linear head{nullptr};
};
TORCH_MODULE(Experts);

// How the user clears gradients before each step, on the model and the
// plain reference alike: the optimizer's zero_grad(), Module::zero_grad
// keeping zeros, or their own loop over the parameters zeroing or dropping
// each .grad that is defined.
enum class Clear { kOptimizer, kModuleZeroGradKeepingZeros, kOwnZeroingLoop, kOwnDroppingLoop };

void clear_grads(Clear clear, nn::Module& model, torch::optim::Optimizer& opt) {
  if (clear == Clear::kOptimizer) return opt.zero_grad();
  if (clear == Clear::kModuleZeroGradKeepingZeros) return model.zero_grad(/*set_to_none=*/false);
  for (auto& p : model.parameters()) {
    if (!p.grad().defined()) continue;
    if (clear == Clear::kOwnZeroingLoop) {
      p.mutable_grad().zero_();
    } else {
      p.mutable_grad().reset();
    }
  }
}

// Trains Net (forward(x, rank, step): each rank routes its own data) under
// `options`, its blocks wrapped with `block_options`, against plain LibTorch
// on every rank's batch, compared every step. `in_place`: fully_shard with
// `options` instead, each of its blocks a unit (the model's wrap() calls,
// outside a scope, are pass-throughs).
template <typename Net>
void train_routed_against_plain(const FSDPOptions& options, const FSDPOptions& block_options,
                                const std::string& what, bool in_place = false,
                                Clear clear = Clear::kOptimizer) {
  const auto [rank, world] = rank_and_world();
  torch::manual_seed(0);
  Net reference;
  torch::manual_seed(0);
  Net inner = [&] {
    if (in_place) return Net();
    EnableWrap scope(block_options);
    return Net();
  }();
  std::vector<torch::Tensor> params;
  FullyShardedDataParallel<typename Net::Impl> model{nullptr};
  if (in_place) {
    const LambdaPolicy blocks([](const nn::Module&, const std::string& path, int64_t) {
      return path.size() == 2 && (path[0] == 'b' || path[0] == 'l');
    });
    params = fully_shard(inner, blocks, options).flat_parameters();
  } else {
    model = FullyShardedDataParallel<typename Net::Impl>(inner, options);
    params = model->parameters();
  }
  nn::Module& trained = in_place ? static_cast<nn::Module&>(*inner) : *model;
  // In place with use_orig_params: AdamW with weight decay, under which a
  // zero gradient and none step differently (flat shards give a parameter
  // no rank used a zero gradient: Note [Parameters without gradients]).
  const bool adamw = in_place && options.use_orig_params();
  auto make = [adamw](std::vector<torch::Tensor> p) -> std::unique_ptr<torch::optim::Optimizer> {
    if (!adamw) return std::make_unique<torch::optim::SGD>(p, torch::optim::SGDOptions(0.1));
    return std::make_unique<torch::optim::AdamW>(
        p, torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
  };
  auto ref_opt_ptr = make(reference->parameters());
  auto opt_ptr = make(params);
  torch::optim::Optimizer& ref_opt = *ref_opt_ptr;
  torch::optim::Optimizer& opt = *opt_ptr;
  for (int step = 0; step < 4; ++step) {
    torch::manual_seed(100 + step);
    const torch::Tensor x = torch::randn({4 * world, 8});
    const torch::Tensor y = torch::randn({4 * world, 2});
    clear_grads(clear, *reference, ref_opt);
    torch::Tensor ref_loss = torch::zeros({});
    for (int r = 0; r < world; ++r) {
      ref_loss = ref_loss + torch::mse_loss(reference->forward(x.chunk(world, 0)[r], r, step),
                                            y.chunk(world, 0)[r]);
    }
    (ref_loss / world).backward();
    ref_opt.step();
    clear_grads(clear, trained, opt);
    const torch::Tensor out = in_place ? inner->forward(local_block(x), rank, step)
                                       : model->forward(local_block(x), rank, step);
    torch::mse_loss(out, local_block(y)).backward();
    opt.step();
    if (in_place) {
      SummonFullParams full(*inner);
      expect_same_params(*inner, *reference, what + " step " + std::to_string(step));
    } else {
      expect_same_after_step(*model.ptr(), *reference.ptr(), what, step);
    }
  }
}

TEST(UnevenGradients, UnitsPartlyUsedOnSomeRanksTrainLikePlainLibTorch) {
  at_two_and_three_ranks(
      {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp},
      [](ShardingStrategy strategy, bool orig_params) {
        // Checkpointed blocks too: the unused expert's AccumulateGrad then
        // runs without a gradient (the recomputation's grad() gives none).
        const bool checkpointed = orig_params == (strategy == ShardingStrategy::kFullShard);
        const std::string what = std::string(to_string(strategy)) +
                                 (orig_params ? " use_orig_params" : " flat shards") +
                                 (checkpointed ? " checkpointed" : "");
        const auto options = FSDPOptions().sharding_strategy(strategy).use_orig_params(orig_params);
        train_routed_against_plain<Experts>(
            options, FSDPOptions(options).activation_checkpointing(checkpointed), what);
      });
}

// A unit whose forward every rank runs but none of whose parameters some
// ranks' data uses: an MoE layer whose experts got no token there (each row
// goes to the expert `routes` names, -1 to none). Its unit is complete where
// backward reaches it (Note [Gradients a backward computes]). Left to the
// end of backward, it held back every later reduction on those ranks only:
// under FULL_SHARD their reductions then paired with the others' gathers.
// `skip_empty` false: an expert no row goes to runs on its empty batch.
struct ExpertLayerImpl : nn::Module {
  explicit ExpertLayerImpl(bool skip_empty = true) : skip_empty(skip_empty) {
    for (int e = 0; e < 2; ++e)
      experts.push_back(register_module("e" + std::to_string(e), nn::Linear(8, 8)));
  }
  torch::Tensor forward(torch::Tensor x, torch::Tensor routes) {
    torch::Tensor out = torch::zeros_like(x);
    for (size_t e = 0; e < experts.size(); ++e) {
      const torch::Tensor rows = routes.eq(static_cast<int64_t>(e)).nonzero().squeeze(1);
      if (rows.numel() == 0 && skip_empty) continue;
      out.index_add_(0, rows, experts[e](x.index_select(0, rows)));
    }
    return x + out;
  }
  std::vector<nn::Linear> experts;
  bool skip_empty;
};
TORCH_MODULE(ExpertLayer);

struct MoeNetImpl : nn::Module {
  explicit MoeNetImpl(bool skip_empty = true) {
    stem = register_module("stem", nn::Linear(8, 8));
    for (int i = 0; i < 3; ++i)
      layers.push_back(register_module("l" + std::to_string(i), wrap(ExpertLayer(skip_empty))));
    head = register_module("head", nn::Linear(8, 2));
  }
  torch::Tensor forward(torch::Tensor x, int rank, int step) {
    x = stem(x);
    for (size_t i = 0; i < layers.size(); ++i) {
      // Rows alternate between the experts, or none goes to any.
      const torch::Tensor routes = uses(rank, step + static_cast<int>(i))
                                       ? torch::arange(x.size(0)).remainder(2)
                                       : torch::full({x.size(0)}, -1, torch::kLong);
      x = torch::relu(layers[i](x, routes));
    }
    return head(x);
  }
  nn::Linear stem{nullptr}, head{nullptr};
  std::vector<FullyShardedDataParallel<ExpertLayerImpl>> layers;
};
TORCH_MODULE(MoeNet);

// The same net whose experts run on their empty batches: under fully_shard
// every rank then enters every unit (docs/using.md).
struct DenseRoutedMoeNetImpl : MoeNetImpl {
  DenseRoutedMoeNetImpl() : MoeNetImpl(/*skip_empty=*/false) {}
};
TORCH_MODULE(DenseRoutedMoeNet);

TEST(UnevenGradients, UnitsUnusedOnSomeRanksTrainLikePlainLibTorch) {
  at_two_and_three_ranks(
      {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp},
      [](ShardingStrategy strategy, bool orig_params) {
        const std::string what =
            std::string(to_string(strategy)) + (orig_params ? " use_orig_params" : " flat shards");
        const auto options = FSDPOptions().sharding_strategy(strategy).use_orig_params(orig_params);
        train_routed_against_plain<MoeNet>(options, options, what);
      });
}

// fully_shard, the user clearing gradients with zero_grad(false) or their
// own loops: a parameter that got its gradient only from other ranks' data
// shows it too (a loop that tests .grad.defined() reaches it, as with plain
// LibTorch on the whole batch), one no rank used in a step keeps showing
// what it has, and what is zeroed or dropped is gone from what the
// optimizer steps (Note [Gradients the user clears]). With use_orig_params
// under AdamW with weight decay: a zero gradient where plain LibTorch has
// none would show.
TEST(UnevenGradients, OwnLoopsClearingGradientsOfUnitsUsedOnSomeRanks) {
  at_two_and_three_ranks({ShardingStrategy::kFullShard}, [](ShardingStrategy strategy,
                                                            bool orig_params) {
    const auto options = FSDPOptions().sharding_strategy(strategy).use_orig_params(orig_params);
    for (const Clear clear :
         {Clear::kModuleZeroGradKeepingZeros, Clear::kOwnZeroingLoop, Clear::kOwnDroppingLoop}) {
      const char* how[] = {"", " zero_grad(false)", " zeroing", " dropping"};
      const std::string what = std::string("fully_shard") +
                               (orig_params ? " use_orig_params" : " flat shards") +
                               how[static_cast<int>(clear)];
      train_routed_against_plain<Experts>(options, options, what, true, clear);
      train_routed_against_plain<DenseRoutedMoeNet>(options, options, what + " moe", true, clear);
    }
  });
}

}  // namespace test_uneven_grads
}  // namespace fsdp::testing
