// The actor's watchdog tells a long step (its forward pass ticking) from a stuck one (no ticks
// for the step timeout), on a clock the test moves by hand.
#include "actors/step_watchdog.h"

#include <gtest/gtest.h>

namespace tessera {
namespace {

using namespace std::chrono_literals;
using Clock = StepWatchdog::Clock;

// Steps the watchdog every 200 ms as the actor's heartbeat does; the step started at `t0`.
struct Heartbeat {
  StepWatchdog dog{1000ms};
  Clock::time_point t0 = Clock::now();
  Clock::time_point now = t0;
  uint64_t progress = 0;

  Heartbeat() { dog.observe(0ms, progress, now); }  // the thread beats before any step runs

  StepWatchdog::Reading beat(bool busy = true, bool tick = false) {
    now += 200ms;
    if (tick) ++progress;
    auto ran = busy ? std::chrono::duration_cast<std::chrono::milliseconds>(now - t0) : 0ms;
    return dog.observe(ran, progress, now);
  }
};

TEST(StepWatchdogTest, AStepThatKeepsTickingIsLongNotStuck) {
  Heartbeat h;
  int long_reports = 0;
  for (int i = 0; i < 100; ++i) {  // 20 s, twenty times the timeout
    auto r = h.beat(/*busy=*/true, /*tick=*/true);
    EXPECT_FALSE(r.stuck) << "at " << r.busy.count() << " ms";
    EXPECT_LE(r.stalled, 200ms);
    long_reports += r.newly_long ? 1 : 0;
  }
  EXPECT_EQ(long_reports, 1);  // said once per step
}

TEST(StepWatchdogTest, AStepWithoutProgressIsStuckAfterTheTimeout) {
  Heartbeat h;
  for (int i = 0; i < 10; ++i) h.beat(true, true);  // 2 s of progress
  StepWatchdog::Reading r;
  int beats = 0;
  do {
    r = h.beat(true, false);
    ++beats;
    if (r.stuck) break;
    EXPECT_FALSE(r.newly_stuck);
  } while (beats < 100);
  EXPECT_TRUE(r.stuck);
  EXPECT_TRUE(r.newly_stuck);
  EXPECT_EQ(beats, 6);  // stalled 1200 ms > 1000 ms at the sixth silent beat
  EXPECT_GT(r.stalled, 1000ms);
  EXPECT_LT(r.stalled, r.busy);
  auto again = h.beat(true, false);
  EXPECT_TRUE(again.stuck);
  EXPECT_FALSE(again.newly_stuck);  // said once
  // Progress again (a peer that came back): no longer stuck.
  EXPECT_FALSE(h.beat(true, true).stuck);
}

// A backend that does not tick (the cuda backend) is judged by the step's length, as before.
TEST(StepWatchdogTest, WithoutTicksAStepIsJudgedByItsLength) {
  Heartbeat h;
  StepWatchdog::Reading r;
  for (int i = 0; i < 5; ++i) {
    r = h.beat();
    EXPECT_FALSE(r.stuck);
  }
  r = h.beat();  // 1200 ms
  EXPECT_TRUE(r.stuck);
  EXPECT_EQ(r.stalled, r.busy);
}

// Between steps nothing is stuck, however long the count has not moved; a new step's silence
// counts from its own start, not from the last tick of the step before.
TEST(StepWatchdogTest, IdleIsNeverStuckAndANewStepStartsItsOwnClock) {
  Heartbeat h;
  for (int i = 0; i < 50; ++i) {
    auto r = h.beat(/*busy=*/false);
    EXPECT_FALSE(r.stuck);
    EXPECT_EQ(r.stalled, 0ms);
  }
  h.t0 = h.now;  // a step starts
  auto r = h.beat(true, false);
  EXPECT_FALSE(r.stuck);
  EXPECT_EQ(r.stalled, 200ms);
}

TEST(StepWatchdogTest, ZeroTimeoutNeverStops) {
  StepWatchdog dog{0ms};
  auto t = Clock::now();
  auto r = dog.observe(std::chrono::hours(5), 0, t);
  r = dog.observe(std::chrono::hours(6), 0, t + std::chrono::hours(1));
  EXPECT_FALSE(r.stuck);
  EXPECT_FALSE(r.newly_long);
}

}  // namespace
}  // namespace tessera
