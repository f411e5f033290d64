#pragma once

#include <cstdint>
#include <string>

namespace fsdp {

/// Reduction applied by reduce-scatter and all-reduce. kAvg divides the sum by
/// the group size after summing in the tensor's own dtype (as NCCL's avg does).
enum class ReduceOp : uint8_t { kSum, kAvg, kMax, kMin };

/// The name of a reduction, for messages ("sum", "avg", ...).
const char* to_string(ReduceOp op);

/// The collectives a ProcessGroup issues; used in messages and fingerprints.
enum class CollectiveKind : uint8_t {
  kAllGather,
  kReduceScatter,
  kAllReduce,
  kBroadcast,
  kBarrier,
};

/// The name of a collective, for messages ("all_gather", ...).
const char* to_string(CollectiveKind kind);

}  // namespace fsdp
