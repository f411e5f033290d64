#include <fsdp/core/mixed_precision.h>

#include <torch/nn/modules/batchnorm.h>

namespace fsdp {

std::vector<ModuleClass> default_module_classes_to_ignore() {
  // PyTorch's _BatchNorm: running statistics in low precision lose too much.
  return {module_class<torch::nn::BatchNorm1dImpl>(), module_class<torch::nn::BatchNorm2dImpl>(),
          module_class<torch::nn::BatchNorm3dImpl>()};
}

namespace {
std::string dtype_name(const c10::optional<at::ScalarType>& t) {
  return t ? c10::toString(*t) : "-";
}
}  // namespace

std::string to_string(const MixedPrecision& mp) {
  return "MixedPrecision(param_dtype=" + dtype_name(mp.param_dtype()) +
         ", reduce_dtype=" + dtype_name(mp.reduce_dtype()) +
         ", buffer_dtype=" + dtype_name(mp.buffer_dtype()) +
         ", output_dtype=" + dtype_name(mp.output_dtype()) + ")";
}

}  // namespace fsdp
