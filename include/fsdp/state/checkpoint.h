#pragma once

// Saving and loading a whole training state to a checkpoint directory: the
// model, the optimizer, the step, every rank's RNG state and whatever the
// training loop registers. See Note [Checkpoint directory].

#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include <fsdp/state/error.h>

namespace fsdp {

class ShardedGradScaler;  // <fsdp/optim/sharded_grad_scaler.h>

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

/// "parent/step-<step>", the step zero-padded to 10 digits so that names sort
/// by step: where Checkpointer::save_step() saves and resume() looks.
std::string checkpoint_path(const std::string& parent, int64_t step);

/// The complete checkpoint directory under `parent` saved last (directories
/// named as checkpoint_path() names them, "step-<10 digits>", that hold a
/// completion marker; the one of the highest step unless a run was rolled
/// back to an earlier step), or "" if none. Nothing is verified.
std::string latest_checkpoint(const std::string& parent);

/// Verifies the checkpoint `dir` without loading it: the completion marker
/// (its own checksum, and that its step is the manifests' and, for a
/// "step-<N>" directory, N), every manifest and every data file (size,
/// CRC-32, header, and every piece a manifest lists). Throws CheckpointError
/// naming the file and the problem if it is incomplete or damaged; a file
/// that is not a regular file (a FIFO, a device) is refused, never waited on.
void verify_checkpoint(const std::string& dir);

/// Options of a Checkpointer.
struct CheckpointerOptions {
  /// save_step() keeps the `keep_last` complete checkpoints under its parent
  /// saved last and removes the others, never the one it just wrote nor the
  /// one resume() loaded, nor those of later steps than it writes (a run
  /// rolled back to an earlier step); 0 keeps them all.
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
  ~Checkpointer();
  /// Movable; a moved-from Checkpointer may only be destroyed or assigned to.
  Checkpointer(Checkpointer&&) noexcept;
  Checkpointer& operator=(Checkpointer&&) noexcept;

  /// Registers per-rank state of the training loop (e.g. the data position):
  /// `save` returns it as text when saving, `load` receives it when loading.
  void register_state(const std::string& name, std::function<std::string()> save,
                      std::function<void(const std::string&)> load);
  /// Registers a ShardedGradScaler's scale and growth count (the same on
  /// every rank) under `name`, as text: what PyTorch users keep of
  /// scaler.state_dict() in their checkpoints.
  void register_state(const std::string& name, ShardedGradScaler& scaler);

  /// Writes the checkpoint to `dir` (created if needed; an old checkpoint
  /// there is invalidated first). Returns once the completion marker is
  /// durable on every rank.
  void save(const std::string& dir, int64_t step, StateDictType type = StateDictType::kSharded);
  /// save() into checkpoint_path(parent, step), written beside it and put in
  /// place once complete, so that a failed save leaves a checkpoint already
  /// there for that step whole; returns that path. Then rank 0 removes what
  /// interrupted saves left under `parent` (torn step directories, temporary
  /// files) and the checkpoints beyond keep_last; if the save fails, what it
  /// was writing. `parent` must belong to this job alone.
  std::string save_step(const std::string& parent, int64_t step,
                        StateDictType type = StateDictType::kSharded);

  /// Loads `dir` (after verifying all of it) into the model, the optimizer,
  /// this rank's RNG and the registered state; returns the saved step.
  /// Throws CheckpointError for an incomplete or damaged checkpoint, on every
  /// rank when any rank fails (see Note [Collective load]).
  int64_t load(const std::string& dir);
  /// Loads the complete checkpoint under `parent` saved last that verifies
  /// (the highest step, unless a run was rolled back), as rank 0 sees it,
  /// and returns its step; returns -1 and changes nothing when there is
  /// none. Rank 0 warns about each newer one it skipped and why, and removes
  /// what interrupted saves left and the checkpoints beyond keep_last, as
  /// save_step does (never the one loaded). Throws on every rank when
  /// checkpoints exist but none verifies.
  int64_t resume(const std::string& parent);

 private:
  /// The model, the optimizer, the options, the registered state and the
  /// directory resume() loaded (src/state/checkpoint.cpp), so that the
  /// checkpoint reader and the other internals stay out of this header.
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace fsdp
