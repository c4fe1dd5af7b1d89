// The continuous-batching scheduler (worker/service/scheduler.h) on the CPU
// backend (stories260K, f32): concurrent clients get exactly the offline
// engine's answers (batching and interleaved prefill change no token, greedy
// and seeded sampling), a request admitted mid-decode finishes before an
// earlier long one, a long prompt's prefill is interleaved with others'
// decode steps, tokens stream by polling with offsets, cancellation and
// deadlines end one request and nothing else, bad requests are refused with
// typed errors, documents are reused through the scheduler, and requests that
// do not fit wait or are refused.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <map>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "tests/test_util.h"
#include "tests/worker/stories_shadowkv.h"
#include "worker/engine/engine.h"
#include "worker/service/scheduler.h"

namespace penumbra::service {
namespace {

using ::penumbra::testing::LcgTokens;
using namespace std::chrono_literals;

class SchedulerTest : public ::penumbra::testing::StoriesTest {};

std::unique_ptr<Engine> OpenEngine(const std::string& policy = "full", int prefill_chunk = 4096,
                                   size_t cache_bytes = 0) {
  EngineOptions o = policy == "full" ? EngineOptions{} : ::penumbra::testing::LossyShadowKvOptions();
  o.backend.device = "cpu";
  o.kv_policy = policy;
  o.runtime.prefill_chunk = prefill_chunk;
  o.runtime.prefix_cache_bytes = cache_bytes;
  auto e = Engine::Open(::penumbra::testing::StoriesDir(), o);
  EXPECT_TRUE(e.ok()) << e.status();
  return e.ok() ? std::move(*e) : nullptr;
}

std::unique_ptr<Scheduler> Start(Engine& e, SchedulerOptions o = {}) {
  auto s = Scheduler::Create(&e.runtime(), o);
  EXPECT_TRUE(s.ok()) << s.status();
  return s.ok() ? std::move(*s) : nullptr;
}

GenerationRequest Req(int prompt_len, int max_new, uint64_t seed, float temperature = 0.0f) {
  GenerationRequest r;
  r.prompt = LcgTokens(prompt_len, seed, true);
  r.max_new_tokens = max_new;
  r.sampling.temperature = temperature;
  r.sampling.top_k = temperature > 0 ? 40 : 0;
  r.sampling.seed = seed;
  return r;
}

// Polls until request `id` has made at least n tokens (or ended).
RequestUpdate WaitForTokens(Scheduler& s, uint64_t id, int64_t n) {
  RequestUpdate u;
  int64_t have = 0;
  for (;;) {
    auto p = s.Poll(id, have, std::chrono::seconds(10));
    EXPECT_TRUE(p.ok()) << p.status();
    if (!p.ok()) return u;
    have += static_cast<int64_t>(p->ids.size());
    u = *p;
    if (have >= n || p->done) return u;
  }
}

// The offline engine's answer for `r` alone.
std::vector<int32_t> Offline(const GenerationRequest& r, const std::string& policy = "full") {
  auto e = OpenEngine(policy);
  if (!e) return {};
  auto res = e->runtime().Generate({r});
  EXPECT_TRUE(res.ok()) << res.status();
  return res.ok() ? (*res)[0].ids : std::vector<int32_t>{};
}

TEST_F(SchedulerTest, ConcurrentClientsGetTheOfflineAnswers) {
  for (const std::string policy : {"full", "shadowkv"}) {
    SCOPED_TRACE(policy);
    // Mixed prompt lengths and answer lengths, greedy and seeded sampling;
    // 16 clients either way (under a sanitizer fewer requests each: the
    // offline answers are most of the instrumented cost, not the concurrency).
    const int per_client = testing::kUnderSanitizer ? 3 : 10;
    std::vector<GenerationRequest> reqs;
    for (int i = 0; i < 16 * per_client; ++i) {
      reqs.push_back(Req(20 + (i * 37) % 300, 1 + (i * 13) % 24, 1000 + i, i % 4 == 3 ? 0.8f : 0.0f));
    }
    std::vector<std::vector<int32_t>> want;
    {
      auto e = OpenEngine(policy);
      ASSERT_TRUE(e);
      for (const auto& r : reqs) {
        auto res = e->runtime().Generate({r});
        ASSERT_TRUE(res.ok()) << res.status();
        want.push_back((*res)[0].ids);
      }
    }
    auto e = OpenEngine(policy, 64);  // small prefill chunks: long prompts are prefilled in pieces
    ASSERT_TRUE(e);
    SchedulerOptions so;
    so.max_batch = 8;
    so.prefill_tokens_per_step = 64;
    auto s = Start(*e, so);
    ASSERT_TRUE(s);
    // 16 clients x 10 requests, each submitted as the client's previous one
    // finishes (so requests arrive while others decode).
    std::vector<std::vector<int32_t>> got(reqs.size());
    std::vector<std::thread> clients;
    for (int c = 0; c < 16; ++c) {
      clients.emplace_back([&, c] {
        for (int k = 0; k < per_client; ++k) {
          const size_t i = static_cast<size_t>(c) * per_client + k;
          auto id = s->Submit(reqs[i]);
          ASSERT_TRUE(id.ok()) << id.status();
          auto u = s->Wait(*id);
          ASSERT_TRUE(u.ok()) << u.status();
          EXPECT_TRUE(u->done);
          EXPECT_TRUE(u->finish_reason == "length" || u->finish_reason == "stop") << u->finish_reason;
          EXPECT_EQ(u->prompt_tokens, static_cast<int64_t>(reqs[i].prompt.size()));
          EXPECT_GE(u->ttft_seconds, 0.0);
          got[i] = u->ids;
          EXPECT_TRUE(s->Release(*id).ok());
        }
      });
    }
    for (auto& t : clients) t.join();
    for (size_t i = 0; i < reqs.size(); ++i) EXPECT_EQ(got[i], want[i]) << "request " << i;
    const SchedulerStats st = s->stats();
    EXPECT_EQ(st.submitted, 16 * per_client);
    EXPECT_EQ(st.finished, 16 * per_client);
    EXPECT_EQ(st.failed, 0);
    EXPECT_GT(st.decode_steps, 0);
  }
}

TEST_F(SchedulerTest, ARequestAdmittedMidDecodeFinishesBeforeAnEarlierLongOne) {
  auto e = OpenEngine();
  ASSERT_TRUE(e);
  auto s = Start(*e);
  ASSERT_TRUE(s);
  auto long_id = s->Submit(Req(30, 300, 1));
  ASSERT_TRUE(long_id.ok());
  // Wait until the long one is decoding.
  ASSERT_FALSE(WaitForTokens(*s, *long_id, 5).done);
  const GenerationRequest short_req = Req(25, 3, 2);
  auto short_id = s->Submit(short_req);
  ASSERT_TRUE(short_id.ok());
  auto done = s->Wait(*short_id);
  ASSERT_TRUE(done.ok());
  EXPECT_EQ(done->ids, Offline(short_req));
  auto long_now = s->Poll(*long_id, 0, 0ms);
  ASSERT_TRUE(long_now.ok());
  EXPECT_FALSE(long_now->done) << "the short request waited for the long one";
  EXPECT_LT(long_now->generated_tokens, 300);
  auto long_done = s->Wait(*long_id);
  ASSERT_TRUE(long_done.ok());
  EXPECT_EQ(long_done->ids, Offline(Req(30, 300, 1)));
}

TEST_F(SchedulerTest, ALongPrefillIsInterleavedWithDecodeSteps) {
  auto e = OpenEngine("full", 32);
  ASSERT_TRUE(e);
  SchedulerOptions so;
  so.prefill_tokens_per_step = 32;  // a 400-token prompt: 13 pieces
  auto s = Start(*e, so);
  ASSERT_TRUE(s);
  const GenerationRequest a = Req(20, 60, 3), b = Req(400, 5, 4);
  auto ida = s->Submit(a);
  ASSERT_TRUE(ida.ok());
  ASSERT_FALSE(WaitForTokens(*s, *ida, 1).done);  // a is decoding
  auto idb = s->Submit(b);
  ASSERT_TRUE(idb.ok());
  auto ub = s->Wait(*idb);
  auto ua = s->Wait(*ida);
  ASSERT_TRUE(ua.ok() && ub.ok());
  EXPECT_EQ(ub->ids, Offline(b));
  EXPECT_EQ(ua->ids, Offline(a));
  const SchedulerStats st = s->stats();
  EXPECT_GE(st.prefill_pieces, 13);
  EXPECT_GT(st.interleaved_decode_steps, 0) << "a decoded nothing while b's prompt went in";
}

// ShadowKV factors a segment whole: its prefill is split by layers instead,
// and the tokens are those of one unsplit prefill.
TEST_F(SchedulerTest, AShadowKvPrefillIsSplitByLayers) {
  auto e = OpenEngine("shadowkv");
  ASSERT_TRUE(e);
  SchedulerOptions so;
  so.prefill_tokens_per_step = 60;  // a 300-token segment: 1 of 5 layers per step
  auto s = Start(*e, so);
  ASSERT_TRUE(s);
  const GenerationRequest a = Req(40, 80, 5), b = Req(300, 6, 6);
  auto ida = s->Submit(a);
  ASSERT_TRUE(ida.ok());
  ASSERT_FALSE(WaitForTokens(*s, *ida, 1).done);
  auto idb = s->Submit(b);
  ASSERT_TRUE(idb.ok());
  auto ub = s->Wait(*idb);
  auto ua = s->Wait(*ida);
  ASSERT_TRUE(ua.ok() && ub.ok());
  EXPECT_EQ(ub->ids, Offline(b, "shadowkv"));
  EXPECT_EQ(ua->ids, Offline(a, "shadowkv"));
  const SchedulerStats st = s->stats();
  EXPECT_GE(st.prefill_pieces, 1 + 5);  // a at once, b one layer per step
  EXPECT_GE(st.interleaved_decode_steps, 4) << "a decoded nothing while b's layers went in";
}

TEST_F(SchedulerTest, TokensStreamByPollingWithOffsets) {
  auto e = OpenEngine();
  ASSERT_TRUE(e);
  auto s = Start(*e);
  ASSERT_TRUE(s);
  const GenerationRequest r = Req(40, 40, 5);
  auto id = s->Submit(r);
  ASSERT_TRUE(id.ok());
  std::vector<int32_t> streamed;
  int polls = 0;
  for (;;) {
    auto u = s->Poll(*id, static_cast<int64_t>(streamed.size()), 5s);
    ASSERT_TRUE(u.ok()) << u.status();
    ++polls;
    streamed.insert(streamed.end(), u->ids.begin(), u->ids.end());
    if (u->done) {
      EXPECT_EQ(u->finish_reason, "length");
      EXPECT_EQ(u->generated_tokens, 40);
      break;
    }
  }
  EXPECT_EQ(streamed, Offline(r));
  EXPECT_GT(polls, 1);
  // Offsets past the tokens made, unknown ids.
  EXPECT_EQ(s->Poll(*id, 41, 0ms).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s->Poll(*id, -1, 0ms).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s->Poll(999999, 0, 0ms).status().code(), StatusCode::kNotFound);
  EXPECT_TRUE(s->Release(*id).ok());
  EXPECT_EQ(s->Poll(*id, 0, 0ms).status().code(), StatusCode::kNotFound);
}

// Several streams polled at once (a coordinator's one poll of a worker):
// every answer continues its own stream, the whole streams are the offline
// answers, and targets that are not there say so each in their own slot.
TEST_F(SchedulerTest, SeveralStreamsPolledAtOnceEachGetTheirTokens) {
  auto e = OpenEngine();
  ASSERT_TRUE(e);
  auto s = Start(*e);
  ASSERT_TRUE(s);
  const std::vector<GenerationRequest> reqs = {Req(30, 25, 11), Req(45, 40, 12), Req(20, 10, 13)};
  std::vector<uint64_t> ids;
  for (const auto& r : reqs) {
    auto id = s->Submit(r);
    ASSERT_TRUE(id.ok()) << id.status();
    ids.push_back(*id);
  }
  std::vector<std::vector<int32_t>> streamed(reqs.size());
  std::vector<bool> done(reqs.size(), false);
  int rounds = 0;
  while (std::find(done.begin(), done.end(), false) != done.end() && rounds < 10000) {
    std::vector<std::pair<uint64_t, int64_t>> targets;
    std::vector<size_t> which;
    for (size_t i = 0; i < reqs.size(); ++i) {
      if (done[i]) continue;
      targets.emplace_back(ids[i], static_cast<int64_t>(streamed[i].size()));
      which.push_back(i);
    }
    auto updates = s->PollMany(targets, 5s);
    ASSERT_EQ(updates.size(), targets.size());
    bool progressed = false;
    for (size_t k = 0; k < updates.size(); ++k) {
      ASSERT_TRUE(updates[k].ok()) << updates[k].status();
      const size_t i = which[k];
      EXPECT_EQ(updates[k]->offset, static_cast<int64_t>(streamed[i].size()));
      streamed[i].insert(streamed[i].end(), updates[k]->ids.begin(), updates[k]->ids.end());
      progressed = progressed || !updates[k]->ids.empty() || updates[k]->done;
      done[i] = updates[k]->done;
    }
    EXPECT_TRUE(progressed) << "a poll returned before its wait with no progress";
    ++rounds;
  }
  for (size_t i = 0; i < reqs.size(); ++i) EXPECT_EQ(streamed[i], Offline(reqs[i])) << i;
  auto bad = s->PollMany({{ids[0], 999}, {424242, 0}, {ids[1], 0}}, 0ms);
  ASSERT_EQ(bad.size(), 3u);
  EXPECT_EQ(bad[0].status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(bad[1].status().code(), StatusCode::kNotFound);
  ASSERT_TRUE(bad[2].ok());
  EXPECT_EQ(bad[2]->ids.size(), 40u);
}

TEST_F(SchedulerTest, CancelAndDeadlineEndOneRequestOnly) {
  auto e = OpenEngine();
  ASSERT_TRUE(e);
  auto s = Start(*e);
  ASSERT_TRUE(s);
  const GenerationRequest keep = Req(30, 50, 6);
  auto id_keep = s->Submit(keep);
  auto id_cancel = s->Submit(Req(30, 400, 7));
  SubmitOptions past;
  past.deadline = Clock::now() + 50ms;
  auto id_deadline = s->Submit(Req(30, 400, 8), past);
  ASSERT_TRUE(id_keep.ok() && id_cancel.ok() && id_deadline.ok());
  ASSERT_FALSE(WaitForTokens(*s, *id_cancel, 2).done);
  EXPECT_TRUE(s->Cancel(*id_cancel).ok());
  auto c = s->Wait(*id_cancel);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->finish_reason, "cancelled");
  EXPECT_LT(c->generated_tokens, 400);
  auto d = s->Wait(*id_deadline);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->finish_reason, "deadline");
  EXPECT_EQ(d->error.code(), StatusCode::kDeadlineExceeded);
  auto k = s->Wait(*id_keep);
  ASSERT_TRUE(k.ok());
  EXPECT_EQ(k->ids, Offline(keep));
  EXPECT_TRUE(s->Cancel(*id_keep).ok());  // finished: left as it is
  EXPECT_EQ(s->Wait(*id_keep)->finish_reason, "length");
  EXPECT_EQ(s->Cancel(424242).code(), StatusCode::kNotFound);
}

TEST_F(SchedulerTest, AQueuedRequestCancelledBeforeAdmissionNeverRuns) {
  auto e = OpenEngine();
  ASSERT_TRUE(e);
  SchedulerOptions one;
  one.max_batch = 1;
  auto s = Start(*e, one);
  ASSERT_TRUE(s);
  auto first = s->Submit(Req(20, 100, 1));
  ASSERT_TRUE(first.ok());
  ASSERT_FALSE(WaitForTokens(*s, *first, 1).done);  // decoding: the batch of one is full
  auto queued = s->Submit(Req(20, 5, 2));
  ASSERT_TRUE(queued.ok());
  EXPECT_EQ(s->stats().queued, 1);
  EXPECT_TRUE(s->Cancel(*queued).ok());
  auto u = s->Poll(*queued, 0, 0ms);
  ASSERT_TRUE(u.ok());
  EXPECT_TRUE(u->done);
  EXPECT_EQ(u->finish_reason, "cancelled");
  EXPECT_EQ(u->generated_tokens, 0);
  EXPECT_EQ(s->Wait(*first)->generated_tokens, 100);
}

// Fair share of admission between tenants (cache namespaces): tenant a has
// 10 requests waiting when b's 2 arrive; b's are admitted 2nd and 4th (a
// idle tenant comes back at the current virtual time and alternates with
// the backlogged one), not after all of a's. With weights 3:1 a backlogged
// pair is admitted 3:1.
TEST_F(SchedulerTest, WaitingTenantsAreAdmittedByFairShare) {
  auto e = OpenEngine();
  ASSERT_TRUE(e);
  for (const double weight_a : {1.0, 3.0}) {
    SchedulerOptions one;
    one.max_batch = 1;
    auto s = Start(*e, one);
    ASSERT_TRUE(s);
    auto sub = [&](const std::string& tenant, int max_new, uint64_t seed, double weight) {
      GenerationRequest r = Req(12, max_new, seed);
      r.cache_namespace = tenant;
      SubmitOptions o;
      o.share_weight = weight;
      auto id = s->Submit(std::move(r), o);
      EXPECT_TRUE(id.ok()) << id.status();
      return std::make_pair(*id, std::chrono::steady_clock::now());
    };
    auto first = sub("a", 60, 1, weight_a);
    ASSERT_FALSE(WaitForTokens(*s, first.first, 1).done);  // the batch of one is full
    std::vector<std::pair<std::string, std::pair<uint64_t, std::chrono::steady_clock::time_point>>> waiting;
    for (int i = 0; i < 10; ++i) waiting.push_back({"a", sub("a", 2, 10 + i, weight_a)});
    const int nb = weight_a == 1.0 ? 2 : 10;
    for (int i = 0; i < nb; ++i) waiting.push_back({"b", sub("b", 2, 30 + i, 1.0)});
    // Admission order: each request's submit time plus its queue time.
    std::vector<std::pair<double, std::string>> admitted;
    for (auto& [tenant, w] : waiting) {
      auto u = s->Wait(w.first);
      ASSERT_TRUE(u.ok()) << u.status();
      ASSERT_EQ(u->generated_tokens, 2);
      admitted.push_back(
          {std::chrono::duration<double>(w.second.time_since_epoch()).count() + u->queue_seconds, tenant});
    }
    std::sort(admitted.begin(), admitted.end());
    std::string order;
    for (auto& [t, tenant] : admitted) order += tenant;
    if (weight_a == 1.0) {
      EXPECT_EQ(order.substr(0, 4), "baba") << order;  // b re-enters at a's current virtual time
    } else {
      // a (weight 3) and b (weight 1) both backlogged: 3 of a's per one of b's.
      const std::string first8 = order.substr(0, 8);
      EXPECT_EQ(std::count(first8.begin(), first8.end(), 'a'), 6) << order;
    }
  }
}

// Fair share of the batch: tenant a floods a batch of 4 while b is active
// (b sent a request within the share window): a holds at most half of it,
// so b's next request is admitted at once, beside a's running ones, and
// finishes long before them. Alone (b long idle: window 0), a takes all 4.
TEST_F(SchedulerTest, AFloodingTenantLeavesTheOthersShareOfTheBatchFree) {
  auto e = OpenEngine();
  ASSERT_TRUE(e);
  for (const bool caps : {true, false}) {
    SchedulerOptions so;
    so.max_batch = 4;
    so.share_window = caps ? std::chrono::milliseconds(60000) : std::chrono::milliseconds(0);
    auto s = Start(*e, so);
    ASSERT_TRUE(s);
    auto sub = [&](const std::string& tenant, int max_new, uint64_t seed) {
      GenerationRequest r = Req(12, max_new, seed);
      r.cache_namespace = tenant;
      auto id = s->Submit(std::move(r));
      EXPECT_TRUE(id.ok()) << id.status();
      return *id;
    };
    ASSERT_TRUE(s->Wait(sub("b", 2, 1)).ok());  // b is active from now on
    std::vector<uint64_t> flood;
    for (int i = 0; i < 6; ++i) flood.push_back(sub("a", 300, 10 + i));
    ASSERT_FALSE(WaitForTokens(*s, flood[0], 2).done);
    // a's admissions come one per loop iteration: wait until the batch holds
    // as many as it will (a loaded machine may take a while), then a little
    // longer, so that a cap overrun would show.
    const int64_t want = caps ? 2 : 4;
    for (int i = 0; i < 1000 && s->stats().decoding + s->stats().prefilling < want; ++i) {
      std::this_thread::sleep_for(10ms);
    }
    std::this_thread::sleep_for(50ms);
    const SchedulerStats st = s->stats();
    EXPECT_EQ(st.decoding + st.prefilling, want) << "a's sequences in the batch";
    const uint64_t steady = sub("b", 3, 2);
    auto u = s->Wait(steady);
    ASSERT_TRUE(u.ok()) << u.status();
    auto first = s->Poll(flood[0], 0, 0ms);
    ASSERT_TRUE(first.ok());
    if (caps) {
      EXPECT_LT(u->queue_seconds, 0.5) << "b waited for a slot";
      EXPECT_FALSE(first->done) << "a's first request ended before b's short one";
    }
    for (uint64_t id : flood) ASSERT_TRUE(s->Cancel(id).ok());
  }
}

TEST_F(SchedulerTest, BadRequestsAreRefusedAndTheSchedulerKeepsServing) {
  auto e = OpenEngine();
  ASSERT_TRUE(e);
  SchedulerOptions so;
  so.max_queue = 2;
  so.max_batch = 1;
  auto s = Start(*e, so);
  ASSERT_TRUE(s);
  GenerationRequest empty = Req(10, 4, 1);
  empty.prompt.clear();
  EXPECT_EQ(s->Submit(empty).status().code(), StatusCode::kInvalidArgument);
  GenerationRequest bad_id = Req(10, 4, 1);
  bad_id.prompt[3] = 512;  // past the vocabulary
  EXPECT_EQ(s->Submit(bad_id).status().code(), StatusCode::kInvalidArgument);
  GenerationRequest too_long = Req(500, 100, 1);  // past max_position_embeddings
  EXPECT_EQ(s->Submit(too_long).status().code(), StatusCode::kInvalidArgument);
  GenerationRequest bad_temp = Req(10, 4, 1);
  bad_temp.sampling.temperature = -1;
  EXPECT_EQ(s->Submit(bad_temp).status().code(), StatusCode::kInvalidArgument);
  // A full queue: ResourceExhausted with a retry hint.
  std::vector<uint64_t> ids;
  Status full = Status::OK();
  for (int i = 0; i < 10 && full.ok(); ++i) {
    auto id = s->Submit(Req(20, 200, 10 + i));
    if (id.ok()) {
      ids.push_back(*id);
    } else {
      full = id.status();
    }
  }
  EXPECT_EQ(full.code(), StatusCode::kResourceExhausted) << full;
  for (uint64_t id : ids) EXPECT_TRUE(s->Cancel(id).ok());
  // Still serving.
  const GenerationRequest ok = Req(15, 6, 99);
  auto id = s->Submit(ok);
  ASSERT_TRUE(id.ok()) << id.status();
  EXPECT_EQ(s->Wait(*id)->ids, Offline(ok));
  EXPECT_FALSE(Scheduler::Create(&e->runtime(), SchedulerOptions{.max_batch = 0}).ok());
}

// A 20-token question (seed q) after document `doc`, segmented at its end.
GenerationRequest QuestionAbout(const std::vector<int32_t>& doc, uint64_t q, int max_new) {
  GenerationRequest r;
  r.prompt = doc;
  const std::vector<int32_t> question = LcgTokens(20, q, false);
  r.prompt.insert(r.prompt.end(), question.begin(), question.end());
  r.document_ends = {static_cast<int64_t>(doc.size())};
  r.max_new_tokens = max_new;
  return r;
}

TEST_F(SchedulerTest, DocumentsAreReusedThroughTheScheduler) {
  for (const std::string policy : {"full", "shadowkv"}) {
    SCOPED_TRACE(policy);
    auto e = OpenEngine(policy, 4096, 64 << 20);
    ASSERT_TRUE(e);
    auto s = Start(*e);
    ASSERT_TRUE(s);
    const std::vector<int32_t> doc = LcgTokens(151, 7, true);
    for (uint64_t q = 0; q < 3; ++q) {
      const GenerationRequest r = QuestionAbout(doc, 100 + q, 12);
      auto id = s->Submit(r);
      ASSERT_TRUE(id.ok());
      auto u = s->Wait(*id);
      ASSERT_TRUE(u.ok());
      EXPECT_EQ(u->cached_prompt_tokens, q == 0 ? 0 : 151);
      // The same segmented request on an engine with no document cache.
      EXPECT_EQ(u->ids, Offline(r, policy)) << "question " << q;
    }
    EXPECT_EQ(s->stats().cached_prompt_tokens, 2 * 151);
  }
}

// Questions about two cached documents submitted interleaved decode in one
// batch, which the scheduler orders by document (a policy scores one
// document's sequences together): each still gets its offline answer.
TEST_F(SchedulerTest, InterleavedQuestionsAboutTwoDocumentsGetTheirOfflineAnswers) {
  for (const std::string policy : {"full", "shadowkv"}) {
    SCOPED_TRACE(policy);
    auto e = OpenEngine(policy, 4096, 64 << 20);
    ASSERT_TRUE(e);
    auto s = Start(*e);
    ASSERT_TRUE(s);
    const std::vector<std::vector<int32_t>> docs = {LcgTokens(151, 7, true), LcgTokens(133, 8, true)};
    auto question = [&](int d, uint64_t q) { return QuestionAbout(docs[d], 200 + q, 10 + static_cast<int>(q % 3)); };
    for (int d = 0; d < 2; ++d) {  // each document cached by a first question
      auto id = s->Submit(question(d, 50 + d));
      ASSERT_TRUE(id.ok());
      ASSERT_TRUE(s->Wait(*id).ok());
    }
    std::vector<GenerationRequest> reqs;
    std::vector<uint64_t> ids;
    for (uint64_t q = 0; q < 6; ++q) {  // A, B, A, B, ...
      reqs.push_back(question(static_cast<int>(q % 2), q));
      auto id = s->Submit(reqs.back());
      ASSERT_TRUE(id.ok());
      ids.push_back(*id);
    }
    for (size_t i = 0; i < ids.size(); ++i) {
      auto u = s->Wait(ids[i]);
      ASSERT_TRUE(u.ok());
      EXPECT_EQ(u->cached_prompt_tokens, static_cast<int64_t>(docs[i % 2].size())) << "question " << i;
      EXPECT_EQ(u->ids, Offline(reqs[i], policy)) << "question " << i;
    }
  }
}

TEST_F(SchedulerTest, DrainFinishesWhatRunsAndRefusesNewRequests) {
  auto e = OpenEngine();
  ASSERT_TRUE(e);
  auto s = Start(*e);
  ASSERT_TRUE(s);
  std::vector<uint64_t> ids;
  for (int i = 0; i < 5; ++i) ids.push_back(*s->Submit(Req(20 + i, 10, 50 + i)));
  s->Drain();
  for (uint64_t id : ids) {
    auto u = s->Poll(id, 0, 0ms);
    ASSERT_TRUE(u.ok());
    EXPECT_TRUE(u->done);
    EXPECT_EQ(u->finish_reason, "length");
  }
  EXPECT_EQ(s->Submit(Req(20, 5, 1)).status().code(), StatusCode::kUnavailable);
}

}  // namespace
}  // namespace penumbra::service

namespace penumbra::service {
namespace {

// A document put: max_new_tokens 0 prefills and captures the prompt's
// segments and generates nothing; the next request about it attaches it;
// ForgetPrefixes (on the loop, through RunOnLoop) drops it again.
TEST_F(SchedulerTest, PrefillOnlyPutsADocumentAndForgetDropsIt) {
  auto e = OpenEngine("full", 4096, 64 << 20);
  ASSERT_TRUE(e);
  auto s = Start(*e);
  ASSERT_TRUE(s);
  GenerationRequest put;
  put.prompt = LcgTokens(130, 9, true);
  put.document_ends = {130};
  put.max_new_tokens = 0;
  auto id = s->Submit(put);
  ASSERT_TRUE(id.ok()) << id.status();
  auto u = s->Wait(*id);
  ASSERT_TRUE(u.ok());
  EXPECT_EQ(u->finish_reason, "prefilled");
  EXPECT_TRUE(u->ids.empty());
  EXPECT_EQ(u->prefilled_tokens, 130);

  GenerationRequest ask = put;
  const std::vector<int32_t> q = LcgTokens(10, 10, false);
  ask.prompt.insert(ask.prompt.end(), q.begin(), q.end());
  ask.max_new_tokens = 6;
  auto a = s->Wait(*s->Submit(ask));
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->cached_prompt_tokens, 130);
  EXPECT_EQ(a->ids, Offline(ask));

  int dropped = -1;
  ASSERT_TRUE(s->RunOnLoop([&](Runtime& rt) {
                 PENUMBRA_ASSIGN_OR_RETURN(dropped, rt.ForgetPrefixes(put));
                 return Status::OK();
               }).ok());
  EXPECT_EQ(dropped, 1);
  auto again = s->Wait(*s->Submit(ask));
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->cached_prompt_tokens, 0);
  EXPECT_EQ(again->ids, a->ids);

  // A put whose segment does not end the prompt, or a negative count: refused.
  GenerationRequest bad = put;
  bad.document_ends = {131};
  EXPECT_EQ(s->Submit(bad).status().code(), StatusCode::kInvalidArgument);
  bad.document_ends = {130};
  bad.max_new_tokens = -1;
  EXPECT_EQ(s->Submit(bad).status().code(), StatusCode::kInvalidArgument);
}

// Release of a running request cancels it and forgets it when it ends.
TEST_F(SchedulerTest, ReleasingARunningRequestCancelsAndForgetsIt) {
  auto e = OpenEngine();
  ASSERT_TRUE(e);
  auto s = Start(*e);
  ASSERT_TRUE(s);
  auto id = s->Submit(Req(20, 400, 3));
  ASSERT_TRUE(id.ok());
  WaitForTokens(*s, *id, 2);
  ASSERT_TRUE(s->Release(*id).ok());
  EXPECT_TRUE(s->WaitReleased(10s));
  EXPECT_EQ(s->Poll(*id, 0, 0ms).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(s->stats().cancelled, 1);
}

}  // namespace
}  // namespace penumbra::service

namespace penumbra::service {
namespace {

// Cancels racing admissions: a queued request cancelled while the loop is
// admitting it (or the one behind it) ends, and no other request is lost.
TEST_F(SchedulerTest, CancellingWhileAdmittingLosesNoRequest) {
  auto e = OpenEngine();
  ASSERT_TRUE(e);
  SchedulerOptions so;
  so.max_batch = 1;
  auto s = Start(*e, so);
  ASSERT_TRUE(s);
  for (int round = 0; round < 200; ++round) {
    std::vector<uint64_t> ids;
    for (int i = 0; i < 4; ++i) {
      auto id = s->Submit(Req(30 + i, 3, 1000 + round * 4 + i));
      ASSERT_TRUE(id.ok()) << id.status();
      ids.push_back(*id);
    }
    // Cancel all but the last, as fast as possible, while the loop admits.
    for (int i = 0; i + 1 < 4; ++i) ASSERT_TRUE(s->Cancel(ids[i]).ok());
    for (uint64_t id : ids) {
      RequestUpdate u;
      int64_t have = 0;
      for (int t = 0; t < 300 && !u.done; ++t) {  // 30 s at most
        auto p = s->Poll(id, have, 100ms);
        ASSERT_TRUE(p.ok()) << p.status();
        u = *p;
        have += static_cast<int64_t>(p->ids.size());
      }
      ASSERT_TRUE(u.done) << "round " << round << ": request " << id << " never ended";
    }
    auto last = s->Poll(ids.back(), 0, 0ms);
    ASSERT_TRUE(last.ok());
    EXPECT_EQ(last->finish_reason, "length") << "round " << round;
  }
  const SchedulerStats st = s->stats();
  EXPECT_EQ(st.queued + st.prefilling + st.decoding, 0);
}

}  // namespace
}  // namespace penumbra::service
