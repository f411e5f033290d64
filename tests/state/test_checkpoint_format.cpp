// The on-disk layer: CRC-32, safetensors headers, and a checkpoint directory
// that refuses every kind of damage with an error naming the file. Single
// process: plain LibTorch modules save and load without a process group.

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <nlohmann/json.hpp>

#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <sstream>
#include <vector>

#include <fsdp/fsdp.h>

#include "detail/torch_compat.h"
#include "error_of.h"
#include "marker_edit.h"
#include "state/crc32.h"
#include "state/manifest.h"
#include "state/safetensors.h"
#include "state_test_util.h"

namespace fsdp::testing {
namespace test_checkpoint_format {

using detail::crc32;
using detail::Crc32;
using detail::encode_safetensors_header;
using detail::parse_safetensors;
using detail::SafetensorsEntry;
using detail::SafetensorsHeader;

TEST(Crc32, KnownValues) {
  EXPECT_EQ(crc32("123456789", 9), 0xCBF43926u);
  EXPECT_EQ(crc32("", 0), 0u);
  Crc32 c;
  c.update("1234", 4);
  c.update("56789", 5);
  EXPECT_EQ(c.value(), 0xCBF43926u);
}

// Eight bytes at a time (slicing-by-8) gives the byte-wise CRC at every
// length, alignment and split into updates.
TEST(Crc32, EightBytesAtATimeMatchesByteByByte) {
  std::vector<unsigned char> bytes(300);
  uint32_t x = 12345;
  for (auto& b : bytes) b = static_cast<unsigned char>((x = x * 1103515245u + 12345u) >> 24);
  const auto bytewise = [](const unsigned char* p, size_t n) {
    uint32_t c = 0xFFFFFFFFu;
    for (size_t i = 0; i < n; ++i) {
      c ^= p[i];
      for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
    }
    return ~c;
  };
  for (size_t offset = 0; offset < 8; ++offset) {
    for (size_t n = 0; n + offset <= bytes.size(); n += 7) {
      EXPECT_EQ(crc32(bytes.data() + offset, n), bytewise(bytes.data() + offset, n))
          << offset << " " << n;
      Crc32 split;
      split.update(bytes.data() + offset, n / 3);
      split.update(bytes.data() + offset + n / 3, n - n / 3);
      EXPECT_EQ(split.value(), bytewise(bytes.data() + offset, n)) << offset << " " << n;
    }
  }
}

std::string tiny_file() {
  std::vector<SafetensorsEntry> entries(2);
  entries[0].name = "a";
  entries[0].dtype = "F32";
  entries[0].shape = {2, 3};
  entries[1].name = "b";
  entries[1].dtype = "I64";
  entries[1].shape = {};
  std::string file = encode_safetensors_header(entries);
  file.append(24 + 8, 'x');
  return file;
}

SafetensorsHeader parse(const std::string& bytes) {
  return parse_safetensors(reinterpret_cast<const unsigned char*>(bytes.data()), bytes.size(),
                           "t.safetensors");
}

// Expects `fn` to throw a CheckpointError whose message contains every needle.
void expect_error(const std::function<void()>& fn, const std::vector<std::string>& needles) {
  try {
    fn();
    ADD_FAILURE() << "no error; expected one mentioning " << needles.front();
  } catch (const std::exception& e) {
    for (const auto& n : needles) {
      EXPECT_NE(std::string(e.what()).find(n), std::string::npos)
          << "error \"" << e.what() << "\" does not mention \"" << n << "\"";
    }
  }
}

TEST(Safetensors, HeaderRoundTrip) {
  const std::string file = tiny_file();
  EXPECT_EQ((file.size() - 32) % 8, 0u);  // header padded to 8 bytes
  // The metadata Hugging Face's loaders read (transformers before 4.48.2
  // failed on files without it).
  EXPECT_NE(file.find("\"__metadata__\":{\"format\":\"pt\"}"), std::string::npos) << file;
  const SafetensorsHeader h = parse(file);
  ASSERT_EQ(h.entries.size(), 2u);
  EXPECT_EQ(h.entries[0].name, "a");
  EXPECT_EQ(h.entries[0].shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(h.entries[0].end, 24u);
  EXPECT_EQ(h.entries[1].dtype, "I64");
  EXPECT_EQ(h.entries[1].begin, 24u);
  EXPECT_EQ(h.entries[1].end, 32u);
}

// A sharded checkpoint's files hold wider elements first, so that every
// tensor starts at a multiple of its element size: a float32 Adam step or an
// int64 buffer after an odd count of bf16 elements did not, which zero-copy
// readers refuse. Found by a review.
struct OddImpl : torch::nn::Module {
  OddImpl() {
    w = register_parameter("w", torch::ones({3}, torch::kBFloat16));
    count = register_buffer("count", torch::zeros({}, torch::kLong));
  }
  torch::Tensor w, count;
};
TORCH_MODULE(Odd);

TEST(Safetensors, EveryTensorOfASavedFileIsAlignedToItsElementSize) {
  const std::string dir = test_dir();
  Odd model;
  torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(0.1));
  model->w.mutable_grad() = torch::ones({3}, torch::kBFloat16);
  opt.step();
  Checkpointer(*model, &opt).save(dir + "/c", 1, StateDictType::kSharded);
  int files = 0;
  for (const char* name : {"model-rank0.safetensors", "optim-rank0.safetensors"}) {
    const std::string bytes = file_bytes(dir + "/c/" + name);
    const SafetensorsHeader h = parse(bytes);
    uint64_t header = 0;
    for (int i = 0; i < 8; ++i) header |= uint64_t{static_cast<uint8_t>(bytes[i])} << (8 * i);
    for (const auto& e : h.entries) {
      EXPECT_EQ((8 + header + e.begin) % detail::dtype_size(e.dtype), 0u)
          << name << ": " << e.name << " (" << e.dtype << ") at " << e.begin;
    }
    ++files;
  }
  EXPECT_EQ(files, 2);
  remove_test_dir(dir);
}

TEST(Safetensors, RefusesInconsistentHeaders) {
  const std::string good = tiny_file();
  expect_error([&] { parse(good.substr(0, good.size() - 1)); }, {"t.safetensors", "truncated"});
  expect_error([&] { parse(good.substr(0, 5)); }, {"t.safetensors", "truncated"});
  std::string huge = good;
  huge[5] = 0x7f;  // header length ~2^47
  expect_error([&] { parse(huge); }, {"t.safetensors", "header length"});
  // Replaces text in the header and rewrites the length prefix to match.
  auto edit = [&](const std::string& from, const std::string& to) {
    std::string s = good;
    s.replace(s.find(from), from.size(), to);
    uint64_t length = 0;  // the length prefix, little-endian
    for (int i = 0; i < 8; ++i) length |= uint64_t{static_cast<uint8_t>(good[i])} << (8 * i);
    const uint64_t n = length + to.size() - from.size();
    for (int i = 0; i < 8; ++i) s[i] = static_cast<char>((n >> (8 * i)) & 0xFF);
    return s;
  };
  expect_error([&] { parse(edit("[2,3]", "[2,4]")); }, {"t.safetensors", "'a'", "data_offsets"});
  expect_error([&] { parse(edit("\"F32\"", "\"F99\"")); }, {"unknown dtype F99"});
  expect_error([&] { parse(edit("[24,32]", "[16,24]")); }, {"'b'", "overlap or gap"});
  expect_error([&] { parse(edit("[2,3]", "[-2,3]")); }, {"'a'", "non-negative"});
  expect_error([&] { parse(edit("{", "[")); }, {"t.safetensors", "JSON"});
  expect_error([&] { parse(edit("[2,3]", "[99999999999,99999999999]")); }, {"too large"});
}

// The prefix of every error in this process: "[rank R] " when the launcher
// gave it a RANK, then "fsdp(<where>): " (see Note [Error messages]).
std::string prefix(const std::string& where) {
  const char* rank = std::getenv("RANK");
  return (rank != nullptr && *rank != '\0' ? "[rank " + std::string(rank) + "] " : "") + "fsdp(" +
         where + "): ";
}

TEST(CheckpointErrors, ReadWithTheOnePrefix) {
  // The on-disk layer: the file, then the problem.
  try {
    parse(tiny_file().substr(0, 5));
    ADD_FAILURE() << "a truncated file was accepted";
  } catch (const CheckpointError& e) {
    EXPECT_EQ(e.file(), "t.safetensors");
    EXPECT_EQ(e.problem().rfind("truncated: 5 bytes", 0), 0u) << e.problem();
    EXPECT_EQ(std::string(e.what()), prefix("t.safetensors") + e.problem());
  }
  const std::string dir = test_dir();
  try {
    verify_checkpoint(dir + "/none");
    ADD_FAILURE() << "a directory without a marker verified";
  } catch (const CheckpointError& e) {
    EXPECT_EQ(std::string(e.what()).rfind(prefix(dir + "/none/COMPLETE") +
                                              "missing completion marker: the save did not finish",
                                          0),
              0u)
        << e.what();
  }
  // The Checkpointer: the component; loading: the parameter.
  Net model(false, FSDPOptions());
  Checkpointer ckpt(*model);
  ckpt.register_state(
      "data", [] { return std::string(); }, [](const std::string&) {});
  EXPECT_EQ(error_of([&] {
              ckpt.register_state(
                  "data", [] { return std::string(); }, [](const std::string&) {});
            }),
            prefix("checkpoint") + "state data is registered twice; use distinct names");
  EXPECT_EQ(
      error_of([&] { Checkpointer(*model, nullptr, CheckpointerOptions().keep_last(-1)); }),
      prefix("checkpoint") + "expected keep_last >= 0, got -1. Pass 0 to keep every checkpoint.");
  auto sd = full_state_dict(*model);
  const std::string name = "head.weight";
  sd[name] = torch::zeros({3, 15});
  const std::string shape = error_of([&] { load_full_state_dict(*model, sd); });
  EXPECT_EQ(shape.rfind(prefix(name) + "has shape [3, 15] in the state dict, expected ", 0), 0u)
      << shape;
  remove_test_dir(dir);
}

// A plain model and Adam after two steps, saved to `dir`.
struct Saved {
  Net model{false, FSDPOptions()};
  std::unique_ptr<torch::optim::Optimizer> opt;
  Saved(const std::string& dir, StateDictType type, int64_t step = 2) {
    torch::manual_seed(1);
    model = Net(false, FSDPOptions());
    opt = make_optimizer("adam", model->parameters());
    train(*model, *opt, 2);
    Checkpointer(*model, opt.get()).save(dir, step, type);
  }
};

TEST(CheckpointDir, PlainModelRoundTripBothTypes) {
  for (auto type : {StateDictType::kFull, StateDictType::kSharded}) {
    const std::string root = test_dir(), dir = root + "/ckpt";
    Saved saved(dir, type);
    torch::manual_seed(2);
    Net other(false, FSDPOptions());
    auto opt = make_optimizer("adam", other->parameters());
    EXPECT_EQ(Checkpointer(*other, opt.get()).load(dir), 2);
    expect_bitwise_equal(full_state_dict(*other), full_state_dict(*saved.model), "model");
    expect_bitwise_equal(full_optim_state_dict(*other, *opt),
                         full_optim_state_dict(*saved.model, *saved.opt), "optimizer");
    // Training continues identically.
    torch::manual_seed(5);
    train(*saved.model, *saved.opt, 2);
    torch::manual_seed(5);
    train(*other, *opt, 2);
    expect_bitwise_equal(full_state_dict(*other), full_state_dict(*saved.model), "after training");
    remove_test_dir(root);
  }
}

// Registered state may be bytes (a data loader's position from torch::save,
// say), not only text: each value comes back as it was saved, whatever its
// bytes (JSON holds text: bytes go in hex).
TEST(CheckpointDir, RegisteredStateKeepsItsBytes) {
  const std::string root = test_dir(), dir = root + "/ckpt";
  std::string bytes = {'\x80', '\xff', '\0', 'a', '\xc0', '\x80'};  // invalid UTF-8, a NUL
  std::stringstream saved_tensor;
  torch::save(torch::arange(5), saved_tensor);
  const std::map<std::string, std::string> states = {
      {"bytes", bytes}, {"tensor", saved_tensor.str()}, {"text", "step 7 \xc3\xa9"}, {"empty", ""}};
  Net model(false, FSDPOptions());
  Checkpointer saving(*model);
  for (const auto& [name, value] : states) {
    saving.register_state(
        name, [value = value] { return value; }, [](const std::string&) {});
  }
  saving.save(dir, 1);
  std::map<std::string, std::string> loaded;
  Checkpointer loading(*model);
  for (const auto& [name, value] : states) {
    loading.register_state(
        name, [] { return std::string(); },
        [&loaded, name = name](const std::string& s) { loaded[name] = s; });
  }
  EXPECT_EQ(loading.load(dir), 1);
  EXPECT_EQ(loaded, states);
  torch::Tensor back;
  std::stringstream in(loaded["tensor"]);
  torch::load(back, in);
  EXPECT_TRUE(torch::equal(back, torch::arange(5)));
  remove_test_dir(root);
}

// A resumed run draws the random numbers the saved one would have drawn
// next: the CPU generator's state, and each visible GPU's (in the manifest
// only where there are GPUs; those of checkpoints from before, without the
// field, still parse).
TEST(CheckpointDir, ResumeRestoresTheGeneratorsStates) {
  const std::string root = test_dir(), dir = root + "/ckpt";
  Net model(false, FSDPOptions());
  torch::manual_seed(5);
  Checkpointer(*model).save(dir, 1);
  const torch::Tensor next = torch::rand({16});
  torch::manual_seed(6);
  EXPECT_EQ(Checkpointer(*model).load(dir), 1);
  EXPECT_TRUE(torch::equal(torch::rand({16}), next));
  const auto manifest = nlohmann::json::parse(file_bytes(dir + "/rank0.json"));
  EXPECT_EQ(manifest.contains("cuda_rng_states"), at::hasCUDA() && at::getNumGPUs() > 0);
  detail::RankManifest m;
  m.kind = "full";
  m.cuda_rng_states = {"00ff", "a1b2"};
  EXPECT_EQ(detail::parse_manifest(detail::encode_manifest(m), "m").cuda_rng_states,
            m.cuda_rng_states);
  m.cuda_rng_states.clear();
  const std::string without = detail::encode_manifest(m);
  EXPECT_EQ(without.find("cuda_rng_states"), std::string::npos);
  EXPECT_TRUE(detail::parse_manifest(without, "m").cuda_rng_states.empty());
  // A GPU generator's state is kept as its seed and offset, which LibTorch
  // 1.13 and 2.0 put after 800 unused bytes (816 in all) and 2.1 on alone
  // (16): saved by one, it restores in the other.
  const torch::Tensor seed_offset = torch::arange(16, torch::kByte) + 1;
  const torch::Tensor old_layout = torch::cat({torch::full({800}, 255, torch::kByte), seed_offset});
  EXPECT_TRUE(torch::equal(compat::portable_cuda_rng_state(old_layout), seed_offset));
  EXPECT_TRUE(torch::equal(compat::portable_cuda_rng_state(seed_offset), seed_offset));
  const torch::Tensor unused_kept = torch::cat({torch::zeros({800}, torch::kByte), seed_offset});
  EXPECT_TRUE(torch::equal(
      compat::native_cuda_rng_state(seed_offset, torch::zeros({816}, torch::kByte)), unused_kept));
  EXPECT_TRUE(torch::equal(
      compat::native_cuda_rng_state(seed_offset, torch::zeros({16}, torch::kByte)), seed_offset));
  remove_test_dir(root);
}

// Rewrites the CRC-32 and size of `target` in the "files" or "manifests"
// list of `j`.
void fix_record(nlohmann::json& j, const char* list, const std::string& dir,
                const std::string& target) {
  const std::string bytes = file_bytes(dir + "/" + target);
  for (auto& f : j[list]) {
    if (f["name"] == target) {
      f["size"] = bytes.size();
      f["crc32"] = crc32(bytes.data(), bytes.size());
    }
  }
}

// Rewrites the checksums that cover data file `name` (in rank0.json, in the
// marker, and the marker's own), so that a deliberately inconsistent file
// passes them and reaches the header validation.
void reseal(const std::string& dir, const std::string& name) {
  auto manifest = nlohmann::json::parse(file_bytes(dir + "/rank0.json"));
  fix_record(manifest, "files", dir, name);
  put_file_bytes(dir + "/rank0.json", manifest.dump(1));
  reseal_marker(dir, [&](nlohmann::json& j) { fix_record(j, "manifests", dir, "rank0.json"); });
}

TEST(CheckpointDir, RefusesDamage) {
  const std::string root = test_dir();
  int n = 0;
  // Each case damages a fresh full checkpoint and expects load to name the file and problem.
  auto check = [&](const std::function<void(const std::string&)>& damage,
                   const std::vector<std::string>& needles) {
    const std::string dir = root + "/c" + std::to_string(n++);
    Saved saved(dir, StateDictType::kFull);
    verify_checkpoint(dir);
    damage(dir);
    Net other(false, FSDPOptions());
    expect_error([&] { Checkpointer(*other).load(dir); }, needles);
    expect_error([&] { verify_checkpoint(dir); }, needles);
  };
  check([](const std::string& d) { std::remove((d + "/COMPLETE").c_str()); },
        {"COMPLETE", "missing completion marker"});
  check(
      [](const std::string& d) {
        std::string b = file_bytes(d + "/model.safetensors");
        b[b.size() - 3] ^= 0x10;
        put_file_bytes(d + "/model.safetensors", b);
      },
      {"model.safetensors", "checksum mismatch"});
  check(
      [](const std::string& d) {
        std::string b = file_bytes(d + "/optim.safetensors");
        put_file_bytes(d + "/optim.safetensors", b.substr(0, b.size() / 2));
      },
      {"optim.safetensors", "truncated"});
  check(
      [](const std::string& d) {
        std::string b = file_bytes(d + "/rank0.json");
        b[b.size() / 2] ^= 0x01;
        put_file_bytes(d + "/rank0.json", b);
      },
      {"rank0.json", "checksum mismatch"});
  check(
      [](const std::string& d) {  // a lie in the header, checksums made consistent
        std::string b = file_bytes(d + "/model.safetensors");
        const auto at = b.find("[16,7]");
        b.replace(at, 6, "[17,7]");
        put_file_bytes(d + "/model.safetensors", b);
        reseal(d, "model.safetensors");
      },
      {"model.safetensors", "fc1.weight", "data_offsets"});
  check(
      [](const std::string& d) {  // a header length past the end, checksums consistent
        std::string b = file_bytes(d + "/model.safetensors");
        b[6] = 0x01;
        put_file_bytes(d + "/model.safetensors", b);
        reseal(d, "model.safetensors");
      },
      {"model.safetensors", "header length"});
  remove_test_dir(root);
}

TEST(CheckpointDir, LatestCompleteCheckpoint) {
  const std::string root = test_dir();
  EXPECT_EQ(latest_checkpoint(root), "");
  Saved a(checkpoint_path(root, 3), StateDictType::kSharded, 3);
  Saved b(checkpoint_path(root, 12), StateDictType::kSharded, 12);
  Saved c(checkpoint_path(root, 20), StateDictType::kSharded, 20);
  std::remove((checkpoint_path(root, 20) + "/COMPLETE").c_str());
  EXPECT_EQ(latest_checkpoint(root), checkpoint_path(root, 12));
  remove_test_dir(root);
}

}  // namespace test_checkpoint_format
}  // namespace fsdp::testing
