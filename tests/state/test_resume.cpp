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

TEST(Resume, StoppedAndResumedRunIsBitIdentical) {
  const std::string dir = test_dir();
  const auto env = with_dir(dir);
  // Uninterrupted: 10 steps (saving along the way, as the other run does).
  run_ranks_ok(
      2,
      [&](int, int) {
        init();
        resume_loop(dir + "/a", 10, 6, dir + "/final_a");
      },
      env);
  // 6 steps and a (sharded) save at step 6, then the processes stop.
  run_ranks_ok(
      2,
      [&](int, int) {
        init();
        resume_loop(dir + "/b", 6, 6, dir + "/final_b6");
      },
      env);
  // New processes resume from step 6 and run steps 7..10 only.
  run_ranks_ok(
      2,
      [&](int, int) {
        init();
        std::vector<int64_t> ran;
        resume_loop(dir + "/b", 10, 6, dir + "/final_b", [&](int64_t s) { ran.push_back(s); });
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

}  // namespace test_resume
}  // namespace fsdp::testing
