#pragma once

// Shared by the train_gpt end-to-end tests: scratch directories and running
// train_gpt alone (one rank, no launcher) with a deadline.

#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "detail/posix_files.h"

namespace train_gpt_test {

/// Removes a directory and everything in it (errors ignored). See Note [No
/// filesystem library]: these tests run against wheels that break it.
inline void remove_dir(const std::string& dir) {
  std::error_code ignored;
  fsdp::detail::remove_tree(dir, ignored);
}

/// A fresh, empty directory under the system's temporary directory.
inline std::string fresh_dir(const std::string& name) {
  const char* tmp = std::getenv("TMPDIR");
  const std::string dir = std::string(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") +
                          "/train_gpt_test_" + name + "_" + std::to_string(::getpid());
  remove_dir(dir);
  std::error_code ignored;
  fsdp::detail::make_dirs(dir, ignored);
  return dir;
}

/// How a direct run of train_gpt ended.
struct Outcome {
  bool exited = false;  ///< false: killed by a signal (a crash)
  int code = -1;        ///< exit status when it exited (124: the deadline hit)
  std::string output;   ///< stdout and stderr together
};

/// Runs `train_gpt <args>` (a shell command line) for at most 60 s.
inline Outcome run_direct(const std::string& args) {
  const std::string cmd = "timeout 60 " + std::string(TRAIN_GPT_PATH) + " " + args + " 2>&1";
  FILE* pipe = ::popen(cmd.c_str(), "r");
  Outcome out;
  if (pipe == nullptr) return out;
  char buf[4096];
  for (size_t n; (n = std::fread(buf, 1, sizeof(buf), pipe)) > 0;) out.output.append(buf, n);
  const int status = ::pclose(pipe);
  out.exited = WIFEXITED(status);
  out.code = out.exited ? WEXITSTATUS(status) : -1;
  return out;
}

}  // namespace train_gpt_test
