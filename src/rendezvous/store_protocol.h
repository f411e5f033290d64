#pragma once

// Wire format of TcpStore. A message is a u32 byte length followed by that
// many bytes: a request starts with a StoreCommand byte, a reply with a
// StoreStatus byte; strings and byte vectors are u32-length-prefixed, integers
// are little-endian 64-bit. Both ends run on the same build, so no versioning.

#include <c10/util/Exception.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "detail/error.h"

namespace fsdp::detail {

/// Requests understood by the store server.
enum class StoreCommand : uint8_t {
  kSet,
  kCompareSet,
  kGet,
  kAdd,
  kDelete,
  kCheck,
  kNumKeys,
  kWait
};

/// First byte of every reply.
enum class StoreStatus : uint8_t { kOk, kTimeout, kBadRequest };

/// Largest message either side accepts; guards against a stray client.
constexpr uint32_t kMaxStoreMessage = 1u << 30;

/// Appends fields to a message.
class MessageWriter {
 public:
  /// Appends one byte.
  MessageWriter& u8(uint8_t v) {
    bytes_.push_back(v);
    return *this;
  }
  /// Appends a 64-bit integer.
  MessageWriter& i64(int64_t v) {
    const auto* p = reinterpret_cast<const uint8_t*>(&v);
    bytes_.insert(bytes_.end(), p, p + sizeof(v));
    return *this;
  }
  /// Appends a length-prefixed byte string.
  MessageWriter& bytes(const void* data, size_t n) {
    const auto len = static_cast<uint32_t>(n);
    const auto* lp = reinterpret_cast<const uint8_t*>(&len);
    bytes_.insert(bytes_.end(), lp, lp + sizeof(len));
    const auto* p = static_cast<const uint8_t*>(data);
    bytes_.insert(bytes_.end(), p, p + n);
    return *this;
  }
  /// Appends a string.
  MessageWriter& str(const std::string& s) { return bytes(s.data(), s.size()); }
  /// Appends a byte vector.
  MessageWriter& vec(const std::vector<uint8_t>& v) { return bytes(v.data(), v.size()); }
  /// The message so far.
  std::vector<uint8_t>& get() { return bytes_; }

 private:
  std::vector<uint8_t> bytes_;
};

/// Reads fields of a message in order; throws on a short message.
class MessageReader {
 public:
  explicit MessageReader(const std::vector<uint8_t>& bytes) : bytes_(bytes) {}
  /// Reads one byte.
  uint8_t u8() {
    need(1);
    return bytes_[pos_++];
  }
  /// Reads a 64-bit integer.
  int64_t i64() {
    int64_t v = 0;
    need(sizeof(v));
    std::memcpy(&v, bytes_.data() + pos_, sizeof(v));
    pos_ += sizeof(v);
    return v;
  }
  /// Reads a length-prefixed byte vector.
  std::vector<uint8_t> vec() {
    uint32_t len = 0;
    need(sizeof(len));
    std::memcpy(&len, bytes_.data() + pos_, sizeof(len));
    pos_ += sizeof(len);
    need(len);
    std::vector<uint8_t> out(bytes_.begin() + pos_, bytes_.begin() + pos_ + len);
    pos_ += len;
    return out;
  }
  /// Reads a length-prefixed string.
  std::string str() {
    auto v = vec();
    return std::string(v.begin(), v.end());
  }

 private:
  void need(size_t n) const {
    FSDP_CHECK(pos_ + n <= bytes_.size(), -1, "tcp store", "malformed message (needs ", n,
               " bytes at offset ", pos_, " of ", bytes_.size(), ")");
  }
  const std::vector<uint8_t>& bytes_;
  size_t pos_ = 0;
};

}  // namespace fsdp::detail
