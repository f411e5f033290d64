#pragma once

// The torchrun-compatible environment each rank is started with.

#include <string>
#include <vector>

#include "options.h"

namespace fsdp::launch {

/// Copies a NULL-terminated "KEY=VALUE" array (such as `environ`).
std::vector<std::string> environment_from(char* const* envp);

/// True when fsdprun will set OMP_NUM_THREADS=1 for the ranks: several ranks
/// share the node and the user did not choose a thread count. Without it each
/// rank would start one OpenMP thread per core and the node would thrash.
bool defaults_omp_num_threads(const LaunchOptions& options,
                              const std::vector<std::string>& base_env);

/// Returns `base_env` with what torchrun's agent sets: RANK, LOCAL_RANK,
/// WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, GROUP_WORLD_SIZE (the number of
/// nodes), ROLE_RANK, ROLE_WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
/// TORCHELASTIC_RESTART_COUNT, TORCHELASTIC_MAX_RESTARTS, TORCHELASTIC_RUN_ID,
/// TORCHELASTIC_USE_AGENT_STORE (False), ROLE_NAME, set for local rank
/// `local_rank`, replacing earlier values; and OMP_NUM_THREADS (1) and
/// TORCH_NCCL_ASYNC_ERROR_HANDLING (1) unless the user set them. Everything
/// else is inherited.
std::vector<std::string> build_rank_environment(const LaunchOptions& options, int master_port,
                                                int local_rank, int restart_count,
                                                const std::vector<std::string>& base_env);

}  // namespace fsdp::launch
