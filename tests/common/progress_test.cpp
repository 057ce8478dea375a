// The progress display: a bar redrawn on a terminal, a line per tenth (or per 10 s) elsewhere,
// a summary at the end; figures with units, rate and time left.
#include "common/progress.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace tessera {
namespace {

using namespace std::chrono_literals;
constexpr uint64_t kGiB = 1ull << 30;

struct Capture {
  std::vector<std::string> draws, lines;
  Progress::Sinks sinks(bool terminal) {
    Progress::Sinks s;
    if (terminal) s.draw = [this](const std::string& t) { draws.push_back(t); };
    s.line = [this](const std::string& t) { lines.push_back(t); };
    return s;
  }
};

TEST(ProgressTest, LinesAtEachTenthOnANonTerminal) {
  Capture c;
  const auto t0 = Progress::Clock::time_point{};
  Progress p("loading weights", c.sinks(false), t0);
  p.update(0, 0, t0 + 1s);  // total unknown: nothing
  EXPECT_TRUE(c.lines.empty());
  // 1 GiB/s over 10 GiB: a line at the first update and at each tenth crossed, none between.
  for (int i = 1; i <= 20; ++i)
    p.update(i * kGiB / 2, 10 * kGiB, t0 + std::chrono::milliseconds(500 * i));
  ASSERT_EQ(c.lines.size(), 11u);
  EXPECT_EQ(c.lines[0], "loading weights:   5% (512 MiB of 10.0 GiB, 1.00 GiB/s, 10 s left)");
  EXPECT_EQ(c.lines[1], "loading weights:  10% (1.00 GiB of 10.0 GiB, 1.00 GiB/s, 9 s left)");
  EXPECT_EQ(c.lines[5], "loading weights:  50% (5.00 GiB of 10.0 GiB, 1.00 GiB/s, 5 s left)");
  EXPECT_EQ(c.lines[10], "loading weights: 100% (10.0 GiB of 10.0 GiB, 1.00 GiB/s)");
  p.finish(10 * kGiB, "on 1 rank(s)", t0 + 10s);
  ASSERT_EQ(c.lines.size(), 12u);
  EXPECT_EQ(c.lines.back(), "loading weights: 10.0 GiB in 10.0 s (1.00 GiB/s) on 1 rank(s)");
  EXPECT_TRUE(c.draws.empty());
}

TEST(ProgressTest, SlowWorkStillLogsEveryTenSeconds) {
  Capture c;
  const auto t0 = Progress::Clock::time_point{};
  Progress p("writing", c.sinks(false), t0);
  p.update(1, 1000 * kGiB, t0 + 1s);  // the first tenth (0) logs at once
  p.update(2, 1000 * kGiB, t0 + 5s);
  p.update(3, 1000 * kGiB, t0 + 11s);
  p.update(4, 1000 * kGiB, t0 + 12s);
  p.update(5, 1000 * kGiB, t0 + 22s);
  EXPECT_EQ(c.lines.size(), 3u);
}

TEST(ProgressTest, BarOnATerminalIsClearedBeforeTheSummary) {
  Capture c;
  const auto t0 = Progress::Clock::time_point{};
  {
    Progress p("loading weights", c.sinks(true), t0);
    p.update(3 * kGiB, 12 * kGiB, t0 + 2s);
    ASSERT_EQ(c.draws.size(), 1u);
    EXPECT_EQ(c.draws[0],
              "loading weights [#######                       ]  25%  3.00 GiB of 12.0 GiB, "
              "1.50 GiB/s, 6 s left");
    EXPECT_TRUE(c.lines.empty());  // the bar replaces the lines
    p.finish(12 * kGiB, {}, t0 + 8s);
    ASSERT_EQ(c.draws.size(), 2u);
    EXPECT_EQ(c.draws[1], "");  // cleared
    ASSERT_EQ(c.lines.size(), 1u);
    EXPECT_EQ(c.lines[0], "loading weights: 12.0 GiB in 8.0 s (1.50 GiB/s)");
    p.update(12 * kGiB, 12 * kGiB, t0 + 9s);  // after finish: nothing
  }
  EXPECT_EQ(c.draws.size(), 2u);
}

TEST(ProgressTest, Units) {
  EXPECT_EQ(Progress::bytes(17), "17 B");
  EXPECT_EQ(Progress::bytes(3 * 1024), "3.00 KiB");
  EXPECT_EQ(Progress::bytes(512.0 * 1024 * 1024), "512 MiB");
  EXPECT_EQ(Progress::bytes(14.96 * kGiB), "15.0 GiB");
  EXPECT_EQ(Progress::bytes(1.5 * 1024 * kGiB), "1.50 TiB");
  EXPECT_EQ(Progress::duration(3.4), "3 s");
  EXPECT_EQ(Progress::duration(125), "2 min 05 s");
  EXPECT_EQ(Progress::duration(3720), "1 h 02 min");
}

}  // namespace
}  // namespace tessera
