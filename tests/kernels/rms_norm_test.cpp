#include "kernels/cpu/rms_norm.h"

#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "tests/kernels/test_util.h"

namespace tessera::cpu {
namespace {

using testing::expect_close_all;
using testing::make_weight;
using testing::random_floats;
using testing::Weight;

// float64 reference: out = w * x / sqrt(mean(x^2) + eps), eps as the fp32 value torch adds.
std::vector<double> reference(const std::vector<float>& x, const Weight& w, double eps) {
  const size_t d = w.value.size();
  std::vector<double> out(x.size());
  const double eps32 = static_cast<float>(eps);
  for (size_t r = 0; r < x.size() / d; ++r) {
    double ss = 0;
    for (size_t i = 0; i < d; ++i) ss += static_cast<double>(x[r * d + i]) * x[r * d + i];
    const double inv = 1.0 / std::sqrt(ss / d + eps32);
    for (size_t i = 0; i < d; ++i) out[r * d + i] = w.value[i] * (x[r * d + i] * inv);
  }
  return out;
}

// Rows at very different scales (1e-3 to 1e3) so eps matters for some and not for others.
std::vector<float> scaled_rows(int64_t n, int64_t d, uint32_t seed) {
  std::vector<float> x = random_floats(n * d, seed, -2.0f, 2.0f);
  const float scales[] = {1.0f, 1e-3f, 1e3f, 0.05f, 7.0f};
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t i = 0; i < d; ++i) x[r * d + i] *= scales[r % 5];
  }
  return x;
}

// Tolerance 1e-6 relative: the kernel's result is a short chain of correctly rounded fp32 ops
// (variance, + eps, sqrt, division, two products), at most ~4 ulp = 2.4e-7 from the exact value;
// there is no cancellation, so every element is bounded relative to itself.
constexpr double kRtol = 1e-6;

TEST(RmsNormTest, MatchesFloat64ReferenceForEveryDtype) {
  CpuContext ctx(3);
  for (DType dtype : {DType::kF32, DType::kF16, DType::kBF16}) {
    for (int64_t d : {7, 64, 1000}) {
      for (double eps : {1e-5, 1e-6}) {
        const int64_t n = 13;
        const Weight w = make_weight(dtype, {d}, 21 + d, 0.5f, 1.5f);
        const std::vector<float> x = scaled_rows(n, d, 22 + d);
        std::vector<float> out(x.size());
        ASSERT_TRUE(rms_norm(ctx, x, w.view(), eps, out).is_ok());
        expect_close_all(out, reference(x, w, eps), kRtol, 0.0,
                         std::string("rms_norm ") + dtype_name(dtype) + " d=" + std::to_string(d));
      }
    }
  }
}

TEST(RmsNormTest, InPlaceAndParallel) {
  CpuContext ctx(4);
  const int64_t n = 300, d = 512;
  const Weight w = make_weight(DType::kBF16, {d}, 23, -1.5f, 1.5f);
  std::vector<float> x = scaled_rows(n, d, 24);
  const std::vector<double> expected = reference(x, w, 1e-6);
  ASSERT_TRUE(rms_norm(ctx, x, w.view(), 1e-6, x).is_ok());
  expect_close_all(x, expected, kRtol, 0.0, "rms_norm in place");
}

TEST(RmsNormTest, AddRmsNormUpdatesResidualAndNormalisesIt) {
  CpuContext ctx(2);
  const int64_t n = 9, d = 96;
  const Weight w = make_weight(DType::kF16, {d}, 25, 0.5f, 1.5f);
  const std::vector<float> x = scaled_rows(n, d, 26);
  std::vector<float> residual = random_floats(n * d, 27, -3.0f, 3.0f);
  // residual += x is one fp32 addition per element: exact expected values.
  std::vector<float> expected_residual(residual.size());
  for (size_t i = 0; i < residual.size(); ++i) expected_residual[i] = residual[i] + x[i];
  std::vector<float> out(x.size());
  ASSERT_TRUE(add_rms_norm(ctx, x, residual, w.view(), 1e-5, out).is_ok());
  EXPECT_EQ(residual, expected_residual);
  expect_close_all(out, reference(expected_residual, w, 1e-5), kRtol, 0.0, "add_rms_norm");
  // out may alias x.
  std::vector<float> x2 = x;
  std::vector<float> residual2 = expected_residual;
  for (size_t i = 0; i < residual2.size(); ++i) residual2[i] -= x[i];
  std::vector<float> expect_res2(residual2.size());
  for (size_t i = 0; i < residual2.size(); ++i) expect_res2[i] = residual2[i] + x[i];
  ASSERT_TRUE(add_rms_norm(ctx, x2, residual2, w.view(), 1e-5, x2).is_ok());
  expect_close_all(x2, reference(expect_res2, w, 1e-5), kRtol, 0.0, "add_rms_norm aliased");
}

// Qwen3's q_norm / k_norm: every head of [n, heads, head_dim] normalised on its own.
TEST(RmsNormTest, PerHeadNormalisesEachHead) {
  CpuContext ctx(2);
  const int64_t n = 5, heads = 6, hd = 128;
  const Weight w = make_weight(DType::kBF16, {hd}, 28, 0.5f, 1.5f);
  std::vector<float> x = scaled_rows(n * heads, hd, 29);
  const std::vector<double> expected = reference(x, w, 1e-6);
  ASSERT_TRUE(rms_norm_per_head(ctx, x, w.view(), 1e-6).is_ok());
  expect_close_all(x, expected, kRtol, 0.0, "rms_norm_per_head");
}

TEST(RmsNormTest, ShapeErrors) {
  CpuContext ctx(1);
  const Weight w = make_weight(DType::kF32, {8}, 30);
  std::vector<float> x(20), out(20);
  EXPECT_EQ(rms_norm(ctx, x, w.view(), 1e-6, out).code(), Code::kInvalidArgument);  // 20 % 8
  std::vector<float> x16(16), out8(8);
  EXPECT_EQ(rms_norm(ctx, x16, w.view(), 1e-6, out8).code(), Code::kInvalidArgument);
  std::vector<float> res8(8);
  EXPECT_EQ(add_rms_norm(ctx, x16, res8, w.view(), 1e-6, x16).code(), Code::kInvalidArgument);
  const Weight w2 = make_weight(DType::kF32, {2, 4}, 31);
  EXPECT_EQ(rms_norm(ctx, x16, w2.view(), 1e-6, x16).code(), Code::kInvalidArgument);
}

}  // namespace
}  // namespace tessera::cpu
