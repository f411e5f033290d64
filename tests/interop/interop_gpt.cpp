// The libfsdp side of the PyTorch interop tests (tests/interop/test_interop.py
// drives it under fsdprun). GPT-mini (examples/models/gpt_mini.h), every block
// an FSDP unit inside an FSDP root, FULL_SHARD:
//
//   interop_gpt save DIR [config]   saves the initial model to DIR/init,
//       trains --steps steps of --optim (adamw, rmsprop or adagrad; each rank
//       its own batches, written to DIR/data_rank<r>.safetensors as step<k>),
//       saves a full checkpoint to DIR/ckpt, then writes an eval batch (the
//       same on every rank) to DIR/batch.safetensors and the model's loss on
//       it to DIR/loss.txt (rank 0).
//   interop_gpt load CKPT BATCH OUT [config]   loads the checkpoint CKPT
//       (written by libfsdp or by PyTorch in its layout) and writes the loss
//       on the batch in BATCH (safetensors: "inputs", "targets", int64) to OUT.
//
// config: --vocab --block-size --d-model --heads --layers --steps --optim (the
// Python side passes the same values to its mirror, tests/interop/gpt_mini.py,
// and builds PyTorch's optimizer with the options of make_optimizer below).

#include <torch/torch.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <iterator>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <fsdp/fsdp.h>
#include "state/safetensors.h"  // libfsdp internals: src/ is on this target's include path

#include "gpt_mini.h"

namespace {

struct Args {
  std::string command;
  std::vector<std::string> paths;
  gpt_mini::GPTConfig config =
      gpt_mini::GPTConfig().vocab_size(64).block_size(16).d_model(32).n_head(4).n_layer(2);
  int steps = 3;
  std::string optim = "adamw";
};

[[noreturn]] void usage(const std::string& why) {
  std::cerr
      << "interop_gpt: " << why
      << "\nusage: interop_gpt save DIR | load CKPT BATCH OUT  [--vocab N] [--block-size N] "
         "[--d-model N] [--heads N] [--layers N] [--steps N] [--optim adamw|rmsprop|adagrad]\n";
  std::exit(2);
}

Args parse(int argc, char** argv) {
  Args a;
  if (argc < 2) usage("expected a command, got none");
  a.command = argv[1];
  for (int i = 2; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg.rfind("--", 0) != 0) {
      a.paths.push_back(arg);
      continue;
    }
    if (i + 1 == argc) usage("expected a value after " + arg);
    if (arg == "--optim") {
      a.optim = argv[++i];
      if (a.optim != "adamw" && a.optim != "rmsprop" && a.optim != "adagrad")
        usage("unknown optimizer '" + a.optim + "'");
      continue;
    }
    const int64_t v = std::stoll(argv[++i]);
    if (arg == "--vocab") {
      a.config.vocab_size(v);
    } else if (arg == "--block-size") {
      a.config.block_size(v);
    } else if (arg == "--d-model") {
      a.config.d_model(v);
    } else if (arg == "--heads") {
      a.config.n_head(v);
    } else if (arg == "--layers") {
      a.config.n_layer(v);
    } else if (arg == "--steps") {
      a.steps = static_cast<int>(v);
    } else {
      usage("unknown option " + arg);
    }
  }
  const size_t want = a.command == "save" ? 1 : a.command == "load" ? 3 : 0;
  if (want == 0) usage("unknown command '" + a.command + "'");
  if (a.paths.size() != want) usage("wrong number of paths for " + a.command);
  return a;
}

using Model = fsdp::FullyShardedDataParallel<gpt_mini::GPTImpl>;

Model build(const gpt_mini::GPTConfig& config) {
  const auto options = fsdp::FSDPOptions().sharding_strategy(fsdp::ShardingStrategy::kFullShard);
  return Model(std::make_shared<gpt_mini::GPTImpl>(config, options), options);
}

// The optimizer `name` with the options test_interop.py's PYTORCH_OPTIMIZERS
// gives PyTorch's: every state each keeps (RMSprop's momentum buffer and
// centred average; Adagrad's sum from a nonzero start).
std::unique_ptr<torch::optim::Optimizer> make_optimizer(const std::string& name,
                                                        const std::vector<at::Tensor>& params) {
  if (name == "rmsprop") {
    return std::make_unique<torch::optim::RMSprop>(
        params,
        torch::optim::RMSpropOptions(1e-3).eps(1e-4).momentum(0.9).centered(true).weight_decay(
            0.01));
  }
  if (name == "adagrad") {
    return std::make_unique<torch::optim::Adagrad>(params, torch::optim::AdagradOptions(1e-2)
                                                               .lr_decay(0.01)
                                                               .weight_decay(0.01)
                                                               .initial_accumulator_value(0.1));
  }
  return std::make_unique<torch::optim::AdamW>(params, torch::optim::AdamWOptions(1e-2).eps(1e-6));
}

// Int64 tensors written as one safetensors file.
void write_tensors(const std::string& path, const std::map<std::string, at::Tensor>& tensors) {
  std::vector<fsdp::detail::SafetensorsEntry> entries;
  std::vector<at::Tensor> data;
  for (const auto& kv : tensors) {
    TORCH_CHECK(kv.second.scalar_type() == at::kLong, "interop_gpt: ", kv.first, " is not int64");
    fsdp::detail::SafetensorsEntry e;
    e.name = kv.first;
    e.dtype = "I64";
    e.shape = kv.second.sizes().vec();
    entries.push_back(e);
    data.push_back(kv.second.contiguous());
  }
  const std::string header = fsdp::detail::encode_safetensors_header(entries);
  std::ofstream out(path, std::ios::binary);
  out.write(header.data(), static_cast<std::streamsize>(header.size()));
  for (const auto& t : data)
    out.write(static_cast<const char*>(t.data_ptr()), static_cast<std::streamsize>(t.nbytes()));
  TORCH_CHECK(out.good(), "interop_gpt: cannot write ", path);
}

// The int64 tensors of a safetensors file, by name.
std::map<std::string, at::Tensor> read_tensors(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  TORCH_CHECK(in.good(), "interop_gpt: cannot read ", path);
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const auto* data = reinterpret_cast<const unsigned char*>(bytes.data());
  const fsdp::detail::SafetensorsHeader header =
      fsdp::detail::parse_safetensors(data, bytes.size(), path);
  std::map<std::string, at::Tensor> out;
  for (const auto& e : header.entries) {
    TORCH_CHECK(e.dtype == "I64", "interop_gpt: ", path, ": ", e.name, " is ", e.dtype,
                ", expected I64");
    at::Tensor t = at::empty(e.shape, at::kLong);
    std::memcpy(t.data_ptr(), data + header.data_start + e.begin, e.end - e.begin);
    out[e.name] = t;
  }
  return out;
}

double eval_loss(Model& model, const at::Tensor& inputs, const at::Tensor& targets) {
  torch::NoGradGuard no_grad;
  return gpt_mini::lm_loss(model->forward(inputs), targets).item<double>();
}

void write_loss(const std::string& path, double loss) {
  std::FILE* f = std::fopen(path.c_str(), "w");
  TORCH_CHECK(f != nullptr, "interop_gpt: cannot write ", path);
  std::fprintf(f, "%.9g\n", loss);
  std::fclose(f);
}

}  // namespace

int main(int argc, char** argv) {
  const Args args = parse(argc, argv);
  auto pg = fsdp::init_process_group();
  torch::set_num_threads(1);
  const int rank = pg->rank();
  const auto& c = args.config;

  if (args.command == "save") {
    const std::string& dir = args.paths[0];
    torch::manual_seed(0);
    Model model = build(c);
    fsdp::Checkpointer(*model).save(dir + "/init", 0, fsdp::StateDictType::kFull);
    const auto opt = make_optimizer(args.optim, model->parameters());
    // Each rank its own data, as in data-parallel training.
    torch::manual_seed(100 + rank);
    std::map<std::string, at::Tensor> batches;
    for (int step = 0; step < args.steps; ++step) {
      at::Tensor data = torch::randint(c.vocab_size(), {4, c.block_size() + 1}, torch::kLong);
      batches["step" + std::to_string(step)] = data;
      opt->zero_grad();
      gpt_mini::lm_loss(model->forward(data.slice(1, 0, c.block_size())),
                        data.slice(1, 1, c.block_size() + 1))
          .backward();
      opt->step();
    }
    write_tensors(dir + "/data_rank" + std::to_string(rank) + ".safetensors", batches);
    fsdp::Checkpointer(*model, opt.get())
        .save(dir + "/ckpt", args.steps, fsdp::StateDictType::kFull);
    // The eval batch: the same on every rank.
    torch::manual_seed(7);
    at::Tensor data = torch::randint(c.vocab_size(), {3, c.block_size() + 1}, torch::kLong);
    at::Tensor inputs = data.slice(1, 0, c.block_size()).contiguous();
    at::Tensor targets = data.slice(1, 1, c.block_size() + 1).contiguous();
    const double loss = eval_loss(model, inputs, targets);
    if (rank == 0) {
      write_tensors(dir + "/batch.safetensors", {{"inputs", inputs}, {"targets", targets}});
      write_loss(dir + "/loss.txt", loss);
    }
  } else {
    // Other initial values than the checkpoint's, so that loading must replace them.
    torch::manual_seed(12345);
    Model model = build(c);
    const int64_t step = fsdp::Checkpointer(*model).load(args.paths[0]);
    const auto batch = read_tensors(args.paths[1]);
    TORCH_CHECK(batch.count("inputs") && batch.count("targets"), "interop_gpt: ", args.paths[1],
                " needs tensors 'inputs' and 'targets'");
    const double loss = eval_loss(model, batch.at("inputs"), batch.at("targets"));
    if (rank == 0) {
      write_loss(args.paths[2], loss);
      std::cout << "interop_gpt: loaded step " << step << ", loss " << loss << "\n";
    }
  }
  pg->barrier().wait();
  return 0;
}
