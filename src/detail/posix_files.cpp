#include "detail/posix_files.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>

// See Note [No filesystem library]. Only libc and the standard library here:
// test programs that do not link libfsdp compile this file in.

namespace fsdp::detail {
namespace {

std::error_code last_error() { return std::error_code(errno, std::generic_category()); }

std::string join(const std::string& dir, const std::string& name) {
  return !dir.empty() && dir.back() == '/' ? dir + name : dir + "/" + name;
}

void copy_file(const std::string& from, const std::string& to, mode_t mode, std::error_code& ec) {
  const int in = ::open(from.c_str(), O_RDONLY | O_CLOEXEC);
  if (in < 0) {
    ec = last_error();
    return;
  }
  const int out = ::open(to.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, mode & 07777);
  if (out < 0) {
    ec = last_error();
    ::close(in);
    return;
  }
  char buf[1 << 16];
  for (;;) {
    const ssize_t n = ::read(in, buf, sizeof(buf));
    if (n == 0) break;
    if (n < 0) {
      if (errno == EINTR) continue;
      ec = last_error();
      break;
    }
    for (ssize_t done = 0; done < n;) {
      const ssize_t w = ::write(out, buf + done, static_cast<size_t>(n - done));
      if (w < 0 && errno == EINTR) continue;
      if (w < 0) {
        ec = last_error();
        break;
      }
      done += w;
    }
    if (ec) break;
  }
  if (::close(out) != 0 && !ec) ec = last_error();
  ::close(in);
}

void walk(const std::string& dir, std::vector<std::string>& out) {
  std::error_code ec;
  for (const std::string& name : list_dir(dir, ec)) {
    const std::string path = join(dir, name);
    out.push_back(path);
    struct stat st {};
    if (::lstat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) walk(path, out);
  }
}

}  // namespace

void remove_tree(const std::string& path, std::error_code& ec) {
  ec.clear();
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) {
    if (errno != ENOENT) ec = last_error();
    return;
  }
  if (S_ISDIR(st.st_mode)) {
    const std::vector<std::string> names = list_dir(path, ec);
    if (ec) return;
    for (const std::string& name : names) {
      remove_tree(join(path, name), ec);
      if (ec) return;
    }
  }
  remove_entry(path, ec);
}

void remove_entry(const std::string& path, std::error_code& ec) {
  ec.clear();
  if (::remove(path.c_str()) != 0 && errno != ENOENT) ec = last_error();
}

void make_dirs(const std::string& path, std::error_code& ec) {
  ec.clear();
  for (size_t pos = 0;;) {
    pos = path.find('/', pos + 1);
    const std::string prefix = path.substr(0, pos);
    // An existing one is no error (EEXIST, or EACCES for one we cannot write).
    if (!prefix.empty() && prefix.back() != '/' && ::mkdir(prefix.c_str(), 0777) != 0) {
      const std::error_code error = last_error();
      struct stat st {};
      if (::stat(prefix.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
        ec = error.value() == EEXIST ? std::make_error_code(std::errc::not_a_directory) : error;
        return;
      }
    }
    if (pos == std::string::npos) return;
  }
}

bool path_exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

bool entry_exists(const std::string& path) {
  struct stat st {};
  return ::lstat(path.c_str(), &st) == 0;
}

int64_t file_size(const std::string& path, std::error_code& ec) {
  ec.clear();
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    ec = last_error();
    return -1;
  }
  return static_cast<int64_t>(st.st_size);
}

std::vector<std::string> list_dir(const std::string& dir, std::error_code& ec) {
  ec.clear();
  std::vector<std::string> names;
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) {
    ec = last_error();
    return names;
  }
  for (;;) {
    errno = 0;  // readdir's end and its failure both return null
    const dirent* ent = ::readdir(d);
    if (ent == nullptr) break;
    const std::string name = ent->d_name;
    if (name != "." && name != "..") names.push_back(name);
  }
  if (errno != 0) {
    ec = last_error();  // a partial listing would hide entries
    names.clear();
  }
  ::closedir(d);
  return names;
}

std::vector<std::string> walk_tree(const std::string& dir) {
  std::vector<std::string> out;
  walk(dir, out);
  return out;
}

void copy_tree(const std::string& from, const std::string& to, std::error_code& ec) {
  ec.clear();
  struct stat st {};
  if (::lstat(from.c_str(), &st) != 0) {
    ec = last_error();
    return;
  }
  if (S_ISLNK(st.st_mode)) {
    std::string target(4096, '\0');
    const ssize_t n = ::readlink(from.c_str(), target.data(), target.size());
    if (n < 0 || ::symlink(target.substr(0, static_cast<size_t>(n)).c_str(), to.c_str()) != 0)
      ec = last_error();
    return;
  }
  if (!S_ISDIR(st.st_mode)) {
    copy_file(from, to, st.st_mode, ec);
    return;
  }
  if (::mkdir(to.c_str(), st.st_mode & 07777) != 0) {
    ec = last_error();
    return;
  }
  const std::vector<std::string> names = list_dir(from, ec);
  for (const std::string& name : names) {
    if (ec) return;
    copy_tree(join(from, name), join(to, name), ec);
  }
}

std::string lexically_normal(const std::string& path) {
  const bool absolute = !path.empty() && path.front() == '/';
  std::vector<std::string> parts;
  for (size_t begin = 0; begin <= path.size();) {
    size_t end = path.find('/', begin);
    if (end == std::string::npos) end = path.size();
    const std::string part = path.substr(begin, end - begin);
    begin = end + 1;
    if (part.empty() || part == ".") continue;
    if (part == ".." && !parts.empty() && parts.back() != "..") {
      parts.pop_back();
    } else if (part != ".." || !absolute) {
      parts.push_back(part);  // ".." above the root of an absolute path is the root
    }
  }
  std::string out = absolute ? "/" : "";
  for (size_t i = 0; i < parts.size(); ++i) out += (i > 0 ? "/" : "") + parts[i];
  return out.empty() ? "." : out;
}

}  // namespace fsdp::detail
