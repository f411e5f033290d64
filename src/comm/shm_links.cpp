#include "comm/shm_links.h"

#include <fsdp/error_message.h>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <fcntl.h>
#include <linux/futex.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>

#include "comm/mismatch.h"
#include "comm/reduce.h"
#include "detail/error.h"
#include "rendezvous/socket.h"

// See Note [Shared memory for same-host ranks].

namespace fsdp::detail {

namespace {

constexpr int kPosted = 0;
constexpr int kDone = 1;
constexpr size_t kHeaderBytes = 256;
constexpr size_t kControlBytes = 256;  // per rank: posted, done, pid, descriptors
constexpr size_t kWordStride = 64;     // posted and done on cache lines of their own
constexpr int kSpins = 200;
constexpr auto kSleepSlice = std::chrono::milliseconds(50);

struct ShmHeader {
  uint32_t aborted;  // 0, or 1 + the rank that failed first
};

struct Descriptor {
  uint32_t op;
  uint32_t detail;  // ShmLinks::Issued::detail
  uint64_t total;
};

struct Control {
  uint32_t words[2 * kWordStride / sizeof(uint32_t)];  // posted at [0], done at [16]
  int32_t pid;
  uint32_t unused[15];
  Descriptor descriptors[2];  // one per slot
};
static_assert(sizeof(Control) <= kControlBytes, "control block overflows its space");

// Rank `rank`'s control block in the segment at `base`.
Control* control_of(void* base, int rank) {
  return reinterpret_cast<Control*>(static_cast<char*>(base) + kHeaderBytes +
                                    static_cast<size_t>(rank) * kControlBytes);
}

size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

size_t data_offset(int size) {
  return round_up(kHeaderBytes + static_cast<size_t>(size) * kControlBytes, 4096);
}

size_t segment_bytes(int size, int64_t slot_bytes) {
  return data_offset(size) + static_cast<size_t>(size) * 2 * static_cast<size_t>(slot_bytes);
}

uint32_t load_acquire(const uint32_t* w) { return __atomic_load_n(w, __ATOMIC_ACQUIRE); }

void futex_wake_all(uint32_t* w) {
  syscall(SYS_futex, w, FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

void futex_wait(uint32_t* w, uint32_t seen, std::chrono::milliseconds limit) {
  timespec ts{};
  ts.tv_sec = static_cast<time_t>(limit.count() / 1000);
  ts.tv_nsec = static_cast<long>((limit.count() % 1000) * 1000000);
  syscall(SYS_futex, w, FUTEX_WAIT, seen, &ts, nullptr, 0);
}

void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// Gone, or a zombie nobody reaped yet: either way it will never post again.
bool process_gone(int32_t pid) {
  if (pid <= 0) return false;
  if (::kill(pid, 0) == -1 && errno == ESRCH) return true;
  // read(2), not an ifstream: a process that dies between open and read
  // makes read fail with ESRCH, which libstdc++'s filebuf throws as
  // "basic_filebuf::underflow error" instead of naming the dead rank.
  const std::string path = "/proc/" + std::to_string(pid) + "/stat";
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return errno == ENOENT || errno == ESRCH;
  char buf[512];
  const ssize_t n = ::read(fd, buf, sizeof(buf));
  ::close(fd);
  if (n < 0) return errno == ESRCH;
  const std::string text(buf, static_cast<size_t>(n));
  const size_t paren = text.rfind(')');
  return paren != std::string::npos && paren + 2 < text.size() &&
         (text[paren + 2] == 'Z' || text[paren + 2] == 'X');
}

std::string read_first_line(const char* path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

std::string read_link(const char* path) {
  char buf[256];
  const ssize_t n = ::readlink(path, buf, sizeof(buf) - 1);
  return n > 0 ? std::string(buf, static_cast<size_t>(n)) : std::string();
}

// Ranks may share memory when they run on the same boot of the same machine,
// in the same IPC namespace (same /dev/shm) and PID namespace (pids checked
// for liveness mean the same process), with the same slot size. Empty: off.
std::string host_key(bool enabled, int64_t slot_bytes) {
  if (!enabled) return "";
  const std::string boot = read_first_line("/proc/sys/kernel/random/boot_id");
  const std::string ipc = read_link("/proc/self/ns/ipc"), pid = read_link("/proc/self/ns/pid");
  if (boot.empty() || ipc.empty() || pid.empty()) return "";
  char host[256] = {};
  ::gethostname(host, sizeof(host) - 1);
  return std::string(host) + "/" + boot + "/" + ipc + "/" + pid + "/" + std::to_string(slot_bytes);
}

std::string get_string(c10d::Store& store, const std::string& key) {
  const auto v = store.get(key);
  return std::string(v.begin(), v.end());
}

void set_string(c10d::Store& store, const std::string& key, const std::string& value) {
  store.set(key, std::vector<uint8_t>(value.begin(), value.end()));
}

// Every rank posts `mine` under `key`/rank; true when all posted `expected`.
bool all_posted(c10d::Store& store, const std::string& key, int rank, int size,
                const std::string& mine, const std::string& expected) {
  const auto all = exchange_strings(store, key, rank, size, mine);
  return std::all_of(all.begin(), all.end(), [&](const std::string& s) { return s == expected; });
}

// Note [Shared memory without a name]
// A segment under a name in /dev/shm outlives every process that dies before
// unlinking it: a rank SIGKILLed between shm_open(O_CREAT) and the unlink
// left an 8 MiB file behind (4 of 24 start-up kills). So the segment never
// gets a name: rank 0 makes it with memfd_create and keeps that descriptor
// open until every rank mapped it; the others open the same file through
// /proc/<rank 0's pid>/fd/<fd> (same PID namespace and user, see host_key()).
// The kernel frees it when the last descriptor and mapping go, whoever dies
// and whenever. Passing the descriptor over a unix socket would work as well
// but needs a socket path (a name again) or an abstract one (same network
// namespace); this needs nothing. A memfd is not bound by /dev/shm's size
// (64 MiB in a default Docker container) but by the memory of the cgroup;
// its pages are still reserved up front, so a shortage is a clean "no".
// FSDP_FAULT_SHM_SETUP=<rank>:<step> makes that rank SIGKILL itself at step
// 1..kSetupSteps of the set-up, for the tests of this Note.

constexpr int kSetupSteps = 6;

void fault_point(int rank, int step) {
  static const std::string target = [] {
    const char* env = std::getenv("FSDP_FAULT_SHM_SETUP");
    return std::string(env != nullptr ? env : "");
  }();
  if (!target.empty() && target == std::to_string(rank) + ":" + std::to_string(step)) {
    ::raise(SIGKILL);
  }
}

// Rank 0's segment, its pages reserved (a shortage is a clean "no" here,
// never a SIGBUS later). An invalid UniqueFd on failure.
UniqueFd create_segment(size_t bytes) {
  UniqueFd fd(::memfd_create("fsdp-shm", MFD_CLOEXEC));
  if (fd.get() < 0 || ::ftruncate(fd.get(), static_cast<off_t>(bytes)) != 0 ||
      ::posix_fallocate(fd.get(), 0, static_cast<off_t>(bytes)) != 0) {
    return UniqueFd();
  }
  return fd;
}

// Another rank's open of rank 0's segment, named "<pid>/<fd>".
UniqueFd open_segment(const std::string& where) {
  const size_t slash = where.find('/');
  if (slash == std::string::npos) return UniqueFd();
  const std::string path = "/proc/" + where.substr(0, slash) + "/fd/" + where.substr(slash + 1);
  return UniqueFd(::open(path.c_str(), O_RDWR | O_CLOEXEC));
}

void* map_segment(const UniqueFd& fd, size_t bytes) {
  if (fd.get() < 0) return nullptr;
  void* base = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0);
  return base == MAP_FAILED ? nullptr : base;
}

int64_t rounds_for(int64_t numel, int64_t per_round) {
  return std::max<int64_t>(1, (numel + per_round - 1) / per_round);
}

}  // namespace

std::vector<std::string> exchange_strings(c10d::Store& store, const std::string& key, int rank,
                                          int size, const std::string& mine) {
  set_string(store, key + "/" + std::to_string(rank), mine);
  std::vector<std::string> all;
  all.reserve(static_cast<size_t>(size));
  for (int p = 0; p < size; ++p) all.push_back(get_string(store, key + "/" + std::to_string(p)));
  return all;
}

std::unique_ptr<ShmLinks> ShmLinks::connect(c10d::Store& store, int rank, int size,
                                            std::chrono::milliseconds timeout, bool enabled,
                                            int64_t slot_bytes, const SlotOpener& open_slots) {
  TORCH_INTERNAL_ASSERT(slot_bytes > 0 && slot_bytes % 64 == 0, "bad slot size ", slot_bytes);
  const std::string key = host_key(enabled, slot_bytes);
  const std::string mine = key.empty() ? "off/" + std::to_string(rank) : key;
  if (!all_posted(store, "shm/host", rank, size, mine, mine)) return nullptr;

  fault_point(rank, 1);

  // See Note [Shared memory without a name]. Slots opened elsewhere take no
  // room in the segment.
  const size_t bytes = segment_bytes(size, open_slots ? 0 : slot_bytes);
  UniqueFd segment;
  if (rank == 0) {
    segment = create_segment(bytes);
    fault_point(rank, 2);
    set_string(
        store, "shm/segment",
        segment.get() < 0 ? "" : std::to_string(::getpid()) + "/" + std::to_string(segment.get()));
  } else {
    segment = open_segment(get_string(store, "shm/segment"));
    fault_point(rank, 2);
  }
  fault_point(rank, 3);
  void* base = map_segment(segment, bytes);
  fault_point(rank, 4);
  if (base != nullptr) {
    control_of(base, rank)->pid = static_cast<int32_t>(::getpid());
  }
  const bool all_mapped = all_posted(store, "shm/mapped", rank, size, base ? "1" : "0", "1");
  fault_point(rank, 5);
  segment.reset();  // every rank opened it by now; the mappings keep it alive
  fault_point(rank, kSetupSteps);
  if (!all_mapped) {
    if (base != nullptr) ::munmap(base, bytes);
    return nullptr;
  }
  std::unique_ptr<SlotMemory> slots;
  if (open_slots) {
    slots = open_slots(store, rank, size, slot_bytes);
    if (!all_posted(store, "shm/slots", rank, size, slots ? "1" : "0", "1")) {
      slots.reset();
      ::munmap(base, bytes);
      return nullptr;
    }
  } else {
    slots = std::make_unique<BufferSlots>(static_cast<char*>(base) + data_offset(size), slot_bytes);
  }
  return std::unique_ptr<ShmLinks>(
      new ShmLinks(rank, size, timeout, slot_bytes, base, bytes, std::move(slots)));
}

ShmLinks::ShmLinks(int rank, int size, std::chrono::milliseconds timeout, int64_t slot_bytes,
                   void* base, size_t bytes, std::unique_ptr<SlotMemory> slots)
    : rank_(rank),
      size_(size),
      timeout_(timeout),
      slot_bytes_(slot_bytes),
      base_(base),
      bytes_(bytes),
      slots_(std::move(slots)) {}

ShmLinks::~ShmLinks() {
  slots_.reset();  // before the segment its peers' control words live in
  ::munmap(base_, bytes_);
}

at::Tensor ShmLinks::view_of(char* p, int64_t numel, at::ScalarType dtype) const {
  return at::from_blob(p, {numel}, at::TensorOptions().dtype(dtype).device(slots_->device()));
}

uint32_t* ShmLinks::word(int rank, int which) const {
  return &control_of(base_, rank)->words[which * kWordStride / sizeof(uint32_t)];
}

void ShmLinks::publish(int which, uint32_t value) {
  uint32_t* w = word(rank_, which);
  __atomic_store_n(w, value, __ATOMIC_RELEASE);
  futex_wake_all(w);
}

void ShmLinks::fail(const std::string& message) {
  auto* header = static_cast<ShmHeader*>(base_);
  uint32_t none = 0;
  __atomic_compare_exchange_n(&header->aborted, &none, static_cast<uint32_t>(rank_ + 1), false,
                              __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
  for (int p = 0; p < size_; ++p) {
    futex_wake_all(word(p, kPosted));
    futex_wake_all(word(p, kDone));
  }
  FSDP_FAIL(rank_, "process group", "", message);
}

void ShmLinks::wait_until(int peer, int which, uint32_t target, const char* what) {
  uint32_t* w = word(peer, which);
  auto reached = [target](uint32_t v) { return static_cast<int32_t>(v - target) >= 0; };
  for (int i = 0; i < kSpins; ++i) {
    if (reached(load_acquire(w))) return;
    cpu_relax();
  }
  const auto* header = static_cast<const ShmHeader*>(base_);
  const int32_t pid = control_of(base_, peer)->pid;
  const auto deadline = std::chrono::steady_clock::now() + timeout_;
  for (;;) {
    const uint32_t seen = load_acquire(w);
    if (reached(seen)) return;
    const uint32_t aborted = load_acquire(&header->aborted);
    FSDP_CHECK(aborted == 0, rank_, "process group", "rank ", aborted - 1,
               " failed a collective over shared memory (see its error), so this rank stops too.");
    if (process_gone(pid)) {
      fail("rank " + std::to_string(peer) + " (pid " + std::to_string(pid) +
           ") exited or was killed while this rank waited for it to " + what +
           " (shared-memory collective). Check that rank's output for the cause.");
    }
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) {
      fail("rank " + std::to_string(peer) + " did not " + what + " within " +
           std::to_string(timeout_.count()) +
           " ms (shared-memory collective): it is stuck, or it issued fewer collectives than "
           "this rank.");
    }
    futex_wait(w, seen, std::min(left, std::chrono::milliseconds(kSleepSlice)));
  }
}

namespace {

// Issued::detail: the dtype in the low byte, the reduction + 1 in the next
// (0: none), the root + 1 in the high half (0: none).
uint32_t issued_detail(at::ScalarType dtype, c10::optional<ReduceOp> op = c10::nullopt,
                       int root = -1) {
  return static_cast<uint32_t>(static_cast<uint8_t>(dtype)) |
         (op ? (static_cast<uint32_t>(*op) + 1) << 8 : 0U) |
         (static_cast<uint32_t>(root + 1) << 16);
}

std::string describe(CollectiveKind op, uint64_t total, uint32_t detail) {
  std::ostringstream os;
  os << to_string(op) << " of " << total << " bytes ("
     << c10::toString(static_cast<at::ScalarType>(detail & 0xFFU));
  if (((detail >> 8) & 0xFFU) != 0) {
    os << ", " << to_string(static_cast<ReduceOp>(((detail >> 8) & 0xFFU) - 1));
  }
  if ((detail >> 16) != 0) os << ", root " << (detail >> 16) - 1;
  os << ")";
  return os.str();
}

}  // namespace

void ShmLinks::check_descriptor(int peer, uint32_t round, const Issued& issued) {
  const Descriptor& theirs = control_of(base_, peer)->descriptors[round & 1u];
  if (theirs.op == static_cast<uint32_t>(issued.op) && theirs.total == issued.total &&
      theirs.detail == issued.detail) {
    return;
  }
  fail("rank " + std::to_string(peer) + " issued " +
       describe(static_cast<CollectiveKind>(theirs.op), theirs.total, theirs.detail) +
       " where this rank issued " + describe(issued.op, issued.total, issued.detail) +
       ": the ranks issued different collectives." + kMismatchAdvice);
}

template <typename Write, typename Read>
void ShmLinks::run_rounds(const Issued& issued, int64_t rounds, Write&& write, Read&& read) {
  Control* control = control_of(base_, rank_);
  // A part this rank fails to write or read (a CUDA error, a failed
  // reduction) stops its peers at once, naming this rank, instead of
  // leaving them to wait out the timeout.
  const auto own_part = [this](auto&& step) {
    try {
      step();
    } catch (const std::exception& e) {
      fail("this rank's part of a shared-memory collective failed: " + error_message(e));
    }
  };
  for (int64_t i = 0; i < rounds; ++i) {
    const uint32_t k = next_round_++;
    // Slot k % 2 was last read in round k - 2: every peer must be past it.
    for (int p = 0; p < size_; ++p) {
      if (p != rank_) wait_until(p, kDone, k - 1, "finish reading the previous round");
    }
    own_part([&] {
      write(i, slot(rank_, k));
      slots_->settle();  // the part is in the slot before it is posted
    });
    control->descriptors[k & 1u] =
        Descriptor{static_cast<uint32_t>(issued.op), issued.detail, issued.total};
    publish(kPosted, k + 1);
    for (int p = 0; p < size_; ++p) {
      if (p == rank_) continue;
      wait_until(p, kPosted, k + 1, "post its part");
      check_descriptor(p, k, issued);
    }
    own_part([&] {
      read(i, k);
      slots_->settle();  // every peer's part is read before its slot is freed
    });
    publish(kDone, k + 1);
  }
}

void ShmLinks::all_gather(const at::Tensor& flat, const at::Tensor& shard) {
  const size_t bytes = shard.nbytes();
  char* out = static_cast<char*>(flat.data_ptr());
  const char* own = static_cast<const char*>(shard.data_ptr());
  char* own_in_flat = out + static_cast<size_t>(rank_) * bytes;
  if (own_in_flat != own && bytes > 0) slots_->copy(own_in_flat, own, bytes);
  const size_t per_round = static_cast<size_t>(slot_bytes_);
  auto len = [&](int64_t i) { return std::min(per_round, bytes - i * per_round); };
  run_rounds(
      {CollectiveKind::kAllGather, flat.nbytes(), issued_detail(flat.scalar_type())},
      rounds_for(static_cast<int64_t>(bytes), static_cast<int64_t>(per_round)),
      [&](int64_t i, char* dst) {
        if (bytes > 0) slots_->copy(dst, own + i * per_round, len(i));
      },
      [&](int64_t i, uint32_t k) {
        if (bytes == 0) return;
        for (int p = 0; p < size_; ++p) {
          if (p != rank_) slots_->copy(out + p * bytes + i * per_round, slot(p, k), len(i));
        }
      });
}

void ShmLinks::reduce_scatter(const at::Tensor& flat, const at::Tensor& shard, ReduceOp op) {
  const int64_t n = shard.numel(), es = static_cast<int64_t>(shard.element_size());
  if (size_ == 1) {  // no peer's slot to add: the shard is the input (an average of one)
    if (n > 0 && shard.data_ptr() != flat.data_ptr()) {
      slots_->copy(static_cast<char*>(shard.data_ptr()), static_cast<const char*>(flat.data_ptr()),
                   static_cast<size_t>(n * es));
      slots_->settle();
    }
    return;
  }
  // Each round, a rank's slot holds one piece per destination rank.
  const int64_t piece = std::max<int64_t>(1, slot_bytes_ / size_ / es / 16 * 16);
  const char* in = static_cast<const char*>(flat.data_ptr());
  auto len = [&](int64_t i) { return std::min(piece, n - i * piece); };
  run_rounds(
      {CollectiveKind::kReduceScatter, flat.nbytes(), issued_detail(flat.scalar_type(), op)},
      rounds_for(n, piece),
      [&](int64_t i, char* dst) {
        if (n == 0) return;
        for (int q = 0; q < size_; ++q) {
          if (q != rank_)
            slots_->copy(dst + q * piece * es, in + (q * n + i * piece) * es, len(i) * es);
        }
      },
      [&](int64_t i, uint32_t k) {
        if (n == 0) return;
        at::Tensor out = shard.narrow(0, i * piece, len(i));
        const at::Tensor own = flat.narrow(0, rank_ * n + i * piece, len(i));
        bool first = true;
        for (int p = 0; p < size_; ++p) {
          if (p == rank_) continue;
          const at::Tensor theirs =
              view_of(slot(p, k) + rank_ * piece * es, len(i), shard.scalar_type());
          reduce_into(out, first ? own : out, theirs, op);
          first = false;
        }
        finish_reduction(out, op, size_);  // while the piece is in cache
      });
}

void ShmLinks::all_reduce(const at::Tensor& tensor, ReduceOp op) {
  if (size_ == 1) return;  // the tensor is its own sum, and its own average
  at::Tensor t = tensor.view({-1});
  const int64_t n = t.numel(), es = static_cast<int64_t>(t.element_size());
  const int64_t per_round = slot_bytes_ / es;
  const char* in = static_cast<const char*>(t.data_ptr());
  auto len = [&](int64_t i) { return std::min(per_round, n - i * per_round); };
  run_rounds(
      {CollectiveKind::kAllReduce, t.nbytes(), issued_detail(t.scalar_type(), op)},
      rounds_for(n, per_round),
      [&](int64_t i, char* dst) {
        if (n > 0) slots_->copy(dst, in + i * per_round * es, len(i) * es);
      },
      [&](int64_t i, uint32_t k) {
        if (n == 0) return;
        // Every rank sums the slots in rank order, so all get the same bits.
        at::Tensor out = t.narrow(0, i * per_round, len(i));
        reduce_into(out, view_of(slot(0, k), len(i), t.scalar_type()),
                    view_of(slot(1, k), len(i), t.scalar_type()), op);
        for (int p = 2; p < size_; ++p) {
          reduce_into(out, out, view_of(slot(p, k), len(i), t.scalar_type()), op);
        }
        finish_reduction(out, op, size_);  // while the piece is in cache
      });
}

void ShmLinks::broadcast(const at::Tensor& tensor, int root) {
  char* data = static_cast<char*>(tensor.data_ptr());
  const size_t bytes = tensor.nbytes(), per_round = static_cast<size_t>(slot_bytes_);
  auto len = [&](int64_t i) { return std::min(per_round, bytes - i * per_round); };
  run_rounds(
      {CollectiveKind::kBroadcast, bytes, issued_detail(tensor.scalar_type(), c10::nullopt, root)},
      rounds_for(static_cast<int64_t>(bytes), static_cast<int64_t>(per_round)),
      [&](int64_t i, char* dst) {
        if (rank_ == root && bytes > 0) slots_->copy(dst, data + i * per_round, len(i));
      },
      [&](int64_t i, uint32_t k) {
        if (rank_ != root && bytes > 0) slots_->copy(data + i * per_round, slot(root, k), len(i));
      });
}

}  // namespace fsdp::detail
