#include "state/manifest.h"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <limits>
#include <map>
#include <string>
#include <type_traits>
#include <vector>

#include <fsdp/state/error.h>

#include "state/crc32.h"
#include "state/safetensors.h"

namespace fsdp::detail {
namespace {

using nlohmann::json;
constexpr int kFormatVersion = 1;

// Whether JSON can hold `s` as a string: valid UTF-8, as nlohmann's writer
// checks it (overlong forms and surrogates refused too).
bool is_json_text(const std::string& s) {
  try {
    (void)json(s).dump();
    return true;
  } catch (const json::type_error&) {
    return false;
  }
}

json file_json(const FileRecord& f) {
  return {{"name", f.name}, {"size", f.size}, {"crc32", f.crc32}};
}

// An integer of type T, or an error naming field `name`. nlohmann's get<int
// type> converts a float (1e81 in a damaged file) with a cast that is
// undefined out of range: insist on an integer that fits.
template <typename T>
T integer_value(const json& v, const char* name, const std::string& file) {
  const auto wrong = [&](const char* why) {
    return CheckpointError(file, std::string("field '") + name + "' " + why + ": " + v.dump());
  };
  if (!v.is_number_integer()) throw wrong("is not an integer");
  using Limits = std::numeric_limits<T>;
  if (v.is_number_unsigned()) {
    const uint64_t u = v.get<uint64_t>();
    if (u > static_cast<uint64_t>(Limits::max())) throw wrong("is out of range");
    return static_cast<T>(u);
  }
  const int64_t i = v.get<int64_t>();
  if (i < static_cast<int64_t>(Limits::min()) ||
      (i > 0 && static_cast<uint64_t>(i) > static_cast<uint64_t>(Limits::max()))) {
    throw wrong("is out of range");
  }
  return static_cast<T>(i);
}

// A field of `j` of the given kind, or an error naming it.
template <typename T>
T field(const json& j, const char* name, const std::string& file) {
  const auto it = j.find(name);
  if (it == j.end()) throw CheckpointError(file, std::string("missing field '") + name + "'");
  const auto wrong_type = [&] {
    return CheckpointError(file,
                           std::string("field '") + name + "' has the wrong type: " + it->dump());
  };
  if constexpr (std::is_integral_v<T> && !std::is_same_v<T, bool>) {
    return integer_value<T>(*it, name, file);
  } else if constexpr (std::is_same_v<T, std::vector<int64_t>>) {
    if (!it->is_array()) throw wrong_type();
    T out;
    for (const json& e : *it) out.push_back(integer_value<int64_t>(e, name, file));
    return out;
  } else if constexpr (std::is_same_v<T, std::map<std::string, int64_t>>) {
    if (!it->is_object()) throw wrong_type();
    T out;
    for (const auto& item : it->items())
      out[item.key()] = integer_value<int64_t>(item.value(), name, file);
    return out;
  } else {
    try {
      return it->get<T>();
    } catch (const json::exception&) {
      throw wrong_type();
    }
  }
}

// A file name that stays inside the checkpoint directory.
std::string safe_name(const json& j, const std::string& file) {
  auto name = field<std::string>(j, "name", file);
  if (name.empty() || name.find('/') != std::string::npos || name == "." || name == "..") {
    throw CheckpointError(file, "bad file name '" + name + "'");
  }
  return name;
}

FileRecord parse_file(const json& j, const std::string& file) {
  if (!j.is_object()) throw CheckpointError(file, "a file record is not an object");
  FileRecord f;
  f.name = safe_name(j, file);
  f.size = field<uint64_t>(j, "size", file);
  f.crc32 = field<uint32_t>(j, "crc32", file);
  return f;
}

json parse_json(const std::string& text, const std::string& file) {
  try {
    json j = json::parse(text);
    if (!j.is_object()) throw CheckpointError(file, "is not a JSON object");
    if (field<std::string>(j, "format", file) != "libfsdp-checkpoint" ||
        field<int>(j, "version", file) != kFormatVersion) {
      throw CheckpointError(
          file, "is not a libfsdp checkpoint of format version " + std::to_string(kFormatVersion));
    }
    return j;
  } catch (const json::exception& e) {
    throw CheckpointError(file, std::string("is not valid JSON: ") + e.what());
  }
}

void check_kind(const std::string& kind, const std::string& file) {
  if (kind != "full" && kind != "sharded")
    throw CheckpointError(file, "kind must be \"full\" or \"sharded\", got \"" + kind + "\"");
}

TensorRecord parse_tensor(const json& j, const RankManifest& m, const std::string& file) {
  if (!j.is_object()) throw CheckpointError(file, "a tensor record is not an object");
  TensorRecord t;
  t.key = field<std::string>(j, "key", file);
  t.file = field<std::string>(j, "file", file);
  t.tensor = field<std::string>(j, "tensor", file);
  t.dtype = field<std::string>(j, "dtype", file);
  t.shape = field<std::vector<int64_t>>(j, "shape", file);
  t.begin = field<int64_t>(j, "begin", file);
  t.end = field<int64_t>(j, "end", file);
  if (dtype_size(t.dtype) == 0) throw CheckpointError(file, t.key + ": unknown dtype " + t.dtype);
  int64_t numel = 1;
  for (int64_t d : t.shape) {
    if (d < 0 || (d != 0 && numel > (int64_t{1} << 56) / d))
      throw CheckpointError(file, t.key + ": bad shape");
    numel *= d;
  }
  if (t.begin < 0 || t.begin > t.end || t.end > numel) {
    throw CheckpointError(file, t.key + ": element range [" + std::to_string(t.begin) + ", " +
                                    std::to_string(t.end) + ") is outside its " +
                                    std::to_string(numel) + " elements");
  }
  bool known = false;
  for (const auto& f : m.files) known = known || f.name == t.file;
  if (!known) throw CheckpointError(file, t.key + ": refers to unlisted file " + t.file);
  return t;
}

}  // namespace

std::string encode_manifest(const RankManifest& m) {
  json files = json::array(), tensors = json::array();
  for (const auto& f : m.files) files.push_back(file_json(f));
  for (const auto& t : m.tensors) {
    tensors.push_back({{"key", t.key},
                       {"file", t.file},
                       {"tensor", t.tensor},
                       {"dtype", t.dtype},
                       {"shape", t.shape},
                       {"begin", t.begin},
                       {"end", t.end}});
  }
  std::map<std::string, std::string> text, bytes;
  for (const auto& [name, value] : m.extra) {
    if (is_json_text(value)) {
      text[name] = value;
    } else {
      bytes[name] = to_hex(value);
    }
  }
  json j = {{"format", "libfsdp-checkpoint"},
            {"version", kFormatVersion},
            {"rank", m.rank},
            {"world_size", m.world_size},
            {"kind", m.kind},
            {"step", m.step},
            {"rng_state", m.rng_state},
            {"extra", text},
            {"scalars", m.scalars},
            {"files", files},
            {"tensors", tensors}};
  if (!bytes.empty()) j["extra_hex"] = bytes;
  if (!m.param_groups.empty()) j["param_groups"] = m.param_groups;
  if (!m.cuda_rng_states.empty()) j["cuda_rng_states"] = m.cuda_rng_states;
  return j.dump(1);
}

std::string to_hex(const std::string& bytes) {
  static const char* digits = "0123456789abcdef";
  std::string out;
  out.reserve(bytes.size() * 2);
  for (const char c : bytes) {
    const auto b = static_cast<unsigned char>(c);
    out += digits[b >> 4];
    out += digits[b & 15];
  }
  return out;
}

bool from_hex(const std::string& hex, std::string& bytes) {
  if (hex.size() % 2 != 0) return false;
  const auto nibble = [](char c) {
    return c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
  };
  bytes.assign(hex.size() / 2, '\0');
  for (size_t i = 0; i < bytes.size(); ++i) {
    const int hi = nibble(hex[2 * i]), lo = nibble(hex[2 * i + 1]);
    if (hi < 0 || lo < 0) return false;
    bytes[i] = static_cast<char>((hi << 4) | lo);
  }
  return true;
}

RankManifest parse_manifest(const std::string& text, const std::string& file) {
  const json j = parse_json(text, file);
  RankManifest m;
  m.rank = field<int>(j, "rank", file);
  m.world_size = field<int>(j, "world_size", file);
  if (m.world_size < 1 || m.rank < 0 || m.rank >= m.world_size) {
    throw CheckpointError(file, "rank " + std::to_string(m.rank) + " is not in a world of " +
                                    std::to_string(m.world_size));
  }
  m.kind = field<std::string>(j, "kind", file);
  check_kind(m.kind, file);
  m.step = field<int64_t>(j, "step", file);
  m.rng_state = field<std::string>(j, "rng_state", file);
  if (j.contains("cuda_rng_states")) {
    m.cuda_rng_states = field<std::vector<std::string>>(j, "cuda_rng_states", file);
  }
  m.extra = field<std::map<std::string, std::string>>(j, "extra", file);
  if (j.contains("extra_hex")) {  // registered state that is bytes, not text
    for (const auto& [name, hex] :
         field<std::map<std::string, std::string>>(j, "extra_hex", file)) {
      if (!from_hex(hex, m.extra[name]))
        throw CheckpointError(file, "registered state '" + name + "' is not hex bytes");
    }
  }
  m.scalars = field<std::map<std::string, int64_t>>(j, "scalars", file);
  if (j.contains("param_groups")) {
    m.param_groups = field<std::vector<std::map<std::string, double>>>(j, "param_groups", file);
  }
  const json files = field<json>(j, "files", file), tensors = field<json>(j, "tensors", file);
  if (!files.is_array() || !tensors.is_array())
    throw CheckpointError(file, "files and tensors must be arrays");
  for (const auto& f : files) m.files.push_back(parse_file(f, file));
  for (const auto& t : tensors) m.tensors.push_back(parse_tensor(t, m, file));
  return m;
}

namespace {

// Note [Marker checksum]
// Every manifest and data file is checked against a checksum one level up;
// the marker is the top of that chain, so it carries its own: "crc32" is the
// CRC-32 of the marker's JSON without that field, as encode_marker dumps it.
// A flipped digit in a size or checksum then blames the marker, not the
// healthy file it describes. Hashing the re-dumped JSON rather than the raw
// bytes keeps the field inside the JSON; every change of a value is caught,
// only a change of white space is not (and it changes nothing).
uint32_t marker_checksum(json j) {
  j.erase("crc32");
  const std::string canonical = j.dump(1);
  return crc32(canonical.data(), canonical.size());
}

}  // namespace

std::string encode_marker(const CompletionMarker& m) {
  json manifests = json::array();
  for (const auto& f : m.manifests) manifests.push_back(file_json(f));
  json j = {{"format", "libfsdp-checkpoint"},
            {"version", kFormatVersion},
            {"world_size", m.world_size},
            {"kind", m.kind},
            {"step", m.step},
            {"sequence", m.sequence},
            {"manifests", manifests}};
  j["crc32"] = marker_checksum(j);
  return j.dump(1);
}

CompletionMarker parse_marker(const std::string& text, const std::string& file) {
  const json j = parse_json(text, file);
  // See Note [Marker checksum].
  if (j.find("crc32") == j.end()) {
    throw CheckpointError(file,
                          "has no checksum (field 'crc32'): it was written by an older libfsdp "
                          "or edited; save the checkpoint again");
  }
  const auto stored = field<uint32_t>(j, "crc32", file);
  const uint32_t actual = marker_checksum(j);
  if (stored != actual) {
    throw CheckpointError(file, "checksum mismatch: the marker's contents have CRC-32 " +
                                    std::to_string(actual) + ", its field 'crc32' says " +
                                    std::to_string(stored) + " (the marker is corrupted)");
  }
  CompletionMarker m;
  m.world_size = field<int>(j, "world_size", file);
  m.kind = field<std::string>(j, "kind", file);
  check_kind(m.kind, file);
  m.step = field<int64_t>(j, "step", file);
  // Absent from markers written before it (Note [Checkpoints saved last]).
  if (j.find("sequence") != j.end()) {
    m.sequence = field<int64_t>(j, "sequence", file);
    if (m.sequence < 0 || m.sequence == std::numeric_limits<int64_t>::max()) {
      throw CheckpointError(file, "sequence " + std::to_string(m.sequence) +
                                      " is out of range (the marker was edited)");
    }
  }
  const json manifests = field<json>(j, "manifests", file);
  if (!manifests.is_array()) throw CheckpointError(file, "manifests must be an array");
  for (const auto& f : manifests) m.manifests.push_back(parse_file(f, file));
  if (m.world_size < 1 || static_cast<int>(m.manifests.size()) != m.world_size) {
    throw CheckpointError(file, "lists " + std::to_string(m.manifests.size()) +
                                    " manifests for a world of " + std::to_string(m.world_size));
  }
  return m;
}

}  // namespace fsdp::detail
