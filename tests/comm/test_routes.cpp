// Every route of Note [Routes of collectives], forced with ProcessGroupOptions
// (and with the environment variables that may still set them), at 2 and 3
// ranks: each collective (all-gather, reduce-scatter sum and avg, all-reduce
// with every op, broadcast, barrier) must give its closed-form result *and*
// be counted on the route the table promises, and on no other.

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <array>
#include <string>
#include <vector>

#include "comm/device_routed.h"
#include "comm/gloo_engine.h"
#include "comm/gloo_process_group.h"
#include "comm_test_util.h"
#include "multi_rank.h"

namespace fsdp::testing {
namespace test_routes {

using detail::GlooProcessGroup;
using detail::Route;

constexpr std::array<CollectiveKind, 5> kKinds = {
    CollectiveKind::kAllGather, CollectiveKind::kReduceScatter, CollectiveKind::kAllReduce,
    CollectiveKind::kBroadcast, CollectiveKind::kBarrier};
constexpr std::array<Route, 3> kRoutes = {Route::kLinks, Route::kShm, Route::kGloo};
constexpr std::array<ReduceOp, 4> kOps = {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax,
                                          ReduceOp::kMin};

// Where broadcast and barrier go: Gloo where built with it, else the links.
Route control_route() { return detail::built_with_gloo() ? Route::kGloo : Route::kLinks; }

// Small integers, exact in every dtype used here.
at::Tensor pattern(int64_t n, int64_t offset, int64_t modulus, at::ScalarType dtype) {
  return (at::arange(n, at::kLong).remainder(modulus) + offset).to(dtype);
}

GlooProcessGroup& engine_of(const std::shared_ptr<ProcessGroup>& pg) {
  auto* g = dynamic_cast<GlooProcessGroup*>(&detail::engine_of(*pg));
  TORCH_INTERNAL_ASSERT(g != nullptr, "expected Backend::kGloo's group");
  return *g;
}

using Counts = std::array<std::array<uint64_t, 3>, 5>;

Counts counts_of(const GlooProcessGroup& g) {
  Counts c{};
  for (size_t k = 0; k < kKinds.size(); ++k) {
    for (size_t r = 0; r < kRoutes.size(); ++r) c[k][r] = g.route_count(kKinds[k], kRoutes[r]);
  }
  return c;
}

// One of each collective, `shard_numel` elements per rank, checked against
// closed forms. Returns how many of each kind it issued.
std::array<uint64_t, 5> run_every_collective(ProcessGroup& pg, int64_t shard_numel,
                                             at::ScalarType dtype) {
  const int r = pg.rank(), n = pg.size();
  const int64_t s = shard_numel;
  std::array<uint64_t, 5> issued{};

  at::Tensor flat = at::full({n * s}, -1, dtype);
  pg.all_gather_into_tensor(flat, pattern(s, r + 1, 13, dtype)).wait();
  for (int k = 0; k < n; ++k) {
    EXPECT_TRUE(tensors_equal(flat.narrow(0, k * s, s), pattern(s, k + 1, 13, dtype)))
        << "all_gather, chunk of rank " << k;
  }
  ++issued[0];

  for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg}) {
    const at::Tensor grads = pattern(n * s, r + 1, 11, dtype);
    at::Tensor shard = at::full({s}, -1, dtype);
    pg.reduce_scatter_tensor(shard, grads, op).wait();
    // sum over ranks k of (k + 1 + j % 11) = n(n+1)/2 + n * (j % 11).
    at::Tensor sum =
        (at::arange(r * s, (r + 1) * s, at::kLong).remainder(11) * n + n * (n + 1) / 2).to(dtype);
    EXPECT_TRUE(tensors_equal(shard, op == ReduceOp::kAvg ? sum.div(n) : sum))
        << "reduce_scatter " << to_string(op);
    ++issued[1];
  }

  // All-reduce of n * s elements: the same per-rank chunk as above.
  for (ReduceOp op : kOps) {
    at::Tensor t = pattern(n * s, r + 1, 7, dtype);
    pg.all_reduce(t, op).wait();
    const at::Tensor expected = expected_all_reduce(n * s, n, op, dtype);
    EXPECT_TRUE(tensors_equal(t, expected)) << "all_reduce " << to_string(op);
    ++issued[2];
  }

  const int root = n - 1;
  at::Tensor b = r == root ? pattern(s, 5, 9, dtype) : at::full({s}, -1, dtype);
  pg.broadcast(b, root).wait();
  EXPECT_TRUE(tensors_equal(b, pattern(s, 5, 9, dtype))) << "broadcast";
  ++issued[3];

  pg.barrier().wait();
  ++issued[4];
  return issued;
}

// Runs every collective in a group made with `options` and expects all
// all-gathers, reduce-scatters and all-reduces on `data`, broadcasts and
// barriers on `control`.
void expect_routes(int world, const ProcessGroupOptions& options, int64_t shard_numel, Route data,
                   Route control, const MultiRankOptions& run = {}) {
  run_ranks_ok(
      world,
      [&](int, int) {
        auto pg =
            init_process_group(ProcessGroupOptions(options).timeout(std::chrono::seconds(30)));
        GlooProcessGroup& g = engine_of(pg);
        for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
          const Counts before = counts_of(g);
          const auto issued = run_every_collective(*pg, shard_numel, dtype);
          const Counts after = counts_of(g);
          for (size_t k = 0; k < kKinds.size(); ++k) {
            const Route want = k < 3 ? data : control;
            for (size_t r = 0; r < kRoutes.size(); ++r) {
              const uint64_t ran = after[k][r] - before[k][r];
              EXPECT_EQ(ran, kRoutes[r] == want ? issued[k] : 0)
                  << to_string(kKinds[k]) << " over " << detail::to_string(kRoutes[r])
                  << " (expected all over " << detail::to_string(want) << "), " << dtype
                  << ", world " << world;
            }
          }
        }
      },
      run);
}

class Routes : public ::testing::TestWithParam<int> {};

// Defaults: chunks up to 64 KiB over the direct links.
TEST_P(Routes, SmallChunksTakeTheDirectLinks) {
  expect_routes(GetParam(), ProcessGroupOptions(), 1000, Route::kLinks, control_route());
}

// direct_link_bytes(0): every size through shared memory on one host; small
// slots make the 400 KB chunks take many rounds.
TEST_P(Routes, WithoutDirectLinksEverySizeTakesSharedMemory) {
  expect_routes(GetParam(), ProcessGroupOptions().direct_link_bytes(0).shm_slot_bytes(4096), 7,
                Route::kShm, control_route());
  expect_routes(GetParam(), ProcessGroupOptions().direct_link_bytes(0).shm_slot_bytes(4096), 100000,
                Route::kShm, control_route());
}

// Above the direct-link size with shared memory on: shared memory.
TEST_P(Routes, LargeChunksTakeSharedMemoryOnOneHost) {
  expect_routes(GetParam(), ProcessGroupOptions(), 100000, Route::kShm, control_route());
}

// Shared memory off and direct_link_bytes(0): Gloo for every size, small
// messages included (LibTorch 1.13 builds); without Gloo (2.15) the links
// carry every message through their sender thread. Small ring segments make
// the large chunks take many segments.
TEST_P(Routes, WithoutSharedMemoryAndDirectLinksGlooCarriesEverySize) {
  const auto options = ProcessGroupOptions().shared_memory(false).direct_link_bytes(0);
  expect_routes(GetParam(), options, 1, control_route(), control_route());
  expect_routes(GetParam(), options, 1000, control_route(), control_route());
  expect_routes(GetParam(), ProcessGroupOptions(options).ring_segment_bytes(4096), 100000,
                control_route(), control_route());
}

// Shared memory off: small chunks over the links, large ones over Gloo
// (or the links' sender thread without Gloo), as between hosts.
TEST_P(Routes, WithoutSharedMemoryLargeChunksTakeGloo) {
  const auto options = ProcessGroupOptions().shared_memory(false);
  expect_routes(GetParam(), options, 1000, Route::kLinks, control_route());
  expect_routes(GetParam(), options, 100000, control_route(), control_route());
}

// Messages the calling thread sends itself that together fill the links'
// buffers, as a ring step posts them all before reading: a direct_link_bytes
// above the buffers the kernel grants, and small ring segments (every one
// inline). Each completes (Note [Direct links for small collectives]).
TEST_P(Routes, InlineMessagesBeyondTheSocketBuffersComplete) {
  const auto options = ProcessGroupOptions().shared_memory(false);
  expect_routes(GetParam(), ProcessGroupOptions(options).direct_link_bytes(8 << 20), 1 << 20,
                Route::kLinks, control_route());
  expect_routes(GetParam(), ProcessGroupOptions(options).ring_segment_bytes(4096), 1 << 20,
                control_route(), control_route());
}

// The environment variables still set the knobs, and a field set explicitly
// wins over its variable.
TEST_P(Routes, EnvironmentSetsTheKnobsAndExplicitFieldsWin) {
  MultiRankOptions run;
  run.env = {{"FSDP_SHM", "0"},
             {"FSDP_DIRECT_LINK_BYTES", "0"},
             {"FSDP_RING_SEGMENT_BYTES", "8192"},
             {"FSDP_SHM_SLOT_BYTES", "10000"}};
  expect_routes(GetParam(), ProcessGroupOptions(), 1000, control_route(), control_route(), run);
  expect_routes(GetParam(), ProcessGroupOptions().shared_memory(true), 1000, Route::kShm,
                control_route(), run);
  expect_routes(GetParam(), ProcessGroupOptions().direct_link_bytes(64 << 10), 1000, Route::kLinks,
                control_route(), run);
  run_ranks_ok(
      GetParam(),
      [](int, int) {
        auto pg = init_process_group(ProcessGroupOptions().ring_segment_bytes(65536));
        const detail::CommConfig& c = engine_of(pg).config();
        EXPECT_EQ(c.direct_link_bytes, 0);
        EXPECT_EQ(c.ring_segment_bytes, 65536);  // the field, not the variable
        EXPECT_FALSE(c.shared_memory);
        EXPECT_EQ(c.shm_slot_bytes, 9984);  // rounded down to a multiple of 64
        // Sub-groups inherit the group's knobs.
        auto sub = pg->new_subgroup({0, 1});
        if (sub) EXPECT_EQ(engine_of(sub).config().ring_segment_bytes, 65536);
      },
      run);
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, Routes, ::testing::Values(2, 3),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return std::to_string(info.param) + "Ranks";
                         });

TEST(RouteOptions, DefaultsAndInvalidFields) {
  // Nothing in the environment: the defaults.
  const detail::CommConfig c = detail::resolve_comm_config(ProcessGroupOptions());
  EXPECT_EQ(c.direct_link_bytes, 64 << 10);
  EXPECT_EQ(c.ring_segment_bytes, 1 << 20);
  EXPECT_TRUE(c.shared_memory);
  EXPECT_EQ(c.shm_slot_bytes, 2 << 20);
  auto expect_error = [](const ProcessGroupOptions& o, const std::string& part) {
    try {
      detail::resolve_comm_config(o);
      ADD_FAILURE() << "accepted; expected an error with '" << part << "'";
    } catch (const c10::Error& e) {
      const std::string msg = e.what_without_backtrace();
      EXPECT_NE(msg.find("fsdp(init_process_group): "), std::string::npos) << msg;
      EXPECT_NE(msg.find(part), std::string::npos) << msg;
    }
  };
  expect_error(ProcessGroupOptions().direct_link_bytes(-2), "direct_link_bytes");
  expect_error(ProcessGroupOptions().ring_segment_bytes(100),
               "ring_segment_bytes must be at least 4096");
  expect_error(ProcessGroupOptions().shm_slot_bytes(0), "shm_slot_bytes must be at least 4096");
}

}  // namespace test_routes
}  // namespace fsdp::testing
