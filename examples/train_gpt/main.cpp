// train_gpt: a character-level GPT trained with libfsdp, each transformer
// block an FSDP unit. The README's first command:
//   build/bin/fsdprun --nproc-per-node 2 build/bin/train_gpt
// `train_gpt --help` lists every flag. Files:
//   config.*       command line (CLI11)          corpus.*   text, vocabulary, split
//   batches.*      data-parallel batches          lr_schedule.h  warm-up + cosine
//   trainer.*      model, AdamW groups, step, eval, generation
//   progress.*     rank 0's bar / log lines, per-rank JSONL metrics
//   train_state.h  what a checkpoint saves besides model and optimizer
//                  (fsdp::Checkpointer: --checkpoint-dir, --checkpoint-every, --resume)

#include <ATen/Parallel.h>
#include <dlfcn.h>
#include <torch/torch.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <exception>
#include <iostream>
#include <memory>
#include <sstream>

#include <fsdp/fsdp.h>

#include "batches.h"
#include "config.h"
#include "corpus.h"
#include "lr_schedule.h"
#include "progress.h"
#include "train_state.h"
#include "trainer.h"

namespace train_gpt {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// at::set_num_threads does not reach OpenBLAS's own thread pool.
void set_blas_threads(int n) {
  using SetThreads = void (*)(int);
  if (auto fn = reinterpret_cast<SetThreads>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads")))
    fn(n);
}

int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v != nullptr ? std::atoi(v) : fallback;
}

// Messages before the process group exists: every rank checks the same
// arguments and files, so each fails alike (fsdprun then reports the rank).
int fail(const std::string& message) {
  std::cerr << "train_gpt: error: " << message << std::endl;
  return 1;
}

// True when `ok` holds on every rank (collective).
bool all_ranks_ok(fsdp::ProcessGroup& pg, bool ok) {
  at::Tensor flag = at::full({1}, ok ? 1.0 : 0.0, at::kFloat);
  pg.all_reduce(flag, fsdp::ReduceOp::kMin).wait();
  return flag.item<float>() > 0.5f;
}

std::vector<Batch> eval_batches(const Corpus& corpus, const TrainConfig& c, int rank, int world) {
  // A fixed held-out set: the same batches at every evaluation.
  const BatchSampler sampler(corpus.val, c.seq_len, c.batch_size, rank, world, c.seed + 1);
  std::vector<Batch> out;
  for (int64_t i = 0; i < c.eval_batches; ++i) out.push_back(sampler.batch(i));
  return out;
}

nlohmann::json config_json(const TrainConfig& c, const Corpus& corpus, const Trainer& trainer,
                           int world) {
  return {{"type", "config"},
          {"world", world},
          {"layers", c.n_layer},
          {"d_model", c.d_model},
          {"heads", c.n_head},
          {"seq_len", c.seq_len},
          {"batch_size", c.batch_size},
          {"steps", c.steps},
          {"lr", c.lr},
          {"sharding", fsdp::to_string(c.sharding)},
          {"bf16", c.bf16},
          {"cpu_offload", c.cpu_offload},
          {"optimizer", trainer.optimizer_name()},
          {"device", trainer.device().str()},
          {"cuda_backend", fsdp::rank_info().cuda_backend},
          {"data", corpus.source},
          {"chars", corpus.chars},
          {"vocab", corpus.vocab.size()},
          {"params", trainer.total_params()},
          {"seed", c.seed}};
}

// Stops the run when a step diverged (see Note [Stopping on divergence]).
void check_finite_step(int64_t step, const StepResult& r) {
  const bool norm_finite = !r.grad_norm || std::isfinite(*r.grad_norm);
  if (std::isfinite(r.loss) && norm_finite) return;
  std::ostringstream s;
  s << "step " << step << ": the loss is " << r.loss;
  if (r.grad_norm) s << " and the gradient norm " << *r.grad_norm;
  s << ": training diverged, stopping before this step is checkpointed. Lower --lr, raise "
       "--warmup-steps or --grad-clip, then --resume from the last checkpoint";
  throw std::runtime_error(s.str());
}

// The device --device names: the GPU LOCAL_RANK names (modulo the GPUs this
// process sees) for cuda, and for auto where there is one; nullopt for cuda
// without a GPU.
std::optional<torch::Device> resolve_device(DeviceChoice choice) {
  if (choice == DeviceChoice::kCpu || (choice == DeviceChoice::kAuto && !at::hasCUDA())) {
    return torch::kCPU;
  }
  return fsdp::local_gpu();
}

int train(const TrainConfig& c, const Corpus& corpus) {
  auto pg = fsdp::init_process_group(
      fsdp::ProcessGroupOptions().timeout(std::chrono::duration_cast<std::chrono::milliseconds>(
          std::chrono::duration<double>(c.timeout_s))));
  const int rank = pg->rank(), world = pg->size();
  if (c.batch_size % world != 0) {
    // The same on every rank: all stop here, before any collective.
    return fail("--batch-size " + std::to_string(c.batch_size) + " cannot be split evenly over " +
                std::to_string(world) + " ranks; use a multiple of " + std::to_string(world));
  }
  // The metrics directory can be writable on one node and not on another:
  // agree before the first collective of the model (see DESIGN.md's rules).
  std::unique_ptr<MetricsLog> metrics_file;
  std::string metrics_error;
  try {
    metrics_file = std::make_unique<MetricsLog>(c.metrics_dir, rank);
  } catch (const std::exception& e) {
    metrics_error = fsdp::error_message(e);
  }
  if (!all_ranks_ok(*pg, metrics_error.empty())) {
    return fail(metrics_error.empty() ? "another rank could not open its metrics file"
                                      : metrics_error);
  }
  MetricsLog& metrics = *metrics_file;
  ProgressDisplay progress(resolve_progress_mode(c.progress), rank == 0, c.log_interval);

  const std::optional<torch::Device> device = resolve_device(c.device);
  if (!device) {
    // The same on every rank of one machine: all stop before any collective.
    return fail(
        "--device cuda: this process sees no CUDA device (LibTorch finds no GPU, or this "
        "LibTorch is a CPU build); use --device cpu, or auto");
  }
  Trainer trainer(c, corpus, pg, *device);
  TrainState state;
  state.seed = c.seed;
  // The checkpoint holds the model, AdamW and `state` (see Note [Training state]).
  fsdp::Checkpointer checkpointer(*trainer.model().ptr(), &trainer.optimizer(),
                                  fsdp::CheckpointerOptions().keep_last(c.keep_last));
  checkpointer.register_state(
      "train_state", [&state] { return nlohmann::json(state).dump(); },
      [&state](const std::string& text) { state = nlohmann::json::parse(text).get<TrainState>(); });
  if (c.resume) {
    const int64_t step = checkpointer.resume(c.checkpoint_dir);
    if (step < 0) {
      progress.message("no checkpoint in " + c.checkpoint_dir + " yet; starting from step 0");
    } else {
      if (state.seed != c.seed) {
        return fail("the checkpoint in " + c.checkpoint_dir + " was made with --seed " +
                    std::to_string(state.seed) + ", not " + std::to_string(c.seed) +
                    "; pass the same --seed to resume (or another --checkpoint-dir)");
      }
      progress.message("resumed from " + fsdp::checkpoint_path(c.checkpoint_dir, step) +
                       " at step " + std::to_string(state.step));
    }
  }
  const BatchSampler sampler(corpus.train, c.seq_len, c.batch_size, rank, world, c.seed);
  const std::vector<Batch> held_out = eval_batches(corpus, c, rank, world);
  const LrSchedule schedule{c.lr, c.min_lr, c.warmup_steps, c.steps};
  const int64_t tokens_per_step = c.batch_size * c.seq_len;

  metrics.write(config_json(c, corpus, trainer, world));
  {
    std::ostringstream s;
    s << "train_gpt: " << corpus.source << " (" << corpus.chars << " chars, vocab "
      << corpus.vocab.size() << "), " << world << " rank(s), " << fsdp::to_string(c.sharding)
      << " on " << trainer.device()
      << (trainer.device().is_cuda() ? " (collectives: " + fsdp::rank_info().cuda_backend + ")"
                                     : "")
      << ", " << c.n_layer << " blocks as FSDP units, " << trainer.total_params() << " parameters ("
      << trainer.undecayed_params() << " without weight decay), global batch " << c.batch_size
      << " x " << c.seq_len << " tokens, " << trainer.optimizer_name();
    progress.message(s.str());
  }

  const auto run_start = Clock::now();
  double train_seconds = 0;  // excludes evaluation
  double ema_step_s = 0;     // recent seconds per step, for tokens/s and ETA
  double last_loss = 0;
  int64_t steps_this_run = 0;
  while (state.step < c.steps) {
    const double lr = schedule.at(state.step);
    const Batch batch = sampler.batch(state.batches_drawn++);
    const auto t0 = Clock::now();
    const StepResult r = trainer.train_step(batch, lr);
    const double dt = seconds_since(t0);
    ++state.step;
    state.tokens_seen += tokens_per_step;
    train_seconds += dt;
    ema_step_s = ++steps_this_run == 1 ? dt : 0.9 * ema_step_s + 0.1 * dt;
    last_loss = r.loss;
    // Note [Stopping on divergence]
    // NaN or infinity in the loss or the gradient norm never recovers: stop
    // at once, before the step's metrics and checkpoint. Both values are the
    // same on every rank (all-gathered, all-reduced), so every rank stops at
    // the same step, with no collective left waiting. A loss computed before
    // the update cannot see an update that poisoned the parameters, so a
    // save first checks them too (Trainer::parameters_finite). With
    // --step-during-backward there is no norm: a gradient that was not
    // finite shows in the next step's loss, or in that check.
    check_finite_step(state.step, r);

    StepReport report;
    report.step = state.step;
    report.total = c.steps;
    report.loss = r.loss;
    report.lr = lr;
    report.grad_norm = r.grad_norm;
    report.tokens_per_s = static_cast<double>(tokens_per_step) / ema_step_s;
    report.eta_s = ema_step_s * static_cast<double>(c.steps - state.step);
    report.peak_bytes = r.peak_bytes;
    progress.step(report);
    metrics.write({{"type", "train"},
                   {"step", state.step},
                   {"loss", r.loss},
                   {"local_loss", r.local_loss},
                   {"lr", lr},
                   {"grad_norm", r.grad_norm ? nlohmann::json(*r.grad_norm) : nullptr},
                   {"step_ms", dt * 1e3},
                   {"tokens_per_s", report.tokens_per_s},
                   {"tokens_seen", state.tokens_seen},
                   {"current_bytes", r.current_bytes[static_cast<size_t>(rank)]},
                   {"peak_bytes", r.peak_bytes[static_cast<size_t>(rank)]}});

    if (state.step % c.eval_interval == 0 || state.step == c.steps) {
      state.last_val_loss = trainer.evaluate(held_out);
      std::ostringstream s;
      s << "eval at step " << state.step << ": held-out loss " << state.last_val_loss << " (train "
        << r.loss << ")";
      progress.message(s.str());
      metrics.write({{"type", "eval"}, {"step", state.step}, {"val_loss", state.last_val_loss}});
    }
    if (!c.checkpoint_dir.empty() &&
        ((c.checkpoint_every > 0 && state.step % c.checkpoint_every == 0) ||
         state.step == c.steps)) {
      if (!trainer.parameters_finite()) {
        throw std::runtime_error("step " + std::to_string(state.step) +
                                 ": the parameters hold NaN or infinity after the optimizer step: "
                                 "training diverged, stopping before they are checkpointed. Lower "
                                 "--lr or --weight-decay, then --resume from the last checkpoint");
      }
      const auto t_save = Clock::now();
      const std::string dir =
          checkpointer.save_step(c.checkpoint_dir, state.step, c.checkpoint_type);
      const double save_s = seconds_since(t_save);
      progress.message("saved checkpoint " + dir + " (" + format_duration(save_s) + ")");
      metrics.write(
          {{"type", "checkpoint"}, {"step", state.step}, {"path", dir}, {"save_s", save_s}});
    }
    if (state.step == c.stop_after && state.step < c.steps) {
      progress.message("stopping after step " + std::to_string(state.step) +
                       " (--stop-after); continue with --resume");
      pg->barrier().wait();
      return 0;
    }
  }

  const double wall = seconds_since(run_start);
  std::string sample;
  if (c.sample_tokens > 0) {
    sample = trainer.generate(c.prompt, c.sample_tokens, c.temperature, c.seed);
  }
  const double tokens_per_s = static_cast<double>(state.tokens_seen) / train_seconds;
  nlohmann::json summary = {{"type", "summary"},
                            {"state", state},
                            {"train_loss", last_loss},
                            {"val_loss", state.last_val_loss},
                            {"wall_s", wall},
                            {"train_s", train_seconds},
                            {"tokens_per_s", tokens_per_s},
                            {"peak_bytes", fsdp::memory_stats().peak_bytes}};
  if (!sample.empty()) summary["sample"] = sample;
  metrics.write(summary);
  if (rank == 0) {
    std::ostringstream s;
    s << "done: " << state.step << " steps in " << format_duration(wall) << " ("
      << static_cast<int64_t>(tokens_per_s) << " tokens/s), final train loss " << last_loss
      << ", held-out loss " << state.last_val_loss;
    if (!metrics.path().empty()) s << "; metrics in " << c.metrics_dir << "/rank<R>.jsonl";
    std::cout << s.str() << "\n";
    if (!sample.empty()) {
      std::cout << "sample (temperature " << c.temperature << "):\n" << sample << "\n";
    }
    std::cout << std::flush;
  }
  pg->barrier().wait();
  return 0;
}

}  // namespace
}  // namespace train_gpt

int main(int argc, char** argv) {
  using namespace train_gpt;
  // Before any tensor exists, so the memory figures count the whole model.
  fsdp::enable_memory_tracking();
  // Steps cycle block-sized buffers; reuse them rather than fault them in
  // (FSDP's units turn the cache on too; this covers the unsharded mode).
  fsdp::enable_cpu_block_cache();
  TrainConfig config;
  if (auto code = parse_command_line(argc, argv, &config)) return *code;
  at::set_num_threads(config.threads);
  set_blas_threads(config.threads);

  Corpus corpus;
  try {
    corpus = load_corpus(config.data_path, config.corpus_chars, config.val_fraction, config.seq_len,
                         config.seed);
  } catch (const std::exception& e) {
    return fail(fsdp::error_message(e));
  }
  if (config.sample_tokens > 0) {
    if (config.prompt.empty())
      return fail("--prompt must not be empty (or pass --sample-tokens 0)");
    try {
      corpus.vocab.encode(config.prompt);
    } catch (const std::exception& e) {
      return fail(std::string("--prompt: ") + fsdp::error_message(e) +
                  "; use characters of the text");
    }
  }
  try {
    return train(config, corpus);
  } catch (const std::exception& e) {
    // A collective error or a bug: name the rank, since fsdprun interleaves output.
    std::cerr << "train_gpt [rank " << env_int("RANK", 0) << "]: " << fsdp::error_message(e)
              << std::endl;
    return 1;
  }
}
