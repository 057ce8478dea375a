// Custom all-reduce over CUDA-IPC peer buffers: the fast path for the small all-reduces of
// tensor-parallel decode (8 KiB .. a few MiB), where NCCL's fixed cost dominates. Ranks are
// separate processes on one node, one per GPU, or several on one GPU (NCCL refuses that; CUDA IPC
// allows it). No NVLink multicast / NVLS: peers' memory is reached by plain loads and stores over
// NVLink (or within the GPU when ranks share one).
//
// Set-up, per rank (one CustomAllReduce per rank and communicator):
//   auto car = CustomAllReduce::create(rank, world, options);   // allocates, zeroes the flags
//   std::string mine = car->handle();                           // opaque bytes, any transport
//   ... every rank gets every rank's handle (the driver relays them over RPC) ...
//   car->open_peers(handles);                                   // handles[r] = rank r's handle
//   car->all_reduce(in, out, count, dtype, stream);             // eager, or inside stream capture
//
// Memory. Each rank cudaMallocs one IPC-shareable allocation and exports one cudaIpcMemHandle_t:
//   [signal area, 8 KiB][data half 0: max_bytes rounded up to 16][data half 1: same]
//   - signal area: uint32 flags start[kMaxBlocks][kMaxRanks] and mid[kMaxBlocks][kMaxRanks],
//     written by the PEERS (start[b][s] = the last epoch in which rank s's block b arrived at the
//     first barrier of a call; mid[...] the same for the second barrier of the two-shot), and a
//     rank-local control word (epoch = calls completed, the sticky error, a block counter) that
//     peers never touch.
//   - data halves: a call copies its input into one half (in-kernel, in the same partition its
//     blocks later read with), peers read it from there. Call k uses half k % 2 (double buffering,
//     see "Why one barrier is enough").
// Plus 32 bytes of mapped pinned host memory per rank where the kernel reports a timeout.
//
// Protocol of one call (kernel `all_reduce_kernel`, grid of G <= kMaxBlocks blocks of 512
// threads; G depends only on count, dtype, world and algorithm, so every rank launches the same
// grid and block b of one rank pairs with block b of every other rank):
//   1. Thread 0 reads the control word for its block: epoch (calls completed by this rank) and
//      the sticky error; on an error the block returns at once. e = epoch + 1 names this call on
//      every rank (all ranks make the same sequence of calls), half = e % 2 picks the data half.
//      The epoch lives in device memory, so graph replays advance it: nothing call-specific is a
//      kernel argument.
//   2. Copy: each thread copies its 16-byte packs of `in` into this rank's data half.
//   3. Barrier (per block): __syncthreads; thread s (s < world, s != rank) stores e into rank s's
//      start[b][rank] with st.release.sys (release at system scope, cumulative over the block's
//      writes ordered before it by the __syncthreads), then polls this rank's start[b][s] with
//      ld.acquire.sys until it is >= e (wrap-safe signed difference); __syncthreads_and then
//      publishes the acquire to the whole block (and whether every wait succeeded).
//   4a. One-shot: each thread reads its packs from all ranks' halves (ld.global.cg: never L1), sums
//      them in fp32 in rank order 0..world-1, rounds once to dtype, stores to `out`.
//   4b. Two-shot: the packs are split into `world` contiguous chunks; rank r reduces chunk r as in
//      4a and writes the result both to `out` and back over chunk r of its own data half (only
//      rank r reads its chunk r: in place is safe); barrier on mid[b][*] as in 3; then each thread
//      copies its packs of every other chunk c from rank c's data half (the reduced values) to
//      `out`. Every block's partition is the same on every rank, so a block only ever waits for
//      its own twins: no grid-wide synchronisation.
//   5. The last block to finish (a fence, then an atomic counter in the control word; a grid of
//      one block needs neither) stores epoch = e for the next call; the next kernel on the stream
//      sees it (stream order).
// Why no "end" barrier (one barrier for the one-shot, two for the two-shot): rank r can start
// call k + 2 only after its call k + 1 passed its first barrier, i.e. after every peer arrived at
// call k + 1, i.e. after every peer's kernel for call k finished (stream order). So when rank r
// overwrites half k % 2 in call k + 2, nobody reads call k's data any more; call k + 1 writes the
// other half. A flag may already hold a later epoch than the one awaited (a fast peer moved on):
// ">= e" accepts it, and that peer's data for epoch e is still in place by the same argument.
//
// all_reduce_add_rms_norm is the one-shot with rows over blocks (block b of every rank copies and
// reduces rows b, b + G, ...) and, after the reduction, the residual add and RMSNorm of each row
// (rms_norm.cuh's add_norm_row); it counts as one call of this protocol.
//
// Results: sum in fp32 in rank order 0..world-1 (acc = x0; acc += x1; ...), rounded once to
// dtype, so every rank gets identical bits, equal to that fp32 sum on the CPU rounded to
// nearest even. Both algorithms give the same bits.
//
// Algorithm choice (kAuto): one-shot when count * dtype_size <= one_shot_max_bytes, else two-shot.
// Default (default_one_shot_max_bytes): 256 KiB for 2 ranks, 128 KiB for 3-4, 64 KiB for 5-8.
// One-shot has one barrier but every rank reads world - 1 full inputs over the links; two-shot
// has two barriers but reads 2 (world - 1) / world of the input. The 2-rank figure follows
// PyTorch's symmetric-memory all-reduce measured on 2 x H200 (one-shot ahead up to 64 KiB,
// two-shot ahead at 512 KiB); custom_all_reduce_test prints both per size to retune it.
//
// Hangs. Every wait is bounded: after `timeout_ms` without the awaited flag (a peer died, hangs,
// or never calls), the waiting block records the peer, the barrier, the block and the epoch in
// the mapped host record, sets the sticky device error and returns; the other blocks see the
// sticky error and return too, so the kernel ends instead of spinning forever (its output is then
// undefined). health() reads the record: DEADLINE_EXCEEDED naming the peer once a kernel timed
// out. Check it after the stream (or an event after the all-reduce) completes, e.g. once per
// step. After a timeout this object is unusable: every later kernel (graph replays included)
// returns at once and all_reduce returns the same DEADLINE_EXCEEDED without launching; destroy it
// and fall back to NCCL or restart the group.
//
// Rules for callers:
//   - Every rank calls all_reduce with the same count, dtype and algorithm, in the same order;
//     calls of one object are ordered (one stream, or streams ordered by events), never
//     concurrent. Ranks are separate processes (CUDA IPC cannot open a handle in the process that
//     made it).
//   - Destroy the objects only after every rank's last all-reduce has completed (a host barrier):
//     a peer still running reads this rank's memory.
//   - A peer that arrives more than `timeout_ms` late counts as dead: keep `timeout_ms` well above
//     the worst skew between ranks' launches (host-side stalls included).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/status.h"
#include "common/tensor.h"

namespace tessera::cuda {

// Limits of the custom all-reduce.
inline constexpr int kCustomAllReduceMaxRanks = 8;

struct CustomAllReduceOptions {
  // Largest all-reduce (count * dtype size, bytes) this object takes; larger ones are
  // INVALID_ARGUMENT (use NCCL). Each rank allocates 2 * max_bytes + 8 KiB of device memory.
  int64_t max_bytes = 8 << 20;
  // How long a block waits for a peer's flag before reporting a timeout (milliseconds, > 0).
  int64_t timeout_ms = 10000;
  // kAuto takes the one-shot up to this many bytes; -1 = default_one_shot_max_bytes(world).
  int64_t one_shot_max_bytes = -1;
};

enum class AllReduceAlgo {
  kAuto,     // by size, see one_shot_max_bytes
  kOneShot,  // every rank reads every peer's whole input
  kTwoShot,  // reduce-scatter + all-gather through the peer buffers
};

// "auto", "one-shot", "two-shot".
const char* algo_name(AllReduceAlgo algo);

// The one-shot / two-shot threshold kAuto uses by default for `world` ranks (bytes).
int64_t default_one_shot_max_bytes(int world);

class CustomAllReduce {
 public:
  // Allocates this rank's buffers on the current device (cudaGetDevice) and zeroes its flags
  // (synchronously). world in [2, 8], rank in [0, world); INVALID_ARGUMENT for those or for
  // options out of range (max_bytes in [16, 1 GiB], timeout_ms in [1, 1 hour]); a CUDA failure
  // is INTERNAL / RESOURCE_EXHAUSTED naming the allocation.
  static Expected<std::unique_ptr<CustomAllReduce>> create(int rank, int world,
                                                           const CustomAllReduceOptions& options);
  ~CustomAllReduce();
  CustomAllReduce(const CustomAllReduce&) = delete;
  CustomAllReduce& operator=(const CustomAllReduce&) = delete;

  // This rank's handle: opaque bytes (a cudaIpcMemHandle_t plus rank, world, max_bytes,
  // one_shot_max_bytes, pid and PCI bus id for validation and error messages) for the caller to
  // pass to every other rank. Only meaningful on this machine, to the same build.
  const std::string& handle() const { return handle_; }

  // Opens every other rank's buffers. handles[r] is rank r's handle() (this rank's own entry is
  // checked and not opened). INVALID_ARGUMENT for a wrong number of handles or a handle that is
  // malformed, from another communicator (world, max_bytes or one_shot_max_bytes differ: every
  // rank must pick the same algorithm), at the wrong index, or made in this process; INTERNAL
  // naming the rank (its GPU and pid) when cudaIpcOpenMemHandle fails (no peer access between the
  // GPUs, or the peer process is gone); FAILED_PRECONDITION if called twice. On failure nothing
  // stays open.
  Status open_peers(const std::vector<std::string>& handles);

  // out[i] = sum over ranks r = 0..world-1 of rank r's in[i], i in [0, count), see the file
  // comment for the arithmetic. Enqueued on `stream`; graph-capturable (one kernel launch, fixed
  // addresses, no allocation or synchronisation).
  //   in:  [count] dtype, device memory of this rank's GPU, aligned to the element size
  //   out: [count] dtype, same; may alias `in` exactly (in place), no partial overlap
  //   dtype: kBF16, kF16 or kF32. Pointers 16-byte aligned take the vector path; others work
  //   (element by element at the edges of each 16-byte pack) but are slower.
  // count == 0 is a no-op (every rank must agree on it). INVALID_ARGUMENT for count < 0,
  // count * dtype size > max_bytes (use NCCL), a null or misaligned pointer; FAILED_PRECONDITION
  // before open_peers; the DEADLINE_EXCEEDED of health() once a call timed out (nothing is
  // launched); INTERNAL for a launch failure.
  Status all_reduce(const void* in, void* out, int64_t count, DType dtype, cudaStream_t stream,
                    AllReduceAlgo algo = AllReduceAlgo::kAuto);

  // all_reduce(in) and then add_rms_norm (kernels/cuda/elementwise.h) in one kernel, bit for bit:
  // sum = the all-reduce of in (left as it was); residual = round(residual + sum);
  // out = RMSNorm(residual) * weight. The one-shot protocol with a row per block (whatever the
  // size), so peers must make the same call (same rows, hidden, dtype) at this point of their
  // sequence; each call counts as one all-reduce call (the epoch).
  //   in, out: [rows, hidden] dtype (out may alias in); residual: [rows, hidden] dtype (apart
  //   from both); weight: [hidden] dtype; all 16-byte aligned, on this rank's GPU
  //   dtype kBF16 or kF16; hidden a multiple of 8, at most 32768; 2, 4 or 8 ranks
  //   (fuses_add_rms_norm)
  // INVALID_ARGUMENT for those, or rows x hidden past max_bytes; otherwise as all_reduce.
  Status all_reduce_add_rms_norm(const void* in, void* residual, const void* weight, int64_t rows,
                                 int64_t hidden, float eps, void* out, DType dtype,
                                 cudaStream_t stream);

  // Whether all_reduce_add_rms_norm takes rows of `hidden` in `dtype` in this group.
  bool fuses_add_rms_norm(int64_t hidden, DType dtype) const;

  // OK, or DEADLINE_EXCEEDED once a kernel of this object timed out: "custom all-reduce rank 1 of
  // 3: rank 2 (GPU 0000:19:00.0, pid 4242) did not arrive at barrier 'start' of call 7 (block 0)
  // within 1000 ms; ...". Reads host memory the kernel writes: cheap, never blocks, safe at any
  // time (it reflects kernels that have finished or are past their timeout).
  Status health() const;

  // The algorithm kAuto picks for an all-reduce of `bytes` bytes (kOneShot or kTwoShot).
  AllReduceAlgo choose(int64_t bytes) const;

  int rank() const { return rank_; }
  int world() const { return world_; }
  int64_t max_bytes() const { return options_.max_bytes; }
  // This rank's device ordinal and PCI bus id ("0000:19:00.0").
  int device() const { return device_; }
  const std::string& pci_bus_id() const { return pci_bus_id_; }

 private:
  CustomAllReduce() = default;
  // The kernels' arguments (custom_all_reduce.cu's Args, at `args`) for a call of `count`
  // elements, `bytes` bytes.
  void fill_args(void* args, const void* in, void* out, int64_t count, int64_t bytes) const;

  int rank_ = 0;
  int world_ = 0;
  CustomAllReduceOptions options_;
  int device_ = -1;
  std::string pci_bus_id_;
  std::string handle_;
  int64_t half_bytes_ = 0;             // one data half, max_bytes rounded up to 16
  void* base_ = nullptr;               // this rank's IPC allocation (signal area + two data halves)
  void* host_error_ = nullptr;         // mapped pinned host record (host view)
  void* host_error_device_ = nullptr;  // the same record as the device sees it
  bool peers_open_ = false;
  std::vector<void*> peer_base_;        // [world] each rank's allocation mapped here (own = base_)
  std::vector<std::string> peer_name_;  // [world] "rank 2 (GPU 0000:19:00.0, pid 4242)"
};

}  // namespace tessera::cuda
