// The scheduler's store I/O off the decode loop (issue 38): a persistent
// store that hangs (a test double standing for a stopped store node) holds
// up only the request that needs it, which waits "fetching" while the batch
// keeps decoding, then is prefilled from its tokens with the offline answer;
// a healthy store's document is attached as before; a write to the hung
// store does not hold up the loop either.
#include <chrono>
#include <condition_variable>
#include <map>
#include <mutex>
#include <thread>

#include <gtest/gtest.h>

#include "tests/test_util.h"
#include "tests/worker/stories_shadowkv.h"
#include "worker/engine/engine.h"
#include "worker/service/scheduler.h"

namespace penumbra::service {
namespace {

using ::penumbra::testing::LcgTokens;
using namespace std::chrono_literals;

// Segments in memory. While hung, every call waits until released, then
// fails DeadlineExceeded (as a stopped node's calls do at their deadline).
class HangingStore final : public storage::DocumentStore {
 public:
  void Hang(bool on) {
    std::lock_guard<std::mutex> l(mu_);
    hung_ = on;
    cv_.notify_all();
  }
  // Down: every call fails at once with Unavailable (a node whose breaker is open).
  void Down(bool on) {
    std::lock_guard<std::mutex> l(mu_);
    down_ = on;
  }
  int calls_waiting() const {
    std::lock_guard<std::mutex> l(mu_);
    return waiting_;
  }
  Status Put(const Hash128& key, const std::string& ns, int64_t tokens, const std::map<std::string, std::string>& blobs,
             const std::map<std::string, size_t>&) override {
    PENUMBRA_RETURN_IF_ERROR(Wait());
    std::lock_guard<std::mutex> l(mu_);
    segments_[key.Hex()] = Segment{ns, tokens, blobs};
    return Status::OK();
  }
  Result<std::map<std::string, std::string>> Get(const Hash128& key) override {
    PENUMBRA_RETURN_IF_ERROR(Wait());
    std::lock_guard<std::mutex> l(mu_);
    auto it = segments_.find(key.Hex());
    if (it == segments_.end()) return Status::NotFound("no segment");
    return it->second.blobs;
  }
  Result<std::map<std::string, std::string>> Get(const Hash128& key, const std::set<std::string>& only) override {
    PENUMBRA_ASSIGN_OR_RETURN(auto all, Get(key));
    std::map<std::string, std::string> out;
    for (const auto& n : only) out[n] = all[n];
    return out;
  }
  Result<std::vector<storage::BlobLayout>> Layout(const Hash128&) const override {
    return Status::Unimplemented("layout");
  }
  Result<storage::SegmentInfo> Info(const Hash128& key) const override {
    PENUMBRA_RETURN_IF_ERROR(Wait());
    std::lock_guard<std::mutex> l(mu_);
    auto it = segments_.find(key.Hex());
    if (it == segments_.end()) return Status::NotFound("no segment");
    storage::SegmentInfo i;
    i.cache_namespace = it->second.ns;
    i.tokens = it->second.tokens;
    return i;
  }
  Status Erase(const Hash128& key) override {
    PENUMBRA_RETURN_IF_ERROR(Wait());
    std::lock_guard<std::mutex> l(mu_);
    return segments_.erase(key.Hex()) ? Status::OK() : Status::NotFound("no segment");
  }
  Result<std::shared_ptr<storage::BlobReader>> OpenReader(const Hash128&) override {
    return Status::Unimplemented("readers");
  }

 private:
  struct Segment {
    std::string ns;
    int64_t tokens = 0;
    std::map<std::string, std::string> blobs;
  };
  Status Wait() const {
    std::unique_lock<std::mutex> l(mu_);
    if (down_) return Status::Unavailable("the store node is down");
    if (!hung_) return Status::OK();
    ++waiting_;
    cv_.wait(l, [&] { return !hung_; });
    --waiting_;
    return Status::DeadlineExceeded("the store did not answer");
  }
  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  bool hung_ = false;
  bool down_ = false;
  mutable int waiting_ = 0;
  std::map<std::string, Segment> segments_;
};

class SchedulerStoreIoTest : public ::penumbra::testing::StoriesTest {};

std::unique_ptr<Engine> OpenEngine(std::shared_ptr<storage::DocumentStore> store) {
  EngineOptions o;
  o.backend.device = "cpu";
  o.runtime.prefix_cache_bytes = size_t{64} << 20;
  o.runtime.prefix_store_fetch_whole = true;
  o.document_store = std::move(store);
  auto e = Engine::Open(::penumbra::testing::StoriesDir(), o);
  EXPECT_TRUE(e.ok()) << e.status();
  return e.ok() ? std::move(*e) : nullptr;
}

GenerationRequest Ask(const std::vector<int32_t>& doc, uint64_t seed, int max_new) {
  GenerationRequest r;
  r.prompt = doc;
  r.document_ends = {static_cast<int64_t>(doc.size())};
  const std::vector<int32_t> q = LcgTokens(8, seed, false);
  r.prompt.insert(r.prompt.end(), q.begin(), q.end());
  r.max_new_tokens = max_new;
  return r;
}

TEST_F(SchedulerStoreIoTest, AHungStoreHoldsUpOnlyTheRequestThatNeedsIt) {
  auto store = std::make_shared<HangingStore>();
  const std::vector<int32_t> doc = LcgTokens(96, 5, true);
  std::vector<int32_t> offline;  // the answer computed without any cache
  {
    EngineOptions o;
    o.backend.device = "cpu";
    auto e = Engine::Open(::penumbra::testing::StoriesDir(), o);
    ASSERT_TRUE(e.ok()) << e.status();
    auto r = (*e)->runtime().Generate({Ask(doc, 7, 6)});
    ASSERT_TRUE(r.ok()) << r.status();
    offline = (*r)[0].ids;
  }
  // Engine A stores the document.
  {
    auto a = OpenEngine(store);
    ASSERT_TRUE(a);
    GenerationRequest put;
    put.prompt = doc;
    put.document_ends = {static_cast<int64_t>(doc.size())};
    put.max_new_tokens = 0;
    ASSERT_TRUE(a->runtime().Generate({put}).ok());
    a->runtime().DrainPrefixStores();
    ASSERT_EQ(a->runtime().stats().prefix_stores, 1);
  }
  auto b = OpenEngine(store);  // nothing in memory
  ASSERT_TRUE(b);
  auto s = Scheduler::Create(&b->runtime(), {});
  ASSERT_TRUE(s.ok()) << s.status();
  Scheduler& sched = **s;

  // A long request decodes; the store hangs; a question about the document
  // comes: it waits fetching while the long one keeps making tokens.
  GenerationRequest steady;
  steady.prompt = LcgTokens(8, 3, true);
  steady.max_new_tokens = 480;
  auto long_id = sched.Submit(steady);
  ASSERT_TRUE(long_id.ok());
  store->Hang(true);
  auto q = sched.Submit(Ask(doc, 7, 6));
  ASSERT_TRUE(q.ok());
  // A new document too: its lookup hangs as well, and its capture's write.
  auto w = sched.Submit(Ask(LcgTokens(96, 6, true), 8, 6));
  ASSERT_TRUE(w.ok());
  const auto until = std::chrono::steady_clock::now() + 20s;
  while (store->calls_waiting() < 2 && std::chrono::steady_clock::now() < until) std::this_thread::sleep_for(5ms);
  ASSERT_EQ(store->calls_waiting(), 2);  // both lookups, on the I/O threads
  EXPECT_EQ(sched.stats().fetching, 2);
  auto at = sched.Poll(*long_id, 0, 0ms);
  ASSERT_TRUE(at.ok());
  const int64_t before = at->generated_tokens;
  auto later = sched.Poll(*long_id, 0, 0ms);
  for (int i = 0; i < 200 && later.ok() && !later->done && later->generated_tokens < before + 20; ++i) {
    std::this_thread::sleep_for(10ms);
    later = sched.Poll(*long_id, 0, 0ms);
  }
  ASSERT_TRUE(later.ok());
  EXPECT_GE(later->generated_tokens, std::min<int64_t>(before + 20, 480))
      << "the batch stopped decoding while the store hung";
  auto waiting = sched.Poll(*q, 0, 0ms);
  ASSERT_TRUE(waiting.ok());
  EXPECT_FALSE(waiting->done);
  EXPECT_LT(waiting->queue_seconds, 0);  // not admitted: fetching

  // The store fails them (their deadline): both prefilled, the offline answer.
  store->Hang(false);
  auto qa = sched.Wait(*q);
  ASSERT_TRUE(qa.ok());
  EXPECT_EQ(qa->finish_reason, "length");
  EXPECT_EQ(qa->cached_prompt_tokens, 0);
  EXPECT_EQ(qa->ids, offline);
  auto wa = sched.Wait(*w);
  ASSERT_TRUE(wa.ok());
  EXPECT_EQ(wa->finish_reason, "length");
  EXPECT_EQ(b->runtime().stats().prefix_store_fetch_failures, 2);
  // The new document's capture was written in the background.
  b->runtime().DrainPrefixStores();
  EXPECT_EQ(b->runtime().stats().prefix_stores, 2);  // the question's document and the new one

  // A healthy store: a fresh engine attaches the document (read off the loop).
  auto c = OpenEngine(store);
  ASSERT_TRUE(c);
  auto s2 = Scheduler::Create(&c->runtime(), {});
  ASSERT_TRUE(s2.ok());
  auto q2 = (*s2)->Submit(Ask(doc, 7, 6));
  ASSERT_TRUE(q2.ok());
  auto a2 = (*s2)->Wait(*q2);
  ASSERT_TRUE(a2.ok());
  EXPECT_EQ(a2->cached_prompt_tokens, static_cast<int64_t>(doc.size()));
  EXPECT_EQ(a2->ids, offline);
  EXPECT_EQ(c->runtime().stats().prefix_store_hits, 1);
  sched.Stop();
  (*s2)->Stop();
}

}  // namespace
}  // namespace penumbra::service

namespace penumbra::service {
namespace {

// A deleted document is forgotten only when its stored state is known to be
// gone: with the store down, ForgetPrefixes fails (the coordinator keeps its
// tombstone and asks again), and once the store answers it erases it.
TEST_F(SchedulerStoreIoTest, AForgetThatCannotReachTheStoreFailsAndSucceedsLater) {
  auto store = std::make_shared<HangingStore>();
  auto e = OpenEngine(store);
  ASSERT_TRUE(e);
  const std::vector<int32_t> doc = LcgTokens(96, 11, true);
  GenerationRequest put;
  put.prompt = doc;
  put.document_ends = {static_cast<int64_t>(doc.size())};
  put.max_new_tokens = 0;
  ASSERT_TRUE(e->runtime().Generate({put}).ok());
  e->runtime().DrainPrefixStores();
  ASSERT_EQ(e->runtime().stats().prefix_stores, 1);

  store->Down(true);
  Result<int> down = e->runtime().ForgetPrefixes(put);
  ASSERT_FALSE(down.ok());
  EXPECT_EQ(down.status().code(), StatusCode::kUnavailable) << down.status();
  EXPECT_NE(down.status().message().find("not erased"), std::string::npos) << down.status();

  store->Down(false);
  Result<int> up = e->runtime().ForgetPrefixes(put);
  ASSERT_TRUE(up.ok()) << up.status();
  EXPECT_EQ(*up, 1);  // the stored copy (the cached one went at the first try)
  Result<int> again = e->runtime().ForgetPrefixes(put);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(*again, 0);  // nothing left anywhere
}

}  // namespace
}  // namespace penumbra::service
