#pragma once

// torchrun's --nproc-per-node gpu|cpu|auto: the devices this node has.

#include <functional>
#include <string>
#include <vector>

#include "options.h"

namespace fsdp::launch {

/// The CUDA GPUs this process can see (CUDA_VISIBLE_DEVICES applied), asked
/// of the driver library (libcuda.so.1, opened at run time: fsdprun links no
/// CUDA). 0, with `why` set, when there is no driver or no device.
int visible_cuda_gpus(std::string* why);

/// The CPUs this process may run on (its affinity mask, as torchrun counts).
int usable_cpus();

/// Turns --nproc-per-node gpu, cpu or auto into a number of ranks, counting
/// GPUs with `gpus` (visible_cuda_gpus, or a test's); `notes` (cleared) gets
/// a line saying what was counted, and one for each --local-ranks-filter
/// rank this node has not (ignored, as torchrun does). False with a
/// one-line `error` for gpu on a node without one.
bool resolve_nproc_per_node(LaunchOptions* options, const std::function<int(std::string*)>& gpus,
                            int cpus, std::vector<std::string>* notes, std::string* error);

}  // namespace fsdp::launch
