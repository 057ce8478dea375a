// NVML (NVIDIA Management Library), loaded at run time with dlopen.
//
// The daemon must start on machines without an NVIDIA driver (CI, laptops, CPU-only nodes), so
// it never links libnvidia-ml: `Nvml::open` loads the library, resolves the few symbols used
// here, and calls nvmlInit_v2; the destructor calls nvmlShutdown and unloads it. No NVML header
// is needed to build: nvml.cpp declares the functions and structs it uses with the ABI of
// NVIDIA's nvml.h.
//
// Every wrapper returns Expected<...>; a failure's message names the NVML function and carries
// NVML's own error string, e.g. "nvmlDeviceGetMemoryInfo: GPU is lost (NVML error 15)".
// NVML error codes map to Status codes as: NOT_FOUND → kNotFound, NO_PERMISSION →
// kPermissionDenied, INVALID_ARGUMENT → kInvalidArgument, NOT_SUPPORTED → kFailedPrecondition,
// DRIVER_NOT_LOADED / GPU_IS_LOST / TIMEOUT → kUnavailable, MEMORY → kResourceExhausted, anything
// else → kInternal. A wrapper whose NVML function the loaded library lacks fails with
// kFailedPrecondition "<library> lacks <function>".
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "common/status.h"

// NVML's opaque device type; `nvmlDevice_t` is a pointer to it.
struct nvmlDevice_st;

namespace tessera {

// A GPU handle from NVML. Valid while the Nvml that returned it is alive.
using NvmlDevice = nvmlDevice_st*;

// The library loaded when neither the constructor argument nor $TESSERA_NVML_LIBRARY names one.
inline constexpr const char* kDefaultNvmlLibrary = "libnvidia-ml.so.1";

// Highest NVLink index + 1 worth asking about. nvml.h defines NVML_NVLINK_MAX_LINKS as 18 up to
// CUDA 13.2 and 36 from CUDA 13.3; drivers answer NVML_ERROR_INVALID_ARGUMENT for an index past
// their own limit, which `nvlink_state` reports as kAbsent, so asking about 36 is safe everywhere.
inline constexpr uint32_t kNvmlMaxNvlinks = 36;

// PCI location of a device (nvmlPciInfo_t, reduced to what we use).
struct NvmlPciInfo {
  std::string bus_id;  // "00000000:18:00.0" (domain:bus:device.function, as NVML spells it)
  uint32_t domain = 0;
  uint32_t bus = 0;
  uint32_t device = 0;
  uint32_t pci_device_id = 0;  // 16-bit device id << 16 | 16-bit vendor id
};

// Device memory in bytes (nvmlMemory_t). `used` includes what the driver reserves.
struct NvmlMemory {
  uint64_t total = 0;
  uint64_t free = 0;
  uint64_t used = 0;
};

// State of one NVLink of a GPU.
enum class NvlinkState {
  kActive,    // trained and up
  kInactive,  // exists but is down
  kAbsent,    // the GPU has no link with this index, or no NVLink at all
};

// What sits at the far end of an NVLink (nvmlIntNvLinkDeviceType_t).
enum class NvlinkRemote { kGpu, kIbmNpu, kSwitch, kUnknown };

// How far apart two GPUs are on the PCIe tree (nvmlGpuTopologyLevel_t; values are NVML's).
enum class NvmlTopologyLevel : int {
  kInternal = 0,     // same board (e.g. the two GPUs of a Tesla K80)
  kSingle = 10,      // at most one PCIe switch between them
  kMultiple = 20,    // several PCIe switches, no host bridge
  kHostBridge = 30,  // through one PCIe host bridge (typically the CPU)
  kNode = 40,        // through several host bridges of one NUMA node
  kSystem = 50,      // through the interconnect between NUMA nodes (QPI/UPI/xGMI)
};

// A loaded and initialized NVML. Non-copyable, non-movable (handles point into it): own it with
// the unique_ptr that `open` returns. Every method is const and may be called from any thread
// (NVML itself is thread-safe).
class Nvml {
 public:
  // Loads the library — `library` if not empty, else $TESSERA_NVML_LIBRARY if set and not empty,
  // else kDefaultNvmlLibrary — resolves its symbols and calls nvmlInit_v2. Fails with
  //  - kNotFound "no NVIDIA driver: <library> not found" when the file does not exist;
  //  - kUnavailable "cannot load <library>: <dlerror>" when it exists but does not load;
  //  - kFailedPrecondition "<library> lacks <symbol> ..." when a symbol needed for the basic
  //    GPU inventory is missing (a very old driver); the NVLink and topology functions
  //    are optional: without them those wrappers fail with kFailedPrecondition instead;
  //  - the mapped NVML code, with "nvmlInit_v2: <NVML error string>", when initialization fails
  //    (e.g. kUnavailable "nvmlInit_v2: Driver Not Loaded (NVML error 9)").
  static Expected<std::unique_ptr<Nvml>> open(const std::string& library = "");

  // nvmlShutdown, then dlclose.
  ~Nvml();
  Nvml(const Nvml&) = delete;
  Nvml& operator=(const Nvml&) = delete;

  // The path or name that was loaded.
  const std::string& library() const { return library_; }
  // Whether the library has the NVLink functions (nvmlDeviceGetNvLinkState and
  // nvmlDeviceGetNvLinkRemotePciInfo_v2); without them `nvlink_state` and `nvlink_remote_pci`
  // always fail.
  bool has_nvlink_api() const;

  // The driver's version, e.g. "580.159.04" (nvmlSystemGetDriverVersion).
  Expected<std::string> driver_version() const;
  // The newest CUDA version the driver supports, "13.0" (nvmlSystemGetCudaDriverVersion_v2).
  Expected<std::string> cuda_version() const;
  // Number of GPUs NVML sees (nvmlDeviceGetCount_v2). NVML ignores CUDA_VISIBLE_DEVICES but
  // respects the GPUs a container was given.
  Expected<uint32_t> device_count() const;
  // Handle of the GPU with NVML index `index` (nvmlDeviceGetHandleByIndex_v2). NVML indexes GPUs
  // in PCI bus order, which is CUDA's order only with CUDA_DEVICE_ORDER=PCI_BUS_ID.
  Expected<NvmlDevice> device(uint32_t index) const;

  // Product name, e.g. "NVIDIA H200" (nvmlDeviceGetName).
  Expected<std::string> name(NvmlDevice device) const;
  // "GPU-<8-4-4-4-12 hex>" (nvmlDeviceGetUUID): what CUDA_VISIBLE_DEVICES accepts.
  Expected<std::string> uuid(NvmlDevice device) const;
  // nvmlDeviceGetPciInfo_v3.
  Expected<NvmlPciInfo> pci_info(NvmlDevice device) const;
  // nvmlDeviceGetMemoryInfo.
  Expected<NvmlMemory> memory(NvmlDevice device) const;

  // State of NVLink `link` (nvmlDeviceGetNvLinkState). NVML's INVALID_ARGUMENT (no such link
  // index) and NOT_SUPPORTED (no NVLink on this GPU) are reported as kAbsent, not as errors.
  Expected<NvlinkState> nvlink_state(NvmlDevice device, uint32_t link) const;
  // PCI location of the device at the far end of NVLink `link`
  // (nvmlDeviceGetNvLinkRemotePciInfo_v2). Only `bus_id`, `domain`, `bus` and `device` are set.
  Expected<NvmlPciInfo> nvlink_remote_pci(NvmlDevice device, uint32_t link) const;
  // Kind of the device at the far end of NVLink `link` (nvmlDeviceGetNvLinkRemoteDeviceType,
  // NVML 11.4 / driver R470 and later).
  Expected<NvlinkRemote> nvlink_remote_type(NvmlDevice device, uint32_t link) const;
  // Nearest common PCIe ancestor of two GPUs (nvmlDeviceGetTopologyCommonAncestor). A level that
  // NVML may add later is passed through as its integer value.
  Expected<NvmlTopologyLevel> common_ancestor(NvmlDevice a, NvmlDevice b) const;

 private:
  struct Symbols;
  Nvml(std::string library, void* handle, std::unique_ptr<Symbols> symbols);

  std::string library_;
  void* handle_;                       // from dlopen
  std::unique_ptr<const Symbols> fn_;  // resolved entry points
};

}  // namespace tessera
