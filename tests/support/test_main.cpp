// main() of the test programs: gtest's, after the rank zygote (Note [Rank
// processes from a zygote] in rank_zygote.cpp).

#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include <cstdlib>

#include "multi_rank.h"
#include "rank_zygote.h"

int main(int argc, char** argv) {
  fsdp::testing::start_rank_zygote(argc, argv);
  // libgomp read OMP_NUM_THREADS when the zygote loaded it: a rank forked
  // from there sets it as an exec'd one read it (which sets it again, alike).
  const char* threads = std::getenv("OMP_NUM_THREADS");
  if (fsdp::testing::is_rank_process() && threads != nullptr && std::atoi(threads) > 0)
    at::set_num_threads(std::atoi(threads));
  ::testing::InitGoogleTest(&argc, argv);
  const int failed = RUN_ALL_TESTS();
  // FSDP_TEST_SKIP_CODE (ctest's SKIP_RETURN_CODE for the cuda entries): a
  // run that skipped tests and failed none says so, and a failure is never
  // hidden by a skip beside it, as a skip pattern in the output would do.
  const char* skip_code = std::getenv("FSDP_TEST_SKIP_CODE");
  if (failed == 0 && skip_code != nullptr && !fsdp::testing::is_rank_process() &&
      ::testing::UnitTest::GetInstance()->skipped_test_count() > 0)
    return std::atoi(skip_code);
  return failed;
}
