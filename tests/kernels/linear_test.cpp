#include "kernels/cpu/linear.h"

#include <gtest/gtest.h>

#include <cmath>
#include <tuple>
#include <vector>

#include "tests/kernels/test_util.h"

namespace tessera::cpu {
namespace {

using testing::expect_near_all;
using testing::make_weight;
using testing::random_floats;
using testing::Weight;

// float64 reference y = x W^T + b, and for each element the rounding-error bound of an fp32
// dot product of length K summed in 8 interleaved lanes: each lane adds K/8 products in
// sequence, then three pairwise steps and the tail, so |error| <= (K/8 + 12) * 2^-24 *
// sum|x_i w_i| (the classical gamma_n bound with n = K/8 + 12, generous for the tail), plus one
// rounding of the bias addition, 2^-24 * |y|.
struct Reference {
  std::vector<double> y;
  std::vector<double> bound;
};

Reference reference(const std::vector<float>& x, const Weight& w, const Weight* bias) {
  const int64_t out = w.shape[0], in = w.shape[1];
  const int64_t n = static_cast<int64_t>(x.size()) / in;
  Reference r;
  r.y.resize(n * out);
  r.bound.resize(n * out);
  const double u = std::ldexp(1.0, -24);
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t o = 0; o < out; ++o) {
      double s = 0, mag = 0;
      for (int64_t i = 0; i < in; ++i) {
        const double p = x[t * in + i] * w.value[o * in + i];
        s += p;
        mag += std::abs(p);
      }
      if (bias != nullptr) s += bias->value[o];
      r.y[t * out + o] = s;
      r.bound[t * out + o] = (in / 8 + 12) * u * mag + u * std::abs(s);
    }
  }
  return r;
}

TEST(LinearTest, MatchesFloat64ReferenceForEveryDtypeAndShape) {
  CpuContext ctx(3);
  // (n, in, out): tails in both dimensions (in % 8 != 0, out % 4 != 0), single tokens, and a
  // size large enough for the pool.
  const std::vector<std::tuple<int64_t, int64_t, int64_t>> shapes = {
      {1, 8, 4}, {1, 13, 5}, {3, 64, 7}, {5, 100, 33}, {1, 1024, 256}, {17, 257, 130}};
  uint32_t seed = 100;
  for (DType dtype : {DType::kF32, DType::kF16, DType::kBF16}) {
    for (auto [n, in, out] : shapes) {
      const Weight w = make_weight(dtype, {out, in}, ++seed);
      const std::vector<float> x = random_floats(n * in, ++seed, -2.0f, 2.0f);
      std::vector<float> y(n * out);
      ASSERT_TRUE(linear(ctx, x, w.view(), nullptr, y).is_ok());
      const Reference r = reference(x, w, nullptr);
      expect_near_all(y, r.y, r.bound,
                      std::string("linear ") + dtype_name(dtype) + " [" + std::to_string(n) + ", " +
                          std::to_string(in) + "] x [" + std::to_string(out) + "]^T");
    }
  }
}

TEST(LinearTest, BiasOfAnyDtype) {
  CpuContext ctx(2);
  const int64_t n = 4, in = 40, out = 18;
  for (DType wd : {DType::kF32, DType::kBF16}) {
    for (DType bd : {DType::kF32, DType::kF16, DType::kBF16}) {
      const Weight w = make_weight(wd, {out, in}, 200);
      const Weight b = make_weight(bd, {out}, 201, -3.0f, 3.0f);
      const std::vector<float> x = random_floats(n * in, 202);
      std::vector<float> y(n * out);
      const TensorView bv = b.view();
      ASSERT_TRUE(linear(ctx, x, w.view(), &bv, y).is_ok());
      const Reference r = reference(x, w, &b);
      expect_near_all(y, r.y, r.bound,
                      std::string("linear bias ") + dtype_name(wd) + "/" + dtype_name(bd));
    }
  }
}

// The result does not depend on the number of threads, and a row computed inside a tile of
// four equals the same row computed alone: the kernels' lane order is fixed.
TEST(LinearTest, BitwiseIndependentOfThreadsAndTiling) {
  const int64_t n = 33, in = 301, out = 65;
  const Weight w = make_weight(DType::kBF16, {out, in}, 300);
  const std::vector<float> x = random_floats(n * in, 301);
  std::vector<float> y1(n * out), y4(n * out);
  CpuContext one(1), four(4);
  ASSERT_TRUE(linear(one, x, w.view(), nullptr, y1).is_ok());
  ASSERT_TRUE(linear(four, x, w.view(), nullptr, y4).is_ok());
  EXPECT_EQ(y1, y4);
  for (int64_t o : {0, 2, 63, 64}) {
    TensorView row{w.half.data() + o * in, DType::kBF16, {1, in}};
    std::vector<float> yr(n);
    ASSERT_TRUE(linear(one, x, row, nullptr, yr).is_ok());
    for (int64_t t = 0; t < n; ++t) ASSERT_EQ(yr[t], y1[t * out + o]) << "row " << o;
  }
}

// A linear over many tokens ticks the context inside its range, about once per
// ProgressTicker::kTickWork multiply-adds, so the actor's watchdog sees a long prefill move.
TEST(LinearTest, ManyTokensTickWithinOneRange) {
  const int64_t n = 64, in = 1024, out = 256;  // 16.7M multiply-adds, 64 tiles of 4 rows
  const Weight w = make_weight(DType::kF32, {out, in}, 310);
  const std::vector<float> x = random_floats(n * in, 311);
  std::vector<float> y(n * out);
  CpuContext ctx(1);  // one range: every tick but one comes from inside it
  const uint64_t before = ctx.ticks();
  ASSERT_TRUE(linear(ctx, x, w.view(), nullptr, y).is_ok());
  EXPECT_EQ(ctx.ticks() - before,
            static_cast<uint64_t>(n * in * out / ProgressTicker::kTickWork + 1));
}

TEST(LinearTest, ShapeErrors) {
  CpuContext ctx(1);
  const Weight w = make_weight(DType::kF32, {6, 8}, 400);
  std::vector<float> x(16), y(12);
  EXPECT_TRUE(linear(ctx, x, w.view(), nullptr, y).is_ok());
  std::vector<float> x_bad(15);
  EXPECT_EQ(linear(ctx, x_bad, w.view(), nullptr, y).code(), Code::kInvalidArgument);
  std::vector<float> y_bad(11);
  EXPECT_EQ(linear(ctx, x, w.view(), nullptr, y_bad).code(), Code::kInvalidArgument);
  const Weight b = make_weight(DType::kF32, {5}, 401);
  const TensorView bv = b.view();
  EXPECT_EQ(linear(ctx, x, w.view(), &bv, y).code(), Code::kInvalidArgument);
  TensorView empty;
  EXPECT_EQ(linear(ctx, x, empty, nullptr, y).code(), Code::kInvalidArgument);
}

}  // namespace
}  // namespace tessera::cpu
