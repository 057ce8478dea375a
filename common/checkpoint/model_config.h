// A Hugging Face model's config.json (+ generation_config.json), reduced to what the runtime
// needs. One struct for every supported architecture: a model is this config plus a weight-name
// map, not a class per model.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "common/attention_scoring.h"
#include "common/checkpoint/quantization.h"
#include "common/status.h"
#include "common/tensor.h"

namespace tessera {

enum class Architecture {
  kLlama,
  kMistral,
  kQwen2,
  kQwen3,
  kMixtral,
  kQwen2Moe,
  kQwen3Moe,
  kGemma2,
  kGemma3,  // Gemma3ForCausalLM, the text model (model_type gemma3_text)
  kPhi3,
};

// "LlamaForCausalLM", ...
const char* architecture_name(Architecture arch);
// The Hugging Face names accepted in config.json "architectures", comma-separated.
std::string supported_architectures();

// config.json "rope_scaling" (or transformers 5's "rope_parameters"); "type" is an older spelling
// of "rope_type". The llama3 fields follow transformers' _compute_llama3_parameters, linear its
// _compute_linear_scaling_rope_parameters (inv_freq / factor), longrope (Phi-3; "su" is its older
// name) _compute_longrope_parameters.
struct RopeScaling {
  std::string type;  // "" (none), "llama3", "linear", "longrope" (others refused)
  double factor = 1.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int64_t original_max_position_embeddings = 8192;  // llama3; longrope: the short/long boundary
  // longrope: per-frequency divisors [rotary_dim / 2] of the positions below / from
  // original_max_position_embeddings, and the factor cos and sin are multiplied by (given, or
  // sqrt(1 + ln(max_position_embeddings / original) / ln(original)) when that ratio is > 1).
  std::vector<double> short_factor, long_factor;
  double attention_factor = 1.0;
};

// The MLP's activation: silu (SwiGLU: Llama, Qwen, Mistral, Phi-3) or gelu_pytorch_tanh
// (GeGLU: Gemma's hidden_activation, torch's gelu(approximate="tanh")).
enum class MlpActivation { kSilu, kGeluTanh };

// The mixture-of-experts MLP of Mixtral, Qwen2-MoE and Qwen3-MoE (transformers'
// *SparseMoeBlock): router logits = gate(x) (no bias), softmax in fp32, the top_k experts, their
// weights renormalised to sum 1 when norm_topk_prob (Mixtral: always), each expert
// down(silu(gate_proj(x)) * up_proj(x)), the weighted sum; Qwen2-MoE adds
// sigmoid(shared_expert_gate(x)) * shared_expert(x). num_experts == 0: a dense model.
struct MoeConfig {
  int64_t num_experts = 0;          // num_local_experts (Mixtral) / num_experts (Qwen)
  int64_t top_k = 0;                // num_experts_per_tok, 1 .. num_experts
  int64_t expert_intermediate = 0;  // moe_intermediate_size (Qwen) / intermediate_size (Mixtral)
  int64_t shared_intermediate = 0;  // shared_expert_intermediate_size (Qwen2-MoE); 0: none
  bool norm_topk_prob = true;       // renormalise the top-k probabilities
  int64_t decoder_sparse_step = 1;  // layer i is MoE when (i + 1) % step == 0 ...
  std::vector<int64_t> mlp_only_layers;  // ... and i is not listed here (dense: intermediate_size)

  bool enabled() const { return num_experts > 0; }
  // Layer `layer` runs the MoE block (else the dense MLP of intermediate_size), as
  // Qwen2MoeDecoderLayer / Qwen3MoeDecoderLayer decide; every layer of a Mixtral.
  bool sparse_layer(int64_t layer) const;
};

struct ModelConfig {
  Architecture arch = Architecture::kLlama;
  std::string model_type;  // "llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", ...
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;  // the dense MLP's (Mixtral: each expert's, no dense layers)
  int64_t num_layers = 0;         // num_hidden_layers
  int64_t num_heads = 0;          // num_attention_heads
  int64_t num_kv_heads = 0;       // num_key_value_heads (defaults to num_heads)
  int64_t head_dim = 0;           // config "head_dim" when given (any arch), else 128 for Qwen3
                                  // (Qwen3Config's default), else hidden_size / num_heads
  int64_t max_position_embeddings = 0;
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  RopeScaling rope_scaling;
  bool tie_word_embeddings = false;
  bool attention_bias = false;  // q/k/v projections have biases (Qwen2; Llama/Qwen3 when
                                // config.json says "attention_bias": true)
  bool o_proj_bias = false;     // o_proj has a bias too (Llama/Qwen3 "attention_bias": true;
                                // never Qwen2, whose o_proj has none)
  bool qk_norm = false;         // per-head RMSNorm on q and k before RoPE (Qwen3, Gemma 3)
  std::optional<int64_t> sliding_window;  // Mistral; Qwen2/Qwen3 only with use_sliding_window;
                                          // Gemma's local layers; Phi-3.
                                          // Which layers use it: attention_window()
  // Which layers are local (sliding_window) and which global, from layer_types
  // ("sliding_attention" / "full_attention") or the older rules (Gemma 2: even layers local;
  // Gemma 3: all but every sliding_window_pattern-th; Qwen: from max_window_layers on). Empty:
  // every layer uses sliding_window.
  std::vector<bool> sliding_layers;
  // Gemma: RMSNorm scales by (1 + weight) (Gemma2RMSNorm / Gemma3RMSNorm, in fp32), and every
  // layer has pre/post feed-forward norms around the MLP, its attention output a post-attention
  // norm before the residual add (post_attention_layernorm then is not the MLP's input norm).
  bool norm_unit_offset = false;
  bool sandwich_norms = false;
  double embed_scale = 1.0;  // the embedding is multiplied by it (Gemma: sqrt(hidden_size))
  MlpActivation activation = MlpActivation::kSilu;
  // Attention scores are q.k * query_pre_attn_scalar^-0.5 (Gemma); unset: head_dim^-0.5.
  std::optional<double> query_pre_attn_scalar;
  double attn_logit_softcapping = 0;   // scores s -> tanh(s / c) * c before the mask (0: none)
  double final_logit_softcapping = 0;  // logits likewise (Gemma 2; Gemma 3 when set)
  // Gemma 3: the local layers' RoPE base (rope_local_base_freq, no scaling); 0: one RoPE for all
  // layers (rope_theta with rope_scaling). Which layers: local_rope().
  double rope_local_theta = 0;
  int64_t rotary_dim = 0;  // dimensions of a head RoPE rotates: head_dim * partial_rotary_factor
                           // (Phi-3 family), else head_dim
  bool fused_projections = false;  // Phi-3: self_attn.qkv_proj and mlp.gate_up_proj tensors
  MoeConfig moe;                   // mixture-of-experts layers (Mixtral, Qwen2-MoE, Qwen3-MoE)
  QuantConfig quant;  // config.json's quantization_config: how the linear layers are stored
  DType torch_dtype = DType::kBF16;  // the checkpoint's declared dtype ("torch_dtype" or the newer
                                     // "dtype" key); BF16 when the config names none
  // From config.json and generation_config.json (the latter wins).
  std::vector<int64_t> eos_token_ids;
  std::optional<int64_t> bos_token_id;
  std::optional<int64_t> pad_token_id;

  // How many of the latest positions a query of layer `layer` (global index) attends to, itself
  // included: 0 = every earlier position (full attention), w > 0 = positions p - w + 1 .. p, as
  // transformers' sliding-window mask. The one place that says which layers slide.
  int64_t attention_window(int64_t layer) const;
  // The window of the KV cache: the widest attention_window when every layer slides (a sequence
  // needs the K/V of its latest positions only, older blocks can be freed), else 0 (some layer
  // attends to every position: keep them all; vLLM's hybrid allocator, one block pool per window,
  // is the step beyond for Gemma's local layers).
  int64_t kv_cache_window() const;
  // The KV tokens one sequence of `max_model_len` must have in the cache at once: all of them,
  // or with kv_cache_window() = w > 0 its window plus two blocks (the block manager frees the
  // blocks behind the window and cuts each step to what the rest holds, max_step_tokens()).
  // What the planner and the backends size "one sequence fits" by.
  int64_t kv_tokens_per_sequence(int64_t max_model_len, int64_t block_size) const;
  // Layer `layer` uses the local RoPE (rope_local_theta): Gemma 3's sliding layers.
  bool local_rope(int64_t layer) const;
  // How layer `layer` (global index) scores q.k: scale query_pre_attn_scalar^-0.5, else
  // head_dim^-0.5 (rounded to fp32 from double, as transformers' python float `scaling`),
  // softcap attn_logit_softcapping, window attention_window(layer).
  AttentionScoring attention_scoring(int64_t layer) const;
};

// Defaults a model's generation_config.json suggests (absent fields stay unset).
struct GenerationDefaults {
  std::optional<double> temperature;
  std::optional<double> top_p;
  std::optional<int64_t> top_k;
  std::optional<double> repetition_penalty;
  std::optional<int64_t> max_new_tokens;
  bool do_sample = false;
};

// Parses config.json text. Errors name the file and the field ("config.json: hidden_size must be
// a positive integer, got -1"); an architecture we do not run (a trust_remote_code model such
// as the original Qwen-72B's QWenLMHeadModel, say) is refused with its name and the supported
// list.
Expected<ModelConfig> parse_model_config(const std::string& json_text,
                                         const std::string& file = "config.json");
// Missing sizes (vocab_size, hidden_size, intermediate_size, num_hidden_layers,
// num_attention_heads) are errors; everything else defaults as the transformers config class of
// the architecture does (LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config, MixtralConfig,
// Qwen2MoeConfig, Qwen3MoeConfig, Gemma2Config, Gemma3TextConfig, Phi3Config): e.g.
// num_key_value_heads = num_attention_heads, rope_theta 10000, tie_word_embeddings false,
// max_position_embeddings 2048 / 131072 / 32768 / 32768, Llama and Mistral bos 1 / eos 2 when
// the keys are absent (not when null); Gemma head_dim 256, tied embeddings, query_pre_attn_scalar
// 256, sliding_window 4096, soft-caps 50 / 30 (Gemma 2; null: off), bos 2 / eos 1 / pad 0; Phi-3
// rms_norm_eps 1e-5, bos 1 / eos 32000. eos_token_id may be an int or a list. Refused with a clear
// error: a quantization_config on a mixture-of-experts model, num_experts_per_tok above the
// number of experts, an mlp_only_layers entry outside the layers, hidden_act other than silu,
// mlp_bias, a quantization_config parse_quantization_config refuses, rope scaling other than
// llama3 / linear / longrope (su), num_attention_heads not a multiple of num_key_value_heads, odd
// head_dim; Gemma: hidden_activation other than gelu_pytorch_tanh, a layer_types list of another
// length or with other values, sliding_window above max_position_embeddings, a
// Gemma3ForConditionalGeneration (multimodal) config; Phi-3: longrope factor lists not of
// rotary_dim / 2 entries, a quantization_config.

// Reads <dir>/config.json and, if present, <dir>/generation_config.json (eos ids, defaults).
// generation_config.json's eos_token_id / bos_token_id / pad_token_id replace config.json's when
// present and not null. Errors name the file's path.
Expected<ModelConfig> load_model_config(const std::string& model_dir,
                                        GenerationDefaults* defaults = nullptr);

}  // namespace tessera
