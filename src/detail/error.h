#pragma once

#include <c10/util/Exception.h>

#include <cstdint>
#include <cstdlib>
#include <string>

namespace fsdp::detail {

// Note [Error messages]
// Every error libfsdp raises reads
//   [rank R] fsdp(<where>): <what went wrong>. <how to fix it>
// where <where> is the module path of the unit concerned ("" for the root,
// shown as "root"), or else the component ("checkpoint", "tcp store",
// "process group"). One prefix lets a user grep a multi-rank log and tells
// at once which rank and which part of the model failed. The rank is the
// process group's where one is known; else the launcher's RANK; else it is
// left out. Raise them with FSDP_CHECK / FSDP_FAIL below.

/// The rank the launcher gave this process (RANK), or -1 when none was given.
inline int64_t launcher_rank() {
  static const int64_t rank = [] {
    const char* env = std::getenv("RANK");
    if (env == nullptr || *env == '\0') return int64_t{-1};
    char* end = nullptr;
    const long long value = std::strtoll(env, &end, 10);
    return *end == '\0' && value >= 0 ? static_cast<int64_t>(value) : int64_t{-1};
  }();
  return rank;
}

/// "[rank R] fsdp(<where>): " (see Note [Error messages]); rank < 0 falls
/// back to the launcher's rank, and is left out if that is unknown too.
inline std::string error_prefix(int64_t rank, const std::string& where) {
  if (rank < 0) rank = launcher_rank();
  std::string out;
  if (rank >= 0) out = "[rank " + std::to_string(rank) + "] ";
  out += "fsdp(";
  out += where.empty() ? std::string("root") : where;
  out += "): ";
  return out;
}

}  // namespace fsdp::detail

/// Checks `cond`; else throws c10::Error "[rank R] fsdp(<where>): <message>".
#define FSDP_CHECK(cond, rank, where, ...) \
  TORCH_CHECK((cond), ::fsdp::detail::error_prefix((rank), (where)), __VA_ARGS__)

/// Throws c10::Error "[rank R] fsdp(<where>): <message>".
#define FSDP_FAIL(rank, where, ...) \
  TORCH_CHECK(false, ::fsdp::detail::error_prefix((rank), (where)), __VA_ARGS__)
