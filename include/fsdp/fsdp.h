#pragma once

/// libfsdp: Fully Sharded Data Parallel training for LibTorch.
/// This umbrella header includes the whole public API, except
/// <fsdp/comm/c10d_process_group.h> (any c10d ProcessGroup behind libfsdp's
/// interface), which brings in c10d's headers: include it where you use it.

#include <fsdp/comm/init.h>
#include <fsdp/comm/process_group.h>
#include <fsdp/comm/types.h>
#include <fsdp/comm/work.h>
#include <fsdp/core/activation_checkpoint.h>
#include <fsdp/core/mixed_precision.h>
#include <fsdp/core/reset_parameters.h>
#include <fsdp/error_message.h>
#include <fsdp/memory.h>
#include <fsdp/optim/fused.h>
#include <fsdp/optim/sharded_grad_scaler.h>
#include <fsdp/runtime/compute_copies.h>
#include <fsdp/runtime/memory_plan.h>
#include <fsdp/runtime/options.h>
#include <fsdp/runtime/reduced_grad_hooks.h>
#include <fsdp/runtime/unit.h>
#include <fsdp/state/checkpoint.h>
#include <fsdp/state/state_dict.h>
#include <fsdp/wrap/activation_checkpointing.h>
#include <fsdp/wrap/auto_wrap.h>
#include <fsdp/wrap/enable_wrap.h>
#include <fsdp/wrap/fully_shard.h>
#include <fsdp/wrap/fully_sharded.h>
#include <fsdp/wrap/options.h>
#include <fsdp/wrap/sequential.h>
#include <fsdp/wrap/summon_full_params.h>
