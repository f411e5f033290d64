#include "comm/cuda_backend.h"

#include <ATen/Context.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <functional>

#include "detail/error.h"

#if FSDP_WITH_CUDA
#include <cuda_runtime_api.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include "comm/cuda_ipc_slots.h"
#include "comm/slot_process_group.h"
#endif

namespace fsdp::detail {

namespace {

// NCCL accepts several ranks on one GPU from 2.30 on, behind a switch.
constexpr int kMultiRankNccl = 23000;

}  // namespace

CudaFacts this_process_cuda_facts(int local_world_size) {
  CudaFacts facts;
  facts.local_world_size = local_world_size;
  facts.nccl_version = built_nccl_version();
  // A CPU-only build never asks the CUDA runtime (nor starts it).
  if (facts.nccl_version != 0 && at::hasCUDA()) facts.visible_gpus = at::getNumGPUs();
  const char* multi = std::getenv("NCCL_MULTI_RANK_GPU_ENABLE");
  facts.multi_rank_switch = multi != nullptr && std::string(multi) == "1";
  return facts;
}

CudaChoice choose_cuda_backend(CudaBackend requested, const CudaFacts& facts) {
  if (requested == CudaBackend::kStaged) return {false, "CudaBackend::kStaged was asked for"};
  if (requested == CudaBackend::kCudaIpc) return {false, "CudaBackend::kCudaIpc was asked for"};
  if (facts.nccl_version == 0) {
    return {false,
            "this libfsdp was built against a LibTorch without NCCL (a CPU build, or one "
            "without NCCL's headers)"};
  }
  if (facts.visible_gpus == 0) {
    return {false, "this process sees no GPU (check CUDA_VISIBLE_DEVICES and the driver)"};
  }
  const bool known = facts.ranks_on_gpu > 0;
  if (known ? facts.ranks_on_gpu > 1 : facts.local_world_size > facts.visible_gpus) {
    const std::string shared =
        known ? std::to_string(facts.ranks_on_gpu) + " ranks share this rank's GPU"
              : std::to_string(facts.local_world_size) + " ranks on this node share " +
                    std::to_string(facts.visible_gpus) + " GPU(s)";
    if (facts.nccl_version < kMultiRankNccl) {
      return {false, shared + ", which NCCL " + nccl_version_string(facts.nccl_version) +
                         " refuses (ranks sharing a GPU need NCCL 2.30 or later with "
                         "NCCL_MULTI_RANK_GPU_ENABLE=1)"};
    }
    if (!facts.multi_rank_switch) {
      return {false, shared + ", which NCCL " + nccl_version_string(facts.nccl_version) +
                         " accepts only with NCCL_MULTI_RANK_GPU_ENABLE=1"};
    }
  }
  return {true, ""};
}

int64_t gpu_identity(std::optional<c10::Device> gpu) {
  if (!gpu) return 0;  // no question to the CUDA runtime without a GPU
#if FSDP_WITH_CUDA
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, gpu->index()) != cudaSuccess) {
    (void)cudaGetLastError();  // not sticky: clear it for LibTorch's next check
    return 0;
  }
  char host[256] = {};
  ::gethostname(host, sizeof(host) - 1);
  std::string key(host);
  key.append("/").append(reinterpret_cast<const char*>(&prop.uuid), sizeof(prop.uuid));
  const auto h = static_cast<int64_t>(std::hash<std::string>{}(key));
  return h == 0 ? 1 : h;
#else
  return 0;
#endif
}

int ranks_on_same_gpu(const std::vector<int64_t>& identities, int64_t mine) {
  if (mine == 0) return 0;
  return static_cast<int>(std::count(identities.begin(), identities.end(), mine));
}

bool auto_tries_cuda_ipc(CudaBackend requested, bool nccl, const CudaFacts& facts, int world_size) {
  return requested == CudaBackend::kAuto && !nccl && world_size > 1 &&
         facts.local_world_size == world_size && facts.visible_gpus > 0;
}

CudaBackend resolve_cuda_backend(std::optional<CudaBackend> option, const char* env, int rank) {
  if (option) return *option;
  if (env == nullptr || *env == '\0') return CudaBackend::kAuto;
  std::string v(env);
  std::transform(v.begin(), v.end(), v.begin(), [](unsigned char c) { return std::tolower(c); });
  if (v == "auto") return CudaBackend::kAuto;
  if (v == "nccl") return CudaBackend::kNccl;
  if (v == "staged") return CudaBackend::kStaged;
  if (v == "ipc") return CudaBackend::kCudaIpc;
  FSDP_FAIL(rank, "init_process_group", "FSDP_CUDA_BACKEND=", env,
            " is not a CUDA backend; use auto, nccl, staged or ipc (or unset it)");
}

std::shared_ptr<ProcessGroup> make_cuda_ipc_group(c10::intrusive_ptr<c10d::Store> store, int rank,
                                                  int size, std::chrono::milliseconds timeout,
                                                  c10::Device gpu) {
#if FSDP_WITH_CUDA
  if (!store) store = c10::make_intrusive<c10d::HashStore>();  // world 1: nobody to ask
  return make_slot_group(c10::make_intrusive<c10d::PrefixStore>("fsdp/cuda_ipc", store), rank, size,
                         timeout, kGpuSlotBytes, cuda_ipc_slot_opener(gpu), "cuda_ipc");
#else
  (void)store, (void)rank, (void)size, (void)timeout, (void)gpu;
  return nullptr;
#endif
}

std::string nccl_version_string(int code) {
  return std::to_string(code / 10000) + "." + std::to_string(code / 100 % 100) + "." +
         std::to_string(code % 100);
}

#if !FSDP_WITH_NCCL
int built_nccl_version() { return 0; }

std::shared_ptr<ProcessGroup> make_nccl_group(const c10::intrusive_ptr<c10d::Store>&, int rank, int,
                                              std::chrono::milliseconds) {
  FSDP_FAIL(rank, "init_process_group", "this libfsdp was built without NCCL");
}
#endif

}  // namespace fsdp::detail
