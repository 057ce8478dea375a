#include "driver/engine/scheduler.h"

#include <algorithm>

namespace tessera {

Scheduler::Scheduler(SchedulerConfig config, BlockManager& blocks)
    : config_(config), blocks_(blocks) {}

void Scheduler::add(std::unique_ptr<Sequence> seq) {
  seq->status = SeqStatus::kWaiting;
  waiting_.push_back(std::move(seq));
}

void Scheduler::preempt(size_t index) {
  std::unique_ptr<Sequence> seq = std::move(running_[index]);
  running_.erase(running_.begin() + static_cast<std::ptrdiff_t>(index));
  blocks_.release(*seq);
  seq->computed = 0;
  seq->sent_blocks = 0;
  if (seq->started) preempted_.push_back(seq->id);
  seq->started = false;
  seq->status = SeqStatus::kWaiting;
  ++seq->preemptions;
  ++preemptions_;
  waiting_.push_front(std::move(seq));
}

bool Scheduler::make_room(size_t index) {
  for (size_t v = running_.size(); v-- > index + 1;) {
    if (!running_[v]->in_flight) {
      preempt(v);
      return true;
    }
  }
  for (size_t v = index + 1; v < running_.size(); ++v) {
    if (running_[v]->in_flight) return false;  // it comes back soon; preempt it then
  }
  preempt(index);
  return false;
}

std::vector<ScheduledChunk> Scheduler::schedule() {
  std::vector<ScheduledChunk> out;
  const ModelInfo& limits = config_.limits;
  size_t budget = static_cast<size_t>(limits.max_num_batched_tokens);
  const size_t max_num_seqs = static_cast<size_t>(limits.max_num_seqs);
  const size_t max_model_len = static_cast<size_t>(limits.max_model_len);
  const size_t seats = config_.max_seqs_per_step > 0 ? config_.max_seqs_per_step : max_num_seqs;
  const uint64_t preempted_before = preemptions_;
  // Running sequences: the rest of a chunked prompt, or one decode token.
  for (size_t i = 0; i < running_.size() && budget > 0 && out.size() < seats;) {
    Sequence& seq = *running_[i];
    if (seq.in_flight > 0) {
      // Async scheduling: the next decode step, whose input is the token the step in flight
      // samples, unless that token already ends the sequence by length. No preemption for it:
      // without a free block it waits for its step to come back.
      const size_t next = seq.total();  // the position of the token being sampled
      if (config_.async_scheduling && seq.in_flight == 1 && seq.sample_in_flight &&
          static_cast<int>(seq.output.size()) + 1 < seq.sampling.max_tokens &&
          next + 1 < max_model_len && blocks_.can_grow(seq, next + 1)) {
        blocks_.grow(seq, next + 1);
        out.push_back({&seq, next, 1, true});
        ++seq.in_flight;
        budget -= 1;
      }
      ++i;
      continue;
    }
    size_t count = std::min({seq.total() - seq.computed, budget, blocks_.max_step_tokens()});
    if (count == 0) {
      ++i;
      continue;
    }
    bool room = true;
    while (room && !blocks_.can_grow(seq, seq.computed + count)) room = make_room(i);
    if (!room) {
      // Waits (running_[i] is still it) or was preempted (running_[i] is the next one).
      if (i < running_.size() && running_[i].get() == &seq) ++i;
      continue;
    }
    blocks_.grow(seq, seq.computed + count);
    out.push_back({&seq, seq.computed, count, seq.computed + count == seq.total()});
    seq.in_flight = 1;
    seq.sample_in_flight = out.back().sample;
    budget -= count;
    ++i;
  }
  if (preemptions_ != preempted_before) return out;
  // Admit waiting sequences in arrival order while budget, seats and blocks last.
  while (!waiting_.empty() && budget > 0 && running_.size() < max_num_seqs && out.size() < seats) {
    Sequence& seq = *waiting_.front();
    std::vector<uint32_t> hits = blocks_.match_prefix(seq);
    size_t start = hits.size() * blocks_.block_size();
    size_t count = std::min({seq.total() - start, budget, blocks_.max_step_tokens()});
    if (blocks_.window() > 0) {
      // The first step holds every block from position 0 (its blocks before the window are
      // freed only after it), so with a sliding window a cached prefix that leaves no room for
      // the chunk in the whole cache is used in part: fewer hits, more recomputed.
      const size_t room = blocks_.total_blocks() -
                          std::min<size_t>(blocks_.total_blocks(), blocks_.blocks_for(count));
      if (hits.size() > room) {
        hits.resize(room);
        start = hits.size() * blocks_.block_size();
        count = std::min({seq.total() - start, budget, blocks_.max_step_tokens()});
      }
    }
    if (!blocks_.can_admit(hits, start + count)) break;
    blocks_.admit(seq, hits, start + count);
    if (seq.preemptions == 0) seq.cached_tokens = start;
    seq.status = SeqStatus::kRunning;
    seq.in_flight = 1;
    out.push_back({&seq, start, count, start + count == seq.total()});
    seq.sample_in_flight = out.back().sample;
    budget -= count;
    running_.push_back(std::move(waiting_.front()));
    waiting_.pop_front();
  }
  return out;
}

std::unique_ptr<Sequence> Scheduler::finish(uint64_t id) {
  auto take = [&](auto& queue) -> std::unique_ptr<Sequence> {
    for (auto it = queue.begin(); it != queue.end(); ++it) {
      if ((*it)->id != id) continue;
      auto seq = std::move(*it);
      queue.erase(it);
      seq->status = SeqStatus::kFinished;
      blocks_.release(*seq);
      return seq;
    }
    return nullptr;
  };
  if (auto seq = take(running_)) return seq;
  return take(waiting_);
}

std::vector<uint64_t> Scheduler::take_preempted() {
  std::vector<uint64_t> out = std::move(preempted_);
  preempted_.clear();
  return out;
}

}  // namespace tessera
