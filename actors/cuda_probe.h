// What the CUDA runtime in an actor process sees: the devices CUDA_VISIBLE_DEVICES left it,
// their memory, and the NCCL library's version. No CUDA headers here: the driver side and the
// CPU build include this too.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace tessera {

struct CudaDevice {
  int ordinal = 0;            // CUDA ordinal within this process
  std::string name;           // "NVIDIA H200"
  std::string uuid;           // "GPU-5f1c..."
  std::string pci_bus_id;     // "0000:18:00.0"
  uint64_t memory_total = 0;  // bytes
  uint64_t memory_free = 0;   // bytes
  int sm_major = 0;
  int sm_minor = 0;
  int multiprocessors = 0;
};

struct CudaProbe {
  bool built_with_cuda = false;
  bool available = false;   // at least one device is usable
  std::string note;         // why not, when not available
  int runtime_version = 0;  // 13000 for CUDA 13.0
  int driver_version = 0;
  std::string nccl_version;  // "2.28.9"
  std::vector<CudaDevice> devices;
};

// Queries the CUDA runtime (creating a context on each visible device) and NCCL. Never fails:
// problems land in `note`.
CudaProbe probe_cuda();

}  // namespace tessera
