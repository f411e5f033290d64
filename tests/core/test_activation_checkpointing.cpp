// Activation checkpointing for LibTorch (issue 18): fsdp::activation_checkpoint,
// CheckpointWrapper and apply_activation_checkpointing train exactly as plain
// LibTorch does, dropout included, inside FSDP units and around them, under
// every sharding strategy at 1-3 ranks (different data per rank; the
// reference trains on every rank's data); the tracker shows activation
// memory falling; FULL_SHARD gathers no more than without checkpointing.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include <fsdp/fsdp.h>

#include "comm/counting_process_group.h"
#include "detail/torch_compat.h"
#include "error_of.h"
#include "multi_rank.h"
#include "test_models.h"

namespace fsdp::testing {
namespace test_activation_checkpointing {

namespace nn = torch::nn;

constexpr int64_t kDim = 16;
constexpr int kBlocks = 3;

// A residual block with dropout: its masks must be the same in the
// recomputation as in the forward.
struct DropBlockImpl : nn::Module {
  explicit DropBlockImpl(int64_t d = kDim) {
    fc1 = register_module("fc1", nn::Linear(d, 2 * d));
    fc2 = register_module("fc2", nn::Linear(2 * d, d));
    drop = register_module("drop", nn::Dropout(0.3));
  }
  torch::Tensor forward(torch::Tensor x) { return x + fc2(drop(torch::gelu(fc1(x)))); }
  nn::Linear fc1{nullptr}, fc2{nullptr};
  nn::Dropout drop{nullptr};
};
TORCH_MODULE(DropBlock);

// What the chain holds: a block as a member, plain or an FSDP unit (so that
// a CheckpointWrapper around the holder is around a unit).
struct HolderImpl : nn::Module {
  HolderImpl(DropBlock block, const c10::optional<FSDPOptions>& unit) {
    if (unit) {
      sharded = register_module("inner", FullyShardedDataParallel<DropBlockImpl>(block, *unit));
    } else {
      plain = register_module("inner", block);
    }
  }
  torch::Tensor forward(torch::Tensor x) { return plain ? plain(x) : sharded(x); }
  DropBlock plain{nullptr};
  FullyShardedDataParallel<DropBlockImpl> sharded{nullptr};
};
TORCH_MODULE(Holder);

struct ChainImpl : nn::SequentialImpl {
  torch::Tensor forward(torch::Tensor x) { return nn::SequentialImpl::forward(x); }
};
TORCH_MODULE(Chain);

bool is_drop_block(const nn::Module& m) { return m.as<DropBlockImpl>() != nullptr; }
bool is_holder(const nn::Module& m) { return m.as<HolderImpl>() != nullptr; }

// How the tested model is built.
enum class Layout {
  kInsideUnits,        // blocks are units; apply_activation_checkpointing checkpoints the units
  kAroundUnits,        // blocks are units, their holders inside a CheckpointWrapper
  kEntriesInRootUnit,  // holders are plain entries of the root unit, checkpointed in place
  kNestedAroundUnits,  // as kAroundUnits, each wrapper within a second one
};

const char* to_string(Layout l) {
  switch (l) {
    case Layout::kInsideUnits:
      return "inside units";
    case Layout::kAroundUnits:
      return "around units";
    case Layout::kEntriesInRootUnit:
      return "entries of the root unit";
    case Layout::kNestedAroundUnits:
      return "nested around units";
  }
  return "?";
}

// Seeded construction: the same weights in the reference and every layout.
// `unit`: the options of the blocks' units (none: plain blocks); `wraps`:
// how many CheckpointWrappers around each holder (0-2).
Chain make_chain(const c10::optional<FSDPOptions>& unit, int wraps) {
  torch::manual_seed(0);
  Chain chain;
  for (int i = 0; i < kBlocks; ++i) {
    Holder holder(DropBlock(), unit);
    if (wraps == 2) {
      chain->push_back(CheckpointWrapper<CheckpointWrapperImpl<HolderImpl>>(
          CheckpointWrapper<HolderImpl>(holder)));
    } else if (wraps == 1) {
      chain->push_back(CheckpointWrapper<HolderImpl>(holder));
    } else {
      chain->push_back(holder);
    }
  }
  chain->push_back(nn::Linear(kDim, 4));
  return chain;
}

Chain plain_chain() { return make_chain(c10::nullopt, 0); }

FullyShardedDataParallel<ChainImpl> sharded_chain(Layout layout, const FSDPOptions& opts) {
  switch (layout) {
    case Layout::kInsideUnits: {
      FullyShardedDataParallel<ChainImpl> root(make_chain(opts, false), opts);
      EXPECT_EQ(apply_activation_checkpointing(*root, is_drop_block), kBlocks);
      EXPECT_EQ(apply_activation_checkpointing(*root, is_drop_block), 0) << "counted twice";
      return root;
    }
    case Layout::kAroundUnits:
      return FullyShardedDataParallel<ChainImpl>(make_chain(opts, 1), opts);
    case Layout::kNestedAroundUnits:
      return FullyShardedDataParallel<ChainImpl>(make_chain(opts, 2), opts);
    case Layout::kEntriesInRootUnit: {
      FullyShardedDataParallel<ChainImpl> root(plain_chain(), opts);
      EXPECT_EQ(apply_activation_checkpointing(*root, is_holder), kBlocks);
      return root;
    }
  }
  return nullptr;
}

// Each rank's loss on its own batch, with its own dropout seed per step; the
// reference replays every rank's batch with that rank's seed and averages
// the losses, which is what averaging the ranks' gradients computes.
torch::Tensor rank_loss(const std::function<torch::Tensor(torch::Tensor)>& forward, int step,
                        int rank) {
  torch::manual_seed(500 + 10 * step + rank);  // the data
  torch::Tensor x = torch::randn({6, kDim});
  torch::Tensor target = torch::randn({6, 4});
  torch::manual_seed(7000 + 10 * step + rank);  // the dropout masks
  return torch::mse_loss(forward(x), target);
}

// Step `step` of the reference on every rank's loss (their mean) and of the
// model on this rank's, compared after.
void step_and_compare(Chain& reference, torch::optim::Optimizer& ref_opt,
                      FullyShardedDataParallel<ChainImpl>& model, torch::optim::Optimizer& opt,
                      int step, const std::string& what) {
  const auto [rank, world] = rank_and_world();
  ref_opt.zero_grad();
  torch::Tensor total = torch::zeros({});
  for (int r = 0; r < world; ++r) {
    total = total + rank_loss([&](torch::Tensor x) { return reference->forward(x); }, step, r);
  }
  (total / world).backward();
  ref_opt.step();
  opt.zero_grad();
  rank_loss([&](torch::Tensor x) { return model->forward(x); }, step, rank).backward();
  opt.step();
  expect_same_after_step(*model.ptr(), *reference.ptr(), what, step);
}

void train_and_compare(Layout layout, const FSDPOptions& opts, int steps) {
  const int world = rank_and_world().second;
  const std::string what = std::string(to_string(layout)) + " " +
                           fsdp::to_string(opts.sharding_strategy()) + " world " +
                           std::to_string(world);
  Chain reference = plain_chain();
  FullyShardedDataParallel<ChainImpl> model = sharded_chain(layout, opts);
  torch::optim::AdamW ref_opt(reference->parameters(), torch::optim::AdamWOptions(1e-2));
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-2));
  for (int step = 0; step < steps; ++step) {
    step_and_compare(reference, ref_opt, model, opt, step, what);
  }
}

TEST(ActivationCheckpoint, SameGradientsAsPlainAutogradWithDropout) {
  for (const bool input_needs_grad : {true, false}) {
    torch::manual_seed(0);
    DropBlock plain;
    torch::manual_seed(0);
    CheckpointWrapper<DropBlockImpl> checkpointed{DropBlock()};
    // Names and parameters are the wrapped module's.
    EXPECT_EQ(checkpointed->named_parameters().keys(), plain->named_parameters().keys());
    torch::Tensor x = torch::randn({5, kDim}).requires_grad_(input_needs_grad);
    torch::Tensor x2 = x.detach().clone().requires_grad_(input_needs_grad);
    torch::manual_seed(42);
    torch::Tensor y = plain->forward(x);
    torch::manual_seed(42);
    torch::Tensor y2 = checkpointed->forward(x2);
    ASSERT_TRUE(torch::equal(y, y2));
    // Random numbers drawn after the forward are the same too: the
    // recomputation puts the generator back where it found it.
    const torch::Tensor after = torch::rand({3});
    y.square().sum().backward();
    y2.square().sum().backward();
    EXPECT_FALSE(torch::equal(torch::rand({3}), after)) << "the generator moved on";
    for (const auto& p : plain->named_parameters()) {
      const torch::Tensor& g2 = checkpointed->named_parameters()[p.key()].grad();
      ASSERT_TRUE(g2.defined()) << p.key() << " got no gradient (input_needs_grad "
                                << input_needs_grad << ")";
      EXPECT_TRUE(torch::equal(p.value().grad(), g2)) << p.key();
    }
    if (input_needs_grad) EXPECT_TRUE(torch::equal(x.grad(), x2.grad()));
  }
}

// A gradient penalty (a double backward) through a checkpointed region gives
// plain autograd's gradients, those of a layer before the region included:
// its second-order path runs through the region's input.
TEST(ActivationCheckpoint, GradientPenaltyThroughTheRegionAsPlainAutograd) {
  torch::manual_seed(0);
  nn::Linear before(kDim, kDim);
  DropBlock plain;
  torch::manual_seed(0);
  nn::Linear before2(kDim, kDim);
  CheckpointWrapper<DropBlockImpl> checkpointed{DropBlock()};
  const torch::Tensor data = torch::randn({5, kDim});
  const auto penalised = [&](nn::Linear& first, auto& block) {
    const torch::Tensor x = data.clone().requires_grad_(true);
    torch::manual_seed(42);
    const torch::Tensor y = block->forward(torch::tanh(first(x)));
    const torch::Tensor g =
        torch::autograd::grad({y.sum()}, {x}, {}, /*retain_graph=*/true, /*create_graph=*/true)[0];
    (y.square().mean() + g.pow(2).sum()).backward();
  };
  penalised(before, plain);
  penalised(before2, checkpointed);
  for (const auto& p : plain->named_parameters()) {
    const torch::Tensor& g2 = checkpointed->named_parameters()[p.key()].grad();
    EXPECT_TRUE(torch::allclose(p.value().grad(), g2, 1e-5, 1e-6)) << p.key();
  }
  for (const auto& p : before->named_parameters()) {
    EXPECT_TRUE(
        torch::allclose(p.value().grad(), before2->named_parameters()[p.key()].grad(), 1e-5, 1e-6))
        << "before." << p.key();
  }
}

// A module of `Holder` and its checkpointed twin, with the same weights.
template <typename Holder>
std::pair<Holder, CheckpointWrapper<typename Holder::ContainedType>> checkpointed_twins() {
  torch::manual_seed(0);
  Holder plain;
  torch::manual_seed(0);
  return {plain, CheckpointWrapper<typename Holder::ContainedType>{Holder()}};
}

// A region called with an undefined tensor (a forward's default mask, c10's
// "None") and returning one trains as without checkpointing.
struct MaskedImpl : nn::Module {
  MaskedImpl() { fc = register_module("fc", nn::Linear(kDim, kDim)); }
  std::tuple<torch::Tensor, torch::Tensor> forward(torch::Tensor x, torch::Tensor mask) {
    torch::Tensor y = torch::tanh(fc(x));
    if (mask.defined()) y = y * mask;
    return {y, mask.defined() ? y.square() : torch::Tensor()};
  }
  nn::Linear fc{nullptr};
};
TORCH_MODULE(Masked);

TEST(ActivationCheckpoint, UndefinedArgumentsAndOutputsAsWithoutCheckpointing) {
  for (const bool masked : {false, true}) {
    auto [plain, checkpointed] = checkpointed_twins<Masked>();
    const torch::Tensor x = torch::randn({5, kDim});
    const torch::Tensor mask = masked ? torch::rand({5, kDim}) : torch::Tensor();
    const auto [y, extra] = plain->forward(x, mask);
    const auto [y2, extra2] = checkpointed->forward(x, mask);
    ASSERT_EQ(extra2.defined(), masked);
    ((extra.defined() ? extra.sum() : torch::zeros({})) + y.sum()).backward();
    ((extra2.defined() ? extra2.sum() : torch::zeros({})) + y2.sum()).backward();
    EXPECT_TRUE(torch::equal(y, y2));
    EXPECT_TRUE(torch::allclose(plain->fc->weight.grad(), checkpointed->module().fc->weight.grad()))
        << "masked " << masked;
  }
}

// The recomputation runs under the autocast its forward ran under, as
// PyTorch's checkpoint does: backward usually runs outside autocast, where
// the second Linear would get the first's bfloat16 output with float weights.
TEST(ActivationCheckpoint, RecomputesUnderTheForwardsAutocast) {
  torch::manual_seed(0);
  nn::Linear a(kDim, kDim), b(kDim, kDim);
  torch::manual_seed(0);
  CheckpointWrapper<nn::LinearImpl> a2{nn::Linear(kDim, kDim)}, b2{nn::Linear(kDim, kDim)};
  const torch::Tensor x = torch::randn({5, kDim});
  compat::set_cpu_autocast(true);
  const torch::Tensor y = b(a(x));
  const torch::Tensor y2 = b2(a2(x));
  compat::set_cpu_autocast(false);
  ASSERT_EQ(y2.scalar_type(), at::kBFloat16);
  y.to(at::kFloat).square().sum().backward();
  y2.to(at::kFloat).square().sum().backward();
  EXPECT_FALSE(compat::autocast_state().cpu) << "the recomputation left autocast on";
  EXPECT_TRUE(torch::equal(a->weight.grad(), a2->module().weight.grad()));
  EXPECT_TRUE(torch::equal(b->weight.grad(), b2->module().weight.grad()));
}

// Tensors within c10::optional and std::vector arguments are inputs of the
// region: their gradients flow back as without checkpointing.
struct ConditionedImpl : nn::Module {
  ConditionedImpl() { fc = register_module("fc", nn::Linear(kDim, kDim)); }
  torch::Tensor forward(torch::Tensor x, c10::optional<torch::Tensor> cond,
                        std::vector<torch::Tensor> scales) {
    torch::Tensor y = fc(x);
    if (cond) y = y + *cond;
    for (const torch::Tensor& s : scales) y = y * s;
    return torch::tanh(y);
  }
  nn::Linear fc{nullptr};
};
TORCH_MODULE(Conditioned);

TEST(ActivationCheckpoint, TensorsWithinOptionalAndVectorArgumentsGetGradients) {
  auto [plain, checkpointed] = checkpointed_twins<Conditioned>();
  const torch::Tensor x = torch::randn({5, kDim});
  const auto grads_of = [&](auto& block) {
    const torch::Tensor cond = torch::randn({kDim}).requires_grad_(true);
    const torch::Tensor scale = torch::rand({kDim}).requires_grad_(true);
    block->forward(x, cond, std::vector<torch::Tensor>{scale}).sum().backward();
    return std::vector<torch::Tensor>{cond.grad(), scale.grad()};
  };
  torch::manual_seed(1);
  const auto expected = grads_of(plain);
  torch::manual_seed(1);
  const auto got = grads_of(checkpointed);
  for (size_t i = 0; i < expected.size(); ++i) {
    ASSERT_TRUE(got[i].defined()) << "argument " << i << " got no gradient";
    EXPECT_TRUE(torch::allclose(expected[i], got[i])) << "argument " << i;
  }
}

// An LSTM's state passed from one checkpointed chunk to the next (chunked
// backpropagation through time): the tensors within the tuple argument are
// inputs of the region, so the second chunk's gradient reaches the first
// chunk and the initial state as without checkpointing (they were copied
// as constants: the weights' gradients missed the second chunk's share).
TEST(ActivationCheckpoint, TensorsWithinTupleArgumentsGetGradients) {
  torch::manual_seed(0);
  nn::LSTM plain(nn::LSTMOptions(kDim, kDim));
  torch::manual_seed(0);
  CheckpointWrapper<nn::LSTMImpl> checkpointed{nn::LSTM(nn::LSTMOptions(kDim, kDim))};
  const torch::Tensor x = torch::randn({6, 2, kDim});
  const torch::Tensor h0 = torch::randn({1, 2, kDim});
  const torch::Tensor c0 = torch::randn({1, 2, kDim});
  const auto grads_of = [&](auto& lstm, nn::Module& module) {
    std::tuple<torch::Tensor, torch::Tensor> state{h0.clone().requires_grad_(true),
                                                   c0.clone().requires_grad_(true)};
    const auto first = state;
    torch::Tensor loss = torch::zeros({});
    for (int chunk = 0; chunk < 2; ++chunk) {
      auto [out, next] = lstm->forward(x.slice(0, 3 * chunk, 3 * chunk + 3), state);
      loss = loss + out.pow(2).sum();
      state = next;
    }
    loss.backward();
    std::vector<torch::Tensor> grads{std::get<0>(first).grad(), std::get<1>(first).grad()};
    for (const torch::Tensor& p : module.parameters()) grads.push_back(p.grad());
    return grads;
  };
  const auto expected = grads_of(plain, *plain);
  const auto got = grads_of(checkpointed, checkpointed->module());
  ASSERT_EQ(expected.size(), got.size());
  for (size_t i = 0; i < expected.size(); ++i) {
    ASSERT_TRUE(got[i].defined()) << "gradient " << i << " missing";
    EXPECT_TRUE(torch::allclose(expected[i], got[i], 1e-5, 1e-6)) << "gradient " << i;
  }
}

// A tuple whose elements are const references (a recurrent state passed
// without copies): the region keeps its own copies for the recomputation
// (it kept the references, which dangled once the caller's tensors were
// gone, and the referenced tensors got no gradient), whether the region is
// a CheckpointWrapper or a unit's own checkpointing.
struct RefStateImpl : nn::Module {
  RefStateImpl() { fc = register_module("fc", nn::Linear(kDim, kDim)); }
  torch::Tensor forward(torch::Tensor x,
                        std::tuple<const torch::Tensor&, const torch::Tensor&> state) {
    return torch::tanh(fc(x) * std::get<0>(state) + std::get<1>(state));
  }
  nn::Linear fc{nullptr};
};
TORCH_MODULE(RefState);

TEST(ActivationCheckpoint, ConstReferencesWithinTupleArgumentsAreCopiedAndGetGradients) {
  const torch::Tensor x = torch::randn({5, kDim});
  const torch::Tensor h0 = torch::randn({5, kDim}), c0 = torch::randn({5, kDim});
  // The gradients of h and c, then the parameters' (flattened and joined, as
  // a unit's flat shard holds them at world 1).
  const auto grads_of = [&](auto& block, const std::vector<torch::Tensor>& params) {
    const torch::Tensor h = h0.clone().requires_grad_(true), c = c0.clone().requires_grad_(true);
    torch::Tensor loss;
    {
      // Tensors the caller drops before backward.
      torch::Tensor hs = h * 2, cs = c * 3;
      loss = block->forward(x, std::tuple<const torch::Tensor&, const torch::Tensor&>(hs, cs))
                 .pow(2)
                 .sum();
    }
    loss.backward();
    std::vector<torch::Tensor> flat;
    for (const torch::Tensor& p : params) flat.push_back(p.grad().flatten());
    return std::vector<torch::Tensor>{h.grad(), c.grad(), torch::cat(flat)};
  };
  auto [plain, wrapped] = checkpointed_twins<RefState>();
  const auto expected = grads_of(plain, plain->parameters());
  run_ranks_ok(1, [&](int, int) {
    init_process_group(ProcessGroupOptions().timeout(std::chrono::seconds(30)));
    torch::manual_seed(0);
    FullyShardedDataParallel<RefStateImpl> unit{RefState(), FSDPOptions()};
    unit->set_activation_checkpointing(true);
    const std::vector<torch::Tensor> unit_grads = grads_of(unit, unit->flat_parameters());
    for (const auto& got : {grads_of(wrapped, wrapped->module().parameters()), unit_grads}) {
      ASSERT_EQ(expected.size(), got.size());
      for (size_t i = 0; i < expected.size(); ++i) {
        ASSERT_TRUE(got[i].defined()) << "gradient " << i << " missing";
        EXPECT_TRUE(torch::allclose(expected[i], got[i], 1e-5, 1e-6)) << "gradient " << i;
      }
    }
  });
}

// Autograd frees a region's saved input after backward; the region keeps
// no copy of it for as long as its graph lives (a loss kept for logging).
TEST(ActivationCheckpoint, InputsAreFreedAfterBackwardWhileTheLossLives) {
  CheckpointWrapper<DropBlockImpl> block{DropBlock()};
  const torch::Tensor x = torch::randn({4, kDim}).requires_grad_(true);
  torch::Tensor h = x * 2;
  const c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl> weak(
      h.getIntrusivePtr());
  const torch::Tensor loss = block->forward(h).sum();
  h.reset();
  loss.backward();
  EXPECT_TRUE(weak.expired()) << "the region's input outlived backward";
  EXPECT_TRUE(loss.defined());
}

// A module registered under two names (or a weight listed twice) gets its
// gradient once, as through plain autograd.
struct TwiceImpl : nn::Module {
  TwiceImpl() {
    lin = register_module("a", nn::Linear(kDim, kDim));
    register_module("again", lin);
  }
  torch::Tensor forward(torch::Tensor x) { return lin(torch::tanh(lin(x))); }
  nn::Linear lin{nullptr};
};
TORCH_MODULE(Twice);

TEST(ActivationCheckpoint, AModuleRegisteredTwiceGetsItsGradientOnce) {
  auto [plain, checkpointed] = checkpointed_twins<Twice>();
  ASSERT_EQ(plain->parameters().size(), 4U) << "LibTorch lists it twice";
  const torch::Tensor x = torch::randn({5, kDim});
  plain->forward(x).sum().backward();
  checkpointed->forward(x).sum().backward();
  EXPECT_TRUE(
      torch::allclose(plain->lin->weight.grad(), checkpointed->module().lin->weight.grad()));
}

TEST(ActivationCheckpoint, GeneratorStateIsRestoredAfterRecomputation) {
  torch::manual_seed(0);
  CheckpointWrapper<DropBlockImpl> block{DropBlock()};
  torch::Tensor y = block->forward(torch::randn({4, kDim}));
  torch::manual_seed(123);
  const torch::Tensor expected = torch::rand({4});
  torch::manual_seed(123);
  y.sum().backward();  // recomputes, drawing dropout masks from the saved state
  EXPECT_TRUE(torch::equal(torch::rand({4}), expected));
}

TEST(ActivationCheckpoint, TrackerShowsActivationMemoryFalling) {
  enable_memory_tracking();
  torch::set_num_threads(1);
  // Peak of a forward + backward beyond the parameters: the gradients and
  // the activations.
  int64_t grad_bytes = 0;
  auto peak_of_step = [&grad_bytes](bool checkpointed) {
    torch::manual_seed(0);
    Chain chain;
    for (int i = 0; i < 8; ++i) chain->push_back(DropBlock(256));
    nn::Sequential seq(chain.ptr());
    if (checkpointed) EXPECT_EQ(apply_activation_checkpointing(*chain, is_drop_block), 8);
    torch::Tensor x = torch::randn({512, 256});
    const int64_t base = memory_stats().current_bytes;
    reset_peak_memory_stats();
    chain->forward(x).square().mean().backward();
    grad_bytes = 0;
    for (const auto& p : chain->parameters()) grad_bytes += p.grad().numel() * 4;
    return memory_stats().peak_bytes - base;
  };
  const int64_t plain = peak_of_step(false) - grad_bytes;
  const int64_t checkpointed = peak_of_step(true) - grad_bytes;
  std::printf("activation memory at the peak of a step: plain %.1f MiB, checkpointed %.1f MiB\n",
              plain / 1048576.0, checkpointed / 1048576.0);
  EXPECT_LT(checkpointed, plain / 2) << "activations were kept";
}

TEST(ActivationCheckpoint, MatchesPlainLibTorchUnderEveryStrategyAndLayout) {
  for (const int world : {1, 2, 3}) {
    run_ranks_ok(world, [](int, int) {
      torch::set_num_threads(1);
      init_process_group(ProcessGroupOptions().timeout(std::chrono::seconds(30)));
      for (const Layout layout : {Layout::kInsideUnits, Layout::kAroundUnits,
                                  Layout::kEntriesInRootUnit, Layout::kNestedAroundUnits}) {
        for (const auto strategy : {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp,
                                    ShardingStrategy::kNoShard}) {
          train_and_compare(layout, FSDPOptions().sharding_strategy(strategy), 3);
        }
      }
      // Prefetching gathers earlier, never differently.
      train_and_compare(
          Layout::kInsideUnits,
          FSDPOptions().forward_prefetch(true).backward_prefetch(BackwardPrefetch::kBackwardPost),
          3);
    });
  }
}

// Nested matches under FSDP: a unit whose wrapped Chain matches checkpoints
// its forward, and the Linears inside it, entries of that Chain, become
// regions of their own within it (recomputed again in its backward); the
// head, an entry of the root, too. Trains as plain LibTorch on every rank's
// data with dropout, at 1-3 ranks under each strategy.
TEST(ActivationCheckpoint, NestedMatchesInsideAUnitTrainAsPlainLibTorch) {
  const auto make = [](const c10::optional<FSDPOptions>& unit) {
    torch::manual_seed(0);
    Chain inner;
    inner->push_back(nn::Linear(kDim, 2 * kDim));
    inner->push_back(nn::GELU());
    inner->push_back(nn::Dropout(0.3));
    inner->push_back(nn::Linear(2 * kDim, kDim));
    Chain chain;
    if (unit) {
      chain->push_back(FullyShardedDataParallel<ChainImpl>(inner, *unit));
    } else {
      chain->push_back(inner);
    }
    chain->push_back(nn::Linear(kDim, 4));
    return chain;
  };
  const auto is_chain_or_linear = [](const nn::Module& m) {
    return m.as<ChainImpl>() != nullptr || m.as<nn::LinearImpl>() != nullptr;
  };
  for (const int world : {1, 2, 3}) {
    run_ranks_ok(world, [&](int, int) {
      torch::set_num_threads(1);
      init_process_group(ProcessGroupOptions().timeout(std::chrono::seconds(30)));
      for (const auto strategy : {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp,
                                  ShardingStrategy::kNoShard}) {
        const FSDPOptions opts = FSDPOptions().sharding_strategy(strategy);
        const std::string what = std::string("nested matches ") + fsdp::to_string(strategy) +
                                 " world " + std::to_string(world);
        Chain reference = make(c10::nullopt);
        FullyShardedDataParallel<ChainImpl> model(make(opts), opts);
        EXPECT_EQ(apply_activation_checkpointing(*model, is_chain_or_linear), 4) << what;
        EXPECT_TRUE(unit_of(*model->module().ptr(0))->checkpoints_activations()) << what;
        torch::optim::AdamW ref_opt(reference->parameters(), torch::optim::AdamWOptions(1e-2));
        torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-2));
        for (int step = 0; step < 3; ++step) {
          step_and_compare(reference, ref_opt, model, opt, step, what);
        }
      }
    });
  }
}

// Without the gradient reduction the ranks' models drift apart: the parity
// test above would see it.
TEST(ActivationCheckpoint, ParityFailsWithoutTheReduction) {
  run_ranks_ok(2, [](int rank, int) {
    torch::set_num_threads(1);
    init_process_group(ProcessGroupOptions().timeout(std::chrono::seconds(30)));
    Chain reference = plain_chain();
    FullyShardedDataParallel<ChainImpl> model = sharded_chain(Layout::kInsideUnits, FSDPOptions());
    torch::optim::AdamW ref_opt(reference->parameters(), torch::optim::AdamWOptions(1e-2));
    torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-2));
    // The reference sees this rank's data only: what a missing reduction trains.
    ref_opt.zero_grad();
    rank_loss([&](torch::Tensor x) { return reference->forward(x); }, 0, rank).backward();
    ref_opt.step();
    opt.zero_grad();
    rank_loss([&](torch::Tensor x) { return model->forward(x); }, 0, rank).backward();
    opt.step();
    SummonFullParams full(*model);
    double diff = 0;
    for (const auto& p : reference->named_parameters()) {
      diff = std::max(diff,
                      (model->named_parameters()[p.key()] - p.value()).abs().max().item<double>());
    }
    EXPECT_GT(diff, 1e-4) << "a rank's own gradient alone gave the reduced result";
  });
}

// FULL_SHARD gathers each unit once in forward and once in backward, with
// or without checkpointing, nested regions too: the recomputation's gather
// is backward's.
TEST(ActivationCheckpoint, FullShardGathersNoMoreThanWithout) {
  run_ranks_ok(2, [](int rank, int) {
    torch::set_num_threads(1);
    auto group = init_process_group(ProcessGroupOptions().timeout(std::chrono::seconds(30)));
    auto gathered_per_step = [&](const char* layout) {
      auto counting = std::make_shared<CountingProcessGroup>(group);
      const auto opts = FSDPOptions().process_group(counting);
      FullyShardedDataParallel<ChainImpl> model =
          std::string(layout) == "none"
              ? FullyShardedDataParallel<ChainImpl>(make_chain(opts, 0), opts)
          : std::string(layout) == "inside" ? sharded_chain(Layout::kInsideUnits, opts)
          : std::string(layout) == "nested" ? sharded_chain(Layout::kNestedAroundUnits, opts)
                                            : sharded_chain(Layout::kAroundUnits, opts);
      rank_loss([&](torch::Tensor x) { return model->forward(x); }, 0, rank).backward();
      const int64_t before = counting->gathered_bytes;
      rank_loss([&](torch::Tensor x) { return model->forward(x); }, 1, rank).backward();
      return counting->gathered_bytes - before;
    };
    const int64_t none = gathered_per_step("none");
    EXPECT_GT(none, 0);
    EXPECT_EQ(gathered_per_step("inside"), none);
    EXPECT_EQ(gathered_per_step("around"), none);
    // A region within a region: its units' recomputation is the outer one's.
    EXPECT_EQ(gathered_per_step("nested"), none);
  });
}

// The function form around a unit, its params the unit's parameters() (the
// wrapper's flat shards, which the function does not read), trained nothing
// silently: refused on every rank, naming the fix. Given the wrapped
// module's own parameters, it trains.
struct FunctionFormImpl : nn::Module {
  FunctionFormImpl(const FSDPOptions& opts, bool pass_shards) : pass_shards(pass_shards) {
    inner = register_module("inner", FullyShardedDataParallel<DropBlockImpl>(DropBlock(), opts));
  }
  torch::Tensor forward(torch::Tensor x) {
    const auto params = pass_shards ? inner->parameters() : inner->module().parameters();
    const auto fn = [this](const std::vector<torch::Tensor>& in) {
      return std::vector<torch::Tensor>{inner(in[0])};
    };
    return activation_checkpoint(fn, {x}, params)[0];
  }
  FullyShardedDataParallel<DropBlockImpl> inner{nullptr};
  bool pass_shards;
};

TEST(ActivationCheckpoint, TheFunctionFormRefusesAUnitsFlatShardsAsParams) {
  run_ranks_ok(2, [](int, int) {
    init_process_group(ProcessGroupOptions().timeout(std::chrono::seconds(30)));
    for (const bool orig : {false, true}) {
      const auto opts = FSDPOptions().use_orig_params(orig);
      FullyShardedDataParallel<FunctionFormImpl> bad(std::make_shared<FunctionFormImpl>(opts, true),
                                                     opts);
      const std::string msg = error_of([&] {
        bad->forward(torch::randn({6, kDim})).sum().backward();
      });
      EXPECT_CONTAINS(msg, "activation_checkpoint's params hold FSDP unit");
      EXPECT_CONTAINS(msg, "unit->module().parameters()");
      FullyShardedDataParallel<FunctionFormImpl> good(
          std::make_shared<FunctionFormImpl>(opts, false), opts);
      good->forward(torch::randn({6, kDim})).sum().backward();
      // A unit fully_shard made (entered by the dispatcher, not a wrapper's
      // forward), given its own shards.
      auto block = std::make_shared<DropBlockImpl>();
      Unit& unit = fully_shard(*block, opts);
      const auto through_block = [&](const std::vector<torch::Tensor>& in) {
        return std::vector<torch::Tensor>{block->forward(in[0])};
      };
      EXPECT_CONTAINS(error_of([&] {
                        activation_checkpoint(through_block, {torch::randn({6, kDim})},
                                              unit.flat_parameters())[0]
                            .sum()
                            .backward();
                      }),
                      "flat shard (the Unit's flat_parameters()), which the checkpointed function "
                      "does not read");
      // The shards (or use_orig_params' pieces, but those this rank holds
      // nothing of) the optimizer steps.
      for (const auto& shard : good->parameters()) {
        if (shard.numel() == 0) continue;
        EXPECT_TRUE(shard.grad().defined() && shard.grad().abs().sum().item<double>() > 0)
            << (orig ? "use_orig_params" : "flat");
      }
    }
  });
}

TEST(ActivationCheckpoint, TypedMembersAreRefusedAndNothingChanges) {
  Chain chain;
  chain->push_back(DropBlock());
  chain->push_back(Holder(DropBlock(), c10::nullopt));
  const std::string error =
      error_of([&] { apply_activation_checkpointing(*chain, is_drop_block); });
  EXPECT_NE(error.find("fsdp(apply_activation_checkpointing): cannot checkpoint '1.inner'"),
            std::string::npos)
      << error;
  EXPECT_NE(error.find("fsdp::CheckpointWrapper<Impl>"), std::string::npos) << error;
  EXPECT_NE(std::dynamic_pointer_cast<DropBlockImpl>(chain->ptr(0)), nullptr)
      << "entry 0 was replaced despite the error";
}

// The walk of PyTorch's apply_activation_checkpointing (_recursive_wrap with
// only_wrap_children): the root is never checkpointed (a check_fn true for
// every module works, as PyTorch's default does), matches are taken
// innermost first and a match inside a match is checkpointed too; a second
// call changes nothing. Nested regions give plain autograd's gradients,
// dropout included.
TEST(ActivationCheckpoint, TheWalkIsPyTorchsRootExcludedNestedMatchesTaken) {
  const auto make = [] {
    torch::manual_seed(0);
    Chain inner;
    inner->push_back(nn::Linear(kDim, kDim));
    inner->push_back(nn::Functional(torch::tanh));
    inner->push_back(nn::Dropout(0.3));
    inner->push_back(nn::Linear(kDim, kDim));
    Chain root;
    root->push_back(inner);
    root->push_back(nn::Linear(kDim, 4));
    return root;
  };
  Chain plain = make();
  Chain checkpointed = make();
  const auto is_chain_or_linear = [](const nn::Module& m) {
    return m.as<ChainImpl>() != nullptr || m.as<nn::LinearImpl>() != nullptr;
  };
  // The inner Linears, then the inner Chain around them, then the head.
  EXPECT_EQ(apply_activation_checkpointing(*checkpointed, is_chain_or_linear), 4);
  const auto outer = std::dynamic_pointer_cast<AnyCheckpointWrapperImpl>(checkpointed->ptr(0));
  ASSERT_NE(outer, nullptr) << "the inner Chain was not checkpointed";
  auto* inner = dynamic_cast<ChainImpl*>(&outer->original_module());
  ASSERT_NE(inner, nullptr);
  EXPECT_NE(std::dynamic_pointer_cast<AnyCheckpointWrapperImpl>(inner->ptr(0)), nullptr)
      << "a match inside a match was skipped";
  EXPECT_NE(std::dynamic_pointer_cast<AnyCheckpointWrapperImpl>(checkpointed->ptr(1)), nullptr);
  EXPECT_EQ(checkpointed->named_parameters().keys(), plain->named_parameters().keys());
  EXPECT_EQ(apply_activation_checkpointing(*checkpointed, is_chain_or_linear), 0)
      << "a second call checkpointed again";

  const torch::Tensor x = torch::randn({6, kDim});
  torch::manual_seed(7);
  plain->forward(x).square().sum().backward();
  torch::manual_seed(7);
  checkpointed->forward(x).square().sum().backward();
  for (const auto& p : plain->named_parameters()) {
    const torch::Tensor& g = checkpointed->named_parameters()[p.key()].grad();
    ASSERT_TRUE(g.defined()) << p.key();
    EXPECT_TRUE(torch::allclose(p.value().grad(), g, 1e-6, 1e-7)) << p.key();
  }

  // Every module but the root, as PyTorch's default check_fn (the root,
  // never asked, used to be matched and, having no parent to be replaced
  // in, refused).
  Chain all = make();
  EXPECT_EQ(apply_activation_checkpointing(*all, [](const nn::Module&) { return true; }), 6);
}

// The policy form (PyTorch's auto_wrap_policy argument) asks as PyTorch's
// _recursive_wrap does: children first, then the parent with what its
// checkpointed children leave, so a size policy checkpoints a parent only
// for its own remainder.
TEST(ActivationCheckpoint, ThePolicyFormAsksForTheRemainderAfterTheChildren) {
  const auto make = [] {
    Chain inner;
    inner->push_back(nn::Linear(8, 8));  // 72 parameters
    inner->push_back(nn::Linear(8, 8));
    Chain root;
    root->push_back(inner);  // 144
    root->push_back(nn::Linear(8, 8));
    return root;
  };
  const auto wrapped = [](const std::shared_ptr<nn::Module>& m) {
    return std::dynamic_pointer_cast<AnyCheckpointWrapperImpl>(m) != nullptr;
  };
  Chain large = make();
  EXPECT_EQ(apply_activation_checkpointing(*large, MinParamsPolicy(100)), 1);
  EXPECT_TRUE(wrapped(large->ptr(0))) << "the inner Chain (144 parameters) was left out";
  EXPECT_FALSE(wrapped(large->ptr(1)));
  Chain small = make();
  EXPECT_EQ(apply_activation_checkpointing(*small, MinParamsPolicy(50)), 3);
  ASSERT_FALSE(wrapped(small->ptr(0)))
      << "the inner Chain was checkpointed for parameters its Linears hold";
  EXPECT_TRUE(wrapped(small->ptr(0)->as<ChainImpl>()->ptr(1)));
  EXPECT_TRUE(wrapped(small->ptr(1)));
  Chain typed = make();
  EXPECT_EQ(apply_activation_checkpointing(*typed, module_type_policy<ChainImpl>()), 1);
  EXPECT_TRUE(wrapped(typed->ptr(0)));
}

TEST(ActivationCheckpoint, AWrapperAroundAUnitItselfIsRefused) {
  run_ranks_ok(1, [](int, int) {
    init_process_group(ProcessGroupOptions().timeout(std::chrono::seconds(30)));
    FullyShardedDataParallel<DropBlockImpl> unit{DropBlock(), FSDPOptions()};
    const std::string error = error_of(
        [&] { CheckpointWrapper<FullyShardedDataParallelImpl<DropBlockImpl>> wrapper(unit); });
    EXPECT_NE(error.find("set_activation_checkpointing"), std::string::npos) << error;
  });
}

// Arguments made of references in other shapes: a vector of tuples of
// const references, a tuple of non-const references (both refused or not
// compiling in a first version), a const reference to a tuple, and a
// reference to an object that cannot be copied (kept a reference, never
// copied). Checkpointed, in a unit and in a CheckpointWrapper, they give
// the gradients the forward gives without checkpointing.
struct Scale {
  Scale() = default;
  Scale(const Scale&) = delete;
  double factor = 0.5;
};
struct RefListImpl : nn::Module {
  RefListImpl() { fc = register_module("fc", nn::Linear(kDim, kDim)); }
  torch::Tensor forward(std::vector<std::tuple<const torch::Tensor&, const Scale&>> xs,
                        std::tuple<torch::Tensor&> bias,
                        const std::tuple<const torch::Tensor&>& g) {
    torch::Tensor y = std::get<0>(bias) * std::get<0>(g);
    for (const auto& x : xs) y = y + torch::tanh(fc(std::get<0>(x))) * std::get<1>(x).factor;
    return y;
  }
  nn::Linear fc{nullptr};
};
TORCH_MODULE(RefList);

TEST(ActivationCheckpoint, ArgumentsOfReferencesInOtherShapesGetGradients) {
  const torch::Tensor x0 = torch::randn({2, kDim}), b0 = torch::randn({kDim}),
                      g0 = torch::randn({kDim});
  const Scale scale;
  const auto grads_of = [&](auto& block) {
    const torch::Tensor x = x0.clone().requires_grad_(true), b = b0.clone().requires_grad_(true),
                        g = g0.clone().requires_grad_(true);
    torch::Tensor loss;
    {
      torch::Tensor x2 = x * 2, bias = b * 1;
      std::vector<std::tuple<const torch::Tensor&, const Scale&>> xs{{x, scale}, {x2, scale}};
      loss =
          block->forward(xs, std::tuple<torch::Tensor&>(bias), std::tuple<const torch::Tensor&>(g))
              .pow(2)
              .sum();
    }
    loss.backward();
    return std::vector<torch::Tensor>{x.grad(), b.grad(), g.grad()};
  };
  torch::manual_seed(0);
  RefList plain;
  torch::manual_seed(0);
  CheckpointWrapper<RefListImpl> wrapped{RefList()};
  const auto expected = grads_of(plain);
  run_ranks_ok(1, [&](int, int) {
    init_process_group(ProcessGroupOptions().timeout(std::chrono::seconds(30)));
    torch::manual_seed(0);
    FullyShardedDataParallel<RefListImpl> unit{RefList(), FSDPOptions()};
    unit->set_activation_checkpointing(true);
    const auto unit_grads = grads_of(unit);
    for (const auto& got : {grads_of(wrapped), unit_grads}) {
      for (size_t i = 0; i < expected.size(); ++i) {
        ASSERT_TRUE(got[i].defined()) << "gradient " << i << " missing";
        EXPECT_TRUE(torch::allclose(expected[i], got[i], 1e-5, 1e-6)) << "gradient " << i;
      }
    }
  });
}

}  // namespace test_activation_checkpointing
}  // namespace fsdp::testing
