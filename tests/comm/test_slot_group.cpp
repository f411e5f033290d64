// The group behind CudaBackend::kCudaIpc (Note [Ranks sharing a GPU]) is
// device-neutral: its collectives are the rounds of Note [Shared memory for
// same-host ranks] over whatever slots it is given, on a thread of its own.
// Here it runs with host slots (its only difference from the GPU's) at 3
// ranks (the closed forms also at 1 and 2, all-reduce and broadcast also at
// 1), as threads of one process sharing a store, with slots of 4 KiB so that
// every collective takes many rounds: each collective against its closed
// form, all-reduce giving every rank the same bits, broadcast copying the
// root's bits exactly, collectives issued back to back before any wait, a
// sub-group, a tensor on another device refused by name, and slots opened
// outside the segment (as CUDA IPC's are), one rank's failure to open them
// being every rank's "no".

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <thread>
#include <vector>

#include "comm/slot_process_group.h"

namespace fsdp::testing {
namespace test_slot_group {

constexpr int kWorld = 3;
constexpr int64_t kSlotBytes = 4096;

// Runs `body(rank, group)` on `world` threads, each with its rank's group
// (slots from `open_slots`, else the segment's); returns each rank's error.
std::vector<std::string> errors_on_ranks(int world,
                                         const std::function<void(int, ProcessGroup&)>& body,
                                         const detail::SlotOpener& open_slots = nullptr) {
  // The ranks are threads: each keeps its ATen ops on itself, as a rank
  // process of fsdprun does (OMP_NUM_THREADS=1). OpenMP's workers would add
  // nothing here but reports from ThreadSanitizer, which does not see
  // libgomp's synchronisation.
  const int threads_before = at::get_num_threads();
  at::set_num_threads(1);
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::vector<std::thread> threads;
  std::vector<std::string> errors(world);
  for (int rank = 0; rank < world; ++rank) {
    threads.emplace_back([&, rank] {
      try {
        auto group = detail::make_slot_group(store, rank, world, std::chrono::seconds(30),
                                             kSlotBytes, open_slots, "slots");
        ASSERT_TRUE(group) << "rank " << rank << ": no shared memory";
        body(rank, *group);
      } catch (const std::exception& e) {
        errors[rank] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  at::set_num_threads(threads_before);
  return errors;
}

// errors_on_ranks, expecting none.
void on_ranks(int world, const std::function<void(int, ProcessGroup&)>& body) {
  const std::vector<std::string> errors = errors_on_ranks(world, body);
  for (int rank = 0; rank < world; ++rank) EXPECT_EQ(errors[rank], "") << "rank " << rank;
}
void on_ranks(const std::function<void(int, ProcessGroup&)>& body) { on_ranks(kWorld, body); }

// Rank r's values: r + 1 + i / 1000, exactly representable in bf16 for small i.
at::Tensor values_of(int rank, int64_t n, at::ScalarType dtype) {
  return (at::arange(n, at::kFloat) / 1024 + rank + 1).to(dtype);
}

// At 1 rank too, where there is no peer's slot to read (a world-1 job under
// FSDP_CUDA_BACKEND=ipc).
TEST(SlotGroup, CollectivesMatchTheirClosedFormsOverManyRounds) {
  for (int world = 1; world <= kWorld; ++world) {
    on_ranks(world, [world](int rank, ProcessGroup& pg) {
      EXPECT_EQ(pg.backend_name(), "slots");
      for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
        const int64_t n = 3 * kSlotBytes + 77;  // several rounds and a ragged end
        // All-gather, out of place and in place.
        at::Tensor flat = at::zeros({world * n}, dtype);
        pg.all_gather_into_tensor(flat, values_of(rank, n, dtype)).wait();
        at::Tensor in_place = at::zeros({world * n}, dtype);
        in_place.narrow(0, rank * n, n).copy_(values_of(rank, n, dtype));
        pg.all_gather_into_tensor(in_place, in_place.narrow(0, rank * n, n)).wait();
        for (int p = 0; p < world; ++p) {
          EXPECT_TRUE(at::equal(flat.narrow(0, p * n, n), values_of(p, n, dtype))) << dtype;
          EXPECT_TRUE(at::equal(in_place.narrow(0, p * n, n), values_of(p, n, dtype))) << dtype;
        }
        // Reduce-scatter: every rank contributes its values on every shard.
        for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg}) {
          at::Tensor input = values_of(rank, world * n, dtype);
          at::Tensor shard = at::empty({n}, dtype);
          pg.reduce_scatter_tensor(shard, input, op).wait();
          at::Tensor expected = values_of(0, world * n, at::kFloat).narrow(0, rank * n, n);
          for (int p = 1; p < world; ++p) {
            const at::Tensor theirs = values_of(p, world * n, at::kFloat).narrow(0, rank * n, n);
            expected = expected + theirs;
          }
          if (op == ReduceOp::kAvg) expected = expected / world;
          EXPECT_TRUE(at::allclose(shard.to(at::kFloat), expected, 1e-2, 1e-2))
              << dtype << " " << to_string(op);
          EXPECT_TRUE(at::equal(input, values_of(rank, world * n, dtype))) << "input modified";
        }
      }
    });
  }
}

TEST(SlotGroup, AllReduceGivesEveryRankTheSameBitsAndBroadcastTheRootsExactly) {
  for (int world : {1, kWorld}) {
    on_ranks(world, [world](int rank, ProcessGroup& pg) {
      const int root = world - 1;
      const int64_t n = 2 * kSlotBytes + 5;
      // Inexact sums, so that the order of adding shows (no global RNG: the
      // ranks are threads of one process).
      auto draw = [n](int r) { return at::sin(at::arange(n, at::kFloat) * (0.37 * (r + 1))); };
      at::Tensor t = draw(rank);
      pg.all_reduce(t, ReduceOp::kSum).wait();
      at::Tensor expected = draw(0);
      for (int p = 1; p < world; ++p) expected = expected + draw(p);  // in rank order
      EXPECT_TRUE(at::equal(t, expected)) << "rank " << rank;
      // Broadcast from the last rank: its bits, signed zeros and a NaN included.
      at::Tensor b = at::full({n}, static_cast<float>(rank));
      if (rank == root) {
        b[0] = -0.0f;
        b[1] = std::numeric_limits<float>::quiet_NaN();
      }
      pg.broadcast(b, root).wait();
      EXPECT_TRUE(std::signbit(b[0].item<float>()));
      EXPECT_TRUE(std::isnan(b[1].item<float>()));
      EXPECT_TRUE(at::equal(b.narrow(0, 2, n - 2), at::full({n - 2}, static_cast<float>(root))));
      pg.barrier().wait();
    });
  }
}

TEST(SlotGroup, BackToBackCollectivesRunInIssueOrder) {
  on_ranks([](int rank, ProcessGroup& pg) {
    const int64_t n = kSlotBytes + 3;
    std::vector<at::Tensor> tensors;
    std::vector<Work> works;
    for (int i = 0; i < 6; ++i) {
      tensors.push_back(at::full({n}, static_cast<float>(i * 10 + rank)));
      works.push_back(pg.all_reduce(tensors.back(), ReduceOp::kSum));
    }
    for (int i = 5; i >= 0; --i) works[i].wait();  // waited in another order
    for (int i = 0; i < 6; ++i) {
      EXPECT_TRUE(at::equal(tensors[i], at::full({n}, static_cast<float>(i * 30 + 3)))) << i;
    }
  });
}

TEST(SlotGroup, SubgroupHasSlotsOfItsOwn) {
  on_ranks([](int rank, ProcessGroup& pg) {
    auto sub = pg.new_subgroup({0, 2});
    ASSERT_EQ(sub == nullptr, rank == 1);
    if (sub) {
      at::Tensor t = at::full({kSlotBytes}, static_cast<float>(rank));
      sub->all_reduce(t, ReduceOp::kSum).wait();
      EXPECT_TRUE(at::equal(t, at::full({kSlotBytes}, 2.0f)));
    }
    pg.barrier().wait();
  });
}

TEST(SlotGroup, TensorOnAnotherDeviceIsRefusedByName) {
  on_ranks([](int rank, ProcessGroup& pg) {
    at::Tensor meta = at::empty({4}, at::TensorOptions().device(at::kMeta));
    try {
      pg.all_reduce(meta, ReduceOp::kSum);
      ADD_FAILURE() << "a meta tensor was accepted";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("carries tensors on cpu, got one on meta"),
                std::string::npos)
          << e.what();
    }
    (void)rank;
  });
}

// Slots outside the segment, as CUDA IPC's are: here one heap buffer that the
// threads (ranks) share, its address passed through the store as the IPC
// handles are. `fail_on` (-1: none) is a rank whose opener says "no".
detail::SlotOpener heap_opener(std::vector<char>* buffer, int fail_on) {
  return [buffer, fail_on](c10d::Store& store, int rank, int size,
                           int64_t slot_bytes) -> std::unique_ptr<detail::SlotMemory> {
    if (rank == 0) {
      buffer->assign(static_cast<size_t>(size * 2 * slot_bytes), 0);
      const std::string at = std::to_string(reinterpret_cast<uintptr_t>(buffer->data()));
      store.set("heap", std::vector<uint8_t>(at.begin(), at.end()));
    }
    const auto at = store.get("heap");
    char* base = reinterpret_cast<char*>(std::stoull(std::string(at.begin(), at.end())));
    if (rank == fail_on) return nullptr;
    return std::make_unique<detail::BufferSlots>(base, slot_bytes);
  };
}

TEST(SlotGroup, SlotsOpenedOutsideTheSegmentCarryTheRoundsAllOrNothing) {
  const int threads_before = at::get_num_threads();
  at::set_num_threads(1);  // see on_ranks()
  for (int fail_on : {-1, 1}) {
    std::vector<char> buffer;
    auto store = c10::make_intrusive<c10d::HashStore>();
    std::vector<std::thread> threads;
    std::vector<int> made(kWorld, -1);
    std::vector<std::string> errors(kWorld);
    for (int rank = 0; rank < kWorld; ++rank) {
      threads.emplace_back([&, rank] {
        try {
          auto group = detail::make_slot_group(store, rank, kWorld, std::chrono::seconds(30),
                                               kSlotBytes, heap_opener(&buffer, fail_on), "heap");
          made[rank] = group ? 1 : 0;
          if (!group) return;
          at::Tensor t = at::full({3 * kSlotBytes + 1}, static_cast<float>(rank + 1));
          group->all_reduce(t, ReduceOp::kSum).wait();
          if (!at::equal(t, at::full({3 * kSlotBytes + 1}, 6.0f))) errors[rank] = "wrong sum";
        } catch (const std::exception& e) {
          errors[rank] = e.what();
        }
      });
    }
    for (auto& t : threads) t.join();
    for (int rank = 0; rank < kWorld; ++rank) {
      EXPECT_EQ(errors[rank], "") << "rank " << rank;
      // One rank's "no" is every rank's.
      EXPECT_EQ(made[rank], fail_on < 0 ? 1 : 0) << "rank " << rank << ", fail_on " << fail_on;
    }
  }
  at::set_num_threads(threads_before);
}

// Collectives of the same bytes that differ in dtype, reduction or root are
// an error on every rank, not one rank reading the other's bytes as its own.
TEST(SlotGroup, CollectivesThatDifferInDtypeReductionOrRootAreAnError) {
  const std::vector<std::function<void(int, ProcessGroup&)>> mismatches = {
      [](int rank, ProcessGroup& pg) {
        at::Tensor t = rank == 0 ? at::ones({2048}) : at::ones({4096}, at::kBFloat16);
        pg.all_reduce(t, ReduceOp::kSum).wait();
      },
      [](int rank, ProcessGroup& pg) {
        at::Tensor t = at::ones({2048});
        pg.all_reduce(t, rank == 0 ? ReduceOp::kSum : ReduceOp::kAvg).wait();
      },
      [](int rank, ProcessGroup& pg) {
        at::Tensor t = at::ones({2048});
        pg.broadcast(t, rank).wait();
      }};
  for (size_t m = 0; m < mismatches.size(); ++m) {
    const std::vector<std::string> errors = errors_on_ranks(2, mismatches[m]);
    for (int rank = 0; rank < 2; ++rank) {
      EXPECT_NE(errors[rank].find("issued different collectives"), std::string::npos)
          << "mismatch " << m << ", rank " << rank << ": " << errors[rank];
    }
  }
}

// Slots on the heap whose settle() fails at its `fail_at`-th call on rank
// `rank`: a part of a collective that fails on one rank (a CUDA error).
class FailingSlots : public detail::SlotMemory {
 public:
  FailingSlots(char* base, int64_t slot_bytes, int fail_at)
      : inner_(base, slot_bytes), fail_at_(fail_at) {}
  char* slot(int rank, uint32_t round) const override { return inner_.slot(rank, round); }
  c10::Device device() const override { return inner_.device(); }
  void copy(void* dst, const void* src, size_t bytes) const override {
    inner_.copy(dst, src, bytes);
  }
  void settle() const override {
    if (++settles_ == fail_at_) throw std::runtime_error("an injected failure");
  }

 private:
  detail::BufferSlots inner_;
  int fail_at_;
  mutable int settles_ = 0;
};

// One rank whose part fails stops its peers at once, naming it, instead of
// leaving them to wait out the group's 30 s timeout.
TEST(SlotGroup, APartThatFailsOnOneRankStopsItsPeersAtOnce) {
  std::vector<char> buffer;
  const detail::SlotOpener open = [&buffer](
                                      c10d::Store& store, int rank, int size,
                                      int64_t slot_bytes) -> std::unique_ptr<detail::SlotMemory> {
    auto heap = heap_opener(&buffer, -1)(store, rank, size, slot_bytes);
    // Rank 1 fails as it reads the first collective's parts.
    return std::make_unique<FailingSlots>(heap->slot(0, 0), slot_bytes, rank == 1 ? 2 : 0);
  };
  const auto t0 = std::chrono::steady_clock::now();
  const std::vector<std::string> errors = errors_on_ranks(
      2,
      [](int, ProcessGroup& pg) {
        for (int i = 0; i < 3; ++i) {
          at::Tensor t = at::ones({16});
          pg.all_reduce(t, ReduceOp::kSum).wait();
        }
      },
      open);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(10));
  EXPECT_NE(errors[1].find("an injected failure"), std::string::npos) << errors[1];
  EXPECT_NE(errors[0].find("rank 1 failed a collective"), std::string::npos) << errors[0];
}

}  // namespace test_slot_group
}  // namespace fsdp::testing
