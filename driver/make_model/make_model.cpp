#include "driver/make_model/make_model.h"

#include <spdlog/spdlog.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <thread>

#include "common/checkpoint/layer_plan.h"
#include "common/checkpoint/safetensors.h"
#include "common/progress.h"
#include "common/tokenizer/bpe_model.h"
#include "common/tokenizer/json_file.h"
#include "driver/cli/cli_help.h"
#include "driver/make_model/presets.h"

namespace tessera {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// The transformers release whose config classes' to_dict() the written config.json mirrors.
constexpr const char* kTransformersVersion = "4.51.0";

using model_shapes::Shape;
using model_shapes::shapes;

const char* model_type_of(Architecture arch) {
  switch (arch) {
    case Architecture::kLlama:
      return "llama";
    case Architecture::kMistral:
      return "mistral";
    case Architecture::kQwen2:
      return "qwen2";
    case Architecture::kQwen3:
      return "qwen3";
    case Architecture::kMixtral:
      return "mixtral";
    case Architecture::kQwen2Moe:
      return "qwen2_moe";
    case Architecture::kQwen3Moe:
      return "qwen3_moe";
    case Architecture::kGemma2:
      return "gemma2";
    case Architecture::kGemma3:
      return "gemma3";  // make-model's name; config.json says gemma3_text
    case Architecture::kPhi3:
      return "phi3";
  }
  return "?";
}

constexpr Architecture kAllArchs[] = {
    Architecture::kLlama,   Architecture::kMistral,  Architecture::kQwen2,    Architecture::kQwen3,
    Architecture::kMixtral, Architecture::kQwen2Moe, Architecture::kQwen3Moe, Architecture::kGemma2,
    Architecture::kGemma3,  Architecture::kPhi3};

std::string arch_names() {
  std::string out;
  for (Architecture a : kAllArchs) out += (out.empty() ? "" : ", ") + std::string(model_type_of(a));
  return out;
}

std::optional<Architecture> parse_arch(const std::string& s) {
  for (Architecture a : kAllArchs) {
    if (s == model_type_of(a) || s == architecture_name(a)) return a;
  }
  return std::nullopt;
}

std::string preset_names() {
  std::string out;
  for (const Shape& s : shapes()) {
    if (out.find(s.name) == std::string::npos)
      out += (out.empty() ? "" : ", ") + std::string(s.name);
  }
  return out;
}

Expected<const Shape*> find_shape(const MakeModelOptions& o) {
  std::optional<Architecture> arch;
  if (!o.arch.empty()) {
    arch = parse_arch(o.arch);
    if (!arch) {
      return invalid_argument("make-model: unknown --arch '" + o.arch +
                              "' (known: " + arch_names() + ")");
    }
  }
  if (!arch && o.preset == "tiny") {
    return invalid_argument("make-model: --arch is required with --preset tiny (" + arch_names() +
                            ")");
  }
  const Shape* named = nullptr;
  for (const Shape& s : shapes()) {
    if (o.preset != s.name) continue;
    if (!arch || *arch == s.arch) return &s;
    named = &s;
  }
  if (named == nullptr) {
    return invalid_argument("make-model: unknown --preset '" + o.preset +
                            "' (known: " + preset_names() + ")");
  }
  return invalid_argument("make-model: preset '" + o.preset + "' is a " +
                          model_type_of(named->arch) + " model, but --arch says " + o.arch);
}

Expected<DType> parse_dtype(const std::string& s) {
  if (s == "bf16" || s == "bfloat16") return DType::kBF16;
  if (s == "fp16" || s == "f16" || s == "float16") return DType::kF16;
  if (s == "fp32" || s == "f32" || s == "float32") return DType::kF32;
  return invalid_argument("make-model: unknown --dtype '" + s + "' (bf16, fp16 or fp32)");
}

const char* torch_dtype_name(DType d) {
  switch (d) {
    case DType::kF32:
      return "float32";
    case DType::kF16:
      return "float16";
    case DType::kBF16:
      return "bfloat16";
    case DType::kI32:
    case DType::kF8E4M3:
      break;
  }
  return "?";
}

Expected<json> read_json(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return not_found(path.string() + ": cannot open (" + std::strerror(errno) + ")");
  std::ostringstream text;  // parsing a string is faster than parsing the stream
  text << in.rdbuf();
  try {
    return json::parse(text.str());
  } catch (const json::exception& e) {  // parse_error, or out_of_range for 1e999
    return invalid_argument(path.string() + ": not valid JSON (" + e.what() + ")");
  }
}

// What make-model needs from a tokenizer directory.
struct TokenizerInfo {
  int64_t vocab_size = 0;  // highest id + 1, added tokens included
  std::optional<int64_t> bos, eos, pad;
};

Expected<TokenizerInfo> read_tokenizer(const std::string& dir) {
  const fs::path tj = fs::path(dir) / "tokenizer.json";
  std::error_code ec;
  if (!fs::is_regular_file(tj, ec)) {
    return not_found("make-model: no tokenizer.json in tokenizer directory '" + dir + "'");
  }
  // The vocab (and merges) stream past the document (tokenizer::parse_tokenizer_json): a
  // 128k-token vocabulary as document nodes was most of make-model's time for a tiny model.
  tokenizer::BpeTables tables;
  TESSERA_ASSIGN_OR_RETURN(std::string text, tokenizer::read_text_file(tj.string()));
  TESSERA_ASSIGN_OR_RETURN(json tok, tokenizer::parse_tokenizer_json(text, tj.string(), tables));
  TokenizerInfo info;
  std::map<std::string, int64_t> special;  // content → id
  if (tok.contains("added_tokens") && tok["added_tokens"].is_array()) {
    for (const json& t : tok["added_tokens"]) {
      if (!t.is_object() || !t.contains("id") || !t["id"].is_number_integer()) continue;
      const int64_t id = t["id"].get<int64_t>();
      info.vocab_size = std::max(info.vocab_size, id + 1);
      if (t.contains("content") && t["content"].is_string()) special[t["content"]] = id;
    }
  }
  const json* vocab = nullptr;  // a vocab the document kept (not a BPE object: Unigram's list)
  if (!tables.vocab_streamed && tok.contains("model") && tok["model"].is_object() &&
      tok["model"].contains("vocab")) {
    vocab = &tok["model"]["vocab"];
  }
  for (const auto& [slice, id] : tables.vocab) {  // BPE / WordPiece / WordLevel: token → id
    info.vocab_size = std::max<int64_t>(info.vocab_size, int64_t{id} + 1);
  }
  if (vocab != nullptr && vocab->is_array()) {  // Unigram: [[piece, score], ...]
    info.vocab_size = std::max(info.vocab_size, static_cast<int64_t>(vocab->size()));
  }
  if (info.vocab_size <= 0) {
    return invalid_argument(tj.string() + ": no vocabulary found (model.vocab / added_tokens)");
  }
  auto id_of = [&](const std::string& content) -> std::optional<int64_t> {
    if (auto it = special.find(content); it != special.end()) return it->second;
    std::optional<int64_t> id;  // the last listing wins, as in the tokenizer's own map
    for (const auto& [slice, token_id] : tables.vocab) {
      if (tables.view(slice) == content) id = token_id;
    }
    return id;
  };

  const fs::path tc = fs::path(dir) / "tokenizer_config.json";
  if (!fs::is_regular_file(tc, ec)) {
    spdlog::warn("make-model: {} has no tokenizer_config.json; bos/eos ids left unset", dir);
    return info;
  }
  TESSERA_ASSIGN_OR_RETURN(json cfg, read_json(tc));
  auto token = [&](const char* key) -> Expected<std::optional<int64_t>> {
    if (!cfg.contains(key) || cfg[key].is_null()) return std::optional<int64_t>();
    const json& v = cfg[key];
    std::string content;
    if (v.is_string()) {
      content = v.get<std::string>();
    } else if (v.is_object() && v.contains("content") && v["content"].is_string()) {
      content = v["content"].get<std::string>();  // an AddedToken dict
    } else {
      return invalid_argument(tc.string() + ": " + key + " must be a string, got " + v.dump());
    }
    std::optional<int64_t> id = id_of(content);
    if (!id) {
      return invalid_argument(tc.string() + ": " + key + " '" + content +
                              "' is not a token of tokenizer.json");
    }
    return id;
  };
  TESSERA_ASSIGN_OR_RETURN(info.bos, token("bos_token"));
  TESSERA_ASSIGN_OR_RETURN(info.eos, token("eos_token"));
  TESSERA_ASSIGN_OR_RETURN(info.pad, token("pad_token"));
  return info;
}

json id_or_null(const std::optional<int64_t>& id) { return id ? json(*id) : json(nullptr); }

// Gemma2Config's / Gemma3TextConfig's keys (as the published configs have them).
void add_gemma(json& c, const Shape& s, int64_t head_dim) {
  const bool g3 = s.arch == Architecture::kGemma3;
  c["attention_bias"] = false;
  c["attn_logit_softcapping"] = s.attn_softcap > 0 ? json(s.attn_softcap) : json(nullptr);
  c["cache_implementation"] = "hybrid";
  c["final_logit_softcapping"] = s.final_softcap > 0 ? json(s.final_softcap) : json(nullptr);
  c["head_dim"] = head_dim;
  c["hidden_act"] = "gelu_pytorch_tanh";
  c["hidden_activation"] = "gelu_pytorch_tanh";
  c["query_pre_attn_scalar"] = s.query_pre_attn_scalar;
  c["sliding_window"] = s.sliding_window;
  const int64_t pattern = g3 ? s.window_pattern : 2;
  if (g3) {
    c["rope_local_base_freq"] = s.rope_local_theta;
    c["rope_scaling"] = s.linear_rope_factor > 0
                            ? json{{"factor", s.linear_rope_factor}, {"rope_type", "linear"}}
                            : json(nullptr);
    c["sliding_window_pattern"] = pattern;
  }
  if (s.layer_types) {
    json types = json::array();
    for (int64_t i = 0; i < s.layers; ++i) {
      types.push_back((i + 1) % pattern != 0 ? "sliding_attention" : "full_attention");
    }
    c["layer_types"] = types;
  }
}

// Phi3Config's keys. Tiny LongRoPE factors: short 1 + i / 4, long 2 + 3i / 2 for frequency i.
void add_phi3(json& c, const Shape& s, int64_t head_dim) {
  c["embd_pdrop"] = 0.0;
  c["resid_pdrop"] = 0.0;
  c["original_max_position_embeddings"] = s.original_max_positions;
  c["sliding_window"] = s.sliding_window != 0 ? json(s.sliding_window) : json(nullptr);
  const double partial = s.partial_rotary > 0 ? s.partial_rotary : 1.0;
  if (s.partial_rotary > 0) c["partial_rotary_factor"] = s.partial_rotary;
  c["rope_scaling"] = nullptr;
  if (!s.long_factor.empty()) {
    const std::vector<double> long_f(s.long_factor.begin(), s.long_factor.end());
    const std::vector<double> short_f(s.short_factor.begin(), s.short_factor.end());
    c["rope_scaling"] = {{"long_factor", long_f}, {"short_factor", short_f}, {"type", "longrope"}};
  } else if (s.longrope) {
    const int64_t n = static_cast<int64_t>(static_cast<double>(head_dim) * partial) / 2;
    json short_f = json::array(), long_f = json::array();
    for (int64_t i = 0; i < n; ++i) {
      short_f.push_back(1.0 + 0.25 * static_cast<double>(i));
      long_f.push_back(2.0 + 1.5 * static_cast<double>(i));
    }
    c["rope_scaling"] = {{"long_factor", long_f}, {"short_factor", short_f}, {"type", "longrope"}};
  }
}

// config.json with the keys transformers' config class for the architecture writes.
json build_config(const Shape& s, const TokenizerInfo& tok, int64_t vocab, DType dtype) {
  const int64_t head_dim = s.head_dim != 0 ? s.head_dim : s.hidden / s.heads;
  json c = {
      {"architectures", {architecture_name(s.arch)}},
      {"attention_dropout", 0.0},
      {"bos_token_id", id_or_null(tok.bos)},
      {"eos_token_id", id_or_null(tok.eos)},
      {"hidden_act", "silu"},
      {"hidden_size", s.hidden},
      {"initializer_range", 0.02},
      {"intermediate_size", s.intermediate},
      {"max_position_embeddings", s.max_positions},
      {"model_type", s.arch == Architecture::kGemma3 ? "gemma3_text" : model_type_of(s.arch)},
      {"num_attention_heads", s.heads},
      {"num_hidden_layers", s.layers},
      {"num_key_value_heads", s.kv_heads},
      {"rms_norm_eps", s.rms_norm_eps},
      {"rope_theta", s.rope_theta},
      {"tie_word_embeddings", s.tie},
      {"torch_dtype", torch_dtype_name(dtype)},
      {"transformers_version", kTransformersVersion},
      {"use_cache", true},
      {"vocab_size", vocab},
  };
  json rope = nullptr;
  if (s.llama3_rope_factor > 0) {
    rope = {{"factor", s.llama3_rope_factor},
            {"high_freq_factor", 4.0},
            {"low_freq_factor", 1.0},
            {"original_max_position_embeddings", 8192},
            {"rope_type", "llama3"}};
  }
  switch (s.arch) {
    case Architecture::kLlama:
      c["attention_bias"] = false;
      c["head_dim"] = head_dim;
      c["mlp_bias"] = false;
      c["pretraining_tp"] = 1;
      c["rope_scaling"] = rope;
      break;
    case Architecture::kMixtral:
      c["num_local_experts"] = s.experts;
      c["num_experts_per_tok"] = s.top_k;
      c["output_router_logits"] = false;
      c["router_aux_loss_coef"] = 0.02;
      c["router_jitter_noise"] = 0.0;
      [[fallthrough]];
    case Architecture::kMistral:
      c["head_dim"] = head_dim;
      c["sliding_window"] = s.sliding_window != 0 ? json(s.sliding_window) : json(nullptr);
      break;
    case Architecture::kQwen3:
    case Architecture::kQwen3Moe:
      c["attention_bias"] = false;
      c["head_dim"] = head_dim;
      [[fallthrough]];
    case Architecture::kQwen2:
    case Architecture::kQwen2Moe:
      c["max_window_layers"] = s.layers;
      c["rope_scaling"] = rope;
      c["sliding_window"] = nullptr;  // unused: use_sliding_window is false
      c["use_sliding_window"] = false;
      break;
    case Architecture::kGemma2:
    case Architecture::kGemma3:
      add_gemma(c, s, head_dim);
      break;
    case Architecture::kPhi3:
      add_phi3(c, s, head_dim);
      // Phi3Config's default pad_token_id (32000) lies outside a smaller vocabulary, where
      // transformers refuses it as the embedding's padding_idx: the tokenizer's, or none.
      c["pad_token_id"] = id_or_null(tok.pad);
      break;
  }
  if (s.arch == Architecture::kQwen2Moe || s.arch == Architecture::kQwen3Moe) {
    c["decoder_sparse_step"] = 1;
    c["mlp_only_layers"] = s.dense_layer >= 0 ? json::array({s.dense_layer}) : json::array();
    c["moe_intermediate_size"] = s.moe_intermediate;
    c["norm_topk_prob"] = s.norm_topk_prob;
    c["num_experts"] = s.experts;
    c["num_experts_per_tok"] = s.top_k;
    c["output_router_logits"] = false;
    c["router_aux_loss_coef"] = 0.001;
    if (s.arch == Architecture::kQwen2Moe) {
      c["shared_expert_intermediate_size"] = s.shared_intermediate;
    }
  }
  return c;
}

// ---- seeded values ----------------------------------------------------------------------------

uint64_t mix64(uint64_t z) {  // splitmix64's finaliser
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

uint64_t tensor_key(uint64_t seed, const std::string& name) {
  uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a
  for (unsigned char c : name) h = (h ^ c) * 0x100000001b3ull;
  return mix64(seed ^ mix64(h));
}

// How one tensor's values are drawn: mean + std · z, z ≈ N(0, 1).
struct Init {
  uint64_t key;
  float mean;
  float std;
  DType dtype;
};

Init init_for(const WeightSpec& w, const ModelConfig& c, uint64_t seed, DType dtype) {
  Init init{tensor_key(seed, w.name), 0.f, 0.f, dtype};
  switch (w.role) {
    case WeightRole::kEmbedding:
      init.std = 1.f / std::sqrt(static_cast<float>(c.hidden_size));
      break;
    case WeightRole::kLinear: {
      float std = 1.f / std::sqrt(static_cast<float>(w.shape[1]));
      // The projections that write into the residual stream (an expert's down too: w2).
      const bool residual = w.kind == WeightKind::kO || w.kind == WeightKind::kDown ||
                            w.kind == WeightKind::kExpertDown || w.kind == WeightKind::kSharedDown;
      if (residual) std /= std::sqrt(2.f * static_cast<float>(c.num_layers));
      init.std = std;
      break;
    }
    case WeightRole::kNorm:
      init.mean = c.norm_unit_offset ? 0.f : 1.f;  // Gemma scales by 1 + w
      init.std = 0.1f;
      break;
    case WeightRole::kBias:
      init.std = 0.1f;
      break;
  }
  return init;
}

// Counter-based: element i depends only on (key, i). A sum of four 16-bit uniforms, centred and
// scaled to unit variance (Irwin–Hall), is close to normal and bounded by ±2√3.
inline float normal_at(uint64_t key, uint64_t i) {
  const uint64_t h = mix64(key + (i + 1) * 0x9e3779b97f4a7c15ull);
  const uint32_t s =
      static_cast<uint32_t>((h & 0xffff) + ((h >> 16) & 0xffff) + ((h >> 32) & 0xffff) + (h >> 48));
  return (static_cast<float>(s + 2) * (1.f / 65536.f) - 2.f) * 1.7320508f;
}

void fill_range(const Init& init, uint64_t first, size_t n, uint8_t* out) {
  for (size_t j = 0; j < n; ++j) {
    const float v = init.mean + init.std * normal_at(init.key, first + j);
    switch (init.dtype) {
      case DType::kF32:
        std::memcpy(out + 4 * j, &v, 4);
        break;
      case DType::kBF16: {
        const uint16_t b = float_to_bf16(v);
        std::memcpy(out + 2 * j, &b, 2);
        break;
      }
      case DType::kF16: {
        const uint16_t b = float_to_f16(v);
        std::memcpy(out + 2 * j, &b, 2);
        break;
      }
      case DType::kI32:
      case DType::kF8E4M3:
        break;  // make-model draws float tensors; quantization packs them afterwards
    }
  }
}

Status fill(const Init& init, uint64_t offset, std::span<uint8_t> out) {
  const size_t esize = dtype_size(init.dtype);
  const uint64_t first = offset / esize;
  const size_t n = out.size() / esize;
  const size_t threads =
      n < (1u << 20) ? 1 : std::clamp<size_t>(std::thread::hardware_concurrency(), 1, 16);
  if (threads == 1) {
    fill_range(init, first, n, out.data());
    return Status::ok();
  }
  std::vector<std::thread> pool;
  const size_t per = (n + threads - 1) / threads;
  for (size_t t = 0; t < threads; ++t) {
    const size_t begin = t * per, end = std::min(n, begin + per);
    if (begin >= end) break;
    pool.emplace_back(fill_range, std::cref(init), first + begin, end - begin,
                      out.data() + begin * esize);
  }
  for (std::thread& th : pool) th.join();
  return Status::ok();
}

// ---- output -----------------------------------------------------------------------------------

Status write_text(const fs::path& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
  out.close();
  if (!out) return internal_error(path.string() + ": write failed (" + std::strerror(errno) + ")");
  return Status::ok();
}

Status prepare_out_dir(const std::string& out) {
  if (out.empty()) return invalid_argument("make-model: --out is required");
  std::error_code ec;
  if (fs::exists(out, ec)) {
    if (!fs::is_directory(out, ec)) {
      return invalid_argument("make-model: --out '" + out + "' exists and is not a directory");
    }
    if (!fs::is_empty(out, ec)) {
      return invalid_argument("make-model: --out '" + out +
                              "' exists and is not empty; refusing to write into it");
    }
    return Status::ok();
  }
  fs::create_directories(out, ec);
  if (ec) return internal_error("make-model: cannot create '" + out + "' (" + ec.message() + ")");
  return Status::ok();
}

// The tensors of a quantized linear layer, made (quantize_linear) from the float weights the
// seed draws for its plain .weight; the writer asks for them in pieces, in its own order, so
// the last layer made is kept.
class QuantizedLayer {
 public:
  explicit QuantizedLayer(QuantConfig q) : q_(std::move(q)) {}

  // A tensor of a quantized linear layer (not a plain float one).
  static bool holds(const WeightSpec& w) {
    return w.part != WeightPart::kWeight || (w.dtype && *w.dtype == DType::kF8E4M3);
  }

  // Adds tensor `w` to `writer`; `plain` is the model unquantized, `written(n)` counts bytes.
  template <typename Written>
  Status add(SafetensorsWriter& writer, const WeightSpec& w, const ModelConfig& plain,
             uint64_t seed, Written written) {
    const size_t dot = w.name.rfind('.');
    const std::string module = w.name.substr(0, dot), suffix = w.name.substr(dot + 1);
    WeightSpec source;
    for (const WeightSpec& s : expected_weights_cached(plain)) {
      if (s.name == module + ".weight") source = s;
    }
    if (source.name.empty()) return internal_error("make-model: no float weight for " + w.name);
    const Init init = init_for(source, plain, seed, DType::kF32);
    const DType dtype = w.dtype                         ? *w.dtype
                        : w.part == WeightPart::kScales ? DType::kF16
                                                        : DType::kF32;
    auto self = this;
    return writer.add(TensorSpec{w.name, dtype, w.shape},
                      [self, init, source, module, suffix, dtype, shape = w.shape, seed, written](
                          uint64_t offset, std::span<uint8_t> bytes) -> Status {
                        TESSERA_ASSIGN_OR_RETURN(const QuantizedPart* part,
                                                 self->part(module, suffix, init, source, seed));
                        if (part->dtype != dtype || part->shape != shape ||
                            offset + bytes.size() > part->bytes.size()) {
                          return internal_error("make-model: " + module + "." + suffix +
                                                " does not match the weight table");
                        }
                        std::memcpy(bytes.data(), part->bytes.data() + offset, bytes.size());
                        written(bytes.size());
                        return Status::ok();
                      });
  }

 private:
  // The input a layer reads, named for the layers that share it: GPTQ's act-order comes from
  // the input's statistics, so q, k and v (and gate and up) share their g_idx.
  static std::string input_of(const std::string& module) {
    for (const auto& [part, shared] : {std::pair{"self_attn.q_proj", "self_attn.qkv"},
                                       {"self_attn.k_proj", "self_attn.qkv"},
                                       {"self_attn.v_proj", "self_attn.qkv"},
                                       {"mlp.gate_proj", "mlp.gate_up"},
                                       {"mlp.up_proj", "mlp.gate_up"}}) {
      const std::string p(part);
      if (module.ends_with(p)) return module.substr(0, module.size() - p.size()) + shared;
    }
    return module;
  }

  const std::vector<WeightSpec>& expected_weights_cached(const ModelConfig& plain) {
    if (table_.empty()) table_ = expected_weights(plain);
    return table_;
  }

  Expected<const QuantizedPart*> part(const std::string& module, const std::string& suffix,
                                      const Init& init, const WeightSpec& source, uint64_t seed) {
    // The writer orders a file's tensors by dtype, then name: a layer's int32 qweight and
    // qzeros come together, its F16 scales in a later run over all layers. So the small parts
    // of every layer made are kept (scales, zeros, g_idx, weight_scale: ~1/64 of the bytes),
    // and the large one of the last layer only; a layer is made again only when its large part
    // is asked for after it was dropped (FP8's weight after its F32 scale).
    if (const auto it = small_.find(module + "." + suffix); it != small_.end()) return &it->second;
    if (module != module_) {
      const int64_t out = source.shape[0], in = source.shape[1];
      // The float weights block by block as quantize_linear asks (never the whole layer).
      auto rows = [&init, in](int64_t first, int64_t last, float* dst) {
        fill_range(init, static_cast<uint64_t>(first * in),
                   static_cast<size_t>((last - first) * in), reinterpret_cast<uint8_t*>(dst));
      };
      parts_ = quantize_linear(rows, out, in, q_, tensor_key(seed, input_of(module)));
      module_ = module;
      const QuantizedPart* largest = nullptr;
      for (const QuantizedPart& p : parts_) {
        if (largest == nullptr || p.bytes.size() > largest->bytes.size()) largest = &p;
      }
      for (const QuantizedPart& p : parts_) {
        if (&p != largest) small_.emplace(module + "." + p.suffix, p);
      }
    }
    for (const QuantizedPart& p : parts_) {
      if (p.suffix == suffix) return &p;
    }
    return internal_error("make-model: " + q_.describe() + " writes no " + module + "." + suffix);
  }

  QuantConfig q_;
  std::vector<WeightSpec> table_;  // the plain model's
  std::string module_;             // the layer parts_ holds
  std::vector<QuantizedPart> parts_;
  std::map<std::string, QuantizedPart> small_;  // every layer's small parts, by tensor name
};

struct Plan {
  Shape shape;  // the preset's, with the options' overrides
  DType dtype;
  TokenizerInfo tok;
  json config;
  ModelConfig parsed;  // what config.json says, quantization_config included
  ModelConfig plain;   // the same model unquantized: the float weights the quantized are made of
};

Expected<Plan> plan(const MakeModelOptions& o) {
  Plan p;
  TESSERA_ASSIGN_OR_RETURN(const Shape* preset, find_shape(o));
  p.shape = *preset;
  const MakeModelOptions::Overrides& ov = o.overrides;
  for (int64_t v : {ov.hidden_size, ov.intermediate_size, ov.num_layers, ov.num_heads,
                    ov.num_kv_heads, ov.head_dim, ov.vocab_size}) {
    if (v < 0) return invalid_argument("make-model: shape overrides must be positive");
  }
  if (ov.hidden_size) p.shape.hidden = ov.hidden_size;
  if (ov.intermediate_size) p.shape.intermediate = ov.intermediate_size;
  if (ov.num_layers) p.shape.layers = ov.num_layers;
  if (ov.num_heads) p.shape.heads = ov.num_heads;
  if (ov.num_kv_heads) p.shape.kv_heads = ov.num_kv_heads;
  if (ov.head_dim) p.shape.head_dim = ov.head_dim;
  if (ov.vocab_size) p.shape.vocab = ov.vocab_size;
  if (p.shape.heads <= 0 || (p.shape.head_dim == 0 && p.shape.hidden % p.shape.heads != 0)) {
    return invalid_argument("make-model: hidden_size " + std::to_string(p.shape.hidden) +
                            " is not a multiple of num_heads " + std::to_string(p.shape.heads) +
                            ": give --head-dim");
  }
  if ((p.shape.arch == Architecture::kQwen2 || p.shape.arch == Architecture::kQwen2Moe ||
       p.shape.arch == Architecture::kPhi3) &&
      p.shape.head_dim != 0 && p.shape.head_dim * p.shape.heads != p.shape.hidden) {
    return invalid_argument(std::string("make-model: ") +
                            (p.shape.arch == Architecture::kPhi3 ? "Phi-3" : "Qwen2") +
                            " has no head_dim setting (it is hidden_size / num_heads): change "
                            "--hidden-size or --num-heads instead");
  }
  TESSERA_ASSIGN_OR_RETURN(p.dtype, parse_dtype(o.dtype));
  if (o.tokenizer_dir.empty()) return invalid_argument("make-model: --tokenizer is required");
  TESSERA_ASSIGN_OR_RETURN(p.tok, read_tokenizer(o.tokenizer_dir));
  const TokenizerInfo& tok = p.tok;
  const int64_t vocab = p.shape.vocab != 0 ? p.shape.vocab : tok.vocab_size;
  if (tok.vocab_size > vocab) {
    return invalid_argument("make-model: the tokenizer in '" + o.tokenizer_dir + "' has " +
                            std::to_string(tok.vocab_size) + " tokens, more than preset '" +
                            o.preset + "''s vocab_size " + std::to_string(vocab) +
                            " (use the model's own tokenizer)");
  }
  p.config = build_config(p.shape, tok, vocab, p.dtype);
  TESSERA_ASSIGN_OR_RETURN(QuantConfig quant, make_model_quantization(o.quantization));
  if (quant.method != QuantMethod::kNone) {
    p.config["quantization_config"] = json::parse(quantization_config_json(quant));
  }
  // Parse what we are about to write: the reader is the judge of a valid config.
  Expected<ModelConfig> parsed = parse_model_config(p.config.dump(), "config.json (generated)");
  if (!parsed) return parsed.status().with_context("make-model: internal error");
  p.parsed = *parsed;
  p.plain = *parsed;
  p.plain.quant = QuantConfig{};
  // A quantized model's shape must split into its format's groups and int32s.
  for (const WeightSpec& w : expected_weights(p.plain)) {
    if (w.role != WeightRole::kLinear || w.layer < 0) continue;
    TESSERA_RETURN_IF_ERROR(
        check_linear_shape(quant, w.shape[0], w.shape[1], w.name.substr(0, w.name.rfind('.')))
            .with_context("make-model"));
  }
  return p;
}

}  // namespace

std::vector<MakeModelPreset> make_model_presets() {
  std::vector<MakeModelPreset> out;
  for (const Shape& s : shapes()) out.push_back({s.name, s.arch, s.source});
  return out;
}

Expected<QuantConfig> make_model_quantization(const MakeModelOptions::Quantization& o) {
  QuantConfig q;
  if (o.method == "none" || o.method.empty()) return q;
  if (o.method != "awq" && o.method != "gptq" && o.method != "fp8") {
    return invalid_argument("make-model: --quantization " + o.method +
                            " is not one of none, awq, gptq, fp8");
  }
  // The exporter's own config is the judge: write it, then read it back.
  QuantConfig want;
  if (o.method == "fp8") {
    want.method = QuantMethod::kFp8;
    want.bits = 8;
    if (o.weight_scale != "tensor" && o.weight_scale != "channel") {
      return invalid_argument("make-model: --weight-scale must be tensor or channel, got " +
                              o.weight_scale);
    }
    want.weight_scale = o.weight_scale == "channel" ? Fp8Scale::kChannel : Fp8Scale::kTensor;
    if (o.activations == "dynamic") {
      want.activations = Fp8Activations::kDynamic;
    } else if (o.activations == "static") {
      want.activations = Fp8Activations::kStatic;
    } else if (o.activations == "none") {
      want.activations = Fp8Activations::kNone;
    } else {
      return invalid_argument("make-model: --activations must be dynamic, static or none, got " +
                              o.activations);
    }
  } else {
    want.method = o.method == "awq" ? QuantMethod::kAwq : QuantMethod::kGptq;
    want.bits = o.bits;
    want.group_size = o.group_size == -1 ? 0 : o.group_size;
    want.desc_act = o.desc_act;
    want.sym = want.method == QuantMethod::kGptq && !o.asym;
  }
  Expected<QuantConfig> back =
      parse_quantization_config(quantization_config_json(want), "make-model --quantization");
  if (!back) return back.status();
  return *back;
}

Expected<std::string> make_model_config_json(const MakeModelOptions& options) {
  TESSERA_ASSIGN_OR_RETURN(Plan p, plan(options));
  return p.config.dump(2) + "\n";
}

Status make_model(const MakeModelOptions& o) {
  TESSERA_ASSIGN_OR_RETURN(Plan p, plan(o));
  TESSERA_RETURN_IF_ERROR(prepare_out_dir(o.out));
  const fs::path out(o.out);

  const std::vector<WeightSpec> weights = expected_weights(p.parsed);
  SafetensorsWriter writer;
  // Bytes as the writer asks for them (in order, on this thread): a bar on a terminal, a line per
  // tenth otherwise, and a summary.
  auto progress = std::make_shared<Progress>("make-model: writing weights");
  auto produced = std::make_shared<uint64_t>(0);
  auto all_bytes = std::make_shared<uint64_t>(0);  // the writer's total, known once all are added
  auto quantized = std::make_shared<QuantizedLayer>(p.parsed.quant);
  for (const WeightSpec& w : weights) {
    if (QuantizedLayer::holds(w)) {
      TESSERA_RETURN_IF_ERROR(
          quantized->add(writer, w, p.plain, o.seed, [progress, produced, all_bytes](size_t n) {
            *produced += n;
            progress->update(*produced, *all_bytes);
          }));
      continue;
    }
    const Init init = init_for(w, p.parsed, o.seed, p.dtype);
    TESSERA_RETURN_IF_ERROR(writer.add(
        TensorSpec{w.name, p.dtype, w.shape},
        [init, progress, produced, all_bytes](uint64_t offset, std::span<uint8_t> bytes) {
          Status st = fill(init, offset, bytes);
          *produced += bytes.size();
          progress->update(*produced, *all_bytes);
          return st;
        }));
  }
  const uint64_t total = writer.total_bytes();
  *all_bytes = total;
  spdlog::info("make-model: {} {} ({}, {} tensors, {:.2f} GB {}) → {}", model_type_of(p.shape.arch),
               o.preset, architecture_name(p.shape.arch), weights.size(), total / 1e9,
               torch_dtype_name(p.dtype), o.out);
  writer.set_progress([](const std::string& path, uint64_t done, uint64_t all) {
    spdlog::info("make-model: wrote {} ({:.0f}%)", path, all ? 100.0 * done / all : 100.0);
  });

  // Tokenizer files first, then weights; config.json last marks the directory complete.
  std::error_code ec;
  for (const char* name : {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                           "chat_template.jinja"}) {
    const fs::path from = fs::path(o.tokenizer_dir) / name;
    if (!fs::is_regular_file(from, ec)) continue;
    fs::copy_file(from, out / name, fs::copy_options::overwrite_existing, ec);
    if (ec) {
      return internal_error("make-model: cannot copy " + from.string() + " to " + o.out + " (" +
                            ec.message() + ")");
    }
  }
  if (!o.config_only) {
    TESSERA_ASSIGN_OR_RETURN(std::vector<std::string> files,
                             writer.write_sharded(o.out, o.max_shard_bytes));
    progress->finish(total, "in " + std::to_string(files.size()) + " file(s)");
  } else {
    spdlog::info("make-model: --config-only: no weights written (run with --load-format dummy)");
  }

  json gen = {{"_from_model_config", true},
              {"bos_token_id", p.config["bos_token_id"]},
              {"eos_token_id", p.config["eos_token_id"]},
              {"transformers_version", kTransformersVersion}};
  if (p.tok.pad) gen["pad_token_id"] = *p.tok.pad;
  TESSERA_RETURN_IF_ERROR(write_text(out / "generation_config.json", gen.dump(2) + "\n"));
  return write_text(out / "config.json", p.config.dump(2) + "\n");
}

CLI::App* add_make_model_subcommand(CLI::App& app, MakeModelOptions& o) {
  CLI::App* sub = app.add_subcommand(
      "make-model", "Write a Hugging Face model directory with seeded random weights");
  sub->add_option("--arch", o.arch,
                  "llama | mistral | qwen2 | qwen3 | mixtral | qwen2_moe | qwen3_moe | gemma2 | "
                  "gemma3 | phi3 (required for tiny; implied by real presets)");
  sub->add_option("--preset", o.preset, "Model shape: " + preset_names())->required();
  sub->add_option("--tokenizer", o.tokenizer_dir,
                  "Directory with tokenizer.json (+ tokenizer_config.json) to copy and size the "
                  "vocabulary from")
      ->required();
  sub->add_option("--seed", o.seed, "The run's random seed: the weights")->capture_default_str();
  sub->add_option("--dtype", o.dtype, "bf16 | fp16 | fp32")->capture_default_str();
  sub->add_option("--out", o.out, "Output directory (created; must be empty if it exists)")
      ->required();
  sub->add_flag("--config-only", o.config_only,
                "Write config.json and the tokenizer files but no weights (for --load-format "
                "dummy: a real shape without its disk space)");
  sub->add_option("--max-shard-size", o.max_shard_bytes,
                  "Largest shard before splitting, e.g. 5GB (10^9) or 4GiB (2^30); default 5GiB")
      ->transform(CLI::AsSizeValue(true));
  MakeModelOptions::Overrides& ov = o.overrides;
  sub->add_option("--hidden-size", ov.hidden_size, "Override the preset's hidden_size");
  sub->add_option("--intermediate-size", ov.intermediate_size,
                  "Override the preset's intermediate_size");
  sub->add_option("--num-layers", ov.num_layers, "Override the preset's num_hidden_layers");
  sub->add_option("--num-heads", ov.num_heads, "Override the preset's num_attention_heads");
  sub->add_option("--num-kv-heads", ov.num_kv_heads, "Override the preset's num_key_value_heads");
  sub->add_option("--head-dim", ov.head_dim,
                  "Override the head size (default: the preset's, else hidden / heads)");
  sub->add_option("--vocab-size", ov.vocab_size,
                  "Override the vocabulary size (at least the tokenizer's; extra rows are "
                  "padding, as many real models have)");
  MakeModelOptions::Quantization& q = o.quantization;
  sub->add_option("--quantization", q.method,
                  "none | awq | gptq | fp8: write the linear layers as AutoAWQ (gemm), GPTQ or "
                  "FP8 exporters do, with their quantization_config")
      ->capture_default_str();
  sub->add_option("--bits", q.bits, "gptq: 4 or 8 bits per weight")->capture_default_str();
  sub->add_option("--group-size", q.group_size,
                  "awq / gptq: input features per scale, 32, 64 or 128 (gptq: -1 for one group)")
      ->capture_default_str();
  sub->add_flag("--desc-act", q.desc_act, "gptq: act-order groups (g_idx a permutation's)");
  sub->add_flag("--asym", q.asym, "gptq: zero points per group (default symmetric)");
  sub->add_option("--weight-scale", q.weight_scale,
                  "fp8: tensor (quant_method fp8) or channel (compressed-tensors)")
      ->capture_default_str();
  sub->add_option("--activations", q.activations,
                  "fp8: dynamic (per token), static (an input_scale per layer) or none (W8A16)")
      ->capture_default_str();
  add_examples(sub, {"tessera make-model --preset llama3-8b --tokenizer ./llama3-tokenizer "
                     "--out ./llama3-8b",
                     "tessera make-model --preset llama3-70b --tokenizer ./llama3-tokenizer "
                     "--quantization awq --out ./llama3-70b-awq"});
  return sub;
}

int make_model_command(const MakeModelOptions& options) {
  Status st = make_model(options);
  if (!st) {
    std::cerr << "tessera make-model: " << st.message() << "\n";
    return 1;
  }
  std::cout << "Wrote " << options.out << "\n";
  return 0;
}

}  // namespace tessera
