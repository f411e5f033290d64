// parse_options(): the walk over the command line and what each flag sets.

#include "options.h"

#include <limits>
#include <sstream>

#include "options_parser.h"
#include "options_values.h"

namespace fsdp::launch {
namespace detail {

namespace {
// torchrun's form of an IPv6 address, "[::1]": the ranks and sockets get "::1".
std::string unbracketed(const std::string& addr) {
  if (addr.size() > 2 && addr.front() == '[' && addr.back() == ']') {
    return addr.substr(1, addr.size() - 2);
  }
  return addr;
}
}  // namespace

ParseResult error_result(const std::string& message) {
  ParseResult result;
  result.kind = ParseResult::Kind::kError;
  result.error = message;
  return result;
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
      opts_.master_addr = unbracketed(*value);
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
      opts_.local_addr = unbracketed(*value);
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
    case Flag::kSignalsToHandle: {
      std::string why;
      if (!parse_signals(*value, &opts_.signals_to_handle, &why)) {
        return fail(bad_value(name, *value, why));
      }
      break;
    }
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
    case Flag::kRdzvConf: {
      std::string why;
      std::vector<std::string> ignored_keys;
      if (!parse_rdzv_conf(*value, &opts_, &ignored_keys, &why)) {
        return fail(bad_value(name, *value, why));
      }
      for (const std::string& key : ignored_keys) {
        result_.warnings.push_back(
            name + ": '" + key +
            "' is ignored (fsdprun reads join_timeout, last_call_timeout and is_host)");
      }
      break;
    }
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

}  // namespace detail

ParseResult parse_options(const std::vector<std::string>& args,
                          const std::vector<std::string>& env) {
  return detail::Parser(env).parse(args);
}

}  // namespace fsdp::launch
