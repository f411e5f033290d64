#pragma once

// Everything a run needs, besides the model and optimizer, to continue where
// it stopped: the unit of a checkpoint.

#include <nlohmann/json.hpp>

#include <cstdint>
#include <limits>

namespace train_gpt {

/// Note [Training state]
/// The loop keeps its progress here and nowhere else, so a checkpoint
/// (issue 6) saves and restores exactly this struct next to the model and
/// optimizer state dicts: the step, the data position (batches are a pure
/// function of (seed, index), see Note [Deterministic batches], so the
/// position is the RNG state of the data), and the seed itself. Nothing else
/// in the run is random (no dropout; the sample at the end seeds its own
/// generator from `seed`).
struct TrainState {
  /// Optimizer steps taken; the next step has this index.
  int64_t step = 0;
  /// Training batches drawn so far (the sampler's next index).
  int64_t batches_drawn = 0;
  /// Training tokens seen by all ranks together.
  int64_t tokens_seen = 0;
  /// The run's seed (weights, batches, sample).
  uint64_t seed = 0;
  /// The last held-out loss (NaN before the first evaluation).
  double last_val_loss = std::numeric_limits<double>::quiet_NaN();
};

/// JSON of a TrainState (for the metrics file, and for checkpoints).
inline void to_json(nlohmann::json& j, const TrainState& s) {
  j = {{"step", s.step},
       {"batches_drawn", s.batches_drawn},
       {"tokens_seen", s.tokens_seen},
       {"seed", s.seed}};
}

/// Reads what to_json wrote.
inline void from_json(const nlohmann::json& j, TrainState& s) {
  j.at("step").get_to(s.step);
  j.at("batches_drawn").get_to(s.batches_drawn);
  j.at("tokens_seen").get_to(s.tokens_seen);
  j.at("seed").get_to(s.seed);
}

}  // namespace train_gpt
