// Sliding-window attention on the CPU backend against Hugging Face transformers: a tiny Mistral
// whose config.json says "sliding_window": 8 (tests/assets/goldens/model_mistral_window.json,
// from scripts/goldens/model_goldens.py's mistral_window variant on the GPU machine: the same
// seeded checkpoint, transformers' eager attention in fp32). Every prompt but the shortest is
// longer than the window, and the 32 greedy tokens run past it.
//
// Checked at tensor-parallel 1 and 2 (and 2 pipeline stages): the logits at every prompt
// position (token-by-token decode through the paged cache), a prefill in one chunk then 32
// greedy tokens, and a chunked prefill (5-token chunks, so chunks start on both sides of the
// window edge and their queries' windows reach into earlier chunks' blocks) then the same 32
// greedy tokens. In the chunked run the driver's freeing is mimicked: every block that falls
// wholly out of the window is handed at once to another request, which overwrites it. Were the
// attention to read it, the logits would leave the goldens.
//
// Tolerance as parity_test.cpp: 1e-4 absolute on the probed logits (fp32 on both sides).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/checkpoint/model_config.h"
#include "common/tokenizer/tokenizer.h"
#include "driver/make_model/make_model.h"
#include "tests/model/rank_group.h"

namespace tessera {
namespace {

constexpr double kTolerance = 1e-4;
constexpr int64_t kBlockSize = 16;  // the tests' engine spec's (EngineSpec's default)
constexpr int kNewTokens = 32;

std::string source_dir() { return TESSERA_SOURCE_DIR; }

struct Golden {
  nlohmann::json j;
  std::string model_dir;
};

// The golden, and its checkpoint made again: make-model's tiny preset of the golden's
// make_arch, config.json patched with its config_patch.
Golden make_golden(const std::string& name, const std::string& tag) {
  Golden g;
  const std::string path = source_dir() + "/tests/assets/goldens/model_" + name + ".json";
  std::ifstream in(path);
  if (!in) {
    // Never skipped: a missing golden is a failure that says how to make it.
    ADD_FAILURE() << "missing golden " << path << ": make it on the GPU machine with "
                  << "scripts/goldens/model_goldens.py TESSERA_BIN tests/assets/tokenizers "
                  << "tests/assets/goldens " << name;
    return g;
  }
  g.j = nlohmann::json::parse(in);
  const std::string tok_dir =
      source_dir() + "/tests/assets/tokenizers/" + g.j["tokenizer"].get<std::string>();
  g.model_dir = std::filesystem::temp_directory_path() /
                ("tessera-window-" + name + tag + "-" + std::to_string(::getpid()));
  std::filesystem::remove_all(g.model_dir);
  MakeModelOptions o;
  o.arch = g.j["make_arch"].get<std::string>();
  o.preset = "tiny";
  o.tokenizer_dir = tok_dir;
  o.seed = g.j["seed"].get<uint64_t>();
  o.dtype = "bf16";
  o.out = g.model_dir;
  const Status st = make_model(o);
  EXPECT_TRUE(st.is_ok()) << st.to_string();
  std::ifstream cin(g.model_dir + "/config.json");
  nlohmann::json config = nlohmann::json::parse(cin);
  cin.close();
  config.merge_patch(g.j["config_patch"]);
  std::ofstream(g.model_dir + "/config.json") << config.dump(2);
  return g;
}

struct Split {
  int tp = 1;
  int pp = 1;
};

void PrintTo(const Split& s, std::ostream* os) { *os << "tp=" << s.tp << " pp=" << s.pp; }

std::string split_name(const ::testing::TestParamInfo<Split>& info) {
  return "tp" + std::to_string(info.param.tp) + "_pp" + std::to_string(info.param.pp);
}

class MistralWindowTest : public ::testing::TestWithParam<Split> {};

// |logits[probe] - expected| below the tolerance; returns the worst difference.
double expect_probe(const std::vector<float>& logits, const std::vector<int64_t>& probe,
                    const nlohmann::json& expected, const std::string& where) {
  double worst = 0.0;
  for (size_t k = 0; k < probe.size(); ++k) {
    const double diff = std::abs(logits[static_cast<size_t>(probe[k])] - expected[k].get<double>());
    worst = std::max(worst, diff);
    EXPECT_LT(diff, kTolerance) << where << ", id " << probe[k];
  }
  return worst;
}

TEST_P(MistralWindowTest, MatchesTransformersAcrossTheWindowEdge) {
  const Split split = GetParam();
  Golden g = make_golden("mistral_window",
                         "-tp" + std::to_string(split.tp) + "pp" + std::to_string(split.pp));
  ASSERT_FALSE(g.j.is_null());
  auto config = load_model_config(g.model_dir);
  ASSERT_TRUE(config) << config.status().to_string();
  const int64_t window = config->kv_cache_window();
  ASSERT_EQ(window, 8) << "every layer slides by the patched window";
  auto tokenizer = Tokenizer::load(g.model_dir);
  ASSERT_TRUE(tokenizer) << tokenizer.status().to_string();
  auto group = RankGroup::load(g.model_dir, split.tp, split.pp);
  ASSERT_TRUE(group) << group.status().to_string();
  const int64_t vocab = (*group)->vocab();
  const std::vector<int64_t> probe = g.j["probe_ids"].get<std::vector<int64_t>>();

  double worst = 0.0;
  uint64_t request = 1;
  int crossing = 0;
  for (const auto& c : g.j["cases"]) {
    const std::vector<int32_t> ids = c["ids"].get<std::vector<int32_t>>();
    const std::vector<int32_t> greedy = c["greedy"].get<std::vector<int32_t>>();
    const int64_t n = static_cast<int64_t>(ids.size());
    crossing += n > window;
    EXPECT_EQ((*tokenizer)->encode(c["prompt"].get<std::string>(), true), ids) << c["prompt"];
    const int64_t total = n + kNewTokens;
    std::vector<uint32_t> blocks;
    for (uint32_t b = 0; b < (total + kBlockSize - 1) / kBlockSize; ++b) blocks.push_back(b);

    // Decode path: one token per step, the logits at every prompt position.
    for (int64_t pos = 0; pos < n; ++pos) {
      auto out = (*group)->execute(seq_step(request, {ids[pos]}, pos, pos == 0, n,
                                            pos == 0 ? blocks : std::vector<uint32_t>{}));
      ASSERT_TRUE(out) << out.status().to_string();
      ASSERT_EQ(static_cast<int64_t>(out->logits.size()), vocab);
      worst = std::max(worst, expect_probe(out->logits, probe, c["probe_logits"][pos],
                                           "decode position " + std::to_string(pos)));
      const int64_t argmax =
          std::max_element(out->logits.begin(), out->logits.end()) - out->logits.begin();
      EXPECT_EQ(argmax, c["argmax"][pos].get<int64_t>()) << "position " << pos;
    }
    ASSERT_TRUE((*group)->execute(finish(request++)));

    // Prefill in one chunk, then the greedy continuation.
    {
      auto out = (*group)->execute(seq_step(request, ids, 0, true, n, blocks));
      ASSERT_TRUE(out) << out.status().to_string();
      worst = std::max(
          worst, expect_probe(out->logits, probe, c["probe_logits"][n - 1], "one-chunk prefill"));
      std::vector<int32_t> generated = {out->outputs[0].sample.token};
      while (static_cast<int>(generated.size()) < kNewTokens) {
        auto o = (*group)->execute(seq_step(request, {generated.back()},
                                            n + static_cast<int64_t>(generated.size()) - 1, false,
                                            0, {}));
        ASSERT_TRUE(o) << o.status().to_string();
        generated.push_back(o->outputs[0].sample.token);
      }
      EXPECT_EQ(generated, greedy) << "one-chunk prefill: " << c["prompt"];
      ASSERT_TRUE((*group)->execute(finish(request++)));
    }

    // Chunked prefill in 5-token chunks, then the greedy continuation; blocks that fall out of
    // the window are overwritten by other requests at once (the engine would reuse them).
    {
      const uint64_t id = request++;
      uint64_t scribbler = 1000 * request;
      size_t freed = 0;
      // Hands the blocks wholly before the window of position `next` to a request that writes
      // other tokens' K/V into them, then forgets it.
      auto scribble_out_of_window = [&](int64_t next) {
        const int64_t first_read = next >= window ? next - window + 1 : 0;
        const size_t dead = static_cast<size_t>(first_read / kBlockSize);
        if (dead <= freed) return;
        std::vector<uint32_t> reuse(blocks.begin() + static_cast<std::ptrdiff_t>(freed),
                                    blocks.begin() + static_cast<std::ptrdiff_t>(dead));
        freed = dead;
        std::vector<int32_t> junk(reuse.size() * kBlockSize);
        for (size_t i = 0; i < junk.size(); ++i) junk[i] = static_cast<int32_t>(3 + (17 * i) % 900);
        const int64_t len = static_cast<int64_t>(junk.size());
        auto o = (*group)->execute(seq_step(scribbler, junk, 0, true, len, reuse));
        ASSERT_TRUE(o) << "scribbling over freed blocks: " << o.status().to_string();
        ASSERT_TRUE((*group)->execute(finish(scribbler++)));
      };
      std::vector<int32_t> generated;
      for (int64_t start = 0; start < n; start += 5) {
        const int64_t end = std::min(n, start + 5);
        std::vector<int32_t> chunk(ids.begin() + start, ids.begin() + end);
        auto out = (*group)->execute(seq_step(id, chunk, start, start == 0, n,
                                              start == 0 ? blocks : std::vector<uint32_t>{}));
        ASSERT_TRUE(out) << out.status().to_string();
        worst = std::max(worst, expect_probe(out->logits, probe, c["probe_logits"][end - 1],
                                             "chunk ending at " + std::to_string(end)));
        if (end == n) generated.push_back(out->outputs[0].sample.token);
        ASSERT_NO_FATAL_FAILURE(scribble_out_of_window(end));
      }
      while (static_cast<int>(generated.size()) < kNewTokens) {
        const int64_t pos = n + static_cast<int64_t>(generated.size()) - 1;
        auto o = (*group)->execute(seq_step(id, {generated.back()}, pos, false, 0, {}));
        ASSERT_TRUE(o) << o.status().to_string();
        generated.push_back(o->outputs[0].sample.token);
        ASSERT_NO_FATAL_FAILURE(scribble_out_of_window(pos + 1));
      }
      EXPECT_EQ(generated, greedy) << "chunked prefill, freed blocks reused: " << c["prompt"];
      if (total > window + 2 * kBlockSize) {
        EXPECT_GT(freed, 0u) << "a sequence of " << total << " tokens frees blocks";
      }
      ASSERT_TRUE((*group)->execute(finish(id)));
    }
  }
  EXPECT_GE(crossing, 2) << "prompts longer than the window";
  std::printf("mistral_window tp=%d pp=%d: max |logit diff| vs transformers = %.3g\n", split.tp,
              split.pp, worst);
  group->reset();
  std::filesystem::remove_all(g.model_dir);
}

INSTANTIATE_TEST_SUITE_P(Splits, MistralWindowTest,
                         ::testing::Values(Split{1, 1}, Split{2, 1}, Split{1, 2}, Split{2, 2}),
                         split_name);

}  // namespace
}  // namespace tessera
