#pragma once

#include <cstdlib>
#include <cstring>

namespace fsdp::detail {

/// Whether libfsdp's switch `name` (an environment variable: FSDP_SIDE_STREAMS,
/// FSDP_COPY_IN_AT_STEP, ...) is on. Every switch is on by default and off
/// only when set to "0", so an A/B of a mechanism is one variable.
inline bool env_switch_on(const char* name) {
  const char* value = std::getenv(name);
  return value == nullptr || std::strcmp(value, "0") != 0;
}

}  // namespace fsdp::detail
