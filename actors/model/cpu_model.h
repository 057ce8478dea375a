// The forward pass on the CPU backend: embedding → layers (RMSNorm, q/k/v, RoPE, paged
// attention with GQA, o_proj, RMSNorm, SwiGLU MLP) → final norm → lm_head, in fp32 from
// bf16/fp16/fp32 weights. The reference the CUDA backend is tested against.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "actors/model/weights.h"
#include "common/checkpoint/model_config.h"
#include "kernels/cpu/cpu_context.h"
#include "kernels/cpu/paged_kv_cache.h"
#include "kernels/cpu/rope.h"

namespace tessera {

// One sequence's slice of a forward batch.
struct ForwardSeq {
  std::span<const int32_t> tokens;  // the new tokens
  int64_t start_position = 0;       // position of tokens[0]
  std::span<const uint32_t> block_table;
  bool want_logits = false;  // logits of the last new token are returned
};

class CpuModel {
 public:
  // `kv_blocks` blocks of `block_size` tokens are allocated for the paged cache.
  static Expected<std::unique_ptr<CpuModel>> create(const ModelConfig& config, ModelWeights weights,
                                                    int64_t kv_blocks, int64_t block_size,
                                                    int64_t max_model_len, int threads = 0);

  // Runs the batch, writing every new token's K/V into the cache. Returns the logits
  // [rows, vocab] of the sequences with want_logits, in order. Errors (a position past
  // max_model_len, a block id past the cache) fail the whole batch and write nothing useful.
  Expected<std::vector<float>> forward(std::span<const ForwardSeq> batch);

  const ModelConfig& config() const { return config_; }
  int64_t kv_blocks() const { return cache_->shape().num_blocks; }
  int64_t block_size() const { return cache_->shape().block_size; }
  int64_t max_model_len() const { return max_model_len_; }
  const ModelWeights& weights() const { return weights_; }

 private:
  CpuModel(const ModelConfig& config, ModelWeights weights, int threads);

  ModelConfig config_;
  ModelWeights weights_;
  cpu::CpuContext ctx_;
  std::unique_ptr<cpu::PagedKvCache> cache_;
  std::unique_ptr<cpu::RopeTable> rope_;
  int64_t max_model_len_ = 0;
};

}  // namespace tessera
