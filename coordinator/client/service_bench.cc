// penumbra-service-bench: measures the service through its public API (a
// running coordinator), as a client sees it. Token ids only (works with a
// coordinator that has no tokenizer, e.g. a random-weights benchmark model).
//
//   penumbra-service-bench --address HOST:PORT --context S [--question Q] [--batch B]
//       [--max-new-tokens M] [--window-s W] [--vocab V] [--tls-ca CA] [--api-key-file F]
//
// 1. Puts one document of S - Q random token ids (timed: prefill into the
//    document cache) and asks one Q-token question about it: time to first
//    token as the client sees it (Generate to the first token polled) and as
//    the worker reports it. One JSON line {"bench": "service-ttft", ...}.
// 2. B questions about that document at once (each sequence S tokens long,
//    max_new_tokens M, greedy, end-of-text ignored), each followed by its own
//    long-polling client; once all of them decode, the tokens all of them
//    make in W seconds: {"bench": "service-decode", "context": S, "batch": B,
//    "kv_policy": ..., "tokens_per_s": ...} ("service-cp-decode" with "gpus": N
//    when the coordinator's only workers are one context group's N ranks).
// 3. With --put-during-decode: while they decode, a second document of the
//    same size is put (its prefill interleaved with their decode steps): the
//    longest gap any of them saw between two tokens, and their tokens/s
//    meanwhile: {"bench": "service-decode-during-put", ...}. Then they are
//    cancelled.
//
// With --job-documents N (instead of the above): N documents of S - Q
// tokens are put, then --job-questions K questions of Q tokens about each
// (N x K, max_new_tokens M, greedy) are asked one at a time through the
// blocking generate call, then all of them again as one batch job (the
// coordinator needs --data-dir); wall time and generated tokens/s of both,
// and how many of the job's answers equal the one-at-a-time ones:
// {"bench": "service-job", ...}.
//
// With --dp-documents N: data-parallel scaling over N workers (DpBench).
//
// With --mixed-hot H: the mixed-documents workload (MixedBench): H hot
// documents asked --mixed-questions K times each and --mixed-cold C documents
// asked once, all of S - Q tokens, arriving over time; generated tokens/s
// over the whole run and the questions' time to first token (p50, p99):
// {"bench": "mixed-documents", "policy": the workers' KV policy, ...}.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <map>
#include <mutex>
#include <set>
#include <thread>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/args.h"
#include "common/logging.h"
#include "coordinator/client/client.h"

namespace penumbra {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

double Since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

std::vector<int32_t> Tokens(int64_t n, int64_t salt, int32_t vocab) {
  std::vector<int32_t> t(n);
  for (int64_t i = 0; i < n; ++i) t[i] = static_cast<int32_t>(3 + (i * 7919 + salt * 104729) % (vocab - 3));
  return t;
}

// Requests each followed by its own long-polling client: the tokens each
// has made, and the longest wait between two of its token arrivals since the
// last ResetGaps.
class Followers {
 public:
  Followers(const client::ClientOptions& o, client::Client& c) : o_(o), c_(c) {}
  ~Followers() { Stop(); }
  // Starts `r` and its client.
  Status Add(const rpc::GenerateRequest& r) {
    auto f = std::make_unique<F>();
    PENUMBRA_ASSIGN_OR_RETURN(f->id, c_.Generate(r));
    F* fp = f.get();
    fs_.push_back(std::move(f));
    threads_.emplace_back([this, fp] { Follow(*fp); });
    return Status::OK();
  }
  // Until every request has made two tokens; an error when one ended first.
  Status WaitAllDecoding() {
    const Clock::time_point start = Clock::now();
    for (;;) {
      bool all = true;
      for (auto& f : fs_) {
        all = all && f->tokens >= 2;
        if (f->done && f->tokens < 2) return f->error.ok() ? Status::Internal("a question ended early") : f->error;
      }
      if (all) return Status::OK();
      if (Since(start) > 3600) return Status::DeadlineExceeded("the questions did not all decode within an hour");
      std::this_thread::sleep_for(milliseconds(5));
    }
  }
  int64_t total() const {
    int64_t n = 0;
    for (auto& f : fs_) n += f->tokens;
    return n;
  }
  bool any_done() const {
    for (auto& f : fs_) {
      if (f->done) return true;
    }
    return false;
  }
  int64_t max_gap_ns() const {
    int64_t g = 0;
    for (auto& f : fs_) g = std::max<int64_t>(g, f->max_gap_ns);
    return g;
  }
  void ResetGaps() {
    for (auto& f : fs_) f->max_gap_ns = 0;
  }
  // Tokens made in `seconds` (after `settle`), and the seconds measured.
  std::pair<int64_t, double> Window(double settle, double seconds) const {
    std::this_thread::sleep_for(std::chrono::duration<double>(settle));
    const int64_t n1 = total();
    const Clock::time_point t1 = Clock::now();
    std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
    return {total() - n1, Since(t1)};
  }
  // Cancels every request and joins the clients.
  void Stop() {
    stop_ = true;
    for (auto& f : fs_) (void)c_.Cancel(f->id);
    for (auto& t : threads_) t.join();
    threads_.clear();
  }

 private:
  struct F {
    std::string id;
    std::atomic<int64_t> tokens{0};
    std::atomic<bool> done{false};
    Status error;
    std::atomic<int64_t> max_gap_ns{0};
  };
  void Follow(F& f) {
    auto own = client::Client::Connect(o_);
    if (!own.ok()) {
      f.error = own.status();
      f.done = true;
      return;
    }
    int64_t off = 0;
    Clock::time_point last = Clock::now();
    while (!stop_) {
      Result<rpc::GenerateChunk> p = (*own)->Poll(f.id, off, 1000);
      if (!p.ok()) {
        f.error = p.status();
        break;
      }
      if (!p->ids.empty()) {
        const Clock::time_point now = Clock::now();
        const int64_t gap = std::chrono::duration_cast<std::chrono::nanoseconds>(now - last).count();
        if (off > 0 && gap > f.max_gap_ns) f.max_gap_ns = gap;
        last = now;
      }
      off += static_cast<int64_t>(p->ids.size());
      f.tokens = off;
      if (p->done) break;
    }
    f.done = true;
  }

  const client::ClientOptions& o_;
  client::Client& c_;
  std::vector<std::unique_ptr<F>> fs_;
  std::vector<std::thread> threads_;
  std::atomic<bool> stop_{false};
};

Status DpBench(const client::ClientOptions& o, client::Client& c, int64_t N, int64_t B, int64_t S, int64_t Q, int64_t M,
               int64_t V, double W, double settle, int64_t put_s, const std::string& policy,
               const std::string& backend);

// The mixed-documents workload's shape (--mixed-*).
struct MixedShape {
  int64_t hot = 4, questions = 16, cold = 10;
  double doc_interval_s = 5, question_interval_s = 2;
};
Status MixedBench(const client::ClientOptions& o, const MixedShape& m, int64_t S, int64_t Q, int64_t M, int64_t V,
                  int64_t put_s, const std::string& policy, const std::string& backend);

// N documents x K questions: one at a time through Complete, then as one job.
Status JobBench(client::Client& c, int64_t N, int64_t K, int64_t S, int64_t Q, int64_t M, int64_t V, int64_t put_s,
                const std::string& policy, const std::string& backend) {
  std::vector<std::string> docs;
  Clock::time_point t0 = Clock::now();
  for (int64_t d = 0; d < N; ++d) {
    const std::vector<int32_t> doc = Tokens(S - Q, 1000 + d, static_cast<int32_t>(V));
    PENUMBRA_ASSIGN_OR_RETURN(rpc::DocumentInfo info, c.PutDocument("job-doc-" + std::to_string(d), nullptr, &doc, true,
                                                                    std::chrono::seconds(put_s)));
    if (info.state != rpc::DocumentState::READY) return Status::Internal("document " + std::to_string(d) + " failed");
    docs.push_back(info.id);
  }
  const double put_seconds = Since(t0);
  rpc::SubmitJobRequest job;
  for (int64_t d = 0; d < N; ++d) {
    for (int64_t k = 0; k < K; ++k) {
      rpc::JobItem it;
      char name[64];
      std::snprintf(name, sizeof name, "d%03lld-q%03lld", static_cast<long long>(d), static_cast<long long>(k));
      it.custom_id = name;
      it.request.document_ids = {docs[static_cast<size_t>(d)]};
      it.request.__set_token_ids(Tokens(Q, 50000 + d * K + k, static_cast<int32_t>(V)));
      it.request.max_new_tokens = static_cast<int32_t>(M);
      it.request.ignore_eos = true;
      job.items.push_back(it);
    }
  }
  // One at a time.
  std::map<std::string, std::vector<int32_t>> alone;
  int64_t alone_tokens = 0;
  t0 = Clock::now();
  for (const rpc::JobItem& it : job.items) {
    PENUMBRA_ASSIGN_OR_RETURN(rpc::GenerateChunk ch, c.Complete(it.request));
    alone[it.custom_id] = ch.ids;
    alone_tokens += ch.usage.generated_tokens;
  }
  const double alone_s = Since(t0);
  // As one job.
  t0 = Clock::now();
  PENUMBRA_ASSIGN_OR_RETURN(rpc::JobInfo info, c.SubmitJob(job));
  while (info.status == rpc::JobStatus::IN_PROGRESS) {
    std::this_thread::sleep_for(milliseconds(20));
    PENUMBRA_ASSIGN_OR_RETURN(info, c.GetJob(info.id));
  }
  const double job_s = Since(t0);
  PENUMBRA_ASSIGN_OR_RETURN(std::vector<rpc::JobItemResult> results, c.JobResults(info.id));
  int64_t job_tokens = 0, equal = 0, failed = 0;
  for (const rpc::JobItemResult& r : results) {
    job_tokens += r.usage.generated_tokens;
    failed += r.ok ? 0 : 1;
    equal += r.ok && r.ids == alone[r.custom_id] ? 1 : 0;
  }
  (void)c.DeleteJob(info.id);
  for (const std::string& d : docs) (void)c.DeleteDocument(d);
  nlohmann::json j = {{"bench", "service-job"},
                      {"documents", N},
                      {"questions_per_document", K},
                      {"context", S},
                      {"question", Q},
                      {"max_new_tokens", M},
                      {"kv_policy", policy},
                      {"backend", backend},
                      {"put_s", put_seconds},
                      {"one_at_a_time_wall_s", alone_s},
                      {"one_at_a_time_tokens_per_s", static_cast<double>(alone_tokens) / alone_s},
                      {"job_wall_s", job_s},
                      {"job_tokens_per_s", static_cast<double>(job_tokens) / job_s},
                      {"job_status", static_cast<int>(info.status)},
                      {"items", static_cast<int64_t>(results.size())},
                      {"failed_items", failed},
                      {"answers_equal", equal}};
  std::cout << j.dump() << std::endl;
  if (info.status != rpc::JobStatus::COMPLETED || failed > 0) {
    return Status::Internal("the job did not complete cleanly (" + std::to_string(failed) + " items failed)");
  }
  return Status::OK();
}

Status Run(int argc, char** argv) {
  Args a;
  client::AddConnectionFlags(a);
  a.Flag("context", "tokens per sequence: document + question (default 124928)")
      .Flag("question", "question tokens (default 64)")
      .Flag("batch", "questions decoded together (default 14)")
      .Flag("max-new-tokens", "per question (default 4096; they are cancelled after the window)")
      .Flag("window-s", "decode measurement window in seconds (default 20)")
      .Flag("settle-s", "wait this long after all questions decode before the window (default 1)")
      .Flag("vocab", "token ids are drawn from [3, vocab) (default: the model's, from /health's workers: 32000)")
      .Flag("put-timeout-s", "how long the document's put may take (default 1800)")
      .Switch("put-during-decode", "3: put a second document while the questions decode; the longest token gap")
      .Flag("job-documents", "instead: a batch job over this many documents (see the top of the source)")
      .Flag("job-questions", "with --job-documents: questions per document (default 16)")
      .Flag("dp-documents",
            "instead: data-parallel scaling over this many documents, one per worker (see "
            "DpBench)")
      .Flag("mixed-hot", "instead: the mixed-documents workload with this many hot documents (see MixedBench)")
      .Flag("mixed-questions", "with --mixed-hot: questions per hot document (default 16)")
      .Flag("mixed-cold", "with --mixed-hot: documents asked once (default 10)")
      .Flag("mixed-doc-interval-s", "with --mixed-hot: seconds between documents' arrivals (default 5)")
      .Flag("mixed-question-interval-s",
            "with --mixed-hot: seconds between a hot document's questions, from its put (default 2)");
  PENUMBRA_RETURN_IF_ERROR(a.Parse(argc, argv, 1));
  PENUMBRA_ASSIGN_OR_RETURN(client::ClientOptions o, client::OptionsFromFlags(a));
  PENUMBRA_ASSIGN_OR_RETURN(int64_t S, a.GetIntIn("context", 124928, 2, int64_t{1} << 24));
  PENUMBRA_ASSIGN_OR_RETURN(int64_t Q, a.GetIntIn("question", 64, 1, S - 1));
  PENUMBRA_ASSIGN_OR_RETURN(int64_t B, a.GetIntIn("batch", 14, 1, 4096));
  PENUMBRA_ASSIGN_OR_RETURN(int64_t M, a.GetIntIn("max-new-tokens", 4096, 1, 1 << 20));
  PENUMBRA_ASSIGN_OR_RETURN(double W, a.GetDoubleIn("window-s", 20, 0.01, 3600));
  PENUMBRA_ASSIGN_OR_RETURN(double settle, a.GetDoubleIn("settle-s", 1, 0, 3600));
  PENUMBRA_ASSIGN_OR_RETURN(int64_t V, a.GetIntIn("vocab", 32000, 4, INT32_MAX));
  PENUMBRA_ASSIGN_OR_RETURN(int64_t put_s, a.GetIntIn("put-timeout-s", 1800, 1, 86400));
  PENUMBRA_ASSIGN_OR_RETURN(auto c, client::Client::Connect(o));
  // The workers' policy and backend label the results: Stats shows them to
  // an admin tenant (or without authentication); public Health does not.
  PENUMBRA_ASSIGN_OR_RETURN(rpc::StatsResponse st, c->Stats());
  const std::string policy = st.workers.empty() ? "unknown" : st.workers[0].kv_policy;
  const std::string backend = st.workers.empty() ? "unknown" : st.workers[0].backend;
  // A deployment whose only workers are one context group's ranks: its
  // decode row is "service-cp-decode" with the group's GPUs.
  int64_t group_ranks = 0;
  for (const rpc::WorkerStatus& w : st.workers) {
    if (w.__isset.group && w.group == st.workers[0].group) ++group_ranks;
  }
  if (group_ranks != static_cast<int64_t>(st.workers.size())) group_ranks = 0;

  if (a.Has("dp-documents")) {
    PENUMBRA_ASSIGN_OR_RETURN(int64_t N, a.GetIntIn("dp-documents", 2, 1, 64));
    return DpBench(o, *c, N, B, S, Q, M, V, W, settle, put_s, policy, backend);
  }
  if (a.Has("mixed-hot")) {
    MixedShape m;
    PENUMBRA_ASSIGN_OR_RETURN(m.hot, a.GetIntIn("mixed-hot", 4, 0, 1024));
    PENUMBRA_ASSIGN_OR_RETURN(m.questions, a.GetIntIn("mixed-questions", 16, 1, 4096));
    PENUMBRA_ASSIGN_OR_RETURN(m.cold, a.GetIntIn("mixed-cold", 10, 0, 1024));
    PENUMBRA_ASSIGN_OR_RETURN(m.doc_interval_s, a.GetDoubleIn("mixed-doc-interval-s", 5, 0, 3600));
    PENUMBRA_ASSIGN_OR_RETURN(m.question_interval_s, a.GetDoubleIn("mixed-question-interval-s", 2, 0, 3600));
    if (m.hot + m.cold == 0) return Status::InvalidArgument("--mixed-hot and --mixed-cold are both 0: no documents");
    if (!a.Has("max-new-tokens")) M = 128;
    return MixedBench(o, m, S, Q, M, V, put_s, policy, backend);
  }
  if (a.Has("job-documents")) {
    PENUMBRA_ASSIGN_OR_RETURN(int64_t N, a.GetIntIn("job-documents", 8, 1, 4096));
    PENUMBRA_ASSIGN_OR_RETURN(int64_t K, a.GetIntIn("job-questions", 16, 1, 4096));
    return JobBench(*c, N, K, S, Q, M, V, put_s, policy, backend);
  }

  // 1. The document, once; then one question's time to first token.
  const std::vector<int32_t> doc = Tokens(S - Q, 0, static_cast<int32_t>(V));
  Clock::time_point t0 = Clock::now();
  PENUMBRA_ASSIGN_OR_RETURN(rpc::DocumentInfo d,
                            c->PutDocument("bench", nullptr, &doc, true, std::chrono::seconds(put_s)));
  const double put_seconds = Since(t0);
  if (d.state != rpc::DocumentState::READY) {
    return Status::Internal("the document did not factor: " + (d.__isset.error ? d.error : std::string("?")));
  }
  auto ask = [&](int64_t salt, int64_t max_new) {
    rpc::GenerateRequest r;
    r.document_ids = {d.id};
    r.__set_token_ids(Tokens(Q, salt, static_cast<int32_t>(V)));
    r.max_new_tokens = static_cast<int32_t>(max_new);
    r.ignore_eos = true;
    return r;
  };
  t0 = Clock::now();
  PENUMBRA_ASSIGN_OR_RETURN(std::string id, c->Generate(ask(1, 2)));
  double client_ttft = -1;
  rpc::GenerateChunk ch;
  int64_t offset = 0;
  while (!ch.done) {
    PENUMBRA_ASSIGN_OR_RETURN(ch, c->Poll(id, offset, 10000));
    offset += static_cast<int64_t>(ch.ids.size());
    if (client_ttft < 0 && offset > 0) client_ttft = Since(t0);
  }
  nlohmann::json ttft = {{"bench", "service-ttft"},
                         {"context", S},
                         {"question", Q},
                         {"kv_policy", policy},
                         {"backend", backend},
                         {"document_put_s", put_seconds},
                         {"ttft_client_s", client_ttft},
                         {"ttft_worker_s", ch.usage.ttft_seconds},
                         {"cached_prompt_tokens", ch.usage.cached_prompt_tokens},
                         {"prompt_tokens", ch.usage.prompt_tokens},
                         {"tls", !o.tls_ca.empty()}};
  std::cout << ttft.dump() << std::endl;

  // 2. B questions decoding together, each followed by its own client.
  Followers fs(o, *c);
  for (int64_t i = 0; i < B; ++i) PENUMBRA_RETURN_IF_ERROR(fs.Add(ask(100 + i, M)));
  const Clock::time_point start = Clock::now();
  Status result = fs.WaitAllDecoding();
  double tps = 0, joined_s = Since(start);
  int64_t window_tokens = 0;
  bool early = false;
  if (result.ok()) {
    const auto [tokens, dt] = fs.Window(settle, W);
    early = fs.any_done();
    window_tokens = tokens;
    tps = static_cast<double>(window_tokens) / dt;
  }
  nlohmann::json during;
  if (result.ok() && !early && a.Has("put-during-decode")) {
    fs.ResetGaps();
    const int64_t n1 = fs.total();
    const Clock::time_point t1 = Clock::now();
    const std::vector<int32_t> doc2 = Tokens(S - Q, 7, static_cast<int32_t>(V));
    Result<rpc::DocumentInfo> d2 = c->PutDocument("bench-2", nullptr, &doc2, true, std::chrono::seconds(put_s));
    const double dt = Since(t1);
    const int64_t n2 = fs.total();
    const int64_t gap = fs.max_gap_ns();
    early = early || fs.any_done();
    if (!d2.ok()) {
      result = d2.status();
    } else {
      during = {{"bench", "service-decode-during-put"},
                {"context", S},
                {"batch", B},
                {"kv_policy", policy},
                {"backend", backend},
                {"document_put_s", dt},
                {"tokens_per_s", static_cast<double>(n2 - n1) / dt},
                {"max_token_gap_s", gap * 1e-9}};
    }
  }
  fs.Stop();
  PENUMBRA_RETURN_IF_ERROR(result);
  if (early) return Status::FailedPrecondition("a question ended inside the window: raise --max-new-tokens");
  nlohmann::json j = {{"bench", group_ranks > 0 ? "service-cp-decode" : "service-decode"},
                      {"context", S},
                      {"batch", B},
                      {"kv_policy", policy},
                      {"backend", backend},
                      {"shared_document", true},
                      {"question", Q},
                      {"window_s", W},
                      {"window_tokens", window_tokens},
                      {"tokens_per_s", tps},
                      {"all_joined_s", joined_s},
                      {"tls", !o.tls_ca.empty()}};
  if (group_ranks > 0) j["gpus"] = group_ranks;
  std::cout << j.dump() << std::endl;
  if (!during.is_null()) std::cout << during.dump() << std::endl;
  return Status::OK();
}

// Data-parallel scaling (--dp-documents N): N documents, which the
// coordinator spreads over its workers; B questions about the first alone
// (one worker's tokens/s), then B about each of them at once (all workers'),
// each question followed by its own long-polling client, tokens counted in
// a window of W seconds once all decode. {"bench": "dp-scaling",
// "workers": distinct workers holding the documents, "speedup": ...}.
Status DpBench(const client::ClientOptions& o, client::Client& c, int64_t N, int64_t B, int64_t S, int64_t Q, int64_t M,
               int64_t V, double W, double settle, int64_t put_s, const std::string& policy,
               const std::string& backend) {
  std::vector<rpc::DocumentInfo> docs;
  for (int64_t d = 0; d < N; ++d) {
    const std::vector<int32_t> ids = Tokens(S - Q, 2000 + d, static_cast<int32_t>(V));
    PENUMBRA_ASSIGN_OR_RETURN(rpc::DocumentInfo info, c.PutDocument("dp-doc-" + std::to_string(d), nullptr, &ids, true,
                                                                    std::chrono::seconds(put_s)));
    if (info.state != rpc::DocumentState::READY) return Status::Internal("document " + std::to_string(d) + " failed");
    docs.push_back(info);
  }
  std::set<std::string> workers;
  for (const auto& d : docs) workers.insert(d.worker);
  // B questions about each of `on` at once: tokens/s in the window.
  auto measure = [&](int64_t on) -> Result<double> {
    Followers fs(o, c);
    for (int64_t d = 0; d < on; ++d) {
      for (int64_t i = 0; i < B; ++i) {
        rpc::GenerateRequest r;
        r.document_ids = {docs[static_cast<size_t>(d)].id};
        r.__set_token_ids(Tokens(Q, 9000 + d * B + i, static_cast<int32_t>(V)));
        r.max_new_tokens = static_cast<int32_t>(M);
        r.ignore_eos = true;
        PENUMBRA_RETURN_IF_ERROR(fs.Add(r));
      }
    }
    PENUMBRA_RETURN_IF_ERROR(fs.WaitAllDecoding());
    const auto [tokens, dt] = fs.Window(settle, W);
    if (fs.any_done()) return Status::FailedPrecondition("a question ended inside the window: raise --max-new-tokens");
    return static_cast<double>(tokens) / dt;
  };
  PENUMBRA_ASSIGN_OR_RETURN(double one, measure(1));
  PENUMBRA_ASSIGN_OR_RETURN(double all, measure(N));
  for (const auto& d : docs) (void)c.DeleteDocument(d.id);
  nlohmann::json j = {{"bench", "dp-scaling"}, {"workers", static_cast<int64_t>(workers.size())},
                      {"documents", N},        {"batch_per_document", B},
                      {"context", S},          {"question", Q},
                      {"kv_policy", policy},   {"backend", backend},
                      {"window_s", W},         {"one_worker_tokens_per_s", one},
                      {"tokens_per_s", all},   {"speedup", one > 0 ? all / one : 0.0}};
  std::cout << j.dump() << std::endl;
  if (static_cast<int64_t>(workers.size()) != N) {
    return Status::FailedPrecondition("the documents are on " + std::to_string(workers.size()) +
                                      " workers, not one each");
  }
  return Status::OK();
}

// The mixed-documents workload (--mixed-hot): documents arrive every
// doc_interval_s, hot and cold interleaved evenly (hot first); each is put
// (waiting for it to be factored) by a client of its own, then asked: a
// cold one once at once, a hot one `questions` times, one every
// question_interval_s from its put's end. Every question (Q tokens,
// max_new_tokens M, greedy, end-of-text ignored) is followed by its own
// client to its last token. tokens/s: all generated tokens over the run's
// wall time (the first arrival to the last token); TTFT: from a question's
// Generate call to its first token, as the client sees it.
Status MixedBench(const client::ClientOptions& o, const MixedShape& m, int64_t S, int64_t Q, int64_t M, int64_t V,
                  int64_t put_s, const std::string& policy, const std::string& backend) {
  const int64_t D = m.hot + m.cold;
  // Arrival order: hot document h at position h * D / hot (the first first).
  std::vector<bool> hot(static_cast<size_t>(D), false);
  for (int64_t h = 0; h < m.hot; ++h) hot[static_cast<size_t>(h * D / m.hot)] = true;
  std::mutex mu;
  std::vector<double> ttfts, puts;
  int64_t tokens = 0, failed = 0, questions = 0;
  Status first_error;
  auto fail = [&](const Status& s) {
    std::lock_guard<std::mutex> lk(mu);
    ++failed;
    if (first_error.ok()) first_error = s;
  };
  auto ask = [&](const std::string& doc_id, int64_t salt) {
    auto c = client::Client::Connect(o);
    if (!c.ok()) return fail(c.status());
    rpc::GenerateRequest r;
    r.document_ids = {doc_id};
    r.__set_token_ids(Tokens(Q, salt, static_cast<int32_t>(V)));
    r.max_new_tokens = static_cast<int32_t>(M);
    r.ignore_eos = true;
    const Clock::time_point t0 = Clock::now();
    Result<std::string> id = (*c)->Generate(r);
    if (!id.ok()) return fail(id.status());
    double ttft = -1;
    int64_t off = 0;
    for (;;) {
      Result<rpc::GenerateChunk> p = (*c)->Poll(*id, off, 10000);
      if (!p.ok()) return fail(p.status());
      off += static_cast<int64_t>(p->ids.size());
      if (ttft < 0 && off > 0) ttft = Since(t0);
      if (p->done) break;
    }
    std::lock_guard<std::mutex> lk(mu);
    ++questions;
    tokens += off;
    if (ttft >= 0) ttfts.push_back(ttft);
  };
  std::vector<std::string> doc_ids(static_cast<size_t>(D));
  const Clock::time_point start = Clock::now();
  std::vector<std::thread> docs;
  for (int64_t d = 0; d < D; ++d) {
    docs.emplace_back([&, d] {
      std::this_thread::sleep_until(start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(
                                                m.doc_interval_s * static_cast<double>(d))));
      auto c = client::Client::Connect(o);
      if (!c.ok()) return fail(c.status());
      const std::vector<int32_t> ids = Tokens(S - Q, 3000 + d, static_cast<int32_t>(V));
      const Clock::time_point t0 = Clock::now();
      Result<rpc::DocumentInfo> info =
          (*c)->PutDocument("mixed-doc-" + std::to_string(d), nullptr, &ids, true, std::chrono::seconds(put_s));
      if (!info.ok()) return fail(info.status());
      if (info->state != rpc::DocumentState::READY) return fail(Status::Internal("a document did not factor"));
      const Clock::time_point put_end = Clock::now();
      {
        std::lock_guard<std::mutex> lk(mu);
        puts.push_back(Since(t0));
        doc_ids[static_cast<size_t>(d)] = info->id;
      }
      const int64_t n = hot[static_cast<size_t>(d)] ? m.questions : 1;
      std::vector<std::thread> qs;
      for (int64_t k = 0; k < n; ++k) {
        qs.emplace_back([&, k, put_end, id = info->id] {
          std::this_thread::sleep_until(
              put_end + std::chrono::duration_cast<Clock::duration>(
                            std::chrono::duration<double>(m.question_interval_s * static_cast<double>(k))));
          ask(id, 70000 + d * 4096 + k);
        });
      }
      for (auto& t : qs) t.join();
    });
  }
  for (auto& t : docs) t.join();
  const double wall = Since(start);
  auto c = client::Client::Connect(o);
  if (c.ok()) {
    for (const std::string& id : doc_ids) {
      if (!id.empty()) (void)(*c)->DeleteDocument(id);
    }
  }
  auto quantile = [](std::vector<double> x, double q) {
    if (x.empty()) return -1.0;
    std::sort(x.begin(), x.end());
    return x[static_cast<size_t>(
        std::min<double>(static_cast<double>(x.size() - 1), std::ceil(q * static_cast<double>(x.size())) - 1))];
  };
  nlohmann::json j = {{"bench", "mixed-documents"},
                      {"policy", policy},
                      {"kv_policy", policy},
                      {"backend", backend},
                      {"hot_documents", m.hot},
                      {"questions_per_hot_document", m.questions},
                      {"cold_documents", m.cold},
                      {"context", S},
                      {"question", Q},
                      {"max_new_tokens", M},
                      {"document_interval_s", m.doc_interval_s},
                      {"question_interval_s", m.question_interval_s},
                      {"questions", questions},
                      {"failed", failed},
                      {"generated_tokens", tokens},
                      {"wall_s", wall},
                      {"tokens_per_s", static_cast<double>(tokens) / wall},
                      {"ttft_p50_s", quantile(ttfts, 0.5)},
                      {"ttft_p99_s", quantile(ttfts, 0.99)},
                      {"ttft_max_s", quantile(ttfts, 1.0)},
                      {"put_p50_s", quantile(puts, 0.5)},
                      {"put_max_s", quantile(puts, 1.0)}};
  std::cout << j.dump() << std::endl;
  return first_error.ok() ? Status::OK() : Status(first_error.code(), "a request failed: " + first_error.message());
}

}  // namespace
}  // namespace penumbra

int main(int argc, char** argv) {
  penumbra::InitLogging(argv[0]);
  penumbra::Status s = penumbra::Run(argc, argv);
  if (!s.ok()) {
    std::cerr << "penumbra-service-bench: " << s.ToString() << std::endl;
    return s.code() == penumbra::StatusCode::kInvalidArgument ? 2 : 1;
  }
  return 0;
}
