// The collective groups of one rank of a worker group, set up in two steps around the driver's
// rendezvous (driver/worker_group.h):
//   prepare(backend)  before loading: "tcp" listens for peers (its address goes to the driver),
//                     "nccl" makes the unique id (rank 0's goes to every rank), "ipc" allocates
//                     this rank's CUDA-IPC buffers (their handle goes to every rank), and so
//                     does "nccl" given buffer bytes (the custom all-reduce beside NCCL);
//   join(spec)        loading: connects the tensor-parallel group (ranks of this stage) and the
//                     pipeline group (this column's stages), bounded by the spec's
//                     engine.nccl_init_timeout_s.
//                     With nccl and spec.comm.custom_all_reduce_max_bytes, the tensor-parallel
//                     group all-reduces up to that size through the IPC buffers (by_size).
// Group order is the same on every rank (tensor-parallel, then pipeline), so joins never wait
// on each other in a cycle.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "actors/comm/communicator.h"
#include "actors/model/backend.h"
#include "common/load_spec.h"
#include "common/status.h"

namespace tessera::comm {

class TcpEndpoint;

class RankComms {
 public:
  // `backend`: "tcp", "nccl" or "ipc", as prepareComm names it (comm_backend_name); anything
  // else, or nccl and ipc without CUDA, is INVALID_ARGUMENT. `host`: the address peers reach
  // this actor at (tcp). `buffer_bytes`, `tp_rank`, `tp_size`: the IPC buffers and this rank's
  // place in the tensor-parallel group they serve (ipc; nccl when buffer_bytes > 0).
  static Expected<std::unique_ptr<RankComms>> prepare(const std::string& backend,
                                                      const std::string& host,
                                                      uint64_t buffer_bytes, int tp_rank,
                                                      int tp_size);
  ~RankComms();

  CommBackend backend() const { return backend_; }
  // tcp: "host:port" of the endpoint.
  std::string address() const;
  // nccl: the unique id bytes (meaningful from the rank the driver picks as 0).
  const std::string& nccl_id() const { return nccl_id_; }
  // The handle of this rank's IPC buffers, when prepared with them; else empty.
  const std::string& ipc_handle() const { return ipc_handle_; }

  // Joins the groups spec.parallel and spec.comm describe. INVALID_ARGUMENT when the spec's
  // backend is not the prepared one.
  Status join(const LoadSpec& spec);

  // The joined groups, for the model (null where the group has one rank).
  StageComms stage() const { return {tp_.get(), pp_.get()}; }

 private:
  RankComms() = default;
  // The prepared IPC buffers opened on the tensor-parallel group's handles (cuda builds).
  Expected<std::unique_ptr<Communicator>> open_ipc(const CommSpec& comm, const ParallelConfig& p);
  CommBackend backend_ = CommBackend::kNone;
  std::string nccl_id_;
  std::string ipc_handle_;
  std::unique_ptr<TcpEndpoint> endpoint_;
  std::unique_ptr<Communicator> world_, tp_, pp_;
  std::unique_ptr<Communicator> ipc_;  // prepared (buffers allocated), joined at join()
};

// The tp group of `spec`'s rank: the world ranks of its stage, in tp order; the pp group: the
// world ranks of its column, in stage order.
std::vector<int> tp_group(const ParallelConfig& p);
std::vector<int> pp_group(const ParallelConfig& p);

}  // namespace tessera::comm
