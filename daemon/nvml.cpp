#include "daemon/nvml.h"

#include <dlfcn.h>

#include <cstddef>
#include <cstdlib>
#include <utility>

namespace tessera {
namespace {

// ---- The part of NVML's C ABI that we use -------------------------------------------------
// Transcribed from NVIDIA's nvml.h as published in github.com/NVIDIA/go-nvml, pkg/nvml/nvml.h
// (the CUDA 11.8 and CUDA 13.3 versions agree on everything here). C enums are 4-byte ints on
// every Linux ABI NVML ships for, so enum-typed parameters are declared as int.
using nvmlReturn_t = int;               // enum nvmlReturn_enum
using nvmlEnableState_t = int;          // enum nvmlEnableState_enum
using nvmlIntNvLinkDeviceType_t = int;  // enum nvmlIntNvLinkDeviceType_enum
using nvmlGpuTopologyLevel_t = int;     // enum nvmlGpuLevel_enum
using nvmlDevice_t = nvmlDevice_st*;    // typedef struct nvmlDevice_st* nvmlDevice_t

constexpr nvmlReturn_t NVML_SUCCESS = 0;
constexpr nvmlReturn_t NVML_ERROR_INVALID_ARGUMENT = 2;
constexpr nvmlReturn_t NVML_ERROR_NOT_SUPPORTED = 3;
constexpr nvmlReturn_t NVML_ERROR_NO_PERMISSION = 4;
constexpr nvmlReturn_t NVML_ERROR_NOT_FOUND = 6;
constexpr nvmlReturn_t NVML_ERROR_DRIVER_NOT_LOADED = 9;
constexpr nvmlReturn_t NVML_ERROR_TIMEOUT = 10;
constexpr nvmlReturn_t NVML_ERROR_GPU_IS_LOST = 15;
constexpr nvmlReturn_t NVML_ERROR_MEMORY = 20;

constexpr nvmlEnableState_t NVML_FEATURE_ENABLED = 1;

constexpr nvmlIntNvLinkDeviceType_t NVML_NVLINK_DEVICE_TYPE_GPU = 0x00;
constexpr nvmlIntNvLinkDeviceType_t NVML_NVLINK_DEVICE_TYPE_IBMNPU = 0x01;
constexpr nvmlIntNvLinkDeviceType_t NVML_NVLINK_DEVICE_TYPE_SWITCH = 0x02;

constexpr unsigned NVML_DEVICE_PCI_BUS_ID_BUFFER_SIZE = 32;
constexpr unsigned NVML_DEVICE_PCI_BUS_ID_BUFFER_V2_SIZE = 16;
constexpr unsigned NVML_DEVICE_NAME_V2_BUFFER_SIZE = 96;  // what nvmlDeviceGetName documents
constexpr unsigned NVML_DEVICE_UUID_V2_BUFFER_SIZE = 96;  // what nvmlDeviceGetUUID documents
constexpr unsigned NVML_SYSTEM_DRIVER_VERSION_BUFFER_SIZE = 80;

struct nvmlPciInfo_t {  // struct nvmlPciInfo_st
  char busIdLegacy[NVML_DEVICE_PCI_BUS_ID_BUFFER_V2_SIZE];
  unsigned int domain;
  unsigned int bus;
  unsigned int device;
  unsigned int pciDeviceId;
  unsigned int pciSubSystemId;
  char busId[NVML_DEVICE_PCI_BUS_ID_BUFFER_SIZE];
};
static_assert(offsetof(nvmlPciInfo_t, domain) == 16);
static_assert(offsetof(nvmlPciInfo_t, busId) == 36);
static_assert(sizeof(nvmlPciInfo_t) == 68);

struct nvmlMemory_t {  // struct nvmlMemory_st (version 1)
  unsigned long long total;
  unsigned long long free;
  unsigned long long used;
};
static_assert(sizeof(nvmlMemory_t) == 24);

// NVML's error string for `rc`, or a placeholder if the library gives none.
std::string describe(const char* (*error_string)(nvmlReturn_t), nvmlReturn_t rc) {
  const char* text = error_string != nullptr ? error_string(rc) : nullptr;
  std::string out = text != nullptr ? text : "unknown NVML error";
  out += " (NVML error " + std::to_string(rc) + ")";
  return out;
}

Code map_code(nvmlReturn_t rc) {
  switch (rc) {
    case NVML_ERROR_NOT_FOUND:
      return Code::kNotFound;
    case NVML_ERROR_NO_PERMISSION:
      return Code::kPermissionDenied;
    case NVML_ERROR_INVALID_ARGUMENT:
      return Code::kInvalidArgument;
    case NVML_ERROR_NOT_SUPPORTED:
      return Code::kFailedPrecondition;
    case NVML_ERROR_DRIVER_NOT_LOADED:
    case NVML_ERROR_GPU_IS_LOST:
    case NVML_ERROR_TIMEOUT:
      return Code::kUnavailable;
    case NVML_ERROR_MEMORY:
      return Code::kResourceExhausted;
    default:
      return Code::kInternal;
  }
}

// A NUL-terminated C string from a fixed buffer that NVML may have filled to the brim.
std::string from_buffer(const char* buffer, size_t size) {
  size_t n = 0;
  while (n < size && buffer[n] != '\0') ++n;
  return std::string(buffer, n);
}

NvmlPciInfo to_pci_info(const nvmlPciInfo_t& pci) {
  NvmlPciInfo out;
  out.bus_id = from_buffer(pci.busId, sizeof(pci.busId));
  if (out.bus_id.empty()) out.bus_id = from_buffer(pci.busIdLegacy, sizeof(pci.busIdLegacy));
  out.domain = pci.domain;
  out.bus = pci.bus;
  out.device = pci.device;
  out.pci_device_id = pci.pciDeviceId;
  return out;
}

template <typename F>
void resolve(void* handle, const char* name, F*& out) {
  out = reinterpret_cast<F*>(dlsym(handle, name));
}

}  // namespace

struct Nvml::Symbols {
  // Required: without these there is no GPU inventory.
  nvmlReturn_t (*init_v2)() = nullptr;
  nvmlReturn_t (*shutdown)() = nullptr;
  const char* (*error_string)(nvmlReturn_t) = nullptr;
  nvmlReturn_t (*system_get_driver_version)(char*, unsigned) = nullptr;
  nvmlReturn_t (*device_get_count_v2)(unsigned*) = nullptr;
  nvmlReturn_t (*device_get_handle_by_index_v2)(unsigned, nvmlDevice_t*) = nullptr;
  nvmlReturn_t (*device_get_name)(nvmlDevice_t, char*, unsigned) = nullptr;
  nvmlReturn_t (*device_get_uuid)(nvmlDevice_t, char*, unsigned) = nullptr;
  nvmlReturn_t (*device_get_pci_info_v3)(nvmlDevice_t, nvmlPciInfo_t*) = nullptr;
  nvmlReturn_t (*device_get_memory_info)(nvmlDevice_t, nvmlMemory_t*) = nullptr;
  // Optional: the CUDA version, and the link matrix, degrade without them.
  nvmlReturn_t (*system_get_cuda_driver_version_v2)(int*) = nullptr;
  nvmlReturn_t (*device_get_nvlink_state)(nvmlDevice_t, unsigned, nvmlEnableState_t*) = nullptr;
  nvmlReturn_t (*device_get_nvlink_remote_pci_info_v2)(nvmlDevice_t, unsigned,
                                                       nvmlPciInfo_t*) = nullptr;
  nvmlReturn_t (*device_get_nvlink_remote_device_type)(nvmlDevice_t, unsigned,
                                                       nvmlIntNvLinkDeviceType_t*) = nullptr;
  nvmlReturn_t (*device_get_topology_common_ancestor)(nvmlDevice_t, nvmlDevice_t,
                                                      nvmlGpuTopologyLevel_t*) = nullptr;

  // Resolves every symbol; returns the name of the first required one that is missing, or
  // nullptr when all required ones are there.
  const char* resolve_all(void* handle) {
    resolve(handle, "nvmlInit_v2", init_v2);
    resolve(handle, "nvmlShutdown", shutdown);
    resolve(handle, "nvmlErrorString", error_string);
    resolve(handle, "nvmlSystemGetDriverVersion", system_get_driver_version);
    resolve(handle, "nvmlDeviceGetCount_v2", device_get_count_v2);
    resolve(handle, "nvmlDeviceGetHandleByIndex_v2", device_get_handle_by_index_v2);
    resolve(handle, "nvmlDeviceGetName", device_get_name);
    resolve(handle, "nvmlDeviceGetUUID", device_get_uuid);
    resolve(handle, "nvmlDeviceGetPciInfo_v3", device_get_pci_info_v3);
    resolve(handle, "nvmlDeviceGetMemoryInfo", device_get_memory_info);
    resolve(handle, "nvmlSystemGetCudaDriverVersion_v2", system_get_cuda_driver_version_v2);
    resolve(handle, "nvmlDeviceGetNvLinkState", device_get_nvlink_state);
    resolve(handle, "nvmlDeviceGetNvLinkRemotePciInfo_v2", device_get_nvlink_remote_pci_info_v2);
    resolve(handle, "nvmlDeviceGetNvLinkRemoteDeviceType", device_get_nvlink_remote_device_type);
    resolve(handle, "nvmlDeviceGetTopologyCommonAncestor", device_get_topology_common_ancestor);
    if (init_v2 == nullptr) return "nvmlInit_v2";
    if (shutdown == nullptr) return "nvmlShutdown";
    if (error_string == nullptr) return "nvmlErrorString";
    if (system_get_driver_version == nullptr) return "nvmlSystemGetDriverVersion";
    if (device_get_count_v2 == nullptr) return "nvmlDeviceGetCount_v2";
    if (device_get_handle_by_index_v2 == nullptr) return "nvmlDeviceGetHandleByIndex_v2";
    if (device_get_name == nullptr) return "nvmlDeviceGetName";
    if (device_get_uuid == nullptr) return "nvmlDeviceGetUUID";
    if (device_get_pci_info_v3 == nullptr) return "nvmlDeviceGetPciInfo_v3";
    if (device_get_memory_info == nullptr) return "nvmlDeviceGetMemoryInfo";
    return nullptr;
  }

  // The Status for a failed call of `function`.
  Status error(const char* function, nvmlReturn_t rc) const {
    return Status(map_code(rc), std::string(function) + ": " + describe(error_string, rc));
  }
};

namespace {

Status missing(const std::string& library, const char* function) {
  return failed_precondition(library + " lacks " + function);
}

}  // namespace

Expected<std::unique_ptr<Nvml>> Nvml::open(const std::string& library) {
  std::string path = library;
  if (path.empty()) {
    const char* env = std::getenv("TESSERA_NVML_LIBRARY");
    if (env != nullptr && *env != '\0') path = env;
  }
  if (path.empty()) path = kDefaultNvmlLibrary;

  dlerror();  // clear any stale error
  void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* err = dlerror();
    std::string detail = err != nullptr ? err : "unknown dlopen error";
    if (detail.find("No such file or directory") != std::string::npos) {
      return not_found("no NVIDIA driver: " + path + " not found");
    }
    return unavailable("cannot load " + path + ": " + detail);
  }

  auto symbols = std::make_unique<Symbols>();
  if (const char* absent = symbols->resolve_all(handle); absent != nullptr) {
    dlclose(handle);
    return failed_precondition(path + " lacks " + absent +
                               " (not an NVML library, or an NVIDIA driver too old)");
  }
  if (nvmlReturn_t rc = symbols->init_v2(); rc != NVML_SUCCESS) {
    Status status = symbols->error("nvmlInit_v2", rc).with_context("NVML initialization failed");
    dlclose(handle);
    return status;
  }
  return std::unique_ptr<Nvml>(new Nvml(std::move(path), handle, std::move(symbols)));
}

Nvml::Nvml(std::string library, void* handle, std::unique_ptr<Symbols> symbols)
    : library_(std::move(library)), handle_(handle), fn_(std::move(symbols)) {}

Nvml::~Nvml() {
  // nvmlShutdown's result is ignored: nothing useful can be done about it here.
  (void)fn_->shutdown();
  dlclose(handle_);
}

bool Nvml::has_nvlink_api() const {
  return fn_->device_get_nvlink_state != nullptr &&
         fn_->device_get_nvlink_remote_pci_info_v2 != nullptr;
}

Expected<std::string> Nvml::driver_version() const {
  char buffer[NVML_SYSTEM_DRIVER_VERSION_BUFFER_SIZE] = {};
  if (nvmlReturn_t rc = fn_->system_get_driver_version(buffer, sizeof(buffer));
      rc != NVML_SUCCESS) {
    return fn_->error("nvmlSystemGetDriverVersion", rc);
  }
  return from_buffer(buffer, sizeof(buffer));
}

Expected<std::string> Nvml::cuda_version() const {
  if (fn_->system_get_cuda_driver_version_v2 == nullptr) {
    return unavailable(library_ + " has no nvmlSystemGetCudaDriverVersion_v2");
  }
  int version = 0;
  if (nvmlReturn_t rc = fn_->system_get_cuda_driver_version_v2(&version); rc != NVML_SUCCESS) {
    return fn_->error("nvmlSystemGetCudaDriverVersion_v2", rc);
  }
  // 13000 -> "13.0": major * 1000 + minor * 10.
  return std::to_string(version / 1000) + "." + std::to_string(version % 1000 / 10);
}

Expected<uint32_t> Nvml::device_count() const {
  unsigned count = 0;
  if (nvmlReturn_t rc = fn_->device_get_count_v2(&count); rc != NVML_SUCCESS) {
    return fn_->error("nvmlDeviceGetCount_v2", rc);
  }
  return static_cast<uint32_t>(count);
}

Expected<NvmlDevice> Nvml::device(uint32_t index) const {
  nvmlDevice_t device = nullptr;
  if (nvmlReturn_t rc = fn_->device_get_handle_by_index_v2(index, &device); rc != NVML_SUCCESS) {
    return fn_->error("nvmlDeviceGetHandleByIndex_v2", rc);
  }
  return device;
}

Expected<std::string> Nvml::name(NvmlDevice device) const {
  char buffer[NVML_DEVICE_NAME_V2_BUFFER_SIZE] = {};
  if (nvmlReturn_t rc = fn_->device_get_name(device, buffer, sizeof(buffer)); rc != NVML_SUCCESS) {
    return fn_->error("nvmlDeviceGetName", rc);
  }
  return from_buffer(buffer, sizeof(buffer));
}

Expected<std::string> Nvml::uuid(NvmlDevice device) const {
  char buffer[NVML_DEVICE_UUID_V2_BUFFER_SIZE] = {};
  if (nvmlReturn_t rc = fn_->device_get_uuid(device, buffer, sizeof(buffer)); rc != NVML_SUCCESS) {
    return fn_->error("nvmlDeviceGetUUID", rc);
  }
  return from_buffer(buffer, sizeof(buffer));
}

Expected<NvmlPciInfo> Nvml::pci_info(NvmlDevice device) const {
  nvmlPciInfo_t pci = {};
  if (nvmlReturn_t rc = fn_->device_get_pci_info_v3(device, &pci); rc != NVML_SUCCESS) {
    return fn_->error("nvmlDeviceGetPciInfo_v3", rc);
  }
  return to_pci_info(pci);
}

Expected<NvmlMemory> Nvml::memory(NvmlDevice device) const {
  nvmlMemory_t memory = {};
  if (nvmlReturn_t rc = fn_->device_get_memory_info(device, &memory); rc != NVML_SUCCESS) {
    return fn_->error("nvmlDeviceGetMemoryInfo", rc);
  }
  return NvmlMemory{memory.total, memory.free, memory.used};
}

Expected<NvlinkState> Nvml::nvlink_state(NvmlDevice device, uint32_t link) const {
  if (fn_->device_get_nvlink_state == nullptr) {
    return missing(library_, "nvmlDeviceGetNvLinkState");
  }
  nvmlEnableState_t active = 0;
  nvmlReturn_t rc = fn_->device_get_nvlink_state(device, link, &active);
  if (rc == NVML_ERROR_INVALID_ARGUMENT || rc == NVML_ERROR_NOT_SUPPORTED) {
    return NvlinkState::kAbsent;
  }
  if (rc != NVML_SUCCESS) return fn_->error("nvmlDeviceGetNvLinkState", rc);
  return active == NVML_FEATURE_ENABLED ? NvlinkState::kActive : NvlinkState::kInactive;
}

Expected<NvmlPciInfo> Nvml::nvlink_remote_pci(NvmlDevice device, uint32_t link) const {
  if (fn_->device_get_nvlink_remote_pci_info_v2 == nullptr) {
    return missing(library_, "nvmlDeviceGetNvLinkRemotePciInfo_v2");
  }
  nvmlPciInfo_t pci = {};
  if (nvmlReturn_t rc = fn_->device_get_nvlink_remote_pci_info_v2(device, link, &pci);
      rc != NVML_SUCCESS) {
    return fn_->error("nvmlDeviceGetNvLinkRemotePciInfo_v2", rc);
  }
  NvmlPciInfo out = to_pci_info(pci);
  out.pci_device_id = 0;  // not documented as filled for remote ends
  return out;
}

Expected<NvlinkRemote> Nvml::nvlink_remote_type(NvmlDevice device, uint32_t link) const {
  if (fn_->device_get_nvlink_remote_device_type == nullptr) {
    return missing(library_, "nvmlDeviceGetNvLinkRemoteDeviceType");
  }
  nvmlIntNvLinkDeviceType_t type = 0;
  if (nvmlReturn_t rc = fn_->device_get_nvlink_remote_device_type(device, link, &type);
      rc != NVML_SUCCESS) {
    return fn_->error("nvmlDeviceGetNvLinkRemoteDeviceType", rc);
  }
  switch (type) {
    case NVML_NVLINK_DEVICE_TYPE_GPU:
      return NvlinkRemote::kGpu;
    case NVML_NVLINK_DEVICE_TYPE_IBMNPU:
      return NvlinkRemote::kIbmNpu;
    case NVML_NVLINK_DEVICE_TYPE_SWITCH:
      return NvlinkRemote::kSwitch;
    default:
      return NvlinkRemote::kUnknown;
  }
}

Expected<NvmlTopologyLevel> Nvml::common_ancestor(NvmlDevice a, NvmlDevice b) const {
  if (fn_->device_get_topology_common_ancestor == nullptr) {
    return missing(library_, "nvmlDeviceGetTopologyCommonAncestor");
  }
  nvmlGpuTopologyLevel_t level = 0;
  if (nvmlReturn_t rc = fn_->device_get_topology_common_ancestor(a, b, &level);
      rc != NVML_SUCCESS) {
    return fn_->error("nvmlDeviceGetTopologyCommonAncestor", rc);
  }
  return static_cast<NvmlTopologyLevel>(level);
}

}  // namespace tessera
