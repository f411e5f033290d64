// Built only with FSDP_WITH_CUDA: Note [Ranks sharing a GPU].
#include "comm/cuda_ipc_slots.h"

#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include <cstdio>
#include <optional>
#include <string>
#include <vector>

namespace fsdp::detail {

namespace {

std::string hex_of(const void* p, size_t n) {
  std::string out;
  out.reserve(2 * n);
  const auto* b = static_cast<const unsigned char*>(p);
  char two[3];
  for (size_t i = 0; i < n; ++i) {
    std::snprintf(two, sizeof(two), "%02x", b[i]);
    out += two;
  }
  return out;
}

bool bytes_of(const std::string& hex, void* out, size_t n) {
  if (hex.size() != 2 * n) return false;
  auto* b = static_cast<unsigned char*>(out);
  for (size_t i = 0; i < n; ++i)
    b[i] = static_cast<unsigned char>(std::stoi(hex.substr(2 * i, 2), nullptr, 16));
  return true;
}

// A failed runtime call leaves its error to be read by the next check
// elsewhere; this one has been handled.
bool ok(cudaError_t e) {
  if (e == cudaSuccess) return true;
  (void)cudaGetLastError();
  return false;
}

// Frees this rank's slots and unmaps its peers'. Return codes ignored: at
// exit the runtime may be gone, and the process's end releases both anyway.
void release(const std::vector<char*>& bases, int rank) {
  for (size_t p = 0; p < bases.size(); ++p) {
    if (bases[p] == nullptr) continue;
    if (static_cast<int>(p) == rank) {
      (void)cudaFree(bases[p]);
    } else {
      (void)cudaIpcCloseMemHandle(bases[p]);
    }
  }
  (void)cudaGetLastError();
}

class CudaIpcSlots final : public SlotMemory {
 public:
  CudaIpcSlots(c10::Device device, int rank, int64_t slot_bytes, std::vector<char*> bases)
      : device_(device),
        rank_(rank),
        slot_bytes_(slot_bytes),
        bases_(std::move(bases)),
        stream_(c10::cuda::getStreamFromPool(false, device.index())) {}
  ~CudaIpcSlots() override { release(bases_, rank_); }
  char* slot(int rank, uint32_t round) const override {
    return bases_[static_cast<size_t>(rank)] + (round & 1u) * static_cast<size_t>(slot_bytes_);
  }
  c10::Device device() const override { return device_; }
  void copy(void* dst, const void* src, size_t bytes) const override {
    C10_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice,
                                   c10::cuda::getCurrentCUDAStream(device_.index()).stream()));
  }
  void settle() const override { c10::cuda::getCurrentCUDAStream(device_.index()).synchronize(); }
  // The group's stream waits for an event recorded on the issuing thread's
  // stream now; the body's copies and kernels go to the group's stream.
  Runner when_ready() const override {
    auto ready = std::make_shared<at::cuda::CUDAEvent>();
    ready->record(c10::cuda::getCurrentCUDAStream(device_.index()));
    return [ready, stream = stream_, device = device_](const std::function<void()>& body) {
      const c10::cuda::CUDAGuard device_guard(device);
      const c10::cuda::CUDAStreamGuard stream_guard(stream);
      ready->block(stream);
      body();
    };
  }

 private:
  const c10::Device device_;
  const int rank_;
  const int64_t slot_bytes_;
  std::vector<char*> bases_;  // every rank's two slots; this rank's own allocation at rank_
  const c10::cuda::CUDAStream stream_;  // the collectives' own
};

}  // namespace

SlotOpener cuda_ipc_slot_opener(c10::Device device) {
  return [device](c10d::Store& store, int rank, int size,
                  int64_t slot_bytes) -> std::unique_ptr<SlotMemory> {
    // A rank without that GPU still takes part, posting "no".
    int gpus = 0;
    const bool usable = ok(cudaGetDeviceCount(&gpus)) && device.index() < gpus;
    std::optional<c10::cuda::CUDAGuard> guard;
    if (usable) guard.emplace(device);
    std::vector<char*> bases(static_cast<size_t>(size), nullptr);
    void* mine = nullptr;
    cudaIpcMemHandle_t handle{};
    cudaDeviceProp prop{};
    const bool made = usable && ok(cudaGetDeviceProperties(&prop, device.index())) &&
                      ok(cudaMalloc(&mine, 2 * static_cast<size_t>(slot_bytes))) &&
                      ok(cudaIpcGetMemHandle(&handle, mine));
    bases[static_cast<size_t>(rank)] = static_cast<char*>(mine);
    const std::string uuid = hex_of(&prop.uuid, sizeof(prop.uuid));
    // Every rank posts "<uuid>/<handle>" ("" when it could not), then all read all.
    const auto posted = exchange_strings(store, "shm/ipc", rank, size,
                                         made ? uuid + "/" + hex_of(&handle, sizeof(handle)) : "");
    bool all = made;
    for (int p = 0; p < size; ++p) {
      const std::string& theirs = posted[static_cast<size_t>(p)];
      if (p == rank || !all) continue;
      cudaIpcMemHandle_t peer{};
      void* mapped = nullptr;
      all = theirs.size() == uuid.size() + 1 + 2 * sizeof(peer) &&
            theirs.compare(0, uuid.size(), uuid) == 0 &&
            bytes_of(theirs.substr(uuid.size() + 1), &peer, sizeof(peer)) &&
            ok(cudaIpcOpenMemHandle(&mapped, peer, cudaIpcMemLazyEnablePeerAccess));
      bases[static_cast<size_t>(p)] = static_cast<char*>(mapped);
    }
    if (!all) {
      release(bases, rank);
      return nullptr;
    }
    return std::make_unique<CudaIpcSlots>(device, rank, slot_bytes, std::move(bases));
  };
}

}  // namespace fsdp::detail
