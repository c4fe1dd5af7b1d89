// penumbra-bench: throughput of the engine on a Llama-3.1-8B-shaped model with
// random weights generated on the device (no checkpoint), comparable to the
// developers' full-attention peer (peer_full_attention.py, bundled into
// .device/ by ops/device/pack.sh). One JSON line per measurement.
//   penumbra-bench decode  --context 61440,124928 [--batch N] [--steps 100] [--kv-policy full|shadowkv|spindlekv]
//   [--lanes N] penumbra-bench prefill --context 124928 [--cp-world 2 --cp-rank R --cp-rendezvous H:P] penumbra-bench
//   ttft    --context 124928 [--question 64] [--cache off|hbm|disk] [--store-dir DIR] penumbra-bench shared  --context
//   124928 [--batch 64] [--question 64] [--steps 20] [--tier0 on|off]
//                          (one shared document)
//   penumbra-bench cp-decode --context 2097152 --cp-world 2 --cp-rank R --cp-rendezvous H:P [--cuda-device R]
//                          (one sequence across the ranks of a context-parallel group, one process per
//                          GPU; --cp-world 1 or absent: the same on one GPU; rank 0 prints the line;
//                          --tls-ca/--tls-cert/--tls-key: the group's mutual TLS, --cp-secret-file its secret)
// decode fills each sequence's context with random keys and values (through
// the policy's real compression path for shadowkv and spindlekv), then times `steps` decode
// steps of the whole model after 2 warm-up steps, greedy sampling included.
// --lanes N splits the batch over N engine lanes (one weights copy, N streams
// and policies) driven by N host threads, so lanes overlap on the GPU.
//
// One file per mode (bench.h); this one parses the flags, opens the engine
// and runs the mode over each --context.
#include <filesystem>
#include <iostream>
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

#include "common/args.h"
#include "common/logging.h"
#include "worker/bench/bench.h"
#include "worker/engine/engine.h"
#include "worker/parallel/context_group.h"

namespace penumbra::bench {
namespace {

ModelConfig Llama8BShape(const Args& a, Status* st) {
  ModelConfig c;
  c.arch = Architecture::kLlama;
  auto geti = [&](const char* k, int64_t def) {
    auto r = a.GetInt(k, def);
    if (!r.ok()) *st = r.status();
    return r.ok() ? *r : def;
  };
  c.hidden_size = static_cast<int>(geti("hidden", 4096));
  c.intermediate_size = static_cast<int>(geti("ffn", 14336));
  c.num_layers = static_cast<int>(geti("layers", 32));
  c.num_heads = static_cast<int>(geti("heads", 32));
  c.num_kv_heads = static_cast<int>(geti("kv-heads", 8));
  c.head_dim = static_cast<int>(geti("head-dim", 128));
  c.vocab_size = static_cast<int>(geti("vocab", 128256));
  c.max_position_embeddings = int64_t{1} << 22;
  c.rope_theta = 500000.0;
  c.rope_scaling.type = "llama3";
  c.rope_scaling.factor = 8.0;
  c.rope_scaling.low_freq_factor = 1.0;
  c.rope_scaling.high_freq_factor = 4.0;
  c.rope_scaling.original_max_position_embeddings = 8192;
  c.rms_norm_eps = 1e-5;
  c.torch_dtype = DType::kBF16;
  return c;
}

// Device-to-device copy bandwidth (bytes read + written per second), the
// practical HBM ceiling used for roofline fractions.
double MeasureCopyGBps(Backend& b) {
  const size_t bytes = size_t{2} << 30;
  auto src = b.Allocate(bytes);
  auto dst = b.Allocate(bytes);
  if (!src.ok() || !dst.ok()) return 0;
  (void)b.CopyDeviceToDevice(dst->get(), src->get(), bytes);
  (void)b.Synchronize();
  const double t0 = NowSeconds();
  for (int i = 0; i < 5; ++i) (void)b.CopyDeviceToDevice(dst->get(), src->get(), bytes);
  (void)b.Synchronize();
  return 2.0 * bytes * 5 / (NowSeconds() - t0) / 1e9;
}

Status Main(int argc, char** argv) {
  if (argc < 2) {
    return Status::InvalidArgument(
        "usage: penumbra-bench decode|prefill|ttft|shared|cp-decode --context N[,N...] [options]");
  }
  const std::string mode = argv[1];
  if (mode != "decode" && mode != "prefill" && mode != "ttft" && mode != "shared" && mode != "cp-decode") {
    return Status::InvalidArgument("mode must be decode, prefill, ttft, shared or cp-decode");
  }
  Args a;
  a.Flag("context", "context lengths, comma-separated")
      .Flag("batch", "sequences (default: largest that fits)")
      .Flag("steps", "timed decode steps (default 100)")
      .Flag("kv-policy", "full, shadowkv, spindlekv or specontext")
      .Flag("force-hit-rate", "shadowkv: keep this fraction of the previous step's chunks")
      .Flag("hit-rates",
            "shadowkv: measure each of these forced hit rates on the same sequences, comma-separated, "
            "'natural' for none (e.g. natural,0.6)")
      .Flag("batch-sweep", "decode: build the batch once, then time the first b sequences for each b, comma-separated")
      .Flag("device", "cuda (default) or cpu")
      .Flag("dtype", "bf16 (default) or f32")
      .Flag("cuda-device", "CUDA device ordinal (default 0)")
      .Flag("linear",
            "CUDA linear layers: auto (skinny kernel for batches <= 8, SwiGLU fused; default), "
            "skinny (unfused) or cublas")
      .Flag("chained-launch", "CUDA: decode kernels launched chained, on (default) or off")
      .Flag("prefill-chunk", "tokens per prefill chunk")
      .Flag("cp-prefill-balance",
            "prefill with --cp-world: on (default): the later ranks hand half their rows' attention over the "
            "earlier keys to the earlier ranks, so every rank does the same work; off: each rank its own rows")
      .Flag("max-batch", "runtime max batch")
      .Flag("fetch-turns", "shadowkv with --lanes > 1: lanes take turns on the host link, on or off (default on)")
      .Flag("lanes", "decode: independent pipelines (lanes) sharing the weights, one host thread each (default 1)")
      .Flag("cache",
            "ttft: off (cold prefill, default), hbm (the document's KV state attached from the prefix "
            "cache in device memory) or disk (read back from the prefix store, as after a restart)")
      .Flag("store-dir",
            "ttft --cache disk: the prefix store's directory, emptied first "
            "(default /tmp/penumbra-ttft-store)")
      .Flag("question", "ttft, shared: question tokens after the document (default 64)")
      .Flag("tier0",
            "shared, ttft: on (default): a hot document's values are copied to spare device memory "
            "(configs/storage.yaml gpu:); off: they stay in host memory")
      .Flag("store-read-threads", "ttft --cache disk: blocks read at once when a stored prefix is read (default 32)")
      .Flag("lazy-threads", "ttft --cache disk: reads in flight for lazily read values (default 64)")
      .Flag("lazy-reads", "ttft --cache disk: on (default): values read lazily; off: read whole before the first token")
      .Flag("layers", "")
      .Flag("hidden", "")
      .Flag("ffn", "")
      .Flag("heads", "")
      .Flag("kv-heads", "")
      .Flag("head-dim", "")
      .Flag("vocab", "")
      .Flag("kernel-trace",
            "decode, cp-decode and shared, CUDA: write every kernel and copy of the run's first measurement's "
            "timed steps (ttft: of the timed question) to this file, one JSON line each (ops/trace_summary.py "
            "summarizes it)")
      .Switch("fetch-timeline",
              "decode, shadowkv: time every value fetch of the timed steps on the device and "
              "report how long per step the PCIe link was busy (fetch_timeline)")
      .Switch("profile",
              "prefill: time each ShadowKV compression op; decode: time every op of 5 extra steps "
              "(synchronizes after each)");
  AddShadowKvFlags(a);
  AddSpindleKvFlags(a);
  AddSpeContextFlags(a);
  AddContextGroupFlags(a);
  transport::AddSecurityFlags(a);  // the context group's TLS certificates (role worker), --insecure
  PENUMBRA_RETURN_IF_ERROR(a.Parse(argc, argv, 2));
  if (a.Has("cp-world") && mode != "cp-decode" && mode != "prefill") {
    return Status::InvalidArgument("--cp-world applies to cp-decode and prefill only");
  }
  PENUMBRA_ASSIGN_OR_RETURN(const transport::ProcessSecurity security, transport::SecurityFromFlags(a));
  Status st;
  ModelConfig c = Llama8BShape(a, &st);
  PENUMBRA_RETURN_IF_ERROR(st);
  EngineOptions eo;
  eo.backend.device = a.Get("device", "cuda");
  eo.backend.dtype = a.Get("dtype", "bf16");
  PENUMBRA_ASSIGN_OR_RETURN(int64_t ordinal, a.GetIntIn("cuda-device", 0, 0, 1023));
  eo.backend.cuda_device = static_cast<int>(ordinal);
  eo.backend.linear = a.Get("linear", "auto");
  PENUMBRA_ASSIGN_OR_RETURN(eo.backend.chained_launch, a.GetOnOff("chained-launch", true));
  eo.kv_policy = a.Get("kv-policy", "full");
  PENUMBRA_ASSIGN_OR_RETURN(int64_t chunk, a.GetInt("prefill-chunk", 4096));
  PENUMBRA_ASSIGN_OR_RETURN(int64_t mb, a.GetInt("max-batch", 256));
  eo.runtime.prefill_chunk = static_cast<int>(chunk);
  eo.runtime.max_batch = static_cast<int>(mb);
  PENUMBRA_ASSIGN_OR_RETURN(eo.runtime.cp_prefill_balance,
                            a.GetOnOff("cp-prefill-balance", eo.runtime.cp_prefill_balance));
  const std::string cache = a.Get("cache", "off");
  if (cache != "off" && cache != "hbm" && cache != "disk") {
    return Status::InvalidArgument("--cache must be off, hbm or disk, got " + cache);
  }
  if (a.Has("cache") && mode != "ttft") return Status::InvalidArgument("--cache applies to ttft only");
  if (cache != "off" || mode == "shared") eo.runtime.prefix_cache_bytes = size_t{1} << 50;  // bounded by device memory
  PENUMBRA_ASSIGN_OR_RETURN(bool tier0, a.GetOnOff("tier0", true));
  if (!tier0) eo.runtime.tiers.gpu_capacity_bytes = 0;
  if (cache == "disk") {
    eo.prefix_store.path = a.Get("store-dir", "/tmp/penumbra-ttft-store");
    std::error_code ec;
    std::filesystem::remove_all(eo.prefix_store.path, ec);
    eo.prefix_store.capacity_bytes = size_t{1} << 40;
    eo.prefix_store.direct_reads = true;
    PENUMBRA_ASSIGN_OR_RETURN(int64_t rt, a.GetIntIn("store-read-threads", 32, 1, 256));
    eo.prefix_store.read_threads = static_cast<size_t>(rt);
    PENUMBRA_ASSIGN_OR_RETURN(int64_t lt, a.GetIntIn("lazy-threads", 64, 1, 256));
    eo.runtime.prefix_store_lazy_threads = static_cast<int>(lt);
    PENUMBRA_ASSIGN_OR_RETURN(eo.runtime.prefix_store_lazy_reads,
                              a.GetOnOff("lazy-reads", eo.runtime.prefix_store_lazy_reads));
  }
  ShadowKvOptions& s = eo.shadowkv;
  PENUMBRA_ASSIGN_OR_RETURN(s.force_hit_rate, a.GetDouble("force-hit-rate", -1.0));
  s.min_prompt_tokens = 0;  // the benchmark's contexts always take the sparse path unless --min-prompt says so
  PENUMBRA_RETURN_IF_ERROR(ApplyShadowKvFlags(a, &s));
  PENUMBRA_RETURN_IF_ERROR(ApplySpindleKvFlags(a, &eo.spindlekv));
  PENUMBRA_RETURN_IF_ERROR(ApplySpeContextFlags(a, &eo.specontext));
  PENUMBRA_ASSIGN_OR_RETURN(s.fetch_turns, a.GetOnOff("fetch-turns", s.fetch_turns));
  PENUMBRA_ASSIGN_OR_RETURN(auto contexts, a.GetIntList("context"));
  if (contexts.empty()) return Status::InvalidArgument("--context is required");
  PENUMBRA_ASSIGN_OR_RETURN(int64_t lanes, a.GetInt("lanes", 1));
  if (lanes < 1 || lanes > 64) return Status::InvalidArgument("--lanes must be in [1, 64]");
  if (lanes > 1 && mode != "decode") return Status::InvalidArgument("--lanes applies to decode only");
  PENUMBRA_ASSIGN_OR_RETURN(auto engine, Engine::OpenRandom(c, eo, 42));
  for (int64_t l = 1; l < lanes; ++l) PENUMBRA_RETURN_IF_ERROR(engine->AddLane().status());
  // cp-decode: this process is one rank of a context-parallel group.
  PENUMBRA_ASSIGN_OR_RETURN(std::unique_ptr<Collective> group, JoinContextGroup(a, &engine->backend(), security));
  if (group) PENUMBRA_RETURN_IF_ERROR(engine->runtime().SetContextGroup(group.get()));
  Common cm;
  cm.gpu = engine->backend().name();
  const double copy =
      mode == "decode" && engine->backend().device() == Device::kCUDA ? MeasureCopyGBps(engine->backend()) : 0;
  bool trace_pending = a.Has("kernel-trace");
  for (int64_t S : contexts) {
    Status r = mode == "decode"      ? RunDecode(a, *engine, cm, S, copy, &trace_pending)
               : mode == "ttft"      ? RunTtft(a, *engine, cm, S)
               : mode == "shared"    ? RunShared(a, *engine, cm, S)
               : mode == "cp-decode" ? RunCpDecode(a, *engine, cm, S, group.get())
                                     : RunPrefill(a, *engine, cm, S, group.get());
    if (!r.ok()) {
      nlohmann::json j = cm.Line(mode);
      j["context"] = S;
      j["kv_policy"] = eo.kv_policy;
      j["error"] = r.ToString();
      std::cout << j.dump() << std::endl;
      // A context that cannot run (out of memory) is a result; a bad flag or
      // option is the caller's error and ends the run with a non-zero exit.
      if (r.code() == StatusCode::kInvalidArgument) return r;
    }
  }
  return Status::OK();
}

}  // namespace
}  // namespace penumbra::bench

int main(int argc, char** argv) {
  penumbra::InitLogging(argv[0]);
  penumbra::Status s = penumbra::bench::Main(argc, argv);
  if (!s.ok()) {
    std::cerr << "penumbra-bench: " << s.ToString() << std::endl;
    return 2;
  }
  return 0;
}
