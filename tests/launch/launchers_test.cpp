// libfsdp under the launchers clusters use (Note [Launch environments] in
// src/rendezvous/launch_env.cpp): real `mpirun -np N`, `torchrun --no-python` and
// fsdprun runs of launch_probe, whose ranks check their layout and an
// all-reduce. A launcher that is not installed skips its test, saying so.
// Every run has a deadline, and the probes bound themselves (launch_probe.cpp).

#include <gtest/gtest.h>

#include <unistd.h>

#include <cstdlib>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "launch_test_util.h"
#include "multi_rank.h"

namespace fsdp::launch::testing {
namespace {

using Env = std::map<std::string, std::optional<std::string>>;

constexpr std::chrono::seconds kDeadline{90};

/// `name` on PATH, or nullopt.
std::optional<std::string> find_on_path(const std::string& name) {
  const char* path = std::getenv("PATH");
  std::istringstream dirs(path != nullptr ? path : "");
  std::string dir;
  while (std::getline(dirs, dir, ':')) {
    const std::string candidate = (dir.empty() ? "." : dir) + "/" + name;
    if (::access(candidate.c_str(), X_OK) == 0) return candidate;
  }
  return std::nullopt;
}

/// The test's environment without any launch of its own (a test run under
/// fsdprun or srun must not hand its layout to the launch under test).
Env clean_env() {
  Env env;
  for (const char* name :
       {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
        "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_USE_AGENT_STORE", "MASTER_ADDR", "MASTER_PORT",
        "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
        "OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_STEP_ID", "SLURM_STEPID"}) {
    env[name] = std::nullopt;
  }
  env["OMP_NUM_THREADS"] = "1";
  // Open MPI refuses root (containers, CI) without both of these.
  env["OMPI_ALLOW_RUN_AS_ROOT"] = "1";
  env["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] = "1";
  return env;
}

std::string describe(const RunResult& r) {
  return "exit " + std::to_string(r.exit_code) + (r.timed_out ? " (killed at the deadline)" : "") +
         "\nstdout:\n" + r.out + "\nstderr:\n" + r.err;
}

/// One "probe ... ok" line per rank of a one-node job of `world` ranks.
void expect_probes(const RunResult& r, int world, const std::string& launcher) {
  ASSERT_FALSE(r.timed_out) << describe(r);
  EXPECT_EQ(r.exit_code, 0) << describe(r);
  for (int rank = 0; rank < world; ++rank) {
    const std::string line =
        "probe rank=" + std::to_string(rank) + " world=" + std::to_string(world) +
        " local_rank=" + std::to_string(rank) + " local_world=" + std::to_string(world) +
        " node=0 nodes=1 launcher=" + launcher + " ok";
    EXPECT_NE(r.out.find(line), std::string::npos) << line << "\n" << describe(r);
  }
}

void mpirun_ranks(int world) {
  const std::optional<std::string> mpirun = find_on_path("mpirun");
  if (!mpirun) GTEST_SKIP() << "mpirun is not installed (Debian: apt-get install openmpi-bin)";
  const std::string port = "MASTER_PORT=" + std::to_string(fsdp::testing::free_port());
  const RunResult r = run_program(
      *mpirun, {"--oversubscribe", "-np", std::to_string(world), "-x", port, LAUNCH_PROBE_PATH},
      clean_env(), kDeadline);
  expect_probes(r, world, "mpirun");
}

TEST(Launchers, MpirunTwoRanks) { mpirun_ranks(2); }

TEST(Launchers, MpirunThreeRanks) { mpirun_ranks(3); }

TEST(Launchers, MpirunWithAStaleWorldSizeFailsNamingBoth) {
  const std::optional<std::string> mpirun = find_on_path("mpirun");
  if (!mpirun) GTEST_SKIP() << "mpirun is not installed (Debian: apt-get install openmpi-bin)";
  Env env = clean_env();
  env["WORLD_SIZE"] = "4";  // an `export WORLD_SIZE=4` left over
  const std::string expected = " fsdp(init_process_group): WORLD_SIZE=4 but OMPI_COMM_WORLD_SIZE=2";
  // As users run it: the job fails, with the error.
  const RunResult r =
      run_program(*mpirun, {"--oversubscribe", "-np", "2", LAUNCH_PROBE_PATH}, env, kDeadline);
  ASSERT_FALSE(r.timed_out) << describe(r);
  EXPECT_NE(r.exit_code, 0) << describe(r);
  EXPECT_NE((r.out + r.err).find(expected), std::string::npos) << describe(r);
  // Every rank says so. mpirun kills the job when its first rank fails (and
  // then exits 0 when told not to), so that a loaded machine cannot kill the
  // other rank before it printed its own error.
  const RunResult both = run_program(*mpirun,
                                     {"--oversubscribe", "--mca", "orte_abort_on_non_zero_status",
                                      "0", "-np", "2", LAUNCH_PROBE_PATH},
                                     env, kDeadline);
  ASSERT_FALSE(both.timed_out) << describe(both);
  for (const char* rank : {"[rank 0]", "[rank 1]"}) {
    EXPECT_NE((both.out + both.err).find(rank + expected), std::string::npos) << describe(both);
  }
}

TEST(Launchers, TorchrunTwoRanks) {
  const std::string torchrun = FSDP_TORCHRUN_PATH;
  if (torchrun.empty() || ::access(torchrun.c_str(), X_OK) != 0) {
    GTEST_SKIP() << "torchrun is not installed next to FSDP_PYTHON ('" << torchrun
                 << "'; scripts/setup.sh makes .venv with torch)";
  }
  const RunResult r =
      run_program(torchrun, {"--no-python", "--nproc-per-node", "2", LAUNCH_PROBE_PATH},
                  clean_env(), kDeadline);
  if (FSDP_TORCHRUN_SAME_TORCH) {
    expect_probes(r, 2, "torchrun");
    return;
  }
  // Another PyTorch's torchrun (LibTorch 1.13 builds, the venv's torch 2.x):
  // its agent's store does not answer this LibTorch, and every rank says so
  // quickly (Note [torchrun's agent store]).
  ASSERT_FALSE(r.timed_out) << describe(r);
  EXPECT_NE(r.exit_code, 0) << describe(r);
  EXPECT_NE((r.out + r.err).find("Start the job with the torchrun of the PyTorch"),
            std::string::npos)
      << describe(r);
}

TEST(Launchers, FsdprunTwoRanks) {
  const RunResult r = run_program(fsdprun_path(), {"--nproc-per-node", "2", LAUNCH_PROBE_PATH},
                                  clean_env(), kDeadline);
  ASSERT_FALSE(r.timed_out) << describe(r);
  EXPECT_EQ(r.exit_code, 0) << describe(r);
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_NE(r.out.find("probe rank=" + std::to_string(rank) +
                         " world=2 local_rank=" + std::to_string(rank) +
                         " local_world=2 node=0 nodes=1 launcher=torchrun ok"),
              std::string::npos)
        << describe(r);
  }
}

// torchrun's multi-node command, the same on both "nodes" (two fsdprun on
// this host): the c10d rendezvous gives the node ranks, and the four libfsdp
// ranks form one job over the endpoint's port, which rank 0's store serves
// once the rendezvous has let go of it. `listen_race`: both launchers' first
// try to serve fails, as when their listen() calls race (Note [Serving the
// rendezvous]; it hung both until the join timeout).
void expect_nodes_meet_at_c10d(bool listen_race) {
  const std::string endpoint = "127.0.0.1:" + std::to_string(fsdp::testing::free_port());
  const std::vector<std::string> args = {"--nnodes",         "2",
                                         "--nproc-per-node", "2",
                                         "--rdzv-backend",   "c10d",
                                         "--rdzv-endpoint",  endpoint,
                                         "--rdzv-id",        "probe",
                                         "--rdzv-conf",      "join_timeout=40",
                                         "--no-python",      LAUNCH_PROBE_PATH};
  Env env = clean_env();
  env["FSDP_JOB_TOKEN"] = "0123456789abcdef0123456789abcdef";
  if (listen_race) env["FSDP_FAULT_RDZV_LISTEN_RACE"] = "1";
  LauncherProcess first(fsdprun_path(), args, env);
  LauncherProcess second(fsdprun_path(), args, env);
  std::string out;
  for (LauncherProcess* node : {&first, &second}) {
    const RunResult r = node->wait(kDeadline);
    EXPECT_FALSE(r.timed_out) << describe(r);
    EXPECT_EQ(r.exit_code, 0) << describe(r);
    out += r.out;
  }
  for (int rank = 0; rank < 4; ++rank) {
    const std::string line =
        "probe rank=" + std::to_string(rank) + " world=4 local_rank=" + std::to_string(rank % 2) +
        " local_world=2 node=" + std::to_string(rank / 2) + " nodes=2 launcher=torchrun ok";
    EXPECT_NE(out.find(line), std::string::npos) << line << "\n" << out;
  }
}

TEST(Launchers, FsdprunNodesMeetAtTheC10dRendezvous) { expect_nodes_meet_at_c10d(false); }

TEST(Launchers, FsdprunNodesMeetWhenBothFailedToServeFirst) { expect_nodes_meet_at_c10d(true); }

}  // namespace
}  // namespace fsdp::launch::testing
