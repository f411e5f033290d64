#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include <fsdp/comm/process_group.h>

#include "comm/shm_links.h"

namespace fsdp::detail {

/// A group whose every collective is the rounds of Note [Shared memory for
/// same-host ranks] over slots that `open_slots` opens (null: slots in the
/// host segment), run in issue order on a thread of the group's own. With
/// cuda_ipc_slot_opener() it carries the CUDA tensors of ranks sharing a GPU
/// (Note [Ranks sharing a GPU]); with host slots the same code runs on CPU
/// tensors, which is how it is tested without a GPU. Collective over `store`
/// (keys under its own prefix); nullptr on every rank where shared memory or
/// the slots cannot be had. `name` is backend_name().
std::shared_ptr<ProcessGroup> make_slot_group(const c10::intrusive_ptr<c10d::Store>& store,
                                              int rank, int size, std::chrono::milliseconds timeout,
                                              int64_t slot_bytes, SlotOpener open_slots,
                                              std::string name);

}  // namespace fsdp::detail
