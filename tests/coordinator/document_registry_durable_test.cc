// DocumentRegistry::Open (coordinator/server/document_registry.h), the
// durable registry, with real RocksDB directories:
//  - model-based: random adds, readies, failures, removes, worker changes,
//    gets, paged lists and reopens, compared after every step with a plain
//    map whose rule is "a reopen keeps the READY documents, with no workers";
//  - concurrent readies, failures and removes of the same documents leave
//    on disk exactly what memory shows READY;
//  - a damaged record is skipped and counted at Open; per-tenant counts
//    are rebuilt at Open; Open's errors name the path.
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "coordinator/server/document_registry.h"
#include "tests/storage/segment_store_test_util.h"

namespace penumbra::coordinator {
namespace {

using storage::testing::TempDir;

std::unique_ptr<DocumentRegistry> OpenOrDie(const std::string& path, int64_t max_per_tenant) {
  auto r = DocumentRegistry::Open(path, max_per_tenant);
  CHECK(r.ok()) << r.status();
  return std::move(r).value();
}

struct ModelDoc {
  std::string tenant, name;
  std::vector<int32_t> ids;
  int64_t leading_special = 0;
  int64_t created_unix_ms = 0;
  DocumentState state = DocumentState::kFactoring;
  StatusCode error_code = StatusCode::kOk;
  double factor_seconds = -1;
  std::set<int> workers;
};

// Every tenant's documents (listed in pages of `page`), each field, the
// counts and the workers' holdings equal the model's.
::testing::AssertionResult Matches(const DocumentRegistry& reg, const std::map<std::string, ModelDoc>& model,
                                   const std::vector<std::string>& tenants, int page) {
  for (const std::string& t : tenants) {
    std::vector<DocumentView> got;
    std::string token;
    for (int guard = 0;; ++guard) {
      if (guard > 1000) return ::testing::AssertionFailure() << "List of " << t << " does not end";
      Result<DocumentPage> p = reg.List(t, token, page);
      if (!p.ok()) return ::testing::AssertionFailure() << "List of " << t << ": " << p.status();
      if (static_cast<int>(p->documents.size()) > page) return ::testing::AssertionFailure() << "page too long";
      for (auto& d : p->documents) got.push_back(std::move(d));
      if (p->next_page_token.empty()) break;
      token = p->next_page_token;
    }
    std::vector<std::pair<std::string, const ModelDoc*>> want;
    for (const auto& [id, m] : model) {
      if (m.tenant == t) want.emplace_back(id, &m);
    }
    if (got.size() != want.size()) {
      return ::testing::AssertionFailure()
             << t << ": " << got.size() << " documents listed, the model has " << want.size();
    }
    for (size_t i = 0; i < got.size(); ++i) {
      const DocumentView& d = got[i];
      const ModelDoc& m = *want[i].second;
      auto bad = [&](const char* field) {
        return ::testing::AssertionFailure()
               << t << ": document " << d.id << " (model " << want[i].first << "): " << field << " differs";
      };
      if (d.id != want[i].first) return bad("id");
      if (d.tenant != t) return bad("tenant");
      if (d.name != m.name) return bad("name");
      if (!d.ids || *d.ids != m.ids) return bad("token ids");
      if (d.tokens != static_cast<int64_t>(m.ids.size())) return bad("tokens");
      if (d.leading_special != m.leading_special) return bad("leading_special");
      if (d.created_unix_ms != m.created_unix_ms) return bad("created_unix_ms");
      if (d.state != m.state) return bad("state");
      if (d.workers != m.workers) return bad("workers");
      if (m.state == DocumentState::kReady) {
        if (d.factor_seconds != m.factor_seconds) return bad("factor_seconds");
        if (d.factored_tokens != d.tokens) return bad("factored_tokens");
      }
      if (m.state == DocumentState::kFailed && d.error_code != m.error_code) return bad("error_code");
      Result<DocumentView> g = reg.Get(t, d.id);
      if (!g.ok() || g->state != d.state || *g->ids != *d.ids) return bad("Get");
    }
    if (reg.count(t) != static_cast<int64_t>(want.size())) {
      return ::testing::AssertionFailure() << t << ": count " << reg.count(t) << ", the model has " << want.size();
    }
  }
  if (reg.count() != static_cast<int64_t>(model.size())) {
    return ::testing::AssertionFailure() << "count " << reg.count() << ", the model has " << model.size();
  }
  std::map<int, int64_t> held;
  for (const auto& [id, m] : model) {
    for (int w : m.workers) ++held[w];
  }
  if (reg.held_per_worker() != held) return ::testing::AssertionFailure() << "held_per_worker differs";
  return ::testing::AssertionSuccess();
}

void RunModel(uint64_t seed, int steps) {
  SCOPED_TRACE("seed " + std::to_string(seed));
  constexpr int kMaxPerTenant = 12;
  TempDir dir;
  const std::string path = dir.path() + "/registry";  // created by Open
  std::unique_ptr<DocumentRegistry> reg = OpenOrDie(path, kMaxPerTenant);
  std::map<std::string, ModelDoc> model;
  std::mt19937_64 rng(seed);
  const std::vector<std::string> tenants = {"alice", "bob", "carol and co"};
  int reopens = 0, readies = 0;
  auto tenant_count = [&](const std::string& t) {
    int64_t n = 0;
    for (const auto& [id, m] : model) n += m.tenant == t;
    return n;
  };
  auto some_id = [&]() -> std::string {
    if (model.empty() || rng() % 10 == 0) return "doc-00000000000000aa";  // unknown
    auto it = model.begin();
    std::advance(it, rng() % model.size());
    return it->first;
  };
  for (int step = 0; step < steps; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    const std::string& t = tenants[rng() % tenants.size()];
    const uint64_t op = rng() % 1000;
    if (op < 250) {  // add
      std::vector<int32_t> ids(rng() % 300);
      for (auto& x : ids) x = static_cast<int32_t>(rng());  // any int32, negative ones too
      const int64_t leading = std::min<int64_t>(static_cast<int64_t>(rng() % 3), static_cast<int64_t>(ids.size()));
      const std::string name = "n" + std::to_string(step) + (step % 7 == 0 ? std::string("\0\xff", 2) : "");
      Result<DocumentView> d = reg->Add(t, name, ids, leading);
      if (tenant_count(t) >= kMaxPerTenant) {
        ASSERT_EQ(d.status().code(), StatusCode::kResourceExhausted);
      } else {
        ASSERT_TRUE(d.ok()) << d.status();
        ASSERT_EQ(model.count(d->id), 0u) << "an id handed out twice";
        ModelDoc& m = model[d->id];
        m.tenant = t;
        m.name = name;
        m.ids = ids;
        m.leading_special = leading;
        m.created_unix_ms = d->created_unix_ms;
      }
    } else if (op < 400) {  // factored
      const std::string id = some_id();
      const int w = static_cast<int>(rng() % 4);
      const double secs = 0.125 * static_cast<double>(step);
      ASSERT_TRUE(reg->SetReady(id, w, secs).ok());
      ++readies;
      if (auto m = model.find(id); m != model.end()) {
        m->second.state = DocumentState::kReady;
        m->second.factor_seconds = secs;
        m->second.workers.insert(w);
      }
    } else if (op < 460) {  // failed (a READY one too: its record goes)
      const std::string id = some_id();
      ASSERT_TRUE(reg->SetFailed(id, Status::Unavailable("no healthy worker")).ok());
      if (auto m = model.find(id); m != model.end()) {
        m->second.state = DocumentState::kFailed;
        m->second.error_code = StatusCode::kUnavailable;
      }
    } else if (op < 610) {  // remove (another tenant's: NotFound, nothing removed)
      const std::string id = some_id();
      Result<DocumentView> d = reg->Remove(t, id);
      auto m = model.find(id);
      if (m == model.end() || m->second.tenant != t) {
        ASSERT_EQ(d.status().code(), StatusCode::kNotFound);
      } else {
        ASSERT_TRUE(d.ok()) << d.status();
        ASSERT_EQ(*d->ids, m->second.ids);
        model.erase(m);
      }
    } else if (op < 730) {  // a generation placed it on a worker
      const std::string id = some_id();
      const int w = static_cast<int>(rng() % 4);
      reg->AddWorker(id, w);
      if (auto m = model.find(id); m != model.end()) m->second.workers.insert(w);
    } else if (op < 830) {  // get, as some tenant
      const std::string id = some_id();
      Result<DocumentView> d = reg->Get(t, id);
      auto m = model.find(id);
      if (m == model.end() || m->second.tenant != t) {
        ASSERT_EQ(d.status().code(), StatusCode::kNotFound);
      } else {
        ASSERT_TRUE(d.ok()) << d.status();
      }
    } else if (op < 975) {  // list in small pages (compared below)
      ASSERT_TRUE(Matches(*reg, model, {t}, 1 + static_cast<int>(rng() % 5)));
    } else {  // restart: READY documents stay, with no workers
      reg.reset();
      reg = OpenOrDie(path, kMaxPerTenant);
      ++reopens;
      for (auto it = model.begin(); it != model.end();) {
        if (it->second.state != DocumentState::kReady) {
          it = model.erase(it);
          continue;
        }
        it->second.workers.clear();
        ++it;
      }
      ASSERT_EQ(reg->corrupt_records(), 0);
    }
    ASSERT_TRUE(Matches(*reg, model, tenants, 1000));
    ASSERT_EQ(reg->persist_errors(), 0);
  }
  // A last restart, always.
  reg.reset();
  reg = OpenOrDie(path, kMaxPerTenant);
  std::erase_if(model, [](const auto& kv) { return kv.second.state != DocumentState::kReady; });
  for (auto& [id, m] : model) m.workers.clear();
  ASSERT_TRUE(Matches(*reg, model, tenants, 1000));
  EXPECT_GT(reopens, 10);
  EXPECT_GT(readies, steps / 10);  // about 15% of the steps
}

TEST(DocumentRegistryDurable, MatchesAModelAcrossReopens) {
  // Each reopen costs RocksDB some fsyncs (~60 ms here), each stored change
  // one (~4 ms): 4 x 800 steps, ~80 reopens, stay under ~10 s.
  for (uint64_t seed : {1, 2, 3, 4}) {
    RunModel(seed, 800);
    if (HasFatalFailure()) return;
  }
}

// Threads ready, fail and remove the same documents at once: whatever order
// the calls took, the records on disk are exactly the READY documents in
// memory when the writes are done.
TEST(DocumentRegistryDurable, ConcurrentChangesLeaveOnDiskWhatMemoryShows) {
  TempDir dir;
  std::unique_ptr<DocumentRegistry> reg = OpenOrDie(dir.path(), 100000);
  std::vector<std::string> ids;
  for (int i = 0; i < 200; ++i) {
    Result<DocumentView> d = reg->Add("t", "d" + std::to_string(i), {i, i + 1, i + 2});
    ASSERT_TRUE(d.ok()) << d.status();
    ids.push_back(d->id);
  }
  std::vector<std::thread> threads;
  for (int k = 0; k < 4; ++k) {
    threads.emplace_back([&, k] {
      std::mt19937_64 rng(k);
      for (int i = 0; i < 150; ++i) {
        const std::string& id = ids[rng() % ids.size()];
        switch (rng() % 5) {
          case 0:
            (void)reg->Remove("t", id);
            break;
          case 1:
            ASSERT_TRUE(reg->SetFailed(id, Status::Internal("boom")).ok());
            break;
          default:
            ASSERT_TRUE(reg->SetReady(id, k, 1.0).ok());
            break;
        }
        (void)reg->List("t", "", 1000);  // readers run meanwhile
      }
    });
  }
  for (auto& th : threads) th.join();
  std::map<std::string, std::vector<int32_t>> ready;
  Result<DocumentPage> before = reg->List("t", "", 1000);
  ASSERT_TRUE(before.ok());
  for (const auto& d : before->documents) {
    if (d.state == DocumentState::kReady) ready[d.id] = *d.ids;
  }
  ASSERT_EQ(reg->persist_errors(), 0);
  reg.reset();
  reg = OpenOrDie(dir.path(), 100000);
  Result<DocumentPage> after = reg->List("t", "", 1000);
  ASSERT_TRUE(after.ok());
  std::map<std::string, std::vector<int32_t>> stored;
  for (const auto& d : after->documents) stored[d.id] = *d.ids;
  EXPECT_EQ(stored, ready);
  EXPECT_GT(ready.size(), 0u);
  EXPECT_LT(ready.size(), ids.size());
}

TEST(DocumentRegistryDurable, ADamagedRecordIsSkippedAndCounted) {
  TempDir dir;
  std::string damaged, kept;
  {
    std::unique_ptr<DocumentRegistry> reg = OpenOrDie(dir.path(), 10);
    for (std::string* id : {&damaged, &kept}) {
      Result<DocumentView> d = reg->Add("t", "x", {1, 2, 3});
      ASSERT_TRUE(d.ok());
      *id = d->id;
      ASSERT_TRUE(reg->SetReady(*id, 0, 2.5).ok());
    }
    Result<DocumentView> factoring = reg->Add("t", "y", {4});
    ASSERT_TRUE(factoring.ok());
    EXPECT_EQ(reg->CorruptRecordForTest(factoring->id).code(), StatusCode::kNotFound);  // never stored
    ASSERT_TRUE(reg->CorruptRecordForTest(damaged).ok());
    EXPECT_EQ(reg->corrupt_records(), 0);  // counted when read, at Open
  }
  std::unique_ptr<DocumentRegistry> reg = OpenOrDie(dir.path(), 10);
  EXPECT_EQ(reg->corrupt_records(), 1);
  EXPECT_EQ(reg->Get("t", damaged).status().code(), StatusCode::kNotFound);
  Result<DocumentView> k = reg->Get("t", kept);
  ASSERT_TRUE(k.ok()) << k.status();
  EXPECT_EQ(*k->ids, (std::vector<int32_t>{1, 2, 3}));
  EXPECT_EQ(k->state, DocumentState::kReady);
  EXPECT_TRUE(k->workers.empty());
  EXPECT_EQ(k->factor_seconds, 2.5);
  EXPECT_EQ(reg->count("t"), 1);
  // Still skipped (and counted) at every Open until a new record replaces it.
  reg.reset();
  reg = OpenOrDie(dir.path(), 10);
  EXPECT_EQ(reg->corrupt_records(), 1);
  EXPECT_EQ(reg->count(), 1);
}

// A document's KV policy pin survives a reopen; a record of format version 1
// (before the pin existed) is still read, with no pin.
TEST(DocumentRegistryDurable, APinSurvivesAReopenAndOldRecordsAreRead) {
  TempDir dir;
  std::string pinned, old;
  {
    std::unique_ptr<DocumentRegistry> reg = OpenOrDie(dir.path(), 10);
    Result<DocumentView> p = reg->Add("t", "p", {1, 2, 3}, 0, "shadowkv");
    ASSERT_TRUE(p.ok());
    EXPECT_EQ(p->kv_policy, "shadowkv");
    pinned = p->id;
    Result<DocumentView> o = reg->Add("t", "o", {4, 5}, 1, "full");
    ASSERT_TRUE(o.ok());
    old = o->id;
    ASSERT_TRUE(reg->SetReady(pinned, 0, 1.5).ok());
    ASSERT_TRUE(reg->SetReady(old, 0, 2.5).ok());
    ASSERT_TRUE(reg->RewriteRecordAsVersion1ForTest(old).ok());
  }
  std::unique_ptr<DocumentRegistry> reg = OpenOrDie(dir.path(), 10);
  EXPECT_EQ(reg->corrupt_records(), 0);
  Result<DocumentView> p = reg->Get("t", pinned);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->kv_policy, "shadowkv");
  Result<DocumentView> o = reg->Get("t", old);
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->kv_policy, "");
  EXPECT_EQ(*o->ids, (std::vector<int32_t>{4, 5}));
  EXPECT_EQ(o->leading_special, 1);
  EXPECT_EQ(o->factor_seconds, 2.5);
}

TEST(DocumentRegistryDurable, OpenErrorsNameThePath) {
  TempDir dir;
  EXPECT_EQ(DocumentRegistry::Open("", 10).status().code(), StatusCode::kInvalidArgument);
  const std::string file = dir.path() + "/a-file";
  std::ofstream(file) << "not a directory";
  Result<std::unique_ptr<DocumentRegistry>> r = DocumentRegistry::Open(file, 10);
  ASSERT_EQ(r.status().code(), StatusCode::kIOError);
  EXPECT_NE(r.status().message().find(file), std::string::npos) << r.status();
  // One process, one holder: a second Open of a directory in use fails.
  const std::string path = dir.path() + "/a/b/registry";  // created, every level
  std::unique_ptr<DocumentRegistry> first = OpenOrDie(path, 10);
  r = DocumentRegistry::Open(path, 10);
  ASSERT_EQ(r.status().code(), StatusCode::kIOError);
  EXPECT_NE(r.status().message().find(path), std::string::npos) << r.status();
}

TEST(DocumentRegistryDurable, InMemoryStoresNothing) {
  DocumentRegistry reg(10);
  Result<DocumentView> d = reg.Add("t", "x", {1});
  ASSERT_TRUE(d.ok());
  ASSERT_TRUE(reg.SetReady(d->id, 0, 1.0).ok());
  EXPECT_EQ(reg.CorruptRecordForTest(d->id).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(reg.persist_errors(), 0);
  EXPECT_EQ(reg.corrupt_records(), 0);
}

// Per-tenant counts are rebuilt at Open: the limit holds across a restart.
TEST(DocumentRegistryDurable, TheLimitHoldsAcrossARestart) {
  TempDir dir;
  {
    std::unique_ptr<DocumentRegistry> reg = OpenOrDie(dir.path(), 3);
    for (int i = 0; i < 3; ++i) {
      Result<DocumentView> d = reg->Add("t", "x", {i});
      ASSERT_TRUE(d.ok());
      ASSERT_TRUE(reg->SetReady(d->id, 0, 1.0).ok());
    }
  }
  std::unique_ptr<DocumentRegistry> reg = OpenOrDie(dir.path(), 3);
  EXPECT_EQ(reg->count("t"), 3);
  EXPECT_EQ(reg->Add("t", "x", {9}).status().code(), StatusCode::kResourceExhausted);
  EXPECT_TRUE(reg->Add("u", "x", {9}).ok());
}

}  // namespace
}  // namespace penumbra::coordinator
