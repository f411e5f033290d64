// Misuse of a wrapped model is an error naming the parameter and the fix, on
// every rank (Note [Sharded placeholders]): calling a sharded unit's inner
// module directly, and an optimizer built on the unwrapped parameters.

#include <ATen/Context.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>
#include <string>

#include <fsdp/fsdp.h>

#include "error_of.h"
#include "multi_rank.h"
#include "test_models.h"

namespace fsdp::testing {
namespace test_misuse {

namespace nn = torch::nn;

struct TwoLayerImpl : nn::Module {
  explicit TwoLayerImpl(const FSDPOptions& o) {
    plain = nn::Linear(6, 6);
    fc = register_module("fc", FullyShardedDataParallel<nn::LinearImpl>(plain, o));
    head = register_module("head", nn::Linear(6, 2));
  }
  torch::Tensor forward(torch::Tensor x) { return head(torch::relu(fc(x))); }
  nn::Linear plain{nullptr};  // the user's own handle on the wrapped Linear
  FullyShardedDataParallel<nn::LinearImpl> fc{nullptr};
  nn::Linear head{nullptr};
};
TORCH_MODULE(TwoLayer);

TEST(Misuse, CallingAShardedUnitsInnerModuleIsAnErrorNamingIt) {
  run_ranks_ok(2, [](int, int) {
    init_process_group(ProcessGroupOptions().timeout(std::chrono::seconds(30)));
    torch::manual_seed(0);
    auto o = FSDPOptions();
    FullyShardedDataParallel<TwoLayerImpl> model(TwoLayer(o), o);
    torch::Tensor x = torch::randn({3, 6});
    // Before the first forward the unit's path is not known yet.
    std::string before = error_of([&] { model->module().plain(x); });
    EXPECT_CONTAINS(before, "parameter 'weight' of an FSDP unit");
    EXPECT_CONTAINS(before, "call the FullyShardedDataParallel wrapper");

    model->forward(x).sum().backward();
    // Through the wrapper's module() and through the user's own holder.
    for (const std::string& msg : {error_of([&] { model->module().fc->module().forward(x); }),
                                   error_of([&] { model->module().plain(x); })}) {
      EXPECT_CONTAINS(msg, "parameter 'weight' of FSDP unit 'fc'");
      EXPECT_CONTAINS(msg, "is sharded");
      EXPECT_CONTAINS(msg, "fsdp::SummonFullParams");
    }
    // Reading the parameter is the same mistake; reading its metadata is not.
    EXPECT_CONTAINS(error_of([&] { model->module().plain->weight.sum(); }), "aten::sum");
    EXPECT_EQ(model->module().plain->weight.sizes(), torch::IntArrayRef({6, 6}));
    EXPECT_TRUE(model->module().plain->weight.requires_grad());

    // The right ways still work: the wrapper, and full parameters on demand.
    torch::Tensor y = model->forward(x);
    EXPECT_EQ(y.sizes(), torch::IntArrayRef({3, 2}));
    SummonFullParams full(*model.ptr());
    torch::Tensor direct = model->module().plain(x);
    EXPECT_EQ(direct.sizes(), torch::IntArrayRef({3, 6}));
  });
}

// Calls f(model, inner, unwrapped, strategy) for a wrapped TwoLayer under
// each strategy; `unwrapped` are its parameters taken before wrapping (the
// user's mistake).
template <typename F>
void for_each_wrapped_two_layer(const F& f) {
  for (auto strategy :
       {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp, ShardingStrategy::kNoShard}) {
    SCOPED_TRACE(to_string(strategy));
    torch::manual_seed(0);
    auto o = FSDPOptions().sharding_strategy(strategy);
    TwoLayer inner(o);
    std::vector<torch::Tensor> unwrapped = inner->parameters();
    FullyShardedDataParallel<TwoLayerImpl> model(inner, o);
    f(model, inner, unwrapped, strategy);
  }
}

TEST(Misuse, AnOptimizerOnTheUnwrappedParametersIsAnErrorNamingTheFix) {
  run_ranks_ok(2, [](int, int) {
    init_process_group(ProcessGroupOptions().timeout(std::chrono::seconds(30)));
    for_each_wrapped_two_layer([](FullyShardedDataParallel<TwoLayerImpl>& model, TwoLayer& inner,
                                  const std::vector<torch::Tensor>& unwrapped,
                                  ShardingStrategy strategy) {
      torch::optim::SGD wrong(unwrapped, torch::optim::SGDOptions(0.1).momentum(0.9));
      torch::optim::Adam also_wrong(inner->fc->module().parameters(), torch::optim::AdamOptions());
      torch::Tensor x = torch::randn({3, 6});
      model->forward(x).sum().backward();
      // zero_grad() fails at once (LibTorch 2.x's default would otherwise
      // drop the moved gradients, and step() would skip them silently) ...
      std::string msg = error_of([&] { wrong.zero_grad(); });
      EXPECT_CONTAINS(msg, "Optimizer::zero_grad() read the gradient of '");
      EXPECT_CONTAINS(msg, "built on the unwrapped module's parameters");
      EXPECT_CONTAINS(msg, "wrapped model's parameters()");
      // ... and so does a step without it.
      msg = error_of([&] { wrong.step(); });
      EXPECT_CONTAINS(msg, "read the gradient of '");
      EXPECT_CONTAINS(msg, "built on the unwrapped module's parameters");
      EXPECT_CONTAINS(msg, "wrapped model's parameters()");
      // Adam reads the (sharded) parameter before its gradient.
      msg = error_of([&] { also_wrong.step(); });
      EXPECT_CONTAINS(msg, strategy == ShardingStrategy::kNoShard ? "gradient of 'fc.weight'"
                                                                  : "of FSDP unit 'fc'");
      EXPECT_CONTAINS(msg, "wrapped model's parameters()");
      // LibTorch's clipping of the unwrapped parameters is the one use of
      // their moved gradients that works: it sees the whole gradients (Note
      // [LibTorch's clipping of a unit made in place]), as the root's does.
      const double libtorch = nn::utils::clip_grad_norm_(unwrapped, 1e9);
      EXPECT_NEAR(libtorch, model->clip_grad_norm_(1e9), 1e-6 * libtorch);
      // AdamW's weight decay writes the parameter before reading its
      // gradient: the write's error names the optimizer too.
      torch::optim::AdamW decays(model->named_parameters().values(),
                                 torch::optim::AdamWOptions().weight_decay(0.1));
      if (strategy != ShardingStrategy::kNoShard) {
        msg = error_of([&] { decays.step(); });
        EXPECT_CONTAINS(msg, "If an optimizer's step() wrote it (weight decay)");
        EXPECT_CONTAINS(msg, "wrapped model's parameters()");
      }

      // The same model trains normally afterwards with the right optimizer,
      // and Module::zero_grad() on the wrapped model stays harmless.
      torch::optim::SGD right(model->parameters(), torch::optim::SGDOptions(0.1));
      for (int step = 0; step < 2; ++step) {
        right.zero_grad();
        model->zero_grad();
        model->forward(x).sum().backward();
        right.step();
      }
      for (const auto& shard : model->parameters()) EXPECT_TRUE(shard.grad().defined());
    });
  });
}

// fsdp::optim's fused optimizers read memory without the dispatcher: built
// on the unwrapped module's parameters they read a placeholder's missing
// data (a review found SIGSEGV, or Caffe2's "data is not allocated yet").
// Now refused as torch::optim's are, naming the fix, before any step: under
// wrappers of every strategy and under fully_shard.
TEST(Misuse, AFusedOptimizerOnTheUnwrappedParametersIsAnErrorNamingTheFix) {
  run_ranks_ok(2, [](int, int) {
    init_process_group(ProcessGroupOptions().timeout(std::chrono::seconds(30)));
    const torch::Tensor x = torch::randn({3, 6});
    auto expect_refused = [](torch::optim::Optimizer& opt) {
      const std::string msg = error_of([&] { opt.step(); });
      EXPECT_CONTAINS(msg, "::step()");
      EXPECT_CONTAINS(msg, "model's parameters()");
    };
    for_each_wrapped_two_layer([&](FullyShardedDataParallel<TwoLayerImpl>& model, TwoLayer&,
                                   const std::vector<torch::Tensor>& unwrapped, ShardingStrategy) {
      optim::FusedAdamW adamw(unwrapped, torch::optim::AdamWOptions(0.1).weight_decay(0.1));
      optim::FusedSGD sgd(unwrapped, torch::optim::SGDOptions(0.1));
      model->forward(x).sum().backward();
      const auto before = full_state_dict(*model.ptr());
      expect_refused(adamw);
      expect_refused(sgd);
      const auto after = full_state_dict(*model.ptr());
      for (const auto& item : before) {  // refused before any step
        EXPECT_TRUE(torch::equal(item.value(), after[item.key()])) << item.key();
      }
    });
    // fully_shard: model->parameters() are the original parameters.
    torch::manual_seed(0);
    nn::Sequential plain(nn::Linear(6, 6), nn::ReLU(), nn::Linear(6, 2));
    fully_shard(plain, module_type_policy<nn::LinearImpl>(), FSDPOptions());
    optim::FusedAdamW adamw(plain->parameters(), torch::optim::AdamWOptions(0.1));
    optim::FusedSGD sgd(plain->parameters(), torch::optim::SGDOptions(0.1));
    plain->forward(x).sum().backward();
    expect_refused(adamw);
    expect_refused(sgd);
  });
}

// Tied weights: the output projection reuses the (wrapped) embedding's weight.
struct TiedImpl : nn::Module {
  explicit TiedImpl(const FSDPOptions& o) {
    nn::Embedding table(10, 4);
    out_weight = register_parameter("out_weight", table->weight);
    embed = register_module("embed", FullyShardedDataParallel<nn::EmbeddingImpl>(table, o));
  }
  torch::Tensor forward(torch::Tensor ids) { return torch::matmul(embed(ids), out_weight.t()); }
  FullyShardedDataParallel<nn::EmbeddingImpl> embed{nullptr};
  torch::Tensor out_weight;
};
TORCH_MODULE(Tied);

TEST(Misuse, AParameterSharedWithANestedUnitIsAnErrorNamingBoth) {
  run_ranks_ok(2, [](int, int) {
    init_process_group(ProcessGroupOptions().timeout(std::chrono::seconds(30)));
    auto o = FSDPOptions();
    Tied tied(o);
    const std::string msg = error_of([&] { FullyShardedDataParallel<TiedImpl> root(tied, o); });
    EXPECT_CONTAINS(msg, "parameter 'out_weight'");
    EXPECT_CONTAINS(msg, "the same tensor as 'embed.weight'");
    EXPECT_CONTAINS(msg, "wrap the modules that share it in the same unit");
  });
}

// FSDPOptions::device_id (Note [One seam for devices]): a device units cannot
// live on (a GPU this process does not see) is refused by name on every rank
// before anything is sharded, and the group stays usable; the CPU, named or
// by default, gives the same unit, whose parameters stay on it.
TEST(Misuse, ADeviceIdUnitsCannotLiveOnIsAnErrorOnEveryRank) {
  run_ranks_ok(2, [](int rank, int) {
    init_process_group(ProcessGroupOptions().timeout(std::chrono::seconds(30)));
    torch::manual_seed(0);
    nn::Linear plain(6, 3);
    const auto unseen =
        torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(at::getNumGPUs()));
    const std::string msg = error_of([&] {
      FullyShardedDataParallel<nn::LinearImpl> unit(plain, FSDPOptions().device_id(unseen));
    });
    EXPECT_CONTAINS(msg, "[rank " + std::to_string(rank) + "]");
    EXPECT_CONTAINS(msg, "the unit's device is " + unseen.str() + " (from FSDPOptions::device_id)");
    EXPECT_CONTAINS(msg, "which this process does not see");
    EXPECT_TRUE(plain->weight.device().is_cpu());
    EXPECT_EQ(plain->weight.numel(), 18);  // untouched: nothing was sharded

    torch::manual_seed(1);
    nn::Linear twin(6, 3);
    torch::manual_seed(1);
    nn::Linear named(6, 3);
    FullyShardedDataParallel<nn::LinearImpl> unit(named, FSDPOptions().device_id(torch::kCPU));
    const torch::Tensor x = torch::randn({4, 6});
    const torch::Tensor y = unit(x);
    EXPECT_TRUE(y.device().is_cpu());
    EXPECT_TRUE(torch::equal(y, twin(x)));
    y.sum().backward();
    for (const auto& p : unit->parameters()) EXPECT_TRUE(p.device().is_cpu());
  });
}

}  // namespace test_misuse
}  // namespace fsdp::testing
