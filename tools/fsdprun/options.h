#pragma once

// Command-line parsing for fsdprun. Kept free of process and I/O code so the
// parser can be unit-tested on its own.

#include <optional>
#include <string>
#include <vector>

namespace fsdp::launch {

/// Everything fsdprun was asked to do, after defaults have been applied.
struct LaunchOptions {
  int nproc_per_node = 1;
  int nnodes = 1;
  int node_rank = 0;
  std::string master_addr = "127.0.0.1";
  /// Unset means "choose one": a free local port on a single node, 29500
  /// (torchrun's default) when several nodes must agree on it.
  std::optional<int> master_port;
  bool standalone = false;
  int max_restarts = 0;
  double kill_timeout_s = 10.0;
  bool prefix_output = true;
  /// The program to run (looked up in PATH) followed by its own arguments.
  std::vector<std::string> command;
};

/// What parse_options() found: options to run with, a request for help, or
/// an error to report (exit code 2).
struct ParseResult {
  enum class Kind { kRun, kHelp, kError };
  Kind kind = Kind::kError;
  LaunchOptions options;
  /// For kError: one line naming the flag and the bad value.
  std::string error;
};

/// Parses argv (argv[0] excluded). Flags may be spelled with '-' or '_'
/// between words and given as "--flag value" or "--flag=value"; parsing stops
/// at "--" or at the first argument that is not a flag, so everything from
/// the program name on is passed through untouched.
ParseResult parse_options(const std::vector<std::string>& args);

/// The --help text: every flag, its default and the environment each rank
/// receives.
std::string usage_text();

}  // namespace fsdp::launch
