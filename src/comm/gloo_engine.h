#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "comm/ring.h"

namespace fsdp::detail {

/// Note [Gloo or not]
/// With Debian's LibTorch 1.13 libfsdp calls Debian's Gloo (libgloo-dev)
/// directly: a full mesh of Gloo pairs carries the ring collectives between
/// hosts, broadcast and barrier included (Gloo's own collectives are not
/// called: Note [Gloo's buffers let go later]). pip's torch wheel
/// (LibTorch 2.x) links its own, newer Gloo into libtorch_cpu.so and exports
/// its symbols but ships none of its headers; Debian's headers describe
/// another version of the same classes, so calling either copy through them
/// would mix two layouts under one set of symbol names. Builds against the
/// wheel are therefore made without Gloo (FSDP_WITH_GLOO=OFF): the direct
/// links carry every collective that shared memory does not (Note [Direct
/// links for large collectives]), and broadcast and barrier run as rings
/// over them. c10d's ProcessGroupGloo (Backend::kC10dGloo) needs the same
/// headers and is absent from such builds.
class GlooEngine {
 public:
  virtual ~GlooEngine() = default;
  /// Gloo's unbound buffers, for the ring collectives.
  virtual PointToPoint& p2p() = 0;
  /// The group broke (Note [Broken groups]): closes every pair, so that the
  /// peers' transfers fail at once, as the direct links' abort() does.
  virtual void abort() = 0;
};

/// Connects a full mesh of Gloo pairs for rank `rank` of `size` through
/// `store` (keys under `prefix`), listening on `listen_addr`. Returns null
/// when libfsdp was built without Gloo (see Note [Gloo or not]).
std::unique_ptr<GlooEngine> connect_gloo(const c10::intrusive_ptr<c10d::Store>& store,
                                         const std::string& prefix, int rank, int size,
                                         std::chrono::milliseconds timeout,
                                         const std::string& listen_addr);

/// True when libfsdp was built with Gloo.
bool built_with_gloo();

}  // namespace fsdp::detail
