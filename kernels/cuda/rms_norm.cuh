// The RMSNorm row kernel shared by rms_norm / add_rms_norm (elementwise.cu) and rms_norm_fp8
// (fp8_linear.cu): one implementation of the normalisation (transformers' LlamaRMSNorm rounding,
// elementwise.h), with what is done with the normed row a policy. Include from .cu files only.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/device_math.cuh"

namespace tessera::cuda::norm {

// The vector kernel's shape for a row of `hidden` elements (hidden % 8 == 0): V 16-byte vectors
// per thread, the fewest of 1, 2, 4, 8 that 512 threads cover, and the threads (a multiple of
// 32). Its reduction order follows from it: anything that must give rms_norm's bits (the GEMV
// with the norm in its prologue, gemv.cu) reduces as this shape does. V 0: wider than 32768.
struct VecShape {
  int v = 0;
  int threads = 0;
};
inline VecShape vec_shape(int64_t hidden) {
  const int64_t nvec = hidden / dev::kHalfVec;
  for (int v : {1, 2, 4, 8}) {
    if (nvec <= static_cast<int64_t>(v) * 512) {
      return {v, static_cast<int>(((nvec + v - 1) / v + 31) / 32 * 32)};
    }
  }
  return {};
}

// The store policy of rms_norm: the normed row in the dtype, out [rows, hidden]. Made from the
// output pointer (implicitly: launch_pdl converts the T* argument to the kernel's parameter).
template <typename T>
struct StoreRow {
  T* out;
  __host__ __device__ StoreRow(T* o) : out(o) {}  // NOLINT(google-explicit-constructor)
  // `normed(k, h)` writes the 8 normed values (fp32, before their rounding to T) of this
  // thread's vector k (elements 8 j .. 8 j + 7 of the row, j = threadIdx.x + k blockDim.x).
  template <int V, typename Normed>
  __device__ __forceinline__ void row(int64_t row, int64_t hidden, const Normed& normed,
                                      float* /*scratch*/) const {
    const int64_t nvec = hidden / dev::kHalfVec;
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const int64_t j = threadIdx.x + static_cast<int64_t>(k) * blockDim.x;
      if (j < nvec) {
        float h[dev::kHalfVec];
        normed(k, h);
        dev::store8(out + row * hidden + j * dev::kHalfVec, h);
      }
    }
  }
};

// One CTA per row (grid-stride over rows). hidden % 8 == 0 and 16-byte aligned buffers; each
// thread keeps V 16-byte vectors of its row in registers, packed as the dtype (one global read),
// and its weight vectors, loaded once before the row loop. All reads of x precede the block
// reduction's barrier and all writes of the store follow it, so x and out may alias. The store
// is called by every thread of the block (it may reduce over the block with `scratch`, which it
// must leave reusable: a barrier last).
//   h = float(x) (kAdd: residual = round(residual + x), h = that); inv = rsqrt(mean(h^2) + eps);
//   normed = weight * round(h * inv), rounded to T by the store
// kUnitOffset (Gemma's RMSNorm, which stores w and scales by 1 + w): normed = (1 + weight) *
// (h * inv) in fp32, rounded once by the store, as transformers' GemmaRMSNorm (float math, then
// type_as(x)).
// kNormX (with kAdd; Gemma's sandwich norms): x is first normalised with x_weight and rounded to
// T, as a separate rms_norm of x would store it, and that is what joins the residual (x itself
// is left as it was); x_weight is ignored otherwise (null).
// h = RMSNorm's output for one 8-element piece, in fp32 before the store's rounding: (1 + w) *
// (h * inv) for kUnitOffset (Gemma), else w * round(h * inv) (Llama's, as transformers rounds).
template <typename T, bool kUnitOffset>
__device__ __forceinline__ void weigh(float (&h)[dev::kHalfVec], const uint4& w, float inv) {
  float wf[dev::kHalfVec];
  dev::unpack8<T>(w, wf);
#pragma unroll
  for (int e = 0; e < dev::kHalfVec; ++e) {
    if constexpr (kUnitOffset) {
      h[e] = (1.0f + wf[e]) * (h[e] * inv);
    } else {
      h[e] = wf[e] * dev::round_to<T>(h[e] * inv);
    }
  }
}

// One row once its x vectors are in hv (hv[k]: this thread's vector j = threadIdx.x + k
// blockDim.x of the row, zeros where j >= hidden / 8), as rms_norm_vec_kernel computes it: kAdd:
// residual = round(residual + x) (stored; hv becomes it); inv = rsqrt(mean(hv^2) + eps); the
// store gets weigh()'s normed values. Called by every thread of the block (block_sum).
template <typename T, int V, bool kAdd, bool kUnitOffset, typename Store>
__device__ __forceinline__ void add_norm_row(uint4 (&hv)[V], T* residual, const uint4 (&w)[V],
                                             int64_t row, int64_t hidden, float eps,
                                             const Store& store, float* scratch) {
  const int64_t nvec = hidden / dev::kHalfVec;
  const int64_t base = row * hidden;
  float ss = 0.0f;
#pragma unroll
  for (int k = 0; k < V; ++k) {
    const int64_t j = threadIdx.x + static_cast<int64_t>(k) * blockDim.x;
    if (j < nvec) {
      float h[dev::kHalfVec];
      dev::unpack8<T>(hv[k], h);
      if constexpr (kAdd) {
        float r[dev::kHalfVec];
        dev::load8(residual + base + j * dev::kHalfVec, r);
#pragma unroll
        for (int e = 0; e < dev::kHalfVec; ++e) h[e] = r[e] + h[e];
        hv[k] = dev::pack8<T>(h);
        *reinterpret_cast<uint4*>(residual + base + j * dev::kHalfVec) = hv[k];
        dev::unpack8<T>(hv[k], h);
      }
#pragma unroll
      for (int e = 0; e < dev::kHalfVec; ++e) ss += h[e] * h[e];
    }
  }
  const float inv = rsqrtf(dev::block_sum(ss, scratch) * (1.0f / static_cast<float>(hidden)) + eps);
  auto normed = [&](int k, float(&h)[dev::kHalfVec]) {
    dev::unpack8<T>(hv[k], h);
    weigh<T, kUnitOffset>(h, w[k], inv);
  };
  store.template row<V>(row, hidden, normed, scratch);
}

// This thread's weight vectors of a row of `hidden` (zeros past it), for add_norm_row.
template <int V, typename T>
__device__ __forceinline__ void load_weight_vecs(const T* __restrict__ weight, int64_t hidden,
                                                 uint4 (&w)[V]) {
  const int64_t nvec = hidden / dev::kHalfVec;
#pragma unroll
  for (int k = 0; k < V; ++k) {
    const int64_t j = threadIdx.x + static_cast<int64_t>(k) * blockDim.x;
    w[k] = j < nvec ? __ldg(reinterpret_cast<const uint4*>(weight) + j) : make_uint4(0, 0, 0, 0);
  }
}

template <typename T, int V, bool kAdd, typename Store = StoreRow<T>, bool kUnitOffset = false,
          bool kNormX = false>
__global__ void __launch_bounds__(512)
    rms_norm_vec_kernel(const T* x, T* residual, const T* __restrict__ weight,
                        const T* __restrict__ x_weight, int64_t rows, int64_t hidden, float eps,
                        Store store) {
  static_assert(!kNormX || kAdd, "x is normalised only before a residual add");
  __shared__ float scratch[32];
  const int64_t nvec = hidden / dev::kHalfVec;
  const float inv_hidden = 1.0f / static_cast<float>(hidden);
  uint4 w[V];
  load_weight_vecs<V>(weight, hidden, w);
  uint4 wx[kNormX ? V : 1];
  if constexpr (kNormX) load_weight_vecs<V>(x_weight, hidden, wx);
  // The weights are constant: loaded before the wait for the kernel that writes x.
  dev::pdl_wait();
  dev::pdl_launch_dependents();
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const int64_t base = row * hidden;
    uint4 hv[V];  // the row's x as the dtype holds it (kNormX: x normalised with x_weight)
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const int64_t j = threadIdx.x + static_cast<int64_t>(k) * blockDim.x;
      hv[k] = j < nvec ? *reinterpret_cast<const uint4*>(x + base + j * dev::kHalfVec)
                       : make_uint4(0, 0, 0, 0);
    }
    if constexpr (kNormX) {  // hv = round(RMSNorm(x) with x_weight)
      float ssx = 0.0f;
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const int64_t j = threadIdx.x + static_cast<int64_t>(k) * blockDim.x;
        if (j < nvec) {
          float h[dev::kHalfVec];
          dev::unpack8<T>(hv[k], h);
#pragma unroll
          for (int e = 0; e < dev::kHalfVec; ++e) ssx += h[e] * h[e];
        }
      }
      const float invx = rsqrtf(dev::block_sum(ssx, scratch) * inv_hidden + eps);
#pragma unroll
      for (int k = 0; k < V; ++k) {
        float h[dev::kHalfVec];
        dev::unpack8<T>(hv[k], h);
        weigh<T, kUnitOffset>(h, wx[k], invx);
        hv[k] = dev::pack8<T>(h);
      }
    }
    add_norm_row<T, V, kAdd, kUnitOffset>(hv, residual, w, row, hidden, eps, store, scratch);
  }
}

}  // namespace tessera::cuda::norm
