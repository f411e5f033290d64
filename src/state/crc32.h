#pragma once

#include <cstddef>
#include <cstdint>

namespace fsdp::detail {

/// Running CRC-32 (IEEE 802.3, the zlib/PNG polynomial), one per file.
class Crc32 {
 public:
  /// Adds `size` bytes.
  void update(const void* data, size_t size);
  /// The checksum of everything added so far.
  uint32_t value() const { return ~state_; }

 private:
  uint32_t state_ = 0xFFFFFFFFu;
};

/// The CRC-32 of one buffer.
uint32_t crc32(const void* data, size_t size);

}  // namespace fsdp::detail
