#include "coordinator/cli/eval.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <map>
#include <set>
#include <tuple>
#include <unordered_map>
#include <utility>

#include <nlohmann/json.hpp>

#include "common/file.h"

namespace penumbra {
namespace {

using json = nlohmann::json;
using ordered_json = nlohmann::ordered_json;

Status FieldError(const std::string& where, const std::string& field, const std::string& what) {
  return Status::InvalidArgument(where + ": " + field + ": " + what);
}

Result<EvalAnswer> ParseAnswer(const json& v, const std::string& where, const std::string& field) {
  EvalAnswer a;
  if (v.is_string()) {
    a.text = v.get<std::string>();
    return a;
  }
  if (!v.is_array()) return FieldError(where, field, "must be a string or a list of strings");
  a.is_list = true;
  for (size_t i = 0; i < v.size(); ++i) {
    if (!v[i].is_string()) {
      return FieldError(where, field + "[" + std::to_string(i) + "]", "must be a string");
    }
    a.items.push_back(v[i].get<std::string>());
  }
  return a;
}

Result<std::string> RequireString(const json& o, const std::string& key, const std::string& where) {
  auto it = o.find(key);
  if (it == o.end()) return FieldError(where, key, "missing");
  if (!it->is_string()) return FieldError(where, key, "must be a string");
  return it->get<std::string>();
}

// Python str.isspace() for one code point.
bool IsPythonSpace(uint32_t c) {
  return (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20) || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

// The code point starting at s[i] and its byte length (1 for a bad byte,
// which is never whitespace).
std::pair<uint32_t, size_t> CodePointAt(std::string_view s, size_t i) {
  const auto b = static_cast<unsigned char>(s[i]);
  size_t n = b < 0x80 ? 1 : (b >> 5) == 0x6 ? 2 : (b >> 4) == 0xE ? 3 : (b >> 3) == 0x1E ? 4 : 0;
  if (n == 0 || i + n > s.size()) return {0xFFFD, 1};
  uint32_t c = n == 1 ? b : n == 2 ? (b & 0x1F) : n == 3 ? (b & 0x0F) : (b & 0x07);
  for (size_t k = 1; k < n; ++k) {
    const auto x = static_cast<unsigned char>(s[i + k]);
    if ((x >> 6) != 0x2) return {0xFFFD, 1};
    c = (c << 6) | (x & 0x3F);
  }
  return {c, n};
}

// Start of the UTF-8 code point ending just before s[end].
size_t CodePointStartBefore(std::string_view s, size_t end) {
  size_t i = end - 1;
  while (i > 0 && end - i < 4 && (static_cast<unsigned char>(s[i]) >> 6) == 0x2) --i;
  return i;
}

double Round4(double x) { return std::round(x * 1e4) / 1e4; }

json AnswerJson(const EvalAnswer& a) { return a.is_list ? json(a.items) : json(a.text); }

std::string Dump(const ordered_json& j) { return j.dump(-1, ' ', true, json::error_handler_t::replace); }

// Python's json.dumps separators: ", " and ": ".
std::string DumpPythonStyle(const ordered_json& j) {
  std::string out = "{";
  bool first = true;
  for (auto it = j.begin(); it != j.end(); ++it) {
    if (!first) out += ", ";
    first = false;
    out += json(it.key()).dump(-1, ' ', true) + ": ";
    if (it->is_array()) {
      out += "[";
      for (size_t i = 0; i < it->size(); ++i) out += (i ? ", " : "") + Dump((*it)[i]);
      out += "]";
    } else {
      out += Dump(*it);
    }
  }
  return out + "}";
}

}  // namespace

// ----------------------------------------------------------------- records

Result<EvalRecord> ParseEvalRecord(std::string_view line, const std::string& where) {
  json j;
  try {
    j = json::parse(line);
  } catch (const json::parse_error& e) {
    return Status::InvalidArgument(where + ": not valid JSON (" + e.what() + ")");
  }
  if (!j.is_object()) return Status::InvalidArgument(where + ": expected a JSON object");
  EvalRecord r;
  PENUMBRA_ASSIGN_OR_RETURN(r.id, RequireString(j, "id", where));
  PENUMBRA_ASSIGN_OR_RETURN(r.task, RequireString(j, "task", where));
  PENUMBRA_ASSIGN_OR_RETURN(r.prompt, RequireString(j, "prompt", where));
  if (r.task == "all") return FieldError(where, "task", "\"all\" is reserved for the aggregate");
  if (r.prompt.empty()) return FieldError(where, "prompt", "is empty");
  auto len = j.find("length");
  if (len == j.end()) return FieldError(where, "length", "missing");
  if (!len->is_number_integer() || (len->is_number_unsigned() && len->get<uint64_t>() > INT64_MAX)) {
    return FieldError(where, "length", "must be an integer");
  }
  r.length = len->get<int64_t>();
  auto ans = j.find("answer");
  if (ans == j.end()) return FieldError(where, "answer", "missing");
  PENUMBRA_ASSIGN_OR_RETURN(r.answer, ParseAnswer(*ans, where, "answer"));
  if (auto m = j.find("max_new_tokens"); m != j.end()) {
    if (!m->is_number_integer()) return FieldError(where, "max_new_tokens", "must be an integer");
    const int64_t v = m->is_number_unsigned() && m->get<uint64_t>() > INT64_MAX ? -1 : m->get<int64_t>();
    if (v < 1 || v > (1 << 20)) return FieldError(where, "max_new_tokens", "must be in [1, 1048576]");
    r.max_new_tokens = static_cast<int>(v);
  }
  if (auto t = j.find("turns"); t != j.end() && !t->is_null()) {
    if (!t->is_array() || t->empty()) return FieldError(where, "turns", "must be a non-empty list");
    for (size_t i = 0; i < t->size(); ++i) {
      const std::string f = "turns[" + std::to_string(i) + "]";
      const json& o = (*t)[i];
      if (!o.is_object()) return FieldError(where, f, "must be an object {question, answer}");
      EvalTurn turn;
      PENUMBRA_ASSIGN_OR_RETURN(turn.question, RequireString(o, "question", where + ": " + f));
      auto a = o.find("answer");
      if (a == o.end()) return FieldError(where, f + ".answer", "missing");
      PENUMBRA_ASSIGN_OR_RETURN(turn.answer, ParseAnswer(*a, where, f + ".answer"));
      if (i > 0 && turn.question.empty()) return FieldError(where, f + ".question", "is empty");
      r.turns.push_back(std::move(turn));
    }
    const std::string& q0 = r.turns[0].question;
    if (r.prompt.size() < q0.size() || r.prompt.compare(r.prompt.size() - q0.size(), q0.size(), q0) != 0) {
      return FieldError(where, "turns[0].question", "must be the end of prompt (prompt == context + question)");
    }
    if (auto c = j.find("context"); c != j.end() && c->is_string() && c->get<std::string>() + q0 != r.prompt) {
      return FieldError(where, "context", "prompt must equal context + turns[0].question");
    }
  }
  return r;
}

Result<std::vector<EvalRecord>> ParseEvalRecords(std::string_view text, const std::string& file) {
  std::vector<EvalRecord> out;
  std::unordered_map<std::string, int> line_of_id;
  int line_no = 0;
  size_t pos = 0;
  while (pos < text.size()) {
    size_t end = text.find('\n', pos);
    if (end == std::string_view::npos) end = text.size();
    std::string_view line = text.substr(pos, end - pos);
    pos = end + 1;
    ++line_no;
    if (StripPythonWhitespace(line).empty()) continue;
    const std::string where = file + ":" + std::to_string(line_no);
    PENUMBRA_ASSIGN_OR_RETURN(EvalRecord r, ParseEvalRecord(line, where));
    r.line = line_no;
    auto [it, fresh] = line_of_id.emplace(r.id, line_no);
    if (!fresh) {
      return FieldError(where, "id", "\"" + r.id + "\" was already used on line " + std::to_string(it->second));
    }
    out.push_back(std::move(r));
  }
  return out;
}

Result<std::vector<EvalRecord>> LoadEvalRecords(const std::string& path) {
  PENUMBRA_ASSIGN_OR_RETURN(std::string text, ReadFileToString(path));
  return ParseEvalRecords(text, path);
}

std::vector<EvalRecord> SelectEvalRecords(const std::vector<EvalRecord>& records, const EvalSelection& s) {
  std::map<std::pair<std::string, int64_t>, int64_t> seen;
  std::vector<EvalRecord> out;
  for (const EvalRecord& r : records) {
    if (!s.tasks.empty() && std::find(s.tasks.begin(), s.tasks.end(), r.task) == s.tasks.end()) continue;
    if (!s.lengths.empty() && std::find(s.lengths.begin(), s.lengths.end(), r.length) == s.lengths.end()) continue;
    if (s.limit > 0 && seen[{r.task, r.length}]++ >= s.limit) continue;
    out.push_back(r);
  }
  return out;
}

// ----------------------------------------------------------------- scoring

std::string StripPythonWhitespace(std::string_view s) {
  size_t b = 0, e = s.size();
  while (b < e) {
    auto [c, n] = CodePointAt(s, b);
    if (!IsPythonSpace(c)) break;
    b += n;
  }
  while (e > b) {
    const size_t start = CodePointStartBefore(s, e);
    auto [c, n] = CodePointAt(s, start);
    if (start + n != e || !IsPythonSpace(c)) break;
    e = start;
  }
  return std::string(s.substr(b, e - b));
}

std::string PredictionOf(std::string_view generated_text) {
  return StripPythonWhitespace(generated_text.substr(0, generated_text.find('\n')));
}

EvalScore ScorePrediction(const std::string& prediction, const EvalAnswer& answer) {
  if (!answer.is_list) {
    const bool ok = prediction == answer.text;
    return {ok, ok ? 1.0 : 0.0};
  }
  std::set<std::string> items;
  size_t pos = 0;
  while (true) {
    const size_t comma = prediction.find(',', pos);
    std::string item = StripPythonWhitespace(std::string_view(prediction).substr(pos, comma - pos));
    if (!item.empty()) items.insert(std::move(item));
    if (comma == std::string::npos) break;
    pos = comma + 1;
  }
  const std::set<std::string> gold(answer.items.begin(), answer.items.end());
  size_t hit = 0;
  for (const std::string& g : gold) hit += items.count(g);
  return {items == gold, static_cast<double>(hit) / static_cast<double>(std::max<size_t>(1, gold.size()))};
}

// ------------------------------------------------------------------ runner

Result<std::unique_ptr<EvalRunner>> EvalRunner::Create(Runtime* runtime, const Tokenizer* tokenizer,
                                                       std::vector<int32_t> eos_ids) {
  auto r = std::unique_ptr<EvalRunner>(new EvalRunner);
  r->runtime_ = runtime;
  r->tokenizer_ = tokenizer;
  r->eos_ids_ = std::move(eos_ids);
  PENUMBRA_ASSIGN_OR_RETURN(r->newline_ids_, tokenizer->Encode("\n", /*add_special_tokens=*/false));
  const int vocab = runtime->config().vocab_size;
  r->token_has_newline_.assign(static_cast<size_t>(vocab), 0);
  for (int32_t id = 0; id < std::min(vocab, tokenizer->vocab_size()); ++id) {
    const int32_t one[1] = {id};
    auto text = tokenizer->Decode(one, /*skip_special_tokens=*/false);
    // Ids the tokenizer does not name (a padded model vocabulary) have no text.
    if (text.ok() && text->find('\n') != std::string::npos) r->token_has_newline_[id] = 1;
  }
  r->logits_.resize(static_cast<size_t>(vocab));
  return r;
}

bool EvalRunner::HasNewline(int32_t id) const {
  return id >= 0 && static_cast<size_t>(id) < token_has_newline_.size() && token_has_newline_[id] != 0;
}

int32_t EvalRunner::Argmax(const float* logits) const {
  const int vocab = runtime_->config().vocab_size;
  int32_t best = 0;
  for (int32_t i = 1; i < vocab; ++i) {
    if (logits[i] > logits[best]) best = i;
  }
  return best;
}

Result<EncodedRecord> EvalRunner::Encode(const EvalRecord& rec) const {
  const ModelConfig& c = runtime_->config();
  const std::string who = "record " + rec.id + " (line " + std::to_string(rec.line) + ")";
  EncodedRecord e;
  e.record = &rec;
  auto prompt = tokenizer_->Encode(rec.prompt, /*add_special_tokens=*/true);
  if (!prompt.ok()) return Status::InvalidArgument(who + ": prompt: " + prompt.status().message());
  e.prompt = std::move(*prompt);
  e.questions.resize(static_cast<size_t>(rec.num_turns()));
  int64_t inputs = static_cast<int64_t>(e.prompt.size());
  for (int t = 1; t < rec.num_turns(); ++t) {
    auto q = tokenizer_->Encode(rec.turns[t].question, /*add_special_tokens=*/false);
    if (!q.ok())
      return Status::InvalidArgument(who + ": turns[" + std::to_string(t) + "].question: " + q.status().message());
    e.questions[t] = std::move(*q);
    inputs += 1 + static_cast<int64_t>(e.questions[t].size());  // previous answer's last token + question
  }
  if (e.prompt.empty()) return Status::InvalidArgument(who + ": the prompt encodes to no tokens");
  if (segmented_) {
    // The first question: turns[0]'s, else the prompt's last line that starts with "Q: ".
    size_t q_at = std::string::npos;
    if (!rec.turns.empty()) {
      q_at = rec.prompt.size() - rec.turns[0].question.size();
    } else if (const size_t nl = rec.prompt.rfind("\nQ: "); nl != std::string::npos) {
      q_at = nl + 1;
    }
    auto doc = q_at == std::string::npos || q_at == 0
                   ? Result<std::vector<int32_t>>(Status::NotFound("no question"))
                   : tokenizer_->Encode(rec.prompt.substr(0, q_at), /*add_special_tokens=*/true);
    if (doc.ok() && !doc->empty() && doc->size() < e.prompt.size() &&
        std::equal(doc->begin(), doc->end(), e.prompt.begin())) {
      e.document_tokens = static_cast<int64_t>(doc->size());
    }
  }
  auto check_ids = [&](const std::vector<int32_t>& ids, const std::string& what) -> Status {
    for (int32_t id : ids) {
      if (id < 0 || id >= c.vocab_size) {
        return Status::InvalidArgument(who + ": " + what + " has token id " + std::to_string(id) +
                                       ", outside the model's vocabulary [0, " + std::to_string(c.vocab_size) + ")");
      }
    }
    return Status::OK();
  };
  PENUMBRA_RETURN_IF_ERROR(check_ids(e.prompt, "prompt"));
  for (size_t t = 1; t < e.questions.size(); ++t) {
    PENUMBRA_RETURN_IF_ERROR(check_ids(e.questions[t], "turns[" + std::to_string(t) + "].question"));
  }
  if (inputs > c.max_position_embeddings) {
    return Status::InvalidArgument(who + ": " + std::to_string(inputs) + " input tokens exceed the model's " +
                                   std::to_string(c.max_position_embeddings) + "-token context");
  }
  return e;
}

Result<std::vector<EvalTurnResult>> EvalRunner::Run(const EncodedRecord& r, int max_new_tokens) {
  if (max_new_tokens < 1) return Status::InvalidArgument("max_new_tokens must be >= 1");
  const EvalRecord& rec = *r.record;
  const int turns = rec.num_turns();
  const int vocab = runtime_->config().vocab_size;
  const int64_t P = static_cast<int64_t>(r.prompt.size());
  // KV rows needed at most: the prompt, max_new_tokens - 1 forwarded per turn
  // (a turn's last token is not), and per later turn that last token, a
  // newline and the question.
  int64_t capacity = P + static_cast<int64_t>(turns) * (max_new_tokens - 1);
  for (int t = 1; t < turns; ++t) {
    capacity += 1 + static_cast<int64_t>(newline_ids_.size() + r.questions[t].size());
  }
  const int64_t seq = next_seq_++;
  const int64_t doc = r.document_tokens;
  if (doc > 0) {
    SequenceSpec spec;
    spec.prompt_len = P;
    spec.max_new_tokens = capacity - P;
    spec.first_prefill = doc;
    PENUMBRA_RETURN_IF_ERROR(runtime_->policy().AddSequence(seq, spec));
  } else {
    PENUMBRA_RETURN_IF_ERROR(runtime_->AddSequence(seq, P, capacity - P));
  }
  struct Remove {
    Runtime* rt;
    int64_t seq;
    ~Remove() { rt->RemoveSequence(seq); }
  } remove{runtime_, seq};

  if (doc > 0) {
    PENUMBRA_RETURN_IF_ERROR(runtime_->Prefill(seq, r.prompt, nullptr, 0, doc));
    PENUMBRA_RETURN_IF_ERROR(runtime_->Prefill(seq, r.prompt, &logits_, doc));
  } else {
    PENUMBRA_RETURN_IF_ERROR(runtime_->Prefill(seq, r.prompt, &logits_));
  }
  int64_t pos = P;    // next position (= rows in the cache)
  int64_t total = P;  // eval_hf.py's input token count
  auto forward = [&](int32_t token) -> Status {
    PENUMBRA_ASSIGN_OR_RETURN(const float* dev, runtime_->DecodeStep({seq}, {token}, {pos}));
    ++pos;
    return runtime_->backend().CopyToHost(logits_.data(), dev, static_cast<size_t>(vocab) * sizeof(float));
  };

  std::vector<EvalTurnResult> results;
  std::vector<int32_t> carry;  // fed before the next question
  for (int t = 0; t < turns; ++t) {
    if (t > 0) {
      std::vector<int32_t> feed = carry;
      feed.insert(feed.end(), r.questions[t].begin(), r.questions[t].end());
      for (int32_t id : feed) PENUMBRA_RETURN_IF_ERROR(forward(id));
      total += static_cast<int64_t>(feed.size());
    }
    EvalTurnResult res;
    for (int k = 0; k < max_new_tokens; ++k) {
      const int32_t next = Argmax(logits_.data());
      res.ids.push_back(next);
      const bool stop = std::find(eos_ids_.begin(), eos_ids_.end(), next) != eos_ids_.end() || HasNewline(next);
      // The turn's last token is never forwarded here (it stops the turn or
      // exhausts max_new_tokens); the next turn feeds it first.
      if (stop || k + 1 == max_new_tokens) break;
      PENUMBRA_RETURN_IF_ERROR(forward(next));
      ++total;
    }
    // As `tokenizers`, ids that name no token decode to nothing.
    std::vector<int32_t> known;
    for (int32_t id : res.ids) {
      if (tokenizer_->IdToToken(id).has_value()) known.push_back(id);
    }
    auto text = tokenizer_->Decode(known, /*skip_special_tokens=*/false);
    if (!text.ok()) return Status::Internal("record " + rec.id + ": decoding the answer: " + text.status().message());
    res.text = std::move(*text);
    res.prediction = PredictionOf(res.text);
    res.input_tokens = total;
    const int32_t last = res.ids.back();
    carry.assign(1, last);
    if (!HasNewline(last)) carry.insert(carry.end(), newline_ids_.begin(), newline_ids_.end());
    results.push_back(std::move(res));
  }
  return results;
}

// ------------------------------------------------------------------ a run

std::string PredictionLineJson(const EvalRecord& rec, int turn, const EvalTurnResult& res, const EvalScore& s) {
  ordered_json j;
  j["id"] = rec.id;
  j["task"] = rec.task;
  j["length"] = rec.length;
  j["turn"] = turn;
  j["prediction"] = res.prediction;
  j["answer"] = AnswerJson(rec.answer_of(turn));
  j["correct"] = s.correct;
  j["partial"] = Round4(s.partial);
  j["tokens"] = res.input_tokens;
  return DumpPythonStyle(j);
}

std::string GroupLineJson(const EvalGroup& g, const std::string& kv_policy) {
  ordered_json j;
  j["engine"] = "penumbra";
  j["kv_policy"] = kv_policy;
  j["task"] = g.task;
  j["length"] = g.length;
  j["n"] = g.n;
  j["accuracy"] = g.n ? Round4(static_cast<double>(g.correct) / static_cast<double>(g.n)) : 0.0;
  j["partial"] = g.n ? Round4(g.partial_sum / static_cast<double>(g.n)) : 0.0;
  return DumpPythonStyle(j);
}

EvalOverall OverallOf(const EvalSummary& sum) {
  int64_t correct = 0, turns = 0;
  std::vector<int64_t> lengths;
  std::map<std::string, std::pair<int64_t, int64_t>> tasks;  // task -> (correct, turns)
  for (const EvalGroup& g : sum.groups) {
    if (g.task == "all") continue;
    correct += g.correct;
    turns += g.n;
    tasks[g.task].first += g.correct;
    tasks[g.task].second += g.n;
    if (std::find(lengths.begin(), lengths.end(), g.length) == lengths.end()) lengths.push_back(g.length);
  }
  std::sort(lengths.begin(), lengths.end());
  EvalOverall o;
  auto percent = [](int64_t c, int64_t n) {
    return n > 0 ? 100.0 * static_cast<double>(c) / static_cast<double>(n) : 0.0;
  };
  o.accuracy_percent = percent(correct, turns);
  for (const auto& [task, cn] : tasks) o.per_task_percent.emplace_back(task, percent(cn.first, cn.second));
  for (int64_t l : lengths) o.lengths += (o.lengths.empty() ? "" : ",") + std::to_string(l);
  return o;
}

Result<std::vector<EncodedRecord>> EncodeEvalRecords(const EvalRunner& runner, const std::vector<EvalRecord>& records) {
  std::vector<EncodedRecord> encoded;
  encoded.reserve(records.size());
  for (const EvalRecord& r : records) {
    PENUMBRA_ASSIGN_OR_RETURN(EncodedRecord e, runner.Encode(r));
    encoded.push_back(std::move(e));
  }
  return encoded;
}

Result<EvalSummary> RunEval(EvalRunner& runner, const std::vector<EncodedRecord>& encoded,
                            const EvalRunOptions& options, std::ostream* predictions) {
  const auto t0 = std::chrono::steady_clock::now();
  auto elapsed = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(); };
  std::map<std::pair<std::string, int64_t>, EvalGroup> groups;
  EvalSummary sum;
  for (size_t i = 0; i < encoded.size(); ++i) {
    const EvalRecord& rec = *encoded[i].record;
    const int mnt = options.max_new_tokens > 0 ? options.max_new_tokens : rec.max_new_tokens;
    PENUMBRA_ASSIGN_OR_RETURN(auto outs, runner.Run(encoded[i], mnt));
    int ok = 0;
    for (int t = 0; t < static_cast<int>(outs.size()); ++t) {
      const EvalScore s = ScorePrediction(outs[t].prediction, rec.answer_of(t));
      ok += s.correct;
      for (const std::string& task : {rec.task, std::string("all")}) {
        EvalGroup& g = groups[{task, rec.length}];
        g.task = task;
        g.length = rec.length;
        ++g.n;
        g.correct += s.correct;
        g.partial_sum += s.partial;
      }
      if (predictions) {
        *predictions << PredictionLineJson(rec, t, outs[t], s) << "\n";
        predictions->flush();
        if (!*predictions) return Status::IOError("writing the predictions file failed");
      }
    }
    ++sum.records;
    sum.turns += static_cast<int64_t>(outs.size());
    if (options.progress) {
      std::fprintf(stderr, "[%zu/%zu] %s: %d/%zu correct, %lld tokens (%.0f s)\n", i + 1, encoded.size(),
                   rec.id.c_str(), ok, outs.size(), static_cast<long long>(outs.back().input_tokens), elapsed());
    }
  }
  sum.seconds = elapsed();
  for (auto& [key, g] : groups) sum.groups.push_back(g);
  std::sort(sum.groups.begin(), sum.groups.end(), [](const EvalGroup& a, const EvalGroup& b) {
    return std::make_tuple(a.length, a.task == "all", a.task) < std::make_tuple(b.length, b.task == "all", b.task);
  });
  return sum;
}

}  // namespace penumbra
