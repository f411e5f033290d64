#pragma once

#include <torch/nn/module.h>

#include <functional>

#include <fsdp/core/mixed_precision.h>

namespace fsdp {

/// Note [Deferred initialisation]
/// A model whose parameters and buffers are on the meta device (built with
/// torch::kMeta tensors, so no storage exists) is materialised unit by unit
/// as the units are made: the unit gives the meta parameters it manages real
/// CPU storage directly inside its unsharded flat buffer (and each meta
/// buffer its own), initialises them, then shards and frees the flat buffer
/// before the next unit is made. So a rank never holds more than the shards
/// made so far plus one unit in full. Initialising means, for each module the
/// unit manages that has meta parameters or buffers of its own (breadth
/// first from the unit's module, never inside nested units or ignored
/// modules): FSDPOptions::param_init_fn(module) when given, else
/// reset_parameters(module). Values therefore equal building the model
/// normally and then resetting every module, whenever each reset draws its
/// own values (e.g. reseeds, or fills constants); a reset that draws from the
/// global generator sees it in the order units are made (post-order), not in
/// construction order.

/// Resets a module's own parameters and buffers in place.
using ResetParametersFn = std::function<void(torch::nn::Module&)>;

/// Teaches reset_parameters() a module class: `fn` is used for modules of
/// `cls` (or derived from it). Later registrations win over earlier ones and
/// over the built-in torch::nn classes. Thread-safe.
void register_reset_parameters(ModuleClass cls, ResetParametersFn fn);

/// Registers Impl::reset_parameters() for modules of class Impl:
/// `fsdp::register_reset_parameters<MyLayerImpl>();`
template <typename Impl>
void register_reset_parameters() {
  register_reset_parameters(module_class<Impl>(), [](torch::nn::Module& m) {
    dynamic_cast<Impl&>(m).reset_parameters();
  });
}

/// True when reset_parameters() knows how to reset `module`: a registered
/// class, or a torch::nn class with a reset_parameters() (Linear, Bilinear,
/// Conv*, ConvTranspose*, Embedding, EmbeddingBag, LayerNorm, GroupNorm,
/// BatchNorm*, InstanceNorm*, RNN, LSTM, GRU, the RNN cells,
/// MultiheadAttention).
bool has_reset_parameters(const torch::nn::Module& module);

/// Resets `module`'s own parameters and buffers in place (no gradient is
/// recorded), with the registered function. Throws naming the module class
/// when none is known.
void reset_parameters(torch::nn::Module& module);

namespace detail {
/// Throws what reset_parameters() would for `module` when no reset is known.
void require_reset_parameters(const torch::nn::Module& module);
}  // namespace detail

}  // namespace fsdp
