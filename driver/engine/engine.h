// The driver's engine loop: schedule → run → postprocess (nano-vllm's three lines).
//
// The engine owns requests, the scheduler and the block manager; a StepExecutor runs each
// step on the actors (over RPC in production, a fake in tests). Postprocessing appends sampled
// tokens, detokenizes, applies stop conditions (EOS unless ignore_eos, stop token ids, stop
// strings, max_tokens, max_model_len) and hands back text deltas for streaming.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "common/status.h"
#include "driver/engine/block_manager.h"
#include "driver/engine/scheduler.h"
#include "driver/engine/sequence.h"

namespace tessera {

// One sequence's work in a step, as the actors need it.
struct SeqWork {
  uint64_t request_id = 0;
  std::vector<int32_t> tokens;        // the tokens computed in this step
  uint32_t start_position = 0;        // position of tokens[0]
  std::vector<uint32_t> block_table;  // the sequence's blocks so far
  bool sample = false;
  bool first = false;  // first step of the request: prompt and sampling follow
  std::vector<int32_t> prompt;
  SamplingOptions sampling;
};

struct StepBatch {
  std::vector<SeqWork> seqs;
  std::vector<uint64_t> finished;  // requests the actors may forget
};

struct SampledToken {
  uint64_t request_id = 0;
  TokenLogprobs token;
};

struct StepResult {
  std::vector<SampledToken> sampled;  // one per SeqWork with sample = true, in order
};

class StepExecutor {
 public:
  virtual ~StepExecutor() = default;
  virtual Expected<StepResult> execute(const StepBatch& batch) = 0;
};

// Turns token ids into text; the tokenizer behind it is the model's.
class Detokenizer {
 public:
  virtual ~Detokenizer() = default;
  virtual std::string decode(const std::vector<int32_t>& ids, bool skip_special_tokens) const = 0;
};

struct EngineConfig {
  uint32_t num_blocks = 0;
  uint32_t block_size = 16;
  SchedulerConfig scheduler;
  int64_t vocab_size = 0;
  std::vector<int32_t> eos_token_ids;
};

struct RequestOutput {
  uint64_t request_id = 0;
  std::string delta;  // new text since the last output
  std::vector<int32_t> new_tokens;
  std::vector<TokenLogprobs> new_logprobs;  // when logprobs were asked for
  bool finished = false;
  std::string finish_reason;  // "stop", "length", or "error: ..."
  size_t prompt_tokens = 0;
  size_t completion_tokens = 0;
};

// Checks a request's sampling options; messages follow the OpenAI/vLLM wording.
Status validate_sampling(const SamplingOptions& s, int64_t vocab_size = 0);

class LlmEngine {
 public:
  LlmEngine(EngineConfig config, StepExecutor& executor, const Detokenizer& detokenizer);

  // Queues a request. INVALID_ARGUMENT for an empty prompt, a prompt that leaves no room in
  // max_model_len, token ids outside the vocabulary, or bad sampling options.
  Expected<uint64_t> add_request(std::vector<int32_t> prompt, SamplingOptions sampling);
  // Runs one step; returns the requests that produced output. A failed step fails the
  // requests that were in it (finish_reason "error: ...") and the engine goes on.
  Expected<std::vector<RequestOutput>> step();
  bool has_unfinished() const { return !scheduler_.idle(); }
  const EngineConfig& config() const { return config_; }

 private:
  void postprocess(Sequence& seq, const TokenLogprobs& sampled, RequestOutput& out);

  EngineConfig config_;
  StepExecutor& executor_;
  const Detokenizer& detokenizer_;
  BlockManager blocks_;
  Scheduler scheduler_;
  uint64_t next_id_ = 1;
  std::vector<uint64_t> finished_since_last_step_;
};

}  // namespace tessera
