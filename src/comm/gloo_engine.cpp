#include "comm/gloo_engine.h"

#if FSDP_WITH_GLOO

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/transport/unbound_buffer.h>

#include <fsdp/error_message.h>

#include <deque>
#include <map>
#include <mutex>

#include "detail/error.h"

// See Note [Gloo or not].

namespace fsdp::detail {

namespace {

// Gloo's rendezvous over any c10d::Store (ours, or a user's).
class GlooStoreAdapter : public gloo::rendezvous::Store {
 public:
  explicit GlooStoreAdapter(c10::intrusive_ptr<c10d::Store> store) : store_(std::move(store)) {}
  void set(const std::string& key, const std::vector<char>& data) override {
    store_->set(key, std::vector<uint8_t>(data.begin(), data.end()));
  }
  std::vector<char> get(const std::string& key) override {
    auto v = store_->get(key);
    return std::vector<char>(v.begin(), v.end());
  }
  void wait(const std::vector<std::string>& keys) override { store_->wait(keys); }
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override {
    store_->wait(keys, timeout);
  }

 private:
  c10::intrusive_ptr<c10d::Store> store_;
};

// One Gloo device (a listening socket and an event loop thread) per address,
// shared by every group of the process.
std::shared_ptr<gloo::transport::Device> device_for(const std::string& addr) {
  static std::mutex mutex;
  static std::map<std::string, std::shared_ptr<gloo::transport::Device>> devices;
  std::lock_guard<std::mutex> lock(mutex);
  auto& dev = devices[addr];
  if (!dev) {
    gloo::transport::tcp::attr attr;
    attr.hostname = addr;
    dev = gloo::transport::tcp::CreateDevice(attr);
  }
  return dev;
}

// Note [Gloo's buffers let go later]
// Destroying a gloo::transport::UnboundBuffer spins (sched_yield) until
// Gloo's loop thread has dropped its reference to it, which it does just
// after the transfer completed. Destroyed at once after each wait, as
// before, that spin lasted scheduler slices wherever threads outnumber
// cores: about 270 small collectives (test_collectives' sweep, world sizes
// 1-4) took 22 s over Gloo's pairs against 5 s over the direct links
// (Debian's 1.13, 2 cores, both busy yielding: perf); 12 s now. A buffer
// whose transfer completed is kept instead and destroyed kKept transfers
// later, when the loop thread has long let go; one whose transfer did not
// complete goes at once, as before. Gloo's own all-reduce, broadcast and
// barrier destroy their buffers at once, out of our reach, and spun the
// same way (80% of the CPU of a 3-rank test over Gloo, perf): libfsdp runs
// them as rings over these transfers instead (gloo_process_group.cpp), and
// the 3-rank route tests over Gloo took 0.7 s instead of 4.5.
class RetiredBuffers {
 public:
  void retire(std::unique_ptr<gloo::transport::UnboundBuffer> buf) {
    std::unique_ptr<gloo::transport::UnboundBuffer> oldest;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      kept_.push_back(std::move(buf));
      if (kept_.size() <= kKept) return;
      oldest = std::move(kept_.front());
      kept_.pop_front();
    }
  }

 private:
  static constexpr size_t kKept = 64;
  std::mutex mutex_;
  std::deque<std::unique_ptr<gloo::transport::UnboundBuffer>> kept_;
};

class GlooTransfer : public PendingTransfer {
 public:
  GlooTransfer(std::unique_ptr<gloo::transport::UnboundBuffer> buf, bool is_send,
               std::chrono::milliseconds timeout, RetiredBuffers& retired)
      : buf_(std::move(buf)), is_send_(is_send), timeout_(timeout), retired_(retired) {}
  ~GlooTransfer() override {
    if (completed_) retired_.retire(std::move(buf_));
  }
  GlooTransfer(const GlooTransfer&) = delete;
  GlooTransfer& operator=(const GlooTransfer&) = delete;
  void wait() override {
    const bool ok = is_send_ ? buf_->waitSend(timeout_) : buf_->waitRecv(timeout_);
    FSDP_CHECK(ok, -1, "process group", "gloo ", is_send_ ? "send" : "receive", " was aborted");
    completed_ = true;
  }

 private:
  std::unique_ptr<gloo::transport::UnboundBuffer> buf_;
  bool is_send_;
  std::chrono::milliseconds timeout_;
  RetiredBuffers& retired_;
  bool completed_ = false;
};

class GlooPointToPoint : public PointToPoint {
 public:
  GlooPointToPoint(gloo::Context& ctx, std::chrono::milliseconds timeout)
      : ctx_(ctx), timeout_(timeout) {}
  std::unique_ptr<PendingTransfer> isend(const at::Tensor& src, int peer, uint64_t slot) override {
    auto buf = ctx_.createUnboundBuffer(src.data_ptr(), src.nbytes());
    buf->send(peer, slot);
    return std::make_unique<GlooTransfer>(std::move(buf), true, timeout_, retired_);
  }
  std::unique_ptr<PendingTransfer> irecv(const at::Tensor& dst, int peer, uint64_t slot) override {
    auto buf = ctx_.createUnboundBuffer(dst.data_ptr(), dst.nbytes());
    buf->recv(peer, slot);
    return std::make_unique<GlooTransfer>(std::move(buf), false, timeout_, retired_);
  }

 private:
  gloo::Context& ctx_;
  std::chrono::milliseconds timeout_;
  RetiredBuffers retired_;  // Note [Gloo's buffers let go later]
};

class Engine final : public GlooEngine {
 public:
  Engine(std::shared_ptr<gloo::Context> context, std::chrono::milliseconds timeout)
      : context_(std::move(context)), p2p_(*context_, timeout) {}
  PointToPoint& p2p() override { return p2p_; }
  // Buffers still pending stay alive (Note [Gloo's buffers let go later]).
  void abort() override { context_->closeConnections(); }

 private:
  std::shared_ptr<gloo::Context> context_;
  GlooPointToPoint p2p_;
};

}  // namespace

std::unique_ptr<GlooEngine> connect_gloo(const c10::intrusive_ptr<c10d::Store>& store,
                                         const std::string& prefix, int rank, int size,
                                         std::chrono::milliseconds timeout,
                                         const std::string& listen_addr) {
  auto ctx = std::make_shared<gloo::rendezvous::Context>(rank, size);
  ctx->setTimeout(timeout);
  GlooStoreAdapter gstore(c10::make_intrusive<c10d::PrefixStore>(prefix, store));
  auto dev = device_for(listen_addr);
  try {
    ctx->connectFullMesh(gstore, dev);
  } catch (const std::exception& e) {
    FSDP_FAIL(rank, "process group", "connecting the ", size, " ranks of group '", prefix,
              "' over Gloo (listening on ", listen_addr, ") failed: ", error_message(e),
              ". Check that every rank started and can reach the others' addresses.");
  }
  return std::make_unique<Engine>(std::move(ctx), timeout);
}

bool built_with_gloo() { return true; }

}  // namespace fsdp::detail

#else  // !FSDP_WITH_GLOO

namespace fsdp::detail {

std::unique_ptr<GlooEngine> connect_gloo(const c10::intrusive_ptr<c10d::Store>&, const std::string&,
                                         int, int, std::chrono::milliseconds, const std::string&) {
  return nullptr;
}

bool built_with_gloo() { return false; }

}  // namespace fsdp::detail

#endif  // FSDP_WITH_GLOO
