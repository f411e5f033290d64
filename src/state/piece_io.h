#pragma once

// Loading local pieces (see Note [State pieces]) from full tensors in memory
// or from a checkpoint directory.

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/ordered_dict.h>

#include <string>
#include <vector>

#include <fsdp/state/state_dict.h>

#include "state/checkpoint_dir.h"

namespace fsdp::detail {

/// Where stored tensors come from, by key ("model/<name>", "optim/<name>/<state>").
class PieceSource {
 public:
  virtual ~PieceSource() = default;
  /// Whether `key` is stored.
  virtual bool has(const std::string& key) const = 0;
  /// Every stored key.
  virtual std::vector<std::string> keys() const = 0;
  /// The dtype `key` is stored in (which must be stored).
  virtual at::ScalarType dtype(const std::string& key) const = 0;
  /// Checks that `key` is stored with full shape `shape` in `dtype` (an
  /// error naming it otherwise): called on every rank, whatever elements it
  /// reads, so that every rank refuses the same bad input.
  virtual void check(const std::string& key, const std::vector<int64_t>& shape,
                     at::ScalarType dtype) const = 0;
  /// Fills `dst` (1-D, end - begin elements) with elements [begin, end) of
  /// the flattened `key`, whose full shape must be `shape` (check()ed).
  virtual void read(const std::string& key, const std::vector<int64_t>& shape, int64_t begin,
                    int64_t end, const at::Tensor& dst) const = 0;
  /// Said during the checks, before anything is written: elements [begin,
  /// end) of `key` will be read. A source whose bytes are checked when first
  /// read checks them now, so that damage is found before anything loads.
  virtual void will_read(const std::string& /*key*/, int64_t /*begin*/, int64_t /*end*/) const {}
};

/// Full tensors in memory, keyed by `prefix` + their name.
class DictSource : public PieceSource {
 public:
  DictSource(const torch::OrderedDict<std::string, at::Tensor>& dict, std::string prefix);
  bool has(const std::string& key) const override;
  std::vector<std::string> keys() const override;
  at::ScalarType dtype(const std::string& key) const override;
  void check(const std::string& key, const std::vector<int64_t>& shape,
             at::ScalarType dtype) const override;
  void read(const std::string& key, const std::vector<int64_t>& shape, int64_t begin, int64_t end,
            const at::Tensor& dst) const override;

 private:
  const torch::OrderedDict<std::string, at::Tensor>& dict_;
  std::string prefix_;
};

/// Pieces in a verified checkpoint directory, from whichever files hold them.
class FileSource : public PieceSource {
 public:
  explicit FileSource(const CheckpointReader& reader) : reader_(reader) {}
  bool has(const std::string& key) const override;
  std::vector<std::string> keys() const override { return reader_.keys(); }
  at::ScalarType dtype(const std::string& key) const override;
  void check(const std::string& key, const std::vector<int64_t>& shape,
             at::ScalarType dtype) const override;
  void read(const std::string& key, const std::vector<int64_t>& shape, int64_t begin, int64_t end,
            const at::Tensor& dst) const override;
  /// Checks the CRC-32 of the files that hold those elements (Note [Each
  /// rank checks what it reads]).
  void will_read(const std::string& key, int64_t begin, int64_t end) const override;

 private:
  const CheckpointReader& reader_;
};

/// How far a load goes: every check only (so that a caller loading several
/// parts checks them all before it writes any), or the checks and the writes.
enum class PieceLoad { kCheckOnly, kCheckAndWrite };

/// Loads every parameter and buffer of `root` from `src`. Strict (`skipped`
/// null): a missing or unexpected "model/" key is an error; else they are
/// left out and named in *skipped. No communication.
void load_model_pieces(torch::nn::Module& root, const PieceSource& src,
                       PieceLoad how = PieceLoad::kCheckAndWrite,
                       IncompatibleKeys* skipped = nullptr);

/// Replaces `opt`'s state for `root`'s parameters with what `src` holds. No
/// communication.
void load_optim_pieces(torch::nn::Module& root, torch::optim::Optimizer& opt,
                       const PieceSource& src, PieceLoad how = PieceLoad::kCheckAndWrite);

}  // namespace fsdp::detail
