// fsdp::optim's step_during_backward (Note [Steps during backward], Note
// [Stepping beside backward]): each unit is stepped on a thread of its own as
// soon as backward has reduced its gradient. Only when the steps happen may
// differ: against the same optimizer stepping after backward the shards are
// bitwise equal after every step, and both match plain LibTorch on the
// concatenated per-rank batches, at 1-3 ranks, for every strategy,
// use_orig_params and CPU offload. Units are handed over before backward
// ends, and stepped when it returns; misuse (two backwards per step,
// clipping, attaching again before step()) is a clear error; no_sync
// accumulation works as without it; options changed late, a backward that
// throws midway and a destroyed optimizer lose nothing.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>
#include <cstdlib>
#include <initializer_list>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include <fsdp/fsdp.h>

#include "core/flat_parameter.h"
#include "detail/torch_compat.h"
#include "error_of.h"
#include "multi_rank.h"
#include "offloaded_steps.h"
#include "optim/backward_steps.h"
#include "parity_ranks.h"
#include "test_models.h"

namespace fsdp::testing {
namespace test_step_during_backward {

using Model = FullyShardedDataParallel<NetImpl>;

Model make_model(const FSDPOptions& options) {
  torch::manual_seed(0);
  return Model(std::make_shared<NetImpl>(true, options), options);
}

torch::optim::AdamWOptions adamw_options() {
  return torch::optim::AdamWOptions(1e-2).weight_decay(0.1);
}

// A user's step: zero_grad on the module, forward, backward, step.
template <typename Wrapped>
void user_step(Wrapped& model, torch::optim::Optimizer& opt, const torch::Tensor& x,
               const torch::Tensor& target) {
  model->zero_grad();
  torch::mse_loss(model->forward(x), target).backward();
  opt.step();
}

// The same model twice, with FusedAdamW stepping after backward and during
// it (the process group initialised first).
struct AfterAndDuring {
  AfterAndDuring() { during_opt.step_during_backward(*during.ptr()); }
  // First: the models need the process group.
  bool initialised =
      (init_process_group(ProcessGroupOptions().timeout(std::chrono::seconds(30))), true);
  Model after = make_model(FSDPOptions());
  Model during = make_model(FSDPOptions());
  optim::FusedAdamW after_opt{after->parameters(), adamw_options()};
  optim::FusedAdamW during_opt{during->parameters(), adamw_options()};
};

// zero_grad, forward and backward on each model, without step().
void backward_each(std::initializer_list<Model*> models, const torch::Tensor& x) {
  for (Model* m : models) {
    (*m)->zero_grad();
    (*m)->forward(x).pow(2).sum().backward();
  }
}

// .grad of `b`'s parameters, each defined and equal to `a`'s.
void expect_equal_grads(Model& a, Model& b, const std::string& what) {
  const std::vector<torch::Tensor> pa = a->parameters(), pb = b->parameters();
  ASSERT_EQ(pa.size(), pb.size());
  for (size_t i = 0; i < pa.size(); ++i) {
    ASSERT_TRUE(pb[i].grad().defined()) << what << ", parameter " << i;
    EXPECT_TRUE(torch::equal(pb[i].grad(), pa[i].grad())) << what << ", parameter " << i;
  }
}

void expect_equal_shards(Model& a, Model& b, const std::string& what) {
  const std::vector<Unit*> ua = units_of(*a.ptr());
  const std::vector<Unit*> ub = units_of(*b.ptr());
  ASSERT_EQ(ua.size(), ub.size());
  for (size_t i = 0; i < ua.size(); ++i) {
    EXPECT_TRUE(torch::equal(ua[i]->flat_param()->shard(), ub[i]->flat_param()->shard()))
        << what << ": unit " << i;
  }
}

// Plain LibTorch, FSDP stepping after backward, FSDP stepping during it,
// each trained by `train(model, optimizer, x, target)` (user_step unless
// given) on the step's batch (its block for the FSDP models).
template <typename Optimizer, typename Options, typename Train>
void train_three_ways(const FSDPOptions& options, const Options& opt_options,
                      const std::string& what, Train train) {
  const int world = rank_and_world().second;
  torch::manual_seed(0);
  Net reference(false, FSDPOptions());
  Model after = make_model(options);
  Model during = make_model(options);
  Optimizer ref_opt(reference->parameters(), opt_options);
  Optimizer after_opt(after->parameters(), opt_options);
  Optimizer during_opt(during->parameters(), opt_options);
  during_opt.step_during_backward(*during.ptr());
  for (int step = 0; step < 4; ++step) {
    torch::manual_seed(1000 + step);
    const torch::Tensor x = torch::randn({5 * world, 7});
    const torch::Tensor target = torch::randn({5 * world, 3});
    train(reference, ref_opt, x, target);
    train(after, after_opt, local_block(x), local_block(target));
    train(during, during_opt, local_block(x), local_block(target));
    expect_equal_shards(during, after, what + " step " + std::to_string(step));
    expect_same_after_step(*during.ptr(), *reference.ptr(), what, step);
  }
}

template <typename Optimizer, typename Options>
void train_three_ways(const FSDPOptions& options, const Options& opt_options,
                      const std::string& what) {
  train_three_ways<Optimizer>(
      options, opt_options, what,
      [](auto& model, torch::optim::Optimizer& opt, const torch::Tensor& x,
         const torch::Tensor& target) { user_step(model, opt, x, target); });
}

TEST(StepDuringBackward, StepsLikeTheSameOptimizerAfterBackward) {
  in_parity_ranks([] {
    for (const ShardingStrategy strategy : parity_strategies()) {
      train_three_ways<optim::FusedAdamW>(FSDPOptions().sharding_strategy(strategy),
                                          adamw_options(), to_string(strategy));
    }
    train_three_ways<optim::FusedAdamW>(FSDPOptions().use_orig_params(true), adamw_options(),
                                        "use_orig_params");
    train_three_ways<optim::FusedAdamW>(
        FSDPOptions().cpu_offload(CPUOffload().offload_params(true)), adamw_options(),
        "cpu_offload");
    train_three_ways<optim::FusedSGD>(
        FSDPOptions(), torch::optim::SGDOptions(0.05).momentum(0.9).weight_decay(0.01),
        "FusedSGD with momentum");
  });
}

// What users do around their steps: validation under c10::InferenceMode,
// then adversarial training (FGSM's input gradient, a backward that reaches
// no parameter, before the step on the perturbed batch; Note [Backward with
// respect to inputs]). The input-only backward hands nothing over and needs
// no step() of its own; stepped beside the training backward, the shards
// stay bitwise those stepped after it, and plain LibTorch's.
TEST(StepDuringBackward, AroundInputGradientsAndInferenceMode) {
  const auto adversarial_step = [](auto& model, torch::optim::Optimizer& opt,
                                   const torch::Tensor& x, const torch::Tensor& target) {
    {
      c10::InferenceMode inference;
      EXPECT_TRUE(model->forward(x).is_inference());
    }
    user_step(model, opt, fgsm(model, x, target), target);
  };
  in_parity_ranks([&] {
    train_three_ways<optim::FusedAdamW>(FSDPOptions(), adamw_options(), "flat", adversarial_step);
    train_three_ways<optim::FusedAdamW>(FSDPOptions().use_orig_params(true), adamw_options(),
                                        "use_orig_params", adversarial_step);
    train_three_ways<optim::FusedAdamW>(
        FSDPOptions().cpu_offload(CPUOffload().offload_params(true)), adamw_options(),
        "cpu_offload", adversarial_step);
    train_three_ways<optim::FusedSGD>(
        FSDPOptions().sharding_strategy(ShardingStrategy::kShardGradOp),
        torch::optim::SGDOptions(0.05).momentum(0.9).weight_decay(0.01), "FusedSGD, SHARD_GRAD_OP",
        adversarial_step);
  });
}

// A learning-rate schedule as LibTorch's users write it: StepLR stepped after
// each optimizer step. The steps beside the next backward take the new rate
// (as plain LibTorch's step() does), with no warning: the options changed
// after step(), not between backward and step().
TEST(StepDuringBackward, LearningRateSchedulesAsInPlainLibTorch) {
  in_parity_ranks([] {
    std::vector<std::string> warnings;
    compat::WarningCollector collect(&warnings);
    std::map<torch::optim::Optimizer*, std::unique_ptr<torch::optim::StepLR>> schedules;
    const auto scheduled_step = [&](auto& model, torch::optim::Optimizer& opt,
                                    const torch::Tensor& x, const torch::Tensor& target) {
      std::unique_ptr<torch::optim::StepLR>& schedule = schedules[&opt];
      if (!schedule) schedule = std::make_unique<torch::optim::StepLR>(opt, 1, 0.5);
      user_step(model, opt, x, target);
      schedule->step();
    };
    train_three_ways<optim::FusedAdamW>(
        FSDPOptions().cpu_offload(CPUOffload().offload_params(true)), adamw_options(),
        "cpu_offload, StepLR", scheduled_step);
    schedules.clear();  // the optimizers are gone; their addresses may come again
    train_three_ways<optim::FusedSGD>(
        FSDPOptions(), torch::optim::SGDOptions(0.05).momentum(0.9).weight_decay(0.01),
        "FusedSGD, StepLR", scheduled_step);
    schedules.clear();
    for (const std::string& w : warnings) ADD_FAILURE() << "unexpected warning: " << w;
  });
}

// The hooks the optimizers use: every unit's shard is handed over once per
// backward, some while backward goes on (at the launch of their reduction;
// complete() then sets .grad). The root unit's reduction is launched last
// and handed over at the end of backward, first of all units there: a unit
// handed over while the root's shard has no gradient yet was handed over
// during backward.
TEST(StepDuringBackward, HandsOverEachUnitOnceSomeBeforeBackwardEnds) {
  for (const int world : {1, 2}) {
    run_ranks_ok(world, [](int, int world) {
      init_process_group(ProcessGroupOptions().timeout(std::chrono::seconds(30)));
      Model model = make_model(FSDPOptions());
      const std::vector<Unit*> units = units_of(*model.ptr());
      const at::Tensor& root_shard = units.front()->flat_param()->shard();
      std::vector<const c10::TensorImpl*> handed;
      int early = 0;
      ReducedGradHooks hooks;
      hooks.owner = "test";
      hooks.on_reduced = [&](ReducedGrad grad) {
        early += !grad.params.front().is_same(root_shard) && !root_shard.grad().defined() ? 1 : 0;
        if (grad.complete) grad.complete();
        for (const at::Tensor& p : grad.params) {
          EXPECT_TRUE(p.grad().defined());
          handed.push_back(p.unsafeGetTensorImpl());
        }
      };
      // model->zero_grad() calls before_zero_grad before it clears any
      // gradient (a listener still stepping waits there): none is cleared
      // when the first call comes.
      int zero_grad_calls = 0;
      int64_t cleared_before = -1;
      hooks.before_zero_grad = [&] {
        if (zero_grad_calls++ > 0) return;
        cleared_before = 0;
        for (const at::Tensor& p : model->parameters()) cleared_before += !p.grad().defined();
        for (const auto& p : model->module().named_parameters()) {  // the original ones
          cleared_before += !p.value().grad().defined();
        }
      };
      set_reduced_grad_hooks(*model.ptr(), hooks);
      for (int step = 0; step < 2; ++step) {
        handed.clear();
        early = 0;
        zero_grad_calls = 0;
        model->zero_grad(/*set_to_none=*/true);
        EXPECT_GE(zero_grad_calls, 1) << "step " << step;
        if (step > 0) EXPECT_EQ(cleared_before, 0) << "gradients cleared before before_zero_grad";
        model->forward(torch::randn({4, 7})).pow(2).sum().backward();
        EXPECT_EQ(handed.size(), units.size()) << "step " << step;
        for (Unit* unit : units) {
          EXPECT_EQ(std::count(handed.begin(), handed.end(),
                               unit->flat_param()->shard().unsafeGetTensorImpl()),
                    1);
        }
        EXPECT_GE(early, 1) << "step " << step;
      }
      EXPECT_CONTAINS(error_of([&] { model->clip_grad_norm_(1.0); }),
                      "test steps each unit as soon as backward has reduced its gradient");
      set_reduced_grad_hooks(*model.ptr(), ReducedGradHooks());  // removes them
      model->clip_grad_norm_(1.0);
    });
  }
}

// Note [Stepping a gradient as it lands]: under FSDP_GRAD_PART_ELEMENTS=5
// each unit's gradient is handed over in parts of about 5 elements (a flat
// shard or a piece spanning several parts, several small pieces in one),
// each part stepped by its ranges as it lands: bitwise the same as the same
// optimizer after backward, for AdamW (amsgrad, weight decay) and SGD with
// momentum and dampening (whose first step takes the gradient as it is in
// every range of a parameter, not only its first).
TEST(StepDuringBackward, StepsInPartsLikeWhole) {
  in_parity_ranks([] {
    ::setenv("FSDP_GRAD_PART_ELEMENTS", "5", 1);
    const auto adamw = adamw_options().amsgrad(true);
    const auto sgd = torch::optim::SGDOptions(0.05).momentum(0.9).dampening(0.1).weight_decay(0.01);
    for (const bool orig : {false, true}) {
      const std::string what = orig ? "parts, use_orig_params" : "parts";
      const FSDPOptions options = FSDPOptions().use_orig_params(orig);
      train_three_ways<optim::FusedAdamW>(options, adamw, what);
      train_three_ways<optim::FusedAdamW>(
          FSDPOptions(options).cpu_offload(CPUOffload().offload_params(true)), adamw,
          what + ", cpu_offload");
      train_three_ways<optim::FusedSGD>(options, sgd, what + ", FusedSGD");
    }
    ::unsetenv("FSDP_GRAD_PART_ELEMENTS");
  });
}

// MixedPrecision::keep_low_precision_grads: bf16 gradients stepped as their
// float values, during backward (whole and in parts) and after it, bitwise
// as the gradients cast to float32, at 1-3 ranks (tests/core/offloaded_steps.h;
// the GPU's in test_cuda_units).
TEST(StepDuringBackward, LowPrecisionGradientsStepAsTheirFloatValues) {
  in_parity_ranks([] { offloaded_steps::expect_kept_grads_step_as_cast(torch::kCPU, "5"); });
}

// The parts as a listener sees them: only hooks that take parts get them;
// their ranges cover each parameter once, in order from 0; once every part
// has arrived the gradients are those handed over whole.
TEST(StepDuringBackward, PartsCoverEachParameterOnceInOrder) {
  run_ranks_ok(2, [](int, int) {
    init_process_group(ProcessGroupOptions().timeout(std::chrono::seconds(30)));
    ::setenv("FSDP_GRAD_PART_ELEMENTS", "5", 1);
    const FSDPOptions options = FSDPOptions().use_orig_params(true);
    Model parted = make_model(options);
    Model whole = make_model(options);
    std::vector<torch::Tensor> parted_grads, whole_grads;
    int handed_in_parts = 0;
    ReducedGradHooks takes;
    takes.owner = "parts";
    takes.takes_parts = true;
    takes.on_reduced = [&](ReducedGrad grad) {
      if (grad.complete) grad.complete();
      handed_in_parts += grad.parts.size() > 1 ? 1 : 0;
      std::vector<int64_t> next(grad.params.size(), 0);
      for (const GradPart& part : grad.parts) {
        part.arrived();
        for (const ParamRange& r : part.ranges) {
          ASSERT_LT(r.param, next.size());
          EXPECT_EQ(r.begin, next[r.param]);
          EXPECT_LE(r.end, grad.params[r.param].numel());
          next[r.param] = r.end;
        }
      }
      for (size_t i = 0; i < grad.params.size(); ++i) {
        if (!grad.parts.empty()) EXPECT_EQ(next[i], grad.params[i].numel()) << "param " << i;
        parted_grads.push_back(grad.params[i].grad().clone());
      }
    };
    ReducedGradHooks plain;
    plain.owner = "whole";
    plain.on_reduced = [&](ReducedGrad grad) {
      EXPECT_TRUE(grad.parts.empty());
      if (grad.complete) grad.complete();
      for (const at::Tensor& p : grad.params) whole_grads.push_back(p.grad().clone());
    };
    set_reduced_grad_hooks(*parted.ptr(), takes);
    set_reduced_grad_hooks(*whole.ptr(), plain);
    for (Model* m : {&parted, &whole}) {
      (*m)->zero_grad(/*set_to_none=*/true);
      torch::manual_seed(7);
      (*m)->forward(torch::randn({4, 7})).pow(2).sum().backward();
    }
    EXPECT_GE(handed_in_parts, 1);
    ASSERT_EQ(parted_grads.size(), whole_grads.size());
    for (size_t i = 0; i < parted_grads.size(); ++i) {
      EXPECT_TRUE(torch::equal(parted_grads[i], whole_grads[i])) << "gradient " << i;
    }
    ::unsetenv("FSDP_GRAD_PART_ELEMENTS");
  });
}

// The profile bench_gpu_step --trace prints (fsdp::detail::BackwardStepEvent):
// when asked, one event per hand-over, each unit's elements once, its times
// in order (handed, completed, landed, stepped) and within the step; none
// when not asked.
TEST(StepDuringBackward, RecordsEachHandOverWhenAsked) {
  run_ranks_ok(1, [](int, int) {
    init_process_group(ProcessGroupOptions().timeout(std::chrono::seconds(30)));
    ::setenv("FSDP_GRAD_PART_ELEMENTS", "5", 1);
    Model model = make_model(FSDPOptions().cpu_offload(CPUOffload().offload_params(true)));
    optim::FusedAdamW opt(model->parameters(), adamw_options());
    opt.step_during_backward(*model.ptr());
    int64_t elements = 0;
    for (const at::Tensor& p : model->parameters()) elements += p.numel();
    for (const bool on : {true, false}) {
      detail::record_backward_step_events(on);
      const auto start = std::chrono::steady_clock::now();
      user_step(model, opt, torch::randn({4, 7}), torch::randn({4, 3}));
      const auto end = std::chrono::steady_clock::now();
      detail::record_backward_step_events(false);
      const std::vector<detail::BackwardStepEvent> events = detail::take_backward_step_events();
      if (!on) {
        EXPECT_TRUE(events.empty());
        continue;
      }
      EXPECT_EQ(events.size(), units_of(*model.ptr()).size());
      int64_t stepped = 0;
      for (const auto& e : events) {
        stepped += e.elements;
        EXPECT_LE(start, e.handed);
        EXPECT_LE(e.handed, e.completed);
        EXPECT_LE(e.completed, e.landed);
        EXPECT_LE(e.landed, e.stepped);
        EXPECT_LE(e.stepped, end);
      }
      EXPECT_EQ(stepped, elements);
    }
    ::unsetenv("FSDP_GRAD_PART_ELEMENTS");
  });
}

TEST(StepDuringBackward, MisuseIsAClearErrorAndNoSyncAccumulates) {
  run_ranks_ok(2, [](int, int) {
    AfterAndDuring models;
    auto& [initialised, after, during, after_opt, during_opt] = models;
    // Accumulating over micro-batches inside no_sync hands nothing over
    // until the last backward: the same as stepping after backward.
    for (int step = 0; step < 2; ++step) {
      for (Model* m : {&after, &during}) {
        (*m)->zero_grad();
        {
          auto guard = (*m)->no_sync();
          torch::manual_seed(50 + step);
          (*m)->forward(torch::randn({3, 7})).pow(2).sum().backward();
        }
        torch::manual_seed(60 + step);
        (*m)->forward(torch::randn({3, 7})).pow(2).sum().backward();
      }
      after_opt.step();
      during_opt.step();
      expect_equal_shards(during, after, "no_sync step " + std::to_string(step));
    }
    // clip_grad_norm_ after such a backward comes too late.
    torch::manual_seed(80);
    const torch::Tensor x1 = torch::randn({3, 7});
    during->zero_grad();
    during->forward(x1).pow(2).sum().backward();
    EXPECT_CONTAINS(error_of([&] { during->clip_grad_norm_(1.0); }),
                    "fsdp::optim::FusedAdamW::step_during_backward steps each unit");
    // A second iteration before step() would step twice: its forward fails.
    const std::string twice = error_of([&] { during->forward(torch::randn({3, 7})); });
    EXPECT_CONTAINS(twice, "with no step() in between");
    EXPECT_CONTAINS(twice, "no_sync()");
    // So would a second backward through a retained graph: it fails as it
    // begins, on every rank, before it reads a shard the first one's steps
    // may still be writing (ThreadSanitizer saw that read race).
    during_opt.step();
    torch::manual_seed(90);
    const torch::Tensor x2 = torch::randn({3, 7});
    during->zero_grad();
    const torch::Tensor loss = during->forward(x2).pow(2).sum();
    loss.backward({}, /*retain_graph=*/true);
    {
      // Inside no_sync() it would hand nothing over, and once went on
      // unrefused, its gradient left for the next step.
      auto guard = during->no_sync();
      EXPECT_CONTAINS(error_of([&] { loss.backward({}, /*retain_graph=*/true); }),
                      "a backward began after a backward whose gradients were stepped");
    }
    EXPECT_CONTAINS(error_of([&] { loss.backward(); }),
                    "a backward began after a backward whose gradients were stepped");
    // Nothing is lost: step() takes the steps and training goes on alike.
    during_opt.step();
    for (const torch::Tensor& x : {x1, x2}) {
      after->zero_grad();
      after->forward(x).pow(2).sum().backward();
      after_opt.step();
    }
    torch::manual_seed(70);
    const torch::Tensor x = torch::randn({3, 7});
    for (auto [m, opt] : {std::pair<Model*, torch::optim::Optimizer*>{&after, &after_opt},
                          std::pair<Model*, torch::optim::Optimizer*>{&during, &during_opt}}) {
      (*m)->zero_grad();
      (*m)->forward(x).pow(2).sum().backward();
      opt->step();
    }
    expect_equal_shards(during, after, "after the errors");
    // ... and each backward ends as before (its end-of-backward callback ran).
    for (Unit* unit : units_of(*during.ptr())) {
      EXPECT_EQ(unit->training_state(), Unit::TrainingState::kIdle);
    }
  });
}

// Between a backward whose units were stepped and step(), the model is
// neither before nor after the step (and the optimizer's thread may still
// write shards): a state dict, SummonFullParams (the rank-0 save's guard)
// and torch::save are refused on every rank, before any collective; after
// step() they give the state of the same model stepped after backward.
TEST(StepDuringBackward, StateUseBeforeStepIsRefused) {
  run_ranks_ok(2, [](int rank, int) {
    AfterAndDuring models;
    auto& [initialised, after, during, after_opt, during_opt] = models;
    torch::manual_seed(100 + rank);
    const torch::Tensor x = torch::randn({3, 7});
    std::stringstream initial_opt;  // between steps: saved as usual
    torch::save(during_opt, initial_opt);
    for (auto [m, opt] : {std::pair<Model*, torch::optim::Optimizer*>{&after, &after_opt},
                          std::pair<Model*, torch::optim::Optimizer*>{&during, &during_opt}}) {
      (*m)->zero_grad();
      (*m)->forward(x).pow(2).sum().backward();
    }
    const std::string refused = "a state dict, checkpoint, SummonFullParams or torch::save/load";
    EXPECT_CONTAINS(error_of([&] { full_state_dict(*during.ptr()); }), refused);
    EXPECT_CONTAINS(error_of([&] { SummonFullParams guard(*during.ptr()); }), refused);
    std::stringstream saved;  // in memory: nothing to clean up if the test fails
    EXPECT_CONTAINS(error_of([&] { torch::save(during, saved); }), refused);
    // The optimizer's own state too: some parameters' from after the step.
    const std::string opt_refused = "a torch::save/load of the optimizer began after a backward";
    std::stringstream refused_opt;
    EXPECT_CONTAINS(error_of([&] { torch::save(during_opt, refused_opt); }), opt_refused);
    EXPECT_CONTAINS(error_of([&] { torch::load(during_opt, initial_opt); }), opt_refused);
    after_opt.step();
    during_opt.step();
    expect_equal_shards(during, after, "after the refusals");
    const auto want = full_state_dict(*after.ptr());
    const auto got = full_state_dict(*during.ptr());
    ASSERT_EQ(got.size(), want.size());
    for (const auto& item : want) {
      EXPECT_TRUE(torch::equal(got[item.key()], item.value())) << item.key();
    }
    torch::save(during, saved);  // collective outside SummonFullParams: every rank
    std::stringstream saved_opt;
    torch::save(during_opt, saved_opt);
    torch::load(after_opt, saved_opt);
  });
}

// The end of backward waits for the optimizer's thread: when backward
// returns, the units it handed over are stepped and their .grad set, so the
// user's reads between backward and step() (a gradient's norm logged, a NaN
// check) race with nothing and see what stepping after backward sees.
TEST(StepDuringBackward, BackwardReturnsWithItsUnitsStepped) {
  run_ranks_ok(2, [](int rank, int) {
    AfterAndDuring models;
    auto& [initialised, after, during, after_opt, during_opt] = models;
    for (int step = 0; step < 3; ++step) {
      torch::manual_seed(200 + 10 * step + rank);
      const torch::Tensor x = torch::randn({3, 7});
      backward_each({&after, &during}, x);
      expect_equal_grads(after, during, "step " + std::to_string(step));
      after_opt.step();
      expect_equal_shards(during, after, "before step(), step " + std::to_string(step));
      during_opt.step();
      expect_equal_shards(during, after, "after step(), step " + std::to_string(step));
    }
  });
}

// A learning rate set between backward and step() comes too late for the
// units stepped during backward: they take it from the next step on, every
// one alike, with a warning at each step (not some units at once and others
// later).
TEST(StepDuringBackward, OptionsChangedAfterBackwardReachTheNextStepWithAWarning) {
  run_ranks_ok(2, [](int rank, int) {
    AfterAndDuring models;
    auto& [initialised, after, during, after_opt, during_opt] = models;
    for (int step = 0; step < 2; ++step) {
      torch::manual_seed(300 + 10 * step + rank);
      const torch::Tensor x = torch::randn({3, 7});
      backward_each({&after, &during}, x);
      std::vector<std::string> warnings;
      {
        compat::WarningCollector collect(&warnings);
        const double lr = 1e-3 * (step + 1);
        for (auto& group : during_opt.param_groups()) group.options().set_lr(lr);
        after_opt.step();  // the lr before, set for after's next step
        for (auto& group : after_opt.param_groups()) group.options().set_lr(lr);
        during_opt.step();
      }
      expect_equal_shards(during, after, "lr changed after backward, step " + std::to_string(step));
      // At every step it happens (it was said once a process, while every
      // step was late: found by a review).
      ASSERT_EQ(warnings.size(), 1u);
      EXPECT_CONTAINS(warnings[0], "changed between backward and step()");
    }
  });
}

// A backward that throws midway (an error in a hook, out of memory) leaves
// the units it handed over stepped, as PyTorch's optimizer-in-backward does:
// the next forward says so on every rank, step() closes that step, and
// training goes on.
TEST(StepDuringBackward, ABackwardThatThrowsMidwayIsClosedByStep) {
  run_ranks_ok(2, [](int rank, int) {
    AfterAndDuring models;
    auto& [initialised, after, during, after_opt, during_opt] = models;
    torch::manual_seed(400 + rank);
    const torch::Tensor x = torch::randn({3, 7}).requires_grad_();
    x.register_hook([](torch::Tensor) -> torch::Tensor { TORCH_CHECK(false, "bad batch"); });
    during->zero_grad();
    EXPECT_CONTAINS(error_of([&] { during->forward(x).pow(2).sum().backward(); }), "bad batch");
    // A loop that skips the batch begins again with the optimizer's
    // zero_grad(), which waits for the thread still setting .grad; the
    // optimizer's state is not saved half stepped.
    during_opt.zero_grad();
    for (const auto& p : during->parameters()) {  // LibTorch 1.13's zero_grad() zeroes
      EXPECT_TRUE(!p.grad().defined() || p.grad().eq(0).all().item<bool>());
    }
    std::stringstream saved_opt;
    EXPECT_CONTAINS(error_of([&] { torch::save(during_opt, saved_opt); }), "stopped midway");
    during->zero_grad();
    const std::string refused = error_of([&] { during->forward(torch::randn({3, 7})); });
    EXPECT_CONTAINS(refused, "stopped midway");
    EXPECT_CONTAINS(refused, "call step() to close that step");
    int stepped = 0;
    const std::vector<Unit*> ua = units_of(*after.ptr()), ud = units_of(*during.ptr());
    for (size_t i = 0; i < ua.size(); ++i) {
      stepped += torch::equal(ua[i]->flat_param()->shard(), ud[i]->flat_param()->shard()) ? 0 : 1;
    }
    EXPECT_GE(stepped, 1);  // handed over before the throw (the refusal waited for them)
    during_opt.step();
    for (int step = 0; step < 2; ++step) {
      user_step(during, during_opt, torch::randn({3, 7}), torch::randn({3, 3}));
    }
    for (Unit* unit : ud) EXPECT_EQ(unit->training_state(), Unit::TrainingState::kIdle);
  });
}

// An optimizer destroyed as a backward throws (unwinding the training
// loop's scope) first lets its thread finish what was handed over: FusedSGD
// with momentum, gradients in parts, whose thread reads the optimizer's own
// members (ASan saw them freed before it had). Another optimizer then trains
// the model as one that never had it, as in the test below.
TEST(StepDuringBackward, AnOptimizerDestroyedAsABackwardThrowsFinishesFirst) {
  run_ranks_ok(2, [](int rank, int) {
    init_process_group(ProcessGroupOptions().timeout(std::chrono::seconds(30)));
    ::setenv("FSDP_GRAD_PART_ELEMENTS", "5", 1);
    Model left = make_model(FSDPOptions());
    Model plain = make_model(FSDPOptions());
    torch::manual_seed(700 + rank);
    const torch::Tensor x = torch::randn({3, 7}).requires_grad_();
    x.register_hook([](torch::Tensor) -> torch::Tensor { TORCH_CHECK(false, "bad batch"); });
    const auto sgd = torch::optim::SGDOptions(1e-2).momentum(0.9);
    EXPECT_CONTAINS(error_of([&] {
                      optim::FusedSGD gone(left->parameters(), sgd);
                      gone.step_during_backward(*left.ptr());
                      left->zero_grad();
                      left->forward(x).pow(2).sum().backward();
                    }),
                    "bad batch");
    ::unsetenv("FSDP_GRAD_PART_ELEMENTS");
    // From the same values on, as any two models do.
    {
      torch::NoGradGuard no_grad;
      const std::vector<Unit*> ul = units_of(*left.ptr()), up = units_of(*plain.ptr());
      for (size_t i = 0; i < ul.size(); ++i) {
        up[i]->flat_param()->shard().copy_(ul[i]->flat_param()->shard());
      }
    }
    optim::FusedSGD plain_opt(plain->parameters(), sgd);
    optim::FusedSGD left_opt(left->parameters(), sgd);
    for (int step = 0; step < 2; ++step) {
      torch::manual_seed(710 + 10 * step + rank);
      const torch::Tensor y = torch::randn({3, 7});
      backward_each({&plain, &left}, y);
      expect_equal_grads(plain, left, "step " + std::to_string(step));
      plain_opt.step();
      left_opt.step();
      expect_equal_shards(left, plain, "after the destroyed one, step " + std::to_string(step));
    }
  });
}

// Attaching again before step() would forget what the backward stepped and
// step it twice: refused; between steps it is allowed. An optimizer
// destroyed before its model leaves hooks that act as if removed: gradients
// reach .grad, clipping works, and another optimizer trains the model as
// one that never had it.
TEST(StepDuringBackward, AttachingAgainOrDestroyingTheOptimizerLosesNothing) {
  run_ranks_ok(2, [](int rank, int) {
    AfterAndDuring models;
    auto& [initialised, after, during, after_opt, during_opt] = models;
    torch::manual_seed(500 + rank);
    const torch::Tensor x = torch::randn({3, 7});
    backward_each({&after, &during}, x);
    EXPECT_CONTAINS(error_of([&] { during_opt.step_during_backward(*during.ptr()); }),
                    "a step_during_backward() call began after a backward whose gradients were "
                    "stepped");
    after_opt.step();
    during_opt.step();
    during_opt.step_during_backward(*during.ptr());  // between steps
    expect_equal_shards(during, after, "attached again");

    Model plain = make_model(FSDPOptions());
    Model left = make_model(FSDPOptions());
    {
      optim::FusedAdamW gone(left->parameters(), adamw_options());
      gone.step_during_backward(*left.ptr());
    }
    torch::optim::AdamW plain_opt(plain->parameters(), adamw_options());
    torch::optim::AdamW left_opt(left->parameters(), adamw_options());
    for (int step = 0; step < 2; ++step) {
      torch::manual_seed(600 + 10 * step + rank);
      const torch::Tensor y = torch::randn({3, 7});
      backward_each({&plain, &left}, y);
      expect_equal_grads(plain, left, "step " + std::to_string(step));
      EXPECT_EQ(left->clip_grad_norm_(1e-3), plain->clip_grad_norm_(1e-3));
      plain_opt.step();
      left_opt.step();
      expect_equal_shards(left, plain, "the optimizer destroyed, step " + std::to_string(step));
    }
  });
}

}  // namespace test_step_during_backward
}  // namespace fsdp::testing
