// Quantized checkpoints end to end on the CPU backend, as make-model writes them in each format:
//   - the quantized model computes exactly what its dequantized weights mean: its logits equal
//     those of a plain F32 "twin" checkpoint holding the dequantized weights (FP8 with
//     quantized activations: close to the twin, not equal);
//   - split tensor-parallel (2 ranks: packed shards, row-parallel groups, desc_act's whole
//     scales) and pipeline-parallel, it gives the logits and greedy tokens of one rank;
//   - bad checkpoints and flags are clear errors naming the tensor, file or field.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "actors/model/weights.h"
#include "common/checkpoint/safetensors.h"
#include "driver/make_model/make_model.h"
#include "tests/model/rank_group.h"

namespace tessera {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

std::string source_dir() { return TESSERA_SOURCE_DIR; }

struct Format {
  std::string name;
  MakeModelOptions::Quantization q;
  bool exact;     // the twin's logits are the model's (no activation rounding)
  bool tp_exact;  // split, the logits are one rank's up to summation order
};

std::vector<Format> formats() {
  std::vector<Format> all;
  auto add = [&](std::string name, auto set, bool exact = true, bool tp_exact = true) {
    Format f{std::move(name), {}, exact, tp_exact};
    f.q.group_size = 32;
    set(f.q);
    all.push_back(std::move(f));
  };
  add("awq", [](auto& q) { q.method = "awq"; });
  add("awq_g64", [](auto& q) {
    q.method = "awq";
    q.group_size = 64;
  });
  add("gptq", [](auto& q) { q.method = "gptq"; });
  add("gptq_desc_act_asym", [](auto& q) {
    q.method = "gptq";
    q.desc_act = true;
    q.asym = true;
  });
  add("gptq_8bit", [](auto& q) {
    q.method = "gptq";
    q.bits = 8;
  });
  add("gptq_one_group", [](auto& q) {
    q.method = "gptq";
    q.group_size = -1;
  });
  add("fp8_w8a16", [](auto& q) {
    q.method = "fp8";
    q.activations = "none";
  });
  // Dynamic per-token scales are each rank's: a row-parallel layer's rank sees its share of
  // the row (vLLM's W8A8 does the same), so split runs differ a little from one rank.
  add("fp8_tensor_dynamic", [](auto& q) { q.method = "fp8"; }, false, false);
  add("fp8_channel_static", [](auto& q) {
    q.method = "fp8";
    q.weight_scale = "channel";
    q.activations = "static";
  }, false);
  return all;
}

std::string temp_dir(const std::string& tag) {
  const fs::path p = fs::temp_directory_path() /
                     ("tessera-quant-" + tag + "-" + std::to_string(::getpid()));
  fs::remove_all(p);
  return p.string();
}

// A tiny Llama (hidden 64, 4 heads of 16, 2 KV heads, 3 layers, MLP 192: whole groups of 32 at
// tp 2) written in `q`'s format.
std::string make_quantized(const std::string& tag, const MakeModelOptions::Quantization& q) {
  MakeModelOptions o;
  o.arch = "llama";
  o.preset = "tiny";
  o.tokenizer_dir = source_dir() + "/tests/assets/tokenizers/llama3";
  o.seed = 77;
  o.dtype = "bf16";
  o.overrides.intermediate_size = 192;
  o.overrides.num_layers = 3;
  o.quantization = q;
  o.out = temp_dir(tag);
  Status st = make_model(o);
  EXPECT_TRUE(st.is_ok()) << st.to_string();
  return o.out;
}

nlohmann::json read_json(const std::string& path) {
  std::ifstream in(path);
  return nlohmann::json::parse(in);
}

void write_json(const std::string& path, const nlohmann::json& j) {
  std::ofstream(path) << j.dump(2);
}

// The model in `dir` rewritten into `out`: each tensor `edit` keeps (returning false drops it),
// config.json as `config` says.
template <typename Edit>
void rewrite(const std::string& dir, const std::string& out, const nlohmann::json& config,
             Edit edit) {
  auto ckpt = Checkpoint::open(dir);
  ASSERT_TRUE(ckpt) << ckpt.status().to_string();
  fs::create_directories(out);
  SafetensorsWriter writer;
  std::deque<std::vector<uint8_t>> keep;
  for (const std::string& name : (*ckpt)->names()) {
    TensorView t = *(*ckpt)->tensor(name);
    std::vector<uint8_t>& bytes = keep.emplace_back(static_cast<const uint8_t*>(t.data),
                                                    static_cast<const uint8_t*>(t.data) + t.bytes());
    if (!edit(name, t, bytes)) continue;
    ASSERT_TRUE(writer.add(name, t.dtype, t.shape, bytes).is_ok()) << name;
  }
  ASSERT_TRUE(writer.write(out + "/model.safetensors").is_ok());
  for (const char* f : {"tokenizer.json", "tokenizer_config.json", "generation_config.json"}) {
    if (fs::exists(fs::path(dir) / f)) fs::copy_file(fs::path(dir) / f, fs::path(out) / f);
  }
  write_json(out + "/config.json", config);
}

// The plain F32 twin of a quantized model: every linear layer's dequantized weight under its
// plain name, the other tensors as they are, no quantization_config.
std::string write_twin(const std::string& dir) {
  const std::string out = dir + "-twin";
  auto config = load_model_config(dir);
  EXPECT_TRUE(config) << config.status().to_string();
  auto ckpt = Checkpoint::open(dir);
  EXPECT_TRUE(ckpt);
  ParallelConfig whole;
  auto plan = LayerPlan::make(*config, whole);
  auto weights = bind_weights(**ckpt, *config, *plan);
  EXPECT_TRUE(weights) << weights.status().to_string();
  SafetensorsWriter writer;
  std::deque<std::vector<float>> keep;
  for (size_t i = 0; i < weights->layers.size(); ++i) {
    for (auto& [name, lw] : weights->layers[i].linears()) {
      const std::string module = layer_tensor_name(static_cast<int64_t>(i), name);
      auto w = dequantize(*lw, config->quant, module);
      EXPECT_TRUE(w) << w.status().to_string();
      std::vector<float>& v = keep.emplace_back(std::move(*w));
      const int64_t out_f = lw->out_features(config->quant), in_f = lw->in_features(config->quant);
      EXPECT_TRUE(writer
                      .add(module + ".weight", DType::kF32, {out_f, in_f},
                           {reinterpret_cast<const uint8_t*>(v.data()), v.size() * 4})
                      .is_ok());
    }
  }
  for (const std::string& name : (*ckpt)->names()) {
    const size_t dot = name.rfind('.');
    const std::string part = name.substr(dot + 1);
    if (part == "qweight" || part == "qzeros" || part == "scales" || part == "g_idx" ||
        part == "weight_scale" || part == "input_scale") {
      continue;
    }
    TensorView t = *(*ckpt)->tensor(name);
    if (t.dtype == DType::kF8E4M3) continue;  // written dequantized above
    EXPECT_TRUE(writer
                    .add(name, t.dtype, t.shape,
                         {static_cast<const uint8_t*>(t.data), t.bytes()})
                    .is_ok());
  }
  fs::create_directories(out);
  EXPECT_TRUE(writer.write(out + "/model.safetensors").is_ok());
  nlohmann::json c = read_json(dir + "/config.json");
  c.erase("quantization_config");
  write_json(out + "/config.json", c);
  for (const char* f : {"tokenizer.json", "tokenizer_config.json", "generation_config.json"}) {
    fs::copy_file(fs::path(dir) / f, fs::path(out) / f);
  }
  return out;
}

// Prefill `ids`, then greedy tokens: every step's full logits and the tokens.
struct Outputs {
  std::vector<std::vector<float>> logits;
  std::vector<int32_t> tokens;
};

Outputs run(RankGroup& g, const std::vector<int32_t>& ids, int steps) {
  Outputs r;
  std::vector<uint32_t> blocks = {0, 1, 2, 3};
  auto out = g.execute(seq_step(1, ids, 0, true, static_cast<int64_t>(ids.size()), blocks));
  EXPECT_TRUE(out) << out.status().to_string();
  if (!out) return r;
  r.logits.push_back(out->logits);
  r.tokens.push_back(out->outputs[0].sample.token);
  for (int s = 1; s < steps; ++s) {
    const int64_t pos = static_cast<int64_t>(ids.size() + r.tokens.size()) - 1;
    auto o = g.execute(seq_step(1, {r.tokens.back()}, pos, false, 0, {}));
    EXPECT_TRUE(o) << o.status().to_string();
    if (!o) return r;
    r.logits.push_back(o->logits);
    r.tokens.push_back(o->outputs[0].sample.token);
  }
  EXPECT_TRUE(g.execute(finish(1)));
  return r;
}

// The largest logit difference over the first `steps` steps (all by default: the tokens fed
// back must then agree, or later steps compare different inputs).
double max_abs(const Outputs& a) {
  double m = 0;
  for (float v : a.logits.at(0)) m = std::max(m, std::abs(static_cast<double>(v)));
  return m;
}

double max_diff(const Outputs& a, const Outputs& b, size_t steps = SIZE_MAX) {
  double worst = 0;
  for (size_t s = 0; s < std::min({a.logits.size(), b.logits.size(), steps}); ++s) {
    for (size_t k = 0; k < a.logits[s].size(); ++k) {
      worst = std::max(worst, std::abs(static_cast<double>(a.logits[s][k]) - b.logits[s][k]));
    }
  }
  return worst;
}

const std::vector<int32_t> kPrompt = {128000, 791, 4062, 14198, 39935, 35308, 927, 279, 16053, 5679};

class QuantizedModelTest : public ::testing::TestWithParam<Format> {};

TEST_P(QuantizedModelTest, ComputesItsDequantizedWeightsOnOneRankAndSplit) {
  const Format& f = GetParam();
  const std::string dir = make_quantized(f.name, f.q);
  const std::string twin = write_twin(dir);

  auto one = RankGroup::load(dir, 1, 1);
  ASSERT_TRUE(one) << one.status().to_string();
  EXPECT_THAT((*one)->rank(0).info().quantization, HasSubstr(f.q.method));
  const Outputs quantized = run(**one, kPrompt, 8);
  ASSERT_EQ(quantized.tokens.size(), 8u);

  auto plain = RankGroup::load(twin, 1, 1);
  ASSERT_TRUE(plain) << plain.status().to_string();
  EXPECT_EQ((*plain)->rank(0).info().quantization, "none");
  const Outputs reference = run(**plain, kPrompt, 8);
  const double twin_diff = max_diff(quantized, reference);
  if (f.exact) {
    // The same F32 weights through the same kernels.
    EXPECT_EQ(twin_diff, 0.0) << f.name;
    EXPECT_EQ(quantized.tokens, reference.tokens) << f.name;
  } else {
    // FP8 activations: each value rounded to 3 mantissa bits, so the prefill's logits move, a
    // little (the greedy tokens after may part).
    const double prefill = max_diff(quantized, reference, 1);
    std::printf("%s: prefill logits vs the twin differ by %.3g (largest |logit| %.3g)\n",
                f.name.c_str(), prefill, max_abs(reference));
    // (3 layers of 7 linear layers, each input rounded: ~3% noise on each output, 6-7% on the
    // largest of 128k logits here; a wrong scale would be all noise.)
    EXPECT_GT(prefill, 0.0) << f.name << ": activations should be rounded";
    EXPECT_LT(prefill, 0.1 * max_abs(reference)) << f.name;
  }

  for (auto [tp, pp] : {std::pair{2, 1}, {1, 3}, {2, 3}}) {
    auto split = RankGroup::load(dir, tp, pp);
    if (f.q.group_size > 32 && tp > 1) {  // o_proj's 32 inputs per rank: not a whole group
      ASSERT_FALSE(split);
      EXPECT_THAT(split.status().message(), HasSubstr("splits a quantization group"));
      continue;
    }
    ASSERT_TRUE(split) << f.name << " tp " << tp << " pp " << pp << ": "
                       << split.status().to_string();
    const Outputs r = run(**split, kPrompt, 8);
    if (f.tp_exact || tp == 1) {
      // Summation order only (partial sums all-reduced).
      EXPECT_LT(max_diff(r, quantized), 1e-4) << f.name << " tp " << tp << " pp " << pp;
      EXPECT_EQ(r.tokens, quantized.tokens) << f.name << " tp " << tp << " pp " << pp;
    } else {
      EXPECT_LT(max_diff(r, quantized, 1), 0.1 * max_abs(quantized))
          << f.name << " tp " << tp << " pp " << pp;
    }
  }
  one->reset();
  plain->reset();
  fs::remove_all(dir);
  fs::remove_all(twin);
}

INSTANTIATE_TEST_SUITE_P(Formats, QuantizedModelTest, ::testing::ValuesIn(formats()),
                         [](const auto& info) { return info.param.name; });

// Online FP8 (--quantization fp8 on a plain checkpoint) is the checkpoint's weights quantized
// per tensor at load: the same model as an FP8 checkpoint written from those weights by
// quantize_fp8 (per-tensor scales, dynamic activations), bit for bit.
TEST(QuantizedModelErrorsTest, OnlineFp8IsTheFp8OfThePlainWeights) {
  MakeModelOptions::Quantization none;
  const std::string plain_dir = make_quantized("online-plain", none);
  const std::string fp8_dir = plain_dir + "-fp8";
  {
    auto ckpt = Checkpoint::open(plain_dir);
    ASSERT_TRUE(ckpt);
    SafetensorsWriter writer;
    std::deque<std::vector<uint8_t>> keep;
    for (const std::string& name : (*ckpt)->names()) {
      TensorView t = *(*ckpt)->tensor(name);
      if (name.find(".layers.") != std::string::npos && name.ends_with("_proj.weight")) {
        Fp8Weight q = quantize_fp8(t);
        std::vector<uint8_t>& bytes = keep.emplace_back(std::move(q.data));
        std::vector<uint8_t>& scale = keep.emplace_back(4);
        std::memcpy(scale.data(), &q.scale, 4);
        ASSERT_TRUE(writer.add(name, DType::kF8E4M3, t.shape, bytes).is_ok());
        ASSERT_TRUE(writer.add(name.substr(0, name.size() - 7) + ".weight_scale", DType::kF32, {1},
                               scale)
                        .is_ok());
        continue;
      }
      ASSERT_TRUE(
          writer.add(name, t.dtype, t.shape, {static_cast<const uint8_t*>(t.data), t.bytes()})
              .is_ok());
    }
    fs::create_directories(fp8_dir);
    ASSERT_TRUE(writer.write(fp8_dir + "/model.safetensors").is_ok());
    nlohmann::json c = read_json(plain_dir + "/config.json");
    QuantConfig q;
    q.method = QuantMethod::kFp8;
    q.bits = 8;
    c["quantization_config"] = nlohmann::json::parse(quantization_config_json(q));
    write_json(fp8_dir + "/config.json", c);
    for (const char* f : {"tokenizer.json", "tokenizer_config.json", "generation_config.json"}) {
      fs::copy_file(fs::path(plain_dir) / f, fs::path(fp8_dir) / f);
    }
  }
  auto online = RankGroup::load(plain_dir, 1, 1, QuantMethod::kFp8);
  ASSERT_TRUE(online) << online.status().to_string();
  EXPECT_THAT((*online)->rank(0).info().quantization, HasSubstr("quantized at load"));
  auto exported = RankGroup::load(fp8_dir, 1, 1);
  ASSERT_TRUE(exported) << exported.status().to_string();
  const Outputs a = run(**online, kPrompt, 6), b = run(**exported, kPrompt, 6);
  EXPECT_EQ(max_diff(a, b), 0.0);
  EXPECT_EQ(a.tokens, b.tokens);
  // And it is not the plain model: the weights and activations were rounded.
  auto plain = RankGroup::load(plain_dir, 1, 1);
  ASSERT_TRUE(plain);
  EXPECT_GT(max_diff(run(**plain, kPrompt, 1), a, 1), 0.0);
  online->reset();
  exported->reset();
  plain->reset();
  fs::remove_all(plain_dir);
  fs::remove_all(fp8_dir);
}

// Against Hugging Face transformers: scripts/goldens/quant_goldens.py (run on the GPU machine)
// makes the same checkpoints, dequantizes them with its own Python reading of each format,
// runs transformers' LlamaForCausalLM in fp32 and records probe logits at every prompt position
// and greedy tokens (tests/assets/goldens/quant_<format>.json). The CPU backend must agree: the
// formats are read the same way by two implementations.
class QuantGoldenTest : public ::testing::TestWithParam<std::string> {};

TEST_P(QuantGoldenTest, LogitsAndGreedyTokensMatchTransformers) {
  std::ifstream in(source_dir() + "/tests/assets/goldens/quant_" + GetParam() + ".json");
  ASSERT_TRUE(in) << "missing golden for " << GetParam();
  const nlohmann::json g = nlohmann::json::parse(in);
  MakeModelOptions o;
  o.arch = "llama";
  o.preset = "tiny";
  o.tokenizer_dir = source_dir() + "/tests/assets/tokenizers/" + g["tokenizer"].get<std::string>();
  o.seed = g["seed"].get<uint64_t>();
  o.dtype = "bf16";
  o.overrides.intermediate_size = 192;
  o.overrides.num_layers = 3;
  const auto flags = g["flags"].get<std::vector<std::string>>();
  for (size_t i = 0; i < flags.size(); ++i) {
    const std::string& f = flags[i];
    auto next = [&] { return flags.at(++i); };
    if (f == "--quantization")
      o.quantization.method = next();
    else if (f == "--group-size")
      o.quantization.group_size = std::stoll(next());
    else if (f == "--bits")
      o.quantization.bits = std::stoi(next());
    else if (f == "--desc-act")
      o.quantization.desc_act = true;
    else if (f == "--asym")
      o.quantization.asym = true;
    else if (f == "--weight-scale")
      o.quantization.weight_scale = next();
    else if (f == "--activations")
      o.quantization.activations = next();
    else
      FAIL() << "unknown flag in the golden: " << f;
  }
  o.out = temp_dir("golden-" + GetParam());
  ASSERT_TRUE(make_model(o).is_ok());
  auto group = RankGroup::load(o.out, 1, 1);
  ASSERT_TRUE(group) << group.status().to_string();
  const auto probe = g["probe_ids"].get<std::vector<int64_t>>();
  double worst = 0;
  uint64_t request = 1;
  for (const auto& c : g["cases"]) {
    const auto ids = c["ids"].get<std::vector<int32_t>>();
    const int64_t n = static_cast<int64_t>(ids.size());
    const std::vector<uint32_t> blocks = {0, 1, 2, 3};
    std::vector<int32_t> tokens;
    for (int64_t pos = 0; pos < n; ++pos) {  // token by token: logits at every position
      auto out = (*group)->execute(seq_step(request, {ids[pos]}, pos, pos == 0, n,
                                            pos == 0 ? blocks : std::vector<uint32_t>{}));
      ASSERT_TRUE(out) << out.status().to_string();
      for (size_t k = 0; k < probe.size(); ++k) {
        const double diff = std::abs(out->logits[static_cast<size_t>(probe[k])] -
                                     c["probe_logits"][pos][k].get<double>());
        worst = std::max(worst, diff);
        ASSERT_LT(diff, 1e-4) << GetParam() << " position " << pos << " id " << probe[k];
      }
      if (pos == n - 1) tokens.push_back(out->outputs[0].sample.token);
    }
    const auto greedy = c["greedy"].get<std::vector<int32_t>>();
    while (tokens.size() < greedy.size()) {
      auto out = (*group)->execute(seq_step(
          request, {tokens.back()}, n + static_cast<int64_t>(tokens.size()) - 1, false, 0, {}));
      ASSERT_TRUE(out) << out.status().to_string();
      tokens.push_back(out->outputs[0].sample.token);
    }
    EXPECT_EQ(tokens, greedy) << GetParam() << ": " << c["prompt"];
    ASSERT_TRUE((*group)->execute(finish(request)));
    ++request;
  }
  std::printf("%s: max |logit diff| vs transformers = %.3g\n", GetParam().c_str(), worst);
  group->reset();
  fs::remove_all(o.out);
}

INSTANTIATE_TEST_SUITE_P(Formats, QuantGoldenTest,
                         ::testing::Values("awq", "gptq_desc_act_asym", "gptq_8bit",
                                           "fp8_channel"));

// The load error of `dir` on one CPU rank.
std::string load_error(const std::string& dir, QuantMethod flag = QuantMethod::kAuto) {
  EngineSpec engine;
  engine.model = dir;
  engine.max_model_len = 256;
  engine.quantization = flag;
  auto spec = load_spec_for_rank(engine, ParallelConfig{}, Device::kCpu);
  if (!spec) return spec.status().message();
  spec->threads = 1;
  auto runner = ModelRunner::load(*spec, StageComms{});
  return runner ? "" : runner.status().message();
}

TEST(QuantizedModelErrorsTest, BadCheckpointsAndFlagsNameWhatIsWrong) {
  MakeModelOptions::Quantization awq;
  awq.method = "awq";
  awq.group_size = 32;
  const std::string dir = make_quantized("errors", awq);
  const nlohmann::json config = read_json(dir + "/config.json");
  const std::string file = dir + "-bad";
  auto keep_all = [](const std::string&, const TensorView&, std::vector<uint8_t>&) {
    return true;
  };

  // The flag against the checkpoint.
  EXPECT_THAT(load_error(dir, QuantMethod::kGptq),
              HasSubstr("--quantization gptq contradicts the checkpoint, which is awq"));
  EXPECT_THAT(load_error(dir, QuantMethod::kNone), HasSubstr("--quantization none contradicts"));
  EXPECT_EQ(load_error(dir, QuantMethod::kAwq), "");

  // Read as plain: its quantized tensors are named.
  nlohmann::json plain = config;
  plain.erase("quantization_config");
  rewrite(dir, file + "1", plain, keep_all);
  EXPECT_THAT(load_error(file + "1"), HasSubstr("is a quantized tensor, but config.json's "
                                                "quantization_config is missing"));

  // A group size the tensors do not have: the shapes disagree, named with the file.
  nlohmann::json g64 = config;
  g64["quantization_config"]["group_size"] = 64;
  rewrite(dir, file + "2", g64, keep_all);
  const std::string shape = load_error(file + "2");
  EXPECT_THAT(shape, HasSubstr("model.layers.0.self_attn.q_proj.qzeros"));
  EXPECT_THAT(shape, HasSubstr("model.safetensors"));

  // 3 bits, an unsupported group size: config.json's field.
  nlohmann::json bits = config;
  bits["quantization_config"]["bits"] = 3;
  rewrite(dir, file + "3", bits, keep_all);
  EXPECT_THAT(load_error(file + "3"), HasSubstr("quantization_config.bits must be 4"));

  // Missing scales: the tensor and the directory.
  rewrite(dir, file + "4", config, [](const std::string& name, const TensorView&, auto&) {
    return name != "model.layers.1.mlp.up_proj.scales";
  });
  EXPECT_THAT(load_error(file + "4"), HasSubstr("model.layers.1.mlp.up_proj.scales"));

  // A qweight of the wrong dtype.
  rewrite(dir, file + "5", config, [](const std::string& name, TensorView& t, auto&) {
    if (name == "model.layers.2.mlp.down_proj.qweight") t.dtype = DType::kF32;
    return true;
  });
  EXPECT_THAT(load_error(file + "5"),
              HasSubstr("model.layers.2.mlp.down_proj.qweight in " + file + "5"));

  // GPTQ: a g_idx out of range.
  MakeModelOptions::Quantization gptq;
  gptq.method = "gptq";
  gptq.group_size = 32;
  gptq.desc_act = true;
  const std::string gdir = make_quantized("errors-gptq", gptq);
  rewrite(gdir, file + "6", read_json(gdir + "/config.json"),
          [](const std::string& name, const TensorView&, std::vector<uint8_t>& bytes) {
            if (name == "model.layers.0.self_attn.o_proj.g_idx") {
              const int32_t bad = 1000;
              std::memcpy(bytes.data() + 12, &bad, 4);
            }
            return true;
          });
  EXPECT_THAT(load_error(file + "6"),
              HasSubstr("model.layers.0.self_attn.o_proj.g_idx[3] is 1000, outside the 2 groups"));

  // FP8 without its scale.
  MakeModelOptions::Quantization fp8;
  fp8.method = "fp8";
  const std::string fdir = make_quantized("errors-fp8", fp8);
  rewrite(fdir, file + "7", read_json(fdir + "/config.json"),
          [](const std::string& name, const TensorView&, auto&) {
            return name != "model.layers.0.mlp.gate_proj.weight_scale";
          });
  EXPECT_THAT(load_error(file + "7"), HasSubstr("model.layers.0.mlp.gate_proj.weight_scale"));

  // A -tp that splits a group: the planner's refusal, with the sizes that work.
  EngineSpec engine;
  engine.model = dir;
  engine.max_model_len = 256;
  ParallelConfig tp4;
  tp4.tp_size = 4;
  auto spec = load_spec_for_rank(engine, tp4, Device::kCpu);
  if (spec) {
    auto runner = ModelRunner::load(*spec, StageComms{});
    ASSERT_FALSE(runner);
    EXPECT_THAT(runner.status().message(), HasSubstr("valid -tp values for this model: 1, 2"));
  } else {
    EXPECT_THAT(spec.status().message(), HasSubstr("valid -tp values for this model: 1, 2"));
  }

  for (const std::string& d : {dir, gdir, fdir}) fs::remove_all(d);
  for (int i = 1; i <= 7; ++i) fs::remove_all(file + std::to_string(i));
}

}  // namespace
}  // namespace tessera
