// Gives the heap's free memory back to the system when the actor goes idle after steps.
//
// A step allocates and frees its activations and logits (tens of MiB for a batch of 64 rows of a
// 128k vocabulary on the cpu backend). glibc keeps freed memory in its arenas for reuse, up to a
// trim threshold that rises with the largest buffers freed (to 64 MiB an arena), plus the holes
// between live blocks; so after a burst of load the actor's RSS stays at the burst's high water
// though nothing leaks (issue 24: "the actor grew over rounds of load"; what remains after a
// trim is the weights, the KV cache pages touched so far and a few MiB). malloc_trim(0) once the
// actor has been idle for a while returns it all; a step that starts meanwhile only waits for an
// arena's lock.
#pragma once

#include <chrono>
#include <cstdint>

namespace tessera {

// When to trim: once per idle period that follows steps.
class HeapTrimSchedule {
 public:
  using Clock = std::chrono::steady_clock;

  // idle_after: how long no step may have run before the heap is trimmed.
  explicit HeapTrimSchedule(std::chrono::milliseconds idle_after) : idle_after_(idle_after) {}

  // Called periodically from one thread: `busy` how long the step now running has run (0: none),
  // `steps` how many steps have finished so far. True when the caller should trim now: no step
  // has run for idle_after, and steps ran since the last trim.
  bool due(std::chrono::milliseconds busy, uint64_t steps, Clock::time_point now);

 private:
  std::chrono::milliseconds idle_after_;
  bool seen_ = false;
  uint64_t last_steps_ = 0;
  Clock::time_point last_active_{};
  bool dirty_ = false;  // steps ran since the last trim
};

struct HeapTrimResult {
  uint64_t rss_before = 0;  // bytes resident before and after
  uint64_t rss_after = 0;
};

// malloc_trim(0) (where the C library has it), with this process's RSS around it.
HeapTrimResult trim_heap();

}  // namespace tessera
