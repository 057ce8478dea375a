#include "kernels/cpu/sampling.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <numeric>
#include <set>
#include <vector>

#include "tests/kernels/test_util.h"

namespace tessera::cpu {
namespace {

using testing::random_floats;

constexpr float kInf = std::numeric_limits<float>::infinity();

Sampler make(const SamplingParams& p) {
  EXPECT_TRUE(p.validate().is_ok()) << p.validate().to_string();  // the samplers' precondition
  return Sampler::create(p);
}

int32_t draw(Sampler& s, const std::vector<float>& logits) {
  auto r = s.sample(logits.data(), static_cast<int64_t>(logits.size()), {}, {});
  EXPECT_TRUE(r.has_value()) << r.status().to_string();
  return r->token;
}

// softmax in double.
std::vector<double> softmax(const std::vector<double>& l) {
  const double m = *std::max_element(l.begin(), l.end());
  std::vector<double> p(l.size());
  double sum = 0;
  for (size_t i = 0; i < l.size(); ++i) sum += p[i] = std::isinf(l[i]) ? 0.0 : std::exp(l[i] - m);
  for (double& v : p) v /= sum;
  return p;
}

// Pearson's chi-square of `draws` samples against probabilities `p` (cells with p = 0 must get no
// sample at all). With df = (cells with p > 0) - 1, the statistic is compared with the chi-square
// quantile at 1 - 1e-4 (upper bounds below for df <= 15): a correct sampler fails with
// probability 1e-4 for a given seed, and the seeds are fixed, so the test is deterministic.
void expect_matches_distribution(Sampler& s, const std::vector<float>& logits,
                                 const std::vector<double>& p, int draws, const char* what) {
  std::vector<int> counts(p.size(), 0);
  for (int i = 0; i < draws; ++i) ++counts[draw(s, logits)];
  double chi2 = 0;
  int cells = 0;
  for (size_t i = 0; i < p.size(); ++i) {
    if (p[i] == 0) {
      EXPECT_EQ(counts[i], 0) << what << ": token " << i << " has probability 0";
      continue;
    }
    const double e = p[i] * draws;
    chi2 += (counts[i] - e) * (counts[i] - e) / e;
    ++cells;
  }
  // chi-square quantiles at 1 - 1e-4 for df = 1..15.
  const double q[] = {0,     15.14, 18.42, 21.11, 23.51, 25.74, 27.86, 29.88,
                      31.83, 33.72, 35.56, 37.37, 39.13, 40.87, 42.58, 44.26};
  ASSERT_GE(cells, 2) << what;
  ASSERT_LE(cells, 16) << what;
  EXPECT_LT(chi2, q[cells - 1]) << what << ": chi-square " << chi2 << " with df " << cells - 1;
}

TEST(SamplingParamsTest, ValidateAcceptsDefaultsAndEdges) {
  EXPECT_TRUE(SamplingParams{}.validate().is_ok());
  SamplingParams p;
  p.temperature = 0;
  p.top_k = 1;
  p.top_p = 1;
  p.min_p = 1;
  p.presence_penalty = -2;
  p.frequency_penalty = 2;
  p.repetition_penalty = 0.01f;
  p.logprobs = 0;
  EXPECT_TRUE(p.validate().is_ok());
}

TEST(SamplingParamsTest, ValidateRejectsOutOfRange) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  struct Bad {
    void (*set)(SamplingParams&);
    const char* field;
  };
  const Bad bad[] = {
      {[](SamplingParams& p) { p.temperature = -0.5f; }, "temperature"},
      {[](SamplingParams& p) { p.temperature = kInf; }, "temperature"},
      {[](SamplingParams& p) { p.top_k = 0; }, "top_k"},
      {[](SamplingParams& p) { p.top_k = -2; }, "top_k"},
      {[](SamplingParams& p) { p.top_p = 0; }, "top_p"},
      {[](SamplingParams& p) { p.top_p = 1.01f; }, "top_p"},
      {[](SamplingParams& p) { p.top_p = -0.5f; }, "top_p"},
      {[](SamplingParams& p) { p.min_p = -0.1f; }, "min_p"},
      {[](SamplingParams& p) { p.min_p = 1.5f; }, "min_p"},
      {[](SamplingParams& p) { p.repetition_penalty = 0; }, "repetition_penalty"},
      {[](SamplingParams& p) { p.repetition_penalty = -1; }, "repetition_penalty"},
      {[](SamplingParams& p) { p.presence_penalty = 2.5f; }, "presence_penalty"},
      {[](SamplingParams& p) { p.presence_penalty = -2.01f; }, "presence_penalty"},
      {[](SamplingParams& p) { p.frequency_penalty = -3; }, "frequency_penalty"},
      {[](SamplingParams& p) { p.logprobs = -2; }, "logprobs"},
  };
  for (const Bad& b : bad) {
    SamplingParams p;
    b.set(p);
    Status st = p.validate();
    EXPECT_EQ(st.code(), Code::kInvalidArgument) << b.field;
    EXPECT_NE(st.message().find(b.field), std::string::npos) << st.message();
  }
  // NaN fails every range check.
  for (auto set : {+[](SamplingParams&p, float v) { p.temperature = v; },
                   +[](SamplingParams&p, float v) { p.top_p = v; },
                   +[](SamplingParams&p, float v) { p.min_p = v; },
                   +[](SamplingParams&p, float v) { p.repetition_penalty = v; },
                   +[](SamplingParams&p, float v) { p.presence_penalty = v; },
                   +[](SamplingParams&p, float v) { p.frequency_penalty = v; }}) {
    SamplingParams p;
    set(p, nan);
    EXPECT_EQ(p.validate().code(), Code::kInvalidArgument);
  }
}

TEST(SamplingTest, GreedyArgmaxTiesGoToLowestId) {
  const std::vector<float> l = {0.5f, 3.0f, -1.0f, 3.0f, 2.9f};
  EXPECT_EQ(greedy_argmax(l.data(), 5), 1);
  const std::vector<float> nan_first = {std::numeric_limits<float>::quiet_NaN(), -5.0f, -4.0f};
  EXPECT_EQ(greedy_argmax(nan_first.data(), 3), 2);
  const std::vector<float> all_neg_inf = {-kInf, -kInf};
  EXPECT_EQ(greedy_argmax(all_neg_inf.data(), 2), 0);
}

TEST(SamplingTest, TemperatureZeroIsGreedy) {
  const std::vector<float> l = random_floats(1000, 1000, -5.0f, 5.0f);
  const int32_t best = greedy_argmax(l.data(), 1000);
  for (uint64_t seed : {1u, 2u, 3u}) {
    Sampler s = make({.temperature = 0.0f, .seed = seed});
    for (int i = 0; i < 20; ++i) EXPECT_EQ(draw(s, l), best);
  }
  Sampler tie = make({.temperature = 0.0f});
  EXPECT_EQ(draw(tie, {1.0f, 7.0f, 7.0f, 2.0f}), 1);
}

TEST(SamplingTest, SameSeedSameTokensDifferentSeedDiffers) {
  const int steps = 200;
  std::vector<std::vector<float>> logits;
  for (int i = 0; i < steps; ++i) logits.push_back(random_floats(500, 1100 + i, -2.0f, 2.0f));
  auto run = [&](uint64_t seed) {
    Sampler s = make({.temperature = 1.0f, .top_p = 0.95f, .seed = seed});
    std::vector<int32_t> out;
    for (const auto& l : logits) out.push_back(draw(s, l));
    return out;
  };
  EXPECT_EQ(run(42), run(42));
  EXPECT_NE(run(42), run(43));
  // An unseeded sampler reports the random seed it drew; reusing it reproduces its tokens.
  Sampler unseeded = make({.temperature = 1.0f, .top_p = 0.95f});
  std::vector<int32_t> first;
  for (const auto& l : logits) first.push_back(draw(unseeded, l));
  EXPECT_EQ(first, run(unseeded.seed()));
}

TEST(SamplingTest, TopK1AndTinyTopPAreGreedy) {
  Sampler k1 = make({.temperature = 1.5f, .top_k = 1, .seed = 7});
  Sampler p0 = make({.temperature = 1.5f, .top_p = 1e-6f, .seed = 8});
  for (int i = 0; i < 50; ++i) {
    std::vector<float> l = random_floats(3000, 1200 + i, -1.0f, 1.0f);
    if (i % 5 == 0) l[17] = l[2900] = 5.0f;  // an exact tie at the top: lowest id wins
    const int32_t best = greedy_argmax(l.data(), 3000);
    EXPECT_EQ(draw(k1, l), best);
    EXPECT_EQ(draw(p0, l), best);
  }
}

TEST(SamplingTest, FrequenciesMatchSoftmax) {
  const std::vector<float> l = {1.0f, 0.2f, -0.5f, 2.0f, 0.0f, -1.5f, 1.2f, 0.7f};
  std::vector<double> scaled(l.size());
  for (size_t i = 0; i < l.size(); ++i) scaled[i] = static_cast<double>(l[i] / 0.8f);
  Sampler s = make({.temperature = 0.8f, .seed = 1300});
  expect_matches_distribution(s, l, softmax(scaled), 40000, "temperature 0.8");
}

TEST(SamplingTest, TopKKeepsTheKBestRenormalised) {
  const std::vector<float> l = {1.0f, 0.2f, -0.5f, 2.0f, 0.0f, -1.5f, 1.2f, 0.7f};
  std::vector<double> kept = {1.0, -kInf, -kInf, 2.0, -kInf, -kInf, 1.2, -kInf};
  Sampler s = make({.top_k = 3, .seed = 1400});
  expect_matches_distribution(s, l, softmax(kept), 30000, "top_k 3");
}

TEST(SamplingTest, TopPKeepsTheSmallestHeadReachingP) {
  // Probabilities 0.5, 0.25, 0.15, 0.1: with top_p = 0.7 the mass above token 2 is 0.75 >= 0.7,
  // so tokens 0 and 1 remain (vLLM: ascending cumsum 0.1, 0.25 <= 0.3 are masked).
  const std::vector<float> l = {std::log(0.5f), std::log(0.25f), std::log(0.15f), std::log(0.1f)};
  Sampler s = make({.top_p = 0.7f, .seed = 1500});
  expect_matches_distribution(s, l, {2.0 / 3, 1.0 / 3, 0, 0}, 30000, "top_p 0.7");
  Sampler s2 = make({.top_p = 0.8f, .seed = 1501});
  expect_matches_distribution(s2, l, {0.5 / 0.9, 0.25 / 0.9, 0.15 / 0.9, 0}, 30000, "top_p 0.8");
}

TEST(SamplingTest, MinPDropsUnlikelyTokens) {
  // p = 0.5, 0.25, 0.15, 0.1; min_p 0.35 drops p < 0.175.
  const std::vector<float> l = {std::log(0.5f), std::log(0.25f), std::log(0.15f), std::log(0.1f)};
  Sampler s = make({.min_p = 0.35f, .seed = 1600});
  expect_matches_distribution(s, l, {0.5 / 0.75, 0.25 / 0.75, 0, 0}, 30000, "min_p 0.35");
}

// min_p runs before top_k / top_p (vLLM V1), and top_p sees the renormalised top_k survivors.
TEST(SamplingTest, FiltersComposeInVllmOrder) {
  // p = 0.4, 0.3, 0.2, 0.1. top_k 3 -> 4/9, 3/9, 2/9; top_p 0.5: mass above token 1 is 4/9 <
  // 0.5 -> tokens 0, 1 remain.
  const std::vector<float> l = {std::log(0.4f), std::log(0.3f), std::log(0.2f), std::log(0.1f)};
  Sampler s = make({.top_p = 0.5f, .top_k = 3, .seed = 1700});
  expect_matches_distribution(s, l, {4.0 / 7, 3.0 / 7, 0, 0}, 30000, "top_k 3 + top_p 0.5");
  // min_p 0.6 keeps p >= 0.24 -> tokens 0, 1; top_p 0.5 then keeps only token 0 (4/7 >= 0.5).
  std::vector<float> f = l;
  ASSERT_TRUE(filter_logits(f, {.top_p = 0.5f, .min_p = 0.6f}).is_ok());
  EXPECT_EQ(f[0], l[0]);
  for (int i = 1; i < 4; ++i) EXPECT_EQ(f[i], -kInf) << i;
}

// top_p without top_k on a large, flat vocabulary: the cut lies beyond several rounds of the
// growing sorted head. The surviving set equals a brute-force full sort.
TEST(SamplingTest, TopPOnLargeVocabularyMatchesFullSort) {
  const int64_t vocab = 150000;
  for (float top_p : {0.05f, 0.5f, 0.9f, 0.999f}) {
    const std::vector<float> l = random_floats(vocab, 1800, -3.0f, 3.0f);
    std::vector<float> f = l;
    ASSERT_TRUE(filter_logits(f, {.temperature = 0.7f, .top_p = top_p}).is_ok());
    std::vector<int32_t> ids(vocab);
    std::iota(ids.begin(), ids.end(), 0);
    std::vector<double> t(vocab);
    for (int64_t i = 0; i < vocab; ++i) t[i] = l[i] / 0.7f;
    std::sort(ids.begin(), ids.end(),
              [&](int32_t a, int32_t b) { return t[a] > t[b] || (t[a] == t[b] && a < b); });
    const double m = t[ids[0]];
    double total = 0;
    for (double v : t) total += std::exp(v - m);
    std::set<int32_t> expected;
    double above = 0;
    for (int32_t id : ids) {
      if (!expected.empty() && above >= top_p * total) break;
      expected.insert(id);
      above += std::exp(t[id] - m);
    }
    std::set<int32_t> actual;
    for (int64_t i = 0; i < vocab; ++i) {
      if (f[i] != -kInf) {
        actual.insert(static_cast<int32_t>(i));
        EXPECT_EQ(f[i], l[i] / 0.7f);  // survivors keep their tempered logits
      }
    }
    EXPECT_EQ(actual, expected) << "top_p " << top_p << ": " << actual.size() << " vs "
                                << expected.size();
  }
}

TEST(SamplingTest, PenaltiesExactValues) {
  const std::vector<float> l = {2.0f, -1.0f, 0.5f, 3.0f, -2.0f, 0.0f, 1.0f};
  const std::vector<int32_t> prompt = {0, 1, 5, 0};
  const std::vector<int32_t> output = {3, 3, 2, 1};
  const SamplingParams p{
      .repetition_penalty = 1.5f, .presence_penalty = 0.25f, .frequency_penalty = 0.5f};
  std::vector<float> got = l;
  ASSERT_TRUE(apply_penalties(got, prompt, output, p).is_ok());
  // Each value in fp32, in vLLM's order: repetition (prompt + output, once per token), then
  // -= frequency * count, then -= presence.
  const std::vector<float> want = {
      2.0f / 1.5f,                           // prompt only, positive: divided
      (-1.0f * 1.5f) - 0.5f * 1.0f - 0.25f,  // prompt + output once, negative: multiplied
      (0.5f / 1.5f) - 0.5f * 1.0f - 0.25f,   // output once
      (3.0f / 1.5f) - 0.5f * 2.0f - 0.25f,   // output twice
      -2.0f,                                 // unseen
      0.0f * 1.5f,                           // zero is "not positive": multiplied
      1.0f,                                  // unseen
  };
  for (size_t i = 0; i < l.size(); ++i) EXPECT_EQ(got[i], want[i]) << "token " << i;
  EXPECT_FLOAT_EQ(want[0], 1.3333334f);
  EXPECT_FLOAT_EQ(want[1], -2.25f);
  EXPECT_FLOAT_EQ(want[3], 0.75f);

  // The sampler applies them before the greedy choice: token 3 (3.0) drops below token 0.
  Sampler s = make({.temperature = 0.0f,
                    .repetition_penalty = 1.5f,
                    .presence_penalty = 0.25f,
                    .frequency_penalty = 0.5f});
  auto r = s.sample(l.data(), 7, prompt, output);
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->token, 0);
  // Out-of-range ids are errors.
  const std::vector<int32_t> bad = {7};
  EXPECT_EQ(apply_penalties(got, bad, {}, p).code(), Code::kInvalidArgument);
  EXPECT_EQ(s.sample(l.data(), 7, {}, bad).status().code(), Code::kInvalidArgument);
}

// Logprobs are vLLM V1's default "raw_logprobs": log_softmax of the model's logits, untouched by
// penalties, temperature and filters. Tolerance 1e-6 absolute: the kernel sums exp in double and
// rounds the final difference to fp32 (|logprob| < 20 here, so 1 ulp <= 2e-6 would be loose;
// the values stay well within 1e-6 of the float64 reference).
TEST(SamplingTest, LogprobsAreRawAndNormalised) {
  const int64_t vocab = kMaxLogprobs;  // every token's logprob comes back
  const std::vector<float> l = random_floats(vocab, 1900, -4.0f, 4.0f);
  std::vector<double> ld(l.begin(), l.end());
  const std::vector<double> p = softmax(ld);
  Sampler s = make({.temperature = 0.7f,
                    .top_k = 5,
                    .seed = 3,
                    .repetition_penalty = 1.3f,
                    .logprobs = static_cast<int>(vocab)});
  const std::vector<int32_t> output = {1, 2, 3};
  auto r = s.sample(l.data(), vocab, {}, output);
  ASSERT_TRUE(r.has_value());
  ASSERT_EQ(static_cast<int64_t>(r->top_logprobs.size()), vocab);
  double lse = -kInf;
  for (size_t i = 0; i < r->top_logprobs.size(); ++i) {
    auto [id, lp] = r->top_logprobs[i];
    EXPECT_NEAR(lp, std::log(p[id]), 1e-6) << id;
    lse = std::max(lse, static_cast<double>(lp)) +
          std::log1p(std::exp(-std::abs(lse - static_cast<double>(lp))));
    if (i > 0) {  // sorted descending, ties by id
      auto [pid, plp] = r->top_logprobs[i - 1];
      EXPECT_TRUE(plp > lp || (plp == lp && pid < id));
    }
  }
  EXPECT_NEAR(lse, 0.0, 1e-6);  // logsumexp of the full distribution
  EXPECT_NEAR(r->logprob, std::log(p[r->token]), 1e-6);

  Sampler top3 = make({.logprobs = 3});
  const std::vector<float> tied = {1.0f, 4.0f, 2.0f, 4.0f, 3.0f};
  r = top3.sample(tied.data(), 5, {}, {});
  ASSERT_TRUE(r.has_value());
  ASSERT_EQ(r->top_logprobs.size(), 3u);
  EXPECT_EQ(r->top_logprobs[0].first, 1);
  EXPECT_EQ(r->top_logprobs[1].first, 3);
  EXPECT_EQ(r->top_logprobs[2].first, 4);

  Sampler none = make({.logprobs = 0});
  r = none.sample(tied.data(), 5, {}, {});
  ASSERT_TRUE(r.has_value());
  EXPECT_TRUE(r->top_logprobs.empty());
  EXPECT_FALSE(std::isnan(r->logprob));
  Sampler off = make({});
  r = off.sample(tied.data(), 5, {}, {});
  ASSERT_TRUE(r.has_value());
  EXPECT_TRUE(std::isnan(r->logprob));
}

TEST(SamplingTest, FilterLogitsGreedyAndErrors) {
  std::vector<float> l = {0.5f, 2.0f, 2.0f, -1.0f};
  ASSERT_TRUE(filter_logits(l, {.temperature = 0.0f}).is_ok());
  EXPECT_EQ(l, (std::vector<float>{-kInf, 2.0f, -kInf, -kInf}));
  std::vector<float> dead = {-kInf, std::numeric_limits<float>::quiet_NaN()};
  EXPECT_EQ(filter_logits(dead, {}).code(), Code::kInvalidArgument);
}

TEST(SamplingTest, SampleErrorsAndNanLogits) {
  Sampler s = make({.seed = 5});
  const std::vector<float> l = {1.0f, 2.0f};
  EXPECT_EQ(s.sample(l.data(), 0, {}, {}).status().code(), Code::kInvalidArgument);
  EXPECT_EQ(s.sample(nullptr, 2, {}, {}).status().code(), Code::kInvalidArgument);
  const std::vector<int32_t> neg = {-1};
  EXPECT_EQ(s.sample(l.data(), 2, neg, {}).status().code(), Code::kInvalidArgument);
  const std::vector<float> dead = {-kInf, -kInf};
  EXPECT_EQ(s.sample(dead.data(), 2, {}, {}).status().code(), Code::kFailedPrecondition);
  // NaN is never sampled.
  const std::vector<float> with_nan = {std::numeric_limits<float>::quiet_NaN(), 0.0f, 0.1f};
  for (int i = 0; i < 200; ++i) EXPECT_NE(draw(s, with_nan), 0);
}

}  // namespace
}  // namespace tessera::cpu
