#pragma once

#include <c10/util/Exception.h>

#include <functional>
#include <string>

namespace fsdp::testing {

/// The message of the c10::Error that `fn` throws ("" when it throws none).
inline std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "";
}

}  // namespace fsdp::testing

/// A gtest failure, showing `haystack`, unless it contains `needle` (the
/// including file includes <gtest/gtest.h>).
#define EXPECT_CONTAINS(haystack, needle) \
  EXPECT_NE(std::string(haystack).find(needle), std::string::npos) << (haystack)
