// The public API's request validation (coordinator/server/validation.h):
// every bound refuses with INVALID_ARGUMENT naming the field and the limit;
// a list's length is checked before its elements (so an attacker's 10
// million stop ids or 20,000 document ids cost one comparison); values at a
// limit pass; deadlines past a week (the 1e13) are refused; jobs'
// bounds (items, metadata, custom_ids, window) and every item's request are
// checked, an item's error naming it; random requests that pass keep every
// promise the coordinator relies on.
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "coordinator/server/validation.h"

namespace penumbra::coordinator {
namespace {

ModelLimits Model() {
  ModelLimits m;
  m.vocab_size = 1000;
  m.max_context = 4096;
  m.can_encode = true;
  m.can_decode = true;
  return m;
}

rpc::GenerateRequest Ok() {
  rpc::GenerateRequest r;
  r.document_ids = {"doc-0000000000000001", "doc-0000000000000002"};
  r.__set_token_ids({1, 2, 3});
  r.max_new_tokens = 16;
  r.stop = {"\n\n"};
  r.stop_ids = {7};
  return r;
}

// `s` is INVALID_ARGUMENT and names every one of `words`.
void ExpectRefused(const Status& s, const std::vector<std::string>& words, const std::string& what) {
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << what << ": " << s;
  for (const std::string& w : words) {
    EXPECT_NE(s.message().find(w), std::string::npos) << what << ": '" << w << "' not in: " << s;
  }
}

TEST(Validation, AValidRequestPassesAndEachBoundRefusesNamingTheFieldAndLimit) {
  const RequestLimits l;
  const ModelLimits m = Model();
  ASSERT_TRUE(ValidateGenerateRequest(Ok(), l, m).ok()) << ValidateGenerateRequest(Ok(), l, m);
  struct Case {
    std::string what;
    std::function<void(rpc::GenerateRequest&)> change;
    std::vector<std::string> words;
  };
  const std::vector<Case> cases = {
      {"65 documents",
       [](auto& r) { r.document_ids.assign(65, "d"); },
       {"document_ids", "65", "at most 64", "max_document_ids"}},
      {"a duplicate document",
       [](auto& r) {
         r.document_ids = {"doc-a", "doc-b", "doc-a"};
       },
       {"document_ids[2]", "document_ids[0]", "once"}},
      {"a long document id",
       [](auto& r) { r.document_ids = {std::string(257, 'x')}; },
       {"document_ids[0]", "max_id_bytes"}},
      {"both text and ids", [](auto& r) { r.__set_text("hi"); }, {"exactly one of text and token_ids"}},
      {"neither", [](auto& r) { r.__isset.token_ids = false; }, {"exactly one of text and token_ids"}},
      {"empty ids", [](auto& r) { r.token_ids.clear(); }, {"token_ids is empty"}},
      {"a question over the context",
       [](auto& r) { r.token_ids.assign(4096, 1); },
       {"question", "4096 token ids", "at most 4095"}},
      {"an id outside the vocabulary",
       [](auto& r) {
         r.token_ids = {1, 1000};
       },
       {"question token_ids", "1000", "[0, 1000)"}},
      {"a negative id", [](auto& r) { r.token_ids = {-1}; }, {"question token_ids", "-1"}},
      {"max_new_tokens 0", [](auto& r) { r.max_new_tokens = 0; }, {"max_new_tokens", "[1, 1048576]"}},
      {"max_new_tokens over the context",
       [](auto& r) { r.max_new_tokens = 4096; },
       {"max_new_tokens 4096", "4096-token context"}},
      {"17 stop strings", [](auto& r) { r.stop.assign(17, "x"); }, {"stop", "17", "max_stop_strings"}},
      {"an empty stop string", [](auto& r) { r.stop = {""}; }, {"stop[0]", "max_stop_string_bytes"}},
      {"a long stop string",
       [](auto& r) {
         r.stop = {"ok", std::string(257, 's')};
       },
       {"stop[1]", "1 to 256 bytes"}},
      {"1001 stop ids",
       [](auto& r) { r.stop_ids.assign(1001, 1); },
       {"stop_ids", "1001", "at most 1000", "max_stop_ids"}},
      {"a stop id outside the vocabulary",
       [](auto& r) {
         r.stop_ids = {5, 5000};
       },
       {"stop_ids", "5000", "vocabulary"}},
      {"kv_policy", [](auto& r) { r.kv_policy = std::string(1 << 20, 'p'); }, {"kv_policy"}},
      {"deadline 1e13",
       [](auto& r) { r.deadline_ms = 10000000000000; },
       {"deadline_ms", "604800000", "max_deadline_ms"}},
      {"a negative deadline", [](auto& r) { r.deadline_ms = -1; }, {"deadline_ms"}},
      {"temperature NaN", [](auto& r) { r.sampling.temperature = std::nan(""); }, {"sampling.temperature"}},
      {"top_p 0", [](auto& r) { r.sampling.top_p = 0; }, {"sampling.top_p"}},
      {"top_k -1", [](auto& r) { r.sampling.top_k = -1; }, {"sampling.top_k"}},
      {"seed -1", [](auto& r) { r.sampling.seed = -1; }, {"sampling.seed"}},
  };
  for (const Case& c : cases) {
    rpc::GenerateRequest r = Ok();
    c.change(r);
    ExpectRefused(ValidateGenerateRequest(r, l, m), c.words, c.what);
  }
  // The over-long kv_policy is not echoed whole.
  rpc::GenerateRequest r = Ok();
  r.kv_policy = std::string(1 << 20, 'p');
  EXPECT_LT(ValidateGenerateRequest(r, l, m).message().size(), 200u);
}

TEST(Validation, ValuesAtEachLimitPass) {
  const RequestLimits l;
  const ModelLimits m = Model();
  rpc::GenerateRequest r = Ok();
  r.document_ids.clear();
  for (int i = 0; i < l.max_document_ids; ++i) r.document_ids.push_back("doc-" + std::to_string(i));
  r.document_ids.back() = std::string(l.max_id_bytes, 'z');
  r.token_ids.assign(m.max_context - 1, m.vocab_size - 1);
  r.max_new_tokens = 1;
  r.stop.assign(l.max_stop_strings, std::string(l.max_stop_string_bytes, 's'));
  r.stop_ids.assign(l.max_stop_ids, 0);
  r.deadline_ms = l.max_deadline_ms;
  r.sampling.temperature = 100;
  r.sampling.top_p = 1;
  EXPECT_TRUE(ValidateGenerateRequest(r, l, m).ok()) << ValidateGenerateRequest(r, l, m);
}

// The floods: the count is refused before the elements are read (the
// first element is bad too; the error is about the count).
TEST(Validation, ListsAreRefusedByTheirLengthBeforeTheirElements) {
  const RequestLimits l;
  const ModelLimits m = Model();
  rpc::GenerateRequest r = Ok();
  r.stop_ids.assign(10000000, 1);
  r.stop_ids[0] = -5;
  ExpectRefused(ValidateGenerateRequest(r, l, m), {"stop_ids: 10000000 ids", "max_stop_ids"}, "10M stop ids");
  r = Ok();
  r.document_ids.assign(20000, "doc-0123456789abcdef");
  ExpectRefused(ValidateGenerateRequest(r, l, m), {"20000 documents", "max_document_ids"}, "20000 copies of one id");
  r = Ok();
  r.token_ids.assign(5000, -1);
  ExpectRefused(ValidateGenerateRequest(r, l, m), {"5000 token ids", "at most 4095"}, "question past the context");
}

TEST(Validation, WithoutWorkerReportsTheModelChecksAreLeftToTheWorker) {
  const RequestLimits l;
  ModelLimits unknown;
  rpc::GenerateRequest r = Ok();
  r.stop.clear();
  r.token_ids = {999999};
  EXPECT_TRUE(ValidateGenerateRequest(r, l, unknown).ok());
  r.token_ids = {-1};  // negative is never an id
  ExpectRefused(ValidateGenerateRequest(r, l, unknown), {"-1"}, "negative id");
  r.token_ids = {1};
  r.stop = {"x"};
  ExpectRefused(ValidateGenerateRequest(r, l, unknown), {"stop strings need the model's tokenizer"}, "no tokenizer");
  r.stop.clear();
  r.__isset.token_ids = false;
  r.__set_text("a question");
  ExpectRefused(ValidateGenerateRequest(r, l, unknown), {"no tokenizer"}, "text without tokenizer");
  r.text = std::string(l.max_text_bytes + 1, 'a');
  ExpectRefused(ValidateGenerateRequest(r, l, Model()), {"max_text_bytes"}, "text over the limit");
}

TEST(Validation, PromptLengthAndTheTokensBound) {
  const ModelLimits m = Model();
  EXPECT_TRUE(ValidatePromptLength(4000, 96, m).ok());
  ExpectRefused(ValidatePromptLength(4000, 97, m), {"4000 tokens", "max_new_tokens (97)", "4096-token context"},
                "one over");
  ExpectRefused(ValidatePromptLength(0, 1, m), {"empty"}, "empty prompt");
  EXPECT_TRUE(ValidatePromptLength(int64_t{1} << 40, 1, ModelLimits{}).ok());  // unknown context
  EXPECT_EQ(GeneratedTokensBound(100, 256, m), 256);
  EXPECT_EQ(GeneratedTokensBound(4000, 256, m), 96);
  EXPECT_EQ(GeneratedTokensBound(5000, 256, m), 0);
  EXPECT_EQ(GeneratedTokensBound(5000, 256, ModelLimits{}), 256);
}

TEST(Validation, PutDocument) {
  const RequestLimits l;
  const ModelLimits m = Model();
  rpc::PutDocumentRequest p;
  p.name = "doc";
  p.__set_token_ids(std::vector<int32_t>(4095, 3));
  EXPECT_TRUE(ValidatePutDocumentRequest(p, l, m).ok()) << ValidatePutDocumentRequest(p, l, m);
  auto refused = [&](const std::function<void(rpc::PutDocumentRequest&)>& change, const std::vector<std::string>& words,
                     const std::string& what) {
    rpc::PutDocumentRequest q = p;
    change(q);
    ExpectRefused(ValidatePutDocumentRequest(q, l, m), words, what);
  };
  refused([](auto& q) { q.name = ""; }, {"name", "max_name_bytes"}, "empty name");
  refused([](auto& q) { q.name = std::string(257, 'n'); }, {"name", "1 to 256 bytes"}, "long name");
  refused([](auto& q) { q.token_ids.push_back(3); }, {"document", "4096 token ids", "at most 4095"},
          "over the context");
  refused([](auto& q) { q.token_ids[9] = 1000; }, {"document token_ids", "1000"}, "outside the vocabulary");
  refused([](auto& q) { q.deadline_ms = int64_t{1} << 60; }, {"deadline_ms", "max_deadline_ms"}, "deadline");
  refused([](auto& q) { q.__set_text("both"); }, {"exactly one"}, "both");
}

TEST(Validation, SubmitJob) {
  const RequestLimits l;
  const ModelLimits m = Model();
  rpc::SubmitJobRequest j;
  for (int i = 0; i < 4; ++i) {
    rpc::JobItem it;
    it.custom_id = "q" + std::to_string(i);
    it.request = Ok();
    j.items.push_back(it);
  }
  j.metadata = std::string(l.max_job_metadata_bytes, 'm');
  j.completion_window_s = l.max_completion_window_s;
  ASSERT_TRUE(ValidateSubmitJobRequest(j, l, m).ok()) << ValidateSubmitJobRequest(j, l, m);
  auto refused = [&](const std::function<void(rpc::SubmitJobRequest&)>& change, const std::vector<std::string>& words,
                     const std::string& what) {
    rpc::SubmitJobRequest q = j;
    change(q);
    ExpectRefused(ValidateSubmitJobRequest(q, l, m), words, what);
  };
  refused([](auto& q) { q.items.clear(); }, {"items", "max_job_items"}, "no items");
  refused([&](auto& q) { q.items.resize(l.max_job_items + 1); }, {"items", "50001", "max_job_items"}, "too many items");
  refused([](auto& q) { q.metadata = std::string(30 << 20, 'm'); },
          {"metadata", "31457280 bytes", "max_job_metadata_bytes"}, "30 MiB metadata");
  refused([](auto& q) { q.completion_window_s = -1; }, {"completion_window_s", "max_completion_window_s"}, "window");
  refused([](auto& q) { q.completion_window_s = int64_t{1} << 50; }, {"completion_window_s"}, "huge window");
  refused([](auto& q) { q.deadline_ms = 10000000000000; }, {"deadline_ms", "max_deadline_ms"}, "deadline");
  refused([](auto& q) { q.items[2].custom_id = ""; }, {"items[2]", "custom_id", "max_custom_id_bytes"},
          "empty custom_id");
  refused([](auto& q) { q.items[2].custom_id = std::string(100000, 'c'); }, {"items[2]", "custom_id"},
          "long custom_id");
  refused([](auto& q) { q.items[3].custom_id = "q1"; }, {"items[3] (custom_id 'q1')", "not unique"}, "duplicate");
  refused([](auto& q) { q.items[1].request.stop_ids.assign(2000, 1); }, {"items[1] (custom_id 'q1')", "max_stop_ids"},
          "an item's stop ids");
  refused([](auto& q) { q.items[0].request.document_ids.assign(100, "d"); }, {"items[0]", "max_document_ids"},
          "an item's documents");
  // An item's own deadline is not used (the job's window applies).
  rpc::SubmitJobRequest q = j;
  q.items[0].request.deadline_ms = 10000000000000;
  EXPECT_TRUE(ValidateSubmitJobRequest(q, l, m).ok());
  // A refusal echoes no long custom_id.
  q = j;
  q.items[1].custom_id = std::string(100000, 'c');
  EXPECT_LT(ValidateSubmitJobRequest(q, l, m).message().size(), 300u);
}

TEST(Validation, IdsPagesWaitsAndLimitsThemselves) {
  RequestLimits l;
  EXPECT_TRUE(ValidateId("job_id", std::string(256, 'j'), l).ok());
  ExpectRefused(ValidateId("job_id", std::string(257, 'j'), l), {"job_id", "257 bytes", "max_id_bytes"}, "id");
  EXPECT_TRUE(ValidatePageSize(1000, l).ok());
  ExpectRefused(ValidatePageSize(0, l), {"page_size", "[1, 1000]"}, "page 0");
  ExpectRefused(ValidatePageSize(1001, l), {"page_size"}, "page 1001");
  EXPECT_TRUE(ValidateWaitMs(60000, l).ok());
  ExpectRefused(ValidateWaitMs(60001, l), {"wait_ms", "[0, 60000]"}, "wait");
  ExpectRefused(ValidateWaitMs(-1, l), {"wait_ms"}, "negative wait");
  EXPECT_TRUE(ValidateDeadline("deadline_ms", 0, l).ok());
  EXPECT_TRUE(l.Validate().ok());
  l.max_stop_ids = RequestLimits::kMaxStopIdsLimit + 1;
  ExpectRefused(l.Validate(), {"max_stop_ids"}, "limit over the worker's");
  l = RequestLimits{};
  l.max_document_ids = 0;
  ExpectRefused(l.Validate(), {"max_document_ids"}, "no documents");
  EXPECT_EQ(Excerpt(std::string(100, 'a'), 10), std::string(10, 'a') + "...");
}

// Random requests near the limits: whenever one passes, it keeps every
// promise the coordinator relies on.
TEST(Validation, RandomRequestsThatPassKeepTheirPromises) {
  const RequestLimits l;
  const ModelLimits m = Model();
  std::mt19937_64 rng(37);
  auto pick = [&](int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); };
  int passed = 0;
  for (int i = 0; i < 3000; ++i) {
    rpc::GenerateRequest r;
    const int docs = static_cast<int>(pick(0, 70));
    for (int d = 0; d < docs; ++d) r.document_ids.push_back("doc-" + std::to_string(pick(0, 200)));
    std::vector<int32_t> q(static_cast<size_t>(pick(0, 5000)));
    for (int32_t& id : q) id = static_cast<int32_t>(pick(-2, 1001));
    if (pick(0, 3) == 0) std::fill(q.begin(), q.end(), 5);
    if (pick(0, 9) > 0) r.__set_token_ids(q);
    r.max_new_tokens = static_cast<int32_t>(pick(-1, 5000));
    r.stop_ids.assign(static_cast<size_t>(pick(0, 1100)), static_cast<int32_t>(pick(-1, 1000)));
    r.deadline_ms = pick(0, 3) == 0 ? pick(-1, int64_t{1} << 50) : 0;
    if (!ValidateGenerateRequest(r, l, m).ok()) continue;
    ++passed;
    ASSERT_LE(static_cast<int>(r.document_ids.size()), l.max_document_ids);
    for (size_t a = 0; a < r.document_ids.size(); ++a) {
      for (size_t b = 0; b < a; ++b) ASSERT_NE(r.document_ids[a], r.document_ids[b]);
    }
    ASSERT_TRUE(r.__isset.token_ids);
    ASSERT_FALSE(r.token_ids.empty());
    ASSERT_LT(static_cast<int64_t>(r.token_ids.size()), m.max_context);
    for (int32_t id : r.token_ids) ASSERT_TRUE(id >= 0 && id < m.vocab_size);
    ASSERT_TRUE(r.max_new_tokens >= 1 && r.max_new_tokens < m.max_context);
    ASSERT_LE(static_cast<int>(r.stop_ids.size()), l.max_stop_ids);
    for (int32_t id : r.stop_ids) ASSERT_TRUE(id >= 0 && id < m.vocab_size);
    ASSERT_TRUE(r.deadline_ms >= 0 && r.deadline_ms <= l.max_deadline_ms);
  }
  EXPECT_GT(passed, 30) << "too few requests passed to test anything";
}

}  // namespace
}  // namespace penumbra::coordinator
