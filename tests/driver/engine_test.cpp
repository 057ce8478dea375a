// The driver's engine loop with a fake executor: scheduling, KV blocks, stop conditions,
// streaming text and failure handling — everything but the model.
#include "driver/engine/engine.h"

#include <gtest/gtest.h>

#include <deque>
#include <map>

namespace tessera {
namespace {

// Token i decodes to pieces_[i]; like Hugging Face, a trailing incomplete UTF-8 sequence
// decodes to U+FFFD.
class FakeDetokenizer final : public Detokenizer {
 public:
  std::map<int32_t, std::string> pieces = {{1, "a"},   {2, "b"},    {3, "\xE4"}, {4, "\xBD\xA0"},
                                           {5, " X"},  {6, "ST"},   {7, "OP"},   {8, "!"},
                                           {9, "<eos>"}, {10, "c"}};
  std::string decode(const std::vector<int32_t>& ids, bool skip_special) const override {
    std::string s;
    for (int32_t id : ids) {
      if (id == 9 && skip_special) continue;
      auto it = pieces.find(id);
      s += it == pieces.end() ? "?" : it->second;
    }
    // Find a trailing incomplete sequence.
    size_t i = s.size();
    size_t back = 0;
    while (i > 0 && back < 4 && (static_cast<unsigned char>(s[i - 1]) & 0xC0) == 0x80) {
      --i;
      ++back;
    }
    if (i > 0) {
      unsigned char lead = static_cast<unsigned char>(s[i - 1]);
      size_t need = lead >= 0xF0 ? 3 : lead >= 0xE0 ? 2 : lead >= 0xC0 ? 1 : 0;
      if (need > back) s = s.substr(0, i - 1) + "\xEF\xBF\xBD";
    }
    return s;
  }
};

// Plays back scripted tokens per request and records every step. Steps complete in submission
// order; up to `depth` may be in flight (pipeline parallelism).
class FakeExecutor final : public StepExecutor {
 public:
  std::map<uint64_t, std::deque<int32_t>> script;
  std::vector<StepInput> batches;
  // Every request's block table as the actors would rebuild it from the deltas.
  std::map<uint64_t, std::vector<uint32_t>> tables;
  int fail_next = 0;
  int depth = 1;
  size_t max_in_flight = 0;
  std::deque<StepInput> in_flight;

  Status submit(StepInput step) override {
    for (const auto& s : step.seqs) {
      if (s.first) tables[s.request_id].clear();
      auto& t = tables[s.request_id];
      t.insert(t.end(), s.new_blocks.begin(), s.new_blocks.end());
    }
    batches.push_back(step);
    in_flight.push_back(std::move(step));
    max_in_flight = std::max(max_in_flight, in_flight.size());
    return Status::ok();
  }
  Expected<StepOutput> collect() override {
    StepInput step = std::move(in_flight.front());
    in_flight.pop_front();
    if (fail_next > 0) {
      --fail_next;
      return unavailable("actor a-1 died (killed by signal 9)");
    }
    StepOutput r;
    r.step_id = step.step_id;
    for (const auto& w : step.seqs) {
      if (!w.sample) continue;
      auto& q = script[w.request_id];
      int32_t t = q.empty() ? 1 : q.front();
      if (!q.empty()) q.pop_front();
      r.outputs.push_back({w.request_id, {t, -0.5f, {}}});
    }
    return r;
  }
  int pipeline_depth() const override { return depth; }
};

EngineConfig config(uint32_t blocks = 64, uint32_t budget = 2048, uint32_t max_len = 256) {
  EngineConfig c;
  c.num_blocks = blocks;
  c.block_size = 4;
  c.scheduler.max_num_batched_tokens = budget;
  c.scheduler.max_model_len = max_len;
  c.vocab_size = 100;
  c.eos_token_ids = {9};
  return c;
}

struct Run {
  std::string text;
  std::vector<int32_t> tokens;
  std::string finish;
  std::vector<std::string> deltas;
};

std::map<uint64_t, Run> run_all(LlmEngine& engine) {
  std::map<uint64_t, Run> runs;
  for (int i = 0; i < 1000 && engine.has_unfinished(); ++i) {
    auto outs = engine.step();
    EXPECT_TRUE(outs) << outs.status().to_string();
    if (!outs) break;
    for (auto& o : *outs) {
      auto& r = runs[o.request_id];
      r.text += o.delta;
      if (!o.delta.empty()) r.deltas.push_back(o.delta);
      r.tokens.insert(r.tokens.end(), o.new_tokens.begin(), o.new_tokens.end());
      if (o.finished) r.finish = o.finish_reason;
    }
  }
  return runs;
}

SamplingParams opts(int max_tokens) {
  SamplingParams s;
  s.max_tokens = max_tokens;
  return s;
}

TEST(EngineTest, StopsAtMaxTokensWithLength) {
  FakeExecutor ex;
  FakeDetokenizer dt;
  LlmEngine engine(config(), ex, dt);
  auto id = engine.add_request({1, 2, 3}, opts(5));
  ASSERT_TRUE(id);
  ex.script[*id] = {1, 2, 1, 2, 1, 2};
  auto runs = run_all(engine);
  EXPECT_EQ(runs[*id].tokens, (std::vector<int32_t>{1, 2, 1, 2, 1}));
  EXPECT_EQ(runs[*id].text, "ababa");
  EXPECT_EQ(runs[*id].finish, "length");
  // Prefill of 3 tokens first, then one token per step, positions continuing.
  ASSERT_EQ(ex.batches.size(), 5u);
  EXPECT_EQ(ex.batches[0].seqs[0].tokens.size(), 3u);
  EXPECT_TRUE(ex.batches[0].seqs[0].first);
  EXPECT_EQ(ex.batches[1].seqs[0].tokens, (std::vector<int32_t>{1}));
  EXPECT_EQ(ex.batches[1].seqs[0].start_position, 3);
  EXPECT_FALSE(ex.batches[1].seqs[0].first);
  EXPECT_EQ(ex.batches[4].seqs[0].start_position, 6);
  EXPECT_EQ(ex.tables[*id].size(), 2u);  // 7 tokens in blocks of 4
  // Only what changed goes out: the second block once, when the sequence grows into it.
  size_t sent = 0;
  for (const auto& b : ex.batches) sent += b.seqs[0].new_blocks.size();
  EXPECT_EQ(sent, 2u);
  EXPECT_TRUE(ex.batches[3].seqs[0].new_blocks.empty());
}

TEST(EngineTest, EosStopsUnlessIgnored) {
  FakeExecutor ex;
  FakeDetokenizer dt;
  LlmEngine engine(config(), ex, dt);
  auto a = engine.add_request({1}, opts(10));
  SamplingParams ignore = opts(4);
  ignore.ignore_eos = true;
  auto b = engine.add_request({1}, ignore);
  ex.script[*a] = {2, 9, 2};
  ex.script[*b] = {2, 9, 2, 2};
  auto runs = run_all(engine);
  EXPECT_EQ(runs[*a].tokens, (std::vector<int32_t>{2, 9}));
  EXPECT_EQ(runs[*a].text, "b");  // EOS adds no text
  EXPECT_EQ(runs[*a].finish, "stop");
  EXPECT_EQ(runs[*b].tokens.size(), 4u);
  EXPECT_EQ(runs[*b].finish, "length");
  // The finished request is announced to the actors in a later step.
  bool announced = false;
  for (const auto& batch : ex.batches) {
    for (uint64_t f : batch.finished) announced |= f == *a;
  }
  EXPECT_TRUE(announced);
}

TEST(EngineTest, StopStringTruncatesAndIsNeverStreamed) {
  FakeExecutor ex;
  FakeDetokenizer dt;
  LlmEngine engine(config(), ex, dt);
  SamplingParams s = opts(20);
  s.stop = {"STOP"};
  auto id = engine.add_request({1}, s);
  ex.script[*id] = {1, 5, 6, 7, 8};  // "a X" + "ST" + "OP" → stop before "STOP"
  auto runs = run_all(engine);
  EXPECT_EQ(runs[*id].text, "a X");
  EXPECT_EQ(runs[*id].finish, "stop");
  for (const auto& d : runs[*id].deltas) EXPECT_EQ(d.find('S'), std::string::npos) << d;
}

TEST(EngineTest, StopTokenIds) {
  FakeExecutor ex;
  FakeDetokenizer dt;
  LlmEngine engine(config(), ex, dt);
  SamplingParams s = opts(20);
  s.stop_token_ids = {10};
  auto id = engine.add_request({1}, s);
  ex.script[*id] = {1, 10, 1};
  auto runs = run_all(engine);
  EXPECT_EQ(runs[*id].tokens, (std::vector<int32_t>{1, 10}));
  EXPECT_EQ(runs[*id].finish, "stop");
}

TEST(EngineTest, PartialUtf8IsHeldBackUntilComplete) {
  FakeExecutor ex;
  FakeDetokenizer dt;
  LlmEngine engine(config(), ex, dt);
  auto id = engine.add_request({1}, opts(3));
  ex.script[*id] = {3, 4, 1};  // E4 | BD A0 → "你", then "a"
  auto runs = run_all(engine);
  EXPECT_EQ(runs[*id].text, "\xE4\xBD\xA0" "a");
  for (const auto& d : runs[*id].deltas) {
    EXPECT_EQ(d.find("\xEF\xBF\xBD"), std::string::npos);
  }
}

TEST(EngineTest, ChunkedPrefillAndContinuousBatching) {
  FakeExecutor ex;
  FakeDetokenizer dt;
  LlmEngine engine(config(64, /*budget=*/8), ex, dt);
  std::vector<int32_t> long_prompt(20, 1);
  auto a = engine.add_request(long_prompt, opts(3));
  auto b = engine.add_request({2, 2}, opts(3));
  auto runs = run_all(engine);
  EXPECT_EQ(runs[*a].tokens.size(), 3u);
  EXPECT_EQ(runs[*b].tokens.size(), 3u);
  // No step computes more than the budget; the long prompt came in chunks of at most 8.
  for (const auto& batch : ex.batches) {
    size_t total = 0;
    for (const auto& w : batch.seqs) total += w.tokens.size();
    EXPECT_LE(total, 8u);
  }
  EXPECT_EQ(ex.batches[0].seqs[0].tokens.size(), 8u);
  EXPECT_FALSE(ex.batches[0].seqs[0].sample);
  // b ran alongside a's decode steps at some point.
  bool together = false;
  for (const auto& batch : ex.batches) together |= batch.seqs.size() == 2;
  EXPECT_TRUE(together);
}

TEST(EngineTest, WaitsForBlocksAndReusesThem) {
  FakeExecutor ex;
  FakeDetokenizer dt;
  // 3 blocks of 4 tokens: one 8-token sequence fits; the second must wait for the first.
  LlmEngine engine(config(/*blocks=*/3), ex, dt);
  auto a = engine.add_request({1, 1, 1, 1, 1, 1}, opts(2));
  auto b = engine.add_request({2, 2, 2, 2, 2, 2}, opts(2));
  auto runs = run_all(engine);
  EXPECT_EQ(runs[*a].finish, "length");
  EXPECT_EQ(runs[*b].finish, "length");
}

TEST(EngineTest, FailedStepFailsOnlyItsRequests) {
  FakeExecutor ex;
  FakeDetokenizer dt;
  LlmEngine engine(config(), ex, dt);
  auto a = engine.add_request({1}, opts(3));
  ex.fail_next = 1;
  auto runs = run_all(engine);
  EXPECT_EQ(runs[*a].finish.rfind("error: ", 0), 0u) << runs[*a].finish;
  // The engine goes on serving.
  auto b = engine.add_request({1}, opts(2));
  runs = run_all(engine);
  EXPECT_EQ(runs[*b].finish, "length");
}

TEST(EngineTest, BadRequestsAreRefusedWithReasons) {
  FakeExecutor ex;
  FakeDetokenizer dt;
  LlmEngine engine(config(64, 2048, /*max_len=*/16), ex, dt);
  EXPECT_EQ(engine.add_request({}, opts(1)).status().code(), Code::kInvalidArgument);
  auto too_long = engine.add_request(std::vector<int32_t>(16, 1), opts(1));
  ASSERT_FALSE(too_long);
  EXPECT_NE(too_long.status().message().find("max-model-len is 16"), std::string::npos);
  EXPECT_NE(engine.add_request({100}, opts(1)).status().message().find("outside the vocab"),
            std::string::npos);
  SamplingParams bad = opts(1);
  bad.top_p = 0;
  EXPECT_NE(engine.add_request({1}, bad).status().message().find("top_p"), std::string::npos);
  bad = opts(0);
  EXPECT_NE(engine.add_request({1}, bad).status().message().find("max_tokens"),
            std::string::npos);
  bad = opts(1);
  bad.temperature = -1;
  EXPECT_NE(engine.add_request({1}, bad).status().message().find("temperature"),
            std::string::npos);
}

TEST(EngineTest, PipelineKeepsSeveralStepsInFlightWithDisjointSequences) {
  FakeExecutor ex;
  ex.depth = 2;
  FakeDetokenizer dt;
  LlmEngine engine(config(64, 4), ex, dt);  // 4 tokens a step: two prompts cannot share one
  auto a = engine.add_request({1, 2, 3, 4}, opts(3));
  auto b = engine.add_request({1, 2, 3, 4}, opts(3));
  ASSERT_TRUE(a && b);
  ex.script[*a] = {1, 2, 8};
  ex.script[*b] = {2, 1, 8};
  auto runs = run_all(engine);
  EXPECT_EQ(runs[*a].tokens, (std::vector<int32_t>{1, 2, 8}));
  EXPECT_EQ(runs[*b].tokens, (std::vector<int32_t>{2, 1, 8}));
  EXPECT_EQ(ex.max_in_flight, 2u);
  // A sequence is never in two steps in flight at once (consecutive steps overlap).
  for (size_t i = 1; i < ex.batches.size(); ++i) {
    for (const auto& s : ex.batches[i].seqs) {
      for (const auto& p : ex.batches[i - 1].seqs) EXPECT_NE(s.request_id, p.request_id);
    }
  }
}

}  // namespace
}  // namespace tessera
