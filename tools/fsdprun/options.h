#pragma once

// Command-line parsing for fsdprun. Kept free of process and I/O code so the
// parser can be unit-tested on its own.

#include <signal.h>

#include <map>
#include <optional>
#include <string>
#include <vector>

namespace fsdp::launch {

/// torchrun's default port for a static multi-node job; every node must
/// compute the same one, so such a job cannot pick a random free port.
inline constexpr int kDefaultMultiNodePort = 29500;
/// torchrun's default port for --rdzv-backend c10d.
inline constexpr int kDefaultRendezvousPort = 29400;

/// torchrun's --redirects / --tee value: which of a rank's streams (bit 1
/// stdout, bit 2 stderr; 3 both) it applies to, for every local rank ("3")
/// or rank by rank ("0:3,1:2").
struct StreamSpec {
  int all = 0;
  std::map<int, int> by_local_rank;
  /// The streams for `local_rank`.
  int of(int local_rank) const {
    const auto it = by_local_rank.find(local_rank);
    return it != by_local_rank.end() ? it->second : all;
  }
  /// Whether some rank has some stream.
  bool any() const {
    if (all != 0) return true;
    for (const auto& [rank, streams] : by_local_rank) {
      if (streams != 0) return true;
    }
    return false;
  }
};

/// Everything fsdprun was asked to do, after defaults have been applied.
struct LaunchOptions {
  int nproc_per_node = 1;
  /// "" when --nproc-per-node was a number; else torchrun's "gpu", "cpu" or
  /// "auto", which resolve_nproc_per_node() (device_count.h) turns into one.
  std::string nproc_per_node_device;
  /// --nnodes N, or MAX of MIN:MAX until the rendezvous says how many
  /// joined (fsdprun then sets it to that count for the attempt).
  int nnodes = 1;
  /// MIN of --nnodes MIN:MAX (c10d only); 0 for a fixed count.
  int min_nnodes = 0;
  int node_rank = 0;
  std::string master_addr = "127.0.0.1";
  /// Unset means "choose one": a free local port on a single node, 29500
  /// (torchrun's default) when several nodes must agree on it.
  std::optional<int> master_port;
  bool standalone = false;
  int max_restarts = 0;
  /// --shutdown-timeout (or fsdprun's --kill-timeout): seconds between the
  /// signal that stops the ranks and SIGKILL. torchrun's default: the
  /// variable TORCH_ELASTIC_SHUTDOWN_TIMEOUT, else 30.
  double kill_timeout_s = 30.0;
  /// --signals-to-handle: the signals fsdprun forwards to every rank before
  /// stopping them (torchrun's default: SIGTERM, SIGINT, SIGHUP, SIGQUIT).
  std::vector<int> signals_to_handle = {SIGTERM, SIGINT, SIGHUP, SIGQUIT};
  bool prefix_output = true;
  /// --log-line-prefix-template: torchrun's template of each line's prefix
  /// (${rank}, ${local_rank}, ${role_name}, ${hostname}); "" for fsdprun's
  /// "[rank<N>]: ".
  std::string log_line_prefix_template;
  /// torchrun's --rdzv-backend: "static" (each node given its --node-rank)
  /// or "c10d" (node ranks assigned as the nodes join at the endpoint).
  std::string rdzv_backend = "static";
  /// The c10d rendezvous' host and port (--rdzv-endpoint; torchrun's
  /// defaults: localhost, 29400). After it, rank 0's store serves that port.
  std::string rdzv_host = "localhost";
  int rdzv_port = 29400;
  /// --role: the ranks' ROLE_NAME, as torchrun sets it.
  std::string role = "default";
  /// --rdzv-id: every node of the job must give the same (TORCHELASTIC_RUN_ID).
  std::string rdzv_id = "none";
  /// --rdzv-conf join_timeout: how long the nodes wait for one another.
  double join_timeout_s = 600.0;
  /// --rdzv-conf last_call_timeout: with --nnodes MIN:MAX, how long node 0
  /// waits for more nodes once MIN have joined (torchrun's default, 30 s).
  double last_call_timeout_s = 30.0;
  /// --rdzv-conf is_host: whether this node serves the rendezvous (unset:
  /// the node whose address the endpoint names).
  std::optional<bool> rdzv_is_host;
  /// --local-addr: the MASTER_ADDR node 0 announces at the c10d rendezvous
  /// of several nodes, as torchrun's rank 0 does ("": fsdprun chooses).
  std::string local_addr;
  /// --local-ranks-filter: the local ranks whose output is shown (all when empty).
  std::vector<int> local_ranks_filter;
  /// --log-dir: where --redirects and --tee write each rank's streams, as
  /// torchrun lays them out: <dir>/<rdzv-id>_<random>/attempt_<n>/<local
  /// rank>/{stdout,stderr}.log ("": $TMPDIR or /tmp); fsdprun's main
  /// replaces it by the <rdzv-id>_<random> directory it made.
  std::string log_dir;
  /// --redirects: streams written to the files only; --tee: to the files too.
  StreamSpec redirects;
  StreamSpec tee;
  /// The program to run (looked up in PATH) followed by its own arguments.
  /// A script ending in ".py" (or any, with --run-path) comes after the
  /// interpreter, as torchrun runs it: PYTHON_EXEC (else python3), "-u", the
  /// script, unless --no-python; a module (-m) after "-u -m".
  std::vector<std::string> command;
  /// The script or module run through the interpreter, else "".
  std::string python_script;

  /// Whether this node's rank comes from the rendezvous (rendezvous.h):
  /// the c10d backend across nodes.
  bool assigns_node_ranks() const { return rdzv_backend == "c10d" && nnodes > 1; }
};

/// What parse_options() found: options to run with, a request for help, or
/// an error to report (exit code 2).
struct ParseResult {
  enum class Kind { kRun, kHelp, kError };
  Kind kind = Kind::kError;
  LaunchOptions options;
  /// For kError: one line naming the flag and the bad value.
  std::string error;
  /// For kRun: flags accepted but ignored, as torchrun ignores them (one line each).
  std::vector<std::string> warnings;
};

/// Parses argv (argv[0] excluded). Flags may be spelled with '-' or '_'
/// between words and given as "--flag value" or "--flag=value" (a short
/// flag also as "-r3"); parsing stops at "--" or at the first argument that
/// is not a flag, so everything from the program name on is passed through
/// untouched. As torchrun, each of torchrun's flags takes its default from
/// the variable PET_<FLAG> of `env` ("KEY=VALUE" entries; PET_NPROC_PER_NODE
/// for --nproc-per-node; 1 or 0 for a flag without a value; empty counts as
/// unset), which the command line overrides; so do TORCH_ELASTIC_SHUTDOWN_
/// TIMEOUT, TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE and PYTHON_EXEC.
ParseResult parse_options(const std::vector<std::string>& args,
                          const std::vector<std::string>& env = {});

/// The --help text: every flag, its default and the environment each rank
/// receives.
std::string usage_text();

/// Every flag the parser knows, in its canonical '-' spelling.
std::vector<std::string> flag_names();

}  // namespace fsdp::launch
