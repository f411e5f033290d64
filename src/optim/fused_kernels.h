#pragma once

// Note [Fused host optimizers]
// torch::optim::AdamW steps a parameter with nine tensor operations (decay,
// two for each moment, a square root, a division, the epsilon, the update),
// each a pass over memory and two of them a fresh allocation: about 88 bytes
// moved per float32 element. The step is bound by memory bandwidth, so the
// fused step reads the value, gradient and both moments once and writes the
// value and moments once (28 bytes an element), in one loop that the
// compiler vectorises (this file's kernels compile with -fno-math-errno so
// that the square root does), split over LibTorch's intra-op threads as its
// own operations are. Each element is computed with AdamW's operations in
// AdamW's order, in float as its CPU kernels compute, so the results agree
// to rounding. FusedSGD does the same for SGD (momentum, dampening,
// Nesterov, weight decay): 20 bytes an element with momentum. A gradient
// kept in bfloat16 or float16 (keep_low_precision_grads: half the bytes from
// a GPU under CPU offload) is read as its float values, 2 bytes an element
// fewer: the exact cast Tensor::to() would make, so the step is bitwise that
// of the float32 gradient.
// bench/bench_host_optim.cpp measures both against LibTorch's and against a
// copy of the same bytes.

#include <c10/core/ScalarType.h>

#include <cstdint>

namespace fsdp::detail {

/// AdamW's per-step constants, as the float values its CPU kernels use.
struct AdamWCoefficients {
  bool decay = false;         ///< weight_decay != 0
  float decay_factor = 1.0F;  ///< 1 - lr * weight_decay
  float beta1 = 0.0F;
  float one_minus_beta1 = 0.0F;
  float beta2 = 0.0F;
  float one_minus_beta2 = 0.0F;
  float sqrt_bias_correction2 = 1.0F;  ///< sqrt(1 - beta2^step)
  float eps = 0.0F;
  float neg_step_size = 0.0F;  ///< -lr / (1 - beta1^step)
};

/// One AdamW step over `n` contiguous elements, in place, on the intra-op
/// threads. `grad` holds `grad_dtype` (kFloat, or kBFloat16 or kHalf, read
/// as their float values). `max_exp_avg_sq` is null without amsgrad. Unless
/// `copy` is null, the new values are also written there as `copy_dtype`
/// (kBFloat16 or kHalf), in the same pass.
void fused_adamw(float* param, const void* grad, c10::ScalarType grad_dtype, float* exp_avg,
                 float* exp_avg_sq, float* max_exp_avg_sq, void* copy, c10::ScalarType copy_dtype,
                 int64_t n, const AdamWCoefficients& c);

/// SGD's per-step constants, as float values.
struct SGDCoefficients {
  float weight_decay = 0.0F;
  float momentum = 0.0F;  ///< 0: no momentum buffer
  float one_minus_dampening = 1.0F;
  float neg_lr = 0.0F;
  bool nesterov = false;
  bool first = false;  ///< the buffer is new: it takes the gradient as it is
};

/// One SGD step over `n` contiguous elements, in place, on the intra-op
/// threads. `grad` as fused_adamw's; `momentum_buffer` is null without
/// momentum.
void fused_sgd(float* param, const void* grad, c10::ScalarType grad_dtype, float* momentum_buffer,
               int64_t n, const SGDCoefficients& c);

/// How many intra-op threads the kernels' loop splits `n` elements over (the
/// most at::get_num_threads() allows): the check that this file compiles
/// with LibTorch's parallel backend (Note [Intra-op threads in libfsdp's
/// loops] in src/CMakeLists.txt).
int kernel_threads_used(int64_t n);

}  // namespace fsdp::detail
