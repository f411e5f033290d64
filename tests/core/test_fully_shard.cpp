// fsdp::fully_shard: units made in place of an unmodified LibTorch model (a
// GPT whose blocks live in a ModuleList, cast back with as<BlockImpl>()),
// against plain LibTorch on the ranks' concatenated batches, every step.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <iostream>
#include <limits>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <unistd.h>

#include <fsdp/fsdp.h>

#include "comm/counting_process_group.h"
#include "core/flat_parameter.h"
#include "detail/posix_files.h"
#include "detail/torch_compat.h"
#include "error_of.h"
#include "multi_rank.h"
#include "test_models.h"

namespace fsdp::testing {
namespace test_fully_shard {

// A user's model, written without FSDP in mind.
struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(int64_t d) {
    ln = register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})));
    fc1 = register_module("fc1", torch::nn::Linear(d, 2 * d));
    fc2 = register_module("fc2", torch::nn::Linear(2 * d, d));
  }
  torch::Tensor forward(torch::Tensor x) { return x + fc2(torch::gelu(fc1(ln(x)))); }
  torch::nn::LayerNorm ln{nullptr};
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(Block);

constexpr int64_t kVocab = 13, kDim = 16, kSeq = 6;

using CheckpointedBlockImpl = CheckpointWrapperImpl<BlockImpl>;

struct ListGptImpl : torch::nn::Module {
  // `checkpointed`: each block in a CheckpointWrapper (the same weights).
  explicit ListGptImpl(int n_layer, bool checkpointed = false) {
    wte = register_module("wte", torch::nn::Embedding(kVocab, kDim));
    blocks = register_module("blocks", torch::nn::ModuleList());
    for (int i = 0; i < n_layer; ++i) {
      if (checkpointed) {
        blocks->push_back(CheckpointWrapper<BlockImpl>(Block(kDim)));
      } else {
        blocks->push_back(Block(kDim));
      }
    }
    ln_f = register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kDim})));
    head = register_module("head", torch::nn::Linear(kDim, kVocab));
  }
  torch::Tensor forward(torch::Tensor idx) {
    torch::Tensor x = wte(idx);
    for (const auto& i : order()) {
      auto* checkpointed = blocks[i]->as<CheckpointedBlockImpl>();
      x = checkpointed != nullptr ? checkpointed->forward(x)
                                  : blocks[i]->as<BlockImpl>()->forward(x);
      if (after_block) after_block(i, x);
    }
    return head(ln_f(x));
  }
  // The blocks the next forward runs, in order (all of them by default).
  std::vector<size_t> order() const {
    if (!block_order.empty()) return block_order;
    std::vector<size_t> all(blocks->size());
    for (size_t i = 0; i < all.size(); ++i) all[i] = i;
    return all;
  }
  torch::nn::Embedding wte{nullptr};
  torch::nn::ModuleList blocks{nullptr};
  torch::nn::LayerNorm ln_f{nullptr};
  torch::nn::Linear head{nullptr};
  std::vector<size_t> block_order;  // test knob: skip or repeat blocks
  std::function<void(size_t, const torch::Tensor&)> after_block;  // test probe
};
TORCH_MODULE(ListGpt);

torch::Tensor lm_loss(const torch::Tensor& logits, const torch::Tensor& targets) {
  return torch::nn::functional::cross_entropy(logits.reshape({-1, kVocab}), targets.reshape({-1}));
}

std::vector<std::string> names(torch::nn::Module& m) {
  std::vector<std::string> out;
  for (const auto& p : m.named_parameters()) out.push_back(p.key());
  return out;
}

// What a user runs between backward and the optimizer's step.
enum class BeforeStep {
  kNothing,
  kEvaluation,      // eval(), NoGradGuard: a forward
  kValidationLoss,  // a loss in grad mode that no backward follows
  kReadWeight,      // a block's weight norm, printed (it gathers the block)
};

struct Case {
  ShardingStrategy strategy = ShardingStrategy::kFullShard;
  std::shared_ptr<ProcessGroup> group;  // nullptr: the default group
  bool use_orig_params = false;
  bool forward_prefetch = false;
  // AdamW with weight decay, else SGD with momentum (whose first steps do not
  // magnify rounding: AdamW's first step is lr * g / |g| even for g ~ 1e-9).
  bool adamw = true;
  int steps = 4;
  bool expect_parity = true;  // false for the controls, which must differ
  // After each step: an evaluation forward (eval(), NoGradGuard) and a
  // validation loss in grad mode that no backward follows, compared with the
  // reference's; training then goes on.
  bool evaluate_between = false;
  // What runs between backward and the optimizer's step, on every rank.
  BeforeStep before_step = BeforeStep::kNothing;
  // Full parameters compared after every step (SummonFullParams), else after
  // the last only: a summon ends an open forward, which could hide one
  // that a step left stale. The losses are compared at every step either way.
  bool compare_params_each_step = true;
  // The model's blocks in CheckpointWrappers (the reference's not).
  bool checkpoint_blocks = false;
  // Per step: which blocks the forward runs (empty: all).
  std::function<std::vector<size_t>(int step)> order;
  // How the user clears gradients before each step, on the model and the
  // reference alike (default: Module::zero_grad()).
  std::function<void(torch::nn::Module&, int step)> clear_grads;
  // Called on the model after each block of its forward.
  std::function<void(ListGptImpl&, size_t block)> mid_forward;
  // Between backward and the step: a loss's gradient with respect to block
  // 0's output only (torch::autograd::grad; no parameter's .grad changes).
  bool input_grad_before_step = false;
  // Before step `load_at`'s forward (-1: never): torch::load of a plain
  // model's file (other weights) into the model on every rank, and into the
  // reference; with `load_gathered`, after a forward in grad mode that no
  // backward follows, which leaves the root gathered.
  int load_at = -1;
  bool load_gathered = false;
  // LibTorch's own clipping of module->parameters() between backward and
  // the step, on the model and the reference alike (Note [LibTorch's
  // clipping of a unit made in place]); clip_grad_norm_'s returned norms
  // are compared.
  enum class Clip { kNone, kNorm, kValue } libtorch_clip = Clip::kNone;
  std::string what;
};

// What Case::libtorch_clip runs on `m`: the norm clip_grad_norm_ returned.
double clip_as_libtorch(torch::nn::Module& m, Case::Clip clip) {
  switch (clip) {
    case Case::Clip::kNone:
      return 0;
    case Case::Clip::kNorm:
      return torch::nn::utils::clip_grad_norm_(m.parameters(), 0.5);
    case Case::Clip::kValue:
      torch::nn::utils::clip_grad_value_(m.parameters(), 0.005);
      return 0;
  }
  return 0;
}

// What a user loading pretrained weights runs, on every rank: torch::load of
// a plain model's file (Note [torch::load into a unit made in place]).
void load_pretrained(ListGpt& model, ListGpt& reference, bool gathered) {
  torch::manual_seed(77);
  ListGpt pretrained(3);
  const std::string path =
      ::testing::TempDir() + "/fully_shard_pretrained_" + std::to_string(getpid()) + ".pt";
  torch::save(pretrained, path);
  if (gathered) {
    (void)model->forward(torch::zeros({1, kSeq}, torch::kLong));
    EXPECT_NE(unit_of(*model)->flat_param()->state(), FlatParameter::State::kSharded);
  }
  torch::load(model, path);
  torch::load(reference, path);
  std::remove(path.c_str());
}

// Trains a fully_shard'ed ListGpt and its plain twin side by side with
// AdamW (weight decay) and compares the full parameters after every step.
// Returns the largest difference seen.
double train_against_reference(const Case& c) {
  const int world = rank_and_world().second;
  torch::manual_seed(0);
  ListGpt reference(3);
  torch::manual_seed(0);
  ListGpt model(3, c.checkpoint_blocks);
  const auto before = names(*model);
  Unit& root = fully_shard(model, module_type_policy<BlockImpl>(),
                           FSDPOptions()
                               .sharding_strategy(c.strategy)
                               .process_group(c.group)
                               .use_orig_params(c.use_orig_params)
                               .forward_prefetch(c.forward_prefetch));
  // In place: names, member types and casts as before.
  EXPECT_EQ(names(*model), before) << c.what;
  if (!c.checkpoint_blocks) EXPECT_NE(model->blocks[1]->as<BlockImpl>(), nullptr) << c.what;
  EXPECT_NE(unit_of(*model->blocks[1]), nullptr) << c.what;
  EXPECT_EQ(unit_of(*model), &root) << c.what;
  auto make = [&c](std::vector<torch::Tensor> params) -> std::unique_ptr<torch::optim::Optimizer> {
    if (c.adamw) {
      return std::make_unique<torch::optim::AdamW>(
          params, torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
    }
    return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(0.1).momentum(0.9));
  };
  auto ref_opt = make(reference->parameters());
  auto opt = make(root.flat_parameters());
  if (c.mid_forward) {
    model->after_block = [&](size_t i, const torch::Tensor&) { c.mid_forward(*model, i); };
  }
  double worst = 0;
  for (int step = 0; step < c.steps; ++step) {
    const auto order = c.order ? c.order(step) : std::vector<size_t>{};
    reference->block_order = order;
    model->block_order = order;
    torch::manual_seed(100 + step);
    const torch::Tensor tokens = torch::randint(0, kVocab, {2 * world, kSeq});
    const torch::Tensor targets = torch::randint(0, kVocab, {2 * world, kSeq});
    auto clear = [&c, step](torch::nn::Module& m) {
      if (c.clear_grads) {
        c.clear_grads(m, step);
      } else {
        m.zero_grad();  // the user's habit: clears the shards' gradients too
      }
    };
    if (step == c.load_at) load_pretrained(model, reference, c.load_gathered);
    double want_loss = 0;
    {
      torch::NoGradGuard no_grad;  // this rank's loss, as the model computes it
      want_loss =
          lm_loss(reference->forward(local_block(tokens)), local_block(targets)).item<double>();
    }
    clear(*reference);
    lm_loss(reference->forward(tokens), targets).backward();
    if (c.libtorch_clip == Case::Clip::kValue && step == 0) {
      double largest = 0;
      for (const auto& p : reference->parameters()) {
        largest = std::max(largest, p.grad().abs().max().item<double>());
      }
      EXPECT_GT(largest, 0.005) << c.what << ": the clip does not bite";
    }
    const double want_norm = clip_as_libtorch(*reference, c.libtorch_clip);
    if (c.libtorch_clip == Case::Clip::kNorm && step == 0) {
      EXPECT_GT(want_norm, 0.5) << c.what << ": the clip does not bite";
    }
    ref_opt->step();
    clear(*model);
    const torch::Tensor loss = lm_loss(model->forward(local_block(tokens)), local_block(targets));
    if (c.expect_parity) {
      EXPECT_NEAR(loss.item<double>(), want_loss, 1e-5) << c.what << " loss, step " << step;
    }
    loss.backward();
    if (c.input_grad_before_step) {
      torch::Tensor act;
      model->after_block = [&act](size_t i, const torch::Tensor& x) {
        if (i == 0) act = x;
      };
      const torch::Tensor again =
          lm_loss(model->forward(local_block(tokens)), local_block(targets));
      EXPECT_TRUE(torch::autograd::grad({again}, {act})[0].defined()) << c.what;
      model->after_block = nullptr;
    }
    switch (c.before_step) {
      case BeforeStep::kNothing:
        break;
      case BeforeStep::kEvaluation: {
        torch::NoGradGuard no_grad;
        model->eval();
        (void)model->forward(local_block(targets));
        model->train();
        break;
      }
      case BeforeStep::kValidationLoss:
        (void)lm_loss(model->forward(local_block(targets)), local_block(tokens)).item<double>();
        break;
      case BeforeStep::kReadWeight:
        (void)model->blocks[1]->as<BlockImpl>()->fc1->weight.norm().item<double>();
        break;
    }
    const double norm = clip_as_libtorch(*model, c.libtorch_clip);
    if (c.expect_parity) {
      EXPECT_NEAR(norm, want_norm, 1e-5 * std::max(1.0, want_norm)) << c.what << " step " << step;
    }
    opt->step();
    if (c.evaluate_between) {
      torch::manual_seed(500 + step);
      const torch::Tensor held_out = torch::randint(0, kVocab, {2 * world, kSeq});
      reference->eval();
      model->eval();
      {
        torch::NoGradGuard no_grad;
        const torch::Tensor want = reference->forward(held_out);
        const torch::Tensor got = model->forward(local_block(held_out));
        EXPECT_TRUE(torch::allclose(got, local_block(want), 1e-5, 1e-5)) << c.what << " eval";
      }
      reference->train();
      model->train();
      const double want =
          lm_loss(reference->forward(local_block(held_out)), local_block(held_out)).item<double>();
      const double got =
          lm_loss(model->forward(local_block(held_out)), local_block(held_out)).item<double>();
      EXPECT_NEAR(got, want, 1e-5) << c.what << " validation loss without backward";
    }
    if (!c.compare_params_each_step && step + 1 < c.steps) continue;
    SummonFullParams full(*model);
    const auto ref = reference->named_parameters();
    for (const auto& p : model->named_parameters()) {
      const double diff = (p.value() - ref[p.key()]).abs().max().item<double>();
      worst = std::max(worst, diff);
    }
    if (c.expect_parity) {
      expect_same_params(*model, *reference, c.what + " step " + std::to_string(step));
    }
  }
  return worst;
}

void init(int world) {
  torch::set_num_threads(1);
  init_process_group(ProcessGroupOptions().timeout(std::chrono::seconds(30)));
  (void)world;
}

// train_against_reference for every case `cases` makes, at each world size
// (real processes; the cases are made in each rank process).
void expect_parity(const std::vector<int>& worlds,
                   const std::function<std::vector<Case>()>& cases) {
  for (int world : worlds) {
    run_ranks_ok(world, [&cases](int, int w) {
      init(w);
      for (const Case& c : cases()) train_against_reference(c);
    });
  }
}

// One Case per strategy, named after it and adjusted by `tweak`.
std::vector<Case> cases_for(const std::vector<ShardingStrategy>& strategies,
                            const std::function<void(Case&)>& tweak) {
  std::vector<Case> cases;
  for (ShardingStrategy strategy : strategies) {
    Case c;
    c.strategy = strategy;
    tweak(c);
    c.what = std::string(to_string(strategy)) + c.what;
    cases.push_back(c);
  }
  return cases;
}

TEST(FullyShard, ModuleListGptTrainsLikePlainLibTorch) {
  expect_parity(parity_world_sizes(), [] {
    std::vector<Case> cases;
    for (bool orig : {false, true}) {
      const auto more = cases_for({ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp,
                                   ShardingStrategy::kNoShard},
                                  [orig](Case& c) {
                                    c.use_orig_params = orig;
                                    c.forward_prefetch = c.strategy == ShardingStrategy::kFullShard;
                                    c.what = orig ? " use_orig_params" : "";
                                  });
      cases.insert(cases.end(), more.begin(), more.end());
    }
    return cases;
  });
}

// FSDP2's habit, LibTorch's own clipping of model->parameters(), on a model
// made by fully_shard (Note [LibTorch's clipping of a unit made in place]):
// clip_grad_norm_ returns the global norm and clips every rank by it,
// clip_grad_value_ clamps every part, and training matches plain LibTorch
// clipped the same way, at 1-3 ranks, flat shards and use_orig_params,
// under every strategy. Clipping each rank by its own part's norm (what
// LibTorch's function did on the shards) differs: the control below.
TEST(FullyShard, LibTorchsOwnClippingOfTheModelsParametersAsPlainLibTorch) {
  expect_parity(parity_world_sizes(), [] {
    std::vector<Case> cases;
    for (bool orig : {false, true}) {
      for (const auto clip : {Case::Clip::kNorm, Case::Clip::kValue}) {
        const auto more = cases_for(
            {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp,
             ShardingStrategy::kNoShard},
            [orig, clip](Case& c) {
              c.use_orig_params = orig;
              c.libtorch_clip = clip;
              c.what = std::string(orig ? " use_orig_params" : "") +
                       (clip == Case::Clip::kNorm ? " clip_grad_norm_" : " clip_grad_value_");
            });
        cases.insert(cases.end(), more.begin(), more.end());
      }
    }
    return cases;
  });
}

// The norm of one moved gradient is the whole gradient's on every rank (a
// collective), and differs from this rank's part's: a clip by the part's
// norm would clip each rank differently. The infinity norm of LibTorch's
// clip (grad.abs().max()) is refused, naming the root's.
TEST(FullyShard, AMovedGradientsNormIsTheWholeGradients) {
  run_ranks_ok(2, [](int, int world) {
    init(world);
    torch::manual_seed(0);
    ListGpt reference(3);
    torch::manual_seed(0);
    ListGpt model(3);
    Unit& root = fully_shard(model, module_type_policy<BlockImpl>());
    torch::manual_seed(5);
    const torch::Tensor tokens = torch::randint(0, kVocab, {2 * world, kSeq});
    lm_loss(reference->forward(tokens), tokens).backward();
    lm_loss(model->forward(local_block(tokens)), local_block(tokens)).backward();
    const torch::Tensor want = reference->blocks[1]->as<BlockImpl>()->fc1->weight.grad();
    const torch::Tensor& grad = model->blocks[1]->as<BlockImpl>()->fc1->weight.grad();
    EXPECT_NEAR(grad.norm().item<double>(), want.norm().item<double>(), 1e-5);
    EXPECT_NEAR(
        torch::linalg_vector_norm(grad, 1, c10::nullopt, false, c10::nullopt).item<double>(),
        want.abs().sum().item<double>(), 1e-4);
    // The premise: the unit's part on this rank is not its whole gradient.
    const double part =
        unit_of(*model->blocks[1])->flat_param()->shard().grad().norm().item<double>();
    double whole = 0;
    for (const auto& p : reference->blocks[1]->parameters()) {
      whole += p.grad().pow(2).sum().item<double>();
    }
    EXPECT_LT(part, std::sqrt(whole) * 0.999) << "a part's norm is the whole's";
    const std::string inf = error_of([&] {
      torch::nn::utils::clip_grad_norm_(model->parameters(), 1.0,
                                        std::numeric_limits<double>::infinity());
    });
    EXPECT_CONTAINS(inf, "clip with the root's clip_grad_norm_()");
    EXPECT_CONTAINS(error_of([&] { (void)grad.norm(-1.0); }), "expected a non-negative order");
    EXPECT_GT(root.clip_grad_norm_(1e9), 0);
    // Stepped beside backward, the gradients are stepped already: clipping
    // them is refused, as the root's clip is.
    optim::FusedAdamW opt(root.flat_parameters(), torch::optim::AdamWOptions(1e-3));
    opt.step_during_backward(*model);
    model->zero_grad();
    lm_loss(model->forward(local_block(tokens)), local_block(tokens)).backward();
    EXPECT_CONTAINS(error_of([&] { torch::nn::utils::clip_grad_norm_(model->parameters(), 1.0); }),
                    "clipping after backward comes too late");
    opt.step();
  });
}

// torch::load(model, path) after fully_shard, the pretrained-weights habit
// (Note [torch::load into a unit made in place]): each rank keeps its part
// of what it read, without communication, before training and between steps
// (the optimizer's state kept, as in plain LibTorch), also where an
// evaluation left the root gathered; the model then trains like the plain
// one that loaded the same file, every step.
TEST(FullyShard, TorchLoadIntoTheShardedModelTrainsLikePlainLibTorch) {
  expect_parity(parity_world_sizes(), [] {
    std::vector<Case> cases;
    for (const int at : {0, 2}) {
      for (const bool gathered : {false, true}) {
        const auto more = cases_for({ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp,
                                     ShardingStrategy::kNoShard},
                                    [&](Case& c) {
                                      c.load_at = at;
                                      c.load_gathered = gathered;
                                      c.use_orig_params = at == 2;
                                      c.what = ", torch::load before step " + std::to_string(at) +
                                               (gathered ? " with the root gathered" : "");
                                    });
        cases.insert(cases.end(), more.begin(), more.end());
      }
    }
    return cases;
  });
}

TEST(FullyShard, EvaluationAndForwardsWithoutBackwardBetweenSteps) {
  expect_parity({1, 2}, [] {
    return cases_for({ShardingStrategy::kFullShard, ShardingStrategy::kNoShard}, [](Case& c) {
      c.forward_prefetch = true;
      c.evaluate_between = true;
      c.what = " with evaluation";
    });
  });
}

// FSDP2's order: activation checkpointing first (each block in a
// CheckpointWrapper), then fully_shard by block type. The policy sees the
// block inside each wrapper: a review found it saw only the wrappers, so
// no block became a unit and the whole model was gathered at once.
TEST(FullyShard, BlocksInCheckpointWrappersBecomeUnitsAndTrainLikePlainLibTorch) {
  expect_parity({1, 2}, [] {
    return cases_for({ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp}, [](Case& c) {
      c.checkpoint_blocks = true;
      c.what = " checkpointed blocks";
    });
  });
}

// Found by review: the evaluation left the root gathered, and the next
// forward computed it with the values from before the step. A second review
// found the same with the parameters compared only at the end (the
// SummonFullParams after each step had ended the open forward): the root,
// and under SHARD_GRAD_OP every block a validation loss had gathered, kept
// the values from before the step (Note [Gathered before a step]).
TEST(FullyShard, EvaluationBetweenBackwardAndStep) {
  expect_parity({1, 2}, [] {
    std::vector<Case> cases;
    for (BeforeStep before :
         {BeforeStep::kEvaluation, BeforeStep::kValidationLoss, BeforeStep::kReadWeight}) {
      for (bool each_step : {true, false}) {
        const auto more =
            cases_for({ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp},
                      [before, each_step](Case& c) {
                        c.before_step = before;
                        c.compare_params_each_step = each_step;
                        c.forward_prefetch = true;
                        c.what = " before the step: " + std::to_string(static_cast<int>(before)) +
                                 (each_step ? "" : ", compared at the end");
                      });
        cases.insert(cases.end(), more.begin(), more.end());
      }
      // SGD writes through .data(), which counts no version: the step is
      // seen where model->zero_grad() clears the gradients.
      const auto sgd = cases_for(
          {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp}, [before](Case& c) {
            c.before_step = before;
            c.compare_params_each_step = false;
            c.adamw = false;
            c.what = " SGD, before the step: " + std::to_string(static_cast<int>(before));
          });
      cases.insert(cases.end(), sgd.begin(), sgd.end());
    }
    return cases;
  });
}

// A unit with fewer elements than there are ranks (rank 2 holds only
// padding), left gathered by a validation loss between backward and SGD's
// step, then cleared with zero_grad(false): rank 2 zeroes nothing of it. A
// review found the gradients' versions deciding whether to gather anew
// there, so rank 2 alone did not: a hang (Note [Gathered before a step]).
TEST(FullyShard, ATinyUnitLeftGatheredIsGatheredAnewOnEveryRank) {
  run_ranks_ok(3, [](int, int world) {
    init(world);
    auto make = [] {
      torch::manual_seed(0);
      return torch::nn::Sequential(torch::nn::Linear(4, 1), torch::nn::Linear(1, 1),
                                   torch::nn::Linear(1, 3));
    };
    torch::nn::Sequential reference = make(), model = make();
    Unit& root = fully_shard(model, module_type_policy<torch::nn::LinearImpl>(),
                             FSDPOptions().sharding_strategy(ShardingStrategy::kShardGradOp));
    torch::optim::SGD ref_opt(reference->parameters(), torch::optim::SGDOptions(0.1));
    torch::optim::SGD opt(root.flat_parameters(), torch::optim::SGDOptions(0.1));
    for (int step = 0; step < 3; ++step) {
      torch::manual_seed(10 + step);
      const torch::Tensor x = torch::randn({2 * world, 4});
      reference->zero_grad(/*set_to_none=*/false);
      reference->forward(x).pow(2).mean().backward();
      ref_opt.step();
      model->zero_grad(/*set_to_none=*/false);
      model->forward(local_block(x)).pow(2).mean().backward();
      (void)model->forward(local_block(x).flip(0)).sum();  // a validation loss
      opt.step();
    }
    SummonFullParams full(*model.ptr());
    expect_same_params(*model, *reference, "tiny unit");
  });
}

TEST(FullyShard, UnitCalledTwiceAndUnitUnusedInSomeSteps) {
  expect_parity({1, 2}, [] {
    return cases_for({ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp}, [](Case& c) {
      c.use_orig_params = true;  // unused blocks keep an undefined .grad, as in LibTorch
      c.adamw = false;
      c.order = [](int step) -> std::vector<size_t> {
        if (step % 2 == 0) return {0, 1, 1, 2};  // block 1 twice
        return {0, 2};                           // block 1 unused
      };
      c.what = " twice/unused";
    });
  });
}

// zero_grad(false) keeps zeroed gradients where zero_grad() drops them: a
// block unused in a step then still takes AdamW's decay and momentum, as in
// plain LibTorch. And the user's own loops, zeroing or dropping each .grad
// (Note [Gradients the user clears]).
TEST(FullyShard, EveryWayOfClearingGradientsActsAsInPlainLibTorch) {
  expect_parity({1, 3}, [] {
    std::vector<Case> cases;
    for (bool orig : {false, true}) {
      for (int way = 0; way < 5; ++way) {
        Case c;
        c.use_orig_params = orig;
        c.steps = 5;
        c.input_grad_before_step = way >= 2;  // the own loops then still see every .grad
        c.order = [](int step) -> std::vector<size_t> {
          if (step % 2 == 0) return {0, 1, 2};
          return {0, 2};  // block 1 unused
        };
        c.clear_grads = [way](torch::nn::Module& m, int step) {
          if (way == 0) m.zero_grad(/*set_to_none=*/false);
          if (way == 1) m.zero_grad(/*set_to_none=*/step % 2 == 0);
          if (way == 4) {
            // Every other step only part of the model: a module that shares
            // the root's unit and a whole block's unit, with each meaning;
            // the other gradients add up over two steps.
            const bool none = step % 4 == 1;
            if (step % 2 == 0) {
              m.zero_grad();
            } else {
              m.named_modules()["head"]->zero_grad(none);
              m.named_modules()["blocks.0"]->zero_grad(none);
            }
          }
          for (auto& p : m.parameters()) {
            if (way == 2 && p.grad().defined()) p.mutable_grad().zero_();
            // Half the blocks' gradients dropped, half zeroed.
            if (way == 3 && p.grad().defined()) {
              if (step % 2 == 0 || p.numel() % 2 == 0) {
                p.mutable_grad().reset();
              } else {
                p.mutable_grad().zero_();
              }
            }
          }
        };
        const char* ways[] = {" zero_grad(false)", " alternating", " own zeroing loop",
                              " own loop dropping and zeroing", " zero_grad of parts"};
        c.what = std::string(orig ? "use_orig_params" : "flat") + ways[way];
        cases.push_back(c);
      }
    }
    return cases;
  });
}

// A SummonFullParams inside the model's own forward, between blocks (a
// weight norm logged there), of one block or of the whole model.
TEST(FullyShard, SummonFullParamsInsideTheForward) {
  expect_parity({2}, [] {
    std::vector<Case> cases;
    for (bool whole : {false, true}) {
      Case c;
      c.mid_forward = [whole](ListGptImpl& m, size_t block) {
        if (block != 1) return;
        torch::nn::Module& target = whole ? static_cast<torch::nn::Module&>(m) : *m.blocks[0];
        SummonFullParams full(target);
        double norm = 0;
        for (const auto& p : target.parameters()) norm += p.norm().item<double>();
        EXPECT_GT(norm, 0);
      };
      c.what = whole ? " whole model summoned mid-forward" : " block 0 summoned mid-forward";
      cases.push_back(c);
    }
    return cases;
  });
}

// Hands back this rank's block of the gradient unaveraged (a reduce-scatter
// that forgot to reduce): what the parity tests must catch.
class SkippingReduceScatter : public CountingProcessGroup {
 public:
  using CountingProcessGroup::CountingProcessGroup;
  Work reduce_scatter_tensor(const at::Tensor& shard, const at::Tensor& flat,
                             ReduceOp op) override {
    ++reduce_scatters;
    shard.copy_(flat.narrow(0, rank() * shard.numel(), shard.numel()));
    return barrier();
  }
};

TEST(FullyShard, WithoutTheReductionParityFails) {
  run_ranks_ok(2, [](int, int w) {
    init(w);
    auto skipping = std::make_shared<SkippingReduceScatter>(default_process_group());
    Case c;
    c.group = skipping;
    c.adamw = false;
    c.expect_parity = false;
    c.what = "reduce-scatter without reduction";
    const double diff = train_against_reference(c);
    EXPECT_GT(skipping->reduce_scatters.load(), 0);
    EXPECT_GT(diff, 1e-3) << "a reduce-scatter that does not reduce went unnoticed";
  });
}

// Units of `model` whose parameters are gathered now (root included).
int gathered_units(ListGptImpl& model) {
  int n = 0;
  for (const auto& m : model.modules(/*include_self=*/true)) {
    const Unit* unit = unit_of(*m);
    if (unit != nullptr && unit->flat_param() != nullptr &&
        unit->flat_param()->state() != FlatParameter::State::kSharded) {
      ++n;
    }
  }
  return n;
}

TEST(FullyShard, FullShardHoldsAtMostTwoUnitsGatheredThreeWithPrefetch) {
  run_ranks_ok(2, [](int, int w) {
    init(w);
    for (bool prefetch : {false, true}) {
      torch::manual_seed(0);
      ListGpt model(8);
      fully_shard(model, module_type_policy<BlockImpl>(),
                  FSDPOptions().forward_prefetch(prefetch).backward_prefetch(
                      prefetch ? BackwardPrefetch::kBackwardPre : BackwardPrefetch::kNone));
      int forward_max = 0, backward_max = 0, backward_probes = 0;
      model->after_block = [&](size_t, const torch::Tensor& x) {
        forward_max = std::max(forward_max, gathered_units(*model));
        x.register_hook([&](const torch::Tensor&) {
          backward_max = std::max(backward_max, gathered_units(*model));
          ++backward_probes;
        });
      };
      for (int step = 0; step < 3; ++step) {
        torch::manual_seed(step);
        const torch::Tensor tokens = torch::randint(0, kVocab, {2, kSeq});
        model->zero_grad();
        lm_loss(model->forward(tokens), tokens).backward();
        EXPECT_EQ(gathered_units(*model), 0) << "all resharded after backward";
      }
      const int bound = prefetch ? 3 : 2;
      EXPECT_EQ(backward_probes, 3 * 8);
      EXPECT_GE(forward_max, 2);  // the root and a block: the probe sees something
      EXPECT_LE(forward_max, bound) << "prefetch " << prefetch;
      EXPECT_LE(backward_max, bound) << "prefetch " << prefetch;
    }
  });
}

TEST(FullyShard, FrozenBlockNoSyncClippingAndStateDicts) {
  run_ranks_ok(2, [](int, int world) {
    init(world);
    torch::manual_seed(0);
    ListGpt reference(3);
    torch::manual_seed(0);
    ListGpt model(3);
    for (auto* m : {&reference, &model}) {
      for (auto& p : (*m)->blocks[0]->parameters()) p.set_requires_grad(false);
    }
    Unit& root = fully_shard(model, module_type_policy<BlockImpl>());
    torch::optim::SGD ref_opt(reference->parameters(), torch::optim::SGDOptions(0.1));
    torch::optim::SGD opt(root.flat_parameters(), torch::optim::SGDOptions(0.1));
    for (int step = 0; step < 3; ++step) {
      // Two micro-batches: the first under no_sync (accumulated locally),
      // the second reduces both.
      reference->zero_grad();
      model->zero_grad();
      for (int micro = 0; micro < 2; ++micro) {
        torch::manual_seed(10 * step + micro);
        const torch::Tensor tokens = torch::randint(0, kVocab, {2 * world, kSeq});
        lm_loss(reference->forward(tokens), tokens).backward();
        if (micro == 0) {
          auto guard = root.no_sync();
          lm_loss(model->forward(local_block(tokens)), local_block(tokens)).backward();
        } else {
          lm_loss(model->forward(local_block(tokens)), local_block(tokens)).backward();
        }
      }
      const double want = torch::nn::utils::clip_grad_norm_(reference->parameters(), 0.5);
      const double got = root.clip_grad_norm_(0.5);
      EXPECT_NEAR(got, want, 1e-5 * want) << "step " << step;
      ref_opt.step();
      opt.step();
      SummonFullParams full(*model);
      expect_same_params(*model, *reference, "frozen/no_sync/clip step " + std::to_string(step));
    }
    // The full state dict has the plain model's names and values; loading
    // it into a fresh sharded twin gives the same forward.
    const auto state = full_state_dict(*model);
    const auto plain = reference->named_parameters();
    for (const auto& p : plain) {
      const torch::Tensor* t = state.find(p.key());
      ASSERT_NE(t, nullptr) << p.key();
      EXPECT_TRUE(torch::allclose(*t, p.value(), 1.3e-6, 1e-5)) << p.key();
    }
    torch::manual_seed(7);
    ListGpt twin(3);
    fully_shard(twin, module_type_policy<BlockImpl>());
    load_full_state_dict(*twin, state);
    const torch::Tensor tokens = torch::randint(0, kVocab, {2, kSeq});
    torch::NoGradGuard no_grad;
    EXPECT_TRUE(torch::allclose(twin->forward(tokens), reference->forward(tokens), 1e-5, 1e-5));
  });
}

TEST(FullyShard, PolicySeesWhatAutoWrapWouldSee) {
  // The policy form walks as auto_wrap does: post-order, and the numel a
  // policy sees leaves out what units made before and ignored modules hold.
  run_ranks_ok(1, [](int, int w) {
    init(w);
    ListGpt model(3);
    std::vector<std::pair<std::string, int64_t>> asked;
    LambdaPolicy policy([&](const torch::nn::Module& m, const std::string& path, int64_t numel) {
      asked.emplace_back(path, numel);
      return dynamic_cast<const BlockImpl*>(&m) != nullptr;
    });
    fully_shard(model, policy, FSDPOptions().ignored_modules({model->blocks[0]}));
    EXPECT_EQ(unit_of(*model->blocks[0]), nullptr);  // ignored
    EXPECT_NE(unit_of(*model->blocks[2]), nullptr);
    const auto at = [&](const std::string& path) {
      for (const auto& [p, numel] : asked) {
        if (p == path) return numel;
      }
      return int64_t{-1};
    };
    int64_t block = 0;
    for (const auto& p : model->blocks[1]->parameters()) block += p.numel();
    EXPECT_EQ(at("blocks.1"), block);
    EXPECT_EQ(at("blocks.0"), -1) << "an ignored module is not asked about";
    EXPECT_EQ(at("blocks"), 0) << "blocks 1 and 2 are units, block 0 is ignored";
  });
}

// FSDP2's ignored_params: a parameter left out of the units that shard its
// module (Net's `scale`, the root's own) keeps its whole tensor on every
// rank and its local gradient, reaches the optimizer through
// flat_parameters(), and steps as plain LibTorch on this rank's rows alone,
// while every other parameter steps as plain LibTorch on every rank's rows.
// Wrappers and fully_shard alike; an undefined entry is refused, and so is
// one on the meta device (no unit would initialise it).
TEST(FullyShard, IgnoredParamsStayWholeAndLocal) {
  run_ranks_ok(2, [](int, int world) {
    init(world);
    for (bool in_place : {false, true}) {
      const std::string what = in_place ? "fully_shard" : "wrapper";
      torch::manual_seed(0);
      Net global(false, FSDPOptions()), local(false, FSDPOptions());
      {
        std::stringstream copy;  // local starts as global does
        torch::save(global, copy);
        torch::load(local, copy);
      }
      torch::manual_seed(0);
      std::shared_ptr<torch::nn::Module> model;
      Unit* root = nullptr;
      torch::Tensor scale;
      std::function<torch::Tensor(const torch::Tensor&)> forward;
      if (in_place) {
        auto net = std::make_shared<NetImpl>(false, FSDPOptions());
        fully_shard(*net->plain_block);
        root = &fully_shard(*net, FSDPOptions().ignored_params({net->scale}));
        scale = net->scale;
        forward = [net](const torch::Tensor& x) { return net->forward(x); };
        model = net;
      } else {
        auto impl = std::make_shared<NetImpl>(true, FSDPOptions());
        FullyShardedDataParallel<NetImpl> net(impl, FSDPOptions().ignored_params({impl->scale}));
        root = net.ptr().get();
        scale = impl->scale;
        forward = [net](const torch::Tensor& x) mutable { return net->forward(x); };
        model = net.ptr();
      }
      EXPECT_EQ(root->flat_parameters().back().unsafeGetTensorImpl(), scale.unsafeGetTensorImpl())
          << what;
      torch::manual_seed(5);
      const torch::Tensor x = torch::randn({8 * world, 7}), y = torch::randn({8 * world, 3});
      const auto sgd = torch::optim::SGDOptions(0.1);
      torch::optim::SGD opt(root->flat_parameters(), sgd), global_opt(global->parameters(), sgd),
          local_opt(local->parameters(), sgd);
      torch::mse_loss(forward(local_block(x)), local_block(y)).backward();
      torch::mse_loss(global->forward(x), y).backward();
      torch::mse_loss(local->forward(local_block(x)), local_block(y)).backward();
      EXPECT_TRUE(torch::allclose(scale.grad(), local->scale.grad())) << what;
      EXPECT_FALSE(torch::allclose(scale.grad(), global->scale.grad())) << what << ": not local";
      opt.step();
      global_opt.step();
      local_opt.step();
      EXPECT_EQ(scale.numel(), 1) << what;
      EXPECT_TRUE(torch::allclose(scale, local->scale)) << what;
      SummonFullParams full(*model);
      for (const auto& p : global->named_parameters()) {
        if (p.key() == "scale") continue;
        const torch::Tensor* mine = model->named_parameters().find(p.key());
        ASSERT_NE(mine, nullptr) << what << " " << p.key();
        EXPECT_TRUE(torch::allclose(*mine, p.value(), 1.3e-6, 1e-5)) << what << " " << p.key();
      }
    }
    EXPECT_CONTAINS(error_of([] {
                      auto net = std::make_shared<NetImpl>(false, FSDPOptions());
                      fully_shard(*net, FSDPOptions().ignored_params({torch::Tensor()}));
                    }),
                    "ignored_params' entry 0 is an undefined tensor");
    EXPECT_CONTAINS(error_of([] {
                      auto net = std::make_shared<NetImpl>(false, FSDPOptions());
                      fully_shard(*net, FSDPOptions().ignored_params(
                                            {torch::empty({1}, torch::Device(torch::kMeta))}));
                    }),
                    "ignored_params' entry 0 is on the meta device");
  });
}

TEST(FullyShard, RefusesWhatItCannotShard) {
  run_ranks_ok(1, [](int, int w) {
    init(w);
    ListGpt model(2);
    fully_shard(*model->blocks[0]);
    EXPECT_THROW(fully_shard(*model->blocks[0]), c10::Error);  // twice
    BlockImpl on_stack(4);
    EXPECT_THROW(fully_shard(on_stack), c10::Error);  // no shared_ptr owner
    // A typed wrapper inside: one way per tree.
    auto holder = std::make_shared<torch::nn::Module>();
    holder->register_module("w", FullyShardedDataParallel<torch::nn::LinearImpl>(
                                     torch::nn::Linear(3, 3), FSDPOptions()));
    EXPECT_THROW(fully_shard(*holder), c10::Error);
  });
}

// A refused call leaves the model as it was: the wrapper is found before
// the walk made units of the modules before it (here 'first').
TEST(FullyShard, AWrapperInTheTreeIsRefusedBeforeAnyUnitIsMade) {
  run_ranks_ok(1, [](int, int w) {
    init(w);
    auto holder = std::make_shared<torch::nn::Module>();
    torch::nn::Linear first(3, 3);
    holder->register_module("first", first);
    auto inner = std::make_shared<torch::nn::Module>();
    inner->register_module("w", FullyShardedDataParallel<torch::nn::LinearImpl>(
                                    torch::nn::Linear(3, 3), FSDPOptions()));
    holder->register_module("inner", inner);
    const std::string error =
        error_of([&] { fully_shard(*holder, module_type_policy<torch::nn::LinearImpl>()); });
    EXPECT_CONTAINS(error, "found an fsdp::FullyShardedDataParallel wrapper at 'inner.w'");
    EXPECT_EQ(unit_of(*first), nullptr) << "the refused call made a unit";
    EXPECT_EQ(unit_of(*holder), nullptr);
  });
}

// Found by review: the policy form made units as it walked, so a refusal
// met on the way (a frozen weight beside a trainable bias, tied weights)
// left the units made before it. It now decides and checks every unit
// first, as auto_wrap does; tied weights between units (siblings, or a tied
// embedding in the root and a head the policy selects) are refused by name.
TEST(FullyShard, RefusalsFoundInTheWalkMakeNoUnit) {
  run_ranks_ok(1, [](int, int w) {
    init(w);
    const auto linears = module_type_policy<torch::nn::LinearImpl>();
    torch::nn::Sequential frozen(torch::nn::Linear(4, 4), torch::nn::Linear(4, 4));
    frozen->ptr(1)->as<torch::nn::Linear>()->weight.set_requires_grad(false);
    EXPECT_CONTAINS(error_of([&] { fully_shard(frozen, linears); }),
                    "has both parameters with requires_grad=true and requires_grad=false");
    EXPECT_EQ(unit_of(*frozen->ptr(0)), nullptr) << "the refused call made a unit";

    torch::nn::Linear first(4, 4);
    torch::nn::Sequential tied(first, torch::nn::ReLU(), SharedWeight(first->weight));
    const std::string siblings = error_of(
        [&] { fully_shard(tied, module_type_policy<torch::nn::LinearImpl, SharedWeightImpl>()); });
    EXPECT_CONTAINS(siblings,
                    "fsdp(fully_shard): parameter '2.weight' is the same tensor as a "
                    "parameter of the unit the policy selects at '0'");
    EXPECT_EQ(unit_of(*tied->ptr(0)), nullptr) << "the refused call made a unit";

    // A tied embedding: the root holds the embedding's weight as its head's.
    ListGpt gpt(2);
    gpt->register_parameter("head_weight", gpt->wte->weight);
    const std::string embedding = error_of(
        [&] { fully_shard(gpt, module_type_policy<torch::nn::EmbeddingImpl, BlockImpl>()); });
    EXPECT_CONTAINS(embedding,
                    "parameter 'head_weight' is the same tensor as a parameter of the "
                    "unit the policy selects at 'wte'");
    EXPECT_CONTAINS(embedding, "and the root is outside that unit");
    EXPECT_EQ(unit_of(*gpt->blocks[0]), nullptr) << "the refused call made a unit";
    // Kept in one unit (the root's), it is sharded.
    fully_shard(gpt, module_type_policy<BlockImpl>());
    EXPECT_NE(unit_of(*gpt->blocks[0]), nullptr);
  });
}

// A unit the caller made before, under a module the policy does not look
// into, manages its parameters: a frozen one there is not the root's (the
// review of the plan-first walk found the root's check counted it).
TEST(FullyShard, AUnitMadeBeforeUnderAModuleThePolicySkipsKeepsItsParameters) {
  run_ranks_ok(1, [](int, int w) {
    init(w);
    auto adapter = std::make_shared<torch::nn::Module>();
    torch::nn::Linear proj(4, 4);
    adapter->register_module("proj", proj);
    adapter->register_module("gate", torch::nn::Linear(4, 4));
    auto model = std::make_shared<torch::nn::Module>();
    model->register_module("adapter", adapter);
    model->register_module("head", torch::nn::Linear(4, 4));
    for (auto& p : proj->parameters()) p.set_requires_grad(false);
    fully_shard(*proj);
    Unit& root = fully_shard(*model, MinParamsPolicy(1'000'000));
    EXPECT_EQ(unit_of(*model), &root);
    EXPECT_EQ(unit_of(*adapter), nullptr);
  });
}

// Only a wrapper's forward reads FSDPOptions::activation_checkpointing: both
// forms refuse it, naming the alternative, before any unit is made.
// apply_activation_checkpointing refuses a unit fully_shard made (it has no
// wrapper forward, and a checkpoint wrapper would hide it), by its path,
// before it changes anything.
TEST(FullyShard, ActivationCheckpointingOfItsUnitsIsRefusedAndNothingChanges) {
  run_ranks_ok(1, [](int, int w) {
    init(w);
    ListGpt model(2);
    const auto checkpointed = FSDPOptions().activation_checkpointing(true);
    const std::string error =
        error_of([&] { fully_shard(model, module_type_policy<BlockImpl>(), checkpointed); });
    EXPECT_CONTAINS(error, "expected FSDPOptions::activation_checkpointing off for fully_shard");
    EXPECT_CONTAINS(error, "fsdp::apply_activation_checkpointing");
    EXPECT_EQ(unit_of(*model->blocks[0]), nullptr) << "the refused call made a unit";
    EXPECT_EQ(unit_of(*model), nullptr);
    EXPECT_CONTAINS(error_of([&] { fully_shard(*model->blocks[0], checkpointed); }),
                    "expected FSDPOptions::activation_checkpointing off");
    EXPECT_EQ(unit_of(*model->blocks[0]), nullptr);

    torch::nn::Sequential seq(torch::nn::Linear(4, 4), torch::nn::ReLU(), torch::nn::Linear(4, 4));
    fully_shard(*seq->ptr(2));
    fully_shard(seq);
    const std::string refused = error_of([&] {
      apply_activation_checkpointing(*seq, [](const torch::nn::Module& m) {
        return dynamic_cast<const torch::nn::LinearImpl*>(&m) != nullptr;
      });
    });
    EXPECT_CONTAINS(refused,
                    "fsdp(apply_activation_checkpointing): cannot checkpoint '2': "
                    "fsdp::fully_shard made each a unit in place");
    EXPECT_EQ(refused.find("set_activation_checkpointing"), std::string::npos)
        << "advice that does nothing for a unit made in place: " << refused;
    EXPECT_NE(std::dynamic_pointer_cast<torch::nn::LinearImpl>(seq->ptr(0)), nullptr)
        << "entry 0 was replaced despite the error";
  });
}

// A MultiheadAttention uses its projections' weights directly, so
// MinParamsPolicy never looks into it (PyTorch's FORCE_LEAF_MODULES).
struct AttentionNetImpl : torch::nn::Module {
  AttentionNetImpl() {
    attn = register_module("attn", torch::nn::MultiheadAttention(kDim, 2));
    head = register_module("head", torch::nn::Linear(kDim, kVocab));
  }
  torch::Tensor forward(torch::Tensor x) { return head(std::get<0>(attn(x, x, x))); }
  torch::nn::MultiheadAttention attn{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(AttentionNet);

// As auto_wrap (and PyTorch's _recursive_wrap): a module the policy does not
// recurse into is not asked whether to become a unit, nor is anything under it.
TEST(FullyShard, NothingUnderAModuleThePolicyDoesNotRecurseIntoBecomesAUnit) {
  run_ranks_ok(1, [](int, int w) {
    init(w);
    AttentionNet net;  // attn: 1088 elements, head: 221
    Unit& root = fully_shard(net, MinParamsPolicy(500));
    EXPECT_EQ(unit_of(*net->attn), nullptr) << "a MultiheadAttention became a unit";
    EXPECT_EQ(unit_of(*net->attn->out_proj), nullptr);
    EXPECT_EQ(unit_of(*net), &root);

    ListGpt model(2);
    std::vector<std::string> asked;
    const AutoWrapPolicy policy(
        [&asked](const torch::nn::Module& m, const std::string& path, int64_t) {
          asked.push_back(path);
          return dynamic_cast<const BlockImpl*>(&m) != nullptr ||
                 dynamic_cast<const torch::nn::LinearImpl*>(&m) != nullptr;
        },
        "blocks and Linears, none in blocks.1",
        [](const torch::nn::Module&, const std::string& path, int64_t) {
          return path != "blocks.1";
        });
    fully_shard(model, policy);
    auto* block0 = model->blocks[0]->as<BlockImpl>();
    auto* block1 = model->blocks[1]->as<BlockImpl>();
    EXPECT_NE(unit_of(*block0), nullptr);
    EXPECT_NE(unit_of(*block0->fc1), nullptr);
    EXPECT_EQ(unit_of(*block1), nullptr);
    EXPECT_EQ(unit_of(*block1->fc1), nullptr);
    for (const std::string& path : asked) {
      EXPECT_NE(path.rfind("blocks.1", 0), 0u) << "asked to wrap " << path;
    }
  });
}

// Under mixed precision the modules of module_classes_to_ignore (BatchNorm)
// become units with mixed precision off, with auto_wrap's warning, as
// auto_wrap makes them: with only reduce_dtype and buffer_dtype given too,
// which the unit's own check (made for param_dtype) left on.
TEST(FullyShard, BatchNormUnitsHaveMixedPrecisionOffAsAutoWrapMakesThem) {
  run_ranks_ok(1, [](int, int w) {
    init(w);
    torch::nn::BatchNorm1d bn(8);
    torch::nn::Sequential model(torch::nn::Linear(4, 8), bn, torch::nn::ReLU(),
                                torch::nn::Linear(8, 2));
    const auto mp = MixedPrecision().reduce_dtype(at::kBFloat16).buffer_dtype(at::kBFloat16);
    std::vector<std::string> warnings;
    {
      compat::WarningCollector collect(&warnings);
      fully_shard(model, module_type_policy<torch::nn::LinearImpl>(),
                  FSDPOptions().mixed_precision(mp));
    }
    const Unit* unit = unit_of(*bn);
    ASSERT_NE(unit, nullptr);
    EXPECT_FALSE(unit->fsdp_options().mixed_precision().has_value());
    EXPECT_TRUE(unit->casts_output_back());
    EXPECT_EQ(bn->running_mean.scalar_type(), at::kFloat) << "cast to buffer_dtype";
    ASSERT_NE(unit_of(*model->ptr(0)), nullptr);
    EXPECT_TRUE(unit_of(*model->ptr(0))->fsdp_options().mixed_precision().has_value());
    int named = 0;
    for (const std::string& warning : warnings) {
      named += warning.find("torch::nn::BatchNorm1dImpl at 1") != std::string::npos;
    }
    EXPECT_EQ(named, 1) << "auto_wrap's warning naming the BatchNorm";
    model->forward(torch::randn({6, 4})).pow(2).sum().backward();
    EXPECT_EQ(bn->running_mean.scalar_type(), at::kFloat);
    // Inside a bf16 unit made by fully_shard: refused with fully_shard's
    // fixes, not the wrappers' (which fully_shard refuses in its tree).
    torch::nn::Sequential plain(torch::nn::Linear(4, 8), torch::nn::BatchNorm1d(8));
    const std::string msg = error_of([&] {
      fully_shard(plain,
                  FSDPOptions().mixed_precision(MixedPrecision().param_dtype(at::kBFloat16)));
    });
    EXPECT_CONTAINS(msg, "Call fsdp::fully_shard(*module, options) on each before its parent");
  });
}

// A BatchNorm computing in bf16 (module_classes_to_ignore emptied): its
// float32 running statistics are not cast (a cast copy took the update and
// the module's statistics stayed at their initial values, silently), so the
// forward fails naming buffer_dtype; with buffer_dtype the statistics update
// as plain bf16 LibTorch's. An LSTM's state, a tensor list, is cast with the
// input (it met the bf16 weights in float32: an error).
TEST(FullyShard, BuffersAreNotCastAndTensorListsAre) {
  run_ranks_ok(1, [](int, int w) {
    init(w);
    const auto bf16 = MixedPrecision().param_dtype(at::kBFloat16).module_classes_to_ignore({});
    const torch::Tensor x = torch::randn({6, 4});
    const auto net = [](int64_t seed) {
      torch::manual_seed(seed);
      return torch::nn::Sequential(torch::nn::Linear(4, 8), torch::nn::BatchNorm1d(8));
    };
    const auto stats = [](torch::nn::Sequential& m) {
      return m->ptr(1)->as<torch::nn::BatchNorm1dImpl>()->running_mean;
    };
    torch::nn::Sequential kept = net(0);
    fully_shard(kept, FSDPOptions().mixed_precision(bf16));
    EXPECT_CONTAINS(error_of([&] { kept->forward(x); }), "MixedPrecision::buffer_dtype(BFloat16)");
    torch::nn::Sequential plain = net(0);
    plain->to(at::kBFloat16);
    torch::nn::Sequential cast = net(0);
    fully_shard(cast,
                FSDPOptions().mixed_precision(MixedPrecision(bf16).buffer_dtype(at::kBFloat16)));
    plain->forward(x.to(at::kBFloat16));
    cast->forward(x);
    ASSERT_GT(stats(plain).abs().sum().item<double>(), 0);
    EXPECT_TRUE(torch::equal(stats(cast), stats(plain)));

    torch::manual_seed(1);
    torch::nn::LSTM plain_lstm(torch::nn::LSTMOptions(4, 5));
    plain_lstm->to(at::kBFloat16);
    torch::manual_seed(1);
    torch::nn::LSTM lstm(torch::nn::LSTMOptions(4, 5));
    fully_shard(lstm, FSDPOptions().mixed_precision(bf16));
    const torch::Tensor xs = torch::randn({3, 2, 4});
    const torch::Tensor out = std::get<0>(lstm->forward(xs));
    EXPECT_EQ(out.scalar_type(), at::kBFloat16);
    EXPECT_TRUE(torch::equal(out, std::get<0>(plain_lstm->forward(xs.to(at::kBFloat16)))));
  });
}

// A block kept after its model is dropped (an encoder taken out of a
// trained model), after a training step and after an evaluation forward
// that left units in their forward: it becomes a root of its own and trains
// as the plain block with its weights (it read the dropped model's freed
// module: a use-after-free, found by a review; ASan's stage checks it). The
// dropped model's other units are freed at that use (they were kept until
// the next fully_shard).
TEST(FullyShard, ABlockOutlivesItsModel) {
  run_ranks_ok(2, [](int, int w) {
    init(w);
    for (bool evaluated : {false, true}) {
      SCOPED_TRACE(evaluated ? "after an evaluation forward" : "after a step");
      Block kept{nullptr};
      Block plain(kDim);
      using WeakTensor = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;
      c10::optional<WeakTensor> root_shard;  // the dropped root's
      {
        torch::manual_seed(0);
        ListGpt model(2);
        Unit& root = fully_shard(model, module_type_policy<BlockImpl>());
        torch::optim::SGD opt(root.flat_parameters(), torch::optim::SGDOptions(0.1));
        const torch::Tensor tokens = torch::randint(0, kVocab, {2, kSeq});
        lm_loss(model->forward(tokens), tokens).backward();
        opt.step();
        if (evaluated) model->forward(tokens);
        kept = Block(std::dynamic_pointer_cast<BlockImpl>(model->blocks->ptr(0)));
        {
          SummonFullParams full(*model);
          torch::NoGradGuard no_grad;
          for (auto& p : plain->named_parameters()) {
            p.value().copy_(kept->named_parameters()[p.key()]);
          }
        }
        root_shard.emplace(root.flat_parameters()[0].getIntrusivePtr());
      }
      EXPECT_FALSE(root_shard->expired()) << "held until a unit is used";
      const torch::Tensor x = torch::randn({2, kSeq, kDim});
      const torch::Tensor out = kept->forward(x);
      EXPECT_TRUE(root_shard->expired()) << "the dropped model's root unit is still held";
      EXPECT_TRUE(torch::allclose(out, plain->forward(x), 1e-5, 1e-6));
      out.pow(2).sum().backward();
      const Unit* unit = unit_of(*kept);
      ASSERT_NE(unit, nullptr);
      EXPECT_TRUE(unit->is_root());
    }
  });
}

// Two more ways a model's units end (a review's findings, for ASan's stage):
// a block initialised alone before its parent was sharded (it was its own
// root, whose state outlived the adoption and was orphaned, into freed
// units, when the dropped model's units were freed in any order); and a
// model dropped between its forward and backward (the block's first
// operator in backward freed the root the backward still calls). Both train
// on, and a later fully_shard frees what is left.
TEST(FullyShard, AModelDroppedAtAnyPointFreesItsUnitsCleanly) {
  run_ranks_ok(2, [](int, int w) {
    init(w);
    const torch::Tensor tokens = torch::randint(0, kVocab, {2, kSeq});
    {
      ListGpt model(2);
      for (size_t i = 0; i < model->blocks->size(); ++i) fully_shard(*model->blocks->ptr(i));
      {
        torch::NoGradGuard no_grad;
        model->blocks[0]->as<BlockImpl>()->fc1->weight.normal_();  // block 0 its own root
      }
      fully_shard(model);
      lm_loss(model->forward(tokens), tokens).backward();
    }
    Block kept{nullptr};
    torch::Tensor loss;
    {
      ListGpt model(2);
      fully_shard(model, module_type_policy<BlockImpl>());
      kept = Block(std::dynamic_pointer_cast<BlockImpl>(model->blocks->ptr(1)));
      loss = lm_loss(model->forward(tokens), tokens);
    }
    loss.backward();  // the dropped root's backward, through the kept block
    EXPECT_TRUE(kept->fc1->weight.grad().defined());
    kept->forward(torch::randn({2, kSeq, kDim})).sum().backward();
    EXPECT_TRUE(unit_of(*kept)->is_root());
    torch::nn::Linear other(3, 3);
    fully_shard(other);  // frees the dropped models' units
    EXPECT_EQ(other->forward(torch::randn({2, 3})).size(1), 3);
  });
}

// A weight printed, and one initialised under NoGradGuard, before the first
// step (a root's parameter read outside any forward, in training mode):
// training then runs as without them, with no warning that the forward
// order changed (a review suspected the read was recorded as the first
// forward).
TEST(FullyShard, AParameterReadBeforeTrainingIsNoForward) {
  run_ranks_ok(2, [](int, int w) {
    init(w);
    torch::manual_seed(0);
    ListGpt model(3);
    Unit& root = fully_shard(model, module_type_policy<BlockImpl>());
    torch::optim::SGD opt(root.flat_parameters(), torch::optim::SGDOptions(0.1));
    std::vector<std::string> warnings;
    compat::WarningCollector collect(&warnings);
    std::ostringstream printed;
    printed << model->head->weight.sum().item<float>();
    {
      torch::NoGradGuard no_grad;
      model->head->bias.zero_();
    }
    for (int step = 0; step < 3; ++step) {
      torch::manual_seed(50 + step);
      const torch::Tensor tokens = torch::randint(0, kVocab, {2, kSeq});
      opt.zero_grad();
      lm_loss(model->forward(tokens), tokens).backward();
      opt.step();
    }
    for (const std::string& warning : warnings) ADD_FAILURE() << warning;
  });
}

TEST(FullyShard, DifferentBlockOrderAcrossRanksIsAnErrorOnEveryRank) {
  run_ranks_ok(2, [](int rank, int w) {
    init(w);
    ListGpt model(3);
    fully_shard(model, module_type_policy<BlockImpl>());
    if (rank == 1) model->block_order = {0, 2, 1};
    const torch::Tensor tokens = torch::randint(0, kVocab, {2, kSeq});
    try {
      lm_loss(model->forward(tokens), tokens).backward();
      ADD_FAILURE() << "no error on rank " << rank;
    } catch (const c10::Error& e) {
      const std::string msg = e.what_without_backtrace();
      EXPECT_EQ(msg.rfind("Forward order differs across ranks", 0), 0u) << msg;
      EXPECT_NE(msg.find("rank 0 was about to all-gather unit `blocks.1`"), std::string::npos)
          << msg;
      EXPECT_NE(msg.find("rank 1 was about to all-gather unit `blocks.2`"), std::string::npos)
          << msg;
    }
  });
}

// Plain LibTorch with the casts mixed precision makes: a bf16 working copy
// of fp32 master weights runs each rank's block of `tokens(step)`, the bf16
// gradients are summed in rank order and averaged, and SGD steps the master.
// Returns the master's parameters after each step.
std::vector<torch::OrderedDict<std::string, torch::Tensor>> bf16_reference(
    int world, int steps, const std::function<torch::Tensor(int)>& tokens) {
  torch::manual_seed(0);
  ListGpt master(3);
  torch::manual_seed(0);
  ListGpt work(3);
  auto master_params = master->named_parameters();
  auto work_params = work->named_parameters();
  torch::optim::SGD opt(master->parameters(), torch::optim::SGDOptions(0.1));
  std::vector<torch::OrderedDict<std::string, torch::Tensor>> out;
  for (int step = 0; step < steps; ++step) {
    std::map<std::string, torch::Tensor> sum;
    const torch::Tensor all = tokens(step);
    for (int r = 0; r < world; ++r) {
      for (auto& p : work_params) {
        p.value().set_data(master_params[p.key()].detach().to(at::kBFloat16));
        p.value().mutable_grad().reset();
      }
      const torch::Tensor mine = all.chunk(world, 0)[r];
      lm_loss(work->forward(mine), mine).backward();
      add_grads(sum, work_params);
    }
    for (auto& p : master_params) {
      p.value().mutable_grad() = sum[p.key()].div(world).to(at::kFloat);
    }
    opt.step();
    torch::OrderedDict<std::string, torch::Tensor> snapshot;
    for (auto& p : master_params) snapshot.insert(p.key(), p.value().detach().clone());
    out.push_back(std::move(snapshot));
  }
  return out;
}

TEST(FullyShard, MixedPrecisionMatchesPlainBf16Computation) {
  run_ranks_ok(2, [](int, int world) {
    init(world);
    constexpr int kSteps = 3;
    const auto tokens = [world](int step) {
      torch::manual_seed(20 + step);
      return torch::randint(0, kVocab, {2 * world, kSeq});
    };
    const auto reference = bf16_reference(world, kSteps, tokens);
    for (auto strategy : {ShardingStrategy::kFullShard, ShardingStrategy::kNoShard}) {
      SCOPED_TRACE(to_string(strategy));
      torch::manual_seed(0);
      ListGpt model(3);
      auto counting = std::make_shared<CountingProcessGroup>(default_process_group());
      Unit& root = fully_shard(
          model, module_type_policy<BlockImpl>(),
          FSDPOptions().sharding_strategy(strategy).process_group(counting).mixed_precision(
              MixedPrecision().param_dtype(at::kBFloat16)));
      std::vector<at::ScalarType> seen;  // block 1's weight and output dtypes in forward
      model->after_block = [&](size_t i, const torch::Tensor& x) {
        if (i == 1)
          seen = {model->blocks[1]->as<BlockImpl>()->fc1->weight.scalar_type(), x.scalar_type()};
      };
      torch::optim::SGD opt(root.flat_parameters(), torch::optim::SGDOptions(0.1));
      for (int step = 0; step < kSteps; ++step) {
        const torch::Tensor mine = local_block(tokens(step));
        model->zero_grad();
        lm_loss(model->forward(mine), mine).backward();
        opt.step();
        EXPECT_EQ(seen, (std::vector<at::ScalarType>{at::kBFloat16, at::kBFloat16}));
        for (const auto& p : root.flat_parameters()) EXPECT_EQ(p.scalar_type(), at::kFloat);
        // The full-precision values (full_state_dict gathers the fp32 shards).
        const auto got = full_state_dict(*model);
        for (const auto& want : reference[step]) {
          const torch::Tensor& g = got[want.key()];
          EXPECT_TRUE(torch::allclose(g, want.value(), /*rtol=*/1.6e-2, /*atol=*/1e-3))
              << want.key() << " step " << step << " max diff "
              << (g - want.value()).abs().max().item<double>();
        }
      }
      if (strategy == ShardingStrategy::kFullShard) {
        EXPECT_GT(counting->reduce_scatters.load(), 0);
        for (at::ScalarType t : counting->reduced_dtypes()) EXPECT_EQ(t, at::kBFloat16);
      }
    }
  });
}

// A layer whose custom Function's backward multiplies its weight by float32
// statistics it saved in forward, as CUDA's layer_norm_backward reads its
// float32 mean and rstd beside a float16 weight. Records the product's dtype.
struct WeightTimesStat : torch::autograd::Function<WeightTimesStat> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x,
                               const torch::Tensor& w) {
    ctx->save_for_backward({x, w});
    ctx->saved_data["stat"] = x.to(torch::kFloat).abs().mean(0);  // one per input feature
    return torch::mm(x, w.t());
  }
  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    const auto saved = ctx->get_saved_variables();
    const torch::Tensor& x = saved[0];
    const torch::Tensor& w = saved[1];
    seen() = (w * ctx->saved_data["stat"].toTensor()).scalar_type();
    const torch::Tensor g = grads[0];
    return {g.mm(w).to(x.scalar_type()), g.t().mm(x.to(g.scalar_type()))};
  }
  static at::ScalarType& seen() {
    static at::ScalarType dtype = at::kByte;
    return dtype;
  }
};

struct StatLayerImpl : torch::nn::Module {
  StatLayerImpl() { weight = register_parameter("weight", torch::randn({6, 6})); }
  torch::Tensor forward(const torch::Tensor& x) { return WeightTimesStat::apply(x, weight); }
  torch::Tensor weight;
};
TORCH_MODULE(StatLayer);

// Only a forward casts to the compute dtype: a backward's operators on a
// unit's parameters get their other inputs as forward left them, and bf16
// times float32 promotes as in plain LibTorch. Before, the float32
// statistics were cast to bf16 (on a GPU, layer_norm_backward refused them).
TEST(FullyShard, BackwardOperatorsGetTheirInputsUncast) {
  run_ranks_ok(2, [](int, int world) {
    init(world);
    torch::nn::Sequential model{StatLayer(), torch::nn::ReLU(), StatLayer()};
    fully_shard(model, module_type_policy<StatLayerImpl>(),
                FSDPOptions().mixed_precision(MixedPrecision().param_dtype(at::kBFloat16)));
    const torch::Tensor out = model->forward(torch::randn({4, 6}));
    EXPECT_EQ(out.scalar_type(), at::kBFloat16);  // the forward cast the input
    out.to(torch::kFloat).pow(2).sum().backward();
    EXPECT_EQ(WeightTimesStat::seen(), at::kFloat);
  });
}

// Under mixed precision a write to one parameter outside forward (a clamp_
// or an initialiser under NoGradGuard) keeps its rank's part of that
// parameter only: the unit's other parameters keep their full-precision
// shards, not the bfloat16 copies the operator was given.
TEST(FullyShard, AWriteUnderMixedPrecisionLeavesTheOtherParametersWhole) {
  run_ranks_ok(2, [](int, int world) {
    init(world);
    torch::nn::Sequential model{torch::nn::Linear(6, 6), torch::nn::Linear(6, 6)};
    {
      torch::NoGradGuard no_grad;
      for (auto& p : model->parameters()) p.fill_(1.0 + 1.0 / 4096);  // not a bfloat16
    }
    fully_shard(model, FSDPOptions().mixed_precision(MixedPrecision().param_dtype(at::kBFloat16)));
    auto* first = model[0]->as<torch::nn::LinearImpl>();
    {
      torch::NoGradGuard no_grad;
      first->bias.zero_();
    }
    SummonFullParams full(*model);
    for (const auto& p : model->named_parameters()) {
      const double want = p.key() == "0.bias" ? 0.0 : 1.0 + 1.0 / 4096;
      EXPECT_TRUE(torch::all(p.value() == want).item<bool>()) << p.key() << ": " << p.value();
    }
  });
}

// Runs `body(rank, world, dir)` on `world` ranks (process group joined) with
// a directory they share, removed afterwards.
void run_with_dir(int world, const std::function<void(int, int, const std::string&)>& body) {
  MultiRankOptions with_dir;
  const std::string dir = shared_temp_dir(with_dir, "fully_shard");
  ASSERT_FALSE(dir.empty());
  run_ranks_ok(
      world,
      [&](int rank, int w) {
        init(w);
        body(rank, w, dir);
      },
      with_dir);
  std::error_code ignored;
  if (!is_rank_process()) detail::remove_tree(dir, ignored);
}

TEST(FullyShard, ShardedCheckpointResumesBitForBit) {
  run_with_dir(2, [](int rank, int world, const std::string& dir) {
    auto train = [&](ListGpt& model, torch::optim::Optimizer& opt, int step) {
      torch::manual_seed(30 + step);
      const torch::Tensor tokens = torch::randint(0, kVocab, {2 * world, kSeq});
      model->zero_grad();
      lm_loss(model->forward(local_block(tokens)), local_block(tokens)).backward();
      opt.step();
    };
    auto adamw = torch::optim::AdamWOptions(1e-2).weight_decay(0.1);
    torch::manual_seed(0);
    ListGpt model(3);
    Unit& root = fully_shard(model, module_type_policy<BlockImpl>());
    torch::optim::AdamW opt(root.flat_parameters(), adamw);
    Checkpointer ckpt(*model, &opt);
    for (int step = 0; step < 3; ++step) {
      if (step == 2) ckpt.save(dir + "/ckpt", step);
      train(model, opt, step);
    }
    // A fresh model (other weights) resumes from the checkpoint and
    // takes the same third step.
    torch::manual_seed(99);
    ListGpt twin(3);
    Unit& twin_root = fully_shard(twin, module_type_policy<BlockImpl>());
    torch::optim::AdamW twin_opt(twin_root.flat_parameters(), adamw);
    Checkpointer twin_ckpt(*twin, &twin_opt);
    EXPECT_EQ(twin_ckpt.load(dir + "/ckpt"), 2);
    train(twin, twin_opt, 2);
    SummonFullParams a(*model);
    SummonFullParams b(*twin);
    const auto want = model->named_parameters();
    for (const auto& p : twin->named_parameters()) {
      EXPECT_TRUE(torch::equal(p.value(), want[p.key()])) << p.key() << " rank " << rank;
    }
  });
}

// The experiment behind docs/using.md's torch::save caveat: Module::save
// cannot be overridden in place, so the parameters it writes are what they
// are at that moment: full under SummonFullParams; outside, placeholders
// whose storage refuses the read (Note [Saving a sharded parameter]; before
// LibTorch 2.4 a file of empty storages, which 1.13 loads silently). And
// torch::load into the sharded model keeps each rank's part of the file.
TEST(FullyShard, TorchSaveUnderSummonFullParamsAndTorchLoad) {
  run_with_dir(2, [](int rank, int world, const std::string& dir) {
    torch::manual_seed(0);
    ListGpt model(2);
    Unit& root = fully_shard(model, module_type_policy<BlockImpl>());
    torch::optim::SGD opt(root.flat_parameters(), torch::optim::SGDOptions(0.1));
    torch::manual_seed(40 + rank);
    const torch::Tensor tokens = torch::randint(0, kVocab, {2, kSeq});
    lm_loss(model->forward(tokens), tokens).backward();
    opt.step();
    const std::string full = dir + "/full.pt";
    const std::string sharded = dir + "/sharded.pt";
    std::vector<torch::Tensor> want;
    {
      SummonFullParams gathered(*model);
      if (rank == 0) torch::save(model, full);
      for (const auto& p : model->parameters()) want.push_back(p.detach().clone());
    }
    // Outside it, on rank 0 alone (the habit): refused at once, without a
    // collective the other rank does not issue, naming a parameter and the fix.
    std::string refused;
    if (rank == 0) {
      try {
        torch::save(model, sharded);
      } catch (const c10::Error& e) {
        refused = e.what();
      }
      if (compat::kRefusesDataReads) {
        EXPECT_NE(refused.find("[rank 0] fsdp(parameters): the data of parameter '"),
                  std::string::npos)
            << refused;
        EXPECT_NE(refused.find("fsdp::SummonFullParams full(*model)"), std::string::npos)
            << refused;
        // A parameter saved alone too.
        EXPECT_NE(error_of([&] {
                    torch::save(model->parameters()[0], dir + "/w.pt");
                  }).find("fsdp::full_state_dict"),
                  std::string::npos);
      }
    }
    const bool written = refused.empty();
    default_process_group()->barrier().wait();
    ListGpt plain(2);
    torch::load(plain, full);
    const auto got = plain->parameters();
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < want.size(); ++i) EXPECT_TRUE(torch::equal(got[i], want[i])) << i;
    // LibTorch 2.x's loader refuses the placeholders' empty storages;
    // 1.13's takes them without a word (docs/using.md warns of it).
    if (rank == 0 && written && TORCH_VERSION_MAJOR >= 2) {
      ListGpt other(2);
      EXPECT_THROW(torch::load(other, sharded), c10::Error)
          << "a file saved from placeholders loaded without a word";
    }
    // torch::load into the sharded model (Note [torch::load into a unit made
    // in place]): after a step that changed the weights, the file's come
    // back; inside SummonFullParams (plain, and under mixed precision, whose
    // guard summons into a buffer of its own) the gathered values show them
    // at once, and the shards keep them after it.
    const auto step_away = [&] {
      lm_loss(model->forward(tokens), tokens).backward();
      opt.step();
      opt.zero_grad();
    };
    const auto expect_loaded = [&](const std::string& what) {
      const auto got = model->parameters();
      for (size_t i = 0; i < want.size(); ++i) {
        EXPECT_TRUE(torch::equal(got[i], want[i])) << what << ", parameter " << i;
      }
    };
    step_away();
    torch::load(model, full);
    {
      SummonFullParams gathered(*model);
      expect_loaded("loaded while sharded");
    }
    step_away();
    {
      SummonFullParams gathered(*model);
      torch::load(model, full);
      expect_loaded("loaded under SummonFullParams");
    }
    {
      SummonFullParams gathered(*model);
      expect_loaded("loaded under SummonFullParams, after the guard");
    }
    {
      torch::manual_seed(0);
      ListGpt low(2);
      Unit& low_root = fully_shard(
          low, module_type_policy<BlockImpl>(),
          FSDPOptions().mixed_precision(MixedPrecision().param_dtype(torch::kBFloat16)));
      (void)low_root;
      {
        SummonFullParams gathered(*low);
        torch::load(low, full);
      }
      SummonFullParams gathered(*low);
      const auto got = low->parameters();
      for (size_t i = 0; i < want.size(); ++i) {
        EXPECT_TRUE(torch::equal(got[i], want[i])) << "mixed precision, parameter " << i;
      }
      // Another thread reads the summoned values (an EMA copy beside the
      // loop): not taken for a forward of the unit.
      std::string thread_error;
      std::thread reader([&] {
        try {
          (void)got[0].sum().item<double>();
        } catch (const std::exception& e) {
          thread_error = e.what();
        }
      });
      reader.join();
      EXPECT_EQ(thread_error, "");
    }
    // A file of another model: the parameter named (what its unit held
    // before it in the file is loaded, as in plain LibTorch).
    torch::manual_seed(5);
    ListGpt other(2);
    other->head = other->replace_module("head", torch::nn::Linear(kDim, kVocab + 1));
    const std::string another = dir + "/another" + std::to_string(rank) + ".pt";
    torch::save(other, another);
    EXPECT_CONTAINS(
        error_of([&] { torch::load(model, another); }),
        "expected parameter 'head.weight' of shape [13, 16] from torch::load (set_), got "
        "[14, 16]");
  });
}

}  // namespace test_fully_shard
}  // namespace fsdp::testing
