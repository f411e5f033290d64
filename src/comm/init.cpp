#include <fsdp/comm/init.h>

#include <ATen/Context.h>
#include <c10/util/Exception.h>

#include <signal.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <chrono>
#include <cstdlib>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <fsdp/comm/c10d_process_group.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "comm/agreement.h"
#include "comm/comm_config.h"
#include "comm/cuda_backend.h"
#include "comm/device_routed.h"
#include "comm/gloo_process_group.h"
#include "comm/join_store.h"
#include "comm/thread_priority.h"
#include "detail/env.h"
#include "detail/error.h"
#include "detail/torch_compat.h"
#include "rendezvous/job_token.h"
#include "rendezvous/launch_env.h"
#include "rendezvous/socket.h"
#include "rendezvous/tcp_store.h"

namespace fsdp {

namespace {

std::mutex g_mutex;
std::shared_ptr<ProcessGroup> g_default;
RankInfo g_info;

// Gloo writes to its sockets without MSG_NOSIGNAL in places, so a peer that
// dies would kill this rank silently with SIGPIPE (seen in the kill test)
// instead of failing the collective with an error. Like most networking
// libraries we ignore SIGPIPE, unless the program installed its own handler.
void ignore_sigpipe() {
  struct sigaction current {};
  if (sigaction(SIGPIPE, nullptr, &current) == 0 && current.sa_handler == SIG_DFL) {
    signal(SIGPIPE, SIG_IGN);
  }
}

// Note [torchrun's agent store]
// torchrun's agent serves a c10d TCPStore on MASTER_PORT itself, on every
// interface, and tells its workers so (TORCHELASTIC_USE_AGENT_STORE=True), so
// rank 0 cannot serve fsdp::TcpStore on that port: every rank joins the
// agent's store as a client instead, as PyTorch's own workers do. That store
// outlives the workers across restarts and serves every init_process_group
// of the job, so libfsdp's keys go under the attempt (the restart count) and
// the number of the call in this process, the same on every rank since every
// rank makes the same calls. The store's protocol changed between PyTorch
// versions (LibTorch 1.13's client gets no answer from torch 2.x's agent), so
// a first query within a few seconds turns that into an error saying so
// rather than a "Socket Timeout" at the end of the timeout.
c10::intrusive_ptr<c10d::Store> join_agent_store(const detail::LaunchEnv& launch,
                                                 std::chrono::milliseconds timeout) {
  static std::atomic<int> calls{0};
  c10d::TCPStoreOptions store_options;
  store_options.port = static_cast<uint16_t>(launch.master_port);
  store_options.isServer = false;
  store_options.waitWorkers = false;
  store_options.timeout = std::min(timeout, std::chrono::milliseconds(10000));
  c10::intrusive_ptr<c10d::TCPStore> agent;
  std::string failure;
  try {
    agent = c10::make_intrusive<c10d::TCPStore>(launch.master_addr, store_options);
    // A get waits at most the store's timeout in every LibTorch (a check may not).
    const std::string probe = "fsdp/answers/" + std::to_string(launch.info.rank);
    agent->set(probe, std::vector<uint8_t>{1});
    agent->get(probe);
  } catch (const c10::Error& e) {
    failure = e.what_without_backtrace();
  } catch (const std::exception& e) {
    failure = e.what();
  }
  FSDP_CHECK(failure.empty(), launch.info.rank, "init_process_group", "torchrun's agent store at ",
             launch.master_addr, ":", launch.master_port, " did not answer (",
             failure.substr(0, failure.find('\n')),
             "). Start the job with the torchrun of the PyTorch this program's LibTorch comes "
             "from (their stores' protocols differ between versions), or with fsdprun.");
  agent->setTimeout(timeout);
  const std::string prefix = "fsdp/attempt_" + std::to_string(*launch.agent_store_attempt) +
                             "/init_" + std::to_string(calls++);
  return c10::make_intrusive<c10d::PrefixStore>(prefix, agent);
}

// The GPU a rank of `local_rank` uses as launchers lay ranks out (modulo the
// GPUs this process sees); nullopt without one. local_gpu() after init, and
// init itself before the default group's RankInfo exists.
std::optional<c10::Device> gpu_of_local_rank(int local_rank) {
  if (!at::hasCUDA()) return std::nullopt;
  const auto gpus = static_cast<int>(at::getNumGPUs());
  return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(local_rank % gpus));
}

// Note [Agreeing on the world size]
// Hand-launched ranks can disagree on WORLD_SIZE; Gloo would then fail deep in
// its rendezvous ("sizeof(impl_) == bytes.size(). 136 vs 272") or wait for
// ranks that never come. So the ranks compare world sizes through the store
// first: every rank posts its own and reads rank 0's; rank 0 reads every
// other rank's and posts a verdict that the others wait for. A rank that
// disagrees with rank 0 fails at once, rank 0 fails on the first one it finds,
// and every other rank fails with rank 0's verdict, all naming both sizes.
// Each rank acknowledges what it learnt, and a failing rank 0 keeps serving the
// store (a few seconds at most) until the ranks that arrived have: its store
// going away would otherwise turn their message into "lost the connection".
// The engine's settings that pick a collective's route and framing (Note
// [Communication knobs]: direct_link_bytes, ring_segment_bytes, debug mode)
// are compared alike: an environment variable set on one node only made the
// ranks take different routes, wait for the whole timeout, and blame a live
// rank or "different collectives".

// One compared setting: its name in messages, its value, and how to fix a
// difference.
struct LaunchFact {
  std::string name;
  std::string value;
  std::string fix;
};

void agree_on_launch(c10d::Store& store, const RankInfo& info, std::chrono::milliseconds timeout,
                     const std::vector<LaunchFact>& facts) {
  const std::string prefix = "fsdp/init/world_size/";
  auto text = [](const std::vector<uint8_t>& v) { return std::string(v.begin(), v.end()); };
  std::string mine;
  for (const LaunchFact& f : facts) mine += f.value + "\n";
  // The first fact that differs between `mine` and `theirs` (rank r and s).
  auto mismatch = [&facts, &mine](int r, int s, const std::string& theirs) {
    std::istringstream a(mine), b(theirs);
    for (const LaunchFact& f : facts) {
      std::string x, y;
      std::getline(a, x);
      std::getline(b, y);
      if (x != y) {
        return "rank " + std::to_string(r) + " has " + f.name + " " + x + ", rank " +
               std::to_string(s) + " has " + y + ". " + f.fix;
      }
    }
    return std::string("the ranks were started differently");
  };
  store.set(prefix + std::to_string(info.rank), std::vector<uint8_t>(mine.begin(), mine.end()));
  std::string verdict;
  if (info.rank == 0) {
    for (int p = 1; p < info.world_size && verdict.empty(); ++p) {
      const std::string theirs = text(store.get(prefix + std::to_string(p)));
      if (theirs != mine) verdict = mismatch(0, p, theirs);
    }
    store.set(prefix + "verdict", std::vector<uint8_t>(verdict.begin(), verdict.end()));
    if (!verdict.empty()) {
      std::vector<std::string> acks;
      for (int p = 1; p < info.world_size; ++p) {
        if (store.check({prefix + std::to_string(p)}))
          acks.push_back(prefix + "ack/" + std::to_string(p));
      }
      try {
        store.wait(acks, std::min(timeout, std::chrono::milliseconds(5000)));
      } catch (const std::exception&) {  // a rank that does not acknowledge fails on its own
      }
    }
  } else {
    const std::string root = text(store.get(prefix + "0"));
    if (root != mine) verdict = mismatch(info.rank, 0, root);
    if (verdict.empty()) verdict = text(store.get(prefix + "verdict"));
    store.set(prefix + "ack/" + std::to_string(info.rank), std::vector<uint8_t>{});
  }
  FSDP_CHECK(verdict.empty(), info.rank, "init_process_group", verdict);
}

// What agree_on_launch compares: the world size first.
std::vector<LaunchFact> launch_facts(const RankInfo& info, const detail::CommConfig& config,
                                     bool debug) {
  const auto knob = [](const char* field, const char* env) {
    return std::string("Every rank must use the same value: set ProcessGroupOptions::") + field +
           " alike, or the environment variable " + env + " on every node (or on none)";
  };
  return {
      {"WORLD_SIZE", std::to_string(info.world_size),
       "Every rank must be started with the same WORLD_SIZE (fsdprun sets it for you)."},
      {"direct_link_bytes", std::to_string(config.direct_link_bytes),
       knob("direct_link_bytes", "FSDP_DIRECT_LINK_BYTES")},
      {"ring_segment_bytes", std::to_string(config.ring_segment_bytes),
       knob("ring_segment_bytes", "FSDP_RING_SEGMENT_BYTES")},
      {"debug_collectives", debug ? "on" : "off", knob("debug_collectives", "FSDP_DEBUG=detail")}};
}

// A size knob of Note [Communication knobs]: the option when set (-1: unset),
// else the variable when set, read as before the options existed (atoll; a
// value below `env_min` falls back, or `env_min` 0 clamps to 0), else `fallback`.
int64_t size_knob(int64_t option, const char* env, int64_t fallback, int64_t env_min,
                  bool env_clamps) {
  if (option >= 0) return option;
  const char* text = std::getenv(env);
  if (text == nullptr) return fallback;
  const int64_t v = std::atoll(text);
  if (env_clamps) return std::max(env_min, v);
  return v >= env_min ? v : fallback;
}

// A switch of Note [Communication knobs], on by default: the option when set,
// else off only when the variable is "0".
bool switch_knob(const std::optional<bool>& option, const char* env) {
  if (option.has_value()) return *option;
  return detail::env_switch_on(env);
}

}  // namespace

namespace detail {

bool debug_requested_by_env() {
  const char* env = std::getenv("FSDP_DEBUG");
  if (env == nullptr) return false;
  std::string value(env);
  std::transform(value.begin(), value.end(), value.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return value == "detail";
}

CommConfig resolve_comm_config(const ProcessGroupOptions& options) {
  FSDP_CHECK(options.direct_link_bytes() >= -1, -1, "init_process_group",
             "direct_link_bytes must be >= 0 (or -1: from FSDP_DIRECT_LINK_BYTES), got ",
             options.direct_link_bytes());
  FSDP_CHECK(options.ring_segment_bytes() == -1 || options.ring_segment_bytes() >= kMinSegmentBytes,
             -1, "init_process_group", "ring_segment_bytes must be at least ", kMinSegmentBytes,
             " (or -1: from FSDP_RING_SEGMENT_BYTES), got ", options.ring_segment_bytes());
  FSDP_CHECK(options.shm_slot_bytes() == -1 || options.shm_slot_bytes() >= kMinSegmentBytes, -1,
             "init_process_group", "shm_slot_bytes must be at least ", kMinSegmentBytes,
             " (or -1: from FSDP_SHM_SLOT_BYTES), got ", options.shm_slot_bytes());
  CommConfig config;
  config.direct_link_bytes = size_knob(options.direct_link_bytes(), "FSDP_DIRECT_LINK_BYTES",
                                       kDefaultDirectLinkBytes, 0, /*env_clamps=*/true);
  config.ring_segment_bytes = size_knob(options.ring_segment_bytes(), "FSDP_RING_SEGMENT_BYTES",
                                        kDefaultRingSegmentBytes, kMinSegmentBytes, false);
  config.shm_slot_bytes = size_knob(options.shm_slot_bytes(), "FSDP_SHM_SLOT_BYTES",
                                    kDefaultShmSlotBytes, kMinSegmentBytes, false) /
                          64 * 64;
  config.job_token = resolve_job_token(options.job_token());
  config.realtime_threads = switch_knob(options.realtime_threads(), "FSDP_COMM_REALTIME");
  config.shared_memory = switch_knob(options.shared_memory(), "FSDP_SHM");
  return config;
}

}  // namespace detail

std::shared_ptr<ProcessGroup> init_process_group(const ProcessGroupOptions& options) {
  // See Note [Launch environments].
  const detail::LaunchEnv launch =
      detail::resolve_launch_env(options, detail::process_environment());
  const RankInfo& info = launch.info;
  FSDP_CHECK(options.timeout().count() > 0, info.rank, "init_process_group",
             "timeout must be positive");
  // See Note [Communication knobs].
  const detail::CommConfig config = detail::resolve_comm_config(options);
  const bool debug = options.debug_collectives().value_or(detail::debug_requested_by_env());
  const CudaBackend requested = detail::resolve_cuda_backend(
      options.cuda_backend(), std::getenv("FSDP_CUDA_BACKEND"), info.rank);
  if (debug && options.backend() == Backend::kGloo && config.realtime_threads &&
      !detail::realtime_permitted()) {
    TORCH_WARN("fsdp: rank ", info.rank,
               "'s communication threads keep the default scheduling priority: this process may "
               "not use real-time scheduling (SCHED_FIFO needs CAP_SYS_NICE, e.g. docker run "
               "--cap-add SYS_NICE, or `ulimit -r 1`); set FSDP_COMM_REALTIME=0 or "
               "ProcessGroupOptions::realtime_threads(false) where that is intended");
  }

  const std::string& master_addr = launch.master_addr;
  const int64_t master_port = launch.master_port;
  std::string listen_addr = options.listen_addr();
  if (listen_addr.empty() && !detail::is_loopback_host(master_addr)) {
    listen_addr = detail::local_address_toward(master_addr);
  } else if (listen_addr.empty()) {
    listen_addr = master_addr.find(':') != std::string::npos ? "::1" : "127.0.0.1";
  }

  c10::intrusive_ptr<c10d::Store> store;
  if (info.world_size > 1) {
    ignore_sigpipe();
    // Rank 0 serves the store on the address the others dial (any loopback
    // address, or the master node's), unless told to listen elsewhere.
    const std::string server_addr = options.listen_addr().empty() ? master_addr : listen_addr;
    if (launch.agent_store_attempt) {
      // torchrun's own store speaks PyTorch's protocol, which has no job
      // token; the direct links still check it. See Note [torchrun's agent store].
      store = join_agent_store(launch, options.timeout());
    } else {
      store = detail::join_store(master_addr, master_port, info, options.timeout(), server_addr,
                                 config.job_token);
    }
    // See Note [Agreeing on the world size].
    agree_on_launch(*store, info, options.timeout(), launch_facts(info, config, debug));
    // Rank 0 has heard from every rank. See Note [A store from an earlier init].
    if (info.rank == 0) store->set(detail::kEveryRankJoined, std::vector<uint8_t>{});
  }

  std::shared_ptr<ProcessGroup> group;
  switch (options.backend()) {
    case Backend::kGloo:
      group = std::make_shared<detail::GlooProcessGroup>(
          store, "fsdp/world", info.rank, info.world_size, options.timeout(), listen_addr, config);
      break;
    case Backend::kC10dGloo: {
#if FSDP_WITH_GLOO
      const auto timeout = options.timeout();
      C10dGroupFactory factory = [timeout, listen_addr](const c10::intrusive_ptr<c10d::Store>& s,
                                                        int rank, int size) {
        return compat::make_c10d_gloo_group(s, rank, size, timeout, listen_addr);
      };
      // c10d's Gloo needs a store even for one rank.
      if (!store) {
        store = c10::make_intrusive<TcpStore>("127.0.0.1", 0, true, timeout, "", config.job_token);
      }
      auto world = c10::make_intrusive<c10d::PrefixStore>("fsdp/c10d", store);
      group = std::make_shared<C10dProcessGroup>(factory(world, info.rank, info.world_size),
                                                 timeout, world, factory);
      break;
#else
      FSDP_FAIL(info.rank, "init_process_group",
                "Backend::kC10dGloo is not in this build of libfsdp: it was built "
                "against a LibTorch without Gloo's headers (pip's torch wheel). Use "
                "Backend::kGloo (the default), or wrap a c10d::ProcessGroup you made in "
                "fsdp::C10dProcessGroup.");
#endif
    }
  }

  // See Note [Choosing what carries CUDA tensors]: every rank states what it
  // can do, the group takes the least.
  detail::CudaFacts facts = detail::this_process_cuda_facts(info.local_world_size);
  // Which ranks share a GPU, by its identity, not by counting (every rank
  // takes part: the build, and so this branch, is the same everywhere).
  if (detail::built_nccl_version() != 0) {
    const int64_t my_gpu = detail::gpu_identity(gpu_of_local_rank(info.local_rank));
    facts.ranks_on_gpu =
        detail::ranks_on_same_gpu(detail::agree_gather(group.get(), {my_gpu}), my_gpu);
  }
  const detail::CudaChoice mine = detail::choose_cuda_backend(requested, facts);
  // Builds without NCCL (the same on every rank) need no agreement.
  const bool nccl = detail::built_nccl_version() != 0 &&
                    detail::agree_reduce(group.get(), {mine.nccl ? 1 : 0}, ReduceOp::kMin)[0] == 1;
  FSDP_CHECK(nccl || requested != CudaBackend::kNccl, info.rank, "init_process_group",
             "CudaBackend::kNccl (or FSDP_CUDA_BACKEND=nccl) cannot be honoured: ",
             mine.nccl ? "another rank cannot run NCCL (see its error)" : mine.why_not,
             ". Use CudaBackend::kAuto or kStaged.");
  std::shared_ptr<ProcessGroup> cuda_group;
  std::string cuda_backend = "staged";
  // Every rank takes part in the agreement once NCCL is out, so that the
  // ranks try CUDA IPC together or not at all.
  const bool try_ipc =
      !nccl && requested == CudaBackend::kAuto && info.world_size > 1 &&
      detail::agree_reduce(
          group.get(),
          {detail::auto_tries_cuda_ipc(requested, nccl, facts, info.world_size) ? 1 : 0},
          ReduceOp::kMin)[0] == 1;
  if (nccl) {
    cuda_group = detail::make_nccl_group(store, info.rank, info.world_size, options.timeout());
    cuda_backend = "nccl";
  } else if (requested == CudaBackend::kCudaIpc || try_ipc) {
    // Collective (every rank asked, the variable or option being the job's).
    const std::optional<c10::Device> gpu = gpu_of_local_rank(info.local_rank);
    // Every rank takes part, a rank without a GPU saying "no".
    cuda_group = detail::make_cuda_ipc_group(store, info.rank, info.world_size, options.timeout(),
                                             gpu.value_or(c10::Device(c10::kCUDA, 0)));
    // Every rank has read the store before any rank gives up (rank 0 serves
    // it): one agreement on the engine, the same answer everywhere.
    const bool all_ipc =
        detail::agree_reduce(group.get(), {cuda_group ? 1 : 0}, ReduceOp::kMin)[0] == 1;
    FSDP_CHECK(all_ipc || try_ipc, info.rank, "init_process_group",
               "CudaBackend::kCudaIpc (or FSDP_CUDA_BACKEND=ipc) cannot be honoured: ",
               !gpu ? "this process sees no GPU"
                    : "the ranks are not all on this GPU of one host, or a CUDA call "
                      "failed on some rank",
               ". Use CudaBackend::kAuto or kStaged.");
    if (all_ipc) {
      cuda_backend = "cuda_ipc";
    } else {
      cuda_group = nullptr;  // kAuto: the ranks stage
    }
  }

  // CPU tensors to the engine, CUDA tensors to NCCL or CUDA IPC, or staged
  // through the host (Note [Tensors on other devices than the engine's]).
  group = std::make_shared<detail::DeviceRoutedProcessGroup>(std::move(group), false,
                                                             std::move(cuda_group));
  group->set_debug_collectives(debug);

  // Nobody leaves init before everyone has connected: a rank that returned
  // and exited at once would otherwise break a peer's connect in progress.
  if (info.world_size > 1) group->barrier().wait();

  if (options.set_default()) {
    std::lock_guard<std::mutex> lock(g_mutex);
    g_default = group;
    g_info = info;
    g_info.cuda_backend = cuda_backend;
  }
  return group;
}

bool backend_available(Backend backend) { return backend == Backend::kGloo || FSDP_WITH_GLOO; }

std::shared_ptr<ProcessGroup> default_process_group() {
  std::lock_guard<std::mutex> lock(g_mutex);
  FSDP_CHECK(g_default, -1, "process group",
             "no default process group. Call fsdp::init_process_group() first.");
  return g_default;
}

bool is_initialized() {
  std::lock_guard<std::mutex> lock(g_mutex);
  return g_default != nullptr;
}

const RankInfo& rank_info() {
  std::lock_guard<std::mutex> lock(g_mutex);
  FSDP_CHECK(g_default, -1, "process group",
             "no default process group. Call fsdp::init_process_group() first.");
  return g_info;
}

std::optional<c10::Device> local_gpu() { return gpu_of_local_rank(rank_info().local_rank); }

void destroy_process_group() {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_default.reset();
  g_info = RankInfo{};
}

}  // namespace fsdp
