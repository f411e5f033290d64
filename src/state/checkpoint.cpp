#include <fsdp/state/checkpoint.h>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <charconv>
#include <map>
#include <mutex>
#include <sstream>
#include <system_error>
#include <vector>

#include <fsdp/comm/process_group.h>
#include <fsdp/optim/sharded_grad_scaler.h>

#include "comm/agreement.h"
#include "detail/error.h"
#include "detail/torch_compat.h"
#include "state/agreement.h"
#include "state/atomic_file.h"
#include "state/checkpoint_dir.h"
#include "state/checkpoint_writer.h"
#include "state/local_state.h"
#include "state/manifest.h"
#include "state/piece_io.h"
#include "state/retention.h"

namespace fsdp {
namespace {

using detail::CheckpointReader;

// A generator's state (bytes), taken and set under its lock.
at::Tensor state_of(at::Generator& gen) {
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}
void set_state_of(at::Generator& gen, const at::Tensor& state) {
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

// Bytes as hex text, and back (`what` and `file` name it in the error).
std::string hex_of(const at::Tensor& bytes) {
  return detail::to_hex(
      std::string(static_cast<const char*>(bytes.data_ptr()), static_cast<size_t>(bytes.numel())));
}
at::Tensor bytes_of(const std::string& hex, const char* what, const std::string& file,
                    int64_t rank) {
  std::string bytes;
  FSDP_CHECK(detail::from_hex(hex, bytes), rank, file, what, " is not hex bytes");
  at::Tensor out = at::empty({static_cast<int64_t>(bytes.size())}, at::kByte);
  std::copy(bytes.begin(), bytes.end(), static_cast<char*>(out.data_ptr()));
  return out;
}

// The default generators of the GPUs this process sees (what at::manual_seed
// seeds), by index; none without.
std::vector<at::Generator> cuda_generators() {
  std::vector<at::Generator> out;
  if (!at::hasCUDA()) return out;
  for (size_t i = 0; i < at::getNumGPUs(); ++i) {
    out.push_back(at::globalContext().defaultGenerator(
        c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(i))));
  }
  return out;
}

/// Note [Collective load]
/// Each rank reads its own files, so one rank can fail where the others
/// succeed (a node that does not see the directory, a piece corrupted on its
/// disk). Left alone, the others would go on and hang at the next collective.
/// load() therefore agrees twice over the state group (detail::agree): after
/// verifying the directory, before anything changes, and after applying it.
/// A failure on any rank becomes an error on every rank. Two small
/// all-reduces; no tensor data moves.

/// Note [Resume fallback]
/// A damaged newest checkpoint (a disk error, a file edited by hand) must not
/// stop a job that fsdprun restarts: every restart would fail the same way.
/// Rank 0 takes the complete checkpoints newest first, skipping (with a
/// warning) each whose marker and manifests do not verify, and broadcasts
/// the step of the first that does. Every rank then verifies what it reads
/// of it (Note [Each rank checks what it reads]); where that finds damage
/// (a checksum, a file cut short: a CheckpointError) on some ranks, and
/// nothing else went wrong, every rank skips it (each damaged rank warning
/// with its cause, rank 0 naming them) and rank 0 takes the next. The data
/// was verified by rank 0 alone, every file, before the broadcast: a
/// checkpoint of hundreds of GB took longer than the collective timeout,
/// and every restart failed in the broadcast. A checkpoint that does not fit
/// the model (another model) is an error, not skipped. If complete
/// checkpoints exist but none verifies, resume() throws on every rank
/// rather than start over: starting from step 0 would hide the damage and,
/// with retention, remove the evidence. A file some rank cannot open for a
/// reason of its own (the open-file limit, permissions, memory: a
/// CheckpointAccessError) is no damage: an error on every rank, naming the
/// limit, since an older checkpoint would silently lose the steps since.

// Warns that resume() skips `dir` of `parent` because of `cause`.
void warn_skipping(int64_t rank, const std::string& parent, const std::string& dir,
                   const std::string& cause) {
  TORCH_WARN(detail::error_prefix(rank, parent), "skipping ", dir, ", it does not verify", cause,
             "; trying an earlier checkpoint");
}

/// Whether `error` is a CheckpointError: damage found reading a checkpoint
/// (Note [Resume fallback]); not one of this process's own (a
/// CheckpointAccessError: the open-file limit), which skipping the
/// checkpoint would not cure but hide.
bool is_damage(const std::exception_ptr& error) {
  try {
    std::rethrow_exception(error);
  } catch (const detail::CheckpointAccessError&) {
    return false;
  } catch (const CheckpointError&) {
    return true;
  } catch (...) {
    return false;
  }
}

// See Note [Checkpoints of a run rolled back]: `later`, newest first.
void warn_of_later_checkpoints(const std::string& parent, int64_t step,
                               const std::vector<std::string>& later) {
  if (later.empty()) return;
  std::string paths;
  for (const std::string& p : later) paths += (paths.empty() ? "" : ", ") + p;
  TORCH_WARN(detail::error_prefix(/*rank=*/0, parent), "saved step ", step,
             " beside complete checkpoints of later steps (", paths,
             "), which keep_last leaves alone; resume() loads the checkpoint saved last. Remove "
             "them if this run replaced them (a run rolled back to an earlier step).");
}

}  // namespace

const char* to_string(StateDictType type) {
  return type == StateDictType::kFull ? "full" : "sharded";
}

std::string checkpoint_path(const std::string& parent, int64_t step) {
  return parent + "/" + detail::step_name(step);
}

std::string latest_checkpoint(const std::string& parent) {
  for (const detail::StepDirectory& s : detail::step_directories(parent)) {
    if (s.marked && s.sequence) return s.path;  // a damaged marker has no place
  }
  return "";
}

void verify_checkpoint(const std::string& dir) { CheckpointReader reader(dir); }

struct Checkpointer::Impl {
  Impl(torch::nn::Module& model, torch::optim::Optimizer* optimizer, CheckpointerOptions options)
      : model(model), optimizer(optimizer), options(options) {}

  /// load(), with `reader` already made (or null: made here). With
  /// `resuming` (resume()'s parent), a checkpoint some ranks find damaged
  /// (and nothing else wrong) is skipped on every rank, -1 returned (Note
  /// [Resume fallback]).
  int64_t load_verified(const std::string& dir, std::unique_ptr<CheckpointReader> reader,
                        const std::string& resuming = "");
  /// What check() read of this rank's manifest, for write().
  struct Checked {
    const detail::RankManifest* manifest = nullptr;
    std::string file;  // the manifest's, for errors
    at::Tensor cpu_rng;
    std::vector<at::Generator> gpus;
    std::vector<at::Tensor> gpu_rng;
  };
  /// Checks that the checkpoint fits the model, the optimizer and the
  /// registered state, and the bytes this rank will read, changing nothing
  /// (no communication; Note [Checked before anything loads]).
  Checked check(const CheckpointReader& reader, ProcessGroup* group) const;
  /// Then copies it into the model, the optimizer, this rank's RNG and the
  /// registered state (no communication).
  void write(const CheckpointReader& reader, const Checked& checked);

  struct Registered {
    std::function<std::string()> save;
    std::function<void(const std::string&)> load;
    // Refuses what load would refuse, changing nothing; empty: load takes
    // anything (the user's own state).
    std::function<void(const std::string&)> check;
  };
  torch::nn::Module& model;
  torch::optim::Optimizer* optimizer;
  CheckpointerOptions options;
  std::map<std::string, Registered> registered;
  /// The directory resume() loaded (retention keeps it); "" before.
  std::string resumed_from;
};

Checkpointer::Checkpointer(torch::nn::Module& model, torch::optim::Optimizer* optimizer,
                           CheckpointerOptions options)
    : impl_(std::make_unique<Impl>(model, optimizer, options)) {
  FSDP_CHECK(options.keep_last() >= 0, /*rank=*/-1, "checkpoint", "expected keep_last >= 0, got ",
             options.keep_last(), ". Pass 0 to keep every checkpoint.");
}

Checkpointer::~Checkpointer() = default;
Checkpointer::Checkpointer(Checkpointer&&) noexcept = default;
Checkpointer& Checkpointer::operator=(Checkpointer&&) noexcept = default;

void Checkpointer::register_state(const std::string& name, std::function<std::string()> save,
                                  std::function<void(const std::string&)> load) {
  FSDP_CHECK(save && load, /*rank=*/-1, "checkpoint", "state ", name, " needs both save and load");
  FSDP_CHECK(impl_->registered.count(name) == 0, /*rank=*/-1, "checkpoint", "state ", name,
             " is registered twice; use distinct names");
  impl_->registered[name] = {std::move(save), std::move(load), /*check=*/nullptr};
}

void Checkpointer::register_state(const std::string& name, ShardedGradScaler& scaler) {
  // "key=value" lines; std::to_chars writes the shortest text that reads back
  // as the same float64, in any locale.
  auto save = [&scaler] {
    std::string text;
    for (const auto& [key, value] : scaler.state_dict()) {
      char number[32];
      const auto end = std::to_chars(number, number + sizeof number, value).ptr;
      text += key + "=" + std::string(number, end) + "\n";
    }
    return text;
  };
  // The text as the scaler's state, refused as load_state_dict refuses it.
  auto read = [&scaler, name](const std::string& text) {
    std::map<std::string, double> state;
    std::istringstream lines(text);
    for (std::string line; std::getline(lines, line);) {
      const auto eq = line.find('=');
      double value = 0;
      const char* last = line.data() + line.size();
      bool parsed = eq != std::string::npos;
      if (parsed) {
        const auto result = std::from_chars(line.data() + eq + 1, last, value);
        parsed = result.ec == std::errc() && result.ptr == last;
      }
      FSDP_CHECK(parsed, /*rank=*/-1, "checkpoint", "registered state '", name, "' holds '", line,
                 "', not a grad scaler's. Register the same state under this name as when "
                 "saving.");
      state[line.substr(0, eq)] = value;
    }
    return state;
  };
  auto load = [&scaler, read](const std::string& text) {
    scaler.load_state_dict(read(text));  // a disabled scaler ignores it
  };
  // Before anything loads (Note [Checked before anything loads]): a copy
  // takes it, or refuses it as the scaler would.
  auto check = [&scaler, read](const std::string& text) {
    ShardedGradScaler trial = scaler;
    trial.load_state_dict(read(text));
  };
  register_state(name, std::move(save), std::move(load));
  impl_->registered[name].check = std::move(check);
}

void Checkpointer::save(const std::string& dir, int64_t step, StateDictType type) {
  // Every rank refuses it alike, before any collective. A negative step's
  // directory (step--000000001) is one resume() and keep_last never see.
  FSDP_CHECK(step >= 0, detail::rank_or_none(detail::state_group(impl_->model)), dir,
             "expected a step of 0 or more to save, got ", step,
             ". resume() returns -1 where there is nothing to resume: save the step the "
             "loop is at (0 before the first)");
  detail::SaveRequest request;
  request.dir = dir;
  request.full = type == StateDictType::kFull;
  request.step = step;
  std::exception_ptr error;
  try {
    // A step directory of another step would be refused at load, blaming
    // its marker (Note [Checkpoint directory]).
    std::string name = dir;
    while (name.size() > 1 && name.back() == '/') name.pop_back();
    name = name.substr(name.find_last_of('/') + 1);
    const int64_t named = detail::step_of_name(name);
    FSDP_CHECK(named < 0 || named == step, detail::rank_or_none(detail::state_group(impl_->model)),
               dir, "is named for step ", named, ", not step ", step, ". Save step ", step,
               " into checkpoint_path(parent, ", step, ") or with save_step(parent, ", step, ")");
    at::Generator cpu = at::detail::getDefaultCPUGenerator();
    request.rng_state = hex_of(state_of(cpu));
    for (at::Generator& gpu : cuda_generators()) {
      request.cuda_rng_states.push_back(hex_of(compat::portable_cuda_rng_state(state_of(gpu))));
    }
    for (const auto& kv : impl_->registered) request.extra[kv.first] = kv.second.save();
    if (impl_->optimizer != nullptr) {  // the learning rate a scheduler set, and the rest
      const std::vector<detail::LocalPiece> pieces = detail::local_pieces(impl_->model);
      request.param_groups = detail::OptimAccess(*impl_->optimizer).group_options(&pieces);
    }
  } catch (...) {
    error = std::current_exception();
  }
  detail::agree(detail::state_group(impl_->model), error, dir, "collecting its registered state",
                "nothing was written");
  detail::write_checkpoint(impl_->model, impl_->optimizer, request);
}

// Note [Saving beside the checkpoint]
// save_step writes into a staging directory beside the step's own
// (detail::staging_name) and rank 0 puts it in place once every rank's files
// and the marker are durable (detail::replace_directory). A save of a step
// that already has a checkpoint (a loop that saves at the top of the step
// it resumed from) leaves that one whole until the new one is: a save that
// fails (a full disk, a rank killed) loses nothing already saved. What an
// interrupted save leaves is removed by the next save_step or resume().
std::string Checkpointer::save_step(const std::string& parent, int64_t step, StateDictType type) {
  std::string dir = checkpoint_path(parent, step);  // not const: returned by move
  const std::string staged = parent + "/" + detail::staging_name(step);
  ProcessGroup* group = detail::state_group(impl_->model);
  const bool root = group == nullptr || group->rank() == 0;
  // See Note [Removing leftovers]: every exit below is after an agreement.
  try {
    save(staged, step, type);
  } catch (...) {
    // A torn directory only takes space (a full disk is the likely cause).
    if (root) detail::remove_if_torn(staged);
    throw;
  }
  std::exception_ptr error;
  if (root) {
    try {
      detail::replace_directory(staged, dir);
    } catch (...) {
      error = std::current_exception();
    }
  }
  detail::agree(group, error, dir, "putting the checkpoint in place",
                "the new checkpoint stays complete beside it, under " + staged);
  if (root) {
    std::vector<std::string> keep = {dir};
    if (!impl_->resumed_from.empty()) keep.push_back(impl_->resumed_from);
    warn_of_later_checkpoints(
        parent, step, detail::tidy_checkpoints(parent, impl_->options.keep_last(), keep, step));
  }
  return dir;
}

int64_t Checkpointer::load(const std::string& dir) {
  const int64_t step = impl_->load_verified(dir, nullptr);
  impl_->resumed_from = dir;  // Note [Checkpoints of a run rolled back]
  return step;
}

int64_t Checkpointer::Impl::load_verified(const std::string& dir,
                                          std::unique_ptr<CheckpointReader> reader,
                                          const std::string& resuming) {
  // See Note [Collective load].
  ProcessGroup* group = detail::state_group(model);
  std::exception_ptr error;
  Checked checked;
  try {
    // Refused before anything is loaded, as loading would leave it out.
    if (optimizer != nullptr) {
      detail::OptimAccess(*optimizer).check_steps_only(detail::local_pieces(model));
    }
    if (!reader) {
      // See Note [Each rank checks what it reads].
      reader =
          std::make_unique<CheckpointReader>(dir, CheckpointReader::DataChecks::kBeforeFirstRead);
    }
    checked = check(*reader, group);
  } catch (...) {
    error = std::current_exception();
  }
  if (!resuming.empty()) {
    // Each rank's outcome: 0 verified, 1 damaged, 2 another error.
    const int64_t mine = !error ? 0 : is_damage(error) ? 1 : 2;
    const std::vector<int64_t> all = group != nullptr && group->size() > 1
                                         ? detail::agree_gather(group, {mine})
                                         : std::vector<int64_t>{mine};
    const std::string damaged = detail::ranks_with(all, 1);
    if (!damaged.empty() && detail::ranks_with(all, 2).empty()) {
      const int64_t rank = detail::rank_or_none(group);
      if (error) {
        try {
          std::rethrow_exception(error);
        } catch (const std::exception& e) {
          warn_skipping(rank, resuming, dir, ": " + detail::cause_of(e));
        }
      } else if (rank <= 0) {
        warn_skipping(rank, resuming, dir, " on rank(s) " + damaged + " (see their warnings)");
      }
      return -1;
    }
  }
  detail::agree(group, error, dir, "verifying it",
                "nothing was loaded; make it readable there or load another checkpoint");
  try {
    write(*reader, checked);
  } catch (...) {
    error = std::current_exception();
  }
  detail::agree(group, error, dir, "loading it",
                "this rank's state is loaded but the job's is not; load again");
  return reader->marker().step;
}

// Note [Checked before anything loads]
// A checkpoint that does not fit (another optimizer's groups, a registered
// state it lacks, another model) must leave the model, the optimizer and the
// generators as they were: a caller that catches the error and trains on
// (from scratch, or from another checkpoint) must not train a mix. So every
// part is checked first, the model's and optimizer's pieces included, and
// only then is anything written.
Checkpointer::Impl::Checked Checkpointer::Impl::check(const CheckpointReader& reader,
                                                      ProcessGroup* group) const {
  detail::FileSource source(reader);
  // Resume state is per rank; at another world size rank r takes what rank
  // r (or, beyond the saved ranks, rank 0) saved.
  const int rank = group != nullptr ? group->rank() : 0;
  const int saved = reader.marker().world_size;
  const detail::RankManifest& m = reader.manifest(rank < saved ? rank : 0);
  Checked out;
  out.manifest = &m;
  out.file = reader.dir() + "/" + detail::manifest_name(m.rank);
  const std::string& file = out.file;
  const int64_t err_rank = detail::rank_or_none(group);
  detail::load_model_pieces(model, source, detail::PieceLoad::kCheckOnly);
  if (optimizer != nullptr) {
    // A checkpoint saved without an optimizer holds no state for it: loaded,
    // a stepped optimizer's state was cleared (Adam's moments restarted),
    // silently; a review found it. A fresh one (fine-tuning from a model's
    // checkpoint) has nothing to lose.
    bool has_optimizer = false;
    for (int r = 0; r < saved; ++r) {
      for (const detail::FileRecord& f : reader.manifest(r).files) {
        has_optimizer = has_optimizer || f.name.rfind("optim", 0) == 0;
      }
    }
    if (!has_optimizer) {
      const detail::OptimAccess access(*optimizer);
      bool stepped = false;
      for (const detail::LocalPiece& p : detail::local_pieces(model)) {
        detail::ParamState st;
        stepped = stepped || (!p.is_buffer && access.get(p.optim_param, st) &&
                              (!access.has_step() || st.step > 0));
      }
      FSDP_CHECK(!stepped, err_rank, reader.dir(),
                 "was saved without an optimizer, so loading it would clear the state of this "
                 "optimizer, which has stepped. Load it with fsdp::Checkpointer(model) (no "
                 "optimizer: the optimizer keeps its state), or load a checkpoint saved with the "
                 "optimizer");
    }
    detail::load_optim_pieces(model, *optimizer, source, detail::PieceLoad::kCheckOnly);
    if (!m.param_groups.empty()) {
      detail::OptimAccess(*optimizer)
          .check_group_options(m.param_groups, detail::local_pieces(model), file);
    }
  }
  if (!m.rng_state.empty()) {
    out.cpu_rng = bytes_of(m.rng_state, "rng_state", file, err_rank);
    at::Generator cpu = at::detail::getDefaultCPUGenerator();
    const int64_t want = state_of(cpu).numel();
    FSDP_CHECK(out.cpu_rng.numel() == want, err_rank, file, "its rng_state has ",
               out.cpu_rng.numel(), " bytes, this LibTorch's CPU generator ", want,
               " (saved by another LibTorch?); load it with the LibTorch that saved it");
  }
  // The GPUs both jobs see, by index (each rank its own where each sees one).
  out.gpus = cuda_generators();
  for (size_t i = 0; i < std::min(out.gpus.size(), m.cuda_rng_states.size()); ++i) {
    out.gpu_rng.push_back(
        bytes_of(m.cuda_rng_states[i], "a GPU generator's state", file, err_rank));
    FSDP_CHECK(out.gpu_rng.back().numel() == compat::kCudaRngStateBytes, err_rank, file,
               "a GPU generator's state has ", out.gpu_rng.back().numel(), " bytes, expected ",
               compat::kCudaRngStateBytes, " (its seed and offset)");
  }
  for (const auto& kv : registered) {
    FSDP_CHECK(m.extra.count(kv.first) != 0, err_rank, file, "has no registered state '", kv.first,
               "'; it was saved without register_state(\"", kv.first, "\", ...)");
    if (kv.second.check) kv.second.check(m.extra.at(kv.first));
  }
  return out;
}

void Checkpointer::Impl::write(const CheckpointReader& reader, const Checked& checked) {
  detail::FileSource source(reader);
  const detail::RankManifest& m = *checked.manifest;
  detail::load_model_pieces(model, source);
  if (optimizer != nullptr) detail::load_optim_pieces(model, *optimizer, source);
  if (checked.cpu_rng.defined()) {
    at::Generator cpu = at::detail::getDefaultCPUGenerator();
    set_state_of(cpu, checked.cpu_rng);
  }
  for (size_t i = 0; i < checked.gpu_rng.size(); ++i) {
    at::Generator gpu = checked.gpus[i];
    set_state_of(gpu, compat::native_cuda_rng_state(checked.gpu_rng[i], state_of(gpu)));
  }
  if (optimizer != nullptr && !m.param_groups.empty()) {
    detail::OptimAccess(*optimizer)
        .set_group_options(m.param_groups, detail::local_pieces(model), checked.file);
  }
  for (const auto& kv : registered) kv.second.load(m.extra.at(kv.first));
}

int64_t Checkpointer::resume(const std::string& parent) {
  // Rank 0 chooses the step, so that ranks whose view of `parent` differs (a
  // save still appearing on another node) cannot load different steps.
  // See Note [Resume fallback].
  ProcessGroup* group = detail::state_group(impl_->model);
  const bool root = group == nullptr || group->rank() == 0;
  constexpr double kNone = -1, kFailed = -2;
  std::vector<detail::StepDirectory> dirs;  // rank 0's, newest first
  size_t next = 0;
  int64_t complete = 0;
  std::string skipped;  // "; skipped <dir> (<why>)" for each
  std::exception_ptr error;
  if (root) {
    try {
      detail::restore_cut_short_replacements(parent);  // Note [A replacement cut short]
      dirs = detail::step_directories(parent);
    } catch (...) {
      error = std::current_exception();
    }
  }
  for (;;) {
    at::Tensor step = at::full({1}, kNone, at::kDouble);
    std::unique_ptr<CheckpointReader> reader;
    if (root) {
      try {
        if (error) std::rethrow_exception(error);
        for (; next < dirs.size() && !reader; ++next) {
          if (!dirs[next].marked) continue;
          ++complete;
          try {
            reader = std::make_unique<CheckpointReader>(
                dirs[next].path, CheckpointReader::DataChecks::kBeforeFirstRead);
          } catch (const detail::CheckpointAccessError&) {
            throw;  // not the checkpoint's fault: see is_damage
          } catch (const std::exception& e) {
            warn_skipping(detail::rank_or_none(group), parent, dirs[next].path,
                          ": " + detail::cause_of(e));
            skipped += "; skipped " + dirs[next].path + " (" + detail::cause_of(e) + ")";
          }
        }
        if (reader) {
          step.fill_(static_cast<double>(reader->marker().step));
        } else if (complete > 0) {
          throw CheckpointError(parent, "none of its " + std::to_string(complete) +
                                            " complete checkpoints verifies" + skipped +
                                            ". Repair or remove them to start over.");
        } else {
          // See Note [Removing leftovers]: every rank is in resume().
          detail::tidy_checkpoints(parent, impl_->options.keep_last(), {});
        }
      } catch (...) {
        error = std::current_exception();
        step.fill_(kFailed);
      }
    }
    if (group != nullptr && group->size() > 1) group->broadcast(step, /*root=*/0).wait();
    const double chosen = step.item<double>();
    if (chosen == kFailed) {
      if (error) std::rethrow_exception(error);
      throw CheckpointError(parent,
                            "rank 0 could not choose a checkpoint to resume from (see rank 0's "
                            "error); nothing was loaded");
    }
    if (chosen == kNone) return -1;
    const std::string dir = checkpoint_path(parent, static_cast<int64_t>(chosen));
    const int64_t loaded = impl_->load_verified(dir, std::move(reader), parent);
    if (loaded < 0) {
      skipped += "; skipped " + dir + " (damaged, see the warnings)";
      continue;
    }
    impl_->resumed_from = dir;
    // Retention applies now too, so that a full disk has room for the next
    // save; only once loaded: a load refused (another model) removes nothing.
    std::exception_ptr tidy_error;
    if (root) {
      try {
        // Checkpoints of later steps than the one saved last are a run
        // rolled back from: left alone (Note [Checkpoints of a run rolled back]).
        detail::tidy_checkpoints(parent, impl_->options.keep_last(), {dir},
                                 static_cast<int64_t>(chosen));
      } catch (...) {
        tidy_error = std::current_exception();
      }
    }
    detail::agree(group, tidy_error, parent, "removing what keep_last and interrupted saves left",
                  "the checkpoint was loaded");
    return loaded;
  }
}

}  // namespace fsdp
