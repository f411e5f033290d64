// What carries CUDA tensors' collectives (Note [Choosing what carries CUDA
// tensors]): the choice for every combination of build, GPUs, ranks per node
// and NCCL version, the option and its variable, and the agreement every
// rank of a real group reaches, which a CPU machine can only ever make
// "staged". NCCL itself runs in test_nccl_cuda (label cuda).

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <string>

#include <fsdp/comm/init.h>

#include "comm/cuda_backend.h"
#include "comm/device_routed.h"
#include "comm_test_util.h"
#include "multi_rank.h"

namespace fsdp::testing {
namespace test_cuda_backend {

using detail::auto_tries_cuda_ipc;
using detail::choose_cuda_backend;
using detail::CudaFacts;

CudaFacts facts(int nccl, int gpus, int ranks, bool multi = false) {
  CudaFacts f;
  f.nccl_version = nccl;
  f.visible_gpus = gpus;
  f.local_world_size = ranks;
  f.multi_rank_switch = multi;
  return f;
}

TEST(ChooseCudaBackend, NcclWhereEveryRankHasAGpuOfItsOwn) {
  EXPECT_TRUE(choose_cuda_backend(CudaBackend::kAuto, facts(22809, 1, 1)).nccl);
  EXPECT_TRUE(choose_cuda_backend(CudaBackend::kAuto, facts(22809, 8, 8)).nccl);
  EXPECT_TRUE(choose_cuda_backend(CudaBackend::kAuto, facts(22809, 8, 4)).nccl);
  EXPECT_TRUE(choose_cuda_backend(CudaBackend::kNccl, facts(22809, 2, 2)).nccl);
}

TEST(ChooseCudaBackend, StagedWhereNcclCannotRunAndSaysWhy) {
  auto expect_staged = [](CudaBackend requested, const CudaFacts& f, const std::string& why) {
    const auto choice = choose_cuda_backend(requested, f);
    EXPECT_FALSE(choice.nccl);
    EXPECT_NE(choice.why_not.find(why), std::string::npos) << choice.why_not;
  };
  expect_staged(CudaBackend::kStaged, facts(22809, 8, 8), "kStaged was asked for");
  expect_staged(CudaBackend::kCudaIpc, facts(22809, 1, 2), "kCudaIpc was asked for");
  expect_staged(CudaBackend::kAuto, facts(0, 8, 8), "without NCCL");
  expect_staged(CudaBackend::kNccl, facts(0, 8, 8), "without NCCL");
  expect_staged(CudaBackend::kAuto, facts(23007, 0, 1), "sees no GPU");
  // Ranks sharing a GPU: NCCL 2.28 refuses them whatever the switch says...
  expect_staged(CudaBackend::kAuto, facts(22809, 1, 2, true),
                "2 ranks on this node share 1 GPU(s), which NCCL 2.28.9 refuses");
  expect_staged(CudaBackend::kAuto, facts(22809, 2, 3), "NCCL 2.30 or later");
  // ... 2.30 accepts them only behind its switch.
  expect_staged(CudaBackend::kAuto, facts(23007, 1, 3), "NCCL_MULTI_RANK_GPU_ENABLE=1");
  EXPECT_TRUE(choose_cuda_backend(CudaBackend::kAuto, facts(23007, 1, 3, true)).nccl);
  EXPECT_TRUE(choose_cuda_backend(CudaBackend::kNccl, facts(23100, 1, 2, true)).nccl);
}

// Ranks counted by their GPU's identity (init_process_group gathers every
// rank's gpu_identity): ranks that each see one GPU of their own (srun
// --gpus-per-task=1, a container per rank) run NCCL, however many share the
// node; ranks on one GPU do not, however many GPUs the node has.
TEST(ChooseCudaBackend, RanksSharingAGpuCountedByItsIdentity) {
  CudaFacts own = facts(22809, 1, 4);
  own.ranks_on_gpu = 1;
  EXPECT_TRUE(choose_cuda_backend(CudaBackend::kAuto, own).nccl);
  CudaFacts shared = facts(22809, 8, 8);
  shared.ranks_on_gpu = 2;
  const auto choice = choose_cuda_backend(CudaBackend::kAuto, shared);
  EXPECT_FALSE(choice.nccl);
  EXPECT_NE(choice.why_not.find("2 ranks share this rank's GPU, which NCCL 2.28.9 refuses"),
            std::string::npos)
      << choice.why_not;
  EXPECT_EQ(detail::ranks_on_same_gpu({7, 9, 7, 7}, 7), 3);
  EXPECT_EQ(detail::ranks_on_same_gpu({7, 9, 7, 7}, 9), 1);
  EXPECT_EQ(detail::ranks_on_same_gpu({0, 0}, 0), 0);  // no GPU: not known
  EXPECT_EQ(detail::gpu_identity(std::nullopt), 0);
}

// Where NCCL cannot run, kAuto tries CUDA IPC for a job on one node whose
// ranks see a GPU (the group is made only where they all share one).
TEST(ChooseCudaBackend, AutoTriesCudaIpcOnlyForOneNodeWithoutNccl) {
  EXPECT_TRUE(auto_tries_cuda_ipc(CudaBackend::kAuto, false, facts(22809, 1, 2), 2));
  EXPECT_TRUE(auto_tries_cuda_ipc(CudaBackend::kAuto, false, facts(0, 2, 3), 3));
  EXPECT_FALSE(auto_tries_cuda_ipc(CudaBackend::kAuto, true, facts(22809, 2, 2), 2));  // NCCL
  EXPECT_FALSE(auto_tries_cuda_ipc(CudaBackend::kStaged, false, facts(22809, 1, 2), 2));
  EXPECT_FALSE(auto_tries_cuda_ipc(CudaBackend::kAuto, false, facts(22809, 1, 2), 4));  // 2 nodes
  EXPECT_FALSE(auto_tries_cuda_ipc(CudaBackend::kAuto, false, facts(22809, 0, 2), 2));  // no GPU
  EXPECT_FALSE(auto_tries_cuda_ipc(CudaBackend::kAuto, false, facts(22809, 1, 1), 1));  // alone
}

TEST(ChooseCudaBackend, VersionsReadAsNcclWritesThem) {
  EXPECT_EQ(detail::nccl_version_string(22809), "2.28.9");
  EXPECT_EQ(detail::nccl_version_string(23007), "2.30.7");
}

TEST(ResolveCudaBackend, TheOptionWinsThenTheVariableThenAuto) {
  using detail::resolve_cuda_backend;
  EXPECT_EQ(resolve_cuda_backend(CudaBackend::kStaged, "nccl", 0), CudaBackend::kStaged);
  EXPECT_EQ(resolve_cuda_backend(std::nullopt, "NCCL", 0), CudaBackend::kNccl);
  EXPECT_EQ(resolve_cuda_backend(std::nullopt, "Staged", 0), CudaBackend::kStaged);
  EXPECT_EQ(resolve_cuda_backend(std::nullopt, "auto", 0), CudaBackend::kAuto);
  EXPECT_EQ(resolve_cuda_backend(std::nullopt, "IPC", 0), CudaBackend::kCudaIpc);
  EXPECT_EQ(resolve_cuda_backend(std::nullopt, "", 0), CudaBackend::kAuto);
  EXPECT_EQ(resolve_cuda_backend(std::nullopt, nullptr, 0), CudaBackend::kAuto);
  try {
    resolve_cuda_backend(std::nullopt, "gloo", 1);
    ADD_FAILURE() << "FSDP_CUDA_BACKEND=gloo was accepted";
  } catch (const c10::Error& e) {
    const std::string msg = e.what_without_backtrace();
    EXPECT_NE(msg.find("rank 1"), std::string::npos) << msg;
    EXPECT_NE(
        msg.find("FSDP_CUDA_BACKEND=gloo is not a CUDA backend; use auto, nccl, staged or ipc"),
        std::string::npos)
        << msg;
  }
}

// What this machine's ranks can do decides the group's choice; with no GPU
// (CI) that is "staged", and CUDA tensors have no NCCL group to go to.
class CudaBackendAgreement : public ::testing::TestWithParam<int> {};

TEST_P(CudaBackendAgreement, EveryRankReportsTheChoice) {
  run_ranks_ok(GetParam(), [](int, int world) {
    auto pg = join(Backend::kGloo);
    const CudaFacts mine = detail::this_process_cuda_facts(world);
    const bool can = choose_cuda_backend(CudaBackend::kAuto, mine).nccl;
    // The ranks of this test are processes of one machine: IPC where they
    // share its one GPU.
    const bool ipc =
        auto_tries_cuda_ipc(CudaBackend::kAuto, can, mine, world) && mine.visible_gpus == 1;
    EXPECT_EQ(rank_info().cuda_backend, can ? "nccl" : ipc ? "cuda_ipc" : "staged");
    auto* routed = dynamic_cast<detail::DeviceRoutedProcessGroup*>(pg.get());
    ASSERT_NE(routed, nullptr);
    EXPECT_EQ(routed->cuda_group() != nullptr, can || ipc);
  });
}

TEST_P(CudaBackendAgreement, StagedWhenAskedForHasNoNcclGroup) {
  run_ranks_ok(GetParam(), [](int, int) {
    auto staged = init_process_group(
        ProcessGroupOptions().cuda_backend(CudaBackend::kStaged).timeout(std::chrono::seconds(30)));
    EXPECT_EQ(dynamic_cast<detail::DeviceRoutedProcessGroup&>(*staged).cuda_group(), nullptr);
    EXPECT_EQ(rank_info().cuda_backend, "staged");
  });
}

TEST_P(CudaBackendAgreement, NcclThatCannotRunIsAnErrorOnEveryRank) {
  if (choose_cuda_backend(CudaBackend::kNccl, detail::this_process_cuda_facts(GetParam())).nccl) {
    GTEST_SKIP() << "this machine can run NCCL: test_nccl_cuda covers it";
  }
  run_ranks_ok(GetParam(), [](int, int) {
    expect_error_within(
        [] {
          init_process_group(ProcessGroupOptions()
                                 .cuda_backend(CudaBackend::kNccl)
                                 .timeout(std::chrono::seconds(30)));
        },
        std::chrono::seconds(20));
    EXPECT_FALSE(is_initialized());
  });
}

// Without a GPU (CI) no rank can open CUDA IPC slots: every rank says so in
// one line, within the timeout, instead of one rank waiting for the others.
TEST_P(CudaBackendAgreement, CudaIpcThatCannotRunIsAnErrorOnEveryRank) {
  if (at::hasCUDA()) GTEST_SKIP() << "this machine has a GPU: test_cuda_ipc covers it";
  run_ranks_ok(GetParam(), [](int, int) {
    try {
      init_process_group(ProcessGroupOptions()
                             .cuda_backend(CudaBackend::kCudaIpc)
                             .timeout(std::chrono::seconds(30)));
      ADD_FAILURE() << "CudaBackend::kCudaIpc was honoured without a GPU";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("CudaBackend::kCudaIpc (or FSDP_CUDA_BACKEND=ipc) "
                                           "cannot be honoured: this process sees no GPU"),
                std::string::npos)
          << e.what();
    }
    EXPECT_FALSE(is_initialized());
  });
}

TEST(CudaBackendAgreement, ABadVariableIsAnErrorOnEveryRank) {
  MultiRankOptions options;
  options.env["FSDP_CUDA_BACKEND"] = "cuda";
  run_ranks_ok(
      2,
      [](int, int) {
        try {
          join(Backend::kGloo);
          ADD_FAILURE() << "FSDP_CUDA_BACKEND=cuda was accepted";
        } catch (const c10::Error& e) {
          EXPECT_NE(std::string(e.what()).find("FSDP_CUDA_BACKEND=cuda is not a CUDA backend"),
                    std::string::npos);
        }
      },
      options);
}

INSTANTIATE_TEST_SUITE_P(Ranks, CudaBackendAgreement, ::testing::Values(1, 2),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return std::to_string(info.param) + "Ranks";
                         });

}  // namespace test_cuda_backend
}  // namespace fsdp::testing
