#include "state/checkpoint_dir.h"

#include <sys/stat.h>

#include <algorithm>
#include <charconv>
#include <cstdio>

#include <fsdp/state/error.h>

#include "detail/posix_files.h"

namespace fsdp::detail {

// Note [Checkpoint directory]
// A checkpoint is a directory:
//   model.safetensors, optim.safetensors  (full: rank 0 writes the whole
//       tensors under their original names; any safetensors reader opens them)
//   model-rank<R>.safetensors, optim-rank<R>.safetensors  (sharded: each rank's
//       pieces of the original tensors, flattened, 1-D)
//   rank<R>.json   each rank's manifest: its files with size and CRC-32, which
//       element range of which original tensor each piece holds, its step,
//       RNG state and registered state
//   COMPLETE       the marker: every manifest with size and CRC-32.
// Every file is written atomically (temporary name, fsync, rename, fsync of
// the directory). Rank 0 writes COMPLETE only after a barrier that every rank
// reaches once its files are durable, so a directory with a marker is whole,
// and the chain marker -> manifest -> data file checksums catches any later
// damage. A full checkpoint is read by the same code as a sharded one: its
// pieces simply span whole tensors, so any world size can load either.

namespace {

std::string join(const std::string& dir, const std::string& name) { return dir + "/" + name; }

void check_size(const FileReader& r, const FileRecord& rec) {
  if (r.size() != rec.size) {
    throw CheckpointError(r.path(), "is " + std::to_string(r.size()) +
                                        " bytes, the manifest says " + std::to_string(rec.size) +
                                        " (truncated or replaced)");
  }
}

void check_record(const FileReader& r, const FileRecord& rec) {
  check_size(r, rec);
  const uint32_t crc = r.checksum();
  if (crc != rec.crc32) {
    throw CheckpointError(r.path(), "checksum mismatch: CRC-32 " + std::to_string(crc) +
                                        ", expected " + std::to_string(rec.crc32) + " (corrupted)");
  }
}

}  // namespace

std::string manifest_name(int rank) { return "rank" + std::to_string(rank) + ".json"; }

CheckpointReader::CheckpointReader(std::string dir)
    : CheckpointReader(std::move(dir), DataChecks::kEveryFile) {}

// Note [Each rank checks what it reads]
// Every rank used to check the CRC-32 of every data file of the checkpoint
// it loaded: at N ranks the job read the whole checkpoint N times over, from
// the shared file system, before loading (8 ranks of a 100 GB checkpoint:
// 800 GB). Loading needs each file's bytes to be whole only where a rank
// reads them, so Checkpointer::load opens it with kBeforeFirstRead: sizes,
// headers and every piece are checked as before, and each rank checks the
// CRC-32 of the files it will read, in its checks before anything is
// written (PieceSource::will_read), so that damage is still an error on
// every rank before anything loads (Note [Collective load]). At the saved
// world size a rank reads its own files, and the file that holds what rank 0
// alone saves (the buffers, in its model file); a step every rank saved is
// read from a file already checked. resume() loads so too, damage found on
// any rank skipping the checkpoint on every rank (Note [Resume fallback]);
// verify_checkpoint checks every file.
CheckpointReader::CheckpointReader(std::string dir, DataChecks checks)
    : checks_(checks), dir_(std::move(dir)) {
  const std::string marker_path = join(dir_, kCompletionMarker);
  if (!is_marked(marker_path)) {
    throw CheckpointError(marker_path,
                          "missing completion marker: the save did not finish (or "
                          "this is not a checkpoint directory); use an earlier "
                          "checkpoint");
  }
  marker_ = parse_marker(read_small_file(marker_path, kMaxManifestBytes), marker_path);
  // The step is in three places: the marker, every manifest, and the name
  // that resume() chose the directory by. A disagreement is the marker's
  // fault (it is written last, from the manifests).
  const auto slash = dir_.find_last_not_of('/');
  const std::string trimmed = dir_.substr(0, slash == std::string::npos ? 0 : slash + 1);
  const std::string base = trimmed.substr(trimmed.rfind('/') + 1);
  const int64_t named = step_of_name(base);
  if (named >= 0 && named != marker_.step) {
    throw CheckpointError(marker_path, "says step " + std::to_string(marker_.step) +
                                           ", but its directory is " + base + " (step " +
                                           std::to_string(named) +
                                           "): the marker was edited or copied from another "
                                           "checkpoint; use an earlier checkpoint");
  }
  for (int r = 0; r < marker_.world_size; ++r) {
    const FileRecord& rec = marker_.manifests[r];
    const std::string path = join(dir_, rec.name);
    FileReader reader(path);
    if (reader.size() > kMaxManifestBytes) throw CheckpointError(path, "manifest too large");
    check_record(reader, rec);
    std::string text(static_cast<size_t>(reader.size()), '\0');
    if (!text.empty()) reader.read_at(0, &text[0], text.size());
    RankManifest m = parse_manifest(text, path);
    if (m.rank != r || m.world_size != marker_.world_size || m.kind != marker_.kind) {
      throw CheckpointError(path, "belongs to rank " + std::to_string(m.rank) + " of " +
                                      std::to_string(m.world_size) + " (" + m.kind +
                                      "), the marker expects rank " + std::to_string(r) + " of " +
                                      std::to_string(marker_.world_size) + " (" + marker_.kind +
                                      ")");
    }
    if (m.step != marker_.step) {
      throw CheckpointError(marker_path, "says step " + std::to_string(marker_.step) + ", but " +
                                             rec.name + " was saved at step " +
                                             std::to_string(m.step) +
                                             ": the marker was edited or copied from another "
                                             "checkpoint; use an earlier checkpoint");
    }
    manifests_.push_back(std::move(m));
  }
  for (const auto& m : manifests_) {
    for (const auto& f : m.files) open_data_file(f);
    for (const auto& t : m.tensors) {
      const DataFile& df = files_.at(t.file);
      const std::string path = join(dir_, t.file);
      const SafetensorsEntry* e = df.header.find(t.tensor);
      if (e == nullptr)
        throw CheckpointError(path, "has no tensor '" + t.tensor + "' (" + t.key + ")");
      if (e->dtype != t.dtype || e->numel() != t.end - t.begin) {
        throw CheckpointError(path, "tensor '" + t.tensor + "' is " + e->dtype + " with " +
                                        std::to_string(e->numel()) +
                                        " elements, the manifest says " + t.dtype + " with " +
                                        std::to_string(t.end - t.begin));
      }
      index_[t.key].push_back(&t);
    }
  }
}

// Note [A reader's open files]
// Every rank's reader reads the header of every data file of the checkpoint
// (each piece a manifest lists is checked against it), and held each file
// open from then on: two per saving rank, so a job of 512 ranks needed more
// descriptors than the usual limit of 1024 on every rank, and resume()
// failed (it had been skipping the checkpoint as damaged). A file is closed
// once its header is read, and opened again when read, its size checked
// against the manifest again and its identity (device and inode) against
// the file whose header was read, so that a file replaced meanwhile is an
// error, not data whose CRC-32 was never checked (that is checked in full
// before the first read, Note [Each rank checks what it reads]); at most
// kOpenDataFiles stay open, the most recently used (a rank reads its own
// files, and rank 0's model file for the buffers, piece after piece). A
// checkpoint removed while it is read (another job's retention) now fails
// the load where it reopens a file; the files held open let it finish.
// Where an open meets the open-file limit, the reader closes its own and
// tries once more: one descriptor free is enough.
constexpr size_t kOpenDataFiles = 4;

void CheckpointReader::open_data_file(const FileRecord& record) {
  if (files_.count(record.name) != 0) return;
  const std::string path = join(dir_, record.name);
  DataFile df;
  const FileReader reader(path);
  df.record = record;
  if (checks_ == DataChecks::kEveryFile) {
    check_record(reader, record);
    verified_.insert(record.name);
  } else {
    check_size(reader, record);  // the CRC-32 before the first read
  }
  unsigned char prefix[8];
  reader.read_at(0, prefix, 8 <= reader.size() ? 8 : 0);
  const uint64_t n = check_header_length(prefix, reader.size(), path);
  std::string json(static_cast<size_t>(n), '\0');
  if (n > 0) reader.read_at(8, &json[0], json.size());
  df.header = parse_safetensors_header(json.data(), json.size(), reader.size(), path);
  df.identity = reader.identity();
  files_.emplace(record.name, std::move(df));
}

std::shared_ptr<const FileReader> CheckpointReader::reader_of(const std::string& name) const {
  std::lock_guard<std::mutex> lock(open_mutex_);
  for (auto it = open_.begin(); it != open_.end(); ++it) {
    if (it->first != name) continue;
    open_.splice(open_.begin(), open_, it);
    return open_.front().second;
  }
  if (open_.size() >= kOpenDataFiles) open_.pop_back();
  const std::string path = join(dir_, name);
  std::shared_ptr<const FileReader> reader;
  try {
    reader = std::make_shared<const FileReader>(path);
  } catch (const CheckpointAccessError&) {
    if (open_.empty()) throw;
    open_.clear();  // this reader's own descriptors made the difference
    reader = std::make_shared<const FileReader>(path);
  }
  const DataFile& df = files_.at(name);
  if (reader->identity() != df.identity) {
    throw CheckpointError(path,
                          "was replaced while the checkpoint was read (a save or a retention of "
                          "the same directory by another job?); load again");
  }
  check_size(*reader, df.record);
  open_.emplace_front(name, reader);
  return reader;
}

std::vector<const TensorRecord*> CheckpointReader::pieces(const std::string& key) const {
  const auto it = index_.find(key);
  return it == index_.end() ? std::vector<const TensorRecord*>{} : it->second;
}

std::vector<std::string> CheckpointReader::keys() const {
  std::vector<std::string> out;
  for (const auto& kv : index_) out.push_back(kv.first);
  return out;
}

void CheckpointReader::verify_file(const TensorRecord& piece) const {
  if (verified_.count(piece.file) != 0) return;
  check_record(*reader_of(piece.file), files_.at(piece.file).record);
  verified_.insert(piece.file);
}

void CheckpointReader::read(const TensorRecord& piece, int64_t begin, int64_t end,
                            void* dst) const {
  verify_file(piece);
  if (begin < piece.begin || end > piece.end || begin > end) {
    throw CheckpointError(join(dir_, piece.file),
                          piece.key + ": elements [" + std::to_string(begin) + ", " +
                              std::to_string(end) + ") are not in this piece");
  }
  const DataFile& df = files_.at(piece.file);
  const SafetensorsEntry* e = df.header.find(piece.tensor);
  const uint64_t elem = dtype_size(piece.dtype);
  reader_of(piece.file)
      ->read_at(df.header.data_start + e->begin + static_cast<uint64_t>(begin - piece.begin) * elem,
                dst, static_cast<size_t>(end - begin) * elem);
}

std::string step_name(int64_t step) {
  char name[32];
  std::snprintf(name, sizeof(name), "step-%010lld", static_cast<long long>(step));
  return name;
}

std::string staging_name(int64_t step) { return "." + step_name(step) + ".saving"; }

bool is_staging_name(const std::string& name) {
  // Whether `name` is `prefix` + a step_name() + `suffix`.
  const auto around_a_step = [&](const std::string& prefix, const std::string& suffix) {
    return name.size() > prefix.size() + suffix.size() && name.rfind(prefix, 0) == 0 &&
           name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0 &&
           step_of_name(name.substr(prefix.size(), name.size() - prefix.size() - suffix.size())) >=
               0;
  };
  return around_a_step(".", ".saving") || around_a_step("", ".replaced");
}

int64_t step_of_name(const std::string& name) {
  // Only names step_name() makes, so that a step number names the
  // directory (Checkpointer::resume broadcasts the step, not the name):
  // ten digits or more (a step counted in tokens seen has more).
  if (name.size() < 15 || name.rfind("step-", 0) != 0 ||
      name.find_first_not_of("0123456789", 5) != std::string::npos)
    return -1;
  int64_t step = -1;
  const char* last = name.data() + name.size();
  const auto parsed = std::from_chars(name.data() + 5, last, step);
  if (parsed.ec != std::errc() || parsed.ptr != last) return -1;  // beyond int64
  return step_name(step) == name ? step : -1;
}

namespace {

// The sequence of the marker at `marker`, or nullopt where it is damaged
// (verifying it says why). A marker this process cannot read (EMFILE, EIO:
// CheckpointAccessError) is no damage: that throws, so that neither resume()
// nor retention acts on an order it could not see.
std::optional<int64_t> sequence_of(const std::string& marker) {
  try {
    return parse_marker(read_small_file(marker, kMaxManifestBytes), marker).sequence;
  } catch (const CheckpointAccessError&) {
    throw;
  } catch (const CheckpointError&) {
    return std::nullopt;
  }
}

// The names under a checkpoint parent; none where it does not exist.
std::vector<std::string> parent_entries(const std::string& parent) {
  std::error_code ec;
  std::vector<std::string> names = list_dir(parent, ec);
  if (ec == std::errc::no_such_file_or_directory) return {};
  if (ec) {
    throw_file_error(parent, "cannot list the checkpoint directory: " + ec.message(), ec.value());
  }
  return names;
}

}  // namespace

std::vector<StepDirectory> step_directories(const std::string& parent) {
  std::vector<StepDirectory> out;
  for (const std::string& name : parent_entries(parent)) {
    const int64_t step = step_of_name(name);
    if (step < 0) continue;
    StepDirectory s;
    s.step = step;
    s.path = join(parent, name);
    // lstat: a marker that is not a regular file is found (and refused when
    // verified); one in a "step-" entry that is not a directory is not.
    const std::string marker = join(s.path, kCompletionMarker);
    s.marked = is_marked(marker);
    if (s.marked) s.sequence = sequence_of(marker);
    out.push_back(std::move(s));
  }
  // See Note [Checkpoints saved last]. A damaged marker first, by step, as
  // before the order: resume() then tries it first and warns that it skips
  // it; retention leaves it alone (tidy_checkpoints).
  std::sort(out.begin(), out.end(), [](const StepDirectory& a, const StepDirectory& b) {
    const bool a_damaged = a.marked && !a.sequence, b_damaged = b.marked && !b.sequence;
    if (a_damaged != b_damaged) return a_damaged;
    const int64_t as = a.sequence.value_or(0), bs = b.sequence.value_or(0);
    return as != bs ? as > bs : a.step > b.step;
  });
  return out;
}

// Note [Checkpoints saved last]
// resume() loads the checkpoint saved last, which is the one of the highest
// step except where a run was rolled back: a run that loaded step 800 of
// 800, 900 and 1000 and saved 850 and 860 before it crashed resumed from
// 1000, the run it had abandoned, and the retention of that resume counted
// 1000 and 900 as the newest and removed everything the rolled-back run had
// saved. So each marker carries its place among the saves into its parent
// (one more than the highest there, taken when rank 0 seals it), and the
// step directories are ordered by it, then by step: resume(),
// latest_checkpoint() and keep_last's count follow the order of the saves.
// A marker written before the field has 0, so older checkpoints keep their
// order by step and any new save comes after them (a save by an older
// libfsdp into a parent of newer ones comes before them). Copying
// checkpoints (cp without -p) keeps the order, which no modification time
// would. The highest is taken over complete saves still under staging
// names too (a replacement cut short, put back at the next resume or
// save_step: Note [A replacement cut short]). Two saves into one parent at
// once may take the same number; the step then orders them.
int64_t next_sequence(const std::string& parent) {
  int64_t highest = 0;
  for (const std::string& name : parent_entries(parent)) {
    if (step_of_name(name) < 0 && !is_staging_name(name)) continue;
    const std::string marker = join(join(parent, name), kCompletionMarker);
    if (!is_marked(marker)) continue;
    highest = std::max(highest, sequence_of(marker).value_or(0));
  }
  return highest + 1;
}

}  // namespace fsdp::detail
