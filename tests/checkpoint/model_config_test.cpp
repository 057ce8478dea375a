#include "common/checkpoint/model_config.h"
#include "common/checkpoint/layer_plan.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "tests/checkpoint/test_util.h"

namespace tessera {
namespace {

using nlohmann::json;
using ::testing::AllOf;
using ::testing::HasSubstr;

// Published configs (https://huggingface.co/<repo>/blob/main/config.json), trimmed of keys we
// do not read.
const char* kLlama31_8B = R"({
  "architectures": ["LlamaForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
  "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "hidden_act": "silu",
  "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
  "max_position_embeddings": 131072, "mlp_bias": false, "model_type": "llama",
  "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
  "pretraining_tp": 1, "rms_norm_eps": 1e-05,
  "rope_scaling": {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                   "original_max_position_embeddings": 8192, "rope_type": "llama3"},
  "rope_theta": 500000.0, "tie_word_embeddings": false, "torch_dtype": "bfloat16",
  "transformers_version": "4.43.0.dev0", "use_cache": true, "vocab_size": 128256})";

const char* kLlama2_7B = R"({
  "architectures": ["LlamaForCausalLM"], "bos_token_id": 1, "eos_token_id": 2,
  "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 11008,
  "max_position_embeddings": 4096, "model_type": "llama", "num_attention_heads": 32,
  "num_hidden_layers": 32, "rms_norm_eps": 1e-05, "torch_dtype": "float16",
  "vocab_size": 32000})";

const char* kMistral7B = R"({
  "architectures": ["MistralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2,
  "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 14336,
  "max_position_embeddings": 32768, "model_type": "mistral", "num_attention_heads": 32,
  "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
  "rope_theta": 10000.0, "sliding_window": 4096, "tie_word_embeddings": false,
  "torch_dtype": "bfloat16", "vocab_size": 32000})";

const char* kQwen25_7B = R"({
  "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
  "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 3584, "intermediate_size": 18944,
  "max_position_embeddings": 131072, "max_window_layers": 28, "model_type": "qwen2",
  "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4,
  "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 131072,
  "tie_word_embeddings": false, "torch_dtype": "bfloat16", "use_sliding_window": false,
  "vocab_size": 152064})";

const char* kQwen3_8B = R"({
  "architectures": ["Qwen3ForCausalLM"], "attention_bias": false, "bos_token_id": 151643,
  "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096,
  "intermediate_size": 12288, "max_position_embeddings": 40960, "max_window_layers": 36,
  "model_type": "qwen3", "num_attention_heads": 32, "num_hidden_layers": 36,
  "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": null, "rope_theta": 1000000,
  "sliding_window": null, "tie_word_embeddings": false, "torch_dtype": "bfloat16",
  "use_sliding_window": false, "vocab_size": 151936})";

// `base` with `patch` merged in (null values delete keys).
std::string patched(const char* base, const json& patch) {
  json j = json::parse(base);
  j.merge_patch(patch);
  return j.dump();
}

Status parse_error(const std::string& text) {
  Expected<ModelConfig> c = parse_model_config(text);
  EXPECT_FALSE(c.has_value()) << text;
  return c.status();
}

TEST(ModelConfigTest, Llama31WithRopeScalingAndEosList) {
  Expected<ModelConfig> c = parse_model_config(kLlama31_8B);
  ASSERT_TRUE(c.has_value()) << c.status().to_string();
  EXPECT_EQ(c->arch, Architecture::kLlama);
  EXPECT_EQ(c->model_type, "llama");
  EXPECT_EQ(c->vocab_size, 128256);
  EXPECT_EQ(c->hidden_size, 4096);
  EXPECT_EQ(c->intermediate_size, 14336);
  EXPECT_EQ(c->num_layers, 32);
  EXPECT_EQ(c->num_heads, 32);
  EXPECT_EQ(c->num_kv_heads, 8);
  EXPECT_EQ(c->head_dim, 128);
  EXPECT_EQ(c->max_position_embeddings, 131072);
  EXPECT_DOUBLE_EQ(c->rms_norm_eps, 1e-5);
  EXPECT_DOUBLE_EQ(c->rope_theta, 500000.0);
  EXPECT_EQ(c->rope_scaling.type, "llama3");
  EXPECT_DOUBLE_EQ(c->rope_scaling.factor, 8.0);
  EXPECT_DOUBLE_EQ(c->rope_scaling.low_freq_factor, 1.0);
  EXPECT_DOUBLE_EQ(c->rope_scaling.high_freq_factor, 4.0);
  EXPECT_EQ(c->rope_scaling.original_max_position_embeddings, 8192);
  EXPECT_FALSE(c->tie_word_embeddings);
  EXPECT_FALSE(c->attention_bias);
  EXPECT_FALSE(c->qk_norm);
  EXPECT_FALSE(c->sliding_window.has_value());
  EXPECT_EQ(c->torch_dtype, DType::kBF16);
  EXPECT_EQ(c->eos_token_ids, (std::vector<int64_t>{128001, 128008, 128009}));
  EXPECT_EQ(c->bos_token_id, 128000);
  EXPECT_FALSE(c->pad_token_id.has_value());
}

// A quantized export's config.json: the model's fields as before, quantization_config read
// into ModelConfig::quant (tests/checkpoint/quantization_test.cpp covers the formats).
TEST(ModelConfigTest, QuantizationConfigIsTheCheckpointsFormat) {
  nlohmann::json j = nlohmann::json::parse(kLlama31_8B);
  auto plain = parse_model_config(j.dump());
  ASSERT_TRUE(plain);
  EXPECT_EQ(plain->quant.method, QuantMethod::kNone);
  j["quantization_config"] = {{"bits", 4},
                              {"group_size", 128},
                              {"quant_method", "awq"},
                              {"version", "gemm"},
                              {"zero_point", true}};
  auto awq = parse_model_config(j.dump());
  ASSERT_TRUE(awq) << awq.status().to_string();
  EXPECT_EQ(awq->quant.method, QuantMethod::kAwq);
  EXPECT_EQ(awq->quant.group_size, 128);
  EXPECT_EQ(awq->hidden_size, 4096);
}

TEST(ModelConfigTest, OlderRopeScalingSpellingAndRopeParameters) {
  Expected<ModelConfig> c = parse_model_config(
      patched(kLlama31_8B,
              {{"rope_scaling", {{"rope_type", nullptr}, {"type", "llama3"}, {"factor", 32.0}}}}));
  ASSERT_TRUE(c.has_value()) << c.status().to_string();
  EXPECT_EQ(c->rope_scaling.type, "llama3");
  EXPECT_DOUBLE_EQ(c->rope_scaling.factor, 32.0);

  // transformers 5: "rope_parameters" carries rope_theta too.
  c = parse_model_config(
      patched(kQwen3_8B, {{"rope_theta", nullptr},
                          {"rope_parameters", {{"rope_type", "default"}, {"rope_theta", 5e6}}}}));
  ASSERT_TRUE(c.has_value()) << c.status().to_string();
  EXPECT_DOUBLE_EQ(c->rope_theta, 5e6);
  EXPECT_EQ(c->rope_scaling.type, "");
}

TEST(ModelConfigTest, Llama2DefaultsAsTransformers) {
  Expected<ModelConfig> c = parse_model_config(kLlama2_7B);
  ASSERT_TRUE(c.has_value()) << c.status().to_string();
  EXPECT_EQ(c->num_kv_heads, 32);  // defaults to num_attention_heads
  EXPECT_EQ(c->head_dim, 128);     // hidden_size / num_attention_heads
  EXPECT_DOUBLE_EQ(c->rope_theta, 10000.0);
  EXPECT_FALSE(c->tie_word_embeddings);
  EXPECT_EQ(c->rope_scaling.type, "");
  EXPECT_EQ(c->torch_dtype, DType::kF16);
  EXPECT_EQ(c->eos_token_ids, std::vector<int64_t>{2});

  // Absent bos/eos take LlamaConfig's defaults; null ones stay unset.
  c = parse_model_config(patched(kLlama2_7B, {{"bos_token_id", nullptr},
                                              {"eos_token_id", nullptr},
                                              {"max_position_embeddings", nullptr}}));
  ASSERT_TRUE(c.has_value());
  EXPECT_EQ(c->bos_token_id, 1);
  EXPECT_EQ(c->eos_token_ids, std::vector<int64_t>{2});
  EXPECT_EQ(c->max_position_embeddings, 2048);
  json j = json::parse(kLlama2_7B);
  j["bos_token_id"] = nullptr;
  j["eos_token_id"] = nullptr;
  c = parse_model_config(j.dump());
  ASSERT_TRUE(c.has_value());
  EXPECT_FALSE(c->bos_token_id.has_value());
  EXPECT_TRUE(c->eos_token_ids.empty());
}

TEST(ModelConfigTest, MistralSlidingWindow) {
  Expected<ModelConfig> c = parse_model_config(kMistral7B);
  ASSERT_TRUE(c.has_value()) << c.status().to_string();
  EXPECT_EQ(c->arch, Architecture::kMistral);
  EXPECT_EQ(c->sliding_window, 4096);
  EXPECT_FALSE(c->attention_bias);
  EXPECT_EQ(c->head_dim, 128);
  // MistralConfig's default window when the key is absent; none when null (v0.2+).
  c = parse_model_config(patched(kMistral7B, {{"sliding_window", nullptr}}));
  ASSERT_TRUE(c.has_value());
  EXPECT_EQ(c->sliding_window, 4096);
  json j = json::parse(kMistral7B);
  j["sliding_window"] = nullptr;
  c = parse_model_config(j.dump());
  ASSERT_TRUE(c.has_value());
  EXPECT_FALSE(c->sliding_window.has_value());
  EXPECT_EQ(c->kv_cache_window(), 0);
  // Every layer slides: the KV cache keeps only the window's blocks.
  c = parse_model_config(kMistral7B);
  ASSERT_TRUE(c.has_value());
  EXPECT_EQ(c->attention_window(0), 4096);
  EXPECT_EQ(c->attention_window(31), 4096);
  EXPECT_EQ(c->kv_cache_window(), 4096);
  // A window larger than the context is refused, naming the field.
  c = parse_model_config(patched(kMistral7B, {{"sliding_window", 40000}}));
  ASSERT_FALSE(c.has_value());
  EXPECT_NE(c.status().message().find("sliding_window"), std::string::npos)
      << c.status().to_string();
  EXPECT_NE(c.status().message().find("max_position_embeddings"), std::string::npos);
}

TEST(ModelConfigTest, Qwen2HasQkvBiasesAndIgnoresUnusedWindow) {
  Expected<ModelConfig> c = parse_model_config(kQwen25_7B);
  ASSERT_TRUE(c.has_value()) << c.status().to_string();
  EXPECT_EQ(c->arch, Architecture::kQwen2);
  EXPECT_TRUE(c->attention_bias);
  EXPECT_FALSE(c->o_proj_bias);
  EXPECT_FALSE(c->qk_norm);
  EXPECT_EQ(c->head_dim, 128);
  EXPECT_EQ(c->num_kv_heads, 4);
  EXPECT_FALSE(c->sliding_window.has_value());  // use_sliding_window is false
  EXPECT_DOUBLE_EQ(c->rope_theta, 1e6);
  EXPECT_FALSE(c->bos_token_id.has_value() && *c->bos_token_id != 151643);
  // use_sliding_window, as transformers' Qwen2Config decides: the layers from max_window_layers
  // on slide (here 28 of 28: none does, and the window is dropped).
  c = parse_model_config(patched(kQwen25_7B, {{"use_sliding_window", true}}));
  ASSERT_TRUE(c.has_value());
  EXPECT_FALSE(c->sliding_window.has_value());
  EXPECT_EQ(c->attention_window(27), 0);
  EXPECT_EQ(c->kv_cache_window(), 0);
}

TEST(ModelConfigTest, Qwen2SlidingLayersFromMaxWindowLayersOrLayerTypes) {
  Expected<ModelConfig> c = parse_model_config(
      patched(kQwen25_7B,
              {{"use_sliding_window", true}, {"sliding_window", 4096}, {"max_window_layers", 20}}));
  ASSERT_TRUE(c.has_value()) << c.status().to_string();
  EXPECT_EQ(c->attention_window(0), 0);
  EXPECT_EQ(c->attention_window(19), 0);
  EXPECT_EQ(c->attention_window(20), 4096);
  EXPECT_EQ(c->attention_window(27), 4096);
  EXPECT_EQ(c->kv_cache_window(), 0);  // some layers attend fully: every block is kept
  c = parse_model_config(
      patched(kQwen25_7B,
              {{"use_sliding_window", true}, {"sliding_window", 4096}, {"max_window_layers", 0}}));
  ASSERT_TRUE(c.has_value()) << c.status().to_string();
  EXPECT_EQ(c->attention_window(0), 4096);
  EXPECT_EQ(c->kv_cache_window(), 4096);
  json types = json::array();
  for (int i = 0; i < 28; ++i) types.push_back(i % 2 ? "full_attention" : "sliding_attention");
  c = parse_model_config(patched(
      kQwen25_7B, {{"use_sliding_window", true}, {"sliding_window", 512}, {"layer_types", types}}));
  ASSERT_TRUE(c.has_value()) << c.status().to_string();
  EXPECT_EQ(c->attention_window(0), 512);
  EXPECT_EQ(c->attention_window(1), 0);
  types[3] = "chunked_attention";
  c = parse_model_config(patched(
      kQwen25_7B, {{"use_sliding_window", true}, {"sliding_window", 512}, {"layer_types", types}}));
  ASSERT_FALSE(c.has_value());
  EXPECT_NE(c.status().message().find("layer_types"), std::string::npos);
  // A window past the context: an error naming the field.
  c = parse_model_config(patched(
      kQwen25_7B,
      {{"use_sliding_window", true}, {"sliding_window", 200000}, {"max_window_layers", 0}}));
  ASSERT_FALSE(c.has_value());
  EXPECT_NE(c.status().message().find("sliding_window"), std::string::npos)
      << c.status().to_string();
}

TEST(ModelConfigTest, Qwen3QkNormAndExplicitHeadDim) {
  Expected<ModelConfig> c = parse_model_config(kQwen3_8B);
  ASSERT_TRUE(c.has_value()) << c.status().to_string();
  EXPECT_EQ(c->arch, Architecture::kQwen3);
  EXPECT_TRUE(c->qk_norm);
  EXPECT_FALSE(c->attention_bias);
  EXPECT_EQ(c->head_dim, 128);
  EXPECT_EQ(c->eos_token_ids, std::vector<int64_t>{151645});
  // head_dim need not be hidden / heads (Qwen3-0.6B: 1024 / 16 = 64, head_dim 128).
  c = parse_model_config(patched(kQwen3_8B, {{"hidden_size", 64},
                                             {"num_attention_heads", 4},
                                             {"num_key_value_heads", 2},
                                             {"head_dim", 32}}));
  ASSERT_TRUE(c.has_value());
  EXPECT_EQ(c->head_dim, 32);
  // Absent, it is Qwen3Config's default 128, not hidden / heads.
  c = parse_model_config(patched(
      kQwen3_8B, {{"hidden_size", 1024}, {"num_attention_heads", 16}, {"head_dim", nullptr}}));
  ASSERT_TRUE(c.has_value());
  EXPECT_EQ(c->head_dim, 128);
  c = parse_model_config(patched(kQwen3_8B, {{"attention_bias", true}}));
  ASSERT_TRUE(c.has_value());
  EXPECT_TRUE(c->attention_bias);
  EXPECT_TRUE(c->o_proj_bias);
}

TEST(ModelConfigTest, DtypeKeys) {
  Expected<ModelConfig> c =
      parse_model_config(patched(kQwen3_8B, {{"torch_dtype", nullptr}, {"dtype", "float32"}}));
  ASSERT_TRUE(c.has_value());
  EXPECT_EQ(c->torch_dtype, DType::kF32);
  c = parse_model_config(patched(kQwen3_8B, {{"torch_dtype", nullptr}}));
  ASSERT_TRUE(c.has_value());
  EXPECT_EQ(c->torch_dtype, DType::kBF16);
  Status st = parse_error(patched(kQwen3_8B, {{"torch_dtype", "int8"}}));
  EXPECT_THAT(st.message(), HasSubstr("config.json: torch_dtype"));
  EXPECT_THAT(st.message(), HasSubstr("int8"));
}

TEST(ModelConfigTest, RefusesTrustRemoteCodeQwenWithSupportedList) {
  const std::string qwen72b = R"({
    "architectures": ["QWenLMHeadModel"],
    "auto_map": {"AutoConfig": "configuration_qwen.QWenConfig",
                 "AutoModelForCausalLM": "modeling_qwen.QWenLMHeadModel"},
    "hidden_size": 8192, "intermediate_size": 49152, "model_type": "qwen",
    "num_attention_heads": 64, "num_hidden_layers": 80, "vocab_size": 152064})";
  Status st = parse_error(qwen72b);
  EXPECT_EQ(st.code(), Code::kInvalidArgument);
  EXPECT_THAT(st.message(), HasSubstr("'QWenLMHeadModel'"));
  EXPECT_THAT(st.message(), HasSubstr("trust_remote_code"));
  for (const char* name :
       {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"}) {
    EXPECT_THAT(st.message(), HasSubstr(name));
  }
  EXPECT_EQ(supported_architectures(),
            "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, "
            "MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM, Gemma2ForCausalLM, "
            "Gemma3ForCausalLM, Phi3ForCausalLM");
}

TEST(ModelConfigTest, BadValuesNameFileAndField) {
  struct Case {
    json patch;
    std::vector<std::string> expect;
  };
  const std::vector<Case> cases = {
      {{{"hidden_size", -1}}, {"config.json: hidden_size", "positive", "-1"}},
      {{{"vocab_size", nullptr}}, {"config.json: vocab_size is missing"}},
      {{{"num_hidden_layers", "32"}}, {"num_hidden_layers", "integer"}},
      {{{"num_key_value_heads", 5}}, {"num_attention_heads (32)", "num_key_value_heads (5)"}},
      {{{"head_dim", 127}}, {"head_dim 127", "even"}},
      {{{"rope_scaling", {{"rope_type", "yarn"}, {"factor", 4.0}}}}, {"'yarn'", "llama3"}},
      {{{"rope_scaling", {{"factor", nullptr}}}}, {"rope_scaling.factor is missing"}},
      {{{"rope_scaling", {{"low_freq_factor", 4.0}}}}, {"high_freq_factor", "low_freq_factor"}},
      {{{"rope_theta", 0}}, {"rope_theta", "positive"}},
      {{{"rms_norm_eps", "small"}}, {"rms_norm_eps", "number"}},
      {{{"tie_word_embeddings", 1}}, {"tie_word_embeddings", "true or false"}},
      {{{"hidden_act", "gelu"}}, {"hidden_act", "silu", "gelu"}},
      {{{"mlp_bias", true}}, {"mlp_bias"}},
      {{{"quantization_config", {{"quant_method", "awq"}, {"version", "gemv"}}}},
       {"quantization_config.version", "gemv"}},
      {{{"quantization_config", {{"quant_method", "bitsandbytes"}}}},
       {"quantization_config.quant_method", "bitsandbytes"}},
      {{{"eos_token_id", {128001, "x"}}}, {"eos_token_id", "element 1"}},
      {{{"eos_token_id", 999999}}, {"eos_token_id", "vocab_size"}},
      {{{"architectures", "LlamaForCausalLM"}}, {"architectures", "list"}},
      {{{"architectures", {"GPT2LMHeadModel"}}}, {"'GPT2LMHeadModel'", "Qwen3ForCausalLM"}},
      // Sizes whose weight shapes overflow int64: num_attention_heads × head_dim = 2^64 was a
      // signed overflow in expected_weights (UBSan, through tests/fuzz/model_config_fuzz.cpp).
      {{{"num_attention_heads", int64_t{1} << 32},
        {"num_key_value_heads", int64_t{1} << 32},
        {"head_dim", int64_t{1} << 32}},
       {"more than 2^48 parameters", "head_dim 4294967296"}},
      {{{"vocab_size", int64_t{1} << 40}},
       {"more than 2^48 parameters", "vocab_size 1099511627776"}},
  };
  for (const Case& c : cases) {
    Status st = parse_error(patched(kLlama31_8B, c.patch));
    EXPECT_EQ(st.code(), Code::kInvalidArgument) << c.patch.dump();
    for (const std::string& s : c.expect) {
      EXPECT_THAT(st.message(), HasSubstr(s)) << c.patch.dump();
    }
  }
  EXPECT_THAT(parse_error("{not json").message(), HasSubstr("config.json: not valid JSON"));
  // A number out of double's range makes nlohmann throw out_of_range, not parse_error: it used
  // to escape as an exception (found by the safetensors fuzzer; the same code is here).
  EXPECT_THAT(parse_error(R"({"vocab_size": 1e999})").message(),
              HasSubstr("config.json: not valid JSON"));
  EXPECT_THAT(parse_error("[1, 2]").message(), HasSubstr("JSON object"));
  EXPECT_THAT(parse_model_config("{}", "/m/config.json").status().message(),
              HasSubstr("/m/config.json"));
}

TEST(ModelConfigTest, ExpectedWeights) {
  Expected<ModelConfig> q2 = parse_model_config(
      patched(kQwen25_7B, {{"num_hidden_layers", 2}, {"tie_word_embeddings", true}}));
  ASSERT_TRUE(q2.has_value());
  std::vector<WeightSpec> w = expected_weights(*q2);
  // embed + 2 × (4 linear + 3 biases + 3 mlp + 2 norms) + final norm, no lm_head (tied).
  ASSERT_EQ(w.size(), 1u + 2 * 12 + 1);
  EXPECT_EQ(w.front().name, "model.embed_tokens.weight");
  EXPECT_EQ(w.front().shape, (std::vector<int64_t>{152064, 3584}));
  EXPECT_EQ(w[1].name, "model.layers.0.self_attn.q_proj.weight");
  EXPECT_EQ(w[1].shape, (std::vector<int64_t>{3584, 3584}));
  EXPECT_EQ(w[2].name, "model.layers.0.self_attn.q_proj.bias");
  EXPECT_EQ(w[2].shape, std::vector<int64_t>{3584});
  EXPECT_EQ(w[3].name, "model.layers.0.self_attn.k_proj.weight");
  EXPECT_EQ(w[3].shape, (std::vector<int64_t>{512, 3584}));
  EXPECT_EQ(w.back().name, "model.norm.weight");

  Expected<ModelConfig> q3 = parse_model_config(patched(kQwen3_8B, {{"num_hidden_layers", 1}}));
  ASSERT_TRUE(q3.has_value());
  std::set<std::string> names;
  for (const WeightSpec& s : expected_weights(*q3)) names.insert(s.name);
  EXPECT_TRUE(names.count("model.layers.0.self_attn.q_norm.weight"));
  EXPECT_TRUE(names.count("model.layers.0.self_attn.k_norm.weight"));
  EXPECT_TRUE(names.count("lm_head.weight"));
  EXPECT_FALSE(names.count("model.layers.0.self_attn.q_proj.bias"));
}

TEST(ModelConfigTest, LoadWithGenerationConfig) {
  ckpt_test::TempDir dir;
  ckpt_test::write_file(dir / "config.json", kQwen3_8B);
  ckpt_test::write_file(dir / "generation_config.json", R"({
    "bos_token_id": 151643, "do_sample": true, "eos_token_id": [151645, 151643],
    "pad_token_id": 151643, "temperature": 0.6, "top_k": 20, "top_p": 0.95,
    "repetition_penalty": 1.05, "max_new_tokens": 512, "transformers_version": "4.51.0"})");
  GenerationDefaults g;
  Expected<ModelConfig> c = load_model_config(dir.path(), &g);
  ASSERT_TRUE(c.has_value()) << c.status().to_string();
  EXPECT_EQ(c->eos_token_ids, (std::vector<int64_t>{151645, 151643}));
  EXPECT_EQ(c->pad_token_id, 151643);
  EXPECT_EQ(c->bos_token_id, 151643);
  EXPECT_TRUE(g.do_sample);
  EXPECT_DOUBLE_EQ(*g.temperature, 0.6);
  EXPECT_DOUBLE_EQ(*g.top_p, 0.95);
  EXPECT_EQ(*g.top_k, 20);
  EXPECT_DOUBLE_EQ(*g.repetition_penalty, 1.05);
  EXPECT_EQ(*g.max_new_tokens, 512);

  // No generation_config.json: config.json's ids, defaults unset.
  ckpt_test::TempDir bare;
  ckpt_test::write_file(bare / "config.json", kQwen3_8B);
  GenerationDefaults none;
  c = load_model_config(bare.path(), &none);
  ASSERT_TRUE(c.has_value());
  EXPECT_EQ(c->eos_token_ids, std::vector<int64_t>{151645});
  EXPECT_FALSE(none.temperature.has_value());
  EXPECT_FALSE(none.do_sample);

  ckpt_test::write_file(dir / "generation_config.json", R"({"top_p": 1.5})");
  Status st = load_model_config(dir.path()).status();
  EXPECT_THAT(st.message(), HasSubstr(dir / "generation_config.json"));
  EXPECT_THAT(st.message(), HasSubstr("top_p"));

  st = load_model_config(dir / "nowhere").status();
  EXPECT_EQ(st.code(), Code::kNotFound);
  EXPECT_THAT(st.message(), HasSubstr("config.json"));
}

// ---- mixture of experts ----------------------------------------------------------------------

const char* kMixtral8x7B = R"({
  "architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1,
  "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
  "intermediate_size": 14336, "max_position_embeddings": 32768, "model_type": "mixtral",
  "num_attention_heads": 32, "num_experts_per_tok": 2, "num_hidden_layers": 32,
  "num_key_value_heads": 8, "num_local_experts": 8, "output_router_logits": false,
  "rms_norm_eps": 1e-05, "rope_theta": 1e6, "router_aux_loss_coef": 0.02, "sliding_window": null,
  "tie_word_embeddings": false, "torch_dtype": "bfloat16", "transformers_version": "4.36.0.dev0",
  "use_cache": true, "vocab_size": 32000})";

const char* kQwen15MoeA27B = R"({
  "architectures": ["Qwen2MoeForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
  "decoder_sparse_step": 1, "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 2048,
  "initializer_range": 0.02, "intermediate_size": 5632, "max_position_embeddings": 8192,
  "max_window_layers": 21, "model_type": "qwen2_moe", "moe_intermediate_size": 1408,
  "norm_topk_prob": false, "num_attention_heads": 16, "num_experts": 60,
  "num_experts_per_tok": 4, "num_hidden_layers": 24, "num_key_value_heads": 16,
  "output_router_logits": false, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
  "router_aux_loss_coef": 0.001, "shared_expert_intermediate_size": 5632,
  "sliding_window": 32768, "tie_word_embeddings": false, "torch_dtype": "bfloat16",
  "transformers_version": "4.40.0.dev0", "use_cache": true, "use_sliding_window": false,
  "vocab_size": 151936})";

const char* kQwen3_30B_A3B = R"({
  "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
  "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128,
  "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
  "intermediate_size": 6144, "max_position_embeddings": 40960, "max_window_layers": 48,
  "mlp_only_layers": [], "model_type": "qwen3_moe", "moe_intermediate_size": 768,
  "norm_topk_prob": true, "num_attention_heads": 32, "num_experts": 128,
  "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4,
  "output_router_logits": false, "rms_norm_eps": 1e-06, "rope_scaling": null,
  "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": null,
  "tie_word_embeddings": false, "torch_dtype": "bfloat16", "transformers_version": "4.51.0",
  "use_cache": true, "use_sliding_window": false, "vocab_size": 151936})";

const WeightSpec* spec_named(const std::vector<WeightSpec>& table, const std::string& name) {
  for (const WeightSpec& w : table) {
    if (w.name == name) return &w;
  }
  return nullptr;
}

TEST(MoeConfigTest, Mixtral8x7B) {
  Expected<ModelConfig> c = parse_model_config(kMixtral8x7B);
  ASSERT_TRUE(c.has_value()) << c.status().to_string();
  EXPECT_EQ(c->arch, Architecture::kMixtral);
  EXPECT_EQ(c->moe.num_experts, 8);
  EXPECT_EQ(c->moe.top_k, 2);
  EXPECT_EQ(c->moe.expert_intermediate, 14336);
  EXPECT_EQ(c->moe.shared_intermediate, 0);
  EXPECT_TRUE(c->moe.norm_topk_prob) << "Mixtral always renormalises";
  EXPECT_FALSE(c->sliding_window.has_value()) << "null, and MixtralConfig's default is None";
  EXPECT_EQ(c->head_dim, 128);
  EXPECT_FALSE(c->attention_bias || c->qk_norm);
  EXPECT_EQ(c->bos_token_id, 1);
  for (int64_t i = 0; i < 32; ++i) EXPECT_TRUE(c->moe.sparse_layer(i));
  const std::vector<WeightSpec> t = expected_weights(*c);
  const WeightSpec* router = spec_named(t, "model.layers.0.block_sparse_moe.gate.weight");
  ASSERT_NE(router, nullptr);
  EXPECT_EQ(router->shape, (std::vector<int64_t>{8, 4096}));
  EXPECT_EQ(router->split, Split::kNone);
  const WeightSpec* w1 = spec_named(t, "model.layers.31.block_sparse_moe.experts.7.w1.weight");
  const WeightSpec* w2 = spec_named(t, "model.layers.31.block_sparse_moe.experts.7.w2.weight");
  const WeightSpec* w3 = spec_named(t, "model.layers.31.block_sparse_moe.experts.7.w3.weight");
  ASSERT_TRUE(w1 && w2 && w3);
  EXPECT_EQ(w1->kind, WeightKind::kExpertGate);
  EXPECT_EQ(w3->kind, WeightKind::kExpertUp);
  EXPECT_EQ(w2->kind, WeightKind::kExpertDown);
  EXPECT_EQ(w2->shape, (std::vector<int64_t>{4096, 14336}));
  EXPECT_EQ(w2->split, Split::kColumns);
  EXPECT_EQ(w1->expert, 7);
  EXPECT_EQ(spec_named(t, "model.layers.0.mlp.gate_proj.weight"), nullptr);
  // Published as 46.7B parameters.
  int64_t params = 0;
  for (const WeightSpec& w : t) {
    int64_t n = 1;
    for (int64_t d : w.shape) n *= d;
    params += n;
  }
  EXPECT_NEAR(static_cast<double>(params), 46.7e9, 0.05e9);
  // MixtralConfig's defaults when absent: rope_theta 1e6, 8 experts, top 2.
  c = parse_model_config(patched(
      kMixtral8x7B,
      {{"rope_theta", nullptr}, {"num_local_experts", nullptr}, {"num_experts_per_tok", nullptr}}));
  ASSERT_TRUE(c.has_value()) << c.status().to_string();
  EXPECT_DOUBLE_EQ(c->rope_theta, 1e6);
  EXPECT_EQ(c->moe.num_experts, 8);
  EXPECT_EQ(c->moe.top_k, 2);
  // A window shorter than the context is kept (and refused at run time, as Mistral's).
  c = parse_model_config(patched(kMixtral8x7B, {{"sliding_window", 4096}}));
  ASSERT_TRUE(c.has_value());
  EXPECT_EQ(c->sliding_window, 4096);
}

TEST(MoeConfigTest, Qwen2MoeHasASharedExpertAndQkvBiases) {
  Expected<ModelConfig> c = parse_model_config(kQwen15MoeA27B);
  ASSERT_TRUE(c.has_value()) << c.status().to_string();
  EXPECT_EQ(c->arch, Architecture::kQwen2Moe);
  EXPECT_EQ(c->model_type, "qwen2_moe");
  EXPECT_EQ(c->moe.num_experts, 60);
  EXPECT_EQ(c->moe.top_k, 4);
  EXPECT_EQ(c->moe.expert_intermediate, 1408);
  EXPECT_EQ(c->moe.shared_intermediate, 5632);
  EXPECT_FALSE(c->moe.norm_topk_prob);
  EXPECT_TRUE(c->attention_bias);
  EXPECT_FALSE(c->o_proj_bias);
  EXPECT_FALSE(c->qk_norm);
  EXPECT_FALSE(c->sliding_window.has_value());
  const std::vector<WeightSpec> t = expected_weights(*c);
  const WeightSpec* gate = spec_named(t, "model.layers.3.mlp.shared_expert_gate.weight");
  ASSERT_NE(gate, nullptr);
  EXPECT_EQ(gate->shape, (std::vector<int64_t>{1, 2048}));
  EXPECT_EQ(gate->split, Split::kNone);
  ASSERT_NE(spec_named(t, "model.layers.3.mlp.shared_expert.down_proj.weight"), nullptr);
  ASSERT_NE(spec_named(t, "model.layers.3.mlp.experts.59.up_proj.weight"), nullptr);
  ASSERT_NE(spec_named(t, "model.layers.3.mlp.gate.weight"), nullptr);
  ASSERT_NE(spec_named(t, "model.layers.3.self_attn.q_proj.bias"), nullptr);
  // Newer configs spell the biases out.
  c = parse_model_config(patched(kQwen15MoeA27B, {{"qkv_bias", false}}));
  ASSERT_TRUE(c.has_value());
  EXPECT_FALSE(c->attention_bias);
  // Defaults as Qwen2MoeConfig's when absent.
  c = parse_model_config(patched(kQwen15MoeA27B, {{"num_experts", nullptr},
                                                  {"shared_expert_intermediate_size", nullptr},
                                                  {"moe_intermediate_size", nullptr}}));
  ASSERT_TRUE(c.has_value());
  EXPECT_EQ(c->moe.num_experts, 60);
  EXPECT_EQ(c->moe.shared_intermediate, 5632);
  EXPECT_EQ(c->moe.expert_intermediate, 1408);
}

TEST(MoeConfigTest, Qwen3MoeWithDenseLayersAmongTheSparse) {
  Expected<ModelConfig> c = parse_model_config(kQwen3_30B_A3B);
  ASSERT_TRUE(c.has_value()) << c.status().to_string();
  EXPECT_EQ(c->arch, Architecture::kQwen3Moe);
  EXPECT_TRUE(c->qk_norm);
  EXPECT_EQ(c->head_dim, 128);
  EXPECT_EQ(c->moe.num_experts, 128);
  EXPECT_EQ(c->moe.top_k, 8);
  EXPECT_EQ(c->moe.expert_intermediate, 768);
  EXPECT_TRUE(c->moe.norm_topk_prob);
  EXPECT_EQ(c->moe.shared_intermediate, 0);
  const std::vector<WeightSpec> t = expected_weights(*c);
  EXPECT_EQ(spec_named(t, "model.layers.0.mlp.shared_expert_gate.weight"), nullptr);
  int64_t params = 0;
  for (const WeightSpec& w : t) {
    int64_t n = 1;
    for (int64_t d : w.shape) n *= d;
    params += n;
  }
  EXPECT_NEAR(static_cast<double>(params), 30.5e9, 0.1e9) << "Qwen3-30B-A3B: 30.5B in all";
  // decoder_sparse_step 2: layers 1, 3, 5, ... are MoE; mlp_only_layers makes 3 dense too.
  c = parse_model_config(
      patched(kQwen3_30B_A3B, {{"decoder_sparse_step", 2}, {"mlp_only_layers", {3}}}));
  ASSERT_TRUE(c.has_value()) << c.status().to_string();
  EXPECT_FALSE(c->moe.sparse_layer(0));
  EXPECT_TRUE(c->moe.sparse_layer(1));
  EXPECT_FALSE(c->moe.sparse_layer(2));
  EXPECT_FALSE(c->moe.sparse_layer(3));
  EXPECT_TRUE(c->moe.sparse_layer(5));
  const std::vector<WeightSpec> d = expected_weights(*c);
  const WeightSpec* dense = spec_named(d, "model.layers.3.mlp.gate_proj.weight");
  ASSERT_NE(dense, nullptr);
  EXPECT_EQ(dense->shape, (std::vector<int64_t>{6144, 2048})) << "intermediate_size";
  EXPECT_EQ(spec_named(d, "model.layers.3.mlp.gate.weight"), nullptr);
  EXPECT_NE(spec_named(d, "model.layers.5.mlp.experts.0.gate_proj.weight"), nullptr);
  // num_experts 0: every layer dense.
  c = parse_model_config(patched(kQwen3_30B_A3B, {{"num_experts", 0}}));
  ASSERT_TRUE(c.has_value()) << c.status().to_string();
  EXPECT_FALSE(c->moe.enabled());
  EXPECT_FALSE(c->moe.sparse_layer(0));
}

TEST(MoeConfigTest, BadMoeFieldsAreNamed) {
  EXPECT_THAT(parse_error(patched(kMixtral8x7B, {{"num_experts_per_tok", 9}})).message(),
              AllOf(HasSubstr("num_experts_per_tok 9 is more than the 8 experts"),
                    HasSubstr("num_local_experts")));
  EXPECT_THAT(parse_error(patched(kQwen3_30B_A3B, {{"num_experts_per_tok", 129}})).message(),
              AllOf(HasSubstr("num_experts_per_tok"), HasSubstr("128")));
  EXPECT_THAT(parse_error(patched(kQwen3_30B_A3B, {{"mlp_only_layers", {48}}})).message(),
              HasSubstr("mlp_only_layers"));
  EXPECT_THAT(parse_error(patched(kQwen3_30B_A3B, {{"mlp_only_layers", 3}})).message(),
              HasSubstr("mlp_only_layers must be a list"));
  EXPECT_THAT(parse_error(patched(kQwen3_30B_A3B, {{"decoder_sparse_step", 0}})).message(),
              HasSubstr("decoder_sparse_step"));
  EXPECT_THAT(parse_error(patched(kQwen3_30B_A3B, {{"moe_intermediate_size", -1}})).message(),
              HasSubstr("moe_intermediate_size"));
  EXPECT_THAT(parse_error(patched(kMixtral8x7B, {{"num_local_experts", 0}})).message(),
              HasSubstr("num_local_experts"));
  EXPECT_THAT(parse_error(patched(kQwen3_30B_A3B,
                                  {{"quantization_config",
                                    {{"quant_method", "fp8"}, {"activation_scheme", "dynamic"}}}}))
                  .message(),
              AllOf(HasSubstr("quantization_config"), HasSubstr("mixture-of-experts")));
}

// ---- Gemma 2, Gemma 3 (text), Phi-3 ------------------------------------------------------------

// google/gemma-2-9b's config.json.
const char* kGemma2_9B = R"({
  "architectures": ["Gemma2ForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
  "attn_logit_softcapping": 50.0, "bos_token_id": 2, "cache_implementation": "hybrid",
  "eos_token_id": 1, "final_logit_softcapping": 30.0, "head_dim": 256,
  "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh",
  "hidden_size": 3584, "initializer_range": 0.02, "intermediate_size": 14336,
  "max_position_embeddings": 8192, "model_type": "gemma2", "num_attention_heads": 16,
  "num_hidden_layers": 42, "num_key_value_heads": 8, "pad_token_id": 0,
  "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_theta": 10000.0,
  "sliding_window": 4096, "sliding_window_size": 4096, "torch_dtype": "float32",
  "transformers_version": "4.42.0.dev0", "use_cache": true, "vocab_size": 256000})";

// google/gemma-3-12b-pt's text_config (config.json holds it inside a
// Gemma3ForConditionalGeneration), as the text model's own config.json.
const char* kGemma3_12B_Text = R"({
  "architectures": ["Gemma3ForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
  "attn_logit_softcapping": null, "bos_token_id": 2, "cache_implementation": "hybrid",
  "eos_token_id": 1, "final_logit_softcapping": null, "head_dim": 256,
  "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 3840, "initializer_range": 0.02,
  "intermediate_size": 15360, "max_position_embeddings": 131072, "model_type": "gemma3_text",
  "num_attention_heads": 16, "num_hidden_layers": 48, "num_key_value_heads": 8,
  "pad_token_id": 0, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06,
  "rope_local_base_freq": 10000, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
  "rope_theta": 1000000, "sliding_window": 1024, "sliding_window_pattern": 6,
  "torch_dtype": "bfloat16", "use_cache": true, "vocab_size": 262208})";

// microsoft/Phi-3-mini-4k-instruct's config.json.
const char* kPhi3Mini4k = R"({
  "architectures": ["Phi3ForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
  "auto_map": {"AutoConfig": "configuration_phi3.Phi3Config",
               "AutoModelForCausalLM": "modeling_phi3.Phi3ForCausalLM"},
  "bos_token_id": 1, "embd_pdrop": 0.0, "eos_token_id": 32000, "hidden_act": "silu",
  "hidden_size": 3072, "initializer_range": 0.02, "intermediate_size": 8192,
  "max_position_embeddings": 4096, "model_type": "phi3", "num_attention_heads": 32,
  "num_hidden_layers": 32, "num_key_value_heads": 32, "original_max_position_embeddings": 4096,
  "pad_token_id": 32000, "resid_pdrop": 0.0, "rms_norm_eps": 1e-05, "rope_scaling": null,
  "rope_theta": 10000.0, "sliding_window": 2047, "tie_word_embeddings": false,
  "torch_dtype": "bfloat16", "transformers_version": "4.40.2", "use_cache": true,
  "vocab_size": 32064})";

// microsoft/Phi-3.5-mini-instruct's config.json: Phi-3-mini-128k-instruct's shape and keys
// (LongRoPE over 131072 positions from 4096, a window past the context), its own factor lists.
const char* kPhi35Mini = R"({
  "architectures": ["Phi3ForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
  "bos_token_id": 1, "embd_pdrop": 0.0, "eos_token_id": 32000, "hidden_act": "silu",
  "hidden_size": 3072, "initializer_range": 0.02, "intermediate_size": 8192,
  "max_position_embeddings": 131072, "model_type": "phi3", "num_attention_heads": 32,
  "num_hidden_layers": 32, "num_key_value_heads": 32, "original_max_position_embeddings": 4096,
  "pad_token_id": 32000, "resid_pdrop": 0.0, "rms_norm_eps": 1e-05,
  "rope_scaling": {
    "long_factor": [1.0800000429153442, 1.1100000143051147, 1.1399999856948853,
      1.340000033378601, 1.5899999141693115, 1.600000023841858, 1.6200000047683716,
      2.620000123977661, 3.2300000190734863, 3.2300000190734863, 4.789999961853027,
      7.400000095367432, 7.700000286102295, 9.09000015258789, 12.199999809265137,
      17.670000076293945, 24.46000099182129, 28.57000160217285, 30.420001983642578,
      30.840002059936523, 32.590003967285156, 32.93000411987305, 42.320003509521484,
      44.96000289916992, 50.340003967285156, 50.45000457763672, 57.55000305175781,
      57.93000411987305, 58.21000289916992, 60.1400032043457, 62.61000442504883,
      62.62000274658203, 62.71000289916992, 63.1400032043457, 63.1400032043457,
      63.77000427246094, 63.93000411987305, 63.96000289916992, 63.970001220703125,
      64.02999877929688, 64.06999969482422, 64.08000183105469, 64.12000274658203,
      64.41000366210938, 64.4800033569336, 64.51000213623047, 64.52999877929688,
      64.83999633789062],
    "short_factor": [1.0, 1.0199999809265137, 1.0299999713897705, 1.0299999713897705,
      1.0499999523162842, 1.0499999523162842, 1.0499999523162842, 1.0499999523162842,
      1.0499999523162842, 1.0699999332427979, 1.0999999046325684, 1.1099998950958252,
      1.1599998474121094, 1.1599998474121094, 1.1699998378753662, 1.2899998426437378,
      1.339999794960022, 1.679999828338623, 1.7899998426437378, 1.8199998140335083,
      1.8499997854232788, 1.8799997568130493, 1.9099997282028198, 1.9399996995925903,
      1.9899996519088745, 2.0199997425079346, 2.0199997425079346, 2.0199997425079346,
      2.0199997425079346, 2.0199997425079346, 2.0199997425079346, 2.0299997329711914,
      2.0299997329711914, 2.0299997329711914, 2.0299997329711914, 2.0299997329711914,
      2.0299997329711914, 2.0299997329711914, 2.0299997329711914, 2.0299997329711914,
      2.0799996852874756, 2.0899996757507324, 2.189999580383301, 2.2199995517730713,
      2.5899994373321533, 2.729999542236328, 2.749999523162842, 2.8399994373321533],
    "type": "longrope"},
  "rope_theta": 10000.0, "sliding_window": 262144, "tie_word_embeddings": false,
  "torch_dtype": "bfloat16", "transformers_version": "4.46.3", "use_cache": true,
  "vocab_size": 32064})";

TEST(GemmaConfigTest, Gemma2_9B) {
  Expected<ModelConfig> c = parse_model_config(kGemma2_9B);
  ASSERT_TRUE(c.has_value()) << c.status().to_string();
  EXPECT_EQ(c->arch, Architecture::kGemma2);
  EXPECT_EQ(c->head_dim, 256);  // not hidden / heads (224)
  EXPECT_EQ(c->activation, MlpActivation::kGeluTanh);
  EXPECT_TRUE(c->norm_unit_offset);
  EXPECT_TRUE(c->sandwich_norms);
  EXPECT_FALSE(c->qk_norm);
  EXPECT_TRUE(c->tie_word_embeddings);  // Gemma2Config's default
  EXPECT_DOUBLE_EQ(c->embed_scale, std::sqrt(3584.0));
  EXPECT_DOUBLE_EQ(c->attn_logit_softcapping, 50.0);
  EXPECT_DOUBLE_EQ(c->final_logit_softcapping, 30.0);
  // Even layers local (window 4096), odd ones global.
  EXPECT_EQ(c->attention_window(0), 4096);
  EXPECT_EQ(c->attention_window(1), 0);
  EXPECT_EQ(c->attention_window(40), 4096);
  EXPECT_EQ(c->attention_window(41), 0);
  EXPECT_FALSE(c->local_rope(0));  // Gemma 2: one RoPE
  const AttentionScoring s = c->attention_scoring(0);
  EXPECT_EQ(s.scale, 1.0f / 16.0f);  // query_pre_attn_scalar 256
  EXPECT_EQ(s.softcap, 50.0f);
  EXPECT_EQ(s.window, 4096);
  EXPECT_EQ(c->attention_scoring(1).window, 0);
  EXPECT_EQ(c->eos_token_ids, std::vector<int64_t>{1});
  EXPECT_EQ(c->bos_token_id, 2);
  EXPECT_EQ(c->pad_token_id, 0);
  // The four norms of every layer, a tied lm_head.
  std::set<std::string> names;
  for (const WeightSpec& w : expected_weights(*c)) names.insert(w.name);
  for (const char* n : {"input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                        "post_feedforward_layernorm"}) {
    EXPECT_TRUE(names.count(std::string("model.layers.41.") + n + ".weight")) << n;
  }
  EXPECT_FALSE(names.count("lm_head.weight"));
  // Defaults as Gemma2Config: soft-caps 50 / 30, scalar 256, window 4096, tied; null turns a
  // soft-cap off.
  json off = json::parse(kGemma2_9B);  // (patched() deletes keys patched to null)
  off["attn_logit_softcapping"] = nullptr;
  off["final_logit_softcapping"] = nullptr;
  off["query_pre_attn_scalar"] = 144;
  c = parse_model_config(off.dump());
  ASSERT_TRUE(c.has_value()) << c.status().to_string();
  EXPECT_EQ(c->attn_logit_softcapping, 0.0);
  EXPECT_EQ(c->final_logit_softcapping, 0.0);
  EXPECT_EQ(c->attention_scoring(0).scale, static_cast<float>(std::pow(144.0, -0.5)));
  json j = json::parse(kGemma2_9B);
  for (const char* k : {"attn_logit_softcapping", "final_logit_softcapping", "sliding_window",
                        "query_pre_attn_scalar", "head_dim", "bos_token_id", "eos_token_id"}) {
    j.erase(k);
  }
  c = parse_model_config(j.dump());
  ASSERT_TRUE(c.has_value()) << c.status().to_string();
  EXPECT_EQ(c->attn_logit_softcapping, 50.0);
  EXPECT_EQ(c->final_logit_softcapping, 30.0);
  EXPECT_EQ(c->head_dim, 256);
  EXPECT_EQ(c->attention_window(0), 4096);
  EXPECT_EQ(c->eos_token_ids, std::vector<int64_t>{1});
  // transformers 5's layer_types wins over the rule.
  json types = json::array();
  for (int i = 0; i < 42; ++i) types.push_back(i < 40 ? "full_attention" : "sliding_attention");
  c = parse_model_config(patched(kGemma2_9B, {{"layer_types", types}}));
  ASSERT_TRUE(c.has_value()) << c.status().to_string();
  EXPECT_EQ(c->attention_window(0), 0);
  EXPECT_EQ(c->attention_window(41), 4096);
}

TEST(GemmaConfigTest, Gemma3_12BText) {
  Expected<ModelConfig> c = parse_model_config(kGemma3_12B_Text);
  ASSERT_TRUE(c.has_value()) << c.status().to_string();
  EXPECT_EQ(c->arch, Architecture::kGemma3);
  EXPECT_EQ(c->model_type, "gemma3_text");
  EXPECT_TRUE(c->qk_norm);
  EXPECT_TRUE(c->norm_unit_offset);
  EXPECT_EQ(c->attn_logit_softcapping, 0.0);
  EXPECT_EQ(c->final_logit_softcapping, 0.0);
  EXPECT_EQ(c->rope_scaling.type, "linear");
  EXPECT_EQ(c->rope_scaling.factor, 8.0);
  EXPECT_EQ(c->rope_theta, 1e6);
  EXPECT_EQ(c->rope_local_theta, 10000.0);
  // 5 local : 1 global: layers 5, 11, ... 47 global.
  for (int64_t i = 0; i < 48; ++i) {
    const bool global = (i + 1) % 6 == 0;
    EXPECT_EQ(c->attention_window(i), global ? 0 : 1024) << i;
    EXPECT_EQ(c->local_rope(i), !global) << i;
  }
  EXPECT_EQ(c->attention_scoring(0).softcap, 0.0f);
  EXPECT_EQ(c->attention_scoring(0).scale, 1.0f / 16.0f);
  std::set<std::string> names;
  for (const WeightSpec& w : expected_weights(*c)) names.insert(w.name);
  EXPECT_TRUE(names.count("model.layers.0.self_attn.q_norm.weight"));
  EXPECT_TRUE(names.count("model.layers.0.post_feedforward_layernorm.weight"));

  // transformers 5 writes one RoPE per layer type (rope_parameters): the same model.
  json j = json::parse(kGemma3_12B_Text);
  j.erase("rope_scaling");
  j.erase("rope_theta");
  j.erase("rope_local_base_freq");
  j["rope_parameters"] = {
      {"full_attention", {{"rope_type", "linear"}, {"factor", 8.0}, {"rope_theta", 1000000.0}}},
      {"sliding_attention", {{"rope_type", "default"}, {"rope_theta", 10000.0}}}};
  Expected<ModelConfig> v5 = parse_model_config(j.dump());
  ASSERT_TRUE(v5.has_value()) << v5.status().to_string();
  EXPECT_EQ(v5->rope_scaling.type, "linear");
  EXPECT_EQ(v5->rope_scaling.factor, 8.0);
  EXPECT_EQ(v5->rope_theta, 1e6);
  EXPECT_EQ(v5->rope_local_theta, 10000.0);

  // The multimodal model (the published config.json as it is) is refused, saying what runs.
  json mm = {{"architectures", {"Gemma3ForConditionalGeneration"}},
             {"model_type", "gemma3"},
             {"text_config", json::parse(kGemma3_12B_Text)},
             {"vision_config", {{"model_type", "siglip_vision_model"}}}};
  EXPECT_THAT(parse_error(mm.dump()).message(),
              AllOf(HasSubstr("Gemma3ForConditionalGeneration"), HasSubstr("gemma3_text"),
                    HasSubstr("Gemma3ForCausalLM")));
}

TEST(Phi3ConfigTest, Phi3Mini4kFusedProjectionsAndWindow) {
  Expected<ModelConfig> c = parse_model_config(kPhi3Mini4k);
  ASSERT_TRUE(c.has_value()) << c.status().to_string();
  EXPECT_EQ(c->arch, Architecture::kPhi3);
  EXPECT_EQ(c->head_dim, 96);
  EXPECT_EQ(c->rotary_dim, 96);
  EXPECT_TRUE(c->fused_projections);
  EXPECT_EQ(c->activation, MlpActivation::kSilu);
  EXPECT_FALSE(c->norm_unit_offset);
  EXPECT_EQ(c->rope_scaling.type, "");
  EXPECT_EQ(c->attention_window(0), 2047);  // every layer
  EXPECT_EQ(c->attention_window(31), 2047);
  EXPECT_EQ(c->attention_scoring(0).scale, static_cast<float>(std::pow(96.0, -0.5)));
  EXPECT_EQ(c->eos_token_ids, std::vector<int64_t>{32000});
  std::map<std::string, std::vector<int64_t>> shapes;
  for (const WeightSpec& w : expected_weights(*c)) shapes[w.name] = w.shape;
  EXPECT_EQ(shapes["model.layers.0.self_attn.qkv_proj.weight"],
            (std::vector<int64_t>{3 * 3072, 3072}));
  EXPECT_EQ(shapes["model.layers.0.mlp.gate_up_proj.weight"],
            (std::vector<int64_t>{2 * 8192, 3072}));
  EXPECT_EQ(shapes["model.layers.0.mlp.down_proj.weight"], (std::vector<int64_t>{3072, 8192}));
  EXPECT_FALSE(shapes.count("model.layers.0.self_attn.q_proj.weight"));
  EXPECT_TRUE(shapes.count("lm_head.weight"));
  // partial_rotary_factor (Phi-4-mini's 0.75) rotates part of each head.
  c = parse_model_config(patched(kPhi3Mini4k, {{"partial_rotary_factor", 0.75}}));
  ASSERT_TRUE(c.has_value()) << c.status().to_string();
  EXPECT_EQ(c->rotary_dim, 72);
}

TEST(Phi3ConfigTest, LongRopeOfPhi35MiniAnd128k) {
  Expected<ModelConfig> c = parse_model_config(kPhi35Mini);
  ASSERT_TRUE(c.has_value()) << c.status().to_string();
  const RopeScaling& r = c->rope_scaling;
  EXPECT_EQ(r.type, "longrope");
  ASSERT_EQ(r.short_factor.size(), 48u);
  ASSERT_EQ(r.long_factor.size(), 48u);
  EXPECT_DOUBLE_EQ(r.long_factor[47], 64.83999633789062);
  EXPECT_EQ(r.original_max_position_embeddings, 4096);
  // transformers: sqrt(1 + ln(131072 / 4096) / ln(4096)).
  EXPECT_NEAR(r.attention_factor, std::sqrt(1 + std::log(32.0) / std::log(4096.0)), 1e-12);
  EXPECT_NEAR(r.attention_factor, 1.1902380714238083, 1e-12);
  // sliding_window 262144 reaches past the 131072 positions: full attention.
  EXPECT_EQ(c->attention_window(0), 0);
  // The original Phi-3-mini-128k spelling, "su".
  c = parse_model_config(patched(kPhi35Mini, {{"rope_scaling", {{"type", "su"}}}}));
  ASSERT_TRUE(c.has_value()) << c.status().to_string();
  EXPECT_EQ(c->rope_scaling.type, "longrope");
  // An explicit attention_factor wins.
  c = parse_model_config(patched(kPhi35Mini, {{"rope_scaling", {{"attention_factor", 1.5}}}}));
  ASSERT_TRUE(c.has_value()) << c.status().to_string();
  EXPECT_EQ(c->rope_scaling.attention_factor, 1.5);
}

TEST(GemmaPhi3ConfigTest, BadFieldsAreNamed) {
  EXPECT_THAT(parse_error(patched(kGemma2_9B, {{"hidden_activation", "gelu"}})).message(),
              AllOf(HasSubstr("hidden_activation"), HasSubstr("gelu_pytorch_tanh")));
  EXPECT_THAT(parse_error(patched(kGemma2_9B, {{"sliding_window", 10000}})).message(),
              AllOf(HasSubstr("sliding_window 10000 is larger than the context"),
                    HasSubstr("max_position_embeddings 8192")));
  EXPECT_THAT(
      parse_error(patched(kGemma3_12B_Text, {{"layer_types", {"full_attention"}}})).message(),
      HasSubstr("layer_types must be a list of num_hidden_layers (48)"));
  EXPECT_THAT(parse_error(patched(kGemma3_12B_Text,
                                  {{"rope_scaling", {{"rope_type", "yarn"}, {"factor", 4.0}}}}))
                  .message(),
              AllOf(HasSubstr("rope_scaling type 'yarn' is not supported")));
  EXPECT_THAT(
      parse_error(patched(kGemma3_12B_Text, {{"use_bidirectional_attention", true}})).message(),
      HasSubstr("use_bidirectional_attention"));
  EXPECT_THAT(parse_error(patched(kGemma2_9B, {{"attn_logit_softcapping", -1.0}})).message(),
              HasSubstr("attn_logit_softcapping"));
  EXPECT_THAT(parse_error(patched(kPhi35Mini, {{"rope_scaling", {{"short_factor", {1.0, 2.0}}}}}))
                  .message(),
              AllOf(HasSubstr("rope_scaling.short_factor has 2 entries"), HasSubstr("48")));
  EXPECT_THAT(parse_error(patched(kPhi35Mini, {{"rope_scaling", {{"type", "dynamic"}}}})).message(),
              HasSubstr("rope_scaling type 'dynamic' is not supported"));
  EXPECT_THAT(parse_error(patched(kPhi3Mini4k, {{"partial_rotary_factor", 1.5}})).message(),
              HasSubstr("partial_rotary_factor"));
  EXPECT_THAT(parse_error(patched(kPhi3Mini4k, {{"hidden_act", "gelu"}})).message(),
              HasSubstr("hidden_act"));
  EXPECT_THAT(parse_error(patched(kPhi3Mini4k, {{"sliding_window", 0}})).message(),
              HasSubstr("sliding_window"));
  EXPECT_THAT(parse_error(patched(kPhi3Mini4k,
                                  {{"quantization_config",
                                    {{"quant_method", "fp8"}, {"activation_scheme", "dynamic"}}}}))
                  .message(),
              AllOf(HasSubstr("quantization_config"), HasSubstr("Phi-3")));
}

}  // namespace
}  // namespace tessera
