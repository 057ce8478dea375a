// One rank's weights on its GPU: the shards of its LayerPlan (bound on the host by
// weights.h), converted to the run dtype and uploaded into one allocation through pinned
// double-buffered staging. q|k|v (and their biases) and gate|up are stacked along the output
// dimension so each is one GEMM; lm_head's vocabulary slice is zero-padded to the plan's
// vocab_shard rows so every tensor-parallel rank computes the same number of logit columns.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "actors/model/weights.h"
#include "common/checkpoint/layer_plan.h"
#include "common/checkpoint/model_config.h"
#include "kernels/cuda/cuda_util.h"

namespace tessera {

// A layer's device tensors (null when absent). Shapes are this rank's.
struct CudaLayer {
  const void* input_norm = nullptr;  // [hidden]
  const void* post_norm = nullptr;   // [hidden]
  const void* qkv = nullptr;         // [(heads + 2 kv_heads) head_dim, hidden]
  const void* qkv_bias = nullptr;    // [(heads + 2 kv_heads) head_dim] or null
  const void* o = nullptr;           // [hidden, heads head_dim]
  const void* o_bias = nullptr;      // [hidden] or null (tp rank 0 only)
  const void* q_norm = nullptr;      // [head_dim] or null
  const void* k_norm = nullptr;      // [head_dim] or null
  const void* gate_up = nullptr;     // [2 intermediate, hidden]
  const void* down = nullptr;        // [hidden, intermediate]
};

class CudaWeights {
 public:
  // Uploads `host` (the plan's shards) converted to `dtype` (kBF16 or kF16) on `stream`.
  static Expected<std::unique_ptr<CudaWeights>> upload(const ModelConfig& config,
                                                       const LayerPlan& plan,
                                                       const ModelWeights& host, DType dtype,
                                                       cudaStream_t stream);

  // Bytes the upload will take (for the memory check before anything is allocated).
  static uint64_t bytes_needed(const ModelConfig& config, const LayerPlan& plan, DType dtype);

  const CudaLayer& layer(int64_t i) const { return layers_[static_cast<size_t>(i)]; }
  const void* embed() const { return embed_; }            // [vocab_rows, hidden], first stage
  const void* final_norm() const { return final_norm_; }  // [hidden], last stage
  const void* lm_head() const { return lm_head_; }        // [vocab_shard, hidden], last stage
  uint64_t bytes() const { return storage_.bytes(); }

 private:
  CudaWeights() = default;
  cuda::DeviceBuffer storage_;
  std::vector<CudaLayer> layers_;
  const void* embed_ = nullptr;
  const void* final_norm_ = nullptr;
  const void* lm_head_ = nullptr;
};

}  // namespace tessera
