// Per-block marks for the decode chain's timeline below the kernel level: where each block of a
// kernel ran (its SM), when it started, when its PDL wait returned and when it finished, in the
// GPU's global timer. CUPTI and nsys see kernels whole; these show which blocks were placed
// before the kernel ahead finished, how long each waited, and the spread of their ends.
//
// Compiled in only with TESSERA_BLOCK_TRACE (the CMake option of that name; moe_bench reads the
// records, scripts/bench/block_trace.py summarises them); otherwise each mark is empty and a
// kernel is the same code as without it.
#pragma once

#include <cstdint>

#include "kernels/cuda/block_trace.h"

namespace tessera::cuda::block_trace {

#ifdef TESSERA_BLOCK_TRACE
// Each translation unit that marks blocks holds its own copy (the build has no relocatable
// device code); its attach function (TESSERA_BLOCK_TRACE_ATTACH) sets it.
static __device__ Buffer g_buffer;

__device__ __forceinline__ uint64_t now() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ uint32_t sm_id() {
  uint32_t sm;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
  return sm;
}

// Thread 0 of the block takes the times and its record's slot at the start, from its SM's own
// counter (one counter for every block of the chain serialised their atomics in one L2 slice and
// slowed the chain by a tenth; at the end the atomic's round trip would delay the block's exit);
// end() writes the record. The marks still cost the chain ~7%, the attention's wait the most.
struct Mark {
  uint64_t start = 0, waited = 0, at_[2] = {0, 0};
  Record* slot = nullptr;
  __device__ __forceinline__ Mark() {
    if (threadIdx.x != 0) return;
    start = now();
    const uint32_t sm = sm_id();
    if (g_buffer.records == nullptr || sm >= kMaxSms) return;
    const unsigned long long at = atomicAdd(g_buffer.next + sm * kCounterStride, 1ull);
    if (at < g_buffer.per_sm) slot = g_buffer.records + sm * g_buffer.per_sm + at;
  }
  __device__ __forceinline__ void wait_returned() {
    if (threadIdx.x == 0) waited = now();
  }
  // A point between the wait and the end (i: 0 or 1), for a kernel's phases.
  __device__ __forceinline__ void at(int i) {
    if (threadIdx.x == 0) at_[i] = now();
  }
  __device__ __forceinline__ void end(Kernel kernel) {
    if (threadIdx.x != 0 || slot == nullptr) return;
    const uint32_t block = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    *slot = {static_cast<uint32_t>(kernel) | (sm_id() << 16),
             block,
             start,
             waited,
             now(),
             {at_[0], at_[1]}};
  }
};

#define TESSERA_BLOCK_TRACE_ATTACH(name)                                                   \
  cudaError_t attach_##name(const Buffer& b) {                                             \
    return cudaMemcpyToSymbol(::tessera::cuda::block_trace::g_buffer, &b, sizeof(Buffer)); \
  }
#else
struct Mark {
  __device__ __forceinline__ void wait_returned() {}
  __device__ __forceinline__ void at(int) {}
  __device__ __forceinline__ void end(Kernel) {}
};

#define TESSERA_BLOCK_TRACE_ATTACH(name) \
  cudaError_t attach_##name(const Buffer&) { return cudaErrorNotSupported; }
#endif

}  // namespace tessera::cuda::block_trace
