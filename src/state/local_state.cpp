#include "state/local_state.h"

#include "detail/error.h"
#include "detail/torch_compat.h"
#include "runtime/strategy.h"
#include "runtime/unit_runtime.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include <cmath>
#include <sstream>
#include <tuple>
#include <unordered_map>
#include <unordered_set>

#include <fsdp/comm/init.h>

namespace fsdp::detail {

// Note [State pieces]
// Every rank describes what it holds as pieces: elements [begin, end) of an
// original tensor flattened. A unit's slot contributes its intersection with
// this rank's shard (padding never belongs to a slot); a parameter no unit
// shards, a buffer, or a NO_SHARD unit's slot is held whole by every rank
// (`replicated`, saved by rank 0 only); a HYBRID_SHARD shard is held by one
// rank per node (saved by the first node's, `saved_elsewhere` elsewhere).
// Saving writes the pieces with their ranges; loading fills each local piece
// from whichever stored pieces intersect it, so any saved world size loads
// into any other without communication, and a full checkpoint is the case of
// one piece per tensor.

std::vector<UnitEntry> units_with_params(torch::nn::Module& root) {
  std::vector<UnitEntry> out;
  std::unordered_set<Unit*> seen;
  for (const auto& item : root.named_modules(/*name_prefix=*/"", /*include_self=*/true)) {
    Unit* unit = unit_of(*item.value());
    if (unit == nullptr || unit->flat_param() == nullptr) continue;
    if (!seen.insert(unit).second) continue;
    out.push_back({unit, item.key().empty() ? "" : item.key() + "."});
  }
  return out;
}

ProcessGroup* state_group(torch::nn::Module& root) {
  for (const auto& e : units_with_params(root)) return e.unit->fsdp_options().process_group().get();
  return is_initialized() ? default_process_group().get() : nullptr;
}

namespace {

LocalPiece unit_piece(const UnitEntry& e, size_t i) {
  const FlatParameter& flat = *e.unit->flat_param();
  const FlatParamSlot& slot = flat.slots()[i];
  const FlatParameter::ShardPart part = flat.shard_part(i);
  LocalPiece p;
  p.name = e.prefix + slot.name;
  p.shape = slot.shape;
  p.numel = slot.numel;
  p.begin = part.in_param;
  p.end = part.in_param + part.numel;
  p.data = flat.shard().detach().narrow(0, part.in_shard, part.numel);
  p.saved_dtype = p.data.scalar_type();
  p.unit = e.unit;
  p.slot = i;
  p.replicated = flat.keeps_unsharded();
  const auto& hybrid = e.unit->fsdp_options().hybrid_groups();
  p.saved_elsewhere = hybrid && is_hybrid(e.unit->fsdp_options().sharding_strategy()) &&
                      hybrid->replicate->rank() != 0;
  if (e.unit->fsdp_options().use_orig_params()) {
    const auto named = e.unit->named_flat_parameters();
    const at::Tensor* piece = named.find(slot.name);
    TORCH_INTERNAL_ASSERT(piece != nullptr, "fsdp: no optimizer parameter for ", p.name);
    p.optim_param = *piece;
    p.optim_offset = 0;
  } else {
    p.optim_param = flat.shard();
    p.optim_offset = part.in_shard;
  }
  return p;
}

LocalPiece whole_piece(const std::string& name, const at::Tensor& t, bool is_buffer) {
  LocalPiece p;
  p.name = name;
  p.shape = t.sizes().vec();
  p.numel = t.numel();
  p.begin = 0;
  p.end = t.numel();
  // A buffer expanded or transposed (position ids expanded from one row, as
  // HF's models register them) is made contiguous in place, with the same
  // values, as torch::load leaves it: pieces are read and written flat.
  if (is_buffer && !t.is_contiguous()) t.set_data(t.contiguous());
  FSDP_CHECK(t.is_contiguous(), /*rank=*/-1, name,
             "is not contiguous; expected the module's parameters to be contiguous tensors");
  p.data = t.detach().view({-1});
  p.saved_dtype = p.data.scalar_type();
  if (!is_buffer) p.optim_param = t;
  p.replicated = true;
  p.is_buffer = is_buffer;
  return p;
}

}  // namespace

// Note [Tied parameters]
// A tensor registered under two names (an output projection sharing the
// embedding's weight) is one parameter: a unit flattens it once, and
// LibTorch's named_parameters() reaches it under both names. It is one
// piece, under the first name, with the others as aliases. Full state dicts
// hold it under every name, one tensor for all, as the unwrapped model's
// named_parameters() and PyTorch's state_dict() do; checkpoints and
// optimizer state hold it once, under the first name (as safetensors files
// of tied models do). Loading reads it under the last of its names the
// source has, as the last name wins in the unwrapped model's torch::load
// and in PyTorch's load_state_dict, and checks the others' shapes. A buffer
// registered twice is the same.
std::vector<LocalPiece> local_pieces(torch::nn::Module& root) {
  std::vector<LocalPiece> out;
  std::unordered_map<const void*, size_t> piece_of;
  for (const UnitEntry& e : units_with_params(root)) {
    e.unit->before_state_use();  // Note [Steps during backward]
    const auto& slots = e.unit->flat_param()->slots();
    for (size_t i = 0; i < slots.size(); ++i) {
      piece_of.emplace(slots[i].param.unsafeGetTensorImpl(), out.size());
      out.push_back(unit_piece(e, i));
    }
  }
  // The new piece, or nullptr where `t` has one already (then an alias).
  auto add = [&](const std::string& name, const at::Tensor& t, bool is_buffer) -> LocalPiece* {
    const auto [it, fresh] = piece_of.emplace(t.unsafeGetTensorImpl(), out.size());
    if (!fresh) {
      LocalPiece& first = out[it->second];
      if (first.name != name) first.aliases.push_back(name);
      return nullptr;
    }
    out.push_back(whole_piece(name, t, is_buffer));
    return &out.back();
  };
  for (const auto& p : root.named_parameters()) add(p.key(), p.value(), false);
  for (const auto& b : root.named_buffers()) {
    LocalPiece* p = add(b.key(), b.value(), true);
    if (p != nullptr) p->saved_dtype = saved_buffer_dtype(b.value()).value_or(p->saved_dtype);
  }
  return out;
}

// Note [Optimizer keys]
// torch::optim keeps state under the address of the parameter's TensorImpl,
// which means nothing in another process. Checkpoints key it by the original
// parameter name instead; these accessors translate, building the address key
// exactly as torch::optim does (see compat::optim_state_key).
namespace {

auto optim_key(const torch::optim::Optimizer& opt, const at::Tensor& p) {
  return compat::optim_state_key(opt.state(), p);
}

template <typename State>
bool get_adam(const torch::optim::Optimizer& opt, const at::Tensor& p, ParamState& out) {
  const auto it = opt.state().find(optim_key(opt, p));
  if (it == opt.state().end()) return false;
  const auto& s = static_cast<const State&>(*it->second);
  out.step = s.step();
  out.tensors["exp_avg"] = s.exp_avg();
  out.tensors["exp_avg_sq"] = s.exp_avg_sq();
  if (s.max_exp_avg_sq().defined()) out.tensors["max_exp_avg_sq"] = s.max_exp_avg_sq();
  return true;
}

template <typename State>
void set_adam(torch::optim::Optimizer& opt, const at::Tensor& p, const ParamState& in) {
  auto s = std::make_unique<State>();
  s->step(in.step);
  s->exp_avg(in.tensors.at("exp_avg"));
  s->exp_avg_sq(in.tensors.at("exp_avg_sq"));
  const auto m = in.tensors.find("max_exp_avg_sq");
  if (m != in.tensors.end()) s->max_exp_avg_sq(m->second);
  opt.state()[optim_key(opt, p)] = std::move(s);
}

bool get_rmsprop(const torch::optim::Optimizer& opt, const at::Tensor& p, ParamState& out) {
  const auto it = opt.state().find(optim_key(opt, p));
  if (it == opt.state().end()) return false;
  const auto& s = static_cast<const torch::optim::RMSpropParamState&>(*it->second);
  out.step = s.step();
  out.tensors["square_avg"] = s.square_avg();
  if (s.momentum_buffer().defined()) out.tensors["momentum_buffer"] = s.momentum_buffer();
  if (s.grad_avg().defined()) out.tensors["grad_avg"] = s.grad_avg();
  return true;
}

// `o`: the options of the group that steps `p` (nullptr if none does).
void set_rmsprop(torch::optim::Optimizer& opt, const at::Tensor& p, const ParamState& in,
                 const torch::optim::RMSpropOptions* o) {
  auto s = std::make_unique<torch::optim::RMSpropParamState>();
  s->step(in.step);
  s->square_avg(in.tensors.at("square_avg"));
  // What the parameter's group uses, as torch::optim::RMSprop makes its state.
  const auto take = [&](const char* name, bool used) {
    const auto it = in.tensors.find(name);
    return used && it != in.tensors.end() ? it->second : at::Tensor();
  };
  s->momentum_buffer(take("momentum_buffer", o == nullptr || o->momentum() > 0));
  s->grad_avg(take("grad_avg", o == nullptr || o->centered()));
  opt.state()[optim_key(opt, p)] = std::move(s);
}

}  // namespace

OptimAccess::OptimAccess(torch::optim::Optimizer& opt) : opt_(opt) {
  if (dynamic_cast<torch::optim::SGD*>(&opt) != nullptr) {
    kind_ = Kind::kSgd;
    possible_ = {"momentum_buffer"};
  } else if (dynamic_cast<torch::optim::RMSprop*>(&opt) != nullptr) {
    kind_ = Kind::kRmsprop;
    possible_ = {"square_avg", "momentum_buffer", "grad_avg"};
  } else if (dynamic_cast<torch::optim::Adagrad*>(&opt) != nullptr) {
    kind_ = Kind::kAdagrad;
    possible_ = {"sum"};
  } else if (dynamic_cast<torch::optim::AdamW*>(&opt) != nullptr) {
    kind_ = Kind::kAdamW;
    possible_ = {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"};
  } else if (dynamic_cast<torch::optim::Adam*>(&opt) != nullptr) {
    kind_ = Kind::kAdam;
    possible_ = {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"};
  } else {
    FSDP_FAIL(/*rank=*/-1, "checkpoint",
              "unsupported optimizer; expected torch::optim::SGD, Adam, AdamW, RMSprop or "
              "Adagrad (or fsdp::optim's), whose state is elementwise (LBFGS's is not). Save "
              "another optimizer's state yourself, each rank its own with torch::save, or as "
              "Checkpointer's registered state.");
  }
  has_step_ = kind_ != Kind::kSgd;
  const auto& groups = opt.param_groups();
  std::unordered_set<std::string> kept;
  for (size_t g = 0; g < groups.size(); ++g) {
    for (const at::Tensor& p : groups[g].params()) group_of_.emplace(p.unsafeGetTensorImpl(), g);
    for (std::string& name : names_kept(groups[g].options())) kept.insert(std::move(name));
  }
  if (groups.empty()) {
    for (std::string& name : names_kept(opt.defaults())) kept.insert(std::move(name));
  }
  // What some group keeps (the defaults where there is none), in order.
  for (const std::string& name : possible_) {
    if (kept.count(name) != 0) names_.push_back(name);
  }
}

std::vector<std::string> OptimAccess::names_kept(const torch::optim::OptimizerOptions& o) const {
  bool amsgrad = false;
  switch (kind_) {
    case Kind::kAdam:
      amsgrad = static_cast<const torch::optim::AdamOptions&>(o).amsgrad();
      break;
    case Kind::kAdamW:
      amsgrad = static_cast<const torch::optim::AdamWOptions&>(o).amsgrad();
      break;
    case Kind::kRmsprop: {
      const auto& r = static_cast<const torch::optim::RMSpropOptions&>(o);
      std::vector<std::string> out{"square_avg"};
      if (r.momentum() > 0) out.push_back("momentum_buffer");
      if (r.centered()) out.push_back("grad_avg");
      return out;
    }
    case Kind::kSgd:
    case Kind::kAdagrad:
      return possible_;
  }
  std::vector<std::string> out{"exp_avg", "exp_avg_sq"};
  if (amsgrad) out.push_back("max_exp_avg_sq");
  return out;
}

const torch::optim::OptimizerOptions* OptimAccess::options_of(const at::Tensor& param) const {
  const auto it = group_of_.find(param.unsafeGetTensorImpl());
  return it == group_of_.end() ? nullptr : &opt_.param_groups()[it->second].options();
}

std::vector<std::string> OptimAccess::state_names(const at::Tensor& param) const {
  const torch::optim::OptimizerOptions* o = options_of(param);
  return o == nullptr ? names_ : names_kept(*o);
}

bool OptimAccess::steps(const at::Tensor& param) const {
  return group_of_.count(param.unsafeGetTensorImpl()) != 0;
}

const char* OptimAccess::option_keeping(const std::string& name) {
  if (name == "max_exp_avg_sq") return "amsgrad(true)";
  if (name == "grad_avg") return "centered(true)";
  if (name == "momentum_buffer") return "momentum > 0";
  return "";
}

const char* OptimAccess::kinds_keeping(const std::string& name) {
  if (name == "exp_avg" || name == "exp_avg_sq" || name == "max_exp_avg_sq") {
    return "Adam and AdamW";
  }
  if (name == "momentum_buffer") return "SGD and RMSprop";
  if (name == "square_avg" || name == "grad_avg") return "RMSprop";
  if (name == "sum") return "Adagrad";
  if (name == "step") return "Adam, AdamW, RMSprop and Adagrad";
  return "";
}

const char* OptimAccess::kind_name() const {
  switch (kind_) {
    case Kind::kSgd:
      return "SGD";
    case Kind::kAdam:
      return "Adam";
    case Kind::kAdamW:
      return "AdamW";
    case Kind::kRmsprop:
      return "RMSprop";
    case Kind::kAdagrad:
      return "Adagrad";
  }
  return "";
}

void OptimAccess::check_steps_only(const std::vector<LocalPiece>& pieces) const {
  std::unordered_set<const void*> known;
  for (const LocalPiece& p : pieces) {
    if (p.optim_param.defined()) known.insert(p.optim_param.unsafeGetTensorImpl());
  }
  const auto& groups = opt_.param_groups();
  for (size_t g = 0; g < groups.size(); ++g) {
    const auto& params = groups[g].params();
    for (size_t i = 0; i < params.size(); ++i) {
      FSDP_CHECK(known.count(params[i].unsafeGetTensorImpl()) != 0, /*rank=*/-1, "optimizer",
                 "parameter group ", g, " steps a tensor of shape ", params[i].sizes(),
                 " (its parameter ", i,
                 ") that is no parameter of the model, so the model's state would not hold its "
                 "values and optimizer state. Register it in the model (register_parameter), or "
                 "step it with an optimizer of its own saved with torch::save");
    }
  }
}

bool OptimAccess::get(const at::Tensor& param, ParamState& out) const {
  out = ParamState();
  switch (kind_) {
    case Kind::kSgd: {
      const auto it = opt_.state().find(optim_key(opt_, param));
      if (it == opt_.state().end()) return false;
      const auto& s = static_cast<const torch::optim::SGDParamState&>(*it->second);
      if (!s.momentum_buffer().defined()) return false;
      out.tensors["momentum_buffer"] = s.momentum_buffer();
      return true;
    }
    case Kind::kAdam:
      return get_adam<torch::optim::AdamParamState>(opt_, param, out);
    case Kind::kAdamW:
      return get_adam<torch::optim::AdamWParamState>(opt_, param, out);
    case Kind::kRmsprop:
      return get_rmsprop(opt_, param, out);
    case Kind::kAdagrad: {
      // Made for every parameter when the optimizer is.
      const auto it = opt_.state().find(optim_key(opt_, param));
      if (it == opt_.state().end()) return false;
      const auto& s = static_cast<const torch::optim::AdagradParamState&>(*it->second);
      out.step = s.step();
      out.tensors["sum"] = s.sum();
      return true;
    }
  }
  return false;
}

void OptimAccess::set(const at::Tensor& param, const ParamState& state) {
  switch (kind_) {
    case Kind::kSgd: {
      auto s = std::make_unique<torch::optim::SGDParamState>();
      s->momentum_buffer(state.tensors.at("momentum_buffer"));
      opt_.state()[optim_key(opt_, param)] = std::move(s);
      return;
    }
    case Kind::kAdam:
      return set_adam<torch::optim::AdamParamState>(opt_, param, state);
    case Kind::kAdamW:
      return set_adam<torch::optim::AdamWParamState>(opt_, param, state);
    case Kind::kRmsprop:
      return set_rmsprop(opt_, param, state,
                         static_cast<const torch::optim::RMSpropOptions*>(options_of(param)));
    case Kind::kAdagrad: {
      auto s = std::make_unique<torch::optim::AdagradParamState>();
      s->step(state.step);
      s->sum(state.tensors.at("sum"));
      opt_.state()[optim_key(opt_, param)] = std::move(s);
      return;
    }
  }
}

void OptimAccess::clear(const at::Tensor& param) {
  if (kind_ != Kind::kAdagrad) {
    opt_.state().erase(optim_key(opt_, param));
    return;
  }
  // Adagrad makes every parameter's state with the optimizer, and its step
  // expects it: made afresh, as its constructor makes it.
  const auto* o = static_cast<const torch::optim::AdagradOptions*>(options_of(param));
  const double initial = o != nullptr ? o->initial_accumulator_value() : 0.0;
  auto s = std::make_unique<torch::optim::AdagradParamState>();
  s->step(0);
  s->sum(at::full_like(param.detach(), initial, at::MemoryFormat::Preserve));
  opt_.state()[optim_key(opt_, param)] = std::move(s);
}

std::vector<std::string> OptimAccess::required_state_names() const {
  switch (kind_) {
    case Kind::kSgd:
      return {"momentum_buffer"};
    case Kind::kAdam:
    case Kind::kAdamW:
      return {"exp_avg", "exp_avg_sq", "step"};
    case Kind::kRmsprop:
      return {"square_avg", "step"};
    case Kind::kAdagrad:
      return {"sum", "step"};
  }
  return {};
}

namespace {

// Adam's and AdamW's options to and from names.
template <typename Options>
std::map<std::string, double> adam_options(const Options& o) {
  return {{"lr", o.lr()},
          {"beta1", std::get<0>(o.betas())},
          {"beta2", std::get<1>(o.betas())},
          {"eps", o.eps()},
          {"weight_decay", o.weight_decay()}};
}

template <typename Options>
void set_adam_options(Options& o, const std::map<std::string, double>& v) {
  o.lr(v.at("lr"));
  o.betas(std::make_tuple(v.at("beta1"), v.at("beta2")));
  o.eps(v.at("eps"));
  o.weight_decay(v.at("weight_decay"));
}

}  // namespace

std::vector<int64_t> OptimAccess::params_per_group(const std::vector<LocalPiece>& pieces) const {
  std::vector<int64_t> out(opt_.param_groups().size(), 0);
  for (const LocalPiece& p : pieces) {
    if (!p.optim_param.defined()) continue;
    const auto it = group_of_.find(p.optim_param.unsafeGetTensorImpl());
    if (it != group_of_.end()) ++out[it->second];
  }
  return out;
}

std::vector<std::map<std::string, double>> OptimAccess::group_options(
    const std::vector<LocalPiece>* pieces) const {
  std::vector<std::map<std::string, double>> out;
  for (const auto& g : opt_.param_groups()) {
    switch (kind_) {
      case Kind::kSgd: {
        const auto& o = static_cast<const torch::optim::SGDOptions&>(g.options());
        out.push_back({{"lr", o.lr()},
                       {"momentum", o.momentum()},
                       {"dampening", o.dampening()},
                       {"weight_decay", o.weight_decay()}});
        break;
      }
      case Kind::kAdam:
        out.push_back(adam_options(static_cast<const torch::optim::AdamOptions&>(g.options())));
        break;
      case Kind::kAdamW:
        out.push_back(adam_options(static_cast<const torch::optim::AdamWOptions&>(g.options())));
        break;
      case Kind::kRmsprop: {
        const auto& o = static_cast<const torch::optim::RMSpropOptions&>(g.options());
        out.push_back({{"lr", o.lr()},
                       {"alpha", o.alpha()},
                       {"eps", o.eps()},
                       {"weight_decay", o.weight_decay()},
                       {"momentum", o.momentum()},
                       {"centered", o.centered() ? 1.0 : 0.0}});
        break;
      }
      case Kind::kAdagrad: {
        const auto& o = static_cast<const torch::optim::AdagradOptions&>(g.options());
        out.push_back({{"lr", o.lr()},
                       {"lr_decay", o.lr_decay()},
                       {"weight_decay", o.weight_decay()},
                       {"initial_accumulator_value", o.initial_accumulator_value()},
                       {"eps", o.eps()}});
        break;
      }
    }
  }
  if (pieces != nullptr) {
    const std::vector<int64_t> counts = params_per_group(*pieces);
    for (size_t g = 0; g < out.size(); ++g) out[g]["params"] = static_cast<double>(counts[g]);
  }
  return out;
}

void OptimAccess::check_group_options(const std::vector<std::map<std::string, double>>& groups,
                                      const std::vector<LocalPiece>& pieces,
                                      const std::string& where) const {
  const auto& mine = opt_.param_groups();
  FSDP_CHECK(groups.size() == mine.size(), -1, where, "holds the options of ", groups.size(),
             " parameter group(s), the optimizer has ", mine.size(),
             ". Make the optimizer with the same parameter groups as the one saved.");
  const std::map<std::string, double> want = group_options().front();
  const std::vector<int64_t> counts = params_per_group(pieces);
  for (size_t i = 0; i < groups.size(); ++i) {
    for (const auto& [name, unused] : want) {
      FSDP_CHECK(groups[i].count(name) == 1, -1, where, "parameter group ", i, " has no ", name,
                 ": it was saved from another kind of optimizer. Load it into the kind saved.");
    }
    // Checkpoints from before the count was saved have none.
    const auto saved = groups[i].find("params");
    FSDP_CHECK(saved == groups[i].end() || saved->second == static_cast<double>(counts[i]), -1,
               where, "parameter group ", i, " stepped ",
               saved == groups[i].end() ? 0 : static_cast<int64_t>(saved->second),
               " of the model's parameters when saved, this optimizer's steps ", counts[i],
               ". Make the optimizer with the same parameter groups as the one saved (the same "
               "parameters in each, as torch::load requires).");
  }
}

void OptimAccess::set_group_options(const std::vector<std::map<std::string, double>>& groups,
                                    const std::vector<LocalPiece>& pieces,
                                    const std::string& where) {
  check_group_options(groups, pieces, where);
  auto& mine = opt_.param_groups();
  for (size_t i = 0; i < groups.size(); ++i) {
    const auto& v = groups[i];
    switch (kind_) {
      case Kind::kSgd: {
        auto& o = static_cast<torch::optim::SGDOptions&>(mine[i].options());
        o.lr(v.at("lr"));
        o.momentum(v.at("momentum"));
        o.dampening(v.at("dampening"));
        o.weight_decay(v.at("weight_decay"));
        break;
      }
      case Kind::kAdam:
        set_adam_options(static_cast<torch::optim::AdamOptions&>(mine[i].options()), v);
        break;
      case Kind::kAdamW:
        set_adam_options(static_cast<torch::optim::AdamWOptions&>(mine[i].options()), v);
        break;
      case Kind::kRmsprop: {
        auto& o = static_cast<torch::optim::RMSpropOptions&>(mine[i].options());
        // A momentum buffer exists either way: a schedule's momentum comes back.
        if (o.momentum() > 0 && v.at("momentum") > 0) o.momentum(v.at("momentum"));
        o.lr(v.at("lr"));
        o.alpha(v.at("alpha"));
        o.eps(v.at("eps"));
        o.weight_decay(v.at("weight_decay"));
        break;
      }
      case Kind::kAdagrad: {
        auto& o = static_cast<torch::optim::AdagradOptions&>(mine[i].options());
        o.lr(v.at("lr"));
        o.lr_decay(v.at("lr_decay"));
        o.weight_decay(v.at("weight_decay"));
        o.initial_accumulator_value(v.at("initial_accumulator_value"));
        o.eps(v.at("eps"));
        break;
      }
    }
  }
}

std::string safetensors_dtype(at::ScalarType t, const std::string& key) {
  switch (t) {
    case at::kFloat:
      return "F32";
    case at::kDouble:
      return "F64";
    case at::kHalf:
      return "F16";
    case at::kBFloat16:
      return "BF16";
    case at::kLong:
      return "I64";
    case at::kInt:
      return "I32";
    case at::kShort:
      return "I16";
    case at::kChar:
      return "I8";
    case at::kByte:
      return "U8";
    case at::kBool:
      return "BOOL";
    default:
      break;
  }
  FSDP_FAIL(/*rank=*/-1, "checkpoint", key, " is ", t,
            ", a dtype checkpoints cannot hold (they hold float64/32/16, bfloat16, int64/32/16/8, "
            "uint8 and bool). Hold the tensor in one of those (a complex one as "
            "torch::view_as_real), or outside the model's parameters and buffers");
}

at::Tensor step_tensor(int64_t step) {
  return at::scalar_tensor(static_cast<double>(step), at::kFloat);
}

int64_t step_value(const at::Tensor& t, const std::string& where) {
  FSDP_CHECK(t.numel() == 1 && (t.is_floating_point() || t.scalar_type() == at::kLong), -1, where,
             "expected Adam's step as one float or int64 value, got ", t.scalar_type(), " of ",
             t.numel(), " elements. Save the optimizer state with libfsdp or PyTorch's Adam");
  const double value = t.item<double>();
  FSDP_CHECK(value >= 0 && value == std::floor(value), -1, where,
             "expected Adam's step to be a whole number of steps, got ", value,
             ". Save the optimizer state with libfsdp or PyTorch's Adam");
  return static_cast<int64_t>(value);
}

at::ScalarType scalar_type_of(const std::string& dtype) {
  static const std::map<std::string, at::ScalarType> types = {
      {"F32", at::kFloat}, {"F64", at::kDouble}, {"F16", at::kHalf},  {"BF16", at::kBFloat16},
      {"I64", at::kLong},  {"I32", at::kInt},    {"I16", at::kShort}, {"I8", at::kChar},
      {"U8", at::kByte},   {"BOOL", at::kBool}};
  const auto it = types.find(dtype);
  FSDP_CHECK(it != types.end(), /*rank=*/-1, "checkpoint", "dtype ", dtype,
             " has no LibTorch equivalent");
  return it->second;
}

}  // namespace fsdp::detail
