#pragma once

// Units made in place by fsdp::fully_shard: who owns them and how a module
// finds its unit. See Note [Units made in place].

#include <torch/nn/module.h>

#include <fsdp/runtime/options.h>
#include <fsdp/runtime/unit.h>

namespace fsdp::detail {

class UnitRuntime;

/// Makes `module` a unit in place, owned here for as long as `module` lives.
Unit& make_in_place_unit(torch::nn::Module& module, FSDPOptions options);

/// The unit made in place of `module`, or nullptr.
Unit* in_place_unit_of(const torch::nn::Module& module);

/// Frees the units whose module is gone (Note [Units made in place]).
void release_gone_in_place_units();

/// The outermost unit made in place whose module's tree holds `module`
/// (`module`'s own unit when none holds it).
UnitRuntime* outermost_in_place_unit(const torch::nn::Module& module);

}  // namespace fsdp::detail
