// The device-neutral storage resize that frees and refills a unit's flat
// buffer on a GPU (Note [One seam for devices]), run on the CPU with an
// allocator that counts: memory comes from and goes back to the storage's
// own allocator, views (autograd's saved ones among them) see the refilled
// memory, and the bytes both sizes hold are kept.

#include <ATen/ATen.h>
#include <c10/core/Allocator.h>
#include <c10/core/StorageImpl.h>
#include <gtest/gtest.h>

#include <cstdlib>

#include "core/device_storage.h"
#include "detail/torch_compat.h"

namespace fsdp::testing {
namespace test_device_storage {

// The CPU's allocator, counting what it hands out and takes back.
struct CountingAllocator final : c10::Allocator {
  static void release(void* p) {
    ++frees;
    std::free(p);
  }
  c10::DataPtr allocate(size_t n) FSDP_ALLOCATE_CONST override {
    if (n == 0) return {nullptr, nullptr, &release, c10::Device(c10::kCPU)};  // holds nothing
    ++allocations;
    void* p = std::malloc(n);
    return {p, p, &release, c10::Device(c10::kCPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &release; }
  FSDP_ALLOCATOR_COPY_DATA
  static inline int allocations = 0;
  static inline int frees = 0;
};

TEST(DeviceStorage, ResizeWithTheStoragesAllocatorKeepsViewsAndBytes) {
  CountingAllocator allocator;
  auto storage = c10::make_intrusive<c10::StorageImpl>(c10::StorageImpl::use_byte_size_t(),
                                                       100 * sizeof(float), &allocator,
                                                       /*resizable=*/true);
  ASSERT_EQ(CountingAllocator::allocations, 1);
  const at::Tensor flat = at::empty({0}, at::kFloat).set_(c10::Storage(storage), 0, {100}, {1});
  flat.copy_(at::arange(100, at::kFloat));
  const at::Tensor view = flat.narrow(0, 10, 5);  // as a parameter's view of the flat buffer

  detail::resize_with_allocator(storage.get(), 0);  // freed
  EXPECT_EQ(storage->nbytes(), 0u);
  EXPECT_EQ(CountingAllocator::frees, 1);

  detail::resize_with_allocator(storage.get(), 100 * sizeof(float));  // refilled
  EXPECT_EQ(storage->nbytes(), 100 * sizeof(float));
  flat.fill_(7);
  EXPECT_TRUE(at::equal(view, at::full({5}, 7.0f)));  // the view sees the new memory
  flat.copy_(at::arange(100, at::kFloat));

  detail::resize_with_allocator(storage.get(), 50 * sizeof(float));   // shrinks, keeps 50
  detail::resize_with_allocator(storage.get(), 100 * sizeof(float));  // grows, keeps 50
  EXPECT_TRUE(at::equal(flat.narrow(0, 0, 50), at::arange(50, at::kFloat)));
  EXPECT_TRUE(at::equal(view, at::arange(10, 15, at::kFloat)));
  const int allocations = CountingAllocator::allocations;
  detail::resize_with_allocator(storage.get(), 100 * sizeof(float));  // the same size: nothing
  EXPECT_EQ(CountingAllocator::allocations, allocations);
  // Every block but the live one went back to the allocator.
  EXPECT_EQ(CountingAllocator::frees, CountingAllocator::allocations - 1);
}

TEST(DeviceStorage, UnitsLiveOnTheCpuAndOnVisibleGpusOnly) {
  EXPECT_TRUE(detail::unit_device_supported(c10::Device(c10::kCPU)));
  EXPECT_FALSE(detail::unit_device_supported(c10::Device(c10::kMeta)));
  const auto gpus = static_cast<c10::DeviceIndex>(at::getNumGPUs());
  EXPECT_FALSE(detail::unit_device_supported(c10::Device(c10::kCUDA, gpus)));
  EXPECT_EQ(detail::unit_device_supported(c10::Device(c10::kCUDA, 0)), at::hasCUDA());
}

}  // namespace test_device_storage
}  // namespace fsdp::testing
