// penumbra-bench decode: the batch's decode steps timed, over lanes, batch
// sizes and forced hit rates.
#include "worker/bench/bench.h"

#include <algorithm>
#include <atomic>
#include <barrier>
#include <cstdlib>
#include <iostream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "kernels/value_format.h"
#include "worker/bench/kernel_trace.h"
#include "worker/engine/op_profiler.h"

namespace penumbra::bench {

namespace {

// One lane's share of a decode measurement.
struct LaneRun {
  std::vector<int64_t> seqs;
  Status status;
  double end = 0;                            // when the lane finished its timed steps (NowSeconds())
  std::map<std::string, double> profile_ms;  // --profile: per-op ms over kProfileSteps steps
};

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

}  // namespace

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
  // Policies whose selected rows are held in slots (hit rates; a forced one
  // with --force-hit-rate): ShadowKV's and SpeContext's.
  const bool slots = shadowkv || e.options().kv_policy == "specontext";
  PENUMBRA_ASSIGN_OR_RETURN(const std::vector<double> rates, HitRates(a, e.options().shadowkv.force_hit_rate));
  if (a.Has("hit-rates") && !slots) {
    return Status::InvalidArgument("--hit-rates needs --kv-policy shadowkv or specontext");
  }
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
  const auto reserve = static_cast<int64_t>(kDeviceMemoryKeptFree);
  // The engine's own estimate of the batch (what a worker's stats report),
  // beside the batch found by filling the device.
  const BatchCapacity capacity = e.runtime(0).Capacity(S, new_tokens, 0);
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
  PENUMBRA_ASSIGN_OR_RETURN(const std::string trace_path, KernelTracePath(a, b0));
  if (!trace_path.empty() && profile) return Status::InvalidArgument("--kernel-trace and --profile do not mix");
  // Times the first `nb` sequences at forced hit rate `rate` (< 0: natural).
  auto measure = [&](int nb, double rate) -> Status {
    std::vector<std::vector<int64_t>> active(N);
    for (int l = 0; l < N; ++l) {
      for (int64_t s : runs[l].seqs)
        if (s < nb) active[l].push_back(s);
      if (slots) PENUMBRA_RETURN_IF_ERROR(e.runtime(l).policy().SetForcedHitRate(rate));
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
        if (t.ok())
          trace = std::move(*t);
        else
          trace_status = t.status();
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
    nlohmann::json trace_fields = nlohmann::json::object();
    if (trace) PENUMBRA_RETURN_IF_ERROR(FinishKernelTrace(*trace, trace_path, trace_fields));
    double end = 0;
    for (const LaneRun& r : runs) end = std::max(end, r.end);
    const double dt = (end - t0) / steps;
    nlohmann::json j = cm.Line("decode");
    AddPolicy(e.options(), j);
    j["context"] = S;
    j["batch"] = nb;
    j["capacity_sequences"] = capacity.sequences();
    j["capacity_limit"] = capacity.limit;
    j["sequence_device_bytes"] = capacity.per_sequence.device;
    j["sequence_host_bytes"] = capacity.per_sequence.host;
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
    if (!slots) {
      // Bytes a step must read: all weights once per lane with sequences (each
      // lane's GEMMs stream them) + every sequence's K and V.
      int busy_lanes = 0;
      for (const auto& s : active) busy_lanes += s.empty() ? 0 : 1;
      const double kv =
          2.0 * c.num_layers * c.num_kv_heads * c.head_dim * DTypeSize(b0.act_dtype()) * (S + 2.0 + steps / 2.0) * nb;
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
        const double row = static_cast<double>(
            kernels::ValueRowBytes(o.value_fp8(), o.chunk_size, c.head_dim, DTypeSize(b0.act_dtype())));
        const double bytes = static_cast<double>(sel - hit) * row;
        nlohmann::json t;
        t["fetches_per_step"] = static_cast<double>(all.size()) / steps;
        t["busy_ms_per_step"] = busy_ms / steps;        // some fetch running (any lane)
        t["kernel_ms_per_step"] = kernel_ms / steps;    // summed over fetches (overlapping ones counted twice)
        t["concurrent_ms_per_step"] = dual_ms / steps;  // two or more fetches (lanes) running at once
        t["bytes_per_step"] = bytes / steps;
        t["gbps_while_busy"] = busy_ms > 0 ? bytes / (busy_ms * 1e-3) / 1e9 : 0.0;
        j["fetch_timeline"] = t;
      }
      j["force_hit_rate"] = rate;
    }
    if (shadowkv) {
      j["value_fetch"] = e.options().shadowkv.value_fetch;
      j["micro_batches"] = e.options().shadowkv.micro_batches;
      j["fetch_blocks"] = e.options().shadowkv.fetch_blocks;
      j["successor_chunks"] = e.options().shadowkv.successor_chunks;
      if (N > 1) j["fetch_turns"] = e.options().shadowkv.fetch_turns;
    }
    j["linear"] = e.options().backend.linear;
    j["chained_launch"] = e.options().backend.chained_launch;
    j["hbm_copy_gbps"] = copy_gbps;
    j.update(trace_fields);  // this measurement's steps ran traced: slower than untraced
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

}  // namespace penumbra::bench
