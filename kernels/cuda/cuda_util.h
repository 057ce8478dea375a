// Small host-side helpers shared by the CUDA kernels' launch functions and the CUDA model:
// cudaError_t -> Status, an owning device buffer, and the element type behind a DType.
// Compiled by both g++ and nvcc; no fmt/spdlog here.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>

#include "common/status.h"
#include "common/tensor.h"

namespace tessera::cuda {

// OK, or INTERNAL naming `what` and CUDA's error string ("cudaMalloc of 1.5 GiB: out of
// memory"). cudaErrorMemoryAllocation becomes RESOURCE_EXHAUSTED.
Status cuda_status(cudaError_t err, const std::string& what);

// The launch error of the last kernel (cudaGetLastError), as a Status naming the kernel.
Status launch_status(const char* kernel);

#define TESSERA_CUDA_RETURN_IF_ERROR(expr, what)                      \
  do {                                                                \
    cudaError_t tessera_cuda_err_ = (expr);                           \
    if (tessera_cuda_err_ != cudaSuccess)                             \
      return ::tessera::cuda::cuda_status(tessera_cuda_err_, (what)); \
  } while (0)

// Launches `kernel` with programmatic stream serialization: it may start while the kernel before
// it on `stream` runs (see dev::pdl_wait in device_math.cuh, which every kernel launched this way
// must call before it touches what earlier kernels write). Inside a graph capture the overlap
// becomes a programmatic edge of the graph. The arguments convert to the kernel's parameter types.
// A launch error is returned and, as for any runtime call, left for cudaGetLastError (which
// launch_status reads).
template <typename... Params, typename... Args>
cudaError_t launch_pdl(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                       cudaStream_t stream, Args&&... args) {
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = &attr;
  config.numAttrs = 1;
  return cudaLaunchKernelEx(&config, kernel, static_cast<Params>(std::forward<Args>(args))...);
}

// The current device's SM count and L2 size in bytes (cached per device: host queries that are
// legal during stream capture); 0 where the query fails.
int current_sm_count();
int64_t current_l2_bytes();

// Bytes of weights a kernel may ask L2 to fetch before its dev::pdl_wait() (dev::prefetch_l2),
// while the kernel before it still runs: half the L2, so that what the kernels before wrote
// stays. 0 where the L2 size is unknown.
inline int64_t l2_prefetch_budget() { return current_l2_bytes() / 2; }

// Owns `bytes` of device memory (cudaMalloc / cudaFree). Move-only.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  static Expected<DeviceBuffer> allocate(size_t bytes, const std::string& what);
  DeviceBuffer(DeviceBuffer&& o) noexcept
      : ptr_(std::exchange(o.ptr_, nullptr)), bytes_(std::exchange(o.bytes_, 0)) {}
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    if (this != &o) {
      reset();
      ptr_ = std::exchange(o.ptr_, nullptr);
      bytes_ = std::exchange(o.bytes_, 0);
    }
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() { reset(); }

  void reset();
  void* get() const { return ptr_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }
  size_t bytes() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

// Activation dtypes the CUDA kernels take: kBF16 or kF16 (kF32 only where a header says so).
inline bool is_half_type(DType d) { return d == DType::kBF16 || d == DType::kF16; }

}  // namespace tessera::cuda
