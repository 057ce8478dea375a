#include "common/sampling_params.h"

#include <cmath>
#include <sstream>

namespace tessera {

namespace {

std::string num(float v) {
  std::ostringstream out;
  out << v;
  return out.str();
}

}  // namespace

Status SamplingParams::validate(int64_t vocab_size) const {
  if (!(temperature >= 0.0f) || !std::isfinite(temperature)) {
    return invalid_argument("temperature must be a number >= 0, got " + num(temperature));
  }
  if (!(top_p > 0.0f && top_p <= 1.0f)) {
    return invalid_argument("top_p must be in (0, 1], got " + num(top_p));
  }
  if (top_k == 0 || top_k < -1) {
    return invalid_argument("top_k must be -1 (off) or at least 1, got " + std::to_string(top_k));
  }
  if (!(min_p >= 0.0f && min_p <= 1.0f)) {
    return invalid_argument("min_p must be in [0, 1], got " + num(min_p));
  }
  if (!(repetition_penalty > 0.0f) || !std::isfinite(repetition_penalty)) {
    return invalid_argument("repetition_penalty must be a number greater than 0, got " +
                            num(repetition_penalty));
  }
  if (!(presence_penalty >= -2.0f && presence_penalty <= 2.0f)) {
    return invalid_argument("presence_penalty must be in [-2, 2], got " + num(presence_penalty));
  }
  if (!(frequency_penalty >= -2.0f && frequency_penalty <= 2.0f)) {
    return invalid_argument("frequency_penalty must be in [-2, 2], got " + num(frequency_penalty));
  }
  if (logprobs < -1 || logprobs > kMaxLogprobs) {
    return invalid_argument("logprobs must be between 0 and " + std::to_string(kMaxLogprobs) +
                            " (or -1 for none), got " + std::to_string(logprobs));
  }
  if (max_tokens < 1) {
    return invalid_argument("max_tokens must be at least 1, got " + std::to_string(max_tokens));
  }
  for (const auto& s : stop) {
    if (s.empty()) return invalid_argument("stop strings must not be empty");
  }
  for (int32_t id : stop_token_ids) {
    if (id < 0 || (vocab_size > 0 && id >= vocab_size)) {
      return invalid_argument("stop token id " + std::to_string(id) +
                              " is outside the vocabulary" +
                              (vocab_size > 0 ? " (" + std::to_string(vocab_size) + " tokens)"
                                              : std::string()));
    }
  }
  return Status::ok();
}

}  // namespace tessera
