// What one kernel boundary of the batch-1 decode chain costs, and what a flag would cost instead
// (not a test; gpu-check's decode parts run it). A CUDA graph of kKernels kernels, each of G
// blocks: every block reads the whole 8 KB row the kernel before wrote (as a GEMV reads its
// input), sums it and writes its share of the next row. The kernels depend on each other by
//   pdl:  programmatic dependent launch, as the model's kernels do: griddepcontrol.wait, then
//         launch_dependents;
//   flag: launched the same way, but a block polls a progress word (ld.acquire) that the kernel
//         before's last block sets (st.release) once every block of it counted its stores; it
//         calls griddepcontrol.wait only before it exits (so a finished kernel still implies
//         every earlier one finished);
//   none: no dependency at all (the launches alone, a lower bound).
// Prints us per kernel for each G, and the sums of both dependent modes (they must agree).
//
//   sync_bench
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "kernels/cuda/cuda_util.h"
#include "kernels/cuda/device_math.cuh"

namespace tessera::cuda {
namespace {

constexpr int kRow = 2048;  // floats a kernel reads (8 KB)
constexpr int kThreads = 256;
constexpr int kKernels = 48;
constexpr int kReplays = 200;

enum Mode : int { kPdl = 0, kFlag = 1, kNone = 2 };

__device__ __forceinline__ uint64_t ld_acquire(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_release(uint64_t* p, uint64_t v) {
  asm volatile("st.release.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__global__ void __launch_bounds__(kThreads)
    chain_kernel(int mode, const float* __restrict__ in, float* __restrict__ out, int index,
                 uint64_t* progress, int* arrivals) {
  __shared__ float partial[kThreads / 32];
  if (mode == kPdl) {
    dev::pdl_wait();
    dev::pdl_launch_dependents();
  } else if (mode == kFlag) {
    if (threadIdx.x == 0) {
      while (ld_acquire(progress) < static_cast<uint64_t>(index)) {
      }
    }
    __syncthreads();
    dev::pdl_launch_dependents();
  } else {
    dev::pdl_launch_dependents();
  }
  float s = 0.0f;
  for (int i = static_cast<int>(threadIdx.x); i < kRow; i += kThreads) s += __ldcg(in + i);
  s = dev::warp_sum(s);
  if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = s;
  __syncthreads();
  float total = 0.0f;
  for (int w = 0; w < kThreads / 32; ++w) total += partial[w];
  const int per = (kRow + static_cast<int>(gridDim.x) - 1) / static_cast<int>(gridDim.x);
  for (int i = static_cast<int>(threadIdx.x); i < per; i += kThreads) {
    const int j = static_cast<int>(blockIdx.x) * per + i;
    if (j < kRow) out[j] = total * (1.0f / kRow) + 1.0f;
  }
  if (mode == kFlag) {
    __syncthreads();
    if (threadIdx.x == 0) {
      __threadfence();
      if (atomicAdd(arrivals, 1) == static_cast<int>(gridDim.x) - 1) {
        *arrivals = 0;
        st_release(progress, static_cast<uint64_t>(index) + 1);
      }
    }
    dev::pdl_wait();
  }
}

__global__ void reset_kernel(uint64_t* progress) { *progress = 0; }

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "sync_bench: %s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

int run() {
  cudaStream_t st;
  check(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking), "stream");
  float* rows = nullptr;
  uint64_t* progress = nullptr;
  int* arrivals = nullptr;
  check(cudaMalloc(&rows, 2 * kRow * sizeof(float)), "malloc");
  check(cudaMalloc(&progress, sizeof(uint64_t)), "malloc");
  check(cudaMalloc(&arrivals, sizeof(int)), "malloc");
  check(cudaMemset(arrivals, 0, sizeof(int)), "memset");
  cudaDeviceProp prop{};
  check(cudaGetDeviceProperties(&prop, 0), "props");
  std::printf("kernel boundaries on %s (%d SMs): us a kernel, %d kernels a graph, %d replays\n",
              prop.name, prop.multiProcessorCount, kKernels, kReplays);
  std::printf("%8s %10s %10s %10s %12s %12s\n", "blocks", "pdl", "flag", "none", "sum pdl",
              "sum flag");
  for (int blocks : {8, 32, 132, 256, 384, 512}) {
    double us[3] = {};
    float sums[2] = {};
    for (int mode : {kPdl, kFlag, kNone}) {
      std::vector<float> init(2 * kRow, 1.0f);
      check(cudaMemcpy(rows, init.data(), init.size() * sizeof(float), cudaMemcpyHostToDevice),
            "copy");
      cudaGraph_t graph;
      check(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal), "capture");
      reset_kernel<<<1, 1, 0, st>>>(progress);
      for (int k = 0; k < kKernels; ++k) {
        const float* in = rows + (k % 2) * kRow;
        float* out = rows + ((k + 1) % 2) * kRow;
        check(launch_pdl(chain_kernel, dim3(blocks), dim3(kThreads), 0, st, mode, in, out, k,
                         progress, arrivals),
              "launch");
      }
      check(cudaStreamEndCapture(st, &graph), "end capture");
      cudaGraphExec_t exec;
      check(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
      for (int i = 0; i < 20; ++i) check(cudaGraphLaunch(exec, st), "warm-up");
      cudaEvent_t a, b;
      check(cudaEventCreate(&a), "event");
      check(cudaEventCreate(&b), "event");
      check(cudaEventRecord(a, st), "record");
      for (int i = 0; i < kReplays; ++i) check(cudaGraphLaunch(exec, st), "replay");
      check(cudaEventRecord(b, st), "record");
      check(cudaEventSynchronize(b), "sync");
      float ms = 0;
      check(cudaEventElapsedTime(&ms, a, b), "elapsed");
      us[mode] = 1e3 * ms / kReplays / kKernels;
      if (mode != kNone) {
        std::vector<float> out(kRow);
        check(cudaMemcpy(out.data(), rows + (kKernels % 2) * kRow, kRow * sizeof(float),
                         cudaMemcpyDeviceToHost),
              "copy back");
        for (float v : out) sums[mode] += v;
      }
      check(cudaGraphExecDestroy(exec), "destroy");
      check(cudaGraphDestroy(graph), "destroy");
      check(cudaEventDestroy(a), "event");
      check(cudaEventDestroy(b), "event");
    }
    std::printf("%8d %10.3f %10.3f %10.3f %12.1f %12.1f\n", blocks, us[kPdl], us[kFlag], us[kNone],
                sums[0], sums[1]);
  }
  return 0;
}

}  // namespace
}  // namespace tessera::cuda

int main() { return tessera::cuda::run(); }
