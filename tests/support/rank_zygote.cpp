#include "rank_zygote.h"

#include <dirent.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <set>

#include "multi_rank.h"

// Note [Rank processes from a zygote]
// A rank process exec'd afresh loads LibTorch again: relocations and operator
// registration cost a core 0.5 s (1.4 s under ASan), and a suite starts
// hundreds of ranks (the core tests 272: 136 of their 153 CPU seconds under
// PyTorch 2.11's wheel). So main() forks a zygote before anything else runs:
// one thread, LibTorch loaded and initialised, no test begun. The test
// process sends it each rank's arguments, environment and log over a socket
// pair; the zygote forks, and the child returns into main() with them, as an
// exec'd process would have started (test_main.cpp). What fork does not redo,
// or cannot:
//   - what a library reads from the environment when it loads: libgomp and
//     OpenBLAS read OMP_NUM_THREADS then, so a rank sets their thread counts
//     from its own environment (become(), test_main.cpp);
//   - a process with threads cannot be forked safely (their locks come along,
//     their work does not): the zygote starts only where the test process is
//     its only thread, once OpenBLAS (Debian's LibTorch links it) has stopped
//     the pool it started when it loaded, as its own fork handler does; else
//     ranks are exec'd as before.
// Under ASan the ranks of 8 core tests took 59 s exec'd and 11 s forked.
// The ranks are the zygote's children, so it reaps them and reports each exit
// status; the test process kills a rank directly. A rank dies with the zygote
// (PDEATHSIG), and the zygote with the test process, or when the socket
// closes. FSDP_TEST_ZYGOTE=0 exec's every rank.

namespace fsdp::testing {

namespace {

constexpr int32_t kSpawned = 1;
constexpr int32_t kExited = 2;
// Largest request: arguments and environment of one rank.
constexpr size_t kMaxRequest = size_t{1} << 20;

struct Reply {
  int32_t kind = 0;
  int32_t pid = 0;
  int32_t status = 0;
};

struct Request {
  std::string log;
  std::vector<std::string> args;
  std::vector<std::string> env;
};

// The test process's end of the socket, -1 without a zygote.
int g_socket = -1;
// Ranks this process started itself (fork and exec), and waits for.
std::set<pid_t> g_execd;
// Exit statuses the zygote reported that no one has asked for yet.
std::map<pid_t, int> g_exited;

// Counted here, not with detail::list_dir: tests/support links no part of
// libfsdp (its programs link libfsdp, its comm objects, or neither).
int thread_count() {
  DIR* dir = ::opendir("/proc/self/task");
  if (dir == nullptr) return -1;
  int n = 0;
  while (const dirent* e = ::readdir(dir)) n += e->d_name[0] != '.';
  ::closedir(dir);
  return n;
}

// OpenBLAS starts its threads when it loads, and stops them before a fork
// (they start again when next needed): stop them now.
void stop_openblas_threads() {
  using Stop = int (*)();
  if (auto stop = reinterpret_cast<Stop>(::dlsym(RTLD_DEFAULT, "blas_thread_shutdown_"))) stop();
}

// The thread count OpenBLAS would have read from this environment at load.
void set_openblas_threads() {
  using Set = void (*)(int);
  auto set = reinterpret_cast<Set>(::dlsym(RTLD_DEFAULT, "openblas_set_num_threads"));
  if (set == nullptr) return;
  for (const char* var : {"OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "OMP_NUM_THREADS"}) {
    const char* value = std::getenv(var);
    if (value != nullptr && std::atoi(value) > 0) {
      set(std::atoi(value));
      return;
    }
  }
}

// Fields, each ended by NUL: log, argument count, arguments, environment.
std::string encode(const Request& r) {
  std::string out;
  auto put = [&out](const std::string& s) { out.append(s).push_back('\0'); };
  put(r.log);
  put(std::to_string(r.args.size()));
  for (const auto& a : r.args) put(a);
  for (const auto& e : r.env) put(e);
  return out;
}

Request decode(const char* data, size_t size) {
  std::vector<std::string> fields;
  for (size_t at = 0; at < size;) {
    const size_t len = ::strnlen(data + at, size - at);
    fields.emplace_back(data + at, len);
    at += len + 1;
  }
  Request r;
  if (fields.size() < 2) return r;
  r.log = fields[0];
  const size_t nargs =
      std::min<size_t>(std::strtoul(fields[1].c_str(), nullptr, 10), fields.size() - 2);
  r.args.assign(fields.begin() + 2, fields.begin() + 2 + static_cast<long>(nargs));
  r.env.assign(fields.begin() + 2 + static_cast<long>(nargs), fields.end());
  return r;
}

void send_reply(int sock, const Reply& reply) {
  if (::send(sock, &reply, sizeof(reply), MSG_NOSIGNAL) != sizeof(reply)) ::_exit(0);
}

// The zygote's loop. Returns only in a rank process, with its request.
Request serve(int sock) {
  const pid_t self = ::getpid();
  // Static, not from the heap: a 1 MiB block freed in the rank would raise
  // glibc's dynamic mmap threshold there, which an exec'd rank does not have
  // (test_block_cache's glibc control saw its memory reused).
  static char buf[kMaxRequest];
  int children = 0;
  for (;;) {
    pollfd p{sock, POLLIN, 0};
    if (::poll(&p, 1, children > 0 ? 5 : -1) > 0) {
      const ssize_t n = ::recv(sock, buf, sizeof(buf), 0);
      if (n <= 0) ::_exit(0);  // the test process has gone
      const pid_t pid = ::fork();
      if (pid == 0) {
        ::close(sock);
        ::prctl(PR_SET_PDEATHSIG, SIGKILL);
        if (::getppid() != self) ::_exit(125);
        return decode(buf, static_cast<size_t>(n));
      }
      children += pid > 0;
      send_reply(sock, {kSpawned, pid, 0});
    }
    int status = 0;
    for (pid_t done; (done = ::waitpid(-1, &status, WNOHANG)) > 0; --children)
      send_reply(sock, {kExited, done, status});
  }
}

// In a rank process forked from the zygote: what exec would have set up.
void become(const Request& r, int& argc, char**& argv) {
  const int fd = ::open(r.log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  if (fd >= 0) {
    ::dup2(fd, 1);
    ::dup2(fd, 2);
    ::close(fd);
  }
  ::clearenv();
  // putenv keeps the pointers: these live as long as the process.
  static std::vector<std::string> env;
  env = r.env;
  for (auto& e : env) ::putenv(e.data());
  set_openblas_threads();
  static std::vector<std::string> args;
  static std::vector<char*> ptrs;
  args = r.args;
  args.insert(args.begin(), "/proc/self/exe");
  for (auto& a : args) ptrs.push_back(a.data());
  ptrs.push_back(nullptr);
  argc = static_cast<int>(args.size());
  argv = ptrs.data();
}

enum class Read { kReply, kNothingYet, kZygoteGone };

Read read_reply(Reply& reply, bool block) {
  ssize_t n = 0;
  do {
    n = ::recv(g_socket, &reply, sizeof(reply), block ? 0 : MSG_DONTWAIT);
  } while (n < 0 && errno == EINTR);
  if (n == sizeof(reply)) return Read::kReply;
  return n < 0 && errno == EAGAIN ? Read::kNothingYet : Read::kZygoteGone;
}

// Takes the replies that have come; false once the zygote has gone (and every
// rank with it).
bool collect_exits(bool block) {
  for (Reply reply;;) {
    switch (read_reply(reply, block)) {
      case Read::kReply:
        g_exited[reply.pid] = reply.status;
        if (block) return true;
        break;
      case Read::kNothingYet:
        return true;
      case Read::kZygoteGone:
        return false;
    }
  }
}

// The status of pid if it has ended: reported, or the zygote gone.
bool take_exit(pid_t pid, bool zygote_alive, int& status) {
  const auto it = g_exited.find(pid);
  if (it != g_exited.end()) {
    status = it->second;
    g_exited.erase(it);
    return true;
  }
  if (zygote_alive) return false;
  status = SIGKILL;  // a wait status: killed by SIGKILL
  return true;
}

pid_t fork_exec(const std::vector<std::string>& args, const std::vector<std::string>& env,
                const std::string& log_path) {
  // Everything the child needs is prepared before fork(): only exec follows.
  std::vector<std::string> arg_strings = args;
  arg_strings.insert(arg_strings.begin(), "/proc/self/exe");
  std::vector<std::string> env_strings = env;
  std::vector<char*> argv, envp;
  for (auto& a : arg_strings) argv.push_back(a.data());
  argv.push_back(nullptr);
  for (auto& e : env_strings) envp.push_back(e.data());
  envp.push_back(nullptr);
  const int log_fd = ::open(log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);  // never outlive the test process
    if (::getppid() != parent) ::_exit(125);
    ::dup2(log_fd, 1);
    ::dup2(log_fd, 2);
    ::execve(argv[0], argv.data(), envp.data());
    ::_exit(127);
  }
  ::close(log_fd);
  return pid;
}

}  // namespace

void start_rank_zygote(int& argc, char**& argv) {
  if (is_rank_process()) return;  // an exec'd rank
  if (const char* z = std::getenv("FSDP_TEST_ZYGOTE"); z != nullptr && std::strcmp(z, "0") == 0)
    return;
  if (thread_count() != 1) stop_openblas_threads();
  if (thread_count() != 1) return;
  int sv[2];
  if (::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) != 0) return;
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid < 0) {
    ::close(sv[0]);
    ::close(sv[1]);
    return;
  }
  if (pid == 0) {
    ::close(sv[0]);
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(0);
    become(serve(sv[1]), argc, argv);
    return;
  }
  ::close(sv[1]);
  g_socket = sv[0];
}

pid_t spawn_rank(const std::vector<std::string>& args, const std::vector<std::string>& env,
                 const std::string& log_path) {
  const std::string request = encode({log_path, args, env});
  // A request the socket does not take (an environment of megabytes) is exec'd.
  if (g_socket < 0 || request.size() > kMaxRequest ||
      ::send(g_socket, request.data(), request.size(), MSG_NOSIGNAL) !=
          static_cast<ssize_t>(request.size())) {
    const pid_t pid = fork_exec(args, env, log_path);
    g_execd.insert(pid);
    return pid;
  }
  for (Reply reply; read_reply(reply, true) == Read::kReply;) {
    if (reply.kind == kSpawned) return reply.pid;
    g_exited[reply.pid] = reply.status;
  }
  return -1;
}

pid_t poll_rank(pid_t pid, int& status) {
  if (g_execd.count(pid) != 0) {
    if (::waitpid(pid, &status, WNOHANG) != pid) return 0;
    g_execd.erase(pid);
    return pid;
  }
  return take_exit(pid, collect_exits(false), status) ? pid : 0;
}

void wait_rank(pid_t pid, int& status) {
  if (g_execd.count(pid) != 0) {
    ::waitpid(pid, &status, 0);
    g_execd.erase(pid);
    return;
  }
  bool alive = collect_exits(false);
  while (!take_exit(pid, alive, status)) alive = collect_exits(true);
}

}  // namespace fsdp::testing
