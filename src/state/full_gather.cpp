#include "state/full_gather.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "comm/agreement.h"
#include "core/sharded_placeholder.h"
#include "detail/error.h"
#include "runtime/unit_collectives.h"
#include "state/local_state.h"

namespace fsdp::detail {
namespace {

// The unit's state `name` as a shard-sized tensor (zeros where this rank's
// pieces have none).
at::Tensor local_state_shard(const std::vector<LocalPiece*>& pieces, OptimAccess& access,
                             const FlatParameter& flat, const std::string& name) {
  const at::Tensor shard = flat.shard().detach();
  if (!pieces.front()->unit->fsdp_options().use_orig_params()) {
    ParamState st;
    // In the shard's dtype, as the walk declares it (LibTorch's SGD keeps a
    // bf16 gradient's momentum in bf16 under keep_low_precision_grads).
    if (access.get(pieces.front()->optim_param, st) && st.tensors.count(name))
      return st.tensors.at(name).detach().reshape({-1}).to(shard.scalar_type());
    return at::zeros_like(shard);
  }
  at::Tensor out = at::zeros_like(shard);
  for (LocalPiece* p : pieces) {
    ParamState st;
    if (p->end == p->begin || !access.get(p->optim_param, st) || !st.tensors.count(name)) continue;
    const int64_t at_shard = p->begin + flat.slots()[p->slot].offset - flat.shard_offset();
    out.narrow(0, at_shard, p->end - p->begin).copy_(st.tensors.at(name).reshape({-1}));
  }
  return out;
}

}  // namespace

FullWalker::FullWalker(torch::nn::Module& root, torch::optim::Optimizer* opt, bool model,
                       bool aliases)
    : root_(root), opt_(opt), model_(model), aliases_(aliases) {
  if (opt_ != nullptr) {
    // Agree on which parameters have optimizer state, and their steps: a
    // rank whose piece is empty may have none (see Note [State pieces]).
    OptimAccess access(*opt_);
    auto pieces = local_pieces(root_);
    access.check_steps_only(pieces);
    std::vector<int64_t> flags(2 * pieces.size(), -1);
    for (size_t i = 0; i < pieces.size(); ++i) {
      ParamState st;
      if (pieces[i].is_buffer || !access.get(pieces[i].optim_param, st)) continue;
      flags[2 * i] = 1;
      flags[2 * i + 1] = static_cast<int64_t>(st.step);
    }
    agreed_ = agree_reduce(state_group(root_), std::move(flags), ReduceOp::kMax);
  }
  run(nullptr);
}

void FullWalker::walk(const std::function<void(size_t, const at::Tensor&)>& fn) { run(&fn); }

void FullWalker::run(const std::function<void(size_t, const at::Tensor&)>* fn) {
  // Inside SummonFullParams, a unit that is sharded on this rank only (the
  // others with rank0_only) must not gather: rank 0 would not.
  const bool summoned = unreported_uses_active();
  UnreportedUses unreported;  // reads outside forward (Note [Units driven by dispatch])
  const bool dry = fn == nullptr;
  if (dry) specs_.clear();
  size_t index = 0;
  auto emit = [&](const std::string& key, at::ScalarType dtype, const std::vector<int64_t>& shape,
                  const at::Tensor& t, bool alias = false) {
    if (dry) {
      specs_.push_back({key, dtype, shape, alias});
    } else {
      TORCH_INTERNAL_ASSERT(specs_.at(index).key == key, "fsdp: full walk out of order at ", key);
      (*fn)(index, t);
    }
    ++index;
  };
  std::vector<LocalPiece> pieces = local_pieces(root_);
  std::unique_ptr<OptimAccess> access;
  if (opt_ != nullptr) access = std::make_unique<OptimAccess>(*opt_);
  auto has_state = [&](size_t i) { return opt_ != nullptr && agreed_[2 * i] > 0; };
  auto step_of = [&](size_t i) { return agreed_[2 * i + 1]; };
  // State `name` of piece i, where its group keeps it (no zeros for Adam's
  // max_exp_avg_sq of a group without amsgrad).
  auto keeps = [&](size_t i, const std::string& name) {
    const std::vector<std::string> kept = access->state_names(pieces[i].optim_param);
    return std::find(kept.begin(), kept.end(), name) != kept.end();
  };

  size_t i = 0;
  while (i < pieces.size() && pieces[i].unit != nullptr) {
    // One unit: pieces [i, j).
    Unit* unit = pieces[i].unit;
    size_t j = i;
    std::vector<LocalPiece*> group;
    while (j < pieces.size() && pieces[j].unit == unit) group.push_back(&pieces[j++]);
    FlatParameter& flat = *unit->flat_param();
    if (model_) {
      // Under mixed precision what is gathered is the full-precision shard
      // (Note [Summoning in full precision]).
      FSDP_CHECK(dry || !summoned || flat.holds_full_values(), flat.group().rank(),
                 flat.unit_path(),
                 "expected the full parameters on this rank inside SummonFullParams, got this "
                 "rank's shard only (with rank0_only only rank 0 keeps them; or the guard "
                 "summons another module). Gathering them would need an all-gather that rank 0 "
                 "does not issue. Call it outside SummonFullParams, on every rank");
      const bool gathered = !dry && unit->gather_full_params();
      for (LocalPiece* p : group) {
        const at::Tensor full = dry ? at::Tensor() : flat.slots()[p->slot].param.detach();
        const auto names = p->names();
        for (size_t k = 0; k < (aliases_ ? names.size() : 1); ++k) {
          emit("model/" + names[k], flat.shard().scalar_type(), p->shape, full, k > 0);
        }
      }
      if (gathered) unit->release_full_params();
    }
    if (opt_ != nullptr) {
      for (const std::string& name : access->state_names()) {
        at::Tensor full;
        // Gathered only where some piece keeps it (alike on every rank: the
        // groups' options are).
        bool any = false;
        for (size_t k = i; k < j; ++k) any = any || (has_state(k) && keeps(k, name));
        if (!any) continue;
        if (!dry) full = gather_full(flat, local_state_shard(group, *access, flat, name));
        for (size_t k = i; k < j; ++k) {
          if (!has_state(k) || !keeps(k, name)) continue;
          const FlatParamSlot& slot = flat.slots()[pieces[k].slot];
          emit("optim/" + pieces[k].name + "/" + name, flat.shard().scalar_type(), slot.shape,
               dry ? at::Tensor() : full.narrow(0, slot.offset, slot.numel).view(slot.shape));
        }
      }
      if (access->has_step()) {
        for (size_t k = i; k < j; ++k) {
          if (!has_state(k)) continue;
          emit("optim/" + pieces[k].name + "/step", at::kFloat, {},
               dry ? at::Tensor() : step_tensor(step_of(k)));
        }
      }
    }
    i = j;
  }
  for (; i < pieces.size(); ++i) {
    const LocalPiece& p = pieces[i];
    const at::ScalarType dtype = p.data.scalar_type();
    if (model_) {
      const at::Tensor full = dry ? at::Tensor() : p.data.view(p.shape).to(p.saved_dtype);
      const auto names = p.names();
      for (size_t k = 0; k < (aliases_ ? names.size() : 1); ++k) {
        emit("model/" + names[k], p.saved_dtype, p.shape, full, k > 0);  // aliases follow
      }
    }
    if (opt_ == nullptr || p.is_buffer || !has_state(i)) continue;
    ParamState st;
    if (!dry) access->get(p.optim_param, st);
    for (const std::string& name : access->state_names(p.optim_param)) {
      emit("optim/" + p.name + "/" + name, dtype, p.shape,
           dry ? at::Tensor()
               : (st.tensors.count(name) ? st.tensors.at(name).to(dtype)
                                         : at::zeros(p.shape, p.data.options())));
    }
    if (access->has_step()) {
      emit("optim/" + p.name + "/step", at::kFloat, {},
           dry ? at::Tensor() : step_tensor(step_of(i)));
    }
  }
}

}  // namespace fsdp::detail
