// Small collectives travel over direct links (Note [Direct links for small
// collectives]): ranks that issue collectives of different sizes get an error
// naming both, a dead or stuck peer fails the others in time, and a stranger
// on a link's port during set-up is turned away.

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <signal.h>

#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "comm/direct_links.h"
#include "comm/gloo_engine.h"
#include "comm_test_util.h"
#include "multi_rank.h"
#include "rendezvous/socket.h"

namespace fsdp::testing {
namespace test_direct_links {

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

// Note [What a ring slot says]: collectives of the same size at the same
// place but of another kind or reduce op (a sum against a max, an
// all-gather against a reduce-scatter of the same shard size) are an error
// on every rank at once; they exchanged their bytes silently. Each pair
// breaks a group of its own.
TEST(DirectLinks, CollectivesOfTheSameSizeButAnotherKindAreAnErrorOnEveryRank) {
  run_ranks_ok(2, [](int rank, int world) {
    auto pg = join(Backend::kGloo, std::chrono::seconds(30));
    auto sums = pg->new_subgroup({0, 1}), gathers = pg->new_subgroup({0, 1});
    const auto expect_mismatch = [](const std::function<void()>& collective) {
      const auto t0 = std::chrono::steady_clock::now();
      try {
        collective();
        ADD_FAILURE() << "mismatched collectives completed";
      } catch (const c10::Error& e) {
        EXPECT_NE(std::string(e.what()).find("issued different collectives"), std::string::npos)
            << e.what();
      }
      EXPECT_LE(std::chrono::steady_clock::now() - t0, std::chrono::seconds(2))
          << "the mismatch waited for a timeout";
    };
    expect_mismatch([&] {
      sums->all_reduce(at::ones({16}), rank == 0 ? ReduceOp::kSum : ReduceOp::kMax).wait();
    });
    expect_mismatch([&] {
      at::Tensor flat = at::ones({world * 8}), shard = at::ones({8});
      (rank == 0 ? gathers->all_gather_into_tensor(flat, shard)
                 : gathers->reduce_scatter_tensor(shard, flat, ReduceOp::kSum))
          .wait();
    });
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
          // The others' pairs (collectives_until_error); all-gathers alone
          // passed for them only while slots did not say what a collective
          // is (Note [What a ring slot says]).
          for (int i = 0; i < 50; ++i) {
            pg->all_gather_into_tensor(flat, shard).wait();
            pg->reduce_scatter_tensor(shard, flat).wait();
          }
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

// A rank whose collective fails (here rank 3, which finds rank 2 sent
// another size: a mismatch) closes its links (Note [Broken groups]), so its
// neighbours fail at once, and theirs in turn: every rank of the ring fails
// within a few seconds of a 20 s timeout (the ranks two or more hops away
// waited the whole timeout, then blamed a live neighbour). Found by a review.
TEST(DirectLinks, ABrokenGroupClosesItsLinksSoTheRingFailsAtOnce) {
  run_ranks_ok(
      4,
      [](int rank, int) {
        auto pg = init_process_group(ProcessGroupOptions()
                                         .shared_memory(false)
                                         .direct_link_bytes(int64_t{1} << 20)
                                         .timeout(std::chrono::seconds(20)));
        pg->barrier().wait();
        at::Tensor t = at::ones({rank == 2 ? 64 : 32});
        expect_error_within([&] { pg->all_reduce(t).wait(); }, std::chrono::seconds(3));
        // Alive meanwhile, its sockets open: what a rank that catches the
        // error and goes on (or is slow to exit) leaves its peers.
        std::this_thread::sleep_for(std::chrono::seconds(4));
      },
      MultiRankOptions{std::chrono::seconds(90), std::chrono::seconds(30), {}});
}

// Note [Strangers on the direct-link port]: connections that do not open with
// the job's token (here a rank number alone, or silence) are closed, and the
// link to the real rank is made all the same. Rank 0's port gets both before rank
// 1 starts, so rank 0 accepts them first.
// The same over Gloo's pairs, where libfsdp has Gloo (Note [Gloo or not];
// skipped without): rank 2's collective times out (a timeout of 1 s, its
// previous rank 3 s late), and its group closes its pairs, so that ranks 0
// and 3 fail at once (they waited out their own 20 s), and rank 1 as it
// comes. (A size mismatch over Gloo aborts the receiving process inside
// Gloo.)
TEST(GlooPairs, ABrokenGroupClosesItsPairsSoTheRingFailsAtOnce) {
  if (!detail::built_with_gloo()) GTEST_SKIP() << "built without Gloo";
  run_ranks_ok(
      4,
      [](int rank, int) {
        auto pg = init_process_group(
            ProcessGroupOptions().shared_memory(false).direct_link_bytes(0).timeout(
                rank == 2 ? std::chrono::seconds(1) : std::chrono::seconds(20)));
        pg->barrier().wait();
        if (rank == 1) std::this_thread::sleep_for(std::chrono::seconds(3));
        at::Tensor t = at::ones({1 << 16});
        expect_error_within([&] { pg->all_reduce(t).wait(); }, std::chrono::seconds(5));
        std::this_thread::sleep_for(std::chrono::seconds(4));  // alive, sockets open
      },
      MultiRankOptions{std::chrono::seconds(90), std::chrono::seconds(30), {}});
}

TEST(DirectLinks, StrangersOnTheLinkPortAreTurnedAway) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  constexpr auto kSetup = std::chrono::seconds(20);
  std::unique_ptr<detail::DirectLinks> links[2];
  std::string errors[2];
  auto make = [&](int rank) {
    try {
      links[rank] = std::make_unique<detail::DirectLinks>(*store, rank, 2, "127.0.0.1", kSetup,
                                                          int64_t{1} << 16, "");
    } catch (const std::exception& e) {
      errors[rank] = e.what();
    }
  };
  std::thread rank0(make, 0);
  const auto where = store->get("direct/0");  // "127.0.0.1 <port>"
  const int port = std::stoi(std::string(where.begin(), where.end()).substr(10));
  detail::UniqueFd liar = detail::connect_tcp("127.0.0.1", port, kSetup);
  const int32_t seven = 7;
  ASSERT_TRUE(detail::write_all(liar.get(), &seven, sizeof(seven)));
  detail::UniqueFd silent = detail::connect_tcp("127.0.0.1", port, kSetup);
  std::thread rank1(make, 1);
  rank1.join();
  rank0.join();
  ASSERT_TRUE(links[0] && links[1]) << errors[0] << errors[1];
  at::Tensor sent = at::arange(16, at::kFloat), got = at::zeros({16});
  auto recv = links[0]->irecv(got, 1, 0);
  links[1]->isend(sent, 0, 0)->wait();
  recv->wait();
  EXPECT_TRUE(got.equal(sent));
}

}  // namespace test_direct_links
}  // namespace fsdp::testing
