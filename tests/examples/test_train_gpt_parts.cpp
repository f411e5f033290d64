// The pieces of examples/train_gpt that the end-to-end tests rely on,
// checked directly: deterministic batches split over ranks, the generated
// corpus, the vocabulary, the learning-rate schedule, the progress formats.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "batches.h"
#include "corpus.h"
#include "lr_schedule.h"
#include "progress.h"

namespace train_gpt {
namespace {

TEST(TrainGptParts, TwoRanksSplitTheOneRankBatch) {
  // See Note [Deterministic batches].
  const at::Tensor tokens = at::arange(1000, at::kLong);
  const BatchSampler whole(tokens, 16, 8, /*rank=*/0, /*world=*/1, /*seed=*/7);
  const BatchSampler first(tokens, 16, 8, 0, 2, 7);
  const BatchSampler second(tokens, 16, 8, 1, 2, 7);
  for (int64_t i : {0, 1, 5}) {
    const Batch all = whole.batch(i);
    const Batch a = first.batch(i), b = second.batch(i);
    EXPECT_TRUE(at::equal(at::cat({a.inputs, b.inputs}), all.inputs)) << "batch " << i;
    EXPECT_TRUE(at::equal(at::cat({a.targets, b.targets}), all.targets)) << "batch " << i;
    // Targets are the inputs shifted by one token.
    EXPECT_TRUE(at::equal(all.targets.slice(1, 0, 15), all.inputs.slice(1, 1)));
    EXPECT_EQ(all.inputs.sizes(), (std::vector<int64_t>{8, 16}));
  }
  EXPECT_FALSE(at::equal(whole.batch(0).inputs, whole.batch(1).inputs));
  EXPECT_THROW(BatchSampler(tokens, 16, 3, 0, 2, 7), c10::Error);
}

TEST(TrainGptParts, DefaultCorpusIsDeterministicText) {
  const std::string a = generate_default_corpus(5000, 1);
  EXPECT_EQ(a, generate_default_corpus(5000, 1));
  EXPECT_NE(a, generate_default_corpus(5000, 2));
  EXPECT_GE(a.size(), 5000u);
  EXPECT_LT(a.size(), 5300u);
  const CharVocab vocab(a);
  EXPECT_GT(vocab.size(), 30);
  EXPECT_LT(vocab.size(), 70);
  const auto ids = vocab.encode("The cat.");
  std::string back;
  for (int64_t id : ids) back += vocab.decode(id);
  EXPECT_EQ(back, "The cat.");
  EXPECT_THROW(vocab.encode("~"), std::runtime_error);
}

TEST(TrainGptParts, CorpusSplitAndTooShortText) {
  const Corpus c = load_corpus("", 10000, 0.1, 32, 1);
  EXPECT_EQ(c.train.numel() + c.val.numel(), c.chars);
  EXPECT_EQ(c.val.numel(), static_cast<int64_t>(c.chars * 0.1));
  EXPECT_THROW(load_corpus("", 1000, 0.1, 200, 1), std::runtime_error);
  EXPECT_THROW(load_corpus("/no/such/file.txt", 0, 0.1, 8, 1), std::runtime_error);
}

TEST(TrainGptParts, LearningRateWarmsUpThenFollowsACosine) {
  const LrSchedule s{1.0, 0.1, 10, 110};
  EXPECT_DOUBLE_EQ(s.at(0), 0.1);
  EXPECT_DOUBLE_EQ(s.at(4), 0.5);
  EXPECT_DOUBLE_EQ(s.at(9), 1.0);
  EXPECT_DOUBLE_EQ(s.at(10), 1.0);
  EXPECT_NEAR(s.at(59), 0.55, 0.01);  // half-way through the decay
  EXPECT_DOUBLE_EQ(s.at(109), 0.1);
  for (int64_t i = 11; i < 110; ++i) EXPECT_LE(s.at(i), s.at(i - 1));
  EXPECT_DOUBLE_EQ((LrSchedule{1.0, 0.1, 0, 1}).at(0), 1.0);
}

TEST(TrainGptParts, ProgressFormats) {
  EXPECT_EQ(format_bytes(512), "512 B");
  EXPECT_EQ(format_bytes(3 * 1024 * 1024 / 2), "1.5 MiB");
  EXPECT_EQ(format_duration(65), "1:05");
  EXPECT_EQ(format_duration(3725), "1:02:05");
  EXPECT_EQ(resolve_progress_mode(ProgressMode::kLog), ProgressMode::kLog);
}

}  // namespace
}  // namespace train_gpt
