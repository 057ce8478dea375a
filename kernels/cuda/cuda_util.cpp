#include "kernels/cuda/cuda_util.h"

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
