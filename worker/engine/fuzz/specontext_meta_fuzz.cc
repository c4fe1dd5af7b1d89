// libFuzzer target: a stored SpeContext document's "meta" blob (read from
// disk or a store node) through SpeContextPrefix::ParseMeta for a fixed
// geometry. Any input must be accepted or refused with InvalidArgument,
// never crash; an accepted one must name a token count and a first position
// in range (the import sizes its blobs by them) and print back to itself.
// Built and run by .ci/fuzz.sh; with PENUMBRA_FUZZ_SEEDS=DIR,
// LLVMFuzzerInitialize writes a few valid metas there.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "tests/fuzz_seeds.h"
#include "worker/engine/specontext_prefix.h"

namespace {

using penumbra::SpeContextPrefix;
using penumbra::StatusCode;

SpeContextPrefix::Geometry TheGeometry() {
  SpeContextPrefix::Geometry g;
  g.layers = 5;
  g.hkv = 4;
  g.d = 8;
  g.head_hkv = 4;
  g.head_d = 8;
  g.dtype = penumbra::DType::kF32;
  g.head = "random:5x8x4x8";
  return g;
}

const char* const kSeeds[] = {
    "specontext-prefix v1 tokens=64 base=0 layers=5 kv_heads=4 head_dim=8 head_kv_heads=4 head_head_dim=8 "
    "dtype=f32 yarn=1 head=random:5x8x4x8",
    "specontext-prefix v1 tokens=150 base=150 layers=5 kv_heads=4 head_dim=8 head_kv_heads=4 head_head_dim=8 "
    "dtype=f32 yarn=2.5 head=random:5x8x4x8",
};

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  penumbra::testing::WriteFuzzSeeds(kSeeds);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string meta(reinterpret_cast<const char*>(data), size);
  const SpeContextPrefix::Geometry g = TheGeometry();
  auto f = SpeContextPrefix::ParseMeta(g, meta);
  if (!f.ok()) {
    if (f.status().code() != StatusCode::kInvalidArgument) std::abort();
    return 0;
  }
  if (f->tokens < 1 || f->tokens >= (int64_t{1} << 31) || f->base < 0 || f->base >= (int64_t{1} << 40)) std::abort();
  if (!(f->factor >= 1.0 && f->factor <= 1024.0)) std::abort();
  if (SpeContextPrefix::Meta(g, f->tokens, f->factor, f->base) != meta) std::abort();
  return 0;
}
