#include "state/dict_broadcast.h"

#include <ATen/ATen.h>

#include <cstdint>
#include <cstring>
#include <exception>
#include <vector>

#include "comm/agreement.h"
#include "detail/error.h"

namespace fsdp::detail {
namespace {

// Rank 0's `values` on every rank: their count first, then the values
// (float64 carries them exactly: names' characters, dtypes, sizes).
std::vector<int64_t> broadcast_values(ProcessGroup& group, std::vector<int64_t> values) {
  const at::Device device = group_device(group);
  at::Tensor count = small_tensor({static_cast<int64_t>(values.size())}, at::kDouble, device);
  group.broadcast(count, 0).wait();
  values.resize(static_cast<size_t>(small_values(count).front()));
  at::Tensor all = small_tensor(values, at::kDouble, device);
  group.broadcast(all, 0).wait();
  return small_values(all);
}

// A tensor of a dtype the process groups do not carry (an int64 step, a
// bool or integer buffer) travels as its bytes in a float32 tensor: a
// broadcast copies them unchanged.
int64_t wire_numel(at::ScalarType dtype, int64_t numel) {
  return (numel * static_cast<int64_t>(c10::elementSize(dtype)) + 3) / 4;
}

}  // namespace

torch::OrderedDict<std::string, at::Tensor> broadcast_dict(
    ProcessGroup* group, const torch::OrderedDict<std::string, at::Tensor>& dict) {
  if (group == nullptr || group->size() == 1) return dict;
  const bool root = group->rank() == 0;
  // What every rank needs to receive the tensors: per entry the name's
  // length and characters, the dtype, the number of dimensions, the sizes.
  // A dict rank 0 cannot send fails there, and the others learn it at once
  // from a lone -1 instead of waiting in a broadcast until the timeout.
  std::vector<int64_t> meta;
  std::exception_ptr error;
  if (root) {
    try {
      for (const auto& item : dict) {
        const at::Tensor& t = item.value();
        FSDP_CHECK(t.defined() && t.layout() == at::kStrided && t.device().type() != c10::kMeta, 0,
                   item.key(),
                   "is not a dense tensor with values (undefined, sparse or on the meta device); "
                   "broadcast_from_rank0 sends rank 0's dict as it is: pass the state dict taken "
                   "with full_state_dict() or full_optim_state_dict()");
        meta.push_back(static_cast<int64_t>(item.key().size()));
        for (const char c : item.key()) meta.push_back(static_cast<unsigned char>(c));
        meta.push_back(static_cast<int64_t>(t.scalar_type()));
        meta.push_back(t.dim());
        for (const int64_t s : t.sizes()) meta.push_back(s);
      }
    } catch (...) {
      error = std::current_exception();
      meta = {-1};
    }
  }
  meta = broadcast_values(*group, std::move(meta));
  if (error) std::rethrow_exception(error);
  FSDP_CHECK(meta.size() != 1 || meta.front() != -1, group->rank(), "state dict",
             "rank 0 could not send its dict with broadcast_from_rank0 (its error says why)");
  torch::OrderedDict<std::string, at::Tensor> out;
  const at::Device device = group_device(*group);
  size_t i = 0;
  while (i < meta.size()) {
    std::string key(static_cast<size_t>(meta[i++]), '\0');
    for (char& c : key) c = static_cast<char>(meta[i++]);
    const auto dtype = static_cast<at::ScalarType>(meta[i++]);
    std::vector<int64_t> sizes(static_cast<size_t>(meta[i++]));
    for (int64_t& s : sizes) s = meta[i++];
    if (collective_dtype(dtype)) {
      at::Tensor t = root ? dict[key].detach().to(device).contiguous()
                          : at::empty(sizes, at::TensorOptions().dtype(dtype).device(device));
      group->broadcast(t, 0).wait();
      out.insert(key, root ? dict[key] : t.to(at::kCPU));
      continue;
    }
    at::Tensor host = root ? dict[key].detach().to(at::kCPU).contiguous()
                           : at::empty(sizes, at::TensorOptions().dtype(dtype));
    at::Tensor wire = at::zeros({wire_numel(dtype, host.numel())}, at::kFloat);
    const size_t bytes = host.numel() * c10::elementSize(dtype);
    if (root && bytes > 0) std::memcpy(wire.data_ptr(), host.data_ptr(), bytes);
    at::Tensor sent = wire.to(device);
    group->broadcast(sent, 0).wait();
    if (!root && bytes > 0) std::memcpy(host.data_ptr(), sent.to(at::kCPU).data_ptr(), bytes);
    out.insert(key, root ? dict[key] : host);
  }
  return out;
}

}  // namespace fsdp::detail
