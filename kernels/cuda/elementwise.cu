// The memory-bound ops of the CUDA forward pass. See elementwise.h for the contract and the
// transformers rounding each op mimics; the launch configuration of each kernel is described
// next to its launch function.
#include "kernels/cuda/elementwise.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "kernels/cuda/cuda_util.h"
#include "kernels/cuda/device_math.cuh"

namespace tessera::cuda {

namespace {

using dev::kHalfVec;

constexpr int64_t kMaxGridX = 2147483647;  // gridDim.x limit
constexpr int64_t kMaxGridY = 65535;       // gridDim.y limit

// ---- host helpers ----

template <typename T>
struct TypeTag {
  using type = T;
};

// Calls fn(TypeTag<T>{}) with T the element type behind `dtype`.
template <typename Fn>
Status with_type(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::kF32:
      return fn(TypeTag<float>{});
    case DType::kF16:
      return fn(TypeTag<__half>{});
    case DType::kBF16:
      return fn(TypeTag<__nv_bfloat16>{});
  }
  return invalid_argument("unknown dtype " + std::to_string(static_cast<int>(dtype)));
}

// The same for the ops that take only the 2-byte activation types (validated before).
template <typename Fn>
Status with_half_type(DType dtype, Fn&& fn) {
  if (dtype == DType::kBF16) return fn(TypeTag<__nv_bfloat16>{});
  if (dtype == DType::kF16) return fn(TypeTag<__half>{});
  return invalid_argument(std::string("expected BF16 or F16, got ") + dtype_name(dtype));
}

Status check_half_dtype(DType dtype, const char* op) {
  if (is_half_type(dtype)) return Status::ok();
  return invalid_argument(std::string(op) + ": dtype must be BF16 or F16, got " +
                          dtype_name(dtype));
}

Status check_non_negative(int64_t v, const char* op, const char* name) {
  if (v >= 0) return Status::ok();
  return invalid_argument(std::string(op) + ": " + name + " must be >= 0, got " +
                          std::to_string(v));
}

Status check_positive(int64_t v, const char* op, const char* name) {
  if (v > 0) return Status::ok();
  return invalid_argument(std::string(op) + ": " + name + " must be > 0, got " + std::to_string(v));
}

Status check_not_null(const void* p, const char* op, const char* name) {
  if (p != nullptr) return Status::ok();
  return invalid_argument(std::string(op) + ": " + name + " is null");
}

bool aligned(const void* p, size_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// ---- embedding / gather_rows: row copies ----

// dst[r, :] = src[clamp(idx[r]), :], rows of row_vecs elements of type V (a 16/8/4/2-byte chunk
// of the row: the op is a byte copy, whatever the dtype). Grid: x covers the columns of a row,
// y strides over the rows.
template <typename V>
__global__ void copy_rows_kernel(const V* __restrict__ src, int64_t src_rows,
                                 const int32_t* __restrict__ idx, int64_t num_rows,
                                 int64_t row_vecs, V* __restrict__ dst) {
  dev::pdl_wait();
  dev::pdl_launch_dependents();
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= row_vecs) return;
  for (int64_t r = blockIdx.y; r < num_rows; r += gridDim.y) {
    int64_t s = idx[r];
    s = s < 0 ? 0 : (s >= src_rows ? src_rows - 1 : s);
    dst[r * row_vecs + c] = __ldg(src + s * row_vecs + c);
  }
}

template <typename V>
Status launch_copy_rows(const void* src, int64_t src_rows, const int32_t* idx, int64_t num_rows,
                        int64_t row_bytes, void* dst, cudaStream_t stream, const char* name) {
  constexpr int kThreads = 128;
  const int64_t row_vecs = row_bytes / static_cast<int64_t>(sizeof(V));
  const dim3 grid(static_cast<unsigned>(ceil_div(row_vecs, kThreads)),
                  static_cast<unsigned>(std::min(num_rows, kMaxGridY)));
  launch_pdl(copy_rows_kernel<V>, grid, kThreads, 0, stream, static_cast<const V*>(src), src_rows,
             idx, num_rows, row_vecs, static_cast<V*>(dst));
  return launch_status(name);
}

// Shared by embedding and gather_rows (the same kernel: a clamped row gather), after validation.
// Picks the widest chunk (16, 8, 4 or 2 bytes) that divides a row and both base pointers'
// alignment.
Status copy_rows(DType dtype, const void* src, int64_t src_rows, const int32_t* idx,
                 int64_t num_rows, int64_t width, void* dst, cudaStream_t stream,
                 const char* name) {
  if (num_rows == 0) return Status::ok();
  const int64_t row_bytes = width * static_cast<int64_t>(dtype_size(dtype));
  auto fits = [&](int64_t bytes) {
    return row_bytes % bytes == 0 && aligned(src, bytes) && aligned(dst, bytes);
  };
  if (fits(16))
    return launch_copy_rows<uint4>(src, src_rows, idx, num_rows, row_bytes, dst, stream, name);
  if (fits(8))
    return launch_copy_rows<uint2>(src, src_rows, idx, num_rows, row_bytes, dst, stream, name);
  if (fits(4))
    return launch_copy_rows<uint32_t>(src, src_rows, idx, num_rows, row_bytes, dst, stream, name);
  return launch_copy_rows<uint16_t>(src, src_rows, idx, num_rows, row_bytes, dst, stream, name);
}

Status check_copy_dtype(DType dtype, const char* op) {
  if (dtype == DType::kF32 || dtype == DType::kF16 || dtype == DType::kBF16) return Status::ok();
  return invalid_argument(std::string(op) + ": unsupported dtype " +
                          std::to_string(static_cast<int>(dtype)));
}

// ---- rms_norm / add_rms_norm ----

// One CTA per row (grid-stride over rows). Fast path: hidden % 8 == 0 and 16-byte aligned
// buffers; each thread keeps V 16-byte vectors of its row in registers, packed as the dtype (one
// global read), and its weight vectors, loaded once before the row loop. All reads of x precede the
// block reduction's barrier and all writes of out follow it, so x and out may alias.
template <typename T, int V, bool kAdd>
__global__ void __launch_bounds__(512)
    rms_norm_vec_kernel(const T* x, T* residual, const T* __restrict__ weight, int64_t rows,
                        int64_t hidden, float eps, T* out) {
  __shared__ float scratch[32];
  const int64_t nvec = hidden / kHalfVec;
  const float inv_hidden = 1.0f / static_cast<float>(hidden);
  uint4 w[V];
#pragma unroll
  for (int k = 0; k < V; ++k) {
    const int64_t j = threadIdx.x + static_cast<int64_t>(k) * blockDim.x;
    w[k] = j < nvec ? __ldg(reinterpret_cast<const uint4*>(weight) + j) : make_uint4(0, 0, 0, 0);
  }
  // The weights are constant: loaded before the wait for the kernel that writes x.
  dev::pdl_wait();
  dev::pdl_launch_dependents();
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const int64_t base = row * hidden;
    uint4 hv[V];  // the row's values as the dtype holds them (x, or the rounded residual sum)
    float ss = 0.0f;
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const int64_t j = threadIdx.x + static_cast<int64_t>(k) * blockDim.x;
      hv[k] = make_uint4(0, 0, 0, 0);
      if (j < nvec) {
        hv[k] = *reinterpret_cast<const uint4*>(x + base + j * kHalfVec);
        float h[kHalfVec];
        dev::unpack8<T>(hv[k], h);
        if constexpr (kAdd) {
          float r[kHalfVec];
          dev::load8(residual + base + j * kHalfVec, r);
#pragma unroll
          for (int e = 0; e < kHalfVec; ++e) h[e] = r[e] + h[e];
          hv[k] = dev::pack8<T>(h);
          *reinterpret_cast<uint4*>(residual + base + j * kHalfVec) = hv[k];
          dev::unpack8<T>(hv[k], h);
        }
#pragma unroll
        for (int e = 0; e < kHalfVec; ++e) ss += h[e] * h[e];
      }
    }
    const float inv = rsqrtf(dev::block_sum(ss, scratch) * inv_hidden + eps);
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const int64_t j = threadIdx.x + static_cast<int64_t>(k) * blockDim.x;
      if (j < nvec) {
        float h[kHalfVec], wf[kHalfVec];
        dev::unpack8<T>(hv[k], h);
        dev::unpack8<T>(w[k], wf);
#pragma unroll
        for (int e = 0; e < kHalfVec; ++e) h[e] = wf[e] * dev::round_to<T>(h[e] * inv);
        dev::store8(out + base + j * kHalfVec, h);
      }
    }
  }
}

// Any hidden size and alignment: scalar, two passes over the row (the second re-reads x or the
// rounded residual, which this thread itself wrote, from cache). Pass 2 reads element i and then
// writes out[i] in the same thread, and add's pass 2 does not read x, so x and out may alias.
template <typename T, bool kAdd>
__global__ void __launch_bounds__(256)
    rms_norm_any_kernel(const T* x, T* residual, const T* __restrict__ weight, int64_t rows,
                        int64_t hidden, float eps, T* out) {
  __shared__ float scratch[32];
  dev::pdl_wait();
  dev::pdl_launch_dependents();
  const float inv_hidden = 1.0f / static_cast<float>(hidden);
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const int64_t base = row * hidden;
    float ss = 0.0f;
    for (int64_t i = threadIdx.x; i < hidden; i += blockDim.x) {
      float h = dev::to_float(x[base + i]);
      if constexpr (kAdd) {
        h = dev::round_to<T>(dev::to_float(residual[base + i]) + h);
        residual[base + i] = dev::from_float<T>(h);
      }
      ss += h * h;
    }
    const float inv = rsqrtf(dev::block_sum(ss, scratch) * inv_hidden + eps);
    for (int64_t i = threadIdx.x; i < hidden; i += blockDim.x) {
      const float h = dev::to_float(kAdd ? residual[base + i] : x[base + i]);
      out[base + i] =
          dev::from_float<T>(dev::to_float(__ldg(weight + i)) * dev::round_to<T>(h * inv));
    }
  }
}

template <typename T, bool kAdd>
Status launch_norm(const void* xv, void* residualv, const void* weightv, int64_t rows,
                   int64_t hidden, float eps, void* outv, cudaStream_t stream, const char* name) {
  const T* x = static_cast<const T*>(xv);
  T* residual = static_cast<T*>(residualv);
  const T* weight = static_cast<const T*>(weightv);
  T* out = static_cast<T*>(outv);
  const unsigned grid = static_cast<unsigned>(std::min(rows, kMaxGridX));
  const bool vec_ok = hidden % kHalfVec == 0 && aligned(x, 16) && aligned(weight, 16) &&
                      aligned(out, 16) && (!kAdd || aligned(residual, 16));
  const int64_t nvec = hidden / kHalfVec;
  // V vectors per thread, at most 512 threads: hidden up to 512 * 8 * 8 = 32768 on this path.
  int v = 0;
  if (vec_ok) {
    for (int cand : {1, 2, 4, 8}) {
      if (nvec <= static_cast<int64_t>(cand) * 512) {
        v = cand;
        break;
      }
    }
  }
  if (v == 0) {
    const int threads = static_cast<int>(std::min<int64_t>(256, ceil_div(hidden, 32) * 32));
    launch_pdl(rms_norm_any_kernel<T, kAdd>, grid, threads, 0, stream, x, residual, weight, rows,
               hidden, eps, out);
    return launch_status(name);
  }
  const int threads = static_cast<int>(ceil_div(ceil_div(nvec, v), 32) * 32);
  switch (v) {
    case 1:
      launch_pdl(rms_norm_vec_kernel<T, 1, kAdd>, grid, threads, 0, stream, x, residual, weight,
                 rows, hidden, eps, out);
      break;
    case 2:
      launch_pdl(rms_norm_vec_kernel<T, 2, kAdd>, grid, threads, 0, stream, x, residual, weight,
                 rows, hidden, eps, out);
      break;
    case 4:
      launch_pdl(rms_norm_vec_kernel<T, 4, kAdd>, grid, threads, 0, stream, x, residual, weight,
                 rows, hidden, eps, out);
      break;
    default:
      launch_pdl(rms_norm_vec_kernel<T, 8, kAdd>, grid, threads, 0, stream, x, residual, weight,
                 rows, hidden, eps, out);
      break;
  }
  return launch_status(name);
}

Status check_norm_args(DType dtype, const void* x, const void* weight, int64_t rows, int64_t hidden,
                       const void* out, const char* op) {
  TESSERA_RETURN_IF_ERROR(check_half_dtype(dtype, op));
  TESSERA_RETURN_IF_ERROR(check_non_negative(rows, op, "rows"));
  TESSERA_RETURN_IF_ERROR(check_positive(hidden, op, "hidden"));
  if (rows == 0) return Status::ok();
  TESSERA_RETURN_IF_ERROR(check_not_null(x, op, "x"));
  TESSERA_RETURN_IF_ERROR(check_not_null(weight, op, "weight"));
  TESSERA_RETURN_IF_ERROR(check_not_null(out, op, "out"));
  return Status::ok();
}

// ---- rope_and_cache ----

constexpr int kRopeWarps = 4;  // head tasks per CTA (one warp each)

// Grid: x strides over tokens, y over groups of kRopeWarps "head tasks" (the num_heads q heads,
// then the num_kv_heads k heads; a k task also copies the matching v head). One warp per head:
// lane l holds the rotation pairs (i, i + half) for i = l + 32 p, p < P = ceil(half / 32), so
// the per-head RMSNorm is a warp shuffle sum. No block-level barriers: idle warps return early.
// QK_NORM is a template parameter so that the variant without q/k norms has no load through
// the (null) norm pointers at all: nvcc was seen to issue those loads ahead of a runtime check.
// x as a cache of KV holds it: rounded to T, then (an FP8 cache) to E4M3, nearest even,
// saturating.
template <typename T, typename KV>
__device__ __forceinline__ KV to_cache(float x) {
  if constexpr (std::is_same_v<KV, T>) {
    return dev::from_float<T>(x);
  } else {
    return dev::from_float<KV>(dev::round_to<T>(x));
  }
}

// KV is the cache's element type: T, or __nv_fp8_e4m3 for an FP8 cache.
template <typename T, typename KV, int P, bool QK_NORM>
__global__ void __launch_bounds__(kRopeWarps * 32) rope_and_cache_kernel(RopeCacheArgs a) {
  dev::pdl_wait();
  dev::pdl_launch_dependents();
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int64_t head =
      static_cast<int64_t>(blockIdx.y) * kRopeWarps + (static_cast<int>(threadIdx.x) >> 5);
  if (head >= a.num_heads + a.num_kv_heads) return;
  const bool is_q = head < a.num_heads;
  const int64_t kvh = head - a.num_heads;  // valid when !is_q
  const int64_t hd = a.head_dim;
  const int64_t half = hd / 2;
  const int64_t row_elems = (a.num_heads + 2 * a.num_kv_heads) * hd;
  const int64_t num_slots = a.num_blocks * a.block_size;
  const T* qkv = static_cast<const T*>(a.qkv);
  const T* norm_w = static_cast<const T*>(is_q ? a.q_norm : a.k_norm);

  for (int64_t t = blockIdx.x; t < a.num_tokens; t += gridDim.x) {
    const int64_t pos = a.positions[t];
    if (pos < 0 || pos >= a.max_position) continue;  // a caller bug: never read past the table
    int64_t slot = -1;
    if (!is_q) {
      slot = a.slots[t];
      if (slot < 0 || slot >= num_slots) continue;  // -1: not stored (and k feeds nothing else)
    }
    const T* row = qkv + t * row_elems;
    const T* src = row + (is_q ? head : a.num_heads + kvh) * hd;

    float x1[P], x2[P];
#pragma unroll
    for (int p = 0; p < P; ++p) {
      const int64_t i = lane + 32 * p;
      x1[p] = i < half ? dev::to_float(src[i]) : 0.0f;
      x2[p] = i < half ? dev::to_float(src[i + half]) : 0.0f;
    }

    if constexpr (QK_NORM) {  // Qwen3 q_norm / k_norm: RMSNorm over the head, as rms_norm
      float ss = 0.0f;
#pragma unroll
      for (int p = 0; p < P; ++p) ss += x1[p] * x1[p] + x2[p] * x2[p];
      const float inv = rsqrtf(dev::warp_sum(ss) * (1.0f / static_cast<float>(hd)) + a.eps);
#pragma unroll
      for (int p = 0; p < P; ++p) {
        const int64_t i = lane + 32 * p;
        if (i < half) {
          x1[p] =
              dev::round_to<T>(dev::to_float(__ldg(norm_w + i)) * dev::round_to<T>(x1[p] * inv));
          x2[p] = dev::round_to<T>(dev::to_float(__ldg(norm_w + i + half)) *
                                   dev::round_to<T>(x2[p] * inv));
        }
      }
    }

    // q * cos + rotate_half(q) * sin in the dtype: cos/sin rounded, each product and sum rounded.
    T* q_dst = static_cast<T*>(a.q_out) + (t * a.num_heads + head) * hd;
    KV* k_dst = is_q ? nullptr : static_cast<KV*>(a.k_cache) + (slot * a.num_kv_heads + kvh) * hd;
    const float* cos_row = a.cos + pos * half;
    const float* sin_row = a.sin + pos * half;
#pragma unroll
    for (int p = 0; p < P; ++p) {
      const int64_t i = lane + 32 * p;
      if (i < half) {
        const float c = dev::round_to<T>(__ldg(cos_row + i));
        const float s = dev::round_to<T>(__ldg(sin_row + i));
        const float lo = dev::round_to<T>(x1[p] * c) + dev::round_to<T>(-x2[p] * s);
        const float hi = dev::round_to<T>(x2[p] * c) + dev::round_to<T>(x1[p] * s);
        if (is_q) {
          q_dst[i] = dev::from_float<T>(lo);
          q_dst[i + half] = dev::from_float<T>(hi);
        } else {
          k_dst[i] = to_cache<T, KV>(lo);
          k_dst[i + half] = to_cache<T, KV>(hi);
        }
      }
    }

    if (!is_q) {  // v: stored as projected (no norm, no rotation)
      const T* v_src = row + (a.num_heads + a.num_kv_heads + kvh) * hd;
      KV* v_dst = static_cast<KV*>(a.v_cache) + (slot * a.num_kv_heads + kvh) * hd;
      for (int64_t i = lane; i < hd; i += 32) {
        if constexpr (std::is_same_v<KV, T>) {
          v_dst[i] = v_src[i];  // bit for bit
        } else {
          v_dst[i] = to_cache<T, KV>(dev::to_float(v_src[i]));
        }
      }
    }
  }
}

template <typename T, int P>
void launch_rope_variant(const RopeCacheArgs& a, dim3 grid, int threads, cudaStream_t stream) {
  const bool fp8 = a.kv_cache_dtype == KvCacheDtype::kFp8E4M3;
  if (a.q_norm != nullptr) {
    if (fp8) {
      launch_pdl(rope_and_cache_kernel<T, __nv_fp8_e4m3, P, true>, grid, threads, 0, stream, a);
    } else {
      launch_pdl(rope_and_cache_kernel<T, T, P, true>, grid, threads, 0, stream, a);
    }
  } else if (fp8) {
    launch_pdl(rope_and_cache_kernel<T, __nv_fp8_e4m3, P, false>, grid, threads, 0, stream, a);
  } else {
    launch_pdl(rope_and_cache_kernel<T, T, P, false>, grid, threads, 0, stream, a);
  }
}

template <typename T>
Status launch_rope_and_cache(const RopeCacheArgs& a, cudaStream_t stream) {
  const int64_t half = a.head_dim / 2;
  const int64_t tasks = a.num_heads + a.num_kv_heads;
  const dim3 grid(static_cast<unsigned>(std::min(a.num_tokens, kMaxGridX)),
                  static_cast<unsigned>(ceil_div(tasks, kRopeWarps)));
  const int threads = kRopeWarps * 32;
  if (half <= 32) {
    launch_rope_variant<T, 1>(a, grid, threads, stream);
  } else if (half <= 64) {
    launch_rope_variant<T, 2>(a, grid, threads, stream);
  } else if (half <= 128) {
    launch_rope_variant<T, 4>(a, grid, threads, stream);
  } else if (half <= 256) {
    launch_rope_variant<T, 8>(a, grid, threads, stream);
  } else {
    launch_rope_variant<T, 16>(a, grid, threads, stream);
  }
  return launch_status("rope_and_cache_kernel");
}

// ---- silu_mul ----

// Grid: x covers a row's columns (8-element vectors on the fast path), y strides over rows.
template <typename T>
__global__ void silu_mul_vec_kernel(const T* __restrict__ gate_up, int64_t rows, int64_t inter,
                                    T* __restrict__ out) {
  dev::pdl_wait();
  dev::pdl_launch_dependents();
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= inter / kHalfVec) return;
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    const T* g_ptr = gate_up + r * 2 * inter + c * kHalfVec;
    float g[kHalfVec], u[kHalfVec], o[kHalfVec];
    dev::load8_ro(g_ptr, g);
    dev::load8_ro(g_ptr + inter, u);
#pragma unroll
    for (int e = 0; e < kHalfVec; ++e) {
      const float sg = dev::round_to<T>(g[e] / (1.0f + expf(-g[e])));
      o[e] = sg * u[e];
    }
    dev::store8(out + r * inter + c * kHalfVec, o);
  }
}

template <typename T>
__global__ void silu_mul_any_kernel(const T* __restrict__ gate_up, int64_t rows, int64_t inter,
                                    T* __restrict__ out) {
  dev::pdl_wait();
  dev::pdl_launch_dependents();
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= inter) return;
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    const float g = dev::to_float(__ldg(gate_up + r * 2 * inter + c));
    const float u = dev::to_float(__ldg(gate_up + r * 2 * inter + inter + c));
    const float sg = dev::round_to<T>(g / (1.0f + expf(-g)));
    out[r * inter + c] = dev::from_float<T>(sg * u);
  }
}

template <typename T>
Status launch_silu_mul(const void* gate_upv, int64_t rows, int64_t inter, void* outv,
                       cudaStream_t stream) {
  constexpr int kThreads = 128;
  const T* gate_up = static_cast<const T*>(gate_upv);
  T* out = static_cast<T*>(outv);
  const unsigned grid_y = static_cast<unsigned>(std::min(rows, kMaxGridY));
  if (inter % kHalfVec == 0 && aligned(gate_up, 16) && aligned(out, 16)) {
    const dim3 grid(static_cast<unsigned>(ceil_div(inter / kHalfVec, kThreads)), grid_y);
    launch_pdl(silu_mul_vec_kernel<T>, grid, kThreads, 0, stream, gate_up, rows, inter, out);
    return launch_status("silu_mul_vec_kernel");
  }
  const dim3 grid(static_cast<unsigned>(ceil_div(inter, kThreads)), grid_y);
  launch_pdl(silu_mul_any_kernel<T>, grid, kThreads, 0, stream, gate_up, rows, inter, out);
  return launch_status("silu_mul_any_kernel");
}

// ---- convert ----

template <typename From, typename To>
__global__ void convert_kernel(const From* __restrict__ src, To* __restrict__ dst, int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    dst[i] = dev::from_float<To>(dev::to_float(src[i]));
  }
}

// ---- vocabulary-parallel embedding, residual add ----

template <typename T>
__global__ void embedding_shard_kernel(const int32_t* __restrict__ ids, int64_t num_tokens,
                                       const T* __restrict__ table, int64_t first_id, int64_t rows,
                                       int64_t hidden, T* __restrict__ out) {
  dev::pdl_wait();
  dev::pdl_launch_dependents();
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= hidden) return;
  for (int64_t t = blockIdx.y; t < num_tokens; t += gridDim.y) {
    const int64_t r = static_cast<int64_t>(ids[t]) - first_id;
    out[t * hidden + c] = (r >= 0 && r < rows) ? table[r * hidden + c] : dev::from_float<T>(0.0f);
  }
}

template <typename T>
__global__ void add_residual_kernel(const T* __restrict__ x, T* __restrict__ residual, int64_t n) {
  dev::pdl_wait();
  dev::pdl_launch_dependents();
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    residual[i] = dev::from_float<T>(dev::to_float(residual[i]) + dev::to_float(x[i]));
  }
}

}  // namespace

Status embedding(DType dtype, const int32_t* ids, int64_t num_tokens, const void* table,
                 int64_t vocab, int64_t hidden, void* out, cudaStream_t stream) {
  constexpr const char* kOp = "embedding";
  TESSERA_RETURN_IF_ERROR(check_copy_dtype(dtype, kOp));
  TESSERA_RETURN_IF_ERROR(check_non_negative(num_tokens, kOp, "num_tokens"));
  TESSERA_RETURN_IF_ERROR(check_positive(vocab, kOp, "vocab"));
  TESSERA_RETURN_IF_ERROR(check_positive(hidden, kOp, "hidden"));
  if (num_tokens == 0) return Status::ok();
  TESSERA_RETURN_IF_ERROR(check_not_null(ids, kOp, "ids"));
  TESSERA_RETURN_IF_ERROR(check_not_null(table, kOp, "table"));
  TESSERA_RETURN_IF_ERROR(check_not_null(out, kOp, "out"));
  return copy_rows(dtype, table, vocab, ids, num_tokens, hidden, out, stream,
                   "embedding (copy_rows_kernel)");
}

Status embedding_shard(DType dtype, const int32_t* ids, int64_t num_tokens, const void* table,
                       int64_t first_id, int64_t rows, int64_t hidden, void* out,
                       cudaStream_t stream) {
  constexpr const char* kOp = "embedding_shard";
  TESSERA_RETURN_IF_ERROR(check_half_dtype(dtype, kOp));
  TESSERA_RETURN_IF_ERROR(check_non_negative(num_tokens, kOp, "num_tokens"));
  TESSERA_RETURN_IF_ERROR(check_non_negative(rows, kOp, "rows"));
  TESSERA_RETURN_IF_ERROR(check_positive(hidden, kOp, "hidden"));
  if (num_tokens == 0) return Status::ok();
  TESSERA_RETURN_IF_ERROR(check_not_null(ids, kOp, "ids"));
  TESSERA_RETURN_IF_ERROR(check_not_null(out, kOp, "out"));
  if (rows > 0) TESSERA_RETURN_IF_ERROR(check_not_null(table, kOp, "table"));
  return with_half_type(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    constexpr int kThreads = 128;
    const dim3 grid(static_cast<unsigned>(ceil_div(hidden, kThreads)),
                    static_cast<unsigned>(std::min(num_tokens, kMaxGridY)));
    launch_pdl(embedding_shard_kernel<T>, grid, kThreads, 0, stream, ids, num_tokens,
               static_cast<const T*>(table), first_id, rows, hidden, static_cast<T*>(out));
    return launch_status("embedding_shard_kernel");
  });
}

Status add_residual(DType dtype, const void* x, void* residual, int64_t n, cudaStream_t stream) {
  constexpr const char* kOp = "add_residual";
  TESSERA_RETURN_IF_ERROR(check_half_dtype(dtype, kOp));
  TESSERA_RETURN_IF_ERROR(check_non_negative(n, kOp, "n"));
  if (n == 0) return Status::ok();
  TESSERA_RETURN_IF_ERROR(check_not_null(x, kOp, "x"));
  TESSERA_RETURN_IF_ERROR(check_not_null(residual, kOp, "residual"));
  return with_half_type(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    constexpr int kThreads = 256;
    const int64_t blocks = std::min<int64_t>(ceil_div(n, kThreads), 65536);
    launch_pdl(add_residual_kernel<T>, dim3(static_cast<unsigned>(blocks)), kThreads, 0, stream,
               static_cast<const T*>(x), static_cast<T*>(residual), n);
    return launch_status("add_residual_kernel");
  });
}

Status gather_rows(DType dtype, const void* src, int64_t src_rows, const int32_t* rows,
                   int64_t num_rows, int64_t width, void* dst, cudaStream_t stream) {
  constexpr const char* kOp = "gather_rows";
  TESSERA_RETURN_IF_ERROR(check_copy_dtype(dtype, kOp));
  TESSERA_RETURN_IF_ERROR(check_non_negative(num_rows, kOp, "num_rows"));
  TESSERA_RETURN_IF_ERROR(check_positive(src_rows, kOp, "src_rows"));
  TESSERA_RETURN_IF_ERROR(check_positive(width, kOp, "width"));
  if (num_rows == 0) return Status::ok();
  TESSERA_RETURN_IF_ERROR(check_not_null(src, kOp, "src"));
  TESSERA_RETURN_IF_ERROR(check_not_null(rows, kOp, "rows"));
  TESSERA_RETURN_IF_ERROR(check_not_null(dst, kOp, "dst"));
  return copy_rows(dtype, src, src_rows, rows, num_rows, width, dst, stream,
                   "gather_rows (copy_rows_kernel)");
}

Status rms_norm(DType dtype, const void* x, const void* weight, int64_t rows, int64_t hidden,
                float eps, void* out, cudaStream_t stream) {
  TESSERA_RETURN_IF_ERROR(check_norm_args(dtype, x, weight, rows, hidden, out, "rms_norm"));
  if (rows == 0) return Status::ok();
  return with_half_type(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    return launch_norm<T, false>(x, nullptr, weight, rows, hidden, eps, out, stream,
                                 "rms_norm_kernel");
  });
}

Status add_rms_norm(DType dtype, const void* x, void* residual, const void* weight, int64_t rows,
                    int64_t hidden, float eps, void* out, cudaStream_t stream) {
  constexpr const char* kOp = "add_rms_norm";
  TESSERA_RETURN_IF_ERROR(check_norm_args(dtype, x, weight, rows, hidden, out, kOp));
  if (rows == 0) return Status::ok();
  TESSERA_RETURN_IF_ERROR(check_not_null(residual, kOp, "residual"));
  if (residual == x || residual == out) {
    return invalid_argument("add_rms_norm: residual must not alias x or out");
  }
  return with_half_type(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    return launch_norm<T, true>(x, residual, weight, rows, hidden, eps, out, stream,
                                "add_rms_norm_kernel");
  });
}

Status rope_and_cache(const RopeCacheArgs& a, cudaStream_t stream) {
  constexpr const char* kOp = "rope_and_cache";
  TESSERA_RETURN_IF_ERROR(check_half_dtype(a.dtype, kOp));
  TESSERA_RETURN_IF_ERROR(check_non_negative(a.num_tokens, kOp, "num_tokens"));
  TESSERA_RETURN_IF_ERROR(check_positive(a.num_heads, kOp, "num_heads"));
  TESSERA_RETURN_IF_ERROR(check_positive(a.num_kv_heads, kOp, "num_kv_heads"));
  TESSERA_RETURN_IF_ERROR(check_positive(a.head_dim, kOp, "head_dim"));
  if (a.head_dim % 2 != 0 || a.head_dim > 1024) {
    return invalid_argument("rope_and_cache: head_dim must be even and <= 1024, got " +
                            std::to_string(a.head_dim));
  }
  if (ceil_div(a.num_heads + a.num_kv_heads, kRopeWarps) > kMaxGridY) {
    return invalid_argument("rope_and_cache: num_heads + num_kv_heads = " +
                            std::to_string(a.num_heads + a.num_kv_heads) + " is too large");
  }
  TESSERA_RETURN_IF_ERROR(check_positive(a.max_position, kOp, "max_position"));
  TESSERA_RETURN_IF_ERROR(check_positive(a.num_blocks, kOp, "num_blocks"));
  TESSERA_RETURN_IF_ERROR(check_positive(a.block_size, kOp, "block_size"));
  if ((a.q_norm == nullptr) != (a.k_norm == nullptr)) {
    return invalid_argument("rope_and_cache: q_norm and k_norm must be both set or both null");
  }
  if (!(a.eps >= 0.0f)) {
    return invalid_argument("rope_and_cache: eps must be >= 0, got " + std::to_string(a.eps));
  }
  if (a.num_tokens == 0) return Status::ok();
  TESSERA_RETURN_IF_ERROR(check_not_null(a.qkv, kOp, "qkv"));
  TESSERA_RETURN_IF_ERROR(check_not_null(a.cos, kOp, "cos"));
  TESSERA_RETURN_IF_ERROR(check_not_null(a.sin, kOp, "sin"));
  TESSERA_RETURN_IF_ERROR(check_not_null(a.positions, kOp, "positions"));
  TESSERA_RETURN_IF_ERROR(check_not_null(a.slots, kOp, "slots"));
  TESSERA_RETURN_IF_ERROR(check_not_null(a.q_out, kOp, "q_out"));
  TESSERA_RETURN_IF_ERROR(check_not_null(a.k_cache, kOp, "k_cache"));
  TESSERA_RETURN_IF_ERROR(check_not_null(a.v_cache, kOp, "v_cache"));
  return with_half_type(a.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    return launch_rope_and_cache<T>(a, stream);
  });
}

Status silu_mul(DType dtype, const void* gate_up, int64_t rows, int64_t inter, void* out,
                cudaStream_t stream) {
  constexpr const char* kOp = "silu_mul";
  TESSERA_RETURN_IF_ERROR(check_half_dtype(dtype, kOp));
  TESSERA_RETURN_IF_ERROR(check_non_negative(rows, kOp, "rows"));
  TESSERA_RETURN_IF_ERROR(check_positive(inter, kOp, "inter"));
  if (rows == 0) return Status::ok();
  TESSERA_RETURN_IF_ERROR(check_not_null(gate_up, kOp, "gate_up"));
  TESSERA_RETURN_IF_ERROR(check_not_null(out, kOp, "out"));
  return with_half_type(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    return launch_silu_mul<T>(gate_up, rows, inter, out, stream);
  });
}

Status convert(DType from, const void* src, DType to, void* dst, int64_t n, cudaStream_t stream) {
  constexpr const char* kOp = "convert";
  TESSERA_RETURN_IF_ERROR(check_copy_dtype(from, kOp));
  TESSERA_RETURN_IF_ERROR(check_copy_dtype(to, kOp));
  TESSERA_RETURN_IF_ERROR(check_non_negative(n, kOp, "n"));
  if (n == 0) return Status::ok();
  TESSERA_RETURN_IF_ERROR(check_not_null(src, kOp, "src"));
  TESSERA_RETURN_IF_ERROR(check_not_null(dst, kOp, "dst"));
  constexpr int kThreads = 256;
  const unsigned grid = static_cast<unsigned>(std::min<int64_t>(ceil_div(n, kThreads), 8192));
  return with_type(from, [&](auto from_tag) {
    using From = typename decltype(from_tag)::type;
    return with_type(to, [&](auto to_tag) {
      using To = typename decltype(to_tag)::type;
      convert_kernel<From, To>
          <<<grid, kThreads, 0, stream>>>(static_cast<const From*>(src), static_cast<To*>(dst), n);
      return launch_status("convert_kernel");
    });
  });
}

}  // namespace tessera::cuda
