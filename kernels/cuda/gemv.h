// The linear layers of a batch-1 decode step as a GEMV: out[m, n] = x[m, k] · w[n, k]ᵀ (+ bias[n])
// for m <= kGemvMaxRows (one), bf16/fp16 in, fp32 accumulation, out in the input dtype (rounded
// once, after the bias, as cuBLASLt's bias epilogue does) or fp32. Gemm::linear takes this path
// for the shapes gemv_takes() accepts, cuBLASLt for the rest.
//
// Why not cuBLASLt there: at batch 1 its kernels for these shapes stream at 0.43-0.64 of the copy
// bandwidth (kernel_bench: Llama-3-8B's o_proj; moe_bench: Qwen3-30B-A3B's qkv and o_proj), and
// its launch cannot overlap the kernel before. This one reads at up to 0.92 of it (gemv.cu's
// measurements) and is launched with programmatic dependent launch (cuda_util.h's launch_pdl),
// so its start overlaps the kernel before, like every other kernel of the decode step.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/status.h"
#include "common/tensor.h"

namespace tessera::cuda {

inline constexpr int64_t kGemvMaxRows = 1;
// Above this many weight bytes cuBLASLt streams at 0.86-0.99 of the copy bandwidth (Llama-3-8B's
// qkv, 48 MiB, and larger: kernel_bench).
inline constexpr int64_t kGemvMaxWeightBytes = int64_t{40} << 20;

// Whether `gemv` takes this shape: 1 <= m <= kGemvMaxRows, bf16/fp16 in, out = in or fp32, k a
// multiple of 8, the weights at most kGemvMaxWeightBytes, x and w 16-byte aligned.
bool gemv_takes(int64_t m, int64_t n, int64_t k, DType in, DType out, const void* x, const void* w);

//   x: [m, k] in;  w: [n, k] in;  bias: [n] in or null (not with out = fp32);  out: [m, n] out.
// INVALID_ARGUMENT for a shape gemv_takes() refuses.
Status gemv(int64_t m, int64_t n, int64_t k, DType in, DType out, const void* x, const void* w,
            const void* bias, void* y, cudaStream_t stream);

}  // namespace tessera::cuda
