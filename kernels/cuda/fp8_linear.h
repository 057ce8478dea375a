// FP8 W8A8 linear layers on the GPU (common/checkpoint/quantization.h's formats; the CPU
// backend's dequantizing linear is the oracle):
//
//   out[m, n] = (fp8(x[m, :] / a[m]) * a[m]) . (w8[n, :] * s[n])^T (+ bias[n]),  fp32 accumulation
//
// a[m] is the activation scale of row m: max|x[m, :]| / 448 per token (dynamic), or the layer's
// static input_scale; s[n] the weight scale of output n (a per-tensor scale is stored once per
// output, so q | k | v stacked with three tensor scales is one layer). The activations are
// quantized by the kernel that writes them: the RMSNorm that feeds q|k|v and gate|up
// (rms_norm_fp8), silu_mul that feeds down (silu_mul_fp8), a standalone pass for o's input
// (quantize_fp8_rows). Each rounds exactly as fake_quantize_fp8_activations does on the CPU,
// from the bf16/fp16 values the plain kernel would have written.
//
// All pointers are device pointers; `dtype` (kBF16 or kF16) is the element type of every
// activation buffer named `void*`. Launches go on `stream` and are graph-capturable (no
// allocation, no synchronisation). Activation widths (hidden, inter, cols) must be multiples of
// 8 and every buffer 16-byte aligned (an FP8 layer's inputs are multiples of 16: Fp8Gemm's).
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <tuple>

#include "common/checkpoint/quantization.h"
#include "common/status.h"
#include "common/tensor.h"
#include "kernels/cuda/cuda_util.h"

namespace tessera::cuda {

// The largest finite E4M3 value: a dynamic scale is max|row| / kFp8Max.
inline constexpr float kFp8Max = 448.0f;

// One FP8 linear layer on the GPU (possibly stacked parts: q|k|v, gate|up).
struct Fp8Layer {
  int64_t out = 0, in = 0;
  const uint8_t* w = nullptr;     // [out, in] E4M3
  const float* scales = nullptr;  // [out] fp32: s[n]
  float input_scale = 0.0f;       // > 0: the static activation scale; 0: dynamic per token
};

// ---- activation quantization ----

// q[r, :] = fp8(x[r, :] / a[r]), scales[r] = a[r]: a[r] = static_scale when > 0, else
// max|x[r, :]| / 448 (1 for an all-zero row), as fake_quantize_fp8_activations.
//   x: [rows, cols] dtype;  q: [rows, cols] E4M3;  scales: [rows] fp32
Status quantize_fp8_rows(DType dtype, const void* x, int64_t rows, int64_t cols, float static_scale,
                         uint8_t* q, float* scales, cudaStream_t stream);

// rms_norm (or, with residual != null, add_rms_norm: residual = round(residual + x) in place)
// of elementwise.h, its output row quantized as quantize_fp8_rows quantizes the row rms_norm
// writes (bit for bit: the same normalisation, kernels/cuda/rms_norm.cuh).
//   x: [rows, hidden] dtype;  residual: [rows, hidden] dtype or null;  weight: [hidden] dtype
//   q: [rows, hidden] E4M3;  scales: [rows] fp32.  hidden <= 32768.
Status rms_norm_fp8(DType dtype, const void* x, void* residual, const void* weight, int64_t rows,
                    int64_t hidden, float eps, float static_scale, uint8_t* q, float* scales,
                    cudaStream_t stream);

// silu_mul of elementwise.h (round(round(silu(gate)) * up)), its output row quantized as
// quantize_fp8_rows quantizes it.
//   gate_up: [rows, 2 inter] dtype;  q: [rows, inter] E4M3;  scales: [rows] fp32
Status silu_mul_fp8(DType dtype, const void* gate_up, int64_t rows, int64_t inter,
                    float static_scale, uint8_t* q, float* scales, cudaStream_t stream);

// ---- weights ----

// Online FP8 (--quantization fp8 on a plain checkpoint), on the GPU at load: quantize_fp8 of
// common/checkpoint/quantization.h bit for bit. scale = max|w| / 448 (1 when all zero), q =
// fp8(w / scale), written to each of the `out` entries of `scales`.
//   w: [out, in] of `dtype` (kF32, kF16, kBF16);  q: [out, in] E4M3;  scales: [out] fp32
//   amax: one uint32 of device scratch (overwritten)
Status quantize_fp8_weight(DType dtype, const void* w, int64_t out, int64_t in, uint8_t* q,
                           float* scales, uint32_t* amax, cudaStream_t stream);

// ---- the GEMM ----

// How Fp8Gemm applies a[m] * s[n]: cuBLASLt's outer-vector scaling (CUBLASLT_MATMUL_MATRIX_
// SCALE_OUTER_VEC_32F, cuBLAS 12.9+) inside the GEMM, or an fp32 GEMM output and an epilogue
// kernel. kAuto takes the outer vectors when a probe at create() shows they work. Steps of
// m <= kFp8GemvMaxM rows bypass cuBLASLt on either path (see kFp8GemvMaxM).
enum class Fp8GemmPath : uint8_t { kAuto, kOuterVector, kEpilogue };

// "auto", "outer-vector", "epilogue" (TESSERA_FP8_GEMM); INVALID_ARGUMENT otherwise.
Expected<Fp8GemmPath> parse_fp8_gemm_path(std::string_view text);
const char* fp8_gemm_path_name(Fp8GemmPath path);

// Rows (tokens) up to which Fp8Gemm::linear runs its own kernel instead of cuBLASLt: batch-1
// to 4 decode, where a layer reads each weight byte once for at most 4 products and its time is
// the weight stream's. cuBLASLt's FP8 kernels are far from HBM bandwidth there (at m = 1 FP8 gave
// 1.27x bf16's tokens/s against the bytes' 2x), and without the outer-vector scaling they add an
// epilogue launch. The kernel streams w once (16-byte loads that bypass L1, 8 in flight per
// thread), widens E4M3 exactly (E4M3 -> f16 -> fp32), sums the products in fp32 and writes
// out_dtype rounded once; its sums are deterministic (a fixed order, no atomics), its
// accumulation order is not cuBLASLt's. TESSERA_FP8_GEMV=0 (read once per process) sends every m
// to cuBLASLt, to time the two side by side.
inline constexpr int64_t kFp8GemvMaxM = 4;

struct Fp8GemmArgs {
  int64_t m = 0, n = 0, k = 0;      // m >= 1; n and k multiples of 16
  DType out_dtype = DType::kBF16;   // kBF16 or kF16
  const uint8_t* x = nullptr;       // [m, k] E4M3
  const float* x_scales = nullptr;  // [m] fp32: a[m]
  const uint8_t* w = nullptr;       // [n, k] E4M3 (a Hugging Face Linear weight)
  const float* w_scales = nullptr;  // [n] fp32: s[n]
  const void* bias = nullptr;       // [n] out_dtype, or null
  void* out = nullptr;              // [m, n] out_dtype; overlaps no input
  // false: cuBLASLt at every m, as TESSERA_FP8_GEMV=0 (tests and benchmarks compare the two).
  bool small_m_kernel = true;
};

class Fp8Gemm {
 public:
  // One cuBLASLt handle and a 32 MiB workspace for steps of up to `max_m` rows and layers of
  // up to `max_n` outputs (the epilogue path's fp32 scratch holds a chunk of rows of the widest
  // layer: at most 64 MiB). `path` kAuto probes the outer-vector scaling on a small GEMM with
  // known results in `out_dtype` (on `stream`, synchronised) and takes it when it gives them;
  // kOuterVector fails (FAILED_PRECONDITION, naming TESSERA_FP8_GEMM) when the probe does not.
  static Expected<std::unique_ptr<Fp8Gemm>> create(Fp8GemmPath path, int64_t max_m, int64_t max_n,
                                                   DType out_dtype, cudaStream_t stream);
  ~Fp8Gemm();
  Fp8Gemm(const Fp8Gemm&) = delete;
  Fp8Gemm& operator=(const Fp8Gemm&) = delete;

  Fp8GemmPath path() const { return path_; }  // kOuterVector or kEpilogue
  // Why kAuto did not take the outer vectors ("" when it did, or was not asked to).
  const std::string& probe_failure() const { return probe_failure_; }
  uint64_t device_bytes() const { return workspace_.bytes() + scratch_.bytes(); }
  // The most device_bytes() can be, whatever the shapes (for a memory check before create).
  static constexpr uint64_t kMaxDeviceBytes = kFp8GemmDeviceBytes;  // the planner counts it

  // out = (x * a) . (w * s)^T (+ bias), as the file comment says. Bad arguments are
  // INVALID_ARGUMENT; cuBLASLt failures name the status and the shape. A shape is planned on
  // its first call (the heuristic's first algorithm), also inside a graph capture. m <=
  // kFp8GemvMaxM takes the small-m kernel (any n, k; no plan, no workspace) unless
  // args.small_m_kernel is false or TESSERA_FP8_GEMV=0.
  Status linear(const Fp8GemmArgs& args, cudaStream_t stream);

 private:
  struct Plan;
  Fp8Gemm() = default;
  Status probe(DType out_dtype, cudaStream_t stream);
  Expected<Plan*> plan(int64_t m, int64_t n, int64_t k, DType out, bool bias, bool outer);
  Status outer_vector(const Fp8GemmArgs& a, cudaStream_t stream);
  Status epilogue(const Fp8GemmArgs& a, cudaStream_t stream);
  Status count_gemv_slots();
  Status gemv(const Fp8GemmArgs& a, cudaStream_t stream);

  Fp8GemmPath path_ = Fp8GemmPath::kEpilogue;
  std::string probe_failure_;
  cublasLtHandle_t handle_ = nullptr;
  DeviceBuffer workspace_;
  DeviceBuffer scratch_;  // the epilogue path's fp32 [chunk_rows_, max_n_]
  int64_t max_n_ = 0, chunk_rows_ = 0;
  // The small-m kernel's CTAs resident on the GPU at once, for m = 1 .. kFp8GemvMaxM: how far it
  // splits K so that a small layer fills every SM.
  std::array<int64_t, kFp8GemvMaxM> gemv_slots_{};
  std::map<std::tuple<int64_t, int64_t, int64_t, DType, bool, bool>, std::unique_ptr<Plan>> plans_;
};

}  // namespace tessera::cuda
