#include "state/crc32.h"

#include <array>
#include <cstring>

namespace fsdp::detail {
namespace {

// Slicing-by-8 tables of the reflected polynomial 0xEDB88320: tables[0] is
// the byte-wise table, tables[k] a byte's effect k bytes further on. Eight
// bytes per step instead of one: a checkpoint is read whole to verify it,
// within the collective timeout, and byte by byte that ran at about 0.4
// GB/s.
using Tables = std::array<std::array<uint32_t, 256>, 8>;

Tables make_tables() {
  Tables t{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
    t[0][i] = c;
  }
  for (uint32_t i = 0; i < 256; ++i) {
    for (size_t k = 1; k < t.size(); ++k) t[k][i] = (t[k - 1][i] >> 8) ^ t[0][t[k - 1][i] & 0xFF];
  }
  return t;
}

}  // namespace

void Crc32::update(const void* data, size_t size) {
  static const Tables t = make_tables();
  const auto* p = static_cast<const unsigned char*>(data);
  uint32_t c = state_;
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
  for (; size >= 8; p += 8, size -= 8) {
    uint32_t lo = 0, hi = 0;
    std::memcpy(&lo, p, 4);
    std::memcpy(&hi, p + 4, 4);
    lo ^= c;
    c = t[7][lo & 0xFF] ^ t[6][(lo >> 8) & 0xFF] ^ t[5][(lo >> 16) & 0xFF] ^ t[4][lo >> 24] ^
        t[3][hi & 0xFF] ^ t[2][(hi >> 8) & 0xFF] ^ t[1][(hi >> 16) & 0xFF] ^ t[0][hi >> 24];
  }
#endif
  for (; size > 0; ++p, --size) c = t[0][(c ^ *p) & 0xFF] ^ (c >> 8);
  state_ = c;
}

uint32_t crc32(const void* data, size_t size) {
  Crc32 c;
  c.update(data, size);
  return c.value();
}

}  // namespace fsdp::detail
