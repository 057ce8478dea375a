// Continuous batching: which sequences run this step and how many of their tokens.
//
// Each step first gives every running sequence its next tokens (the rest of a chunked prompt,
// or one decode token), then admits waiting sequences' prompts in chunks while the token budget,
// the seats and the free KV blocks allow (chunked prefill). An admitted sequence starts after
// its longest cached prefix (block_manager.h). With a sliding-window KV cache a step computes at
// most BlockManager::max_step_tokens() tokens of a sequence, so that one sequence's blocks (its
// window's and its chunk's) always fit the cache, however long the sequence.
//
// Preemption by recompute (vLLM V1): when a running sequence's next block cannot be had, the
// most recently admitted running sequence gives up its blocks and goes back to the front of the
// waiting queue with its output kept; when readmitted it computes prompt + output again (from
// the prefix cache where its blocks survived) and samples its next token. The actors must
// forget it (take_preempted()). No new sequence is admitted in a step that preempted.
//
// A sequence is "in flight" from the step that schedules it until the engine has its result
// (pipeline parallelism keeps several steps in flight): it is not preempted meanwhile (its
// blocks are in use) and not scheduled again, except for one decode step ahead with async
// scheduling. A sequence that needs a block while the only candidates to preempt are in flight
// waits for them to come back.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <vector>

#include "common/load_spec.h"
#include "driver/engine/block_manager.h"
#include "driver/engine/sequence.h"

namespace tessera {

struct SchedulerConfig {
  // What the actors reported (WorkerGroup::model()): max_num_seqs sequences admitted (holding KV
  // blocks) at once, max_num_batched_tokens computed per step, max_model_len per sequence.
  ModelInfo limits;
  // Sequences in one step; 0 = limits.max_num_seqs. With several steps in flight (pipeline
  // stages) the engine sets it to max_num_seqs / stages, so that the running sequences split
  // into that many micro-batches, one per step, instead of the first step taking them all and
  // leaving the other stages nothing to run.
  uint32_t max_seqs_per_step = 0;
  // Async scheduling (vLLM's --async-scheduling): a decoding sequence whose step is still in
  // flight is scheduled again, for the token that step samples (kSampledToken), so that two
  // full steps are in flight and the driver's work hides behind the GPU's. The actor fills the
  // token in from its own sample, so this needs a single rank. A token that turns out to end the
  // sequence (EOS, a stop string) costs one discarded step for it.
  bool async_scheduling = false;
};

struct ScheduledChunk {
  Sequence* seq = nullptr;
  size_t start = 0;     // first token computed in this step
  size_t count = 0;     // tokens computed in this step
  bool sample = false;  // the chunk reaches the end of the sequence: sample the next token
};

class Scheduler {
 public:
  Scheduler(SchedulerConfig config, BlockManager& blocks);

  void add(std::unique_ptr<Sequence> seq);
  // The next step's work (its sequences are marked in flight); empty when nothing can run.
  std::vector<ScheduledChunk> schedule();
  // Removes a sequence (waiting or running) and frees its blocks; it is handed back to the
  // caller with status kFinished, or null when the scheduler does not have it.
  std::unique_ptr<Sequence> finish(uint64_t id);
  // Ids of the sequences preempted since the last call, which the actors must forget (their
  // state and block tables are stale; they restart with a `first` step).
  std::vector<uint64_t> take_preempted();

  bool idle() const { return waiting_.empty() && running_.empty(); }
  size_t running() const { return running_.size(); }
  size_t waiting() const { return waiting_.size(); }
  uint64_t preemptions() const { return preemptions_; }
  const SchedulerConfig& config() const { return config_; }

 private:
  // Frees running_[index]'s blocks and puts it at the front of the waiting queue.
  void preempt(size_t index);
  // For running_[index], which needs a block: preempts the most recently admitted running
  // sequence that is not in flight (possibly running_[index] itself). False when it must wait
  // instead (the candidates after it are in flight) or it was itself preempted.
  bool make_room(size_t index);

  SchedulerConfig config_;
  BlockManager& blocks_;
  std::deque<std::unique_ptr<Sequence>> waiting_;
  std::vector<std::unique_ptr<Sequence>> running_;  // in admission order
  std::vector<uint64_t> preempted_;
  uint64_t preemptions_ = 0;
};

}  // namespace tessera
