// A LibTorch user's own habits on an FSDP model train as plain LibTorch does,
// or fail at once with an error that says what to do (issue 16): parameters
// that get no gradient, partly frozen units however made, model->zero_grad(),
// torch::save / torch::load, BatchNorm under bf16, a second backward through
// the same graph, forwards with default arguments, LibTorch's own
// clip_grad_norm_, model->to(device), initialising parameters after
// sharding, a gradient penalty (double backward), custom autograd Functions
// and clone(). Data differs per rank; the reference trains on all of it.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <iterator>
#include <set>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <fsdp/fsdp.h>

#include "core/flat_parameter.h"
#include "detail/torch_compat.h"
#include "error_of.h"
#include "multi_rank.h"
#include "parity_ranks.h"
#include "test_models.h"

namespace fsdp::testing {
namespace test_user_habits {

namespace nn = torch::nn;
using compat::WarningCollector;

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

std::unique_ptr<torch::optim::AdamW> adamw(std::vector<torch::Tensor> params) {
  return std::make_unique<torch::optim::AdamW>(params,
                                               torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
}

// A plain Net and its FSDP twin with the same initial weights.
std::pair<Net, FullyShardedDataParallel<NetImpl>> twins(const FSDPOptions& options) {
  torch::manual_seed(0);
  Net reference(false, FSDPOptions());
  torch::manual_seed(0);
  FullyShardedDataParallel<NetImpl> model(std::make_shared<NetImpl>(true, options), options);
  return {reference, model};
}

// `used` is a unit the forward calls; `spare` a unit it never calls; the root
// manages `head` and `extra`, which the forward never uses.
struct HabitNetImpl : nn::Module {
  HabitNetImpl(bool wrap, const FSDPOptions& o) {
    nn::Linear a(6, 8), b(8, 8);
    if (wrap) {
      used = nn::AnyModule(FullyShardedDataParallel<nn::LinearImpl>(a, o));
      spare = nn::AnyModule(FullyShardedDataParallel<nn::LinearImpl>(b, o));
    } else {
      used = nn::AnyModule(a);
      spare = nn::AnyModule(b);
    }
    register_module("used", used.ptr());
    register_module("spare", spare.ptr());
    head = register_module("head", nn::Linear(8, 2));
    extra = register_parameter("extra", torch::ones({3}));
  }
  torch::Tensor forward(torch::Tensor x) { return head(torch::relu(used.forward(x))); }
  nn::AnyModule used, spare;
  nn::Linear head{nullptr};
  torch::Tensor extra;
};
TORCH_MODULE(HabitNet);

// Item 1. use_orig_params: parameters without a gradient keep an undefined
// .grad, so AdamW's weight decay leaves them, as in plain LibTorch. Flat
// shards: the unused unit's shard keeps no gradient; the root warns, once,
// naming `extra`, whose flat gradient is zero (so AdamW moves it).
TEST(UserHabits, ParametersWithoutGradientsAsInPlainLibTorch) {
  for (int world : {1, 2, 3}) {
    run_ranks_ok(world, [](int, int world) {
      join_test_group();
      for (bool orig : {true, false}) {
        const std::string what = orig ? "use_orig_params" : "flat";
        torch::manual_seed(0);
        HabitNet reference(false, FSDPOptions());
        torch::manual_seed(0);
        auto options = FSDPOptions().use_orig_params(orig);
        FullyShardedDataParallel<HabitNetImpl> model(std::make_shared<HabitNetImpl>(true, options),
                                                     options);
        auto ref_opt = adamw(reference->parameters());
        auto opt = adamw(model->parameters());
        std::vector<std::string> warnings;
        for (int step = 0; step < 4; ++step) {
          torch::manual_seed(step);
          torch::Tensor x = torch::randn({3 * world, 6}), y = torch::randn({3 * world, 2});
          ref_opt->zero_grad();
          torch::mse_loss(reference->forward(x), y).backward();
          ref_opt->step();
          opt->zero_grad();
          {
            WarningCollector guard(&warnings);
            torch::mse_loss(model->forward(local_block(x)), local_block(y)).backward();
          }
          opt->step();
          SummonFullParams full(*model.ptr());
          for (const auto& p : reference->named_parameters()) {
            if (!orig && p.key() == "extra") continue;  // checked below
            const torch::Tensor& a = model->named_parameters()[p.key()];
            EXPECT_TRUE(torch::allclose(a, p.value(), 1.3e-6, 1e-5))
                << what << " step " << step << " " << p.key();
          }
        }
        if (orig) {
          const auto named = model->named_flat_parameters();
          for (const char* name : {"extra", "spare.weight", "spare.bias"}) {
            EXPECT_FALSE(named[name].grad().defined()) << name << " got a gradient";
          }
          EXPECT_TRUE(named["head.weight"].grad().defined());
          EXPECT_TRUE(warnings.empty()) << warnings.front();
        } else {
          ASSERT_EQ(warnings.size(), 1u) << "one warning for the root unit";
          EXPECT_TRUE(contains(warnings[0], "[extra]")) << warnings[0];
          EXPECT_TRUE(contains(warnings[0], "use_orig_params(true)")) << warnings[0];
          for (const auto& m : model->named_modules()) {
            auto* unit = dynamic_cast<Unit*>(m.value().get());
            if (unit == nullptr || m.key() != "spare") continue;
            EXPECT_FALSE(unit->flat_param()->shard().grad().defined()) << "unused unit";
          }
          SummonFullParams full(*model.ptr());
          // Plain LibTorch leaves `extra` at 1; the flat zero gradient decays it.
          EXPECT_TRUE(reference->extra.eq(1).all().item<bool>());
          EXPECT_TRUE(model->named_parameters()["extra"].lt(1).all().item<bool>());
        }
      }
    });
  }
}

// Item 2: the uniform requires_grad rule for units made by hand.
TEST(UserHabits, PartlyFrozenUnitsAreRefusedHoweverMade) {
  run_ranks_ok(1, [](int, int) {
    join_test_group();
    auto partly_frozen = [] {
      nn::Sequential seq(nn::Linear(4, 4), nn::Linear(4, 4));
      for (auto& p : seq[1]->parameters()) p.set_requires_grad(false);
      return seq;
    };
    auto expect_refused = [](const std::string& msg, const std::string& how,
                             const std::string& trainable, const std::string& frozen) {
      EXPECT_TRUE(contains(msg, "requires_grad=true and requires_grad=false")) << how << msg;
      EXPECT_TRUE(contains(msg, "requires_grad=true:\n" + trainable)) << how << msg;
      EXPECT_TRUE(contains(msg, "requires_grad=false:\n" + frozen)) << how << msg;
      EXPECT_TRUE(contains(msg, "use_orig_params(true)")) << how << msg;
    };
    expect_refused(
        error_of([&] { FullyShardedDataParallel<nn::SequentialImpl> unit(partly_frozen()); }),
        "typed wrapper: ", "[0.weight, 0.bias]", "[1.weight, 1.bias]");
    expect_refused(error_of([&] {
                     EnableWrap scope{FSDPOptions()};
                     wrap(partly_frozen());
                   }),
                   "wrap(): ", "[0.weight, 0.bias]", "[1.weight, 1.bias]");
    expect_refused(error_of([&] {
                     nn::Sequential outer(nn::Linear(4, 4), nn::Linear(4, 4));
                     outer[1]->as<nn::Linear>()->weight.set_requires_grad(false);
                     wrap_sequential_entry(outer, 1);
                   }),
                   "Sequential entry: ", "[bias]", "[weight]");
    // use_orig_params(true): accepted with one warning naming both sides.
    std::vector<std::string> warnings;
    {
      WarningCollector guard(&warnings);
      FullyShardedDataParallel<nn::SequentialImpl> unit(partly_frozen(),
                                                        FSDPOptions().use_orig_params(true));
    }
    ASSERT_EQ(warnings.size(), 1u);
    EXPECT_TRUE(contains(warnings[0], "[1.weight, 1.bias]")) << warnings[0];
    // Not the advice to turn on what is on.
    EXPECT_FALSE(contains(warnings[0], "pass FSDPOptions().use_orig_params(true)")) << warnings[0];
  });
}

// The user's own loops over a wrapped model's named_parameters() (the
// original parameters, whose .grad is a placeholder after backward), zeroing
// or dropping each .grad: they clear what the optimizer steps, as in plain
// LibTorch (Note [Gradients the user clears]).
TEST(UserHabits, OwnLoopsOverNamedParametersClearTheOptimizersGradients) {
  for (int world : {1, 2}) {
    run_ranks_ok(world, [](int, int world) {
      join_test_group();
      for (bool orig : {false, true}) {
        for (bool drop : {false, true}) {
          const std::string what = std::string(orig ? "use_orig_params" : "flat") +
                                   (drop ? " dropping loop" : " zeroing loop");
          auto [reference, model] = twins(FSDPOptions().use_orig_params(orig));
          auto ref_opt = adamw(reference->parameters());
          auto opt = adamw(model->parameters());
          auto clear = [drop](nn::Module& m) {
            for (auto& p : m.named_parameters()) {
              if (!p.value().grad().defined()) continue;
              if (drop) {
                p.value().mutable_grad().reset();
              } else {
                p.value().mutable_grad().zero_();
              }
            }
          };
          for (int step = 0; step < 4; ++step) {
            torch::manual_seed(step);
            torch::Tensor x = torch::randn({4 * world, 7}), y = torch::randn({4 * world, 3});
            clear(*reference);
            torch::mse_loss(reference->forward(x), y).backward();
            ref_opt->step();
            clear(*model);
            torch::mse_loss(model->forward(local_block(x)), local_block(y)).backward();
            opt->step();
            expect_same_after_step(*model.ptr(), *reference.ptr(), what, step);
          }
        }
      }
    });
  }
}

// Item 3: model->zero_grad() (root or any unit) clears what the optimizer steps.
TEST(UserHabits, ModuleZeroGradClearsTheOptimizersGradients) {
  for (int world : {1, 2, 3}) {
    run_ranks_ok(world, [](int, int world) {
      join_test_group();
      for (bool orig : {false, true}) {
        auto [reference, model] = twins(FSDPOptions().use_orig_params(orig));
        auto ref_opt = adamw(reference->parameters());
        auto opt = adamw(model->parameters());
        for (int step = 0; step < 4; ++step) {
          torch::manual_seed(step);
          torch::Tensor x = torch::randn({4 * world, 7}), y = torch::randn({4 * world, 3});
          const bool set_to_none = step % 2 == 1;  // both meanings, alternating
          reference->zero_grad(set_to_none);
          torch::mse_loss(reference->forward(x), y).backward();
          ref_opt->step();
          model->zero_grad(set_to_none);
          torch::mse_loss(model->forward(local_block(x)), local_block(y)).backward();
          opt->step();
          expect_same_after_step(*model.ptr(), *reference.ptr(), orig ? "use_orig_params" : "flat",
                                 step);
        }
        {
          // zero_grad after a micro-batch accumulated inside no_sync discards
          // it, as plain LibTorch's zero_grad discards the accumulated .grad.
          torch::manual_seed(50);
          torch::Tensor xa = torch::randn({4 * world, 7}), ya = torch::randn({4 * world, 3});
          torch::Tensor xb = torch::randn({4 * world, 7}), yb = torch::randn({4 * world, 3});
          torch::mse_loss(reference->forward(xa), ya).backward();
          reference->zero_grad();
          torch::mse_loss(reference->forward(xb), yb).backward();
          ref_opt->step();
          {
            auto no_sync = model->no_sync();
            torch::mse_loss(model->forward(local_block(xa)), local_block(ya)).backward();
          }
          model->zero_grad();
          torch::mse_loss(model->forward(local_block(xb)), local_block(yb)).backward();
          opt->step();
          expect_same_after_step(*model.ptr(), *reference.ptr(),
                                 orig ? "use_orig_params, no_sync then zero_grad"
                                      : "flat, no_sync "
                                        "then zero_grad",
                                 4);
        }
        model->zero_grad(/*set_to_none=*/false);
        for (const auto& p : model->parameters()) {
          ASSERT_TRUE(p.grad().defined());
          EXPECT_EQ(p.grad().abs().sum().item<double>(), 0.0);
        }
        model->zero_grad(/*set_to_none=*/true);
        for (const auto& p : model->parameters()) EXPECT_FALSE(p.grad().defined());
        // On one unit: its gradients only.
        torch::mse_loss(model->forward(torch::randn({4, 7})), torch::randn({4, 3})).backward();
        Unit* block = nullptr;
        for (const auto& m : model->named_modules()) {
          if (m.key() == "block") block = dynamic_cast<Unit*>(m.value().get());
        }
        ASSERT_NE(block, nullptr);
        dynamic_cast<nn::Module*>(block)->zero_grad(true);
        for (const auto& p : block->flat_parameters()) EXPECT_FALSE(p.grad().defined());
        EXPECT_TRUE(model->parameters().front().grad().defined()) << "the root's was cleared";
      }
    });
  }
}

std::string file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// Item 4: torch::save / torch::load of a wrapped model, every rank calling.
TEST(UserHabits, TorchSaveAndLoadWriteWhatThePlainModelWrites) {
  run_ranks_ok(2, [](int rank, int) {
    join_test_group();
    const std::string base =
        "/tmp/fsdp_user_habits_" + std::to_string(getppid()) + "_" + std::to_string(rank);
    for (auto strategy : {ShardingStrategy::kFullShard, ShardingStrategy::kNoShard}) {
      torch::manual_seed(0);
      auto options = FSDPOptions().sharding_strategy(strategy).use_orig_params(
          strategy == ShardingStrategy::kNoShard);
      FullyShardedDataParallel<NetImpl> model(std::make_shared<NetImpl>(true, options), options);
      auto opt = adamw(model->parameters());
      torch::mse_loss(model->forward(torch::randn({4, 7})), torch::randn({4, 3})).backward();
      opt->step();
      torch::save(model, base + "_fsdp.pt");
      // Into a plain model: the same values, and the same file.
      Net plain(false, FSDPOptions());
      torch::load(plain, base + "_fsdp.pt");
      {
        SummonFullParams full(*model.ptr());
        expect_same_params(*model.ptr(), *plain.ptr(), "loaded into a plain model");
      }
      // Every tensor written in full (a broken file had empty storages): the
      // same size as the plain model's file, up to the archive's names.
      torch::save(plain, base + "_plain.pt");
      const auto fsdp_size = static_cast<double>(file_bytes(base + "_fsdp.pt").size());
      EXPECT_NEAR(fsdp_size, static_cast<double>(file_bytes(base + "_plain.pt").size()), 200.0);
      // And back: a plain model's file loads into the wrapped model.
      {
        torch::NoGradGuard no_grad;
        for (auto& p : plain->parameters()) p.mul_(-2);
      }
      torch::save(plain, base + "_plain.pt");
      torch::load(model, base + "_plain.pt");
      SummonFullParams full(*model.ptr());
      expect_same_params(*model.ptr(), *plain.ptr(), "loaded from a plain model's file");
    }
    std::remove((base + "_fsdp.pt").c_str());
    std::remove((base + "_plain.pt").c_str());
  });
}

struct NormNetImpl : nn::Module {
  NormNetImpl(bool bn_unit, const FSDPOptions& o) {
    fc = register_module("fc", nn::Linear(4, 6));
    if (bn_unit) {
      bn_wrapped = register_module(
          "bn", FullyShardedDataParallel<nn::BatchNorm1dImpl>(nn::BatchNorm1d(6), o));
    } else {
      bn = register_module("bn", nn::BatchNorm1d(6));
    }
  }
  torch::Tensor forward(torch::Tensor x) {
    x = fc(x);
    if (bn) return bn(x);
    return bn_wrapped(x);
  }
  nn::Linear fc{nullptr};
  nn::BatchNorm1d bn{nullptr};
  FullyShardedDataParallel<nn::BatchNorm1dImpl> bn_wrapped{nullptr};
};

// Walking the modules by type (freezing BatchNorm statistics, setting an
// option on every block): modules() gives a unit as its wrapper, which
// Module::as<T>() does not find; original_modules() gives the wrapped
// module, as the unwrapped model's modules() would. Printing names it.
TEST(UserHabits, WalkingModulesByTypeFindsWrappedOnes) {
  run_ranks_ok(2, [](int, int) {
    join_test_group();
    FullyShardedDataParallel<NormNetImpl> model(std::make_shared<NormNetImpl>(true, FSDPOptions()),
                                                FSDPOptions());
    int through_modules = 0, through_original = 0;
    for (const auto& m : model->modules())
      through_modules += m->as<nn::BatchNorm1dImpl>() != nullptr;
    for (nn::Module* m : original_modules(*model)) {
      if (auto* bn = m->as<nn::BatchNorm1dImpl>()) {
        ++through_original;
        bn->eval();  // its statistics frozen
      }
    }
    EXPECT_EQ(through_modules, 0) << "LibTorch's modules() lists the wrapper";
    EXPECT_EQ(through_original, 1);
    EXPECT_EQ(original_modules(*model).size(), model->modules().size());
    const torch::Tensor before = model->module().bn_wrapped->module().running_mean.clone();
    model->forward(torch::randn({8, 4})).sum().backward();
    EXPECT_TRUE(torch::equal(model->module().bn_wrapped->module().running_mean, before));
    std::ostringstream printed;
    printed << *model;
    EXPECT_CONTAINS(printed.str(), "fsdp::FullyShardedDataParallel<torch::nn::BatchNorm1d(6");
    // A checkpoint wrapper stands for its module too.
    CheckpointWrapper<nn::LinearImpl> checkpointed(nn::Linear(2, 2));
    const auto found = original_modules(*checkpointed);
    ASSERT_EQ(found.size(), 1u);
    EXPECT_NE(found[0]->as<nn::LinearImpl>(), nullptr);
    // Through every layer of wrappers.
    CheckpointWrapper<CheckpointWrapperImpl<nn::LinearImpl>> twice(
        std::make_shared<CheckpointWrapperImpl<nn::LinearImpl>>(nn::Linear(2, 2)));
    const auto inner = original_modules(*twice);
    ASSERT_EQ(inner.size(), 1u);
    EXPECT_NE(inner[0]->as<nn::LinearImpl>(), nullptr);
  });
}

// parameters(false), as LibTorch's: a unit's own shards (or, with
// use_orig_params, its own parameters' pieces), not its nested units' (the
// flag was ignored: every unit's were returned, and an optimizer built per
// unit from them stepped the nested shards twice).
TEST(UserHabits, ParametersWithoutRecursionAreTheUnitsOwn) {
  run_ranks_ok(2, [](int, int) {
    join_test_group();
    for (bool orig : {false, true}) {
      const auto options = FSDPOptions().use_orig_params(orig);
      FullyShardedDataParallel<HabitNetImpl> model(std::make_shared<HabitNetImpl>(true, options),
                                                   options);
      std::set<const void*> all, parts;
      for (const auto& p : model->parameters()) all.insert(p.unsafeGetTensorImpl());
      const std::vector<torch::Tensor> own = model->parameters(/*recurse=*/false);
      EXPECT_EQ(own.size(), orig ? 3u : 1u) << "orig " << orig;
      for (const auto& p : own) parts.insert(p.unsafeGetTensorImpl());
      for (const auto* child : {&model->module().used, &model->module().spare}) {
        const auto* unit = dynamic_cast<const Unit*>(child->ptr().get());
        ASSERT_NE(unit, nullptr);
        for (const auto& p : unit->flat_parameters(/*recurse=*/false)) {
          EXPECT_TRUE(parts.insert(p.unsafeGetTensorImpl()).second) << "listed twice";
        }
      }
      EXPECT_EQ(parts, all) << "orig " << orig;
    }
  });
}

// Item 5: BatchNorm under bf16 in typed units: a unit of its own is kept in
// full precision; inside a bf16 unit it is refused with the fix.
TEST(UserHabits, BatchNormInTypedUnitsUnderBf16) {
  run_ranks_ok(2, [](int, int) {
    join_test_group();
    auto options = FSDPOptions().mixed_precision(MixedPrecision().param_dtype(at::kBFloat16));
    const std::string msg = error_of([&] {
      FullyShardedDataParallel<NormNetImpl> model(std::make_shared<NormNetImpl>(false, options),
                                                  options);
    });
    EXPECT_TRUE(contains(msg, "BatchNorm")) << msg;
    EXPECT_TRUE(contains(msg, "module_classes_to_ignore")) << msg;
    EXPECT_TRUE(contains(msg, "fsdp::FullyShardedDataParallel<Impl>")) << msg;
    torch::manual_seed(0);
    FullyShardedDataParallel<NormNetImpl> model(std::make_shared<NormNetImpl>(true, options),
                                                options);
    torch::Tensor out = model->forward(torch::randn({5, 4}));
    EXPECT_EQ(out.scalar_type(), at::kBFloat16);  // back to its input's dtype
    out.to(at::kFloat).pow(2).sum().backward();
    for (const auto& p : model->parameters()) EXPECT_TRUE(p.grad().defined());
    EXPECT_EQ(model->module().bn_wrapped->module().running_mean.scalar_type(), at::kFloat);
  });
}

// Item 6: a second backward through the same graph accumulates, as in
// plain LibTorch.
TEST(UserHabits, SecondBackwardWithRetainGraphAccumulates) {
  for (int world : {1, 2, 3}) {
    run_ranks_ok(world, [](int, int world) {
      join_test_group();
      for (bool orig : {false, true}) {
        auto [reference, model] = twins(FSDPOptions().use_orig_params(orig));
        auto ref_opt = adamw(reference->parameters());
        auto opt = adamw(model->parameters());
        for (int step = 0; step < 3; ++step) {
          torch::manual_seed(step);
          torch::Tensor x = torch::randn({4 * world, 7}), y = torch::randn({4 * world, 3});
          ref_opt->zero_grad();
          torch::Tensor ref_loss = torch::mse_loss(reference->forward(x), y);
          ref_loss.backward({}, /*retain_graph=*/true);
          (ref_loss * 0.5).backward();
          ref_opt->step();
          opt->zero_grad();
          torch::Tensor loss = torch::mse_loss(model->forward(local_block(x)), local_block(y));
          loss.backward({}, /*retain_graph=*/true);
          (loss * 0.5).backward();
          opt->step();
          expect_same_after_step(*model.ptr(), *reference.ptr(), orig ? "orig" : "flat", step);
        }
      }
    });
  }
}

// Item 7: forwards with default arguments (FORWARD_HAS_DEFAULT_ARGS).
TEST(UserHabits, DefaultForwardArgumentsAreForwarded) {
  run_ranks_ok(2, [](int, int) {
    join_test_group();
    torch::manual_seed(0);
    const torch::Tensor seq = torch::randn({5, 2, 4});
    nn::LSTM lstm(nn::LSTMOptions(4, 3));
    const auto lstm_expected = lstm(seq);
    FullyShardedDataParallel<nn::LSTMImpl> lstm_unit(lstm);
    const auto lstm_out = lstm_unit(seq);
    EXPECT_TRUE(torch::allclose(std::get<0>(lstm_out), std::get<0>(lstm_expected)));
    EXPECT_TRUE(torch::allclose(std::get<0>(lstm_unit->forward(seq)), std::get<0>(lstm_expected)));

    const torch::Tensor x = torch::randn({2, 4});
    nn::GRUCell cell(4, 3);
    const torch::Tensor cell_expected = cell(x);
    FullyShardedDataParallel<nn::GRUCellImpl> cell_unit(cell);
    EXPECT_TRUE(torch::allclose(cell_unit(x), cell_expected));

    nn::MultiheadAttention mha(nn::MultiheadAttentionOptions(4, 2));
    const auto mha_expected = mha(seq, seq, seq);
    FullyShardedDataParallel<nn::MultiheadAttentionImpl> mha_unit(mha);
    const auto mha_out = mha_unit(seq, seq, seq);
    EXPECT_TRUE(torch::allclose(std::get<0>(mha_out), std::get<0>(mha_expected)));
    EXPECT_TRUE(torch::allclose(std::get<1>(mha_out), std::get<1>(mha_expected)));
    // Given arguments still count: need_weights=false returns no weights.
    EXPECT_FALSE(std::get<1>(mha_unit(seq, seq, seq, torch::Tensor(), false)).defined());
    // Too few arguments: one line naming the module and the count, on every rank.
    const std::string msg = error_of([&] { mha_unit(seq); });
    EXPECT_NE(msg.find("] fsdp(torch::nn::MultiheadAttention): expected at least 3 forward "
                       "arguments, got 1"),
              std::string::npos)
        << msg;
    std::get<0>(mha_out).sum().backward();
    for (const auto& p : mha_unit->parameters()) EXPECT_TRUE(p.grad().defined());
  });
}

// Item 8: LibTorch's clip_grad_norm_ on the shards sees one rank's shard: a
// local norm, smaller than the global one that the root's clip_grad_norm_
// (and plain LibTorch) computes. README and the root's docs say so.
TEST(UserHabits, LibTorchClipGradNormSeesOnlyTheLocalShard) {
  run_ranks_ok(2, [](int, int world) {
    join_test_group();
    auto [reference, model] = twins(FSDPOptions());
    torch::manual_seed(1);
    torch::Tensor x = torch::randn({4 * world, 7}) * 10, y = torch::zeros({4 * world, 3});
    torch::mse_loss(reference->forward(x), y).backward();
    torch::mse_loss(model->forward(local_block(x)), local_block(y)).backward();
    const double expected = torch::nn::utils::clip_grad_norm_(reference->parameters(), 1e9);
    const double local = torch::nn::utils::clip_grad_norm_(model->parameters(), 1e9);
    const double global = model->clip_grad_norm_(1e9);
    EXPECT_NEAR(global, expected, 1e-5 * expected);
    EXPECT_LT(local, global * 0.999) << "a shard's norm is a part of the global norm";
    // Logging each parameter's gradient norm through the module's own
    // parameters (named_parameters()): their gradients moved into the
    // shard, and a norm of one is the whole gradient's, on every rank (Note
    // [LibTorch's clipping of a unit made in place]); other reads say where
    // to read them.
    EXPECT_NEAR(model->named_parameters()["fc1.weight"].grad().norm().item<double>(),
                reference->named_parameters()["fc1.weight"].grad().norm().item<double>(), 1e-4);
    const std::string moved =
        error_of([&] { model->named_parameters()["fc1.weight"].grad().sum(); });
    EXPECT_TRUE(contains(moved, "read the gradient of 'fc1.weight'") &&
                contains(moved, "To log gradients, read those tensors' .grad()"))
        << moved;
  });
}

// One step of `reference` (plain LibTorch) on the global batch of `step`
// and of `model` on this rank's block of it, each zeroing its gradients
// with Module::zero_grad first, as users do.
template <typename Reference, typename Model>
void train_step(Reference& reference, torch::optim::Optimizer& ref_opt, Model& model,
                torch::optim::Optimizer& opt, int step, int world) {
  torch::manual_seed(step);
  torch::Tensor x = torch::randn({4 * world, 7}), y = torch::randn({4 * world, 3});
  reference->zero_grad();
  torch::mse_loss(reference->forward(x), y).backward();
  ref_opt.step();
  model->zero_grad();
  torch::mse_loss(model->forward(local_block(x)), local_block(y)).backward();
  opt.step();
}

// Item 9: model->to(device) after wrapping, as LibTorch code moves a model
// once it is built (Note [Module::to on a sharded model]). To the units' own
// device and dtype it changes no parameter (the optimizer built before keeps
// stepping what the forward reads) and converts the buffers as LibTorch
// does; to anything else it is an error naming the unit, on every rank, and
// nothing changed.
TEST(UserHabits, ModelToAfterWrappingKeepsTheUnitsAndConvertsTheBuffers) {
  for (int world : {1, 2, 3}) {
    run_ranks_ok(world, [](int, int world) {
      join_test_group();
      for (ShardingStrategy strategy : parity_strategies()) {
        const FSDPOptions options = FSDPOptions().sharding_strategy(strategy);
        const std::string what = to_string(strategy);
        torch::manual_seed(0);
        Net reference(false, FSDPOptions());
        reference->register_buffer("seen", torch::zeros({2}, torch::kDouble));
        torch::manual_seed(0);
        auto inner = std::make_shared<NetImpl>(true, options);
        inner->register_buffer("seen", torch::zeros({2}, torch::kDouble));
        FullyShardedDataParallel<NetImpl> model(inner, options);
        auto ref_opt = adamw(reference->parameters());
        auto opt = adamw(model->parameters());
        std::vector<const c10::TensorImpl*> before;
        for (const auto& p : model->named_parameters()) {
          before.push_back(p.value().unsafeGetTensorImpl());
        }
        for (int step = 0; step < 4; ++step) {
          if (step == 0 || step == 2) {  // before the first forward, and between steps
            for (nn::Module* m : {static_cast<nn::Module*>(reference.ptr().get()),
                                  static_cast<nn::Module*>(model.ptr().get())}) {
              m->to(torch::kCPU);
              m->to(torch::Device(torch::kCPU), /*non_blocking=*/true);
            }
          }
          if (step == 2) {
            const std::string refused = error_of([&] { model->to(torch::kHalf); });
            EXPECT_TRUE(contains(refused,
                                 "fsdp(Module::to): to(Half) would move or convert the FSDP unit "
                                 "around a fsdp::testing::NetImpl (on cpu, Float)") &&
                        contains(refused, "before wrapping it"))
                << what << ": " << refused;
            const std::string moved =
                error_of([&] { model->to(torch::Device(torch::kCUDA, 0), torch::kFloat); });
            EXPECT_TRUE(contains(moved, "to(cuda:0, Float) would move or convert"))
                << what << ": " << moved;
            EXPECT_EQ(model->named_buffers()["seen"].scalar_type(), torch::kDouble) << what;
            reference->to(torch::kCPU, torch::kFloat);
            model->to(torch::kCPU, torch::kFloat);  // the buffer, as LibTorch's does
          }
          train_step(reference, *ref_opt, model, *opt, step, world);
          expect_same_after_step(*model.ptr(), *reference.ptr(), what, step);
          EXPECT_EQ(model->named_buffers()["seen"].scalar_type(),
                    step < 2 ? torch::kDouble : torch::kFloat)
              << what << " step " << step;
        }
        EXPECT_EQ(reference->named_buffers()["seen"].scalar_type(), torch::kFloat);
        std::vector<const c10::TensorImpl*> after;
        for (const auto& p : model->named_parameters()) {
          after.push_back(p.value().unsafeGetTensorImpl());
        }
        EXPECT_EQ(after, before) << what;
      }
    });
  }
}

// Sequential entries made units by auto_wrap (AnyUnit), under a root
// wrapper: the same, through each wrapper's own to().
TEST(UserHabits, ModelToAfterAutoWrapKeepsTheUnits) {
  run_ranks_ok(2, [](int, int) {
    join_test_group();
    torch::manual_seed(0);
    nn::Sequential seq(nn::Linear(7, 16), nn::ReLU(), nn::Linear(16, 3));
    const torch::Tensor x = torch::randn({4, 7});
    const torch::Tensor expected = seq->forward(x).detach();
    auto_wrap(seq, module_type_policy<nn::LinearImpl>());
    seq->to(torch::kCPU, torch::kFloat);  // the plain Sequential: each entry's to()
    FullyShardedDataParallel<nn::SequentialImpl> root(seq);
    root->to(torch::kCPU);
    const std::string refused = error_of([&] { seq->to(torch::kDouble); });
    EXPECT_TRUE(contains(refused,
                         "fsdp(Module::to): to(Double) would move or convert the FSDP "
                         "unit around a torch::nn::LinearImpl (on cpu, Float)"))
        << refused;
    EXPECT_TRUE(torch::allclose(root->forward(x), expected, 1e-6, 1e-7));
  });
}

// A plain Net and its twin made a model by fully_shard (each Linear a unit),
// with the same initial weights.
std::pair<Net, Net> fully_shard_twins() {
  torch::manual_seed(0);
  Net reference(false, FSDPOptions());
  torch::manual_seed(0);
  Net model(false, FSDPOptions());
  fully_shard(model, module_type_policy<nn::LinearImpl>());
  return {reference, model};
}

// The same for units made by fully_shard, whose module's to() is the user's:
// each parameter's Tensor::to keeps it, or names it.
TEST(UserHabits, ModelToAfterFullyShardKeepsTheUnits) {
  run_ranks_ok(2, [](int, int world) {
    join_test_group();
    auto [reference, model] = fully_shard_twins();
    Unit& root = *unit_of(*model);
    auto opt = adamw(root.flat_parameters());
    auto ref_opt = adamw(reference->parameters());
    for (int step = 0; step < 3; ++step) {
      model->to(torch::kCPU);
      model->to(torch::kFloat);
      train_step(reference, *ref_opt, model, *opt, step, world);
    }
    const std::string refused = error_of([&] { model->to(torch::kDouble); });
    EXPECT_TRUE(contains(refused,
                         "would give data on cpu in Double to a parameter of a unit made by "
                         "fsdp::fully_shard") &&
                contains(refused, "(on cpu, Float)"))
        << refused;
    SummonFullParams full(*model);
    for (const auto& p : reference->named_parameters()) {
      const torch::Tensor mine = model->named_parameters()[p.key()];
      EXPECT_TRUE(torch::allclose(mine, p.value(), 1e-5, 1e-6)) << p.key();
    }
  });
  // A conversion that would change a parameter is refused when set_data
  // would cut it off its unit, under mixed precision (bf16 parameters, fp32
  // shards) too.
  run_ranks_ok(1, [](int, int) {
    join_test_group();
    Net model(false, FSDPOptions());
    fully_shard(model, module_type_policy<nn::LinearImpl>(),
                FSDPOptions().mixed_precision(MixedPrecision().param_dtype(torch::kBFloat16)));
    model->to(torch::kCPU);
    const std::string refused = error_of([&] { model->to(torch::kFloat); });
    EXPECT_TRUE(
        contains(refused, "set_data (as Module::to does) would give data on cpu in Float") &&
        contains(refused, "(on cpu, BFloat16)"))
        << refused;
  });
}

// Item 10: initialising (or clamping) parameters in place after sharding, as
// plain LibTorch code does after building a model. On a fully_shard model
// the write gathers the unit and lasts (each rank keeps its part), as with
// FSDP2; on a wrapper's sharded parameter it is an error that says where
// such writes go (before wrapping, or under SummonFullParams with
// writeback), and that way works.
TEST(UserHabits, InitialisingParametersAfterShardingLasts) {
  run_ranks_ok(2, [](int, int world) {
    join_test_group();
    auto [reference, model] = fully_shard_twins();
    Unit& root = *unit_of(*model);
    const auto init_weights = [](nn::Module& m) {
      torch::NoGradGuard no_grad;
      torch::manual_seed(7);
      for (auto& p : m.named_parameters()) torch::nn::init::normal_(p.value(), 0.0, 0.2);
    };
    init_weights(*reference);
    init_weights(*model);
    {
      SummonFullParams full(*model);
      const auto expected = reference->named_parameters();
      for (const auto& p : model->named_parameters()) {
        EXPECT_TRUE(torch::equal(p.value(), expected[p.key()])) << p.key();
      }
    }
    auto opt = adamw(root.flat_parameters());
    auto ref_opt = adamw(reference->parameters());
    for (int step = 0; step < 3; ++step) {
      train_step(reference, *ref_opt, model, *opt, step, world);
      {
        torch::NoGradGuard no_grad;  // WGAN-style clipping through the parameters
        for (auto* m : {static_cast<nn::Module*>(reference.ptr().get()),
                        static_cast<nn::Module*>(model.ptr().get())}) {
          for (auto& p : m->named_parameters()) p.value().clamp_(-0.15, 0.15);
        }
      }
    }
    SummonFullParams full(*model);
    const auto expected = reference->named_parameters();
    for (const auto& p : model->named_parameters()) {
      EXPECT_TRUE(torch::allclose(p.value(), expected[p.key()], 1e-5, 1e-6)) << p.key();
      EXPECT_LE(p.value().abs().max().item<double>(), 0.15 + 1e-7) << p.key();
    }
  });
  run_ranks_ok(2, [](int, int) {
    join_test_group();
    auto [reference, model] = twins(FSDPOptions());
    const torch::Tensor weight = model->named_parameters()["fc1.weight"];
    const std::string refused = error_of([&] {
      torch::NoGradGuard no_grad;
      torch::nn::init::constant_(weight, 0.5);
    });
    EXPECT_TRUE(contains(refused, "wrote to parameter 'weight' of an FSDP unit") &&
                contains(refused, "SummonOptions().writeback(true)"))
        << refused;
    {
      SummonFullParams full(*model.ptr(), SummonOptions().writeback(true));
      torch::NoGradGuard no_grad;
      torch::nn::init::constant_(weight, 0.5);
    }
    SummonFullParams full(*model.ptr());
    EXPECT_TRUE(torch::equal(weight, torch::full_like(weight, 0.5)));
  });
}

// Item 11: an operator on the parameters of several units at once, outside a
// module's forward (parameters_to_vector for an L2 term or a log, a
// difference of two blocks' weights), on a fully_shard model: each unit it
// reads stays gathered until it ran, though entering one unit ends its
// sibling's forward (that sibling's memory was freed under the operator, a
// crash, or its placeholder read as a stale alias).
TEST(UserHabits, AnOperatorOnSeveralUnitsParametersReadsThemAll) {
  run_ranks_ok(2, [](int, int world) {
    join_test_group();
    auto [reference, model] = fully_shard_twins();
    Unit& root = *unit_of(*model);
    const auto block_weights = [](Net& net) {
      auto params = net->named_parameters();
      return std::make_pair(params["block.0.weight"], params["block.3.weight"]);
    };
    {
      const auto [a, b] = block_weights(model);
      const auto [ra, rb] = block_weights(reference);
      EXPECT_TRUE(torch::equal(torch::cat({a.view(-1), b.view(-1)}),
                               torch::cat({ra.view(-1), rb.view(-1)})));
      EXPECT_TRUE(torch::equal((a - b).abs().sum(), (ra - rb).abs().sum()));
    }
    auto opt = adamw(root.flat_parameters());
    auto ref_opt = adamw(reference->parameters());
    for (int step = 0; step < 3; ++step) {
      torch::manual_seed(step);
      torch::Tensor x = torch::randn({4 * world, 7}), y = torch::randn({4 * world, 3});
      const auto l2 = [](Net& net) {
        return torch::nn::utils::parameters_to_vector(net->parameters()).pow(2).sum();
      };
      reference->zero_grad();
      (torch::mse_loss(reference->forward(x), y) + 1e-2 * l2(reference)).backward();
      ref_opt->step();
      model->zero_grad();
      // Every rank's loss has the L2 term: the average of the ranks' gradients
      // holds it once, as the reference's.
      (torch::mse_loss(model->forward(local_block(x)), local_block(y)) + 1e-2 * l2(model))
          .backward();
      opt->step();
      const double plain =
          torch::nn::utils::parameters_to_vector(reference->parameters()).sum().item<double>();
      const double sharded =
          torch::nn::utils::parameters_to_vector(model->parameters()).sum().item<double>();
      EXPECT_NEAR(sharded, plain, 1e-4) << "step " << step;
    }
  });
}

// Item 12: freezing layers of a wrapped model by their parameters
// (requires_grad_(false) through named_parameters()), as one freezes layers
// of a built model (Note [Freezing after wrapping]). With flat shards the
// next forward used to give them the shard's flag back, so they went on
// training without a word. Now a unit all of whose parameters the user
// froze (or unfroze) follows, and freezing part of a unit is an error
// naming both sides, as at wrapping.
TEST(UserHabits, FreezingLayersAfterWrappingFreezesTheirUnits) {
  const auto set_trainable = [](nn::Module& m, const std::string& prefix, bool on) {
    for (auto& p : m.named_parameters()) {
      if (p.key().rfind(prefix, 0) == 0) p.value().requires_grad_(on);
    }
  };
  for (int world : {1, 2, 3}) {
    run_ranks_ok(world, [&set_trainable](int, int world) {
      join_test_group();
      auto [reference, model] = twins(FSDPOptions());
      auto ref_opt = adamw(reference->parameters());
      auto opt = adamw(model->parameters());
      const torch::Tensor frozen = model->named_parameters()["block.0.weight"];
      torch::Tensor before;
      for (int step = 0; step < 5; ++step) {
        if (step == 1 || step == 3) {  // freeze the block (a unit), then unfreeze it
          set_trainable(*reference, "block.", step == 3);
          set_trainable(*model, "block.", step == 3);
        }
        if (step == 1) {
          SummonFullParams full(*model.ptr());
          before = frozen.clone();
        }
        train_step(reference, *ref_opt, model, *opt, step, world);
        expect_same_after_step(*model.ptr(), *reference.ptr(), "freezing", step);
        // LibTorch 1.13's zero_grad() leaves zeros, not undefined gradients,
        // so there AdamW's decay and momentum move frozen parameters, plain
        // LibTorch's too (the comparison above holds either way).
        if (step == 2 && kModuleZeroGradSetsToNone) {
          SummonFullParams full(*model.ptr());
          EXPECT_TRUE(torch::equal(frozen, before)) << "a frozen unit trained";
        }
      }
      model->named_parameters()["head.weight"].requires_grad_(false);  // the root's, in part
      const std::string refused = error_of([&] { model->forward(torch::randn({2, 7})); });
      EXPECT_TRUE(contains(refused, "requires_grad=true and requires_grad=false") &&
                  contains(refused, "requires_grad=false:\n[head.weight]"))
          << refused;
    });
  }
  // A fully_shard model (each Linear a unit): the same habit.
  run_ranks_ok(2, [&set_trainable](int, int world) {
    join_test_group();
    auto [reference, model] = fully_shard_twins();
    auto opt = adamw(unit_of(*model)->flat_parameters());
    auto ref_opt = adamw(reference->parameters());
    for (int step = 0; step < 3; ++step) {
      if (step == 1) {
        set_trainable(*reference, "fc1.", false);
        set_trainable(*model, "fc1.", false);
      }
      train_step(reference, *ref_opt, model, *opt, step, world);
    }
    SummonFullParams full(*model);
    const auto expected = reference->named_parameters();
    for (const auto& p : model->named_parameters()) {
      EXPECT_TRUE(torch::allclose(p.value(), expected[p.key()], 1e-5, 1e-6)) << p.key();
    }
  });
}

// The fine-tuning habit under use_orig_params: layers frozen before
// wrapping, unfrozen some steps later through named_parameters(), train from
// then on as in plain LibTorch, their pieces (the optimizer's) following the
// flag (Note [Freezing after wrapping]). The next forward used to freeze
// them again without a word: they never trained.
TEST(UserHabits, ParametersFrozenWhenWrappedCanBeUnfrozen) {
  run_ranks_ok(2, [](int, int world) {
    join_test_group();
    const auto set_trainable = [](nn::Module& m, bool on) {
      for (auto& p : m.named_parameters()) {
        if (p.key().rfind("fc1.", 0) == 0) p.value().requires_grad_(on);
      }
    };
    torch::manual_seed(0);
    Net reference(false, FSDPOptions());
    torch::manual_seed(0);
    auto inner = std::make_shared<NetImpl>(false, FSDPOptions());
    set_trainable(*reference, false);
    set_trainable(*inner, false);
    const auto options = FSDPOptions().use_orig_params(true);
    FullyShardedDataParallel<NetImpl> model(inner, options);
    auto ref_opt = adamw(reference->parameters());
    auto opt = adamw(model->parameters());
    for (int step = 0; step < 4; ++step) {
      if (step == 2) {
        set_trainable(*reference, true);
        set_trainable(*model, true);
      }
      train_step(reference, *ref_opt, model, *opt, step, world);
      expect_same_after_step(*model.ptr(), *reference.ptr(), "unfrozen", step);
    }
  });
  // Flat shards: fc1 a unit of its own, frozen whole when fully_shard made it.
  run_ranks_ok(2, [](int, int world) {
    join_test_group();
    torch::manual_seed(0);
    Net reference(false, FSDPOptions());
    torch::manual_seed(0);
    Net model(false, FSDPOptions());
    for (nn::Module* m : {reference.ptr().get(), model.ptr().get()}) {
      for (auto& p : m->named_parameters()) {
        if (p.key().rfind("fc1.", 0) == 0) p.value().requires_grad_(false);
      }
    }
    fully_shard(model, module_type_policy<nn::LinearImpl>());
    auto ref_opt = adamw(reference->parameters());
    auto opt = adamw(unit_of(*model)->flat_parameters());
    for (int step = 0; step < 4; ++step) {
      if (step == 2) {
        for (nn::Module* m : {reference.ptr().get(), model.ptr().get()}) {
          for (auto& p : m->named_parameters()) {
            if (p.key().rfind("fc1.", 0) == 0) p.value().requires_grad_(true);
          }
        }
      }
      train_step(reference, *ref_opt, model, *opt, step, world);
    }
    SummonFullParams full(*model);
    const auto expected = reference->named_parameters();
    for (const auto& p : model->named_parameters()) {
      EXPECT_TRUE(torch::allclose(p.value(), expected[p.key()], 1e-5, 1e-6)) << p.key();
    }
  });
}

// A gradient penalty's loss: the model's loss plus the mean squared norm of
// the gradient of its outputs with respect to its inputs, taken with
// create_graph so that backward goes through it (a double backward).
template <typename Model>
torch::Tensor penalised_loss(Model& model, const torch::Tensor& x, const torch::Tensor& y) {
  const torch::Tensor input = x.detach().requires_grad_(true);
  // In fp32 (a bf16 unit returns bf16; LibTorch 1.13 cannot mix them in a loss).
  const torch::Tensor out = model->forward(input).to(torch::kFloat);
  const torch::Tensor g = torch::autograd::grad({out.sum()}, {input}, {}, /*retain_graph=*/true,
                                                /*create_graph=*/true)[0];
  return torch::mse_loss(out, y) + 0.1 * g.pow(2).sum(1).mean();
}

// One step of `model` with the gradient penalty, as users vary it: at step
// 0 the full parameters are summoned between the penalty's gradient and
// backward; at step 1 a penalty is computed again after backward, only to be
// logged, before the optimizer steps (its graph is never differentiated);
// at step 2 backward runs twice through the same graph (retain_graph).
template <typename Model>
void penalty_step(Model& model, torch::optim::Optimizer& opt, const torch::Tensor& x,
                  const torch::Tensor& y, int step) {
  opt.zero_grad();
  const torch::Tensor loss = penalised_loss(model, x, y);
  if (step == 0) SummonFullParams full(*model.ptr());
  if (step == 2) loss.backward({}, /*retain_graph=*/true);
  loss.backward();
  if (step == 1) penalised_loss(model, x, y);
  opt.step();
}

// Trains a plain Net (seed 0) beside `root`'s model, each with SGD
// (`sgd`), for three steps: `step_fn(reference, ref_opt, opt, x, y, step)`
// steps both on the global batch (x, y) drawn from seed `step`, and compares.
template <typename StepFn>
void train_beside_plain(Unit& root, int world, const torch::optim::SGDOptions& sgd,
                        const StepFn& step_fn) {
  torch::manual_seed(0);
  Net reference(false, FSDPOptions());
  torch::optim::SGD ref_opt(reference->parameters(), sgd), opt(root.flat_parameters(), sgd);
  for (int step = 0; step < 3; ++step) {
    torch::manual_seed(step);
    const torch::Tensor x = torch::randn({4 * world, 7}), y = torch::randn({4 * world, 3});
    step_fn(reference, ref_opt, opt, x, y, step);
  }
}

// One plain training step of `model` on (x, y): zero_grad, MSE, backward, step.
template <typename Model>
void mse_step(Model& model, torch::optim::Optimizer& opt, const torch::Tensor& x,
              const torch::Tensor& y) {
  opt.zero_grad();
  torch::mse_loss(model->forward(x), y).backward();
  opt.step();
}

// Trains `model` (rooted at `root`) beside a plain Net with the gradient
// penalty (penalty_step), comparing after each step but the one whose
// logged graph the next forward must not read stale. Then checks that gradients
// of the parameters with create_graph are refused.
template <typename Model>
void expect_penalty_training(Model& model, Unit& root, int world, const std::string& what) {
  // SGD: its step follows the gradient's size, which Adam's first steps hide.
  train_beside_plain(root, world, torch::optim::SGDOptions(0.1).momentum(0.9),
                     [&](Net& reference, torch::optim::SGD& ref_opt, torch::optim::SGD& opt,
                         const torch::Tensor& x, const torch::Tensor& y, int step) {
                       penalty_step(reference, ref_opt, x, y, step);
                       penalty_step(model, opt, local_block(x), local_block(y), step);
                       // The next forward reads what the logged graph held.
                       if (step != 1) expect_same_after_step(*model.ptr(), *reference, what, step);
                     });
  const torch::Tensor x = local_block(torch::randn({4 * world, 7}));
  const std::string refused = error_of(
      [&] { model->forward(x).sum().backward({}, /*retain_graph=*/true, /*create_graph=*/true); });
  EXPECT_TRUE(
      contains(refused, "a backward with create_graph=true computed gradients of the parameters") &&
      contains(refused, "take the gradient of the inputs"))
      << what << ": " << refused;
}

// Runs `expect(model, root, what)` on the habit tests' models under every
// strategy: the wrapped Net with each of `kinds` ("flat" shards, "orig"
// for use_orig_params, "checkpointed" inner units), then the fully_shard one.
template <typename Expect>
void for_each_net(const std::vector<std::string>& kinds, const Expect& expect) {
  for (ShardingStrategy strategy : parity_strategies()) {
    for (const std::string& kind : kinds) {
      const FSDPOptions options =
          FSDPOptions().sharding_strategy(strategy).use_orig_params(kind == "orig");
      // Checkpointed: the inner units recompute their forward in backward.
      const FSDPOptions inner =
          FSDPOptions(options).activation_checkpointing(kind == "checkpointed");
      torch::manual_seed(0);
      FullyShardedDataParallel<NetImpl> model(std::make_shared<NetImpl>(true, inner), options);
      expect(model, *unit_of(*model), std::string(to_string(strategy)) + " " + kind);
    }
    torch::manual_seed(0);
    Net model(false, FSDPOptions());
    Unit& root = fully_shard(model, module_type_policy<nn::LinearImpl>(),
                             FSDPOptions().sharding_strategy(strategy));
    expect(model, root, std::string(to_string(strategy)) + " fully_shard");
  }
}

// Runs `expect(model, root, world, what)` at each world size, on every rank,
// for each model for_each_net makes.
template <typename Expect>
void expect_on_each_net(std::initializer_list<int> worlds, const std::vector<std::string>& kinds,
                        const Expect& expect) {
  for (int world : worlds) {
    run_ranks_ok(world, [&](int, int world) {
      join_test_group();
      for_each_net(kinds, [&](auto& model, Unit& root, const std::string& what) {
        expect(model, root, world, what);
      });
    });
  }
}

// Item 12: a gradient penalty (WGAN-GP, R1) differentiates through a graph
// that backward built: the units stay gathered for it (Note [Double
// backward]), for wrapped models (flat shards, use_orig_params, activation
// checkpointing) and fully_shard ones, under every strategy.
TEST(UserHabits, GradientPenaltyTrainsAsInPlainLibTorch) {
  expect_on_each_net({1, 2, 3}, {"flat", "orig", "checkpointed"},
                     [](auto& model, Unit& root, int world, const std::string& what) {
                       expect_penalty_training(model, root, world, what);
                     });
}

// A forward that no backward follows, between backward and the optimizer's
// step: a validation loss in grad mode (step 0), an evaluation under
// NoGradGuard (step 1), and both (step 2). It left the root (and under
// SHARD_GRAD_OP every unit) gathered through the step, so the next forward
// computed with the values from before it (Note [Gathered before a step]).
// Each step's outputs are compared after the loop's zero_grad and before
// it trains, and the parameters only at the end: a SummonFullParams after
// each step would end what the extra forward left open, hiding it. SGD,
// which counts no version: the clearing of the gradients tells the step,
// the optimizer's (none on 2.x, zeros in place on 1.13) or an own loop
// zeroing each .grad in place (step 2).
template <typename Model>
void expect_forwards_before_the_step_training(Model& model, Unit& root, int world,
                                              const std::string& what) {
  train_beside_plain(root, world, torch::optim::SGDOptions(0.1).momentum(0.9),
                     [&](Net& reference, torch::optim::SGD& ref_opt, torch::optim::SGD& opt,
                         const torch::Tensor& x, const torch::Tensor& y, int step) {
                       if (step == 2) {
                         for (auto& p : model->parameters()) {
                           if (p.grad().defined()) p.grad().zero_();
                         }
                       } else {
                         opt.zero_grad();
                       }
                       {
                         torch::NoGradGuard no_grad;
                         const torch::Tensor want = local_block(reference->forward(x));
                         const torch::Tensor got = model->forward(local_block(x));
                         EXPECT_TRUE(torch::allclose(got, want, 1e-5, 1e-6))
                             << what << " step " << step << ": "
                             << (got - want).abs().max().item<double>();
                       }
                       mse_step(reference, ref_opt, x, y);
                       torch::mse_loss(model->forward(local_block(x)), local_block(y)).backward();
                       const torch::Tensor held_out = local_block(x).flip(0) * 0.5;
                       if (step != 1)
                         (void)torch::mse_loss(model->forward(held_out), local_block(y));
                       if (step != 0) {
                         torch::NoGradGuard no_grad;
                         (void)model->forward(local_block(x));
                       }
                       opt.step();
                       if (step == 2) expect_same_after_step(*model.ptr(), *reference, what, step);
                     });
}

TEST(UserHabits, ForwardsWithoutBackwardBeforeTheStepAsInPlainLibTorch) {
  expect_on_each_net({1, 2}, {"flat", "orig"},
                     [](auto& model, Unit& root, int world, const std::string& what) {
                       expect_forwards_before_the_step_training(model, root, world, what);
                     });
}

// A review found full_state_dict (and a kFull checkpoint) after a logged
// penalty and the step saved the values from before the step: the units
// held for the penalty's graph were not gathered again under the state
// dict's reads.
TEST(UserHabits, StateDictAfterALoggedPenaltyHoldsTheStep) {
  expect_on_each_net(
      {2}, {"flat", "orig"}, [](auto& model, Unit& root, int world, const std::string& what) {
        train_beside_plain(root, world, torch::optim::SGDOptions(0.1).momentum(0.9),
                           [&](Net& reference, torch::optim::SGD& ref_opt, torch::optim::SGD& opt,
                               const torch::Tensor& x, const torch::Tensor& y, int step) {
                             const int as = step == 0 ? 0 : 1;  // summoned, then logged
                             penalty_step(reference, ref_opt, x, y, as);
                             penalty_step(model, opt, local_block(x), local_block(y), as);
                             if (step == 0) return;
                             const auto sd = full_state_dict(*model.ptr());
                             for (const auto& p : reference->named_parameters()) {
                               const torch::Tensor* got = sd.find(p.key());
                               ASSERT_NE(got, nullptr) << what << " " << p.key();
                               EXPECT_TRUE(torch::allclose(*got, p.value(), 1e-5, 1e-6))
                                   << what << " step " << step << " " << p.key();
                             }
                           });
      });
}

// Adversarial training trains `model` (rooted at `root`) as plain LibTorch
// trains a Net: each step's adversarial batch is the plain one's block, the
// input-only backward leaves every .grad as the step before left it (Note
// [Backward with respect to inputs]), and the step on it matches.
template <typename Model>
void expect_adversarial_training(Model& model, Unit& root, int world, const std::string& what) {
  train_beside_plain(root, world, torch::optim::SGDOptions(0.1).momentum(0.9).weight_decay(0.01),
                     [&](Net& reference, torch::optim::SGD& ref_opt, torch::optim::SGD& opt,
                         const torch::Tensor& x, const torch::Tensor& y, int step) {
                       const std::string at = what + " step " + std::to_string(step);
                       std::vector<torch::Tensor> grads;
                       for (const auto& p : root.flat_parameters()) {
                         grads.push_back(p.grad().defined() ? p.grad().clone() : torch::Tensor());
                       }
                       const torch::Tensor ref_adv = fgsm(reference, x, y);
                       const torch::Tensor adv = fgsm(model, local_block(x), local_block(y));
                       EXPECT_TRUE(torch::allclose(adv, local_block(ref_adv))) << at;
                       const auto params = root.flat_parameters();
                       for (size_t i = 0; i < params.size(); ++i) {
                         EXPECT_EQ(params[i].grad().defined(), grads[i].defined())
                             << at << " parameter " << i;
                         if (grads[i].defined())
                           EXPECT_TRUE(torch::equal(params[i].grad(), grads[i])) << at;
                       }
                       mse_step(reference, ref_opt, ref_adv, y);
                       mse_step(model, opt, adv, local_block(y));
                       expect_same_after_step(*model.ptr(), *reference, what, step);
                     });
}

TEST(UserHabits, AdversarialTrainingAsInPlainLibTorch) {
  expect_on_each_net({1, 2, 3}, {"flat", "orig", "checkpointed"},
                     [](auto& model, Unit& root, int world, const std::string& what) {
                       expect_adversarial_training(model, root, world, what);
                     });
}

// Two forwards of the whole model before one backward (siamese networks,
// contrastive losses, consistency regularisation): the loss compares the
// model's outputs on two views of the batch. Trains as plain LibTorch does,
// wrapped and fully_shard, every strategy, with a forward without backward
// (validation) between steps.
template <typename Model>
void expect_siamese_training(Model& model, Unit& root, int world, const std::string& what) {
  const auto loss_of = [](const torch::Tensor& a, const torch::Tensor& b, const torch::Tensor& y) {
    return torch::mse_loss(a, y) + 0.5 * (a - b).pow(2).mean();
  };
  train_beside_plain(root, world, torch::optim::SGDOptions(0.1).momentum(0.9).weight_decay(0.01),
                     [&](Net& reference, torch::optim::SGD& ref_opt, torch::optim::SGD& opt,
                         const torch::Tensor& x, const torch::Tensor& y, int step) {
                       const torch::Tensor view = x + 0.1 * torch::randn({4 * world, 7});
                       ref_opt.zero_grad();
                       loss_of(reference->forward(x), reference->forward(view), y).backward();
                       ref_opt.step();
                       opt.zero_grad();
                       loss_of(model->forward(local_block(x)), model->forward(local_block(view)),
                               local_block(y))
                           .backward();
                       opt.step();
                       {
                         torch::NoGradGuard no_grad;
                         model->forward(local_block(x));
                       }
                       expect_same_after_step(*model.ptr(), *reference, what, step);
                     });
}

TEST(UserHabits, TwoForwardsBeforeOneBackwardAsInPlainLibTorch) {
  expect_on_each_net({1, 2, 3}, {"flat", "orig"},
                     [](auto& model, Unit& root, int world, const std::string& what) {
                       expect_siamese_training(model, root, world, what);
                     });
}

// A backward on `model` that throws midway, as a check in a hook (or running
// out of memory) does: at the batch's input, the last gradient backward makes,
// on every rank alike. Returns the error.
template <typename Model>
std::string throwing_backward(Model& model, const torch::Tensor& x, const torch::Tensor& y) {
  const torch::Tensor input = x.clone().requires_grad_();
  input.register_hook([](torch::Tensor) -> torch::Tensor { TORCH_CHECK(false, "bad batch"); });
  return error_of([&] { torch::mse_loss(model->forward(input), y).backward(); });
}

// A batch whose backward throws is skipped and training goes on:
// model->zero_grad() after it discards what that backward left, in .grad and
// in units it had not reduced yet, as plain LibTorch's discards the .grad it
// left (which the next backward would add to).
template <typename Model>
void expect_skipped_batch_training(Model& model, Unit& root, int world, const std::string& what) {
  train_beside_plain(root, world, torch::optim::SGDOptions(0.1).momentum(0.9).weight_decay(0.01),
                     [&](Net& reference, torch::optim::SGD& ref_opt, torch::optim::SGD& opt,
                         const torch::Tensor& x, const torch::Tensor& y, int step) {
                       if (step == 1) {
                         EXPECT_CONTAINS(throwing_backward(reference, x, y), "bad batch");
                         EXPECT_CONTAINS(throwing_backward(model, local_block(x), local_block(y)),
                                         "bad batch");
                         reference->zero_grad();
                         model->zero_grad();
                       }
                       mse_step(reference, ref_opt, x, y);
                       mse_step(model, opt, local_block(x), local_block(y));
                       expect_same_after_step(*model.ptr(), *reference, what, step);
                     });
}

TEST(UserHabits, ABatchWhoseBackwardThrowsIsSkippedAsInPlainLibTorch) {
  expect_on_each_net({1, 2, 3}, {"flat", "orig"},
                     [](auto& model, Unit& root, int world, const std::string& what) {
                       expect_skipped_batch_training(model, root, world, what);
                     });
}

// The optimizer's zero_grad() reaches only the shards' .grad: what such a
// backward left in a unit it had not reduced would join the next gradient,
// so the next forward says so, once, naming the remedy.
TEST(UserHabits, UnreducedGradientsOfAThrowingBackwardAreNamed) {
  run_ranks_ok(1, [](int, int) {
    join_test_group();
    torch::manual_seed(0);
    FullyShardedDataParallel<NetImpl> model(std::make_shared<NetImpl>(true, FSDPOptions()),
                                            FSDPOptions());
    torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
    const torch::Tensor x = torch::randn({4, 7}), y = torch::randn({4, 3});
    std::vector<std::string> warnings;
    {
      WarningCollector collect(&warnings);
      EXPECT_CONTAINS(throwing_backward(model, x, y), "bad batch");
      opt.zero_grad();
      model->forward(x);
    }
    ASSERT_EQ(warnings.size(), 1u);
    EXPECT_CONTAINS(warnings[0], "call model->zero_grad() after a backward that throws");
  });
}

// Inference as LibTorch recommends it, under c10::InferenceMode: before the
// first training step (the model's first forward) and between steps. The
// outputs are plain LibTorch's, and training after it is too.
template <typename Model>
void expect_training_around_inference(Model& model, Unit& root, int world,
                                      const std::string& what) {
  train_beside_plain(root, world, torch::optim::SGDOptions(0.1).momentum(0.9),
                     [&](Net& reference, torch::optim::SGD& ref_opt, torch::optim::SGD& opt,
                         const torch::Tensor& x, const torch::Tensor& y, int step) {
                       {
                         c10::InferenceMode inference;
                         const torch::Tensor expected = reference->forward(x);
                         const torch::Tensor got = model->forward(local_block(x));
                         EXPECT_TRUE(torch::allclose(got, local_block(expected), 1.3e-6, 1e-5))
                             << what << " step " << step;
                       }
                       mse_step(reference, ref_opt, x, y);
                       mse_step(model, opt, local_block(x), local_block(y));
                       expect_same_after_step(*model.ptr(), *reference, what, step);
                     });
}

TEST(UserHabits, InferenceModeAroundTrainingAsInPlainLibTorch) {
  expect_on_each_net({1, 2}, {"flat", "orig"},
                     [](auto& model, Unit& root, int world, const std::string& what) {
                       expect_training_around_inference(model, root, world, what);
                     });
}

// What a unit makes in a forward under c10::InferenceMode (Note [Inference
// mode]): its first forward there allocates its buffers (compute copies
// under mixed precision, offload's copies), and the state dict and
// SummonFullParams taken there communicate. Training after them is bitwise
// the training without them, and the state dict is the one taken outside;
// a fully_shard model used first there trains as plain LibTorch.
TEST(UserHabits, InferenceModeFirstLeavesNothingTrainingCannotUse) {
  for (int world : {2, 3}) {
    run_ranks_ok(world, [](int, int world) {
      join_test_group();
      for (const bool orig : {false, true}) {
        const FSDPOptions options =
            FSDPOptions()
                .use_orig_params(orig)
                .mixed_precision(MixedPrecision().param_dtype(at::kBFloat16))
                .cpu_offload(CPUOffload().offload_params(true));
        const std::string what = orig ? "use_orig_params" : "flat";
        std::vector<std::vector<torch::Tensor>> params;
        for (const bool inference_first : {false, true}) {
          torch::manual_seed(0);
          FullyShardedDataParallel<NetImpl> model(std::make_shared<NetImpl>(true, options),
                                                  options);
          torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-2));
          torch::manual_seed(1);
          const torch::Tensor x = torch::randn({4 * world, 7}), y = torch::randn({4 * world, 3});
          if (inference_first) {
            c10::InferenceMode inference;
            model->forward(local_block(x));
            const auto inside = full_state_dict(*model.ptr());
            c10::InferenceMode off(false);
            const auto outside = full_state_dict(*model.ptr());
            ASSERT_EQ(inside.size(), outside.size()) << what;
            for (size_t i = 0; i < inside.size(); ++i) {
              EXPECT_TRUE(torch::equal(inside[i].value(), outside[i].value())) << what;
            }
          }
          if (inference_first) {
            c10::InferenceMode inference;
            SummonFullParams full(*model.ptr());
          }
          for (int step = 0; step < 2; ++step) {
            opt.zero_grad();
            torch::mse_loss(model->forward(local_block(x)).to(torch::kFloat), local_block(y))
                .backward();
            opt.step();
          }
          params.emplace_back();
          for (const auto& p : model->parameters()) params.back().push_back(p.detach().clone());
        }
        ASSERT_EQ(params[0].size(), params[1].size());
        for (size_t i = 0; i < params[0].size(); ++i) {
          EXPECT_TRUE(torch::equal(params[0][i], params[1][i])) << what << " parameter " << i;
        }
      }
      // A fully_shard model whose first use is a state dict and
      // SummonFullParams under the mode, then a forward there: it trains
      // as plain LibTorch afterwards.
      torch::manual_seed(0);
      Net reference(false, FSDPOptions());
      torch::manual_seed(0);
      Net model(false, FSDPOptions());
      Unit& root = fully_shard(model, module_type_policy<nn::LinearImpl>(), FSDPOptions());
      torch::manual_seed(1);
      const torch::Tensor x = torch::randn({4 * world, 7}), y = torch::randn({4 * world, 3});
      {
        c10::InferenceMode inference;
        const auto state = full_state_dict(*model);
        ASSERT_EQ(state.size(), reference->named_parameters().size());
        for (const auto& p : reference->named_parameters()) {
          EXPECT_TRUE(torch::equal(state[p.key()], p.value())) << p.key();
        }
        { SummonFullParams full(*model); }
        model->forward(local_block(x));
      }
      torch::optim::SGD ref_opt(reference->parameters(), 0.1), opt(root.flat_parameters(), 0.1);
      torch::mse_loss(reference->forward(x), y).backward();
      ref_opt.step();
      torch::mse_loss(model->forward(local_block(x)), local_block(y)).backward();
      opt.step();
      SummonFullParams full(*model);
      expect_same_params(*model, *reference, "fully_shard after inference mode");
    });
  }
}

// Mixed precision as LibTorch code writes it without FSDP's MixedPrecision:
// the forward under CPU autocast (bf16 matmuls of fp32 parameters), the
// loss and backward after it. Wrapped and fully_shard (whose parameters the
// autocast kernels cast through libfsdp's dispatch), every strategy: as
// plain LibTorch under the same autocast.
template <typename Model>
void expect_autocast_training(Model& model, Unit& root, int world, const std::string& what) {
  train_beside_plain(root, world, torch::optim::SGDOptions(0.1).momentum(0.9),
                     [&](Net& reference, torch::optim::SGD& ref_opt, torch::optim::SGD& opt,
                         const torch::Tensor& x, const torch::Tensor& y, int step) {
                       compat::set_cpu_autocast(true);
                       const torch::Tensor ref_out = reference->forward(x).to(torch::kFloat);
                       const torch::Tensor out = model->forward(local_block(x)).to(torch::kFloat);
                       compat::set_cpu_autocast(false);
                       ref_opt.zero_grad();
                       torch::mse_loss(ref_out, y).backward();
                       ref_opt.step();
                       opt.zero_grad();
                       torch::mse_loss(out, local_block(y)).backward();
                       opt.step();
                       if (world == 1) {
                         expect_same_after_step(*model.ptr(), *reference, what, step);
                         return;
                       }
                       // The gradients' sums over the batch are bf16 matmuls: over each
                       // rank's block, then averaged, they round apart from one over the
                       // whole batch (as DDP's do), by bf16's resolution times the step.
                       SummonFullParams full(*model.ptr());
                       const std::string at = what + " step " + std::to_string(step);
                       for (const auto& p : reference->named_parameters()) {
                         const torch::Tensor* got = model.ptr()->named_parameters().find(p.key());
                         ASSERT_NE(got, nullptr) << at << " " << p.key();
                         EXPECT_TRUE(torch::allclose(*got, p.value(), 1e-2, 2e-3))
                             << at << " " << p.key() << " max diff "
                             << (*got - p.value()).abs().max().item<double>();
                       }
                     });
}

TEST(UserHabits, CpuAutocastAsInPlainLibTorch) {
  {
    // LibTorch 1.13's CPU autocast cannot run the plain model (its LayerNorm
    // gets bf16 inputs and fp32 weights).
    Net plain(false, FSDPOptions());
    compat::set_cpu_autocast(true);
    const std::string error = error_of([&] { plain->forward(torch::randn({2, 7})); });
    compat::set_cpu_autocast(false);
    if (!error.empty()) GTEST_SKIP() << "plain LibTorch fails under CPU autocast: " << error;
  }
  expect_on_each_net({1, 2}, {"flat"},
                     [](auto& model, Unit& root, int world, const std::string& what) {
                       expect_autocast_training(model, root, world, what);
                     });
}

// A WGAN-GP step as usually written: the critic's scores, its gradient
// penalty, a score logged under no_grad (which reshards what it gathers)
// and the critic's backward; then the generator's loss through the critic.
template <typename G, typename D>
void wgan_gp_step(G& g, D& d, torch::optim::Optimizer& gopt, torch::optim::Optimizer& dopt,
                  const torch::Tensor& z, const torch::Tensor& real, const torch::Tensor& eps) {
  const auto critic = [&](const torch::Tensor& x) { return d->forward(x).sum(1); };
  dopt.zero_grad();
  const torch::Tensor fake = g->forward(z).detach();
  const torch::Tensor scores = critic(fake).mean() - critic(real).mean();
  const torch::Tensor mixed = (eps * real + (1 - eps) * fake).requires_grad_(true);
  const torch::Tensor slope =
      torch::autograd::grad({critic(mixed).sum()}, {mixed}, {}, true, /*create_graph=*/true)[0];
  const torch::Tensor penalty = (slope.norm(2, 1) - 1).pow(2).mean();
  {
    torch::NoGradGuard no_grad;
    critic(real);
  }
  (scores + 10 * penalty).backward();
  dopt.step();
  gopt.zero_grad();
  (-critic(g->forward(z)).mean()).backward();
  gopt.step();
}

// Two sharded models trained as a GAN: a fully_shard generator and a critic
// with nested units (wrapped, or fully_shard), under every strategy.
TEST(UserHabits, WganGpTrainsAsInPlainLibTorch) {
  for (int world : {1, 2, 3}) {
    run_ranks_ok(world, [](int, int world) {
      join_test_group();
      for (ShardingStrategy strategy : parity_strategies()) {
        for (bool wrapped : {true, false}) {
          const FSDPOptions options = FSDPOptions().sharding_strategy(strategy);
          const std::string what = std::string(to_string(strategy)) +
                                   (wrapped ? " wrapped critic" : " fully_shard critic");
          const auto generator = [] {
            return nn::Sequential(nn::Linear(5, 16), nn::Tanh(), nn::Linear(16, 7));
          };
          torch::manual_seed(0);
          nn::Sequential ref_g = generator();
          torch::manual_seed(0);
          nn::Sequential g = generator();
          Unit& g_root = fully_shard(g, module_type_policy<nn::LinearImpl>(), options);
          torch::manual_seed(1);
          Net ref_d(false, FSDPOptions());
          torch::manual_seed(1);
          FullyShardedDataParallel<NetImpl> wrapped_d(std::make_shared<NetImpl>(true, options),
                                                      options);
          const auto sgd = torch::optim::SGDOptions(0.01).momentum(0.5);
          torch::optim::SGD ref_gopt(ref_g->parameters(), sgd);
          torch::optim::SGD ref_dopt(ref_d->parameters(), sgd);
          torch::optim::SGD gopt(g_root.flat_parameters(), sgd);
          torch::manual_seed(1);
          Net plain_d(false, options);
          Unit& d_root = wrapped
                             ? *unit_of(*wrapped_d)
                             : fully_shard(plain_d, module_type_policy<nn::LinearImpl>(), options);
          torch::optim::SGD dopt(d_root.flat_parameters(), sgd);
          for (int step = 0; step < 3; ++step) {
            torch::manual_seed(step);
            const torch::Tensor z = torch::randn({4 * world, 5}),
                                real = torch::randn({4 * world, 7});
            const torch::Tensor eps = torch::rand({4 * world, 1});
            wgan_gp_step(ref_g, ref_d, ref_gopt, ref_dopt, z, real, eps);
            const torch::Tensor mine[] = {local_block(z), local_block(real), local_block(eps)};
            if (wrapped) {
              wgan_gp_step(g, wrapped_d, gopt, dopt, mine[0], mine[1], mine[2]);
            } else {
              wgan_gp_step(g, plain_d, gopt, dopt, mine[0], mine[1], mine[2]);
            }
            const std::string at = what + " step " + std::to_string(step);
            {
              SummonFullParams full(*g);
              expect_same_params(*g, *ref_g, at + " generator");
            }
            nn::Module& d = wrapped ? static_cast<nn::Module&>(*wrapped_d.ptr()) : *plain_d;
            SummonFullParams full(d);
            expect_same_params(d, *ref_d, at + " critic");
          }
        }
      }
    });
  }
}

// The same under bf16 parameters (fp32 shards and reduction), wrapped and
// fully_shard: within bf16's rounding of the fp32 reference after 3 steps.
TEST(UserHabits, GradientPenaltyUnderBf16) {
  run_ranks_ok(2, [](int, int world) {
    join_test_group();
    const FSDPOptions options =
        FSDPOptions().mixed_precision(MixedPrecision().param_dtype(torch::kBFloat16));
    for (bool wrapped : {true, false}) {
      torch::manual_seed(0);
      Net reference(false, FSDPOptions());
      torch::manual_seed(0);
      FullyShardedDataParallel<NetImpl> wrapper(std::make_shared<NetImpl>(true, options), options);
      torch::manual_seed(0);
      Net model(false, FSDPOptions());
      Unit& root = wrapped ? *unit_of(*wrapper)
                           : fully_shard(model, module_type_policy<nn::LinearImpl>(), options);
      const auto sgd = torch::optim::SGDOptions(0.1);
      torch::optim::SGD ref_opt(reference->parameters(), sgd), opt(root.flat_parameters(), sgd);
      for (int step = 0; step < 3; ++step) {
        torch::manual_seed(step);
        torch::Tensor x = torch::randn({4 * world, 7}), y = torch::randn({4 * world, 3});
        ref_opt.zero_grad();
        penalised_loss(reference, x, y).backward();
        ref_opt.step();
        opt.zero_grad();
        (wrapped ? penalised_loss(wrapper, local_block(x), local_block(y))
                 : penalised_loss(model, local_block(x), local_block(y)))
            .backward();
        opt.step();
      }
      nn::Module& sharded = wrapped ? static_cast<nn::Module&>(*wrapper.ptr()) : *model;
      SummonFullParams full(sharded);
      for (const auto& p : reference->named_parameters()) {
        const torch::Tensor mine = sharded.named_parameters()[p.key()].to(torch::kFloat);
        EXPECT_TRUE(torch::allclose(mine, p.value(), 0, 1e-2))
            << (wrapped ? "wrapped " : "fully_shard ") << p.key();
      }
    }
  });
}

// A linear layer written as a custom autograd Function, which saves the
// weight it is given for its own backward (its forward runs without grad
// mode, as every Function's does).
struct LinearFunction : torch::autograd::Function<LinearFunction> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x,
                               const torch::Tensor& weight, const torch::Tensor& bias) {
    ctx->save_for_backward({x, weight});
    return x.matmul(weight.t()) + bias;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const torch::Tensor& g = grads[0];
    return {g.matmul(saved[1]), g.t().matmul(saved[0]), g.sum(0)};
  }
};

struct FunctionBlockImpl : nn::Module {
  FunctionBlockImpl() { fc = register_module("fc", nn::Linear(8, 8)); }
  torch::Tensor forward(const torch::Tensor& x) {
    return x + torch::tanh(LinearFunction::apply(x, fc->weight, fc->bias));
  }
  nn::Linear fc{nullptr};
};
TORCH_MODULE(FunctionBlock);

struct FunctionNetImpl : nn::Module {
  FunctionNetImpl() {
    in = register_module("in", nn::Linear(5, 8));
    blocks = register_module("blocks", nn::ModuleList(FunctionBlock(), FunctionBlock()));
    out = register_module("out", nn::Linear(8, 2));
  }
  torch::Tensor forward(torch::Tensor x) {
    x = in(x);
    for (const auto& block : *blocks) x = block->as<FunctionBlockImpl>()->forward(x);
    return out(x);
  }
  nn::Linear in{nullptr}, out{nullptr};
  nn::ModuleList blocks{nullptr};
};
TORCH_MODULE(FunctionNet);

// Item 13: a unit whose parameters only a custom autograd Function uses (its
// forward runs without grad mode, so no output of theirs needs a gradient)
// trains as plain LibTorch, fully_shard and wrapped, every strategy; also
// under FULL_SHARD with set_unshard_in_backward(false) on those units, whose
// backward reads the saved weight all the same (gathered at that read: Note
// [Units backward does not gather]).
TEST(UserHabits, CustomAutogradFunctionsOnUnitParameters) {
  for (int world : {1, 2, 3}) {
    run_ranks_ok(world, [](int, int world) {
      join_test_group();
      std::vector<std::pair<ShardingStrategy, bool>> cases;
      for (ShardingStrategy strategy : parity_strategies()) cases.emplace_back(strategy, true);
      cases.emplace_back(ShardingStrategy::kFullShard, false);
      for (const auto& [strategy, unshard_in_backward] : cases) {
        const FSDPOptions options = FSDPOptions().sharding_strategy(strategy);
        torch::manual_seed(0);
        FunctionNet reference;
        torch::manual_seed(0);
        FunctionNet model;
        Unit& root = fully_shard(model, module_type_policy<FunctionBlockImpl>(), options);
        for (const auto& block : *model->blocks) {
          unit_of(*block)->set_unshard_in_backward(unshard_in_backward);
        }
        const auto sgd = torch::optim::SGDOptions(0.1).momentum(0.9);
        torch::optim::SGD ref_opt(reference->parameters(), sgd), opt(root.flat_parameters(), sgd);
        for (int step = 0; step < 3; ++step) {
          torch::manual_seed(step);
          const torch::Tensor x = torch::randn({4 * world, 5}), y = torch::randn({4 * world, 2});
          ref_opt.zero_grad();
          torch::mse_loss(reference->forward(x), y).backward();
          ref_opt.step();
          opt.zero_grad();
          torch::mse_loss(model->forward(local_block(x)), local_block(y)).backward();
          opt.step();
          SummonFullParams full(*model);
          expect_same_params(*model, *reference,
                             std::string(to_string(strategy)) +
                                 (unshard_in_backward ? "" : " not gathered in backward") +
                                 " step " + std::to_string(step));
        }
      }
    });
  }
}

// A Cloneable model, as LibTorch code that clones models writes them:
// reset() builds the children, units when `wrap` is set.
struct CloneNetImpl : nn::Cloneable<CloneNetImpl> {
  explicit CloneNetImpl(bool wrap = false) : wrap_(wrap) { reset(); }
  void reset() override {
    fc = register_module("fc", nn::Linear(7, 16));
    nn::Linear block_linear(16, 16);
    block = wrap_ ? nn::AnyModule(FullyShardedDataParallel<nn::LinearImpl>(block_linear))
                  : nn::AnyModule(block_linear);
    register_module("block", block.ptr());
    head = register_module("head", nn::Linear(16, 3));
  }
  torch::Tensor forward(torch::Tensor x) {
    return head(torch::relu(block.forward(torch::relu(fc(x)))));
  }
  bool wrap_;
  nn::Linear fc{nullptr}, head{nullptr};
  nn::AnyModule block;
};
TORCH_MODULE(CloneNet);

// Item 14: model->clone() for a target network. A wrapper refuses, naming
// the ways that work, as does a wrapped module's clone() reaching nested
// units (which would otherwise come back freshly initialised); the way it
// names gives the full parameters; a fully_shard model clones as LibTorch
// does, into a plain copy that stays put while the original trains.
TEST(UserHabits, CloningAModelForATargetNetwork) {
  run_ranks_ok(2, [](int, int world) {
    join_test_group();
    torch::manual_seed(0);
    CloneNet reference;
    torch::manual_seed(0);
    FullyShardedDataParallel<CloneNetImpl> model(std::make_shared<CloneNetImpl>(true));
    const std::string refused = error_of([&] { model->clone(); });
    EXPECT_TRUE(contains(refused, "cannot clone the FSDP unit around a") &&
                contains(refused, "fsdp::load_full_state_dict(copy, fsdp::full_state_dict(model))"))
        << refused;
    const std::string nested = error_of([&] {
      SummonFullParams full(*model.ptr());
      model->module().clone();
    });
    EXPECT_TRUE(contains(nested, "cannot clone the FSDP unit around a torch::nn::LinearImpl"))
        << nested;
    // A pass-through wrapper (no unit) would keep fresh values the same way.
    FullyShardedDataParallel<nn::LinearImpl> pass(nn::Linear(2, 2), FSDPOptions(),
                                                  /*enabled=*/false);
    const std::string passing = error_of([&] { pass->clone(); });
    EXPECT_TRUE(contains(passing, "cannot clone the pass-through FSDP wrapper around a"))
        << passing;
    auto opt = adamw(model->parameters());
    auto ref_opt = adamw(reference->parameters());
    train_step(reference, *ref_opt, model, *opt, 0, world);
    // The way the error names: a plain twin with the full parameters.
    torch::manual_seed(5);
    CloneNet target;
    load_full_state_dict(*target, full_state_dict(*model.ptr()));
    expect_same_params(*target, *reference, "target from full_state_dict");

    torch::manual_seed(0);
    CloneNet sharded;
    Unit& root = fully_shard(sharded, module_type_policy<nn::LinearImpl>());
    auto fs_opt = adamw(root.flat_parameters());
    train_step(reference, *ref_opt, sharded, *fs_opt, 1, world);
    std::shared_ptr<nn::Module> copy;
    {
      SummonFullParams full(*sharded);
      copy = sharded->clone();
    }
    EXPECT_EQ(unit_of(*copy), nullptr) << "the clone is a plain model";
    SummonFullParams full(*sharded);
    expect_same_params(*copy, *sharded, "fully_shard clone");
  });
}

// A sparse embedding (torch::nn::Embedding with sparse(true), whose backward
// makes a sparse gradient) inside a unit: it trains as in plain LibTorch
// (there with sparse gradients; here densified into the unit's flat
// gradient), wrapped, with use_orig_params and fully_shard, at 1-3 ranks.
// It failed with LibTorch's "reshape is not implemented for sparse tensors".
struct SparseNetImpl : nn::Module {
  SparseNetImpl() {
    table = register_module("table", nn::Embedding(nn::EmbeddingOptions(12, 6).sparse(true)));
    head = register_module("head", nn::Linear(6, 2));
  }
  torch::Tensor forward(const torch::Tensor& ids) { return head(table(ids)).sum(1); }
  nn::Embedding table{nullptr};
  nn::Linear head{nullptr};
};
TORCH_MODULE(SparseNet);

TEST(UserHabits, SparseEmbeddingTrainsAsInPlainLibTorch) {
  in_parity_ranks([] {
    const int world = rank_and_world().second;
    for (const char* kind : {"wrapped", "use_orig_params", "fully_shard"}) {
      torch::manual_seed(0);
      SparseNet reference;
      torch::manual_seed(0);
      SparseNet plain;
      const auto options = FSDPOptions().use_orig_params(std::string(kind) == "use_orig_params");
      FullyShardedDataParallel<SparseNetImpl> wrapper{nullptr};
      std::vector<torch::Tensor> params;
      if (std::string(kind) == "fully_shard") {
        params = fully_shard(plain, options).flat_parameters();
      } else {
        torch::manual_seed(0);
        wrapper = FullyShardedDataParallel<SparseNetImpl>(SparseNet(), options);
        params = wrapper->parameters();
      }
      const auto sgd = torch::optim::SGDOptions(0.02).momentum(0.9);
      torch::optim::SGD ref_opt(reference->parameters(), sgd), opt(params, sgd);
      nn::Module& model = wrapper ? static_cast<nn::Module&>(*wrapper) : *plain;
      for (int step = 0; step < 3; ++step) {
        torch::manual_seed(step);
        const torch::Tensor ids = torch::randint(12, {4 * world, 3});
        ref_opt.zero_grad();
        reference->forward(ids).pow(2).mean().backward();  // the ranks' mean
        ASSERT_TRUE(reference->table->weight.grad().is_sparse());
        ref_opt.step();
        opt.zero_grad();
        const torch::Tensor local = local_block(ids);
        (wrapper ? wrapper->forward(local) : plain->forward(local)).pow(2).mean().backward();
        opt.step();
        expect_same_after_step(model, *reference, kind, step);
      }
    }
  });
}

// NetImpl whose forward runs fc1 (a unit when wrapped) under NoGradGuard:
// a frozen feature extractor, as users freeze one without requires_grad.
// Its parameters keep no gradient (weight decay and momentum leave them),
// as in plain LibTorch, every strategy, flat and use_orig_params.
struct FrozenFeaturesImpl : NetImpl {
  using NetImpl::NetImpl;
  torch::Tensor forward(torch::Tensor input) {
    torch::Tensor x;
    {
      torch::NoGradGuard no_grad;
      x = torch::relu(fc1.forward(input));
    }
    x = x + (plain_block ? plain_block->forward(x) : block.forward(x));
    return head(x) * scale;
  }
};
TORCH_MODULE(FrozenFeatures);

TEST(UserHabits, FeatureExtractorUnderNoGradAsInPlainLibTorch) {
  for (int world : {1, 2, 3}) {
    run_ranks_ok(world, [](int, int world) {
      join_test_group();
      for (ShardingStrategy strategy : parity_strategies()) {
        for (const bool orig : {false, true}) {
          const FSDPOptions options =
              FSDPOptions().sharding_strategy(strategy).use_orig_params(orig);
          torch::manual_seed(0);
          FrozenFeatures reference(false, FSDPOptions());
          torch::manual_seed(0);
          FullyShardedDataParallel<FrozenFeaturesImpl> model(
              std::make_shared<FrozenFeaturesImpl>(true, options), options);
          const auto sgd = torch::optim::SGDOptions(0.1).momentum(0.9).weight_decay(0.1);
          torch::optim::SGD ref_opt(reference->parameters(), sgd), opt(model->parameters(), sgd);
          for (int step = 0; step < 3; ++step) {
            torch::manual_seed(step);
            torch::Tensor x = torch::randn({4 * world, 7}), y = torch::randn({4 * world, 3});
            ref_opt.zero_grad();
            torch::mse_loss(reference->forward(x), y).backward();
            ref_opt.step();
            opt.zero_grad();
            torch::mse_loss(model->forward(local_block(x)), local_block(y)).backward();
            opt.step();
            SummonFullParams full(*model.ptr());
            expect_same_params(*model.ptr(), *reference,
                               std::string(to_string(strategy)) + (orig ? " orig" : "") + " step " +
                                   std::to_string(step));
          }
        }
      }
    });
  }
}

}  // namespace test_user_habits
}  // namespace fsdp::testing
