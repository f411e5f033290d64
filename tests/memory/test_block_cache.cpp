// The CPU block cache (Note [CPU block cache]): large blocks are reused
// instead of faulted in again, the cache never holds more than the peak of
// blocks in use, and, at the process level, FSDP's peak resident memory
// follows the sharding (issue 18).

#include <ATen/ATen.h>
#include <c10/core/CPUAllocator.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include <fsdp/fsdp.h>

#include "multi_rank.h"
#include "resident_memory.h"

namespace fsdp::testing {
namespace {

namespace nn = torch::nn;

constexpr int64_t kMiB = int64_t{1} << 20;

int64_t rss_bytes() { return memory_stats().resident_bytes; }

TEST(BlockCache, FreedBlockIsReusedForTheNextRequestOfItsSize) {
  ASSERT_TRUE(enable_cpu_block_cache());
  empty_cpu_block_cache();
  at::Tensor t = at::empty({4 * kMiB}, at::kByte);
  void* first = t.data_ptr();
  const MemoryStats held = memory_stats();
  EXPECT_EQ(held.cached_bytes, 0);
  t.reset();
  const MemoryStats freed = memory_stats();
  EXPECT_EQ(freed.cached_bytes, 4 * kMiB) << "the freed block is kept";
  EXPECT_EQ(freed.current_bytes, held.current_bytes - 4 * kMiB) << "and no longer counted in use";

  // The same size, and a size that the block serves within 1/8, reuse it.
  at::Tensor again = at::empty({4 * kMiB}, at::kByte);
  EXPECT_EQ(again.data_ptr(), first);
  EXPECT_EQ(memory_stats().cached_bytes, 0);
  again.reset();
  at::Tensor slightly_smaller = at::empty({4 * kMiB - 300 * 1024}, at::kByte);
  EXPECT_EQ(slightly_smaller.data_ptr(), first);
  slightly_smaller.reset();
  // A much smaller request takes it too, rather than mapping memory beyond
  // the peak in use (4 MiB); a larger one cannot, and gets a new block while
  // the cached one is unmapped to stay under the peak.
  at::Tensor half = at::empty({2 * kMiB}, at::kByte);
  EXPECT_EQ(half.data_ptr(), first);
  half.reset();
  at::Tensor twice = at::empty({8 * kMiB}, at::kByte);
  EXPECT_EQ(memory_stats().cached_bytes, 0);
  twice.reset();
  EXPECT_EQ(memory_stats().cached_bytes, 8 * kMiB);
  empty_cpu_block_cache();
  EXPECT_EQ(memory_stats().cached_bytes, 0);
}

TEST(BlockCache, CountsAreTheBytesAskedFor) {
  ASSERT_TRUE(enable_cpu_block_cache());
  const MemoryStats start = memory_stats();
  {
    at::Tensor a = at::empty({3 * kMiB + 5}, at::kByte);  // not a page multiple
    at::Tensor b = at::ones({kMiB / 4}, at::kFloat);      // exactly the smallest cached size
    const MemoryStats held = memory_stats();
    EXPECT_EQ(held.current_bytes, start.current_bytes + 4 * kMiB + 5);
    EXPECT_EQ(held.allocations, start.allocations + 2);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(a.data_ptr()) % 4096, 0u) << "a block is whole pages";
  }
  const MemoryStats end = memory_stats();
  EXPECT_EQ(end.current_bytes, start.current_bytes);
  EXPECT_EQ(end.frees, start.frees + 2);
}

// Whatever sizes a program cycles through, the cache holds at most the peak
// of blocks in use (plus 1/16): here four phases, each of eight blocks of a
// size the earlier phases' blocks cannot serve.
TEST(BlockCache, NeverHoldsMoreThanThePeakInUse) {
  ASSERT_TRUE(enable_cpu_block_cache());
  empty_cpu_block_cache();
  const int64_t base = memory_stats().current_bytes;
  reset_peak_memory_stats();
  int64_t worst = 0, peak = 0;
  for (const int64_t mib : {3, 5, 2, 7}) {
    std::vector<at::Tensor> held;
    for (int i = 0; i < 8; ++i) {
      held.push_back(at::empty({mib * kMiB}, at::kByte));
      const MemoryStats s = memory_stats();
      peak = std::max(peak, s.current_bytes - base);
      worst = std::max(worst, s.current_bytes - base + s.cached_bytes);
    }
  }
  EXPECT_EQ(peak, 8 * 7 * kMiB);
  EXPECT_LE(worst, peak + peak / 16)
      << "in use + cached exceeded the peak in use by more than 1/16";
  EXPECT_GT(memory_stats().cached_bytes, 0);
  empty_cpu_block_cache();
}

struct CycleFigures {
  // What touching the blocks faulted in, over the bytes touched: in the
  // first round and in the last.
  double first_faulted_in, faulted_in;
  double rss;  // peak RSS growth / (1.15 x tracker peak + 8 MiB)
};

/// Allocates `n` bytes from `cpu`, touches them, and adds what that faulted
/// in to `faulted_in`.
c10::DataPtr allocate_and_touch(c10::Allocator* cpu, size_t n, int64_t& faulted_in) {
  const int64_t before = rss_now();
  c10::DataPtr block = cpu->allocate(n);
  std::memset(block.get(), 1, n);
  faulted_in += rss_now() - before;
  return block;
}

// `rounds` rounds of a step-like cycle of blocks (some held across the
// round, some freed at once, sizes as varied as a model's units), through
// LibTorch's CPU allocator, measured as Note [Measuring resident memory in
// tests] says, from an empty block cache. `empty_cache` empties it after
// every round too, so that each round maps its blocks afresh.
CycleFigures cycle_blocks(int rounds, bool empty_cache = false) {
  enable_memory_tracking();
  empty_cpu_block_cache();
  const int64_t rss0 = rss_bytes();
  EXPECT_TRUE(reset_peak_rss()) << "the resident high-water mark cannot be reset here";
  reset_peak_memory_stats();
  const int64_t base = memory_stats().current_bytes;
  std::vector<double> faulted_in(rounds);
  c10::Allocator* cpu = c10::GetCPUAllocator();
  for (double& round : faulted_in) {
    int64_t bytes = 0, touched = 0;
    std::vector<c10::DataPtr> held;
    for (int unit = 0; unit < 8; ++unit) {
      const size_t n = (6 + unit % 3) * kMiB;
      c10::DataPtr gathered = allocate_and_touch(cpu, n, bytes);  // transient, per unit
      held.push_back(allocate_and_touch(cpu, n / 2, bytes));      // kept until the round ends
      touched += static_cast<int64_t>(n + n / 2);
    }
    held.clear();
    if (empty_cache) empty_cpu_block_cache();
    round = static_cast<double>(bytes) / static_cast<double>(touched);
  }
  const double growth = static_cast<double>(peak_rss_bytes() - rss0);
  const double bound =
      1.15 * static_cast<double>(memory_stats().peak_bytes - base) + static_cast<double>(8 * kMiB);
  return {faulted_in.front(), faulted_in.back(), growth / bound};
}

// Each in a fresh process (the cache, once on, stays on): with the cache,
// touching the last round's blocks faults in nothing (after a few rounds in
// which its ranges settle) and RSS grows by what the blocks in use need;
// emptied after every round, the cache faults in each round as much as in
// its first (the measurement sees it); LibTorch's allocator (glibc) gives up
// one of the two (here its heap keeps 1.7x the bound).
TEST(BlockCache, StepsFaultInNothingAndResidentMemoryFollowsTheBlocksInUse) {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "the sanitizer's shadow memory and allocator distort resident memory";
#endif
  run_ranks_ok(1, [](int, int) {
    ASSERT_TRUE(enable_cpu_block_cache());
    const CycleFigures cached = cycle_blocks(6);
    std::printf(
        "cache: faulted in by the first round %.3f, the last %.3f; RSS growth / bound %.3f\n",
        cached.first_faulted_in, cached.faulted_in, cached.rss);
    EXPECT_LT(cached.faulted_in, 0.05) << "the cache did not reuse its blocks";
    EXPECT_LE(cached.rss, 1.0) << "resident memory grew beyond what the blocks in use explain";
    const CycleFigures emptied = cycle_blocks(2, /*empty_cache=*/true);
    std::printf("cache emptied every round: faulted in by the first round %.3f, the last %.3f\n",
                emptied.first_faulted_in, emptied.faulted_in);
    EXPECT_GT(emptied.faulted_in, 0.9 * emptied.first_faulted_in)
        << "the control: blocks mapped afresh were not seen faulted in";
  });
  run_ranks_ok(1, [](int, int) {
    const CycleFigures glibc = cycle_blocks(6);
    std::printf(
        "LibTorch's allocator: faulted in by the first round %.3f, the last %.3f; RSS growth / "
        "bound %.3f\n",
        glibc.first_faulted_in, glibc.faulted_in, glibc.rss);
    // glibc either faults the blocks in again or keeps more than the bound.
    EXPECT_TRUE(glibc.faulted_in > 0.5 || glibc.rss > 1.0)
        << "the control: glibc matched the cache";
  });
}

TEST(BlockCache, EmptyingTheCacheReturnsItsMemoryToTheOs) {
  ASSERT_TRUE(enable_cpu_block_cache());
  empty_cpu_block_cache();
  {
    std::vector<at::Tensor> blocks;
    for (int i = 0; i < 8; ++i) blocks.push_back(at::ones({8 * kMiB}, at::kByte));
  }
  EXPECT_GE(memory_stats().cached_bytes, 64 * kMiB);
  const int64_t before = rss_bytes();
  empty_cpu_block_cache();
  EXPECT_EQ(memory_stats().cached_bytes, 0);
#if !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__)
  // (A sanitizer's shadow pages stay resident.)
  EXPECT_LE(rss_bytes(), before - 60 * kMiB) << "the cached blocks are still resident";
#else
  (void)before;
#endif
}

// A size past PTRDIFF_MAX (a negative one cast to size_t) is refused as
// c10's allocator refuses it, not wrapped to a cached block already free.
TEST(BlockCache, ASizePastPtrdiffMaxIsRefusedNotWrapped) {
  ASSERT_TRUE(enable_cpu_block_cache());
  empty_cpu_block_cache();
  { at::Tensor block = at::ones({4 * kMiB}, at::kByte); }
  ASSERT_EQ(memory_stats().cached_bytes, 4 * kMiB);
  EXPECT_THROW(c10::GetCPUAllocator()->allocate(SIZE_MAX - 100), c10::Error);
  EXPECT_EQ(memory_stats().cached_bytes, 4 * kMiB) << "the free block was handed out";
  empty_cpu_block_cache();
}

// oneDNN kernels allocate through the allocator's raw interface, also blocks
// large enough for the cache.
TEST(BlockCache, RawInterfaceServesLargeBlocks) {
  ASSERT_TRUE(enable_cpu_block_cache());
  empty_cpu_block_cache();
  const int64_t before = memory_stats().current_bytes;
  {
    at::Tensor x = at::randn({512, 1024});  // 2 MiB
    at::Tensor y = at::gelu(x);
    EXPECT_TRUE(at::allclose(y, x * 0.5 * (1 + at::erf(x / std::sqrt(2.0))), 1e-5, 1e-5));
    c10::Allocator* cpu = c10::GetCPUAllocator();
    ASSERT_NE(cpu->raw_deleter(), nullptr);
    void* p = cpu->raw_allocate(3 * kMiB);
    EXPECT_EQ(memory_stats().cached_bytes % (1 << 12), 0);
    const int64_t cached = memory_stats().cached_bytes;
    cpu->raw_deallocate(p);
    EXPECT_EQ(memory_stats().cached_bytes, cached + 3 * kMiB);
  }
  EXPECT_EQ(memory_stats().current_bytes, before);
}

TEST(BlockCache, ConcurrentThreadsShareTheCacheExactly) {
  ASSERT_TRUE(enable_cpu_block_cache());
  const MemoryStats start = memory_stats();
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([t] {
      std::vector<at::Tensor> held(3);
      for (int i = 0; i < 200; ++i) {
        held[i % 3] = at::empty({(1 + (t + i) % 4) * kMiB}, at::kByte);
        held[i % 3].data_ptr<uint8_t>()[0] = static_cast<uint8_t>(i);
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  const MemoryStats end = memory_stats();
  EXPECT_EQ(end.current_bytes, start.current_bytes);
  EXPECT_EQ(end.allocations - start.allocations, 800);
  EXPECT_EQ(end.frees - start.frees, 800);
}

// ---------------------------------------------------------------------------
// FSDP at the process level.

constexpr int64_t kWidth = 1448, kLayers = 8;  // 8 MiB per layer, 64 MiB in all

struct WideLinearImpl : nn::Module {
  WideLinearImpl() {
    weight = register_parameter("weight", torch::empty({kWidth, kWidth}));
    bias = register_parameter("bias", torch::zeros({kWidth}));
    torch::NoGradGuard no_grad;
    weight.uniform_(-0.02, 0.02);
  }
  torch::Tensor forward(torch::Tensor x) { return torch::tanh(torch::addmm(bias, x, weight.t())); }
  torch::Tensor weight, bias;
};
TORCH_MODULE(WideLinear);

struct ChainImpl : nn::SequentialImpl {
  torch::Tensor forward(torch::Tensor x) { return nn::SequentialImpl::forward(x); }
};
TORCH_MODULE(Chain);

/// Three AdamW steps on the chain (each layer a unit when `strategy` is set,
/// built unit by unit, as a model too large for one process is); returns
/// {peak RSS growth since before the model, the tracker's peak since then}.
std::pair<int64_t, int64_t> train_and_measure(std::optional<ShardingStrategy> strategy, int rank) {
  enable_memory_tracking();
  torch::set_num_threads(1);
  const int64_t rss0 = rss_bytes();
  EXPECT_TRUE(reset_peak_rss()) << "the resident high-water mark cannot be reset here";
  reset_peak_memory_stats();
  const int64_t base = memory_stats().current_bytes;
  torch::manual_seed(0);
  {
    std::vector<at::Tensor> params;
    std::function<at::Tensor(at::Tensor)> forward;
    Chain chain;
    std::shared_ptr<torch::nn::Module> root;
    if (strategy) {
      const auto opts = FSDPOptions().sharding_strategy(*strategy);
      EnableWrap scope(opts);
      for (int64_t i = 0; i < kLayers; ++i) chain->push_back(wrap(WideLinear()));
      auto wrapped = wrap(chain);
      params = wrapped->parameters();
      forward = [wrapped](at::Tensor x) mutable { return wrapped->forward(x); };
      root = wrapped.ptr();
    } else {
      for (int64_t i = 0; i < kLayers; ++i) chain->push_back(WideLinear());
      params = chain->parameters();
      forward = [chain](at::Tensor x) mutable { return chain->forward(x); };
    }
    torch::optim::AdamW opt(params, torch::optim::AdamWOptions(1e-3));
    torch::manual_seed(100 + rank);
    for (int step = 0; step < 3; ++step) {
      opt.zero_grad();
      forward(torch::randn({16, kWidth})).square().mean().backward();
      opt.step();
    }
  }
  return {peak_rss_bytes() - rss0, memory_stats().peak_bytes - base};
}

std::string rss_file() { return ::testing::TempDir() + "fsdp_block_cache_local_rss"; }

// Issue 18: a user watching top sees FULL_SHARD hold less than one process
// training the whole model (at most 0.8x at 2 ranks), and in every mode the
// peak RSS growth stays within 1.15x the tracker's peak + 32 MiB, i.e. no
// heap of freed unit-sized buffers on top of what the tensors need.
TEST(BlockCacheFsdp, PeakResidentMemoryFollowsTheSharding) {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "the sanitizer's shadow memory and allocator distort resident memory";
#endif
  MultiRankOptions options;
  options.deadline = std::chrono::seconds(120);
  options.env["FSDP_TEST_LOCAL_RSS"] = rss_file();
  // The baseline: plain LibTorch in one process, with LibTorch's allocator.
  run_ranks_ok(
      1,
      [](int rank, int) {
        const auto [growth, peak] = train_and_measure(std::nullopt, rank);
        std::printf("local: peak RSS growth %.1f MiB, tracker peak %.1f MiB\n", growth / 1048576.0,
                    peak / 1048576.0);
        std::ofstream(std::getenv("FSDP_TEST_LOCAL_RSS")) << growth << "\n";
      },
      options);
  for (const ShardingStrategy strategy :
       {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp, ShardingStrategy::kNoShard}) {
    SCOPED_TRACE(to_string(strategy));
    const auto outcomes = run_ranks(
        2,
        [strategy](int rank, int) {
          auto group = init_process_group(ProcessGroupOptions().timeout(std::chrono::seconds(60)));
          const auto [growth, peak] = train_and_measure(strategy, rank);
          int64_t local = 0;
          std::ifstream(std::getenv("FSDP_TEST_LOCAL_RSS")) >> local;
          ASSERT_GT(local, 0);
          std::printf(
              "%s rank %d: peak RSS growth %.1f MiB, tracker peak %.1f MiB, local %.1f MiB\n",
              to_string(strategy), rank, growth / 1048576.0, peak / 1048576.0, local / 1048576.0);
          EXPECT_LE(static_cast<double>(growth), 1.15 * static_cast<double>(peak) + 32 * kMiB);
          if (strategy == ShardingStrategy::kFullShard) {
            EXPECT_LE(static_cast<double>(growth), 0.8 * static_cast<double>(local));
          }
          group->barrier().wait();
        },
        options);
    expect_all_succeeded(outcomes);
    for (const RankOutcome& o : outcomes) std::printf("%s", o.output.c_str());
  }
}

// FULL_SHARD's backward holds a few units' parameters and gradients at a
// time, not all of them: the root (embeddings, whose gradients arrive last)
// once held back every reduction, and with it every unit's gathered
// parameters and unsharded gradient, until the end of backward (Note
// [Reduction order]). Tracker bytes, at 2 ranks, 8 units of 8 MiB.
TEST(BlockCacheFsdp, FullShardBackwardHoldsAFewUnitsAtATime) {
  run_ranks_ok(2, [](int, int) {
    enable_memory_tracking();
    torch::set_num_threads(1);
    auto group = init_process_group(ProcessGroupOptions().timeout(std::chrono::seconds(60)));
    const auto opts = FSDPOptions();
    EnableWrap scope(opts);
    Chain chain;
    // The root's own parameters first, as embeddings are: their gradients
    // arrive last in backward.
    chain->push_back(nn::Linear(kWidth, kWidth));
    for (int64_t i = 0; i < kLayers; ++i) chain->push_back(wrap(WideLinear()));
    auto root = wrap(chain);
    for (int step = 0; step < 2; ++step) {
      root->zero_grad(/*set_to_none=*/true);
      at::Tensor loss = root->forward(torch::randn({2, kWidth})).square().mean();
      reset_peak_memory_stats();
      loss.backward();
      // Above what stays (the new gradient shards): what backward held only
      // for a while.
      const MemoryStats end = memory_stats();
      const int64_t unit_bytes = (kWidth * kWidth + kWidth) * 4;
      const double held = static_cast<double>(end.peak_bytes - end.current_bytes) / unit_bytes;
      std::printf("backward's transient peak: %.1f units\n", held);
      // A unit's gathered parameters, its parameters' gradients and its
      // flat gradient, for the unit computing and one prefetched or reducing.
      EXPECT_LE(held, 6.0) << "backward held most units at once";
    }
    group->barrier().wait();
  });
}

}  // namespace
}  // namespace fsdp::testing
