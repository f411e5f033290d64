#include "core/sharded_placeholder.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/DispatchKeySet.h>
#include <c10/core/TensorImpl.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include "detail/error.h"
#include "detail/torch_compat.h"

#include <mutex>
#include <unordered_map>
#include <utility>

// See Note [Sharded placeholders].

namespace fsdp::detail {
namespace {

constexpr c10::DispatchKey kKey = c10::DispatchKey::FSDP_PLACEHOLDER_DISPATCH_KEY;

struct Entry {
  PlaceholderKind kind;
  std::string what;
};

std::mutex& registry_mutex() {
  static std::mutex mu;
  return mu;
}

std::unordered_map<const c10::StorageImpl*, Entry>& registry() {
  static auto* map = new std::unordered_map<const c10::StorageImpl*, Entry>();
  return *map;
}

const c10::StorageImpl* storage_of(const at::Tensor& t) {
  return t.defined() && t.has_storage() ? t.storage().unsafeGetStorageImpl() : nullptr;
}

bool passes_through(const std::string& name) {
  return name == "aten::_has_compatible_shallow_copy_type" || name == "aten::detach" ||
         name == "aten::detach_" || name == "aten::alias" || name == "aten::set_data" ||
         name == "aten::requires_grad_" || name == "aten::_version" || name == "aten::output_nr" ||
         name == "aten::retain_grad";
}

std::string message(const std::string& op, const Entry& e) {
  if (e.kind == PlaceholderKind::kGradient) {
    return error_prefix(-1, "parameters") + op + " read the gradient of " + e.what +
           ", but FSDP moved it into the unit's flat gradient shard. An optimizer (or "
           "clip_grad_norm_) was built on the unwrapped module's parameters. Build it on the "
           "wrapped model's parameters() (the flat shards, or per-parameter views with "
           "FSDPOptions().use_orig_params(true)), and clip with the root's clip_grad_norm_().";
  }
  return error_prefix(-1, "parameters") + op + " used " + e.what +
         ", which is sharded: its data exists only while its FSDP unit runs. Either the wrapped "
         "module was called directly (call the FullyShardedDataParallel wrapper, or the root, "
         "instead of the inner module, and read full parameters under fsdp::SummonFullParams), "
         "or an optimizer was built on the unwrapped module's parameters (build it on the "
         "wrapped model's parameters()).";
}

void placeholder_fallback(const c10::OperatorHandle& op, c10::DispatchKeySet keys,
                          torch::jit::Stack* stack) {
  const std::string& name = op.schema().name();
  const size_t n = op.schema().arguments().size();
  // The first placeholder among the arguments; a gradient one wins, since
  // reading a moved gradient is the more specific mistake.
  const Entry* found = nullptr;
  Entry copy;
  {
    std::lock_guard<std::mutex> lock(registry_mutex());
    for (size_t i = stack->size() - n; i < stack->size(); ++i) {
      const c10::IValue& v = (*stack)[i];
      if (!v.isTensor()) continue;
      auto it = registry().find(storage_of(v.toTensor()));
      if (it == registry().end()) continue;
      if (found == nullptr || it->second.kind == PlaceholderKind::kGradient) found = &it->second;
    }
    if (found != nullptr) copy = *found;
  }
  if (name == "aten::zero_" && found != nullptr && copy.kind == PlaceholderKind::kGradient) {
    return;  // Module::zero_grad(): the moved gradient is zero here already
  }
  // Optimizer::zero_grad() detaches each gradient in place before zeroing it
  // (LibTorch 1.13) or dropping it (2.x's default, after which step() would
  // skip the parameter without a word); Module::zero_grad() uses an
  // out-of-place detach. So an in-place detach of a moved gradient means an
  // optimizer was built on the unwrapped parameters: say so now.
  if (name == "aten::detach_" && found != nullptr && copy.kind == PlaceholderKind::kGradient) {
    TORCH_CHECK(false, message("Optimizer::zero_grad()", copy));
  }
  if (passes_through(name) || found == nullptr) {
    op.redispatchBoxed(keys & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, kKey), stack);
    return;
  }
  TORCH_CHECK(false, message(name, copy));
}

}  // namespace

TORCH_LIBRARY_IMPL(_, FSDP_PLACEHOLDER_DISPATCH_KEY, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&placeholder_fallback>());
}

at::Tensor make_placeholder(const at::Tensor& like, PlaceholderKind kind, std::string what) {
  c10::Storage storage(c10::Storage::use_byte_size_t(), 0,
                       c10::DataPtr(nullptr, c10::Device(c10::kCPU)), nullptr,
                       /*resizable=*/false);
  auto t = at::detail::make_tensor<c10::TensorImpl>(
      std::move(storage), c10::DispatchKeySet(c10::DispatchKey::CPU) | c10::DispatchKeySet(kKey),
      like.dtype());
  t.unsafeGetTensorImpl()->set_sizes_contiguous(like.sizes());
  std::lock_guard<std::mutex> lock(registry_mutex());
  registry()[storage_of(t)] = Entry{kind, std::move(what)};
  return t;
}

void rename_placeholder(const at::Tensor& placeholder, std::string what) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  auto it = registry().find(storage_of(placeholder));
  if (it != registry().end()) it->second.what = std::move(what);
}

void release_placeholder(const at::Tensor& placeholder) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  registry().erase(storage_of(placeholder));
}

bool is_placeholder(const at::Tensor& t) { return t.defined() && t.key_set().has(kKey); }

}  // namespace fsdp::detail
