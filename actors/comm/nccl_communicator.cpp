#include "actors/comm/nccl_communicator.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <cstring>
#include <thread>

namespace tessera::comm {

namespace {

ncclDataType_t nccl_type(DType d) {
  switch (d) {
    case DType::kF32:
      return ncclFloat32;
    case DType::kF16:
      return ncclFloat16;
    case DType::kBF16:
      return ncclBfloat16;
    case DType::kI32:
      return ncclInt32;
    case DType::kF8E4M3:
      return ncclFloat8e4m3;
  }
  return ncclFloat32;
}

std::string nccl_error(ncclResult_t r, ncclComm_t comm) {
  std::string out = ncclGetErrorString(r);
  if (comm != nullptr) {
    const char* last = ncclGetLastError(comm);
    if (last != nullptr && *last != '\0') out += " (" + std::string(last) + ")";
  }
  return out;
}

// Waits for a non-blocking communicator to finish what it started, up to `deadline`.
ncclResult_t wait_ready(ncclComm_t comm, std::chrono::steady_clock::time_point deadline) {
  ncclResult_t state = ncclInProgress;
  while (true) {
    ncclResult_t r = ncclCommGetAsyncError(comm, &state);
    if (r != ncclSuccess) return r;
    if (state != ncclInProgress) return state;
    if (std::chrono::steady_clock::now() > deadline) return ncclInProgress;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

std::string list_peers(const std::vector<RankInfo>& peers) {
  std::string out;
  for (const auto& p : peers) out += (out.empty() ? "" : "; ") + describe_peer(p);
  return out;
}

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(ncclComm_t comm, int rank, std::vector<RankInfo> peers)
      : comm_(comm), rank_(rank), peers_(std::move(peers)) {}
  ~NcclCommunicator() override {
    if (comm_ != nullptr) {
      // A communicator whose peers died cannot be destroyed collectively: abort it.
      ncclCommAbort(comm_);
    }
  }

  ncclComm_t comm() const { return comm_; }
  const std::vector<RankInfo>& peers() const { return peers_; }

  int rank() const override { return rank_; }
  int size() const override { return static_cast<int>(peers_.size()); }

  Status all_reduce_sum(void* data, int64_t count, DType dtype, void* stream) override {
    return check(ncclAllReduce(data, data, static_cast<size_t>(count), nccl_type(dtype), ncclSum,
                               comm_, static_cast<cudaStream_t>(stream)),
                 "all-reduce");
  }
  Status all_gather(const void* in, int64_t count, DType dtype, void* out, void* stream) override {
    return check(ncclAllGather(in, out, static_cast<size_t>(count), nccl_type(dtype), comm_,
                               static_cast<cudaStream_t>(stream)),
                 "all-gather");
  }
  // Grouped sends and receives (NCCL's all-to-all recipe); this rank's segment by a copy.
  Status all_to_all(const void* in, std::span<const int64_t> send_bytes, void* out,
                    std::span<const int64_t> recv_bytes, void* stream) override {
    TESSERA_RETURN_IF_ERROR(check_all_to_all(size(), in, send_bytes, out, recv_bytes));
    auto st = static_cast<cudaStream_t>(stream);
    const char* src = static_cast<const char*>(in);
    char* dst = static_cast<char*>(out);
    ncclResult_t r = ncclGroupStart();
    for (int p = 0; p < size() && r == ncclSuccess; ++p) {
      if (p == rank_) {
        if (send_bytes[p] != recv_bytes[p]) {
          ncclGroupEnd();
          return invalid_argument("all_to_all: this rank sends itself " +
                                  std::to_string(send_bytes[p]) + " bytes but expects " +
                                  std::to_string(recv_bytes[p]));
        }
        if (send_bytes[p] > 0 && cudaMemcpyAsync(dst, src, static_cast<size_t>(send_bytes[p]),
                                                 cudaMemcpyDeviceToDevice, st) != cudaSuccess) {
          ncclGroupEnd();
          return internal_error("all_to_all: copying this rank's own segment failed");
        }
      } else {
        if (send_bytes[p] > 0) {
          r = ncclSend(src, static_cast<size_t>(send_bytes[p]), ncclUint8, p, comm_, st);
        }
        if (r == ncclSuccess && recv_bytes[p] > 0) {
          r = ncclRecv(dst, static_cast<size_t>(recv_bytes[p]), ncclUint8, p, comm_, st);
        }
      }
      src += send_bytes[p];
      dst += recv_bytes[p];
    }
    const ncclResult_t end = ncclGroupEnd();
    return check(r != ncclSuccess ? r : end, "all-to-all");
  }
  Status send(const void* data, int64_t bytes, int peer, void* stream) override {
    return check(ncclSend(data, static_cast<size_t>(bytes), ncclUint8, peer, comm_,
                          static_cast<cudaStream_t>(stream)),
                 "send to " + describe(peer));
  }
  Status recv(void* data, int64_t bytes, int peer, void* stream) override {
    return check(ncclRecv(data, static_cast<size_t>(bytes), ncclUint8, peer, comm_,
                          static_cast<cudaStream_t>(stream)),
                 "receive from " + describe(peer));
  }
  Status barrier() override {
    void* flag = nullptr;
    if (cudaMalloc(&flag, sizeof(float)) != cudaSuccess) {
      return internal_error("barrier: cannot allocate a flag");
    }
    Status st =
        check(ncclAllReduce(flag, flag, 1, ncclFloat32, ncclSum, comm_, nullptr), "barrier");
    cudaStreamSynchronize(nullptr);
    cudaFree(flag);
    return st;
  }
  std::string describe(int peer) const override {
    if (peer < 0 || peer >= size()) return "rank " + std::to_string(peer);
    return describe_peer(peers_[static_cast<size_t>(peer)]);
  }

 private:
  // Non-blocking communicators may answer "in progress" while they enqueue: wait for it (a
  // peer that died surfaces here as an error, bounded by NCCL's own timeouts).
  Status check(ncclResult_t r, const std::string& what) {
    if (r == ncclInProgress) {
      r = wait_ready(comm_, std::chrono::steady_clock::now() + std::chrono::minutes(10));
    }
    if (r == ncclSuccess) return Status::ok();
    return unavailable("NCCL " + what + " failed on " + describe(rank_) + ": " +
                       nccl_error(r, comm_));
  }

  ncclComm_t comm_;
  int rank_;
  std::vector<RankInfo> peers_;
};

}  // namespace

Expected<std::string> make_nccl_id() {
  ncclUniqueId id;
  ncclResult_t r = ncclGetUniqueId(&id);
  if (r != ncclSuccess) {
    return unavailable(std::string("cannot make an NCCL unique id: ") + ncclGetErrorString(r));
  }
  return std::string(id.internal, sizeof(id.internal));
}

Expected<std::unique_ptr<Communicator>> nccl_join(const std::string& id_bytes, int rank,
                                                  std::vector<RankInfo> peers,
                                                  std::chrono::milliseconds timeout) {
  ncclUniqueId id;
  if (id_bytes.size() != sizeof(id.internal)) {
    return invalid_argument("an NCCL unique id has " + std::to_string(sizeof(id.internal)) +
                            " bytes, got " + std::to_string(id_bytes.size()));
  }
  std::memcpy(id.internal, id_bytes.data(), sizeof(id.internal));
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;  // return at once; we poll with a deadline
  ncclComm_t comm = nullptr;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  ncclResult_t r = ncclCommInitRankConfig(&comm, static_cast<int>(peers.size()), id, rank, &config);
  if (r == ncclSuccess || r == ncclInProgress) r = wait_ready(comm, deadline);
  if (r == ncclInProgress) {
    ncclCommAbort(comm);
    return deadline_exceeded(
        "NCCL start-up of " + describe_peer(peers[static_cast<size_t>(rank)]) +
        " did not complete within " + std::to_string(timeout.count() / 1000) +
        " s: a rank did not join (--nccl-init-timeout). The ranks: " + list_peers(peers));
  }
  if (r != ncclSuccess) {
    std::string why = nccl_error(r, comm);
    if (comm != nullptr) ncclCommAbort(comm);
    return unavailable("NCCL start-up of " + describe_peer(peers[static_cast<size_t>(rank)]) +
                       " failed: " + why + ". The ranks: " + list_peers(peers));
  }
  return std::unique_ptr<Communicator>(new NcclCommunicator(comm, rank, std::move(peers)));
}

Expected<std::unique_ptr<Communicator>> nccl_split(Communicator& world, int color, int key,
                                                   std::vector<RankInfo> members,
                                                   std::chrono::milliseconds timeout) {
  auto* nccl = dynamic_cast<NcclCommunicator*>(&world);
  if (nccl == nullptr) return internal_error("nccl_split needs an NCCL communicator");
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclComm_t comm = nullptr;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  ncclResult_t r = ncclCommSplit(nccl->comm(), color, key, &comm, &config);
  if (r == ncclSuccess || r == ncclInProgress) r = wait_ready(nccl->comm(), deadline);
  if (r == ncclSuccess && comm != nullptr) r = wait_ready(comm, deadline);
  if (r != ncclSuccess || comm == nullptr) {
    if (comm != nullptr) ncclCommAbort(comm);
    return unavailable("NCCL could not form a group of " + std::to_string(members.size()) +
                       " ranks: " + (r == ncclInProgress ? "timed out" : nccl_error(r, nullptr)) +
                       ". The ranks: " + list_peers(members));
  }
  int rank = 0;
  ncclCommUserRank(comm, &rank);
  return std::unique_ptr<Communicator>(new NcclCommunicator(comm, rank, std::move(members)));
}

}  // namespace tessera::comm
