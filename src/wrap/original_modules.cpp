// fsdp::original_modules: a model's modules as the unwrapped model has them.

#include <fsdp/wrap/wrapper_traits.h>

#include <vector>

namespace fsdp {

std::vector<torch::nn::Module*> original_modules(torch::nn::Module& model) {
  std::vector<torch::nn::Module*> out;
  // Through every layer: FullyShardedDataParallel<CheckpointWrapperImpl<X>>
  // stands for an X.
  for (const auto& m : model.modules(/*include_self=*/true)) {
    torch::nn::Module* inner = m.get();
    while (auto* w = dynamic_cast<detail::ModuleWrapper*>(inner)) inner = &w->original_module();
    out.push_back(inner);
  }
  return out;
}

}  // namespace fsdp
