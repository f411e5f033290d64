#pragma once

// Where this rank sits in the job and where the rendezvous is, from the
// options and whichever launcher started the process (fsdprun, torchrun,
// mpirun, srun). See Note [Launch environments] in launch_env.cpp.

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <fsdp/comm/init.h>

namespace fsdp::detail {

/// Reads one environment variable: nullopt when it is unset or empty.
using EnvLookup = std::function<std::optional<std::string>(const std::string& name)>;

/// The process's own environment (std::getenv).
EnvLookup process_environment();

/// What init_process_group needs from the launch: the rank layout and the
/// address of rank 0's store.
struct LaunchEnv {
  /// Rank, sizes, node layout and the launcher they came from.
  RankInfo info;
  /// Host of rank 0's rendezvous store.
  std::string master_addr;
  /// Port of rank 0's rendezvous store, in [1, 65535].
  int64_t master_port = 0;
  /// Set when torchrun's agent already serves a c10d TCPStore at
  /// master_addr:master_port (TORCHELASTIC_USE_AGENT_STORE=True): the
  /// restart count (TORCHELASTIC_RESTART_COUNT), which keys in that store go
  /// under. See Note [torchrun's agent store] in init.cpp.
  std::optional<int64_t> agent_store_attempt;
};

/// Resolves the options' rank fields and master address against `env`, in the
/// order of Note [Launch environments]. Throws a one-line error naming the
/// variable for a malformed value, an incomplete set (RANK without
/// WORLD_SIZE), variables set by hand that disagree with the launcher, and a
/// layout that does not hold together (rank not below the world size).
LaunchEnv resolve_launch_env(const ProcessGroupOptions& options, const EnvLookup& env);

/// The first host of a SLURM node list in its compressed form:
/// "node[01-04,07],gpu3" -> "node01". `variable` names it in errors.
std::string first_slurm_host(const std::string& nodelist, const std::string& variable);

/// Tasks on each node from SLURM's compressed form: "4(x2),3" -> {4, 4, 3}.
/// `variable` names it in errors.
std::vector<int64_t> slurm_tasks_per_node(const std::string& text, const std::string& variable);

}  // namespace fsdp::detail
