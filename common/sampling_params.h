// What a request asks of generation: vLLM's SamplingParams (OpenAI's request fields), one type
// from the HTTP request or the CLI down to the sampler on the GPU. Defaults live here and only
// here (protocol/step.capnp's wire form has none: protocol/convert.cpp writes every field).
// validate() is the one check (the ranges vLLM accepts), run where a request enters a process:
// the driver's Request::make (driver/engine/request.h) and the actor's RequestTable::apply.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "common/status.h"

namespace tessera {

// The most alternatives a request may ask logprobs for (vLLM's default max_logprobs).
inline constexpr int kMaxLogprobs = 20;

struct SamplingParams {
  // Per token (the sampler's; see kernels/cpu/sampling.h for the order they apply in).
  float temperature = 1.0f;         // >= 0; < 1e-5 means greedy
  float top_p = 1.0f;               // (0, 1]; 1 = off
  int top_k = -1;                   // -1 = off, else >= 1 (>= vocab is off too)
  float min_p = 0.0f;               // [0, 1]; 0 = off
  std::optional<uint64_t> seed;     // same seed, same logits -> same tokens; unset = random
  float repetition_penalty = 1.0f;  // > 0; 1 = off
  float presence_penalty = 0.0f;    // [-2, 2]
  float frequency_penalty = 0.0f;   // [-2, 2]
  int logprobs = -1;                // -1 = off; 0..kMaxLogprobs: the token's logprob and top N

  // Per request (the engine's).
  int max_tokens = 16;
  bool ignore_eos = false;
  std::vector<int32_t> stop_token_ids;
  std::vector<std::string> stop;  // stop strings; the output ends before them
  bool skip_special_tokens = true;

  // INVALID_ARGUMENT naming the field, its range and the value when anything is out of range.
  // With vocab_size > 0, stop token ids must be inside the vocabulary too.
  Status validate(int64_t vocab_size = 0) const;

  // Greedy: temperature below vLLM's epsilon.
  bool greedy() const { return temperature < 1e-5f; }
  // A penalty is on: sampling reads the request's token history.
  bool penalised() const {
    return repetition_penalty != 1.0f || presence_penalty != 0.0f || frequency_penalty != 0.0f;
  }
};

// What sampling one token gives back.
struct SampleResult {
  int32_t token = -1;
  // Raw logprob of `token` (before penalties and filtering) when SamplingParams::logprobs >= 0, NaN otherwise.
  float logprob = 0.0f;
  // The SamplingParams::logprobs highest raw logprobs (fewer if the vocabulary is smaller), sorted by
  // logprob descending, ties by id ascending; may or may not include `token`.
  std::vector<std::pair<int32_t, float>> top_logprobs;
};

}  // namespace tessera
