// out[M, N] = x[M, K] . w[N, K]^T (+ bias) for small M; see skinny_gemm.h.
//
// One CTA computes 16 rows of w (16 outputs per batch row) over the whole of K. Its 8 warps share
// K: chunk c (128 values of k) goes to warp c % 8, so at any moment the CTA's warps read 8
// neighbouring 256-byte runs of each of its 16 rows. A warp's chunk is 16 rows x 128 k: each
// thread loads four 16-byte vectors of two rows (g and g + 8, g = lane / 4) at k = 32 t .. 32 t
// + 31 (t = lane % 4), and the four matching vectors of x's row g. Since a dot product does not
// care in which order k is summed, the thread's eight values of a vector are fed to two mma
// m16n8k16 as the k-positions {2t, 2t+1, 2t+8, 2t+9} of each: w as the A operand (rows = output
// features), x as the B operand (columns = batch rows, M <= 8 per n-tile, two n-tiles for M <=
// 16), accumulated in fp32. A warp's first chunk of w is loaded before the kernel waits for the one
// that writes x (programmatic dependent launch). The 8 warps'
// partial sums meet in shared memory and are added in warp order: the result does not depend on
// timing.
#include "kernels/cuda/skinny_gemm.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <climits>
#include <string>

#include "kernels/cuda/cuda_util.h"
#include "kernels/cuda/device_math.cuh"

namespace tessera::cuda {

namespace {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kRows = 16;             // rows of w per CTA: one mma tile's M
constexpr int kVecs = 4;              // 16-byte vectors per thread and row in a chunk
constexpr int kThreadK = kVecs * 8;   // 32 values of k per thread and chunk
constexpr int kChunk = 4 * kThreadK;  // 128 values of k per warp and chunk
// The loads in flight are what sets the bandwidth: three CTAs (24 warps, 96 KB of w) per SM.
// A first version kept the next chunk in registers too, ran one CTA per SM and read w at 0.65
// to 0.85 of the copy bandwidth.
constexpr int kMinCtasPerSm = 3;

template <typename T>
__device__ __forceinline__ void mma_16816(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                          uint32_t a3, uint32_t b0, uint32_t b1);
template <>
__device__ __forceinline__ void mma_16816<__nv_bfloat16>(float (&c)[4], uint32_t a0, uint32_t a1,
                                                         uint32_t a2, uint32_t a3, uint32_t b0,
                                                         uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void mma_16816<__half>(float (&c)[4], uint32_t a0, uint32_t a1,
                                                  uint32_t a2, uint32_t a3, uint32_t b0,
                                                  uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// w is read once per call: through the non-coherent path, not kept in L1.
__device__ __forceinline__ uint4 load_weights(const void* p) {
  uint4 r;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
      : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
      : "l"(p));
  return r;
}

template <typename T, typename OutT, int NT>
__global__ void __launch_bounds__(kThreads, kMinCtasPerSm)
    skinny_gemm_kernel(const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ bias,
                       OutT* __restrict__ y, int m, int n, int k) {
  __shared__ float partial[kWarps][NT][kRows][8];
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int warp = static_cast<int>(threadIdx.x) >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * kRows;
  const bool lo_ok = row0 + g < n, hi_ok = row0 + g + 8 < n;
  const T* w_lo = w + (row0 + g) * k;  // read only where lo_ok (hi_ok)
  const T* w_hi = w + (row0 + g + 8) * k;
  const int chunks = (k + kChunk - 1) / kChunk;
  const uint4 zero = make_uint4(0, 0, 0, 0);

  auto load_w = [&](int c, uint4(&lo)[kVecs], uint4(&hi)[kVecs]) {
#pragma unroll
    for (int v = 0; v < kVecs; ++v) {
      const int kk = c * kChunk + t * kThreadK + v * 8;
      lo[v] = lo_ok && kk < k ? load_weights(w_lo + kk) : zero;
      hi[v] = hi_ok && kk < k ? load_weights(w_hi + kk) : zero;
    }
  };

  float acc[NT][4];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.0f;
  uint4 wl[kVecs], wh[kVecs];
  int c = warp;
  if (c < chunks) load_w(c, wl, wh);  // weights only: before the wait
  dev::pdl_wait();
  dev::pdl_launch_dependents();
  for (; c < chunks; c += kWarps) {
    if (c != warp) load_w(c, wl, wh);  // the first chunk was loaded before the wait
    uint4 xv[NT][kVecs];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const int row = nt * 8 + g;
#pragma unroll
      for (int v = 0; v < kVecs; ++v) {
        const int kk = c * kChunk + t * kThreadK + v * 8;
        xv[nt][v] = row < m && kk < k
                        ? *reinterpret_cast<const uint4*>(x + static_cast<int64_t>(row) * k + kk)
                        : zero;
      }
    }
#pragma unroll
    for (int v = 0; v < kVecs; ++v) {
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        mma_16816<T>(acc[nt], wl[v].x, wh[v].x, wl[v].y, wh[v].y, xv[nt][v].x, xv[nt][v].y);
        mma_16816<T>(acc[nt], wl[v].z, wh[v].z, wl[v].w, wh[v].w, xv[nt][v].z, xv[nt][v].w);
      }
    }
  }

  // C fragment: c0, c1 = (row g, batch 2t, 2t+1), c2, c3 = (row g + 8, batch 2t, 2t+1).
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    partial[warp][nt][g][2 * t] = acc[nt][0];
    partial[warp][nt][g][2 * t + 1] = acc[nt][1];
    partial[warp][nt][g + 8][2 * t] = acc[nt][2];
    partial[warp][nt][g + 8][2 * t + 1] = acc[nt][3];
  }
  __syncthreads();
  for (int i = static_cast<int>(threadIdx.x); i < NT * 8 * kRows; i += kThreads) {
    const int r = i % kRows, col = i / kRows;  // col: the batch row
    const int64_t row = row0 + r;
    if (col >= m || row >= n) continue;
    float s = 0.0f;
#pragma unroll
    for (int q = 0; q < kWarps; ++q) s += partial[q][col / 8][r][col % 8];
    if (bias != nullptr) s += dev::to_float(bias[row]);
    y[static_cast<int64_t>(col) * n + row] = dev::from_float<OutT>(s);
  }
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

template <typename T, typename OutT>
cudaError_t launch(int64_t m, int64_t n, int64_t k, const void* x, const void* w, const void* bias,
                   void* y, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>((n + kRows - 1) / kRows));
  const auto* xt = static_cast<const T*>(x);
  const auto* wt = static_cast<const T*>(w);
  const auto* bt = static_cast<const T*>(bias);
  auto* yt = static_cast<OutT*>(y);
  const int mi = static_cast<int>(m), ni = static_cast<int>(n), ki = static_cast<int>(k);
  if (m <= 8) {
    return launch_pdl(skinny_gemm_kernel<T, OutT, 1>, grid, dim3(kThreads), 0, stream, xt, wt, bt,
                      yt, mi, ni, ki);
  }
  return launch_pdl(skinny_gemm_kernel<T, OutT, 2>, grid, dim3(kThreads), 0, stream, xt, wt, bt, yt,
                    mi, ni, ki);
}

}  // namespace

bool skinny_linear_applies(int64_t m, int64_t k, const void* x, const void* w) {
  return m >= 1 && m <= kSkinnyMaxM && k % 8 == 0 && k <= INT_MAX && aligned16(x) && aligned16(w);
}

Status skinny_linear(int64_t m, int64_t n, int64_t k, DType in, DType out, const void* x,
                     const void* w, const void* bias, void* y, cudaStream_t stream) {
  const std::string what = "skinny_linear [m=" + std::to_string(m) + " n=" + std::to_string(n) +
                           " k=" + std::to_string(k) + "]";
  if (!skinny_linear_applies(m, k, x, w) || n <= 0 || n > INT_MAX - kRows) {
    return invalid_argument(what + ": not a shape this kernel takes");
  }
  cudaError_t err = cudaErrorInvalidValue;
  if (in == DType::kBF16) {
    err = out == DType::kF32 ? launch<__nv_bfloat16, float>(m, n, k, x, w, bias, y, stream)
                             : launch<__nv_bfloat16, __nv_bfloat16>(m, n, k, x, w, bias, y, stream);
  } else if (in == DType::kF16) {
    err = out == DType::kF32 ? launch<__half, float>(m, n, k, x, w, bias, y, stream)
                             : launch<__half, __half>(m, n, k, x, w, bias, y, stream);
  } else {
    return invalid_argument(what + ": inputs must be BF16 or F16");
  }
  return cuda_status(err, "launching " + what);
}

}  // namespace tessera::cuda
