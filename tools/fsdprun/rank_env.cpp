#include "rank_env.h"

#include <map>

namespace fsdp::launch {
namespace {

/// The variable name of a "KEY=VALUE" entry.
std::string entry_key(const std::string& entry) { return entry.substr(0, entry.find('=')); }

/// True when `env` defines `key`.
bool has_key(const std::vector<std::string>& env, const std::string& key) {
  for (const std::string& entry : env) {
    if (entry_key(entry) == key) return true;
  }
  return false;
}

}  // namespace

std::vector<std::string> environment_from(char* const* envp) {
  std::vector<std::string> env;
  for (; envp != nullptr && *envp != nullptr; ++envp) env.emplace_back(*envp);
  return env;
}

bool defaults_omp_num_threads(const LaunchOptions& options,
                              const std::vector<std::string>& base_env) {
  return options.nproc_per_node > 1 && !has_key(base_env, "OMP_NUM_THREADS");
}

std::vector<std::string> build_rank_environment(const LaunchOptions& options, int master_port,
                                                int local_rank, int restart_count,
                                                const std::vector<std::string>& base_env) {
  const int rank = options.node_rank * options.nproc_per_node + local_rank;
  const int world_size = options.nnodes * options.nproc_per_node;
  // Ordered so the resulting environment is deterministic (easier to diff
  // when debugging a launch).
  std::map<std::string, std::string> overrides = {
      {"RANK", std::to_string(rank)},
      {"LOCAL_RANK", std::to_string(local_rank)},
      {"WORLD_SIZE", std::to_string(world_size)},
      {"LOCAL_WORLD_SIZE", std::to_string(options.nproc_per_node)},
      {"GROUP_RANK", std::to_string(options.node_rank)},
      {"GROUP_WORLD_SIZE", std::to_string(options.nnodes)},
      {"ROLE_RANK", std::to_string(rank)},
      {"ROLE_WORLD_SIZE", std::to_string(world_size)},
      {"MASTER_ADDR", options.master_addr},
      {"MASTER_PORT", std::to_string(master_port)},
      {"TORCHELASTIC_RESTART_COUNT", std::to_string(restart_count)},
      {"TORCHELASTIC_MAX_RESTARTS", std::to_string(options.max_restarts)},
      {"TORCHELASTIC_RUN_ID", options.rdzv_id},
      {"ROLE_NAME", options.role},
      // No agent serves a store at MASTER_ADDR:MASTER_PORT, as torchrun's
      // does: rank 0 serves it (libfsdp's, or PyTorch's TCPStore under
      // init_process_group's env://). "True" would have every rank join an
      // agent's store as a client, and nobody serve it.
      {"TORCHELASTIC_USE_AGENT_STORE", "False"},
  };
  if (defaults_omp_num_threads(options, base_env)) {
    overrides["OMP_NUM_THREADS"] = "1";
  }
  // torchrun's default, kept when the user set it (PyTorch's NCCL then ends
  // a job whose collective failed or hung instead of leaving it stuck).
  if (!has_key(base_env, "TORCH_NCCL_ASYNC_ERROR_HANDLING")) {
    overrides["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "1";
  }

  std::vector<std::string> env;
  env.reserve(base_env.size() + overrides.size());
  for (const std::string& entry : base_env) {
    if (overrides.count(entry_key(entry)) == 0) env.push_back(entry);
  }
  for (const auto& [key, value] : overrides) env.push_back(key + "=" + value);
  return env;
}

}  // namespace fsdp::launch
