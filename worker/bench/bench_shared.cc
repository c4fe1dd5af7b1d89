// penumbra-bench shared: many sequences decoding over one shared document.
#include "worker/bench/bench.h"

#include <iostream>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace penumbra::bench {

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
  const bool tier0 =
      rt.prefix_cache() != nullptr && e.options().runtime.tiers.gpu_capacity_bytes > 0 && b.device() == Device::kCUDA;
  constexpr int64_t kMaxTier0Steps = 256;
  const bool profile = a.Has("profile");
  // --kernel-trace PATH: the timed steps' kernels and copies.
  PENUMBRA_ASSIGN_OR_RETURN(const std::string trace_path, KernelTracePath(a, b));
  if (!trace_path.empty() && profile) return Status::InvalidArgument("--kernel-trace and --profile do not mix");
  const int64_t new_tokens = steps + 4 + (tier0 ? kMaxTier0Steps : 0) + (profile ? kProfileSteps : 0);
  double t0 = NowSeconds();
  SequenceSpec spec;
  spec.prompt_len = S + Q;
  spec.max_new_tokens = new_tokens;
  spec.first_prefill = S;
  const int64_t doc_seq = 1 << 30;
  PENUMBRA_RETURN_IF_ERROR(policy.AddSequence(doc_seq, spec));
  Status st = rt.Prefill(doc_seq, doc, nullptr, 0, S);
  Result<std::shared_ptr<const KvPrefix>> prefix =
      st.ok() ? policy.CapturePrefix(doc_seq, S) : Result<std::shared_ptr<const KvPrefix>>(st);
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
  std::unique_ptr<KernelTrace> trace;
  if (!trace_path.empty()) {
    PENUMBRA_ASSIGN_OR_RETURN(trace, KernelTrace::Start());  // the device is idle here
  }
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
  if (trace) PENUMBRA_RETURN_IF_ERROR(FinishKernelTrace(*trace, trace_path, j));  // the timed steps ran traced
  AddPolicy(e.options(), j);
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
  j["workspace_device_bytes"] = b.WorkspaceBytes();  // the kernels' workspaces after the timed steps
  const int64_t sel = after.selected_chunks - before.selected_chunks;
  if (sel > 0) j["hit_rate"] = static_cast<double>(after.hit_chunks - before.hit_chunks) / static_cast<double>(sel);
  // The share of the sequences' scores taken together with the document's
  // other questions (ShadowKV's one-prefix scores).
  const int64_t scored = after.scored_sequences - before.scored_sequences;
  if (scored > 0) {
    j["one_prefix_fraction"] =
        static_cast<double>(after.one_prefix_sequences - before.one_prefix_sequences) / static_cast<double>(scored);
  }
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

}  // namespace penumbra::bench
