// Tests for fsdp::memory_stats() and the tracking CPU allocator behind it.

#include <ATen/ATen.h>
#include <ATen/native/Resize.h>
#include <c10/core/CPUAllocator.h>
#include <gtest/gtest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#include <fsdp/memory.h>

#include "memory/malloc_tuning.h"
#include "resident_memory.h"

namespace {

constexpr int64_t kMiB = int64_t{1} << 20;

/// Tensors allocated before any test runs, i.e. before tracking is installed
/// (a global environment's SetUp runs ahead of every test, whatever the
/// filter or order).
std::vector<at::Tensor>& pre_tracking_tensors() {
  static std::vector<at::Tensor> tensors;
  return tensors;
}

/// The CPU allocator that was installed when the environment was set up.
c10::Allocator* g_allocator_before_tracking = nullptr;

class PreTrackingEnvironment : public ::testing::Environment {
 public:
  void SetUp() override {
    // --gtest_repeat sets the environment up again, by then behind tracking.
    if (g_allocator_before_tracking != nullptr) return;
    g_allocator_before_tracking = c10::GetCPUAllocator();
    for (int i = 0; i < 3; ++i) pre_tracking_tensors().push_back(at::ones({kMiB}, at::kByte));
    pre_tracking_tensors().push_back(at::empty({16 * kMiB}, at::kByte));
  }
  void TearDown() override { pre_tracking_tensors().clear(); }
};

::testing::Environment* const g_environment =
    ::testing::AddGlobalTestEnvironment(new PreTrackingEnvironment);

TEST(Memory, LargeAllocationIsCountedAndPeakStaysUntilReset) {
  fsdp::enable_memory_tracking();
  fsdp::reset_peak_memory_stats();
  const fsdp::MemoryStats start = fsdp::memory_stats();
  EXPECT_TRUE(start.tracking);
  EXPECT_EQ(start.peak_bytes, start.current_bytes);

  at::Tensor t = at::empty({64 * kMiB}, at::kByte);
  // at::empty on CPU must reach the allocator installed by SetCPUAllocator.
  EXPECT_EQ(t.storage().allocator(), c10::GetCPUAllocator());
  const fsdp::MemoryStats held = fsdp::memory_stats();
  EXPECT_GE(held.current_bytes, start.current_bytes + 64 * kMiB);
  EXPECT_GE(held.peak_bytes, start.current_bytes + 64 * kMiB);
  EXPECT_EQ(held.allocations, start.allocations + 1);

  t.reset();
  const fsdp::MemoryStats freed = fsdp::memory_stats();
  EXPECT_EQ(freed.current_bytes, start.current_bytes);
  EXPECT_EQ(freed.frees, start.frees + 1);
  EXPECT_GE(freed.peak_bytes, start.current_bytes + 64 * kMiB) << "peak must survive the free";

  fsdp::reset_peak_memory_stats();
  const fsdp::MemoryStats reset = fsdp::memory_stats();
  EXPECT_EQ(reset.peak_bytes, reset.current_bytes);
  EXPECT_EQ(reset.current_bytes, start.current_bytes);
}

TEST(Memory, SmallAndEmptyAllocations) {
  fsdp::enable_memory_tracking();
  const fsdp::MemoryStats start = fsdp::memory_stats();
  {
    // No small-size pool in LibTorch's CPU allocator: 4 bytes are 4 bytes.
    at::Tensor one = at::empty({1}, at::kFloat);
    EXPECT_EQ(fsdp::memory_stats().current_bytes, start.current_bytes + 4);
    // Empty tensors hold no memory and are passed through uncounted.
    at::Tensor none = at::empty({0}, at::kFloat);
    const fsdp::MemoryStats held = fsdp::memory_stats();
    EXPECT_EQ(held.current_bytes, start.current_bytes + 4);
    EXPECT_EQ(held.allocations, start.allocations + 1);
  }
  const fsdp::MemoryStats end = fsdp::memory_stats();
  EXPECT_EQ(end.current_bytes, start.current_bytes);
  EXPECT_EQ(end.frees, start.frees + 1);
}

// FSDP frees a parameter by resizing its storage to 0 bytes and back; both
// directions go through the storage's allocator, so both must be counted.
TEST(Memory, ResizingStorageToZeroAndBackIsCounted) {
  fsdp::enable_memory_tracking();
  constexpr int64_t kBytes = 4 * kMiB;
  at::Tensor t = at::ones({kBytes / 4}, at::kFloat);
  c10::StorageImpl* storage = t.storage().unsafeGetStorageImpl();
  const fsdp::MemoryStats held = fsdp::memory_stats();

  at::native::resize_bytes_cpu(storage, 0);
  EXPECT_EQ(t.storage().nbytes(), 0u);
  const fsdp::MemoryStats released = fsdp::memory_stats();
  EXPECT_EQ(released.current_bytes, held.current_bytes - kBytes);
  EXPECT_EQ(released.frees, held.frees + 1);

  at::native::resize_bytes_cpu(storage, kBytes);
  EXPECT_EQ(t.storage().nbytes(), static_cast<size_t>(kBytes));
  const fsdp::MemoryStats refilled = fsdp::memory_stats();
  EXPECT_EQ(refilled.current_bytes, held.current_bytes);
  EXPECT_EQ(refilled.allocations, held.allocations + 1);
  t.fill_(2.0f);  // the new buffer is usable through the old tensor
  EXPECT_EQ(t.sum().item<float>(), 2.0f * static_cast<float>(kBytes / 4));

  t.reset();
  EXPECT_EQ(fsdp::memory_stats().current_bytes, held.current_bytes - kBytes);
}

TEST(Memory, ConcurrentAllocationsAreCountedExactly) {
  fsdp::enable_memory_tracking();
  fsdp::reset_peak_memory_stats();
  const fsdp::MemoryStats start = fsdp::memory_stats();
  constexpr int kThreads = 8;
  constexpr int kIterations = 400;
  constexpr int kHeld = 4;  // each thread keeps a few alive so frees interleave
  std::vector<std::thread> threads;
  for (int rank = 0; rank < kThreads; ++rank) {
    threads.emplace_back([rank] {
      std::vector<at::Tensor> held(kHeld);
      for (int i = 0; i < kIterations; ++i) {
        held[i % kHeld] = at::empty({(rank + 1) * 4096 + i % 7}, at::kByte);
      }
    });
  }
  for (std::thread& thread : threads) thread.join();

  const fsdp::MemoryStats end = fsdp::memory_stats();
  EXPECT_EQ(end.current_bytes, start.current_bytes);
  EXPECT_EQ(end.allocations - start.allocations, kThreads * kIterations);
  EXPECT_EQ(end.frees - start.frees, kThreads * kIterations);
  // At least one thread held kHeld tensors of its size at once.
  EXPECT_GE(end.peak_bytes, start.current_bytes + kHeld * 4096);
}

// Storages from before installation keep their original allocator, for the
// free and for resizes alike, so they never touch the counts.
TEST(Memory, StoragesFromBeforeTrackingAreNotCounted) {
  if (pre_tracking_tensors().empty()) GTEST_SKIP() << "consumed by an earlier --gtest_repeat";
  ASSERT_EQ(pre_tracking_tensors().size(), 4u);
  for (const at::Tensor& t : pre_tracking_tensors()) {
    ASSERT_EQ(t.storage().allocator(), g_allocator_before_tracking);
  }
  fsdp::enable_memory_tracking();
  ASSERT_NE(c10::GetCPUAllocator(), g_allocator_before_tracking);
  const fsdp::MemoryStats start = fsdp::memory_stats();
  ASSERT_GE(start.current_bytes, 0);

  c10::StorageImpl* storage = pre_tracking_tensors()[0].storage().unsafeGetStorageImpl();
  at::native::resize_bytes_cpu(storage, 0);
  at::native::resize_bytes_cpu(storage, 2 * kMiB);
  pre_tracking_tensors().clear();

  const fsdp::MemoryStats end = fsdp::memory_stats();
  EXPECT_EQ(end.current_bytes, start.current_bytes);
  EXPECT_GE(end.current_bytes, 0);
  EXPECT_EQ(end.allocations, start.allocations);
  EXPECT_EQ(end.frees, start.frees);
}

TEST(Memory, EnableIsIdempotentAndThreadSafe) {
  std::vector<std::thread> threads;
  for (int i = 0; i < 4; ++i) threads.emplace_back([] { fsdp::enable_memory_tracking(); });
  for (std::thread& thread : threads) thread.join();
  c10::Allocator* installed = c10::GetCPUAllocator();
  fsdp::enable_memory_tracking();
  EXPECT_EQ(c10::GetCPUAllocator(), installed);
  EXPECT_TRUE(fsdp::memory_stats().tracking);
  // Wrapping twice would count each byte twice.
  const fsdp::MemoryStats start = fsdp::memory_stats();
  at::Tensor t = at::empty({kMiB}, at::kByte);
  EXPECT_EQ(fsdp::memory_stats().current_bytes, start.current_bytes + kMiB);
}

}  // namespace

namespace fsdp {
namespace {

// oneDNN kernels (at::gelu's exact form in LibTorch 1.13) allocate through
// the allocator's raw interface; with tracking on they must still work.
TEST(MemoryTracking, RawInterfaceServesOneDnnKernels) {
  enable_memory_tracking();
  const int64_t before = memory_stats().current_bytes;
  {
    at::Tensor x = at::randn({64, 1024});
    at::Tensor y = at::gelu(x);
    EXPECT_TRUE(at::allclose(y, x * 0.5 * (1 + at::erf(x / std::sqrt(2.0))), 1e-5, 1e-5));
    c10::Allocator* cpu = c10::GetCPUAllocator();
    ASSERT_NE(cpu->raw_deleter(), nullptr);
    void* p = cpu->raw_allocate(4096);
    EXPECT_GE(memory_stats().current_bytes - before, 4096 + 2 * 64 * 1024 * 4);
    cpu->raw_deallocate(p);
  }
  EXPECT_EQ(memory_stats().current_bytes, before);
}

/// In a fresh child process (optionally after detail::keep_freed_heap_memory(),
/// what keep_freed_cpu_memory() did before the CPU block cache):
/// three rounds of allocating, touching and freeing `blocks` blocks of
/// `block_bytes`, the way a training step cycles unit-sized buffers. Returns,
/// for the first and the third round, what touching the blocks faulted in
/// over their bytes (Note [Measuring resident memory in tests]).
/// (Plain malloc: LibTorch's posix_memalign also depends on how glibc splits
/// aligned chunks, which makes its count less regular; bench_step measures
/// the effect on real steps, BENCH_DEFAULT_MALLOC=1 against the default.)
std::array<double, 2> fresh_bytes_of_rounds_1_and_3(bool keep, int blocks, size_t block_bytes) {
  int fds[2];
  if (pipe(fds) != 0) return {-1, -1};
  const pid_t pid = fork();
  if (pid == 0) {
    close(fds[0]);
    if (keep && !detail::keep_freed_heap_memory()) _exit(3);
    std::array<double, 3> fresh{};
    for (double& round : fresh) {
      int64_t bytes = 0;
      std::vector<void*> ptrs(blocks);
      for (void*& p : ptrs) {
        const int64_t before = testing::rss_now();
        p = std::malloc(block_bytes);
        if (p == nullptr) _exit(4);
        std::memset(p, 1, block_bytes);
        bytes += testing::rss_now() - before;
      }
      for (void* p : ptrs) std::free(p);
      round = static_cast<double>(bytes) / static_cast<double>(blocks * block_bytes);
    }
    const std::array<double, 2> result{fresh[0], fresh[2]};
    const ssize_t n = write(fds[1], result.data(), sizeof(result));
    _exit(n == sizeof(result) ? 0 : 5);
  }
  close(fds[1]);
  std::array<double, 2> result{-1, -1};
  const ssize_t n = read(fds[0], result.data(), sizeof(result));
  close(fds[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  if (n != sizeof(result) || !WIFEXITED(status) || WEXITSTATUS(status) != 0) return {-1, -1};
  std::printf("%s: faulted in by round 1 %.3f, by round 3 %.3f\n",
              keep ? "keep_freed_heap_memory" : "glibc's default", result[0], result[1]);
  return result;
}

// See Note [Reusing freed CPU memory]: with glibc's defaults the freed heap
// goes back to the OS and every round faults its pages in again; with
// keep_freed_heap_memory() the third round reuses the second round's memory.
TEST(Memory, KeepFreedCpuMemoryReusesPagesInsteadOfFaultingThemIn) {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "the sanitizer replaces glibc's malloc, whose tuning this tests";
#endif
#if defined(__GLIBC__)
  const int blocks = 8;
  const size_t block_bytes = 6 * kMiB;
  const auto [default_first, by_default] =
      fresh_bytes_of_rounds_1_and_3(false, blocks, block_bytes);
  const auto [kept_first, kept] = fresh_bytes_of_rounds_1_and_3(true, blocks, block_bytes);
  ASSERT_GE(by_default, 0) << "the child process failed";
  ASSERT_GE(kept, 0) << "the child process failed (or keep_freed_heap_memory returned false)";
  // The measurement sees fresh memory as such: both first rounds are fresh.
  EXPECT_GT(default_first, 0.9);
  EXPECT_GT(kept_first, 0.9);
  EXPECT_GT(by_default, 0.5) << "glibc's default no longer returns freed heap: the control fails";
  EXPECT_LT(kept, 0.05) << "freed memory was not reused";
#else
  EXPECT_FALSE(detail::keep_freed_heap_memory());
#endif
}

}  // namespace
}  // namespace fsdp
