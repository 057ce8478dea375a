// FP8 W8A8 linear layers: the activation quantizers (fused into RMSNorm and silu_mul, and
// standalone), the online weight quantizer, the cuBLASLt FP8 GEMM and the small-m (decode) kernel
// that replaces it at m <= kFp8GemvMaxM. See fp8_linear.h for the contract; the rounding of each
// quantizer is common/checkpoint/quantization.cpp's, line for line (x / a in IEEE fp32 division,
// never a multiply by 1 / a; E4M3 round-to-nearest-even saturating at +-448, which is what
// __nv_cvt_float_to_fp8(.., __NV_SATFINITE, __NV_E4M3) does and what float_to_fp8_e4m3 mirrors on
// the host).
#include "kernels/cuda/fp8_linear.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kernels/cuda/device_math.cuh"
#include "kernels/cuda/elementwise.h"
#include "kernels/cuda/rms_norm.cuh"

namespace tessera::cuda {

namespace {

using dev::kHalfVec;

constexpr int64_t kMaxGridX = 2147483647;
constexpr int64_t kMaxGridY = 65535;
constexpr int kMaxNormHidden = 512 * kHalfVec * 8;  // rms_norm_vec_kernel's V = 8 at 512 threads

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
bool aligned(const void* p, size_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

template <typename T>
struct TypeTag {
  using type = T;
};

template <typename Fn>
Status with_half_type(DType dtype, const char* op, Fn&& fn) {
  if (dtype == DType::kBF16) return fn(TypeTag<__nv_bfloat16>{});
  if (dtype == DType::kF16) return fn(TypeTag<__half>{});
  return invalid_argument(std::string(op) + ": dtype must be BF16 or F16, got " +
                          dtype_name(dtype));
}

// The checks every activation quantizer makes: sizes, and the 16-byte vectors it reads and
// writes (`in` and the output rows of `width` E4M3 bytes).
Status check_rows(const char* op, int64_t rows, int64_t width, float static_scale,
                  std::initializer_list<const void*> in, const uint8_t* q, const float* scales) {
  if (rows < 0 || width <= 0 || width % kHalfVec != 0) {
    return invalid_argument(std::string(op) + ": rows " + std::to_string(rows) + " and width " +
                            std::to_string(width) + " must be >= 0 and a positive multiple of 8");
  }
  if (!(static_scale >= 0.0f) || static_scale > 3.0e38f) {
    return invalid_argument(std::string(op) + ": static_scale " + std::to_string(static_scale) +
                            " is not 0 (dynamic) or a positive finite scale");
  }
  if (rows == 0) return Status::ok();
  for (const void* p : in) {
    if (p == nullptr || !aligned(p, 16)) {
      return invalid_argument(std::string(op) + ": an input is null or not 16-byte aligned");
    }
  }
  if (q == nullptr || scales == nullptr || !aligned(q, 16)) {
    return invalid_argument(std::string(op) + ": q (16-byte aligned) and scales must be set");
  }
  return Status::ok();
}

// ---- device helpers ----

// Max over the whole block of non-negative values; every thread gets it. blockDim.x a multiple
// of 32; `scratch` __shared__ float[32], reusable after (a barrier last).
__device__ __forceinline__ float block_max(float v, float* scratch) {
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int warp = static_cast<int>(threadIdx.x) >> 5;
  const int num_warps = static_cast<int>(blockDim.x) >> 5;
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  }
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float total = lane < num_warps ? scratch[lane] : 0.0f;
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    total = fmaxf(total, __shfl_xor_sync(0xffffffffu, total, offset));
  }
  __syncthreads();
  return total;
}

__device__ __forceinline__ uint8_t to_e4m3(float v) {
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3));
}

// fp8(v[e] / a) for 8 values, packed as 8 bytes.
__device__ __forceinline__ uint2 quantize8(const float (&v)[kHalfVec], float a) {
  uint2 r;
  uint8_t* b = reinterpret_cast<uint8_t*>(&r);
#pragma unroll
  for (int e = 0; e < kHalfVec; ++e) b[e] = to_e4m3(v[e] / a);
  return r;
}

// The row scale: the static one, or max|row| / 448 (1 for a zero row) from this thread's
// `amax` and the block's.
__device__ __forceinline__ float row_scale(float static_scale, float amax, float* scratch) {
  if (static_scale > 0.0f) return static_scale;
  amax = block_max(amax, scratch);
  return amax > 0.0f ? amax / kFp8Max : 1.0f;
}

// ---- fused RMSNorm + quantization: rms_norm_vec_kernel's store policy ----

template <typename T>
struct StoreFp8Row {
  uint8_t* q;
  float* scales;
  float static_scale;
  template <int V, typename Normed>
  __device__ __forceinline__ void row(int64_t row, int64_t hidden, const Normed& normed,
                                      float* scratch) const {
    const int64_t nvec = hidden / kHalfVec;
    float amax = 0.0f;
    if (!(static_scale > 0.0f)) {
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const int64_t j = threadIdx.x + static_cast<int64_t>(k) * blockDim.x;
        if (j < nvec) {
          float h[kHalfVec];
          normed(k, h);
#pragma unroll
          for (int e = 0; e < kHalfVec; ++e) amax = fmaxf(amax, fabsf(dev::round_to<T>(h[e])));
        }
      }
    }
    const float a = row_scale(static_scale, amax, scratch);
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const int64_t j = threadIdx.x + static_cast<int64_t>(k) * blockDim.x;
      if (j < nvec) {
        float h[kHalfVec];
        normed(k, h);
#pragma unroll
        for (int e = 0; e < kHalfVec; ++e) h[e] = dev::round_to<T>(h[e]);
        *reinterpret_cast<uint2*>(q + row * hidden + j * kHalfVec) = quantize8(h, a);
      }
    }
    if (threadIdx.x == 0) scales[row] = a;
  }
};

// ---- standalone and silu_mul quantizers: one CTA per row, two passes over it ----

// `value(j, v)` writes the 8 values (already rounded to the dtype) of vector j of the row.
template <typename Value>
__device__ __forceinline__ void quantize_row(const Value& value, int64_t row, int64_t cols,
                                             float static_scale, uint8_t* q, float* scales,
                                             float* scratch) {
  const int64_t nvec = cols / kHalfVec;
  float amax = 0.0f;
  if (!(static_scale > 0.0f)) {
    for (int64_t j = threadIdx.x; j < nvec; j += blockDim.x) {
      float v[kHalfVec];
      value(j, v);
#pragma unroll
      for (int e = 0; e < kHalfVec; ++e) amax = fmaxf(amax, fabsf(v[e]));
    }
  }
  const float a = row_scale(static_scale, amax, scratch);
  for (int64_t j = threadIdx.x; j < nvec; j += blockDim.x) {
    float v[kHalfVec];
    value(j, v);
    *reinterpret_cast<uint2*>(q + row * cols + j * kHalfVec) = quantize8(v, a);
  }
  if (threadIdx.x == 0) scales[row] = a;
}

template <typename T>
__global__ void __launch_bounds__(256)
    quantize_rows_kernel(const T* x, int64_t rows, int64_t cols, float static_scale, uint8_t* q,
                         float* scales) {
  __shared__ float scratch[32];
  dev::pdl_wait();
  dev::pdl_launch_dependents();
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* xr = x + row * cols;
    auto value = [&](int64_t j, float(&v)[kHalfVec]) { dev::load8(xr + j * kHalfVec, v); };
    quantize_row(value, row, cols, static_scale, q, scales, scratch);
  }
}

// silu_mul_vec_kernel's arithmetic (elementwise.cu) on 8 elements: round(round(silu(g)) * u).
template <typename T>
__device__ __forceinline__ void silu_mul8(const float (&g)[kHalfVec], const float (&u)[kHalfVec],
                                          float (&o)[kHalfVec]) {
#pragma unroll
  for (int e = 0; e < kHalfVec; ++e) {
    const float sg = dev::round_to<T>(g[e] / (1.0f + expf(-g[e])));
    o[e] = dev::round_to<T>(sg * u[e]);
  }
}

// silu_mul8 on each piece, then the row's quantization.
template <typename T>
__global__ void __launch_bounds__(256)
    silu_mul_fp8_kernel(const T* gate_up, int64_t rows, int64_t inter, float static_scale,
                        uint8_t* q, float* scales) {
  __shared__ float scratch[32];
  dev::pdl_wait();
  dev::pdl_launch_dependents();
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* gr = gate_up + row * 2 * inter;
    auto value = [&](int64_t j, float(&o)[kHalfVec]) {
      float g[kHalfVec], u[kHalfVec];
      dev::load8(gr + j * kHalfVec, g);
      dev::load8(gr + inter + j * kHalfVec, u);
      silu_mul8<T>(g, u, o);
    };
    quantize_row(value, row, inter, static_scale, q, scales, scratch);
  }
}

// The same for up to 8 x 512 vectors of a row, each thread's V of them held in registers: all of
// a thread's loads are issued before the first is used and the row is read once. The loop above
// waits a memory round trip per vector of each pass: 16.7 us per Llama-3-8B layer at m = 1 on
// the H200 (TESSERA_PROFILE_STEPS; the bf16 silu_mul takes ~2).
template <typename T, int V>
__global__ void __launch_bounds__(512)
    silu_mul_fp8_regs_kernel(const T* gate_up, int64_t rows, int64_t inter, float static_scale,
                             uint8_t* q, float* scales) {
  __shared__ float scratch[32];
  dev::pdl_wait();
  dev::pdl_launch_dependents();
  const int64_t nvec = inter / kHalfVec;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* gr = gate_up + row * 2 * inter;
    uint4 g[V], u[V];
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const int64_t j = threadIdx.x + static_cast<int64_t>(k) * blockDim.x;
      if (j < nvec) {
        g[k] = *reinterpret_cast<const uint4*>(gr + j * kHalfVec);
        u[k] = *reinterpret_cast<const uint4*>(gr + inter + j * kHalfVec);
      }
    }
    float amax = 0.0f;
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const int64_t j = threadIdx.x + static_cast<int64_t>(k) * blockDim.x;
      if (j < nvec) {
        float gv[kHalfVec], uv[kHalfVec], ov[kHalfVec];
        dev::unpack8<T>(g[k], gv);
        dev::unpack8<T>(u[k], uv);
        silu_mul8<T>(gv, uv, ov);
#pragma unroll
        for (int e = 0; e < kHalfVec; ++e) amax = fmaxf(amax, fabsf(ov[e]));
        g[k] = dev::pack8<T>(ov);  // exact: the values are already rounded to T
      }
    }
    const float a = row_scale(static_scale, amax, scratch);
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const int64_t j = threadIdx.x + static_cast<int64_t>(k) * blockDim.x;
      if (j < nvec) {
        float v[kHalfVec];
        dev::unpack8<T>(g[k], v);
        *reinterpret_cast<uint2*>(q + row * inter + j * kHalfVec) = quantize8(v, a);
      }
    }
    if (threadIdx.x == 0) scales[row] = a;
  }
}

// One row-quantizing launch: one CTA per row, up to 256 threads (fewer for narrow rows).
template <typename Kernel, typename... Args>
Status launch_rows(Kernel kernel, const char* name, int64_t rows, int64_t cols, cudaStream_t stream,
                   Args... args) {
  const int threads =
      static_cast<int>(std::min<int64_t>(256, ceil_div(ceil_div(cols, kHalfVec), 32) * 32));
  const unsigned grid = static_cast<unsigned>(std::min(rows, kMaxGridX));
  launch_pdl(kernel, grid, threads, 0, stream, args...);
  return launch_status(name);
}

// ---- online weight quantization ----

template <typename T>
__global__ void weight_amax_kernel(const T* __restrict__ w, int64_t n, uint32_t* amax) {
  float m = 0.0f;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    m = fmaxf(m, fabsf(dev::to_float(w[i])));
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, offset));
  }
  // Non-negative floats order as their bits do.
  if ((threadIdx.x & 31) == 0) atomicMax(amax, __float_as_uint(m));
}

template <typename T>
__global__ void weight_quantize_kernel(const T* __restrict__ w, int64_t n, int64_t out,
                                       const uint32_t* amax, uint8_t* q, float* scales) {
  const float m = __uint_as_float(*amax);
  const float scale = m > 0.0f ? m / kFp8Max : 1.0f;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = first; i < n; i += stride) q[i] = to_e4m3(dev::to_float(w[i]) / scale);
  for (int64_t o = first; o < out; o += stride) scales[o] = scale;
}

template <typename T>
Status launch_weight_quantize(const void* w, int64_t out, int64_t in, uint8_t* q, float* scales,
                              uint32_t* amax, cudaStream_t stream) {
  constexpr int kThreads = 256;
  const int64_t n = out * in;
  const unsigned grid = static_cast<unsigned>(std::min<int64_t>(ceil_div(n, kThreads), 16384));
  TESSERA_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(amax, 0, sizeof(uint32_t), stream),
                               "clearing the FP8 weight quantizer's max");
  weight_amax_kernel<T><<<grid, kThreads, 0, stream>>>(static_cast<const T*>(w), n, amax);
  TESSERA_RETURN_IF_ERROR(launch_status("weight_amax_kernel"));
  weight_quantize_kernel<T>
      <<<grid, kThreads, 0, stream>>>(static_cast<const T*>(w), n, out, amax, q, scales);
  return launch_status("weight_quantize_kernel");
}

// ---- the epilogue path: out = acc * a[m] * s[n] (+ bias[n]), rounded once ----

// Grid: x covers a row's 8-column vectors, y strides over the rows.
template <typename T>
__global__ void scale_epilogue_kernel(const float* __restrict__ acc, int64_t rows, int64_t n,
                                      const float* __restrict__ a, const float* __restrict__ s,
                                      const T* __restrict__ bias, T* __restrict__ out) {
  dev::pdl_wait();
  dev::pdl_launch_dependents();
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= n / kHalfVec) return;
  float sv[kHalfVec], bv[kHalfVec] = {};
#pragma unroll
  for (int e = 0; e < kHalfVec; ++e) sv[e] = __ldg(s + c * kHalfVec + e);
  if (bias != nullptr) dev::load8_ro(bias + c * kHalfVec, bv);
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    const float4* p = reinterpret_cast<const float4*>(acc + r * n + c * kHalfVec);
    const float4 lo = p[0], hi = p[1];
    const float v[kHalfVec] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
    const float ar = a[r];
    float o[kHalfVec];
#pragma unroll
    for (int e = 0; e < kHalfVec; ++e) o[e] = v[e] * ar * sv[e] + bv[e];
    dev::store8(out + r * n + c * kHalfVec, o);
  }
}

// ---- the small-m path: out = (x . w^T) * a * s (+ bias) in one kernel, without cuBLASLt ----
//
// At m <= kFp8GemvMaxM a layer reads each weight byte once for at most four products, so its time
// is the weight stream's and the kernel is built to keep HBM busy. A warp owns a strip of
// kGemvRows consecutive outputs over a K-slice of whole chunks (kGemvChunk = 32 lanes x 16 bytes:
// one coalesced 16-byte load per lane and row) and keeps two chunks of its rows in flight (2 x
// kGemvRows loads of 16 bytes per lane, ld.global.nc.L1::no_allocate: read once, kept out of L1).
// A lane reads the 16 bytes of x at the same k for each token, once for the strip's kGemvRows
// rows (cached loads: every warp of the SM reads them, so they stay in L1; no shared staging, so
// no limit on k), and widens both operands E4M3 -> f16 (cvt.rn.f16x2.e4m3x2, exact) -> fp32. The
// products (up to 448^2) are summed in fp32 FMAs, each lane over its k, then across the warp and
// the K-slices in a fixed order (no atomics: the result does not depend on timing). A CTA is
// kGemvWarps warps: p.split K-slices of kGemvWarps / p.split strips (gemv_split picks p.split so
// that a small layer still spreads over every SM). The scales, the bias and the one rounding to
// out_dtype are applied where the sums meet: no fp32 output, no second kernel.
constexpr int kGemvWarps = 8;
constexpr int kGemvRows = 4;
constexpr int kGemvChunk = 32 * 16;
// CTAs per SM the registers must allow: 3 (<= 80 registers) at m <= 2, 2 (<= 128) from m = 3 on,
// whose 4 x m sums and widened x do not fit in 80. Even 2 keep 16 warps x 32 lanes x 8 loads of
// 16 bytes in flight per SM, about 2.5x what HBM's latency x bandwidth asks of an SM.
constexpr int gemv_min_blocks(int m) { return m <= 2 ? 3 : 2; }

struct GemvParams {
  const uint8_t* x;  // [m, k] E4M3
  const float* a;    // [m]
  const uint8_t* w;  // [n, k] E4M3
  const float* s;    // [n]
  const void* bias;  // [n] T, or null
  void* out;         // [m, n] T
  int64_t n, k;
  int chunks;  // ceil(k / kGemvChunk)
  int strips;  // n / kGemvRows
  int split;   // K-slices per strip: 1, 2, 4 or 8
};

__device__ __forceinline__ uint32_t word(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// The 4 E4M3 values of a 32-bit word, widened exactly: pairs to f16x2 by the hardware
// conversion (sm_89+), then to fp32. x and w go through the same calls, so their orders match.
__device__ __forceinline__ void widen4(uint32_t v, float (&f)[4]) {
  uint32_t lo, hi;
  asm("{\n\t.reg .b16 l, h;\n\tmov.b32 {l, h}, %2;\n\tcvt.rn.f16x2.e4m3x2 %0, l;\n\t"
      "cvt.rn.f16x2.e4m3x2 %1, h;\n\t}"
      : "=r"(lo), "=r"(hi)
      : "r"(v));
  const float2 a = __half22float2(*reinterpret_cast<const __half2*>(&lo));
  const float2 b = __half22float2(*reinterpret_cast<const __half2*>(&hi));
  f[0] = a.x;
  f[1] = a.y;
  f[2] = b.x;
  f[3] = b.y;
}

// Sums each of the Width values v[0, Width) over the lanes, for rounds offset, offset / 2, .., 1
// of a butterfly: while a lane holds more than one value, each round halves them (the lane keeps
// the half its bit `offset` names and adds its partner's copy of it: Width / 2 shuffles instead
// of Width); then whole pairs add. Lane l ends with the total of value l >> (5 - log2(Width)) in
// v[0] (offset = 16), the same bits in every lane that holds it.
template <int Width, int V>
__device__ __forceinline__ void fold(float (&v)[V], int lane, int offset) {
  if constexpr (Width > 1) {
    constexpr int kHalf = Width / 2;
    const bool upper = (lane & offset) != 0;
#pragma unroll
    for (int i = 0; i < kHalf; ++i) {
      const float send = upper ? v[i] : v[i + kHalf];
      const float keep = upper ? v[i + kHalf] : v[i];
      v[i] = keep + __shfl_xor_sync(0xffffffffu, send, offset);
    }
    fold<kHalf>(v, lane, offset >> 1);
  } else {
#pragma unroll
    for (int o = offset; o > 0; o >>= 1) v[0] += __shfl_xor_sync(0xffffffffu, v[0], o);
  }
}

constexpr int gemv_values(int m) {  // a warp's sums (kGemvRows x m), rounded up to a power of 2
  int v = 1;
  while (v < kGemvRows * m) v *= 2;
  return v;
}
constexpr int log2_int(int v) { return v <= 1 ? 0 : 1 + log2_int(v / 2); }

// acc[r * M + t] += w[r][k] x[t][k] over one chunk's 16 values of this lane.
template <int M>
__device__ __forceinline__ void gemv_chunk(const uint4 (&w)[kGemvRows], const uint4 (&x)[M],
                                           float* acc) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float xf[M][4];
#pragma unroll
    for (int t = 0; t < M; ++t) widen4(word(x[t], i), xf[t]);
#pragma unroll
    for (int r = 0; r < kGemvRows; ++r) {
      float wf[4];
      widen4(word(w[r], i), wf);
#pragma unroll
      for (int t = 0; t < M; ++t) {
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[r * M + t] = fmaf(wf[e], xf[t][e], acc[r * M + t]);
      }
    }
  }
}

// The CTA's outputs from the warps' sums red[warp][r * M + t]: K-slices added in slice order, then
// scaled, biased and rounded once (scale_epilogue_kernel's arithmetic).
template <typename T, int M, int V>
__device__ __forceinline__ void gemv_store(const GemvParams& p, const float (*red)[V]) {
  const int strips_per_cta = kGemvWarps / p.split;
  const int rows = strips_per_cta * kGemvRows;
  for (int i = static_cast<int>(threadIdx.x); i < rows * M; i += blockDim.x) {
    const int t = i / rows, row = i % rows;
    const int ls = row / kGemvRows, r = row % kGemvRows;
    const int strip = static_cast<int>(blockIdx.x) * strips_per_cta + ls;
    if (strip >= p.strips) continue;
    float sum = 0.0f;
    for (int sl = 0; sl < p.split; ++sl) sum += red[ls * p.split + sl][r * M + t];
    const int64_t n = static_cast<int64_t>(strip) * kGemvRows + r;
    const float b = p.bias != nullptr ? dev::to_float(static_cast<const T*>(p.bias)[n]) : 0.0f;
    static_cast<T*>(p.out)[t * p.n + n] = dev::from_float<T>(sum * p.a[t] * __ldg(p.s + n) + b);
  }
}

template <typename T, int M>
__global__ void __launch_bounds__(kGemvWarps * 32, gemv_min_blocks(M))
    fp8_gemv_kernel(const __grid_constant__ GemvParams p) {
  constexpr int V = gemv_values(M);
  __shared__ float red[kGemvWarps][V];
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int strip = static_cast<int>(blockIdx.x) * (kGemvWarps / p.split) + warp / p.split;
  const int slice = warp % p.split;
  const int c0 = strip < p.strips ? slice * p.chunks / p.split : 0;
  const int c1 = strip < p.strips ? (slice + 1) * p.chunks / p.split : 0;
  const int64_t lane_k = lane * 16;
  const uint8_t* wp = p.w + static_cast<int64_t>(strip) * kGemvRows * p.k + lane_k;
  const uint8_t* xp = p.x + lane_k;
  // Chunk c is this lane's when it is in the slice and the lane's 16 bytes are inside k.
  auto mine = [&](int c) { return c < c1 && c * int64_t{kGemvChunk} + lane_k < p.k; };
  uint4 wq[2][kGemvRows] = {}, xq[2][M] = {};
  auto fetch_w = [&](int slot, int c) {
    if (!mine(c)) return;
#pragma unroll
    for (int r = 0; r < kGemvRows; ++r)
      wq[slot][r] = dev::ldg_stream(wp + r * p.k + int64_t{c} * kGemvChunk);
  };
  auto fetch_x = [&](int slot, int c) {
    if (!mine(c)) return;
#pragma unroll
    for (int t = 0; t < M; ++t) {
      xq[slot][t] = *reinterpret_cast<const uint4*>(xp + t * p.k + int64_t{c} * kGemvChunk);
    }
  };
  // The weights are constant: requested before the wait for the kernel that writes x.
  fetch_w(0, c0);
  fetch_w(1, c0 + 1);
  dev::pdl_wait();
  dev::pdl_launch_dependents();
  fetch_x(0, c0);
  fetch_x(1, c0 + 1);
  float acc[V] = {};
  for (int c = c0; c < c1; c += 2) {
#pragma unroll
    for (int slot = 0; slot < 2; ++slot) {
      if (mine(c + slot)) gemv_chunk<M>(wq[slot], xq[slot], acc);
      fetch_w(slot, c + slot + 2);
      fetch_x(slot, c + slot + 2);
    }
  }
  fold<V>(acc, lane, 16);
  constexpr int kShift = 5 - log2_int(V);
  if ((lane & ((1 << kShift) - 1)) == 0) red[warp][lane >> kShift] = acc[0];
  __syncthreads();
  gemv_store<T, M, V>(p, red);
}

// K-slices per strip: the fewest (1, 2, 4 or 8, at most one per chunk) whose CTAs take every
// slot of the GPU (`resident` CTAs) at least once, so that a small layer's weights still stream
// through every SM. More CTAs than slots cost nothing: each keeps its loads in flight and a
// finished one's slot is taken by the next.
int gemv_split(int64_t strips, int64_t chunks, int64_t resident) {
  int split = 1;
  while (split < kGemvWarps && split * 2 <= chunks &&
         ceil_div(strips * split, kGemvWarps) < resident) {
    split *= 2;
  }
  return split;
}

template <typename T, int M>
Status launch_gemv(const Fp8GemmArgs& a, int64_t resident, cudaStream_t stream) {
  GemvParams p{};
  p.x = a.x;
  p.a = a.x_scales;
  p.w = a.w;
  p.s = a.w_scales;
  p.bias = a.bias;
  p.out = a.out;
  p.n = a.n;
  p.k = a.k;
  p.chunks = static_cast<int>(ceil_div(a.k, kGemvChunk));
  p.strips = static_cast<int>(a.n / kGemvRows);
  p.split = gemv_split(p.strips, p.chunks, resident);
  const int64_t grid = ceil_div(p.strips, kGemvWarps / p.split);
  launch_pdl(fp8_gemv_kernel<T, M>, dim3(static_cast<unsigned>(grid)), dim3(kGemvWarps * 32), 0,
             stream, p);
  return launch_status("fp8_gemv_kernel");
}

// TESSERA_FP8_GEMV=0 sends every m to cuBLASLt (to time the two side by side); read once.
bool gemv_enabled() {
  static const bool enabled = [] {
    const char* v = std::getenv("TESSERA_FP8_GEMV");
    return v == nullptr || std::string_view(v) != "0";
  }();
  return enabled;
}

// ---- cuBLASLt ----

Status lt_status(cublasStatus_t st, const std::string& what) {
  if (st == CUBLAS_STATUS_SUCCESS) return Status::ok();
  std::string msg = what + ": " + cublasLtGetStatusName(st);
  if (st == CUBLAS_STATUS_ALLOC_FAILED) return resource_exhausted(msg);
  return internal_error(msg);
}

cudaDataType_t cuda_type(DType d) {
  return d == DType::kBF16 ? CUDA_R_16BF : d == DType::kF16 ? CUDA_R_16F : CUDA_R_32F;
}

// "[m=1 n=4096 k=4096 fp8->bf16 outer-vector]"
std::string describe(int64_t m, int64_t n, int64_t k, DType out, bool bias, bool outer) {
  return "[m=" + std::to_string(m) + " n=" + std::to_string(n) + " k=" + std::to_string(k) +
         " fp8->" + dtype_name(out) + (bias ? " +bias" : "") +
         (outer ? " outer-vector" : " fp32 for the epilogue") + "]";
}

struct PreferenceGuard {
  cublasLtMatmulPreference_t pref = nullptr;
  ~PreferenceGuard() {
    if (pref != nullptr) cublasLtMatmulPreferenceDestroy(pref);
  }
};

constexpr size_t kWorkspaceBytes = 32u << 20;
constexpr uint64_t kEpilogueScratchBytes = 64ull << 20;
static_assert(kWorkspaceBytes + kEpilogueScratchBytes <= Fp8Gemm::kMaxDeviceBytes);
constexpr uint32_t kAlignment = 16;  // every pointer Fp8Gemm passes is 16-byte aligned

}  // namespace

// ---- activation quantization ----

Status quantize_fp8_rows(DType dtype, const void* x, int64_t rows, int64_t cols, float static_scale,
                         uint8_t* q, float* scales, cudaStream_t stream) {
  constexpr const char* kOp = "quantize_fp8_rows";
  TESSERA_RETURN_IF_ERROR(check_rows(kOp, rows, cols, static_scale, {x}, q, scales));
  if (rows == 0) return Status::ok();
  return with_half_type(dtype, kOp, [&](auto tag) {
    using T = typename decltype(tag)::type;
    return launch_rows(quantize_rows_kernel<T>, "quantize_rows_kernel", rows, cols, stream,
                       static_cast<const T*>(x), rows, cols, static_scale, q, scales);
  });
}

Status rms_norm_fp8(DType dtype, const void* x, void* residual, const void* weight, int64_t rows,
                    int64_t hidden, float eps, float static_scale, uint8_t* q, float* scales,
                    cudaStream_t stream) {
  constexpr const char* kOp = "rms_norm_fp8";
  TESSERA_RETURN_IF_ERROR(check_rows(kOp, rows, hidden, static_scale, {x, weight}, q, scales));
  if (hidden > kMaxNormHidden) {
    return invalid_argument("rms_norm_fp8: hidden " + std::to_string(hidden) + " is above " +
                            std::to_string(kMaxNormHidden));
  }
  if (rows == 0) return Status::ok();
  if (residual != nullptr && (!aligned(residual, 16) || residual == x)) {
    return invalid_argument("rms_norm_fp8: residual must be 16-byte aligned and not alias x");
  }
  const norm::VecShape shape = norm::vec_shape(hidden);  // hidden <= kMaxNormHidden: v > 0
  const int v = shape.v, threads = shape.threads;
  const unsigned grid = static_cast<unsigned>(std::min(rows, kMaxGridX));
  return with_half_type(dtype, kOp, [&](auto tag) -> Status {
    using T = typename decltype(tag)::type;
    const T* xt = static_cast<const T*>(x);
    T* res = static_cast<T*>(residual);
    const T* w = static_cast<const T*>(weight);
    const StoreFp8Row<T> store{q, scales, static_scale};
    auto launch = [&](auto kernel) {
      launch_pdl(kernel, grid, threads, 0, stream, xt, res, w, static_cast<const T*>(nullptr), rows,
                 hidden, eps, store);
      return launch_status("rms_norm_fp8");
    };
    const bool add = residual != nullptr;
    switch (v) {
      case 1:
        return add ? launch(norm::rms_norm_vec_kernel<T, 1, true, StoreFp8Row<T>>)
                   : launch(norm::rms_norm_vec_kernel<T, 1, false, StoreFp8Row<T>>);
      case 2:
        return add ? launch(norm::rms_norm_vec_kernel<T, 2, true, StoreFp8Row<T>>)
                   : launch(norm::rms_norm_vec_kernel<T, 2, false, StoreFp8Row<T>>);
      case 4:
        return add ? launch(norm::rms_norm_vec_kernel<T, 4, true, StoreFp8Row<T>>)
                   : launch(norm::rms_norm_vec_kernel<T, 4, false, StoreFp8Row<T>>);
      default:
        return add ? launch(norm::rms_norm_vec_kernel<T, 8, true, StoreFp8Row<T>>)
                   : launch(norm::rms_norm_vec_kernel<T, 8, false, StoreFp8Row<T>>);
    }
  });
}

Status silu_mul_fp8(DType dtype, const void* gate_up, int64_t rows, int64_t inter,
                    float static_scale, uint8_t* q, float* scales, cudaStream_t stream) {
  constexpr const char* kOp = "silu_mul_fp8";
  TESSERA_RETURN_IF_ERROR(check_rows(kOp, rows, inter, static_scale, {gate_up}, q, scales));
  if (rows == 0) return Status::ok();
  return with_half_type(dtype, kOp, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const auto* x = static_cast<const T*>(gate_up);
    // Rows of up to 8 x 512 vectors (inter <= 32768): the register-resident kernel, V vectors
    // per thread; wider ones the two-pass loop.
    const int64_t nvec = inter / kHalfVec;
    for (int v : {1, 2, 4, 8}) {
      if (nvec > static_cast<int64_t>(v) * 512) continue;
      const int threads = static_cast<int>(ceil_div(ceil_div(nvec, v), 32) * 32);
      const unsigned grid = static_cast<unsigned>(std::min(rows, kMaxGridX));
      auto kernel = v == 1   ? silu_mul_fp8_regs_kernel<T, 1>
                    : v == 2 ? silu_mul_fp8_regs_kernel<T, 2>
                    : v == 4 ? silu_mul_fp8_regs_kernel<T, 4>
                             : silu_mul_fp8_regs_kernel<T, 8>;
      launch_pdl(kernel, grid, threads, 0, stream, x, rows, inter, static_scale, q, scales);
      return launch_status("silu_mul_fp8_regs_kernel");
    }
    return launch_rows(silu_mul_fp8_kernel<T>, "silu_mul_fp8_kernel", rows, inter, stream, x, rows,
                       inter, static_scale, q, scales);
  });
}

// ---- weights ----

Status quantize_fp8_weight(DType dtype, const void* w, int64_t out, int64_t in, uint8_t* q,
                           float* scales, uint32_t* amax, cudaStream_t stream) {
  if (out <= 0 || in <= 0) {
    return invalid_argument("quantize_fp8_weight: out " + std::to_string(out) + " and in " +
                            std::to_string(in) + " must be positive");
  }
  if (w == nullptr || q == nullptr || scales == nullptr || amax == nullptr) {
    return invalid_argument("quantize_fp8_weight: null w, q, scales or amax");
  }
  switch (dtype) {
    case DType::kF32:
      return launch_weight_quantize<float>(w, out, in, q, scales, amax, stream);
    case DType::kF16:
      return launch_weight_quantize<__half>(w, out, in, q, scales, amax, stream);
    case DType::kBF16:
      return launch_weight_quantize<__nv_bfloat16>(w, out, in, q, scales, amax, stream);
    case DType::kI32:
    case DType::kF8E4M3:
      break;
  }
  return invalid_argument(std::string("quantize_fp8_weight: a ") + dtype_name(dtype) +
                          " weight is not quantized at load (F32, F16 or BF16)");
}

// ---- the GEMM ----

Expected<Fp8GemmPath> parse_fp8_gemm_path(std::string_view text) {
  if (text == "auto" || text.empty()) return Fp8GemmPath::kAuto;
  if (text == "outer-vector") return Fp8GemmPath::kOuterVector;
  if (text == "epilogue") return Fp8GemmPath::kEpilogue;
  return invalid_argument("\"" + std::string(text) +
                          "\" is not an FP8 GEMM path (auto, outer-vector or epilogue)");
}

const char* fp8_gemm_path_name(Fp8GemmPath path) {
  switch (path) {
    case Fp8GemmPath::kAuto:
      return "auto";
    case Fp8GemmPath::kOuterVector:
      return "outer-vector";
    case Fp8GemmPath::kEpilogue:
      return "epilogue";
  }
  return "?";
}

struct Fp8Gemm::Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr;  // w: col-major [k, n], used transposed (FP8 wants TN)
  cublasLtMatrixLayout_t b = nullptr;  // x: col-major [k, m]
  cublasLtMatrixLayout_t d = nullptr;  // out: col-major [n, m] (also C, beta = 0)
  cublasLtMatmulAlgo_t algo{};
  bool bias_in_gemm = false;  // false with a bias: add_bias after the GEMM
  std::string what;

  Plan() = default;
  Plan(const Plan&) = delete;
  Plan& operator=(const Plan&) = delete;
  ~Plan() { destroy(); }
  void destroy() {
    if (d != nullptr) cublasLtMatrixLayoutDestroy(d);
    if (b != nullptr) cublasLtMatrixLayoutDestroy(b);
    if (a != nullptr) cublasLtMatrixLayoutDestroy(a);
    if (desc != nullptr) cublasLtMatmulDescDestroy(desc);
    d = b = a = nullptr;
    desc = nullptr;
  }

  // D^T[n, m] = W[n, k] . X^T[k, m] in cuBLASLt's column-major terms; the outer vectors scale
  // A's rows (s[n]) and B's columns (a[m]).
  Status init(int64_t m, int64_t n, int64_t k, DType out, bool bias, bool outer) {
    const std::string w = "creating cuBLASLt FP8 descriptors for " + what;
    TESSERA_RETURN_IF_ERROR(
        lt_status(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), w));
    auto set = [&](cublasLtMatmulDescAttributes_t attr, const void* v, size_t size) {
      return lt_status(cublasLtMatmulDescSetAttribute(desc, attr, v, size), w);
    };
    const cublasOperation_t transa = CUBLAS_OP_T, transb = CUBLAS_OP_N;
    TESSERA_RETURN_IF_ERROR(set(CUBLASLT_MATMUL_DESC_TRANSA, &transa, sizeof(transa)));
    TESSERA_RETURN_IF_ERROR(set(CUBLASLT_MATMUL_DESC_TRANSB, &transb, sizeof(transb)));
    if (outer) {
      const int32_t mode = CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F;
      TESSERA_RETURN_IF_ERROR(set(CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &mode, sizeof(mode)));
      TESSERA_RETURN_IF_ERROR(set(CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &mode, sizeof(mode)));
    }
    if (bias) {
      const cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_BIAS;
      const int32_t bias_type = cuda_type(out);
      TESSERA_RETURN_IF_ERROR(set(CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof(epilogue)));
      TESSERA_RETURN_IF_ERROR(
          set(CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_type, sizeof(bias_type)));
    }
    const auto mu = static_cast<uint64_t>(m), nu = static_cast<uint64_t>(n),
               ku = static_cast<uint64_t>(k);
    TESSERA_RETURN_IF_ERROR(
        lt_status(cublasLtMatrixLayoutCreate(&a, CUDA_R_8F_E4M3, ku, nu, k), w));
    TESSERA_RETURN_IF_ERROR(
        lt_status(cublasLtMatrixLayoutCreate(&b, CUDA_R_8F_E4M3, ku, mu, k), w));
    TESSERA_RETURN_IF_ERROR(
        lt_status(cublasLtMatrixLayoutCreate(&d, cuda_type(out), nu, mu, n), w));
    bias_in_gemm = bias;
    return Status::ok();
  }

  // The heuristic's first algorithm (fp32 split-K reductions only, 16-byte aligned pointers).
  Status choose(cublasLtHandle_t handle, uint64_t workspace) {
    const std::string w = "cublasLtMatmulAlgoGetHeuristic " + what;
    PreferenceGuard guard;
    TESSERA_RETURN_IF_ERROR(lt_status(cublasLtMatmulPreferenceCreate(&guard.pref), w));
    auto pref = [&](cublasLtMatmulPreferenceAttributes_t attr, const void* v, size_t size) {
      return lt_status(cublasLtMatmulPreferenceSetAttribute(guard.pref, attr, v, size), w);
    };
    const uint32_t reductions = CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
    TESSERA_RETURN_IF_ERROR(
        pref(CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace, sizeof(workspace)));
    TESSERA_RETURN_IF_ERROR(
        pref(CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &reductions, sizeof(reductions)));
    for (const auto attr :
         {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
          CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES}) {
      TESSERA_RETURN_IF_ERROR(pref(attr, &kAlignment, sizeof(kAlignment)));
    }
    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    TESSERA_RETURN_IF_ERROR(lt_status(
        cublasLtMatmulAlgoGetHeuristic(handle, desc, a, b, d, d, guard.pref, 1, &result, &found),
        w));
    if (found == 0 || result.state != CUBLAS_STATUS_SUCCESS) {
      return lt_status(CUBLAS_STATUS_NOT_SUPPORTED, w + " (no algorithm)");
    }
    algo = result.algo;
    return Status::ok();
  }
};

Expected<Fp8Gemm::Plan*> Fp8Gemm::plan(int64_t m, int64_t n, int64_t k, DType out, bool bias,
                                       bool outer) {
  const auto key = std::make_tuple(m, n, k, out, bias, outer);
  if (auto it = plans_.find(key); it != plans_.end()) return it->second.get();
  auto p = std::make_unique<Plan>();
  p->what = describe(m, n, k, out, bias, outer);
  TESSERA_RETURN_IF_ERROR(p->init(m, n, k, out, bias, outer));
  if (Status chosen = p->choose(handle_, workspace_.bytes()); !chosen.is_ok()) {
    if (!bias) return chosen;
    // No FP8 kernel with this bias epilogue: the GEMM without it, then add_bias.
    p->destroy();
    TESSERA_RETURN_IF_ERROR(p->init(m, n, k, out, false, outer));
    TESSERA_RETURN_IF_ERROR(p->choose(handle_, workspace_.bytes()));
  }
  return plans_.emplace(key, std::move(p)).first->second.get();
}

Expected<std::unique_ptr<Fp8Gemm>> Fp8Gemm::create(Fp8GemmPath path, int64_t max_m, int64_t max_n,
                                                   DType out_dtype, cudaStream_t stream) {
  if (max_m <= 0 || max_n <= 0 || max_n % 16 != 0 || !is_half_type(out_dtype)) {
    return invalid_argument("Fp8Gemm::create: max_m " + std::to_string(max_m) + " and max_n " +
                            std::to_string(max_n) +
                            " must be positive, max_n a multiple of 16, the output BF16 or F16");
  }
  std::unique_ptr<Fp8Gemm> g(new Fp8Gemm());
  g->max_n_ = max_n;
  TESSERA_RETURN_IF_ERROR(lt_status(cublasLtCreate(&g->handle_), "cublasLtCreate"));
  TESSERA_ASSIGN_OR_RETURN(g->workspace_,
                           DeviceBuffer::allocate(kWorkspaceBytes, "the FP8 GEMM's workspace"));
  TESSERA_RETURN_IF_ERROR(g->count_gemv_slots());
  g->path_ = Fp8GemmPath::kEpilogue;
  if (path != Fp8GemmPath::kEpilogue) {
    Status probed = g->probe(out_dtype, stream);
    if (probed.is_ok()) {
      g->path_ = Fp8GemmPath::kOuterVector;
    } else if (path == Fp8GemmPath::kOuterVector) {
      return failed_precondition(
          "TESSERA_FP8_GEMM=outer-vector: cuBLASLt's outer-vector FP8 scaling does not work "
          "here (" +
          probed.message() + "); unset it or set epilogue");
    } else {
      g->probe_failure_ = probed.message();
    }
  }
  if (g->path_ == Fp8GemmPath::kEpilogue) {
    // Rows per chunk: a multiple of 16 (x's chunks stay 256-byte aligned), the scratch <= 64 MiB.
    int64_t rows = static_cast<int64_t>(kEpilogueScratchBytes / (4 * static_cast<uint64_t>(max_n)));
    rows = std::max<int64_t>(16, rows / 16 * 16);
    g->chunk_rows_ = std::min(rows, max_m);
    TESSERA_ASSIGN_OR_RETURN(
        g->scratch_,
        DeviceBuffer::allocate(static_cast<size_t>(g->chunk_rows_ * max_n) * sizeof(float),
                               "the FP8 GEMM's fp32 output chunk"));
  }
  return std::move(g);
}

Fp8Gemm::~Fp8Gemm() {
  plans_.clear();
  if (handle_ != nullptr) cublasLtDestroy(handle_);
}

// A 3 x 32 x 32 GEMM of ones whose scales make every output distinct: out[m][n] = 32 * (m + 1) *
// (n + 1) / 16 (+ n) = 2 (m + 1)(n + 1) (+ n), integers below 256 (exact in bf16 and fp16), with
// and without the bias. The outer-vector path is taken only when cuBLASLt computes exactly these.
Status Fp8Gemm::probe(DType out_dtype, cudaStream_t stream) {
  constexpr int64_t M = 3, N = 32, K = 32;
  constexpr size_t kX = 0, kW = 256, kA = 2048, kS = 2304, kBias = 2560, kOut = 2816;
  TESSERA_ASSIGN_OR_RETURN(DeviceBuffer buf, DeviceBuffer::allocate(4096, "the FP8 GEMM probe"));
  std::vector<uint8_t> host(4096, 0);
  std::fill_n(host.begin() + kX, M * K, uint8_t{0x38});  // E4M3 1.0
  std::fill_n(host.begin() + kW, N * K, uint8_t{0x38});
  for (int64_t m = 0; m < M; ++m) {
    const float a = static_cast<float>(m + 1);
    std::memcpy(host.data() + kA + m * 4, &a, 4);
  }
  for (int64_t n = 0; n < N; ++n) {
    const float s = static_cast<float>(n + 1) / 16.0f;
    const uint16_t b = out_dtype == DType::kBF16 ? float_to_bf16(static_cast<float>(n))
                                                 : float_to_f16(static_cast<float>(n));
    std::memcpy(host.data() + kS + n * 4, &s, 4);
    std::memcpy(host.data() + kBias + n * 2, &b, 2);
  }
  char* d = buf.as<char>();
  TESSERA_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(d, host.data(), host.size(), cudaMemcpyHostToDevice, stream), "FP8 probe");
  for (bool bias : {false, true}) {
    Fp8GemmArgs args;
    args.m = M;
    args.n = N;
    args.k = K;
    args.out_dtype = out_dtype;
    args.x = reinterpret_cast<const uint8_t*>(d + kX);
    args.w = reinterpret_cast<const uint8_t*>(d + kW);
    args.x_scales = reinterpret_cast<const float*>(d + kA);
    args.w_scales = reinterpret_cast<const float*>(d + kS);
    args.bias = bias ? d + kBias : nullptr;
    args.out = d + kOut;
    TESSERA_RETURN_IF_ERROR(outer_vector(args, stream));
    std::vector<uint16_t> got(static_cast<size_t>(M * N));
    TESSERA_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(got.data(), d + kOut, got.size() * 2, cudaMemcpyDeviceToHost, stream),
        "FP8 probe");
    TESSERA_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream), "FP8 probe");
    for (int64_t m = 0; m < M; ++m) {
      for (int64_t n = 0; n < N; ++n) {
        const float want = static_cast<float>(2 * (m + 1) * (n + 1) + (bias ? n : 0));
        const uint16_t bits = got[static_cast<size_t>(m * N + n)];
        const float have = out_dtype == DType::kBF16 ? bf16_to_float(bits) : f16_to_float(bits);
        if (have != want) {
          plans_.clear();
          return internal_error("the probe GEMM" + std::string(bias ? " with a bias" : "") +
                                " gave " + std::to_string(have) + " at [" + std::to_string(m) +
                                ", " + std::to_string(n) + "], not " + std::to_string(want));
        }
      }
    }
  }
  plans_.clear();
  return Status::ok();
}

Status Fp8Gemm::outer_vector(const Fp8GemmArgs& a, cudaStream_t stream) {
  TESSERA_ASSIGN_OR_RETURN(Plan * p, plan(a.m, a.n, a.k, a.out_dtype, a.bias != nullptr, true));
  auto set = [&](cublasLtMatmulDescAttributes_t attr, const void* ptr) {
    return cublasLtMatmulDescSetAttribute(p->desc, attr, &ptr, sizeof(ptr));
  };
  // Messages are built only for an error.
  cublasStatus_t st = set(CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, a.w_scales);
  if (st == CUBLAS_STATUS_SUCCESS) st = set(CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, a.x_scales);
  if (st == CUBLAS_STATUS_SUCCESS && p->bias_in_gemm) {
    st = set(CUBLASLT_MATMUL_DESC_BIAS_POINTER, a.bias);
  }
  if (st != CUBLAS_STATUS_SUCCESS) return lt_status(st, "setting the scales of " + p->what);
  const float alpha = 1.0f, beta = 0.0f;
  st = cublasLtMatmul(handle_, p->desc, &alpha, a.w, p->a, a.x, p->b, &beta, a.out, p->d, a.out,
                      p->d, &p->algo, workspace_.get(), workspace_.bytes(), stream);
  if (st != CUBLAS_STATUS_SUCCESS) return lt_status(st, "cublasLtMatmul " + p->what);
  if (a.bias == nullptr || p->bias_in_gemm) return Status::ok();
  return add_bias(a.out_dtype, a.out, a.bias, a.m, a.n, stream);
}

Status Fp8Gemm::epilogue(const Fp8GemmArgs& a, cudaStream_t stream) {
  if (a.n > max_n_) {
    return invalid_argument("Fp8Gemm::linear: n " + std::to_string(a.n) + " is above the max_n " +
                            std::to_string(max_n_) + " it was made for");
  }
  float* acc = scratch_.as<float>();
  for (int64_t r0 = 0; r0 < a.m; r0 += chunk_rows_) {
    const int64_t mc = std::min(chunk_rows_, a.m - r0);
    TESSERA_ASSIGN_OR_RETURN(Plan * p, plan(mc, a.n, a.k, DType::kF32, false, false));
    const float alpha = 1.0f, beta = 0.0f;
    const cublasStatus_t mm =
        cublasLtMatmul(handle_, p->desc, &alpha, a.w, p->a, a.x + r0 * a.k, p->b, &beta, acc, p->d,
                       acc, p->d, &p->algo, workspace_.get(), workspace_.bytes(), stream);
    if (mm != CUBLAS_STATUS_SUCCESS) return lt_status(mm, "cublasLtMatmul " + p->what);
    constexpr int kThreads = 128;
    const dim3 grid(static_cast<unsigned>(ceil_div(a.n / kHalfVec, kThreads)),
                    static_cast<unsigned>(std::min(mc, kMaxGridY)));
    Status st = with_half_type(a.out_dtype, "Fp8Gemm", [&](auto tag) {
      using T = typename decltype(tag)::type;
      launch_pdl(scale_epilogue_kernel<T>, grid, kThreads, 0, stream, acc, mc, a.n, a.x_scales + r0,
                 a.w_scales, static_cast<const T*>(a.bias), static_cast<T*>(a.out) + r0 * a.n);
      return launch_status("scale_epilogue_kernel");
    });
    TESSERA_RETURN_IF_ERROR(st);
  }
  return Status::ok();
}

// Asked once at create (host queries; linear may run inside a graph capture).
Status Fp8Gemm::count_gemv_slots() {
  int device = 0, sms = 0;
  TESSERA_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device), "Fp8Gemm: cudaGetDevice");
  TESSERA_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device),
                               "Fp8Gemm: SM count");
  auto count = [&](auto kernel, int64_t& slots) {
    int per_sm = 0;
    TESSERA_CUDA_RETURN_IF_ERROR(
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kGemvWarps * 32, 0),
        "Fp8Gemm: the small-m kernel's occupancy");
    slots = std::max<int64_t>(int64_t{sms} * per_sm, 1);
    return Status::ok();
  };
  static_assert(kFp8GemvMaxM == 4);
  TESSERA_RETURN_IF_ERROR(count(fp8_gemv_kernel<__nv_bfloat16, 1>, gemv_slots_[0]));
  TESSERA_RETURN_IF_ERROR(count(fp8_gemv_kernel<__nv_bfloat16, 2>, gemv_slots_[1]));
  TESSERA_RETURN_IF_ERROR(count(fp8_gemv_kernel<__nv_bfloat16, 3>, gemv_slots_[2]));
  return count(fp8_gemv_kernel<__nv_bfloat16, 4>, gemv_slots_[3]);
}

Status Fp8Gemm::gemv(const Fp8GemmArgs& a, cudaStream_t stream) {
  const int64_t slots = gemv_slots_[static_cast<size_t>(a.m - 1)];
  return with_half_type(a.out_dtype, "Fp8Gemm", [&](auto tag) {
    using T = typename decltype(tag)::type;
    switch (a.m) {
      case 1:
        return launch_gemv<T, 1>(a, slots, stream);
      case 2:
        return launch_gemv<T, 2>(a, slots, stream);
      case 3:
        return launch_gemv<T, 3>(a, slots, stream);
      default:
        return launch_gemv<T, 4>(a, slots, stream);
    }
  });
}

Status Fp8Gemm::linear(const Fp8GemmArgs& a, cudaStream_t stream) {
  // Built only for an error (a decode step makes seven calls a layer).
  auto where = [&] {
    return "Fp8Gemm::linear " + describe(a.m, a.n, a.k, a.out_dtype, a.bias != nullptr,
                                         path_ == Fp8GemmPath::kOuterVector);
  };
  if (a.m <= 0 || a.n <= 0 || a.k <= 0 || a.n % 16 != 0 || a.k % 16 != 0) {
    return invalid_argument(where() + ": m, n and k must be positive, n and k multiples of 16");
  }
  if (!is_half_type(a.out_dtype)) {
    return invalid_argument(where() + ": the output must be BF16 or F16");
  }
  for (const void* p : {static_cast<const void*>(a.x), static_cast<const void*>(a.w),
                        static_cast<const void*>(a.x_scales), static_cast<const void*>(a.w_scales),
                        static_cast<const void*>(a.out)}) {
    if (p == nullptr || !aligned(p, kAlignment)) {
      return invalid_argument(where() + ": x, w, their scales and out must be 16-byte aligned");
    }
  }
  if (a.bias != nullptr && !aligned(a.bias, kAlignment)) {
    return invalid_argument(where() + ": the bias must be 16-byte aligned");
  }
  if (a.m <= kFp8GemvMaxM && a.small_m_kernel && gemv_enabled()) return gemv(a, stream);
  return path_ == Fp8GemmPath::kOuterVector ? outer_vector(a, stream) : epilogue(a, stream);
}

}  // namespace tessera::cuda
