// What a node has to offer: CPUs, memory, GPUs and how the GPUs are linked.
//
// Plain value types (the protocol layer converts them to Cap'n Proto) plus discovery:
// `discover_resources` for a one-shot report, `ResourceMonitor` for a daemon that reports the
// same node every heartbeat and keeps NVML loaded to refresh the memory figures cheaply.
//
// Discovery never fails. A machine without an NVIDIA driver has zero GPUs and a `gpu_note`
// saying why; an NVML query that fails for one GPU or one pair of GPUs leaves an empty field or
// a kUnknown link and a line in `gpu_note`, and the rest of the report stands.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "common/node_resources.h"
#include "common/status.h"
#include "daemon/nvml.h"

namespace tessera {

// Describes this machine. `nvml_library` is passed to Nvml::open ("" = $TESSERA_NVML_LIBRARY
// or libnvidia-ml.so.1). Never fails: see the file comment.
NodeResources discover_resources(const std::string& nvml_library = "");

// Host memory figures in bytes, from the text of /proc/meminfo.
struct HostMemory {
  uint64_t total = 0;      // MemTotal
  uint64_t available = 0;  // MemAvailable, or MemFree on kernels before 3.14 that lack it
};
// Fails with kInvalidArgument when MemTotal is missing or a value is malformed.
Expected<HostMemory> parse_meminfo(std::string_view text);

// Discovers the node once and keeps NVML loaded, so that heartbeats can refresh the memory
// figures without loading the library again. Thread-safe.
class ResourceMonitor {
 public:
  // Runs the same discovery as discover_resources.
  explicit ResourceMonitor(const std::string& nvml_library = "");
  ~ResourceMonitor();
  ResourceMonitor(const ResourceMonitor&) = delete;
  ResourceMonitor& operator=(const ResourceMonitor&) = delete;

  // Refreshes the memory figures and returns a copy of the report: what a heartbeat sends.
  // Never fails: a refresh failure is added to the copy's gpu_note as a line
  // "refresh: GPU1: nvmlDeviceGetMemoryInfo: ...", and the figures it concerns keep their
  // previous values.
  NodeResources snapshot();

  // A copy of the latest report, without refreshing.
  NodeResources resources() const;

  // Keeps only the GPUs `list` names (what `tessera start --gpus` or CUDA_VISIBLE_DEVICES gave
  // the daemon), in the order discovered, with their links: comma-separated NVML indices
  // (nvidia-smi's numbers, PCI bus order) or UUIDs ("GPU-..."; a unique prefix will do). ""
  // keeps none. INVALID_ARGUMENT (and nothing changed) for an entry that names no GPU of this
  // machine, names one twice, or is not of that form (MIG devices are not offered); with
  // `stopped_at`, CUDA's own reading of CUDA_VISIBLE_DEVICES instead: the list ends before such
  // an entry ("-1" hides every GPU), and *stopped_at says which and why ("" when none did).
  Status keep_gpus(const std::string& list, std::string* stopped_at = nullptr);

  // Re-reads the host's available memory and each GPU's used memory. Every figure that can be
  // read is updated; the first failure is returned (with the GPU as context, "GPU1: ...") and
  // the figures it concerns keep their previous values. OK with zero GPUs.
  Status refresh();

 private:
  Status refresh_locked();

  mutable std::mutex mu_;            // guards everything below
  std::unique_ptr<Nvml> nvml_;       // null when NVML could not be opened
  std::vector<NvmlDevice> handles_;  // handles_[i] is resources_.gpus[i]
  NodeResources resources_;
};

}  // namespace tessera
