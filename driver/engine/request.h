// A request the engine can run. Only Request::make builds one, after checking it against the
// model once: a prompt of at least one token, every token in the vocabulary, room in the
// context for at least one new token, and sampling parameters that SamplingParams::validate
// accepts for this vocabulary. The HTTP server, `tessera generate` and the C++ LLM all make
// theirs here, and everything after (the server's engine thread, LlmEngine, the actors' step)
// takes it as it is: the driver's side of "validate at the process boundary". What only the
// engine knows, whether the KV cache can hold the prompt at all, the engine still checks.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "common/load_spec.h"
#include "common/sampling_params.h"
#include "common/status.h"

namespace tessera {

class Request {
 public:
  // `model` gives the vocabulary (vocab_size) and the context (max_model_len), as the actors
  // reported them. INVALID_ARGUMENT naming what is wrong.
  static Expected<Request> make(std::vector<int32_t> prompt, SamplingParams sampling,
                                const ModelInfo& model);

  // The sampling half of make(): for a caller that has its parameters before its prompts
  // (`tessera generate`'s flags, refused before a node starts).
  static Status check_sampling(const SamplingParams& sampling, int64_t vocab_size);

  const std::vector<int32_t>& prompt() const { return prompt_; }
  const SamplingParams& sampling() const { return sampling_; }
  // The same request with another seed (the server's n choices of one prompt): a seed is never
  // invalid.
  Request with_seed(uint64_t seed) const;
  // Hands over the parts (the engine's sequence keeps them).
  std::pair<std::vector<int32_t>, SamplingParams> take() && {
    return {std::move(prompt_), std::move(sampling_)};
  }

 private:
  Request(std::vector<int32_t> prompt, SamplingParams sampling)
      : prompt_(std::move(prompt)), sampling_(std::move(sampling)) {}

  std::vector<int32_t> prompt_;
  SamplingParams sampling_;
};

}  // namespace tessera
