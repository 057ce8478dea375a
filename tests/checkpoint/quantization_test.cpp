// Quantized checkpoint formats (common/checkpoint/quantization.h): the packings bit for bit as
// AutoAWQ and GPTQ lay them out, quantization_config as the exporters write it, the flag against
// the checkpoint, dequantization (the CPU oracle) and its errors, FP8 rounding.
#include "common/checkpoint/quantization.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>

namespace tessera {
namespace {

using ::testing::HasSubstr;

std::vector<uint8_t> random_ints(size_t n, int bits, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint8_t> v(n);
  for (auto& x : v) x = static_cast<uint8_t>(rng() & ((1u << bits) - 1));
  return v;
}

std::vector<float> random_weights(int64_t out, int64_t in, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.f, 0.05f);
  std::vector<float> w(static_cast<size_t>(out * in));
  for (float& x : w) x = normal(rng);
  return w;
}

// ---- packing -------------------------------------------------------------------------------

TEST(QuantPackingTest, AwqNibbleOrderIsAutoAwqs) {
  // Output column j holds value j: AutoAWQ puts column order[i] in nibble i, order 0 2 4 6 1 3 5 7.
  std::vector<uint8_t> q = {0, 1, 2, 3, 4, 5, 6, 7};
  std::vector<int32_t> packed = pack_awq(q, 1, 8);
  ASSERT_EQ(packed.size(), 1u);
  EXPECT_EQ(static_cast<uint32_t>(packed[0]), 0x75316420u);
  EXPECT_EQ(unpack_awq(packed, 1, 8), q);
}

TEST(QuantPackingTest, GptqPacksInputRowsInOrder) {
  // Rows 0..7 of one column hold 1..8: row i goes to bits 4i..4i+3.
  std::vector<uint8_t> q = {1, 2, 3, 4, 5, 6, 7, 8};
  std::vector<int32_t> packed = pack_rows(q, 8, 1, 4);
  ASSERT_EQ(packed.size(), 1u);
  EXPECT_EQ(static_cast<uint32_t>(packed[0]), 0x87654321u);
  // 8-bit: four rows per int32.
  std::vector<uint8_t> q8 = {0x11, 0x22, 0x33, 0xf4};
  EXPECT_EQ(static_cast<uint32_t>(pack_rows(q8, 4, 1, 8)[0]), 0xf4332211u);
  // GPTQ's qzeros pack along the columns.
  EXPECT_EQ(static_cast<uint32_t>(pack_cols(q, 1, 8, 4)[0]), 0x87654321u);
}

TEST(QuantPackingTest, RoundTripsEveryPacking) {
  const int64_t rows = 64, cols = 48;
  for (int bits : {4, 8}) {
    const auto q = random_ints(rows * cols, bits, 7 + bits);
    EXPECT_EQ(unpack_rows(pack_rows(q, rows, cols, bits), rows, cols, bits), q) << bits;
    EXPECT_EQ(unpack_cols(pack_cols(q, rows, cols, bits), rows, cols, bits), q) << bits;
  }
  const auto q4 = random_ints(rows * cols, 4, 3);
  EXPECT_EQ(unpack_awq(pack_awq(q4, rows, cols), rows, cols), q4);
}

// ---- quantization_config -------------------------------------------------------------------

TEST(QuantConfigTest, ReadsAutoAwqGptqAndFp8Exports) {
  // As AutoAWQ 0.2 writes it (e.g. Qwen/Qwen2.5-72B-Instruct-AWQ).
  auto awq = parse_quantization_config(
      R"({"bits": 4, "group_size": 128, "modules_to_not_convert": null, "quant_method": "awq",
          "version": "gemm", "zero_point": true})",
      "config.json");
  ASSERT_TRUE(awq) << awq.status().to_string();
  EXPECT_EQ(awq->method, QuantMethod::kAwq);
  EXPECT_EQ(awq->bits, 4);
  EXPECT_EQ(awq->group_size, 128);
  // AutoGPTQ / GPTQModel.
  auto gptq = parse_quantization_config(
      R"({"bits": 8, "group_size": -1, "damp_percent": 0.01, "desc_act": true, "sym": false,
          "true_sequential": true, "quant_method": "gptq", "checkpoint_format": "gptq"})",
      "config.json");
  ASSERT_TRUE(gptq) << gptq.status().to_string();
  EXPECT_EQ(gptq->method, QuantMethod::kGptq);
  EXPECT_EQ(gptq->bits, 8);
  EXPECT_EQ(gptq->group_size, 0);  // one group
  EXPECT_TRUE(gptq->desc_act);
  EXPECT_FALSE(gptq->sym);
  EXPECT_TRUE(gptq->zero_offset);
  EXPECT_EQ(gptq->pack_factor(), 4);
  EXPECT_EQ(gptq->group(4096), 4096);
  // vLLM / AutoFP8.
  auto fp8 = parse_quantization_config(
      R"({"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": ["lm_head"]})",
      "config.json");
  ASSERT_TRUE(fp8) << fp8.status().to_string();
  EXPECT_EQ(fp8->method, QuantMethod::kFp8);
  EXPECT_EQ(fp8->activations, Fp8Activations::kStatic);
  EXPECT_EQ(fp8->weight_scale, Fp8Scale::kTensor);
  // llm-compressor's FP8-dynamic (e.g. neuralmagic/Meta-Llama-3.1-8B-Instruct-FP8-dynamic).
  auto ct = parse_quantization_config(R"({
      "quant_method": "compressed-tensors", "format": "float-quantized",
      "config_groups": {"group_0": {
        "targets": ["Linear"],
        "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": true,
                    "dynamic": false},
        "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                              "symmetric": true, "dynamic": true}}},
      "ignore": ["lm_head"], "quantization_status": "compressed"})",
                                      "config.json");
  ASSERT_TRUE(ct) << ct.status().to_string();
  EXPECT_EQ(ct->method, QuantMethod::kFp8);
  EXPECT_EQ(ct->weight_scale, Fp8Scale::kChannel);
  EXPECT_EQ(ct->activations, Fp8Activations::kDynamic);
  EXPECT_FALSE(ct->quantizes("lm_head"));
  EXPECT_TRUE(ct->quantizes("model.layers.0.mlp.down_proj"));
}

TEST(QuantConfigTest, RefusesWhatItCannotReadNamingTheField) {
  struct Case {
    const char* json;
    const char* says;
  };
  const Case cases[] = {
      {R"({"quant_method": "awq", "version": "gemv", "bits": 4, "group_size": 128})",
       "quantization_config.version \"gemv\""},
      {R"({"quant_method": "awq", "bits": 3, "group_size": 128})", "bits must be 4"},
      {R"({"quant_method": "awq", "bits": 4, "group_size": 256})", "group_size must be 32"},
      {R"({"quant_method": "awq", "bits": 4, "zero_point": false})", "zero_point"},
      {R"({"quant_method": "gptq", "bits": 3, "group_size": 128})", "bits must be 4 or 8"},
      {R"({"quant_method": "gptq", "bits": 4, "group_size": 128, "lm_head": true})",
       "quantized lm_head"},
      {R"({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"})",
       "checkpoint_format"},
      {R"({"quant_method": "fp8", "weight_block_size": [128, 128]})", "block-wise"},
      {R"({"quant_method": "fp8", "activation_scheme": "sometimes"})", "activation_scheme"},
      {R"({"quant_method": "bitsandbytes"})", "\"bitsandbytes\" is not supported"},
      {R"({"bits": 4})", "quant_method is missing"},
      {R"({"quant_method": "compressed-tensors", "format": "pack-quantized",
           "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int"}}}})",
       "format"},
      {R"({"quant_method": "compressed-tensors", "format": "float-quantized",
           "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int"}}}})",
       "only 8-bit float"},
      {R"({"quant_method": "awq", "bits": 4, "group_size": 128,
           "modules_to_not_convert": ["re:(unclosed"]})",
       "not a regular expression"},
  };
  for (const Case& c : cases) {
    auto q = parse_quantization_config(c.json, "m/config.json");
    ASSERT_FALSE(q) << c.json;
    EXPECT_THAT(q.status().message(), HasSubstr(c.says)) << c.json;
    EXPECT_THAT(q.status().message(), HasSubstr("m/config.json")) << c.json;
  }
}

TEST(QuantConfigTest, WritesWhatItReads) {
  std::vector<QuantConfig> configs;
  QuantConfig awq;
  awq.method = QuantMethod::kAwq;
  awq.bits = 4;
  awq.group_size = 64;
  configs.push_back(awq);
  QuantConfig gptq;
  gptq.method = QuantMethod::kGptq;
  gptq.bits = 8;
  gptq.group_size = 32;
  gptq.desc_act = true;
  gptq.sym = false;
  configs.push_back(gptq);
  for (auto scale : {Fp8Scale::kTensor, Fp8Scale::kChannel}) {
    for (auto act : {Fp8Activations::kDynamic, Fp8Activations::kStatic, Fp8Activations::kNone}) {
      QuantConfig fp8;
      fp8.method = QuantMethod::kFp8;
      fp8.bits = 8;
      fp8.weight_scale = scale;
      fp8.activations = act;
      fp8.ignored = {"lm_head"};
      configs.push_back(fp8);
    }
  }
  for (const QuantConfig& q : configs) {
    auto back = parse_quantization_config(quantization_config_json(q), "written");
    ASSERT_TRUE(back) << back.status().to_string() << " " << quantization_config_json(q);
    QuantConfig expect = q;
    if (expect.method == QuantMethod::kFp8 && expect.ignored.empty()) expect.ignored = {"lm_head"};
    EXPECT_EQ(*back, expect) << quantization_config_json(q);
  }
}

TEST(QuantConfigTest, TheFlagAgreesWithTheCheckpointOrSaysWhy) {
  QuantConfig plain;
  QuantConfig awq;
  awq.method = QuantMethod::kAwq;
  awq.bits = 4;
  awq.group_size = 128;
  EXPECT_EQ(resolve_quantization(QuantMethod::kAuto, awq)->method, QuantMethod::kAwq);
  EXPECT_EQ(resolve_quantization(QuantMethod::kAwq, awq)->method, QuantMethod::kAwq);
  EXPECT_EQ(*parse_quant_method("awq_marlin"), QuantMethod::kAwq);
  EXPECT_EQ(*parse_quant_method("gptq_marlin"), QuantMethod::kGptq);
  EXPECT_EQ(resolve_quantization(QuantMethod::kAuto, plain)->method, QuantMethod::kNone);
  auto online = resolve_quantization(QuantMethod::kFp8, plain);
  ASSERT_TRUE(online);
  EXPECT_EQ(online->method, QuantMethod::kFp8);
  EXPECT_TRUE(online->online);

  auto gptq_on_awq = resolve_quantization(QuantMethod::kGptq, awq);
  ASSERT_FALSE(gptq_on_awq);
  EXPECT_THAT(gptq_on_awq.status().message(), HasSubstr("--quantization gptq contradicts"));
  EXPECT_THAT(gptq_on_awq.status().message(), HasSubstr("awq (4-bit, group 128)"));
  auto none_on_awq = resolve_quantization(QuantMethod::kNone, awq);
  ASSERT_FALSE(none_on_awq);
  EXPECT_THAT(none_on_awq.status().message(), HasSubstr("--quantization none contradicts"));
  auto awq_on_plain = resolve_quantization(QuantMethod::kAwq, plain);
  ASSERT_FALSE(awq_on_plain);
  EXPECT_THAT(awq_on_plain.status().message(), HasSubstr("no quantization_config"));
  EXPECT_FALSE(parse_quant_method("int4"));
  EXPECT_THAT(parse_quant_method("int4").status().message(), HasSubstr("awq, awq_marlin"));
}

TEST(QuantConfigTest, IgnoredModulesByNameSuffixOrPattern) {
  QuantConfig q;
  q.method = QuantMethod::kFp8;
  q.ignored = {"lm_head", "model.layers.1.mlp.down_proj", "re:.*self_attn\\.o_proj$"};
  EXPECT_FALSE(q.quantizes("lm_head"));
  EXPECT_FALSE(q.quantizes("model.layers.1.mlp.down_proj"));
  EXPECT_TRUE(q.quantizes("model.layers.0.mlp.down_proj"));
  EXPECT_FALSE(q.quantizes("model.layers.5.self_attn.o_proj"));
  EXPECT_TRUE(q.quantizes("model.layers.5.self_attn.q_proj"));
  // AWQ's modules_to_not_convert names a module's last part ("down_proj").
  q.ignored = {"down_proj"};
  EXPECT_FALSE(q.quantizes("model.layers.3.mlp.down_proj"));
  EXPECT_TRUE(q.quantizes("model.layers.3.mlp.up_proj"));
}

// ---- dequantization ------------------------------------------------------------------------

// A linear layer's tensors as views over `parts`.
LinearWeight view_of(const std::vector<QuantizedPart>& parts, QuantMethod method) {
  LinearWeight w;
  w.method = method;
  for (const QuantizedPart& p : parts) {
    TensorView v{p.bytes.data(), p.dtype, p.shape};
    if (p.suffix == "qweight") w.qweight = v;
    if (p.suffix == "qzeros") w.qzeros = v;
    if (p.suffix == "scales") w.scales = v;
    if (p.suffix == "g_idx") w.g_idx = v;
    if (p.suffix == "weight") w.weight = v;
    if (p.suffix == "weight_scale") w.weight_scale = v;
    if (p.suffix == "input_scale") w.input_scale = v;
  }
  return w;
}

TEST(QuantDequantizeTest, AwqIsZeroPointAndScaleOfTheUnpackedInts) {
  // Built by hand: two groups of 4 inputs, 8 outputs.
  QuantConfig q;
  q.method = QuantMethod::kAwq;
  q.bits = 4;
  q.group_size = 4;
  const int64_t in = 8, out = 8, groups = 2;
  const auto ints = random_ints(in * out, 4, 11);   // [in, out]
  const auto zeros = random_ints(groups * out, 4, 12);  // [groups, out]
  std::vector<uint16_t> scales(groups * out);
  for (size_t k = 0; k < scales.size(); ++k) scales[k] = float_to_f16(0.01f * (1 + k));
  const auto qweight = pack_awq(ints, in, out), qzeros = pack_awq(zeros, groups, out);
  LinearWeight w;
  w.method = QuantMethod::kAwq;
  w.qweight = {qweight.data(), DType::kI32, {in, out / 8}};
  w.qzeros = {qzeros.data(), DType::kI32, {groups, out / 8}};
  w.scales = {scales.data(), DType::kF16, {groups, out}};
  auto deq = dequantize(w, q, "l");
  ASSERT_TRUE(deq) << deq.status().to_string();
  for (int64_t o = 0; o < out; ++o) {
    for (int64_t i = 0; i < in; ++i) {
      const int64_t g = i / 4;
      const float want = (static_cast<int>(ints[i * out + o]) - zeros[g * out + o]) *
                         f16_to_float(scales[g * out + o]);
      EXPECT_EQ((*deq)[o * in + i], want) << o << "," << i;
    }
  }
}

TEST(QuantDequantizeTest, GptqAddsOneToTheStoredZeroAndReadsGIdx) {
  QuantConfig q;
  q.method = QuantMethod::kGptq;
  q.bits = 4;
  q.group_size = 4;
  q.desc_act = true;
  const int64_t in = 8, out = 8, groups = 2;
  const auto ints = random_ints(in * out, 4, 21);
  auto zeros = random_ints(groups * out, 4, 22);
  for (auto& z : zeros) z = static_cast<uint8_t>(z % 15);  // stored zero - 1
  std::vector<int32_t> g_idx = {1, 0, 1, 0, 0, 1, 1, 0};
  std::vector<uint16_t> scales(groups * out);
  for (size_t k = 0; k < scales.size(); ++k) scales[k] = float_to_f16(0.02f * (1 + k));
  const auto qweight = pack_rows(ints, in, out, 4), qzeros = pack_cols(zeros, groups, out, 4);
  LinearWeight w;
  w.method = QuantMethod::kGptq;
  w.qweight = {qweight.data(), DType::kI32, {in / 8, out}};
  w.qzeros = {qzeros.data(), DType::kI32, {groups, out / 8}};
  w.scales = {scales.data(), DType::kF16, {groups, out}};
  w.g_idx = {g_idx.data(), DType::kI32, {in}};
  auto deq = dequantize(w, q, "l");
  ASSERT_TRUE(deq) << deq.status().to_string();
  for (int64_t o = 0; o < out; ++o) {
    for (int64_t i = 0; i < in; ++i) {
      const int64_t g = g_idx[i];
      const float want = (static_cast<int>(ints[i * out + o]) - (zeros[g * out + o] + 1)) *
                         f16_to_float(scales[g * out + o]);
      EXPECT_EQ((*deq)[o * in + i], want) << o << "," << i;
    }
  }
  q.zero_offset = false;  // gptq_v2 stores the zero itself
  auto v2 = dequantize(w, q, "l");
  ASSERT_TRUE(v2);
  EXPECT_EQ((*v2)[0], (static_cast<int>(ints[0]) - zeros[g_idx[0] * out]) *
                          f16_to_float(scales[g_idx[0] * out]));
}

// Every format's writer and reader agree: dequantized, a quantized layer is within half a
// quantization step of the weights it was made from.
TEST(QuantDequantizeTest, QuantizedLayersComeBackWithinHalfAStep) {
  const int64_t out = 320, in = 256;  // more than 256 outputs: the loops run on every core
  const auto w = random_weights(out, in, 5);
  std::vector<QuantConfig> configs;
  for (int64_t group : {32, 64, 128}) {
    QuantConfig awq;
    awq.method = QuantMethod::kAwq;
    awq.bits = 4;
    awq.group_size = group;
    configs.push_back(awq);
  }
  for (int bits : {4, 8}) {
    for (bool desc_act : {false, true}) {
      for (bool sym : {false, true}) {
        QuantConfig gptq;
        gptq.method = QuantMethod::kGptq;
        gptq.bits = bits;
        gptq.group_size = 64;
        gptq.desc_act = desc_act;
        gptq.sym = sym;
        configs.push_back(gptq);
      }
    }
  }
  QuantConfig one_group;
  one_group.method = QuantMethod::kGptq;
  one_group.bits = 4;
  configs.push_back(one_group);
  for (auto scale : {Fp8Scale::kTensor, Fp8Scale::kChannel}) {
    QuantConfig fp8;
    fp8.method = QuantMethod::kFp8;
    fp8.bits = 8;
    fp8.weight_scale = scale;
    configs.push_back(fp8);
  }
  for (const QuantConfig& q : configs) {
    const auto parts = quantize_linear(w, out, in, q, 99);
    auto deq = dequantize(view_of(parts, q.method), q, "l");
    ASSERT_TRUE(deq) << q.describe() << ": " << deq.status().to_string();
    ASSERT_EQ(deq->size(), w.size());
    double worst = 0, max_w = 0;
    for (size_t k = 0; k < w.size(); ++k) {
      worst = std::max(worst, std::abs(static_cast<double>((*deq)[k]) - w[k]));
      max_w = std::max(max_w, std::abs(static_cast<double>(w[k])));
    }
    // int4 steps are at most 2 max / 15 wide, int8 2 max / 255; FP8 keeps 3 mantissa bits.
    // (The scales are F16, a step up to 2^-11 wider.)
    const double step =
        q.method == QuantMethod::kFp8 ? max_w / 8 : 2 * max_w / ((1 << q.bits) - 1) * 1.001;
    EXPECT_LE(worst, step / 2) << q.describe();
    EXPECT_GT(worst, 0) << q.describe() << " should lose something";
  }
}

TEST(QuantDequantizeTest, BadTensorsAreErrorsNamingThem) {
  QuantConfig q;
  q.method = QuantMethod::kGptq;
  q.bits = 4;
  q.group_size = 32;
  const int64_t out = 16, in = 64;
  const auto w = random_weights(out, in, 8);
  auto parts = quantize_linear(w, out, in, q, 1);
  const std::string name = "model.layers.0.mlp.up_proj";

  LinearWeight ok = view_of(parts, q.method);
  ASSERT_TRUE(dequantize(ok, q, name));

  LinearWeight no_scales = ok;
  no_scales.scales = {};
  auto e1 = dequantize(no_scales, q, name);
  ASSERT_FALSE(e1);
  EXPECT_THAT(e1.status().message(), HasSubstr(name + ".scales is missing"));

  LinearWeight bad_zeros = ok;
  bad_zeros.qzeros.shape = {1, out / 8};
  auto e2 = dequantize(bad_zeros, q, name);
  ASSERT_FALSE(e2);
  EXPECT_THAT(e2.status().message(), HasSubstr(name + ".qzeros is [1, 2] I32"));

  for (QuantizedPart& p : parts) {
    if (p.suffix == "g_idx") {
      const int32_t big = 7;
      std::memcpy(p.bytes.data() + 4 * 10, &big, 4);
    }
  }
  auto e3 = dequantize(view_of(parts, q.method), q, name);
  ASSERT_FALSE(e3);
  EXPECT_THAT(e3.status().message(), HasSubstr(name + ".g_idx[10] is 7, outside the 2 groups"));

  QuantConfig f;
  f.method = QuantMethod::kFp8;
  f.bits = 8;
  auto fp8 = view_of(quantize_linear(w, out, in, f, 1), QuantMethod::kFp8);
  LinearWeight no_scale = fp8;
  no_scale.weight_scale = {};
  auto e4 = dequantize(no_scale, f, name);
  ASSERT_FALSE(e4);
  EXPECT_THAT(e4.status().message(), HasSubstr(name + ".weight_scale is missing"));
  const float zero = 0.f;
  LinearWeight zero_scale = fp8;
  zero_scale.weight_scale = {&zero, DType::kF32, {1}};
  EXPECT_FALSE(dequantize(zero_scale, f, name));

  EXPECT_THAT(check_linear_shape(q, 20, 64, name).message(), HasSubstr("multiples of 8"));
  EXPECT_THAT(check_linear_shape(q, 16, 48, name).message(), HasSubstr("groups of 32"));
  EXPECT_TRUE(check_linear_shape(q, 16, 64, name).is_ok());
}

TEST(QuantFp8Test, OnlineQuantizationAndActivationRounding) {
  const auto w = random_weights(8, 16, 4);
  TensorView view{w.data(), DType::kF32, {8, 16}};
  Fp8Weight q = quantize_fp8(view);
  float amax = 0;
  for (float x : w) amax = std::max(amax, std::abs(x));
  EXPECT_FLOAT_EQ(q.scale, amax / 448.f);
  // The largest weight lands on E4M3's largest value.
  bool saw_max = false;
  for (uint8_t b : q.data) saw_max |= std::abs(fp8_e4m3_to_float(b)) == 448.f;
  EXPECT_TRUE(saw_max);

  // Per token: each row's largest magnitude maps to 448, every value to an E4M3 multiple.
  std::vector<float> x = {1.f, -0.3f, 0.01f, 2.f, 100.f, 3.f, -7.f, 0.5f};
  std::vector<float> y = x;
  fake_quantize_fp8_activations(y, 2, 4, 0.f);
  EXPECT_FLOAT_EQ(y[3], 2.f);    // the first row's max
  EXPECT_FLOAT_EQ(y[4], 100.f);  // the second's
  for (int r = 0; r < 2; ++r) {
    float a = 0;
    for (int c = 0; c < 4; ++c) a = std::max(a, std::abs(x[r * 4 + c]));
    for (int c = 0; c < 4; ++c) {
      // Within half an E4M3 step of the row's scale a / 448: 1/16 relative, or a subnormal's.
      EXPECT_NEAR(y[r * 4 + c], x[r * 4 + c], std::abs(x[r * 4 + c]) / 16 + a / 448.f / 512)
          << r << "," << c;
    }
  }
  // Per token: 0.01 keeps 3 significant bits under its own row's scale (max 2), whatever the
  // other row holds.
  EXPECT_NEAR(y[2], 0.01f, 0.01f / 16);
  // Static: one scale for every token; values past 448 scales saturate.
  std::vector<float> s = {1.f, 1000.f};
  fake_quantize_fp8_activations(s, 1, 2, 1.f);
  EXPECT_EQ(s[0], 1.f);
  EXPECT_EQ(s[1], 448.f);
}

TEST(QuantFp8Test, FusedLayersShareTheLargestStaticInputScale) {
  const float a = 0.5f, b = 2.f;
  LinearWeight q, k, v;
  q.input_scale = {&a, DType::kF32, {1}};
  k.input_scale = {&b, DType::kF32, {}};
  EXPECT_EQ(shared_input_scale({&q, &k, &v}), 2.f);
  EXPECT_EQ(shared_input_scale({&q}), 0.5f);
  EXPECT_EQ(shared_input_scale({&v}), 0.f) << "no scale: dynamic";
}

}  // namespace
}  // namespace tessera
