#pragma once

namespace fsdp::detail {

/// Note [Communication threads preempt compute]
/// While a unit computes, its neighbours' collectives move data on two
/// threads per rank: the communication thread (receives, ring reductions) and
/// the direct links' sender thread (Note [Direct links for large
/// collectives]). Both sleep in syscalls until a socket or a peer is ready,
/// then have a moment's work to keep the link busy. Where compute fills every
/// core (one rank per core, or the simulated nodes of bench/network_overlap.sh
/// sharing 2 cores), a woken thread waits behind the compute thread for the
/// scheduler, and the link idles meanwhile. Real-time priority (SCHED_FIFO,
/// the lowest level, 1) lets them preempt compute at once; they never spin
/// long (shared memory spins kSpins pauses, then sleeps on a futex), so
/// compute gets its core back as soon as the data moved. Measured on 2
/// simulated nodes x 1 rank at 1 Gbit/s (GPT-mini 8 x 512, batch 4): the
/// FULL_SHARD step 0.95x (median of 6 interleaved rounds, 0.90-0.99) with
/// communication alone unchanged; no change on one host (2 ranks on 2 cores,
/// within the noise). Needs CAP_SYS_NICE or RLIMIT_RTPRIO >= 1 (root in a
/// container has it); without either the threads keep the default policy,
/// which is only slower.
/// ProcessGroupOptions::realtime_threads(false), or FSDP_COMM_REALTIME=0,
/// keeps the default policy. Under FSDP_DEBUG=detail init_process_group warns
/// when the process may not take the priority (docker drops CAP_SYS_NICE by
/// default), since the fallback is otherwise silent.

/// Gives the calling thread SCHED_FIFO priority 1 when `realtime` and the
/// process is allowed to; returns whether it took. Never throws.
bool prefer_over_compute(bool realtime);

/// Whether prefer_over_compute(true) would take in this process (tried on a
/// short-lived thread of its own).
bool realtime_permitted();

}  // namespace fsdp::detail
