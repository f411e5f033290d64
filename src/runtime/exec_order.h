#pragma once

#include <torch/nn/module.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include <fsdp/comm/process_group.h>

namespace fsdp {

class Unit;

/// The forward order of a root's units: recorded in the first training
/// iteration (agreed across ranks), compared with later ones, and used by
/// forward and backward prefetch. Owned by the root unit.
///
/// Note [Forward order]
/// Units pair their all-gathers across ranks by issue order, so ranks that
/// run units in different orders hang, or silently exchange the parameters of
/// different units when their sizes match. Hence:
/// - first training iteration (kRecording): before each all-gather, every
///   rank all-gathers a tiny fixed-size message holding the index of the unit
///   it is about to gather (its position in the root's pre-order list of
///   units, the same on every rank since every rank builds the same model).
///   At the end of the root's forward every rank sends an end mark instead,
///   so a rank that runs fewer units than another is caught too (it would
///   otherwise wait in a backward collective). Every rank sees every rank's
///   choice, so all raise the same error; none hangs. The order agreed on is
///   recorded.
/// - later training iterations (kRecorded): each rank compares its units with
///   the recorded order locally, without communication, and warns once (then
///   stops checking) at the first difference.
/// - eval mode with gradients off (the root not training, under
///   NoGradGuard: evaluation): nothing is checked or recorded.
/// - eval mode with gradients on: backward may follow (fine-tuning with
///   dropout and BatchNorm statistics frozen), so its first forward is
///   agreed and recorded as above (kRecordingInEval), for prefetch, as
///   PyTorch's FSDP records the order whatever the mode; it is never
///   compared later (as in PyTorch, only training forwards are), and the
///   first training forward records again (a validation pass without
///   NoGradGuard before training does not decide the order).
/// Not covered: a rank whose divergence involves no unit (e.g. a collective of
/// its own issued on one rank only), and backward order changes that come
/// with an identical forward order; FSDP_DEBUG=detail (Note [Collective
/// fingerprints]) catches those at the collective itself.
class ExecOrder {
 public:
  /// kUnrecorded: no forward backward may follow ran yet. kRecording: inside
  /// the first training forward; kRecordingInEval: inside the first forward
  /// in eval mode with gradients on, before any training one. kRecorded:
  /// order() holds the first training forward's order; kRecordedInEval: the
  /// eval one's, until a training forward records again.
  enum class Phase { kUnrecorded, kRecordingInEval, kRecordedInEval, kRecording, kRecorded };

  /// Indexes the active units of `root_module`'s tree in pre-order (their
  /// identity across ranks) with their module paths. `check`: false turns
  /// both the cross-rank agreement and the later comparison off (recording
  /// stays, for prefetch).
  ExecOrder(torch::nn::Module& root_module, std::shared_ptr<ProcessGroup> group, bool check);

  /// The root's forward starts; `training`: the root's mode; `grad_enabled`:
  /// autograd records (a backward may follow).
  void begin_forward(bool training, bool grad_enabled);
  /// `unit` is about to all-gather its parameters in forward. First
  /// iteration: agrees with the other ranks (collective; throws "Forward
  /// order differs across ranks" on every rank when they disagree) and
  /// records. Later: compares with the recorded order (warns once).
  void before_unshard(Unit& unit);
  /// The root's forward ended (see before_unshard()).
  void end_forward();

  /// Current phase.
  Phase phase() const { return phase_; }
  /// Whether order() is complete (kRecorded or kRecordedInEval).
  bool recorded() const { return phase_ == Phase::kRecorded || phase_ == Phase::kRecordedInEval; }
  /// The first iteration's order of units with parameters (complete once
  /// recorded()).
  const std::vector<Unit*>& order() const { return order_; }
  /// The unit recorded after `unit`, or nullptr (also before recorded()).
  Unit* next(const Unit& unit) const;
  /// The unit recorded before `unit`, or nullptr (also before recorded()).
  Unit* previous(const Unit& unit) const;
  /// `unit` is destroyed (Note [A model's units outlive it]): next() and
  /// previous() give nullptr where they gave it.
  void forget(const Unit& unit);
  /// True once the later-iteration warning was issued.
  bool warned() const { return warned_; }

 private:
  // What a rank sends in the first iteration's agreement.
  enum class Mark : int64_t { kUnit = 1, kEndOfForward = 2 };

  // `position`: 1-based position in this forward, for the message.
  void agree(Mark mark, int64_t value, size_t position);
  void warn_changed(const std::string& recorded, const std::string& actual);
  std::string unit_name(int64_t index) const;
  std::string describe_mark(Mark mark, int64_t value) const;
  int64_t index_of(const Unit& unit) const;
  std::string recorded_order() const;

  // Constant after construction.
  std::vector<Unit*> units_;        // pre-order: index = identity across ranks
  std::vector<std::string> paths_;  // module path of each, "" for the root
  std::unordered_map<const Unit*, int64_t> index_;
  std::shared_ptr<ProcessGroup> group_;
  bool check_;

  Phase phase_ = Phase::kUnrecorded;
  bool checking_ = false;  // this forward is checked (training, check_)
  std::vector<Unit*> order_;
  std::unordered_map<const Unit*, size_t> position_;  // in order_ (last one)
  size_t seen_ = 0;                                   // units of this forward so far
  bool warned_ = false;
};

/// The name of a phase, for messages.
const char* to_string(ExecOrder::Phase phase);

}  // namespace fsdp
