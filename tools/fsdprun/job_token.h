#pragma once

// The job token fsdprun hands to the ranks it starts (see Note [Job token]
// in src/rendezvous/job_token.cpp).

#include <string>
#include <vector>

#include "options.h"

namespace fsdp::launch {

/// A fresh random token: 128 bits from getrandom(), as 32 hex digits.
/// Returns "" (and sets `error`) when the kernel gives no randomness.
std::string random_job_token(std::string* error);

/// A fresh random id in the form of torchrun's --standalone run id (a
/// version-4 UUID, "1b4e28ba-2fa1-41d2-883f-0016d3cca427"); "" (and `error`)
/// when the kernel gives no randomness.
std::string random_run_id(std::string* error);

/// Makes sure `env` carries FSDP_JOB_TOKEN for the ranks and returns it:
/// kept when set and non-empty; else, for a one-node job, a random one is
/// added (the same for every restart of the job). A multi-node job needs the
/// same token on every node, so it must come from the environment: "", with
/// a one-line `error` giving the fix, when it is missing; "" without an
/// error for a Python program under the static backend, which needs none.
std::string ensure_job_token(const LaunchOptions& options, std::vector<std::string>* env,
                             std::string* error);

}  // namespace fsdp::launch
