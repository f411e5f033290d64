// Mixed precision (issue 4): bf16 training under FSDP against the same bf16
// computation in plain LibTorch (fp32 master weights cast to bf16 for the
// forward, bf16 gradients averaged over the ranks in bf16, cast to fp32 for
// the SGD step), within bf16 tolerance over 5 steps; the full-precision shards
// keep their dtype; the all-gather moves half the bytes of fp32.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
#include <string>
#include <vector>

#include <fsdp/fsdp.h>

#include "bf16_parity.h"
#include "comm/counting_process_group.h"
#include "core/flat_parameter.h"
#include "error_of.h"
#include "multi_rank.h"
#include "test_models.h"

namespace fsdp::testing {
namespace test_mixed_precision {

namespace nn = torch::nn;

using CountingGroup = CountingProcessGroup;

using bf16_parity::batch;
using bf16_parity::expected_shard;
using bf16_parity::loss_of;
using bf16_parity::make_model;
using bf16_parity::reference_training;

TEST(MixedPrecision, Bf16TrainingMatchesPlainBf16Computation) {
  run_ranks_ok(2, [](int rank, int world) {
    torch::set_num_threads(1);
    auto group = init_process_group(ProcessGroupOptions().timeout(std::chrono::seconds(30)));
    constexpr int kSteps = 5;
    int64_t bf16_bytes = 0;
    bf16_parity::expect_bf16_matches_reference(group, rank, world, torch::kCPU, &bf16_bytes);

    // The same steps in fp32 (FULL_SHARD) all-gather twice the bytes.
    auto counting32 = std::make_shared<CountingGroup>(group);
    nn::Sequential model32 = make_model();
    const auto o32 = FSDPOptions().process_group(counting32).check_forward_order(false);
    auto_wrap(model32, module_type_policy<nn::LinearImpl>(), o32);
    FullyShardedDataParallel<nn::SequentialImpl> root32(model32, o32);
    for (int step = 0; step < kSteps; ++step) {
      loss_of(root32->forward(batch(step, rank))).backward();
    }
    EXPECT_EQ(bf16_bytes * 2, counting32->gathered_bytes);
  });
}

TEST(MixedPrecision, KeepLowPrecisionGradsAndReduceDtype) {
  run_ranks_ok(2, [](int rank, int) {
    torch::set_num_threads(1);
    auto group = init_process_group(ProcessGroupOptions().timeout(std::chrono::seconds(30)));
    for (const bool keep : {false, true}) {
      auto counting = std::make_shared<CountingGroup>(group);
      nn::Sequential model = make_model();
      const auto o = FSDPOptions().process_group(counting).mixed_precision(
          MixedPrecision()
              .param_dtype(torch::kBFloat16)
              .reduce_dtype(torch::kFloat32)
              .keep_low_precision_grads(keep));
      FullyShardedDataParallel<nn::SequentialImpl> root(model, o);
      loss_of(root->forward(batch(0, rank))).backward();
      ASSERT_EQ(counting->reduced_dtypes().size(), 1u);
      EXPECT_EQ(counting->reduced_dtypes()[0], torch::kFloat32);
      // As PyTorch's FSDP1: kept in param_dtype, not reduce_dtype.
      EXPECT_EQ(root->flat_param()->shard().grad().scalar_type(),
                keep ? torch::kBFloat16 : torch::kFloat32);
    }
    // reduce_dtype bf16 with keep_low_precision_grads: the shard's gradient stays bf16.
    nn::Sequential model = make_model();
    const auto o = FSDPOptions().mixed_precision(
        MixedPrecision().param_dtype(torch::kBFloat16).keep_low_precision_grads(true));
    FullyShardedDataParallel<nn::SequentialImpl> root(model, o);
    loss_of(root->forward(batch(0, rank))).backward();
    EXPECT_EQ(root->flat_param()->shard().grad().scalar_type(), torch::kBFloat16);
    EXPECT_EQ(root->flat_param()->shard().scalar_type(), torch::kFloat32);
    group->barrier().wait();
  });
}

// A float16 average whose terms fit but whose sum does not (two ranks'
// gradients of 40000, as under a GradScaler's scale) is the average, not
// inf, whatever the sharding (Note [Averaging float16 gradients]).
struct ScaleImpl : nn::Module {
  ScaleImpl() { w = register_parameter("w", torch::ones({8})); }
  torch::Tensor forward(torch::Tensor x) { return x * w; }
  torch::Tensor w;
};
TORCH_MODULE(Scale);

TEST(MixedPrecision, Float16AveragesWhoseSumOverflowsAreTheAverage) {
  run_ranks_ok(2, [](int rank, int) {
    torch::set_num_threads(1);
    init_process_group(ProcessGroupOptions().timeout(std::chrono::seconds(30)));
    for (const auto strategy : {ShardingStrategy::kFullShard, ShardingStrategy::kNoShard}) {
      const auto o = FSDPOptions().sharding_strategy(strategy).mixed_precision(
          MixedPrecision().param_dtype(torch::kHalf));
      FullyShardedDataParallel<ScaleImpl> root(Scale(), o);
      // d(sum)/dw = x: 40000 on rank 0, 32000 on rank 1 (sum 72000 > 65504;
      // the average, 36000, is a float16).
      root->forward(torch::full({8}, rank == 0 ? 40000.0 : 32000.0)).sum().backward();
      const torch::Tensor grad = root->flat_param()->shard().grad();
      ASSERT_TRUE(grad.defined());
      EXPECT_TRUE(
          torch::all(grad.narrow(0, 0, std::min<int64_t>(grad.numel(), 8)) == 36000.0).item<bool>())
          << to_string(strategy) << ": " << grad;
    }
  });
}

// cast_forward_inputs casts every unit's inputs, the root's too, as PyTorch's
// FSDP does (its _pre_forward runs for the root as well; a review found the
// root's left in float32 with cast_root_forward_inputs(false), where a
// bf16 Linear then refuses them); with neither option the root's stay.
TEST(MixedPrecision, CastForwardInputsCastsTheRootsToo) {
  run_ranks_ok(2, [](int, int) {
    init_process_group(ProcessGroupOptions().timeout(std::chrono::seconds(30)));
    const auto bf16 = MixedPrecision().param_dtype(torch::kBFloat16);
    const auto x = torch::randn({2, 6});
    const auto every = FSDPOptions().mixed_precision(
        MixedPrecision(bf16).cast_forward_inputs(true).cast_root_forward_inputs(false));
    FullyShardedDataParallel<nn::LinearImpl> cast(nn::Linear(6, 3), every);
    EXPECT_EQ(cast->forward(x).scalar_type(), torch::kBFloat16);
    const auto neither = FSDPOptions().mixed_precision(
        MixedPrecision(bf16).cast_forward_inputs(false).cast_root_forward_inputs(false));
    FullyShardedDataParallel<nn::LinearImpl> uncast(nn::Linear(6, 3), neither);
    EXPECT_THROW(uncast->forward(x), c10::Error);
    const auto root_only = FSDPOptions().mixed_precision(bf16);  // PyTorch's defaults
    FullyShardedDataParallel<nn::LinearImpl> root(nn::Linear(6, 3), root_only);
    EXPECT_EQ(root->forward(x).scalar_type(), torch::kBFloat16);
  });
}

// MixedPrecision::output_dtype (FSDP2's): the root's bf16 output comes back
// in float32, as the tensors of a tuple output do, and backward goes through
// the cast; the units inside, given no output_dtype, hand bf16 on. fully_shard
// refuses it, naming why, before anything changes.
struct TwoOutImpl : nn::Module {
  TwoOutImpl(const FSDPOptions& inner) {
    fc = register_module("fc", FullyShardedDataParallel<nn::LinearImpl>(nn::Linear(6, 6), inner));
    head = register_module("head", nn::Linear(6, 3));
  }
  std::tuple<torch::Tensor, torch::Tensor> forward(torch::Tensor x) {
    const torch::Tensor h = fc(x);
    inner_dtype = h.scalar_type();
    return {head(h), h};
  }
  FullyShardedDataParallel<nn::LinearImpl> fc{nullptr};
  nn::Linear head{nullptr};
  torch::ScalarType inner_dtype = torch::kFloat;
};

TEST(MixedPrecision, OutputDtypeCastsTheOutputOfTheUnitsGivenIt) {
  run_ranks_ok(2, [](int, int) {
    init_process_group(ProcessGroupOptions().timeout(std::chrono::seconds(30)));
    const auto bf16 = MixedPrecision().param_dtype(torch::kBFloat16);
    const auto inner = FSDPOptions().mixed_precision(bf16);
    const auto outer =
        FSDPOptions().mixed_precision(MixedPrecision(bf16).output_dtype(torch::kFloat));
    FullyShardedDataParallel<TwoOutImpl> model(std::make_shared<TwoOutImpl>(inner), outer);
    const auto [logits, hidden] = model->forward(torch::randn({4, 6}));
    EXPECT_EQ(logits.scalar_type(), torch::kFloat);
    EXPECT_EQ(hidden.scalar_type(), torch::kFloat);
    EXPECT_EQ(model->module().inner_dtype, torch::kBFloat16);
    logits.sum().backward();
    for (const auto& p : model->parameters()) {
      EXPECT_TRUE(p.grad().defined() && p.grad().abs().sum().item<double>() > 0);
    }
    nn::Linear plain(6, 3);
    const std::string refused = error_of([&] { fully_shard(plain, outer); });
    EXPECT_NE(refused.find("expected MixedPrecision::output_dtype unset for fully_shard"),
              std::string::npos)
        << refused;
    EXPECT_EQ(unit_of(*plain), nullptr);
  });
}

// A unit casts the tensors within tuple, pair, vector and optional
// arguments to the compute dtype, as PyTorch's FSDP casts nested inputs (a
// recurrent state passed as a tuple reached the bf16 module in float32).
struct StatefulImpl : nn::Module {
  StatefulImpl() { fc = register_module("fc", nn::Linear(6, 6)); }
  torch::Tensor forward(torch::Tensor x,
                        std::tuple<torch::Tensor, std::pair<torch::Tensor, int64_t>> state,
                        c10::optional<std::vector<torch::Tensor>> extra) {
    seen = {std::get<0>(state).scalar_type(), std::get<1>(state).first.scalar_type(),
            extra->at(0).scalar_type()};
    return fc(x) + std::get<0>(state) * std::get<1>(state).second;
  }
  nn::Linear fc{nullptr};
  std::vector<torch::ScalarType> seen;
};
TORCH_MODULE(Stateful);

// A tuple element that is a const reference is cast as a copy the tuple's
// reference points into (it was passed uncast: float32 reached bf16 weights);
// a non-const reference is passed as it is, since a cast would not be the
// caller's tensor (this did not compile).
struct RefTupleImpl : nn::Module {
  RefTupleImpl() { fc = register_module("fc", nn::Linear(6, 6)); }
  torch::Tensor forward(std::tuple<const torch::Tensor&, torch::Tensor> xs) {
    seen = {std::get<0>(xs).scalar_type(), std::get<1>(xs).scalar_type()};
    return fc(std::get<1>(xs));
  }
  nn::Linear fc{nullptr};
  std::vector<torch::ScalarType> seen;
};
TORCH_MODULE(RefTuple);
struct MutableRefTupleImpl : nn::Module {
  MutableRefTupleImpl() { fc = register_module("fc", nn::Linear(6, 6)); }
  torch::Tensor forward(std::tuple<torch::Tensor&> xs) {
    seen = {std::get<0>(xs).scalar_type()};
    return fc(std::get<0>(xs).to(fc->weight.scalar_type()));
  }
  nn::Linear fc{nullptr};
  std::vector<torch::ScalarType> seen;
};
TORCH_MODULE(MutableRefTuple);

TEST(MixedPrecision, TensorsWithinNestedArgumentsAreCast) {
  run_ranks_ok(1, [](int, int) {
    init_process_group(ProcessGroupOptions().timeout(std::chrono::seconds(30)));
    const auto bf16 = MixedPrecision().param_dtype(torch::kBFloat16);
    FullyShardedDataParallel<StatefulImpl> unit(Stateful(), FSDPOptions().mixed_precision(bf16));
    const torch::Tensor out = unit->forward(
        torch::randn({2, 6}),
        std::make_tuple(torch::randn({2, 6}), std::make_pair(torch::randn({2}), int64_t{3})),
        std::vector<torch::Tensor>{torch::randn({2})});
    EXPECT_EQ(out.scalar_type(), torch::kBFloat16);
    EXPECT_EQ(unit->module().seen, std::vector<torch::ScalarType>(3, torch::kBFloat16));
    FullyShardedDataParallel<RefTupleImpl> refs(RefTuple(), FSDPOptions().mixed_precision(bf16));
    const torch::Tensor x = torch::randn({2, 6});
    refs->forward(std::tuple<const torch::Tensor&, torch::Tensor>(x, x));
    EXPECT_EQ(refs->module().seen, std::vector<torch::ScalarType>(2, torch::kBFloat16));
    FullyShardedDataParallel<MutableRefTupleImpl> mutable_refs(MutableRefTuple(),
                                                               FSDPOptions().mixed_precision(bf16));
    torch::Tensor y = torch::randn({2, 6});
    mutable_refs->forward(std::tuple<torch::Tensor&>(y));
    EXPECT_EQ(y.scalar_type(), torch::kFloat) << "the caller's tensor was replaced";
    EXPECT_EQ(mutable_refs->module().seen, std::vector<torch::ScalarType>{torch::kFloat});
  });
}

// A unit kept in full precision inside a bf16 model (module_classes_to_ignore)
// casts the tensors within its nested arguments to float32 and those of a
// tuple output back to its inputs' dtype, as FSDP1's hooks do (a review
// found only a plain Tensor output cast back, and the dtype read from plain
// Tensor arguments only: bf16 reached the float32 layer).
struct PairOutImpl : nn::Module {
  PairOutImpl() { fc = register_module("fc", nn::Linear(6, 6)); }
  std::tuple<torch::Tensor, std::vector<torch::Tensor>> forward(
      std::pair<torch::Tensor, torch::Tensor> xs) {
    seen = {xs.first.scalar_type(), xs.second.scalar_type()};
    return {fc(xs.first), {fc(xs.second)}};
  }
  nn::Linear fc{nullptr};
  std::vector<torch::ScalarType> seen;
};
TORCH_MODULE(PairOut);

TEST(MixedPrecision, FullPrecisionUnitsCastNestedInputsAndOutputs) {
  run_ranks_ok(1, [](int, int) {
    init_process_group(ProcessGroupOptions().timeout(std::chrono::seconds(30)));
    const auto bf16 = MixedPrecision()
                          .param_dtype(torch::kBFloat16)
                          .module_classes_to_ignore({module_class<PairOutImpl>()});
    FullyShardedDataParallel<PairOutImpl> unit(PairOut(), FSDPOptions().mixed_precision(bf16));
    ASSERT_TRUE(unit->casts_output_back());
    const torch::Tensor x = torch::randn({2, 6}).to(torch::kBFloat16);
    const auto [out, outs] = unit->forward(std::make_pair(x, x));
    EXPECT_EQ(unit->module().seen, std::vector<torch::ScalarType>(2, torch::kFloat));
    EXPECT_EQ(out.scalar_type(), torch::kBFloat16);
    ASSERT_EQ(outs.size(), 1u);
    EXPECT_EQ(outs[0].scalar_type(), torch::kBFloat16);
  });
}

}  // namespace test_mixed_precision
}  // namespace fsdp::testing
