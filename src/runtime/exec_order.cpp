#include "runtime/exec_order.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <sstream>
#include <utility>

#include <fsdp/runtime/unit.h>

#include "comm/agreement.h"

namespace fsdp {

const char* to_string(ExecOrder::Phase phase) {
  switch (phase) {
    case ExecOrder::Phase::kUnrecorded:
      return "unrecorded";
    case ExecOrder::Phase::kRecordingInEval:
      return "recording in eval mode";
    case ExecOrder::Phase::kRecordedInEval:
      return "recorded in eval mode";
    case ExecOrder::Phase::kRecording:
      return "recording";
    case ExecOrder::Phase::kRecorded:
      return "recorded";
  }
  return "?";
}

ExecOrder::ExecOrder(torch::nn::Module& root_module, std::shared_ptr<ProcessGroup> group,
                     bool check)
    : group_(std::move(group)), check_(check) {
  TORCH_INTERNAL_ASSERT(group_, "fsdp: the forward order needs a process group");
  for (const auto& item : root_module.named_modules(/*name_prefix=*/"", /*include_self=*/true)) {
    Unit* unit = unit_of(*item.value());
    if (unit == nullptr || index_.count(unit) > 0) continue;
    index_[unit] = static_cast<int64_t>(units_.size());
    units_.push_back(unit);
    paths_.push_back(item.key());
  }
}

void ExecOrder::begin_forward(bool training, bool grad_enabled) {
  seen_ = 0;
  checking_ = false;
  if (!training && !grad_enabled) return;  // evaluation: nothing recorded, nothing checked
  switch (phase_) {
    case Phase::kRecorded:
      checking_ = training && check_ && !warned_;
      return;
    case Phase::kRecordedInEval:
      if (!training) return;
      break;  // the first training forward records again
    case Phase::kUnrecorded:
    case Phase::kRecordingInEval:  // the first forward did not finish (it threw): start again
    case Phase::kRecording:
      break;
  }
  order_.clear();
  position_.clear();
  phase_ = training ? Phase::kRecording : Phase::kRecordingInEval;
  checking_ = check_;
}

void ExecOrder::before_unshard(Unit& unit) {
  const size_t at = seen_++;
  if (phase_ == Phase::kRecording || phase_ == Phase::kRecordingInEval) {
    if (checking_) agree(Mark::kUnit, index_of(unit), at + 1);
    position_[&unit] = order_.size();
    order_.push_back(&unit);
    return;
  }
  if (!checking_) return;
  if (at < order_.size() && order_[at] == &unit) return;
  std::ostringstream recorded, actual;
  recorded << "unit " << at + 1 << " was "
           << (at < order_.size() ? unit_name(index_of(*order_[at])) : "none (the forward ended)");
  actual << "is " << unit_name(index_of(unit));
  warn_changed(recorded.str(), actual.str());
}

void ExecOrder::end_forward() {
  if (phase_ == Phase::kRecording || phase_ == Phase::kRecordingInEval) {
    if (checking_) agree(Mark::kEndOfForward, static_cast<int64_t>(order_.size()), seen_ + 1);
    phase_ = phase_ == Phase::kRecording ? Phase::kRecorded : Phase::kRecordedInEval;
    checking_ = false;
    return;
  }
  if (!checking_ || seen_ == order_.size()) return;
  if (seen_ > order_.size()) return;  // already warned at the first extra unit
  std::ostringstream recorded, actual;
  recorded << "unit " << seen_ + 1 << " was " << unit_name(index_of(*order_[seen_]));
  actual << "ended after " << seen_ << (seen_ == 1 ? " unit" : " units");
  warn_changed(recorded.str(), actual.str());
}

Unit* ExecOrder::next(const Unit& unit) const {
  if (!recorded()) return nullptr;
  auto it = position_.find(&unit);
  if (it == position_.end() || it->second + 1 >= order_.size()) return nullptr;
  return order_[it->second + 1];
}

void ExecOrder::forget(const Unit& unit) {
  std::replace(order_.begin(), order_.end(), const_cast<Unit*>(&unit), static_cast<Unit*>(nullptr));
  std::replace(units_.begin(), units_.end(), const_cast<Unit*>(&unit), static_cast<Unit*>(nullptr));
  position_.erase(&unit);
  index_.erase(&unit);
}

Unit* ExecOrder::previous(const Unit& unit) const {
  if (!recorded()) return nullptr;
  auto it = position_.find(&unit);
  if (it == position_.end() || it->second == 0) return nullptr;
  return order_[it->second - 1];
}

void ExecOrder::agree(Mark mark, int64_t value, size_t position) {
  const int world = group_->size();
  if (world == 1) return;
  const std::vector<int64_t> all =
      detail::agree_gather(group_.get(), {static_cast<int64_t>(mark), value});
  const int64_t* rows = all.data();
  bool same = true;
  auto row = [&](int r) { return rows + 2 * static_cast<size_t>(r); };
  for (int r = 1; r < world && same; ++r) {
    same = row(r)[0] == rows[0] && row(r)[1] == rows[1];
  }
  if (same) return;
  // Ranks grouped by what they were about to do, in rank order.
  std::vector<std::pair<std::string, std::vector<int>>> groups;
  for (int r = 0; r < world; ++r) {
    const std::string what = describe_mark(static_cast<Mark>(row(r)[0]), row(r)[1]);
    auto it =
        std::find_if(groups.begin(), groups.end(), [&](const auto& g) { return g.first == what; });
    if (it == groups.end()) {
      groups.push_back({what, {r}});
    } else {
      it->second.push_back(r);
    }
  }
  std::ostringstream os;
  os << "Forward order differs across ranks: at unit " << position << " of the first iteration's "
     << "forward, ";
  for (size_t i = 0; i < groups.size(); ++i) {
    const auto& ranks = groups[i].second;
    os << (i > 0 ? "; " : "") << (ranks.size() > 1 ? "ranks " : "rank ");
    for (size_t j = 0; j < ranks.size(); ++j) os << (j > 0 ? ", " : "") << ranks[j];
    os << (ranks.size() > 1 ? " were " : " was ") << groups[i].first;
  }
  os << " (seen from rank " << group_->rank() << "; units so far: " << recorded_order()
     << "). FSDP units must run in the same order on every rank: their all-gathers and "
        "reduce-scatters pair up by order, so a difference hangs or silently mixes parameters. "
        "Look for control flow that depends on the rank or on its data (e.g. a branch that "
        "calls one unit on some ranks and another elsewhere) and make it the same on every "
        "rank.";
  // Not the one prefix (Note [Error messages]): seed 004 pins PyTorch's own
  // words at the start; the rank is named in the message.
  TORCH_CHECK(false, os.str());
}

void ExecOrder::warn_changed(const std::string& recorded, const std::string& actual) {
  if (warned_) return;
  warned_ = true;
  checking_ = false;
  // Plain TORCH_WARN (not _ONCE): the once-only logic is this object's, per root.
  TORCH_WARN("Forward order differs from that of the first iteration on rank ", group_->rank(),
             ". Collectives are unchecked and may give incorrect results or hang. In the first "
             "iteration, ",
             recorded, "; in this iteration it ", actual,
             " (first iteration's order: ", recorded_order(),
             "). FSDP prefetches by the first iteration's order and every rank must run the "
             "same order; this warning is issued once. Set FSDP_DEBUG=detail to turn a "
             "resulting collective mismatch into an error.");
}

std::string ExecOrder::unit_name(int64_t index) const {
  if (index < 0 || index >= static_cast<int64_t>(units_.size())) {
    return "unknown unit #" + std::to_string(index);
  }
  return paths_[index].empty() ? "the root unit" : "unit `" + paths_[index] + "`";
}

std::string ExecOrder::describe_mark(Mark mark, int64_t value) const {
  switch (mark) {
    case Mark::kUnit:
      return "about to all-gather " + unit_name(value);
    case Mark::kEndOfForward:
      return "at the end of its forward after " + std::to_string(value) +
             (value == 1 ? " unit" : " units");
  }
  return "in an unknown state";
}

int64_t ExecOrder::index_of(const Unit& unit) const {
  auto it = index_.find(&unit);
  return it == index_.end() ? -1 : it->second;
}

std::string ExecOrder::recorded_order() const {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < order_.size(); ++i) {
    const int64_t index = index_of(*order_[i]);
    os << (i > 0 ? ", " : "")
       << (index >= 0 && !paths_[index].empty() ? paths_[index] : std::string("(root)"));
  }
  os << "]";
  return os.str();
}

}  // namespace fsdp
