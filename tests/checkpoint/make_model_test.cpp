#include "driver/make_model/make_model.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <CLI/CLI.hpp>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <set>
#include <tuple>
#include "common/checkpoint/layer_plan.h"

#include "common/checkpoint/safetensors.h"
#include "tests/checkpoint/test_util.h"

namespace tessera {
namespace {

namespace fs = std::filesystem;
using ckpt_test::TempDir;
using nlohmann::json;
using ::testing::HasSubstr;

// The tensors a tiny model must hold, written out independently of expected_weights().
std::map<std::string, std::vector<int64_t>> tiny_tensors(Architecture arch, int64_t vocab) {
  const int64_t h = 64, inter = 176, layers = 4, heads = 4, kv = 2;
  const int64_t hd = arch == Architecture::kQwen3 ? 32 : 16;
  const bool tied = arch == Architecture::kQwen2 || arch == Architecture::kQwen3;
  std::map<std::string, std::vector<int64_t>> t;
  t["model.embed_tokens.weight"] = {vocab, h};
  t["model.norm.weight"] = {h};
  if (!tied) t["lm_head.weight"] = {vocab, h};
  for (int64_t i = 0; i < layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    t[p + "self_attn.q_proj.weight"] = {heads * hd, h};
    t[p + "self_attn.k_proj.weight"] = {kv * hd, h};
    t[p + "self_attn.v_proj.weight"] = {kv * hd, h};
    t[p + "self_attn.o_proj.weight"] = {h, heads * hd};
    if (arch == Architecture::kQwen2) {
      t[p + "self_attn.q_proj.bias"] = {heads * hd};
      t[p + "self_attn.k_proj.bias"] = {kv * hd};
      t[p + "self_attn.v_proj.bias"] = {kv * hd};
    }
    if (arch == Architecture::kQwen3) {
      t[p + "self_attn.q_norm.weight"] = {hd};
      t[p + "self_attn.k_norm.weight"] = {hd};
    }
    t[p + "mlp.gate_proj.weight"] = {inter, h};
    t[p + "mlp.up_proj.weight"] = {inter, h};
    t[p + "mlp.down_proj.weight"] = {h, inter};
    t[p + "input_layernorm.weight"] = {h};
    t[p + "post_attention_layernorm.weight"] = {h};
  }
  return t;
}

struct TinyCase {
  const char* arch;
  Architecture expect;
  const char* tokenizer;
  int64_t vocab;  // the tokenizer's size, added tokens included
  std::optional<int64_t> bos;
  int64_t eos;
};

const TinyCase kTiny[] = {
    {"llama", Architecture::kLlama, "llama3", 128256, 128000, 128001},
    {"mistral", Architecture::kMistral, "llama2", 32000, 1, 2},
    {"qwen2", Architecture::kQwen2, "qwen3", 151669, std::nullopt, 151645},
    {"qwen3", Architecture::kQwen3, "qwen3", 151669, std::nullopt, 151645},
};

std::unique_ptr<Checkpoint> open_checkpoint(const std::string& dir) {
  Expected<std::unique_ptr<Checkpoint>> c = Checkpoint::open(dir);
  EXPECT_TRUE(c.has_value()) << c.status().to_string();
  return c.has_value() ? std::move(c).value() : nullptr;
}

void PrintTo(const TinyCase& c, std::ostream* os) { *os << c.arch << " / " << c.tokenizer; }

MakeModelOptions tiny_options(const TinyCase& c, const std::string& out, uint64_t seed = 1) {
  MakeModelOptions o;
  o.arch = c.arch;
  o.preset = "tiny";
  o.tokenizer_dir = ckpt_test::tokenizer_dir(c.tokenizer);
  o.seed = seed;
  o.out = out;
  return o;
}

#define REQUIRE_TOKENIZERS()                                                                     \
  if (ckpt_test::tokenizer_dir("llama3").empty() || ckpt_test::tokenizer_dir("qwen3").empty() || \
      ckpt_test::tokenizer_dir("llama2").empty())                                                \
  GTEST_SKIP() << "test tokenizers missing: run scripts/fetch-test-assets"

class MakeModelTinyTest : public ::testing::TestWithParam<TinyCase> {};

TEST_P(MakeModelTinyTest, WritesADirectoryTheReaderLoads) {
  REQUIRE_TOKENIZERS();
  const TinyCase& c = GetParam();
  TempDir dir;
  const std::string out = dir / "model";
  Status st = make_model(tiny_options(c, out));
  ASSERT_TRUE(st.is_ok()) << st.to_string();
  for (const char* f : {"config.json", "generation_config.json", "model.safetensors",
                        "tokenizer.json", "tokenizer_config.json"}) {
    EXPECT_TRUE(fs::exists(fs::path(out) / f)) << f;
  }
  EXPECT_FALSE(fs::exists(fs::path(out) / "model.safetensors.index.json"));
  EXPECT_EQ(ckpt_test::read_file(dir / "model/tokenizer.json"),
            ckpt_test::read_file(tiny_options(c, out).tokenizer_dir + "/tokenizer.json"));

  Expected<ModelConfig> cfg = load_model_config(out);
  ASSERT_TRUE(cfg.has_value()) << cfg.status().to_string();
  EXPECT_EQ(cfg->arch, c.expect);
  EXPECT_EQ(cfg->vocab_size, c.vocab);
  EXPECT_EQ(cfg->hidden_size, 64);
  EXPECT_EQ(cfg->num_layers, 4);
  EXPECT_EQ(cfg->num_heads, 4);
  EXPECT_EQ(cfg->num_kv_heads, 2);
  EXPECT_EQ(cfg->head_dim, c.expect == Architecture::kQwen3 ? 32 : 16);
  EXPECT_EQ(cfg->bos_token_id, c.bos);
  EXPECT_EQ(cfg->eos_token_ids, std::vector<int64_t>{c.eos});
  EXPECT_EQ(cfg->torch_dtype, DType::kBF16);
  EXPECT_EQ(cfg->attention_bias, c.expect == Architecture::kQwen2);
  EXPECT_EQ(cfg->qk_norm, c.expect == Architecture::kQwen3);
  EXPECT_EQ(cfg->rope_scaling.type, c.expect == Architecture::kLlama ? "llama3" : "");

  Expected<std::unique_ptr<Checkpoint>> ckpt = Checkpoint::open(out);
  ASSERT_TRUE(ckpt.has_value()) << ckpt.status().to_string();
  const auto expected = tiny_tensors(c.expect, c.vocab);
  EXPECT_EQ((*ckpt)->size(), expected.size());
  for (const auto& [name, shape] : expected) {
    Expected<TensorView> v = (*ckpt)->require(name, shape);
    ASSERT_TRUE(v.has_value()) << v.status().to_string();
    EXPECT_EQ(v->dtype, DType::kBF16) << name;
  }
  // The reader's own notion of the model agrees.
  for (const WeightSpec& w : expected_weights(*cfg)) {
    EXPECT_TRUE((*ckpt)->require(w.name, w.shape).has_value()) << w.name;
  }

  // Values: norms near 1, linear weights centred with std 1/sqrt(in) (o/down scaled down).
  auto stats = [&](const std::string& name) {
    TensorView v = *(*ckpt)->tensor(name);
    double sum = 0, sq = 0;
    for (int64_t i = 0; i < v.numel(); ++i) sum += v.at(i);
    const double mean = sum / v.numel();
    for (int64_t i = 0; i < v.numel(); ++i) sq += (v.at(i) - mean) * (v.at(i) - mean);
    return std::pair<double, double>(mean, std::sqrt(sq / v.numel()));
  };
  auto [norm_mean, norm_std] = stats("model.layers.0.input_layernorm.weight");
  EXPECT_NEAR(norm_mean, 1.0, 0.05);
  EXPECT_NEAR(norm_std, 0.1, 0.03);
  auto [up_mean, up_std] = stats("model.layers.1.mlp.up_proj.weight");
  EXPECT_NEAR(up_mean, 0.0, 0.01);
  EXPECT_NEAR(up_std, 1.0 / 8, 0.01);
  auto [down_mean, down_std] = stats("model.layers.1.mlp.down_proj.weight");
  EXPECT_NEAR(down_std, 1.0 / std::sqrt(176.0 * 8), 0.005);
  (void)down_mean;
}

INSTANTIATE_TEST_SUITE_P(AllArchs, MakeModelTinyTest, ::testing::ValuesIn(kTiny),
                         [](const auto& info) { return std::string(info.param.arch); });

TEST(MakeModelTest, SameSeedSameBytesOtherSeedOtherBytes) {
  REQUIRE_TOKENIZERS();
  TempDir dir;
  const TinyCase& c = kTiny[3];  // qwen3
  ASSERT_TRUE(make_model(tiny_options(c, dir / "a", 7)).is_ok());
  ASSERT_TRUE(make_model(tiny_options(c, dir / "b", 7)).is_ok());
  ASSERT_TRUE(make_model(tiny_options(c, dir / "c", 8)).is_ok());
  for (const char* f : {"model.safetensors", "config.json", "generation_config.json"}) {
    EXPECT_EQ(ckpt_test::read_file(dir / ("a/" + std::string(f))),
              ckpt_test::read_file(dir / ("b/" + std::string(f))))
        << f;
  }
  EXPECT_EQ(ckpt_test::read_file(dir / "a/config.json"),
            ckpt_test::read_file(dir / "c/config.json"));
  auto a = open_checkpoint(dir / "a");
  auto other = open_checkpoint(dir / "c");
  for (const std::string& name : a->names()) {
    TensorView x = *a->tensor(name), y = *other->tensor(name);
    EXPECT_NE(std::memcmp(x.data, y.data, x.bytes()), 0) << name;
  }
  // Tensors differ from one another too (the key includes the name).
  TensorView q = *a->tensor("model.layers.0.mlp.up_proj.weight");
  TensorView g = *a->tensor("model.layers.0.mlp.gate_proj.weight");
  EXPECT_NE(std::memcmp(q.data, g.data, q.bytes()), 0);
}

// --config-only: the same config.json and tokenizer, no weights (--load-format dummy runs it).
TEST(MakeModelTest, ConfigOnlyWritesNoWeights) {
  REQUIRE_TOKENIZERS();
  TempDir dir;
  const TinyCase& c = kTiny[3];  // qwen3
  MakeModelOptions only = tiny_options(c, dir / "only");
  only.config_only = true;
  ASSERT_TRUE(make_model(tiny_options(c, dir / "full")).is_ok());
  ASSERT_TRUE(make_model(only).is_ok());
  for (const char* f : {"config.json", "generation_config.json", "tokenizer.json"}) {
    EXPECT_EQ(ckpt_test::read_file(dir / ("full/" + std::string(f))),
              ckpt_test::read_file(dir / ("only/" + std::string(f))))
        << f;
  }
  EXPECT_FALSE(fs::exists(dir / "only/model.safetensors"));
  EXPECT_FALSE(fs::exists(dir / "only/model.safetensors.index.json"));
}

TEST(MakeModelTest, ShardsAboveMaxShardSize) {
  REQUIRE_TOKENIZERS();
  TempDir dir;
  const TinyCase& c = kTiny[0];  // llama: 16 MB embed + 16 MB lm_head in BF16
  MakeModelOptions whole = tiny_options(c, dir / "whole");
  MakeModelOptions sharded = tiny_options(c, dir / "sharded");
  sharded.max_shard_bytes = 4'000'000;
  ASSERT_TRUE(make_model(whole).is_ok());
  ASSERT_TRUE(make_model(sharded).is_ok());
  EXPECT_TRUE(fs::exists(dir / "sharded/model.safetensors.index.json"));
  EXPECT_FALSE(fs::exists(dir / "sharded/model.safetensors"));
  auto a = open_checkpoint(dir / "whole");
  auto b = open_checkpoint(dir / "sharded");
  EXPECT_TRUE(b->sharded());
  EXPECT_GE(b->files().size(), 3u);
  EXPECT_EQ(a->names(), b->names());
  for (const std::string& name : a->names()) {
    TensorView x = *a->tensor(name), y = *b->tensor(name);
    ASSERT_EQ(x.shape, y.shape);
    EXPECT_EQ(std::memcmp(x.data, y.data, x.bytes()), 0) << name;
  }
}

TEST(MakeModelTest, Dtypes) {
  REQUIRE_TOKENIZERS();
  TempDir dir;
  for (auto [flag, dtype, torch] :
       {std::tuple{"fp32", DType::kF32, "float32"}, std::tuple{"fp16", DType::kF16, "float16"}}) {
    MakeModelOptions o = tiny_options(kTiny[1], dir / flag);
    o.dtype = flag;
    ASSERT_TRUE(make_model(o).is_ok());
    EXPECT_EQ(json::parse(
                  ckpt_test::read_file(dir / (std::string(flag) + "/config.json")))["torch_dtype"],
              torch);
    auto ckpt = open_checkpoint(dir / flag);
    EXPECT_EQ(ckpt->tensor("model.norm.weight")->dtype, dtype);
  }
}

TEST(MakeModelTest, RealShapePresetConfigs) {
  REQUIRE_TOKENIZERS();
  struct Case {
    const char* preset;
    const char* tokenizer;
    int64_t vocab, hidden, inter, layers, heads, kv, head_dim;
  };
  const Case cases[] = {
      {"llama3-8b", "llama3", 128256, 4096, 14336, 32, 32, 8, 128},
      {"llama3-70b", "llama3", 128256, 8192, 28672, 80, 64, 8, 128},
      {"llama3.1-8b", "llama3", 128256, 4096, 14336, 32, 32, 8, 128},
      {"mistral-7b", "llama2", 32000, 4096, 14336, 32, 32, 8, 128},
      {"qwen2.5-7b", "qwen3", 152064, 3584, 18944, 28, 28, 4, 128},
      {"qwen3-8b", "qwen3", 151936, 4096, 12288, 36, 32, 8, 128},
      {"qwen3-0.6b", "qwen3", 151936, 1024, 3072, 28, 16, 8, 128},
  };
  for (const Case& c : cases) {
    MakeModelOptions o;
    o.preset = c.preset;
    o.tokenizer_dir = ckpt_test::tokenizer_dir(c.tokenizer);
    Expected<std::string> text = make_model_config_json(o);
    ASSERT_TRUE(text.has_value()) << c.preset << ": " << text.status().to_string();
    Expected<ModelConfig> cfg = parse_model_config(*text);
    ASSERT_TRUE(cfg.has_value()) << c.preset;
    EXPECT_EQ(cfg->vocab_size, c.vocab) << c.preset;
    EXPECT_EQ(cfg->hidden_size, c.hidden) << c.preset;
    EXPECT_EQ(cfg->intermediate_size, c.inter) << c.preset;
    EXPECT_EQ(cfg->num_layers, c.layers) << c.preset;
    EXPECT_EQ(cfg->num_heads, c.heads) << c.preset;
    EXPECT_EQ(cfg->num_kv_heads, c.kv) << c.preset;
    EXPECT_EQ(cfg->head_dim, c.head_dim) << c.preset;
  }
  MakeModelOptions o;
  o.preset = "llama3.1-8b";
  o.tokenizer_dir = ckpt_test::tokenizer_dir("llama3");
  json j = json::parse(*make_model_config_json(o));
  EXPECT_EQ(j["rope_scaling"]["rope_type"], "llama3");
  EXPECT_EQ(j["rope_scaling"]["factor"], 8.0);
  EXPECT_EQ(j["max_position_embeddings"], 131072);
  EXPECT_EQ(j["architectures"], json::array({"LlamaForCausalLM"}));
  EXPECT_EQ(j["head_dim"], 128);
  EXPECT_EQ(j["mlp_bias"], false);
  o.preset = "llama3-8b";
  EXPECT_TRUE(json::parse(*make_model_config_json(o))["rope_scaling"].is_null());
}

TEST(MakeModelTest, Refusals) {
  REQUIRE_TOKENIZERS();
  TempDir dir;
  MakeModelOptions o = tiny_options(kTiny[0], dir / "m");

  ckpt_test::write_file(dir / "m", "");  // --out is a file
  EXPECT_THAT(make_model(o).message(), HasSubstr("not a directory"));
  fs::remove(dir / "m");
  fs::create_directory(dir / "m");
  ckpt_test::write_file(dir / "m/keep.txt", "precious");
  Status st = make_model(o);
  EXPECT_EQ(st.code(), Code::kInvalidArgument);
  EXPECT_THAT(st.message(), HasSubstr("not empty"));
  EXPECT_EQ(ckpt_test::read_file(dir / "m/keep.txt"), "precious");

  MakeModelOptions bad = o;
  bad.out = dir / "x";
  bad.arch = "gpt2";
  EXPECT_THAT(make_model(bad).message(), HasSubstr("unknown --arch 'gpt2'"));
  bad = o;
  bad.out = dir / "x";
  bad.preset = "huge";
  st = make_model(bad);
  EXPECT_THAT(st.message(), HasSubstr("unknown --preset 'huge'"));
  EXPECT_THAT(st.message(), HasSubstr("qwen3-8b"));
  bad.preset = "qwen3-8b";
  bad.arch = "llama";
  EXPECT_THAT(make_model(bad).message(), HasSubstr("preset 'qwen3-8b' is a qwen3 model"));
  bad.arch = "";
  bad.preset = "tiny";
  EXPECT_THAT(make_model(bad).message(), HasSubstr("--arch is required with --preset tiny"));
  bad = o;
  bad.out = dir / "x";
  bad.dtype = "int4";
  EXPECT_THAT(make_model(bad).message(), HasSubstr("--dtype 'int4'"));
  bad = o;
  bad.out = dir / "x";
  bad.tokenizer_dir = dir.path();
  st = make_model(bad);
  EXPECT_EQ(st.code(), Code::kNotFound);
  EXPECT_THAT(st.message(), HasSubstr("no tokenizer.json"));
  bad = o;
  bad.out = dir / "x";
  bad.arch = "";
  bad.preset = "mistral-7b";
  bad.tokenizer_dir = ckpt_test::tokenizer_dir("qwen3");
  EXPECT_THAT(make_model(bad).message(), HasSubstr("151669 tokens, more than preset"));
  EXPECT_FALSE(fs::exists(dir / "x"));  // refused before creating anything
}

// --quantization writes the exporter's quantization_config (read back by the same parser the
// runtime uses) and the format's tensors; a shape the format cannot pack, or a value it does not
// have, is refused before anything is written. (tests/model/quantized_test.cpp loads and runs
// every format.)
TEST(MakeModelTest, QuantizedCheckpoints) {
  REQUIRE_TOKENIZERS();
  TempDir dir;
  MakeModelOptions o = tiny_options(kTiny[0], dir / "awq");
  o.overrides.intermediate_size = 192;
  o.quantization.method = "awq";
  o.quantization.group_size = 64;
  json j = json::parse(*make_model_config_json(o));
  EXPECT_EQ(j["quantization_config"]["quant_method"], "awq");
  EXPECT_EQ(j["quantization_config"]["group_size"], 64);
  EXPECT_EQ(j["quantization_config"]["version"], "gemm");
  ASSERT_TRUE(make_model(o).is_ok());
  auto ckpt = Checkpoint::open(dir / "awq");
  ASSERT_TRUE(ckpt);
  auto qweight = (*ckpt)->tensor("model.layers.0.mlp.down_proj.qweight");
  ASSERT_TRUE(qweight);
  EXPECT_EQ(qweight->dtype, DType::kI32);
  EXPECT_EQ(qweight->shape, (std::vector<int64_t>{192, 64 / 8}));
  EXPECT_EQ((*ckpt)->tensor("model.layers.0.mlp.down_proj.scales")->dtype, DType::kF16);
  EXPECT_FALSE((*ckpt)->has("model.layers.0.mlp.down_proj.weight"));
  EXPECT_EQ((*ckpt)->tensor("lm_head.weight")->dtype, DType::kBF16) << "lm_head stays plain";

  o.quantization.method = "fp8";
  o.quantization.weight_scale = "channel";
  j = json::parse(*make_model_config_json(o));
  EXPECT_EQ(j["quantization_config"]["quant_method"], "compressed-tensors");

  MakeModelOptions bad = tiny_options(kTiny[0], dir / "x");
  bad.quantization.method = "int3";
  EXPECT_THAT(make_model(bad).message(), HasSubstr("--quantization int3"));
  bad.quantization.method = "gptq";
  bad.quantization.bits = 3;
  EXPECT_THAT(make_model(bad).message(), HasSubstr("bits must be 4 or 8"));
  bad.quantization.bits = 4;
  bad.quantization.group_size = 48;
  EXPECT_THAT(make_model(bad).message(), HasSubstr("group_size must be 32, 64, 128"));
  bad.quantization.group_size = 32;  // the tiny MLP's 176 inputs are not whole groups of 32
  EXPECT_THAT(make_model(bad).message(), HasSubstr("down_proj has 176 input features"));
  bad.quantization.method = "fp8";
  bad.quantization.activations = "sometimes";
  EXPECT_THAT(make_model(bad).message(), HasSubstr("--activations"));
  EXPECT_FALSE(fs::exists(dir / "x"));
}

// Shape overrides give tiny models of unusual shapes; what the reader refuses, or a Qwen2 head
// size its config cannot say, is refused before anything is written.
TEST(MakeModelTest, ShapeOverrides) {
  REQUIRE_TOKENIZERS();
  MakeModelOptions o = tiny_options(kTiny[0], "");
  o.overrides.hidden_size = 160;
  o.overrides.num_heads = 2;
  o.overrides.num_kv_heads = 1;
  o.overrides.head_dim = 80;
  o.overrides.intermediate_size = 200;
  o.overrides.num_layers = 3;
  o.overrides.vocab_size = 128259;
  json j = json::parse(*make_model_config_json(o));
  EXPECT_EQ(j["hidden_size"], 160);
  EXPECT_EQ(j["num_attention_heads"], 2);
  EXPECT_EQ(j["num_key_value_heads"], 1);
  EXPECT_EQ(j["head_dim"], 80);
  EXPECT_EQ(j["intermediate_size"], 200);
  EXPECT_EQ(j["num_hidden_layers"], 3);
  EXPECT_EQ(j["vocab_size"], 128259);

  TempDir dir;
  MakeModelOptions small = tiny_options(kTiny[3], dir / "q");  // qwen3
  small.overrides.head_dim = 6;
  small.overrides.num_heads = 6;
  small.overrides.num_kv_heads = 2;
  small.overrides.num_layers = 1;
  ASSERT_TRUE(make_model(small).is_ok());
  Expected<ModelConfig> cfg = load_model_config(dir / "q");
  ASSERT_TRUE(cfg.has_value()) << cfg.status().to_string();
  EXPECT_EQ(cfg->head_dim, 6);
  EXPECT_EQ(cfg->num_heads, 6);
  EXPECT_EQ(cfg->num_kv_heads, 2);
  auto ckpt = open_checkpoint(dir / "q");
  ASSERT_TRUE(ckpt);
  EXPECT_TRUE(ckpt->require("model.layers.0.self_attn.q_proj.weight", {36, 64}).has_value());

  MakeModelOptions bad = o;
  bad.overrides.vocab_size = 1000;  // below the tokenizer's 128256
  EXPECT_THAT(make_model_config_json(bad).status().message(), HasSubstr("128256 tokens"));
  bad = o;
  bad.overrides.num_kv_heads = 3;  // 2 heads over 3 KV heads
  EXPECT_FALSE(make_model_config_json(bad).has_value());
  bad = o;
  bad.overrides.head_dim = 0;
  bad.overrides.num_heads = 3;  // 160 / 3
  EXPECT_THAT(make_model_config_json(bad).status().message(), HasSubstr("give --head-dim"));
  bad = tiny_options(kTiny[2], "");  // qwen2: head size is hidden / heads
  bad.overrides.head_dim = 32;
  EXPECT_THAT(make_model_config_json(bad).status().message(), HasSubstr("Qwen2 has no head_dim"));
  bad.overrides.head_dim = -4;
  EXPECT_THAT(make_model_config_json(bad).status().message(), HasSubstr("must be positive"));
}

TEST(MakeModelTest, CommandLine) {
  CLI::App app;
  MakeModelOptions o;
  CLI::App* sub = add_make_model_subcommand(app, o);
  ASSERT_NE(sub, nullptr);
  std::vector<std::string> args = {
      "2GiB",  "--max-shard-size", "/tmp/t",    "--tokenizer", "/tmp/o", "--out",
      "7",     "--seed",           "fp16",      "--dtype",     "tiny",   "--preset",
      "qwen3", "--arch",           "make-model"};
  app.parse(args);  // CLI11 takes the arguments reversed
  EXPECT_TRUE(sub->parsed());
  EXPECT_EQ(o.arch, "qwen3");
  EXPECT_EQ(o.preset, "tiny");
  EXPECT_EQ(o.dtype, "fp16");
  EXPECT_EQ(o.seed, 7u);
  EXPECT_EQ(o.out, "/tmp/o");
  EXPECT_EQ(o.tokenizer_dir, "/tmp/t");
  EXPECT_EQ(o.max_shard_bytes, 2ull << 30);

  MakeModelOptions d;
  CLI::App app2;
  add_make_model_subcommand(app2, d);
  app2.parse("make-model --preset tiny --tokenizer t --out o --max-shard-size 5GB", false);
  EXPECT_EQ(d.max_shard_bytes, 5'000'000'000ull);
  EXPECT_EQ(d.dtype, "bf16");
  EXPECT_EQ(d.seed, 0u);

  std::set<std::string> presets;
  for (const MakeModelPreset& p : make_model_presets()) presets.insert(p.name);
  for (const char* p :
       {"tiny", "llama3-8b", "llama3-70b", "qwen2.5-7b", "qwen3-8b", "mistral-7b"}) {
    EXPECT_TRUE(presets.count(p)) << p;
  }
}

// The tiny MoE models: config.json with the keys MixtralConfig / Qwen2MoeConfig / Qwen3MoeConfig
// read, and the experts' tensors under the names transformers' checkpoints use.
TEST(MakeModelTest, TinyMixtureOfExperts) {
  REQUIRE_TOKENIZERS();
  struct Case {
    const char* arch;
    const char* tokenizer;
    Architecture expect;
    int64_t layers;
    std::vector<std::string> layer0;  // MoE tensors of layer 0 (names after "model.layers.0.")
  };
  const Case cases[] = {
      {"mixtral",
       "llama2",
       Architecture::kMixtral,
       2,
       {"block_sparse_moe.gate.weight", "block_sparse_moe.experts.0.w1.weight",
        "block_sparse_moe.experts.3.w2.weight", "block_sparse_moe.experts.2.w3.weight"}},
      {"qwen2_moe",
       "qwen3",
       Architecture::kQwen2Moe,
       2,
       {"mlp.gate.weight", "mlp.experts.0.gate_proj.weight", "mlp.experts.3.down_proj.weight",
        "mlp.experts.1.up_proj.weight", "mlp.shared_expert.gate_proj.weight",
        "mlp.shared_expert.up_proj.weight", "mlp.shared_expert.down_proj.weight",
        "mlp.shared_expert_gate.weight", "self_attn.q_proj.bias"}},
      {"qwen3_moe",
       "qwen3",
       Architecture::kQwen3Moe,
       3,
       {"mlp.gate.weight", "mlp.experts.3.gate_proj.weight", "self_attn.q_norm.weight"}},
  };
  for (const Case& c : cases) {
    TempDir dir;
    MakeModelOptions o;
    o.arch = c.arch;
    o.preset = "tiny";
    o.tokenizer_dir = ckpt_test::tokenizer_dir(c.tokenizer);
    o.seed = 3;
    o.out = dir / "model";
    Status st = make_model(o);
    ASSERT_TRUE(st.is_ok()) << c.arch << ": " << st.to_string();
    Expected<ModelConfig> cfg = load_model_config(o.out);
    ASSERT_TRUE(cfg.has_value()) << cfg.status().to_string();
    EXPECT_EQ(cfg->arch, c.expect);
    EXPECT_EQ(cfg->num_layers, c.layers);
    EXPECT_EQ(cfg->moe.num_experts, 4) << c.arch;
    EXPECT_EQ(cfg->moe.top_k, 2) << c.arch;
    json j = json::parse(ckpt_test::read_file(o.out + "/config.json"));
    EXPECT_EQ(j["model_type"], c.arch);
    EXPECT_EQ(j.contains("num_local_experts"), c.expect == Architecture::kMixtral);
    EXPECT_EQ(j.contains("num_experts"), c.expect != Architecture::kMixtral);
    auto ckpt = open_checkpoint(o.out);
    ASSERT_NE(ckpt, nullptr);
    for (const std::string& name : c.layer0) {
      EXPECT_TRUE((*ckpt).tensor("model.layers.0." + name).has_value()) << c.arch << " " << name;
    }
    EXPECT_EQ(ckpt->size(), expected_weights(*cfg).size()) << c.arch;
    if (c.expect == Architecture::kQwen3Moe) {
      // mlp_only_layers [1]: layer 1 is a dense MLP of intermediate_size between MoE layers.
      EXPECT_EQ(j["mlp_only_layers"], json::array({1}));
      EXPECT_TRUE(ckpt->require("model.layers.1.mlp.gate_proj.weight", {176, 64}).has_value());
      EXPECT_FALSE(ckpt->tensor("model.layers.1.mlp.gate.weight").has_value());
      EXPECT_TRUE(
          ckpt->require("model.layers.2.mlp.experts.0.up_proj.weight", {48, 64}).has_value());
      EXPECT_TRUE(cfg->moe.norm_topk_prob);
    }
    if (c.expect == Architecture::kQwen2Moe) {
      EXPECT_EQ(j["shared_expert_intermediate_size"], 96);
      EXPECT_FALSE(cfg->moe.norm_topk_prob);
    }
  }
}

TEST(MakeModelTest, RealShapeMoePresets) {
  REQUIRE_TOKENIZERS();
  MakeModelOptions o;
  o.preset = "mixtral-8x7b";
  o.tokenizer_dir = ckpt_test::tokenizer_dir("llama2");
  Expected<std::string> text = make_model_config_json(o);
  ASSERT_TRUE(text.has_value()) << text.status().to_string();
  json j = json::parse(*text);
  EXPECT_EQ(j["architectures"], json::array({"MixtralForCausalLM"}));
  EXPECT_EQ(j["num_local_experts"], 8);
  EXPECT_EQ(j["num_experts_per_tok"], 2);
  EXPECT_EQ(j["intermediate_size"], 14336);
  EXPECT_EQ(j["rope_theta"], 1e6);
  EXPECT_TRUE(j["sliding_window"].is_null());
  o.preset = "qwen3-30b-a3b";
  o.tokenizer_dir = ckpt_test::tokenizer_dir("qwen3");
  text = make_model_config_json(o);
  ASSERT_TRUE(text.has_value()) << text.status().to_string();
  j = json::parse(*text);
  EXPECT_EQ(j["architectures"], json::array({"Qwen3MoeForCausalLM"}));
  EXPECT_EQ(j["num_experts"], 128);
  EXPECT_EQ(j["num_experts_per_tok"], 8);
  EXPECT_EQ(j["moe_intermediate_size"], 768);
  EXPECT_EQ(j["norm_topk_prob"], true);
  EXPECT_EQ(j["decoder_sparse_step"], 1);
  EXPECT_EQ(j["mlp_only_layers"], json::array());
  EXPECT_EQ(j["num_hidden_layers"], 48);
  EXPECT_EQ(j["head_dim"], 128);
  Expected<ModelConfig> cfg = parse_model_config(*text);
  ASSERT_TRUE(cfg.has_value()) << cfg.status().to_string();
  EXPECT_EQ(cfg->moe.expert_intermediate, 768);
  o.preset = "qwen1.5-moe-a2.7b";
  text = make_model_config_json(o);
  ASSERT_TRUE(text.has_value()) << text.status().to_string();
  j = json::parse(*text);
  EXPECT_EQ(j["architectures"], json::array({"Qwen2MoeForCausalLM"}));
  EXPECT_EQ(j["num_experts"], 60);
  EXPECT_EQ(j["num_experts_per_tok"], 4);
  EXPECT_EQ(j["moe_intermediate_size"], 1408);
  EXPECT_EQ(j["shared_expert_intermediate_size"], 5632);
  EXPECT_EQ(j["norm_topk_prob"], false);
  EXPECT_EQ(j["num_key_value_heads"], 16);
  EXPECT_EQ(j["num_hidden_layers"], 24);
  EXPECT_EQ(j["vocab_size"], 151936);
  cfg = parse_model_config(*text);
  ASSERT_TRUE(cfg.has_value()) << cfg.status().to_string();
  EXPECT_EQ(cfg->moe.expert_intermediate, 1408);
  EXPECT_EQ(cfg->moe.shared_intermediate, 5632);
}

// The tiny Gemma 2, Gemma 3 (text) and Phi-3 models exercise each feature: windows shorter than
// the test prompts, soft-caps, layer_types, local/global RoPE, LongRoPE over a partial rotary
// dimension, fused projections; and the real-shape presets copy the published configs.
TEST(MakeModelTest, GemmaAndPhi3) {
  REQUIRE_TOKENIZERS();
  for (const char* arch : {"gemma2", "gemma3", "phi3"}) {
    TempDir dir;
    MakeModelOptions o;
    o.arch = arch;
    o.preset = "tiny";
    o.tokenizer_dir = ckpt_test::tokenizer_dir("llama2");
    o.seed = 3;
    o.out = dir / "model";
    Status st = make_model(o);
    ASSERT_TRUE(st.is_ok()) << arch << ": " << st.to_string();
    Expected<ModelConfig> cfg = load_model_config(o.out);
    ASSERT_TRUE(cfg.has_value()) << cfg.status().to_string();
    auto ckpt = open_checkpoint(o.out);
    ASSERT_NE(ckpt, nullptr);
    EXPECT_EQ(ckpt->size(), expected_weights(*cfg).size()) << arch;
    const std::string a = arch;
    if (a == "phi3") {
      EXPECT_EQ(cfg->arch, Architecture::kPhi3);
      EXPECT_EQ(cfg->attention_window(0), 16);
      EXPECT_EQ(cfg->rotary_dim, 12);
      EXPECT_EQ(cfg->rope_scaling.type, "longrope");
      EXPECT_NEAR(cfg->rope_scaling.attention_factor,
                  std::sqrt(1 + std::log(4.0) / std::log(128.0)), 1e-12);
      EXPECT_TRUE(
          ckpt->require("model.layers.0.self_attn.qkv_proj.weight", {64 + 2 * 32, 64}).has_value());
      EXPECT_TRUE(ckpt->require("model.layers.3.mlp.gate_up_proj.weight", {352, 64}).has_value());
      continue;
    }
    EXPECT_EQ(cfg->arch, a == "gemma2" ? Architecture::kGemma2 : Architecture::kGemma3);
    EXPECT_EQ(cfg->head_dim, 32);
    EXPECT_EQ(cfg->attention_window(0), 8);
    EXPECT_EQ(cfg->attention_window(a == "gemma2" ? 1 : 2), 0);
    EXPECT_EQ(*cfg->query_pre_attn_scalar, 24.0);
    EXPECT_EQ(cfg->attn_logit_softcapping, a == "gemma2" ? 5.0 : 0.0);
    EXPECT_TRUE(ckpt->require("model.layers.0.pre_feedforward_layernorm.weight", {64}).has_value());
    // Gemma's norm weights are w of (1 + w): drawn around 0.
    Expected<TensorView> norm = ckpt->tensor("model.norm.weight");
    ASSERT_TRUE(norm.has_value());
    double mean = 0;
    for (int64_t i = 0; i < 64; ++i) mean += norm->at(i) / 64;
    EXPECT_LT(std::abs(mean), 0.1) << arch;
    json j = json::parse(ckpt_test::read_file(o.out + "/config.json"));
    EXPECT_EQ(j["model_type"], a == "gemma2" ? "gemma2" : "gemma3_text");
    EXPECT_EQ(j["layer_types"].size(), static_cast<size_t>(cfg->num_layers));
  }
  for (auto [preset, tok, cls] : {std::tuple{"gemma2-9b", "llama2", "Gemma2ForCausalLM"},
                                  {"gemma3-12b", "llama2", "Gemma3ForCausalLM"},
                                  {"phi3-mini", "llama2", "Phi3ForCausalLM"},
                                  {"phi3-mini-128k", "llama2", "Phi3ForCausalLM"}}) {
    MakeModelOptions o;
    o.preset = preset;
    o.tokenizer_dir = ckpt_test::tokenizer_dir(tok);
    Expected<std::string> text = make_model_config_json(o);
    ASSERT_TRUE(text.has_value()) << preset << ": " << text.status().to_string();
    json j = json::parse(*text);
    EXPECT_EQ(j["architectures"], json::array({cls}));
    Expected<ModelConfig> c = parse_model_config(*text);
    ASSERT_TRUE(c.has_value()) << c.status().to_string();
    const std::string p = preset;
    if (p == "phi3-mini") {
      EXPECT_EQ(c->head_dim, 96);
      EXPECT_EQ(c->attention_window(0), 2047);
    } else if (p == "phi3-mini-128k") {
      // LongRoPE with the published factor lists; transformers' attention_factor for 32x.
      EXPECT_EQ(c->head_dim, 96);
      EXPECT_EQ(c->max_position_embeddings, 131072);
      // sliding_window 262144 reaches past max_position_embeddings: no layer slides.
      EXPECT_EQ(j["sliding_window"], 262144);
      EXPECT_EQ(c->attention_window(0), 0);
      EXPECT_EQ(c->rope_scaling.type, "longrope");
      EXPECT_EQ(c->rope_scaling.original_max_position_embeddings, 4096);
      ASSERT_EQ(c->rope_scaling.short_factor.size(), 48u);
      ASSERT_EQ(c->rope_scaling.long_factor.size(), 48u);
      EXPECT_EQ(c->rope_scaling.short_factor[1], 1.0199999809265137);
      EXPECT_EQ(c->rope_scaling.long_factor[47], 64.83999633789062);
      EXPECT_NEAR(c->rope_scaling.attention_factor,
                  std::sqrt(1 + std::log(32.0) / std::log(4096.0)), 1e-12);
    } else if (p == "gemma2-9b") {
      EXPECT_EQ(c->num_layers, 42);
      EXPECT_EQ(c->final_logit_softcapping, 30.0);
    } else {
      EXPECT_EQ(c->num_layers, 48);
      EXPECT_EQ(c->attention_window(5), 0);
      EXPECT_EQ(c->attention_window(4), 1024);
      EXPECT_EQ(c->rope_scaling.factor, 8.0);
    }
  }
}

}  // namespace
}  // namespace tessera
