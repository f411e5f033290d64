#include "reduced_grad.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace fsdp::detail {

bool all_zero_bits(const at::Tensor& t) {
  if (!t.is_contiguous() || !t.device().is_cpu()) return false;
  const auto* bytes = static_cast<const unsigned char*>(t.data_ptr());
  const size_t n = static_cast<size_t>(t.numel()) * t.element_size();
  // Blocks of 256 bytes OR-ed together: one branch per block, and the first
  // non-zero block (the usual case for a gradient that was not zeroed) ends it.
  constexpr size_t kBlock = 256;
  size_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    uint64_t words[kBlock / sizeof(uint64_t)];
    std::memcpy(words, bytes + i, kBlock);
    uint64_t acc = 0;
    for (uint64_t w : words) acc |= w;
    if (acc != 0) return false;
  }
  for (; i < n; ++i) {
    if (bytes[i] != 0) return false;
  }
  return true;
}

void accumulate_reduced_grad(at::Tensor& param, const at::Tensor& grad) {
  // Note [Handing over the reduced gradient]
  // LibTorch 1.13's Optimizer::zero_grad() zeroes gradients instead of
  // dropping them (2.x drops them by default), so every step would add the
  // reduced gradient into a buffer of zeros: a read of both and a write, for
  // a result equal to the reduced gradient. When the gradient is all +0.0
  // (checked by reading it once, stopping at the first non-zero byte), it
  // takes the reduced gradient's storage instead, through set_(): the same
  // tensor object, so a reference the user holds sees the new values, as
  // after an in-place add. 0 + x == x for every x but -0.0, which stays -0.0
  // here (as with 2.x's dropped gradients) instead of becoming +0.0.
  // Measured (GPT-mini, NO_SHARD, world 1): the hand-over at the end of
  // backward takes 4.0 ms instead of 6.4 ms per step.
  // A view (a use_orig_params piece of the shard) is copied, never taken:
  // LibTorch 1.13's zero_grad() cannot detach_() a view.
  at::Tensor& current = param.mutable_grad();
  if (!current.defined()) {
    current = grad.is_view() ? grad.clone() : grad;
  } else if (!grad.is_view() && takes_reduced_grad(param, grad)) {
    take_reduced_grad(param, grad);
  } else {
    current.add_(grad);
  }
}

void take_reduced_grad(at::Tensor& param, const at::Tensor& grad) {
  at::Tensor& current = param.mutable_grad();
  if (current.defined()) {
    current.set_(grad);
  } else {
    current = grad;
  }
}

bool takes_reduced_grad(const at::Tensor& param, const at::Tensor& grad) {
  const at::Tensor& current = param.grad();
  if (!current.defined()) return true;
  return !current.is_view() && current.unsafeGetTensorImpl()->allow_tensor_metadata_change() &&
         current.dtype() == grad.dtype() && current.sizes() == grad.sizes() &&
         all_zero_bits(current);
}

void set_reduced_grads(const std::vector<GradTarget>& targets, const at::Tensor& grad) {
  for (const GradTarget& t : targets) {
    at::Tensor param = t.param;
    accumulate_reduced_grad(param, t.numel < 0 ? grad : grad.narrow(0, t.offset, t.numel));
  }
}

// Note [Stepping a gradient as it lands]
// Under CPU offload a unit stepped beside backward (Note [Stepping beside
// backward]) waits for its reduced gradient's copy to host memory, then
// steps it. For the unit whose gradient backward makes last (the token
// embedding's), both happen after the GPU has finished: on an H100, GPT-2
// small's embedding took 5.8 ms to copy and 7.9 ms to step after the last
// kernel. So a large gradient is copied in parts of about 4 Mi elements
// (16 MB of fp32, ~0.6 ms over PCIe), each with an event of its own, and the
// optimizer steps each part's elements once that event has passed, while
// the next parts are copied: the tail becomes the first part's copy plus the
// step. Each element is stepped once, with the step count and bias
// corrections of the whole parameter (counted at its first range), so the
// values are bitwise those of the whole step. Only listeners that declare
// ReducedGradHooks::takes_parts get parts; the others read .grad whole.
int64_t grad_part_elements(bool goes_to_host) {
  if (const char* env = std::getenv("FSDP_GRAD_PART_ELEMENTS")) {
    const long long n = std::atoll(env);
    return n > 0 ? static_cast<int64_t>(n) : 0;
  }
  return goes_to_host ? (int64_t{4} << 20) : 0;
}

std::vector<std::vector<ParamRange>> plan_grad_parts(const std::vector<int64_t>& sizes,
                                                     int64_t part_elements) {
  int64_t total = 0;
  for (int64_t n : sizes) total += n;
  std::vector<std::vector<ParamRange>> parts;
  if (total == 0) return parts;
  if (part_elements <= 0 || total < 2 * part_elements) {
    parts.emplace_back();
    for (size_t i = 0; i < sizes.size(); ++i) parts.back().push_back({i, 0, sizes[i]});
    return parts;
  }
  // Each part ends at the next multiple of part_elements, except that a
  // remainder under half a part joins the last one.
  int64_t done = 0;
  size_t param = 0;
  int64_t within = 0;  // elements of sizes[param] already in earlier parts
  while (done < total) {
    int64_t take = std::min(part_elements, total - done);
    if (total - done - take < part_elements / 2) take = total - done;
    parts.emplace_back();
    while (take > 0) {
      const int64_t n = std::min(take, sizes[param] - within);
      if (n > 0 || sizes[param] == 0) parts.back().push_back({param, within, within + n});
      within += n;
      take -= n;
      done += n;
      if (within == sizes[param]) {
        ++param;
        within = 0;
      }
    }
  }
  for (; param < sizes.size(); ++param) parts.back().push_back({param, 0, 0});  // empty, at the end
  return parts;
}

}  // namespace fsdp::detail
