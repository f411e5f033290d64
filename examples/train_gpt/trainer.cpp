#include "trainer.h"

#include <ATen/CPUGeneratorImpl.h>
#if FSDP_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

#include <set>

namespace train_gpt {
namespace {

gpt_mini::GPTConfig model_config(const TrainConfig& c, int64_t vocab) {
  return gpt_mini::GPTConfig()
      .vocab_size(vocab)
      .block_size(c.seq_len)
      .d_model(c.d_model)
      .n_head(c.n_head)
      .n_layer(c.n_layer);
}

// Names of the parameters that get no weight decay: biases and LayerNorm's
// weights (GPT-2's and nanoGPT's choice: decay only what multiplies inputs).
std::set<std::string> no_decay_names(torch::nn::Module& root) {
  std::set<std::string> names;
  for (const auto& item : root.named_modules(/*name_prefix=*/"", /*include_self=*/true)) {
    const std::string prefix = item.key().empty() ? "" : item.key() + ".";
    const bool layer_norm = item.value()->as<torch::nn::LayerNorm>() != nullptr;
    for (const auto& p : item.value()->named_parameters(/*recurse=*/false)) {
      if (layer_norm || p.key() == "bias") names.insert(prefix + p.key());
    }
  }
  return names;
}

}  // namespace

Trainer::Trainer(const TrainConfig& config, const Corpus& corpus,
                 std::shared_ptr<fsdp::ProcessGroup> pg, torch::Device device)
    : config_(config), corpus_(corpus), pg_(std::move(pg)), device_(device) {
  // use_orig_params: the optimizer sees one piece of the shard per original
  // parameter, with its name, so it can have parameter groups. device_id:
  // gpt_mini builds each block on the CPU and moves it there before wrapping.
  auto options = fsdp::FSDPOptions()
                     .process_group(pg_)
                     .sharding_strategy(config.sharding)
                     .forward_prefetch(true)
                     .use_orig_params(true)
                     .device_id(device);
  if (config.bf16) {
    // bf16 halves the all-gathered bytes; gradients are reduced in fp32 and
    // AdamW steps the fp32 shards (see Note [Mixed precision]).
    options.mixed_precision(
        fsdp::MixedPrecision().param_dtype(at::kBFloat16).reduce_dtype(at::kFloat));
  }
  if (config.cpu_offload) options.cpu_offload(fsdp::CPUOffload().offload_params(true));
  torch::manual_seed(config.seed);  // the same initial weights on every rank
  model_ = ShardedGPT(
      std::make_shared<gpt_mini::GPTImpl>(model_config(config, corpus.vocab.size()), options),
      options);
  build_optimizer();
  // A model that cannot train here fails now, on every rank, with the bytes
  // (Note [Memory plan]), not with an out-of-memory error in backward.
  fsdp::check_memory(*model_.ptr(), optimizer_.get());
}

void Trainer::build_optimizer() {
  const std::set<std::string> no_decay = no_decay_names(*model_.ptr());
  std::vector<at::Tensor> decay, plain;
  for (const auto& item : model_->named_flat_parameters()) {
    (no_decay.count(item.key()) ? plain : decay).push_back(item.value());
  }
  {
    // Sizes of the full parameters, for the log (the pieces are shards).
    fsdp::SummonFullParams full(*model_.ptr());
    for (const auto& p : model_->named_parameters()) {
      total_params_ += p.value().numel();
      (no_decay.count(p.key()) ? undecayed_ : decayed_) += p.value().numel();
    }
  }
  const auto base =
      torch::optim::AdamWOptions(config_.lr).betas(std::make_tuple(config_.beta1, config_.beta2));
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(decay,
                      std::make_unique<torch::optim::AdamWOptions>(
                          torch::optim::AdamWOptions(base).weight_decay(config_.weight_decay)));
  groups.emplace_back(plain, std::make_unique<torch::optim::AdamWOptions>(
                                 torch::optim::AdamWOptions(base).weight_decay(0.0)));
  if (!config_.cpu_offload) {
    optimizer_ = std::make_unique<torch::optim::AdamW>(std::move(groups), base);
    return;
  }
  // Host shards: libfsdp's fused AdamW (the same options, groups and state),
  // writing the bf16 copies each unshard sends to the GPU.
  auto fused = std::make_unique<fsdp::optim::FusedAdamW>(std::move(groups), base);
  fused->write_compute_copies(*model_.ptr());
  if (config_.step_during_backward) fused->step_during_backward(*model_.ptr());
  optimizer_ = std::move(fused);
}

std::string Trainer::optimizer_name() const {
  const auto* fused = dynamic_cast<const fsdp::optim::FusedAdamW*>(optimizer_.get());
  if (fused == nullptr) return "torch::optim::AdamW";
  return fused->steps_during_backward() ? "fsdp::optim::FusedAdamW, stepping during backward"
                                        : "fsdp::optim::FusedAdamW";
}

namespace {

// Memory held now and at most: on a GPU the CUDA caching allocator's
// statistics, on the CPU libfsdp's tracker.
std::pair<int64_t, int64_t> memory_on(const torch::Device& device) {
#if FSDP_WITH_CUDA
  if (device.is_cuda()) {
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device.index());
    return {stats.allocated_bytes[0].current, stats.allocated_bytes[0].peak};
  }
#endif
  const fsdp::MemoryStats mem = fsdp::memory_stats();
  return {mem.current_bytes, mem.peak_bytes};
}

}  // namespace

StepResult Trainer::train_step(const Batch& batch, double lr) {
  for (auto& group : optimizer_->param_groups()) group.options().set_lr(lr);
  optimizer_->zero_grad();
  at::Tensor loss =
      gpt_mini::lm_loss(model_->forward(batch.inputs.to(device_)), batch.targets.to(device_));
  loss.backward();
  StepResult out;
  if (!config_.step_during_backward) {
    // clip_grad_norm_ with an infinite bound only measures the norm.
    const double max_norm = config_.grad_clip > 0 ? config_.grad_clip : 1e30;
    out.grad_norm = model_->clip_grad_norm_(max_norm);
  }
  optimizer_->step();
  out.local_loss = loss.item<double>();

  // One all-gather brings every rank's loss and memory: the mean loss (summed
  // in rank order, so it is the same on every rank) and the memory display.
  const auto [current, peak] = memory_on(device_);
  const at::Tensor mine = at::tensor(
      {out.local_loss, static_cast<double>(current), static_cast<double>(peak)}, at::kDouble);
  at::Tensor all = at::empty({3 * pg_->size()}, at::kDouble);
  pg_->all_gather_into_tensor(all, mine).wait();
  const auto rows = all.view({pg_->size(), 3});
  for (int r = 0; r < pg_->size(); ++r) {
    out.loss += rows[r][0].item<double>() / pg_->size();
    out.current_bytes.push_back(static_cast<int64_t>(rows[r][1].item<double>()));
    out.peak_bytes.push_back(static_cast<int64_t>(rows[r][2].item<double>()));
  }
  return out;
}

bool Trainer::parameters_finite() {
  bool finite = true;
  for (const at::Tensor& p : model_->parameters()) {
    finite = finite && at::isfinite(p.detach()).all().item<bool>();
  }
  at::Tensor flag = at::full({1}, finite ? 1.0 : 0.0, at::kFloat);
  pg_->all_reduce(flag, fsdp::ReduceOp::kMin).wait();
  return flag.item<float>() > 0.5f;
}

double Trainer::evaluate(const std::vector<Batch>& batches) {
  torch::NoGradGuard no_grad;
  model_->eval();
  double sum = 0;
  for (const Batch& b : batches) {
    sum += gpt_mini::lm_loss(model_->forward(b.inputs.to(device_)), b.targets.to(device_))
               .item<double>();
  }
  model_->train();
  at::Tensor mean = at::full({1}, sum / static_cast<double>(batches.size()), at::kDouble);
  pg_->all_reduce(mean, fsdp::ReduceOp::kAvg).wait();
  return mean.item<double>();
}

std::string Trainer::generate(const std::string& prompt, int64_t n, double temperature,
                              uint64_t seed) {
  torch::NoGradGuard no_grad;
  model_->eval();
  std::vector<int64_t> ids = corpus_.vocab.encode(prompt);
  std::string text = prompt;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  for (int64_t i = 0; i < n; ++i) {
    const auto start = static_cast<int64_t>(ids.size()) > config_.seq_len
                           ? ids.size() - static_cast<size_t>(config_.seq_len)
                           : 0;
    const std::vector<int64_t> window(ids.begin() + static_cast<std::ptrdiff_t>(start), ids.end());
    const at::Tensor context = at::tensor(window, at::kLong).unsqueeze(0).to(device_);
    // The forward pass is collective: every rank runs it. Rank 0 draws on the
    // host, with the CPU generator, so a seed gives one text on any device.
    const at::Tensor logits = model_->forward(context)[0][-1].to(at::kCPU);
    // Rank 0 chooses; a broadcast keeps every rank's context identical.
    at::Tensor next = at::zeros({1}, at::kDouble);
    if (pg_->rank() == 0) {
      int64_t id = 0;
      if (temperature <= 0) {
        id = logits.argmax().item<int64_t>();
      } else {
        const at::Tensor probs = at::softmax(logits.to(at::kDouble) / temperature, 0);
        id = at::multinomial(probs, 1, /*replacement=*/false, gen).item<int64_t>();
      }
      next.fill_(static_cast<double>(id));
    }
    pg_->broadcast(next, /*root=*/0).wait();
    const auto id = static_cast<int64_t>(next.item<double>());
    ids.push_back(id);
    text += corpus_.vocab.decode(id);
  }
  model_->train();
  return text;
}

}  // namespace train_gpt
