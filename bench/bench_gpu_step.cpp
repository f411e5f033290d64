// GPU training-step benchmark (issue 34, item 8; bench/gpu_step.sh runs it
// beside PyTorch): GPT-mini (examples/models/gpt_mini.h) at GPT-2 small's
// sizes by default, AdamW, each block an FSDP unit, on this rank's GPU:
//   build/bin/bench_gpu_step --mode local                  # plain LibTorch
//   build/bin/bench_gpu_step --mode full_shard             # libfsdp, world 1
//   build/bin/fsdprun --nproc-per-node 2 build/bin/bench_gpu_step --mode full_shard
// Modes: local | full_shard | shard_grad_op | no_shard. --precision bf16 (the
// default) computes in bfloat16: autocast for local, MixedPrecision(param_dtype
// bf16) with fp32 shards and a bf16 reduction for libfsdp. --device cpu runs the
// same on the CPU (a smoke test where no GPU is visible).
// Each timed step is bracketed by a device synchronisation and a barrier, so
// step_ms is the slowest rank's wall time of a whole step.
// Figures (rank 0 prints one JSON line; memory per rank, the largest rank's):
// - median_ms: the slowest rank's median step; tokens_per_s: the job's tokens
//   (world x batch x seq) per median step.
// - mfu: model FLOPs per token (6 x parameters + 12 x layers x d_model x seq,
//   forward and backward with attention, as PaLM's appendix counts them) x
//   tokens_per_s / (world x --peak-tflops), 989 for an H100 SXM's dense bf16.
// - peak_device_bytes: the CUDA caching allocator's peak of allocated bytes
//   over the timed steps (0 on the CPU), peak_reserved_bytes its peak of
//   memory taken from the driver (each stream's blocks are its own: the side
//   streams can raise it, Note [Copy-in on a stream of its own]); peak_host_rss_bytes: the largest
//   rank's peak resident memory (getrusage); state_bytes: parameters + gradients +
//   AdamW state from the tensors after the last step (shards under FSDP).
// --offload after|during (issue 35, item 3): CPU offload, the fp32 shards,
// gradients and AdamW state in pinned host memory, stepped by
// fsdp::optim::FusedAdamW after backward or unit by unit beside it
// (step_during_backward), which also writes the bf16 copies each unshard
// sends to the GPU (write_compute_copies); --offload-root 0 keeps the root
// unit (GPT-mini's token embedding, whose gradient backward makes last) on
// the GPU, stepped there; --keep-low-precision-grads 1 keeps the reduced
// gradients in bf16 (half the bytes over PCIe; the fused step reads them as
// floats). Then, in the same run after the
// timed steps, the three parts alone: fwd_bwd_ms (forward and backward, the step left out;
// with --offload during the units stepped beside it still compete for the
// host: bench/gpu_step.sh takes the parts from --offload after),
// host_optim_ms (FusedAdamW's step over the shards, --offload-root 0's on the
// GPU) and copy_ms (every
// shard to the GPU in the compute dtype and every gradient back, as the step
// copies them); bound_ms is the largest of the three. With --offload during,
// per timed step, where the optimizer's thread beside backward spent its time
// (fsdp::detail::BackwardStepTimes): listener_span_ms from the first unit
// handed over to the last one stepped, of which listener_complete_ms waiting
// for reductions and whole copies, listener_arrive_ms for parts to land and
// listener_step_ms stepping; step_wait_ms is how long the end of backward
// waited for it (before 2026-11-29: step(), once backward had returned; the
// same wait). --trace 1: the last timed step's timeline
// (trace_ms), in ms from its start: when forward, backward and step()
// returned on the host (*_cpu) and when the GPU had run what each had queued
// (*_gpu), and per unit handed over [elements, handed, completed, landed,
// stepped] (fsdp::detail::BackwardStepEvent).

#include <torch/torch.h>
#include <torch/version.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <fsdp/fsdp.h>

#include "bench_cli.h"
#include "bench_util.h"

#include "detail/torch_compat.h"
#include "gpt_step.h"
#include "optim/backward_steps.h"

#if FSDP_WITH_CUDA
#include <ATen/autocast_mode.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAFunctions.h>
#endif

namespace {

using bench::Clock;
using bench::max_over_ranks;
using bench::median;
using bench::ms_since;
using bench::optimizer_state_bytes;

struct Args {
  std::string mode = "full_shard";
  std::string device = "auto";
  std::string precision = "bf16";
  std::string offload = "none";
  bool activation_checkpointing = false;
  bool parts = true;
  bool head_unit = false;
  bool offload_root = true;
  bool keep_low_precision_grads = false;
  bool trace = false;
  int steps = 10;
  int warmup = 3;
  int64_t blocks = 12;
  int64_t d_model = 768;
  int64_t heads = 12;
  int64_t seq = 1024;
  int64_t batch = 8;
  int64_t vocab = 50304;
  double peak_tflops = 989.0;
};

Args parse(int argc, char** argv) {
  Args a;
  bench::CommandLine cli("GPT training step on a GPU: plain LibTorch or libfsdp");
  cli.option("--mode", &a.mode).one_of({"local", "full_shard", "shard_grad_op", "no_shard"});
  cli.option("--device", &a.device).one_of({"auto", "cpu", "cuda"});
  cli.option("--precision", &a.precision).one_of({"fp32", "bf16"});
  cli.option("--offload", &a.offload,
             "CPU offload, the host optimizer stepping after backward "
             "or beside it")
      .one_of({"none", "after", "during"});
  cli.option("--activation-checkpointing", &a.activation_checkpointing,
             "0|1: recompute each block's activations in backward");
  cli.option("--offload-root", &a.offload_root,
             "0|1: with --offload, the root unit (the token embedding) offloaded too, or kept "
             "on the GPU with its optimizer state (FSDP2's offload_policy per unit)");
  cli.option("--keep-low-precision-grads", &a.keep_low_precision_grads,
             "0|1: with bf16, MixedPrecision::keep_low_precision_grads: gradients stay bf16, "
             "half the bytes to host memory under offload, read as floats by the fused step");
  cli.option("--head-unit", &a.head_unit,
             "0|1: libfsdp's output head as a unit of its own (GPTConfig::head_unit)");
  cli.option("--parts", &a.parts,
             "0|1: with --offload, also time its parts alone (forward+backward, host "
             "optimizer, copies) after the timed steps");
  cli.option("--trace", &a.trace,
             "0|1: print the last timed step's timeline (trace_ms) with --offload during");
  bench::add_gpt_step_options(cli, a);
  cli.option("--peak-tflops", &a.peak_tflops, "the device's dense peak, for MFU");
  cli.parse(argc, argv);
  if (a.offload != "none" && a.mode == "local") {
    std::fprintf(stderr,
                 "bench_gpu_step: --offload is libfsdp's CPU offload; use it with "
                 "--mode full_shard, shard_grad_op or no_shard, not local\n");
    std::exit(2);
  }
  return a;
}

// This rank's device: LOCAL_RANK's GPU for cuda (and auto where one is seen).
torch::Device pick_device(const std::string& choice) {
  if (choice == "cpu" || (choice == "auto" && !at::hasCUDA())) return torch::kCPU;
  const std::optional<torch::Device> gpu = fsdp::local_gpu();
  if (!gpu) {
    std::fprintf(stderr, "bench_gpu_step: --device cuda, but this process sees no GPU\n");
    std::exit(2);
  }
  return *gpu;
}

void synchronize(const torch::Device& device) {
  if (device.is_cuda()) torch::cuda::synchronize(device.index());
}

// Milliseconds of `fn`, the device synchronised before and after; the
// median of `rounds`.
double timed_ms(const torch::Device& device, int rounds, const std::function<void()>& fn) {
  std::vector<double> ms;
  for (int i = 0; i < rounds; ++i) {
    synchronize(device);
    const auto t0 = Clock::now();
    fn();
    synchronize(device);
    ms.push_back(ms_since(t0));
  }
  return median(ms);
}

// The PCIe traffic of an offloaded step alone: each host shard to the device
// in `dtype`, each (fp32) gradient back into pinned host memory.
std::function<void()> offload_copies(std::vector<at::Tensor> shards, const torch::Device& device,
                                     at::ScalarType dtype) {
  shards.erase(
      std::remove_if(shards.begin(), shards.end(), [](const at::Tensor& s) { return !s.is_cpu(); }),
      shards.end());  // --offload-root 0: the root's stays on the GPU
  std::vector<at::Tensor> grads_on_device, grads_on_host;
  for (const auto& s : shards) {
    grads_on_device.push_back(at::empty({s.numel()}, s.options().device(device)));
    grads_on_host.push_back(at::empty({s.numel()}, s.options().pinned_memory(device.is_cuda())));
  }
  return [=] {
    for (size_t i = 0; i < shards.size(); ++i) {
      (void)shards[i].to(device, dtype, /*non_blocking=*/true);
      grads_on_host[i].copy_(grads_on_device[i], /*non_blocking=*/true);
    }
  };
}

// Plain LibTorch's bfloat16 compute on a GPU: autocast, as PyTorch users run it.
void set_autocast(const torch::Device& device, bool on) {
#if FSDP_WITH_CUDA
  if (!device.is_cuda()) return;
  at::autocast::set_autocast_enabled(at::kCUDA, on);
  at::autocast::set_autocast_dtype(at::kCUDA, at::kBFloat16);
#endif
}

// One step's timeline (--trace), in ms from its start: when forward,
// backward and step() returned on the host, when the GPU had run what
// forward and backward queued (events, where there is a GPU), and each unit's
// path through the optimizer's thread beside backward
// (fsdp::detail::BackwardStepEvent: elements, handed, completed, landed,
// stepped), as one JSON object.
class StepTimeline {
 public:
  explicit StepTimeline(const torch::Device& device) : device_(device) {}

  void start() {
    t0_ = Clock::now();
    marks_.clear();
#if FSDP_WITH_CUDA
    gpu_.clear();
    if (device_.is_cuda()) record_gpu();
#endif
  }
  /// The host reached `name`; where there is a GPU, also when it runs what was queued before.
  void mark(const char* name) {
    marks_.emplace_back(name, ms_since(t0_));
#if FSDP_WITH_CUDA
    if (device_.is_cuda()) record_gpu();
#endif
  }
  std::string json(const std::vector<fsdp::detail::BackwardStepEvent>& events) {
    std::string out = "{";
    for (size_t i = 0; i < marks_.size(); ++i) {
      out += "\"" + marks_[i].first + "_cpu\":" + fixed(marks_[i].second) + ",";
#if FSDP_WITH_CUDA
      if (device_.is_cuda()) {
        gpu_[i + 1]->synchronize();
        out +=
            "\"" + marks_[i].first + "_gpu\":" + fixed(gpu_[0]->elapsed_time(*gpu_[i + 1])) + ",";
      }
#endif
    }
    out += "\"units\":[";
    for (size_t i = 0; i < events.size(); ++i) {
      const auto& e = events[i];
      out += std::string(i ? "," : "") + "[" + std::to_string(e.elements);
      for (const auto& t : {e.handed, e.completed, e.landed, e.stepped}) {
        out += "," + fixed(std::chrono::duration<double, std::milli>(t - t0_).count());
      }
      out += "]";
    }
    return out + "]}";
  }

 private:
  static std::string fixed(double ms) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.2f", ms);
    return buf;
  }
#if FSDP_WITH_CUDA
  void record_gpu() {
    gpu_.push_back(std::make_unique<at::cuda::CUDAEvent>(cudaEventDefault));
    gpu_.back()->record();
  }
  std::vector<std::unique_ptr<at::cuda::CUDAEvent>> gpu_;
#endif
  torch::Device device_;
  Clock::time_point t0_;
  std::vector<std::pair<std::string, double>> marks_;
};

}  // namespace

int main(int argc, char** argv) try {
  const Args args = parse(argc, argv);
  auto pg = fsdp::init_process_group();
  const int rank = pg->rank(), world = pg->size();
  const torch::Device device = pick_device(args.device);
#if FSDP_WITH_CUDA
  if (device.is_cuda()) c10::cuda::set_device(device.index());
#endif
  const bool bf16 = args.precision == "bf16";

  const auto config = bench::gpt_config(args)
                          .activation_checkpointing(args.activation_checkpointing)
                          .head_unit(args.head_unit);
  torch::manual_seed(0);
  bench::GptUnderTest model;
  if (args.mode == "local") {
    model.plain(config, device);
  } else {
    auto opts = fsdp::FSDPOptions()
                    .sharding_strategy(bench::strategy_names().at(args.mode))
                    .device_id(device);
    if (bf16) {
      opts.mixed_precision(fsdp::MixedPrecision()
                               .param_dtype(at::kBFloat16)
                               .keep_low_precision_grads(args.keep_low_precision_grads));
    }
    const fsdp::FSDPOptions root_opts = opts;  // the root's offload: --offload-root
    if (args.offload != "none") opts.cpu_offload(fsdp::CPUOffload().offload_params(true));
    model.wrapped(config, opts, args.offload_root ? opts : root_opts);
  }
  const std::vector<at::Tensor>& params = model.params;
  const auto& sharded = model.sharded;
  const auto forward = [&model](const at::Tensor& x) { return model.forward(x); };
  // With offload the shards are host memory: libfsdp's fused host AdamW.
  std::unique_ptr<torch::optim::AdamW> owned_opt;
  fsdp::optim::FusedAdamW* host_opt = nullptr;
  if (args.offload == "none") {
    owned_opt = std::make_unique<torch::optim::AdamW>(params, torch::optim::AdamWOptions(3e-4));
  } else {
    auto fused =
        std::make_unique<fsdp::optim::FusedAdamW>(params, torch::optim::AdamWOptions(3e-4));
    host_opt = fused.get();
    if (args.offload == "during") host_opt->step_during_backward(*sharded.ptr());
    host_opt->write_compute_copies(*sharded.ptr());  // bf16: half the bytes to the GPU
    owned_opt = std::move(fused);
  }
  torch::optim::AdamW& opt = *owned_opt;
  // A model too large fails here, with the bytes, not deep in backward
  // (bench/largest_gpu_model.sh reads the message).
  if (sharded) fsdp::check_memory(*sharded.ptr(), &opt);
  int64_t total_params = 0;
  for (const auto& p : params) total_params += p.numel();
  if (args.mode == "full_shard" || args.mode == "shard_grad_op") total_params *= world;

  const bench::TokenBatch batch = bench::rank_batch(args, rank, device);
  const at::Tensor& inputs = batch.inputs;
  const at::Tensor& targets = batch.targets;

  std::vector<double> step_ms;
  double loss0 = 0;
  StepTimeline timeline(device);
  std::string trace = "null";
  for (int i = -args.warmup; i < args.steps; ++i) {
    if (i == 0 && device.is_cuda()) fsdp::compat::reset_cuda_peak(device.index());
    if (i == 0) (void)fsdp::detail::take_backward_step_times();  // the timed steps' only
    const bool traced = args.trace && i == args.steps - 1;
    fsdp::detail::record_backward_step_events(traced);
    synchronize(device);
    pg->barrier().wait();
    const auto t0 = Clock::now();
    timeline.start();
    opt.zero_grad();
    set_autocast(device, bf16 && args.mode == "local");
    at::Tensor logits = forward(inputs);
    set_autocast(device, false);
    at::Tensor loss = gpt_mini::lm_loss(logits.to(at::kFloat), targets);
    if (traced) timeline.mark("forward");
    loss.backward();
    if (traced) timeline.mark("backward");
    opt.step();
    if (traced) timeline.mark("step");
    synchronize(device);
    if (traced) trace = timeline.json(fsdp::detail::take_backward_step_events());
    if (i >= 0) step_ms.push_back(ms_since(t0));
    if (i == -args.warmup) loss0 = loss.item<double>();
  }
  // Per timed step, where the host optimizer's thread spent its time
  // beside backward (--offload during): a span longer than its complete,
  // arrive and step times together means it waited for gradients.
  fsdp::detail::BackwardStepTimes listener = fsdp::detail::take_backward_step_times();
  for (double* ms : {&listener.span_ms, &listener.complete_ms, &listener.arrive_ms,
                     &listener.step_ms, &listener.step_wait_ms}) {
    *ms /= std::max(1, args.steps);
  }
  const fsdp::compat::CudaMemory device_memory =
      device.is_cuda() ? fsdp::compat::cuda_memory(device.index()) : fsdp::compat::CudaMemory{};
  const int64_t peak = device_memory.peak_allocated;
  // The three parts of an offloaded step alone (after the timed steps, so
  // they change neither its memory peak nor its times).
  double fwd_bwd_ms = 0, host_optim_ms = 0, copy_ms = 0;
  if (host_opt != nullptr && args.parts) {
    const int rounds = std::max(3, args.steps / 2);
    std::vector<double> ms;
    for (int i = 0; i < rounds; ++i) {
      synchronize(device);
      const auto t0 = Clock::now();
      opt.zero_grad();
      gpt_mini::lm_loss(forward(inputs).to(at::kFloat), targets).backward();
      synchronize(device);
      ms.push_back(ms_since(t0));
      opt.step();  // untimed: each backward is followed by its step
    }
    fwd_bwd_ms = median(ms);
    host_optim_ms = timed_ms(device, rounds, [&] { host_opt->step(); });
    copy_ms =
        timed_ms(device, rounds, offload_copies(params, device, bf16 ? at::kBFloat16 : at::kFloat));
  }

  const double med = max_over_ranks(*pg, median(step_ms));
  const double tokens_per_s = static_cast<double>(world * args.batch * args.seq) / (med / 1e3);
  const double flops_per_token = 6.0 * static_cast<double>(total_params) +
                                 12.0 * static_cast<double>(args.blocks * args.d_model * args.seq);
  const double mfu = flops_per_token * tokens_per_s / (world * args.peak_tflops * 1e12);
  const auto peak_max = bench::max_bytes_over_ranks(*pg, peak);
  const auto reserved_max = bench::max_bytes_over_ranks(*pg, device_memory.peak_reserved);
  const auto state_max = bench::max_bytes_over_ranks(*pg, optimizer_state_bytes(opt));
  const auto rss_max = bench::max_bytes_over_ranks(*pg, fsdp::memory_stats().peak_resident_bytes);
  if (rank == 0) {
    std::printf(
        "{\"bench\":\"gpu_step\",\"impl\":\"libtorch\",\"mode\":\"%s\",\"world\":%d,"
        "\"device\":\"%s\",\"collectives\":\"%s\",\"precision\":\"%s\",\"blocks\":%lld,"
        "\"d_model\":%lld,\"seq\":%lld,\"batch\":%lld,\"vocab\":%lld,\"params\":%lld,"
        "\"steps\":%d,\"warmup\":%d,\"median_ms\":%.2f,\"tokens_per_s\":%.0f,\"mfu\":%.4f,"
        "\"peak_device_bytes\":%lld,\"state_bytes\":%lld,\"loss0\":%.6f,\"torch\":\"%s\","
        "\"offload\":\"%s\",\"fwd_bwd_ms\":%.2f,\"host_optim_ms\":%.2f,\"copy_ms\":%.2f,"
        "\"bound_ms\":%.2f,\"activation_checkpointing\":%s,\"peak_host_rss_bytes\":%lld,"
        "\"peak_reserved_bytes\":%lld,\"threads\":%d,\"listener_span_ms\":%.2f,"
        "\"listener_complete_ms\":%.2f,\"listener_arrive_ms\":%.2f,\"listener_step_ms\":%.2f,"
        "\"step_wait_ms\":%.2f,\"keep_low_precision_grads\":%s,\"trace_ms\":%s}\n",
        args.mode.c_str(), world, device.str().c_str(), fsdp::rank_info().cuda_backend.c_str(),
        args.precision.c_str(), static_cast<long long>(args.blocks),
        static_cast<long long>(args.d_model), static_cast<long long>(args.seq),
        static_cast<long long>(args.batch), static_cast<long long>(args.vocab),
        static_cast<long long>(total_params), args.steps, args.warmup, med, tokens_per_s, mfu,
        static_cast<long long>(peak_max), static_cast<long long>(state_max), loss0, TORCH_VERSION,
        args.offload.c_str(), fwd_bwd_ms, host_optim_ms, copy_ms,
        std::max({fwd_bwd_ms, host_optim_ms, copy_ms}),
        args.activation_checkpointing ? "true" : "false", static_cast<long long>(rss_max),
        static_cast<long long>(reserved_max), at::get_num_threads(), listener.span_ms,
        listener.complete_ms, listener.arrive_ms, listener.step_ms, listener.step_wait_ms,
        args.keep_low_precision_grads ? "true" : "false", trace.c_str());
    std::fflush(stdout);
  }
  pg->barrier().wait();
  return 0;
} catch (
    const std::exception& e) {  // one line on every rank (a rung that does not fit, a bad option)
  std::fprintf(stderr, "bench_gpu_step: %s\n", fsdp::error_message(e).c_str());
  return 1;
}
