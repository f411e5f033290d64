// How init_process_group reads the launch (Note [Launch environments]):
// resolve_launch_env() on fake environments of fsdprun, torchrun, mpirun and
// srun, alone and nested, and the errors for conflicting or missing pieces.

#include <gtest/gtest.h>

#include <c10/util/Exception.h>

#include <map>
#include <string>

#include "rendezvous/launch_env.h"

namespace fsdp::detail {
namespace test_launch_env {

using Env = std::map<std::string, std::string>;

EnvLookup fake(const Env& env) {
  return [env](const std::string& name) -> std::optional<std::string> {
    const auto it = env.find(name);
    if (it == env.end() || it->second.empty()) return std::nullopt;
    return it->second;
  };
}

LaunchEnv resolve(const Env& env, const ProcessGroupOptions& options = {}) {
  return resolve_launch_env(options, fake(env));
}

/// The message of the error resolve() throws, or "" when it does not throw.
std::string error_of(const Env& env, const ProcessGroupOptions& options = {}) {
  try {
    resolve(env, options);
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "";
}

#define EXPECT_HAS(text, part) EXPECT_NE((text).find(part), std::string::npos) << (text)

void expect_layout(const RankInfo& info, int rank, int world, int local_rank, int local_world,
                   int node_rank, int num_nodes, const std::string& launcher) {
  EXPECT_EQ(info.rank, rank);
  EXPECT_EQ(info.world_size, world);
  EXPECT_EQ(info.local_rank, local_rank);
  EXPECT_EQ(info.local_world_size, local_world);
  EXPECT_EQ(info.node_rank, node_rank);
  EXPECT_EQ(info.num_nodes, num_nodes);
  EXPECT_EQ(info.launcher, launcher);
}

const Env kTorchrun = {{"RANK", "5"},
                       {"WORLD_SIZE", "8"},
                       {"LOCAL_RANK", "1"},
                       {"LOCAL_WORLD_SIZE", "4"},
                       {"GROUP_RANK", "1"},
                       {"GROUP_WORLD_SIZE", "2"},
                       {"MASTER_ADDR", "n01"},
                       {"MASTER_PORT", "29400"},
                       {"TORCHELASTIC_RESTART_COUNT", "0"}};

const Env kMpirun = {{"OMPI_COMM_WORLD_RANK", "3"},
                     {"OMPI_COMM_WORLD_SIZE", "4"},
                     {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                     {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}};

// srun -N 3 -n 11: 4 + 4 + 3 tasks; this is global rank 5, the second on node 1.
const Env kSrun = {{"SLURM_JOB_ID", "12345"},
                   {"SLURM_STEP_ID", "2"},
                   {"SLURM_PROCID", "5"},
                   {"SLURM_NTASKS", "11"},
                   {"SLURM_LOCALID", "1"},
                   {"SLURM_NODEID", "1"},
                   {"SLURM_STEP_NUM_NODES", "3"},
                   {"SLURM_STEP_TASKS_PER_NODE", "4(x2),3"},
                   {"SLURM_STEP_NODELIST", "node[01-02,07]"},
                   {"SLURM_JOB_NODELIST", "node[01-04,07],gpu3"}};

Env merged(Env base, const Env& more) {
  for (const auto& [k, v] : more) base[k] = v;
  return base;
}

TEST(LaunchEnv, NothingSetIsOneRankOnLoopback) {
  const LaunchEnv e = resolve({});
  expect_layout(e.info, 0, 1, 0, 1, 0, 1, "none");
  EXPECT_EQ(e.master_addr, "127.0.0.1");
  EXPECT_EQ(e.master_port, 29500);
}

TEST(LaunchEnv, TorchrunVariables) {
  const LaunchEnv e = resolve(kTorchrun);
  expect_layout(e.info, 5, 8, 1, 4, 1, 2, "torchrun");
  EXPECT_EQ(e.master_addr, "n01");
  EXPECT_EQ(e.master_port, 29400);
  EXPECT_FALSE(e.agent_store_attempt.has_value());
}

TEST(LaunchEnv, TorchrunsAgentStoreIsJoined) {
  const Env env = merged(
      kTorchrun, {{"TORCHELASTIC_USE_AGENT_STORE", "True"}, {"TORCHELASTIC_RESTART_COUNT", "2"}});
  EXPECT_EQ(resolve(env).agent_store_attempt, std::optional<int64_t>(2));
  // An address of the user's own is not the agent's.
  EXPECT_FALSE(resolve(env, ProcessGroupOptions().master_port(1234)).agent_store_attempt);
  EXPECT_FALSE(
      resolve(merged(env, {{"TORCHELASTIC_USE_AGENT_STORE", "False"}})).agent_store_attempt);
}

TEST(LaunchEnv, FsdprunVariablesGiveTheNodeFromGroupRank) {
  // fsdprun --nnodes 3 --node-rank 2 --nproc-per-node 2: no GROUP_WORLD_SIZE.
  const LaunchEnv e = resolve({{"RANK", "4"},
                               {"WORLD_SIZE", "6"},
                               {"LOCAL_RANK", "0"},
                               {"LOCAL_WORLD_SIZE", "2"},
                               {"GROUP_RANK", "2"},
                               {"MASTER_ADDR", "10.0.0.1"},
                               {"TORCHELASTIC_RESTART_COUNT", "0"}});
  expect_layout(e.info, 4, 6, 0, 2, 2, 3, "torchrun");
}

TEST(LaunchEnv, SeveralNodesNeedMasterAddr) {
  const std::string error = error_of({{"RANK", "4"},
                                      {"WORLD_SIZE", "6"},
                                      {"LOCAL_RANK", "0"},
                                      {"LOCAL_WORLD_SIZE", "2"},
                                      {"GROUP_RANK", "2"}});
  EXPECT_HAS(error, "[rank 4] fsdp(init_process_group): the 6 ranks run on 3 nodes");
  EXPECT_HAS(error, "Set MASTER_ADDR");
}

TEST(LaunchEnv, RankAndWorldSizeByHand) {
  const LaunchEnv e = resolve({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "1234"}});
  expect_layout(e.info, 1, 2, 1, 2, 0, 1, "environment");
  EXPECT_EQ(e.master_port, 1234);
}

TEST(LaunchEnv, MpirunOnOneNodeDefaultsToLoopback) {
  const LaunchEnv e = resolve({{"OMPI_COMM_WORLD_RANK", "1"},
                               {"OMPI_COMM_WORLD_SIZE", "3"},
                               {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                               {"OMPI_COMM_WORLD_LOCAL_SIZE", "3"}});
  expect_layout(e.info, 1, 3, 1, 3, 0, 1, "mpirun");
  EXPECT_EQ(e.master_addr, "127.0.0.1");
  EXPECT_EQ(e.master_port, 29500);
}

TEST(LaunchEnv, MpirunAcrossNodesNeedsMasterAddr) {
  const std::string error = error_of(kMpirun);
  EXPECT_HAS(error, "[rank 3] fsdp(init_process_group)");
  EXPECT_HAS(error, "-x MASTER_ADDR=<node 0's address>");
  EXPECT_EQ(error.find('\n'), std::string::npos) << error;
  const LaunchEnv e = resolve(merged(kMpirun, {{"MASTER_ADDR", "10.0.0.1"}}));
  expect_layout(e.info, 3, 4, 1, 2, 1, 2, "mpirun");
  EXPECT_EQ(e.master_addr, "10.0.0.1");
  EXPECT_EQ(e.master_port, 29500);
}

TEST(LaunchEnv, SrunLayoutNodeListAndPort) {
  const LaunchEnv e = resolve(kSrun);
  expect_layout(e.info, 5, 11, 1, 4, 1, 3, "srun");
  EXPECT_EQ(e.master_addr, "node01");  // the step's list, not the job's
  EXPECT_EQ(e.master_port, 20000 + (10 * 12345 + 2) % 10000);

  // The third node runs 3 tasks.
  const LaunchEnv last = resolve(
      merged(kSrun, {{"SLURM_PROCID", "10"}, {"SLURM_LOCALID", "2"}, {"SLURM_NODEID", "2"}}));
  expect_layout(last.info, 10, 11, 2, 3, 2, 3, "srun");
}

TEST(LaunchEnv, SrunUserMasterWins) {
  const LaunchEnv e = resolve(merged(kSrun, {{"MASTER_ADDR", "head"}, {"MASTER_PORT", "4000"}}));
  EXPECT_EQ(e.master_addr, "head");
  EXPECT_EQ(e.master_port, 4000);
}

TEST(LaunchEnv, SrunTasksPerNodeForms) {
  Env env = kSrun;
  env.erase("SLURM_STEP_TASKS_PER_NODE");
  env.erase("SLURM_STEP_NUM_NODES");
  env.erase("SLURM_STEP_NODELIST");
  env["SLURM_NTASKS"] = "8";
  env["SLURM_NTASKS_PER_NODE"] = "4";  // sbatch --ntasks-per-node=4: every node
  const LaunchEnv uniform = resolve(env);
  expect_layout(uniform.info, 5, 8, 1, 4, 1, 2, "srun");
  EXPECT_EQ(uniform.master_addr, "node01");  // from SLURM_JOB_NODELIST

  env.erase("SLURM_NTASKS_PER_NODE");
  env["SLURM_TASKS_PER_NODE"] = "3,5";  // the job's form
  const LaunchEnv job_form = resolve(env);
  expect_layout(job_form.info, 5, 8, 1, 5, 1, 2, "srun");

  // The step's own form wins over the job's.
  env["SLURM_STEP_TASKS_PER_NODE"] = "2(x4)";
  const LaunchEnv step_form = resolve(env);
  expect_layout(step_form.info, 5, 8, 1, 2, 1, 4, "srun");
}

TEST(LaunchEnv, SlurmOutsideAStepIsNotALauncher) {
  // A batch script or an salloc shell: the allocation's variables, no step.
  Env env = kSrun;
  env.erase("SLURM_STEP_ID");
  expect_layout(resolve(env).info, 0, 1, 0, 1, 0, 1, "none");
  env["SLURM_STEP_ID"] = "4294967290";  // salloc's interactive step
  expect_layout(resolve(env).info, 0, 1, 0, 1, 0, 1, "none");
  env["SLURM_STEP_ID"] = "4294967294";  // the batch step
  expect_layout(resolve(env).info, 0, 1, 0, 1, 0, 1, "none");
}

TEST(LaunchEnv, TorchrunUnderSrunIsNoConflict) {
  // srun -N 2 --ntasks-per-node 1 torchrun --nproc-per-node 4: SLURM's
  // variables describe the torchrun process.
  const Env env = merged(kSrun, merged(kTorchrun, {{"SLURM_PROCID", "1"},
                                                   {"SLURM_NTASKS", "2"},
                                                   {"SLURM_LOCALID", "0"},
                                                   {"SLURM_STEP_TASKS_PER_NODE", "1(x2)"}}));
  const LaunchEnv e = resolve(env);
  expect_layout(e.info, 5, 8, 1, 4, 1, 2, "torchrun");
  EXPECT_EQ(e.master_addr, "n01");
  EXPECT_EQ(e.master_port, 29400);
}

TEST(LaunchEnv, MpirunInsideASlurmAllocationIsNoConflict) {
  // mpirun starts its daemons with srun: the ranks carry a daemon's SLURM_*.
  const Env env = merged(merged(kSrun, kMpirun), {{"SLURM_PROCID", "0"},
                                                  {"SLURM_NTASKS", "2"},
                                                  {"SLURM_LOCALID", "0"},
                                                  {"SLURM_NODEID", "0"},
                                                  {"SLURM_STEP_TASKS_PER_NODE", "1(x2)"},
                                                  {"MASTER_ADDR", "node01"}});
  const LaunchEnv e = resolve(env);
  expect_layout(e.info, 3, 4, 1, 2, 1, 2, "mpirun");
}

TEST(LaunchEnv, HandSetRankUnderMpirunMustAgree) {
  const Env stale = merged(kMpirun, {{"MASTER_ADDR", "h"}, {"WORLD_SIZE", "8"}});
  const std::string error = error_of(stale);
  EXPECT_HAS(error, "[rank 3] fsdp(init_process_group)");
  EXPECT_HAS(error, "WORLD_SIZE=8 but OMPI_COMM_WORLD_SIZE=4");
  EXPECT_HAS(error, "Unset WORLD_SIZE");
  EXPECT_EQ(error.find('\n'), std::string::npos) << error;
  EXPECT_HAS(error_of(merged(kMpirun, {{"MASTER_ADDR", "h"}, {"RANK", "0"}})),
             "RANK=0 but OMPI_COMM_WORLD_RANK=3");

  // `export RANK=$OMPI_COMM_WORLD_RANK` and the like agree: fine.
  const LaunchEnv e = resolve(merged(
      kMpirun, {{"MASTER_ADDR", "h"}, {"RANK", "3"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "1"}}));
  expect_layout(e.info, 3, 4, 1, 2, 1, 2, "mpirun");
}

TEST(LaunchEnv, HandSetRankUnderSrunMustAgree) {
  const std::string error = error_of(merged(kSrun, {{"RANK", "0"}, {"WORLD_SIZE", "11"}}));
  EXPECT_HAS(error, "RANK=0 but SLURM_PROCID=5");
  EXPECT_HAS(error, "srun started this process");
}

TEST(LaunchEnv, IncompleteSetsAreErrors) {
  EXPECT_HAS(error_of({{"RANK", "1"}}), "RANK=1 is set but WORLD_SIZE is not");
  EXPECT_HAS(error_of({{"WORLD_SIZE", "2"}}), "WORLD_SIZE=2 is set but RANK is not");
  EXPECT_HAS(error_of({{"OMPI_COMM_WORLD_RANK", "1"}}),
             "OMPI_COMM_WORLD_RANK=1 is set but OMPI_COMM_WORLD_SIZE is not");
  EXPECT_HAS(error_of({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_WORLD_SIZE", "2"}}),
             "LOCAL_WORLD_SIZE=2 is set but LOCAL_RANK is not");
  Env no_tasks = kSrun;
  no_tasks.erase("SLURM_NTASKS");
  EXPECT_HAS(error_of(no_tasks), "SLURM_PROCID=5 is set but SLURM_STEP_NUM_TASKS is not");
  // The single-rank readings alone are fine.
  expect_layout(resolve({{"RANK", "0"}}).info, 0, 1, 0, 1, 0, 1, "environment");
  expect_layout(resolve({{"WORLD_SIZE", "1"}}).info, 0, 1, 0, 1, 0, 1, "environment");
}

TEST(LaunchEnv, BadValuesNameTheVariable) {
  EXPECT_HAS(error_of({{"RANK", "abc"}, {"WORLD_SIZE", "2"}}), "RANK='abc' is not a non-negative");
  EXPECT_HAS(error_of({{"RANK", "2"}, {"WORLD_SIZE", "2"}}),
             "rank 2 is not below the world size 2");
  EXPECT_HAS(error_of(merged(kSrun, {{"SLURM_NODEID", "3"}})),
             "SLURM_NODEID=3 but SLURM_STEP_TASKS_PER_NODE='4(x2),3' lists 3 nodes");
  EXPECT_HAS(error_of(merged(kSrun, {{"SLURM_STEP_TASKS_PER_NODE", "4(2)"}})),
             "SLURM_STEP_TASKS_PER_NODE='4(2)' is not SLURM's tasks-per-node form");
  EXPECT_HAS(error_of(merged(kSrun, {{"SLURM_STEP_NODELIST", "node[01"}})),
             "SLURM_STEP_NODELIST='node[01' is not a SLURM node list");
  EXPECT_HAS(error_of({{"MASTER_PORT", "70000"}}), "master port 70000 is not in [1, 65535]");
}

TEST(LaunchEnv, ExplicitOptionsWin) {
  // Options over a stale hand-set WORLD_SIZE under mpirun: no error.
  const Env env = merged(kMpirun, {{"WORLD_SIZE", "7"}, {"MASTER_ADDR", "h"}});
  const LaunchEnv e = resolve(env, ProcessGroupOptions().rank(1).world_size(2).master_port(555));
  // The launcher's local layout describes its own world of 4, so it is not used.
  expect_layout(e.info, 1, 2, 1, 2, 0, 1, "options");
  EXPECT_EQ(e.master_addr, "h");
  EXPECT_EQ(e.master_port, 555);

  const LaunchEnv all = resolve(
      kTorchrun,
      ProcessGroupOptions().rank(2).world_size(8).local_rank(0).local_world_size(2).master_addr(
          "10.1.1.1"));
  expect_layout(all.info, 2, 8, 0, 2, 1, 4, "options");
  EXPECT_EQ(all.master_addr, "10.1.1.1");
  EXPECT_EQ(all.master_port, 29400);

  // Only the rank from an option: the launcher's world and local layout stay.
  const LaunchEnv some = resolve(kTorchrun, ProcessGroupOptions().rank(4));
  expect_layout(some.info, 4, 8, 1, 4, 1, 2, "torchrun");
}

TEST(SlurmNodeList, FirstHost) {
  EXPECT_EQ(first_slurm_host("node[01-04,07],gpu3", "V"), "node01");
  EXPECT_EQ(first_slurm_host("gpu3,node[1-2]", "V"), "gpu3");
  EXPECT_EQ(first_slurm_host("rack[2-3]-n[07,09]", "V"), "rack2-n07");
  EXPECT_EQ(first_slurm_host("node[7]", "V"), "node7");
  EXPECT_EQ(first_slurm_host("login.cluster.org", "V"), "login.cluster.org");
  for (const char* bad : {"", "node[01", "node[]", "[a-b]", ",node1"}) {
    EXPECT_THROW(first_slurm_host(bad, "V"), c10::Error) << bad;
  }
}

TEST(SlurmTasksPerNode, CompressedForm) {
  using V = std::vector<int64_t>;
  EXPECT_EQ(slurm_tasks_per_node("4(x2),3", "V"), (V{4, 4, 3}));
  EXPECT_EQ(slurm_tasks_per_node("2", "V"), (V{2}));
  EXPECT_EQ(slurm_tasks_per_node("1(x3)", "V"), (V{1, 1, 1}));
  EXPECT_EQ(slurm_tasks_per_node("2,1(x2),8", "V"), (V{2, 1, 1, 8}));
  for (const char* bad : {"", "4(x", "4x2", "a", "4,", "4(x0)", "(x2)", "4(y2)"}) {
    EXPECT_THROW(slurm_tasks_per_node(bad, "V"), c10::Error) << bad;
  }
}

}  // namespace test_launch_env
}  // namespace fsdp::detail
