#include "actors/step_watchdog.h"

#include <algorithm>

namespace tessera {

StepWatchdog::Reading StepWatchdog::observe(std::chrono::milliseconds busy, uint64_t progress,
                                            Clock::time_point now) {
  if (!seen_ || progress != last_progress_) {
    seen_ = true;
    last_progress_ = progress;
    last_moved_ = now;
  }
  // A new step started since the reading before (none runs, or this one has run less time than
  // the last one had): it has not been reported as long yet.
  if (busy.count() <= 0 || busy < last_busy_) long_ = false;
  last_busy_ = busy;

  Reading r;
  r.busy = std::max(busy, std::chrono::milliseconds(0));
  if (r.busy.count() > 0) {
    r.stalled =
        std::min(r.busy, std::chrono::duration_cast<std::chrono::milliseconds>(now - last_moved_));
  }
  const bool limited = timeout_.count() > 0;
  r.stuck = limited && r.stalled > timeout_;
  r.newly_stuck = r.stuck && !stuck_;
  stuck_ = r.stuck;
  if (limited && !r.stuck && r.busy > timeout_ && !long_) {
    r.newly_long = true;
    long_ = true;
  }
  return r;
}

}  // namespace tessera
