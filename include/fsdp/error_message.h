#pragma once

#include <c10/util/Exception.h>

#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>

namespace fsdp {

/// The message of `e` for printing or for embedding in another message. A
/// c10::Error's what() ends with a C++ backtrace ("Exception raised from ...",
/// then one "frame #N" line per frame); this drops it, unless the environment
/// has TORCH_SHOW_CPP_STACKTRACES=1, the variable with which PyTorch shows
/// those backtraces too (LibTorch's C++ what() always carries them).
inline std::string error_message(const std::exception& e) {
  const auto* error = dynamic_cast<const c10::Error*>(&e);
  if (error == nullptr) return e.what();
  const char* show = std::getenv("TORCH_SHOW_CPP_STACKTRACES");
  return show != nullptr && std::strcmp(show, "1") == 0 ? error->what()
                                                        : error->what_without_backtrace();
}

}  // namespace fsdp
