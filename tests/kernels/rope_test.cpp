#include "kernels/cpu/rope.h"

#include <gtest/gtest.h>

#include <cmath>
#include <numbers>
#include <vector>

#include "tests/kernels/test_util.h"

namespace tessera::cpu {
namespace {

using testing::expect_near_all;
using testing::random_floats;

const double kU = std::ldexp(1.0, -24);  // fp32 unit roundoff

// inv_freq by the documented formulas, in double.
std::vector<double> expected_inv_freq(int64_t hd, double theta,
                                      std::optional<Llama3RopeScaling> s) {
  std::vector<double> inv(hd / 2);
  for (int64_t i = 0; i < hd / 2; ++i) {
    double f = 1.0 / std::pow(theta, 2.0 * i / hd);
    if (s) {
      const double low_wl = s->original_max_position_embeddings / s->low_freq_factor;
      const double high_wl = s->original_max_position_embeddings / s->high_freq_factor;
      const double wl = 2 * std::numbers::pi / f;
      if (wl > low_wl) {
        f = f / s->factor;
      } else if (wl >= high_wl) {
        const double smooth = (s->original_max_position_embeddings / wl - s->low_freq_factor) /
                              (s->high_freq_factor - s->low_freq_factor);
        f = (1 - smooth) * f / s->factor + smooth * f;
      }
    }
    inv[i] = f;
  }
  return inv;
}

// transformers rounds the exponent 2i/d to fp32 before pow, which moves theta^e by up to
// ln(theta) * 2^-24 relative; pow, reciprocal and the llama3 arithmetic add a few more fp32
// roundings (the smooth blend is a handful of ops): bound (ln(theta) + 8) * 2^-24 relative.
void check_inv_freq(const RopeTable& t, const std::vector<double>& expected, double theta) {
  ASSERT_EQ(t.inv_freq().size(), expected.size());
  const double rtol = (std::log(theta) + 8) * kU;
  for (size_t i = 0; i < expected.size(); ++i) {
    EXPECT_NEAR(t.inv_freq()[i], expected[i], rtol * expected[i]) << "inv_freq[" << i << "]";
  }
}

TEST(RopeTest, DefaultInvFreq) {
  for (auto [hd, theta] : {std::pair<int64_t, double>{128, 10000.0},
                           {128, 500000.0},
                           {64, 1000000.0},
                           {80, 10000.0}}) {
    auto t = RopeTable::create(hd, theta, 16);
    ASSERT_TRUE(t.has_value()) << t.status().to_string();
    check_inv_freq(*t, expected_inv_freq(hd, theta, std::nullopt), theta);
    EXPECT_EQ(t->inv_freq()[0], 1.0f);
  }
}

// Llama 3.1 8B (factor 8) and Llama 3.2 1B (factor 32): high frequencies untouched, low ones
// divided by the factor, the middle band blended.
TEST(RopeTest, Llama3ScalingKnownConfigs) {
  for (auto [hd, factor] : {std::pair<int64_t, double>{128, 8.0}, {64, 32.0}}) {
    const Llama3RopeScaling s{.factor = factor,
                              .low_freq_factor = 1.0,
                              .high_freq_factor = 4.0,
                              .original_max_position_embeddings = 8192};
    auto t = RopeTable::create(hd, 500000.0, 8, s);
    ASSERT_TRUE(t.has_value()) << t.status().to_string();
    const std::vector<double> expected = expected_inv_freq(hd, 500000.0, s);
    check_inv_freq(*t, expected, 500000.0);
    const std::vector<double> plain = expected_inv_freq(hd, 500000.0, std::nullopt);
    auto unscaled = RopeTable::create(hd, 500000.0, 8);
    ASSERT_TRUE(unscaled.has_value());
    int high = 0, low = 0, medium = 0;
    for (size_t i = 0; i < plain.size(); ++i) {
      const double wl = 2 * std::numbers::pi / plain[i];
      const float base = unscaled->inv_freq()[i];
      if (wl < 2048) {  // exactly the unscaled fp32 value
        ++high;
        EXPECT_EQ(t->inv_freq()[i], base) << i;
      } else if (wl > 8192) {  // exactly one fp32 division by the factor
        ++low;
        EXPECT_EQ(t->inv_freq()[i], base / static_cast<float>(factor)) << i;
      } else {
        ++medium;
        EXPECT_LT(t->inv_freq()[i], plain[i]);
        EXPECT_GT(t->inv_freq()[i], plain[i] / factor);
      }
    }
    EXPECT_EQ(t->inv_freq()[0], 1.0f);
    // All three bands occur for these configs (wavelengths span 2pi .. ~3e6).
    EXPECT_GT(high, 0);
    EXPECT_GT(low, 0);
    EXPECT_GT(medium, 0);
  }
}

// cos/sin as transformers computes them: freq = fp32(inv_freq * position), then cos/sin of it.
// Our table rounds a double cos/sin once: within 2^-24 of that value (tolerance 1e-7 absolute).
// Against the all-double formula the angle differs by the fp32 error of inv_freq and of the
// product, (ln(theta) + 10) * 2^-24 * freq (see check_inv_freq), which bounds cos/sin too.
TEST(RopeTest, CosSinTable) {
  const Llama3RopeScaling s{};
  auto t = RopeTable::create(64, 500000.0, 100001, s);
  ASSERT_TRUE(t.has_value());
  const std::vector<double> exact = expected_inv_freq(64, 500000.0, s);
  for (int64_t pos : {0, 1, 2, 7, 100, 4095, 8191, 65537, 100000}) {
    for (int64_t i = 0; i < 32; ++i) {
      const float freq = t->inv_freq()[i] * static_cast<float>(pos);
      EXPECT_NEAR(t->cos(pos)[i], std::cos(static_cast<double>(freq)), 1e-7) << pos << " " << i;
      EXPECT_NEAR(t->sin(pos)[i], std::sin(static_cast<double>(freq)), 1e-7) << pos << " " << i;
      const double angle_err = (std::log(500000.0) + 10) * kU * exact[i] * pos + 1e-7;
      EXPECT_NEAR(t->cos(pos)[i], std::cos(exact[i] * pos), angle_err) << pos << " " << i;
      EXPECT_NEAR(t->sin(pos)[i], std::sin(exact[i] * pos), angle_err) << pos << " " << i;
    }
  }
}

// float64 rotate_half reference on [n, heads, hd] using transformers' cos/sin (fp32 freq).
std::vector<double> rotate_reference(const std::vector<float>& x, const RopeTable& t,
                                     const std::vector<int64_t>& positions, int64_t hd,
                                     std::vector<double>* bound) {
  const int64_t half = hd / 2;
  const int64_t n = static_cast<int64_t>(positions.size());
  const int64_t heads = static_cast<int64_t>(x.size()) / (n * hd);
  std::vector<double> out(x.size());
  bound->assign(x.size(), 0.0);
  for (int64_t tk = 0; tk < n; ++tk) {
    for (int64_t h = 0; h < heads; ++h) {
      const float* v = x.data() + (tk * heads + h) * hd;
      double* o = out.data() + (tk * heads + h) * hd;
      double* b = bound->data() + (tk * heads + h) * hd;
      for (int64_t i = 0; i < half; ++i) {
        const double f = static_cast<float>(t.inv_freq()[i] * static_cast<float>(positions[tk]));
        const double c = std::cos(f), s = std::sin(f);
        o[i] = v[i] * c - v[i + half] * s;
        o[i + half] = v[i + half] * c + v[i] * s;
        // Two fp32 products, one sum, and cos/sin each rounded to fp32: <= 4 * 2^-24 * (|a|+|b|).
        b[i] = b[i + half] = 4 * kU * (std::abs(v[i]) + std::abs(v[i + half]));
      }
    }
  }
  return out;
}

TEST(RopeTest, ApplyRotatesQAndKWithGqa) {
  CpuContext ctx(3);
  const int64_t hd = 64, heads = 8, kv_heads = 2;
  auto t = RopeTable::create(hd, 1000000.0, 5000);
  ASSERT_TRUE(t.has_value());
  const std::vector<int64_t> positions = {0, 1, 4999, 17, 17, 256, 3};
  const int64_t n = static_cast<int64_t>(positions.size());
  std::vector<float> q = random_floats(n * heads * hd, 500, -3.0f, 3.0f);
  std::vector<float> k = random_floats(n * kv_heads * hd, 501, -3.0f, 3.0f);
  std::vector<double> qb, kb;
  const std::vector<double> q_ref = rotate_reference(q, *t, positions, hd, &qb);
  const std::vector<double> k_ref = rotate_reference(k, *t, positions, hd, &kb);
  ASSERT_TRUE(apply_rope(ctx, *t, positions, q, k).is_ok());
  expect_near_all(q, q_ref, qb, "rope q");
  expect_near_all(k, k_ref, kb, "rope k");
}

TEST(RopeTest, ApplyManyTokensInParallelAndQOnly) {
  CpuContext ctx(4);
  const int64_t hd = 128, heads = 4;
  const Llama3RopeScaling s{};
  auto t = RopeTable::create(hd, 500000.0, 2048, s);
  ASSERT_TRUE(t.has_value());
  std::vector<int64_t> positions(1000);
  for (size_t i = 0; i < positions.size(); ++i) positions[i] = static_cast<int64_t>(i * 2);
  std::vector<float> q = random_floats(positions.size() * heads * hd, 502);
  std::vector<double> qb;
  const std::vector<double> q_ref = rotate_reference(q, *t, positions, hd, &qb);
  ASSERT_TRUE(apply_rope(ctx, *t, positions, q, {}).is_ok());
  expect_near_all(q, q_ref, qb, "rope q only");
}

TEST(RopeTest, Errors) {
  EXPECT_EQ(RopeTable::create(63, 10000.0, 8).status().code(), Code::kInvalidArgument);
  EXPECT_EQ(RopeTable::create(64, 0.0, 8).status().code(), Code::kInvalidArgument);
  EXPECT_EQ(RopeTable::create(64, 10000.0, 0).status().code(), Code::kInvalidArgument);
  Llama3RopeScaling bad{.low_freq_factor = 4.0, .high_freq_factor = 1.0};
  EXPECT_EQ(RopeTable::create(64, 10000.0, 8, bad).status().code(), Code::kInvalidArgument);

  CpuContext ctx(1);
  auto t = RopeTable::create(8, 10000.0, 10);
  ASSERT_TRUE(t.has_value());
  std::vector<float> q = random_floats(2 * 8, 503);
  const std::vector<float> before = q;
  const std::vector<int64_t> bad_pos = {3, 10};
  EXPECT_EQ(apply_rope(ctx, *t, bad_pos, q, {}).code(), Code::kInvalidArgument);
  EXPECT_EQ(q, before);  // nothing modified
  const std::vector<int64_t> neg_pos = {-1, 0};
  EXPECT_EQ(apply_rope(ctx, *t, neg_pos, q, {}).code(), Code::kInvalidArgument);
  std::vector<float> q_bad(15);
  const std::vector<int64_t> pos = {1, 2};
  EXPECT_EQ(apply_rope(ctx, *t, pos, q_bad, {}).code(), Code::kInvalidArgument);
}

// Phi-3's LongRoPE over a partial rotary dimension: short factors below the boundary, long
// from it, cos/sin times attention_factor; the dimensions past rotary_dim pass through.
TEST(RopeTest, LongRopePartialRotary) {
  RopeSpec spec;
  spec.head_dim = 16;
  spec.rotary_dim = 12;
  spec.theta = 10000.0;
  LongRopeScaling l;
  for (int i = 0; i < 6; ++i) {
    l.short_factor.push_back(1.0 + 0.25 * i);
    l.long_factor.push_back(2.0 + 1.5 * i);
  }
  l.original_max_position_embeddings = 128;
  l.attention_factor = std::sqrt(1 + std::log(4.0) / std::log(128.0));
  spec.longrope = l;
  auto t = RopeTable::create(spec, 512);
  ASSERT_TRUE(t.has_value()) << t.status().to_string();
  EXPECT_EQ(t->rotary_dim(), 12);
  ASSERT_EQ(t->inv_freq().size(), 6u);
  const float att = static_cast<float>(l.attention_factor);
  for (int64_t pos : {0, 1, 127, 128, 511}) {
    const std::vector<double>& f = pos < 128 ? l.short_factor : l.long_factor;
    for (int64_t i = 0; i < 6; ++i) {
      const double inv = 1.0 / (f[i] * std::pow(10000.0, 2.0 * i / 12));
      const double angle = inv * pos;
      const double tol = (std::log(10000.0) + 10) * kU * inv * pos * 1.2 + 4e-7;
      EXPECT_NEAR(t->cos(pos)[i], std::cos(angle) * att, tol) << pos << " " << i;
      EXPECT_NEAR(t->sin(pos)[i], std::sin(angle) * att, tol) << pos << " " << i;
    }
  }
  // Rotation touches only the first 12 dimensions of each 16.
  CpuContext ctx(1);
  std::vector<float> q = random_floats(2 * 16, 77, -1.0f, 1.0f);
  const std::vector<float> before = q;
  const std::vector<int64_t> positions = {3, 200};
  ASSERT_TRUE(apply_rope(ctx, *t, positions, q, {}).is_ok());
  for (int64_t tk = 0; tk < 2; ++tk) {
    const float* c = t->cos(positions[tk]);
    const float* sn = t->sin(positions[tk]);
    for (int64_t i = 0; i < 6; ++i) {
      const float a = before[tk * 16 + i], b = before[tk * 16 + i + 6];
      EXPECT_FLOAT_EQ(q[tk * 16 + i], a * c[i] - b * sn[i]);
      EXPECT_FLOAT_EQ(q[tk * 16 + i + 6], b * c[i] + a * sn[i]);
    }
    for (int64_t i = 12; i < 16; ++i) EXPECT_EQ(q[tk * 16 + i], before[tk * 16 + i]);
  }
  spec.rotary_dim = 10;  // factor lists of 6 do not fit 10 / 2
  EXPECT_FALSE(RopeTable::create(spec, 512).has_value());
  spec.rotary_dim = 18;
  EXPECT_FALSE(RopeTable::create(spec, 512).has_value());
}

// Gemma 3's global layers: rope_type linear divides inv_freq by the factor.
TEST(RopeTest, LinearScaling) {
  RopeSpec spec;
  spec.head_dim = 32;
  spec.theta = 1e6;
  auto plain = RopeTable::create(spec, 8);
  spec.linear_factor = 8.0;
  auto scaled = RopeTable::create(spec, 8);
  ASSERT_TRUE(plain.has_value() && scaled.has_value());
  for (size_t i = 0; i < 16; ++i) {
    EXPECT_EQ(scaled->inv_freq()[i], plain->inv_freq()[i] / 8.0f) << i;
  }
  spec.linear_factor = 0;
  EXPECT_FALSE(RopeTable::create(spec, 8).has_value());
}

}  // namespace
}  // namespace tessera::cpu
