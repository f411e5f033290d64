#include "state/safetensors.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstring>

#include <fsdp/state/error.h>

namespace fsdp::detail {
namespace {

using nlohmann::json;

// Largest element count or byte size accepted: keeps every product and sum
// below 2^63, so the size checks themselves cannot overflow.
constexpr uint64_t kMaxBytes = uint64_t{1} << 56;

std::vector<int64_t> parse_shape(const json& j, const std::string& file, const std::string& name,
                                 size_t elem_size) {
  if (!j.is_array()) throw CheckpointError(file, "tensor '" + name + "': shape is not an array");
  std::vector<int64_t> shape;
  uint64_t numel = 1;
  for (const auto& d : j) {
    if (!d.is_number_unsigned()) {
      throw CheckpointError(file, "tensor '" + name + "': shape entry " + d.dump() +
                                      " is not a non-negative integer");
    }
    const uint64_t v = d.get<uint64_t>();
    if (v > kMaxBytes || (v != 0 && numel > kMaxBytes / v)) {
      throw CheckpointError(file, "tensor '" + name + "': shape " + j.dump() + " is too large");
    }
    numel *= v;
    shape.push_back(static_cast<int64_t>(v));
  }
  if (numel > kMaxBytes / elem_size) {
    throw CheckpointError(file, "tensor '" + name + "': shape " + j.dump() + " is too large");
  }
  return shape;
}

SafetensorsEntry parse_entry(const std::string& name, const json& j, const std::string& file) {
  if (!j.is_object()) throw CheckpointError(file, "tensor '" + name + "' is not a JSON object");
  SafetensorsEntry e;
  e.name = name;
  const auto dt = j.find("dtype");
  if (dt == j.end() || !dt->is_string())
    throw CheckpointError(file, "tensor '" + name + "' has no dtype string");
  e.dtype = dt->get<std::string>();
  const size_t elem = dtype_size(e.dtype);
  if (elem == 0) throw CheckpointError(file, "tensor '" + name + "': unknown dtype " + e.dtype);
  const auto shape = j.find("shape");
  if (shape == j.end()) throw CheckpointError(file, "tensor '" + name + "' has no shape");
  e.shape = parse_shape(*shape, file, name, elem);
  const auto off = j.find("data_offsets");
  if (off == j.end() || !off->is_array() || off->size() != 2 || !(*off)[0].is_number_unsigned() ||
      !(*off)[1].is_number_unsigned()) {
    throw CheckpointError(file, "tensor '" + name + "': data_offsets must be [begin, end]");
  }
  e.begin = (*off)[0].get<uint64_t>();
  e.end = (*off)[1].get<uint64_t>();
  const uint64_t want = static_cast<uint64_t>(e.numel()) * elem;
  if (e.end < e.begin || e.end - e.begin != want) {
    throw CheckpointError(file, "tensor '" + name + "': data_offsets [" + std::to_string(e.begin) +
                                    ", " + std::to_string(e.end) + "] hold " +
                                    std::to_string(e.end >= e.begin ? e.end - e.begin : 0) +
                                    " bytes, but dtype " + e.dtype + " and its shape need " +
                                    std::to_string(want));
  }
  return e;
}

}  // namespace

int64_t SafetensorsEntry::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

const SafetensorsEntry* SafetensorsHeader::find(const std::string& name) const {
  for (const auto& e : entries) {
    if (e.name == name) return &e;
  }
  return nullptr;
}

size_t dtype_size(const std::string& dtype) {
  static const std::map<std::string, size_t> sizes = {
      {"F64", 8}, {"F32", 4}, {"F16", 2},  {"BF16", 2}, {"I64", 8}, {"I32", 4}, {"I16", 2},
      {"I8", 1},  {"U8", 1},  {"BOOL", 1}, {"U16", 2},  {"U32", 4}, {"U64", 8}};
  const auto it = sizes.find(dtype);
  return it == sizes.end() ? 0 : it->second;
}

uint64_t check_header_length(const unsigned char prefix[8], uint64_t file_size,
                             const std::string& file) {
  if (file_size < 8) {
    throw CheckpointError(file, "truncated: " + std::to_string(file_size) +
                                    " bytes, shorter than the 8-byte header length");
  }
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | prefix[i];
  if (n > kMaxSafetensorsHeader || n > file_size - 8) {
    throw CheckpointError(file, "header length " + std::to_string(n) +
                                    " does not fit in a file of " + std::to_string(file_size) +
                                    " bytes (truncated or corrupted)");
  }
  return n;
}

SafetensorsHeader parse_safetensors_header(const char* text, size_t size, uint64_t file_size,
                                           const std::string& file) {
  json j;
  try {
    j = json::parse(text, text + size);
  } catch (const json::exception& e) {
    throw CheckpointError(file, std::string("header is not valid JSON: ") + e.what());
  }
  if (!j.is_object()) throw CheckpointError(file, "header is not a JSON object");
  SafetensorsHeader h;
  h.data_start = 8 + size;
  for (auto it = j.begin(); it != j.end(); ++it) {
    if (it.key() == "__metadata__") {
      if (!it->is_object()) throw CheckpointError(file, "__metadata__ is not an object");
      for (auto m = it->begin(); m != it->end(); ++m) {
        if (!m->is_string()) throw CheckpointError(file, "__metadata__ values must be strings");
        h.metadata[m.key()] = m->get<std::string>();
      }
      continue;
    }
    h.entries.push_back(parse_entry(it.key(), *it, file));
  }
  std::sort(h.entries.begin(), h.entries.end(), [](const auto& a, const auto& b) {
    return a.begin < b.begin || (a.begin == b.begin && a.end < b.end);
  });
  // The tensors must tile the data section: no gap, no overlap, nothing past the end.
  const uint64_t data_size = file_size - h.data_start;
  uint64_t at = 0;
  for (const auto& e : h.entries) {
    if (e.begin != at) {
      throw CheckpointError(file, "tensor '" + e.name + "' starts at byte " +
                                      std::to_string(e.begin) + " of the data, expected " +
                                      std::to_string(at) + " (overlap or gap)");
    }
    at = e.end;
  }
  if (at != data_size) {
    throw CheckpointError(file, "the header describes " + std::to_string(at) +
                                    " bytes of data, the file holds " + std::to_string(data_size) +
                                    " (truncated or corrupted)");
  }
  return h;
}

SafetensorsHeader parse_safetensors(const unsigned char* data, size_t size,
                                    const std::string& file) {
  const uint64_t n = check_header_length(data, size, file);
  return parse_safetensors_header(reinterpret_cast<const char*>(data) + 8, n, size, file);
}

std::string encode_safetensors_header(std::vector<SafetensorsEntry>& entries,
                                      const std::map<std::string, std::string>& metadata) {
  json j = json::object();
  uint64_t at = 0;
  for (auto& e : entries) {
    e.begin = at;
    e.end = at + static_cast<uint64_t>(e.numel()) * dtype_size(e.dtype);
    at = e.end;
    j[e.name] = {{"dtype", e.dtype}, {"shape", e.shape}, {"data_offsets", {e.begin, e.end}}};
  }
  if (!metadata.empty()) j["__metadata__"] = metadata;
  std::string text = j.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  std::string out(8, '\0');
  uint64_t n = text.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xFF);
  return out + text;
}

}  // namespace fsdp::detail
