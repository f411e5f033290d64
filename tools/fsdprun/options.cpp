#include "options.h"

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <sstream>

namespace fsdp::launch {
namespace {

/// torchrun's default rendezvous port; every node must compute the same one,
/// so a multi-node job cannot pick a random free port.
constexpr int kDefaultMultiNodePort = 29500;

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

}  // namespace

ParseResult parse_options(const std::vector<std::string>& args) {
  ParseResult result;
  LaunchOptions& opts = result.options;
  // Remember what was given explicitly: --standalone conflicts only with
  // flags the user actually typed, not with their defaults.
  bool nnodes_given = false;
  bool node_rank_given = false;
  bool master_addr_given = false;

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
        auto n = parse_int(*value, 1, 1 << 20);
        if (!n) return error_result(bad_value(name, *value, "must be >= 1"));
        opts.nproc_per_node = static_cast<int>(*n);
        break;
      }
      case Flag::kNnodes: {
        auto n = parse_int(*value, 1, 1 << 20);
        if (!n) {
          return error_result(
              bad_value(name, *value, "must be an integer >= 1; MIN:MAX is unsupported"));
        }
        opts.nnodes = static_cast<int>(*n);
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
        errno = 0;
        char* end = nullptr;
        const double seconds = std::strtod(value->c_str(), &end);
        if (value->empty() || errno != 0 || end != value->c_str() + value->size() ||
            !std::isfinite(seconds) || seconds < 0 || seconds > 1e6) {
          return error_result(bad_value(name, *value, "must be a number of seconds >= 0"));
        }
        opts.kill_timeout_s = seconds;
        break;
      }
      case Flag::kNoPrefix:
        opts.prefix_output = false;
        break;
      case Flag::kHelp:
        result.kind = ParseResult::Kind::kHelp;
        return result;
    }
  }

  opts.command.assign(args.begin() + static_cast<long>(i), args.end());
  if (opts.command.empty()) {
    return error_result("missing the program to run");
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

std::string usage_text() {
  std::ostringstream out;
  out << "Usage: fsdprun [options] [--] program [program args...]\n"
         "\n"
         "Starts --nproc-per-node copies of `program` (found via PATH) on this "
         "node,\n"
         "like PyTorch's torchrun. Option parsing stops at `--` or at the "
         "program\n"
         "name, so the program's own flags pass through untouched. Multi-word "
         "flags\n"
         "may also be written with '_' (--nproc_per_node) and as "
         "--flag=value.\n"
         "\n"
         "Options:\n"
         "  --nproc-per-node N   ranks to start on this node (default 1)\n"
         "  --nnodes M           number of nodes in the job (default 1)\n"
         "  --node-rank R        this node's index, 0 <= R < M (default 0)\n"
         "  --master-addr A      address of the rank-0 node (default "
         "127.0.0.1)\n"
         "  --master-port P      rendezvous port, 1..65535 (default: a free "
         "port\n"
         "                       when --nnodes is 1, else "
      << kDefaultMultiNodePort
      << ")\n"
         "  --standalone         single-node job on 127.0.0.1 with a free "
         "port\n"
         "  --max-restarts K     restart all ranks up to K times after a "
         "failure\n"
         "                       (default 0)\n"
         "  --kill-timeout S     seconds between SIGTERM and SIGKILL when "
         "stopping\n"
         "                       ranks (default 10)\n"
         "  --no-prefix          do not prefix output lines with "
         "\"[rank<N>]: \"\n"
         "  -h, --help           show this help and exit\n"
         "\n"
         "Each rank's environment: RANK, LOCAL_RANK, WORLD_SIZE, "
         "LOCAL_WORLD_SIZE,\n"
         "GROUP_RANK, ROLE_RANK, ROLE_WORLD_SIZE, MASTER_ADDR, MASTER_PORT,\n"
         "TORCHELASTIC_RESTART_COUNT, TORCHELASTIC_MAX_RESTARTS, and "
         "OMP_NUM_THREADS=1\n"
         "when N > 1 and it is not already set, and FSDPRUN_STDOUT_TTY=1 when\n"
         "fsdprun's stdout is a terminal (the ranks' own stdout is a pipe).\n"
         "\n"
         "FSDP_JOB_TOKEN, the secret every rank presents on each connection: kept\n"
         "when set; else made at random for a one-node job. With --nnodes > 1 it\n"
         "must be set, the same on every node: export FSDP_JOB_TOKEN=$(openssl rand -hex 16)\n"
         "\n"
         "SIGINT, SIGTERM and SIGHUP are forwarded to every rank's process "
         "group;\n"
         "fsdprun then exits with 128+signal. If a rank fails, the others are\n"
         "stopped and fsdprun exits with that rank's status.\n";
  return out.str();
}

}  // namespace fsdp::launch
