// A specontext document: see specontext_prefix.h.
#include "worker/engine/specontext_prefix.h"

#include <cstdlib>
#include <cstring>
#include <sstream>
#include <utility>

namespace penumbra {

SpeContextPrefix::SpeContextPrefix(Backend* backend, Geometry g, int64_t tokens, int64_t stride, double factor,
                                   int64_t pos0)
    : backend_(backend), g_(std::move(g)), tokens_(tokens), stride_(stride), factor_(factor), pos0_(pos0) {
  k_.resize(g_.layers);
  v_.resize(g_.layers);
  k_at_.resize(g_.layers);
  v_at_.resize(g_.layers);
  on_device_.assign(g_.layers, false);
}

size_t SpeContextPrefix::device_bytes() const {
  size_t n = head_k_.bytes();
  for (int l = 0; l < g_.layers; ++l) n += on_device_[l] ? k_[l].bytes() + v_[l].bytes() : 0;
  return n;
}

size_t SpeContextPrefix::host_bytes() const {
  size_t n = 0;
  for (int l = 0; l < g_.layers; ++l) n += on_device_[l] ? 0 : k_[l].bytes() + v_[l].bytes();
  return n;
}

std::string SpeContextPrefix::Meta(const Geometry& g, int64_t tokens, double factor, int64_t base) {
  std::ostringstream os;
  os.precision(17);
  os << "specontext-prefix v1 tokens=" << tokens << " base=" << base << " layers=" << g.layers << " kv_heads=" << g.hkv
     << " head_dim=" << g.d << " head_kv_heads=" << g.head_hkv << " head_head_dim=" << g.head_d
     << " dtype=" << DTypeName(g.dtype) << " yarn=" << factor << " head=" << g.head;
  return os.str();
}

Result<SpeContextPrefix::MetaFields> SpeContextPrefix::ParseMeta(const Geometry& g, const std::string& meta) {
  // tokens=, base= and yarn= are the document's own; the rest must be g's.
  auto field = [&](const std::string& key) -> std::string {
    const size_t at = meta.find(" " + key + "=");
    if (at == std::string::npos) return "";
    const size_t b = at + key.size() + 2, e = meta.find(' ', b);
    return meta.substr(b, e == std::string::npos ? std::string::npos : e - b);
  };
  const std::string tok = field("tokens"), base = field("base"), yarn = field("yarn");
  MetaFields f;
  char* end = nullptr;
  f.tokens = std::strtoll(tok.c_str(), &end, 10);
  const bool tokens_ok = !tok.empty() && *end == '\0' && f.tokens >= 1 && f.tokens < (int64_t{1} << 31);
  end = nullptr;
  f.base = std::strtoll(base.c_str(), &end, 10);
  const bool base_ok = !base.empty() && *end == '\0' && f.base >= 0 && f.base < (int64_t{1} << 40);
  end = nullptr;
  f.factor = std::strtod(yarn.c_str(), &end);
  const bool factor_ok = !yarn.empty() && *end == '\0' && f.factor >= 1.0 && f.factor <= 1024.0;
  // Printed back, the fields must give the same meta: nothing else in it,
  // and the geometry and head this policy's.
  if (!tokens_ok || !base_ok || !factor_ok || Meta(g, f.tokens, f.factor, f.base) != meta) {
    return Status::InvalidArgument("specontext document: meta '" + meta.substr(0, 300) +
                                   "' does not fit this policy (" + Meta(g, 0, 1, 0) + ")");
  }
  return f;
}

Result<std::string> SpeContextPrefix::Compact(const void* src, bool device, int heads, int width,
                                              int64_t stride) const {
  const size_t es = DTypeSize(g_.dtype), row = static_cast<size_t>(width) * es;
  std::string out(static_cast<size_t>(heads) * tokens_ * row, '\0');
  if (device) {
    PENUMBRA_RETURN_IF_ERROR(backend_->Synchronize());
    for (int h = 0; h < heads; ++h) {
      PENUMBRA_RETURN_IF_ERROR(backend_->CopyToHost(out.data() + h * tokens_ * row,
                                                    static_cast<const char*>(src) + h * stride * row, tokens_ * row));
    }
  } else {
    for (int h = 0; h < heads; ++h) {
      std::memcpy(out.data() + h * tokens_ * row, static_cast<const char*>(src) + h * stride * row, tokens_ * row);
    }
  }
  return out;
}

Result<std::map<std::string, std::string>> SpeContextPrefix::Export() const {
  std::map<std::string, std::string> out;
  out["meta"] = Meta(g_, tokens_, factor_, pos0_);
  PENUMBRA_ASSIGN_OR_RETURN(out["head_k"], Compact(head_k_.get(), true, g_.head_hkv, g_.head_d, tokens_));
  for (int l = 0; l < g_.layers; ++l) {
    PENUMBRA_ASSIGN_OR_RETURN(out["k." + std::to_string(l)],
                              Compact(k_[l].get(), on_device_[l], g_.hkv, g_.d, stride_));
    PENUMBRA_ASSIGN_OR_RETURN(out["v." + std::to_string(l)],
                              Compact(v_[l].get(), on_device_[l], g_.hkv, g_.d, stride_));
  }
  return out;
}

}  // namespace penumbra
