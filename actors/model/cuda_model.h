// The forward pass on one GPU: the same layers as CpuModel (its oracle), in bf16/fp16 with fp32
// accumulation, through kernels/cuda and cuBLASLt. q/k/v and gate/up projections are fused into
// one GEMM each (their weights are stacked when uploaded). Decode steps replay CUDA graphs
// captured for batch sizes 1, 2, 4, 8, 16, 24, 32, ... up to max_num_seqs (a batch is padded to
// the next captured size); eager mode pads the same way, so outputs are identical with and
// without graphs.
//
// Memory: weights first, then fixed activation buffers for max_num_batched_tokens, then one
// profiling step at that size; the KV cache takes what is left of
// gpu_memory_utilization x total memory (everything this GPU already holds counts against it:
// other processes, NCCL, the CUDA context), less a reserve for CUDA graphs.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "actors/model/cpu_model.h"
#include "actors/model/weights.h"
#include "common/checkpoint/model_config.h"
#include "kernels/cuda/cuda_util.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/sampling.h"

namespace tessera {

struct CudaModelOptions {
  DType dtype = DType::kBF16;  // kBF16 or kF16
  int64_t max_model_len = 0;
  int64_t block_size = 16;
  int64_t max_num_seqs = 256;
  int64_t max_num_batched_tokens = 8192;
  double gpu_memory_utilization = 0.9;
  int64_t kv_blocks = 0;  // 0 = size the cache from memory
  bool enforce_eager = false;
};

// Where this GPU's memory went, in bytes (logged, and reported to the driver).
struct GpuMemoryReport {
  std::string device_name;
  uint64_t total = 0;
  uint64_t budget = 0;         // gpu_memory_utilization x total
  uint64_t used_at_start = 0;  // by anything before the weights (other processes, context)
  uint64_t weights = 0;
  uint64_t activations = 0;   // fixed buffers, cuBLASLt workspace, sampler
  uint64_t profile_peak = 0;  // extra memory the profiling step took beyond the buffers
  uint64_t graph_reserve = 0;
  uint64_t graphs = 0;  // measured after capture
  uint64_t kv_cache = 0;
  int64_t kv_blocks = 0;
};

class CudaModel {
 public:
  // Uploads the weights (converted to options.dtype), sizes and allocates the KV cache, warms up
  // and captures the decode graphs. Errors: the memory figures and the flags that would fit.
  static Expected<std::unique_ptr<CudaModel>> create(const ModelConfig& config,
                                                     const ModelWeights& host_weights,
                                                     const CudaModelOptions& options);
  ~CudaModel();
  CudaModel(const CudaModel&) = delete;
  CudaModel& operator=(const CudaModel&) = delete;

  // Runs the batch (same contract as CpuModel::forward) and returns the logits of the rows with
  // want_logits, fp32 [rows, vocab] in device memory, valid until the next call; *rows is set.
  Expected<float*> forward(std::span<const ForwardSeq> batch, int64_t* rows);

  const ModelConfig& config() const { return config_; }
  const CudaModelOptions& options() const { return options_; }
  const GpuMemoryReport& memory() const { return memory_; }
  int64_t kv_blocks() const { return memory_.kv_blocks; }
  cuda::GpuSampler& sampler() { return *sampler_; }
  cudaStream_t stream() const { return stream_; }
  // Decode batch sizes with a captured graph (empty with enforce_eager).
  std::vector<int64_t> graph_sizes() const;

 private:
  struct Layer;
  struct Graph;
  struct StepPlan;
  CudaModel(const ModelConfig& config, const CudaModelOptions& options);

  Status upload_weights(const ModelWeights& w);
  Status allocate_buffers();
  Status allocate_kv_cache(int64_t blocks);
  Status size_kv_cache();
  Status capture_graphs();
  // Fills the host staging area for a step and copies it to the device.
  Expected<StepPlan> stage(std::span<const ForwardSeq> batch, int64_t pad_to);
  Status run_layers(const StepPlan& plan);

  ModelConfig config_;
  CudaModelOptions options_;
  GpuMemoryReport memory_;
  int num_sms_ = 0;
  cudaStream_t stream_ = nullptr;
  std::unique_ptr<cuda::Gemm> gemm_;
  std::unique_ptr<cuda::GpuSampler> sampler_;

  cuda::DeviceBuffer weight_storage_;
  std::vector<Layer> layers_;
  const void* embed_ = nullptr;
  const void* final_norm_ = nullptr;
  const void* lm_head_ = nullptr;
  cuda::DeviceBuffer rope_cos_, rope_sin_;

  // Activation buffers, sized for max_tokens_ rows.
  int64_t max_tokens_ = 0;
  int64_t max_blocks_per_seq_ = 0;
  cuda::DeviceBuffer residual_, hidden_, qkv_, q_, attn_, proj_, gate_up_, act_, rows_, logits_;
  cuda::DeviceBuffer attn_workspace_;
  // Step metadata: one device block and its pinned host mirror, copied with one memcpy.
  cuda::DeviceBuffer meta_;
  void* meta_host_ = nullptr;
  size_t meta_bytes_ = 0;

  cuda::DeviceBuffer kv_storage_;
  std::vector<void*> k_cache_, v_cache_;  // per layer
  int64_t kv_blocks_ = 0;

  std::map<int64_t, std::unique_ptr<Graph>> graphs_;  // by padded decode batch size
  std::vector<int64_t> decode_sizes_;                 // the padding buckets
};

}  // namespace tessera
