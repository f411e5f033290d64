#include "state/atomic_file.h"

#include <fcntl.h>
#include <linux/fs.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include <fsdp/state/error.h>

#include "detail/posix_files.h"

namespace fsdp::detail {
namespace {

std::string errno_text() { return std::strerror(errno); }

std::string parent_dir(const std::string& path) {
  const auto slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

}  // namespace

std::optional<std::string> access_problem_hint(int error) {
  switch (error) {
    case EMFILE:
    case ENFILE:
      return std::string(
          " (the open-file limit: raise `ulimit -n`, or LimitNOFILE / the container's nofile "
          "limit)");
    case EACCES:
    case EPERM:
      return std::string(" (make it readable to this user)");
    case ENOMEM:
      return std::string();
    case EINTR:
    case EAGAIN:
    case ETIMEDOUT:
    case ESTALE:
      return std::string(" (try again)");
    default:
      return std::nullopt;
  }
}

bool is_marked(const std::string& marker) {
  struct stat st {};
  if (::lstat(marker.c_str(), &st) == 0) return true;
  const int error = errno;
  if (error == ENOENT || error == ENOTDIR) return false;
  // Unknown is neither: an unfinished save would be skipped or removed.
  throw CheckpointAccessError(marker, "cannot tell whether the save finished: " + errno_text() +
                                          access_problem_hint(error).value_or(""));
}

void throw_file_error(const std::string& path, const std::string& problem, int error) {
  if (const std::optional<std::string> hint = access_problem_hint(error)) {
    throw CheckpointAccessError(path, problem + *hint);
  }
  throw CheckpointError(path, problem);
}

std::string temporary_name(const std::string& path) {
  return path + kTemporarySuffix + std::to_string(::getpid());
}

bool is_temporary_name(const std::string& name) {
  const auto at = name.rfind(kTemporarySuffix);
  if (at == std::string::npos || at == 0) return false;
  const std::string pid = name.substr(at + std::strlen(kTemporarySuffix));
  return !pid.empty() && pid.find_first_not_of("0123456789") == std::string::npos;
}

const char* file_type_name(unsigned mode) {
  switch (mode & S_IFMT) {
    case S_IFREG:
      return "a regular file";
    case S_IFDIR:
      return "a directory";
    case S_IFIFO:
      return "a FIFO";
    case S_IFCHR:
      return "a character device";
    case S_IFBLK:
      return "a block device";
    case S_IFSOCK:
      return "a socket";
    case S_IFLNK:
      return "a symbolic link";
    default:
      return "a file of unknown type";
  }
}

AtomicFileWriter::AtomicFileWriter(std::string path)
    : path_(std::move(path)), tmp_path_(temporary_name(path_)) {
  // A leftover of an earlier process with our pid is not in progress. O_EXCL
  // and O_NOFOLLOW then refuse whatever else is there (a FIFO would block an
  // O_WRONLY open until a reader came).
  ::unlink(tmp_path_.c_str());
  fd_ = ::open(tmp_path_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
  if (fd_ < 0) throw CheckpointError(tmp_path_, "cannot create: " + errno_text());
}

AtomicFileWriter::~AtomicFileWriter() {
  if (fd_ >= 0) {
    ::close(fd_);
    ::unlink(tmp_path_.c_str());
  }
}

void AtomicFileWriter::write(const void* data, size_t size) {
  if (fd_ < 0) throw CheckpointError(path_, "write after commit");
  crc_.update(data, size);
  const auto* p = static_cast<const char*>(data);
  while (size > 0) {
    const ssize_t n = ::write(fd_, p, size);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) throw CheckpointError(tmp_path_, "write failed: " + errno_text());
    p += n;
    size -= static_cast<size_t>(n);
    size_ += static_cast<uint64_t>(n);
  }
}

void AtomicFileWriter::commit() {
  if (::fsync(fd_) != 0) throw CheckpointError(tmp_path_, "fsync failed: " + errno_text());
  ::close(fd_);
  fd_ = -1;
  if (::rename(tmp_path_.c_str(), path_.c_str()) != 0) {
    const std::string why = errno_text();
    ::unlink(tmp_path_.c_str());
    throw CheckpointError(path_, "rename from " + tmp_path_ + " failed: " + why);
  }
  fsync_directory(parent_dir(path_));
}

uint32_t write_file_atomically(const std::string& path, const std::string& contents) {
  AtomicFileWriter w(path);
  w.write(contents.data(), contents.size());
  const uint32_t crc = w.crc32();
  w.commit();
  return crc;
}

std::string parent_directory(const std::string& path) {
  const size_t end = path.find_last_not_of('/');
  const size_t slash = end == std::string::npos ? std::string::npos : path.find_last_of('/', end);
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

void replace_directory(const std::string& staged, const std::string& dir) {
  const std::string parent = parent_directory(dir);
  const auto renamed = [](const std::string& from, const std::string& to) {
    if (::rename(from.c_str(), to.c_str()) != 0)
      throw CheckpointError(to, "cannot rename " + from + " to it: " + errno_text());
  };
  std::error_code ec;
  std::string older;  // where the older one is once the new one is in place
  if (!entry_exists(dir)) {
    renamed(staged, dir);
  } else if (::syscall(SYS_renameat2, AT_FDCWD, staged.c_str(), AT_FDCWD, dir.c_str(),
                       RENAME_EXCHANGE) == 0) {
    older = staged;
  } else if (errno == EINVAL || errno == ENOSYS || errno == ENOTSUP) {
    older = dir + ".replaced";  // NFS, older kernels: no exchange
    remove_tree(older, ec);
    renamed(dir, older);
    renamed(staged, dir);
  } else {
    throw CheckpointError(dir, "cannot exchange it with " + staged + ": " + errno_text());
  }
  fsync_directory(parent);  // the new one in place before the older one goes
  if (!older.empty()) remove_tree(older, ec);
}

void fsync_directory(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) throw CheckpointError(dir, "cannot open directory: " + errno_text());
  const int rc = ::fsync(fd);
  ::close(fd);
  if (rc != 0) throw CheckpointError(dir, "fsync of the directory failed: " + errno_text());
}

FileReader::FileReader(const std::string& path) : path_(path) {
  // O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer
  // forever. It changes nothing for the regular files accepted below.
  fd_ = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd_ < 0) throw_file_error(path, "cannot open: " + errno_text(), errno);
  struct stat st {};
  if (::fstat(fd_, &st) != 0) {
    const int error = errno;
    const std::string why = errno_text();
    ::close(fd_);
    throw_file_error(path, "cannot stat: " + why, error);
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd_);
    throw CheckpointError(path, std::string("is ") + file_type_name(st.st_mode) +
                                    ", not a regular file; a checkpoint holds only regular "
                                    "files: remove it or load another checkpoint");
  }
  size_ = static_cast<uint64_t>(st.st_size);
  identity_ = {static_cast<uint64_t>(st.st_dev), static_cast<uint64_t>(st.st_ino)};
}

FileReader::~FileReader() {
  if (fd_ >= 0) ::close(fd_);
}

void FileReader::read_at(uint64_t offset, void* dst, size_t size) const {
  if (offset > size_ || size > size_ - offset) {
    throw CheckpointError(path_, "read of " + std::to_string(size) + " bytes at offset " +
                                     std::to_string(offset) + " is past the end of the file (" +
                                     std::to_string(size_) + " bytes)");
  }
  auto* p = static_cast<char*>(dst);
  while (size > 0) {
    const ssize_t n = ::pread(fd_, p, size, static_cast<off_t>(offset));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) throw CheckpointError(path_, "read failed (file shrank?): " + errno_text());
    p += n;
    offset += static_cast<uint64_t>(n);
    size -= static_cast<size_t>(n);
  }
}

uint32_t FileReader::checksum() const {
  Crc32 crc;
  std::vector<char> block(1 << 20);
  for (uint64_t at = 0; at < size_; at += block.size()) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(block.size(), size_ - at));
    read_at(at, block.data(), n);
    crc.update(block.data(), n);
  }
  return crc.value();
}

std::string read_small_file(const std::string& path, uint64_t max_size) {
  FileReader r(path);
  if (r.size() > max_size) {
    throw CheckpointError(path, "is " + std::to_string(r.size()) + " bytes, more than the " +
                                    std::to_string(max_size) + " expected");
  }
  std::string out(static_cast<size_t>(r.size()), '\0');
  if (!out.empty()) r.read_at(0, &out[0], out.size());
  return out;
}

}  // namespace fsdp::detail
