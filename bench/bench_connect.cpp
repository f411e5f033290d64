// Connection set-up time (issue 20, Note [Job token]): how long
// init_process_group takes to connect a world (store, direct links, shared
// memory, Gloo where built), repeated in one job. Run at 2-4 ranks:
//   build/bin/fsdprun --nproc-per-node 3 build/bin/bench_connect [--iters 20]
// Rank 0 prints one JSON line: the median and the fastest set-up (each the
// slowest rank's). Only the public API, so it builds against older libfsdp too.

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <fsdp/comm/init.h>

namespace {

// A port nothing listens on now (bound, read and released).
int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  if (fd < 0 || ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    std::perror("bench_connect: no free port");
    std::exit(1);
  }
  ::close(fd);
  return ntohs(a.sin_port);
}

}  // namespace

int main(int argc, char** argv) {
  int iters = 20;
  for (int i = 1; i + 1 < argc; ++i) {
    if (std::strcmp(argv[i], "--iters") == 0) iters = std::atoi(argv[i + 1]);
  }
  auto world = fsdp::init_process_group();
  const int rank = world->rank();
  std::vector<double> times;
  for (int i = -2; i < iters; ++i) {  // two warm-ups
    at::Tensor port = at::full({1}, rank == 0 ? free_port() : 0, at::kDouble);
    world->all_reduce(port).wait();
    world->barrier().wait();
    const auto t0 = std::chrono::steady_clock::now();
    auto group =
        fsdp::init_process_group(fsdp::ProcessGroupOptions()
                                     .master_port(static_cast<int64_t>(port.item<double>()))
                                     .set_default(false));
    const double ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    world->barrier().wait();  // nobody drops the group (rank 0: the store) while others use it
    group.reset();
    at::Tensor slowest = at::full({1}, ms, at::kDouble);
    world->all_reduce(slowest, fsdp::ReduceOp::kMax).wait();
    if (i >= 0) times.push_back(slowest.item<double>());
  }
  std::sort(times.begin(), times.end());
  if (rank == 0) {
    std::printf(
        "{\"bench\":\"connect\",\"world\":%d,\"iters\":%d,\"median_ms\":%.3f,\"min_ms\":%.3f}\n",
        world->size(), iters, times[times.size() / 2], times.front());
  }
  world->barrier().wait();
  return 0;
}
