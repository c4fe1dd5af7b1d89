// Byte-pair-encoding model of a Hugging Face tokenizer.json (internal to
// coordinator/tokenizer).
//
// Merges follow `tokenizers` exactly: the word starts as one symbol per
// character (vocabulary lookup, else byte fallback <0xNN>, else the unk
// token), then the pair with the lowest merge rank is merged, leftmost first,
// through a priority queue (O(n log n) in the word length). Immutable after
// construction, so Tokenize may be called from many threads.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "common/status.h"

namespace penumbra::tokenizer_internal {

// Hash/equality that let an unordered_map<std::string, V> be probed with a
// string_view without building a std::string.
struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};
struct StringEq {
  using is_transparent = void;
  bool operator()(std::string_view a, std::string_view b) const { return a == b; }
};
using StringIdMap = std::unordered_map<std::string, int32_t, StringHash, StringEq>;

class BpeModel {
 public:
  // `model` is the "model" object of tokenizer.json; `where` prefixes errors.
  static Result<std::unique_ptr<BpeModel>> FromJson(const nlohmann::json& model, const std::string& where);

  // Appends the ids of one pre-token (valid UTF-8, non-empty).
  void Tokenize(std::string_view word, std::vector<int32_t>* out) const;

  std::optional<int32_t> TokenToId(std::string_view token) const;
  // nullptr when no vocabulary entry has this id.
  const std::string* IdToToken(int32_t id) const;
  // Largest id in the vocabulary, -1 when empty.
  int32_t max_id() const { return static_cast<int32_t>(id_to_token_.size()) - 1; }

 private:
  struct MergeValue {
    int32_t rank;
    int32_t new_id;
  };
  static uint64_t PairKey(int32_t a, int32_t b) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
  }
  // Open-addressing (linear probing) map from a token-id pair to its merge.
  class MergeMap {
   public:
    void Reserve(size_t n);
    // Inserts or overwrites.
    void Put(uint64_t key, MergeValue v);
    const MergeValue* Find(uint64_t key) const {
      if (keys_.empty()) return nullptr;
      for (size_t i = Slot(key);; i = (i + 1) & mask_) {
        if (keys_[i] == key) return &values_[i];
        if (keys_[i] == kEmpty) return nullptr;
      }
    }

   private:
    static constexpr uint64_t kEmpty = ~uint64_t{0};  // ids are non-negative
    size_t Slot(uint64_t key) const { return static_cast<size_t>((key * 0x9E3779B97F4A7C15ull) >> shift_); }
    std::vector<uint64_t> keys_;
    std::vector<MergeValue> values_;
    size_t mask_ = 0;
    int shift_ = 64;
    size_t size_ = 0;
  };
  const MergeValue* FindMerge(int32_t a, int32_t b) const { return merges_.Find(PairKey(a, b)); }
  void MergeAll(std::vector<int32_t>* ids, std::vector<uint32_t>* lens) const;

  StringIdMap vocab_;
  std::vector<std::string> id_to_token_;
  std::vector<bool> id_present_;
  // Single-code-point tokens, for the common case with no prefix/suffix.
  std::unordered_map<char32_t, int32_t> char_to_id_;
  MergeMap merges_;
  std::optional<std::string> unk_token_;
  std::string continuing_subword_prefix_;
  std::string end_of_word_suffix_;
  bool fuse_unk_ = false;
  bool byte_fallback_ = false;
  bool ignore_merges_ = false;
  int32_t byte_ids_[256];  // <0xNN> ids, -1 where absent
};

}  // namespace penumbra::tokenizer_internal
