// Parity of the CPU backend with Hugging Face transformers, on one rank and split over ranks.
//
// The goldens (tests/assets/goldens/model_<arch>.json) come from scripts/goldens/model_goldens.py
// run on the GPU machine: transformers 5.17 / torch 2.11 load the tiny checkpoint that
// `tessera make-model --preset tiny --seed 1234 --dtype bf16` writes, in float32, and record the
// logits at every prompt position for a fixed set of vocabulary ids, each position's argmax,
// and 32 greedy tokens. Here the same checkpoint is made again from the same seed and run through
// the CPU backend: prefill (one chunk), token-by-token decode through the paged cache, and
// greedy generation — on one rank, and split tensor-parallel (2 and 4 ranks: 4 is more ranks
// than the tiny models' 2 KV heads, so pairs of ranks share a KV head), pipeline-parallel (2
// stages) and both (2 x 2). The ranks are threads of this process joined by the tcp collectives
// the actors use (actors/comm/rank_comms.h); every rank runs every step, as in the actors.
//
// Tolerance: every side computes in fp32 from the same bf16 weights, differing only in summation
// order (dot products of at most 176 terms, 4 layers; a tensor-parallel split sums partial
// products of 64/T or 176/T terms, then the group's all-reduce). Rounding accounts for ~1e-6 on
// these logits (|logit| < 1); 1e-4 absolute leaves room for the order differences of softmax
// and norms while staying far below the gaps between top tokens that greedy decoding depends on.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <thread>

#include "actors/model/model_runner.h"
#include "common/tokenizer/tokenizer.h"
#include "driver/make_model/make_model.h"
#include "tests/model/rank_group.h"

namespace tessera {
namespace {

constexpr double kTolerance = 1e-4;

std::string source_dir() { return TESSERA_SOURCE_DIR; }

struct Golden {
  nlohmann::json j;
  std::string model_dir;
};

Golden make(const std::string& arch, const std::string& tag = "") {
  Golden g;
  const std::string path = source_dir() + "/tests/assets/goldens/model_" + arch + ".json";
  std::ifstream in(path);
  if (!in) {
    // Never skipped: a missing golden is a failure that says how to make it.
    ADD_FAILURE() << "missing golden " << path << " for " << arch
                  << ": make it on the GPU machine with scripts/goldens/model_goldens.py";
    return g;
  }
  g.j = nlohmann::json::parse(in);
  std::string tok_dir =
      source_dir() + "/tests/assets/tokenizers/" + g.j["tokenizer"].get<std::string>();
  EXPECT_TRUE(std::filesystem::exists(tok_dir + "/tokenizer.json"))
      << tok_dir << " is missing: run scripts/fetch-test-assets";
  g.model_dir = std::filesystem::temp_directory_path() /
                ("tessera-parity-" + arch + tag + "-" + std::to_string(::getpid()));
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

struct Split {
  std::string arch;
  int tp = 1;
  int pp = 1;
  bool ep = false;  // --enable-expert-parallel: whole experts per rank, tokens by all-to-all
};

void PrintTo(const Split& s, std::ostream* os) {
  *os << s.arch << " tp=" << s.tp << " pp=" << s.pp << (s.ep ? " ep" : "");
}

std::string split_name(const ::testing::TestParamInfo<Split>& info) {
  return info.param.arch + "_tp" + std::to_string(info.param.tp) + "_pp" +
         std::to_string(info.param.pp) + (info.param.ep ? "_ep" : "");
}

// One architecture's checkpoint and tokenizer, made once per process: ctest runs each
// architecture's splits in one process (tests/model/CMakeLists.txt), so the checkpoint is written
// and the tokenizer parsed once for all of them (under ASan that was a third of each case). Every
// split reads the same files, as each made the same bytes from the same seed before.
struct Made {
  Golden g;
  std::unique_ptr<Tokenizer> tokenizer;
  std::string error;  // why making or loading failed, for every split that asks
};

std::map<std::string, Made> g_made;  // by architecture

const Made& made(const std::string& arch) {
  auto it = g_made.find(arch);
  if (it != g_made.end()) return it->second;
  Made m;
  m.g = make(arch, "-splits");
  if (m.g.j.is_null()) {
    m.error = "no golden for " + arch;
  } else if (auto t = Tokenizer::load(m.g.model_dir); t) {
    m.tokenizer = std::move(*t);
  } else {
    m.error = t.status().to_string();
  }
  return g_made.emplace(arch, std::move(m)).first->second;
}

// Removes the checkpoints made() wrote when the process's tests are done.
class MadeCleanup : public ::testing::Environment {
 public:
  void TearDown() override {
    std::error_code ec;  // a model that failed to be made may have no directory
    for (const auto& [arch, m] : g_made) std::filesystem::remove_all(m.g.model_dir, ec);
    g_made.clear();
  }
};
[[maybe_unused]] ::testing::Environment* const kMadeCleanup =
    ::testing::AddGlobalTestEnvironment(new MadeCleanup);

class ParityTest : public ::testing::TestWithParam<Split> {};

TEST_P(ParityTest, LogitsAndGreedyTokensMatchTransformers) {
  const Split split = GetParam();
  const std::string& arch = split.arch;
  const Made& m = made(arch);
  ASSERT_TRUE(m.error.empty()) << m.error;
  const Golden& g = m.g;
  const Tokenizer* tokenizer = m.tokenizer.get();
  auto group = RankGroup::load(g.model_dir, split.tp, split.pp, QuantMethod::kAuto, split.ep);
  ASSERT_TRUE(group) << group.status().to_string();
  const int64_t vocab = (*group)->vocab();
  std::vector<int64_t> probe = g.j["probe_ids"].get<std::vector<int64_t>>();

  double worst = 0.0;
  uint64_t request = 1;
  for (const auto& c : g.j["cases"]) {
    std::vector<int32_t> ids = c["ids"].get<std::vector<int32_t>>();
    const int64_t n = static_cast<int64_t>(ids.size());
    // The tokenizer agrees with Hugging Face on the prompt.
    EXPECT_EQ(tokenizer->encode(c["prompt"].get<std::string>(), true), ids) << c["prompt"];
    std::vector<uint32_t> blocks;
    for (uint32_t b = 0; b < (ids.size() + 32 + 15) / 16; ++b) blocks.push_back(b);

    // Decode path: one token per step, logits at every position.
    for (int64_t pos = 0; pos < n; ++pos) {
      auto out = (*group)->execute(seq_step(request, {ids[pos]}, pos, pos == 0, n,
                                            pos == 0 ? blocks : std::vector<uint32_t>{}));
      ASSERT_TRUE(out) << out.status().to_string();
      ASSERT_EQ(out->outputs.size(), 1u);
      ASSERT_EQ(static_cast<int64_t>(out->logits.size()), vocab);
      const auto& expected = c["probe_logits"][pos];
      for (size_t k = 0; k < probe.size(); ++k) {
        double diff =
            std::abs(out->logits[static_cast<size_t>(probe[k])] - expected[k].get<double>());
        worst = std::max(worst, diff);
        ASSERT_LT(diff, kTolerance) << arch << " position " << pos << " id " << probe[k];
      }
      int64_t argmax =
          std::max_element(out->logits.begin(), out->logits.end()) - out->logits.begin();
      EXPECT_EQ(argmax, c["argmax"][pos].get<int64_t>()) << arch << " position " << pos;
      EXPECT_EQ(out->outputs[0].sample.token, argmax) << "greedy samples the argmax";
    }
    ASSERT_TRUE((*group)->execute(finish(request))) << "forgetting a finished request";
    ++request;

    // Prefill in one chunk, then 32 greedy tokens through the paged cache.
    std::vector<int32_t> generated;
    auto out = (*group)->execute(seq_step(request, ids, 0, true, n, blocks));
    ASSERT_TRUE(out) << out.status().to_string();
    ASSERT_EQ(static_cast<int64_t>(out->logits.size()), vocab);
    const auto& last = c["probe_logits"][ids.size() - 1];
    for (size_t k = 0; k < probe.size(); ++k) {
      double diff = std::abs(out->logits[static_cast<size_t>(probe[k])] - last[k].get<double>());
      worst = std::max(worst, diff);
      ASSERT_LT(diff, kTolerance) << arch << " prefill, id " << probe[k];
    }
    generated.push_back(out->outputs[0].sample.token);
    for (int step = 1; step < 32; ++step) {
      auto o =
          (*group)->execute(seq_step(request, {generated.back()},
                                     n + static_cast<int64_t>(generated.size()) - 1, false, 0, {}));
      ASSERT_TRUE(o) << o.status().to_string();
      generated.push_back(o->outputs[0].sample.token);
    }
    EXPECT_EQ(generated, c["greedy"].get<std::vector<int32_t>>()) << arch << ": " << c["prompt"];
    ASSERT_TRUE((*group)->execute(finish(request))) << "forgetting a finished request";
    for (int r = 0; r < split.tp * split.pp; ++r) {
      EXPECT_EQ((*group)->rank(r).live_requests(), 0u) << "rank " << r << " forgot the request";
    }
    ++request;
  }
  std::printf("%s tp=%d pp=%d%s: max |logit diff| vs transformers = %.3g (tolerance %.0e)\n",
              arch.c_str(), split.tp, split.pp, split.ep ? " expert-parallel" : "", worst,
              kTolerance);
  group->reset();
}

std::vector<Split> splits() {
  std::vector<Split> all;
  // The mixture-of-experts goldens come from the same script (mixtral: the llama2 tokenizer;
  // qwen2_moe, qwen3_moe: qwen3's); so do Gemma 2, Gemma 3 (text) and Phi-3's (the llama2
  // tokenizer; transformers' eager attention, a fourth prompt longer than their windows).
  for (const char* arch : {"llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe",
                           "qwen3_moe", "gemma2", "gemma3", "phi3"}) {
    for (auto [tp, pp] : {std::pair{1, 1}, {2, 1}, {4, 1}, {1, 2}, {2, 2}}) {
      all.push_back({arch, tp, pp});
    }
  }
  // Expert parallelism: whole experts per rank (the tiny models' 4 experts: 2 per rank, 1 per
  // rank), tokens dispatched and combined by all-to-all over the tcp collectives.
  for (const char* arch : {"mixtral", "qwen2_moe", "qwen3_moe"}) {
    for (auto [tp, pp] : {std::pair{2, 1}, {4, 1}, {2, 2}}) all.push_back({arch, tp, pp, true});
  }
  return all;
}

INSTANTIATE_TEST_SUITE_P(Architectures, ParityTest, ::testing::ValuesIn(splits()), split_name);

// Each rank holds its share: the stages' layers partition the model, the tensor-parallel ranks'
// weights add up to the whole (the vocabulary shards once padded to a multiple of tp).
TEST(ParallelLoadTest, RanksHoldTheirShare) {
  Golden g = make("qwen3", "-share");
  auto whole = RankGroup::load(g.model_dir, 1, 1);
  ASSERT_TRUE(whole) << whole.status().to_string();
  const ModelInfo one = (*whole)->rank(0).info();
  auto split = RankGroup::load(g.model_dir, 2, 2);
  ASSERT_TRUE(split) << split.status().to_string();
  int64_t layers = 0;
  for (int r = 0; r < 4; ++r) {
    ModelInfo info = (*split)->rank(r).info();
    EXPECT_EQ(info.layer_begin, r / 2 == 0 ? 0 : 2) << "rank " << r;
    EXPECT_EQ(info.layer_end, r / 2 == 0 ? 2 : 4) << "rank " << r;
    EXPECT_LT(info.weight_bytes, one.weight_bytes / 2) << "rank " << r << " holds a quarter-ish";
    if (r % 2 == 0) layers += info.layer_end - info.layer_begin;
  }
  EXPECT_EQ(layers, one.num_layers);
  std::filesystem::remove_all(g.model_dir);
}

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
  auto load = [&]() { return ModelRunner::load(cpu_spec(g.model_dir, 64), {}); };
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

// ---- mixture of experts -----------------------------------------------------------------------

// A tiny MoE model (make-model --preset tiny) without a golden: the splits are checked against
// one rank (the goldens check one rank against transformers).
std::string make_tiny(const std::string& arch, const std::string& tokenizer,
                      const std::string& tag) {
  const std::string dir = std::filesystem::temp_directory_path() /
                          ("tessera-moe-" + arch + tag + "-" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  MakeModelOptions o;
  o.arch = arch;
  o.preset = "tiny";
  o.tokenizer_dir = source_dir() + "/tests/assets/tokenizers/" + tokenizer;
  o.seed = 1234;
  o.dtype = "bf16";
  o.out = dir;
  Status st = make_model(o);
  EXPECT_TRUE(st.is_ok()) << st.to_string();
  return dir;
}

// The logits of a prefill of `ids` then one decode step, concatenated.
std::vector<float> run_prompt(RankGroup& group, const std::vector<int32_t>& ids) {
  std::vector<float> all;
  auto out = group.execute(seq_step(1, ids, 0, true, static_cast<int64_t>(ids.size()), {0, 1}));
  EXPECT_TRUE(out) << out.status().to_string();
  if (!out) return all;
  all = out->logits;
  const int32_t next = out->outputs[0].sample.token;
  auto o = group.execute(seq_step(1, {next}, static_cast<int64_t>(ids.size()), false, 0, {}));
  EXPECT_TRUE(o) << o.status().to_string();
  if (o) all.insert(all.end(), o->logits.begin(), o->logits.end());
  EXPECT_TRUE(group.execute(finish(1)));
  return all;
}

// Every split of the model in `dir` (tp 2, 4; pp 2; 2 x 2) gives one rank's logits of `ids`
// (finite): fp32 sums in another order (the all-reduce of 2 or 4 partials), ~1e-6 on O(1) logits.
void expect_splits_give_one_ranks_logits(const std::string& arch, const std::string& dir,
                                         const std::vector<int32_t>& ids) {
  std::vector<float> one;
  {
    auto group = RankGroup::load(dir, 1, 1);
    ASSERT_TRUE(group) << arch << ": " << group.status().to_string();
    one = run_prompt(**group, ids);
  }
  ASSERT_FALSE(one.empty()) << arch;
  for (float x : one) ASSERT_TRUE(std::isfinite(x)) << arch;
  for (auto [tp, pp] : {std::pair{2, 1}, {4, 1}, {1, 2}, {2, 2}}) {
    auto group = RankGroup::load(dir, tp, pp);
    ASSERT_TRUE(group) << arch << " tp " << tp << " pp " << pp << ": "
                       << group.status().to_string();
    const std::vector<float> split = run_prompt(**group, ids);
    ASSERT_EQ(split.size(), one.size()) << arch << " tp " << tp << " pp " << pp;
    double worst = 0;
    for (size_t i = 0; i < one.size(); ++i) {
      ASSERT_TRUE(std::isfinite(split[i])) << arch << " tp " << tp << " pp " << pp;
      worst = std::max(worst, static_cast<double>(std::abs(split[i] - one[i])));
    }
    EXPECT_LT(worst, 1e-4) << arch << " tp " << tp << " pp " << pp;
  }
}

// Every split of each tiny MoE model (experts sliced over 2 and 4 tensor-parallel ranks, layers
// over 2 stages) gives one rank's logits: the partial expert sums add up through the all-reduce.
TEST(MoeModelTest, EverySplitGivesOneRanksLogits) {
  const std::vector<int32_t> ids = {1, 450, 7483, 310, 3444, 338, 29871, 13, 42, 99, 7};
  for (auto [arch, tok] : {std::pair<std::string, std::string>{"mixtral", "llama2"},
                           {"qwen2_moe", "qwen3"},
                           {"qwen3_moe", "qwen3"}}) {
    const std::string dir = make_tiny(arch, tok, "-splits");
    expect_splits_give_one_ranks_logits(arch, dir, ids);
    std::filesystem::remove_all(dir);
  }
}

// Gemma 2, Gemma 3 and Phi-3 split over ranks give one rank's logits (the goldens check one rank
// against transformers): Phi-3's fused qkv_proj / gate_up_proj sliced part by part, Gemma's
// sandwich norms after the all-reduce, windows shorter than the prompt on every layout.
TEST(SlidingWindowModelTest, EverySplitGivesOneRanksLogits) {
  std::vector<int32_t> ids;
  for (int32_t i = 0; i < 24; ++i) ids.push_back(100 + 37 * i);  // longer than the windows
  for (const std::string arch : {"gemma2", "gemma3", "phi3"}) {
    const std::string dir = make_tiny(arch, "llama2", "-splits");
    expect_splits_give_one_ranks_logits(arch, dir, ids);
    std::filesystem::remove_all(dir);
  }
}

// A checkpoint that lacks an expert's tensor is refused at load, naming the tensor and where it
// was looked for.
TEST(MoeModelTest, AMissingExpertIsNamed) {
  const std::string dir = make_tiny("mixtral", "llama2", "-missing");
  // Rename expert 3's w1 in the safetensors header (same length): the checkpoint lacks it.
  const std::string file = dir + "/model.safetensors";
  std::string bytes;
  {
    std::ifstream in(file, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  const std::string name = "model.layers.1.block_sparse_moe.experts.3.w1.weight";
  const size_t at = bytes.find(name);
  ASSERT_NE(at, std::string::npos);
  bytes.replace(at, name.size(), "model.layers.1.block_sparse_moe.experts.3.w9.weight");
  std::ofstream(file, std::ios::binary | std::ios::trunc) << bytes;
  auto missing = ModelRunner::load(cpu_spec(dir, 64), {});
  ASSERT_FALSE(missing);
  const std::string m = missing.status().message();
  EXPECT_NE(m.find("tensor '" + name + "' not found"), std::string::npos) << m;
  EXPECT_NE(m.find(dir), std::string::npos) << m;
  EXPECT_NE(m.find("expert 3 of layer 1 (config.json: 4 experts per MoE layer)"), std::string::npos)
      << m;
  std::filesystem::remove_all(dir);
}

// --load-format dummy makes the weights on the GPU; the CPU backend refuses it by name.
TEST(MoeModelTest, TheCpuBackendRefusesDummyWeights) {
  const std::string dir = make_tiny("qwen3_moe", "qwen3", "-dummy");
  LoadSpec spec = cpu_spec(dir, 64);
  spec.engine.load_format = LoadFormat::kDummy;
  auto r = ModelRunner::load(spec, {});
  ASSERT_FALSE(r);
  EXPECT_NE(r.status().message().find("--load-format dummy runs on the CUDA backend"),
            std::string::npos)
      << r.status().message();
  std::filesystem::remove_all(dir);
}

// The cuda backend runs MoE models (tests/gpu/cuda_model_test.cpp checks them on a GPU): here,
// without one, a load fails for want of the GPU, not because of the experts.
TEST(MoeModelTest, TheCudaBackendDoesNotRefuseMoeModels) {
  const std::string dir = make_tiny("qwen3_moe", "qwen3", "-cuda");
  LoadSpec spec = cpu_spec(dir, 64);
  spec.engine.device = Device::kCuda;
  auto r = ModelRunner::load(spec, {});
  if (!r) {
    EXPECT_EQ(r.status().message().find("mixture-of-experts"), std::string::npos)
        << r.status().message();
  }
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace tessera
