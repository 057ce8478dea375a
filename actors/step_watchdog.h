// Tells a stuck step from a long one, for the actor's heartbeat (actor_main.cpp). A step is
// stuck when its forward pass has made no progress (the backend's progress count has not moved,
// Backend::progress) for the step timeout, however long the step has run in all: a 100k-token
// prefill that takes minutes but keeps ticking is long, not stuck; a hung collective, a deadlock
// or a peer that stopped is stuck. A stopped process (SIGSTOP) beats no heartbeat at all.
#pragma once

#include <chrono>
#include <cstdint>

namespace tessera {

class StepWatchdog {
 public:
  using Clock = std::chrono::steady_clock;

  // timeout: how long a step may go without progress (0 = never stuck).
  explicit StepWatchdog(std::chrono::milliseconds timeout) : timeout_(timeout) {}

  struct Reading {
    std::chrono::milliseconds busy{0};     // how long the step now running has run (0: none)
    std::chrono::milliseconds stalled{0};  // how long it has gone without progress (<= busy)
    bool stuck = false;                    // stalled past the timeout: stop the heartbeat
    bool newly_stuck = false;              // stuck now and not at the reading before
    bool newly_long = false;  // this step has just run past the timeout, still making progress
  };

  // Called every heartbeat period from one thread. `busy`: how long the step now running has
  // run (0 when none runs); `progress`: the backend's count now; `now`: the steady clock. The
  // count is seen to move only at these calls, so `stalled` can be up to one period short.
  Reading observe(std::chrono::milliseconds busy, uint64_t progress, Clock::time_point now);

 private:
  std::chrono::milliseconds timeout_;
  bool seen_ = false;
  uint64_t last_progress_ = 0;
  Clock::time_point last_moved_{};
  std::chrono::milliseconds last_busy_{0};
  bool stuck_ = false;
  bool long_ = false;  // the running step has been reported as long
};

}  // namespace tessera
