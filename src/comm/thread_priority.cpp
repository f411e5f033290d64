#include "comm/thread_priority.h"

#include <pthread.h>
#include <sched.h>

#include <thread>

namespace fsdp::detail {

bool prefer_over_compute(bool realtime) {
  if (!realtime) return false;
  sched_param param{};
  param.sched_priority = 1;
  // EPERM (no CAP_SYS_NICE, RLIMIT_RTPRIO 0) leaves the thread as it was.
  return pthread_setschedparam(pthread_self(), SCHED_FIFO, &param) == 0;
}

bool realtime_permitted() {
  // Trying is the only exact answer (besides capabilities and RLIMIT_RTPRIO,
  // a cgroup without a real-time budget or seccomp can refuse), on a thread
  // of its own so that the caller's scheduling is never touched.
  bool took = false;
  std::thread([&took] { took = prefer_over_compute(true); }).join();
  return took;
}

}  // namespace fsdp::detail
