#include "worker/engine/engine_flags.h"

namespace penumbra {

void AddEngineFlags(Args& a) {
  a.Flag("device", "cpu, cuda or auto (default auto: cuda when a GPU is present)")
      .Flag("cuda-device", "CUDA device ordinal (default 0)")
      .Flag("dtype", "CUDA compute dtype: bf16 (default) or f32")
      .Flag("linear",
            "CUDA linear layers: auto (skinny kernel for decode batches <= 8, SwiGLU fused; default), "
            "skinny (unfused) or cublas")
      .Flag("chained-launch", "CUDA: decode kernels launched chained (programmatic dependent launch), on (default) or off")
      .Flag("config", "engine YAML (see configs/engine.yaml); flags override it")
      .Flag("storage-config", "the document cache's tiers (see configs/storage.yaml); over the engine YAML's storage:")
      .Flag("kv-policy", "full (default) or shadowkv")
      .Flag("prefill-chunk", "tokens per prefill chunk (default 4096)");
  AddShadowKvFlags(a);
}

Status ApplyEngineFlags(const Args& a, EngineOptions* o) {
  if (a.Has("config")) {
    PENUMBRA_ASSIGN_OR_RETURN(*o, LoadEngineOptionsFile(a.Get("config")));
  }
  if (a.Has("storage-config")) PENUMBRA_RETURN_IF_ERROR(LoadStorageOptionsFile(a.Get("storage-config"), o));
  if (a.Has("device")) o->backend.device = a.Get("device");
  if (a.Has("dtype")) o->backend.dtype = a.Get("dtype");
  PENUMBRA_ASSIGN_OR_RETURN(int64_t ordinal, a.GetIntIn("cuda-device", o->backend.cuda_device, 0, 1023));
  o->backend.cuda_device = static_cast<int>(ordinal);
  if (a.Has("linear")) o->backend.linear = a.Get("linear");
  if (a.Has("chained-launch")) {
    PENUMBRA_ASSIGN_OR_RETURN(o->backend.chained_launch, a.GetOnOff("chained-launch", true));
  }
  if (a.Has("kv-policy")) o->kv_policy = a.Get("kv-policy");
  PENUMBRA_ASSIGN_OR_RETURN(int64_t chunk, a.GetInt("prefill-chunk", o->runtime.prefill_chunk));
  if (chunk < 1 || chunk > (1 << 20)) return Status::InvalidArgument("--prefill-chunk must be in [1, 1048576]");
  o->runtime.prefill_chunk = static_cast<int>(chunk);
  return ApplyShadowKvFlags(a, &o->shadowkv);
}

}  // namespace penumbra
