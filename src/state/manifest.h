#pragma once

// The JSON metadata of a checkpoint directory (no LibTorch):
//   rank<R>.json  one manifest per rank: its data files (size, CRC-32), the
//                 pieces of original tensors they hold, and its resume state;
//   COMPLETE      the completion marker, written last by rank 0: every
//                 manifest with its size and CRC-32, and its own CRC-32.
// See Note [Checkpoint directory] in src/state/checkpoint_dir.cpp.

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace fsdp::detail {

/// A file of the checkpoint with its size and checksum.
struct FileRecord {
  std::string name;    ///< file name inside the checkpoint directory
  uint64_t size = 0;   ///< bytes
  uint32_t crc32 = 0;  ///< CRC-32 of all its bytes
};

/// A piece of an original tensor stored in a safetensors file: elements
/// [begin, end) of the original tensor flattened.
struct TensorRecord {
  std::string key;             ///< "model/<name>" or "optim/<name>/<state>"
  std::string file;            ///< the safetensors file that holds it
  std::string tensor;          ///< its name inside that file
  std::string dtype;           ///< safetensors dtype
  std::vector<int64_t> shape;  ///< the original tensor's full shape
  int64_t begin = 0;           ///< first element held
  int64_t end = 0;             ///< one past the last element held
};

/// What one rank wrote.
struct RankManifest {
  int rank = 0;           ///< the writer's rank
  int world_size = 1;     ///< ranks of the saving job
  std::string kind;       ///< "full" or "sharded"
  int64_t step = 0;       ///< the training step saved
  std::string rng_state;  ///< CPU generator state, hex
  /// Each visible GPU's default generator state, hex (torch.cuda's
  /// get_rng_state_all); empty without GPUs and before 2026-11-29.
  std::vector<std::string> cuda_rng_states;
  std::map<std::string, std::string> extra;  ///< registered training-loop state
  std::map<std::string, int64_t> scalars;    ///< e.g. "optim/<name>/step"
  /// The optimizer's parameter groups' options (OptimAccess::group_options);
  /// empty without an optimizer, and in checkpoints from before 2026-11-29.
  std::vector<std::map<std::string, double>> param_groups;
  std::vector<FileRecord> files;      ///< data files this rank wrote
  std::vector<TensorRecord> tensors;  ///< pieces in those files
};

/// The completion marker.
struct CompletionMarker {
  int world_size = 1;                 ///< ranks of the saving job
  std::string kind;                   ///< "full" or "sharded"
  int64_t step = 0;                   ///< the training step saved
  std::vector<FileRecord> manifests;  ///< rank<R>.json, one per rank
  /// Its place among the saves into its parent directory, 1 for the first
  /// (Note [Checkpoints saved last]); 0 in markers written before it.
  int64_t sequence = 0;
};

/// `bytes` as lowercase hex digits, two a byte.
std::string to_hex(const std::string& bytes);
/// The bytes `hex` spells (to_hex's inverse); false if it is no hex bytes.
bool from_hex(const std::string& hex, std::string& bytes);

/// JSON text of a manifest. Registered state that is no UTF-8 text (bytes
/// from torch::save, say) goes in hex under "extra_hex" (JSON holds text).
std::string encode_manifest(const RankManifest& m);
/// Parses and validates a manifest; errors name `file`.
RankManifest parse_manifest(const std::string& text, const std::string& file);
/// JSON text of a marker.
std::string encode_marker(const CompletionMarker& m);
/// Parses and validates a marker, its own checksum first (see Note [Marker
/// checksum] in manifest.cpp); errors name `file`.
CompletionMarker parse_marker(const std::string& text, const std::string& file);

}  // namespace fsdp::detail
