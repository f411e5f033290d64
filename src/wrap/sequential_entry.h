#pragma once

#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/container/sequential.h>

#include <cstddef>
#include <functional>

namespace fsdp::detail {

/// Replaces entry `index` of `seq` in place by make(entry): in the entry
/// list that Sequential::forward calls and in the registered child of the
/// same name, so names and parameters() stay as they were. Errors name
/// `where`. Defined in sequential.cpp.
void replace_sequential_entry(
    torch::nn::Sequential& seq, size_t index, const char* where,
    const std::function<torch::nn::AnyModule(torch::nn::AnyModule)>& make);

}  // namespace fsdp::detail
