// Device helpers shared by the attention kernels (include from .cu files only): the PTX wrappers
// for shared-memory addresses, cp.async, ldmatrix and the m16n8k16 MMAs, exp2, and the paged
// cache's key -> slot division by a reciprocal (BlockDivisor, computed on the host).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>

#include "kernels/cuda/rope.h"

namespace tessera::cuda::attn {

// key / block_size == (key * magic) >> shift for every key < 2^31: a runtime integer division
// costs ~20 instructions per 16-byte K/V copy otherwise. Round-up reciprocal: l =
// ceil(log2(block_size)), magic = floor(2^(32 + l) / block_size) + 1 (33 bits); exact for keys
// below 2^31 since key * (magic * block_size - 2^(32 + l)) < 2^31 * 2^l.
struct BlockDivisor {
  uint64_t magic = 0;
  int shift = 0;
  static BlockDivisor make(int block_size) {
    int l = 0;
    while ((1 << l) < block_size) ++l;
    return {((uint64_t{1} << (32 + l)) / static_cast<uint64_t>(block_size)) + 1, 32 + l};
  }
  // key / block_size, for 0 <= key < 2^31.
  __device__ __forceinline__ int divide(int key) const {
    return static_cast<int>((static_cast<uint64_t>(static_cast<uint32_t>(key)) * magic) >> shift);
  }
};

// A launch's arguments as the kernels take them (paged_attention fills them from
// AttentionArgs).
struct Params {
  const void* q;
  void* out;
  const void* k_cache;
  const void* v_cache;
  const int32_t* cu_query_lens;
  const int32_t* context_lens;
  const int32_t* block_tables;
  int64_t block_table_stride;
  int block_size;
  BlockDivisor block_div;  // of block_size
  int num_heads;
  int num_kv_heads;
  int group;
  float scale_log2;  // scale * log2(e)
  // The logit soft-cap in the log2 domain: c * log2(e) and its inverse (both 0: off). A score
  // x = s * scale_log2 becomes softcap_log2 * tanh(x * inv_softcap_log2) = log2(e) * c tanh(s
  // scale / c).
  float softcap_log2;
  float inv_softcap_log2;
  int window;  // 0 = full causal; w > 0: the query at position p reads keys p - w + 1 ..= p
  // Split-K (the tile kernel; the Hopper kernel has none): see attention.cu.
  int num_splits;
  int split_size;
  float* ws_o;
  float* ws_lse;
  int64_t total_q;
  // AttentionRope (the ROPE instance only): the projection row's q, k, v; the layer's head
  // norms and rotation tables; the cache the step's k and v go to.
  const void* qkv;
  RopeConstants rope;
  void* k_store;
  void* v_store;
};

// The first key a query at `pos` reads (its window's start; 0 without a window).
__device__ __forceinline__ int window_start(const Params& p, int pos) {
  return p.window > 0 && pos >= p.window ? pos - p.window + 1 : 0;
}

// A scaled score in the log2 domain (x = q . k * scale * log2(e)) after the soft-cap, if any.
__device__ __forceinline__ float soft_cap_log2(const Params& p, float x) {
  return p.softcap_log2 > 0.0f ? p.softcap_log2 * tanhf(x * p.inv_softcap_log2) : x;
}

// The cache slot of `key` of a sequence whose block table is `table`.
__device__ __forceinline__ int64_t paged_slot(const Params& p, const int32_t* table, int key) {
  const int block = p.block_div.divide(key);
  return static_cast<int64_t>(table[block]) * p.block_size + (key - block * p.block_size);
}

// PTX wrappers.

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared; with fill == false nothing is read and the 16 bytes are zeroed.
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, bool fill) {
  const int src_bytes = fill ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(src_bytes)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

__device__ __forceinline__ float fast_exp2(float x) {  // exp2(-inf) = +0
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

template <typename T>
struct HalfOps;

template <>
struct HalfOps<__nv_bfloat16> {
  // c += a (16x16, row-major) * b (16x8, column-major), fp32 accumulate.
  static __device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                             uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  // lo goes to the low 16 bits (the lower column index).
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    uint32_t r;
    memcpy(&r, &v, sizeof(r));
    return r;
  }
};

template <>
struct HalfOps<__half> {
  static __device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                             uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    const __half2 v = __floats2half2_rn(lo, hi);
    uint32_t r;
    memcpy(&r, &v, sizeof(r));
    return r;
  }
};

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

}  // namespace tessera::cuda::attn
