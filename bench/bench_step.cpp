// Training-step benchmark (issue: FSDP core, "Step"). GPT-mini (gpt_mini.h),
// AdamW, fp32, one intra-op thread per rank, each block an FSDP unit:
//   build/bin/bench_step --mode local                       # one process, no FSDP
//   build/bin/fsdprun --nproc-per-node 2 build/bin/bench_step --mode full_shard
// Modes: local | no_shard | shard_grad_op | full_shard. `local` under fsdprun
// runs one independent unsharded model per rank (no communication but the
// timing barriers): not data parallel, but it shows what running N processes
// side by side costs on the machine by itself (cores, memory bandwidth).
// Options:
//   --steps N (10) --warmup W (2) --blocks 8 --d-model 512 --heads 8 --seq 128
//   --batch 8 (per rank) --vocab 256 --forward-prefetch 0|1 (1)
//   --mixed-precision fp32|bf16 (fp32): bf16 sets MixedPrecision(param_dtype
//   bf16) on every unit (compute, all-gather and reduce-scatter in bf16,
//   fp32 shards for AdamW); the loss is computed on fp32 logits either way.
//   --activation-checkpointing 0|1 (0): recompute each block's activations in
//   backward (GPTConfig::activation_checkpointing).
//   --backward-prefetch none|backward_pre|backward_post (backward_pre).
//   --comm-only 0|1 (0): a sharded mode's collectives without the compute:
//   the last warm-up step records every collective the model issues (kind,
//   size, dtype) and each timed "step" issues the same sequence again on the
//   same engine and waits for it (bench/recording_process_group.h).
// cpu_ms_per_step: this rank's process CPU time (user + system, every thread)
// per timed step: beside median_ms it shows what communication costs the
// cores (with 2 cores and 2 ranks, a rank's TCP work competes with compute).
// net_tx_bytes_per_step: bytes this rank's network namespace sent per timed
// step on every interface but loopback (/proc/net/dev): what crosses the
// links between simulated nodes (bench/network_overlap.sh).
// median_ms is the larger of the ranks' median step times;
// slowest_rank_median_ms the median over steps of each step's slowest rank.
// Under FSDP the two agree (every step waits for the slowest rank); for
// `local` on N ranks the second adds what the ranks' drift alone would cost.
// Each sharded run also reports all_gather_bytes_per_step and
// reduce_scatter_bytes_per_step (per rank, the unsharded buffers' bytes),
// counted by a forwarding process group.
// Rank 0 prints one JSON line; bench/run_fsdp_benchmarks.sh runs every mode
// and computes the ratios to local.
//
// Memory figures (all per rank, the maximum over ranks):
// - peak_bytes: peak of libfsdp's tracked CPU allocations over the timed
//   steps (parameters, gradients, optimizer state, activations, buffers).
// - state_bytes: parameters + gradients + AdamW state, computed from the
//   tensors themselves after the last optimizer step (the optimizer's
//   parameters, i.e. the flat shards under FSDP, their .grad, exp_avg and
//   exp_avg_sq). This is what is resident between steps.
// - param_peak_bytes: peak tracked bytes of one extra step on a 1x1 token
//   input, measured with memory_stats. Activations are then a few KiB, so this
//   is the peak of parameters + gradients + optimizer state *during* a step,
//   including what FSDP holds only transiently (gathered blocks, unsharded
//   gradient buffers, reduce-scatter outputs, optimizer temporaries). With
//   next to no compute, backward outruns the reduce-scatters, so more
//   unsharded gradient buffers wait for the communication thread at once than
//   in a real step: an upper bound. run_fsdp_benchmarks.sh's main figure is
//   instead this run's peak_bytes minus local's activations (local's peak_bytes
//   minus its state_bytes), which holds the same per rank in every mode.

#include <ATen/Parallel.h>
#include <dlfcn.h>
#include <sys/resource.h>
#include <torch/torch.h>
#include <torch/version.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <fsdp/fsdp.h>

#include "bench_cli.h"
#include "bench_util.h"

#include "gpt_step.h"
#include "memory/cpu_allocator.h"
#include "recording_process_group.h"
#include "runtime/strategy.h"

namespace {

using bench::Clock;
using bench::max_over_ranks;
using bench::median;
using bench::ms_since;
using bench::optimizer_state_bytes;

struct Args {
  std::string mode = "full_shard";
  int steps = 10;
  int warmup = 2;
  int64_t blocks = 8;
  int64_t d_model = 512;
  int64_t heads = 8;
  int64_t seq = 128;
  int64_t batch = 8;
  int64_t vocab = 256;
  bool forward_prefetch = true;
  std::string precision = "fp32";
  bool activation_checkpointing = false;
  std::string backward_prefetch = "backward_pre";
  bool comm_only = false;
  bool in_place = false;  // the plain GPT's blocks made units by fsdp::fully_shard
  // Backwards per step (gradient accumulation), and how all but the last
  // skip communication: no_sync (set_requires_gradient_sync(false): nothing
  // reduced), within_node (set_requires_all_reduce(false): reduce-scattered
  // within the node, nothing across, the hybrid strategies), or sync (each
  // backward reduces everything, as a loop that sets nothing does).
  int micro_batches = 1;
  std::string accumulate = "no_sync";
};

const std::map<std::string, fsdp::BackwardPrefetch>& backward_prefetch_names() {
  static const std::map<std::string, fsdp::BackwardPrefetch> names = {
      {"none", fsdp::BackwardPrefetch::kNone},
      {"backward_pre", fsdp::BackwardPrefetch::kBackwardPre},
      {"backward_post", fsdp::BackwardPrefetch::kBackwardPost}};
  return names;
}

// This process's CPU time so far (user + system, all threads), in ms.
double cpu_ms() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return (u.ru_utime.tv_sec + u.ru_stime.tv_sec) * 1e3 +
         (u.ru_utime.tv_usec + u.ru_stime.tv_usec) / 1e3;
}

// Bytes sent on every interface but loopback of this network namespace.
int64_t net_tx_bytes() {
  std::FILE* f = std::fopen("/proc/net/dev", "r");
  if (f == nullptr) return 0;
  char line[512];
  int64_t total = 0;
  while (std::fgets(line, sizeof(line), f) != nullptr) {
    char name[64];
    long long v[16];
    // "  eth0: rx_bytes packets errs drop fifo frame compressed multicast tx_bytes ..."
    if (std::sscanf(line, " %63[^:]: %lld %lld %lld %lld %lld %lld %lld %lld %lld", name, &v[0],
                    &v[1], &v[2], &v[3], &v[4], &v[5], &v[6], &v[7], &v[8]) == 10 &&
        std::string(name) != "lo") {
      total += v[8];
    }
  }
  std::fclose(f);
  return total;
}

Args parse(int argc, char** argv) {
  Args a;
  bench::CommandLine cli("GPT-mini training step: local or FSDP, time and memory per rank");
  std::vector<std::string> modes = bench::strategy_keys();
  modes.insert(modes.begin(), "local");
  std::vector<std::string> prefetches;
  for (const auto& kv : backward_prefetch_names()) prefetches.push_back(kv.first);
  cli.option("--mode", &a.mode).one_of(modes);
  bench::add_gpt_step_options(cli, a);
  cli.option("--forward-prefetch", &a.forward_prefetch, "0 or 1");
  cli.option("--mixed-precision", &a.precision).one_of({"fp32", "bf16"});
  cli.option("--activation-checkpointing", &a.activation_checkpointing,
             "0 or 1: recompute each block's activations in backward");
  cli.option("--backward-prefetch", &a.backward_prefetch).one_of(prefetches);
  cli.option("--in-place", &a.in_place,
             "0 or 1: units made in place by fsdp::fully_shard on the plain GPT "
             "instead of wrappers (a sharded mode)");
  cli.option("--micro-batches", &a.micro_batches,
             "backwards per step (gradient accumulation; each on the rank's batch)")
      .positive();
  cli.option("--accumulate", &a.accumulate,
             "how all but the last micro-batch skip communication: no_sync (nothing reduced), "
             "within_node (hybrid modes: reduce-scattered within the node only), sync (none)")
      .one_of({"no_sync", "within_node", "sync"});
  cli.option("--comm-only", &a.comm_only,
             "0 or 1: time the step's collectives alone (a sharded mode, warmup >= 1)");
  cli.parse(argc, argv);
  if (a.in_place && a.mode == "local") {
    std::fprintf(stderr, "bench_step: --in-place 1 needs a sharded --mode\n");
    std::exit(2);
  }
  if (a.accumulate == "within_node" && a.micro_batches > 1 && a.mode.rfind("hybrid", 0) != 0) {
    std::fprintf(stderr, "bench_step: --accumulate within_node needs a hybrid --mode\n");
    std::exit(2);
  }
  if (a.comm_only && a.micro_batches > 1 && a.mode.rfind("hybrid", 0) == 0) {
    // The recording group sees the world's collectives, not the hybrid
    // subgroups' that accumulation changes.
    std::fprintf(stderr,
                 "bench_step: --comm-only replays nothing of a hybrid mode's "
                 "accumulation; leave --micro-batches at 1\n");
    std::exit(2);
  }
  if (a.comm_only && (a.mode == "local" || a.warmup < 1)) {
    std::fprintf(stderr, "bench_step: --comm-only needs a sharded --mode and --warmup >= 1\n");
    std::exit(2);
  }
  return a;
}

}  // namespace

int main(int argc, char** argv) {
  const Args args = parse(argc, argv);
  std::optional<fsdp::ShardingStrategy> strategy;
  if (args.mode != "local") strategy = bench::strategy_names().at(args.mode);

  // Before any tensor exists, so every storage of the model is counted.
  fsdp::enable_memory_tracking();
  bench::setup_process();
  auto pg = fsdp::init_process_group();
  const int rank = pg->rank(), world = pg->size();
  // Peaks are measured from here: what building and training the model adds.
  const int64_t rss_before_model = fsdp::memory_stats().resident_bytes;
  fsdp::reset_peak_memory_stats();
  int64_t run_peak = 0;  // the tracker's peak over the whole run, across resets

  const auto config =
      bench::gpt_config(args).activation_checkpointing(args.activation_checkpointing);

  // The model behind one forward function: plain GPT, or an FSDP root around
  // a GPT whose blocks are units (wrappers, or made in place).
  torch::manual_seed(0);
  bench::GptUnderTest model;
  std::shared_ptr<bench::RecordingProcessGroup> counting;
  if (strategy) {
    counting = std::make_shared<bench::RecordingProcessGroup>(pg);
    auto opts = fsdp::FSDPOptions()
                    .process_group(counting)
                    .sharding_strategy(*strategy)
                    .forward_prefetch(args.forward_prefetch)
                    .backward_prefetch(backward_prefetch_names().at(args.backward_prefetch));
    if (args.precision == "bf16") {
      opts.mixed_precision(fsdp::MixedPrecision().param_dtype(at::kBFloat16));
    }
    if (args.in_place) {
      model.in_place(config, opts);
    } else {
      model.wrapped(config, opts, opts);
    }
  } else {
    TORCH_CHECK(args.precision == "fp32",
                "bench_step: --mixed-precision bf16 needs a sharded mode");
    model.plain(config, torch::kCPU);
  }
  const std::vector<at::Tensor>& params = model.params;
  const auto forward = [&model](const at::Tensor& x) { return model.forward(x); };
  torch::optim::AdamW opt(params, torch::optim::AdamWOptions(3e-4));

  // Each rank its own batch; rank 0's equals the local run's, so loss0 (the
  // first step's loss on rank 0) must agree between every mode.
  const bench::TokenBatch batch = bench::rank_batch(args, rank, torch::kCPU);
  const at::Tensor& inputs = batch.inputs;
  const at::Tensor& targets = batch.targets;

  std::vector<double> step_ms, fwd_ms, bwd_ms, opt_ms;
  // The tracker's bytes as the last timed step starts and as its (last
  // micro-batch's) forward ends: what any sharding must hold there (the
  // shards, or the whole state for local, and the activations), for issue
  // 18's floor (memory_rss.sh).
  int64_t step_start_bytes = 0, forward_end_bytes = 0;
  double loss0 = 0;
  int64_t gathered0 = 0, reduced0 = 0, tx0 = 0;
  double cpu0 = 0;
  for (int i = -args.warmup; i < args.steps; ++i) {
    if (i == 0) {
      run_peak = std::max(run_peak, fsdp::memory_stats().peak_bytes);
      fsdp::reset_peak_memory_stats();
      if (counting) {
        gathered0 = counting->gathered_bytes;
        reduced0 = counting->reduced_bytes;
        if (args.comm_only) counting->prepare_replay();
      }
    }
    if (counting) counting->set_recording(i == -1);
    pg->barrier().wait();
    if (i == 0) {
      tx0 = net_tx_bytes();
      cpu0 = cpu_ms();
    }
    const auto t0 = Clock::now();
    if (args.comm_only && i >= 0) {
      counting->replay();
      step_ms.push_back(ms_since(t0));
      fwd_ms.push_back(0);
      bwd_ms.push_back(0);
      opt_ms.push_back(0);
      continue;
    }
    opt.zero_grad();
    if (i == args.steps - 1) step_start_bytes = fsdp::memory_stats().current_bytes;
    double f = 0, b = 0;
    at::Tensor loss;
    for (int m = 0; m < args.micro_batches; ++m) {
      const bool last = m == args.micro_batches - 1;
      if (model.root != nullptr && args.micro_batches > 1) {
        if (args.accumulate == "within_node") {
          model.root->set_requires_all_reduce(last);
        } else if (args.accumulate == "no_sync") {
          model.root->set_requires_gradient_sync(last);
        }
      }
      // The first forward's time counts from the step's start (zero_grad),
      // as it did before micro-batches.
      const auto tf = m == 0 ? t0 : Clock::now();
      loss = gpt_mini::lm_loss(forward(inputs).to(at::kFloat), targets);
      // At the last micro-batch: what accumulation holds (no_sync's full
      // gradients, or the sums kept within the node) on top.
      if (i == args.steps - 1 && last) forward_end_bytes = fsdp::memory_stats().current_bytes;
      f += ms_since(tf);
      const auto tb = Clock::now();
      loss.backward();
      b += ms_since(tb);
    }
    const auto t2 = Clock::now();
    opt.step();
    const double o = ms_since(t2);
    const double total = ms_since(t0);
    if (i == -args.warmup) loss0 = loss.item<double>();
    if (i >= 0) {
      step_ms.push_back(total);
      fwd_ms.push_back(f);
      bwd_ms.push_back(b);
      opt_ms.push_back(o);
    }
  }
  if (counting) counting->set_recording(false);
  pg->barrier().wait();
  const int64_t tx_per_step = (net_tx_bytes() - tx0) / args.steps;
  const double cpu_per_step = (cpu_ms() - cpu0) / args.steps;
  const int64_t peak = fsdp::memory_stats().peak_bytes;
  const int64_t state = optimizer_state_bytes(opt);
  const int64_t gathered_per_step =
      counting ? (counting->gathered_bytes - gathered0) / args.steps : 0;
  const int64_t reduced_per_step = counting ? (counting->reduced_bytes - reduced0) / args.steps : 0;

  // One step on a single token: activations vanish, parameter memory stays.
  at::Tensor tiny = inputs.slice(0, 0, 1).slice(1, 0, 1).contiguous();
  at::Tensor tiny_target = targets.slice(0, 0, 1).slice(1, 0, 1).contiguous();
  pg->barrier().wait();
  run_peak = std::max(run_peak, peak);
  fsdp::reset_peak_memory_stats();
  opt.zero_grad();
  gpt_mini::lm_loss(forward(tiny).to(at::kFloat), tiny_target).backward();
  opt.step();
  const int64_t param_peak = fsdp::memory_stats().peak_bytes;
  run_peak = std::max(run_peak, param_peak);
  // Issue 18's bound on what the process holds beyond what tensors need:
  // peak RSS growth <= 1.15 x the tracker's peak + 32 MiB (ratio <= 1).
  const int64_t rss_growth = fsdp::memory_stats().peak_resident_bytes - rss_before_model;
  const double rss_bound_ratio =
      static_cast<double>(rss_growth) / (1.15 * static_cast<double>(run_peak) + (32 << 20));

  int64_t total_params = 0;
  for (const auto& p : params) total_params += p.numel();
  // Shards of the whole job, or for the hybrid strategies of one node.
  if (strategy && fsdp::detail::is_hybrid(*strategy)) {
    total_params *= fsdp::rank_info().local_world_size;
  } else if (strategy && *strategy != fsdp::ShardingStrategy::kNoShard) {
    total_params *= world;
  }

  const double med = max_over_ranks(*pg, median(step_ms));
  // Each step's slowest rank: what a step of synchronous training costs when
  // the ranks' compute drifts apart (for `local` on N ranks, the host's part of
  // data parallelism, with no communication at all).
  at::Tensor slowest = torch::tensor(step_ms, torch::kDouble);
  pg->all_reduce(slowest, fsdp::ReduceOp::kMax).wait();
  const double med_synced = median(std::vector<double>(
      slowest.data_ptr<double>(), slowest.data_ptr<double>() + slowest.numel()));
  const double med_f = max_over_ranks(*pg, median(fwd_ms));
  const double med_b = max_over_ranks(*pg, median(bwd_ms));
  const double med_o = max_over_ranks(*pg, median(opt_ms));
  const auto peak_max = bench::max_bytes_over_ranks(*pg, peak);
  const auto state_max = bench::max_bytes_over_ranks(*pg, state);
  const auto param_peak_max = bench::max_bytes_over_ranks(*pg, param_peak);
  const auto run_peak_max = bench::max_bytes_over_ranks(*pg, run_peak);
  const auto step_start_max = bench::max_bytes_over_ranks(*pg, step_start_bytes);
  const auto forward_end_max = bench::max_bytes_over_ranks(*pg, forward_end_bytes);
  const auto rss_before_max = bench::max_bytes_over_ranks(*pg, rss_before_model);
  const auto peak_rss_max =
      bench::max_bytes_over_ranks(*pg, fsdp::memory_stats().peak_resident_bytes);
  const auto rss_growth_max = bench::max_bytes_over_ranks(*pg, rss_growth);
  const double rss_bound_ratio_max = max_over_ranks(*pg, rss_bound_ratio);
  const auto tx_max = bench::max_bytes_over_ranks(*pg, tx_per_step);
  const double cpu_max = max_over_ranks(*pg, cpu_per_step);
  const int64_t cached_end = fsdp::memory_stats().cached_bytes;
  const fsdp::detail::BlockCache::Stats cache = fsdp::detail::block_cache_stats();
  if (rank == 0) {
    std::printf(
        "{\"bench\":\"step\",\"mode\":\"%s\",\"world\":%d,\"blocks\":%lld,\"d_model\":%lld,"
        "\"seq\":%lld,\"batch\":%lld,\"params\":%lld,\"forward_prefetch\":%s,\"steps\":%d,"
        "\"warmup\":%d,\"median_ms\":%.1f,\"slowest_rank_median_ms\":%.1f,\"forward_ms\":%.1f,"
        "\"backward_ms\":%.1f,"
        "\"optimizer_ms\":%.1f,\"peak_bytes\":%lld,\"state_bytes\":%lld,"
        "\"param_peak_bytes\":%lld,\"block_param_bytes\":%lld,\"loss0\":%.6f,"
        "\"precision\":\"%s\",\"activation_checkpointing\":%s,\"all_gather_bytes_per_step\":%lld,"
        "\"reduce_scatter_bytes_per_step\":%lld,\"run_peak_bytes\":%lld,"
        "\"peak_rss_bytes\":%lld,\"rss_growth_bytes\":%lld,\"rss_bound_ratio\":%.3f,"
        "\"cached_bytes_at_end\":%lld,\"cache_reused\":%lld,\"cache_split\":%lld,"
        "\"cache_mapped\":%lld,\"cache_evicted\":%lld,\"cache_peak_in_use\":%lld,"
        "\"cache_mapped_bytes\":%lld,\"backward_prefetch\":\"%s\",\"comm_only\":%s,"
        "\"recorded_collectives\":%lld,\"net_tx_bytes_per_step\":%lld,\"cpu_ms_per_step\":%.1f,"
        "\"step_start_bytes\":%lld,\"forward_end_bytes\":%lld,\"rss_before_model_bytes\":%lld,"
        "\"malloc\":\"%s\",\"in_place\":%s,\"micro_batches\":%d,\"accumulate\":\"%s\","
        "\"torch\":\"%s\",\"blas\":\"%s\"}\n",
        args.mode.c_str(), world, static_cast<long long>(args.blocks),
        static_cast<long long>(args.d_model), static_cast<long long>(args.seq),
        static_cast<long long>(args.batch), static_cast<long long>(total_params),
        strategy && args.forward_prefetch ? "true" : "false", args.steps, args.warmup, med,
        med_synced, med_f, med_b, med_o, static_cast<long long>(peak_max),
        static_cast<long long>(state_max), static_cast<long long>(param_peak_max),
        static_cast<long long>(gpt_mini::block_param_count(config) *
                               static_cast<int64_t>(sizeof(float))),
        loss0, args.precision.c_str(), args.activation_checkpointing ? "true" : "false",
        static_cast<long long>(gathered_per_step), static_cast<long long>(reduced_per_step),
        static_cast<long long>(run_peak_max), static_cast<long long>(peak_rss_max),
        static_cast<long long>(rss_growth_max), rss_bound_ratio_max,
        static_cast<long long>(cached_end), static_cast<long long>(cache.reused),
        static_cast<long long>(cache.split), static_cast<long long>(cache.mapped),
        static_cast<long long>(cache.evicted), static_cast<long long>(cache.peak_in_use),
        static_cast<long long>(cache.mapped_bytes), args.backward_prefetch.c_str(),
        args.comm_only ? "true" : "false",
        static_cast<long long>(counting ? counting->recorded() : 0), static_cast<long long>(tx_max),
        cpu_max, static_cast<long long>(step_start_max), static_cast<long long>(forward_end_max),
        static_cast<long long>(rss_before_max), bench::malloc_mode(),
        args.in_place ? "true" : "false", args.micro_batches, args.accumulate.c_str(),
        TORCH_VERSION, bench::blas_description().c_str());
    std::fflush(stdout);
  }
  pg->barrier().wait();
  return 0;
}
