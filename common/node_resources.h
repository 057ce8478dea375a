// What a node has to offer, as plain values: CPUs, memory, GPUs and how the GPUs are linked.
// The daemon discovers these (daemon/resources.h); the driver reads them back off the wire to
// show and plan with, so both sides share the types and their formatting here.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace tessera {

struct GpuDevice {
  uint32_t index = 0;      // NVML index: PCI bus order (CUDA's with CUDA_DEVICE_ORDER=PCI_BUS_ID)
  std::string name;        // "NVIDIA H200"
  std::string uuid;        // "GPU-…": use this in CUDA_VISIBLE_DEVICES, it survives reordering
  std::string pci_bus_id;  // "00000000:18:00.0"
  uint64_t memory_total = 0;  // bytes
  // Bytes, including what the driver reserves (nvmlMemory_t v1): total - used is what can still
  // be allocated. nvidia-smi's "memory.used" leaves the reserve out (~600 MiB on an H200).
  uint64_t memory_used = 0;
};

// How two GPUs reach each other, best first (the legend of `nvidia-smi topo -m`).
enum class LinkKind {
  kSelf,     // the same GPU                                            "X"
  kNvlink,   // a bonded set of NVLinks, direct or through NVSwitches   "NV#"
  kPix,      // at most one PCIe bridge                                 "PIX"
  kPxb,      // several PCIe bridges, no host bridge                    "PXB"
  kPhb,      // a PCIe host bridge (typically the CPU)                  "PHB"
  kNode,     // several host bridges within one NUMA node               "NODE"
  kSys,      // the interconnect between NUMA nodes (QPI/UPI)           "SYS"
  kUnknown,  // NVML could not tell                                     "N/A"
};

struct GpuLink {
  LinkKind kind = LinkKind::kUnknown;
  uint32_t nvlinks = 0;  // number of NVLinks when kind == kNvlink, else 0
};

struct NodeResources {
  std::string hostname;
  uint32_t cpus = 0;              // CPUs this process may run on (sched_getaffinity)
  uint64_t memory_total = 0;      // bytes (/proc/meminfo MemTotal)
  uint64_t memory_available = 0;  // bytes (/proc/meminfo MemAvailable)
  std::vector<GpuDevice> gpus;
  // gpus.size()² entries, row-major: links[a * gpus.size() + b] is how gpus[a] reaches gpus[b].
  // Symmetric, with kSelf on the diagonal.
  std::vector<GpuLink> links;
  std::string driver_version;  // "580.159.04"; empty without NVML
  std::string cuda_version;    // the newest CUDA the driver supports, "13.0"; empty without NVML
  // Empty when every NVML query succeeded. Otherwise why there are no GPUs ("no NVIDIA driver:
  // libnvidia-ml.so.1 not found") or which queries failed, one per line.
  std::string gpu_note;
};

// "GPU3": how a GPU is named in matrices and logs.
std::string gpu_label(const GpuDevice& gpu);

// Precondition: a, b < r.gpus.size() and r.links is complete.
const GpuLink& gpu_link(const NodeResources& r, size_t a, size_t b);

// "X", "NV18", "PIX", "PXB", "PHB", "NODE", "SYS" or "N/A".
std::string link_name(const GpuLink& link);

// The link matrix as `nvidia-smi topo -m` prints it, one line per GPU after a header:
//         GPU0  GPU1
//   GPU0  X     NV18
//   GPU1  NV18  X
// Columns are separated by at least two spaces; lines have no trailing blanks and end in '\n'.
// Empty when there are no GPUs.
std::string format_link_matrix(const NodeResources& r);

}  // namespace tessera
