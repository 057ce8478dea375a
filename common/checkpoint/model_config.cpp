#include "common/checkpoint/model_config.h"

#include "common/checkpoint/json_fields.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>
#include <tuple>

namespace tessera {
namespace {

using json_fields::Fields;
using json_fields::type_name;
using nlohmann::json;

struct ArchInfo {
  Architecture arch;
  const char* hf_name;
  const char* model_type;
  int64_t default_max_positions;  // the transformers config class's default
};

// Defaults from transformers' LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config,
// MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig, Gemma2Config, Gemma3TextConfig and Phi3Config.
constexpr ArchInfo kArchs[] = {
    {Architecture::kLlama, "LlamaForCausalLM", "llama", 2048},
    {Architecture::kMistral, "MistralForCausalLM", "mistral", 4096 * 32},
    {Architecture::kQwen2, "Qwen2ForCausalLM", "qwen2", 32768},
    {Architecture::kQwen3, "Qwen3ForCausalLM", "qwen3", 32768},
    {Architecture::kMixtral, "MixtralForCausalLM", "mixtral", 4096 * 32},
    {Architecture::kQwen2Moe, "Qwen2MoeForCausalLM", "qwen2_moe", 32768},
    {Architecture::kQwen3Moe, "Qwen3MoeForCausalLM", "qwen3_moe", 32768},
    {Architecture::kGemma2, "Gemma2ForCausalLM", "gemma2", 8192},
    {Architecture::kGemma3, "Gemma3ForCausalLM", "gemma3_text", 131072},
    {Architecture::kPhi3, "Phi3ForCausalLM", "phi3", 4096},
};

bool is_gemma(Architecture a) { return a == Architecture::kGemma2 || a == Architecture::kGemma3; }

const ArchInfo& arch_info(Architecture arch) {
  for (const ArchInfo& info : kArchs) {
    if (info.arch == arch) return info;
  }
  return kArchs[0];
}

Expected<json> parse_json_object(const std::string& text, const std::string& file) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {  // parse_error, or out_of_range for 1e999
    return invalid_argument(file + ": not valid JSON (" + e.what() + ")");
  }
  if (!j.is_object()) return invalid_argument(file + ": expected a JSON object at the top level");
  return j;
}

Expected<std::string> read_text_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return not_found(path + ": cannot open (" + std::strerror(errno) + ")");
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) return internal_error(path + ": read failed");
  return ss.str();
}

Expected<Architecture> parse_architecture(const Fields& f, const json& j, const std::string& file,
                                          std::string* model_type) {
  *model_type = j.contains("model_type") && j["model_type"].is_string()
                    ? j["model_type"].get<std::string>()
                    : "";
  std::string name;
  if (*model_type == "gemma3" || (f.given("architectures") && f.at("architectures").is_array() &&
                                  !f.at("architectures").empty() &&
                                  f.at("architectures")[0] == "Gemma3ForConditionalGeneration")) {
    return invalid_argument(
        file +
        ": Gemma3ForConditionalGeneration (model_type gemma3) is the multimodal Gemma 3 "
        "(a vision tower around the text model) and is not supported; only the text model "
        "runs: Gemma3ForCausalLM, model_type gemma3_text (its text_config as config.json, "
        "with the language model's weights)");
  }
  if (f.given("architectures")) {
    const json& a = f.at("architectures");
    if (!a.is_array() || a.empty() || !a[0].is_string()) {
      return f.error("architectures",
                     "must be a non-empty list of class names, got " + type_name(a));
    }
    name = a[0].get<std::string>();
    for (const ArchInfo& info : kArchs) {
      if (name == info.hf_name) return info.arch;
    }
  } else {
    // A few configs omit "architectures": fall back to model_type, as AutoModelForCausalLM does.
    for (const ArchInfo& info : kArchs) {
      if (*model_type == info.model_type) return info.arch;
    }
    return invalid_argument(file + ": neither \"architectures\" nor a known \"model_type\" (got '" +
                            *model_type +
                            "'); supported architectures: " + supported_architectures());
  }
  std::string why;
  if (j.contains("auto_map")) why = " (it is custom code that needs trust_remote_code)";
  return invalid_argument(file + ": architecture '" + name + "' is not supported" + why +
                          "; supported architectures: " + supported_architectures());
}

// A list of positive numbers of `n` entries (longrope's short_factor / long_factor).
Expected<std::vector<double>> factor_list(const Fields& rf, const json& r, const char* key,
                                          int64_t n) {
  if (!rf.given(key)) return rf.error(key, "is missing (required for rope_type longrope)");
  const json& v = r.at(key);
  if (!v.is_array()) return rf.error(key, "must be a list of numbers, got " + type_name(v));
  std::vector<double> out;
  for (const json& e : v) {
    if (!e.is_number() || !(e.get<double>() > 0) || !std::isfinite(e.get<double>())) {
      return rf.error(key, "holds " + type_name(e) + ", not a positive number");
    }
    out.push_back(e.get<double>());
  }
  if (static_cast<int64_t>(out.size()) != n) {
    return rf.error(key, "has " + std::to_string(out.size()) +
                             " entries, expected rotary_dim / 2 = " + std::to_string(n));
  }
  return out;
}

// Phi-3's LongRoPE (transformers' _compute_longrope_parameters): the factor lists, the boundary
// and the cos/sin factor. Needs cfg->rotary_dim and max_position_embeddings.
Status parse_longrope(const Fields& f, const Fields& rf, const json& r, ModelConfig* cfg) {
  RopeScaling& rs = cfg->rope_scaling;
  rs.type = "longrope";
  const int64_t n = cfg->rotary_dim / 2;
  TESSERA_ASSIGN_OR_RETURN(rs.short_factor, factor_list(rf, r, "short_factor", n));
  TESSERA_ASSIGN_OR_RETURN(rs.long_factor, factor_list(rf, r, "long_factor", n));
  // Phi3Config keeps original_max_position_embeddings at the top level (transformers 5 may move
  // it into rope_parameters); absent, max_position_embeddings.
  if (rf.given("original_max_position_embeddings")) {
    TESSERA_ASSIGN_OR_RETURN(rs.original_max_position_embeddings,
                             rf.positive("original_max_position_embeddings"));
  } else {
    TESSERA_ASSIGN_OR_RETURN(
        rs.original_max_position_embeddings,
        f.positive_or("original_max_position_embeddings", cfg->max_position_embeddings));
  }
  // The ratio of the extended to the pretrained context, not rope_scaling's "factor" (the
  // transformers note: Phi-3 derives it from the two context lengths).
  const double factor = static_cast<double>(cfg->max_position_embeddings) /
                        static_cast<double>(rs.original_max_position_embeddings);
  rs.factor = factor;
  if (rf.given("attention_factor")) {
    TESSERA_ASSIGN_OR_RETURN(rs.attention_factor, rf.positive_number_or("attention_factor", 1.0));
  } else {
    rs.attention_factor =
        factor <= 1.0
            ? 1.0
            : std::sqrt(1.0 + std::log(factor) / std::log(static_cast<double>(
                                                     rs.original_max_position_embeddings)));
  }
  return Status::ok();
}

Status parse_rope(const Fields& f, const json& j, const std::string& file, ModelConfig* cfg) {
  // transformers 5 writes "rope_parameters" (with rope_theta inside); 4.x "rope_scaling".
  const char* key = nullptr;
  if (f.given("rope_scaling")) key = "rope_scaling";
  if (f.given("rope_parameters")) key = "rope_parameters";
  if (key == nullptr) return Status::ok();
  const json* rp = &j.at(key);
  if (!rp->is_object()) return f.error(key, "must be an object or null, got " + type_name(*rp));
  std::string where = key;
  if (cfg->arch == Architecture::kGemma3 && rp->contains("full_attention")) {
    // transformers 5's Gemma 3: one entry per layer type. The local layers' is a plain RoPE.
    if (rp->contains("sliding_attention")) {
      const json& local = rp->at("sliding_attention");
      Fields lf(local, file, where + ".sliding_attention.");
      if (!local.is_object()) {
        return invalid_argument(file + ": " + where + ".sliding_attention must be an object, got " +
                                type_name(local));
      }
      TESSERA_ASSIGN_OR_RETURN(cfg->rope_local_theta,
                               lf.positive_number_or("rope_theta", cfg->rope_local_theta));
      TESSERA_ASSIGN_OR_RETURN(std::string t, lf.text_or("rope_type", "default"));
      if (t != "default") {
        return lf.error("rope_type",
                        "must be \"default\" (the local layers' RoPE), got \"" + t + "\"");
      }
    }
    rp = &rp->at("full_attention");
    where += ".full_attention";
    if (!rp->is_object()) {
      return invalid_argument(file + ": " + where + " must be an object, got " + type_name(*rp));
    }
  }
  const json& r = *rp;
  Fields rf(r, file, where + ".");
  if (std::string(key) == "rope_parameters" && rf.given("rope_theta")) {
    TESSERA_ASSIGN_OR_RETURN(cfg->rope_theta, rf.positive_number_or("rope_theta", 10000.0));
  }
  if (std::string(key) == "rope_parameters" && rf.given("partial_rotary_factor")) {
    TESSERA_ASSIGN_OR_RETURN(double prf, rf.positive_number_or("partial_rotary_factor", 1.0));
    if (prf > 1.0) return rf.error("partial_rotary_factor", "must be in (0, 1]");
    cfg->rotary_dim = static_cast<int64_t>(static_cast<double>(cfg->head_dim) * prf);
  }
  std::string type;
  for (const char* k : {"rope_type", "type"}) {
    if (rf.given(k)) {
      if (!r.at(k).is_string()) return rf.error(k, "must be a string, got " + type_name(r.at(k)));
      type = r.at(k).get<std::string>();
      break;
    }
  }
  if (type.empty() || type == "default") return Status::ok();
  if (type == "linear" && cfg->arch == Architecture::kGemma3) {
    cfg->rope_scaling.type = "linear";
    if (!rf.given("factor"))
      return rf.error("factor", "is missing (required for rope_type linear)");
    TESSERA_ASSIGN_OR_RETURN(cfg->rope_scaling.factor, rf.positive_number_or("factor", 1.0));
    return Status::ok();
  }
  if ((type == "longrope" || type == "su") && cfg->arch == Architecture::kPhi3) {
    return parse_longrope(f, rf, r, cfg);
  }
  if (type != "llama3") {
    return invalid_argument(file + ": " + where + " type '" + type +
                            "' is not supported (supported: llama3, linear on Gemma 3, longrope / "
                            "su on Phi-3, or none/default)");
  }
  RopeScaling& rs = cfg->rope_scaling;
  rs.type = "llama3";
  for (const char* k :
       {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}) {
    if (!rf.given(k)) return rf.error(k, "is missing (required for rope_type llama3)");
  }
  TESSERA_ASSIGN_OR_RETURN(rs.factor, rf.positive_number_or("factor", 1.0));
  TESSERA_ASSIGN_OR_RETURN(rs.low_freq_factor, rf.positive_number_or("low_freq_factor", 1.0));
  TESSERA_ASSIGN_OR_RETURN(rs.high_freq_factor, rf.positive_number_or("high_freq_factor", 4.0));
  TESSERA_ASSIGN_OR_RETURN(rs.original_max_position_embeddings,
                           rf.positive("original_max_position_embeddings"));
  if (!(rs.high_freq_factor > rs.low_freq_factor)) {
    return invalid_argument(file + ": " + key + ".high_freq_factor (" +
                            r["high_freq_factor"].dump() + ") must be greater than " +
                            "low_freq_factor (" + r["low_freq_factor"].dump() + ")");
  }
  return Status::ok();
}

Expected<DType> parse_dtype(const Fields& f) {
  const char* key = f.given("dtype") ? "dtype" : f.given("torch_dtype") ? "torch_dtype" : nullptr;
  if (key == nullptr) return DType::kBF16;
  const json& v = f.at(key);
  std::string s = v.is_string() ? v.get<std::string>() : "";
  if (s.rfind("torch.", 0) == 0) s = s.substr(6);
  if (s == "bfloat16") return DType::kBF16;
  if (s == "float16" || s == "half") return DType::kF16;
  if (s == "float32" || s == "float") return DType::kF32;
  return f.error(key, "must be \"bfloat16\", \"float16\" or \"float32\", got " + type_name(v));
}

// More parameters than this is not a model but a corrupt or hostile config.json; the weight
// shapes multiply the sizes, and past this their products would overflow int64 downstream.
constexpr int64_t kMaxParameters = int64_t{1} << 48;

// a × b (a, b > 0), saturated just past kMaxParameters.
int64_t saturated_product(int64_t a, int64_t b) {
  return a > (kMaxParameters + 1) / b ? kMaxParameters + 1 : std::min(a * b, kMaxParameters + 1);
}

// The number of parameters the weights of `c` hold (the tensors expected_weights lists),
// saturated just past kMaxParameters. Sizes are positive.
int64_t parameter_count(const ModelConfig& c) {
  auto mul = [](std::initializer_list<int64_t> factors) {
    int64_t p = 1;
    for (int64_t f : factors) {
      if (f == 0) return int64_t{0};  // a size that is absent (no shared expert)
      p = saturated_product(p, f);
    }
    return p;
  };
  auto sum = [](std::initializer_list<int64_t> terms) {
    int64_t s = 0;
    for (int64_t t : terms) s = std::min(s + t, kMaxParameters + 1);
    return s;
  };
  const int64_t q_out = mul({c.num_heads, c.head_dim});
  const int64_t kv_out = mul({c.num_kv_heads, c.head_dim});
  const MoeConfig& m = c.moe;
  // An MoE layer's experts, router and shared expert (counted on top of the dense MLP: a bound).
  const int64_t moe = m.enabled()
                          ? sum({mul({m.num_experts, 3, m.expert_intermediate, c.hidden_size}),
                                 mul({m.num_experts + 1, c.hidden_size}),
                                 mul({3, m.shared_intermediate, c.hidden_size})})
                          : 0;
  const int64_t layer = sum({mul({2, q_out, c.hidden_size}), mul({2, kv_out, c.hidden_size}),
                             mul({3, c.intermediate_size, c.hidden_size}), q_out, mul({2, kv_out}),
                             mul({3, c.hidden_size}), mul({2, c.head_dim}), moe});
  return sum({mul({c.num_layers, layer}), mul({2, c.vocab_size, c.hidden_size}), c.hidden_size});
}

bool is_moe(Architecture a) {
  return a == Architecture::kMixtral || a == Architecture::kQwen2Moe ||
         a == Architecture::kQwen3Moe;
}

// The MoE fields of config.json, defaulting as MixtralConfig / Qwen2MoeConfig / Qwen3MoeConfig
// do; router_aux_loss_coef, output_router_logits and router_jitter_noise are training-only.
Status parse_moe(const Fields& f, const json& j, ModelConfig* cfg) {
  MoeConfig& m = cfg->moe;
  if (cfg->arch == Architecture::kMixtral) {
    TESSERA_ASSIGN_OR_RETURN(m.num_experts, f.positive_or("num_local_experts", 8));
    TESSERA_ASSIGN_OR_RETURN(m.top_k, f.positive_or("num_experts_per_tok", 2));
    m.expert_intermediate = cfg->intermediate_size;  // MixtralBlockSparseTop2MLP's ffn_dim
    m.norm_topk_prob = true;                         // Mixtral always renormalises
  } else {
    const bool q2 = cfg->arch == Architecture::kQwen2Moe;
    m.num_experts = q2 ? 60 : 128;
    if (f.given("num_experts")) {
      TESSERA_ASSIGN_OR_RETURN(m.num_experts, f.integer("num_experts"));
      if (m.num_experts < 0) {
        return f.error("num_experts", "must be >= 0, got " + std::to_string(m.num_experts));
      }
    }
    TESSERA_ASSIGN_OR_RETURN(m.top_k, f.positive_or("num_experts_per_tok", q2 ? 4 : 8));
    TESSERA_ASSIGN_OR_RETURN(m.expert_intermediate,
                             f.positive_or("moe_intermediate_size", q2 ? 1408 : 768));
    if (q2) {
      TESSERA_ASSIGN_OR_RETURN(m.shared_intermediate,
                               f.positive_or("shared_expert_intermediate_size", 5632));
    }
    TESSERA_ASSIGN_OR_RETURN(m.norm_topk_prob, f.boolean_or("norm_topk_prob", false));
    TESSERA_ASSIGN_OR_RETURN(m.decoder_sparse_step, f.positive_or("decoder_sparse_step", 1));
    if (f.given("mlp_only_layers")) {
      const json& l = j.at("mlp_only_layers");
      if (!l.is_array()) {
        return f.error("mlp_only_layers", "must be a list of layer indices, got " + type_name(l));
      }
      for (const json& v : l) {
        if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() >= cfg->num_layers) {
          return f.error("mlp_only_layers", "holds " + type_name(v) +
                                                ", not a layer index in [0, num_hidden_layers " +
                                                std::to_string(cfg->num_layers) + ")");
        }
        m.mlp_only_layers.push_back(v.get<int64_t>());
      }
    }
    if (!m.enabled()) return Status::ok();  // num_experts 0: every layer dense
  }
  if (m.top_k > m.num_experts) {
    return f.error("num_experts_per_tok",
                   std::to_string(m.top_k) + " is more than the " + std::to_string(m.num_experts) +
                       " experts (" +
                       (f.has("num_local_experts") ? "num_local_experts" : "num_experts") + ")");
  }
  return Status::ok();
}

// Gemma 2 / Gemma 3 (text): the (1 + w) norms around attention and MLP, the scaled embedding,
// query_pre_attn_scalar, soft-capping and the local (sliding) / global layers, defaulting as
// Gemma2Config / Gemma3TextConfig.
// config.json's layer_types (given): num_hidden_layers entries, each "sliding_attention" (true)
// or "full_attention" (false); an error naming layer_types otherwise.
Expected<std::vector<bool>> parse_layer_types(const Fields& f, const json& j, int64_t n) {
  const json& t = j.at("layer_types");
  if (!t.is_array() || static_cast<int64_t>(t.size()) != n) {
    return f.error("layer_types", "must be a list of num_hidden_layers (" + std::to_string(n) +
                                      ") layer types, got " + type_name(t) +
                                      (t.is_array() ? " of " + std::to_string(t.size()) : ""));
  }
  std::vector<bool> sliding(static_cast<size_t>(n), false);
  for (int64_t i = 0; i < n; ++i) {
    const json& v = t[static_cast<size_t>(i)];
    const std::string s = v.is_string() ? v.get<std::string>() : "";
    if (s != "sliding_attention" && s != "full_attention") {
      return f.error("layer_types", "holds " + type_name(v) + " at " + std::to_string(i) +
                                        ", not \"sliding_attention\" or \"full_attention\"");
    }
    sliding[static_cast<size_t>(i)] = s == "sliding_attention";
  }
  return sliding;
}

Status parse_gemma(const Fields& f, const json& j, ModelConfig* cfg) {
  const bool g2 = cfg->arch == Architecture::kGemma2;
  cfg->norm_unit_offset = true;
  cfg->sandwich_norms = true;
  cfg->embed_scale = std::sqrt(static_cast<double>(cfg->hidden_size));
  TESSERA_ASSIGN_OR_RETURN(double scalar, f.positive_number_or("query_pre_attn_scalar", 256));
  cfg->query_pre_attn_scalar = scalar;
  // Soft-capping: Gemma 2 on by default (50 / 30), Gemma 3 off; null turns it off.
  for (auto [key, out, fallback] :
       {std::tuple{"attn_logit_softcapping", &cfg->attn_logit_softcapping, g2 ? 50.0 : 0.0},
        std::tuple{"final_logit_softcapping", &cfg->final_logit_softcapping, g2 ? 30.0 : 0.0}}) {
    *out = f.has(key) ? 0.0 : fallback;
    if (f.given(key)) {
      TESSERA_ASSIGN_OR_RETURN(*out, f.positive_number_or(key, fallback));
    }
  }
  if (cfg->arch == Architecture::kGemma3) {
    TESSERA_ASSIGN_OR_RETURN(bool bidirectional,
                             f.boolean_or("use_bidirectional_attention", false));
    if (bidirectional) {
      return f.error("use_bidirectional_attention",
                     "true is not supported (an embedding model: causal attention only)");
    }
  }
  TESSERA_ASSIGN_OR_RETURN(int64_t window, f.positive_or("sliding_window", 4096));
  if (window > cfg->max_position_embeddings) {
    return f.error("sliding_window", std::to_string(window) +
                                         " is larger than the context, max_position_embeddings " +
                                         std::to_string(cfg->max_position_embeddings));
  }
  cfg->sliding_window = window;
  const int64_t n = cfg->num_layers;
  cfg->sliding_layers.assign(static_cast<size_t>(n), false);
  if (f.given("layer_types")) {
    TESSERA_ASSIGN_OR_RETURN(cfg->sliding_layers, parse_layer_types(f, j, n));
  } else {
    // Gemma 2: even layers local; Gemma 3: every sliding_window_pattern-th layer global.
    int64_t pattern = 2;
    if (!g2) {
      TESSERA_ASSIGN_OR_RETURN(pattern, f.positive_or("sliding_window_pattern", 6));
    }
    for (int64_t i = 0; i < n; ++i)
      cfg->sliding_layers[static_cast<size_t>(i)] = (i + 1) % pattern != 0;
  }
  return Status::ok();
}

// Qwen2/Qwen3 (and their MoE) with use_sliding_window, as their transformers configs decide:
// layer_types when given, else the layers from max_window_layers (default 28) on slide and the
// first ones attend fully. A window no layer uses is dropped; a window past the context
// (max_position_embeddings) is refused, naming sliding_window.
Status parse_qwen_window(const Fields& f, const json& j, ModelConfig* cfg) {
  TESSERA_ASSIGN_OR_RETURN(int64_t window, f.positive_or("sliding_window", 4096));
  const int64_t n = cfg->num_layers;
  std::vector<bool> sliding(static_cast<size_t>(n), false);
  if (f.given("layer_types")) {
    TESSERA_ASSIGN_OR_RETURN(sliding, parse_layer_types(f, j, n));
  } else {
    int64_t full = 28;  // Qwen2Config's / Qwen3Config's default
    if (f.given("max_window_layers")) {
      TESSERA_ASSIGN_OR_RETURN(full, f.integer("max_window_layers"));
      if (full < 0) return f.error("max_window_layers", "must be >= 0");
    }
    for (int64_t i = full; i < n; ++i) sliding[static_cast<size_t>(i)] = true;
  }
  if (std::find(sliding.begin(), sliding.end(), true) == sliding.end()) return Status::ok();
  if (window > cfg->max_position_embeddings) {
    return f.error("sliding_window", std::to_string(window) +
                                         " is larger than the context, max_position_embeddings " +
                                         std::to_string(cfg->max_position_embeddings));
  }
  cfg->sliding_window = window;
  if (std::find(sliding.begin(), sliding.end(), false) != sliding.end()) {
    cfg->sliding_layers = std::move(sliding);  // else empty: every layer slides
  }
  return Status::ok();
}

Status parse_generation_config(const std::string& text, const std::string& file, ModelConfig* cfg,
                               GenerationDefaults* defaults) {
  TESSERA_ASSIGN_OR_RETURN(json j, parse_json_object(text, file));
  Fields f(j, file);
  TESSERA_ASSIGN_OR_RETURN(std::vector<int64_t> eos, f.token_ids("eos_token_id"));
  if (!eos.empty()) cfg->eos_token_ids = eos;
  TESSERA_ASSIGN_OR_RETURN(std::optional<int64_t> bos, f.token_id("bos_token_id"));
  if (bos) cfg->bos_token_id = bos;
  TESSERA_ASSIGN_OR_RETURN(std::optional<int64_t> pad, f.token_id("pad_token_id"));
  if (pad) cfg->pad_token_id = pad;
  GenerationDefaults g;
  if (f.given("temperature")) {
    TESSERA_ASSIGN_OR_RETURN(double t, f.number_or("temperature", 1.0));
    if (t < 0) return f.error("temperature", "must be >= 0, got " + j["temperature"].dump());
    g.temperature = t;
  }
  if (f.given("top_p")) {
    TESSERA_ASSIGN_OR_RETURN(double p, f.number_or("top_p", 1.0));
    if (!(p > 0 && p <= 1)) return f.error("top_p", "must be in (0, 1], got " + j["top_p"].dump());
    g.top_p = p;
  }
  if (f.given("top_k")) {
    TESSERA_ASSIGN_OR_RETURN(int64_t k, f.integer("top_k"));
    if (k < 0) return f.error("top_k", "must be >= 0, got " + std::to_string(k));
    g.top_k = k;
  }
  if (f.given("repetition_penalty")) {
    TESSERA_ASSIGN_OR_RETURN(g.repetition_penalty, f.positive_number_or("repetition_penalty", 1.0));
  }
  if (f.given("max_new_tokens")) {
    TESSERA_ASSIGN_OR_RETURN(g.max_new_tokens, f.positive("max_new_tokens"));
  }
  TESSERA_ASSIGN_OR_RETURN(g.do_sample, f.boolean_or("do_sample", false));
  if (defaults != nullptr) *defaults = g;
  return Status::ok();
}

}  // namespace

const char* architecture_name(Architecture arch) { return arch_info(arch).hf_name; }

bool MoeConfig::sparse_layer(int64_t layer) const {
  if (!enabled()) return false;
  if (std::find(mlp_only_layers.begin(), mlp_only_layers.end(), layer) != mlp_only_layers.end()) {
    return false;
  }
  return (layer + 1) % decoder_sparse_step == 0;
}

std::string supported_architectures() {
  std::string out;
  for (const ArchInfo& info : kArchs) out += (out.empty() ? "" : ", ") + std::string(info.hf_name);
  return out;
}

Expected<ModelConfig> parse_model_config(const std::string& json_text, const std::string& file) {
  TESSERA_ASSIGN_OR_RETURN(json j, parse_json_object(json_text, file));
  Fields f(j, file);
  ModelConfig cfg;
  TESSERA_ASSIGN_OR_RETURN(cfg.arch, parse_architecture(f, j, file, &cfg.model_type));
  const ArchInfo& info = arch_info(cfg.arch);
  if (cfg.model_type.empty()) cfg.model_type = info.model_type;

  if (f.given("quantization_config")) {
    TESSERA_ASSIGN_OR_RETURN(cfg.quant,
                             parse_quantization_config(j["quantization_config"].dump(), file));
  }
  if (is_gemma(cfg.arch)) {
    // Gemma's MLP reads hidden_activation (hidden_act, when present, is not used).
    TESSERA_ASSIGN_OR_RETURN(std::string act, f.text_or("hidden_activation", "gelu_pytorch_tanh"));
    if (act != "gelu_pytorch_tanh") {
      return f.error("hidden_activation",
                     "must be \"gelu_pytorch_tanh\" (Gemma's GeGLU MLP), got \"" + act + "\"");
    }
    cfg.activation = MlpActivation::kGeluTanh;
  } else if (f.given("hidden_act")) {
    const json& act = j["hidden_act"];
    if (!act.is_string() || act.get<std::string>() != "silu") {
      return f.error("hidden_act", "must be \"silu\" (SwiGLU MLP), got " + type_name(act));
    }
  }
  TESSERA_ASSIGN_OR_RETURN(bool mlp_bias, f.boolean_or("mlp_bias", false));
  if (mlp_bias) return f.error("mlp_bias", "true is not supported (MLP projections with biases)");

  TESSERA_ASSIGN_OR_RETURN(cfg.vocab_size, f.positive("vocab_size"));
  TESSERA_ASSIGN_OR_RETURN(cfg.hidden_size, f.positive("hidden_size"));
  TESSERA_ASSIGN_OR_RETURN(cfg.intermediate_size, f.positive("intermediate_size"));
  TESSERA_ASSIGN_OR_RETURN(cfg.num_layers, f.positive("num_hidden_layers"));
  TESSERA_ASSIGN_OR_RETURN(cfg.num_heads, f.positive("num_attention_heads"));
  TESSERA_ASSIGN_OR_RETURN(cfg.num_kv_heads, f.positive_or("num_key_value_heads", cfg.num_heads));
  if (cfg.num_heads % cfg.num_kv_heads != 0) {
    return invalid_argument(file + ": num_attention_heads (" + std::to_string(cfg.num_heads) +
                            ") must be a multiple of num_key_value_heads (" +
                            std::to_string(cfg.num_kv_heads) + ")");
  }
  if (f.given("head_dim")) {
    TESSERA_ASSIGN_OR_RETURN(cfg.head_dim, f.positive("head_dim"));
  } else if (cfg.arch == Architecture::kQwen3) {
    cfg.head_dim = 128;  // Qwen3Config(head_dim=128); Qwen3MoeConfig has no such default
  } else if (is_gemma(cfg.arch)) {
    cfg.head_dim = 256;  // Gemma2Config / Gemma3TextConfig(head_dim=256)
  } else {
    if (cfg.hidden_size % cfg.num_heads != 0) {
      return invalid_argument(file + ": hidden_size (" + std::to_string(cfg.hidden_size) +
                              ") must be a multiple of num_attention_heads (" +
                              std::to_string(cfg.num_heads) + ") when head_dim is not given");
    }
    cfg.head_dim = cfg.hidden_size / cfg.num_heads;
  }
  if (cfg.head_dim % 2 != 0) {
    return invalid_argument(file + ": head_dim " + std::to_string(cfg.head_dim) +
                            " must be even (rotary embeddings rotate pairs)");
  }
  TESSERA_ASSIGN_OR_RETURN(cfg.max_position_embeddings,
                           f.positive_or("max_position_embeddings", info.default_max_positions));
  TESSERA_ASSIGN_OR_RETURN(
      cfg.rms_norm_eps,
      f.positive_number_or("rms_norm_eps", cfg.arch == Architecture::kPhi3 ? 1e-5 : 1e-6));
  // MixtralConfig / Gemma3TextConfig(rope_theta=1e6); the others 10000.
  const bool theta_1e6 = cfg.arch == Architecture::kMixtral || cfg.arch == Architecture::kGemma3;
  TESSERA_ASSIGN_OR_RETURN(cfg.rope_theta,
                           f.positive_number_or("rope_theta", theta_1e6 ? 1e6 : 10000.0));
  cfg.rotary_dim = cfg.head_dim;
  if (cfg.arch == Architecture::kPhi3) {
    TESSERA_ASSIGN_OR_RETURN(double prf, f.positive_number_or("partial_rotary_factor", 1.0));
    if (prf > 1.0)
      return f.error("partial_rotary_factor",
                     "must be in (0, 1], got " + j["partial_rotary_factor"].dump());
    cfg.rotary_dim = static_cast<int64_t>(static_cast<double>(cfg.head_dim) * prf);
  }
  if (cfg.arch == Architecture::kGemma3) {
    TESSERA_ASSIGN_OR_RETURN(cfg.rope_local_theta,
                             f.positive_number_or("rope_local_base_freq", 10000.0));
  }
  TESSERA_RETURN_IF_ERROR(parse_rope(f, j, file, &cfg));
  if (cfg.rotary_dim < 2 || cfg.rotary_dim % 2 != 0) {
    return invalid_argument(file + ": partial_rotary_factor leaves " +
                            std::to_string(cfg.rotary_dim) + " of head_dim " +
                            std::to_string(cfg.head_dim) +
                            " dimensions to rotate; RoPE needs an even number, at least 2");
  }
  TESSERA_ASSIGN_OR_RETURN(cfg.tie_word_embeddings,
                           f.boolean_or("tie_word_embeddings", is_gemma(cfg.arch)));
  TESSERA_ASSIGN_OR_RETURN(cfg.torch_dtype, parse_dtype(f));

  switch (cfg.arch) {
    case Architecture::kQwen2:
      cfg.attention_bias = true;  // Qwen2Attention: q/k/v bias=True, o_proj bias=False
      break;
    case Architecture::kQwen2Moe: {
      // Qwen2MoeAttention: q/k/v bias=config.qkv_bias (True; always, before the key existed).
      TESSERA_ASSIGN_OR_RETURN(cfg.attention_bias, f.boolean_or("qkv_bias", true));
      break;
    }
    case Architecture::kLlama:
    case Architecture::kQwen3:
    case Architecture::kQwen3Moe:
    case Architecture::kGemma2:
    case Architecture::kGemma3: {
      TESSERA_ASSIGN_OR_RETURN(bool bias, f.boolean_or("attention_bias", false));
      cfg.attention_bias = cfg.o_proj_bias = bias;
      break;
    }
    case Architecture::kMistral:
    case Architecture::kMixtral:
    case Architecture::kPhi3:  // Phi3Attention: qkv_proj and o_proj without biases
      break;
  }
  cfg.qk_norm = cfg.arch == Architecture::kQwen3 || cfg.arch == Architecture::kQwen3Moe ||
                cfg.arch == Architecture::kGemma3;
  if (is_gemma(cfg.arch)) TESSERA_RETURN_IF_ERROR(parse_gemma(f, j, &cfg));
  if (cfg.arch == Architecture::kPhi3) {
    cfg.fused_projections = true;
    if (cfg.quant.method != QuantMethod::kNone) {
      return f.error("quantization_config",
                     "on Phi-3 is not supported yet (its fused qkv_proj / gate_up_proj run "
                     "unquantized)");
    }
  }

  if (is_moe(cfg.arch)) {
    TESSERA_RETURN_IF_ERROR(parse_moe(f, j, &cfg));
    if (cfg.quant.method != QuantMethod::kNone && cfg.moe.enabled()) {
      return f.error("quantization_config",
                     "on a mixture-of-experts model is not supported yet (the experts' linear "
                     "layers run unquantized)");
    }
  }

  // Sliding window: MistralConfig defaults it to 4096 (MixtralConfig to None); Qwen2/Qwen3 (and
  // their MoE) use it only when use_sliding_window is true (their configs carry a sliding_window
  // they do not use).
  if (cfg.arch == Architecture::kMistral || cfg.arch == Architecture::kMixtral) {
    if (!f.has("sliding_window")) {
      if (cfg.arch == Architecture::kMistral) cfg.sliding_window = 4096;
    } else if (f.given("sliding_window")) {
      TESSERA_ASSIGN_OR_RETURN(cfg.sliding_window, f.positive("sliding_window"));
    }
    if (cfg.sliding_window && *cfg.sliding_window > cfg.max_position_embeddings) {
      return f.error("sliding_window", std::to_string(*cfg.sliding_window) +
                                           " is larger than the context, "
                                           "max_position_embeddings " +
                                           std::to_string(cfg.max_position_embeddings));
    }
  } else if (cfg.arch == Architecture::kPhi3) {
    // Phi3Config(sliding_window=None); every layer slides when set. A window that reaches past
    // max_position_embeddings (Phi-3-mini-128k's 262144 over 131072) never cuts: full attention.
    if (f.given("sliding_window")) {
      TESSERA_ASSIGN_OR_RETURN(int64_t w, f.positive("sliding_window"));
      if (w < cfg.max_position_embeddings) cfg.sliding_window = w;
    }
  } else if (cfg.arch != Architecture::kLlama && !is_gemma(cfg.arch)) {
    TESSERA_ASSIGN_OR_RETURN(bool use, f.boolean_or("use_sliding_window", false));
    if (use) TESSERA_RETURN_IF_ERROR(parse_qwen_window(f, j, &cfg));
  }

  if (parameter_count(cfg) > kMaxParameters) {
    return invalid_argument(
        file + ": the sizes describe a model of more than 2^48 parameters (vocab_size " +
        std::to_string(cfg.vocab_size) + ", hidden_size " + std::to_string(cfg.hidden_size) +
        ", intermediate_size " + std::to_string(cfg.intermediate_size) + ", num_hidden_layers " +
        std::to_string(cfg.num_layers) + ", num_attention_heads " + std::to_string(cfg.num_heads) +
        ", num_key_value_heads " + std::to_string(cfg.num_kv_heads) + ", head_dim " +
        std::to_string(cfg.head_dim) + ")");
  }

  TESSERA_ASSIGN_OR_RETURN(cfg.eos_token_ids, f.token_ids("eos_token_id"));
  TESSERA_ASSIGN_OR_RETURN(cfg.bos_token_id, f.token_id("bos_token_id"));
  TESSERA_ASSIGN_OR_RETURN(cfg.pad_token_id, f.token_id("pad_token_id"));
  if (cfg.arch == Architecture::kLlama || cfg.arch == Architecture::kMistral ||
      cfg.arch == Architecture::kMixtral) {
    // LlamaConfig / MistralConfig / MixtralConfig(bos_token_id=1, eos_token_id=2) when the keys
    // are absent.
    if (!f.has("bos_token_id")) cfg.bos_token_id = 1;
    if (!f.has("eos_token_id")) cfg.eos_token_ids = {2};
  } else if (is_gemma(cfg.arch)) {
    // Gemma2Config / Gemma3TextConfig(pad_token_id=0, eos_token_id=1, bos_token_id=2).
    if (!f.has("bos_token_id")) cfg.bos_token_id = 2;
    if (!f.has("eos_token_id")) cfg.eos_token_ids = {1};
    if (!f.has("pad_token_id")) cfg.pad_token_id = 0;
  } else if (cfg.arch == Architecture::kPhi3) {
    // Phi3Config(bos_token_id=1, eos_token_id=32000, pad_token_id=32000).
    if (!f.has("bos_token_id")) cfg.bos_token_id = 1;
    if (!f.has("eos_token_id")) cfg.eos_token_ids = {32000};
    if (!f.has("pad_token_id")) cfg.pad_token_id = 32000;
  }
  for (int64_t id : cfg.eos_token_ids) {
    if (id >= cfg.vocab_size) {
      return f.error("eos_token_id", std::to_string(id) + " is not below vocab_size " +
                                         std::to_string(cfg.vocab_size));
    }
  }
  return cfg;
}

Expected<ModelConfig> load_model_config(const std::string& model_dir,
                                        GenerationDefaults* defaults) {
  namespace fs = std::filesystem;
  const std::string path = (fs::path(model_dir) / "config.json").string();
  std::error_code ec;
  if (!fs::exists(path, ec)) {
    return not_found(path + ": no such file (is " + model_dir +
                     " a Hugging Face model directory?)");
  }
  TESSERA_ASSIGN_OR_RETURN(std::string text, read_text_file(path));
  TESSERA_ASSIGN_OR_RETURN(ModelConfig cfg, parse_model_config(text, path));
  const std::string gen_path = (fs::path(model_dir) / "generation_config.json").string();
  if (defaults != nullptr) *defaults = GenerationDefaults();
  if (fs::exists(gen_path, ec)) {
    TESSERA_ASSIGN_OR_RETURN(std::string gen_text, read_text_file(gen_path));
    TESSERA_RETURN_IF_ERROR(parse_generation_config(gen_text, gen_path, &cfg, defaults));
    for (int64_t id : cfg.eos_token_ids) {
      if (id >= cfg.vocab_size) {
        return invalid_argument(gen_path + ": eos_token_id " + std::to_string(id) +
                                " is not below vocab_size " + std::to_string(cfg.vocab_size));
      }
    }
  }
  return cfg;
}

int64_t ModelConfig::attention_window(int64_t layer) const {
  if (!sliding_layers.empty()) {
    const bool local = layer >= 0 && layer < static_cast<int64_t>(sliding_layers.size()) &&
                       sliding_layers[static_cast<size_t>(layer)];
    return local ? sliding_window.value_or(0) : 0;
  }
  return sliding_window.value_or(0);
}

int64_t ModelConfig::kv_cache_window() const {
  int64_t widest = 0;
  for (int64_t l = 0; l < num_layers; ++l) {
    const int64_t w = attention_window(l);
    if (w == 0) return 0;
    widest = std::max(widest, w);
  }
  return widest;
}

int64_t ModelConfig::kv_tokens_per_sequence(int64_t max_model_len, int64_t block_size) const {
  const int64_t w = kv_cache_window();
  return w > 0 ? std::min(max_model_len, w + 2 * block_size) : max_model_len;
}

bool ModelConfig::local_rope(int64_t layer) const {
  return rope_local_theta > 0 && attention_window(layer) > 0;
}

AttentionScoring ModelConfig::attention_scoring(int64_t layer) const {
  const double d = query_pre_attn_scalar ? *query_pre_attn_scalar : static_cast<double>(head_dim);
  AttentionScoring s;
  s.scale = static_cast<float>(std::pow(d, -0.5));
  s.softcap = static_cast<float>(attn_logit_softcapping);
  s.window = attention_window(layer);
  return s;
}

}  // namespace tessera
