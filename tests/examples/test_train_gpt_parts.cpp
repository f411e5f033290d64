// The pieces of examples/train_gpt that the end-to-end tests rely on,
// checked directly: the command line's refusals, deterministic batches split
// over ranks, the generated corpus, the vocabulary, the learning-rate
// schedule, the progress formats.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdio>
#include <fstream>
#include <optional>
#include <sstream>

#include "batches.h"
#include "config.h"
#include "corpus.h"
#include "lr_schedule.h"
#include "progress.h"

namespace train_gpt {
namespace {

struct Parsed {
  std::optional<int> code;  ///< What main() returns at once; nullopt: it trains.
  std::string err;          ///< What the parser printed to stderr.
};

// parse_command_line on `args` (words split at spaces), as main() calls it.
Parsed parse(const std::string& args) {
  std::vector<std::string> words{"train_gpt"};
  std::istringstream in(args);
  for (std::string w; in >> w;) words.push_back(w);
  std::vector<char*> argv;
  for (std::string& w : words) argv.push_back(w.data());
  TrainConfig config;
  ::testing::internal::CaptureStderr();
  const std::optional<int> code =
      parse_command_line(static_cast<int>(argv.size()), argv.data(), &config);
  return {code, ::testing::internal::GetCapturedStderr()};
}

// Every refusal of the command line, in this process: TrainGpt's
// BadCommandLineGivesMessageAndNonZeroExit runs train_gpt on one of each
// kind (the parser's, the text's, the prompt's, the metrics folder's).
TEST(TrainGptParts, BadFlagsAreRefusedNamingThem) {
  const std::string tiny = "--layers 1 --d-model 16 --heads 2 --steps 1 ";
  const Parsed good = parse(tiny + "--sharding shard_grad_op");
  EXPECT_EQ(good.code, std::nullopt) << good.err;
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"--no-such-flag 3", "--no-such-flag"},
      {"--layers 0", "--layers"},
      {"--layers many", "--layers"},
      {"--seq-len -5", "--seq-len"},
      {"--lr -1", "--lr"},
      {"--batch-size 0", "--batch-size"},
      {"--d-model 30 --heads 4", "not a multiple of --heads 4"},
      {"--sharding half", "--sharding"},
      {"--progress fancy", "--progress"},
      {"--steps 10 --warmup-steps 50", "exceeds --steps"},
      {"--val-fraction 2", "--val-fraction"},
      {"--resume", "--resume needs --checkpoint-dir"},
      {"--checkpoint-every 5", "--checkpoint-every needs --checkpoint-dir"},
      {"--checkpoint-dir c --checkpoint-type zip", "--checkpoint-type"},
      {"--stop-after 5", "--stop-after 5 exceeds --steps 1"},
      {"--device tpu", "--device"},
      {"--keep-last 2", "--keep-last needs --checkpoint-dir"},
      // Stepping during backward needs host shards and no clipping by a norm
      // that does not exist yet (the default --grad-clip is 1).
      {"--step-during-backward --grad-clip 0", "pass --cpu-offload with it"},
      {"--step-during-backward --cpu-offload", "pass --grad-clip 0 with it"},
      {"--lr -inf", "--lr: "},
      {"--steps nan", "--steps: "},
      {"--keep-last nan", "--keep-last: "},
      {"--warmup-steps inf", "--warmup-steps: "},
  };
  for (const auto& [args, message] : cases) {
    const Parsed p = parse(tiny + args);
    ASSERT_TRUE(p.code.has_value()) << args << ": accepted";
    EXPECT_NE(*p.code, 0) << args << "\n" << p.err;
    EXPECT_NE(p.err.find(message), std::string::npos)
        << args << ": expected a message with '" << message << "', got:\n"
        << p.err;
  }
  const Parsed help = parse("--help");
  EXPECT_EQ(help.code, std::optional<int>(0));
}

TEST(TrainGptParts, NonFiniteNumbersAreRefusedForEveryFlag) {
  for (const char* flag : {"--lr", "--min-lr", "--weight-decay", "--beta1", "--beta2",
                           "--grad-clip", "--val-fraction", "--temperature", "--timeout"}) {
    for (const char* value : {"nan", "inf"}) {
      const Parsed p = parse(std::string("--steps 1 ") + flag + " " + value);
      ASSERT_TRUE(p.code.has_value()) << flag << " " << value << ": accepted";
      EXPECT_NE(*p.code, 0);
      EXPECT_NE(p.err.find(flag), std::string::npos) << flag << " " << value << "\n" << p.err;
      EXPECT_NE(p.err.find("finite"), std::string::npos) << flag << " " << value << "\n" << p.err;
    }
  }
}

// The message load_corpus's refusal carries (main() prints it).
std::string corpus_error(const std::string& path, int64_t seq_len) {
  try {
    load_corpus(path, 0, 0.1, seq_len, 1);
  } catch (const std::runtime_error& e) {
    return e.what();
  }
  return "accepted";
}

TEST(TrainGptParts, UnusableTextIsRefusedNamingTheFile) {
  const std::string dir = ::testing::TempDir();
  const std::string short_text = dir + "train_gpt_short.txt", empty = dir + "train_gpt_empty.txt";
  std::ofstream(short_text) << "A short text, far shorter than the sequence length.\n";
  std::ofstream{empty};
  EXPECT_NE(corpus_error(dir + "missing.txt", 8).find("missing.txt"), std::string::npos);
  EXPECT_NE(corpus_error(short_text, 64).find("--seq-len 64 needs at least 65 characters"),
            std::string::npos)
      << corpus_error(short_text, 64);
  EXPECT_NE(corpus_error(empty, 8).find("is empty"), std::string::npos) << corpus_error(empty, 8);
  std::remove(short_text.c_str());
  std::remove(empty.c_str());
}

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
