#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/container/any_value.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/pimpl.h>
#include <torch/serialize/archive.h>

#include <memory>
#include <tuple>
#include <type_traits>
#include <typeinfo>
#include <utility>
#include <vector>

#include <fsdp/runtime/unit.h>
#include <fsdp/wrap/activation_checkpointing.h>
#include <fsdp/wrap/options.h>
#include <fsdp/wrap/wrapper_traits.h>

namespace fsdp {

namespace detail {
/// A forward argument as the unit passes it on: a floating-point Tensor cast
/// to `dtype` when one is given (see Unit::forward_input_dtype), anything
/// else unchanged. Arg is the declared parameter type; a non-const Tensor&
/// is passed unchanged (a cast copy could not bind to it), and so is a
/// container whose references (a tuple's Tensor&) could not bind to an
/// Owned copy.
template <typename Arg, typename T>
decltype(auto) cast_forward_arg(T&& arg, const c10::optional<at::ScalarType>& dtype) {
  using Declared = std::remove_reference_t<Arg>;
  constexpr bool mutable_ref = std::is_lvalue_reference_v<Arg> && !std::is_const_v<Declared>;
  using D = std::decay_t<T>;
  using O = Owned<D>;
  if constexpr (std::is_same_v<D, at::Tensor> && !mutable_ref) {
    if (dtype && arg.defined() && arg.is_floating_point() && arg.scalar_type() != *dtype) {
      return at::Tensor(arg.to(*dtype));
    }
    return at::Tensor(std::forward<T>(arg));
  } else if constexpr (MayHoldTensor<O>::value && !mutable_ref &&
                       std::is_constructible_v<Arg, O&&>) {
    // The tensors within (optionals, vectors, tuples, pairs), as PyTorch's
    // FSDP casts nested inputs; a tuple's const references then point into
    // the copy, which lives until the forward returns.
    O out = to_owned(std::forward<T>(arg));
    for_each_tensor_arg(out,
                        [&dtype](at::Tensor& t) { t = cast_forward_arg<at::Tensor>(t, dtype); });
    return out;
  } else {
    return std::forward<T>(arg);
  }
}

/// The dtype of the first floating-point Tensor among `args` (within
/// optionals, vectors, tuples and pairs too), if any.
template <typename... T>
c10::optional<at::ScalarType> first_floating_dtype(const T&... args) {
  c10::optional<at::ScalarType> out;
  auto look = [&out](const at::Tensor& t) {
    if (!out && t.defined() && t.is_floating_point()) out = t.scalar_type();
  };
  (for_each_tensor_arg(args, look), ...);
  return out;
}

/// Whether Impl declares its forward's default arguments with LibTorch's
/// FORWARD_HAS_DEFAULT_ARGS (LSTM, GRUCell, MultiheadAttention, ...): the
/// macro overrides Module::_forward_has_default_args in Impl itself.
template <typename Impl, bool = std::is_final_v<Impl>>
struct ForwardHasDefaultArgs : std::false_type {};
template <typename Impl>
struct ForwardHasDefaultArgs<Impl, false> {
  struct Probe : Impl {
    using Impl::_forward_has_default_args;  // protected in Module
  };
  static constexpr bool value =
      !std::is_same_v<decltype(&Probe::_forward_has_default_args), bool (torch::nn::Module::*)()>;
};

/// Reaches Module's protected default-argument hooks (the ones
/// FORWARD_HAS_DEFAULT_ARGS defines) of any module.
struct DefaultArgsAccess : torch::nn::Module {
  /// How many leading forward arguments have no default.
  static unsigned required(torch::nn::Module& m) {
    return (m.*&DefaultArgsAccess::_forward_num_required_args)();
  }
  /// The given leading arguments followed by the defaults of the others.
  static std::vector<torch::nn::AnyValue> populate(torch::nn::Module& m,
                                                   std::vector<torch::nn::AnyValue>&& given) {
    return (m.*&DefaultArgsAccess::_forward_populate_default_args)(std::move(given));
  }
};

}  // namespace detail

/// An FSDP unit around a module of type Impl: use it where the parent calls
/// the module (a member, or an entry of a Sequential). It re-registers the
/// wrapped module's parameters, buffers and children under their own names,
/// so named_parameters() and state dicts keep the original names, and its
/// forward has the wrapped forward's signature. See Note [FSDP and autograd].
///
/// Called with fewer arguments than the wrapped forward declares, it passes
/// the defaults the module declares with FORWARD_HAS_DEFAULT_ARGS (as
/// `lstm(x)` does for torch::nn::LSTM).
template <typename Impl, typename Sig = typename detail::ForwardSignature<Impl>::type,
          bool DefaultArgs = detail::ForwardHasDefaultArgs<Impl>::value>
class FullyShardedDataParallelImpl;

// C: the class that declares forward (Impl or a base, as BatchNormImplBase
// for BatchNorm1dImpl).
template <typename Impl, typename C, typename R, typename... Args>
class FullyShardedDataParallelImpl<Impl, R (C::*)(Args...), false>
    : public torch::nn::Module, public Unit, public detail::ModuleWrapper {
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
      : Module("FullyShardedDataParallel"), Unit(std::move(options)), module_(std::move(module)) {
    detail::check_module_given(module_.get());
    check_not_a_unit(*module_);
    detail::adopt_module_contents(*this, *module_);
    if (enabled) {
      init_unit(*this, module_.get());
    } else {
      deactivate(module_.get());
    }
  }

  /// Gathers the parameters, runs the wrapped forward, and arranges backward.
  R forward(Args... args) {
    if (!is_active()) return module_->forward(std::forward<Args>(args)...);
    if (checkpoints_activations()) check_checkpointable();
    pre_forward();
    {
      std::vector<at::Tensor> inputs;
      const bool all_found = (detail::input_tensors(args, inputs) && ... && true);
      record_forward_inputs(inputs, all_found);
    }
    // See Note [Mixed precision]: inputs in the compute dtype.
    const c10::optional<at::ScalarType> dtype = forward_input_dtype();
    const c10::optional<at::ScalarType> output_dtype = forward_output_dtype(
        casts_output_back() ? detail::first_floating_dtype(args...) : c10::nullopt);
    R out =
        checkpoints_activations()
            ? checkpointed_forward(
                  detail::cast_forward_arg<Args>(std::forward<Args>(args), dtype)...)
            : module_->forward(detail::cast_forward_arg<Args>(std::forward<Args>(args), dtype)...);
    if constexpr (!std::is_reference_v<R>) {
      if (output_dtype) {  // every floating-point tensor of the output, as FSDP1's hooks
        detail::for_each_tensor_arg(out, [&output_dtype](at::Tensor& t) {
          if (t.defined() && t.is_floating_point()) t = t.to(*output_dtype);
        });
      }
    }
    // See Note [FSDP and autograd]: backward starts at the output's tensors.
    std::vector<at::Tensor> tensors;
    const bool found = detail::output_tensors(out, tensors);
    post_forward(tensors, found ? nullptr : typeid(R).name());
    return out;
  }

  /// Prints the wrapped module inside (std::cout << *model names it; the
  /// children follow as LibTorch prints them).
  void pretty_print(std::ostream& stream) const override {
    stream << "fsdp::FullyShardedDataParallel<";
    module_->pretty_print(stream);
    stream << ">";
  }

  /// Sets training mode on the wrapper, the wrapped module and their children.
  void train(bool on = true) override {
    torch::nn::Module::train(on);
    module_->train(on);
  }

  /// Module::zero_grad, and the gradients the optimizer steps (this unit's
  /// shard or per-parameter views; nested units through the recursion).
  /// The default of set_to_none is LibTorch's (false in 1.13, true in 2.x).
  void zero_grad(bool set_to_none = kModuleZeroGradSetsToNone) override {
    // First: it waits for an optimizer still stepping this unit's shard
    // (ReducedGradHooks::before_zero_grad) before any .grad is cleared.
    zero_optim_grads(set_to_none);  // nothing for a pass-through
    torch::nn::Module::zero_grad(set_to_none);
  }

  /// What the unwrapped module's save() writes: full parameters. Under
  /// SummonFullParams no communication (rank 0 alone may save); outside it
  /// they are gathered, so torch::save(model, path) runs on every rank. See
  /// Note [Saving a unit].
  void save(torch::serialize::OutputArchive& archive) const override {
    if (is_active()) {
      save_unit(*this, archive);
    } else {
      torch::nn::Module::save(archive);
    }
  }

  /// Reads what the unwrapped module's save() wrote (torch::load(model,
  /// path) on every rank); each rank keeps its shard.
  void load(torch::serialize::InputArchive& archive) override {
    if (is_active()) {
      load_unit(*this, archive);
    } else {
      torch::nn::Module::load(archive);
    }
  }

  /// Module::to: buffers move; the units' parameters stay, and must already
  /// be on `device` in `dtype` (else an error naming the unit, nothing moved).
  void to(torch::Device device, torch::Dtype dtype, bool non_blocking = false) override {
    to_unit(*this, device, dtype, non_blocking);
  }
  /// See to(device, dtype).
  void to(torch::Dtype dtype, bool non_blocking = false) override {
    to_unit(*this, c10::nullopt, dtype, non_blocking);
  }
  /// See to(device, dtype).
  void to(torch::Device device, bool non_blocking = false) override {
    to_unit(*this, device, c10::nullopt, non_blocking);
  }

  /// Module::clone: refused, naming what works (Unit::refuse_clone).
  std::shared_ptr<torch::nn::Module> clone(
      const c10::optional<torch::Device>& = c10::nullopt) const override {
    refuse_clone(*this);
    return nullptr;  // not reached
  }

  /// What the optimizer steps: the flat shards of this unit and the units in
  /// it (`recurse` false: this unit's own; see Unit::flat_parameters). (Hides
  /// Module::parameters; named_parameters() keeps the original names.)
  std::vector<at::Tensor> parameters(bool recurse = true) const {
    return is_active() ? flat_parameters(recurse) : torch::nn::Module::parameters(recurse);
  }

  /// False for a pass-through wrapper made by fsdp::wrap() outside a scope.
  bool enabled() const { return is_active(); }

  /// The wrapped module.
  Impl& module() const { return *module_; }
  /// See detail::ModuleWrapper.
  torch::nn::Module& original_module() const override { return *module_; }

 private:
  // A Cloneable parent's clone() copies its children through clone_: a
  // unit's values cannot be copied so (Unit::refuse_clone).
  void clone_(torch::nn::Module&, const c10::optional<torch::Device>&) override {
    refuse_clone(*this);
  }

  // Whether activation_checkpoint() can take this forward's output apart.
  static constexpr bool kCheckpointable = detail::IsForwardOutput<R>::value;

  // Refuses a forward kCheckpointable is false for, before the forward
  // changes anything.
  void check_checkpointable() const {
    if constexpr (!kCheckpointable) refuse_activation_checkpointing(typeid(R).name());
  }

  // The wrapped forward under activation_checkpoint() (see
  // Unit::set_activation_checkpointing).
  template <typename... Given>
  R checkpointed_forward(Given&&... given) {
    if constexpr (kCheckpointable) {
      Impl* m = module_.get();
      return detail::call_checkpointed<R>([m](auto&&... a) -> R { return m->forward(a...); },
                                          detail::module_parameters(*m),
                                          std::forward<Given>(given)...);
    } else {
      check_checkpointable();
      return module_->forward(std::forward<Given>(given)...);  // not reached
    }
  }

  std::shared_ptr<Impl> module_;
};

/// A wrapper around a module whose forward has default arguments: also
/// callable with only the leading arguments.
template <typename Impl, typename C, typename R, typename... Args>
class FullyShardedDataParallelImpl<Impl, R (C::*)(Args...), true>
    : public FullyShardedDataParallelImpl<Impl, R (C::*)(Args...), false> {
  using Base = FullyShardedDataParallelImpl<Impl, R (C::*)(Args...), false>;

 public:
  using Base::Base;
  using Base::forward;

  /// The wrapped forward with the module's defaults for the missing arguments.
  template <typename... Given, typename = std::enable_if_t<(sizeof...(Given) < sizeof...(Args))>>
  R forward(Given&&... given) {
    const unsigned required = detail::DefaultArgsAccess::required(this->module());
    detail::check_forward_arity(this->module(), sizeof...(Given), required);
    std::vector<torch::nn::AnyValue> values;
    values.reserve(sizeof...(Args));
    push_given(values, std::index_sequence_for<Given...>{}, std::forward<Given>(given)...);
    values = detail::DefaultArgsAccess::populate(this->module(), std::move(values));
    return call_with(values, std::index_sequence_for<Args...>{});
  }

 private:
  template <size_t... I, typename... Given>
  static void push_given(std::vector<torch::nn::AnyValue>& values, std::index_sequence<I...>,
                         Given&&... given) {
    // As the declared types, which the defaults' AnyValues hold too.
    (values.emplace_back(
         std::decay_t<std::tuple_element_t<I, std::tuple<Args...>>>(std::forward<Given>(given))),
     ...);
  }
  template <size_t... I>
  R call_with(std::vector<torch::nn::AnyValue>& values, std::index_sequence<I...>) {
    return Base::forward(values[I].template get<std::decay_t<Args>>()...);
  }
};

/// Holder for FullyShardedDataParallelImpl, like torch::nn::Linear for LinearImpl:
/// `fsdp::FullyShardedDataParallel<torch::nn::LinearImpl> fc(torch::nn::Linear(4, 4));`
template <typename Impl>
class FullyShardedDataParallel
    : public torch::nn::ModuleHolder<FullyShardedDataParallelImpl<Impl>> {
 public:
  using torch::nn::ModuleHolder<FullyShardedDataParallelImpl<Impl>>::ModuleHolder;

  /// Calls forward, like ModuleHolder's operator(), also with a module's
  /// default arguments left out (whose overloaded forward ModuleHolder's
  /// return-type deduction cannot see).
  template <typename... A>
  decltype(auto) operator()(A&&... args) {
    return this->get()->forward(std::forward<A>(args)...);
  }
};

}  // namespace fsdp
