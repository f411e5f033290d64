#pragma once

// Learning rate per step: linear warm-up, then a cosine decay to a floor
// (GPT-2 / nanoGPT's schedule).

#include <cmath>
#include <cstdint>

namespace train_gpt {

/// Learning rate of step `step` (0-based) of `total` steps.
struct LrSchedule {
  /// Peak rate, reached at the end of warm-up.
  double peak = 3e-3;
  /// Rate at the last step.
  double floor = 3e-4;
  /// Steps of linear warm-up from peak / warmup to peak.
  int64_t warmup = 0;
  /// All steps of the run.
  int64_t total = 1;

  /// The rate at `step`.
  double at(int64_t step) const {
    if (step < warmup) return peak * static_cast<double>(step + 1) / static_cast<double>(warmup);
    const int64_t decay_steps = total - warmup;
    if (decay_steps <= 1) return peak;
    const double progress =
        static_cast<double>(step - warmup) / static_cast<double>(decay_steps - 1);
    const double cosine = 0.5 * (1.0 + std::cos(M_PI * std::min(progress, 1.0)));
    return floor + (peak - floor) * cosine;
  }
};

}  // namespace train_gpt
