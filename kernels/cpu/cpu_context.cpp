#include "kernels/cpu/cpu_context.h"

#include <algorithm>
#include <atomic>

namespace tessera::cpu {

// One parallel_for: chunks [i*chunk, min(n, (i+1)*chunk)) claimed through `next`.
struct CpuContext::Job {
  RangeFn fn;
  int64_t n = 0;
  int64_t chunk = 1;
  int64_t num_chunks = 0;
  std::atomic<int64_t> next{0};
};

CpuContext::CpuContext(int threads)
    : num_threads_(threads > 0
                       ? threads
                       : std::max(1, static_cast<int>(std::thread::hardware_concurrency()))) {
  workers_.reserve(num_threads_ - 1);
  for (int i = 1; i < num_threads_; ++i) workers_.emplace_back([this] { worker_loop(); });
}

CpuContext::~CpuContext() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  work_cv_.notify_all();
  for (std::thread& t : workers_) t.join();
}

void CpuContext::run_chunks(Job& job) {
  for (;;) {
    const int64_t i = job.next.fetch_add(1, std::memory_order_relaxed);
    if (i >= job.num_chunks) return;
    const int64_t begin = i * job.chunk;
    job.fn.call(job.fn.obj, begin, std::min(job.n, begin + job.chunk));
    tick();
  }
}

void CpuContext::run(int64_t n, int64_t grain, RangeFn fn) {
  std::unique_lock<std::mutex> dispatch(dispatch_mu_, std::try_to_lock);
  if (!dispatch.owns_lock()) {  // nested or concurrent: the workers are busy, run here
    fn.call(fn.obj, 0, n);
    tick();
    return;
  }
  Job job;
  job.fn = fn;
  job.n = n;
  // About four chunks per thread balances uneven work without much claiming overhead.
  const int64_t target_chunks = int64_t{4} * num_threads_;
  job.chunk = std::max(grain, (n + target_chunks - 1) / target_chunks);
  job.num_chunks = (n + job.chunk - 1) / job.chunk;
  {
    std::lock_guard<std::mutex> lock(mu_);
    job_ = &job;
    ++generation_;
  }
  work_cv_.notify_all();
  run_chunks(job);
  // Every chunk is claimed now. Stop sharing the job (it lives on this stack) and wait for the
  // workers that joined it to finish the chunks they claimed.
  std::unique_lock<std::mutex> lock(mu_);
  job_ = nullptr;
  done_cv_.wait(lock, [this] { return active_ == 0; });
}

void CpuContext::worker_loop() {
  uint64_t seen = 0;
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    work_cv_.wait(lock, [&] { return stop_ || generation_ != seen; });
    if (stop_) return;
    seen = generation_;
    Job* job = job_;
    if (job == nullptr) continue;  // woke after the dispatcher finished alone
    ++active_;
    lock.unlock();
    run_chunks(*job);
    lock.lock();
    if (--active_ == 0) done_cv_.notify_all();
  }
}

}  // namespace tessera::cpu
