// A group of model-shard actors that reduce, gather and exchange tensors: tensor-parallel ranks
// all-reduce after o_proj and down_proj, pipeline stages send hidden states to the next stage.
//
// Implementations, chosen when a model loads:
//   - TcpCommunicator (actors/comm/tcp_communicator.h): the cpu backend; host memory; a full mesh
//     of TCP connections between the ranks, authenticated with a per-group secret.
//   - NcclCommunicator: the cuda backend across GPUs; device memory, stream-ordered.
//   - IpcCommunicator: the cuda backend's custom all-reduce through CUDA-IPC peer buffers on one
//     node (also two ranks sharing one GPU, which NCCL refuses).
//
// Every rank gets identical bits from a reduction, and the same inputs give the same bits on
// every call, so tensor-parallel output is reproducible. The order of the sum is each
// implementation's own: TcpCommunicator and the IPC custom all-reduce accumulate in fp32 in rank
// order 0, 1, ..., size-1 (custom_all_reduce.h) and round once; NCCL's order follows its
// algorithm (ring or tree, chosen by size and topology), not rank order, and is fixed only for a
// fixed topology, size, NCCL version and settings (NCCL_ALGO, NCCL_PROTO), so its results match
// another implementation's only to rounding. Errors (a peer that died, a timeout) name the peer
// (rank, node, address) and never throw.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "common/rank_info.h"
#include "common/status.h"
#include "common/tensor.h"

namespace tessera::comm {

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;

  // In place: data[i] = sum over ranks of data[i] (count elements of `dtype`), identical bits on
  // every rank. `stream` is the cudaStream_t the device backends order the work on (null on the
  // cpu backend).
  virtual Status all_reduce_sum(void* data, int64_t count, DType dtype, void* stream) = 0;

  // The tensor-parallel layer's all-reduce and the residual add and RMSNorm after it, in one
  // kernel where the group's path for this size has one (the custom all-reduce:
  // custom_all_reduce.h's all_reduce_add_rms_norm): residual = round(residual + the sum of x);
  // out = RMSNorm(residual) * weight, with the bits of all_reduce_sum and then the cuda
  // backend's add_rms_norm; x is left as it was. Callers ask fuses_add_rms_norm first (the same
  // answer on every rank) and otherwise all_reduce_sum and norm; the others refuse it
  // (FAILED_PRECONDITION).
  struct AddRmsNorm {
    void* residual = nullptr;      // [rows, hidden] dtype
    const void* weight = nullptr;  // [hidden] dtype
    void* out = nullptr;           // [rows, hidden] dtype
    int64_t rows = 0;
    int64_t hidden = 0;
    float eps = 0.0f;
  };
  virtual bool fuses_add_rms_norm(int64_t /*rows*/, int64_t /*hidden*/, DType /*dtype*/) const {
    return false;
  }
  virtual Status all_reduce_add_rms_norm(const void* /*x*/, const AddRmsNorm& norm, DType dtype,
                                         void* /*stream*/) {
    return failed_precondition("this group fuses no all-reduce with add + RMSNorm for " +
                               std::to_string(norm.rows) + " x " + std::to_string(norm.hidden) +
                               " " + dtype_name(dtype) +
                               " (ask fuses_add_rms_norm; else all_reduce_sum, then the norm)");
  }

  // out[r * count .. (r + 1) * count) = rank r's `in`, for every rank r (rank order).
  virtual Status all_gather(const void* in, int64_t count, DType dtype, void* out,
                            void* stream) = 0;

  // Personalized exchange (expert parallelism's token dispatch and combine): `in` holds one
  // segment per rank in rank order, send_bytes[r] bytes for rank r; `out` receives one segment
  // from every rank in rank order, recv_bytes[r] bytes from rank r (this rank's own segment is
  // copied). Every rank must pass recv_bytes[r] == rank r's send_bytes[this rank] (exchange the
  // counts first with a fixed-size all_to_all when they vary); a mismatch is an error naming
  // the peer where the implementation can see it (tcp), not silent corruption. Both spans have
  // size() entries; `in` and `out` must not overlap.
  virtual Status all_to_all(const void* in, std::span<const int64_t> send_bytes, void* out,
                            std::span<const int64_t> recv_bytes, void* stream) = 0;

  // Point to point, matched in order per (sender, receiver) pair: a send of `bytes` bytes to
  // `peer` pairs with that peer's recv of `bytes` bytes from this rank.
  virtual Status send(const void* data, int64_t bytes, int peer, void* stream) = 0;
  virtual Status recv(void* data, int64_t bytes, int peer, void* stream) = 0;

  // Returns once every rank has called it.
  virtual Status barrier() = 0;

  // "rank 1 (a-3f2e on node n-77ab, 10.0.0.2:41022)": what errors say about a peer.
  virtual std::string describe(int peer) const = 0;
};

// The checks every all_to_all makes of its arguments: `size` entries in each span, none
// negative, buffers present where bytes move. INVALID_ARGUMENT naming the bad entry.
Status check_all_to_all(int size, const void* in, std::span<const int64_t> send_bytes,
                        const void* out, std::span<const int64_t> recv_bytes);

// "rank 1 (a-3f2e, GPU 0 on node n-77ab, 10.0.0.2:41022)": a peer (its rank in the group) for
// error messages.
std::string describe_peer(const RankInfo& peer);

// One group over two communicators of the same ranks, picked by size: all-reduces and
// all-gathers of at most `small_max_bytes` (the gathered output for all-gather) go through
// `small` (the custom all-reduce over CUDA-IPC buffers: one kernel, no protocol), larger ones
// and everything else (send, recv, barrier) through `large` (NCCL). The choice depends only on
// the size, the same on every rank, so the ranks never disagree on the path; every size has one
// path, so a given shape gives the same bits each step. Both must have the same rank and size.
std::unique_ptr<Communicator> by_size(std::unique_ptr<Communicator> small,
                                      std::unique_ptr<Communicator> large,
                                      uint64_t small_max_bytes);

}  // namespace tessera::comm
