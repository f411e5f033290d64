#pragma once

// Files that appear whole or not at all, and checked reads (no LibTorch).

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>

#include <fsdp/state/error.h>

#include "state/crc32.h"

namespace fsdp::detail {

/// A checkpoint file this process cannot open for a reason of its own, not
/// of the file: too many open files, no memory, no permission, a transient
/// failure (an interrupted call, a stale NFS handle). resume() does
/// not take it for damage and skip the checkpoint (Note [Resume fallback]):
/// an older checkpoint would silently lose the steps since.
class CheckpointAccessError final : public CheckpointError {
 public:
  using CheckpointError::CheckpointError;
};
/// For an errno that says the process, not the file, is at fault (EMFILE,
/// ENFILE, EACCES, EPERM, ENOMEM; EINTR, EAGAIN, ETIMEDOUT, ESTALE, which a
/// retry may cure): what to change, in parentheses (possibly empty); nullopt
/// for any other errno.
std::optional<std::string> access_problem_hint(int error);
/// Throws what `problem` (a failure of `path` with errno `error`) is: a
/// CheckpointAccessError with the hint, or a CheckpointError.
[[noreturn]] void throw_file_error(const std::string& path, const std::string& problem, int error);
/// Whether the completion marker `marker` exists (lstat: whatever it is);
/// a CheckpointAccessError where that cannot be told (EACCES on the
/// directory, EIO): the checkpoint is then neither skipped nor removed.
bool is_marked(const std::string& marker);

/// What AtomicFileWriter appends to a path for its temporary file, before
/// the writer's pid: "<path>.tmp.<pid>".
constexpr const char* kTemporarySuffix = ".tmp.";
/// The temporary name this process uses for `path`.
std::string temporary_name(const std::string& path);
/// True for a name AtomicFileWriter makes ("<name>.tmp.<digits>").
bool is_temporary_name(const std::string& name);
/// "a FIFO", "a directory", ... for a st_mode, for messages.
const char* file_type_name(unsigned mode);

/// Writes `path` atomically: the bytes go to a temporary name in the same
/// directory; commit() fsyncs it, renames it to `path` and fsyncs the
/// directory, so a crash leaves either the old state or the whole new file.
/// A writer destroyed before commit() removes its temporary file.
class AtomicFileWriter {
 public:
  /// Opens the temporary file; throws CheckpointError if it cannot.
  explicit AtomicFileWriter(std::string path);
  ~AtomicFileWriter();
  AtomicFileWriter(const AtomicFileWriter&) = delete;
  AtomicFileWriter& operator=(const AtomicFileWriter&) = delete;

  /// Appends bytes (and adds them to the checksum).
  void write(const void* data, size_t size);
  /// Makes the file durable under its final name.
  void commit();
  /// Bytes written so far.
  uint64_t size() const { return size_; }
  /// CRC-32 of the bytes written so far.
  uint32_t crc32() const { return crc_.value(); }

 private:
  std::string path_;
  std::string tmp_path_;
  int fd_ = -1;
  uint64_t size_ = 0;
  Crc32 crc_;
};

/// Writes a whole small file atomically; returns its CRC-32.
uint32_t write_file_atomically(const std::string& path, const std::string& contents);

/// fsyncs a directory, so that renames and creations in it are durable.
void fsync_directory(const std::string& dir);
/// The directory that holds `path` ("." for a bare name).
std::string parent_directory(const std::string& path);

/// Puts the complete directory `staged` in place of `dir` (which may hold an
/// older one, or nothing), durably: an atomic exchange where the file system
/// has one (RENAME_EXCHANGE), after which the older one is removed; else the
/// older one moves aside first (a crash between the two renames leaves it
/// under `<dir>.replaced`). Throws CheckpointError naming what failed.
void replace_directory(const std::string& staged, const std::string& dir);

/// A file opened for reading at offsets; every read is checked.
class FileReader {
 public:
  /// Opens `path`; throws CheckpointError if it does not exist or is not a
  /// regular file (a FIFO, a device, a directory: refused, never waited on).
  explicit FileReader(const std::string& path);
  ~FileReader();
  FileReader(const FileReader&) = delete;
  FileReader& operator=(const FileReader&) = delete;

  /// The file's size when opened.
  uint64_t size() const { return size_; }
  /// Which file it is (device and inode): the same path opened again may be
  /// another file.
  std::pair<uint64_t, uint64_t> identity() const { return identity_; }
  /// The path, for messages.
  const std::string& path() const { return path_; }
  /// Reads exactly `size` bytes at `offset`; throws if the file is shorter.
  void read_at(uint64_t offset, void* dst, size_t size) const;
  /// CRC-32 of the whole file, read in blocks (no allocation of its size).
  uint32_t checksum() const;

 private:
  std::string path_;
  int fd_ = -1;
  uint64_t size_ = 0;
  std::pair<uint64_t, uint64_t> identity_;
};

/// Reads a small file whole, refusing one larger than max_size before
/// allocating.
std::string read_small_file(const std::string& path, uint64_t max_size);

}  // namespace fsdp::detail
