#pragma once

#include <torch/arg.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/archive.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>

#include <fsdp/comm/process_group.h>

namespace fsdp {

/// ShardedGradScaler's settings: PyTorch's GradScaler's names and defaults.
struct GradScalerOptions {
  /// The scale the first backward's loss is multiplied by.
  TORCH_ARG(double, init_scale) = 65536.0;
  /// What the scale is multiplied by after growth_interval steps in a row
  /// without an inf or NaN gradient (above 1).
  TORCH_ARG(double, growth_factor) = 2.0;
  /// What the scale is multiplied by after a step skipped for an inf or NaN
  /// gradient (between 0 and 1).
  TORCH_ARG(double, backoff_factor) = 0.5;
  /// Steps in a row without an inf or NaN gradient before the scale grows.
  TORCH_ARG(int64_t, growth_interval) = 2000;
  /// Off: scale() returns the loss as it is, step() always steps, update()
  /// does nothing (one code path for fp32 and fp16 runs).
  TORCH_ARG(bool, enabled) = true;
  /// The ranks whose gradients make one decision; null: the default group
  /// (fsdp::default_process_group()) where one is initialised, else this
  /// process alone, which unscale_() refuses while the process holds a
  /// group of several ranks (the model's, made with set_default(false)):
  /// pass that group. PyTorch's process_group.
  TORCH_ARG(std::shared_ptr<ProcessGroup>, process_group) = nullptr;
};

/// Dynamic loss scaling for float16 training of sharded models, PyTorch's
/// torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler (LibTorch has
/// no GradScaler). Multiplying the loss keeps small float16 gradients from
/// flushing to zero; unscale_() divides the gradients back and looks for inf
/// and NaN. Each rank sees only its own shards' gradients, so whether any is
/// non-finite is agreed over the group: every rank then skips the same steps
/// and keeps the same scale, where a check of this rank's gradients alone
/// would step on some ranks and skip on others (Note [One decision for every
/// rank] in src/optim/sharded_grad_scaler.cpp). The loop, as PyTorch's:
///
///   scaler.scale(loss).backward();
///   scaler.unscale_(optimizer);        // optional: before clipping
///   model->clip_grad_norm_(1.0);
///   scaler.step(optimizer);            // skipped if any rank found inf/NaN
///   scaler.update();
///
/// unscale_() (and step() where unscale_() was not called) is collective:
/// every rank of the group calls it, in the same order. torch::save(scaler,
/// ...) and torch::load(scaler, ...) keep the scale and its growth count.
class ShardedGradScaler {
 public:
  /// Checks the options when enabled (a one-line error names a wrong one).
  explicit ShardedGradScaler(GradScalerOptions options = {});

  /// `loss` times the current scale, in float32 at least (a float16 loss,
  /// per sample too, scales in float32, as torch.amp.GradScaler's does; PyTorch's
  /// ShardedGradScaler casts back to float16, where 65536 overflows); `loss`
  /// itself when disabled.
  torch::Tensor scale(const torch::Tensor& loss) const;

  /// Divides the gradients `optimizer` steps by the scale, in place, and
  /// agrees over the group whether any rank found inf or NaN (an error on one
  /// rank is an error on all, and the step is skipped). At most once per
  /// optimizer between update()s, before step(). Collective.
  void unscale_(torch::optim::Optimizer& optimizer);

  /// unscale_() where it was not called, then optimizer.step() unless some
  /// rank found inf or NaN in the gradients. Returns whether it stepped (the
  /// same on every rank). Once per optimizer between update()s.
  bool step(torch::optim::Optimizer& optimizer);

  /// Backs the scale off after a skipped step, grows it after growth_interval
  /// good steps in a row; then a new iteration may begin. Call it once per
  /// iteration, after every optimizer's step().
  void update();
  /// Sets the scale to `new_scale` instead (the growth count is kept).
  void update(double new_scale);

  /// The current scale (1.0 when disabled).
  double get_scale() const;
  /// Good steps since the scale last changed.
  int64_t growth_tracker() const;
  /// Whether the scaler scales (GradScalerOptions::enabled).
  bool is_enabled() const;
  /// The options it was made with.
  const GradScalerOptions& options() const;

  /// PyTorch's state_dict(): "scale", "growth_factor", "backoff_factor",
  /// "growth_interval", "_growth_tracker"; empty when disabled.
  std::map<std::string, double> state_dict() const;
  /// Restores what state_dict() returned (the scale becomes init_scale too,
  /// as in PyTorch); an error names a missing or wrong entry. A disabled
  /// scaler ignores it, as PyTorch's does.
  void load_state_dict(const std::map<std::string, double>& state);

  /// Writes state_dict() into `archive` (torch::save); a disabled scaler
  /// writes nothing.
  void save(torch::serialize::OutputArchive& archive) const;
  /// Reads what save() wrote (torch::load), as load_state_dict().
  void load(torch::serialize::InputArchive& archive);

 private:
  /// Where each optimizer is in the current iteration (PyTorch's OptState).
  enum class Stage : uint8_t { kReady, kUnscaled, kStepped };
  struct PerOptimizer {
    Stage stage = Stage::kReady;
    bool found_inf = false;  // agreed over the group; valid from kUnscaled on
  };

  /// Throws PyTorch's message where `call` may not move `state` to `next`.
  void check_transition(const PerOptimizer& state, Stage next, const char* call) const;
  ProcessGroup* group() const;
  int64_t rank() const;

  GradScalerOptions options_;
  float scale_;  // float32, as PyTorch keeps it, so a factor rounds alike
  int64_t growth_tracker_ = 0;
  std::unordered_map<const torch::optim::Optimizer*, PerOptimizer> per_optimizer_;
};

/// torch::save(scaler, ...): ShardedGradScaler::save.
torch::serialize::OutputArchive& operator<<(torch::serialize::OutputArchive& archive,
                                            const ShardedGradScaler& scaler);
/// torch::load(scaler, ...): ShardedGradScaler::load.
torch::serialize::InputArchive& operator>>(torch::serialize::InputArchive& archive,
                                           ShardedGradScaler& scaler);

}  // namespace fsdp
