#include "worker/model/model_config.h"

#include <cmath>
#include <limits>
#include <numbers>
#include <optional>

#include <nlohmann/json.hpp>

#include "common/file.h"

namespace penumbra {

using json = nlohmann::json;

std::string_view ArchitectureName(Architecture a) {
  switch (a) {
    case Architecture::kLlama:
      return "LlamaForCausalLM";
    case Architecture::kQwen2:
      return "Qwen2ForCausalLM";
    case Architecture::kMistral:
      return "MistralForCausalLM";
  }
  return "?";
}

namespace {

// Typed, exception-free access to one JSON object; every error names the source
// file and the key (prefixed with `prefix`, e.g. "rope_scaling.").
class KeyReader {
 public:
  KeyReader(const json& obj, const std::string& source, std::string prefix = "")
      : obj_(obj), source_(source), prefix_(std::move(prefix)) {}

  // nullptr when absent or null.
  const json* Find(const std::string& key) const {
    auto it = obj_.find(key);
    if (it == obj_.end() || it->is_null()) return nullptr;
    return &*it;
  }

  Status Error(const std::string& key, const std::string& what) const {
    return Status::InvalidArgument(source_ + ": key '" + prefix_ + key + "': " + what);
  }

  Result<int64_t> Int(const std::string& key, std::optional<int64_t> fallback) const {
    const json* v = Find(key);
    if (!v) {
      if (fallback) return *fallback;
      return Error(key, "missing");
    }
    return AsInt(key, *v);
  }

  Result<int64_t> AsInt(const std::string& key, const json& v) const {
    if (v.is_number_unsigned()) {
      const uint64_t u = v.get<uint64_t>();
      if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return Error(key, "integer out of range");
      return static_cast<int64_t>(u);
    }
    if (v.is_number_integer()) return v.get<int64_t>();
    if (v.is_number_float()) {
      const double d = v.get<double>();
      if (std::isfinite(d) && d == std::floor(d) && std::fabs(d) < 9.0e15) return static_cast<int64_t>(d);
    }
    return Error(key, "expected an integer, got " + v.dump());
  }

  // An int that must be in [lo, hi].
  Result<int> BoundedInt(const std::string& key, std::optional<int64_t> fallback, int64_t lo, int64_t hi) const {
    PENUMBRA_ASSIGN_OR_RETURN(int64_t v, Int(key, fallback));
    if (v < lo || v > hi) {
      return Error(key,
                   std::to_string(v) + " is out of range [" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
    }
    return static_cast<int>(v);
  }

  Result<double> Double(const std::string& key, std::optional<double> fallback) const {
    const json* v = Find(key);
    if (!v) {
      if (fallback) return *fallback;
      return Error(key, "missing");
    }
    if (!v->is_number()) return Error(key, "expected a number, got " + v->dump());
    const double d = v->get<double>();
    if (!std::isfinite(d)) return Error(key, "not finite");
    return d;
  }

  Result<bool> Bool(const std::string& key, bool fallback) const {
    const json* v = Find(key);
    if (!v) return fallback;
    if (!v->is_boolean()) return Error(key, "expected true or false, got " + v->dump());
    return v->get<bool>();
  }

  // nullopt when absent or null.
  Result<std::optional<std::string>> String(const std::string& key) const {
    const json* v = Find(key);
    if (!v) return std::optional<std::string>();
    if (!v->is_string()) return Error(key, "expected a string, got " + v->dump());
    return std::optional<std::string>(v->get<std::string>());
  }

 private:
  const json& obj_;
  const std::string& source_;
  std::string prefix_;
};

constexpr int64_t kMaxDim = 1 << 24;  // generous bound on any one size; keeps products in range

Status ParseRope(const KeyReader& top, const std::string& source, ModelConfig* c) {
  // transformers 5.x: "rope_parameters": {"rope_type", "rope_theta", "factor", ...}.
  // transformers 4.x: "rope_theta" at top level and "rope_scaling": {"rope_type" or "type", ...}.
  std::string key = "rope_scaling";
  const json* params = top.Find("rope_parameters");
  if (params) {
    key = "rope_parameters";
  } else {
    params = top.Find("rope_scaling");
  }
  PENUMBRA_ASSIGN_OR_RETURN(c->rope_theta, top.Double("rope_theta", 10000.0));
  if (!params) return Status::OK();
  if (!params->is_object()) return top.Error(key, "expected an object or null, got " + params->dump());

  KeyReader r(*params, source, key + ".");
  if (r.Find("rope_theta")) {
    PENUMBRA_ASSIGN_OR_RETURN(c->rope_theta, r.Double("rope_theta", std::nullopt));
  }
  PENUMBRA_ASSIGN_OR_RETURN(std::optional<std::string> type, r.String("rope_type"));
  if (!type) {
    PENUMBRA_ASSIGN_OR_RETURN(type, r.String("type"));
  }
  if (!type) {
    // 5.x only fills rope_parameters with a type; 4.x scaling without one is malformed.
    if (key == "rope_parameters" && !r.Find("factor")) {
      type = "default";
    } else {
      return r.Error("rope_type", "missing");
    }
  }
  RopeScaling& s = c->rope_scaling;
  if (*type == "default" || *type == "none") {
    s = RopeScaling();
  } else if (*type == "linear" || *type == "llama3") {
    s.type = *type;
    PENUMBRA_ASSIGN_OR_RETURN(s.factor, r.Double("factor", std::nullopt));
    if (s.factor < 1.0) return r.Error("factor", "must be >= 1, got " + std::to_string(s.factor));
    if (s.type == "llama3") {
      PENUMBRA_ASSIGN_OR_RETURN(s.low_freq_factor, r.Double("low_freq_factor", std::nullopt));
      PENUMBRA_ASSIGN_OR_RETURN(s.high_freq_factor, r.Double("high_freq_factor", std::nullopt));
      PENUMBRA_ASSIGN_OR_RETURN(s.original_max_position_embeddings,
                                r.Int("original_max_position_embeddings", std::nullopt));
      if (s.low_freq_factor <= 0) return r.Error("low_freq_factor", "must be positive");
      if (s.high_freq_factor <= s.low_freq_factor) {
        return r.Error("high_freq_factor", "must exceed low_freq_factor");
      }
      if (s.original_max_position_embeddings <= 0) {
        return r.Error("original_max_position_embeddings", "must be positive");
      }
    }
  } else {
    return r.Error(r.Find("rope_type") ? "rope_type" : "type",
                   "unsupported RoPE scaling '" + *type + "' (supported: default, linear, llama3)");
  }
  if (const json* p = r.Find("partial_rotary_factor"); p && !(p->is_number() && p->get<double>() == 1.0)) {
    return r.Error("partial_rotary_factor", "only 1.0 is supported");
  }
  return Status::OK();
}

Status ParseTokenIds(const KeyReader& r, ModelConfig* c) {
  if (const json* v = r.Find("bos_token_id")) {
    PENUMBRA_ASSIGN_OR_RETURN(int64_t bos, r.AsInt("bos_token_id", *v));
    if (bos < 0 || bos >= c->vocab_size) return r.Error("bos_token_id", std::to_string(bos) + " is not a token id");
    c->bos_token_id = static_cast<int32_t>(bos);
  }
  if (const json* v = r.Find("eos_token_id")) {
    std::vector<const json*> ids;
    if (v->is_array()) {
      for (const json& e : *v) ids.push_back(&e);
    } else {
      ids.push_back(v);
    }
    for (const json* e : ids) {
      PENUMBRA_ASSIGN_OR_RETURN(int64_t eos, r.AsInt("eos_token_id", *e));
      if (eos < 0 || eos >= c->vocab_size) {
        return r.Error("eos_token_id", std::to_string(eos) + " is not a token id");
      }
      c->eos_token_ids.push_back(static_cast<int32_t>(eos));
    }
  }
  return Status::OK();
}

}  // namespace

Result<ModelConfig> ParseModelConfig(std::string_view json_text, const std::string& source) {
  json root = json::parse(json_text.begin(), json_text.end(), nullptr, /*allow_exceptions=*/false);
  if (root.is_discarded()) return Status::InvalidArgument(source + ": not valid JSON");
  if (!root.is_object()) return Status::InvalidArgument(source + ": top level is not a JSON object");
  KeyReader r(root, source);
  ModelConfig c;

  const json* archs = r.Find("architectures");
  if (!archs) return r.Error("architectures", "missing");
  if (!archs->is_array() || archs->empty() || !(*archs)[0].is_string()) {
    return r.Error("architectures", "expected a non-empty list of strings");
  }
  const std::string arch = (*archs)[0].get<std::string>();
  if (arch == "LlamaForCausalLM") {
    c.arch = Architecture::kLlama;
  } else if (arch == "Qwen2ForCausalLM") {
    c.arch = Architecture::kQwen2;
  } else if (arch == "MistralForCausalLM") {
    c.arch = Architecture::kMistral;
  } else {
    return r.Error("architectures", "unsupported architecture '" + arch +
                                        "' (supported: LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM)");
  }

  PENUMBRA_ASSIGN_OR_RETURN(c.hidden_size, r.BoundedInt("hidden_size", std::nullopt, 1, kMaxDim));
  PENUMBRA_ASSIGN_OR_RETURN(c.intermediate_size, r.BoundedInt("intermediate_size", std::nullopt, 1, kMaxDim));
  PENUMBRA_ASSIGN_OR_RETURN(c.num_layers, r.BoundedInt("num_hidden_layers", std::nullopt, 1, 4096));
  PENUMBRA_ASSIGN_OR_RETURN(c.num_heads, r.BoundedInt("num_attention_heads", std::nullopt, 1, 4096));
  PENUMBRA_ASSIGN_OR_RETURN(c.num_kv_heads, r.BoundedInt("num_key_value_heads", c.num_heads, 1, 4096));
  if (c.num_heads % c.num_kv_heads != 0) {
    return r.Error("num_key_value_heads", std::to_string(c.num_kv_heads) + " does not divide num_attention_heads " +
                                              std::to_string(c.num_heads));
  }
  if (r.Find("head_dim")) {
    PENUMBRA_ASSIGN_OR_RETURN(c.head_dim, r.BoundedInt("head_dim", std::nullopt, 2, 4096));
  } else {
    if (c.hidden_size % c.num_heads != 0) {
      return r.Error("num_attention_heads", std::to_string(c.num_heads) + " does not divide hidden_size " +
                                                std::to_string(c.hidden_size) + " and head_dim is not given");
    }
    c.head_dim = c.hidden_size / c.num_heads;
  }
  if (c.head_dim % 2 != 0) return r.Error("head_dim", std::to_string(c.head_dim) + " is odd; RoPE needs it even");
  if (static_cast<int64_t>(c.num_heads) * c.head_dim > kMaxDim)
    return r.Error("head_dim", "heads * head_dim too large");
  PENUMBRA_ASSIGN_OR_RETURN(c.vocab_size, r.BoundedInt("vocab_size", std::nullopt, 1, 1 << 30));
  PENUMBRA_ASSIGN_OR_RETURN(c.max_position_embeddings, r.Int("max_position_embeddings", std::nullopt));
  if (c.max_position_embeddings <= 0) return r.Error("max_position_embeddings", "must be positive");

  PENUMBRA_ASSIGN_OR_RETURN(c.rms_norm_eps, r.Double("rms_norm_eps", 1e-6));
  if (c.rms_norm_eps <= 0) return r.Error("rms_norm_eps", "must be positive");
  PENUMBRA_RETURN_IF_ERROR(ParseRope(r, source, &c));
  if (!(c.rope_theta > 1.0)) return r.Error("rope_theta", "must exceed 1, got " + std::to_string(c.rope_theta));

  PENUMBRA_ASSIGN_OR_RETURN(c.tie_word_embeddings, r.Bool("tie_word_embeddings", false));
  PENUMBRA_ASSIGN_OR_RETURN(std::optional<std::string> act, r.String("hidden_act"));
  if (act && *act != "silu") return r.Error("hidden_act", "only 'silu' is supported, got '" + *act + "'");
  PENUMBRA_ASSIGN_OR_RETURN(bool mlp_bias, r.Bool("mlp_bias", false));
  if (mlp_bias) return r.Error("mlp_bias", "MLP biases are not supported");
  if (c.arch == Architecture::kQwen2) {
    c.attention_bias = true;  // Qwen2 always has q/k/v biases, whatever the config says
  } else {
    PENUMBRA_ASSIGN_OR_RETURN(bool bias, r.Bool("attention_bias", false));
    // Llama's attention_bias also adds an o_proj bias, which the runtime does not implement.
    if (bias) return r.Error("attention_bias", "attention biases are not supported for " + arch);
  }

  PENUMBRA_RETURN_IF_ERROR(ParseTokenIds(r, &c));

  std::string dtype_key = "torch_dtype";
  PENUMBRA_ASSIGN_OR_RETURN(std::optional<std::string> dtype, r.String("torch_dtype"));
  if (!dtype) {
    dtype_key = "dtype";
    PENUMBRA_ASSIGN_OR_RETURN(dtype, r.String("dtype"));
  }
  if (dtype) {
    if (*dtype == "float32") {
      c.torch_dtype = DType::kF32;
    } else if (*dtype == "float16") {
      c.torch_dtype = DType::kF16;
    } else if (*dtype == "bfloat16") {
      c.torch_dtype = DType::kBF16;
    } else {
      return r.Error(dtype_key, "unsupported dtype '" + *dtype + "' (supported: float32, float16, bfloat16)");
    }
  }

  if (c.arch != Architecture::kLlama && r.Find("sliding_window")) {
    PENUMBRA_ASSIGN_OR_RETURN(c.sliding_window, r.Int("sliding_window", std::nullopt));
    if (c.sliding_window <= 0) return r.Error("sliding_window", "must be positive or null");
    if (c.arch == Architecture::kMistral) {
      c.use_sliding_window = true;
    } else {
      PENUMBRA_ASSIGN_OR_RETURN(c.use_sliding_window, r.Bool("use_sliding_window", false));
    }
  }
  return c;
}

Result<ModelConfig> LoadModelConfig(const std::string& config_json_path) {
  PENUMBRA_ASSIGN_OR_RETURN(std::string text, ReadFileToString(config_json_path));
  return ParseModelConfig(text, config_json_path);
}

std::vector<float> ModelConfig::RopeInvFreq() const {
  // Hugging Face computes, in float32:
  //   inv = 1.0 / (theta ** (arange(0, d, 2).float() / d))
  // and for llama3, with wavelen = 2*pi / inv:
  //   scaled = where(wavelen > orig/low, inv / factor, inv)
  //   smooth = (orig / wavelen - low) / (high - low)
  //   smoothed = (1 - smooth) * scaled / factor + smooth * scaled
  //   result = where(!(wavelen < orig/high) && !(wavelen > orig/low), smoothed, scaled)
  // Python scalars meeting a float32 tensor are rounded to float32 first; the one
  // transcendental (pow) is evaluated in double and rounded once.
  const int half = head_dim / 2;
  std::vector<float> inv(static_cast<size_t>(half));
  const float theta_f = static_cast<float>(rope_theta);
  const float d_f = static_cast<float>(head_dim);
  for (int i = 0; i < half; ++i) {
    const float exponent = static_cast<float>(2 * i) / d_f;
    const float base_pow = static_cast<float>(std::pow(static_cast<double>(theta_f), static_cast<double>(exponent)));
    inv[static_cast<size_t>(i)] = 1.0f / base_pow;
  }
  const RopeScaling& s = rope_scaling;
  if (s.type == "linear") {
    const float factor = static_cast<float>(s.factor);
    for (float& f : inv) f = f / factor;
  } else if (s.type == "llama3") {
    const float factor = static_cast<float>(s.factor);
    const double orig = static_cast<double>(s.original_max_position_embeddings);
    const float low_wavelen = static_cast<float>(orig / s.low_freq_factor);
    const float high_wavelen = static_cast<float>(orig / s.high_freq_factor);
    const float two_pi = static_cast<float>(2.0 * std::numbers::pi);
    const float orig_f = static_cast<float>(s.original_max_position_embeddings);
    const float low_f = static_cast<float>(s.low_freq_factor);
    const float span = static_cast<float>(s.high_freq_factor - s.low_freq_factor);
    for (float& f : inv) {
      const float wavelen = two_pi / f;
      const float scaled = wavelen > low_wavelen ? f / factor : f;
      const bool medium = !(wavelen < high_wavelen) && !(wavelen > low_wavelen);
      if (medium) {
        const float smooth = (orig_f / wavelen - low_f) / span;
        f = (1.0f - smooth) * scaled / factor + smooth * scaled;
      } else {
        f = scaled;
      }
    }
  }
  return inv;
}

}  // namespace penumbra
