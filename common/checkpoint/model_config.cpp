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
// MixtralConfig, Qwen2MoeConfig and Qwen3MoeConfig.
constexpr ArchInfo kArchs[] = {
    {Architecture::kLlama, "LlamaForCausalLM", "llama", 2048},
    {Architecture::kMistral, "MistralForCausalLM", "mistral", 4096 * 32},
    {Architecture::kQwen2, "Qwen2ForCausalLM", "qwen2", 32768},
    {Architecture::kQwen3, "Qwen3ForCausalLM", "qwen3", 32768},
    {Architecture::kMixtral, "MixtralForCausalLM", "mixtral", 4096 * 32},
    {Architecture::kQwen2Moe, "Qwen2MoeForCausalLM", "qwen2_moe", 32768},
    {Architecture::kQwen3Moe, "Qwen3MoeForCausalLM", "qwen3_moe", 32768},
};

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

Status parse_rope(const Fields& f, const json& j, const std::string& file, ModelConfig* cfg) {
  // transformers 5 writes "rope_parameters" (with rope_theta inside); 4.x "rope_scaling".
  const char* key = nullptr;
  if (f.given("rope_scaling")) key = "rope_scaling";
  if (f.given("rope_parameters")) key = "rope_parameters";
  if (key == nullptr) return Status::ok();
  const json& r = j.at(key);
  if (!r.is_object()) return f.error(key, "must be an object or null, got " + type_name(r));
  Fields rf(r, file, std::string(key) + ".");
  if (std::string(key) == "rope_parameters" && rf.given("rope_theta")) {
    TESSERA_ASSIGN_OR_RETURN(cfg->rope_theta, rf.positive_number_or("rope_theta", 10000.0));
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
  if (type != "llama3") {
    return invalid_argument(file + ": " + key + " type '" + type +
                            "' is not supported (supported: llama3, or none/default)");
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
  if (f.given("hidden_act")) {
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
  TESSERA_ASSIGN_OR_RETURN(cfg.rms_norm_eps, f.positive_number_or("rms_norm_eps", 1e-6));
  // MixtralConfig(rope_theta=1e6); the others 10000.
  TESSERA_ASSIGN_OR_RETURN(
      cfg.rope_theta,
      f.positive_number_or("rope_theta", cfg.arch == Architecture::kMixtral ? 1e6 : 10000.0));
  TESSERA_RETURN_IF_ERROR(parse_rope(f, j, file, &cfg));
  TESSERA_ASSIGN_OR_RETURN(cfg.tie_word_embeddings, f.boolean_or("tie_word_embeddings", false));
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
    case Architecture::kQwen3Moe: {
      TESSERA_ASSIGN_OR_RETURN(bool bias, f.boolean_or("attention_bias", false));
      cfg.attention_bias = cfg.o_proj_bias = bias;
      break;
    }
    case Architecture::kMistral:
    case Architecture::kMixtral:
      break;
  }
  cfg.qk_norm = cfg.arch == Architecture::kQwen3 || cfg.arch == Architecture::kQwen3Moe;

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
  } else if (cfg.arch != Architecture::kLlama) {
    TESSERA_ASSIGN_OR_RETURN(bool use, f.boolean_or("use_sliding_window", false));
    if (use) {
      TESSERA_ASSIGN_OR_RETURN(cfg.sliding_window, f.positive_or("sliding_window", 4096));
    }
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

}  // namespace tessera
