// What the service tests share beyond the cluster (service_cluster.h): the
// offline engine's answers to compare with, and the client calls the tests
// make (a question, a put, following a stream to its end).
#pragma once

#include <gtest/gtest.h>

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "coordinator/client/client.h"
#include "tests/worker/stories_shadowkv.h"
#include "worker/engine/engine.h"

namespace penumbra::testing {

// The offline engine's greedy (or seeded) answer: the same model and
// options as the worker, one request alone.
class Offline {
 public:
  explicit Offline(const std::string& policy = "full")
      : Offline([&] {
          EngineOptions o = policy == "full" ? EngineOptions{} : LossyShadowKvOptions();
          o.kv_policy = policy;
          return o;
        }()) {}
  // With these engine options (on the CPU).
  explicit Offline(EngineOptions o) {
    o.backend.device = "cpu";
    auto e = Engine::Open(StoriesDir(), o);
    EXPECT_TRUE(e.ok()) << e.status();
    if (e.ok()) engine_ = std::move(*e);
  }
  std::vector<int32_t> Answer(const GenerationRequest& r) {
    std::lock_guard<std::mutex> lk(mu_);
    if (!engine_) return {};
    auto res = engine_->runtime().Generate({r});
    EXPECT_TRUE(res.ok()) << res.status();
    return res.ok() ? (*res)[0].ids : std::vector<int32_t>{};
  }
  // The request of a question about one document ("": none), greedy unless
  // `sampling` says otherwise.
  static GenerationRequest Request(const std::vector<int32_t>& doc, const std::vector<int32_t>& question, int max_new,
                                   const SamplingOptions& sampling = {}) {
    GenerationRequest g;
    g.prompt = doc;
    if (!doc.empty()) g.document_ends = {static_cast<int64_t>(doc.size())};
    g.prompt.insert(g.prompt.end(), question.begin(), question.end());
    g.max_new_tokens = max_new;
    g.sampling = sampling;
    return g;
  }
  // Its answer.
  std::vector<int32_t> About(const std::vector<int32_t>& doc, const std::vector<int32_t>& question, int max_new,
                             const SamplingOptions& sampling = {}) {
    return Answer(Request(doc, question, max_new, sampling));
  }

 private:
  std::mutex mu_;
  std::unique_ptr<Engine> engine_;
};

// Whether the coordinator's health check has marked worker `name` (w0, w1,
// ...) down: its Stats list the worker unhealthy.
inline bool MarkedDown(client::Client& c, const std::string& name) {
  auto s = c.Stats();
  if (!s.ok()) return false;
  for (const rpc::WorkerStatus& w : s->workers) {
    if (w.name == name) return !w.healthy;
  }
  return false;
}

inline rpc::GenerateRequest Ask(const std::vector<std::string>& docs, const std::vector<int32_t>& question,
                                int max_new) {
  rpc::GenerateRequest r;
  r.document_ids = docs;
  r.__set_token_ids(question);
  r.max_new_tokens = max_new;
  r.ignore_eos = true;
  return r;
}

// Long polls until done; every chunk's ids continue the previous ones.
inline rpc::GenerateChunk Follow(client::Client& c, const std::string& id, std::vector<int32_t>* ids = nullptr) {
  int64_t offset = 0;
  for (int i = 0; i < 10000; ++i) {
    auto ch = c.Poll(id, offset, 2000);
    EXPECT_TRUE(ch.ok()) << ch.status();
    if (!ch.ok()) return {};
    EXPECT_EQ(ch->offset, offset);
    if (ids) ids->insert(ids->end(), ch->ids.begin(), ch->ids.end());
    offset += static_cast<int64_t>(ch->ids.size());
    if (ch->done) return *ch;
  }
  ADD_FAILURE() << "request " << id << " never ended";
  return {};
}

inline rpc::DocumentInfo Put(client::Client& c, const std::string& name, const std::vector<int32_t>& ids) {
  auto d = c.PutDocument(name, nullptr, &ids);
  EXPECT_TRUE(d.ok()) << d.status();
  if (!d.ok()) return {};
  EXPECT_EQ(d->state, rpc::DocumentState::READY) << (d->__isset.error ? d->error : "");
  EXPECT_EQ(d->tokens, static_cast<int64_t>(ids.size()));
  return *d;
}

}  // namespace penumbra::testing
