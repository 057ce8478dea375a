// The actor's model: the loaded checkpoint, the forward pass on one backend, and each request's
// sampling state (its RNG and the token history penalties look at). Two backends sit behind one
// interface: "cpu" (fp32 reference math, kernels/cpu) and "cuda" (bf16/fp16 on one GPU,
// kernels/cuda, cuBLASLt, CUDA graphs).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "actors/model/cpu_model.h"
#include "common/checkpoint/safetensors.h"
#include "kernels/cpu/sampling.h"

namespace tessera {

struct RunnerLoadSpec {
  std::string model_dir;
  std::string dtype = "auto";   // auto | bfloat16 | float16 | half | float32 | float
  std::string device = "auto";  // auto (cuda when a GPU is visible) | cuda | cpu
  int64_t kv_blocks = 0;        // 0 = cpu: one sequence of max_model_len; cuda: sized from memory
  int64_t block_size = 16;
  int64_t max_model_len = 0;  // 0 = min(max_position_embeddings, 8192)
  bool return_logits = false;
  int threads = 0;  // cpu backend threads (0 = hardware concurrency)
  // cuda backend:
  double gpu_memory_utilization = 0.9;  // fraction of the GPU's memory this actor may use
  bool enforce_eager = false;           // no CUDA graphs
  int64_t max_num_seqs = 256;           // largest decode batch (and largest graph)
  int64_t max_num_batched_tokens = 0;   // largest step; 0 = max(max_model_len, 2048), capped 16384
};

struct RunnerSeq {
  uint64_t request_id = 0;
  std::vector<int32_t> tokens;
  int64_t start_position = 0;
  std::vector<uint32_t> block_table;
  bool sample = false;
  bool first = false;
  std::vector<int32_t> prompt;
  cpu::SamplingParams sampling;
};

struct RunnerOutput {
  uint64_t request_id = 0;
  cpu::SampleResult result;
};

// What a backend reports after loading, for ModelInfo and logs.
struct RunnerInfo {
  std::string backend;  // "cpu" | "cuda"
  DType dtype = DType::kF32;
  int64_t kv_blocks = 0;
  int64_t block_size = 0;
  int64_t max_model_len = 0;
  int64_t max_num_seqs = 0;
  int64_t max_num_batched_tokens = 0;
  uint64_t weight_bytes = 0;
  uint64_t kv_cache_bytes = 0;
  std::string device_name;  // "NVIDIA H200", "" on the cpu backend
};

class ModelRunner {
 public:
  virtual ~ModelRunner() = default;

  // Loads the checkpoint on the backend spec.device names (auto: cuda when this process sees a
  // GPU and was built with CUDA, else cpu). Errors name the tensor/file at fault, or the memory
  // figures and the flags that would make the model fit.
  static Expected<std::unique_ptr<ModelRunner>> load(const RunnerLoadSpec& spec);

  // Runs one step. `finished` requests are forgotten first. With return_logits, the sampled
  // rows' logits (fp32, [rows, vocab]) are appended to *logits.
  virtual Expected<std::vector<RunnerOutput>> execute(const std::vector<RunnerSeq>& seqs,
                                                      const std::vector<uint64_t>& finished,
                                                      std::vector<float>* logits) = 0;

  virtual const ModelConfig& config() const = 0;
  virtual const RunnerInfo& info() const = 0;
  virtual size_t live_requests() const = 0;
  // GPU time of the last step's forward pass in microseconds (0 on the cpu backend).
  virtual uint32_t last_gpu_micros() const { return 0; }

  int64_t kv_blocks() const { return info().kv_blocks; }
  int64_t block_size() const { return info().block_size; }
  int64_t max_model_len() const { return info().max_model_len; }
  uint64_t weight_bytes() const { return info().weight_bytes; }
};

// Shared by both backends: the dtype the model runs in ("auto" = the checkpoint's; a float32
// checkpoint runs in bfloat16 on the GPU), INVALID_ARGUMENT for an unknown name.
Expected<DType> resolve_dtype(const std::string& name, DType checkpoint_dtype, bool gpu);

// The max-model-len to use: spec's, or min(max_position_embeddings, 8192); INVALID_ARGUMENT
// past max_position_embeddings.
Expected<int64_t> resolve_max_model_len(int64_t requested, const ModelConfig& config);

// The largest step in tokens: spec's, or max(max_model_len, 2048) capped at 16384. Reported in
// ModelInfo; the driver's scheduler uses the actor's figure.
int64_t resolve_max_num_batched_tokens(int64_t requested, int64_t max_model_len);

// Shared by the backends' execute(): FAILED_PRECONDITION for a continuing request (first =
// false) the actor keeps no state for; and the forward pass's view of a step's sequences.
Status require_request_state(const RunnerSeq& seq, bool known);
std::vector<ForwardSeq> forward_batch(const std::vector<RunnerSeq>& seqs);

#ifdef TESSERA_WITH_CUDA
// Defined by the cuda backend (actors/model/cuda_runner.cpp).
Expected<std::unique_ptr<ModelRunner>> load_cuda_runner(const RunnerLoadSpec& spec);
bool cuda_device_visible();
#endif

}  // namespace tessera
