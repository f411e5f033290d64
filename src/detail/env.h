#pragma once

#include <c10/util/Optional.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

namespace fsdp::detail {

/// Whether libfsdp's switch `name` (an environment variable: FSDP_SIDE_STREAMS,
/// FSDP_COPY_IN_AT_STEP, ...) is on. Every switch is on by default and off
/// only when set to "0", so an A/B of a mechanism is one variable.
inline bool env_switch_on(const char* name) {
  const char* value = std::getenv(name);
  return value == nullptr || std::strcmp(value, "0") != 0;
}

/// Test-only fault hooks addressed to one rank, "<rank>:<value>" (such as
/// FSDP_FAULT_STATE_DICT_COPY=1:3): the value where the variable `name`
/// addresses `rank`, else nullopt.
inline c10::optional<int64_t> rank_fault(const char* name, int64_t rank) {
  const char* env = std::getenv(name);
  if (env == nullptr) return c10::nullopt;
  const std::string spec(env);
  const size_t colon = spec.find(':');
  if (colon == std::string::npos || std::stoll(spec.substr(0, colon)) != rank) return c10::nullopt;
  return std::stoll(spec.substr(colon + 1));
}

}  // namespace fsdp::detail
