#pragma once

#include <c10/core/Device.h>
#include <torch/arg.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include <fsdp/comm/process_group.h>

namespace fsdp {

/// Which engine carries the collectives of a group made by init_process_group.
enum class Backend : uint8_t {
  /// libfsdp's CPU engine, the default: all-gather into the caller's buffer,
  /// a ring reduce-scatter, a dedicated communication thread; small
  /// collectives over direct TCP links, large ones between ranks on one host
  /// through shared memory, the rest over Gloo called directly (LibTorch 1.13
  /// builds) or over the direct links (builds against pip's torch wheel, which
  /// ships no Gloo headers). The ProcessGroupOptions fields from
  /// direct_link_bytes to shm_slot_bytes tune it; docs/communication.md tables
  /// the routes.
  kGloo,
  /// c10d's ProcessGroupGloo behind the same interface (reference path; the
  /// same adapter carries NCCL on CUDA builds of LibTorch). Only in builds
  /// with Gloo's headers: see backend_available().
  kC10dGloo,
};

/// What carries the collectives of CUDA tensors (PyTorch's "cuda:nccl" in
/// "cpu:gloo,cuda:nccl"); CPU tensors always go to the Backend's engine.
enum class CudaBackend : uint8_t {
  /// NCCL where it can run: each rank of a node on a GPU of its own, or ranks
  /// sharing GPUs with NCCL 2.30 or later and NCCL_MULTI_RANK_GPU_ENABLE=1;
  /// else kCudaIpc where every rank of the job shares one GPU of one host;
  /// else kStaged. Every rank agrees on one choice.
  kAuto,
  /// c10d's ProcessGroupNCCL from the LibTorch build; an error on every rank
  /// where some rank cannot run it.
  kNccl,
  /// Through pinned host memory and the CPU engine (Note [Tensors on other
  /// devices than the engine's]): any GPUs, any NCCL, ranks sharing a GPU.
  kStaged,
  /// Ranks of one host sharing one GPU read each other's GPU memory (CUDA
  /// IPC; Note [Ranks sharing a GPU]); an error on every rank where they do
  /// not all share one (kAuto stages there instead).
  kCudaIpc,
};

/// How to join a group. A field set explicitly always wins. A field left at
/// its default comes from the launcher that started this process, the first
/// of these that is present:
///  1. fsdprun or torchrun (`torchrun --no-python`): RANK, WORLD_SIZE,
///     LOCAL_RANK, LOCAL_WORLD_SIZE, recognised by TORCHELASTIC_RESTART_COUNT,
///     GROUP_RANK or LOCAL_WORLD_SIZE. Any SLURM_* or OMPI_* variables around
///     them are ignored (srun or mpirun starting one torchrun per node).
///  2. Open MPI's mpirun: OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK, _LOCAL_SIZE
///     (SLURM_* variables around them are ignored: mpirun inside an allocation).
///  3. SLURM's srun (inside a job step, SLURM_STEP_ID set): SLURM_PROCID,
///     SLURM_NTASKS, SLURM_LOCALID, SLURM_NODEID, and the step's tasks per node.
///  4. RANK and WORLD_SIZE set by hand (no launcher), else a single rank.
/// RANK or WORLD_SIZE set by hand under mpirun or srun must agree with it: a
/// mismatch is an error naming both variables. MASTER_ADDR and MASTER_PORT
/// always come from the environment when set; else under srun from the job
/// (first host of the step's node list, a port derived from SLURM_JOB_ID), else
/// 127.0.0.1 and 29500 (mpirun across nodes needs `-x MASTER_ADDR=...`).
/// Note [Launch environments] in src/rendezvous/launch_env.cpp has the reasons.
/// Likewise the engine's knobs (direct_link_bytes ... debug_collectives) come
/// from FSDP_* variables when left unset; a field set explicitly always wins
/// over its variable. Sub-groups inherit them all.
struct ProcessGroupOptions {
  /// This process's rank; -1: from the launcher (default 0).
  TORCH_ARG(int64_t, rank) = -1;
  /// Number of ranks; -1: from the launcher (default 1).
  TORCH_ARG(int64_t, world_size) = -1;
  /// Rank within this node; -1: from the launcher (default: rank).
  TORCH_ARG(int64_t, local_rank) = -1;
  /// Ranks on this node; -1: from the launcher (default: world_size).
  TORCH_ARG(int64_t, local_world_size) = -1;
  /// Address of rank 0's rendezvous store; "": from MASTER_ADDR, else from
  /// the launcher (default 127.0.0.1).
  TORCH_ARG(std::string, master_addr) = "";
  /// Port of rank 0's rendezvous store; -1: from MASTER_PORT, else from the
  /// launcher (default 29500).
  TORCH_ARG(int64_t, master_port) = -1;
  /// Address this rank listens on, for the store (rank 0) and for Gloo's
  /// connections. "": the store listens on master_addr itself (any loopback
  /// address, IPv6 too); Gloo on loopback when master_addr is a loopback
  /// address, else on the local address of the interface that routes to
  /// master_addr. Nothing ever listens on the wildcard address unless
  /// "0.0.0.0" is given here.
  TORCH_ARG(std::string, listen_addr) = "";
  /// Limit for rendezvous and for every collective.
  TORCH_ARG(std::chrono::milliseconds, timeout) = std::chrono::minutes(5);
  /// Collective engine.
  TORCH_ARG(Backend, backend) = Backend::kGloo;
  /// Backend::kGloo: largest per-rank chunk (bytes) of an all-gather,
  /// reduce-scatter or all-reduce sent over the direct links to the ring
  /// neighbours rather than through shared memory or Gloo, and the largest
  /// message a rank writes without its sender thread. 0: nothing prefers the
  /// links (with Gloo they are then not opened). -1: from
  /// FSDP_DIRECT_LINK_BYTES (negative counts as 0), else 64 KiB.
  TORCH_ARG(int64_t, direct_link_bytes) = -1;
  /// Backend::kGloo: bytes per pipelined segment of the ring collectives, at
  /// least 4096. -1: from FSDP_RING_SEGMENT_BYTES (values below 4096 are
  /// ignored), else 1 MiB.
  TORCH_ARG(int64_t, ring_segment_bytes) = -1;
  /// Backend::kGloo: whether a group whose ranks all run on this host moves
  /// collectives above direct_link_bytes through shared memory (off on any
  /// rank: off for the whole group). Unset: on unless FSDP_SHM=0.
  TORCH_ARG(std::optional<bool>, shared_memory) = std::nullopt;
  /// Backend::kGloo: bytes of each of a rank's two shared-memory slots (bytes
  /// per rank and round), at least 4096, rounded down to a multiple of 64.
  /// -1: from FSDP_SHM_SLOT_BYTES (values below 4096 are ignored), else 2 MiB.
  TORCH_ARG(int64_t, shm_slot_bytes) = -1;
  /// Backend::kGloo: whether the communication thread and the direct links'
  /// sender thread take real-time priority (SCHED_FIFO 1) where the process
  /// may (root, CAP_SYS_NICE or RLIMIT_RTPRIO >= 1), so that on cores busy
  /// with compute they move data as soon as a link is ready; without the
  /// privilege they keep the default policy (in debug mode, a warning says
  /// so). Unset: on unless FSDP_COMM_REALTIME=0.
  TORCH_ARG(std::optional<bool>, realtime_threads) = std::nullopt;
  /// Debug mode: every collective first exchanges a fingerprint with the
  /// other ranks, so a mismatch is an error on every rank rather than a hang
  /// (see ProcessGroup::set_debug_collectives()). Unset: on when
  /// FSDP_DEBUG=detail (any case).
  TORCH_ARG(std::optional<bool>, debug_collectives) = std::nullopt;
  /// What carries CUDA tensors' collectives. Unset: from FSDP_CUDA_BACKEND
  /// (auto, nccl, staged or ipc), else CudaBackend::kAuto. RankInfo::cuda_backend
  /// says what was chosen.
  TORCH_ARG(std::optional<CudaBackend>, cuda_backend) = std::nullopt;
  /// Make the result the default group (see default_process_group()).
  TORCH_ARG(bool, set_default) = true;
  /// Secret every rank of the job shares and presents first on every store
  /// and direct-link connection; a connection without it is closed at once.
  /// "": from FSDP_JOB_TOKEN (fsdprun sets it), else the empty token. Not
  /// encryption: it travels in clear. See docs/communication.md.
  TORCH_ARG(std::string, job_token) = "";
};

/// Where this process sits in the whole job, as resolved by init_process_group.
struct RankInfo {
  /// Global rank.
  int rank = 0;
  /// Global number of ranks.
  int world_size = 1;
  /// Rank within the node.
  int local_rank = 0;
  /// Ranks on this node.
  int local_world_size = 1;
  /// Index of this rank's node, in [0, num_nodes): from the launcher
  /// (GROUP_RANK, SLURM_NODEID), else rank / local_world_size, which holds
  /// when ranks are numbered node by node (every launcher's default).
  int node_rank = 0;
  /// Number of nodes: from the launcher, else world_size / local_world_size
  /// rounded up.
  int num_nodes = 1;
  /// What the layout came from: "options", "torchrun" (torchrun or fsdprun),
  /// "mpirun", "srun", "environment" (RANK and WORLD_SIZE set by hand), or
  /// "none" (a single rank).
  std::string launcher = "none";
  /// What carries CUDA tensors' collectives: "nccl", "staged" or "cuda_ipc" (see
  /// ProcessGroupOptions::cuda_backend).
  std::string cuda_backend = "staged";
};

/// Joins (or, on rank 0, opens) the rendezvous and returns the group of all
/// ranks. World size 1 needs no store and opens no socket. It may be called
/// again, on the same MASTER_PORT, once every rank has let the earlier group
/// go (destroy_process_group() and no copy of it left).
std::shared_ptr<ProcessGroup> init_process_group(const ProcessGroupOptions& options = {});

/// Whether this build of libfsdp has `backend` (kC10dGloo needs Gloo's
/// headers, which pip's torch wheel does not ship).
bool backend_available(Backend backend);

/// The group made by the last init_process_group with set_default(true).
/// Throws when there is none.
std::shared_ptr<ProcessGroup> default_process_group();

/// True after init_process_group and before destroy_process_group.
bool is_initialized();

/// Rank, world size and node layout of the default group's job.
const RankInfo& rank_info();

/// This rank's GPU as launchers lay ranks out (PyTorch's
/// `torch.cuda.set_device(LOCAL_RANK)`): GPU rank_info().local_rank modulo
/// the GPUs this process sees; nullopt where it sees none. Call it after
/// init_process_group.
std::optional<c10::Device> local_gpu();

/// Forgets the default group (its resources go when the last user drops it).
void destroy_process_group();

}  // namespace fsdp
