// Custom all-reduce over CUDA-IPC peer buffers. custom_all_reduce.h describes the memory layout,
// the barrier protocol and its memory ordering; this file follows it step by step.
#include "kernels/cuda/custom_all_reduce.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>

#include "kernels/cuda/cuda_util.h"
#include "kernels/cuda/device_math.cuh"
#include "kernels/cuda/rms_norm.cuh"

namespace tessera::cuda {

namespace {

constexpr int kMaxRanks = kCustomAllReduceMaxRanks;
constexpr int kThreads = 512;       // threads per block
constexpr int kMaxBlocks = 64;      // flag slots per rank pair (the grid never exceeds it)
constexpr int kMaxGrid = 48;        // blocks launched for the largest sizes (<= kMaxBlocks)
constexpr int64_t kPackBytes = 16;  // one uint4: 8 bf16/fp16 or 4 fp32 elements
static_assert(kMaxGrid <= kMaxBlocks, "the grid must fit the flag slots");

// ---- memory shared with the peers (layout fixed: peers index it in their own kernels) ----

// Written by the peers (start[b][s] / mid[b][s]: the last epoch in which rank s's block b
// arrived at the first / second barrier); only this rank reads it.
struct Signal {
  uint32_t start[kMaxBlocks][kMaxRanks];
  uint32_t mid[kMaxBlocks][kMaxRanks];
};

// This rank's own state; peers never touch it.
struct alignas(16) Control {
  uint32_t epoch;        // calls completed by this rank (every block of them)
  uint32_t error;        // sticky: != 0 once a wait timed out; kernels then return at once
  uint32_t blocks_done;  // blocks of the running call that finished (reset by the last one)
  uint32_t unused;
};

// The timeout record, in mapped pinned host memory: the kernel fills it, health() reads it.
struct HostError {
  uint32_t set;    // written last (after a system fence): the other fields are valid
  uint32_t peer;   // the rank whose flag did not come
  uint32_t stage;  // 0 = barrier "start", 1 = barrier "mid"
  uint32_t block;
  uint32_t epoch;  // the call (1-based count of this object's calls)
  uint32_t unused[3];
};

constexpr int64_t kControlOffset = sizeof(Signal);
constexpr int64_t kSignalBytes = 8192;  // signal + control, padded; the data halves follow
static_assert(sizeof(Signal) + sizeof(Control) <= kSignalBytes, "signal area too small");

// What every kernel launch gets; fixed per (object, count, dtype, algorithm), so graph replays
// reuse it unchanged.
struct Args {
  char* data[kMaxRanks];   // each rank's data half 0 as mapped here; half 1 = + half_bytes
  Signal* sig[kMaxRanks];  // each rank's signal area as mapped here
  Control* ctl;            // this rank's control word
  HostError* herr;         // device view of the host record
  const void* in;          // [count] T
  void* out;               // [count] T
  int64_t count;           // elements
  int64_t packs;           // ceil(count * sizeof(T) / 16)
  int64_t chunk_packs;     // two-shot: packs per rank's chunk, ceil(packs / world)
  int64_t half_bytes;      // size of one data half
  uint64_t timeout_ns;
  int rank;
  int vec_io;  // in and out are 16-byte aligned
};

// ---- device helpers ----

__device__ __forceinline__ uint32_t ld_acquire_sys(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void st_release_sys(uint32_t* p, uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ uint32_t ld_volatile(const uint32_t* p) {
  return *reinterpret_cast<const volatile uint32_t*>(p);
}

__device__ __forceinline__ uint64_t globaltimer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// The first block whose wait times out records it for the host and sets the sticky error.
__device__ void report_timeout(const Args& a, int peer, int stage, uint32_t epoch) {
  if (atomicCAS(&a.ctl->error, 0u, 1u) != 0u) return;
  volatile HostError* h = a.herr;
  h->peer = static_cast<uint32_t>(peer);
  h->stage = static_cast<uint32_t>(stage);
  h->block = blockIdx.x;
  h->epoch = epoch;
  __threadfence_system();
  h->set = 1u;
  __threadfence_system();
}

// Spins until *flag >= e (wrap-safe). Every 256 polls: gives up if another block already
// failed, and checks the clock (read lazily: a wait that succeeds quickly never reads it).
__device__ bool wait_flag(const Args& a, const uint32_t* flag, uint32_t e, int peer, int stage) {
  uint64_t deadline = 0;
  for (uint32_t spins = 1;; ++spins) {
    if (static_cast<int32_t>(ld_acquire_sys(flag) - e) >= 0) return true;
    if ((spins & 255u) == 0) {
      if (ld_volatile(&a.ctl->error) != 0u) return false;
      const uint64_t now = globaltimer_ns();
      if (deadline == 0) {
        deadline = now + a.timeout_ns;
      } else if (now >= deadline) {
        report_timeout(a, peer, stage, e);
        return false;
      }
    }
  }
}

// Barrier between block blockIdx.x of every rank (stage 0: start flags, 1: mid flags). The
// __syncthreads orders the block's earlier writes before thread s's release store into rank
// s's flag; thread s then acquires rank s's flag here; __syncthreads_and hands that on to the
// whole block. False (on every thread) when a wait failed.
template <int N>
__device__ __forceinline__ bool block_barrier(const Args& a, int stage, uint32_t e) {
  __syncthreads();
  bool ok = true;
  const int s = static_cast<int>(threadIdx.x);
  if (s < N && s != a.rank) {
    uint32_t(*remote)[kMaxRanks] = stage == 0 ? a.sig[s]->start : a.sig[s]->mid;
    st_release_sys(&remote[blockIdx.x][a.rank], e);
    const uint32_t(*mine)[kMaxRanks] = stage == 0 ? a.sig[a.rank]->start : a.sig[a.rank]->mid;
    ok = wait_flag(a, &mine[blockIdx.x][s], e, s, stage);
  }
  return __syncthreads_and(ok ? 1 : 0) != 0;
}

template <typename T>
inline constexpr int kPerPack = static_cast<int>(kPackBytes / sizeof(T));

// Pack p of `in` (elements past count read as zero).
template <typename T>
__device__ __forceinline__ uint4 load_in(const Args& a, int64_t p) {
  const int64_t first = p * kPerPack<T>;
  if (a.vec_io && first + kPerPack<T> <= a.count) return reinterpret_cast<const uint4*>(a.in)[p];
  uint4 v = make_uint4(0u, 0u, 0u, 0u);
  T* e = reinterpret_cast<T*>(&v);
  const T* src = static_cast<const T*>(a.in);
#pragma unroll
  for (int j = 0; j < kPerPack<T>; ++j) {
    if (first + j < a.count) e[j] = src[first + j];
  }
  return v;
}

// Stores pack p to `out` (elements past count are not written).
template <typename T>
__device__ __forceinline__ void store_out(const Args& a, int64_t p, const uint4& v) {
  const int64_t first = p * kPerPack<T>;
  if (a.vec_io && first + kPerPack<T> <= a.count) {
    reinterpret_cast<uint4*>(a.out)[p] = v;
    return;
  }
  const T* e = reinterpret_cast<const T*>(&v);
  T* dst = static_cast<T*>(a.out);
#pragma unroll
  for (int j = 0; j < kPerPack<T>; ++j) {
    if (first + j < a.count) dst[first + j] = e[j];
  }
}

// Pack p of every rank's data half, summed in fp32 in rank order and rounded once to T.
// ld.global.cg: the peers' data never comes from (possibly stale) L1 lines.
template <typename T, int N>
__device__ __forceinline__ uint4 reduce_pack(const Args& a, int64_t half, int64_t p) {
  uint4 v[N];
#pragma unroll
  for (int q = 0; q < N; ++q) v[q] = __ldcg(reinterpret_cast<const uint4*>(a.data[q] + half) + p);
  float acc[kPerPack<T>];
  const T* x0 = reinterpret_cast<const T*>(&v[0]);
#pragma unroll
  for (int j = 0; j < kPerPack<T>; ++j) acc[j] = dev::to_float(x0[j]);
#pragma unroll
  for (int q = 1; q < N; ++q) {
    const T* x = reinterpret_cast<const T*>(&v[q]);
#pragma unroll
    for (int j = 0; j < kPerPack<T>; ++j) acc[j] += dev::to_float(x[j]);
  }
  uint4 r;
  T* o = reinterpret_cast<T*>(&r);
#pragma unroll
  for (int j = 0; j < kPerPack<T>; ++j) o[j] = dev::from_float<T>(acc[j]);
  return r;
}

// The start of a call: thread 0 reads the control word for the block (the read is complete, its
// value in shared memory, before the block can count itself done in finish_call, so the last
// block's epoch update is never seen by a block of the same call). False when a previous call
// timed out (the sticky error); else e = this call's epoch (calls completed + 1).
__device__ __forceinline__ bool begin_call(const Args& a, uint32_t& e) {
  __shared__ uint32_t s_control[2];
  if (threadIdx.x == 0) {
    s_control[0] = ld_volatile(&a.ctl->error);
    s_control[1] = ld_volatile(&a.ctl->epoch);
  }
  __syncthreads();
  e = s_control[1] + 1u;
  return s_control[0] == 0u;
}

// The end of a call: the last block of it advances the epoch (every block has read it by then).
// A grid of one block (the small sizes, where latency counts) needs no counter.
__device__ __forceinline__ void finish_call(const Args& a, uint32_t e) {
  __syncthreads();
  if (threadIdx.x == 0 && gridDim.x == 1) {
    *reinterpret_cast<volatile uint32_t*>(&a.ctl->epoch) = e;
  } else if (threadIdx.x == 0) {
    __threadfence();
    const uint32_t done = atomicAdd(&a.ctl->blocks_done, 1u);
    if (done == gridDim.x - 1) {
      a.ctl->blocks_done = 0u;
      *reinterpret_cast<volatile uint32_t*>(&a.ctl->epoch) = e;
    }
  }
}

// One all-reduce call; see custom_all_reduce.h for the protocol. T: float, __half or
// __nv_bfloat16; N: world size; grid: one-shot ceil(packs / kThreads) or two-shot
// ceil(chunk_packs / kThreads) blocks, capped at kMaxGrid, of kThreads threads. Thread
// (block b, thread t) handles packs tid, tid + stride, ... (tid = b * kThreads + t) of the whole
// tensor (one-shot) or of each chunk (two-shot), in the copy, the reduction and the gather alike:
// so every pack a block reads from a peer was written by the same block index of that peer.
template <typename T, int N, bool kTwoShot>
__global__ void __launch_bounds__(kThreads) all_reduce_kernel(const Args a) {
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  // One-shot: the first input pack is loaded before the control word arrives (its latency
  // overlaps; the data half it goes to depends on the epoch).
  uint4 first = make_uint4(0u, 0u, 0u, 0u);
  if (!kTwoShot && tid < a.packs) first = load_in<T>(a, tid);
  uint32_t e = 0;
  if (!begin_call(a, e)) return;  // sticky: a previous call timed out
  const int64_t half = (e & 1u) ? a.half_bytes : 0;
  uint4* own = reinterpret_cast<uint4*>(a.data[a.rank] + half);

  if constexpr (!kTwoShot) {
    if (tid < a.packs) own[tid] = first;
    for (int64_t p = tid + stride; p < a.packs; p += stride) own[p] = load_in<T>(a, p);
    if (!block_barrier<N>(a, 0, e)) return;
    for (int64_t p = tid; p < a.packs; p += stride)
      store_out<T>(a, p, reduce_pack<T, N>(a, half, p));
  } else {
    const int64_t cp = a.chunk_packs;
#pragma unroll
    for (int c = 0; c < N; ++c) {
      const int64_t hi = (c + 1) * cp < a.packs ? (c + 1) * cp : a.packs;
      for (int64_t p = c * cp + tid; p < hi; p += stride) own[p] = load_in<T>(a, p);
    }
    if (!block_barrier<N>(a, 0, e)) return;
    {
      const int64_t hi = (a.rank + 1) * cp < a.packs ? (a.rank + 1) * cp : a.packs;
      for (int64_t p = a.rank * cp + tid; p < hi; p += stride) {
        const uint4 r = reduce_pack<T, N>(a, half, p);
        own[p] = r;  // only this rank read its own chunk: safe to overwrite with the sum
        store_out<T>(a, p, r);
      }
    }
    if (!block_barrier<N>(a, 1, e)) return;
#pragma unroll
    for (int c = 0; c < N; ++c) {
      if (c == a.rank) continue;
      const uint4* src = reinterpret_cast<const uint4*>(a.data[c] + half);
      const int64_t hi = (c + 1) * cp < a.packs ? (c + 1) * cp : a.packs;
      for (int64_t p = c * cp + tid; p < hi; p += stride) store_out<T>(a, p, __ldcg(src + p));
    }
  }

  finish_call(a, e);
}

// ---- the all-reduce fused with the residual add and RMSNorm (all_reduce_add_rms_norm) ----
//
// One-shot with rows over blocks: block b copies rows b, b + G, ... of `in` into this rank's data
// half, each thread its 16-byte vectors of the row where rms_norm_vec_kernel's shape puts them
// (norm::vec_shape: V vectors of a thread, j = threadIdx.x + k * blockDim.x), meets block b of
// every rank at the start barrier (the grid, G = min(rows, kMaxGrid), is the same on every rank),
// then per row sums the ranks' vectors as reduce_pack does (the all-reduce's bits) and hands them
// to norm::add_norm_row (add_rms_norm's bits). So the result is all_reduce followed by
// add_rms_norm, bit for bit, in one kernel: the sum never goes to memory.
struct NormArgs {
  void* residual;      // [rows, hidden] T, += the sum
  const void* weight;  // [hidden] T
  void* out;           // [rows, hidden] T
  int64_t rows;
  int64_t hidden;
  float eps;
};

template <typename T, int N, int V>
__global__ void __launch_bounds__(kThreads)
    all_reduce_add_rms_norm_kernel(const Args a, const NormArgs n) {
  __shared__ float scratch[32];
  const int64_t nvec = n.hidden / dev::kHalfVec;
  uint4 w[V];
  norm::load_weight_vecs<V>(static_cast<const T*>(n.weight), n.hidden, w);
  uint32_t e = 0;
  if (!begin_call(a, e)) return;  // sticky: a previous call timed out
  const int64_t half = (e & 1u) ? a.half_bytes : 0;
  uint4* own = reinterpret_cast<uint4*>(a.data[a.rank] + half);
  const uint4* in = static_cast<const uint4*>(a.in);
  for (int64_t row = blockIdx.x; row < n.rows; row += gridDim.x) {
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const int64_t j = threadIdx.x + static_cast<int64_t>(k) * blockDim.x;
      if (j < nvec) own[row * nvec + j] = in[row * nvec + j];
    }
  }
  if (!block_barrier<N>(a, 0, e)) return;
  const norm::StoreRow<T> store(static_cast<T*>(n.out));
  for (int64_t row = blockIdx.x; row < n.rows; row += gridDim.x) {
    uint4 hv[V];
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const int64_t j = threadIdx.x + static_cast<int64_t>(k) * blockDim.x;
      hv[k] = j < nvec ? reduce_pack<T, N>(a, half, row * nvec + j) : make_uint4(0u, 0u, 0u, 0u);
    }
    norm::add_norm_row<T, V, true, false>(hv, static_cast<T*>(n.residual), w, row, n.hidden, n.eps,
                                          store, scratch);
  }
  finish_call(a, e);
}

// ---- host side ----

// What handle() carries. Plain bytes: both ends are the same build on the same machine.
struct HandleBlob {
  char magic[8];
  int32_t rank;
  int32_t world;
  int64_t max_bytes;
  int64_t one_shot_max_bytes;  // must match: it decides the algorithm, hence the grid
  int64_t pid;
  uint64_t pid_ns;  // inode of /proc/self/ns/pid (0 if unknown): pids are per namespace
  char pci_bus_id[32];
  cudaIpcMemHandle_t mem;
};
static_assert(std::is_trivially_copyable_v<HandleBlob>);
constexpr char kMagic[8] = {'T', 'S', 'C', 'A', 'R', '0', '1', '\0'};

// This process's pid namespace (two containers may both have a pid 1).
uint64_t pid_namespace() {
  struct stat st;
  if (stat("/proc/self/ns/pid", &st) != 0) return 0;
  return static_cast<uint64_t>(st.st_ino);
}

bool made_in_this_process(const HandleBlob& b) {
  return b.pid == static_cast<int64_t>(getpid()) && b.pid_ns == pid_namespace();
}

std::string peer_label(int rank, const HandleBlob& b) {
  return "rank " + std::to_string(rank) + " (GPU " + std::string(b.pci_bus_id) + ", pid " +
         std::to_string(b.pid) + ")";
}

template <typename T, bool kTwoShot>
void launch_kernel(int world, int blocks, const Args& a, cudaStream_t stream) {
  switch (world) {
#define TESSERA_CAR_CASE(n)                                                \
  case n:                                                                  \
    all_reduce_kernel<T, n, kTwoShot><<<blocks, kThreads, 0, stream>>>(a); \
    break;
    TESSERA_CAR_CASE(2)
    TESSERA_CAR_CASE(3)
    TESSERA_CAR_CASE(4)
    TESSERA_CAR_CASE(5)
    TESSERA_CAR_CASE(6)
    TESSERA_CAR_CASE(7)
    TESSERA_CAR_CASE(8)
#undef TESSERA_CAR_CASE
    default:
      break;  // world is validated by create()
  }
}

template <typename T>
void launch_typed(int world, bool two_shot, int blocks, const Args& a, cudaStream_t stream) {
  if (two_shot) {
    launch_kernel<T, true>(world, blocks, a, stream);
  } else {
    launch_kernel<T, false>(world, blocks, a, stream);
  }
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace

const char* algo_name(AllReduceAlgo algo) {
  switch (algo) {
    case AllReduceAlgo::kAuto:
      return "auto";
    case AllReduceAlgo::kOneShot:
      return "one-shot";
    case AllReduceAlgo::kTwoShot:
      return "two-shot";
  }
  return "?";
}

int64_t default_one_shot_max_bytes(int world) {
  if (world <= 2) return 256 << 10;
  if (world <= 4) return 128 << 10;
  return 64 << 10;
}

Expected<std::unique_ptr<CustomAllReduce>> CustomAllReduce::create(
    int rank, int world, const CustomAllReduceOptions& options) {
  if (world < 2 || world > kMaxRanks) {
    return invalid_argument("custom all-reduce: world size " + std::to_string(world) +
                            " is outside [2, " + std::to_string(kMaxRanks) + "]");
  }
  if (rank < 0 || rank >= world) {
    return invalid_argument("custom all-reduce: rank " + std::to_string(rank) + " is outside [0, " +
                            std::to_string(world) + ")");
  }
  if (options.max_bytes < kPackBytes || options.max_bytes > (int64_t{1} << 30)) {
    return invalid_argument("custom all-reduce: max_bytes " + std::to_string(options.max_bytes) +
                            " is outside [16, 1 GiB]");
  }
  if (options.timeout_ms < 1 || options.timeout_ms > 3600 * 1000) {
    return invalid_argument("custom all-reduce: timeout_ms " + std::to_string(options.timeout_ms) +
                            " is outside [1, 3600000]");
  }
  std::unique_ptr<CustomAllReduce> car(new CustomAllReduce());
  car->rank_ = rank;
  car->world_ = world;
  car->options_ = options;
  if (car->options_.one_shot_max_bytes < 0) {
    car->options_.one_shot_max_bytes = default_one_shot_max_bytes(world);
  }
  car->half_bytes_ = ceil_div(options.max_bytes, kPackBytes) * kPackBytes;
  const std::string who =
      "custom all-reduce rank " + std::to_string(rank) + " of " + std::to_string(world);

  TESSERA_CUDA_RETURN_IF_ERROR(cudaGetDevice(&car->device_), who + ": cudaGetDevice");
  char bus[32] = {};
  TESSERA_CUDA_RETURN_IF_ERROR(cudaDeviceGetPCIBusId(bus, sizeof(bus), car->device_),
                               who + ": cudaDeviceGetPCIBusId");
  car->pci_bus_id_ = bus;

  const int64_t total = kSignalBytes + 2 * car->half_bytes_;
  cudaError_t err = cudaMalloc(&car->base_, static_cast<size_t>(total));
  if (err != cudaSuccess) {
    car->base_ = nullptr;
    cudaGetLastError();
    return cuda_status(err, who + ": allocating " + std::to_string(total) +
                                " bytes of IPC buffers on GPU " + car->pci_bus_id_);
  }
  TESSERA_CUDA_RETURN_IF_ERROR(cudaMemset(car->base_, 0, kSignalBytes),
                               who + ": zeroing the signal area");
  TESSERA_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize(), who + ": zeroing the signal area");

  err = cudaHostAlloc(&car->host_error_, sizeof(HostError), cudaHostAllocMapped);
  if (err != cudaSuccess) {
    car->host_error_ = nullptr;
    cudaGetLastError();
    return cuda_status(err, who + ": allocating the mapped host error record");
  }
  std::memset(car->host_error_, 0, sizeof(HostError));
  TESSERA_CUDA_RETURN_IF_ERROR(
      cudaHostGetDevicePointer(&car->host_error_device_, car->host_error_, 0),
      who + ": cudaHostGetDevicePointer of the error record");

  HandleBlob blob;
  std::memset(&blob, 0, sizeof(blob));
  std::memcpy(blob.magic, kMagic, sizeof(kMagic));
  blob.rank = rank;
  blob.world = world;
  blob.max_bytes = options.max_bytes;
  blob.one_shot_max_bytes = car->options_.one_shot_max_bytes;
  blob.pid = static_cast<int64_t>(getpid());
  blob.pid_ns = pid_namespace();
  std::memcpy(blob.pci_bus_id, bus, sizeof(blob.pci_bus_id) - 1);
  TESSERA_CUDA_RETURN_IF_ERROR(cudaIpcGetMemHandle(&blob.mem, car->base_),
                               who + ": cudaIpcGetMemHandle");
  car->handle_.assign(reinterpret_cast<const char*>(&blob), sizeof(blob));
  car->peer_base_.assign(static_cast<size_t>(world), nullptr);
  car->peer_name_.assign(static_cast<size_t>(world), std::string());
  car->peer_base_[static_cast<size_t>(rank)] = car->base_;
  car->peer_name_[static_cast<size_t>(rank)] = peer_label(rank, blob);
  return Expected<std::unique_ptr<CustomAllReduce>>(std::move(car));
}

CustomAllReduce::~CustomAllReduce() {
  if (peers_open_) {
    for (int r = 0; r < world_; ++r) {
      if (r != rank_ && peer_base_[static_cast<size_t>(r)] != nullptr) {
        cudaIpcCloseMemHandle(peer_base_[static_cast<size_t>(r)]);
      }
    }
  }
  if (base_ != nullptr) cudaFree(base_);
  if (host_error_ != nullptr) cudaFreeHost(host_error_);
}

Status CustomAllReduce::open_peers(const std::vector<std::string>& handles) {
  const std::string who =
      "custom all-reduce rank " + std::to_string(rank_) + " of " + std::to_string(world_);
  if (peers_open_) return failed_precondition(who + ": open_peers was already called");
  if (handles.size() != static_cast<size_t>(world_)) {
    return invalid_argument(who + ": open_peers got " + std::to_string(handles.size()) +
                            " handles, expected one per rank (" + std::to_string(world_) + ")");
  }
  std::vector<HandleBlob> blobs(handles.size());
  for (int r = 0; r < world_; ++r) {
    const std::string& h = handles[static_cast<size_t>(r)];
    HandleBlob& b = blobs[static_cast<size_t>(r)];
    const std::string at = who + ": handle " + std::to_string(r);
    if (h.size() != sizeof(HandleBlob)) {
      return invalid_argument(at + " has " + std::to_string(h.size()) + " bytes, expected " +
                              std::to_string(sizeof(HandleBlob)) +
                              " (not a custom all-reduce handle of this build)");
    }
    std::memcpy(&b, h.data(), sizeof(b));
    b.pci_bus_id[sizeof(b.pci_bus_id) - 1] = '\0';
    if (std::memcmp(b.magic, kMagic, sizeof(kMagic)) != 0) {
      return invalid_argument(at + " is not a custom all-reduce handle (bad magic)");
    }
    if (b.world != world_ || b.max_bytes != options_.max_bytes ||
        b.one_shot_max_bytes != options_.one_shot_max_bytes) {
      return invalid_argument(
          at + " belongs to another communicator or was made with other options (world " +
          std::to_string(b.world) + ", max_bytes " + std::to_string(b.max_bytes) +
          ", one_shot_max_bytes " + std::to_string(b.one_shot_max_bytes) + "; this one: world " +
          std::to_string(world_) + ", max_bytes " + std::to_string(options_.max_bytes) +
          ", one_shot_max_bytes " + std::to_string(options_.one_shot_max_bytes) + ")");
    }
    if (b.rank != r) {
      return invalid_argument(at + " is rank " + std::to_string(b.rank) +
                              "'s: handles must be in rank order");
    }
    if (r == rank_) {
      if (h != handle_) return invalid_argument(at + " (this rank's) is not this object's handle");
    } else if (made_in_this_process(b)) {
      return invalid_argument(at +
                              " was made in this process: ranks must be separate processes "
                              "(CUDA IPC cannot open a handle in the process that made it)");
    }
  }
  for (int r = 0; r < world_; ++r) {
    if (r == rank_) continue;
    const HandleBlob& b = blobs[static_cast<size_t>(r)];
    peer_name_[static_cast<size_t>(r)] = peer_label(r, b);
    void* ptr = nullptr;
    const cudaError_t err = cudaIpcOpenMemHandle(&ptr, b.mem, cudaIpcMemLazyEnablePeerAccess);
    if (err != cudaSuccess) {
      cudaGetLastError();
      for (int q = 0; q < r; ++q) {
        if (q != rank_ && peer_base_[static_cast<size_t>(q)] != nullptr) {
          cudaIpcCloseMemHandle(peer_base_[static_cast<size_t>(q)]);
          peer_base_[static_cast<size_t>(q)] = nullptr;
        }
      }
      return cuda_status(err, who + " (GPU " + pci_bus_id_ + "): opening the buffers of " +
                                  peer_name_[static_cast<size_t>(r)] +
                                  " (cudaIpcOpenMemHandle; needs peer access between the GPUs "
                                  "and the peer process alive)");
    }
    peer_base_[static_cast<size_t>(r)] = ptr;
  }
  peers_open_ = true;
  return Status::ok();
}

Status CustomAllReduce::health() const {
  const volatile HostError* h = static_cast<const volatile HostError*>(host_error_);
  if (h == nullptr || h->set == 0u) return Status::ok();
  std::atomic_thread_fence(std::memory_order_acquire);
  const uint32_t peer = h->peer;
  const std::string peer_text =
      peer < static_cast<uint32_t>(world_) ? peer_name_[peer] : "rank " + std::to_string(peer);
  return deadline_exceeded(
      "custom all-reduce rank " + std::to_string(rank_) + " of " + std::to_string(world_) +
      " (GPU " + pci_bus_id_ + "): " + peer_text + " did not arrive at barrier '" +
      (h->stage == 0u ? "start" : "mid") + "' of call " + std::to_string(h->epoch) + " (block " +
      std::to_string(h->block) + ") within " + std::to_string(options_.timeout_ms) +
      " ms; the communicator is unusable (fall back to NCCL or restart the group)");
}

AllReduceAlgo CustomAllReduce::choose(int64_t bytes) const {
  return bytes <= options_.one_shot_max_bytes ? AllReduceAlgo::kOneShot : AllReduceAlgo::kTwoShot;
}

Status CustomAllReduce::all_reduce(const void* in, void* out, int64_t count, DType dtype,
                                   cudaStream_t stream, AllReduceAlgo algo) {
  // Error text is built only on the error paths: this runs for every all-reduce of a step.
  auto who = [this] {
    return "custom all-reduce rank " + std::to_string(rank_) + " of " + std::to_string(world_);
  };
  if (dtype != DType::kF32 && dtype != DType::kF16 && dtype != DType::kBF16) {
    return invalid_argument(who() + ": unsupported dtype " +
                            std::to_string(static_cast<int>(dtype)));
  }
  const int64_t esize = static_cast<int64_t>(dtype_size(dtype));
  if (count < 0) return invalid_argument(who() + ": count " + std::to_string(count) + " < 0");
  if (count > options_.max_bytes / esize) {
    return invalid_argument(who() + ": " + std::to_string(count) + " " + dtype_name(dtype) +
                            " elements exceed max_bytes " + std::to_string(options_.max_bytes) +
                            " (use NCCL for this size)");
  }
  if (!peers_open_) return failed_precondition(who() + ": all_reduce before open_peers");
  TESSERA_RETURN_IF_ERROR(health());
  if (count == 0) return Status::ok();
  if (in == nullptr || out == nullptr) return invalid_argument(who() + ": null in or out pointer");
  const auto in_addr = reinterpret_cast<uintptr_t>(in);
  const auto out_addr = reinterpret_cast<uintptr_t>(out);
  if (in_addr % static_cast<uintptr_t>(esize) != 0 ||
      out_addr % static_cast<uintptr_t>(esize) != 0) {
    return invalid_argument(who() + ": in/out must be aligned to the " + dtype_name(dtype) +
                            " element size");
  }
  const int64_t bytes = count * esize;
  if (in_addr != out_addr && in_addr < out_addr + static_cast<uintptr_t>(bytes) &&
      out_addr < in_addr + static_cast<uintptr_t>(bytes)) {
    return invalid_argument(who() + ": in and out overlap partially (in place must alias exactly)");
  }

  const bool two_shot =
      (algo == AllReduceAlgo::kAuto ? choose(bytes) : algo) == AllReduceAlgo::kTwoShot;
  Args a;
  fill_args(&a, in, out, count, bytes);
  const int64_t work = two_shot ? a.chunk_packs : a.packs;
  const int blocks = static_cast<int>(std::clamp<int64_t>(ceil_div(work, kThreads), 1, kMaxGrid));

  switch (dtype) {
    case DType::kF32:
      launch_typed<float>(world_, two_shot, blocks, a, stream);
      break;
    case DType::kF16:
      launch_typed<__half>(world_, two_shot, blocks, a, stream);
      break;
    case DType::kBF16:
      launch_typed<__nv_bfloat16>(world_, two_shot, blocks, a, stream);
      break;
    case DType::kI32:
    case DType::kF8E4M3:
      break;  // refused above
  }
  return launch_status(two_shot ? "custom all-reduce (two-shot)" : "custom all-reduce (one-shot)");
}

void CustomAllReduce::fill_args(void* args, const void* in, void* out, int64_t count,
                                int64_t bytes) const {
  Args& a = *static_cast<Args*>(args);
  std::memset(&a, 0, sizeof(a));
  for (int r = 0; r < world_; ++r) {
    char* base = static_cast<char*>(peer_base_[static_cast<size_t>(r)]);
    a.sig[r] = reinterpret_cast<Signal*>(base);
    a.data[r] = base + kSignalBytes;
  }
  a.ctl = reinterpret_cast<Control*>(static_cast<char*>(base_) + kControlOffset);
  a.herr = static_cast<HostError*>(host_error_device_);
  a.in = in;
  a.out = out;
  a.count = count;
  a.packs = ceil_div(bytes, kPackBytes);
  a.chunk_packs = ceil_div(a.packs, world_);
  a.half_bytes = half_bytes_;
  a.timeout_ns = static_cast<uint64_t>(options_.timeout_ms) * 1000000ull;
  a.rank = rank_;
  a.vec_io = (reinterpret_cast<uintptr_t>(in) % kPackBytes == 0 &&
              reinterpret_cast<uintptr_t>(out) % kPackBytes == 0)
                 ? 1
                 : 0;
}

bool CustomAllReduce::fuses_add_rms_norm(int64_t hidden, DType dtype) const {
  return (world_ == 2 || world_ == 4 || world_ == 8) &&
         (dtype == DType::kBF16 || dtype == DType::kF16) && hidden > 0 &&
         hidden % dev::kHalfVec == 0 && norm::vec_shape(hidden).v > 0;
}

Status CustomAllReduce::all_reduce_add_rms_norm(const void* in, void* residual, const void* weight,
                                                int64_t rows, int64_t hidden, float eps, void* out,
                                                DType dtype, cudaStream_t stream) {
  auto who = [this] {
    return "custom all-reduce + add + RMSNorm, rank " + std::to_string(rank_) + " of " +
           std::to_string(world_);
  };
  if (!fuses_add_rms_norm(hidden, dtype) || rows < 0) {
    return invalid_argument(who() + ": rows " + std::to_string(rows) + " x hidden " +
                            std::to_string(hidden) + " of " + dtype_name(dtype) +
                            " (fused for 2, 4 or 8 ranks, bf16 or f16, rows >= 0 and hidden a "
                            "positive multiple of 8 up to 32768: else all_reduce, then "
                            "add_rms_norm)");
  }
  const norm::VecShape shape = norm::vec_shape(hidden);
  const int64_t bytes = rows * hidden * static_cast<int64_t>(dtype_size(dtype));
  if (rows > 0 && bytes > options_.max_bytes) {
    return invalid_argument(who() + ": " + std::to_string(bytes) + " bytes exceed max_bytes " +
                            std::to_string(options_.max_bytes) + " (all-reduce through NCCL)");
  }
  if (!peers_open_) return failed_precondition(who() + ": called before open_peers");
  TESSERA_RETURN_IF_ERROR(health());
  if (rows == 0) return Status::ok();
  for (const void* p :
       {in, static_cast<const void*>(residual), weight, static_cast<const void*>(out)}) {
    if (p == nullptr || reinterpret_cast<uintptr_t>(p) % kPackBytes != 0) {
      return invalid_argument(who() +
                              ": in, residual, weight and out must be 16-byte aligned "
                              "device pointers");
    }
  }
  if (residual == in || residual == out) {
    return invalid_argument(who() + ": residual must not alias in or out");
  }
  Args a;
  fill_args(&a, in, out, rows * hidden, bytes);
  const NormArgs n{residual, weight, out, rows, hidden, eps};
  const int blocks = static_cast<int>(std::min<int64_t>(rows, kMaxGrid));
  const auto launch = [&](auto tag) {
    using T = decltype(tag);
    switch (world_ * 10 + shape.v) {  // fuses_add_rms_norm admits no other case
#define TESSERA_CAR_NORM_CASE(n_, v_)                                                      \
  case n_ * 10 + v_:                                                                       \
    all_reduce_add_rms_norm_kernel<T, n_, v_><<<blocks, shape.threads, 0, stream>>>(a, n); \
    break;
#define TESSERA_CAR_NORM_WORLD(n_) \
  TESSERA_CAR_NORM_CASE(n_, 1)     \
  TESSERA_CAR_NORM_CASE(n_, 2)     \
  TESSERA_CAR_NORM_CASE(n_, 4)     \
  TESSERA_CAR_NORM_CASE(n_, 8)
      TESSERA_CAR_NORM_WORLD(2)
      TESSERA_CAR_NORM_WORLD(4)
      TESSERA_CAR_NORM_WORLD(8)
#undef TESSERA_CAR_NORM_WORLD
#undef TESSERA_CAR_NORM_CASE
      default:
        break;
    }
  };
  if (dtype == DType::kBF16) {
    launch(__nv_bfloat16{});
  } else {
    launch(__half{});
  }
  return launch_status("custom all-reduce + add + RMSNorm");
}

}  // namespace tessera::cuda
