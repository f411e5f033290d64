#include "output_writer.h"

#include <poll.h>
#include <unistd.h>

#include <cerrno>

namespace fsdp::launch {

bool OutputWriter::write(std::string_view data) {
  while (!broken_ && !data.empty()) {
    const ssize_t n = ::write(fd_, data.data(), data.size());
    if (n > 0) {
      data.remove_prefix(static_cast<size_t>(n));
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      pollfd pfd{fd_, POLLOUT, 0};
      ::poll(&pfd, 1, -1);
    } else {
      broken_ = true;
    }
  }
  return !broken_;
}

}  // namespace fsdp::launch
