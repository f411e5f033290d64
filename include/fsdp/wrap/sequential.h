#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/pimpl.h>

#include <vector>

#include <fsdp/runtime/unit.h>
#include <fsdp/wrap/options.h>
#include <fsdp/wrap/wrapper_traits.h>

namespace fsdp {

/// An FSDP unit around a type-erased module whose forward takes and returns
/// one Tensor: what a Sequential entry is. Its parameters, buffers and
/// children keep their names, as with FullyShardedDataParallel<Impl>.
class AnyUnitImpl : public torch::nn::Module, public Unit, public detail::ModuleWrapper {
 public:
  /// Wraps `module` (flattening and sharding its parameters now).
  AnyUnitImpl(torch::nn::AnyModule module, FSDPOptions options = {});
  /// Gathers the parameters, runs the wrapped forward, arranges backward.
  at::Tensor forward(at::Tensor input);
  /// Sets training mode on the wrapper, the wrapped module and their children.
  void train(bool on = true) override;
  /// See FullyShardedDataParallelImpl::pretty_print.
  void pretty_print(std::ostream& stream) const override;
  /// Module::zero_grad, and the gradients the optimizer steps (see
  /// FullyShardedDataParallelImpl::zero_grad).
  void zero_grad(bool set_to_none = kModuleZeroGradSetsToNone) override;
  /// See FullyShardedDataParallelImpl::save: full parameters (Note [Saving a unit]).
  void save(torch::serialize::OutputArchive& archive) const override;
  /// See FullyShardedDataParallelImpl::load.
  void load(torch::serialize::InputArchive& archive) override;
  /// See FullyShardedDataParallelImpl::to.
  void to(torch::Device device, torch::Dtype dtype, bool non_blocking = false) override;
  /// See FullyShardedDataParallelImpl::to.
  void to(torch::Dtype dtype, bool non_blocking = false) override;
  /// See FullyShardedDataParallelImpl::to.
  void to(torch::Device device, bool non_blocking = false) override;
  /// See detail::ModuleWrapper.
  torch::nn::Module& original_module() const override { return *module_.ptr(); }
  /// See Unit::flat_parameters.
  std::vector<at::Tensor> parameters(bool recurse = true) const { return flat_parameters(recurse); }
  /// See FullyShardedDataParallelImpl::clone: refused, naming what works.
  std::shared_ptr<torch::nn::Module> clone(
      const c10::optional<torch::Device>& device = c10::nullopt) const override;

 private:
  // See FullyShardedDataParallelImpl::clone_.
  void clone_(torch::nn::Module& other, const c10::optional<torch::Device>& device) override;

  torch::nn::AnyModule module_;
};
TORCH_MODULE(AnyUnit);

/// Replaces entry `index` of `seq` in place by an FSDP unit around it, so
/// `seq->forward` and `seq->named_parameters()` go through the unit with
/// unchanged names. Returns the unit. The entry's forward must take and
/// return one Tensor.
AnyUnit wrap_sequential_entry(torch::nn::Sequential& seq, size_t index, FSDPOptions options = {});

}  // namespace fsdp
