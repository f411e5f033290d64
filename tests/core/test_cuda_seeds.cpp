// The seed ports on GPU 0 (label cuda), as PyTorch runs its own versions of
// them on GPUs: the 32 freezing-weights combinations (seed 000), meta-device
// init materialised on the GPU through device_id (seed 002) and the
// forward-order agreement error (seed 001), at 1-3 ranks sharing the GPU.
// TF32 is off so that the GPU's float32 results stay within the seeds'
// tolerance of plain LibTorch's. Reported skipped, by name, without a GPU.

#include <ATen/Context.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "seed_ports.h"

namespace fsdp::testing {
namespace test_cuda_seeds {

const torch::Device kGpu(torch::kCUDA, 0);

void exact_float32() {
  at::globalContext().setAllowTF32CuDNN(false);
  at::globalContext().setAllowTF32CuBLAS(false);
}

TEST(CudaSeeds, FreezingWeightsOnTheGpu) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device visible";
  exact_float32();
  check_freezing_weights(kGpu);
}

TEST(CudaSeeds, MetaInitMaterialisesOnTheGpu) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device visible";
  exact_float32();
  check_meta_init_simple(kGpu);
  check_meta_init_nested(kGpu);
}

TEST(CudaSeeds, ForwardOrderErrorOnTheGpu) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device visible";
  check_first_iteration_order_error(kGpu, 2);
  check_first_iteration_order_error(kGpu, 3);
}

}  // namespace test_cuda_seeds
}  // namespace fsdp::testing
