// Model weights resident on a backend, in the backend's act dtype, with the
// projections fused for fewer, larger GEMMs: QKV as one [ (hq+2hkv)*d, H ]
// matrix (and bias), gate and up as one [2F, H] matrix.
#pragma once

#include <cstdint>
#include <vector>

#include "common/status.h"
#include "worker/engine/backend.h"
#include "worker/model/checkpoint.h"
#include "worker/model/model_config.h"

namespace penumbra {

struct LayerWeights {
  const void* attn_norm = nullptr;  // [H]
  LinearWeight qkv;                 // [(hq + 2*hkv) * d, H] (+ bias)
  LinearWeight o;                   // [H, hq * d]
  const void* mlp_norm = nullptr;   // [H]
  LinearWeight gate_up;             // [2F, H]: gate rows, then up rows
  LinearWeight down;                // [H, F]
};

class ModelWeights {
 public:
  // Converts every tensor of a validated checkpoint to the backend's act dtype
  // and uploads it. Errors name the tensor.
  static Result<ModelWeights> Load(const Checkpoint& ckpt, Backend& backend);
  // Random N(0, 0.02) weights generated on the device (benchmarks; no checkpoint).
  static Result<ModelWeights> Random(const ModelConfig& config, Backend& backend, uint64_t seed);

  const ModelConfig& config() const { return config_; }
  DType dtype() const { return dtype_; }
  const void* embed() const { return embed_; }  // [V, H]
  const void* final_norm() const { return final_norm_; }
  const LinearWeight& lm_head() const { return lm_head_; }
  const std::vector<LayerWeights>& layers() const { return layers_; }
  size_t device_bytes() const;

 private:
  Result<void*> Upload(Backend& b, const std::vector<float>& host);
  Result<void*> AllocRandom(Backend& b, int64_t n, float std, uint64_t seed);

  ModelConfig config_;
  DType dtype_ = DType::kF32;
  const void* embed_ = nullptr;
  const void* final_norm_ = nullptr;
  LinearWeight lm_head_;
  std::vector<LayerWeights> layers_;
  std::vector<DeviceBuffer> buffers_;
};

}  // namespace penumbra
