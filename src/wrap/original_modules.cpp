// fsdp::original_modules: a model's modules as the unwrapped model has them.

#include <fsdp/wrap/wrapper_traits.h>

#include <vector>

namespace fsdp {

std::vector<torch::nn::Module*> original_modules(torch::nn::Module& model) {
  std::vector<torch::nn::Module*> out;
  for (const auto& m : model.modules(/*include_self=*/true)) {
    const auto* wrapper = dynamic_cast<const detail::ModuleWrapper*>(m.get());
    out.push_back(wrapper != nullptr ? &wrapper->original_module() : m.get());
  }
  return out;
}

}  // namespace fsdp
