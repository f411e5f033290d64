#pragma once

// A unit's collectives, in one stateless file (as FSDP2's _fsdp_collectives):
// the FlatParameter holds the layout and the storage, UnitRuntime decides
// when, and these functions move the bytes. See Note [A unit's collectives]
// in unit_collectives.cpp.

#include <ATen/core/Tensor.h>

#include <memory>
#include <optional>
#include <string>

#include <fsdp/comm/process_group.h>

#include "core/flat_parameter.h"

namespace fsdp::detail {

/// kSharded -> kUnsharding: allocates `flat`'s unsharded buffer and starts
/// the all-gather of every rank's shard into it, on a GPU on the copy-in
/// stream, made to wait for the current stream first where
/// `copy_in_waits_for_current` (Note [Copy-in on a stream of its own]). Pass
/// the Work to wait_all_gather(). NO_SHARD gathers nothing (its copy runs on
/// the current stream): `flat` ends kUnsharded and the Work is empty.
Work all_gather_unit(FlatParameter& flat, bool copy_in_waits_for_current);

/// kUnsharding -> kUnsharded: waits for `work` (from all_gather_unit).
void wait_all_gather(FlatParameter& flat, Work work);

/// The padded unsharded buffer of a shard-sized tensor `local` (a state,
/// the shard itself), gathered now from every rank of `flat`'s group;
/// `local` itself where `flat` keeps everything unsharded (NO_SHARD).
at::Tensor gather_full(const FlatParameter& flat, const at::Tensor& local);

/// A gradient reduction in flight: `shard` holds the result once `work`
/// completes (and keeps the inputs alive until then).
struct GradReduction {
  at::Tensor shard;  ///< this rank's shard of the averaged gradient
  Work work;         ///< the pending collective(s)
};

/// How far and by what a unit's gradient is reduced.
struct GradReductionOptions {
  /// Hybrid sharding's group across the nodes (the shard's replicas), or
  /// null: no all-reduce after the reduce-scatter (Note [Hybrid sharding]).
  std::shared_ptr<ProcessGroup> replicate;
  /// What earlier backwards reduce-scattered without that all-reduce, added
  /// to the shard before it; undefined: none (Note [Accumulating within the
  /// node]).
  at::Tensor within_node;
  /// Unit::set_gradient_divide_factor: the ranks' sum divided by this
  /// instead of their average; nullopt: the average.
  std::optional<double> divide_factor;
};

/// Starts averaging `flat_grad` (padded_numel() elements, padding zeroed)
/// over the ranks: an all-reduce in place for NO_SHARD, else a reduce-scatter
/// into a new shard, followed by an all-reduce of that shard across
/// `options.replicate` where given; `label` names the unit in the chained
/// Work's description.
GradReduction reduce_unit_grad(const FlatParameter& flat, const at::Tensor& flat_grad,
                               const GradReductionOptions& options, const std::string& label);

}  // namespace fsdp::detail
