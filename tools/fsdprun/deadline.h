#pragma once

// fsdprun's loops wait in poll() until a steady-clock deadline.

#include <algorithm>
#include <chrono>

namespace fsdp::launch {

/// Milliseconds from now until `deadline`, rounded up, at least 0 (a poll()
/// timeout).
inline int ms_until(std::chrono::steady_clock::time_point deadline) {
  const auto left = deadline - std::chrono::steady_clock::now();
  if (left <= std::chrono::steady_clock::duration::zero()) return 0;
  const auto ms = std::chrono::ceil<std::chrono::milliseconds>(left).count();
  return static_cast<int>(std::min<long long>(ms, 1 << 30));
}

}  // namespace fsdp::launch
