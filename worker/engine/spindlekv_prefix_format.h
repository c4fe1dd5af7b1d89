// The stored form of a spindlekv document (KvPrefix::Export, ImportPrefix),
// the same for the host policy (spindlekv_policy.cc) and the device-state
// one (spindlekv_device_policy.cc), so a document stored by either imports
// into both: "meta" (PrefixMeta), then per layer "layer.L", a Part's flat
// binary form (ExportPart): per KV head its key and value codebooks (f32
// entries) and its tokens' arrays.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "common/status.h"
#include "worker/engine/spindlekv_math.h"

namespace penumbra::spindlekv {

// The tokens one KV head holds (kept by at least one of its query heads),
// in position order, each as its position, references into the key and
// value codebooks with magnitudes, and the mask of its KV head's query
// heads that keep it (bit j: the group's j-th query head).
struct Tokens {
  std::vector<int32_t> pos, kref, vref;
  std::vector<float> kmag, vmag;
  std::vector<uint32_t> heads;
  int64_t size() const { return static_cast<int64_t>(pos.size()); }
  void Push(int32_t p, int32_t kr, float km, int32_t vr, float vm, uint32_t mask) {
    pos.push_back(p);
    kref.push_back(kr);
    kmag.push_back(km);
    vref.push_back(vr);
    vmag.push_back(vm);
    heads.push_back(mask);
  }
  void Append(const Tokens& o) {
    pos.insert(pos.end(), o.pos.begin(), o.pos.end());
    kref.insert(kref.end(), o.kref.begin(), o.kref.end());
    kmag.insert(kmag.end(), o.kmag.begin(), o.kmag.end());
    vref.insert(vref.end(), o.vref.begin(), o.vref.end());
    vmag.insert(vmag.end(), o.vmag.begin(), o.vmag.end());
    heads.insert(heads.end(), o.heads.begin(), o.heads.end());
  }
  static constexpr size_t kBytesPerToken = 4 * sizeof(int32_t) + 2 * sizeof(float);
  size_t bytes() const { return pos.size() * kBytesPerToken; }
};

// One layer's compressed state, or what a sequence adds to an attached
// prefix's layer: its own codebook entries (references past the prefix's
// entries count into them) and its own tokens.
struct Part {
  std::vector<Codebook> ck, cv;  // [hkv]
  std::vector<Tokens> tok;       // [hkv]
  void Init(int hkv, int d) {
    ck.assign(hkv, Codebook{});
    cv.assign(hkv, Codebook{});
    for (int g = 0; g < hkv; ++g) ck[g].d = cv[g].d = d;
    tok.assign(hkv, Tokens{});
  }
  size_t bytes() const {
    size_t b = 0;
    for (const auto& c : ck) b += c.entries.size() * sizeof(float);
    for (const auto& c : cv) b += c.entries.size() * sizeof(float);
    for (const auto& t : tok) b += t.bytes();
    return b;
  }
  int64_t entries() const {
    int64_t n = 0;
    for (size_t g = 0; g < ck.size(); ++g) n += ck[g].size() + cv[g].size();
    return n;
  }
};

// A Part's flat binary form (Export/Import): counts, then arrays.
inline void PutU64(std::string* out, uint64_t v) { out->append(reinterpret_cast<const char*>(&v), sizeof(v)); }
template <typename T>
void PutArray(std::string* out, const std::vector<T>& v) {
  PutU64(out, v.size());
  out->append(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
}

class Reader {
 public:
  Reader(const std::string& s, std::string what) : s_(s), what_(std::move(what)) {}
  Status U64(uint64_t* v) {
    if (s_.size() - at_ < sizeof(*v)) return Truncated();
    std::memcpy(v, s_.data() + at_, sizeof(*v));
    at_ += sizeof(*v);
    return Status::OK();
  }
  template <typename T>
  Status Array(std::vector<T>* v, uint64_t max) {
    uint64_t n = 0;
    PENUMBRA_RETURN_IF_ERROR(U64(&n));
    if (n > max)
      return Status::Corruption(what_ + ": an array of " + std::to_string(n) + " entries (at most " +
                                std::to_string(max) + ")");
    if ((s_.size() - at_) / sizeof(T) < n) return Truncated();
    v->resize(n);
    std::memcpy(v->data(), s_.data() + at_, n * sizeof(T));
    at_ += n * sizeof(T);
    return Status::OK();
  }
  bool done() const { return at_ == s_.size(); }
  const std::string& what() const { return what_; }

 private:
  Status Truncated() const { return Status::Corruption(what_ + ": truncated at byte " + std::to_string(at_)); }
  const std::string& s_;
  std::string what_;
  size_t at_ = 0;
};

inline std::string ExportPart(const Part& p) {
  std::string out;
  for (size_t g = 0; g < p.tok.size(); ++g) {
    PutArray(&out, p.ck[g].entries);
    PutArray(&out, p.cv[g].entries);
    const Tokens& t = p.tok[g];
    PutArray(&out, t.pos);
    PutArray(&out, t.kref);
    PutArray(&out, t.kmag);
    PutArray(&out, t.vref);
    PutArray(&out, t.vmag);
    PutArray(&out, t.heads);
  }
  return out;
}

// Reads and checks a Part of a prefix of `tokens` tokens: every reference
// inside its codebook, every position inside the prefix and increasing,
// every mask naming query heads of the group (`group` of them), finite
// numbers.
inline Status ImportPart(Reader& r, int group, int hkv, int d, int64_t tokens, Part* p) {
  p->Init(hkv, d);
  const uint64_t max = static_cast<uint64_t>(tokens) * std::max(1, d) * 2 + 16;
  auto bad = [&](const std::string& why) { return Status::Corruption(r.what() + ": " + why); };
  auto finite = [](const std::vector<float>& v) {
    return std::all_of(v.begin(), v.end(), [](float x) { return std::isfinite(x); });
  };
  for (int g = 0; g < hkv; ++g) {
    PENUMBRA_RETURN_IF_ERROR(r.Array(&p->ck[g].entries, max));
    PENUMBRA_RETURN_IF_ERROR(r.Array(&p->cv[g].entries, max));
    if (p->ck[g].entries.size() % d || p->cv[g].entries.size() % d) return bad("a codebook of partial entries");
    if (!finite(p->ck[g].entries) || !finite(p->cv[g].entries)) return bad("a codebook entry is not finite");
    Tokens& t = p->tok[g];
    PENUMBRA_RETURN_IF_ERROR(r.Array(&t.pos, tokens));
    PENUMBRA_RETURN_IF_ERROR(r.Array(&t.kref, tokens));
    PENUMBRA_RETURN_IF_ERROR(r.Array(&t.kmag, tokens));
    PENUMBRA_RETURN_IF_ERROR(r.Array(&t.vref, tokens));
    PENUMBRA_RETURN_IF_ERROR(r.Array(&t.vmag, tokens));
    PENUMBRA_RETURN_IF_ERROR(r.Array(&t.heads, tokens));
    const size_t n = t.pos.size();
    if (t.kref.size() != n || t.kmag.size() != n || t.vref.size() != n || t.vmag.size() != n || t.heads.size() != n) {
      return bad("KV head " + std::to_string(g) + ": token arrays of different lengths");
    }
    const int32_t nk = p->ck[g].size(), nv = p->cv[g].size();
    for (size_t i = 0; i < n; ++i) {
      if (t.pos[i] < 0 || t.pos[i] >= tokens) return bad("a token position outside the prefix");
      if (i > 0 && t.pos[i] <= t.pos[i - 1]) return bad("token positions out of order");
      if (t.heads[i] == 0 || (group < 32 && (t.heads[i] >> group) != 0)) {
        return bad("a token's query-head mask names no head or one outside the group");
      }
      if (t.kref[i] < 0 || t.kref[i] >= nk || t.vref[i] < 0 || t.vref[i] >= nv) {
        return bad("a reference outside its codebook");
      }
      if (!std::isfinite(t.kmag[i]) || !std::isfinite(t.vmag[i]) || t.kmag[i] < 0 || t.vmag[i] < 0) {
        return bad("a magnitude that is negative or not finite");
      }
    }
  }
  return Status::OK();
}

// A document's "meta" blob: its tokens, the model's attention geometry and
// the state fingerprint (SpindleKvStateFingerprint) of the options that made
// it; an import checks the whole string.
inline std::string PrefixMeta(int64_t tokens, int layers, int hq, int hkv, int d, const std::string& state) {
  std::ostringstream os;
  os << "spindlekv-prefix v1 tokens=" << tokens << " layers=" << layers << " q_heads=" << hq << " kv_heads=" << hkv
     << " head_dim=" << d << " state=" << state;
  return os.str();
}

// The token count a "meta" blob names; InvalidArgument when it is not a
// spindlekv document's.
inline Result<int64_t> PrefixMetaTokens(const std::string& meta) {
  const std::string head = "spindlekv-prefix v1 tokens=";
  if (meta.rfind(head, 0) != 0) return Status::InvalidArgument("spindlekv prefix: unknown format '" + meta + "'");
  std::istringstream is(meta.substr(head.size()));
  int64_t tokens = 0;
  is >> tokens;
  if (!is || tokens < 1) return Status::InvalidArgument("spindlekv prefix: bad token count in '" + meta + "'");
  return tokens;
}

// A stored document read back, every blob checked: its "meta" must be
// meta_of(its tokens) (this policy's geometry and options), and each of the
// `layers` "layer.L" blobs a Part of it (ImportPart) with nothing after it.
struct StoredPrefix {
  int64_t tokens = 0;
  std::vector<Part> layers;
};
inline Result<StoredPrefix> ReadStoredPrefix(const std::map<std::string, std::string>& blobs,
                                             const std::function<std::string(int64_t)>& meta_of, int layers, int hq,
                                             int hkv, int d) {
  auto meta = blobs.find("meta");
  if (meta == blobs.end()) return Status::InvalidArgument("spindlekv prefix: blob 'meta' is missing");
  StoredPrefix out;
  PENUMBRA_ASSIGN_OR_RETURN(out.tokens, PrefixMetaTokens(meta->second));
  if (meta->second != meta_of(out.tokens)) {
    return Status::InvalidArgument("spindlekv prefix: made for another geometry or options ('" + meta->second +
                                   "'; this policy: '" + meta_of(out.tokens) + "')");
  }
  out.layers.resize(layers);
  for (int l = 0; l < layers; ++l) {
    const std::string name = "layer." + std::to_string(l);
    auto b = blobs.find(name);
    if (b == blobs.end()) return Status::InvalidArgument("spindlekv prefix: blob '" + name + "' is missing");
    Reader r(b->second, "spindlekv prefix blob '" + name + "'");
    PENUMBRA_RETURN_IF_ERROR(ImportPart(r, hq / hkv, hkv, d, out.tokens, &out.layers[l]));
    if (!r.done()) return Status::Corruption("spindlekv prefix blob '" + name + "': bytes past its end");
  }
  return out;
}

}  // namespace penumbra::spindlekv
