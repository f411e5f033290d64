#include <fsdp/runtime/unit.h>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <cmath>
#include <mutex>
#include <unordered_map>
#include <unordered_set>

#include <fsdp/comm/init.h>
#include <fsdp/core/mixed_precision.h>

#include "core/sharded_placeholder.h"
#include "detail/error.h"
#include "runtime/reduced_grad.h"
#include "runtime/unit_init.h"

namespace fsdp {

const char* to_string(ShardingStrategy strategy) {
  switch (strategy) {
    case ShardingStrategy::kFullShard:
      return "FULL_SHARD";
    case ShardingStrategy::kShardGradOp:
      return "SHARD_GRAD_OP";
    case ShardingStrategy::kNoShard:
      return "NO_SHARD";
  }
  return "?";
}

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

Unit::Unit(FSDPOptions options) : options_(std::move(options)) {}

namespace {

/// Note [One unit per parameter]
/// Every parameter a unit flattens is registered here (by its TensorImpl,
/// which set_data keeps) until the unit is destroyed. Wrapping a module that
/// another unit already manages (the same torch::nn::Linear handed to two
/// wrappers) then fails at once, naming the module, instead of two
/// FlatParameters pointing one parameter at their own buffers.
struct ParamRegistry {
  std::mutex mutex;
  std::unordered_map<const void*, const Unit*> owner;
};
ParamRegistry& param_registry() {
  static ParamRegistry* registry = new ParamRegistry();  // outlives static units
  return *registry;
}

}  // namespace

Unit::~Unit() {
  for (const auto& p : grad_placeholders_) detail::release_placeholder(p);
  if (flat_ == nullptr) return;
  ParamRegistry& r = param_registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  for (const auto& slot : flat_->slots()) {
    auto it = r.owner.find(slot.param.unsafeGetTensorImpl());
    if (it != r.owner.end() && it->second == this) r.owner.erase(it);
  }
}

namespace {

// Parameters of `m` and its children, skipping the subtrees of other units
// (they manage their own) and parameters shared with one seen before.
// Ignored modules (FSDPOptions::ignored_modules) keep their parameters.
void collect_managed(torch::nn::Module& m, const torch::nn::Module& self, const std::string& prefix,
                     const detail::ModuleSet& ignored, std::unordered_set<const void*>& seen,
                     std::vector<std::pair<std::string, at::Tensor>>& out,
                     std::vector<std::pair<std::string, const torch::nn::Module*>>* modules) {
  const auto* unit = dynamic_cast<const Unit*>(&m);
  if (&m != &self && unit != nullptr && unit->is_active()) return;
  if (ignored.count(&m) != 0 || (unit != nullptr && ignored.count(unit->wrapped_module()) != 0)) {
    return;
  }
  if (modules != nullptr) modules->emplace_back(prefix, &m);
  for (const auto& p : m.named_parameters(/*recurse=*/false)) {
    if (seen.insert(p.value().unsafeGetTensorImpl()).second)
      out.emplace_back(prefix + p.key(), p.value());
  }
  for (const auto& c : m.named_children()) {
    collect_managed(*c.value(), self, prefix + c.key() + ".", ignored, seen, out, modules);
  }
}

// Parameters already flattened by units nested in `self`, with where they
// live ("block.0.weight"), keyed by TensorImpl.
std::unordered_map<const void*, std::string> owned_by_nested_units(torch::nn::Module& self) {
  std::unordered_map<const void*, std::string> owned;
  for (const auto& item : self.named_modules(/*name_prefix=*/"", /*include_self=*/false)) {
    const auto* unit = dynamic_cast<const Unit*>(item.value().get());
    if (unit == nullptr || !unit->is_active() || unit->flat_param() == nullptr) continue;
    for (const auto& slot : unit->flat_param()->slots()) {
      owned.emplace(slot.param.unsafeGetTensorImpl(), item.key() + "." + slot.name);
    }
  }
  return owned;
}

}  // namespace

void Unit::check_not_a_unit(const torch::nn::Module& module) {
  const auto* unit = dynamic_cast<const Unit*>(&module);
  TORCH_CHECK(unit == nullptr, "fsdp: cannot wrap a module that is already an FSDP unit (",
              module.name(), " around a ",
              unit->wrapped_ != nullptr ? unit->wrapped_->name() : "module",
              "); wrap each module once and use that unit where the module is needed.");
}

void Unit::init_unit(torch::nn::Module& self, torch::nn::Module* wrapped) {
  TORCH_CHECK(self_ == nullptr, "fsdp: a unit was initialised twice");
  self_ = &self;
  wrapped_ = wrapped;
  if (!options_.process_group()) options_.process_group(default_process_group());
  detail::check_param_init_fn(options_, wrapped != nullptr ? wrapped->name() : self.name());
  std::unordered_set<const void*> seen;
  std::vector<std::pair<std::string, at::Tensor>> params;
  std::vector<std::pair<std::string, const torch::nn::Module*>> modules;
  collect_managed(self, self, "", detail::ignored_module_set(options_), seen, params, &modules);
  // A parameter shared with a nested unit would be flattened twice; PyTorch
  // FSDP's answer (the outer unit skips it) breaks as soon as the outer
  // forward uses it while the inner unit is sharded.
  const auto owned = owned_by_nested_units(self);
  for (const auto& [name, p] : params) {
    auto it = owned.find(p.unsafeGetTensorImpl());
    TORCH_CHECK(it == owned.end(), "fsdp: parameter '", name, "' of ", self.name(),
                " is the same tensor as '", it->second,
                "', which a nested FSDP unit already manages. A parameter shared between units "
                "(e.g. tied embedding weights) must belong to one unit: wrap the modules that "
                "share it in the same unit (or leave the nested module unwrapped).");
  }
  {
    // See Note [One unit per parameter].
    ParamRegistry& r = param_registry();
    std::lock_guard<std::mutex> lock(r.mutex);
    for (const auto& [name, p] : params) {
      auto it = r.owner.find(p.unsafeGetTensorImpl());
      if (it == r.owner.end()) continue;
      const Unit& other = *it->second;
      const torch::nn::Module* other_module =
          other.wrapped_ != nullptr ? other.wrapped_ : other.self_;
      TORCH_CHECK(false, "fsdp: cannot wrap ", wrapped != nullptr ? wrapped->name() : self.name(),
                  ": its parameter '", name, "' already belongs to another FSDP unit (around a ",
                  other_module != nullptr ? other_module->name() : "module",
                  "). A module is wrapped once: keep the first FullyShardedDataParallel and use "
                  "it (its module() is the wrapped module) instead of wrapping the module again.");
    }
  }
  const std::string* path = detail::UnitPathScope::current();
  const std::string where = path != nullptr      ? *path
                            : wrapped != nullptr ? wrapped->name()
                                                 : self.name();
  const int rank = options_.process_group()->rank();
  if (path != nullptr && !path->empty()) {
    auto named = params;  // as the user knows them, from the root
    for (auto& [name, p] : named) name = *path + "." + name;
    detail::check_uniform_requires_grad(named, where, options_.use_orig_params(), rank, true);
  } else {
    detail::check_uniform_requires_grad(params, where, options_.use_orig_params(), rank, true);
  }
  keep_full_precision_classes(modules, where, rank);
  // See Note [Deferred initialisation] and Note [Mixed precision].
  detail::UnitInit init(wrapped != nullptr ? *wrapped : self, options_);
  if (params.empty()) {
    if (init.needs_fill()) init.fill(at::Tensor());
    init.cast_buffers();
    return;
  }
  flat_ = std::make_unique<FlatParameter>(std::move(params), options_.process_group(),
                                          flat_param_config(init));
  {
    ParamRegistry& r = param_registry();
    std::lock_guard<std::mutex> lock(r.mutex);
    for (const auto& slot : flat_->slots()) r.owner[slot.param.unsafeGetTensorImpl()] = this;
  }
  init.cast_buffers();
  register_grad_hooks();
  make_optim_params();
}

void Unit::keep_full_precision_classes(
    const std::vector<std::pair<std::string, const torch::nn::Module*>>& modules,
    const std::string& where, int rank) {
  const auto& mp = options_.mixed_precision();
  if (!mp || !mp->param_dtype()) return;
  const auto& classes = mp->module_classes_to_ignore();
  // A unit around one module of these classes computes in full precision,
  // as auto_wrap makes it (see Planner::warn_full_precision in auto_wrap.cpp).
  const torch::nn::Module& target = wrapped_ != nullptr ? *wrapped_ : *self_;
  for (const auto& c : classes) {
    if (!c.matches(target)) continue;
    options_.mixed_precision(c10::nullopt);
    keep_full_precision();
    return;
  }
  std::vector<std::string> found;
  for (const auto& [path, m] : modules) {
    for (const auto& c : classes) {
      if (c.matches(*m)) {
        found.push_back(c.name + " at " +
                        (path.empty() ? "<root>" : path.substr(0, path.size() - 1)));
        break;
      }
    }
  }
  if (found.empty()) return;
  std::string list;
  for (size_t i = 0; i < found.size(); ++i) list += (i ? ", " : "") + found[i];
  TORCH_CHECK(false, "[rank ", rank, "] fsdp(", where,
              "): expected the modules of MixedPrecision::module_classes_to_ignore to be FSDP "
              "units of their own, got [",
              list, "] inside this unit, which computes in ", c10::toString(*mp->param_dtype()),
              ". They must compute in full precision, which a unit computing in low precision "
              "cannot do. Hold each as fsdp::FullyShardedDataParallel<Impl> where its parent "
              "calls it (such a unit is kept in full precision), or make it a Sequential entry "
              "and use fsdp::auto_wrap, or remove its class from module_classes_to_ignore.");
}

void Unit::make_optim_params() {
  const at::Tensor& shard = flat_->shard();
  if (!options_.use_orig_params()) {
    optim_params_ = {shard};
    return;
  }
  // Each slot's piece is its intersection with this rank's shard: a view of
  // the shard (so an optimizer step updates the shard in place), and a leaf.
  const int64_t begin = flat_->shard_offset(), end = begin + shard.numel();
  const at::Tensor base = shard.detach();
  for (size_t i = 0; i < flat_->slots().size(); ++i) {
    const auto& slot = flat_->slots()[i];
    const int64_t lo = std::max(begin, slot.offset), hi = std::min(end, slot.offset + slot.numel);
    at::Tensor piece = base.narrow(0, lo < hi ? lo - begin : 0, lo < hi ? hi - lo : 0);
    piece.set_requires_grad(slot.param.requires_grad());  // as when wrapped
    optim_params_.push_back(piece);
  }
}

void Unit::assign_reduced_grad(const std::vector<bool>* received) {
  grad_shard_ = full_precision_grad(grad_shard_);  // see Note [Mixed precision]
  if (!options_.use_orig_params()) {
    // No rank got a gradient: the shard's .grad stays as it was.
    if (received == nullptr || (*received)[0]) {
      detail::accumulate_reduced_grad(optim_params_[0], grad_shard_);
    }
    return;
  }
  const int64_t begin = flat_->shard_offset();
  for (size_t i = 0; i < optim_params_.size(); ++i) {
    at::Tensor& piece = optim_params_[i];
    // See Note [Parameters without gradients].
    if (!piece.requires_grad() || (received != nullptr && !(*received)[i])) continue;
    const auto& slot = flat_->slots()[i];
    const int64_t lo = std::max(begin, slot.offset);
    detail::accumulate_reduced_grad(
        piece, grad_shard_.narrow(0, piece.numel() > 0 ? lo - begin : 0, piece.numel()));
  }
}

void Unit::register_grad_hooks() {
  const auto& slots = flat_->slots();
  slot_trainable_.assign(slots.size(), false);
  // A unit frozen entirely when wrapped can be unfrozen later through its
  // shard (as PyTorch's FlatParameter can; seed 004 does it): every slot gets
  // its hook, made while requires_grad is briefly on.
  const bool all_frozen = !flat_->shard().requires_grad();
  for (size_t i = 0; i < slots.size(); ++i) {
    grad_placeholders_.push_back(detail::make_placeholder(
        slots[i].param, detail::PlaceholderKind::kGradient, "'" + slots[i].name + "'"));
    auto& param = const_cast<at::Tensor&>(slots[i].param);
    if (!param.requires_grad() && !all_frozen) continue;
    slot_trainable_[i] = true;
    if (all_frozen) param.set_requires_grad(true);
    auto acc = torch::autograd::impl::grad_accumulator(param);
    if (all_frozen) param.set_requires_grad(false);
    acc->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
        [this, i](const torch::autograd::variable_list& outputs,
                  const torch::autograd::variable_list&) {
          on_grad_ready(i);
          return outputs;
        }));
    grad_accumulators_.push_back(std::move(acc));  // autograd holds only a weak_ptr
  }
}

std::vector<at::Tensor> Unit::flat_parameters() const {
  std::vector<at::Tensor> out;
  for (const Unit* unit : units_in_tree()) {
    out.insert(out.end(), unit->optim_params_.begin(), unit->optim_params_.end());
  }
  return out;
}

torch::OrderedDict<std::string, at::Tensor> Unit::named_flat_parameters() const {
  torch::OrderedDict<std::string, at::Tensor> out;
  if (self_ == nullptr) return out;
  for (const auto& item : self_->named_modules(/*name_prefix=*/"", /*include_self=*/true)) {
    const auto* unit = dynamic_cast<const Unit*>(item.value().get());
    if (unit == nullptr || !unit->flat_) continue;
    const std::string prefix = item.key().empty() ? "" : item.key() + ".";
    if (!unit->options_.use_orig_params()) {
      out.insert(prefix + "_flat_param", unit->optim_params_[0]);
      continue;
    }
    for (size_t i = 0; i < unit->optim_params_.size(); ++i) {
      out.insert(prefix + unit->flat_->slots()[i].name, unit->optim_params_[i]);
    }
  }
  return out;
}

void Unit::transition(TrainingState from, TrainingState to) {
  TORCH_INTERNAL_ASSERT(state_ == from, "fsdp: unit expected to be in state ", to_string(from),
                        " before ", to_string(to), ", but it is ", to_string(state_));
  state_ = to;
}

void Unit::lazy_init_root() {
  root_ = this;
  units_ = units_in_tree();
  for (Unit* unit : units_) unit->root_ = this;
  // Error messages about sharded parameters name each unit by its path.
  for (const auto& item : self_->named_modules(/*name_prefix=*/"", /*include_self=*/true)) {
    auto* unit = dynamic_cast<Unit*>(item.value().get());
    if (unit == nullptr || !unit->is_active() || !unit->flat_) continue;
    unit->flat_->set_unit_path(item.key());
    const auto& slots = unit->flat_->slots();
    const std::string where = item.key().empty() ? "" : item.key() + ".";
    for (size_t i = 0; i < slots.size(); ++i) {
      detail::rename_placeholder(unit->grad_placeholders_[i], "'" + where + slots[i].name + "'");
    }
  }
  exec_order_ =
      std::make_unique<ExecOrder>(*self_, options_.process_group(), options_.check_forward_order());
}

void Unit::pre_forward() {
  if (root_ == nullptr) lazy_init_root();
  if (state_ != TrainingState::kIdle) {
    // A forward after a forward whose backward never ran completes nothing:
    // only the state is reset (the gradients of that backward never existed).
    state_ = TrainingState::kIdle;
  }
  transition(TrainingState::kIdle, TrainingState::kForward);
  if (is_root()) root_->exec_order_->begin_forward(self_->is_training());
  if (!flat_) return;
  root_->exec_order_->before_unshard(*this);  // See Note [Forward order].
  // requires_grad(false) set on the shard after wrapping freezes the unit's
  // original parameters too, so autograd computes no gradient for them.
  // (With use_orig_params, per parameter: its piece, or the original itself.)
  const bool trainable = flat_->shard().requires_grad();
  const bool per_param = options_.use_orig_params();
  trainable_slots_ = 0;
  const auto& slots = flat_->slots();
  clear_moved_grads();
  for (size_t i = 0; i < slots.size(); ++i) {
    const bool want = slot_trainable_[i] && (per_param ? optim_params_[i].requires_grad() &&
                                                             slots[i].param.requires_grad()
                                                       : trainable);
    if (slots[i].param.requires_grad() != want) {
      const_cast<at::Tensor&>(slots[i].param).set_requires_grad(want);
    }
    trainable_slots_ += want ? 1 : 0;
  }
  flat_->unshard();
  prefetch_forward();
}

void Unit::clear_moved_grads() {
  // The last backward's moved gradient (a placeholder) must not meet
  // AccumulateGrad: the next backward's gradient starts afresh.
  for (const auto& slot : flat_->slots()) {
    if (detail::is_placeholder(slot.param.grad())) {
      const_cast<at::Tensor&>(slot.param).mutable_grad().reset();
    }
  }
}

void Unit::prefetch_forward() {
  if (!options_.forward_prefetch()) return;
  // The next unit of the first iteration's order starts gathering now; its
  // own pre_forward waits for it.
  if (Unit* next = root_->exec_order_->next(*this)) next->flat_->unshard_async();
}

void Unit::post_forward(const std::vector<at::Tensor>& outputs, const char* unknown_output_type) {
  if (is_root()) exec_order_->end_forward();
  transition(TrainingState::kForward, TrainingState::kIdle);
  const bool grad_enabled = at::GradMode::is_enabled();
  TORCH_CHECK(
      unknown_output_type == nullptr || !grad_enabled || !flat_ || !flat_->shard().requires_grad(),
      "fsdp: the forward of ", flat_ ? flat_->unit_label() : "an FSDP unit", " (",
      wrapped_ != nullptr ? wrapped_->name() : self_->name(), ") returns ",
      c10::demangle(unknown_output_type),
      ", in which libfsdp cannot find the tensors that backward starts from, so it "
      "cannot gather the unit's parameters for backward. Return at::Tensor, "
      "std::vector<at::Tensor>, or a std::tuple / std::pair of these.");
  if (flat_ && (!grad_enabled ||
                (!is_root() && options_.sharding_strategy() == ShardingStrategy::kFullShard))) {
    flat_->reshard();
  }
  if (!grad_enabled) return;
  bool backward_reaches = false;
  for (const at::Tensor& output : outputs) {
    if (!output.defined() || !output.requires_grad()) continue;
    backward_reaches = true;
    // See Note [FSDP and autograd]. The first of the outputs whose gradient
    // arrives runs pre_backward; it is idempotent per backward.
    const_cast<at::Tensor&>(output).register_hook([this](const at::Tensor&) { pre_backward(); });
  }
  if (backward_reaches) join_reduction_order();
}

// Note [Reduction order]
// Ranks pair their collectives by order, so every rank must launch the same
// reductions in the same order. Launching each unit's reduction as soon as
// its gradients are complete does that only while every rank's backward
// gives the same units their gradients: a unit whose parameters get
// gradients on some ranks and not on others (a branch taken on some ranks'
// data, a head whose output only some ranks' losses use) would launch on
// those ranks alone and pair with another unit's reduction elsewhere: a hang,
// or, at equal sizes, gradients silently exchanged between units. Plain
// LibTorch on the ranks' concatenated data gives such parameters the mean
// of what the ranks that used them computed, the others adding zeros.
// So every unit whose forward this iteration returned a tensor that needs a
// gradient (the same on every rank, which runs the same forward order:
// Note [Forward order]) joins the root's reduction order, and reductions are
// launched in the reverse of that order only: a unit whose gradients are
// complete launches together with every complete unit after it, up to the
// first incomplete one. Backward completes units in about that order, so
// nothing waits in the usual case. At the end of backward the rest launch in
// the same order, with zeros for what this rank did not get; then the ranks
// agree which units and parameters got a gradient anywhere (Note
// [Parameters without gradients]), and those that got none on any rank keep
// their .grad as it was. That is the whole story for SHARD_GRAD_OP and
// NO_SHARD, which gather nothing in backward. FULL_SHARD gathers a unit's
// parameters again where backward reaches its outputs (or prefetches them),
// so its all-gathers differ too, interleaved with the reductions by local
// timing: no local rule orders them alike. The same all-reduce therefore
// counts, per FULL_SHARD unit, the ranks whose backward reached it, and a
// count between 0 and the world size is an error on every rank naming the
// units (when mismatched collectives did not fail first), never a silent
// exchange of parameters. Separate process groups for gathers and reductions
// would lift this; PyTorch's FSDP does not support it either.
void Unit::join_reduction_order() {
  if (!flat_ || trainable_slots_ == 0) return;
  auto& order = root_->reduction_order_;
  if (std::find(order.begin(), order.end(), this) == order.end()) order.push_back(this);
}

void Unit::launch_ready_reductions() {
  auto& order = reduction_order_;
  while (reductions_launched_ < order.size()) {
    Unit* unit = order[order.size() - 1 - reductions_launched_];
    if (!unit->require_sync_ || unit->grads_ready_ < unit->trainable_slots_) return;
    if (!unit->grad_work_) unit->launch_grad_reduction();
    ++reductions_launched_;
  }
}

void Unit::pre_backward() {
  Unit* root = root_ != nullptr ? root_ : this;
  if (!root->callback_queued_) {
    root->callback_queued_ = true;
    torch::autograd::Engine::get_default_engine().queue_callback(
        [root] { root->end_of_backward(); });
  }
  if (backward_seen_) return;
  backward_seen_ = true;
  transition(TrainingState::kIdle, TrainingState::kPreBackward);
  if (flat_) {
    // A second backward through the same graph (retain_graph) accumulates
    // into the shards' gradients as plain LibTorch accumulates into .grad.
    clear_moved_grads();
    flat_->unshard();
  }
  if (options_.backward_prefetch() == BackwardPrefetch::kBackwardPre) prefetch_backward();
}

void Unit::prefetch_backward() {
  // Backward runs the first iteration's forward order in reverse: the unit
  // recorded before this one is the next to need its parameters.
  Unit* root = root_ != nullptr ? root_ : this;
  Unit* next = root->exec_order_ ? root->exec_order_->previous(*this) : nullptr;
  if (next != nullptr && !next->backward_seen_ && next->state_ == TrainingState::kIdle) {
    next->flat_->unshard_async();
  }
}

void Unit::on_grad_ready(size_t slot) {
  const auto& param = flat_->slots()[slot].param;
  if (!param.grad().defined()) return;
  // Note [Filling the flat gradient]
  // The buffer starts uninitialised: a slot's first gradient is copied in,
  // later ones (inside no_sync(), the buffer lives across backwards) are
  // added; slots that got none and the padding are zeroed just before the
  // reduction. Zero-filling up front and adding cost a unit-sized memset and
  // a third more memory traffic per backward.
  if (!flat_grad_.defined()) {
    flat_grad_ = flat_->new_flat_grad();
    slot_filled_.assign(flat_->slots().size(), false);
  }
  at::Tensor dst = flat_->slot_view(flat_grad_, slot);
  if (slot_filled_[slot]) {
    dst.add_(param.grad().reshape({-1}));
  } else {
    dst.copy_(param.grad().reshape({-1}));
    slot_filled_[slot] = true;
  }
  const_cast<at::Tensor&>(param).mutable_grad() = grad_placeholders_[slot];
  if (++grads_ready_ != trainable_slots_ || !require_sync_) return;
  const auto& order = root_->reduction_order_;
  if (std::find(order.begin(), order.end(), this) == order.end()) {
    launch_grad_reduction();  // not from this iteration's forward: nothing to order it by
  } else {
    root_->launch_ready_reductions();  // See Note [Reduction order].
  }
}

void Unit::launch_grad_reduction() {
  TORCH_INTERNAL_ASSERT(!grad_work_, "fsdp: gradient reduction launched twice");
  ProcessGroup& group = flat_->group();
  if (!flat_grad_.defined()) {  // no gradient on this rank: zeros (Note [Reduction order])
    flat_grad_ = flat_->new_flat_grad();
    slot_filled_.assign(flat_->slots().size(), false);
  }
  for (size_t i = 0; i < slot_filled_.size(); ++i) {
    if (!slot_filled_[i]) flat_->slot_view(flat_grad_, i).zero_();
  }
  warn_unused_slots();
  flat_->zero_padding(flat_grad_);
  if (flat_->keeps_unsharded()) {
    grad_shard_ = flat_grad_;
    grad_work_ = group.all_reduce(grad_shard_, ReduceOp::kAvg);
  } else {
    grad_shard_ = at::empty({flat_->shard().numel()}, flat_grad_.options());
    grad_work_ = group.reduce_scatter_tensor(grad_shard_, flat_grad_, ReduceOp::kAvg);
  }
  flat_grad_ = at::Tensor();  // the Work keeps it alive until reduced
  if (state_ == TrainingState::kPreBackward) state_ = TrainingState::kPostBackward;
  flat_->reshard();
  if (options_.backward_prefetch() == BackwardPrefetch::kBackwardPost) prefetch_backward();
}

void Unit::warn_unused_slots() {
  if (options_.use_orig_params() || warned_unused_) return;
  // Only a unit that got some gradient here: one that got none may keep its
  // .grad (if no rank got one; Note [Reduction order]).
  if (std::find(slot_filled_.begin(), slot_filled_.end(), true) == slot_filled_.end()) return;
  std::string names;
  for (size_t i = 0; i < slot_filled_.size(); ++i) {
    const auto& slot = flat_->slots()[i];
    if (slot_filled_[i] || !slot.param.requires_grad()) continue;
    names += (names.empty() ? "" : ", ") + slot.name;
  }
  if (names.empty()) return;
  warned_unused_ = true;
  TORCH_WARN("[rank ", flat_->group().rank(), "] fsdp(", flat_->unit_label(), "): parameters [",
             names,
             "] received no gradient in this backward on this rank (not used in the forward). "
             "With flat shards (use_orig_params=false) one gradient tensor holds the whole "
             "unit, so they get a zero gradient: plain SGD leaves them, but weight decay and "
             "momentum (AdamW, SGD with momentum) still move them, unlike plain LibTorch, "
             "where their .grad stays undefined. Pass FSDPOptions().use_orig_params(true) "
             "(they then keep an undefined .grad), or put them in a unit of their own. "
             "(Warned once per unit.)");
}

void Unit::finish_reduction() {
  if (!require_sync_) return;  // no_sync(): the unsharded gradient waits for later
  // Gradients that arrived only in part (unused parameters), or only inside
  // no_sync(), are reduced now.
  if (flat_ && flat_grad_.defined() && !grad_work_) launch_grad_reduction();
  if (grad_work_) grad_work_.wait();
}

void Unit::finish_backward(const std::vector<bool>* received) {
  if (!require_sync_) {  // no_sync(): keep the unsharded gradient for later
    grads_ready_ = 0;
    backward_seen_ = false;
    if (flat_) flat_->reshard();
    state_ = TrainingState::kIdle;
    return;
  }
  if (grad_work_) assign_reduced_grad(received);
  grad_work_ = Work();
  grad_shard_ = at::Tensor();
  flat_grad_ = at::Tensor();
  grads_ready_ = 0;
  backward_seen_ = false;
  if (flat_) flat_->reshard();
  state_ = TrainingState::kIdle;
}

// Note [Parameters without gradients]
// In plain LibTorch a parameter the forward did not use keeps its .grad
// (undefined, if never set), so optimizers skip it: no weight decay, no
// momentum. A unit's gradient is one flat buffer, reduced whole, in which
// such a parameter's part is zero. With use_orig_params each parameter has
// its own piece of the shard, so a piece whose parameter got no gradient on
// any rank is left alone. "Any rank" needs agreement: the end-of-backward
// callback all-reduces (sums) one flag per slot of every use_orig_params unit,
// after every unit's reduction was launched and waited for, so every rank
// issues the same collectives in the same order (one small all-reduce per
// backward). With flat shards the whole shard gets the gradient; a warning
// names the parameters once per unit. A unit that got no gradient on any
// rank (one flag per flat-shard unit in the same all-reduce) leaves its
// shard's .grad as it was (undefined if never set); see also Note
// [Reduction order].
std::vector<std::vector<bool>> Unit::agree_received_grads() const {
  // Per unit: one flag per slot with use_orig_params, else one; then, for a
  // FULL_SHARD unit that is not the root, whether backward reached its
  // outputs here. Summed over the ranks.
  const auto grad_flags = [](const Unit& unit) -> size_t {
    if (!unit.flat_) return 0;
    return unit.options_.use_orig_params() ? unit.flat_->slots().size() : 1;
  };
  const auto regathers = [this](const Unit& unit) {
    return unit.flat_ && &unit != this &&
           unit.options_.sharding_strategy() == ShardingStrategy::kFullShard;
  };
  std::vector<std::vector<bool>> out(units_.size());
  int64_t total = 0;
  ProcessGroup* group = options_.process_group() ? options_.process_group().get() : nullptr;
  for (const Unit* unit : units_) {
    if (!unit->flat_) continue;
    total += static_cast<int64_t>(grad_flags(*unit)) + (regathers(*unit) ? 1 : 0);
    if (group == nullptr) group = &unit->flat_->group();
  }
  if (total == 0 || !require_sync_) return out;
  // Last: whether this rank's forward order ever left the first iteration's
  // (already warned: collectives unchecked, as PyTorch's FSDP has it).
  at::Tensor flags = at::zeros({total + 1}, at::kFloat);
  float* f = flags.data_ptr<float>();
  flags.data_ptr<float>()[total] = exec_order_ && exec_order_->warned() ? 1.f : 0.f;
  for (const Unit* unit : units_) {
    if (!unit->flat_) continue;
    const auto& filled = unit->slot_filled_;
    const bool reduced = static_cast<bool>(unit->grad_work_);
    if (unit->options_.use_orig_params()) {
      for (size_t i = 0; i < filled.size(); ++i) *f++ = reduced && filled[i] ? 1.f : 0.f;
    } else {
      const bool any = std::find(filled.begin(), filled.end(), true) != filled.end();
      *f++ = reduced && any ? 1.f : 0.f;
    }
    if (regathers(*unit)) *f++ = unit->backward_seen_ ? 1.f : 0.f;
  }
  const int world = group->size();
  if (world > 1) group->all_reduce(flags, ReduceOp::kSum).wait();
  f = flags.data_ptr<float>();
  std::string uneven;
  for (size_t u = 0; u < units_.size(); ++u) {
    const Unit& unit = *units_[u];
    if (!unit.flat_) continue;
    for (size_t i = 0; i < grad_flags(unit); ++i) out[u].push_back(*f++ > 0.5f);
    if (!regathers(unit)) continue;
    const float reached = *f++;
    if (reached > 0.5f && reached < world - 0.5f) {
      uneven += (uneven.empty() ? "" : ", ") + unit.flat_->unit_label();
    }
  }
  // See Note [Reduction order]: under FULL_SHARD a unit's parameters are
  // gathered again where backward reaches its outputs, so ranks that differ
  // there gather different units; whatever the collectives did, say why.
  const bool order_changed = *f > 0.5f;
  FSDP_CHECK(uneven.empty() || order_changed, group->rank(), "backward",
             "backward reached the outputs of ", uneven,
             " on some ranks but not on others (their loss did not use them). Under "
             "FULL_SHARD every rank must then gather the same parameters in backward, "
             "which it cannot know. Let every rank's loss use those outputs (add 0 * the "
             "unused term), or make those units SHARD_GRAD_OP or NO_SHARD, which gather "
             "nothing in backward and train like plain LibTorch here");
  return out;
}

std::vector<Unit*> Unit::units_in_tree() const {
  std::vector<Unit*> out;
  if (self_ == nullptr) return out;
  for (const auto& m : self_->modules(/*include_self=*/true)) {
    auto* unit = dynamic_cast<Unit*>(m.get());
    if (unit != nullptr && unit->is_active()) out.push_back(unit);
  }
  return out;
}

Unit::NoSyncGuard::NoSyncGuard(std::vector<Unit*> units) : units_(std::move(units)) {
  for (Unit* unit : units_) unit->require_sync_ = false;
}

Unit::NoSyncGuard::~NoSyncGuard() {
  for (Unit* unit : units_) unit->require_sync_ = true;
}

Unit::NoSyncGuard Unit::no_sync() { return NoSyncGuard(units_in_tree()); }

double Unit::clip_grad_norm_(double max_norm, double norm_type) {
  TORCH_CHECK(max_norm > 0, "fsdp clip_grad_norm_: max_norm must be positive, got ", max_norm);
  TORCH_CHECK(norm_type > 0, "fsdp clip_grad_norm_: norm_type must be positive, got ", norm_type);
  const bool inf = std::isinf(norm_type);
  // Sharded gradients are disjoint pieces (reduced over the group);
  // NO_SHARD gradients are whole copies (counted once, locally).
  double sharded = 0, replicated = 0;
  std::vector<at::Tensor> grads;
  ProcessGroup* group = nullptr;
  for (Unit* unit : units_in_tree()) {
    if (!unit->flat_) continue;
    group = &unit->flat_->group();
    for (const at::Tensor& p : unit->optim_params_) {
      const at::Tensor& g = p.grad();
      if (!g.defined() || g.numel() == 0) continue;
      grads.push_back(g);
      const double part = inf ? g.abs().max().item<double>()
                              : g.to(at::kDouble).abs().pow(norm_type).sum().item<double>();
      double& acc = unit->flat_->keeps_unsharded() ? replicated : sharded;
      acc = inf ? std::max(acc, part) : acc + part;
    }
  }
  if (group == nullptr) return 0.0;
  at::Tensor total = at::full({1}, sharded, at::kDouble);
  group->all_reduce(total, inf ? ReduceOp::kMax : ReduceOp::kSum).wait();
  const double combined = inf ? std::max(total.item<double>(), replicated)
                              : std::pow(total.item<double>() + replicated, 1.0 / norm_type);
  const double coef = max_norm / (combined + 1e-6);
  if (coef < 1.0) {
    for (auto& g : grads) g.mul_(coef);
  }
  return combined;
}

void Unit::end_of_backward() {
  callback_queued_ = false;
  // What did not launch during backward launches now, in the same order on
  // every rank (Note [Reduction order]).
  for (size_t i = reductions_launched_; i < reduction_order_.size(); ++i) {
    Unit* unit = reduction_order_[reduction_order_.size() - 1 - i];
    if (unit->require_sync_ && !unit->grad_work_) unit->launch_grad_reduction();
  }
  reduction_order_.clear();
  reductions_launched_ = 0;
  for (Unit* unit : units_) unit->finish_reduction();
  const auto received = agree_received_grads();  // See Note [Parameters without gradients].
  for (size_t i = 0; i < units_.size(); ++i) {
    units_[i]->finish_backward(received[i].empty() ? nullptr : &received[i]);
  }
}

void Unit::zero_optim_grads(bool set_to_none) {
  at::NoGradGuard no_grad;
  for (at::Tensor& p : optim_params_) {
    at::Tensor& grad = p.mutable_grad();
    if (!grad.defined()) continue;
    if (set_to_none) {
      grad.reset();
    } else {
      grad.zero_();
    }
  }
}

}  // namespace fsdp
