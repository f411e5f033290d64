#include "optim/fused_kernels.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <atomic>
#include <cmath>
#include <type_traits>

// See Note [Fused host optimizers].

namespace fsdp::detail {

namespace {

// Elements per task: large enough that a task streams for tens of
// microseconds, small enough that a few MiB split over every thread.
constexpr int64_t kGrain = int64_t{1} << 15;

// The element loops, one per combination of the branches, so that each is a
// straight loop the compiler vectorises. Expressions follow AdamW's CPU
// kernels: mul_ then add_ with alpha, addcmul_, sqrt then the division by
// sqrt(bias_correction2) then add_(eps), addcdiv_ (value * t1 / t2).
// Copy is NoCopy, or the low-precision type the new values are also written
// in (c10::BFloat16, c10::Half: the conversions of Tensor::to()). Grad is
// the gradient's type: float, or the reduce dtype a gradient keeps under
// keep_low_precision_grads, read as its float value (exact, as Tensor::to()).
struct NoCopy {};

// Calls `f` with a value of the C++ type of `dtype`, a gradient's: float,
// c10::BFloat16 or c10::Half.
template <typename F>
void with_grad_type(c10::ScalarType dtype, F&& f) {
  if (dtype == c10::kBFloat16) {
    f(c10::BFloat16());
  } else if (dtype == c10::kHalf) {
    f(c10::Half());
  } else {
    f(0.0F);
  }
}

// Each loop is compiled twice on x86-64, for AVX2 and for the baseline
// (SSE2), and the loader picks the one the CPU runs: 8 floats a vector
// instead of 4. Only AVX2, not FMA (one rounding where the expressions above
// have two): the clones then compute bitwise the same, whatever the CPU, and
// as close to LibTorch's optimizers as before. One core stepped AdamW with
// its bfloat16 copy 1.5x faster so (a loop of its shape, 16 Mi elements),
// where the step is bound by the core rather than by memory: few cores per
// GPU. Not under ThreadSanitizer, whose runtime is not up yet when the
// loader asks which clone to take (a crash).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(__SANITIZE_THREAD__)
#define FSDP_VECTOR_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define FSDP_VECTOR_CLONES
#endif

template <bool kDecay, bool kAmsgrad, typename Copy, typename Grad>
FSDP_VECTOR_CLONES void adamw_range(float* __restrict p, const Grad* __restrict g,
                                    float* __restrict m, float* __restrict v,
                                    float* __restrict vmax, Copy* __restrict copy, int64_t n,
                                    const AdamWCoefficients& c) {
  const float decay = c.decay_factor;
  const float b1 = c.beta1, a1 = c.one_minus_beta1, b2 = c.beta2, a2 = c.one_minus_beta2;
  const float bc2 = c.sqrt_bias_correction2, eps = c.eps, step = c.neg_step_size;
  for (int64_t i = 0; i < n; ++i) {
    float value = p[i];
    if (kDecay) value = value * decay;
    const auto grad = static_cast<float>(g[i]);
    const float avg = m[i] * b1 + a1 * grad;
    const float sq = v[i] * b2 + a2 * grad * grad;
    m[i] = avg;
    v[i] = sq;
    float second = sq;
    if (kAmsgrad) {
      // at::maximum's: a NaN on either side wins.
      second = (vmax[i] > sq || vmax[i] != vmax[i]) ? vmax[i] : sq;
      vmax[i] = second;
    }
    const float denom = std::sqrt(second) / bc2 + eps;
    const float updated = value + step * avg / denom;
    p[i] = updated;
    if constexpr (!std::is_same_v<Copy, NoCopy>) copy[i] = static_cast<Copy>(updated);
  }
}

template <bool kDecay, bool kAmsgrad, typename Grad>
void adamw_copy_dispatch(float* p, const Grad* g, float* m, float* v, float* vmax, void* copy,
                         c10::ScalarType copy_dtype, int64_t begin, int64_t n,
                         const AdamWCoefficients& c) {
  if (copy == nullptr) {
    adamw_range<kDecay, kAmsgrad, NoCopy>(p, g, m, v, vmax, nullptr, n, c);
  } else if (copy_dtype == c10::kBFloat16) {
    adamw_range<kDecay, kAmsgrad>(p, g, m, v, vmax, static_cast<c10::BFloat16*>(copy) + begin, n,
                                  c);
  } else {
    adamw_range<kDecay, kAmsgrad>(p, g, m, v, vmax, static_cast<c10::Half*>(copy) + begin, n, c);
  }
}

template <bool kDecay, bool kMomentum, bool kFirst, bool kNesterov, typename Grad>
FSDP_VECTOR_CLONES void sgd_range(float* __restrict p, const Grad* __restrict g,
                                  float* __restrict buf, int64_t n, const SGDCoefficients& c) {
  const float wd = c.weight_decay, mom = c.momentum, keep = c.one_minus_dampening;
  const float lr = c.neg_lr;
  for (int64_t i = 0; i < n; ++i) {
    auto d = static_cast<float>(g[i]);
    if (kDecay) d = d + wd * p[i];
    if (kMomentum) {
      const float b = kFirst ? d : buf[i] * mom + keep * d;
      buf[i] = b;
      d = kNesterov ? d + mom * b : b;
    }
    p[i] = p[i] + lr * d;
  }
}

template <bool kDecay, bool kMomentum, bool kFirst, typename Grad>
void sgd_dispatch(float* p, const Grad* g, float* buf, int64_t n, const SGDCoefficients& c) {
  if (c.nesterov) {
    sgd_range<kDecay, kMomentum, kFirst, true>(p, g, buf, n, c);
  } else {
    sgd_range<kDecay, kMomentum, kFirst, false>(p, g, buf, n, c);
  }
}

}  // namespace

void fused_adamw(float* param, const void* grad, c10::ScalarType grad_dtype, float* exp_avg,
                 float* exp_avg_sq, float* max_exp_avg_sq, void* copy, c10::ScalarType copy_dtype,
                 int64_t n, const AdamWCoefficients& c) {
  with_grad_type(grad_dtype, [&](auto tag) {
    using Grad = decltype(tag);
    at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
      float* vmax = max_exp_avg_sq != nullptr ? max_exp_avg_sq + begin : nullptr;
      const int64_t count = end - begin;
      float* p = param + begin;
      float* m = exp_avg + begin;
      float* v = exp_avg_sq + begin;
      const Grad* g = static_cast<const Grad*>(grad) + begin;
      const auto t = copy_dtype;
      if (c.decay) {
        if (vmax != nullptr)
          return adamw_copy_dispatch<true, true>(p, g, m, v, vmax, copy, t, begin, count, c);
        return adamw_copy_dispatch<true, false>(p, g, m, v, vmax, copy, t, begin, count, c);
      }
      if (vmax != nullptr)
        return adamw_copy_dispatch<false, true>(p, g, m, v, vmax, copy, t, begin, count, c);
      adamw_copy_dispatch<false, false>(p, g, m, v, vmax, copy, t, begin, count, c);
    });
  });
}

void fused_sgd(float* param, const void* grad, c10::ScalarType grad_dtype, float* momentum_buffer,
               int64_t n, const SGDCoefficients& c) {
  with_grad_type(grad_dtype, [&](auto tag) {
    using Grad = decltype(tag);
    at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
      float* p = param + begin;
      const Grad* g = static_cast<const Grad*>(grad) + begin;
      float* buf = momentum_buffer != nullptr ? momentum_buffer + begin : nullptr;
      const int64_t count = end - begin;
      const bool decay = c.weight_decay != 0.0F;
      if (buf == nullptr) {
        if (decay) return sgd_dispatch<true, false, false>(p, g, buf, count, c);
        return sgd_dispatch<false, false, false>(p, g, buf, count, c);
      }
      if (c.first) {
        if (decay) return sgd_dispatch<true, true, true>(p, g, buf, count, c);
        return sgd_dispatch<false, true, true>(p, g, buf, count, c);
      }
      if (decay) return sgd_dispatch<true, true, false>(p, g, buf, count, c);
      sgd_dispatch<false, true, false>(p, g, buf, count, c);
    });
  });
}

int kernel_threads_used(int64_t n) {
  std::atomic<int> most{0};
  at::parallel_for(0, n, kGrain, [&](int64_t, int64_t) {
    const int mine = at::get_thread_num() + 1;
    int seen = most.load();
    while (seen < mine && !most.compare_exchange_weak(seen, mine)) {
    }
  });
  return most.load();
}

}  // namespace fsdp::detail
