// The actor's model: one rank's shard of the checkpoint on one backend ("cpu": fp32 reference
// math; "cuda": bf16/fp16 on one GPU with CUDA graphs), the live requests (requests.h) and the
// step loop: apply the step to the request table, run the backend over the batch, hand back the
// samples. Loading is two-phase so every rank of a group ends with the same KV cache: load()
// binds the shard and reports how many KV blocks fit; init_cache() allocates the fewest any rank
// fits.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "actors/model/backend.h"
#include "actors/model/requests.h"
#include "actors/model/weights.h"
#include "common/checkpoint/layer_plan.h"
#include "common/checkpoint/model_config.h"
#include "common/kv_cache_dtype.h"
#include "common/checkpoint/safetensors.h"
#include "common/load_spec.h"
#include "common/step.h"

namespace tessera {

class ModelRunner {
 public:
  // Loads this rank's shard (spec.parallel) on the backend spec.device names (auto: cuda when
  // this process sees a GPU and was built with CUDA, else cpu). `comms` are the rank's joined
  // groups. Errors name the tensor/file at fault, or the memory figures and the flags that
  // would make the model fit.
  static Expected<std::unique_ptr<ModelRunner>> load(const LoadSpec& spec, StageComms comms);

  // Allocates the KV cache with `blocks` KV blocks (<= info().kv_blocks after load).
  Status init_cache(int64_t blocks);

  // Runs one step. A malformed step is refused before anything of it is applied; a failure in
  // the forward pass (a peer gone, a CUDA error) leaves its requests unusable: the driver fails
  // them.
  Expected<StepOutput> execute(const StepInput& step);

  ModelInfo info() const;
  const ModelConfig& config() const { return config_; }
  const LayerPlan& plan() const { return plan_; }
  size_t live_requests() const { return requests_.size(); }
  // This rank samples (the last stage's tensor-parallel rank 0).
  bool samples() const { return plan_.last_stage && plan_.parallel.tp_rank == 0; }
  uint32_t last_gpu_micros() const { return backend_->last_gpu_micros(); }

 private:
  ModelRunner(ModelConfig config, LayerPlan plan, RequestLimits limits);

  ModelConfig config_;
  LayerPlan plan_;
  RequestTable requests_;
  std::unique_ptr<Checkpoint> checkpoint_;  // the weights' storage (mmap); outlives backend_
  std::unique_ptr<Backend> backend_;
  bool return_logits_ = false;
  bool cache_ready_ = false;
};

// resolve_dtype, resolve_max_model_len, resolve_max_num_batched_tokens: common/checkpoint/
// layer_plan.h (the planner sizes ranks with the same rules).

#ifdef TESSERA_WITH_CUDA
// Defined by the cuda backend (actors/model/cuda_backend.cpp).
struct CudaLoad {
  const ModelConfig* config = nullptr;
  const LayerPlan* plan = nullptr;
  const ModelWeights* weights = nullptr;
  StageComms comms;
  DType dtype = DType::kBF16;
  KvCacheDtype kv_cache_dtype = KvCacheDtype::kAuto;
  int64_t max_model_len = 0;
  int64_t max_num_batched_tokens = 0;
};
Expected<std::unique_ptr<Backend>> load_cuda_backend(const LoadSpec& spec, const CudaLoad& load);
bool cuda_device_visible();
#endif

}  // namespace tessera
