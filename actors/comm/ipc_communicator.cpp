#include "actors/comm/ipc_communicator.h"

#include <cuda_runtime.h>

#include <algorithm>

#include "kernels/cuda/custom_all_reduce.h"

namespace tessera::comm {

Expected<std::unique_ptr<IpcCommunicator>> IpcCommunicator::create(int rank, int world,
                                                                   uint64_t buffer_bytes) {
  cuda::CustomAllReduceOptions o;
  o.max_bytes = static_cast<int64_t>(buffer_bytes);
  std::unique_ptr<IpcCommunicator> c(new IpcCommunicator());
  c->rank_ = rank;
  c->world_ = world;
  TESSERA_ASSIGN_OR_RETURN(c->impl_, cuda::CustomAllReduce::create(rank, world, o));
  if (cudaMalloc(&c->flag_, sizeof(float)) != cudaSuccess) {
    return resource_exhausted("cannot allocate the ipc barrier flag");
  }
  return c;
}

IpcCommunicator::~IpcCommunicator() {
  if (flag_ != nullptr) cudaFree(flag_);
}

const std::string& IpcCommunicator::handle() const { return impl_->handle(); }

Status IpcCommunicator::open(const std::vector<std::string>& handles, std::vector<RankInfo> peers) {
  peers_ = std::move(peers);
  return impl_->open_peers(handles);
}

Status IpcCommunicator::all_reduce_sum(void* data, int64_t count, DType dtype, void* stream) {
  const int64_t es = static_cast<int64_t>(dtype_size(dtype));
  const int64_t chunk = std::max<int64_t>(1, impl_->max_bytes() / es);
  auto* p = static_cast<char*>(data);
  for (int64_t at = 0; at < count; at += chunk) {
    const int64_t n = std::min(chunk, count - at);
    Status st = impl_->all_reduce(p + at * es, p + at * es, n, dtype,
                                  static_cast<cudaStream_t>(stream));
    if (!st) return st.with_context("all-reduce over the ipc buffers");
  }
  return Status::ok();
}

bool IpcCommunicator::fuses_add_rms_norm(int64_t rows, int64_t hidden, DType dtype) const {
  // Where the all-reduce alone takes the one-shot: the fused kernel is one (past that size every
  // rank reads every peer's whole input, and the two-shot reads less at 4 and 8 ranks).
  const int64_t bytes = rows * hidden * static_cast<int64_t>(dtype_size(dtype));
  return rows >= 0 && bytes <= impl_->max_bytes() &&
         impl_->choose(bytes) == cuda::AllReduceAlgo::kOneShot &&
         impl_->fuses_add_rms_norm(hidden, dtype);
}

Status IpcCommunicator::all_reduce_add_rms_norm(const void* x, const AddRmsNorm& norm, DType dtype,
                                                void* stream) {
  if (!fuses_add_rms_norm(norm.rows, norm.hidden, dtype)) {
    return Communicator::all_reduce_add_rms_norm(x, norm, dtype, stream);
  }
  Status st =
      impl_->all_reduce_add_rms_norm(x, norm.residual, norm.weight, norm.rows, norm.hidden,
                                     norm.eps, norm.out, dtype, static_cast<cudaStream_t>(stream));
  if (!st) return st.with_context("all-reduce + add + RMSNorm over the ipc buffers");
  return Status::ok();
}

Status IpcCommunicator::all_gather(const void* in, int64_t count, DType dtype, void* out,
                                   void* stream) {
  const size_t es = dtype_size(dtype);
  auto* o = static_cast<char*>(out);
  auto st = static_cast<cudaStream_t>(stream);
  const size_t slot = static_cast<size_t>(count) * es;
  char* mine = o + static_cast<size_t>(rank_) * slot;
  if (cudaMemsetAsync(o, 0, static_cast<size_t>(rank_) * slot, st) != cudaSuccess ||
      cudaMemsetAsync(mine + slot, 0, static_cast<size_t>(world_ - rank_ - 1) * slot, st) !=
          cudaSuccess) {
    return internal_error("all-gather: clearing the other ranks' slots failed");
  }
  if (in != mine &&
      cudaMemcpyAsync(mine, in, slot, cudaMemcpyDeviceToDevice, st) != cudaSuccess) {
    return internal_error("all-gather: copying this rank's slot failed");
  }
  return all_reduce_sum(out, count * world_, dtype, stream);
}

Status IpcCommunicator::send(const void*, int64_t, int, void*) {
  return failed_precondition(
      "the ipc collectives carry no point-to-point transfers: pipeline stages need --collectives "
      "nccl");
}

Status IpcCommunicator::all_to_all(const void*, std::span<const int64_t>, void*,
                                   std::span<const int64_t>, void*) {
  return failed_precondition(
      "the ipc collectives carry no all-to-all: expert parallelism needs --collectives nccl "
      "(ranks on separate GPUs)");
}

Status IpcCommunicator::recv(void* data, int64_t bytes, int peer, void* stream) {
  return send(data, bytes, peer, stream);
}

Status IpcCommunicator::barrier() {
  TESSERA_RETURN_IF_ERROR(all_reduce_sum(flag_, 1, DType::kF32, nullptr));
  return cudaStreamSynchronize(nullptr) == cudaSuccess
             ? Status::ok()
             : internal_error("barrier: the ipc all-reduce failed");
}

std::string IpcCommunicator::describe(int peer) const {
  if (peer >= 0 && peer < static_cast<int>(peers_.size())) {
    return describe_peer(peers_[static_cast<size_t>(peer)]);
  }
  return "rank " + std::to_string(peer);
}

}  // namespace tessera::comm
