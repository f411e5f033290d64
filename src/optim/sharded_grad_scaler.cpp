#include <fsdp/optim/sharded_grad_scaler.h>

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <exception>
#include <string>
#include <utility>
#include <vector>

#include <fsdp/comm/init.h>
#include <fsdp/optim/fused.h>

#include "comm/agreement.h"
#include "detail/error.h"
#include "detail/torch_compat.h"
#include "optim/backward_steps.h"

// Note [One decision for every rank]
// A float16 step overflows in some gradient elements, not in all: the largest
// gradient of a backward passes float16's 65504 first. Sharded, that element
// lives in one rank's shard, so a check of this rank's gradients alone finds
// inf on one rank and nothing on the others: that rank skips the step, the
// others take it, and the shards of one model come from different
// trajectories (no error; and the scales drift apart too). So the flag is
// agreed: each rank checks its own gradients on their own devices, and one
// small all-reduce (max) over the group makes it the same everywhere, as
// PyTorch's ShardedGradScaler all-reduces its found_inf. The agreement reads
// the flags on the host once per optimizer and iteration; PyTorch's step()
// reads its flag there too, to decide whether to step.

namespace fsdp {

namespace {

const char* kWhere = "grad scaler";

// PyTorch's state_dict keys.
const char* const kStateKeys[] = {"scale", "growth_factor", "backoff_factor", "growth_interval",
                                  "_growth_tracker"};

// The settings' ranges, for the options (`saved` false: the fix names the
// option) and for a loaded state (the fix names the file).
void check_settings(const GradScalerOptions& o, int64_t rank, bool saved) {
  auto fix = [saved](const char* option) {
    return saved ? std::string("Load what an enabled scaler saved.")
                 : std::string("Use GradScalerOptions().") + option + ".";
  };
  const char* what = saved ? "the saved " : "";
  const auto scale = static_cast<float>(o.init_scale());
  FSDP_CHECK(std::isfinite(scale) && scale > 0, rank, kWhere, what, saved ? "scale" : "init_scale",
             " must be a positive float32 number, got ", o.init_scale(), ". ",
             fix("init_scale(65536.0)"));
  FSDP_CHECK(o.growth_factor() > 1.0 && std::isfinite(o.growth_factor()), rank, kWhere, what,
             "growth_factor must be above 1, got ", o.growth_factor(), ". ",
             fix("growth_factor(2.0)"));
  FSDP_CHECK(o.backoff_factor() > 0.0 && o.backoff_factor() < 1.0, rank, kWhere, what,
             "backoff_factor must be between 0 and 1, got ", o.backoff_factor(), ". ",
             fix("backoff_factor(0.5)"));
  FSDP_CHECK(o.growth_interval() > 0, rank, kWhere, what, "growth_interval must be positive, got ",
             o.growth_interval(), ". ", fix("growth_interval(2000)"));
}

// Each device's gradients together, for the AMP kernel (one device per call).
std::vector<std::pair<c10::Device, std::vector<at::Tensor>>> grads_by_device(
    torch::optim::Optimizer& optimizer, int64_t rank) {
  std::vector<std::pair<c10::Device, std::vector<at::Tensor>>> out;
  for (auto& group : optimizer.param_groups()) {
    for (auto& p : group.params()) {
      const at::Tensor& g = p.grad();
      if (!g.defined()) continue;
      FSDP_CHECK(!g.is_sparse(), rank, kWhere,
                 "a sparse gradient cannot be unscaled. Give the optimizer dense parameters "
                 "(torch::nn::EmbeddingOptions::sparse(false)).");
      FSDP_CHECK(at::isFloatingType(g.scalar_type()), rank, kWhere, "a gradient of dtype ",
                 g.scalar_type(),
                 " cannot be unscaled. Only floating-point parameters train under a scaler.");
      auto same = [&g](const auto& entry) { return entry.first == g.device(); };
      auto it = std::find_if(out.begin(), out.end(), same);
      if (it == out.end()) it = out.insert(out.end(), {g.device(), {}});
      it->second.push_back(g);
    }
  }
  return out;
}

// Unscales `optimizer`'s gradients, each device's in one call; whether this
// rank found inf or NaN.
bool unscale_grads(torch::optim::Optimizer& optimizer, float scale, int64_t rank) {
  // As PyTorch: the reciprocal in float64, rounded to float32.
  const float inv_scale = static_cast<float>(1.0 / static_cast<double>(scale));
  bool found = false;
  for (auto& [device, grads] : grads_by_device(optimizer, rank)) {
    const auto on_device = at::TensorOptions().dtype(at::kFloat).device(device);
    at::Tensor found_inf = at::zeros({1}, on_device);
    compat::unscale_and_check_(grads, found_inf, at::full({1}, inv_scale, on_device));
    found = found || found_inf.item<float>() != 0.0f;
  }
  return found;
}

// An optimizer that stepped during backward already stepped on the scaled,
// unchecked gradients: refused (the docs say so before it happens).
void refuse_steps_during_backward(torch::optim::Optimizer& optimizer, int64_t rank) {
  const char* name = nullptr;
  if (auto* adamw = dynamic_cast<optim::FusedAdamW*>(&optimizer)) {
    if (adamw->steps_during_backward()) name = "FusedAdamW";
  } else if (auto* sgd = dynamic_cast<optim::FusedSGD*>(&optimizer)) {
    if (sgd->steps_during_backward()) name = "FusedSGD";
  }
  FSDP_CHECK(name == nullptr, rank, kWhere, name,
             " steps during backward (step_during_backward), on gradients not yet unscaled or "
             "checked, so no step can be skipped. Leave step_during_backward off under a scaler.");
}

}  // namespace

ShardedGradScaler::ShardedGradScaler(GradScalerOptions options)
    : options_(std::move(options)), scale_(static_cast<float>(options_.init_scale())) {
  if (options_.enabled()) check_settings(options_, rank(), /*saved=*/false);
}

ProcessGroup* ShardedGradScaler::group() const {
  // Resolved at each use, so that a scaler made before init_process_group
  // still agrees over the default group.
  if (options_.process_group() != nullptr) return options_.process_group().get();
  return is_initialized() ? default_process_group().get() : nullptr;
}

int64_t ShardedGradScaler::rank() const { return detail::rank_or_none(group()); }

void ShardedGradScaler::check_transition(const PerOptimizer& state, Stage next,
                                         const char* call) const {
  if ((state.stage == Stage::kReady && next == Stage::kUnscaled) ||
      (state.stage == Stage::kUnscaled && next == Stage::kStepped)) {
    return;
  }
  // PyTorch's messages.
  const char* why = state.stage == Stage::kUnscaled
                        ? "unscale_() has already been called on this optimizer since the last "
                          "update()"
                    : next == Stage::kUnscaled ? "unscale_() is being called after step()"
                                               : "step() has already been called since the last "
                                                 "update()";
  FSDP_FAIL(rank(), kWhere, call, " refused: ", why,
            ". Call unscale_() and step() once per optimizer, then update(), every iteration.");
}

torch::Tensor ShardedGradScaler::scale(const torch::Tensor& loss) const {
  if (!options_.enabled()) return loss;
  // Refused here, before the backward: its units would be stepped on the
  // scaled gradients before unscale_() could refuse (a review found the
  // model stepped 65536x, or made NaN, by then).
  FSDP_CHECK(detail::backward_steps_attached() == 0, rank(), kWhere,
             "scale(): a FusedAdamW or FusedSGD of this process steps during backward "
             "(step_during_backward), on gradients not yet unscaled or checked, so no step could "
             "be skipped. Leave step_during_backward off under a scaler.");
  // In float32 at least: a float16 loss times a Scalar, or (with dimensions,
  // a loss per sample) times a 0-dim tensor, stays float16, where 65536 is
  // already inf. PyTorch's (1,)-shaped factor promotes both.
  const at::ScalarType dtype = at::promote_types(loss.scalar_type(), at::kFloat);
  return loss.to(dtype) * at::full({}, scale_, loss.options().dtype(dtype));
}

void ShardedGradScaler::unscale_(torch::optim::Optimizer& optimizer) {
  if (!options_.enabled()) return;
  const int64_t r = rank();
  // PyTorch's default is the world group, which FSDP's always has; here a
  // model on a group that is not the default (or with no default made)
  // would leave each rank to skip its steps alone, drifting apart silently.
  FSDP_CHECK(group() != nullptr || detail::multi_rank_groups_alive() == 0, r, kWhere,
             "unscale_(): the scaler has no process group (no default group was made, and none "
             "was given), but this process is in a group of several ranks: each rank would "
             "decide alone to skip a step, and the ranks would drift apart. Pass the model's "
             "group: GradScalerOptions().process_group(pg).");
  refuse_steps_during_backward(optimizer, r);
  PerOptimizer& state = per_optimizer_[&optimizer];
  check_transition(state, Stage::kUnscaled, "unscale_()");
  // A failure on this rank is agreed too, so that no other rank waits alone in
  // the all-reduce; either way the step is then skipped on every rank.
  bool found = false;
  std::exception_ptr error;
  try {
    found = unscale_grads(optimizer, scale_, r);
  } catch (...) {
    error = std::current_exception();
  }
  // Note [One decision for every rank].
  const std::vector<int64_t> agreed =
      detail::agree_reduce(group(), {found ? 1 : 0, error ? 1 : 0}, ReduceOp::kMax);
  state.stage = Stage::kUnscaled;
  state.found_inf = agreed[0] != 0 || agreed[1] != 0;
  if (error) std::rethrow_exception(error);
  FSDP_CHECK(agreed[1] == 0, r, kWhere,
             "unscale_() failed on another rank (its error says why). This iteration's step is "
             "skipped on every rank; fix that rank's error.");
}

bool ShardedGradScaler::step(torch::optim::Optimizer& optimizer) {
  if (!options_.enabled()) {
    optimizer.step();
    return true;
  }
  PerOptimizer& state = per_optimizer_[&optimizer];
  if (state.stage == Stage::kReady) unscale_(optimizer);
  check_transition(state, Stage::kStepped, "step()");
  state.stage = Stage::kStepped;
  if (state.found_inf) return false;
  optimizer.step();
  return true;
}

void ShardedGradScaler::update() {
  if (!options_.enabled()) return;
  bool checked = false, found_inf = false;
  for (const auto& entry : per_optimizer_) {
    if (entry.second.stage == Stage::kReady) continue;
    checked = true;
    found_inf = found_inf || entry.second.found_inf;
  }
  FSDP_CHECK(checked, rank(), kWhere,
             "update() found no gradient checked since the last update(). Call "
             "scaler.step(optimizer) after backward, then update().");
  // PyTorch's _amp_update_scale_: the product in float64, kept as float32; a
  // growth that would overflow float32 leaves the scale as it is.
  if (found_inf) {
    scale_ = static_cast<float>(scale_ * options_.backoff_factor());
    growth_tracker_ = 0;
  } else if (growth_tracker_ + 1 == options_.growth_interval()) {
    const auto grown = static_cast<float>(scale_ * options_.growth_factor());
    if (std::isfinite(grown)) scale_ = grown;
    growth_tracker_ = 0;
  } else {
    ++growth_tracker_;
  }
  per_optimizer_.clear();
}

void ShardedGradScaler::update(double new_scale) {
  if (!options_.enabled()) return;
  const auto value = static_cast<float>(new_scale);
  FSDP_CHECK(std::isfinite(value) && value > 0, rank(), kWhere,
             "update(new_scale) needs a positive float32 number, got ", new_scale,
             ". Pass the scale to use from now on, e.g. update(1024.0).");
  scale_ = value;
  per_optimizer_.clear();
}

double ShardedGradScaler::get_scale() const { return options_.enabled() ? scale_ : 1.0; }

int64_t ShardedGradScaler::growth_tracker() const { return growth_tracker_; }

bool ShardedGradScaler::is_enabled() const { return options_.enabled(); }

const GradScalerOptions& ShardedGradScaler::options() const { return options_; }

std::map<std::string, double> ShardedGradScaler::state_dict() const {
  if (!options_.enabled()) return {};
  return {{"scale", scale_},
          {"growth_factor", options_.growth_factor()},
          {"backoff_factor", options_.backoff_factor()},
          {"growth_interval", static_cast<double>(options_.growth_interval())},
          {"_growth_tracker", static_cast<double>(growth_tracker_)}};
}

void ShardedGradScaler::load_state_dict(const std::map<std::string, double>& state) {
  if (!options_.enabled()) return;  // as PyTorch: a disabled scaler keeps nothing
  const int64_t r = rank();
  FSDP_CHECK(!state.empty(), r, kWhere,
             "the saved state is empty (saved from a disabled scaler). Load what an enabled "
             "scaler saved, or start afresh.");
  for (const char* key : kStateKeys) {
    FSDP_CHECK(state.count(key) == 1, r, kWhere, "the saved state has no '", key,
               "'. Load what ShardedGradScaler::state_dict() or torch::save(scaler, ...) wrote.");
  }
  for (const char* key : {"growth_interval", "_growth_tracker"}) {
    const double value = state.at(key);
    FSDP_CHECK(value >= 0 && value < 9.0e15 && std::floor(value) == value, r, kWhere, "the saved ",
               key, " is ", value, ", not a count. Load what an enabled scaler saved.");
  }
  GradScalerOptions loaded = options_;
  // As PyTorch's load_state_dict, the loaded scale is also the initial one.
  loaded.init_scale(state.at("scale"))
      .growth_factor(state.at("growth_factor"))
      .backoff_factor(state.at("backoff_factor"))
      .growth_interval(static_cast<int64_t>(state.at("growth_interval")));
  check_settings(loaded, r, /*saved=*/true);
  const auto tracker = static_cast<int64_t>(state.at("_growth_tracker"));
  FSDP_CHECK(tracker < loaded.growth_interval(), r, kWhere, "the saved _growth_tracker ", tracker,
             " is not below growth_interval. Load what an enabled scaler saved.");
  options_ = loaded;
  scale_ = static_cast<float>(loaded.init_scale());
  growth_tracker_ = tracker;
  // What unscale_() and step() did this iteration stays, as in PyTorch's
  // load_state_dict: a step() after it does not unscale a second time.
}

void ShardedGradScaler::save(torch::serialize::OutputArchive& archive) const {
  for (const auto& [key, value] : state_dict())
    archive.write(key, at::full({}, value, at::kDouble));
}

void ShardedGradScaler::load(torch::serialize::InputArchive& archive) {
  std::map<std::string, double> state;
  for (const char* key : kStateKeys) {
    at::Tensor value;
    if (archive.try_read(key, value)) state[key] = value.item<double>();
  }
  load_state_dict(state);
}

torch::serialize::OutputArchive& operator<<(torch::serialize::OutputArchive& archive,
                                            const ShardedGradScaler& scaler) {
  scaler.save(archive);
  return archive;
}

torch::serialize::InputArchive& operator>>(torch::serialize::InputArchive& archive,
                                           ShardedGradScaler& scaler) {
  scaler.load(archive);
  return archive;
}

}  // namespace fsdp
