#pragma once

// Data-parallel batches: each step draws one global batch of random windows
// of the text, deterministic from (seed, batch index); rank r keeps rows
// [r * B / W, (r + 1) * B / W).

#include <ATen/ATen.h>

#include <cstdint>

namespace train_gpt {

/// One rank's part of a global batch.
struct Batch {
  at::Tensor inputs;   ///< int64 [B / W, seq_len]
  at::Tensor targets;  ///< int64 [B / W, seq_len]: inputs shifted by one character
};

/// Note [Deterministic batches]
/// Batch i is a pure function of (seed, i) and the text, never of the world
/// size or of earlier batches: 1 rank with B rows and 2 ranks with B/2 rows
/// each see the same global batch (the loss-curve test relies on it), and a
/// resumed run continues from TrainState::batches_drawn without replaying.
class BatchSampler {
 public:
  /// Windows of `seq_len` + 1 tokens of `tokens` (int64 [n], n > seq_len).
  /// `global_batch` must be a multiple of `world`.
  BatchSampler(at::Tensor tokens, int64_t seq_len, int64_t global_batch, int rank, int world,
               uint64_t seed);

  /// This rank's rows of global batch `index`.
  Batch batch(int64_t index) const;

  /// Rows per rank.
  int64_t local_batch() const { return local_batch_; }

 private:
  at::Tensor tokens_;
  int64_t seq_len_;
  int64_t global_batch_;
  int64_t local_batch_;
  int rank_;
  uint64_t seed_;
};

}  // namespace train_gpt
