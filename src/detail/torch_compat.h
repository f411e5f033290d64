#pragma once

// Every difference between LibTorch 1.13 and 2.x that libfsdp meets lives here.
// 1.13: c10d::ProcessGroupGloo derives from c10d::ProcessGroup.
// 2.x:  it derives from c10d::Backend and is wrapped in a c10d::ProcessGroup.

#include <torch/version.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <gloo/transport/tcp/device.h>

#include <c10/util/Exception.h>

#include <chrono>
#include <string>
#include <vector>

#define FSDP_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) ||       \
   (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

namespace fsdp::compat {

/// A c10d Gloo process group listening on `listen_addr`.
inline c10::intrusive_ptr<c10d::ProcessGroup> make_c10d_gloo_group(
    const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
    std::chrono::milliseconds timeout, const std::string& listen_addr) {
  auto options = c10d::ProcessGroupGloo::Options::create(timeout);
  gloo::transport::tcp::attr attr;
  attr.hostname = listen_addr;
  options->devices.push_back(gloo::transport::tcp::CreateDevice(attr));
#if FSDP_TORCH_AT_LEAST(2, 0)
  auto backend = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, options);
  auto group = c10::make_intrusive<c10d::ProcessGroup>(store, rank, size);
  group->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::GLOO, backend);
  group->setDefaultBackend(c10d::ProcessGroup::BackendType::GLOO);
  return group;
#else
  return c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, options);
#endif
}

/// Waits for a c10d collective with a limit (the Work type moved in 2.x).
template <typename WorkPtr>
void wait_work(const WorkPtr& work, std::chrono::milliseconds timeout) {
  work->wait(timeout);
}

/// Collects the messages of the warnings (TORCH_WARN) issued on any thread
/// while it is installed; 1.13's handler takes (location, msg, verbatim), 2.x
/// a c10::Warning.
class CapturedWarnings : public c10::WarningHandler {
 public:
#if FSDP_TORCH_AT_LEAST(2, 0)
  void process(const c10::Warning& warning) override { messages.push_back(warning.msg()); }
  using Guard = c10::WarningUtils::WarningHandlerGuard;
#else
  void process(const c10::SourceLocation&, const std::string& msg, const bool) override {
    messages.push_back(msg);
  }
  using Guard = c10::Warning::WarningHandlerGuard;
#endif
  std::vector<std::string> messages;
};

}  // namespace fsdp::compat
