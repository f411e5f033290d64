#pragma once

// The advice the transports give when the ranks issued different collectives.

namespace fsdp::detail {

/// Appended to a transport's "the ranks issued different collectives"
/// error: what makes ranks differ in practice (one rank alone calling
/// something collective, e.g. torch::save of a sharded model outside
/// SummonFullParams, PyTorch users' rank-0-only habit) and how to find it.
inline constexpr const char* kMismatchAdvice =
    " Make every rank issue the same collectives in the same order: forward and backward, "
    "SummonFullParams, the state dicts and checkpoints, and torch::save of a sharded model "
    "outside SummonFullParams are collective (FSDP_DEBUG=detail names the first difference).";

}  // namespace fsdp::detail
