// Module::to and Module::clone on a wrapper: Note [Module::to on a sharded
// model], Note [Cloning a wrapped model].

#include <fsdp/runtime/unit.h>

#include <ATen/ATen.h>

#include <sstream>
#include <unordered_set>

#include "core/device_storage.h"
#include "core/flat_parameter.h"
#include "detail/error.h"

// Note [Module::to on a sharded model]
// LibTorch users move a model with model->to(device), often after building
// all of it, and Module::to converts each parameter with
// set_data(param.to(...)). A unit's parameters are views of its flat buffer,
// or placeholders while sharded: converted, one would be cut off its unit
// (and its gradient hook dropped), so the forward would read a copy that
// the optimizer, stepping the shards, never updates. Moving a unit (its
// shards, its buffers' storage, the optimizer's tensors, its collectives'
// device) is not built; unlike FSDP2, whose sharded parameters follow
// Module::to, a unit stays on the device and in the dtype it was wrapped
// with. So a wrapper's to():
// - where it leaves every unit in its tree as it is (model->to(device) after
//   wrapping, on that device), converts what no unit owns as LibTorch does
//   (buffers, e.g. BatchNorm's statistics) and leaves the units' parameters;
// - otherwise refuses with one line naming the unit, before anything
//   changed: every rank calls it, so every rank gets it.
// A unit made by fully_shard is the user's module, whose to() libfsdp cannot
// override. There the placeholders' fallback sees each parameter's
// Tensor::to, and returns the parameter itself where nothing would change
// (without gathering the unit), and the set_data that would replace a
// parameter's data is the error (Note [Sharded placeholders]): it comes at
// that parameter, after what the module converted before it (buffers), and
// the dtype kept is the parameters' own (under mixed precision, the compute
// dtype).

namespace fsdp {

void Unit::to_unit(torch::nn::Module& self, c10::optional<c10::Device> device,
                   c10::optional<at::ScalarType> dtype, bool non_blocking) {
  if (!is_active()) {  // a pass-through: LibTorch's, which reaches the units inside
    if (device && dtype) {
      self.torch::nn::Module::to(*device, *dtype, non_blocking);
    } else if (device) {
      self.torch::nn::Module::to(*device, non_blocking);
    } else {
      self.torch::nn::Module::to(*dtype, non_blocking);
    }
    return;
  }
  std::unordered_set<const c10::TensorImpl*> owned;
  // Named from `self` (the model, as a rule): the units' paths are known
  // only from the first forward on.
  for (const auto& item : self.named_modules(/*name_prefix=*/"", /*include_self=*/true)) {
    const Unit* unit = unit_of(*item.value());
    const FlatParameter* flat = unit != nullptr ? unit->flat_param() : nullptr;
    if (flat == nullptr) continue;
    const c10::Device at = flat->unsharded().device();
    const at::ScalarType as = flat->shard().scalar_type();
    if (!detail::conversion_keeps(at, as, device, dtype)) {
      std::ostringstream change;
      change << "to(";
      if (device) change << *device << (dtype ? ", " : "");
      if (dtype) change << *dtype;
      change << ") would move or convert";
      const torch::nn::Module* wrapped =
          unit->wrapped_module() != nullptr ? unit->wrapped_module() : item.value().get();
      const std::string label = item.key().empty()
                                    ? "the FSDP unit around a " + wrapped->name()
                                    : "FSDP unit '" + item.key() + "' (" + wrapped->name() + ")";
      FSDP_FAIL(flat->group().rank(), item.key().empty() ? "Module::to" : item.key(),
                detail::conversion_refusal(change.str(), label, at, as));
    }
    for (const auto& slot : flat->slots()) owned.insert(slot.param.unsafeGetTensorImpl());
  }
  // What is left out stays as the tensor has it, as in Module::to.
  const auto convert = [&](const at::Tensor& t) {
    return t.to(device.value_or(t.device()), dtype.value_or(t.scalar_type()), non_blocking);
  };
  for (const auto& module : self.modules(/*include_self=*/true)) {
    for (auto& p : module->named_parameters(/*recurse=*/false)) {
      if (owned.count(p.value().unsafeGetTensorImpl()) == 0) p.value().set_data(convert(p.value()));
    }
    for (auto& b : module->named_buffers(/*recurse=*/false)) b.value().set_data(convert(b.value()));
  }
}

// Note [Cloning a wrapped model]
// LibTorch copies a model with clone() (a target network, an EMA): a
// Cloneable module copies itself, then rebuilds its children (reset()) and
// has each copy its values from the original's child (clone_). A wrapper is
// no Cloneable, and its values are shards: a copy made so would be fresh
// units with freshly initialised parameters, the original's never copied
// (LibTorch's base clone_ does nothing). So a wrapper's clone() and clone_()
// are an error naming what works: a plain twin loaded from
// full_state_dict() (collective), or a model made by fully_shard, which is
// the user's own Cloneable module and clones as in LibTorch (a plain copy of
// what it holds: under SummonFullParams, the full parameters). A
// pass-through wrapper's copy would keep fresh values the same way: refused
// too, naming the module it wraps.
void Unit::refuse_clone(const torch::nn::Module& self) const {
  const FlatParameter* flat = flat_param();
  const torch::nn::Module* wrapped = wrapped_module() != nullptr ? wrapped_module() : &self;
  FSDP_CHECK(is_active(), -1, "Module::clone",
             "cannot clone the pass-through FSDP wrapper around a ", wrapped->name(),
             " (fsdp::wrap() outside a wrapping scope): a copy made by clone() would keep "
             "freshly initialised parameters. Clone the module it wraps, or build the model "
             "again and load its state");
  FSDP_FAIL(flat != nullptr ? flat->group().rank() : -1, "Module::clone",
            "cannot clone the FSDP unit around a ", wrapped->name(),
            ": its parameters are shards spread over the ranks, and a copy made by clone() "
            "would be new units with freshly initialised parameters. For a copy of the full "
            "model (a target network, an EMA), build the plain model and, on every rank, call "
            "fsdp::load_full_state_dict(copy, fsdp::full_state_dict(model)); or make the model "
            "with fsdp::fully_shard, whose clone() is LibTorch's (inside fsdp::SummonFullParams "
            "it copies the full parameters)");
}

}  // namespace fsdp
