#include "state/retention.h"

#include <c10/util/Exception.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <optional>
#include <utility>

#include "detail/error.h"
#include "detail/posix_files.h"
#include "state/agreement.h"
#include "state/atomic_file.h"
#include "state/checkpoint_dir.h"

namespace fsdp::detail {

// Note [Removing leftovers]
// A rank killed while saving leaves "*.tmp.<pid>" files and a step directory
// without a marker; on a full disk they make every retry fail sooner. They
// are removed by rank 0 only where no writer can be in progress:
//   - write_checkpoint, step 1: temporaries inside the directory it is about
//     to write (every rank has passed an agreement, none has begun writing);
//   - save_step, after the save's last agreement (every rank's files are
//     durable), and resume(), which every rank calls at once: torn step
//     directories and temporaries anywhere under the parent.
// A save is collective and ends only when every rank's writes are durable,
// so when rank 0 is in one of those places no rank of the job is writing;
// an earlier incarnation of the job is dead (fsdprun restarts ranks only
// after all of them exited). Only the parent given to save_step/resume is
// touched, so it must belong to one job (as resume() already assumes).

namespace {

void remove_path(const std::string& path, bool tree) {
  std::error_code ec;  // See Note [No filesystem library].
  if (tree) {
    remove_tree(path, ec);
  } else {
    remove_entry(path, ec);
  }
  if (ec) {
    TORCH_WARN(error_prefix(/*rank=*/-1, path), "cannot remove it: ", ec.message());
  }
}

}  // namespace

void remove_temporaries(const std::string& dir) {
  // A dir that cannot be listed (nothing there yet, or not a directory) holds
  // nothing of ours.
  std::error_code ec;
  for (const std::string& name : list_dir(dir, ec)) {
    if (is_temporary_name(name)) remove_path(dir + "/" + name, /*tree=*/false);
  }
}

void remove_if_torn(const std::string& dir) {
  if (!entry_exists(dir + "/" + kCompletionMarker) && path_exists(dir)) {
    remove_path(dir, /*tree=*/true);
  }
}

// Note [A replacement cut short]
// Where two directories cannot be exchanged (NFS, older kernels),
// replace_directory moves the checkpoint of a step aside
// ("step-N.replaced"), then the new complete one in (".step-N.saving" ->
// "step-N"). A job killed between the two renames (a wall-time limit, a
// power cut) leaves no "step-N" and both complete copies under staging
// names: resume() then saw no checkpoint of that step, and tidying removed
// both. So before a parent is read (resume) or tidied, rank 0 renames the
// new one into place, or, were it incomplete, the one moved aside.
void restore_cut_short_replacements(const std::string& parent) {
  std::error_code ec;
  std::vector<std::string> names = list_dir(parent, ec);
  if (ec) return;
  // The new ones (".step-N.saving") first: the save had completed them.
  std::stable_partition(names.begin(), names.end(),
                        [](const std::string& n) { return !n.empty() && n[0] == '.'; });
  for (const std::string& name : names) {
    if (!is_staging_name(name)) continue;
    const std::string step = name.substr(name[0] == '.' ? 1 : 0, step_name(0).size());
    const std::string from = parent + "/" + name, to = parent + "/" + step;
    if (entry_exists(to) || !entry_exists(from + "/" + kCompletionMarker)) continue;
    if (::rename(from.c_str(), to.c_str()) != 0) {
      TORCH_WARN(error_prefix(/*rank=*/-1, from), "cannot put it back as ", to, ": ",
                 std::strerror(errno));
      continue;
    }
    TORCH_WARN(error_prefix(/*rank=*/-1, parent), "a save of ", step,
               " was cut short between its two renames; ", name, " is ", step, " again");
    try {
      fsync_directory(parent);
    } catch (const std::exception& e) {
      TORCH_WARN(error_prefix(/*rank=*/-1, parent), cause_of(e));
    }
  }
}

// Note [Checkpoints of a run rolled back]
// A run that loads an earlier step (a loss spike: load step 800 of 800, 900
// and 1000) and trains on saves steps below the abandoned run's. Counted by
// number, those would fill keep_last: each new save removed the one before
// it, and the step loaded, while the abandoned ones stayed. So save_step,
// and resume() (up to the step it loaded, the one saved last: Note
// [Checkpoints saved last]), leave complete checkpoints of later steps alone
// and out of the count, and save_step warns that they are there (removing
// them is the user's call: they may be wanted); the directory load() read is
// kept as resume()'s is.
std::vector<std::string> tidy_checkpoints(const std::string& parent, int64_t keep_last,
                                          const std::vector<std::string>& keep, int64_t up_to) {
  restore_cut_short_replacements(parent);
  // The directories to keep, by identity (device and inode) where they can
  // be looked at: a checkpoint loaded by an absolute path, or through a
  // link, and saved beside by a relative one is the same directory (it was
  // removed, compared by name). By name otherwise.
  const auto identity = [](const std::string& path) -> std::optional<std::pair<dev_t, ino_t>> {
    struct stat st {};
    if (::stat(path.c_str(), &st) != 0) return std::nullopt;
    return std::make_pair(st.st_dev, st.st_ino);
  };
  std::vector<std::string> kept_paths;
  std::vector<std::pair<dev_t, ino_t>> kept_ids;
  for (const std::string& k : keep) {
    kept_paths.push_back(lexically_normal(k));
    if (auto id = identity(k)) kept_ids.push_back(*id);
  }
  std::vector<StepDirectory> dirs;
  try {
    dirs = step_directories(parent);
  } catch (const std::exception& e) {
    TORCH_WARN(error_prefix(/*rank=*/-1, parent), "not tidying it: ", cause_of(e));
    return {};
  }
  std::error_code ec;
  for (const std::string& name : list_dir(parent, ec)) {  // Note [Saving beside the checkpoint]
    if (is_staging_name(name)) remove_path(parent + "/" + name, /*tree=*/true);
  }
  int64_t complete = 0;  // complete ones seen so far, newest first
  std::vector<std::string> later;
  for (const StepDirectory& s : dirs) {
    const auto id = identity(s.path);
    const bool kept = std::find(kept_paths.begin(), kept_paths.end(), lexically_normal(s.path)) !=
                          kept_paths.end() ||
                      (id && std::find(kept_ids.begin(), kept_ids.end(), *id) != kept_ids.end());
    // A damaged marker has no place in the order: left alone, uncounted
    // (resume() warns of it; removing it is the user's call).
    if (s.marked && !s.sequence) {
      remove_temporaries(s.path);
      continue;
    }
    if (s.marked && s.step > up_to) {  // Note [Checkpoints of a run rolled back]
      later.push_back(s.path);
      continue;
    }
    if (s.marked) ++complete;
    if (kept || (s.marked && (keep_last == 0 || complete <= keep_last))) {
      remove_temporaries(s.path);
    } else {
      remove_path(s.path, /*tree=*/true);
    }
  }
  return later;
}

}  // namespace fsdp::detail
