// The linear layers of a batch-1 decode step as a GEMV: out[m, n] = x[m, k] · w[n, k]ᵀ (+ bias[n])
// for m <= kGemvMaxRows (one), bf16/fp16 in, fp32 accumulation, out in the input dtype (rounded
// once, after the bias, as cuBLASLt's bias epilogue does) or fp32. Gemm::linear takes this path
// for every shape gemv_takes() accepts, whatever its size, cuBLASLt for the rest.
//
// Why not cuBLASLt there: kernel_bench's tile table (every batch-1 linear of Llama-3-8B / 70B,
// Gemma 2 9B and Qwen3-30B-A3B, weights from HBM, H100) has this kernel at least as fast on every
// shape: 1.20x on Qwen3-30B-A3B's qkv [5120 x 2048] (9.0 vs 10.9 us before its tile was chosen),
// 1.13x on Gemma 2 9B's down [3584 x 14336], 1.05-1.08x on the lm_heads (Llama-3-8B's 331 vs
// 358 us), within 1% on the gate_up GEMMs. It is also launched with programmatic dependent
// launch (cuda_util.h's launch_pdl), so its start overlaps the kernel before, like every other
// kernel of the decode step.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "common/status.h"
#include "common/tensor.h"

namespace tessera::cuda {

inline constexpr int64_t kGemvMaxRows = 1;

// Whether the kernel computes this shape: 1 <= m <= kGemvMaxRows, bf16/fp16 in, out = in or
// fp32, k a multiple of 8, x and w 16-byte aligned.
bool gemv_takes(int64_t m, int64_t n, int64_t k, DType in, DType out, const void* x, const void* w);

// The kernel's tile: output rows per group of warps, 512-byte chunks of each row a warp has in
// flight, and the warps of a group that split k between them (1: a warp reads whole rows).
// gemv_with() runs the tiles gemv_tiles() lists (kernel_bench compares them). Tiles of one slice
// count give the same bits; another slice count adds in another order.
struct GemvTile {
  int rows = 2;
  int depth = 2;
  int slices = 1;
};
// The tiles gemv_with() has kernels for (gemv.cu's Tiles tuple, in its order).
std::vector<GemvTile> gemv_tiles();
// The tile `gemv` takes for [n, k], and the one gemv_add_rms_norm takes (gemv.cu says what each
// was measured against).
GemvTile gemv_tile(int64_t n, int64_t k);
GemvTile gemv_norm_tile(int64_t n, int64_t k);

//   x: [m, k] in;  w: [n, k] in;  bias: [n] in or null (not with out = fp32);  out: [m, n] out.
// The first chunks of w are read before the kernel waits for the one launched before it
// (launch_pdl): w must not be that kernel's output.
// INVALID_ARGUMENT for a shape gemv_takes() refuses. Runs gemv_tile(n, k).
Status gemv(int64_t m, int64_t n, int64_t k, DType in, DType out, const void* x, const void* w,
            const void* bias, void* y, cudaStream_t stream);
// The same with another tile (the bits are gemv's where the slice count is gemv_tile's: a lane
// sums the same elements in the same order whatever the rows and the depth).
Status gemv_with(const GemvTile& tile, int64_t m, int64_t n, int64_t k, DType in, DType out,
                 const void* x, const void* w, const void* bias, void* y, cudaStream_t stream);

// gemv with the decoder layer's "residual += proj; x = rms_norm(residual) * weight" (cuda::
// add_rms_norm) in its prologue, for one row: every block normalises the row itself into shared
// memory, reducing as add_rms_norm's kernel does at width k (the same bits), and the block that
// gets there last writes residual and normed (what add_rms_norm writes): one launch instead of
// two, the bits of add_rms_norm then gemv_with(gemv_norm_tile(n, k)). out: the input's dtype or
// fp32 (a router's logits); bias as gemv's.
//   proj, residual (in/out), weight, normed: [k] dtype, 16-byte aligned, apart
//   arrivals: one int32, 0 before the first call; every call leaves it 0
struct GemvAddRmsNorm {
  const void* proj = nullptr;
  void* residual = nullptr;
  const void* weight = nullptr;
  float eps = 1e-6f;
  void* normed = nullptr;
  int32_t* arrivals = nullptr;
};
// Dynamic shared memory a call takes (the normed row and the residual sum): k * 4 bytes.
size_t gemv_add_rms_norm_smem(int64_t k);
bool gemv_add_rms_norm_takes(int64_t n, int64_t k, DType dtype, DType out, const GemvAddRmsNorm& a,
                             const void* w);
Status gemv_add_rms_norm(int64_t n, int64_t k, DType dtype, DType out, const GemvAddRmsNorm& a,
                         const void* w, const void* bias, void* y, cudaStream_t stream);
// Whether a call's blocks all fit on the current device at once (its occupancy times the
// multiprocessors). Every block computes the norm before its GEMV, so a grid of one wave pays
// that latency once, and each further wave pays it again: the model fuses the norm only then
// (decode, H100: Llama-3-8B's gate_up [28672 x 4096], 896 blocks, made a step slower fused).
bool gemv_add_rms_norm_one_wave(int64_t n, int64_t k, DType dtype, DType out);
// The same two with another tile than gemv_norm_tile(n, k)'s.
bool gemv_add_rms_norm_one_wave_with(const GemvTile& tile, int64_t n, int64_t k, DType dtype,
                                     DType out);
Status gemv_add_rms_norm_with(const GemvTile& tile, int64_t n, int64_t k, DType dtype, DType out,
                              const GemvAddRmsNorm& a, const void* w, const void* bias, void* y,
                              cudaStream_t stream);

}  // namespace tessera::cuda
