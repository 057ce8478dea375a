// The driver's engine loop with a fake executor: scheduling, KV blocks, stop conditions,
// streaming text, metrics and failure handling — everything but the model.
#include "driver/engine/engine.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "tests/driver/engine_fakes.h"

namespace tessera {
namespace {

using namespace engine_testing;

TEST(EngineTest, StopsAtMaxTokensWithLength) {
  FakeExecutor ex;
  FakeDetokenizer dt;
  LlmEngine engine(config(), ex, dt);
  auto id = add(engine, {1, 2, 3}, opts(5));
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
  auto a = add(engine, {1}, opts(10));
  SamplingParams ignore = opts(4);
  ignore.ignore_eos = true;
  auto b = add(engine, {1}, ignore);
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
  auto id = add(engine, {1}, s);
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
  auto id = add(engine, {1}, s);
  ex.script[*id] = {1, 10, 1};
  auto runs = run_all(engine);
  EXPECT_EQ(runs[*id].tokens, (std::vector<int32_t>{1, 10}));
  EXPECT_EQ(runs[*id].finish, "stop");
}

TEST(EngineTest, PartialUtf8IsHeldBackUntilComplete) {
  FakeExecutor ex;
  FakeDetokenizer dt;
  LlmEngine engine(config(), ex, dt);
  auto id = add(engine, {1}, opts(3));
  ex.script[*id] = {3, 4, 1};  // E4 | BD A0 → "你", then "a"
  auto runs = run_all(engine);
  EXPECT_EQ(runs[*id].text,
            "\xE4\xBD\xA0"
            "a");
  for (const auto& d : runs[*id].deltas) {
    EXPECT_EQ(d.find("\xEF\xBF\xBD"), std::string::npos);
  }
}

TEST(EngineTest, ChunkedPrefillAndContinuousBatching) {
  FakeExecutor ex;
  FakeDetokenizer dt;
  LlmEngine engine(config(64, /*budget=*/8), ex, dt);
  std::vector<int32_t> long_prompt(20, 1);
  auto a = add(engine, long_prompt, opts(3));
  auto b = add(engine, {2, 2}, opts(3));
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
  auto a = add(engine, {1, 1, 1, 1, 1, 1}, opts(2));
  auto b = add(engine, {2, 2, 2, 2, 2, 2}, opts(2));
  auto runs = run_all(engine);
  EXPECT_EQ(runs[*a].finish, "length");
  EXPECT_EQ(runs[*b].finish, "length");
}

TEST(EngineTest, FailedStepFailsOnlyItsRequests) {
  FakeExecutor ex;
  FakeDetokenizer dt;
  LlmEngine engine(config(), ex, dt);
  auto a = add(engine, {1}, opts(3));
  ex.fail_next = 1;
  auto runs = run_all(engine);
  EXPECT_EQ(runs[*a].finish, "error");
  EXPECT_FALSE(runs[*a].error.is_ok());
  // The engine goes on serving.
  auto b = add(engine, {1}, opts(2));
  runs = run_all(engine);
  EXPECT_EQ(runs[*b].finish, "length");
}

TEST(EngineTest, AFailedSubmitFailsItsRequestsAndForgetsNothing) {
  FakeExecutor ex;
  FakeDetokenizer dt;
  LlmEngine engine(config(), ex, dt);
  auto a = add(engine, {30}, opts(1));
  ASSERT_TRUE(a);
  auto runs = run_all(engine);
  EXPECT_EQ(runs[*a].finish, "length");
  auto b = add(engine, {31}, opts(2));
  ex.fail_submit = 1;
  runs = run_all(engine);
  EXPECT_EQ(runs[*b].finish, "error");
  EXPECT_FALSE(runs[*b].error.is_ok());
  // The step that was to tell the actors to forget a never arrived: the next one does.
  auto c = add(engine, {32}, opts(2));
  runs = run_all(engine);
  EXPECT_EQ(runs[*c].finish, "length");
  std::vector<uint64_t> forget;  // the last step's that had some
  for (const auto& batch : ex.batches) {
    if (!batch.finished.empty()) forget = batch.finished;
  }
  EXPECT_NE(std::find(forget.begin(), forget.end(), *a), forget.end());
  EXPECT_NE(std::find(forget.begin(), forget.end(), *b), forget.end());
  EXPECT_TRUE(ex.violations.empty()) << ex.violations.front();
}

TEST(EngineTest, BadRequestsAreRefusedWithReasons) {
  FakeExecutor ex;
  FakeDetokenizer dt;
  LlmEngine engine(config(64, 2048, /*max_len=*/16), ex, dt);
  EXPECT_EQ(add(engine, {}, opts(1)).status().code(), Code::kInvalidArgument);
  auto too_long = add(engine, std::vector<int32_t>(16, 1), opts(1));
  ASSERT_FALSE(too_long);
  EXPECT_NE(too_long.status().message().find("max-model-len is 16"), std::string::npos);
  EXPECT_NE(add(engine, {100}, opts(1)).status().message().find("outside the vocab"),
            std::string::npos);
  SamplingParams bad = opts(1);
  bad.top_p = 0;
  EXPECT_NE(add(engine, {1}, bad).status().message().find("top_p"), std::string::npos);
  bad = opts(0);
  EXPECT_NE(add(engine, {1}, bad).status().message().find("max_tokens"), std::string::npos);
  bad = opts(1);
  bad.temperature = -1;
  EXPECT_NE(add(engine, {1}, bad).status().message().find("temperature"), std::string::npos);
}

// What only the engine knows: a valid request (request.h) whose prompt the whole KV cache cannot
// hold is refused there, with nothing queued.
TEST(EngineTest, APromptLargerThanTheKvCacheIsRefusedByTheEngine) {
  FakeExecutor ex;
  FakeDetokenizer dt;
  LlmEngine engine(config(/*blocks=*/2, 2048, /*max_len=*/256), ex, dt);  // 8 tokens of cache
  auto request = Request::make(std::vector<int32_t>(8, 1), opts(1), engine.config().model);
  ASSERT_TRUE(request) << request.status().to_string();
  auto id = engine.add_request(std::move(*request));
  ASSERT_FALSE(id);
  EXPECT_NE(id.status().message().find("more than the KV cache holds (8 tokens)"),
            std::string::npos)
      << id.status().to_string();
  EXPECT_FALSE(engine.has_unfinished());
  EXPECT_TRUE(add(engine, std::vector<int32_t>(7, 1), opts(1)));
}

TEST(EngineTest, PipelineKeepsSeveralStepsInFlightWithDisjointSequences) {
  FakeExecutor ex;
  ex.depth = 2;
  FakeDetokenizer dt;
  LlmEngine engine(config(64, 4), ex, dt);  // 4 tokens a step: two prompts cannot share one
  auto a = add(engine, {1, 2, 3, 4}, opts(3));
  auto b = add(engine, {1, 2, 3, 4}, opts(3));
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

EngineConfig async_config() {
  EngineConfig c = config();
  c.async_scheduling = true;
  return c;
}

// Async scheduling: each decode step is submitted while the one before is in flight, its input
// the token that step samples (kSampledToken, filled in by the fake as the actor does). Stop
// conditions found in a token end the request with exactly the tokens one step at a time gives;
// the step already in flight for it is computed and its result dropped.
TEST(EngineAsyncTest, StopConditionsGiveTheSameOutput) {
  for (bool async : {false, true}) {
    SCOPED_TRACE(async ? "async" : "one step at a time");
    FakeExecutor ex;
    FakeDetokenizer dt;
    LlmEngine engine(async ? async_config() : config(), ex, dt);
    auto length = add(engine, {1, 2, 3}, opts(5));
    auto eos = add(engine, {1}, opts(10));
    SamplingParams stop_string = opts(20);
    stop_string.stop = {"STOP"};
    auto stop = add(engine, {1}, stop_string);
    SamplingParams stop_id = opts(20);
    stop_id.stop_token_ids = {10};
    auto id10 = add(engine, {1}, stop_id);
    ASSERT_TRUE(length && eos && stop && id10);
    ex.script[*length] = {1, 2, 1, 2, 1, 2, 1};
    ex.script[*eos] = {2, 9, 2, 2};
    ex.script[*stop] = {1, 5, 6, 7, 8, 1, 1};
    ex.script[*id10] = {1, 10, 1, 1};
    auto runs = run_all(engine);
    EXPECT_EQ(runs[*length].tokens, (std::vector<int32_t>{1, 2, 1, 2, 1}));
    EXPECT_EQ(runs[*length].finish, "length");
    EXPECT_EQ(runs[*eos].tokens, (std::vector<int32_t>{2, 9}));
    EXPECT_EQ(runs[*eos].finish, "stop");
    EXPECT_EQ(runs[*stop].text, "a X");
    EXPECT_EQ(runs[*stop].finish, "stop");
    EXPECT_EQ(runs[*id10].tokens, (std::vector<int32_t>{1, 10}));
    EXPECT_TRUE(ex.violations.empty()) << ex.violations.front();
    EXPECT_EQ(engine.stats().kv_blocks_used, 0u);
    EXPECT_EQ(ex.max_in_flight, async ? 2u : 1u);
    size_t ahead = 0;  // decode steps sent before their input token was known
    for (const auto& b : ex.batches) {
      for (const auto& s : b.seqs) ahead += s.tokens == std::vector<int32_t>{kSampledToken};
    }
    if (async) {
      EXPECT_GT(ahead, 0u);
    } else {
      EXPECT_EQ(ahead, 0u);
    }
    // max_tokens is known ahead: no step is sent for a token past it.
    size_t length_steps = 0;
    for (const auto& b : ex.batches) {
      for (const auto& s : b.seqs) length_steps += s.request_id == *length;
    }
    EXPECT_EQ(length_steps, 5u);
  }
}

// A failed step with async scheduling fails its requests, also those the step after it holds
// (whose result is dropped), and the engine goes on; an abort while a step in flight holds a
// request ends it at once, the others unaffected.
TEST(EngineAsyncTest, FailuresAndAbortsWithTwoStepsInFlight) {
  FakeExecutor ex;
  FakeDetokenizer dt;
  LlmEngine engine(async_config(), ex, dt);
  auto a = add(engine, {1}, opts(6));
  ASSERT_TRUE(a);
  ASSERT_TRUE(engine.step());  // the prompt's step, then the first decode ahead of it
  ASSERT_TRUE(engine.step());
  ex.fail_next = 1;
  auto runs = run_all(engine);
  EXPECT_EQ(runs[*a].finish, "error");
  EXPECT_FALSE(runs[*a].error.is_ok());
  EXPECT_FALSE(engine.has_unfinished());
  // The step after the failed one continued `a` past the step the fake dropped (real actors
  // refuse that: a position that does not continue the request); its result was dropped.
  ex.violations.clear();
  auto b = add(engine, {1}, opts(8));
  auto c = add(engine, {2}, opts(8));
  ASSERT_TRUE(b && c);
  size_t c_tokens = 0, b_tokens = 0;
  for (int i = 0; i < 2; ++i) {
    auto outs = engine.step();
    ASSERT_TRUE(outs);
    for (const auto& o : *outs) (o.request_id == *c ? c_tokens : b_tokens) += o.new_tokens.size();
  }
  ASSERT_EQ(ex.in_flight.size(), 1u);  // the decode step ahead, holding b and c
  auto aborted = engine.abort_request(*b);
  ASSERT_TRUE(aborted);
  EXPECT_EQ(aborted->finish_reason, FinishReason::kAbort);
  runs = run_all(engine);
  EXPECT_EQ(runs[*c].finish, "length");
  EXPECT_EQ(c_tokens + runs[*c].tokens.size(), 8u);
  EXPECT_EQ(b_tokens, 2u);
  EXPECT_TRUE(runs[*b].tokens.empty());  // nothing after the abort
  EXPECT_FALSE(engine.has_unfinished());
  EXPECT_EQ(engine.stats().kv_blocks_used, 0u);
  EXPECT_TRUE(ex.violations.empty()) << ex.violations.front();
}

TEST(EngineTextTest, EachTokenIsDetokenizedOnce) {
  FakeExecutor ex;
  FakeDetokenizer dt;
  LlmEngine engine(config(), ex, dt);
  auto a = add(engine, {1}, opts(40));
  auto b = add(engine, {2}, opts(25));
  ASSERT_TRUE(a && b);
  for (int i = 0; i < 40; ++i) ex.script[*a].push_back(i % 2 ? 1 : 2);
  auto runs = run_all(engine);
  EXPECT_EQ(runs[*a].text.size(), 40u);
  EXPECT_EQ(dt.pushes, 65u);
}

TEST(EngineTextTest, OnlyWhatMayStartAStopStringIsHeldBack) {
  FakeExecutor ex;
  FakeDetokenizer dt;
  LlmEngine engine(config(), ex, dt);
  SamplingParams s = opts(20);
  s.stop = {"STOP", "zz"};
  auto id = add(engine, {1}, s);
  // "a" " X" "S" "T" "!" "S" "T" "O" "P": the stop string spans four tokens.
  ex.script[*id] = {1, 5, 11, 12, 8, 11, 12, 13, 14, 1};
  auto runs = run_all(engine);
  EXPECT_EQ(runs[*id].text, "a XST!");
  EXPECT_EQ(runs[*id].finish, "stop");
  EXPECT_EQ(runs[*id].deltas, (std::vector<std::string>{"a", " X", "ST!"}));
}

TEST(EngineTextTest, AnUnfinishedCharacterAtTheEndIsDropped) {
  FakeExecutor ex;
  FakeDetokenizer dt;
  LlmEngine engine(config(), ex, dt);
  auto id = add(engine, {1}, opts(2));
  ex.script[*id] = {1, 3};  // "a", then the first byte of a 3-byte character
  auto runs = run_all(engine);
  EXPECT_EQ(runs[*id].text, "a");
  EXPECT_EQ(runs[*id].finish, "length");
}

TEST(EngineTextTest, NoDetokenizerGivesTokensOnly) {
  FakeExecutor ex;
  NoDetokenizer none;
  LlmEngine engine(config(), ex, none);
  auto id = add(engine, {1}, opts(3));
  ex.script[*id] = {1, 2, 1};
  auto runs = run_all(engine);
  EXPECT_EQ(runs[*id].tokens, (std::vector<int32_t>{1, 2, 1}));
  EXPECT_EQ(runs[*id].text, "");
}

TEST(EngineStatsTest, CountsRequestsBlocksAndTokens) {
  FakeExecutor ex;
  FakeDetokenizer dt;
  EngineConfig c = config(/*blocks=*/10);
  c.model.max_num_seqs = 1;
  LlmEngine engine(c, ex, dt);
  EngineStats s = engine.stats();
  EXPECT_EQ(s.kv_blocks_total, 10u);
  EXPECT_EQ(s.kv_cache_usage, 0.0);
  ASSERT_TRUE(add(engine, {30, 31, 32, 33, 34}, opts(5)));
  ASSERT_TRUE(add(engine, {40, 41}, opts(4)));
  ASSERT_TRUE(engine.step());
  s = engine.stats();
  EXPECT_EQ(s.running, 1u);
  EXPECT_EQ(s.waiting, 1u);
  EXPECT_EQ(s.kv_blocks_used, 2u);  // 5 prompt tokens in blocks of 4
  EXPECT_DOUBLE_EQ(s.kv_cache_usage, 0.2);
  EXPECT_EQ(s.prompt_tokens, 5u);
  EXPECT_EQ(s.generation_tokens, 1u);
  run_all(engine);
  s = engine.stats();
  EXPECT_EQ(s.running, 0u);
  EXPECT_EQ(s.waiting, 0u);
  EXPECT_EQ(s.kv_blocks_used, 0u);
  EXPECT_EQ(s.prompt_tokens, 7u);
  EXPECT_EQ(s.generation_tokens, 9u);
  EXPECT_EQ(s.preemptions, 0u);
  EXPECT_EQ(s.prefix_cache_queries, 7u);
  EXPECT_EQ(s.prefix_cache_hits, 0u);
}

}  // namespace
}  // namespace tessera
