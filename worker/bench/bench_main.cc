// penumbra-bench: throughput of the engine on a Llama-3.1-8B-shaped model with
// random weights generated on the device (no checkpoint), comparable to the
// developers' full-attention peer (peer_full_attention.py, bundled into
// .device/ by ops/device/pack.sh). One JSON line per measurement.
//   penumbra-bench decode  --context 61440,124928 [--batch N] [--steps 100] [--kv-policy full|shadowkv] [--lanes N]
//   penumbra-bench prefill --context 124928 [--cp-world 2 --cp-rank R --cp-rendezvous H:P]
//   penumbra-bench ttft    --context 124928 [--question 64] [--cache off|hbm|disk] [--store-dir DIR]
//   penumbra-bench shared  --context 124928 [--batch 64] [--question 64] [--steps 20] [--tier0 on|off]
//                          (one shared document)
//   penumbra-bench cp-decode --context 2097152 --cp-world 2 --cp-rank R --cp-rendezvous H:P [--cuda-device R]
//                          (one sequence across the ranks of a context-parallel group, one process per
//                          GPU; --cp-world 1 or absent: the same on one GPU; rank 0 prints the line;
//                          --tls-ca/--tls-cert/--tls-key: the group's mutual TLS, --cp-secret-file its secret)
// decode fills each sequence's context with random keys and values (through
// the policy's real compression path for shadowkv), then times `steps` decode
// steps of the whole model after 2 warm-up steps, greedy sampling included.
// --lanes N splits the batch over N engine lanes (one weights copy, N streams
// and policies) driven by N host threads, so lanes overlap on the GPU.
#include <algorithm>
#include <atomic>
#include <barrier>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <iostream>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/args.h"
#include "common/logging.h"
#include "worker/parallel/context_group.h"
#include "worker/bench/kernel_trace.h"
#include "worker/engine/engine.h"
#include "worker/engine/op_profiler.h"
#include "worker/engine/shadowkv_prefix.h"

namespace penumbra {
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

struct Common {
  std::string gpu;
  nlohmann::json Line(const std::string& mode) const {
    nlohmann::json j;
    j["mode"] = mode;
    j["gpu"] = gpu;
    return j;
  }
};

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

// One lane's share of a decode measurement.
struct LaneRun {
  std::vector<int64_t> seqs;
  Status status;
  double end = 0;  // when the lane finished its timed steps (NowSeconds())
  std::map<std::string, double> profile_ms;  // --profile: per-op ms over kProfileSteps steps
};

// --profile: steps after the timed ones whose ops are timed one by one.
constexpr int kProfileSteps = 5;

// kProfileSteps calls of `step` with every op of rt timed (synchronized: no
// overlap), sampling included: per-op milliseconds over all of them.
Status ProfileSteps(Backend& b, Runtime& rt, const std::function<Status()>& step,
                    std::map<std::string, double>* ms) {
  OpProfiler prof(&b);
  rt.SetDecodeProfiler(&prof);
  Status st;
  for (int i = 0; i < kProfileSteps && st.ok(); ++i) {
    st = step();
    prof.Lap("sample");
  }
  rt.SetDecodeProfiler(nullptr);
  *ms = prof.ms();
  return st;
}

// Per step: where the time goes (ProfileSteps' milliseconds), into j.
void AddProfile(const std::map<std::string, double>& ms, nlohmann::json& j) {
  double total = 0;
  for (const auto& [op, t] : ms) {
    j["decode_op_ms"][op] = t / kProfileSteps;
    total += t / kProfileSteps;
  }
  j["profiled_ms_per_step"] = total;
}

// --hit-rates: comma-separated forced hit rates, "natural" for none; without
// the flag, the one of --force-hit-rate.
Result<std::vector<double>> HitRates(const Args& a, double def) {
  if (!a.Has("hit-rates")) return std::vector<double>{def};
  std::vector<double> out;
  std::stringstream ss(a.Get("hit-rates", ""));
  std::string item;
  while (std::getline(ss, item, ',')) {
    if (item == "natural") {
      out.push_back(-1.0);
      continue;
    }
    char* end = nullptr;
    const double v = std::strtod(item.c_str(), &end);
    if (item.empty() || *end != '\0' || !(v >= 0.0 && v <= 1.0)) {
      return Status::InvalidArgument("--hit-rates: '" + item + "' is neither 'natural' nor a fraction in [0, 1]");
    }
    out.push_back(v);
  }
  if (out.empty()) return Status::InvalidArgument("--hit-rates is empty");
  return out;
}

// With --lanes N the batch is split round-robin over N lanes (sequence i on
// lane i % N), each driven by its own host thread (lane 0 by this one): 2
// warm-up steps, a barrier, `steps` timed steps and a synchronize per lane.
// The step time is the wall time from the barrier's release to the last lane
// finishing, divided by `steps`. N = 1 is the single-pipeline loop.
//
// The batch is built once (the costly part: SVD, landmarks and offload of
// every sequence). --batch-sweep times the first b sequences of it for each b
// (the others wait), and --hit-rates repeats every measurement for each
// forced hit rate, each a JSON line of its own.
// `trace_pending`: --kernel-trace has not traced a measurement yet (of any context).
Status RunDecode(const Args& a, Engine& e, const Common& cm, int64_t S, double copy_gbps, bool* trace_pending) {
  const ModelConfig& c = e.config();
  const int N = e.lanes();
  Backend& b0 = e.backend();
  PENUMBRA_ASSIGN_OR_RETURN(int64_t steps, a.GetInt("steps", 100));
  PENUMBRA_ASSIGN_OR_RETURN(int64_t batch, a.GetInt("batch", 0));
  if (steps < 1) return Status::InvalidArgument("--steps must be >= 1");
  const bool profile = a.Has("profile");
  if (profile && N > 1) return Status::InvalidArgument("--profile times the ops of one lane: use --lanes 1");
  const bool shadowkv = e.options().kv_policy == "shadowkv";
  PENUMBRA_ASSIGN_OR_RETURN(const std::vector<double> rates, HitRates(a, e.options().shadowkv.force_hit_rate));
  if (a.Has("hit-rates") && !shadowkv) return Status::InvalidArgument("--hit-rates needs --kv-policy shadowkv");
  const bool timeline = a.Has("fetch-timeline");
  if (timeline && !shadowkv) return Status::InvalidArgument("--fetch-timeline needs --kv-policy shadowkv");
  PENUMBRA_ASSIGN_OR_RETURN(const std::vector<int64_t> sweep, a.GetIntList("batch-sweep"));
  for (int64_t nb : sweep) {
    // A lane without sequences would not step, and lanes with fetch turns
    // wait (bounded) for each other every step.
    if (nb < N) return Status::InvalidArgument("--batch-sweep sizes must be >= --lanes");
  }
  const int64_t measurements = static_cast<int64_t>(rates.size() * std::max<size_t>(sweep.size(), 1));
  const int64_t new_tokens = measurements * (steps + 2 + (profile ? kProfileSteps : 0)) + 2;
  const int64_t reserve = static_cast<int64_t>(4.0 * (1 << 30));
  std::vector<LaneRun> runs(N);
  auto remove_all = [&] {
    for (int l = 0; l < N; ++l) {
      for (int64_t s : runs[l].seqs) e.runtime(l).RemoveSequence(s);
      runs[l].seqs.clear();
    }
  };
  // Find the largest batch that fits by adding sequences until memory runs out
  // (or the requested batch), leaving `reserve` bytes free for activations.
  // Free memory is device-wide: lane 0's backend reports it for all lanes.
  const int64_t max_b = batch > 0 ? batch : 4096;
  Status last;
  int64_t added = 0;
  for (int64_t i = 0; i < max_b; ++i) {
    const int l = static_cast<int>(i % N);
    Runtime& rt = e.runtime(l);
    Backend& b = e.backend(l);
    if (batch == 0 && static_cast<int64_t>(b0.FreeMemoryBytes()) < reserve) break;
    last = rt.AddSequence(i, S, new_tokens);
    if (!last.ok()) break;
    last = rt.policy().SynthesizeContext(i, S, 1000 + i);
    if (!last.ok()) {
      rt.RemoveSequence(i);
      break;
    }
    PENUMBRA_RETURN_IF_ERROR(b.Synchronize());
    if (batch == 0 && static_cast<int64_t>(b0.FreeMemoryBytes()) < reserve) {
      rt.RemoveSequence(i);
      break;
    }
    runs[l].seqs.push_back(i);
    ++added;
  }
  if (added == 0) return last.ok() ? Status::ResourceExhausted("not even one sequence fits") : last;
  if (batch > 0 && added < batch) {
    remove_all();
    return last;
  }
  const int B = static_cast<int>(added);
  const std::string limit = batch > 0 ? "requested" : last.ok() ? "gpu-memory-reserve" : last.ToString();
  std::vector<int64_t> pos(B, S);  // next position of each sequence (ids 0..B-1)

  // --fetch-timeline: every value fetch of the timed steps as a device-timed
  // interval, to see how busy the PCIe link is (union over lanes).
  if (timeline) {
    for (int l = 0; l < N; ++l) e.backend(l).SetFetchTimeline(true);  // the reference is recorded here, idle
  }
  // --kernel-trace PATH: the run's first measurement's timed steps as a
  // device timeline of every kernel and copy (ops/trace_summary.py reads it).
  const std::string trace_path = a.Get("kernel-trace", "");
  if (a.Has("kernel-trace") && trace_path.empty()) return Status::InvalidArgument("--kernel-trace needs a file path");
  if (!trace_path.empty() && profile) return Status::InvalidArgument("--kernel-trace and --profile do not mix");
  if (!trace_path.empty() && b0.device() != Device::kCUDA) {
    return Status::InvalidArgument("--kernel-trace traces the CUDA backend's kernels: use --device cuda");
  }
  // Times the first `nb` sequences at forced hit rate `rate` (< 0: natural).
  auto measure = [&](int nb, double rate) -> Status {
    std::vector<std::vector<int64_t>> active(N);
    for (int l = 0; l < N; ++l) {
      for (int64_t s : runs[l].seqs)
        if (s < nb) active[l].push_back(s);
      if (shadowkv) PENUMBRA_RETURN_IF_ERROR(e.runtime(l).policy().SetForcedHitRate(rate));
    }
    std::vector<PolicyStats> before(N), after(N);
    for (LaneRun& r : runs) {
      r.status = Status::OK();
      r.end = 0;
      r.profile_ms.clear();
    }
    std::atomic<bool> failed{false};
    double t0 = 0;
    const bool traced = *trace_pending;
    *trace_pending = false;
    std::unique_ptr<KernelTrace> trace;
    Status trace_status;
    std::barrier start(N, [&]() noexcept {
      if (traced && !failed) {
        auto t = KernelTrace::Start();  // every lane is idle here (warm-up synchronized)
        if (t.ok()) trace = std::move(*t); else trace_status = t.status();
      }
      t0 = NowSeconds();
    });
    auto drive = [&](int l) {
      LaneRun& run = runs[l];
      Runtime& rt = e.runtime(l);
      Backend& b = e.backend(l);
      const std::vector<int64_t>& seqs = active[l];
      const int lb = static_cast<int>(seqs.size());
      std::vector<int32_t> tokens(lb, 1);
      std::vector<SampleParams> greedy(lb);
      std::vector<int32_t> next(lb);
      std::vector<int64_t> positions(lb);
      auto step = [&]() -> Status {
        if (lb == 0) return Status::OK();
        for (int i = 0; i < lb; ++i) positions[i] = pos[seqs[i]]++;  // this lane's sequences only
        PENUMBRA_ASSIGN_OR_RETURN(const float* logits, rt.DecodeStep(seqs, tokens, positions));
        PENUMBRA_RETURN_IF_ERROR(b.Sample(logits, lb, c.vocab_size, greedy, next.data()));
        tokens = next;
        return Status::OK();
      };
      // After the timed steps: kProfileSteps more with every op timed.
      auto profiled = [&]() -> Status { return ProfileSteps(b, rt, step, &run.profile_ms); };
      auto warm = [&]() -> Status {
        PENUMBRA_RETURN_IF_ERROR(step());
        PENUMBRA_RETURN_IF_ERROR(step());
        before[l] = rt.policy().stats();
        return b.Synchronize();
      };
      auto timed = [&]() -> Status {
        if (timeline) b.SetFetchTimeline(true);  // drops the warm-up's intervals
        for (int64_t i = 0; i < steps; ++i) PENUMBRA_RETURN_IF_ERROR(step());
        const Status st = b.Synchronize();
        after[l] = rt.policy().stats();
        if (timeline) b.SetFetchTimeline(false);
        return st;
      };
      run.status = warm();
      if (!run.status.ok()) failed = true;
      // Every lane arrives, failed or not, so none waits forever; after the
      // release a lane runs the timed steps only if every warm-up succeeded.
      start.arrive_and_wait();
      if (failed) return;
      run.status = timed();
      run.end = NowSeconds();
      if (profile && run.status.ok()) run.status = profiled();
    };
    std::vector<std::thread> threads;
    threads.reserve(N - 1);
    for (int l = 1; l < N; ++l) threads.emplace_back(drive, l);
    drive(0);
    for (std::thread& t : threads) t.join();
    // Every lane's error, under the first failing lane's code.
    Status first;
    std::string errors;
    for (int l = 0; l < N; ++l) {
      if (runs[l].status.ok()) continue;
      if (first.ok()) first = runs[l].status;
      errors += (errors.empty() ? "" : "; ") + ("lane " + std::to_string(l) + ": " + runs[l].status.ToString());
    }
    if (!first.ok()) return N == 1 ? first : Status(first.code(), errors);
    PENUMBRA_RETURN_IF_ERROR(trace_status);
    size_t trace_records = 0;
    if (trace) {
      PENUMBRA_ASSIGN_OR_RETURN(std::vector<TraceRecord> recs, trace->Stop());
      trace_records = recs.size();
      PENUMBRA_RETURN_IF_ERROR(KernelTrace::Write(recs, trace_path));
    }
    double end = 0;
    for (const LaneRun& r : runs) end = std::max(end, r.end);
    const double dt = (end - t0) / steps;
    nlohmann::json j = cm.Line("decode");
    j["kv_policy"] = e.options().kv_policy;
    j["context"] = S;
    j["batch"] = nb;
    if (!sweep.empty()) j["built_batch"] = B;  // the sweep's sequences were built once, this many
    if (N > 1) {
      j["lanes"] = N;
      std::vector<int> lane_batch;
      for (const auto& s : active) lane_batch.push_back(static_cast<int>(s.size()));
      j["lane_batch"] = lane_batch;
    }
    j["steps"] = steps;
    j["tokens_per_s"] = nb / dt;
    j["ms_per_step"] = dt * 1e3;
    j["batch_limit"] = limit;
    size_t dev_bytes = 0;
    for (int l = 0; l < N; ++l) {
      for (int64_t s : active[l]) dev_bytes += e.runtime(l).policy().DeviceBytes(s);
    }
    j["kv_device_bytes_per_token"] = static_cast<double>(dev_bytes) / (static_cast<double>(S) * nb);
    if (profile) AddProfile(runs[0].profile_ms, j);
    if (!shadowkv) {
      // Bytes a step must read: all weights once per lane with sequences (each
      // lane's GEMMs stream them) + every sequence's K and V.
      int busy_lanes = 0;
      for (const auto& s : active) busy_lanes += s.empty() ? 0 : 1;
      const double kv = 2.0 * c.num_layers * c.num_kv_heads * c.head_dim * DTypeSize(b0.act_dtype()) * (S + 2.0 + steps / 2.0) * nb;
      const double bytes = static_cast<double>(e.weights().device_bytes()) * busy_lanes + kv;
      j["hbm_gbps"] = bytes / dt / 1e9;
      if (copy_gbps > 0) j["hbm_roofline_fraction"] = bytes / dt / 1e9 / (copy_gbps);
    } else {
      int64_t sel = 0, hit = 0;
      for (int l = 0; l < N; ++l) {
        sel += after[l].selected_chunks - before[l].selected_chunks;
        hit += after[l].hit_chunks - before[l].hit_chunks;
      }
      j["hit_rate"] = sel ? static_cast<double>(hit) / sel : 0.0;
      if (timeline) {
        std::vector<Backend::Interval> all;
        double kernel_ms = 0;
        for (int l = 0; l < N; ++l) {
          PENUMBRA_ASSIGN_OR_RETURN(std::vector<Backend::Interval> iv, e.backend(l).FetchIntervals());
          for (const Backend::Interval& x : iv) kernel_ms += x.end_ms - x.start_ms;
          all.insert(all.end(), iv.begin(), iv.end());
        }
        // Sweep over the start/end points: time with >= 1 and >= 2 fetches running.
        std::vector<std::pair<double, int>> edges;
        for (const Backend::Interval& x : all) {
          edges.push_back({x.start_ms, +1});
          edges.push_back({x.end_ms, -1});
        }
        std::sort(edges.begin(), edges.end());
        double busy_ms = 0, dual_ms = 0, prev = 0;
        int running = 0;
        for (const auto& [t, delta] : edges) {
          if (running >= 1) busy_ms += t - prev;
          if (running >= 2) dual_ms += t - prev;
          running += delta;
          prev = t;
        }
        const ShadowKvOptions& o = e.options().shadowkv;
        const double bytes = static_cast<double>(sel - hit) * o.chunk_size * c.head_dim * DTypeSize(b0.act_dtype());
        nlohmann::json t;
        t["fetches_per_step"] = static_cast<double>(all.size()) / steps;
        t["busy_ms_per_step"] = busy_ms / steps;    // some fetch running (any lane)
        t["kernel_ms_per_step"] = kernel_ms / steps;  // summed over fetches (overlapping ones counted twice)
        t["concurrent_ms_per_step"] = dual_ms / steps;  // two or more fetches (lanes) running at once
        t["bytes_per_step"] = bytes / steps;
        t["gbps_while_busy"] = busy_ms > 0 ? bytes / (busy_ms * 1e-3) / 1e9 : 0.0;
        j["fetch_timeline"] = t;
      }
      j["force_hit_rate"] = rate;
      j["value_fetch"] = e.options().shadowkv.value_fetch;
      j["micro_batches"] = e.options().shadowkv.micro_batches;
      j["fetch_blocks"] = e.options().shadowkv.fetch_blocks;
      j["chunk_size"] = e.options().shadowkv.chunk_size;
      j["successor_chunks"] = e.options().shadowkv.successor_chunks;
      j["landmarks_per_chunk"] = e.options().shadowkv.landmarks_per_chunk;
      j["landmark_format"] = e.options().shadowkv.landmark_format;
      if (N > 1) j["fetch_turns"] = e.options().shadowkv.fetch_turns;
    }
    j["linear"] = e.options().backend.linear;
    j["chained_launch"] = e.options().backend.chained_launch;
    j["hbm_copy_gbps"] = copy_gbps;
    if (traced) {
      j["kernel_trace"] = trace_path;  // this measurement's steps ran traced: slower than untraced
      j["kernel_trace_records"] = trace_records;
    }
    std::cout << j.dump() << std::endl;
    return Status::OK();
  };

  Status st;
  for (double rate : rates) {
    for (int64_t nb : sweep.empty() ? std::vector<int64_t>{B} : sweep) {
      if (nb > B) {
        nlohmann::json j = cm.Line("decode");
        j["kv_policy"] = e.options().kv_policy;
        j["context"] = S;
        j["batch"] = nb;
        j["error"] = "batch " + std::to_string(nb) + " does not fit: " + std::to_string(B) + " sequences were built (" +
                     limit + ")";
        std::cout << j.dump() << std::endl;
        continue;
      }
      st = measure(static_cast<int>(nb), rate);
      if (!st.ok()) break;
    }
    if (!st.ok()) break;
  }
  remove_all();
  for (int l = 0; l < N; ++l) (void)e.backend(l).Synchronize();
  return st;
}

// One sequence (or --batch of them) of S tokens decoding across the ranks of
// a context-parallel group (`group`, null: this process alone): each rank
// synthesizes its shard (random keys and values through the policy's real
// compression path) and every rank runs the same steps; the step time is
// rank 0's wall time over `steps` steps after 2 warm-up steps, all ranks
// synchronized at its start and end.
Status RunCpDecode(const Args& a, Engine& e, const Common& cm, int64_t S, Collective* group) {
  const ModelConfig& c = e.config();
  Runtime& rt = e.runtime();
  Backend& b = e.backend();
  PENUMBRA_ASSIGN_OR_RETURN(int64_t steps, a.GetIntIn("steps", 20, 1, 100000));
  PENUMBRA_ASSIGN_OR_RETURN(int64_t batch, a.GetIntIn("batch", 1, 1, rt.max_batch()));
  const int rank = group ? group->rank() : 0, world = group ? group->world() : 1;
  const Runtime::Shard shard = Runtime::ShardOf(S, rank, world);
  const int64_t new_tokens = steps + 4;
  const double t_setup = NowSeconds();
  std::vector<int64_t> seqs;
  Status st;
  for (int64_t i = 0; i < batch && st.ok(); ++i) {
    st = rt.AddSequence(i, S, new_tokens);
    if (st.ok()) {
      seqs.push_back(i);
      st = rt.policy().SynthesizeContext(i, shard.end - shard.begin, 1000 + i);
    }
  }
  if (st.ok()) st = b.Synchronize();
  // Every rank reports whether its shards fit before any decodes.
  if (group) {
    std::vector<int32_t> ok(static_cast<size_t>(world));
    const int32_t mine = st.ok() ? 1 : 0;
    PENUMBRA_RETURN_IF_ERROR(group->AllGatherHost(&mine, ok.data(), sizeof(mine)));
    for (int r = 0; r < world && st.ok(); ++r) {
      if (!ok[r]) st = Status::ResourceExhausted("rank " + std::to_string(r) + " could not hold its shard");
    }
  }
  auto remove_all = [&] {
    for (int64_t s : seqs) rt.RemoveSequence(s);
  };
  if (!st.ok()) {
    remove_all();
    return st;
  }
  const double setup_s = NowSeconds() - t_setup;
  std::vector<int32_t> tokens(seqs.size(), 1), next(seqs.size());
  std::vector<int64_t> positions(seqs.size(), S);
  std::vector<SampleParams> greedy(seqs.size());
  auto step = [&]() -> Status {
    PENUMBRA_ASSIGN_OR_RETURN(const float* logits, rt.DecodeStep(seqs, tokens, positions));
    PENUMBRA_RETURN_IF_ERROR(b.Sample(logits, static_cast<int>(seqs.size()), c.vocab_size, greedy, next.data()));
    if (group) PENUMBRA_RETURN_IF_ERROR(group->BroadcastHost(next.data(), next.size() * sizeof(int32_t), 0));
    tokens = next;
    for (int64_t& p : positions) ++p;
    return Status::OK();
  };
  auto run = [&]() -> Result<double> {
    PENUMBRA_RETURN_IF_ERROR(step());
    PENUMBRA_RETURN_IF_ERROR(step());
    PENUMBRA_RETURN_IF_ERROR(b.Synchronize());
    if (group) PENUMBRA_RETURN_IF_ERROR(group->Barrier());
    const double t0 = NowSeconds();
    for (int64_t i = 0; i < steps; ++i) PENUMBRA_RETURN_IF_ERROR(step());
    PENUMBRA_RETURN_IF_ERROR(b.Synchronize());
    if (group) PENUMBRA_RETURN_IF_ERROR(group->Barrier());
    return NowSeconds() - t0;
  };
  Result<double> dt = run();
  const PolicyStats ps = rt.policy().stats();
  size_t dev = 0;
  for (int64_t s : seqs) dev += rt.policy().DeviceBytes(s);
  remove_all();
  PENUMBRA_RETURN_IF_ERROR(dt.status());
  if (rank != 0) return Status::OK();
  nlohmann::json j = cm.Line("cp-decode");
  j["bench"] = "cp-decode";
  j["gpus"] = world;
  j["context"] = S;
  j["shard_tokens"] = shard.end - shard.begin;  // rank 0's
  j["batch"] = seqs.size();
  j["steps"] = steps;
  j["tokens_per_s"] = static_cast<double>(seqs.size()) * steps / *dt;
  j["ms_per_step"] = *dt / steps * 1e3;
  j["setup_s"] = setup_s;
  j["kv_policy"] = e.options().kv_policy;
  j["kv_device_bytes_rank0"] = dev;
  if (e.options().kv_policy == "shadowkv") {
    j["budget_tokens"] = e.options().shadowkv.budget_tokens;
    j["shard_selection"] = e.options().shadowkv.shard_selection;
    // Under the global selection a shard's live slots vary: no hit rate.
    if (world == 1 || e.options().shadowkv.shard_selection == "local") j["hit_rate_rank0"] = ps.hit_rate();
  }
  std::cout << j.dump() << std::endl;
  return Status::OK();
}

// With a context group (--cp-world): the prompt's shards prefilled by the
// ranks together (each attends to the earlier shards' keys); rank 0 prints.
Status RunPrefill(const Args& a, Engine& e, const Common& cm, int64_t S, Collective* group) {
  Runtime& rt = e.runtime();
  std::vector<int32_t> prompt(S);
  for (int64_t i = 0; i < S; ++i) prompt[i] = static_cast<int32_t>((i * 7919) % e.config().vocab_size);
  PENUMBRA_RETURN_IF_ERROR(rt.AddSequence(0, S, 1));
  // Warm-up on a short prompt so handles and kernels are loaded.
  std::vector<int32_t> warm(prompt.begin(), prompt.begin() + std::min<int64_t>(S, 1024));
  PENUMBRA_RETURN_IF_ERROR(rt.AddSequence(1, warm.size(), 1));
  PENUMBRA_RETURN_IF_ERROR(rt.Prefill(1, warm, nullptr));
  rt.RemoveSequence(1);
  if (a.Has("profile")) rt.policy().SetProfiling(true);
  if (group) PENUMBRA_RETURN_IF_ERROR(group->Barrier());
  const double t0 = NowSeconds();
  PENUMBRA_RETURN_IF_ERROR(rt.Prefill(0, prompt, nullptr));
  PENUMBRA_RETURN_IF_ERROR(e.backend().Synchronize());
  if (group) PENUMBRA_RETURN_IF_ERROR(group->Barrier());
  const double dt = NowSeconds() - t0;
  if (group && group->rank() != 0) {
    rt.RemoveSequence(0);
    return Status::OK();
  }
  nlohmann::json j = cm.Line("prefill");
  j["gpus"] = group ? group->world() : 1;
  j["kv_policy"] = e.options().kv_policy;
  j["context"] = S;
  j["batch"] = 1;
  j["seconds"] = dt;
  j["prefill_chunk"] = e.options().runtime.prefill_chunk;
  if (a.Has("profile")) {
    double ops = 0;
    for (const auto& [op, ms] : rt.policy().stats().prefill_op_ms) {
      j["prefill_op_ms"][op] = ms;
      ops += ms;
    }
    j["compression_fraction"] = ops / 1e3 / dt;
  }
  std::cout << j.dump() << std::endl;
  rt.RemoveSequence(0);
  return Status::OK();
}

// Time to first token of a question about a document of S tokens (issue 17):
// a request of S document tokens + --question tokens, max_new_tokens 1,
// through Runtime::Generate. --cache off: cold (the whole prompt prefilled).
// --cache hbm: a first request with the same document and another question
// fills the prefix cache (its TTFT is reported as populate_ttft_ms), then the
// timed request attaches the document's KV state from device memory and
// prefills only its question. --cache disk: the same, with the prefix also
// stored on disk (--store-dir, emptied first, synced commits, O_DIRECT
// reads); before the timed request the device cache is cleared, as after a
// restart, so the document is read back from disk (restore_gb_per_s: stored
// bytes over the checked read's time).
Status RunTtft(const Args& a, Engine& e, const Common& cm, int64_t S) {
  const std::string cache = a.Get("cache", "off");
  PENUMBRA_ASSIGN_OR_RETURN(int64_t Q, a.GetIntIn("question", 64, 1, 1 << 20));
  Runtime& rt = e.runtime();
  const int V = e.config().vocab_size;
  auto tokens = [&](int64_t n, int64_t salt) {
    std::vector<int32_t> t(n);
    for (int64_t i = 0; i < n; ++i) t[i] = static_cast<int32_t>((i * 7919 + salt * 104729) % V);
    return t;
  };
  auto request = [&](int64_t salt) {
    GenerationRequest r;
    r.prompt = tokens(S, 0);
    const std::vector<int32_t> q = tokens(Q, salt);
    r.prompt.insert(r.prompt.end(), q.begin(), q.end());
    r.max_new_tokens = 1;
    if (cache != "off") r.segment_ends = {S};
    return r;
  };
  auto timed = [&](const GenerationRequest& r, int64_t* cached) -> Result<double> {
    PENUMBRA_RETURN_IF_ERROR(e.backend().Synchronize());
    const double t0 = NowSeconds();
    PENUMBRA_ASSIGN_OR_RETURN(auto res, rt.Generate({r}));
    PENUMBRA_RETURN_IF_ERROR(e.backend().Synchronize());
    *cached = res[0].cached_prompt_tokens;
    return (NowSeconds() - t0) * 1e3;
  };
  int64_t cached = 0;
  {  // warm-up: handles, kernels, allocator
    GenerationRequest w;
    w.prompt = tokens(std::min<int64_t>(S, 1024), 3);
    w.max_new_tokens = 1;
    PENUMBRA_RETURN_IF_ERROR(timed(w, &cached).status());
  }
  nlohmann::json j = cm.Line("ttft");
  j["kv_policy"] = e.options().kv_policy;
  j["context"] = S;
  j["question"] = Q;
  j["cache"] = cache;
  if (e.options().kv_policy == "shadowkv") j["continuation"] = e.options().shadowkv.continuation;
  if (cache == "disk") {
    j["store_read_threads"] = e.options().prefix_store.read_threads;
    j["lazy_reads"] = e.options().runtime.prefix_store_lazy_reads;
    j["lazy_threads"] = e.options().runtime.prefix_store_lazy_threads;
    j["lazy_block_bytes"] = e.options().runtime.prefix_store_lazy_block_bytes;
  }
  if (cache != "off") {
    PENUMBRA_ASSIGN_OR_RETURN(double populate, timed(request(1), &cached));
    j["populate_ttft_ms"] = populate;
    if (rt.prefix_cache()->entries() == 0) {
      return Status::FailedPrecondition("the " + e.options().kv_policy + " KV policy captured no prefix");
    }
    j["prefix_device_bytes"] = rt.prefix_cache()->bytes();
    j["prefix_host_bytes"] = rt.prefix_cache()->host_bytes();
  }
  if (cache == "disk") {
    // The populating request queued the prefix for the store; writing it
    // happens in the background (not in populate_ttft_ms).
    const double t0 = NowSeconds();
    rt.DrainPrefixStores();
    j["store_drain_ms"] = (NowSeconds() - t0) * 1e3;
    j["store_write_ms"] = rt.stats().prefix_store_write_seconds * 1e3;
    if (rt.stats().prefix_store_errors > 0 || rt.stats().prefix_stores != 1) {
      return Status::Internal("the prefix was not stored (see the log)");
    }
    rt.prefix_cache()->Clear();
  }
  const RunStats before = rt.stats();
  const double t_request = NowSeconds();
  PENUMBRA_ASSIGN_OR_RETURN(double ms, timed(request(2), &cached));
  j["ttft_ms"] = ms;
  if (cache == "disk" && e.options().runtime.prefix_store_lazy_reads) {
    // Values read lazily: what the question read before its first token,
    // then the whole document's restore (from the request's start).
    int64_t lazy_bytes = 0, demand_bytes = 0, device_bytes = 0;
    for (const auto& p : rt.prefix_cache()->Prefixes()) {
      const auto* skv = dynamic_cast<const ShadowKvPrefix*>(p.get());
      if (!skv || !skv->lazy_values()) continue;
      const storage::LazyBlob& lb = *skv->lazy_values();
      demand_bytes += lb.blocks_on_demand() * static_cast<int64_t>(lb.block_bytes());
      PENUMBRA_RETURN_IF_ERROR(skv->EnsureAllValues());
      lazy_bytes += static_cast<int64_t>(lb.size());
      device_bytes += static_cast<int64_t>(skv->device_bytes());
    }
    const double restore_s = NowSeconds() - t_request;
    j["lazy_demand_bytes"] = demand_bytes;
    j["lazy_value_bytes"] = lazy_bytes;
    j["restore_complete_ms"] = restore_s * 1e3;
    // Every byte of the stored document: its device state (read at the
    // import) and its values.
    j["restore_all_gb_per_s"] = static_cast<double>(device_bytes + lazy_bytes) / restore_s / 1e9;
  }
  if (cache == "disk") {
    const RunStats& after = rt.stats();
    const double read_s = after.prefix_store_read_seconds - before.prefix_store_read_seconds;
    const double bytes = static_cast<double>(after.prefix_store_read_bytes - before.prefix_store_read_bytes);
    j["store_read_ms"] = read_s * 1e3;
    j["import_ms"] = (after.prefix_import_seconds - before.prefix_import_seconds) * 1e3;
    j["store_read_bytes"] = bytes;
    j["restore_gb_per_s"] = read_s > 0 ? bytes / read_s / 1e9 : 0.0;
  }
  j["cached_prompt_tokens"] = cached;
  if (cache == "hbm" && e.options().runtime.tiers.gpu_capacity_bytes > 0 && e.backend().device() == Device::kCUDA) {
    // Tier 0: the question's reads made the document hot; once its values
    // are copied to the device, another question's TTFT.
    const double t0 = NowSeconds();
    for (int i = 0; i < 1024 && rt.stats().tiers.promotions == 0; ++i) rt.PlaceDocuments();
    PENUMBRA_RETURN_IF_ERROR(e.backend().Synchronize());
    j["tier0_promote_ms"] = (NowSeconds() - t0) * 1e3;
    j["tier0_promoted_bytes"] = rt.stats().tiers.promoted_bytes;
    if (rt.stats().tiers.promotions > 0) {
      PENUMBRA_ASSIGN_OR_RETURN(double t0_ms, timed(request(3), &cached));
      j["ttft_tier0_ms"] = t0_ms;
    }
  }
  std::cout << j.dump() << std::endl;
  return Status::OK();
}

// shared: --batch sequences over ONE copy of a document (the issue 17
// shared-document decode). The document (--context tokens, real prefill of
// synthetic ids) is prefilled once and captured; each sequence attaches it
// (SequenceSpec::prefix) and prefills its own --question tokens; then
// --steps decode steps of the whole batch are timed after 2 warm-up steps
// (with tier 0, after the steps that copy the document's values to the
// device), greedy sampling included. Reports device bytes per attached
// sequence and the prefix's device and host bytes.
Status RunShared(const Args& a, Engine& e, const Common& cm, int64_t S) {
  Runtime& rt = e.runtime();
  Backend& b = e.backend();
  KvPolicy& policy = rt.policy();
  const int V = e.config().vocab_size;
  PENUMBRA_ASSIGN_OR_RETURN(int64_t B, a.GetIntIn("batch", 64, 1, 4096));
  PENUMBRA_ASSIGN_OR_RETURN(int64_t steps, a.GetIntIn("steps", 20, 1, 100000));
  PENUMBRA_ASSIGN_OR_RETURN(int64_t Q, a.GetIntIn("question", 64, 1, 1 << 20));
  auto tokens = [&](int64_t n, int64_t salt) {
    std::vector<int32_t> t(n);
    for (int64_t i = 0; i < n; ++i) t[i] = static_cast<int32_t>((i * 7919 + salt * 104729) % V);
    return t;
  };
  const std::vector<int32_t> doc = tokens(S, 0);
  // With tier 0 the document is copied to the device one layer per step
  // while the batch decodes: those steps come before the timed ones.
  const bool tier0 = rt.prefix_cache() != nullptr && e.options().runtime.tiers.gpu_capacity_bytes > 0 &&
                     b.device() == Device::kCUDA;
  constexpr int64_t kMaxTier0Steps = 256;
  const bool profile = a.Has("profile");
  const int64_t new_tokens = steps + 4 + (tier0 ? kMaxTier0Steps : 0) + (profile ? kProfileSteps : 0);
  double t0 = NowSeconds();
  SequenceSpec spec;
  spec.prompt_len = S + Q;
  spec.max_new_tokens = new_tokens;
  spec.first_prefill = S;
  const int64_t doc_seq = 1 << 30;
  PENUMBRA_RETURN_IF_ERROR(policy.AddSequence(doc_seq, spec));
  Status st = rt.Prefill(doc_seq, doc, nullptr, 0, S);
  Result<std::shared_ptr<const KvPrefix>> prefix = st.ok() ? policy.CapturePrefix(doc_seq, S)
                                                           : Result<std::shared_ptr<const KvPrefix>>(st);
  rt.RemoveSequence(doc_seq);
  PENUMBRA_RETURN_IF_ERROR(prefix.status());
  PENUMBRA_RETURN_IF_ERROR(b.Synchronize());
  const double document_s = NowSeconds() - t0;
  // In the runtime's document cache (where tier 0 finds it), as a put would leave it.
  if (rt.prefix_cache() != nullptr && !rt.prefix_cache()->Insert(PrefixKeys("bench-shared", doc, {S})[0], *prefix)) {
    return Status::ResourceExhausted("the document does not fit in the prefix cache");
  }
  t0 = NowSeconds();
  std::vector<int64_t> seqs;
  auto remove_all = [&] {
    for (int64_t q : seqs) rt.RemoveSequence(q);
  };
  spec.prefix = *prefix;
  for (int64_t i = 0; i < B; ++i) {
    std::vector<int32_t> prompt = doc;
    const std::vector<int32_t> q = tokens(Q, i + 1);
    prompt.insert(prompt.end(), q.begin(), q.end());
    Status added = policy.AddSequence(i, spec);
    if (added.ok()) {
      seqs.push_back(i);
      added = rt.Prefill(i, prompt, nullptr, S);
    }
    if (!added.ok()) {
      remove_all();
      return added;
    }
  }
  PENUMBRA_RETURN_IF_ERROR(b.Synchronize());
  const double questions_s = NowSeconds() - t0;
  std::vector<int32_t> next(B, 1);
  std::vector<int64_t> positions(B, S + Q);
  const std::vector<SampleParams> greedy(B);
  auto step = [&]() -> Status {
    auto logits = rt.DecodeStep(seqs, next, positions);
    if (!logits.ok()) {
      remove_all();
      return logits.status();
    }
    PENUMBRA_RETURN_IF_ERROR(b.Sample(*logits, static_cast<int>(B), V, greedy, next.data()));
    for (int64_t& p : positions) ++p;
    return Status::OK();
  };
  // Warm-up: 2 steps, and with tier 0 until the document's copy is complete.
  int64_t warmup = 0;
  const double warm_t0 = NowSeconds();
  while (warmup < 2 || (tier0 && rt.stats().tiers.promotions == 0 && warmup < kMaxTier0Steps)) {
    PENUMBRA_RETURN_IF_ERROR(step());
    ++warmup;
  }
  PENUMBRA_RETURN_IF_ERROR(b.Synchronize());
  const double warmup_s = NowSeconds() - warm_t0;
  const PolicyStats before = policy.stats();
  const double timed = NowSeconds();
  for (int64_t i = 0; i < steps; ++i) PENUMBRA_RETURN_IF_ERROR(step());
  PENUMBRA_RETURN_IF_ERROR(b.Synchronize());
  const double dt = (NowSeconds() - timed) / static_cast<double>(steps);
  const PolicyStats after = policy.stats();
  std::map<std::string, double> profile_ms;
  if (profile) PENUMBRA_RETURN_IF_ERROR(ProfileSteps(b, rt, step, &profile_ms));
  nlohmann::json j = cm.Line("decode");
  j["shared_document"] = true;
  if (profile) AddProfile(profile_ms, j);
  j["kv_policy"] = e.options().kv_policy;
  j["context"] = S;
  j["batch"] = B;
  j["question"] = Q;
  j["steps"] = steps;
  j["tokens_per_s"] = static_cast<double>(B) / dt;
  j["ms_per_step"] = dt * 1e3;
  j["document_prefill_s"] = document_s;
  j["questions_prefill_s"] = questions_s;
  j["prefix_device_bytes"] = (*prefix)->device_bytes();
  j["prefix_host_bytes"] = (*prefix)->host_bytes();
  j["device_bytes_per_sequence"] = policy.DeviceBytes(seqs[0]);
  const int64_t sel = after.selected_chunks - before.selected_chunks;
  if (sel > 0) j["hit_rate"] = static_cast<double>(after.hit_chunks - before.hit_chunks) / static_cast<double>(sel);
  const TierStats t = rt.stats().tiers;
  j["tier0"] = tier0;
  j["warmup_steps"] = warmup;
  j["warmup_s"] = warmup_s;
  if (tier0) {
    j["tier0_promotions"] = t.promotions;
    j["tier0_promoted_bytes"] = t.promoted_bytes;
    j["tier0_size_bytes"] = t.size_bytes;
  }
  remove_all();
  std::cout << j.dump() << std::endl;
  return Status::OK();
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
  a.Flag("context", "context lengths, comma-separated").Flag("batch", "sequences (default: largest that fits)")
      .Flag("steps", "timed decode steps (default 100)").Flag("kv-policy", "full or shadowkv")
      .Flag("force-hit-rate", "shadowkv: keep this fraction of the previous step's chunks")
      .Flag("hit-rates", "shadowkv: measure each of these forced hit rates on the same sequences, comma-separated, "
                         "'natural' for none (e.g. natural,0.6)")
      .Flag("batch-sweep", "decode: build the batch once, then time the first b sequences for each b, comma-separated")
      .Flag("device", "cuda (default) or cpu").Flag("dtype", "bf16 (default) or f32")
      .Flag("cuda-device", "CUDA device ordinal (default 0)")
      .Flag("linear",
            "CUDA linear layers: auto (skinny kernel for batches <= 8, SwiGLU fused; default), "
            "skinny (unfused) or cublas")
      .Flag("chained-launch", "CUDA: decode kernels launched chained, on (default) or off")
      .Flag("prefill-chunk", "tokens per prefill chunk").Flag("max-batch", "runtime max batch")
      .Flag("fetch-turns", "shadowkv with --lanes > 1: lanes take turns on the host link, on or off (default on)")
      .Flag("lanes", "decode: independent pipelines (lanes) sharing the weights, one host thread each (default 1)")
      .Flag("cache", "ttft: off (cold prefill, default), hbm (the document's KV state attached from the prefix "
                     "cache in device memory) or disk (read back from the prefix store, as after a restart)")
      .Flag("store-dir", "ttft --cache disk: the prefix store's directory, emptied first "
                         "(default /tmp/penumbra-ttft-store)")
      .Flag("question", "ttft, shared: question tokens after the document (default 64)")
      .Flag("tier0", "shared, ttft: on (default): a hot document's values are copied to spare device memory "
                     "(configs/storage.yaml gpu:); off: they stay in host memory")
      .Flag("store-read-threads", "ttft --cache disk: blocks read at once when a stored prefix is read (default 32)")
      .Flag("lazy-threads", "ttft --cache disk: reads in flight for lazily read values (default 64)")
      .Flag("lazy-reads", "ttft --cache disk: on (default): values read lazily; off: read whole before the first token")
      .Flag("layers", "").Flag("hidden", "").Flag("ffn", "").Flag("heads", "").Flag("kv-heads", "")
      .Flag("head-dim", "").Flag("vocab", "")
      .Flag("kernel-trace", "decode, CUDA: write every kernel and copy of the run's first measurement's timed steps "
                            "to this file, one JSON line each (ops/trace_summary.py summarizes it)")
      .Switch("fetch-timeline", "decode, shadowkv: time every value fetch of the timed steps on the device and "
                                "report how long per step the PCIe link was busy (fetch_timeline)")
      .Switch("profile", "prefill: time each ShadowKV compression op; decode: time every op of 5 extra steps "
                         "(synchronizes after each)");
  AddShadowKvFlags(a);
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
  const double copy = mode == "decode" && engine->backend().device() == Device::kCUDA ? MeasureCopyGBps(engine->backend()) : 0;
  bool trace_pending = a.Has("kernel-trace");
  for (int64_t S : contexts) {
    Status r = mode == "decode"   ? RunDecode(a, *engine, cm, S, copy, &trace_pending)
               : mode == "ttft"   ? RunTtft(a, *engine, cm, S)
               : mode == "shared" ? RunShared(a, *engine, cm, S)
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
}  // namespace penumbra

int main(int argc, char** argv) {
  penumbra::InitLogging(argv[0]);
  penumbra::Status s = penumbra::Main(argc, argv);
  if (!s.ok()) {
    std::cerr << "penumbra-bench: " << s.ToString() << std::endl;
    return 2;
  }
  return 0;
}
