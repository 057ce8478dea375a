// The host side of the per-block marks (block_trace.cuh): the record, the buffer the marked
// kernels append to, and attaching it. Built with TESSERA_BLOCK_TRACE only; otherwise attach()
// answers cudaErrorNotSupported.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace tessera::cuda::block_trace {

// The marked kernels (a record's kernel field).
enum class Kernel : uint32_t {
  kNormGemv = 1,     // the GEMV with the RMSNorm before it (q|k|v's)
  kNormGemvF32 = 2,  // the same with fp32 out (the MoE router's)
  kGemv = 3,         // the plain GEMV (o's)
  kAttention = 4,    // the decode attention (rope inside)
  kCombine = 5,      // the attention's split merge
  kRoute = 6,        // the MoE routing
  kGateUp = 7,       // the MoE gate_up GEMV
  kDown = 8,         // the MoE down GEMV + weighted sum
};

// One block: kernel | sm << 16, its linear index, and the global timer (ns) at its start, when
// its PDL wait returned (0 for a kernel without one), at two marks between (0 where the kernel
// has none) and at its end (thread 0's).
struct Record {
  uint32_t kernel_sm;
  uint32_t block;
  uint64_t start, waited, end;
  uint64_t at[2];
};

// Each SM's records go to its own part of the buffer, counted by its own counter (next[sm *
// kCounterStride], a line apart): records[sm * per_sm + i] for i < min(count, per_sm).
constexpr unsigned kMaxSms = 256;
constexpr unsigned kCounterStride = 32;

// Device memory: kMaxSms x per_sm records and kMaxSms x kCounterStride counters (zeroed).
struct Buffer {
  Record* records = nullptr;
  unsigned long long* next = nullptr;
  unsigned long long per_sm = 0;
};

cudaError_t attach_gemv(const Buffer& b);
cudaError_t attach_moe(const Buffer& b);
cudaError_t attach_attention(const Buffer& b);

// Every marked translation unit appends to b from its next kernel on (b = {}: none does).
inline cudaError_t attach(const Buffer& b) {
  for (auto f : {attach_gemv, attach_moe, attach_attention}) {
    const cudaError_t err = f(b);
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

}  // namespace tessera::cuda::block_trace
