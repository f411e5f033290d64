#include "options_values.h"

#include <signal.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <iterator>
#include <sstream>

#include "exit_status.h"

namespace fsdp::launch::detail {
namespace {

/// The signals --signals-to-handle may name: those that ask a process to
/// stop or to act (SLURM's SIGUSR1 before a job's time is up), and not
/// those a fault raises or fsdprun needs itself (SIGCHLD, SIGPIPE).
constexpr int kForwardable[] = {SIGTERM, SIGINT,  SIGHUP,  SIGQUIT,   SIGUSR1,
                                SIGUSR2, SIGALRM, SIGXCPU, SIGVTALRM, SIGPROF};

}  // namespace

std::optional<long> parse_int(const std::string& text, long lo, long hi) {
  if (text.empty()) return std::nullopt;
  errno = 0;
  char* end = nullptr;
  long value = std::strtol(text.c_str(), &end, 10);
  if (errno != 0 || end != text.c_str() + text.size()) return std::nullopt;
  if (value < lo || value > hi) return std::nullopt;
  return value;
}

std::optional<double> parse_seconds(const std::string& text) {
  errno = 0;
  char* end = nullptr;
  const double seconds = std::strtod(text.c_str(), &end);
  if (text.empty() || errno != 0 || end != text.c_str() + text.size() || !std::isfinite(seconds) ||
      seconds < 0 || seconds > 1e6) {
    return std::nullopt;
  }
  return seconds;
}

bool parse_endpoint(const std::string& text, std::string* host, int* port, bool* port_given) {
  std::string rest;
  if (!text.empty() && text[0] == '[') {
    const size_t close = text.find(']');
    if (close == std::string::npos) return false;
    *host = text.substr(1, close - 1);
    rest = text.substr(close + 1);
    if (!rest.empty() && rest[0] != ':') return false;
  } else {
    const size_t colon = text.rfind(':');
    // A bare IPv6 address has several colons and no port.
    const bool has_port = colon != std::string::npos && text.find(':') == colon;
    *host = has_port ? text.substr(0, colon) : text;
    rest = has_port ? text.substr(colon) : "";
  }
  if (host->empty()) return false;
  *port = kDefaultRendezvousPort;
  *port_given = !rest.empty();
  if (rest.empty()) return true;
  const auto value = parse_int(rest.substr(1), 0, 65535);
  if (!value) return false;
  *port = static_cast<int>(*value);
  return true;
}

bool parse_stream_spec(const std::string& text, StreamSpec* spec) {
  *spec = StreamSpec();
  if (text.find(':') == std::string::npos) {
    const auto all = parse_int(text, 0, 3);
    if (all) spec->all = static_cast<int>(*all);
    return all.has_value();
  }
  if (text.back() == ',') return false;
  std::istringstream pairs(text);
  std::string pair;
  while (std::getline(pairs, pair, ',')) {
    const size_t colon = pair.find(':');
    if (colon == std::string::npos) return false;
    const auto rank = parse_int(pair.substr(0, colon), 0, 1 << 20);
    const auto streams = parse_int(pair.substr(colon + 1), 0, 3);
    if (!rank || !streams) return false;
    spec->by_local_rank[static_cast<int>(*rank)] = static_cast<int>(*streams);
  }
  return !spec->by_local_rank.empty();
}

bool parse_signals(const std::string& text, std::vector<int>* signals, std::string* why) {
  std::string choices;
  for (const int signo : kForwardable)
    choices += (choices.empty() ? "" : ", ") + signal_name(signo);
  signals->clear();
  std::istringstream items(text);
  std::string item;
  while (std::getline(items, item, ',')) {
    // torchrun strips each name.
    item.erase(0, item.find_first_not_of(" \t"));
    item.erase(item.find_last_not_of(" \t") + 1);
    if (item.empty()) continue;
    const int signo = signal_number(item);
    if (std::find(std::begin(kForwardable), std::end(kForwardable), signo) ==
        std::end(kForwardable)) {
      *why = "'" + item + "' is not one of " + choices;
      return false;
    }
    if (std::find(signals->begin(), signals->end(), signo) == signals->end()) {
      signals->push_back(signo);
    }
  }
  if (signals->empty()) {
    *why = "name one or more of " + choices;
    return false;
  }
  return true;
}

bool parse_rdzv_conf(const std::string& text, LaunchOptions* opts,
                     std::vector<std::string>* ignored_keys, std::string* why) {
  // join_timeout, last_call_timeout and is_host are fsdprun's; the others
  // are the c10d store's own and have nothing to act on here.
  const LaunchOptions defaults;
  opts->join_timeout_s = defaults.join_timeout_s;
  opts->last_call_timeout_s = defaults.last_call_timeout_s;
  opts->rdzv_is_host.reset();
  std::istringstream pairs(text);
  std::string pair;
  while (std::getline(pairs, pair, ',')) {
    const size_t eq_at = pair.find('=');
    const std::string key = pair.substr(0, eq_at);
    const std::string setting = eq_at == std::string::npos ? "" : pair.substr(eq_at + 1);
    if (key == "join_timeout") {
      const auto seconds = parse_seconds(setting);
      if (!seconds || *seconds == 0) {
        *why = "join_timeout must be a number of seconds > 0";
        return false;
      }
      opts->join_timeout_s = *seconds;
    } else if (key == "last_call_timeout") {
      const auto seconds = parse_seconds(setting);
      if (!seconds) {
        *why = "last_call_timeout must be a number of seconds >= 0";
        return false;
      }
      opts->last_call_timeout_s = *seconds;
    } else if (key == "is_host") {
      // torchrun's spellings of a boolean (RendezvousParameters.get_as_bool).
      std::string word = setting;
      for (char& c : word) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
      if (word == "1" || word == "true" || word == "t" || word == "yes" || word == "y") {
        opts->rdzv_is_host = true;
      } else if (word == "0" || word == "false" || word == "f" || word == "no" || word == "n") {
        opts->rdzv_is_host = false;
      } else {
        *why = "is_host must be 1 or 0";
        return false;
      }
    } else if (!key.empty()) {
      ignored_keys->push_back(key);
    }
  }
  return true;
}

std::string bad_value(const std::string& flag, const std::string& value, const std::string& why) {
  return flag + ": invalid value '" + value + "' (" + why + ")";
}

}  // namespace fsdp::launch::detail
