#include "runtime/unit_init.h"

#include "core/device_storage.h"
#include "detail/error.h"

#include <ATen/ATen.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <deque>
#include <optional>

#include <fsdp/comm/init.h>
#include <fsdp/core/reset_parameters.h>
#include <fsdp/runtime/unit.h>

namespace fsdp::detail {

ModuleSet ignored_module_set(const FSDPOptions& options) {
  ModuleSet out;
  for (const auto& m : options.ignored_modules()) {
    FSDP_CHECK(m != nullptr, -1, "options",
               "expected ignored_modules to hold modules, got a "
               "nullptr. Pass the modules themselves (shared_ptr<Module>)");
    for (const auto& sub : m->modules(/*include_self=*/true)) out.insert(sub.get());
  }
  return out;
}

std::unordered_set<const void*> ignored_params(const FSDPOptions& options) {
  std::unordered_set<const void*> out;
  for (const auto& m : options.ignored_modules()) {
    if (m == nullptr) continue;  // ignored_module_set() names it
    for (const auto& p : m->parameters()) out.insert(p.unsafeGetTensorImpl());
  }
  const auto& params = options.ignored_params();
  for (size_t i = 0; i < params.size(); ++i) {
    FSDP_CHECK(params[i].defined(), -1, "options", "ignored_params' entry ", i,
               " is an undefined tensor. Pass the parameters themselves "
               "(module->named_parameters()[\"name\"])");
    FSDP_CHECK(!params[i].is_meta(), -1, "options", "ignored_params' entry ", i,
               " is on the meta device: libfsdp initialises only what its units manage. "
               "Materialise it before wrapping (to_empty and initialise it on every rank alike)");
    out.insert(params[i].unsafeGetTensorImpl());
  }
  return out;
}

namespace {

std::string join_names(const std::vector<std::string>& names) {
  std::string out = "[";
  for (size_t i = 0; i < names.size(); ++i) out += (i ? ", " : "") + names[i];
  return out + "]";
}

}  // namespace

namespace {
thread_local const std::string* t_unit_path = nullptr;
}  // namespace

UnitPathScope::UnitPathScope(std::string path) : path_(std::move(path)), previous_(t_unit_path) {
  t_unit_path = &path_;
}

UnitPathScope::~UnitPathScope() { t_unit_path = previous_; }

const std::string* UnitPathScope::current() { return t_unit_path; }

void check_uniform_requires_grad(const std::vector<std::pair<std::string, at::Tensor>>& params,
                                 const std::string& where, bool use_orig_params, int rank,
                                 bool warn) {
  std::vector<std::string> trainable, frozen;
  int64_t trainable_numel = 0, frozen_numel = 0;
  for (const auto& [name, p] : params) {
    (p.requires_grad() ? trainable : frozen).push_back(name);
    (p.requires_grad() ? trainable_numel : frozen_numel) += p.numel();
  }
  if (trainable.empty() || frozen.empty() || (use_orig_params && !warn)) return;
  const std::string shown = where.empty() ? "<root>" : where;
  std::string msg = error_prefix(rank, where) + shown +
                    " has both parameters with requires_grad=true and requires_grad=false.";
  if (use_orig_params) {
    msg +=
        " We do not recommend wrapping such modules since the gradient memory usage will be "
        "higher than expected (" +
        std::to_string(trainable_numel + frozen_numel) + " numel instead of " +
        std::to_string(trainable_numel) + " numel before sharding via reduce-scatter).";
  } else {
    msg +=
        " FSDP does not support wrapping such modules when use_orig_params=false (a unit's "
        "flat parameter has a single requires_grad, and the frozen parameters would be "
        "stepped).";
  }
  // With use_orig_params already on, advising it again misleads.
  msg += std::string(
             " If possible, wrap the frozen parameters with FSDP separately (units of their own, "
             "or a policy that selects the frozen modules)") +
         (use_orig_params ? "." : ", or pass FSDPOptions().use_orig_params(true).") +
         "\nThe following parameters have requires_grad=true:\n" + join_names(trainable) +
         "\nThe following parameters have requires_grad=false:\n" + join_names(frozen);
  if (use_orig_params) {
    TORCH_WARN(msg);
  } else {
    TORCH_CHECK(false, msg);
  }
}

void check_param_init_fn(const FSDPOptions& options, const std::string& where) {
  const auto& fn = options.param_init_fn();
  FSDP_CHECK(!fn.has_value() || static_cast<bool>(*fn), -1, where,
             "expected param_init_fn to be callable, got an empty std::function. Pass a "
             "function that initialises a module's parameters and buffers in place, or leave "
             "param_init_fn unset (nullopt) to initialise meta modules with "
             "fsdp::reset_parameters()");
}

namespace {

bool has_meta_state(const torch::nn::Module& m) {
  for (const auto& p : m.parameters(/*recurse=*/false)) {
    if (p.defined() && p.is_meta()) return true;
  }
  for (const auto& b : m.buffers(/*recurse=*/false)) {
    if (b.defined() && b.is_meta()) return true;
  }
  return false;
}

// A module as initialisation sees it: a pass-through wrapper stands for the
// module it wraps (its own state is that module's).
torch::nn::Module* unwrap(torch::nn::Module* m) {
  const auto* unit = dynamic_cast<const Unit*>(m);
  if (unit != nullptr && !unit->is_active() && unit->wrapped_module() != nullptr) {
    return unit->wrapped_module();
  }
  return m;
}

bool is_broadcastable(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kBFloat16 || t == at::kHalf;
}

void broadcast_in_place(ProcessGroup& group, const at::Tensor& t) {
  if (t.numel() == 0) return;
  if (is_broadcastable(t.scalar_type()) && t.is_contiguous()) {
    group.broadcast(t, 0).wait();
    return;
  }
  // Integer and bool buffers (num_batches_tracked, masks) travel as doubles:
  // exact for integers below 2^53.
  at::Tensor tmp = t.to(at::kDouble).contiguous();
  group.broadcast(tmp, 0).wait();
  t.copy_(tmp);
}

// device_id(torch::kCUDA), without an index: the current device, as
// LibTorch reads "cuda" and PyTorch's FSDP reads device_id, with its
// warning where that is not this rank's GPU as launchers lay ranks out (no
// c10::cuda::set_device(local rank) before wrapping: every rank on GPU 0).
c10::Device current_device_for(c10::Device device, int rank, const std::string& where) {
  const c10::Device current = c10::impl::VirtualGuardImpl(device.type()).getDevice();
  const std::optional<c10::Device> gpu = is_initialized() ? local_gpu() : std::nullopt;
  if (gpu && gpu->type() == current.type() && *gpu != current) {
    TORCH_WARN(error_prefix(rank, where), "device_id ", device,
               " has no index, so the unit goes to the current device, ", current,
               " (as in PyTorch's FSDP), but this rank's GPU is ", *gpu,
               " (fsdp::local_gpu()). Call c10::cuda::set_device(", int(gpu->index()),
               ") before wrapping, or set device_id(*fsdp::local_gpu()).");
  }
  return current;
}

}  // namespace

c10::Device resolve_unit_device(const FSDPOptions& options,
                                const std::vector<std::pair<std::string, at::Tensor>>& params,
                                int rank, const std::string& where) {
  const std::pair<std::string, at::Tensor>* first = nullptr;
  for (const auto& named : params) {
    if (!named.second.is_meta()) {
      first = &named;
      break;
    }
  }
  c10::Device device = options.device_id() ? *options.device_id()
                       : first != nullptr  ? first->second.device()
                                           : c10::Device(c10::kCPU);
  const std::string origin = options.device_id() ? "FSDPOptions::device_id"
                             : first != nullptr  ? "parameter '" + first->first + "'"
                                                 : "the default";
  FSDP_CHECK(unit_device_supported(device), rank, where, "the unit's device is ", device, " (from ",
             origin,
             "), but libfsdp places units on the CPU and on CUDA devices (which this process "
             "does not see). Build the model on the CPU or a visible GPU, or set device_id to "
             "one of them");
  if (!device.is_cpu() && !device.has_index()) device = current_device_for(device, rank, where);
  return device;
}

UnitInit::UnitInit(torch::nn::Module& root, const FSDPOptions& options, c10::Device device)
    : options_(options), device_(device) {
  const ModuleSet ignored = ignored_module_set(options);
  std::unordered_set<const torch::nn::Module*> seen{&root};
  std::deque<torch::nn::Module*> queue{&root};
  while (!queue.empty()) {
    torch::nn::Module* m = queue.front();
    queue.pop_front();
    managed_.push_back(m);
    for (const auto& c : m->children()) {
      if (unit_of(*c) != nullptr) continue;  // manages its own
      torch::nn::Module* child = unwrap(c.get());
      if (ignored.count(c.get()) != 0 || ignored.count(child) != 0) continue;
      if (seen.insert(child).second) queue.push_back(child);
    }
  }
  at::NoGradGuard no_grad;
  // PyTorch's device_id: what was built on the CPU moves to the unit's GPU
  // (the module's own tensor objects, so the user's handles follow).
  // Not the parameters the user left out (FSDPOptions::ignored_params), as
  // PyTorch's FSDP leaves them.
  const std::unordered_set<const void*> left_out = ignored_params(options_);
  const auto move_to_device = [&](const at::Tensor& t) {
    if (!device_.is_cpu() && t.defined() && t.is_cpu() &&
        left_out.count(t.unsafeGetTensorImpl()) == 0) {
      at::Tensor(t).set_data(t.to(device_));
    }
  };
  for (torch::nn::Module* m : managed_) {
    if (!has_meta_state(*m)) continue;
    // Refused before anything is materialised: the model stays on the meta
    // device, to be wrapped again once a reset is registered.
    if (!options_.param_init_fn()) require_reset_parameters(*m);
    deferred_.push_back(m);
  }
  for (torch::nn::Module* m : managed_) {
    for (const auto& p : m->parameters(/*recurse=*/false)) move_to_device(p);
    for (const auto& b : m->buffers(/*recurse=*/false)) {
      if (!b.defined()) continue;
      move_to_device(b);
      if (b.is_meta()) {
        // Storage of its own (buffers are not flattened). See FlatParameter::bind.
        at::Tensor real = at::empty(b.sizes(), b.options().device(device_));
        b.unsafeGetTensorImpl()->shallow_copy_from(real.getIntrusivePtr());
      }
      buffers_.push_back(b);
    }
  }
}

void UnitInit::fill(const at::Tensor& unsharded) {
  {
    at::NoGradGuard no_grad;
    for (torch::nn::Module* m : deferred_) {
      if (options_.param_init_fn()) {
        (*options_.param_init_fn())(*m);
      } else {
        reset_parameters(*m);
      }
    }
  }
  if (!options_.sync_module_states()) return;
  ProcessGroup& group = *options_.process_group();
  at::NoGradGuard no_grad;
  if (unsharded.defined()) broadcast_in_place(group, unsharded);
  for (const auto& b : buffers_) broadcast_in_place(group, b);
}

std::vector<CastBuffer> UnitInit::cast_buffers() {
  std::vector<CastBuffer> cast;
  const auto& mp = options_.mixed_precision();
  if (!mp || !mp->buffer_dtype()) return cast;
  at::NoGradGuard no_grad;
  for (const auto& b : buffers_) {
    if (b.is_floating_point() && b.scalar_type() != *mp->buffer_dtype()) {
      cast.push_back({b, b.scalar_type()});
      at::Tensor(b).set_data(b.to(*mp->buffer_dtype()));  // the module's own buffer object
    }
  }
  return cast;
}

}  // namespace fsdp::detail
