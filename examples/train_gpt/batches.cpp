#include "batches.h"

#include <ATen/CPUGeneratorImpl.h>
#include <c10/util/Exception.h>

namespace train_gpt {

BatchSampler::BatchSampler(at::Tensor tokens, int64_t seq_len, int64_t global_batch, int rank,
                           int world, uint64_t seed)
    : tokens_(std::move(tokens)),
      seq_len_(seq_len),
      global_batch_(global_batch),
      local_batch_(global_batch / world),
      rank_(rank),
      seed_(seed) {
  TORCH_CHECK(global_batch % world == 0, "train_gpt: --batch-size ", global_batch,
              " cannot be split evenly over ", world, " ranks; use a multiple of ", world);
  TORCH_CHECK(tokens_.numel() > seq_len, "train_gpt: ", tokens_.numel(),
              " tokens are too few for sequences of ", seq_len);
}

Batch BatchSampler::batch(int64_t index) const {
  // One generator per batch: see Note [Deterministic batches].
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed_ * 0x9E3779B97F4A7C15ull +
                                                      static_cast<uint64_t>(index));
  // (randint takes the generator's lock itself.)
  at::Tensor starts = at::randint(tokens_.numel() - seq_len_, {global_batch_}, gen, at::kLong);
  starts = starts.slice(0, rank_ * local_batch_, (rank_ + 1) * local_batch_);
  // rows[i] = tokens[starts[i] + 0 .. seq_len]
  const at::Tensor offsets = at::arange(seq_len_ + 1, at::kLong);
  const at::Tensor rows = tokens_.index_select(0, (starts.unsqueeze(1) + offsets).reshape(-1))
                              .view({local_batch_, seq_len_ + 1});
  return {rows.slice(1, 0, seq_len_).contiguous(), rows.slice(1, 1).contiguous()};
}

}  // namespace train_gpt
