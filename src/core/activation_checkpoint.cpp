#include <fsdp/core/activation_checkpoint.h>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <ATen/core/ivalue.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/custom_class.h>

#include <algorithm>
#include <mutex>
#include <unordered_set>
#include <utility>

#include "core/checkpoint_region.h"
#include "detail/error.h"
#include "detail/torch_compat.h"

namespace fsdp {
namespace detail {
namespace {

// Note [Activation checkpointing]
// A custom autograd Function whose forward runs `fn` with grad mode off (so
// autograd keeps none of its activations) and whose backward runs `fn` again
// with grad mode on, on detached copies of the saved inputs, then asks
// autograd for the gradients of the recomputed outputs with respect to the
// inputs and the params (torch::autograd::grad, a nested backward that
// accumulates nothing) and returns them as the Function's input gradients.
// The params are inputs of the Function for that reason: their gradients
// then reach their AccumulateGrad nodes in the outer backward, where FSDP's
// per-parameter hooks wait, exactly as without checkpointing; and the output
// requires a gradient whenever a param does, even if no input does (a
// block's first layer on raw data).
//
// FSDP units inside `fn` see the phase (checkpoint_phase()): in the forward
// pass they join the reduction order as a grad-mode forward would, though
// their outputs carry no hooks; in the recomputation they gather their
// parameters, are not resharded after their forward (backward needs the
// parameters next), and hook their recomputed outputs, so their pre-backward
// finds the parameters gathered. One all-gather per unit in backward, as
// without checkpointing. A unit whose wrapped forward is checkpointed
// (FSDPOptions::activation_checkpointing) runs its hooks outside `fn`: its
// pre-backward gathers, then the recomputation uses the gathered parameters.
//
// A backward with create_graph (a gradient penalty) runs the Function's
// backward in grad mode, and a second backward will differentiate what it
// returns. Then the recomputation runs on the saved inputs themselves, not
// detached copies, and the nested backward keeps and builds its graph
// (retain_graph, create_graph): the gradients returned reach, through the
// recomputed graph, the params and whatever computed the inputs (a layer
// before the region, whose second-order term passes through the region).
// Detached, that term would be lost silently. FSDP units keep the
// parameters the recomputed graph saved gathered (Note [Double backward]).
thread_local CheckpointPhase t_phase = CheckpointPhase::kNone;
// The params of the innermost region whose forward runs on this thread;
// null outside one and in a recomputation (checkpoint_region_takes()).
thread_local const std::vector<at::Tensor>* t_region_params = nullptr;

// Sets this thread's phase, and with it the region whose forward runs
// (`params` in kForward), until it ends.
class PhaseGuard {
 public:
  explicit PhaseGuard(CheckpointPhase phase, const std::vector<at::Tensor>* params = nullptr)
      : previous_(t_phase), previous_params_(t_region_params) {
    t_phase = phase;
    t_region_params = phase == CheckpointPhase::kForward ? params : nullptr;
  }
  ~PhaseGuard() {
    t_phase = previous_;
    t_region_params = previous_params_;
  }
  PhaseGuard(const PhaseGuard&) = delete;
  PhaseGuard& operator=(const PhaseGuard&) = delete;

 private:
  CheckpointPhase previous_;
  const std::vector<at::Tensor>* previous_params_;
};

/// The generators a checkpointed region may draw from: the CPU's and those of
/// the other devices its inputs are on (a GPU's dropout draws from that GPU's
/// generator), as PyTorch's checkpoint saves them.
std::vector<at::Generator> generators_of(const std::vector<at::Tensor>& inputs) {
  std::vector<at::Generator> gens{at::detail::getDefaultCPUGenerator()};
  std::vector<c10::Device> devices;
  for (const at::Tensor& t : inputs) {
    if (!t.defined() || t.is_cpu() || t.is_meta()) continue;
    if (std::find(devices.begin(), devices.end(), t.device()) != devices.end()) continue;
    devices.push_back(t.device());
    gens.push_back(at::globalContext().defaultGenerator(t.device()));
  }
  return gens;
}

/// Each generator's state, taken under its lock.
std::vector<at::Tensor> rng_states(std::vector<at::Generator>& gens) {
  std::vector<at::Tensor> out;
  for (at::Generator& gen : gens) {
    std::lock_guard<std::mutex> lock(gen.mutex());
    out.push_back(gen.get_state());
  }
  return out;
}

void set_rng_states(std::vector<at::Generator>& gens, const std::vector<at::Tensor>& states) {
  for (size_t i = 0; i < gens.size(); ++i) {
    std::lock_guard<std::mutex> lock(gens[i].mutex());
    gens[i].set_state(states[i]);
  }
}

/// Runs under the autocast settings a region's forward ran under, as
/// PyTorch's checkpoint recomputes (backward usually runs outside autocast),
/// and clears autocast's cache of casts at the outermost exit as its
/// autocast context does.
class AutocastAs {
 public:
  explicit AutocastAs(const compat::AutocastState& state) : previous_(compat::autocast_state()) {
    at::autocast::increment_nesting();
    compat::set_autocast_state(state);
  }
  ~AutocastAs() {
    compat::set_autocast_state(previous_);
    if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
  }
  AutocastAs(const AutocastAs&) = delete;
  AutocastAs& operator=(const AutocastAs&) = delete;

 private:
  compat::AutocastState previous_;
};

/// What backward needs besides the saved inputs; travels in the context as a
/// capsule (an IValue that holds any CustomClassHolder).
struct CheckpointState : torch::CustomClassHolder {
  CheckpointedFunction fn;
  size_t num_inputs = 0;
  // The defined inputs' positions among fn's inputs: only they are the
  // Function's (LibTorch's Function takes no undefined tensor, a default
  // argument's "None"), the others are passed to fn undefined.
  std::vector<size_t> defined_inputs;
  std::vector<at::Tensor> params;
  std::vector<bool> input_requires_grad;  // of each defined input
  std::vector<bool> output_defined;       // of each of fn's outputs, from the forward
  compat::AutocastState autocast;         // the forward's
  std::vector<at::Generator> generators;  // see generators_of()
  std::vector<at::Tensor> rng_states;     // theirs as forward began

  // fn's inputs: `defined` at their positions, undefined tensors elsewhere.
  std::vector<at::Tensor> all_inputs(const std::vector<at::Tensor>& defined) const {
    std::vector<at::Tensor> inputs(num_inputs);
    for (size_t i = 0; i < defined_inputs.size(); ++i) inputs[defined_inputs[i]] = defined[i];
    return inputs;
  }
};

struct CheckpointFunction : torch::autograd::Function<CheckpointFunction> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                at::TensorList inputs_and_params,
                                                const c10::intrusive_ptr<CheckpointState>& state) {
    const std::vector<at::Tensor> defined(inputs_and_params.begin(),
                                          inputs_and_params.begin() + state->defined_inputs.size());
    const std::vector<at::Tensor> inputs = state->all_inputs(defined);
    state->generators = generators_of(inputs);
    state->rng_states = rng_states(state->generators);
    std::vector<at::Tensor> outputs;
    {
      // A region within a region being recomputed is part of that
      // recomputation: its units stay gathered for the backward that follows.
      const bool nested = t_phase == CheckpointPhase::kRecompute;
      PhaseGuard phase(nested ? CheckpointPhase::kRecompute : CheckpointPhase::kForward,
                       &state->params);
      outputs = state->fn(inputs);
    }
    // Only defined outputs are the Function's too; activation_checkpoint()
    // puts the undefined ones back.
    std::vector<at::Tensor> returned;
    for (const at::Tensor& out : outputs) {
      state->output_defined.push_back(out.defined());
      if (out.defined()) returned.push_back(out);
    }
    ctx->save_for_backward(defined);
    ctx->saved_data["state"] = at::IValue::make_capsule(state);
    return returned;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    auto state =
        c10::static_intrusive_pointer_cast<CheckpointState>(ctx->saved_data["state"].toCapsule());
    const std::vector<at::Tensor> saved = ctx->get_saved_variables();
    // A backward with create_graph (a gradient penalty) differentiates this
    // one (Note [Activation checkpointing]).
    const bool create_graph = at::GradMode::is_enabled();
    std::vector<at::Tensor> defined;
    defined.reserve(saved.size());
    for (size_t i = 0; i < saved.size(); ++i) {
      at::Tensor x = create_graph ? saved[i] : saved[i].detach();
      if (state->input_requires_grad[i] && x.is_leaf()) x.requires_grad_(true);
      defined.push_back(std::move(x));
    }
    std::vector<at::Tensor> all_outputs;
    {
      const std::vector<at::Tensor> now = rng_states(state->generators);
      set_rng_states(state->generators, state->rng_states);
      try {
        at::AutoGradMode grad_on(true);
        const AutocastAs autocast(state->autocast);
        PhaseGuard phase(CheckpointPhase::kRecompute);
        all_outputs = state->fn(state->all_inputs(defined));
      } catch (...) {
        set_rng_states(state->generators, now);
        throw;
      }
      set_rng_states(state->generators, now);
    }
    bool same = all_outputs.size() == state->output_defined.size();
    std::vector<at::Tensor> outputs;
    for (size_t i = 0; same && i < all_outputs.size(); ++i) {
      same = all_outputs[i].defined() == state->output_defined[i];
      if (all_outputs[i].defined()) outputs.push_back(all_outputs[i]);
    }
    TORCH_CHECK(same && outputs.size() == grad_outputs.size(),
                error_prefix(-1, "activation checkpoint"), "the recomputation returned ",
                all_outputs.size(), " tensors, the forward ", state->output_defined.size(),
                " (or other ones undefined). The checkpointed function must return the same "
                "tensors every time it runs on the same inputs");
    // Gradients of the recomputed outputs with respect to what needs one.
    std::vector<at::Tensor> roots, root_grads, wrt;
    std::vector<size_t> wrt_index;  // position of each of wrt among the Function's inputs
    for (size_t i = 0; i < outputs.size(); ++i) {
      if (!outputs[i].requires_grad() || !grad_outputs[i].defined()) continue;
      roots.push_back(outputs[i]);
      root_grads.push_back(grad_outputs[i]);
    }
    for (size_t i = 0; i < defined.size(); ++i) {
      if (defined[i].requires_grad()) {
        wrt.push_back(defined[i]);
        wrt_index.push_back(i);
      }
    }
    for (size_t i = 0; i < state->params.size(); ++i) {
      if (state->params[i].requires_grad()) {
        wrt.push_back(state->params[i]);
        wrt_index.push_back(defined.size() + i);
      }
    }
    // One gradient per tensor of inputs_and_params, and none for the state.
    torch::autograd::variable_list grads(defined.size() + state->params.size() + 1);
    if (!roots.empty() && !wrt.empty()) {
      const auto found = torch::autograd::grad(roots, wrt, root_grads, create_graph, create_graph,
                                               /*allow_unused=*/true);
      for (size_t k = 0; k < found.size(); ++k) grads[wrt_index[k]] = found[k];
    }
    return grads;
  }
};

}  // namespace

CheckpointPhase checkpoint_phase() { return t_phase; }

bool checkpoint_region_takes(const at::Tensor& t) {
  if (t_region_params == nullptr || !t.defined()) return false;
  for (const at::Tensor& p : *t_region_params) {
    if (p.unsafeGetTensorImpl() == t.unsafeGetTensorImpl()) return true;
  }
  return false;
}

}  // namespace detail

std::vector<at::Tensor> activation_checkpoint(const CheckpointedFunction& fn,
                                              const std::vector<at::Tensor>& inputs,
                                              const std::vector<at::Tensor>& params) {
  bool needs_grad = false;
  for (const auto* list : {&inputs, &params}) {
    for (const at::Tensor& t : *list) needs_grad = needs_grad || (t.defined() && t.requires_grad());
  }
  if (!at::GradMode::is_enabled() || !needs_grad) return fn(inputs);
  auto state = c10::make_intrusive<detail::CheckpointState>();
  state->fn = fn;
  state->num_inputs = inputs.size();
  state->autocast = compat::autocast_state();
  std::vector<at::Tensor> all;
  std::unordered_set<const c10::TensorImpl*> seen;
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (!inputs[i].defined()) continue;
    state->defined_inputs.push_back(i);
    state->input_requires_grad.push_back(inputs[i].requires_grad());
    all.push_back(inputs[i]);
    seen.insert(inputs[i].unsafeGetTensorImpl());
  }
  // A parameter listed twice (a module registered under two names, tied
  // weights) or passed as an input too gets its gradient once, as through
  // plain autograd: torch::autograd::grad would return it at each place.
  for (const at::Tensor& p : params) {
    if (p.defined() && seen.insert(p.unsafeGetTensorImpl()).second) state->params.push_back(p);
  }
  all.insert(all.end(), state->params.begin(), state->params.end());
  const std::vector<at::Tensor> defined =
      detail::CheckpointFunction::apply(at::TensorList(all), state);
  std::vector<at::Tensor> outputs;
  size_t k = 0;
  for (const bool is_defined : state->output_defined) {
    outputs.push_back(is_defined ? defined[k++] : at::Tensor());
  }
  return outputs;
}

}  // namespace fsdp
