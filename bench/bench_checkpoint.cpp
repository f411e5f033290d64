// Checkpoint benchmark (issue 6): GPT-mini (gpt_mini.h, each block an FSDP
// unit, FULL_SHARD) with AdamW state after one step, at 2 ranks:
//   build/bin/fsdprun --nproc-per-node 2 build/bin/bench_checkpoint [--dir D] [--repeats 3]
//       [--blocks 8] [--d-model 512]
// For full and sharded checkpoints, save and load: the median time (slowest
// rank) and the peak of tracked CPU tensor memory above what was held before
// the operation, per rank. Rank 0 prints one JSON line per configuration and
// a last line with the full/sharded ratios measured in the same run, and
// one with the rate of the CRC-32 every load verifies whole files with,
// against a copy of the same bytes (rounds interleaved).

#include <torch/torch.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <fsdp/fsdp.h>

#include "bench_cli.h"
#include "bench_util.h"
#include "state/crc32.h"

#include "gpt_mini.h"

namespace {

struct Args {
  std::string dir = "/tmp/fsdp_bench_checkpoint";
  int repeats = 3;
  int64_t blocks = 8, d_model = 512;
};

Args parse(int argc, char** argv) {
  Args a;
  bench::CommandLine cli("Checkpoint save/load time and peak memory (full and sharded)");
  cli.option("--dir", &a.dir, "where to write the checkpoints");
  cli.option("--repeats", &a.repeats, "repeats per configuration").positive();
  cli.option("--blocks", &a.blocks, "GPT-mini blocks").positive();
  cli.option("--d-model", &a.d_model, "GPT-mini width").positive();
  cli.parse(argc, argv);
  return a;
}

struct Result {
  double ms = 0;
  double peak_extra = 0;  // bytes, this rank
};

// Runs op `repeats` times; the median time over repeats and the largest peak.
template <typename Op>
Result measure(fsdp::ProcessGroup& pg, int repeats, Op op) {
  std::vector<double> times;
  double peak = 0;
  for (int r = 0; r < repeats; ++r) {
    pg.barrier().wait();
    const int64_t before = fsdp::memory_stats().current_bytes;
    fsdp::reset_peak_memory_stats();
    const auto t0 = bench::Clock::now();
    op();
    times.push_back(bench::ms_since(t0));
    peak = std::max(peak, static_cast<double>(fsdp::memory_stats().peak_bytes - before));
  }
  return {bench::median(times), peak};
}

// GB/s of the CRC-32 and of a copy over the same 256 MiB, medians of
// interleaved rounds: what a load's verification costs per byte read.
void print_crc32_rate(int repeats) {
  std::vector<unsigned char> bytes(size_t{256} << 20), copy(bytes.size());
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<unsigned char>(i * 131 + 7);
  std::vector<double> crc_ms, copy_ms;
  uint32_t sum = 0;
  for (int r = 0; r < repeats; ++r) {
    auto t0 = bench::Clock::now();
    sum ^= fsdp::detail::crc32(bytes.data(), bytes.size());
    crc_ms.push_back(bench::ms_since(t0));
    t0 = bench::Clock::now();
    std::memcpy(copy.data(), bytes.data(), bytes.size());
    copy_ms.push_back(bench::ms_since(t0));
  }
  const double gb = static_cast<double>(bytes.size()) / 1e9;
  const double crc = gb / (bench::median(crc_ms) / 1e3), cp = gb / (bench::median(copy_ms) / 1e3);
  std::printf(
      "{\"bench\":\"checkpoint_crc32\",\"bytes\":%zu,\"repeats\":%d,\"crc32_gb_per_s\":%.2f,"
      "\"copy_gb_per_s\":%.2f,\"crc32_over_copy\":%.3f,\"sum\":%u}\n",
      bytes.size(), repeats, crc, cp, crc / cp, sum ^ copy[12345]);
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  const Args args = parse(argc, argv);
  bench::setup_process();
  fsdp::enable_memory_tracking();
  auto pg = fsdp::init_process_group();
  const auto config = gpt_mini::GPTConfig().n_layer(args.blocks).d_model(args.d_model);
  const auto opts = fsdp::FSDPOptions().sharding_strategy(fsdp::ShardingStrategy::kFullShard);
  torch::manual_seed(0);
  fsdp::FullyShardedDataParallel<gpt_mini::GPTImpl> model(
      std::make_shared<gpt_mini::GPTImpl>(config, opts), opts);
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(3e-4));
  {
    torch::manual_seed(1);
    at::Tensor tokens = torch::randint(config.vocab_size(), {4, 64});
    opt.zero_grad();
    gpt_mini::lm_loss(model->forward(tokens), tokens).backward();
    opt.step();
  }
  int64_t params = 0;
  for (const auto& p : model->named_parameters()) params += p.value().numel();
  const double held = static_cast<double>(fsdp::memory_stats().current_bytes);
  fsdp::Checkpointer ckpt(*model, &opt);
  std::vector<double> ms(4);
  int i = 0;
  for (auto type : {fsdp::StateDictType::kFull, fsdp::StateDictType::kSharded}) {
    const std::string dir = args.dir + "/" + fsdp::to_string(type);
    for (const char* op : {"save", "load"}) {
      const bool save = std::string(op) == "save";
      const Result r = measure(*pg, args.repeats, [&] {
        if (save) {
          ckpt.save(dir, 1, type);
        } else {
          ckpt.load(dir);
        }
      });
      const double slowest = bench::max_over_ranks(*pg, r.ms);
      const double peak_max = bench::max_over_ranks(*pg, r.peak_extra);
      at::Tensor peaks = at::zeros({pg->size()}, at::kDouble);
      peaks[pg->rank()] = r.peak_extra;
      pg->all_reduce(peaks, fsdp::ReduceOp::kSum).wait();
      ms[i++] = slowest;
      if (pg->rank() == 0) {
        std::printf(
            "{\"bench\":\"checkpoint\",\"model\":\"gpt_mini\",\"params\":%lld,\"ranks\":%d,"
            "\"type\":\"%s\",\"op\":\"%s\",\"repeats\":%d,\"ms\":%.1f,"
            "\"peak_extra_bytes_max_rank\":%.0f,\"peak_extra_bytes_per_rank\":[%.0f,%.0f],"
            "\"held_bytes_rank0\":%.0f}\n",
            static_cast<long long>(params), pg->size(), fsdp::to_string(type), op, args.repeats,
            slowest, peak_max, peaks[0].item<double>(),
            pg->size() > 1 ? peaks[1].item<double>() : 0.0, held);
        std::fflush(stdout);
      }
    }
  }
  if (pg->rank() == 0) print_crc32_rate(std::max(args.repeats, 5));
  if (pg->rank() == 0) {
    std::printf(
        "{\"bench\":\"checkpoint_ratios\",\"full_over_sharded_save_ms\":%.2f,"
        "\"full_over_sharded_load_ms\":%.2f}\n",
        ms[0] / ms[2], ms[1] / ms[3]);
  }
  return 0;
}
