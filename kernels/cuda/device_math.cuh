// Device-side helpers shared by the CUDA kernels (include from .cu files only): fp32 <-> bf16 /
// fp16 / fp32 conversion with round-to-nearest-even, "round to the element type and back" (how
// the kernels mimic a bf16/fp16 tensor op materialising its result), 16-byte vector loads and
// stores of 8 half-precision elements, and warp / block sums.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace tessera::cuda::dev {

// ---- element conversions ----

template <typename T>
__device__ __forceinline__ float to_float(T x);
template <>
__device__ __forceinline__ float to_float<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ float to_float<__half>(__half x) {
  return __half2float(x);
}
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 x) {
  return __bfloat162float(x);
}
template <>
__device__ __forceinline__ float to_float<__nv_fp8_e4m3>(__nv_fp8_e4m3 x) {
  return static_cast<float>(x);  // exact
}

// fp32 -> T, round to nearest even (overflow to inf, as torch's .to(dtype); FP8 E4M3 saturates
// at +-448 instead, as the KV cache stores it).
template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __half from_float<__half>(float x) {
  return __float2half_rn(x);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
template <>
__device__ __forceinline__ __nv_fp8_e4m3 from_float<__nv_fp8_e4m3>(float x) {
  __nv_fp8_e4m3 r;
  r.__x = __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3);
  return r;
}

// x rounded to T and widened back: the value a T tensor would hold.
template <typename T>
__device__ __forceinline__ float round_to(float x) {
  return to_float(from_float<T>(x));
}

// ---- 16-byte vectors of 8 half-precision elements ----

// Number of 2-byte elements in one 16-byte vector access.
inline constexpr int kHalfVec = 8;

// The 8 elements packed in a 16-byte vector, widened to fp32.
template <typename T>
__device__ __forceinline__ void unpack8(const uint4& raw, float (&out)[kHalfVec]) {
  static_assert(sizeof(T) == 2, "unpack8 is for 2-byte element types");
  const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int i = 0; i < kHalfVec; ++i) out[i] = to_float(e[i]);
}

// 8 fp32 values rounded to T and packed into a 16-byte vector.
template <typename T>
__device__ __forceinline__ uint4 pack8(const float (&in)[kHalfVec]) {
  static_assert(sizeof(T) == 2, "pack8 is for 2-byte element types");
  uint4 raw;
  T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
  for (int i = 0; i < kHalfVec; ++i) e[i] = from_float<T>(in[i]);
  return raw;
}

// Loads 8 elements at p (16-byte aligned) widened to fp32.
template <typename T>
__device__ __forceinline__ void load8(const T* p, float (&out)[kHalfVec]) {
  unpack8<T>(*reinterpret_cast<const uint4*>(p), out);
}

// Same through the read-only data cache (p must not be written while the kernel runs).
template <typename T>
__device__ __forceinline__ void load8_ro(const T* p, float (&out)[kHalfVec]) {
  unpack8<T>(__ldg(reinterpret_cast<const uint4*>(p)), out);
}

// Rounds 8 fp32 values to T and stores them at p (16-byte aligned).
template <typename T>
__device__ __forceinline__ void store8(T* p, const float (&in)[kHalfVec]) {
  *reinterpret_cast<uint4*>(p) = pack8<T>(in);
}

// ---- programmatic dependent launch (sm_90) ----
//
// A kernel launched with launch_pdl (cuda_util.h) may start while the kernel before it on the
// stream is still running, so that its launch and its reads of constant data (weights) overlap
// that kernel's tail. Every such kernel calls pdl_wait() before it reads anything an earlier
// kernel wrote and before it writes anything at all: the wait returns once the kernel before has
// finished and its writes are visible. Since each kernel waits before it finishes, a finished
// kernel implies every earlier one finished too. pdl_launch_dependents() lets the next kernel's
// blocks be scheduled once every block of this one has called it (or finished). Both are no-ops
// for a kernel launched the ordinary way.
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void pdl_launch_dependents() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

// ---- reductions ----

// Sum over the 32 lanes of a full warp; every lane gets the (bitwise identical) total.
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// Sum over the whole block; every thread gets the same total. blockDim.x must be a multiple of 32
// (<= 1024) and every thread of the block must call it. `scratch` is __shared__ float[32]. Ends
// with a barrier, so it may be called again (next row) with the same scratch.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int warp = static_cast<int>(threadIdx.x) >> 5;
  const int num_warps = static_cast<int>(blockDim.x) >> 5;
  v = warp_sum(v);
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  // Every warp reduces the per-warp partials itself: no second broadcast round trip.
  float total = lane < num_warps ? scratch[lane] : 0.0f;
  total = warp_sum(total);
  __syncthreads();
  return total;
}

// 16 bytes of data read once (weights streamed from HBM): not kept in L1, read-only path.
__device__ __forceinline__ uint4 ldg_stream(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// Asks L2 to fetch the 128-byte line holding p; the thread does not wait for it.
__device__ __forceinline__ void prefetch_l2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

// The warp's lanes ask L2 for the lines of [p, p + bytes), every 32nd line each: a kernel
// launched with launch_pdl calls it on weights before dev::pdl_wait(), so they stream in while the
// kernel before still runs (l2_prefetch_budget in cuda_util.h bounds the bytes).
__device__ __forceinline__ void warp_prefetch_l2(const void* p, int bytes, int lane) {
  const char* c = static_cast<const char*>(p);
  for (int off = lane * 128; off < bytes; off += 32 * 128) prefetch_l2(c + off);
}

}  // namespace tessera::cuda::dev
