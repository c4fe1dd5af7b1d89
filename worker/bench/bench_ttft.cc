// penumbra-bench ttft: time to first token of a question about a document,
// cold or with the document attached from the prefix cache or the store.
#include "worker/bench/bench.h"

#include <algorithm>
#include <iostream>
#include <string>
#include <vector>

#include "worker/engine/shadowkv_prefix.h"

namespace penumbra::bench {

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
    if (cache != "off") r.document_ends = {S};
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
  // --kernel-trace PATH: the timed question's kernels and copies.
  PENUMBRA_ASSIGN_OR_RETURN(const std::string trace_path, KernelTracePath(a, e.backend()));
  int64_t cached = 0;
  {  // warm-up: handles, kernels, allocator
    GenerationRequest w;
    w.prompt = tokens(std::min<int64_t>(S, 1024), 3);
    w.max_new_tokens = 1;
    PENUMBRA_RETURN_IF_ERROR(timed(w, &cached).status());
  }
  nlohmann::json j = cm.Line("ttft");
  AddPolicy(e.options(), j);
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
  const PolicyStats policy_before = rt.policy().stats();
  std::unique_ptr<KernelTrace> trace;
  if (!trace_path.empty()) {
    PENUMBRA_RETURN_IF_ERROR(e.backend().Synchronize());
    PENUMBRA_ASSIGN_OR_RETURN(trace, KernelTrace::Start());
  }
  const double t_request = NowSeconds();
  PENUMBRA_ASSIGN_OR_RETURN(double ms, timed(request(2), &cached));
  j["ttft_ms"] = ms;
  {  // how the question attended to the document (continuation auto picks)
    const PolicyStats ps = rt.policy().stats();
    if (ps.sparse_continuations > policy_before.sparse_continuations) j["continuation_used"] = "sparse";
    if (ps.dense_continuations > policy_before.dense_continuations) j["continuation_used"] = "dense";
  }
  if (trace) PENUMBRA_RETURN_IF_ERROR(FinishKernelTrace(*trace, trace_path, j));  // the question ran traced
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

}  // namespace penumbra::bench
