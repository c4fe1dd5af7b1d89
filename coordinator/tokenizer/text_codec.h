// Text <-> ids for a model directory: its tokenizer.json when present, else a
// decode-only table from vocab_pieces.json (llama2.c-converted models such as
// stories260K ship no tokenizer.json).
#pragma once

#include <memory>
#include <span>
#include <string>
#include <vector>

#include "common/status.h"
#include "coordinator/tokenizer/tokenizer.h"

namespace penumbra {

class TextCodec {
 public:
  static Result<std::unique_ptr<TextCodec>> ForModel(const std::string& model_dir);
  bool can_encode() const { return tokenizer_ != nullptr; }
  // With add_special_tokens the tokenizer's template applies (e.g. a BOS
  // before the text): the start of a prompt. Without: text that continues one.
  Result<std::vector<int32_t>> Encode(const std::string& text, bool add_special_tokens = true) const;
  // How many of `ids`' first tokens are special (a BOS the template added).
  int LeadingSpecialTokens(const std::vector<int32_t>& ids) const;
  Result<std::string> Decode(const std::vector<int32_t>& ids) const;

 private:
  std::unique_ptr<Tokenizer> tokenizer_;
  std::vector<std::string> pieces_;  // decode-only fallback
};

// The text of generated ids as they come, decoded incrementally: each Append
// decodes a short window (the ids since the previous emission and the ones
// before it, which give the new ones their context: a leading space, a
// multi-byte character split over tokens) instead of every id so far, so a
// long stream costs the same per token at its end as at its start. Text only
// grows: a character whose bytes have not all come (decoded as U+FFFD) waits
// for the next ids; Finish adds whatever is pending, as decoding every id at
// once would. The result equals TextCodec::Decode of all the ids.
class IncrementalText {
 public:
  Status Append(const TextCodec& codec, std::span<const int32_t> ids);
  Status Finish(const TextCodec& codec);
  const std::string& text() const { return text_; }
  // The ids appended so far.
  size_t size() const { return ids_.size(); }

 private:
  // Decodes ids_[prefix_, end).
  Result<std::string> Window(const TextCodec& codec, size_t end) const;
  std::vector<int32_t> ids_;
  size_t prefix_ = 0, read_ = 0;  // the window's start; the ids emitted end here
  std::string text_;
};

}  // namespace penumbra
