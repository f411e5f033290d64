// Small collectives travel over direct links (Note [Direct links for small
// collectives]): ranks that issue collectives of different sizes get an error
// naming both, and a dead or stuck peer fails the others in time.

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <signal.h>

#include <chrono>
#include <thread>

#include "comm_test_util.h"
#include "multi_rank.h"

namespace fsdp::testing {
namespace {

constexpr auto kTimeout = std::chrono::seconds(3);
constexpr auto kAllowed = kTimeout + std::chrono::seconds(5);

TEST(DirectLinks, CollectivesOfDifferentSizesAreAnErrorOnEveryRank) {
  run_ranks_ok(2, [](int rank, int world) {
    auto pg = join(Backend::kGloo, std::chrono::seconds(30));
    // Matching small collectives work, back to back.
    at::Tensor flat = at::zeros({world * 8});
    for (int i = 0; i < 50; ++i) {
      pg->all_gather_into_tensor(flat, at::full({8}, static_cast<float>(rank + i))).wait();
      EXPECT_EQ(flat[8].item<float>(), static_cast<float>(1 + i));
    }
    // Rank 1 gathers shards of 16 where rank 0 gathers shards of 8.
    expect_mismatched_all_gather_error(
        *pg, rank == 0 ? 8 : 16, rank == 0 ? "of 64 bytes where slot" : "of 32 bytes where slot");
  });
}

TEST(DirectLinks, PeerKilledDuringSmallCollectivesFailsTheOthersInTime) {
  auto outcomes = run_ranks(
      3,
      [](int rank, int world) {
        auto pg = join(Backend::kGloo, kTimeout);
        pg->barrier().wait();
        at::Tensor flat = at::zeros({world * 16});
        at::Tensor shard = at::ones({16});
        if (rank == 1) {
          for (int i = 0; i < 100; ++i) pg->all_gather_into_tensor(flat, shard).wait();
          raise(SIGKILL);
        }
        EXPECT_LE(collectives_until_error(*pg, 16, 100000), kAllowed);
      },
      MultiRankOptions{std::chrono::seconds(60), std::chrono::seconds(20), {}});
  ASSERT_EQ(outcomes.size(), 3u);
  EXPECT_EQ(outcomes[1].term_signal, SIGKILL) << describe(outcomes[1]);
  for (int r : {0, 2}) {
    EXPECT_EQ(outcomes[r].exit_code, 0) << describe(outcomes[r]);
    EXPECT_NE(outcomes[r].output.find("got the expected error"), std::string::npos)
        << describe(outcomes[r]);
  }
}

TEST(DirectLinks, StuckPeerMakesSmallCollectivesTimeOut) {
  auto outcomes = run_ranks(
      2,
      [](int rank, int world) {
        auto pg = join(Backend::kGloo, kTimeout);
        pg->barrier().wait();
        if (rank == 1) {
          std::this_thread::sleep_for(std::chrono::seconds(6));
          return;
        }
        expect_error_within(
            [&] { pg->all_gather_into_tensor(at::zeros({world * 4}), at::ones({4})).wait(); },
            kAllowed);
      },
      MultiRankOptions{std::chrono::seconds(60), std::chrono::seconds(20), {}});
  ASSERT_EQ(outcomes.size(), 2u);
  EXPECT_EQ(outcomes[0].exit_code, 0) << describe(outcomes[0]);
  EXPECT_NE(outcomes[0].output.find("got the expected error"), std::string::npos)
      << describe(outcomes[0]);
}

}  // namespace
}  // namespace fsdp::testing
