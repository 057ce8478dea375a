// Sampling on the GPU for a batch of rows, with the semantics of cpu::Sampler (its oracle):
// raw logprobs, repetition / frequency / presence penalties, temperature, greedy argmax (ties
// to the lowest id), min_p, top_k, top_p — without sorting the vocabulary (thresholds are found
// by radix selection over the fp32 bit patterns) — and a draw from the renormalised survivors.
//
// Randomness is per request and independent of the batch: the uniform number for a row is
// Philox4x32-10 keyed by the request's seed and counted by how many tokens that request has
// sampled (`step`), so the same seed and logits give the same tokens in any batch. (The draw
// differs from the CPU backend's mt19937 stream: the same seed gives the same tokens on the same
// backend.)
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "common/status.h"
#include "kernels/cpu/sampling.h"
#include "kernels/cuda/cuda_util.h"

namespace tessera::cuda {

// One row of the batch, on the host.
struct SampleRow {
  cpu::SamplingParams params;           // validated (params.validate() is OK)
  uint64_t seed = 0;                    // the request's seed (the caller draws one if unset)
  uint64_t step = 0;                    // tokens this request has sampled before this one
  std::span<const int32_t> prompt_ids;  // repetition penalty (read only when it is != 1)
  std::span<const int32_t> output_ids;  // all three penalties (read only when one is on)
};

class GpuSampler {
 public:
  // Buffers for up to max_rows rows of `vocab` logits and up to max_logprobs alternatives
  // (vLLM's max_logprobs, 20) per row, used on `stream`.
  static Expected<std::unique_ptr<GpuSampler>> create(int max_rows, int64_t vocab,
                                                      int max_logprobs, cudaStream_t stream);
  ~GpuSampler();
  GpuSampler(const GpuSampler&) = delete;
  GpuSampler& operator=(const GpuSampler&) = delete;

  // Samples one token per row.
  //   logits: [rows.size(), vocab] fp32 device memory, overwritten (scratch)
  // Returns one result per row, as cpu::Sampler::sample would shape it (logprob NaN when not
  // asked for). Synchronises the stream once at the end. INVALID_ARGUMENT for too many rows, a
  // logprobs count above max_logprobs or a token id out of range; FAILED_PRECONDITION for a row
  // with no finite logit.
  Expected<std::vector<cpu::SampleResult>> sample(float* logits, std::span<const SampleRow> rows);

  // Greedy only (every row temperature 0, no penalties, no logprobs): the argmax of each row,
  // without synchronising: ids [rows] int32 device memory, graph-capturable.
  Status argmax(const float* logits, int rows, int32_t* ids, cudaStream_t stream) const;

 private:
  GpuSampler() = default;
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace tessera::cuda
