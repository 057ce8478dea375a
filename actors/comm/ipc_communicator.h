// Tensor-parallel collectives through CUDA-IPC peer buffers on one node (built with CUDA only):
// kernels/cuda/custom_all_reduce.h's one-shot / two-shot all-reduce, which also works for ranks
// that share one GPU (NCCL refuses that). All-gather is an all-reduce over a buffer where every
// rank fills its own slot and zeroes the rest (x + 0 is exact). Tensors larger than the IPC
// buffers go through in chunks. Point-to-point transfers are not offered: pipeline stages use
// NCCL.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "actors/comm/communicator.h"
#include "common/status.h"

namespace tessera::cuda {
class CustomAllReduce;
}

namespace tessera::comm {

class IpcCommunicator final : public Communicator {
 public:
  // Allocates this rank's IPC buffers (2 x buffer_bytes + a signal area) on the current GPU.
  static Expected<std::unique_ptr<IpcCommunicator>> create(int rank, int world,
                                                           uint64_t buffer_bytes);
  ~IpcCommunicator() override;

  // The bytes peers open this rank's buffers with.
  const std::string& handle() const;
  // Opens every rank's buffers (handles by rank; this rank's is skipped).
  Status open(const std::vector<std::string>& handles, std::vector<RankInfo> peers);

  int rank() const override { return rank_; }
  int size() const override { return world_; }
  Status all_reduce_sum(void* data, int64_t count, DType dtype, void* stream) override;
  // One call of the custom all-reduce's fused kernel: sizes it all-reduces in one one-shot call.
  bool fuses_add_rms_norm(int64_t rows, int64_t hidden, DType dtype) const override;
  Status all_reduce_add_rms_norm(const void* x, const AddRmsNorm& norm, DType dtype,
                                 void* stream) override;
  Status all_gather(const void* in, int64_t count, DType dtype, void* out, void* stream) override;
  // Not offered yet (like send / recv): FAILED_PRECONDITION saying what to use instead.
  Status all_to_all(const void* in, std::span<const int64_t> send_bytes, void* out,
                    std::span<const int64_t> recv_bytes, void* stream) override;
  Status send(const void* data, int64_t bytes, int peer, void* stream) override;
  Status recv(void* data, int64_t bytes, int peer, void* stream) override;
  Status barrier() override;
  std::string describe(int peer) const override;

 private:
  IpcCommunicator() = default;
  int rank_ = 0;
  int world_ = 0;
  std::unique_ptr<cuda::CustomAllReduce> impl_;
  std::vector<RankInfo> peers_;
  void* flag_ = nullptr;  // one float for barrier()
};

}  // namespace tessera::comm
