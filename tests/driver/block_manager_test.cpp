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

}  // namespace
}  // namespace tessera
