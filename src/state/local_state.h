#pragma once

// What this rank holds of a model's original tensors, as pieces of their
// flattened forms, and of their optimizer state. See Note [State pieces].

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <map>
#include <string>
#include <unordered_map>
#include <vector>

#include <fsdp/comm/process_group.h>
#include <fsdp/runtime/unit.h>

#include "core/flat_parameter.h"

namespace fsdp::detail {

/// Elements [begin, end) of an original parameter or buffer, flattened, that
/// this rank holds.
struct LocalPiece {
  std::string name;  ///< original name ("block.0.weight")
  /// Its other names, where the tensor is tied (Note [Tied parameters]).
  std::vector<std::string> aliases;
  std::vector<int64_t> shape;  ///< original full shape
  int64_t numel = 0;           ///< original numel
  int64_t begin = 0, end = 0;  ///< element range held here
  at::Tensor data;             ///< 1-D view of the local values (end - begin elements)
  /// The dtype it is saved and loaded in: data's, but a buffer's from
  /// before MixedPrecision::buffer_dtype (see CastBuffer).
  at::ScalarType saved_dtype = at::kFloat;
  at::Tensor optim_param;    ///< what the optimizer steps (undefined for buffers)
  int64_t optim_offset = 0;  ///< where `data` starts inside optim_param, flattened
  Unit* unit = nullptr;      ///< the unit that shards it, nullptr when not sharded
  size_t slot = 0;           ///< its slot in unit->flat_param()
  bool replicated = false;   ///< every rank holds it whole (buffers, NO_SHARD, unmanaged)
  bool is_buffer = false;    ///< a buffer (no optimizer state)
  /// A copy of a shard that a rank of the first node saves (HYBRID_SHARD on
  /// the other nodes, Note [Hybrid sharding]).
  bool saved_elsewhere = false;

  /// Its name, then its aliases.
  std::vector<std::string> names() const {
    std::vector<std::string> out{name};
    out.insert(out.end(), aliases.begin(), aliases.end());
    return out;
  }
};

/// A unit with parameters and its module path.
struct UnitEntry {
  Unit* unit = nullptr;
  std::string prefix;  ///< module path plus "." ("" for the root)
};

/// Units with parameters under `root`, pre-order (the same order on every rank).
std::vector<UnitEntry> units_with_params(torch::nn::Module& root);

/// Every piece this rank holds: units' slots (pre-order), then parameters no
/// unit manages, then buffers; each tensor once, under the first name the
/// root's named_parameters() (named_buffers()) reaches it by.
std::vector<LocalPiece> local_pieces(torch::nn::Module& root);

/// The whole job's group of the first unit (for HYBRID_SHARD its world, not
/// its node), the default group if there is one, else nullptr.
ProcessGroup* state_group(torch::nn::Module& root);

/// Optimizer state of one optimizer parameter, by state name.
struct ParamState {
  std::map<std::string, at::Tensor> tensors;  ///< "exp_avg", "momentum_buffer", ...
  int64_t step = -1;                          ///< Adam's step; -1 when none
};

/// Reads and writes torch::optim state by parameter (see Note [Optimizer keys]).
/// Supports SGD, Adam, AdamW, RMSprop and Adagrad: every torch::optim
/// optimizer whose state is elementwise (LBFGS's is not).
class OptimAccess {
 public:
  explicit OptimAccess(torch::optim::Optimizer& opt);
  /// The tensor state names this optimizer keeps.
  const std::vector<std::string>& state_names() const { return names_; }
  /// Every tensor state name this kind of optimizer may keep with other
  /// options (Adam's max_exp_avg_sq with amsgrad; RMSprop's momentum_buffer
  /// and grad_avg): saved by one, loaded into another, they go unused.
  const std::vector<std::string>& possible_state_names() const { return possible_; }
  /// The tensor state names the group that steps `param` keeps (Adam's
  /// max_exp_avg_sq with amsgrad only; RMSprop's momentum_buffer and
  /// grad_avg with momentum and centered); state_names() where none does.
  std::vector<std::string> state_names(const at::Tensor& param) const;
  /// Whether a parameter group of the optimizer steps `param`.
  bool steps(const at::Tensor& param) const;
  /// The option a group needs to keep state `name` ("amsgrad(true)"), for
  /// messages; "" for state every group of the kind keeps.
  static const char* option_keeping(const std::string& name);
  /// The kinds of optimizer that keep state `name` ("Adam and AdamW"), for
  /// messages; "" for a name none keeps.
  static const char* kinds_keeping(const std::string& name);
  /// This optimizer's kind ("SGD", "Adam", ...), for messages.
  const char* kind_name() const;
  /// True for optimizers with a step count (Adam, AdamW, RMSprop, Adagrad).
  bool has_step() const { return has_step_; }
  /// The state of `param`; false if it has none yet.
  bool get(const at::Tensor& param, ParamState& out) const;
  /// Replaces the state of `param`.
  void set(const at::Tensor& param, const ParamState& state);
  /// Drops the state of `param` (as if it was never stepped); Adagrad's,
  /// which its constructor makes, is made afresh.
  void clear(const at::Tensor& param);
  /// The states ("step" among them) that a parameter with any state saved
  /// must have: what every optimizer of the kind keeps.
  std::vector<std::string> required_state_names() const;
  /// Refuses (alike on every rank) an optimizer that steps a tensor no piece
  /// of the model is (one added with add_param_group): its values and state
  /// would be left out of the state saved, or not restored.
  void check_steps_only(const std::vector<LocalPiece>& pieces) const;
  /// Each parameter group's hyperparameters that training changes (lr,
  /// betas, eps, weight_decay; SGD's momentum and dampening; RMSprop's
  /// alpha; Adagrad's lr_decay), by name: what PyTorch's optimizer
  /// state_dict keeps in its param_groups. With `pieces` (the model's),
  /// also "params": how many of the model's parameters the group steps, by
  /// name, whatever the wrapping and world size.
  std::vector<std::map<std::string, double>> group_options(
      const std::vector<LocalPiece>* pieces = nullptr) const;
  /// Sets what group_options() returned, group by group (the same number of
  /// groups, each of the size saved where "params" was, as torch::load
  /// checks; else an error naming `where`). amsgrad, nesterov, RMSprop's
  /// centered and whether its momentum is 0 stay as constructed: they decide
  /// which state exists.
  void set_group_options(const std::vector<std::map<std::string, double>>& groups,
                         const std::vector<LocalPiece>& pieces, const std::string& where);
  /// set_group_options()'s checks alone: the same errors, nothing set.
  void check_group_options(const std::vector<std::map<std::string, double>>& groups,
                           const std::vector<LocalPiece>& pieces, const std::string& where) const;

 private:
  /// The options of the group that steps `param`; nullptr if none does.
  const torch::optim::OptimizerOptions* options_of(const at::Tensor& param) const;
  /// The tensor state names a group with options `o` keeps.
  std::vector<std::string> names_kept(const torch::optim::OptimizerOptions& o) const;
  /// How many of `pieces`' parameters each parameter group steps.
  std::vector<int64_t> params_per_group(const std::vector<LocalPiece>& pieces) const;

  torch::optim::Optimizer& opt_;
  enum class Kind { kSgd, kAdam, kAdamW, kRmsprop, kAdagrad } kind_;
  std::vector<std::string> names_, possible_;
  bool has_step_ = false;
  /// Each stepped parameter's group (its first, as options_of() found it).
  std::unordered_map<const c10::TensorImpl*, size_t> group_of_;
};

/// Adam's step count as PyTorch's optimizers keep and save it: a 0-d float32
/// tensor (so a libfsdp checkpoint's optimizer state loads into PyTorch's
/// Adam as it is; float32 holds every count below 2^24 exactly).
at::Tensor step_tensor(int64_t step);
/// The step count in `t`: a 0-d or one-element tensor of integral value,
/// float (as PyTorch and libfsdp save it) or int64 (libfsdp before 2026-11).
/// `where` names it in the error.
int64_t step_value(const at::Tensor& t, const std::string& where);

/// The safetensors dtype of a scalar type; throws for an unsupported one,
/// naming `key` (the tensor: "model/<name>", "optim/<name>/<state>").
std::string safetensors_dtype(at::ScalarType t, const std::string& key);
/// The scalar type of a safetensors dtype.
at::ScalarType scalar_type_of(const std::string& dtype);

}  // namespace fsdp::detail
