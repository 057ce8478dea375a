#include "daemon/resources.h"

#include <sched.h>
#include <sys/sysinfo.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <climits>
#include <cstdio>
#include <fstream>
#include <optional>
#include <sstream>
#include <utility>

namespace tessera {
namespace {

// ---- Host -------------------------------------------------------------------------------

std::string read_hostname() {
  char buffer[HOST_NAME_MAX + 1] = {};
  if (gethostname(buffer, sizeof(buffer) - 1) != 0) return "";
  return buffer;
}

// CPUs this process may run on; the affinity mask is what a container or taskset allows.
uint32_t count_cpus() {
  // The kernel refuses a mask smaller than its own (EINVAL): grow until it fits.
  for (size_t n = 1024; n <= (size_t{1} << 20); n *= 2) {
    cpu_set_t* set = CPU_ALLOC(n);
    if (set == nullptr) break;
    size_t size = CPU_ALLOC_SIZE(n);
    CPU_ZERO_S(size, set);
    int rc = sched_getaffinity(0, size, set);
    int saved_errno = errno;
    int count = rc == 0 ? CPU_COUNT_S(size, set) : 0;
    CPU_FREE(set);
    if (rc == 0 && count > 0) return static_cast<uint32_t>(count);
    if (rc != 0 && saved_errno != EINVAL) break;
  }
  long online = sysconf(_SC_NPROCESSORS_ONLN);
  return online > 0 ? static_cast<uint32_t>(online) : 1;
}

Expected<HostMemory> read_host_memory() {
  std::ifstream file("/proc/meminfo");
  if (file) {
    std::ostringstream text;
    text << file.rdbuf();
    auto parsed = parse_meminfo(text.str());
    if (parsed.has_value()) return parsed;
  }
  struct sysinfo info = {};
  if (sysinfo(&info) != 0) return internal_error("cannot read /proc/meminfo or sysinfo()");
  HostMemory memory;
  memory.total = static_cast<uint64_t>(info.totalram) * info.mem_unit;
  memory.available = static_cast<uint64_t>(info.freeram) * info.mem_unit;
  return memory;
}

// ---- GPUs -------------------------------------------------------------------------------

void add_note(NodeResources& r, const std::string& line) {
  if (!r.gpu_note.empty()) r.gpu_note += '\n';
  r.gpu_note += line;
}

// A PCI location as one comparable number: domain, bus, device and function, like NCCL's
// busIdToInt64. NVML spells bus ids "%08X:%02X:%02X.0" for a GPU but may use lower case or a
// 4-digit domain elsewhere, so the strings are not compared directly.
std::optional<uint64_t> bus_id_key(const std::string& bus_id) {
  unsigned domain = 0, bus = 0, device = 0, function = 0;
  if (std::sscanf(bus_id.c_str(), "%x:%x:%x.%x", &domain, &bus, &device, &function) != 4) {
    return std::nullopt;
  }
  return (uint64_t{domain} << 24) | (bus << 16) | (device << 8) | function;
}

// The key of a remote NVLink end: its bus id, or its numeric fields if the string is unusable.
std::optional<uint64_t> pci_key(const NvmlPciInfo& pci) {
  if (auto key = bus_id_key(pci.bus_id); key.has_value()) return key;
  if (pci.domain == 0 && pci.bus == 0 && pci.device == 0) return std::nullopt;
  return (uint64_t{pci.domain} << 24) | (pci.bus << 16) | (pci.device << 8);
}

LinkKind kind_of(NvmlTopologyLevel level) {
  switch (level) {
    case NvmlTopologyLevel::kInternal:  // two GPUs on one board: no more than one bridge apart
    case NvmlTopologyLevel::kSingle:
      return LinkKind::kPix;
    case NvmlTopologyLevel::kMultiple:
      return LinkKind::kPxb;
    case NvmlTopologyLevel::kHostBridge:
      return LinkKind::kPhb;
    case NvmlTopologyLevel::kNode:
      return LinkKind::kNode;
    case NvmlTopologyLevel::kSystem:
      return LinkKind::kSys;
  }
  return LinkKind::kUnknown;
}

// What the NVLinks of one GPU lead to.
struct NvlinkScan {
  std::vector<uint32_t> to_gpu;  // to_gpu[j]: active links whose far end is gpus[j]
  uint32_t to_switch = 0;        // active links whose far end is an NVSwitch
  bool failed = false;           // a query failed: links may be missing from the counts
};

NvlinkScan scan_nvlinks(const Nvml& nvml, const std::vector<NvmlDevice>& handles,
                        const std::vector<std::optional<uint64_t>>& keys, size_t self,
                        NodeResources& r) {
  NvlinkScan scan;
  scan.to_gpu.assign(handles.size(), 0);
  const std::string label = gpu_label(r.gpus[self]);
  std::string first_failure;  // of nvmlDeviceGetNvLinkRemotePciInfo_v2: one note per GPU
  uint32_t failed_links = 0;
  for (uint32_t link = 0; link < kNvmlMaxNvlinks; ++link) {
    auto state = nvml.nvlink_state(handles[self], link);
    if (!state.has_value()) {
      // Typically the whole GPU is unreachable: one note, not one per link.
      add_note(r, label + " NVLink " + std::to_string(link) + ": " + state.status().message());
      scan.failed = true;
      break;
    }
    if (*state != NvlinkState::kActive) continue;

    // nvmlDeviceGetNvLinkRemoteDeviceType says what is at the far end when the driver has it
    // (R470+). Without it, a far end that is none of our GPUs is taken for an NVSwitch, as
    // NCCL's topology does with NVLink targets that are neither a GPU nor a CPU.
    auto remote_type = nvml.nvlink_remote_type(handles[self], link);
    if (remote_type.has_value()) {
      if (*remote_type == NvlinkRemote::kSwitch) {
        ++scan.to_switch;
        continue;
      }
      if (*remote_type != NvlinkRemote::kGpu) continue;  // a CPU (IBM NPU) or unknown
    }
    auto remote = nvml.nvlink_remote_pci(handles[self], link);
    if (!remote.has_value()) {
      if (!scan.failed) {
        first_failure =
            label + " NVLink " + std::to_string(link) + ": " + remote.status().message();
      }
      scan.failed = true;
      ++failed_links;
      continue;
    }
    std::optional<uint64_t> key = pci_key(*remote);
    auto peer = std::find(keys.begin(), keys.end(), key);
    if (key.has_value() && peer != keys.end()) {
      size_t j = static_cast<size_t>(peer - keys.begin());
      if (j != self) ++scan.to_gpu[j];
    } else if (!remote_type.has_value()) {
      ++scan.to_switch;
    }
    // else: a GPU that NVML does not show us (another container's); no use to us.
  }
  if (failed_links > 1) {
    first_failure += " (and " + std::to_string(failed_links - 1) + " more links)";
  }
  if (failed_links > 0) add_note(r, first_failure);
  return scan;
}

// Fills r.links for r.gpus (handles[i] is r.gpus[i]).
//
// Two GPUs are NVLinked when one's links end at the other (the count is the larger of the two
// directions' counts, so a failed query on one side loses nothing), or when both have links to
// NVSwitches. With NVSwitches every GPU reaches every other through the switch fabric at the
// rate of the slower of the two attachments: the pair counts min(switch links of a, switch
// links of b). This is how NCCL models it (all NVSwitches collapse into one NVS node that each
// GPU joins with its link count, src/graph/topo.cc ncclTopoAddNvLinks) and matches
// `nvidia-smi topo -m` on an HGX H100/H200, which shows NV18 between every pair (checked on
// two H200s of an HGX host in a VM, driver 580.159.04: each of the 18 links of each GPU reports
// a SWITCH far end at bus id FFFFFFFF:FF:FF.0, and nvidia-smi shows NV18). It is decided
// per pair rather than "all GPUs see switches", so one GPU with its NVLinks down falls back to
// its PCIe path without taking the others with it. Fabric Manager partitions that fence GPUs
// from each other are not visible here.
//
// Pairs without NVLink get their PCIe distance from nvmlDeviceGetTopologyCommonAncestor. A pair
// whose NVLink scan failed and that has no NVLink found, or whose common ancestor cannot be
// read, is kUnknown.
void compute_links(const Nvml& nvml, const std::vector<NvmlDevice>& handles, NodeResources& r) {
  const size_t n = r.gpus.size();
  r.links.assign(n * n, GpuLink{});

  std::vector<std::optional<uint64_t>> keys;
  for (const GpuDevice& gpu : r.gpus) keys.push_back(bus_id_key(gpu.pci_bus_id));

  std::vector<NvlinkScan> scans;
  if (nvml.has_nvlink_api()) {
    for (size_t i = 0; i < n; ++i) scans.push_back(scan_nvlinks(nvml, handles, keys, i, r));
  } else {
    add_note(r, nvml.library() + " has no NVLink functions: links reported as PCIe only");
    scans.assign(n, NvlinkScan{std::vector<uint32_t>(n, 0), 0, false});
  }

  for (size_t a = 0; a < n; ++a) {
    r.links[a * n + a] = GpuLink{LinkKind::kSelf, 0};
    for (size_t b = a + 1; b < n; ++b) {
      GpuLink link;
      uint32_t nvlinks = std::max(scans[a].to_gpu[b], scans[b].to_gpu[a]) +
                         std::min(scans[a].to_switch, scans[b].to_switch);
      if (nvlinks > 0) {
        link = GpuLink{LinkKind::kNvlink, nvlinks};
      } else if (scans[a].failed || scans[b].failed) {
        link = GpuLink{LinkKind::kUnknown, 0};
      } else if (auto level = nvml.common_ancestor(handles[a], handles[b]); level.has_value()) {
        link = GpuLink{kind_of(*level), 0};
      } else {
        add_note(
            r, gpu_label(r.gpus[a]) + "-" + gpu_label(r.gpus[b]) + ": " + level.status().message());
      }
      r.links[a * n + b] = link;
      r.links[b * n + a] = link;
    }
  }
}

// Fills r's GPU fields from NVML; handles receives the handle of each GPU kept.
void discover_gpus(const Nvml& nvml, NodeResources& r, std::vector<NvmlDevice>& handles) {
  if (auto version = nvml.driver_version(); version.has_value()) {
    r.driver_version = *version;
  } else {
    add_note(r, version.status().message());
  }
  // Older drivers lack the call: the version stays empty, which is no GPU problem.
  if (auto cuda = nvml.cuda_version(); cuda.has_value()) r.cuda_version = *cuda;
  auto count = nvml.device_count();
  if (!count.has_value()) {
    add_note(r, "cannot count GPUs: " + count.status().message());
    return;
  }
  if (*count == 0) {
    add_note(r, "NVML reports no GPUs");
    return;
  }
  for (uint32_t i = 0; i < *count; ++i) {
    const std::string label = "GPU" + std::to_string(i);
    auto device = nvml.device(i);
    if (!device.has_value()) {
      add_note(r, label + " skipped: " + device.status().message());
      continue;
    }
    GpuDevice gpu;
    gpu.index = i;
    if (auto name = nvml.name(*device); name.has_value()) {
      gpu.name = *name;
    } else {
      add_note(r, label + ": " + name.status().message());
    }
    if (auto uuid = nvml.uuid(*device); uuid.has_value()) {
      gpu.uuid = *uuid;
    } else {
      add_note(r, label + ": " + uuid.status().message());
    }
    if (auto pci = nvml.pci_info(*device); pci.has_value()) {
      gpu.pci_bus_id = pci->bus_id;
    } else {
      add_note(r, label + ": " + pci.status().message());
    }
    if (auto memory = nvml.memory(*device); memory.has_value()) {
      gpu.memory_total = memory->total;
      gpu.memory_used = memory->used;
    } else {
      add_note(r, label + ": " + memory.status().message());
    }
    r.gpus.push_back(std::move(gpu));
    handles.push_back(*device);
  }
  compute_links(nvml, handles, r);
}

// Host part of the report.
NodeResources discover_host() {
  NodeResources r;
  r.hostname = read_hostname();
  r.cpus = count_cpus();
  if (auto memory = read_host_memory(); memory.has_value()) {
    r.memory_total = memory->total;
    r.memory_available = memory->available;
  }
  return r;
}

// Opens NVML and fills r's GPU part; returns the open library, or null with r.gpu_note set.
std::unique_ptr<Nvml> discover_gpus(const std::string& nvml_library, NodeResources& r,
                                    std::vector<NvmlDevice>& handles) {
  auto nvml = Nvml::open(nvml_library);
  if (!nvml.has_value()) {
    add_note(r, nvml.status().message());
    return nullptr;
  }
  discover_gpus(**nvml, r, handles);
  return std::move(nvml).value();
}

}  // namespace

Expected<HostMemory> parse_meminfo(std::string_view text) {
  std::optional<uint64_t> total, available, free;
  while (!text.empty()) {
    size_t end = text.find('\n');
    std::string_view line = text.substr(0, end);
    text = end == std::string_view::npos ? std::string_view() : text.substr(end + 1);

    size_t colon = line.find(':');
    if (colon == std::string_view::npos) continue;
    std::string_view key = line.substr(0, colon);
    if (key != "MemTotal" && key != "MemAvailable" && key != "MemFree") continue;

    std::string_view rest = line.substr(colon + 1);
    size_t start = rest.find_first_not_of(' ');
    if (start == std::string_view::npos) {
      return invalid_argument("meminfo: no value for " + std::string(key));
    }
    rest = rest.substr(start);
    uint64_t value = 0;
    auto [ptr, ec] = std::from_chars(rest.data(), rest.data() + rest.size(), value);
    if (ec != std::errc()) {
      return invalid_argument("meminfo: bad value in '" + std::string(line) + "'");
    }
    std::string_view unit = rest.substr(static_cast<size_t>(ptr - rest.data()));
    unit = unit.substr(std::min(unit.size(), unit.find_first_not_of(' ')));
    if (unit == "kB") {
      value *= 1024;
    } else if (!unit.empty()) {
      return invalid_argument("meminfo: unknown unit in '" + std::string(line) + "'");
    }
    if (key == "MemTotal") total = value;
    if (key == "MemAvailable") available = value;
    if (key == "MemFree") free = value;
  }
  if (!total.has_value()) return invalid_argument("meminfo: no MemTotal");
  HostMemory memory;
  memory.total = *total;
  memory.available = available.value_or(free.value_or(0));
  return memory;
}

NodeResources discover_resources(const std::string& nvml_library) {
  NodeResources r = discover_host();
  std::vector<NvmlDevice> handles;
  discover_gpus(nvml_library, r, handles);  // the library is unloaded when this returns
  return r;
}

ResourceMonitor::ResourceMonitor(const std::string& nvml_library) : resources_(discover_host()) {
  nvml_ = discover_gpus(nvml_library, resources_, handles_);
}

ResourceMonitor::~ResourceMonitor() = default;

NodeResources ResourceMonitor::snapshot() {
  std::lock_guard<std::mutex> lock(mu_);
  Status status = refresh_locked();
  NodeResources copy = resources_;
  if (!status.is_ok()) add_note(copy, "refresh: " + status.message());
  return copy;
}

NodeResources ResourceMonitor::resources() const {
  std::lock_guard<std::mutex> lock(mu_);
  return resources_;
}

Status ResourceMonitor::refresh() {
  std::lock_guard<std::mutex> lock(mu_);
  return refresh_locked();
}

Status ResourceMonitor::keep_gpus(const std::string& list, std::string* stopped_at) {
  std::lock_guard<std::mutex> lock(mu_);
  const NodeResources& r = resources_;
  auto known = [&r] {
    std::string out;
    for (const GpuDevice& g : r.gpus) {
      out += (out.empty() ? "" : ", ") + std::to_string(g.index) + " " + g.uuid;
    }
    return out.empty() ? std::string("none") : out;
  };
  std::vector<size_t> keep;  // positions in r.gpus
  size_t at = 0;
  while (!list.empty() && at <= list.size()) {
    const size_t comma = std::min(list.find(',', at), list.size());
    std::string entry = list.substr(at, comma - at);
    at = comma + 1;
    entry.erase(0, entry.find_first_not_of(' '));
    entry.erase(entry.find_last_not_of(' ') + 1);
    std::vector<size_t> match;
    const bool number =
        !entry.empty() && entry.size() <= 9 && entry.find_first_not_of("0123456789") == entry.npos;
    const unsigned long index = number ? std::stoul(entry) : 0;
    for (size_t i = 0; i < r.gpus.size(); ++i) {
      if (number ? r.gpus[i].index == index
                 : entry.rfind("GPU-", 0) == 0 && r.gpus[i].uuid.rfind(entry, 0) == 0) {
        match.push_back(i);
      }
    }
    const std::string what = "GPU list '" + list + "': entry '" + entry + "' ";
    std::string wrong;
    if (!number && entry.rfind("GPU-", 0) != 0) {
      wrong = what +
              "is neither an NVML index nor a GPU UUID (MIG devices are not offered); this "
              "machine's GPUs: " +
              known();
    } else if (match.size() != 1) {
      wrong = what + (match.empty() ? "names no GPU" : "names several GPUs") +
              " of this machine (its GPUs: " + known() + ")";
    } else if (std::find(keep.begin(), keep.end(), match[0]) != keep.end()) {
      wrong = what + "names a GPU the list already has";
    }
    if (!wrong.empty() && stopped_at != nullptr) {  // CUDA's rule: the list ends there
      *stopped_at = wrong;
      break;
    }
    if (!wrong.empty()) return invalid_argument(wrong);
    keep.push_back(match[0]);
  }
  std::sort(keep.begin(), keep.end());
  const size_t n = resources_.gpus.size();
  std::vector<GpuDevice> gpus;
  std::vector<NvmlDevice> handles;
  std::vector<GpuLink> links;
  for (size_t a : keep) {
    gpus.push_back(resources_.gpus[a]);
    if (a < handles_.size()) handles.push_back(handles_[a]);
    for (size_t b : keep) {
      if (a * n + b < resources_.links.size()) links.push_back(resources_.links[a * n + b]);
    }
  }
  resources_.gpus = std::move(gpus);
  resources_.links = std::move(links);
  handles_ = std::move(handles);
  return Status::ok();
}

Status ResourceMonitor::refresh_locked() {
  Status first;
  if (auto memory = read_host_memory(); memory.has_value()) {
    resources_.memory_total = memory->total;
    resources_.memory_available = memory->available;
  } else {
    first = memory.status();
  }
  if (nvml_ == nullptr) return first;
  for (size_t i = 0; i < handles_.size(); ++i) {
    GpuDevice& gpu = resources_.gpus[i];
    if (auto memory = nvml_->memory(handles_[i]); memory.has_value()) {
      gpu.memory_used = memory->used;
    } else if (first.is_ok()) {
      first = memory.status().with_context(gpu_label(gpu));
    }
  }
  return first;
}

}  // namespace tessera
