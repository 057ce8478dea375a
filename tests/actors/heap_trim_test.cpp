// The actor trims its heap once per idle period that follows steps, never while steps run.
#include "actors/heap_trim.h"

#include <gtest/gtest.h>

#include <vector>

namespace tessera {
namespace {

using namespace std::chrono_literals;
using Clock = HeapTrimSchedule::Clock;

TEST(HeapTrimTest, OncePerIdlePeriodAfterSteps) {
  HeapTrimSchedule s{2s};
  auto now = Clock::now();
  uint64_t steps = 0;
  auto tick = [&](std::chrono::milliseconds busy) {
    now += 200ms;
    return s.due(busy, steps, now);
  };
  // Idle from the start: nothing to give back.
  for (int i = 0; i < 30; ++i) EXPECT_FALSE(tick(0ms));
  // Steps run (a long one, then short ones that finish between two readings).
  for (int i = 0; i < 10; ++i) EXPECT_FALSE(tick(std::chrono::milliseconds(200 * (i + 1))));
  for (int i = 0; i < 10; ++i) {
    ++steps;
    EXPECT_FALSE(tick(0ms));
  }
  // Idle: due once, 2 s after the last step.
  int trims = 0, at = -1;
  for (int i = 0; i < 50; ++i) {
    if (tick(0ms)) {
      ++trims;
      at = i;
    }
  }
  EXPECT_EQ(trims, 1);
  EXPECT_EQ(at, 9);  // the tenth idle reading is 2 s after the last step
  // More steps, another idle period: once more.
  ++steps;
  EXPECT_FALSE(tick(0ms));
  trims = 0;
  for (int i = 0; i < 50; ++i) trims += tick(0ms) ? 1 : 0;
  EXPECT_EQ(trims, 1);
}

TEST(HeapTrimTest, TrimReportsResidentMemory) {
  {
    std::vector<std::vector<char>> blocks;  // freed before the trim
    for (int i = 0; i < 64; ++i) blocks.emplace_back(1 << 16, 'x');
  }
  HeapTrimResult r = trim_heap();
  EXPECT_GT(r.rss_before, 0u);
  EXPECT_GT(r.rss_after, 0u);
}

}  // namespace
}  // namespace tessera
