// fsdprun_test_rank: a stand-in for a training program, started by fsdprun in
// the launch tests. What it does is chosen by its arguments, applied in this
// order:
//
//   --ignore-sigterm               ignore SIGTERM (only SIGKILL stops it)
//   --record-signals               on SIGTERM, SIGINT, SIGHUP, SIGQUIT,
//                                  SIGUSR1 or SIGUSR2, write its number to
//                                  DIR/<RANK>.signal and exit with 128 + it
//                                  (needs --write-pid-dir)
//   --spawn-grandchild             fork a child that sleeps forever in the
//                                  same process group (needs --write-pid-dir;
//                                  its pid goes to DIR/<RANK>.grandchild.pid)
//   --write-pid-dir DIR            write getpid() to DIR/<RANK>.pid
//   --barrier                      wait (<= 10 s) until LOCAL_WORLD_SIZE
//                                  <n>.pid files exist in the pid dir, so a
//                                  test knows every rank was up before one
//                                  fails
//   --print-env                    print KEY=VALUE for the launcher variables
//   --lines N                      print N long lines to stdout, each in
//                                  several write() calls
//   --stderr-lines N               print N lines to stderr
//   --partial-line                 end stdout with a line lacking '\n'
//   --exit-code-on-rank R:C        exit with C if RANK == R (repeatable)
//   --exit-code-if-restart-below N:C
//                                  exit with C if TORCHELASTIC_RESTART_COUNT<N
//   --kill-self-on-rank R:S        raise signal S if RANK == R
//   --sleep S                      sleep S seconds ("inf": forever), exit 0
//   --print-argv ARGS...           print every following argument verbatim
//
// Unknown arguments make it exit with 64 so test typos fail loudly.

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace {

/// Exit code for a malformed test-rank command line.
constexpr int kUsageError = 64;

/// The variables fsdprun promises to set, printed by --print-env.
constexpr const char* kEnvNames[] = {
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "FSDP_JOB_TOKEN",
    "OMP_NUM_THREADS",
};

/// The parsed command line.
struct Args {
  bool ignore_sigterm = false;
  bool record_signals = false;
  bool spawn_grandchild = false;
  std::string pid_dir;
  bool barrier = false;
  bool print_env = false;
  int lines = 0;
  int stderr_lines = 0;
  bool partial_line = false;
  std::vector<std::pair<int, int>> exit_code_on_rank;
  std::vector<std::pair<int, int>> exit_code_if_restart_below;
  std::vector<std::pair<int, int>> kill_self_on_rank;
  double sleep_s = 0;
  bool print_argv = false;
  std::vector<std::string> argv_to_print;
};

/// Reports a usage error and exits.
[[noreturn]] void usage_error(const std::string& message) {
  std::fprintf(stderr, "fsdprun_test_rank: %s\n", message.c_str());
  std::exit(kUsageError);
}

/// Parses "A:B" as two integers.
std::pair<int, int> parse_pair(const std::string& text) {
  const size_t colon = text.find(':');
  if (colon == std::string::npos) usage_error("expected A:B, got " + text);
  return {std::atoi(text.substr(0, colon).c_str()), std::atoi(text.substr(colon + 1).c_str())};
}

/// Parses argv into Args; exits on anything unknown.
Args parse_args(int argc, char** argv) {
  Args args;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) usage_error(arg + " needs a value");
      return argv[++i];
    };
    if (arg == "--ignore-sigterm") {
      args.ignore_sigterm = true;
    } else if (arg == "--record-signals") {
      args.record_signals = true;
    } else if (arg == "--spawn-grandchild") {
      args.spawn_grandchild = true;
    } else if (arg == "--write-pid-dir") {
      args.pid_dir = next();
    } else if (arg == "--barrier") {
      args.barrier = true;
    } else if (arg == "--print-env") {
      args.print_env = true;
    } else if (arg == "--lines") {
      args.lines = std::atoi(next().c_str());
    } else if (arg == "--stderr-lines") {
      args.stderr_lines = std::atoi(next().c_str());
    } else if (arg == "--partial-line") {
      args.partial_line = true;
    } else if (arg == "--exit-code-on-rank") {
      args.exit_code_on_rank.push_back(parse_pair(next()));
    } else if (arg == "--exit-code-if-restart-below") {
      args.exit_code_if_restart_below.push_back(parse_pair(next()));
    } else if (arg == "--kill-self-on-rank") {
      args.kill_self_on_rank.push_back(parse_pair(next()));
    } else if (arg == "--sleep") {
      const std::string value = next();
      args.sleep_s = value == "inf" ? INFINITY : std::atof(value.c_str());
    } else if (arg == "--print-argv") {
      args.print_argv = true;
      args.argv_to_print.assign(argv + i + 1, argv + argc);
      break;
    } else {
      usage_error("unknown argument " + arg);
    }
  }
  if (args.spawn_grandchild && args.pid_dir.empty()) {
    usage_error("--spawn-grandchild needs --write-pid-dir");
  }
  if (args.record_signals && args.pid_dir.empty()) {
    usage_error("--record-signals needs --write-pid-dir");
  }
  if (args.barrier && args.pid_dir.empty()) {
    usage_error("--barrier needs --write-pid-dir");
  }
  return args;
}

/// An integer environment variable, or `fallback` when unset.
int env_int(const char* name, int fallback) {
  const char* value = std::getenv(name);
  return value != nullptr ? std::atoi(value) : fallback;
}

/// Writes `pid` to `path` atomically (temp file + rename) so a test polling
/// for the file never reads a half-written number.
void write_pid_file(const std::string& path, pid_t pid) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream file(tmp);
    file << pid << "\n";
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::perror("rename");
    std::exit(kUsageError);
  }
}

/// Writes all of `text` to `fd`.
void write_fd(int fd, const std::string& text) {
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) std::exit(1);
    done += static_cast<size_t>(n);
  }
}

/// --record-signals' file, made before any signal can come.
char g_signal_file[4096];

/// Records the signal (async-signal-safe calls only) and exits.
void record_signal(int signo) {
  const int fd = ::open(g_signal_file, O_WRONLY | O_CREAT | O_TRUNC, 0644);
  char digits[4] = {static_cast<char>('0' + signo / 10), static_cast<char>('0' + signo % 10), '\n'};
  if (fd >= 0) {
    (void)!::write(fd, signo >= 10 ? digits : digits + 1, signo >= 10 ? 3 : 2);
    ::close(fd);
  }
  ::_exit(128 + signo);
}

/// Sleeps forever; pause() returns after ignored-but-caught signals only, so
/// loop.
[[noreturn]] void sleep_forever() {
  while (true) ::pause();
}

/// Sleeps `seconds` (infinite: forever).
void sleep_for(double seconds) {
  if (std::isinf(seconds)) sleep_forever();
  if (seconds > 0) {
    std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
  }
}

}  // namespace

/// Runs the actions selected on the command line; see the file comment.
int main(int argc, char** argv) {
  const Args args = parse_args(argc, argv);
  const int rank = env_int("RANK", -1);
  const int restart = env_int("TORCHELASTIC_RESTART_COUNT", 0);

  if (args.record_signals) {
    std::snprintf(g_signal_file, sizeof(g_signal_file), "%s/%d.signal", args.pid_dir.c_str(), rank);
    for (const int signo : {SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2}) {
      ::signal(signo, record_signal);
    }
  }
  if (args.ignore_sigterm) ::signal(SIGTERM, SIG_IGN);

  if (args.spawn_grandchild) {
    const pid_t child = ::fork();
    if (child == 0) sleep_forever();  // Stays in the rank's process group.
    if (child < 0) {
      std::perror("fork");
      return 1;
    }
    write_pid_file(args.pid_dir + "/" + std::to_string(rank) + ".grandchild.pid", child);
  }
  if (!args.pid_dir.empty()) {
    write_pid_file(args.pid_dir + "/" + std::to_string(rank) + ".pid", ::getpid());
  }
  if (args.barrier) {
    const int local_world = env_int("LOCAL_WORLD_SIZE", 1);
    const int first = env_int("GROUP_RANK", 0) * local_world;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    for (int r = first; r < first + local_world;) {
      const std::string path = args.pid_dir + "/" + std::to_string(r) + ".pid";
      if (::access(path.c_str(), F_OK) == 0) {
        ++r;
      } else if (std::chrono::steady_clock::now() > deadline) {
        usage_error("--barrier timed out waiting for " + path);
      } else {
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      }
    }
  }

  if (args.print_env) {
    std::string text;
    for (const char* name : kEnvNames) {
      const char* value = std::getenv(name);
      text += std::string(name) + "=" + (value ? value : "<unset>") + "\n";
    }
    write_fd(STDOUT_FILENO, text);
  }
  for (const std::string& arg : args.argv_to_print) {
    write_fd(STDOUT_FILENO, "ARGV: " + arg + "\n");
  }
  // Each line goes out in three write() calls with yields in between, so the
  // launcher sees lines split across reads and ranks racing each other.
  const std::string payload(100, 'x');
  for (int i = 0; i < args.lines; ++i) {
    write_fd(STDOUT_FILENO, "line " + std::to_string(i) + " of rank ");
    std::this_thread::yield();
    write_fd(STDOUT_FILENO, std::to_string(rank) + " ");
    std::this_thread::yield();
    write_fd(STDOUT_FILENO, payload + "\n");
  }
  for (int i = 0; i < args.stderr_lines; ++i) {
    write_fd(STDERR_FILENO, "err " + std::to_string(i) + " of rank " + std::to_string(rank) + "\n");
  }
  if (args.partial_line) {
    write_fd(STDOUT_FILENO, "tail of rank " + std::to_string(rank));
  }

  for (const auto& [on_rank, code] : args.exit_code_on_rank) {
    if (on_rank == rank) return code;
  }
  for (const auto& [below, code] : args.exit_code_if_restart_below) {
    if (restart < below) return code;
  }
  for (const auto& [on_rank, signo] : args.kill_self_on_rank) {
    if (on_rank == rank) {
      ::signal(signo, SIG_DFL);
      ::raise(signo);
    }
  }
  sleep_for(args.sleep_s);
  return 0;
}
