#pragma once

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <iostream>
#include <memory>
#include <string>

#include <fsdp/comm/init.h>

namespace fsdp::testing {

/// Joins the group that run_ranks' environment describes.
inline std::shared_ptr<ProcessGroup> join(
    Backend backend, std::chrono::milliseconds timeout = std::chrono::seconds(30)) {
  return init_process_group(ProcessGroupOptions().backend(backend).timeout(timeout));
}

/// Names a backend for parameterised test names.
inline std::string backend_label(const ::testing::TestParamInfo<Backend>& info) {
  return info.param == Backend::kGloo ? "Gloo" : "C10dGloo";
}

/// Expects `collective` to throw a c10::Error within `limit` (a dead or
/// stuck peer must fail it, not hang it); prints "got the expected error".
inline void expect_error_within(const std::function<void()>& collective,
                                std::chrono::steady_clock::duration limit) {
  const auto t0 = std::chrono::steady_clock::now();
  try {
    collective();
    ADD_FAILURE() << "the collective completed although its peers disagree or are gone";
  } catch (const c10::Error& e) {
    std::cout << "got the expected error: " << e.what() << std::endl;
  }
  EXPECT_LE(std::chrono::steady_clock::now() - t0, limit);
}

/// Bitwise equality with a message naming where the first difference is.
inline ::testing::AssertionResult tensors_equal(const at::Tensor& actual,
                                                const at::Tensor& expected) {
  if (actual.sizes() != expected.sizes() || actual.scalar_type() != expected.scalar_type()) {
    return ::testing::AssertionFailure()
           << "shape/dtype " << actual.sizes() << " " << actual.scalar_type() << " vs "
           << expected.sizes() << " " << expected.scalar_type();
  }
  if (at::equal(actual, expected)) return ::testing::AssertionSuccess();
  auto diff = (actual.to(at::kDouble) != expected.to(at::kDouble)).nonzero();
  const int64_t i = diff[0][0].item<int64_t>();
  return ::testing::AssertionFailure()
         << diff.size(0) << " of " << actual.numel() << " elements differ; first at " << i
         << ": got " << actual[i].item<double>() << ", expected " << expected[i].item<double>();
}

}  // namespace fsdp::testing
