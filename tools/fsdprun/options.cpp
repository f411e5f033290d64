#include "options.h"

#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <sstream>

namespace fsdp::launch {
namespace {

/// The flags fsdprun understands, in their canonical '-' spelling.
enum class Flag {
  kNprocPerNode,
  kNnodes,
  kNodeRank,
  kMasterAddr,
  kMasterPort,
  kStandalone,
  kMaxRestarts,
  kKillTimeout,
  kNoPrefix,
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
  kPythonOnly,
  kHelp,
};

/// One row of the flag table.
struct FlagSpec {
  const char* name;
  Flag flag;
  bool takes_value;
};

constexpr FlagSpec kFlags[] = {
    {"--nproc-per-node", Flag::kNprocPerNode, true},
    {"--nnodes", Flag::kNnodes, true},
    {"--node-rank", Flag::kNodeRank, true},
    {"--master-addr", Flag::kMasterAddr, true},
    {"--master-port", Flag::kMasterPort, true},
    {"--standalone", Flag::kStandalone, false},
    {"--max-restarts", Flag::kMaxRestarts, true},
    {"--kill-timeout", Flag::kKillTimeout, true},
    {"--no-prefix", Flag::kNoPrefix, false},
    {"--rdzv-backend", Flag::kRdzvBackend, true},
    {"--rdzv-endpoint", Flag::kRdzvEndpoint, true},
    {"--rdzv-id", Flag::kRdzvId, true},
    {"--rdzv-conf", Flag::kRdzvConf, true},
    {"--no-python", Flag::kNoPython, false},
    {"--local-ranks-filter", Flag::kLocalRanksFilter, true},
    {"--log-dir", Flag::kLogDir, true},
    {"--redirects", Flag::kRedirects, true},
    {"-r", Flag::kRedirects, true},
    {"--tee", Flag::kTee, true},
    {"-t", Flag::kTee, true},
    {"--monitor-interval", Flag::kMonitorInterval, true},
    {"--start-method", Flag::kStartMethod, true},
    {"--role", Flag::kRole, true},
    {"--module", Flag::kPythonOnly, false},
    {"-m", Flag::kPythonOnly, false},
    {"--run-path", Flag::kPythonOnly, false},
    {"--help", Flag::kHelp, false},
    {"-h", Flag::kHelp, false},
};

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

}  // namespace

ParseResult parse_options(const std::vector<std::string>& args) {
  ParseResult result;
  LaunchOptions& opts = result.options;
  // Remember what was given explicitly: --standalone conflicts only with
  // flags the user actually typed, not with their defaults.
  bool nnodes_given = false;
  bool node_rank_given = false;
  bool master_addr_given = false;
  std::optional<std::string> endpoint;
  bool endpoint_port_given = false;

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
    const size_t eq = arg.find('=');
    if (eq != std::string::npos) {
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

    switch (spec->flag) {
      case Flag::kNprocPerNode: {
        if (*value == "gpu" || *value == "cpu" || *value == "auto") {
          opts.nproc_per_node_device = *value;
          break;
        }
        auto n = parse_int(*value, 1, 1 << 20);
        if (!n) return error_result(bad_value(name, *value, "must be >= 1, gpu, cpu or auto"));
        opts.nproc_per_node = static_cast<int>(*n);
        opts.nproc_per_node_device.clear();
        break;
      }
      case Flag::kNnodes: {
        // torchrun's N, or MIN:MAX: as many nodes as join, MIN to MAX.
        const size_t colon = value->find(':');
        const auto low = parse_int(value->substr(0, colon), 1, 1 << 20);
        const auto high =
            colon == std::string::npos ? low : parse_int(value->substr(colon + 1), 1, 1 << 20);
        if (!low || !high || *low > *high) {
          return error_result(
              bad_value(name, *value, "must be a count >= 1, or MIN:MAX with 1 <= MIN <= MAX"));
        }
        opts.nnodes = static_cast<int>(*high);
        opts.min_nnodes = *low < *high ? static_cast<int>(*low) : 0;
        nnodes_given = true;
        break;
      }
      case Flag::kNodeRank: {
        auto n = parse_int(*value, 0, std::numeric_limits<int>::max());
        if (!n) return error_result(bad_value(name, *value, "must be >= 0"));
        opts.node_rank = static_cast<int>(*n);
        node_rank_given = true;
        break;
      }
      case Flag::kMasterAddr:
        if (value->empty()) {
          return error_result(bad_value(name, *value, "must not be empty"));
        }
        opts.master_addr = *value;
        master_addr_given = true;
        break;
      case Flag::kMasterPort: {
        auto port = parse_int(*value, 1, 65535);
        if (!port) {
          return error_result(bad_value(name, *value, "must be in 1..65535"));
        }
        opts.master_port = static_cast<int>(*port);
        break;
      }
      case Flag::kStandalone:
        opts.standalone = true;
        break;
      case Flag::kMaxRestarts: {
        auto n = parse_int(*value, 0, std::numeric_limits<int>::max());
        if (!n) return error_result(bad_value(name, *value, "must be >= 0"));
        opts.max_restarts = static_cast<int>(*n);
        break;
      }
      case Flag::kKillTimeout: {
        const auto seconds = parse_seconds(*value);
        if (!seconds) {
          return error_result(bad_value(name, *value, "must be a number of seconds >= 0"));
        }
        opts.kill_timeout_s = *seconds;
        break;
      }
      case Flag::kNoPrefix:
        opts.prefix_output = false;
        break;
      case Flag::kRdzvBackend:
        if (*value == "etcd" || *value == "etcd-v2") {
          return error_result(bad_value(name, *value,
                                        "fsdprun has no etcd rendezvous: use c10d, which "
                                        "fsdprun serves at --rdzv-endpoint"));
        }
        if (*value != "static" && *value != "c10d") {
          return error_result(bad_value(name, *value, "must be static or c10d"));
        }
        opts.rdzv_backend = *value;
        break;
      case Flag::kRdzvEndpoint:
        if (!parse_endpoint(*value, &opts.rdzv_host, &opts.rdzv_port, &endpoint_port_given)) {
          return error_result(
              bad_value(name, *value, "expected HOST, HOST:PORT or [IPv6]:PORT, port 0..65535"));
        }
        endpoint = *value;
        break;
      case Flag::kRdzvId:
        if (value->empty() || value->find('\n') != std::string::npos) {
          return error_result(bad_value(name, *value, "must be one non-empty line"));
        }
        opts.rdzv_id = *value;
        break;
      case Flag::kRdzvConf: {
        // "key=value,...": join_timeout is fsdprun's; the others are the
        // c10d store's own and have nothing to act on here.
        std::istringstream pairs(*value);
        std::string pair;
        while (std::getline(pairs, pair, ',')) {
          const size_t eq_at = pair.find('=');
          const std::string key = pair.substr(0, eq_at);
          const std::string setting = eq_at == std::string::npos ? "" : pair.substr(eq_at + 1);
          if (key == "join_timeout") {
            const auto seconds = parse_seconds(setting);
            if (!seconds || *seconds == 0) {
              return error_result(
                  bad_value(name, *value, "join_timeout must be a number of seconds > 0"));
            }
            opts.join_timeout_s = *seconds;
          } else if (key == "last_call_timeout") {
            const auto seconds = parse_seconds(setting);
            if (!seconds) {
              return error_result(
                  bad_value(name, *value, "last_call_timeout must be a number of seconds >= 0"));
            }
            opts.last_call_timeout_s = *seconds;
          } else if (key == "is_host") {
            // torchrun's spellings of a boolean (RendezvousParameters.get_as_bool).
            std::string word = setting;
            for (char& c : word) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
            if (word == "1" || word == "true" || word == "t" || word == "yes" || word == "y") {
              opts.rdzv_is_host = true;
            } else if (word == "0" || word == "false" || word == "f" || word == "no" ||
                       word == "n") {
              opts.rdzv_is_host = false;
            } else {
              return error_result(bad_value(name, *value, "is_host must be 1 or 0"));
            }
          } else if (!key.empty()) {
            result.warnings.push_back(
                name + ": '" + key +
                "' is ignored (fsdprun reads join_timeout, last_call_timeout and is_host)");
          }
        }
        break;
      }
      case Flag::kLogDir:
        if (value->empty()) return error_result(bad_value(name, *value, "must not be empty"));
        opts.log_dir = *value;
        break;
      case Flag::kRedirects:
      case Flag::kTee:
        if (!parse_stream_spec(*value, spec->flag == Flag::kTee ? &opts.tee : &opts.redirects)) {
          return error_result(bad_value(
              name, *value,
              "expected 0 (none), 1 (stdout), 2 (stderr), 3 (both), or per local rank: 0:3,1:2"));
        }
        break;
      case Flag::kMonitorInterval:
        // torchrun polls its workers this often; fsdprun is woken by SIGCHLD.
        if (!parse_seconds(*value)) {
          return error_result(bad_value(name, *value, "must be a number of seconds >= 0"));
        }
        break;
      case Flag::kStartMethod:
        result.warnings.push_back(name + " " + *value +
                                  " is ignored: it chooses how Python starts its workers, and "
                                  "fsdprun runs programs");
        break;
      case Flag::kRole:
        if (value->empty()) return error_result(bad_value(name, *value, "must not be empty"));
        opts.role = *value;
        break;
      case Flag::kPythonOnly:
        return error_result(name +
                            ": fsdprun runs a program, not Python code; start the interpreter "
                            "as that program (fsdprun ... python3 -m MODULE, or python3 "
                            "SCRIPT)");
      case Flag::kNoPython:
        // torchrun's "run the program itself, not through python": fsdprun
        // always does, so command lines written for torchrun work unchanged.
        break;
      case Flag::kLocalRanksFilter: {
        opts.local_ranks_filter.clear();
        std::istringstream ranks(*value);
        std::string item;
        while (std::getline(ranks, item, ',')) {
          const auto local_rank = parse_int(item, 0, 1 << 20);
          if (!local_rank) {
            return error_result(bad_value(name, *value, "expected local ranks such as 0 or 0,1,3"));
          }
          opts.local_ranks_filter.push_back(static_cast<int>(*local_rank));
        }
        if (opts.local_ranks_filter.empty()) {
          return error_result(bad_value(name, *value, "expected local ranks such as 0 or 0,1,3"));
        }
        break;
      }
      case Flag::kHelp:
        result.kind = ParseResult::Kind::kHelp;
        return result;
    }
  }

  opts.command.assign(args.begin() + static_cast<long>(i), args.end());
  if (opts.command.empty()) {
    return error_result("missing the program to run");
  }
  if (!opts.log_dir.empty() && !opts.redirects.any() && !opts.tee.any()) {
    result.warnings.push_back(
        "--log-dir writes nothing without --redirects or --tee (as torchrun's, but for its "
        "error files)");
  }
  if (opts.min_nnodes > 0 && (opts.rdzv_backend != "c10d" || opts.standalone)) {
    return error_result(
        "--nnodes " + std::to_string(opts.min_nnodes) + ":" + std::to_string(opts.nnodes) +
        ": a number of nodes agreed as they join needs --rdzv-backend c10d and --rdzv-endpoint");
  }
  if (opts.standalone && endpoint) {
    return error_result(
        "--standalone: cannot be combined with --rdzv-endpoint (it picks 127.0.0.1 and a free "
        "port)");
  }
  if (opts.standalone) opts.rdzv_backend = "static";  // as torchrun, which ignores the others
  if (opts.rdzv_backend == "static" && endpoint) {
    // torchrun's static backend meets at the endpoint when one is given.
    if (master_addr_given || opts.master_port) {
      return error_result(
          "--rdzv-endpoint: give rank 0's node either as --rdzv-endpoint or as --master-addr "
          "and --master-port, not both");
    }
    opts.master_addr = opts.rdzv_host;
    if (endpoint_port_given && opts.rdzv_port > 0) {
      opts.master_port = opts.rdzv_port;
    }
  }
  if (opts.rdzv_backend == "c10d") {
    if (master_addr_given || opts.master_port) {
      result.warnings.push_back(
          "--master-addr and --master-port are ignored with --rdzv-backend c10d: the job meets "
          "at --rdzv-endpoint (as torchrun)");
    }
    opts.master_addr = opts.rdzv_host;
    opts.master_port.reset();
    if (opts.rdzv_port > 0) opts.master_port = opts.rdzv_port;
    if (opts.nnodes > 1) {
      if (opts.rdzv_port == 0) {
        return error_result(bad_value("--rdzv-endpoint", endpoint.value_or(""),
                                      "a job of several nodes needs a port every node knows"));
      }
      if (!endpoint) {
        result.warnings.push_back(
            "--rdzv-backend c10d without --rdzv-endpoint meets at localhost:29400, which "
            "reaches no other host: name node 0's host there");
      }
      if (node_rank_given) {
        result.warnings.push_back(
            "--node-rank is ignored with --rdzv-backend c10d: node ranks are assigned as the "
            "nodes join (as torchrun)");
      }
      opts.node_rank = 0;  // until the rendezvous assigns it
    }
  }
  if (opts.node_rank >= opts.nnodes) {
    return error_result(bad_value("--node-rank", std::to_string(opts.node_rank),
                                  "must be in [0, " + std::to_string(opts.nnodes) +
                                      ") for --nnodes " + std::to_string(opts.nnodes)));
  }
  if (opts.standalone) {
    // --standalone means "one node, rendezvous on this machine"; silently
    // overriding a multi-node setup the user typed would hide a mistake.
    if ((nnodes_given && opts.nnodes != 1) || (node_rank_given && opts.node_rank != 0)) {
      return error_result(
          "--standalone: cannot be combined with --nnodes > 1 or --node-rank "
          "> 0");
    }
    if (master_addr_given || opts.master_port) {
      return error_result(
          "--standalone: cannot be combined with --master-addr or "
          "--master-port (it picks 127.0.0.1 and a free port)");
    }
  }
  if (!opts.master_port && opts.nnodes > 1) {
    opts.master_port = kDefaultMultiNodePort;
  }
  result.kind = ParseResult::Kind::kRun;
  return result;
}

std::vector<std::string> flag_names() {
  std::vector<std::string> names;
  for (const FlagSpec& spec : kFlags) names.emplace_back(spec.name);
  return names;
}

}  // namespace fsdp::launch
