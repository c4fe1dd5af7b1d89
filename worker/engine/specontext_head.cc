#include "worker/engine/specontext_head.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstring>
#include <numbers>
#include <random>

#include "common/hash.h"
#include "worker/model/safetensors.h"

namespace penumbra {
namespace {

constexpr const char* kFormat = "penumbra-specontext-head v1";

Status Bad(const std::string& path, const std::string& what) {
  return Status::InvalidArgument("specontext head " + path + ": " + what);
}

// A metadata entry as an integer or a number; InvalidArgument naming it.
Result<int64_t> MetaInt(const SafetensorsFile& f, const std::string& path, const std::string& key) {
  auto it = f.metadata().find(key);
  if (it == f.metadata().end()) return Bad(path, "metadata has no '" + key + "'");
  int64_t v = 0;
  const std::string& s = it->second;
  auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || end != s.data() + s.size()) return Bad(path, key + " '" + s + "' is not an integer");
  return v;
}
Result<double> MetaNumber(const SafetensorsFile& f, const std::string& path, const std::string& key) {
  auto it = f.metadata().find(key);
  if (it == f.metadata().end()) return Bad(path, "metadata has no '" + key + "'");
  char* end = nullptr;
  const double v = std::strtod(it->second.c_str(), &end);
  if (end == it->second.c_str() || *end != '\0' || !std::isfinite(v)) {
    return Bad(path, key + " '" + it->second + "' is not a number");
  }
  return v;
}

// Tensor `name` of exactly `shape`, as f32 appended to `out`.
Status AppendTensor(const SafetensorsFile& f, const std::string& path, const std::string& name,
                    const std::vector<int64_t>& shape, std::vector<float>* out) {
  const TensorInfo* t = f.Find(name);
  if (t == nullptr) return Bad(path, "no tensor '" + name + "'");
  if (!t->dtype_supported || (t->dtype != DType::kBF16 && t->dtype != DType::kF32 && t->dtype != DType::kF16)) {
    return Bad(path, name + " is " + t->dtype_name + " (expected BF16, F16 or F32)");
  }
  if (t->shape != shape) {
    return Bad(path, name + " has shape " + ShapeToString(t->shape) + ", expected " + ShapeToString(shape));
  }
  const size_t n = static_cast<size_t>(t->numel()), old = out->size();
  out->resize(old + n);
  ConvertToF32(t->data, t->dtype, out->data() + old, n);
  for (size_t i = old; i < out->size(); ++i) {
    if (!std::isfinite((*out)[i])) return Bad(path, name + " holds a value that is not finite");
  }
  return Status::OK();
}

Result<DeviceBuffer> UploadAs(Backend* b, const std::vector<float>& host, DType t) {
  std::vector<uint8_t> staged(host.size() * DTypeSize(t));
  ConvertFromF32(host.data(), staged.data(), t, host.size());
  PENUMBRA_ASSIGN_OR_RETURN(DeviceBuffer buf, b->Allocate(staged.size()));
  PENUMBRA_RETURN_IF_ERROR(b->CopyToDevice(buf.get(), staged.data(), staged.size()));
  PENUMBRA_RETURN_IF_ERROR(b->Synchronize());  // `staged` dies at return
  return buf;
}

}  // namespace

std::vector<float> YarnInvFreq(int d, double theta, double factor, int64_t trained_context) {
  std::vector<float> inv(d / 2);
  for (int i = 0; i < d / 2; ++i) {
    const double base = 1.0 / std::pow(theta, 2.0 * i / d);
    double f = base;
    if (factor > 1.0) {
      const double wavelength = 2.0 * std::numbers::pi / base;
      const double r = static_cast<double>(trained_context) / wavelength;  // periods inside the trained context
      const double keep = std::clamp((r - 1.0) / (32.0 - 1.0), 0.0, 1.0);  // 1: high frequency, kept
      f = base / factor * (1.0 - keep) + base * keep;
    }
    inv[i] = static_cast<float>(f);
  }
  return inv;
}

double YarnMscale(double factor) { return factor <= 1.0 ? 1.0 : 0.1 * std::log(factor) + 1.0; }

Result<std::unique_ptr<SpeContextHead>> SpeContextHead::Load(const std::string& path, const ModelConfig& target,
                                                             TargetEmbedding embed, Backend* backend,
                                                             double yarn_factor) {
  Result<SafetensorsFile> opened = SafetensorsFile::Open(path);
  if (!opened.ok()) {
    return Status(opened.status().code(), "specontext head: " + opened.status().message() +
                                              " (specontext.head names the retrieval head: a head.safetensors from "
                                              "ops/evalmodel/train_specontext_head.py, or random)");
  }
  const SafetensorsFile& f = *opened;
  auto fmt = f.metadata().find("format");
  if (fmt == f.metadata().end() || fmt->second != kFormat) {
    return Bad(path, std::string("metadata format is not '") + kFormat + "'");
  }
  auto emb = f.metadata().find("embedding");
  if (emb == f.metadata().end() || emb->second != "target") {
    return Bad(path, "embedding must be 'target' (the head reads the model's embedding table)");
  }
  std::unique_ptr<SpeContextHead> h(new SpeContextHead());
  PENUMBRA_ASSIGN_OR_RETURN(int64_t hidden, MetaInt(f, path, "hidden_size"));
  PENUMBRA_ASSIGN_OR_RETURN(int64_t heads, MetaInt(f, path, "num_heads"));
  PENUMBRA_ASSIGN_OR_RETURN(int64_t kv_heads, MetaInt(f, path, "num_kv_heads"));
  PENUMBRA_ASSIGN_OR_RETURN(int64_t head_dim, MetaInt(f, path, "head_dim"));
  PENUMBRA_ASSIGN_OR_RETURN(int64_t vocab, MetaInt(f, path, "vocab_size"));
  PENUMBRA_ASSIGN_OR_RETURN(int64_t trained, MetaInt(f, path, "trained_context"));
  PENUMBRA_ASSIGN_OR_RETURN(double theta, MetaNumber(f, path, "rope_theta"));
  PENUMBRA_ASSIGN_OR_RETURN(double eps, MetaNumber(f, path, "rms_norm_eps"));
  if (hidden != target.hidden_size) {
    return Bad(path,
               "hidden_size " + std::to_string(hidden) + " is not the model's " + std::to_string(target.hidden_size));
  }
  if (vocab != target.vocab_size) {
    return Bad(path,
               "vocab_size " + std::to_string(vocab) + " is not the model's " + std::to_string(target.vocab_size));
  }
  if (kv_heads != target.num_kv_heads) {
    return Bad(path, "num_kv_heads " + std::to_string(kv_heads) + " is not the model's " +
                         std::to_string(target.num_kv_heads) + " (the selection is per KV head of the model)");
  }
  if (heads < kv_heads || heads % kv_heads != 0 || heads / kv_heads > 8) {
    return Bad(path,
               "num_heads " + std::to_string(heads) + " must be 1 to 8 times num_kv_heads " + std::to_string(kv_heads));
  }
  if (head_dim < 8 || head_dim > 256 || head_dim % 8 != 0) {
    return Bad(path, "head_dim " + std::to_string(head_dim) + " must be a multiple of 8 in [8, 256]");
  }
  if (trained < 1) return Bad(path, "trained_context must be positive");
  if (!(theta > 0) || !(eps > 0)) return Bad(path, "rope_theta and rms_norm_eps must be positive");
  h->hidden_ = static_cast<int>(hidden);
  h->heads_ = static_cast<int>(heads);
  h->kv_heads_ = static_cast<int>(kv_heads);
  h->head_dim_ = static_cast<int>(head_dim);
  h->rope_theta_ = theta;
  h->trained_context_ = trained;
  std::vector<float> norm, qk;
  PENUMBRA_RETURN_IF_ERROR(AppendTensor(f, path, "norm.weight", {hidden}, &norm));
  PENUMBRA_RETURN_IF_ERROR(AppendTensor(f, path, "q_proj.weight", {heads * head_dim, hidden}, &qk));
  PENUMBRA_RETURN_IF_ERROR(AppendTensor(f, path, "k_proj.weight", {kv_heads * head_dim, hidden}, &qk));
  Hash128 id = HashBytes128(qk.data(), qk.size() * sizeof(float), HashBytes128(norm.data(), norm.size() * 4).hi);
  h->identity_ = "file:" + id.Hex();
  PENUMBRA_RETURN_IF_ERROR(h->Finish(embed, backend, norm, qk, eps, yarn_factor));
  return h;
}

Result<std::unique_ptr<SpeContextHead>> SpeContextHead::Random(const ModelConfig& target, TargetEmbedding embed,
                                                               Backend* backend, uint64_t seed, double yarn_factor) {
  if (target.head_dim > 256 || target.head_dim % 8 != 0 || target.num_heads / target.num_kv_heads > 8) {
    return Status::InvalidArgument(
        "specontext: a random head takes the model's attention shape, which the head's "
        "scoring does not support (head_dim a multiple of 8 up to 256, GQA up to 8)");
  }
  std::unique_ptr<SpeContextHead> h(new SpeContextHead());
  h->hidden_ = target.hidden_size;
  h->heads_ = target.num_heads;
  h->kv_heads_ = target.num_kv_heads;
  h->head_dim_ = target.head_dim;
  h->rope_theta_ = target.rope_theta;
  h->trained_context_ = target.max_position_embeddings > 0 ? target.max_position_embeddings : 4096;
  std::vector<float> norm(h->hidden_, 1.0f);
  std::vector<float> qk(static_cast<size_t>(h->heads_ + h->kv_heads_) * h->head_dim_ * h->hidden_);
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> n(0.0f, 0.02f);
  for (float& x : qk) x = n(rng);
  h->identity_ = "random:" + std::to_string(seed);
  PENUMBRA_RETURN_IF_ERROR(h->Finish(embed, backend, norm, qk, target.rms_norm_eps, yarn_factor));
  return h;
}

Status SpeContextHead::Finish(TargetEmbedding embed, Backend* backend, const std::vector<float>& norm,
                              const std::vector<float>& qk, double rms_eps, double yarn_factor) {
  backend_ = backend;
  embed_ = embed;
  rms_eps_ = rms_eps;
  yarn_factor_ = yarn_factor;
  const DType t = backend->act_dtype();
  PENUMBRA_ASSIGN_OR_RETURN(norm_, UploadAs(backend, norm, t));
  // The projection as RopeStore reads its input: query rows, key rows, then
  // value rows it requires room for (zeros; the head keeps no values).
  std::vector<float> proj(qk);
  proj.resize(qk.size() + static_cast<size_t>(kv_heads_) * head_dim_ * hidden_, 0.0f);
  PENUMBRA_ASSIGN_OR_RETURN(proj_, UploadAs(backend, proj, t));
  const size_t rows = kMaxRows;
  const size_t es = DTypeSize(t);
  PENUMBRA_ASSIGN_OR_RETURN(x_, backend->Allocate(rows * hidden_ * sizeof(float)));
  PENUMBRA_ASSIGN_OR_RETURN(h_, backend->Allocate(rows * hidden_ * es));
  PENUMBRA_ASSIGN_OR_RETURN(qkv_, backend->Allocate(rows * (heads_ + 2 * kv_heads_) * head_dim_ * sizeof(float)));
  PENUMBRA_ASSIGN_OR_RETURN(q_discard_, backend->Allocate(rows * heads_ * head_dim_ * es));
  return backend->Synchronize();
}

double SpeContextHead::Factor(int64_t tokens) const {
  if (yarn_factor_ > 0) return yarn_factor_;
  return std::max(1.0, static_cast<double>(tokens) / static_cast<double>(trained_context_));
}

float SpeContextHead::Scale(double factor) const {
  const double m = YarnMscale(factor);
  return static_cast<float>(m * m / std::sqrt(static_cast<double>(head_dim_)));
}

Result<const float*> SpeContextHead::InvFreq(double factor) {
  auto it = inv_freq_.find(factor);
  if (it == inv_freq_.end()) {
    const std::vector<float> inv = YarnInvFreq(head_dim_, rope_theta_, factor, trained_context_);
    PENUMBRA_ASSIGN_OR_RETURN(DeviceBuffer buf, backend_->Allocate(inv.size() * sizeof(float)));
    PENUMBRA_RETURN_IF_ERROR(backend_->CopyToDevice(buf.get(), inv.data(), inv.size() * sizeof(float)));
    PENUMBRA_RETURN_IF_ERROR(backend_->Synchronize());  // `inv` dies here
    it = inv_freq_.emplace(factor, std::move(buf)).first;
  }
  return it->second.as<float>();
}

Status SpeContextHead::Project(const int32_t* ids, const int32_t* positions, int n, double factor, void* q_out,
                               void* const* k_dst, int64_t head_stride) {
  if (n < 1 || n > kMaxRows) return Status::InvalidArgument("specontext head: " + std::to_string(n) + " rows");
  PENUMBRA_ASSIGN_OR_RETURN(const float* inv_freq, InvFreq(factor));
  Backend& b = *backend_;
  b.Embedding(embed_.table, embed_.dtype, ids, n, hidden_, x_.as<float>());
  b.RmsNorm(x_.as<float>(), norm_.get(), b.act_dtype(), n, hidden_, static_cast<float>(rms_eps_), h_.get());
  LinearWeight w;
  w.w = proj_.get();
  w.dtype = b.act_dtype();
  w.out = (heads_ + 2 * kv_heads_) * head_dim_;
  w.in = hidden_;
  b.Linear(h_.get(), w, n, qkv_.as<float>(), false);
  RopeStoreOp r;
  r.qkv = qkv_.as<float>();
  r.positions = positions;
  r.inv_freq = inv_freq;
  r.n = n;
  r.hq = heads_;
  r.hkv = kv_heads_;
  r.d = head_dim_;
  r.q_out = q_out != nullptr ? q_out : q_discard_.get();
  r.k_dst = k_dst;
  r.v_dst = nullptr;  // no values
  r.head_stride = head_stride;
  b.RopeStore(r);
  return Status::OK();
}

}  // namespace penumbra
