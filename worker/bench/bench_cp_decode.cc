// penumbra-bench cp-decode: one sequence decoding across a context-parallel
// group's ranks.
#include "worker/bench/bench.h"
#include "worker/bench/kernel_trace.h"

#include <iostream>
#include <string>
#include <vector>

namespace penumbra::bench {

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
  // --kernel-trace PATH: this rank's timed steps as a device timeline
  // (ops/trace_summary.py; a traced run is slower than an untraced one).
  PENUMBRA_ASSIGN_OR_RETURN(const std::string trace_path, KernelTracePath(a, b));
  std::unique_ptr<KernelTrace> trace;
  nlohmann::json trace_fields = nlohmann::json::object();
  auto run = [&]() -> Result<double> {
    PENUMBRA_RETURN_IF_ERROR(step());
    PENUMBRA_RETURN_IF_ERROR(step());
    PENUMBRA_RETURN_IF_ERROR(b.Synchronize());
    if (group) PENUMBRA_RETURN_IF_ERROR(group->Barrier());
    if (!trace_path.empty()) {
      PENUMBRA_ASSIGN_OR_RETURN(trace, KernelTrace::Start());
    }
    const double t0 = NowSeconds();
    for (int64_t i = 0; i < steps; ++i) PENUMBRA_RETURN_IF_ERROR(step());
    PENUMBRA_RETURN_IF_ERROR(b.Synchronize());
    if (group) PENUMBRA_RETURN_IF_ERROR(group->Barrier());
    const double dt = NowSeconds() - t0;
    if (trace) PENUMBRA_RETURN_IF_ERROR(FinishKernelTrace(*trace, trace_path, trace_fields));
    return dt;
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
  AddPolicy(e.options(), j);
  j["kv_device_bytes_rank0"] = dev;
  j.update(trace_fields);  // these steps ran traced: slower than untraced
  if (e.options().kv_policy == "shadowkv") {
    j["budget_tokens"] = e.options().shadowkv.budget_tokens;
    j["shard_selection"] = e.options().shadowkv.shard_selection;
    // Under the global selection a shard's live slots vary: no hit rate.
    if (world == 1 || e.options().shadowkv.shard_selection == "local") j["hit_rate_rank0"] = ps.hit_rate();
  }
  std::cout << j.dump() << std::endl;
  return Status::OK();
}

}  // namespace penumbra::bench
