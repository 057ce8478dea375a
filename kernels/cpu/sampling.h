// Token sampling for one request, with vLLM's (V1 engine) parameters and order of operations:
//
//   1. logprobs, when asked: log_softmax of the RAW logits (vLLM V1's default
//      logprobs_mode = "raw_logprobs": before penalties, temperature and filtering)
//   2. repetition penalty over prompt + output tokens (HF / vLLM: a positive logit is divided by
//      the penalty, any other multiplied), then frequency and presence penalties over output
//      tokens (OpenAI: logit -= frequency * count + presence * (count > 0))
//   3. temperature < 1e-5 (vLLM's _SAMPLING_EPS, so 0 included): greedy argmax of the penalised
//      logits, ties to the lowest id; nothing below applies
//   4. logits /= temperature
//   5. min_p: drop tokens whose probability is below min_p * the top probability (vLLM V1 runs
//      min_p here, before top-k / top-p, as an argmax-invariant logits processor)
//   6. top_k, then top_p over the renormalised survivors of top_k (vLLM's apply_top_k_top_p):
//      keep the highest tokens while the probability mass ranked strictly above them is < top_p
//   7. draw one token from the renormalised survivors with the request's own RNG
//
// Ties in the ranking (top-k, top-p, top logprobs) go to the lowest token id, so top_k = 1 is
// always the greedy token; vLLM keeps every token tied with the k-th, which only differs on
// exact ties. Ranking never sorts the vocabulary: top-k is an nth_element over the candidates,
// top-p sorts only the top M candidates, M = 256, 1024, ... until they hold top_p of the mass.
// Logits are expected finite or -inf; NaN is treated as -inf.
#pragma once

#include <cstdint>
#include <optional>
#include <random>
#include <span>
#include <utility>
#include <vector>

#include "common/sampling_params.h"
#include "common/status.h"

namespace tessera::cpu {

// Requests sample with tessera::SamplingParams (common/sampling_params.h): its per-token fields
// are what this sampler reads.


// Step 2 alone, in place (the oracle for a GPU penalties kernel):
//   logits:     [vocab] fp32, in place
//   prompt_ids: prompt tokens, output_ids: generated tokens, each in [0, vocab)
// INVALID_ARGUMENT for an id out of range (nothing is modified then).
Status apply_penalties(std::span<float> logits, std::span<const int32_t> prompt_ids,
                       std::span<const int32_t> output_ids, const SamplingParams& params);

// Steps 3-6 alone, in place: turns penalised logits into the logits of the distribution that
// is sampled from: divided by the temperature, every token that min_p / top_k / top_p drop set
// to -inf (for greedy, every token but the argmax). softmax(logits) afterwards is exactly the
// distribution Sampler draws from (the oracle for a GPU sampling kernel).
//   logits: [vocab] fp32, in place; NaN is treated as -inf
//   params: valid (SamplingParams::validate accepts them)
// INVALID_ARGUMENT when no logit is finite.
Status filter_logits(std::span<float> logits, const SamplingParams& params);

// Index of the largest logit, the lowest index among ties (torch.argmax's choice). NaN is never
// chosen unless every logit is NaN (then 0). Precondition: vocab >= 1.
int32_t greedy_argmax(const float* logits, int64_t vocab);

// One request's sampler. It owns the RNG (std::mt19937_64 seeded with params.seed, or a random
// seed), so a request's tokens depend only on its seed and its logits, not on the batch. Not
// thread-safe; one per request.
class Sampler {
 public:
  // `params` are valid: SamplingParams::validate accepted them where they entered the process
  // (the actor's RequestTable::apply checks every request's once); the sampler checks nothing
  // of them again.
  static Sampler create(const SamplingParams& params);

  const SamplingParams& params() const { return params_; }
  uint64_t seed() const { return seed_; }  // the seed in use (to reproduce a random one)

  // Picks the next token.
  //   logits:     [vocab] fp32, the model's output for the last position (not modified)
  //   prompt_ids: the request's prompt tokens (repetition penalty), each in [0, vocab)
  //   output_ids: the tokens generated so far (all three penalties), each in [0, vocab)
  // INVALID_ARGUMENT for vocab < 1 or an id out of range; FAILED_PRECONDITION when no logit is
  // finite (nothing can be sampled).
  Expected<SampleResult> sample(const float* logits, int64_t vocab,
                                std::span<const int32_t> prompt_ids,
                                std::span<const int32_t> output_ids);

 private:
  Sampler(const SamplingParams& params, uint64_t seed);
  void raw_logprobs(const float* logits, int64_t vocab, SampleResult* result);
  double uniform();  // [0, 1) with 53 random bits

  SamplingParams params_;
  uint64_t seed_ = 0;
  std::mt19937_64 rng_;
  // Scratch reused across calls.
  std::vector<float> work_;     // [vocab] processed logits
  std::vector<int32_t> order_;  // candidate token ids
};

}  // namespace tessera::cpu
