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
#include "kernels/cuda/rms_norm.cuh"
#include "kernels/cuda/rope_math.cuh"

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

// Calls fn(TypeTag<T>{}) with T the 2-byte activation type behind `dtype` (validated before).
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

// Fast path: hidden % 8 == 0 and 16-byte aligned buffers: the row kernel of rms_norm.cuh (shared
// with rms_norm_fp8), storing the normed row in the dtype (its StoreRow policy, made from `out`).
using norm::rms_norm_vec_kernel;

// Any hidden size and alignment: scalar, two passes over the row (the second re-reads x or the
// rounded residual, which this thread itself wrote, from cache). Pass 2 reads element i and then
// writes out[i] in the same thread, and add's pass 2 does not read x, so x and out may alias.
template <typename T, bool kAdd, bool kUnitOffset>
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
      const float w = dev::to_float(__ldg(weight + i));
      if constexpr (kUnitOffset) {  // Gemma: (1 + w) * (h * inv) in fp32, rounded once
        out[base + i] = dev::from_float<T>((1.0f + w) * (h * inv));
      } else {
        out[base + i] = dev::from_float<T>(w * dev::round_to<T>(h * inv));
      }
    }
  }
}

template <typename T, bool kAdd, bool kUnitOffset, bool kNormX = false>
Status launch_norm(const void* xv, void* residualv, const void* weightv, int64_t rows,
                   int64_t hidden, float eps, void* outv, cudaStream_t stream, const char* name,
                   const void* x_weightv = nullptr) {
  const T* x_weight = static_cast<const T*>(x_weightv);
  const T* x = static_cast<const T*>(xv);
  T* residual = static_cast<T*>(residualv);
  const T* weight = static_cast<const T*>(weightv);
  T* out = static_cast<T*>(outv);
  const unsigned grid = static_cast<unsigned>(std::min(rows, kMaxGridX));
  const bool vec_ok = hidden % kHalfVec == 0 && aligned(x, 16) && aligned(weight, 16) &&
                      aligned(out, 16) && (!kAdd || aligned(residual, 16)) &&
                      (!kNormX || aligned(x_weight, 16));
  // V vectors per thread, at most 512 threads: hidden up to 512 * 8 * 8 = 32768 on this path.
  const norm::VecShape shape = vec_ok ? norm::vec_shape(hidden) : norm::VecShape{};
  const int v = shape.v;
  if (v == 0) {
    const int threads = static_cast<int>(std::min<int64_t>(256, ceil_div(hidden, 32) * 32));
    if constexpr (kNormX) {  // x normalised in place first (norm_add_rms_norm may overwrite x)
      launch_pdl(rms_norm_any_kernel<T, false, kUnitOffset>, grid, threads, 0, stream, x,
                 static_cast<T*>(nullptr), x_weight, rows, hidden, eps, const_cast<T*>(x));
    }
    launch_pdl(rms_norm_any_kernel<T, kAdd, kUnitOffset>, grid, threads, 0, stream, x, residual,
               weight, rows, hidden, eps, out);
    return launch_status(name);
  }
  const int threads = shape.threads;
  using Store = norm::StoreRow<T>;
  switch (v) {
    case 1:
      launch_pdl(rms_norm_vec_kernel<T, 1, kAdd, Store, kUnitOffset, kNormX>, grid, threads, 0,
                 stream, x, residual, weight, x_weight, rows, hidden, eps, out);
      break;
    case 2:
      launch_pdl(rms_norm_vec_kernel<T, 2, kAdd, Store, kUnitOffset, kNormX>, grid, threads, 0,
                 stream, x, residual, weight, x_weight, rows, hidden, eps, out);
      break;
    case 4:
      launch_pdl(rms_norm_vec_kernel<T, 4, kAdd, Store, kUnitOffset, kNormX>, grid, threads, 0,
                 stream, x, residual, weight, x_weight, rows, hidden, eps, out);
      break;
    default:
      launch_pdl(rms_norm_vec_kernel<T, 8, kAdd, Store, kUnitOffset, kNormX>, grid, threads, 0,
                 stream, x, residual, weight, x_weight, rows, hidden, eps, out);
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

// Copies a run of N consecutive elements of type E (between global memory and a thread's
// registers) as one access of N * sizeof(E) bytes, or as 16-byte pieces when that is more; both
// pointers must be aligned to min(N * sizeof(E), 16) bytes.
template <int N, typename E>
__device__ __forceinline__ void copy_run(E* dst, const E* src) {
  constexpr int kBytes = N * static_cast<int>(sizeof(E));
  if constexpr (kBytes >= 16) {
#pragma unroll
    for (int i = 0; i < kBytes / 16; ++i) {
      reinterpret_cast<uint4*>(dst)[i] = reinterpret_cast<const uint4*>(src)[i];
    }
  } else if constexpr (kBytes == 8) {
    *reinterpret_cast<uint2*>(dst) = *reinterpret_cast<const uint2*>(src);
  } else if constexpr (kBytes == 4) {
    *reinterpret_cast<unsigned*>(dst) = *reinterpret_cast<const unsigned*>(src);
  } else if constexpr (kBytes == 2) {
    *reinterpret_cast<unsigned short*>(dst) = *reinterpret_cast<const unsigned short*>(src);
  } else {
    static_assert(kBytes == 1, "runs are 1, 2, 4, 8 or a multiple of 16 bytes");
    dst[0] = src[0];
  }
}

// The same with a runtime choice: one vector access of all N when `vec` (the caller checked the
// alignment and that all N are there), else the first n <= N elements one at a time (the same
// values either way; the rest of dst is left as it was).
template <int N, typename E>
__device__ __forceinline__ void copy_elems(E* dst, const E* src, bool vec, int64_t n) {
  if (vec) {
    copy_run<N>(dst, src);
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) {
      if (i < n) dst[i] = src[i];
    }
  }
}

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

// Grid: x strides over groups of U tokens, y over groups of kRopeWarps "head tasks" (the
// num_heads q heads, then the num_kv_heads k heads; a k task also copies the matching v head).
// One warp per head: lane l holds the P consecutive rotation pairs (i, i + half) for
// i = l P + p, p < P (lanes with l P >= half hold none), read and written as runs of P elements
// (one vector access each when `vec`: half % P == 0 and aligned buffers), so the per-head RMSNorm
// is a warp shuffle sum. A warp loads all U tokens' rows before it computes any (U x the bytes in
// flight). H200, 4096 tokens at Llama-3-8B's shapes on random data: 57.4 us with one token per
// warp and element-wise accesses (i = l + 32 p), 40.6 us so in the same run (read through __ldg
// then; 41.5 us in a later run with the plain loads of copy_run). No block-level barriers: idle
// warps return early.
// QK_NORM is a template parameter so that the variant without q/k norms has no load through the
// (null) norm pointers at all: nvcc was seen to issue those loads ahead of a runtime check.
// KV is the cache's element type: T, or __nv_fp8_e4m3 for an FP8 cache.
template <typename T, typename KV, int P, bool QK_NORM, int U>
__global__ void __launch_bounds__(kRopeWarps * 32)
    rope_and_cache_kernel(RopeCacheArgs a, bool vec) {
  // The norm weights, the cos / sin tables and the tokens' positions and slots are not the
  // kernel before's (the model's constants and the host's step metadata): they are read before
  // the wait, qkv (the kernel before's output) after it, and everything is written after it.
  dev::pdl_launch_dependents();
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int64_t head =
      static_cast<int64_t>(blockIdx.y) * kRopeWarps + (static_cast<int>(threadIdx.x) >> 5);
  if (head >= a.num_heads + a.num_kv_heads) return;
  const bool is_q = head < a.num_heads;
  const int64_t kvh = head - a.num_heads;  // valid when !is_q
  const int64_t hd = a.head_dim;
  const int64_t half = hd / 2;
  const int64_t i0 = static_cast<int64_t>(lane) * P;  // this lane's first pair
  const bool holds = i0 < half;
  const int64_t n = holds ? std::min<int64_t>(P, half - i0) : 0;  // pairs this lane holds
  const int64_t row_elems = (a.num_heads + 2 * a.num_kv_heads) * hd;
  const int64_t num_slots = a.num_blocks * a.block_size;
  const T* qkv = static_cast<const T*>(a.qkv);

  float nw1[P] = {}, nw2[P] = {};  // the head norm's weights of this lane's pairs
  if constexpr (QK_NORM) {
    if (holds) {
      const T* norm_w = static_cast<const T*>(is_q ? a.constants.q_norm : a.constants.k_norm);
      alignas(16) T w1[P], w2[P];
      copy_elems<P>(w1, norm_w + i0, vec, n);
      copy_elems<P>(w2, norm_w + i0 + half, vec, n);
#pragma unroll
      for (int p = 0; p < P; ++p) {
        nw1[p] = dev::to_float(w1[p]);
        nw2[p] = dev::to_float(w2[p]);
      }
    }
  }

  bool waited = false;
  for (int64_t t0 = static_cast<int64_t>(blockIdx.x) * U; t0 < a.num_tokens;
       t0 += static_cast<int64_t>(gridDim.x) * U) {
    // Load: each of the U tokens' position, slot, cos and sin; then (after the wait, the first
    // time) its q or k pairs and (k tasks) the v run.
    bool ok[U];
    int64_t slot[U];
    alignas(16) T x1[U][P], x2[U][P], v[U][2 * P];
    alignas(16) float cs[U][P], sn[U][P];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t t = t0 + u;
      ok[u] = t < a.num_tokens;
      slot[u] = -1;
      if (!ok[u]) continue;
      const int64_t pos = a.positions[t];
      // pos out of range is a caller bug: never read past the table.
      ok[u] = pos >= 0 && pos < a.constants.max_position;
      if (!is_q) {
        slot[u] = a.slots[t];
        // -1: not stored (and k feeds nothing else)
        ok[u] = ok[u] && slot[u] >= 0 && slot[u] < num_slots;
      }
      if (!ok[u] || !holds) continue;
      copy_elems<P>(cs[u], a.constants.cos + pos * half + i0, vec, n);
      copy_elems<P>(sn[u], a.constants.sin + pos * half + i0, vec, n);
    }
    if (!waited) {
      dev::pdl_wait();
      waited = true;
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (!ok[u] || !holds) continue;
      const int64_t t = t0 + u;
      const T* row = qkv + t * row_elems;
      const T* src = row + (is_q ? head : a.num_heads + kvh) * hd;
      copy_elems<P>(x1[u], src + i0, vec, n);
      copy_elems<P>(x2[u], src + i0 + half, vec, n);
      if (!is_q) {
        copy_elems<2 * P>(v[u], row + (a.num_heads + a.num_kv_heads + kvh) * hd + 2 * i0, vec,
                          2 * n);
      }
    }

#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (!ok[u]) continue;
      const int64_t t = t0 + u;
      float f1[P], f2[P];
#pragma unroll
      for (int p = 0; p < P; ++p) {
        const bool in = p < n;
        f1[p] = in ? dev::to_float(x1[u][p]) : 0.0f;
        f2[p] = in ? dev::to_float(x2[u][p]) : 0.0f;
      }

      if constexpr (QK_NORM) {  // Qwen3 q_norm / k_norm: RMSNorm over the head, as rms_norm
        rope::head_norm<T, P>(f1, f2, nw1, nw2, hd, a.constants.eps, a.constants.norm_unit_offset);
      }
      if (!holds) continue;

      float lo[P], hi[P];
      rope::rotate<T, P>(f1, f2, cs[u], sn[u], lo, hi);
      if (is_q) {
        alignas(16) T q1[P], q2[P];
#pragma unroll
        for (int p = 0; p < P; ++p) {
          q1[p] = dev::from_float<T>(lo[p]);
          q2[p] = dev::from_float<T>(hi[p]);
        }
        T* q_dst = static_cast<T*>(a.q_out) + (t * a.num_heads + head) * hd + i0;
        copy_elems<P>(q_dst, q1, vec, n);
        copy_elems<P>(q_dst + half, q2, vec, n);
      } else {
        alignas(16) KV k1[P], k2[P], vv[2 * P];
#pragma unroll
        for (int p = 0; p < P; ++p) {
          k1[p] = to_cache<T, KV>(lo[p]);
          k2[p] = to_cache<T, KV>(hi[p]);
        }
#pragma unroll
        for (int p = 0; p < 2 * P; ++p) {  // v: stored as projected (no norm, no rotation)
          if constexpr (std::is_same_v<KV, T>) {
            vv[p] = v[u][p];  // bit for bit
          } else {
            vv[p] = to_cache<T, KV>(dev::to_float(v[u][p]));
          }
        }
        const int64_t base = (slot[u] * a.num_kv_heads + kvh) * hd;
        KV* k_dst = static_cast<KV*>(a.k_cache) + base + i0;
        copy_elems<P>(k_dst, k1, vec, n);
        copy_elems<P>(k_dst + half, k2, vec, n);
        copy_elems<2 * P>(static_cast<KV*>(a.v_cache) + base + 2 * i0, vv, vec, 2 * n);
      }
    }
  }
}

// Tokens per warp iteration: two where a lane's registers allow.
template <int P>
constexpr int kRopeTokens = P <= 4 ? 2 : 1;

template <typename T, int P>
void launch_rope_variant(const RopeCacheArgs& a, dim3 grid, int threads, bool vec,
                         cudaStream_t stream) {
  constexpr int U = kRopeTokens<P>;
  const bool fp8 = a.kv_cache_dtype == KvCacheDtype::kFp8E4M3;
  if (a.constants.q_norm != nullptr) {
    if (fp8) {
      launch_pdl(rope_and_cache_kernel<T, __nv_fp8_e4m3, P, true, U>, grid, threads, 0, stream, a,
                 vec);
    } else {
      launch_pdl(rope_and_cache_kernel<T, T, P, true, U>, grid, threads, 0, stream, a, vec);
    }
  } else if (fp8) {
    launch_pdl(rope_and_cache_kernel<T, __nv_fp8_e4m3, P, false, U>, grid, threads, 0, stream, a,
               vec);
  } else {
    launch_pdl(rope_and_cache_kernel<T, T, P, false, U>, grid, threads, 0, stream, a, vec);
  }
}

template <typename T, int P>
Status launch_rope_p(const RopeCacheArgs& a, cudaStream_t stream) {
  const int64_t half = a.head_dim / 2;
  const int64_t tasks = a.num_heads + a.num_kv_heads;
  const dim3 grid(
      static_cast<unsigned>(std::min(ceil_div(a.num_tokens, kRopeTokens<P>), kMaxGridX)),
      static_cast<unsigned>(ceil_div(tasks, kRopeWarps)));
  // Vector accesses: every run starts at a multiple of P elements (half % P == 0), from buffers
  // aligned to 16 bytes (every run is at most 16 bytes or a multiple of 16).
  bool vec = half % P == 0;
  for (const void* p :
       {a.qkv, a.constants.q_norm, a.constants.k_norm, static_cast<const void*>(a.constants.cos),
        static_cast<const void*>(a.constants.sin), static_cast<const void*>(a.q_out),
        static_cast<const void*>(a.k_cache), static_cast<const void*>(a.v_cache)}) {
    vec = vec && aligned(p, 16);
  }
  launch_rope_variant<T, P>(a, grid, kRopeWarps * 32, vec, stream);
  return launch_status("rope_and_cache_kernel");
}

// Partial rotary embeddings (Phi-3's partial_rotary_factor < 1, as transformers' Phi3Attention:
// the first rotary_dim dimensions of a head rotate with rotate_half over rotary_dim, the rest
// pass through as projected). One block per (token group, head task), a thread per element of
// the head: not tuned (no released Phi-3 checkpoint rotates part of its heads; Phi-4-mini does).
// Same rounding as rope_and_cache_kernel: cos/sin rounded, each product and the sum rounded.
template <typename T, typename KV>
__global__ void __launch_bounds__(128) rope_partial_kernel(RopeCacheArgs a) {
  dev::pdl_wait();
  dev::pdl_launch_dependents();
  const int64_t head = blockIdx.y;
  const bool is_q = head < a.num_heads;
  const int64_t kvh = head - a.num_heads;
  const int64_t hd = a.head_dim, rot = a.rotary_dim, rh = a.rotary_dim / 2;
  const int64_t row_elems = (a.num_heads + 2 * a.num_kv_heads) * hd;
  const int64_t num_slots = a.num_blocks * a.block_size;
  const T* qkv = static_cast<const T*>(a.qkv);
  for (int64_t t = blockIdx.x; t < a.num_tokens; t += gridDim.x) {
    const int64_t pos = a.positions[t];
    if (pos < 0 || pos >= a.constants.max_position) continue;
    int64_t slot = -1;
    if (!is_q) {
      slot = a.slots[t];
      if (slot < 0 || slot >= num_slots) continue;
    }
    const T* row = qkv + t * row_elems;
    const T* src = row + (is_q ? head : a.num_heads + kvh) * hd;
    for (int64_t d = threadIdx.x; d < hd; d += blockDim.x) {
      float y;
      if (d < rot) {
        const int64_t i = d < rh ? d : d - rh;
        const float c = dev::round_to<T>(a.constants.cos[pos * rh + i]);
        const float s = dev::round_to<T>(a.constants.sin[pos * rh + i]);
        const float x = dev::to_float(src[d]);
        const float other = dev::to_float(src[d < rh ? d + rh : d - rh]);
        y = dev::round_to<T>(x * c) + dev::round_to<T>((d < rh ? -other : other) * s);
      } else {
        y = dev::to_float(src[d]);  // exact: a T widened
      }
      if (is_q) {
        static_cast<T*>(a.q_out)[(t * a.num_heads + head) * hd + d] = dev::from_float<T>(y);
      } else {
        const int64_t base = (slot * a.num_kv_heads + kvh) * hd;
        static_cast<KV*>(a.k_cache)[base + d] = to_cache<T, KV>(y);
        const T v = row[(a.num_heads + a.num_kv_heads + kvh) * hd + d];
        if constexpr (std::is_same_v<KV, T>) {
          static_cast<KV*>(a.v_cache)[base + d] = v;  // bit for bit
        } else {
          static_cast<KV*>(a.v_cache)[base + d] = to_cache<T, KV>(dev::to_float(v));
        }
      }
    }
  }
}

template <typename T>
Status launch_rope_partial(const RopeCacheArgs& a, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(std::min<int64_t>(a.num_tokens, 65536)),
                  static_cast<unsigned>(a.num_heads + a.num_kv_heads));
  if (a.kv_cache_dtype == KvCacheDtype::kFp8E4M3) {
    launch_pdl(rope_partial_kernel<T, __nv_fp8_e4m3>, grid, 128, 0, stream, a);
  } else {
    launch_pdl(rope_partial_kernel<T, T>, grid, 128, 0, stream, a);
  }
  return launch_status("rope_partial_kernel");
}

template <typename T>
Status launch_rope_and_cache(const RopeCacheArgs& a, cudaStream_t stream) {
  if (a.rotary_dim != 0 && a.rotary_dim != a.head_dim) return launch_rope_partial<T>(a, stream);
  const int64_t half = a.head_dim / 2;
  if (half <= 32) return launch_rope_p<T, 1>(a, stream);
  if (half <= 64) return launch_rope_p<T, 2>(a, stream);
  if (half <= 128) return launch_rope_p<T, 4>(a, stream);
  if (half <= 256) return launch_rope_p<T, 8>(a, stream);
  return launch_rope_p<T, 16>(a, stream);
}

// ---- silu_mul ----

// The gated MLP's activation of the gate: silu, or (Gemma's GeGLU, hidden_activation
// gelu_pytorch_tanh) torch's gelu(approximate="tanh") spelled as cpu::gelu_tanh_mul's
// 0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x^3))) in fp32.
template <bool kGelu>
__device__ __forceinline__ float gate_act(float x) {
  if constexpr (kGelu) {
    const float beta = 0.7978845608028654f;  // sqrt(2 / pi)
    const float inner = beta * (x + 0.044715f * (x * x * x));
    return 0.5f * x * (1.0f + tanhf(inner));
  } else {
    return x / (1.0f + expf(-x));
  }
}

// Grid: x covers a row's columns (8-element vectors on the fast path), y strides over rows.
template <typename T, bool kGelu>
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
      const float sg = dev::round_to<T>(gate_act<kGelu>(g[e]));
      o[e] = sg * u[e];
    }
    dev::store8(out + r * inter + c * kHalfVec, o);
  }
}

template <typename T, bool kGelu>
__global__ void silu_mul_any_kernel(const T* __restrict__ gate_up, int64_t rows, int64_t inter,
                                    T* __restrict__ out) {
  dev::pdl_wait();
  dev::pdl_launch_dependents();
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= inter) return;
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    const float g = dev::to_float(__ldg(gate_up + r * 2 * inter + c));
    const float u = dev::to_float(__ldg(gate_up + r * 2 * inter + inter + c));
    const float sg = dev::round_to<T>(gate_act<kGelu>(g));
    out[r * inter + c] = dev::from_float<T>(sg * u);
  }
}

template <typename T, bool kGelu>
Status launch_silu_mul(const void* gate_upv, int64_t rows, int64_t inter, void* outv,
                       cudaStream_t stream) {
  constexpr int kThreads = 128;
  const T* gate_up = static_cast<const T*>(gate_upv);
  T* out = static_cast<T*>(outv);
  const unsigned grid_y = static_cast<unsigned>(std::min(rows, kMaxGridY));
  if (inter % kHalfVec == 0 && aligned(gate_up, 16) && aligned(out, 16)) {
    const dim3 grid(static_cast<unsigned>(ceil_div(inter / kHalfVec, kThreads)), grid_y);
    launch_pdl(silu_mul_vec_kernel<T, kGelu>, grid, kThreads, 0, stream, gate_up, rows, inter, out);
    return launch_status("silu_mul_vec_kernel");
  }
  const dim3 grid(static_cast<unsigned>(ceil_div(inter, kThreads)), grid_y);
  launch_pdl(silu_mul_any_kernel<T, kGelu>, grid, kThreads, 0, stream, gate_up, rows, inter, out);
  return launch_status("silu_mul_any_kernel");
}

// ---- convert ----
//
// Device ports of common/tensor.h's conversions, line for line, on the bits of the float (a
// uint32_t) so that no floating-point instruction touches a value: CUDA's cvt instructions
// (__float2bfloat16_rn, __float2half_rn) agree on finite values but return a canonical NaN where
// the host keeps part of the payload (bf16) or writes 0x7e00 (fp16), and a float negation may
// rewrite a NaN. cuda_elementwise_test compares every 16-bit and 8-bit pattern and millions of
// fp32 patterns with the host functions, bit for bit.
namespace port {

// bf16_to_float
__device__ __forceinline__ uint32_t bf16_to_float(uint16_t h) {
  return static_cast<uint32_t>(h) << 16;
}

// float_to_bf16: round to nearest even; NaN keeps its top bits and gets the quiet bit.
__device__ __forceinline__ uint16_t float_to_bf16(uint32_t bits) {
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
  const uint32_t rounding = 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + rounding) >> 16);
}

// f16_to_float: subnormals normalised, inf and NaN (payload shifted up) kept.
__device__ __forceinline__ uint32_t f16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  if (exp == 0) {
    if (mant == 0) return sign;
    exp = 127 - 15 + 1;
    while ((mant & 0x400u) == 0) {
      mant <<= 1;
      --exp;
    }
    mant &= 0x3ffu;
    return sign | (exp << 23) | (mant << 13);
  }
  if (exp == 31) return sign | 0x7f800000u | (mant << 13);
  return sign | ((exp + 127 - 15) << 23) | (mant << 13);
}

// float_to_f16: round to nearest even, overflow to inf, subnormals rounded, NaN -> 0x7e00.
__device__ __forceinline__ uint16_t float_to_f16(uint32_t bits) {
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t abs = bits & 0x7fffffffu;
  if (abs > 0x7f800000u) return sign | 0x7e00u;
  if (abs >= 0x477ff000u) return sign | 0x7c00u;
  if (abs < 0x38800000u) {
    if (abs < 0x33000000u) return sign;
    const uint32_t exp = abs >> 23;
    const uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126 - exp;  // 14..24
    uint32_t half = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1);
    const uint32_t halfway = 1u << (shift - 1);
    if (rem > halfway || (rem == halfway && (half & 1u))) ++half;
    return sign | static_cast<uint16_t>(half);
  }
  uint32_t h = ((abs >> 13) - ((127 - 15) << 10));
  const uint32_t rem = abs & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;
  return sign | static_cast<uint16_t>(h);
}

// fp8_e4m3_to_float: exact; 0x7f / 0xff are the quiet NaN 0x7fc00000 with the sign bit (the host
// negates quiet_NaN(), which flips the sign bit).
__device__ __forceinline__ uint32_t fp8_e4m3_to_float(uint8_t v) {
  const uint32_t exp = (v >> 3) & 0xfu;
  const uint32_t man = v & 7u;
  uint32_t a;
  if (exp == 15 && man == 7) {
    a = 0x7fc00000u;
  } else if (exp == 0) {
    a = __float_as_uint(static_cast<float>(man) * 0x1p-9f);  // exact (ldexp(man, -9))
  } else {
    a = ((exp + 120u) << 23) | (man << 20);  // (8 + man) * 2^(exp - 10)
  }
  return (v & 0x80u) ? (a | 0x80000000u) : a;
}

}  // namespace port

// The stored element of each dtype convert takes, and its value as fp32 bits.
template <DType D>
struct Stored;
template <>
struct Stored<DType::kF32> {
  using type = uint32_t;
  __device__ static uint32_t decode(uint32_t x) { return x; }
  __device__ static uint32_t encode(uint32_t bits) { return bits; }
};
template <>
struct Stored<DType::kF16> {
  using type = uint16_t;
  __device__ static uint32_t decode(uint16_t x) { return port::f16_to_float(x); }
  __device__ static uint16_t encode(uint32_t bits) { return port::float_to_f16(bits); }
};
template <>
struct Stored<DType::kBF16> {
  using type = uint16_t;
  __device__ static uint32_t decode(uint16_t x) { return port::bf16_to_float(x); }
  __device__ static uint16_t encode(uint32_t bits) { return port::float_to_bf16(bits); }
};
template <>
struct Stored<DType::kF8E4M3> {
  using type = uint8_t;
  __device__ static uint32_t decode(uint8_t x) { return port::fp8_e4m3_to_float(x); }
};

// dst[i] = encode_To(decode_From(src[i])), grid-stride.
template <DType From, DType To>
__global__ void convert_kernel(const typename Stored<From>::type* __restrict__ src,
                               typename Stored<To>::type* __restrict__ dst, int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    dst[i] = Stored<To>::encode(Stored<From>::decode(src[i]));
  }
}

// 256 threads, one element per thread per pass, at most 8192 CTAs (grid-stride beyond).
template <DType From, DType To>
Status launch_convert(const void* src, void* dst, int64_t n, cudaStream_t stream) {
  constexpr int kThreads = 256;
  const unsigned grid = static_cast<unsigned>(std::min<int64_t>(ceil_div(n, kThreads), 8192));
  convert_kernel<From, To>
      <<<grid, kThreads, 0, stream>>>(static_cast<const typename Stored<From>::type*>(src),
                                      static_cast<typename Stored<To>::type*>(dst), n);
  return launch_status("convert_kernel");
}

template <DType From>
Status launch_convert_from(const void* src, DType to, void* dst, int64_t n, cudaStream_t stream) {
  switch (to) {
    case DType::kF32:
      return launch_convert<From, DType::kF32>(src, dst, n, stream);
    case DType::kF16:
      return launch_convert<From, DType::kF16>(src, dst, n, stream);
    case DType::kBF16:
      return launch_convert<From, DType::kBF16>(src, dst, n, stream);
    case DType::kI32:
    case DType::kF8E4M3:
      break;
  }
  return invalid_argument("convert: unsupported destination dtype " +
                          std::to_string(static_cast<int>(to)));
}

template <typename T>
__global__ void add_bias_kernel(T* __restrict__ out, const T* __restrict__ bias, int64_t rows,
                                int64_t cols) {
  const int64_t n = rows * cols;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    out[i] = dev::from_float<T>(dev::to_float(out[i]) + dev::to_float(bias[i % cols]));
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
                float eps, void* out, cudaStream_t stream, bool unit_offset) {
  TESSERA_RETURN_IF_ERROR(check_norm_args(dtype, x, weight, rows, hidden, out, "rms_norm"));
  if (rows == 0) return Status::ok();
  return with_half_type(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if (unit_offset) {
      return launch_norm<T, false, true>(x, nullptr, weight, rows, hidden, eps, out, stream,
                                         "rms_norm_kernel (unit offset)");
    }
    return launch_norm<T, false, false>(x, nullptr, weight, rows, hidden, eps, out, stream,
                                        "rms_norm_kernel");
  });
}

Status add_rms_norm(DType dtype, const void* x, void* residual, const void* weight, int64_t rows,
                    int64_t hidden, float eps, void* out, cudaStream_t stream, bool unit_offset) {
  constexpr const char* kOp = "add_rms_norm";
  TESSERA_RETURN_IF_ERROR(check_norm_args(dtype, x, weight, rows, hidden, out, kOp));
  if (rows == 0) return Status::ok();
  TESSERA_RETURN_IF_ERROR(check_not_null(residual, kOp, "residual"));
  if (residual == x || residual == out) {
    return invalid_argument("add_rms_norm: residual must not alias x or out");
  }
  return with_half_type(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if (unit_offset) {
      return launch_norm<T, true, true>(x, residual, weight, rows, hidden, eps, out, stream,
                                        "add_rms_norm_kernel (unit offset)");
    }
    return launch_norm<T, true, false>(x, residual, weight, rows, hidden, eps, out, stream,
                                       "add_rms_norm_kernel");
  });
}

Status norm_add_rms_norm(DType dtype, void* x, const void* x_weight, void* residual,
                         const void* weight, int64_t rows, int64_t hidden, float eps, void* out,
                         cudaStream_t stream, bool unit_offset) {
  constexpr const char* kOp = "norm_add_rms_norm";
  TESSERA_RETURN_IF_ERROR(check_norm_args(dtype, x, weight, rows, hidden, out, kOp));
  if (rows == 0) return Status::ok();
  TESSERA_RETURN_IF_ERROR(check_not_null(residual, kOp, "residual"));
  TESSERA_RETURN_IF_ERROR(check_not_null(x_weight, kOp, "x_weight"));
  if (residual == x || residual == out || x == out) {
    return invalid_argument("norm_add_rms_norm: x, residual and out must be three buffers");
  }
  return with_half_type(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if (unit_offset) {
      return launch_norm<T, true, true, true>(x, residual, weight, rows, hidden, eps, out, stream,
                                              "norm_add_rms_norm_kernel (unit offset)", x_weight);
    }
    return launch_norm<T, true, false, true>(x, residual, weight, rows, hidden, eps, out, stream,
                                             "norm_add_rms_norm_kernel", x_weight);
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
  TESSERA_RETURN_IF_ERROR(check_positive(a.constants.max_position, kOp, "max_position"));
  TESSERA_RETURN_IF_ERROR(check_positive(a.num_blocks, kOp, "num_blocks"));
  TESSERA_RETURN_IF_ERROR(check_positive(a.block_size, kOp, "block_size"));
  if ((a.constants.q_norm == nullptr) != (a.constants.k_norm == nullptr)) {
    return invalid_argument("rope_and_cache: q_norm and k_norm must be both set or both null");
  }
  if (a.rotary_dim != 0 && a.rotary_dim != a.head_dim) {
    if (a.rotary_dim < 0 || a.rotary_dim % 2 != 0 || a.rotary_dim > a.head_dim) {
      return invalid_argument("rope_and_cache: rotary_dim must be 0 or even in (0, head_dim = " +
                              std::to_string(a.head_dim) + "], got " +
                              std::to_string(a.rotary_dim));
    }
    if (a.constants.q_norm != nullptr) {
      return invalid_argument(
          "rope_and_cache: q/k norms with partial rotary embeddings are not implemented");
    }
  }
  if (!(a.constants.eps >= 0.0f)) {
    return invalid_argument("rope_and_cache: eps must be >= 0, got " +
                            std::to_string(a.constants.eps));
  }
  if (a.num_tokens == 0) return Status::ok();
  TESSERA_RETURN_IF_ERROR(check_not_null(a.qkv, kOp, "qkv"));
  TESSERA_RETURN_IF_ERROR(check_not_null(a.constants.cos, kOp, "cos"));
  TESSERA_RETURN_IF_ERROR(check_not_null(a.constants.sin, kOp, "sin"));
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

namespace {

template <bool kGelu>
Status gated_mul(const char* op, DType dtype, const void* gate_up, int64_t rows, int64_t inter,
                 void* out, cudaStream_t stream) {
  TESSERA_RETURN_IF_ERROR(check_half_dtype(dtype, op));
  TESSERA_RETURN_IF_ERROR(check_non_negative(rows, op, "rows"));
  TESSERA_RETURN_IF_ERROR(check_positive(inter, op, "inter"));
  if (rows == 0) return Status::ok();
  TESSERA_RETURN_IF_ERROR(check_not_null(gate_up, op, "gate_up"));
  TESSERA_RETURN_IF_ERROR(check_not_null(out, op, "out"));
  return with_half_type(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    return launch_silu_mul<T, kGelu>(gate_up, rows, inter, out, stream);
  });
}

}  // namespace

Status silu_mul(DType dtype, const void* gate_up, int64_t rows, int64_t inter, void* out,
                cudaStream_t stream) {
  return gated_mul<false>("silu_mul", dtype, gate_up, rows, inter, out, stream);
}

Status gelu_tanh_mul(DType dtype, const void* gate_up, int64_t rows, int64_t inter, void* out,
                     cudaStream_t stream) {
  return gated_mul<true>("gelu_tanh_mul", dtype, gate_up, rows, inter, out, stream);
}

// ---- Gemma's embedding scale and final logit soft-cap ----

namespace {

template <typename T>
__global__ void scale_kernel(T* __restrict__ x, int64_t n, float scale) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    x[i] = dev::from_float<T>(dev::to_float(x[i]) * scale);
  }
}

__global__ void softcap_kernel(float* __restrict__ x, int64_t n, float cap) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    x[i] = tanhf(x[i] / cap) * cap;
  }
}

unsigned flat_grid(int64_t n, int threads) {
  return static_cast<unsigned>(std::min<int64_t>(ceil_div(n, threads), 8192));
}

}  // namespace

Status scale_embedding(DType dtype, void* x, int64_t n, float scale, cudaStream_t stream) {
  constexpr const char* kOp = "scale_embedding";
  TESSERA_RETURN_IF_ERROR(check_half_dtype(dtype, kOp));
  TESSERA_RETURN_IF_ERROR(check_non_negative(n, kOp, "n"));
  if (n == 0) return Status::ok();
  TESSERA_RETURN_IF_ERROR(check_not_null(x, kOp, "x"));
  constexpr int kThreads = 256;
  return with_half_type(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    // The normalizer is a tensor of the activations' dtype in transformers: rounded first.
    const float s = dtype == DType::kBF16 ? bf16_to_float(float_to_bf16(scale))
                                          : f16_to_float(float_to_f16(scale));
    scale_kernel<T><<<flat_grid(n, kThreads), kThreads, 0, stream>>>(static_cast<T*>(x), n, s);
    return launch_status("scale_kernel");
  });
}

Status softcap_logits(float* logits, int64_t n, float cap, cudaStream_t stream) {
  constexpr const char* kOp = "softcap_logits";
  TESSERA_RETURN_IF_ERROR(check_non_negative(n, kOp, "n"));
  if (!(cap > 0.0f)) {
    return invalid_argument(std::string(kOp) + ": cap must be > 0, got " + std::to_string(cap));
  }
  if (n == 0) return Status::ok();
  TESSERA_RETURN_IF_ERROR(check_not_null(logits, kOp, "logits"));
  constexpr int kThreads = 256;
  softcap_kernel<<<flat_grid(n, kThreads), kThreads, 0, stream>>>(logits, n, cap);
  return launch_status("softcap_kernel");
}

namespace {
__global__ void spin_kernel(int64_t ns) {
  uint64_t t0 = 0, t = 0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  while (t - t0 < static_cast<uint64_t>(ns)) {  // spin(0) returns at once: no sleep
    __nanosleep(1000);
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  }
}
}  // namespace

Status spin(int64_t ns, cudaStream_t stream) {
  TESSERA_RETURN_IF_ERROR(check_non_negative(ns, "spin", "ns"));
  spin_kernel<<<1, 1, 0, stream>>>(ns);
  return launch_status("spin_kernel");
}

Status add_bias(DType dtype, void* out, const void* bias, int64_t rows, int64_t cols,
                cudaStream_t stream) {
  constexpr const char* kOp = "add_bias";
  TESSERA_RETURN_IF_ERROR(check_half_dtype(dtype, kOp));
  TESSERA_RETURN_IF_ERROR(check_non_negative(rows, kOp, "rows"));
  TESSERA_RETURN_IF_ERROR(check_positive(cols, kOp, "cols"));
  if (rows == 0) return Status::ok();
  TESSERA_RETURN_IF_ERROR(check_not_null(out, kOp, "out"));
  TESSERA_RETURN_IF_ERROR(check_not_null(bias, kOp, "bias"));
  constexpr int kThreads = 256;
  const unsigned grid =
      static_cast<unsigned>(std::min<int64_t>(ceil_div(rows * cols, kThreads), 8192));
  return with_half_type(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    add_bias_kernel<T><<<grid, kThreads, 0, stream>>>(static_cast<T*>(out),
                                                      static_cast<const T*>(bias), rows, cols);
    return launch_status("add_bias_kernel");
  });
}

namespace {

// ---- fill_uniform ----

template <typename T>
__global__ void fill_uniform_kernel(T* __restrict__ dst, int64_t n, uint64_t seed, float scale) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    uint64_t z = seed + static_cast<uint64_t>(i) + 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    const float u = static_cast<float>(z >> 40) * (2.0f / 16777216.0f) - 1.0f;
    dst[i] = dev::from_float<T>(scale * u);
  }
}

}  // namespace

Status fill_uniform(DType dtype, void* dst, int64_t n, uint64_t seed, float scale,
                    cudaStream_t stream) {
  constexpr const char* kOp = "fill_uniform";
  TESSERA_RETURN_IF_ERROR(check_copy_dtype(dtype, kOp));
  TESSERA_RETURN_IF_ERROR(check_non_negative(n, kOp, "n"));
  if (n == 0) return Status::ok();
  TESSERA_RETURN_IF_ERROR(check_not_null(dst, kOp, "dst"));
  constexpr int kThreads = 256;
  const unsigned grid = static_cast<unsigned>(std::min<int64_t>(ceil_div(n, kThreads), 8192));
  switch (dtype) {
    case DType::kF32:
      fill_uniform_kernel<<<grid, kThreads, 0, stream>>>(static_cast<float*>(dst), n, seed, scale);
      break;
    case DType::kF16:
      fill_uniform_kernel<<<grid, kThreads, 0, stream>>>(static_cast<__half*>(dst), n, seed, scale);
      break;
    default:
      fill_uniform_kernel<<<grid, kThreads, 0, stream>>>(static_cast<__nv_bfloat16*>(dst), n, seed,
                                                         scale);
      break;
  }
  return launch_status("fill_uniform_kernel");
}

Status convert(DType from, const void* src, DType to, void* dst, int64_t n, cudaStream_t stream) {
  constexpr const char* kOp = "convert";
  if (from != DType::kF8E4M3) TESSERA_RETURN_IF_ERROR(check_copy_dtype(from, kOp));
  TESSERA_RETURN_IF_ERROR(check_copy_dtype(to, kOp));
  TESSERA_RETURN_IF_ERROR(check_non_negative(n, kOp, "n"));
  if (n == 0) return Status::ok();
  TESSERA_RETURN_IF_ERROR(check_not_null(src, kOp, "src"));
  TESSERA_RETURN_IF_ERROR(check_not_null(dst, kOp, "dst"));
  switch (from) {
    case DType::kF32:
      return launch_convert_from<DType::kF32>(src, to, dst, n, stream);
    case DType::kF16:
      return launch_convert_from<DType::kF16>(src, to, dst, n, stream);
    case DType::kBF16:
      return launch_convert_from<DType::kBF16>(src, to, dst, n, stream);
    case DType::kF8E4M3:
      return launch_convert_from<DType::kF8E4M3>(src, to, dst, n, stream);
    case DType::kI32:
      break;
  }
  return invalid_argument("convert: unsupported source dtype " +
                          std::to_string(static_cast<int>(from)));
}

}  // namespace tessera::cuda
