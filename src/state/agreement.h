#pragma once

// Turning one rank's failure in a checkpoint phase into an error on every
// rank, instead of a hang at the next collective; and quoting one error in
// another.

#include <exception>
#include <string>

#include <fsdp/comm/process_group.h>

namespace fsdp::detail {

/// Collective over `group` (nothing when it is null or of size 1): every rank
/// learns which ranks failed `phase`. A rank whose `error` is set rethrows
/// it; if any other rank failed, the rest throw CheckpointError(dir, "rank(s)
/// R failed while <phase> (see that rank's error); <consequence>").
void agree(ProcessGroup* group, const std::exception_ptr& error, const std::string& dir,
           const std::string& phase, const std::string& consequence);

/// `e`'s message for embedding in another message: "<file>: <problem>" for a
/// CheckpointError (without its "[rank R] fsdp(...): " prefix, which the
/// outer message has), else error_message(e).
std::string cause_of(const std::exception& e);

}  // namespace fsdp::detail
