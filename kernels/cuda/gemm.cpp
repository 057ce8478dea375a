#include "kernels/cuda/gemm.h"

#include "kernels/cuda/gemv.h"

#include <algorithm>
#include <limits>
#include <string>
#include <tuple>
#include <utility>

namespace tessera::cuda {

namespace {

constexpr int kWarmupRuns = 2;
constexpr int kTimedRuns = 8;
constexpr uint32_t kMaxAlignment = 16;  // what the fastest kernels ask of a pointer

const char* short_name(DType d) {
  switch (d) {
    case DType::kF32:
      return "f32";
    case DType::kF16:
      return "f16";
    case DType::kBF16:
      return "bf16";
    case DType::kI32:
      return "i32";
    case DType::kF8E4M3:
      return "fp8e4m3";
  }
  return "?";
}

cudaDataType_t cuda_type(DType d) {
  switch (d) {
    case DType::kF16:
      return CUDA_R_16F;
    case DType::kBF16:
      return CUDA_R_16BF;
    case DType::kF8E4M3:
      return CUDA_R_8F_E4M3;
    case DType::kI32:
      return CUDA_R_32I;
    case DType::kF32:
      break;
  }
  return CUDA_R_32F;
}

// "[m=1 n=4096 k=4096 bf16->bf16]", "+bias" inside when there is one.
std::string describe(const GemmShape& s) {
  return "[m=" + std::to_string(s.m) + " n=" + std::to_string(s.n) + " k=" + std::to_string(s.k) +
         " " + short_name(s.in) + "->" + short_name(s.out) + (s.bias ? " +bias" : "") + "]";
}

Status lt_status(cublasStatus_t st, const std::string& what) {
  if (st == CUBLAS_STATUS_SUCCESS) return Status::ok();
  std::string msg = what + ": " + cublasLtGetStatusName(st);
  if (st == CUBLAS_STATUS_ALLOC_FAILED) return resource_exhausted(msg);
  return internal_error(msg);
}

// The largest power of two up to kMaxAlignment that divides the address.
uint32_t alignment_of(const void* p) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  if (a == 0) return kMaxAlignment;
  return static_cast<uint32_t>(std::min<uintptr_t>(a & (~a + 1), kMaxAlignment));
}

bool overlaps(const void* a, size_t a_bytes, const void* b, size_t b_bytes) {
  const auto pa = reinterpret_cast<uintptr_t>(a);
  const auto pb = reinterpret_cast<uintptr_t>(b);
  return pa < pb + b_bytes && pb < pa + a_bytes;
}

Status validate(const GemmShape& s, const void* x, const void* w, const void* bias,
                const void* out) {
  const std::string where = "Gemm::linear " + describe(s);
  if (s.m <= 0 || s.n <= 0 || s.k <= 0) {
    return invalid_argument(where + ": m, n and k must be positive");
  }
  if (!is_half_type(s.in)) {
    return invalid_argument(where + ": inputs must be BF16 or F16, not " + dtype_name(s.in));
  }
  if (s.out != s.in && s.out != DType::kF32) {
    return invalid_argument(where + ": output must be " + dtype_name(s.in) + " or F32, not " +
                            dtype_name(s.out));
  }
  if (x == nullptr || w == nullptr || out == nullptr) {
    return invalid_argument(where + ": null x, w or out");
  }
  if (s.bias != (bias != nullptr)) {
    return invalid_argument(where + (s.bias ? ": shape has a bias but the bias pointer is null"
                                            : ": a bias pointer was given for a shape without"));
  }
  if (s.bias && s.out == DType::kF32) {
    return invalid_argument(where +
                            ": a bias with F32 output is not supported (cuBLASLt takes "
                            "the bias in the output's type)");
  }
  const size_t in_size = dtype_size(s.in);
  const size_t out_bytes = static_cast<size_t>(s.m * s.n) * dtype_size(s.out);
  if (overlaps(out, out_bytes, x, static_cast<size_t>(s.m * s.k) * in_size) ||
      overlaps(out, out_bytes, w, static_cast<size_t>(s.n * s.k) * in_size) ||
      (bias != nullptr && overlaps(out, out_bytes, bias, static_cast<size_t>(s.n) * in_size))) {
    return invalid_argument(where + ": out overlaps an input");
  }
  return Status::ok();
}

// A call's alignment class (PlanKey): the largest of 2, 4, 8, 16 bytes all its pointers share.
uint32_t alignment_class(const void* x, const void* w, const void* bias, const void* out) {
  uint32_t alignment = std::min({alignment_of(x), alignment_of(w), alignment_of(out)});
  if (bias != nullptr) alignment = std::min(alignment, alignment_of(bias));
  return alignment;
}

// An algorithm's configuration in words, for test failures: "id 66 tile 18 splitK 1 ...".
std::string algo_config(const cublasLtMatmulAlgo_t& algo) {
  const std::tuple<cublasLtMatmulAlgoConfigAttributes_t, const char*, size_t> attrs[] = {
      {CUBLASLT_ALGO_CONFIG_ID, "id", 4},
      {CUBLASLT_ALGO_CONFIG_TILE_ID, "tile", 4},
      {CUBLASLT_ALGO_CONFIG_SPLITK_NUM, "splitK", 4},
      {CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, "reduction", 4},
      {CUBLASLT_ALGO_CONFIG_STAGES_ID, "stages", 4},
      {CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING, "swizzle", 4},
      {CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION, "custom", 4},
      {CUBLASLT_ALGO_CONFIG_INNER_SHAPE_ID, "inner", 2},
      {CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, "cluster", 2}};
  std::string out;
  for (const auto& [attr, label, bytes] : attrs) {
    uint32_t value = 0;  // little-endian: a 2-byte attribute fills the low half
    size_t written = 0;
    if (cublasLtMatmulAlgoConfigGetAttribute(&algo, attr, &value, bytes, &written) !=
        CUBLAS_STATUS_SUCCESS) {
      continue;
    }
    if (!out.empty()) out += ' ';
    out += std::string(label) + ' ' + std::to_string(value);
  }
  return out;
}

// Destroys a heuristic preference at the end of a scope.
struct PreferenceGuard {
  cublasLtMatmulPreference_t pref = nullptr;
  ~PreferenceGuard() {
    if (pref != nullptr) cublasLtMatmulPreferenceDestroy(pref);
  }
};

}  // namespace

struct Gemm::Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr;  // w: col-major [k, n], used transposed
  cublasLtMatrixLayout_t b = nullptr;  // x: col-major [k, m]
  cublasLtMatrixLayout_t d = nullptr;  // out: col-major [n, m] (also C, with beta = 0)
  cublasLtMatmulAlgo_t algo{};
  bool has_algo = false;
  bool timed = false;  // false: chosen during a capture, time it on the next eager call

  Plan() = default;
  Plan(const Plan&) = delete;
  Plan& operator=(const Plan&) = delete;
  ~Plan() {
    if (d != nullptr) cublasLtMatrixLayoutDestroy(d);
    if (b != nullptr) cublasLtMatrixLayoutDestroy(b);
    if (a != nullptr) cublasLtMatrixLayoutDestroy(a);
    if (desc != nullptr) cublasLtMatmulDescDestroy(desc);
  }

  // The descriptors of D^T[n, m] = W[n, k] . X^T[k, m] in cuBLASLt's column-major terms.
  Status init(const GemmShape& s) {
    const std::string what = "creating cuBLASLt descriptors for " + describe(s);
    TESSERA_RETURN_IF_ERROR(
        lt_status(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), what));
    const cublasOperation_t transa = CUBLAS_OP_T;
    const cublasOperation_t transb = CUBLAS_OP_N;
    TESSERA_RETURN_IF_ERROR(lt_status(
        cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &transa, sizeof(transa)),
        what));
    TESSERA_RETURN_IF_ERROR(lt_status(
        cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &transb, sizeof(transb)),
        what));
    if (s.bias) {
      const cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_BIAS;
      const int32_t bias_type = cuda_type(s.in);
      TESSERA_RETURN_IF_ERROR(
          lt_status(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue,
                                                   sizeof(epilogue)),
                    what));
      TESSERA_RETURN_IF_ERROR(
          lt_status(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE,
                                                   &bias_type, sizeof(bias_type)),
                    what));
    }
    const auto m = static_cast<uint64_t>(s.m);
    const auto n = static_cast<uint64_t>(s.n);
    const auto k = static_cast<uint64_t>(s.k);
    TESSERA_RETURN_IF_ERROR(
        lt_status(cublasLtMatrixLayoutCreate(&a, cuda_type(s.in), k, n, s.k), what));
    TESSERA_RETURN_IF_ERROR(
        lt_status(cublasLtMatrixLayoutCreate(&b, cuda_type(s.in), k, m, s.k), what));
    TESSERA_RETURN_IF_ERROR(
        lt_status(cublasLtMatrixLayoutCreate(&d, cuda_type(s.out), n, m, s.n), what));
    return Status::ok();
  }

  Status set_bias(const void* bias, const GemmShape& s) {
    if (!s.bias) return Status::ok();
    return lt_status(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias,
                                                    sizeof(bias)),
                     "setting the bias of " + describe(s));
  }
};

Expected<std::unique_ptr<Gemm>> Gemm::create(size_t workspace_bytes, bool autotune) {
  std::unique_ptr<Gemm> g(new Gemm());
  g->autotune_ = autotune;
  TESSERA_RETURN_IF_ERROR(lt_status(cublasLtCreate(&g->handle_), "cublasLtCreate"));
  TESSERA_ASSIGN_OR_RETURN(g->workspace_,
                           DeviceBuffer::allocate(workspace_bytes, "the cuBLASLt workspace"));
  TESSERA_CUDA_RETURN_IF_ERROR(cudaEventCreate(&g->start_), "cudaEventCreate");
  TESSERA_CUDA_RETURN_IF_ERROR(cudaEventCreate(&g->stop_), "cudaEventCreate");
  return g;
}

Gemm::~Gemm() {
  plans_.clear();
  if (stop_ != nullptr) cudaEventDestroy(stop_);
  if (start_ != nullptr) cudaEventDestroy(start_);
  workspace_.reset();
  if (handle_ != nullptr) cublasLtDestroy(handle_);
}

size_t Gemm::cached_shapes() const { return plans_.size(); }

cublasStatus_t Gemm::matmul(const Plan& p, const cublasLtMatmulAlgo_t& algo, const void* x,
                            const void* w, void* out, cudaStream_t stream) const {
  const float alpha = 1.0f;
  const float beta = 0.0f;
  return cublasLtMatmul(handle_, p.desc, &alpha, w, p.a, x, p.b, &beta, out, p.d, out, p.d, &algo,
                        workspace_.get(), workspace_.bytes(), stream);
}

Expected<int> Gemm::heuristic(const Plan& p, const GemmShape& shape, uint32_t alignment,
                              cublasLtMatmulHeuristicResult_t (&results)[kCandidates]) {
  const std::string shape_str = describe(shape);
  const std::string heuristic_what = "cublasLtMatmulAlgoGetHeuristic " + shape_str;
  PreferenceGuard guard;
  TESSERA_RETURN_IF_ERROR(lt_status(cublasLtMatmulPreferenceCreate(&guard.pref), heuristic_what));
  const uint64_t max_workspace = workspace_.bytes();
  // Split-K partial sums in fp32 only: the in-place and output-type schemes would round them to
  // bf16/fp16 before the reduction. (Algorithms without split-K always pass the mask.)
  const uint32_t reductions = CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
  TESSERA_RETURN_IF_ERROR(lt_status(
      cublasLtMatmulPreferenceSetAttribute(guard.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                           &max_workspace, sizeof(max_workspace)),
      heuristic_what));
  TESSERA_RETURN_IF_ERROR(lt_status(
      cublasLtMatmulPreferenceSetAttribute(guard.pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK,
                                           &reductions, sizeof(reductions)),
      heuristic_what));
  for (const auto attr :
       {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES}) {
    TESSERA_RETURN_IF_ERROR(lt_status(
        cublasLtMatmulPreferenceSetAttribute(guard.pref, attr, &alignment, sizeof(alignment)),
        heuristic_what));
  }

  int found = 0;
  TESSERA_RETURN_IF_ERROR(
      lt_status(cublasLtMatmulAlgoGetHeuristic(handle_, p.desc, p.a, p.b, p.d, p.d, guard.pref,
                                               kCandidates, results, &found),
                heuristic_what));
  int usable = 0;
  for (int i = 0; i < found; ++i) {
    if (results[i].state == CUBLAS_STATUS_SUCCESS && results[i].workspaceSize <= max_workspace) {
      results[usable++] = results[i];
    }
  }
  if (usable == 0) {
    return lt_status(CUBLAS_STATUS_NOT_SUPPORTED, heuristic_what + " (no algorithm for " +
                                                      std::to_string(alignment) +
                                                      "-byte aligned pointers)");
  }
  return usable;
}

Status Gemm::select_algo(Plan& p, const GemmShape& shape, uint32_t alignment, bool time,
                         cudaStream_t stream, const void* x, const void* w, void* out) {
  const std::string shape_str = describe(shape);
  cublasLtMatmulHeuristicResult_t results[kCandidates] = {};
  TESSERA_ASSIGN_OR_RETURN(const int usable, heuristic(p, shape, alignment, results));

  if (!time || usable == 1) {  // capturing: the heuristic's best guess, timed when next eager
    p.algo = results[0].algo;
    p.has_algo = true;
    p.timed = time;
    return Status::ok();
  }

  // Time each candidate on the caller's buffers (out is overwritten by the call anyway).
  const std::string matmul_what = "cublasLtMatmul " + shape_str;
  float best_ms = std::numeric_limits<float>::infinity();
  int best = -1;
  cublasStatus_t last_error = CUBLAS_STATUS_SUCCESS;
  for (int i = 0; i < usable; ++i) {
    const cublasLtMatmulAlgo_t& algo = results[i].algo;
    cublasStatus_t st = CUBLAS_STATUS_SUCCESS;
    for (int r = 0; r < kWarmupRuns && st == CUBLAS_STATUS_SUCCESS; ++r) {
      st = matmul(p, algo, x, w, out, stream);
    }
    if (st != CUBLAS_STATUS_SUCCESS) {
      last_error = st;
      continue;
    }
    TESSERA_CUDA_RETURN_IF_ERROR(cudaEventRecord(start_, stream), "timing " + matmul_what);
    for (int r = 0; r < kTimedRuns && st == CUBLAS_STATUS_SUCCESS; ++r) {
      st = matmul(p, algo, x, w, out, stream);
    }
    TESSERA_CUDA_RETURN_IF_ERROR(cudaEventRecord(stop_, stream), "timing " + matmul_what);
    TESSERA_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(stop_), "timing " + matmul_what);
    if (st != CUBLAS_STATUS_SUCCESS) {
      last_error = st;
      continue;
    }
    float ms = 0.0f;
    TESSERA_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&ms, start_, stop_), "timing " + matmul_what);
    if (ms < best_ms) {
      best_ms = ms;
      best = i;
    }
  }
  if (best < 0) return lt_status(last_error, matmul_what);
  p.algo = results[best].algo;
  p.has_algo = true;
  p.timed = true;
  return Status::ok();
}

Expected<Gemm::Plan*> Gemm::plan(const GemmShape& shape, cudaStream_t stream, const void* x,
                                 const void* w, const void* bias, void* out) {
  const uint32_t alignment = alignment_class(x, w, bias, out);
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  TESSERA_CUDA_RETURN_IF_ERROR(cudaStreamIsCapturing(stream, &capture), "cudaStreamIsCapturing");
  const bool capturing = capture != cudaStreamCaptureStatusNone;

  const PlanKey key{shape, alignment};
  auto it = plans_.find(key);
  if (it == plans_.end()) {
    auto p = std::make_unique<Plan>();
    TESSERA_RETURN_IF_ERROR(p->init(shape));
    it = plans_.emplace(key, std::move(p)).first;
  }
  Plan& p = *it->second;
  Status st = p.set_bias(bias, shape);
  if (st.is_ok() && (!p.has_algo || (autotune_ && !p.timed && !capturing))) {
    st = select_algo(p, shape, alignment, autotune_ && !capturing, stream, x, w, out);
  }
  if (!st.is_ok()) {
    if (!p.has_algo) plans_.erase(it);
    return st;
  }
  return &p;
}

Status Gemm::linear(const GemmShape& shape, const void* x, const void* w, const void* bias,
                    void* out, cudaStream_t stream) {
  TESSERA_RETURN_IF_ERROR(validate(shape, x, w, bias, out));
  if (gemv_takes(shape.m, shape.n, shape.k, shape.in, shape.out, x, w)) {
    return gemv(shape.m, shape.n, shape.k, shape.in, shape.out, x, w, bias, out, stream);
  }
  return planned_matmul(shape, x, w, bias, out, stream);
}

Status Gemm::linear_cublaslt(const GemmShape& shape, const void* x, const void* w, const void* bias,
                             void* out, cudaStream_t stream) {
  TESSERA_RETURN_IF_ERROR(validate(shape, x, w, bias, out));
  return planned_matmul(shape, x, w, bias, out, stream);
}

Expected<int> Gemm::linear_candidate(const GemmShape& shape, int index, const void* x,
                                     const void* w, const void* bias, void* out,
                                     cudaStream_t stream, std::string* config) {
  TESSERA_RETURN_IF_ERROR(validate(shape, x, w, bias, out));
  TESSERA_ASSIGN_OR_RETURN(Plan * p, plan(shape, stream, x, w, bias, out));
  const uint32_t alignment = alignment_class(x, w, bias, out);
  cublasLtMatmulHeuristicResult_t results[kCandidates] = {};
  TESSERA_ASSIGN_OR_RETURN(const int usable, heuristic(*p, shape, alignment, results));
  if (index < 0 || index >= usable) {
    return invalid_argument("gemm: candidate " + std::to_string(index) + " of " +
                            std::to_string(usable) + " for " + describe(shape));
  }
  if (config != nullptr) *config = algo_config(results[index].algo);
  TESSERA_RETURN_IF_ERROR(
      lt_status(matmul(*p, results[index].algo, x, w, out, stream),
                "cublasLtMatmul " + describe(shape) + " candidate " + std::to_string(index)));
  return usable;
}

Status Gemm::planned_matmul(const GemmShape& shape, const void* x, const void* w, const void* bias,
                            void* out, cudaStream_t stream) {
  TESSERA_ASSIGN_OR_RETURN(Plan * p, plan(shape, stream, x, w, bias, out));
  return lt_status(matmul(*p, p->algo, x, w, out, stream), "cublasLtMatmul " + describe(shape));
}

}  // namespace tessera::cuda
