// One request's state in the driver: its tokens, KV blocks and stop conditions (nano-vllm's
// `Sequence`). Plain data; the scheduler and the engine move it between states.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "common/sampling_params.h"

namespace tessera {

enum class SeqStatus { kWaiting, kRunning, kFinished };

struct TokenLogprobs {
  int32_t token = 0;
  float logprob = 0.0f;
  std::vector<std::pair<int32_t, float>> top;  // best first
};

struct Sequence {
  uint64_t id = 0;
  std::vector<int32_t> prompt;
  std::vector<int32_t> output;
  SamplingParams sampling;
  SeqStatus status = SeqStatus::kWaiting;
  std::vector<uint32_t> block_table;
  size_t computed = 0;     // tokens whose K/V are in the cache
  bool started = false;    // its first step was sent to the actors
  size_t sent_blocks = 0;  // block_table entries the actors have been sent
  bool in_flight = false;  // in a step submitted and not collected yet
  std::string text;        // detokenized output so far (before stop-string truncation)
  size_t emitted = 0;      // chars of `text` already handed to the caller
  std::string finish_reason;  // "stop", "length", "abort: ..."
  std::vector<TokenLogprobs> logprobs;

  size_t total() const { return prompt.size() + output.size(); }
  int32_t last_token() const { return output.empty() ? prompt.back() : output.back(); }
  int32_t token_at(size_t i) const {
    return i < prompt.size() ? prompt[i] : output[i - prompt.size()];
  }
};

}  // namespace tessera
