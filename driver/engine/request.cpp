#include "driver/engine/request.h"

#include <string>
#include <utility>

namespace tessera {

Expected<Request> Request::make(std::vector<int32_t> prompt, SamplingParams sampling,
                                const ModelInfo& model) {
  if (prompt.empty()) return invalid_argument("the prompt is empty");
  for (int32_t t : prompt) {
    if (t < 0 || t >= model.vocab_size) {
      return invalid_argument("token id " + std::to_string(t) + " is outside the vocabulary (" +
                              std::to_string(model.vocab_size) + " tokens)");
    }
  }
  if (static_cast<int64_t>(prompt.size()) >= model.max_model_len) {
    return invalid_argument("the prompt has " + std::to_string(prompt.size()) +
                            " tokens, but max-model-len is " +
                            std::to_string(model.max_model_len) +
                            ": shorten the prompt or raise --max-model-len");
  }
  TESSERA_RETURN_IF_ERROR(check_sampling(sampling, model.vocab_size));
  return Request(std::move(prompt), std::move(sampling));
}

Status Request::check_sampling(const SamplingParams& sampling, int64_t vocab_size) {
  return sampling.validate(vocab_size);
}

Request Request::with_seed(uint64_t seed) const {
  Request r = *this;
  r.sampling_.seed = seed;
  return r;
}

}  // namespace tessera
