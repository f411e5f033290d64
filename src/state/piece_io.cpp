#include "state/piece_io.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <algorithm>
#include <map>
#include <set>

#include "core/sharded_placeholder.h"
#include "detail/error.h"
#include "state/local_state.h"

namespace fsdp::detail {
namespace {

std::string shape_text(const std::vector<int64_t>& s) {
  return c10::IntArrayRef(s).vec().empty() ? "[]" : c10::str(c10::IntArrayRef(s));
}

// The key `src` holds `p`'s entry under (prefix + name + suffix): of its
// names the last the source has, as the last of a tied tensor's names wins
// in the unwrapped model's torch::load and PyTorch's load_state_dict; its
// own name where the source has none.
std::string stored_key(const PieceSource& src, const std::string& prefix, const LocalPiece& p,
                       const std::string& suffix) {
  std::string found = prefix + p.name + suffix;
  for (const std::string& name : p.names()) {
    if (src.has(prefix + name + suffix)) found = prefix + name + suffix;
  }
  return found;
}

// State the load leaves unused, where torch::load would have taken it (it
// restores amsgrad and the rest with the state, and refuses other groups):
// the user made the optimizer with other options or groups than the one
// saved, which would go on silently as another optimizer. Warned, once a
// load, naming the first such tensor and the option. Not where another
// group of this optimizer keeps the state: libfsdp before 2026-11-30 saved
// zeros of it for every group then (and loaded them), so old checkpoints
// of a correctly made optimizer have it.
void warn_unused_state(const OptimAccess& access, const std::vector<LocalPiece>& pieces,
                       const PieceSource& src) {
  std::string first, why;
  int64_t count = 0;
  // What some group keeps: every group's own state among it.
  const std::vector<std::string>& any_group = access.state_names();
  for (const LocalPiece& p : pieces) {
    if (p.is_buffer) continue;
    const bool stepped = access.steps(p.optim_param);
    for (const std::string& name : access.possible_state_names()) {
      const std::string key = stored_key(src, "optim/", p, "/" + name);
      const bool kept = std::count(any_group.begin(), any_group.end(), name) != 0;
      if (!src.has(key) || (stepped && kept)) continue;
      if (count++ == 0) {
        first = key.substr(6);
        why = stepped ? std::string("the group that steps it is not made with ") +
                            OptimAccess::option_keeping(name)
                      : "this optimizer does not step " + p.name + " (frozen, or in no group)";
      }
    }
  }
  if (count == 0) return;
  TORCH_WARN("fsdp(optimizer state): the state has ", first, " (and ", count - 1,
             " more tensors) that this optimizer leaves unused: ", why,
             ". To continue the optimizer saved, make it with the options and parameter groups "
             "it was saved with.");
}

}  // namespace

DictSource::DictSource(const torch::OrderedDict<std::string, at::Tensor>& dict, std::string prefix)
    : dict_(dict), prefix_(std::move(prefix)) {}

bool DictSource::has(const std::string& key) const {
  return key.rfind(prefix_, 0) == 0 && dict_.find(key.substr(prefix_.size())) != nullptr;
}

std::vector<std::string> DictSource::keys() const {
  std::vector<std::string> out;
  for (const auto& item : dict_) out.push_back(prefix_ + item.key());
  return out;
}

at::ScalarType DictSource::dtype(const std::string& key) const {
  return dict_[key.substr(prefix_.size())].scalar_type();
}

void DictSource::check(const std::string& key, const std::vector<int64_t>& shape,
                       at::ScalarType dtype) const {
  const std::string name = key.substr(prefix_.size());
  const at::Tensor& t = dict_[name];
  FSDP_CHECK(t.sizes().vec() == shape, /*rank=*/-1, name, "has shape ", t.sizes(),
             " in the state dict, expected ", shape_text(shape),
             " (the model's). Load a state dict saved from the same model.");
  FSDP_CHECK(t.scalar_type() == dtype, /*rank=*/-1, name, "is ", t.scalar_type(),
             " in the state dict, expected ", dtype, ". Convert it with .to(", dtype,
             ") before loading");
}

void DictSource::read(const std::string& key, const std::vector<int64_t>& shape, int64_t begin,
                      int64_t end, const at::Tensor& dst) const {
  check(key, shape, dst.scalar_type());
  const at::Tensor& t = dict_[key.substr(prefix_.size())];
  dst.copy_(t.detach().reshape({-1}).narrow(0, begin, end - begin));
}

bool FileSource::has(const std::string& key) const { return !reader_.pieces(key).empty(); }

void FileSource::check(const std::string& key, const std::vector<int64_t>& shape,
                       at::ScalarType dtype) const {
  const std::string want = safetensors_dtype(dtype, key);
  for (const TensorRecord* p : reader_.pieces(key)) {
    const std::string file = reader_.dir() + "/" + p->file;
    FSDP_CHECK(p->shape == shape, /*rank=*/-1, file, key, " has shape ", shape_text(p->shape),
               ", the model expects ", shape_text(shape),
               ". Load a checkpoint saved from the same model.");
    FSDP_CHECK(p->dtype == want, /*rank=*/-1, file, key, " is ", p->dtype, ", the model expects ",
               want);
  }
}

void FileSource::will_read(const std::string& key, int64_t begin, int64_t end) const {
  for (const TensorRecord* p : reader_.pieces(key)) {
    if (p->begin < end && begin < p->end) reader_.verify_file(*p);
  }
}

at::ScalarType FileSource::dtype(const std::string& key) const {
  const auto pieces = reader_.pieces(key);
  TORCH_INTERNAL_ASSERT(!pieces.empty(), "no piece of ", key);
  return scalar_type_of(pieces.front()->dtype);
}

void FileSource::read(const std::string& key, const std::vector<int64_t>& shape, int64_t begin,
                      int64_t end, const at::Tensor& dst) const {
  TORCH_INTERNAL_ASSERT(dst.is_contiguous(), "the destination of ", key, " is not contiguous");
  if (!dst.is_cpu()) {
    // The files are read into host memory; a GPU shard gets one copy.
    const at::Tensor host = at::empty(dst.sizes(), dst.options().device(at::kCPU));
    read(key, shape, begin, end, host);
    dst.copy_(host);
    return;
  }
  check(key, shape, dst.scalar_type());
  auto pieces = reader_.pieces(key);
  // Where several files hold the same elements (every rank saves the step),
  // one already checked first (Note [Each rank checks what it reads]).
  std::sort(pieces.begin(), pieces.end(), [this](const TensorRecord* a, const TensorRecord* b) {
    if (a->begin != b->begin) return a->begin < b->begin;
    return reader_.verified(*a) && !reader_.verified(*b);
  });
  auto* out = static_cast<char*>(dst.data_ptr());
  const int64_t elem = static_cast<int64_t>(dst.element_size());
  int64_t cur = begin;
  for (const TensorRecord* p : pieces) {
    if (cur >= end) break;
    if (p->begin > cur || p->end <= cur) continue;
    const int64_t hi = std::min(end, p->end);
    reader_.read(*p, cur, hi, out + (cur - begin) * elem);
    cur = hi;
  }
  FSDP_CHECK(cur >= end, /*rank=*/-1, reader_.dir(), "elements [", cur, ", ", end, ") of ", key,
             " are in no file of the checkpoint (an incomplete sharded checkpoint?)");
  // Written through the pointer: the version counter moves as after copy_,
  // or what keeps a copy of the shard (its bf16 host copy, Note [A host copy
  // in the compute dtype]) would take the old copy for current.
  dst.unsafeGetTensorImpl()->bump_version();
}

void load_model_pieces(torch::nn::Module& root, const PieceSource& src, PieceLoad how,
                       IncompatibleKeys* skipped) {
  // A unit left unsharded would keep stale full values: free them first; the
  // next forward gathers the loaded shards.
  if (how == PieceLoad::kCheckAndWrite) {
    for (const UnitEntry& e : units_with_params(root)) e.unit->release_full_params();
  }
  at::NoGradGuard no_grad;
  UnreportedUses unreported;  // writes outside forward (Note [Units driven by dispatch])
  // Every entry checked before any is written, on every rank whatever its
  // shard holds: bad input is refused alike everywhere, and changes nothing.
  std::vector<LocalPiece> pieces = local_pieces(root);
  std::set<std::string> expected;
  std::vector<std::string> from(pieces.size());       // the key each piece is read from
  std::vector<at::ScalarType> stored(pieces.size());  // and the dtype it is stored in
  for (size_t i = 0; i < pieces.size(); ++i) {
    const LocalPiece& p = pieces[i];
    for (const std::string& name : p.names()) expected.insert("model/" + name);
    from[i] = stored_key(src, "model/", p, "");
    // Non-strict: every name the source lacks, as PyTorch's load_state_dict
    // names each of a tied tensor's names (the tensor loads from another).
    if (skipped != nullptr) {
      for (const std::string& name : p.names()) {
        if (!src.has("model/" + name)) skipped->missing_keys.push_back(name);
      }
    }
    // A zero-element tensor has nothing to read, and sharded checkpoints
    // saved until 2026-11-29 have no entry for it; a missing one is left as
    // it is where the load is not strict.
    if ((p.numel == 0 || skipped != nullptr) && !src.has(from[i])) {
      stored[i] = p.saved_dtype;
      continue;
    }
    FSDP_CHECK(src.has(from[i]), /*rank=*/-1, p.name, "the checkpoint has no entry for ",
               p.is_buffer ? "buffer " : "parameter ", p.name,
               ". Load a checkpoint saved from the same model (names are the original "
               "module paths).");
    // A buffer in buffer_dtype is saved in its own dtype; one saved before
    // 2026-11-29 is in buffer_dtype.
    // A floating-point entry of another floating-point dtype is cast as it
    // is read, as PyTorch's load_state_dict copies (a bf16 dict into a
    // float32 model); so is a buffer in buffer_dtype, saved in its own dtype
    // (or, before 2026-11-29, in buffer_dtype).
    const at::ScalarType given = src.dtype(from[i]);
    stored[i] =
        at::isFloatingType(given) && at::isFloatingType(p.saved_dtype) ? given : p.saved_dtype;
    for (const std::string& name : p.names()) {
      if (src.has("model/" + name)) src.check("model/" + name, p.shape, stored[i]);
    }
    if (p.end > p.begin) src.will_read(from[i], p.begin, p.end);
  }
  for (const std::string& key : src.keys()) {
    if (key.rfind("model/", 0) != 0 || expected.count(key) != 0) continue;
    if (skipped != nullptr) {
      skipped->unexpected_keys.push_back(key.substr(6));
      continue;
    }
    FSDP_FAIL(/*rank=*/-1, key.substr(6), "the checkpoint has ", key.substr(6),
              ", which the model does not have. Load a checkpoint saved from the same model.");
  }
  if (how == PieceLoad::kCheckOnly) return;
  for (size_t i = 0; i < pieces.size(); ++i) {
    LocalPiece& p = pieces[i];
    if (p.end <= p.begin || !src.has(from[i])) continue;  // nothing here, or skipped
    if (stored[i] == p.data.scalar_type()) {
      src.read(from[i], p.shape, p.begin, p.end, p.data);
    } else {  // cast as it is read (see above)
      const at::Tensor saved = at::empty(p.data.sizes(), p.data.options().dtype(stored[i]));
      src.read(from[i], p.shape, p.begin, p.end, saved);
      p.data.copy_(saved);
    }
  }
}

void load_optim_pieces(torch::nn::Module& root, torch::optim::Optimizer& opt,
                       const PieceSource& src, PieceLoad how) {
  OptimAccess access(opt);
  auto pieces = local_pieces(root);
  access.check_steps_only(pieces);
  // Pieces grouped by the tensor the optimizer steps (a flat shard holds
  // many). A parameter it does not step (frozen, or left out of its groups)
  // gets no state, as torch::optim makes none for it.
  std::vector<std::vector<LocalPiece*>> groups;
  std::map<const void*, size_t> where;
  for (LocalPiece& p : pieces) {
    if (p.is_buffer || !access.steps(p.optim_param)) continue;
    const void* impl = p.optim_param.unsafeGetTensorImpl();
    auto it = where.find(impl);
    if (it == where.end()) {
      it = where.emplace(impl, groups.size()).first;
      groups.emplace_back();
    }
    groups[it->second].push_back(&p);
  }
  // Every "optim/" key names a state of one of the model's parameters: a
  // model's state dict passed instead, or another model's optimizer, is an
  // error on every rank, not optimizer state silently reset.
  std::set<std::string> expected, params;
  for (const LocalPiece& p : pieces) {
    if (p.is_buffer) continue;
    for (const std::string& param : p.names()) {
      params.insert(param);
      // What another optimizer of the kind keeps too (amsgrad's; loaded
      // into one without, unused).
      for (const std::string& name : access.possible_state_names())
        expected.insert("optim/" + param + "/" + name);
      if (access.has_step()) expected.insert("optim/" + param + "/step");
    }
  }
  for (const std::string& key : src.keys()) {
    if (key.rfind("optim/", 0) != 0 || expected.count(key) != 0) continue;
    // A state of this model's parameter that another kind of optimizer keeps.
    const size_t slash = key.rfind('/');
    const char* kind = OptimAccess::kinds_keeping(key.substr(slash + 1));
    FSDP_CHECK(slash <= 6 || params.count(key.substr(6, slash - 6)) == 0 || *kind == '\0',
               /*rank=*/-1, "optimizer state", "the state has ", key.substr(6), ", which ", kind,
               " keep, not ", access.kind_name(),
               ". Load it into an optimizer of the kind that saved it (or start this one afresh, "
               "without its state).");
    FSDP_FAIL(/*rank=*/-1, "optimizer state", "the state has ", key.substr(6),
              ", which is no state this optimizer keeps for this model's parameters (names "
              "are parameter/state, e.g. fc.weight/exp_avg). Load the optimizer state saved "
              "with this model and optimizer (a model's state dict is not one).");
  }
  // A parameter with some state has what every optimizer of the kind keeps:
  // SGD's momentum loaded into RMSprop, or a dict cut short, is refused.
  for (const LocalPiece& p : pieces) {
    if (p.is_buffer) continue;
    std::vector<std::string> stored, missing;
    for (const std::string& name : access.possible_state_names()) {
      if (src.has(stored_key(src, "optim/", p, "/" + name))) stored.push_back(name);
    }
    if (stored.empty()) continue;  // never stepped
    for (const std::string& name : access.required_state_names()) {
      if (!src.has(stored_key(src, "optim/", p, "/" + name))) missing.push_back(name);
    }
    FSDP_CHECK(missing.empty(), /*rank=*/-1, "optimizer state", "the state of ", p.name, " has ",
               stored.front(), " but no ", missing.front(),
               ": it was saved by another kind of optimizer, or cut short. Load the optimizer "
               "state saved with this model and optimizer.");
  }
  // Checked before any state is replaced, steps too: a bad one in a later
  // group must not leave the earlier groups loaded.
  std::vector<int64_t> steps(groups.size(), -1);  // each group's, -1 where none is stored
  std::vector<std::vector<std::string>> names(groups.size());  // the state each keeps
  // The dtype of each group's state `name`: as stored where it is a
  // floating dtype, as torch::load keeps it (LibTorch's SGD makes its
  // momentum from a bf16 gradient under keep_low_precision_grads), else
  // the parameter's.
  std::vector<std::map<std::string, at::ScalarType>> dtypes(groups.size());
  for (size_t g = 0; g < groups.size(); ++g) {
    names[g] = access.state_names(groups[g].front()->optim_param);
    for (const std::string& name : names[g]) {
      at::ScalarType& dtype = dtypes[g][name] = groups[g].front()->optim_param.scalar_type();
      bool first = true;  // the first stored piece decides the dtype
      for (const LocalPiece* p : groups[g]) {
        const std::string key = stored_key(src, "optim/", *p, "/" + name);
        if (!src.has(key)) continue;
        if (first && at::isFloatingType(src.dtype(key))) dtype = src.dtype(key);
        first = false;
        src.check(key, p->shape, dtype);
        if (p->end > p->begin) src.will_read(key, p->begin, p->end);
      }
    }
    if (!access.has_step()) continue;
    for (const LocalPiece* p : groups[g]) {
      const std::string key = stored_key(src, "optim/", *p, "/step");
      if (!src.has(key)) continue;
      at::Tensor step = at::zeros({1}, src.dtype(key));
      src.read(key, {}, 0, 1, step);
      steps[g] = step_value(step, key);
      break;
    }
  }
  if (how == PieceLoad::kCheckOnly) return;
  warn_unused_state(access, pieces, src);
  at::NoGradGuard no_grad;
  for (size_t g = 0; g < groups.size(); ++g) {
    const std::vector<LocalPiece*>& group = groups[g];
    const at::Tensor& param = group.front()->optim_param;
    ParamState st;
    bool found = false;
    for (const std::string& name : names[g]) {
      at::Tensor t = at::zeros_like(param.detach(), param.options().dtype(dtypes[g].at(name)),
                                    at::MemoryFormat::Contiguous);
      at::Tensor flat = t.view({-1});
      for (LocalPiece* p : group) {
        const std::string key = stored_key(src, "optim/", *p, "/" + name);
        if (!src.has(key)) continue;
        found = true;
        if (p->end > p->begin)
          src.read(key, p->shape, p->begin, p->end,
                   flat.narrow(0, p->optim_offset, p->end - p->begin));
      }
      st.tensors[name] = t;
    }
    if (steps[g] >= 0) {
      st.step = steps[g];
      found = true;
    }
    if (found) {
      access.set(param, st);
    } else {
      access.clear(param);  // saved without state: it was never stepped
    }
  }
}

}  // namespace fsdp::detail
