#include "progress.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <sstream>
#include <stdexcept>

namespace train_gpt {
namespace {

// Clears the current line (where fsdprun may have put its "[rankN]: " prefix),
// then moves up to the previous bar and clears it.
constexpr const char* kCursorUpClearLine = "\x1b[2K\x1b[1A\x1b[2K\r";

std::string fixed(double v, int digits) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.*f", digits, v);
  return buf;
}

std::string memory_per_rank(const std::vector<int64_t>& bytes) {
  std::string out;
  for (size_t r = 0; r < bytes.size(); ++r) {
    if (r > 0) out += " ";
    out += "r" + std::to_string(r) + " " + format_bytes(bytes[r]);
  }
  return out;
}

}  // namespace

ProgressMode resolve_progress_mode(ProgressMode mode) {
  if (mode != ProgressMode::kAuto) return mode;
  const char* launcher_tty = std::getenv("FSDPRUN_STDOUT_TTY");
  const bool tty =
      ::isatty(STDOUT_FILENO) != 0 || (launcher_tty != nullptr && std::string(launcher_tty) == "1");
  return tty ? ProgressMode::kBar : ProgressMode::kLog;
}

std::string format_duration(double seconds) {
  const auto s = static_cast<int64_t>(std::max(0.0, seconds) + 0.5);
  char buf[64];
  if (s >= 3600) {
    std::snprintf(buf, sizeof(buf), "%lld:%02lld:%02lld", static_cast<long long>(s / 3600),
                  static_cast<long long>(s / 60 % 60), static_cast<long long>(s % 60));
  } else {
    std::snprintf(buf, sizeof(buf), "%lld:%02lld", static_cast<long long>(s / 60),
                  static_cast<long long>(s % 60));
  }
  return buf;
}

ProgressDisplay::ProgressDisplay(ProgressMode mode, bool active, int64_t log_interval)
    : mode_(mode), active_(active && mode != ProgressMode::kNone), log_interval_(log_interval) {}

std::string ProgressDisplay::bar_line(const StepReport& r) const {
  constexpr int kWidth = 24;
  const double frac = static_cast<double>(r.step) / static_cast<double>(r.total);
  const int filled = static_cast<int>(frac * kWidth);
  std::string bar(static_cast<size_t>(filled), '#');
  bar.resize(kWidth, '.');
  std::ostringstream s;
  s << "[" << bar << "] " << r.step << "/" << r.total << " loss " << fixed(r.loss, 4) << " | "
    << fixed(r.tokens_per_s / 1000.0, 1) << "k tok/s | ETA " << format_duration(r.eta_s)
    << " | peak mem " << memory_per_rank(r.peak_bytes);
  return s.str();
}

std::string ProgressDisplay::log_line(const StepReport& r) const {
  std::ostringstream s;
  s << "step " << r.step << "/" << r.total << " loss " << fixed(r.loss, 4) << " lr "
    << fixed(r.lr * 1e3, 3) << "e-3";
  if (r.grad_norm) s << " grad_norm " << fixed(*r.grad_norm, 3);
  s << " | " << static_cast<int64_t>(r.tokens_per_s) << " tok/s | ETA " << format_duration(r.eta_s)
    << " | peak mem " << memory_per_rank(r.peak_bytes);
  return s.str();
}

void ProgressDisplay::draw(const std::string& line) {
  // See Note [Progress bar through fsdprun].
  std::cout << (bar_shown_ ? kCursorUpClearLine : "") << line << "\n" << std::flush;
  bar_shown_ = true;
  last_bar_ = line;
}

void ProgressDisplay::step(const StepReport& report) {
  if (!active_) return;
  if (mode_ == ProgressMode::kBar) {
    draw(bar_line(report));
  } else if (report.step % log_interval_ == 0 || report.step == report.total || report.step == 1) {
    std::cout << log_line(report) << "\n" << std::flush;
  }
}

void ProgressDisplay::message(const std::string& text) {
  if (!active_) return;
  if (bar_shown_) {
    std::cout << kCursorUpClearLine << text << "\n";
    bar_shown_ = false;
    draw(last_bar_);
  } else {
    std::cout << text << "\n" << std::flush;
  }
}

MetricsLog::MetricsLog(const std::string& dir, int rank) {
  if (dir.empty()) return;
  // mkdir -p, errors ignored (open() below names the directory). Not with
  // C++17's filesystem library: some PyTorch wheels export its symbols and
  // break it (pytorch/pytorch#133437).
  for (size_t pos = dir.find('/', 1);; pos = dir.find('/', pos + 1)) {
    ::mkdir(dir.substr(0, pos).c_str(), 0777);
    if (pos == std::string::npos) break;
  }
  path_ = dir + (dir.back() == '/' ? "" : "/") + "rank" + std::to_string(rank) + ".jsonl";
  fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd_ < 0) {
    throw std::runtime_error("cannot write metrics file '" + path_ + "' (--metrics-dir): " +
                             std::strerror(errno) + "; check that the directory is writable");
  }
}

MetricsLog::~MetricsLog() {
  if (fd_ >= 0) ::close(fd_);
}

void MetricsLog::write(const nlohmann::json& record) {
  if (fd_ < 0) return;
  const std::string line = record.dump() + "\n";
  for (size_t done = 0; done < line.size();) {
    const ssize_t n = ::write(fd_, line.data() + done, line.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const std::string why = n < 0 ? std::strerror(errno) : "nothing written";
      // Keep the file whole lines (a reader parses every line).
      if (::ftruncate(fd_, size_) == 0) ::lseek(fd_, size_, SEEK_SET);
      throw std::runtime_error("cannot write metrics file '" + path_ + "' (--metrics-dir): " + why +
                               "; free space there or pass another --metrics-dir");
    }
    done += static_cast<size_t>(n);
  }
  size_ += static_cast<int64_t>(line.size());
}

}  // namespace train_gpt
