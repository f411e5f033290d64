// End-to-end: the environment fsdprun gives each rank.

#include <gtest/gtest.h>

#include <map>
#include <optional>
#include <regex>
#include <string>

#include "launch_test_util.h"

namespace fsdp::launch::testing {
namespace {

TEST(FsdprunEnv, SingleNodeRanksAndFreePort) {
  const RunResult r = run_launcher(
      {"--nproc-per-node", "3", test_rank_path(), "--print-env"},
      {{"OMP_NUM_THREADS", std::nullopt}, {"TORCH_NCCL_ASYNC_ERROR_HANDLING", std::nullopt}});
  ASSERT_FALSE(r.timed_out) << r.err;
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EnvByRank env = parse_env(r.out);
  ASSERT_EQ(env.size(), 3u) << r.out;

  // No --master-port on one node: a free port, the same for every rank.
  const std::string port = env[0]["MASTER_PORT"];
  ASSERT_TRUE(std::regex_match(port, std::regex("[0-9]+"))) << port;
  EXPECT_GE(std::stoi(port), 1);
  EXPECT_LE(std::stoi(port), 65535);

  for (int rank = 0; rank < 3; ++rank) {
    SCOPED_TRACE("rank " + std::to_string(rank));
    auto& e = env[rank];
    EXPECT_EQ(e["RANK"], std::to_string(rank));
    EXPECT_EQ(e["LOCAL_RANK"], std::to_string(rank));
    EXPECT_EQ(e["WORLD_SIZE"], "3");
    EXPECT_EQ(e["LOCAL_WORLD_SIZE"], "3");
    EXPECT_EQ(e["GROUP_RANK"], "0");
    EXPECT_EQ(e["GROUP_WORLD_SIZE"], "1");
    EXPECT_EQ(e["ROLE_RANK"], std::to_string(rank));
    EXPECT_EQ(e["ROLE_WORLD_SIZE"], "3");
    EXPECT_EQ(e["MASTER_ADDR"], "127.0.0.1");
    EXPECT_EQ(e["MASTER_PORT"], port);
    EXPECT_EQ(e["TORCHELASTIC_RESTART_COUNT"], "0");
    EXPECT_EQ(e["TORCHELASTIC_MAX_RESTARTS"], "0");
    // Rank 0 serves the store, not an agent (as torchrun's agent does).
    EXPECT_EQ(e["TORCHELASTIC_USE_AGENT_STORE"], "False");
    EXPECT_EQ(e["TORCH_NCCL_ASYNC_ERROR_HANDLING"], "1");
    EXPECT_EQ(e["OMP_NUM_THREADS"], "1");
  }
  EXPECT_NE(r.err.find("OMP_NUM_THREADS=1"), std::string::npos) << r.err;
}

// What a multi-node job's nodes would all export (Note [Job token]).
constexpr const char* kNodesToken = "0123456789abcdef0123456789abcdef";

TEST(FsdprunEnv, MultiNodeRanks) {
  const RunResult r =
      run_launcher({"--nproc-per-node", "3", "--nnodes", "2", "--node-rank", "1", "--master-addr",
                    "10.9.8.7", "--master-port", "29999", test_rank_path(), "--print-env"},
                   {{"FSDP_JOB_TOKEN", kNodesToken}});
  ASSERT_FALSE(r.timed_out) << r.err;
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EnvByRank env = parse_env(r.out);
  ASSERT_EQ(env.size(), 3u) << r.out;
  for (int local = 0; local < 3; ++local) {
    const int rank = 3 + local;
    SCOPED_TRACE("rank " + std::to_string(rank));
    ASSERT_EQ(env.count(rank), 1u);
    auto& e = env[rank];
    EXPECT_EQ(e["RANK"], std::to_string(rank));
    EXPECT_EQ(e["LOCAL_RANK"], std::to_string(local));
    EXPECT_EQ(e["WORLD_SIZE"], "6");
    EXPECT_EQ(e["LOCAL_WORLD_SIZE"], "3");
    EXPECT_EQ(e["GROUP_RANK"], "1");
    EXPECT_EQ(e["GROUP_WORLD_SIZE"], "2");
    EXPECT_EQ(e["ROLE_RANK"], std::to_string(rank));
    EXPECT_EQ(e["ROLE_WORLD_SIZE"], "6");
    EXPECT_EQ(e["MASTER_ADDR"], "10.9.8.7");
    EXPECT_EQ(e["MASTER_PORT"], "29999");
    EXPECT_EQ(e["FSDP_JOB_TOKEN"], kNodesToken);  // passed on as it is, on every node
  }
}

TEST(FsdprunEnv, MultiNodeDefaultPortIs29500) {
  const RunResult r = run_launcher({"--nnodes", "2", test_rank_path(), "--print-env"},
                                   {{"FSDP_JOB_TOKEN", kNodesToken}});
  ASSERT_FALSE(r.timed_out) << r.err;
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EnvByRank env = parse_env(r.out);
  ASSERT_EQ(env.size(), 1u) << r.out;
  EXPECT_EQ(env[0]["MASTER_PORT"], "29500");
  EXPECT_EQ(env[0]["WORLD_SIZE"], "2");
}

// The ranks of a one-node job share a fresh random token; another launch
// gets another one.
TEST(FsdprunEnv, OneNodeJobGetsARandomToken) {
  std::string tokens[2];
  for (std::string& token : tokens) {
    const RunResult r = run_launcher({"--nproc-per-node", "2", test_rank_path(), "--print-env"},
                                     {{"FSDP_JOB_TOKEN", std::nullopt}});
    ASSERT_FALSE(r.timed_out) << r.err;
    ASSERT_EQ(r.exit_code, 0) << r.err;
    EnvByRank env = parse_env(r.out);
    ASSERT_EQ(env.size(), 2u) << r.out;
    token = env[0]["FSDP_JOB_TOKEN"];
    EXPECT_EQ(env[1]["FSDP_JOB_TOKEN"], token);
    EXPECT_EQ(token.size(), 32u) << token;
    EXPECT_EQ(token.find_first_not_of("0123456789abcdef"), std::string::npos) << token;
  }
  EXPECT_NE(tokens[0], tokens[1]);
}

TEST(FsdprunEnv, OneNodeJobKeepsTheUsersToken) {
  const RunResult r = run_launcher({test_rank_path(), "--print-env"}, {{"FSDP_JOB_TOKEN", "mine"}});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(parse_env(r.out)[0]["FSDP_JOB_TOKEN"], "mine");
}

TEST(FsdprunEnv, MultiNodeWithoutATokenIsAOneLineErrorWithTheFix) {
  for (const char* unset : {"", "<unset>"}) {
    std::map<std::string, std::optional<std::string>> env = {{"FSDP_JOB_TOKEN", unset}};
    if (std::string(unset) == "<unset>") env["FSDP_JOB_TOKEN"] = std::nullopt;
    const RunResult r = run_launcher({"--nnodes", "2", test_rank_path(), "--print-env"}, env);
    ASSERT_FALSE(r.timed_out) << r.err;
    EXPECT_EQ(r.exit_code, 2) << r.err;
    EXPECT_EQ(r.out, "") << "a rank was started";
    EXPECT_EQ(r.err,
              "fsdprun: error: --nnodes 2 needs FSDP_JOB_TOKEN, the same on every node: run "
              "`export FSDP_JOB_TOKEN=$(openssl rand -hex 16)` once and start fsdprun with it on "
              "each node\n");
  }
}

// torchrun's --standalone runs under a random run id of UUID form, another
// for each launch.
TEST(FsdprunEnv, StandaloneRunIdIsARandomUuid) {
  std::string ids[2];
  for (std::string& id : ids) {
    const RunResult r = run_launcher({"--standalone", test_rank_path(), "--print-env"});
    ASSERT_EQ(r.exit_code, 0) << r.err;
    id = parse_env(r.out)[0]["TORCHELASTIC_RUN_ID"];
    EXPECT_TRUE(std::regex_match(
        id, std::regex("[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}")))
        << id;
  }
  EXPECT_NE(ids[0], ids[1]);
}

// torchrun 2.15 runs a single-node job given no master port under a random
// id too (its log directory is named after it); a port, or an id given,
// keeps the id.
TEST(FsdprunEnv, SingleNodeRunIdIsARandomUuidUnlessGiven) {
  const std::regex uuid("[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}");
  std::string ids[2];
  for (std::string& id : ids) {
    const RunResult r = run_launcher({test_rank_path(), "--print-env"});
    ASSERT_EQ(r.exit_code, 0) << r.err;
    id = parse_env(r.out)[0]["TORCHELASTIC_RUN_ID"];
    EXPECT_TRUE(std::regex_match(id, uuid)) << id;
  }
  EXPECT_NE(ids[0], ids[1]);
  const RunResult named = run_launcher({"--rdzv-id", "job7", test_rank_path(), "--print-env"});
  ASSERT_EQ(named.exit_code, 0) << named.err;
  EXPECT_EQ(parse_env(named.out)[0]["TORCHELASTIC_RUN_ID"], "job7");
}

TEST(FsdprunEnv, KeepsUserOmpNumThreads) {
  const RunResult r =
      run_launcher({"--nproc-per-node", "2", test_rank_path(), "--print-env"},
                   {{"OMP_NUM_THREADS", "7"}, {"TORCH_NCCL_ASYNC_ERROR_HANDLING", "0"}});
  ASSERT_FALSE(r.timed_out) << r.err;
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EnvByRank env = parse_env(r.out);
  ASSERT_EQ(env.size(), 2u) << r.out;
  EXPECT_EQ(env[0]["OMP_NUM_THREADS"], "7");
  EXPECT_EQ(env[1]["OMP_NUM_THREADS"], "7");
  EXPECT_EQ(env[0]["TORCH_NCCL_ASYNC_ERROR_HANDLING"], "0");
  EXPECT_EQ(r.err.find("OMP_NUM_THREADS"), std::string::npos) << r.err;
}

}  // namespace
}  // namespace fsdp::launch::testing
