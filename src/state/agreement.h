#pragma once

// Turning one rank's failure in a checkpoint phase into an error on every
// rank, instead of a hang at the next collective; and quoting one error in
// another.

#include <c10/core/Stream.h>

#include <exception>
#include <functional>
#include <string>
#include <vector>

#include <fsdp/comm/process_group.h>

namespace fsdp::detail {

/// Collective over `group` (nothing when it is null or of size 1): every rank
/// learns which ranks failed `phase`. A rank whose `error` is set rethrows
/// it; if any other rank failed, the rest throw CheckpointError(dir, "rank(s)
/// R failed while <phase> (see that rank's error); <consequence>").
void agree(ProcessGroup* group, const std::exception_ptr& error, const std::string& dir,
           const std::string& phase, const std::string& consequence);

/// agree() on `phase`, whose work on this rank is `work` (file I/O: no
/// collective), run on a thread of its own while this thread keeps the
/// ranks' wait alive (Note [Waiting for a rank that writes more]). `streams`
/// are this thread's current streams, made current on the work's thread so
/// that its copies to the host are ordered after what was queued here.
void agree_after_work(ProcessGroup* group, const std::function<void()>& work,
                      const std::vector<c10::Stream>& streams, const std::string& dir,
                      const std::string& phase, const std::string& consequence);

/// The ranks whose entry of `per_rank` (one per rank) is `value`, as "1, 3".
std::string ranks_with(const std::vector<int64_t>& per_rank, int64_t value);

/// `e`'s message for embedding in another message: "<file>: <problem>" for a
/// CheckpointError (without its "[rank R] fsdp(...): " prefix, which the
/// outer message has), else error_message(e).
std::string cause_of(const std::exception& e);

}  // namespace fsdp::detail
