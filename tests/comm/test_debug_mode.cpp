// Debug mode (Note [Collective fingerprints]): ranks that issue mismatched
// collectives all fail within one collective, with both fingerprints in the
// message, instead of hanging until the timeout; correct programs run
// unchanged.

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <chrono>
#include <string>

#include "comm_test_util.h"
#include "multi_rank.h"

namespace fsdp::testing {
namespace test_debug_mode {

using Clock = std::chrono::steady_clock;
constexpr auto kGroupTimeout = std::chrono::seconds(30);
// "Within one collective": far below the group timeout a hang would take.
constexpr auto kFast = std::chrono::seconds(5);

class DebugMode : public ::testing::TestWithParam<Backend> {};

void expect_contains(const std::string& msg, const std::string& part) {
  EXPECT_NE(msg.find(part), std::string::npos) << "missing '" << part << "' in: " << msg;
}

TEST_P(DebugMode, MismatchedSizesFailFastOnEveryRankNamingBothFingerprints) {
  run_ranks_ok(2, [](int rank, int) {
    auto pg = init_process_group(
        ProcessGroupOptions().backend(GetParam()).timeout(kGroupTimeout).debug_collectives(true));
    ASSERT_TRUE(pg->debug_collectives());
    at::Tensor ok = at::ones({3});
    pg->all_reduce(ok).wait();  // matching collectives are unaffected
    EXPECT_TRUE(at::equal(ok, at::full({3}, 2.0f)));

    at::Tensor t = at::ones({rank == 0 ? 4 : 8});
    const auto start = Clock::now();
    try {
      pg->all_reduce(t).wait();
      ADD_FAILURE() << "the mismatched all_reduce succeeded on rank " << rank;
    } catch (const c10::Error& e) {
      const auto took = Clock::now() - start;
      EXPECT_LT(took, kFast) << "the mismatch was found only after "
                             << std::chrono::duration_cast<std::chrono::milliseconds>(took).count()
                             << " ms";
      const std::string msg = e.what_without_backtrace();
      expect_contains(msg, "collective mismatch");
      expect_contains(msg, "rank 0 issued all_reduce #");
      expect_contains(msg, "(4 x Float, sum)");
      expect_contains(msg, "rank 1 issued all_reduce #");
      expect_contains(msg, "(8 x Float, sum)");
    }
    // The group is broken for good: later collectives fail at once.
    const auto start2 = Clock::now();
    EXPECT_THROW(pg->barrier().wait(), c10::Error);
    EXPECT_LT(Clock::now() - start2, kFast);
  });
}

TEST_P(DebugMode, DifferentOperationsFailFast) {
  run_ranks_ok(2, [](int rank, int) {
    auto pg = init_process_group(
        ProcessGroupOptions().backend(GetParam()).timeout(kGroupTimeout).debug_collectives(true));
    const auto start = Clock::now();
    try {
      at::Tensor flat = at::zeros({4}, at::kDouble);
      if (rank == 0) {
        pg->all_gather_into_tensor(flat, flat.narrow(0, 0, 2)).wait();
      } else {
        pg->broadcast(flat, 1).wait();
      }
      ADD_FAILURE() << "mismatched collectives succeeded on rank " << rank;
    } catch (const c10::Error& e) {
      EXPECT_LT(Clock::now() - start, kFast);
      const std::string msg = e.what_without_backtrace();
      expect_contains(msg, "rank 0 issued all_gather #");
      expect_contains(msg, "(4 x Double)");
      expect_contains(msg, "rank 1 issued broadcast #");
      expect_contains(msg, "(4 x Double, root 1)");
    }
  });
}

// FSDP_DEBUG=detail turns it on; every collective gives its usual result at
// three ranks (the fingerprints' messages never collide with the ring's).
TEST_P(DebugMode, EnvironmentTurnsItOnAndCorrectCollectivesAreUnchanged) {
  MultiRankOptions options;
  options.env["FSDP_DEBUG"] = "detail";
  run_ranks_ok(
      3,
      [](int rank, int world) {
        auto pg = join(GetParam(), kGroupTimeout);
        ASSERT_TRUE(pg->debug_collectives());
        const int64_t s = 300000;  // several ring segments per chunk
        at::Tensor shard = at::full({s}, static_cast<float>(rank));
        at::Tensor flat = at::empty({world * s});
        auto ag = pg->all_gather_into_tensor(flat, shard);
        at::Tensor grads = at::arange(world * s, at::kFloat);
        at::Tensor out = at::empty({s});
        auto rs = pg->reduce_scatter_tensor(out, grads, ReduceOp::kSum);
        at::Tensor b = at::full({5}, static_cast<double>(rank), at::kDouble);
        auto bc = pg->broadcast(b, 2);
        ag.wait();
        rs.wait();
        bc.wait();
        pg->barrier().wait();
        for (int r = 0; r < world; ++r) {
          EXPECT_TRUE(tensors_equal(flat.narrow(0, r * s, s), at::full({s}, float(r))));
        }
        EXPECT_TRUE(tensors_equal(out, grads.narrow(0, rank * s, s) * world));
        EXPECT_TRUE(tensors_equal(b, at::full({5}, 2.0, at::kDouble)));
        // Sub-groups inherit it; switching off applies to later collectives.
        auto sub = pg->new_subgroup({0, 1, 2});
        EXPECT_TRUE(sub->debug_collectives());
        pg->set_debug_collectives(false);
        EXPECT_FALSE(pg->debug_collectives());
        at::Tensor one = at::ones({2}, at::kBFloat16);
        pg->all_reduce(one, ReduceOp::kMax).wait();
        EXPECT_EQ(one[0].item<float>(), 1.0f);
      },
      options);
}

INSTANTIATE_TEST_SUITE_P(Engines, DebugMode, ::testing::ValuesIn(available_engines()),
                         backend_label);

}  // namespace test_debug_mode
}  // namespace fsdp::testing
