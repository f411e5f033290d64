#include "core/device_storage.h"

#include <ATen/native/Resize.h>
#include <c10/core/TensorOptions.h>

namespace fsdp::detail {

bool unit_device_supported(c10::Device device) { return device.is_cpu(); }

void resize_storage_bytes(c10::StorageImpl* storage, size_t bytes) {
  const c10::Device device = storage->device();
  TORCH_INTERNAL_ASSERT(unit_device_supported(device), "fsdp: no storage resize on ", device);
  at::native::resize_bytes_cpu(storage, bytes);
}

c10::DispatchKey dense_backend_key(c10::Device device) {
  return c10::computeDispatchKey(c10::nullopt, c10::kStrided, device);
}

}  // namespace fsdp::detail
