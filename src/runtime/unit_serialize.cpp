// torch::save / torch::load of FSDP-wrapped modules (Unit::save_unit and
// Unit::load_unit, called by the wrappers' virtual Module::save / load).

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <algorithm>
#include <functional>
#include <unordered_map>
#include <vector>

#include <fsdp/runtime/unit.h>

#include "core/flat_parameter.h"
#include "core/sharded_placeholder.h"
#include "detail/error.h"
#include "runtime/unit_collectives.h"
#include "runtime/unit_runtime.h"

namespace fsdp {

namespace {

using torch::serialize::InputArchive;
using torch::serialize::OutputArchive;

// Module::save, with each parameter in `full` written as its full copy and
// each buffer in the dtype it is saved in (detail::saved_buffer_dtype). A
// nested unit saves its own parameters; a pass-through wrapper's belong to
// the enclosing unit.
void save_tree(const torch::nn::Module& m, OutputArchive& archive,
               const std::unordered_map<const void*, at::Tensor>& full) {
  for (const auto& p : m.named_parameters(/*recurse=*/false)) {
    auto it = full.find(p.value().unsafeGetTensorImpl());
    archive.write(p.key(), it != full.end() ? it->second : p.value());
  }
  for (const auto& b : m.named_buffers(/*recurse=*/false)) {
    const auto saved = detail::saved_buffer_dtype(b.value());
    archive.write(b.key(), saved ? b.value().to(*saved) : b.value(), /*is_buffer=*/true);
  }
  for (const auto& c : m.named_children()) {
    if (!c.value()->is_serializable()) continue;
    OutputArchive child(archive.compilation_unit());
    if (const Unit* nested = unit_of(*c.value())) {
      // A unit made in place (fully_shard) has no save() of its own.
      nested->save_unit(*c.value(), child);
    } else {
      save_tree(*c.value(), child, full);
    }
    archive.write(c.key(), child);
  }
}

}  // namespace

// Note [Saving a unit]
// torch::save(model, path) calls the virtual Module::save, which puts each
// parameter tensor into the archive by reference; the archive is written to
// the file after save() returns. A sharded unit's original parameters are
// placeholders without data (Note [Sharded placeholders]) and its unsharded
// buffer is freed as soon as the unit reshards, so Module::save wrote empty
// storages. save_unit instead writes a copy of each full parameter, under the
// same names and archive layout as the unwrapped module's Module::save: the
// file loads into the plain model and back. Where the full values come from:
//   - a unit that never shards (NO_SHARD): its shard, the whole buffer;
//   - a unit whose original parameters hold them under SummonFullParams
//     (on rank 0 with rank0_only, in full precision under mixed precision
//     too: Note [Summoning in full precision]);
// neither needs communication, so PyTorch's habit works as it is:
//     { fsdp::SummonFullParams full(*model); if (rank == 0) torch::save(model, path); }
//   - otherwise (sharded; or gathered outside the guard, by a forward, by
//     unshard(), which a step since may have made stale: Note [Resharding as
//     the user says]; or in param_dtype under mixed precision)
//     one all-gather of the full-precision shard; units are visited in the
//     module tree's pre-order, the same on every rank, so outside
//     SummonFullParams every rank must call torch::save, and every rank
//     writes the (identical) file.
// Inside SummonFullParams a unit that would need that all-gather (on ranks
// other than 0 with rank0_only; one outside the summoned module) is an error
// on each rank that saves, issuing nothing: where only rank 0 saves (the
// habit above), the others do not issue the all-gather, so it would pair
// with their next collective and break the group. The unit states tell all
// of this (FlatParameter::State, low_precision()); "inside SummonFullParams"
// is its open UnreportedUses scope, the only one user code runs in.
// load_unit needs no communication: each rank reads every full parameter
// and keeps the part its shard holds.
void Unit::save_unit(const torch::nn::Module& self, OutputArchive& archive) const {
  runtime().before_state_use();  // Note [Steps during backward]
  const FlatParameter* flat = flat_param();
  std::unordered_map<const void*, at::Tensor> full;
  if (flat != nullptr) {
    at::Tensor all;  // the padded full buffer, unless the original parameters hold the values
    // Gathered outside SummonFullParams (for a built graph, Note [Double
    // backward]; left gathered by a forward, unshard(), Note [Resharding as
    // the user says]): maybe stale since an optimizer step, which LibTorch's
    // SGD takes without a sign. Every rank holds its units alike.
    const bool stale = !detail::unreported_uses_active() &&
                       (runtime().held_for_graph() || flat->gathered_apart_from_shard());
    if (flat->keeps_unsharded() && flat->state() != FlatParameter::State::kSummoned) {
      all = flat->shard().detach();
    } else if (!flat->holds_full_values() || stale) {
      const bool low = flat->low_precision() && flat->state() == FlatParameter::State::kUnsharded;
      FSDP_CHECK(!detail::unreported_uses_active(), flat->group().rank(), flat->unit_path(),
                 "expected the full parameters on this rank to save them inside "
                 "SummonFullParams, got ",
                 low ? "their param_dtype copies (mixed precision)"
                     : "this rank's shard only (with rank0_only only rank 0 keeps them; "
                       "or the guard summons another module)",
                 ". Saving them would need an all-gather that the other ranks do not issue. ",
                 low ? "Call torch::save on every rank outside SummonFullParams"
                     : "Call torch::save on rank 0 only, under a guard on the module you "
                       "save, or on every rank outside SummonFullParams");
      all = detail::gather_full(*flat, flat->shard().detach());
    }
    for (const auto& slot : flat->slots()) {
      const at::Tensor value = all.defined()
                                   ? all.narrow(0, slot.offset, slot.numel).view(slot.shape)
                                   : slot.param.detach();
      // Each its own storage, as the unwrapped module's parameters are.
      full.emplace(slot.param.unsafeGetTensorImpl(), value.clone());
    }
  }
  save_tree(self, archive, full);
}

namespace {

// What loading changes, run once everything has been read and checked.
using Writes = std::vector<std::function<void()>>;

// Note [Loading a unit]
// torch::load of a file that does not fit the model (another model's, a
// layer of another shape) is an error naming the first difference, and it
// changes nothing: every unit of the tree, nested ones too, first reads and
// checks all its names and shapes, and only then is anything written. A
// caller that catches the error (falling back to training from scratch, or
// to an older checkpoint) still has the model it had. Every tensor is
// copied into the one the model holds, buffers too: they keep their device
// and dtype, as the shards do, where LibTorch's read would move a buffer to
// the file's device.
void read_unit(Unit& unit, torch::nn::Module& self, InputArchive& archive, Writes& writes) {
  unit.before_state_use();  // Note [Steps during backward]
  FlatParameter* flat = unit.flat_param();
  std::unordered_map<const void*, size_t> slot_of;
  if (flat != nullptr) {
    // The shard is what is written; unsharded values are refilled from it.
    writes.push_back([&unit] { unit.release_full_params(); });
    for (size_t i = 0; i < flat->slots().size(); ++i) {
      slot_of.emplace(flat->slots()[i].param.unsafeGetTensorImpl(), i);
    }
  }
  // Reads `key`, which must have `shape`: the file was saved from this model.
  const auto read_checked = [](InputArchive& in, const std::string& key, bool is_buffer,
                               const std::string& name, at::IntArrayRef shape, int rank,
                               const std::string& where) {
    at::Tensor value;
    in.read(key, value, is_buffer);
    FSDP_CHECK(value.sizes() == shape, rank, where, "expected ",
               is_buffer ? "buffer '" : "parameter '", name, "' of shape ", shape,
               " in the archive, got ", value.sizes(),
               ". The file was saved from a different model; load it into the model that "
               "saved it");
    return value;
  };
  // A tensor no flat parameter holds, copied into `dst`.
  const auto read_into = [&](InputArchive& in, const std::string& key, const at::Tensor& dst,
                             bool is_buffer, const std::string& name) {
    if (!dst.defined()) {  // as Module::load, which reads into a copy of the handle
      at::Tensor ignored;
      in.read(key, ignored, is_buffer);
      return;
    }
    const at::Tensor value = read_checked(in, key, is_buffer, name, dst.sizes(), -1, name);
    writes.push_back([dst, value] { at::Tensor(dst).copy_(value); });
  };
  std::function<void(torch::nn::Module&, InputArchive&, const std::string&)> read_tree =
      [&](torch::nn::Module& m, InputArchive& in, const std::string& prefix) {
        for (auto& p : m.named_parameters(/*recurse=*/false)) {
          auto it = slot_of.find(p.value().unsafeGetTensorImpl());
          if (it == slot_of.end()) {
            read_into(in, p.key(), p.value(), false, prefix + p.key());
            continue;
          }
          const FlatParamSlot& slot = flat->slots()[it->second];
          const at::Tensor value = read_checked(in, p.key(), false, prefix + p.key(), slot.shape,
                                                flat->group().rank(), flat->unit_path());
          // This rank's part: the slot's intersection with the shard.
          writes.push_back([flat, i = it->second, value] { flat->copy_into_shard(i, value); });
        }
        for (auto& b : m.named_buffers(/*recurse=*/false)) {
          // One saved in its own dtype (detail::saved_buffer_dtype) is kept
          // in buffer_dtype: the copy casts it.
          read_into(in, b.key(), b.value(), true, prefix + b.key());
        }
        for (const auto& c : m.named_children()) {
          if (!c.value()->is_serializable()) continue;
          InputArchive child;
          in.read(c.key(), child);
          if (Unit* nested = unit_of(*c.value())) {
            read_unit(*nested, *c.value(), child, writes);
          } else {
            read_tree(*c.value(), child, prefix + c.key() + ".");
          }
        }
      };
  read_tree(self, archive, "");
}

}  // namespace

// Note [torch::load into a unit made in place]
// torch::load(model, path) calls the model's Module::load, which reads each
// parameter and sets it to what it read with set_(value) (InputArchive::read,
// under NoGradGuard). A unit made by fully_shard cannot override that load,
// but the set_ reaches its parameter's dispatch key (Note [Sharded
// placeholders]), and the unit takes it as a load instead of a swap of
// storage, which would cut the parameter off its flat buffer: it checks the
// shape (a file of another model is an error naming the parameter, as
// wrappers' load_unit says it) and keeps this rank's part of the value in its
// shard, as load_unit does; a parameter gathered at that moment (left so by a
// forward, under SummonFullParams) takes the whole value too, so the gathered
// copy and the shard agree. No communication: every rank reads the file, as
// in plain LibTorch, and the ranks need not load together. The shard's
// version counter moves, so a compute-dtype copy of it is filled anew (Note
// [A host copy in the compute dtype]). Unlike load_unit, Module::load sets
// the parameters one by one: a file that fails halfway (a missing name, a
// shape) leaves the ones before it loaded, as plain LibTorch's load does.
// Where the file's device differs from the model's, InputArchive::read calls
// set_data instead, which is refused naming the device (Note [Module::to on
// a sharded model]); torch::load(model, path, device) reads onto the model's.
bool detail::UnitRuntime::load_param(const at::Tensor& param, const at::Tensor& value) {
  // An alias of a parameter (a detach(), a view) is no load: set_ on it is
  // refused as any other set_ on the unit's storage.
  const auto& slots = flat_->slots();
  size_t i = 0;
  while (i < slots.size() && !slots[i].param.is_same(param)) ++i;
  if (i == slots.size()) return false;
  end_open_forward();  // an evaluation's forward may still be open
  before_state_use();  // Note [Steps during backward]
  const int rank = flat_->group().rank();
  FSDP_CHECK(state_ == Unit::TrainingState::kIdle, rank, path_, "torch::load reached ", label(),
             " in ", to_string(state_), ": load between steps, not inside forward or backward");
  const FlatParamSlot& slot = slots[i];
  FSDP_CHECK(value.sizes() == at::IntArrayRef(slot.shape), rank, path_, "expected parameter '",
             slot.name, "' of shape ", at::IntArrayRef(slot.shape),
             " from torch::load (set_), got ", value.sizes(),
             ". The file was saved from a different model; load it into the model that saved it");
  // Left gathered: freed, to be gathered anew from the loaded shard; what
  // stays (SummonFullParams' guard, a graph that may be differentiated
  // again) takes the whole value.
  using State = FlatParameter::State;
  if (!held_by_summon_guard() && flat_->state() != State::kSummoned &&
      flat_->state() != State::kSharded) {
    reshard();
  }
  at::NoGradGuard no_grad;
  flat_->copy_into_shard(i, value);
  if (flat_->state() != State::kSharded) param.detach().copy_(value);
  return true;
}

void Unit::load_unit(torch::nn::Module& self, InputArchive& archive) {
  Writes writes;
  read_unit(*this, self, archive, writes);  // Note [Loading a unit]
  at::NoGradGuard no_grad;
  for (const auto& write : writes) write();
}

}  // namespace fsdp
