// A training job that checkpoints every SAVE_EVERY steps and resumes from
// its latest complete checkpoint when (re)started; rank 1 kills itself once
// after step DIE_AT (0: never). Run under `fsdprun --max-restarts K` by
// restart_resume_test.sh. Usage: resume_example DIR STEPS SAVE_EVERY DIE_AT

#include <signal.h>
#include <sys/stat.h>

#include <fstream>
#include <iostream>

#include <fsdp/fsdp.h>

#include "resume_loop.h"

int main(int argc, char** argv) {
  if (argc != 5) {
    std::cerr << "usage: resume_example DIR STEPS SAVE_EVERY DIE_AT\n";
    return 2;
  }
  const std::string dir = argv[1];
  const int64_t steps = std::stoll(argv[2]), save_every = std::stoll(argv[3]);
  const int64_t die_at = std::stoll(argv[4]);
  fsdp::init_process_group();
  const int rank = fsdp::default_process_group()->rank();
  const std::string died = dir + "/died";
  fsdp::testing::resume_loop(dir + "/ckpts", steps, save_every, dir + "/final", [&](int64_t step) {
    struct stat st {};
    if (rank == 1 && step == die_at && ::stat(died.c_str(), &st) != 0) {
      std::ofstream(died) << step;
      std::cerr << "rank 1 dies after step " << step << std::endl;
      ::raise(SIGKILL);
    }
  });
  std::cout << "finished " << steps << " steps" << std::endl;
  return 0;
}
