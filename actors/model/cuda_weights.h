// One rank's weights on its GPU: the shards of its LayerPlan (bound on the host by
// weights.h), converted to the run dtype (on the GPU, cuda::convert: bit for bit what
// common/tensor.h's conversions give) and uploaded into one allocation through pinned
// double-buffered staging. q|k|v (and their biases) and gate|up are stacked along the output
// dimension so each is one GEMM; lm_head's vocabulary slice is zero-padded to the plan's
// vocab_shard rows so every tensor-parallel rank computes the same number of logit columns.
// An int4 checkpoint's (AWQ, 4-bit GPTQ) linear layers are uploaded as stored, repacked on the
// GPU for the W4A16 kernels (kernels/cuda/quant_gemm.h) and stacked the same way: the kernels'
// layout is a sequence of 64-output units, so q's, k's and v's follow one another.
// An FP8 checkpoint's linear layers are uploaded as stored (E4M3 [out, in]) with one fp32 weight
// scale per output (a per-tensor scale repeated: q | k | v with three tensor scales stack into one
// layer); --quantization fp8 on a plain checkpoint quantizes each linear on the GPU at load
// (cuda::quantize_fp8_weight, bit for bit quantize_fp8), as vLLM's online FP8 does.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "actors/model/weights.h"
#include "common/checkpoint/layer_plan.h"
#include "common/checkpoint/model_config.h"
#include "kernels/cuda/cuda_util.h"
#include "kernels/cuda/fp8_linear.h"
#include "kernels/cuda/quant_gemm.h"

namespace tessera {

// A linear layer on the GPU: a plain [out, in] weight in the run dtype (a cuBLASLt GEMM), an
// int4 layer repacked for the W4A16 kernels, or an FP8 W8A8 layer (cuda::Fp8Gemm; its input
// quantized per token, or with fp8.input_scale: the largest of its stacked parts' static scales).
struct CudaLinear {
  const void* w = nullptr;
  cuda::W4Layer w4;
  cuda::Fp8Layer fp8;
  bool int4() const { return w4.qweight != nullptr; }
  bool is_fp8() const { return fp8.w != nullptr; }
};

// A layer's device tensors (null when absent). Shapes are this rank's.
struct CudaLayer {
  const void* input_norm = nullptr;  // [hidden]
  const void* post_norm = nullptr;   // [hidden]
  // Gemma (ModelConfig::sandwich_norms): pre_feedforward_layernorm (the MLP's input norm, while
  // post_norm is post_attention_layernorm, on the attention output) and
  // post_feedforward_layernorm; null otherwise. Gemma's norm weights (every one, q/k norms too)
  // are the checkpoint's w: the kernels scale by 1 + w (ModelConfig::norm_unit_offset).
  const void* pre_ff_norm = nullptr;   // [hidden] or null
  const void* post_ff_norm = nullptr;  // [hidden] or null
  CudaLinear qkv;                    // [(heads + 2 kv_heads) head_dim, hidden]
  const void* qkv_bias = nullptr;    // [(heads + 2 kv_heads) head_dim] or null
  CudaLinear o;                      // [hidden, heads head_dim]
  const void* o_bias = nullptr;      // [hidden] or null (tp rank 0 only)
  const void* q_norm = nullptr;      // [head_dim] or null
  const void* k_norm = nullptr;      // [head_dim] or null
  CudaLinear gate_up;                // [2 intermediate, hidden]
  CudaLinear down;                   // [hidden, intermediate]
  // A mixture-of-experts layer (router non-null) has these instead of gate_up / down (plain
  // weights: MoE checkpoints run unquantized); the experts are LayerPlan::expert_begin onwards.
  const void* router = nullptr;              // [num_experts, hidden]
  const void* experts_gate_up = nullptr;     // [experts][2 moe_intermediate][hidden]: gate | up
  const void* experts_down = nullptr;        // [experts][hidden][moe_intermediate]
  const void* shared_gate_up = nullptr;      // [2 shared_intermediate, hidden] or null (Qwen2-MoE)
  const void* shared_down = nullptr;         // [hidden, shared_intermediate]
  const void* shared_expert_gate = nullptr;  // [hidden] (with the shared expert)
  bool moe() const { return router != nullptr; }
};

class CudaWeights {
 public:
  // Uploads `host` (the plan's shards) converted to `dtype` (kBF16 or kF16) on `stream`.
  // `quant` (resolve_quantization's: the checkpoint's, or online FP8) says how the linear layers
  // are stored and run; those it quantizes in AWQ or 4-bit GPTQ are repacked, FP8 ones uploaded
  // or quantized at load (INVALID_ARGUMENT naming the layer for a shape the kernels cannot take,
  // or a missing / bad tensor).
  static Expected<std::unique_ptr<CudaWeights>> upload(const ModelConfig& config,
                                                       const LayerPlan& plan,
                                                       const ModelWeights& host,
                                                       const QuantConfig& quant, DType dtype,
                                                       cudaStream_t stream);

  // Bytes the upload will take (for the memory check before anything is allocated): the
  // weights (FP8 layers: a byte per weight and 4 per output's scale) and, with online FP8, the
  // device scratch one plain layer crosses in before it is quantized.
  // Errors: an int4 or FP8 layer the kernels cannot take (its shape, or parts stored
  // differently).
  static Expected<uint64_t> bytes_needed(const ModelConfig& config, const LayerPlan& plan,
                                         const QuantConfig& quant, DType dtype);

  // Device memory upload() takes besides the weights while it runs, freed before it returns:
  // two 64 MiB chunks that a tensor stored in another dtype than the run's crosses in before
  // the GPU converts it into place (allocated only when some tensor needs it).
  static constexpr uint64_t kConvertStagingBytes = 2 * (64ull << 20);

  // The workspace the int4 layers need for steps of up to `max_m` tokens (0: none is int4).
  uint64_t w4_workspace_bytes(int64_t max_m) const;

  // Whether some linear layer is FP8 (the model then sizes its FP8 activation workspace).
  bool any_fp8() const { return any_fp8_; }

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
  bool any_fp8_ = false;
};

}  // namespace tessera
