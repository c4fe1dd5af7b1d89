// DocumentRegistry (coordinator/server/document_registry.h), model-based: a
// long random sequence of adds, gets, lists (paged), state changes and
// removes across three tenants, each checked against a plain map; plus the
// limits and the malformed page token.
#include <map>
#include <random>
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "coordinator/server/document_registry.h"

namespace penumbra::coordinator {
namespace {

struct ModelDoc {
  std::string tenant, name;
  std::vector<int32_t> ids;
  DocumentState state = DocumentState::kFactoring;
  std::set<int> workers;
};

TEST(DocumentRegistry, MatchesAModelUnderRandomOperations) {
  constexpr int kMaxPerTenant = 40;
  DocumentRegistry reg(kMaxPerTenant);
  std::map<std::string, ModelDoc> model;  // by id
  std::mt19937_64 rng(17);
  const std::vector<std::string> tenants = {"alice", "bob", "carol"};
  auto count = [&](const std::string& t) {
    int n = 0;
    for (const auto& [id, d] : model) n += d.tenant == t;
    return n;
  };
  auto some_id = [&]() -> std::string {
    if (model.empty() || rng() % 8 == 0) return "doc-00000000000000aa";  // unknown
    auto it = model.begin();
    std::advance(it, rng() % model.size());
    return it->first;
  };
  for (int step = 0; step < 4000; ++step) {
    const std::string& t = tenants[rng() % tenants.size()];
    switch (rng() % 6) {
      case 0: {  // add
        std::vector<int32_t> ids(1 + rng() % 20);
        for (auto& x : ids) x = static_cast<int32_t>(rng() % 1000);
        Result<DocumentView> d = reg.Add(t, "n" + std::to_string(step), ids);
        if (count(t) >= kMaxPerTenant) {
          ASSERT_EQ(d.status().code(), StatusCode::kResourceExhausted);
        } else {
          ASSERT_TRUE(d.ok()) << d.status();
          ASSERT_EQ(model.count(d->id), 0u) << "an id handed out twice";
          ModelDoc m;
          m.tenant = t;
          m.name = "n" + std::to_string(step);
          m.ids = ids;
          model[d->id] = m;
          EXPECT_EQ(*d->ids, ids);
        }
        break;
      }
      case 1: {  // get (any tenant: another's is NotFound)
        const std::string id = some_id();
        Result<DocumentView> d = reg.Get(t, id);
        auto m = model.find(id);
        if (m == model.end() || m->second.tenant != t) {
          ASSERT_EQ(d.status().code(), StatusCode::kNotFound);
        } else {
          ASSERT_TRUE(d.ok());
          EXPECT_EQ(d->name, m->second.name);
          EXPECT_EQ(*d->ids, m->second.ids);
          EXPECT_EQ(d->state, m->second.state);
          EXPECT_EQ(d->workers, m->second.workers);
        }
        break;
      }
      case 2: {  // list every page
        const int page = 1 + static_cast<int>(rng() % 7);
        std::vector<std::string> got;
        std::string token;
        for (int guard = 0; guard < 1000; ++guard) {
          Result<DocumentPage> p = reg.List(t, token, page);
          ASSERT_TRUE(p.ok()) << p.status();
          ASSERT_LE(static_cast<int>(p->documents.size()), page);
          for (const auto& d : p->documents) got.push_back(d.id);
          if (p->next_page_token.empty()) break;
          token = p->next_page_token;
        }
        std::vector<std::string> want;
        for (const auto& [id, d] : model) {
          if (d.tenant == t) want.push_back(id);
        }
        EXPECT_EQ(got, want);  // each once, in id order
        break;
      }
      case 3: {  // remove (another tenant's: NotFound, nothing removed)
        const std::string id = some_id();
        Result<DocumentView> d = reg.Remove(t, id);
        auto m = model.find(id);
        if (m == model.end() || m->second.tenant != t) {
          ASSERT_EQ(d.status().code(), StatusCode::kNotFound);
        } else {
          ASSERT_TRUE(d.ok());
          model.erase(m);
        }
        break;
      }
      case 4: {  // factoring ends
        const std::string id = some_id();
        const int w = static_cast<int>(rng() % 3);
        auto m = model.find(id);
        if (rng() % 4 == 0) {
          ASSERT_TRUE(reg.SetFailed(id, Status::Internal("boom")).ok());
          if (m != model.end()) m->second.state = DocumentState::kFailed;
        } else {
          ASSERT_TRUE(reg.SetReady(id, w, 1.5).ok());
          if (m != model.end()) {
            m->second.state = DocumentState::kReady;
            m->second.workers.insert(w);
          }
        }
        break;
      }
      case 5: {  // a generation placed it on a worker
        const std::string id = some_id();
        const int w = static_cast<int>(rng() % 3);
        reg.AddWorker(id, w);
        auto m = model.find(id);
        if (m != model.end()) m->second.workers.insert(w);
        break;
      }
    }
    ASSERT_EQ(reg.count(), static_cast<int64_t>(model.size()));
    ASSERT_EQ(reg.count(t), count(t));
  }
  std::map<int, int64_t> held;
  for (const auto& [id, d] : model) {
    for (int w : d.workers) ++held[w];
  }
  EXPECT_EQ(reg.held_per_worker(), held);
}

TEST(DocumentRegistry, RefusesAMalformedPageToken) {
  DocumentRegistry reg(10);
  EXPECT_EQ(reg.List("t", "garbage", 10).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(reg.List("t", "doc-0123456789ABCDEF", 10).status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(reg.List("t", "doc-0123456789abcdef", 10).ok());  // well formed, past every id
}

}  // namespace
}  // namespace penumbra::coordinator
