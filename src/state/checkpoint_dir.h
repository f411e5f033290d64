#pragma once

// Reading a checkpoint directory (no LibTorch): the completion marker, the
// manifests, and pieces of tensors from the safetensors files, every size and
// checksum verified. See Note [Checkpoint directory].

#include <cstdint>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "state/atomic_file.h"
#include "state/manifest.h"
#include "state/safetensors.h"

namespace fsdp::detail {

/// Name of the completion marker inside a checkpoint directory.
constexpr const char* kCompletionMarker = "COMPLETE";
/// Name of rank r's manifest.
std::string manifest_name(int rank);
/// Largest manifest or marker accepted (checked before reading).
constexpr uint64_t kMaxManifestBytes = 256u << 20;

/// A complete checkpoint directory opened for reading.
class CheckpointReader {
 public:
  /// Verifies the marker (its own checksum, and that its step is the
  /// manifests' and, for a "step-<N>" directory, N), every manifest (size and
  /// CRC-32) and every data file (size, CRC-32, header, and that each piece a
  /// manifest lists is in it with its dtype and size); throws CheckpointError
  /// naming the file otherwise. A file that is not a regular file (a FIFO, a
  /// device, a directory) is refused, never waited on.
  explicit CheckpointReader(std::string dir);
  /// Which data files' CRC-32 the constructor checks: all of them, or none
  /// yet, each then checked in full before its first read (verify_file, or
  /// read()); sizes, headers and pieces are checked either way (Note [Each
  /// rank checks what it reads]).
  enum class DataChecks { kEveryFile, kBeforeFirstRead };
  CheckpointReader(std::string dir, DataChecks checks);

  /// Checks the CRC-32 of the data file `piece` is in, unless done before.
  void verify_file(const TensorRecord& piece) const;
  /// Whether the CRC-32 of the data file `piece` is in was checked.
  bool verified(const TensorRecord& piece) const { return verified_.count(piece.file) != 0; }

  /// The directory.
  const std::string& dir() const { return dir_; }
  /// The marker.
  const CompletionMarker& marker() const { return marker_; }
  /// Rank r's manifest (r < marker().world_size).
  const RankManifest& manifest(int rank) const { return manifests_.at(rank); }
  /// Every stored piece of `key` (empty if none).
  std::vector<const TensorRecord*> pieces(const std::string& key) const;
  /// Every key stored.
  std::vector<std::string> keys() const;
  /// Copies elements [begin, end) of `piece` (relative to the original tensor,
  /// inside the piece's range) to dst.
  void read(const TensorRecord& piece, int64_t begin, int64_t end, void* dst) const;

 private:
  struct DataFile {
    FileRecord record;  // its manifest's size and CRC-32
    SafetensorsHeader header;
    std::pair<uint64_t, uint64_t> identity;  // FileReader::identity() when its header was read
  };
  // Reads the header of a data file (and, for kEveryFile, checks it), then
  // closes it (Note [A reader's open files]).
  void open_data_file(const FileRecord& record);
  // Data file `name`, opened again (its size checked) unless among the last
  // kOpenDataFiles used.
  std::shared_ptr<const FileReader> reader_of(const std::string& name) const;

  DataChecks checks_;
  mutable std::set<std::string> verified_;  // data files whose CRC-32 was checked
  std::string dir_;
  CompletionMarker marker_;
  std::vector<RankManifest> manifests_;
  std::map<std::string, DataFile> files_;
  std::map<std::string, std::vector<const TensorRecord*>> index_;
  // The data files open now, most recently used first; open_mutex_ guards it.
  mutable std::mutex open_mutex_;
  mutable std::list<std::pair<std::string, std::shared_ptr<const FileReader>>> open_;
};

/// A directory under a checkpoint parent named as step_name() names them.
struct StepDirectory {
  int64_t step = 0;     ///< the step its name says
  std::string path;     ///< parent/step-<10 digits>
  bool marked = false;  ///< it holds a completion marker (else: torn or in progress)
  /// Its marker's CompletionMarker::sequence (0 in a marker written before
  /// it); nullopt without a marker or where the marker is damaged
  /// (verifying it says why).
  std::optional<int64_t> sequence;
};

/// Every "step-<10 digits>" entry under `parent`, saved last first (Note
/// [Checkpoints saved last]: by marker sequence, then by step; a damaged
/// marker first); empty when `parent` does not exist. Throws
/// CheckpointError if it cannot be read, CheckpointAccessError if a marker
/// cannot be.
std::vector<StepDirectory> step_directories(const std::string& parent);

/// The sequence number the next save under `parent` takes: one more than
/// the highest of its step directories' (Note [Checkpoints saved last]).
int64_t next_sequence(const std::string& parent);

/// The name of step `step`'s directory, "step-<10 digits>" (zero-padded, so
/// names sort by step); fsdp::checkpoint_path() puts it under a parent.
std::string step_name(int64_t step);

/// Where save_step writes step `step`'s checkpoint before it is put in place
/// (Note [Saving beside the checkpoint]): ".step-<10 digits>.saving" under
/// the same parent, a name step_directories() does not list.
std::string staging_name(int64_t step);
/// Whether `name` is a staging_name() or what replace_directory() moves
/// aside ("step-<10 digits>.replaced"): what an interrupted save left.
bool is_staging_name(const std::string& name);

/// The step a step_name() says ("step-0000000020" -> 20), or -1 for another
/// name.
int64_t step_of_name(const std::string& name);

}  // namespace fsdp::detail
