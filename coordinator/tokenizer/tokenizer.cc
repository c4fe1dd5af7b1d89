#include "coordinator/tokenizer/tokenizer.h"

#include <algorithm>
#include <climits>

#include <nlohmann/json.hpp>

#include "common/file.h"
#include "coordinator/tokenizer/bpe.h"
#include "coordinator/tokenizer/components.h"
#include "coordinator/tokenizer/unicode.h"

namespace penumbra {

using json = nlohmann::json;
using tokenizer_internal::AddedToken;
using tokenizer_internal::AddedTokenMatcher;
using tokenizer_internal::Piece;

namespace {

// Pre-tokens longer than this are not cached (they rarely repeat).
constexpr size_t kMaxCachedPieceBytes = 256;

Result<json> ParseJson(std::string_view text, const std::string& name) {
  try {
    return json::parse(text.begin(), text.end());
  } catch (const json::parse_error& e) {
    return Status::InvalidArgument(name + ": malformed JSON: " + e.what());
  }
}

Result<std::vector<AddedToken>> ParseAddedTokens(const json& root, const std::string& name) {
  std::vector<AddedToken> tokens;
  auto it = root.find("added_tokens");
  if (it == root.end() || it->is_null()) return tokens;
  if (!it->is_array()) return Status::InvalidArgument(name + ": added_tokens must be an array");
  for (size_t i = 0; i < it->size(); ++i) {
    const json& t = (*it)[i];
    const std::string where = name + ": added_tokens[" + std::to_string(i) + "]";
    if (!t.is_object()) return Status::InvalidArgument(where + " must be an object");
    auto id = t.find("id");
    auto content = t.find("content");
    if (id == t.end() || !id->is_number_integer() || id->get<int64_t>() < 0 || id->get<int64_t>() >= INT32_MAX) {
      return Status::InvalidArgument(where + ".id must be a non-negative integer");
    }
    if (content == t.end() || !content->is_string() || content->get_ref<const std::string&>().empty()) {
      return Status::InvalidArgument(where + ".content must be a non-empty string");
    }
    AddedToken tok;
    tok.id = static_cast<int32_t>(id->get<int64_t>());
    tok.content = content->get<std::string>();
    if (tokenizer_internal::FindInvalidUtf8(tok.content) != std::string_view::npos) {
      return Status::InvalidArgument(where + ".content is not valid UTF-8");
    }
    auto flag = [&](const char* key, bool dflt, bool* out) -> Status {
      auto f = t.find(key);
      if (f == t.end() || f->is_null()) {
        *out = dflt;
      } else if (f->is_boolean()) {
        *out = f->get<bool>();
      } else {
        return Status::InvalidArgument(where + "." + key + " must be a boolean");
      }
      return Status::OK();
    };
    PENUMBRA_RETURN_IF_ERROR(flag("special", false, &tok.special));
    PENUMBRA_RETURN_IF_ERROR(flag("single_word", false, &tok.single_word));
    PENUMBRA_RETURN_IF_ERROR(flag("lstrip", false, &tok.lstrip));
    PENUMBRA_RETURN_IF_ERROR(flag("rstrip", false, &tok.rstrip));
    PENUMBRA_RETURN_IF_ERROR(flag("normalized", !tok.special, &tok.normalized));
    tokens.push_back(std::move(tok));
  }
  return tokens;
}

// "bos_token": "<s>" or {"content": "<s>", ...}; empty when absent or null.
std::string TokenText(const json& config, const char* key) {
  auto it = config.find(key);
  if (it == config.end()) return "";
  if (it->is_string()) return it->get<std::string>();
  if (it->is_object()) {
    auto c = it->find("content");
    if (c != it->end() && c->is_string()) return c->get<std::string>();
  }
  return "";
}

std::string DirName(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

}  // namespace

Tokenizer::Tokenizer() = default;
Tokenizer::~Tokenizer() = default;

Result<std::unique_ptr<Tokenizer>> Tokenizer::FromFile(const std::string& tokenizer_json_path) {
  PENUMBRA_ASSIGN_OR_RETURN(std::string text, ReadFileToString(tokenizer_json_path));
  PENUMBRA_ASSIGN_OR_RETURN(auto tok, FromJsonString(text, tokenizer_json_path));
  PENUMBRA_RETURN_IF_ERROR(tok->DetectSpecialIds(DirName(tokenizer_json_path)));
  return tok;
}

Result<std::unique_ptr<Tokenizer>> Tokenizer::FromJsonString(std::string_view tokenizer_json, const std::string& name) {
  PENUMBRA_ASSIGN_OR_RETURN(json root, ParseJson(tokenizer_json, name));
  if (!root.is_object()) return Status::InvalidArgument(name + ": top level must be a JSON object");
  std::unique_ptr<Tokenizer> tok(new Tokenizer());
  try {
    auto model = root.find("model");
    if (model == root.end() || !model->is_object()) {
      return Status::InvalidArgument(name + ": \"model\" must be an object");
    }
    // Files written by old `tokenizers` versions may omit model.type.
    const std::string type = model->contains("type") && (*model)["type"].is_string()
                                 ? (*model)["type"].get<std::string>()
                                 : (model->contains("merges") ? "BPE" : "");
    if (type != "BPE") {
      return Status::Unimplemented(name + ": model type \"" + type + "\" is not supported (only BPE)");
    }
    PENUMBRA_ASSIGN_OR_RETURN(tok->model_, tokenizer_internal::BpeModel::FromJson(*model, name));
    static const json kNull;
    auto section = [&](const char* key) -> const json& {
      auto it = root.find(key);
      return it == root.end() ? kNull : *it;
    };
    PENUMBRA_ASSIGN_OR_RETURN(tok->normalizer_,
                              tokenizer_internal::NormalizerFromJson(section("normalizer"), name + ": normalizer"));
    PENUMBRA_ASSIGN_OR_RETURN(tok->pre_tokenizer_, tokenizer_internal::PreTokenizerFromJson(section("pre_tokenizer"),
                                                                                            name + ": pre_tokenizer"));
    PENUMBRA_ASSIGN_OR_RETURN(tok->post_processor_, tokenizer_internal::PostProcessorFromJson(
                                                        section("post_processor"), name + ": post_processor"));
    PENUMBRA_ASSIGN_OR_RETURN(tok->decoder_,
                              tokenizer_internal::DecoderFromJson(section("decoder"), name + ": decoder"));

    PENUMBRA_ASSIGN_OR_RETURN(std::vector<AddedToken> added, ParseAddedTokens(root, name));
    std::vector<AddedToken> raw, normalized;
    std::vector<std::string> raw_patterns, normalized_patterns;
    int32_t max_id = tok->model_->max_id();
    for (const AddedToken& t : added) {
      tok->added_by_content_[t.content] = t.id;
      tok->added_by_id_[t.id] = t.content;
      if (t.special) {
        tok->special_contents_.insert(t.content);
        tok->special_ids_.insert(t.id);
      }
      max_id = std::max(max_id, t.id);
      if (t.normalized) {
        std::string pattern = t.content;
        if (tok->normalizer_) PENUMBRA_RETURN_IF_ERROR(tok->normalizer_->Normalize(&pattern));
        normalized_patterns.push_back(std::move(pattern));
        normalized.push_back(t);
      } else {
        raw_patterns.push_back(t.content);
        raw.push_back(t);
      }
    }
    tok->raw_matcher_ = std::make_unique<AddedTokenMatcher>(std::move(raw), std::move(raw_patterns));
    tok->normalized_matcher_ =
        std::make_unique<AddedTokenMatcher>(std::move(normalized), std::move(normalized_patterns));
    tok->vocab_size_ = max_id + 1;
  } catch (const json::exception& e) {
    return Status::InvalidArgument(name + ": unexpected JSON structure: " + e.what());
  }
  PENUMBRA_RETURN_IF_ERROR(tok->DetectSpecialIds(""));
  return tok;
}

Status Tokenizer::DetectSpecialIds(const std::string& dir) {
  bos_id_.reset();
  eos_ids_.clear();
  auto add_eos = [&](int32_t id) {
    if (std::find(eos_ids_.begin(), eos_ids_.end(), id) == eos_ids_.end()) eos_ids_.push_back(id);
  };
  auto read_config = [&](const std::string& file, json* out) -> Status {
    const std::string path = JoinPath(dir, file);
    if (dir.empty() || !FileExists(path)) return Status::OK();
    PENUMBRA_ASSIGN_OR_RETURN(std::string text, ReadFileToString(path));
    PENUMBRA_ASSIGN_OR_RETURN(*out, ParseJson(text, path));
    if (!out->is_object()) return Status::InvalidArgument(path + ": top level must be a JSON object");
    return Status::OK();
  };
  json config = json::object(), generation = json::object();
  PENUMBRA_RETURN_IF_ERROR(read_config("tokenizer_config.json", &config));
  PENUMBRA_RETURN_IF_ERROR(read_config("generation_config.json", &generation));

  if (const std::string bos = TokenText(config, "bos_token"); !bos.empty()) bos_id_ = TokenToId(bos);
  if (const std::string eos = TokenText(config, "eos_token"); !eos.empty()) {
    if (auto id = TokenToId(eos)) add_eos(*id);
  }
  if (auto it = generation.find("bos_token_id"); !bos_id_ && it != generation.end() && it->is_number_integer()) {
    bos_id_ = it->get<int32_t>();
  }
  if (auto it = generation.find("eos_token_id"); it != generation.end()) {
    if (it->is_number_integer()) add_eos(it->get<int32_t>());
    if (it->is_array()) {
      for (const json& v : *it) {
        if (v.is_number_integer()) add_eos(v.get<int32_t>());
      }
    }
  }

  // What the post-processor puts around a sequence.
  std::vector<int32_t> prefix, suffix;
  if (post_processor_) {
    constexpr int32_t kSentinel = INT32_MIN;
    std::vector<int32_t> probe = {kSentinel};
    post_processor_->Process(&probe);
    auto at = std::find(probe.begin(), probe.end(), kSentinel);
    if (at != probe.end()) {
      prefix.assign(probe.begin(), at);
      suffix.assign(at + 1, probe.end());
    }
  }
  if (!bos_id_ && !prefix.empty()) bos_id_ = prefix.front();
  if (eos_ids_.empty()) {
    for (int32_t id : suffix) add_eos(id);
  }
  if (eos_ids_.empty()) {
    for (const char* known : {"</s>", "<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<eos>"}) {
      auto it = added_by_content_.find(known);
      if (it != added_by_content_.end() && special_ids_.count(it->second)) add_eos(it->second);
    }
  }
  return Status::OK();
}

std::optional<int32_t> Tokenizer::TokenToId(std::string_view token) const {
  auto it = added_by_content_.find(std::string(token));
  if (it != added_by_content_.end()) return it->second;
  return model_->TokenToId(token);
}

std::optional<std::string> Tokenizer::IdToToken(int32_t id) const {
  auto it = added_by_id_.find(id);
  if (it != added_by_id_.end()) return it->second;
  if (const std::string* t = model_->IdToToken(id)) return *t;
  return std::nullopt;
}

bool Tokenizer::IsSpecial(int32_t id) const { return special_ids_.count(id) != 0; }

Result<std::vector<int32_t>> Tokenizer::Encode(std::string_view text, bool add_special_tokens) const {
  if (const size_t bad = tokenizer_internal::FindInvalidUtf8(text); bad != std::string_view::npos) {
    return Status::InvalidArgument("Encode: input is not valid UTF-8 at byte " + std::to_string(bad));
  }
  if (text.size() >= (uint64_t{1} << 32)) {
    return Status::InvalidArgument("Encode: input of " + std::to_string(text.size()) + " bytes is over 4 GiB");
  }
  std::vector<Piece> pieces;
  if (!text.empty()) pieces.push_back(Piece{std::string(text), -1, true});
  raw_matcher_->Split(&pieces);
  if (normalizer_) {
    for (Piece& p : pieces) {
      if (p.id < 0) PENUMBRA_RETURN_IF_ERROR(normalizer_->Normalize(&p.text));
    }
  }
  normalized_matcher_->Split(&pieces);
  pieces.erase(std::remove_if(pieces.begin(), pieces.end(), [](const Piece& p) { return p.id < 0 && p.text.empty(); }),
               pieces.end());
  if (pre_tokenizer_) PENUMBRA_RETURN_IF_ERROR(pre_tokenizer_->PreTokenize(&pieces));

  std::vector<int32_t> ids;
  ids.reserve(text.size() / 3 + 4);
  std::unordered_map<std::string, std::vector<int32_t>> cache;
  std::vector<int32_t> word_ids;
  for (const Piece& p : pieces) {
    if (p.id >= 0) {
      ids.push_back(p.id);
      continue;
    }
    if (p.text.size() > kMaxCachedPieceBytes) {
      model_->Tokenize(p.text, &ids);
      continue;
    }
    auto it = cache.find(p.text);
    if (it == cache.end()) {
      word_ids.clear();
      model_->Tokenize(p.text, &word_ids);
      it = cache.emplace(p.text, word_ids).first;
    }
    ids.insert(ids.end(), it->second.begin(), it->second.end());
  }
  if (add_special_tokens && post_processor_) post_processor_->Process(&ids);
  return ids;
}

Result<std::string> Tokenizer::Decode(std::span<const int32_t> ids, bool skip_special_tokens) const {
  std::vector<std::string> tokens;
  tokens.reserve(ids.size());
  for (const int32_t id : ids) {
    const std::string* token = nullptr;
    if (auto it = added_by_id_.find(id); it != added_by_id_.end()) {
      token = &it->second;
    } else {
      token = model_->IdToToken(id);
    }
    if (token == nullptr) {
      return Status::InvalidArgument("Decode: unknown token id " + std::to_string(id) + " (vocab_size " +
                                     std::to_string(vocab_size_) + ")");
    }
    if (skip_special_tokens && special_contents_.count(*token)) continue;
    tokens.push_back(*token);
  }
  if (!decoder_) {
    std::string out;
    for (size_t i = 0; i < tokens.size(); ++i) {
      if (i) out.push_back(' ');
      out += tokens[i];
    }
    return out;
  }
  decoder_->DecodeChain(&tokens);
  std::string out;
  for (const std::string& t : tokens) out += t;
  return out;
}

}  // namespace penumbra
