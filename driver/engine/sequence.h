// One request's state in the driver: its tokens, KV blocks and stop conditions (nano-vllm's
// `Sequence`). Plain data; the scheduler and the engine move it between states.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace tessera {

// What a request asks of generation (OpenAI/vLLM semantics).
struct SamplingOptions {
  float temperature = 1.0f;  // 0 = greedy
  float top_p = 1.0f;
  int top_k = -1;            // -1 = off
  float min_p = 0.0f;
  std::optional<uint64_t> seed;
  float repetition_penalty = 1.0f;
  float presence_penalty = 0.0f;
  float frequency_penalty = 0.0f;
  int logprobs = -1;         // -1 = off, else top-N alternatives per token
  int max_tokens = 16;
  bool ignore_eos = false;
  std::vector<int32_t> stop_token_ids;
  std::vector<std::string> stop;  // stop strings; the output ends before them
  bool skip_special_tokens = true;
};

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
  SamplingOptions sampling;
  SeqStatus status = SeqStatus::kWaiting;
  std::vector<uint32_t> block_table;
  size_t computed = 0;     // tokens whose K/V are in the cache
  bool started = false;    // the actor has seen this request's first step
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
