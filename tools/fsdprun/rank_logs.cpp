#include "rank_logs.h"

#include <fcntl.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <system_error>
#include <vector>

#include "detail/posix_files.h"

namespace fsdp::launch {
namespace {

/// detail::make_dirs, its failure in `error`.
bool make_directories(const std::string& path, std::string* error) {
  std::error_code ec;
  detail::make_dirs(path, ec);
  if (ec) *error = "cannot make " + path + ": " + ec.message();
  return !ec;
}

}  // namespace

std::string make_run_log_dir(const std::string& base, const std::string& run_id,
                             std::string* error) {
  std::string dir = base;
  if (dir.empty()) {
    const char* tmp = std::getenv("TMPDIR");
    dir = tmp != nullptr && *tmp != '\0' ? tmp : "/tmp";
  }
  if (!make_directories(dir, error)) return "";
  // A fresh directory per run, as torchrun's (mkdtemp with the run id as its
  // prefix): nodes sharing --log-dir, or a pid that repeats (a container's
  // entrypoint), never write into one another's files. A '/' in the id would
  // make it a path.
  std::string prefix = run_id;
  std::replace(prefix.begin(), prefix.end(), '/', '_');
  const std::string pattern = dir + "/" + prefix + "_XXXXXX";
  std::vector<char> name(pattern.begin(), pattern.end());
  name.push_back('\0');
  if (::mkdtemp(name.data()) == nullptr) {
    *error = "cannot make a directory in " + dir + ": " + std::strerror(errno);
    return "";
  }
  return name.data();
}

std::string rank_log_path(const std::string& run_dir, int attempt, int local_rank, int stream) {
  return run_dir + "/attempt_" + std::to_string(attempt) + "/" + std::to_string(local_rank) +
         (stream == 0 ? "/stdout.log" : "/stderr.log");
}

int open_rank_log(const std::string& run_dir, int attempt, int local_rank, int stream,
                  std::string* error) {
  const std::string path = rank_log_path(run_dir, attempt, local_rank, stream);
  if (!make_directories(path.substr(0, path.rfind('/')), error)) return -1;
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) *error = "cannot write " + path + ": " + std::strerror(errno);
  return fd;
}

}  // namespace fsdp::launch
