#include "kernels/cuda/gemv.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <string>

#include "kernels/cuda/cuda_util.h"
#include "kernels/cuda/device_math.cuh"

namespace tessera::cuda {

namespace {

// A block is kWarps warps, kRows output rows each (all m rows of x against them). A lane reads
// 16 bytes of each row per chunk, kDepth chunks in flight: 4 loads of 512 bytes per warp.
// Measured on the H200 (moe_bench, kernel_bench) against 1 row x 4 or 8 deep, 2 x 4 and 4 x 1
// or 2, with and without prefetching the rows into L2 before the wait (slower everywhere):
// Llama's o_proj [1 x 4096 x 4096] 8.5 us = 0.92 of the copy bandwidth (cuBLASLt 18.2 us),
// Qwen3-30B-A3B's qkv 7.1 us (7.7), o 7.1 us (8.7), router 2.0 us (4.6). With 2 or 4 rows of x
// (the same loop over them) it lost to cuBLASLt (qkv 11.1 / 13.7 us, o 9.9 / 11.6 us), so it
// takes one.
constexpr int kWarps = 8;
constexpr int kRows = 2;
constexpr int kDepth = 2;
constexpr int kChunk = 32 * dev::kHalfVec;  // elements a warp reads per chunk

template <typename T, typename O>
__global__ void __launch_bounds__(kWarps * 32)
    gemv_kernel(const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ bias,
                O* __restrict__ out, int n, int k) {
  constexpr int R = kRows, D = kDepth, M = 1;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int row0 = (blockIdx.x * kWarps + warp) * R;
  const T* wr[R];
#pragma unroll
  for (int r = 0; r < R; ++r) wr[r] = w + static_cast<int64_t>(min(row0 + r, n - 1)) * k;
  dev::pdl_wait();
  dev::pdl_launch_dependents();
  if (row0 >= n) return;
  float acc[M][R] = {};
  int i = lane * dev::kHalfVec;
  for (; i + (D - 1) * kChunk < k; i += D * kChunk) {
    uint4 wv[D][R];
#pragma unroll
    for (int c = 0; c < D; ++c) {
#pragma unroll
      for (int r = 0; r < R; ++r) {
        wv[c][r] = __ldg(reinterpret_cast<const uint4*>(wr[r] + i + c * kChunk));
      }
    }
#pragma unroll
    for (int m = 0; m < M; ++m) {
      uint4 xv[D];
#pragma unroll
      for (int c = 0; c < D; ++c) {
        // x was written by the kernel before: through L2, not the non-coherent path.
        xv[c] = __ldcg(
            reinterpret_cast<const uint4*>(x + static_cast<int64_t>(m) * k + i + c * kChunk));
      }
#pragma unroll
      for (int c = 0; c < D; ++c) {
        float b[dev::kHalfVec];
        dev::unpack8<T>(xv[c], b);
#pragma unroll
        for (int r = 0; r < R; ++r) {
          float a[dev::kHalfVec];
          dev::unpack8<T>(wv[c][r], a);
#pragma unroll
          for (int j = 0; j < dev::kHalfVec; ++j) acc[m][r] = fmaf(a[j], b[j], acc[m][r]);
        }
      }
    }
  }
  for (; i < k; i += kChunk) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
      float a[dev::kHalfVec];
      dev::unpack8<T>(__ldg(reinterpret_cast<const uint4*>(wr[r] + i)), a);
#pragma unroll
      for (int m = 0; m < M; ++m) {
        float b[dev::kHalfVec];
        dev::unpack8<T>(__ldcg(reinterpret_cast<const uint4*>(x + static_cast<int64_t>(m) * k + i)),
                        b);
#pragma unroll
        for (int j = 0; j < dev::kHalfVec; ++j) acc[m][r] = fmaf(a[j], b[j], acc[m][r]);
      }
    }
  }
#pragma unroll
  for (int m = 0; m < M; ++m) {
#pragma unroll
    for (int r = 0; r < R; ++r) acc[m][r] = dev::warp_sum(acc[m][r]);
  }
  if (lane != 0) return;
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int row = row0 + r;
    if (row >= n) break;
    const float bv = bias != nullptr ? dev::to_float(bias[row]) : 0.0f;
#pragma unroll
    for (int m = 0; m < M; ++m) {
      out[static_cast<int64_t>(m) * n + row] = dev::from_float<O>(acc[m][r] + bv);
    }
  }
}

template <typename T, typename O>
cudaError_t launch(int64_t n, int64_t k, const void* x, const void* w, const void* bias, void* y,
                   cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>((n + kWarps * kRows - 1) / (kWarps * kRows)));
  return launch_pdl(gemv_kernel<T, O>, grid, dim3(kWarps * 32), 0, stream, static_cast<const T*>(x),
                    static_cast<const T*>(w), static_cast<const T*>(bias), static_cast<O*>(y),
                    static_cast<int>(n), static_cast<int>(k));
}

}  // namespace

static_assert(kGemvMaxRows == 1, "gemv_kernel computes one row of x");

bool gemv_takes(int64_t m, int64_t n, int64_t k, DType in, DType out, const void* x,
                const void* w) {
  const bool half = in == DType::kBF16 || in == DType::kF16;
  return m >= 1 && m <= kGemvMaxRows && n >= 1 && k >= 8 && k % 8 == 0 && half &&
         (out == in || out == DType::kF32) &&
         n * k * static_cast<int64_t>(dtype_size(in)) <= kGemvMaxWeightBytes &&
         n < (int64_t{1} << 31) / kWarps && reinterpret_cast<uintptr_t>(x) % 16 == 0 &&
         reinterpret_cast<uintptr_t>(w) % 16 == 0;
}

Status gemv(int64_t m, int64_t n, int64_t k, DType in, DType out, const void* x, const void* w,
            const void* bias, void* y, cudaStream_t stream) {
  if (!gemv_takes(m, n, k, in, out, x, w) || y == nullptr ||
      (bias != nullptr && out == DType::kF32)) {
    return invalid_argument("gemv: m " + std::to_string(m) + " n " + std::to_string(n) + " k " +
                            std::to_string(k) + " " + dtype_name(in) + "->" + dtype_name(out) +
                            " is not a shape it takes (m 1.." + std::to_string(kGemvMaxRows) +
                            ", k a multiple of 8, 16-byte aligned x and w, weights <= " +
                            std::to_string(kGemvMaxWeightBytes >> 20) + " MiB)");
  }
  cudaError_t err;
  if (in == DType::kBF16) {
    err = out == DType::kF32 ? launch<__nv_bfloat16, float>(n, k, x, w, bias, y, stream)
                             : launch<__nv_bfloat16, __nv_bfloat16>(n, k, x, w, bias, y, stream);
  } else {
    err = out == DType::kF32 ? launch<__half, float>(n, k, x, w, bias, y, stream)
                             : launch<__half, __half>(n, k, x, w, bias, y, stream);
  }
  TESSERA_CUDA_RETURN_IF_ERROR(err, "gemv");
  return launch_status("gemv");
}

}  // namespace tessera::cuda
