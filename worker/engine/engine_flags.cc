#include "worker/engine/engine_flags.h"

namespace penumbra {

const OptionTable<EngineOptions>& EngineOptionTable() {
  using O = EngineOptions;
  using T = OptionTable<O>;
  static const auto* table =
      &(*new T("engine"))
           .Enum(T::Field<std::string>([](O* o) { return &o->backend.device; }), "device", "device",
                 {"auto", "cpu", "cuda"}, "the backend (auto: cuda when a GPU is present)")
           .Int(T::Field<int>([](O* o) { return &o->backend.cuda_device; }), "cuda-device", "cuda_device", 0, 1023,
                "CUDA device ordinal")
           .Enum(T::Field<std::string>([](O* o) { return &o->backend.dtype; }), "dtype", "dtype",
                 {"auto", "bf16", "f32"}, "CUDA compute dtype (auto: bf16)")
           .Int(T::Field<int>([](O* o) { return &o->backend.cpu_threads; }), "cpu-threads", "cpu_threads", 0, 4096,
                "CPU backend threads (0: every core)")
           .Enum(T::Field<std::string>([](O* o) { return &o->backend.linear; }), "linear", "linear",
                 {"auto", "skinny", "cublas"},
                 "CUDA linear layers: auto (the skinny kernel for decode batches of at most 8, SwiGLU fused), "
                 "skinny (unfused) or cublas")
           .Bool(T::Field<bool>([](O* o) { return &o->backend.chained_launch; }), "chained-launch", "chained_launch",
                 "CUDA: decode kernels launched chained (programmatic dependent launch)")
           .Int(T::Field<int>([](O* o) { return &o->runtime.prefill_chunk; }), "prefill-chunk", "prefill_chunk", 1,
                1 << 20, "tokens per prefill chunk")
           .Int(T::Field<int>([](O* o) { return &o->runtime.max_batch; }), "", "max_batch", 1, 1 << 16,
                "sequences decoded together at most")
           .Bool(T::Field<bool>([](O* o) { return &o->runtime.cp_prefill_balance; }), "cp-prefill-balance",
                 "cp_prefill_balance",
                 "context group prefill: the later ranks hand half their rows' attention over the earlier keys to "
                 "the earlier ranks, so that every rank does the same work (every rank of a group must agree)")
           .Enum(&O::kv_policy, "kv-policy", "kv_policy", {"full", "shadowkv", "spindlekv", "specontext", "auto"},
                 "the KV policy (auto: full or shadowkv per document, spindlekv or specontext by pin; "
                 "docs/kv-policies.md)")
           .MiB(T::Field<size_t>([](O* o) { return &o->runtime.auto_exact_bytes; }), "auto-exact-mib", "auto_exact_mib",
                0, int64_t{1} << 30,
                "kv_policy auto: device MiB for documents (and sequences) held exact; 0: half of "
                "storage.memory.device_bytes");
  return *table;
}

void AddEngineFlags(Args& a) {
  a.Flag("config", "engine YAML (see configs/engine.yaml); flags override it")
      .Flag("storage-config", "the document cache's tiers (see configs/storage.yaml); over the engine YAML's storage:");
  EngineOptionTable().AddFlags(a);
  AddShadowKvFlags(a);
  AddSpindleKvFlags(a);
  AddSpeContextFlags(a);
}

Status ApplyEngineFlags(const Args& a, EngineOptions* o) {
  if (a.Has("config")) {
    PENUMBRA_ASSIGN_OR_RETURN(*o, LoadEngineOptionsFile(a.Get("config")));
  }
  if (a.Has("storage-config")) PENUMBRA_RETURN_IF_ERROR(LoadStorageOptionsFile(a.Get("storage-config"), o));
  PENUMBRA_RETURN_IF_ERROR(EngineOptionTable().ApplyFlags(a, o));
  PENUMBRA_RETURN_IF_ERROR(ApplyShadowKvFlags(a, &o->shadowkv));
  PENUMBRA_RETURN_IF_ERROR(ApplySpindleKvFlags(a, &o->spindlekv));
  return ApplySpeContextFlags(a, &o->specontext);
}

}  // namespace penumbra
