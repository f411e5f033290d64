#pragma once

// What libfsdp's module wrappers (FSDP units, activation checkpointing)
// share: the wrapped forward's signature, the tensors of a forward's output,
// and adopting the wrapped module's contents under their own names.

#include <ATen/ATen.h>
#include <c10/util/Optional.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/sequential.h>

#include <cstddef>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace fsdp {

/// model.modules() as in the unwrapped model: each libfsdp wrapper (an FSDP
/// unit, a checkpoint wrapper) stands for the module it wraps. modules()
/// gives a BatchNorm2d made a unit as its FullyShardedDataParallel<
/// BatchNorm2dImpl>, which Module::as<T>() does not find (PyTorch's FSDP
/// lists both). Pre-order, `model` itself first.
std::vector<torch::nn::Module*> original_modules(torch::nn::Module& model);

namespace detail {

/// What every libfsdp module wrapper is besides a Module: it stands for the
/// module it wraps, whose contents it adopted (see original_modules()).
class ModuleWrapper {
 public:
  virtual ~ModuleWrapper() = default;
  /// The wrapped module.
  virtual torch::nn::Module& original_module() const = 0;
};

/// Registers `inner`'s direct parameters and buffers and its children on
/// `outer`, so a wrapper is transparent to names and state dicts.
void adopt_module_contents(torch::nn::Module& outer, torch::nn::Module& inner);
/// Refuses a null module with a one-line error naming the fix.
void check_module_given(const torch::nn::Module* module);
/// Refuses a forward call of `module` with fewer than `required` arguments.
void check_forward_arity(const torch::nn::Module& module, size_t given, size_t required);

/// The forward signature the wrapper exposes; deduced from Impl::forward.
template <typename Impl>
struct ForwardSignature {
  using type = decltype(&Impl::forward);
};
/// Whether a T may hold tensors that for_each_tensor_arg() reaches: a
/// Tensor, or a c10::optional, std::vector, std::tuple or std::pair of such
/// (nested). Tuple elements that are references or const are not reached
/// (a cast or a replacement would write through them).
template <typename T>
struct MayHoldTensor : std::is_same<T, at::Tensor> {};
template <typename T>
struct MayHoldTensor<c10::optional<T>> : MayHoldTensor<T> {};
template <typename T>
struct MayHoldTensor<std::vector<T>> : MayHoldTensor<T> {};
template <typename... T>
struct MayHoldTensor<std::tuple<T...>> : std::bool_constant<(MayHoldTensor<T>::value || ...)> {};
template <typename A, typename B>
struct MayHoldTensor<std::pair<A, B>>
    : std::bool_constant<MayHoldTensor<A>::value || MayHoldTensor<B>::value> {};

template <typename T>
struct IsOptional : std::false_type {};
template <typename T>
struct IsOptional<c10::optional<T>> : std::true_type {};
template <typename T>
struct IsVector : std::false_type {};
template <typename T>
struct IsVector<std::vector<T>> : std::true_type {};

template <typename T, typename F>
void for_each_tensor_arg(T& arg, F&& f);

/// for_each_tensor_arg() on the elements of tuple or pair `arg` that are
/// MayHoldTensor (no reference, no const element).
template <typename T, typename F, size_t... I>
void for_each_tuple_element(T& arg, F& f, std::index_sequence<I...>) {
  using D = std::remove_const_t<T>;
  auto visit = [&f](auto& e, auto held) {
    if constexpr (decltype(held)::value) for_each_tensor_arg(e, f);
  };
  (visit(std::get<I>(arg), MayHoldTensor<std::tuple_element_t<I, D>>{}), ...);
}

/// Calls `f` on each tensor `arg` holds (MayHoldTensor), depth first in
/// declaration order; nothing for other types.
template <typename T, typename F>
void for_each_tensor_arg(T& arg, F&& f) {
  using D = std::remove_const_t<T>;
  if constexpr (std::is_same_v<D, at::Tensor>) {
    f(arg);
  } else if constexpr (!MayHoldTensor<D>::value) {
    return;
  } else if constexpr (IsOptional<D>::value) {
    if (arg.has_value()) for_each_tensor_arg(*arg, f);
  } else if constexpr (IsVector<D>::value) {
    for (auto& e : arg) for_each_tensor_arg(e, f);
  } else {
    for_each_tuple_element(arg, f, std::make_index_sequence<std::tuple_size_v<D>>{});
  }
}

template <typename T>
struct OwnedArg {
  using type = T;
};
/// T decayed, as a value to keep: within its tuples and pairs (inside
/// optionals and vectors too), the elements that may hold tensors lose their
/// reference and const, so that a copy owns the tensors the caller's
/// references pointed to; other elements stay as declared (a const Config&
/// is not copied). view_owned() makes the declared type from it again.
template <typename T>
using Owned = typename OwnedArg<std::decay_t<T>>::type;
template <typename E>
using OwnedElement = std::conditional_t<MayHoldTensor<Owned<E>>::value, Owned<E>, E>;
template <typename T>
struct OwnedArg<c10::optional<T>> {
  using type = c10::optional<Owned<T>>;
};
template <typename T>
struct OwnedArg<std::vector<T>> {
  using type = std::vector<Owned<T>>;
};
template <typename... T>
struct OwnedArg<std::tuple<T...>> {
  using type = std::tuple<OwnedElement<T>...>;
};
template <typename A, typename B>
struct OwnedArg<std::pair<A, B>> {
  using type = std::pair<OwnedElement<A>, OwnedElement<B>>;
};

template <typename T>
Owned<T> to_owned(T&& arg);

template <typename O, typename T, size_t... I>
O to_owned_tuple(T& arg, std::index_sequence<I...>) {
  // An element Owned keeps as declared (a reference) refers to the caller's.
  auto element = [](auto& e, auto kept) -> decltype(auto) {
    if constexpr (decltype(kept)::value) {
      return (e);
    } else {
      return to_owned(e);
    }
  };
  return O(element(std::get<I>(arg),
                   std::bool_constant<std::is_reference_v<std::tuple_element_t<I, O>>>{})...);
}

/// The Owned copy of `arg`.
template <typename T>
Owned<T> to_owned(T&& arg) {
  using D = std::decay_t<T>;
  using O = Owned<T>;
  if constexpr (std::is_same_v<D, O>) {
    return O(std::forward<T>(arg));
  } else if constexpr (IsOptional<D>::value) {
    O out;
    if (arg.has_value()) out.emplace(to_owned(*arg));
    return out;
  } else if constexpr (IsVector<D>::value) {
    O out;
    out.reserve(arg.size());
    for (auto& e : arg) out.push_back(to_owned(e));
    return out;
  } else {
    return to_owned_tuple<O>(arg, std::make_index_sequence<std::tuple_size_v<D>>{});
  }
}

template <typename Arg>
decltype(auto) view_owned(Owned<Arg>& o);

/// An element of declared type E made from `e`, its Owned counterpart.
template <typename E, typename O>
decltype(auto) view_owned_element(O& e) {
  if constexpr (std::is_same_v<std::decay_t<E>, std::decay_t<O>>) {
    return (e);
  } else {
    static_assert(!std::is_reference_v<E>,
                  "a reference to a tuple, pair, vector or optional of tensor references "
                  "within a tuple cannot be passed on from a copy: take it by value");
    return view_owned<E>(e);
  }
}

template <typename D, typename O, size_t... I>
D view_owned_tuple(O& o, std::index_sequence<I...>) {
  return D(view_owned_element<std::tuple_element_t<I, D>>(std::get<I>(o))...);
}

/// An argument of the declared type Arg made from `o`, the Owned<Arg> copy
/// the caller keeps alive: `o` itself where the two types are the same,
/// else a value whose references refer into `o`.
template <typename Arg>
decltype(auto) view_owned(Owned<Arg>& o) {
  using D = std::decay_t<Arg>;
  if constexpr (std::is_same_v<D, Owned<Arg>>) {
    return (o);
  } else if constexpr (IsOptional<D>::value) {
    D out;
    if (o.has_value()) out.emplace(view_owned<typename D::value_type>(*o));
    return out;
  } else if constexpr (IsVector<D>::value) {
    D out;
    out.reserve(o.size());
    for (auto& e : o) out.push_back(view_owned<typename D::value_type>(e));
    return out;
  } else {
    return view_owned_tuple<D>(o, std::make_index_sequence<std::tuple_size_v<D>>{});
  }
}

/// Whether all the tensors of a T are found by for_each_tensor_arg(): T
/// holds none (arithmetic, enum, string) or is one of MayHoldTensor's
/// shapes made of such. False for other types, which may hide tensors (a
/// struct of the user's).
template <typename T>
struct TensorsFindable
    : std::bool_constant<std::is_arithmetic_v<T> || std::is_enum_v<T> ||
                         std::is_same_v<T, std::string> || std::is_same_v<T, at::Tensor>> {};
template <typename T>
struct TensorsFindable<c10::optional<T>> : TensorsFindable<T> {};
template <typename T>
struct TensorsFindable<std::vector<T>> : TensorsFindable<T> {};
template <typename... T>
struct TensorsFindable<std::tuple<T...>> : std::bool_constant<(TensorsFindable<T>::value && ...)> {
};
template <typename A, typename B>
struct TensorsFindable<std::pair<A, B>>
    : std::bool_constant<TensorsFindable<A>::value && TensorsFindable<B>::value> {};

/// Whether a forward's output type is a Tensor, a std::vector of Tensors, or
/// a std::tuple / std::pair of these (nested; no reference or const
/// element): the outputs whose tensors backward can start from.
template <typename T>
struct IsForwardOutput : std::bool_constant<std::is_same_v<T, at::Tensor> ||
                                            std::is_same_v<T, std::vector<at::Tensor>>> {};
template <typename... T>
struct IsForwardOutput<std::tuple<T...>> : std::bool_constant<(IsForwardOutput<T>::value && ...)> {
};
template <typename A, typename B>
struct IsForwardOutput<std::pair<A, B>>
    : std::bool_constant<IsForwardOutput<A>::value && IsForwardOutput<B>::value> {};

/// Appends the Tensors of a forward's output to `into`, in
/// for_each_tensor_arg()'s order. Returns false for a type that is not an
/// IsForwardOutput, whose tensors cannot be found.
template <typename T>
bool output_tensors(const T& out, std::vector<at::Tensor>& into) {
  if constexpr (IsForwardOutput<std::decay_t<T>>::value) {
    for_each_tensor_arg(out, [&into](const at::Tensor& t) { into.push_back(t); });
    return true;
  } else {
    return false;
  }
}

/// Appends the Tensors of a forward argument to `into`, in
/// for_each_tensor_arg()'s order. Returns TensorsFindable: false where the
/// argument may hide tensors.
template <typename T>
bool input_tensors(const T& arg, std::vector<at::Tensor>& into) {
  for_each_tensor_arg(arg, [&into](const at::Tensor& t) { into.push_back(t); });
  return TensorsFindable<std::decay_t<T>>::value;
}

/// Replaces the tensors `arg` holds, in for_each_tensor_arg()'s order, by
/// flat[k], flat[k + 1], ...; advances k.
template <typename T>
void replace_tensors(T& arg, const std::vector<at::Tensor>& flat, size_t& k) {
  for_each_tensor_arg(arg, [&flat, &k](at::Tensor& t) { t = flat[k++]; });
}

/// Sequential's forward is a template: its wrapper takes and returns a Tensor.
template <>
struct ForwardSignature<torch::nn::SequentialImpl> {
  using type = at::Tensor (torch::nn::SequentialImpl::*)(at::Tensor);
};

}  // namespace detail
}  // namespace fsdp
