#pragma once

// The job token that every store and direct-link connection presents first.
// See Note [Job token] in job_token.cpp.

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "rendezvous/socket.h"

namespace fsdp::detail {

/// Longest token accepted (FSDP_JOB_TOKEN, ProcessGroupOptions::job_token);
/// fsdprun's are 32 hex digits.
constexpr size_t kMaxJobTokenBytes = 256;

/// How long an accepted connection may take to present its handshake before
/// it is closed. Short and separate from the collective timeout: a connection
/// that sends nothing must not hold anything up for long.
constexpr auto kHandshakeTimeout = std::chrono::seconds(5);

/// Bytes of the handshake's fixed part: magic (6), version (u16), token length (u32).
constexpr size_t kHandshakeHeaderBytes = 12;

/// Bytes the accepting side answers a handshake with ("JTOK", or "JTNO" when
/// only the token was wrong).
constexpr size_t kHandshakeAckBytes = 4;

/// `option` when set, else FSDP_JOB_TOKEN, else the empty token. Throws when
/// the token is longer than kMaxJobTokenBytes.
std::string resolve_job_token(const std::string& option);

/// The handshake a connecting side sends before anything else.
std::vector<uint8_t> handshake_bytes(const std::string& token);

/// Sends the handshake on a freshly connected socket.
IoResult send_handshake(int fd, const std::string& token,
                        std::chrono::steady_clock::time_point deadline);

/// How the accepting side answered our handshake.
enum class HandshakeAnswer : uint8_t {
  kAccepted,
  kRefused,   // it speaks the handshake but holds another token
  kClosed,    // closed without an answer, or answered something else
  kTimedOut,  // no answer before the deadline
};

/// Reads the accepting side's answer to our handshake.
HandshakeAnswer read_handshake_answer(int fd, std::chrono::steady_clock::time_point deadline);

/// The answer to an accepted handshake, for a non-blocking sender.
std::vector<uint8_t> handshake_ack_bytes();

/// Sends the answer to an accepted handshake.
IoResult send_handshake_ack(int fd, std::chrono::steady_clock::time_point deadline);

/// The accepting side of the handshake on one connection: reads no byte past
/// the handshake, so what follows stays in the socket for its protocol.
class HandshakeReader {
 public:
  /// Where the handshake stands.
  enum class State : uint8_t { kReading, kAccepted, kRefused };

  /// Reads what the handshake still needs from `fd` (blocking or not; on a
  /// non-blocking socket returns kReading when nothing more is there yet) and
  /// checks it against `token` once complete. A peer that spoke the
  /// handshake with another token is told so ("JTNO") before it is refused,
  /// so that a rank of another job gets a clear error; anything else hears
  /// nothing.
  State read_some(int fd, const std::string& token);
  /// The state after the last read_some.
  State state() const { return state_; }
  /// Why the connection was refused (for the log), once kRefused.
  const std::string& refusal() const { return refusal_; }
  /// Refuses from outside (deadline passed, set-up over) with `why`.
  void refuse(std::string why);

 private:
  State state_ = State::kReading;
  std::vector<uint8_t> bytes_;  // received so far
  size_t need_ = kHandshakeHeaderBytes;
  std::string refusal_;
};

/// Counts a refused connection and, for the first one in this process, logs
/// one line naming the peer, `listener` ("the rendezvous store", ...) and why.
/// `rank` < 0: the launcher's rank (RANK), if any.
void record_refusal(int fd, int64_t rank, const char* listener, const std::string& why);

/// Connections refused in this process so far (for tests).
uint64_t refused_connections();

}  // namespace fsdp::detail
