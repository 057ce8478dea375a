#include "kernels/cpu/paged_kv_cache.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "tests/kernels/test_util.h"

namespace tessera::cpu {
namespace {

using testing::random_floats;

const KvCacheShape kShape{
    .num_layers = 3, .num_blocks = 10, .block_size = 4, .num_kv_heads = 2, .head_dim = 8};

TEST(PagedKvCacheTest, LayoutIsLayerBlockSlotHeadDim) {
  auto cache = PagedKvCache::create(kShape);
  ASSERT_TRUE(cache.has_value());
  const float* base = cache->key(0, 0, 0);
  for (int64_t l = 0; l < 3; ++l) {
    for (int64_t b : {0, 3, 9}) {
      for (int64_t o = 0; o < 4; ++o) {
        EXPECT_EQ(cache->key(l, b, o) - base, ((l * 10 + b) * 4 + o) * 16);
        EXPECT_EQ(cache->value(l, b, o) - cache->value(0, 0, 0), ((l * 10 + b) * 4 + o) * 16);
      }
    }
  }
}

TEST(PagedKvCacheTest, WriteStoresTokensAtTheirSlots) {
  auto cache = PagedKvCache::create(kShape);
  ASSERT_TRUE(cache.has_value());
  const std::vector<int64_t> slots = {0, 39, 17, -1, 5};  // -1: padding, skipped
  const int64_t n = static_cast<int64_t>(slots.size()), te = 16;
  const std::vector<float> k = random_floats(n * te, 600);
  const std::vector<float> v = random_floats(n * te, 601);
  ASSERT_TRUE(cache->write(1, k, v, slots).is_ok());
  for (int64_t i = 0; i < n; ++i) {
    if (slots[i] < 0) continue;
    const float* kc = cache->key(1, slots[i] / 4, slots[i] % 4);
    const float* vc = cache->value(1, slots[i] / 4, slots[i] % 4);
    for (int64_t e = 0; e < te; ++e) {
      ASSERT_EQ(kc[e], k[i * te + e]);
      ASSERT_EQ(vc[e], v[i * te + e]);
    }
  }
  // Other layers and slots are untouched (zero-initialised).
  for (int64_t e = 0; e < te; ++e) {
    EXPECT_EQ(cache->key(0, 0, 0)[e], 0.0f);
    EXPECT_EQ(cache->key(2, 9, 3)[e], 0.0f);
    EXPECT_EQ(cache->value(1, 0, 1)[e], 0.0f);
  }
}

TEST(PagedKvCacheTest, Fp8CacheStoresValuesRoundedToE4M3) {
  KvCacheShape shape = kShape;
  shape.dtype = KvCacheDtype::kFp8E4M3;
  auto cache = PagedKvCache::create(shape);
  ASSERT_TRUE(cache.has_value());
  const std::vector<int64_t> slots = {3, 22};
  const int64_t te = 16;
  std::vector<float> k = random_floats(2 * te, 604), v = random_floats(2 * te, 605);
  k[0] = 1000.0f;   // saturates at 448
  v[1] = -1.0625f;  // a tie: to the even code, -1
  ASSERT_TRUE(cache->write(0, k, v, slots).is_ok());
  int changed = 0;
  for (int64_t i = 0; i < 2; ++i) {
    const float* kc = cache->key(0, slots[i] / 4, slots[i] % 4);
    const float* vc = cache->value(0, slots[i] / 4, slots[i] % 4);
    for (int64_t e = 0; e < te; ++e) {
      const float kx = k[i * te + e], vx = v[i * te + e];
      ASSERT_EQ(kc[e], fp8_e4m3_to_float(float_to_fp8_e4m3(kx)));
      ASSERT_EQ(vc[e], fp8_e4m3_to_float(float_to_fp8_e4m3(vx)));
      // E4M3 keeps 3 fraction bits: within 1/16 relative (or 2^-10 absolute near zero).
      EXPECT_LE(std::fabs(vc[e] - vx), std::max(std::fabs(vx) / 16.0f, 0.0009765625f));
      changed += kc[e] != kx;
    }
  }
  EXPECT_EQ(cache->key(0, 0, 3)[0], 448.0f);
  EXPECT_EQ(cache->value(0, 0, 3)[1], -1.0f);
  EXPECT_GT(changed, 16);  // random floats are almost never E4M3 values already
}

TEST(PagedKvCacheTest, BadSlotIsAnErrorAndWritesNothing) {
  auto cache = PagedKvCache::create(kShape);
  ASSERT_TRUE(cache.has_value());
  const std::vector<float> k = random_floats(2 * 16, 602), v = random_floats(2 * 16, 603);
  for (int64_t bad : {int64_t{40}, int64_t{-2}, int64_t{1} << 40}) {
    const std::vector<int64_t> slots = {3, bad};
    Status st = cache->write(0, k, v, slots);
    EXPECT_EQ(st.code(), Code::kInvalidArgument) << bad;
    EXPECT_NE(st.message().find(std::to_string(bad)), std::string::npos) << st.message();
    for (int64_t e = 0; e < 16; ++e) EXPECT_EQ(cache->key(0, 0, 3)[e], 0.0f);
  }
  const std::vector<int64_t> slots = {1, 2};
  EXPECT_EQ(cache->write(3, k, v, slots).code(), Code::kInvalidArgument);   // layer
  EXPECT_EQ(cache->write(-1, k, v, slots).code(), Code::kInvalidArgument);  // layer
  const std::vector<float> short_v(31);
  EXPECT_EQ(cache->write(0, k, short_v, slots).code(), Code::kInvalidArgument);
}

TEST(PagedKvCacheTest, CreateErrors) {
  KvCacheShape s = kShape;
  s.num_blocks = 0;
  EXPECT_EQ(PagedKvCache::create(s).status().code(), Code::kInvalidArgument);
  s = kShape;
  s.head_dim = -8;
  EXPECT_EQ(PagedKvCache::create(s).status().code(), Code::kInvalidArgument);
  s = kShape;
  s.num_blocks = int64_t{1} << 40;
  s.num_layers = int64_t{1} << 20;
  EXPECT_EQ(PagedKvCache::create(s).status().code(), Code::kResourceExhausted);
}

}  // namespace
}  // namespace tessera::cpu
