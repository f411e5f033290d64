#pragma once

// The parser behind parse_options(): its state, shared by the files that
// implement its steps (options.cpp, options_env.cpp, options_finish.cpp).

#include <initializer_list>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "options.h"
#include "options_flags.h"

namespace fsdp::launch::detail {

/// Builds the error result for `message`.
ParseResult error_result(const std::string& message);

/// The value of `key` in "KEY=VALUE" entries; nullopt when absent or empty.
std::optional<std::string> lookup(const std::vector<std::string>& env, const std::string& key);

/// One run of the parser: the options so far, and which flags were given
/// (on the command line or by a PET_ variable) under which name.
class Parser {
 public:
  explicit Parser(const std::vector<std::string>& env) : env_(env) {}

  /// parse_options(), with the environment given to the constructor.
  ParseResult parse(const std::vector<std::string>& args);

 private:
  /// Takes the defaults torchrun takes from the environment; false on a bad value.
  bool apply_environment();
  /// Applies one flag, `name` as the user spelled it (or the PET_ variable
  /// it came from); false with result_ set to the error.
  bool apply(const FlagSpec& spec, const std::string& name,
             const std::optional<std::string>& value);
  /// Puts the interpreter in front of a Python script or module, as torchrun.
  bool python_command();
  /// Checks the flags against one another and fills in what depends on several.
  bool finish();
  /// Makes the result the error `message`; false, for `return fail(...)`.
  bool fail(const std::string& message) {
    result_ = error_result(message);
    return false;
  }
  /// Whether `flag` was given, on the command line or by a PET_ variable.
  bool given(Flag flag) const { return given_.count(flag) != 0; }
  /// How the user gave `flag`: its spelling, or its PET_ variable.
  std::string shown(Flag flag, const char* otherwise) const {
    const auto it = given_.find(flag);
    return it != given_.end() ? it->second : otherwise;
  }
  /// How each of `flags` that was given was given (shown()), joined by ", ".
  std::string list_given(std::initializer_list<Flag> flags) const;

  const std::vector<std::string>& env_;
  ParseResult result_;
  LaunchOptions& opts_ = result_.options;
  std::map<Flag, std::string> given_;
  std::optional<std::string> endpoint_;
  bool endpoint_port_given_ = false;
  bool no_python_ = false;
};

}  // namespace fsdp::launch::detail
