#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <utility>
#include <vector>

#include <fsdp/comm/work.h>

#include "core/device_streams.h"
#include "runtime/exec_order.h"

namespace fsdp::detail {

class UnitRuntime;

// The root's state (see Note [Unit, runtime and root]), made at the root's
// first forward: every unit of its tree, the first iteration's forward order,
// this iteration's reduction order and the end-of-backward callback.
class RootState {
 public:
  /// Makes `root` the root of every unit in its tree.
  explicit RootState(UnitRuntime& root);
  /// Hands back the held memory (Note [Copy-in on a stream of its own]):
  /// kernels queued before may still read it.
  ~RootState();
  RootState(const RootState&) = delete;
  RootState& operator=(const RootState&) = delete;

  UnitRuntime& root() const { return root_; }
  /// Every unit of the tree, pre-order.
  const std::vector<UnitRuntime*>& units() const { return units_; }
  /// See Note [Forward order].
  ExecOrder& exec_order() const { return *exec_order_; }

  /// The root's forward starts: forward positions count from 0 again, and
  /// what a backward that stopped part-way left (an error in a hook: no
  /// end_of_backward) is dropped.
  void begin_forward();
  /// The next unit forward of this iteration (see join_reduction_order).
  size_t next_forward_position() { return forward_positions_++; }
  /// Queues end_of_backward() with autograd's engine, once per backward.
  void queue_end_of_backward();
  /// `unit`'s forward this iteration can bring gradients: it joins the
  /// reduction order (see Note [Reduction order]).
  void join_reduction_order(UnitRuntime& unit);
  bool in_reduction_order(const UnitRuntime& unit) const;
  /// `unit` reduces its gradient in this backward: false where it gives no
  /// parameter of the unit a gradient on any rank (Note [Backward with
  /// respect to inputs]).
  bool reduces_in_backward(const UnitRuntime& unit) const;
  /// Launches the reductions whose turn it is (see Note [Reduction order]).
  void launch_ready_reductions();
  /// Counts a reduction just launched; waits for the oldest while more than
  /// kMaxReductionsInFlight are unfinished (Note [Reductions in flight]).
  void limit_reductions_in_flight(const Work& work);

  /// See Note [Reductions in flight].
  static constexpr size_t kMaxReductionsInFlight = 2;

  /// `unit` queued the copy of its reduced shard to host memory
  /// (copy_out_early): the shards on the GPU whose copies have run, in the
  /// order queued, are let go (Note [Gradients to host memory]).
  void release_copied_out(UnitRuntime& unit);

  /// Note [A model's units outlive it]: `unit`, one of this root's, is
  /// destroyed; it is left out from now on.
  void forget(const UnitRuntime& unit);
  /// The root is destroyed: each of its other units is orphaned.
  void orphan_units();
  /// Whether the root is a unit made in place whose module is gone.
  bool module_gone() const;

  // Wrapper units (Note [The first unit of backward stays gathered]).
  /// `unit` ended a forward that backward will reach and stays gathered; the
  /// unit kept before it, whose forward was not the last after all, reshards.
  void keep_for_backward(UnitRuntime& unit);
  /// The kept unit, if any, reshards: a unit's forward begins.
  void release_kept();
  /// `unit`'s backward began: it is no longer kept (it reshards once its
  /// gradient is reduced, as every unit does).
  void forget_kept(const UnitRuntime& unit);

  // Units driven by dispatch (Note [Units driven by dispatch]).
  /// `unit` (idle) is used in a forward: ends the forward of the units in
  /// forward that do not hold it, then enters it and the idle units around it.
  void enter_forward(UnitRuntime& unit);
  /// Ends the forward of every unit in forward, innermost first; `keep`
  /// stays gathered.
  void settle_forward(UnitRuntime* keep);
  /// Some dispatch-driven unit is in its forward.
  bool forward_in_progress() const { return !forward_units_.empty(); }
  /// Backward runs: a pre-backward hook fired and the end-of-backward callback
  /// has not yet.
  bool in_backward() const {
    return phase_ == BackwardPhase::kRunning || phase_ == BackwardPhase::kRetaining ||
           phase_ == BackwardPhase::kBuildingGraph;
  }

  /// A graph that a backward with create_graph built may still be
  /// differentiated, and no backward runs: its units stay gathered (Note
  /// [Double backward]).
  bool keeps_graph() const { return phase_ == BackwardPhase::kGraphKept; }
  /// `unit` was gathered when a backward with create_graph ended, and the
  /// graph it built may still be differentiated: it reads the unit's
  /// parameters, so the unit does not reshard (Note [Double backward]).
  bool holds_for_graph(const UnitRuntime& unit) const;

  // Note [Copy-in on a stream of its own]
  /// A forward or backward of this root is under way: resharded memory on a
  /// GPU is held, and the copy-in stream waited for the compute stream when
  /// the forward began.
  bool in_iteration() const;
  /// Keeps `memory`, resharded by a unit, until release_held().
  void hold(HeldMemory memory);
  /// Hands back the held memory, oldest first, all of it or all but the
  /// newest.
  void release_held(bool keep_newest);

 private:
  // Backward as the root sees it (checked transitions; Note [Double backward]).
  enum class BackwardPhase {
    kNone,           // no backward under way
    kRunning,        // a hook fired: end_of_backward() is queued with the engine
    kRetaining,      // the same, in a backward with retain_graph
    kBuildingGraph,  // the same, in a backward with create_graph (grad mode on)
    kGraphKept,      // a built graph may still be differentiated: the units
                     // gathered for it stay gathered
  };
  void set_phase(BackwardPhase to);

  void end_of_backward();
  // The reduced-gradient hooks' after_backward, at each end of backward.
  void after_backward_hooks();
  std::vector<std::vector<bool>> agree_received_grads() const;
  // See Note [Backward with respect to inputs].
  void note_units_without_grads();

  UnitRuntime& root_;
  std::vector<UnitRuntime*> units_;
  std::unique_ptr<ExecOrder> exec_order_;
  BackwardPhase phase_ = BackwardPhase::kNone;
  size_t forward_positions_ = 0;  // unit forwards entered this iteration
  // The units whose forward this iteration can bring gradients, in the order
  // their forwards began; their reductions are launched in reverse, the
  // first `reductions_launched_` of them already.
  std::vector<UnitRuntime*> reduction_order_;
  size_t reductions_launched_ = 0;
  // reduction_order_ is a backward's with retain_graph, kept for a second
  // backward through its graph; the next forward starts it afresh.
  bool order_outlived_backward_ = false;
  // The units whose parameters this backward gives no gradient on any rank
  // (Note [Backward with respect to inputs]).
  std::vector<const UnitRuntime*> without_grads_;
  // Launched reductions that may be unfinished, oldest first.
  std::deque<Work> reductions_in_flight_;
  // Dispatch-driven units in forward, outermost first: each holds the next.
  std::vector<UnitRuntime*> forward_units_;
  // The first unit this forward entered after the root: entering it again
  // starts the next forward.
  UnitRuntime* first_entered_ = nullptr;
  // The wrapper unit whose forward ended last and that backward will reach,
  // gathered until its backward or the next forward.
  UnitRuntime* kept_ = nullptr;
  // The units gathered when a backward with create_graph ended (see
  // holds_for_graph()); cleared when the phase returns to kNone.
  std::vector<UnitRuntime*> graph_units_;
  // Units whose reduced shard on the GPU the copy-out stream may still be
  // reading, in the order queued (release_copied_out).
  std::deque<UnitRuntime*> copying_out_;
  // Resharded units' memory on a GPU, oldest first (see in_iteration()).
  std::deque<HeldMemory> held_;
  // The devices with streams that the units live on.
  std::vector<c10::Device> stream_devices_;
};

}  // namespace fsdp::detail
