#pragma once

// Note [One seam for devices]
// Everything libfsdp does differently by device lives behind these functions:
// which devices a unit may live on, how a flat buffer's storage is freed and
// refilled in place, and which backend a placeholder dispatches as. The rest
// of the library carries a unit's device (FSDPOptions::device_id, resolved by
// resolve_unit_device in runtime/unit_init.h) into every tensor it makes, so a
// new device is added here, and the CPU path stays the reference.

#include <c10/core/Device.h>
#include <c10/core/DispatchKey.h>
#include <c10/core/StorageImpl.h>

#include <cstddef>

namespace fsdp::detail {

/// Whether a unit's flat parameter may live on `device` (the CPU so far).
bool unit_device_supported(c10::Device device);

/// Resizes `storage` in place to `bytes` on its own device (0 frees it), so
/// that every view of it, autograd's saved ones included, sees the change.
void resize_storage_bytes(c10::StorageImpl* storage, size_t bytes);

/// The dispatch key of dense tensors on `device` (a placeholder's backend).
c10::DispatchKey dense_backend_key(c10::Device device);

}  // namespace fsdp::detail
