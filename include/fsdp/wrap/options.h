#pragma once

/// The options of an FSDP unit (FSDPOptions, ShardingStrategy,
/// BackwardPrefetch) belong to the runtime layer; the wrap layer re-exports
/// them here, where users of fsdp::FullyShardedDataParallel look first.
#include <fsdp/runtime/options.h>
