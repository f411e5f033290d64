// ShardedGradScaler (PyTorch's, for LibTorch, which has no GradScaler):
// scaled training equals plain LibTorch's unscaled training (1-3 ranks, every
// strategy, wrapped and fully_shard, with clipping between unscale_ and step);
// an inf in one rank's shard skips the step on every rank, where a check of
// each rank's own shards would split them; float16 gradients that flush to
// zero unscaled train as float32 with the scaler; its bookkeeping, errors and
// torch::save.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <sstream>
#include <string>
#include <vector>

#include <fsdp/fsdp.h>

#include "comm/agreement.h"
#include "error_of.h"
#include "float16_scaling.h"
#include "multi_rank.h"
#include "parity_ranks.h"
#include "test_models.h"

namespace fsdp::testing {
namespace test_sharded_grad_scaler {

namespace nn = torch::nn;

using float16_scaling::Sharded;

torch::Tensor global_batch(int step, int world) {
  torch::manual_seed(step);
  return torch::randn({4 * world, 7});
}

bool all_finite(torch::optim::Optimizer& opt) {
  for (auto& group : opt.param_groups()) {
    for (auto& p : group.params()) {
      if (p.grad().defined() && !p.grad().isfinite().all().item<bool>()) return false;
    }
  }
  return true;
}

// Every step: scale, backward, unscale_, clip, step, update, against plain
// LibTorch without a scaler on all ranks' data. The scale (a power of two,
// growing every other step) neither overflows nor underflows, so scaling is
// exact and the trajectories agree to float rounding. Clipping reads the
// unscaled gradients: its norm equals the reference's (it would be 4096x with
// unscale_() doing nothing; the clipped step alone cannot tell). Flat
// shards, use_orig_params and CPU offload, wrapped and fully_shard.
TEST(ShardedGradScaler, TrainsAsPlainLibTorch) {
  in_parity_ranks([] {
    const int world = rank_and_world().second;
    enum class Kind { kFlat, kOrigParams, kOffload, kFullyShard };
    for (const ShardingStrategy strategy : parity_strategies()) {
      for (const Kind kind : {Kind::kFlat, Kind::kOrigParams, Kind::kOffload, Kind::kFullyShard}) {
        if (kind == Kind::kOffload && strategy == ShardingStrategy::kNoShard) continue;
        torch::manual_seed(0);
        Net reference(false, FSDPOptions());
        const FSDPOptions options =
            FSDPOptions()
                .sharding_strategy(strategy)
                .use_orig_params(kind == Kind::kOrigParams)
                .cpu_offload(CPUOffload().offload_params(kind == Kind::kOffload));
        Sharded model(kind != Kind::kFullyShard, options);
        const auto sgd = torch::optim::SGDOptions(0.05).momentum(0.9).weight_decay(0.01);
        torch::optim::SGD ref_opt(reference->parameters(), sgd);
        // Per-parameter views of the shards under use_orig_params.
        torch::optim::SGD opt(model.root.flat_parameters(), sgd);
        ShardedGradScaler scaler(GradScalerOptions().init_scale(4096).growth_interval(2));
        const std::string what = model.name() + " " + to_string(strategy) +
                                 (kind == Kind::kOrigParams ? " use_orig_params"
                                  : kind == Kind::kOffload  ? " offload"
                                                            : "");
        for (int step = 0; step < 4; ++step) {
          const torch::Tensor x = global_batch(step, world);
          ref_opt.zero_grad();
          (reference->forward(x).pow(2).sum() / world).backward();
          const double ref_norm = nn::utils::clip_grad_norm_(reference->parameters(), 0.5);
          ref_opt.step();

          model.module().zero_grad();  // the habit; the optimizer's zero_grad() elsewhere
          scaler.scale(model.forward(local_block(x)).pow(2).sum()).backward();
          scaler.unscale_(opt);
          const double norm = model.root.clip_grad_norm_(0.5);
          EXPECT_NEAR(norm, ref_norm, 1e-5 * ref_norm) << what << " step " << step;
          EXPECT_GT(norm, 0.5) << what;  // clipping is active
          EXPECT_TRUE(scaler.step(opt));
          scaler.update();
          expect_same_after_step(model.module(), *reference, what, step);
        }
        EXPECT_EQ(scaler.get_scale(), 4096 * 4);  // grown twice
      }
    }
  });
}

// Gradient accumulation: two micro-batches per step, the first inside
// no_sync(), both scaled; then one step. As plain LibTorch on both.
TEST(ShardedGradScaler, AccumulatesUnderNoSync) {
  run_ranks_ok(2, [](int, int world) {
    join_test_group();
    torch::manual_seed(0);
    Net reference(false, FSDPOptions());
    Sharded model(true, FSDPOptions());
    const auto sgd = torch::optim::SGDOptions(0.05).momentum(0.9);
    torch::optim::SGD ref_opt(reference->parameters(), sgd);
    torch::optim::SGD opt(model.root.flat_parameters(), sgd);
    ShardedGradScaler scaler(GradScalerOptions().init_scale(1 << 20));
    for (int step = 0; step < 3; ++step) {
      const torch::Tensor a = global_batch(2 * step, world), b = global_batch(2 * step + 1, world);
      ref_opt.zero_grad();
      ((reference->forward(a).pow(2).sum() + reference->forward(b).pow(2).sum()) / world)
          .backward();
      ref_opt.step();

      opt.zero_grad();
      {
        auto guard = model.root.no_sync();
        scaler.scale(model.forward(local_block(a)).pow(2).sum()).backward();
      }
      scaler.scale(model.forward(local_block(b)).pow(2).sum()).backward();
      EXPECT_TRUE(scaler.step(opt));
      scaler.update();
      expect_same_after_step(model.module(), *reference, "no_sync", step);
    }
  });
}

// An error in unscale_() on one rank (here a sparse gradient only rank 1's
// optimizer holds) is an error on every rank, not a rank left alone in the
// agreement: the others say another rank failed, and the step is skipped on
// all.
TEST(ShardedGradScaler, AnErrorOnOneRankIsAnErrorOnEvery) {
  run_ranks_ok(2, [](int rank, int) {
    join_test_group();
    nn::Linear layer(3, 2);
    nn::Embedding table(nn::EmbeddingOptions(4, 2).sparse(true));
    std::vector<torch::Tensor> params = layer->parameters();
    if (rank == 1) params.push_back(table->weight);
    torch::optim::SGD opt(params, torch::optim::SGDOptions(0.1));
    ShardedGradScaler scaler;
    (scaler.scale(layer(torch::ones({1, 3})).sum() + table(torch::tensor({1})).sum())).backward();
    EXPECT_CONTAINS(
        error_of([&] { scaler.unscale_(opt); }),
        rank == 1 ? "a sparse gradient cannot be unscaled" : "unscale_() failed on another rank");
    const torch::Tensor before = layer->weight.detach().clone();
    EXPECT_FALSE(scaler.step(opt));
    EXPECT_TRUE(torch::equal(layer->weight, before));
    scaler.update();
    EXPECT_EQ(scaler.get_scale(), 32768);
  });
}

// The scale doubles every step until the largest gradient element overflows
// float32. That element lies in one rank's shard: the ranks' own checks
// disagree (asserted, so the case is real), yet every rank skips that step
// and backs off alike, and the training equals plain LibTorch's taking the
// same steps. Without the agreement one rank steps its shard and the others
// do not: the parameters differ from the reference.
TEST(ShardedGradScaler, AnInfInOneRanksShardSkipsTheStepOnEveryRank) {
  for (const int world : {2, 3}) {
    run_ranks_ok(world, [](int, int world) {
      auto group = join_test_group();
      for (const ShardingStrategy strategy :
           {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp}) {
        for (const bool wrapped : {true, false}) {
          const std::string what = std::string(wrapped ? "wrapped " : "fully_shard ") +
                                   to_string(strategy) + " at " + std::to_string(world);
          torch::manual_seed(0);
          Net reference(false, FSDPOptions());
          Sharded model(wrapped, FSDPOptions().sharding_strategy(strategy));
          const auto sgd = torch::optim::SGDOptions(1e-5).momentum(0.9);
          torch::optim::SGD ref_opt(reference->parameters(), sgd);
          torch::optim::SGD opt(model.root.flat_parameters(), sgd);
          ShardedGradScaler scaler(
              GradScalerOptions().init_scale(std::ldexp(1.0, 120)).growth_interval(1));
          int split = 0, skipped = 0;
          for (int step = 0; step < 16; ++step) {
            torch::Tensor x = global_batch(step, world);
            x.select(1, 0).mul_(100);  // feature 0's weights get the largest gradients
            // Targets off the current output by a little: a small loss (its
            // scaled value stays finite) with large gradients.
            const torch::Tensor y =
                reference->forward(x).detach() + 0.1 * torch::randn({4 * world, 3});
            const double scale = scaler.get_scale();
            opt.zero_grad();
            scaler.scale((model.forward(local_block(x)) - local_block(y)).pow(2).sum()).backward();
            const bool finite_here = all_finite(opt);
            const auto finite = detail::agree_gather(group.get(), {finite_here ? 1 : 0});
            const auto n_finite = std::count(finite.begin(), finite.end(), 1);
            split += n_finite != 0 && n_finite != world ? 1 : 0;
            const bool stepped = scaler.step(opt);
            scaler.update();
            ASSERT_EQ(stepped, n_finite == world) << what;
            EXPECT_EQ(scaler.get_scale(), stepped ? 2 * scale : scale / 2) << what;
            skipped += stepped ? 0 : 1;

            ref_opt.zero_grad();
            ((reference->forward(x) - y).pow(2).sum() / world).backward();
            if (stepped) ref_opt.step();
            expect_same_after_step(model.module(), *reference, what, step);
          }
          EXPECT_GT(split, 0) << what << ": no step had an inf in some shards only";
          EXPECT_GT(skipped, 0) << what;
          EXPECT_LT(skipped, 16) << what;
        }
      }
    });
  }
}

// A model on a group that is not the default one (init_process_group with
// set_default(false), as docs/communication.md shows) and a scaler given no
// group: PyTorch's scaler agrees over the world group, which FSDP always has;
// this one would have let each rank skip alone (a review found the shards
// drifting apart silently). It is refused, naming the fix, and with the
// model's group it trains.
TEST(ShardedGradScaler, AScalerWithoutTheModelsGroupIsRefused) {
  run_ranks_ok(2, [](int rank, int) {
    auto pg = init_process_group(
        ProcessGroupOptions().timeout(std::chrono::seconds(30)).set_default(false));
    ASSERT_FALSE(is_initialized());
    torch::manual_seed(0);
    const auto o = FSDPOptions().process_group(pg);
    FullyShardedDataParallel<nn::LinearImpl> model(nn::Linear(6, 3), o);
    torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
    const auto loss = [&] { return model->forward(torch::randn({3, 6}) * (rank + 1)).sum(); };
    ShardedGradScaler lone;
    lone.scale(loss()).backward();
    const std::string error = error_of([&] { lone.step(opt); });
    EXPECT_CONTAINS(error, "the scaler has no process group");
    EXPECT_CONTAINS(error, "GradScalerOptions().process_group(pg)");
    ShardedGradScaler scaler(GradScalerOptions().process_group(pg));
    opt.zero_grad();
    scaler.scale(loss()).backward();
    EXPECT_TRUE(scaler.step(opt));
    scaler.update();
  });
}

// Float16 parameters (float32 shards and reduction) with a loss whose
// gradients are below float16's smallest subnormal (float16_scaling.h).
TEST(ShardedGradScaler, Float16GradientsTrainWithTheScale) {
  try {
    (void)torch::ones({2, 2}, torch::kHalf).mm(torch::ones({2, 2}, torch::kHalf));
  } catch (const c10::Error&) {
    GTEST_SKIP() << "this LibTorch has no float16 matrix product on the CPU";
  }
  run_ranks_ok(2, [](int, int) {
    join_test_group();
    float16_scaling::expect_float16_trains_with_scale(torch::kCPU);
  });
}

// The bookkeeping of PyTorch's GradScaler, its errors, disabled scalers and
// torch::save / torch::load, in one process without a group.
TEST(ShardedGradScaler, BookkeepingErrorsAndSaving) {
  {
    // A float16 loss per sample scales in float32 (65536 is inf in float16).
    ShardedGradScaler scaler;
    const torch::Tensor scaled = scaler.scale(torch::ones({3}, torch::kHalf));
    EXPECT_EQ(scaled.scalar_type(), torch::kFloat);
    EXPECT_TRUE(scaled.eq(65536).all().item<bool>());
    EXPECT_EQ(scaler.scale(torch::ones({}, torch::kDouble)).scalar_type(), torch::kDouble);
  }
  EXPECT_CONTAINS(error_of([] { ShardedGradScaler(GradScalerOptions().growth_factor(1.0)); }),
                  "fsdp(grad scaler): growth_factor must be above 1, got 1");
  EXPECT_CONTAINS(error_of([] { ShardedGradScaler(GradScalerOptions().backoff_factor(1.5)); }),
                  "backoff_factor must be between 0 and 1");
  EXPECT_CONTAINS(error_of([] { ShardedGradScaler(GradScalerOptions().init_scale(1e40)); }),
                  "init_scale must be a positive float32 number");
  EXPECT_CONTAINS(error_of([] { ShardedGradScaler(GradScalerOptions().growth_interval(0)); }),
                  "growth_interval must be positive");

  nn::Linear layer(3, 2);
  // A 0-dim parameter (a learned temperature) and a float64 one beside the layer.
  torch::Tensor temperature = torch::ones({}, torch::requires_grad());
  torch::Tensor bias64 = torch::zeros({2}, torch::dtype(torch::kDouble).requires_grad(true));
  std::vector<torch::Tensor> params = layer->parameters();
  params.push_back(temperature);
  params.push_back(bias64);
  torch::optim::SGD opt(params, torch::optim::SGDOptions(0.1));
  ShardedGradScaler scaler(GradScalerOptions().init_scale(8).growth_interval(3));
  // A float16 loss scales in float32: 65536 times 2 would be inf in float16.
  EXPECT_EQ(ShardedGradScaler().scale(torch::full({}, 2.0, torch::kHalf)).item<float>(), 131072);
  EXPECT_CONTAINS(error_of([&] { scaler.update(); }), "update() found no gradient checked");
  scaler.scale((layer(torch::ones({1, 3})) * temperature + bias64).sum()).backward();
  std::vector<torch::Tensor> scaled_grads;
  for (const auto& p : params) scaled_grads.push_back(p.grad().clone());
  scaler.unscale_(opt);
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_TRUE(torch::equal(params[i].grad() * 8, scaled_grads[i])) << "parameter " << i;
  }
  EXPECT_CONTAINS(error_of([&] { scaler.unscale_(opt); }),
                  "unscale_() has already been called on this optimizer since the last update()");
  EXPECT_TRUE(scaler.step(opt));  // after unscale_, step() does not unscale again
  EXPECT_CONTAINS(error_of([&] { scaler.step(opt); }), "step() has already been called");
  EXPECT_CONTAINS(error_of([&] { scaler.unscale_(opt); }),
                  "unscale_() is being called after step()");
  scaler.update();
  EXPECT_EQ(scaler.growth_tracker(), 1);

  // An inf gradient: skipped, backed off, the growth count restarts.
  opt.zero_grad();
  scaler.scale(layer(torch::full({1, 3}, INFINITY)).sum()).backward();
  const torch::Tensor before = layer->weight.detach().clone();
  EXPECT_FALSE(scaler.step(opt));
  EXPECT_TRUE(torch::equal(layer->weight, before));
  scaler.update();
  EXPECT_EQ(scaler.get_scale(), 4);
  EXPECT_EQ(scaler.growth_tracker(), 0);
  scaler.update(1024.0);
  EXPECT_EQ(scaler.get_scale(), 1024);

  // torch::save and torch::load keep the scale and the growth count.
  opt.zero_grad();
  scaler.scale(layer(torch::ones({1, 3})).sum()).backward();
  scaler.step(opt);
  scaler.update();
  std::stringstream saved;
  torch::save(scaler, saved);
  ShardedGradScaler loaded;
  torch::load(loaded, saved);
  EXPECT_EQ(loaded.get_scale(), 1024);
  EXPECT_EQ(loaded.growth_tracker(), 1);
  EXPECT_EQ(loaded.options().growth_interval(), 3);

  // PyTorch's state_dict, and what a wrong one is told.
  auto state = loaded.state_dict();
  EXPECT_EQ(state.at("scale"), 1024);
  EXPECT_EQ(state.at("_growth_tracker"), 1);
  state.erase("growth_factor");
  EXPECT_CONTAINS(error_of([&] { loaded.load_state_dict(state); }),
                  "the saved state has no 'growth_factor'");
  state["growth_factor"] = 0.5;
  EXPECT_CONTAINS(error_of([&] { loaded.load_state_dict(state); }),
                  "the saved growth_factor must be above 1, got 0.5. Load what an enabled scaler");
  EXPECT_EQ(loaded.get_scale(), 1024);  // a refused state changes nothing

  // A state loaded between unscale_() and step() leaves what unscale_() did
  // (PyTorch's too): step() does not unscale again.
  opt.zero_grad();
  scaler.scale(layer(torch::ones({1, 3})).sum()).backward();
  scaler.unscale_(opt);
  const torch::Tensor unscaled = layer->weight.grad().clone();
  scaler.load_state_dict(scaler.state_dict());
  EXPECT_TRUE(scaler.step(opt));
  EXPECT_TRUE(torch::equal(layer->weight.grad(), unscaled));
  scaler.update();

  // Disabled: the loss as it is, a plain step, nothing saved or loaded.
  ShardedGradScaler off(GradScalerOptions().enabled(false));
  const torch::Tensor loss = layer(torch::ones({1, 3})).sum();
  EXPECT_TRUE(off.scale(loss).is_same(loss));
  EXPECT_EQ(off.get_scale(), 1.0);
  std::stringstream nothing;
  torch::save(off, nothing);
  EXPECT_CONTAINS(error_of([&] { torch::load(loaded, nothing); }),
                  "the saved state is empty (saved from a disabled scaler)");
  std::stringstream again;  // a disabled scaler ignores a state, as PyTorch's
  torch::save(scaler, again);
  torch::load(off, again);
  EXPECT_EQ(off.get_scale(), 1.0);
  EXPECT_FALSE(off.is_enabled());
}

// Checkpointer::register_state(name, scaler): the scale, the growth count
// and the factors come back with resume(), in the ranks that resume.
TEST(ShardedGradScaler, CheckpointerKeepsTheScale) {
  MultiRankOptions with_dir;
  const std::string dir = shared_temp_dir(with_dir, "scaler");
  ASSERT_FALSE(dir.empty());
  const std::string off_dir = dir + "_off";  // a parent of its own
  run_ranks_ok(
      2,
      [&dir, &off_dir](int, int world) {
        join_test_group();
        {
          Sharded model(true, FSDPOptions());
          torch::optim::SGD opt(model.root.flat_parameters(), torch::optim::SGDOptions(0.01));
          ShardedGradScaler scaler(GradScalerOptions().init_scale(1024).growth_interval(3));
          Checkpointer ckpt(model.module(), &opt);
          ckpt.register_state("scaler", scaler);
          for (int step = 0; step < 4; ++step) {
            opt.zero_grad();
            scaler.scale(model.forward(local_block(global_batch(step, world))).sum()).backward();
            scaler.step(opt);
            scaler.update();
          }
          ASSERT_EQ(scaler.get_scale(), 2048);
          ckpt.save_step(dir, 4);
        }
        Sharded model(true, FSDPOptions());
        torch::optim::SGD opt(model.root.flat_parameters(), torch::optim::SGDOptions(0.01));
        ShardedGradScaler scaler;
        Checkpointer ckpt(model.module(), &opt);
        ckpt.register_state("scaler", scaler);
        EXPECT_EQ(ckpt.resume(dir), 4);
        EXPECT_EQ(scaler.get_scale(), 2048);
        EXPECT_EQ(scaler.growth_tracker(), 1);
        EXPECT_EQ(scaler.options().growth_interval(), 3);
        // A run resumed without float16 (the scaler disabled) ignores the
        // saved scale, as PyTorch's load_state_dict does.
        Sharded fp32_model(true, FSDPOptions());
        ShardedGradScaler off(GradScalerOptions().enabled(false));
        Checkpointer fp32_ckpt(fp32_model.module());
        fp32_ckpt.register_state("scaler", off);
        EXPECT_EQ(fp32_ckpt.resume(dir), 4);
        EXPECT_EQ(off.get_scale(), 1.0);
        // What a disabled scaler saved, resumed with an enabled one: refused
        // before anything loads (a review found the model and the optimizer
        // loaded first, then the error asking to load again, which failed
        // alike).
        fp32_ckpt.save_step(off_dir, 5);
        for (auto& p : model.root.flat_parameters()) p.data().fill_(0.5);
        const std::string refused = error_of([&] { ckpt.resume(off_dir); });
        EXPECT_CONTAINS(refused, "saved from a disabled scaler");
        for (const auto& p : model.root.flat_parameters()) {
          EXPECT_TRUE(p.eq(0.5).all().item<bool>()) << "the model loaded before the refusal";
        }
        EXPECT_EQ(scaler.get_scale(), 2048);
      },
      with_dir);
  std::error_code ignored;
  std::filesystem::remove_all(dir, ignored);
  std::filesystem::remove_all(off_dir, ignored);
}

// An optimizer that steps during backward cannot skip a step: refused at
// scale(), before any unit is stepped (it was refused at step(), after the
// backward had stepped every unit on the scaled gradients: found by a
// review); unscale_() and step() still refuse it.
TEST(ShardedGradScaler, StepsDuringBackwardRefused) {
  run_ranks_ok(1, [](int, int) {
    init_process_group();
    Sharded model(true, FSDPOptions());
    const std::vector<torch::Tensor> params = model.root.flat_parameters();
    std::vector<torch::Tensor> before;
    for (const auto& p : params) before.push_back(p.detach().clone());
    optim::FusedSGD opt(params, torch::optim::SGDOptions(0.1));
    opt.step_during_backward(model.module());
    ShardedGradScaler scaler;
    const torch::Tensor loss = model.forward(torch::randn({2, 7})).sum();
    EXPECT_CONTAINS(error_of([&] { scaler.scale(loss); }),
                    "a FusedAdamW or FusedSGD of this process steps during backward");
    for (size_t i = 0; i < params.size(); ++i) EXPECT_TRUE(torch::equal(params[i], before[i]));
    EXPECT_CONTAINS(error_of([&] { scaler.step(opt); }),
                    "FusedSGD steps during backward (step_during_backward)");
  });
}

}  // namespace test_sharded_grad_scaler
}  // namespace fsdp::testing
