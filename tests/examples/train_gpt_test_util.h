#pragma once

// Shared by the train_gpt end-to-end tests: scratch directories and running
// train_gpt alone (one rank, no launcher) with a deadline.

#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <string>

namespace train_gpt_test {

/// A fresh, empty directory under the system's temporary directory.
inline std::filesystem::path fresh_dir(const std::string& name) {
  const std::filesystem::path dir = std::filesystem::temp_directory_path() /
                                    ("train_gpt_test_" + name + "_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
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
