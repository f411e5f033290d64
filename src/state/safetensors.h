#pragma once

// The safetensors format (https://github.com/huggingface/safetensors), read and
// written without LibTorch (see Note [Checkpoint errors without LibTorch]):
//   8 bytes: N, the header length, unsigned little-endian
//   N bytes: JSON {"name": {"dtype": "F32", "shape": [2, 3],
//              "data_offsets": [begin, end]}, ..., "__metadata__": {str: str}}
//   the data: every tensor's bytes, offsets relative to the end of the header.

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace fsdp::detail {

/// One tensor in a safetensors file.
struct SafetensorsEntry {
  std::string name;            ///< its key
  std::string dtype;           ///< "F32", "BF16", "I64", ... (see dtype_size())
  std::vector<int64_t> shape;  ///< its shape
  uint64_t begin = 0;          ///< first byte, relative to the data section
  uint64_t end = 0;            ///< one past the last byte
  /// Elements: the product of shape (1 for a scalar).
  int64_t numel() const;
};

/// A parsed, validated header.
struct SafetensorsHeader {
  std::vector<SafetensorsEntry> entries;        ///< in data order
  std::map<std::string, std::string> metadata;  ///< "__metadata__"
  uint64_t data_start = 0;                      ///< 8 + header length
  /// The entry named `name`, or nullptr.
  const SafetensorsEntry* find(const std::string& name) const;
};

/// Bytes per element of a safetensors dtype, 0 for an unknown one.
size_t dtype_size(const std::string& dtype);

/// Largest header accepted, so that a lying length is refused before allocating.
constexpr uint64_t kMaxSafetensorsHeader = 100u << 20;

/// Checks the 8-byte length prefix of a file of `file_size` bytes and returns
/// the header length; throws CheckpointError naming `file` if it cannot fit.
uint64_t check_header_length(const unsigned char prefix[8], uint64_t file_size,
                             const std::string& file);

/// Parses and validates the JSON header `json` (the N bytes after the prefix)
/// of a file of `file_size` bytes: known dtypes, non-negative shapes, each
/// tensor's byte size equal to numel * dtype size, offsets inside the file,
/// and the tensors covering the data section exactly, without overlap.
SafetensorsHeader parse_safetensors_header(const char* json, size_t size, uint64_t file_size,
                                           const std::string& file);

/// Parses a whole file held in memory (length prefix, header, and sizes).
SafetensorsHeader parse_safetensors(const unsigned char* data, size_t size,
                                    const std::string& file);

/// The length prefix and header (padded with spaces to a multiple of 8) for
/// tensors laid out back to back in the given order; sets each entry's
/// begin/end from its dtype and shape. The metadata defaults to
/// {"format": "pt"}, which Hugging Face's loaders read (transformers before
/// 4.48.2 fails on a file without it).
std::string encode_safetensors_header(std::vector<SafetensorsEntry>& entries,
                                      const std::map<std::string, std::string>& metadata = {
                                          {"format", "pt"}});

}  // namespace fsdp::detail
