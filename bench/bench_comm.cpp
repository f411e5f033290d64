// Communication benchmark (issue: foundation). Run at 2 ranks:
//   build/bin/fsdprun --nproc-per-node 2 build/bin/bench_comm [--mib 64] [--iters 10]
// Rank 0 prints one JSON line per configuration, then one line of ratios
// measured in the same run: ours against c10d's Gloo path and a local memcpy.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include <fsdp/comm/c10d_process_group.h>
#include <fsdp/comm/init.h>

namespace {

double median_ms(int iters, const std::function<void()>& fn, fsdp::ProcessGroup& pg) {
  std::vector<double> times;
  for (int i = -2; i < iters; ++i) {  // two warm-ups
    pg.barrier().wait();
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    const double ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    if (i >= 0) times.push_back(ms);
  }
  // Each rank's median is taken as the slowest rank's, like a collective's.
  std::sort(times.begin(), times.end());
  at::Tensor m = at::full({1}, times[times.size() / 2], at::kDouble);
  pg.all_reduce(m, fsdp::ReduceOp::kMax).wait();
  return m.item<double>();
}

// A ratio as JSON: null when a side was not measured (NaN).
std::string json_number(double v) {
  if (std::isnan(v)) return "null";
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.2f", v);
  return buf;
}

void emit(int rank, const std::string& op, const std::string& impl, int world, int64_t bytes,
          double ms, double moved_fraction) {
  if (rank != 0) return;
  const double busbw = bytes * moved_fraction / (ms * 1e-3) / 1e9;
  std::printf(
      "{\"bench\":\"comm\",\"op\":\"%s\",\"impl\":\"%s\",\"world\":%d,\"bytes\":%lld,"
      "\"median_ms\":%.3f,\"busbw_GBps\":%.3f}\n",
      op.c_str(), impl.c_str(), world, static_cast<long long>(bytes), ms, busbw);
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  int64_t mib = 64;
  int iters = 10;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (std::strcmp(argv[i], "--mib") == 0)
      mib = std::atoll(argv[i + 1]);
    else if (std::strcmp(argv[i], "--iters") == 0)
      iters = std::atoi(argv[i + 1]);
    else {
      std::fprintf(stderr, "usage: bench_comm [--mib N] [--iters N]\n");
      return 2;
    }
  }
  at::set_num_threads(1);
  auto pg = fsdp::init_process_group();
  // A second group on the next port: c10d's ProcessGroupGloo, the baseline,
  // where this build has it (not against pip's wheel: no Gloo headers).
  c10::intrusive_ptr<c10d::ProcessGroup> c10d;
  std::shared_ptr<fsdp::ProcessGroup> c10d_wrapper;
  if (fsdp::backend_available(fsdp::Backend::kC10dGloo)) {
    const char* port_env = std::getenv("MASTER_PORT");
    const int64_t c10d_port = (port_env ? std::atoll(port_env) : 29500) + 1;
    c10d_wrapper = fsdp::init_process_group(fsdp::ProcessGroupOptions()
                                                .backend(fsdp::Backend::kC10dGloo)
                                                .master_port(c10d_port)
                                                .set_default(false));
    c10d = std::dynamic_pointer_cast<fsdp::C10dProcessGroup>(c10d_wrapper)->c10d_group();
  }

  const int rank = pg->rank(), world = pg->size();
  const int64_t numel = mib * (1 << 20) / 4;
  const int64_t bytes = numel * 4;
  TORCH_CHECK(numel % world == 0, "--mib must make a buffer divisible by the world size");
  const int64_t s = numel / world;
  at::Tensor flat = at::zeros({numel});
  at::Tensor flat2 = at::zeros({numel});
  at::Tensor shard = at::full({s}, static_cast<float>(rank));
  const double moved = static_cast<double>(world - 1) / world;

  const double memcpy_ms = median_ms(
      iters, [&] { flat2.copy_(flat); }, *pg);
  emit(rank, "memcpy", "local", world, bytes, memcpy_ms, 1.0);

  const double ag_ms = median_ms(
      iters, [&] { pg->all_gather_into_tensor(flat, shard).wait(); }, *pg);
  emit(rank, "all_gather", "fsdp", world, bytes, ag_ms, moved);

  std::vector<at::Tensor> outputs;
  for (int k = 0; k < world; ++k) outputs.push_back(flat.narrow(0, k * s, s));
  double c10d_ag_ms = std::nan("");
  if (c10d) {
    c10d_ag_ms = median_ms(
        iters,
        [&] {
          std::vector<std::vector<at::Tensor>> out{outputs};
          std::vector<at::Tensor> in{shard};
          c10d->allgather(out, in)->wait();
        },
        *pg);
    emit(rank, "all_gather", "c10d_gloo_list", world, bytes, c10d_ag_ms, moved);
  }

  at::Tensor grads = at::ones({numel});
  const double rs_ms = median_ms(
      iters, [&] { pg->reduce_scatter_tensor(shard, grads, fsdp::ReduceOp::kSum).wait(); }, *pg);
  emit(rank, "reduce_scatter", "fsdp", world, bytes, rs_ms, moved);

  double c10d_rs_ms = std::nan("");
  if (c10d) {
    c10d_rs_ms = median_ms(
        iters,
        [&] {
          std::vector<at::Tensor> t{flat2};
          c10d->allreduce(t)->wait();
          shard.copy_(flat2.narrow(0, rank * s, s));
        },
        *pg);
    emit(rank, "reduce_scatter", "c10d_allreduce_slice", world, bytes, c10d_rs_ms, moved);
  }

  at::Tensor tiny = at::ones({1});
  const double ar_ms = median_ms(
      200, [&] { pg->all_reduce(tiny).wait(); }, *pg);
  emit(rank, "all_reduce", "fsdp", world, 4, ar_ms, 2.0 * moved);

  if (rank == 0) {
    std::printf(
        "{\"bench\":\"comm_ratios\",\"world\":%d,\"bytes\":%lld,"
        "\"all_gather_speedup_vs_c10d\":%s,\"reduce_scatter_speedup_vs_allreduce_slice\":%s,"
        "\"all_gather_over_memcpy\":%.2f,\"reduce_scatter_over_memcpy\":%.2f,"
        "\"all_reduce_4B_latency_ms\":%.4f}\n",
        world, static_cast<long long>(bytes), json_number(c10d_ag_ms / ag_ms).c_str(),
        json_number(c10d_rs_ms / rs_ms).c_str(), ag_ms / memcpy_ms, rs_ms / memcpy_ms, ar_ms);
  }
  pg->barrier().wait();
  return 0;
}
