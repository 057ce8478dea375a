// One request's state in the driver: its tokens, KV blocks and stop conditions (nano-vllm's
// `Sequence`). Plain data; the scheduler and the engine move it between states, the block
// manager fills its block table.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/sampling_params.h"
#include "driver/engine/detokenizer.h"

namespace tessera {

enum class SeqStatus { kWaiting, kRunning, kFinished };

// Why a request ended: vLLM's finish reasons, and kError when it failed (the output that ends it
// carries the Status, engine.h's RequestOutput::error). kNone while it runs.
enum class FinishReason { kNone, kStop, kLength, kAbort, kError };

// vLLM's and OpenAI's wire names: "stop", "length", "abort"; "error" for kError, "" for kNone.
constexpr std::string_view finish_reason_name(FinishReason r) {
  switch (r) {
    case FinishReason::kStop:
      return "stop";
    case FinishReason::kLength:
      return "length";
    case FinishReason::kAbort:
      return "abort";
    case FinishReason::kError:
      return "error";
    case FinishReason::kNone:
      break;
  }
  return "";
}

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
  // KV blocks, in position order. Its first blocks may be shared with other sequences (prefix
  // caching): those are full and never written again.
  std::vector<uint32_t> block_table;
  // Prefix-caching hash of each full, computed block of block_table (a chain: each hash covers
  // every token before the block's end). Maintained by the block manager.
  std::vector<uint64_t> block_hashes;
  size_t computed = 0;       // tokens whose K/V are in the cache
  size_t cached_tokens = 0;  // of the prompt, found in the prefix cache when first admitted
  bool started = false;      // its first step was sent to the actors (since its last preemption)
  size_t sent_blocks = 0;    // block_table entries the actors have been sent
  size_t freed_blocks = 0;   // leading block_table entries given back (sliding window:
                             // BlockManager::release_out_of_window), now kFreedBlock
  int in_flight = 0;         // steps submitted and not collected yet that hold it (2 at most,
                             // with async scheduling)
  // The last step scheduled for it samples its next token (async scheduling may then schedule
  // the step after, whose input is that token, before it is known).
  bool sample_in_flight = false;
  bool aborted = false;  // aborted while in flight: the step's result is dropped
  uint32_t preemptions = 0;
  std::unique_ptr<TextStream> text_stream;  // the detokenizer's stream for `output`
  std::string text;    // detokenized output so far (truncated at a stop string)
  size_t emitted = 0;  // chars of `text` already handed to the caller
  FinishReason finish_reason = FinishReason::kNone;  // kStop or kLength once it ends
  std::vector<TokenLogprobs> logprobs;

  size_t total() const { return prompt.size() + output.size(); }
  int32_t last_token() const { return output.empty() ? prompt.back() : output.back(); }
  int32_t token_at(size_t i) const {
    return i < prompt.size() ? prompt[i] : output[i - prompt.size()];
  }
};

}  // namespace tessera
