#pragma once

// Note [One compiled command-line parser]
// CLI11 (2.1, Debian's) is header-only: every program that parses with it
// compiles and optimises its parser again, ~15 s of a core at -O3, as much
// as the rest of a benchmark's own code. The benchmarks parse through this
// class instead, whose one source file compiles CLI11 once for all of them.
// Options, checks, messages, --help and exit codes are CLI11's.

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace bench {

/// A benchmark's command line: options bound to variables, checked, parsed
/// by CLI11 in bench_cli.cpp.
class CommandLine {
 public:
  /// `description` heads --help.
  explicit CommandLine(const std::string& description);
  ~CommandLine();
  CommandLine(const CommandLine&) = delete;
  CommandLine& operator=(const CommandLine&) = delete;

  /// `--name VALUE` into `*value`, whose value before parsing is the default.
  CommandLine& option(const std::string& name, int* value, const std::string& help = "");
  CommandLine& option(const std::string& name, int64_t* value, const std::string& help = "");
  CommandLine& option(const std::string& name, double* value, const std::string& help = "");
  /// `--name 0` or `--name 1` (also true/false).
  CommandLine& option(const std::string& name, bool* value, const std::string& help = "");
  CommandLine& option(const std::string& name, std::string* value, const std::string& help = "");
  /// `--name a,b,c`.
  CommandLine& option(const std::string& name, std::vector<std::string>* value,
                      const std::string& help = "");
  /// `--name` alone sets `*value`.
  CommandLine& flag(const std::string& name, bool* value, const std::string& help = "");

  /// The option added last takes only these values.
  CommandLine& one_of(const std::vector<std::string>& names);
  /// The option added last must be > 0.
  CommandLine& positive();
  /// The option added last must be >= 0.
  CommandLine& non_negative();

  /// Parses; on a bad command line or --help, prints CLI11's message and
  /// exits with CLI11's code.
  void parse(int argc, char** argv);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// The training-step benchmarks' common options (--steps, --warmup and the
/// GPT's shape: --blocks, --d-model, --heads, --seq, --batch, --vocab),
/// bound to the fields of `a` of those names.
template <typename StepArgs>
void add_gpt_step_options(CommandLine& cli, StepArgs& a) {
  cli.option("--steps", &a.steps, "timed steps").positive();
  cli.option("--warmup", &a.warmup, "untimed steps first").non_negative();
  cli.option("--blocks", &a.blocks).positive();
  cli.option("--d-model", &a.d_model).positive();
  cli.option("--heads", &a.heads).positive();
  cli.option("--seq", &a.seq).positive();
  cli.option("--batch", &a.batch, "per rank").positive();
  cli.option("--vocab", &a.vocab).positive();
}

}  // namespace bench
