// Sampling on the GPU for a batch of rows, with the semantics of cpu::Sampler (its oracle):
// raw logprobs, repetition / frequency / presence penalties, temperature, greedy argmax (ties
// to the lowest id), min_p, top_k, top_p — without sorting the vocabulary (thresholds are found
// by radix selection over the fp32 bit patterns) — and a draw from the renormalised survivors.
// The set of tokens that can be drawn is exactly the support of cpu::filter_logits' output
// (ties at a top-k / top-p cut go to the lower ids, as on the CPU); the probabilities are those of
// softmax over it, with weights rounded to a fixed point of about 2^-44 of the largest (so a
// survivor more than ~30 nats below the maximum is never drawn).
//
// Randomness is per request and independent of the batch: the uniform number for a row is
// Philox4x32-10 keyed by the request's seed and counted by how many tokens that request has
// sampled (`step`), so the same seed and logits give the same tokens in any batch (every sum
// that decides a draw is an exact integer sum: no dependence on atomics' order). The draw
// differs from the CPU backend's mt19937 stream: the same seed gives the same tokens on the same
// backend.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "common/sampling_params.h"
#include "common/status.h"
#include "kernels/cuda/cuda_util.h"

namespace tessera::cuda {

// One row of the batch, on the host.
struct SampleRow {
  // Valid (SamplingParams::validate accepted them where they entered the process: the actor's
  // RequestTable::apply); the sampler checks only what it was sized for (logprobs).
  SamplingParams params;
  uint64_t seed = 0;                    // the request's seed (the caller draws one if unset)
  uint64_t step = 0;                    // tokens this request has sampled before this one
  std::span<const int32_t> prompt_ids;  // repetition penalty (read only when it is != 1)
  std::span<const int32_t> output_ids;  // all three penalties (read only when one is on)
};

// A sampling call enqueued and not finished (GpuSampler::enqueue).
struct SampleTicket {
  int slot = -1;              // -1: no rows
  std::vector<int> logprobs;  // each row's SamplingParams::logprobs
};

class GpuSampler {
 public:
  // Buffers for up to max_rows rows of `vocab` logits and up to max_logprobs alternatives
  // (vLLM's max_logprobs, 20) per row, used on `stream`. Holds max_rows * vocab int32 of device
  // memory for the penalties' token counts, plus small per-row buffers and pinned staging.
  // INVALID_ARGUMENT for max_rows < 1, vocab outside [1, 2^31) or max_logprobs < 0.
  static Expected<std::unique_ptr<GpuSampler>> create(int max_rows, int64_t vocab, int max_logprobs,
                                                      cudaStream_t stream);
  ~GpuSampler();
  GpuSampler(const GpuSampler&) = delete;
  GpuSampler& operator=(const GpuSampler&) = delete;

  // Samples one token per row.
  //   logits: [rows.size(), vocab] fp32 device memory, overwritten (scratch), ready on `stream`
  // Returns one result per row, as cpu::Sampler::sample would shape it (logprob NaN and no
  // top_logprobs when not asked for). One upload of the rows' parameters (and of the id lists
  // the penalties read), the kernels, one copy back and one synchronisation of the stream; an
  // all-greedy batch without penalties or logprobs is one argmax kernel and the copy back.
  // INVALID_ARGUMENT (before anything is enqueued) for too many rows, a logprobs count above
  // max_logprobs or a token id out of range in a list that is read (prompt_ids only with a
  // repetition penalty, output_ids only with some penalty on); the params themselves are not
  // checked again (SampleRow);
  // FAILED_PRECONDITION naming the first row with no finite logit (after the penalties and the
  // temperature; a +inf maximum counts as none for a sampled row). Not thread-safe.
  Expected<std::vector<SampleResult>> sample(float* logits, std::span<const SampleRow> rows);

  // sample() in two halves, so the host can go on while the GPU samples: enqueue() validates
  // (the same errors, nothing enqueued on one) and enqueues the kernels and the copy back;
  // finish() waits for that copy and returns what sample() would. Two calls may be outstanding
  // (FAILED_PRECONDITION for a third); finish them in order. `rows` need not outlive enqueue().
  Expected<SampleTicket> enqueue(float* logits, std::span<const SampleRow> rows);
  Expected<std::vector<SampleResult>> finish(const SampleTicket& ticket);

  // The tokens the last enqueued call samples, in device memory (written on the sampler's stream
  // by that call): row r's at tokens[r * *stride]. Async scheduling takes a step's input tokens
  // from there without a trip to the host (fill_tokens below).
  const int32_t* tokens(int* stride) const;

  // Greedy only (every row temperature 0, no penalties, no logprobs): the argmax of each row
  // (cpu::greedy_argmax: NaN below -inf, ties to the lowest id), without synchronising: ids
  // [rows] int32 device memory, graph-capturable (one kernel, no allocation). `rows` may exceed
  // max_rows. INVALID_ARGUMENT only for null pointers or rows < 0.
  Status argmax(const float* logits, int rows, int32_t* ids, cudaStream_t stream) const;

 private:
  GpuSampler() = default;
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Async scheduling, on `stream`: ids[pairs[2i]] = tokens[pairs[2i + 1] * stride] for i < n (a
// step's input tokens from the samples of the step before; pairs in device memory), and
// out[i] = tokens[i * stride] for i < n (the samples packed, for the tensor-parallel peers).
Status fill_tokens(int32_t* ids, const int32_t* pairs, int n, const int32_t* tokens, int stride,
                   cudaStream_t stream);
Status pack_tokens(const int32_t* tokens, int stride, int n, int32_t* out, cudaStream_t stream);

}  // namespace tessera::cuda
