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

using Clock = std::chrono::steady_clock;
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
    const int64_t s = rank == 0 ? 8 : 16;
    const auto t0 = Clock::now();
    try {
      pg->all_gather_into_tensor(at::zeros({world * s}), at::ones({s})).wait();
      ADD_FAILURE() << "mismatched all-gathers completed";
    } catch (const c10::Error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("issued different collectives"), std::string::npos) << msg;
      EXPECT_NE(msg.find(rank == 0 ? "of 64 bytes where slot" : "of 32 bytes where slot"),
                std::string::npos)
          << msg;
    }
    EXPECT_LE(Clock::now() - t0, std::chrono::seconds(2)) << "the mismatch waited for a timeout";
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
        Clock::time_point since = Clock::now();
        try {
          for (int i = 0; i < 100000; ++i) {
            since = Clock::now();
            pg->all_gather_into_tensor(flat, shard).wait();
            pg->reduce_scatter_tensor(shard, flat).wait();
          }
          ADD_FAILURE() << "collectives succeeded although a peer died";
        } catch (const c10::Error& e) {
          std::cout << "got the expected error: " << e.what() << std::endl;
        }
        EXPECT_LE(Clock::now() - since, kAllowed);
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
