// Continuous batching: which sequences run this step and how many of their tokens.
//
// Each step first gives every running sequence its next token (decode), then admits waiting
// sequences' prompts in chunks while the token budget and the free KV blocks allow (chunked
// prefill). A sequence whose next block cannot be had waits (it is not preempted yet). A
// sequence is "in flight" from the step that schedules it until the engine has its result
// (pipeline parallelism keeps several steps in flight): it is not scheduled again meanwhile.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <vector>

#include "driver/engine/block_manager.h"
#include "driver/engine/sequence.h"

namespace tessera {

struct SchedulerConfig {
  uint32_t max_num_seqs = 256;
  uint32_t max_num_batched_tokens = 2048;  // tokens computed per step
  uint32_t max_model_len = 4096;
};

struct ScheduledChunk {
  Sequence* seq = nullptr;
  size_t start = 0;      // first token computed in this step
  size_t count = 0;      // tokens computed in this step
  bool sample = false;   // the chunk reaches the end of the sequence: sample the next token
};

class Scheduler {
 public:
  Scheduler(SchedulerConfig config, BlockManager& blocks);

  void add(std::unique_ptr<Sequence> seq);
  // The next step's work (its sequences are marked in flight); empty when nothing can run.
  std::vector<ScheduledChunk> schedule();
  // Marks a sequence finished and frees its blocks; it is handed back to the caller.
  std::unique_ptr<Sequence> finish(uint64_t id);
  bool idle() const { return waiting_.empty() && running_.empty(); }
  size_t running() const { return running_.size(); }
  size_t waiting() const { return waiting_.size(); }
  const SchedulerConfig& config() const { return config_; }

 private:
  SchedulerConfig config_;
  BlockManager& blocks_;
  std::deque<std::unique_ptr<Sequence>> waiting_;
  std::vector<std::unique_ptr<Sequence>> running_;
};

}  // namespace tessera
