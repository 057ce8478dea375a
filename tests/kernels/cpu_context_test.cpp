#include "kernels/cpu/cpu_context.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <mutex>
#include <thread>
#include <vector>

namespace tessera::cpu {
namespace {

// Every index in [0, n) is visited exactly once, for several pool sizes, sizes and grains.
TEST(CpuContextTest, CoversEveryIndexOnce) {
  for (int threads : {1, 2, 3, 8}) {
    CpuContext ctx(threads);
    EXPECT_EQ(ctx.num_threads(), threads);
    for (int64_t n : {0, 1, 7, 64, 1000, 100003}) {
      for (int64_t grain : {1, 3, 1000}) {
        std::vector<std::atomic<int>> hits(static_cast<size_t>(n));
        ctx.parallel_for(n, grain, [&](int64_t b, int64_t e) {
          EXPECT_LE(0, b);
          EXPECT_LT(b, e);
          EXPECT_LE(e, n);
          for (int64_t i = b; i < e; ++i) hits[i].fetch_add(1);
        });
        for (int64_t i = 0; i < n; ++i) {
          ASSERT_EQ(hits[i].load(), 1) << "threads " << threads << " n " << n << " i " << i;
        }
      }
    }
  }
}

TEST(CpuContextTest, DefaultUsesHardwareThreads) {
  CpuContext ctx;
  EXPECT_GE(ctx.num_threads(), 1);
  if (std::thread::hardware_concurrency() > 0) {
    EXPECT_EQ(ctx.num_threads(), static_cast<int>(std::thread::hardware_concurrency()));
  }
}

// The work really is spread: with 4 threads and slow chunks, more than one thread takes part.
TEST(CpuContextTest, UsesSeveralThreads) {
  CpuContext ctx(4);
  std::mutex mu;
  std::vector<std::thread::id> ids;
  ctx.parallel_for(64, [&](int64_t, int64_t) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
    std::lock_guard<std::mutex> lock(mu);
    if (std::find(ids.begin(), ids.end(), std::this_thread::get_id()) == ids.end()) {
      ids.push_back(std::this_thread::get_id());
    }
  });
  EXPECT_GT(ids.size(), 1u);
}

// A parallel_for inside a parallel_for runs inline instead of deadlocking on the busy pool.
TEST(CpuContextTest, NestedCallsRunInline) {
  CpuContext ctx(4);
  std::atomic<int64_t> total{0};
  ctx.parallel_for(16, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      ctx.parallel_for(100, [&](int64_t ib, int64_t ie) { total += ie - ib; });
    }
  });
  EXPECT_EQ(total.load(), 1600);
}

// Several threads sharing one context: each call still covers its range exactly once.
TEST(CpuContextTest, ConcurrentCallers) {
  CpuContext ctx(4);
  std::vector<std::thread> callers;
  std::atomic<int> bad{0};
  for (int c = 0; c < 4; ++c) {
    callers.emplace_back([&] {
      for (int rep = 0; rep < 200; ++rep) {
        std::atomic<int64_t> sum{0};
        ctx.parallel_for(1000, [&](int64_t b, int64_t e) {
          int64_t s = 0;
          for (int64_t i = b; i < e; ++i) s += i;
          sum += s;
        });
        if (sum.load() != 999 * 1000 / 2) ++bad;
      }
    });
  }
  for (std::thread& t : callers) t.join();
  EXPECT_EQ(bad.load(), 0);
}

// Many small jobs back to back (the per-op pattern of a decode step) complete correctly.
TEST(CpuContextTest, ManyJobsInARow) {
  CpuContext ctx(3);
  int64_t total = 0;
  for (int rep = 0; rep < 5000; ++rep) {
    std::atomic<int64_t> sum{0};
    ctx.parallel_for(37, [&](int64_t b, int64_t e) { sum += e - b; });
    total += sum.load();
  }
  EXPECT_EQ(total, 5000 * 37);
}

// Every range a parallel_for runs ticks the context once (the actor's watchdog reads the count
// from another thread), inline or on the pool; a ProgressTicker ticks once per kTickWork.
TEST(CpuContextTest, TicksOncePerRangeAndPerTickerWork) {
  for (int threads : {1, 4}) {
    CpuContext ctx(threads);
    for (int64_t n : {1, 64, 10000}) {
      std::atomic<uint64_t> ranges{0};
      const uint64_t before = ctx.ticks();
      ctx.parallel_for(n, [&](int64_t, int64_t) { ranges.fetch_add(1); });
      EXPECT_EQ(ctx.ticks() - before, ranges.load()) << "threads " << threads << " n " << n;
    }
  }
  CpuContext ctx(1);
  ProgressTicker ticker(ctx);
  const uint64_t before = ctx.ticks();
  for (int i = 0; i < 10; ++i) ticker.done(ProgressTicker::kTickWork / 4);
  EXPECT_EQ(ctx.ticks() - before, 2u);  // at 4/4 and 8/4 of kTickWork
  ticker.done(3 * ProgressTicker::kTickWork);
  EXPECT_EQ(ctx.ticks() - before, 3u);
}

}  // namespace
}  // namespace tessera::cpu
