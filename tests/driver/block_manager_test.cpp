// The block manager alone: reference-counted sharing of cached prefix blocks, verification of
// every hit (a colliding hash never shares wrong content), LRU eviction of cached free blocks.
#include "driver/engine/block_manager.h"

#include <gtest/gtest.h>

#include <span>
#include <vector>

namespace tessera {
namespace {

Sequence seq_of(std::vector<int32_t> tokens) {
  Sequence s;
  s.prompt = std::move(tokens);
  return s;
}

// Admits `s` (after its cached prefix), computes all its tokens and caches its full blocks.
std::vector<uint32_t> compute_all(BlockManager& m, Sequence& s) {
  std::vector<uint32_t> hits = m.match_prefix(s);
  EXPECT_TRUE(m.can_admit(hits, s.total()));
  m.admit(s, hits, s.total());
  s.computed = s.total();
  m.commit(s);
  return hits;
}

TEST(BlockManagerTest, SharesTheFullBlocksOfACommonPrefix) {
  BlockManager m(16, 4);
  Sequence a = seq_of({1, 1, 1, 1, 2, 2, 2, 2, 3, 3});
  EXPECT_TRUE(compute_all(m, a).empty());
  EXPECT_EQ(m.used_blocks(), 3u);
  Sequence b = seq_of({1, 1, 1, 1, 2, 2, 2, 2, 4, 4, 4});
  std::vector<uint32_t> hits = compute_all(m, b);
  EXPECT_EQ(hits, (std::vector<uint32_t>{a.block_table[0], a.block_table[1]}));
  EXPECT_EQ(b.block_table[0], a.block_table[0]);
  EXPECT_NE(b.block_table[2], a.block_table[2]);
  EXPECT_EQ(m.used_blocks(), 4u);
  EXPECT_EQ(m.prefix_queries(), 10u + 11u);
  EXPECT_EQ(m.prefix_hits(), 8u);
  m.release(a);
  EXPECT_EQ(m.used_blocks(), 3u);  // b still holds the shared blocks
  EXPECT_EQ(m.cached_free_blocks(), 0u);
  m.release(b);
  EXPECT_EQ(m.used_blocks(), 0u);
  EXPECT_EQ(m.cached_free_blocks(), 2u);  // the shared ones; partial blocks are not cached
}

TEST(BlockManagerTest, NeverCoversTheLastToken) {
  BlockManager m(16, 4);
  Sequence a = seq_of({1, 2, 3, 4, 5, 6, 7, 8});
  compute_all(m, a);
  Sequence same = seq_of({1, 2, 3, 4, 5, 6, 7, 8});
  EXPECT_EQ(m.match_prefix(same).size(), 1u);
  Sequence longer = seq_of({1, 2, 3, 4, 5, 6, 7, 8, 9});
  EXPECT_EQ(m.match_prefix(longer).size(), 2u);
  Sequence other_start = seq_of({0, 2, 3, 4, 5, 6, 7, 8, 9});
  EXPECT_TRUE(m.match_prefix(other_start).empty());
}

// Keys that ignore the parent: block [2 2 2 2] has one key whatever precedes it.
uint64_t parentless_hash(uint64_t, std::span<const int32_t> tokens) {
  return BlockManager::hash_block(BlockManager::kRootHash, tokens);
}

TEST(BlockManagerTest, AHashCollisionNeverSharesWrongContent) {
  BlockManager m(16, 4, true, &parentless_hash);
  Sequence a = seq_of({1, 1, 1, 1, 2, 2, 2, 2, 9});
  compute_all(m, a);
  Sequence b = seq_of({3, 3, 3, 3, 2, 2, 2, 2, 9});
  EXPECT_TRUE(compute_all(m, b).empty());
  // d's second block has a's second block's key and tokens, but a's follows other content.
  Sequence d = seq_of({3, 3, 3, 3, 2, 2, 2, 2, 9});
  EXPECT_EQ(m.match_prefix(d), (std::vector<uint32_t>{b.block_table[0]}));
}

uint64_t constant_hash(uint64_t, std::span<const int32_t>) { return 42; }

TEST(BlockManagerTest, EveryKeyCollidingStillGivesOnlyVerifiedHits) {
  BlockManager m(16, 4, true, &constant_hash);
  Sequence a = seq_of({1, 1, 1, 1, 2, 2, 2, 2, 9});
  compute_all(m, a);
  Sequence b = seq_of({2, 2, 2, 2, 1, 1, 1, 1, 9});
  EXPECT_TRUE(m.match_prefix(b).empty());
  Sequence same = seq_of({1, 1, 1, 1, 2, 2, 2, 2, 9});
  EXPECT_EQ(m.match_prefix(same), (std::vector<uint32_t>{a.block_table[0]}));
}

TEST(BlockManagerTest, EvictsCachedBlocksOnlyWhenNeededTailFirst) {
  BlockManager m(4, 4);
  Sequence a = seq_of({1, 1, 1, 1, 2, 2, 2, 2, 3});
  compute_all(m, a);
  const std::vector<uint32_t> a_blocks = a.block_table;
  m.release(a);
  EXPECT_EQ(m.free_blocks(), 4u);
  EXPECT_EQ(m.cached_free_blocks(), 2u);
  // Never-cached free blocks go first.
  Sequence c = seq_of({7, 7, 7, 7, 7, 7, 7, 7});
  m.admit(c, {}, c.total());
  EXPECT_EQ(m.cached_free_blocks(), 2u);
  Sequence again = seq_of({1, 1, 1, 1, 2, 2, 2, 2, 3});
  EXPECT_EQ(m.match_prefix(again).size(), 2u);
  m.release(c);
  // Three fresh blocks: one cached block must go, a's tail (its head was freed after it).
  Sequence d = seq_of({8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8});
  ASSERT_TRUE(m.can_admit({}, d.total()));
  m.admit(d, {}, d.total());
  EXPECT_EQ(m.cached_free_blocks(), 1u);
  EXPECT_EQ(m.match_prefix(again), (std::vector<uint32_t>{a_blocks[0]}));
  EXPECT_FALSE(m.can_grow(d, d.total() + 5));  // 2 more blocks, 1 free
}

TEST(BlockManagerTest, IdleHitsComeOutOfTheFreeBlocks) {
  BlockManager m(3, 4);
  Sequence a = seq_of({1, 1, 1, 1, 2, 2, 2, 2, 3});
  compute_all(m, a);
  m.release(a);
  Sequence b = seq_of({1, 1, 1, 1, 2, 2, 2, 2, 5, 5, 5, 5});
  std::vector<uint32_t> hits = m.match_prefix(b);
  ASSERT_EQ(hits.size(), 2u);
  EXPECT_TRUE(m.can_admit(hits, 12));
  EXPECT_FALSE(m.can_admit(hits, 13));  // a fourth block
  m.admit(b, hits, 12);
  EXPECT_EQ(b.computed, 8u);
  EXPECT_EQ(m.used_blocks(), 3u);
  EXPECT_EQ(m.free_blocks(), 0u);
}

TEST(BlockManagerTest, OffCachesNothing) {
  BlockManager m(8, 4, /*prefix_caching=*/false);
  Sequence a = seq_of({1, 1, 1, 1, 2, 2, 2, 2, 3});
  compute_all(m, a);
  m.release(a);
  EXPECT_EQ(m.cached_free_blocks(), 0u);
  Sequence same = seq_of({1, 1, 1, 1, 2, 2, 2, 2, 3});
  EXPECT_TRUE(m.match_prefix(same).empty());
  EXPECT_EQ(m.prefix_queries(), 0u);
}

// ---- sliding window -----------------------------------------------------------------------

// Computes `n` more tokens of s (growing its table), as a step that succeeded: commit, then the
// blocks that fell out of the window go back.
void compute_more(BlockManager& m, Sequence& s, size_t n) {
  ASSERT_TRUE(m.can_grow(s, s.computed + n));
  m.grow(s, s.computed + n);
  s.computed += n;
  m.commit(s);
  m.release_out_of_window(s);
}

TEST(BlockManagerTest, SlidingWindowFreesTheBlocksBeforeTheWindow) {
  constexpr uint32_t kFreed = BlockManager::kFreedBlock;
  BlockManager m(16, 4, true, &BlockManager::hash_block, /*window=*/6);
  std::vector<int32_t> prompt(40);
  for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<int32_t>(100 + i);
  Sequence a = seq_of(prompt);
  m.admit(a, m.match_prefix(a), 8);
  a.computed = 8;
  m.commit(a);
  m.release_out_of_window(a);
  // The next query (position 8) reads 3..8: block 0 (0..3) is still read.
  EXPECT_EQ(a.block_table.size(), 2u);
  EXPECT_EQ(a.freed_blocks, 0u);
  EXPECT_EQ(m.used_blocks(), 2u);
  compute_more(m, a, 1);  // position 9 reads 4..9: block 0 is out
  EXPECT_EQ(a.block_table[0], kFreed);
  EXPECT_EQ(a.freed_blocks, 1u);
  EXPECT_EQ(m.used_blocks(), 2u);
  // Decoding on: the sequence never holds more than the window's blocks and the next one.
  for (int i = 0; i < 30; ++i) {
    compute_more(m, a, 1);
    EXPECT_LE(m.used_blocks(), 3u) << a.computed;
  }
  EXPECT_EQ(a.computed, 39u);
  EXPECT_EQ(a.block_table.size(), 10u);
  EXPECT_EQ(a.freed_blocks, (39u - 6u + 1u) / 4u);
  for (size_t i = 0; i < a.freed_blocks; ++i) EXPECT_EQ(a.block_table[i], kFreed);
  // The freed blocks were cached when they filled: they stay cached (free, evictable).
  EXPECT_EQ(m.cached_free_blocks(), a.freed_blocks);
  m.release(a);
  EXPECT_EQ(m.used_blocks(), 0u);
  EXPECT_EQ(a.freed_blocks, 0u);
  EXPECT_TRUE(a.block_table.empty());
}

// A block freed out of one sequence's window still serves a new sequence with the same prefix
// (its content depends only on the tokens up to its end), while it is not evicted.
TEST(BlockManagerTest, FreedBlocksStayVerifiedPrefixHits) {
  BlockManager m(32, 4, true, &BlockManager::hash_block, /*window=*/5);
  std::vector<int32_t> prompt(24);
  for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<int32_t>(7 * i + 1);
  Sequence a = seq_of(prompt);
  m.admit(a, m.match_prefix(a), 24);
  a.computed = 24;
  m.commit(a);
  m.release_out_of_window(a);
  EXPECT_EQ(a.freed_blocks, 5u);  // positions 20.. are read next: blocks 0..4 are out
  const std::vector<uint32_t> kept(a.block_table.begin() + 5, a.block_table.end());
  Sequence b = seq_of(prompt);
  const std::vector<uint32_t> hits = m.match_prefix(b);
  ASSERT_EQ(hits.size(), 5u);  // the last token is recomputed: 5 of the 6 full blocks
  EXPECT_TRUE(m.can_admit(hits, 24));
  m.admit(b, hits, 24);
  EXPECT_EQ(b.computed, 20u);
  EXPECT_EQ(std::vector<uint32_t>(b.block_table.begin(), b.block_table.begin() + 5), hits);
  EXPECT_NE(b.block_table[5], kept[0]);  // the last block is b's own (a still holds its own)
  m.release(a);
  m.release(b);
  EXPECT_EQ(m.used_blocks(), 0u);
}

// With a window shorter than a block, a block can fill after its predecessor was freed: it is
// not cached (its parent link can no longer be verified), so a later sequence stops there.
TEST(BlockManagerTest, ABlockWhosePredecessorWasFreedIsNotCached) {
  BlockManager m(16, 4, true, &BlockManager::hash_block, /*window=*/2);
  std::vector<int32_t> prompt(12);
  for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<int32_t>(i + 50);
  Sequence a = seq_of(prompt);
  m.admit(a, m.match_prefix(a), 1);
  a.computed = 1;
  m.commit(a);
  m.release_out_of_window(a);
  while (a.computed < 12) compute_more(m, a, 1);
  EXPECT_EQ(a.freed_blocks, 2u);  // position 12 reads 11..12
  EXPECT_EQ(m.used_blocks(), 1u);
  m.release(a);
  Sequence b = seq_of(prompt);
  // Block 0 was cached when it filled (at 4, before it was freed at 5); block 1 filled at 8,
  // after block 0 had gone: uncached.
  EXPECT_EQ(m.match_prefix(b).size(), 1u);
}

TEST(BlockManagerTest, StepTokensThatFitTheCacheWithAWindow) {
  EXPECT_EQ(BlockManager(8, 4).max_step_tokens(), SIZE_MAX);
  // A step of n tokens holds (window + n - 2) / 4 + 2 blocks at most: n <= 6 * 4 - 10 + 2.
  BlockManager m(8, 4, true, &BlockManager::hash_block, /*window=*/10);
  EXPECT_EQ(m.max_step_tokens(), 16u);
  EXPECT_TRUE(m.fits_alone(100000));
  EXPECT_FALSE(BlockManager(8, 4).fits_alone(33));
  EXPECT_TRUE(BlockManager(8, 4).fits_alone(32));
  BlockManager tiny(4, 4, true, &BlockManager::hash_block, /*window=*/10);
  EXPECT_EQ(tiny.max_step_tokens(), 0u);  // the window alone needs more than the cache
  EXPECT_FALSE(tiny.fits_alone(17));
  EXPECT_TRUE(tiny.fits_alone(16));
  // Every alignment of a worst-case step fits: held blocks from the first query's window start
  // to the last query.
  for (size_t c = 0; c < 40; ++c) {
    const size_t n = m.max_step_tokens();
    const size_t first = c + 1 > 10 ? c + 1 - 10 : 0;
    const size_t held = (c + n - 1) / 4 - first / 4 + 1;
    EXPECT_LE(held, 8u) << c;
  }
}

}  // namespace
}  // namespace tessera
