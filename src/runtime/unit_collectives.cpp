#include "runtime/unit_collectives.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <utility>

#include "comm/work_state.h"
#include "core/device_streams.h"

// Note [A unit's collectives]
// Every collective a unit issues for its parameters and gradients is made
// here and nowhere else: the all-gather of the shards into the unsharded
// buffer (forward, backward, prefetch), the gather of a shard-sized state
// for checkpoints, and the gradient reduction (all-reduce for NO_SHARD,
// reduce-scatter, and the all-reduce across nodes chained to it under hybrid
// sharding). The FlatParameter only says where the bytes go (its layout and
// storage: begin_unshard() allocates and returns the all-gather input,
// end_unshard() marks the buffer filled); UnitRuntime decides when. A device
// other than the CPU changes what happens here (streams, events), not the
// FlatParameter or the hooks: the all-gather is issued on the copy-in stream
// and waited for by the compute stream, so the host runs ahead of an NCCL
// all-gather, and its buffer is handed back after the copy-in stream waited
// for the kernels that read it (Note [Copy-in on a stream of its own]).

namespace fsdp::detail {

Work all_gather_unit(FlatParameter& flat, bool copy_in_waits_for_current) {
  if (flat.keeps_unsharded()) {
    // NO_SHARD copies its shard in (offload, low precision) on the current
    // stream: no collective for the compute stream to wait for.
    (void)flat.begin_unshard();
    return Work();
  }
  const SideStreamScope copy_in(flat.unsharded().device(), SideStream::kCopyIn,
                                copy_in_waits_for_current);
  const at::Tensor input = flat.begin_unshard();
  return flat.group().all_gather_into_tensor(flat.unsharded(), input);
}

void wait_all_gather(FlatParameter& flat, Work work) {
  // On a GPU the compute stream waits, not the host (Note [A unit's collectives]).
  work.block_current_stream();
  flat.end_unshard();
}

at::Tensor gather_full(const FlatParameter& flat, const at::Tensor& local) {
  if (flat.keeps_unsharded()) return local;
  at::Tensor full = at::empty({flat.padded_numel()}, local.options());
  const Work work = flat.group().all_gather_into_tensor(full, local.contiguous());
  // The stream wait first: over NCCL it is what hands c10d's hold on the
  // tensors back (Note [NCCL collectives and their Work]). A host wait alone
  // left each unit's gather to c10d's watchdog, so summoning a model with
  // offload_to_cpu at world 1 held every unit's buffers at once on an H200.
  work.block_current_stream();
  work.wait();
  return full;
}

namespace {

// Note [Averaging float16 gradients]
// An average summed first overflows float16 (65504) where its terms do not:
// two ranks' gradients of 40000 under a GradScaler's scale made inf, and the
// scaler skipped the step. So a float16 gradient is divided by the ranks
// first, on the stream that computed it, and the collective sums, as NCCL's
// average does for floating types (every route, Gloo, the direct links,
// shared memory, gets the same terms). Other dtypes keep kAvg.
ReduceOp averaging(const at::Tensor& grad, int ranks) {
  if (grad.scalar_type() != at::kHalf || ranks <= 1) return ReduceOp::kAvg;
  grad.div_(ranks);
  return ReduceOp::kSum;
}

// Note [A gradient divide factor]
// FSDP2's set_gradient_divide_factor: the reduction yields the ranks' sum
// divided by the factor instead of their average (a loss summed over the
// global batch, or scaled by a count of the user's). The gradient is divided
// before the collectives, which then sum: NCCL's PreMulSum in FSDP2, one
// kernel here on the stream that computed it; under hybrid sharding the
// all-reduce across the nodes sums too. Dividing first also keeps a float16
// sum from overflowing (Note [Averaging float16 gradients]).
ReduceOp dividing(const at::Tensor& grad, double factor) {
  grad.div_(factor);
  return ReduceOp::kSum;
}

// Hybrid sharding's second collective: `shard`, the node's reduced
// gradient, plus what was kept within the node (float32, or undefined),
// all-reduced across `replicate`.
Work all_reduce_across_nodes(ProcessGroup& replicate, const at::Tensor& shard,
                             const at::Tensor& within_node, std::optional<double> factor) {
  const SideStreamScope ready(shard.device(), SideStream::kChained, /*wait_for_current=*/false);
  // Divided by the factor before the reduce-scatter, or here by averaging()
  // where float16 (Note [Averaging float16 gradients]): what was kept is
  // divided alike before it is added.
  const int replicas = replicate.size();
  const ReduceOp op = factor ? ReduceOp::kSum : averaging(shard, replicas);
  const bool divided_here = !factor && op == ReduceOp::kSum;
  if (within_node.defined()) shard.add_(divided_here ? within_node / replicas : within_node);
  return replicate.all_reduce(shard, op);
}

}  // namespace

GradReduction reduce_unit_grad(const FlatParameter& flat, const at::Tensor& flat_grad,
                               const GradReductionOptions& options, const std::string& label) {
  ProcessGroup& group = flat.group();
  const std::optional<double> factor = options.divide_factor;
  // Note [Averaging float16 gradients], [A gradient divide factor].
  const ReduceOp op = factor ? dividing(flat_grad, *factor) : averaging(flat_grad, group.size());
  if (flat.keeps_unsharded()) return {flat_grad, group.all_reduce(flat_grad, op)};
  at::Tensor shard = at::empty({flat.shard().numel()}, flat_grad.options());
  Work work = group.reduce_scatter_tensor(shard, flat_grad, op);
  const std::shared_ptr<ProcessGroup>& replicate = options.replicate;
  if (replicate && replicate->size() > 1) {
    // See Note [Hybrid sharding]: the node's average, then the job's.
    // Issued by the thread that saw the reduce-scatter end, whose current
    // stream is the device's default one: NCCL would make the all-reduce
    // wait for all the compute queued there since. Its input is ready, so it
    // is issued from a stream with nothing queued.
    // `within_node` was last written on the compute stream before the
    // reduce-scatter was issued, which waited for it there: once the
    // reduce-scatter ended, so had that write. The chain keeps it alive
    // until the all-reduce ended (the add runs on the chained stream).
    const at::Tensor within_node = options.within_node;
    work = chain_work(work,
                      [replicate, shard, within_node, factor] {
                        return all_reduce_across_nodes(*replicate, shard, within_node, factor);
                      },
                      "reduce_scatter then all_reduce across nodes (" + label + ")",
                      {shard, within_node});
  }
  return {shard, std::move(work)};
}

}  // namespace fsdp::detail
