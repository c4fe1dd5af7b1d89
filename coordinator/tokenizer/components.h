// The stages of a Hugging Face tokenizer.json pipeline (internal to
// coordinator/tokenizer): added-token splitting, normalizers, pre-tokenizers,
// post-processors and decoders. Each is parsed from its JSON object and is
// immutable afterwards, so a built pipeline may be shared across threads.
//
// Offsets are not tracked: Encode only needs ids, so a piece is plain text.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "common/status.h"
#include "coordinator/tokenizer/regex.h"

namespace penumbra::tokenizer_internal {

// A span of the input on its way through the pipeline.
struct Piece {
  std::string text;
  int32_t id = -1;         // >= 0: an added token, final
  bool at_origin = false;  // starts at byte 0 of the input (Metaspace "first")
};

// A literal or a regex, matched as `tokenizers` Pattern::find_matches does:
// the result covers the whole input as (start, end, is_match) spans.
class SplitPattern {
 public:
  struct Span {
    size_t start, end;
    bool is_match;
  };
  // `pattern` is {"String": "..."} or {"Regex": "..."}.
  static Result<SplitPattern> FromJson(const nlohmann::json& pattern, const std::string& where);
  static SplitPattern Literal(std::string s);
  static SplitPattern FromRegex(std::shared_ptr<const Regex> re);
  Status Find(std::string_view s, std::vector<Span>* out) const;

 private:
  std::string literal_;
  std::shared_ptr<const Regex> regex_;
};

enum class SplitBehavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };

// Splits `s` at `pattern` with `behavior` (as NormalizedString::split);
// appends the [start, end) byte ranges of the parts, empty ones included.
Status SplitText(std::string_view s, const SplitPattern& pattern, SplitBehavior behavior, bool invert,
                 std::vector<std::pair<size_t, size_t>>* parts);

// ---- added tokens -----------------------------------------------------------
struct AddedToken {
  std::string content;
  int32_t id = -1;
  bool single_word = false;
  bool lstrip = false;
  bool rstrip = false;
  bool normalized = true;
  bool special = false;
};

// Finds added tokens leftmost-longest (like an Aho-Corasick automaton in
// LeftmostLongest mode) and cuts them out of the unfinished pieces.
class AddedTokenMatcher {
 public:
  // `patterns[i]` is the text matched for `tokens[i]` (its content, or its
  // normalized content).
  AddedTokenMatcher(std::vector<AddedToken> tokens, std::vector<std::string> patterns);
  bool empty() const { return tokens_.empty(); }
  void Split(std::vector<Piece>* pieces) const;

 private:
  void SplitOne(Piece piece, std::vector<Piece>* out) const;
  std::vector<AddedToken> tokens_;
  std::vector<std::string> patterns_;
  std::vector<std::vector<uint32_t>> by_first_byte_;  // indices, longest first
};

// ---- normalizers ------------------------------------------------------------
class Normalizer {
 public:
  virtual ~Normalizer() = default;
  // `s` is valid UTF-8 and stays so.
  virtual Status Normalize(std::string* s) const = 0;
};
// `j` may be null (no normalizer: returns nullptr).
Result<std::unique_ptr<Normalizer>> NormalizerFromJson(const nlohmann::json& j, const std::string& where);

// ---- pre-tokenizers ---------------------------------------------------------
class PreTokenizer {
 public:
  virtual ~PreTokenizer() = default;
  // Rewrites and splits every unfinished piece; drops empty ones.
  virtual Status PreTokenize(std::vector<Piece>* pieces) const = 0;
};
Result<std::unique_ptr<PreTokenizer>> PreTokenizerFromJson(const nlohmann::json& j, const std::string& where);

// ---- post-processors ----------------------------------------------------------
class PostProcessor {
 public:
  virtual ~PostProcessor() = default;
  // Adds the special tokens around a single sequence.
  virtual void Process(std::vector<int32_t>* ids) const = 0;
};
Result<std::unique_ptr<PostProcessor>> PostProcessorFromJson(const nlohmann::json& j, const std::string& where);

// ---- decoders -----------------------------------------------------------------
class Decoder {
 public:
  virtual ~Decoder() = default;
  // Rewrites the token strings; the caller concatenates what is left.
  virtual void DecodeChain(std::vector<std::string>* tokens) const = 0;
};
Result<std::unique_ptr<Decoder>> DecoderFromJson(const nlohmann::json& j, const std::string& where);

}  // namespace penumbra::tokenizer_internal
