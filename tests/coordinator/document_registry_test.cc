// DocumentRegistry (coordinator/server/document_registry.h), model-based: a
// long random sequence of adds, gets, lists (paged), state changes and
// removes across three tenants, each checked against a plain map; plus the
// limits and the malformed page token; and MatchPrefix (automatic document
// reuse) against a brute-force search over every document.
#include <algorithm>
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

// MatchPrefix against a brute force over every document: documents that
// share long beginnings (past the index's 16 tokens), are prefixes of each
// other, have a leading special token or none, are factoring, failed or
// removed, of three tenants; prompts built from chains of them and a tail.
TEST(DocumentRegistry, MatchPrefixFindsWhatABruteForceFinds) {
  DocumentRegistry reg(1000);
  std::mt19937_64 rng(29);
  const std::vector<std::string> tenants = {"alice", "bob", "carol"};
  struct Doc {
    std::string id, tenant;
    std::vector<int32_t> ids;
    int64_t leading_special = 0;
    bool ready = false, removed = false;
  };
  std::vector<Doc> docs;
  const std::vector<int32_t> common(40, 7);  // a long shared beginning
  for (int i = 0; i < 120; ++i) {
    Doc d;
    d.tenant = tenants[rng() % 3];
    d.leading_special = rng() % 2;
    if (d.leading_special) d.ids.push_back(1);  // a BOS
    if (i > 0 && rng() % 4 == 0) {
      // An extension of an earlier document (which is then its prefix).
      const Doc& base = docs[rng() % docs.size()];
      d.ids = base.ids;
      d.leading_special = base.leading_special;
    } else if (rng() % 3 == 0) {
      d.ids.insert(d.ids.end(), common.begin(), common.begin() + 1 + rng() % common.size());
    }
    for (size_t n = 1 + rng() % 30; n > 0; --n) d.ids.push_back(static_cast<int32_t>(2 + rng() % 6));
    Result<DocumentView> v = reg.Add(d.tenant, "d", d.ids, d.leading_special);
    ASSERT_TRUE(v.ok()) << v.status();
    d.id = v->id;
    switch (rng() % 5) {
      case 0:
        break;  // factoring
      case 1:
        ASSERT_TRUE(reg.SetFailed(d.id, Status::Internal("x")).ok());
        break;
      default:
        ASSERT_TRUE(reg.SetReady(d.id, 0, 1.0).ok());
        d.ready = true;
    }
    if (rng() % 10 == 0) {
      ASSERT_TRUE(reg.Remove(d.tenant, d.id).ok());
      d.removed = true;
    }
    docs.push_back(std::move(d));
  }
  auto form = [](const Doc& d, bool first) {
    return std::vector<int32_t>(d.ids.begin() + (first ? 0 : d.leading_special), d.ids.end());
  };
  auto brute = [&](const std::string& tenant, const std::vector<int32_t>& prompt, size_t max_docs) {
    std::vector<std::string> out;
    size_t pos = 0;
    while (out.size() < max_docs) {
      const Doc* best = nullptr;
      size_t best_len = 0;
      for (const Doc& d : docs) {
        if (d.tenant != tenant || !d.ready || d.removed) continue;
        const std::vector<int32_t> f = form(d, out.empty());
        if (f.empty() || f.size() <= best_len || pos + f.size() >= prompt.size()) continue;
        if (std::equal(f.begin(), f.end(), prompt.begin() + static_cast<ptrdiff_t>(pos))) {
          best = &d;
          best_len = f.size();
        }
      }
      if (!best) break;
      out.push_back(best->id);
      pos += best_len;
    }
    return std::make_pair(out, static_cast<int64_t>(pos));
  };
  int matched = 0, chains = 0;
  for (int trial = 0; trial < 3000; ++trial) {
    const std::string& t = tenants[rng() % 3];
    std::vector<int32_t> prompt;
    for (int n = static_cast<int>(rng() % 4); n > 0; --n) {
      const Doc& d = docs[rng() % docs.size()];
      const std::vector<int32_t> f = form(d, prompt.empty());
      prompt.insert(prompt.end(), f.begin(), f.end());
    }
    for (size_t n = rng() % 4; n > 0; --n) prompt.push_back(static_cast<int32_t>(2 + rng() % 6));
    const size_t max_docs = 1 + rng() % 3;
    int64_t consumed = -1;
    std::vector<DocumentView> got = reg.MatchPrefix(t, prompt, max_docs, &consumed);
    const auto [want, want_consumed] = brute(t, prompt, max_docs);
    std::vector<std::string> got_ids;
    for (const DocumentView& d : got) got_ids.push_back(d.id);
    ASSERT_EQ(got_ids, want) << "trial " << trial;
    ASSERT_EQ(consumed, want_consumed) << "trial " << trial;
    matched += !got.empty();
    chains += got.size() > 1;
  }
  // The search is exercised, not hoped for.
  EXPECT_GT(matched, 300);
  EXPECT_GT(chains, 30);
}

TEST(DocumentRegistry, RefusesAMalformedPageToken) {
  DocumentRegistry reg(10);
  EXPECT_EQ(reg.List("t", "garbage", 10).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(reg.List("t", "doc-0123456789ABCDEF", 10).status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(reg.List("t", "doc-0123456789abcdef", 10).ok());  // well formed, past every id
}

}  // namespace
}  // namespace penumbra::coordinator
