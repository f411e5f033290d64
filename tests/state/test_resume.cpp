// Exact resume: 10 steps in one go versus 6 steps, save, stop (the processes
// end), resume in new processes and 4 more steps: the final model, optimizer
// state, RNG-dependent data and registered state agree bit for bit.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <fsdp/fsdp.h>

#include "resume_loop.h"
#include "state_test_util.h"

namespace fsdp::testing {
namespace test_resume {

void init() { init_process_group(ProcessGroupOptions().timeout(std::chrono::seconds(30))); }

void expect_bit_identical_resume(ResumeModel kind) {
  const std::string dir = test_dir();
  const auto env = with_dir(dir);
  // Uninterrupted: 10 steps (saving along the way, as the other run does).
  run_ranks_ok(
      2,
      [&](int, int) {
        init();
        resume_loop(dir + "/a", 10, 6, dir + "/final_a", {}, kind);
      },
      env);
  // 6 steps and a (sharded) save at step 6, then the processes stop.
  run_ranks_ok(
      2,
      [&](int, int) {
        init();
        resume_loop(dir + "/b", 6, 6, dir + "/final_b6", {}, kind);
      },
      env);
  // New processes resume from step 6 and run steps 7..10 only.
  run_ranks_ok(
      2,
      [&](int, int) {
        init();
        std::vector<int64_t> ran;
        resume_loop(
            dir + "/b", 10, 6, dir + "/final_b", [&](int64_t s) { ran.push_back(s); }, kind);
        EXPECT_EQ(ran, (std::vector<int64_t>{7, 8, 9, 10}));
      },
      env);
  if (is_rank_process()) return;
  for (const char* f : {"model.safetensors", "optim.safetensors", "rank0.json", "rank1.json"}) {
    const std::string a = file_bytes(dir + "/final_a/" + f);
    EXPECT_GT(a.size(), 100u) << f;
    EXPECT_TRUE(a == file_bytes(dir + "/final_b/" + f)) << f << " differs after resume";
  }
  remove_test_dir(dir);
}

TEST(Resume, StoppedAndResumedRunIsBitIdentical) {
  expect_bit_identical_resume(ResumeModel::kPlain);
}

// Offloaded bf16 units whose bf16 host copies FusedAdamW writes: the resumed
// process made its copies from its initial weights, and the checkpoint's
// shards, read from the files into host memory, must replace them before the
// first unshard sends them (Note [A host copy in the compute dtype]).
TEST(Resume, OffloadedBf16WithHostCopiesIsBitIdentical) {
  expect_bit_identical_resume(ResumeModel::kOffloadedBf16);
}

}  // namespace test_resume
}  // namespace fsdp::testing
