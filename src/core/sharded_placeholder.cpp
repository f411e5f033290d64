#include "core/sharded_placeholder.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/DispatchKeySet.h>
#include <c10/core/TensorImpl.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include "core/device_storage.h"
#include "detail/error.h"
#include "detail/torch_compat.h"

#include <algorithm>
#include <mutex>
#include <sstream>
#include <unordered_map>
#include <utility>
#include <vector>

// See Note [Sharded placeholders].

namespace fsdp::detail {
namespace {

constexpr c10::DispatchKey kKey = c10::DispatchKey::FSDP_PLACEHOLDER_DISPATCH_KEY;

struct Entry {
  PlaceholderKind kind;
  std::string what;
  // A unit made by fully_shard: operators are reported to it (a placeholder
  // gathers it) instead of failing.
  ParamUseListener* listener = nullptr;
  bool tracked = false;  // a gathered unit's storage (track_storage), not a placeholder
  // Operators on it are reported to the listener (track_storage's `report`).
  bool reports = true;
};

// Set while this thread runs an operator (or a listener) for the fallback:
// the operators it calls in turn (a composite's parts, the unit's own
// set_data) pass through unreported; see also UnreportedUses.
thread_local int t_reporting = 0;
// OwnSetData scopes open on this thread.
thread_local int t_own_set_data = 0;

using ReportingScope = UnreportedUses;

std::mutex& registry_mutex() {
  static std::mutex mu;
  return mu;
}

std::unordered_map<const c10::StorageImpl*, Entry>& registry() {
  static auto* map = new std::unordered_map<const c10::StorageImpl*, Entry>();
  return *map;
}

const c10::StorageImpl* storage_of(const at::Tensor& t) {
  return t.defined() && t.has_storage() ? t.storage().unsafeGetStorageImpl() : nullptr;
}

bool passes_through(const std::string& name) {
  return name == "aten::_has_compatible_shallow_copy_type" || name == "aten::detach" ||
         name == "aten::detach_" || name == "aten::alias" || name == "aten::set_data" ||
         name == "aten::requires_grad_" || name == "aten::_version" || name == "aten::output_nr" ||
         name == "aten::retain_grad";
}

// What `e` stands for in a message: its name, or what a gathered unit's
// storage (which has none) holds.
std::string shown(const Entry& e) {
  return e.what.empty() ? "a parameter of a unit made by fsdp::fully_shard" : e.what;
}

std::string message(const std::string& op, const Entry& e, bool writes) {
  if (e.kind == PlaceholderKind::kGradient) {
    return error_prefix(-1, "parameters") + op + " read the gradient of " + e.what +
           ", but FSDP moved it into the unit's flat gradient shard (this rank's part, "
           "reduced over the ranks). An optimizer built on the unwrapped module's parameters "
           "(named_parameters(), or parameters() of a model made by fsdp::fully_shard) reads "
           "it: build it on the flat shards, the wrapped model's parameters() or, for "
           "fully_shard, the returned Unit's flat_parameters() (fsdp::unit_of(*model)), or "
           "per-parameter views with FSDPOptions().use_orig_params(true), named by "
           "Unit::named_flat_parameters() for parameter groups. LibTorch's clip_grad_norm_ (of "
           "a finite order) and clip_grad_value_ of these parameters, and a .grad()'s norm(), "
           "do work, on every rank alike (Note [LibTorch's clipping of a unit made in place]); "
           "for the infinity norm, clip with the root's clip_grad_norm_(). To log gradients, "
           "read those tensors' .grad() (each rank holds its part; the root's "
           "clip_grad_norm_() returns the global norm), or the full ones inside "
           "fsdp::SummonFullParams(model, fsdp::SummonOptions().with_grads(true)).";
  }
  if (writes) {
    return error_prefix(-1, "parameters") + op + " wrote to " + e.what +
           ", which is sharded: its data exists only while its FSDP unit runs. Initialise or "
           "change parameters before wrapping, or inside fsdp::SummonFullParams(model, "
           "fsdp::SummonOptions().writeback(true)) on every rank, which gathers them and keeps "
           "each rank's part of what was written. If an optimizer's step() wrote it (weight "
           "decay), it was built on the unwrapped module's parameters (named_parameters()): "
           "build it on the flat shards, the wrapped model's parameters(), or "
           "Unit::named_flat_parameters() with FSDPOptions().use_orig_params(true) for "
           "parameter groups.";
  }
  return error_prefix(-1, "parameters") + op + " used " + e.what +
         ", which is sharded: its data exists only while its FSDP unit runs. To read or copy "
         "full parameters (a log, an EMA or target-network copy), do it inside "
         "fsdp::SummonFullParams(model) on every rank; to run the module, call the "
         "FullyShardedDataParallel wrapper (or the root), not the module it wraps; an "
         "optimizer is built on the wrapped model's parameters(), not on the unwrapped "
         "module's parameters.";
}

// Note [Saving a sharded parameter]
// torch::save(model, path) of a model made by fully_shard, outside
// SummonFullParams, reaches each sharded parameter through Module::save,
// which puts the tensor into the archive without an operator, and the
// archive then copies the storage's bytes: the placeholder's, none. The file
// is written without a word and LibTorch 2.x refuses it at torch::load, long
// after (1.13 even loads it: empty storages). So a parameter placeholder's
// storage refuses data reads (LibTorch 2.4+, compat::refuse_data_reads), and
// the save fails at once, naming the parameter and the fix. The file it had
// begun is incomplete, as after any failed torch::save. Operators never read
// a placeholder's storage (the fallback runs first), nor does set_data.
std::string data_read_message(const std::string& what) {
  return error_prefix(-1, "parameters") + "the data of " + what +
         " was read directly (torch::save(model) outside fsdp::SummonFullParams does, or "
         "data_ptr()), but it is sharded: its data exists only while its FSDP unit runs, and "
         "a file would hold none of it. Save inside fsdp::SummonFullParams full(*model) "
         "(every rank enters it; then rank 0 alone may call torch::save), or use "
         "fsdp::full_state_dict or an fsdp::Checkpointer";
}

void refuse_data_reads(const at::Tensor& placeholder, const Entry& e) {
  if (e.kind != PlaceholderKind::kParameter) return;
  compat::refuse_data_reads(*placeholder.storage().unsafeGetStorageImpl(),
                            data_read_message(e.what));
}

// The last `n` values of `stack`: an operator's arguments before it runs,
// its returns after.
c10::ArrayRef<c10::IValue> last_values(const torch::jit::Stack* stack, size_t n) {
  return c10::ArrayRef<c10::IValue>(stack->data() + stack->size() - n, n);
}

// The storages of the tensors `op` writes in place among its arguments
// `args` (its schema's Tensor(a!) ones).
std::vector<const c10::StorageImpl*> written_storages(const c10::OperatorHandle& op,
                                                      c10::ArrayRef<c10::IValue> args) {
  std::vector<const c10::StorageImpl*> out;
  const auto& schema_args = op.schema().arguments();
  for (size_t i = 0; i < schema_args.size() && i < args.size(); ++i) {
    const auto* alias = schema_args[i].alias_info();
    if (alias == nullptr || !alias->isWrite()) continue;
    for_each_tensor(args.slice(i, 1), [&](const at::Tensor& t) {
      if (const c10::StorageImpl* storage = storage_of(t)) out.push_back(storage);
    });
  }
  return out;
}

// Runs the operator as if the placeholders' key were not there.
void redispatch_below(const c10::OperatorHandle& op, c10::DispatchKeySet keys,
                      torch::jit::Stack* stack) {
  op.redispatchBoxed(keys & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, kKey), stack);
}

// One listener to report to, and whether it saw one of its placeholders.
struct Use {
  ParamUseListener* listener;
  bool sharded;
};

// Mixed precision without forward hooks: the floating-point inputs of an
// operator on a unit's parameters, within tensor lists too (an LSTM's state),
// other than parameters, buffers and what it writes, are cast to the unit's
// compute dtype (see ParamUseListener::compute_dtype). Returns a buffer left
// uncast in another floating-point dtype, if any: its dtype and the compute
// dtype.
struct KeptBuffer {
  at::ScalarType buffer;
  at::ScalarType compute;
};
c10::optional<KeptBuffer> cast_inputs(const c10::OperatorHandle& op, torch::jit::Stack* stack,
                                      const std::vector<Use>& uses) {
  c10::optional<at::ScalarType> dtype;
  for (const Use& u : uses) {
    if (!dtype) dtype = u.listener->compute_dtype();
  }
  c10::optional<KeptBuffer> kept_buffer;
  if (!dtype) return kept_buffer;
  // `t` itself, or its cast.
  const auto cast = [&](const at::Tensor& t) {
    if (!t.defined() || !t.is_floating_point() || t.scalar_type() == *dtype ||
        t.key_set().has(kKey)) {
      return t;
    }
    for (const Use& u : uses) {
      if (u.listener->holds_buffer(t)) {
        kept_buffer = KeptBuffer{t.scalar_type(), *dtype};
        return t;
      }
    }
    ReportingScope scope;
    return t.to(*dtype);
  };
  const auto& schema_args = op.schema().arguments();
  const size_t n = schema_args.size();
  for (size_t i = 0; i < n; ++i) {
    c10::IValue& v = (*stack)[stack->size() - n + i];
    const auto* alias = schema_args[i].alias_info();
    if (alias != nullptr && alias->isWrite()) continue;
    if (v.isTensor()) {
      at::Tensor t = cast(v.toTensor());
      if (!t.is_same(v.toTensor())) v = c10::IValue(std::move(t));
    } else if (v.isTensorList()) {
      std::vector<at::Tensor> list = v.toTensorVector();
      bool changed = false;
      for (at::Tensor& t : list) {
        at::Tensor c = cast(t);
        changed = changed || !c.is_same(t);
        t = std::move(c);
      }
      if (changed) v = c10::IValue(std::move(list));
    }
  }
  return kept_buffer;
}

// run_reported's body, once the units are held for the operator.
void run_held(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack,
              const std::vector<Use>& uses, c10::ArrayRef<c10::IValue> args) {
  const size_t n = args.size();
  {
    ReportingScope scope;
    for (const Use& u : uses) u.listener->before_param_use(u.sharded);
    for (const Use& u : uses) u.listener->param_use_arguments(last_values(stack, n));
  }
  // A placeholder still here is an alias made while its unit was sharded
  // (detach() outside forward): gathering the unit did not fill it.
  {
    std::lock_guard<std::mutex> lock(registry_mutex());
    for_each_tensor(last_values(stack, n), [&](const at::Tensor& t) {
      if (!t.defined() || !t.key_set().has(kKey)) return;
      auto it = registry().find(storage_of(t));
      TORCH_CHECK(it == registry().end() || it->second.tracked ||
                      it->second.kind != PlaceholderKind::kParameter,
                  error_prefix(-1, "parameters"), op.schema().name(), " used ", it->second.what,
                  " through an alias taken while it was sharded (detach(), a "
                  "view). Take aliases of a fully_shard unit's parameters inside "
                  "its forward, or under fsdp::SummonFullParams");
    });
  }
  // Which units' parameters it writes in place (their storages, while
  // gathered: before_param_use gathered them).
  std::vector<ParamUseListener*> wrote;
  {
    const auto written = written_storages(op, args);
    std::lock_guard<std::mutex> lock(registry_mutex());
    for (const c10::StorageImpl* storage : written) {
      auto it = registry().find(storage);
      if (it != registry().end() && it->second.listener != nullptr &&
          it->second.kind == PlaceholderKind::kParameter) {
        wrote.push_back(it->second.listener);
      }
    }
  }
  const c10::optional<KeptBuffer> kept_buffer = cast_inputs(op, stack, uses);
  try {
    ReportingScope scope;
    redispatch_below(op, keys, stack);
  } catch (const c10::Error& e) {
    // Only what reads as a dtype mismatch (an out-of-memory error, say, keeps
    // its type and message).
    const std::string what = e.what_without_backtrace();
    if (!kept_buffer || dynamic_cast<const c10::OutOfMemoryError*>(&e) != nullptr ||
        (what.find("type") == std::string::npos && what.find("Type") == std::string::npos)) {
      throw;
    }
    // Most likely the buffer's dtype beside the low-precision parameters.
    TORCH_CHECK(false, error_prefix(-1, "mixed precision"), op.schema().name(),
                " failed with a buffer in ", c10::toString(kept_buffer->buffer),
                " beside parameters in ", c10::toString(kept_buffer->compute),
                " (buffers are not cast: ", "a cast copy's running statistics would be lost): ",
                what, ". Give the buffers that dtype with MixedPrecision::buffer_dtype(",
                c10::toString(kept_buffer->compute),
                "), or keep the module in full precision (module_classes_to_ignore)");
  }
  const auto returns = last_values(stack, op.schema().returns().size());
  ReportingScope scope;
  for (const Use& u : uses) {
    u.listener->after_param_use(returns,
                                std::find(wrote.begin(), wrote.end(), u.listener) != wrote.end());
  }
}

// Reports the operator to the units whose parameters it uses (Note [Units
// driven by dispatch]) and runs it, holding them all gathered meanwhile.
// What after_this_operator() deferred, and how deep in reported operators
// this thread is (an operator reported inside another's listener calls).
struct OperatorEnd {
  int depth = 0;
  std::vector<std::function<void()>> actions;
};
OperatorEnd& operator_end() {
  thread_local OperatorEnd end;
  return end;
}

// While alive, a reported operator runs on this thread; the outermost one's
// end runs what after_this_operator() deferred (an action that throws is
// dropped: it runs where nothing can take its error).
class ReportedOperator {
 public:
  ReportedOperator() { ++operator_end().depth; }
  ~ReportedOperator() {
    OperatorEnd& end = operator_end();
    if (--end.depth > 0) return;
    std::vector<std::function<void()>> actions;
    actions.swap(end.actions);
    for (auto& action : actions) {
      try {
        action();
      } catch (...) {  // NOLINT(bugprone-empty-catch): see above
      }
    }
  }
  ReportedOperator(const ReportedOperator&) = delete;
  ReportedOperator& operator=(const ReportedOperator&) = delete;
};

void run_reported(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack,
                  const std::vector<Use>& uses, c10::ArrayRef<c10::IValue> args) {
  const ReportedOperator reported;
  {
    ReportingScope scope;
    for (const Use& u : uses) u.listener->hold_for_operator();
  }
  try {
    run_held(op, keys, stack, uses, args);
  } catch (...) {
    ReportingScope scope;
    for (const Use& u : uses) u.listener->after_param_use({}, /*wrote=*/false);
    throw;
  }
}

// The value of `op`'s argument `name` on `stack`, or nullptr when the
// overload has none or it is None.
const c10::IValue* argument(const c10::OperatorHandle& op, const torch::jit::Stack* stack,
                            const char* name) {
  const size_t n = op.schema().arguments().size();
  const auto index = op.schema().argumentIndexWithName(name);
  if (!index) return nullptr;
  const c10::IValue& v = (*stack)[stack->size() - n + static_cast<size_t>(*index)];
  return v.isNone() ? nullptr : &v;
}

// The registry's entry for a unit's parameter `t` (sharded or gathered), if
// it is one.
c10::optional<Entry> parameter_entry(const at::Tensor& t) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  auto it = registry().find(storage_of(t));
  if (it == registry().end() || it->second.kind != PlaceholderKind::kParameter) {
    return c10::nullopt;
  }
  return it->second;
}

// Tensor::to that changes nothing, as Module::to(device) calls it on every
// parameter: returns the parameter itself, as ATen's to() does, without
// gathering its unit (Note [Module::to on a sharded model]). False for any
// other conversion, which runs as any operator does.
bool keep_parameter(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const size_t n = op.schema().arguments().size();
  const at::Tensor self = last_values(stack, n)[0].toTensor();
  if (!parameter_entry(self)) return false;
  c10::optional<c10::Device> device;
  c10::optional<at::ScalarType> dtype;
  if (const c10::IValue* other = argument(op, stack, "other")) {
    device = other->toTensor().device();
    dtype = other->toTensor().scalar_type();
  }
  if (const c10::IValue* v = argument(op, stack, "device")) device = v->toDevice();
  if (const c10::IValue* v = argument(op, stack, "dtype")) dtype = v->toScalarType();
  const c10::IValue* copy = argument(op, stack, "copy");
  const c10::IValue* layout = argument(op, stack, "layout");
  const c10::IValue* format = argument(op, stack, "memory_format");
  const bool keeps =
      (copy == nullptr || !copy->toBool()) &&
      (layout == nullptr || layout->toLayout() == c10::kStrided) &&
      (format == nullptr || format->toMemoryFormat() == c10::MemoryFormat::Preserve ||
       format->toMemoryFormat() == c10::MemoryFormat::Contiguous) &&
      conversion_keeps(self.device(), self.scalar_type(), device, dtype);
  if (!keeps) return false;
  torch::jit::drop(*stack, n);
  stack->emplace_back(self);
  return true;
}

// set_data giving a unit's parameter other data (Module::to to another device
// or dtype, a parameter assigned by hand) would cut it off its unit: the
// forward would read what the optimizer, stepping the shard, never updates.
// libfsdp's own set_data runs in an OwnSetData scope.
void refuse_new_data(c10::ArrayRef<c10::IValue> args) {
  const at::Tensor& self = args[0].toTensor();
  const c10::optional<Entry> entry = parameter_entry(self);
  if (!entry || storage_of(args[1].toTensor()) == storage_of(self)) return;
  const at::Tensor& data = args[1].toTensor();
  std::ostringstream change;
  change << "set_data (as Module::to does) would give data on " << data.device() << " in "
         << data.scalar_type() << " to";
  // torch::load reads a file saved on another device onto that device, and
  // then sets the parameter with set_data (Note [torch::load into a unit
  // made in place]).
  const bool load_from_elsewhere = data.sizes() == self.sizes() && data.device() != self.device();
  std::ostringstream load_hint;
  if (load_from_elsewhere) {
    load_hint << ". If torch::load read a file saved on " << data.device()
              << ", pass the model's device: torch::load(model, path, torch::Device(\""
              << self.device() << "\"))";
  }
  TORCH_CHECK(false, error_prefix(-1, "parameters"),
              conversion_refusal(change.str(), shown(*entry), self.device(), self.scalar_type()),
              load_hint.str());
}

// torch::load (InputArchive::read) sets each parameter to what it read with
// set_(source): on a unit made in place the unit keeps this rank's part of
// it instead (Note [torch::load into a unit made in place]). False for any
// other set_, which replaces a storage and is refused below.
bool load_into_unit(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const size_t n = op.schema().arguments().size();
  if (op.schema().overload_name() != "source_Tensor" || n != 2) return false;
  const auto args = last_values(stack, n);
  const at::Tensor self = args[0].toTensor();
  const at::Tensor source = args[1].toTensor();
  const c10::optional<Entry> entry = parameter_entry(self);
  // In grad mode plain LibTorch refuses set_ on a leaf that requires grad;
  // so does the refusal below. InputArchive::read runs under NoGradGuard.
  if (!entry || entry->listener == nullptr || source.key_set().has(kKey) ||
      at::GradMode::is_enabled()) {
    return false;
  }
  {
    ReportingScope scope;
    if (!entry->listener->load_param(self, source)) return false;  // an alias of a parameter
  }
  torch::jit::drop(*stack, n);
  stack->emplace_back(self);
  return true;
}

// The whole-gradient norms of a moved gradient (Note [LibTorch's clipping of a
// unit made in place]): aten::norm with no dims, aten::linalg_vector_norm
// over every dim, unkept. The order, and the result's dtype if asked.
struct WholeNorm {
  double p = 2;
  c10::optional<at::ScalarType> dtype;
};
c10::optional<WholeNorm> whole_norm(const c10::OperatorHandle& op,
                                    c10::ArrayRef<c10::IValue> args) {
  const std::string& name = op.schema().name();
  const std::string& overload = op.schema().overload_name();
  const auto order = [](const c10::IValue& v) {
    return v.isNone() ? 2.0 : v.toScalar().toDouble();
  };
  if (name == "aten::norm" && (overload == "Scalar" || overload == "ScalarOpt_dtype")) {
    WholeNorm w{order(args[1]), c10::nullopt};
    if (overload == "ScalarOpt_dtype") w.dtype = args[2].toScalarType();
    return w;
  }
  if (name == "aten::linalg_vector_norm" && args.size() == 5 && args[2].isNone() &&
      !args[3].toBool()) {
    WholeNorm w{order(args[1]), c10::nullopt};
    if (!args[4].isNone()) w.dtype = args[4].toScalarType();
    return w;
  }
  return c10::nullopt;
}

// In-place elementwise operators that LibTorch's clip_grad_norm_ (mul_ by
// a 0-d coefficient) and clip_grad_value_ (clamp_) apply to each .grad, and
// their kin: with scalar or 0-d arguments they act on each rank's part alike.
bool elementwise_in_place(const std::string& name) {
  return name == "aten::mul_" || name == "aten::div_" || name == "aten::clamp_" ||
         name == "aten::clamp_min_" || name == "aten::clamp_max_" || name == "aten::clip_" ||
         name == "aten::add_" || name == "aten::sub_" || name == "aten::nan_to_num_";
}

// An operator on a moved gradient of a unit made by fully_shard that the
// unit answers for the whole gradient (Note [LibTorch's clipping of a unit
// made in place]): replaces its arguments on `stack` by its result and
// returns true, or leaves it and returns false.
bool moved_grad_operator(const c10::OperatorHandle& op, torch::jit::Stack* stack,
                         const c10::StorageImpl* grad_storage, const Entry& e) {
  const size_t n = op.schema().arguments().size();
  const c10::ArrayRef<c10::IValue> args = last_values(stack, n);
  if (n == 0 || !args[0].isTensor() || storage_of(args[0].toTensor()) != grad_storage) {
    return false;
  }
  const at::Tensor self = args[0].toTensor();
  if (const auto norm = whole_norm(op, args)) {
    at::Tensor out;
    {
      ReportingScope scope;
      out = e.listener->moved_grad_norm(self, norm->p);
      if (norm->dtype) out = out.to(*norm->dtype);
    }
    torch::jit::drop(*stack, n);
    stack->emplace_back(std::move(out));
    return true;
  }
  if (!elementwise_in_place(op.schema().name())) return false;
  bool scalars = true;  // every other argument a scalar, or a 0-d tensor that is no placeholder
  for_each_tensor(args.slice(1), [&](const at::Tensor& t) {
    scalars = scalars && (!t.defined() || (t.dim() == 0 && !t.key_set().has(kKey)));
  });
  if (!scalars) return false;
  const std::vector<c10::IValue> rest(args.begin() + 1, args.end());
  {
    ReportingScope scope;
    e.listener->write_moved_grad(self, [&](const at::Tensor& part) {
      torch::jit::Stack call;
      call.reserve(n);
      call.emplace_back(part);
      for (const c10::IValue& v : rest) {
        // A coefficient computed on the compute device (a GPU) for a part
        // in host memory (CPU offload) goes to the part's device.
        const bool moves =
            v.isTensor() && v.toTensor().defined() && v.toTensor().device() != part.device();
        call.emplace_back(moves ? c10::IValue(v.toTensor().to(part.device())) : v);
      }
      op.callBoxed(&call);
    });
  }
  torch::jit::drop(*stack, n);
  stack->emplace_back(self);  // in place: the operator returns its self
  return true;
}

void placeholder_fallback(const c10::OperatorHandle& op, c10::DispatchKeySet keys,
                          torch::jit::Stack* stack) {
  const std::string& name = op.schema().name();
  if (name == "aten::to" && keep_parameter(op, stack)) return;
  // Inside SummonFullParams too (an unreported scope): libfsdp never sets a
  // parameter with set_ itself.
  if (name == "aten::set_" && load_into_unit(op, stack)) return;
  const size_t n = op.schema().arguments().size();
  const c10::ArrayRef<c10::IValue> args = last_values(stack, n);
  // Tensor::set_data reaches the dispatcher only through this check of its
  // arguments (self, new data). Inside SummonFullParams too (an unreported
  // scope): only libfsdp's own set_data is let through.
  if (name == "aten::_has_compatible_shallow_copy_type" && t_own_set_data == 0) {
    refuse_new_data(args);
  }
  // The first placeholder among the arguments; a gradient one wins, since
  // reading a moved gradient is the more specific mistake.
  const Entry* found = nullptr;
  const c10::StorageImpl* found_storage = nullptr;
  Entry copy;
  std::vector<Use> uses;
  const bool report = t_reporting == 0 && !passes_through(name);
  {
    std::lock_guard<std::mutex> lock(registry_mutex());
    for_each_tensor(args, [&](const at::Tensor& t) {
      if (!t.defined() || !t.key_set().has(kKey)) return;
      auto it = registry().find(storage_of(t));
      if (it == registry().end()) return;
      const Entry& e = it->second;
      // Any other set_ (to a storage, to another unit's parameter) would cut
      // the parameter off its flat buffer, silently.
      TORCH_CHECK(
          name != "aten::set_" || e.listener == nullptr || e.kind != PlaceholderKind::kParameter,
          error_prefix(-1, "parameters"), "set_ would replace the storage of ", shown(e),
          ", cutting it off its unit. Write into it instead (copy_ under "
          "fsdp::SummonFullParams(model, fsdp::SummonOptions().writeback(true))), or load "
          "with torch::load(model, path) or fsdp::load_full_state_dict");
      if (e.listener != nullptr && e.kind == PlaceholderKind::kParameter) {
        if (report && e.reports) {
          auto same = std::find_if(uses.begin(), uses.end(),
                                   [&](const Use& u) { return u.listener == e.listener; });
          if (same == uses.end()) {
            uses.push_back({e.listener, !e.tracked});
          } else {
            same->sharded = same->sharded || !e.tracked;
          }
          return;
        }
        if (e.tracked) return;  // gathered: runs as it is
        // A sharded one inside a reported operator or an unreported scope:
        // like any placeholder below (passes through, or an error).
      }
      if (found == nullptr || e.kind == PlaceholderKind::kGradient) {
        found = &e;
        found_storage = storage_of(t);
      }
    });
    if (found != nullptr) copy = *found;
  }
  if (name == "aten::zero_" && found != nullptr && copy.kind == PlaceholderKind::kGradient) {
    // Module::zero_grad(false), or the user's own loop zeroing each .grad.
    if (copy.listener != nullptr && t_reporting == 0) {
      const at::Tensor self = args[0].toTensor();
      ReportingScope scope;
      copy.listener->moved_grad_zeroed(self);
    }
    return;
  }
  // Module::zero_grad() detaches each .grad before it drops or zeroes it: on
  // a unit made by fully_shard (whose module's zero_grad cannot be
  // overridden) that is how the gradients its optimizer steps get cleared
  // (Note [Gradients the user clears]).
  if (name == "aten::detach" && found != nullptr && copy.kind == PlaceholderKind::kGradient &&
      copy.listener != nullptr && t_reporting == 0) {
    ReportingScope scope;
    copy.listener->moved_grad_detached(args[0].toTensor());
  }
  // Optimizer::zero_grad() detaches each gradient in place before zeroing it
  // (LibTorch 1.13) or dropping it (2.x's default, after which step() would
  // skip the parameter without a word); Module::zero_grad() uses an
  // out-of-place detach. So an in-place detach of a moved gradient means an
  // optimizer was built on the unwrapped parameters: say so now.
  if (name == "aten::detach_" && found != nullptr && copy.kind == PlaceholderKind::kGradient) {
    TORCH_CHECK(false, message("Optimizer::zero_grad()", copy, /*writes=*/false));
  }
  if (found != nullptr && copy.kind == PlaceholderKind::kGradient && copy.listener != nullptr &&
      t_reporting == 0 && moved_grad_operator(op, stack, found_storage, copy)) {
    return;
  }
  if (found != nullptr && !passes_through(name)) {
    const auto written = written_storages(op, args);
    const bool writes = std::find(written.begin(), written.end(), found_storage) != written.end();
    TORCH_CHECK(false, message(name, copy, writes));
  }
  if (!uses.empty()) {
    run_reported(op, keys, stack, uses, args);
    return;
  }
  redispatch_below(op, keys, stack);
}

}  // namespace

void begin_unreported_uses() { ++t_reporting; }
void end_unreported_uses() { --t_reporting; }
bool unreported_uses_active() { return t_reporting > 0; }
OwnSetData::OwnSetData() { ++t_own_set_data; }
OwnSetData::~OwnSetData() { --t_own_set_data; }

UnreportedUses::UnreportedUses() { begin_unreported_uses(); }
UnreportedUses::~UnreportedUses() { end_unreported_uses(); }

TORCH_LIBRARY_IMPL(_, FSDP_PLACEHOLDER_DISPATCH_KEY, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&placeholder_fallback>());
}

at::Tensor make_placeholder(const at::Tensor& like, PlaceholderKind kind, std::string what,
                            ParamUseListener* listener) {
  // On the device of what it stands for, and dispatching as its backend
  // below the placeholder key (Note [One seam for devices]).
  c10::Storage storage(c10::Storage::use_byte_size_t(), 0, c10::DataPtr(nullptr, like.device()),
                       nullptr, /*resizable=*/false);
  auto t = at::detail::make_tensor<c10::TensorImpl>(
      std::move(storage),
      c10::DispatchKeySet(dense_backend_key(like.device())) | c10::DispatchKeySet(kKey),
      like.dtype());
  t.unsafeGetTensorImpl()->set_sizes_contiguous(like.sizes());
  Entry entry{kind, std::move(what), listener, /*tracked=*/false};
  refuse_data_reads(t, entry);  // Note [Saving a sharded parameter]
  std::lock_guard<std::mutex> lock(registry_mutex());
  registry()[storage_of(t)] = std::move(entry);
  return t;
}

void track_storage(const at::Tensor& base, ParamUseListener* listener, bool report) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  registry()[storage_of(base)] =
      Entry{PlaceholderKind::kParameter, std::string(), listener, /*tracked=*/true, report};
}

void untrack_storage(const at::Tensor& base) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  registry().erase(storage_of(base));
}

at::Tensor tracked_alias(const at::Tensor& view) {
  auto t = at::detail::make_tensor<c10::TensorImpl>(
      c10::TensorImpl::VIEW, c10::Storage(view.storage()),
      view.key_set() | c10::DispatchKeySet(kKey), view.dtype());
  auto* impl = t.unsafeGetTensorImpl();
  impl->set_sizes_and_strides(view.sizes(), view.strides());
  impl->set_storage_offset(view.storage_offset());
  return t;
}

void rename_placeholder(const at::Tensor& placeholder, std::string what) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  auto it = registry().find(storage_of(placeholder));
  if (it == registry().end()) return;
  it->second.what = std::move(what);
  refuse_data_reads(placeholder, it->second);
}

void release_placeholder(const at::Tensor& placeholder) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  registry().erase(storage_of(placeholder));
}

void after_this_operator(std::function<void()> action) {
  OperatorEnd& end = operator_end();
  if (end.depth == 0) {
    action();
  } else {
    end.actions.push_back(std::move(action));
  }
}

bool is_placeholder(const at::Tensor& t) { return t.defined() && t.key_set().has(kKey); }

void refuse_placeholder_use(const at::Tensor& t, const std::string& user) {
  std::string text;
  {
    std::lock_guard<std::mutex> lock(registry_mutex());
    auto it = registry().find(storage_of(t));
    if (it != registry().end()) text = message(user, it->second, /*writes=*/false);
  }
  TORCH_CHECK(!text.empty(), error_prefix(-1, "parameters"), user,
              " read a sharded parameter or a moved gradient; build it on the flat shards "
              "(the wrapped model's parameters(), or the Unit's flat_parameters())");
  TORCH_CHECK(false, text);
}

}  // namespace fsdp::detail
