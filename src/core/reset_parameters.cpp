#include <fsdp/core/reset_parameters.h>

#include <c10/util/Exception.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/nn/functional.h>
#include <torch/nn/modules.h>

#include <mutex>
#include <utility>
#include <vector>

#include "detail/error.h"

namespace fsdp {

namespace {

struct Entry {
  ModuleClass cls;
  ResetParametersFn fn;
};

template <typename Impl>
Entry builtin() {
  return Entry{module_class<Impl>(),
               [](torch::nn::Module& m) { dynamic_cast<Impl&>(m).reset_parameters(); }};
}

std::vector<Entry> builtins() {
  namespace nn = torch::nn;
  std::vector<Entry> out = {
      builtin<nn::LinearImpl>(),
      builtin<nn::BilinearImpl>(),
      builtin<nn::Conv1dImpl>(),
      builtin<nn::Conv2dImpl>(),
      builtin<nn::Conv3dImpl>(),
      builtin<nn::ConvTranspose1dImpl>(),
      builtin<nn::ConvTranspose2dImpl>(),
      builtin<nn::ConvTranspose3dImpl>(),
      builtin<nn::EmbeddingImpl>(),
      builtin<nn::EmbeddingBagImpl>(),
      builtin<nn::LayerNormImpl>(),
      builtin<nn::GroupNormImpl>(),
      builtin<nn::BatchNorm1dImpl>(),
      builtin<nn::BatchNorm2dImpl>(),
      builtin<nn::BatchNorm3dImpl>(),
      builtin<nn::InstanceNorm1dImpl>(),
      builtin<nn::InstanceNorm2dImpl>(),
      builtin<nn::InstanceNorm3dImpl>(),
      builtin<nn::RNNImpl>(),
      builtin<nn::LSTMImpl>(),
      builtin<nn::GRUImpl>(),
      builtin<nn::RNNCellImpl>(),
      builtin<nn::LSTMCellImpl>(),
      builtin<nn::GRUCellImpl>(),
  };
  out.push_back(Entry{module_class<nn::MultiheadAttentionImpl>(), [](torch::nn::Module& m) {
                        dynamic_cast<nn::MultiheadAttentionImpl&>(m)._reset_parameters();
                      }});
  return out;
}

// Searched from the back: user registrations come after the built-ins.
struct Registry {
  std::mutex mutex;
  std::vector<Entry> entries = builtins();
};

Registry& registry() {
  static Registry r;
  return r;
}

const ResetParametersFn* find(const torch::nn::Module& module, Registry& r) {
  for (auto it = r.entries.rbegin(); it != r.entries.rend(); ++it) {
    if (it->cls.matches(module)) return &it->fn;
  }
  return nullptr;
}

}  // namespace

void register_reset_parameters(ModuleClass cls, ResetParametersFn fn) {
  FSDP_CHECK(fn, -1, "register_reset_parameters " + cls.name,
             "expected a callable reset function, got an empty one. Pass a function that "
             "resets a module of that class in place");
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.entries.push_back(Entry{std::move(cls), std::move(fn)});
}

bool has_reset_parameters(const torch::nn::Module& module) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  return find(module, r) != nullptr;
}

void detail::require_reset_parameters(const torch::nn::Module& module) {
  FSDP_CHECK(has_reset_parameters(module), -1, "reset_parameters",
             "expected a known way to reset a module of class ", module.name(),
             ", found none: it is no torch::nn class with reset_parameters() and none was "
             "registered. Call fsdp::register_reset_parameters<YourImpl>() (or pass a function), "
             "or give FSDPOptions::param_init_fn.");
}

void reset_parameters(torch::nn::Module& module) {
  ResetParametersFn fn;
  {
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mutex);
    if (const ResetParametersFn* found = find(module, r)) fn = *found;
  }
  if (!fn) detail::require_reset_parameters(module);
  torch::NoGradGuard no_grad;
  fn(module);
}

}  // namespace fsdp
