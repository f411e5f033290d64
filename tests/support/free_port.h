#pragma once

// A free TCP port for a test's job, outside the kernel's ephemeral range:
// for the multi-rank harness and for tests that start ranks by hand.

#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <random>

namespace fsdp::testing {

// Note [Test ports outside the ephemeral range]
// A port that bind(0) reported free is closed again before the job listens on
// it, and the kernel hands ports of that same range (ip_local_port_range,
// 32768-60999 by default) to every connect() and bind(0) on the machine: the
// other tests of a `ctest -j` run, and mpirun's own PMIx sockets, took one
// before rank 0 listened ("Address already in use", 1 run in 134 under
// taskset). A test port comes from below that range instead, where only
// explicit binds go, at a random place so that concurrent tests differ, and
// is checked free with the options the store listens with.
inline int free_port() {
  int low = 32768;
  if (std::ifstream range("/proc/sys/net/ipv4/ip_local_port_range"); range) range >> low;
  const int first = 10000;
  const int count = std::max(1000, low - first);
  static std::mt19937 rng(std::random_device{}() ^ static_cast<unsigned>(::getpid()));
  for (int attempt = 0; attempt < 200; ++attempt) {
    const int port = first + static_cast<int>(rng() % static_cast<unsigned>(count));
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) break;
    const int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_ANY);
    addr.sin_port = htons(static_cast<uint16_t>(port));
    const bool free = ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
    ::close(fd);
    if (free) return port;
  }
  ADD_FAILURE() << "free_port: no free TCP port below " << low << " after 200 tries";
  return 0;
}

}  // namespace fsdp::testing
