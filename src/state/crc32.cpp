#include "state/crc32.h"

#include <array>

namespace fsdp::detail {
namespace {

// The byte-wise table of the reflected polynomial 0xEDB88320.
std::array<uint32_t, 256> make_table() {
  std::array<uint32_t, 256> table{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
    table[i] = c;
  }
  return table;
}

}  // namespace

void Crc32::update(const void* data, size_t size) {
  static const std::array<uint32_t, 256> table = make_table();
  const auto* p = static_cast<const unsigned char*>(data);
  uint32_t c = state_;
  for (size_t i = 0; i < size; ++i) c = table[(c ^ p[i]) & 0xFF] ^ (c >> 8);
  state_ = c;
}

uint32_t crc32(const void* data, size_t size) {
  Crc32 c;
  c.update(data, size);
  return c.value();
}

}  // namespace fsdp::detail
