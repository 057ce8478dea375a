#include "kernels/cpu/sampling.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

namespace tessera::cpu {

namespace {

constexpr float kSamplingEps = 1e-5f;  // vLLM's _SAMPLING_EPS: below it, greedy
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Strict weak order "ranks higher": larger logit first, lower id among equals. Only called on
// logits without NaN.
struct RanksHigher {
  const float* logits;
  bool operator()(int32_t a, int32_t b) const {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  }
};

Status check_ids(std::span<const int32_t> ids, int64_t vocab) {
  for (int32_t id : ids) {
    if (id < 0 || id >= vocab) {
      return invalid_argument("sample: token id " + std::to_string(id) +
                              " is outside the vocabulary [0, " + std::to_string(vocab) + ")");
    }
  }
  return Status::ok();
}

void nan_to_neg_inf(float* l, int64_t vocab) {
  for (int64_t i = 0; i < vocab; ++i) {
    if (std::isnan(l[i])) l[i] = kNegInf;
  }
}

bool any_finite(const float* l, int64_t vocab) {
  for (int64_t i = 0; i < vocab; ++i) {
    if (std::isfinite(l[i])) return true;
  }
  return false;
}

// Step 2 on checked ids.
void penalise(float* logits, int64_t vocab, std::span<const int32_t> prompt_ids,
              std::span<const int32_t> output_ids, const SamplingParams& p) {
  if (p.repetition_penalty != 1.0f) {
    std::vector<uint8_t> seen(static_cast<size_t>(vocab), 0);
    auto apply = [&](int32_t id) {
      if (seen[id]) return;
      seen[id] = 1;
      // vLLM / HF: positive logits divided, the rest (0 included) multiplied.
      logits[id] =
          logits[id] > 0.0f ? logits[id] / p.repetition_penalty : logits[id] * p.repetition_penalty;
    };
    for (int32_t id : prompt_ids) apply(id);
    for (int32_t id : output_ids) apply(id);
  }
  if (p.frequency_penalty != 0.0f || p.presence_penalty != 0.0f) {
    std::vector<int32_t> counts(static_cast<size_t>(vocab), 0);
    for (int32_t id : output_ids) ++counts[id];
    for (int32_t id : output_ids) {
      if (counts[id] == 0) continue;  // applied already
      // In torch's order: logits -= f * counts (fp32 product); logits -= p * (counts > 0).
      logits[id] -= p.frequency_penalty * static_cast<float>(counts[id]);
      logits[id] -= p.presence_penalty;
      counts[id] = 0;
    }
  }
}

// Steps 5-6 on tempered logits l (no NaN, at least one finite): fills order[0, count) with the
// surviving token ids and returns count; *max gets the largest logit (always a survivor).
int64_t select_candidates(const float* l, int64_t vocab, const SamplingParams& p,
                          std::vector<int32_t>& order, float* max) {
  float m = kNegInf;
  for (int64_t i = 0; i < vocab; ++i) m = std::max(m, l[i]);
  *max = m;
  order.clear();
  if (p.min_p > 0.0f) {
    // p_i < min_p * p_max  <=>  exp(l_i - max) < min_p (softmax's normaliser cancels).
    for (int64_t i = 0; i < vocab; ++i) {
      if (l[i] > kNegInf && std::exp(static_cast<double>(l[i]) - m) >= p.min_p) {
        order.push_back(static_cast<int32_t>(i));
      }
    }
  } else {
    for (int64_t i = 0; i < vocab; ++i) {
      if (l[i] > kNegInf) order.push_back(static_cast<int32_t>(i));
    }
  }
  const RanksHigher ranks{l};
  int64_t count = static_cast<int64_t>(order.size());
  if (p.top_k > 0 && p.top_k < count) {
    std::nth_element(order.begin(), order.begin() + p.top_k, order.end(), ranks);
    count = p.top_k;
    order.resize(static_cast<size_t>(count));
  }
  if (p.top_p < 1.0f) {
    // Keep candidates in rank order while the mass ranked strictly above them is < top_p of the
    // survivors' mass. Only the top `head` candidates are sorted; head grows 4x until it holds
    // the cut.
    double total = 0.0;
    for (int64_t i = 0; i < count; ++i) total += std::exp(static_cast<double>(l[order[i]]) - m);
    const double threshold = static_cast<double>(p.top_p) * total;
    int64_t head = std::min<int64_t>(count, 256);
    for (;;) {
      if (head < count) std::nth_element(order.begin(), order.begin() + head, order.end(), ranks);
      std::sort(order.begin(), order.begin() + head, ranks);
      double above = 0.0;
      int64_t r = 0;
      for (; r < head && (r == 0 || above < threshold); ++r) {
        above += std::exp(static_cast<double>(l[order[r]]) - m);
      }
      if (r < head || head == count) {
        count = r;
        break;
      }
      head = std::min(count, head * 4);
    }
    order.resize(static_cast<size_t>(count));
  }
  return count;
}

}  // namespace

Status apply_penalties(std::span<float> logits, std::span<const int32_t> prompt_ids,
                       std::span<const int32_t> output_ids, const SamplingParams& params) {
  const int64_t vocab = static_cast<int64_t>(logits.size());
  TESSERA_RETURN_IF_ERROR(check_ids(prompt_ids, vocab));
  TESSERA_RETURN_IF_ERROR(check_ids(output_ids, vocab));
  penalise(logits.data(), vocab, prompt_ids, output_ids, params);
  return Status::ok();
}

Status filter_logits(std::span<float> logits, const SamplingParams& params) {
  float* l = logits.data();
  const int64_t vocab = static_cast<int64_t>(logits.size());
  nan_to_neg_inf(l, vocab);
  if (!any_finite(l, vocab)) return invalid_argument("filter_logits: no logit is finite");
  std::vector<int32_t> order;
  if (params.temperature < kSamplingEps) {
    order.push_back(greedy_argmax(l, vocab));
  } else {
    if (params.temperature != 1.0f) {
      for (int64_t i = 0; i < vocab; ++i) l[i] /= params.temperature;
    }
    float max;
    select_candidates(l, vocab, params, order, &max);
  }
  std::vector<uint8_t> keep(static_cast<size_t>(vocab), 0);
  for (int32_t id : order) keep[id] = 1;
  for (int64_t i = 0; i < vocab; ++i) {
    if (!keep[i]) l[i] = kNegInf;
  }
  return Status::ok();
}

int32_t greedy_argmax(const float* logits, int64_t vocab) {
  int64_t best = 0;
  for (int64_t i = 1; i < vocab; ++i) {
    if (logits[i] > logits[best] || (std::isnan(logits[best]) && !std::isnan(logits[i]))) {
      best = i;
    }
  }
  return static_cast<int32_t>(best);
}

Sampler Sampler::create(const SamplingParams& params) {
  uint64_t seed = 0;
  if (params.seed) {
    seed = *params.seed;
  } else {
    std::random_device rd;
    seed = (static_cast<uint64_t>(rd()) << 32) ^ rd();
  }
  return Sampler(params, seed);
}

Sampler::Sampler(const SamplingParams& params, uint64_t seed)
    : params_(params), seed_(seed), rng_(seed) {}

double Sampler::uniform() { return static_cast<double>(rng_() >> 11) * 0x1.0p-53; }

void Sampler::raw_logprobs(const float* logits, int64_t vocab, SampleResult* result) {
  // log_softmax of the raw logits (NaN as -inf), max-subtracted, summed in double.
  work_.assign(logits, logits + vocab);
  nan_to_neg_inf(work_.data(), vocab);
  const float* l = work_.data();
  float m = kNegInf;
  for (int64_t i = 0; i < vocab; ++i) m = std::max(m, l[i]);
  double sum = 0.0;
  for (int64_t i = 0; i < vocab; ++i) sum += std::exp(static_cast<double>(l[i]) - m);
  const double lse = static_cast<double>(m) + std::log(sum);
  auto logprob = [&](int32_t id) { return static_cast<float>(static_cast<double>(l[id]) - lse); };
  result->logprob = logprob(result->token);
  const int64_t n = std::min<int64_t>(params_.logprobs, vocab);
  if (n <= 0) return;
  order_.resize(static_cast<size_t>(vocab));
  for (int64_t i = 0; i < vocab; ++i) order_[i] = static_cast<int32_t>(i);
  std::partial_sort(order_.begin(), order_.begin() + n, order_.end(), RanksHigher{l});
  result->top_logprobs.reserve(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) result->top_logprobs.emplace_back(order_[i], logprob(order_[i]));
}

Expected<SampleResult> Sampler::sample(const float* logits, int64_t vocab,
                                       std::span<const int32_t> prompt_ids,
                                       std::span<const int32_t> output_ids) {
  if (logits == nullptr || vocab < 1 || vocab > std::numeric_limits<int32_t>::max()) {
    return invalid_argument("sample: need logits for a vocabulary of at least one token, got " +
                            std::to_string(vocab));
  }
  TESSERA_RETURN_IF_ERROR(check_ids(prompt_ids, vocab));
  TESSERA_RETURN_IF_ERROR(check_ids(output_ids, vocab));
  if (!any_finite(logits, vocab)) return failed_precondition("sample: no logit is finite");

  SampleResult result;
  result.logprob = std::numeric_limits<float>::quiet_NaN();
  work_.assign(logits, logits + vocab);
  float* l = work_.data();
  nan_to_neg_inf(l, vocab);
  penalise(l, vocab, prompt_ids, output_ids, params_);
  if (params_.temperature < kSamplingEps) {
    result.token = greedy_argmax(l, vocab);
  } else {
    if (params_.temperature != 1.0f) {
      for (int64_t i = 0; i < vocab; ++i) l[i] /= params_.temperature;
    }
    float m;
    const int64_t count = select_candidates(l, vocab, params_, order_, &m);
    // Inverse-CDF draw over the survivors with weights exp(l - max), in double.
    double total = 0.0;
    for (int64_t i = 0; i < count; ++i) total += std::exp(static_cast<double>(l[order_[i]]) - m);
    const double target = uniform() * total;
    double acc = 0.0;
    result.token = order_[count - 1];  // if rounding leaves target at the very top
    for (int64_t i = 0; i < count; ++i) {
      acc += std::exp(static_cast<double>(l[order_[i]]) - m);
      if (target < acc) {
        result.token = order_[i];
        break;
      }
    }
  }
  if (params_.logprobs >= 0) raw_logprobs(logits, vocab, &result);
  return result;
}

}  // namespace tessera::cpu
