#pragma once

// What libfsdp's module wrappers (FSDP units, activation checkpointing)
// share: the wrapped forward's signature, the tensors of a forward's output,
// and adopting the wrapped module's contents under their own names.

#include <ATen/ATen.h>
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

/// Appends the Tensors of a forward argument to `into`: what
/// output_tensors() lists, and a c10::optional<at::Tensor> that holds one.
/// Arithmetic, enum and string arguments hold none. Returns false for any
/// other type, which may hide tensors (a struct of the user's).
template <typename T>
bool input_tensors(const T& arg, std::vector<at::Tensor>& into) {
  using D = std::decay_t<T>;
  if constexpr (std::is_arithmetic_v<D> || std::is_enum_v<D> || std::is_same_v<D, std::string>) {
    return true;
  } else if constexpr (std::is_same_v<D, c10::optional<at::Tensor>>) {
    if (arg.has_value()) into.push_back(*arg);
    return true;
  } else {
    return output_tensors(arg, into);
  }
}

/// Sequential's forward is a template: its wrapper takes and returns a Tensor.
template <>
struct ForwardSignature<torch::nn::SequentialImpl> {
  using type = at::Tensor (torch::nn::SequentialImpl::*)(at::Tensor);
};

/// Whether output_tensors() can list the tensors of a T.
template <typename T>
struct IsForwardOutput
    : std::integral_constant<bool, std::is_same_v<T, at::Tensor> || IsTensorVector<T>::value> {};
template <typename... T>
struct IsForwardOutput<std::tuple<T...>>
    : std::integral_constant<bool, (IsForwardOutput<std::decay_t<T>>::value && ...)> {};
template <typename A, typename B>
struct IsForwardOutput<std::pair<A, B>>
    : std::integral_constant<bool, IsForwardOutput<std::decay_t<A>>::value &&
                                       IsForwardOutput<std::decay_t<B>>::value> {};

/// Replaces the tensors of `out`, in output_tensors()'s order, by
/// flat[k], flat[k + 1], ...; advances k.
template <typename T>
void replace_output_tensors(T& out, const std::vector<at::Tensor>& flat, size_t& k) {
  using D = std::decay_t<T>;
  if constexpr (std::is_same_v<D, at::Tensor>) {
    out = flat[k++];
  } else if constexpr (IsTensorVector<D>::value) {
    for (at::Tensor& t : out) t = flat[k++];
  } else if constexpr (IsTuple<D>::value) {
    std::apply([&flat, &k](auto&... e) { (replace_output_tensors(e, flat, k), ...); }, out);
  }
}

}  // namespace detail
}  // namespace fsdp
