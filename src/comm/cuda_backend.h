#pragma once

// Note [Choosing what carries CUDA tensors]
// PyTorch's users name a backend per device ("cpu:gloo,cuda:nccl"); libfsdp
// picks the one for CUDA tensors itself unless told (CudaBackend). NCCL is
// what GPU clusters run on, but it cannot run everywhere a CUDA tensor can:
// a LibTorch without NCCL (CPU builds, Debian's 1.13), a process that sees no
// GPU, and ranks that share one GPU, which NCCL before 2.30 refuses outright
// ("Duplicate GPU") and 2.30 and later accept only behind its experimental
// NCCL_MULTI_RANK_GPU_ENABLE=1. Which ranks share a GPU is read from its
// identity (host and GPU UUID, gathered from every rank), not from ranks per
// node against GPUs visible: under a launcher that shows each rank one GPU
// of its own (srun --gpus-per-task=1), four ranks on a node each see one
// GPU and share none. Everywhere else the staged path (Note
// [Tensors on other devices than the engine's]) carries them: slower, never
// wrong. The facts differ between nodes (GPUs per node, environment), and
// making a NCCL group is a collective act, so every rank states what it can
// do and the group takes the least of them: NCCL only where every rank can.
// CudaBackend::kNccl that some rank cannot honour is an error on every rank,
// after that agreement, so that no rank waits for a peer that gave up.
// Where NCCL cannot run and every rank of the job is on this node and sees
// a GPU, kAuto tries CUDA IPC (Note [Ranks sharing a GPU]: 0.52x the staged
// step of two GPT-2 small ranks on an H100): the ranks agree to try, make
// the group only where every rank can (they all share one GPU), and stage
// otherwise.

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <fsdp/comm/init.h>

namespace fsdp::detail {

/// What decides whether this process can run NCCL.
struct CudaFacts {
  int nccl_version = 0;            ///< NCCL_VERSION_CODE style (2.28.9: 22809); 0: not built
  int visible_gpus = 0;            ///< GPUs this process sees
  int local_world_size = 1;        ///< ranks on this node
  bool multi_rank_switch = false;  ///< NCCL_MULTI_RANK_GPU_ENABLE=1
  /// Ranks of the job on this rank's GPU (the same host and GPU UUID: see
  /// gpu_identity), itself included; 0 where not known, and then
  /// local_world_size against visible_gpus decides whether ranks share one.
  int ranks_on_gpu = 0;
};

/// A number that only processes on the same GPU of the same host share (a
/// hash of the host's name and `gpu`'s UUID); 0 without a GPU. Ranks that
/// each see one GPU of their own (a launcher's per-rank CUDA_VISIBLE_DEVICES)
/// then do not count as ranks sharing one.
int64_t gpu_identity(std::optional<c10::Device> gpu);

/// How many of `identities` (every rank's gpu_identity) are `mine`; 0 for a
/// rank without a GPU (mine == 0).
int ranks_on_same_gpu(const std::vector<int64_t>& identities, int64_t mine);

/// This process's CudaFacts (it queries the CUDA runtime only when NCCL is built).
CudaFacts this_process_cuda_facts(int local_world_size);

/// Whether NCCL can carry this process's CUDA tensors, and if not, why (a
/// clause naming the cause and the fix).
struct CudaChoice {
  bool nccl = false;
  std::string why_not;
};

/// Note [Choosing what carries CUDA tensors], for one rank.
CudaChoice choose_cuda_backend(CudaBackend requested, const CudaFacts& facts);

/// Whether kAuto tries CUDA IPC for this rank, NCCL being `nccl` for the
/// job (Note [Choosing what carries CUDA tensors]).
bool auto_tries_cuda_ipc(CudaBackend requested, bool nccl, const CudaFacts& facts, int world_size);

/// `option` if set, else FSDP_CUDA_BACKEND (auto, nccl, staged, ipc, any
/// case), else kAuto. Another value of the variable is an error naming it.
CudaBackend resolve_cuda_backend(std::optional<CudaBackend> option, const char* env, int rank);

/// "2.28.9" for 22809.
std::string nccl_version_string(int code);

/// The NCCL version of the LibTorch build (0 when libfsdp was built without
/// NCCL: see FSDP_WITH_NCCL).
int built_nccl_version();

/// A group that carries the CUDA tensors of ranks sharing `gpu` on one host
/// (Note [Ranks sharing a GPU]), made over `store` (nullptr at world size
/// 1); nullptr on every rank where they do not all share it (or a CUDA call
/// failed on some rank), and always in a build without CUDA.
std::shared_ptr<ProcessGroup> make_cuda_ipc_group(c10::intrusive_ptr<c10d::Store> store, int rank,
                                                  int size, std::chrono::milliseconds timeout,
                                                  c10::Device gpu);

/// A group that carries CUDA tensors over c10d's ProcessGroupNCCL, made over
/// `store` (nullptr at world size 1). Only where built_nccl_version() != 0.
std::shared_ptr<ProcessGroup> make_nccl_group(const c10::intrusive_ptr<c10d::Store>& store,
                                              int rank, int size,
                                              std::chrono::milliseconds timeout);

}  // namespace fsdp::detail
