#include "coordinator/tokenizer/text_codec.h"

#include <nlohmann/json.hpp>

#include "common/file.h"

namespace penumbra {

Result<std::unique_ptr<TextCodec>> TextCodec::ForModel(const std::string& model_dir) {
  auto c = std::unique_ptr<TextCodec>(new TextCodec);
  const std::string tok = JoinPath(model_dir, "tokenizer.json");
  if (FileExists(tok)) {
    PENUMBRA_ASSIGN_OR_RETURN(c->tokenizer_, Tokenizer::FromFile(tok));
    return c;
  }
  const std::string pieces = JoinPath(model_dir, "vocab_pieces.json");
  if (FileExists(pieces)) {
    PENUMBRA_ASSIGN_OR_RETURN(std::string text, ReadFileToString(pieces));
    nlohmann::json j = nlohmann::json::parse(text, nullptr, false);
    if (!j.is_array()) return Status::InvalidArgument(pieces + ": expected a JSON array of strings");
    for (const auto& p : j) {
      if (!p.is_string()) return Status::InvalidArgument(pieces + ": expected a JSON array of strings");
      c->pieces_.push_back(p.get<std::string>());
    }
  }
  return c;
}

Result<std::vector<int32_t>> TextCodec::Encode(const std::string& text, bool add_special_tokens) const {
  if (!tokenizer_) return Status::FailedPrecondition("this model directory has no tokenizer.json; use --prompt-ids");
  return tokenizer_->Encode(text, add_special_tokens);
}

int TextCodec::LeadingSpecialTokens(const std::vector<int32_t>& ids) const {
  int n = 0;
  while (tokenizer_ && n < static_cast<int>(ids.size()) && tokenizer_->IsSpecial(ids[n])) ++n;
  return n;
}

Result<std::string> TextCodec::Decode(const std::vector<int32_t>& ids) const {
  if (tokenizer_) return tokenizer_->Decode(ids, /*skip_special_tokens=*/true);
  std::string out;
  for (int32_t id : ids) {
    if (id < 0 || static_cast<size_t>(id) >= pieces_.size()) {
      if (pieces_.empty()) return std::string();
      return Status::InvalidArgument("token id " + std::to_string(id) + " is outside the vocabulary");
    }
    const std::string& p = pieces_[id];
    if (p.size() == 6 && p.rfind("<0x", 0) == 0 && p.back() == '>') {
      out.push_back(static_cast<char>(std::stoi(p.substr(3, 2), nullptr, 16)));
    } else if (p.find("<s>") != std::string::npos || p.find("</s>") != std::string::npos || p == "<unk>") {
      continue;  // control pieces
    } else {
      out += p;
    }
  }
  return out;
}

Result<std::string> IncrementalText::Window(const TextCodec& codec, size_t end) const {
  return codec.Decode(std::vector<int32_t>(ids_.begin() + static_cast<std::ptrdiff_t>(prefix_),
                                           ids_.begin() + static_cast<std::ptrdiff_t>(end)));
}

Status IncrementalText::Append(const TextCodec& codec, std::span<const int32_t> ids) {
  ids_.insert(ids_.end(), ids.begin(), ids.end());
  PENUMBRA_ASSIGN_OR_RETURN(std::string before, Window(codec, read_));
  PENUMBRA_ASSIGN_OR_RETURN(std::string now, Window(codec, ids_.size()));
  static const std::string kReplacement = "\xEF\xBF\xBD";
  const bool partial = now.size() >= 3 && now.compare(now.size() - 3, 3, kReplacement) == 0;
  if (now.size() <= before.size() || partial) return Status::OK();  // nothing complete yet
  text_.append(now, before.size(), std::string::npos);
  prefix_ = read_;
  read_ = ids_.size();
  return Status::OK();
}

Status IncrementalText::Finish(const TextCodec& codec) {
  PENUMBRA_ASSIGN_OR_RETURN(std::string before, Window(codec, read_));
  PENUMBRA_ASSIGN_OR_RETURN(std::string now, Window(codec, ids_.size()));
  if (now.size() > before.size()) text_.append(now, before.size(), std::string::npos);
  prefix_ = read_ = ids_.size();
  return Status::OK();
}

}  // namespace penumbra
