#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/pimpl.h>

#include <memory>
#include <tuple>
#include <type_traits>
#include <typeinfo>
#include <utility>
#include <vector>

#include <fsdp/runtime/unit.h>
#include <fsdp/wrap/options.h>

namespace fsdp {

namespace detail {
/// Registers `inner`'s direct parameters and buffers and its children on
/// `outer`, so a wrapper is transparent to names and state dicts.
void adopt_module_contents(torch::nn::Module& outer, torch::nn::Module& inner);

/// The forward signature the wrapper exposes; deduced from Impl::forward.
template <typename Impl>
struct ForwardSignature {
  using type = decltype(&Impl::forward);
};
/// A forward argument as the unit passes it on: a floating-point Tensor cast
/// to `dtype` when one is given (see Unit::forward_input_dtype), anything
/// else unchanged. Arg is the declared parameter type; a non-const Tensor&
/// is passed unchanged (a cast copy could not bind to it).
template <typename Arg, typename T>
decltype(auto) cast_forward_arg(T&& arg, const c10::optional<at::ScalarType>& dtype) {
  using Declared = std::remove_reference_t<Arg>;
  constexpr bool mutable_ref = std::is_lvalue_reference_v<Arg> && !std::is_const_v<Declared>;
  if constexpr (std::is_same_v<std::decay_t<T>, at::Tensor> && !mutable_ref) {
    if (dtype && arg.defined() && arg.is_floating_point() && arg.scalar_type() != *dtype) {
      return at::Tensor(arg.to(*dtype));
    }
    return at::Tensor(std::forward<T>(arg));
  } else {
    return std::forward<T>(arg);
  }
}

/// The dtype of the first floating-point Tensor among `args`, if any.
template <typename... T>
c10::optional<at::ScalarType> first_floating_dtype(const T&... args) {
  c10::optional<at::ScalarType> out;
  auto look = [&out](const auto& a) {
    if constexpr (std::is_same_v<std::decay_t<decltype(a)>, at::Tensor>) {
      if (!out && a.defined() && a.is_floating_point()) out = a.scalar_type();
    }
  };
  (look(args), ...);
  return out;
}

template <typename T>
struct IsTensorVector : std::false_type {};
template <>
struct IsTensorVector<std::vector<at::Tensor>> : std::true_type {};
template <typename T>
struct IsTuple : std::false_type {};
template <typename... T>
struct IsTuple<std::tuple<T...>> : std::true_type {};
template <typename A, typename B>
struct IsTuple<std::pair<A, B>> : std::true_type {};

/// Appends the Tensors of a forward's output to `into`: a Tensor, a
/// std::vector of Tensors, or a std::tuple / std::pair of these (nested).
/// Returns false for any other type, whose tensors cannot be found.
template <typename T>
bool output_tensors(const T& out, std::vector<at::Tensor>& into) {
  using D = std::decay_t<T>;
  if constexpr (std::is_same_v<D, at::Tensor>) {
    into.push_back(out);
    return true;
  } else if constexpr (IsTensorVector<D>::value) {
    into.insert(into.end(), out.begin(), out.end());
    return true;
  } else if constexpr (IsTuple<D>::value) {
    return std::apply([&into](const auto&... e) { return (output_tensors(e, into) && ...); }, out);
  } else {
    return false;
  }
}

/// Sequential's forward is a template: its wrapper takes and returns a Tensor.
template <>
struct ForwardSignature<torch::nn::SequentialImpl> {
  using type = at::Tensor (torch::nn::SequentialImpl::*)(at::Tensor);
};
}  // namespace detail

/// An FSDP unit around a module of type Impl: use it where the parent calls
/// the module (a member, or an entry of a Sequential). It re-registers the
/// wrapped module's parameters, buffers and children under their own names,
/// so named_parameters() and state dicts keep the original names, and its
/// forward has the wrapped forward's signature. See Note [FSDP and autograd].
template <typename Impl, typename Sig = typename detail::ForwardSignature<Impl>::type>
class FullyShardedDataParallelImpl;

template <typename Impl, typename R, typename... Args>
class FullyShardedDataParallelImpl<Impl, R (Impl::*)(Args...)> : public torch::nn::Module,
                                                                 public Unit {
 public:
  /// Wraps the module held by `module` (flattening and sharding its
  /// parameters now). With enabled == false the wrapper is a pass-through:
  /// no unit, the module unchanged (see fsdp::wrap()).
  explicit FullyShardedDataParallelImpl(const torch::nn::ModuleHolder<Impl>& module,
                                        FSDPOptions options = {}, bool enabled = true)
      : FullyShardedDataParallelImpl(module.ptr(), std::move(options), enabled) {}

  /// See the constructor above.
  explicit FullyShardedDataParallelImpl(std::shared_ptr<Impl> module, FSDPOptions options = {},
                                        bool enabled = true)
      : Module("FullyShardedDataParallel"),
        Unit(std::move(options)),
        module_(std::move(module)),
        enabled_(enabled) {
    TORCH_CHECK(module_, "fsdp: cannot wrap a null module");
    check_not_a_unit(*module_);
    detail::adopt_module_contents(*this, *module_);
    if (enabled_) {
      init_unit(*this, module_.get());
    } else {
      deactivate(module_.get());
    }
  }

  /// Gathers the parameters, runs the wrapped forward, and arranges backward.
  R forward(Args... args) {
    if (!enabled_) return module_->forward(std::forward<Args>(args)...);
    pre_forward();
    // See Note [Mixed precision]: inputs in the compute dtype.
    const c10::optional<at::ScalarType> dtype = forward_input_dtype();
    c10::optional<at::ScalarType> input_dtype;
    if (casts_output_back()) input_dtype = detail::first_floating_dtype(args...);
    R out = module_->forward(detail::cast_forward_arg<Args>(std::forward<Args>(args), dtype)...);
    if constexpr (std::is_same_v<std::decay_t<R>, at::Tensor>) {
      if (input_dtype && out.defined() && out.is_floating_point()) out = out.to(*input_dtype);
    }
    // See Note [FSDP and autograd]: backward starts at the output's tensors.
    std::vector<at::Tensor> tensors;
    const bool found = detail::output_tensors(out, tensors);
    post_forward(tensors, found ? nullptr : typeid(R).name());
    return out;
  }

  /// Sets training mode on the wrapper, the wrapped module and their children.
  void train(bool on = true) override {
    torch::nn::Module::train(on);
    module_->train(on);
  }

  /// What the optimizer steps: the flat shards of this unit and the units in it.
  /// (Hides Module::parameters; named_parameters() keeps the original names.)
  std::vector<at::Tensor> parameters(bool recurse = true) const {
    return enabled_ ? flat_parameters() : torch::nn::Module::parameters(recurse);
  }

  /// False for a pass-through wrapper made by fsdp::wrap() outside a scope.
  bool enabled() const { return enabled_; }

  /// The wrapped module.
  Impl& module() const { return *module_; }

 private:
  std::shared_ptr<Impl> module_;
  bool enabled_;
};

/// Holder for FullyShardedDataParallelImpl, like torch::nn::Linear for LinearImpl:
/// `fsdp::FullyShardedDataParallel<torch::nn::LinearImpl> fc(torch::nn::Linear(4, 4));`
template <typename Impl>
class FullyShardedDataParallel
    : public torch::nn::ModuleHolder<FullyShardedDataParallelImpl<Impl>> {
 public:
  using torch::nn::ModuleHolder<FullyShardedDataParallelImpl<Impl>>::ModuleHolder;
};

}  // namespace fsdp
