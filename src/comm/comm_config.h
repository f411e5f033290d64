#pragma once

#include <cstdint>
#include <string>

namespace fsdp {
struct ProcessGroupOptions;
}  // namespace fsdp

namespace fsdp::detail {

/// Default of CommConfig::direct_link_bytes.
constexpr int64_t kDefaultDirectLinkBytes = int64_t{64} << 10;
/// Default of CommConfig::ring_segment_bytes; 1 MiB was the fastest of
/// 256 KiB-8 MiB on the 2-core reference box.
constexpr int64_t kDefaultRingSegmentBytes = int64_t{1} << 20;
/// Default of CommConfig::shm_slot_bytes.
constexpr int64_t kDefaultShmSlotBytes = int64_t{2} << 20;
/// Smallest ring segment and shared-memory slot.
constexpr int64_t kMinSegmentBytes = 4096;

/// Note [Communication knobs]
/// The CPU engine's sizes and switches are ProcessGroupOptions fields. An
/// environment variable may still set each one (FSDP_DIRECT_LINK_BYTES,
/// FSDP_RING_SEGMENT_BYTES, FSDP_SHM, FSDP_SHM_SLOT_BYTES, FSDP_COMM_REALTIME,
/// FSDP_DEBUG); they are read once, by init_process_group, where the options
/// are resolved, and a field set explicitly wins over its variable. The
/// resolved values travel down as this struct to the group, its links, shared
/// memory and rings;
/// nothing below init_process_group reads the environment for them. Two
/// exceptions: the test-only fault hook FSDP_FAULT_SHM_SETUP is read where it
/// acts, and a C10dProcessGroup that a user constructs directly still starts
/// in debug mode under FSDP_DEBUG=detail (its documented contract).
struct CommConfig {
  /// Largest per-rank chunk that takes the direct links in preference to
  /// shared memory or Gloo, and the largest message the calling thread sends
  /// itself (Note [Direct links for small collectives]); 0: none.
  int64_t direct_link_bytes = kDefaultDirectLinkBytes;
  /// Bytes per pipelined segment of the ring collectives (Note [Ring collectives]).
  int64_t ring_segment_bytes = kDefaultRingSegmentBytes;
  /// Whether a group whose ranks are all on this host may use shared memory.
  bool shared_memory = true;
  /// Bytes of each of a rank's two shared-memory slots, a multiple of 64.
  int64_t shm_slot_bytes = kDefaultShmSlotBytes;
  /// Whether the communication and sender threads take real-time priority
  /// where allowed (Note [Communication threads preempt compute]).
  bool realtime_threads = true;
  /// What every link of the group presents first (Note [Job token]);
  /// ProcessGroupOptions::job_token, else FSDP_JOB_TOKEN, else "".
  std::string job_token;
};

/// The engine's knobs from `options`, each unset field from its environment
/// variable, else its default (see Note [Communication knobs]). Invalid
/// explicit fields are errors naming the field. Defined in init.cpp.
CommConfig resolve_comm_config(const ProcessGroupOptions& options);

/// True when FSDP_DEBUG is "detail" (any case): debug mode by default.
/// Defined in init.cpp.
bool debug_requested_by_env();

}  // namespace fsdp::detail
