#include "worker/engine/model_weights.h"

#include <cstring>

namespace penumbra {

Result<void*> ModelWeights::Upload(Backend& b, const std::vector<float>& host) {
  const DType t = b.act_dtype();
  std::vector<uint8_t> staged(host.size() * DTypeSize(t));
  ConvertFromF32(host.data(), staged.data(), t, host.size());
  PENUMBRA_ASSIGN_OR_RETURN(DeviceBuffer buf, b.Allocate(staged.size()));
  PENUMBRA_RETURN_IF_ERROR(b.CopyToDevice(buf.get(), staged.data(), staged.size()));
  PENUMBRA_RETURN_IF_ERROR(b.Synchronize());  // `staged` dies at return
  void* p = buf.get();
  buffers_.push_back(std::move(buf));
  return p;
}

Result<void*> ModelWeights::AllocRandom(Backend& b, int64_t n, float std, uint64_t seed) {
  PENUMBRA_ASSIGN_OR_RETURN(DeviceBuffer buf, b.Allocate(static_cast<size_t>(n) * DTypeSize(b.act_dtype())));
  b.FillRandomNormal(buf.get(), b.act_dtype(), n, std, seed);
  void* p = buf.get();
  buffers_.push_back(std::move(buf));
  return p;
}

namespace {

// Appends tensor `name` (validated shape) as f32 to `out`.
Status AppendF32(const Checkpoint& ckpt, const std::string& name, std::initializer_list<int64_t> shape,
                 std::vector<float>* out) {
  PENUMBRA_ASSIGN_OR_RETURN(const TensorInfo* t, ckpt.Get(name, shape));
  size_t n = 1;
  for (int64_t s : t->shape) n *= static_cast<size_t>(s);
  const size_t old = out->size();
  out->resize(old + n);
  ConvertToF32(t->data, t->dtype, out->data() + old, n);
  return Status::OK();
}

}  // namespace

Result<ModelWeights> ModelWeights::Load(const Checkpoint& ckpt, Backend& b) {
  ModelWeights w;
  w.config_ = ckpt.config();
  w.dtype_ = b.act_dtype();
  const ModelConfig& c = w.config_;
  const int64_t H = c.hidden_size, F = c.intermediate_size, d = c.head_dim, hq = c.num_heads, hkv = c.num_kv_heads,
                V = c.vocab_size;
  std::vector<float> host;
  auto upload = [&](void const** dst) -> Status {
    PENUMBRA_ASSIGN_OR_RETURN(void* p, w.Upload(b, host));
    *dst = p;
    host.clear();
    return Status::OK();
  };
  PENUMBRA_RETURN_IF_ERROR(AppendF32(ckpt, "model.embed_tokens.weight", {V, H}, &host));
  PENUMBRA_RETURN_IF_ERROR(upload(&w.embed_));
  PENUMBRA_RETURN_IF_ERROR(AppendF32(ckpt, "model.norm.weight", {H}, &host));
  PENUMBRA_RETURN_IF_ERROR(upload(&w.final_norm_));
  w.lm_head_ = {nullptr, nullptr, w.dtype_, static_cast<int>(V), static_cast<int>(H)};
  if (c.tie_word_embeddings && !ckpt.Has("lm_head.weight")) {
    w.lm_head_.w = w.embed_;
  } else {
    PENUMBRA_RETURN_IF_ERROR(AppendF32(ckpt, "lm_head.weight", {V, H}, &host));
    PENUMBRA_RETURN_IF_ERROR(upload(&w.lm_head_.w));
  }
  for (int l = 0; l < c.num_layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    LayerWeights L;
    PENUMBRA_RETURN_IF_ERROR(AppendF32(ckpt, p + "input_layernorm.weight", {H}, &host));
    PENUMBRA_RETURN_IF_ERROR(upload(&L.attn_norm));
    PENUMBRA_RETURN_IF_ERROR(AppendF32(ckpt, p + "self_attn.q_proj.weight", {hq * d, H}, &host));
    PENUMBRA_RETURN_IF_ERROR(AppendF32(ckpt, p + "self_attn.k_proj.weight", {hkv * d, H}, &host));
    PENUMBRA_RETURN_IF_ERROR(AppendF32(ckpt, p + "self_attn.v_proj.weight", {hkv * d, H}, &host));
    L.qkv = {nullptr, nullptr, w.dtype_, static_cast<int>((hq + 2 * hkv) * d), static_cast<int>(H)};
    PENUMBRA_RETURN_IF_ERROR(upload(&L.qkv.w));
    if (c.attention_bias) {
      PENUMBRA_RETURN_IF_ERROR(AppendF32(ckpt, p + "self_attn.q_proj.bias", {hq * d}, &host));
      PENUMBRA_RETURN_IF_ERROR(AppendF32(ckpt, p + "self_attn.k_proj.bias", {hkv * d}, &host));
      PENUMBRA_RETURN_IF_ERROR(AppendF32(ckpt, p + "self_attn.v_proj.bias", {hkv * d}, &host));
      PENUMBRA_RETURN_IF_ERROR(upload(&L.qkv.bias));
    }
    PENUMBRA_RETURN_IF_ERROR(AppendF32(ckpt, p + "self_attn.o_proj.weight", {H, hq * d}, &host));
    L.o = {nullptr, nullptr, w.dtype_, static_cast<int>(H), static_cast<int>(hq * d)};
    PENUMBRA_RETURN_IF_ERROR(upload(&L.o.w));
    PENUMBRA_RETURN_IF_ERROR(AppendF32(ckpt, p + "post_attention_layernorm.weight", {H}, &host));
    PENUMBRA_RETURN_IF_ERROR(upload(&L.mlp_norm));
    PENUMBRA_RETURN_IF_ERROR(AppendF32(ckpt, p + "mlp.gate_proj.weight", {F, H}, &host));
    PENUMBRA_RETURN_IF_ERROR(AppendF32(ckpt, p + "mlp.up_proj.weight", {F, H}, &host));
    L.gate_up = {nullptr, nullptr, w.dtype_, static_cast<int>(2 * F), static_cast<int>(H)};
    PENUMBRA_RETURN_IF_ERROR(upload(&L.gate_up.w));
    PENUMBRA_RETURN_IF_ERROR(AppendF32(ckpt, p + "mlp.down_proj.weight", {H, F}, &host));
    L.down = {nullptr, nullptr, w.dtype_, static_cast<int>(H), static_cast<int>(F)};
    PENUMBRA_RETURN_IF_ERROR(upload(&L.down.w));
    w.layers_.push_back(L);
  }
  return w;
}

Result<ModelWeights> ModelWeights::Random(const ModelConfig& c, Backend& b, uint64_t seed) {
  ModelWeights w;
  w.config_ = c;
  w.dtype_ = b.act_dtype();
  const int64_t H = c.hidden_size, F = c.intermediate_size, d = c.head_dim, hq = c.num_heads, hkv = c.num_kv_heads,
                V = c.vocab_size;
  const float kStd = 0.02f;
  uint64_t s = seed;
  std::vector<float> ones(static_cast<size_t>(H), 1.0f);
  PENUMBRA_ASSIGN_OR_RETURN(void* embed, w.AllocRandom(b, V * H, kStd, ++s));
  w.embed_ = embed;
  PENUMBRA_ASSIGN_OR_RETURN(void* fnorm, w.Upload(b, ones));
  w.final_norm_ = fnorm;
  PENUMBRA_ASSIGN_OR_RETURN(void* head, w.AllocRandom(b, V * H, kStd, ++s));
  w.lm_head_ = {head, nullptr, w.dtype_, static_cast<int>(V), static_cast<int>(H)};
  for (int l = 0; l < c.num_layers; ++l) {
    LayerWeights L;
    PENUMBRA_ASSIGN_OR_RETURN(void* an, w.Upload(b, ones));
    L.attn_norm = an;
    PENUMBRA_ASSIGN_OR_RETURN(void* mn, w.Upload(b, ones));
    L.mlp_norm = mn;
    PENUMBRA_ASSIGN_OR_RETURN(void* qkv, w.AllocRandom(b, (hq + 2 * hkv) * d * H, kStd, ++s));
    L.qkv = {qkv, nullptr, w.dtype_, static_cast<int>((hq + 2 * hkv) * d), static_cast<int>(H)};
    if (c.attention_bias) {
      PENUMBRA_ASSIGN_OR_RETURN(void* bias, w.AllocRandom(b, (hq + 2 * hkv) * d, kStd, ++s));
      L.qkv.bias = bias;
    }
    PENUMBRA_ASSIGN_OR_RETURN(void* o, w.AllocRandom(b, H * hq * d, kStd, ++s));
    L.o = {o, nullptr, w.dtype_, static_cast<int>(H), static_cast<int>(hq * d)};
    PENUMBRA_ASSIGN_OR_RETURN(void* gu, w.AllocRandom(b, 2 * F * H, kStd, ++s));
    L.gate_up = {gu, nullptr, w.dtype_, static_cast<int>(2 * F), static_cast<int>(H)};
    PENUMBRA_ASSIGN_OR_RETURN(void* dn, w.AllocRandom(b, H * F, kStd, ++s));
    L.down = {dn, nullptr, w.dtype_, static_cast<int>(H), static_cast<int>(F)};
    w.layers_.push_back(L);
  }
  PENUMBRA_RETURN_IF_ERROR(b.Synchronize());
  return w;
}

size_t ModelWeights::device_bytes() const {
  size_t n = 0;
  for (const auto& buf : buffers_) n += buf.bytes();
  return n;
}

}  // namespace penumbra
