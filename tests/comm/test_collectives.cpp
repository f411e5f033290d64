// Every collective against a closed-form result, world sizes 1-4, every dtype,
// lengths from one element per rank to 8 MiB (FSDP_TEST_SWEEP_MIB), for both
// engines.

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <thread>
#include <vector>

#include "comm_test_util.h"
#include "multi_rank.h"

namespace fsdp::testing {
namespace test_collectives {

const std::vector<at::ScalarType> kDtypes = {at::kFloat, at::kDouble, at::kBFloat16, at::kHalf};

// Small integers, exact in every dtype (bf16 holds integers up to 256 exactly).
at::Tensor pattern(int64_t n, int64_t offset, int64_t modulus, at::ScalarType dtype) {
  return (at::arange(n, at::kLong).remainder(modulus) + offset).to(dtype);
}

// Shard sizes (elements per rank): tiny, uneven against the 1 MiB ring
// segment, several segments, and the one that makes the flat buffer max_bytes.
/// Shard sizes from one element up to a flat buffer of `max_bytes`.
std::vector<int64_t> shard_sizes(at::ScalarType dtype, int world, int64_t max_bytes) {
  const int64_t elem = c10::elementSize(dtype);
  return {1, 7, 1000, (1 << 20) / elem + 3, max_bytes / elem / world};
}

void check_all_gather(ProcessGroup& pg, at::ScalarType dtype, int64_t shard_numel, bool in_place) {
  const int r = pg.rank(), n = pg.size();
  at::Tensor flat = at::full({n * shard_numel}, -1, dtype);
  at::Tensor shard = pattern(shard_numel, r + 1, 13, dtype);
  if (in_place) {
    flat.narrow(0, r * shard_numel, shard_numel).copy_(shard);
    shard = flat.narrow(0, r * shard_numel, shard_numel);
  }
  pg.all_gather_into_tensor(flat, shard).wait();
  std::vector<at::Tensor> parts;
  for (int k = 0; k < n; ++k) parts.push_back(pattern(shard_numel, k + 1, 13, dtype));
  EXPECT_TRUE(tensors_equal(flat, at::cat(parts)))
      << "all_gather " << dtype << " shard " << shard_numel << (in_place ? " in place" : "");
}

void check_reduce_scatter(ProcessGroup& pg, at::ScalarType dtype, int64_t shard_numel,
                          ReduceOp op) {
  const int r = pg.rank(), n = pg.size();
  const at::Tensor flat = pattern(n * shard_numel, r + 1, 11, dtype);
  const at::Tensor before = flat.clone();
  at::Tensor shard = at::full({shard_numel}, -1, dtype);
  pg.reduce_scatter_tensor(shard, flat, op).wait();
  // sum over ranks k of (k + 1 + j % 11) = n(n+1)/2 + n * (j % 11), exact in every dtype.
  at::Tensor sum =
      (at::arange(r * shard_numel, (r + 1) * shard_numel, at::kLong).remainder(11) * n +
       n * (n + 1) / 2)
          .to(dtype);
  at::Tensor expected = op == ReduceOp::kAvg ? sum.div(n) : sum;
  EXPECT_TRUE(tensors_equal(shard, expected))
      << "reduce_scatter " << to_string(op) << " " << dtype << " shard " << shard_numel;
  EXPECT_TRUE(at::equal(flat, before)) << "reduce_scatter modified its input";
}

void check_all_reduce(ProcessGroup& pg, at::ScalarType dtype, int64_t numel, ReduceOp op) {
  const int r = pg.rank(), n = pg.size();
  at::Tensor t = pattern(numel, r + 1, 7, dtype);
  pg.all_reduce(t, op).wait();
  const at::Tensor expected = expected_all_reduce(numel, n, op, dtype);
  EXPECT_TRUE(tensors_equal(t, expected)) << "all_reduce " << to_string(op) << " " << dtype;
}

void check_broadcast(ProcessGroup& pg, at::ScalarType dtype, int64_t numel) {
  const int root = pg.size() - 1;
  at::Tensor t = pg.rank() == root ? pattern(numel, 5, 9, dtype) : at::full({numel}, -1, dtype);
  pg.broadcast(t, root).wait();
  EXPECT_TRUE(tensors_equal(t, pattern(numel, 5, 9, dtype))) << "broadcast " << dtype;
}

class Collectives : public ::testing::TestWithParam<Backend> {};

/// Every collective at world sizes 1-4, all dtypes, flat buffers up to
/// `max_bytes`, against closed-form results.
void closed_form_sweep(Backend backend, int64_t max_bytes) {
  for (int world : {1, 2, 3, 4}) {
    // 64 MiB at 4 ranks takes about a minute on 2 cores (Note [Sweep sizes]).
    MultiRankOptions options;
    options.deadline = std::chrono::seconds(180);
    run_ranks_ok(
        world,
        [backend, max_bytes](int, int) {
          auto pg = join(backend);
          for (at::ScalarType dtype : kDtypes) {
            for (int64_t s : shard_sizes(dtype, pg->size(), max_bytes)) {
              check_all_gather(*pg, dtype, s, /*in_place=*/false);
              check_reduce_scatter(*pg, dtype, s, ReduceOp::kSum);
            }
            check_all_gather(*pg, dtype, 1000, /*in_place=*/true);
            check_reduce_scatter(*pg, dtype, 1000, ReduceOp::kAvg);
            for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax, ReduceOp::kMin}) {
              check_all_reduce(*pg, dtype, 1, op);
              check_all_reduce(*pg, dtype, 100003, op);
            }
            check_broadcast(*pg, dtype, 1);
            check_broadcast(*pg, dtype, 300001);
          }
          pg->barrier().wait();
        },
        options);
  }
}

// Note [Sweep sizes]
// The largest flat buffer is 8 MiB: a rank's part then spans two or more ring
// segments (kDefaultRingSegmentBytes, 1 MiB) and at 1-2 ranks several
// shared-memory slots (kDefaultShmSlotBytes, 2 MiB), so every path of a long
// message runs. A larger one adds no path, only time: up to 64 MiB this test
// and test_collectives_over_links took 108 and 104 s of the 2.15 stage's
// tests on 2 cores. FSDP_TEST_SWEEP_MIB=64 runs that sweep again.
int64_t sweep_bytes() {
  const char* mib = std::getenv("FSDP_TEST_SWEEP_MIB");
  return (mib != nullptr ? std::atoll(mib) : 8) << 20;
}

TEST_P(Collectives, ClosedFormAllDtypesAllSizes) {
  closed_form_sweep(GetParam(), GetParam() == Backend::kGloo ? sweep_bytes() : (4 << 20));
}

// Up to 2 MiB: every path below and just above the direct-link threshold,
// cheap enough to run again with direct links off (see CMakeLists.txt).
TEST_P(Collectives, ClosedFormUpTo2MiB) { closed_form_sweep(GetParam(), 2 << 20); }

TEST_P(Collectives, HandlesWaitedInAnotherOrderThanIssued) {
  run_ranks_ok(3, [](int rank, int world) {
    auto pg = join(GetParam());
    const int64_t s = 100000;
    at::Tensor flat = at::zeros({world * s});
    at::Tensor shard = at::full({s}, static_cast<float>(rank + 1));
    at::Tensor grads = at::ones({world * s});
    at::Tensor reduced = at::zeros({s});
    at::Tensor scalar = at::full({1}, static_cast<float>(rank));
    at::Tensor bcast = at::full({10}, static_cast<float>(rank * 10));
    std::vector<Work> works{pg->all_gather_into_tensor(flat, shard),
                            pg->reduce_scatter_tensor(reduced, grads, ReduceOp::kSum),
                            pg->all_reduce(scalar, ReduceOp::kSum), pg->broadcast(bcast, 1),
                            pg->barrier()};
    for (auto it = works.rbegin(); it != works.rend(); ++it) it->wait();
    for (auto& w : works) EXPECT_TRUE(w.is_completed() && w.is_success());
    for (int k = 0; k < world; ++k) {
      EXPECT_TRUE(at::all(flat.narrow(0, k * s, s) == k + 1).item<bool>());
    }
    EXPECT_TRUE(at::all(reduced == world).item<bool>());
    EXPECT_EQ(scalar.item<float>(), world * (world - 1) / 2);
    EXPECT_TRUE(at::all(bcast == 10).item<bool>());
  });
}

TEST_P(Collectives, BadSizesAreErrorsNamingTheSizes) {
  run_ranks_ok(2, [](int, int) {
    auto pg = join(GetParam());
    at::Tensor shard = at::zeros({3});
    try {
      pg->reduce_scatter_tensor(shard, at::zeros({7}), ReduceOp::kSum);
      ADD_FAILURE() << "a flat buffer of 7 elements over 2 ranks was accepted";
    } catch (const c10::Error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("7 elements"), std::string::npos) << msg;
      EXPECT_NE(msg.find("world size 2"), std::string::npos) << msg;
    }
    try {
      pg->all_gather_into_tensor(at::zeros({7}), shard);
      ADD_FAILURE() << "an all-gather into 7 elements from shards of 3 was accepted";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("got 7"), std::string::npos) << e.what();
    }
    EXPECT_THROW(pg->all_reduce(at::zeros({4}, at::kInt)), c10::Error);
    EXPECT_THROW(pg->broadcast(at::zeros({4}), 2), c10::Error);
    EXPECT_THROW(pg->all_gather_into_tensor(at::zeros({8}, at::kDouble), at::zeros({4})),
                 c10::Error);
    // The group is still usable after rejected calls: nothing was issued.
    at::Tensor t = at::ones({2});
    pg->all_reduce(t).wait();
    EXPECT_TRUE(at::all(t == 2).item<bool>());
  });
}

// The usual way to average parameters by hand: under NoGradGuard, a leaf
// that requires grad is written in place by the collective whichever thread
// runs it (the communication thread's grad mode is its own).
TEST_P(Collectives, ParametersReducedUnderNoGradGuardWhicheverThreadRunsThem) {
  run_ranks_ok(2, [](int rank, int world) {
    auto pg = join(GetParam());
    at::Tensor p = at::full({8}, static_cast<float>(rank + 1)).set_requires_grad(true);
    at::Tensor flat = at::zeros({8 * world}).set_requires_grad(true);
    {
      const at::NoGradGuard no_grad;
      Work reduce = pg->all_reduce(p, ReduceOp::kAvg);
      Work gather = pg->all_gather_into_tensor(flat, p);
      // Left to the communication thread, not run by this one's wait().
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      reduce.wait();
      gather.wait();
    }
    EXPECT_TRUE(at::all(p == 1.5F).item<bool>());
    EXPECT_TRUE(at::all(flat == 1.5F).item<bool>());
    EXPECT_FALSE(flat.grad_fn()) << "a collective recorded autograd history";
    pg->barrier().wait();  // the group is still whole
  });
}

// A shard that is a view of the flat buffer would read partial sums in place
// of its own part on the ring: refused, with the way out.
TEST_P(Collectives, AShardWithinTheFlatBufferIsRefused) {
  run_ranks_ok(2, [](int rank, int world) {
    auto pg = join(GetParam());
    at::Tensor flat = at::ones({4 * world});
    try {
      pg->reduce_scatter_tensor(flat.narrow(0, 4 * rank, 4), flat, ReduceOp::kSum);
      ADD_FAILURE() << "a shard within the flat buffer was accepted";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("overlaps the flat buffer"), std::string::npos)
          << e.what();
    }
    at::Tensor shard = at::zeros({4});
    pg->reduce_scatter_tensor(shard, flat, ReduceOp::kSum).wait();
    EXPECT_TRUE(at::all(shard == world).item<bool>());
  });
}

// wait(limit) shorter than the group's timeout returns at its limit, even
// when the waiting thread could have run the collective itself.
TEST_P(Collectives, AShortWaitLimitIsKeptWhileAPeerIsLate) {
  run_ranks_ok(2, [](int rank, int) {
    auto pg = join(GetParam());
    at::Tensor t = at::ones({4});
    if (rank == 1) std::this_thread::sleep_for(std::chrono::milliseconds(1500));
    Work w = pg->all_reduce(t);
    if (rank == 0) {
      const auto t0 = std::chrono::steady_clock::now();
      EXPECT_THROW(w.wait(std::chrono::milliseconds(200)), c10::Error);
      EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::milliseconds(1200));
    }
    w.wait();
    EXPECT_TRUE(at::all(t == 2).item<bool>());
  });
}

INSTANTIATE_TEST_SUITE_P(Engines, Collectives, ::testing::ValuesIn(available_engines()),
                         backend_label);

}  // namespace test_collectives
}  // namespace fsdp::testing
