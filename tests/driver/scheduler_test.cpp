// The scheduler alone, over a real block manager: which sequences run each step and how many of
// their tokens (admission against the seats and the token budget, chunked prefill), preemption
// when blocks run out and whom it hits, prefix-cache hits at admission, async scheduling, and
// finishing. The harness does what the engine does around schedule(): marks a step's sequences
// started when it is sent, and when it comes back counts its tokens computed, caches the full
// blocks and appends a sampled token.
#include "driver/engine/scheduler.h"

#include <gtest/gtest.h>

#include <deque>
#include <map>
#include <memory>
#include <tuple>
#include <vector>

namespace tessera {
namespace {

// One scheduled chunk, comparable and printable: {sequence id, start, count, sample}.
using Chunk = std::tuple<uint64_t, size_t, size_t, bool>;
using Chunks = std::vector<Chunk>;

constexpr int32_t kSampled = 7;  // the token every sampling step "samples"

SchedulerConfig config(uint32_t max_num_seqs, uint32_t budget) {
  SchedulerConfig c;
  c.limits.max_num_seqs = max_num_seqs;
  c.limits.max_num_batched_tokens = budget;
  c.limits.max_model_len = 4096;
  return c;
}

class Harness {
 public:
  Harness(SchedulerConfig config, uint32_t num_blocks, uint32_t block_size,
          bool prefix_caching = true, uint32_t window = 0)
      : blocks(num_blocks, block_size, prefix_caching, &BlockManager::hash_block, window),
        scheduler(config, blocks) {}

  // Adds a sequence with this prompt; it stays owned by the scheduler.
  Sequence* add(uint64_t id, std::vector<int32_t> prompt, int max_tokens = 100) {
    auto seq = std::make_unique<Sequence>();
    seq->id = id;
    seq->prompt = std::move(prompt);
    seq->sampling.max_tokens = max_tokens;
    Sequence* raw = seq.get();
    scheduler.add(std::move(seq));
    return raw;
  }
  // A prompt of `len` tokens that no other sequence's shares (no accidental prefix hits).
  Sequence* add(uint64_t id, size_t len, int max_tokens = 100) {
    return add(id, unique_prompt(id, len), max_tokens);
  }
  static std::vector<int32_t> unique_prompt(uint64_t id, size_t len) {
    std::vector<int32_t> p(len);
    for (size_t i = 0; i < len; ++i) p[i] = static_cast<int32_t>(id * 1000 + i);
    return p;
  }

  // schedule(), and the step is sent to the actors (its sequences are started).
  Chunks submit() {
    std::vector<ScheduledChunk> chunks = scheduler.schedule();
    Chunks out;
    for (const ScheduledChunk& c : chunks) {
      c.seq->started = true;
      c.seq->sent_blocks = c.seq->block_table.size();
      out.emplace_back(c.seq->id, c.start, c.count, c.sample);
    }
    if (!chunks.empty()) in_flight.push_back(std::move(chunks));
    return out;
  }
  // The oldest step in flight comes back.
  void complete() {
    ASSERT_FALSE(in_flight.empty());
    std::vector<ScheduledChunk> chunks = std::move(in_flight.front());
    in_flight.pop_front();
    for (const ScheduledChunk& c : chunks) {
      --c.seq->in_flight;
      c.seq->computed = c.start + c.count;
      blocks.commit(*c.seq);
      blocks.release_out_of_window(*c.seq);  // sliding window only
      if (c.sample) c.seq->output.push_back(kSampled);
    }
  }
  // One step sent and collected.
  Chunks step() {
    Chunks out = submit();
    if (!out.empty()) complete();
    return out;
  }

  BlockManager blocks;
  Scheduler scheduler;
  std::deque<std::vector<ScheduledChunk>> in_flight;
};

// ---- admission --------------------------------------------------------------------------------

TEST(SchedulerTest, AdmitsInArrivalOrderUpToMaxNumSeqs) {
  Harness h(config(2, 1024), 64, 4);
  h.add(1, 4);
  h.add(2, 4);
  h.add(3, 4);
  EXPECT_EQ(h.scheduler.waiting(), 3u);
  EXPECT_EQ(h.step(), (Chunks{{1, 0, 4, true}, {2, 0, 4, true}}));
  EXPECT_EQ(h.scheduler.running(), 2u);
  EXPECT_EQ(h.scheduler.waiting(), 1u);
  // The seats stay taken: the next step decodes 1 and 2, and 3 still waits.
  EXPECT_EQ(h.step(), (Chunks{{1, 4, 1, true}, {2, 4, 1, true}}));
  EXPECT_EQ(h.scheduler.waiting(), 1u);
  // A finished sequence gives its seat to the next in line.
  ASSERT_NE(h.scheduler.finish(1), nullptr);
  EXPECT_EQ(h.step(), (Chunks{{2, 5, 1, true}, {3, 0, 4, true}}));
  EXPECT_EQ(h.scheduler.running(), 2u);
  EXPECT_EQ(h.scheduler.waiting(), 0u);
}

TEST(SchedulerTest, ChunksAPromptToTheTokenBudget) {
  Harness h(config(8, 8), 64, 4);
  Sequence* a = h.add(1, 20);
  // 20 prompt tokens over a budget of 8: two chunks that sample nothing, then the rest samples.
  EXPECT_EQ(h.step(), (Chunks{{1, 0, 8, false}}));
  EXPECT_EQ(a->block_table.size(), 2u);
  EXPECT_TRUE(a->output.empty());
  EXPECT_EQ(h.step(), (Chunks{{1, 8, 8, false}}));
  EXPECT_EQ(a->block_table.size(), 4u);
  EXPECT_EQ(h.step(), (Chunks{{1, 16, 4, true}}));
  EXPECT_EQ(a->block_table.size(), 5u);
  EXPECT_EQ(a->output.size(), 1u);
  // Then one token per step; the 21st token opens a sixth block.
  EXPECT_EQ(h.step(), (Chunks{{1, 20, 1, true}}));
  EXPECT_EQ(a->block_table.size(), 6u);
  EXPECT_EQ(h.blocks.used_blocks(), 6u);
}

TEST(SchedulerTest, RunningSequencesGoFirstAndAdmissionsTakeTheRestOfTheBudget) {
  Harness h(config(8, 10), 64, 4);
  h.add(1, 4);
  EXPECT_EQ(h.step(), (Chunks{{1, 0, 4, true}}));
  h.add(2, 20);
  h.add(3, 2);
  // 1's decode (1 token), then 2's prompt gets the other 9; 3 gets nothing this step.
  EXPECT_EQ(h.step(), (Chunks{{1, 4, 1, true}, {2, 0, 9, false}}));
  EXPECT_EQ(h.scheduler.waiting(), 1u);
  // 2's prompt goes on before 3 is admitted: decode 1, 2 takes 9 of its 11 left.
  EXPECT_EQ(h.step(), (Chunks{{1, 5, 1, true}, {2, 9, 9, false}}));
  EXPECT_EQ(h.step(), (Chunks{{1, 6, 1, true}, {2, 18, 2, true}, {3, 0, 2, true}}));
}

TEST(SchedulerTest, MaxSeqsPerStepSplitsTheRunningSequencesIntoMicroBatches) {
  SchedulerConfig c = config(4, 1024);
  c.max_seqs_per_step = 2;
  Harness h(c, 64, 4);
  for (uint64_t id = 1; id <= 4; ++id) h.add(id, 3);
  EXPECT_EQ(h.submit(), (Chunks{{1, 0, 3, true}, {2, 0, 3, true}}));
  // 1 and 2 are in flight: the next step takes the next two, then nothing is left to run.
  EXPECT_EQ(h.submit(), (Chunks{{3, 0, 3, true}, {4, 0, 3, true}}));
  EXPECT_EQ(h.submit(), Chunks{});
  EXPECT_EQ(h.scheduler.running(), 4u);
  h.complete();
  EXPECT_EQ(h.submit(), (Chunks{{1, 3, 1, true}, {2, 3, 1, true}}));
}

TEST(SchedulerTest, TheHeadOfTheQueueWaitsForBlocksAndIsNotOvertaken) {
  Harness h(config(8, 1024), 4, 4);
  Sequence* a = h.add(1, 12);  // 3 blocks
  h.add(2, 8);                 // 2 blocks: only 1 is left
  h.add(3, 2);                 // 1 block would fit, but 2 is first
  EXPECT_EQ(h.step(), (Chunks{{1, 0, 12, true}}));
  EXPECT_EQ(h.blocks.used_blocks(), 3u);
  EXPECT_EQ(h.step(), (Chunks{{1, 12, 1, true}}));  // the 13th token takes the last block
  EXPECT_EQ(a->block_table.size(), 4u);
  EXPECT_EQ(h.scheduler.waiting(), 2u);
  EXPECT_EQ(h.scheduler.preemptions(), 0u);
  std::unique_ptr<Sequence> done = h.scheduler.finish(1);
  ASSERT_NE(done, nullptr);
  EXPECT_EQ(h.blocks.used_blocks(), 0u);
  EXPECT_EQ(h.step(), (Chunks{{2, 0, 8, true}, {3, 0, 2, true}}));
  EXPECT_EQ(h.blocks.used_blocks(), 3u);
}

// ---- preemption -------------------------------------------------------------------------------

TEST(SchedulerTest, PreemptsTheMostRecentlyAdmittedWhenABlockIsMissing) {
  Harness h(config(8, 1024), 6, 4);
  Sequence* a = h.add(1, 8);
  Sequence* b = h.add(2, 8);
  Sequence* c = h.add(3, 8);
  EXPECT_EQ(h.step(), (Chunks{{1, 0, 8, true}, {2, 0, 8, true}, {3, 0, 8, true}}));
  EXPECT_EQ(h.blocks.free_blocks(), 0u);
  // Each needs a third block for its 9th token: 1 asks first and 3 (the newest) gives up its
  // two, which 1 and 2 take.
  EXPECT_EQ(h.step(), (Chunks{{1, 8, 1, true}, {2, 8, 1, true}}));
  EXPECT_EQ(h.scheduler.preemptions(), 1u);
  EXPECT_EQ(h.scheduler.take_preempted(), std::vector<uint64_t>{3});
  EXPECT_TRUE(h.scheduler.take_preempted().empty());
  EXPECT_EQ(h.scheduler.running(), 2u);
  EXPECT_EQ(h.scheduler.waiting(), 1u);
  EXPECT_EQ(a->block_table.size(), 3u);
  EXPECT_EQ(b->block_table.size(), 3u);
  // 3 starts over: no blocks, nothing computed, not started, its output kept.
  EXPECT_EQ(c->status, SeqStatus::kWaiting);
  EXPECT_TRUE(c->block_table.empty());
  EXPECT_EQ(c->computed, 0u);
  EXPECT_FALSE(c->started);
  EXPECT_EQ(c->output, std::vector<int32_t>{kSampled});
  EXPECT_EQ(c->preemptions, 1u);
  // It waits until blocks come back, then recomputes prompt + output and samples.
  EXPECT_EQ(h.step(), (Chunks{{1, 9, 1, true}, {2, 9, 1, true}}));
  ASSERT_NE(h.scheduler.finish(1), nullptr);
  EXPECT_EQ(h.step(), (Chunks{{2, 10, 1, true}, {3, 0, 9, true}}));
  EXPECT_EQ(c->output.size(), 2u);
}

TEST(SchedulerTest, TheNewestSequencePreemptsItselfRatherThanAnOlderOne) {
  // 1 and 2 hold two blocks each; 2 reaches its block boundary first.
  Harness h(config(8, 1024), 4, 4);
  Sequence* a = h.add(1, 5);
  Sequence* b = h.add(2, 8);
  EXPECT_EQ(h.step(), (Chunks{{1, 0, 5, true}, {2, 0, 8, true}}));
  EXPECT_EQ(h.blocks.free_blocks(), 0u);
  EXPECT_EQ(h.step(), (Chunks{{1, 5, 1, true}}));
  EXPECT_EQ(h.scheduler.take_preempted(), std::vector<uint64_t>{2});
  EXPECT_EQ(a->block_table.size(), 2u);
  EXPECT_TRUE(b->block_table.empty());
  EXPECT_EQ(h.blocks.free_blocks(), 2u);
}

TEST(SchedulerTest, APreemptedSequenceGoesBackToTheFrontOfTheQueue) {
  Harness h(config(8, 1024), 5, 4);
  h.add(1, 8);
  h.add(2, 8);
  h.add(3, 8);  // waits: one block is left and it needs two
  EXPECT_EQ(h.step(), (Chunks{{1, 0, 8, true}, {2, 0, 8, true}}));
  EXPECT_EQ(h.step(), (Chunks{{1, 8, 1, true}}));  // 2 found no block for its 9th token
  EXPECT_EQ(h.scheduler.take_preempted(), std::vector<uint64_t>{2});
  EXPECT_EQ(h.scheduler.waiting(), 2u);
  ASSERT_NE(h.scheduler.finish(1), nullptr);
  // 2 comes back before 3, which has waited longer; its own blocks are still cached.
  EXPECT_EQ(h.step(), (Chunks{{2, 8, 1, true}, {3, 0, 8, true}}));
}

TEST(SchedulerTest, AStepThatPreemptsAdmitsNothing) {
  // Prefix caching off, so that a readmission never starts past position 0. Budget 6.
  Harness h(config(8, 6), 5, 4, /*prefix_caching=*/false);
  h.add(1, 4);
  h.add(2, 2);
  Sequence* c = h.add(3, 8);
  EXPECT_EQ(h.step(), (Chunks{{1, 0, 4, true}, {2, 0, 2, true}}));
  EXPECT_EQ(h.step(), (Chunks{{1, 4, 1, true}, {2, 2, 1, true}, {3, 0, 4, false}}));
  EXPECT_EQ(h.step(), (Chunks{{1, 5, 1, true}, {2, 3, 1, true}, {3, 4, 4, true}}));
  EXPECT_EQ(h.blocks.free_blocks(), 0u);
  // 2's 5th token needs a block: 3 (newest) gives up its two, 2 takes one. A 4-token chunk of
  // 3 would fit in the other and the budget has 4 left, but a step that preempted admits none.
  EXPECT_EQ(h.step(), (Chunks{{1, 6, 1, true}, {2, 4, 1, true}}));
  EXPECT_EQ(h.scheduler.take_preempted(), std::vector<uint64_t>{3});
  EXPECT_EQ(h.blocks.free_blocks(), 1u);
  EXPECT_EQ(h.scheduler.waiting(), 1u);
  // The next step readmits it from the start, in budget-sized chunks.
  EXPECT_EQ(h.step(), (Chunks{{1, 7, 1, true}, {2, 5, 1, true}, {3, 0, 4, false}}));
  EXPECT_EQ(c->block_table.size(), 1u);
}

TEST(SchedulerTest, InFlightSequencesAreNotPreemptedTheNeedyOneWaits) {
  SchedulerConfig cfg = config(8, 1024);
  cfg.max_seqs_per_step = 1;  // two micro-batches, as with two pipeline stages
  Harness h(cfg, 4, 4);
  h.add(1, 8);
  h.add(2, 8);
  EXPECT_EQ(h.submit(), (Chunks{{1, 0, 8, true}}));
  EXPECT_EQ(h.submit(), (Chunks{{2, 0, 8, true}}));
  h.complete();  // 1 is back and needs a third block; 2 is in flight and holds the rest
  EXPECT_EQ(h.submit(), Chunks{});
  EXPECT_EQ(h.scheduler.preemptions(), 0u);
  EXPECT_EQ(h.scheduler.running(), 2u);
  h.complete();  // now 2 can be preempted for 1
  EXPECT_EQ(h.submit(), (Chunks{{1, 8, 1, true}}));
  EXPECT_EQ(h.scheduler.take_preempted(), std::vector<uint64_t>{2});
  EXPECT_EQ(h.scheduler.running(), 1u);
}

TEST(SchedulerTest, AloneInAFullCacheItPreemptsItself) {
  Harness h(config(8, 1024), 2, 4);
  h.add(1, 8);
  EXPECT_EQ(h.step(), (Chunks{{1, 0, 8, true}}));
  // Its 9th token needs a third block that does not exist: it gives its own back and waits,
  // and nothing can run (the engine reports that no request fits).
  EXPECT_EQ(h.step(), Chunks{});
  EXPECT_EQ(h.scheduler.take_preempted(), std::vector<uint64_t>{1});
  EXPECT_EQ(h.scheduler.running(), 0u);
  EXPECT_EQ(h.scheduler.waiting(), 1u);
  EXPECT_FALSE(h.scheduler.idle());
  EXPECT_EQ(h.blocks.used_blocks(), 0u);
  EXPECT_EQ(h.step(), Chunks{});  // 9 tokens never fit in 2 blocks of 4
}

TEST(SchedulerTest, APreemptedSequenceThatWasNeverSentIsNotReported) {
  Harness h(config(8, 1024), 2, 4);
  h.add(1, 8);
  // Scheduled but not sent (as when a submit fails before the actors see it).
  std::vector<ScheduledChunk> chunks = h.scheduler.schedule();
  ASSERT_EQ(chunks.size(), 1u);
  Sequence* a = chunks[0].seq;
  --a->in_flight;
  a->computed = 8;
  a->output.push_back(kSampled);
  EXPECT_TRUE(h.scheduler.schedule().empty());  // it preempts itself
  EXPECT_EQ(h.scheduler.preemptions(), 1u);
  EXPECT_TRUE(h.scheduler.take_preempted().empty());  // the actors never knew it
}

// ---- prefix cache -----------------------------------------------------------------------------

TEST(SchedulerTest, AdmissionStartsAfterTheCachedPrefixAndItIsOutsideTheBudget) {
  Harness h(config(8, 4), 16, 4);
  std::vector<int32_t> shared = Harness::unique_prompt(1, 10);
  Sequence* a = h.add(1, shared);
  EXPECT_EQ(h.step(), (Chunks{{1, 0, 4, false}}));
  EXPECT_EQ(h.step(), (Chunks{{1, 4, 4, false}}));
  EXPECT_EQ(h.step(), (Chunks{{1, 8, 2, true}}));
  // 2 shares 1's first two blocks (8 tokens) and adds 3: one step of 3 tokens fits the budget.
  std::vector<int32_t> longer(shared.begin(), shared.begin() + 8);
  longer.insert(longer.end(), {501, 502, 503});
  Sequence* b = h.add(2, longer);
  EXPECT_EQ(h.step(), (Chunks{{1, 10, 1, true}, {2, 8, 3, true}}));
  EXPECT_EQ(b->cached_tokens, 8u);
  ASSERT_EQ(b->block_table.size(), 3u);
  EXPECT_EQ(b->block_table[0], a->block_table[0]);
  EXPECT_EQ(b->block_table[1], a->block_table[1]);
  EXPECT_NE(b->block_table[2], a->block_table[2]);
  EXPECT_EQ(h.blocks.used_blocks(), 4u);  // 1's three, 2's own third
  // The same 8 tokens as a whole prompt: the last token is always computed, so only the first
  // block is a hit, and the budget left after the decodes (2) goes to positions 4 and 5.
  Sequence* c = h.add(3, std::vector<int32_t>(shared.begin(), shared.begin() + 8));
  EXPECT_EQ(h.step(), (Chunks{{1, 11, 1, true}, {2, 11, 1, true}, {3, 4, 2, false}}));
  EXPECT_EQ(c->cached_tokens, 4u);
  ASSERT_EQ(c->block_table.size(), 2u);
  EXPECT_EQ(c->block_table[0], a->block_table[0]);
  EXPECT_EQ(h.blocks.prefix_hits(), 8u + 4u);
}

TEST(SchedulerTest, APreemptedSequenceResumesFromItsSurvivingCachedPrefix) {
  Harness h(config(8, 1024), 7, 4);
  h.add(1, 8);
  h.add(2, 8);
  Sequence* c = h.add(3, 8);
  EXPECT_EQ(h.step(), (Chunks{{1, 0, 8, true}, {2, 0, 8, true}, {3, 0, 8, true}}));
  const uint32_t c_first_block = c->block_table[0];
  // 1 takes the free block; 2 preempts 3, whose blocks stay cached, and takes 3's last one
  // (a released sequence's tail is evicted before its head).
  EXPECT_EQ(h.step(), (Chunks{{1, 8, 1, true}, {2, 8, 1, true}}));
  EXPECT_EQ(h.scheduler.take_preempted(), std::vector<uint64_t>{3});
  EXPECT_EQ(h.blocks.cached_free_blocks(), 1u);
  // 3 needs 3 blocks (9 tokens) and only its cached first block is free: it waits.
  EXPECT_EQ(h.step(), (Chunks{{1, 9, 1, true}, {2, 9, 1, true}}));
  ASSERT_NE(h.scheduler.finish(1), nullptr);
  // Readmitted after its first block (a hit), recomputing the rest of prompt + output.
  EXPECT_EQ(h.step(), (Chunks{{2, 10, 1, true}, {3, 4, 5, true}}));
  EXPECT_EQ(c->block_table.size(), 3u);
  EXPECT_EQ(c->block_table[0], c_first_block);
  EXPECT_EQ(c->cached_tokens, 0u);  // what its first admission found; not the readmission's
}

// ---- async scheduling -------------------------------------------------------------------------

TEST(SchedulerTest, WithoutAsyncSchedulingAnInFlightSequenceIsNotScheduledAgain) {
  Harness h(config(8, 1024), 16, 4);
  h.add(1, 4);
  EXPECT_EQ(h.submit(), (Chunks{{1, 0, 4, true}}));
  EXPECT_EQ(h.submit(), Chunks{});
}

TEST(SchedulerTest, AsyncSchedulingRunsOneDecodeAheadUpToMaxTokens) {
  SchedulerConfig cfg = config(8, 1024);
  cfg.async_scheduling = true;
  Harness h(cfg, 16, 4);
  Sequence* a = h.add(1, 4, /*max_tokens=*/3);
  EXPECT_EQ(h.submit(), (Chunks{{1, 0, 4, true}}));
  // The next decode is for the token the step in flight samples (position 4).
  EXPECT_EQ(h.submit(), (Chunks{{1, 4, 1, true}}));
  EXPECT_EQ(a->in_flight, 2);
  EXPECT_EQ(a->block_table.size(), 2u);  // position 4 opened the second block
  EXPECT_EQ(h.submit(), Chunks{});       // two in flight at most
  h.complete();
  EXPECT_EQ(h.submit(), (Chunks{{1, 5, 1, true}}));  // the third and last token
  h.complete();
  // Two tokens out and the third in flight: a fourth would pass max_tokens.
  EXPECT_EQ(h.submit(), Chunks{});
  h.complete();
  EXPECT_EQ(a->output.size(), 3u);
}

TEST(SchedulerTest, AsyncSchedulingStopsAtMaxModelLen) {
  SchedulerConfig cfg = config(8, 1024);
  cfg.async_scheduling = true;
  cfg.limits.max_model_len = 6;
  Harness h(cfg, 16, 4);
  h.add(1, 4);
  EXPECT_EQ(h.submit(), (Chunks{{1, 0, 4, true}}));
  EXPECT_EQ(h.submit(), (Chunks{{1, 4, 1, true}}));
  h.complete();
  // The token sampled at position 5 is the last one max_model_len 6 allows.
  EXPECT_EQ(h.submit(), Chunks{});
}

TEST(SchedulerTest, AsyncSchedulingNeverRunsAheadOfAPromptChunk) {
  SchedulerConfig cfg = config(8, 4);
  cfg.async_scheduling = true;
  Harness h(cfg, 16, 4);
  h.add(1, 6);
  EXPECT_EQ(h.submit(), (Chunks{{1, 0, 4, false}}));
  EXPECT_EQ(h.submit(), Chunks{});  // the step in flight samples nothing to continue from
  h.complete();
  EXPECT_EQ(h.submit(), (Chunks{{1, 4, 2, true}}));
  EXPECT_EQ(h.submit(), (Chunks{{1, 6, 1, true}}));
}

TEST(SchedulerTest, AsyncSchedulingWaitsRatherThanPreemptForTheDecodeAhead) {
  SchedulerConfig cfg = config(8, 1024);
  cfg.async_scheduling = true;
  Harness h(cfg, 2, 4);
  h.add(1, 4);
  h.add(2, 4);
  EXPECT_EQ(h.submit(), (Chunks{{1, 0, 4, true}, {2, 0, 4, true}}));
  // Position 4 needs a new block and none is free: no step ahead, no preemption.
  EXPECT_EQ(h.submit(), Chunks{});
  EXPECT_EQ(h.scheduler.preemptions(), 0u);
}

// ---- sliding window ---------------------------------------------------------------------------

// Every layer slides by 8 tokens: a sequence far longer than the whole cache (6 blocks of 4 =
// 24 tokens) runs alone to 300 tokens, holding only its window's blocks, never preempted.
TEST(SchedulerTest, SlidingWindowRunsASequenceLongerThanTheCache) {
  SchedulerConfig cfg = config(8, 4);
  cfg.limits.max_model_len = 4096;
  Harness h(cfg, 6, 4, /*prefix_caching=*/true, /*window=*/8);
  Sequence* a = h.add(1, 30, /*max_tokens=*/270);
  size_t steps = 0;
  while (a->output.size() < 270 && steps < 1000) {
    const Chunks chunks = h.step();
    ASSERT_EQ(chunks.size(), 1u) << "step " << steps;
    // A prompt chunk of 4 holds the window before it (8 - 1 tokens) and itself: <= 4 blocks.
    EXPECT_LE(h.blocks.used_blocks(), 4u) << "step " << steps;
    ++steps;
  }
  EXPECT_EQ(a->total(), 300u);
  EXPECT_EQ(h.scheduler.preemptions(), 0u);
  EXPECT_EQ(a->block_table.size(), 75u);  // still indexed by position
  EXPECT_EQ(a->freed_blocks, (a->computed - 8 + 1) / 4);
  EXPECT_EQ(h.blocks.used_blocks(), a->block_table.size() - a->freed_blocks);
  ASSERT_NE(h.scheduler.finish(1), nullptr);
  EXPECT_EQ(h.blocks.used_blocks(), 0u);
}

// Chunked prefill over a window: a step computes at most max_step_tokens() tokens (here
// (5 - 2) * 4 - 8 + 2 = 6, under a budget of 100) so that its blocks (the window before the
// chunk, which starts in earlier chunks' blocks, and the chunk's) fit the 5-block cache.
TEST(SchedulerTest, SlidingWindowChunksAPromptSoThatItsBlocksFit) {
  Harness h(config(8, 100), 5, 4, /*prefix_caching=*/false, /*window=*/8);
  Sequence* a = h.add(1, 20);
  EXPECT_EQ(h.step(), (Chunks{{1, 0, 6, false}}));
  EXPECT_EQ(h.step(), (Chunks{{1, 6, 6, false}}));
  EXPECT_EQ(a->freed_blocks, 1u);  // position 12 reads 5..12: block 0 is out
  EXPECT_EQ(h.step(), (Chunks{{1, 12, 6, false}}));
  EXPECT_EQ(h.step(), (Chunks{{1, 18, 2, true}}));
  EXPECT_EQ(a->freed_blocks, 3u);  // position 20 reads 13..20
  EXPECT_EQ(h.blocks.used_blocks(), 2u);
  EXPECT_EQ(h.step(), (Chunks{{1, 20, 1, true}}));
}

// Preemption with a sliding window: the preempted sequence gives back only the blocks it still
// holds, and comes back from the start (its head's cached blocks long evicted) in chunks.
TEST(SchedulerTest, SlidingWindowPreemptionReleasesWhatIsHeldAndRecomputes) {
  // Decoding, each holds up to 3 blocks (a window of 6 spans two, plus the next): 6 > 5.
  Harness h(config(8, 4), 5, 4, /*prefix_caching=*/true, /*window=*/6);
  Sequence* a = h.add(1, 12);
  Sequence* b = h.add(2, 12);
  for (int i = 0; i < 200 && h.scheduler.preemptions() == 0; ++i) {
    const Chunks chunks = h.step();
    ASSERT_FALSE(chunks.empty());
    ASSERT_LE(h.blocks.used_blocks(), 5u);
  }
  ASSERT_EQ(h.scheduler.preemptions(), 1u);
  EXPECT_EQ(h.scheduler.take_preempted(), std::vector<uint64_t>{2});
  EXPECT_TRUE(b->block_table.empty());
  EXPECT_EQ(b->freed_blocks, 0u);
  EXPECT_EQ(b->computed, 0u);
  EXPECT_EQ(h.blocks.used_blocks(), a->block_table.size() - a->freed_blocks);
  // Both finish: 2 is readmitted once 1 is done and recomputes prompt + output.
  ASSERT_NE(h.scheduler.finish(1), nullptr);
  const size_t total = b->total();
  size_t recomputed = 0;
  while (b->computed < total) {
    const Chunks chunks = h.step();
    ASSERT_EQ(chunks.size(), 1u);
    EXPECT_EQ(std::get<1>(chunks[0]), recomputed);
    recomputed += std::get<2>(chunks[0]);
    ASSERT_LE(h.blocks.used_blocks(), 5u);
  }
  EXPECT_EQ(recomputed, total);
}

// With a sliding window a sequence's first step still holds its blocks from position 0: a cached
// prefix that leaves no room for the chunk in the whole cache is used in part, rather than
// waiting forever for blocks that cannot exist.
TEST(SchedulerTest, SlidingWindowUsesOnlyTheCachedPrefixThatFitsWithTheChunk) {
  Harness h(config(8, 8), 8, 4, /*prefix_caching=*/true, /*window=*/8);
  std::vector<int32_t> prompt = Harness::unique_prompt(1, 30);
  Sequence* a = h.add(1, prompt, /*max_tokens=*/1);
  while (a->output.empty()) ASSERT_FALSE(h.step().empty());
  ASSERT_NE(h.scheduler.finish(1), nullptr);
  EXPECT_EQ(h.blocks.cached_free_blocks(), 7u);  // positions 0..27, a chain from block 0
  // 20 more tokens: 7 hits (28 tokens) and a chunk of 8 would need 9 blocks of the 8.
  std::vector<int32_t> longer = prompt;
  for (int32_t t = 0; t < 20; ++t) longer.push_back(5000 + t);
  Sequence* b = h.add(2, longer);
  EXPECT_EQ(h.step(), (Chunks{{2, 24, 8, false}}));  // 6 hits: room for the chunk's 2 blocks
  EXPECT_EQ(b->cached_tokens, 24u);
  while (b->output.empty()) ASSERT_FALSE(h.step().empty());
  EXPECT_EQ(b->total(), 51u);
}

// ---- finishing --------------------------------------------------------------------------------

TEST(SchedulerTest, FinishHandsTheSequenceBackAndFreesItsBlocks) {
  Harness h(config(1, 1024), 8, 4);
  h.add(1, 6);
  h.add(2, 3);
  EXPECT_EQ(h.step(), (Chunks{{1, 0, 6, true}}));
  EXPECT_EQ(h.blocks.used_blocks(), 2u);

  std::unique_ptr<Sequence> waiting = h.scheduler.finish(2);
  ASSERT_NE(waiting, nullptr);
  EXPECT_EQ(waiting->id, 2u);
  EXPECT_EQ(waiting->status, SeqStatus::kFinished);
  EXPECT_EQ(h.scheduler.waiting(), 0u);
  EXPECT_EQ(h.blocks.used_blocks(), 2u);

  std::unique_ptr<Sequence> running = h.scheduler.finish(1);
  ASSERT_NE(running, nullptr);
  EXPECT_EQ(running->status, SeqStatus::kFinished);
  EXPECT_TRUE(running->block_table.empty());
  EXPECT_EQ(running->output, std::vector<int32_t>{kSampled});
  EXPECT_EQ(h.blocks.used_blocks(), 0u);
  EXPECT_EQ(h.blocks.cached_free_blocks(), 1u);  // its one full block stays cached
  EXPECT_TRUE(h.scheduler.idle());

  EXPECT_EQ(h.scheduler.finish(1), nullptr);   // twice
  EXPECT_EQ(h.scheduler.finish(99), nullptr);  // never added
  EXPECT_EQ(h.step(), Chunks{});
}

}  // namespace
}  // namespace tessera
