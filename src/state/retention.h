#pragma once

// Removing what interrupted saves leave behind, and old checkpoints beyond a
// retention limit. See Note [Removing leftovers].

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

namespace fsdp::detail {

/// Removes AtomicFileWriter temporaries ("<name>.tmp.<pid>") in `dir`.
/// REQUIRES: no rank of the job is writing into `dir` (see Note [Removing
/// leftovers]). A file that cannot be removed is a warning.
void remove_temporaries(const std::string& dir);

/// Under a checkpoint parent: removes torn step directories (no marker) and
/// the temporaries inside the others and, when keep_last > 0, the complete
/// ones beyond the keep_last saved last (Note [Checkpoints saved last]).
/// Never removes the directories in `keep`, those whose marker is damaged
/// (uncounted), nor complete ones of steps after `up_to`, which keep_last
/// does not count and which it returns (Note [Checkpoints of a run rolled
/// back]).
/// REQUIRES: as remove_temporaries, for the whole of `parent`. Failures are
/// warnings (nothing a later save needs is at stake).
std::vector<std::string> tidy_checkpoints(const std::string& parent, int64_t keep_last,
                                          const std::vector<std::string>& keep,
                                          int64_t up_to = std::numeric_limits<int64_t>::max());

/// Puts back, under a checkpoint parent, each step directory that a
/// replacement cut short between its two renames left missing: the new
/// checkpoint if complete, else the one moved aside (Note [A replacement cut
/// short]). REQUIRES: as tidy_checkpoints. Failures are warnings.
void restore_cut_short_replacements(const std::string& parent);

/// Removes `dir` if it holds no completion marker (a save that failed).
/// REQUIRES: as remove_temporaries.
void remove_if_torn(const std::string& dir);

}  // namespace fsdp::detail
