#pragma once

// What a run shows and records: rank 0's progress bar (or log lines when
// stdout is not a terminal) and every rank's metrics as JSON lines.

#include <nlohmann/json.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <fsdp/memory.h>

#include "config.h"

namespace train_gpt {

/// One finished optimizer step, as rank 0 shows it.
struct StepReport {
  int64_t step = 0;   ///< Steps done (1-based).
  int64_t total = 0;  ///< Steps of the run.
  double loss = 0;    ///< Mean training loss over all ranks.
  double lr = 0;
  std::optional<double> grad_norm;  ///< None when stepped during backward.
  double tokens_per_s = 0;          ///< All ranks together, averaged over recent steps.
  double eta_s = 0;
  std::vector<int64_t> peak_bytes;  ///< Peak tracked memory of each rank.
};

/// kAuto resolved: kBar when stdout is a terminal, or when fsdprun's is
/// (fsdprun sets FSDPRUN_STDOUT_TTY=1 for its ranks then), else kLog.
ProgressMode resolve_progress_mode(ProgressMode mode);

/// "12.3 MiB" (libfsdp's).
using fsdp::format_bytes;

/// "1:05" or "1:02:05".
std::string format_duration(double seconds);

/// Rank 0's display. Inactive (on other ranks, or with kNone) it prints nothing.
///
/// Note [Progress bar through fsdprun]
/// fsdprun prefixes each rank's output line by line, so a bar redrawn with a
/// bare '\r' would only show when a line ends. Each redraw is therefore a
/// whole line that first moves the cursor up over the previous bar
/// ("ESC[1A ESC[2K"); it shows the same on a terminal and through fsdprun.
class ProgressDisplay {
 public:
  /// `mode` must be resolved (not kAuto).
  ProgressDisplay(ProgressMode mode, bool active, int64_t log_interval);

  /// Shows a finished step: redraws the bar, or prints a log line every
  /// log_interval steps and at the last step.
  void step(const StepReport& report);

  /// Prints a message line (kept above the bar).
  void message(const std::string& text);

 private:
  void draw(const std::string& line);
  std::string bar_line(const StepReport& r) const;
  std::string log_line(const StepReport& r) const;

  ProgressMode mode_;
  bool active_;
  int64_t log_interval_;
  bool bar_shown_ = false;  // a bar line is the last thing printed
  std::string last_bar_;    // redrawn below a message
};

/// One JSON object per line in <dir>/rank<R>.jsonl, written at once, so a
/// crashed run still leaves its metrics. A no-op without a directory.
class MetricsLog {
 public:
  /// Creates `dir` if needed and truncates this rank's file. Throws
  /// std::runtime_error naming the path when it cannot be written.
  MetricsLog(const std::string& dir, int rank);
  ~MetricsLog();
  MetricsLog(const MetricsLog&) = delete;
  MetricsLog& operator=(const MetricsLog&) = delete;

  /// Appends `record` as one line. Throws std::runtime_error naming the file
  /// when the write fails (a full disk), after cutting off the part of the
  /// line that was written: the file keeps whole lines only.
  void write(const nlohmann::json& record);

  /// The file written, or "" without a directory.
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  int fd_ = -1;
  int64_t size_ = 0;  // bytes of the whole lines written
};

}  // namespace train_gpt
