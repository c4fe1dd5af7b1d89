// A document under the specontext KV policy (worker/engine/specontext_policy.h):
// every layer's exact keys and values of its `tokens` tokens, [hkv][stride]
// rows each (stride >= tokens: a put's sequence's buffers, moved, keep their
// own), in device memory or pinned host memory (mapped), and the retrieval
// head's keys, [head hkv][tokens] rows on the device (ShadowKV's shared
// landmarks have no stride of their own). Sequences attached to it read it
// in place: the scores as ShadowKV's shared landmarks, the row copies as
// its shared values. A context-parallel shard's document holds the shard's
// tokens, from position `pos0`.
//
// Stored form (Export): "meta" (Meta below), "head_k" ([head hkv][tokens]
// rows), "k.L" and "v.L" ([hkv][tokens] rows of layer L), compacted to
// `tokens` rows a head, in the activation dtype.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "common/status.h"
#include "worker/engine/backend.h"
#include "worker/engine/kv_policy.h"

namespace penumbra {

class SpeContextPrefix final : public KvPrefix {
 public:
  // What a document must share with the policy that attaches or imports it.
  struct Geometry {
    int layers = 0, hkv = 0, d = 0, head_hkv = 0, head_d = 0;
    DType dtype = DType::kF32;
    std::string head;  // the retrieval head's identity
  };
  // A document's own fields of its meta.
  struct MetaFields {
    int64_t tokens = 0;
    int64_t base = 0;   // a shard's first position (0: a whole prompt's prefix)
    double factor = 1;  // the YaRN factor its head keys were made at
  };

  SpeContextPrefix(Backend* backend, Geometry g, int64_t tokens, int64_t stride, double factor, int64_t pos0);

  std::string policy() const override { return "specontext"; }
  int64_t tokens() const override { return tokens_; }
  size_t device_bytes() const override;
  size_t host_bytes() const override;
  Result<std::map<std::string, std::string>> Export() const override;

  // "specontext-prefix v1 tokens=T base=B layers=... yarn=F head=...".
  static std::string Meta(const Geometry& g, int64_t tokens, double factor, int64_t base);
  // The fields of a stored meta made for geometry `g` (any other geometry,
  // head or malformed field: InvalidArgument naming the meta and `g`'s).
  static Result<MetaFields> ParseMeta(const Geometry& g, const std::string& meta);

  // The policy reads and fills these directly (the document is its own).
  Backend* backend_;
  Geometry g_;
  int64_t tokens_, stride_;
  double factor_;
  int64_t pos0_;
  std::vector<DeviceBuffer> k_, v_;
  std::vector<void*> k_at_, v_at_;  // device addresses
  std::vector<bool> on_device_;
  DeviceBuffer head_k_;

 private:
  // Rows [0, tokens) of each of `heads` heads of `stride` rows of `width`
  // elements: [heads][tokens][width].
  Result<std::string> Compact(const void* src, bool device, int heads, int width, int64_t stride) const;
};

}  // namespace penumbra
