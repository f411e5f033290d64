// Checkpoints under faults and hostile input (issue 17): non-regular files
// are refused, not waited on; the completion marker checks itself and its
// step; resume() falls back to the newest checkpoint that verifies; what
// interrupted saves leave is removed; keep_last retention; a full disk.

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <torch/torch.h>
#include <unistd.h>

#include <functional>
#include <optional>
#include <set>

#include <fsdp/fsdp.h>

#include "detail/torch_compat.h"
#include "marker_edit.h"
#include "small_disk.h"
#include "state/checkpoint_dir.h"
#include "state_test_util.h"

namespace fsdp::testing {
namespace test_checkpoint_faults {

// mkdir -p, failing the test when it cannot.
void make_dirs_or_fail(const std::string& path) {
  std::error_code ec;
  detail::make_dirs(path, ec);
  ASSERT_FALSE(ec) << path << ": " << ec.message();
}

int64_t file_size_of(const std::string& path) {
  std::error_code ec;
  const int64_t size = detail::file_size(path, ec);
  EXPECT_FALSE(ec) << path << ": " << ec.message();
  return size;
}

// Expects `fn` to throw an exception whose message contains every needle and
// none of the `absent` ones.
void expect_error(const std::function<void()>& fn, const std::vector<std::string>& needles,
                  const std::vector<std::string>& absent = {}) {
  try {
    fn();
    ADD_FAILURE() << "no error; expected one mentioning " << needles.front();
  } catch (const std::exception& e) {
    const std::string what = e.what();
    for (const auto& n : needles)
      EXPECT_NE(what.find(n), std::string::npos) << "\"" << what << "\" lacks \"" << n << "\"";
    for (const auto& n : absent)
      EXPECT_EQ(what.find(n), std::string::npos) << "\"" << what << "\" has \"" << n << "\"";
  }
}

// A plain model and Adam after two steps; save() and save_step() write it.
struct Trained {
  Net model{false, FSDPOptions()};
  std::unique_ptr<torch::optim::Optimizer> opt;
  explicit Trained(uint64_t seed = 1) {
    torch::manual_seed(seed);
    model = Net(false, FSDPOptions());
    opt = make_optimizer("adam", model->parameters());
    train(*model, *opt, 2);
  }
};

std::string saved_full(const std::string& dir, int64_t step = 2) {
  Trained t;
  Checkpointer(*t.model, t.opt.get()).save(dir, step, StateDictType::kFull);
  return dir;
}

// Loads `dir` into a fresh plain model (what resume and load do).
void load_fresh(const std::string& dir) {
  Trained t(7);
  Checkpointer(*t.model, t.opt.get()).load(dir);
}

TEST(CheckpointFaults, NonRegularFilesAreRefusedNotWaitedOn) {
  const std::string root = test_dir();
  int n = 0;
  // Each case replaces one file of a fresh checkpoint; loading must fail at
  // once (a FIFO used to block the open forever) with an error naming it.
  auto check = [&](const std::string& file, const std::function<void(const std::string&)>& make,
                   const std::vector<std::string>& needles) {
    const std::string dir = saved_full(root + "/c" + std::to_string(n++));
    const std::string path = dir + "/" + file;
    std::error_code ec;
    detail::remove_entry(path, ec);
    make(path);
    std::vector<std::string> all = needles;
    all.insert(all.begin(), path);
    expect_error([&] { verify_checkpoint(dir); }, all);
    expect_error([&] { load_fresh(dir); }, all);
  };
  const auto fifo = [](const std::string& p) { ASSERT_EQ(::mkfifo(p.c_str(), 0644), 0); };
  check("model.safetensors", fifo, {"is a FIFO, not a regular file"});
  check("rank0.json", fifo, {"is a FIFO"});
  check("COMPLETE", fifo, {"is a FIFO"});
  check("optim.safetensors", [](const std::string& p) { ASSERT_EQ(::mkdir(p.c_str(), 0755), 0); },
        {"is a directory, not a regular file"});
  check("model.safetensors",
        [](const std::string& p) { ASSERT_EQ(::symlink("/dev/zero", p.c_str()), 0); },
        {"is a character device"});
  check("COMPLETE", [](const std::string& p) { ASSERT_EQ(::symlink(p.c_str(), p.c_str()), 0); },
        {"cannot open", "symbolic links"});
  remove_test_dir(root);
}

TEST(CheckpointFaults, FlippedDigitInTheMarkerBlamesTheMarker) {
  const std::string root = test_dir();
  const std::string dir = saved_full(root + "/c");
  std::string marker = file_bytes(dir + "/COMPLETE");
  const std::string size = std::to_string(file_size_of(dir + "/rank0.json"));
  const auto at = marker.find("\"size\": " + size);
  ASSERT_NE(at, std::string::npos) << marker;
  char& digit = marker[at + 8];
  digit = digit == '9' ? '8' : static_cast<char>(digit + 1);
  put_file_bytes(dir + "/COMPLETE", marker);
  // Used to be "rank0.json: is N bytes, the manifest says M".
  expect_error([&] { verify_checkpoint(dir); }, {dir + "/COMPLETE", "checksum mismatch"},
               {"rank0.json"});
  remove_test_dir(root);
}

// Entries of `dir` whose name starts like a step's ("step-" or ".step-").
size_t entries_named_step(const std::string& dir) {
  std::error_code ec;
  size_t n = 0;
  for (const std::string& name : detail::list_dir(dir, ec)) {
    n += name.rfind("step-", 0) == 0 || name.rfind(".step-", 0) == 0 ? 1 : 0;
  }
  return n;
}

TEST(CheckpointFaults, MarkerStepMustMatchManifestsAndDirectoryName) {
  const std::string root = test_dir();
  // A step-<N> directory whose marker was edited (checksum and all) from 20 to 29.
  const std::string named = saved_full(checkpoint_path(root, 20), 20);
  reseal_marker(named, [](nlohmann::json& j) { j["step"] = 29; });
  expect_error([&] { verify_checkpoint(named); },
               {named + "/COMPLETE", "says step 29", "step-0000000020"});
  // Resume must not load it as step 29 (it used to report "resumed from
  // step-0000000029 at step 20"); it is the only one, so nothing loads.
  Trained t(7);
  expect_error([&] { Checkpointer(*t.model, t.opt.get()).resume(root); },
               {"none of its 1 complete checkpoints verifies", "says step 29"});
  // Another name: the manifests still disagree.
  const std::string other = saved_full(root + "/final", 20);
  reseal_marker(other, [](nlohmann::json& j) { j["step"] = 29; });
  expect_error([&] { verify_checkpoint(other); },
               {other + "/COMPLETE", "says step 29", "rank0.json was saved at step 20"});
  // Saving a step into another step's directory is refused before anything
  // is written (it was written, then refused at load as an edited marker).
  const std::string wrong = checkpoint_path(root, 31);
  expect_error([&] { Checkpointer(*t.model, t.opt.get()).save(wrong + "/", 30); },
               {"step-0000000031", "is named for step 31, not step 30", "save_step(parent, 30)"});
  struct stat st {};
  EXPECT_NE(::stat(wrong.c_str(), &st), 0) << wrong << " was made";
  // A negative step (resume()'s -1 saved as it is): refused, nothing made;
  // its directory was one that resume() and keep_last never saw.
  expect_error([&] { Checkpointer(*t.model, t.opt.get()).save_step(root, -1); },
               {"expected a step of 0 or more to save, got -1", "resume() returns -1"});
  EXPECT_EQ(entries_named_step(root), 1u) << "only step 20's directory";
  remove_test_dir(root);
}

// Three complete checkpoints 10, 20, 30 under root, the plain model's.
void save_steps(const std::string& root, const std::vector<int64_t>& steps,
                CheckpointerOptions options = {}) {
  Trained t;
  Checkpointer ckpt(*t.model, t.opt.get(), options);
  for (int64_t s : steps) ckpt.save_step(root, s);
}

std::set<std::string> entries(const std::string& dir) {
  std::set<std::string> out;
  std::error_code ec;
  for (const std::string& name : detail::list_dir(dir, ec)) out.insert(name);
  return out;
}

TEST(CheckpointFaults, ResumeFallsBackToTheNewestThatVerifies) {
  const std::string root = test_dir();
  save_steps(root, {10, 20, 30});
  const std::string newest = checkpoint_path(root, 30);
  std::string b = file_bytes(newest + "/model-rank0.safetensors");
  b[b.size() - 2] ^= 0x04;
  put_file_bytes(newest + "/model-rank0.safetensors", b);
  Trained t(7);
  std::vector<std::string> warnings;
  {
    compat::WarningCollector collect(&warnings);
    EXPECT_EQ(Checkpointer(*t.model, t.opt.get()).resume(root), 20);
  }
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_NE(warnings[0].find("skipping " + newest), std::string::npos) << warnings[0];
  EXPECT_NE(warnings[0].find("checksum mismatch"), std::string::npos) << warnings[0];
  // The damaged one is kept for inspection.
  EXPECT_TRUE(detail::path_exists(newest + "/COMPLETE"));
  // Nothing verifies: an error, not a silent start from step 0.
  for (int64_t s : {10, 20}) std::remove((checkpoint_path(root, s) + "/rank0.json").c_str());
  expect_error(
      [&] {
        compat::WarningCollector quiet;
        Checkpointer(*t.model, t.opt.get()).resume(root);
      },
      {root, "none of its 3 complete checkpoints verifies", "step-0000000010"});
  remove_test_dir(root);
}

TEST(CheckpointFaults, LeftoversOfInterruptedSavesAreRemoved) {
  const std::string root = test_dir();
  save_steps(root, {10});
  const std::string ten = checkpoint_path(root, 10);
  // What a rank killed while re-saving step 10, then while saving 40, leaves.
  put_file_bytes(ten + "/model-rank1.safetensors.tmp.123456", "partial");
  make_dirs_or_fail(checkpoint_path(root, 40));
  put_file_bytes(checkpoint_path(root, 40) + "/rank0.json", "{}");
  put_file_bytes(checkpoint_path(root, 40) + "/optim-rank0.safetensors.tmp.99", "partial");
  put_file_bytes(root + "/notes.tmp.1", "not under a step directory: not ours");
  {
    Trained t(7);
    EXPECT_EQ(Checkpointer(*t.model, t.opt.get()).resume(root), 10);
  }
  EXPECT_EQ(entries(root), (std::set<std::string>{"step-0000000010", "notes.tmp.1"}));
  EXPECT_EQ(entries(ten),
            (std::set<std::string>{"COMPLETE", "rank0.json", "model-rank0.safetensors",
                                   "optim-rank0.safetensors"}));
  verify_checkpoint(ten);
  // The next save removes them too, and a save into a directory first clears
  // the temporaries in it.
  put_file_bytes(ten + "/model-rank0.safetensors.tmp.77", "partial");
  make_dirs_or_fail(checkpoint_path(root, 60));
  make_dirs_or_fail(checkpoint_path(root, 20));
  put_file_bytes(checkpoint_path(root, 20) + "/rank3.json.tmp.5", "partial");
  save_steps(root, {20});
  EXPECT_EQ(entries(root),
            (std::set<std::string>{"step-0000000010", "step-0000000020", "notes.tmp.1"}));
  EXPECT_EQ(entries(ten).count("model-rank0.safetensors.tmp.77"), 0u);
  EXPECT_EQ(entries(checkpoint_path(root, 20)).count("rank3.json.tmp.5"), 0u);
  remove_test_dir(root);
}

TEST(CheckpointFaults, KeepLastRemovesOlderCheckpointsButNotTheResumedOne) {
  const std::string root = test_dir();
  save_steps(root, {10, 20, 30, 40, 50}, CheckpointerOptions().keep_last(2));
  EXPECT_EQ(entries(root), (std::set<std::string>{"step-0000000040", "step-0000000050"}));
  {
    Trained t(7);
    Checkpointer ckpt(*t.model, t.opt.get(), CheckpointerOptions().keep_last(1));
    EXPECT_EQ(ckpt.resume(root), 50);  // applies keep_last too
    EXPECT_EQ(entries(root), (std::set<std::string>{"step-0000000050"}));
    ckpt.save_step(root, 60);
    ckpt.save_step(root + "/", 70);  // another spelling of the same parent
    EXPECT_EQ(entries(root), (std::set<std::string>{"step-0000000050", "step-0000000070"}));
  }
  Trained t(7);
  EXPECT_THROW(Checkpointer(*t.model, t.opt.get(), CheckpointerOptions().keep_last(-1)),
               c10::Error);
  // A resume that cannot load (another model) removes nothing: a review
  // found keep_last applied before the load.
  torch::nn::Linear other(3, 3);
  torch::optim::Adam other_opt(other->parameters());
  EXPECT_THROW(Checkpointer(*other, &other_opt, CheckpointerOptions().keep_last(1)).resume(root),
               c10::Error);
  EXPECT_EQ(entries(root), (std::set<std::string>{"step-0000000050", "step-0000000070"}));
  {
    // Resumed through a link, saved beside by the real path: the same
    // directory, kept (compared by name, a review found it removed).
    const std::string link = root + "-link";
    ASSERT_EQ(::symlink(root.c_str(), link.c_str()), 0);
    Trained again(7);
    Checkpointer ckpt(*again.model, again.opt.get(), CheckpointerOptions().keep_last(1));
    EXPECT_EQ(ckpt.resume(link), 70);
    ckpt.save_step(root, 80);
    EXPECT_EQ(entries(root), (std::set<std::string>{"step-0000000070", "step-0000000080"}));
    ::unlink(link.c_str());
  }
  remove_test_dir(root);
  // Steps of more than ten digits (tokens seen) are found and kept too: a
  // review found them saved but never resumed nor counted.
  const std::string wide = test_dir();
  save_steps(wide, {9'999'999'999, 12'000'000'000, 30'000'000'000},
             CheckpointerOptions().keep_last(2));
  EXPECT_EQ(entries(wide), (std::set<std::string>{"step-12000000000", "step-30000000000"}));
  EXPECT_EQ(Checkpointer(*t.model, t.opt.get()).resume(wide), 30'000'000'000);
  remove_test_dir(wide);
}

// A run rolled back (load() of an earlier step after a loss spike) saves
// steps below the abandoned run's checkpoints. keep_last counted those: each
// save removed the one before it and the step loaded, the abandoned ones
// stayed, and resume() would pick them (a review found it). Now they are
// left alone, out of the count, and named in a warning; the step loaded is
// kept (Note [Checkpoints of a run rolled back]).
TEST(CheckpointFaults, ARolledBackRunKeepsItsCheckpointsAndIsWarnedOfLaterOnes) {
  const std::string root = test_dir();
  save_steps(root, {800, 900, 1000});
  Trained t(7);
  Checkpointer ckpt(*t.model, t.opt.get(), CheckpointerOptions().keep_last(2));
  EXPECT_EQ(ckpt.load(checkpoint_path(root, 800)), 800);
  std::vector<std::string> warnings;
  {
    compat::WarningCollector collect(&warnings);
    ckpt.save_step(root, 850);
  }
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_NE(warnings[0].find("saved step 850 beside complete checkpoints of later steps (" +
                             checkpoint_path(root, 1000) + ", " + checkpoint_path(root, 900)),
            std::string::npos)
      << warnings[0];
  {
    compat::WarningCollector quiet;
    ckpt.save_step(root, 860);
    ckpt.save_step(root, 870);
  }
  EXPECT_EQ(entries(root),
            (std::set<std::string>{"step-0000000800", "step-0000000860", "step-0000000870",
                                   "step-0000000900", "step-0000001000"}));
  remove_test_dir(root);
}

// The rolled-back run crashes after saving 850 and 860, and fsdprun's
// restart resumes (Note [Checkpoints saved last]): it loads 860, what the
// run saved last, not the abandoned 1000 (which it used to, its retention
// then removing 850 and 860); keep_last(2) counts 860 and 850 and leaves the
// later steps alone. A save after that resume keeps the order.
TEST(CheckpointFaults, ResumeAfterARollBackLoadsWhatItSavedLast) {
  const std::string root = test_dir();
  save_steps(root, {800, 900, 1000});
  const auto options = CheckpointerOptions().keep_last(2);
  torch::OrderedDict<std::string, torch::Tensor> at_860;
  {
    Trained t(7);
    Checkpointer ckpt(*t.model, t.opt.get(), options);
    ckpt.load(checkpoint_path(root, 800));
    compat::WarningCollector quiet;
    ckpt.save_step(root, 850);
    train(*t.model, *t.opt, 1);  // the run goes on: 860 differs from 850
    ckpt.save_step(root, 860);
    at_860 = full_state_dict(*t.model);
  }
  EXPECT_EQ(latest_checkpoint(root), checkpoint_path(root, 860));
  Trained restarted(9);
  Checkpointer ckpt(*restarted.model, restarted.opt.get(), options);
  EXPECT_EQ(ckpt.resume(root), 860);
  expect_bitwise_equal(full_state_dict(*restarted.model), at_860, "resumed");
  EXPECT_EQ(entries(root), (std::set<std::string>{"step-0000000850", "step-0000000860",
                                                  "step-0000000900", "step-0000001000"}));
  {
    compat::WarningCollector quiet;
    ckpt.save_step(root, 861);
  }
  EXPECT_EQ(latest_checkpoint(root), checkpoint_path(root, 861));
  EXPECT_EQ(entries(root), (std::set<std::string>{"step-0000000860", "step-0000000861",
                                                  "step-0000000900", "step-0000001000"}));
  remove_test_dir(root);
}

// 256x256 weights and Adam's two moments (~0.8 MB a checkpoint), one step taken.
struct LinearAndAdam {
  torch::nn::Linear model = (torch::manual_seed(0), torch::nn::Linear(256, 256));
  torch::optim::Adam opt{model->parameters(), torch::optim::AdamOptions(1e-3)};
  LinearAndAdam() { step(); }
  void step() {
    opt.zero_grad();
    model->forward(torch::randn({4, 256})).sum().backward();
    opt.step();
  }
};

TEST(CheckpointFaults, FullDiskFailsTheSaveNamingTheFileAndKeepsEarlierCheckpoints) {
  SmallDisk disk("2m");
  if (!disk.ok()) GTEST_SKIP() << disk.why_not();
  LinearAndAdam trained;
  auto& [model, opt] = trained;
  Checkpointer ckpt(*model, &opt);
  std::string error;
  int64_t saved = 0;
  for (int64_t s = 1; s <= 5 && error.empty(); ++s) {
    try {
      ckpt.save_step(disk.path(), s);
      saved = s;
    } catch (const CheckpointError& e) {
      error = e.what();
    }
  }
  ASSERT_FALSE(error.empty()) << "five checkpoints fit in 2 MiB?";
  ASSERT_GE(saved, 1);
  const std::string failed = checkpoint_path(disk.path(), saved + 1);
  // Written beside its place (Note [Saving beside the checkpoint]).
  EXPECT_NE(error.find(disk.path() + "/" + detail::staging_name(saved + 1) + "/"),
            std::string::npos)
      << error;
  EXPECT_NE(error.find("No space left on device"), std::string::npos) << error;
  // The failed directory and every temporary are gone; the earlier ones load.
  for (const std::string& path : detail::walk_tree(disk.path())) {
    EXPECT_EQ(path.find(".tmp."), std::string::npos) << path;
  }
  EXPECT_FALSE(detail::path_exists(failed));
  for (int64_t s = 1; s <= saved; ++s) verify_checkpoint(checkpoint_path(disk.path(), s));
  torch::nn::Linear other(256, 256);
  torch::optim::Adam other_opt(other->parameters(), torch::optim::AdamOptions(1e-3));
  EXPECT_EQ(Checkpointer(*other, &other_opt).resume(disk.path()), saved);
  EXPECT_TRUE(torch::equal(other->weight, model->weight));
  // With retention the same disk holds a checkpoint every step (room for
  // two: the new one is complete before the old one goes).
  for (int64_t s = 1; s < saved; ++s) {
    std::error_code ec;
    detail::remove_tree(checkpoint_path(disk.path(), s), ec);
  }
  Checkpointer kept(*model, &opt, CheckpointerOptions().keep_last(1));
  for (int64_t s = saved + 1; s <= saved + 6; ++s) {
    trained.step();
    kept.save_step(disk.path(), s);
  }
  EXPECT_EQ(entries(disk.path()).size(), 1u);
}

// A loop that saves at the top of the step it resumed from saves that step
// again. If that save fails (here the disk is full), the checkpoint already
// there stays whole and loads (Note [Saving beside the checkpoint]); once the
// disk has room, the new save replaces it.
TEST(CheckpointFaults, AFailedSaveKeepsTheCheckpointOfTheSameStep) {
  SmallDisk disk("2m");
  if (!disk.ok()) GTEST_SKIP() << disk.why_not();
  LinearAndAdam trained;
  auto& [model, opt] = trained;
  Checkpointer ckpt(*model, &opt);
  const std::string path = ckpt.save_step(disk.path(), 7);
  const torch::Tensor first = model->weight.detach().clone();
  trained.step();
  // Leave the disk ~0.25 MB: too little for a second checkpoint.
  const std::string filler = disk.path() + "/filler";
  put_file_bytes(filler, std::string(static_cast<size_t>(1) << 20, 'x'));
  EXPECT_THROW(ckpt.save_step(disk.path(), 7), CheckpointError);
  verify_checkpoint(path);
  EXPECT_EQ(entries(disk.path()), (std::set<std::string>{"step-0000000007", "filler"}));
  torch::nn::Linear other(256, 256);
  torch::optim::Adam other_opt(other->parameters(), torch::optim::AdamOptions(1e-3));
  EXPECT_EQ(Checkpointer(*other, &other_opt).resume(disk.path()), 7);
  EXPECT_TRUE(torch::equal(other->weight, first));
  ::unlink(filler.c_str());
  EXPECT_EQ(ckpt.save_step(disk.path(), 7), path);
  EXPECT_EQ(entries(disk.path()), (std::set<std::string>{"step-0000000007"}));
  EXPECT_EQ(Checkpointer(*other, &other_opt).resume(disk.path()), 7);
  EXPECT_TRUE(torch::equal(other->weight, model->weight));
  EXPECT_FALSE(torch::equal(other->weight, first));
}

// Where directories cannot be exchanged (NFS), saving a step that exists
// moves the old checkpoint aside (step-N.replaced), then the new one in
// (.step-N.saving -> step-N). A job killed between the two renames left no
// step-N: resume() found nothing to resume and removed both complete copies
// (a review found it). Now the new one is put back, else the old one (Note
// [A replacement cut short]).
TEST(CheckpointFaults, AReplacementCutShortBetweenItsRenamesIsResumed) {
  const std::string root = test_dir();
  LinearAndAdam trained;
  auto& [model, opt] = trained;
  Checkpointer ckpt(*model, &opt);
  const std::string path = ckpt.save_step(root, 7);
  const torch::Tensor first = model->weight.detach().clone();
  trained.step();
  ckpt.save_step(root + "/elsewhere", 7);  // the new save, complete
  const auto renamed = [](const std::string& from, const std::string& to) {
    ASSERT_EQ(std::rename(from.c_str(), to.c_str()), 0) << from << " -> " << to;
  };
  renamed(path, path + ".replaced");
  renamed(checkpoint_path(root + "/elsewhere", 7), root + "/" + detail::staging_name(7));
  std::error_code ec;
  detail::remove_tree(root + "/elsewhere", ec);
  torch::nn::Linear other(256, 256);
  torch::optim::Adam other_opt(other->parameters(), torch::optim::AdamOptions(1e-3));
  {
    compat::WarningCollector quiet;
    EXPECT_EQ(Checkpointer(*other, &other_opt).resume(root), 7);
  }
  EXPECT_TRUE(torch::equal(other->weight, model->weight)) << "not the newer save";
  EXPECT_EQ(entries(root), (std::set<std::string>{"step-0000000007"}));
  // Cut short with the new one incomplete (no marker): the old one is back,
  // and the torn one is removed.
  renamed(path, path + ".replaced");
  const std::string torn = root + "/" + detail::staging_name(7);
  make_dirs_or_fail(torn);
  put_file_bytes(torn + "/model-rank0.safetensors", "partial");
  torch::nn::Linear third(256, 256);
  torch::optim::Adam third_opt(third->parameters(), torch::optim::AdamOptions(1e-3));
  {
    compat::WarningCollector quiet;
    EXPECT_EQ(Checkpointer(*third, &third_opt).resume(root), 7);
  }
  EXPECT_TRUE(torch::equal(third->weight, model->weight));
  EXPECT_FALSE(torch::equal(third->weight, first));
  EXPECT_EQ(entries(root), (std::set<std::string>{"step-0000000007"}));
  // Cut short again, and the next save (step 8) comes before any resume:
  // its place among the saves counts the new copy still under its staging
  // name (Note [Checkpoints saved last]), so step 8 stays the one saved
  // last once the copy is put back.
  trained.step();
  // Third among the saves where it was made: above the one it replaces.
  for (int64_t s : {5, 6, 7}) ckpt.save_step(root + "/elsewhere", s);
  renamed(path, path + ".replaced");
  renamed(checkpoint_path(root + "/elsewhere", 7), root + "/" + detail::staging_name(7));
  detail::remove_tree(root + "/elsewhere", ec);
  {
    compat::WarningCollector quiet;
    ckpt.save_step(root, 8);
  }
  EXPECT_EQ(latest_checkpoint(root), checkpoint_path(root, 8));
  EXPECT_EQ(entries(root), (std::set<std::string>{"step-0000000007", "step-0000000008"}));
  remove_test_dir(root);
}

// A marker damaged in place (a flipped byte: its checksum fails) has no
// place among the saves: resume() tries it first, as the newest by step,
// warns and skips it; keep_last leaves it alone, uncounted (removing it is
// the user's call), and removes the others beyond it (step 10; step 20 is
// the one resumed from).
TEST(CheckpointFaults, ADamagedMarkerIsSkippedAndLeftAlone) {
  const std::string root = test_dir();
  save_steps(root, {10, 20, 30});
  const std::string damaged = checkpoint_path(root, 30) + "/COMPLETE";
  std::string m = file_bytes(damaged);
  m[m.find("\"step\"")] = '\'';
  put_file_bytes(damaged, m);
  Trained t(7);
  Checkpointer ckpt(*t.model, t.opt.get(), CheckpointerOptions().keep_last(1));
  std::vector<std::string> warnings;
  {
    compat::WarningCollector collect(&warnings);
    EXPECT_EQ(ckpt.resume(root), 20);
  }
  ASSERT_GE(warnings.size(), 1u);
  EXPECT_NE(warnings[0].find("skipping " + checkpoint_path(root, 30)), std::string::npos)
      << warnings[0];
  {
    compat::WarningCollector quiet;
    ckpt.save_step(root, 40);
  }
  EXPECT_EQ(entries(root),
            (std::set<std::string>{"step-0000000020", "step-0000000030", "step-0000000040"}));
  EXPECT_EQ(latest_checkpoint(root), checkpoint_path(root, 40));
  remove_test_dir(root);
}

// At `ranks` ranks (CKPT_TEST_DIR `dir`): a model trained 2 steps with Adam,
// each rank on its own data, and its Checkpointer, given to `fn` with the
// rank.
void with_trained_ranks(const std::string& dir, const std::function<void(Checkpointer&, int)>& fn,
                        int ranks = 2) {
  run_ranks_ok(
      ranks,
      [&](int rank, int) {
        init_process_group(ProcessGroupOptions().timeout(std::chrono::seconds(20)));
        auto model = make_model(FSDPOptions());
        auto opt = make_optimizer("adam", model->parameters());
        torch::manual_seed(3 + rank);
        train(*model, *opt, 2);
        Checkpointer ckpt(*model, opt.get());
        fn(ckpt, rank);
      },
      with_dir(dir));
}

// Two ranks, sharded: rank 0 decides, both load the same earlier checkpoint,
// and only rank 0 says what it skipped.
TEST(CheckpointFaults, EveryRankFallsBackToTheSameCheckpoint) {
  const std::string dir = test_dir();
  const auto body = [&](const std::function<void(Checkpointer&, int)>& fn) {
    with_trained_ranks(dir, fn);
  };
  body([&](Checkpointer& ckpt, int) {
    ckpt.save_step(dir, 6);
    ckpt.save_step(dir, 12);
  });
  if (!is_rank_process()) {
    // Damage a file only rank 1 wrote and reads: rank 1 finds it, and every
    // rank skips the checkpoint (rank 0 verified every rank's files alone,
    // which took longer than the collective timeout on large checkpoints).
    const std::string f = checkpoint_path(dir, 12) + "/optim-rank1.safetensors";
    std::string b = file_bytes(f);
    b[b.size() - 1] ^= 0x01;
    put_file_bytes(f, b);
  }
  body([&](Checkpointer& ckpt, int rank) {
    std::vector<std::string> warnings;
    {
      compat::WarningCollector collect(&warnings);
      EXPECT_EQ(ckpt.resume(dir), 6);
    }
    ASSERT_EQ(warnings.size(), 1u);
    const std::string step12 = checkpoint_path(dir, 12);
    if (rank == 1) {
      // The one prefix, once: the quoted error keeps only its file and problem.
      EXPECT_EQ(warnings[0].rfind("[rank 1] fsdp(" + dir + "): skipping " + step12 +
                                      ", it does not verify: " + step12 +
                                      "/optim-rank1.safetensors: checksum mismatch",
                                  0),
                0u)
          << warnings[0];
      EXPECT_EQ(warnings[0].find("fsdp(", warnings[0].find("fsdp(") + 1), std::string::npos)
          << warnings[0];
    } else {
      EXPECT_EQ(warnings[0].rfind("[rank 0] fsdp(" + dir + "): skipping " + step12 +
                                      ", it does not verify on rank(s) 1 (see their warnings)",
                                  0),
                0u)
          << warnings[0];
    }
  });
  remove_test_dir(dir);
}

// While alive, every open() of this process fails with EMFILE: the soft
// open-file limit at the lowest free descriptor (those open above it stay
// usable: the ranks' connections).
class NoFreeDescriptors {
 public:
  // `spare`: descriptors still free below the limit.
  explicit NoFreeDescriptors(int spare = 0) {
    EXPECT_EQ(::getrlimit(RLIMIT_NOFILE, &saved_), 0);
    const int lowest = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
    EXPECT_GE(lowest, 0);
    ::close(lowest);
    rlimit tight = saved_;
    tight.rlim_cur = static_cast<rlim_t>(lowest + spare);
    EXPECT_EQ(::setrlimit(RLIMIT_NOFILE, &tight), 0);
  }
  ~NoFreeDescriptors() { ::setrlimit(RLIMIT_NOFILE, &saved_); }
  NoFreeDescriptors(const NoFreeDescriptors&) = delete;
  NoFreeDescriptors& operator=(const NoFreeDescriptors&) = delete;

 private:
  rlimit saved_{};
};

// A rank that cannot open a checkpoint's files for a reason of its own (the
// open-file limit; also permissions) makes resume() fail on every rank,
// naming the limit, with nothing loaded: rank 1 reading its files, and rank
// 0 listing the checkpoints. Taken for damage, it
// made every rank skip the newest checkpoint and resume an older one, losing the steps since with a
// warning. With the limit raised, the newest resumes.
TEST(CheckpointFaults, AFileARankCannotOpenIsAnErrorNotDamage) {
  const std::string dir = test_dir();
  with_trained_ranks(dir, [&](Checkpointer& ckpt, int rank) {
    ckpt.save_step(dir, 6);
    ckpt.save_step(dir, 12);
    for (int limited : {1, 0}) {
      std::vector<std::string> warnings;
      {
        compat::WarningCollector collect(&warnings);
        std::optional<NoFreeDescriptors> none;
        if (rank == limited) none.emplace();
        const std::vector<std::string> needles =
            rank == limited ? std::vector<std::string>{"Too many open files", "ulimit -n"}
            : limited == 1  ? std::vector<std::string>{"rank(s) 1 failed while verifying it"}
                            : std::vector<std::string>{"rank 0 could not choose a checkpoint"};
        expect_error([&] { ckpt.resume(dir); }, needles);
      }
      EXPECT_TRUE(warnings.empty()) << "rank " << limited << " limited: " << warnings[0];
    }
    {
      // One descriptor free is enough (Note [A reader's open files]: the
      // reader lets its own go where it runs short).
      NoFreeDescriptors one(/*spare=*/1);
      EXPECT_EQ(ckpt.resume(dir), 12);
    }
    EXPECT_EQ(ckpt.resume(dir), 12);
  });
  remove_test_dir(dir);
}

// Note [A reader's open files]: a checkpoint of 4 ranks (8 data files)
// loads with 6 descriptors free (at world 1, reading every rank's files):
// the reader held every data file open, two per saving rank, which at 512
// ranks took every rank past the usual limit of 1024.
TEST(CheckpointFaults, AReaderHoldsAFewFilesOpenNotEveryRanks) {
  const std::string dir = test_dir();
  with_trained_ranks(
      dir, [&](Checkpointer& ckpt, int) { ckpt.save(dir, 2, StateDictType::kSharded); },
      /*ranks=*/4);
  if (is_rank_process()) return;
  Trained t(7);
  Checkpointer ckpt(*t.model, t.opt.get());
  {
    NoFreeDescriptors few(/*spare=*/6);
    ckpt.load(dir);
  }
  remove_test_dir(dir);
}

// A rank that writes for much longer than the collective timeout (NO_SHARD:
// rank 0 writes everything; a slow disk): the others wait in rounds and the
// save completes (they failed at the timeout, "a peer rank has probably
// died", and no large model could be saved). Then it loads.
TEST(CheckpointFaults, ARankWritingLongerThanTheTimeoutIsWaitedFor) {
  const std::string dir = test_dir();
  auto env = with_dir(dir);
  env.env["FSDP_FAULT_SLOW_SAVE"] = "0:4000";
  run_ranks_ok(
      2,
      [&](int, int) {
        init_process_group(ProcessGroupOptions().timeout(std::chrono::milliseconds(500)));
        auto model = make_model(FSDPOptions().sharding_strategy(ShardingStrategy::kNoShard));
        auto opt = make_optimizer("adam", model->parameters());
        train(*model, *opt, 1);
        const auto saved = full_state_dict(*model);
        // A sharded save (NO_SHARD: rank 0 writes everything), and a full
        // one, whose rank 0 commits its files after the gathers.
        Checkpointer(*model, opt.get()).save_step(dir, 1);
        Checkpointer(*model, opt.get()).save_step(dir, 2, StateDictType::kFull);
        ::unsetenv("FSDP_FAULT_SLOW_SAVE");
        for (const int64_t step : {2, 1}) {
          auto other = make_model(FSDPOptions().sharding_strategy(ShardingStrategy::kNoShard), 5);
          auto other_opt = make_optimizer("adam", other->parameters());
          EXPECT_EQ(Checkpointer(*other, other_opt.get()).load(checkpoint_path(dir, step)), step);
          expect_bitwise_equal(full_state_dict(*other), saved, "loaded");
        }
      },
      env);
  remove_test_dir(dir);
}

}  // namespace test_checkpoint_faults
}  // namespace fsdp::testing
