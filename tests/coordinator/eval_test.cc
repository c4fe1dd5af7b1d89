// penumbra eval: task-file parsing and validation, scoring (scoring.py's
// rules), the evalmodel-shaped fixture tokenizer, and end-to-end runs of the
// tiny random Llama on the CPU backend under both KV policies, checked against
// Runtime::Generate and against a full re-prefill of the multi-turn history.
#include "coordinator/cli/eval.h"

#include <filesystem>
#include <set>
#include <sstream>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "common/file.h"
#include "tests/test_util.h"
#include "tests/worker/model_test_util.h"
#include "worker/engine/engine.h"

namespace penumbra {
namespace {

using json = nlohmann::json;

std::string Line(const json& j) { return j.dump(); }

json GoodRecord() {
  return {{"id", "niah_single-128-0"},
          {"task", "niah_single"},
          {"length", 128},
          {"prompt", "<doc>\nx\n</doc>\nQ: What?\nA:"},
          {"answer", "1234567"}};
}

json MultiTurnRecord() {
  json r = GoodRecord();
  r["id"] = "niah_multiturn-128-0";
  r["task"] = "niah_multiturn";
  r["context"] = "<doc>\nx\n</doc>\n";
  r["turns"] = json::array({{{"question", "Q: What?\nA:"}, {"answer", "1234567"}},
                            {{"question", "Q: And?\nA:"}, {"answer", json::array({"1", "2"})}}});
  return r;
}

// Expects ParseEvalRecords to fail with a message containing every needle.
void ExpectParseError(const std::string& text, const std::vector<std::string>& needles) {
  auto r = ParseEvalRecords(text, "t.jsonl");
  ASSERT_FALSE(r.ok()) << "accepted: " << text;
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  for (const std::string& n : needles) EXPECT_HAS_SUBSTR(r.status().message(), n);
}

TEST(EvalRecordsTest, ParsesSingleAndMultiTurnRecords) {
  json list = GoodRecord();
  list["id"] = "b";
  list["answer"] = json::array({"a", "b"});
  list["max_new_tokens"] = 7;
  list["seed"] = 5;  // unknown fields are ignored
  const std::string text = Line(GoodRecord()) + "\n\n  \n" + Line(list) + "\n" + Line(MultiTurnRecord()) + "\n";
  auto r = ParseEvalRecords(text, "t.jsonl");
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->size(), 3u);
  const EvalRecord& a = (*r)[0];
  EXPECT_EQ(a.id, "niah_single-128-0");
  EXPECT_EQ(a.task, "niah_single");
  EXPECT_EQ(a.length, 128);
  EXPECT_EQ(a.max_new_tokens, 64);
  EXPECT_FALSE(a.answer.is_list);
  EXPECT_EQ(a.answer.text, "1234567");
  EXPECT_EQ(a.num_turns(), 1);
  EXPECT_EQ(a.line, 1);
  const EvalRecord& b = (*r)[1];
  EXPECT_EQ(b.line, 4);
  EXPECT_TRUE(b.answer.is_list);
  EXPECT_EQ(b.answer.items, (std::vector<std::string>{"a", "b"}));
  EXPECT_EQ(b.max_new_tokens, 7);
  const EvalRecord& c = (*r)[2];
  ASSERT_EQ(c.num_turns(), 2);
  EXPECT_EQ(c.turns[1].question, "Q: And?\nA:");
  EXPECT_TRUE(c.answer_of(1).is_list);
  EXPECT_EQ(c.answer_of(0).text, "1234567");
}

TEST(EvalRecordsTest, RejectsBadLinesNamingFileLineAndField) {
  const std::string good = Line(GoodRecord()) + "\n";
  ExpectParseError(good + "{\"id\": \"x\",\n", {"t.jsonl:2", "not valid JSON"});
  ExpectParseError(good + "[1, 2]\n", {"t.jsonl:2", "object"});
  json r = GoodRecord();
  r["id"] = "y";
  r.erase("answer");
  ExpectParseError(good + "\n" + Line(r), {"t.jsonl:3", "answer", "missing"});
  for (const char* key : {"id", "task", "prompt", "length"}) {
    json m = GoodRecord();
    m.erase(key);
    ExpectParseError(Line(m), {"t.jsonl:1", key, "missing"});
  }
  auto with = [](const std::string& key, const json& v) {
    json m = GoodRecord();
    m[key] = v;
    return Line(m);
  };
  ExpectParseError(with("length", "128"), {"t.jsonl:1", "length", "integer"});
  ExpectParseError(with("length", 128.5), {"length", "integer"});
  ExpectParseError(with("answer", 5), {"answer", "string or a list"});
  ExpectParseError(with("answer", json::array({"a", 1})), {"answer[1]", "string"});
  ExpectParseError(with("prompt", 3), {"prompt", "string"});
  ExpectParseError(with("prompt", ""), {"prompt", "empty"});
  ExpectParseError(with("id", json::array()), {"id", "string"});
  ExpectParseError(with("max_new_tokens", "64"), {"max_new_tokens", "integer"});
  ExpectParseError(with("max_new_tokens", 0), {"max_new_tokens", "[1, 1048576]"});
  ExpectParseError(with("max_new_tokens", nullptr), {"max_new_tokens", "integer"});
  ExpectParseError(with("task", "all"), {"task", "reserved"});
  ExpectParseError(good + good, {"t.jsonl:2", "id", "line 1"});
}

TEST(EvalRecordsTest, RejectsMalformedTurns) {
  auto turns = [](const json& t) {
    json m = MultiTurnRecord();
    m["turns"] = t;
    return Line(m);
  };
  ExpectParseError(turns("Q"), {"t.jsonl:1", "turns", "list"});
  ExpectParseError(turns(json::array()), {"turns", "non-empty"});
  ExpectParseError(turns(json::array({"Q: What?\nA:"})), {"turns[0]", "object"});
  ExpectParseError(turns(json::array({{{"question", "Q: What?\nA:"}, {"answer", "1"}}, {{"answer", "2"}}})),
                   {"turns[1]", "question", "missing"});
  ExpectParseError(turns(json::array({{{"question", "Q: What?\nA:"}, {"answer", "1"}}, {{"question", "Q"}}})),
                   {"turns[1].answer", "missing"});
  ExpectParseError(turns(json::array({{{"question", "Q: What?\nA:"}, {"answer", 1}}})), {"turns[0].answer"});
  ExpectParseError(turns(json::array({{{"question", 7}, {"answer", "1"}}})), {"turns[0]", "question", "string"});
  ExpectParseError(turns(json::array({{{"question", "Q: Other?\nA:"}, {"answer", "1"}}})),
                   {"turns[0].question", "end of prompt"});
  json m = MultiTurnRecord();
  m["context"] = "<doc>\ny\n</doc>\n";
  ExpectParseError(Line(m), {"context"});
}

TEST(EvalRecordsTest, SelectsByTaskLengthAndLimitInFileOrder) {
  std::vector<EvalRecord> all;
  int i = 0;
  for (const char* task : {"a", "b"}) {
    for (int64_t len : {128, 256}) {
      for (int k = 0; k < 3; ++k) {
        EvalRecord r;
        r.id = std::to_string(i++);
        r.task = task;
        r.length = len;
        all.push_back(r);
      }
    }
  }
  EXPECT_EQ(SelectEvalRecords(all, {}).size(), 12u);
  auto lim = SelectEvalRecords(all, {{}, {}, 2});
  ASSERT_EQ(lim.size(), 8u);
  EXPECT_EQ(lim[0].id, "0");
  EXPECT_EQ(lim[1].id, "1");
  EXPECT_EQ(lim[2].id, "3");
  auto only = SelectEvalRecords(all, {{"b"}, {256}, 1});
  ASSERT_EQ(only.size(), 1u);
  EXPECT_EQ(only[0].id, "9");
}

EvalAnswer Str(const std::string& s) { return {false, s, {}}; }
EvalAnswer List(std::vector<std::string> v) { return {true, "", std::move(v)}; }

TEST(EvalScoringTest, MatchesScoringPy) {
  // ops/evalmodel/test_tasks.py's expectations.
  EXPECT_EQ(PredictionOf(" 1234567\nQ: next"), "1234567");
  auto check = [](const std::string& pred, const EvalAnswer& a, bool ok, double partial) {
    const EvalScore s = ScorePrediction(pred, a);
    EXPECT_EQ(s.correct, ok) << pred;
    EXPECT_DOUBLE_EQ(s.partial, partial) << pred;
  };
  check("1234567", Str("1234567"), true, 1.0);
  check("123456", Str("1234567"), false, 0.0);
  check("b, a", List({"a", "b"}), true, 1.0);
  check("a, b, c", List({"a", "b"}), false, 1.0);
  check("a", List({"a", "b"}), false, 0.5);
  check("", List({"a"}), false, 0.0);
  // More of the same rules.
  check("1234567 ", Str("1234567"), false, 0.0);  // scoring sees the prediction as given
  check("A", Str("a"), false, 0.0);
  check("a,, b ,a,", List({"a", "b"}), true, 1.0);  // empty items dropped, duplicates ignored
  check("a, b, c", List({"a", "b", "c", "d"}), false, 0.75);
  check("", List({}), true, 0.0);
  check("x", List({"a", "a"}), false, 0.0);
  check("a", List({"a", "a"}), true, 1.0);
  // Python str.strip(): Unicode whitespace, both ends, before the first "\n" only.
  EXPECT_EQ(PredictionOf("\t\u00a0 42\u3000\r\nmore"), "42");
  EXPECT_EQ(PredictionOf("\n42"), "");
  EXPECT_EQ(PredictionOf("no newline "), "no newline");
  EXPECT_EQ(StripPythonWhitespace("\x1c\x1f"
                                  "a b\x0b\x0c"),
            "a b");
  EXPECT_EQ(StripPythonWhitespace("\u2003\u00e9\u2003"), "\u00e9");
  EXPECT_EQ(StripPythonWhitespace("\xff "), "\xff");  // a bad byte is not whitespace
}

TEST(EvalOutputTest, LinesHaveEvalHfFields) {
  EvalRecord r;
  r.id = "x-1-0";
  r.task = "x";
  r.length = 1;
  r.answer = List({"a", "b"});
  EvalTurnResult t;
  t.prediction = "a";
  t.input_tokens = 17;
  const json p = json::parse(PredictionLineJson(r, 0, t, ScorePrediction("a", r.answer)));
  EXPECT_EQ(p, json::parse(R"({"id": "x-1-0", "task": "x", "length": 1, "turn": 0, "prediction": "a",
                               "answer": ["a", "b"], "correct": false, "partial": 0.5, "tokens": 17})"));
  EvalGroup g{"all", 4096, 3, 1, 2.0};
  EXPECT_EQ(GroupLineJson(g, "shadowkv"),
            R"({"engine": "penumbra", "kv_policy": "shadowkv", "task": "all", "length": 4096, "n": 3, )"
            R"("accuracy": 0.3333, "partial": 0.6667})");
}

TEST(EvalOutputTest, OverallAccuracyIsOverEveryTurnOfEveryTaskAndLength) {
  EvalSummary s;
  s.groups = {{"kv", 4096, 3, 2, 2.0},
              {"niah", 4096, 1, 1, 1.0},
              {"all", 4096, 4, 3, 3.0},
              {"kv", 16384, 4, 0, 1.0},
              {"all", 16384, 4, 0, 1.0}};
  const EvalOverall o = OverallOf(s);
  EXPECT_DOUBLE_EQ(o.accuracy_percent, 100.0 * 3 / 8);  // not a mean of the groups' accuracies
  EXPECT_EQ(o.lengths, "4096,16384");
  ASSERT_EQ(o.per_task_percent.size(), 2u);  // by task name, over every length
  EXPECT_EQ(o.per_task_percent[0].first, "kv");
  EXPECT_DOUBLE_EQ(o.per_task_percent[0].second, 100.0 * 2 / 7);
  EXPECT_EQ(o.per_task_percent[1].first, "niah");
  EXPECT_DOUBLE_EQ(o.per_task_percent[1].second, 100.0);
  EXPECT_TRUE(OverallOf(EvalSummary{}).per_task_percent.empty());
  EXPECT_EQ(OverallOf(EvalSummary{}).lengths, "");
  EXPECT_EQ(OverallOf(EvalSummary{}).accuracy_percent, 0.0);
}

// ------------------------------------------------- the evalmodel tokenizer

std::string FixtureTokenizer() { return testing::SourceDir() + "/tests/data/tokenizer/evalmodel_tokenizer.json"; }

TEST(EvalTokenizerTest, EvalModelShapedTokenizerEncodesWithBosAndDecodes) {
  auto tok = Tokenizer::FromFile(FixtureTokenizer());
  ASSERT_TRUE(tok.ok()) << tok.status();
  EXPECT_EQ((*tok)->vocab_size(), 1024);
  EXPECT_EQ((*tok)->TokenToId("<|bos|>"), 0);
  EXPECT_EQ((*tok)->TokenToId("<|eos|>"), 1);
  EXPECT_EQ((*tok)->TokenToId("<|pad|>"), 2);
  EXPECT_EQ((*tok)->bos_id(), 0);
  auto golden = ReadFileToString(testing::SourceDir() + "/tests/data/tokenizer/evalmodel_golden.jsonl");
  ASSERT_TRUE(golden.ok()) << golden.status();
  std::istringstream in(*golden);
  std::string line;
  int n = 0;
  while (std::getline(in, line)) {
    const json g = json::parse(line);
    const std::string text = g["text"];
    auto plain = (*tok)->Encode(text, false);
    auto with_bos = (*tok)->Encode(text, true);
    ASSERT_TRUE(plain.ok() && with_bos.ok()) << text;
    EXPECT_EQ(*plain, g["ids"].get<std::vector<int32_t>>()) << text;
    EXPECT_EQ(*with_bos, g["ids_special"].get<std::vector<int32_t>>()) << text;
    ASSERT_FALSE(with_bos->empty());
    EXPECT_EQ((*with_bos)[0], 0);
    auto back = (*tok)->Decode(*plain, false);
    ASSERT_TRUE(back.ok());
    EXPECT_EQ(*back, text);  // byte-level BPE round-trips (specials kept)
    ++n;
  }
  EXPECT_GE(n, 10);
  auto bos_text = (*tok)->Decode(std::vector<int32_t>{0, 1}, false);
  ASSERT_TRUE(bos_text.ok());
  EXPECT_EQ(*bos_text, "<|bos|><|eos|>");
}

// ---------------------------------------------------------- end to end

class EvalRunTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string src = testing::SourceDir() + "/tests/data/models/tiny_llama";
    for (const auto& e : std::filesystem::directory_iterator(src)) {
      const std::string name = e.path().filename().string();
      if (name.rfind("golden", 0) == 0) continue;
      std::filesystem::copy_file(e.path(), dir_.File(name));
    }
    std::filesystem::copy_file(FixtureTokenizer(), dir_.File("tokenizer.json"));
    auto tok = Tokenizer::FromFile(dir_.File("tokenizer.json"));
    ASSERT_TRUE(tok.ok()) << tok.status();
    tok_ = std::move(*tok);
    auto recs = LoadEvalRecords(testing::SourceDir() + "/tests/data/evaltasks/eval_smoke.jsonl");
    ASSERT_TRUE(recs.ok()) << recs.status();
    records_ = std::move(*recs);
    ASSERT_EQ(records_.size(), 3u);
  }

  std::unique_ptr<Engine> Open(const std::string& policy, int rank, int64_t budget, int outliers, int chunk = 4,
                               int window = 8) {
    EngineOptions o;
    o.backend.device = "cpu";
    o.kv_policy = policy;
    o.shadowkv.rank = rank;
    o.shadowkv.chunk_size = chunk;
    o.shadowkv.budget_tokens = budget;
    o.shadowkv.outlier_chunks = outliers;
    o.shadowkv.local_window = window;
    o.shadowkv.min_prompt_tokens = 16;
    auto e = Engine::Open(dir_.path(), o);
    EXPECT_TRUE(e.ok()) << e.status();
    return e.ok() ? std::move(*e) : nullptr;
  }

  struct Run {
    std::vector<std::vector<EvalTurnResult>> turns;  // [record][turn]
    std::vector<json> lines;
    EvalSummary summary;
  };

  // The records one by one through EvalRunner::Run, then the whole set
  // through RunEval on the same engine (the two must agree).
  Run RunAll(Engine& e) {
    Run out;
    auto runner = EvalRunner::Create(&e.runtime(), tok_.get(), e.config().eos_token_ids);
    EXPECT_TRUE(runner.ok()) << runner.status();
    if (!runner.ok()) return out;
    auto enc = EncodeEvalRecords(**runner, records_);
    EXPECT_TRUE(enc.ok()) << enc.status();
    if (!enc.ok()) return out;
    for (const EncodedRecord& r : *enc) {
      auto res = (*runner)->Run(r, r.record->max_new_tokens);
      EXPECT_TRUE(res.ok()) << res.status();
      out.turns.push_back(res.ok() ? *res : std::vector<EvalTurnResult>{});
    }
    std::stringstream pred;
    auto sum = RunEval(**runner, *enc, {}, &pred);
    EXPECT_TRUE(sum.ok()) << sum.status();
    if (sum.ok()) out.summary = *sum;
    std::string line;
    while (std::getline(pred, line)) out.lines.push_back(json::parse(line));
    return out;
  }

  std::vector<int32_t> NewlineIds() const {
    std::vector<int32_t> ids;
    for (int32_t id = 0; id < tok_->vocab_size(); ++id) {
      auto t = tok_->Decode(std::vector<int32_t>{id}, false);
      if (t.ok() && t->find('\n') != std::string::npos) ids.push_back(id);
    }
    return ids;
  }

  // Checks `run` against Runtime::Generate (stop at EOS or any token whose
  // text has a newline) for each record's first turn, and the prediction
  // file against the turn results.
  void CheckAgainstGenerate(Engine& e, const Run& run) {
    ASSERT_EQ(run.turns.size(), records_.size());
    std::vector<int32_t> stops = NewlineIds();
    ASSERT_FALSE(stops.empty());
    for (int32_t id : e.config().eos_token_ids) stops.push_back(id);
    size_t line = 0;
    for (size_t i = 0; i < records_.size(); ++i) {
      const EvalRecord& rec = records_[i];
      ASSERT_EQ(static_cast<int>(run.turns[i].size()), rec.num_turns()) << rec.id;
      GenerationRequest q;
      auto prompt = tok_->Encode(rec.prompt, true);
      ASSERT_TRUE(prompt.ok());
      q.prompt = *prompt;
      q.max_new_tokens = rec.max_new_tokens;
      q.stop_ids = stops;
      auto g = e.runtime().Generate({q});
      ASSERT_TRUE(g.ok()) << g.status();
      const EvalTurnResult& t0 = run.turns[i][0];
      EXPECT_EQ(t0.ids, (*g)[0].ids) << rec.id;
      // eval_hf.py's count: the prompt plus every generated token but the
      // turn's last (a stop token or the max_new_tokens-th), never forwarded.
      EXPECT_EQ(t0.input_tokens, static_cast<int64_t>(q.prompt.size() + t0.ids.size()) - 1);
      auto text = tok_->Decode(t0.ids, false);
      ASSERT_TRUE(text.ok());
      EXPECT_EQ(t0.text, *text);
      for (int t = 0; t < rec.num_turns(); ++t, ++line) {
        ASSERT_LT(line, run.lines.size());
        const json& l = run.lines[line];
        EXPECT_EQ(l.size(), 9u) << l.dump();
        EXPECT_EQ(l["id"], rec.id);
        EXPECT_EQ(l["task"], rec.task);
        EXPECT_EQ(l["length"], rec.length);
        EXPECT_EQ(l["turn"], t);
        EXPECT_EQ(l["prediction"], run.turns[i][t].prediction);
        EXPECT_EQ(l["tokens"], run.turns[i][t].input_tokens);
        const EvalScore s = ScorePrediction(run.turns[i][t].prediction, rec.answer_of(t));
        EXPECT_EQ(l["correct"], s.correct);
        EXPECT_TRUE(l["answer"].is_array() == rec.answer_of(t).is_list);
      }
    }
    EXPECT_EQ(line, run.lines.size());
    EXPECT_EQ(run.summary.records, 3);
    EXPECT_EQ(run.summary.turns, 4);
    // Groups: the three tasks at length 128, then "all".
    ASSERT_EQ(run.summary.groups.size(), 4u);
    EXPECT_EQ(run.summary.groups.back().task, "all");
    EXPECT_EQ(run.summary.groups.back().n, 4);
  }

  testing::TempDir dir_;
  std::unique_ptr<Tokenizer> tok_;
  std::vector<EvalRecord> records_;
};

// Runs the multi-turn record with `eos` as the stop ids and checks turn 1
// against a fresh greedy run on the whole history: prompt, turn 0's answer
// (every token once; the last one is fed at the start of turn 1), "\n"
// unless that token had one, and turn 1's question. Returns turn 0's ids.
std::vector<int32_t> CheckMultiTurnAgainstReprefill(Engine& e, const Tokenizer& tok, const EvalRecord& mt,
                                                    const std::vector<int32_t>& nl_tokens,
                                                    const std::vector<int32_t>& eos, bool expect_stop) {
  EXPECT_EQ(mt.num_turns(), 2);
  auto runner = EvalRunner::Create(&e.runtime(), &tok, eos);
  EXPECT_TRUE(runner.ok()) << runner.status();
  auto enc = (*runner)->Encode(mt);
  EXPECT_TRUE(enc.ok()) << enc.status();
  auto res = (*runner)->Run(*enc, mt.max_new_tokens);
  EXPECT_TRUE(res.ok()) << res.status();
  if (!res.ok() || res->size() != 2) return {};
  const EvalTurnResult& t0 = (*res)[0];
  auto is = [](const std::vector<int32_t>& v, int32_t id) { return std::count(v.begin(), v.end(), id) > 0; };
  const bool t0_stopped = is(nl_tokens, t0.ids.back()) || is(eos, t0.ids.back());
  EXPECT_EQ(t0_stopped, expect_stop);
  EXPECT_EQ(static_cast<int>(t0.ids.size()) < mt.max_new_tokens, expect_stop);
  std::vector<int32_t> history = *tok.Encode(mt.prompt, true);
  history.insert(history.end(), t0.ids.begin(), t0.ids.end());
  if (!is(nl_tokens, t0.ids.back())) {
    auto nl = tok.Encode("\n", false);
    history.insert(history.end(), nl->begin(), nl->end());
  }
  auto q1 = tok.Encode(mt.turns[1].question, false);
  history.insert(history.end(), q1->begin(), q1->end());
  GenerationRequest q;
  q.prompt = history;
  q.max_new_tokens = mt.max_new_tokens;
  q.stop_ids = nl_tokens;
  q.stop_ids.insert(q.stop_ids.end(), eos.begin(), eos.end());
  auto g = e.runtime().Generate({q});
  EXPECT_TRUE(g.ok()) << g.status();
  if (!g.ok()) return {};
  EXPECT_EQ((*res)[1].ids, (*g)[0].ids);
  EXPECT_EQ((*res)[1].input_tokens, static_cast<int64_t>(history.size() + (*res)[1].ids.size()) - 1);
  return t0.ids;
}

TEST_F(EvalRunTest, FullAttentionMatchesGenerateAndARePrefilledHistory) {
  auto e = Open("full", 160, 2048, 48);
  ASSERT_NE(e, nullptr);
  const Run run = RunAll(*e);
  CheckAgainstGenerate(*e, run);
  const std::vector<int32_t> nl_tokens = NewlineIds();
  // The random model runs turn 0 out of tokens (no newline)...
  const std::vector<int32_t> t0 =
      CheckMultiTurnAgainstReprefill(*e, *tok_, records_[2], nl_tokens, e->config().eos_token_ids, false);
  ASSERT_EQ(t0.size(), static_cast<size_t>(records_[2].max_new_tokens));
  // ...and stops early when its third token is made an end-of-sequence id.
  ASSERT_EQ(std::count(t0.begin(), t0.begin() + 2, t0[2]), 0) << "pick another token";
  CheckMultiTurnAgainstReprefill(*e, *tok_, records_[2], nl_tokens, {t0[2]}, true);
}

TEST_F(EvalRunTest, ShadowKvSparsePathMatchesGenerate) {
  auto e = Open("shadowkv", 8, 16, 2);
  ASSERT_NE(e, nullptr);
  const Run run = RunAll(*e);
  EXPECT_GT(e->runtime().policy().stats().selected_chunks, 0) << "the sparse path did not run";
  CheckAgainstGenerate(*e, run);
}

// rank = hkv*d, a budget over every prompt chunk and no outliers make ShadowKV
// exact as long as no generated or fed token completes a new chunk (the
// budget is fixed at the prompt's chunks, so later chunks would make it
// sparse by design). The local window is picked so that every record's
// appended tokens stay below the next chunk boundary.
TEST_F(EvalRunTest, ShadowKvWithFullRankAndBudgetPredictsAsFull) {
  constexpr int kChunk = 40;
  auto nl = tok_->Encode("\n", false);
  ASSERT_TRUE(nl.ok());
  int window = 0;
  for (int w = 1; w < kChunk && window == 0; ++w) {
    bool fits = true;
    for (const EvalRecord& r : records_) {
      auto p = tok_->Encode(r.prompt, true);
      ASSERT_TRUE(p.ok());
      const int64_t P = static_cast<int64_t>(p->size());
      // Tokens appended after the prompt at most (the runner's capacity less
      // the last token, which is never fed).
      int64_t appended = static_cast<int64_t>(r.num_turns()) * r.max_new_tokens - 1;
      for (int t = 1; t < r.num_turns(); ++t) {
        auto q = tok_->Encode(r.turns[t].question, false);
        ASSERT_TRUE(q.ok());
        appended += 1 + static_cast<int64_t>(nl->size() + q->size());
      }
      const int64_t room = kChunk - (P - w) % kChunk;  // appends before local rows reach w + kChunk
      fits = fits && P - w >= 2 * kChunk && appended < room;
    }
    if (fits) window = w;
  }
  ASSERT_GT(window, 0) << "no local window keeps the fixture's appended tokens inside one chunk";
  auto full = Open("full", 160, 2048, 48);
  auto sparse = Open("shadowkv", 64, 100 * kChunk, 0, kChunk, window);  // rank = hkv * d
  ASSERT_NE(full, nullptr);
  ASSERT_NE(sparse, nullptr);
  const Run a = RunAll(*full);
  const Run b = RunAll(*sparse);
  EXPECT_GT(sparse->runtime().policy().stats().selected_chunks, 0) << "the sparse path did not run";
  ASSERT_EQ(a.turns.size(), b.turns.size());
  for (size_t i = 0; i < a.turns.size(); ++i) {
    ASSERT_EQ(a.turns[i].size(), b.turns[i].size());
    for (size_t t = 0; t < a.turns[i].size(); ++t) {
      EXPECT_EQ(a.turns[i][t].prediction, b.turns[i][t].prediction) << records_[i].id << " turn " << t;
      EXPECT_EQ(a.turns[i][t].ids, b.turns[i][t].ids) << records_[i].id << " turn " << t;
    }
  }
}

TEST_F(EvalRunTest, RecordsOverTheContextAreRefusedBeforeRunning) {
  auto e = Open("full", 160, 2048, 48);
  ASSERT_NE(e, nullptr);
  auto runner = EvalRunner::Create(&e->runtime(), tok_.get(), e->config().eos_token_ids);
  ASSERT_TRUE(runner.ok());
  std::vector<EvalRecord> recs = records_;
  EvalRecord big = records_[0];
  big.id = "too-long";
  big.prompt.clear();
  for (int i = 0; i < 1500; ++i) big.prompt += " x7 q";  // > 4096 tokens
  big.prompt += "\nA:";
  recs.push_back(big);
  auto enc = EncodeEvalRecords(**runner, recs);
  ASSERT_FALSE(enc.ok());
  EXPECT_EQ(enc.status().code(), StatusCode::kInvalidArgument);
  EXPECT_HAS_SUBSTR(enc.status().message(), "too-long");
  EXPECT_HAS_SUBSTR(enc.status().message(), "4096");
}

}  // namespace
}  // namespace penumbra
