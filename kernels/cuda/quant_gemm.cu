// The W4A16 kernels: the repacking of AWQ / GPTQ checkpoints, the fused decode kernel, and the
// dequantize kernel of the prefill path. quant_gemm.h states the contract and the repacked
// layout; the fused kernel's tiling, pipeline and split-K are described above the kernel.
#include "kernels/cuda/quant_gemm.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "kernels/cuda/cuda_util.h"
#include "kernels/cuda/device_math.cuh"

namespace tessera::cuda {

namespace {

constexpr int kTile = static_cast<int>(kW4Tile);  // outputs of a tile, inputs of a unit
constexpr int kUnitWords = kTile * kTile / 8;     // one (64 x 64) unit of int4 weights
constexpr int kUnitBytes = kUnitWords * 4;        // 2 KiB
constexpr int kThreads = 128;                     // 4 warps, 16 outputs of the tile each
constexpr int64_t kLockBytes = 32 << 10;          // split-K counters at the workspace's start
constexpr int64_t kMaxTiles = kLockBytes / 4;     // one int32 counter per 64-output tile
constexpr int64_t kMaxFusedCtas = 1024;           // the partial-sum slots are sized for this
// A tile's 64-input units are spread over at most this many CTAs: fewer partial sums for the
// last CTA of a tile to add (a short layer does not get 2 units per CTA).
constexpr int64_t kMaxSplits = 16;
constexpr uint64_t kAlign = 256;
constexpr int kMaxDevices = 64;

uint64_t align_up(uint64_t v) { return (v + kAlign - 1) / kAlign * kAlign; }
int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
bool aligned(const void* p, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

// ---- the repacked layer's regions in its w4_bytes buffer

struct Regions {
  uint64_t scales = 0, zeros = 0, perm = 0, total = 0;
};
Regions regions(int64_t out, int64_t in, int64_t group) {
  const uint64_t groups = static_cast<uint64_t>(in / group);
  Regions r;
  r.scales = align_up(static_cast<uint64_t>(out * in / 2));
  r.zeros = r.scales + align_up(groups * static_cast<uint64_t>(out) * 2);
  r.perm = r.zeros + align_up(groups * static_cast<uint64_t>(out));
  r.total = r.perm + align_up(static_cast<uint64_t>(in) * 4);
  return r;
}

// ---- PTX wrappers

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
// 16 bytes global -> shared, bypassing L1 (the weights are read once).
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
__device__ __forceinline__ void sts128_zero(uint32_t addr) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(addr), "r"(0u) : "memory");
}
// ldmatrix.x4: lanes 8j..8j+7 give the row addresses of 8x8 matrix j; register j of lane l
// receives row l / 4, columns 2 (l % 4) and 2 (l % 4) + 1 of it.
__device__ __forceinline__ void ldmatrix_x4(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
// (a & b) | c in one instruction.
__device__ __forceinline__ uint32_t and_or(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;\n" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}

// ---- the run dtype's packed pair arithmetic and MMA
//
// Int4 -> 16-bit without a conversion instruction: a nibble n OR-ed into the low mantissa bits
// of kMagic (1024.0 for fp16, 128.0 for bf16: the mantissa's last bit weighs 1) is the number
// kMagic + n. Subtracting kMagic + z (same binade) gives n - z in [-16, 15] exactly; one multiply
// by the scale then rounds once: w = round((n - z) * s). Explicit .rn keeps ptxas from fusing.
template <typename T>
struct W4Ops;

template <>
struct W4Ops<__half> {
  static constexpr uint32_t kMagic = 0x6400;  // 1024.0
  static __device__ __forceinline__ uint32_t sub2(uint32_t a, uint32_t b) {
    uint32_t d;
    asm("sub.rn.f16x2 %0, %1, %2;\n" : "=r"(d) : "r"(a), "r"(b));
    return d;
  }
  static __device__ __forceinline__ uint32_t mul2(uint32_t a, uint32_t b) {
    uint32_t d;
    asm("mul.rn.f16x2 %0, %1, %2;\n" : "=r"(d) : "r"(a), "r"(b));
    return d;
  }
  // c += a (16x16, row-major) * b (16x8, column-major), fp32 accumulate.
  static __device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                             uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

template <>
struct W4Ops<__nv_bfloat16> {
  static constexpr uint32_t kMagic = 0x4300;  // 128.0
  static __device__ __forceinline__ uint32_t sub2(uint32_t a, uint32_t b) {
    uint32_t d;
    asm("sub.rn.bf16x2 %0, %1, %2;\n" : "=r"(d) : "r"(a), "r"(b));
    return d;
  }
  static __device__ __forceinline__ uint32_t mul2(uint32_t a, uint32_t b) {
    uint32_t d;
    asm("mul.rn.bf16x2 %0, %1, %2;\n" : "=r"(d) : "r"(a), "r"(b));
    return d;
  }
  static __device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                             uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

// The scale and zero of one output, as packed pairs for dequant_word: s in both halves, and
// kMagic + z in both halves.
template <typename T>
__device__ __forceinline__ uint32_t scale_pair(uint32_t s_bits) {
  return s_bits * 0x10001u;
}
template <typename T>
__device__ __forceinline__ uint32_t zero_pair(uint32_t z) {
  return (W4Ops<T>::kMagic | z) * 0x10001u;
}

// The four A registers of one repacked word (quant_gemm.h: a_p = {nibble p, nibble p + 4}).
// a0 and a2 are rows r (zero z[0], scale s[0]), a1 and a3 rows r + 8 (z[1], s[1]).
template <typename T>
__device__ __forceinline__ void dequant_word(uint32_t q, const uint32_t (&z)[2],
                                             const uint32_t (&s)[2], uint32_t (&a)[4]) {
  constexpr uint32_t kMagic2 = W4Ops<T>::kMagic * 0x10001u;
#pragma unroll
  for (int p = 0; p < 4; ++p) {
    const uint32_t v = and_or(q >> (4 * p), 0x000f000fu, kMagic2);
    a[p] = W4Ops<T>::mul2(W4Ops<T>::sub2(v, z[p & 1]), s[p & 1]);
  }
}

// ---- repacking

enum class Format { kAwq, kGptq };

// AWQ's nibble of output o % 8 = v: kAwqOrder = {0, 2, 4, 6, 1, 3, 5, 7} inverted.
__device__ __forceinline__ int awq_nibble(int v) { return (v >> 1) + 4 * (v & 1); }

// One thread per uint4 of the repacked qweight: unit (tile, kit), warp, lane (quant_gemm.h).
//   AWQ:  src [in, out / 8], input k's nibble of output o at src[k][o / 8], awq_nibble(o % 8)
//   GPTQ: src [in / 8, out], input k at src[k / 8][o], nibble k % 8; k = perm[j] for column j
template <Format F>
__global__ void repack_weights_kernel(const int32_t* __restrict__ src,
                                      const int32_t* __restrict__ perm, int out, int in,
                                      uint4* __restrict__ dst) {
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t total = static_cast<int64_t>(out) * in / 32;
  if (idx >= total) return;
  const int lane = static_cast<int>(idx % 32);
  const int warp = static_cast<int>((idx / 32) % 4);
  const int64_t unit = idx / 128;
  const int k_iters = in / kTile;
  const int tile = static_cast<int>(unit / k_iters);
  const int kit = static_cast<int>(unit % k_iters);
  const int r = lane >> 2, c = 2 * (lane & 3);
  uint32_t words[4];
#pragma unroll
  for (int step = 0; step < 4; ++step) {
    uint32_t word = 0;
#pragma unroll
    for (int p = 0; p < 8; ++p) {
      const int o = tile * kTile + warp * 16 + r + 8 * (p & 1);
      const int k = kit * kTile + step * 16 + c + 8 * ((p >> 1) & 1) + (p >> 2);
      uint32_t nib;
      if constexpr (F == Format::kAwq) {
        const uint32_t w = static_cast<uint32_t>(src[static_cast<int64_t>(k) * (out / 8) + o / 8]);
        nib = (w >> (4 * awq_nibble(o % 8))) & 0xfu;
      } else {
        const int sk = perm != nullptr ? perm[k] : k;
        const uint32_t w = static_cast<uint32_t>(src[static_cast<int64_t>(sk / 8) * out + o]);
        nib = (w >> (4 * (sk % 8))) & 0xfu;
      }
      word |= nib << (4 * p);
    }
    words[step] = word;
  }
  dst[idx] = make_uint4(words[0], words[1], words[2], words[3]);
}

// One thread per (tile, group, output of the tile): dst [out / 64][groups][64].
//   scales: F16 [groups, out] -> T
//   qzeros: [groups, out / 8]: AWQ's order, or in order (GPTQ, + zero_offset)
template <Format F, typename T>
__global__ void repack_scales_kernel(const __half* __restrict__ scales,
                                     const int32_t* __restrict__ qzeros, int out, int groups,
                                     int zero_offset, T* __restrict__ dst_scales,
                                     uint8_t* __restrict__ dst_zeros) {
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= static_cast<int64_t>(out) * groups) return;
  const int r = static_cast<int>(idx % kTile);
  const int64_t rest = idx / kTile;
  const int g = static_cast<int>(rest % groups);
  const int tile = static_cast<int>(rest / groups);
  const int o = tile * kTile + r;
  dst_scales[idx] = dev::from_float<T>(__half2float(scales[static_cast<int64_t>(g) * out + o]));
  const uint32_t zw = static_cast<uint32_t>(qzeros[static_cast<int64_t>(g) * (out / 8) + o / 8]);
  const int nibble = F == Format::kAwq ? awq_nibble(o % 8) : o % 8;
  dst_zeros[idx] = static_cast<uint8_t>(((zw >> (4 * nibble)) & 0xfu) + zero_offset);
}

// ---- dequantize (w4_dequantize and the prefill path)

// One CTA per (64 x 64) unit, one thread per uint4 of it (as repack_weights_kernel): each
// thread's 32 weights go through the same dequant_word as the fused kernel into a shared tile
// in MMA-fragment order, then the CTA writes the tile's 64 rows of w [out, in] as 128-byte runs
// (act-order: each value at its checkpoint input index perm[k]). The writes dominate (4x the
// bytes read): written straight from the fragments they were 16-byte pieces of 8 rows, half of
// every 32-byte sector, and the prefill path ran at a tenth of the copy bandwidth.
constexpr int kDequantPitch = kTile + 8;  // shared row pitch in elements: 16-byte aligned rows

template <typename T>
__global__ void __launch_bounds__(kThreads)
    dequantize_kernel(const uint4* __restrict__ qweight, const T* __restrict__ scales,
                      const uint8_t* __restrict__ zeros, const int32_t* __restrict__ perm, int out,
                      int in, int group, T* __restrict__ w) {
  __shared__ __align__(16) T tile_w[kTile * kDequantPitch];
  // Launched with launch_pdl: w is a workspace the kernels before may still read.
  dev::pdl_wait();
  dev::pdl_launch_dependents();
  const int unit = static_cast<int>(blockIdx.x);  // < out * in / 4096 <= 2^22 (check_w4_shape)
  const int k_iters = in / kTile;
  const int groups = in / group;
  const int tile = unit / k_iters, kit = unit - tile * k_iters;
  const int lane = static_cast<int>(threadIdx.x) & 31, warp = static_cast<int>(threadIdx.x) >> 5;
  const int r = lane >> 2, c = 2 * (lane & 3);
  const uint4 q4 = qweight[static_cast<int64_t>(unit) * kThreads + threadIdx.x];
  const uint32_t q[4] = {q4.x, q4.y, q4.z, q4.w};
#pragma unroll
  for (int step = 0; step < 4; ++step) {
    const int k0 = kit * kTile + step * 16;
    const int64_t sz = (static_cast<int64_t>(tile) * groups + k0 / group) * kTile + warp * 16 + r;
    uint16_t s0, s8;
    memcpy(&s0, scales + sz, 2);
    memcpy(&s8, scales + sz + 8, 2);
    const uint32_t zp[2] = {zero_pair<T>(zeros[sz]), zero_pair<T>(zeros[sz + 8])};
    const uint32_t sp[2] = {scale_pair<T>(s0), scale_pair<T>(s8)};
    uint32_t a[4];
    dequant_word<T>(q[step], zp, sp, a);
#pragma unroll
    for (int p = 0; p < 4; ++p) {
      const int row = warp * 16 + r + 8 * (p & 1);
      const int k = step * 16 + c + 8 * (p >> 1);
      // k even: a 4-byte aligned pair. Typed stores, not memcpy through a T*: nvcc splits a
      // memcpy it cannot prove aligned into 2-byte (or byte) stores.
      *reinterpret_cast<uint32_t*>(&tile_w[row * kDequantPitch + k]) = a[p];
    }
  }
  __syncthreads();
  T* w_tile = w + static_cast<int64_t>(tile) * kTile * in + static_cast<int64_t>(kit) * kTile;
  if (perm == nullptr) {
    // 512 pieces of 16 bytes: 8 threads write one row's 128 bytes (16-byte aligned: w is, in is
    // a multiple of 64, col of 8).
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int piece = static_cast<int>(threadIdx.x) + kThreads * i;
      const int row = piece >> 3, col = (piece & 7) * 8;
      const uint4 v = *reinterpret_cast<const uint4*>(&tile_w[row * kDequantPitch + col]);
      *reinterpret_cast<uint4*>(w_tile + static_cast<int64_t>(row) * in + col) = v;
    }
  } else {
    const int32_t* unit_perm = perm + kit * kTile;
    T* w_rows = w + static_cast<int64_t>(tile) * kTile * in;
    for (int e = static_cast<int>(threadIdx.x); e < kTile * kTile; e += kThreads) {
      const int row = e / kTile, col = e % kTile;
      w_rows[static_cast<int64_t>(row) * in + unit_perm[col]] = tile_w[row * kDequantPitch + col];
    }
  }
}

// out[r, j] = x[r, perm[j]] (perm null: a copy), both [m, in]. Grid: x over j, y over rows.
template <typename T>
__global__ void permute_cols_kernel(const T* __restrict__ x, const int32_t* __restrict__ perm,
                                    int64_t m, int64_t in, T* __restrict__ out) {
  dev::pdl_wait();
  dev::pdl_launch_dependents();
  const int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= in) return;
  const int64_t src = perm != nullptr ? perm[j] : j;
  for (int64_t r = blockIdx.y; r < m; r += gridDim.y) out[r * in + j] = x[r * in + src];
}

// ---- the fused kernel (m <= 64)
//
// Work: the layer is out / 64 tiles of 64 outputs, each in / 64 units of 64 inputs (k_iters);
// units are numbered tile-major (unit = tile * k_iters + kit), the order of qweight, so a run of
// units is one contiguous stream of 2 KiB blocks. CTA b takes units [b * per, (b + 1) * per)
// (stream-K: equal work per CTA whatever the shape), one wave of CTAs over the SMs: per is
// ceil(units / resident CTAs), and at least k_iters / kMaxSplits.
//
// CTA: 4 warps; warp w computes outputs 16w..16w+15 of the unit's tile for all m rows of x:
// its A operand is the dequantized weight (outputs as M = 16 rows, inputs as K), its B operand
// x's rows (tokens as N = 8 columns per n-tile, NT n-tiles for m <= 8 NT). Per unit and warp:
// one 16-byte shared load of its weights (4 k16 steps), 4 dequant_word, 2 NT ldmatrix.x4 of x,
// 4 NT mma.sync. Output column t of C only depends on x's row t, so rows >= m are never needed
// (they are zeroed once anyway, and their outputs never stored). With one n-tile the MMAs
// alternate between two accumulator sets, so that they do not wait on each other.
//
// Pipeline: a stage is kUnits consecutive units: weights (2 KiB), scales and zeros (one or, for
// group 32, two groups of 64) and x's 64 columns of the m rows (128-byte rows, the 16-byte chunk
// c of row r stored at chunk c ^ (r % 8) so that the 8 rows an ldmatrix phase reads hit distinct
// banks). kStages - 1 stages are in flight through cp.async while one is computed; the first
// stages' weights are requested before the kernel waits for the one that writes x (PDL). A
// stage inside one tile (the common case) is computed in straight-line code, its units'
// shared loads and dequantization overlapping each other's MMAs; one that crosses a tile or
// the CTA's end goes unit by unit. The copies' addresses are worked out once (UnitLoader) and
// units are followed without divisions (Cursor): the per-unit instructions, not the memory
// system, are what limits this kernel at m = 1 (measured on the H200).
//
// Split-K: a tile whose units belong to several CTAs (b_lo..b_hi) gets one fp32 partial sum
// [m][64] from each, in slot b + tile of the workspace (unique: CTA ranges and tiles are both
// increasing). Each CTA then counts itself in the tile's counter; the last to arrive adds the
// partials in the order b_lo..b_hi (so the result does not depend on timing), writes y and
// resets the counter to zero for the next call. A tile inside one CTA's range is written
// directly. No CTA ever waits for another.

constexpr int kSlotScales = kUnitBytes;        // 2 groups x 64 scales x 2 bytes
constexpr int kSlotZeros = kSlotScales + 256;  // 2 groups x 64 zeros
constexpr int kSlotX = kSlotZeros + 128;       // 8 NT rows of 64 inputs, 128 bytes each

// One instance of the fused kernel: NT n-tiles of 8 tokens; ONE: m = 1 exactly (NT = 1), so a
// slot holds x's one row and ldmatrix reads it for all 8 columns of the n-tile (columns 1..7
// are copies whose outputs are never stored): with 3 stages 30 KiB per CTA instead of 54, six
// CTAs per SM;
// TWO: group 32 (a unit spans two groups). Both are template arguments so that a stage's units
// are straight-line code without branches, which the compiler interleaves.
template <int NT_, bool ONE_, bool TWO_>
struct FusedConfig {
  static constexpr int NT = NT_;
  static constexpr bool kOne = ONE_;
  static constexpr bool kTwo = TWO_;
  static_assert(!kOne || NT == 1, "one row is one n-tile");
  static constexpr int kRows = kOne ? 1 : 8 * NT;
  static constexpr int kUnits = NT <= 2 ? 4 : 2;  // units per stage
  static constexpr int kSlotBytes = kSlotX + kRows * 128;
  // cp.async pipeline depth. One row: 3 stages of 10 KiB, six CTAs per SM (measured on the
  // H200 against 4 stages and five CTAs: 1.04-1.08x on layers of 59 MB and more).
  static constexpr int kStages = kOne ? 3 : 4;
  static constexpr int kSmemBytes = kStages * kUnits * kSlotBytes;
  // What fits in an H200 SM's 228 KiB (30, 54, 70, 51, 83 KiB per CTA): the register cap.
  static constexpr int kMinBlocks = kOne ? 6 : NT == 1 ? 4 : NT == 2 ? 3 : NT == 4 ? 4 : 2;
  // Independent accumulator chains: with one n-tile, the 4 MMAs of a unit would otherwise wait
  // on each other (added together at the flush).
  static constexpr int kAccSets = NT == 1 ? 2 : 1;
  static_assert(kSlotBytes % 128 == 0, "slots keep 128-byte alignment");
};

struct FusedParams {
  const uint8_t* qweight;  // 2 KiB per unit
  const void* scales;      // [out / 64][groups][64] T
  const uint8_t* zeros;    // [out / 64][groups][64]
  const void* x;           // [m, in] T, 16-byte aligned
  void* y;                 // [m, out] T
  float* partials;         // [slots][m][64]
  int* counters;           // [out / 64], zero between calls
  int m, out, in, groups;
  // The unit's first scale group within its tile: (kit * group_mul) >> group_shift (group 32:
  // 2 kit; 64: kit; 128: kit / 2; one group: 0), so no division per unit.
  int group_mul, group_shift;
  bool two_groups;  // group 32: a unit spans two groups
  int k_iters, total_units, per_cta;
};

// A position in the unit sequence, advanced without divisions.
struct Cursor {
  int unit, tile, kit;
  __device__ __forceinline__ void advance(int k_iters) {
    ++unit;
    if (++kit == k_iters) {
      kit = 0;
      ++tile;
    }
  }
};

// The copies one thread issues for each unit, with its addresses worked out once per CTA:
//   weights: its 16 bytes of the unit's 2 KiB;
//   x: chunk tid % 8 of rows tid / 8 + 16 i (i < kXIters), for the rows below m;
//   scales / zeros (threads 64..): one 16-byte chunk of the unit's group rows (8 chunks of
//     scales and 4 of zeros per group).
template <typename C>
struct UnitLoader {
  static constexpr int kXIters = C::NT == 1 ? 1 : C::NT / 2;  // 8 NT rows x 8 chunks / 128 threads
  const uint8_t* w;
  const uint8_t* x;
  int64_t x_step;     // 16 rows of x, in bytes
  uint32_t x_dst;     // slot offset of the first chunk (the others + 16 rows of 128 bytes)
  int x_chunks;       // chunks of this thread inside the m rows
  const uint8_t* sz;  // scales or zeros of (tile 0, group 0) plus this thread's offset, or null
  int sz_row;         // bytes of one (tile, group) row: 128 (scales) or 64 (zeros)
  uint32_t sz_dst;

  __device__ __forceinline__ UnitLoader(const FusedParams& p, int tid) {
    w = p.qweight + tid * 16;
    const int row = tid >> 3, chunk = tid & 7;
    x = static_cast<const uint8_t*>(p.x) + static_cast<int64_t>(row) * p.in * 2 + chunk * 16;
    x_step = static_cast<int64_t>(16) * p.in * 2;
    x_dst = kSlotX + row * 128 + ((chunk ^ (row & 7)) << 4);
    x_chunks = row < p.m ? min(kXIters, (p.m - row + 15) / 16) : 0;
    const int groups_per_unit = C::kTwo ? 2 : 1;
    const int i = tid - 64;
    sz = nullptr;
    sz_row = 0;
    sz_dst = 0;
    if (i >= 0 && i < 8 * groups_per_unit) {
      sz = static_cast<const uint8_t*>(p.scales) + i * 16;
      sz_row = kTile * 2;
      sz_dst = kSlotScales + i * 16;
    } else if (i >= 8 * groups_per_unit && i < 12 * groups_per_unit) {
      const int j = i - 8 * groups_per_unit;
      sz = p.zeros + j * 16;
      sz_row = kTile;
      sz_dst = kSlotZeros + j * 16;
    }
  }

  // The constant part of the unit at `c` (weights, scales, zeros) into `slot`.
  __device__ __forceinline__ void weights(const FusedParams& p, const Cursor& c,
                                          uint32_t slot) const {
    cp_async_16(slot + (threadIdx.x * 16), w + static_cast<int64_t>(c.unit) * kUnitBytes);
    if (sz != nullptr) {
      const int first = c.tile * p.groups + ((c.kit * p.group_mul) >> p.group_shift);
      cp_async_16(slot + sz_dst, sz + static_cast<int64_t>(first) * sz_row);
    }
  }

  // x's rows [0, m), columns of the unit at `c`, into the slot (swizzled 16-byte chunks).
  __device__ __forceinline__ void x_cols(const Cursor& c, uint32_t slot) const {
    const uint8_t* src = x + c.kit * (kTile * 2);
#pragma unroll
    for (int k = 0; k < kXIters; ++k) {
      if (k < x_chunks) cp_async_16(slot + x_dst + k * 16 * 128, src + k * x_step);
    }
  }
};

// Adds the unit in `slot` (generic pointer into shared memory) to the warp's accumulators.
template <typename T, typename C>
__device__ __forceinline__ void compute_unit(const uint8_t* slot, int m, int warp, int lane,
                                             float (&acc)[C::kAccSets][C::NT][4]) {
  constexpr int NT = C::NT, SETS = C::kAccSets;
  using Ops = W4Ops<T>;
  const int r = lane >> 2;
  const uint4 q4 = *reinterpret_cast<const uint4*>(slot + warp * 512 + lane * 16);
  const uint32_t q[4] = {q4.x, q4.y, q4.z, q4.w};
  // Scales and zeros of rows r and r + 8: steps 0, 1 use the unit's first group, steps 2, 3
  // its second (group 32) or the first again.
  const auto* sp = reinterpret_cast<const uint16_t*>(slot + kSlotScales) + warp * 16 + r;
  const uint8_t* zp = slot + kSlotZeros + warp * 16 + r;
  uint32_t s[2][2], z[2][2];
  s[0][0] = scale_pair<T>(sp[0]);
  s[0][1] = scale_pair<T>(sp[8]);
  z[0][0] = zero_pair<T>(zp[0]);
  z[0][1] = zero_pair<T>(zp[8]);
  if constexpr (C::kTwo) {
    s[1][0] = scale_pair<T>(sp[kTile]);
    s[1][1] = scale_pair<T>(sp[kTile + 8]);
    z[1][0] = zero_pair<T>(zp[kTile]);
    z[1][1] = zero_pair<T>(zp[kTile + 8]);
  } else {
    s[1][0] = s[0][0];
    s[1][1] = s[0][1];
    z[1][0] = z[0][0];
    z[1][1] = z[0][1];
  }
  uint32_t a[4][4];
#pragma unroll
  for (int step = 0; step < 4; ++step) {
    dequant_word<T>(q[step], z[step >> 1], s[step >> 1], a[step]);
  }
  const uint32_t xs = smem_u32(slot + kSlotX);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      if (nt > 0 && nt * 8 >= m) break;  // warp-uniform: n-tiles of padding rows only
      // Matrices: steps 2h and 2h + 1, inputs 0..7 and 8..15 of each = b0, b1, b0, b1.
      const int row = C::kOne ? 0 : nt * 8 + (lane & 7);
      const int chunk = h * 4 + (lane >> 3);
      uint32_t b[4];
      ldmatrix_x4(xs + row * 128 + ((chunk ^ (row & 7)) << 4), b);
      Ops::mma(acc[h % SETS][nt], a[2 * h], b[0], b[1]);
      Ops::mma(acc[h % SETS][nt], a[2 * h + 1], b[2], b[3]);
    }
  }
}

// The warp's sums for `tile` (C fragment: c0, c1 = row r, tokens 2 (lane % 4) + 0, 1; c2, c3 =
// row r + 8) -> y, or through a partial sum when other CTAs share the tile.
template <typename T, int NT, bool kOne>
__device__ void flush_tile(const FusedParams& p, int tile, int warp, int lane,
                           const float (&acc)[NT][4], int* s_last) {
  const int b_lo = (tile * p.k_iters) / p.per_cta;
  const int b_hi = ((tile + 1) * p.k_iters - 1) / p.per_cta;
  const int col = warp * 16 + (lane >> 2);  // output within the tile (and col + 8)
  const int tok = 2 * (lane & 3);           // token within an n-tile (and tok + 1)
  T* y = static_cast<T*>(p.y);
  if (b_lo == b_hi) {
    T* yt = y + static_cast<int64_t>(tile) * kTile + col;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int t = nt * 8 + tok + (e & 1);
        if (t < p.m) {
          yt[static_cast<int64_t>(t) * p.out + 8 * (e >> 1)] = dev::from_float<T>(acc[nt][e]);
        }
      }
    }
    return;
  }
  const int64_t slot_floats = static_cast<int64_t>(p.m) * kTile;
  float* part = p.partials + (static_cast<int64_t>(blockIdx.x) + tile) * slot_floats + col;
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int t = nt * 8 + tok + (e & 1);
      if (t < p.m) part[t * kTile + 8 * (e >> 1)] = acc[nt][e];
    }
  }
  // Release: every thread's partial is visible device-wide before the CTA counts itself.
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    const int arrived = atomicAdd(p.counters + tile, 1);
    const bool last = arrived == b_hi - b_lo;
    if (last) p.counters[tile] = 0;  // every CTA of the tile has counted: ready for next call
    __threadfence();                 // acquire: the other CTAs' partials before they are read
    *s_last = last ? 1 : 0;
  }
  __syncthreads();
  if (*s_last == 0) return;
  const float* base = p.partials + static_cast<int64_t>(tile) * slot_floats;
  // __ldcg: from L2, where the other SMs' partials are (never a stale L1 line). The partials are
  // added in CTA order (b_lo..b_hi), so the result does not depend on timing.
  if constexpr (kOne) {
    // One row: a float per thread (64 of them), one CTA's partial at a time. The batched form
    // below measured 1.10x slower on a 4096 x 14336 layer here (H200, 16.8 against 15.3 us).
    for (int i = threadIdx.x; i < kTile; i += kThreads) {
      float sum = 0.f;
      for (int b = b_lo; b <= b_hi; ++b) sum += __ldcg(base + b * slot_floats + i);
      y[static_cast<int64_t>(tile) * kTile + i] = dev::from_float<T>(sum);
    }
    return;
  }
  // Four outputs per thread and step, the partials of kBatch CTAs loaded together before they
  // are added. One float at a time, the last CTA waited an L2 round trip per CTA of the tile and
  // per 128 of its m x 64 sums (H200: 4096 x 4096 at m = 16 15.8 -> 11.0 us, m = 64 31.3 ->
  // 23.6). Slots are m x 64 floats, so every float4 is aligned.
  constexpr int kBatch = 4;
  const auto* base4 = reinterpret_cast<const float4*>(base);
  const int64_t slot4 = slot_floats / 4;
  for (int i4 = threadIdx.x; i4 < p.m * kTile / 4; i4 += kThreads) {
    float sum[4] = {0.f, 0.f, 0.f, 0.f};
    for (int b0 = b_lo; b0 <= b_hi; b0 += kBatch) {
      float4 v[kBatch];
#pragma unroll
      for (int k = 0; k < kBatch; ++k) {
        if (b0 + k <= b_hi) v[k] = __ldcg(base4 + (b0 + k) * slot4 + i4);
      }
#pragma unroll
      for (int k = 0; k < kBatch; ++k) {
        if (b0 + k <= b_hi) {
          sum[0] += v[k].x;
          sum[1] += v[k].y;
          sum[2] += v[k].z;
          sum[3] += v[k].w;
        }
      }
    }
    const int t = i4 * 4 / kTile, col4 = i4 * 4 % kTile;
    T* yt = y + static_cast<int64_t>(t) * p.out + static_cast<int64_t>(tile) * kTile + col4;
#pragma unroll
    for (int e = 0; e < 4; ++e) yt[e] = dev::from_float<T>(sum[e]);
  }
}

template <typename T, typename C>
__global__ void __launch_bounds__(kThreads, C::kMinBlocks)
    w4_fused_kernel(const __grid_constant__ FusedParams p) {
  constexpr int NT = C::NT;
  extern __shared__ __align__(128) uint8_t smem[];
  __shared__ int s_last;
  const int tid = static_cast<int>(threadIdx.x);
  const int warp = tid / 32, lane = tid % 32;
  const int u_begin = static_cast<int>(blockIdx.x) * p.per_cta;
  const int u_end = min(u_begin + p.per_cta, p.total_units);
  const int num_stages = (u_end - u_begin + C::kUnits - 1) / C::kUnits;
  const Cursor first{u_begin, u_begin / p.k_iters, u_begin % p.k_iters};
  const uint32_t base = smem_u32(smem);
  auto slot_addr = [&](int stage, int j) {
    return static_cast<uint32_t>(((stage % C::kStages) * C::kUnits + j) * C::kSlotBytes);
  };

  // The weights are constant: requested before the wait for the kernel that writes x.
  const UnitLoader<C> loader(p, tid);
  Cursor load = first;
  for (int st = 0; st < C::kStages - 1; ++st) {
    for (int j = 0; j < C::kUnits && load.unit < u_end; ++j, load.advance(p.k_iters)) {
      loader.weights(p, load, base + slot_addr(st, j));
    }
  }
  dev::pdl_wait();
  dev::pdl_launch_dependents();
  // Rows m.. of every x slot: zero (never loaded; their outputs are never stored).
  const int pad_chunks = (C::kRows - p.m) * 8;
  for (int s = 0; s < C::kStages * C::kUnits; ++s) {
    for (int c = tid; c < pad_chunks; c += kThreads) {
      sts128_zero(base + static_cast<uint32_t>(s * C::kSlotBytes + kSlotX + p.m * 128 + c * 16));
    }
  }
  Cursor load_x = first;
  for (int st = 0; st < C::kStages - 1; ++st) {
    for (int j = 0; j < C::kUnits && load_x.unit < u_end; ++j, load_x.advance(p.k_iters)) {
      loader.x_cols(load_x, base + slot_addr(st, j));
    }
    cp_async_commit();  // one group per stage, empty ones included, for the wait counts
  }

  float acc[C::kAccSets][NT][4];
#pragma unroll
  for (int a = 0; a < C::kAccSets; ++a) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[a][nt][e] = 0.f;
    }
  }
  // Adds the accumulator sets, writes the tile's sums (flush_tile) and restarts from zero.
  auto flush = [&](int tile) {
#pragma unroll
    for (int a = 1; a < C::kAccSets; ++a) {
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[0][nt][e] += acc[a][nt][e];
      }
    }
    flush_tile<T, NT, C::kOne>(p, tile, warp, lane, acc[0], &s_last);
#pragma unroll
    for (int a = 0; a < C::kAccSets; ++a) {
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[a][nt][e] = 0.f;
      }
    }
  };
  Cursor comp = first;
  for (int st = 0; st < num_stages; ++st) {
    cp_async_wait<C::kStages - 2>();  // stage st has landed (this thread's copies) ...
    __syncthreads();               // ... everyone's; and stage st - 1's slots are free
    const int next = st + C::kStages - 1;
    for (int j = 0; j < C::kUnits && load.unit < u_end; ++j, load.advance(p.k_iters)) {
      loader.weights(p, load, base + slot_addr(next, j));
      loader.x_cols(load, base + slot_addr(next, j));
    }
    cp_async_commit();
    if (comp.unit + C::kUnits <= u_end && comp.kit + C::kUnits <= p.k_iters) {
      // The common case: a whole stage inside one tile, at most ending it. Straight-line code
      // over its units, so that their loads and dequantization overlap each other's MMAs.
#pragma unroll
      for (int j = 0; j < C::kUnits; ++j) {
        compute_unit<T, C>(smem + slot_addr(st, j), p.m, warp, lane, acc);
      }
      comp.unit += C::kUnits;
      comp.kit += C::kUnits;
      if (comp.kit == p.k_iters || comp.unit == u_end) flush(comp.tile);
      if (comp.kit == p.k_iters) {
        comp.kit = 0;
        ++comp.tile;
      }
    } else {
      for (int j = 0; j < C::kUnits && comp.unit < u_end; ++j, comp.advance(p.k_iters)) {
        compute_unit<T, C>(smem + slot_addr(st, j), p.m, warp, lane, acc);
        if (comp.kit == p.k_iters - 1 || comp.unit == u_end - 1) flush(comp.tile);
      }
    }
  }
  cp_async_wait<0>();  // only empty groups remain; nothing may target shared memory at exit
}

// ---- the m = 1 kernel (decode of one sequence)
//
// No shared staging of the weights and no cross-CTA reduction: a warp owns a strip of 16
// outputs (warp w of a 64-output tile, 512 contiguous bytes of every unit) over a range of the
// tile's units, and streams its pieces straight into registers, kGemvDepth units ahead (16
// bytes per lane each, ld.global.nc: the weights are read once). A CTA is kGemvWarps warps:
// p.split K-slices of kGemvWarps / p.split strips (launch_gemv picks p.split so that the layer's
// CTAs fill the GPU in one wave). x's row is copied once into shared memory; ldmatrix reads it
// for all 8 columns of the MMA's n-tile (column 0 is the token; columns 1..7 are copies never
// stored). At the end the K-slices' sums meet in shared memory and are added in slice order, so
// the result does not depend on timing.
//
// Few instructions per weight (at m = 1 the kernel is issue-bound, not bandwidth-bound, if each
// weight costs a subtract and a multiply): the MMA takes the magic-biased nibbles kMagic + q as
// they are, one and_or per pair, and the scale and zero are applied to fp32 sums of 32 inputs:
//   sum_i (q_i - z) s x_i = s (T - (kMagic + z) X),  T = sum_i (kMagic + q_i) x_i,  X = sum_i x_i
// with X of every 32 inputs computed once per CTA from x's row. T is exact to fp32's 24 bits of
// kMagic |x| (kMagic + q <= 1039), far below the output's rounding. So this kernel computes
// x . ((q - z) s) with each product exact, where the other paths round each weight to the dtype
// first (quant_gemm.h: w4_decode_kernel says which path a call takes).
constexpr int kGemvWarps = 8;
constexpr int kGemvDepth = 4;
// Three CTAs per SM (80 registers): at two, a 6144 x 4096 layer's 384 CTAs take two waves.
constexpr int kGemvMinBlocks = 3;

struct GemvParams {
  const uint8_t* qweight;
  const void* scales;    // [out / 64][groups][64] T
  const uint8_t* zeros;  // [out / 64][groups][64]
  const void* x;         // [in] T, 16-byte aligned
  void* y;               // [out] T
  int in, groups, k_iters;
  int group_mul, group_shift;
  int split;  // K-slices per strip: 1, 2, 4 or 8 (kGemvWarps / split strips per CTA)
};

// Shared memory of the m = 1 kernel: the K-slice sums, the sums of x's 32-input pieces, x's row
// (16-byte aligned).
__host__ __device__ constexpr int gemv_x_offset(int in) {
  return kGemvWarps * 16 * 4 + (in / 32 * 4 + 15) / 16 * 16;
}

// A scale's bits in the run dtype, as a float.
template <typename T>
__device__ __forceinline__ float scale_float(uint16_t bits);
template <>
__device__ __forceinline__ float scale_float<__half>(uint16_t bits) {
  return __half2float(__ushort_as_half(bits));
}
template <>
__device__ __forceinline__ float scale_float<__nv_bfloat16>(uint16_t bits) {
  return __uint_as_float(static_cast<uint32_t>(bits) << 16);
}

// Copies x's row into shared memory and writes xsum[j] = the fp32 sum of inputs 32j..32j+31
// (four threads' 8 inputs each, added in a fixed order: every CTA gets the same sums).
template <typename T>
__device__ __forceinline__ void stage_x(const GemvParams& p, uint8_t* xs, float* xsum) {
  const auto* xg = static_cast<const uint4*>(p.x);
  const int vecs = p.in / 8;
  const int rounded = (vecs + 31) / 32 * 32;  // whole warps take part in the shuffles
  for (int i = static_cast<int>(threadIdx.x); i < rounded; i += kGemvWarps * 32) {
    float sum = 0.f;
    if (i < vecs) {
      const uint4 v = xg[i];
      reinterpret_cast<uint4*>(xs)[i] = v;
      const T* e = reinterpret_cast<const T*>(&v);
#pragma unroll
      for (int k = 0; k < 8; ++k) sum += dev::to_float(e[k]);
    }
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    if (i < vecs && i % 4 == 0) xsum[i / 4] = sum;
  }
}

template <typename T, bool TWO>
__global__ void __launch_bounds__(kGemvWarps * 32, kGemvMinBlocks)
    w4_gemv_kernel(const __grid_constant__ GemvParams p) {
  constexpr float kMagic = std::is_same_v<T, __half> ? 1024.f : 128.f;
  constexpr uint32_t kMagic2 = W4Ops<T>::kMagic * 0x10001u;
  constexpr int kGroups = TWO ? 2 : 1;  // scale groups per unit
  extern __shared__ __align__(16) uint8_t smem[];
  float* red = reinterpret_cast<float*>(smem);  // [kGemvWarps][16] K-slice sums
  float* xsum = red + kGemvWarps * 16;          // [in / 32]
  uint8_t* xs = smem + gemv_x_offset(p.in);     // x's row
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int slice = warp % p.split;
  const int strip = static_cast<int>(blockIdx.x) * (kGemvWarps / p.split) + warp / p.split;
  const int tile = strip / 4, w = strip % 4;
  const int per = (p.k_iters + p.split - 1) / p.split;
  const int k0 = min(slice * per, p.k_iters), k1 = min(k0 + per, p.k_iters);
  const int r = lane >> 2;
  const uint8_t* wp =
      p.qweight + (static_cast<int64_t>(tile) * p.k_iters) * kUnitBytes + w * 512 + lane * 16;
  // Scale and zero of rows r and r + 8 of the strip in group g: index + g * 64.
  const int64_t sz0 = static_cast<int64_t>(tile) * p.groups * kTile + w * 16 + r;
  const auto* sc = static_cast<const uint16_t*>(p.scales) + sz0;
  const uint8_t* zc = p.zeros + sz0;

  // The ring of units in flight: a lane's 16 bytes of weights, and per scale group the scales
  // and the zeros of rows r (low half) and r + 8 (high half), packed to save registers.
  uint4 q[kGemvDepth];
  uint32_t s[kGemvDepth][kGroups], z[kGemvDepth][kGroups];
  auto fetch = [&](int j, int kit) {
    if (kit < k1) {
      q[j] = dev::ldg_stream(wp + static_cast<int64_t>(kit) * kUnitBytes);
      const int g = (kit * p.group_mul) >> p.group_shift;
#pragma unroll
      for (int h = 0; h < kGroups; ++h) {
        const int64_t at = static_cast<int64_t>(g + h) * kTile;
        s[j][h] = static_cast<uint32_t>(__ldg(sc + at)) | static_cast<uint32_t>(__ldg(sc + at + 8))
                                                              << 16;
        z[j][h] = static_cast<uint32_t>(__ldg(zc + at)) | static_cast<uint32_t>(__ldg(zc + at + 8))
                                                              << 16;
      }
    }
  };
  // The weights are constant: requested before the wait for the kernel that writes x.
#pragma unroll
  for (int j = 0; j < kGemvDepth; ++j) fetch(j, k0 + j);
  dev::pdl_wait();
  dev::pdl_launch_dependents();
  stage_x<T>(p, xs, xsum);
  __syncthreads();

  float acc0 = 0.f, acc8 = 0.f;                            // rows r and r + 8, token column
  const uint32_t xbase = smem_u32(xs) + (lane >> 3) * 16;  // matrix lane / 8 of each ldmatrix
  for (int base = k0; base < k1; base += kGemvDepth) {
#pragma unroll
    for (int j = 0; j < kGemvDepth; ++j) {
      const int kit = base + j;
      if (kit >= k1) break;
      const uint32_t qw[4] = {q[j].x, q[j].y, q[j].z, q[j].w};
      uint32_t a[4][4];
#pragma unroll
      for (int step = 0; step < 4; ++step) {
#pragma unroll
        for (int pp = 0; pp < 4; ++pp)
          a[step][pp] = and_or(qw[step] >> (4 * pp), 0x000f000fu, kMagic2);
      }
      float sf[2 * kGroups], zf[2 * kGroups];
#pragma unroll
      for (int h = 0; h < kGroups; ++h) {
        sf[2 * h] = scale_float<T>(static_cast<uint16_t>(s[j][h]));
        sf[2 * h + 1] = scale_float<T>(static_cast<uint16_t>(s[j][h] >> 16));
        zf[2 * h] = -(kMagic + static_cast<float>(z[j][h] & 0xffu));
        zf[2 * h + 1] = -(kMagic + static_cast<float>(z[j][h] >> 16));
      }
      fetch(j, kit + kGemvDepth);
      const float2 xh = *reinterpret_cast<const float2*>(xsum + 2 * kit);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        uint32_t b[4];
        ldmatrix_x4(xbase + (kit * kTile + h * 32) * 2, b);
        float t[4] = {0.f, 0.f, 0.f, 0.f};
        W4Ops<T>::mma(t, a[2 * h], b[0], b[1]);
        W4Ops<T>::mma(t, a[2 * h + 1], b[2], b[3]);
        const int e = TWO ? 2 * h : 0;
        const float xsh = h == 0 ? xh.x : xh.y;
        acc0 = fmaf(sf[e], fmaf(zf[e], xsh, t[0]), acc0);
        acc8 = fmaf(sf[e + 1], fmaf(zf[e + 1], xsh, t[2]), acc8);
      }
    }
  }
  // Token 0's outputs: lanes 4r hold rows r (c0) and r + 8 (c2).
  if ((lane & 3) == 0) {
    red[warp * 16 + r] = acc0;
    red[warp * 16 + r + 8] = acc8;
  }
  __syncthreads();
  if (static_cast<int>(threadIdx.x) < (kGemvWarps / p.split) * 16) {
    const int ls = static_cast<int>(threadIdx.x) / 16, o = static_cast<int>(threadIdx.x) % 16;
    float sum = 0.f;
    for (int k = 0; k < p.split; ++k) sum += red[(ls * p.split + k) * 16 + o];
    const int out_strip = static_cast<int>(blockIdx.x) * (kGemvWarps / p.split) + ls;
    static_cast<T*>(p.y)[static_cast<int64_t>(out_strip) * 16 + o] = dev::from_float<T>(sum);
  }
}

// ---- host side

Status check_half(DType dtype, const char* op) {
  if (is_half_type(dtype)) return Status::ok();
  return invalid_argument(std::string(op) + ": dtype must be BF16 or F16, got " +
                          dtype_name(dtype));
}

Status check_not_null(const void* p, const char* op, const char* name) {
  if (p != nullptr) return Status::ok();
  return invalid_argument(std::string(op) + ": " + name + " is null");
}

Status check_aligned(const void* p, uintptr_t bytes, const char* op, const char* name) {
  if (aligned(p, bytes)) return Status::ok();
  return invalid_argument(std::string(op) + ": " + name + " is not " + std::to_string(bytes) +
                          "-byte aligned");
}

Status check_dst(void* dst, uint64_t dst_bytes, int64_t out, int64_t in, int64_t group,
                 const char* op) {
  TESSERA_RETURN_IF_ERROR(check_not_null(dst, op, "dst"));
  TESSERA_RETURN_IF_ERROR(check_aligned(dst, 16, op, "dst"));
  const uint64_t need = w4_bytes(out, in, group);
  if (dst_bytes < need) {
    return invalid_argument(std::string(op) + ": dst has " + std::to_string(dst_bytes) +
                            " bytes, the layer needs w4_bytes = " + std::to_string(need));
  }
  return Status::ok();
}

Status check_layer(const W4Layer& l, const char* op) {
  TESSERA_RETURN_IF_ERROR(check_w4_shape(l.out, l.in, l.group).with_context(op));
  TESSERA_RETURN_IF_ERROR(check_half(l.dtype, op));
  TESSERA_RETURN_IF_ERROR(check_not_null(l.qweight, op, "layer.qweight"));
  TESSERA_RETURN_IF_ERROR(check_not_null(l.scales, op, "layer.scales"));
  TESSERA_RETURN_IF_ERROR(check_not_null(l.zeros, op, "layer.zeros"));
  TESSERA_RETURN_IF_ERROR(check_aligned(l.qweight, 16, op, "layer.qweight"));
  TESSERA_RETURN_IF_ERROR(check_aligned(l.scales, 16, op, "layer.scales"));
  TESSERA_RETURN_IF_ERROR(check_aligned(l.zeros, 16, op, "layer.zeros"));
  return Status::ok();
}

unsigned blocks_for(int64_t threads, int64_t per_block) {
  return static_cast<unsigned>(ceil_div(threads, per_block));
}

W4Layer layer_in(void* dst, int64_t out, int64_t in, int64_t group, DType dtype) {
  const Regions r = regions(out, in, group);
  auto* bytes = static_cast<uint8_t*>(dst);
  W4Layer l;
  l.out = out;
  l.in = in;
  l.group = group;
  l.dtype = dtype;
  l.qweight = reinterpret_cast<const uint32_t*>(bytes);
  l.scales = bytes + r.scales;
  l.zeros = bytes + r.zeros;
  l.perm = nullptr;
  return l;
}

// Launches the repack kernels of format F into the layer's buffers at dst.
template <Format F>
Status launch_repack(const int32_t* qweight, const int32_t* qzeros, const void* scales,
                     int zero_offset, const int32_t* perm, void* dst, const W4Layer& l,
                     cudaStream_t stream) {
  constexpr int kBlock = 256;
  const int out = static_cast<int>(l.out), in = static_cast<int>(l.in);
  const int groups = static_cast<int>(l.in / l.group);
  auto* words = static_cast<uint4*>(dst);
  repack_weights_kernel<F>
      <<<blocks_for(l.out * l.in / 32, kBlock), kBlock, 0, stream>>>(qweight, perm, out, in, words);
  TESSERA_RETURN_IF_ERROR(launch_status("repack_weights"));
  const auto* s = static_cast<const __half*>(scales);
  auto* zeros = const_cast<uint8_t*>(l.zeros);
  const unsigned grid = blocks_for(l.out * groups, kBlock);
  if (l.dtype == DType::kBF16) {
    repack_scales_kernel<F, __nv_bfloat16><<<grid, kBlock, 0, stream>>>(
        s, qzeros, out, groups, zero_offset,
        static_cast<__nv_bfloat16*>(const_cast<void*>(l.scales)), zeros);
  } else {
    repack_scales_kernel<F, __half>
        <<<grid, kBlock, 0, stream>>>(s, qzeros, out, groups, zero_offset,
                                      static_cast<__half*>(const_cast<void*>(l.scales)), zeros);
  }
  return launch_status("repack_scales");
}

// The stable sort of inputs by g_idx (counting sort), or an empty vector when g_idx is already
// i / group. INVALID_ARGUMENT when g_idx does not describe groups of `group` inputs.
Expected<std::vector<int32_t>> act_order_perm(std::span<const int32_t> g_idx, int64_t in,
                                              int64_t group) {
  if (g_idx.empty()) return std::vector<int32_t>{};
  const char* op = "repack_gptq";
  if (static_cast<int64_t>(g_idx.size()) != in) {
    return invalid_argument(std::string(op) + ": g_idx has " + std::to_string(g_idx.size()) +
                            " entries, the layer has " + std::to_string(in) + " inputs");
  }
  const int64_t groups = in / group;
  std::vector<int64_t> count(static_cast<size_t>(groups), 0);
  bool identity = true;
  for (int64_t i = 0; i < in; ++i) {
    const int32_t g = g_idx[static_cast<size_t>(i)];
    if (g < 0 || g >= groups) {
      return invalid_argument(std::string(op) + ": g_idx[" + std::to_string(i) + "] is " +
                              std::to_string(g) + ", outside the " + std::to_string(groups) +
                              " groups");
    }
    ++count[static_cast<size_t>(g)];
    identity = identity && g == i / group;
  }
  for (int64_t g = 0; g < groups; ++g) {
    if (count[static_cast<size_t>(g)] != group) {
      return invalid_argument(std::string(op) + ": g_idx puts " +
                              std::to_string(count[static_cast<size_t>(g)]) + " inputs in group " +
                              std::to_string(g) + ", expected " + std::to_string(group));
    }
  }
  if (identity) return std::vector<int32_t>{};
  std::vector<int64_t> next(static_cast<size_t>(groups));
  for (int64_t g = 0; g < groups; ++g) next[static_cast<size_t>(g)] = g * group;
  std::vector<int32_t> perm(static_cast<size_t>(in));
  for (int64_t i = 0; i < in; ++i) {
    perm[static_cast<size_t>(next[static_cast<size_t>(g_idx[static_cast<size_t>(i)])]++)] =
        static_cast<int32_t>(i);
  }
  return perm;
}

template <typename T>
Status launch_dequantize(const W4Layer& l, void* w, cudaStream_t stream) {
  launch_pdl(dequantize_kernel<T>, static_cast<unsigned>(l.out * l.in / (kTile * kTile)), kThreads,
             0, stream, reinterpret_cast<const uint4*>(l.qweight), static_cast<const T*>(l.scales),
             l.zeros, l.perm, static_cast<int>(l.out), static_cast<int>(l.in),
             static_cast<int>(l.group), static_cast<T*>(w));
  return launch_status("w4_dequantize");
}

template <typename T>
Status launch_permute(const void* x, const int32_t* perm, int64_t m, int64_t in, void* out,
                      cudaStream_t stream) {
  constexpr int kBlock = 256;
  const dim3 grid(blocks_for(in, kBlock), static_cast<unsigned>(std::min<int64_t>(m, 65535)));
  launch_pdl(permute_cols_kernel<T>, grid, kBlock, 0, stream, static_cast<const T*>(x), perm, m, in,
             static_cast<T*>(out));
  return launch_status("w4_linear permute_cols");
}

// Bytes of the fused path's scratch for m rows: the copy of x, then the partial-sum slots.
uint64_t fused_x_bytes(int64_t m, int64_t in) {
  return align_up(static_cast<uint64_t>(m * in * 2));
}
uint64_t fused_scratch_bytes(int64_t out, int64_t in, int64_t m) {
  const uint64_t slots = static_cast<uint64_t>(kMaxFusedCtas + out / kTile);
  return fused_x_bytes(m, in) + align_up(slots * static_cast<uint64_t>(m) * kTile * 4);
}

template <typename T, typename C>
Status launch_fused(FusedParams p, cudaStream_t stream) {
  auto* kernel = w4_fused_kernel<T, C>;
  if constexpr (C::kSmemBytes > 48 * 1024) {
    // Per launch rather than once: a host-side call, legal during stream capture.
    TESSERA_CUDA_RETURN_IF_ERROR(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, C::kSmemBytes),
        "w4_linear: raising the dynamic shared memory limit");
  }
  // CTAs resident on the whole GPU: asked once per device and instance (host queries, legal
  // during capture, but microseconds each: a prefill runs hundreds of these layers eagerly).
  static std::atomic<int> cached[kMaxDevices] = {};
  int device = 0;
  TESSERA_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device), "w4_linear: cudaGetDevice");
  int resident = device >= 0 && device < kMaxDevices ? cached[device].load() : 0;
  if (resident == 0) {
    int sms = 0, per_sm = 0;
    TESSERA_CUDA_RETURN_IF_ERROR(
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device),
        "w4_linear: SM count");
    TESSERA_CUDA_RETURN_IF_ERROR(
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, C::kSmemBytes),
        "w4_linear: occupancy");
    resident = std::max(sms * per_sm, 1);
    if (device >= 0 && device < kMaxDevices) cached[device].store(resident);
  }
  const int64_t target = std::min<int64_t>(resident, kMaxFusedCtas);
  const int64_t per = std::max(ceil_div(p.total_units, target), ceil_div(p.k_iters, kMaxSplits));
  p.per_cta = static_cast<int>(per);
  const int64_t grid = ceil_div(p.total_units, per);
  launch_pdl(kernel, dim3(static_cast<unsigned>(grid)), dim3(kThreads), C::kSmemBytes, stream, p);
  return launch_status("w4_linear fused");
}

uint64_t gemv_smem_bytes(int64_t in) {
  return static_cast<uint64_t>(gemv_x_offset(static_cast<int>(in)) + in * 2);
}
// Inputs up to which the m = 1 kernel holds x's row (96 KiB of shared memory); longer rows
// take the fused kernel.
constexpr int64_t kGemvMaxIn = 48 * 1024;

// The m = 1 kernel's CTAs resident on the whole GPU at `smem` bytes of shared memory each
// (asked once per device, instance and size class: host queries, legal during capture).
template <typename T, bool TWO>
Expected<int> gemv_resident(uint64_t smem) {
  constexpr int kClasses = 8;  // shared memory in 12 KiB classes up to 96 KiB
  static std::atomic<int> cached[kMaxDevices][kClasses] = {};
  int device = 0;
  TESSERA_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device), "w4_linear: cudaGetDevice");
  const int cls = std::min<int>(static_cast<int>(smem / (12 << 10)), kClasses - 1);
  const bool cache = device >= 0 && device < kMaxDevices;
  if (cache && cached[device][cls].load() > 0) return cached[device][cls].load();
  int sms = 0, per_sm = 0;
  TESSERA_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device),
                               "w4_linear: SM count");
  const auto class_smem = static_cast<size_t>((cls + 1) * (12 << 10));  // the class's worst
  TESSERA_CUDA_RETURN_IF_ERROR(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
                                   &per_sm, w4_gemv_kernel<T, TWO>, kGemvWarps * 32, class_smem),
                               "w4_linear: occupancy");
  const int resident = std::max(sms * per_sm, 1);
  if (cache) cached[device][cls].store(resident);
  return resident;
}

template <typename T, bool TWO>
Status launch_gemv(const FusedParams& f, cudaStream_t stream) {
  GemvParams p{};
  p.qweight = f.qweight;
  p.scales = f.scales;
  p.zeros = f.zeros;
  p.x = f.x;
  p.y = f.y;
  p.in = f.in;
  p.groups = f.groups;
  p.k_iters = f.k_iters;
  p.group_mul = f.group_mul;
  p.group_shift = f.group_shift;
  const uint64_t smem = gemv_smem_bytes(f.in);
  auto* kernel = w4_gemv_kernel<T, TWO>;
  if (smem > 48 * 1024) {
    TESSERA_CUDA_RETURN_IF_ERROR(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             static_cast<int>(gemv_smem_bytes(kGemvMaxIn))),
        "w4_linear: raising the dynamic shared memory limit");
  }
  TESSERA_ASSIGN_OR_RETURN(const int resident, (gemv_resident<T, TWO>(smem)));
  // K-slices: the most (up to one per warp) whose CTAs still run in one wave, so a small layer
  // spreads over every SM and a large one keeps long strips (x copied by fewer CTAs). Strips
  // per CTA must divide the layer's strips.
  const int64_t strips = f.out / 16;
  int split = 1;
  while (split < kGemvWarps && strips * split * 2 / kGemvWarps <= resident) split *= 2;
  while (strips % (kGemvWarps / split) != 0) split *= 2;
  p.split = split;
  const auto grid = static_cast<unsigned>(strips / (kGemvWarps / split));
  launch_pdl(kernel, dim3(grid), dim3(kGemvWarps * 32), static_cast<size_t>(smem), stream, p);
  return launch_status("w4_linear gemv");
}

// TESSERA_W4_DECODE=fused sends m = 1 to the fused kernel, =gemv to the gemv kernel wherever x's
// row fits (to compare the two side by side); unset or auto: kGemvMaxWeights decides.
std::string_view m1_forced() {
  static const std::string forced = [] {
    const char* v = std::getenv("TESSERA_W4_DECODE");
    return std::string(v != nullptr ? v : "auto");
  }();
  return forced;
}

// Weights (out x in) up to which m = 1 takes w4_gemv_kernel. Measured on the H200 (graph
// replay, tests/kernels_cuda DecodeBandwidth): 4096 x 4096 5.8 us against the fused kernel's
// 9.2, 6144 x 4096 6.7 against 11.1; from 28672 x 4096 on, the fused kernel's stream-K
// balance wins (its CTAs split the units evenly; the gemv's strips come in waves of CTAs).
constexpr int64_t kGemvMaxWeights = int64_t{32} << 20;

W4DecodeKernel decode_kernel_for(int64_t out, int64_t in, int64_t m) {
  if (m > kW4FusedMaxM) return W4DecodeKernel::kDequantGemm;
  if (m > 1 || in > kGemvMaxIn || m1_forced() == "fused") return W4DecodeKernel::kFused;
  if (m1_forced() == "gemv" || out * in <= kGemvMaxWeights) return W4DecodeKernel::kGemv;
  return W4DecodeKernel::kFused;
}

template <typename T, bool TWO>
Status launch_fused_for_m(const FusedParams& p, cudaStream_t stream) {
  if (decode_kernel_for(p.out, p.in, p.m) == W4DecodeKernel::kGemv)
    return launch_gemv<T, TWO>(p, stream);
  if (p.m == 1) return launch_fused<T, FusedConfig<1, true, TWO>>(p, stream);
  if (p.m <= 8) return launch_fused<T, FusedConfig<1, false, TWO>>(p, stream);
  if (p.m <= 16) return launch_fused<T, FusedConfig<2, false, TWO>>(p, stream);
  if (p.m <= 32) return launch_fused<T, FusedConfig<4, false, TWO>>(p, stream);
  return launch_fused<T, FusedConfig<8, false, TWO>>(p, stream);
}

}  // namespace

Status check_w4_shape(int64_t out, int64_t in, int64_t group) {
  if (out <= 0 || out % kW4Tile != 0) {
    return invalid_argument("int4 linear: out = " + std::to_string(out) +
                            " must be a positive multiple of 64");
  }
  if (in <= 0 || in % kW4Tile != 0) {
    return invalid_argument("int4 linear: in = " + std::to_string(in) +
                            " must be a positive multiple of 64");
  }
  if (group != 32 && group != 64 && group != 128 && group != in) {
    return invalid_argument("int4 linear: group = " + std::to_string(group) +
                            " must be 32, 64, 128 or in (" + std::to_string(in) + ")");
  }
  if (in % group != 0) {
    return invalid_argument("int4 linear: in = " + std::to_string(in) + " is not whole groups of " +
                            std::to_string(group));
  }
  if (out / kW4Tile > kMaxTiles || out * in / 8 > (int64_t{1} << 31)) {
    return invalid_argument("int4 linear: [" + std::to_string(out) + ", " + std::to_string(in) +
                            "] is larger than the kernels index");
  }
  return Status::ok();
}

uint64_t w4_bytes(int64_t out, int64_t in, int64_t group) { return regions(out, in, group).total; }

Expected<W4Layer> repack_awq(const AwqTensors& t, DType dtype, void* dst, uint64_t dst_bytes,
                             cudaStream_t stream) {
  const char* op = "repack_awq";
  TESSERA_RETURN_IF_ERROR(check_w4_shape(t.out, t.in, t.group).with_context(op));
  TESSERA_RETURN_IF_ERROR(check_half(dtype, op));
  TESSERA_RETURN_IF_ERROR(check_not_null(t.qweight, op, "qweight"));
  TESSERA_RETURN_IF_ERROR(check_not_null(t.qzeros, op, "qzeros"));
  TESSERA_RETURN_IF_ERROR(check_not_null(t.scales, op, "scales"));
  TESSERA_RETURN_IF_ERROR(check_dst(dst, dst_bytes, t.out, t.in, t.group, op));
  const W4Layer layer = layer_in(dst, t.out, t.in, t.group, dtype);
  TESSERA_RETURN_IF_ERROR(
      launch_repack<Format::kAwq>(t.qweight, t.qzeros, t.scales, 0, nullptr, dst, layer, stream));
  return layer;
}

Expected<W4Layer> repack_gptq(const GptqTensors& t, DType dtype, void* dst, uint64_t dst_bytes,
                              cudaStream_t stream) {
  const char* op = "repack_gptq";
  TESSERA_RETURN_IF_ERROR(check_w4_shape(t.out, t.in, t.group).with_context(op));
  TESSERA_RETURN_IF_ERROR(check_half(dtype, op));
  TESSERA_RETURN_IF_ERROR(check_not_null(t.qweight, op, "qweight"));
  TESSERA_RETURN_IF_ERROR(check_not_null(t.qzeros, op, "qzeros"));
  TESSERA_RETURN_IF_ERROR(check_not_null(t.scales, op, "scales"));
  TESSERA_RETURN_IF_ERROR(check_dst(dst, dst_bytes, t.out, t.in, t.group, op));
  TESSERA_ASSIGN_OR_RETURN(std::vector<int32_t> perm, act_order_perm(t.g_idx, t.in, t.group));
  W4Layer layer = layer_in(dst, t.out, t.in, t.group, dtype);
  if (!perm.empty()) {
    auto* perm_dst =
        reinterpret_cast<int32_t*>(static_cast<uint8_t*>(dst) + regions(t.out, t.in, t.group).perm);
    // From pageable memory: returns once `perm` is staged, so it may go out of scope.
    TESSERA_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(perm_dst, perm.data(), perm.size() * 4, cudaMemcpyHostToDevice, stream),
        "repack_gptq: copying the act-order permutation");
    layer.perm = perm_dst;
  }
  TESSERA_RETURN_IF_ERROR(launch_repack<Format::kGptq>(
      t.qweight, t.qzeros, t.scales, t.zero_offset ? 1 : 0, layer.perm, dst, layer, stream));
  return layer;
}

Status w4_dequantize(const W4Layer& layer, void* w, cudaStream_t stream) {
  const char* op = "w4_dequantize";
  TESSERA_RETURN_IF_ERROR(check_layer(layer, op));
  TESSERA_RETURN_IF_ERROR(check_not_null(w, op, "w"));
  TESSERA_RETURN_IF_ERROR(check_aligned(w, 16, op, "w"));
  if (layer.dtype == DType::kBF16) return launch_dequantize<__nv_bfloat16>(layer, w, stream);
  return launch_dequantize<__half>(layer, w, stream);
}

uint64_t w4_workspace_bytes(int64_t out, int64_t in, int64_t max_m) {
  max_m = std::max<int64_t>(max_m, 1);
  const uint64_t fused = fused_scratch_bytes(out, in, std::min(max_m, kW4FusedMaxM));
  const uint64_t prefill = max_m > kW4FusedMaxM ? align_up(static_cast<uint64_t>(out * in * 2)) : 0;
  return static_cast<uint64_t>(kLockBytes) + std::max(fused, prefill);
}

W4DecodeKernel w4_decode_kernel(int64_t out, int64_t in, int64_t m) {
  return decode_kernel_for(out, in, m);
}

Status w4_linear(const W4Layer& layer, const void* x, int64_t m, void* y, void* workspace,
                 uint64_t workspace_bytes, Gemm* gemm, cudaStream_t stream) {
  const char* op = "w4_linear";
  TESSERA_RETURN_IF_ERROR(check_layer(layer, op));
  if (m < 1) return invalid_argument(std::string(op) + ": m = " + std::to_string(m) + " < 1");
  TESSERA_RETURN_IF_ERROR(check_not_null(x, op, "x"));
  TESSERA_RETURN_IF_ERROR(check_not_null(y, op, "y"));
  TESSERA_RETURN_IF_ERROR(check_not_null(workspace, op, "workspace"));
  TESSERA_RETURN_IF_ERROR(check_aligned(workspace, 16, op, "workspace"));
  const uint64_t need = w4_workspace_bytes(layer.out, layer.in, m);
  if (workspace_bytes < need) {
    return invalid_argument(std::string(op) + ": workspace has " + std::to_string(workspace_bytes) +
                            " bytes, m = " + std::to_string(m) +
                            " needs w4_workspace_bytes = " + std::to_string(need));
  }
  auto* scratch = static_cast<uint8_t*>(workspace) + kLockBytes;
  const bool bf16 = layer.dtype == DType::kBF16;

  if (m > kW4FusedMaxM) {
    if (gemm == nullptr) {
      return invalid_argument(std::string(op) + ": m = " + std::to_string(m) + " > " +
                              std::to_string(kW4FusedMaxM) + " needs a Gemm (it is null)");
    }
    TESSERA_RETURN_IF_ERROR(bf16 ? launch_dequantize<__nv_bfloat16>(layer, scratch, stream)
                                 : launch_dequantize<__half>(layer, scratch, stream));
    const GemmShape shape{m, layer.out, layer.in, layer.dtype, layer.dtype, false};
    return gemm->linear(shape, x, scratch, nullptr, y, stream);
  }

  // The fused kernel reads x with 16-byte copies from its columns in repacked order: act-order
  // layers (and a misaligned x) read a permuted copy instead.
  const void* x_in = x;
  if (layer.perm != nullptr || !aligned(x, 16)) {
    TESSERA_RETURN_IF_ERROR(
        bf16 ? launch_permute<__nv_bfloat16>(x, layer.perm, m, layer.in, scratch, stream)
             : launch_permute<__half>(x, layer.perm, m, layer.in, scratch, stream));
    x_in = scratch;
  }
  FusedParams p{};
  p.qweight = reinterpret_cast<const uint8_t*>(layer.qweight);
  p.scales = layer.scales;
  p.zeros = layer.zeros;
  p.x = x_in;
  p.y = y;
  p.partials = reinterpret_cast<float*>(scratch + fused_x_bytes(m, layer.in));
  p.counters = static_cast<int*>(workspace);
  p.m = static_cast<int>(m);
  p.out = static_cast<int>(layer.out);
  p.in = static_cast<int>(layer.in);
  p.groups = static_cast<int>(layer.in / layer.group);
  p.two_groups = layer.group == 32;
  p.group_mul = layer.group == 32 ? 2 : layer.group == 64 || layer.group == 128 ? 1 : 0;
  p.group_shift = layer.group == 128 ? 1 : 0;
  p.k_iters = static_cast<int>(layer.in / kW4Tile);
  p.total_units = static_cast<int>((layer.out / kW4Tile) * p.k_iters);
  if (p.two_groups) {
    return bf16 ? launch_fused_for_m<__nv_bfloat16, true>(p, stream)
                : launch_fused_for_m<__half, true>(p, stream);
  }
  return bf16 ? launch_fused_for_m<__nv_bfloat16, false>(p, stream)
              : launch_fused_for_m<__half, false>(p, stream);
}

}  // namespace tessera::cuda
