#pragma once

// Saving and loading a whole training state to a checkpoint directory: the
// model, the optimizer, the step, every rank's RNG state and whatever the
// training loop registers. See Note [Checkpoint directory].

#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>

#include <fsdp/comm/process_group.h>
#include <fsdp/state/checkpoint_dir.h>
#include <fsdp/state/error.h>

namespace fsdp {

/// How tensors are laid out on disk.
enum class StateDictType {
  /// Rank 0 writes whole tensors (model.safetensors, optim.safetensors),
  /// gathered one unit at a time; readable by any safetensors reader.
  kFull,
  /// Every rank writes its own shards (model-rank<R>.safetensors, ...);
  /// no communication besides two barriers.
  kSharded,
};

/// The name of a state dict type, for messages ("full", "sharded").
const char* to_string(StateDictType type);

/// Options of a Checkpointer.
struct CheckpointerOptions {
  /// save_step() keeps the newest `keep_last` complete checkpoints under its
  /// parent and removes the older ones, never the one it just wrote nor the
  /// one resume() loaded; 0 keeps them all.
  TORCH_ARG(int64_t, keep_last) = 0;
};

/// Saves and restores a training job's state. Both are collective: every rank
/// calls them with the same arguments. Loading accepts a checkpoint of either
/// type saved at any world size (resharding from the files, no communication).
///
///   fsdp::Checkpointer ckpt(*model, &optimizer);
///   ckpt.register_state("data", [&] { return std::to_string(pos); },
///                       [&](const std::string& s) { pos = std::stoll(s); });
///   int64_t step = ckpt.resume("ckpts");   // -1: nothing to resume from
///   for (++step; step < steps; ++step) {
///     ...train...
///     if (step % 100 == 0) ckpt.save_step("ckpts", step);
///   }
class Checkpointer {
 public:
  /// `model` is the FSDP root (or any module); `optimizer` may be null.
  explicit Checkpointer(torch::nn::Module& model, torch::optim::Optimizer* optimizer = nullptr,
                        CheckpointerOptions options = {});

  /// Registers per-rank state of the training loop (e.g. the data position):
  /// `save` returns it as text when saving, `load` receives it when loading.
  void register_state(const std::string& name, std::function<std::string()> save,
                      std::function<void(const std::string&)> load);

  /// Writes the checkpoint to `dir` (created if needed; an old checkpoint
  /// there is invalidated first). Returns once the completion marker is
  /// durable on every rank.
  void save(const std::string& dir, int64_t step, StateDictType type = StateDictType::kSharded);
  /// save() into checkpoint_path(parent, step); returns that path. Then rank
  /// 0 removes what interrupted saves left under `parent` (torn step
  /// directories, temporary files) and the checkpoints beyond keep_last; if
  /// the save fails, the directory it was writing. `parent` must belong to
  /// this job alone.
  std::string save_step(const std::string& parent, int64_t step,
                        StateDictType type = StateDictType::kSharded);

  /// Loads `dir` (after verifying all of it) into the model, the optimizer,
  /// this rank's RNG and the registered state; returns the saved step.
  /// Throws CheckpointError for an incomplete or damaged checkpoint, on every
  /// rank when any rank fails (see Note [Collective load]).
  int64_t load(const std::string& dir);
  /// Loads the newest complete checkpoint under `parent` that verifies, as
  /// rank 0 sees it, and returns its step; returns -1 and changes nothing
  /// when there is none. Rank 0 warns about each newer one it skipped and
  /// why, and removes what interrupted saves left and the checkpoints beyond
  /// keep_last, as save_step does (never the one loaded). Throws
  /// on every rank when checkpoints exist but none verifies.
  int64_t resume(const std::string& parent);

 private:
  int64_t load_verified(const std::string& dir, std::unique_ptr<CheckpointReader> reader);
  void apply(const CheckpointReader& reader, ProcessGroup* group);

  struct Registered {
    std::function<std::string()> save;
    std::function<void(const std::string&)> load;
  };
  torch::nn::Module& model_;
  torch::optim::Optimizer* optimizer_;
  CheckpointerOptions options_;
  std::map<std::string, Registered> registered_;
  /// The directory resume() loaded (retention keeps it); "" before.
  std::string resumed_from_;
};

}  // namespace fsdp
