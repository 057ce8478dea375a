// GpuSampler against its CPU oracle (kernels/cpu/sampling.h): greedy argmax, raw logprobs and
// top logprobs, penalties, the support and frequencies of filtered draws, determinism and errors.
// Runs only on a GPU machine (scripts/gpu-check); without a CUDA device every test fails.
#include "kernels/cuda/sampling.h"

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <deque>
#include <functional>
#include <limits>
#include <random>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "kernels/cpu/sampling.h"
#include "kernels/cuda/cuda_util.h"

namespace tessera::cuda {
namespace {

using ::tessera::SampleResult;
using ::tessera::SamplingParams;

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

bool have_gpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

#define REQUIRE_GPU()                                                                        \
  do {                                                                                       \
    if (!have_gpu()) FAIL() << "no CUDA device: run this test on a GPU machine (gpu-check)"; \
  } while (0)

std::unique_ptr<GpuSampler> make_sampler(int max_rows, int64_t vocab, int max_logprobs = 20) {
  auto s = GpuSampler::create(max_rows, vocab, max_logprobs, nullptr);
  EXPECT_TRUE(s.has_value()) << s.status().to_string();
  return s.has_value() ? std::move(s).value() : nullptr;
}

// Logits in device memory (a fresh copy per call: sample() overwrites them).
struct DeviceLogits {
  DeviceBuffer buf;
  explicit DeviceLogits(const std::vector<float>& host, size_t extra_floats = 0) {
    auto b = DeviceBuffer::allocate((host.size() + extra_floats) * sizeof(float), "test logits");
    EXPECT_TRUE(b.has_value());
    buf = std::move(b).value();
    EXPECT_EQ(cudaMemcpy(buf.as<float>() + extra_floats, host.data(), host.size() * sizeof(float),
                         cudaMemcpyHostToDevice),
              cudaSuccess);
  }
  float* get(size_t offset = 0) const { return buf.as<float>() + offset; }
};

Expected<std::vector<SampleResult>> gpu_sample(GpuSampler& s, const std::vector<float>& logits,
                                               std::span<const SampleRow> rows) {
  DeviceLogits d(logits);
  return s.sample(d.get(), rows);
}

std::vector<float> random_logits(std::mt19937_64& rng, int64_t n, float stddev) {
  std::normal_distribution<float> dist(0.0f, stddev);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = dist(rng);
  return v;
}

// log_softmax of raw logits (NaN as -inf), in double.
std::vector<double> raw_log_softmax(const float* l, int64_t vocab) {
  double m = -kInf;
  for (int64_t i = 0; i < vocab; ++i) {
    if (!std::isnan(l[i])) m = std::max(m, static_cast<double>(l[i]));
  }
  double sum = 0.0;
  for (int64_t i = 0; i < vocab; ++i) {
    if (!std::isnan(l[i])) sum += std::exp(static_cast<double>(l[i]) - m);
  }
  const double lse = m + std::log(sum);
  std::vector<double> out(static_cast<size_t>(vocab));
  for (int64_t i = 0; i < vocab; ++i) {
    out[i] = std::isnan(l[i]) ? -kInf : static_cast<double>(l[i]) - lse;
  }
  return out;
}

void expect_logprob_near(double expected, float got, const std::string& where) {
  if (std::isinf(expected)) {
    EXPECT_TRUE(std::isinf(got) && got < 0) << where << ": got " << got;
  } else {
    EXPECT_NEAR(expected, got, 1e-4) << where;
  }
}

// Rows that all share one span of ids must keep it alive: rows hold spans into `ids`.
struct Rows {
  std::deque<std::vector<int32_t>> ids;
  std::vector<SampleRow> rows;
  SampleRow& add(const SamplingParams& p, uint64_t seed = 0, uint64_t step = 0,
                 std::vector<int32_t> prompt = {}, std::vector<int32_t> output = {}) {
    SampleRow r;
    r.params = p;
    r.seed = seed;
    r.step = step;
    ids.push_back(std::move(prompt));
    r.prompt_ids = ids.back();
    ids.push_back(std::move(output));
    r.output_ids = ids.back();
    rows.push_back(r);
    return rows.back();
  }
};

SamplingParams greedy_params(int logprobs = -1) {
  SamplingParams p;
  p.temperature = 0.0f;
  p.logprobs = logprobs;
  return p;
}

// Rows with ties, -inf and NaN, for the argmax tests. Every row has at least one finite logit
// unless `allow_nonfinite_rows`.
std::vector<float> tricky_rows(std::mt19937_64& rng, int rows, int64_t vocab,
                               bool allow_nonfinite_rows) {
  std::vector<float> all;
  std::uniform_int_distribution<int64_t> pick(0, vocab - 1);
  for (int r = 0; r < rows; ++r) {
    std::vector<float> l = random_logits(rng, vocab, 3.0f);
    switch (r % 8) {
      case 0:
        break;
      case 1: {  // exact ties of the maximum, the first somewhere in the middle
        const float top = *std::max_element(l.begin(), l.end()) + 1.0f;
        for (int i = 0; i < 4; ++i) l[pick(rng)] = top;
        break;
      }
      case 2:  // NaN and -inf sprinkled, NaN at 0
        for (int i = 0; i < std::max<int64_t>(1, vocab / 5); ++i) l[pick(rng)] = kNaN;
        for (int i = 0; i < std::max<int64_t>(1, vocab / 5); ++i) l[pick(rng)] = -kInf;
        l[0] = kNaN;
        if (std::none_of(l.begin(), l.end(), [](float x) { return std::isfinite(x); })) {
          l[vocab - 1] = 0.5f;
        }
        break;
      case 3:  // all equal: the answer is 0
        std::fill(l.begin(), l.end(), 0.25f);
        break;
      case 4: {  // -0 and +0 tie for the maximum
        std::fill(l.begin(), l.end(), -1.0f);
        l[vocab - 1] = 0.0f;
        l[vocab / 2] = -0.0f;
        break;
      }
      case 5:  // all -inf but one (at the end)
        std::fill(l.begin(), l.end(), -kInf);
        l[vocab - 1] = -7.0f;
        break;
      case 6:
        if (allow_nonfinite_rows) std::fill(l.begin(), l.end(), kNaN);
        break;
      case 7:
        if (allow_nonfinite_rows) {
          std::fill(l.begin(), l.end(), -kInf);
          l[vocab / 3] = kNaN;
        }
        break;
    }
    all.insert(all.end(), l.begin(), l.end());
  }
  return all;
}

// ---- (a) greedy ------------------------------------------------------------------------------

TEST(GpuSampling, ArgmaxMatchesCpuGreedyArgmax) {
  REQUIRE_GPU();
  std::mt19937_64 rng(1);
  for (int64_t vocab : {1, 2, 7, 50, 1000, 4097, 128256, 151936}) {
    const int rows = 16;
    auto sampler = make_sampler(rows, vocab);
    ASSERT_NE(sampler, nullptr);
    const std::vector<float> host = tricky_rows(rng, rows, vocab, /*allow_nonfinite_rows=*/true);
    // Aligned (vectorised loads when vocab % 4 == 0) and misaligned by one float.
    for (size_t offset : {size_t{0}, size_t{1}}) {
      DeviceLogits d(host, offset);
      auto ids = DeviceBuffer::allocate(rows * sizeof(int32_t), "ids");
      ASSERT_TRUE(ids.has_value());
      ASSERT_TRUE(sampler->argmax(d.get(offset), rows, ids->as<int32_t>(), nullptr).is_ok());
      std::vector<int32_t> got(rows);
      ASSERT_EQ(cudaMemcpy(got.data(), ids->get(), rows * sizeof(int32_t), cudaMemcpyDeviceToHost),
                cudaSuccess);
      for (int r = 0; r < rows; ++r) {
        EXPECT_EQ(got[r], cpu::greedy_argmax(host.data() + r * vocab, vocab))
            << "vocab " << vocab << " row " << r << " offset " << offset;
      }
    }
  }
}

TEST(GpuSampling, GreedySampleMatchesCpuSampler) {
  REQUIRE_GPU();
  std::mt19937_64 rng(2);
  for (int64_t vocab : {3, 50, 1001, 128256}) {
    const int rows = 24;
    auto sampler = make_sampler(rows, vocab);
    ASSERT_NE(sampler, nullptr);
    const std::vector<float> host = tricky_rows(rng, rows, vocab, /*allow_nonfinite_rows=*/false);
    for (bool with_logprobs : {false, true}) {
      Rows batch;
      for (int r = 0; r < rows; ++r) batch.add(greedy_params(with_logprobs ? r % 4 : -1));
      auto got = gpu_sample(*sampler, host, batch.rows);
      ASSERT_TRUE(got.has_value()) << got.status().to_string();
      ASSERT_EQ(got->size(), static_cast<size_t>(rows));
      for (int r = 0; r < rows; ++r) {
        auto cpu_sampler = cpu::Sampler::create(batch.rows[r].params);
        auto want = cpu_sampler.sample(host.data() + r * vocab, vocab, {}, {});
        ASSERT_TRUE(want.has_value());
        EXPECT_EQ((*got)[r].token, want->token) << "vocab " << vocab << " row " << r;
        if (!with_logprobs) {
          EXPECT_TRUE(std::isnan((*got)[r].logprob));
          EXPECT_TRUE((*got)[r].top_logprobs.empty());
        }
      }
    }
  }
}

// A greedy call of at most 16 rows takes the split argmax (blocks of 4096 logits merged by
// atomics, the last block of a row writing it and clearing the merge state): the CPU sampler's
// token for 1, 2, 5 and 16 rows of ties, NaN, -inf and +-0 across the slices' edges, vectorised
// and misaligned logits, the same sampler called again and again (the merge state is clean
// after each call), and a row with no finite logit failing that call only.
TEST(GpuSampling, GreedyCallOfFewRowsMatchesCpuSampler) {
  REQUIRE_GPU();
  std::mt19937_64 rng(3);
  for (int64_t vocab : {3, 4096, 4097, 12289, 151936}) {
    auto sampler = make_sampler(16, vocab);
    ASSERT_NE(sampler, nullptr);
    for (int rows : {1, 2, 5, 16, 1}) {
      const std::vector<float> host = tricky_rows(rng, rows, vocab, /*allow_nonfinite_rows=*/false);
      Rows batch;
      for (int r = 0; r < rows; ++r) batch.add(greedy_params());
      for (size_t offset : {size_t{0}, size_t{1}}) {
        DeviceLogits d(host, offset);
        auto got = sampler->sample(d.get(offset), batch.rows);
        ASSERT_TRUE(got.has_value()) << got.status().to_string();
        ASSERT_EQ(got->size(), static_cast<size_t>(rows));
        for (int r = 0; r < rows; ++r) {
          EXPECT_EQ((*got)[r].token, cpu::greedy_argmax(host.data() + r * vocab, vocab))
              << "vocab " << vocab << ", " << rows << " rows, row " << r << ", offset " << offset;
        }
      }
    }
    // A row with no finite logit fails its call; the next call is right.
    std::vector<float> bad = tricky_rows(rng, 2, vocab, false);
    std::fill(bad.begin() + vocab, bad.end(), -kInf);
    Rows two;
    two.add(greedy_params());
    two.add(greedy_params());
    auto failed = gpu_sample(*sampler, bad, two.rows);
    ASSERT_FALSE(failed.has_value());
    EXPECT_EQ(failed.status().code(), Code::kFailedPrecondition);
    const std::vector<float> good = tricky_rows(rng, 2, vocab, false);
    auto again = gpu_sample(*sampler, good, two.rows);
    ASSERT_TRUE(again.has_value()) << again.status().to_string();
    for (int r = 0; r < 2; ++r) {
      EXPECT_EQ((*again)[r].token, cpu::greedy_argmax(good.data() + r * vocab, vocab)) << vocab;
    }
  }
}

// ---- (b) raw logprobs ------------------------------------------------------------------------

TEST(GpuSampling, RawLogprobsAndTopLogprobsMatchCpu) {
  REQUIRE_GPU();
  std::mt19937_64 rng(3);
  for (int64_t vocab : {5, 50, 1000, 128256}) {
    const int rows = 12;
    auto sampler = make_sampler(rows, vocab, 20);
    ASSERT_NE(sampler, nullptr);
    std::vector<float> host;
    for (int r = 0; r < rows; ++r) {
      std::vector<float> l = random_logits(rng, vocab, 2.0f);
      if (r % 3 == 1) {  // ties among the top values, some -inf and NaN
        std::vector<float> sorted = l;
        std::sort(sorted.begin(), sorted.end(), std::greater<>());
        std::uniform_int_distribution<int64_t> pick(0, vocab - 1);
        for (int i = 0; i < 6; ++i) l[pick(rng)] = sorted[std::min<int64_t>(3, vocab - 1)];
        l[pick(rng)] = -kInf;
        l[pick(rng)] = kNaN;
      }
      if (r % 3 == 2) {  // few distinct levels: long tie groups everywhere
        std::uniform_int_distribution<int> level(0, 4);
        for (float& x : l) x = 0.5f * level(rng);
      }
      host.insert(host.end(), l.begin(), l.end());
    }
    Rows batch;
    for (int r = 0; r < rows; ++r) {
      SamplingParams p;
      p.logprobs = std::vector<int>{0, 1, 5, 20}[r % 4];
      p.temperature = r % 2 == 0 ? 0.0f : 1.0f;  // greedy rows compare the token too
      p.top_k = r % 2 == 0 ? -1 : 8;
      batch.add(p, /*seed=*/1000 + r, /*step=*/3);
    }
    auto got = gpu_sample(*sampler, host, batch.rows);
    ASSERT_TRUE(got.has_value()) << got.status().to_string();
    for (int r = 0; r < rows; ++r) {
      const float* l = host.data() + r * vocab;
      const std::string where = "vocab " + std::to_string(vocab) + " row " + std::to_string(r);
      auto cpu_sampler = cpu::Sampler::create(batch.rows[r].params);
      auto want = cpu_sampler.sample(l, vocab, {}, {});
      ASSERT_TRUE(want.has_value());
      const SampleResult& g = (*got)[r];
      if (batch.rows[r].params.temperature == 0.0f) {
        EXPECT_EQ(g.token, want->token) << where;
        expect_logprob_near(want->logprob, g.logprob, where);
      } else {
        const std::vector<double> lsm = raw_log_softmax(l, vocab);
        ASSERT_GE(g.token, 0);
        ASSERT_LT(g.token, vocab);
        expect_logprob_near(lsm[g.token], g.logprob, where + " (sampled)");
      }
      ASSERT_EQ(g.top_logprobs.size(), want->top_logprobs.size()) << where;
      for (size_t i = 0; i < g.top_logprobs.size(); ++i) {
        EXPECT_EQ(g.top_logprobs[i].first, want->top_logprobs[i].first) << where << " rank " << i;
        expect_logprob_near(want->top_logprobs[i].second, g.top_logprobs[i].second,
                            where + " rank " + std::to_string(i));
      }
    }
  }
}

// ---- (c) penalties ---------------------------------------------------------------------------

TEST(GpuSampling, PenalisedGreedyTokenMatchesCpuApplyPenalties) {
  REQUIRE_GPU();
  std::mt19937_64 rng(4);
  for (int64_t vocab : {20, 1000, 128256}) {
    const int rows = 32;
    auto sampler = make_sampler(rows, vocab);
    ASSERT_NE(sampler, nullptr);
    // Several calls on one sampler: the token counts must be clean between calls.
    for (int call = 0; call < 3; ++call) {
      std::vector<float> host;
      Rows batch;
      std::uniform_int_distribution<int32_t> id(
          0, static_cast<int32_t>(std::min<int64_t>(vocab, 64)) - 1);
      for (int r = 0; r < rows; ++r) {
        std::vector<float> l = random_logits(rng, vocab, 1.0f);
        // The likely winners are the ids the lists name.
        for (int i = 0; i < 64 && i < vocab; ++i) l[i] += 2.0f;
        host.insert(host.end(), l.begin(), l.end());
        SamplingParams p = greedy_params(r % 3 == 0 ? 2 : -1);
        p.repetition_penalty = std::vector<float>{1.0f, 1.3f, 0.7f, 2.0f}[r % 4];
        p.frequency_penalty = std::vector<float>{0.0f, 0.5f, -0.4f}[(r / 4) % 3];
        p.presence_penalty = std::vector<float>{0.0f, 1.0f, -1.5f, 2.0f}[(r / 2) % 4];
        std::vector<int32_t> prompt(static_cast<size_t>(r % 7 * 5));
        std::vector<int32_t> output(static_cast<size_t>(r % 5 * 4));
        for (int32_t& x : prompt) x = id(rng);
        for (int32_t& x : output) x = id(rng);
        batch.add(p, 0, 0, prompt, output);
      }
      auto got = gpu_sample(*sampler, host, batch.rows);
      ASSERT_TRUE(got.has_value()) << got.status().to_string();
      for (int r = 0; r < rows; ++r) {
        const SampleRow& row = batch.rows[r];
        std::vector<float> l(host.begin() + r * vocab, host.begin() + (r + 1) * vocab);
        ASSERT_TRUE(cpu::apply_penalties(l, row.prompt_ids, row.output_ids, row.params).is_ok());
        EXPECT_EQ((*got)[r].token, cpu::greedy_argmax(l.data(), vocab))
            << "vocab " << vocab << " call " << call << " row " << r;
        if (row.params.logprobs >= 0) {  // raw: before the penalties
          auto cpu_sampler = cpu::Sampler::create(row.params);
          auto want =
              cpu_sampler.sample(host.data() + r * vocab, vocab, row.prompt_ids, row.output_ids);
          ASSERT_TRUE(want.has_value());
          EXPECT_EQ((*got)[r].token, want->token);
          expect_logprob_near(want->logprob, (*got)[r].logprob, "penalised row");
        }
      }
    }
  }
}

TEST(GpuSampling, PenaltiesThatCreateExactTiesGoToTheLowerId) {
  REQUIRE_GPU();
  auto sampler = make_sampler(4, 8);
  ASSERT_NE(sampler, nullptr);
  const std::vector<float> one = {0.0f, 1.0f, 2.0f, -1.0f, 0.5f, 3.0f, 4.0f, 1.5f};
  std::vector<float> host;
  for (int r = 0; r < 4; ++r) host.insert(host.end(), one.begin(), one.end());
  Rows batch;
  SamplingParams p = greedy_params();
  p.frequency_penalty = 1.0f;
  p.presence_penalty = 1.0f;
  batch.add(p, 0, 0, {6}, {5, 6});  // 6: 4 - 1 - 1 = 2 ties 2; 5: 1. The prompt is not read.
  p.presence_penalty = 0.0f;
  batch.add(p, 0, 0, {}, {6, 5, 6});  // 6: 4 - 2 * 1 = 2; 5: 3 - 1 = 2; both tie 2
  p.frequency_penalty = 0.0f;
  p.repetition_penalty = 2.0f;
  batch.add(p, 0, 0, {6, 6}, {5});  // 6: 4 / 2 = 2 ties 2; 5: 1.5
  p.repetition_penalty = 0.5f;
  batch.add(p, 0, 0, {2}, {});  // 2: 2 / 0.5 = 4 ties 6
  auto got = gpu_sample(*sampler, host, batch.rows);
  ASSERT_TRUE(got.has_value()) << got.status().to_string();
  EXPECT_EQ((*got)[0].token, 2);
  EXPECT_EQ((*got)[1].token, 2);
  EXPECT_EQ((*got)[2].token, 2);
  EXPECT_EQ((*got)[3].token, 2);
}

// ---- (d) filtering ---------------------------------------------------------------------------

// softmax of filter_logits' output: the distribution the sampler draws from.
std::vector<double> cpu_distribution(std::vector<float> l, const SamplingParams& p) {
  EXPECT_TRUE(cpu::filter_logits(l, p).is_ok());
  double m = -kInf;
  for (float x : l) m = std::max(m, static_cast<double>(x));
  std::vector<double> q(l.size(), 0.0);
  double sum = 0.0;
  for (size_t i = 0; i < l.size(); ++i) {
    if (l[i] > -kInf) sum += q[i] = std::exp(static_cast<double>(l[i]) - m);
  }
  for (double& x : q) x /= sum;
  return q;
}

// Draws `draws` tokens for one (logits, params) from many seeds and steps, checks that each is
// in the CPU support and that the frequencies fit the CPU distribution (chi-square, cells with
// expected count < 5 pooled).
void check_draws(GpuSampler& sampler, int max_rows, const std::vector<float>& l,
                 const SamplingParams& p, int draws, uint64_t seed_base, const std::string& where,
                 bool check_frequencies) {
  const int64_t vocab = static_cast<int64_t>(l.size());
  const std::vector<double> q = cpu_distribution(l, p);
  std::vector<int> seen(static_cast<size_t>(vocab), 0);
  int done = 0;
  for (int call = 0; done < draws; ++call) {
    const int rows = std::min(max_rows, draws - done);
    std::vector<float> host;
    host.reserve(static_cast<size_t>(rows * vocab));
    Rows batch;
    for (int r = 0; r < rows; ++r) {
      host.insert(host.end(), l.begin(), l.end());
      batch.add(p, seed_base + static_cast<uint64_t>(r), static_cast<uint64_t>(call));
    }
    auto got = gpu_sample(sampler, host, batch.rows);
    ASSERT_TRUE(got.has_value()) << where << ": " << got.status().to_string();
    for (const SampleResult& g : *got) {
      ASSERT_GE(g.token, 0) << where;
      ASSERT_LT(g.token, vocab) << where;
      EXPECT_GT(q[g.token], 0.0) << where << ": drew token " << g.token
                                 << " outside the CPU support";
      ++seen[g.token];
    }
    done += rows;
  }
  if (!check_frequencies) return;
  double chi2 = 0.0;
  int cells = 0;
  double pooled_expected = 0.0;
  double pooled_observed = 0.0;
  for (int64_t i = 0; i < vocab; ++i) {
    const double e = q[i] * draws;
    if (e <= 0.0) continue;
    if (e < 5.0) {
      pooled_expected += e;
      pooled_observed += seen[i];
      continue;
    }
    chi2 += (seen[i] - e) * (seen[i] - e) / e;
    ++cells;
  }
  if (pooled_expected > 0.0) {
    chi2 += (pooled_observed - pooled_expected) * (pooled_observed - pooled_expected) /
            std::max(pooled_expected, 1.0);
    ++cells;
  }
  const double df = std::max(1, cells - 1);
  // About a 1e-5 false alarm per check.
  EXPECT_LT(chi2, df + 6.0 * std::sqrt(2.0 * df) + 12.0)
      << where << ": chi2 over " << cells << " cells";
}

TEST(GpuSampling, FilteredDrawsMatchCpuSupportAndFrequencies) {
  REQUIRE_GPU();
  constexpr int64_t kVocab = 50;
  constexpr int kRows = 256;
  auto sampler = make_sampler(kRows, kVocab);
  ASSERT_NE(sampler, nullptr);
  std::mt19937_64 rng(5);
  std::vector<std::vector<float>> logit_sets;
  {  // continuous, with a few exact duplicates
    std::vector<float> l = random_logits(rng, kVocab, 1.2f);
    l[7] = l[3];
    l[40] = l[3];
    l[11] = l[29];
    l[45] = -kInf;
    logit_sets.push_back(l);
  }
  {  // five levels: long tie groups at every cut
    std::uniform_int_distribution<int> level(0, 4);
    std::vector<float> l(kVocab);
    for (float& x : l) x = 0.6f * static_cast<float>(level(rng));
    logit_sets.push_back(l);
  }
  {  // all equal
    logit_sets.emplace_back(kVocab, 1.0f);
  }
  uint64_t seed_base = 1;
  for (size_t set = 0; set < logit_sets.size(); ++set) {
    for (float temperature : {0.6f, 1.0f, 1.7f}) {
      for (float min_p : {0.0f, 0.1f, 0.5f}) {
        for (int top_k : {-1, 1, 3, 10, 49}) {
          for (float top_p : {1.0f, 0.9f, 0.5f, 0.2f}) {
            SamplingParams p;
            p.temperature = temperature;
            p.min_p = min_p;
            p.top_k = top_k;
            p.top_p = top_p;
            const std::string where = "set " + std::to_string(set) + " T " +
                                      std::to_string(temperature) + " min_p " +
                                      std::to_string(min_p) + " top_k " + std::to_string(top_k) +
                                      " top_p " + std::to_string(top_p);
            // Frequencies on a subset of the combinations (each costs a few thousand draws).
            const bool freq = temperature == 1.0f && (top_k == -1 || top_k == 10);
            check_draws(*sampler, kRows, logit_sets[set], p, freq ? 4096 : 512, seed_base, where,
                        freq);
            seed_base += 100003;
          }
        }
      }
    }
  }
}

TEST(GpuSampling, LargeVocabularyDrawsStayInTheCpuSupport) {
  REQUIRE_GPU();
  std::mt19937_64 rng(6);
  for (int64_t vocab : {128256, 151936}) {
    constexpr int kRows = 64;
    auto sampler = make_sampler(kRows, vocab);
    ASSERT_NE(sampler, nullptr);
    std::vector<float> l = random_logits(rng, vocab, 2.5f);
    // A few exact ties near the top.
    std::vector<float> sorted = l;
    std::nth_element(sorted.begin(), sorted.begin() + 49, sorted.end(), std::greater<>());
    l[17] = sorted[49];
    l[vocab - 3] = sorted[49];
    struct Case {
      float temperature, min_p, top_p;
      int top_k;
      bool freq;
    };
    for (const Case& c : {Case{1.0f, 0.0f, 0.9f, 50, true}, Case{1.0f, 0.0f, 1.0f, 50, true},
                          Case{0.8f, 0.05f, 0.9f, 50, false}, Case{1.0f, 0.0f, 0.9f, -1, false},
                          Case{0.3f, 0.0f, 0.95f, -1, true}, Case{1.0f, 0.2f, 1.0f, -1, false},
                          Case{1.0f, 0.0f, 1.0f, 1, false}}) {
      SamplingParams p;
      p.temperature = c.temperature;
      p.min_p = c.min_p;
      p.top_p = c.top_p;
      p.top_k = c.top_k;
      const std::string where = "vocab " + std::to_string(vocab) + " T " +
                                std::to_string(c.temperature) + " min_p " +
                                std::to_string(c.min_p) + " top_k " + std::to_string(c.top_k) +
                                " top_p " + std::to_string(c.top_p);
      check_draws(*sampler, kRows, l, p, c.freq ? 1024 : 128, 77, where, c.freq);
    }
  }
}

// ---- (e) determinism -------------------------------------------------------------------------

TEST(GpuSampling, DrawsDependOnSeedAndStepNotOnTheBatch) {
  REQUIRE_GPU();
  constexpr int64_t kVocab = 1000;
  auto sampler = make_sampler(64, kVocab);
  ASSERT_NE(sampler, nullptr);
  std::mt19937_64 rng(7);
  const std::vector<float> target = random_logits(rng, kVocab, 0.3f);  // a flat distribution
  SamplingParams p;
  p.top_p = 0.95f;
  p.min_p = 0.01f;
  p.logprobs = 2;
  auto sample_in = [&](int batch_size, int position, uint64_t seed, uint64_t step) {
    std::vector<float> host;
    Rows batch;
    for (int r = 0; r < batch_size; ++r) {
      if (r == position) {
        host.insert(host.end(), target.begin(), target.end());
        batch.add(p, seed, step);
      } else {
        const std::vector<float> other = random_logits(rng, kVocab, 2.0f);
        host.insert(host.end(), other.begin(), other.end());
        SamplingParams q;
        q.temperature = r % 3 == 0 ? 0.0f : 0.9f;
        q.top_k = r % 2 == 0 ? 20 : -1;
        q.presence_penalty = r % 4 == 1 ? 0.5f : 0.0f;
        batch.add(q, rng(), rng(), {}, {1, 2, 3});
      }
    }
    auto got = gpu_sample(*sampler, host, batch.rows);
    EXPECT_TRUE(got.has_value()) << got.status().to_string();
    return got.has_value() ? (*got)[position].token : -1;
  };
  std::set<int32_t> tokens;
  for (uint64_t step = 0; step < 32; ++step) {
    const int32_t alone = sample_in(1, 0, 42, step);
    EXPECT_EQ(sample_in(64, 37, 42, step), alone) << "step " << step;
    EXPECT_EQ(sample_in(9, 0, 42, step), alone) << "step " << step;
    EXPECT_EQ(sample_in(1, 0, 42, step), alone) << "step " << step;
    tokens.insert(alone);
  }
  // 32 draws from ~950 near-equal tokens: repeats are rare.
  EXPECT_GE(tokens.size(), 24u);
  std::set<int32_t> by_seed;
  for (uint64_t seed = 0; seed < 32; ++seed) by_seed.insert(sample_in(1, 0, seed << 40, 5));
  EXPECT_GE(by_seed.size(), 24u);
}

// Async scheduling: two calls outstanding (enqueue, enqueue, then finish in order) give what each
// gives alone, each from its own host image; fill_tokens copies the last call's tokens into a
// step's ids on the device (pack_tokens: in row order); a third call, or a second finish, is
// refused.
TEST(GpuSampling, TwoCallsOutstandingGiveWhatEachGivesAlone) {
  REQUIRE_GPU();
  constexpr int64_t kVocab = 500;
  auto sampler = make_sampler(8, kVocab, 5);
  ASSERT_NE(sampler, nullptr);
  std::mt19937_64 rng(21);
  const std::vector<float> a = random_logits(rng, 3 * kVocab, 2.0f);
  const std::vector<float> b = random_logits(rng, 2 * kVocab, 2.0f);
  SamplingParams drawn;
  drawn.temperature = 0.8f;
  drawn.top_k = 50;
  drawn.logprobs = 3;
  SamplingParams penalised = greedy_params(1);
  penalised.repetition_penalty = 1.5f;
  Rows ra, rb;
  ra.add(greedy_params(), 0, 0);
  ra.add(drawn, 99, 4);
  ra.add(penalised, 0, 0, {1, 2, 3}, {4, 5});
  rb.add(drawn, 7, 1);
  rb.add(greedy_params(2), 0, 0);
  auto alone_a = gpu_sample(*sampler, a, ra.rows);
  auto alone_b = gpu_sample(*sampler, b, rb.rows);
  ASSERT_TRUE(alone_a && alone_b);
  DeviceLogits da(a), db(b), dc(b);
  auto ta = sampler->enqueue(da.get(), ra.rows);
  auto tb = sampler->enqueue(db.get(), rb.rows);
  ASSERT_TRUE(ta && tb) << (ta ? tb.status() : ta.status()).to_string();
  auto third = sampler->enqueue(dc.get(), rb.rows);
  ASSERT_FALSE(third);
  EXPECT_EQ(third.status().code(), Code::kFailedPrecondition);
  // The ids of a next step: token 0 from b's row 1, token 2 from b's row 0.
  auto ids = DeviceBuffer::allocate(4 * sizeof(int32_t), "ids");
  auto pairs = DeviceBuffer::allocate(4 * sizeof(int32_t), "pairs");
  ASSERT_TRUE(ids && pairs);
  const std::vector<int32_t> host_ids = {-1, 11, -1, 13}, host_pairs = {0, 1, 2, 0};
  ASSERT_EQ(cudaMemcpy(ids->get(), host_ids.data(), 16, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(pairs->get(), host_pairs.data(), 16, cudaMemcpyHostToDevice), cudaSuccess);
  int stride = 0;
  const int32_t* tokens = sampler->tokens(&stride);
  ASSERT_TRUE(fill_tokens(ids->as<int32_t>(), pairs->as<int32_t>(), 2, tokens, stride, nullptr));
  auto packed = DeviceBuffer::allocate(2 * sizeof(int32_t), "packed");
  ASSERT_TRUE(packed);
  ASSERT_TRUE(pack_tokens(tokens, stride, 2, packed->as<int32_t>(), nullptr));
  auto got_a = sampler->finish(*ta);
  auto got_b = sampler->finish(*tb);
  ASSERT_TRUE(got_a && got_b);
  auto same = [](const std::vector<SampleResult>& x, const std::vector<SampleResult>& y) {
    ASSERT_EQ(x.size(), y.size());
    for (size_t i = 0; i < x.size(); ++i) {
      EXPECT_EQ(x[i].token, y[i].token) << "row " << i;
      EXPECT_EQ(std::isnan(x[i].logprob), std::isnan(y[i].logprob)) << "row " << i;
      if (!std::isnan(x[i].logprob)) {
        EXPECT_EQ(x[i].logprob, y[i].logprob) << "row " << i;
      }
      EXPECT_EQ(x[i].top_logprobs, y[i].top_logprobs) << "row " << i;
    }
  };
  same(*got_a, *alone_a);
  same(*got_b, *alone_b);
  std::vector<int32_t> filled(4);
  ASSERT_EQ(cudaMemcpy(filled.data(), ids->get(), 16, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(filled, (std::vector<int32_t>{(*got_b)[1].token, 11, (*got_b)[0].token, 13}));
  std::vector<int32_t> in_order(2);
  ASSERT_EQ(cudaMemcpy(in_order.data(), packed->get(), 8, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(in_order, (std::vector<int32_t>{(*got_b)[0].token, (*got_b)[1].token}));
  EXPECT_EQ(sampler->finish(*ta).status().code(), Code::kFailedPrecondition);
}

// ---- (f) errors ------------------------------------------------------------------------------

TEST(GpuSampling, Errors) {
  REQUIRE_GPU();
  EXPECT_EQ(GpuSampler::create(0, 10, 20, nullptr).status().code(), Code::kInvalidArgument);
  EXPECT_EQ(GpuSampler::create(4, 0, 20, nullptr).status().code(), Code::kInvalidArgument);
  EXPECT_EQ(GpuSampler::create(4, 10, -1, nullptr).status().code(), Code::kInvalidArgument);

  constexpr int64_t kVocab = 16;
  auto sampler = make_sampler(4, kVocab, 5);
  ASSERT_NE(sampler, nullptr);
  std::mt19937_64 rng(8);
  const std::vector<float> one = random_logits(rng, kVocab, 1.0f);
  auto rows_of = [&](int n) {
    std::vector<float> host;
    for (int i = 0; i < n; ++i) host.insert(host.end(), one.begin(), one.end());
    return host;
  };
  auto code_of = [&](const std::vector<float>& host, Rows& batch) {
    auto got = gpu_sample(*sampler, host, batch.rows);
    return got.has_value() ? Code::kOk : got.status().code();
  };

  {  // no rows: nothing to do
    Rows batch;
    auto got = gpu_sample(*sampler, rows_of(1), batch.rows);
    ASSERT_TRUE(got.has_value());
    EXPECT_TRUE(got->empty());
  }
  {  // too many rows
    Rows batch;
    for (int i = 0; i < 5; ++i) batch.add(SamplingParams{});
    EXPECT_EQ(code_of(rows_of(5), batch), Code::kInvalidArgument);
  }
  {  // too many logprobs
    Rows batch;
    SamplingParams p;
    p.logprobs = 6;
    batch.add(p);
    EXPECT_EQ(code_of(rows_of(1), batch), Code::kInvalidArgument);
  }
  {  // ids out of range, where they are read
    SamplingParams rep;
    rep.repetition_penalty = 1.2f;
    SamplingParams freq;
    freq.frequency_penalty = 0.5f;
    for (int32_t bad : {-1, static_cast<int32_t>(kVocab)}) {
      Rows a;
      a.add(SamplingParams{});
      a.add(rep, 0, 0, {1, bad}, {});
      EXPECT_EQ(code_of(rows_of(2), a), Code::kInvalidArgument);
      Rows b;
      b.add(freq, 0, 0, {}, {3, bad});
      EXPECT_EQ(code_of(rows_of(1), b), Code::kInvalidArgument);
    }
    // With every penalty off the lists are not read.
    Rows c;
    c.add(SamplingParams{}, 0, 0, {-5}, {99});
    EXPECT_EQ(code_of(rows_of(1), c), Code::kOk);
  }
  {  // no finite logit: greedy or sampled, penalised or not
    std::vector<float> host = rows_of(2);
    std::fill(host.begin() + kVocab, host.end(), -kInf);
    host[kVocab + 3] = kNaN;
    for (float temperature : {0.0f, 1.0f}) {
      for (bool penalised : {false, true}) {
        SamplingParams p;
        p.temperature = temperature;
        p.presence_penalty = penalised ? 1.0f : 0.0f;
        p.logprobs = penalised ? 1 : -1;
        Rows batch;
        batch.add(p, 0, 0, {}, {1, 3});
        batch.add(p, 0, 0, {}, {1, 3});
        auto got = gpu_sample(*sampler, host, batch.rows);
        ASSERT_FALSE(got.has_value());
        EXPECT_EQ(got.status().code(), Code::kFailedPrecondition);
        EXPECT_NE(got.status().message().find("row 1"), std::string::npos)
            << got.status().message();
      }
    }
  }
  {  // the sampler still works after the errors (the penalty counts are clean)
    Rows batch;
    SamplingParams p = greedy_params();
    p.frequency_penalty = 2.0f;
    const int32_t best = cpu::greedy_argmax(one.data(), kVocab);
    batch.add(p, 0, 0, {}, {best, best, best, best, best});
    std::vector<float> l = one;
    ASSERT_TRUE(cpu::apply_penalties(l, {}, batch.rows[0].output_ids, p).is_ok());
    auto got = gpu_sample(*sampler, rows_of(1), batch.rows);
    ASSERT_TRUE(got.has_value()) << got.status().to_string();
    EXPECT_EQ((*got)[0].token, cpu::greedy_argmax(l.data(), kVocab));
  }
  {  // argmax arguments
    EXPECT_EQ(sampler->argmax(nullptr, 1, nullptr, nullptr).code(), Code::kInvalidArgument);
    EXPECT_TRUE(sampler->argmax(nullptr, 0, nullptr, nullptr).is_ok());
  }
}

}  // namespace
}  // namespace tessera::cuda
