#include "rendezvous.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "deadline.h"
#include "detail/posix_socket.h"

// Note [fsdprun's rendezvous]
// torchrun's multi-node command is the same on every node (--rdzv-backend
// c10d --rdzv-endpoint HOST:PORT, no --node-rank), which a batch script can
// run everywhere. fsdprun does the same with a small protocol of its own:
// - The node that can listen on the endpoint's port, with HOST one of its
//   own addresses (or --rdzv-conf is_host=1, as torchrun's), serves the
//   rendezvous, on every interface as c10d's store, and is node 0, where
//   rank 0 runs. Every other node (and a second fsdprun on the serving
//   host, as in the tests) connects, resolving HOST and retrying until the
//   server is up.
// - A joining node sends "FSDPRUN-RDZV 3", its FSDP_JOB_TOKEN, --rdzv-id,
//   --nproc-per-node and --nnodes, a line each. The server refuses what
//   differs from its own with one line naming it ("ERR ..."; the token in
//   clear, as on every libfsdp connection: Note [Job token]) and goes on
//   waiting; it answers "WAIT" to a node it takes in, so that the node
//   tells waiting for nodes from a port held by something else; a
//   connection that does not speak the protocol is closed.
// - With --nnodes MIN:MAX, once MIN nodes have joined, node 0 waits
//   --rdzv-conf last_call_timeout (30 s) more, then the job is those that
//   joined (MAX at most): torchrun's elastic count, agreed at each meeting.
// - Once every node has joined, each hears "OK <node rank> <MASTER_ADDR>
//   <number of nodes>", in the order they joined, and the server
//   closes the port: rank 0's store then serves it (MASTER_PORT), so a job
//   needs that one port between nodes, as with torchrun. A node that leaves
//   before then gives up its place. MASTER_ADDR is HOST, unless the store,
//   which listens on MASTER_ADDR alone, could not be reached there: HOST
//   names only loopback addresses on node 0 while the others came from
//   elsewhere (Debian's /etc/hosts maps a host's own name to 127.0.1.1), or
//   none of node 0's (is_host=1 behind a virtual IP); then the address the
//   first node reached. Node 0's --local-addr, when given, is MASTER_ADDR
//   (torchrun's rank 0 announces its local_addr so).
// - Nodes wait at most --rdzv-conf join_timeout (600 s), saying every 30 s
//   how it stands. They meet again before every restart (--max-restarts),
//   so a node started anew in place of a lost one joins the job; until node
//   0's ranks of the attempt before have ended, rank 0's store still holds
//   the port and closes a joining node's connection unanswered, which the
//   node then tries again (once a second).
// Every node must start the same number of ranks (rank = node rank x
// nproc + local rank), which torchrun does not require. A node that comes
// after the job formed (one too many, or after the last call) finds rank
// 0's store on the port, which closes its connections unanswered: it tries
// again until the next meeting (a restart) or its join_timeout, unlike
// torchrun's, whose running nodes restart to let a waiting node in. On node
// 0's own host, in the moment before the store listens, it could take the
// port to serve a rendezvous of its own: several "nodes" on one host are for
// tests. Each node counts its own restarts; a node whose peers have given
// up waits until its join_timeout.

namespace fsdp::launch {
namespace {

using Clock = std::chrono::steady_clock;

constexpr char kMagic[] = "FSDPRUN-RDZV 3";  // 3: "OK" carries MASTER_ADDR and the count
constexpr int kJoinLines = 5;
constexpr size_t kMaxJoinBytes = 4096;
constexpr auto kJoinReadLimit = std::chrono::seconds(5);
constexpr auto kProgressEvery = std::chrono::seconds(30);
constexpr auto kRetryEvery = std::chrono::milliseconds(200);
constexpr auto kClosedRetryEvery = std::chrono::seconds(1);
constexpr size_t kMaxPending = 256;  // connections still saying who they are

using detail::UniqueFd;

/// What a joining node says about itself.
struct Join {
  std::string token;
  std::string run_id;
  std::string nproc;
  std::string nnodes;
};

std::string endpoint_of(const LaunchOptions& o) {
  const bool v6 = o.rdzv_host.find(':') != std::string::npos;
  return (v6 ? "[" + o.rdzv_host + "]" : o.rdzv_host) + ":" + std::to_string(o.rdzv_port);
}

/// --nnodes as given: "N", or "MIN:MAX".
std::string nnodes_of(const LaunchOptions& o) {
  return (o.min_nnodes > 0 ? std::to_string(o.min_nnodes) + ":" : "") + std::to_string(o.nnodes);
}

std::string join_message(const LaunchOptions& o, const std::string& token) {
  return std::string(kMagic) + "\n" + token + "\n" + o.rdzv_id + "\n" +
         std::to_string(o.nproc_per_node) + "\n" + nnodes_of(o) + "\n";
}

/// A whole join message (kJoinLines lines), or nullopt if it is not one.
std::optional<Join> parse_join(const std::string& text) {
  std::istringstream lines(text);
  std::string magic;
  Join join;
  if (!std::getline(lines, magic) || magic != kMagic) return std::nullopt;
  if (!std::getline(lines, join.token) || !std::getline(lines, join.run_id) ||
      !std::getline(lines, join.nproc) || !std::getline(lines, join.nnodes)) {
    return std::nullopt;
  }
  return join;
}

/// Equal strings, in time independent of where they differ.
bool same_secret(const std::string& a, const std::string& b) {
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  }
  return diff == 0;
}

/// Why the serving node refuses `theirs`, or "".
std::string why_refused(const Join& theirs, const LaunchOptions& ours, const std::string& token) {
  if (!same_secret(theirs.token, token)) {
    return "its FSDP_JOB_TOKEN differs from node 0's: export the same token on every node";
  }
  if (theirs.run_id != ours.rdzv_id) {
    return "its --rdzv-id '" + theirs.run_id + "' differs from node 0's '" + ours.rdzv_id +
           "' (another job's node?)";
  }
  if (theirs.nnodes != nnodes_of(ours)) {
    return "its --nnodes " + theirs.nnodes + " differs from node 0's " + nnodes_of(ours);
  }
  if (theirs.nproc != std::to_string(ours.nproc_per_node)) {
    return "its --nproc-per-node " + theirs.nproc + " differs from node 0's " +
           std::to_string(ours.nproc_per_node) + ": every node starts the same number of ranks";
  }
  return "";
}

/// Sends all of `text`, ignoring a peer that went away.
void send_all(int fd, const std::string& text) {
  size_t sent = 0;
  while (sent < text.size()) {
    const ssize_t n = ::send(fd, text.data() + sent, text.size() - sent, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    sent += static_cast<size_t>(n);
  }
}

}  // namespace

std::string peer_name(const sockaddr_storage& addr) {
  char host[INET6_ADDRSTRLEN] = "?";
  if (addr.ss_family == AF_INET) {
    ::inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in&>(addr).sin_addr, host, sizeof(host));
  } else if (addr.ss_family == AF_INET6) {
    ::inet_ntop(AF_INET6, &reinterpret_cast<const sockaddr_in6&>(addr).sin6_addr, host,
                sizeof(host));
  }
  const std::string name = host;
  // An IPv4 peer of the dual-stack listener, as it would write itself.
  const std::string mapped = "::ffff:";
  if (name.rfind(mapped, 0) == 0 && name.find('.') != std::string::npos) {
    return name.substr(mapped.size());
  }
  return name;
}

namespace {

/// The endpoint's addresses (numeric port).
std::vector<sockaddr_storage> resolve(const LaunchOptions& o, std::string* error) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const std::string port = std::to_string(o.rdzv_port);
  if (const int rc = ::getaddrinfo(o.rdzv_host.c_str(), port.c_str(), &hints, &found); rc != 0) {
    *error = "--rdzv-endpoint " + endpoint_of(o) + ": cannot resolve '" + o.rdzv_host + "' (" +
             ::gai_strerror(rc) + ")";
    return {};
  }
  std::vector<sockaddr_storage> out;
  for (const addrinfo* a = found; a != nullptr; a = a->ai_next) {
    sockaddr_storage s{};
    std::memcpy(&s, a->ai_addr, a->ai_addrlen);
    out.push_back(s);
  }
  ::freeaddrinfo(found);
  return out;
}

socklen_t length_of(const sockaddr_storage& s) {
  return s.ss_family == AF_INET6 ? sizeof(sockaddr_in6) : sizeof(sockaddr_in);
}

/// Whether `addr` is one of this host's addresses (binding it works).
bool is_local(sockaddr_storage addr) {
  UniqueFd probe(::socket(addr.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!probe.valid()) return false;
  if (addr.ss_family == AF_INET6) {
    reinterpret_cast<sockaddr_in6&>(addr).sin6_port = 0;
  } else {
    reinterpret_cast<sockaddr_in&>(addr).sin_port = 0;
  }
  return ::bind(probe.get(), reinterpret_cast<sockaddr*>(&addr), length_of(addr)) == 0;
}

/// A socket listening on every interface at `port` (IPv6 and IPv4 where the
/// host has IPv6), or an invalid one (the port is taken: someone else serves).
UniqueFd listen_everywhere(int port) {
  for (const int f : {AF_INET6, AF_INET}) {
    // Non-blocking: a connection gone between poll() and accept() must not
    // stop the loop.
    UniqueFd s(::socket(f, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
    if (!s.valid()) continue;
    const int one = 1, zero = 0;
    ::setsockopt(s.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    sockaddr_storage any{};
    if (f == AF_INET6) {
      ::setsockopt(s.get(), IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof(zero));
      auto& a6 = reinterpret_cast<sockaddr_in6&>(any);
      a6.sin6_family = AF_INET6;
      a6.sin6_addr = in6addr_any;
      a6.sin6_port = htons(static_cast<uint16_t>(port));
    } else {
      auto& a4 = reinterpret_cast<sockaddr_in&>(any);
      a4.sin_family = AF_INET;
      a4.sin_addr.s_addr = htonl(INADDR_ANY);
      a4.sin_port = htons(static_cast<uint16_t>(port));
    }
    if (::bind(s.get(), reinterpret_cast<sockaddr*>(&any), length_of(any)) == 0 &&
        ::listen(s.get(), 64) == 0) {
      return s;
    }
    if (errno == EADDRINUSE) return UniqueFd();
  }
  return UniqueFd();
}

std::string seconds(double s) {
  std::ostringstream out;
  out << s;
  return out.str();
}

}  // namespace

std::string meeting_address(const std::string& host, const std::vector<sockaddr_storage>& endpoint,
                            bool endpoint_here, const sockaddr_storage& first_peer,
                            const sockaddr_storage& first_reached) {
  const bool loopback_here = std::all_of(endpoint.begin(), endpoint.end(), detail::is_loopback);
  const bool unreachable = !endpoint_here || (loopback_here && !detail::is_loopback(first_peer));
  return unreachable ? peer_name(first_reached) : host;
}

namespace {

Clock::time_point deadline_of(const LaunchOptions& o) {
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(
                            std::chrono::duration<double>(o.join_timeout_s));
}

/// Node 0: waits for the others on `listener`, then tells each its rank and
/// where the ranks meet.
bool serve(UniqueFd listener, const std::vector<sockaddr_storage>& endpoint, bool endpoint_here,
           const LaunchOptions& o, const std::string& token, const Hooks& hooks,
           Assignment* assignment, std::string* error) {
  const auto& progress = hooks.progress;
  struct Pending {
    UniqueFd socket;
    std::string received;
    Clock::time_point since;
    sockaddr_storage peer{};
    sockaddr_storage reached{};  // this node's address as the peer reached it
  };
  std::vector<Pending> pending;
  std::vector<Pending> joined;
  const Clock::time_point deadline = deadline_of(o);
  Clock::time_point next_progress = Clock::now() + kProgressEvery;
  // --nnodes MIN:MAX: once MIN have joined, the job starts with those that
  // joined within last_call_timeout more, MAX at most.
  const size_t others = static_cast<size_t>(o.nnodes - 1);
  const size_t enough = static_cast<size_t>((o.min_nnodes > 0 ? o.min_nnodes : o.nnodes) - 1);
  const auto last_call = std::chrono::duration_cast<Clock::duration>(
      std::chrono::duration<double>(o.last_call_timeout_s));
  std::optional<Clock::time_point> enough_since;
  const auto joined_line = [&] {
    return std::to_string(joined.size() + 1) + " of " + nnodes_of(o) + " nodes have joined";
  };
  progress("fsdprun: node 0 serves the rendezvous at " + endpoint_of(o) + "; waiting for " +
           (o.min_nnodes > 0 ? nnodes_of(o) + " nodes" : std::to_string(others) + " more node(s)"));
  while (joined.size() < others) {
    const Clock::time_point now = Clock::now();
    if (joined.size() < enough) enough_since.reset();
    if (joined.size() >= enough && !enough_since) enough_since = now;
    if (hooks.stopped()) {
      for (Pending& p : joined) send_all(p.socket.get(), "ERR node 0 was stopped\n");
      *error = "stopped during the rendezvous";
      return false;
    }
    if (enough_since && now >= *enough_since + last_call) break;
    if (now >= deadline) {
      for (Pending& p : joined) send_all(p.socket.get(), "ERR the rendezvous timed out\n");
      *error = "the rendezvous at " + endpoint_of(o) + " timed out after " +
               seconds(o.join_timeout_s) + " s: " + joined_line() +
               ". Start fsdprun on every node with the same --nnodes, --rdzv-endpoint and "
               "FSDP_JOB_TOKEN, or raise --rdzv-conf join_timeout";
      return false;
    }
    if (now >= next_progress) {
      progress("fsdprun: rendezvous at " + endpoint_of(o) + ": " + joined_line() + ", waiting " +
               seconds(std::chrono::duration<double>(deadline - now).count()) + " s more");
      next_progress = now + kProgressEvery;
    }
    // At kMaxPending, new connections wait in the listen backlog.
    std::vector<pollfd> fds{
        {listener.get(), static_cast<short>(pending.size() < kMaxPending ? POLLIN : 0), 0}};
    for (const Pending& p : joined) fds.push_back({p.socket.get(), POLLIN, 0});
    for (const Pending& p : pending) fds.push_back({p.socket.get(), POLLIN, 0});
    Clock::time_point wake = std::min({deadline, next_progress, Clock::now() + kRetryEvery});
    if (enough_since) wake = std::min(wake, *enough_since + last_call);
    for (const Pending& p : pending) wake = std::min(wake, p.since + kJoinReadLimit);
    if (::poll(fds.data(), fds.size(), std::max(ms_until(wake), 1)) < 0 && errno != EINTR) {
      *error = std::string("rendezvous: poll failed: ") + std::strerror(errno);
      return false;
    }
    // A joined node that hangs up (its fsdprun stopped) gives up its place.
    std::vector<Pending> staying;
    for (size_t k = 0; k < joined.size(); ++k) {
      char byte;
      if (fds[1 + k].revents != 0 && ::recv(joined[k].socket.get(), &byte, 1, MSG_DONTWAIT) <= 0) {
        progress("fsdprun: the node from " + peer_name(joined[k].peer) +
                 " left before the job was whole");
        continue;
      }
      staying.push_back(std::move(joined[k]));
    }
    // Joining nodes, in the order they connected.
    std::vector<Pending> waiting;
    for (size_t k = 0; k < pending.size(); ++k) {
      Pending& p = pending[k];
      bool done = Clock::now() - p.since > kJoinReadLimit;
      if (!done && fds[1 + joined.size() + k].revents != 0) {
        char buffer[1024];
        const ssize_t n = ::recv(p.socket.get(), buffer, sizeof(buffer), MSG_DONTWAIT);
        if (n > 0) p.received.append(buffer, static_cast<size_t>(n));
        done = n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR) ||
               p.received.size() > kMaxJoinBytes;
      }
      if (!done && std::count(p.received.begin(), p.received.end(), '\n') >= kJoinLines) {
        done = true;
        if (const std::optional<Join> join = parse_join(p.received)) {
          std::string why = why_refused(*join, o, token);
          if (why.empty() && staying.size() == others) {
            why = "the job already has its " + std::to_string(o.nnodes) +
                  " nodes (--nnodes): this one is too many";
          }
          if (why.empty()) {
            // Said at once, so that the node knows it is in (and waits for
            // nodes, not for a port held by something else).
            send_all(p.socket.get(), "WAIT\n");
            staying.push_back(std::move(p));
            continue;
          }
          send_all(p.socket.get(), "ERR node 0 refused this node: " + why + "\n");
          progress("fsdprun: refused the node from " + peer_name(p.peer) + ": " + why);
        }
      }
      if (!done) waiting.push_back(std::move(p));
    }
    joined = std::move(staying);
    pending = std::move(waiting);
    if ((fds[0].revents & POLLIN) != 0) {
      Pending p;
      socklen_t length = sizeof(p.peer);
      p.socket = UniqueFd(
          ::accept4(listener.get(), reinterpret_cast<sockaddr*>(&p.peer), &length, SOCK_CLOEXEC));
      if (!p.socket.valid() && (errno == EMFILE || errno == ENFILE)) {
        // Out of descriptors: the oldest connection still joining goes, or,
        // with none, the loop waits instead of spinning on the listener.
        if (pending.empty()) std::this_thread::sleep_for(kRetryEvery);
        if (!pending.empty()) pending.erase(pending.begin());
      } else if (p.socket.valid()) {
        length = sizeof(p.reached);
        ::getsockname(p.socket.get(), reinterpret_cast<sockaddr*>(&p.reached), &length);
        p.since = Clock::now();
        pending.push_back(std::move(p));
      }
    }
  }
  // --local-addr: the user names node 0's address, as torchrun's rank 0 announces it.
  assignment->master_addr = !o.local_addr.empty() ? o.local_addr
                            : joined.empty()      ? o.rdzv_host
                                             : meeting_address(o.rdzv_host, endpoint, endpoint_here,
                                                               joined[0].peer, joined[0].reached);
  if (o.local_addr.empty() && assignment->master_addr != o.rdzv_host) {
    progress("fsdprun: rank 0's store cannot listen on '" + o.rdzv_host +
             "' for the other nodes (a loopback address here, or none of this node's); the "
             "ranks meet at " +
             assignment->master_addr + ", where the other nodes reached this node");
  }
  // The port goes to rank 0's store before anyone learns its rank.
  listener.reset();
  for (size_t k = 0; k < joined.size(); ++k) {
    send_all(joined[k].socket.get(), "OK " + std::to_string(k + 1) + " " + assignment->master_addr +
                                         " " + std::to_string(joined.size() + 1) + "\n");
  }
  assignment->node_rank = 0;
  assignment->nnodes = static_cast<int>(joined.size() + 1);
  return true;
}

/// A connection to the endpoint, or an invalid socket (nobody listens yet).
UniqueFd connect_to(const std::vector<sockaddr_storage>& addresses, Clock::time_point deadline) {
  for (const sockaddr_storage& a : addresses) {
    UniqueFd s(::socket(a.ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
    if (!s.valid()) continue;
    if (::connect(s.get(), reinterpret_cast<const sockaddr*>(&a), length_of(a)) != 0) {
      if (errno != EINPROGRESS) continue;
      pollfd pfd{s.get(), POLLOUT, 0};
      const auto limit = std::min(deadline, Clock::now() + std::chrono::seconds(5));
      if (::poll(&pfd, 1, std::max(ms_until(limit), 1)) <= 0) continue;
      int so_error = 0;
      socklen_t length = sizeof(so_error);
      ::getsockopt(s.get(), SOL_SOCKET, SO_ERROR, &so_error, &length);
      if (so_error != 0) continue;
    }
    return s;
  }
  return UniqueFd();
}

/// How a try at joining ended.
enum class Joined {
  kYes,       // the node has its rank
  kNo,        // refused, or stopped: `error` says why
  kClosed,    // the connection closed without an answer: try again
  kTimedOut,  // no answer within the deadline (`waited`: after node 0 took the node in)
};

/// Any other node, connected to node 0: joins and reads its rank.
Joined join(UniqueFd s, const LaunchOptions& o, const std::string& token,
            Clock::time_point deadline, const Hooks& hooks, Assignment* assignment, bool* waited,
            std::string* error) {
  const auto& progress = hooks.progress;
  send_all(s.get(), join_message(o, token));
  Clock::time_point next_progress = Clock::now() + kProgressEvery;
  std::string reply;
  *waited = false;
  for (;;) {
    // "WAIT": node 0 took this node in; the answer comes when the job is whole.
    if (reply.rfind("WAIT\n", 0) == 0) {
      *waited = true;
      reply.erase(0, 5);
    }
    if (reply.find('\n') != std::string::npos) break;
    const Clock::time_point now = Clock::now();
    if (hooks.stopped()) {
      *error = "stopped during the rendezvous";
      return Joined::kNo;
    }
    if (now >= deadline) return Joined::kTimedOut;
    if (now >= next_progress) {
      progress("fsdprun: joined the rendezvous at " + endpoint_of(o) +
               "; still waiting for the other nodes");
      next_progress = now + kProgressEvery;
    }
    pollfd pfd{s.get(), POLLIN, 0};
    const Clock::time_point wake = std::min({deadline, next_progress, now + kRetryEvery});
    if (::poll(&pfd, 1, std::max(ms_until(wake), 1)) <= 0) continue;
    char buffer[512];
    const ssize_t n = ::recv(s.get(), buffer, sizeof(buffer), MSG_DONTWAIT);
    if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (n <= 0) return Joined::kClosed;
    reply.append(buffer, static_cast<size_t>(n));
  }
  reply.resize(reply.find('\n'));
  std::istringstream words(reply);
  std::string ok;
  int rank = -1;
  int nnodes = 0;
  if (words >> ok >> rank >> assignment->master_addr >> nnodes && ok == "OK" && rank >= 1 &&
      rank < nnodes && nnodes <= o.nnodes) {
    assignment->node_rank = rank;
    assignment->nnodes = nnodes;
    return Joined::kYes;
  }
  *error = reply.rfind("ERR ", 0) == 0 ? reply.substr(4)
                                       : "the rendezvous endpoint " + endpoint_of(o) +
                                             " answered something else than fsdprun's protocol";
  return Joined::kNo;
}

}  // namespace

bool join_rendezvous(const LaunchOptions& options, const std::string& token, const Hooks& hooks,
                     Assignment* assignment, std::string* error) {
  const auto& progress = hooks.progress;
  if (token.find('\n') != std::string::npos) {
    *error = "FSDP_JOB_TOKEN must be one line";
    return false;
  }
  const Clock::time_point deadline = deadline_of(options);
  Clock::time_point next_progress = Clock::now() + kProgressEvery;
  // FSDP_FAULT_RDZV_LISTEN_RACE=1: this node's first try to serve fails, as
  // when two nodes' listen() race (tests/launch: they still meet).
  const char* fault = std::getenv("FSDP_FAULT_RDZV_LISTEN_RACE");
  bool fail_first_listen = fault != nullptr && std::string(fault) == "1";
  std::minstd_rand jitter(std::random_device{}());
  bool closed = false;         // whether the last try's connection closed unanswered
  bool closed_before = false;  // whether any try's did
  bool announced = false;      // whether this node said it joined
  std::string resolve_error;
  for (;;) {
    // Resolved again on every try: a name may appear only once its node is
    // up (a Kubernetes service, a fresh DNS record).
    const std::vector<sockaddr_storage> addresses = resolve(options, &resolve_error);
    // Note [Serving the rendezvous]
    // The node with the endpoint's address serves it, if it can listen on
    // the port. Tried again on every try until this node has joined one:
    // two nodes of one host (or two launchers of one node) starting
    // together can both fail to listen, as Linux marks a socket listening
    // before it checks the port for another listener, and then neither
    // served and both waited for the join timeout. A try a random 0-200 ms
    // later lets one of them win.
    bool may_serve = false;
    if (!addresses.empty() && !announced) {
      const bool local = std::any_of(addresses.begin(), addresses.end(), is_local);
      may_serve = options.rdzv_is_host.value_or(local);
      if (may_serve) {
        UniqueFd listener = std::exchange(fail_first_listen, false)
                                ? UniqueFd()
                                : listen_everywhere(options.rdzv_port);
        if (listener.valid()) {
          return serve(std::move(listener), addresses, local, options, token, hooks, assignment,
                       error);
        }
        // Only a first try gets here: with is_host=1 it serves or fails.
        if (options.rdzv_is_host.value_or(false)) {
          *error = "--rdzv-conf is_host=1, but port " + std::to_string(options.rdzv_port) +
                   " is taken on this node";
          return false;
        }
      }
    }
    auto retry_after = kRetryEvery;
    if (!addresses.empty()) {
      UniqueFd s = connect_to(addresses, deadline);
      closed = false;
      if (s.valid()) {
        if (!announced) {
          progress("fsdprun: joined the rendezvous at " + endpoint_of(options) +
                   "; waiting for the other nodes");
          announced = true;
        }
        // Closed unanswered: rank 0's store of the attempt before a restart,
        // still there until node 0's ranks end (or another program).
        bool waited = false;
        const Joined joined =
            join(std::move(s), options, token, deadline, hooks, assignment, &waited, error);
        if (joined == Joined::kYes || joined == Joined::kNo) return joined == Joined::kYes;
        if (joined == Joined::kTimedOut && (waited || !closed_before)) {
          *error = "the rendezvous at " + endpoint_of(options) + " did not complete within " +
                   seconds(options.join_timeout_s) + " s (nodes missing?)";
          return false;
        }
        closed = true;
        closed_before = true;
        retry_after = kClosedRetryEvery;
      }
    }
    if (hooks.stopped()) {
      *error = "stopped during the rendezvous";
      return false;
    }
    if (Clock::now() >= deadline) {
      *error = addresses.empty() ? resolve_error + " for " + seconds(options.join_timeout_s) + " s"
               : closed          ? "the rendezvous endpoint " + endpoint_of(options) +
                              " closed the connection without a node rank for " +
                              seconds(options.join_timeout_s) +
                              " s: another program holds the port, or the job started without this "
                              "node"
                        : "no rendezvous at " + endpoint_of(options) + " after " +
                              seconds(options.join_timeout_s) +
                              " s: the node that serves it (the one with that address) has not "
                              "started fsdprun with --rdzv-backend c10d, or the port is blocked "
                              "between nodes";
      return false;
    }
    if (Clock::now() >= next_progress) {
      progress(addresses.empty()
                   ? "fsdprun: " + resolve_error + "; trying again"
                   : "fsdprun: waiting for the rendezvous at " + endpoint_of(options) +
                         " (served by the node with that address)");
      next_progress = Clock::now() + kProgressEvery;
    }
    if (may_serve && !closed) {
      retry_after = std::chrono::milliseconds(std::uniform_int_distribution<int>(0, 200)(jitter));
    }
    std::this_thread::sleep_for(retry_after);
  }
}

}  // namespace fsdp::launch
