#pragma once

// Parsers of single flag values, shared by the command line and PET_ variables.

#include <optional>
#include <string>
#include <vector>

#include "options.h"

namespace fsdp::launch::detail {

/// Parses a whole string as a base-10 integer in [lo, hi]; partial parses
/// such as "3x" or "" are rejected rather than silently truncated.
std::optional<long> parse_int(const std::string& text, long lo, long hi);

/// A number of seconds in (0, 1e6], or nullopt.
std::optional<double> parse_seconds(const std::string& text);

/// Splits "host[:port]" ("[v6 address]:port" for IPv6) as torchrun's
/// parse_rendezvous_endpoint does; the port defaults to 29400. False on a
/// malformed endpoint. `port_given`: whether the text had one.
bool parse_endpoint(const std::string& text, std::string* host, int* port, bool* port_given);

/// torchrun's Std value: "0".."3" for every local rank, or "0:3,1:2".
bool parse_stream_spec(const std::string& text, StreamSpec* spec);

/// --signals-to-handle's comma-separated names into `signals`, each once;
/// false with `why` set when a name is not one fsdprun forwards, or none is given.
bool parse_signals(const std::string& text, std::vector<int>* signals, std::string* why);

/// --rdzv-conf's "key=value,..." into `opts`' join_timeout_s,
/// last_call_timeout_s and rdzv_is_host (reset first: a later --rdzv-conf
/// replaces an earlier one, as in argparse); the keys fsdprun does not read
/// go to `ignored_keys`. False with `why` set on a bad setting.
bool parse_rdzv_conf(const std::string& text, LaunchOptions* opts,
                     std::vector<std::string>* ignored_keys, std::string* why);

/// "--flag: invalid value 'v' (why)".
std::string bad_value(const std::string& flag, const std::string& value, const std::string& why);

}  // namespace fsdp::launch::detail
