// GEMMs through cuBLASLt for the linear layers: out[M, N] = x[M, K] . w[N, K]^T (+ bias[N]),
// bf16/fp16 inputs, fp32 accumulation, output in the input dtype or fp32 (the logits). Decode
// shapes that gemv_takes() (kernels/cuda/gemv.h: one row, any width) run on the GEMV kernel
// instead, which overlaps the kernel before; they get no plan. Their w is read before the GEMV
// waits for that kernel: w must not be the output of the kernel launched just before on the
// stream (weights never are; w4_linear's dequantized weight is multiplied only at m > 1).
// The algorithm for each (M, N, K, dtypes, bias) is chosen once — the heuristic's candidates
// are timed on the first eager call of that shape — and cached; inside a CUDA-graph capture
// an unseen shape takes the heuristic's first choice without timing, and is timed on its next
// eager call. Split-K reductions are kept in fp32 (never in a bf16/fp16 output buffer).
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
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
  // autotune = false (the default) takes the heuristic's first algorithm for each shape: the
  // same choice on every run, so outputs are reproducible across restarts. autotune = true
  // times the heuristic's candidates on a shape's first eager call and keeps the fastest
  // (faster by a few percent at best; the choice can differ between runs).
  static Expected<std::unique_ptr<Gemm>> create(size_t workspace_bytes = 32u << 20,
                                                bool autotune = false);
  ~Gemm();
  Gemm(const Gemm&) = delete;
  Gemm& operator=(const Gemm&) = delete;

  //   x:    [m, k] row-major, dtype shape.in
  //   w:    [n, k] row-major (a Hugging Face Linear weight), dtype shape.in
  //   bias: [n] dtype shape.in, or null (shape.bias must say which); not with out = kF32
  //         (cuBLASLt wants the bias in D's type)
  //   out:  [m, n] row-major, dtype shape.out; must not overlap x, w or bias
  // Bad arguments are INVALID_ARGUMENT; cuBLASLt failures name the status and the shape
  // ("cublasLtMatmul [m=1 n=4096 k=4096 bf16->bf16]: CUBLAS_STATUS_NOT_SUPPORTED").
  Status linear(const GemmShape& shape, const void* x, const void* w, const void* bias, void* out,
                cudaStream_t stream);
  // The same through cuBLASLt whatever the shape (kernel_bench times it beside the GEMV).
  Status linear_cublaslt(const GemmShape& shape, const void* x, const void* w, const void* bias,
                         void* out, cudaStream_t stream);

  // The heuristic's candidate `index` for this call (0: its first, what autotune = false takes;
  // autotune = true takes the fastest of them all), whatever the shape: returns how many there
  // are (an index past them is INVALID_ARGUMENT). For tests and benchmarks of every algorithm.
  // `config`, when given, gets the algorithm's configuration in words (tile, split-K, ...).
  Expected<int> linear_candidate(const GemmShape& shape, int index, const void* x, const void* w,
                                 const void* bias, void* out, cudaStream_t stream,
                                 std::string* config = nullptr);

  // Shapes whose algorithm is cached (for logs and tests; the GEMV's shapes have none): one plan
  // per shape and alignment class of the pointers it was called with (see PlanKey).
  size_t cached_shapes() const;

 private:
  struct Plan;
  // The cuBLASLt call of linear() and linear_cublaslt(), on arguments they validated.
  Status planned_matmul(const GemmShape& shape, const void* x, const void* w, const void* bias,
                        void* out, cudaStream_t stream);
  // Plans are per shape and per alignment class of the call's pointers (the largest of 2, 4, 8,
  // 16 bytes that all of x, w, bias and out share): the fast kernels need 16-byte aligned
  // pointers, so a call with less aligned ones gets a plan of its own among the kernels that
  // accept them. cached_shapes() counts these plans.
  struct PlanKey {
    GemmShape shape;
    uint32_t alignment = 16;
    bool operator<(const PlanKey& o) const {
      return std::make_tuple(shape.key(), alignment) < std::make_tuple(o.shape.key(), o.alignment);
    }
  };
  Gemm() = default;
  // The plan for this call, created and its algorithm chosen (timed unless `stream` is capturing)
  // as needed, with the bias pointer set.
  Expected<Plan*> plan(const GemmShape& shape, cudaStream_t stream, const void* x, const void* w,
                       const void* bias, void* out);
  static constexpr int kCandidates = 8;  // heuristic results timed on a shape's first eager call
  // The heuristic's usable candidates for the plan (those within the workspace), first in
  // `results`; NOT_SUPPORTED when there are none.
  Expected<int> heuristic(const Plan& plan, const GemmShape& shape, uint32_t alignment,
                          cublasLtMatmulHeuristicResult_t (&results)[kCandidates]);
  // Asks the heuristic for candidates and keeps the fastest (or, when `time` is false, the
  // heuristic's first) in plan.algo.
  Status select_algo(Plan& plan, const GemmShape& shape, uint32_t alignment, bool time,
                     cudaStream_t stream, const void* x, const void* w, void* out);
  cublasStatus_t matmul(const Plan& plan, const cublasLtMatmulAlgo_t& algo, const void* x,
                        const void* w, void* out, cudaStream_t stream) const;

  bool autotune_ = false;
  cublasLtHandle_t handle_ = nullptr;
  DeviceBuffer workspace_;
  cudaEvent_t start_ = nullptr, stop_ = nullptr;  // timing of the candidates
  std::map<PlanKey, std::unique_ptr<Plan>> plans_;
};

}  // namespace tessera::cuda
