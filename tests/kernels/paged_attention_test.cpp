#include "kernels/cpu/paged_attention.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <vector>

#include "tests/kernels/test_util.h"

namespace tessera::cpu {
namespace {

using testing::expect_near_all;
using testing::random_floats;

const double kU = std::ldexp(1.0, -24);

// One sequence of a test batch: its dense K/V (all context tokens), its queries and the blocks
// it was given.
struct TestSeq {
  int64_t context_len;
  int64_t query_len;
  std::vector<float> k, v;  // [context_len, kv_heads, hd]
  std::vector<float> q;     // [query_len, heads, hd]
  std::vector<int32_t> blocks;
};

struct Case {
  int64_t kv_heads, group, hd, block_size;
  std::vector<std::pair<int64_t, int64_t>> lens;  // (context_len, query_len) per sequence
  int64_t window = 0;
  float softcap = 0.0f;
};

// Dense causal attention in double with the softmax weights' error budget, written naively
// (every position, masked by the window's definition: kv > q - w) rather than with the kernel's
// attention_window_start. Per element: each score is an fp32 dot of length hd (<= (hd/8 + 12) u
// scale sum|q k| off) times scale; the soft-cap c tanh(s / c) (|d/ds| <= 1) adds <= 4u |c| of
// fp32 tanh; exp(s - max) in fp32 adds u |s - max| + 2u relative; a relative error e on every
// weight moves the weighted mean of V by at most 2 e max|v|; the final division and rounding add
// 4u |out|.
void reference(const TestSeq& s, int64_t kv_heads, int64_t group, int64_t hd,
               const AttentionScoring& scoring, std::vector<double>* out,
               std::vector<double>* bound) {
  const int64_t heads = kv_heads * group;
  const double scale = scoring.scale, cap = scoring.softcap;
  for (int64_t j = 0; j < s.query_len; ++j) {
    const int64_t pos = s.context_len - s.query_len + j;
    auto visible = [&](int64_t p) { return scoring.window == 0 || p > pos - scoring.window; };
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t kvh = h / group;
      const float* q = s.q.data() + (j * heads + h) * hd;
      std::vector<double> score(pos + 1, 0.0);
      double score_err = 0, vmax = 0;
      for (int64_t p = 0; p <= pos; ++p) {
        if (!visible(p)) continue;
        const float* k = s.k.data() + (p * kv_heads + kvh) * hd;
        double dot = 0, mag = 0;
        for (int64_t d = 0; d < hd; ++d) {
          dot += static_cast<double>(q[d]) * k[d];
          mag += std::abs(static_cast<double>(q[d]) * k[d]);
        }
        score[p] = dot * scale;
        double err = ((hd / 8 + 12) * mag * scale + std::abs(score[p])) * kU;
        if (cap > 0) {
          score[p] = std::tanh(score[p] / cap) * cap;
          err += 4 * cap * kU;
        }
        score_err = std::max(score_err, err);
      }
      double m = -INFINITY;
      for (int64_t p = 0; p <= pos; ++p) {
        if (visible(p)) m = std::max(m, score[p]);
      }
      double sum = 0, spread = 0;
      for (int64_t p = 0; p <= pos; ++p) {
        if (!visible(p)) {
          score[p] = 0;  // masked: -inf before the softmax
          continue;
        }
        spread = std::max(spread, m - score[p]);
        score[p] = std::exp(score[p] - m);
        sum += score[p];
      }
      for (int64_t d = 0; d < hd; ++d) {
        double acc = 0;
        for (int64_t p = 0; p <= pos; ++p) {
          if (!visible(p)) continue;
          const double v = s.v[(p * kv_heads + kvh) * hd + d];
          acc += score[p] * v;
          vmax = std::max(vmax, std::abs(v));
        }
        const double o = acc / sum;
        const double weight_err = 2 * score_err + kU * (spread + 2);
        out->push_back(o);
        bound->push_back(2 * weight_err * vmax + 4 * kU * std::abs(o));
      }
    }
  }
}

// Builds the sequences, writes them into a cache through shuffled, non-contiguous block
// tables, runs paged_attention on the whole batch and checks every output element. With a
// window, the table entries of blocks wholly before a sequence's first query's window name a
// block of NaNs instead: the kernel must not read them (a masked read would still make NaN).
void run_case(const Case& c, uint32_t seed, int threads) {
  const int64_t heads = c.kv_heads * c.group;
  std::vector<TestSeq> seqs;
  int64_t blocks_needed = 0;
  for (auto [ctx_len, q_len] : c.lens) {
    TestSeq s;
    s.context_len = ctx_len;
    s.query_len = q_len;
    s.k = random_floats(ctx_len * c.kv_heads * c.hd, ++seed);
    s.v = random_floats(ctx_len * c.kv_heads * c.hd, ++seed);
    s.q = random_floats(q_len * heads * c.hd, ++seed);
    blocks_needed += (ctx_len + c.block_size - 1) / c.block_size;
    seqs.push_back(std::move(s));
  }
  // Twice the blocks needed, handed out in a shuffled order.
  const int64_t num_blocks = 2 * blocks_needed + 3;
  const int32_t poison = static_cast<int32_t>(num_blocks);  // one more block, all NaN
  std::vector<int32_t> pool(num_blocks);
  std::iota(pool.begin(), pool.end(), 0);
  std::shuffle(pool.begin(), pool.end(), std::mt19937(seed));
  auto cache = PagedKvCache::create({.num_layers = 2,
                                     .num_blocks = num_blocks + 1,
                                     .block_size = c.block_size,
                                     .num_kv_heads = c.kv_heads,
                                     .head_dim = c.hd});
  ASSERT_TRUE(cache.has_value());
  size_t next = 0;
  for (TestSeq& s : seqs) {
    const int64_t nb = (s.context_len + c.block_size - 1) / c.block_size;
    for (int64_t b = 0; b < nb; ++b) s.blocks.push_back(pool[next++]);
    std::vector<int64_t> slots(s.context_len);
    for (int64_t p = 0; p < s.context_len; ++p) {
      slots[p] = int64_t{s.blocks[p / c.block_size]} * c.block_size + p % c.block_size;
    }
    ASSERT_TRUE(cache->write(1, s.k, s.v, slots).is_ok());
    const int64_t unread =
        attention_window_start(s.context_len - s.query_len, c.window) / c.block_size;
    for (int64_t b = 0; b < unread; ++b) s.blocks[b] = poison;
    // Layer 0 holds different data: reading the wrong layer would fail the comparison.
    const std::vector<float> junk = random_floats(s.k.size(), ++seed, 5.0f, 9.0f);
    ASSERT_TRUE(cache->write(0, junk, junk, slots).is_ok());
  }
  {
    std::vector<int64_t> slots(c.block_size);
    std::iota(slots.begin(), slots.end(), int64_t{poison} * c.block_size);
    const std::vector<float> nan(c.block_size * c.kv_heads * c.hd, NAN);
    ASSERT_TRUE(cache->write(1, nan, nan, slots).is_ok());
  }
  std::vector<float> q;
  std::vector<AttentionSeq> batch;
  std::vector<double> expected, bound;
  const AttentionScoring scoring{.scale = 1.0f / std::sqrt(static_cast<float>(c.hd)),
                                 .softcap = c.softcap,
                                 .window = c.window};
  for (const TestSeq& s : seqs) {
    q.insert(q.end(), s.q.begin(), s.q.end());
    batch.push_back(
        {.block_table = s.blocks, .query_len = s.query_len, .context_len = s.context_len});
    reference(s, c.kv_heads, c.group, c.hd, scoring, &expected, &bound);
  }
  std::vector<float> out(q.size(), -1.0f);
  CpuContext ctx(threads);
  ASSERT_TRUE(paged_attention(ctx, *cache, 1, q, batch, scoring, out).is_ok());
  expect_near_all(
      out, expected, bound,
      "paged_attention kv_heads=" + std::to_string(c.kv_heads) +
          " group=" + std::to_string(c.group) + " block=" + std::to_string(c.block_size) +
          " window=" + std::to_string(c.window) + " softcap=" + std::to_string(c.softcap));
}

// (context_len, query_len): prefill (Q = L), chunked prefill (0 < Q < L), decode (Q = 1).
const std::vector<std::pair<int64_t, int64_t>> kPrefill = {{37, 37}, {1, 1}, {16, 16}};
const std::vector<std::pair<int64_t, int64_t>> kChunked = {{50, 13}, {33, 16}, {70, 1 + 31}};
const std::vector<std::pair<int64_t, int64_t>> kDecode = {{1, 1}, {17, 1}, {64, 1}, {100, 1}};
const std::vector<std::pair<int64_t, int64_t>> kMixed = {{29, 29}, {45, 1}, {60, 7}, {3, 1}};

TEST(PagedAttentionTest, PrefillChunkedAndDecodeForGqaRatios) {
  uint32_t seed = 700;
  for (int64_t group : {1, 2, 4}) {
    for (const auto* lens : {&kPrefill, &kChunked, &kDecode, &kMixed}) {
      run_case({.kv_heads = 2, .group = group, .hd = 64, .block_size = 16, .lens = *lens},
               seed += 100, 3);
    }
  }
}

TEST(PagedAttentionTest, SmallBlocksOddHeadDimAndManyThreads) {
  run_case({.kv_heads = 3, .group = 2, .hd = 20, .block_size = 4, .lens = kMixed}, 900, 4);
  run_case({.kv_heads = 1, .group = 4, .hd = 128, .block_size = 1, .lens = kChunked}, 901, 1);
}

// Sliding windows: w = 1 (a query sees only itself), windows that end inside a block, on a
// block edge, span several blocks, and windows >= the context (full attention); over prefill,
// chunked prefill (chunks whose queries' windows start in earlier chunks' blocks), decode and
// mixed batches. Blocks before the window hold NaN, so a read (even masked) fails the test.
TEST(PagedAttentionTest, SlidingWindowMatchesNaiveMask) {
  uint32_t seed = 1200;
  for (int64_t window : {1, 3, 4, 5, 16, 17, 40, 100, 1000}) {
    for (int64_t bs : {4, 16}) {
      for (const auto* lens : {&kPrefill, &kChunked, &kDecode, &kMixed}) {
        run_case({.kv_heads = 2,
                  .group = 2,
                  .hd = 32,
                  .block_size = bs,
                  .lens = *lens,
                  .window = window},
                 seed += 10, 3);
      }
    }
  }
}

// The logit soft-cap (Gemma 2: c tanh(s / c) before the mask), alone and with a window; c small
// enough that the cap bites on these scores (|s| up to ~1).
TEST(PagedAttentionTest, SoftcapMatchesReference) {
  uint32_t seed = 1500;
  for (float cap : {0.3f, 2.0f, 50.0f}) {
    for (int64_t window : {0, 7}) {
      for (const auto* lens : {&kChunked, &kMixed}) {
        run_case({.kv_heads = 2,
                  .group = 4,
                  .hd = 64,
                  .block_size = 8,
                  .lens = *lens,
                  .window = window,
                  .softcap = cap},
                 seed += 10, 2);
      }
    }
  }
}

// A long decode over a small window reads only the window's blocks: the ~180 earlier entries of
// the table name the NaN block, and the output matches the naive masked reference.
TEST(PagedAttentionTest, WindowDecodeReadsOnlyTheWindowsBlocks) {
  run_case({.kv_heads = 2,
            .group = 4,
            .hd = 64,
            .block_size = 16,
            .lens = {{3000, 1}, {2500, 4}, {33, 1}},
            .window = 40},
           1600, 4);
}

// A longer decode: the double accumulation keeps the error within the same budget.
TEST(PagedAttentionTest, LongContextDecode) {
  run_case({.kv_heads = 2, .group = 4, .hd = 64, .block_size = 16, .lens = {{3000, 1}, {2500, 4}}},
           950, 4);
}

// Chunked prefill computed chunk by chunk gives the same outputs as the whole prefill at once.
TEST(PagedAttentionTest, ChunksEqualWholePrefill) {
  const int64_t L = 40, kvh = 2, group = 2, hd = 32, heads = kvh * group;
  auto cache = PagedKvCache::create(
      {.num_layers = 1, .num_blocks = 8, .block_size = 8, .num_kv_heads = kvh, .head_dim = hd});
  ASSERT_TRUE(cache.has_value());
  const std::vector<int32_t> blocks = {6, 1, 4, 0, 7};
  std::vector<int64_t> slots(L);
  for (int64_t p = 0; p < L; ++p) slots[p] = blocks[p / 8] * 8 + p % 8;
  ASSERT_TRUE(
      cache->write(0, random_floats(L * kvh * hd, 960), random_floats(L * kvh * hd, 961), slots)
          .is_ok());
  const std::vector<float> q = random_floats(L * heads * hd, 962);
  CpuContext ctx(2);
  std::vector<float> whole(q.size());
  const AttentionSeq all{.block_table = blocks, .query_len = L, .context_len = L};
  // Windows narrower than a chunk, wider than one, and ending mid-block: every chunk after the
  // first has queries whose windows start in earlier chunks' blocks.
  for (int64_t window : {0, 5, 8, 20}) {
    const AttentionScoring scoring{.scale = 0.125f, .window = window};
    ASSERT_TRUE(paged_attention(ctx, *cache, 0, q, {&all, 1}, scoring, whole).is_ok());
    for (int64_t start : {0, 15, 31}) {
      const int64_t end = start == 0 ? 15 : (start == 15 ? 31 : L);
      const AttentionSeq chunk{.block_table = blocks, .query_len = end - start, .context_len = end};
      const std::span<const float> qc(q.data() + start * heads * hd, (end - start) * heads * hd);
      std::vector<float> out(qc.size());
      ASSERT_TRUE(paged_attention(ctx, *cache, 0, qc, {&chunk, 1}, scoring, out).is_ok());
      for (size_t i = 0; i < out.size(); ++i) {
        ASSERT_EQ(out[i], whole[start * heads * hd + i]) << "window " << window;
      }
    }
  }
}

// Attention over a long context ticks the context inside its range (one thread runs the whole
// op as one range here), about once per ProgressTicker::kTickWork of work, so the actor's
// watchdog sees a long prefill move.
TEST(PagedAttentionTest, LongContextTicksWithinOneRange) {
  const int64_t L = 4608, Q = 8, kvh = 1, group = 4, hd = 128, heads = kvh * group, bs = 16;
  auto cache = PagedKvCache::create({.num_layers = 1,
                                     .num_blocks = L / bs,
                                     .block_size = bs,
                                     .num_kv_heads = kvh,
                                     .head_dim = hd});
  ASSERT_TRUE(cache.has_value());
  std::vector<int32_t> blocks(L / bs);
  std::iota(blocks.begin(), blocks.end(), 0);
  std::vector<int64_t> slots(L);
  std::iota(slots.begin(), slots.end(), 0);
  ASSERT_TRUE(
      cache->write(0, random_floats(L * kvh * hd, 970), random_floats(L * kvh * hd, 971), slots)
          .is_ok());
  const std::vector<float> q = random_floats(Q * heads * hd, 972);
  std::vector<float> out(q.size());
  const AttentionSeq seq{.block_table = blocks, .query_len = Q, .context_len = L};
  CpuContext ctx(1);
  const uint64_t before = ctx.ticks();
  ASSERT_TRUE(paged_attention(ctx, *cache, 0, q, {&seq, 1}, {.scale = 0.125f}, out).is_ok());
  // Each query row is (L - Q .. L) * group * hd * 2 >= kTickWork: a tick per row, and one for
  // the range.
  static_assert((L - Q) * group * hd * 2 >= ProgressTicker::kTickWork);
  EXPECT_EQ(ctx.ticks() - before, static_cast<uint64_t>(Q * kvh + 1));
}

TEST(PagedAttentionTest, Errors) {
  auto cache = PagedKvCache::create(
      {.num_layers = 1, .num_blocks = 4, .block_size = 4, .num_kv_heads = 2, .head_dim = 8});
  ASSERT_TRUE(cache.has_value());
  CpuContext ctx(1);
  const std::vector<int32_t> blocks = {2, 0};
  std::vector<float> q(3 * 4 * 8), out(q.size());
  auto run = [&](AttentionSeq s, int64_t layer = 0, AttentionScoring scoring = {.scale = 0.35f}) {
    return paged_attention(ctx, *cache, layer, q, {&s, 1}, scoring, out).code();
  };
  EXPECT_EQ(run({.block_table = blocks, .query_len = 3, .context_len = 8}), Code::kOk);
  EXPECT_EQ(run({.block_table = blocks, .query_len = 3, .context_len = 8}, 1),
            Code::kInvalidArgument);  // layer
  EXPECT_EQ(run({.block_table = blocks, .query_len = 3, .context_len = 9}),
            Code::kInvalidArgument);  // table too short
  EXPECT_EQ(run({.block_table = blocks, .query_len = 3, .context_len = 2}),
            Code::kInvalidArgument);  // query_len > context_len
  EXPECT_EQ(run({.block_table = blocks, .query_len = 5, .context_len = 8}),
            Code::kInvalidArgument);  // 96 elements of q are not [5, heads, 8]
  const std::vector<int32_t> bad_blocks = {2, 4};
  EXPECT_EQ(run({.block_table = bad_blocks, .query_len = 3, .context_len = 8}),
            Code::kInvalidArgument);  // block id out of range
  const AttentionSeq ok{.block_table = blocks, .query_len = 3, .context_len = 8};
  EXPECT_EQ(run(ok, 0, {.scale = NAN}), Code::kInvalidArgument);
  EXPECT_EQ(run(ok, 0, {.scale = 0.0f}), Code::kInvalidArgument);
  EXPECT_EQ(run(ok, 0, {.scale = 0.35f, .softcap = -1.0f}), Code::kInvalidArgument);
  EXPECT_EQ(run(ok, 0, {.scale = 0.35f, .window = -1}), Code::kInvalidArgument);
  // With a window of 3 the queries at 5..7 read positions 3..7: block 0 (positions 0..3) is read,
  // so its entry must be valid; with a window of 2 (positions 4..7) it is not read and may be -1
  // (a block the engine freed).
  const std::vector<int32_t> freed = {-1, 0};
  const AttentionSeq slid{.block_table = freed, .query_len = 3, .context_len = 8};
  EXPECT_EQ(run(slid, 0, {.scale = 0.35f, .window = 3}), Code::kInvalidArgument);
  EXPECT_EQ(run(slid, 0, {.scale = 0.35f, .window = 2}), Code::kOk);
  std::vector<float> q3(3 * 3 * 8), out3(q3.size());  // 3 heads over 2 kv heads
  const AttentionSeq s{.block_table = blocks, .query_len = 3, .context_len = 8};
  EXPECT_EQ(paged_attention(ctx, *cache, 0, q3, {&s, 1}, {.scale = 0.35f}, out3).code(),
            Code::kInvalidArgument);
}

}  // namespace
}  // namespace tessera::cpu
