#include "actors/comm/rank_comms.h"

#include "actors/comm/tcp_communicator.h"
#ifdef TESSERA_WITH_CUDA
#include "actors/comm/ipc_communicator.h"
#include "actors/comm/nccl_communicator.h"
#endif

namespace tessera::comm {

std::vector<int> tp_group(const ParallelConfig& p) {
  std::vector<int> out;
  for (int t = 0; t < p.tp_size; ++t) out.push_back(p.pp_rank * p.tp_size + t);
  return out;
}

std::vector<int> pp_group(const ParallelConfig& p) {
  std::vector<int> out;
  for (int s = 0; s < p.pp_size; ++s) out.push_back(s * p.tp_size + p.tp_rank);
  return out;
}

namespace {

std::vector<RankInfo> members(const CommSpec& comm, const std::vector<int>& world_ranks) {
  std::vector<RankInfo> out;
  for (size_t i = 0; i < world_ranks.size(); ++i) {
    RankInfo p = comm.ranks[static_cast<size_t>(world_ranks[i])];
    p.rank = static_cast<int>(i);  // its rank in this group
    out.push_back(std::move(p));
  }
  return out;
}

}  // namespace

RankComms::~RankComms() {
  // Groups before the endpoint they use.
  pp_.reset();
  tp_.reset();
  world_.reset();
  endpoint_.reset();
}

Expected<std::unique_ptr<RankComms>> RankComms::prepare(const std::string& backend,
                                                        const std::string& host,
                                                        uint64_t buffer_bytes, int tp_rank,
                                                        int tp_size) {
  std::unique_ptr<RankComms> c(new RankComms());
  for (CommBackend b : {CommBackend::kTcp, CommBackend::kNccl, CommBackend::kIpc}) {
    if (backend == comm_backend_name(b)) c->backend_ = b;
  }
  if (c->backend_ == CommBackend::kTcp) {
    TESSERA_ASSIGN_OR_RETURN(c->endpoint_, TcpEndpoint::listen(host));
    return c;
  }
#ifdef TESSERA_WITH_CUDA
  if (c->backend_ == CommBackend::kNccl || c->backend_ == CommBackend::kIpc) {
    if (c->backend_ == CommBackend::kNccl) {
      TESSERA_ASSIGN_OR_RETURN(c->nccl_id_, make_nccl_id());
    }
    if (c->backend_ == CommBackend::kIpc || buffer_bytes > 0) {
      TESSERA_ASSIGN_OR_RETURN(auto ipc, IpcCommunicator::create(tp_rank, tp_size, buffer_bytes));
      c->ipc_handle_ = ipc->handle();
      c->ipc_ = std::move(ipc);
    }
    return c;
  }
#else
  (void)buffer_bytes;
  (void)tp_rank;
  (void)tp_size;
#endif
  return invalid_argument("collective backend '" + backend +
                          "' is not one of tcp, nccl (with CUDA), ipc (with CUDA)");
}

#ifdef TESSERA_WITH_CUDA
Expected<std::unique_ptr<Communicator>> RankComms::open_ipc(const CommSpec& comm,
                                                            const ParallelConfig& p) {
  if (!ipc_) {
    return failed_precondition(
        "the custom all-reduce was asked for but this rank prepared no "
        "IPC buffers (prepareComm with bufferBytes > 0)");
  }
  if (static_cast<int>(comm.ipc_handles.size()) != p.world_size()) {
    return invalid_argument("the spec has " + std::to_string(comm.ipc_handles.size()) +
                            " IPC handles for a world of " + std::to_string(p.world_size()));
  }
  const std::vector<int> group = tp_group(p);
  std::vector<std::string> handles;
  for (int r : group) handles.push_back(comm.ipc_handles[static_cast<size_t>(r)]);
  auto* ipc = static_cast<IpcCommunicator*>(ipc_.get());
  TESSERA_RETURN_IF_ERROR(ipc->open(handles, members(comm, group)));
  return std::move(ipc_);
}
#endif

std::string RankComms::address() const { return endpoint_ ? endpoint_->address() : ""; }

Status RankComms::join(const LoadSpec& spec) {
  const ParallelConfig& p = spec.parallel;
  const CommSpec& comm = spec.comm;
  if (comm.backend != backend_) {
    return invalid_argument("the spec's collective backend '" +
                            std::string(comm_backend_name(comm.backend)) +
                            "' is not the prepared '" + comm_backend_name(backend_) + "'");
  }
  if (static_cast<int>(comm.ranks.size()) != p.world_size()) {
    return invalid_argument("the spec names " + std::to_string(comm.ranks.size()) +
                            " ranks for a world of " + std::to_string(p.world_size()));
  }
  const std::chrono::milliseconds timeout = std::chrono::seconds(spec.engine.nccl_init_timeout_s);
  if (backend_ == CommBackend::kTcp) {
    if (p.tp_size > 1) {
      TESSERA_ASSIGN_OR_RETURN(tp_,
                               endpoint_->join("tp-" + std::to_string(p.pp_rank), p.tp_rank,
                                               members(comm, tp_group(p)), comm.secret, timeout));
    }
    if (p.pp_size > 1) {
      TESSERA_ASSIGN_OR_RETURN(pp_,
                               endpoint_->join("pp-" + std::to_string(p.tp_rank), p.pp_rank,
                                               members(comm, pp_group(p)), comm.secret, timeout));
    }
    return Status::ok();
  }
#ifdef TESSERA_WITH_CUDA
  if (backend_ == CommBackend::kNccl) {
    std::vector<int> all;
    for (int r = 0; r < p.world_size(); ++r) all.push_back(r);
    TESSERA_ASSIGN_OR_RETURN(world_,
                             nccl_join(comm.nccl_id, p.rank(), members(comm, all), timeout));
    if (p.tp_size > 1) {
      TESSERA_ASSIGN_OR_RETURN(
          tp_, nccl_split(*world_, p.pp_rank, p.tp_rank, members(comm, tp_group(p)), timeout));
      if (comm.custom_all_reduce_max_bytes > 0) {
        TESSERA_ASSIGN_OR_RETURN(auto ipc, open_ipc(comm, p));
        tp_ = by_size(std::move(ipc), std::move(tp_), comm.custom_all_reduce_max_bytes);
      }
    }
    if (p.pp_size > 1) {
      TESSERA_ASSIGN_OR_RETURN(
          pp_, nccl_split(*world_, p.tp_rank, p.pp_rank, members(comm, pp_group(p)), timeout));
    }
    return Status::ok();
  }
  if (backend_ == CommBackend::kIpc) {
    if (p.pp_size > 1) {
      return invalid_argument(
          "the ipc collectives serve tensor parallelism within one node; pipeline stages need "
          "--collectives nccl");
    }
    TESSERA_ASSIGN_OR_RETURN(tp_, open_ipc(comm, p));
    return Status::ok();
  }
#endif
  return invalid_argument("collective backend '" + std::string(comm_backend_name(backend_)) +
                          "' is not supported here");
}

}  // namespace tessera::comm
