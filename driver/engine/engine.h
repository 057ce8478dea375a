// The driver's engine loop: schedule → run → postprocess (nano-vllm's three lines).
//
// The engine owns requests, the scheduler and the block manager; a StepExecutor runs each
// step on the actors (over RPC in production, a fake in tests). Postprocessing appends sampled
// tokens, detokenizes, applies stop conditions (EOS unless ignore_eos, stop token ids, stop
// strings, max_tokens, max_model_len) and hands back text deltas for streaming.
#pragma once

#include <cstdint>
#include <functional>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "common/status.h"
#include "common/step.h"
#include "driver/engine/block_manager.h"
#include "driver/engine/scheduler.h"
#include "driver/engine/sequence.h"

namespace tessera {

// Runs steps on the model's actors (the worker group in production, a fake in tests). Steps
// complete in the order they were submitted; up to pipeline_depth() may be in flight at once
// (the number of pipeline stages: each stage works on a different step).
class StepExecutor {
 public:
  virtual ~StepExecutor() = default;
  virtual Status submit(StepInput step) = 0;
  // The output of the oldest submitted step not collected yet.
  virtual Expected<StepOutput> collect() = 0;
  virtual int pipeline_depth() const { return 1; }
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

class LlmEngine {
 public:
  LlmEngine(EngineConfig config, StepExecutor& executor, const Detokenizer& detokenizer);

  // Queues a request. INVALID_ARGUMENT for an empty prompt, a prompt that leaves no room in
  // max_model_len, token ids outside the vocabulary, or bad sampling options.
  Expected<uint64_t> add_request(std::vector<int32_t> prompt, SamplingParams sampling);
  // Submits steps until pipeline_depth() are in flight (or nothing more can run), then collects
  // the oldest and returns the requests that produced output. A failed step fails the requests
  // that were in it (finish_reason "error: ...") and the engine goes on.
  Expected<std::vector<RequestOutput>> step();
  bool has_unfinished() const { return !scheduler_.idle(); }
  const EngineConfig& config() const { return config_; }

 private:
  void postprocess(Sequence& seq, const TokenLogprobs& sampled, RequestOutput& out);
  // The actors' view of the scheduled chunks: new tokens and blocks only, sampling on first.
  StepInput make_step(const std::vector<ScheduledChunk>& chunks);
  void fail(const std::vector<ScheduledChunk>& chunks, const Status& why,
            std::vector<RequestOutput>& outputs);

  EngineConfig config_;
  StepExecutor& executor_;
  const Detokenizer& detokenizer_;
  BlockManager blocks_;
  Scheduler scheduler_;
  uint64_t next_id_ = 1;
  uint64_t next_step_ = 1;
  std::vector<uint64_t> finished_since_last_step_;
  std::deque<std::vector<ScheduledChunk>> in_flight_;  // submitted steps, oldest first
};

}  // namespace tessera
