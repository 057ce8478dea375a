// One engine step as the actors see it, and what comes back. The driver's scheduler owns the
// KV-cache blocks and sends, per sequence, only what changed since the actor last saw it: the
// new tokens, the blocks appended to its table, and (first step) its sampling parameters. Each
// actor keeps every live request's block table and token history (actors/model/requests.h).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/sampling_params.h"

namespace tessera {

// In SeqStep::tokens (async scheduling, one rank): the token this actor sampled for the request in
// the step before, which the driver does not know yet. Only as the one token of a continuing
// request's decode step.
constexpr int32_t kSampledToken = -1;

struct SeqStep {
  uint64_t request_id = 0;
  std::vector<int32_t> tokens;       // this step's tokens: a prompt chunk, or the last sampled
  int64_t start_position = 0;        // position of tokens[0]
  std::vector<uint32_t> new_blocks;  // appended to the request's block table, in order
  bool sample = false;               // sample a token after these (last prefill chunk, decode)
  bool first = false;                // a new request: its table starts empty; the fields below
  int64_t prompt_len = 0;            // first only: tokens of the request that are prompt
  SamplingParams sampling;           // first only
  // First only, on a prefix-cache hit (start_position > 0): the tokens of positions
  // [0, start_position), whose K/V the leading new_blocks already hold. They are not computed;
  // they join the request's history (penalties, the seeded sampler's position).
  std::vector<int32_t> prefix_tokens;
};

// The sequence's one token is kSampledToken: a continuing request's decode step taking the
// token the step before samples.
inline bool takes_sampled_token(const SeqStep& s) {
  return !s.first && s.tokens.size() == 1 && s.tokens[0] == kSampledToken;
}

struct StepInput {
  uint64_t step_id = 0;
  std::vector<SeqStep> seqs;
  std::vector<uint64_t> finished;  // requests the actors forget before this step
};

struct SeqOutput {
  uint64_t request_id = 0;
  SampleResult sample;
};

struct StepOutput {
  uint64_t step_id = 0;
  std::vector<SeqOutput> outputs;  // one per SeqStep with sample, in order (from the rank
                                   // that samples; empty from the others)
  std::vector<float> logits;       // the sampled rows' logits, when loaded with return_logits
  uint32_t actor_micros = 0;       // time the actor spent in this step
  uint32_t gpu_micros = 0;         // of which the forward pass on the GPU (0 on the cpu backend)
  std::string error;               // the step failed on this rank (ring transport), else ""
};

}  // namespace tessera
