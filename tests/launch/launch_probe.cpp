// A rank for the real-launcher tests (launchers_test.cpp): joins the job
// with fsdp::init_process_group() as mpirun, torchrun or fsdprun started it,
// checks an all-reduce and its GPU (fsdp::local_gpu), and prints its layout
// on one line for the test to compare. It bounds itself: killed with its launcher, and at 60 s
// anyway.

#include <ATen/ATen.h>

#include <signal.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <chrono>
#include <iostream>
#include <optional>
#include <sstream>

#include <fsdp/fsdp.h>

int main() try {
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  ::alarm(60);
  auto pg = fsdp::init_process_group(fsdp::ProcessGroupOptions().timeout(std::chrono::seconds(30)));
  const fsdp::RankInfo& info = fsdp::rank_info();
  at::Tensor t = at::full({8}, static_cast<float>(info.rank + 1));
  pg->all_reduce(t, fsdp::ReduceOp::kSum).wait();
  const int sum_of_ranks_plus_one = info.world_size * (info.world_size + 1) / 2;
  const auto expected = static_cast<float>(sum_of_ranks_plus_one);
  // This rank's GPU follows the launcher's LOCAL_RANK; none without a GPU.
  const std::optional<c10::Device> gpu = fsdp::local_gpu();
  const bool gpu_ok =
      at::hasCUDA() ? gpu && gpu->index() == info.local_rank % static_cast<int>(at::getNumGPUs())
                    : !gpu.has_value();
  const bool ok = at::all(t == expected).item<bool>() && pg->rank() == info.rank &&
                  pg->size() == info.world_size && gpu_ok;
  std::ostringstream line;
  line << "probe rank=" << info.rank << " world=" << info.world_size
       << " local_rank=" << info.local_rank << " local_world=" << info.local_world_size
       << " node=" << info.node_rank << " nodes=" << info.num_nodes << " launcher=" << info.launcher
       << (ok ? " ok" : " WRONG_SUM") << "\n";
  std::cout << line.str() << std::flush;
  fsdp::destroy_process_group();
  return ok ? 0 : 1;
} catch (const std::exception& e) {
  std::cerr << "probe failed: " << e.what() << "\n";
  return 1;
}
