// Collectives larger than a direct link's message go through shared memory
// when every rank is on this host (Note [Shared memory for same-host ranks]):
// the segment is really used and has no name (a memfd), all-reduce gives
// every rank the same bits, ranks in different collectives get an error naming
// both, and a killed peer fails the others well before the timeout.

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <stdlib.h>

#include <chrono>
#include <fstream>
#include <string>
#include <thread>

#include "comm_test_util.h"
#include "multi_rank.h"

namespace fsdp::testing {
namespace test_shm_links {

// Lines of /proc/self/maps naming one of libfsdp's shared-memory segments
// (memfds, Note [Shared memory without a name]).
std::vector<std::string> shm_mappings() {
  std::ifstream maps("/proc/self/maps");
  std::vector<std::string> found;
  for (std::string line; std::getline(maps, line);) {
    if (line.find("/memfd:fsdp-shm") != std::string::npos) found.push_back(line);
  }
  return found;
}

TEST(ShmLinks, SameHostGroupMapsOneSegmentWithoutAName) {
  run_ranks_ok(3, [](int rank, int world) {
    auto pg = join(Backend::kGloo);
    const auto maps = shm_mappings();
    ASSERT_EQ(maps.size(), 1u) << "expected the group's segment mapped once";
    EXPECT_NE(maps[0].find("(deleted)"), std::string::npos)
        << "the segment must have no name: " << maps[0];
    // A sub-group has a segment of its own.
    auto sub = pg->new_subgroup({0, 2});
    EXPECT_EQ(shm_mappings().size(), rank == 1 ? 1u : 2u);
    (void)world;
  });
}

TEST(ShmLinks, TurnedOffOnOneRankKeepsEveryRankOnGloo) {
  run_ranks_ok(2, [](int rank, int world) {
    if (rank == 1) setenv("FSDP_SHM", "0", 1);
    auto pg = join(Backend::kGloo);
    EXPECT_TRUE(shm_mappings().empty());
    // Large collectives still work (over Gloo).
    const int64_t s = 1 << 20;
    at::Tensor flat = at::zeros({world * s});
    pg->all_gather_into_tensor(flat, at::full({s}, static_cast<float>(rank + 1))).wait();
    EXPECT_EQ(flat[s].item<float>(), 2.0f);
  });
}

TEST(ShmLinks, AllReduceGivesEveryRankTheSameBits) {
  run_ranks_ok(3, [](int rank, int world) {
    auto pg = join(Backend::kGloo);
    ASSERT_EQ(shm_mappings().size(), 1u);
    for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
      for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg}) {
        at::manual_seed(100 + rank);
        // Several rounds of the 2 MiB slots, with a ragged end.
        at::Tensor t = at::randn({3 * (1 << 20) + 12345}).to(dtype);
        pg->all_reduce(t, op).wait();
        at::Tensor all = at::empty({world * t.numel()}, t.options());
        pg->all_gather_into_tensor(all, t).wait();
        for (int p = 1; p < world; ++p) {
          EXPECT_TRUE(
              at::equal(all.narrow(0, 0, t.numel()), all.narrow(0, p * t.numel(), t.numel())))
              << "rank " << p << " got other bits than rank 0 (" << dtype << ", " << to_string(op)
              << ")";
        }
        // The value itself: the sum of every rank's draw, in rank order.
        at::Tensor expected = at::zeros({t.numel()}, at::kFloat);
        for (int p = 0; p < world; ++p) {
          at::manual_seed(100 + p);
          expected = p == 0 ? at::randn({t.numel()}).to(dtype)
                            : expected + at::randn({t.numel()}).to(dtype);
        }
        if (op == ReduceOp::kAvg) expected = expected / world;
        EXPECT_TRUE(at::equal(t, expected.to(dtype))) << dtype << " " << to_string(op);
      }
    }
  });
}

TEST(ShmLinks, CollectivesOfDifferentSizesAreAnErrorOnEveryRank) {
  run_ranks_ok(2, [](int rank, int world) {
    auto pg = join(Backend::kGloo, std::chrono::seconds(30));
    ASSERT_EQ(shm_mappings().size(), 1u);
    // Rank 1 gathers 2 MiB shards (fp32) where rank 0 gathers 1 MiB ones.
    expect_mismatched_all_gather_error(*pg, rank == 0 ? (256 << 10) : (512 << 10),
                                       rank == 0 ? "issued all_gather of 4194304 bytes (Float) "
                                                   "where this rank issued all_gather of 2097152 "
                                                   "bytes (Float)"
                                                 : "issued all_gather of 2097152 bytes (Float) "
                                                   "where this rank issued all_gather of 4194304 "
                                                   "bytes (Float)");
  });
}

TEST(ShmLinks, KilledPeerFailsTheOthersLongBeforeTheTimeout) {
  auto outcomes = run_ranks(
      3,
      [](int rank, int world) {
        // A long timeout: the error must come from seeing the peer gone.
        auto pg = join(Backend::kGloo, std::chrono::seconds(60));
        const int64_t s = 4 << 20;
        at::Tensor flat = at::zeros({world * s});
        at::Tensor shard = at::ones({s});
        pg->barrier().wait();
        if (rank == 1) {
          auto work = pg->all_gather_into_tensor(flat, shard);
          std::this_thread::sleep_for(std::chrono::milliseconds(2));
          raise(SIGKILL);
        }
        EXPECT_LE(collectives_until_error(*pg, s, 1000), std::chrono::seconds(10));
      },
      MultiRankOptions{std::chrono::seconds(50), std::chrono::seconds(20), {}});
  ASSERT_EQ(outcomes.size(), 3u);
  EXPECT_EQ(outcomes[1].term_signal, SIGKILL) << describe(outcomes[1]);
  for (int r : {0, 2}) {
    EXPECT_EQ(outcomes[r].exit_code, 0) << describe(outcomes[r]);
    // One rank sees rank 1 gone; the other either does too, or is stopped
    // by the first one's abort.
    const bool named =
        outcomes[r].output.find("rank 1 (pid") != std::string::npos ||
        outcomes[r].output.find("failed a collective over shared memory") != std::string::npos;
    EXPECT_TRUE(named) << describe(outcomes[r]);
  }
  EXPECT_TRUE(outcomes[0].output.find("exited or was killed") != std::string::npos ||
              outcomes[2].output.find("exited or was killed") != std::string::npos)
      << describe(outcomes[0]) << describe(outcomes[2]);
}

}  // namespace test_shm_links
}  // namespace fsdp::testing
