#include "actors/comm/comm_check.h"

#include <algorithm>
#include <chrono>
#include <string>
#include <vector>

#ifdef TESSERA_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace tessera::comm {

namespace {

// The device side: a buffer and a stream, released on every path.
class Buffer {
 public:
  Buffer(size_t count, bool device) : count_(count), device_(device) {
    if (!device) host_.resize(count);
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer() {
#ifdef TESSERA_WITH_CUDA
    if (data_ != nullptr) cudaFree(data_);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
#endif
  }

  Status init() {
    if (!device_) return Status::ok();
#ifdef TESSERA_WITH_CUDA
    if (cudaError_t e = cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking);
        e != cudaSuccess) {
      return internal_error(std::string("cudaStreamCreate: ") + cudaGetErrorString(e));
    }
    if (cudaError_t e = cudaMalloc(&data_, count_ * sizeof(float)); e != cudaSuccess) {
      return resource_exhausted("cannot allocate " + std::to_string(count_ * sizeof(float)) +
                                " bytes for the check: " + cudaGetErrorString(e));
    }
    return Status::ok();
#else
    return failed_precondition("this actor has no CUDA backend: device buffers are not possible");
#endif
  }

  void* data() { return device_ ? data_ : host_.data(); }
  void* stream() { return stream_; }

  Status put(const std::vector<float>& values) {
    if (!device_) {
      host_ = values;
      return Status::ok();
    }
#ifdef TESSERA_WITH_CUDA
    if (cudaError_t e =
            cudaMemcpy(data_, values.data(), count_ * sizeof(float), cudaMemcpyHostToDevice);
        e != cudaSuccess) {
      return internal_error(std::string("cudaMemcpy: ") + cudaGetErrorString(e));
    }
#endif
    return Status::ok();
  }

  Expected<std::vector<float>> get() {
    if (!device_) return host_;
    std::vector<float> out(count_);
#ifdef TESSERA_WITH_CUDA
    if (cudaError_t e = cudaStreamSynchronize(static_cast<cudaStream_t>(stream_));
        e != cudaSuccess) {
      return internal_error(std::string("the all-reduce failed on the GPU: ") +
                            cudaGetErrorString(e));
    }
    if (cudaError_t e =
            cudaMemcpy(out.data(), data_, count_ * sizeof(float), cudaMemcpyDeviceToHost);
        e != cudaSuccess) {
      return internal_error(std::string("cudaMemcpy: ") + cudaGetErrorString(e));
    }
#endif
    return out;
  }

  Status sync() {
#ifdef TESSERA_WITH_CUDA
    if (device_) {
      if (cudaError_t e = cudaStreamSynchronize(static_cast<cudaStream_t>(stream_));
          e != cudaSuccess) {
        return internal_error(std::string("the all-reduce failed on the GPU: ") +
                              cudaGetErrorString(e));
      }
    }
#endif
    return Status::ok();
  }

 private:
  size_t count_;
  bool device_;
  std::vector<float> host_;
  void* data_ = nullptr;
#ifdef TESSERA_WITH_CUDA
  cudaStream_t stream_ = nullptr;
#else
  void* stream_ = nullptr;
#endif
};

float contribution(int rank, size_t i) { return static_cast<float>(rank + 1 + i % 7); }

}  // namespace

Expected<CommCheckResult> run_comm_check(Communicator& group, uint64_t bytes, int iterations,
                                         bool device) {
  const size_t count = std::max<size_t>(1, bytes / sizeof(float));
  const int n = group.size();
  Buffer buffer(count, device);
  TESSERA_RETURN_IF_ERROR(buffer.init());
  std::vector<float> mine(count);
  for (size_t i = 0; i < count; ++i) mine[i] = contribution(group.rank(), i);
  std::vector<double> times;
  for (int it = 0; it <= iterations; ++it) {
    TESSERA_RETURN_IF_ERROR(buffer.put(mine));
    TESSERA_RETURN_IF_ERROR(group.barrier());
    auto t0 = std::chrono::steady_clock::now();
    TESSERA_RETURN_IF_ERROR(group.all_reduce_sum(buffer.data(), static_cast<int64_t>(count),
                                                 DType::kF32, buffer.stream()));
    TESSERA_RETURN_IF_ERROR(buffer.sync());
    auto us =
        std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
    if (it > 0) times.push_back(us);  // the first one warms the connections up
    TESSERA_ASSIGN_OR_RETURN(std::vector<float> sums, buffer.get());
    for (size_t i = 0; i < count; ++i) {
      // Small integers: exact in fp32 whatever the order of the sum.
      float want = 0;
      for (int r = 0; r < n; ++r) want += contribution(r, i);
      if (sums[i] != want) {
        return internal_error("all-reduce " + std::to_string(it) + " of " + std::to_string(n) +
                              " ranks gave " + std::to_string(sums[i]) + " at element " +
                              std::to_string(i) + " where the ranks' sum is " +
                              std::to_string(want));
      }
    }
  }
  CommCheckResult out;
  out.bytes = count * sizeof(float);
  out.iterations = iterations;
  if (!times.empty()) {
    std::sort(times.begin(), times.end());
    out.median_us = times[times.size() / 2];
    double seconds = out.median_us * 1e-6;
    out.busbw_gbps =
        seconds > 0 ? static_cast<double>(out.bytes) * 2.0 * (n - 1) / n / seconds / 1e9 : 0;
  }
  return out;
}

#ifdef TESSERA_WITH_CUDA
namespace {

// Copies `bytes` from device `src` to `dst` and checks them; never throws.
P2pCopy copy_pair(int src, int dst, size_t bytes) {
  P2pCopy out{src, dst};
  int can = 0;
  cudaDeviceCanAccessPeer(&can, src, dst);
  out.peer_access = can != 0;
  const size_t words = std::max<size_t>(1, bytes / 4);
  std::vector<uint32_t> pattern(words);
  for (size_t i = 0; i < words; ++i) {
    pattern[i] = static_cast<uint32_t>(i * 2654435761u) ^ static_cast<uint32_t>(src << 24 | dst);
  }
  void* a = nullptr;
  void* b = nullptr;
  cudaStream_t stream = nullptr;
  cudaEvent_t start = nullptr, stop = nullptr;
  auto fail = [&](const char* what, cudaError_t e) {
    out.error = std::string(what) + ": " + cudaGetErrorString(e);
    cudaGetLastError();
    return out;
  };
  auto cleanup = [&] {
    if (a != nullptr) cudaSetDevice(src), cudaFree(a);
    if (b != nullptr) cudaSetDevice(dst), cudaFree(b);
    if (stream != nullptr) cudaStreamDestroy(stream);
    if (start != nullptr) cudaEventDestroy(start);
    if (stop != nullptr) cudaEventDestroy(stop);
  };
  P2pCopy result = [&]() -> P2pCopy {
    cudaError_t e;
    if ((e = cudaSetDevice(src)) != cudaSuccess) return fail("cudaSetDevice", e);
    if (out.peer_access) {
      e = cudaDeviceEnablePeerAccess(dst, 0);
      if (e != cudaSuccess && e != cudaErrorPeerAccessAlreadyEnabled) {
        return fail("cudaDeviceEnablePeerAccess", e);
      }
      cudaGetLastError();
    }
    if ((e = cudaMalloc(&a, words * 4)) != cudaSuccess) return fail("cudaMalloc", e);
    if ((e = cudaMemcpy(a, pattern.data(), words * 4, cudaMemcpyHostToDevice)) != cudaSuccess) {
      return fail("cudaMemcpy", e);
    }
    if ((e = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking)) != cudaSuccess) {
      return fail("cudaStreamCreate", e);
    }
    cudaEventCreate(&start);
    cudaEventCreate(&stop);
    if ((e = cudaSetDevice(dst)) != cudaSuccess) return fail("cudaSetDevice", e);
    if ((e = cudaMalloc(&b, words * 4)) != cudaSuccess) return fail("cudaMalloc", e);
    if ((e = cudaMemset(b, 0, words * 4)) != cudaSuccess) return fail("cudaMemset", e);
    cudaSetDevice(src);
    constexpr int kTimed = 5;
    for (int i = 0; i <= kTimed; ++i) {
      if (i == 1) cudaEventRecord(start, stream);
      if ((e = cudaMemcpyPeerAsync(b, dst, a, src, words * 4, stream)) != cudaSuccess) {
        return fail("cudaMemcpyPeerAsync", e);
      }
    }
    cudaEventRecord(stop, stream);
    if ((e = cudaStreamSynchronize(stream)) != cudaSuccess) return fail("the copy", e);
    float ms = 0;
    cudaEventElapsedTime(&ms, start, stop);
    out.gbps = ms > 0 ? static_cast<double>(words * 4) * kTimed / (ms * 1e-3) / 1e9 : 0;
    std::vector<uint32_t> back(words);
    cudaSetDevice(dst);
    if ((e = cudaMemcpy(back.data(), b, words * 4, cudaMemcpyDeviceToHost)) != cudaSuccess) {
      return fail("reading the copy back", e);
    }
    for (size_t i = 0; i < words; ++i) {
      if (back[i] != pattern[i]) {
        out.error = "the copy arrived wrong at byte " + std::to_string(i * 4) + " of " +
                    std::to_string(words * 4);
        return out;
      }
    }
    out.ok = true;
    return out;
  }();
  cleanup();
  return result;
}

}  // namespace
#endif

Expected<std::vector<P2pCopy>> run_p2p_check(uint64_t bytes) {
#ifdef TESSERA_WITH_CUDA
  int count = 0;
  if (cudaError_t e = cudaGetDeviceCount(&count); e != cudaSuccess) {
    return failed_precondition(std::string("no CUDA device: ") + cudaGetErrorString(e));
  }
  if (count < 2) {
    return failed_precondition("this actor sees " + std::to_string(count) +
                               " GPU(s): a P2P check needs two");
  }
  std::vector<P2pCopy> out;
  for (int s = 0; s < count; ++s) {
    for (int d = 0; d < count; ++d) {
      if (s != d) out.push_back(copy_pair(s, d, bytes));
    }
  }
  return out;
#else
  (void)bytes;
  return failed_precondition("this actor has no CUDA backend");
#endif
}

}  // namespace tessera::comm
