#include "free_port.h"

#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace fsdp::launch {

int pick_free_port(const std::string& addr, std::string* error) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* list = nullptr;
  const int rc = ::getaddrinfo(addr.c_str(), "0", &hints, &list);
  if (rc != 0) {
    *error = "cannot resolve " + addr + ": " + gai_strerror(rc);
    return -1;
  }
  int port = -1;
  *error = "no address for " + addr;
  for (addrinfo* ai = list; ai != nullptr && port < 0; ai = ai->ai_next) {
    const int fd = ::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
    if (fd < 0) {
      *error = std::string("socket: ") + std::strerror(errno);
      continue;
    }
    sockaddr_storage bound{};
    socklen_t len = sizeof(bound);
    if (::bind(fd, ai->ai_addr, ai->ai_addrlen) != 0) {
      *error = "bind " + addr + ":0: " + std::strerror(errno);
    } else if (::getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &len) != 0) {
      *error = std::string("getsockname: ") + std::strerror(errno);
    } else {
      port = ntohs(bound.ss_family == AF_INET6
                       ? reinterpret_cast<const sockaddr_in6*>(&bound)->sin6_port
                       : reinterpret_cast<const sockaddr_in*>(&bound)->sin_port);
    }
    ::close(fd);
  }
  ::freeaddrinfo(list);
  return port;
}

}  // namespace fsdp::launch
