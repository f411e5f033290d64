#pragma once

#include <functional>
#include <optional>
#include <utility>

#include <fsdp/wrap/fully_sharded.h>
#include <fsdp/wrap/options.h>

namespace fsdp {

/// While alive (on this thread), fsdp::wrap() makes FSDP units with these
/// options: PyTorch's `with enable_wrap(...)`. Scopes nest; the innermost wins.
class EnableWrap {
 public:
  /// Opens a scope.
  explicit EnableWrap(FSDPOptions options);
  /// Closes it, restoring the enclosing scope's options.
  ~EnableWrap();
  EnableWrap(const EnableWrap&) = delete;
  EnableWrap& operator=(const EnableWrap&) = delete;

  /// The innermost scope's options, or nullptr outside any scope.
  static const FSDPOptions* current();

 private:
  std::optional<FSDPOptions> previous_;
};

/// Inside an EnableWrap scope: an FSDP unit around `module` with the scope's
/// options. Outside: the same wrapper type in pass-through mode, which is the
/// module unchanged (no unit, no sharding, the module's own parameters), so
/// model code can call wrap() unconditionally.
template <typename Impl>
FullyShardedDataParallel<Impl> wrap(const torch::nn::ModuleHolder<Impl>& module) {
  if (const FSDPOptions* options = EnableWrap::current()) {
    return FullyShardedDataParallel<Impl>(module, *options);
  }
  return FullyShardedDataParallel<Impl>(module, FSDPOptions(), /*enabled=*/false);
}

/// wrap() with the scope's options changed by `overrides` for this unit
/// (PyTorch's wrap(module, **wrap_overrides)):
/// `fsdp::wrap(head, [](fsdp::FSDPOptions& o) { o.reshard_after_forward(false); })`.
/// Outside a scope `overrides` is not called and the module is unchanged.
template <typename Impl>
FullyShardedDataParallel<Impl> wrap(const torch::nn::ModuleHolder<Impl>& module,
                                    const std::function<void(FSDPOptions&)>& overrides) {
  const FSDPOptions* options = EnableWrap::current();
  if (options == nullptr || !overrides) return wrap(module);
  FSDPOptions changed = *options;
  overrides(changed);
  return FullyShardedDataParallel<Impl>(module, std::move(changed));
}

}  // namespace fsdp
