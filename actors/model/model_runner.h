// The actor's model: the loaded checkpoint, the forward pass, and each request's sampling
// state (its sampler's RNG and the token history penalties look at).
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
  std::string dtype = "auto";  // auto | bfloat16 | float16 | half | float32 | float
  int64_t kv_blocks = 0;       // 0 = one sequence of max_model_len
  int64_t block_size = 16;
  int64_t max_model_len = 0;  // 0 = min(max_position_embeddings, 8192)
  bool return_logits = false;
  int threads = 0;
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

class ModelRunner {
 public:
  static Expected<std::unique_ptr<ModelRunner>> load(const RunnerLoadSpec& spec);

  // Runs one step. `finished` requests are forgotten first. With return_logits, the sampled
  // rows' logits are appended to *logits.
  Expected<std::vector<RunnerOutput>> execute(const std::vector<RunnerSeq>& seqs,
                                              const std::vector<uint64_t>& finished,
                                              std::vector<float>* logits);

  const ModelConfig& config() const { return model_->config(); }
  int64_t kv_blocks() const { return model_->kv_blocks(); }
  int64_t block_size() const { return model_->block_size(); }
  int64_t max_model_len() const { return model_->max_model_len(); }
  uint64_t weight_bytes() const { return model_->weights().bytes; }
  size_t live_requests() const { return requests_.size(); }

 private:
  struct Request {
    cpu::Sampler sampler;
    std::vector<int32_t> prompt;
    std::vector<int32_t> output;
  };
  std::unique_ptr<Checkpoint> checkpoint_;  // the weights' storage (mmap); outlives model_
  std::unique_ptr<CpuModel> model_;
  bool return_logits_ = false;
  std::map<uint64_t, Request> requests_;
};

}  // namespace tessera
