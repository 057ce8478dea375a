#include "kernels/cuda/gemv.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <mutex>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "kernels/cuda/cuda_util.h"
#include "kernels/cuda/device_math.cuh"
#include "kernels/cuda/rms_norm.cuh"

namespace tessera::cuda {

namespace {

// A block is kWarps warps, R output rows each (all m rows of x against them). A lane reads 16
// bytes of each row per chunk, D chunks in flight: R x D loads of 512 bytes per warp.
//
// gemv_tile()'s choice, from kernel_bench's table (H100, every call on another copy of the
// weights, so none comes from L2; us, the tiles beside each other and beside cuBLASLt):
//   Qwen3-30B-A3B router [128 x 2048]: 2x2 2.48 (its __ldg loads; 3.28 with ordered loads),
//     2x4 3.07, 4x2 5.18: few rows, so few warps: the fewest rows per warp.
//   Qwen3-30B-A3B o [2048 x 4096] 7.91, Llama-3-8B o [4096 x 4096] 12.67, Gemma 2 9B o [3584 x
//     4096] 11.34 with 2x2; 4x2 and 4x4 lose 13-42% there (half the warps), 1xD lose 19-65%.
//   Wider n at k <= 4096 take 4x2: Qwen3-30B-A3B qkv [5120 x 2048] 9.01 (2x2 10.88), Llama-3-8B
//     qkv [6144 x 4096] 18.78 (cuBLASLt 19.40), Gemma 2 9B qkv 20.66 (21.19), the lm_heads at
//     K 2048-4096 197-577 us = 1.04-1.05 of the copy bandwidth (cuBLASLt 0.97-1.01), gate_up
//     within 1% of cuBLASLt.
//   k > 4096 takes 2x4: Llama-3-8B down [4096 x 14336] 39.66 (cuBLASLt 41.78, 4x2 45.18), Gemma
//     2 9B down 35.25 (39.89), Llama-3-70B's qkv, down, gate_up and lm_head 1.00-1.05 of copy
//     (cuBLASLt 0.91-1.01).
// Tiles other than 2x2 load through ldg_stream (ordered asm loads: the R x D loads issue before
// the first is used; measured equal to __ldg on the shapes above but the router).
// With 2 or 4 rows of x (the same loop over them) it lost to cuBLASLt (qkv 11.1 / 13.7 us, o
// 9.9 / 11.6 us), so it takes one.
constexpr int kWarps = 8;
constexpr int kChunk = 32 * dev::kHalfVec;  // elements a warp reads per chunk

// gemv_add_rms_norm's norm (NORM): x is proj, and the block computes the row it multiplies,
// rms_norm(residual + proj) * weight, into shared memory first.
template <typename T>
struct NormArgs {
  T* residual = nullptr;
  const T* weight = nullptr;
  float eps = 0.0f;
  T* normed = nullptr;
  int32_t* arrivals = nullptr;
  norm::VecShape shape;  // rms_norm's kernel at this width, whose reduction order is copied
};

// The block's copy of add_rms_norm on one row of k elements (x = proj): sum[j] = round(residual +
// x) and normed[j] = the normed row, 16-byte vectors in shared memory. The sum of squares is
// reduced as rms_norm_vec_kernel reduces it with a.shape's threads and vectors per thread (each
// of this block's threads plays those threads t, t + blockDim.x, ...; a warp of them sums as a
// warp of that kernel does), so the row has add_rms_norm's bits. Every thread calls it; it ends
// with a barrier.
template <typename T>
__device__ void add_rms_norm_row(const T* __restrict__ x, const NormArgs<T>& a, int k,
                                 uint4* normed, uint4* sum, float* scratch) {
  const int nvec = k / dev::kHalfVec;
  const int tid = static_cast<int>(threadIdx.x), lane = tid & 31;
  const uint4* xv = reinterpret_cast<const uint4*>(x);
  const uint4* rv = reinterpret_cast<const uint4*>(a.residual);
  for (int t = tid; t < a.shape.threads; t += static_cast<int>(blockDim.x)) {
    float ss = 0.0f;
    for (int q = 0; q < a.shape.v; ++q) {
      const int j = t + q * a.shape.threads;
      if (j >= nvec) continue;
      float h[dev::kHalfVec], r[dev::kHalfVec];
      dev::unpack8<T>(__ldcg(xv + j), h);
      dev::unpack8<T>(__ldcg(rv + j), r);
#pragma unroll
      for (int e = 0; e < dev::kHalfVec; ++e) h[e] = r[e] + h[e];
      sum[j] = dev::pack8<T>(h);
      dev::unpack8<T>(sum[j], h);
#pragma unroll
      for (int e = 0; e < dev::kHalfVec; ++e) ss += h[e] * h[e];
    }
    ss = dev::warp_sum(ss);  // a whole warp takes part: threads is a multiple of 32
    if (lane == 0) scratch[t >> 5] = ss;
  }
  __syncthreads();
  const float inv_hidden = 1.0f / static_cast<float>(k);
  float total = lane < (a.shape.threads >> 5) ? scratch[lane] : 0.0f;
  total = dev::warp_sum(total);
  const float inv = rsqrtf(total * inv_hidden + a.eps);
  const uint4* wv = reinterpret_cast<const uint4*>(a.weight);
  for (int j = tid; j < nvec; j += static_cast<int>(blockDim.x)) {
    float h[dev::kHalfVec];
    dev::unpack8<T>(sum[j], h);
    norm::weigh<T, false>(h, __ldg(wv + j), inv);
    normed[j] = dev::pack8<T>(h);
  }
  __syncthreads();
}

template <typename T, typename O, int R, int D, bool NORM = false>
__global__ void __launch_bounds__(kWarps * 32)
    gemv_kernel(const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ bias,
                O* __restrict__ out, int n, int k, NormArgs<T> nrm) {
  constexpr int M = 1;
  constexpr bool kStream = R != 2 || D != 2;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int row0 = (blockIdx.x * kWarps + warp) * R;
  const T* wr[R];
#pragma unroll
  for (int r = 0; r < R; ++r) wr[r] = w + static_cast<int64_t>(min(row0 + r, n - 1)) * k;
  uint4 wv[D][R];  // the weights of the chunks at i
  auto load_w = [&](int at) {
#pragma unroll
    for (int c = 0; c < D; ++c) {
#pragma unroll
      for (int r = 0; r < R; ++r) {
        wv[c][r] = kStream ? dev::ldg_stream(wr[r] + at + c * kChunk)
                           : __ldg(reinterpret_cast<const uint4*>(wr[r] + at + c * kChunk));
      }
    }
  };
  int i = lane * dev::kHalfVec;
  // The first chunks' weights are requested before the wait: they do not depend on the kernel
  // before, so their latency overlaps its tail (the loop requests the later ones as before).
  if (i + (D - 1) * kChunk < k) load_w(i);
  dev::pdl_wait();
  dev::pdl_launch_dependents();
  // NORM: the normed row (the x every warp multiplies), then the residual sum (k / 8 each).
  extern __shared__ uint4 row_smem[];
  if constexpr (NORM) {
    __shared__ float scratch[32];
    __shared__ int last;
    add_rms_norm_row<T>(x, nrm, k, row_smem, row_smem + k / dev::kHalfVec, scratch);
    // The block that finishes the norm last writes the residual and the normed row (every other
    // one has read the residual by then), and sets the arrivals back to 0.
    if (threadIdx.x == 0) {
      __threadfence();
      last = atomicAdd(nrm.arrivals, 1) == static_cast<int>(gridDim.x) - 1;
      if (last) atomicExch(nrm.arrivals, 0);
    }
    __syncthreads();
    if (last) {
      uint4* res = reinterpret_cast<uint4*>(nrm.residual);
      uint4* nor = reinterpret_cast<uint4*>(nrm.normed);
      for (int j = static_cast<int>(threadIdx.x); j < k / dev::kHalfVec; j += blockDim.x) {
        res[j] = row_smem[k / dev::kHalfVec + j];
        nor[j] = row_smem[j];
      }
    }
  }
  // The row of x: 16-byte vector v of it (through L2: the kernel before wrote it; or the block's
  // normed row).
  auto x_vec = [&](int64_t v) {
    if constexpr (NORM) {
      return row_smem[v];
    } else {
      return __ldcg(reinterpret_cast<const uint4*>(x) + v);
    }
  };
  if (row0 >= n) return;
  float acc[M][R] = {};
  for (bool first = true; i + (D - 1) * kChunk < k; i += D * kChunk, first = false) {
    if (!first) load_w(i);
#pragma unroll
    for (int m = 0; m < M; ++m) {
      uint4 xv[D];
#pragma unroll
      for (int c = 0; c < D; ++c) xv[c] = x_vec((static_cast<int64_t>(m) * k + i + c * kChunk) / 8);
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
        dev::unpack8<T>(x_vec((static_cast<int64_t>(m) * k + i) / 8), b);
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

// Blocks of a call with R rows per warp (the launch and gemv_add_rms_norm_one_wave agree on it).
int64_t grid_blocks(int64_t n, int rows_per_warp) {
  const int64_t rows = int64_t{kWarps} * rows_per_warp;
  return (n + rows - 1) / rows;
}

template <typename T, typename O, int R, int D>
cudaError_t launch(int64_t n, int64_t k, const void* x, const void* w, const void* bias, void* y,
                   cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(grid_blocks(n, R)));
  return launch_pdl(gemv_kernel<T, O, R, D>, grid, dim3(kWarps * 32), 0, stream,
                    static_cast<const T*>(x), static_cast<const T*>(w), static_cast<const T*>(bias),
                    static_cast<O*>(y), static_cast<int>(n), static_cast<int>(k), NormArgs<T>{});
}

template <int R, int D>
cudaError_t launch_tile(int64_t n, int64_t k, DType in, DType out, const void* x, const void* w,
                        const void* bias, void* y, cudaStream_t stream) {
  if (in == DType::kBF16) {
    return out == DType::kF32
               ? launch<__nv_bfloat16, float, R, D>(n, k, x, w, bias, y, stream)
               : launch<__nv_bfloat16, __nv_bfloat16, R, D>(n, k, x, w, bias, y, stream);
  }
  return out == DType::kF32 ? launch<__half, float, R, D>(n, k, x, w, bias, y, stream)
                            : launch<__half, __half, R, D>(n, k, x, w, bias, y, stream);
}

Status check_call(int64_t m, int64_t n, int64_t k, DType in, DType out, const void* x,
                  const void* w, const void* bias, const void* y) {
  if (!gemv_takes(m, n, k, in, out, x, w) || y == nullptr ||
      (bias != nullptr && out == DType::kF32)) {
    return invalid_argument("gemv: m " + std::to_string(m) + " n " + std::to_string(n) + " k " +
                            std::to_string(k) + " " + dtype_name(in) + "->" + dtype_name(out) +
                            " is not a shape it takes (m 1.." + std::to_string(kGemvMaxRows) +
                            ", k a multiple of 8, 16-byte aligned x and w)");
  }
  return Status::ok();
}

// Calls f(kernel, std::pair<T, O>{}) with the NORM kernel of gemv_tile(n, k)'s tile for these
// types; cudaErrorNotSupported for a tile it has no kernel for.
template <typename F>
cudaError_t with_norm_kernel(int64_t n, int64_t k, DType dtype, DType out, F&& f) {
  auto by_types = [&](auto r, auto d) {
    constexpr int R = decltype(r)::value, D = decltype(d)::value;
    if (dtype == DType::kBF16) {
      using T = __nv_bfloat16;
      return out == DType::kF32 ? f(gemv_kernel<T, float, R, D, true>, std::pair<T, float>{})
                                : f(gemv_kernel<T, T, R, D, true>, std::pair<T, T>{});
    }
    using T = __half;
    return out == DType::kF32 ? f(gemv_kernel<T, float, R, D, true>, std::pair<T, float>{})
                              : f(gemv_kernel<T, T, R, D, true>, std::pair<T, T>{});
  };
  using I2 = std::integral_constant<int, 2>;
  using I4 = std::integral_constant<int, 4>;
  const GemvTile tile = gemv_tile(n, k);
  switch (tile.rows * 100 + tile.depth) {
    case 202:
      return by_types(I2{}, I2{});
    case 402:
      return by_types(I4{}, I2{});
    case 204:
      return by_types(I2{}, I4{});
    default:
      return cudaErrorNotSupported;
  }
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

size_t gemv_add_rms_norm_smem(int64_t k) { return static_cast<size_t>(k) * 4; }

bool gemv_add_rms_norm_takes(int64_t n, int64_t k, DType dtype, DType out, const GemvAddRmsNorm& a,
                             const void* w) {
  return gemv_takes(1, n, k, dtype, out, a.proj, w) && norm::vec_shape(k).v > 0 &&
         gemv_add_rms_norm_smem(k) <= 48 * 1024 && aligned16(a.residual) && aligned16(a.weight) &&
         aligned16(a.normed) && a.arrivals != nullptr && a.residual != a.proj &&
         a.normed != a.proj && a.normed != a.residual;
}

bool gemv_add_rms_norm_one_wave(int64_t n, int64_t k, DType dtype, DType out) {
  if (!gemv_takes(1, n, k, dtype, out, nullptr, nullptr) || norm::vec_shape(k).v <= 0) {
    return false;
  }
  // Blocks a multiprocessor holds at once, per (device, shape, types): the query is a host call,
  // and the model asks twice a layer every decode step.
  struct Known {
    int device;
    int64_t n, k;
    DType dtype, out;
    int64_t blocks;
  };
  static std::mutex mu;
  static std::vector<Known> known;
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return false;
  const int64_t grid = grid_blocks(n, gemv_tile(n, k).rows);
  std::lock_guard<std::mutex> lock(mu);
  for (const Known& e : known) {
    if (e.device == device && e.n == n && e.k == k && e.dtype == dtype && e.out == out) {
      return grid <= e.blocks;
    }
  }
  int per_sm = 0;
  const cudaError_t err = with_norm_kernel(n, k, dtype, out, [&](auto kernel, auto) {
    return cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kWarps * 32,
                                                         gemv_add_rms_norm_smem(k));
  });
  if (err != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  const int64_t blocks = int64_t{per_sm} * current_sm_count();
  known.push_back({device, n, k, dtype, out, blocks});
  return grid <= blocks;
}

Status gemv_add_rms_norm(int64_t n, int64_t k, DType dtype, DType out, const GemvAddRmsNorm& a,
                         const void* w, const void* bias, void* y, cudaStream_t stream) {
  if (!gemv_add_rms_norm_takes(n, k, dtype, out, a, w) || y == nullptr ||
      (bias != nullptr && out == DType::kF32)) {
    return invalid_argument("gemv_add_rms_norm: n " + std::to_string(n) + " k " +
                            std::to_string(k) + " " + dtype_name(dtype) + "->" + dtype_name(out) +
                            " is not a call it takes (gemv's shapes, k * 4 bytes of shared "
                            "memory <= 48 KiB, 16-byte aligned buffers, an arrivals counter, "
                            "proj, residual and normed apart, no bias with fp32 out)");
  }
  const cudaError_t err = with_norm_kernel(n, k, dtype, out, [&](auto kernel, auto t) {
    using T = typename decltype(t)::first_type;
    using O = typename decltype(t)::second_type;
    const dim3 grid(static_cast<unsigned>(grid_blocks(n, gemv_tile(n, k).rows)));
    NormArgs<T> nrm;
    nrm.residual = static_cast<T*>(a.residual);
    nrm.weight = static_cast<const T*>(a.weight);
    nrm.eps = a.eps;
    nrm.normed = static_cast<T*>(a.normed);
    nrm.arrivals = a.arrivals;
    nrm.shape = norm::vec_shape(k);
    return launch_pdl(kernel, grid, dim3(kWarps * 32), gemv_add_rms_norm_smem(k), stream,
                      static_cast<const T*>(a.proj), static_cast<const T*>(w),
                      static_cast<const T*>(bias), static_cast<O*>(y), static_cast<int>(n),
                      static_cast<int>(k), nrm);
  });
  if (err == cudaErrorNotSupported) {
    return internal_error("gemv_add_rms_norm: gemv_tile chose a tile it has no kernel for");
  }
  TESSERA_CUDA_RETURN_IF_ERROR(err, "gemv_add_rms_norm");
  return launch_status("gemv_add_rms_norm");
}

static_assert(kGemvMaxRows == 1, "gemv_kernel computes one row of x");

bool gemv_takes(int64_t m, int64_t n, int64_t k, DType in, DType out, const void* x,
                const void* w) {
  const bool half = in == DType::kBF16 || in == DType::kF16;
  return m >= 1 && m <= kGemvMaxRows && n >= 1 && k >= 8 && k % 8 == 0 && half &&
         (out == in || out == DType::kF32) && n < (int64_t{1} << 31) / kWarps &&
         k < (int64_t{1} << 31) && reinterpret_cast<uintptr_t>(x) % 16 == 0 &&
         reinterpret_cast<uintptr_t>(w) % 16 == 0;
}

GemvTile gemv_tile(int64_t n, int64_t k) {
  if (k > 4096) return {2, 4};
  if (n > 4096) return {4, 2};
  return {2, 2};
}

Status gemv(int64_t m, int64_t n, int64_t k, DType in, DType out, const void* x, const void* w,
            const void* bias, void* y, cudaStream_t stream) {
  return gemv_with(gemv_tile(n, k), m, n, k, in, out, x, w, bias, y, stream);
}

Status gemv_with(const GemvTile& tile, int64_t m, int64_t n, int64_t k, DType in, DType out,
                 const void* x, const void* w, const void* bias, void* y, cudaStream_t stream) {
  TESSERA_RETURN_IF_ERROR(check_call(m, n, k, in, out, x, w, bias, y));
  cudaError_t err = cudaSuccess;
  const int rd = tile.rows * 100 + tile.depth;
  switch (rd) {
    case 202:
      err = launch_tile<2, 2>(n, k, in, out, x, w, bias, y, stream);
      break;
    case 104:
      err = launch_tile<1, 4>(n, k, in, out, x, w, bias, y, stream);
      break;
    case 108:
      err = launch_tile<1, 8>(n, k, in, out, x, w, bias, y, stream);
      break;
    case 204:
      err = launch_tile<2, 4>(n, k, in, out, x, w, bias, y, stream);
      break;
    case 208:
      err = launch_tile<2, 8>(n, k, in, out, x, w, bias, y, stream);
      break;
    case 402:
      err = launch_tile<4, 2>(n, k, in, out, x, w, bias, y, stream);
      break;
    case 404:
      err = launch_tile<4, 4>(n, k, in, out, x, w, bias, y, stream);
      break;
    default:
      return invalid_argument("gemv_with: no kernel for " + std::to_string(tile.rows) + " rows x " +
                              std::to_string(tile.depth) +
                              " chunks deep (it has 2x2, 1x4, 1x8, 2x4, 2x8, 4x2, 4x4)");
  }
  TESSERA_CUDA_RETURN_IF_ERROR(err, "gemv");
  return launch_status("gemv");
}

}  // namespace tessera::cuda
