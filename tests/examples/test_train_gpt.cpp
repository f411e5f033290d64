// examples/train_gpt end to end: a tiny model trains at 2 ranks and its loss
// falls; 1 rank with global batch B follows the same loss curve as 2 ranks
// with B/2 each; bad command lines end with a message and a non-zero exit.

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <nlohmann/json.hpp>

#include <cstdio>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "launch_test_util.h"
#include "train_gpt_test_util.h"

namespace {

using fsdp::launch::testing::run_launcher;
using fsdp::launch::testing::RunResult;
using train_gpt_test::fresh_dir;
using train_gpt_test::Outcome;
using train_gpt_test::remove_dir;
using train_gpt_test::run_direct;

// A tiny model: a few seconds for a few dozen steps at 2 ranks.
std::vector<std::string> tiny_run(const std::string& metrics_dir) {
  return {"--layers",       "2",        "--d-model",       "32", "--heads",        "2",
          "--seq-len",      "32",       "--batch-size",    "8",  "--corpus-chars", "20000",
          "--eval-batches", "2",        "--sample-tokens", "40", "--progress",     "log",
          "--metrics-dir",  metrics_dir};
}

// tiny_run for `steps` steps after `warmup`, with no evaluation or sample
// before the end: the runs whose losses are compared.
std::vector<std::string> short_run(const std::string& metrics_dir, int steps, int warmup) {
  auto args = tiny_run(metrics_dir);
  for (const std::string& a :
       {std::string("--steps"), std::to_string(steps), std::string("--warmup-steps"),
        std::to_string(warmup), std::string("--eval-interval"), std::string("100"),
        std::string("--sample-tokens"), std::string("0")}) {
    args.push_back(a);
  }
  return args;
}

std::vector<std::string> launch(int ranks, std::vector<std::string> train_args) {
  std::vector<std::string> args = {"--nproc-per-node", std::to_string(ranks), TRAIN_GPT_PATH};
  args.insert(args.end(), train_args.begin(), train_args.end());
  return args;
}

std::vector<nlohmann::json> read_jsonl(const std::string& path, const std::string& type) {
  std::ifstream in(path);
  EXPECT_TRUE(in) << "no metrics file " << path;
  std::vector<nlohmann::json> out;
  for (std::string line; std::getline(in, line);) {
    auto record = nlohmann::json::parse(line);
    if (record.at("type") == type) out.push_back(record);
  }
  return out;
}

std::vector<double> losses(const std::string& path) {
  std::vector<double> out;
  for (const auto& r : read_jsonl(path, "train")) out.push_back(r.at("loss").get<double>());
  return out;
}

void expect_success(const RunResult& r) {
  ASSERT_FALSE(r.timed_out) << r.out << r.err;
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
}

TEST(TrainGpt, LossFallsAtTwoRanks) {
  const std::string dir = fresh_dir("falls");
  auto args = tiny_run(dir);
  for (const char* a : {"--steps", "40", "--warmup-steps", "4", "--lr", "1e-2", "--min-lr", "1e-3",
                        "--eval-interval", "20"}) {
    args.push_back(a);
  }
  const RunResult r = run_launcher(launch(2, args), {}, std::chrono::seconds(120));
  expect_success(r);

  const auto loss0 = losses(dir + "/rank0.jsonl");
  const auto loss1 = losses(dir + "/rank1.jsonl");
  ASSERT_EQ(loss0.size(), 40u);
  // The reported loss is the mean over all ranks: the same on both.
  EXPECT_EQ(loss0, loss1);
  // From about ln(vocab) to well below it.
  double tail = 0;
  for (size_t i = loss0.size() - 5; i < loss0.size(); ++i) tail += loss0[i] / 5;
  EXPECT_GT(loss0.front(), 3.0);
  EXPECT_LT(tail, 0.75 * loss0.front()) << "loss " << loss0.front() << " -> " << tail;

  // Ranks trained on different rows.
  const auto train0 = read_jsonl(dir + "/rank0.jsonl", "train");
  const auto train1 = read_jsonl(dir + "/rank1.jsonl", "train");
  EXPECT_NE(train0[0].at("local_loss"), train1[0].at("local_loss"));
  EXPECT_GT(train0[0].at("peak_bytes").get<int64_t>(), 0);

  // Held-out loss at steps 20 and 40, falling.
  const auto evals = read_jsonl(dir + "/rank0.jsonl", "eval");
  ASSERT_EQ(evals.size(), 2u);
  EXPECT_LT(evals[1].at("val_loss").get<double>(), 0.8 * loss0.front());

  // The sample: the prompt and 40 characters, printed by rank 0 only.
  const auto summary = read_jsonl(dir + "/rank0.jsonl", "summary");
  ASSERT_EQ(summary.size(), 1u);
  const std::string sample = summary[0].at("sample");
  EXPECT_EQ(sample.size(), 4u + 40u);
  EXPECT_EQ(sample.rfind("The ", 0), 0u);
  EXPECT_NE(r.out.find("[rank0]: sample"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("[rank1]: sample"), std::string::npos) << r.out;
  EXPECT_EQ(read_jsonl(dir + "/rank1.jsonl", "summary")[0].at("sample"), sample);
  remove_dir(dir);
}

TEST(TrainGpt, OneRankWithBatchBMatchesTwoRanksWithHalf) {
  const std::string one = fresh_dir("one"), two = fresh_dir("two");
  auto common = [](const std::string& dir) { return short_run(dir, 15, 3); };
  expect_success(run_launcher(launch(1, common(one)), {}, std::chrono::seconds(120)));
  expect_success(run_launcher(launch(2, common(two)), {}, std::chrono::seconds(120)));
  const auto a = losses(one + "/rank0.jsonl");
  const auto b = losses(two + "/rank0.jsonl");
  ASSERT_EQ(a.size(), 15u);
  ASSERT_EQ(b.size(), 15u);
  for (size_t i = 0; i < a.size(); ++i) {
    // fp32 sums in a different order (rows split over ranks, gradients
    // reduce-scattered), nothing more.
    EXPECT_NEAR(a[i], b[i], 1e-5 * a[i]) << "step " << i + 1;
  }
  EXPECT_LT(a.back(), a.front());
  remove_dir(one);
  remove_dir(two);
}

// --cpu-offload: shards, gradients and AdamW state in host memory, stepped by
// libfsdp's fused AdamW: the losses of the run without it, to float rounding.
TEST(TrainGpt, CpuOffloadTrainsAsWithout) {
  const std::string plain = fresh_dir("plain"), offload = fresh_dir("offload");
  auto common = [](const std::string& dir) { return short_run(dir, 10, 2); };
  auto with_offload = common(offload);
  with_offload.push_back("--cpu-offload");
  expect_success(run_launcher(launch(2, common(plain)), {}, std::chrono::seconds(120)));
  expect_success(run_launcher(launch(2, with_offload), {}, std::chrono::seconds(120)));
  const auto a = losses(plain + "/rank0.jsonl");
  const auto b = losses(offload + "/rank0.jsonl");
  ASSERT_EQ(a.size(), 10u);
  ASSERT_EQ(b.size(), 10u);
  for (size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(a[i], b[i], 1e-5 * a[i]) << "step " << i + 1;
  const auto config = read_jsonl(offload + "/rank0.jsonl", "config");
  ASSERT_EQ(config.size(), 1u);
  EXPECT_TRUE(config[0].at("cpu_offload").get<bool>());
  remove_dir(plain);
  remove_dir(offload);
}

// --step-during-backward: each unit's host shard stepped as backward hands
// its gradient over, bit for bit the losses of the step after backward (in
// bf16, so the compute copies are written during backward too), with no
// gradient norm logged, since none exists before the step.
TEST(TrainGpt, StepDuringBackwardTrainsAsAfterIt) {
  const std::string after = fresh_dir("after"), during = fresh_dir("during");
  auto common = [](const std::string& dir) {
    auto args = short_run(dir, 8, 2);
    for (const char* a : {"--cpu-offload", "--bf16", "--grad-clip", "0"}) args.push_back(a);
    return args;
  };
  auto beside = common(during);
  beside.push_back("--step-during-backward");
  expect_success(run_launcher(launch(2, common(after)), {}, std::chrono::seconds(120)));
  const RunResult r = run_launcher(launch(2, beside), {}, std::chrono::seconds(120));
  expect_success(r);
  const auto a = losses(after + "/rank0.jsonl");
  const auto b = losses(during + "/rank0.jsonl");
  ASSERT_EQ(a.size(), 8u);
  ASSERT_EQ(b.size(), 8u);
  for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(a[i], b[i]) << "step " << i + 1;
  EXPECT_LT(b.back(), b.front());
  for (const auto& rec : read_jsonl(during + "/rank0.jsonl", "train")) {
    EXPECT_TRUE(rec.at("grad_norm").is_null()) << rec.dump();
  }
  for (const auto& rec : read_jsonl(after + "/rank0.jsonl", "train")) {
    EXPECT_TRUE(rec.at("grad_norm").is_number()) << rec.dump();
  }
  // As the optimizer reports itself, not as the flag asked.
  EXPECT_EQ(read_jsonl(during + "/rank0.jsonl", "config").at(0).at("optimizer"),
            "fsdp::optim::FusedAdamW, stepping during backward");
  EXPECT_EQ(read_jsonl(after + "/rank0.jsonl", "config").at(0).at("optimizer"),
            "fsdp::optim::FusedAdamW");
  EXPECT_EQ(r.out.find("grad_norm"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("step 8/8 loss"), std::string::npos) << r.out;
  remove_dir(after);
  remove_dir(during);
}

// Losses by step from a metrics file.
std::map<int64_t, double> losses_by_step(const std::string& path) {
  std::map<int64_t, double> out;
  for (const auto& r : read_jsonl(path, "train")) {
    out[r.at("step").get<int64_t>()] = r.at("loss").get<double>();
  }
  return out;
}

// A run stopped after step 10 (its last checkpoint at step 8) and resumed
// with --resume logs, for steps 9..20, exactly the losses of the run that was
// never stopped: the checkpoint holds model, AdamW moments, RNG and the data
// position. Once in fp32 with sharded checkpoints, once in bf16 with full
// ones, once offloaded in bf16 with AdamW stepping during backward (its
// state saved after step(), as it must be).
struct ResumeCase {
  // fp32, bf16, or bf16_offload_during (bf16 with --cpu-offload --step-during-backward)
  const char* precision;
  const char* type;  // --checkpoint-type
};
// Names the case in ctest's listing (instead of two pointers).
void PrintTo(const ResumeCase& c, std::ostream* os) { *os << c.precision << "_" << c.type; }

class TrainGptResume : public ::testing::TestWithParam<ResumeCase> {};

TEST_P(TrainGptResume, StoppedAndResumedRunLogsTheSameLosses) {
  const auto [precision, type] = GetParam();
  const std::string tag = std::string(precision) + "_" + type;
  const std::string whole = fresh_dir("whole_" + tag), part = fresh_dir("part_" + tag),
                    resumed = fresh_dir("resumed_" + tag), ckpt = fresh_dir("ckpt_" + tag),
                    ckpt_whole = fresh_dir("ckpt_whole_" + tag);
  auto args = [&](const std::string& metrics, const std::string& ckpt_dir) {
    auto a = tiny_run(metrics);
    for (const char* x :
         {"--steps", "20", "--warmup-steps", "3", "--lr", "1e-2", "--eval-interval", "5",
          "--sample-tokens", "20", "--checkpoint-every", "8", "--checkpoint-type", type}) {
      a.push_back(x);
    }
    a.push_back("--checkpoint-dir");
    a.push_back(ckpt_dir);
    if (std::string(precision) != "fp32") a.push_back("--bf16");
    if (std::string(precision) == "bf16_offload_during") {
      for (const char* x : {"--cpu-offload", "--step-during-backward", "--grad-clip", "0"}) {
        a.push_back(x);
      }
    }
    return a;
  };
  expect_success(run_launcher(launch(2, args(whole, ckpt_whole)), {}, std::chrono::seconds(120)));
  auto stopped = args(part, ckpt);
  stopped.insert(stopped.end(), {"--stop-after", "10"});
  const RunResult first = run_launcher(launch(2, stopped), {}, std::chrono::seconds(120));
  expect_success(first);
  EXPECT_NE(first.out.find("stopping after step 10"), std::string::npos) << first.out;
  EXPECT_TRUE(fsdp::detail::path_exists(ckpt + "/step-0000000008")) << "no checkpoint at step 8";
  EXPECT_FALSE(fsdp::detail::path_exists(ckpt + "/step-0000000010"))
      << "a checkpoint at step 10 (not every 8)";
  auto again = args(resumed, ckpt);
  again.push_back("--resume");
  const RunResult second = run_launcher(launch(2, again), {}, std::chrono::seconds(120));
  expect_success(second);
  EXPECT_NE(second.out.find("at step 8"), std::string::npos) << second.out;

  const auto expected = losses_by_step(whole + "/rank0.jsonl");
  ASSERT_EQ(expected.size(), 20u);
  EXPECT_LT(expected.at(20), 0.8 * expected.at(1)) << precision << " training did not learn";
  const auto before = losses_by_step(part + "/rank0.jsonl");
  ASSERT_EQ(before.size(), 10u);
  for (const auto& [step, loss] : before) EXPECT_EQ(loss, expected.at(step)) << "step " << step;
  for (const char* rank : {"rank0.jsonl", "rank1.jsonl"}) {
    const auto after = losses_by_step(resumed + "/" + rank);
    ASSERT_EQ(after.size(), 12u) << rank;
    EXPECT_EQ(after.begin()->first, 9);
    // Bitwise: the same floating-point operations on the same values.
    for (const auto& [step, loss] : after) {
      EXPECT_EQ(loss, expected.at(step)) << rank << " step " << step;
    }
  }
  const auto sample_of = [](const std::string& f) {
    return read_jsonl(f, "summary").at(0).at("sample").get<std::string>();
  };
  EXPECT_EQ(sample_of(resumed + "/rank0.jsonl"), sample_of(whole + "/rank0.jsonl"));
  EXPECT_EQ(read_jsonl(resumed + "/rank0.jsonl", "summary").at(0).at("state").at("tokens_seen"),
            read_jsonl(whole + "/rank0.jsonl", "summary").at(0).at("state").at("tokens_seen"));

  // Resuming with another seed would silently continue a different run.
  auto other_seed = args(resumed, ckpt);
  other_seed.insert(other_seed.end(), {"--resume", "--seed", "7"});
  const RunResult refused = run_launcher(launch(2, other_seed), {}, std::chrono::seconds(120));
  ASSERT_FALSE(refused.timed_out) << refused.out << refused.err;
  EXPECT_NE(refused.exit_code, 0);
  EXPECT_NE(refused.err.find("was made with --seed 1337, not 7"), std::string::npos) << refused.err;
  for (const auto& d : {whole, part, resumed, ckpt, ckpt_whole}) remove_dir(d);
}

INSTANTIATE_TEST_SUITE_P(TrainGpt, TrainGptResume,
                         ::testing::Values(ResumeCase{"fp32", "sharded"},
                                           ResumeCase{"bf16", "full"},
                                           ResumeCase{"bf16_offload_during", "sharded"}),
                         [](const auto& info) { return ::testing::PrintToString(info.param); });

TEST(TrainGpt, ProgressBarOnATerminalLogLinesOtherwise) {
  const std::string dir = fresh_dir("progress");
  auto args = tiny_run(dir);
  for (const char* a : {"--steps", "5", "--sample-tokens", "0", "--progress", "auto"}) {
    args.push_back(a);
  }
  // Piped (the test reads the output) and no FSDPRUN_STDOUT_TTY: log lines.
  const RunResult piped = run_launcher(launch(1, args), {{"FSDPRUN_STDOUT_TTY", std::nullopt}},
                                       std::chrono::seconds(60));
  expect_success(piped);
  EXPECT_NE(piped.out.find("[rank0]: step 5/5 loss"), std::string::npos) << piped.out;
  EXPECT_EQ(piped.out.find("\x1b["), std::string::npos) << piped.out;
  // What fsdprun sets when its own stdout is a terminal: the bar, redrawn in
  // place (fsdprun prefixes what follows the '\r' too).
  const RunResult tty =
      run_launcher(launch(1, args), {{"FSDPRUN_STDOUT_TTY", "1"}}, std::chrono::seconds(60));
  expect_success(tty);
  EXPECT_NE(tty.out.find("\x1b[1A\x1b[2K\r[rank0]: [########################] 5/5 loss"),
            std::string::npos)
      << tty.out;
  EXPECT_NE(tty.out.find("tok/s | ETA"), std::string::npos) << tty.out;
  remove_dir(dir);
}

TEST(TrainGpt, BadCommandLineGivesMessageAndNonZeroExit) {
  // One refusal of each kind that main() reports: the parser's, the text's,
  // the prompt's, the metrics folder's (after the process group exists).
  // Every flag's refusal is checked in process by TrainGptParts, 0.5-1.5 s
  // of LibTorch loading less per case.
  const std::string dir = fresh_dir("bad");
  const std::string tiny = "--layers 1 --d-model 16 --heads 2 --steps 1 ";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"--no-such-flag 3", "--no-such-flag"},
      {"--data " + (dir + "/missing.txt"), "missing.txt"},
      {"--prompt '~~~'", "--prompt"},
      {"--metrics-dir /proc/no/such/dir", "cannot write metrics file"},
  };
  for (const auto& [args, message] : cases) {
    const Outcome o = run_direct(tiny + args);
    EXPECT_TRUE(o.exited) << args << ": killed by a signal\n" << o.output;
    EXPECT_NE(o.code, 0) << args << "\n" << o.output;
    EXPECT_NE(o.code, 124) << args << ": timed out\n" << o.output;
    EXPECT_NE(o.output.find(message), std::string::npos)
        << args << ": expected a message with '" << message << "', got:\n"
        << o.output;
    EXPECT_EQ(o.output.find("terminate called"), std::string::npos) << args << "\n" << o.output;
  }
  // --device cuda trains on a GPU where there is one, and is a one-line
  // error without (this program does not link LibTorch to ask which).
  const Outcome cuda = run_direct(tiny + "--device cuda --sample-tokens 0");
  if (cuda.output.find("this process sees no CUDA device") != std::string::npos) {
    EXPECT_NE(cuda.code, 0) << cuda.output;
    EXPECT_NE(cuda.output.find("use --device cpu"), std::string::npos) << cuda.output;
  } else {
    EXPECT_EQ(cuda.code, 0) << cuda.output;
    EXPECT_NE(cuda.output.find("on cuda:0"), std::string::npos) << cuda.output;
  }
  const Outcome help = run_direct("--help");
  EXPECT_EQ(help.code, 0) << help.output;
  EXPECT_NE(help.output.find("--seq-len"), std::string::npos) << help.output;
  remove_dir(dir);
}

TEST(TrainGpt, BatchNotDivisibleByRanksIsRefusedOnEveryRank) {
  const RunResult r = run_launcher(
      launch(2, {"--layers", "1", "--d-model", "16", "--heads", "2", "--batch-size", "3"}), {},
      std::chrono::seconds(60));
  ASSERT_FALSE(r.timed_out) << r.out << r.err;
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find("--batch-size 3 cannot be split evenly over 2 ranks"), std::string::npos)
      << r.err;
}

}  // namespace
