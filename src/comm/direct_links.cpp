#include "comm/direct_links.h"

#include <c10/util/Exception.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>

#include "comm/mismatch.h"
#include "comm/thread_priority.h"
#include "detail/error.h"
#include "rendezvous/job_token.h"
#include "rendezvous/token_accept.h"

// See Note [Direct links for small collectives] and Note [Direct links for
// large collectives].

namespace fsdp::detail {

// What precedes every message on a link. Not in the anonymous namespace:
// DirectLinks::Outgoing holds one.
struct LinkHeader {
  uint64_t slot;
  uint64_t bytes;
};

namespace {

void set_socket_options(int fd, std::chrono::milliseconds timeout) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  int buf = 1 << 20;
  setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &buf, sizeof(buf));
  setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &buf, sizeof(buf));
  timeval tv{};
  tv.tv_sec = static_cast<time_t>(timeout.count() / 1000);
  tv.tv_usec = static_cast<suseconds_t>((timeout.count() % 1000) * 1000);
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
}

// Note [Strangers on the direct-link port]
// A rank's direct-link port listens on its node's address until the previous
// rank connects, so anything that reaches the node can connect first: a port
// scanner, a stranger on the network (tests/cluster/test_stranger.sh), a rank
// of another job. Taking that connection for rank prev's failed the job
// ("expected the direct link from rank 2, got one from rank 7"). A connection
// without this job's token is refused by accept_with_token (Note [Job
// token]); one that has it but does not open with prev's hello within a
// moment (a rank of another job started with the same token, or none) is
// closed with a warning. Either way the rank keeps accepting until prev's
// link arrives or the timeout passes.
UniqueFd accept_link_from(int listener, const std::string& job_token, int prev, int rank,
                          std::chrono::milliseconds timeout,
                          std::chrono::steady_clock::time_point deadline) {
  constexpr std::chrono::milliseconds kHelloWait{2000};
  while (true) {
    UniqueFd fd = accept_with_token(listener, job_token, deadline, rank, "the direct links");
    FSDP_CHECK(fd.get() >= 0, rank, "process group", "rank ", prev,
               " did not open its direct link within ", timeout.count(), " ms");
    const auto left =
        std::chrono::ceil<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    set_socket_options(fd.get(),
                       std::max(std::chrono::milliseconds(1), std::min(kHelloWait, left)));
    int32_t peer = -1;
    const bool hello = read_all(fd.get(), &peer, sizeof(peer));
    if (hello && peer == prev) return fd;
    TORCH_WARN(error_prefix(rank, "process group"),
               "closed a connection to the direct-link port that presented this job's token but ",
               hello ? "said it was rank " + std::to_string(peer) : std::string("sent no hello"),
               ", not rank ", prev, ". Still waiting for rank ", prev,
               "; is another job with the same FSDP_JOB_TOKEN (or none) reaching this node?");
  }
}

std::string errno_text(ssize_t rc) {
  if (rc == 0) return "the peer closed the connection";
  if (errno == EAGAIN || errno == EWOULDBLOCK) return "timed out";
  return std::strerror(errno);
}

// Sends header and payload from byte `from` of the two on, with as few
// syscalls as the kernel allows; returns the bytes of the two now sent. With
// `block` false it stops where the socket's buffer is full instead of
// waiting for the peer to read.
size_t send_message(int fd, const LinkHeader& h, const void* data, size_t from, bool block,
                    int rank, int peer) {
  iovec iov[2] = {{const_cast<LinkHeader*>(&h), sizeof(h)},
                  {const_cast<void*>(data), static_cast<size_t>(h.bytes)}};
  const size_t total = sizeof(h) + static_cast<size_t>(h.bytes);
  size_t sent = 0;
  int first = 0;
  auto advance = [&](size_t n) {
    sent += n;
    while (first < 2 && n >= iov[first].iov_len) n -= iov[first++].iov_len;
    if (first < 2) {
      iov[first].iov_base = static_cast<char*>(iov[first].iov_base) + n;
      iov[first].iov_len -= n;
    }
  };
  advance(from);
  while (first < 2) {
    msghdr msg{};
    msg.msg_iov = iov + first;
    msg.msg_iovlen = static_cast<size_t>(2 - first);
    ssize_t w = ::sendmsg(fd, &msg, MSG_NOSIGNAL | (block ? 0 : MSG_DONTWAIT));
    if (w < 0 && errno == EINTR) continue;
    if (!block && w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
    FSDP_CHECK(w > 0, rank, "process group", "sending to rank ", peer,
               " over its direct link failed: ", errno_text(w));
    advance(static_cast<size_t>(w));
  }
  TORCH_INTERNAL_ASSERT(sent <= total);
  return sent;
}

class DoneTransfer : public PendingTransfer {
 public:
  void wait() override {}
};

}  // namespace

struct DirectLinks::Outgoing {
  LinkHeader header;
  at::Tensor src;    // keeps the bytes alive until written
  size_t begun = 0;  // bytes of header and payload isend() wrote before queueing the rest
  bool done = false;
  std::string error;  // set with done when the send failed
};

namespace {

// Waits for a send queued to the sender thread.
class QueuedSend : public PendingTransfer {
 public:
  QueuedSend(std::mutex& mutex, std::condition_variable& cv,
             std::shared_ptr<DirectLinks::Outgoing> out)
      : mutex_(mutex), cv_(cv), out_(std::move(out)) {}
  void wait() override {
    std::unique_lock<std::mutex> lock(mutex_);
    // The socket's send timeout bounds each write, so the sender thread
    // always finishes or fails a message.
    cv_.wait(lock, [&] { return out_->done; });
    TORCH_CHECK(out_->error.empty(), out_->error);
  }

 private:
  std::mutex& mutex_;
  std::condition_variable& cv_;
  std::shared_ptr<DirectLinks::Outgoing> out_;
};

class LazyReceive : public PendingTransfer {
 public:
  LazyReceive(DirectLinks& links, at::Tensor dst, uint64_t slot)
      : links_(links), dst_(std::move(dst)), slot_(slot) {}
  void wait() override {
    if (done_) return;
    links_.receive(dst_.data_ptr(), dst_.nbytes(), slot_);
    done_ = true;
  }

 private:
  DirectLinks& links_;
  at::Tensor dst_;
  uint64_t slot_;
  bool done_ = false;
};

}  // namespace

DirectLinks::DirectLinks(c10d::Store& store, int rank, int size, const std::string& listen_addr,
                         std::chrono::milliseconds timeout, int64_t inline_bytes,
                         const std::string& job_token, bool realtime)
    : rank_(rank),
      next_((rank + 1) % size),
      prev_((rank + size - 1) % size),
      inline_bytes_(inline_bytes) {
  int port = 0;
  UniqueFd listener = listen_tcp(listen_addr, 0, &port);
  const std::string mine = listen_addr + " " + std::to_string(port);
  store.set("direct/" + std::to_string(rank), std::vector<uint8_t>(mine.begin(), mine.end()));
  const auto theirs = store.get("direct/" + std::to_string(next_));
  const std::string addr(theirs.begin(), theirs.end());
  const size_t space = addr.rfind(' ');
  try {
    to_next_ = connect_tcp(addr.substr(0, space), std::stoi(addr.substr(space + 1)), timeout);
  } catch (const c10::Error& e) {
    FSDP_FAIL(rank, "process group", "cannot open the direct link to rank ", next_, " at ", addr,
              ": ", e.what_without_backtrace());
  }
  // The handshake, then our rank; `next` answers the handshake only once it
  // accepts, after its own connect, so the answer is read last (every rank
  // connects before it accepts: nobody waits in a cycle).
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  const int32_t hello = rank;
  FSDP_CHECK(send_handshake(to_next_.get(), job_token, deadline) == IoResult::kOk &&
                 write_all(to_next_.get(), &hello, sizeof(hello)),
             rank, "process group", "the direct link to rank ", next_, " closed during set-up");
  from_prev_ = accept_link_from(listener.get(), job_token, prev_, rank, timeout, deadline);
  const HandshakeAnswer answer = read_handshake_answer(to_next_.get(), deadline);
  FSDP_CHECK(answer != HandshakeAnswer::kRefused, rank, "process group", "rank ", next_,
             " refused this rank's job token on the direct link: FSDP_JOB_TOKEN differs from the "
             "job's. Start every rank with the same FSDP_JOB_TOKEN.");
  FSDP_CHECK(answer != HandshakeAnswer::kTimedOut, rank, "process group", "rank ", next_,
             " did not accept the direct link within ", timeout.count(), " ms");
  FSDP_CHECK(answer == HandshakeAnswer::kAccepted, rank, "process group", "rank ", next_,
             " closed the direct link during set-up");
  set_socket_options(to_next_.get(), timeout);
  set_socket_options(from_prev_.get(), timeout);
  sender_ = std::thread([this, realtime] {
    prefer_over_compute(realtime);
    sender_loop();
  });
}

DirectLinks::~DirectLinks() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  // A write blocked on a peer that stopped reading ends now, not at the timeout.
  ::shutdown(to_next_.get(), SHUT_RDWR);
  sender_.join();
}

void DirectLinks::sender_loop() {
  std::string failure;  // the first send error; every later send fails with it
  std::unique_lock<std::mutex> lock(mutex_);
  while (true) {
    // A message stays at the front of queue_ until written, so isend()
    // never writes past it.
    wake_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
    if (stopping_) break;
    auto out = queue_.front();
    lock.unlock();
    std::string error = failure;
    if (error.empty()) {
      try {
        send_message(to_next_.get(), out->header, out->src.data_ptr(), out->begun, true, rank_,
                     next_);
      } catch (const c10::Error& e) {
        error = failure = e.what_without_backtrace();
      }
    }
    lock.lock();
    out->done = true;
    out->error = std::move(error);
    out->src = at::Tensor();
    queue_.pop_front();
    wake_.notify_all();
  }
  for (auto& out : queue_) {
    out->done = true;
    out->error = error_prefix(rank_, "process group") + "the direct link to rank " +
                 std::to_string(next_) + " was closed before this message was sent";
  }
  queue_.clear();
  wake_.notify_all();
}

std::unique_ptr<PendingTransfer> DirectLinks::isend(const at::Tensor& src, int peer,
                                                    uint64_t slot) {
  TORCH_INTERNAL_ASSERT(peer == next_, "direct links send only to the next rank");
  const LinkHeader header{slot, static_cast<uint64_t>(src.nbytes())};
  std::unique_lock<std::mutex> lock(mutex_);
  // Only this thread queues, so an empty queue stays empty while it writes.
  // It writes what the socket takes now and queues the rest: a calling
  // thread blocked on a full link would never read its own, and a ring step
  // whose every rank posts more than the buffers hold (small segments,
  // a large direct_link_bytes) would wait on itself.
  size_t begun = 0;
  if (queue_.empty() && static_cast<int64_t>(header.bytes) <= inline_bytes_) {
    lock.unlock();
    begun = send_message(to_next_.get(), header, src.data_ptr(), 0, false, rank_, next_);
    if (begun == sizeof(header) + header.bytes) return std::make_unique<DoneTransfer>();
    lock.lock();
  }
  auto out = std::make_shared<Outgoing>();
  out->header = header;
  out->src = src;
  out->begun = begun;
  queue_.push_back(out);
  wake_.notify_all();
  return std::make_unique<QueuedSend>(mutex_, wake_, std::move(out));
}

std::unique_ptr<PendingTransfer> DirectLinks::irecv(const at::Tensor& dst, int peer,
                                                    uint64_t slot) {
  TORCH_INTERNAL_ASSERT(peer == prev_, "direct links receive only from the previous rank");
  return std::make_unique<LazyReceive>(*this, dst, slot);
}

void DirectLinks::abort() {
  ::shutdown(to_next_.get(), SHUT_RDWR);
  ::shutdown(from_prev_.get(), SHUT_RDWR);
}

void DirectLinks::receive(void* dst, size_t bytes, uint64_t slot) {
  LinkHeader h{};
  iovec iov[2] = {{&h, sizeof(h)}, {dst, bytes}};
  size_t got = 0;
  const size_t total = sizeof(h) + bytes;
  while (got < total) {
    // Until the header is in, read no further than it: a payload size that
    // disagrees must not be read into `dst`.
    const bool header_done = got >= sizeof(h);
    iovec part[2];
    int count = 0;
    size_t skip = got;
    for (int i = 0; i < (header_done ? 2 : 1); ++i) {
      if (skip >= iov[i].iov_len) {
        skip -= iov[i].iov_len;
        continue;
      }
      part[count++] = {static_cast<char*>(iov[i].iov_base) + skip, iov[i].iov_len - skip};
      skip = 0;
    }
    msghdr msg{};
    msg.msg_iov = part;
    msg.msg_iovlen = static_cast<size_t>(count);
    ssize_t r = ::recvmsg(from_prev_.get(), &msg, 0);
    if (r < 0 && errno == EINTR) continue;
    FSDP_CHECK(r > 0, rank_, "process group", "receiving from rank ", prev_,
               " over its direct link failed: ", errno_text(r));
    got += static_cast<size_t>(r);
    if (!header_done && got >= sizeof(h)) {
      FSDP_CHECK(h.slot == slot && h.bytes == bytes, rank_, "process group", "rank ", prev_,
                 " sent message slot ", h.slot, " of ", h.bytes, " bytes where slot ", slot, " of ",
                 bytes, " bytes was expected: the ranks issued different collectives.",
                 kMismatchAdvice);
    }
  }
}

}  // namespace fsdp::detail
