// Text <-> ids for a model directory: its tokenizer.json when present, else a
// decode-only table from vocab_pieces.json (llama2.c-converted models such as
// stories260K ship no tokenizer.json).
#pragma once

#include <memory>
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

}  // namespace penumbra
