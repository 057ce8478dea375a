// The execution context of the CPU reference ops: a small thread pool, owned by whoever runs the
// model (the CPU backend of an actor, a test) and passed by reference to every op that can use
// it. There is no global pool.
//
// Ops call parallel_for only when the work is large enough to pay for waking the workers (see
// each op); small ops run inline on the calling thread, so tiny models stay fast.
#pragma once

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
  static void run_chunks(Job& job);

  const int num_threads_;
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

}  // namespace tessera::cpu
