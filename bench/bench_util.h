#pragma once

// Helpers shared by the benchmarks.

#include <ATen/ATen.h>
#include <dlfcn.h>
#include <cstdlib>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <torch/optim/adamw.h>

#include <fsdp/comm/process_group.h>
#include <fsdp/memory.h>
#include <fsdp/wrap/options.h>

#include "memory/malloc_tuning.h"

namespace bench {

/// One intra-op thread means one BLAS thread too: at::set_num_threads() does
/// not reach OpenBLAS's own pthread pool (Debian's default BLAS), which
/// otherwise uses every core for a single-process run while fsdprun's ranks
/// get OMP_NUM_THREADS=1, and would flatter the local baseline.
inline void single_threaded_blas() {
  using SetThreads = void (*)(int);
  if (auto fn = reinterpret_cast<SetThreads>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads")))
    fn(1);
}

/// The BLAS this process runs LibTorch's matmuls on: "openblas <core>"
/// (Debian's LibTorch 1.13 calls the system OpenBLAS, whose core detection
/// can fall back to a generic core; see scripts/check_blas.sh), else "mkl"
/// (pip's wheel), else "other".
inline std::string blas_description() {
  using CoreName = char* (*)();
  if (auto fn = reinterpret_cast<CoreName>(dlsym(RTLD_DEFAULT, "openblas_get_corename"))) {
    return std::string("openblas ") + fn();
  }
  return at::hasMKL() ? "mkl" : "other";
}

/// How this process gets its CPU memory, from BENCH_CPU_MEMORY: "cache"
/// (the default: libfsdp's block cache, fsdp::enable_cpu_block_cache(), for
/// every mode, `local` included), "kept" (no cache; glibc keeps freed memory,
/// what fsdp::keep_freed_cpu_memory() did before the cache) or "default" (no
/// cache, glibc's defaults).
/// The JSON lines say it as "malloc".
inline const char* malloc_mode() {
  static const std::string mode = [] {
    const char* env = std::getenv("BENCH_CPU_MEMORY");
    const std::string m = env != nullptr && *env != '\0' ? env : "cache";
    TORCH_CHECK(m == "cache" || m == "kept" || m == "default",
                "BENCH_CPU_MEMORY must be cache, kept or default, not '", m, "'");
    return m;
  }();
  return mode.c_str();
}

/// Every benchmark's process set-up, for all modes alike: one intra-op thread
/// and one BLAS thread, and the CPU memory policy of malloc_mode(). Call it
/// before any FSDP unit exists. Prints nothing.
inline void setup_process() {
  at::set_num_threads(1);
  single_threaded_blas();
  const std::string mode = malloc_mode();
  if (mode == "cache") {
    fsdp::enable_cpu_block_cache();
  } else {
    setenv("FSDP_CPU_BLOCK_CACHE", "0", 1);  // FSDP's units would turn it on
    if (mode == "kept") fsdp::detail::keep_freed_heap_memory();
  }
}

/// The benchmarks' clock.
using Clock = std::chrono::steady_clock;

/// Microseconds since t0.
inline double us_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
}

/// Milliseconds since t0.
inline double ms_since(Clock::time_point t0) { return us_since(t0) / 1000.0; }

/// The median (upper median for an even count).
inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

/// The slowest rank's value: a step is as slow as its slowest rank.
inline double max_over_ranks(fsdp::ProcessGroup& pg, double value) {
  at::Tensor t = at::full({1}, value, at::kDouble);
  pg.all_reduce(t, fsdp::ReduceOp::kMax).wait();
  return t.item<double>();
}

/// The largest byte count over ranks (through max_over_ranks: exact below
/// 2^53 bytes).
inline int64_t max_bytes_over_ranks(fsdp::ProcessGroup& pg, int64_t bytes) {
  return static_cast<int64_t>(max_over_ranks(pg, static_cast<double>(bytes)));
}

/// Sharding strategies by their command-line names.
inline const std::map<std::string, fsdp::ShardingStrategy>& strategy_names() {
  static const std::map<std::string, fsdp::ShardingStrategy> names = {
      {"full_shard", fsdp::ShardingStrategy::kFullShard},
      {"shard_grad_op", fsdp::ShardingStrategy::kShardGradOp},
      {"no_shard", fsdp::ShardingStrategy::kNoShard},
      {"hybrid_shard", fsdp::ShardingStrategy::kHybridShard},
      {"hybrid_shard_zero2", fsdp::ShardingStrategy::kHybridShardZero2}};
  return names;
}

/// The names strategy_names() knows.
inline std::vector<std::string> strategy_keys() {
  std::vector<std::string> keys;
  for (const auto& kv : strategy_names()) keys.push_back(kv.first);
  return keys;
}

/// Bytes of `t`'s elements (0 for an undefined tensor).
inline int64_t bytes_of(const at::Tensor& t) {
  return t.defined() ? t.numel() * static_cast<int64_t>(t.element_size()) : 0;
}

/// Parameters + gradients + AdamW state of what `opt` steps, from the tensors.
inline int64_t optimizer_state_bytes(torch::optim::AdamW& opt) {
  int64_t bytes = 0;
  for (const auto& group : opt.param_groups()) {
    for (const auto& p : group.params()) bytes += bytes_of(p) + bytes_of(p.grad());
  }
  for (const auto& kv : opt.state()) {
    const auto* s = dynamic_cast<const torch::optim::AdamWParamState*>(kv.second.get());
    if (s == nullptr) continue;
    bytes += bytes_of(s->exp_avg()) + bytes_of(s->exp_avg_sq()) + bytes_of(s->max_exp_avg_sq());
  }
  return bytes;
}

}  // namespace bench
