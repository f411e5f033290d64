#pragma once

// Shared by the checkpoint tests: scratch directories, models, training.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdlib>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>

#include <fsdp/fsdp.h>

#include "detail/posix_files.h"
#include "multi_rank.h"
#include "test_models.h"

namespace fsdp::testing {

/// A fresh directory in the test process; in rank processes the one the test
/// process passed in CKPT_TEST_DIR (see with_dir()).
inline std::string test_dir() {
  if (is_rank_process()) return std::getenv("CKPT_TEST_DIR");
  char tmpl[] = "/tmp/fsdp_ckpt_test_XXXXXX";
  const char* dir = ::mkdtemp(tmpl);
  EXPECT_NE(dir, nullptr);
  return dir;
}

/// Removes a test directory in the test process once the test passed (a
/// failing test keeps it for inspection).
inline void remove_test_dir(const std::string& dir) {
  std::error_code ignored;
  if (!is_rank_process() && !::testing::Test::HasFailure()) detail::remove_tree(dir, ignored);
}

/// Options that pass `dir` to the rank processes.
inline MultiRankOptions with_dir(const std::string& dir) {
  MultiRankOptions o;
  o.env["CKPT_TEST_DIR"] = dir;
  return o;
}

/// A whole file's bytes.
inline std::string file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

/// Writes bytes over a file.
inline void put_file_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << bytes;
}

/// The wrapped test model (fc1 and block units inside a root unit), seeded
/// the same on every rank.
inline std::shared_ptr<FullyShardedDataParallelImpl<NetImpl>> make_model(const FSDPOptions& o,
                                                                         uint64_t seed = 0) {
  torch::manual_seed(seed);
  return std::make_shared<FullyShardedDataParallelImpl<NetImpl>>(std::make_shared<NetImpl>(true, o),
                                                                 o);
}

/// An optimizer of the kind named ("sgd", "adam", "adamw") over `params`.
inline std::unique_ptr<torch::optim::Optimizer> make_optimizer(const std::string& kind,
                                                               std::vector<torch::Tensor> params) {
  if (kind == "sgd")
    return std::make_unique<torch::optim::SGD>(params,
                                               torch::optim::SGDOptions(0.05).momentum(0.9));
  if (kind == "adam")
    return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(1e-2));
  return std::make_unique<torch::optim::AdamW>(params, torch::optim::AdamWOptions(1e-2));
}

/// `steps` training steps on inputs drawn from the global generator.
template <typename Model>
void train(Model& model, torch::optim::Optimizer& opt, int steps) {
  for (int s = 0; s < steps; ++s) {
    torch::Tensor x = torch::randn({4, 7});
    opt.zero_grad();
    torch::mse_loss(model.forward(x), torch::ones({4, 3})).backward();
    opt.step();
  }
}

/// Bitwise equality of two state dicts (names, shapes, dtypes, values).
inline void expect_bitwise_equal(const torch::OrderedDict<std::string, torch::Tensor>& a,
                                 const torch::OrderedDict<std::string, torch::Tensor>& b,
                                 const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (const auto& item : a) {
    const torch::Tensor* other = b.find(item.key());
    ASSERT_NE(other, nullptr) << what << ": missing " << item.key();
    EXPECT_TRUE(item.value().sizes() == other->sizes() &&
                item.value().scalar_type() == other->scalar_type() &&
                torch::equal(item.value(), *other))
        << what << ": " << item.key() << " differs";
  }
}

}  // namespace fsdp::testing
