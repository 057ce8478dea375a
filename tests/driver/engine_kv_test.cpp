// The engine's KV-cache policies with the content-computing fake executor: prefix caching
// (output identical with it off), preemption by recompute when blocks run out (output identical
// to an ample cache), and abort in every state a request can be in.
#include <gtest/gtest.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "driver/engine/engine.h"
#include "tests/driver/engine_fakes.h"

namespace tessera {
namespace {

using namespace engine_testing;

struct Arrival {
  size_t at_step = 0;  // added before this step() call
  std::vector<int32_t> prompt;
  int max_tokens = 8;
};

struct Workload {
  std::vector<Run> runs;  // in arrival order
  EngineStats stats;
  std::vector<StepInput> batches;
  std::vector<std::string> violations;
  std::vector<uint64_t> ids;
  size_t max_in_flight = 0;  // steps the executor had at once
};

// Runs `arrivals` through an engine over the content-computing fake, to the end.
Workload run_workload(const EngineConfig& c, int depth, const std::vector<Arrival>& arrivals) {
  FakeExecutor ex(static_cast<uint32_t>(c.model.block_size),
                  static_cast<uint32_t>(c.model.kv_blocks));
  ex.depth = depth;
  ex.window = c.kv_window;
  FakeDetokenizer dt;
  LlmEngine engine(c, ex, dt);
  Workload w;
  w.ids.assign(arrivals.size(), 0);
  std::map<uint64_t, Run> runs;
  size_t added = 0;
  for (size_t step = 0; step < 5000; ++step) {
    for (size_t i = 0; i < arrivals.size(); ++i) {
      if (arrivals[i].at_step != step) continue;
      auto id = add(engine, arrivals[i].prompt, opts(arrivals[i].max_tokens));
      EXPECT_TRUE(id) << id.status().to_string();
      if (!id) return w;
      w.ids[i] = *id;
      ++added;
    }
    if (added == arrivals.size() && !engine.has_unfinished()) break;
    auto outs = engine.step();
    EXPECT_TRUE(outs) << outs.status().to_string();
    if (!outs) break;
    for (auto& o : *outs) {
      auto& r = runs[o.request_id];
      r.text += o.delta;
      r.tokens.insert(r.tokens.end(), o.new_tokens.begin(), o.new_tokens.end());
      if (o.finished) r.finish = finish_reason_name(o.finish_reason);
      r.cached_tokens = o.cached_tokens;
    }
  }
  EXPECT_FALSE(engine.has_unfinished());
  for (uint64_t id : w.ids) w.runs.push_back(runs[id]);
  w.stats = engine.stats();
  w.batches = ex.batches;
  w.violations = ex.violations;
  w.max_in_flight = ex.max_in_flight;
  return w;
}

EngineConfig caching(bool on, uint32_t blocks = 256, uint32_t budget = 2048) {
  EngineConfig c = config(blocks, budget);
  c.enable_prefix_caching = on;
  return c;
}

size_t tokens_sent(const std::vector<StepInput>& batches) {
  size_t n = 0;
  for (const auto& b : batches) {
    for (const auto& s : b.seqs) n += s.tokens.size();
  }
  return n;
}

// Requests sharing a 10-token system prompt (two full blocks of 4), some identical, some
// arriving while others run, some after they finished.
std::vector<Arrival> shared_prefix_workload() {
  std::vector<int32_t> system = {30, 31, 32, 33, 34, 35, 36, 37, 38, 39};
  auto with = [&](std::vector<int32_t> tail) {
    std::vector<int32_t> p = system;
    p.insert(p.end(), tail.begin(), tail.end());
    return p;
  };
  return {
      {0, with({50, 51}), 6},        {0, with({52}), 5},
      {2, with({50, 51}), 6},        {3, with({50, 51, 53, 54, 55, 56}), 7},
      {12, with({50, 51}), 6},       {12, {30, 31, 32, 33, 60, 61, 62, 63, 64}, 4},
      {13, {40, 41, 42, 43, 44}, 5}, {20, {30, 31, 32, 33, 60, 61, 62, 63, 64}, 4},
  };
}

TEST(EnginePrefixCacheTest, OutputIsIdenticalWithAndWithoutCaching) {
  for (int depth : {1, 2}) {
    SCOPED_TRACE("pipeline depth " + std::to_string(depth));
    Workload off = run_workload(caching(false), depth, shared_prefix_workload());
    Workload on = run_workload(caching(true), depth, shared_prefix_workload());
    EXPECT_TRUE(off.violations.empty()) << off.violations.front();
    EXPECT_TRUE(on.violations.empty()) << on.violations.front();
    ASSERT_EQ(on.runs.size(), off.runs.size());
    for (size_t i = 0; i < on.runs.size(); ++i) {
      EXPECT_EQ(on.runs[i], off.runs[i]) << "request " << i;
      EXPECT_EQ(on.runs[i].finish, "length");
    }
    // The cache was used: fewer tokens computed, first steps that start past position 0.
    EXPECT_GT(on.stats.prefix_cache_hits, 0u);
    EXPECT_GE(on.stats.prefix_cache_queries, on.stats.prefix_cache_hits);
    EXPECT_EQ(off.stats.prefix_cache_queries, 0u);
    EXPECT_EQ(tokens_sent(off.batches) - tokens_sent(on.batches), on.stats.prefix_cache_hits);
    bool started_late = false;
    for (const auto& b : on.batches) {
      for (const auto& s : b.seqs) started_late |= s.first && s.start_position > 0;
    }
    EXPECT_TRUE(started_late);
    EXPECT_EQ(on.stats.kv_blocks_used, 0u);  // cached blocks nobody holds count as free
  }
}

TEST(EnginePrefixCacheTest, RecomputesTheLastPromptToken) {
  std::vector<int32_t> prompt = {30, 31, 32, 33, 34, 35, 36, 37};  // exactly two blocks
  std::vector<int32_t> longer = prompt;
  longer.push_back(38);
  Workload w = run_workload(caching(true), 1, {{0, prompt, 3}, {5, prompt, 3}, {10, longer, 3}});
  EXPECT_TRUE(w.violations.empty()) << w.violations.front();
  EXPECT_EQ(w.runs[1], w.runs[0]);  // same prompt, same content, same tokens
  EXPECT_EQ(w.runs[0].cached_tokens, 0u);
  // The identical prompt reuses only its first block: the second holds the last prompt token,
  // which must be computed for its logits (and a shared block is never written).
  EXPECT_EQ(w.runs[1].cached_tokens, 4u);
  EXPECT_EQ(w.runs[2].cached_tokens, 8u);
  std::vector<const SeqStep*> firsts;
  for (const auto& b : w.batches) {
    for (const auto& s : b.seqs) {
      if (s.first) firsts.push_back(&s);
    }
  }
  ASSERT_EQ(firsts.size(), 3u);
  EXPECT_EQ(firsts[1]->start_position, 4);
  EXPECT_EQ(firsts[1]->tokens, (std::vector<int32_t>{34, 35, 36, 37}));
  EXPECT_EQ(firsts[1]->new_blocks.size(), 2u);  // the cached block leads the table
  EXPECT_EQ(firsts[2]->start_position, 8);
  EXPECT_EQ(firsts[2]->tokens, (std::vector<int32_t>{38}));
  EXPECT_EQ(w.stats.prefix_cache_queries, 8u + 8u + 9u);
  EXPECT_EQ(w.stats.prefix_cache_hits, 4u + 8u);
}

TEST(EnginePrefixCacheTest, CachedBlocksAreEvictedWhenNeeded) {
  std::vector<int32_t> prompt = {30, 31, 32, 33, 34, 35, 36, 37, 38};
  std::vector<int32_t> big(20);
  for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<int32_t>(40 + i);
  // 6 blocks: the big request needs all of them, so the first request's cached blocks go.
  Workload w =
      run_workload(caching(true, /*blocks=*/6), 1, {{0, prompt, 2}, {5, big, 3}, {10, prompt, 2}});
  EXPECT_TRUE(w.violations.empty()) << w.violations.front();
  EXPECT_EQ(w.runs[2], w.runs[0]);
  EXPECT_EQ(w.runs[1].finish, "length");
  EXPECT_EQ(w.runs[2].cached_tokens, 0u);  // evicted
  EXPECT_EQ(w.stats.prefix_cache_hits, 0u);
  // With room to spare the same sequence of requests hits.
  Workload roomy =
      run_workload(caching(true, /*blocks=*/64), 1, {{0, prompt, 2}, {5, big, 3}, {10, prompt, 2}});
  EXPECT_EQ(roomy.runs[2].cached_tokens, 8u);
  EXPECT_EQ(roomy.runs[2], w.runs[2]);
}

// A chat's next turn: its prompt is the last prompt, the answer and a new question. The
// answer's blocks were cached as they filled, so the next turn computes little more than the
// question.
TEST(EnginePrefixCacheTest, NextTurnReusesTheAnswerBlocks) {
  std::vector<int32_t> first = {30, 31, 32, 33, 34};
  Workload alone = run_workload(caching(true), 1, {{0, first, 7}});
  std::vector<int32_t> next = first;  // 5 + 7 tokens, then 3 more
  next.insert(next.end(), alone.runs[0].tokens.begin(), alone.runs[0].tokens.end());
  next.insert(next.end(), {70, 71, 72});
  std::vector<Arrival> chat = {{0, first, 7}, {10, next, 4}};
  Workload on = run_workload(caching(true), 1, chat);
  Workload off = run_workload(caching(false), 1, chat);
  EXPECT_TRUE(on.violations.empty()) << on.violations.front();
  EXPECT_EQ(on.runs, off.runs);
  // The first turn computed 11 of its 12 tokens (the last sampled one never): 2 full blocks.
  EXPECT_EQ(on.runs[1].cached_tokens, 8u);
}

std::vector<Arrival> crowd(size_t n, int max_tokens) {
  std::vector<Arrival> a;
  for (size_t i = 0; i < n; ++i) {
    std::vector<int32_t> p;
    for (size_t k = 0; k < 3 + i % 5; ++k) p.push_back(static_cast<int32_t>(20 + (i * 7 + k) % 60));
    a.push_back({0, p, max_tokens});
  }
  return a;
}

// `got` and `want` ran the crowd workload: no violation in `got`, every request's output the same
// (all 12 tokens), no block left held.
void expect_same_runs(const Workload& got, const Workload& want) {
  EXPECT_TRUE(got.violations.empty()) << got.violations.front();
  ASSERT_EQ(got.runs.size(), want.runs.size());
  for (size_t i = 0; i < got.runs.size(); ++i) {
    EXPECT_EQ(got.runs[i], want.runs[i]) << "request " << i;
    EXPECT_EQ(got.runs[i].tokens.size(), 12u);
  }
  EXPECT_EQ(got.stats.generation_tokens, want.stats.generation_tokens);
  EXPECT_EQ(got.stats.kv_blocks_used, 0u);
}

TEST(EnginePreemptionTest, TinyBudgetFinishesEverythingLikeAnAmpleOne) {
  for (bool prefix : {false, true}) {
    for (int depth : {1, 2}) {
      SCOPED_TRACE(std::string("prefix caching ") + (prefix ? "on" : "off") + ", depth " +
                   std::to_string(depth));
      Workload ample = run_workload(caching(prefix, 256), depth, crowd(10, 12));
      // 8 blocks of 4 = 32 tokens for ten requests of up to 19 tokens each.
      Workload tight = run_workload(caching(prefix, 8), depth, crowd(10, 12));
      EXPECT_EQ(ample.stats.preemptions, 0u);
      EXPECT_GT(tight.stats.preemptions, 0u);
      expect_same_runs(tight, ample);
    }
  }
}

// `got` ran the crowd workload with two steps in flight, `want` one step at a time.
void expect_same_output_two_in_flight(const Workload& got, const Workload& want) {
  EXPECT_EQ(want.max_in_flight, 1u);
  EXPECT_EQ(got.max_in_flight, 2u);
  expect_same_runs(got, want);
}

// Two pipeline stages: two steps in flight, each with at most half the seats (the running
// sequences split into micro-batches), never the same sequence in both, and every request's
// output what the one-stage engine gives (with an ample cache, and with one so tight that
// requests are preempted).
TEST(EnginePipelineTest, TwoMicroBatchesInFlightGiveTheSameOutput) {
  for (bool prefix : {false, true}) {
    for (uint32_t blocks : {256u, 8u}) {
      SCOPED_TRACE(std::string("prefix caching ") + (prefix ? "on" : "off") + ", " +
                   std::to_string(blocks) + " blocks");
      EngineConfig c = caching(prefix, blocks);
      c.model.max_num_seqs = 6;
      Workload one = run_workload(c, 1, crowd(10, 12));
      Workload two = run_workload(c, 2, crowd(10, 12));
      expect_same_output_two_in_flight(two, one);
      // (The fake records a step that has a sequence a step in flight has as a violation.)
      size_t full_steps = 0;
      for (size_t i = 0; i < two.batches.size(); ++i) {
        EXPECT_LE(two.batches[i].seqs.size(), 3u) << "step " << i;
        full_steps += two.batches[i].seqs.size() == 3;
      }
      EXPECT_GT(full_steps, 0u);
    }
  }
}

// Async scheduling over the content-computing fake: every request's output is what one step at a
// time gives, with an ample cache and with one so tight that requests are preempted, with and
// without prefix caching; two full steps in flight.
TEST(EngineAsyncTest, SameOutputAsOneStepAtATime) {
  for (bool prefix : {false, true}) {
    for (uint32_t blocks : {256u, 8u}) {
      SCOPED_TRACE(std::string("prefix caching ") + (prefix ? "on" : "off") + ", " +
                   std::to_string(blocks) + " blocks");
      EngineConfig c = caching(prefix, blocks);
      EngineConfig a = c;
      a.async_scheduling = true;
      Workload one = run_workload(c, 1, crowd(10, 12));
      Workload two = run_workload(a, 1, crowd(10, 12));
      expect_same_output_two_in_flight(two, one);
      if (blocks == 256) {
        // Ample blocks: each step holds every running request (full batches, unlike the
        // micro-batches of pipeline stages).
        size_t widest = 0;
        for (const auto& b : two.batches) widest = std::max(widest, b.seqs.size());
        EXPECT_EQ(widest, 10u);
      }
    }
  }
}

TEST(EnginePreemptionTest, PreemptsTheMostRecentlyAdmittedAndRestartsItFresh) {
  // 3 blocks of 4: after their prompts, A and B each need a second block and only one is left.
  std::vector<Arrival> two = {{0, {30, 31, 32, 33}, 8}, {0, {40, 41, 42, 43}, 8}};
  Workload w = run_workload(caching(false, 3), 1, two);
  Workload ample = run_workload(caching(false, 64), 1, two);
  EXPECT_TRUE(w.violations.empty()) << w.violations.front();
  EXPECT_EQ(w.runs, ample.runs);
  EXPECT_GE(w.stats.preemptions, 1u);
  // B (admitted second) was preempted: the actors are told to forget it, then it comes back as
  // a first step from position 0 with its prompt and the output it had, re-fed.
  const uint64_t b = w.ids[1];
  size_t forgot = 0;
  for (size_t i = 0; i < w.batches.size() && forgot == 0; ++i) {
    for (uint64_t f : w.batches[i].finished) {
      EXPECT_EQ(f, b) << "only B is preempted";
      if (f == b) forgot = i;
    }
  }
  ASSERT_GT(forgot, 0u);
  const SeqStep* restart = nullptr;
  for (size_t i = forgot; i < w.batches.size() && !restart; ++i) {
    for (const auto& s : w.batches[i].seqs) {
      if (s.request_id == b) restart = &s;
    }
  }
  ASSERT_NE(restart, nullptr);
  EXPECT_TRUE(restart->first);
  EXPECT_EQ(restart->start_position, 0);
  EXPECT_EQ(restart->prompt_len, 4);
  ASSERT_EQ(restart->tokens.size(), 5u);  // prompt + the one token it had
  EXPECT_EQ(restart->tokens[4], w.runs[1].tokens[0]);
}

// A request alone in the cache ends with "length" when the cache is full rather than waiting
// forever for a block that cannot come.
TEST(EnginePreemptionTest, ARequestLongerThanTheCacheEndsWithLength) {
  Workload w = run_workload(caching(false, 2), 1, {{0, {30, 31, 32}, 20}});
  EXPECT_EQ(w.runs[0].finish, "length");
  EXPECT_EQ(w.runs[0].tokens.size(), 5u);  // 3 + 5 = 8 tokens: the whole cache
}

// A sliding-window model (every layer attends to the last 6 positions): requests several times
// longer than the whole cache (6 blocks of 4) run to their max_tokens, the blocks that fall out
// of their windows freed and handed to the others, and give what an ample cache without freeing
// gives (the fake reads position p - 1, inside every window). With and without prefix caching,
// one step or two in flight (async scheduling).
TEST(EngineSlidingWindowTest, RequestsLongerThanTheCacheRunToTheirLength) {
  std::vector<Arrival> arrivals;
  for (int i = 0; i < 3; ++i) {
    std::vector<int32_t> prompt;
    for (int k = 0; k < 12 + i; ++k) prompt.push_back(20 + (i * 13 + k * 7) % 60);
    arrivals.push_back({static_cast<size_t>(i), prompt, 40});
  }
  Workload ample = run_workload(caching(true, 256), 1, arrivals);
  for (bool prefix : {false, true}) {
    for (bool async : {false, true}) {
      SCOPED_TRACE(std::string("prefix caching ") + (prefix ? "on" : "off") +
                   (async ? ", async scheduling" : ""));
      EngineConfig c = caching(prefix, 6, 8);
      c.kv_window = 6;
      c.async_scheduling = async;
      Workload tight = run_workload(c, 1, arrivals);
      EXPECT_TRUE(tight.violations.empty()) << tight.violations.front();
      ASSERT_EQ(tight.runs.size(), ample.runs.size());
      for (size_t i = 0; i < tight.runs.size(); ++i) {
        EXPECT_EQ(tight.runs[i], ample.runs[i]) << "request " << i;
        EXPECT_EQ(tight.runs[i].tokens.size(), 40u) << "request " << i;
        EXPECT_EQ(tight.runs[i].finish, "length");
      }
      EXPECT_EQ(tight.stats.kv_blocks_used, 0u);
    }
  }
  // Without the window the same cache holds 24 tokens: a request alone stops there.
  Workload capped = run_workload(caching(false, 6, 8), 1, {arrivals[0]});
  EXPECT_EQ(capped.runs[0].tokens.size(), 24u - 12u);
}

// A cache too small for the window itself refuses the request, saying so.
TEST(EngineSlidingWindowTest, ACacheSmallerThanTheWindowRefusesNamingIt) {
  EngineConfig c = config(4, 8);
  c.kv_window = 16;  // a step needs (16 + n - 2) / 4 + 2 > 4 blocks for any n
  FakeExecutor ex(4, 4);
  FakeDetokenizer dt;
  LlmEngine engine(c, ex, dt);
  auto id = add(engine, {20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34, 35, 36, 37},
                opts(4));
  ASSERT_FALSE(id);
  EXPECT_NE(id.status().message().find("sliding window of 16"), std::string::npos)
      << id.status().to_string();
}

struct AbortFixture {
  FakeExecutor ex;
  FakeDetokenizer dt;
  std::unique_ptr<LlmEngine> engine;
  std::map<uint64_t, Run> runs;

  explicit AbortFixture(EngineConfig c, int depth = 1) {
    ex.depth = depth;
    engine = std::make_unique<LlmEngine>(c, ex, dt);
  }
  uint64_t add(std::vector<int32_t> prompt, int max_tokens) {
    auto id = engine_testing::add(*engine, std::move(prompt), opts(max_tokens));
    EXPECT_TRUE(id);
    return id ? *id : 0;
  }
  void step() {
    auto outs = engine->step();
    ASSERT_TRUE(outs) << outs.status().to_string();
    for (auto& o : *outs) {
      auto& r = runs[o.request_id];
      r.text += o.delta;
      r.tokens.insert(r.tokens.end(), o.new_tokens.begin(), o.new_tokens.end());
      if (o.finished) r.finish = finish_reason_name(o.finish_reason);
    }
  }
  void finish() {
    for (int i = 0; i < 1000 && engine->has_unfinished(); ++i) step();
    EXPECT_FALSE(engine->has_unfinished());
  }
  bool ever_sent(uint64_t id, size_t from_batch = 0) const {
    for (size_t i = from_batch; i < ex.batches.size(); ++i) {
      for (const auto& s : ex.batches[i].seqs) {
        if (s.request_id == id) return true;
      }
    }
    return false;
  }
  bool told_to_forget(uint64_t id) const {
    for (const auto& b : ex.batches) {
      for (uint64_t f : b.finished) {
        if (f == id) return true;
      }
    }
    return false;
  }
};

// What request `prompt` generates alone.
Run solo(std::vector<int32_t> prompt, int max_tokens) {
  Workload w = run_workload(config(), 1, {{0, std::move(prompt), max_tokens}});
  return w.runs[0];
}

// ---- fairness: first come, first served, as vLLM's scheduler ---------------------------------

// The first and the last step (index into the batches) that carried a request; -1 if none.
struct Span {
  int first = -1, last = -1;
};
Span steps_of(const Workload& w, uint64_t id) {
  int first = -1, last = -1;
  for (size_t i = 0; i < w.batches.size(); ++i) {
    for (const auto& s : w.batches[i].seqs) {
      if (s.request_id != id) continue;
      if (first < 0) first = static_cast<int>(i);
      last = static_cast<int>(i);
    }
  }
  return Span{first, last};
}

// Six equal requests at once and blocks for two of them to finish side by side: they start in
// the order they came, and when blocks run out the newest is preempted (vLLM's rule), so they
// also finish in that order: nobody who came earlier waits on somebody who came later.
TEST(EngineFairnessTest, ServesInArrivalOrder) {
  std::vector<Arrival> six;
  for (int i = 0; i < 6; ++i) six.push_back({0, {20 + i, 30 + i, 40 + i, 50 + i}, 4});
  Workload w = run_workload(caching(false, 4), 1, six);  // a request needs 2 of the 4 blocks
  EXPECT_TRUE(w.violations.empty()) << w.violations.front();
  std::vector<Span> spans;
  for (uint64_t id : w.ids) spans.push_back(steps_of(w, id));
  for (size_t i = 1; i < spans.size(); ++i) {
    EXPECT_GE(spans[i].first, spans[i - 1].first) << "request " << i << " started before " << i - 1;
    EXPECT_GE(spans[i].last, spans[i - 1].last) << "request " << i << " finished before " << i - 1;
  }
  EXPECT_GT(spans[5].first, spans[0].last) << "the last one cannot have run beside the first";
  for (const engine_testing::Run& r : w.runs) EXPECT_EQ(r.tokens.size(), 4u);
}

// A request at the head of the queue that does not fit yet is not overtaken by a smaller one
// behind it (no starvation of long prompts): the small one waits its turn.
TEST(EngineFairnessTest, TheHeadOfTheQueueIsNotOvertaken) {
  std::vector<int32_t> big;
  for (int i = 0; i < 16; ++i) big.push_back(20 + i);
  const std::vector<Arrival> arrivals = {
      {0, {60, 61, 62, 63}, 12},  // runs first, holds 4 of the 6 blocks for a while
      {1, big, 2},                // needs 5 blocks: waits for the first to finish
      {2, {70, 71}, 2},           // would fit at once, but came after the big one
  };
  Workload w = run_workload(caching(false, 6), 1, arrivals);
  EXPECT_TRUE(w.violations.empty()) << w.violations.front();
  const auto first = steps_of(w, w.ids[0]), head = steps_of(w, w.ids[1]),
             small = steps_of(w, w.ids[2]);
  ASSERT_GE(head.first, 0);
  ASSERT_GE(small.first, 0);
  EXPECT_GT(head.first, first.first);
  EXPECT_GE(small.first, head.first) << "the small request jumped the queue";
  for (const engine_testing::Run& r : w.runs) EXPECT_FALSE(r.tokens.empty());
}

// A preempted request goes back to the front of the queue: it runs again before requests that
// arrived after it, however small.
TEST(EngineFairnessTest, APreemptedRequestResumesBeforeNewerOnes) {
  std::vector<Arrival> arrivals = {{0, {30, 31, 32, 33}, 8}, {0, {40, 41, 42, 43}, 8}};
  for (int i = 0; i < 3; ++i) arrivals.push_back({3, {50 + i}, 2});
  Workload w = run_workload(caching(false, 3), 1, arrivals);
  EXPECT_TRUE(w.violations.empty()) << w.violations.front();
  ASSERT_GE(w.stats.preemptions, 1u);
  // B (the second) was preempted: find its restart (a first step after the first one).
  const uint64_t b = w.ids[1];
  int restart = -1, seen_first = 0;
  for (size_t i = 0; i < w.batches.size() && restart < 0; ++i) {
    for (const auto& s : w.batches[i].seqs) {
      if (s.request_id == b && s.first && ++seen_first == 2) restart = static_cast<int>(i);
    }
  }
  ASSERT_GE(restart, 0) << "B never restarted";
  for (size_t k = 2; k < w.ids.size(); ++k) {
    EXPECT_GE(steps_of(w, w.ids[k]).first, restart) << "newer request " << k << " ran first";
  }
}

// Chunked prefill does not starve decodes: while a long prompt is computed in chunks under a
// small token budget, a running request gets a token in every one of those steps.
TEST(EngineFairnessTest, DecodesGoOnWhileALongPromptIsChunked) {
  std::vector<int32_t> long_prompt;
  for (int i = 0; i < 40; ++i) long_prompt.push_back(20 + i % 60);
  const std::vector<Arrival> arrivals = {{0, {60, 61}, 30}, {2, long_prompt, 2}};
  Workload w = run_workload(caching(false, 64, /*budget=*/8), 1, arrivals);
  EXPECT_TRUE(w.violations.empty()) << w.violations.front();
  const uint64_t decode = w.ids[0], prompt = w.ids[1];
  int chunks = 0;
  for (const StepInput& b : w.batches) {
    bool has_prompt = false, has_decode = false;
    for (const auto& s : b.seqs) {
      has_prompt |= s.request_id == prompt && s.tokens.size() > 1;
      has_decode |= s.request_id == decode;
    }
    if (!has_prompt) continue;
    ++chunks;
    EXPECT_TRUE(has_decode) << "a prompt chunk ran without the running request's decode";
  }
  EXPECT_GE(chunks, 5) << "40 tokens under a budget of 8 take several steps";
  EXPECT_EQ(w.runs[0].tokens.size(), 30u);
}

TEST(EngineAbortTest, Waiting) {
  EngineConfig c = config();
  c.model.max_num_seqs = 1;
  AbortFixture f(c);
  uint64_t a = f.add({30, 31, 32}, 4);
  uint64_t b = f.add({40, 41}, 4);
  f.step();
  EXPECT_EQ(f.engine->stats().waiting, 1u);
  auto out = f.engine->abort_request(b);
  ASSERT_TRUE(out);
  EXPECT_EQ(out->request_id, b);
  EXPECT_TRUE(out->finished);
  EXPECT_EQ(out->finish_reason, FinishReason::kAbort);
  EXPECT_EQ(out->completion_tokens, 0u);
  EXPECT_EQ(f.engine->stats().waiting, 0u);
  EXPECT_FALSE(f.engine->abort_request(b));  // once only
  f.finish();
  EXPECT_FALSE(f.runs.count(b));
  EXPECT_FALSE(f.ever_sent(b));
  EXPECT_FALSE(f.told_to_forget(b));  // the actors never knew it
  EXPECT_EQ(f.runs[a], solo({30, 31, 32}, 4));
  EXPECT_TRUE(f.ex.violations.empty()) << f.ex.violations.front();
}

TEST(EngineAbortTest, Running) {
  AbortFixture f(config());
  uint64_t a = f.add({30, 31, 32, 33, 34}, 6);
  uint64_t b = f.add({40, 41}, 6);
  f.step();
  f.step();
  const uint32_t used = f.engine->stats().kv_blocks_used;
  auto out = f.engine->abort_request(a);
  ASSERT_TRUE(out);
  EXPECT_EQ(out->finish_reason, FinishReason::kAbort);
  EXPECT_EQ(out->completion_tokens, 2u);
  EXPECT_TRUE(out->new_tokens.empty());
  EXPECT_EQ(f.engine->stats().kv_blocks_used, used - 2);  // a's 7 tokens were in 2 blocks
  EXPECT_EQ(f.engine->stats().running, 1u);
  const size_t sent_before = f.ex.batches.size();
  f.finish();
  EXPECT_EQ(f.runs[a].tokens.size(), 2u);
  EXPECT_TRUE(f.runs[a].finish.empty());  // its only final output is the abort's
  EXPECT_FALSE(f.ever_sent(a, sent_before));
  ASSERT_GT(f.ex.batches.size(), sent_before);
  EXPECT_EQ(f.ex.batches[sent_before].finished, (std::vector<uint64_t>{a}));
  EXPECT_EQ(f.runs[b], solo({40, 41}, 6));
  EXPECT_EQ(f.engine->stats().kv_blocks_used, 0u);
  EXPECT_TRUE(f.ex.violations.empty()) << f.ex.violations.front();
}

TEST(EngineAbortTest, InFlight) {
  // Two pipeline stages and 4 tokens a step: A's and B's prompts go in different steps.
  AbortFixture f(config(64, 4), /*depth=*/2);
  uint64_t a = f.add({30, 31, 32, 33}, 5);
  uint64_t b = f.add({40, 41, 42, 43}, 5);
  f.step();  // submits A's and B's prefills, collects A's
  ASSERT_TRUE(f.ex.in_flight_has(b));
  const size_t sent_before = f.ex.batches.size();
  auto out = f.engine->abort_request(b);
  ASSERT_TRUE(out);
  EXPECT_EQ(out->finish_reason, FinishReason::kAbort);
  EXPECT_EQ(out->completion_tokens, 0u);
  EXPECT_TRUE(f.engine->has_unfinished());
  f.finish();
  EXPECT_FALSE(f.runs.count(b));  // the step that came back with its token was dropped
  EXPECT_FALSE(f.ever_sent(b, sent_before));
  ASSERT_GT(f.ex.batches.size(), sent_before);
  EXPECT_EQ(f.ex.batches[sent_before].finished, (std::vector<uint64_t>{b}));
  EXPECT_EQ(f.runs[a], solo({30, 31, 32, 33}, 5));
  EXPECT_EQ(f.engine->stats().kv_blocks_used, 0u);
  EXPECT_TRUE(f.ex.violations.empty()) << f.ex.violations.front();
}

TEST(EngineAbortTest, InFlightBlocksGoToTheNextRequest) {
  // 3 blocks, 4 tokens a step: B's first chunk is in flight with a block when it is aborted;
  // its block goes to C (the fake checks nobody writes a block another request holds).
  AbortFixture f(config(/*blocks=*/3, /*budget=*/4), /*depth=*/2);
  uint64_t a = f.add({30, 31, 32, 33}, 3);
  uint64_t b = f.add({40, 41, 42, 43, 44, 45, 46}, 3);
  f.step();
  ASSERT_TRUE(f.ex.in_flight_has(b));
  ASSERT_TRUE(f.engine->abort_request(b));
  uint64_t c = f.add({50, 51, 52, 53, 54, 55}, 3);
  f.finish();
  EXPECT_EQ(f.runs[a], solo({30, 31, 32, 33}, 3));
  EXPECT_EQ(f.runs[c], solo({50, 51, 52, 53, 54, 55}, 3));
  EXPECT_TRUE(f.ex.violations.empty()) << f.ex.violations.front();
}

TEST(EngineAbortTest, UnknownOrFinishedIsNothing) {
  AbortFixture f(config());
  uint64_t a = f.add({30}, 2);
  EXPECT_FALSE(f.engine->abort_request(a + 100));
  f.finish();
  EXPECT_EQ(f.runs[a].finish, "length");
  EXPECT_FALSE(f.engine->abort_request(a));
}

}  // namespace
}  // namespace tessera
