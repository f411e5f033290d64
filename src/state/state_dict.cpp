#include <fsdp/state/state_dict.h>

#include <cstdint>
#include <exception>
#include <string>

#include "comm/agreement.h"
#include "core/sharded_placeholder.h"
#include "detail/env.h"
#include "detail/error.h"
#include "state/crc32.h"
#include "state/dict_broadcast.h"
#include "state/full_gather.h"
#include "state/local_state.h"
#include "state/piece_io.h"

namespace fsdp {
namespace {

// Test-only: FSDP_FAULT_STATE_DICT_COPY=<rank>:<index> makes that rank's copy
// of entry <index> throw, as a copy out of host memory would.
bool copy_fault(int64_t rank, size_t index) {
  const c10::optional<int64_t> at = detail::rank_fault("FSDP_FAULT_STATE_DICT_COPY", rank);
  return at && *at == static_cast<int64_t>(index);
}

torch::OrderedDict<std::string, at::Tensor> gather(torch::nn::Module& model,
                                                   torch::optim::Optimizer* optimizer,
                                                   const StateDictOptions& options) {
  detail::FullWalker walker(model, optimizer, /*model=*/optimizer == nullptr, /*aliases=*/true);
  ProcessGroup* group = detail::state_group(model);
  const int64_t rank = detail::rank_or_none(group);
  const bool summoned = detail::unreported_uses_active();
  const bool keep = !options.rank0_only() || group == nullptr || group->rank() == 0;
  torch::OrderedDict<std::string, at::Tensor> out;
  at::Tensor last_copy;
  std::exception_ptr error;
  walker.walk([&](size_t i, const at::Tensor& t) {
    if (!keep || error) return;
    try {
      TORCH_CHECK(!copy_fault(rank, i), "FSDP_FAULT_STATE_DICT_COPY: copy of entry ", i);
      const std::string& key = walker.specs()[i].key;
      if (!walker.specs()[i].alias) {  // a tied tensor's names share one copy, as in the model
        last_copy = options.offload_to_cpu() ? t.detach().to(at::kCPU, t.scalar_type(),
                                                             /*non_blocking=*/false, /*copy=*/true)
                                             : t.detach().clone();
      }
      out.insert(key.substr(key.find('/') + 1), last_copy);
    } catch (...) {
      error = std::current_exception();
    }
  });
  // One rank's failure is every rank's error: the walk went on to its end
  // (every unit resharded, the ranks' gathers paired), where the others would
  // have waited for it at their next collective. Not for the model inside
  // SummonFullParams, where the walk gathers nothing and rank 0 may be alone
  // (rank0_only); the optimizer's walk is collective there too.
  const bool agree = !summoned || optimizer != nullptr;
  const bool failed = agree && detail::agree_reduce(group, {error ? 1 : 0}, ReduceOp::kMax)[0] > 0;
  if (error) std::rethrow_exception(error);
  FSDP_CHECK(!failed, rank, optimizer != nullptr ? "optimizer state" : "state dict",
             "another rank failed while taking the full ",
             optimizer != nullptr ? "optimizer state" : "state",
             " dict (see its error); nothing was taken");
  return out;
}

}  // namespace

torch::OrderedDict<std::string, at::Tensor> full_state_dict(torch::nn::Module& model,
                                                            const StateDictOptions& options) {
  return gather(model, nullptr, options);
}

torch::OrderedDict<std::string, at::Tensor> full_optim_state_dict(
    torch::nn::Module& model, torch::optim::Optimizer& optimizer, const StateDictOptions& options) {
  return gather(model, &optimizer, options);
}

namespace {

// A dict that rank0_only left empty, passed on the other ranks: the model's
// load would name a missing parameter, and the optimizer's would clear its
// state, silently (an empty dict is also what a never-stepped optimizer
// gives), so each says what happened.
constexpr const char* kEmptyOnOtherRanks =
    " A dict taken with StateDictOptions().rank0_only(true) is empty on every rank but 0: "
    "load it with StateDictOptions().broadcast_from_rank0(true), or on every rank what rank 0 "
    "saved of it (torch::save).";

// A fingerprint (exact in the agreement's float64) of the dict's names,
// shapes and dtypes, in order: their CRC-32.
int64_t dict_fingerprint(const torch::OrderedDict<std::string, at::Tensor>& dict) {
  detail::Crc32 crc;
  for (const auto& item : dict) {
    crc.update(item.key().data(), item.key().size() + 1);
    const int64_t dtype = static_cast<int64_t>(item.value().scalar_type());
    crc.update(&dtype, sizeof dtype);
    for (const int64_t d : item.value().sizes()) crc.update(&d, sizeof d);
  }
  return crc.value();
}

int64_t rank_of(torch::nn::Module& model) {
  return detail::rank_or_none(detail::state_group(model));
}

// Rank 0's dict on every rank where `options` asks for it; else `dict`,
// once the ranks agreed it is empty on all of them or on none: rank0_only's
// dicts loaded as they are would leave ranks 1.. fresh (an optimizer's empty
// dict is also a never-stepped one's), and the refusal comes on every rank,
// so that none goes on alone to its next collective.
torch::OrderedDict<std::string, at::Tensor> dict_to_load(
    torch::nn::Module& model, const torch::OrderedDict<std::string, at::Tensor>& dict,
    const StateDictOptions& options, const char* where) {
  ProcessGroup* group = detail::state_group(model);
  if (options.broadcast_from_rank0()) return detail::broadcast_dict(group, dict);
  // A model without units loads on each rank alone, as it always did.
  if (detail::units_with_params(model).empty()) return dict;
  const bool empty = dict.is_empty();
  const int64_t print = dict_fingerprint(dict);
  const auto seen =
      detail::agree_reduce(group, {empty ? 1 : 0, empty ? 0 : 1, print, -print}, ReduceOp::kMax);
  FSDP_CHECK(seen[0] == 0 || seen[1] == 0, rank_of(model), where, "the dict is empty on ",
             empty ? "this rank" : "some ranks", " and not on others.", kEmptyOnOtherRanks);
  // Each rank checks its own dict: different dicts would load different
  // entries, or be refused on some ranks only.
  FSDP_CHECK(seen[2] == -seen[3], rank_of(model), where,
             "the dicts passed on the ranks differ (names, shapes or dtypes). Pass the same dict "
             "on every rank, or rank 0's with StateDictOptions().broadcast_from_rank0(true)");
  return dict;
}

}  // namespace

IncompatibleKeys load_full_state_dict(torch::nn::Module& model,
                                      const torch::OrderedDict<std::string, at::Tensor>& given,
                                      const StateDictOptions& options) {
  const auto state_dict = dict_to_load(model, given, options, "state dict");
  FSDP_CHECK(!options.strict() || !state_dict.is_empty() ||
                 (model.parameters().empty() && model.buffers().empty()),
             rank_of(model), "state dict",
             "the state dict is empty, and the model has parameters or buffers to load.",
             kEmptyOnOtherRanks);
  IncompatibleKeys skipped;
  detail::load_model_pieces(model, detail::DictSource(state_dict, "model/"),
                            detail::PieceLoad::kCheckAndWrite,
                            options.strict() ? nullptr : &skipped);
  return skipped;
}

void load_full_optim_state_dict(torch::nn::Module& model, torch::optim::Optimizer& optimizer,
                                const torch::OrderedDict<std::string, at::Tensor>& given,
                                const StateDictOptions& options) {
  const auto state_dict = dict_to_load(model, given, options, "optimizer state");
  FSDP_CHECK(!state_dict.is_empty() || optimizer.state().empty(), rank_of(model), "optimizer state",
             "the optimizer state dict is empty, which would clear this optimizer's state (as if "
             "never stepped); to start afresh, make a new optimizer instead.",
             kEmptyOnOtherRanks);
  detail::load_optim_pieces(model, optimizer, detail::DictSource(state_dict, "optim/"));
}

}  // namespace fsdp
