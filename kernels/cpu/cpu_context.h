// The execution context of the CPU reference ops: a small thread pool, owned by whoever runs the
// model (the CPU backend of an actor, a test) and passed by reference to every op that can use
// it. There is no global pool.
//
// Ops call parallel_for only when the work is large enough to pay for waking the workers (see
// each op); small ops run inline on the calling thread, so tiny models stay fast.
//
// The context also counts progress for a watchdog on another thread (the actor's heartbeat
// tells a long step from a stuck one by it): every parallel_for ticks once per range it runs,
// and ops whose single ranges can be long (attention over a long context, a linear over many
// tokens) tick inside them through a ProgressTicker, so ticks come well under a second apart
// while the ops run.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

namespace tessera::cpu {

class CpuContext {
 public:
  // threads: total threads that run a parallel_for, the calling thread included (it works too,
  // so `threads - 1` workers are started). 0 = std::thread::hardware_concurrency().
  explicit CpuContext(int threads = 0);
  ~CpuContext();
  CpuContext(const CpuContext&) = delete;
  CpuContext& operator=(const CpuContext&) = delete;

  int num_threads() const { return num_threads_; }

  // One more unit of progress. Any thread; a relaxed add (it orders nothing), cheap enough for
  // every range of a parallel_for and every few milliseconds of work inside one.
  void tick() { ticks_.fetch_add(1, std::memory_order_relaxed); }
  // Ticks so far (monotonic). Any thread: a watchdog samples it and calls the work stuck when it
  // stops moving.
  uint64_t ticks() const { return ticks_.load(std::memory_order_relaxed); }

  // Calls fn(begin, end) on disjoint ranges that together cover [0, n) exactly once, spread
  // over the pool and the calling thread, and returns when all calls have returned. Ranges hold
  // at least `grain` items (except possibly the last). Runs inline (a single fn(0, n)) when
  // n <= grain, when the pool has one thread, when called from inside another parallel_for of
  // this context, or while another thread is running one (so nesting and concurrent callers
  // never deadlock). fn must not throw.
  template <typename Fn>
  void parallel_for(int64_t n, int64_t grain, Fn&& fn) {
    if (n <= 0) return;
    if (grain < 1) grain = 1;
    if (n <= grain || num_threads_ <= 1) {
      fn(int64_t{0}, n);
      tick();
      return;
    }
    using F = std::remove_reference_t<Fn>;
    run(n, grain,
        RangeFn{const_cast<void*>(static_cast<const void*>(&fn)),
                [](void* obj, int64_t b, int64_t e) { (*static_cast<F*>(obj))(b, e); }});
  }
  // Same with grain 1 (each index is worth a task: rows of a big matrix, say).
  template <typename Fn>
  void parallel_for(int64_t n, Fn&& fn) {
    parallel_for(n, 1, std::forward<Fn>(fn));
  }

 private:
  // A non-owning, non-allocating reference to the caller's callable.
  struct RangeFn {
    void* obj;
    void (*call)(void*, int64_t, int64_t);
  };
  struct Job;

  void run(int64_t n, int64_t grain, RangeFn fn);
  void worker_loop();
  void run_chunks(Job& job);

  const int num_threads_;
  alignas(64) std::atomic<uint64_t> ticks_{0};  // a line of its own: every thread adds to it
  std::vector<std::thread> workers_;
  // One parallel_for at a time uses the workers; others (nested or concurrent) run inline.
  std::mutex dispatch_mu_;
  // mu_ guards generation_, job_, active_ and stop_.
  std::mutex mu_;
  std::condition_variable work_cv_;  // workers wait here for a new generation or stop_
  std::condition_variable done_cv_;  // the dispatcher waits here for active_ == 0
  uint64_t generation_ = 0;          // bumped for every job handed to the workers
  Job* job_ = nullptr;               // the job being run; null once the dispatcher stops sharing it
  int active_ = 0;                   // workers currently running chunks of job_
  bool stop_ = false;
};

// Ticks a context once per kTickWork units of work done on one thread (a unit is about one
// multiply-add), so a loop of many small items ticks every few milliseconds instead of paying a
// shared atomic add per item. One per thread: declare it inside the parallel_for body.
class ProgressTicker {
 public:
  static constexpr int64_t kTickWork = int64_t{1} << 22;

  explicit ProgressTicker(CpuContext& ctx) : ctx_(ctx) {}
  void done(int64_t work) {
    pending_ += work;
    if (pending_ >= kTickWork) {
      ctx_.tick();
      pending_ = 0;
    }
  }

 private:
  CpuContext& ctx_;
  int64_t pending_ = 0;
};

}  // namespace tessera::cpu
