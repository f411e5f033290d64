// detail::UnitRuntime: construction, the parameters it owns, what the
// optimizer steps, and gathering outside forward and backward. The forward
// and backward hooks are in unit_hooks.cpp. See Note [Unit, runtime and root].

#include "runtime/unit_runtime.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>

#include <algorithm>
#include <mutex>
#include <unordered_map>
#include <unordered_set>

#include <fsdp/comm/init.h>

#include "comm/agreement.h"
#include "core/sharded_placeholder.h"
#include "detail/error.h"
#include "memory/cpu_allocator.h"
#include "runtime/hybrid.h"
#include "runtime/reduced_grad.h"
#include "runtime/root_state.h"
#include "runtime/unit_collectives.h"
#include "runtime/unit_init.h"

namespace fsdp::detail {

namespace {

/// Note [One unit per parameter]
/// Every parameter a unit flattens is registered here (by its TensorImpl,
/// which set_data keeps) until the unit is destroyed. Wrapping a module that
/// another unit already manages (the same torch::nn::Linear handed to two
/// wrappers) then fails at once, naming the module, instead of two
/// FlatParameters pointing one parameter at their own buffers.
struct ParamRegistry {
  std::mutex mutex;
  std::unordered_map<const void*, const UnitRuntime*> owner;
};
ParamRegistry& param_registry() {
  static ParamRegistry* registry = new ParamRegistry();  // outlives static units
  return *registry;
}

// Buffers units cast to buffer_dtype, with their dtype before (see
// CastBuffer), until the unit that cast them is destroyed: one module's
// buffer registered in several units' modules (a shared rotary table) is
// cast by the first and found by the others.
struct BufferRegistry {
  std::mutex mutex;
  std::unordered_map<const void*, std::pair<const UnitRuntime*, at::ScalarType>> saved;
};
BufferRegistry& buffer_registry() {
  static BufferRegistry* registry = new BufferRegistry();  // outlives static units
  return *registry;
}

// Parameters of `m` and its children, skipping the subtrees of other units
// (they manage their own) and parameters shared with one seen before.
// Ignored modules (FSDPOptions::ignored_modules) keep their parameters.
void collect_managed(torch::nn::Module& m, const torch::nn::Module& self, const std::string& prefix,
                     const ModuleSet& ignored, std::unordered_set<const void*>& seen,
                     std::vector<std::pair<std::string, at::Tensor>>& out,
                     std::vector<std::pair<std::string, const torch::nn::Module*>>* modules) {
  const Unit* unit = unit_of(m);
  if (&m != &self && unit != nullptr) return;
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
    const UnitRuntime* unit = UnitRuntime::of(*item.value());
    if (unit == nullptr || unit->flat() == nullptr) continue;
    for (const auto& slot : unit->flat()->slots()) {
      owned.emplace(slot.param.unsafeGetTensorImpl(), item.key() + "." + slot.name);
    }
  }
  return owned;
}

// The module a unit stands for in messages: what it wraps, else itself.
const torch::nn::Module* shown_module(const UnitRuntime& unit) {
  const torch::nn::Module* wrapped = unit.handle().wrapped_module();
  return wrapped != nullptr ? wrapped : unit.self();
}

}  // namespace

UnitRuntime::UnitRuntime(Unit& handle, FSDPOptions options)
    : handle_(handle), options_(std::move(options)) {}

UnitRuntime::~UnitRuntime() {
  try {
    release_copied_out(/*wait=*/true);  // not freed while the copy-out stream reads it
  } catch (...) {  // NOLINT(bugprone-empty-catch): a destructor; the device failed already
  }
  // Note [A model's units outlive it].
  if (root_ != nullptr && root_ != owned_root_.get()) root_->forget(*this);
  if (owned_root_) owned_root_->orphan_units();
  forget_forward_inputs();  // no hook of a leaf that outlives the unit calls into it
  for (const auto& p : grad_placeholders_) release_placeholder(p);
  if (!cast_buffers_.empty()) {
    BufferRegistry& r = buffer_registry();
    std::lock_guard<std::mutex> lock(r.mutex);
    for (const CastBuffer& c : cast_buffers_) {
      auto it = r.saved.find(c.buffer.unsafeGetTensorImpl());
      if (it != r.saved.end() && it->second.first == this) r.saved.erase(it);
    }
  }
  if (flat_ == nullptr) return;
  ParamRegistry& r = param_registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  for (const auto& slot : flat_->slots()) {
    auto it = r.owner.find(slot.param.unsafeGetTensorImpl());
    if (it != r.owner.end() && it->second == this) r.owner.erase(it);
  }
}

UnitRuntime* UnitRuntime::of(const torch::nn::Module& module) {
  const Unit* unit = unit_of(module);
  return unit != nullptr ? unit->runtime_.get() : nullptr;
}

std::vector<UnitRuntime*> UnitRuntime::all_in(const torch::nn::Module& model) {
  std::vector<UnitRuntime*> out;
  for (const auto& m : model.modules(/*include_self=*/true)) {
    if (UnitRuntime* unit = of(*m)) out.push_back(unit);
  }
  return out;
}

c10::optional<at::ScalarType> saved_buffer_dtype(const at::Tensor& buffer) {
  BufferRegistry& r = buffer_registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  auto it = r.saved.find(buffer.unsafeGetTensorImpl());
  if (it == r.saved.end()) return c10::nullopt;
  return it->second.second;
}

void UnitRuntime::remember_cast_buffers(std::vector<CastBuffer> cast) {
  cast_buffers_ = std::move(cast);
  BufferRegistry& r = buffer_registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  for (const CastBuffer& c : cast_buffers_) {
    r.saved.emplace(c.buffer.unsafeGetTensorImpl(), std::make_pair(this, c.saved_dtype));
  }
}

bool UnitRuntime::is_root() const { return root_ != nullptr && &root_->root() == this; }

RootState& UnitRuntime::root() const {
  TORCH_INTERNAL_ASSERT(root_ != nullptr, "fsdp: unit used before its root's first forward");
  return *root_;
}

std::string UnitRuntime::label() const {
  return flat_ ? flat_->unit_label() : std::string("an FSDP unit");
}

std::string UnitRuntime::module_name() const {
  const torch::nn::Module* m = shown_module(*this);
  return m != nullptr ? m->name() : std::string("module");
}

void UnitRuntime::init(torch::nn::Module& self, torch::nn::Module* wrapped, Driver driver) {
  TORCH_INTERNAL_ASSERT(self_ == nullptr, "fsdp: a unit was initialised twice");
  self_ = &self;
  driver_ = driver;
  if (driver == Driver::kDispatch) self_alive_ = self.weak_from_this();
  std::shared_ptr<ProcessGroup> shard_group;
  if (is_hybrid(options_.sharding_strategy())) {
    HybridGroups groups = resolve_hybrid_groups(options_);  // See Note [Hybrid sharding].
    options_.process_group(groups.world);
    options_.hybrid_groups(groups);
    shard_group = groups.shard;
    replicate_group_ = groups.replicate;
  } else if (options_.hybrid_groups()) {
    // An easy slip: the job then shards over the whole world, every gather
    // crossing nodes, the very traffic the groups were made to avoid.
    TORCH_WARN_ONCE("fsdp: FSDPOptions::hybrid_groups is set but sharding_strategy is ",
                    to_string(options_.sharding_strategy()),
                    ", which does not use them (it works over the whole process group); set "
                    "sharding_strategy(ShardingStrategy::kHybridShard) to use the groups");
  }
  if (!options_.process_group()) options_.process_group(default_process_group());
  if (!shard_group) shard_group = options_.process_group();
  check_param_init_fn(options_, wrapped != nullptr ? wrapped->name() : self.name());
  // Ignored parameters count as seen: reached elsewhere too (tied to a
  // managed module, re-registered by a wrapper), they stay unmanaged.
  const ModuleSet ignored = ignored_module_set(options_);
  std::unordered_set<const void*> seen = ignored_params(options_);
  std::vector<std::pair<std::string, at::Tensor>> params;
  std::vector<std::pair<std::string, const torch::nn::Module*>> modules;
  collect_managed(self, self, "", ignored, seen, params, &modules);
  const std::string* path = UnitPathScope::current();
  const std::string where = path != nullptr      ? *path
                            : wrapped != nullptr ? wrapped->name()
                                                 : self.name();
  const int rank = options_.process_group()->rank();
  // A parameter shared with a nested unit would be flattened twice; PyTorch
  // FSDP's answer (the outer unit skips it) breaks as soon as the outer
  // forward uses it while the inner unit is sharded.
  const auto owned = owned_by_nested_units(self);
  for (const auto& [name, p] : params) {
    auto it = owned.find(p.unsafeGetTensorImpl());
    FSDP_CHECK(it == owned.end(), rank, where, "parameter '", name, "' is the same tensor as '",
               it->second,
               "', which a nested FSDP unit already manages. A parameter shared between units "
               "(e.g. tied embedding weights) must belong to one unit: wrap the modules that "
               "share it in the same unit (or leave the nested module unwrapped)");
  }
  {
    // See Note [One unit per parameter].
    ParamRegistry& r = param_registry();
    std::lock_guard<std::mutex> lock(r.mutex);
    for (const auto& [name, p] : params) {
      auto it = r.owner.find(p.unsafeGetTensorImpl());
      if (it == r.owner.end()) continue;
      const torch::nn::Module* other = shown_module(*it->second);
      FSDP_FAIL(rank, where, "cannot wrap ", wrapped != nullptr ? wrapped->name() : self.name(),
                ": its parameter '", name, "' already belongs to another FSDP unit (around a ",
                other != nullptr ? other->name() : "module",
                "). A module is wrapped once: keep the first FullyShardedDataParallel and use "
                "it (its module() is the wrapped module) instead of wrapping the module again");
    }
  }
  if (path != nullptr && !path->empty()) {
    auto named = params;  // as the user knows them, from the root
    for (auto& [name, p] : named) name.insert(0, *path + ".");
    check_uniform_requires_grad(named, where, options_.use_orig_params(), rank, true);
  } else {
    check_uniform_requires_grad(params, where, options_.use_orig_params(), rank, true);
  }
  keep_full_precision_classes(modules, where, rank);
  // See Note [Deferred initialisation] and Note [Mixed precision].
  const c10::Device device = resolve_unit_device(options_, params, rank, where);
  // Before the unit's flat buffers exist: their storages keep the allocator
  // they are made with (Note [CPU block cache]). A CPU unit's only: the
  // cache holds host memory.
  if (device.is_cpu()) enable_cpu_block_cache_by_default();
  UnitInit init(wrapped != nullptr ? *wrapped : self, options_, device);
  if (params.empty()) {
    if (init.needs_fill()) init.fill(at::Tensor());
    remember_cast_buffers(init.cast_buffers());
    return;
  }
  flat_ = std::make_unique<FlatParameter>(std::move(params), std::move(shard_group),
                                          flat_param_config(init, device));
  {
    ParamRegistry& r = param_registry();
    std::lock_guard<std::mutex> lock(r.mutex);
    for (const auto& slot : flat_->slots()) r.owner[slot.param.unsafeGetTensorImpl()] = this;
  }
  remember_cast_buffers(init.cast_buffers());
  register_grad_hooks();
  make_optim_params();
}

void UnitRuntime::keep_full_precision_classes(
    const std::vector<std::pair<std::string, const torch::nn::Module*>>& modules,
    const std::string& where, int rank) {
  const auto& mp = options_.mixed_precision();
  if (!mp || !mp->param_dtype()) return;
  const auto& classes = mp->module_classes_to_ignore();
  // A unit around one module of these classes computes in full precision,
  // as auto_wrap makes it (see Planner::warn_full_precision in auto_wrap.cpp).
  const torch::nn::Module& target = *shown_module(*this);
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
  FSDP_FAIL(rank, where,
            "expected the modules of MixedPrecision::module_classes_to_ignore to be FSDP "
            "units of their own, got [",
            list, "] inside this unit, which computes in ", c10::toString(*mp->param_dtype()),
            ". They must compute in full precision, which a unit computing in low precision "
            "cannot do. ",
            driver_ == Driver::kDispatch
                ? "Call fsdp::fully_shard(*module, options) on each before its parent (such a "
                  "unit is kept in full precision), or use the policy form fsdp::fully_shard("
                  "root, policy, options), which makes them units of their own"
                : "Hold each as fsdp::FullyShardedDataParallel<Impl> where its parent calls it "
                  "(such a unit is kept in full precision), or make it a Sequential entry and "
                  "use fsdp::auto_wrap",
            ", or remove its class from module_classes_to_ignore (and set "
            "MixedPrecision::buffer_dtype to the same dtype, for its running statistics).");
}

void UnitRuntime::make_optim_params() {
  const at::Tensor& shard = flat_->shard();
  if (!options_.use_orig_params()) {
    optim_params_ = {shard};
    return;
  }
  // Each slot's piece is its intersection with this rank's shard: a view of
  // the shard (so an optimizer step updates the shard in place), and a leaf.
  const at::Tensor base = shard.detach();
  for (size_t i = 0; i < flat_->slots().size(); ++i) {
    const auto& slot = flat_->slots()[i];
    const FlatParameter::ShardPart part = flat_->shard_part(i);
    at::Tensor piece = base.narrow(0, part.in_shard, part.numel);
    piece.set_requires_grad(slot.param.requires_grad());  // as when wrapped
    optim_params_.push_back(piece);
    params_given_.push_back(slot.param.requires_grad());
  }
}

// Note [Freezing after wrapping]
// A LibTorch user freezes layers of a built model by setting requires_grad
// on their parameters (named_parameters()). With use_orig_params each
// parameter keeps its own flag. With flat shards a unit trains whole or not
// at all, and prepare_slots gives every parameter the shard's flag at each
// forward, which silently undid such a freeze (the layers went on
// training). So a flag the user changed since prepare_slots last gave it
// wins: all of a unit's parameters frozen (or unfrozen) freezes (or
// unfreezes) its shard, so the optimizer skips it as it skips a frozen
// parameter; some of them is an error naming both sides, as at wrapping.
// With use_orig_params the same holds per parameter: its piece (what the
// optimizer steps) follows the flag the user gave it, and a flag given the
// piece reaches the parameter. A parameter frozen when wrapped used to stay
// frozen however the user unfroze it (fine-tuning that unfreezes the
// backbone after some epochs trained only the head).
bool UnitRuntime::follow_parameters_frozen_by_user() {
  std::vector<std::pair<std::string, at::Tensor>> params;
  bool changed = false;
  for (const auto& slot : flat_->slots()) {
    changed = changed || slot.param.requires_grad() != params_trainable_;
    params.emplace_back(slot.name, slot.param);
  }
  if (changed) {
    check_uniform_requires_grad(params, path_, /*use_orig_params=*/false, flat_->group().rank(),
                                /*warn=*/false);
    at::Tensor(flat_->shard()).set_requires_grad(params.front().second.requires_grad());
  }
  params_trainable_ = flat_->shard().requires_grad();
  return params_trainable_;
}

void UnitRuntime::register_grad_hooks() {
  const auto& slots = flat_->slots();
  moved_grads_.assign(slots.size(), MovedGrad::kNone);
  const bool all_frozen = !flat_->shard().requires_grad();
  params_trainable_ = !all_frozen;
  for (size_t i = 0; i < slots.size(); ++i) {
    // Every unit's moved gradients report a detach or zero_ (Note
    // [Gradients the user clears]): a wrapper's original parameters are
    // reached through named_parameters() too.
    grad_placeholders_.push_back(make_placeholder(slots[i].param, PlaceholderKind::kGradient,
                                                  "'" + slots[i].name + "'", this));
    // The slot's tensor object is the module's own parameter: only its
    // autograd flags change here, never what it refers to. Every slot gets
    // its hook, made while requires_grad is briefly on where it is off: a
    // unit frozen whole when wrapped (as PyTorch's FlatParameter can be; seed
    // 004 does it), or under use_orig_params a parameter frozen when wrapped,
    // can be unfrozen later (Note [Freezing after wrapping]).
    at::Tensor param = slots[i].param;
    const bool frozen = !param.requires_grad();
    if (frozen) param.set_requires_grad(true);
    auto acc = torch::autograd::impl::grad_accumulator(param);
    if (frozen) param.set_requires_grad(false);
    acc->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
        [this, i](const torch::autograd::variable_list& outputs,
                  const torch::autograd::variable_list&) {
          on_grad_ready(i);
          return outputs;
        }));
    grad_accumulators_.push_back(std::move(acc));  // autograd holds only a weak_ptr
  }
}

void UnitRuntime::set_activation_checkpointing(bool on) {
  check_idle(on ? "turn activation checkpointing on" : "turn activation checkpointing off");
  options_.activation_checkpointing(on);
}

void UnitRuntime::refuse_activation_checkpointing(const char* output_type) const {
  FSDP_FAIL(flat_ ? flat_->group().rank() : -1, path_, "activation checkpointing of ", label(),
            " (", module_name(),
            ") needs a forward that returns at::Tensor, "
            "std::vector<at::Tensor>, or a std::tuple / std::pair of these, not ",
            c10::demangle(output_type), ". Checkpoint a submodule that does, or turn it off");
}

void UnitRuntime::check_idle(const char* what) {
  end_open_forward();  // see Note [Units driven by dispatch]
  // Between a backward with create_graph and the one through its graph the
  // units wait in kPreBackward, gathered, and nothing runs (Note [Double
  // backward]).
  const bool waits_for_graph =
      state_ == Unit::TrainingState::kPreBackward && root_ != nullptr && root_->keeps_graph();
  FSDP_CHECK(state_ == Unit::TrainingState::kIdle || waits_for_graph,
             flat_ ? flat_->group().rank() : -1, path_, "cannot ", what,
             " while the unit is in its ", to_string(state_),
             " state. Call it outside the forward and backward passes (after backward, or "
             "before the next forward)");
}

bool UnitRuntime::held_for_graph() const {
  return root_ != nullptr && root_->holds_for_graph(*this);
}

void UnitRuntime::refresh_gathered() {
  // See Note [Double backward]: in the storage the graph's views share.
  if (!flat_ || !flat_->frees_unsharded() || flat_->state() != FlatParameter::State::kUnsharded) {
    return;
  }
  free_unsharded();
  unshard();
}

void UnitRuntime::mark_gather() {
  ++gathers_;
  grads_at_gather_.clear();
  for (const at::Tensor& p : optim_params_) {
    const at::Tensor& g = p.grad();
    grads_at_gather_.push_back(
        g.defined() ? std::optional<GradMark>(GradMark{WeakGrad(g.getIntrusivePtr()), g._version()})
                    : std::nullopt);
  }
  clears_at_gather_ = grad_clears_;
}

bool UnitRuntime::gathered_may_be_stale() const {
  if (!flat_ || !flat_->gathered_apart_from_shard()) return false;
  if (flat_->gathered_behind_shard() || grad_clears_ != clears_at_gather_ ||
      grads_at_gather_.size() != optim_params_.size()) {
    return true;
  }
  // A .grad dropped, replaced (the optimizer's zero_grad() setting them to
  // none) or written in place (zeroed).
  for (size_t i = 0; i < optim_params_.size(); ++i) {
    const at::Tensor& g = optim_params_[i].grad();
    const auto& mark = grads_at_gather_[i];
    if (g.defined() != mark.has_value()) return true;
    if (g.defined() &&
        (mark->grad.lock().get() != g.unsafeGetTensorImpl() || mark->version != g._version())) {
      return true;
    }
  }
  return false;
}

void UnitRuntime::reshard_left_gathered() {
  // The root is in its forward already: the one that begins, whose
  // begin_forward_state gathers it right after. A unit the operator under
  // way holds and has not entered yet gathers as it enters; one it entered
  // (and whose forward another unit ended since) it reads still.
  const bool free_to_go = is_root() || (state_ == Unit::TrainingState::kIdle &&
                                        operator_hold_ != OperatorHold::kReshardAfter);
  if (!free_to_go || held_by_summon_guard() || !gathered_may_be_stale()) return;
  reshard();
}

// Note [Nested summons]
// A SummonFullParams guard holds each unit it reaches on every rank, whether
// this rank gathered it (rank0_only frees it at once on the others, and a
// unit gathered already gathers nothing), as FSDP's training state
// SUMMON_FULL_PARAMS does. Within it, what the unit holds is the outer
// guard's to say: a nested guard, and a state dict taken there, do nothing
// with it on any rank (as FSDP's nested summon_full_params). Deciding that
// from what this rank holds instead made a nested guard all-gather on the
// ranks rank0_only had freed and not on rank 0 (a hang), and let a nested
// with_grads or offload_to_cpu free or replace what the outer guard gathered.
// Forward and backward through a held unit are refused, as in FSDP: in full
// precision the unit is only kUnsharded there, and a forward would reshard
// it (losing edits not yet written back) or, under rank0_only, gather on
// some ranks only.
void UnitRuntime::enter_summon_guard() {
  TORCH_INTERNAL_ASSERT(summon_guard_ == SummonGuard::kNone, "fsdp: ", path_,
                        " entered a second SummonFullParams");
  summon_guard_ = SummonGuard::kHeld;
}

void UnitRuntime::leave_summon_guard() {
  TORCH_INTERNAL_ASSERT(summon_guard_ == SummonGuard::kHeld, "fsdp: ", path_,
                        " left a SummonFullParams it was not in");
  summon_guard_ = SummonGuard::kNone;
}

bool UnitRuntime::gather_full_params(bool to_cpu, bool with_grads) {
  check_idle("gather the full parameters");
  if (held_by_summon_guard()) return false;  // Note [Nested summons]
  if (held_for_graph()) {                    // gathered for a built graph (Note [Double backward])
    refresh_gathered();                      // a state dict's reads too (they are unreported uses)
    return false;
  }
  if (!flat_ || flat_->state() == FlatParameter::State::kSummoned) return false;
  // What a forward left gathered may predate a step (Note [Gathered before
  // a step]); a summon is no training loop, so always gathered anew.
  if (flat_->state() != FlatParameter::State::kSharded) reshard();  // a prefetch arriving too
  // As FSDP1's offload_to_cpu: only a unit that shards (NO_SHARD's full
  // values are on the device already).
  const c10::Device device = flat_->unsharded().device();
  to_cpu = to_cpu && !device.is_cpu() && !flat_->keeps_unsharded();
  bool gathered = false;
  if (!flat_->holds_full_values() || to_cpu) {
    if (flat_->low_precision() || to_cpu) {
      // Note [Summoning in full precision]: the param_dtype copies (kept
      // gathered after a forward) give way to the shards as they are.
      reshard();
      at::Tensor full = gather_full(*flat_, flat_->shard().detach().to(device));
      if (to_cpu) full = full.to(at::kCPU);  // the device's copy is freed here, unit by unit
      flat_->begin_summon(std::move(full));
    } else {
      unshard();
    }
    gathered = true;
  }
  const bool had_grads = summoned_grads_.defined();
  if (with_grads) summon_grads();
  return gathered || (summoned_grads_.defined() && !had_grads);
}

// Note [Summoning gradients]
// SummonOptions::with_grads, as FSDP1's: while summoned, each original
// parameter's .grad is its full gradient, gathered from the ranks' gradient
// shards (the flat shard's .grad, or the use_orig_params pieces') as the
// parameters are, into one buffer beside them, in their dtype. A parameter
// gets one where some rank's part of it has a gradient: the ranks agree on
// that per parameter (one small all-reduce per unit; Note [Parameters
// without gradients]). The .grad each had before (its moved gradient's
// placeholder, or none) comes back when the guard ends; with writeback each
// rank's part of the full gradients is first copied into the shard's
// gradients that exist, as FSDP1 writes back.
void UnitRuntime::summon_grads() {
  if (summoned_grads_.defined()) return;  // an enclosing guard summoned them
  const auto& slots = flat_->slots();
  std::vector<int64_t> has(slots.size(), 0);
  for (size_t i = 0; i < slots.size(); ++i) {
    const at::Tensor& owner = options_.use_orig_params() ? optim_params_[i] : optim_params_[0];
    has[i] = owner.grad().defined() ? 1 : 0;
  }
  has = agree_reduce(&flat_->group(), std::move(has), ReduceOp::kMax);
  if (std::find(has.begin(), has.end(), 1) == has.end()) return;
  at::NoGradGuard no_grad;
  const at::Tensor& shard = flat_->shard();
  at::Tensor local = at::zeros({shard.numel()}, shard.options());
  for (const GradTarget& t : grad_targets(nullptr)) {
    const at::Tensor& g = t.param.grad();
    if (g.defined())
      (t.numel < 0 ? local : local.narrow(0, t.offset, t.numel)).copy_(g.reshape({-1}));
  }
  const at::Tensor& beside = slots.front().param;
  summoned_grads_ = gather_full(*flat_, local.to(flat_->unsharded().device()))
                        .to(beside.device(), beside.scalar_type());
  grads_before_summon_.clear();
  for (size_t i = 0; i < slots.size(); ++i) {
    at::Tensor param = slots[i].param;
    grads_before_summon_.push_back(param.grad());
    if (has[i] == 0) continue;
    param.mutable_grad() =
        summoned_grads_.narrow(0, slots[i].offset, slots[i].numel).view(slots[i].shape);
  }
}

void UnitRuntime::release_grads() {
  if (!summoned_grads_.defined()) return;
  const auto& slots = flat_->slots();
  for (size_t i = 0; i < slots.size(); ++i) {
    at::Tensor(slots[i].param).mutable_grad() = grads_before_summon_[i];
  }
  grads_before_summon_.clear();
  summoned_grads_ = at::Tensor();
}

void UnitRuntime::release_full_params() {
  check_idle("free the full parameters");
  if (!flat_) return;
  release_grads();
  if (flat_->state() == FlatParameter::State::kSummoned) {
    flat_->end_summon();
  } else {
    reshard();
  }
}

void UnitRuntime::write_back_full_params() {
  check_idle("write the full parameters back into the shard");
  if (flat_ && (flat_->state() == FlatParameter::State::kSummoned ||
                (flat_->frees_unsharded() && flat_->state() == FlatParameter::State::kUnsharded))) {
    flat_->copy_unsharded_into_shard();
  }
  if (!summoned_grads_.defined()) return;
  // See Note [Summoning gradients].
  at::NoGradGuard no_grad;
  const at::Tensor mine = summoned_grads_.narrow(0, flat_->shard_offset(), flat_->shard().numel());
  for (const GradTarget& t : grad_targets(nullptr)) {
    const at::Tensor& g = t.param.grad();
    if (g.defined()) g.view(-1).copy_(t.numel < 0 ? mine : mine.narrow(0, t.offset, t.numel));
  }
}

void UnitRuntime::zero_optim_grads(bool set_to_none) {
  wait_for_grad_users();
  clear_optim_grads(set_to_none);
}

void UnitRuntime::wait_for_grad_users() const {
  if (const ReducedGradHooks* hooks = grad_hooks(); hooks && hooks->before_zero_grad) {
    hooks->before_zero_grad();
  }
}

void UnitRuntime::clear_optim_grads(bool set_to_none) {
  at::NoGradGuard no_grad;
  // What no_sync() accumulated (unsharded, not yet in .grad), and what
  // backwards kept within the node, are part of the gradient that
  // Module::zero_grad clears in plain LibTorch; a backward
  // that stopped part-way (it threw: its units never came back to idle) may
  // have left some too. Only a backward running now (zero_grad from one of
  // its hooks) keeps filling it.
  if (state_ == Unit::TrainingState::kIdle ||
      torch::autograd::get_current_graph_task_exec_info() == nullptr) {
    flat_grad_ = at::Tensor();
    slot_filled_.clear();
    forget_within_node();  // Note [Accumulating within the node]
  }
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

}  // namespace fsdp::detail
