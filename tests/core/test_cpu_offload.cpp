// CPU offload (FSDPOptions::cpu_offload, PyTorch's CPUOffload): the shards,
// their gradients and the optimizer's state in host memory, copied to the
// unit's device for each unshard and back for each reduced gradient (Note
// [Shards in host memory]). On the CPU the same copies run between host
// buffers, so offload must change nothing: AdamW with weight decay against
// plain LibTorch on the concatenated per-rank batches, and bitwise against
// the same model without offload, every step, at 1-3 ranks; full state dicts
// the same as without offload. The GPU's version is in test_cuda_units.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>
#include <vector>

#include <fsdp/fsdp.h>

#include "bf16_parity.h"
#include "core/copy_in_ahead.h"
#include "core/flat_parameter.h"
#include "multi_rank.h"
#include "offloaded_steps.h"
#include "parity_ranks.h"
#include "test_models.h"

namespace fsdp::testing {
namespace test_cpu_offload {

torch::optim::AdamW adamw(const std::vector<torch::Tensor>& params) {
  return torch::optim::AdamW(params, torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
}

using Wrapped = FullyShardedDataParallel<NetImpl>;

// Step `step`'s batches: plain LibTorch steps on the ranks' batches
// concatenated; each of `models` runs forward and backward on this rank's
// (its optimizer's step is left to the caller).
void step_reference_and_backward(Net& reference, torch::optim::Optimizer& ref_opt, int step,
                                 const std::vector<Wrapped*>& models) {
  const int world = rank_and_world().second;
  torch::manual_seed(1000 + step);
  const torch::Tensor x = torch::randn({5 * world, 7});
  const torch::Tensor target = torch::randn({5 * world, 3});
  ref_opt.zero_grad();
  torch::mse_loss(reference->forward(x), target).backward();
  ref_opt.step();
  for (Wrapped* m : models) {
    (*m)->zero_grad();  // Module::zero_grad, as users write it
    torch::mse_loss((*m)->forward(local_block(x)), local_block(target)).backward();
  }
}

// Trains the same Net three ways on different per-rank batches: plain
// LibTorch on their concatenation, FSDP with `options`, FSDP with `options`
// and offload; the offloaded one must match the reference and, bitwise, the
// one without offload, after every step.
void train_three_ways(const FSDPOptions& options, const std::string& what) {
  const FSDPOptions offload = FSDPOptions(options).cpu_offload(CPUOffload().offload_params(true));
  torch::manual_seed(0);
  Net reference(false, FSDPOptions());
  torch::manual_seed(0);
  FullyShardedDataParallel<NetImpl> on_device(std::make_shared<NetImpl>(true, options), options);
  torch::manual_seed(0);
  FullyShardedDataParallel<NetImpl> offloaded(std::make_shared<NetImpl>(true, offload), offload);
  auto ref_opt = adamw(reference->parameters());
  auto dev_opt = adamw(on_device->parameters());
  auto off_opt = adamw(offloaded->parameters());
  const std::vector<Unit*> dev_units = units_of(*on_device.ptr());
  const std::vector<Unit*> off_units = units_of(*offloaded.ptr());
  ASSERT_EQ(off_units.size(), 3u) << what;
  for (Unit* u : off_units) {
    const FlatParameter& flat = *u->flat_param();
    EXPECT_TRUE(flat.offloaded()) << what;
    EXPECT_TRUE(flat.frees_unsharded()) << what << ": the device buffer is apart from the shard";
    EXPECT_EQ(flat.state(), FlatParameter::State::kSharded) << what;
  }
  for (int step = 0; step < 4; ++step) {
    step_reference_and_backward(reference, ref_opt, step, {&on_device, &offloaded});
    dev_opt.step();
    off_opt.step();
    for (size_t i = 0; i < off_units.size(); ++i) {
      const FlatParameter& off = *off_units[i]->flat_param();
      const FlatParameter& dev = *dev_units[i]->flat_param();
      // Between uses only the host shard holds the values, NO_SHARD's too.
      EXPECT_EQ(off.state(), FlatParameter::State::kSharded) << what << " step " << step;
      EXPECT_TRUE(off.shard().device().is_cpu());
      EXPECT_NE(off.shard().data_ptr(), off.unsharded().data_ptr());
      EXPECT_TRUE(torch::equal(off.shard(), dev.shard()))
          << what << " unit " << i << " step " << step;
      // (use_orig_params: the gradients are the pieces', compared through
      // the shards they step.)
      ASSERT_EQ(off.shard().grad().defined(), dev.shard().grad().defined()) << what;
      if (dev.shard().grad().defined()) {
        EXPECT_TRUE(torch::equal(off.shard().grad(), dev.shard().grad()))
            << what << " unit " << i << " step " << step;
      }
    }
    expect_same_after_step(*offloaded.ptr(), *reference.ptr(), what, step);
  }
  // Checkpoints are the same with and without offload.
  const auto off_state = full_state_dict(*offloaded.ptr());
  const auto dev_state = full_state_dict(*on_device.ptr());
  ASSERT_EQ(off_state.size(), dev_state.size()) << what;
  for (const auto& item : dev_state) {
    ASSERT_NE(off_state.find(item.key()), nullptr) << what << " " << item.key();
    EXPECT_TRUE(torch::equal(*off_state.find(item.key()), item.value()))
        << what << " " << item.key();
  }
}

TEST(CpuOffload, TrainsLikePlainLibTorchAndLikeNoOffload) {
  in_parity_ranks([] {
    for (const ShardingStrategy strategy : parity_strategies()) {
      train_three_ways(FSDPOptions().sharding_strategy(strategy), to_string(strategy));
    }
    train_three_ways(FSDPOptions().use_orig_params(true), "use_orig_params");
    train_three_ways(FSDPOptions().forward_prefetch(true), "forward_prefetch");
  });
}

// Offload unit by unit, as FSDP2's offload_policy per fully_shard call: the
// nested units offloaded, the root not (on a GPU its shard, gradient and
// optimizer state stay there). Trains like plain LibTorch, with the
// optimizer after backward and FusedAdamW beside it.
TEST(CpuOffload, SomeUnitsOffloadedTheRootNot) {
  in_parity_ranks([] {
    const FSDPOptions offload = FSDPOptions().cpu_offload(CPUOffload().offload_params(true));
    torch::manual_seed(0);
    Net reference(false, FSDPOptions());
    torch::manual_seed(0);
    FullyShardedDataParallel<NetImpl> after(std::make_shared<NetImpl>(true, offload),
                                            FSDPOptions());
    torch::manual_seed(0);
    FullyShardedDataParallel<NetImpl> during(std::make_shared<NetImpl>(true, offload),
                                             FSDPOptions());
    const std::vector<Unit*> units = units_of(*during.ptr());
    ASSERT_EQ(units.size(), 3u);
    EXPECT_FALSE(units[0]->flat_param()->offloaded()) << "the root";
    EXPECT_TRUE(units[1]->flat_param()->offloaded());
    EXPECT_TRUE(units[2]->flat_param()->offloaded());
    auto ref_opt = adamw(reference->parameters());
    auto after_opt = adamw(after->parameters());
    optim::FusedAdamW during_opt(during->parameters(),
                                 torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
    during_opt.step_during_backward(*during.ptr());
    for (int step = 0; step < 4; ++step) {
      step_reference_and_backward(reference, ref_opt, step, {&after, &during});
      after_opt.step();
      during_opt.step();
      expect_same_after_step(*after.ptr(), *reference.ptr(), "after backward", step);
      expect_same_after_step(*during.ptr(), *reference.ptr(), "beside backward", step);
    }
  });
}

// bf16 parameters, fp32 shards in host memory: the same results as plain
// LibTorch with the same casts (tests/core/bf16_parity.h).
TEST(CpuOffload, Bf16MixedPrecisionMatchesPlainBf16) {
  run_ranks_ok(2, [](int rank, int world) {
    auto group = init_process_group(ProcessGroupOptions().timeout(std::chrono::seconds(30)));
    int64_t bf16_bytes = 0;
    bf16_parity::expect_bf16_matches_reference(group, rank, world, torch::kCPU, &bf16_bytes,
                                               CPUOffload().offload_params(true));
    EXPECT_GT(bf16_bytes, 0);
  });
}

// no_sync accumulates on the device and reduces once; clip_grad_norm_ (the
// root's, then LibTorch's of the original parameters) sees the host
// gradients; a full state dict loads back into the offloaded model.
TEST(CpuOffload, NoSyncClippingAndLoadingBack) {
  run_ranks_ok(2, [](int, int world) {
    init_process_group(ProcessGroupOptions().timeout(std::chrono::seconds(30)));
    const FSDPOptions offload = FSDPOptions().cpu_offload(CPUOffload().offload_params(true));
    torch::manual_seed(0);
    Net reference(false, FSDPOptions());
    torch::manual_seed(0);
    FullyShardedDataParallel<NetImpl> model(std::make_shared<NetImpl>(true, offload), offload);
    torch::optim::SGD ref_opt(reference->parameters(), torch::optim::SGDOptions(0.1));
    torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
    for (int step = 0; step < 2; ++step) {
      ref_opt.zero_grad();
      opt.zero_grad();
      for (int micro = 0; micro < 2; ++micro) {
        torch::manual_seed(50 + 2 * step + micro);
        const torch::Tensor x = torch::randn({4 * world, 7});
        reference->forward(x).pow(2).mean().div(2).backward();
        const torch::Tensor loss = model->forward(local_block(x)).pow(2).mean().div(2);
        if (micro == 0) {
          auto guard = model->no_sync();
          loss.backward();
        } else {
          loss.backward();
        }
      }
      const double want = torch::nn::utils::clip_grad_norm_(reference->parameters(), 0.05);
      // Step 1 clips with LibTorch's own function of the original
      // parameters, whose gradients live in host memory (Note [LibTorch's
      // clipping of a unit made in place]).
      const double got =
          step == 0 ? model->clip_grad_norm_(0.05)
                    : torch::nn::utils::clip_grad_norm_(model->named_parameters().values(), 0.05);
      EXPECT_NEAR(got, want, 1e-5 * (1 + want));
      ref_opt.step();
      opt.step();
      expect_same_after_step(*model.ptr(), *reference.ptr(), "no_sync + clipping", step);
    }
    auto saved = full_state_dict(*model.ptr());
    torch::manual_seed(7);
    FullyShardedDataParallel<NetImpl> fresh(std::make_shared<NetImpl>(true, offload), offload);
    load_full_state_dict(*fresh.ptr(), saved);
    for (Unit* u : units_of(*fresh.ptr())) EXPECT_TRUE(u->flat_param()->shard().is_cpu());
    expect_same_after_step(*fresh.ptr(), *reference.ptr(), "loaded", 2);
  });
}

// bf16 with offload: FusedAdamW writes each unit's bf16 host copy in its
// step (write_compute_copies) and unsharding sends it instead of the fp32
// shard, with bitwise the results of the same model without the copies (so
// the copies hold the cast shards); a write of a shard by anything else
// leaves the copy stale until the next unshard casts it anew, still with the
// same results (Note [A host copy in the compute dtype]); so does an
// optimizer that writes no copies, FusedSGD taking over after step 3.
TEST(CpuOffload, ComputeCopiesWrittenByTheOptimizerAreWhatUnshardingSends) {
  run_ranks_ok(2, [](int, int world) {
    init_process_group(ProcessGroupOptions().timeout(std::chrono::seconds(30)));
    for (const bool orig : {false, true}) {
      const FSDPOptions o = FSDPOptions()
                                .use_orig_params(orig)
                                .cpu_offload(CPUOffload().offload_params(true))
                                .mixed_precision(MixedPrecision().param_dtype(at::kBFloat16));
      const std::string what = orig ? "use_orig_params" : "flat";
      torch::manual_seed(0);
      FullyShardedDataParallel<NetImpl> plain(std::make_shared<NetImpl>(true, o), o);
      torch::manual_seed(0);
      FullyShardedDataParallel<NetImpl> copied(std::make_shared<NetImpl>(true, o), o);
      optim::FusedAdamW plain_opt(plain->parameters(), torch::optim::AdamWOptions(1e-2));
      optim::FusedAdamW copied_opt(copied->parameters(), torch::optim::AdamWOptions(1e-2));
      copied_opt.write_compute_copies(*copied.ptr());
      const auto sgd = torch::optim::SGDOptions(0.1).momentum(0.9);
      optim::FusedSGD plain_sgd(plain->parameters(), sgd), copied_sgd(copied->parameters(), sgd);
      const std::vector<Unit*> a = units_of(*plain.ptr());
      const std::vector<Unit*> b = units_of(*copied.ptr());
      for (int step = 0; step < 6; ++step) {
        if (step == 2) {
          // Another write of a shard: the copy is stale, and sending it
          // would differ from the plain model's.
          at::NoGradGuard no_grad;
          b[0]->flat_param()->shard().mul_(0.5);
          a[0]->flat_param()->shard().mul_(0.5);
          EXPECT_FALSE(b[0]->flat_param()->low_precision_copy_current()) << what;
        }
        for (Unit* u : b) {
          // FusedSGD's steps (from step 4) leave every copy stale.
          EXPECT_EQ(u->flat_param()->low_precision_copy_current(),
                    step < 5 && (step != 2 || u != b[0]))
              << what << " step " << step;
          EXPECT_FALSE(a[0]->flat_param()->low_precision_copy_current());
        }
        torch::manual_seed(40 + step);
        const torch::Tensor x = torch::randn({4 * world, 7});
        for (auto [model, opt] :
             {std::pair<FullyShardedDataParallel<NetImpl>*, torch::optim::Optimizer*>{&plain,
                                                                                      &plain_opt},
              std::pair<FullyShardedDataParallel<NetImpl>*, torch::optim::Optimizer*>{
                  &copied, &copied_opt}}) {
          if (step >= 4) opt = model == &plain ? &plain_sgd : &copied_sgd;
          (*model)->zero_grad();
          (*model)->forward(local_block(x)).to(at::kFloat).pow(2).mean().backward();
          opt->step();
        }
        for (size_t i = 0; i < a.size(); ++i) {
          EXPECT_TRUE(torch::equal(a[i]->flat_param()->shard(), b[i]->flat_param()->shard()))
              << what << " unit " << i << " step " << step;
        }
      }
    }
  });
}

// Note [Copy-in at the step], at 1-3 ranks (tests/core/offloaded_steps.h;
// the GPU's in test_cuda_units).
TEST(CpuOffload, FirstUnitCopiedInAtTheStep) {
  in_parity_ranks([] { offloaded_steps::expect_copy_in_at_step_as_without(torch::kCPU, "5"); });
}

// Note [Copy-in at the step]: the device copy is ready only when every range
// was sent right after its own step wrote it. A first range sent before
// being written (its step left to the last range, for a state the fused
// kernel does not take: a review found the last range's one write of each
// then passed for its own, and the next forward took the first range's old
// values) leaves nothing ready; sent after one write of each since the
// hand-over, the copy is ready and holds the values.
TEST(CpuOffload, ACopyInAheadIsReadyOnlyWhenEveryRangeWasWrittenFirst) {
  using Versions = detail::CopyInAhead::Versions;
  // One write of each, as a step of elements [begin, end) makes.
  const auto write = [](torch::Tensor& shard, torch::Tensor& copy, int64_t begin = 0,
                        int64_t end = 8) {
    shard.narrow(0, begin, end - begin).add_(1);
    copy.narrow(0, begin, end - begin).copy_(shard.narrow(0, begin, end - begin));
  };
  const auto versions = [](const torch::Tensor& shard, const torch::Tensor& copy) {
    return Versions{shard._version(), copy._version()};
  };
  torch::Tensor shard = torch::zeros({8});
  torch::Tensor copy = torch::zeros({8});
  detail::CopyInAhead ahead(torch::kCPU);
  const Versions handed = versions(shard, copy);
  ahead.send(copy, 0, 4, versions(shard, copy), handed);  // not written yet
  write(shard, copy);                                     // the whole step, at the last range
  ahead.send(copy, 4, 8, versions(shard, copy), handed);
  EXPECT_EQ(ahead.state(), detail::CopyInAhead::State::kEmpty);
  EXPECT_FALSE(ahead.take(versions(shard, copy)).has_value());

  const Versions next = versions(shard, copy);
  write(shard, copy, 0, 4);
  ahead.send(copy, 0, 4, versions(shard, copy), next);
  write(shard, copy, 4, 8);
  ahead.send(copy, 4, 8, versions(shard, copy), next);
  EXPECT_EQ(ahead.state(), detail::CopyInAhead::State::kReady);
  const auto taken = ahead.take(versions(shard, copy));
  ASSERT_TRUE(taken.has_value());
  EXPECT_TRUE(torch::equal(*taken, copy));
}

}  // namespace test_cpu_offload
}  // namespace fsdp::testing
