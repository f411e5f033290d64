#include <fsdp/wrap/sequential.h>

#include <c10/util/Exception.h>

#include <fsdp/wrap/fully_sharded.h>

#include <functional>
#include <string>

#include "detail/error.h"
#include "wrap/sequential_entry.h"

namespace fsdp {

namespace detail {
/// Registers `inner`'s direct parameters and buffers and its children on
/// `outer`, so a wrapper is transparent to names and state dicts.
void adopt_module_contents(torch::nn::Module& outer, torch::nn::Module& inner) {
  for (const auto& p : inner.named_parameters(/*recurse=*/false)) {
    outer.register_parameter(p.key(), p.value(), p.value().requires_grad());
  }
  for (const auto& b : inner.named_buffers(/*recurse=*/false))
    outer.register_buffer(b.key(), b.value());
  for (const auto& c : inner.named_children()) outer.register_module(c.key(), c.value());
}

void check_module_given(const torch::nn::Module* module) {
  FSDP_CHECK(module != nullptr, -1, "wrap",
             "cannot wrap a null module. Pass the module holder or shared_ptr of a built module");
}

void check_forward_arity(const torch::nn::Module& module, size_t given, size_t required) {
  FSDP_CHECK(given >= required, -1, module.name(), "expected at least ", required,
             " forward arguments, got ", given, ". The others have no default. Pass them");
}
}  // namespace detail

AnyUnitImpl::AnyUnitImpl(torch::nn::AnyModule module, FSDPOptions options)
    : Module("FullyShardedDataParallel"), Unit(std::move(options)), module_(std::move(module)) {
  FSDP_CHECK(!module_.is_empty(), -1, "wrap",
             "cannot wrap an empty AnyModule. Pass one that "
             "holds a module");
  check_not_a_unit(*module_.ptr());
  detail::adopt_module_contents(*this, *module_.ptr());
  init_unit(*this, module_.ptr().get());
}

void AnyUnitImpl::train(bool on) {
  torch::nn::Module::train(on);
  module_.ptr()->train(on);
}

void AnyUnitImpl::pretty_print(std::ostream& stream) const {
  stream << "fsdp::AnyUnit<";
  module_.ptr()->pretty_print(stream);
  stream << ">";
}

void AnyUnitImpl::zero_grad(bool set_to_none) {
  zero_optim_grads(set_to_none);  // first, as FullyShardedDataParallelImpl::zero_grad
  torch::nn::Module::zero_grad(set_to_none);
}

void AnyUnitImpl::save(torch::serialize::OutputArchive& archive) const {
  save_unit(*this, archive);
}

void AnyUnitImpl::load(torch::serialize::InputArchive& archive) { load_unit(*this, archive); }

void AnyUnitImpl::to(torch::Device device, torch::Dtype dtype, bool non_blocking) {
  to_unit(*this, device, dtype, non_blocking);
}

void AnyUnitImpl::to(torch::Dtype dtype, bool non_blocking) {
  to_unit(*this, c10::nullopt, dtype, non_blocking);
}

void AnyUnitImpl::to(torch::Device device, bool non_blocking) {
  to_unit(*this, device, c10::nullopt, non_blocking);
}

std::shared_ptr<torch::nn::Module> AnyUnitImpl::clone(const c10::optional<torch::Device>&) const {
  refuse_clone(*this);
}

void AnyUnitImpl::clone_(torch::nn::Module&, const c10::optional<torch::Device>&) {
  refuse_clone(*this);
}

at::Tensor AnyUnitImpl::forward(at::Tensor input) {
  pre_forward();
  record_forward_inputs({input}, /*all_found=*/true);
  // See Note [Mixed precision]: inputs in the compute dtype.
  const c10::optional<at::ScalarType> input_dtype =
      input.defined() && input.is_floating_point()
          ? c10::optional<at::ScalarType>(input.scalar_type())
          : c10::nullopt;
  at::Tensor x = detail::cast_forward_arg<at::Tensor>(std::move(input), forward_input_dtype());
  at::Tensor out;
  if (checkpoints_activations()) {
    torch::nn::AnyModule& m = module_;
    out = detail::call_checkpointed<at::Tensor>([&m](at::Tensor& a) { return m.forward(a); },
                                                detail::module_parameters(*m.ptr()), std::move(x));
  } else {
    out = module_.forward(std::move(x));
  }
  const c10::optional<at::ScalarType> output_dtype = forward_output_dtype(input_dtype);
  if (output_dtype && out.defined() && out.is_floating_point()) out = out.to(*output_dtype);
  post_forward({out});
  return out;
}

namespace detail {
void replace_sequential_entry(
    torch::nn::Sequential& seq, size_t index, const char* where,
    const std::function<torch::nn::AnyModule(torch::nn::AnyModule)>& make) {
  FSDP_CHECK(index < seq->size(), -1, where, "expected an entry index below ", seq->size(),
             " (the Sequential's size), got ", index, ". Pass an existing entry");
  auto it = seq->begin() + static_cast<std::ptrdiff_t>(index);
  // The child registered for this entry, found by identity: a Sequential
  // subclass may register other children before its entries.
  std::string name;
  for (const auto& child : seq->named_children()) {
    if (child.value().get() == it->ptr().get()) name = child.key();
  }
  FSDP_CHECK(!name.empty(), -1, where, "entry ", index,
             " of the Sequential is not one of its registered children, so it cannot be wrapped "
             "in place. Register it with push_back, or wrap it by hand");
  torch::nn::AnyModule replacement = make(*it);
  *it = replacement;                             // what Sequential::forward calls
  seq->replace_module(name, replacement.ptr());  // what children() and parameters() see
}
}  // namespace detail

AnyUnit wrap_sequential_entry(torch::nn::Sequential& seq, size_t index, FSDPOptions options) {
  AnyUnit unit{nullptr};
  detail::replace_sequential_entry(seq, index, "wrap_sequential_entry",
                                   [&](torch::nn::AnyModule entry) {
                                     unit = AnyUnit(std::move(entry), std::move(options));
                                     return torch::nn::AnyModule(unit);
                                   });
  return unit;
}

}  // namespace fsdp
