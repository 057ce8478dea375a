// FP8 E4M3 conversions (common/tensor.h) and --kv-cache-dtype parsing (common/kv_cache_dtype.h).
// The rounding oracle is a brute-force search over the 254 finite E4M3 values: the nearest one,
// ties to the even code, saturating at +-448 -- a different algorithm from the library's.
// Where CUDA is built, CUDA's own host-side converter (cuda_fp8.h) is checked too: the GPU
// writes the cache with it, the CPU backend with ours, and they must agree bit for bit.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "common/kv_cache_dtype.h"
#include "common/tensor.h"

#ifdef TESSERA_WITH_CUDA
#include <cuda_fp8.h>
#endif

namespace tessera {
namespace {

uint8_t brute_force_round(float x) {
  if (std::isnan(x)) return std::signbit(x) ? 0xff : 0x7f;
  const double a = std::fabs(static_cast<double>(x));
  const uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
  int best = 0;
  double best_err = std::numeric_limits<double>::infinity();
  for (int code = 0; code <= 0x7e; ++code) {
    const double v = fp8_e4m3_to_float(static_cast<uint8_t>(code));
    const double err = std::fabs(v - a);
    if (err < best_err || (err == best_err && (code & 1) == 0)) {
      best = code;
      best_err = err;
    }
  }
  return static_cast<uint8_t>(sign | best);
}

TEST(Fp8E4M3, DecodesTheFormat) {
  EXPECT_EQ(fp8_e4m3_to_float(0x00), 0.0f);
  EXPECT_TRUE(std::signbit(fp8_e4m3_to_float(0x80)));
  EXPECT_EQ(fp8_e4m3_to_float(0x38), 1.0f);  // exponent 7 = bias
  EXPECT_EQ(fp8_e4m3_to_float(0xb8), -1.0f);
  EXPECT_EQ(fp8_e4m3_to_float(0x7e), 448.0f);        // the largest finite
  EXPECT_EQ(fp8_e4m3_to_float(0x08), 0.015625f);     // the smallest normal, 2^-6
  EXPECT_EQ(fp8_e4m3_to_float(0x01), 0.001953125f);  // the smallest subnormal, 2^-9
  EXPECT_EQ(fp8_e4m3_to_float(0x07), 7 * 0.001953125f);
  EXPECT_EQ(fp8_e4m3_to_float(0x3c), 1.5f);
  EXPECT_TRUE(std::isnan(fp8_e4m3_to_float(0x7f)));
  EXPECT_TRUE(std::isnan(fp8_e4m3_to_float(0xff)));
  // Strictly increasing over the positive codes: no code is skipped or repeated.
  for (int c = 1; c <= 0x7e; ++c) {
    EXPECT_GT(fp8_e4m3_to_float(static_cast<uint8_t>(c)),
              fp8_e4m3_to_float(static_cast<uint8_t>(c - 1)));
  }
}

TEST(Fp8E4M3, EveryCodeRoundTrips) {
  for (int c = 0; c < 256; ++c) {
    if ((c & 0x7f) == 0x7f) continue;  // NaN
    EXPECT_EQ(float_to_fp8_e4m3(fp8_e4m3_to_float(static_cast<uint8_t>(c))), c) << c;
  }
}

TEST(Fp8E4M3, RoundsToNearestEvenAndSaturates) {
  EXPECT_EQ(float_to_fp8_e4m3(1.0625f), 0x38);        // halfway 1 .. 1.125: to the even code (1.0)
  EXPECT_EQ(float_to_fp8_e4m3(1.1875f), 0x3a);        // halfway 1.125 .. 1.25: to 1.25
  EXPECT_EQ(float_to_fp8_e4m3(0.0009765625f), 0x00);  // half the smallest subnormal: to 0
  EXPECT_EQ(float_to_fp8_e4m3(0.0029296875f), 0x02);  // 1.5 subnormal steps: to 2
  EXPECT_EQ(float_to_fp8_e4m3(0.0166015625f), 0x08);  // just past 2^-6 in the normal range
  EXPECT_EQ(float_to_fp8_e4m3(460.0f), 0x7e);
  EXPECT_EQ(float_to_fp8_e4m3(1e30f), 0x7e);
  EXPECT_EQ(float_to_fp8_e4m3(-1e30f), 0xfe);
  EXPECT_EQ(float_to_fp8_e4m3(std::numeric_limits<float>::infinity()), 0x7e);
  EXPECT_EQ(float_to_fp8_e4m3(-std::numeric_limits<float>::infinity()), 0xfe);
  EXPECT_EQ(float_to_fp8_e4m3(std::numeric_limits<float>::quiet_NaN()) & 0x7f, 0x7f);
}

// Every bf16 value (what a bf16 model writes into the cache), and random floats.
std::vector<float> probe_values() {
  std::vector<float> xs;
  for (uint32_t h = 0; h < 0x10000; ++h) xs.push_back(bf16_to_float(static_cast<uint16_t>(h)));
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> mant(-1.0f, 1.0f);
  std::uniform_int_distribution<int> exp(-14, 10);
  for (int i = 0; i < 200000; ++i) xs.push_back(std::ldexp(mant(rng), exp(rng)));
  return xs;
}

TEST(Fp8E4M3, MatchesTheBruteForceNearestValue) {
  for (float x : probe_values()) {
    if (std::isnan(x)) continue;
    ASSERT_EQ(float_to_fp8_e4m3(x), brute_force_round(x)) << x;
  }
}

#ifdef TESSERA_WITH_CUDA
TEST(Fp8E4M3, MatchesCudasConverterBitForBit) {
  for (float x : probe_values()) {
    const uint8_t cuda = __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3);
    if (std::isnan(x)) {
      EXPECT_EQ(cuda & 0x7f, 0x7f);
      EXPECT_EQ(float_to_fp8_e4m3(x) & 0x7f, 0x7f);
      continue;
    }
    ASSERT_EQ(float_to_fp8_e4m3(x), cuda) << x;
  }
}
#endif

TEST(KvCacheDtype, ParsesVllmsSpellings) {
  EXPECT_EQ(*parse_kv_cache_dtype("auto"), KvCacheDtype::kAuto);
  EXPECT_EQ(*parse_kv_cache_dtype("fp8"), KvCacheDtype::kFp8E4M3);
  EXPECT_EQ(*parse_kv_cache_dtype("fp8_e4m3"), KvCacheDtype::kFp8E4M3);
  const Expected<KvCacheDtype> e5m2 = parse_kv_cache_dtype("fp8_e5m2");
  ASSERT_FALSE(e5m2);
  EXPECT_NE(e5m2.status().message().find("E5M2 is not supported"), std::string::npos);
  const Expected<KvCacheDtype> bad = parse_kv_cache_dtype("int4");
  ASSERT_FALSE(bad);
  EXPECT_NE(bad.status().message().find("auto, fp8, fp8_e4m3"), std::string::npos);
  // The canonical name reads back.
  for (KvCacheDtype d : {KvCacheDtype::kAuto, KvCacheDtype::kFp8E4M3}) {
    EXPECT_EQ(*parse_kv_cache_dtype(kv_cache_dtype_name(d)), d);
  }
  EXPECT_EQ(kv_cache_element_size(KvCacheDtype::kFp8E4M3, DType::kBF16), 1u);
  EXPECT_EQ(kv_cache_element_size(KvCacheDtype::kAuto, DType::kBF16), 2u);
  EXPECT_EQ(kv_cache_element_size(KvCacheDtype::kAuto, DType::kF32), 4u);
  EXPECT_STREQ(kv_cache_storage_name(KvCacheDtype::kFp8E4M3, DType::kBF16), "F8_E4M3");
  EXPECT_STREQ(kv_cache_storage_name(KvCacheDtype::kAuto, DType::kF16), "F16");
}

}  // namespace
}  // namespace tessera
