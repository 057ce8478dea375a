// CUDA side of the actor's device probe. No fmt/spdlog here (nvcc and fmt's consteval format
// strings do not mix in C++20).
#include <cuda_runtime.h>
#include <nccl.h>

#include <cstdio>

#include "actors/cuda_probe.h"

namespace tessera {

namespace {

std::string uuid_text(const cudaUUID_t& u) {
  char buf[64];
  const auto* b = reinterpret_cast<const unsigned char*>(u.bytes);
  std::snprintf(buf, sizeof(buf),
                "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0],
                b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13],
                b[14], b[15]);
  return buf;
}

}  // namespace

CudaProbe probe_cuda() {
  CudaProbe p;
  p.built_with_cuda = true;
  int nccl = 0;
  if (ncclGetVersion(&nccl) == ncclSuccess) {
    p.nccl_version = std::to_string(nccl / 10000) + "." + std::to_string((nccl / 100) % 100) + "." +
                     std::to_string(nccl % 100);
  }
  cudaRuntimeGetVersion(&p.runtime_version);
  cudaDriverGetVersion(&p.driver_version);
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    p.note = std::string("CUDA reports no usable device: ") + cudaGetErrorString(err);
    cudaGetLastError();
    return p;
  }
  if (count == 0) {
    p.note = "CUDA sees no device (CUDA_VISIBLE_DEVICES is empty)";
    return p;
  }
  for (int i = 0; i < count; ++i) {
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, i) != cudaSuccess) continue;
    CudaDevice d;
    d.ordinal = i;
    d.name = prop.name;
    d.uuid = uuid_text(prop.uuid);
    char bus[32];
    std::snprintf(bus, sizeof(bus), "%04x:%02x:%02x.0", prop.pciDomainID, prop.pciBusID,
                  prop.pciDeviceID);
    d.pci_bus_id = bus;
    d.sm_major = prop.major;
    d.sm_minor = prop.minor;
    d.multiprocessors = prop.multiProcessorCount;
    size_t free_bytes = 0, total_bytes = 0;
    if (cudaSetDevice(i) == cudaSuccess &&
        cudaMemGetInfo(&free_bytes, &total_bytes) == cudaSuccess) {
      d.memory_total = total_bytes;
      d.memory_free = free_bytes;
    } else {
      d.memory_total = prop.totalGlobalMem;
    }
    p.devices.push_back(d);
  }
  p.available = !p.devices.empty();
  if (!p.available) p.note = "CUDA could not read any device's properties";
  return p;
}

}  // namespace tessera
