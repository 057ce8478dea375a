#include "kernels/cuda/moe.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <string>
#include <type_traits>

#include "common/checkpoint/moe_carve.h"
#include "kernels/cuda/block_trace.cuh"
#include "kernels/cuda/cuda_util.h"
#include "kernels/cuda/device_math.cuh"
#include "kernels/cuda/elementwise.h"

namespace tessera::cuda {

namespace {

constexpr int kMaxExperts = 4096;
constexpr int kMaxTopK = 32;

// ---- router ----

constexpr int kRouteWarps = 4;

// Whether token t's row is counted (MoeCount::rows: the host's, a row < 0 is padding).
__device__ __forceinline__ bool counted_row(const MoeCount& c, int t) {
  return c.rows == nullptr || c.rows[t] >= 0;
}

// Counts a routing to expert e of a token whose row is `live` (counted_row) if e is local.
__device__ __forceinline__ void count_routing(const MoeCount& c, bool live, int e) {
  if (!live) return;
  if (e - c.expert_begin < 0 || e - c.expert_begin >= c.local_experts) return;
  atomicAdd(c.counts + e, 1ull);
}

// The routing kernel's counting, before its PDL wait: whether token t's row is counted (rows are
// the host's, copied before the step's kernels, so they are read before the wait, not after the
// top-k), and the warp asks L2 for the counters' lines (last touched a step ago) so that the
// adds at the routing's end, which the layer's later kernels wait for, find them there.
__device__ __forceinline__ bool count_live_row(const MoeCount& c, int t, int lane) {
  if (c.counts == nullptr) return false;
  // The lines of counts[expert_begin, expert_begin + local_experts): one more than the bytes
  // fill, as the range need not start at a line.
  const int lines = static_cast<int>(c.local_experts * sizeof(unsigned long long) / 128) + 1;
  const unsigned long long* first = c.counts + c.expert_begin;
  for (int i = lane; i < lines; i += 32) {
    dev::prefetch_l2(first + min(static_cast<int64_t>(i) * 16, c.local_experts - 1));
  }
  return counted_row(c, t);
}

// One warp per token, its probabilities in registers: lane l holds experts l, l + 32, ...
// (kPerLane of them). R: the type the logits are rounded to first (float: none). Launched with
// launch_pdl.
template <typename R, int kPerLane>
__global__ void __launch_bounds__(kRouteWarps * 32)
    route_kernel(const float* __restrict__ logits, int tokens, int experts, int top_k,
                 bool renormalize, int32_t* __restrict__ ids, float* __restrict__ weights,
                 MoeCount count) {
  block_trace::Mark mark;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int t = blockIdx.x * kRouteWarps + warp;
  const bool live = t < tokens && count_live_row(count, t, lane);
  dev::pdl_wait();
  mark.wait_returned();
  dev::pdl_launch_dependents();
  if (t >= tokens) return;
  const float* l = logits + static_cast<int64_t>(t) * experts;
  float v[kPerLane];
  float mx = -INFINITY;
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    const int e = lane + 32 * j;
    v[j] = e < experts ? dev::round_to<R>(__ldcg(l + e)) : -INFINITY;
    mx = fmaxf(mx, v[j]);
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  float sum = 0.0f;
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    v[j] = lane + 32 * j < experts ? expf(v[j] - mx) : 0.0f;
    sum += v[j];
  }
  sum = dev::warp_sum(sum);
  // Each candidate as an unsigned key ordered as its probability: the float's bits + 1 (a
  // probability is >= 0, so its bits order as it does), 0 for padding, taken ones and NaN (never
  // chosen while any other is left). A round is two warp reductions (redux.sync): the highest
  // key, then the lowest index holding it (ties go to the lower index).
  unsigned key[kPerLane];
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    const float pj = v[j] / sum;
    key[j] = lane + 32 * j < experts && pj >= 0.0f ? __float_as_uint(pj) + 1u : 0u;
  }
  float my_p = 0.0f;  // lane k < top_k: the k-th choice
  int my_e = 0;
  for (int k = 0; k < top_k; ++k) {
    // The lane's best (its lowest index on ties: j ascends and the comparison is strict).
    unsigned lane_key = 0u;
    int lane_e = experts;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      if (key[j] > lane_key) {
        lane_key = key[j];
        lane_e = lane + 32 * j;
      }
    }
    const unsigned best = __reduce_max_sync(0xffffffffu, lane_key);
    // No candidate left (only NaN logits leave none: top_k <= experts): index `experts`, which
    // is no expert (every path skips it; the shuffles before chose a taken one again).
    const int best_e =
        best == 0u
            ? experts
            : static_cast<int>(__reduce_min_sync(
                  0xffffffffu, lane_key == best ? static_cast<unsigned>(lane_e) : 0xffffffffu));
    if (lane == k) {
      my_p = best == 0u ? -1.0f : __uint_as_float(best - 1u);
      my_e = best_e;
    }
    if (best != 0u && (best_e & 31) == lane) {
#pragma unroll
      for (int j = 0; j < kPerLane; ++j) {
        if (lane + 32 * j == best_e) key[j] = 0u;
      }
    }
  }
  float top = 0.0f;  // summed in rank order, as the CPU reference does
  for (int k = 0; k < top_k; ++k) top += __shfl_sync(0xffffffffu, my_p, k);
  if (lane < top_k) {
    ids[static_cast<int64_t>(t) * top_k + lane] = my_e;
    weights[static_cast<int64_t>(t) * top_k + lane] = renormalize ? my_p / top : my_p;
    count_routing(count, live, my_e);  // live: false without counts
  }
  mark.end(block_trace::Kernel::kRoute);
}

// ---- expert counts ----

constexpr int kCountThreads = 256;

__global__ void __launch_bounds__(kCountThreads)
    count_kernel(const int32_t* __restrict__ ids, int pairs, int top_k, MoeCount count) {
  dev::pdl_wait();
  dev::pdl_launch_dependents();
  const int p = blockIdx.x * kCountThreads + static_cast<int>(threadIdx.x);
  if (p >= pairs) return;
  count_routing(count, counted_row(count, p / top_k), ids[p]);
}

// ---- permutation ----

constexpr int kPermuteThreads = 1024;

__global__ void permute_kernel(const int32_t* __restrict__ ids, int pairs, int expert_begin,
                               int local_experts, int32_t* __restrict__ offsets,
                               int32_t* __restrict__ tiles, int32_t* __restrict__ rows,
                               int32_t* __restrict__ pos, int top_k) {
  extern __shared__ int32_t counts[];  // [local_experts] counts, then [local_experts] cursors
  int32_t* cursor = counts + local_experts;
  for (int e = threadIdx.x; e < local_experts; e += blockDim.x) counts[e] = 0;
  __syncthreads();
  for (int i = threadIdx.x; i < pairs; i += blockDim.x) {
    const int e = ids[i] - expert_begin;
    if (e >= 0 && e < local_experts) atomicAdd(&counts[e], 1);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int32_t at = 0, tile = 0;
    for (int e = 0; e < local_experts; ++e) {
      offsets[e] = at;
      tiles[e] = tile;
      cursor[e] = at;
      at += counts[e];
      tile += (counts[e] + static_cast<int>(kMoeTileRows) - 1) / static_cast<int>(kMoeTileRows);
    }
    offsets[local_experts] = at;
    tiles[local_experts] = tile;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < pairs; i += blockDim.x) {
    const int e = ids[i] - expert_begin;
    if (e >= 0 && e < local_experts) {
      const int p = atomicAdd(&cursor[e], 1);
      rows[p] = i / top_k;
      pos[i] = p;
    } else {
      pos[i] = -1;
    }
  }
}

// ---- grouped GEMM on tensor cores ----
//
// Block tile 64 rows x 64 weight rows x 32 k, 4 warps (2 x 2), each warp 32 x 32 = 2 m16 x 4 n8
// mma.sync tiles. Shared tiles are padded to 40 elements a row: the 8 rows x 4 words a fragment
// load reads fall in distinct banks. Two stages of cp.async: tile k + 1 loads while k computes.
// For gate_up, a warp's 32 weight rows are 16 gate rows and the 16 up rows of the same outputs,
// so each thread holds g and u of the same (row, output) and SiLU-and-mul is its epilogue.

constexpr int kBM = 64, kBN = 64, kBK = 32, kPad = 40, kGemmThreads = 128;
static_assert(kBM == kMoeTileRows, "moe_permute's tiles are the GEMM's row tiles");

template <typename T>
struct MmaOps;
template <>
struct MmaOps<__half> {
  static __device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                             uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};
template <>
struct MmaOps<__nv_bfloat16> {
  static __device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                             uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

__device__ __forceinline__ void cp_async_16(void* smem, const void* src) {
  const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ float silu(float g) { return g / (1.0f + expf(-g)); }

// kGateUp: A = x rows gathered through rows[], B = the expert's gate | up, out = act [P, inter];
// else A = act rows, B = the expert's down, out = y [P, hidden]. K = the A row length.
template <typename T, bool kGateUp>
__global__ void __launch_bounds__(kGemmThreads)
    grouped_gemm_kernel(const T* __restrict__ a, const int32_t* __restrict__ rows,
                        const T* __restrict__ w, const int32_t* __restrict__ offsets,
                        const int32_t* __restrict__ tiles, int local_experts, int k_dim, int n_dim,
                        T* __restrict__ out) {
  __shared__ __align__(16) T as[2][kBM][kPad];
  __shared__ __align__(16) T bs[2][kBN][kPad];
  __shared__ int32_t a_src[kBM];  // the A row each tile row reads (-1: past the expert's rows)
  const int tile = blockIdx.x;
  if (tile >= tiles[local_experts]) return;
  // The expert whose tiles hold this one: the last e with tiles[e] <= tile.
  int lo = 0, hi = local_experts - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (tiles[mid] <= tile) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  const int e = lo;
  const int m0 = offsets[e] + (tile - tiles[e]) * kBM, m_end = offsets[e + 1];
  // gate_up: a block covers 32 outputs (n_dim = inter) as 64 weight rows; down: 64 outputs.
  const int n0 = blockIdx.y * (kGateUp ? kBN / 2 : kBN);
  const T* we = w + static_cast<int64_t>(e) * (kGateUp ? 2 * n_dim : n_dim) * k_dim;
  const int tid = threadIdx.x;
  if (tid < kBM) {
    const int p = m0 + tid;
    a_src[tid] = p < m_end ? (kGateUp ? rows[p] : p) : -1;
  }
  __syncthreads();
  // The weight row of shared row r, or -1 past the outputs.
  auto b_row = [&](int r) -> int {
    if (!kGateUp) return n0 + r < n_dim ? n0 + r : -1;
    const int j = n0 + (r >> 5) * 16 + (r & 15);
    if (j >= n_dim) return -1;
    return (r & 16) ? n_dim + j : j;
  };
  const int k_tiles = (k_dim + kBK - 1) / kBK;
  auto load = [&](int stage, int kt) {
    const int k0 = kt * kBK;
    // 64 rows x 4 chunks of 8 elements, for A and for B: 2 chunks each per thread.
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int c = tid + i * kGemmThreads;
      const int r = c >> 2, kc = (c & 3) * 8;
      const bool k_ok = k0 + kc < k_dim;  // k_dim % 8 == 0: a chunk is in or out whole
      const int src = a_src[r];
      if (src >= 0 && k_ok) {
        cp_async_16(&as[stage][r][kc], a + static_cast<int64_t>(src) * k_dim + k0 + kc);
      } else {
        *reinterpret_cast<uint4*>(&as[stage][r][kc]) = make_uint4(0, 0, 0, 0);
      }
      const int br = b_row(r);
      if (br >= 0 && k_ok) {
        cp_async_16(&bs[stage][r][kc], we + static_cast<int64_t>(br) * k_dim + k0 + kc);
      } else {
        *reinterpret_cast<uint4*>(&bs[stage][r][kc]) = make_uint4(0, 0, 0, 0);
      }
    }
    cp_async_commit();
  };
  const int warp = tid >> 5, lane = tid & 31;
  const int wm = warp >> 1, wn = warp & 1;
  const int g = lane >> 2, q = lane & 3;
  float acc[2][4][4] = {};
  load(0, 0);
  for (int kt = 0; kt < k_tiles; ++kt) {
    const int stage = kt & 1;
    if (kt + 1 < k_tiles) {
      load(stage ^ 1, kt + 1);
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < kBK; kk += 16) {
      uint32_t af[2][4];
#pragma unroll
      for (int mi = 0; mi < 2; ++mi) {
        const int r = wm * 32 + mi * 16 + g;
        af[mi][0] = *reinterpret_cast<const uint32_t*>(&as[stage][r][kk + q * 2]);
        af[mi][1] = *reinterpret_cast<const uint32_t*>(&as[stage][r + 8][kk + q * 2]);
        af[mi][2] = *reinterpret_cast<const uint32_t*>(&as[stage][r][kk + q * 2 + 8]);
        af[mi][3] = *reinterpret_cast<const uint32_t*>(&as[stage][r + 8][kk + q * 2 + 8]);
      }
#pragma unroll
      for (int ni = 0; ni < 4; ++ni) {
        const int n = wn * 32 + ni * 8 + g;
        const uint32_t b0 = *reinterpret_cast<const uint32_t*>(&bs[stage][n][kk + q * 2]);
        const uint32_t b1 = *reinterpret_cast<const uint32_t*>(&bs[stage][n][kk + q * 2 + 8]);
#pragma unroll
        for (int mi = 0; mi < 2; ++mi) MmaOps<T>::mma(acc[mi][ni], af[mi], b0, b1);
      }
    }
    __syncthreads();  // the stage is refilled next iteration
  }
  // Epilogue. C fragment: c[0], c[1] at (row g, cols 2q, 2q + 1), c[2], c[3] at row g + 8.
#pragma unroll
  for (int mi = 0; mi < 2; ++mi) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int p = m0 + wm * 32 + mi * 16 + g + half * 8;
      if (p >= m_end) continue;
      T* orow = out + static_cast<int64_t>(p) * n_dim;
      if (kGateUp) {
#pragma unroll
        for (int ni = 0; ni < 2; ++ni) {
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            const int j = n0 + wn * 16 + ni * 8 + q * 2 + c;
            if (j >= n_dim) continue;
            const float gv = dev::round_to<T>(acc[mi][ni][half * 2 + c]);
            const float uv = dev::round_to<T>(acc[mi][ni + 2][half * 2 + c]);
            orow[j] = dev::from_float<T>(dev::round_to<T>(silu(gv)) * uv);
          }
        }
      } else {
#pragma unroll
        for (int ni = 0; ni < 4; ++ni) {
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            const int n = n0 + wn * 32 + ni * 8 + q * 2 + c;
            if (n < n_dim) orow[n] = dev::from_float<T>(acc[mi][ni][half * 2 + c]);
          }
        }
      }
    }
  }
}

// ---- GEMV (decode) ----
//
// Both kernels are launched with launch_pdl (cuda_util.h): their launch overlaps the kernel
// before, and everything an earlier kernel wrote is read after dev::pdl_wait().
//
// gate_up: grid (output groups, pairs); each warp computes O outputs of its pair's expert: their
// gate rows and up rows streamed together, U 16-byte pieces of each row per lane in flight, so a
// batch-1 step reads the chosen experts' rows and nothing else. The block stages the input row
// in shared memory.
//
// down + combine: grid (hidden / SR, tokens); warp j of a block computes its token's j-th local
// slot (by expert) on the block's SR output rows: one expert's contiguous rows (a warp per output
// row across the slots' experts read 512-byte pieces of eight experts at once and ran at 0.37 of
// the copy bandwidth). Then the block combines them (kernels/cpu/moe.h's order: slots by expert,
// each product rounded, summed in the run dtype; + the shared expert's gated row) through shared
// memory: the y rows the grouped path stores never exist. The activation rows are staged in
// shared memory once (top_k x inter, up to kMaxGemvSmem: wider layers take the grouped path).
// The blocks start while gate_up still runs (gate_up calls pdl_launch_dependents after its own
// pdl_wait, so the router's ids are final by then): they read the ids and order the slots before
// they wait for the activations.
//
// The tiles (moe.h's MoeGemvTiles), from moe_bench at Qwen3-30B-A3B's widths, batch 1, six
// layers' experts in turn (so from HBM), H100. Alone, more pieces in flight are faster: gate_up
// 2 outputs x 4 pieces 18.67 us = 0.89 of the copy bandwidth (2x1: 22.20 = 0.75; 2x2 19.52, 1x4
// 20.79, 1x8 19.90), down 8 rows x 2 pieces 11.00 us = 0.75 (8x1: 12.05; 8x3 10.98, 4x1 11.45,
// 4x3 13.40). The whole block (router, route, gate_up, down, each waiting for the one before)
// follows only for down: in two calls, 36.41 / 35.98 us with gate_up 2x1 and down 8x2 against
// 36.72 / 36.26 with 2x1 and 8x1, but 36.86 / 36.41 with gate_up 2x4 and 37.15 / 36.66 with 2x4
// and 8x1. So gate_up takes 2x1 and down 8x2 (moe_bench times the whole block with each set).
//
// Down's blocks also ask L2 for their experts' rows before they wait (dev::warp_prefetch_l2, the
// first l2_prefetch_budget() / rows bytes of each: all of them at batch 1), so the rows stream in
// while gate_up still runs: down + combine 11.02 -> 10.12 us (moe_bench, H100, Qwen3-30B-A3B
// widths, batch 1; the whole block 36.03 -> 34.92 us in the same run, 0.19 us of which was a
// router GEMV prefetch that was not kept). The same prefetch in the dense GEMV
// (gemv.cu), whose kernel before is short, made qkv and o slower (8.91 -> 11.24, 7.87 -> 10.38 us).

constexpr int kGemvWarps = 8;
// Lets `kernel` take `smem` bytes of dynamic shared memory (past the 48 KiB default).
template <typename Kernel>
cudaError_t allow_smem(Kernel kernel, size_t smem) {
  if (smem <= 48 * 1024) return cudaSuccess;
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                              static_cast<int>(smem));
}
// The GEMV kernels' shared memory: gate_up's input row (1 x hidden), down's activation rows
// (top_k x inter).
constexpr size_t kMaxGemvSmem = 200 * 1024;
size_t moe_gemv_smem_bytes(DType dtype, int64_t top_k, int64_t inter) {
  return static_cast<size_t>(top_k * inter) * dtype_size(dtype);
}

// Activations another kernel wrote: through L2 (not the non-coherent path).
template <typename T>
__device__ __forceinline__ void load8_l2(const T* p, float (&out)[dev::kHalfVec]) {
  dev::unpack8<T>(__ldcg(reinterpret_cast<const uint4*>(p)), out);
}

// O: outputs per warp (O gate rows and their O up rows); U: the lane's 16-byte pieces of each
// row loaded before the first is used (U x 2 O loads in flight per lane).
template <typename T, int O, int U>
__global__ void __launch_bounds__(kGemvWarps * 32)
    gemv_gate_up_kernel(const T* __restrict__ x, const int32_t* __restrict__ ids, int top_k,
                        int expert_begin, int local_experts, const T* __restrict__ w, int k_dim,
                        int n_dim, T* __restrict__ out) {
  constexpr int kRowsPerWarp = 2 * O;
  extern __shared__ uint4 x_smem[];  // the pair's input row
  block_trace::Mark mark;
  dev::pdl_wait();
  mark.wait_returned();
  dev::pdl_launch_dependents();
  const int p = blockIdx.y;
  // The pair's expert and the input row are asked for together (one round trip to L2): the
  // input row once per block into shared memory (every warp of every pair of the token reads it:
  // from L2 that was a quarter of the weights' bytes, all from the same few lines).
  const int e = ids[p] - expert_begin;
  const int vecs = k_dim / dev::kHalfVec;
  const uint4* xr = reinterpret_cast<const uint4*>(x + static_cast<int64_t>(p / top_k) * k_dim);
  for (int v = static_cast<int>(threadIdx.x); v < vecs; v += blockDim.x) x_smem[v] = __ldcg(xr + v);
  if (e < 0 || e >= local_experts) return;  // the whole block: e is the pair's
  __syncthreads();
  const T* we = w + static_cast<int64_t>(e) * 2 * n_dim * k_dim;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int first = (blockIdx.x * kGemvWarps + warp) * O;
  if (first >= n_dim) return;
  const T* rows[kRowsPerWarp];
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    // rows [0, O): the gate rows of outputs first .. first + O - 1; [O, 2 O): their up rows (a
    // row past the outputs reads the last one again, and is not stored).
    const int n = min(first + r % O, n_dim - 1);
    const int row = r >= O ? n_dim + n : n;
    rows[r] = we + static_cast<int64_t>(row) * k_dim;
  }
  float s[kRowsPerWarp] = {};
  for (int i0 = lane; i0 < vecs; i0 += 32 * U) {
    uint4 raw[U][kRowsPerWarp];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int i = min(i0 + 32 * u, vecs - 1);  // past the row: loaded, not used
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r)
        raw[u][r] = dev::ldg_stream(rows[r] + i * dev::kHalfVec);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (i0 + 32 * u >= vecs) break;
      float xv[dev::kHalfVec];
      dev::unpack8<T>(x_smem[i0 + 32 * u], xv);
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r) {
        float wv[dev::kHalfVec];
        dev::unpack8<T>(raw[u][r], wv);
#pragma unroll
        for (int j = 0; j < dev::kHalfVec; ++j) s[r] = fmaf(wv[j], xv[j], s[r]);
      }
    }
  }
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) s[r] = dev::warp_sum(s[r]);
  if (lane != 0) return;
#pragma unroll
  for (int o = 0; o < O; ++o) {
    const int n = first + o;
    if (n >= n_dim) break;
    const float gv = dev::round_to<T>(s[o]), uv = dev::round_to<T>(s[O + o]);
    out[static_cast<int64_t>(p) * n_dim + n] = dev::from_float<T>(dev::round_to<T>(silu(gv)) * uv);
  }
  mark.end(block_trace::Kernel::kGateUp);
}

// SR: output rows of one expert a warp reads; U: the lane's 16-byte pieces of each row loaded
// before the first is used (U x SR loads in flight per lane).
template <typename T, int SR, int U>
__global__ void __launch_bounds__(kGemvWarps * 32)
    gemv_down_combine_kernel(const T* __restrict__ act, const int32_t* __restrict__ ids,
                             const float* __restrict__ weights, int top_k, int expert_begin,
                             int local_experts, const T* __restrict__ w, int inter, int hidden,
                             const T* __restrict__ x, const T* __restrict__ shared_gate,
                             const T* __restrict__ shared_out, T* __restrict__ out,
                             int prefetch_bytes) {
  block_trace::Mark mark;
  extern __shared__ uint4 act_smem[];
  __shared__ int32_t slot_ids[kMaxTopK];
  __shared__ int32_t order[kMaxTopK];
  __shared__ float slot_w[kMaxTopK];
  __shared__ float y_s[kMaxTopK][SR];
  __shared__ int n_local;
  __shared__ float scratch[32];
  const int t = blockIdx.y;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int tid = static_cast<int>(threadIdx.x);
  if (tid < top_k) slot_ids[tid] = ids[static_cast<int64_t>(t) * top_k + tid];
  if (tid == 0) n_local = 0;
  __syncthreads();
  if (tid < top_k) {
    const int e = slot_ids[tid];
    if (e - expert_begin >= 0 && e - expert_begin < local_experts) {
      int rank = 0;
      for (int j = 0; j < top_k; ++j) {
        const int f = slot_ids[j];
        const bool local = f - expert_begin >= 0 && f - expert_begin < local_experts;
        rank += local && (f < e || (f == e && j < tid));
      }
      order[rank] = tid;
      slot_w[rank] = dev::round_to<T>(weights[static_cast<int64_t>(t) * top_k + tid]);
      atomicAdd(&n_local, 1);
    }
  }
  __syncthreads();
  const int nl = n_local;
  const int n0 = blockIdx.x * SR;
  // The block's rows of its experts into L2 while gate_up runs (the first prefetch_bytes of each).
  for (int j = warp; j < nl; j += kGemvWarps) {
    const T* base = w + (static_cast<int64_t>(slot_ids[order[j]] - expert_begin) * hidden) * inter;
    for (int r = 0; r < SR && n0 + r < hidden; ++r) {
      dev::warp_prefetch_l2(base + static_cast<int64_t>(n0 + r) * inter, prefetch_bytes, lane);
    }
  }
  dev::pdl_wait();
  mark.wait_returned();
  dev::pdl_launch_dependents();
  const int vecs = inter / dev::kHalfVec;
  for (int v = tid; v < nl * vecs; v += blockDim.x) {
    const int j = v / vecs, c = v - j * vecs;
    act_smem[v] = __ldcg(
        reinterpret_cast<const uint4*>(act + (static_cast<int64_t>(t) * top_k + order[j]) * inter) +
        c);
  }
  __syncthreads();
  float gate = 0.0f;
  if (shared_out != nullptr) {
    float sum = 0.0f;
    const T* xr = x + static_cast<int64_t>(t) * hidden;
    for (int h = tid; h < hidden; h += blockDim.x) {
      sum = fmaf(dev::to_float(__ldcg(xr + h)), dev::to_float(shared_gate[h]), sum);
    }
    const float logit = dev::round_to<T>(dev::block_sum(sum, scratch));
    gate = dev::round_to<T>(1.0f / (1.0f + expf(-logit)));
  }
  for (int j = warp; j < nl; j += kGemvWarps) {
    const T* base = w + (static_cast<int64_t>(slot_ids[order[j]] - expert_begin) * hidden) * inter;
    float s[SR] = {};
    for (int i0 = lane; i0 < vecs; i0 += 32 * U) {
      uint4 raw[U][SR];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int i = min(i0 + 32 * u, vecs - 1);  // past the row: loaded, not used
#pragma unroll
        for (int r = 0; r < SR; ++r) {
          const int n = min(n0 + r, hidden - 1);
          raw[u][r] = dev::ldg_stream(base + static_cast<int64_t>(n) * inter + i * dev::kHalfVec);
        }
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (i0 + 32 * u >= vecs) break;
        float av[dev::kHalfVec];
        dev::unpack8<T>(act_smem[j * vecs + i0 + 32 * u], av);
#pragma unroll
        for (int r = 0; r < SR; ++r) {
          float wv[dev::kHalfVec];
          dev::unpack8<T>(raw[u][r], wv);
#pragma unroll
          for (int q = 0; q < dev::kHalfVec; ++q) s[r] = fmaf(wv[q], av[q], s[r]);
        }
      }
    }
#pragma unroll
    for (int r = 0; r < SR; ++r) {
      s[r] = dev::warp_sum(s[r]);
      if (lane == 0) y_s[j][r] = s[r];
    }
  }
  __syncthreads();
  if (tid >= SR || n0 + tid >= hidden) return;
  float acc = 0.0f;
  for (int j = 0; j < nl; ++j) {
    acc = dev::round_to<T>(acc + dev::round_to<T>(dev::round_to<T>(y_s[j][tid]) * slot_w[j]));
  }
  const int n = n0 + tid;
  if (shared_out != nullptr) {
    const float sv = dev::to_float(__ldcg(shared_out + static_cast<int64_t>(t) * hidden + n));
    acc = acc + dev::round_to<T>(gate * sv);
  }
  out[static_cast<int64_t>(t) * hidden + n] = dev::from_float<T>(acc);
  mark.end(block_trace::Kernel::kDown);
}

// ---- combine ----

constexpr int kCombineThreads = 256;

template <typename T>
__global__ void __launch_bounds__(kCombineThreads)
    combine_kernel(const T* __restrict__ y, const int32_t* __restrict__ pos,
                   const int32_t* __restrict__ ids, const float* __restrict__ weights, int top_k,
                   int hidden, int expert_begin, int local_experts, const T* __restrict__ x,
                   const T* __restrict__ shared_gate, const T* __restrict__ shared_out,
                   T* __restrict__ out) {
  __shared__ int32_t row[kMaxTopK];
  __shared__ float wt[kMaxTopK];
  __shared__ int n_rows;
  __shared__ float scratch[32];
  const int t = blockIdx.x;
  if (threadIdx.x == 0) {
    // This token's local slots sorted by expert (insertion sort of <= 32): transformers adds
    // the experts' rows in expert order.
    int ek[kMaxTopK];
    int n = 0;
    for (int k = 0; k < top_k; ++k) {
      const int i = t * top_k + k;
      const int e = ids[i];
      if (e - expert_begin < 0 || e - expert_begin >= local_experts) continue;
      int j = n++;
      while (j > 0 && ek[j - 1] > e) {
        ek[j] = ek[j - 1];
        row[j] = row[j - 1];
        wt[j] = wt[j - 1];
        --j;
      }
      ek[j] = e;
      row[j] = pos != nullptr ? pos[i] : i;
      wt[j] = dev::round_to<T>(weights[i]);  // routing_weights.to(hidden dtype)
    }
    n_rows = n;
  }
  __syncthreads();
  float gate = 0.0f;
  if (shared_out != nullptr) {
    float s = 0.0f;
    const T* xr = x + static_cast<int64_t>(t) * hidden;
    for (int h = threadIdx.x; h < hidden; h += blockDim.x) {
      s = fmaf(dev::to_float(xr[h]), dev::to_float(shared_gate[h]), s);
    }
    const float logit = dev::round_to<T>(dev::block_sum(s, scratch));
    gate = dev::round_to<T>(1.0f / (1.0f + expf(-logit)));
  }
  const int n = n_rows;
  for (int h = threadIdx.x; h < hidden; h += blockDim.x) {
    float acc = 0.0f;
    for (int j = 0; j < n; ++j) {
      const float v = dev::to_float(y[static_cast<int64_t>(row[j]) * hidden + h]);
      acc = dev::round_to<T>(acc + dev::round_to<T>(v * wt[j]));
    }
    if (shared_out != nullptr) {
      const float s = dev::to_float(shared_out[static_cast<int64_t>(t) * hidden + h]);
      acc = acc + dev::round_to<T>(gate * s);
    }
    out[static_cast<int64_t>(t) * hidden + h] = dev::from_float<T>(acc);
  }
}

Status check_experts(const MoeExperts& w, const char* op) {
  if (w.gate_up == nullptr || w.down == nullptr || w.local_experts < 1 ||
      w.local_experts > kMaxExperts || w.hidden < 8 || w.hidden % 8 != 0 || w.inter < 8 ||
      w.inter % 8 != 0) {
    return invalid_argument(std::string(op) + ": experts " + std::to_string(w.local_experts) +
                            " (1 .. " + std::to_string(kMaxExperts) + "), hidden " +
                            std::to_string(w.hidden) + " and inter " + std::to_string(w.inter) +
                            " (multiples of 8), weights " +
                            (w.gate_up != nullptr && w.down != nullptr ? "set" : "missing"));
  }
  return Status::ok();
}

Status check_dtype(DType dtype, const char* op) {
  if (!is_half_type(dtype)) {
    return invalid_argument(std::string(op) + ": dtype " + dtype_name(dtype) +
                            " is not bf16 or fp16");
  }
  return Status::ok();
}

template <typename Fn>
void dispatch(DType dtype, Fn&& fn) {
  if (dtype == DType::kBF16) {
    fn(__nv_bfloat16{});
  } else {
    fn(__half{});
  }
}

// The workspace's pieces, in order: common/checkpoint/moe_carve.h (the planner counts the same
// bytes).
using Carve = MoeCarve;

// A MoeCount the kernels take: counts set, a local range within kMaxExperts.
Status check_count(const MoeCount& c, const char* op) {
  if (c.counts == nullptr || c.expert_begin < 0 || c.local_experts < 1 ||
      c.expert_begin + c.local_experts > kMaxExperts) {
    return invalid_argument(std::string(op) + ": expert counts " +
                            (c.counts != nullptr ? "set" : "missing") + ", experts [" +
                            std::to_string(c.expert_begin) + ", +" +
                            std::to_string(c.local_experts) + ")");
  }
  return Status::ok();
}

}  // namespace

Status moe_route(const float* logits, DType logits_dtype, int64_t tokens, int64_t experts,
                 int64_t top_k, bool renormalize, int32_t* ids, float* weights, cudaStream_t stream,
                 const MoeCount& count) {
  if (logits_dtype != DType::kF32 && !is_half_type(logits_dtype)) {
    return invalid_argument(std::string("moe_route: logits dtype ") + dtype_name(logits_dtype) +
                            " is not F32, BF16 or F16");
  }
  if (experts < 1 || experts > kMaxExperts || top_k < 1 || top_k > experts || top_k > kMaxTopK ||
      tokens < 0) {
    return invalid_argument("moe_route: " + std::to_string(experts) + " experts (1 .. " +
                            std::to_string(kMaxExperts) + "), top_k " + std::to_string(top_k) +
                            " (1 .. min(experts, " + std::to_string(kMaxTopK) + "))");
  }
  if (count.counts != nullptr) TESSERA_RETURN_IF_ERROR(check_count(count, "moe_route"));
  if (tokens == 0) return Status::ok();
  const int blocks = static_cast<int>((tokens + kRouteWarps - 1) / kRouteWarps);
  auto launch = [&](auto tag, auto per_lane) -> Status {
    using R = decltype(tag);
    TESSERA_CUDA_RETURN_IF_ERROR(
        launch_pdl(route_kernel<R, decltype(per_lane)::value>, dim3(blocks), dim3(kRouteWarps * 32),
                   0, stream, logits, static_cast<int>(tokens), static_cast<int>(experts),
                   static_cast<int>(top_k), renormalize, ids, weights, count),
        "moe_route");
    return launch_status("moe_route");
  };
  // Registers per lane for the experts: 4 (<= 128), 8 (<= 256), 32 (<= 1024) or 128.
  auto by_width = [&](auto tag) -> Status {
    if (experts <= 128) return launch(tag, std::integral_constant<int, 4>{});
    if (experts <= 256) return launch(tag, std::integral_constant<int, 8>{});
    if (experts <= 1024) return launch(tag, std::integral_constant<int, 32>{});
    return launch(tag, std::integral_constant<int, 128>{});
  };
  if (logits_dtype == DType::kBF16) return by_width(__nv_bfloat16{});
  if (logits_dtype == DType::kF16) return by_width(__half{});
  return by_width(float{});
}

Status moe_count_experts(const int32_t* ids, int64_t tokens, int64_t top_k, const MoeCount& count,
                         cudaStream_t stream) {
  TESSERA_RETURN_IF_ERROR(check_count(count, "moe_count_experts"));
  if (tokens < 0 || top_k < 1 || top_k > kMaxTopK || tokens * top_k > (int64_t{1} << 30)) {
    return invalid_argument("moe_count_experts: tokens " + std::to_string(tokens) + ", top_k " +
                            std::to_string(top_k));
  }
  const int64_t pairs = tokens * top_k;
  if (pairs == 0) return Status::ok();
  const dim3 grid(static_cast<unsigned>((pairs + kCountThreads - 1) / kCountThreads));
  TESSERA_CUDA_RETURN_IF_ERROR(launch_pdl(count_kernel, grid, dim3(kCountThreads), 0, stream, ids,
                                          static_cast<int>(pairs), static_cast<int>(top_k), count),
                               "moe_count_experts");
  return launch_status("moe_count_experts");
}

Status moe_permute(const int32_t* ids, int64_t tokens, int64_t top_k, int64_t expert_begin,
                   int64_t local_experts, const MoePermutation& perm, cudaStream_t stream) {
  if (local_experts < 1 || local_experts > kMaxExperts || top_k < 1 || tokens < 0) {
    return invalid_argument("moe_permute: " + std::to_string(local_experts) +
                            " local experts (1 .. " + std::to_string(kMaxExperts) + "), top_k " +
                            std::to_string(top_k));
  }
  const size_t smem = 2 * sizeof(int32_t) * static_cast<size_t>(local_experts);
  permute_kernel<<<1, kPermuteThreads, smem, stream>>>(
      ids, static_cast<int>(tokens * top_k), static_cast<int>(expert_begin),
      static_cast<int>(local_experts), perm.offsets, perm.tiles, perm.rows, perm.pos,
      static_cast<int>(top_k));
  return launch_status("moe_permute");
}

namespace {

template <bool kGateUp>
Status launch_grouped(DType dtype, const void* a, const int32_t* rows, const MoeExperts& w,
                      const MoePermutation& perm, int64_t max_rows, void* out, cudaStream_t stream,
                      const char* op) {
  TESSERA_RETURN_IF_ERROR(check_dtype(dtype, op));
  TESSERA_RETURN_IF_ERROR(check_experts(w, op));
  if (max_rows <= 0) return Status::ok();
  // Each expert's rows start a tile: at most max_rows / 64 full tiles plus one partial each.
  const int64_t m_tiles =
      (max_rows + kMoeTileRows - 1) / kMoeTileRows + std::min<int64_t>(w.local_experts, max_rows);
  const int64_t n = kGateUp ? w.inter : w.hidden;
  const int64_t k = kGateUp ? w.hidden : w.inter;
  const int64_t per_block = kGateUp ? kBN / 2 : kBN;
  const dim3 grid(static_cast<unsigned>(m_tiles),
                  static_cast<unsigned>((n + per_block - 1) / per_block));
  dispatch(dtype, [&](auto tag) {
    using T = decltype(tag);
    grouped_gemm_kernel<T, kGateUp><<<grid, kGemmThreads, 0, stream>>>(
        static_cast<const T*>(a), rows, static_cast<const T*>(kGateUp ? w.gate_up : w.down),
        perm.offsets, perm.tiles, static_cast<int>(w.local_experts), static_cast<int>(k),
        static_cast<int>(n), static_cast<T*>(out));
  });
  return launch_status(op);
}

}  // namespace

Status moe_grouped_gate_up(DType dtype, const void* x, const MoeExperts& w,
                           const MoePermutation& perm, int64_t max_rows, void* act,
                           cudaStream_t stream) {
  return launch_grouped<true>(dtype, x, perm.rows, w, perm, max_rows, act, stream,
                              "moe_grouped_gate_up");
}

Status moe_grouped_down(DType dtype, const void* act, const MoeExperts& w,
                        const MoePermutation& perm, int64_t max_rows, void* y,
                        cudaStream_t stream) {
  return launch_grouped<false>(dtype, act, nullptr, w, perm, max_rows, y, stream,
                               "moe_grouped_down");
}

template <typename T, int O, int U>
cudaError_t launch_gate_up(dim3 grid_y, size_t smem, cudaStream_t stream, const void* x,
                           const int32_t* ids, int64_t top_k, const MoeExperts& w, void* act) {
  auto kernel = gemv_gate_up_kernel<T, O, U>;
  cudaError_t err = allow_smem(kernel, smem);
  if (err != cudaSuccess) return err;
  const int64_t per_block = kGemvWarps * O;
  const dim3 grid(static_cast<unsigned>((w.inter + per_block - 1) / per_block), grid_y.y);
  return launch_pdl(kernel, grid, dim3(kGemvWarps * 32), smem, stream, static_cast<const T*>(x),
                    ids, static_cast<int>(top_k), static_cast<int>(w.expert_begin),
                    static_cast<int>(w.local_experts), static_cast<const T*>(w.gate_up),
                    static_cast<int>(w.hidden), static_cast<int>(w.inter), static_cast<T*>(act));
}

template <typename T, int SR, int U>
cudaError_t launch_down(dim3 grid_y, size_t smem, cudaStream_t stream, const void* act,
                        const int32_t* ids, const float* weights, int64_t top_k,
                        const MoeExperts& w, const void* x, const void* shared_gate,
                        const void* shared_out, void* out) {
  auto kernel = gemv_down_combine_kernel<T, SR, U>;
  cudaError_t err = allow_smem(kernel, smem);
  if (err != cudaSuccess) return err;
  const dim3 grid(static_cast<unsigned>((w.hidden + SR - 1) / SR), grid_y.y);
  // Each expert row's first bytes, as many as fit l2_prefetch_budget() over the rows the pairs
  // read (tokens x top_k x hidden), in whole lines.
  const int64_t rows = static_cast<int64_t>(grid_y.y) * top_k * w.hidden;
  const int64_t prefetch =
      std::min(w.inter * static_cast<int64_t>(sizeof(T)), l2_prefetch_budget() / rows / 128 * 128);
  return launch_pdl(kernel, grid, dim3(kGemvWarps * 32), smem, stream, static_cast<const T*>(act),
                    ids, weights, static_cast<int>(top_k), static_cast<int>(w.expert_begin),
                    static_cast<int>(w.local_experts), static_cast<const T*>(w.down),
                    static_cast<int>(w.inter), static_cast<int>(w.hidden), static_cast<const T*>(x),
                    static_cast<const T*>(shared_gate), static_cast<const T*>(shared_out),
                    static_cast<T*>(out), static_cast<int>(prefetch));
}

Status moe_gemv_gate_up(DType dtype, const void* x, const int32_t* ids, int64_t tokens,
                        int64_t top_k, const MoeExperts& w, void* act, cudaStream_t stream,
                        const MoeGemvTiles& tiles) {
  TESSERA_RETURN_IF_ERROR(check_dtype(dtype, "moe_gemv_gate_up"));
  TESSERA_RETURN_IF_ERROR(check_experts(w, "moe_gemv_gate_up"));
  const int64_t pairs = tokens * top_k;
  if (pairs <= 0) return Status::ok();
  if (pairs > 65535) return invalid_argument("moe_gemv_gate_up: more than 65535 pairs");
  const dim3 grid_y(1, static_cast<unsigned>(pairs));
  cudaError_t err = cudaSuccess;
  const size_t smem = static_cast<size_t>(w.hidden) * dtype_size(dtype);
  if (smem > kMaxGemvSmem) {
    return invalid_argument("moe_gemv_gate_up: hidden " + std::to_string(w.hidden) +
                            " exceeds the shared memory for the input row");
  }
  bool known = true;
  dispatch(dtype, [&](auto tag) {
    using T = decltype(tag);
    switch (tiles.gate_up_outs * 100 + tiles.gate_up_unroll) {
      case 201:
        err = launch_gate_up<T, 2, 1>(grid_y, smem, stream, x, ids, top_k, w, act);
        break;
      case 202:
        err = launch_gate_up<T, 2, 2>(grid_y, smem, stream, x, ids, top_k, w, act);
        break;
      case 204:
        err = launch_gate_up<T, 2, 4>(grid_y, smem, stream, x, ids, top_k, w, act);
        break;
      case 104:
        err = launch_gate_up<T, 1, 4>(grid_y, smem, stream, x, ids, top_k, w, act);
        break;
      case 108:
        err = launch_gate_up<T, 1, 8>(grid_y, smem, stream, x, ids, top_k, w, act);
        break;
      default:
        known = false;
    }
  });
  if (!known) {
    return invalid_argument(
        "moe_gemv_gate_up: no kernel for " + std::to_string(tiles.gate_up_outs) + " outputs x " +
        std::to_string(tiles.gate_up_unroll) + " pieces per warp (it has 2x1, 2x2, 2x4, 1x4, 1x8)");
  }
  TESSERA_CUDA_RETURN_IF_ERROR(err, "moe_gemv_gate_up");
  return launch_status("moe_gemv_gate_up");
}

Status moe_gemv_down_combine(DType dtype, const void* act, const int32_t* ids, const float* weights,
                             int64_t tokens, int64_t top_k, const MoeExperts& w, const void* x,
                             const void* shared_gate, const void* shared_out, void* out,
                             cudaStream_t stream, const MoeGemvTiles& tiles) {
  TESSERA_RETURN_IF_ERROR(check_dtype(dtype, "moe_gemv_down_combine"));
  TESSERA_RETURN_IF_ERROR(check_experts(w, "moe_gemv_down_combine"));
  if (top_k < 1 || top_k > kMaxTopK) {
    return invalid_argument("moe_gemv_down_combine: top_k " + std::to_string(top_k) + " (1 .. " +
                            std::to_string(kMaxTopK) + ")");
  }
  if (shared_out != nullptr && (x == nullptr || shared_gate == nullptr)) {
    return invalid_argument("moe_gemv_down_combine: a shared expert's output needs x and its gate");
  }
  if (tokens <= 0) return Status::ok();
  if (tokens > 65535) return invalid_argument("moe_gemv_down_combine: more than 65535 tokens");
  const size_t smem = moe_gemv_smem_bytes(dtype, top_k, w.inter);
  if (smem > kMaxGemvSmem) {
    return invalid_argument("moe_gemv_down_combine: top_k x inter = " + std::to_string(top_k) +
                            " x " + std::to_string(w.inter) + " activations exceed " +
                            std::to_string(kMaxGemvSmem) + " bytes of shared memory");
  }
  const dim3 grid_y(1, static_cast<unsigned>(tokens));
  cudaError_t err = cudaSuccess;
  bool known = true;
  dispatch(dtype, [&](auto tag) {
    using T = decltype(tag);
    const auto go = [&](auto sr, auto u) {
      return launch_down<T, decltype(sr)::value, decltype(u)::value>(
          grid_y, smem, stream, act, ids, weights, top_k, w, x, shared_gate, shared_out, out);
    };
    using I1 = std::integral_constant<int, 1>;
    using I2 = std::integral_constant<int, 2>;
    using I3 = std::integral_constant<int, 3>;
    using I4 = std::integral_constant<int, 4>;
    using I8 = std::integral_constant<int, 8>;
    switch (tiles.down_rows * 100 + tiles.down_unroll) {
      case 801:
        err = go(I8{}, I1{});
        break;
      case 802:
        err = go(I8{}, I2{});
        break;
      case 803:
        err = go(I8{}, I3{});
        break;
      case 401:
        err = go(I4{}, I1{});
        break;
      case 403:
        err = go(I4{}, I3{});
        break;
      default:
        known = false;
    }
  });
  if (!known) {
    return invalid_argument(
        "moe_gemv_down_combine: no kernel for " + std::to_string(tiles.down_rows) + " rows x " +
        std::to_string(tiles.down_unroll) + " pieces per warp (it has 8x1, 8x2, 8x3, 4x1, 4x3)");
  }
  TESSERA_CUDA_RETURN_IF_ERROR(err, "moe_gemv_down_combine");
  return launch_status("moe_gemv_down_combine");
}

Status moe_combine(DType dtype, const void* y, const int32_t* pos, const int32_t* ids,
                   const float* weights, int64_t tokens, int64_t top_k, int64_t hidden,
                   int64_t expert_begin, int64_t local_experts, const void* x,
                   const void* shared_gate, const void* shared_out, void* out,
                   cudaStream_t stream) {
  TESSERA_RETURN_IF_ERROR(check_dtype(dtype, "moe_combine"));
  if (top_k < 1 || top_k > kMaxTopK || hidden < 1) {
    return invalid_argument("moe_combine: top_k " + std::to_string(top_k) + " (1 .. " +
                            std::to_string(kMaxTopK) + "), hidden " + std::to_string(hidden));
  }
  if (shared_out != nullptr && (x == nullptr || shared_gate == nullptr)) {
    return invalid_argument("moe_combine: a shared expert's output needs x and its gate");
  }
  if (tokens <= 0) return Status::ok();
  dispatch(dtype, [&](auto tag) {
    using T = decltype(tag);
    combine_kernel<T><<<static_cast<unsigned>(tokens), kCombineThreads, 0, stream>>>(
        static_cast<const T*>(y), pos, ids, weights, static_cast<int>(top_k),
        static_cast<int>(hidden), static_cast<int>(expert_begin), static_cast<int>(local_experts),
        static_cast<const T*>(x), static_cast<const T*>(shared_gate),
        static_cast<const T*>(shared_out), static_cast<T*>(out));
  });
  return launch_status("moe_combine");
}

uint64_t moe_workspace_bytes(DType dtype, int64_t max_tokens, int64_t num_experts, int64_t top_k,
                             int64_t local_experts, int64_t hidden, int64_t inter,
                             int64_t shared_inter) {
  return Carve::make(dtype, max_tokens, num_experts, top_k, local_experts, hidden, inter,
                     shared_inter)
      .bytes;
}

Status moe_forward(const MoeArgs& a, Gemm& gemm, cudaStream_t stream) {
  TESSERA_RETURN_IF_ERROR(check_dtype(a.dtype, "moe"));
  TESSERA_RETURN_IF_ERROR(check_experts(a.experts, "moe"));
  const MoeExperts& w = a.experts;
  const int64_t T = a.tokens, K = a.top_k, H = w.hidden, P = T * K;
  if (T <= 0) return Status::ok();
  const bool shared = a.shared_gate_up != nullptr;
  if (shared &&
      (a.shared_down == nullptr || a.shared_expert_gate == nullptr || a.shared_inter < 1)) {
    return invalid_argument("moe: the shared expert needs gate_up, down, its gate and a width");
  }
  const Carve c = Carve::make(a.dtype, T, a.num_experts, K, w.local_experts, H, w.inter,
                              shared ? a.shared_inter : 0);
  if (a.workspace == nullptr || c.bytes > a.workspace_bytes) {
    return invalid_argument("moe: the workspace has " + std::to_string(a.workspace_bytes) +
                            " bytes, " + std::to_string(T) + " tokens need " +
                            std::to_string(c.bytes));
  }
  char* ws = static_cast<char*>(a.workspace);
  auto* logits = reinterpret_cast<float*>(ws + c.logits);
  auto* ids = reinterpret_cast<int32_t*>(ws + c.ids);
  auto* weights = reinterpret_cast<float*>(ws + c.weights);
  void* act = ws + c.act;
  void* y = ws + c.y;
  void* sh_out = nullptr;
  if (shared) {  // before the routing: the GEMV path's last kernel reads the routing's ids early
    const int64_t Is = a.shared_inter;
    void* sh_gate_up = ws + c.sh_gate_up;
    void* sh_act = ws + c.sh_act;
    sh_out = ws + c.sh_out;
    TESSERA_RETURN_IF_ERROR(gemm.linear(GemmShape{T, 2 * Is, H, a.dtype, a.dtype, false}, a.x,
                                        a.shared_gate_up, nullptr, sh_gate_up, stream));
    TESSERA_RETURN_IF_ERROR(silu_mul(a.dtype, sh_gate_up, T, Is, sh_act, stream));
    TESSERA_RETURN_IF_ERROR(gemm.linear(GemmShape{T, H, Is, a.dtype, a.dtype, false}, sh_act,
                                        a.shared_down, nullptr, sh_out, stream));
  }
  // The gate Linear's output is a bf16/fp16 tensor in transformers: moe_route rounds the fp32
  // logits to it (what a GEMM with that output dtype gives) before its fp32 softmax.
  const GemmShape router{T, a.num_experts, H, a.dtype, DType::kF32, false};
  if (a.norm != nullptr) {
    if (T != 1 || shared || a.norm->normed != a.x) {
      return invalid_argument(
          "moe: the norm in the router's GEMV takes one token, no shared "
          "expert, and x as the normed row");
    }
    TESSERA_RETURN_IF_ERROR(gemv_add_rms_norm(a.num_experts, H, a.dtype, DType::kF32, *a.norm,
                                              a.router, nullptr, logits, stream));
  } else {
    TESSERA_RETURN_IF_ERROR(gemm.linear(router, a.x, a.router, nullptr, logits, stream));
  }
  MoeCount count;  // the expert balance, counted where the routing is computed
  if (a.expert_counts != nullptr) {
    count = {a.expert_counts, a.count_rows, w.expert_begin, w.local_experts};
  }
  TESSERA_RETURN_IF_ERROR(
      moe_route(logits, a.dtype, T, a.num_experts, K, a.renormalize, ids, weights, stream, count));
  const bool gemv =
      a.path == MoePath::kGemv || (a.path == MoePath::kAuto && P <= kMoeGemvMaxPairs &&
                                   moe_gemv_smem_bytes(a.dtype, K, w.inter) <= kMaxGemvSmem &&
                                   moe_gemv_smem_bytes(a.dtype, 1, H) <= kMaxGemvSmem);
  if (gemv) {
    // moe_gemv_down_combine reads the ids early: moe_gemv_gate_up must be the kernel before it.
    TESSERA_RETURN_IF_ERROR(
        moe_gemv_gate_up(a.dtype, a.x, ids, T, K, w, act, stream, a.gemv_tiles));
    return moe_gemv_down_combine(a.dtype, act, ids, weights, T, K, w, a.x, a.shared_expert_gate,
                                 sh_out, a.out, stream, a.gemv_tiles);
  }
  MoePermutation perm;
  perm.offsets = reinterpret_cast<int32_t*>(ws + c.offsets);
  perm.tiles = reinterpret_cast<int32_t*>(ws + c.tiles);
  perm.rows = reinterpret_cast<int32_t*>(ws + c.rows);
  perm.pos = reinterpret_cast<int32_t*>(ws + c.pos);
  TESSERA_RETURN_IF_ERROR(moe_permute(ids, T, K, w.expert_begin, w.local_experts, perm, stream));
  TESSERA_RETURN_IF_ERROR(moe_grouped_gate_up(a.dtype, a.x, w, perm, P, act, stream));
  TESSERA_RETURN_IF_ERROR(moe_grouped_down(a.dtype, act, w, perm, P, y, stream));
  return moe_combine(a.dtype, y, perm.pos, ids, weights, T, K, H, w.expert_begin, w.local_experts,
                     a.x, a.shared_expert_gate, sh_out, a.out, stream);
}

namespace block_trace {
TESSERA_BLOCK_TRACE_ATTACH(moe)
}  // namespace block_trace

}  // namespace tessera::cuda
