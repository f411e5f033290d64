// libFuzzer target for the checkpoint loader's parsing and validation layer
// (safetensors headers, manifests, completion markers), which does not depend
// on LibTorch. Every input must either parse or be refused with a
// fsdp::CheckpointError; any other exception, crash, leak or undefined
// behaviour is a finding. See README.md ("Checkpoints") for how to run it.

#include <cstddef>
#include <cstdint>
#include <string>

#include <fsdp/state/error.h>

#include "state/manifest.h"
#include "state/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    const fsdp::detail::SafetensorsHeader h =
        fsdp::detail::parse_safetensors(data, size, "fuzz.safetensors");
    // A valid header's tensors lie inside the input: touch their bytes.
    volatile uint8_t sink = 0;
    for (const auto& e : h.entries) {
      if (e.end > e.begin) sink = sink ^ data[h.data_start + e.end - 1];
    }
  } catch (const fsdp::CheckpointError&) {
  }
  const std::string text(reinterpret_cast<const char*>(data), size);
  try {
    fsdp::detail::parse_manifest(text, "rank0.json");
  } catch (const fsdp::CheckpointError&) {
  }
  try {
    fsdp::detail::parse_marker(text, "COMPLETE");
  } catch (const fsdp::CheckpointError&) {
  }
  return 0;
}
