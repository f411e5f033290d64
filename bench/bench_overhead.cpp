// Per-unit overhead benchmark (issue: FSDP core, "Overhead"). 64 units of
// Linear(32, 32) + ReLU, batch 4, one intra-op thread, so the compute is tiny
// and a step's time is mostly FSDP's bookkeeping and collectives:
//   build/bin/bench_overhead                                  # world size 1
//   build/bin/fsdprun --nproc-per-node 2 build/bin/bench_overhead
// Options: --units 64 --width 32 --batch 4 --warmup 20 --rounds 5 --steps 40
//   --modes full_shard,shard_grad_op,no_shard
//   --in-place  also units made by fsdp::fully_shard (mode in_place_<strategy>)
//
// A step is zero_grad + forward + sum + backward + SGD step (lr 0.01), the
// same for the local model (the identical network, no FSDP, run in the same
// process) and for each FSDP strategy. overhead_us_per_unit is
// (median FSDP step - median local step) / units; fwd_bwd_overhead_us_per_unit
// is the same for forward + backward alone (the optimizer steps 64 flat
// shards under FSDP but 128 tensors locally, which favours FSDP slightly).
// Configurations are interleaved in rounds so that drift of the machine hits
// them alike. Rank 0 prints one JSON line per configuration and a summary.

#include <ATen/Parallel.h>
#include <dlfcn.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include <fsdp/fsdp.h>

#include "bench_cli.h"
#include "bench_util.h"
#include "overhead_net.h"

namespace {

using bench::Clock;
using bench::max_over_ranks;
using bench::median;
using bench::strategy_names;
using bench::us_since;

using bench::Net;
using bench::NetImpl;

struct Config {
  std::string mode;
  std::function<at::Tensor(const at::Tensor&)> forward;
  std::unique_ptr<torch::optim::SGD> opt;
  std::vector<double> step_us, fwd_bwd_us;
};

}  // namespace

int main(int argc, char** argv) {
  int64_t units = 64, width = 32, batch = 4;
  int warmup = 20, rounds = 5, steps = 40;
  std::vector<std::string> modes = {"full_shard", "shard_grad_op", "no_shard"};
  bench::CommandLine cli("Per-unit FSDP overhead above plain LibTorch (64 small units)");
  cli.option("--units", &units).positive();
  cli.option("--width", &width).positive();
  cli.option("--batch", &batch).positive();
  cli.option("--warmup", &warmup).non_negative();
  cli.option("--rounds", &rounds).positive();
  cli.option("--steps", &steps).positive();
  cli.option("--modes", &modes, "strategies to measure").one_of(bench::strategy_keys());
  bool in_place = false;
  cli.flag("--in-place", &in_place,
           "also measure each strategy with units made by fsdp::fully_shard "
           "(mode in_place_<strategy>), interleaved with the wrappers");
  cli.parse(argc, argv);

  bench::setup_process();
  auto pg = fsdp::init_process_group();
  const int rank = pg->rank(), world = pg->size();

  std::vector<Config> configs;
  std::vector<std::shared_ptr<torch::nn::Module>> keep_alive;
  {
    torch::manual_seed(0);
    Net net(units, width, std::nullopt);
    keep_alive.push_back(net.ptr());
    Config c;
    c.mode = "local";
    c.forward = [net](const at::Tensor& x) mutable { return net->forward(x); };
    c.opt = std::make_unique<torch::optim::SGD>(net->parameters(), torch::optim::SGDOptions(0.01));
    configs.push_back(std::move(c));
  }
  for (const std::string& mode : modes) {
    const fsdp::ShardingStrategy strategy = strategy_names().at(mode);
    torch::manual_seed(0);
    const auto opts = fsdp::FSDPOptions().sharding_strategy(strategy);
    fsdp::FullyShardedDataParallel<NetImpl> root(std::make_shared<NetImpl>(units, width, opts),
                                                 opts);
    keep_alive.push_back(root.ptr());
    Config c;
    c.mode = mode;
    c.forward = [root](const at::Tensor& x) mutable { return root->forward(x); };
    c.opt = std::make_unique<torch::optim::SGD>(root->parameters(), torch::optim::SGDOptions(0.01));
    configs.push_back(std::move(c));
    if (!in_place) continue;
    // The plain network, its layers made units in place.
    torch::manual_seed(0);
    Net net(units, width, std::nullopt);
    keep_alive.push_back(net.ptr());
    fsdp::Unit& unit = fsdp::fully_shard(net, fsdp::module_type_policy<bench::LayerImpl>(), opts);
    Config p;
    p.mode = "in_place_" + mode;
    p.forward = [net](const at::Tensor& x) mutable { return net->forward(x); };
    p.opt =
        std::make_unique<torch::optim::SGD>(unit.flat_parameters(), torch::optim::SGDOptions(0.01));
    configs.push_back(std::move(p));
  }

  torch::manual_seed(1000 + rank);
  const at::Tensor x = torch::randn({batch, width});
  auto run_step = [&](Config& c, bool record) {
    const auto t0 = Clock::now();
    c.opt->zero_grad();
    const auto t1 = Clock::now();
    c.forward(x).sum().backward();
    const double fb = us_since(t1);
    c.opt->step();
    const double total = us_since(t0);
    if (record) {
      c.step_us.push_back(total);
      c.fwd_bwd_us.push_back(fb);
    }
  };
  for (auto& c : configs) {
    for (int i = 0; i < warmup; ++i) run_step(c, false);
  }
  for (int r = 0; r < rounds; ++r) {
    for (auto& c : configs) {
      pg->barrier().wait();  // ranks start each block of steps together
      for (int i = 0; i < steps; ++i) run_step(c, true);
    }
  }

  const double local_step = max_over_ranks(*pg, median(configs[0].step_us));
  const double local_fb = max_over_ranks(*pg, median(configs[0].fwd_bwd_us));
  std::ostringstream summary;
  double wrapper_per_unit = 0;
  for (auto& c : configs) {
    const double step = max_over_ranks(*pg, median(c.step_us));
    const double fb = max_over_ranks(*pg, median(c.fwd_bwd_us));
    const double per_unit = (step - local_step) / static_cast<double>(units);
    const double fb_per_unit = (fb - local_fb) / static_cast<double>(units);
    if (rank == 0) {
      std::printf(
          "{\"bench\":\"overhead\",\"mode\":\"%s\",\"world\":%d,\"units\":%lld,\"width\":%lld,"
          "\"batch\":%lld,\"step\":\"zero_grad+forward+backward+sgd\",\"samples\":%zu,"
          "\"median_step_us\":%.1f,\"median_fwd_bwd_us\":%.1f,\"overhead_us_per_unit\":%.2f,"
          "\"fwd_bwd_overhead_us_per_unit\":%.2f,\"malloc\":\"%s\"}\n",
          c.mode.c_str(), world, static_cast<long long>(units), static_cast<long long>(width),
          static_cast<long long>(batch), c.step_us.size(), step, fb, per_unit, fb_per_unit,
          bench::malloc_mode());
      if (c.mode != "local") {
        char buf[128];
        std::snprintf(buf, sizeof(buf), ",\"%s_us_per_unit\":%.2f", c.mode.c_str(), per_unit);
        summary << buf;
      }
      const bool in_place_row = c.mode.rfind("in_place_", 0) == 0;
      if (c.mode != "local" && !in_place_row) {
        wrapper_per_unit = per_unit;  // a wrapper's row comes just before its in-place row
      }
      if (in_place_row && wrapper_per_unit > 0) {
        // Issue 21's bound: at most 1.5x the wrapper's per-unit overhead.
        char buf[128];
        std::snprintf(buf, sizeof(buf), ",\"%s_over_wrapper\":%.3f", c.mode.c_str(),
                      per_unit / wrapper_per_unit);
        summary << buf;
      }
    }
  }
  if (rank == 0) {
    // The bounds: 25 us per unit per step at world size 1, 400 us at 2.
    const double target = world == 1 ? 25.0 : 400.0;
    std::printf("{\"bench\":\"overhead_summary\",\"world\":%d,\"target_us_per_unit\":%.0f%s}\n",
                world, target, summary.str().c_str());
    std::fflush(stdout);
  }
  pg->barrier().wait();
  return 0;
}
