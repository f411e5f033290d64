// A rank SIGKILLed at a random point while checkpoints are being written
// (repeatedly, to the same directory): the earlier checkpoint always still
// loads, and the interrupted one either loads whole (the kill came between
// saves) or is refused for its missing completion marker, never half-read.

#include <gtest/gtest.h>
#include <signal.h>
#include <torch/torch.h>

#include <chrono>
#include <random>
#include <thread>

#include <fsdp/fsdp.h>

#include "state_test_util.h"

namespace fsdp::testing {
namespace test_kill_during_save {

class KillDuringSave : public ::testing::TestWithParam<int> {};

TEST_P(KillDuringSave, PreviousCheckpointSurvivesAndTornOneIsRefused) {
  const int seed = GetParam();
  const int victim = seed % 2;
  const auto type = (seed / 2) % 2 == 0 ? StateDictType::kSharded : StateDictType::kFull;
  const std::string dir = test_dir();
  MultiRankOptions options = with_dir(dir);
  options.failure_grace = std::chrono::seconds(2);
  options.deadline = std::chrono::seconds(60);
  const auto outcomes = run_ranks(
      2,
      [&](int rank, int) {
        init_process_group(ProcessGroupOptions().timeout(std::chrono::seconds(5)));
        auto model = make_model(FSDPOptions());
        auto opt = make_optimizer("adam", model->parameters());
        torch::manual_seed(3);
        train(*model, *opt, 2);
        Checkpointer ckpt(*model, opt.get());
        const auto t0 = std::chrono::steady_clock::now();
        ckpt.save(dir + "/A", 2, type);  // complete on every rank when save() returns
        const auto save_time = std::chrono::steady_clock::now() - t0;
        if (rank == victim) {
          std::mt19937 gen(seed);
          const auto us = std::chrono::duration_cast<std::chrono::microseconds>(save_time * 3);
          std::uniform_int_distribution<int64_t> when(0, us.count());
          std::thread([delay = when(gen)] {
            std::this_thread::sleep_for(std::chrono::microseconds(delay));
            ::raise(SIGKILL);
          }).detach();
        }
        for (int64_t step = 3;; ++step) {
          train(*model, *opt, 1);
          ckpt.save(dir + "/B", step, type);
        }
      },
      options);
  ASSERT_EQ(outcomes.size(), 2u);
  EXPECT_EQ(outcomes[victim].term_signal, SIGKILL) << describe(outcomes[victim]);

  // A still loads, whole, into a plain LibTorch model.
  Net plain(false, FSDPOptions());
  auto opt = make_optimizer("adam", plain->parameters());
  EXPECT_EQ(Checkpointer(*plain, opt.get()).load(dir + "/A"), 2);
  EXPECT_EQ(full_optim_state_dict(*plain, *opt).size(), 3 * plain->parameters().size());
  // B loads only if its marker says it is complete.
  if (std::ifstream(dir + "/B/COMPLETE").good()) {
    EXPECT_GE(Checkpointer(*plain, opt.get()).load(dir + "/B"), 3);
  } else {
    try {
      verify_checkpoint(dir + "/B");
      ADD_FAILURE() << "a torn checkpoint was accepted";
    } catch (const CheckpointError& e) {
      EXPECT_NE(std::string(e.what()).find("missing completion marker"), std::string::npos)
          << e.what();
    }
  }
  remove_test_dir(dir);
}

INSTANTIATE_TEST_SUITE_P(Seeds, KillDuringSave, ::testing::Range(0, 8));

}  // namespace test_kill_during_save
}  // namespace fsdp::testing
