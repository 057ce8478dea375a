#include "kernels/cuda/gemv.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <mutex>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "kernels/cuda/block_trace.cuh"
#include "kernels/cuda/cuda_util.h"
#include "kernels/cuda/device_math.cuh"
#include "kernels/cuda/rms_norm.cuh"

namespace tessera::cuda {

namespace {

// A block is kWarps warps in kWarps / S groups of S; a group computes R output rows (all m rows
// of x against them), its S warps splitting k (split-K inside the block, the partial sums added
// in shared memory in slice order). A lane reads 16 bytes of each row per chunk, D chunks in
// flight: R x D loads of 512 bytes per warp.
//
// The tiles, from kernel_bench's table (H100, every call on another copy of the weights, so none
// comes from L2; us, fraction of the copy bandwidth, the tiles beside each other and cuBLASLt):
//   Whole rows per warp (S = 1) leave a small grid short of loads in flight: Qwen3-30B-A3B's o
//     [2048 x 4096] is 128 blocks of 2x2, one an SM, 8.03 us (0.69). Split four ways it is 512
//     blocks: 4x2x4 5.61 (0.99), 2x4x2 5.99, 2x2x4 6.54. Likewise Llama-3-8B o [4096 x 4096]
//     12.64 -> 11.22 (4x2x4), qkv [6144 x 4096] 17.97 (4x2) -> 16.56, down [4096 x 14336] 38.68
//     (2x4) -> 37.60, gate_up [28672 x 4096] 75.80 -> 74.18; Gemma 2 9B o 11.24 -> 10.14, qkv
//     19.86 -> 18.82, down 35.48 -> 33.35; Llama-3-70B's 1-4% (qkv 55.71 -> 53.07). k = 2048
//     has half the chunks: two slices, Qwen3-30B-A3B qkv [5120 x 2048] 8.83 (4x2) -> 8.37
//     (4x2x2; 4x2x4 9.36), its lm_head 196.5 -> 195.8; the lm_heads at k 3584-8192 within 1%.
//   Few rows: the Qwen3-30B-A3B router [128 x 2048] 2.17 (2x2) -> 1.27 (2x2x4, 32 blocks), 1.21
//     (2x2x8); moe_bench's chained layer takes 2x2x4 (-1.75 us a layer against -0.88).
//   Up to 2048 rows of k 3072-4096 (Qwen3-30B-A3B's o [2048 x 4096]): 4x4x4, whose warps ask for
//     their whole slice of the row (four 512-byte chunks of four rows) before the wait, so more
//     of the weights are in flight while the attention's combine finishes: moe_bench's chained
//     layer -0.53 us on an H200 (47.52 -> 46.99); on an H100 -0.37 in one call, +0.14 in
//     another, its decode ~1.009x there; the same bits as 4x2x4 (one slice count). Llama-3-8B's
//     o [4096 x 4096] keeps 4x2x4 (4x4x4: twice the blocks that fit at once; its decode 0.99x
//     on the H100).
// gemv_norm_tile(): the fused norm runs in every block before its loads and is taken only where
// the grid is one wave (gemv_add_rms_norm_one_wave); split grids are not, or (qkv 4x2x2 in three
// blocks an SM) were slower in the chain (+1.2 us a layer), so it keeps whole rows but for few
// rows (the router).
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

// The norm weight's vectors a thread holds before the PDL wait (vector tid + i * blockDim.x for
// i < kNormWeightVecs: a row of up to 4096 bf16 at 256 threads); a wider row reads the rest after.
constexpr int kNormWeightVecs = 2;

// Thread tid's vectors of the norm weight: read before the wait, as rms_norm_vec_kernel reads its
// own (the weight is constant), not after the sum of squares. On an H100 within the noise
// (moe_bench's chain 55.21 -> 55.13 us a layer; Qwen3-30B-A3B decode 1.003x, async 1.006x,
// Llama-3-8B 1.006x / 1.004x, with the routing's early reads in moe.cu); 18 registers more in
// the 4x2 kernels, still two blocks an SM.
template <typename T>
__device__ __forceinline__ void load_norm_weight(const NormArgs<T>& a, int k,
                                                 uint4 (&w)[kNormWeightVecs]) {
  const int nvec = k / dev::kHalfVec;
  const uint4* wv = reinterpret_cast<const uint4*>(a.weight);
#pragma unroll
  for (int i = 0; i < kNormWeightVecs; ++i) {
    const int j = static_cast<int>(threadIdx.x) + i * static_cast<int>(blockDim.x);
    w[i] = j < nvec ? __ldg(wv + j) : make_uint4(0, 0, 0, 0);
  }
}

// The block's copy of add_rms_norm on one row of k elements (x = proj): sum[j] = round(residual +
// x) and normed[j] = the normed row, 16-byte vectors in shared memory. The sum of squares is
// reduced as rms_norm_vec_kernel reduces it with a.shape's threads and vectors per thread (each
// of this block's threads plays those threads t, t + blockDim.x, ...; a warp of them sums as a
// warp of that kernel does), so the row has add_rms_norm's bits. w: the thread's vectors of the
// norm weight (load_norm_weight). Every thread calls it; it ends with a barrier.
template <typename T>
__device__ void add_rms_norm_row(const T* __restrict__ x, const NormArgs<T>& a, int k,
                                 const uint4 (&w)[kNormWeightVecs], uint4* normed, uint4* sum,
                                 float* scratch) {
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
  auto weigh = [&](int j, uint4 weight) {
    float h[dev::kHalfVec];
    dev::unpack8<T>(sum[j], h);
    norm::weigh<T, false>(h, weight, inv);
    normed[j] = dev::pack8<T>(h);
  };
  const int step = static_cast<int>(blockDim.x);
#pragma unroll
  for (int i = 0; i < kNormWeightVecs; ++i) {
    if (tid + i * step < nvec) weigh(tid + i * step, w[i]);
  }
  const uint4* wv = reinterpret_cast<const uint4*>(a.weight);  // a row wider than w holds
  for (int j = tid + kNormWeightVecs * step; j < nvec; j += step) weigh(j, __ldg(wv + j));
  __syncthreads();
}

// S: the warps that share a row group's k (split-K inside the block). Warp w takes rows of group
// w / S and the chunks c of k with c % S == w % S; the S partial sums meet in shared memory and
// are added in slice order. S = 1 is the whole row per warp (the bits of every S = 1 tile).
template <typename T, typename O, int R, int D, bool NORM = false, int S = 1>
__global__ void __launch_bounds__(kWarps * 32)
    gemv_kernel(const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ bias,
                O* __restrict__ out, int n, int k, NormArgs<T> nrm) {
  static_assert(S >= 1 && kWarps % S == 0, "S divides the block's warps");
  constexpr int M = 1;
  constexpr bool kStream = R != 2 || D != 2 || S != 1;
  constexpr int kStride = S * kChunk;  // elements between a warp's consecutive chunks
  block_trace::Mark mark;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int group = warp / S, slice = warp % S;
  const int row0 = (blockIdx.x * (kWarps / S) + group) * R;
  const T* wr[R];
#pragma unroll
  for (int r = 0; r < R; ++r) wr[r] = w + static_cast<int64_t>(min(row0 + r, n - 1)) * k;
  uint4 wv[D][R];  // the weights of the chunks at i
  auto load_w = [&](int at) {
#pragma unroll
    for (int c = 0; c < D; ++c) {
#pragma unroll
      for (int r = 0; r < R; ++r) {
        wv[c][r] = kStream ? dev::ldg_stream(wr[r] + at + c * kStride)
                           : __ldg(reinterpret_cast<const uint4*>(wr[r] + at + c * kStride));
      }
    }
  };
  int i = slice * kChunk + lane * dev::kHalfVec;
  // The first chunks' weights are requested before the wait: they do not depend on the kernel
  // before, so their latency overlaps its tail (the loop requests the later ones as before).
  if (i + (D - 1) * kStride < k) load_w(i);
  uint4 norm_w[kNormWeightVecs];  // NORM: the norm weight's vectors of this thread
  if constexpr (NORM) load_norm_weight<T>(nrm, k, norm_w);
  dev::pdl_wait();
  mark.wait_returned();
  dev::pdl_launch_dependents();
  // NORM: the normed row (the x every warp multiplies), then the residual sum (k / 8 each).
  extern __shared__ uint4 row_smem[];
  int arrival = 0;  // NORM, thread 0: the block's place among those done reading the residual
  if constexpr (NORM) {
    __shared__ float scratch[32];
    add_rms_norm_row<T>(x, nrm, k, norm_w, row_smem, row_smem + k / dev::kHalfVec, scratch);
    // The block has read the residual (its values are in the row). The count's answer is needed
    // only after the dot products (written_by_last_block), so its round trip overlaps them.
    if (threadIdx.x == 0) arrival = atomicAdd(nrm.arrivals, 1);
  }
  // NORM: the block counted last writes the residual and the normed row (every other one has
  // read the residual by then) and sets the arrivals back to 0. Every thread calls it.
  auto written_by_last_block = [&]() {
    __shared__ int last;
    if (threadIdx.x == 0) {
      last = arrival == static_cast<int>(gridDim.x) - 1;
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
  };
  // The row of x: 16-byte vector v of it (through L2: the kernel before wrote it; or the block's
  // normed row).
  auto x_vec = [&](int64_t v) {
    if constexpr (NORM) {
      return row_smem[v];
    } else {
      return __ldcg(reinterpret_cast<const uint4*>(x) + v);
    }
  };
  if constexpr (S == 1 && !NORM) {
    // (NORM: every thread reaches written_by_last_block; the rows past n read row n - 1 and are
    // not stored)
    if (row0 >= n) return;
  }
  float acc[M][R] = {};
  for (bool first = true; i + (D - 1) * kStride < k; i += D * kStride, first = false) {
    if (!first) load_w(i);
#pragma unroll
    for (int m = 0; m < M; ++m) {
      uint4 xv[D];
#pragma unroll
      for (int c = 0; c < D; ++c) {
        xv[c] = x_vec((static_cast<int64_t>(m) * k + i + c * kStride) / 8);
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
  for (; i < k; i += kStride) {
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
  if constexpr (NORM) written_by_last_block();
#pragma unroll
  for (int m = 0; m < M; ++m) {
#pragma unroll
    for (int r = 0; r < R; ++r) acc[m][r] = dev::warp_sum(acc[m][r]);
  }
  if constexpr (S > 1) {  // the group's first warp adds the slices' sums in slice order
    __shared__ float part[kWarps][R];
    if (lane == 0) {
#pragma unroll
      for (int r = 0; r < R; ++r) part[warp][r] = acc[0][r];
    }
    __syncthreads();
    if (slice != 0 || row0 >= n) return;
#pragma unroll
    for (int r = 0; r < R; ++r) {
      float sum = part[warp][r];
#pragma unroll
      for (int j = 1; j < S; ++j) sum += part[warp + j][r];
      acc[0][r] = sum;
    }
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
  mark.end(!NORM                       ? block_trace::Kernel::kGemv
           : std::is_same_v<O, float> ? block_trace::Kernel::kNormGemvF32
                                      : block_trace::Kernel::kNormGemv);
}

// Blocks of a call with this tile (the launch and gemv_add_rms_norm_one_wave agree on it).
int64_t grid_blocks(int64_t n, const GemvTile& t) {
  const int64_t rows = int64_t{kWarps} / t.slices * t.rows;
  return (n + rows - 1) / rows;
}

// The tiles gemv_with() has kernels for, as rows x depth x slices (gemv.h's GemvTile).
template <int R, int D, int S>
struct TileOf {
  static constexpr int kR = R, kD = D, kS = S;
};
using Tiles = std::tuple<TileOf<2, 2, 1>, TileOf<1, 4, 1>, TileOf<2, 4, 1>, TileOf<4, 2, 1>,
                         TileOf<2, 2, 2>, TileOf<2, 4, 2>, TileOf<4, 2, 2>, TileOf<2, 2, 4>,
                         TileOf<4, 2, 4>, TileOf<2, 2, 8>, TileOf<4, 4, 4>>;

// Calls f(TileOf<...>{}) for the kernel of `t`; cudaErrorNotSupported for a tile with none.
template <typename F, size_t I = 0>
cudaError_t with_tile(const GemvTile& t, F&& f) {
  if constexpr (I == std::tuple_size_v<Tiles>) {
    return cudaErrorNotSupported;
  } else {
    using Tl = std::tuple_element_t<I, Tiles>;
    if (t.rows == Tl::kR && t.depth == Tl::kD && t.slices == Tl::kS) return f(Tl{});
    return with_tile<F, I + 1>(t, std::forward<F>(f));
  }
}

std::string tile_list() {
  std::string out;
  for (const GemvTile& t : gemv_tiles()) {
    out += (out.empty() ? "" : ", ") + std::to_string(t.rows) + "x" + std::to_string(t.depth) +
           "x" + std::to_string(t.slices);
  }
  return out;
}

template <typename T, typename O, int R, int D, int S>
cudaError_t launch(const GemvTile& tile, int64_t n, int64_t k, const void* x, const void* w,
                   const void* bias, void* y, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(grid_blocks(n, tile)));
  return launch_pdl(gemv_kernel<T, O, R, D, false, S>, grid, dim3(kWarps * 32), 0, stream,
                    static_cast<const T*>(x), static_cast<const T*>(w), static_cast<const T*>(bias),
                    static_cast<O*>(y), static_cast<int>(n), static_cast<int>(k), NormArgs<T>{});
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

// Calls f(kernel, std::pair<T, O>{}) with the NORM kernel of `tile` for these types;
// cudaErrorNotSupported for a tile it has no kernel for.
template <typename F>
cudaError_t with_norm_kernel(const GemvTile& tile, DType dtype, DType out, F&& f) {
  return with_tile(tile, [&](auto t) {
    constexpr int R = decltype(t)::kR, D = decltype(t)::kD, S = decltype(t)::kS;
    if (dtype == DType::kBF16) {
      using T = __nv_bfloat16;
      return out == DType::kF32 ? f(gemv_kernel<T, float, R, D, true, S>, std::pair<T, float>{})
                                : f(gemv_kernel<T, T, R, D, true, S>, std::pair<T, T>{});
    }
    using T = __half;
    return out == DType::kF32 ? f(gemv_kernel<T, float, R, D, true, S>, std::pair<T, float>{})
                              : f(gemv_kernel<T, T, R, D, true, S>, std::pair<T, T>{});
  });
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

std::vector<GemvTile> gemv_tiles() {
  return std::apply(
      [](auto... t) {
        return std::vector<GemvTile>{
            GemvTile{decltype(t)::kR, decltype(t)::kD, decltype(t)::kS}...};
      },
      Tiles{});
}

size_t gemv_add_rms_norm_smem(int64_t k) { return static_cast<size_t>(k) * 4; }

bool gemv_add_rms_norm_takes(int64_t n, int64_t k, DType dtype, DType out, const GemvAddRmsNorm& a,
                             const void* w) {
  return gemv_takes(1, n, k, dtype, out, a.proj, w) && norm::vec_shape(k).v > 0 &&
         gemv_add_rms_norm_smem(k) <= 48 * 1024 && aligned16(a.residual) && aligned16(a.weight) &&
         aligned16(a.normed) && a.arrivals != nullptr && a.residual != a.proj &&
         a.normed != a.proj && a.normed != a.residual;
}

bool gemv_add_rms_norm_one_wave(int64_t n, int64_t k, DType dtype, DType out) {
  return gemv_add_rms_norm_one_wave_with(gemv_norm_tile(n, k), n, k, dtype, out);
}

bool gemv_add_rms_norm_one_wave_with(const GemvTile& tile, int64_t n, int64_t k, DType dtype,
                                     DType out) {
  // A tile with no kernel (slices 0 or 3 would also break grid_blocks' division) is never one.
  const bool has_kernel =
      with_tile(tile, [](auto) { return cudaSuccess; }) != cudaErrorNotSupported;
  if (!has_kernel || !gemv_takes(1, n, k, dtype, out, nullptr, nullptr) ||
      norm::vec_shape(k).v <= 0) {
    return false;
  }
  // Blocks a multiprocessor holds at once, per (device, shape, types): the query is a host call,
  // and the model asks twice a layer every decode step.
  struct Known {
    int device;
    int64_t n, k;
    GemvTile tile;
    DType dtype, out;
    int64_t blocks;
  };
  static std::mutex mu;
  static std::vector<Known> known;
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return false;
  const int64_t grid = grid_blocks(n, tile);
  std::lock_guard<std::mutex> lock(mu);
  for (const Known& e : known) {
    if (e.device == device && e.n == n && e.k == k && e.tile.rows == tile.rows &&
        e.tile.depth == tile.depth && e.tile.slices == tile.slices && e.dtype == dtype &&
        e.out == out) {
      return grid <= e.blocks;
    }
  }
  int per_sm = 0;
  const cudaError_t err = with_norm_kernel(tile, dtype, out, [&](auto kernel, auto) {
    return cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kWarps * 32,
                                                         gemv_add_rms_norm_smem(k));
  });
  if (err != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  const int64_t blocks = int64_t{per_sm} * current_sm_count();
  known.push_back({device, n, k, tile, dtype, out, blocks});
  return grid <= blocks;
}

Status gemv_add_rms_norm(int64_t n, int64_t k, DType dtype, DType out, const GemvAddRmsNorm& a,
                         const void* w, const void* bias, void* y, cudaStream_t stream) {
  return gemv_add_rms_norm_with(gemv_norm_tile(n, k), n, k, dtype, out, a, w, bias, y, stream);
}

Status gemv_add_rms_norm_with(const GemvTile& tile, int64_t n, int64_t k, DType dtype, DType out,
                              const GemvAddRmsNorm& a, const void* w, const void* bias, void* y,
                              cudaStream_t stream) {
  if (!gemv_add_rms_norm_takes(n, k, dtype, out, a, w) || y == nullptr ||
      (bias != nullptr && out == DType::kF32)) {
    return invalid_argument("gemv_add_rms_norm: n " + std::to_string(n) + " k " +
                            std::to_string(k) + " " + dtype_name(dtype) + "->" + dtype_name(out) +
                            " is not a call it takes (gemv's shapes, k * 4 bytes of shared "
                            "memory <= 48 KiB, 16-byte aligned buffers, an arrivals counter, "
                            "proj, residual and normed apart, no bias with fp32 out)");
  }
  const cudaError_t err = with_norm_kernel(tile, dtype, out, [&](auto kernel, auto t) {
    using T = typename decltype(t)::first_type;
    using O = typename decltype(t)::second_type;
    const dim3 grid(static_cast<unsigned>(grid_blocks(n, tile)));
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
    return invalid_argument("gemv_add_rms_norm: no kernel for tile " + std::to_string(tile.rows) +
                            "x" + std::to_string(tile.depth) + "x" + std::to_string(tile.slices) +
                            " (it has " + tile_list() + ")");
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
  if (n <= 1024) return {2, 2, 4};
  if (n <= 2048 && k >= 3072 && k <= 4096) return {4, 4, 4};
  if (k >= 3072) return {4, 2, 4};
  if (k >= 1024) return {4, 2, 2};
  return {4, 2, 1};
}

GemvTile gemv_norm_tile(int64_t n, int64_t k) {
  if (n <= 1024) return {2, 2, 4};
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
  const cudaError_t err = with_tile(tile, [&](auto t) {
    constexpr int R = decltype(t)::kR, D = decltype(t)::kD, S = decltype(t)::kS;
    if (in == DType::kBF16) {
      using B = __nv_bfloat16;
      return out == DType::kF32 ? launch<B, float, R, D, S>(tile, n, k, x, w, bias, y, stream)
                                : launch<B, B, R, D, S>(tile, n, k, x, w, bias, y, stream);
    }
    return out == DType::kF32 ? launch<__half, float, R, D, S>(tile, n, k, x, w, bias, y, stream)
                              : launch<__half, __half, R, D, S>(tile, n, k, x, w, bias, y, stream);
  });
  if (err == cudaErrorNotSupported) {
    return invalid_argument("gemv_with: no kernel for tile " + std::to_string(tile.rows) + "x" +
                            std::to_string(tile.depth) + "x" + std::to_string(tile.slices) +
                            " (rows x chunks deep x k slices; it has " + tile_list() + ")");
  }
  TESSERA_CUDA_RETURN_IF_ERROR(err, "gemv");
  return launch_status("gemv");
}

namespace block_trace {
TESSERA_BLOCK_TRACE_ATTACH(gemv)
}  // namespace block_trace

}  // namespace tessera::cuda
