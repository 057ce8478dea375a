// GEMMs through cuBLASLt for the linear layers: out[M, N] = x[M, K] . w[N, K]^T (+ bias[N]),
// bf16/fp16 inputs, fp32 accumulation, output in the input dtype or fp32 (the logits).
// The algorithm for each (M, N, K, dtypes, bias) is chosen once — the heuristic's candidates
// are timed on the first eager call of that shape — and cached; inside a CUDA-graph capture
// an unseen shape takes the heuristic's first choice without timing.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <memory>
#include <tuple>

#include "common/status.h"
#include "common/tensor.h"
#include "kernels/cuda/cuda_util.h"

namespace tessera::cuda {

struct GemmShape {
  int64_t m = 0, n = 0, k = 0;
  DType in = DType::kBF16;   // x and w
  DType out = DType::kBF16;  // out: `in` or kF32
  bool bias = false;         // bias [N] in dtype `in`
  auto key() const { return std::make_tuple(m, n, k, in, out, bias); }
  bool operator<(const GemmShape& o) const { return key() < o.key(); }
};

class Gemm {
 public:
  // One cuBLASLt handle and a `workspace_bytes` workspace. Not thread-safe: one per stream.
  static Expected<std::unique_ptr<Gemm>> create(size_t workspace_bytes = 32u << 20);
  ~Gemm();
  Gemm(const Gemm&) = delete;
  Gemm& operator=(const Gemm&) = delete;

  //   x:    [m, k] row-major, dtype shape.in
  //   w:    [n, k] row-major (a Hugging Face Linear weight), dtype shape.in
  //   bias: [n] dtype shape.in, or null (shape.bias must say which)
  //   out:  [m, n] row-major, dtype shape.out; must not overlap x or w
  Status linear(const GemmShape& shape, const void* x, const void* w, const void* bias, void* out,
                cudaStream_t stream);

  // Shapes whose algorithm is cached (for logs and tests).
  size_t cached_shapes() const;

 private:
  struct Plan;
  Gemm() = default;
  Expected<const Plan*> plan(const GemmShape& shape, cudaStream_t stream, const void* x,
                             const void* w, const void* bias, void* out);

  cublasLtHandle_t handle_ = nullptr;
  DeviceBuffer workspace_;
  std::map<GemmShape, std::unique_ptr<Plan>> plans_;
};

}  // namespace tessera::cuda
