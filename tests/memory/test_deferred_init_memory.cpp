// Memory of deferred initialisation (issue 4): wrapping a model of S bytes
// over N ranks never holds more than S/N plus the largest unit plus 10% per
// rank, measured with fsdp::memory_stats() on a 64 MiB model at 2 ranks:
// built on the meta device and auto-wrapped, or built unit by unit with
// fsdp::wrap() inside an EnableWrap scope (shard-as-you-build).

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <fsdp/fsdp.h>

#include "multi_rank.h"

namespace fsdp::testing {
namespace {

namespace nn = torch::nn;

constexpr int64_t kIn = 1448, kOut = 1448, kLayers = 8;
constexpr int64_t kUnitBytes = (kIn * kOut + kOut) * 4;  // 8 MiB + 5.7 KiB
constexpr int64_t kModelBytes = kLayers * kUnitBytes;    // 64.03 MiB

// A Linear that can be built on the meta device (C++ modules cannot be told
// a device), with a reset that writes in place.
struct BigLinearImpl : nn::Module {
  BigLinearImpl(torch::Device device) {
    weight = register_parameter("weight", torch::empty({kOut, kIn}, torch::device(device)));
    bias = register_parameter("bias", torch::empty({kOut}, torch::device(device)));
    if (!device.is_meta()) reset_parameters();
  }
  void reset_parameters() {
    torch::NoGradGuard no_grad;
    weight.uniform_(-0.03, 0.03);
    bias.zero_();
  }
  torch::Tensor forward(torch::Tensor x) { return torch::addmm(bias, x, weight.t()); }
  torch::Tensor weight, bias;
};
TORCH_MODULE(BigLinear);

struct ChainImpl : nn::SequentialImpl {
  torch::Tensor forward(torch::Tensor x) { return nn::SequentialImpl::forward(x); }
};
TORCH_MODULE(Chain);

void expect_within_bound(int64_t base, int world, const std::string& what) {
  const MemoryStats stats = memory_stats();
  ASSERT_TRUE(stats.tracking);
  const double bound = 1.10 * (static_cast<double>(kModelBytes) / world + kUnitBytes);
  const int64_t peak = stats.peak_bytes - base;
  EXPECT_LE(peak, bound) << what << ": peak " << peak << " bytes, bound " << bound;
  // What stays: this rank's shards.
  EXPECT_LE(stats.current_bytes - base, 1.02 * kModelBytes / world) << what;
  EXPECT_GE(stats.current_bytes - base, 0.98 * kModelBytes / world) << what;
  std::printf("%s: peak %.1f MiB, bound %.1f MiB, resident %.1f MiB\n", what.c_str(),
              peak / 1048576.0, bound / 1048576.0, (stats.current_bytes - base) / 1048576.0);
}

TEST(DeferredInitMemory, MetaModelWrappedUnitByUnit) {
  run_ranks_ok(2, [](int, int world) {
    enable_memory_tracking();  // before the model exists
    torch::set_num_threads(1);
    register_reset_parameters<BigLinearImpl>();
    auto group = init_process_group(ProcessGroupOptions().timeout(std::chrono::seconds(60)));
    const int64_t base = memory_stats().current_bytes;
    reset_peak_memory_stats();
    {
      Chain chain;
      for (int64_t i = 0; i < kLayers; ++i) chain->push_back(BigLinear(torch::kMeta));
      EXPECT_LT(memory_stats().current_bytes - base, 1 << 20) << "a meta model has no storage";
      nn::Sequential seq(chain.ptr());
      auto_wrap(seq, module_type_policy<BigLinearImpl>());
      FullyShardedDataParallel<ChainImpl> root(chain);
      expect_within_bound(base, world, "meta + auto_wrap");
      // It trains: one forward/backward (the gathered units are transient).
      root->forward(torch::randn({2, kIn})).sum().backward();
    }
    group->barrier().wait();
  });
}

TEST(DeferredInitMemory, ShardAsYouBuildInsideEnableWrap) {
  run_ranks_ok(2, [](int, int world) {
    enable_memory_tracking();
    torch::set_num_threads(1);
    auto group = init_process_group(ProcessGroupOptions().timeout(std::chrono::seconds(60)));
    const int64_t base = memory_stats().current_bytes;
    reset_peak_memory_stats();
    {
      EnableWrap scope(FSDPOptions{});
      Chain chain;
      // Each layer is built on the CPU and sharded at once by wrap().
      for (int64_t i = 0; i < kLayers; ++i) chain->push_back(wrap(BigLinear(torch::kCPU)));
      auto root = wrap(chain);
      expect_within_bound(base, world, "enable_wrap + wrap");
    }
    group->barrier().wait();
  });
}

}  // namespace
}  // namespace fsdp::testing
