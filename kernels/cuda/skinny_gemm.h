// The linear layers of small decode batches: out[M, N] = x[M, K] . w[N, K]^T (+ bias[N]) for
// M <= kSkinnyMaxM, where the step is bound by reading w once and cuBLAS's tiles, sized for
// larger M, leave part of the bandwidth unused. Tensor cores (mma m16n8k16) take w as the
// 16-row operand and x as the 8-column one ("swap AB"), so M up to 16 costs what M = 1 does.
// Launched with programmatic dependent launch: a CTA loads its first slice of w before it
// waits for the kernel that writes x. Gemm::linear calls it; nothing else should.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/status.h"
#include "common/tensor.h"

namespace tessera::cuda {

inline constexpr int64_t kSkinnyMaxM = 16;

// Whether skinny_linear takes this call: M <= kSkinnyMaxM, inputs bf16/fp16, output the input
// type or fp32, K a multiple of 8, and x and w 16-byte aligned.
bool skinny_linear_applies(int64_t m, int64_t k, const void* x, const void* w);

// Gemm::linear's contract (validated by it): in = bf16 or fp16, out = in or kF32, bias [n] in
// `in` or null. fp32 accumulation; the sum over k is in a fixed order (bitwise reproducible).
Status skinny_linear(int64_t m, int64_t n, int64_t k, DType in, DType out, const void* x,
                     const void* w, const void* bias, void* y, cudaStream_t stream);

}  // namespace tessera::cuda
