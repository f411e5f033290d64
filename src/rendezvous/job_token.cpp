#include "rendezvous/job_token.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "detail/error.h"

// Note [Job token]
// The store and the direct links listen on addresses other hosts (and every
// process of this host) can reach, and c10d offers nothing to tell this job's
// ranks from anyone else: a second job that reuses MASTER_PORT, a port
// scanner, a stranger. So every connection libfsdp accepts must first present
// the job token, a secret all ranks of the job share:
// - Source: ProcessGroupOptions::job_token, else FSDP_JOB_TOKEN, else the
//   empty token. fsdprun makes a random one (128 bits, hex) for a one-node job
//   and requires FSDP_JOB_TOKEN for --nnodes > 1 (it must be the same on every
//   node). Ranks started by hand with no token still work: they all present
//   the empty token, so the protocol is the same and a stranger that does not
//   speak it is still refused.
// - Handshake (the connecting side, before any request; little-endian):
//     "FSDPJT" | u16 version (1) | u32 token length (<= 256) | token bytes
//   The accepting side answers "JTOK" once the token matches. A peer that
//   spoke the handshake with a different token hears "JTNO" and the
//   connection closes: a rank of another job (or with a stale token) then
//   fails with an error saying its FSDP_JOB_TOKEN differs from the job's,
//   not with a lost connection. Anything else (wrong magic or version, an
//   oversized length, EOF, or nothing complete within kHandshakeTimeout, 5 s,
//   not the collective timeout) is closed at once without a byte. Readers
//   never read past the handshake, so what follows is the connection's own
//   protocol, unchanged.
// - Tokens of equal length are compared in constant time (the length is not
//   secret: fsdprun's are always 32 digits).
// - Every refusal is counted (refused_connections()); the first in a process
//   is logged on stderr in one line, later ones are only counted, so a flood
//   cannot fill the log.
// - The token is not encryption: it travels in clear, like everything else on
//   these connections. It keeps out other jobs and strangers that cannot read
//   this job's traffic, not someone who can.
// - Gloo's own listeners (LibTorch 1.13 builds) cannot carry the handshake.
//   They are open only while a pair connects and their addresses are
//   published only through the store, which is guarded; a stranger that wins
//   the race for one makes set-up fail (never hang). See docs/communication.md
//   and the test HostileConnectionsToTheGlooListener.

namespace fsdp::detail {

namespace {

constexpr char kMagic[6] = {'F', 'S', 'D', 'P', 'J', 'T'};
constexpr uint16_t kVersion = 1;
constexpr char kAck[kHandshakeAckBytes] = {'J', 'T', 'O', 'K'};
constexpr char kNack[kHandshakeAckBytes] = {'J', 'T', 'N', 'O'};

std::atomic<uint64_t> g_refused{0};
std::atomic<bool> g_logged{false};

bool same_token(const uint8_t* got, size_t n, const std::string& token) {
  if (n != token.size()) return false;
  uint8_t diff = 0;
  for (size_t i = 0; i < n; ++i) diff |= static_cast<uint8_t>(got[i] ^ token[i]);
  return diff == 0;
}

// Best effort, never blocking: "JTNO", then what the peer already sent after
// its handshake is read and dropped, so that closing sends a FIN rather than
// a reset that could overtake the answer.
void tell_wrong_token(int fd) {
  if (::send(fd, kNack, sizeof(kNack), MSG_DONTWAIT | MSG_NOSIGNAL) != sizeof(kNack)) return;
  char sink[4096];
  for (int i = 0; i < 16 && ::recv(fd, sink, sizeof(sink), MSG_DONTWAIT) > 0; ++i) {
  }
}

std::string peer_of(int fd) {
  sockaddr_storage ss{};
  socklen_t len = sizeof(ss);
  if (::getpeername(fd, reinterpret_cast<sockaddr*>(&ss), &len) != 0) return "an unknown peer";
  char host[INET6_ADDRSTRLEN] = {0};
  if (ss.ss_family == AF_INET) {
    const auto* a = reinterpret_cast<const sockaddr_in*>(&ss);
    ::inet_ntop(AF_INET, &a->sin_addr, host, sizeof(host));
    return std::string(host) + ":" + std::to_string(ntohs(a->sin_port));
  }
  if (ss.ss_family == AF_INET6) {
    const auto* a = reinterpret_cast<const sockaddr_in6*>(&ss);
    ::inet_ntop(AF_INET6, &a->sin6_addr, host, sizeof(host));
    return "[" + std::string(host) + "]:" + std::to_string(ntohs(a->sin6_port));
  }
  return "an unknown peer";
}

}  // namespace

std::string resolve_job_token(const std::string& option) {
  std::string token = option;
  if (token.empty()) {
    const char* env = std::getenv("FSDP_JOB_TOKEN");
    if (env != nullptr) token = env;
  }
  FSDP_CHECK(token.size() <= kMaxJobTokenBytes, -1, "init_process_group",
             "the job token (ProcessGroupOptions::job_token or FSDP_JOB_TOKEN) has ", token.size(),
             " bytes, at most ", kMaxJobTokenBytes,
             " are allowed. Use e.g. `export FSDP_JOB_TOKEN=$(openssl rand -hex 16)`.");
  return token;
}

std::vector<uint8_t> handshake_bytes(const std::string& token) {
  std::vector<uint8_t> out(kHandshakeHeaderBytes + token.size());
  std::memcpy(out.data(), kMagic, sizeof(kMagic));
  const uint16_t version = kVersion;
  std::memcpy(out.data() + 6, &version, sizeof(version));
  const auto len = static_cast<uint32_t>(token.size());
  std::memcpy(out.data() + 8, &len, sizeof(len));
  std::memcpy(out.data() + kHandshakeHeaderBytes, token.data(), token.size());
  return out;
}

IoResult send_handshake(int fd, const std::string& token,
                        std::chrono::steady_clock::time_point deadline) {
  const auto bytes = handshake_bytes(token);
  return write_all_until(fd, bytes.data(), bytes.size(), deadline);
}

HandshakeAnswer read_handshake_answer(int fd, std::chrono::steady_clock::time_point deadline) {
  char got[kHandshakeAckBytes] = {0};
  const IoResult r = read_all_until(fd, got, sizeof(got), deadline);
  if (r == IoResult::kTimedOut) return HandshakeAnswer::kTimedOut;
  if (r == IoResult::kOk && std::memcmp(got, kAck, sizeof(kAck)) == 0) {
    return HandshakeAnswer::kAccepted;
  }
  if (r == IoResult::kOk && std::memcmp(got, kNack, sizeof(kNack)) == 0) {
    return HandshakeAnswer::kRefused;
  }
  return HandshakeAnswer::kClosed;
}

std::vector<uint8_t> handshake_ack_bytes() { return {kAck, kAck + sizeof(kAck)}; }

IoResult send_handshake_ack(int fd, std::chrono::steady_clock::time_point deadline) {
  return write_all_until(fd, kAck, sizeof(kAck), deadline);
}

HandshakeReader::State HandshakeReader::read_some(int fd, const std::string& token) {
  while (state_ == State::kReading && bytes_.size() < need_) {
    const size_t have = bytes_.size();
    bytes_.resize(need_);
    const ssize_t r = ::recv(fd, bytes_.data() + have, need_ - have, MSG_DONTWAIT);
    bytes_.resize(have + static_cast<size_t>(std::max<ssize_t>(r, 0)));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return state_;
    if (r == 0)
      refuse(have == 0 ? "it closed without sending anything" : "it closed mid-handshake");
    if (r < 0) refuse(std::string("reading from it failed: ") + std::strerror(errno));
    if (r <= 0) return state_;
    if (bytes_.size() == kHandshakeHeaderBytes && need_ == kHandshakeHeaderBytes) {
      uint16_t version = 0;
      uint32_t len = 0;
      std::memcpy(&version, bytes_.data() + 6, sizeof(version));
      std::memcpy(&len, bytes_.data() + 8, sizeof(len));
      if (std::memcmp(bytes_.data(), kMagic, sizeof(kMagic)) != 0) {
        refuse("it sent bytes that are not libfsdp's handshake");
      } else if (version != kVersion) {
        refuse("it speaks handshake version " + std::to_string(version) + ", this build " +
               std::to_string(kVersion));
      } else if (len > kMaxJobTokenBytes) {
        refuse("its token length " + std::to_string(len) + " exceeds " +
               std::to_string(kMaxJobTokenBytes));
      } else {
        need_ = kHandshakeHeaderBytes + len;
      }
    }
  }
  if (state_ == State::kReading) {
    if (same_token(bytes_.data() + kHandshakeHeaderBytes, need_ - kHandshakeHeaderBytes, token)) {
      state_ = State::kAccepted;
    } else {
      refuse("it presented a different token");
      tell_wrong_token(fd);
    }
  }
  return state_;
}

void HandshakeReader::refuse(std::string why) {
  state_ = State::kRefused;
  refusal_ = std::move(why);
}

void record_refusal(int fd, int64_t rank, const char* listener, const std::string& why) {
  g_refused.fetch_add(1, std::memory_order_relaxed);
  if (g_logged.exchange(true)) return;
  if (rank < 0) rank = launcher_rank();
  const std::string who = rank >= 0 ? "fsdp: rank " + std::to_string(rank) + ": " : "fsdp: ";
  const std::string line = who + listener + " closed a connection from " + peer_of(fd) +
                           " that did not present this job's token (" + why +
                           "; further refusals are counted, not logged)\n";
  std::fputs(line.c_str(), stderr);
  std::fflush(stderr);
}

uint64_t refused_connections() { return g_refused.load(std::memory_order_relaxed); }

}  // namespace fsdp::detail
