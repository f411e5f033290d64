#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <c10/core/Device.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <fsdp/comm/types.h>

namespace fsdp::detail {

/// Note [Shared memory for same-host ranks]
/// On one host, TCP loopback costs every byte a copy into the kernel, a copy
/// out of it, the TCP stack and an event-loop thread's wake-ups, all on the
/// cores that also compute (on 2 cores, FULL_SHARD's per-block 12.6 MB
/// collectives took ~290 ms of a 2 s step). When every rank of a group is on
/// this host (same boot, IPC and PID namespaces), the group maps one
/// shared-memory segment instead: per rank a control block and two slots of
/// CommConfig::shm_slot_bytes. A collective is a sequence of *rounds*; in round k each rank
/// writes its part into its slot k % 2, publishes `posted = k + 1`, reads what
/// it needs from the others' slot k % 2, then publishes `done = k + 1`. A slot
/// is written again (round k + 2) only after every peer's `done` passed k, so
/// a rank fills one slot while its peers still read the other. Waits spin
/// briefly, then sleep on a futex in the shared word (no thread of our own,
/// nothing to spin on 2 cores).
/// - Results are the same on every rank: all-reduce sums the slots in rank
///   order on every rank; reduce-scatter's shard is computed by its owner only.
/// - Each round's slot carries (operation, total bytes): a peer in another
///   collective is an error naming both, not a silent mix or a hang.
/// - A dead peer (its pid gone or a zombie) or one that does not post within
///   the timeout fails the wait; the failing rank sets the segment's abort word
///   and wakes everyone, so the others fail at once naming it.
/// - Set-up is collective and all-or-nothing (through the store): any rank
///   elsewhere, shared memory turned off on any rank
///   (CommConfig::shared_memory), slot sizes that differ, or a segment that
///   cannot be created gives every rank nullptr, and the group keeps its
///   other routes. The segment has no name at any time, so nothing is ever
///   left in /dev/shm, whoever dies when (Note [Shared memory without a
///   name]).
/// Where a ShmLinks group's slots live and how bytes move through them: in
/// the shared segment itself (host memory, memcpy), or in each rank's GPU
/// memory opened by its peers (Note [Ranks sharing a GPU] in
/// comm/cuda_ipc_slots.h). The segment's control words (posted, done, the
/// descriptors, the abort word) stay in host memory either way.
class SlotMemory {
 public:
  virtual ~SlotMemory() = default;
  /// Rank `rank`'s slot for round `round` (two per rank, used alternately).
  virtual char* slot(int rank, uint32_t round) const = 0;
  /// The device of the slots, which the collectives' tensors must be on.
  virtual c10::Device device() const = 0;
  /// Copies `bytes` from `src` to `dst` (on a GPU: queued on the current stream).
  virtual void copy(void* dst, const void* src, size_t bytes) const = 0;
  /// Returns once everything queued on the current stream has run, so that
  /// what this rank wrote or read may be published (nothing to do on the CPU).
  virtual void settle() const = 0;

  /// Runs a collective's body where the group runs it.
  using Runner = std::function<void(const std::function<void()>& body)>;
  /// Called where a collective is issued; what it returns runs the body once
  /// the tensors' producers have run: at once on the CPU; on a GPU on a
  /// stream of the group's own, made to wait for what the issuing thread's
  /// stream had queued when the collective was issued.
  virtual Runner when_ready() const {
    return [](const std::function<void()>& body) { body(); };
  }
};

/// Host slots at `data`: each rank's two back to back, in rank order. The
/// segment's own (after its control blocks), and any other host memory every
/// rank sees at its own address.
class BufferSlots final : public SlotMemory {
 public:
  BufferSlots(char* data, int64_t slot_bytes) : data_(data), slot_bytes_(slot_bytes) {}
  char* slot(int rank, uint32_t round) const override {
    const size_t index = static_cast<size_t>(rank) * 2 + (round & 1u);
    return data_ + index * static_cast<size_t>(slot_bytes_);
  }
  c10::Device device() const override { return c10::Device(c10::kCPU); }
  void copy(void* dst, const void* src, size_t bytes) const override {
    std::memcpy(dst, src, bytes);
  }
  void settle() const override {}

 private:
  char* data_;
  int64_t slot_bytes_;
};

/// Every rank of the group posts `mine` under `key`/rank in `store`, then
/// reads all of them: the strings in rank order.
std::vector<std::string> exchange_strings(c10d::Store& store, const std::string& key, int rank,
                                          int size, const std::string& mine);

/// Opens slot memory outside the segment for ShmLinks::connect(), collectively
/// over the group; nullptr when this rank cannot (every rank then agrees on
/// "no").
using SlotOpener = std::function<std::unique_ptr<SlotMemory>(c10d::Store& store, int rank, int size,
                                                             int64_t slot_bytes)>;

class ShmLinks {
 public:
  /// Collective over the group (keys under `store`, the group's own prefix),
  /// with slots of `slot_bytes` (a multiple of 64); `enabled` false posts "off".
  /// With `open_slots`, the slots are what it opens instead of part of the
  /// segment. Returns nullptr on every rank when the group cannot use shared
  /// memory (or any rank's `open_slots` failed).
  static std::unique_ptr<ShmLinks> connect(c10d::Store& store, int rank, int size,
                                           std::chrono::milliseconds timeout, bool enabled,
                                           int64_t slot_bytes,
                                           const SlotOpener& open_slots = nullptr);
  ~ShmLinks();
  ShmLinks(const ShmLinks&) = delete;
  ShmLinks& operator=(const ShmLinks&) = delete;

  /// Where the slots are, and how bytes move through them.
  const SlotMemory& slots() const { return *slots_; }

  /// See ProcessGroup::all_gather_into_tensor (contiguous 1-D tensors).
  void all_gather(const at::Tensor& flat, const at::Tensor& shard);
  /// See ProcessGroup::reduce_scatter_tensor (contiguous 1-D tensors).
  void reduce_scatter(const at::Tensor& flat, const at::Tensor& shard, ReduceOp op);
  /// See ProcessGroup::all_reduce (contiguous tensor).
  void all_reduce(const at::Tensor& tensor, ReduceOp op);
  /// See ProcessGroup::broadcast (contiguous tensor): root's bytes, exactly.
  void broadcast(const at::Tensor& tensor, int root);

 private:
  struct Layout;
  ShmLinks(int rank, int size, std::chrono::milliseconds timeout, int64_t slot_bytes, void* base,
           size_t bytes, std::unique_ptr<SlotMemory> slots);

  char* slot(int rank, uint32_t round) const { return slots_->slot(rank, round); }
  at::Tensor view_of(char* p, int64_t numel, at::ScalarType dtype) const;
  uint32_t* word(int rank, int which) const;
  // What every rank must issue alike: the collective, its bytes, and
  // (packed into a word) its dtype, reduction and root where it has them.
  struct Issued {
    CollectiveKind op;
    uint64_t total;
    uint32_t detail;
  };
  // Runs `rounds` rounds of collective `issued`: write(i, my slot) fills
  // this rank's part of round i, read(i, round) consumes it once every peer
  // posted (slot(p, round) is peer p's part).
  template <typename Write, typename Read>
  void run_rounds(const Issued& issued, int64_t rounds, Write&& write, Read&& read);
  void wait_until(int peer, int which, uint32_t target, const char* what);
  void check_descriptor(int peer, uint32_t round, const Issued& issued);
  [[noreturn]] void fail(const std::string& message);
  void publish(int which, uint32_t value);

  const int rank_, size_;
  const std::chrono::milliseconds timeout_;
  const int64_t slot_bytes_;  // bytes of one slot (CommConfig::shm_slot_bytes)
  void* base_;
  size_t bytes_;
  std::unique_ptr<SlotMemory> slots_;
  uint32_t next_round_ = 0;
};

}  // namespace fsdp::detail
