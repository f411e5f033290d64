// The rank program of the simulated-cluster tests (tests/cluster/*.sh): a
// small MLP of FSDP units trained for a few steps on different data per rank,
// whose final full parameters rank 0 writes to a file. Every step's batch is
// drawn from (--seed, rank, step) alone, so a run resumed from a checkpoint
// sees the same data as an uninterrupted one, and N nodes x P ranks see the
// same data as 1 node x N*P ranks.
//
//   fsdprun ... cluster_train --strategy full_shard --steps 6 --out params.pt
//       [--optimizer adam|sgd] [--timeout S] [--step-ms MS] [--save DIR] [--load DIR]
//       [--ckpt-dir DIR --ckpt-every K]   (resumes from DIR's latest checkpoint)
//   cluster_train --compare A.pt B.pt --tol 1e-6   (no process group)
//   cluster_train --gloo    prints 1 when this build connects ranks over Gloo
//
// Blocks are 128 wide with a 512-wide hidden layer: a unit's flat parameter
// is 132 K floats, so its collectives (33 K floats per rank at 4 ranks) take
// the large routes (shared memory on one host, the TCP ring across hosts), and
// the root's small ones take the direct links.

#include <torch/torch.h>

#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <fsdp/fsdp.h>

namespace nn = torch::nn;

namespace {

constexpr int64_t kWidth = 128;
constexpr int64_t kDepth = 3;
constexpr int64_t kRowsPerRank = 8;

struct BlockImpl : nn::Module {
  BlockImpl() {
    fc = register_module("fc", nn::Linear(kWidth, 4 * kWidth));
    proj = register_module("proj", nn::Linear(4 * kWidth, kWidth));
  }
  torch::Tensor forward(torch::Tensor x) { return x + proj(torch::tanh(fc(x))); }
  nn::Linear fc{nullptr}, proj{nullptr};
};
TORCH_MODULE(Block);

struct ModelImpl : nn::Module {
  explicit ModelImpl(const fsdp::FSDPOptions& options) {
    in = register_module("in", nn::Linear(16, kWidth));
    for (int64_t i = 0; i < kDepth; ++i) {
      blocks.push_back(
          register_module("block" + std::to_string(i),
                          fsdp::FullyShardedDataParallel<BlockImpl>(Block(), options)));
    }
    out = register_module("out", nn::Linear(kWidth, 1));
  }
  torch::Tensor forward(torch::Tensor x) {
    x = in(x);
    for (auto& block : blocks) x = block(x);
    return out(x);
  }
  nn::Linear in{nullptr}, out{nullptr};
  std::vector<fsdp::FullyShardedDataParallel<BlockImpl>> blocks;
};
TORCH_MODULE(Model);

struct Args {
  std::string strategy = "full_shard";
  int64_t steps = 6;
  int64_t seed = 7;
  double timeout_s = 60;
  int64_t step_ms = 0;
  std::string optimizer = "adam";
  std::string out, save, load, ckpt_dir;
  int64_t ckpt_every = 0;
  std::vector<std::string> compare;
  bool gloo = false;
  double tol = 0;
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw std::invalid_argument(flag + ": missing value");
      return argv[++i];
    };
    if (flag == "--strategy") {
      a.strategy = value();
    } else if (flag == "--optimizer") {
      a.optimizer = value();
    } else if (flag == "--steps") {
      a.steps = std::stoll(value());
    } else if (flag == "--seed") {
      a.seed = std::stoll(value());
    } else if (flag == "--timeout") {
      a.timeout_s = std::stod(value());
    } else if (flag == "--step-ms") {
      a.step_ms = std::stoll(value());
    } else if (flag == "--out") {
      a.out = value();
    } else if (flag == "--save") {
      a.save = value();
    } else if (flag == "--load") {
      a.load = value();
    } else if (flag == "--ckpt-dir") {
      a.ckpt_dir = value();
    } else if (flag == "--ckpt-every") {
      a.ckpt_every = std::stoll(value());
    } else if (flag == "--compare") {
      a.compare = {value(), value()};
    } else if (flag == "--gloo") {
      a.gloo = true;
    } else if (flag == "--tol") {
      a.tol = std::stod(value());
    } else {
      throw std::invalid_argument("unknown flag '" + flag + "'");
    }
  }
  return a;
}

fsdp::ShardingStrategy strategy_from(const std::string& name) {
  if (name == "full_shard") return fsdp::ShardingStrategy::kFullShard;
  if (name == "shard_grad_op") return fsdp::ShardingStrategy::kShardGradOp;
  if (name == "no_shard") return fsdp::ShardingStrategy::kNoShard;
  if (name == "hybrid_shard") return fsdp::ShardingStrategy::kHybridShard;
  if (name == "hybrid_shard_zero2") return fsdp::ShardingStrategy::kHybridShardZero2;
  throw std::invalid_argument(
      "--strategy: expected full_shard|shard_grad_op|no_shard|hybrid_shard|hybrid_shard_zero2, "
      "got '" +
      name + "'");
}

// Writes names and tensors as two lists (torch::save takes no OrderedDict).
void save_params(const torch::OrderedDict<std::string, at::Tensor>& dict, const std::string& path) {
  std::vector<torch::Tensor> tensors;
  std::string names;
  for (const auto& item : dict) {
    names += item.key() + "\n";
    tensors.push_back(item.value());
  }
  torch::save(tensors, path);
  std::ofstream(path + ".names") << names;
}

std::map<std::string, torch::Tensor> load_params(const std::string& path) {
  std::vector<torch::Tensor> tensors;
  torch::load(tensors, path);
  std::ifstream names(path + ".names");
  std::map<std::string, torch::Tensor> out;
  std::string name;
  for (const auto& t : tensors) {
    if (!std::getline(names, name)) throw std::runtime_error(path + ".names: too few names");
    out[name] = t;
  }
  return out;
}

// Largest |a - b| / max(1, |b|) over every parameter; exit 1 above --tol.
int compare(const Args& a) {
  const auto x = load_params(a.compare[0]);
  const auto y = load_params(a.compare[1]);
  if (x.size() != y.size() || x.empty()) {
    std::cerr << "compare: " << x.size() << " vs " << y.size() << " parameters\n";
    return 1;
  }
  double worst = 0;
  std::string where;
  for (const auto& [name, t] : x) {
    auto it = y.find(name);
    if (it == y.end() || !t.sizes().equals(it->second.sizes())) {
      std::cerr << "compare: " << name << " missing or of another shape in " << a.compare[1]
                << "\n";
      return 1;
    }
    const double d = ((t - it->second).abs() / it->second.abs().clamp_min(1)).max().item<double>();
    if (d > worst || !std::isfinite(d)) {
      worst = d;
      where = name;
    }
  }
  std::cout << "compare: " << x.size() << " parameters, max relative difference " << worst
            << (where.empty() ? "" : " (" + where + ")") << ", tolerance " << a.tol << "\n";
  return worst <= a.tol && std::isfinite(worst) ? 0 : 1;
}

int train(const Args& a) {
  torch::set_num_threads(1);
  auto pg = fsdp::init_process_group(fsdp::ProcessGroupOptions().timeout(
      std::chrono::milliseconds(static_cast<int64_t>(a.timeout_s * 1000))));
  const int rank = pg->rank();
  const char* restart = std::getenv("TORCHELASTIC_RESTART_COUNT");
  if (restart == nullptr) restart = "-";
  char host[256] = {};
  ::gethostname(host, sizeof(host) - 1);
  std::cout << "rank " << rank << "/" << pg->size() << " on " << host << ", " << a.strategy
            << ", restart " << restart << ", gloo "
            << fsdp::backend_available(fsdp::Backend::kC10dGloo) << std::endl;

  const auto options = fsdp::FSDPOptions().sharding_strategy(strategy_from(a.strategy));
  torch::manual_seed(0);  // the same initial weights on every rank
  fsdp::FullyShardedDataParallel<ModelImpl> model(Model(options), options);
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  if (a.optimizer == "adam") {
    optimizer =
        std::make_unique<torch::optim::Adam>(model->parameters(), torch::optim::AdamOptions(1e-3));
  } else if (a.optimizer == "sgd") {
    optimizer = std::make_unique<torch::optim::SGD>(model->parameters(),
                                                    torch::optim::SGDOptions(0.01).momentum(0.9));
  } else {
    throw std::invalid_argument("--optimizer: expected adam|sgd, got '" + a.optimizer + "'");
  }
  fsdp::Checkpointer checkpointer(*model, optimizer.get());

  int64_t step = 0;  // the next step to run
  if (!a.load.empty()) step = checkpointer.load(a.load) + 1;
  if (!a.ckpt_dir.empty()) {
    const int64_t resumed = checkpointer.resume(a.ckpt_dir);
    if (resumed >= 0) {
      step = resumed + 1;
      std::cout << "resumed from step " << resumed << std::endl;
    }
  }
  for (; step < a.steps; ++step) {
    torch::manual_seed(static_cast<uint64_t>((a.seed * 1000003 + rank) * 1000003 + step));
    torch::Tensor x = torch::randn({kRowsPerRank, 16});
    torch::Tensor y = x.sum(1, /*keepdim=*/true).sin();
    optimizer->zero_grad();
    torch::Tensor loss = torch::mse_loss(model->forward(x), y);
    loss.backward();
    optimizer->step();
    const double value = loss.item<double>();
    if (!std::isfinite(value))
      throw std::runtime_error("step " + std::to_string(step) + ": loss " + std::to_string(value));
    if (rank == 0) std::cout << "step " << step << " loss " << value << std::endl;
    if (a.ckpt_every > 0 && (step + 1) % a.ckpt_every == 0) {
      checkpointer.save_step(a.ckpt_dir, step);
    }
    if (a.step_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(a.step_ms));
  }
  if (!a.save.empty()) checkpointer.save(a.save, a.steps - 1);
  const auto params = fsdp::full_state_dict(*model, fsdp::StateDictOptions().rank0_only(true));
  if (rank == 0 && !a.out.empty()) save_params(params, a.out);
  pg->barrier().wait();
  std::cout << "rank " << rank << " done" << std::endl;
  return 0;
}

}  // namespace

int main(int argc, char** argv) try {
  const Args a = parse(argc, argv);
  if (a.gloo) {  // whether this build connects ranks over Gloo (LibTorch 1.13 builds)
    std::cout << fsdp::backend_available(fsdp::Backend::kC10dGloo) << std::endl;
    return 0;
  }
  return a.compare.empty() ? train(a) : compare(a);
} catch (const std::exception& e) {
  std::cerr << "cluster_train: " << fsdp::error_message(e) << std::endl;
  return 1;
}
