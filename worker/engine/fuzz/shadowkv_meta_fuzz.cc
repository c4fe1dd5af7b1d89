// libFuzzer target: a stored ShadowKV document's "meta" blob (read from disk
// or a store node) through ShadowKvPrefixGeometry::ParseMeta. Any input must
// be accepted or refused with InvalidArgument, never crash; an accepted one
// must name blob sizes that do not wrap (each under 1 TiB: they are then
// allocated and copied) and print back to a meta that parses to itself.
// Built and run by .ci/fuzz.sh; with PENUMBRA_FUZZ_SEEDS=DIR,
// LLVMFuzzerInitialize writes a few valid metas there.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "tests/fuzz_seeds.h"
#include "worker/engine/shadowkv_prefix.h"

namespace {

using penumbra::ShadowKvPrefixGeometry;
using penumbra::StatusCode;

const char* const kSeeds[] = {
    "shadowkv-prefix v2 tokens=151 factored=151 sparse=1 chunks=35 outliers=2 tail=11 layers=5 kv_heads=4 "
    "head_dim=8 rank=12 chunk_size=4 dtype=f32 landmarks_per_chunk=2 landmark_format=fp8",
    "shadowkv-prefix v2 tokens=124928 factored=124928 sparse=1 chunks=15612 outliers=48 tail=32 layers=32 "
    "kv_heads=8 head_dim=128 rank=160 chunk_size=8 dtype=bf16 landmarks_per_chunk=4 landmark_format=fp8 "
    "value_format=fp8",
    "shadowkv-prefix v2 tokens=40 factored=40 sparse=0 chunks=0 outliers=0 tail=40 layers=2 kv_heads=2 "
    "head_dim=16 rank=8 chunk_size=8 dtype=bf16",
};

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  penumbra::testing::WriteFuzzSeeds(kSeeds);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string meta(reinterpret_cast<const char*>(data), size);
  auto g = ShadowKvPrefixGeometry::ParseMeta(meta);
  if (!g.ok()) {
    if (g.status().code() != StatusCode::kInvalidArgument) std::abort();
    return 0;
  }
  for (const auto& [name, bytes] : g->BlobBytes()) {
    if (bytes > (size_t{1} << 40)) std::abort();
  }
  if (g->ValueRowBytes() == 0 && g->sparse) std::abort();
  auto back = ShadowKvPrefixGeometry::ParseMeta(g->Meta());
  if (!back.ok() || back->Meta() != g->Meta()) std::abort();
  return 0;
}
