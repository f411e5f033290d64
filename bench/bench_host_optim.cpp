// Host optimizer benchmark (issue 35, "A host optimizer that keeps up"):
// fsdp::optim::FusedAdamW and FusedSGD against torch::optim::AdamW and SGD on
// the same flat float32 shards and the same intra-op threads, and against a
// copy of the bytes the step must move (Note [Fused host optimizers]):
//   build/bin/bench_host_optim                      # 64 Mi elements in 8 shards
// Options: --elements 67108864 --shards 8 --rounds 7 --threads 0 (LibTorch's)
//
// Each round steps every configuration once, interleaved (torch, fused, copy)
// so that drift of the machine hits them alike, after two warm-up steps that
// create the optimizer state. bytes_moved counts what the step must read and
// write once (AdamW: value, gradient and both moments read, value and moments
// written: 28 bytes an element; 30 with the bfloat16 copy for a GPU, 28
// again with the gradient in bfloat16; SGD with momentum: 20); copy_gbps is a
// multi-threaded copy of as many bytes (read + write). One JSON line per
// optimizer: median step times, speedup = torch / fused, and
// bandwidth_fraction = (bytes_moved / fused step) / copy bandwidth, and the
// process's resident memory above its level before the step at the step's
// peak (VmHWM reset before each step; median over the rounds): what a step
// allocates besides the parameters and their state. A last line gives the
// fused step with bfloat16 gradients over the one with float32 gradients.

#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <fsdp/optim/fused.h>

#include "bench_cli.h"
#include "bench_util.h"
#include "resident_memory.h"

namespace {

using bench::Clock;
using bench::median;
using bench::ms_since;

std::vector<torch::Tensor> shards(int64_t elements, int count, uint64_t seed) {
  torch::manual_seed(seed);
  std::vector<torch::Tensor> out;
  for (int i = 0; i < count; ++i) {
    auto p = torch::randn({elements / count}).requires_grad_();
    p.mutable_grad() = torch::randn({elements / count}) * 1e-3;
    out.push_back(p);
  }
  return out;
}

struct Run {
  Run(std::string name, int64_t bytes, std::unique_ptr<torch::optim::Optimizer> reference,
      std::unique_ptr<torch::optim::Optimizer> fused)
      : optimizer(std::move(name)),
        bytes_per_element(bytes),
        torch_opt(std::move(reference)),
        fused_opt(std::move(fused)) {}
  std::string optimizer;
  int64_t bytes_per_element;
  std::unique_ptr<torch::optim::Optimizer> torch_opt, fused_opt;
  std::function<void()> after_torch_step = [] {};  // what the torch side does besides
  std::vector<double> torch_ms, fused_ms, copy_ms;
  std::vector<double> torch_peak_extra, fused_peak_extra;
};

// Runs `step` and returns its time; `peak_extra` gets the resident bytes at
// its peak above those before it.
double measured_step(const std::function<void()>& step, std::vector<double>& peak_extra) {
  fsdp::testing::reset_peak_rss();
  const int64_t before = fsdp::testing::rss_now();
  const auto t0 = Clock::now();
  step();
  const double ms = ms_since(t0);
  peak_extra.push_back(static_cast<double>(fsdp::testing::peak_rss_bytes() - before));
  return ms;
}

}  // namespace

int main(int argc, char** argv) {
  bench::CommandLine cli("fsdp::optim fused host optimizers against torch::optim");
  int64_t elements = int64_t{64} << 20;
  int count = 8, rounds = 7, threads = 0;
  cli.option("--elements", &elements, "float32 elements in all shards together");
  cli.option("--shards", &count, "parameters the elements are split into");
  cli.option("--rounds", &rounds, "timed rounds");
  cli.option("--threads", &threads, "intra-op threads (0: LibTorch's default)");
  cli.parse(argc, argv);
  if (threads > 0) at::set_num_threads(threads);
  torch::NoGradGuard no_grad;

  auto torch_params = shards(elements, count, 1), fused_params = shards(elements, count, 1);
  std::vector<Run> runs;
  runs.emplace_back("adamw", 28, std::make_unique<torch::optim::AdamW>(torch_params),
                    std::make_unique<fsdp::optim::FusedAdamW>(fused_params));
  // With the bfloat16 copy a GPU computes with under CPU offload: written in
  // the fused pass, and by Tensor::copy_ after LibTorch's step. Then the
  // same with the gradients kept in bfloat16 (keep_low_precision_grads: what
  // a GPU sends under offload with a bf16 reduce dtype), 2 bytes an element
  // fewer to read.
  auto copied_params = shards(elements, count, 1);
  auto low_grad_torch = shards(elements, count, 1), low_grad_fused = shards(elements, count, 1);
  for (auto* set : {&low_grad_torch, &low_grad_fused}) {
    for (auto& p : *set) p.mutable_grad() = p.grad().to(torch::kBFloat16);
  }
  std::vector<torch::Tensor> torch_low, fused_low, low_grad_torch_low, low_grad_fused_low;
  // `params`' FusedAdamW writing bfloat16 copies into `copies`, and
  // LibTorch's AdamW on `reference` followed by its copies' copy_.
  auto add_copy_run = [&](const char* name, int64_t bytes, std::vector<torch::Tensor>& reference,
                          std::vector<torch::Tensor>& reference_copies,
                          std::vector<torch::Tensor>& params, std::vector<torch::Tensor>& copies) {
    auto fused = std::make_unique<fsdp::optim::FusedAdamW>(params);
    for (size_t i = 0; i < params.size(); ++i) {
      reference_copies.push_back(torch::empty_like(reference[i], torch::kBFloat16));
      copies.push_back(torch::empty_like(params[i], torch::kBFloat16));
      fused->set_low_precision_copy(params[i], copies.back());
    }
    runs.emplace_back(name, bytes, std::make_unique<torch::optim::AdamW>(reference),
                      std::move(fused));
    runs.back().after_torch_step = [&reference, &reference_copies] {
      for (size_t i = 0; i < reference.size(); ++i) reference_copies[i].copy_(reference[i]);
    };
  };
  add_copy_run("adamw_bf16_copy", 30, torch_params, torch_low, copied_params, fused_low);
  add_copy_run("adamw_bf16_copy_bf16_grads", 28, low_grad_torch, low_grad_torch_low, low_grad_fused,
               low_grad_fused_low);
  const auto sgd = torch::optim::SGDOptions(1e-3).momentum(0.9);
  runs.emplace_back("sgd_momentum", 20, std::make_unique<torch::optim::SGD>(torch_params, sgd),
                    std::make_unique<fsdp::optim::FusedSGD>(fused_params, sgd));
  // The copy moves bytes_per_element / 2 bytes an element each way.
  auto src = torch::ones({elements * 15}, torch::kByte), dst = torch::empty_like(src);
  auto copy_src = [&](int64_t bytes) { return src.narrow(0, 0, bytes); };
  for (auto& run : runs) {
    for (int i = 0; i < 2; ++i) {
      run.torch_opt->step();
      run.fused_opt->step();
    }
  }
  for (int round = 0; round < rounds; ++round) {
    for (auto& run : runs) {
      run.torch_ms.push_back(measured_step(
          [&] {
            run.torch_opt->step();
            run.after_torch_step();
          },
          run.torch_peak_extra));
      run.fused_ms.push_back(measured_step([&] { run.fused_opt->step(); }, run.fused_peak_extra));
      const int64_t half = elements * run.bytes_per_element / 2;
      const auto t0 = Clock::now();
      dst.narrow(0, 0, half).copy_(copy_src(half));
      run.copy_ms.push_back(ms_since(t0));
    }
  }
  for (const auto& run : runs) {
    const double torch_ms = median(run.torch_ms), fused_ms = median(run.fused_ms);
    const double copy_ms = median(run.copy_ms);
    const double bytes = static_cast<double>(elements) * run.bytes_per_element;
    const double fused_gbps = bytes / fused_ms / 1e6, copy_gbps = bytes / copy_ms / 1e6;
    std::printf(
        "{\"bench\": \"host_optim\", \"optimizer\": \"%s\", \"elements\": %lld, \"shards\": %d, "
        "\"threads\": %d, \"rounds\": %d, \"torch_ms\": %.2f, \"fused_ms\": %.2f, "
        "\"speedup\": %.2f, \"bytes_moved\": %.0f, \"fused_gbps\": %.2f, \"copy_ms\": %.2f, "
        "\"copy_gbps\": %.2f, \"bandwidth_fraction\": %.2f, \"torch_step_peak_extra_mib\": "
        "%.1f, \"fused_step_peak_extra_mib\": %.1f}\n",
        run.optimizer.c_str(), static_cast<long long>(elements), count, at::get_num_threads(),
        rounds, torch_ms, fused_ms, torch_ms / fused_ms, bytes, fused_gbps, copy_ms, copy_gbps,
        fused_gbps / copy_gbps, median(run.torch_peak_extra) / (1 << 20),
        median(run.fused_peak_extra) / (1 << 20));
  }
  // The fused step with bfloat16 gradients against float32 ones, same run.
  std::printf("{\"bench\": \"host_optim_summary\", \"bf16_grads_over_fp32_grads\": %.3f}\n",
              median(runs[2].fused_ms) / median(runs[1].fused_ms));
  return 0;
}
