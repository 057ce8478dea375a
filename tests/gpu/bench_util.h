// What the GPU benchmarks (kernel_bench, moe_bench) share: exiting on a failed call, device
// buffers of random bf16 values, and the device-to-device copy bandwidth their figures are
// fractions of.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "common/status.h"

namespace tessera::cuda::bench {

inline void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}
inline void check(const Status& s, const char* what) {
  if (!s.is_ok()) {
    std::fprintf(stderr, "%s: %s\n", what, s.to_string().c_str());
    std::exit(1);
  }
}

// `bytes` of device memory holding random bf16 values in [-1, 1) (a 32 MB xorshift pattern,
// repeated), or zeros. A tensor-core GEMM's power draw, and so the clock it holds under the
// H200's power limit, depends on the bits it multiplies: on zeros the prefill GEMMs ran ~10%
// faster than they do on a real checkpoint's weights.
inline void* dalloc(size_t bytes, bool zeros = false) {
  void* p = nullptr;
  check(cudaMalloc(&p, bytes), "cudaMalloc");
  check(cudaMemset(p, 0, bytes), "cudaMemset");
  if (zeros) return p;
  static const std::vector<uint16_t> pattern = [] {
    std::vector<uint16_t> v(16u << 20);
    uint32_t x = 2463534242u;  // xorshift32
    for (uint16_t& e : v) {
      x ^= x << 13;
      x ^= x >> 17;
      x ^= x << 5;
      const float f = static_cast<float>(x >> 8) * (2.0f / 16777216.0f) - 1.0f;
      uint32_t bits;
      std::memcpy(&bits, &f, 4);
      e = static_cast<uint16_t>(bits >> 16);
    }
    return v;
  }();
  const size_t chunk = pattern.size() * sizeof(uint16_t);
  for (size_t off = 0; off + 2 <= bytes; off += chunk) {
    const size_t n = std::min(chunk, bytes - off) & ~size_t{1};
    check(cudaMemcpy(static_cast<char*>(p) + off, pattern.data(), n, cudaMemcpyHostToDevice),
          "random fill");
  }
  return p;
}

// Device-to-device copy bandwidth (bytes read + written), GB/s: 10 plain stream copies of 1 GiB
// (a copy node in a graph measured ~2.7 TB/s against ~4.3 here).
inline double copy_bandwidth(cudaStream_t st) {
  const size_t bytes = size_t{1} << 30;
  void *src = nullptr, *dst = nullptr;
  check(cudaMalloc(&src, bytes), "cudaMalloc");
  check(cudaMalloc(&dst, bytes), "cudaMalloc");
  check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, st), "copy");
  cudaEvent_t a, b;
  check(cudaEventCreate(&a), "event");
  check(cudaEventCreate(&b), "event");
  check(cudaEventRecord(a, st), "event");
  for (int i = 0; i < 10; ++i) {
    check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, st), "copy");
  }
  check(cudaEventRecord(b, st), "event");
  check(cudaEventSynchronize(b), "copy sync");
  float ms = 0;
  cudaEventElapsedTime(&ms, a, b);
  cudaFree(src);
  cudaFree(dst);
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return 2.0 * static_cast<double>(bytes) * 10 / (ms * 1e-3) / 1e9;
}

}  // namespace tessera::cuda::bench
