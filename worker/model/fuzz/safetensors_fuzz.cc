// libFuzzer target: SafetensorsFile::Parse must return (OK or an error) on any
// input without crashing, reading out of bounds, or hitting undefined behaviour;
// when it accepts, every tensor it hands out must lie inside the input.
// Built and run by .ci/fuzz.sh.
#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include "worker/model/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  penumbra::Result<penumbra::SafetensorsFile> f = penumbra::SafetensorsFile::Parse(data, size, "fuzz");
  if (!f.ok()) return 0;
  const uint8_t* end = data + size;
  volatile uint8_t sink = 0;
  for (const penumbra::TensorInfo& t : f->tensors()) {
    if (t.data < data || t.data > end || t.bytes > static_cast<size_t>(end - t.data)) std::abort();
    if (t.numel() < 0) std::abort();
    if (t.bytes > 0) sink = sink ^ t.data[0] ^ t.data[t.bytes - 1];  // ASan checks these reads
    if (f->Find(t.name) != &t) std::abort();
  }
  (void)sink;
  return 0;
}
