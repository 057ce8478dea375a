// One rank's stage of the forward pass on its GPU (actors/model/layer_loop.h, the same layers as
// CpuModel, its oracle), in bf16/fp16 with fp32 accumulation through kernels/cuda and cuBLASLt,
// with the tensor- and pipeline-parallel collectives on the model's stream. Decode steps replay
// CUDA graphs captured for batch sizes 1, 2, 4, 8, 16, 24, 32, ... up to max_num_seqs (a batch is
// padded to the next captured size; eager mode pads the same way, so outputs are identical with
// and without graphs); the collectives are captured with them.
//
// Memory (vLLM's rule): this rank may use gpu_memory_utilization x the GPU's total memory, and
// the GPU must have that much free when it starts (other processes are not charged to it, but
// they must leave room). Weights first, then fixed activation buffers for
// max_num_batched_tokens, then one profiling step at that size; the KV cache gets what is left
// of the budget, less a reserve for the CUDA graphs.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "actors/model/backend.h"
#include "actors/model/cuda_weights.h"
#include "actors/model/step_timer.h"
#include "actors/model/weights.h"
#include "common/checkpoint/layer_plan.h"
#include "common/checkpoint/model_config.h"
#include "common/kv_cache_dtype.h"
#include "kernels/cuda/attention.h"
#include "kernels/cuda/cuda_util.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/sampling.h"

namespace tessera {

// Where this GPU's memory went, in bytes (logged, and reported to the driver).
struct GpuMemoryReport {
  std::string device_name;
  uint64_t total = 0;
  uint64_t budget = 0;         // gpu_memory_utilization x total / the ranks sharing the GPU
  uint64_t used_at_start = 0;  // by anything before this rank (other processes, its context)
  uint64_t weights = 0;
  uint64_t activations = 0;   // fixed buffers, cuBLASLt workspace, sampler
  uint64_t profile_peak = 0;  // extra memory the profiling step took beyond the buffers
  uint64_t graph_reserve = 0;
  uint64_t graphs = 0;  // measured after capture
  uint64_t kv_cache = 0;
  int64_t fit_blocks = 0;  // KV blocks the budget holds
  int64_t kv_blocks = 0;   // allocated
};

class CudaModel {
 public:
  // Uploads this rank's weights, allocates the activation buffers and runs the profiling step
  // (every rank of a group at once: it runs the collectives), then sizes the KV cache
  // (memory().fit_blocks). Errors: the memory figures and the flags that would fit.
  static Expected<std::unique_ptr<CudaModel>> create(const ModelConfig& config,
                                                     const LayerPlan& plan,
                                                     const ModelWeights& host_weights,
                                                     StageComms comms, const EngineSpec& engine,
                                                     int gpu_shares = 1);
  ~CudaModel();
  CudaModel(const CudaModel&) = delete;
  CudaModel& operator=(const CudaModel&) = delete;

  // Allocates `blocks` KV blocks (<= fit_blocks), warms up and captures the decode graphs
  // (every rank of a group at once).
  Status init_cache(int64_t blocks);

  // Enqueues the batch through this rank's stage on stream(). On the last stage returns the
  // logits of the rows with want_logits, fp32 [rows, vocab] in device memory, valid until the
  // next call, and sets *rows; other stages return null and *rows = 0. `fills`: tokens the
  // sampler writes in from its last call (async scheduling; the rank that samples).
  Expected<float*> forward(std::span<const ForwardSeq> batch, int64_t* rows,
                           std::span<const TokenFill> fills = {});

  const ModelConfig& config() const { return config_; }
  const LayerPlan& plan() const { return plan_; }
  // The resolved spec it runs (common/engine_spec.h), and its dtype (kBF16 or kF16).
  const EngineSpec& engine() const { return engine_; }
  DType dtype() const { return dtype_; }
  const GpuMemoryReport& memory() const { return memory_; }
  cudaStream_t stream() const { return stream_; }
  // The sampler of the rank that samples (the last stage's tp rank 0), else null.
  cuda::GpuSampler* sampler() { return sampler_.get(); }
  // Decode batch sizes with a captured graph (empty with enforce_eager).
  std::vector<int64_t> graph_sizes() const;
  // The routings this rank counted since init_cache (common/expert_load.h; empty when it does
  // not count). Any thread.
  ExpertLoad expert_load() const;

 private:
  struct Graph;
  struct StepPlan;
  class Ops;  // layer_loop.h's operations on this model's buffers
  CudaModel(const ModelConfig& config, const LayerPlan& plan, StageComms comms,
            const EngineSpec& engine, int gpu_shares);
  // "--gpu-memory-utilization 0.90" and, when ranks share the GPU, how many: for messages.
  std::string utilization_text() const;

  Status allocate_buffers();
  // The FP8 GEMM (its path from TESSERA_FP8_GEMM) when some layer is FP8.
  Status create_fp8_gemm();
  // One KV block of one layer, K or V: block_size x kv_heads x head_dim in the cache's dtype.
  uint64_t kv_block_bytes_per_layer() const;
  Status allocate_kv_cache(int64_t blocks);
  Status size_kv_cache();
  Status capture_graphs();
  // Fills a host staging area for a step and copies it to the device (then the sampler fills).
  Expected<StepPlan> stage(std::span<const ForwardSeq> batch, int64_t pad_to,
                           std::span<const TokenFill> fills = {});
  // The step before's samples into the staged ids (device) at the staged fill pairs.
  Status fill_sampled_tokens(const StepPlan& plan, char* ids, char* fills);
  // One forward pass on the stream; `timer` (TESSERA_PROFILE_STEPS) marks each op.
  Status run(const StepPlan& plan, StepTimer* timer = nullptr);

  ModelConfig config_;
  LayerPlan plan_;
  StageComms comms_;
  EngineSpec engine_;
  DType dtype_ = DType::kBF16;
  int gpu_shares_ = 1;
  GpuMemoryReport memory_;
  uint64_t free_at_start_ = 0;
  int num_sms_ = 0;
  cudaStream_t stream_ = nullptr;
  std::unique_ptr<cuda::Gemm> gemm_;
  cuda::AttentionKernel attention_kernel_ = cuda::AttentionKernel::kAuto;
  std::unique_ptr<CudaWeights> weights_;
  std::unique_ptr<cuda::GpuSampler> sampler_;
  // [max_model_len, head_dim / 2] fp32 each: the global layers' RoPE and (Gemma 3, empty
  // otherwise) the sliding layers' own (rope_local_theta).
  cuda::DeviceBuffer rope_cos_, rope_sin_, rope_local_cos_, rope_local_sin_;

  // Activation buffers, sized for max_tokens_ rows.
  int64_t max_tokens_ = 0;
  int64_t max_blocks_per_seq_ = 0;
  cuda::DeviceBuffer residual_, hidden_, qkv_, q_, attn_, proj_, gate_up_, act_, rows_;
  cuda::DeviceBuffer shard_logits_;  // [T][max_num_seqs][vocab_shard] fp32 (T: tp ranks)
  cuda::DeviceBuffer logits_;        // [max_num_seqs][vocab] fp32
  cuda::DeviceBuffer attn_workspace_;
  // gemv_add_rms_norm's arrivals counter (kernels/cuda/gemv.h): one int32, zeroed once.
  cuda::DeviceBuffer norm_arrivals_;
  cuda::DeviceBuffer w4_workspace_;  // the int4 layers' (zeroed once; kernels/cuda/quant_gemm.h)
  // FP8 layers (kernels/cuda/fp8_linear.h): their GEMM, and the input of the one running, as the
  // norm / silu_mul / quantizer before it writes it: [max_tokens, widest FP8 input] E4M3 and
  // [max_tokens] fp32 row scales. Null / empty without FP8 layers.
  std::unique_ptr<cuda::Fp8Gemm> fp8_gemm_;
  cuda::DeviceBuffer fp8_act_, fp8_scales_;
  cuda::DeviceBuffer moe_workspace_;  // MoE models: cuda::moe_forward's, for max_tokens_ rows
  // The routings counted per (MoE layer of counted_layers_, expert): [layers][num_experts]
  // unsigned long long; empty on ranks that do not count (see allocate_buffers).
  cuda::DeviceBuffer expert_counts_;
  std::vector<int64_t> counted_layers_;  // model indices, ascending
  std::atomic<uint64_t> counted_steps_{0};
  cuda::DeviceBuffer sampled_tokens_;  // tensor parallelism: [max_num_seqs] packed, [tp][...]
  // Step metadata: one device block and two pinned host images used in turn (a step is staged
  // while the one before runs, whose copies read their image when they run).
  cuda::DeviceBuffer meta_;
  void* meta_host_[2] = {nullptr, nullptr};
  int meta_turn_ = 0;

  cuda::DeviceBuffer kv_storage_;
  std::vector<void*> k_cache_, v_cache_;  // per local layer
  int64_t kv_blocks_ = 0;

  std::map<int64_t, std::unique_ptr<Graph>> graphs_;  // by padded decode batch size
  std::unique_ptr<StepTimer> step_timer_;  // TESSERA_PROFILE_STEPS (null: the graphs run)
  std::vector<int64_t> decode_sizes_;                 // the padding buckets
};

}  // namespace tessera
