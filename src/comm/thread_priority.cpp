#include "comm/thread_priority.h"

#include <pthread.h>
#include <sched.h>

namespace fsdp::detail {

bool prefer_over_compute(bool realtime) {
  if (!realtime) return false;
  sched_param param{};
  param.sched_priority = 1;
  // EPERM (no CAP_SYS_NICE, RLIMIT_RTPRIO 0) leaves the thread as it was.
  return pthread_setschedparam(pthread_self(), SCHED_FIFO, &param) == 0;
}

}  // namespace fsdp::detail
