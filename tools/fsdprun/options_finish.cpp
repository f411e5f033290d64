// The parser's last step: checking the flags against one another, settling
// where the ranks meet, and putting Python in front of a script.

#include "options_parser.h"
#include "options_values.h"

namespace fsdp::launch::detail {

std::string Parser::list_given(std::initializer_list<Flag> flags) const {
  std::string out;
  for (const Flag flag : flags) {
    if (!given(flag)) continue;
    out += (out.empty() ? "" : ", ") + given_.at(flag);
  }
  return out;
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

}  // namespace fsdp::launch::detail
