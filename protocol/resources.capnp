@0xf4040e70b00e4a76;
# What a node has: CPUs, memory, GPUs and how the GPUs are linked.
using Cxx = import "/capnp/c++.capnp";
$Cxx.namespace("tessera::proto");

struct GpuInfo {
  index @0 :UInt32;          # NVML index on the node (what CUDA_VISIBLE_DEVICES names)
  name @1 :Text;             # "NVIDIA H200"
  uuid @2 :Text;             # "GPU-5f1c..."
  pciBusId @3 :Text;         # "00000000:18:00.0"
  memoryTotal @4 :UInt64;    # bytes
  memoryUsed @5 :UInt64;     # bytes, at the time of the report
}

# How two GPUs reach each other, as `nvidia-smi topo -m` names it.
enum LinkKind {
  self @0;     # the diagonal
  nvlink @1;   # `nvlinks` NVLink connections between the pair
  pix @2;      # at most one PCIe bridge
  pxb @3;      # several PCIe bridges, no host bridge
  phb @4;      # through a PCIe host bridge (same CPU)
  node @5;     # across host bridges within one NUMA node
  sys @6;      # across NUMA nodes (SMP interconnect)
  unknown @7;
}

struct GpuLink {
  kind @0 :LinkKind;
  nvlinks @1 :UInt32;   # number of NVLink connections when kind == nvlink
}

struct NodeResources {
  hostname @0 :Text;
  cpus @1 :UInt32;             # CPUs this process may run on
  memoryTotal @2 :UInt64;      # bytes (MemTotal)
  memoryAvailable @3 :UInt64;  # bytes (MemAvailable)
  gpus @4 :List(GpuInfo);
  links @5 :List(GpuLink);     # row-major gpus.size() x gpus.size() matrix
  driverVersion @6 :Text;      # NVIDIA driver version, empty without GPUs
  gpuNote @7 :Text;
  cudaVersion @8 :Text;        # the newest CUDA the driver supports ("13.0"), empty without            # why there are no GPUs ("no NVIDIA driver: ..."), else empty
}
