#include <fsdp/core/flat_parameter.h>

#include <ATen/ATen.h>
#include <ATen/native/Resize.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/grad_mode.h>

#include "core/sharded_placeholder.h"

namespace fsdp {

const char* to_string(FlatParameter::State state) {
  return state == FlatParameter::State::kSharded ? "sharded" : "unsharded";
}

FlatParameter::FlatParameter(std::vector<std::pair<std::string, at::Tensor>> params,
                             std::shared_ptr<ProcessGroup> group, bool keep_unsharded)
    : group_(std::move(group)), keep_unsharded_(keep_unsharded) {
  TORCH_CHECK(!params.empty(), "fsdp: a FlatParameter needs at least one parameter");
  TORCH_CHECK(group_, "fsdp: a FlatParameter needs a process group");
  const auto options = params.front().second.options();
  for (auto& [name, p] : params) {
    TORCH_CHECK(p.device().is_cpu(), "fsdp(", name, "): expected a CPU parameter, got one on ",
                p.device(), ". libfsdp's CPU engine shards CPU parameters.");
    TORCH_CHECK(p.scalar_type() == options.dtype().toScalarType(), "fsdp(", name,
                "): all parameters of a unit must share one dtype; expected ", options.dtype(),
                ", got ", p.scalar_type(),
                ". Convert the module with ->to(dtype) before wrapping.");
    FlatParamSlot slot;
    slot.name = name;
    slot.param = p;
    slot.shape = p.sizes().vec();
    slot.offset = numel_;
    slot.numel = p.numel();
    numel_ += slot.numel;
    slots_.push_back(std::move(slot));
  }
  const int64_t world = group_->size();
  shard_numel_ = keep_unsharded_ ? numel_ : (numel_ + world - 1) / world;
  padded_numel_ = keep_unsharded_ ? numel_ : shard_numel_ * world;

  at::NoGradGuard no_grad;
  unsharded_ = at::zeros({padded_numel_}, options.requires_grad(false));
  bool any_trainable = false;
  for (size_t i = 0; i < slots_.size(); ++i) {
    auto& slot = slots_[i];
    at::Tensor view = slot_view(unsharded_, i);
    view.copy_(slot.param.reshape({-1}));
    // Same TensorImpl, grad accumulator and requires_grad; new storage.
    views_.push_back(view.view(slot.shape));
    slot.param.set_data(views_.back());
    any_trainable = any_trainable || slot.param.requires_grad();
    if (!keep_unsharded_) {
      placeholders_.push_back(
          detail::make_placeholder(slot.param, detail::PlaceholderKind::kParameter,
                                   "parameter '" + slot.name + "' of an FSDP unit"));
    }
  }
  if (keep_unsharded_) {
    shard_ = unsharded_.detach();
  } else {
    shard_ = unsharded_.narrow(0, group_->rank() * shard_numel_, shard_numel_).clone();
  }
  shard_.set_requires_grad(any_trainable);
  state_ = State::kUnsharded;
  reshard();
}

FlatParameter::~FlatParameter() {
  for (const auto& p : placeholders_) detail::release_placeholder(p);
}

void FlatParameter::set_unit_path(const std::string& path) {
  const std::string unit = path.empty() ? "the root FSDP unit" : "FSDP unit '" + path + "'";
  for (size_t i = 0; i < placeholders_.size(); ++i) {
    detail::rename_placeholder(placeholders_[i], "parameter '" + slots_[i].name + "' of " + unit);
  }
}

at::Tensor FlatParameter::slot_view(const at::Tensor& flat, size_t i) const {
  return flat.narrow(0, slots_[i].offset, slots_[i].numel);
}

void FlatParameter::copy_unsharded_into_shard() {
  if (keep_unsharded_ || state_ != State::kUnsharded) return;
  unshard();  // a pending all-gather must land first
  at::NoGradGuard no_grad;
  shard_.detach().copy_(unsharded_.narrow(0, shard_offset(), shard_numel_));
}

at::Tensor FlatParameter::new_flat_grad() const {
  return at::zeros({padded_numel_}, shard_.options().requires_grad(false));
}

void FlatParameter::resize_unsharded_storage(bool allocate) {
  // Resizing the StorageImpl in place (not replacing the tensor) is what lets
  // autograd's saved views of the parameters see the refilled buffer.
  at::native::resize_bytes_cpu(unsharded_.storage().unsafeGetStorageImpl(),
                               allocate ? padded_numel_ * unsharded_.element_size() : 0);
}

void FlatParameter::unshard_async() {
  if (state_ == State::kUnsharded) return;
  resize_unsharded_storage(true);
  for (size_t i = 0; i < slots_.size(); ++i) slots_[i].param.set_data(views_[i]);
  state_ = State::kUnsharded;
  pending_unshard_ = group_->all_gather_into_tensor(unsharded_, shard_.detach());
}

void FlatParameter::unshard() {
  unshard_async();
  if (pending_unshard_) {
    Work work = std::move(pending_unshard_);
    pending_unshard_ = Work();
    work.wait();
  }
}

void FlatParameter::reshard() {
  if (pending_unshard_) unshard();
  if (keep_unsharded_ || state_ == State::kSharded) return;
  resize_unsharded_storage(false);
  for (size_t i = 0; i < slots_.size(); ++i) slots_[i].param.set_data(placeholders_[i]);
  state_ = State::kSharded;
}

}  // namespace fsdp
