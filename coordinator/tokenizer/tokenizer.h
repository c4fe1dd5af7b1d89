// Tokenizer: a Hugging Face `tokenizer.json` tokenizer with the exact ids of
// the Python/Rust `tokenizers` library.
//
// Supported pipelines (everything else is refused with Unimplemented when the
// file is loaded, never approximated):
//   model          BPE (byte fallback, unk/fuse_unk, ignore_merges,
//                  continuing_subword_prefix, end_of_word_suffix; no dropout)
//   normalizer     NFC NFD NFKC NFKD Lowercase Prepend Replace Strip Sequence
//   pre_tokenizer  ByteLevel (use_regex, add_prefix_space) Split Metaspace
//                  Sequence
//   post_processor TemplateProcessing (single) BertProcessing
//                  RobertaProcessing ByteLevel Sequence
//   decoder        ByteLevel Replace ByteFallback Fuse Strip Metaspace Sequence
// This covers byte-level BPE with a split regex (GPT-2, Qwen2, Llama-3 and the
// files `tokenizers` writes for our own byte-level models) and
// SentencePiece-style BPE with byte fallback (Llama-2).
//
// Added tokens (added_tokens) are cut out of the raw text before
// normalization exactly as `tokenizers` does: leftmost-longest, honouring
// single_word, lstrip, rstrip and normalized.
//
// Thread-safety: a Tokenizer is immutable after FromFile; Encode and Decode
// may run concurrently.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "common/status.h"

namespace penumbra {

namespace tokenizer_internal {
class AddedTokenMatcher;
class BpeModel;
class Decoder;
class Normalizer;
class PostProcessor;
class PreTokenizer;
}  // namespace tokenizer_internal

class Tokenizer {
 public:
  // Loads `tokenizer_json_path`. bos_id()/eos_ids() also read
  // tokenizer_config.json and generation_config.json from the same folder
  // when they exist. Errors name the file and the offending key: NotFound
  // (no file), InvalidArgument (malformed JSON or fields), Unimplemented (a
  // model, normalizer, ... type this class does not implement).
  static Result<std::unique_ptr<Tokenizer>> FromFile(const std::string& tokenizer_json_path);
  // The same from the text of a tokenizer.json; `name` labels errors. Only the
  // post-processor and well-known token names inform bos_id()/eos_ids().
  static Result<std::unique_ptr<Tokenizer>> FromJsonString(std::string_view tokenizer_json, const std::string& name);

  ~Tokenizer();
  Tokenizer(const Tokenizer&) = delete;
  Tokenizer& operator=(const Tokenizer&) = delete;

  // `text` must be valid UTF-8 (InvalidArgument naming the first bad byte
  // otherwise). With add_special_tokens the post-processor's template is
  // applied (e.g. a BOS), as `tokenizers` encode(text, add_special_tokens).
  Result<std::vector<int32_t>> Encode(std::string_view text, bool add_special_tokens) const;

  // Inverse of Encode through the file's decoder. An id that names no token
  // is InvalidArgument naming it. skip_special_tokens drops added tokens
  // marked special. Invalid byte sequences decode to U+FFFD, as in
  // `tokenizers`, so the result is always valid UTF-8.
  Result<std::string> Decode(std::span<const int32_t> ids, bool skip_special_tokens) const;

  // One past the largest id (model vocabulary and added tokens).
  int32_t vocab_size() const { return vocab_size_; }
  // Added tokens first, then the model vocabulary.
  std::optional<int32_t> TokenToId(std::string_view token) const;
  std::optional<std::string> IdToToken(int32_t id) const;
  // True for added tokens marked "special" (skipped by skip_special_tokens).
  bool IsSpecial(int32_t id) const;

  // Beginning-of-sequence id: tokenizer_config.json "bos_token", else
  // generation_config.json "bos_token_id", else the first special token the
  // post-processor puts before the text; nullopt when none. Note Encode adds
  // it only where the post-processor does (Llama-2's tokenizer.json here does
  // not): a caller that wants a BOS and sees none from Encode adds bos_id().
  std::optional<int32_t> bos_id() const { return bos_id_; }
  // End-of-sequence ids: tokenizer_config.json "eos_token" and
  // generation_config.json "eos_token_id" (int or list); else the special
  // tokens the post-processor appends; else special added tokens with a
  // well-known end name (</s>, <|endoftext|>, <|im_end|>, <|eot_id|>,
  // <|end_of_text|>, <eos>).
  std::vector<int32_t> eos_ids() const { return eos_ids_; }

 private:
  Tokenizer();
  Status DetectSpecialIds(const std::string& dir);

  std::unique_ptr<tokenizer_internal::BpeModel> model_;
  std::unique_ptr<tokenizer_internal::Normalizer> normalizer_;
  std::unique_ptr<tokenizer_internal::PreTokenizer> pre_tokenizer_;
  std::unique_ptr<tokenizer_internal::PostProcessor> post_processor_;
  std::unique_ptr<tokenizer_internal::Decoder> decoder_;
  std::unique_ptr<tokenizer_internal::AddedTokenMatcher> raw_matcher_;         // normalized == false
  std::unique_ptr<tokenizer_internal::AddedTokenMatcher> normalized_matcher_;  // normalized == true
  std::unordered_map<std::string, int32_t> added_by_content_;
  std::unordered_map<int32_t, std::string> added_by_id_;
  std::unordered_set<std::string> special_contents_;
  std::unordered_set<int32_t> special_ids_;
  int32_t vocab_size_ = 0;
  std::optional<int32_t> bos_id_;
  std::vector<int32_t> eos_ids_;
};

}  // namespace penumbra
