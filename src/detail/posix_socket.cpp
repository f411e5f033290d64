#include "detail/posix_socket.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <unistd.h>

#include <cstring>

namespace fsdp::detail {

UniqueFd& UniqueFd::operator=(UniqueFd&& other) noexcept {
  if (this != &other) {
    reset();
    fd_ = other.release();
  }
  return *this;
}

int UniqueFd::release() {
  int fd = fd_;
  fd_ = -1;
  return fd;
}

void UniqueFd::reset() {
  if (fd_ >= 0) {
    ::close(fd_);
    fd_ = -1;
  }
}

bool is_loopback(const sockaddr_storage& addr) {
  if (addr.ss_family == AF_INET) {
    return (ntohl(reinterpret_cast<const sockaddr_in&>(addr).sin_addr.s_addr) >> 24) == 127;
  }
  if (addr.ss_family != AF_INET6) return false;
  const in6_addr& a6 = reinterpret_cast<const sockaddr_in6&>(addr).sin6_addr;
  return IN6_IS_ADDR_LOOPBACK(&a6) || (IN6_IS_ADDR_V4MAPPED(&a6) && a6.s6_addr[12] == 127);
}

bool is_loopback_host(const std::string& host) {
  if (host == "localhost") return true;
  sockaddr_storage addr{};
  auto& a4 = reinterpret_cast<sockaddr_in&>(addr);
  auto& a6 = reinterpret_cast<sockaddr_in6&>(addr);
  if (inet_pton(AF_INET, host.c_str(), &a4.sin_addr) == 1) {
    addr.ss_family = AF_INET;
  } else if (inet_pton(AF_INET6, host.c_str(), &a6.sin6_addr) == 1) {
    addr.ss_family = AF_INET6;
  } else {
    return false;
  }
  return is_loopback(addr);
}

}  // namespace fsdp::detail
