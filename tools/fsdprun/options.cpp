#include "options.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <initializer_list>
#include <iterator>
#include <limits>
#include <sstream>

#include "exit_status.h"

namespace fsdp::launch {
namespace {

/// The flags fsdprun understands, in their canonical '-' spelling.
enum class Flag {
  kNprocPerNode,
  kNnodes,
  kNodeRank,
  kMasterAddr,
  kMasterPort,
  kLocalAddr,
  kStandalone,
  kMaxRestarts,
  kKillTimeout,
  kSignalsToHandle,
  kNoPrefix,
  kLogLinePrefixTemplate,
  kRdzvBackend,
  kRdzvEndpoint,
  kRdzvId,
  kRdzvConf,
  kNoPython,
  kLocalRanksFilter,
  kLogDir,
  kRedirects,
  kTee,
  kMonitorInterval,
  kStartMethod,
  kRole,
  kModule,
  kRunPath,
  kNoEffect,
  kHelp,
};

/// One row of the flag table.
struct FlagSpec {
  const char* name;
  Flag flag;
  bool takes_value;
  /// Whether torchrun reads its default from PET_<NAME> (argparse_util's
  /// env and check_env); set on one spelling of each flag.
  bool from_env;
  /// For kNoEffect: why fsdprun has nothing to do with it.
  const char* why = nullptr;
};

constexpr FlagSpec kFlags[] = {
    {"--nproc-per-node", Flag::kNprocPerNode, true, true},
    {"--nnodes", Flag::kNnodes, true, true},
    {"--node-rank", Flag::kNodeRank, true, true},
    {"--master-addr", Flag::kMasterAddr, true, true},
    {"--master-port", Flag::kMasterPort, true, true},
    {"--local-addr", Flag::kLocalAddr, true, true},
    {"--standalone", Flag::kStandalone, false, true},
    {"--max-restarts", Flag::kMaxRestarts, true, true},
    {"--shutdown-timeout", Flag::kKillTimeout, true, true},
    {"--kill-timeout", Flag::kKillTimeout, true, false},
    {"--signals-to-handle", Flag::kSignalsToHandle, true, true},
    {"--no-prefix", Flag::kNoPrefix, false, false},
    {"--log-line-prefix-template", Flag::kLogLinePrefixTemplate, true, true},
    {"--rdzv-backend", Flag::kRdzvBackend, true, true},
    {"--rdzv-endpoint", Flag::kRdzvEndpoint, true, true},
    {"--rdzv-id", Flag::kRdzvId, true, true},
    {"--rdzv-conf", Flag::kRdzvConf, true, true},
    {"--no-python", Flag::kNoPython, false, true},
    {"--local-ranks-filter", Flag::kLocalRanksFilter, true, true},
    {"--log-dir", Flag::kLogDir, true, true},
    {"--redirects", Flag::kRedirects, true, true},
    {"-r", Flag::kRedirects, true, false},
    {"--tee", Flag::kTee, true, true},
    {"-t", Flag::kTee, true, false},
    {"--monitor-interval", Flag::kMonitorInterval, true, true},
    {"--start-method", Flag::kStartMethod, true, true},
    {"--role", Flag::kRole, true, true},
    {"--module", Flag::kModule, false, true},
    {"-m", Flag::kModule, false, false},
    {"--run-path", Flag::kRunPath, false, true},
    {"--event-log-handler", Flag::kNoEffect, true, true, "fsdprun logs no torchelastic events"},
    {"--logs-specs", Flag::kNoEffect, true, false,
     "it names a Python plugin; use --log-dir, --redirects and --tee"},
    {"--numa-binding", Flag::kNoEffect, true, false,
     "fsdprun binds no rank to CPUs; start the program under numactl for that"},
    {"--virtual-local-rank", Flag::kNoEffect, false, true,
     "LOCAL_RANK stays the local rank and every rank sees every GPU"},
    {"--duplicate-stdout-filters", Flag::kNoEffect, true, true,
     "no line is copied to a file of its own; use --tee"},
    {"--duplicate-stderr-filters", Flag::kNoEffect, true, true,
     "no line is copied to a file of its own; use --tee"},
    {"--help", Flag::kHelp, false, false},
    {"-h", Flag::kHelp, false, false},
};

/// The signals --signals-to-handle may name: those that ask a process to
/// stop or to act (SLURM's SIGUSR1 before a job's time is up), and not
/// those a fault raises or fsdprun needs itself (SIGCHLD, SIGPIPE).
constexpr int kForwardable[] = {SIGTERM, SIGINT,  SIGHUP,  SIGQUIT,   SIGUSR1,
                                SIGUSR2, SIGALRM, SIGXCPU, SIGVTALRM, SIGPROF};

/// torchrun accepts "--nproc_per_node" as well as "--nproc-per-node"; mapping
/// '_' to '-' after the leading dashes lets one table serve both.
std::string canonical_flag_name(const std::string& name) {
  std::string out = name;
  for (size_t i = 2; i < out.size(); ++i) {
    if (out[i] == '_') out[i] = '-';
  }
  return out;
}

/// Looks a flag up by its canonical name; nullptr when unknown.
const FlagSpec* find_flag(const std::string& canonical) {
  for (const FlagSpec& spec : kFlags) {
    if (canonical == spec.name) return &spec;
  }
  return nullptr;
}

/// Parses a whole string as a base-10 integer in [lo, hi]; partial parses
/// such as "3x" or "" are rejected rather than silently truncated.
std::optional<long> parse_int(const std::string& text, long lo, long hi) {
  if (text.empty()) return std::nullopt;
  errno = 0;
  char* end = nullptr;
  long value = std::strtol(text.c_str(), &end, 10);
  if (errno != 0 || end != text.c_str() + text.size()) return std::nullopt;
  if (value < lo || value > hi) return std::nullopt;
  return value;
}

/// Builds the error result for `message`.
ParseResult error_result(const std::string& message) {
  ParseResult result;
  result.kind = ParseResult::Kind::kError;
  result.error = message;
  return result;
}

/// "--flag: invalid value 'v' (why)".
std::string bad_value(const std::string& flag, const std::string& value, const std::string& why) {
  return flag + ": invalid value '" + value + "' (" + why + ")";
}

/// Splits "host[:port]" ("[v6 address]:port" for IPv6) as torchrun's
/// parse_rendezvous_endpoint does; the port defaults to 29400. False on a
/// malformed endpoint. `port_given`: whether the text had one.
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

/// torchrun's Std value: "0".."3" for every local rank, or "0:3,1:2".
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

/// A number of seconds in (0, 1e6], or nullopt.
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

/// "PET_NPROC_PER_NODE" for "--nproc-per-node": argparse's dest, upper-cased.
std::string env_name(const std::string& flag) {
  std::string name = "PET_";
  for (size_t i = flag.find_first_not_of('-'); i < flag.size(); ++i) {
    name +=
        flag[i] == '-' ? '_' : static_cast<char>(std::toupper(static_cast<unsigned char>(flag[i])));
  }
  return name;
}

/// The value of `key` in "KEY=VALUE" entries; nullopt when absent or empty.
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
  /// --signals-to-handle's list of names.
  bool parse_signals(const std::string& name, const std::string& value);
  /// --rdzv-conf's "key=value,..." settings.
  bool parse_rdzv_conf(const std::string& name, const std::string& value);
  /// Puts the interpreter in front of a Python script or module, as torchrun.
  bool python_command();
  /// Checks the flags against one another and fills in what depends on several.
  bool finish();
  /// Makes the result the error `message`; false, for `return fail(...)`.
  bool fail(const std::string& message) {
    result_ = error_result(message);
    return false;
  }
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

std::string Parser::list_given(std::initializer_list<Flag> flags) const {
  std::string out;
  for (const Flag flag : flags) {
    if (!given(flag)) continue;
    out += (out.empty() ? "" : ", ") + given_.at(flag);
  }
  return out;
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

ParseResult Parser::parse(const std::vector<std::string>& args) {
  if (!apply_environment()) return result_;
  size_t i = 0;
  for (; i < args.size(); ++i) {
    const std::string& arg = args[i];
    if (arg == "--") {
      ++i;
      break;
    }
    if (arg.size() < 2 || arg[0] != '-') break;  // The program name.

    std::string name = arg;
    std::optional<std::string> value;
    const FlagSpec* short_spec = arg[1] != '-' ? find_flag(arg.substr(0, 2)) : nullptr;
    if (short_spec != nullptr && short_spec->takes_value && arg.size() > 2) {
      // argparse's "-r3" and "-r=3".
      name = arg.substr(0, 2);
      value = arg.substr(arg[2] == '=' ? 3 : 2);
    } else if (const size_t eq = arg.find('='); eq != std::string::npos) {
      name = arg.substr(0, eq);
      value = arg.substr(eq + 1);
    }
    const FlagSpec* spec = find_flag(canonical_flag_name(name));
    if (spec == nullptr) return error_result("unknown flag '" + name + "'");
    if (!spec->takes_value && value) {
      return error_result(name + " does not take a value (got '" + *value + "')");
    }
    if (spec->takes_value && !value) {
      if (i + 1 >= args.size()) return error_result(name + ": missing value");
      value = args[++i];
    }
    if (!apply(*spec, name, value)) return result_;
    if (result_.kind == ParseResult::Kind::kHelp) return result_;
  }

  opts_.command.assign(args.begin() + static_cast<long>(i), args.end());
  if (opts_.command.empty()) return error_result("missing the program to run");
  if (!finish()) return result_;
  result_.kind = ParseResult::Kind::kRun;
  return result_;
}

bool Parser::apply(const FlagSpec& spec, const std::string& name,
                   const std::optional<std::string>& value) {
  given_[spec.flag] = name;
  switch (spec.flag) {
    case Flag::kNprocPerNode: {
      if (*value == "gpu" || *value == "cpu" || *value == "auto") {
        opts_.nproc_per_node_device = *value;
        break;
      }
      auto n = parse_int(*value, 1, 1 << 20);
      if (!n) return fail(bad_value(name, *value, "must be >= 1, gpu, cpu or auto"));
      opts_.nproc_per_node = static_cast<int>(*n);
      opts_.nproc_per_node_device.clear();
      break;
    }
    case Flag::kNnodes: {
      // torchrun's N, or MIN:MAX: as many nodes as join, MIN to MAX.
      const size_t colon = value->find(':');
      const auto low = parse_int(value->substr(0, colon), 1, 1 << 20);
      const auto high =
          colon == std::string::npos ? low : parse_int(value->substr(colon + 1), 1, 1 << 20);
      if (!low || !high || *low > *high) {
        return fail(
            bad_value(name, *value, "must be a count >= 1, or MIN:MAX with 1 <= MIN <= MAX"));
      }
      opts_.nnodes = static_cast<int>(*high);
      opts_.min_nnodes = *low < *high ? static_cast<int>(*low) : 0;
      break;
    }
    case Flag::kNodeRank: {
      auto n = parse_int(*value, 0, std::numeric_limits<int>::max());
      if (!n) return fail(bad_value(name, *value, "must be >= 0"));
      opts_.node_rank = static_cast<int>(*n);
      break;
    }
    case Flag::kMasterAddr:
      if (value->empty()) return fail(bad_value(name, *value, "must not be empty"));
      opts_.master_addr = *value;
      break;
    case Flag::kMasterPort: {
      auto port = parse_int(*value, 1, 65535);
      if (!port) return fail(bad_value(name, *value, "must be in 1..65535"));
      opts_.master_port = static_cast<int>(*port);
      break;
    }
    case Flag::kLocalAddr:
      // It travels in one word of the rendezvous' answer to the other nodes.
      if (value->empty() || value->find_first_of(" \t\r\n") != std::string::npos) {
        return fail(bad_value(name, *value, "must be one host name or address"));
      }
      opts_.local_addr = *value;
      break;
    case Flag::kStandalone:
      opts_.standalone = true;
      break;
    case Flag::kMaxRestarts: {
      auto n = parse_int(*value, 0, std::numeric_limits<int>::max());
      if (!n) return fail(bad_value(name, *value, "must be >= 0"));
      opts_.max_restarts = static_cast<int>(*n);
      break;
    }
    case Flag::kKillTimeout: {
      const auto seconds = parse_seconds(*value);
      if (!seconds) return fail(bad_value(name, *value, "must be a number of seconds >= 0"));
      opts_.kill_timeout_s = *seconds;
      break;
    }
    case Flag::kSignalsToHandle:
      return parse_signals(name, *value);
    case Flag::kNoPrefix:
      opts_.prefix_output = false;
      break;
    case Flag::kLogLinePrefixTemplate:
      opts_.log_line_prefix_template = *value;
      break;
    case Flag::kRdzvBackend:
      if (*value == "etcd" || *value == "etcd-v2") {
        return fail(bad_value(name, *value,
                              "fsdprun has no etcd rendezvous: use c10d, which fsdprun serves "
                              "at --rdzv-endpoint"));
      }
      if (*value != "static" && *value != "c10d") {
        return fail(bad_value(name, *value, "must be static or c10d"));
      }
      opts_.rdzv_backend = *value;
      break;
    case Flag::kRdzvEndpoint:
      if (!parse_endpoint(*value, &opts_.rdzv_host, &opts_.rdzv_port, &endpoint_port_given_)) {
        return fail(
            bad_value(name, *value, "expected HOST, HOST:PORT or [IPv6]:PORT, port 0..65535"));
      }
      endpoint_ = *value;
      break;
    case Flag::kRdzvId:
      if (value->empty() || value->find('\n') != std::string::npos) {
        return fail(bad_value(name, *value, "must be one non-empty line"));
      }
      opts_.rdzv_id = *value;
      break;
    case Flag::kRdzvConf:
      return parse_rdzv_conf(name, *value);
    case Flag::kLogDir:
      if (value->empty()) return fail(bad_value(name, *value, "must not be empty"));
      opts_.log_dir = *value;
      break;
    case Flag::kRedirects:
    case Flag::kTee:
      if (!parse_stream_spec(*value, spec.flag == Flag::kTee ? &opts_.tee : &opts_.redirects)) {
        return fail(bad_value(
            name, *value,
            "expected 0 (none), 1 (stdout), 2 (stderr), 3 (both), or per local rank: 0:3,1:2"));
      }
      break;
    case Flag::kMonitorInterval:
      // torchrun polls its workers this often; fsdprun is woken by SIGCHLD.
      if (!parse_seconds(*value)) {
        return fail(bad_value(name, *value, "must be a number of seconds >= 0"));
      }
      break;
    case Flag::kStartMethod:
      result_.warnings.push_back(name + " " + *value +
                                 " is ignored: it chooses how Python starts its workers, and "
                                 "fsdprun runs programs");
      break;
    case Flag::kRole:
      if (value->empty()) return fail(bad_value(name, *value, "must not be empty"));
      opts_.role = *value;
      break;
    case Flag::kModule:
    case Flag::kRunPath:
      break;  // finish() puts the interpreter in front of the program
    case Flag::kNoPython:
      // torchrun's "run the program itself, not through python".
      no_python_ = true;
      break;
    case Flag::kNoEffect:
      result_.warnings.push_back(name + " has no effect under fsdprun: " + spec.why);
      break;
    case Flag::kLocalRanksFilter: {
      opts_.local_ranks_filter.clear();
      std::istringstream ranks(*value);
      std::string item;
      while (std::getline(ranks, item, ',')) {
        const auto local_rank = parse_int(item, 0, 1 << 20);
        if (!local_rank) {
          return fail(bad_value(name, *value, "expected local ranks such as 0 or 0,1,3"));
        }
        opts_.local_ranks_filter.push_back(static_cast<int>(*local_rank));
      }
      if (opts_.local_ranks_filter.empty()) {
        return fail(bad_value(name, *value, "expected local ranks such as 0 or 0,1,3"));
      }
      break;
    }
    case Flag::kHelp:
      result_.kind = ParseResult::Kind::kHelp;
      break;
  }
  return true;
}

bool Parser::parse_signals(const std::string& name, const std::string& value) {
  std::string choices;
  for (const int signo : kForwardable)
    choices += (choices.empty() ? "" : ", ") + signal_name(signo);
  opts_.signals_to_handle.clear();
  std::istringstream items(value);
  std::string item;
  while (std::getline(items, item, ',')) {
    // torchrun strips each name.
    item.erase(0, item.find_first_not_of(" \t"));
    item.erase(item.find_last_not_of(" \t") + 1);
    if (item.empty()) continue;
    const int signo = signal_number(item);
    if (std::find(std::begin(kForwardable), std::end(kForwardable), signo) ==
        std::end(kForwardable)) {
      return fail(bad_value(name, value, "'" + item + "' is not one of " + choices));
    }
    auto& handled = opts_.signals_to_handle;
    if (std::find(handled.begin(), handled.end(), signo) == handled.end()) handled.push_back(signo);
  }
  if (opts_.signals_to_handle.empty()) {
    return fail(bad_value(name, value, "name one or more of " + choices));
  }
  return true;
}

bool Parser::parse_rdzv_conf(const std::string& name, const std::string& value) {
  // "key=value,...": join_timeout, last_call_timeout and is_host are
  // fsdprun's; the others are the c10d store's own and have nothing to act
  // on here. A later --rdzv-conf replaces an earlier one, as in argparse.
  const LaunchOptions defaults;
  opts_.join_timeout_s = defaults.join_timeout_s;
  opts_.last_call_timeout_s = defaults.last_call_timeout_s;
  opts_.rdzv_is_host.reset();
  std::istringstream pairs(value);
  std::string pair;
  while (std::getline(pairs, pair, ',')) {
    const size_t eq_at = pair.find('=');
    const std::string key = pair.substr(0, eq_at);
    const std::string setting = eq_at == std::string::npos ? "" : pair.substr(eq_at + 1);
    if (key == "join_timeout") {
      const auto seconds = parse_seconds(setting);
      if (!seconds || *seconds == 0) {
        return fail(bad_value(name, value, "join_timeout must be a number of seconds > 0"));
      }
      opts_.join_timeout_s = *seconds;
    } else if (key == "last_call_timeout") {
      const auto seconds = parse_seconds(setting);
      if (!seconds) {
        return fail(bad_value(name, value, "last_call_timeout must be a number of seconds >= 0"));
      }
      opts_.last_call_timeout_s = *seconds;
    } else if (key == "is_host") {
      // torchrun's spellings of a boolean (RendezvousParameters.get_as_bool).
      std::string word = setting;
      for (char& c : word) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
      if (word == "1" || word == "true" || word == "t" || word == "yes" || word == "y") {
        opts_.rdzv_is_host = true;
      } else if (word == "0" || word == "false" || word == "f" || word == "no" || word == "n") {
        opts_.rdzv_is_host = false;
      } else {
        return fail(bad_value(name, value, "is_host must be 1 or 0"));
      }
    } else if (!key.empty()) {
      result_.warnings.push_back(
          name + ": '" + key +
          "' is ignored (fsdprun reads join_timeout, last_call_timeout and is_host)");
    }
  }
  return true;
}

bool Parser::finish() {
  auto& warnings = result_.warnings;
  if (!opts_.log_dir.empty() && !opts_.redirects.any() && !opts_.tee.any()) {
    warnings.push_back(
        "--log-dir writes nothing without --redirects or --tee (as torchrun's, but for its "
        "error files)");
  }
  if (opts_.min_nnodes > 0 && (opts_.rdzv_backend != "c10d" || opts_.standalone)) {
    return fail(
        "--nnodes " + std::to_string(opts_.min_nnodes) + ":" + std::to_string(opts_.nnodes) +
        ": a number of nodes agreed as they join needs --rdzv-backend c10d and --rdzv-endpoint");
  }
  if (opts_.standalone) {
    // --standalone means "one node, rendezvous on this machine"; silently
    // overriding a multi-node setup the user typed would hide a mistake.
    if ((given(Flag::kNnodes) && opts_.nnodes != 1) ||
        (given(Flag::kNodeRank) && opts_.node_rank != 0)) {
      return fail(shown(Flag::kStandalone, "--standalone") +
                  ": cannot be combined with --nnodes > 1 or --node-rank > 0");
    }
    // Where the ranks meet, torchrun's --standalone overrides (silently).
    const std::string ignored =
        list_given({Flag::kMasterAddr, Flag::kMasterPort, Flag::kRdzvBackend, Flag::kRdzvEndpoint,
                    Flag::kRdzvId});
    if (!ignored.empty()) {
      warnings.push_back(shown(Flag::kStandalone, "--standalone") + " ignores " + ignored +
                         ": the ranks meet at 127.0.0.1 on a free port, under a random "
                         "TORCHELASTIC_RUN_ID (as torchrun's)");
    }
    const LaunchOptions defaults;
    opts_.master_addr = defaults.master_addr;
    opts_.master_port.reset();
    opts_.rdzv_backend = "static";
    endpoint_.reset();
  }
  if (opts_.rdzv_backend == "static" && endpoint_) {
    // torchrun's static backend meets at the endpoint when one is given.
    if (given(Flag::kMasterAddr) || given(Flag::kMasterPort)) {
      warnings.push_back(list_given({Flag::kMasterAddr, Flag::kMasterPort}) +
                         ": ignored, the nodes meet at " + shown(Flag::kRdzvEndpoint, "") + " " +
                         *endpoint_ + " (as torchrun)");
    }
    opts_.master_addr = opts_.rdzv_host;
    opts_.master_port.reset();
    if (endpoint_port_given_ && opts_.rdzv_port > 0) opts_.master_port = opts_.rdzv_port;
  }
  if (opts_.rdzv_backend == "c10d") {
    if (given(Flag::kMasterAddr) || given(Flag::kMasterPort)) {
      warnings.push_back(
          "--master-addr and --master-port are ignored with --rdzv-backend c10d: the job meets "
          "at --rdzv-endpoint (as torchrun)");
    }
    opts_.master_addr = opts_.rdzv_host;
    opts_.master_port.reset();
    if (opts_.rdzv_port > 0) opts_.master_port = opts_.rdzv_port;
    if (opts_.nnodes > 1) {
      if (opts_.rdzv_port == 0) {
        return fail(bad_value("--rdzv-endpoint", endpoint_.value_or(""),
                              "a job of several nodes needs a port every node knows"));
      }
      if (!endpoint_) {
        warnings.push_back(
            "--rdzv-backend c10d without --rdzv-endpoint meets at localhost:29400, which "
            "reaches no other host: name node 0's host there");
      }
      if (given(Flag::kNodeRank)) {
        warnings.push_back(
            "--node-rank is ignored with --rdzv-backend c10d: node ranks are assigned as the "
            "nodes join (as torchrun)");
      }
      opts_.node_rank = 0;  // until the rendezvous assigns it
    }
  }
  if (opts_.node_rank >= opts_.nnodes) {
    return fail(bad_value(shown(Flag::kNodeRank, "--node-rank"), std::to_string(opts_.node_rank),
                          "must be in [0, " + std::to_string(opts_.nnodes) + ") for --nnodes " +
                              std::to_string(opts_.nnodes)));
  }
  if (!opts_.master_port && opts_.nnodes > 1) opts_.master_port = kDefaultMultiNodePort;
  if (!opts_.local_addr.empty() && !opts_.assigns_node_ranks()) {
    warnings.push_back(shown(Flag::kLocalAddr, "--local-addr") +
                       " has no effect here: it names node 0's MASTER_ADDR at the c10d "
                       "rendezvous of several nodes; here the ranks meet at " +
                       opts_.master_addr);
  }
  return python_command();
}

bool Parser::python_command() {
  // torchrun runs its script through Python unless told --no-python (which
  // --run-path overrides); a program that is not a .py script runs itself,
  // as fsdprun always has, torchrun's command lines giving it --no-python.
  const std::string& program = opts_.command[0];
  const bool script = program.size() > 3 && program.compare(program.size() - 3, 3, ".py") == 0;
  const bool module = given(Flag::kModule);
  if (module && no_python_ && !given(Flag::kRunPath)) {
    return fail(shown(Flag::kModule, "--module") + " runs a module through Python, which " +
                shown(Flag::kNoPython, "--no-python") + " forbids: give one of them");
  }
  if (!given(Flag::kRunPath) && (no_python_ || (!script && !module))) return true;
  opts_.python_script = program;
  std::vector<std::string> interpreter = {lookup(env_, "PYTHON_EXEC").value_or("python3"), "-u"};
  // torchrun's --run-path runs the script, not a module, whatever -m says.
  if (module && !given(Flag::kRunPath)) interpreter.push_back("-m");
  opts_.command.insert(opts_.command.begin(), interpreter.begin(), interpreter.end());
  return true;
}

}  // namespace

ParseResult parse_options(const std::vector<std::string>& args,
                          const std::vector<std::string>& env) {
  return Parser(env).parse(args);
}

std::vector<std::string> flag_names() {
  std::vector<std::string> names;
  for (const FlagSpec& spec : kFlags) names.emplace_back(spec.name);
  return names;
}

}  // namespace fsdp::launch
