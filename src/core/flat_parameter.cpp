#include "core/flat_parameter.h"

#include "detail/error.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <algorithm>

#include "core/device_storage.h"
#include "core/sharded_placeholder.h"
#include "detail/torch_compat.h"

namespace fsdp {

const char* to_string(FlatParameter::State state) {
  switch (state) {
    case FlatParameter::State::kSharded:
      return "sharded";
    case FlatParameter::State::kUnsharding:
      return "unsharding";
    case FlatParameter::State::kUnsharded:
      return "unsharded";
    case FlatParameter::State::kSummoned:
      return "summoned in full precision";
  }
  return "?";
}

namespace {

// A tensor of `numel` elements whose storage holds 0 bytes: the freed state of
// an unsharded buffer, made without ever allocating it.
at::Tensor freed_buffer(int64_t numel, const at::TensorOptions& options) {
  at::Tensor t = at::empty({0}, options);
  t.unsafeGetTensorImpl()->set_sizes_contiguous({numel});
  return t;
}

// A view of `base`'s storage, built on the TensorImpl so that it can be made
// while the storage is freed (narrow/view would check the storage's bounds).
at::Tensor storage_view(const at::Tensor& base, int64_t offset, at::IntArrayRef shape) {
  at::Tensor v = at::empty({0}, base.options());
  std::vector<int64_t> strides(shape.size(), 1);
  for (int64_t d = static_cast<int64_t>(shape.size()) - 2; d >= 0; --d) {
    strides[d] = strides[d + 1] * std::max<int64_t>(shape[d + 1], 1);
  }
  auto* impl = v.unsafeGetTensorImpl();
  impl->set_storage_keep_dtype(base.storage());
  impl->set_sizes_and_strides(shape, strides);
  impl->set_storage_offset(offset);
  return v;
}

}  // namespace

FlatParameter::FlatParameter(std::vector<std::pair<std::string, at::Tensor>> params,
                             std::shared_ptr<ProcessGroup> group, bool keep_unsharded)
    : FlatParameter(std::move(params), std::move(group),
                    FlatParamConfig().keep_unsharded(keep_unsharded)) {}

FlatParameter::FlatParameter(std::vector<std::pair<std::string, at::Tensor>> params,
                             std::shared_ptr<ProcessGroup> group, FlatParamConfig config)
    : group_(std::move(group)),
      keep_unsharded_(config.keep_unsharded()),
      listener_(config.use_listener()) {
  TORCH_INTERNAL_ASSERT(!params.empty(), "fsdp: a FlatParameter needs at least one parameter");
  TORCH_INTERNAL_ASSERT(group_, "fsdp: a FlatParameter needs a process group");
  const at::ScalarType dtype = params.front().second.scalar_type();
  bool any_meta = false;
  for (auto& [name, p] : params) {
    FSDP_CHECK(p.device() == config.device() || p.is_meta(), group_->rank(), name,
               "expected a parameter on the unit's device, ", config.device(),
               " (or on the meta device), got one on ", p.device(),
               ". Move the module there with ->to() before wrapping it");
    FSDP_CHECK(p.scalar_type() == dtype, group_->rank(), name,
               "all parameters of a unit must share one dtype; expected ", dtype, ", got ",
               p.scalar_type(), ". Convert the module with ->to(dtype) before wrapping");
    any_meta = any_meta || p.is_meta();
    FlatParamSlot slot;
    slot.name = name;
    slot.param = p;
    slot.shape = p.sizes().vec();
    slot.offset = numel_;
    slot.numel = p.numel();
    numel_ += slot.numel;
    slots_.push_back(std::move(slot));
  }
  TORCH_INTERNAL_ASSERT(!any_meta || config.fill(), "fsdp(", slots_.front().name,
                        "): parameters on the meta device need a fill function");
  const int64_t world = group_->size();
  shard_numel_ = keep_unsharded_ ? numel_ : (numel_ + world - 1) / world;
  padded_numel_ = keep_unsharded_ ? numel_ : shard_numel_ * world;
  unsharded_ =
      freed_buffer(padded_numel_, at::TensorOptions().dtype(dtype).device(config.device()));
  state_ = State::kSharded;

  bool any_trainable = false;
  for (const auto& slot : slots_) any_trainable = any_trainable || slot.param.requires_grad();
  at::NoGradGuard no_grad;
  if (config.fill() || keep_unsharded_) {
    build_through_unsharded(config);
  } else {
    build_shard_directly();
  }
  if (config.offload_shard()) offload_shard(config.pin_shard());
  shard_.set_requires_grad(any_trainable);
  // Built through the unsharded buffer: free it, unless it is the shard.
  // Its memory came from the current stream, which orders the free too.
  if (frees_unsharded() && state_ == State::kUnsharded) (void)reshard();
  if (config.param_dtype() && *config.param_dtype() != dtype) {
    use_low_precision(*config.param_dtype());
  }
  grad_dtype_ = config.reduce_dtype().value_or(config.param_dtype().value_or(dtype));
  // Built sharded (or made low precision): bound to views of a freed buffer.
  if (frees_unsharded() && state_ == State::kSharded) point_at_placeholders();
  if (listener_ != nullptr) detail::track_storage(unsharded_, listener_);
}

FlatParameter::~FlatParameter() {
  // A gathered buffer on a device with streams may still be read by queued
  // kernels: its memory goes back once the copy-in stream, which reuses it,
  // waited for them (Note [Copy-in on a stream of its own]).
  // A model that outlives main (a static) is destroyed after the CUDA
  // runtime may be gone: an error then must not terminate the exit.
  if (state_ == State::kUnsharded && frees_unsharded() &&
      detail::has_streams(unsharded_.device())) {
    try {
      detail::HeldMemory(unsharded_.storage().unsafeGetStorageImpl()).release();
    } catch (...) {  // NOLINT(bugprone-empty-catch): a destructor; the device is gone
    }
  }
  for (const auto& p : placeholders_) detail::release_placeholder(p);
  if (listener_ != nullptr) detail::untrack_storage(unsharded_);
}

void FlatParameter::set_unit_path(const std::string& path) {
  unit_path_ = path;
  unit_label_ = path.empty() ? "the root FSDP unit" : "FSDP unit '" + path + "'";
  for (size_t i = 0; i < placeholders_.size(); ++i) {
    detail::rename_placeholder(placeholders_[i],
                               "parameter '" + slots_[i].name + "' of " + unit_label_);
  }
}

void FlatParameter::point_at_views() {
  const detail::OwnSetData own;
  for (size_t i = 0; i < slots_.size(); ++i) slots_[i].param.set_data(views_[i]);
}

void FlatParameter::point_at_placeholders() {
  // See Note [Sharded placeholders]; same dtype as the views, so set_data
  // keeps each parameter's grad accumulator.
  if (placeholders_.empty() || placeholders_[0].scalar_type() != unsharded_.scalar_type()) {
    for (const auto& p : placeholders_) detail::release_placeholder(p);
    placeholders_.clear();
    for (size_t i = 0; i < slots_.size(); ++i) {
      placeholders_.push_back(detail::make_placeholder(
          views_[i], detail::PlaceholderKind::kParameter,
          "parameter '" + slots_[i].name + "' of " + unit_label_, listener_));
    }
  }
  const detail::OwnSetData own;
  for (size_t i = 0; i < slots_.size(); ++i) slots_[i].param.set_data(placeholders_[i]);
}

void FlatParameter::bind(FlatParamSlot& slot) {
  at::Tensor view = storage_view(unsharded_, slot.offset, slot.shape);
  if (listener_ != nullptr) view = detail::tracked_alias(view);
  views_.resize(slots_.size());
  views_[&slot - slots_.data()] = view;
  if (slot.param.is_meta()) {
    // set_data refuses meta -> CPU; on a meta parameter no autograd state
    // (grad accumulator) exists yet, so swapping the TensorImpl's metadata
    // is all set_data would do. Keeps the TensorImpl, so every handle to the
    // parameter (typed members, registered entries) sees the new storage.
    slot.param.unsafeGetTensorImpl()->shallow_copy_from(view.getIntrusivePtr());
  } else {
    // Same TensorImpl, grad accumulator (same dtype) and requires_grad; new
    // storage. The unit's own set_data (Note [Sharded placeholders]).
    const detail::OwnSetData own;
    slot.param.set_data(view);
  }
}

void FlatParameter::build_shard_directly() {
  // Each rank copies only its piece of each parameter; the original storages
  // are released as the parameters are rebound, one by one.
  shard_ = at::zeros({shard_numel_}, unsharded_.options());
  for (size_t i = 0; i < slots_.size(); ++i) {
    copy_into_shard(i, slots_[i].param);
    bind(slots_[i]);
  }
}

void FlatParameter::copy_into_shard(size_t i, const at::Tensor& full) {
  const ShardPart part = shard_part(i);
  if (part.numel == 0) return;
  shard_.detach()
      .narrow(0, part.in_shard, part.numel)
      .copy_(full.reshape({-1}).narrow(0, part.in_param, part.numel));
}

FlatParameter::ShardPart FlatParameter::shard_part(size_t i) const {
  const FlatParamSlot& slot = slots_[i];
  const int64_t begin = shard_offset();
  const int64_t lo = std::max(begin, slot.offset);
  const int64_t hi = std::min(begin + shard_numel_, slot.offset + slot.numel);
  if (lo >= hi) return {};
  return {lo - begin, lo - slot.offset, hi - lo};
}

void FlatParameter::build_through_unsharded(const FlatParamConfig& config) {
  resize_unsharded_storage(true);
  state_ = State::kUnsharded;
  unsharded_.narrow(0, numel_, padded_numel_ - numel_).zero_();  // padding stays zero
  for (size_t i = 0; i < slots_.size(); ++i) {
    auto& slot = slots_[i];
    if (!slot.param.is_meta()) slot_view(unsharded_, i).copy_(slot.param.reshape({-1}));
    bind(slot);
  }
  if (config.fill()) config.fill()(unsharded_);
  if (keep_unsharded_) {
    shard_ = unsharded_.detach();
  } else {
    shard_ = unsharded_.narrow(0, shard_offset(), shard_numel_).clone();
  }
}

void FlatParameter::use_low_precision(at::ScalarType dtype) {
  // See Note [Mixed precision]. The full-precision values live on in the
  // shard (for NO_SHARD, the shard keeps the old buffer's storage).
  TORCH_INTERNAL_ASSERT(state_ == State::kSharded || keep_unsharded_);
  low_precision_ = true;
  unsharded_ = freed_buffer(padded_numel_, unsharded_.options().dtype(dtype));
  state_ = State::kSharded;
  // A new dtype drops the parameters' grad accumulators: the unit registers
  // its gradient hooks after this.
  for (auto& slot : slots_) bind(slot);
}

void FlatParameter::offload_shard(bool pinned) {
  // Note [Shards in host memory]
  // With CPU offload the shard, and so its gradient and the optimizer's
  // state, live in host memory (pinned for a GPU: asynchronous copies), the
  // unsharded buffer on the device. The shard is built on the device as
  // without offload and copied out once, unit by unit, so at most one
  // shard of device memory is ever needed for it. Each unshard copies it
  // back in on the caller's current stream, in the parameters' compute
  // dtype (begin_unshard), before the all-gather that reads the copy; the
  // reduced gradient is copied out before it reaches the shard's .grad
  // (UnitRuntime::grad_for_shard), which waits for the device, so the
  // optimizer never steps a shard while a copy of it is still pending. On
  // the CPU the same copies run between host buffers: the reference path.
  at::Tensor host = detail::host_buffer(shard_numel_, shard_.scalar_type(), pinned, unit_label_);
  host.copy_(shard_);
  shard_ = host;
  offloaded_ = true;
  pinned_shard_ = pinned;
}

const at::Tensor& FlatParameter::low_precision_host_copy() {
  // Note [A host copy in the compute dtype]
  // Under CPU offload with mixed precision each unshard sends the fp32 host
  // shard to the device and casts it: 4 bytes an element over PCIe where the
  // all-gather needs 2. A host copy in the compute dtype halves that, if it
  // is as new as the shard; fsdp::optim::FusedAdamW writes it in the pass
  // that steps the shard (its set_low_precision_copy), so keeping it costs a
  // write of 2 bytes an element in a pass that moves 28. Anything else may
  // write the shard too (load_state_dict, another optimizer, the user), so
  // the copy is used only while the shard's version counter and the copy's
  // have moved alike since it was filled here: the fused step bumps each once
  // per step (in place through a pointer, it bumps them itself; so does a
  // sharded checkpoint's reader); any other write bumps the shard's alone,
  // and the next begin_unshard fills the copy here again before sending it.
  TORCH_INTERNAL_ASSERT(offloaded_ && low_precision_, unit_label_,
                        ": a compute-dtype host copy is for an offloaded low-precision shard");
  if (!low_precision_host_.defined()) {
    low_precision_host_ =
        detail::host_buffer(shard_numel_, param_dtype(), pinned_shard_, unit_label_);
  } else {
    // Written anew: earlier reads of it finish first, sends on the copy-in
    // stream, and NO_SHARD's copies (or all of them, without side streams)
    // on the current one.
    detail::wait_for_side_stream(unsharded_.device(), detail::SideStream::kCopyIn);
    detail::wait_for_current_stream(unsharded_.device());
  }
  at::NoGradGuard no_grad;
  low_precision_host_.copy_(shard_);
  shard_version_base_ = shard_._version();
  copy_version_base_ = low_precision_host_._version();
  return low_precision_host_;
}

bool FlatParameter::low_precision_copy_current() const {
  return low_precision_host_.defined() && shard_._version() - shard_version_base_ ==
                                              low_precision_host_._version() - copy_version_base_;
}

std::function<void(int64_t, int64_t)> FlatParameter::copy_in_ahead_sender() {
  if (!offloaded_ || !low_precision_ || keep_unsharded_ || !low_precision_copy_current()) return {};
  if (!ahead_) ahead_ = std::make_shared<detail::CopyInAhead>(unsharded_.device());
  // By value: the sender may outlive this unit's use on the optimizer's thread.
  const detail::CopyInAhead::Versions handed_over{shard_._version(),
                                                  low_precision_host_._version()};
  return [ahead = ahead_, shard = shard_, copy = low_precision_host_, handed_over](int64_t begin,
                                                                                   int64_t end) {
    ahead->send(copy, begin, end, {shard._version(), copy._version()}, handed_over);
  };
}

at::Tensor FlatParameter::slot_view(const at::Tensor& flat, size_t i) const {
  return flat.narrow(0, slots_[i].offset, slots_[i].numel);
}

void FlatParameter::copy_unsharded_into_shard() {
  copy_unsharded_into_shard(shard_offset(), shard_offset() + shard_numel_);
}

void FlatParameter::copy_unsharded_into_shard(int64_t begin, int64_t end) {
  const bool summoned = state_ == State::kSummoned;
  TORCH_INTERNAL_ASSERT(summoned || (frees_unsharded() && state_ == State::kUnsharded), unit_label_,
                        ": write-back expected an unsharded buffer apart from the shard, state ",
                        to_string(state_));
  const int64_t lo = std::max(begin, shard_offset());
  const int64_t hi = std::min(end, shard_offset() + shard_numel_);
  if (lo >= hi) return;
  at::NoGradGuard no_grad;
  const at::Tensor& full = summoned ? summoned_ : unsharded_;
  shard_.detach().narrow(0, lo - shard_offset(), hi - lo).copy_(full.narrow(0, lo, hi - lo));
  if (!summoned) gathered_version_ = shard_._version();  // written from what is gathered
}

// Note [Summoning in full precision]
// Under mixed precision the unsharded buffer holds the param_dtype copies,
// but SummonFullParams shows the full-precision values, as PyTorch's FSDP1
// does (its summon_full_params forces full precision): what a user reads,
// writes back or saves with torch::save is the model, not its compute
// copies. So SummonFullParams gathers every rank's shard, as it is, into a
// buffer of its own and points the original parameters at its views; the
// unsharded buffer stays freed. Two costs of changing the parameters' dtype
// with set_data: autograd forgets their gradient accumulators (which carry
// the unit's hooks), so end_summon makes them the accumulators again; and
// no forward or backward may gather the unit meanwhile (UnitRuntime refuses,
// as FSDP1 refuses a forward inside summon_full_params). NO_SHARD's shard is
// the whole buffer: it is copied, so that writes without writeback are
// dropped as for the other strategies. SummonOptions::offload_to_cpu takes
// the same way for every unit that shards on a GPU, with the buffer in host
// memory (its device copy freed before the next unit gathers).
void FlatParameter::begin_summon(at::Tensor full) {
  TORCH_INTERNAL_ASSERT(
      state_ == State::kSharded && (low_precision_ || full.device() != unsharded_.device()),
      unit_label_, ": begin_summon in state ", to_string(state_));
  TORCH_INTERNAL_ASSERT(full.numel() == padded_numel_ && full.scalar_type() == shard_.scalar_type(),
                        unit_label_, ": begin_summon expects the full-precision buffer");
  if (full.data_ptr() == shard_.data_ptr()) full = full.clone();  // NO_SHARD's shard
  summoned_ = full.detach();
  summoned_accumulators_.clear();
  // A unit made in place sees operators on the summoned views too: torch::load
  // inside the guard reaches it (Note [torch::load into a unit made in place]).
  // Uses are not reported (no forward can run on it; another thread may read
  // it while the guard holds it): only set_ reaches the unit.
  if (listener_ != nullptr) detail::track_storage(summoned_, listener_, /*report=*/false);
  const detail::OwnSetData own;
  for (auto& slot : slots_) {
    summoned_accumulators_.push_back(torch::autograd::impl::try_get_grad_accumulator(slot.param));
    at::Tensor view = summoned_.narrow(0, slot.offset, slot.numel).view(slot.shape);
    if (listener_ != nullptr) view = detail::tracked_alias(view);
    slot.param.set_data(view);
  }
  state_ = State::kSummoned;
}

void FlatParameter::end_summon() {
  TORCH_INTERNAL_ASSERT(state_ == State::kSummoned, unit_label_, ": end_summon in state ",
                        to_string(state_));
  point_at_placeholders();
  if (listener_ != nullptr) detail::untrack_storage(summoned_);
  for (size_t i = 0; i < slots_.size(); ++i) {
    if (summoned_accumulators_[i]) {
      compat::set_grad_accumulator(slots_[i].param, summoned_accumulators_[i]);
    }
  }
  summoned_accumulators_.clear();
  summoned_ = at::Tensor();
  state_ = State::kSharded;
}

at::Tensor FlatParameter::new_flat_grad() const {
  // On the device, where the parameters' gradients are (not the shard's
  // host memory under offload).
  return at::empty({padded_numel_}, unsharded_.options().dtype(grad_dtype_).requires_grad(false));
}

void FlatParameter::zero_padding(const at::Tensor& flat) const {
  if (padded_numel_ > numel_) flat.narrow(0, numel_, padded_numel_ - numel_).zero_();
}

void FlatParameter::resize_unsharded_storage(bool allocate) {
  // Resizing the StorageImpl in place (not replacing the tensor) is what lets
  // autograd's saved views of the parameters see the refilled buffer.
  detail::resize_storage_bytes(unsharded_.storage().unsafeGetStorageImpl(),
                               allocate ? padded_numel_ * unsharded_.element_size() : 0);
}

at::Tensor FlatParameter::begin_unshard() {
  TORCH_INTERNAL_ASSERT(state_ == State::kSharded, unit_label_, ": begin_unshard in state ",
                        to_string(state_));
  resize_unsharded_storage(true);
  point_at_views();
  gathered_version_ = shard_._version();
  if (low_precision_host_.defined() && !low_precision_copy_current()) {
    // Something other than the fused step wrote the shard (a checkpoint
    // loaded, the user): cast the copy anew, once, so the unshards that
    // follow still send 2 bytes an element.
    low_precision_host_copy();
  }
  at::Tensor input = shard_.detach();
  // From host memory in another dtype: cast on the device.
  const auto source = [this] {
    return detail::staged_for_cast(unshard_source().detach(), unsharded_.device(),
                                   unsharded_.scalar_type(), /*non_blocking=*/pinned_shard_);
  };
  if (keep_unsharded_) {
    at::NoGradGuard no_grad;
    unsharded_.copy_(source(), /*non_blocking=*/pinned_shard_);
    state_ = State::kUnsharded;
    return input;
  }
  // The low-precision shard, or the offloaded shard's copy on the device:
  // what is all-gathered (the Work keeps it alive). See Note [Shards in
  // host memory].
  if (low_precision_ || offloaded_) {
    // Sent to the device at the step, if nothing wrote the shard or its
    // copy since (Note [Copy-in at the step]).
    std::optional<at::Tensor> ahead;
    if (ahead_) {
      ahead = ahead_->take(
          low_precision_copy_current()
              ? detail::CopyInAhead::Versions{shard_._version(), low_precision_host_._version()}
              : detail::CopyInAhead::Versions{-1, -1});
    }
    input = ahead ? *ahead
                  : source().to(unsharded_.device(), unsharded_.scalar_type(),
                                /*non_blocking=*/pinned_shard_);
  }
  state_ = State::kUnsharding;
  return input;
}

void FlatParameter::end_unshard() {
  TORCH_INTERNAL_ASSERT(state_ == State::kUnsharding, unit_label_, ": end_unshard in state ",
                        to_string(state_));
  state_ = State::kUnsharded;
}

std::optional<detail::HeldMemory> FlatParameter::reshard() {
  TORCH_INTERNAL_ASSERT(frees_unsharded() && state_ == State::kUnsharded, unit_label_,
                        ": reshard in state ", to_string(state_),
                        frees_unsharded() ? "" : " (its buffer is the shard)");
  std::optional<detail::HeldMemory> held;
  if (detail::has_streams(unsharded_.device())) {
    held.emplace(unsharded_.storage().unsafeGetStorageImpl());
  } else {
    resize_unsharded_storage(false);
  }
  point_at_placeholders();
  state_ = State::kSharded;
  return held;
}

}  // namespace fsdp
