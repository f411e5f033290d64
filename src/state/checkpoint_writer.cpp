#include "state/checkpoint_writer.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include <fsdp/state/error.h>

#include "core/device_streams.h"
#include "detail/env.h"
#include "detail/error.h"
#include "detail/posix_files.h"
#include "state/agreement.h"
#include "state/atomic_file.h"
#include "state/checkpoint_dir.h"
#include "state/full_gather.h"
#include "state/local_state.h"
#include "state/manifest.h"
#include "state/retention.h"
#include "state/safetensors.h"

namespace fsdp::detail {
namespace {

constexpr const char* kIncomplete = "this checkpoint is incomplete and will not load";

// A tensor to write: its header entry, its bytes, and its manifest record.
struct Item {
  SafetensorsEntry entry;
  at::Tensor data;
  TensorRecord record;
};

void make_dirs(const std::string& dir) {
  std::error_code ec;
  detail::make_dirs(dir, ec);
  if (ec) throw CheckpointError(dir, "cannot create directory: " + ec.message());
  // Its entry in the parent is durable too, before older checkpoints are
  // removed for it: a power loss must not take the new one's name away.
  fsync_directory(parent_directory(dir));
}

void write_bytes(AtomicFileWriter& w, const at::Tensor& t) {
  // A GPU tensor's bytes come to the host first (to() returns a CPU tensor itself).
  const at::Tensor c = t.to(at::kCPU).contiguous();
  w.write(c.data_ptr(), c.numel() * c.element_size());
}

FileRecord write_items(const std::string& dir, const std::string& name, std::vector<Item>& items,
                       RankManifest& manifest) {
  // Wider elements first: each tensor then starts at a multiple of its
  // element size (a float32 step after an odd count of bf16 elements did
  // not), which zero-copy readers need.
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) {
    return dtype_size(a.entry.dtype) > dtype_size(b.entry.dtype);
  });
  std::vector<SafetensorsEntry> entries;
  entries.reserve(items.size());
  for (const Item& it : items) entries.push_back(it.entry);
  const std::string header = encode_safetensors_header(entries);
  AtomicFileWriter w(dir + "/" + name);
  w.write(header.data(), header.size());
  for (Item& it : items) {
    write_bytes(w, it.data);
    it.record.file = name;
    manifest.tensors.push_back(it.record);
  }
  FileRecord rec{name, w.size(), w.crc32()};
  w.commit();
  return rec;
}

Item make_item(const std::string& key, const std::string& tensor, const at::Tensor& data,
               const std::vector<int64_t>& shape, std::vector<int64_t> stored_shape, int64_t begin,
               int64_t end) {
  Item it;
  it.entry.name = tensor;
  it.entry.dtype = safetensors_dtype(data.scalar_type(), key);
  it.entry.shape = std::move(stored_shape);
  it.data = data;
  it.record = TensorRecord{key, "", tensor, it.entry.dtype, shape, begin, end};
  return it;
}

// Test-only: FSDP_FAULT_SLOW_SAVE=<rank>:<ms> makes that rank's sharded
// write take `ms` longer, as a rank that writes much more does.
void slow_save_fault(int rank) {
  if (const auto ms = rank_fault("FSDP_FAULT_SLOW_SAVE", rank)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(*ms));
  }
}

void write_sharded(const std::vector<LocalPiece>& pieces, torch::optim::Optimizer* opt, int rank,
                   const std::string& dir, RankManifest& manifest) {
  slow_save_fault(rank);
  std::vector<Item> model, optim;
  std::unique_ptr<OptimAccess> access;
  if (opt != nullptr) {
    access = std::make_unique<OptimAccess>(*opt);
    access->check_steps_only(pieces);
  }
  const std::string suffix = "-rank" + std::to_string(rank) + ".safetensors";
  for (const LocalPiece& p : pieces) {
    if ((p.replicated && rank != 0) || p.saved_elsewhere) continue;
    const int64_t len = p.end - p.begin;
    // A zero-element tensor is in no rank's range: rank 0 writes it empty, so
    // that it has an entry to load like every other tensor.
    const bool writes = len > 0 || (p.numel == 0 && rank == 0);
    if (writes)
      model.push_back(make_item("model/" + p.name, p.name, p.data.to(p.saved_dtype), p.shape, {len},
                                p.begin, p.end));
    ParamState st;
    if (!access || p.is_buffer || !access->get(p.optim_param, st)) continue;
    for (const std::string& name : access->state_names()) {
      if (!writes || st.tensors.count(name) == 0) continue;
      const at::Tensor piece = st.tensors.at(name).reshape({-1}).narrow(0, p.optim_offset, len);
      const std::string tensor = p.name + "/" + name;
      optim.push_back(make_item("optim/" + tensor, tensor, piece, p.shape, {len}, p.begin, p.end));
    }
    if (access->has_step()) {
      const std::string tensor = p.name + "/step";
      optim.push_back(make_item("optim/" + tensor, tensor, step_tensor(st.step), {}, {}, 0, 1));
    }
  }
  manifest.files.push_back(write_items(dir, "model" + suffix, model, manifest));
  if (opt != nullptr) manifest.files.push_back(write_items(dir, "optim" + suffix, optim, manifest));
}

// Rank 0 streams the full tensors as the walker gathers them; the other ranks
// only take part in the gathers. A write error on rank 0 is kept until the
// walk ends, so that no rank is left waiting in a gather. What is left once
// the gathers are over, rank 0's commit of its files (an fsync of the whole
// model and optimizer state), is set in `commit`, for the caller to run
// where the other ranks wait for it in rounds.
std::exception_ptr write_full(torch::nn::Module& root, torch::optim::Optimizer* opt, int rank,
                              const std::string& dir, RankManifest& manifest,
                              std::function<void()>& commit) {
  FullWalker walker(root, opt, /*model=*/true);
  if (rank != 0) {
    walker.walk([](size_t, const at::Tensor&) {});
    return nullptr;
  }
  std::exception_ptr error;
  const std::vector<FullSpec>& specs = walker.specs();
  std::vector<SafetensorsEntry> entries[2];
  std::vector<int> which(specs.size());
  std::vector<TensorRecord> records;
  const std::string names[2] = {"model.safetensors", "optim.safetensors"};
  std::unique_ptr<AtomicFileWriter> writers[2];
  const int files = opt != nullptr ? 2 : 1;
  try {
    for (size_t i = 0; i < specs.size(); ++i) {
      const FullSpec& s = specs[i];
      which[i] = s.key.rfind("model/", 0) == 0 ? 0 : 1;
      SafetensorsEntry e;
      e.name = s.key.substr(s.key.find('/') + 1);
      e.dtype = safetensors_dtype(s.dtype, s.key);
      e.shape = s.shape;
      entries[which[i]].push_back(e);
      records.push_back({s.key, names[which[i]], e.name, e.dtype, s.shape, 0, e.numel()});
    }
    for (int f = 0; f < files; ++f) {
      const std::string header = encode_safetensors_header(entries[f]);
      writers[f] = std::make_unique<AtomicFileWriter>(dir + "/" + names[f]);
      writers[f]->write(header.data(), header.size());
    }
  } catch (...) {
    error = std::current_exception();
  }
  walker.walk([&](size_t i, const at::Tensor& t) {
    if (error) return;
    try {
      TORCH_INTERNAL_ASSERT(t.scalar_type() == specs[i].dtype && t.sizes().vec() == specs[i].shape,
                            "fsdp save: ", specs[i].key, " changed shape or dtype while saving");
      write_bytes(*writers[which[i]], t);
    } catch (...) {
      error = std::current_exception();
    }
  });
  if (error) return error;
  auto held = std::make_shared<std::vector<std::unique_ptr<AtomicFileWriter>>>();
  for (int f = 0; f < files; ++f) held->push_back(std::move(writers[f]));
  commit = [held, &manifest, records = std::move(records), files, names]() mutable {
    for (int f = 0; f < files; ++f) {
      manifest.files.push_back({names[f], (*held)[f]->size(), (*held)[f]->crc32()});
      (*held)[f]->commit();
    }
    manifest.tensors = std::move(records);
  };
  return nullptr;
}

// Every tensor saved is in a dtype safetensors stores (optimizer state is in
// its parameter's, its step float32). Checked on every rank before anything
// is written or gathered: every rank fails alike at once, where rank 0 alone
// failing a full save would leave the others waiting in its gathers.
void check_dtypes(torch::nn::Module& root) {
  for (const LocalPiece& p : local_pieces(root))
    safetensors_dtype(p.saved_dtype, "model/" + p.name);
}

CompletionMarker make_marker(const std::string& dir, int world, const SaveRequest& request) {
  CompletionMarker marker;
  // Note [Checkpoints saved last]. A parent this process may not list
  // (save(dir) into a directory whose parent only lets it through) fails
  // nothing written: the save takes no place there (0, before the others);
  // any other failure to read the parent fails the save.
  const std::string parent = parent_directory(dir);
  try {
    marker.sequence = next_sequence(parent);
  } catch (const CheckpointError& e) {
    if (::access(parent.c_str(), R_OK) == 0 || errno != EACCES) throw;
    TORCH_WARN(error_prefix(/*rank=*/0, dir),
               "saved without a place among its parent's saves: ", cause_of(e));
  }
  marker.world_size = world;
  marker.kind = request.full ? "full" : "sharded";
  marker.step = request.step;
  for (int r = 0; r < world; ++r) {
    const std::string text = read_small_file(dir + "/" + manifest_name(r), kMaxManifestBytes);
    marker.manifests.push_back({manifest_name(r), text.size(), crc32(text.data(), text.size())});
  }
  return marker;
}

}  // namespace

void write_checkpoint(torch::nn::Module& root, torch::optim::Optimizer* opt,
                      const SaveRequest& request) {
  ProcessGroup* group = state_group(root);
  const int rank = group != nullptr ? group->rank() : 0;
  const int world = group != nullptr ? group->size() : 1;
  const std::string& dir = request.dir;
  std::exception_ptr error;
  // 1. Every rank checks the dtypes; then rank 0 prepares the directory: an
  //    old marker goes first, so that a half-overwritten checkpoint can never
  //    look complete. Temporaries of an interrupted save go too (see Note
  //    [Removing leftovers]).
  try {
    check_dtypes(root);
    if (rank == 0) {
      make_dirs(dir);
      remove_temporaries(dir);
      const std::string marker = dir + "/" + kCompletionMarker;
      if (::unlink(marker.c_str()) != 0 && errno != ENOENT)
        throw CheckpointError(marker, std::string("cannot remove: ") + std::strerror(errno));
      fsync_directory(dir);
    }
  } catch (...) {
    error = std::current_exception();
  }
  agree(group, error, dir, "checking its tensors or preparing the directory", kIncomplete);
  // 2. Every rank writes its files and then its manifest.
  RankManifest manifest;
  manifest.rank = rank;
  manifest.world_size = world;
  manifest.kind = request.full ? "full" : "sharded";
  manifest.step = request.step;
  manifest.rng_state = request.rng_state;
  manifest.cuda_rng_states = request.cuda_rng_states;
  manifest.extra = request.extra;
  manifest.param_groups = request.param_groups;
  if (request.full) {
    std::function<void()> commit;
    try {
      error = write_full(root, opt, rank, dir, manifest, commit);
    } catch (...) {
      error = std::current_exception();
    }
    // Rank 0's commit may outlast the collective timeout (hundreds of GB
    // flushed): the others wait for it in rounds (Note [Waiting for a rank
    // that writes more]).
    agree_after_work(
        group,
        [&] {
          if (error) std::rethrow_exception(error);
          slow_save_fault(rank);
          if (commit) commit();
          write_file_atomically(dir + "/" + manifest_name(rank), encode_manifest(manifest));
        },
        {}, dir, "writing its files", kIncomplete);
  } else {
    // Ranks write unequal shares (NO_SHARD: rank 0 all of it), so the others
    // wait in rounds (Note [Waiting for a rank that writes more]).
    std::vector<LocalPiece> pieces;
    std::vector<c10::Stream> streams;
    try {
      pieces = local_pieces(root);
      for (const LocalPiece& p : pieces) {
        const c10::Device device = p.data.device();
        if (device.is_cpu()) continue;
        const c10::Stream stream = current_stream(device);
        if (std::find(streams.begin(), streams.end(), stream) == streams.end()) {
          streams.push_back(stream);
        }
      }
    } catch (...) {
      error = std::current_exception();
    }
    agree_after_work(
        group,
        [&] {
          if (error) std::rethrow_exception(error);
          write_sharded(pieces, opt, rank, dir, manifest);
          write_file_atomically(dir + "/" + manifest_name(rank), encode_manifest(manifest));
        },
        streams, dir, "writing its files", kIncomplete);
  }
  // 3. Every rank's files are durable: rank 0 seals the checkpoint.
  if (rank == 0) {
    try {
      write_file_atomically(dir + "/" + kCompletionMarker,
                            encode_marker(make_marker(dir, world, request)));
    } catch (...) {
      error = std::current_exception();
    }
  }
  agree(group, error, dir, "writing the completion marker", kIncomplete);
}

}  // namespace fsdp::detail
