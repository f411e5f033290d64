// The PET_ variables (and torchrun's other variables) that give flags their
// defaults, below the command line.

#include <cctype>
#include <limits>

#include "options_parser.h"
#include "options_values.h"

namespace fsdp::launch::detail {
namespace {

/// "PET_NPROC_PER_NODE" for "--nproc-per-node": argparse's dest, upper-cased.
std::string env_name(const std::string& flag) {
  std::string name = "PET_";
  for (size_t i = flag.find_first_not_of('-'); i < flag.size(); ++i) {
    name +=
        flag[i] == '-' ? '_' : static_cast<char>(std::toupper(static_cast<unsigned char>(flag[i])));
  }
  return name;
}

}  // namespace

std::optional<std::string> lookup(const std::vector<std::string>& env, const std::string& key) {
  for (const std::string& entry : env) {
    if (entry.size() > key.size() && entry.compare(0, key.size(), key) == 0 &&
        entry[key.size()] == '=') {
      if (entry.size() == key.size() + 1) return std::nullopt;
      return entry.substr(key.size() + 1);
    }
  }
  return std::nullopt;
}

bool Parser::apply_environment() {
  // torchrun's own fallbacks, below every PET_ variable.
  if (const auto seconds = lookup(env_, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT")) {
    const auto parsed = parse_seconds(*seconds);
    if (!parsed) {
      return fail(bad_value("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", *seconds,
                            "must be a number of seconds >= 0"));
    }
    opts_.kill_timeout_s = *parsed;
  }
  opts_.log_line_prefix_template =
      lookup(env_, "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE").value_or("");
  for (const FlagSpec& spec : kFlags) {
    if (!spec.from_env) continue;
    const std::string variable = env_name(spec.name);
    const auto value = lookup(env_, variable);
    if (!value) continue;
    if (spec.takes_value) {
      if (!apply(spec, variable, value)) return false;
      continue;
    }
    // check_env: an integer, non-zero for "given".
    const auto on =
        parse_int(*value, std::numeric_limits<long>::min(), std::numeric_limits<long>::max());
    if (!on) {
      return fail(bad_value(variable, *value,
                            std::string("1 stands for ") + spec.name + ", 0 for its absence"));
    }
    if (*on != 0 && !apply(spec, variable, std::nullopt)) return false;
  }
  return true;
}

}  // namespace fsdp::launch::detail
