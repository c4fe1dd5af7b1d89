#include "coordinator/tokenizer/components.h"

#include <algorithm>
#include <cstdlib>

#include <nlohmann/json.hpp>

#include "coordinator/tokenizer/unicode.h"

namespace penumbra::tokenizer_internal {
namespace {

using json = nlohmann::json;

// The GPT-2 pre-tokenization regex of the ByteLevel pre-tokenizer.
constexpr std::string_view kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

Result<std::string> TypeOf(const json& j, const std::string& where) {
  if (!j.is_object()) return Status::InvalidArgument(where + " must be an object");
  auto t = j.find("type");
  if (t == j.end() || !t->is_string()) return Status::InvalidArgument(where + ".type must be a string");
  return t->get<std::string>();
}

Result<std::string> StringField(const json& j, const char* key, const std::string& where) {
  auto it = j.find(key);
  if (it == j.end() || !it->is_string()) return Status::InvalidArgument(where + "." + key + " must be a string");
  return it->get<std::string>();
}

Result<bool> BoolField(const json& j, const char* key, bool dflt, const std::string& where) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return dflt;
  if (!it->is_boolean()) return Status::InvalidArgument(where + "." + key + " must be a boolean");
  return it->get<bool>();
}

Result<const json*> ArrayField(const json& j, const char* key, const std::string& where) {
  auto it = j.find(key);
  if (it == j.end() || !it->is_array()) return Status::InvalidArgument(where + "." + key + " must be an array");
  return &*it;
}

// Exactly one code point.
Result<std::string> CharField(const json& j, const char* key, const std::string& where) {
  PENUMBRA_ASSIGN_OR_RETURN(std::string s, StringField(j, key, where));
  size_t i = 0;
  if (s.empty() || (DecodeUtf8(s, &i), i != s.size())) {
    return Status::InvalidArgument(where + "." + key + " must be a single character");
  }
  return s;
}

std::string ReplaceAll(std::string_view s, std::string_view from, std::string_view to) {
  std::string out;
  out.reserve(s.size() + s.size() / 4);
  size_t pos = 0;
  while (true) {
    const size_t hit = s.find(from, pos);
    if (hit == std::string_view::npos) break;
    out.append(s.substr(pos, hit - pos));
    out.append(to);
    pos = hit + from.size();
  }
  out.append(s.substr(pos));
  return out;
}

// NormalizedString::replace: every match of `pattern` becomes `content`.
Status ReplacePattern(const SplitPattern& pattern, std::string_view content, std::string* s) {
  std::vector<SplitPattern::Span> spans;
  PENUMBRA_RETURN_IF_ERROR(pattern.Find(*s, &spans));
  std::string out;
  out.reserve(s->size());
  for (const auto& sp : spans) {
    if (sp.is_match) {
      out.append(content);
    } else {
      out.append(*s, sp.start, sp.end - sp.start);
    }
  }
  *s = std::move(out);
  return Status::OK();
}

// Runs `fn(piece, out)` on every unfinished piece and keeps finished ones;
// empty results are dropped.
template <typename Fn>
Status ForEachUnfinished(std::vector<Piece>* pieces, Fn&& fn) {
  std::vector<Piece> out;
  out.reserve(pieces->size());
  for (Piece& p : *pieces) {
    if (p.id >= 0) {
      out.push_back(std::move(p));
      continue;
    }
    const size_t before = out.size();
    PENUMBRA_RETURN_IF_ERROR(fn(std::move(p), &out));
    out.erase(std::remove_if(out.begin() + static_cast<ptrdiff_t>(before), out.end(),
                             [](const Piece& q) { return q.id < 0 && q.text.empty(); }),
              out.end());
  }
  *pieces = std::move(out);
  return Status::OK();
}

Status SplitPiece(Piece p, const SplitPattern& pattern, SplitBehavior behavior, bool invert, std::vector<Piece>* out) {
  std::vector<std::pair<size_t, size_t>> parts;
  PENUMBRA_RETURN_IF_ERROR(SplitText(p.text, pattern, behavior, invert, &parts));
  for (const auto& [b, e] : parts) {
    out->push_back(Piece{p.text.substr(b, e - b), -1, p.at_origin && b == 0});
  }
  return Status::OK();
}

Result<SplitBehavior> ParseBehavior(const json& j, const std::string& where) {
  PENUMBRA_ASSIGN_OR_RETURN(std::string b, StringField(j, "behavior", where));
  if (b == "Removed") return SplitBehavior::kRemoved;
  if (b == "Isolated") return SplitBehavior::kIsolated;
  if (b == "MergedWithPrevious") return SplitBehavior::kMergedWithPrevious;
  if (b == "MergedWithNext") return SplitBehavior::kMergedWithNext;
  if (b == "Contiguous") return SplitBehavior::kContiguous;
  return Status::InvalidArgument(where + ".behavior \"" + b + "\" is not a known split behavior");
}

}  // namespace

// ---- patterns -----------------------------------------------------------------
Result<SplitPattern> SplitPattern::FromJson(const json& pattern, const std::string& where) {
  if (pattern.is_object() && pattern.size() == 1) {
    if (auto it = pattern.find("String"); it != pattern.end() && it->is_string()) {
      return Literal(it->get<std::string>());
    }
    if (auto it = pattern.find("Regex"); it != pattern.end() && it->is_string()) {
      auto re = Regex::Compile(it->get<std::string>());
      if (!re.ok()) return re.status().WithContext(where);
      return FromRegex(std::shared_ptr<const Regex>(std::move(re).value()));
    }
  }
  return Status::InvalidArgument(where + " must be {\"String\": ...} or {\"Regex\": ...}");
}

SplitPattern SplitPattern::FromRegex(std::shared_ptr<const Regex> re) {
  SplitPattern p;
  p.regex_ = std::move(re);
  return p;
}

SplitPattern SplitPattern::Literal(std::string s) {
  SplitPattern p;
  p.literal_ = std::move(s);
  return p;
}

Status SplitPattern::Find(std::string_view s, std::vector<Span>* out) const {
  out->clear();
  if (s.empty() || (!regex_ && literal_.empty())) {
    out->push_back({0, s.size(), false});
    return Status::OK();
  }
  size_t prev = 0;
  auto add = [&](size_t b, size_t e) {
    if (prev != b) out->push_back({prev, b, false});
    out->push_back({b, e, true});
    prev = e;
  };
  if (regex_) {
    std::vector<std::pair<size_t, size_t>> matches;
    PENUMBRA_RETURN_IF_ERROR(regex_->FindAll(s, &matches));
    for (const auto& [b, e] : matches) add(b, e);
  } else {
    size_t pos = 0;
    while ((pos = s.find(literal_, pos)) != std::string_view::npos) {
      add(pos, pos + literal_.size());
      pos += literal_.size();
    }
  }
  if (prev != s.size()) out->push_back({prev, s.size(), false});
  return Status::OK();
}

Status SplitText(std::string_view s, const SplitPattern& pattern, SplitBehavior behavior, bool invert,
                 std::vector<std::pair<size_t, size_t>>* parts) {
  std::vector<SplitPattern::Span> spans;
  PENUMBRA_RETURN_IF_ERROR(pattern.Find(s, &spans));
  if (invert) {
    for (auto& sp : spans) sp.is_match = !sp.is_match;
  }
  struct Part {
    size_t start, end;
    bool remove;
  };
  std::vector<Part> acc;
  acc.reserve(spans.size());
  bool previous_match = false;
  switch (behavior) {
    case SplitBehavior::kIsolated:
      for (const auto& sp : spans) acc.push_back({sp.start, sp.end, false});
      break;
    case SplitBehavior::kRemoved:
      for (const auto& sp : spans) acc.push_back({sp.start, sp.end, sp.is_match});
      break;
    case SplitBehavior::kContiguous:
      for (const auto& sp : spans) {
        if (sp.is_match == previous_match && !acc.empty()) {
          acc.back().end = sp.end;
        } else {
          acc.push_back({sp.start, sp.end, false});
        }
        previous_match = sp.is_match;
      }
      break;
    case SplitBehavior::kMergedWithPrevious:
      for (const auto& sp : spans) {
        if (sp.is_match && !previous_match && !acc.empty()) {
          acc.back().end = sp.end;
        } else {
          acc.push_back({sp.start, sp.end, false});
        }
        previous_match = sp.is_match;
      }
      break;
    case SplitBehavior::kMergedWithNext:
      for (auto it = spans.rbegin(); it != spans.rend(); ++it) {
        if (it->is_match && !previous_match && !acc.empty()) {
          acc.back().start = it->start;
        } else {
          acc.push_back({it->start, it->end, false});
        }
        previous_match = it->is_match;
      }
      std::reverse(acc.begin(), acc.end());
      break;
  }
  for (const Part& p : acc) {
    if (!p.remove) parts->emplace_back(p.start, p.end);
  }
  return Status::OK();
}

// ---- added tokens -----------------------------------------------------------
AddedTokenMatcher::AddedTokenMatcher(std::vector<AddedToken> tokens, std::vector<std::string> patterns)
    : tokens_(std::move(tokens)), patterns_(std::move(patterns)), by_first_byte_(256) {
  for (uint32_t i = 0; i < patterns_.size(); ++i) {
    if (patterns_[i].empty()) continue;
    by_first_byte_[static_cast<unsigned char>(patterns_[i][0])].push_back(i);
  }
  for (auto& bucket : by_first_byte_) {
    std::stable_sort(bucket.begin(), bucket.end(),
                     [&](uint32_t a, uint32_t b) { return patterns_[a].size() > patterns_[b].size(); });
  }
}

void AddedTokenMatcher::Split(std::vector<Piece>* pieces) const {
  if (empty()) return;
  std::vector<Piece> out;
  out.reserve(pieces->size());
  for (Piece& p : *pieces) {
    if (p.id >= 0) {
      out.push_back(std::move(p));
    } else {
      SplitOne(std::move(p), &out);
    }
  }
  *pieces = std::move(out);
}

void AddedTokenMatcher::SplitOne(Piece piece, std::vector<Piece>* out) const {
  const std::string_view s = piece.text;
  auto last_char = [&](size_t end) {  // code point ending at `end` (> 0)
    size_t b = end - 1;
    while (b > 0 && (static_cast<unsigned char>(s[b]) & 0xC0) == 0x80) --b;
    size_t i = b;
    return DecodeUtf8(s, &i);
  };
  auto char_at = [&](size_t pos) {
    size_t i = pos;
    return DecodeUtf8(s, &i);
  };
  size_t start_offset = 0;
  size_t pos = 0;
  while (pos < s.size()) {
    // Leftmost-longest: first position with any match, longest there.
    int32_t hit = -1;
    for (; pos < s.size(); ++pos) {
      for (uint32_t k : by_first_byte_[static_cast<unsigned char>(s[pos])]) {
        if (s.compare(pos, patterns_[k].size(), patterns_[k]) == 0) {
          hit = static_cast<int32_t>(k);
          break;
        }
      }
      if (hit >= 0) break;
    }
    if (hit < 0) break;
    const AddedToken& tok = tokens_[hit];
    size_t start = pos, stop = pos + patterns_[hit].size();
    pos = stop;  // the automaton resumes after the raw match
    if (tok.single_word) {
      const bool start_space = start == 0 || !IsWordChar(last_char(start));
      const bool stop_space = stop == s.size() || !IsWordChar(char_at(stop));
      if (!start_space || !stop_space) continue;
    }
    if (tok.lstrip) {
      size_t b = start;
      while (b > 0) {
        size_t cb = b - 1;
        while (cb > 0 && (static_cast<unsigned char>(s[cb]) & 0xC0) == 0x80) --cb;
        if (!IsWhiteSpace(char_at(cb))) break;
        b = cb;
      }
      start = std::max(b, start_offset);
    }
    if (tok.rstrip) {
      while (stop < s.size()) {
        size_t i = stop;
        if (!IsWhiteSpace(DecodeUtf8(s, &i))) break;
        stop = i;
      }
    }
    if (start_offset < start) {
      out->push_back(
          Piece{std::string(s.substr(start_offset, start - start_offset)), -1, piece.at_origin && start_offset == 0});
    }
    out->push_back(Piece{std::string(s.substr(start, stop - start)), tok.id, false});
    start_offset = stop;
  }
  if (start_offset < s.size()) {
    out->push_back(Piece{std::string(s.substr(start_offset)), -1, piece.at_origin && start_offset == 0});
  }
}

// ---- normalizers ------------------------------------------------------------
namespace {

class NormalFormNormalizer final : public Normalizer {
 public:
  explicit NormalFormNormalizer(NormalForm f) : form_(f) {}
  Status Normalize(std::string* s) const override {
    *s = tokenizer_internal::Normalize(*s, form_);
    return Status::OK();
  }

 private:
  NormalForm form_;
};

class LowercaseNormalizer final : public Normalizer {
 public:
  Status Normalize(std::string* s) const override {
    *s = Lowercase(*s);
    return Status::OK();
  }
};

class PrependNormalizer final : public Normalizer {
 public:
  explicit PrependNormalizer(std::string p) : prepend_(std::move(p)) {}
  Status Normalize(std::string* s) const override {
    if (!s->empty()) s->insert(0, prepend_);
    return Status::OK();
  }

 private:
  std::string prepend_;
};

class ReplaceNormalizer final : public Normalizer {
 public:
  ReplaceNormalizer(SplitPattern p, std::string content) : pattern_(std::move(p)), content_(std::move(content)) {}
  Status Normalize(std::string* s) const override { return ReplacePattern(pattern_, content_, s); }

 private:
  SplitPattern pattern_;
  std::string content_;
};

class StripNormalizer final : public Normalizer {
 public:
  StripNormalizer(bool left, bool right) : left_(left), right_(right) {}
  Status Normalize(std::string* s) const override {
    size_t b = 0, e = s->size();
    if (left_) {
      while (b < e) {
        size_t i = b;
        if (!IsWhiteSpace(DecodeUtf8(*s, &i))) break;
        b = i;
      }
    }
    if (right_) {
      while (e > b) {
        size_t cb = e - 1;
        while (cb > b && (static_cast<unsigned char>((*s)[cb]) & 0xC0) == 0x80) --cb;
        size_t i = cb;
        if (!IsWhiteSpace(DecodeUtf8(*s, &i))) break;
        e = cb;
      }
    }
    *s = s->substr(b, e - b);
    return Status::OK();
  }

 private:
  bool left_, right_;
};

class SequenceNormalizer final : public Normalizer {
 public:
  explicit SequenceNormalizer(std::vector<std::unique_ptr<Normalizer>> n) : steps_(std::move(n)) {}
  Status Normalize(std::string* s) const override {
    for (const auto& n : steps_) PENUMBRA_RETURN_IF_ERROR(n->Normalize(s));
    return Status::OK();
  }

 private:
  std::vector<std::unique_ptr<Normalizer>> steps_;
};

}  // namespace

Result<std::unique_ptr<Normalizer>> NormalizerFromJson(const json& j, const std::string& where) {
  if (j.is_null()) return std::unique_ptr<Normalizer>();
  PENUMBRA_ASSIGN_OR_RETURN(std::string type, TypeOf(j, where));
  if (type == "NFC") return std::unique_ptr<Normalizer>(new NormalFormNormalizer(NormalForm::kNFC));
  if (type == "NFD") return std::unique_ptr<Normalizer>(new NormalFormNormalizer(NormalForm::kNFD));
  if (type == "NFKC") return std::unique_ptr<Normalizer>(new NormalFormNormalizer(NormalForm::kNFKC));
  if (type == "NFKD") return std::unique_ptr<Normalizer>(new NormalFormNormalizer(NormalForm::kNFKD));
  if (type == "Lowercase") return std::unique_ptr<Normalizer>(new LowercaseNormalizer());
  if (type == "Prepend") {
    PENUMBRA_ASSIGN_OR_RETURN(std::string p, StringField(j, "prepend", where));
    return std::unique_ptr<Normalizer>(new PrependNormalizer(std::move(p)));
  }
  if (type == "Replace") {
    auto pat = j.find("pattern");
    if (pat == j.end()) return Status::InvalidArgument(where + ".pattern is missing");
    PENUMBRA_ASSIGN_OR_RETURN(SplitPattern p, SplitPattern::FromJson(*pat, where + ".pattern"));
    PENUMBRA_ASSIGN_OR_RETURN(std::string content, StringField(j, "content", where));
    return std::unique_ptr<Normalizer>(new ReplaceNormalizer(std::move(p), std::move(content)));
  }
  if (type == "Strip") {
    PENUMBRA_ASSIGN_OR_RETURN(bool left, BoolField(j, "strip_left", false, where));
    PENUMBRA_ASSIGN_OR_RETURN(bool right, BoolField(j, "strip_right", false, where));
    return std::unique_ptr<Normalizer>(new StripNormalizer(left, right));
  }
  if (type == "Sequence") {
    PENUMBRA_ASSIGN_OR_RETURN(const json* list, ArrayField(j, "normalizers", where));
    std::vector<std::unique_ptr<Normalizer>> steps;
    for (size_t i = 0; i < list->size(); ++i) {
      PENUMBRA_ASSIGN_OR_RETURN(auto n,
                                NormalizerFromJson((*list)[i], where + ".normalizers[" + std::to_string(i) + "]"));
      if (n) steps.push_back(std::move(n));
    }
    return std::unique_ptr<Normalizer>(new SequenceNormalizer(std::move(steps)));
  }
  return Status::Unimplemented(where + ": normalizer type \"" + type + "\" is not supported");
}

// ---- pre-tokenizers ---------------------------------------------------------
namespace {

class ByteLevelPreTokenizer final : public PreTokenizer {
 public:
  ByteLevelPreTokenizer(bool add_prefix_space, std::shared_ptr<const Regex> regex)
      : add_prefix_space_(add_prefix_space), regex_(std::move(regex)) {}

  Status PreTokenize(std::vector<Piece>* pieces) const override {
    const SplitPattern pattern = regex_ ? SplitPattern::FromRegex(regex_) : SplitPattern::Literal("");
    return ForEachUnfinished(pieces, [&](Piece p, std::vector<Piece>* out) -> Status {
      if (add_prefix_space_ && (p.text.empty() || p.text[0] != ' ')) p.text.insert(0, 1, ' ');
      const size_t first = out->size();
      if (regex_) {
        PENUMBRA_RETURN_IF_ERROR(SplitPiece(std::move(p), pattern, SplitBehavior::kIsolated, false, out));
      } else {
        out->push_back(std::move(p));
      }
      const auto& table = ByteToUnicode();
      for (size_t k = first; k < out->size(); ++k) {
        std::string mapped;
        mapped.reserve((*out)[k].text.size() * 2);
        for (unsigned char b : (*out)[k].text) AppendUtf8(table[b], &mapped);
        (*out)[k].text = std::move(mapped);
      }
      return Status::OK();
    });
  }

 private:
  bool add_prefix_space_;
  std::shared_ptr<const Regex> regex_;
};

class SplitPreTokenizer final : public PreTokenizer {
 public:
  SplitPreTokenizer(SplitPattern p, SplitBehavior b, bool invert)
      : pattern_(std::move(p)), behavior_(b), invert_(invert) {}
  Status PreTokenize(std::vector<Piece>* pieces) const override {
    return ForEachUnfinished(pieces, [&](Piece p, std::vector<Piece>* out) {
      return SplitPiece(std::move(p), pattern_, behavior_, invert_, out);
    });
  }

 private:
  SplitPattern pattern_;
  SplitBehavior behavior_;
  bool invert_;
};

enum class PrependScheme { kAlways, kFirst, kNever };

Result<PrependScheme> ParsePrependScheme(const json& j, const std::string& where) {
  PrependScheme scheme = PrependScheme::kAlways;
  if (auto it = j.find("prepend_scheme"); it != j.end() && !it->is_null()) {
    const std::string s = it->is_string() ? it->get<std::string>() : "";
    if (s == "always") {
      scheme = PrependScheme::kAlways;
    } else if (s == "first") {
      scheme = PrependScheme::kFirst;
    } else if (s == "never") {
      scheme = PrependScheme::kNever;
    } else {
      return Status::InvalidArgument(where + ".prepend_scheme must be \"always\", \"first\" or \"never\"");
    }
  }
  PENUMBRA_ASSIGN_OR_RETURN(bool add_prefix_space, BoolField(j, "add_prefix_space", true, where));
  if (!add_prefix_space) {
    if (scheme != PrependScheme::kNever && j.contains("prepend_scheme")) {
      return Status::InvalidArgument(where + ": add_prefix_space does not match declared prepend_scheme");
    }
    scheme = PrependScheme::kNever;
  }
  return scheme;
}

class MetaspacePreTokenizer final : public PreTokenizer {
 public:
  MetaspacePreTokenizer(std::string replacement, PrependScheme scheme, bool split)
      : replacement_(std::move(replacement)), scheme_(scheme), split_(split) {}
  Status PreTokenize(std::vector<Piece>* pieces) const override {
    const SplitPattern delimiter = SplitPattern::Literal(replacement_);
    return ForEachUnfinished(pieces, [&](Piece p, std::vector<Piece>* out) -> Status {
      p.text = ReplaceAll(p.text, " ", replacement_);
      const bool starts = p.text.compare(0, replacement_.size(), replacement_) == 0;
      if (!starts && (scheme_ == PrependScheme::kAlways || (scheme_ == PrependScheme::kFirst && p.at_origin))) {
        p.text.insert(0, replacement_);
      }
      if (!split_) {
        out->push_back(std::move(p));
        return Status::OK();
      }
      return SplitPiece(std::move(p), delimiter, SplitBehavior::kMergedWithNext, false, out);
    });
  }

 private:
  std::string replacement_;
  PrependScheme scheme_;
  bool split_;
};

class SequencePreTokenizer final : public PreTokenizer {
 public:
  explicit SequencePreTokenizer(std::vector<std::unique_ptr<PreTokenizer>> s) : steps_(std::move(s)) {}
  Status PreTokenize(std::vector<Piece>* pieces) const override {
    for (const auto& s : steps_) PENUMBRA_RETURN_IF_ERROR(s->PreTokenize(pieces));
    return Status::OK();
  }

 private:
  std::vector<std::unique_ptr<PreTokenizer>> steps_;
};

}  // namespace

Result<std::unique_ptr<PreTokenizer>> PreTokenizerFromJson(const json& j, const std::string& where) {
  if (j.is_null()) return std::unique_ptr<PreTokenizer>();
  PENUMBRA_ASSIGN_OR_RETURN(std::string type, TypeOf(j, where));
  if (type == "ByteLevel") {
    PENUMBRA_ASSIGN_OR_RETURN(bool add_prefix_space, BoolField(j, "add_prefix_space", true, where));
    PENUMBRA_ASSIGN_OR_RETURN(bool use_regex, BoolField(j, "use_regex", true, where));
    std::shared_ptr<const Regex> re;
    if (use_regex) {
      auto compiled = Regex::Compile(kGpt2Pattern);
      if (!compiled.ok()) return compiled.status().WithContext(where);
      re = std::shared_ptr<const Regex>(std::move(compiled).value());
    }
    return std::unique_ptr<PreTokenizer>(new ByteLevelPreTokenizer(add_prefix_space, std::move(re)));
  }
  if (type == "Split") {
    auto pat = j.find("pattern");
    if (pat == j.end()) return Status::InvalidArgument(where + ".pattern is missing");
    PENUMBRA_ASSIGN_OR_RETURN(SplitPattern p, SplitPattern::FromJson(*pat, where + ".pattern"));
    PENUMBRA_ASSIGN_OR_RETURN(SplitBehavior b, ParseBehavior(j, where));
    PENUMBRA_ASSIGN_OR_RETURN(bool invert, BoolField(j, "invert", false, where));
    return std::unique_ptr<PreTokenizer>(new SplitPreTokenizer(std::move(p), b, invert));
  }
  if (type == "Metaspace") {
    PENUMBRA_ASSIGN_OR_RETURN(std::string replacement, CharField(j, "replacement", where));
    PENUMBRA_ASSIGN_OR_RETURN(PrependScheme scheme, ParsePrependScheme(j, where));
    PENUMBRA_ASSIGN_OR_RETURN(bool split, BoolField(j, "split", true, where));
    return std::unique_ptr<PreTokenizer>(new MetaspacePreTokenizer(std::move(replacement), scheme, split));
  }
  if (type == "Sequence") {
    PENUMBRA_ASSIGN_OR_RETURN(const json* list, ArrayField(j, "pretokenizers", where));
    std::vector<std::unique_ptr<PreTokenizer>> steps;
    for (size_t i = 0; i < list->size(); ++i) {
      PENUMBRA_ASSIGN_OR_RETURN(auto p,
                                PreTokenizerFromJson((*list)[i], where + ".pretokenizers[" + std::to_string(i) + "]"));
      if (p) steps.push_back(std::move(p));
    }
    return std::unique_ptr<PreTokenizer>(new SequencePreTokenizer(std::move(steps)));
  }
  return Status::Unimplemented(where + ": pre-tokenizer type \"" + type + "\" is not supported");
}

// ---- post-processors ----------------------------------------------------------
namespace {

class TemplatePostProcessor final : public PostProcessor {
 public:
  // `items`: -1 stands for the sequence, otherwise an index into `specials`.
  TemplatePostProcessor(std::vector<int> items, std::vector<std::vector<int32_t>> specials)
      : items_(std::move(items)), specials_(std::move(specials)) {}
  void Process(std::vector<int32_t>* ids) const override {
    std::vector<int32_t> out;
    for (int item : items_) {
      if (item < 0) {
        out.insert(out.end(), ids->begin(), ids->end());
      } else {
        out.insert(out.end(), specials_[item].begin(), specials_[item].end());
      }
    }
    *ids = std::move(out);
  }

 private:
  std::vector<int> items_;
  std::vector<std::vector<int32_t>> specials_;
};

class SequencePostProcessor final : public PostProcessor {
 public:
  explicit SequencePostProcessor(std::vector<std::unique_ptr<PostProcessor>> s) : steps_(std::move(s)) {}
  void Process(std::vector<int32_t>* ids) const override {
    for (const auto& s : steps_) s->Process(ids);
  }

 private:
  std::vector<std::unique_ptr<PostProcessor>> steps_;
};

class NoopPostProcessor final : public PostProcessor {
 public:
  void Process(std::vector<int32_t>*) const override {}
};

Result<int32_t> TokenPairId(const json& j, const char* key, const std::string& where) {
  auto it = j.find(key);
  if (it == j.end() || !it->is_array() || it->size() != 2 || !(*it)[1].is_number_integer()) {
    return Status::InvalidArgument(where + "." + key + " must be [token, id]");
  }
  return (*it)[1].get<int32_t>();
}

}  // namespace

Result<std::unique_ptr<PostProcessor>> PostProcessorFromJson(const json& j, const std::string& where) {
  if (j.is_null()) return std::unique_ptr<PostProcessor>();
  PENUMBRA_ASSIGN_OR_RETURN(std::string type, TypeOf(j, where));
  if (type == "ByteLevel") return std::unique_ptr<PostProcessor>(new NoopPostProcessor());
  if (type == "TemplateProcessing") {
    PENUMBRA_ASSIGN_OR_RETURN(const json* single, ArrayField(j, "single", where));
    auto specials_json = j.find("special_tokens");
    std::vector<int> items;
    std::vector<std::vector<int32_t>> specials;
    for (size_t i = 0; i < single->size(); ++i) {
      const json& item = (*single)[i];
      const std::string at = where + ".single[" + std::to_string(i) + "]";
      if (item.contains("Sequence")) {
        const json& seq = item["Sequence"];
        if (!seq.is_object() || seq.value("id", std::string()) != "A") {
          return Status::InvalidArgument(at + ": a single-sequence template may only use sequence \"A\"");
        }
        items.push_back(-1);
      } else if (item.contains("SpecialToken") && item["SpecialToken"].is_object() &&
                 item["SpecialToken"].contains("id") && item["SpecialToken"]["id"].is_string()) {
        const std::string name = item["SpecialToken"]["id"].get<std::string>();
        if (specials_json == j.end() || !specials_json->is_object() || !specials_json->contains(name)) {
          return Status::InvalidArgument(at + ": special token \"" + name + "\" is not in " + where +
                                         ".special_tokens");
        }
        const json& entry = (*specials_json)[name];
        static const json kNull;
        const json& ids = entry.is_object() && entry.contains("ids") ? entry["ids"] : kNull;
        if (!ids.is_array()) {
          return Status::InvalidArgument(where + ".special_tokens[\"" + name + "\"].ids must be an array");
        }
        std::vector<int32_t> v;
        for (const json& id : ids) {
          if (!id.is_number_integer()) {
            return Status::InvalidArgument(where + ".special_tokens[\"" + name + "\"].ids must hold integers");
          }
          v.push_back(id.get<int32_t>());
        }
        items.push_back(static_cast<int>(specials.size()));
        specials.push_back(std::move(v));
      } else {
        return Status::InvalidArgument(at + " must be {\"Sequence\": ...} or {\"SpecialToken\": {\"id\": ...}}");
      }
    }
    return std::unique_ptr<PostProcessor>(new TemplatePostProcessor(std::move(items), std::move(specials)));
  }
  if (type == "BertProcessing" || type == "RobertaProcessing") {
    PENUMBRA_ASSIGN_OR_RETURN(int32_t cls, TokenPairId(j, "cls", where));
    PENUMBRA_ASSIGN_OR_RETURN(int32_t sep, TokenPairId(j, "sep", where));
    return std::unique_ptr<PostProcessor>(new TemplatePostProcessor({0, -1, 1}, {{cls}, {sep}}));
  }
  if (type == "Sequence") {
    PENUMBRA_ASSIGN_OR_RETURN(const json* list, ArrayField(j, "processors", where));
    std::vector<std::unique_ptr<PostProcessor>> steps;
    for (size_t i = 0; i < list->size(); ++i) {
      PENUMBRA_ASSIGN_OR_RETURN(auto p,
                                PostProcessorFromJson((*list)[i], where + ".processors[" + std::to_string(i) + "]"));
      if (p) steps.push_back(std::move(p));
    }
    return std::unique_ptr<PostProcessor>(new SequencePostProcessor(std::move(steps)));
  }
  return Status::Unimplemented(where + ": post-processor type \"" + type + "\" is not supported");
}

// ---- decoders -----------------------------------------------------------------
namespace {

class ByteLevelDecoder final : public Decoder {
 public:
  void DecodeChain(std::vector<std::string>* tokens) const override {
    std::string bytes;
    std::string token_bytes;
    for (const std::string& t : *tokens) {
      token_bytes.clear();
      bool all = true;
      size_t i = 0;
      while (i < t.size()) {
        const int b = UnicodeToByte(DecodeUtf8(t, &i));
        if (b < 0) {
          all = false;
          break;
        }
        token_bytes.push_back(static_cast<char>(b));
      }
      bytes.append(all ? token_bytes : t);
    }
    tokens->assign(1, Utf8Lossy(bytes));
  }
};

class ReplaceDecoder final : public Decoder {
 public:
  ReplaceDecoder(SplitPattern p, std::string content) : pattern_(std::move(p)), content_(std::move(content)) {}
  void DecodeChain(std::vector<std::string>* tokens) const override {
    for (std::string& t : *tokens) {
      // Literal and compiled patterns cannot fail on valid UTF-8 tokens except
      // through PCRE2 resource limits; a token left unchanged is the fallback.
      std::string copy = t;
      if (ReplacePattern(pattern_, content_, &copy).ok()) t = std::move(copy);
    }
  }

 private:
  SplitPattern pattern_;
  std::string content_;
};

int HexDigit(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

class ByteFallbackDecoder final : public Decoder {
 public:
  void DecodeChain(std::vector<std::string>* tokens) const override {
    std::vector<std::string> out;
    out.reserve(tokens->size());
    std::string pending;
    auto flush = [&] {
      if (pending.empty()) return;
      if (FindInvalidUtf8(pending) == std::string_view::npos) {
        out.push_back(pending);
      } else {
        for (size_t k = 0; k < pending.size(); ++k) out.emplace_back("\xEF\xBF\xBD");
      }
      pending.clear();
    };
    for (std::string& t : *tokens) {
      int byte = -1;
      if (t.size() == 6 && t.compare(0, 3, "<0x") == 0 && t[5] == '>') {
        const int hi = HexDigit(t[3]), lo = HexDigit(t[4]);
        if (hi >= 0 && lo >= 0) byte = hi * 16 + lo;
      }
      if (byte >= 0) {
        pending.push_back(static_cast<char>(byte));
      } else {
        flush();
        out.push_back(std::move(t));
      }
    }
    flush();
    *tokens = std::move(out);
  }
};

class FuseDecoder final : public Decoder {
 public:
  void DecodeChain(std::vector<std::string>* tokens) const override {
    std::string all;
    for (const std::string& t : *tokens) all += t;
    tokens->clear();
    tokens->push_back(std::move(all));
  }
};

class StripDecoder final : public Decoder {
 public:
  StripDecoder(char32_t content, size_t start, size_t stop) : content_(content), start_(start), stop_(stop) {}
  void DecodeChain(std::vector<std::string>* tokens) const override {
    for (std::string& t : *tokens) {
      std::vector<size_t> offsets;  // byte offset of every char, plus the end
      std::vector<char32_t> chars;
      size_t i = 0;
      while (i < t.size()) {
        offsets.push_back(i);
        chars.push_back(DecodeUtf8(t, &i));
      }
      offsets.push_back(t.size());
      size_t start_cut = 0;
      for (size_t k = 0; k < start_ && k < chars.size(); ++k) {
        if (chars[k] != content_) break;
        start_cut = k + 1;
      }
      size_t stop_cut = chars.size();
      for (size_t k = 0; k < stop_ && k < chars.size(); ++k) {
        const size_t index = chars.size() - k - 1;
        if (chars[index] != content_) break;
        stop_cut = index;
      }
      if (stop_cut < start_cut) stop_cut = start_cut;
      t = t.substr(offsets[start_cut], offsets[stop_cut] - offsets[start_cut]);
    }
  }

 private:
  char32_t content_;
  size_t start_, stop_;
};

class MetaspaceDecoder final : public Decoder {
 public:
  MetaspaceDecoder(char32_t replacement, PrependScheme scheme) : replacement_(replacement), scheme_(scheme) {}
  void DecodeChain(std::vector<std::string>* tokens) const override {
    for (size_t k = 0; k < tokens->size(); ++k) {
      const std::string& t = (*tokens)[k];
      std::string out;
      out.reserve(t.size());
      size_t i = 0;
      while (i < t.size()) {
        const size_t b = i;
        const char32_t c = DecodeUtf8(t, &i);
        if (c == replacement_) {
          if (!(k == 0 && scheme_ != PrependScheme::kNever)) out.push_back(' ');
        } else {
          out.append(t, b, i - b);
        }
      }
      (*tokens)[k] = std::move(out);
    }
  }

 private:
  char32_t replacement_;
  PrependScheme scheme_;
};

class SequenceDecoder final : public Decoder {
 public:
  explicit SequenceDecoder(std::vector<std::unique_ptr<Decoder>> s) : steps_(std::move(s)) {}
  void DecodeChain(std::vector<std::string>* tokens) const override {
    for (const auto& s : steps_) s->DecodeChain(tokens);
  }

 private:
  std::vector<std::unique_ptr<Decoder>> steps_;
};

Result<size_t> SizeField(const json& j, const char* key, const std::string& where) {
  auto it = j.find(key);
  if (it == j.end() || !it->is_number_unsigned()) {
    return Status::InvalidArgument(where + "." + key + " must be a non-negative integer");
  }
  return it->get<size_t>();
}

}  // namespace

Result<std::unique_ptr<Decoder>> DecoderFromJson(const json& j, const std::string& where) {
  if (j.is_null()) return std::unique_ptr<Decoder>();
  PENUMBRA_ASSIGN_OR_RETURN(std::string type, TypeOf(j, where));
  if (type == "ByteLevel") return std::unique_ptr<Decoder>(new ByteLevelDecoder());
  if (type == "ByteFallback") return std::unique_ptr<Decoder>(new ByteFallbackDecoder());
  if (type == "Fuse") return std::unique_ptr<Decoder>(new FuseDecoder());
  if (type == "Replace") {
    auto pat = j.find("pattern");
    if (pat == j.end()) return Status::InvalidArgument(where + ".pattern is missing");
    PENUMBRA_ASSIGN_OR_RETURN(SplitPattern p, SplitPattern::FromJson(*pat, where + ".pattern"));
    PENUMBRA_ASSIGN_OR_RETURN(std::string content, StringField(j, "content", where));
    return std::unique_ptr<Decoder>(new ReplaceDecoder(std::move(p), std::move(content)));
  }
  if (type == "Strip") {
    PENUMBRA_ASSIGN_OR_RETURN(std::string content, CharField(j, "content", where));
    PENUMBRA_ASSIGN_OR_RETURN(size_t start, SizeField(j, "start", where));
    PENUMBRA_ASSIGN_OR_RETURN(size_t stop, SizeField(j, "stop", where));
    size_t i = 0;
    return std::unique_ptr<Decoder>(new StripDecoder(DecodeUtf8(content, &i), start, stop));
  }
  if (type == "Metaspace") {
    PENUMBRA_ASSIGN_OR_RETURN(std::string replacement, CharField(j, "replacement", where));
    PENUMBRA_ASSIGN_OR_RETURN(PrependScheme scheme, ParsePrependScheme(j, where));
    size_t i = 0;
    return std::unique_ptr<Decoder>(new MetaspaceDecoder(DecodeUtf8(replacement, &i), scheme));
  }
  if (type == "Sequence") {
    PENUMBRA_ASSIGN_OR_RETURN(const json* list, ArrayField(j, "decoders", where));
    std::vector<std::unique_ptr<Decoder>> steps;
    for (size_t i = 0; i < list->size(); ++i) {
      PENUMBRA_ASSIGN_OR_RETURN(auto d, DecoderFromJson((*list)[i], where + ".decoders[" + std::to_string(i) + "]"));
      if (d) steps.push_back(std::move(d));
    }
    return std::unique_ptr<Decoder>(new SequenceDecoder(std::move(steps)));
  }
  return Status::Unimplemented(where + ": decoder type \"" + type + "\" is not supported");
}

}  // namespace penumbra::tokenizer_internal
