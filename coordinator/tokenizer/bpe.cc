#include "coordinator/tokenizer/bpe.h"

#include <algorithm>
#include <cstdio>

#include <nlohmann/json.hpp>

#include "coordinator/tokenizer/unicode.h"

namespace penumbra::tokenizer_internal {
namespace {

using json = nlohmann::json;

Result<std::optional<std::string>> OptionalString(const json& obj, const char* key, const std::string& where) {
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) return std::optional<std::string>();
  if (!it->is_string()) return Status::InvalidArgument(where + ": model." + key + " must be a string or null");
  return std::optional<std::string>(it->get<std::string>());
}

Result<bool> OptionalBool(const json& obj, const char* key, bool dflt, const std::string& where) {
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) return dflt;
  if (!it->is_boolean()) return Status::InvalidArgument(where + ": model." + key + " must be a boolean");
  return it->get<bool>();
}

}  // namespace

Result<std::unique_ptr<BpeModel>> BpeModel::FromJson(const json& model, const std::string& where) {
  std::unique_ptr<BpeModel> m(new BpeModel());
  auto dropout = model.find("dropout");
  if (dropout != model.end() && !dropout->is_null() && !(dropout->is_number() && dropout->get<double>() == 0.0)) {
    return Status::Unimplemented(where + ": BPE dropout is not supported (model.dropout must be null)");
  }
  PENUMBRA_ASSIGN_OR_RETURN(m->unk_token_, OptionalString(model, "unk_token", where));
  PENUMBRA_ASSIGN_OR_RETURN(auto prefix, OptionalString(model, "continuing_subword_prefix", where));
  PENUMBRA_ASSIGN_OR_RETURN(auto suffix, OptionalString(model, "end_of_word_suffix", where));
  m->continuing_subword_prefix_ = prefix.value_or("");
  m->end_of_word_suffix_ = suffix.value_or("");
  PENUMBRA_ASSIGN_OR_RETURN(m->fuse_unk_, OptionalBool(model, "fuse_unk", false, where));
  PENUMBRA_ASSIGN_OR_RETURN(m->byte_fallback_, OptionalBool(model, "byte_fallback", false, where));
  PENUMBRA_ASSIGN_OR_RETURN(m->ignore_merges_, OptionalBool(model, "ignore_merges", false, where));

  auto vocab = model.find("vocab");
  if (vocab == model.end() || !vocab->is_object()) {
    return Status::InvalidArgument(where + ": model.vocab must be an object of token -> id");
  }
  m->vocab_.reserve(vocab->size());
  int64_t max_id = -1;
  for (auto it = vocab->begin(); it != vocab->end(); ++it) {
    if (!it.value().is_number_integer() || it.value().get<int64_t>() < 0 || it.value().get<int64_t>() > INT32_MAX - 1) {
      return Status::InvalidArgument(where + ": model.vocab[\"" + it.key() + "\"] must be a non-negative integer id");
    }
    if (FindInvalidUtf8(it.key()) != std::string_view::npos) {
      return Status::InvalidArgument(where + ": model.vocab has a token that is not valid UTF-8");
    }
    const int32_t id = static_cast<int32_t>(it.value().get<int64_t>());
    m->vocab_[it.key()] = id;
    max_id = std::max<int64_t>(max_id, id);
  }
  m->id_to_token_.resize(static_cast<size_t>(max_id + 1));
  m->id_present_.assign(static_cast<size_t>(max_id + 1), false);
  for (const auto& [token, id] : m->vocab_) {
    m->id_to_token_[id] = token;
    m->id_present_[id] = true;
    size_t i = 0;
    const char32_t cp = DecodeUtf8(token, &i);
    if (i == token.size() && !token.empty()) m->char_to_id_[cp] = id;
  }
  for (int b = 0; b < 256; ++b) {
    char name[8];
    std::snprintf(name, sizeof(name), "<0x%02X>", b);
    auto it = m->vocab_.find(std::string_view(name));
    m->byte_ids_[b] = it == m->vocab_.end() ? -1 : it->second;
  }
  if (m->unk_token_ && !m->vocab_.count(*m->unk_token_)) {
    return Status::InvalidArgument(where + ": model.unk_token \"" + *m->unk_token_ + "\" is not in model.vocab");
  }

  auto merges = model.find("merges");
  if (merges == model.end() || merges->is_null()) {
    // A vocabulary without merges is legal (every word stays in characters).
  } else if (!merges->is_array()) {
    return Status::InvalidArgument(where + ": model.merges must be an array");
  } else {
    m->merges_.Reserve(merges->size());
    const size_t prefix_len = m->continuing_subword_prefix_.size();
    int32_t rank = 0;
    for (const json& entry : *merges) {
      std::string a, b;
      if (entry.is_string()) {
        const std::string& s = entry.get_ref<const std::string&>();
        const size_t sp = s.find(' ');
        if (sp == std::string::npos || s.find(' ', sp + 1) != std::string::npos) {
          return Status::InvalidArgument(where + ": model.merges[" + std::to_string(rank) + "] \"" + s +
                                         "\" is not two tokens separated by one space");
        }
        a = s.substr(0, sp);
        b = s.substr(sp + 1);
      } else if (entry.is_array() && entry.size() == 2 && entry[0].is_string() && entry[1].is_string()) {
        a = entry[0].get<std::string>();
        b = entry[1].get<std::string>();
      } else {
        return Status::InvalidArgument(where + ": model.merges[" + std::to_string(rank) +
                                       "] must be \"a b\" or [\"a\", \"b\"]");
      }
      auto ia = m->vocab_.find(a);
      auto ib = m->vocab_.find(b);
      const std::string merged = a + (b.size() >= prefix_len ? b.substr(prefix_len) : std::string());
      auto in = m->vocab_.find(merged);
      if (ia == m->vocab_.end() || ib == m->vocab_.end() || in == m->vocab_.end()) {
        const std::string& missing = ia == m->vocab_.end() ? a : ib == m->vocab_.end() ? b : merged;
        return Status::InvalidArgument(where + ": model.merges[" + std::to_string(rank) + "] uses \"" + missing +
                                       "\", which is not in model.vocab");
      }
      // A repeated pair keeps its last rank, as in `tokenizers`.
      m->merges_.Put(PairKey(ia->second, ib->second), MergeValue{rank, in->second});
      ++rank;
    }
  }
  return m;
}

void BpeModel::MergeMap::Reserve(size_t n) {
  size_t cap = 16;
  int bits = 4;
  while (cap < 2 * n) {
    cap <<= 1;
    ++bits;
  }
  keys_.assign(cap, kEmpty);
  values_.assign(cap, MergeValue{0, 0});
  mask_ = cap - 1;
  shift_ = 64 - bits;
  size_ = 0;
}

void BpeModel::MergeMap::Put(uint64_t key, MergeValue v) {
  if (2 * (size_ + 1) > keys_.size()) {
    std::vector<uint64_t> old_keys = std::move(keys_);
    std::vector<MergeValue> old_values = std::move(values_);
    Reserve(size_ + 1 > 8 ? 2 * (size_ + 1) : 16);
    for (size_t i = 0; i < old_keys.size(); ++i) {
      if (old_keys[i] != kEmpty) Put(old_keys[i], old_values[i]);
    }
  }
  for (size_t i = Slot(key);; i = (i + 1) & mask_) {
    if (keys_[i] == key) {
      values_[i] = v;
      return;
    }
    if (keys_[i] == kEmpty) {
      keys_[i] = key;
      values_[i] = v;
      ++size_;
      return;
    }
  }
}

std::optional<int32_t> BpeModel::TokenToId(std::string_view token) const {
  auto it = vocab_.find(token);
  if (it == vocab_.end()) return std::nullopt;
  return it->second;
}

const std::string* BpeModel::IdToToken(int32_t id) const {
  if (id < 0 || static_cast<size_t>(id) >= id_to_token_.size() || !id_present_[id]) return nullptr;
  return &id_to_token_[id];
}

void BpeModel::Tokenize(std::string_view word, std::vector<int32_t>* out) const {
  if (word.empty()) return;
  if (ignore_merges_) {
    auto it = vocab_.find(word);
    if (it != vocab_.end()) {
      out->push_back(it->second);
      return;
    }
  }
  std::vector<int32_t> ids;
  std::vector<uint32_t> lens;
  ids.reserve(word.size());
  lens.reserve(word.size());
  const bool plain = continuing_subword_prefix_.empty() && end_of_word_suffix_.empty();
  const int32_t unk_id = unk_token_ ? vocab_.find(*unk_token_)->second : -1;
  bool have_unk = false;
  uint32_t unk_len = 0;
  std::string symbol;
  size_t i = 0;
  while (i < word.size()) {
    const size_t start = i;
    const char32_t cp = DecodeUtf8(word, &i);
    const uint32_t byte_len = static_cast<uint32_t>(i - start);
    const std::string_view piece = word.substr(start, byte_len);
    int32_t id = -1;
    if (plain) {
      auto it = char_to_id_.find(cp);
      if (it != char_to_id_.end()) id = it->second;
      symbol.assign(piece);
    } else {
      symbol.clear();
      if (start != 0) symbol += continuing_subword_prefix_;
      symbol += piece;
      if (i == word.size()) symbol += end_of_word_suffix_;
      auto it = vocab_.find(symbol);
      if (it != vocab_.end()) id = it->second;
    }
    if (id >= 0) {
      if (have_unk) {
        ids.push_back(unk_id);
        lens.push_back(unk_len);
        have_unk = false;
      }
      ids.push_back(id);
      lens.push_back(byte_len);
      continue;
    }
    if (byte_fallback_) {
      bool all = true;
      for (unsigned char b : symbol) all = all && byte_ids_[b] >= 0;
      if (all) {
        for (unsigned char b : symbol) {
          ids.push_back(byte_ids_[b]);
          lens.push_back(1);
        }
        continue;
      }
    }
    if (unk_id >= 0) {
      if (have_unk && fuse_unk_) {
        unk_len += byte_len;
      } else {
        if (have_unk) {
          ids.push_back(unk_id);
          lens.push_back(unk_len);
        }
        have_unk = true;
        unk_len = byte_len;
      }
    }
    // With neither byte fallback nor an unk token the character is dropped.
  }
  if (have_unk) {
    ids.push_back(unk_id);
    lens.push_back(unk_len);
  }
  MergeAll(&ids, &lens);
  out->insert(out->end(), ids.begin(), ids.end());
}

void BpeModel::MergeAll(std::vector<int32_t>* ids, std::vector<uint32_t>* lens) const {
  const size_t n = ids->size();
  if (n < 2) return;
  struct Symbol {
    int32_t id;
    int64_t prev, next;
    uint32_t len;  // bytes; 0 marks a symbol merged into its left neighbour
  };
  std::vector<Symbol> sym(n);
  for (size_t k = 0; k < n; ++k) {
    sym[k] = Symbol{(*ids)[k], static_cast<int64_t>(k) - 1, k + 1 < n ? static_cast<int64_t>(k + 1) : -1, (*lens)[k]};
  }
  // Ordered by (rank, position): lowest rank first, then leftmost.
  struct Candidate {
    uint64_t order;
    int32_t new_id;
  };
  auto order = [](int32_t rank, size_t pos) { return (static_cast<uint64_t>(rank) << 32) | pos; };
  auto later = [](const Candidate& x, const Candidate& y) { return x.order > y.order; };
  std::vector<Candidate> queue;
  queue.reserve(n);
  for (size_t k = 0; k + 1 < n; ++k) {
    if (const MergeValue* mv = FindMerge(sym[k].id, sym[k + 1].id)) queue.push_back({order(mv->rank, k), mv->new_id});
  }
  std::make_heap(queue.begin(), queue.end(), later);
  auto push = [&](Candidate c) {
    queue.push_back(c);
    std::push_heap(queue.begin(), queue.end(), later);
  };
  while (!queue.empty()) {
    std::pop_heap(queue.begin(), queue.end(), later);
    const Candidate top = queue.back();
    queue.pop_back();
    const size_t top_pos = static_cast<size_t>(top.order & 0xFFFFFFFFu);
    Symbol& cur = sym[top_pos];
    if (cur.len == 0 || cur.next < 0) continue;
    const size_t next_pos = static_cast<size_t>(cur.next);
    const Symbol right = sym[next_pos];
    // Skip entries made stale by an earlier merge.
    const MergeValue* mv = FindMerge(cur.id, right.id);
    if (mv == nullptr || mv->new_id != top.new_id) continue;
    cur.id = top.new_id;
    cur.len += right.len;
    cur.next = right.next;
    sym[next_pos].len = 0;
    if (right.next >= 0) sym[static_cast<size_t>(right.next)].prev = static_cast<int64_t>(top_pos);
    if (cur.prev >= 0) {
      const size_t prev = static_cast<size_t>(cur.prev);
      if (const MergeValue* pm = FindMerge(sym[prev].id, cur.id)) push({order(pm->rank, prev), pm->new_id});
    }
    if (cur.next >= 0) {
      if (const MergeValue* nm = FindMerge(cur.id, sym[static_cast<size_t>(cur.next)].id)) {
        push({order(nm->rank, top_pos), nm->new_id});
      }
    }
  }
  ids->clear();
  lens->clear();
  for (const Symbol& s : sym) {
    if (s.len == 0) continue;
    ids->push_back(s.id);
    lens->push_back(s.len);
  }
}

}  // namespace penumbra::tokenizer_internal
