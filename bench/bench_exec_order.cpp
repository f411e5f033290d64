// Cost of the forward-order check (Note [Forward order]) and of debug mode
// (Note [Collective fingerprints]), issue 5:
//   build/bin/fsdprun --nproc-per-node 2 build/bin/bench_exec_order
// Options: --models overhead64,gpt_mini --strategy full_shard --reps 7 --steps 10
//   --blocks 8 --d-model 256 --heads 8 --seq 64 --batch 4   (GPT-mini's size)
//
// Per model, three measurements, configurations interleaved so that drift of
// the (shared) machine hits them alike; each value is the slowest rank's:
// - first_iteration: a freshly wrapped model's first training step (forward +
//   backward), with check_forward_order on and off, `reps` fresh models each.
//   cost_us_per_unit = (on - off) / units checked. The check runs only here.
// - later_iterations: steady steps with the check on (a local comparison per
//   unit) and off.
// - debug_mode: steady steps with debug mode (a fingerprint exchange before
//   every collective) on and off; cost per unit per step and per collective.
// The steady configurations alternate step by step (reps * steps each).
// A step is forward + sum/loss + backward (no optimizer: it is the same in
// every configuration). Rank 0 prints one JSON line per measurement.

#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <fsdp/fsdp.h>

#include "bench_cli.h"
#include "bench_util.h"
#include "gpt_mini.h"
#include "overhead_net.h"

namespace {

using bench::Clock;
using bench::max_over_ranks;
using bench::median;
using bench::us_since;

struct Args {
  std::vector<std::string> models = {"overhead64", "gpt_mini"};
  std::string strategy = "full_shard";
  int reps = 7;
  int steps = 10;
  int64_t blocks = 8, d_model = 256, heads = 8, seq = 64, batch = 4;
};

// A wrapped model and one training step's forward + backward on fixed data.
struct Model {
  std::shared_ptr<torch::nn::Module> root;
  std::function<void()> step;
  int64_t units_with_params = 0;  // units the check agrees on, per forward
};

Model make_model(const std::string& name, const Args& a, const fsdp::FSDPOptions& opts, int rank) {
  Model m;
  torch::manual_seed(0);
  if (name == "overhead64") {
    auto root = std::make_shared<fsdp::FullyShardedDataParallelImpl<bench::NetImpl>>(
        std::make_shared<bench::NetImpl>(64, 32, opts), opts);
    torch::manual_seed(1000 + rank);
    at::Tensor x = torch::randn({4, 32});
    m.root = root;
    m.step = [root, x] { root->forward(x).sum().backward(); };
    m.units_with_params = 64;  // the root holds no parameter
  } else if (name == "gpt_mini") {
    const auto config =
        gpt_mini::GPTConfig().block_size(a.seq).d_model(a.d_model).n_head(a.heads).n_layer(
            a.blocks);
    auto root = std::make_shared<fsdp::FullyShardedDataParallelImpl<gpt_mini::GPTImpl>>(
        std::make_shared<gpt_mini::GPTImpl>(config, opts), opts);
    torch::manual_seed(1000 + rank);
    at::Tensor data = torch::randint(config.vocab_size(), {a.batch, a.seq + 1}, torch::kLong);
    at::Tensor in = data.slice(1, 0, a.seq).contiguous();
    at::Tensor target = data.slice(1, 1, a.seq + 1).contiguous();
    m.root = root;
    m.step = [root, in, target] { gpt_mini::lm_loss(root->forward(in), target).backward(); };
    m.units_with_params = a.blocks + 1;  // the blocks and the root (embeddings, head)
  } else {
    std::fprintf(stderr, "bench_exec_order: unknown model '%s'\n", name.c_str());
    std::exit(2);
  }
  return m;
}

double timed(fsdp::ProcessGroup& pg, const std::function<void()>& fn) {
  pg.barrier().wait();
  const auto t0 = Clock::now();
  fn();
  return us_since(t0);
}

Args parse(int argc, char** argv) {
  Args a;
  bench::CommandLine cli("Cost of the forward-order check and of debug mode");
  cli.option("--models", &a.models, "overhead64 and/or gpt_mini")
      .one_of({"overhead64", "gpt_mini"});
  cli.option("--strategy", &a.strategy).one_of(bench::strategy_keys());
  cli.option("--reps", &a.reps).positive();
  cli.option("--steps", &a.steps).positive();
  cli.option("--blocks", &a.blocks);
  cli.option("--d-model", &a.d_model);
  cli.option("--heads", &a.heads);
  cli.option("--seq", &a.seq);
  cli.option("--batch", &a.batch);
  cli.parse(argc, argv);
  return a;
}

}  // namespace

int main(int argc, char** argv) {
  const Args a = parse(argc, argv);
  const fsdp::ShardingStrategy strategy = bench::strategy_names().at(a.strategy);

  bench::setup_process();
  auto pg = fsdp::init_process_group();
  const int rank = pg->rank(), world = pg->size();
  const auto base = fsdp::FSDPOptions().sharding_strategy(strategy);

  for (const std::string& name : a.models) {
    // first_iteration: fresh models, the check on and off in turn.
    std::vector<double> first_on, first_off;
    int64_t units = 0;
    for (int r = 0; r < a.reps; ++r) {
      for (bool check : {false, true}) {
        Model m = make_model(name, a, fsdp::FSDPOptions(base).check_forward_order(check), rank);
        units = m.units_with_params;
        (check ? first_on : first_off).push_back(timed(*pg, m.step));
      }
    }
    const double on = max_over_ranks(*pg, median(first_on));
    const double off = max_over_ranks(*pg, median(first_off));
    if (rank == 0) {
      std::printf(
          "{\"bench\":\"exec_order\",\"measure\":\"first_iteration\",\"model\":\"%s\","
          "\"strategy\":\"%s\",\"world\":%d,\"units\":%lld,\"samples\":%d,"
          "\"check_off_us\":%.1f,\"check_on_us\":%.1f,\"ratio\":%.4f,"
          "\"cost_us_per_unit\":%.2f}\n",
          name.c_str(), a.strategy.c_str(), world, static_cast<long long>(units), a.reps, off, on,
          on / off, (on - off) / static_cast<double>(units));
      std::fflush(stdout);
    }

    // later_iterations and debug_mode: steady steps of two models.
    Model checked = make_model(name, a, base, rank);
    Model unchecked = make_model(name, a, fsdp::FSDPOptions(base).check_forward_order(false), rank);
    for (int i = 0; i < 2; ++i) {  // warm-up (and the first iteration)
      checked.step();
      unchecked.step();
    }
    // Interleaved step by step: checked (debug off), unchecked, checked with
    // debug mode on (every rank switches at the same point).
    std::vector<double> later_on, later_off, debug_on;
    for (int i = 0; i < a.reps * a.steps; ++i) {
      later_on.push_back(timed(*pg, checked.step));
      later_off.push_back(timed(*pg, unchecked.step));
      pg->set_debug_collectives(true);
      debug_on.push_back(timed(*pg, checked.step));
      pg->set_debug_collectives(false);
    }
    const std::vector<double>& debug_off = later_on;
    const double l_on = max_over_ranks(*pg, median(later_on));
    const double l_off = max_over_ranks(*pg, median(later_off));
    const double d_on = max_over_ranks(*pg, median(debug_on));
    const double d_off = max_over_ranks(*pg, median(debug_off));
    if (rank == 0) {
      std::printf(
          "{\"bench\":\"exec_order\",\"measure\":\"later_iterations\",\"model\":\"%s\","
          "\"strategy\":\"%s\",\"world\":%d,\"units\":%lld,\"samples\":%zu,"
          "\"check_off_us\":%.1f,\"check_on_us\":%.1f,\"ratio\":%.4f,"
          "\"cost_us_per_unit_per_step\":%.3f}\n",
          name.c_str(), a.strategy.c_str(), world, static_cast<long long>(units), later_on.size(),
          l_off, l_on, l_on / l_off, (l_on - l_off) / static_cast<double>(units));
      // Per unit and step: FULL_SHARD two all-gathers (the root only one: it
      // stays gathered after forward) and a reduce-scatter; SHARD_GRAD_OP an
      // all-gather and a reduce-scatter; NO_SHARD an all-reduce.
      const bool root_has_params = name != "overhead64";
      const int64_t per_unit = strategy == fsdp::ShardingStrategy::kFullShard     ? 3
                               : strategy == fsdp::ShardingStrategy::kShardGradOp ? 2
                                                                                  : 1;
      const int64_t collectives =
          per_unit * units -
          (root_has_params && strategy == fsdp::ShardingStrategy::kFullShard ? 1 : 0);
      std::printf(
          "{\"bench\":\"exec_order\",\"measure\":\"debug_mode\",\"model\":\"%s\","
          "\"strategy\":\"%s\",\"world\":%d,\"units\":%lld,\"samples\":%zu,"
          "\"debug_off_us\":%.1f,\"debug_on_us\":%.1f,\"ratio\":%.4f,"
          "\"collectives_per_step\":%lld,\"cost_us_per_unit_per_step\":%.2f,"
          "\"cost_us_per_collective\":%.2f}\n",
          name.c_str(), a.strategy.c_str(), world, static_cast<long long>(units), debug_on.size(),
          d_off, d_on, d_on / d_off, static_cast<long long>(collectives),
          (d_on - d_off) / static_cast<double>(units),
          (d_on - d_off) / static_cast<double>(collectives));
      std::fflush(stdout);
    }
  }
  pg->barrier().wait();
  return 0;
}
