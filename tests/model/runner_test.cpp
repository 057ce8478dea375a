// ModelRunner on the cpu backend: steps submitted while the one before runs (async scheduling as
// the actor runs it) give the tokens of steps run one at a time, and what cannot go ahead, or
// fails, comes back in order without touching the steps around it.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>

#include "actors/model/model_runner.h"
#include "driver/make_model/make_model.h"
#include "tests/model/launch_ahead.h"

namespace tessera {
namespace {

using testing::decode_step;
using testing::generate_steps;
using testing::prompt_step;

class RunnerTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new std::string(std::filesystem::temp_directory_path() /
                           ("tessera-runner-" + std::to_string(::getpid())));
    std::filesystem::remove_all(*dir_);
    MakeModelOptions o;
    o.arch = "llama";
    o.preset = "tiny";
    o.tokenizer_dir = std::string(TESSERA_SOURCE_DIR) + "/tests/assets/tokenizers/llama3";
    o.seed = 77;
    o.out = *dir_;
    Status st = make_model(o);
    ASSERT_TRUE(st.is_ok()) << st.to_string();
  }
  static void TearDownTestSuite() {
    std::filesystem::remove_all(*dir_);
    delete dir_;
  }

  std::unique_ptr<ModelRunner> load(bool return_logits = false) {
    EngineSpec engine;
    engine.model = *dir_;
    engine.max_model_len = 256;
    engine.max_num_seqs = 4;
    engine.return_logits = return_logits;
    auto spec = load_spec_for_rank(engine, ParallelConfig{}, Device::kCpu);
    EXPECT_TRUE(spec) << spec.status().to_string();
    if (!spec) return nullptr;
    spec->threads = 1;
    auto r = ModelRunner::load(*spec, {});
    EXPECT_TRUE(r) << r.status().to_string();
    if (!r) return nullptr;
    Status st = (*r)->init_cache((*r)->info().kv_blocks);
    EXPECT_TRUE(st.is_ok()) << st.to_string();
    return std::move(*r);
  }

  static std::string* dir_;
  const std::vector<std::vector<int32_t>> prompts_ = {
      {128000, 791, 6460, 315, 9822, 374},
      {128000, 40, 1093, 311, 1373, 264, 2363, 922, 279, 2294, 323, 279, 12691}};
};

std::string* RunnerTest::dir_ = nullptr;

SamplingParams greedy() {
  SamplingParams p;
  p.temperature = 0.0f;
  return p;
}

SamplingParams seeded(uint64_t seed) {
  SamplingParams p;
  p.temperature = 0.9f;
  p.top_k = 40;
  p.seed = seed;
  return p;
}

TEST_F(RunnerTest, LaunchingAheadGivesTheTokensOfOneStepAtATime) {
  auto r = load();
  ASSERT_TRUE(r);
  for (const auto& params : {std::vector<SamplingParams>{greedy(), greedy()},
                             std::vector<SamplingParams>{seeded(5), seeded(9)}}) {
    auto one = generate_steps(*r, prompts_, 12, params, false);
    auto ahead = generate_steps(*r, prompts_, 12, params, true);
    ASSERT_EQ(one.size(), 2u);
    EXPECT_EQ(one[0].size(), 12u);
    EXPECT_EQ(one, ahead);
    EXPECT_EQ(r->live_requests(), 0u);
  }
}

TEST_F(RunnerTest, WhatCannotGoAheadIsRefusedInOrderAndChangesNothing) {
  auto r = load();
  ASSERT_TRUE(r);
  SamplingParams penalised = greedy();
  penalised.repetition_penalty = 1.3f;
  r->submit(prompt_step(prompts_, 4, {greedy(), penalised}, 1));
  // The second request's penalty reads its history, which lacks the sample still running.
  const StepInput next = decode_step(prompts_, 1, 1, {kSampledToken, kSampledToken});
  EXPECT_FALSE(r->can_launch_ahead(next));
  r->submit(next);  // submitted anyway: refused, after the step before
  EXPECT_EQ(r->running(), 2u);
  auto first = r->collect();
  ASSERT_TRUE(first) << first.status().to_string();
  EXPECT_EQ(first->step_id, 1u);
  EXPECT_EQ(first->outputs.size(), 2u);
  auto refused = r->collect();
  ASSERT_FALSE(refused);
  EXPECT_EQ(refused.status().code(), Code::kFailedPrecondition);
  EXPECT_NE(refused.status().message().find("cannot start before"), std::string::npos)
      << refused.status().message();
  // Nothing of it was applied: the same step now runs, taking the recorded samples.
  auto again = r->execute(next);
  ASSERT_TRUE(again) << again.status().to_string();
  EXPECT_EQ(again->outputs.size(), 2u);
  // Two steps at most: with two running, a third waits.
  auto step = [&](int n) {
    auto s = decode_step(prompts_, 1, n, {kSampledToken, kSampledToken});
    s.seqs.pop_back();  // the request without a penalty
    return s;
  };
  r->submit(step(2));
  ASSERT_TRUE(r->can_launch_ahead(step(3)));
  r->submit(step(3));
  EXPECT_FALSE(r->can_launch_ahead(step(4)));
  EXPECT_TRUE(r->collect());
  EXPECT_TRUE(r->collect());
}

TEST_F(RunnerTest, AFailedStepAheadLeavesTheStepBeforeWhole) {
  auto r = load();
  ASSERT_TRUE(r);
  const std::vector<SamplingParams> params = {greedy(), greedy()};
  r->submit(prompt_step(prompts_, 4, params, 1));
  // Malformed (a request this actor never saw): refused when it is applied, nothing changes.
  StepInput bad = decode_step(prompts_, 1, 1, {kSampledToken, kSampledToken});
  bad.seqs[1].request_id = 99;
  ASSERT_TRUE(r->can_launch_ahead(bad));
  r->submit(bad);
  auto first = r->collect();
  ASSERT_TRUE(first) << first.status().to_string();
  auto failed = r->collect();
  ASSERT_FALSE(failed);
  EXPECT_NE(failed.status().message().find("request 99"), std::string::npos)
      << failed.status().message();
  // The samples of the first step are recorded and taken by the next step.
  auto next = r->execute(decode_step(prompts_, 1, 1, {kSampledToken, kSampledToken}));
  ASSERT_TRUE(next) << next.status().to_string();
  // One at a time from the start gives the same two tokens.
  auto fresh = load();
  auto one = generate_steps(*fresh, prompts_, 2, params, false, 1);
  ASSERT_EQ(one.size(), 2u);
  ASSERT_EQ(one[0].size(), 2u);
  EXPECT_EQ(first->outputs[0].sample.token, one[0][0]);
  EXPECT_EQ(next->outputs[0].sample.token, one[0][1]);
  EXPECT_EQ(next->outputs[1].sample.token, one[1][1]);
}

TEST_F(RunnerTest, ReturningLogitsKeepsStepsOneAtATime) {
  auto r = load(true);
  ASSERT_TRUE(r);
  r->submit(prompt_step(prompts_, 4, {greedy(), greedy()}, 1));
  EXPECT_FALSE(r->can_launch_ahead(decode_step(prompts_, 1, 1, {kSampledToken, kSampledToken})));
  auto out = r->collect();
  ASSERT_TRUE(out);
  EXPECT_EQ(out->logits.size(), 2 * static_cast<size_t>(r->config().vocab_size));
}

}  // namespace
}  // namespace tessera
