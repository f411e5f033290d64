#include "device_count.h"

#include <dlfcn.h>
#include <sched.h>

#include <string>

namespace fsdp::launch {
namespace {

// The two driver entry points fsdprun needs (cuda.h's signatures; CUresult
// is an int, 0 for success).
using CuInit = int (*)(unsigned int flags);
using CuDeviceGetCount = int (*)(int* count);

}  // namespace

int visible_cuda_gpus(std::string* why) {
  // Opened once and never closed: the driver keeps threads of its own.
  void* driver = ::dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (driver == nullptr) {
    *why = "no CUDA driver: libcuda.so.1 cannot be loaded";
    return 0;
  }
  const auto init = reinterpret_cast<CuInit>(::dlsym(driver, "cuInit"));
  const auto count = reinterpret_cast<CuDeviceGetCount>(::dlsym(driver, "cuDeviceGetCount"));
  if (init == nullptr || count == nullptr) {
    *why = "libcuda.so.1 lacks cuInit or cuDeviceGetCount";
    return 0;
  }
  if (const int status = init(0); status != 0) {
    // 100 is CUDA_ERROR_NO_DEVICE (none visible, or CUDA_VISIBLE_DEVICES empty).
    *why = status == 100 ? "the CUDA driver sees no device (CUDA_VISIBLE_DEVICES?)"
                         : "cuInit failed with CUDA error " + std::to_string(status);
    return 0;
  }
  int devices = 0;
  if (count(&devices) != 0 || devices <= 0) {
    *why = "the CUDA driver sees no device (CUDA_VISIBLE_DEVICES?)";
    return 0;
  }
  return devices;
}

int usable_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (::sched_getaffinity(0, sizeof(set), &set) != 0) return 1;
  const int cpus = CPU_COUNT(&set);
  return cpus > 0 ? cpus : 1;
}

bool resolve_nproc_per_node(LaunchOptions* options, const std::function<int(std::string*)>& gpus,
                            int cpus, std::vector<std::string>* notes, std::string* error) {
  const std::string device = options->nproc_per_node_device;
  notes->clear();
  if (!device.empty()) {
    std::string why;
    const int gpu_count = device == "cpu" ? 0 : gpus(&why);
    if (device == "gpu" && gpu_count <= 0) {
      *error = "--nproc-per-node gpu: no CUDA GPU is visible (" + why +
               "); give a number of ranks instead";
      return false;
    }
    const bool on_gpus = device != "cpu" && gpu_count > 0;
    options->nproc_per_node = on_gpus ? gpu_count : cpus;
    const int n = options->nproc_per_node;
    notes->push_back("--nproc-per-node " + device + ": " + std::to_string(n) +
                     (n == 1 ? " rank" : " ranks") + ", one per " +
                     (on_gpus ? "visible CUDA GPU" : "usable CPU"));
  }
  for (const int local_rank : options->local_ranks_filter) {
    if (local_rank >= options->nproc_per_node) {
      notes->push_back("--local-ranks-filter: this node has no local rank " +
                       std::to_string(local_rank) + " (" + std::to_string(options->nproc_per_node) +
                       " ranks)");
    }
  }
  return true;
}

}  // namespace fsdp::launch
