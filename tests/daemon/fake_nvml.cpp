// A stand-in for libnvidia-ml.so.1: exports the NVML entry points that daemon/nvml.cpp uses and
// pretends to be a node with NVIDIA H200 GPUs. Tests load it through TESSERA_NVML_LIBRARY or the
// Nvml::open argument.
//
// The declarations follow NVIDIA's nvml.h (github.com/NVIDIA/go-nvml, pkg/nvml/nvml.h); they are
// written out again here rather than shared with nvml.cpp so that this file is a second, separate
// reading of the ABI.
//
// Behaviour, read from the environment at each call:
//   TESSERA_FAKE_NVML_INIT_FAIL=1     nvmlInit_v2 returns NVML_ERROR_DRIVER_NOT_LOADED.
//   TESSERA_FAKE_NVML_GPUS=N          number of GPUs, 0..8 (default 2).
//   TESSERA_FAKE_NVML_TOPOLOGY=T      "nvlink" (default): GPUs 2k and 2k+1 joined by 18 NVLinks
//                                     (an odd last GPU has its links down);
//                                     "pcie": no NVLink (nvmlDeviceGetNvLinkState: NOT_SUPPORTED);
//                                     "nvswitch": every GPU's links go to NVSwitches.
//   TESSERA_FAKE_NVML_SWITCH_LINKS=a,b,...  active NVSwitch links of GPU 0, 1, ... (default 18).
//   TESSERA_FAKE_NVML_NO_REMOTE_TYPE=1  nvmlDeviceGetNvLinkRemoteDeviceType: NOT_SUPPORTED, as on
//                                     drivers that predate it.
//   TESSERA_FAKE_NVML_ANCESTOR=L      nvmlDeviceGetTopologyCommonAncestor answers level L for every
//                                     pair (default: HOSTBRIDGE for GPUs 2k and 2k+1, else SYSTEM).
//   TESSERA_FAKE_NVML_USED_MIB=M      memory used on every GPU (default 512).
//   TESSERA_FAKE_NVML_FAIL=f[@i],...  NVML function f returns NVML_ERROR_UNKNOWN (for GPU i only,
//                                     if given; for a pair function, if either GPU is i).
// Device functions return NVML_ERROR_UNINITIALIZED unless nvmlInit_v2 succeeded and was not yet
// matched by nvmlShutdown; tessera_fake_nvml_live_inits() reports that balance.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

extern "C" {

typedef int nvmlReturn_t;
typedef int nvmlEnableState_t;
typedef int nvmlIntNvLinkDeviceType_t;
typedef int nvmlGpuTopologyLevel_t;
struct nvmlDevice_st {
  unsigned index;
};
typedef nvmlDevice_st* nvmlDevice_t;

struct nvmlPciInfo_t {
  char busIdLegacy[16];  // NVML_DEVICE_PCI_BUS_ID_BUFFER_V2_SIZE
  unsigned int domain;
  unsigned int bus;
  unsigned int device;
  unsigned int pciDeviceId;
  unsigned int pciSubSystemId;
  char busId[32];  // NVML_DEVICE_PCI_BUS_ID_BUFFER_SIZE
};
static_assert(sizeof(nvmlPciInfo_t) == 68);

struct nvmlMemory_t {
  unsigned long long total;
  unsigned long long free;
  unsigned long long used;
};

}  // extern "C"

namespace {

constexpr nvmlReturn_t kSuccess = 0;
constexpr nvmlReturn_t kUninitialized = 1;
constexpr nvmlReturn_t kInvalidArgument = 2;
constexpr nvmlReturn_t kNotSupported = 3;
constexpr nvmlReturn_t kInsufficientSize = 7;
constexpr nvmlReturn_t kDriverNotLoaded = 9;
constexpr nvmlReturn_t kUnknown = 999;

constexpr int kMaxGpus = 8;
constexpr unsigned kLinksPerGpu = 18;  // H100/H200: NVLink 4, 18 links
constexpr unsigned long long kMiB = 1024ull * 1024ull;
constexpr unsigned long long kH200Memory = 143771ull * kMiB;
constexpr unsigned kPciBus[kMaxGpus] = {0x18, 0x2a, 0x3a, 0x5d, 0x9a, 0xab, 0xba, 0xdb};
constexpr unsigned kH200PciDeviceId = 0x233510de;  // device 0x2335, vendor 0x10de

nvmlDevice_st g_devices[kMaxGpus] = {{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}};
int g_live_inits = 0;

std::string env(const char* name) {
  const char* value = std::getenv(name);
  return value != nullptr ? value : "";
}

int gpu_count() {
  std::string value = env("TESSERA_FAKE_NVML_GPUS");
  if (value.empty()) return 2;
  int n = std::atoi(value.c_str());
  return n < 0 ? 0 : (n > kMaxGpus ? kMaxGpus : n);
}

std::string topology() {
  std::string value = env("TESSERA_FAKE_NVML_TOPOLOGY");
  return value.empty() ? "nvlink" : value;
}

// Whether TESSERA_FAKE_NVML_FAIL asks `function` to fail for GPU a (or b).
bool fails(const char* function, int a = -1, int b = -1) {
  std::string list = env("TESSERA_FAKE_NVML_FAIL");
  size_t start = 0;
  while (start <= list.size()) {
    size_t end = list.find(',', start);
    if (end == std::string::npos) end = list.size();
    std::string item = list.substr(start, end - start);
    start = end + 1;
    size_t at = item.find('@');
    if (item.substr(0, at) != function) continue;
    if (at == std::string::npos) return true;
    int gpu = std::atoi(item.c_str() + at + 1);
    if (gpu == a || gpu == b) return true;
  }
  return false;
}

bool valid(nvmlDevice_t device) {
  return device != nullptr && device >= g_devices && device < g_devices + gpu_count();
}

// Active NVSwitch links of GPU `index` in the "nvswitch" topology.
unsigned switch_links(unsigned index) {
  std::string list = env("TESSERA_FAKE_NVML_SWITCH_LINKS");
  size_t start = 0;
  for (unsigned i = 0; start <= list.size() && !list.empty(); ++i) {
    size_t end = list.find(',', start);
    if (end == std::string::npos) end = list.size();
    if (i == index) {
      return static_cast<unsigned>(std::atoi(list.substr(start, end - start).c_str()));
    }
    start = end + 1;
  }
  return kLinksPerGpu;
}

// The NVLink partner of GPU `index` in the "nvlink" topology, or -1.
int partner(unsigned index) {
  int other = static_cast<int>(index ^ 1u);
  return other < gpu_count() ? other : -1;
}

void fill_pci(nvmlPciInfo_t* pci, unsigned bus, bool lower_case) {
  std::memset(pci, 0, sizeof(*pci));
  pci->domain = 0;
  pci->bus = bus;
  pci->device = 0;
  std::snprintf(pci->busId, sizeof(pci->busId),
                lower_case ? "%08x:%02x:%02x.0" : "%08X:%02X:%02X.0", 0u, bus, 0u);
  std::snprintf(pci->busIdLegacy, sizeof(pci->busIdLegacy),
                lower_case ? "%04x:%02x:%02x.0" : "%04X:%02X:%02X.0", 0u, bus, 0u);
}

nvmlReturn_t copy_string(const std::string& value, char* out, unsigned length) {
  if (out == nullptr) return kInvalidArgument;
  if (value.size() + 1 > length) return kInsufficientSize;
  std::memcpy(out, value.c_str(), value.size() + 1);
  return kSuccess;
}

// Common checks of a per-GPU call: NVML initialized, device valid, failure not requested.
nvmlReturn_t check(const char* function, nvmlDevice_t device) {
  if (g_live_inits <= 0) return kUninitialized;
  if (!valid(device)) return kInvalidArgument;
  if (fails(function, static_cast<int>(device->index))) return kUnknown;
  return kSuccess;
}

}  // namespace

extern "C" {

// Test hook: nvmlInit_v2 successes minus nvmlShutdown calls.
int tessera_fake_nvml_live_inits() { return g_live_inits; }

nvmlReturn_t nvmlInit_v2() {
  if (env("TESSERA_FAKE_NVML_INIT_FAIL") == "1") return kDriverNotLoaded;
  ++g_live_inits;
  return kSuccess;
}

nvmlReturn_t nvmlShutdown() {
  if (g_live_inits <= 0) return kUninitialized;
  --g_live_inits;
  return kSuccess;
}

const char* nvmlErrorString(nvmlReturn_t result) {
  switch (result) {
    case kSuccess:
      return "Success";
    case kUninitialized:
      return "Uninitialized";
    case kInvalidArgument:
      return "Invalid Argument";
    case kNotSupported:
      return "Not Supported";
    case kInsufficientSize:
      return "Insufficient Size";
    case kDriverNotLoaded:
      return "Driver Not Loaded";
    default:
      return "Unknown Error";
  }
}

nvmlReturn_t nvmlSystemGetDriverVersion(char* version, unsigned int length) {
  if (g_live_inits <= 0) return kUninitialized;
  if (fails("nvmlSystemGetDriverVersion")) return kUnknown;
  return copy_string("580.159.04", version, length);
}

nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int* version) {
  if (g_live_inits <= 0) return kUninitialized;
  if (version == nullptr) return kInvalidArgument;
  if (fails("nvmlSystemGetCudaDriverVersion_v2")) return kUnknown;
  *version = 13000;
  return kSuccess;
}

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int* count) {
  if (g_live_inits <= 0) return kUninitialized;
  if (count == nullptr) return kInvalidArgument;
  if (fails("nvmlDeviceGetCount_v2")) return kUnknown;
  *count = static_cast<unsigned>(gpu_count());
  return kSuccess;
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t* device) {
  if (g_live_inits <= 0) return kUninitialized;
  if (device == nullptr || index >= static_cast<unsigned>(gpu_count())) return kInvalidArgument;
  if (fails("nvmlDeviceGetHandleByIndex_v2", static_cast<int>(index))) return kUnknown;
  *device = &g_devices[index];
  return kSuccess;
}

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char* name, unsigned int length) {
  if (nvmlReturn_t rc = check("nvmlDeviceGetName", device); rc != kSuccess) return rc;
  return copy_string("NVIDIA H200", name, length);
}

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char* uuid, unsigned int length) {
  if (nvmlReturn_t rc = check("nvmlDeviceGetUUID", device); rc != kSuccess) return rc;
  char text[64];
  std::snprintf(text, sizeof(text), "GPU-5e1f0c2a-8d43-4b7e-9a16-3c0d7e2b90%02x", device->index);
  return copy_string(text, uuid, length);
}

nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t device, nvmlPciInfo_t* pci) {
  if (nvmlReturn_t rc = check("nvmlDeviceGetPciInfo_v3", device); rc != kSuccess) return rc;
  if (pci == nullptr) return kInvalidArgument;
  fill_pci(pci, kPciBus[device->index], /*lower_case=*/false);
  pci->pciDeviceId = kH200PciDeviceId;
  pci->pciSubSystemId = 0x18b010de;
  return kSuccess;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t* memory) {
  if (nvmlReturn_t rc = check("nvmlDeviceGetMemoryInfo", device); rc != kSuccess) return rc;
  if (memory == nullptr) return kInvalidArgument;
  std::string used = env("TESSERA_FAKE_NVML_USED_MIB");
  memory->total = kH200Memory;
  memory->used = (used.empty() ? 512ull : std::strtoull(used.c_str(), nullptr, 10)) * kMiB;
  memory->free = memory->total - memory->used;
  return kSuccess;
}

nvmlReturn_t nvmlDeviceGetNvLinkState(nvmlDevice_t device, unsigned int link,
                                      nvmlEnableState_t* is_active) {
  if (nvmlReturn_t rc = check("nvmlDeviceGetNvLinkState", device); rc != kSuccess) return rc;
  if (is_active == nullptr || link >= kLinksPerGpu) return kInvalidArgument;
  std::string topo = topology();
  if (topo == "pcie") return kNotSupported;
  if (topo == "nvswitch") {
    *is_active = link < switch_links(device->index) ? 1 : 0;
  } else {
    *is_active = partner(device->index) >= 0 ? 1 : 0;
  }
  return kSuccess;
}

nvmlReturn_t nvmlDeviceGetNvLinkRemotePciInfo_v2(nvmlDevice_t device, unsigned int link,
                                                 nvmlPciInfo_t* pci) {
  if (nvmlReturn_t rc = check("nvmlDeviceGetNvLinkRemotePciInfo_v2", device); rc != kSuccess) {
    return rc;
  }
  if (pci == nullptr || link >= kLinksPerGpu) return kInvalidArgument;
  std::string topo = topology();
  if (topo == "pcie") return kNotSupported;
  if (topo == "nvswitch") {
    // What a VM on an HGX H200 reports (NVIDIA driver 580): the switches are not visible, every
    // switch link's far end reads FFFFFFFF:FF:FF.0.
    std::memset(pci, 0, sizeof(*pci));
    pci->domain = 0xffffffffu;
    pci->bus = 0xff;
    pci->device = 0xff;
    std::snprintf(pci->busId, sizeof(pci->busId), "FFFFFFFF:FF:FF.0");
    std::snprintf(pci->busIdLegacy, sizeof(pci->busIdLegacy), "FFFF:FF:FF.0");
    return kSuccess;
  }
  int other = partner(device->index);
  if (other < 0) return kInvalidArgument;  // the link is down
  // Lower case on purpose: the GPU's own bus id is upper case, matching must not care.
  fill_pci(pci, kPciBus[other], /*lower_case=*/true);
  pci->pciDeviceId = kH200PciDeviceId;
  return kSuccess;
}

nvmlReturn_t nvmlDeviceGetNvLinkRemoteDeviceType(nvmlDevice_t device, unsigned int link,
                                                 nvmlIntNvLinkDeviceType_t* type) {
  if (nvmlReturn_t rc = check("nvmlDeviceGetNvLinkRemoteDeviceType", device); rc != kSuccess) {
    return rc;
  }
  if (type == nullptr || link >= kLinksPerGpu) return kInvalidArgument;
  if (env("TESSERA_FAKE_NVML_NO_REMOTE_TYPE") == "1") return kNotSupported;
  std::string topo = topology();
  if (topo == "pcie") return kNotSupported;
  *type = topo == "nvswitch" ? 0x02 /* SWITCH */ : 0x00 /* GPU */;
  return kSuccess;
}

nvmlReturn_t nvmlDeviceGetTopologyCommonAncestor(nvmlDevice_t a, nvmlDevice_t b,
                                                 nvmlGpuTopologyLevel_t* level) {
  if (g_live_inits <= 0) return kUninitialized;
  if (!valid(a) || !valid(b) || level == nullptr) return kInvalidArgument;
  if (fails("nvmlDeviceGetTopologyCommonAncestor", static_cast<int>(a->index),
            static_cast<int>(b->index))) {
    return kUnknown;
  }
  std::string forced = env("TESSERA_FAKE_NVML_ANCESTOR");
  if (!forced.empty()) {
    *level = std::atoi(forced.c_str());
  } else {
    *level = a->index / 2 == b->index / 2 ? 30 /* HOSTBRIDGE */ : 50 /* SYSTEM */;
  }
  return kSuccess;
}

}  // extern "C"
