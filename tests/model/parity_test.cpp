// Parity of the CPU backend with Hugging Face transformers.
//
// The goldens (tests/assets/goldens/model_<arch>.json) come from scripts/goldens/model_goldens.py
// run on the GPU machine: transformers 5.17 / torch 2.11 load the tiny checkpoint that
// `tessera make-model --preset tiny --seed 1234 --dtype bf16` writes, in float32, and record the
// logits at every prompt position for a fixed set of vocabulary ids, each position's argmax,
// and 32 greedy tokens. Here the same checkpoint is made again from the same seed and run through
// the CPU backend: prefill (one chunk), token-by-token decode through the paged cache, and
// greedy generation.
//
// Tolerance: both sides compute in fp32 from the same bf16 weights, differing only in summation
// order (dot products of at most 176 terms, 4 layers). Rounding accounts for ~1e-6 on these
// logits (|logit| < 1); 1e-4 absolute leaves room for the order differences of softmax and
// norms while staying far below the gaps between top tokens that greedy decoding depends on.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "actors/model/model_runner.h"
#include "common/tokenizer/tokenizer.h"
#include "driver/make_model/make_model.h"

namespace tessera {
namespace {

constexpr double kTolerance = 1e-4;

std::string source_dir() { return TESSERA_SOURCE_DIR; }

struct Golden {
  nlohmann::json j;
  std::string model_dir;
};

Golden make(const std::string& arch) {
  Golden g;
  std::ifstream in(source_dir() + "/tests/assets/goldens/model_" + arch + ".json");
  EXPECT_TRUE(in) << "missing golden for " << arch;
  g.j = nlohmann::json::parse(in);
  std::string tok_dir =
      source_dir() + "/tests/assets/tokenizers/" + g.j["tokenizer"].get<std::string>();
  EXPECT_TRUE(std::filesystem::exists(tok_dir + "/tokenizer.json"))
      << tok_dir << " is missing: run scripts/fetch-test-assets";
  g.model_dir = std::filesystem::temp_directory_path() /
                ("tessera-parity-" + arch + "-" + std::to_string(::getpid()));
  std::filesystem::remove_all(g.model_dir);
  MakeModelOptions o;
  o.arch = arch;
  o.preset = "tiny";
  o.tokenizer_dir = tok_dir;
  o.seed = g.j["seed"].get<uint64_t>();
  o.dtype = "bf16";
  o.out = g.model_dir;
  Status st = make_model(o);
  EXPECT_TRUE(st.is_ok()) << st.to_string();
  return g;
}

class ParityTest : public ::testing::TestWithParam<std::string> {};

TEST_P(ParityTest, LogitsAndGreedyTokensMatchTransformers) {
  const std::string arch = GetParam();
  Golden g = make(arch);
  auto tokenizer = Tokenizer::load(g.model_dir);
  ASSERT_TRUE(tokenizer) << tokenizer.status().to_string();
  RunnerLoadSpec spec;
  spec.model_dir = g.model_dir;
  spec.device = "cpu";  // the fp32 oracle, on any machine
  spec.max_model_len = 256;
  spec.kv_blocks = 64;
  spec.return_logits = true;
  auto runner = ModelRunner::load(spec);
  ASSERT_TRUE(runner) << runner.status().to_string();
  const int64_t vocab = (*runner)->config().vocab_size;
  std::vector<int64_t> probe = g.j["probe_ids"].get<std::vector<int64_t>>();

  double worst = 0.0;
  uint64_t request = 1;
  for (const auto& c : g.j["cases"]) {
    std::vector<int32_t> ids = c["ids"].get<std::vector<int32_t>>();
    // The tokenizer agrees with Hugging Face on the prompt.
    EXPECT_EQ((*tokenizer)->encode(c["prompt"].get<std::string>(), true), ids) << c["prompt"];
    std::vector<uint32_t> blocks;
    for (uint32_t b = 0; b < (ids.size() + 32 + 15) / 16; ++b) blocks.push_back(b);

    // Decode path: one token per step, logits at every position.
    cpu::SamplingParams greedy;
    greedy.temperature = 0.0f;
    for (size_t pos = 0; pos < ids.size(); ++pos) {
      RunnerSeq s;
      s.request_id = request;
      s.tokens = {ids[pos]};
      s.start_position = static_cast<int64_t>(pos);
      s.block_table = blocks;
      s.sample = true;
      s.first = pos == 0;
      s.prompt = ids;
      s.sampling = greedy;
      std::vector<float> logits;
      auto out = (*runner)->execute({s}, {}, &logits);
      ASSERT_TRUE(out) << out.status().to_string();
      ASSERT_EQ(static_cast<int64_t>(logits.size()), vocab);
      const auto& expected = c["probe_logits"][pos];
      for (size_t k = 0; k < probe.size(); ++k) {
        double diff = std::abs(logits[static_cast<size_t>(probe[k])] - expected[k].get<double>());
        worst = std::max(worst, diff);
        ASSERT_LT(diff, kTolerance) << arch << " position " << pos << " id " << probe[k];
      }
      int64_t argmax = std::max_element(logits.begin(), logits.end()) - logits.begin();
      EXPECT_EQ(argmax, c["argmax"][pos].get<int64_t>()) << arch << " position " << pos;
    }
    EXPECT_TRUE((*runner)->execute({}, {request}, nullptr)) << "forgetting a finished request";
    ++request;

    // Prefill in one chunk, then 32 greedy tokens through the paged cache.
    RunnerSeq s;
    s.request_id = request;
    s.tokens = ids;
    s.block_table = blocks;
    s.sample = true;
    s.first = true;
    s.prompt = ids;
    s.sampling = greedy;
    std::vector<int32_t> generated;
    std::vector<float> logits;
    auto out = (*runner)->execute({s}, {}, &logits);
    ASSERT_TRUE(out) << out.status().to_string();
    const auto& last = c["probe_logits"][ids.size() - 1];
    for (size_t k = 0; k < probe.size(); ++k) {
      double diff = std::abs(logits[static_cast<size_t>(probe[k])] - last[k].get<double>());
      worst = std::max(worst, diff);
      ASSERT_LT(diff, kTolerance) << arch << " prefill, id " << probe[k];
    }
    generated.push_back((*out)[0].result.token);
    for (int step = 1; step < 32; ++step) {
      RunnerSeq d;
      d.request_id = request;
      d.tokens = {generated.back()};
      d.start_position = static_cast<int64_t>(ids.size() + generated.size() - 1);
      d.block_table = blocks;
      d.sample = true;
      auto o = (*runner)->execute({d}, {}, nullptr);
      ASSERT_TRUE(o) << o.status().to_string();
      generated.push_back((*o)[0].result.token);
    }
    EXPECT_EQ(generated, c["greedy"].get<std::vector<int32_t>>()) << arch << ": " << c["prompt"];
    EXPECT_TRUE((*runner)->execute({}, {request}, nullptr)) << "forgetting a finished request";
    ++request;
  }
  std::printf("%s: max |logit diff| vs transformers = %.3g (tolerance %.0e)\n", arch.c_str(), worst,
              kTolerance);
  std::filesystem::remove_all(g.model_dir);
}

INSTANTIATE_TEST_SUITE_P(Architectures, ParityTest,
                         ::testing::Values("llama", "mistral", "qwen2", "qwen3"));

}  // namespace
}  // namespace tessera

namespace tessera {
namespace {

// A config that disagrees with the checkpoint fails at load, naming the tensor and the file.
TEST(WeightBindingTest, MismatchesNameTensorAndFile) {
  Golden g = make("llama");
  auto edit = [&](const char* key, int value) {
    std::ifstream in(g.model_dir + "/config.json");
    auto config = nlohmann::json::parse(in);
    in.close();
    config[key] = value;
    std::ofstream(g.model_dir + "/config.json") << config.dump(2);
  };
  auto load = [&]() {
    RunnerLoadSpec spec;
    spec.model_dir = g.model_dir;
    spec.device = "cpu";
    spec.device = "cpu";  // the fp32 oracle, on any machine
    spec.max_model_len = 64;
    return ModelRunner::load(spec);
  };
  edit("intermediate_size", 200);  // wrong shapes
  auto wrong_shape = load();
  ASSERT_FALSE(wrong_shape);
  EXPECT_NE(wrong_shape.status().message().find("model.layers.0.mlp.gate_proj.weight"),
            std::string::npos)
      << wrong_shape.status().message();
  EXPECT_NE(wrong_shape.status().message().find("model.safetensors"), std::string::npos);
  edit("intermediate_size", 176);
  edit("num_hidden_layers", 5);  // a tensor that is not there
  auto missing = load();
  ASSERT_FALSE(missing);
  EXPECT_NE(missing.status().message().find("model.layers.4."), std::string::npos)
      << missing.status().message();
  edit("num_hidden_layers", 3);  // tensors nobody uses
  auto unused = load();
  ASSERT_FALSE(unused);
  EXPECT_NE(unused.status().message().find("model.layers.3."), std::string::npos)
      << unused.status().message();
  edit("num_hidden_layers", 4);
  EXPECT_TRUE(load()) << "the restored config loads again";
  std::filesystem::remove_all(g.model_dir);
}

}  // namespace
}  // namespace tessera
