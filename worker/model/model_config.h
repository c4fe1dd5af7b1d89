// A decoder-only model's shape and hyper-parameters, read from a Hugging Face
// config.json (Llama, Qwen2 and Mistral families).
//
// Both config.json dialects are read: transformers 4.x ("rope_theta" and
// "rope_scaling" at top level, "torch_dtype") and 5.x ("rope_parameters" with
// "rope_theta" inside it, "dtype").
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "common/dtype.h"
#include "common/status.h"

namespace penumbra {

enum class Architecture : uint8_t { kLlama, kQwen2, kMistral };

// "LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM".
std::string_view ArchitectureName(Architecture a);

// RoPE frequency scaling. Only the fields that `type` uses are meaningful.
struct RopeScaling {
  // "none", "linear" or "llama3". Default: "none".
  std::string type = "none";
  // Divisor applied to (some of) the inverse frequencies. Default: 1.0.
  double factor = 1.0;
  // llama3: wavelengths above original/low_freq_factor are fully scaled. Default: 1.0.
  double low_freq_factor = 1.0;
  // llama3: wavelengths below original/high_freq_factor are left alone. Default: 4.0.
  double high_freq_factor = 4.0;
  // llama3: the context length the model was pre-trained with. Default: 8192.
  int64_t original_max_position_embeddings = 8192;
};

struct ModelConfig {
  Architecture arch = Architecture::kLlama;
  int hidden_size = 0;
  int intermediate_size = 0;
  int num_layers = 0;
  int num_heads = 0;
  int num_kv_heads = 0;
  // May differ from hidden_size / num_heads when config.json says so.
  int head_dim = 0;
  int vocab_size = 0;
  int64_t max_position_embeddings = 0;
  double rope_theta = 10000.0;
  double rms_norm_eps = 1e-6;
  RopeScaling rope_scaling;
  // lm_head shares model.embed_tokens.weight. Default: false.
  bool tie_word_embeddings = false;
  // q_proj/k_proj/v_proj carry a bias (always true for Qwen2; o_proj never does).
  bool attention_bias = false;
  // -1 when config.json has none.
  int32_t bos_token_id = -1;
  // Empty when config.json has none.
  std::vector<int32_t> eos_token_ids;
  // The dtype the checkpoint was saved in (config "torch_dtype" or "dtype"). Default: f32.
  DType torch_dtype = DType::kF32;
  // Attention window in tokens, as recorded in config.json; 0 = none.
  int64_t sliding_window = 0;
  // Whether the reference implementation applies `sliding_window` (Mistral: whenever one is set;
  // Qwen2: only with "use_sliding_window": true). The runtime refuses prompts longer than the
  // window when this is true, since it does not implement windowed attention.
  bool use_sliding_window = false;

  int q_dim() const { return num_heads * head_dim; }
  int kv_dim() const { return num_kv_heads * head_dim; }

  // The RoPE inverse frequencies, [head_dim / 2]: 1 / theta^(2i / head_dim), then scaled
  // as rope_scaling says. Mirrors the float32 arithmetic of Hugging Face transformers'
  // rope initialisation (default, linear, llama3) so results match to the last bit in
  // nearly all cases (powf rounding can differ by one ulp).
  std::vector<float> RopeInvFreq() const;
};

// Reads and validates a config.json. Errors are InvalidArgument (NotFound when the file
// is missing) and name the file and the offending key.
Result<ModelConfig> LoadModelConfig(const std::string& config_json_path);
// As above, from the file's text; `source` names it in error messages.
Result<ModelConfig> ParseModelConfig(std::string_view json_text, const std::string& source);

}  // namespace penumbra
