// The actor's model: one rank's shard of the checkpoint on one backend ("cpu": fp32 reference
// math; "cuda": bf16/fp16 on one GPU with CUDA graphs), the live requests (requests.h) and the
// step loop: apply the step to the request table, run the backend over the batch, hand back the
// samples. Loading is two-phase so every rank of a group ends with the same KV cache: load()
// binds the shard and reports how many KV blocks fit; init_cache() allocates the fewest any rank
// fits.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <unordered_map>

#include "actors/model/backend.h"
#include "actors/model/requests.h"
#include "actors/model/weights.h"
#include "common/checkpoint/layer_plan.h"
#include "common/checkpoint/model_config.h"
#include "common/checkpoint/safetensors.h"
#include "common/kv_cache_dtype.h"
#include "common/load_spec.h"
#include "common/step.h"

namespace tessera {

class ModelRunner {
 public:
  // Loads this rank's shard (spec.parallel) on the backend the resolved spec.engine names
  // (check_resolved: an unresolved spec is refused). `comms` are the rank's joined
  // groups. Errors name the tensor/file at fault, or the memory figures and the flags that
  // would make the model fit.
  static Expected<std::unique_ptr<ModelRunner>> load(const LoadSpec& spec, StageComms comms);

  // Allocates the KV cache with `blocks` KV blocks (<= info().kv_blocks after load).
  Status init_cache(int64_t blocks);

  // Runs one step (nothing else running): submit() then collect(). A malformed step is refused
  // before anything of it is applied; a failure in the forward pass (a peer gone, a CUDA error)
  // leaves its requests unusable: the driver fails them.
  Expected<StepOutput> execute(const StepInput& step);

  // Async scheduling: the step after the one running is launched before that one is collected,
  // so the backend starts it as soon as the device is free, and a decoding request's next token
  // (kSampledToken) is filled in on the device from the running step's sample.
  //
  // Applies the step and launches it; collect() hands back its output (or its error) after
  // those of the steps submitted before. With a step running, submit only a step for which
  // can_launch_ahead() holds (else collect first).
  void submit(const StepInput& step);
  // The output of the oldest step submitted and not collected (waits for the device).
  Expected<StepOutput> collect();
  // Steps submitted and not collected.
  size_t running() const { return running_.size(); }
  // The step id of the oldest of them (0 if none).
  uint64_t oldest_step_id() const { return running_.empty() ? 0 : running_.front().step_id; }
  // The oldest running step has finished on the device: collect() would not wait.
  bool ready() const;
  // `step` may be launched while the one running is not collected: one step runs, no logits
  // are returned, and the step's requests that the running one samples only take its sample
  // (kSampledToken) without a penalty on (the penalties read the history on the host).
  bool can_launch_ahead(const StepInput& step) const;

  ModelInfo info() const;
  const ModelConfig& config() const { return config_; }
  const LayerPlan& plan() const { return plan_; }
  size_t live_requests() const { return requests_.size(); }
  // This rank samples (the last stage's tensor-parallel rank 0).
  bool samples() const { return plan_.last_stage && plan_.parallel.tp_rank == 0; }
  uint32_t last_gpu_micros() const { return backend_->last_gpu_micros(); }
  // The backend's progress count (Backend::progress): any thread, while this runner lives.
  uint64_t progress() const { return backend_->progress(); }
  // The routings this rank counted in its MoE layers (Backend::expert_load). Any thread.
  ExpertLoad expert_load() const { return backend_->expert_load(); }

 private:
  ModelRunner(ModelConfig config, LayerPlan plan, ModelInfo limits);
  // A step submitted and not collected.
  struct Running {
    uint64_t step_id = 0;
    Status error;                // refused or failed to launch: its output is this
    bool launched = false;       // the backend has a launch of it to collect
    std::vector<uint64_t> rows;  // the requests it samples, in row order (the sampling rank)
    std::chrono::steady_clock::time_point submitted;
  };
  Status launch(const StepInput& step, Running& r);

  ModelConfig config_;
  LayerPlan plan_;
  RequestTable requests_;
  std::unique_ptr<Checkpoint> checkpoint_;  // the weights' storage (mmap); outlives backend_
  std::unique_ptr<Backend> backend_;
  bool return_logits_ = false;
  bool cache_ready_ = false;
  std::deque<Running> running_;
  // The rows of the last launch, by request: where a kSampledToken of the next one comes from.
  std::unordered_map<uint64_t, size_t> last_rows_;
  std::chrono::steady_clock::time_point last_collected_{};
};

#ifdef TESSERA_WITH_CUDA
// Defined by the cuda backend (actors/model/cuda_backend.cpp): this rank's shard of `config`
// as `plan` splits it, uploaded from `weights`, run as spec.engine says.
Expected<std::unique_ptr<Backend>> load_cuda_backend(const LoadSpec& spec, const ModelConfig& config,
                                                     const LayerPlan& plan,
                                                     const ModelWeights& weights, StageComms comms);
bool cuda_device_visible();
#endif

}  // namespace tessera
