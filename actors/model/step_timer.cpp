#include "actors/model/step_timer.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstdlib>
#include <utility>

#include "kernels/cuda/cuda_util.h"
#include "kernels/cuda/elementwise.h"

namespace tessera {

std::unique_ptr<StepTimer> StepTimer::from_env() {
  const char* v = std::getenv("TESSERA_PROFILE_STEPS");
  if (v == nullptr) return nullptr;
  char* end = nullptr;
  const long long n = std::strtoll(v, &end, 10);
  if (end == v || *end != '\0' || n <= 0) {
    spdlog::warn("TESSERA_PROFILE_STEPS={} is not a positive number of steps; not profiling", v);
    return nullptr;
  }
  spdlog::info(
      "TESSERA_PROFILE_STEPS={}: decode steps run eagerly with an event after each op (not from "
      "their CUDA graphs, so slower); a table of op times every {} steps of a batch size",
      n, n);
  return std::make_unique<StepTimer>(n);
}

StepTimer::~StepTimer() {
  for (cudaEvent_t e : events_) cudaEventDestroy(e);
}

Status StepTimer::calibrate(cudaStream_t stream) {
  constexpr int kOps = 32;
  used_ = 0;
  error_ = Status::ok();
  gate(stream);
  for (int i = 0; i < kOps; ++i) {
    TESSERA_RETURN_IF_ERROR(cuda::spin(0, stream));
    mark("(empty)", stream);
  }
  TESSERA_RETURN_IF_ERROR(error_);
  TESSERA_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(events_[used_ - 1]), "calibrating");
  float ms = 0.f;
  TESSERA_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&ms, events_[0], events_[used_ - 1]),
                               "calibrating");
  floor_us_ = 1000.0 * ms / kOps;
  return Status::ok();
}

Status StepTimer::begin(cudaStream_t stream) {
  if (floor_us_ < 0) TESSERA_RETURN_IF_ERROR(calibrate(stream));
  used_ = 0;
  since_gate_ = 0;
  late_ = false;
  error_ = Status::ok();
  gate(stream);
  return error_;
}

void StepTimer::gate(cudaStream_t stream) {
  // Done already, just after the host enqueued it: the GPU was waiting for the host.
  if (used_ > 0 && cudaEventQuery(events_[used_ - 1]) == cudaSuccess) late_ = true;
  if (Status s = cuda::spin(kGateNs, stream); !s) {
    error_ = s;
    return;
  }
  mark(nullptr, stream);
  since_gate_ = 0;
}

void StepTimer::mark(const char* op, cudaStream_t stream) {
  if (!error_.is_ok()) return;
  if (used_ == events_.size()) {
    cudaEvent_t e = nullptr;
    if (cudaEventCreate(&e) != cudaSuccess) {
      error_ = internal_error("StepTimer: cudaEventCreate failed");
      return;
    }
    events_.push_back(e);
    labels_.push_back(nullptr);
  }
  if (cudaEventRecord(events_[used_], stream) != cudaSuccess) {
    error_ = internal_error(std::string("StepTimer: recording the event after ") +
                            (op != nullptr ? op : "a gate"));
    return;
  }
  labels_[used_++] = op;
  if (op != nullptr && ++since_gate_ == kMarksPerGate) gate(stream);
}

Status StepTimer::end(int64_t batch) {
  TESSERA_RETURN_IF_ERROR(error_);
  if (used_ < 2) return Status::ok();
  if (cudaEventQuery(events_[used_ - 1]) == cudaSuccess) late_ = true;
  TESSERA_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(events_[used_ - 1]), "a profiled step");
  Account& a = accounts_[batch];
  for (size_t i = 1; i < used_; ++i) {
    if (labels_[i] == nullptr) continue;  // a gate's spin: not an op
    float ms = 0.f;
    TESSERA_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&ms, events_[i - 1], events_[i]),
                                 "a profiled op");
    a.us[labels_[i]] += 1000.0 * ms;
    ++a.calls[labels_[i]];
  }
  ++a.steps;
  if (late_) ++a.late_steps;
  if (a.steps >= every_) {
    report(batch, a);
    a = Account{};
  }
  return Status::ok();
}

void StepTimer::report(int64_t batch, Account& a) const {
  double total = 0;
  std::vector<std::pair<double, std::string>> rows;
  for (const auto& [op, us] : a.us) {
    total += us;
    rows.emplace_back(us, op);
  }
  std::sort(rows.rbegin(), rows.rend());
  const double n = static_cast<double>(a.steps);
  spdlog::info(
      "decode profile, batch {}, {} steps: the forward's ops take {:.1f} us per step (an empty "
      "kernel measures {:.2f} us this way: the floor of each op's figure)",
      batch, a.steps, total / n, floor_us_);
  for (const auto& [us, op] : rows) {
    spdlog::info("  {:<22} {:9.1f} us/step {:5.1f}%  {:4.0f} calls/step", op, us / n,
                 100.0 * us / total, static_cast<double>(a.calls.at(op)) / n);
  }
  if (a.late_steps > 0) {
    spdlog::warn(
        "decode profile, batch {}: in {} of {} steps the GPU caught up with the host's launches; "
        "their times include launch gaps",
        batch, a.late_steps, a.steps);
  }
}

}  // namespace tessera
