#include "driver/engine/scheduler.h"

#include <algorithm>

namespace tessera {

Scheduler::Scheduler(SchedulerConfig config, BlockManager& blocks)
    : config_(config), blocks_(blocks) {}

void Scheduler::add(std::unique_ptr<Sequence> seq) {
  seq->status = SeqStatus::kWaiting;
  waiting_.push_back(std::move(seq));
}

std::vector<ScheduledChunk> Scheduler::schedule() {
  std::vector<ScheduledChunk> out;
  size_t budget = config_.max_num_batched_tokens;
  // Running sequences: the rest of a chunked prompt, or one decode token.
  for (auto& seq : running_) {
    if (budget == 0) break;
    if (seq->in_flight) continue;  // its previous step is still in the pipeline
    size_t remaining = seq->total() - seq->computed;
    size_t count = std::min(remaining, budget);
    if (count == 0) continue;
    if (!blocks_.can_grow(*seq, seq->computed + count)) continue;  // waits for blocks
    blocks_.grow(*seq, seq->computed + count);
    out.push_back({seq.get(), seq->computed, count, seq->computed + count == seq->total()});
    seq->in_flight = true;
    budget -= count;
  }
  // Admit waiting sequences in arrival order while budget, seats and blocks last.
  while (!waiting_.empty() && budget > 0 && running_.size() < config_.max_num_seqs) {
    Sequence& seq = *waiting_.front();
    size_t count = std::min(seq.total() - seq.computed, budget);
    if (!blocks_.can_grow(seq, seq.computed + count)) break;
    blocks_.grow(seq, seq.computed + count);
    seq.status = SeqStatus::kRunning;
    seq.in_flight = true;
    out.push_back({&seq, seq.computed, count, seq.computed + count == seq.total()});
    budget -= count;
    running_.push_back(std::move(waiting_.front()));
    waiting_.pop_front();
  }
  return out;
}

std::unique_ptr<Sequence> Scheduler::finish(uint64_t id) {
  for (auto it = running_.begin(); it != running_.end(); ++it) {
    if ((*it)->id == id) {
      auto seq = std::move(*it);
      running_.erase(it);
      seq->status = SeqStatus::kFinished;
      blocks_.release(*seq);
      return seq;
    }
  }
  for (auto it = waiting_.begin(); it != waiting_.end(); ++it) {
    if ((*it)->id == id) {
      auto seq = std::move(*it);
      waiting_.erase(it);
      seq->status = SeqStatus::kFinished;
      blocks_.release(*seq);
      return seq;
    }
  }
  return nullptr;
}

}  // namespace tessera
