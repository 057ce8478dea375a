// The driver's engine loop: schedule → run → postprocess (nano-vllm's three lines).
//
// The engine owns requests, the scheduler and the block manager; a StepExecutor runs each
// step on the actors (over RPC in production, a fake in tests). Postprocessing appends sampled
// tokens, detokenizes them incrementally (one TextStream per request), applies stop conditions
// (EOS unless ignore_eos, stop token ids, stop strings, max_tokens, max_model_len — or the
// whole KV cache when it holds fewer tokens, so that a request alone always fits) and hands back
// text deltas for streaming.
//
// What the actors are told (common/step.h): a request's first step has `first` set, starts
// after its cached prefix (start_position > 0 on a prefix-cache hit, whose blocks lead its
// new_blocks) and carries its sampling parameters; later steps carry only new tokens and
// blocks. `finished` lists the requests the actors forget: finished, failed, aborted and
// preempted ones. A preempted request keeps its id and comes back as a `first` step that
// recomputes prompt + output (actors/model/requests.h replaces a request's state on `first`).
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "common/status.h"
#include "common/step.h"
#include "driver/engine/block_manager.h"
#include "driver/engine/detokenizer.h"
#include "driver/engine/request.h"
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

struct EngineConfig {
  // The model as its actors reported it after loading (WorkerGroup::model()): the KV cache
  // (kv_blocks of block_size tokens), the vocabulary, and the scheduler's limits
  // (max_num_seqs, max_num_batched_tokens, max_model_len).
  ModelInfo model;
  bool enable_prefix_caching = true;  // share cached KV blocks of common prompt prefixes
  bool async_scheduling = false;      // scheduler.h
  std::vector<int32_t> eos_token_ids;
  // ModelConfig::kv_cache_window(): > 0 when every layer slides by at most it, and the block
  // manager frees a sequence's blocks as they fall out of the window (block_manager.h); then a
  // sequence may be longer than the whole KV cache. 0 (full attention, or only some layers
  // slide): every block is kept.
  uint32_t kv_window = 0;
};

struct RequestOutput {
  uint64_t request_id = 0;
  std::string delta;  // new text since the last output
  std::vector<int32_t> new_tokens;
  std::vector<TokenLogprobs> new_logprobs;  // when logprobs were asked for
  bool finished = false;
  FinishReason finish_reason = FinishReason::kNone;  // set when finished
  // vLLM's stop_reason, set when finished by kStop: the stop string that ended the text, or the
  // stop_token_ids entry sampled; empty (None) for an end-of-sequence token.
  std::variant<std::monostate, int32_t, std::string> stop_reason;
  Status error;  // why it failed (finish_reason kError); OK otherwise
  size_t prompt_tokens = 0;
  size_t completion_tokens = 0;
  size_t cached_tokens = 0;  // prompt tokens found in the prefix cache (OpenAI's usage field)
};

// A snapshot of the engine for metrics (vLLM's gauges and counters); counters are cumulative
// since the engine started.
struct EngineStats {
  size_t running = 0;  // requests admitted (holding KV blocks or in flight)
  size_t waiting = 0;  // requests queued, preempted ones included
  uint32_t kv_blocks_total = 0;
  uint32_t kv_blocks_used = 0;        // held by requests (cached blocks nobody holds are free)
  double kv_cache_usage = 0.0;        // kv_blocks_used / kv_blocks_total, in [0, 1]
  uint64_t prefix_cache_queries = 0;  // tokens looked up at admissions (prompt, + output after
                                      // a preemption); 0 with prefix caching off
  uint64_t prefix_cache_hits = 0;     // of which found cached
  uint64_t prompt_tokens = 0;         // prompt tokens of requests that produced a first token
  uint64_t generation_tokens = 0;     // tokens sampled
  uint64_t preemptions = 0;
  // Kept by the server's engine thread across worker-group restarts (the engine is new after
  // each): restarts that brought the model back, restarts that failed, and requests failed
  // because they were running at each of kMaxRequestRestarts group deaths.
  uint64_t restarts = 0;
  uint64_t restart_failures = 0;
  uint64_t requests_failed_by_restarts = 0;
};

class LlmEngine {
 public:
  // `executor` and `detokenizer` are borrowed and must outlive the engine.
  LlmEngine(EngineConfig config, StepExecutor& executor, const Detokenizer& detokenizer);

  // Queues a request (valid: request.h). INVALID_ARGUMENT only for a prompt the whole KV cache
  // cannot hold.
  Expected<uint64_t> add_request(Request request);
  // Submits steps until pipeline_depth() are in flight (or nothing more can run), then collects
  // the oldest and returns the requests that produced output. A failed step fails the requests
  // that were in it (finish_reason kError, the step's Status as error) and the engine goes on.
  Expected<std::vector<RequestOutput>> step();
  // Ends a request whatever its state (a client went away): waiting, running, or in a step in
  // flight (whose result for it is then dropped). Its blocks are freed now, the actors forget it
  // in the next step. Returns its final output (finished, finish_reason kAbort, no new text or
  // tokens); nullopt when no unfinished request has that id.
  std::optional<RequestOutput> abort_request(uint64_t id);
  // Requests not finished yet, or steps still to collect.
  bool has_unfinished() const { return !scheduler_.idle() || !in_flight_.empty(); }
  // Steps kept in flight: the executor's pipeline stages, 2 with async scheduling on one.
  int steps_in_flight() const { return depth_; }
  EngineStats stats() const;
  const EngineConfig& config() const { return config_; }

 private:
  void postprocess(Sequence& seq, const TokenLogprobs& sampled, RequestOutput& out);
  // The actors' view of the scheduled chunks: new tokens and blocks only, sampling on first.
  StepInput make_step(const std::vector<ScheduledChunk>& chunks);
  void fail(const std::vector<ScheduledChunk>& chunks, const Status& why,
            std::vector<RequestOutput>& outputs);
  // The final output of a request that ends now, with no new tokens.
  static RequestOutput final_output(const Sequence& seq, FinishReason reason, Status error = {});
  // A sequence that ended (finished, failed, aborted) while a step in flight still holds it: kept
  // alive, marked aborted, until that step is collected (its result is dropped).
  void keep_until_collected(std::unique_ptr<Sequence> seq);
  // Hands over the sequences of a step that came back that were aborted while it was in flight.
  std::vector<std::unique_ptr<Sequence>> take_aborted(const std::vector<ScheduledChunk>& chunks);

  EngineConfig config_;
  int depth_;  // steps kept in flight: the stages, or 2 with async scheduling
  StepExecutor& executor_;
  const Detokenizer& detokenizer_;
  BlockManager blocks_;
  Scheduler scheduler_;
  size_t max_len_;  // max_model_len, or fewer when the whole KV cache holds fewer tokens
  uint64_t next_id_ = 1;
  uint64_t next_step_ = 1;
  std::vector<uint64_t> finished_since_last_step_;
  std::deque<std::vector<ScheduledChunk>> in_flight_;  // submitted steps, oldest first
  // Sequences aborted while in flight, kept alive until their step comes back.
  std::vector<std::unique_ptr<Sequence>> aborted_in_flight_;
  uint64_t prompt_tokens_ = 0;
  uint64_t generation_tokens_ = 0;
};

}  // namespace tessera
