#include "state/agreement.h"

#include <fsdp/error_message.h>
#include <fsdp/state/error.h>

#include "comm/agreement.h"

namespace fsdp::detail {

void agree(ProcessGroup* group, const std::exception_ptr& error, const std::string& dir,
           const std::string& phase, const std::string& consequence) {
  std::string failed;
  if (group != nullptr && group->size() > 1) {
    std::vector<int64_t> flags(group->size(), 0);
    if (error) flags[group->rank()] = 1;
    flags = agree_reduce(group, std::move(flags), ReduceOp::kSum);
    for (int r = 0; r < group->size(); ++r) {
      if (flags[r] > 0) failed += (failed.empty() ? "" : ", ") + std::to_string(r);
    }
  }
  if (error) std::rethrow_exception(error);
  if (!failed.empty()) {
    throw CheckpointError(dir, "rank(s) " + failed + " failed while " + phase +
                                   " (see that rank's error); " + consequence);
  }
}

std::string cause_of(const std::exception& e) {
  if (const auto* c = dynamic_cast<const CheckpointError*>(&e))
    return c->file() + ": " + c->problem();
  return error_message(e);
}

}  // namespace fsdp::detail
