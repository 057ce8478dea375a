// TESSERA_PROFILE_STEPS=N: where a CUDA rank's decode step spends its time, op by op.
//
// With the variable set, every decode step runs eagerly instead of from its CUDA graph, with an
// event after each op of layer_loop.h (and after the sub-ops inside some: the MLP's gate_up and
// activation, Gemma's extra norms, the lm_head GEMM). A spin kernel (kGateNs) holds the stream
// before every kMarksPerGate ops while the host enqueues them, so the GPU runs them back to back
// and the gaps between events are the ops' own times, not the host's launches (one 30 ms gate for
// a whole step was not enough: on the H100 the enqueue of every Gemma 2 9B and Llama-3-70B step
// outlasted it, though the tables moved by under 1%). Every N
// decode steps of one batch size the rank logs a table: each op's microseconds per step summed over
// the layers, its share and calls per step. The figures include what a graph saves (launch gaps are
// gone, but programmatic dependent launch no longer overlaps one kernel's tail with the next one's
// start), so the total is a little above the graph's step time; the sampler, which runs after the
// forward, is not in it. A step where the GPU caught up with the host's enqueue is counted with a
// warning (its times then include the host's launches).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "common/status.h"

namespace tessera {

class StepTimer {
 public:
  static constexpr int64_t kGateNs = 10'000'000;  // 10 ms, and then:
  static constexpr int kMarksPerGate = 64;        // ~300 queue entries, ~1 ms to enqueue

  // Null unless TESSERA_PROFILE_STEPS is a positive number (the steps per report).
  static std::unique_ptr<StepTimer> from_env();
  explicit StepTimer(int64_t steps_per_report) : every_(steps_per_report) {}
  ~StepTimer();
  StepTimer(const StepTimer&) = delete;
  StepTimer& operator=(const StepTimer&) = delete;

  // Starts a step with a gate on `stream`.
  Status begin(cudaStream_t stream);
  // The op named `op` (a string literal) has been enqueued on `stream` since the last mark.
  void mark(const char* op, cudaStream_t stream);
  // Waits for the step, adds its times to the batch size's account, logs every N steps.
  Status end(int64_t batch);

 private:
  struct Account {
    std::map<std::string, double> us;      // per op, summed over steps
    std::map<std::string, int64_t> calls;  // per op, summed over steps
    int64_t steps = 0, late_steps = 0;
  };
  void report(int64_t batch, Account& a) const;

  int64_t every_;
  std::vector<cudaEvent_t> events_;
  std::vector<const char*> labels_;
  size_t used_ = 0;
  void gate(cudaStream_t stream);  // a spin and an event labelled null (not an op)
  int since_gate_ = 0;
  bool late_ = false;  // the GPU caught up with the host's enqueue in this step
  Status error_;
  // What an op that does nothing measures here: an empty kernel between two events, behind a
  // gate (measured once; every op's figure includes it, where a graph's launch costs less).
  Status calibrate(cudaStream_t stream);
  double floor_us_ = -1;
  std::map<int64_t, Account> accounts_;
};

}  // namespace tessera
