#pragma once

// Deliberate edits of a checkpoint's completion marker in tests: the edit is
// made and the marker's own checksum recomputed, as encode_marker does (see
// Note [Marker checksum]), so the edited marker passes its checksum.

#include <nlohmann/json.hpp>

#include <functional>
#include <string>

#include "state/crc32.h"
#include "state_test_util.h"

namespace fsdp::testing {

/// Applies `edit` to dir/COMPLETE and reseals it.
inline void reseal_marker(const std::string& dir,
                          const std::function<void(nlohmann::json&)>& edit) {
  auto j = nlohmann::json::parse(file_bytes(dir + "/COMPLETE"));
  edit(j);
  j.erase("crc32");
  const std::string canonical = j.dump(1);
  j["crc32"] = detail::crc32(canonical.data(), canonical.size());
  put_file_bytes(dir + "/COMPLETE", j.dump(1));
}

}  // namespace fsdp::testing
