// detail::RootState: the root's share of the runtime (see Note [Unit,
// runtime and root]): the units of the tree, the reduction order and the
// end-of-backward callback.

#include "runtime/root_state.h"

#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/graph_task.h>

#include <algorithm>
#include <vector>

#include "comm/agreement.h"
#include "core/device_storage.h"
#include "core/sharded_placeholder.h"
#include "detail/error.h"
#include "runtime/unit_runtime.h"

namespace fsdp::detail {

RootState::RootState(UnitRuntime& root) : root_(root) {
  // no_sync() and set_requires_gradient_sync are refused on an inner unit
  // once the root is known; before, such a unit is not known to be inner.
  // Checked before any unit is given this root, so that a refusal leaves
  // the model as it was.
  for (const auto& item : root.self()->named_modules(/*name_prefix=*/"", /*include_self=*/false)) {
    const UnitRuntime* unit = UnitRuntime::of(*item.value());
    FSDP_CHECK(unit == nullptr || unit->require_sync() == root.require_sync(), -1, item.key(),
               "gradient synchronisation was turned ", root.require_sync() ? "off" : "on",
               " for this inner FSDP unit alone (no_sync() or set_requires_gradient_sync() "
               "called on it before the first forward), unlike the root: call them on the "
               "root, which covers every unit of the model");
  }
  for (Unit* unit : root.handle().units_in_tree()) {
    UnitRuntime* runtime = unit->runtime_.get();
    units_.push_back(runtime);
    runtime->root_ = this;
    // A unit used alone before (its own root: an initialiser run before its
    // parent was sharded) is this root's now: the state it had as a root
    // lists units that are this root's too, which it would outlive
    // (Note [A model's units outlive it]).
    if (runtime != &root) runtime->owned_root_.reset();
  }
  // Error messages about sharded parameters name each unit by its path.
  for (const auto& item : root.self()->named_modules(/*name_prefix=*/"", /*include_self=*/true)) {
    UnitRuntime* unit = UnitRuntime::of(*item.value());
    if (unit == nullptr) continue;
    unit->path_ = item.key();
    if (!unit->flat_) continue;
    unit->flat_->set_unit_path(item.key());
    const auto& slots = unit->flat_->slots();
    const std::string where = item.key().empty() ? "" : item.key() + ".";
    for (size_t i = 0; i < slots.size(); ++i) {
      rename_placeholder(unit->grad_placeholders_[i], "'" + where + slots[i].name + "'");
    }
  }
  exec_order_ = std::make_unique<ExecOrder>(*root.self(), root.options().process_group(),
                                            root.options().check_forward_order());
  for (const UnitRuntime* unit : units_) {
    if (!unit->flat_) continue;
    const c10::Device device = unit->flat_->unsharded().device();
    if (has_streams(device) && std::find(stream_devices_.begin(), stream_devices_.end(), device) ==
                                   stream_devices_.end()) {
      stream_devices_.push_back(device);
    }
  }
  // Each unit's nearest enclosing unit: the last, in pre-order, of the units
  // whose module tree holds it.
  for (UnitRuntime* outer : units_) {
    for (const auto& m : outer->self()->modules(/*include_self=*/false)) {
      UnitRuntime* inner = UnitRuntime::of(*m);
      if (inner != nullptr && inner != outer) inner->enclosing_ = outer;
    }
  }
}

RootState::~RootState() {
  try {  // see ~FlatParameter: at exit the CUDA runtime may be gone
    release_held(/*keep_newest=*/false);
  } catch (...) {  // NOLINT(bugprone-empty-catch): a destructor; the device is gone
  }
}

// Note [A model's units outlive it]
// A user may keep part of a model and drop the rest: an encoder taken out
// of a trained model, a block kept for a test. Its units outlive the root
// that knew them, which held their enclosing units and their iteration.
// Each unit destroyed leaves its root's lists (forget); the root destroyed
// orphans the units left (orphan_units), which become idle with no root,
// and the next use of one roots it anew (the outermost survivor becomes the
// root, as at a model's first forward). A wrapper root is destroyed with its
// module. A unit made in place outlives its module in the registry until
// something frees it (Note [Units made in place]): so a survivor whose root's
// module is gone (module_gone) orphans the gone root's units at its next use
// outside that root's iteration (its backward may still call it), and the
// gone units are freed once that operator has ended (it may use some: a
// tied weight). A unit that was a root itself before a parent adopted it
// drops that state then, which lists units it would outlive.

void RootState::forget(const UnitRuntime& unit) {
  const auto drop = [&unit](auto& units) {
    units.erase(std::remove(units.begin(), units.end(), &unit), units.end());
  };
  drop(units_);
  drop(reduction_order_);
  drop(without_grads_);
  drop(forward_units_);
  drop(graph_units_);
  drop(copying_out_);
  if (first_entered_ == &unit) first_entered_ = nullptr;
  if (kept_ == &unit) kept_ = nullptr;
  if (exec_order_) exec_order_->forget(unit.handle());
}

void RootState::release_copied_out(UnitRuntime& unit) {
  // One stream carries the copies in the order queued: the oldest runs first.
  copying_out_.push_back(&unit);
  while (!copying_out_.empty() && copying_out_.front()->release_copied_out(/*wait=*/false)) {
    copying_out_.pop_front();
  }
}

void RootState::orphan_units() {
  for (UnitRuntime* unit : units_) {
    if (unit != &root_ && unit->root_ == this) unit->orphan();
  }
  units_ = {&root_};
  forward_units_.clear();
  copying_out_.clear();  // each unit lets its own go (~UnitRuntime, its next iteration)
  first_entered_ = nullptr;
  kept_ = nullptr;
}

bool RootState::module_gone() const {
  return root_.driver_ == UnitRuntime::Driver::kDispatch && root_.self_alive_.expired();
}

// Note [Gathered before a step]
// A backward frees every unit it went through, so in training each forward
// gathers the shards as the last step left them. A forward that no backward
// follows (an evaluation, a validation loss in grad mode, a parameter read
// or printed outside forward) can leave units gathered: the root, which
// keeps its parameters for the backward it expects, and under SHARD_GRAD_OP
// every unit whose outputs it hooked. An optimizer step after it writes the
// shards, not what is gathered, and the next forward used to compute with
// the values from before the step: training drifted from plain LibTorch.
// So a unit left gathered is gathered anew where what it holds may be
// stale (UnitRuntime::gathered_may_be_stale): its shard's version counter
// moved since the gather (a step that writes through the tensor: Adam,
// AdamW, RMSprop, Adagrad, fsdp::optim's; a load; a write in place), or its
// gradients were cleared (zero_grad, the optimizer's or the model's, either
// meaning; own loops over the parameters' .grad), which loops do between a
// step and the next backward: LibTorch's SGD writes through .data(), which
// counts no version. The ranks must agree, so every sign moves on every
// rank alike: a rank whose part of a parameter is empty bumps the version
// of the gradient where the others zero or scale their parts
// (zero_slot_grad, clip_grad_norm_), and the user's clearings through the
// parameters are counted per unit (grad_clears_). Where: at the start of a
// forward (the root's, wrappers' and fully_shard's alike), and with
// fully_shard at the first operator on such a unit still in its forward
// (the next forward is seen only at its first unit after the root, so the
// root's operators before it, the token embedding, would run in the open
// one). A second forward of the same iteration (siamese pairs, a unit run
// twice) regathers nothing. Left out: SGD with no clearing of the gradients
// between its step and the next forward (docs/using.md). SummonFullParams
// and the state dicts, which no training loop repeats, gather every unit a
// forward left gathered anew.

void RootState::begin_forward() {
  forward_positions_ = 0;
  // See Note [Copy-in on a stream of its own]: the shards were written on
  // the compute stream (the optimizer, the user) since the last forward.
  release_held(/*keep_newest=*/false);
  for (const c10::Device& device : stream_devices_) {
    side_stream_waits_for_current(device, SideStream::kCopyIn);
  }
  if (phase_ == BackwardPhase::kNone && order_outlived_backward_) reduction_order_.clear();
  order_outlived_backward_ = false;
  if (phase_ == BackwardPhase::kNone) {
    for (UnitRuntime* unit : units_) unit->reshard_left_gathered();
    return;
  }
  if (phase_ == BackwardPhase::kGraphKept) {
    // A forward between a backward that built a graph and the backward
    // through it belongs to the same iteration; what the graph holds is
    // gathered again in place, in case a step changed the shards (Note
    // [Double backward]). The same units in the same order on every rank.
    for (UnitRuntime* unit : graph_units_) unit->refresh_gathered();
    return;
  }
  // Autograd drops the callbacks of a backward that failed, so nothing of it
  // completes: its launched reductions are forgotten here and by each unit
  // (UnitRuntime::abandon_iteration), and the next backward queues its own
  // callback. Ranks fail alike (their hooks run the same units in the same
  // order), so their collectives stay paired.
  set_phase(BackwardPhase::kNone);
  reduction_order_.clear();
  reductions_launched_ = 0;
  reductions_in_flight_.clear();
  // What the failed backward gathered, a step after it may have written.
  for (UnitRuntime* unit : units_) unit->reshard_left_gathered();
}

bool RootState::in_iteration() const {
  return root_.state_ != Unit::TrainingState::kIdle || forward_in_progress() || in_backward();
}

void RootState::hold(HeldMemory memory) { held_.push_back(std::move(memory)); }

void RootState::release_held(bool keep_newest) {
  const size_t keep = keep_newest ? 1 : 0;
  while (held_.size() > keep) {
    held_.front().release();
    held_.pop_front();
  }
}

void RootState::set_phase(BackwardPhase to) {
  using P = BackwardPhase;
  const P from = phase_;
  const bool starts = to == P::kRunning || to == P::kRetaining || to == P::kBuildingGraph;
  const bool allowed =
      to == P::kNone || ((from == P::kNone || from == P::kGraphKept) && starts) ||
      ((from == P::kBuildingGraph || from == P::kRetaining) && to == P::kGraphKept);
  TORCH_INTERNAL_ASSERT(allowed, "fsdp: backward phase ", static_cast<int>(from), " to ",
                        static_cast<int>(to));
  phase_ = to;
  if (to == P::kNone) graph_units_.clear();  // they may reshard now
}

bool RootState::holds_for_graph(const UnitRuntime& unit) const {
  if (phase_ == BackwardPhase::kNone || phase_ == BackwardPhase::kRunning) return false;
  return std::find(graph_units_.begin(), graph_units_.end(), &unit) != graph_units_.end();
}

void RootState::queue_end_of_backward() {
  if (in_backward()) return;
  // Before this backward's state: a listener that refuses it (Note [Stepping
  // beside backward]) leaves the root as the last backward left it.
  if (const ReducedGradHooks* hooks = root_.grad_hooks(); hooks && hooks->before_backward) {
    hooks->before_backward();
  }
  // Hooks run in grad mode exactly when backward builds a graph
  // (create_graph), and see whether it keeps its graph: see Note [Double
  // backward].
  if (at::GradMode::is_enabled()) {
    set_phase(BackwardPhase::kBuildingGraph);
  } else {
    set_phase(torch::autograd::get_current_graph_task_keep_graph() ? BackwardPhase::kRetaining
                                                                   : BackwardPhase::kRunning);
  }
  note_units_without_grads();
  torch::autograd::Engine::get_default_engine().queue_callback([this] { end_of_backward(); });
}

// Note [Backward with respect to inputs]
// A backward given the tensors to differentiate (torch::autograd::grad({loss},
// {input}): FGSM's adversarial examples, saliency maps; or backward with
// `inputs`) runs through the units and gives their parameters no gradient:
// autograd runs only the nodes on the way to those tensors, and a
// parameter's AccumulateGrad runs only when the parameter is one of them.
// Launching, at its end, a reduction of zeros for every unit (Note
// [Reduction order]) cost a whole backward's communication, only for the
// agreement to find that no rank got anything. Which AccumulateGrad nodes
// run is decided by the tensors named, not by the data, so it is the same
// on every rank: at the first hook of a backward (inside autograd's graph
// task), the units none of whose parameters' nodes will run are noted. In
// this backward they reduce nothing, on any rank: they keep .grad as it
// was, and a gradient accumulated under no_sync() for the next backward, as
// PyTorch's FSDP (whose reduction hooks do not run there) leaves them; the
// reductions behind them in the order do not wait for them. A noted unit
// that gets a gradient all the same (a nested backward of the user's own,
// on some ranks maybe) keeps it for the next backward too, as under
// no_sync(): reducing it on the ranks that got it would pair their
// collectives with others.
void RootState::note_units_without_grads() {
  without_grads_.clear();
  const auto* info = torch::autograd::get_current_graph_task_exec_info();
  if (info == nullptr || info->empty()) return;  // every node runs
  for (const UnitRuntime* unit : units_) {
    const bool runs = std::any_of(unit->grad_accumulators_.begin(), unit->grad_accumulators_.end(),
                                  [&](const auto& acc) {
                                    const auto it = info->find(acc.get());
                                    return it != info->end() && it->second.needed_;
                                  });
    if (unit->flat_ && !runs) without_grads_.push_back(unit);
  }
}

bool RootState::reduces_in_backward(const UnitRuntime& unit) const {
  return std::find(without_grads_.begin(), without_grads_.end(), &unit) == without_grads_.end();
}

// Note [Reduction order]
// Ranks pair their collectives by order, so every rank must launch the same
// reductions in the same order. Launching each unit's reduction as soon as
// its gradients are complete does that only while every rank's backward
// gives the same units their gradients: a unit whose parameters get
// gradients on some ranks and not on others (a branch taken on some ranks'
// data, a head whose output only some ranks' losses use) would launch on
// those ranks alone and pair with another unit's reduction elsewhere: a hang,
// or, at equal sizes, gradients silently exchanged between units. Plain
// LibTorch on the ranks' concatenated data gives such parameters the mean
// of what the ranks that used them computed, the others adding zeros.
// So every unit whose forward this iteration returned a tensor that needs a
// gradient (the same on every rank, which runs the same forward order:
// Note [Forward order]) joins the root's reduction order, placed by when its
// forward began, and reductions are launched in the reverse of that order
// only: a unit whose gradients are
// complete launches together with every complete unit after it, up to the
// first incomplete one. Backward completes units in about that order, so
// nothing waits in the usual case. At the end of backward the rest launch in
// the same order, with zeros for what this rank did not get (but Note
// [Backward with respect to inputs]); then the ranks
// agree which units and parameters got a gradient anywhere (Note
// [Parameters without gradients]), and those that got none on any rank keep
// their .grad as it was. That is the whole story for SHARD_GRAD_OP and
// NO_SHARD, which gather nothing in backward. FULL_SHARD gathers a unit's
// parameters again where backward reaches its outputs (or prefetches them),
// so its all-gathers differ too, interleaved with the reductions by local
// timing: no local rule orders them alike. (A unit every rank's backward
// reaches completes where its backward ends on every rank, whatever part of
// it this rank's data used: Note [Gradients a backward computes].) The same
// all-reduce therefore
// counts, per FULL_SHARD unit, the ranks whose backward reached it, and a
// count between 0 and the world size is an error on every rank naming the
// units (when mismatched collectives did not fail first), never a silent
// exchange of parameters. Separate process groups for gathers and reductions
// would lift this; PyTorch's FSDP does not support it either.
void RootState::join_reduction_order(UnitRuntime& unit) {
  if (in_reduction_order(unit)) return;
  // By when the forward began, not when it ended: a unit's forward ends after
  // those of the units inside it, and the outermost (the root: embeddings,
  // whose gradients come last) would otherwise be first in the reverse order
  // and hold back every reduction, and with them every unit's gathered
  // parameters and unsharded gradient, until the end of backward.
  const auto later = std::upper_bound(reduction_order_.begin(), reduction_order_.end(), &unit,
                                      [](const UnitRuntime* a, const UnitRuntime* b) {
                                        return a->forward_position_ < b->forward_position_;
                                      });
  reduction_order_.insert(later, &unit);
}

bool RootState::in_reduction_order(const UnitRuntime& unit) const {
  return std::find(reduction_order_.begin(), reduction_order_.end(), &unit) !=
         reduction_order_.end();
}

void RootState::launch_ready_reductions() {
  auto& order = reduction_order_;
  while (reductions_launched_ < order.size()) {
    UnitRuntime* unit = order[order.size() - 1 - reductions_launched_];
    if (!reduces_in_backward(*unit)) {  // See Note [Backward with respect to inputs].
      ++reductions_launched_;
      continue;
    }
    if (!unit->require_sync() || unit->grads_ready_ < unit->grads_expected_) return;
    if (!unit->grad_work_) unit->launch_grad_reduction();
    ++reductions_launched_;
  }
}

// Note [Reductions in flight]
// A launched reduction holds its unit's unsharded gradient (a unit's worth of
// memory) until the collective finishes. When backward computes faster than
// the reductions complete (small batches, slow links), they pile up: GPT-mini
// with 12 blocks at batch 2 held 235 MB above its shards, params and AdamW
// state at the peak, nearly every block's gradient at once. So at most
// kMaxReductionsInFlight are unfinished: launching one more first waits for
// the oldest, as PyTorch's FSDP limits its all-gathers in flight
// (limit_all_gathers). Every rank launches the same reductions in the same
// order (Note [Reduction order]), so the oldest is one every rank has
// launched or will launch without waiting on this rank: no deadlock. Backward
// then runs at most two reductions ahead of the communication, which is the
// bottleneck whenever the limit bites. On a GPU (NCCL) the compute stream
// waits for the oldest instead of the host, as FSDP2 does: the CPU still runs
// ahead, and the GPU holds at most that many gradients being reduced.
void RootState::limit_reductions_in_flight(const Work& work) {
  reductions_in_flight_.push_back(work);
  while (!reductions_in_flight_.empty() && reductions_in_flight_.front().is_completed()) {
    reductions_in_flight_.pop_front();
  }
  while (reductions_in_flight_.size() > kMaxReductionsInFlight) {
    RECORD_USER_SCOPE("fsdp::wait_reduction_in_flight");
    reductions_in_flight_.front().block_current_stream();
    reductions_in_flight_.pop_front();
  }
}

// Note [Steps during backward]
// An optimizer that steps unit by unit while backward goes on (fsdp::optim's
// step_during_backward; on a GPU with CPU offload, the host's optimizer
// beside the GPU's backward) needs each unit's reduced gradient as soon as
// it is final, not at the end of backward. A unit's gradient is final when
// its reduction is launched during backward (Note [Reduction order]) and
// nothing the end-of-backward agreement decides can change it (Note
// [Parameters without gradients]): this rank got a gradient for its flat
// shard, or for every trainable piece with use_orig_params, so every rank
// counts it received. With reduced-gradient hooks installed, such a unit is
// handed to the hooks at its launch, on the thread that runs backward, with
// the launched collective: the listener completes it on a thread of its own
// (waits for the collective, copies the gradient into the shard's memory,
// sets .grad) and steps it, while backward goes on launching the next units
// and, on a GPU, the CPU runs ahead of the device. The unit keeps nothing of
// it, so no state is shared with that thread; it still counts as reduced in
// the agreement, so the collectives are the same on every rank. The other
// units are handed over at the end of backward, .grad already set. Without
// hooks nothing changes. Values are those of a step after backward: the
// same gradients, the same per-parameter updates; only when they happen
// differs. The end of backward waits for the listener (after_backward), so
// when backward returns every unit handed over is stepped and its .grad set,
// as PyTorch's optimizer-in-backward leaves them, and no thread of ours
// writes what the user may read. Until step(), the model is neither before
// nor after the step (the rest is stepped by step()): the hooks refuse a
// forward (before_forward), another backward (before_backward) and any use
// of the model's state (before_state_use: state dicts, checkpoints,
// SummonFullParams, torch::save and torch::load). A backward that throws
// midway leaves the units it handed over stepped (its end never comes), as
// PyTorch's optimizer-in-backward does: step() closes that step.

void RootState::end_of_backward() {
  RECORD_USER_SCOPE("fsdp::end_of_backward");
  if (forward_in_progress()) settle_forward(nullptr);
  if (phase_ == BackwardPhase::kBuildingGraph) {
    // See Note [Double backward]: the graph it built saved what is gathered.
    // Its units' inputs are forgotten (Note [Parameters backward reads
    // without a gradient]): the backward through it passes them again.
    for (UnitRuntime* unit : units_) unit->forget_forward_inputs();
    for (UnitRuntime* unit : units_) {
      if (unit->flat_ && unit->flat_->state() != FlatParameter::State::kSharded &&
          !holds_for_graph(*unit)) {
        graph_units_.push_back(unit);
      }
    }
    set_phase(BackwardPhase::kGraphKept);
    after_backward_hooks();
    return;
  }
  // A backward with retain_graph through a built graph: a second may follow
  // through both, so what the built graph reads stays gathered.
  const bool retaining = phase_ == BackwardPhase::kRetaining;
  const bool retained = retaining && !graph_units_.empty();
  // A unit this backward did not reach (its pre_backward did it for the
  // others) loses the gradients the user dropped before the optimizer steps
  // (Note [Gradients the user clears]).
  for (UnitRuntime* unit : units_) unit->drop_grads_the_user_dropped();
  set_phase(retained ? BackwardPhase::kGraphKept : BackwardPhase::kNone);
  reductions_in_flight_.clear();  // each unit waits for its own below
  // What did not launch during backward launches now, in the same order on
  // every rank (Note [Reduction order]).
  for (size_t i = reductions_launched_; i < reduction_order_.size(); ++i) {
    UnitRuntime* unit = reduction_order_[reduction_order_.size() - 1 - i];
    if (unit->require_sync() && !unit->grad_work_ && reduces_in_backward(*unit)) {
      unit->launch_grad_reduction();
    }
  }
  // A unit that kept gradients within the node and had no forward in this
  // iteration (the same on every rank: Note [Reduction order]) still
  // reduces what it kept, with zeros for this backward, in the units' order
  // (Note [Accumulating within the node]).
  for (UnitRuntime* unit : units_) {
    if (unit->kept_within_node_ && unit->require_sync() && !unit->reduction_launched() &&
        !unit->reduces_within_node_only() && reduces_in_backward(*unit)) {
      unit->launch_grad_reduction();
    }
  }
  // A second backward through a retained graph has no forward to order its
  // reductions (each rank's would launch as its own gradients came, and a
  // unit that got none here nothing): this order stays for it.
  if (!retaining) reduction_order_.clear();
  order_outlived_backward_ = retaining;
  reductions_launched_ = 0;
  // The devices whose streams carry copies to host memory, waited for once
  // the agreement has overlapped them (Note [Gradients to host memory]).
  std::vector<c10::Device> copying;
  for (UnitRuntime* unit : units_) {
    const c10::Device device = unit->flat_ ? unit->flat_->unsharded().device() : c10::kCPU;
    if (reduces_in_backward(*unit) && unit->finish_reduction() &&
        std::find(copying.begin(), copying.end(), device) == copying.end()) {
      copying.push_back(device);
    }
  }
  const auto received = agree_received_grads();  // See Note [Parameters without gradients].
  for (const c10::Device& device : copying) {
    wait_for_device(device);
    wait_for_side_stream(device, SideStream::kCopyOut);
  }
  copying_out_.clear();  // every copy ran: finish_backward lets the shards go
  for (size_t i = 0; i < units_.size(); ++i) {
    units_[i]->finish_backward(received[i].empty() ? nullptr : &received[i],
                               reduces_in_backward(*units_[i]));
  }
  without_grads_.clear();               // See Note [Backward with respect to inputs].
  release_held(/*keep_newest=*/false);  // Note [Copy-in on a stream of its own]
  after_backward_hooks();
}

void RootState::after_backward_hooks() {
  // The listener's steps settle before backward returns (Note [Steps during backward]).
  if (const ReducedGradHooks* hooks = root_.grad_hooks(); hooks && hooks->after_backward) {
    hooks->after_backward();
  }
}

// Note [Double backward]
// A gradient penalty differentiates a gradient: torch::autograd::grad(out,
// inputs, {}, true, /*create_graph=*/true) builds, while it runs, a graph of
// the backward itself, whose nodes save the parameters they read, and the
// loss's backward then goes through it. A unit's saved parameters are views
// of its gathered buffer, and those nodes run before any hook of ours can
// gather it again, so the unit must not reshard in between: the second
// backward would read freed storage (LibTorch's "setStorage ... out of
// bounds"). Backward builds a graph exactly when autograd runs it in grad
// mode, which the hooks see, so the root's backward phase tells the two
// apart. A backward that builds a graph (kBuildingGraph) ends with nothing
// finished (kGraphKept): its units stay in kPreBackward, the reduction order
// stays, and the units gathered then stay gathered, through forwards in
// between too (WGAN-GP computes the penalty's gradient before or after the
// critic's other forwards, and may log a score under no_grad), until the
// next backward that builds no graph: it finishes both, one reduction per
// unit of the gradients both brought and one end-of-backward agreement, so
// ranks issue the same collectives as for a plain backward. In it a unit
// reshards at its gradient's reduction, as usual: by then every node that
// read its parameters has run (each has an edge to their AccumulateGrad).
// That backward with retain_graph (kRetaining) keeps them gathered after it
// too, for a second backward through the same graph. The units are released
// when a backward without retain_graph ends, so a graph built only to be
// logged holds them until the next step's backward. Meanwhile an optimizer
// step or a load may change their shards (LibTorch's optimizers write
// through .data(), which no version counter sees), so what reads the
// gathered values gathers them again in place first (the same storage, which
// the graph's saved views share): a forward (RootState::begin_forward), a
// SummonFullParams or state dict outside one (gather_full_params), a
// torch::save (save_unit). Each is collective by contract, so ranks issue
// the same all-gathers. Gradients of the parameters themselves inside
// a backward that builds a graph (a .grad carrying a graph, as
// loss.backward({}, true, true) leaves it) are an error naming the unit: a
// unit's gradient is reduced and sharded as it arrives, so it cannot carry
// one. Ranks must build the same graph: a backward with create_graph that
// reaches a FULL_SHARD unit on some ranks only is not agreed on (its end
// issues no collective), so their next gathers differ. PyTorch's FSDP warns
// that it does not support double backward.

// Note [Parameters without gradients]
// In plain LibTorch a parameter the forward did not use keeps its .grad
// (undefined, if never set), so optimizers skip it: no weight decay, no
// momentum. A unit's gradient is one flat buffer, reduced whole, in which
// such a parameter's part is zero. With use_orig_params each parameter has
// its own piece of the shard, so a piece whose parameter got no gradient on
// any rank is left alone. "Any rank" needs agreement: the end-of-backward
// callback all-reduces (sums) one flag per slot of every use_orig_params unit,
// after every unit's reduction was launched and waited for, so every rank
// issues the same collectives in the same order (one small all-reduce per
// backward). With flat shards the whole shard gets the gradient; a warning
// names the parameters once per unit. A unit that got no gradient on any
// rank (one flag per flat-shard unit in the same all-reduce) leaves its
// shard's .grad as it was (undefined if never set); see also Note
// [Reduction order].
std::vector<std::vector<bool>> RootState::agree_received_grads() const {
  // Per unit: one flag per slot with use_orig_params, else one; then, for a
  // FULL_SHARD unit that is not the root, whether backward reached its
  // outputs here. Summed over the ranks.
  const auto grad_flags = [](const UnitRuntime& unit) -> size_t {
    if (!unit.flat_) return 0;
    return unit.options_.use_orig_params() ? unit.flat_->slots().size() : 1;
  };
  const auto regathers = [](const UnitRuntime& unit) {  // collectively (not NO_SHARD's cast)
    return unit.flat_ && !unit.flat_->keeps_unsharded() &&
           unit.frees_after_forward(/*backward_follows=*/true);
  };
  std::vector<std::vector<bool>> out(units_.size());
  int64_t total = 0;
  ProcessGroup* group = root_.options_.process_group().get();
  for (const UnitRuntime* unit : units_) {
    if (!unit->flat_) continue;
    total += static_cast<int64_t>(grad_flags(*unit)) + (regathers(*unit) ? 1 : 0);
    if (group == nullptr) group = &unit->flat_->group();
  }
  if (total == 0 || !root_.require_sync()) return out;
  // Last: whether this rank's forward order ever left the first iteration's
  // (already warned: collectives unchecked, as PyTorch's FSDP has it).
  // Each unit writes exactly grad_flags() flags, as the reading loop below
  // consumes them: its slot_filled_ can hold fewer entries (no gradient
  // reached the unit), and those flags are 0.
  std::vector<int64_t> flags(static_cast<size_t>(total) + 1, 0);
  flags[static_cast<size_t>(total)] = exec_order_->warned() ? 1 : 0;
  auto w = flags.begin();
  for (const UnitRuntime* unit : units_) {
    if (!unit->flat_) continue;
    // A slot had a gradient in this backward, or in one whose reduction
    // stayed within the node and this one adds (Note [Accumulating within
    // the node]).
    const auto filled = [unit](size_t i) {
      const auto& now = unit->slot_filled_;
      const auto& kept = unit->within_node_filled_;
      return (i < now.size() && now[i]) ||
             (unit->grad_reach_ == UnitRuntime::GradReach::kJob && i < kept.size() && kept[i]);
    };
    const bool reduced = unit->reduction_launched();
    if (unit->options_.use_orig_params()) {
      for (size_t i = 0; i < grad_flags(*unit); ++i) *w++ = reduced && filled(i) ? 1 : 0;
    } else {
      bool any = false;
      for (size_t i = 0; i < unit->flat_->slots().size(); ++i) any = any || filled(i);
      *w++ = reduced && any ? 1 : 0;
    }
    // Backward reached it, or, where the user said backward does not read
    // its parameters, it gathered them all the same (Note [Units backward
    // does not gather]).
    if (regathers(*unit)) {
      const bool gathers = unit->unshard_in_backward_
                               ? unit->state_ != Unit::TrainingState::kIdle
                               : unit->backward_gather_ == UnitRuntime::BackwardGather::kGathered;
      *w++ = gathers ? 1 : 0;
    }
  }
  const int world = group->size();
  flags = agree_reduce(group, std::move(flags), ReduceOp::kSum);
  auto f = flags.begin();
  std::string uneven;
  for (size_t u = 0; u < units_.size(); ++u) {
    const UnitRuntime& unit = *units_[u];
    if (!unit.flat_) continue;
    for (size_t i = 0; i < grad_flags(unit); ++i) out[u].push_back(*f++ > 0);
    if (!regathers(unit)) continue;
    const int64_t reached = *f++;
    if (reached > 0 && reached < world) {
      uneven += (uneven.empty() ? "" : ", ") + unit.flat_->unit_label();
    }
  }
  // See Note [Reduction order]: under FULL_SHARD a unit's parameters are
  // gathered again where backward reaches its outputs, so ranks that differ
  // there gather different units; whatever the collectives did, say why.
  const bool order_changed = *f > 0;
  FSDP_CHECK(uneven.empty() || order_changed, group->rank(), "backward",
             "backward reached the outputs of ", uneven,
             " on some ranks but not on others (their loss did not use them). Under "
             "FULL_SHARD every rank must then gather the same parameters in backward, "
             "which it cannot know. Let every rank's loss use those outputs (add 0 * the "
             "unused term), or make those units SHARD_GRAD_OP or NO_SHARD, which gather "
             "nothing in backward and train like plain LibTorch here");
  return out;
}

void RootState::keep_for_backward(UnitRuntime& unit) {
  if (kept_ != nullptr && kept_ != &unit) kept_->reshard();
  kept_ = &unit;
}

void RootState::release_kept() {
  if (kept_ != nullptr) kept_->reshard();
  kept_ = nullptr;
}

void RootState::forget_kept(const UnitRuntime& unit) {
  if (kept_ == &unit) kept_ = nullptr;
}

}  // namespace fsdp::detail
