// penumbra eval: a JSONL long-context task set (docs/evalmodel.md) run through
// our engine and scored exactly as ops/evalmodel/eval_hf.py and scoring.py do,
// so that greedy predictions can be compared record by record with
// ops/evalmodel/compare_predictions.py.
//
// Three parts: records (parse + validate a task file), scoring (prediction
// text -> correct/partial), and EvalRunner (one record through a Runtime with
// greedy decoding, turn by turn on one KV cache).
#pragma once

#include <cstdint>
#include <memory>
#include <ostream>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/status.h"
#include "coordinator/tokenizer/tokenizer.h"
#include "worker/engine/runtime.h"

namespace penumbra {

// ----------------------------------------------------------------- records

// A gold answer: a string, or a list of strings (scored as a set).
struct EvalAnswer {
  bool is_list = false;
  std::string text;                // when !is_list
  std::vector<std::string> items;  // when is_list
};

struct EvalTurn {
  std::string question;  // "Q: ...\nA:"; turn 0's is the end of the record's prompt
  EvalAnswer answer;
};

struct EvalRecord {
  std::string id;
  std::string task;
  int64_t length = 0;
  std::string prompt;
  EvalAnswer answer;
  int max_new_tokens = 64;
  // Multi-turn records only (empty otherwise); turns[0].answer == answer.
  std::vector<EvalTurn> turns;
  int line = 0;  // 1-based line in the task file

  int num_turns() const { return turns.empty() ? 1 : static_cast<int>(turns.size()); }
  const EvalAnswer& answer_of(int turn) const { return turns.empty() ? answer : turns[turn].answer; }
};

// Parses one JSON line; errors are InvalidArgument "WHERE: field: what".
Result<EvalRecord> ParseEvalRecord(std::string_view line, const std::string& where);
// Every non-blank line of `text` (a whole task file named `file` in errors,
// as FILE:LINE). Fails on the first bad line or a duplicate id; nothing is
// returned unless the whole file is valid.
Result<std::vector<EvalRecord>> ParseEvalRecords(std::string_view text, const std::string& file);
Result<std::vector<EvalRecord>> LoadEvalRecords(const std::string& path);

struct EvalSelection {
  std::vector<std::string> tasks;  // keep only these tasks (empty: all). Default: empty.
  std::vector<int64_t> lengths;    // keep only these lengths (empty: all). Default: empty.
  int64_t limit = 0;               // first N records per (task, length) in file order (0: all). Default: 0.
};
std::vector<EvalRecord> SelectEvalRecords(const std::vector<EvalRecord>& records, const EvalSelection& selection);

// ----------------------------------------------------------------- scoring

// The generated text before its first '\n', stripped of surrounding
// whitespace (Python str.strip(): Unicode whitespace).
std::string PredictionOf(std::string_view generated_text);
// Python str.strip() on UTF-8 text.
std::string StripPythonWhitespace(std::string_view s);

struct EvalScore {
  bool correct = false;
  double partial = 0.0;  // fraction of gold list items present (1/0 for strings)
};
// String: exact equality. List: the prediction split on ',', items stripped,
// empty ones dropped; correct iff the item set equals the gold set.
EvalScore ScorePrediction(const std::string& prediction, const EvalAnswer& answer);

// ------------------------------------------------------------------ runner

// A record's token ids: the prompt with the tokenizer's specials (BOS) and
// each later turn's question without.
struct EncodedRecord {
  const EvalRecord* record = nullptr;
  std::vector<int32_t> prompt;
  std::vector<std::vector<int32_t>> questions;  // [turn]; questions[0] unused (part of the prompt)
  // With SetSegmented: the tokens of the prompt's context (the prompt less
  // its first question: turns[0].question, else from the last line that
  // starts with "Q: ") when they are the prompt's first tokens, else 0.
  int64_t document_tokens = 0;
};

struct EvalTurnResult {
  std::vector<int32_t> ids;  // generated ids (the stop token included)
  std::string text;          // Decode(ids), specials kept
  std::string prediction;    // PredictionOf(text)
  int64_t input_tokens = 0;  // tokens fed to the model so far (eval_hf.py's `total`)
};

class EvalRunner {
 public:
  // `runtime` and `tokenizer` must outlive the runner. eos_ids: the model's.
  static Result<std::unique_ptr<EvalRunner>> Create(Runtime* runtime, const Tokenizer* tokenizer,
                                                    std::vector<int32_t> eos_ids);

  // Tokenizes a record and checks it fits the model: ids inside the
  // vocabulary, and its input tokens (prompt plus, per later turn, the
  // previous answer's last token and the question) within
  // max_position_embeddings. Errors name the record id.
  Result<EncodedRecord> Encode(const EvalRecord& record) const;

  // Runs every turn of `r` (see docs/evalmodel.md "Running a record") on one
  // new sequence, removed again before returning (also on errors).
  Result<std::vector<EvalTurnResult>> Run(const EncodedRecord& r, int max_new_tokens);

  // True when the token's text (specials kept) contains '\n'.
  bool HasNewline(int32_t id) const;

  // Segmented prompts (--segmented): the context is prefilled first and the
  // first question continues it, as a question about a cached document is
  // served (for shadowkv: the context factored, the question a continuation,
  // shadowkv.continuation auto, dense or sparse).
  void SetSegmented(bool on) { segmented_ = on; }

 private:
  EvalRunner() = default;
  int32_t Argmax(const float* logits_host) const;  // ties to the lowest id

  Runtime* runtime_ = nullptr;
  const Tokenizer* tokenizer_ = nullptr;
  std::vector<int32_t> eos_ids_;
  std::vector<int32_t> newline_ids_;       // Encode("\n") without specials
  std::vector<int8_t> token_has_newline_;  // [vocab]
  int64_t next_seq_ = 0;
  bool segmented_ = false;
  std::vector<float> logits_;
};

// ------------------------------------------------------------------ a run

struct EvalRunOptions {
  int max_new_tokens = 0;  // > 0 replaces every record's max_new_tokens. Default: 0.
  bool progress = false;   // one line per record on stderr. Default: false.
};

// Accuracy of one (task, length); task "all" aggregates every task.
struct EvalGroup {
  std::string task;
  int64_t length = 0;
  int64_t n = 0;
  int64_t correct = 0;
  double partial_sum = 0.0;
};

struct EvalSummary {
  std::vector<EvalGroup> groups;  // ordered as eval_hf.py prints them
  int64_t records = 0;
  int64_t turns = 0;
  double seconds = 0.0;
};

// Encodes (and so validates, see EvalRunner::Encode) every record; the first
// bad one fails the whole set. The result points into `records`.
Result<std::vector<EncodedRecord>> EncodeEvalRecords(const EvalRunner& runner, const std::vector<EvalRecord>& records);

// Runs the records in order. When `predictions` is non-null, writes one JSON
// line per turn (the fields of eval_hf.py's --predictions file) and flushes
// it after each line, so an interrupted run keeps what it finished.
Result<EvalSummary> RunEval(EvalRunner& runner, const std::vector<EncodedRecord>& records,
                            const EvalRunOptions& options, std::ostream* predictions);

// One --predictions line (no newline).
std::string PredictionLineJson(const EvalRecord& record, int turn, const EvalTurnResult& result,
                               const EvalScore& score);
// One result line: {"engine": "penumbra", "kv_policy", "task", "length", "n",
// "accuracy", "partial"} (no newline).
std::string GroupLineJson(const EvalGroup& group, const std::string& kv_policy);

// A run's overall figures for its summary line: the percent of turns
// answered exactly over every task and length (the "all" groups left out),
// the same per task over every length (by task name; issue 20's rule is per
// task), and the lengths run, ascending, comma-separated ("16384,32768").
struct EvalOverall {
  double accuracy_percent = 0.0;
  std::vector<std::pair<std::string, double>> per_task_percent;
  std::string lengths;
};
EvalOverall OverallOf(const EvalSummary& summary);

}  // namespace penumbra
