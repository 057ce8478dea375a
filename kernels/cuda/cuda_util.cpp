#include "kernels/cuda/cuda_util.h"

#include <atomic>

namespace tessera::cuda {

Status cuda_status(cudaError_t err, const std::string& what) {
  if (err == cudaSuccess) return Status::ok();
  std::string msg = what + ": " + cudaGetErrorString(err);
  if (err == cudaErrorMemoryAllocation) return resource_exhausted(msg);
  return internal_error(msg);
}

Status launch_status(const char* kernel) {
  cudaError_t err = cudaGetLastError();
  if (err == cudaSuccess) return Status::ok();
  return internal_error(std::string("launching ") + kernel + ": " + cudaGetErrorString(err));
}

namespace {

// attr of the current device, cached per device (up to 64 devices; others are queried each time).
int64_t cached_attribute(cudaDeviceAttr attr, std::atomic<int64_t> (&cache)[64]) {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0) return 0;
  if (device < 64) {
    const int64_t known = cache[device].load(std::memory_order_relaxed);
    if (known != 0) return known;
  }
  int v = 0;
  if (cudaDeviceGetAttribute(&v, attr, device) != cudaSuccess) return 0;
  if (device < 64) cache[device].store(v, std::memory_order_relaxed);
  return v;
}

}  // namespace

int current_sm_count() {
  static std::atomic<int64_t> cache[64] = {};
  return static_cast<int>(cached_attribute(cudaDevAttrMultiProcessorCount, cache));
}

int64_t current_l2_bytes() {
  static std::atomic<int64_t> cache[64] = {};
  return cached_attribute(cudaDevAttrL2CacheSize, cache);
}

Expected<DeviceBuffer> DeviceBuffer::allocate(size_t bytes, const std::string& what) {
  DeviceBuffer b;
  if (bytes == 0) return b;
  void* p = nullptr;
  cudaError_t err = cudaMalloc(&p, bytes);
  if (err != cudaSuccess) {
    cudaGetLastError();  // clear the sticky-free error so later calls are not blamed
    return cuda_status(
        err, "allocating " + std::to_string(bytes) + " bytes of device memory for " + what);
  }
  b.ptr_ = p;
  b.bytes_ = bytes;
  return b;
}

void DeviceBuffer::reset() {
  if (ptr_ != nullptr) cudaFree(ptr_);
  ptr_ = nullptr;
  bytes_ = 0;
}

}  // namespace tessera::cuda
