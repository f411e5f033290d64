#pragma once

// Splits one rank's output stream into lines and prefixes each one.

#include <cstddef>
#include <map>
#include <string>
#include <string_view>

namespace fsdp::launch {

/// Buffers bytes from one pipe and releases only whole lines, each with a
/// prefix such as "[rank3]: ". A line ends at '\n' or at '\r' (a progress
/// bar redrawing its line, shown at each redraw as on a terminal), and keeps
/// its ending ("\r\n" too). Because the caller writes what it gets in a
/// single call from a single thread, lines of different ranks never mix
/// mid-line: a partial line shown early (flush_partial) is ended by the
/// caller (break_line) before another rank's output.
class LinePrefixer {
 public:
  /// A line longer than this is released in pieces of this size (each piece
  /// ending in '\n') so a rank that never ends a line cannot make fsdprun
  /// buffer without bound.
  static constexpr size_t kMaxLineBytes = 1 << 20;

  /// `prefix` is put in front of every line; empty disables prefixing.
  explicit LinePrefixer(std::string prefix);

  /// Consumes `data` and appends every line it completes, prefixed and with
  /// its ending, to `out`.
  void feed(std::string_view data, std::string* out);

  /// End of stream: appends a trailing partial line, prefixed and completed
  /// with '\n' so the next line of another rank starts on its own line.
  void finish(std::string* out);

  /// The rank went quiet in mid-line (a prompt, dots of progress): appends
  /// the partial line, prefixed, without an ending, as torchrun shows what
  /// it reads. Its rest comes later without a prefix.
  void flush_partial(std::string* out);

  /// Whether flush_partial() began a line that has not ended.
  bool mid_line() const { return mid_line_; }

  /// The caller ended that line ('\n') for another rank's output: the rest
  /// of it comes prefixed, as a line of its own.
  void break_line() { mid_line_ = false; }

  /// Bytes of an incomplete line held back so far.
  size_t pending_bytes() const { return partial_.size(); }

 private:
  /// Appends prefix + `line` + `ending` to `out` (no prefix for the rest of
  /// a line flush_partial() began).
  void emit(std::string_view line, std::string* out, std::string_view ending = "\n");

  std::string prefix_;
  std::string partial_;
  bool ended_at_cr_ = false;  // the last feed ended with a line ended by '\r'
  bool mid_line_ = false;     // flush_partial() began a line that has not ended
};

/// torchrun's --log-line-prefix-template filled in as Python's
/// string.Template.safe_substitute fills it: "${name}" and "$name" become
/// `values`' entry (torchrun's: rank, local_rank, role_name, hostname), "$$"
/// becomes "$", and anything else stays as written.
std::string expand_prefix_template(const std::string& text,
                                   const std::map<std::string, std::string>& values);

}  // namespace fsdp::launch
