// fsdp::Unit, the handle (see Note [Unit, runtime and root]): what users and
// the wrappers call, forwarded to the unit's runtime.

#include <fsdp/runtime/unit.h>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include "detail/error.h"
#include "runtime/in_place_units.h"
#include "runtime/norm_reduce.h"
#include "runtime/strategy.h"
#include "runtime/unit_runtime.h"

namespace fsdp {

const char* to_string(Unit::TrainingState state) {
  switch (state) {
    case Unit::TrainingState::kIdle:
      return "idle";
    case Unit::TrainingState::kForward:
      return "forward";
    case Unit::TrainingState::kPreBackward:
      return "pre-backward";
    case Unit::TrainingState::kPostBackward:
      return "post-backward";
  }
  return "?";
}

Unit::Unit(FSDPOptions options)
    : runtime_(std::make_unique<detail::UnitRuntime>(*this, std::move(options))) {}

Unit::~Unit() = default;

detail::UnitRuntime& Unit::runtime() const {
  FSDP_CHECK(runtime_ != nullptr, -1, wrapped_ != nullptr ? wrapped_->name() : "wrapper",
             "this wrapper is a pass-through (fsdp::wrap() outside an EnableWrap scope, "
             "or enabled=false): it is no FSDP unit and has no unit state. Check is_active() "
             "first, or make it a unit");
  return *runtime_;
}

void Unit::before_state_use() const { runtime().before_state_use(); }

void Unit::check_not_a_unit(const torch::nn::Module& module) {
  // A pass-through wrapper (fsdp::wrap() outside an EnableWrap scope) is the
  // module it holds: it may become part of a unit, or one.
  const auto* unit = dynamic_cast<const Unit*>(&module);
  FSDP_CHECK(unit == nullptr || !unit->is_active(), -1, module.name(),
             "cannot wrap a module that is already an FSDP unit (", module.name(), " around a ",
             unit->wrapped_ != nullptr ? unit->wrapped_->name() : "module",
             "). Wrap each module once and use that unit where the module is needed");
  FSDP_CHECK(detail::in_place_unit_of(module) == nullptr, -1, module.name(),
             "cannot make a unit of a ", module.name(),
             " that fsdp::fully_shard already made a unit. Shard each module once, and use "
             "fsdp::unit_of(module) to reach its unit");
}

void Unit::init_unit(torch::nn::Module& self, torch::nn::Module* wrapped) {
  wrapped_ = wrapped;
  runtime().init(self, wrapped);
}

void Unit::init_in_place(torch::nn::Module& module) {
  wrapped_ = &module;
  runtime().init(module, &module, detail::UnitRuntime::Driver::kDispatch);
}

// A pass-through wrapper is no unit itself, but fully_shard may make it one.
Unit* unit_of(torch::nn::Module& module) {
  auto* wrapper = dynamic_cast<Unit*>(&module);
  if (wrapper != nullptr && wrapper->is_active()) return wrapper;
  return detail::in_place_unit_of(module);
}

const Unit* unit_of(const torch::nn::Module& module) {
  const auto* wrapper = dynamic_cast<const Unit*>(&module);
  if (wrapper != nullptr && wrapper->is_active()) return wrapper;
  return detail::in_place_unit_of(module);
}

void Unit::deactivate(torch::nn::Module* wrapped) {
  runtime_.reset();
  wrapped_ = wrapped;
}

FlatParameter* Unit::flat_param() const { return runtime_ ? runtime_->flat() : nullptr; }
bool Unit::is_root() const { return runtime_ && runtime_->is_root(); }
Unit::TrainingState Unit::training_state() const {
  return runtime_ ? runtime_->state() : TrainingState::kIdle;
}
const FSDPOptions& Unit::fsdp_options() const { return runtime().options(); }
c10::optional<at::ScalarType> Unit::forward_input_dtype() const {
  return runtime().forward_input_dtype();
}
bool Unit::casts_output_back() const { return runtime_ && runtime_->full_precision_override(); }
c10::optional<at::ScalarType> Unit::forward_output_dtype(
    c10::optional<at::ScalarType> inputs_dtype) const {
  if (casts_output_back()) return inputs_dtype;
  const auto& mp = fsdp_options().mixed_precision();
  return runtime_ && mp ? mp->output_dtype() : c10::nullopt;
}
void Unit::keep_full_precision() { runtime().keep_full_precision(); }
bool Unit::checkpoints_activations() const {
  return runtime_ && runtime_->options().activation_checkpointing();
}
void Unit::set_activation_checkpointing(bool on) { runtime().set_activation_checkpointing(on); }
void Unit::refuse_activation_checkpointing(const char* output_type) const {
  runtime().refuse_activation_checkpointing(output_type);
}
void Unit::pre_forward() { runtime().pre_forward(); }
void Unit::record_forward_inputs(const std::vector<at::Tensor>& inputs, bool all_found) {
  runtime().record_forward_inputs(inputs, all_found);
}
void Unit::post_forward(const std::vector<at::Tensor>& outputs, const char* unknown_output_type) {
  runtime().post_forward(outputs, unknown_output_type);
}
bool Unit::gather_full_params(bool to_cpu, bool with_grads) {
  return runtime().gather_full_params(to_cpu, with_grads);
}
bool Unit::held_by_summon_guard() const { return runtime_ && runtime_->held_by_summon_guard(); }
void Unit::enter_summon_guard() { runtime().enter_summon_guard(); }
void Unit::leave_summon_guard() { runtime().leave_summon_guard(); }
void Unit::release_full_params() { runtime().release_full_params(); }
void Unit::write_back_full_params() { runtime().write_back_full_params(); }
void Unit::zero_optim_grads(bool set_to_none) {
  if (runtime_) runtime_->zero_optim_grads(set_to_none);
}

std::vector<Unit*> Unit::units_in_tree() const {
  std::vector<Unit*> out;
  // A pass-through's parameters are the wrapped module's (it adopted them),
  // and its tree may hold units (fully_shard sees through it).
  torch::nn::Module* self = runtime_ ? runtime_->self() : wrapped_;
  if (self == nullptr) return out;
  for (const auto& m : self->modules(/*include_self=*/true)) {
    if (Unit* unit = unit_of(*m)) out.push_back(unit);
  }
  return out;
}

std::vector<std::pair<std::string, at::Tensor>> Unit::unmanaged_parameters() const {
  std::vector<std::pair<std::string, at::Tensor>> out;
  torch::nn::Module* self = runtime_ ? runtime_->self() : wrapped_;  // see units_in_tree()
  if (self == nullptr) return out;
  std::unordered_set<const void*> seen;  // managed, or listed (a tied one once)
  for (const Unit* unit : units_in_tree()) {
    if (const FlatParameter* flat = unit->flat_param()) {
      for (const auto& slot : flat->slots()) seen.insert(slot.param.unsafeGetTensorImpl());
    }
  }
  for (const auto& p : self->named_parameters()) {
    if (seen.insert(p.value().unsafeGetTensorImpl()).second) out.emplace_back(p.key(), p.value());
  }
  return out;
}

std::vector<at::Tensor> Unit::flat_parameters(bool recurse) const {
  std::vector<at::Tensor> out;
  for (const Unit* unit : units_in_tree()) {
    if (!recurse && unit != this) continue;
    const auto& params = unit->runtime_->optim_params();
    out.insert(out.end(), params.begin(), params.end());
  }
  for (auto& [name, p] : unmanaged_parameters()) {
    if (recurse || name.find('.') == std::string::npos) out.push_back(std::move(p));
  }
  return out;
}

torch::OrderedDict<std::string, at::Tensor> Unit::named_flat_parameters() const {
  torch::OrderedDict<std::string, at::Tensor> out;
  torch::nn::Module* self = runtime_ ? runtime_->self() : wrapped_;  // see units_in_tree()
  if (self == nullptr) return out;
  for (const auto& item : self->named_modules(/*name_prefix=*/"", /*include_self=*/true)) {
    const detail::UnitRuntime* unit = detail::UnitRuntime::of(*item.value());
    if (unit == nullptr || unit->flat() == nullptr) continue;
    const std::string prefix = item.key().empty() ? "" : item.key() + ".";
    const auto& params = unit->optim_params();
    if (!unit->options().use_orig_params()) {
      out.insert(prefix + "_flat_param", params[0]);
      continue;
    }
    for (size_t i = 0; i < params.size(); ++i) {
      out.insert(prefix + unit->flat()->slots()[i].name, params[i]);
    }
  }
  for (auto& [name, p] : unmanaged_parameters()) out.insert(name, std::move(p));
  return out;
}

Unit::NoSyncGuard::NoSyncGuard(std::vector<Unit*> units) : units_(std::move(units)) {
  for (Unit* unit : units_) unit->runtime_->enter_no_sync();
}

Unit::NoSyncGuard::~NoSyncGuard() {
  for (Unit* unit : units_) unit->runtime_->leave_no_sync();
}

Unit::NoSyncGuard Unit::no_sync() {
  // As PyTorch's FSDP: an inner unit's no_sync() would leave the root's
  // other units reducing (and stepping) while this subtree accumulates.
  FSDP_CHECK(!runtime_ || !runtime_->is_inner(), -1, "no_sync", "called on an inner FSDP unit (",
             runtime_ ? runtime_->label() : "",
             "); call it on the root, whose guard covers every unit of the model");
  return NoSyncGuard(units_in_tree());
}

void Unit::set_requires_gradient_sync(bool requires_gradient_sync) {
  FSDP_CHECK(!runtime_ || !runtime_->is_inner(), -1, "set_requires_gradient_sync",
             "called on an inner FSDP unit (", runtime_ ? runtime_->label() : "",
             "); call it on the root, which sets it for every unit of the model");
  for (Unit* unit : units_in_tree()) {
    unit->runtime_->set_requires_gradient_sync(requires_gradient_sync);
  }
}

std::vector<Unit*> Unit::units_to_set(bool recurse) {
  return recurse ? units_in_tree() : std::vector<Unit*>{&runtime().handle()};
}

void Unit::set_reshard_after_forward(bool reshard_after_forward, bool recurse) {
  for (Unit* unit : units_to_set(recurse)) {
    unit->runtime_->set_reshard_after_forward(reshard_after_forward);
  }
}

void Unit::set_reshard_after_backward(bool reshard_after_backward, bool recurse) {
  for (Unit* unit : units_to_set(recurse)) {
    unit->runtime_->set_reshard_after_backward(reshard_after_backward);
  }
}

void Unit::set_gradient_divide_factor(double factor, bool recurse) {
  FSDP_CHECK(factor > 0 && std::isfinite(factor), -1, "set_gradient_divide_factor",
             "expected a positive, finite factor, got ", factor,
             ". The reduced gradient is the ranks' sum divided by it: pass the world size for "
             "their average (the default), 1 for their sum");
  for (Unit* unit : units_to_set(recurse)) unit->runtime_->set_gradient_divide_factor(factor);
}

void Unit::set_unshard_in_backward(bool unshard_in_backward) {
  detail::UnitRuntime& r = runtime();
  FSDP_CHECK(r.driver() == detail::UnitRuntime::Driver::kDispatch, -1, "set_unshard_in_backward",
             r.label(),
             " is a FullyShardedDataParallel wrapper, whose backward reads its parameters "
             "without libfsdp seeing it: skipping their gather could compute with freed "
             "memory. Make the module a unit with fsdp::fully_shard, whose parameters' reads in "
             "backward gather them when needed");
  r.set_unshard_in_backward(unshard_in_backward);
}

void Unit::set_requires_all_reduce(bool requires_all_reduce, bool recurse) {
  bool hybrid = false;
  for (Unit* unit : units_to_set(recurse)) {
    unit->runtime_->set_requires_all_reduce(requires_all_reduce);
    hybrid = hybrid || detail::is_hybrid(unit->runtime_->options().sharding_strategy());
  }
  // Silent in FSDP2; here a user who took it for no_sync learns why every
  // micro-batch still communicates.
  if (!requires_all_reduce && !hybrid) {
    TORCH_WARN_ONCE("fsdp: set_requires_all_reduce(false) changes nothing here: no unit it set ",
                    "is HYBRID_SHARD or _HYBRID_SHARD_ZERO2, the only strategies that all-reduce ",
                    "across nodes. To accumulate gradients without communicating, use ",
                    "set_requires_gradient_sync(false) or no_sync()");
  }
}

Unit::UnshardHandle Unit::unshard(bool async_op) {
  detail::UnitRuntime& r = runtime();
  const uint64_t gather = r.unshard_for_user(async_op);
  return UnshardHandle(this, r.alive(), gather);
}

void Unit::UnshardHandle::wait() {
  const std::shared_ptr<const void> alive = alive_.lock();
  if (alive) unit_->runtime_->wait_for_user_gather(gather_);
}

void Unit::reshard() { runtime().reshard_for_user(); }

void Unit::set_modules_to_forward_prefetch(const std::vector<Unit*>& units) {
  runtime().set_prefetch_targets(units, /*backward=*/false);
}

void Unit::set_modules_to_backward_prefetch(const std::vector<Unit*>& units) {
  runtime().set_prefetch_targets(units, /*backward=*/true);
}

namespace {

using detail::all_norm_max;
using detail::all_norm_sum;
using detail::norm_max;
using detail::NormTerms;

}  // namespace

double Unit::clip_grad_norm_(double max_norm, double norm_type) {
  FSDP_CHECK(max_norm > 0, -1, "clip_grad_norm_", "expected a positive max_norm, got ", max_norm,
             ". Pass the largest global gradient norm to allow");
  FSDP_CHECK(norm_type > 0, -1, "clip_grad_norm_", "expected a positive norm_type, got ", norm_type,
             ". Pass 2.0 (Euclidean), 1.0, or INFINITY");
  const ReducedGradHooks* hooks = runtime_ ? runtime_->grad_hooks() : nullptr;
  FSDP_CHECK(hooks == nullptr, -1, "clip_grad_norm_", hooks ? hooks->owner : "",
             " steps each unit as soon as backward has reduced its gradient, so clipping after "
             "backward comes too late and would change gradients already stepped; turn that off "
             "to clip, or clip nothing");
  const bool inf = std::isinf(norm_type);
  // Sharded gradients are disjoint pieces of a unit's group; a group smaller
  // than the job's (HYBRID_SHARD's node) holds its pieces once per replica,
  // so each counts 1 / replicas of itself and one reduction over the job
  // adds every piece once, whatever strategies the units mix. NO_SHARD
  // gradients are whole copies (counted once, locally). Those of parameters
  // no unit manages are this rank's own, counted once as PyTorch's FSDP
  // does; they differ across ranks, so the largest norm over the ranks is
  // the one every rank clips by (the same everywhere, as documented).
  NormTerms sharded_terms(norm_type), replicated_terms(norm_type), local_terms(norm_type);
  bool any_unit = false, any_sharded = false;  // the same on every rank: what collectives run
  std::vector<at::Tensor> grads;
  ProcessGroup* job = fsdp_options().process_group().get();  // every rank's
  const auto add = [&](const at::Tensor& p, NormTerms& terms, double weight) {
    const at::Tensor& g = p.grad();
    if (!g.defined()) return;
    // Scaled below, an empty one too: its version moves on every rank alike
    // (Note [Gathered before a step]).
    grads.push_back(g);
    if (g.numel() > 0) terms.add(g, weight);
  };
  for (Unit* unit : units_in_tree()) {
    const FlatParameter* flat = unit->flat_param();
    if (flat == nullptr) continue;
    any_unit = true;
    if (flat->keeps_unsharded()) {
      for (const at::Tensor& p : unit->runtime_->optim_params()) add(p, replicated_terms, 1.0);
      continue;
    }
    any_sharded = true;
    const int replicas = detail::replicas_of(job, flat->group());
    for (const at::Tensor& p : unit->runtime_->optim_params()) {
      add(p, sharded_terms, inf ? 1.0 : 1.0 / replicas);
    }
  }
  const auto unmanaged = unmanaged_parameters();
  for (const auto& [name, p] : unmanaged) add(p, local_terms, 1.0);
  if (!any_unit && unmanaged.empty()) return 0.0;
  const double sharded = sharded_terms.value(), replicated = replicated_terms.value(),
               local = local_terms.value();
  double total = sharded;
  if (any_sharded && job != nullptr) {
    total = inf ? all_norm_max(*job, sharded) : all_norm_sum(*job, sharded);
  }
  double combined = inf ? norm_max(norm_max(total, replicated), local)
                        : std::pow(total + replicated + local, 1.0 / norm_type);
  if (!unmanaged.empty() && job != nullptr) combined = all_norm_max(*job, combined);
  // As torch's clip_grad_norm_ (its coefficient clamped at 1): a NaN norm
  // makes every gradient NaN, on every rank alike.
  const double coef = max_norm / (combined + 1e-6);
  if (std::isnan(coef) || coef < 1.0) {
    for (auto& g : grads) g.mul_(coef);
  }
  return combined;
}

}  // namespace fsdp
