#include "kernels/cpu/activation.h"

#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "tests/kernels/test_util.h"

namespace tessera::cpu {
namespace {

using testing::expect_close_all;
using testing::random_floats;

// silu(g) * u in double.
std::vector<double> reference(const std::vector<float>& gate, const std::vector<float>& up) {
  std::vector<double> out(gate.size());
  for (size_t i = 0; i < gate.size(); ++i) {
    const double g = gate[i];
    out[i] = g / (1.0 + std::exp(-g)) * up[i];
  }
  return out;
}

// Tolerance 1e-6 relative: expf (<= 1 ulp), 1 + e, the division and the product are each
// within an ulp or so of exact (<= ~5 * 2^-24 = 3e-7); there is no cancellation.
constexpr double kRtol = 1e-6;

TEST(ActivationTest, SiluMulMatchesFloat64Reference) {
  CpuContext ctx(3);
  for (int64_t n : {1, 7, 100000}) {  // the last is split over the pool
    const std::vector<float> gate = random_floats(n, 800 + n, -12.0f, 12.0f);
    const std::vector<float> up = random_floats(n, 801 + n, -3.0f, 3.0f);
    std::vector<float> out(n);
    ASSERT_TRUE(silu_mul(ctx, gate, up, out).is_ok());
    expect_close_all(out, reference(gate, up), kRtol, 0.0, "silu_mul n=" + std::to_string(n));
  }
}

TEST(ActivationTest, ExtremeGates) {
  CpuContext ctx(1);
  // Large negative gates underflow to (-)0 as in torch; large positive ones are the identity.
  const std::vector<float> gate = {-200.0f, -90.0f, -30.0f, 30.0f, 90.0f, 1e-30f};
  const std::vector<float> up = {1.5f, -2.0f, 3.0f, 0.5f, -1.0f, 2.0f};
  std::vector<float> out(gate.size());
  ASSERT_TRUE(silu_mul(ctx, gate, up, out).is_ok());
  expect_close_all(out, reference(gate, up), kRtol, 1e-30, "silu_mul extremes");
  for (float v : out) EXPECT_FALSE(std::isnan(v));
}

TEST(ActivationTest, FusedGateUpLayout) {
  CpuContext ctx(2);
  const int64_t n = 9, inter = 300;
  const std::vector<float> gate_up = random_floats(n * 2 * inter, 810, -6.0f, 6.0f);
  std::vector<float> gate, up;
  for (int64_t r = 0; r < n; ++r) {
    gate.insert(gate.end(), gate_up.begin() + r * 2 * inter,
                gate_up.begin() + r * 2 * inter + inter);
    up.insert(up.end(), gate_up.begin() + r * 2 * inter + inter,
              gate_up.begin() + (r + 1) * 2 * inter);
  }
  std::vector<float> out(n * inter), split(n * inter);
  ASSERT_TRUE(silu_mul_fused(ctx, gate_up, inter, out).is_ok());
  expect_close_all(out, reference(gate, up), kRtol, 0.0, "silu_mul_fused");
  ASSERT_TRUE(silu_mul(ctx, gate, up, split).is_ok());
  EXPECT_EQ(out, split);  // same arithmetic, same bits
}

TEST(ActivationTest, SizeErrors) {
  CpuContext ctx(1);
  std::vector<float> a(8), b(7), out(8);
  EXPECT_EQ(silu_mul(ctx, a, b, out).code(), Code::kInvalidArgument);
  std::vector<float> gu(16), o(9);
  EXPECT_EQ(silu_mul_fused(ctx, gu, 8, o).code(), Code::kInvalidArgument);
  EXPECT_EQ(silu_mul_fused(ctx, gu, 0, o).code(), Code::kInvalidArgument);
  std::vector<float> o8(8);
  EXPECT_TRUE(silu_mul_fused(ctx, gu, 4, o8).is_ok());
}

// Gemma's gelu_pytorch_tanh(g) * u against the formula in double. 1 + tanh(..) cancels for
// negative g (to ~2.5e-3 at g = -3): an fp32 rounding of tanh there is ~1e-7 absolute, so the
// bound is 1e-5 relative plus 1e-6 absolute (|u| <= 3).
TEST(ActivationTest, GeluTanhMulMatchesFloat64Reference) {
  CpuContext ctx(3);
  for (int64_t n : {1, 7, 100000}) {
    const std::vector<float> gate = random_floats(n, 900 + n, -6.0f, 6.0f);
    const std::vector<float> up = random_floats(n, 901 + n, -3.0f, 3.0f);
    std::vector<float> out(n);
    ASSERT_TRUE(gelu_tanh_mul(ctx, gate, up, out).is_ok());
    std::vector<double> ref(gate.size());
    for (size_t i = 0; i < gate.size(); ++i) {
      const double g = gate[i];
      const double inner = std::sqrt(2.0 / M_PI) * (g + 0.044715 * g * g * g);
      ref[i] = 0.5 * g * (1.0 + std::tanh(inner)) * up[i];
    }
    expect_close_all(out, ref, 1e-5, 1e-6, "gelu_tanh_mul n=" + std::to_string(n));
  }
  std::vector<float> a(3), b(4), o(3);
  EXPECT_EQ(gelu_tanh_mul(ctx, a, b, o).code(), Code::kInvalidArgument);
}

}  // namespace
}  // namespace tessera::cpu
