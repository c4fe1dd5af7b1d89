// The input of `penumbra job submit`: a JSON-lines file, read and checked
// whole before anything is sent (a bad line refuses the file, and no job is
// made).
//
// Each non-blank line is one JSON object, in one of two forms:
//
//   one item:
//     {"custom_id": "q1", "documents": ["doc-..."], "question": "Q: ...\nA:", "max_new_tokens": 32}
//   a question list over the same documents (one item per question):
//     {"custom_id_prefix": "city", "documents": ["doc-..."], "questions": ["Q1", "Q2"]}
//     -> items "city-0" and "city-1": PREFIX-I, I the question's 0-based index
//        in that line's list; the line's other keys apply to every item.
//
// Keys of either form:
//   documents        list of document ids the question follows (default: none)
//   question         the question's text; or question_ids, its token ids (for
//                    a model without a tokenizer): exactly one of question,
//                    question_ids, questions
//   max_new_tokens   integer in [1, 2^20]          (default: the server's, 256)
//   temperature      number in [0, 100]            (default 0: greedy)
//   top_k            integer >= 0                  (default 0: off)
//   top_p            number in (0, 1]              (default 1: off)
//   seed             integer >= 0                  (default 0)
//   stop             list of at most 16 strings, each 1..256 bytes
//   kv_policy        "full" or "shadowkv"          (default: any worker)
// Any other key is an error (a typo must not be ignored). custom_id (and each
// expanded id) is 1..256 bytes and unique in the file; a file has 1..50000
// items. Blank lines are skipped; line numbers count every line from 1.
// Errors are InvalidArgument and read `FILE:LINE: "KEY" must be ...`.
#pragma once

#include <istream>
#include <string>
#include <vector>

#include "common/status.h"
#include "gen-cpp/penumbra_types.h"

namespace penumbra {

inline constexpr size_t kMaxJobFileItems = 50000;

struct JobFile {
  std::vector<rpc::JobItem> items;  // in file order
  std::vector<int64_t> lines;       // lines[i]: the line items[i] came from (1-based)
};

// Reads and checks `path`; errors name it (as given) and the line.
Result<JobFile> ReadJobFile(const std::string& path);

// The same over a stream; `name` stands for the file in errors.
Result<JobFile> ParseJobLines(std::istream& in, const std::string& name);

}  // namespace penumbra
