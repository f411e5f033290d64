#include "options_flags.h"

#include <vector>

#include "options.h"

namespace fsdp::launch {
namespace detail {

std::string canonical_flag_name(const std::string& name) {
  std::string out = name;
  for (size_t i = 2; i < out.size(); ++i) {
    if (out[i] == '_') out[i] = '-';
  }
  return out;
}

const FlagSpec* find_flag(const std::string& canonical) {
  for (const FlagSpec& spec : kFlags) {
    if (canonical == spec.name) return &spec;
  }
  return nullptr;
}

}  // namespace detail

std::vector<std::string> flag_names() {
  std::vector<std::string> names;
  for (const detail::FlagSpec& spec : detail::kFlags) names.emplace_back(spec.name);
  return names;
}

}  // namespace fsdp::launch
