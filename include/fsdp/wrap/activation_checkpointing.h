#pragma once

#include <c10/util/Optional.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/pimpl.h>

#include <functional>
#include <memory>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <fsdp/core/activation_checkpoint.h>
#include <fsdp/wrap/wrapper_traits.h>

namespace fsdp {

class AutoWrapPolicy;

namespace detail {

/// Drops the tensors `arg` holds (the recomputation substitutes them).
template <typename T>
void release_tensor_arg(T& arg) {
  for_each_tensor_arg(arg, [](at::Tensor& t) { t = at::Tensor(); });
}

/// A module's own parameters(), even where a wrapper hides it (an FSDP
/// unit's parameters() returns its flat shards; these are the originals the
/// forward uses).
inline std::vector<at::Tensor> module_parameters(const torch::nn::Module& m) {
  return m.parameters();
}

/// Refuses to checkpoint an FSDP unit itself: its wrapper would hide the unit
/// from the tree (it adopts the unit's contents). Names the fix.
void check_not_a_unit_to_checkpoint(const torch::nn::Module& m);

/// f(view_owned<Args>(std::get<I>(call))...).
template <typename... Args, typename F, typename Saved, size_t... I>
decltype(auto) call_viewed(F& f, Saved& call, std::index_sequence<I...>) {
  return f(view_owned<Args>(std::get<I>(call))...);
}

/// Calls `f(args...)` under activation_checkpoint(): the tensors of its
/// arguments (for_each_tensor_arg: within optionals, vectors, tuples and
/// pairs too) are its inputs, `params` the parameters `f` uses; the rest is
/// copied for the recomputation (a tensor inside a struct of the user's is
/// a constant there: no gradient reaches it). The copies are Owned: the
/// recomputation runs in backward, when the tensors a tuple's references
/// pointed to may be gone. `f` is called with arguments of the declared
/// types made from the copies (view_owned). R is the forward's output type
/// (IsForwardOutput).
template <typename R, typename F, typename... Args>
R call_checkpointed(F f, const std::vector<at::Tensor>& params, Args&&... args) {
  static_assert(IsForwardOutput<R>::value,
                "activation checkpointing needs a forward returning at::Tensor, "
                "std::vector<at::Tensor>, or a std::tuple / std::pair of these");
  using Saved = std::tuple<Owned<Args>...>;
  auto saved = std::make_shared<Saved>(to_owned(std::forward<Args>(args))...);
  std::vector<at::Tensor> inputs;
  std::apply([&inputs](const auto&... a) { (input_tensors(a, inputs), ...); }, *saved);
  // The copy kept for the recomputation holds no tensor: autograd saves the
  // inputs and frees them after backward, while the graph (a loss kept for
  // logging) may keep this function much longer.
  std::apply([](auto&... a) { (release_tensor_arg(a), ...); }, *saved);
  // The first run's output gives the result its shape (a tuple, a vector);
  // it is taken out at once so that the state autograd keeps for backward
  // holds no output (which would hold the graph: a cycle).
  struct First {
    c10::optional<R> out;
    bool taken = false;
  };
  auto first = std::make_shared<First>();
  CheckpointedFunction fn = [f, saved, first](const std::vector<at::Tensor>& xs) {
    Saved call = *saved;
    size_t k = 0;
    std::apply([&xs, &k](auto&... a) { (replace_tensors(a, xs, k), ...); }, call);
    R out = call_viewed<Args...>(f, call, std::index_sequence_for<Args...>{});
    std::vector<at::Tensor> flat;
    output_tensors(out, flat);
    if (!first->taken) first->out = std::move(out);
    return flat;
  };
  const std::vector<at::Tensor> flat = activation_checkpoint(fn, inputs, params);
  R result = std::move(*first->out);
  first->out.reset();
  first->taken = true;
  size_t k = 0;
  replace_tensors(result, flat, k);
  return result;
}

}  // namespace detail

/// A module that runs the forward of the module it wraps under
/// activation_checkpoint() (PyTorch's CheckpointWrapper): its activations
/// are not kept but recomputed in backward, with the same dropout masks.
/// Like FullyShardedDataParallel<Impl>, it re-registers the wrapped module's
/// parameters, buffers and children under their own names and has the
/// wrapped forward's signature, so it replaces the module where the parent
/// calls it. It works inside an FSDP unit (the unit gathers once for
/// backward, before the recomputation) and around modules that hold units
/// (the recomputation's gather replaces the unit's backward gather); see Note
/// [Activation checkpointing]. To checkpoint a unit's own forward, use
/// Unit::set_activation_checkpointing (or apply_activation_checkpointing()):
/// a wrapper around the unit itself is refused. The forward must return at::Tensor,
/// std::vector<at::Tensor>, or a std::tuple / std::pair of these.
template <typename Impl, typename Sig = typename detail::ForwardSignature<Impl>::type>
class CheckpointWrapperImpl;

template <typename Impl, typename C, typename R, typename... Args>
class CheckpointWrapperImpl<Impl, R (C::*)(Args...)> : public torch::nn::Module,
                                                       public detail::ModuleWrapper {
 public:
  /// Wraps the module held by `module`.
  explicit CheckpointWrapperImpl(const torch::nn::ModuleHolder<Impl>& module)
      : CheckpointWrapperImpl(module.ptr()) {}
  /// See the constructor above.
  explicit CheckpointWrapperImpl(std::shared_ptr<Impl> module)
      : Module("CheckpointWrapper"), module_(std::move(module)) {
    detail::check_module_given(module_.get());
    detail::check_not_a_unit_to_checkpoint(*module_);
    detail::adopt_module_contents(*this, *module_);
  }
  /// The wrapped forward, its activations recomputed in backward.
  R forward(Args... args) {
    Impl* m = module_.get();
    return detail::call_checkpointed<R>([m](auto&&... a) -> R { return m->forward(a...); },
                                        detail::module_parameters(*m), std::forward<Args>(args)...);
  }
  /// Sets training mode on the wrapper, the wrapped module and their children.
  void train(bool on = true) override {
    torch::nn::Module::train(on);
    module_->train(on);
  }
  /// The wrapped module.
  Impl& module() const { return *module_; }
  /// See detail::ModuleWrapper.
  torch::nn::Module& original_module() const override { return *module_; }

 private:
  std::shared_ptr<Impl> module_;
};

/// The module holder of CheckpointWrapperImpl<Impl>, as TORCH_MODULE makes:
/// `fsdp::CheckpointWrapper<BlockImpl> block{Block(config)};`.
template <typename Impl>
class CheckpointWrapper : public torch::nn::ModuleHolder<CheckpointWrapperImpl<Impl>> {
 public:
  using torch::nn::ModuleHolder<CheckpointWrapperImpl<Impl>>::ModuleHolder;
};

/// A checkpoint wrapper around a type-erased module whose forward takes and
/// returns one Tensor: what a Sequential entry is (see
/// apply_activation_checkpointing()).
class AnyCheckpointWrapperImpl : public torch::nn::Module, public detail::ModuleWrapper {
 public:
  /// Wraps `module`.
  explicit AnyCheckpointWrapperImpl(torch::nn::AnyModule module);
  /// The wrapped forward, its activations recomputed in backward.
  at::Tensor forward(at::Tensor input);
  /// Sets training mode on the wrapper, the wrapped module and their children.
  void train(bool on = true) override;
  /// See detail::ModuleWrapper.
  torch::nn::Module& original_module() const override { return *module_.ptr(); }

 private:
  torch::nn::AnyModule module_;
};
TORCH_MODULE(AnyCheckpointWrapper);

/// Turns activation checkpointing on for the modules under `root` for which
/// `check_fn` is true, as PyTorch's apply_activation_checkpointing(model,
/// check_fn=...): the root itself is never checkpointed (checkpoint a root
/// unit with unit->set_activation_checkpointing(true)); matches are taken
/// innermost first, and a match inside a match is checkpointed too (see
/// Note [Which modules apply_activation_checkpointing checkpoints]). An FSDP
/// unit (checked by the module it wraps) checkpoints its wrapped forward
/// (Unit::set_activation_checkpointing); a Sequential entry that is not a
/// unit is replaced in place by an AnyCheckpointWrapper; a module already
/// checkpointed is left as it is, so a second call changes nothing. Other
/// matches (a typed member of a parent class, whose type cannot change) are
/// an error naming them: declare the member as CheckpointWrapper<Impl>, or
/// make it a FullyShardedDataParallel<Impl> unit; so is a unit fully_shard
/// made in place (it has no forward of its own to checkpoint), and nothing
/// changes. Returns how many modules were checkpointed. Call it after
/// wrapping and before the first forward.
int apply_activation_checkpointing(torch::nn::Module& root,
                                   const std::function<bool(const torch::nn::Module&)>& check_fn);

/// apply_activation_checkpointing with a policy instead of check_fn
/// (PyTorch's auto_wrap_policy argument):
/// `fsdp::apply_activation_checkpointing(*model, fsdp::module_type_policy<BlockImpl>())`.
/// The policy is asked as auto_wrap asks it, with the numel of a module's
/// subtree that no checkpointed module under it holds.
int apply_activation_checkpointing(torch::nn::Module& root, const AutoWrapPolicy& policy);

}  // namespace fsdp
