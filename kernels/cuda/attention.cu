// Paged causal attention for sm_90a: FlashAttention-2 style tiles with mma.sync m16n8k16
// (bf16/fp16 in, fp32 accumulate), ldmatrix and cp.async, plus a split-K combine kernel.
//
// Main kernel: grid (ceil(max_query_len * G / 64), num_seqs, num_kv_heads * num_splits), 128
// threads (4 warps x 16 rows). Row R of a sequence's packed rows is (token R / G, query head
// kv_head * G + R % G), G = num_heads / num_kv_heads. Each warp keeps its 16 Q rows as A
// fragments (registers for head_dim <= 128, shared memory for 256), walks the keys of its split
// in tiles of kBlockN (K and V in a kStages-deep cp.async pipeline in shared memory, each key's
// address looked up in the block table, keys past the end zero-filled), computes S = Q K^T,
// an online softmax in the log2 domain and O += P V with P rounded to the input dtype. The first
// stages' copies of the keys earlier steps wrote are issued before the PDL wait (they stream in
// while the kernel before, rope, finishes); only the step's own keys, which rope writes, after it.
// Decode with AttentionRope (the ROPE instance, 16-bit cache, head_dim 64 / 128) has no rope
// kernel before it: the CTA applies rope_and_cache's head norms and rotation (rope_math.cuh, the
// same bits) to its rows' q into shared memory, and the warp whose keys hold the step's own key
// computes that k and v, stores them in the cache and writes them into the tile's stage (no copy
// of them); the tables and norm weights are read before the wait (Qwen3-30B-A3B batch-1 decode
// 1.014x on an H100).
// A CTA with at most 16 rows (decode: one token x G heads) splits keys instead of rows: every
// warp holds the same rows and takes 16 keys of each 64-key tile (loading, awaiting and reading
// only those, with __syncwarp instead of CTA barriers), and warp 0 merges the four softmax
// states at the end. Decode attention reads K/V at 0.96 of the copy bandwidth this way
// (batch 256 x 1536 keys, H200; 0.65 with one computing warp per CTA and two stages, 0.82 with a
// runtime division by the block size per 16-byte copy instead of BlockDivisor's reciprocal).
//
// An FP8 (E4M3) cache: the stages hold bytes (HD per key, five stages deep up to head_dim 128,
// so as many bytes are in flight as with two 16-bit stages). Decode (split keys) reads each
// lane's K and V bytes straight from the stage into registers and widens them with
// cvt.rn.f16x2.e4m3x2 for fp16 MMAs, in a permuted head-dimension order that needs no shuffles
// (compute_tile_regs): 0.81 of the copy bandwidth at batch 256 x 1536 keys with three CTAs per
// SM (the DECODE instance, Config), 0.71 with two, against 0.43 when the CTA widened every tile
// into shared memory between barriers. Prefill still widens each
// tile's K, then V, into one 16-bit tile that ldmatrix reads (the widening is shared by the
// CTA's four warps there).
//
// Split-K workspace (num_splits > 1), all fp32:
//   o_part: [num_splits][total_q][num_heads][head_dim]  the split's output, already divided by
//                                                       its own softmax denominator
//   lse:    [num_splits][total_q][num_heads]            natural-log sum-exp of the split's
//                                                       scaled scores; -inf when it saw no key
// A sequence spreads the keys its rows read (its context; with a sliding window, from its first
// query's window start on) over the num_splits CTAs in whole 64-key tiles (seq_split_size) and
// uses n_used = ceil(keys / that) of them, computed on the device from context_lens
// (graphs replay one num_splits with varying lengths); splits past n_used do nothing and the
// combine reads only the first n_used. When n_used == 1 the single split writes `out` directly and
// the combine skips the sequence. The combine asks for a row's lse and O of up to
// kCombineAtOnce splits at once (one round trip to L2; more splits: the lse's, then the O's).
#include "kernels/cuda/attention.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <type_traits>

#include "kernels/cuda/attention_common.cuh"
#include "kernels/cuda/attention_sm90.h"
#include "kernels/cuda/block_trace.cuh"
#include "kernels/cuda/cuda_util.h"
#include "kernels/cuda/device_math.cuh"
#include "kernels/cuda/rope_math.cuh"

namespace tessera::cuda {

namespace {

using namespace attn;  // NOLINT(google-build-using-namespace): the shared PTX wrappers

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kRowsPerCta = kWarps * 16;
constexpr int kAllKeys = 0, kOldKeys = 1, kNewKeys = 2;  // load_kv_keys' key sets
constexpr int kSplitAlign = 64;     // split_size must be a multiple of this (>= every kBlockN)
constexpr int kMinSplitSize = 256;  // plan_attention_splits never cuts finer than this
constexpr int kMaxPlannedSplits = 64;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr int kCombineThreads = 128;
constexpr int kCombineAtOnce = 8;  // splits the combine reads in one round trip (more: two)

// FP8 (an E4M3 cache): K/V tiles stream through shared memory as bytes (half the traffic of
// a bf16 cache); decode reads them into registers (compute_tile_regs), prefill widens each
// tile's K, then its V, into one tile of the compute dtype (widen_fp8x4) that the MMAs read as
// in the 16-bit path.
//
// DECODE: the kernel instance for launches whose CTAs all split keys (max_query_len x G <= 16,
// every decode step of a graph): only that loop is compiled, so its registers are not sized for
// the row path too, and an FP8 cache gets no widened tile (decode reads registers) and four
// stages, which lets three CTAs share an SM instead of two (__launch_bounds__ below).
template <int HD, bool FP8 = false, bool DECODE = false>
struct Config {
  // Keys per tile. head_dim 256 uses 32 so that O (128 fp32 registers) + S fit without spills.
  static constexpr int kBlockN = HD > 128 ? 32 : 64;
  // K/V tiles in flight: up to head_dim 128, two tiles load while a third is computed (the
  // registers allow two CTAs per SM anyway, and the shared memory still does); head_dim 256
  // keeps two stages so that two CTAs fit.
  // FP8 tiles are half the bytes: five stages (four in flight, as many bytes as the 16-bit
  // path's two) up to head_dim 128, still two CTAs per SM; the FP8 decode instance four, so
  // that three fit.
  static constexpr int kStages = FP8 ? (HD > 128 ? 3 : (DECODE ? 4 : 5)) : (HD > 128 ? 2 : 3);
  // A CTA whose rows fit one warp (decode: one token x the group's heads) spreads each tile's
  // keys over its warps, 16 each, instead of leaving three warps idle; it needs 16 keys per warp.
  static constexpr bool kCanSplitKeys = kBlockN == kWarps * 16;
  static_assert(!DECODE || kCanSplitKeys, "the decode instance splits keys");
  // CTAs per SM the registers must allow (__launch_bounds__): three for the FP8 decode instance.
  static constexpr int kMinCtasPerSm = FP8 && DECODE ? 3 : 1;
  // Q fragments stay in registers up to head_dim 128; for 256 they are re-read from shared memory.
  static constexpr bool kQInSmem = HD > 128;
  // Shared-memory row stride in elements: +8 (16 bytes) makes the 8 rows an ldmatrix reads hit
  // 8 distinct 16-byte bank groups.
  static constexpr int kStride = HD + 8;
  static constexpr int kTileElems = kBlockN * kStride;
  // An FP8 stage row: HD bytes, unpadded (a warp's 16-byte copies and reads cover whole
  // consecutive rows, so they touch every bank once).
  static constexpr int kRawStride = HD;
  // FP8 stage chunk c of row r sits at chunk c ^ raw_swizzle(r). With head_dim 128 (a row is
  // the 128 bytes of all banks) that spreads the split-keys register reads over the banks: a
  // quarter warp reads K rows r, r + 1 (r even) at chunks 4 i + {0..3}, and V rows 2 tig + x at
  // chunks {g, g + 1}; both land in 8 distinct chunks. Other head sizes are not swizzled.
  static __device__ __forceinline__ int raw_swizzle(int row) {
    if constexpr (FP8 && HD == 128) {
      return ((row & 1) << 2) ^ (row & 6);
    } else {
      return 0;
    }
  }
  // Bytes of one pipeline stage's K (or V) tile, and of all the stages (K then V).
  static constexpr size_t kStageTileBytes =
      FP8 ? static_cast<size_t>(kBlockN * kRawStride) : static_cast<size_t>(kTileElems) * 2;
  static constexpr size_t kStagesBytes = 2 * kStages * kStageTileBytes;
  // FP8 prefill only: the widened tile the MMAs read (K, then V of the same tile), after the
  // stages.
  static constexpr size_t kComputeBytes = FP8 && !DECODE ? static_cast<size_t>(kTileElems) * 2 : 0;
  // The stages, the widened tiles (FP8), then Q (head_dim 256 only).
  static constexpr size_t kQOffset = kStagesBytes + kComputeBytes;
  static constexpr size_t kSmemBytes =
      kQOffset + (kQInSmem ? static_cast<size_t>(kRowsPerCta * kStride) * 2 : 0);
  // The split-keys merge reuses the tiles' memory: warps 1.. write O [16][kMergeStride] and m,
  // l [16][2] in fp32. +8 floats per row puts the 4 rows a half-warp's float2 accesses touch in
  // distinct banks (a stride of HD floats made them 8-way conflicts).
  static constexpr int kMergeStride = HD + 8;
  static_assert(!kCanSplitKeys ||
                    (kWarps - 1) * 16 * (kMergeStride + 2) * sizeof(float) <= kQOffset,
                "split-keys merge must fit the tiles' shared memory");
};

// Four E4M3 bytes (x's bytes 0..3, lowest first) widened exactly to T: two packed pairs, the
// lower element in the low 16 bits. Integer ops and one multiply, no conversion instructions
// (cvt runs at a quarter of the ALU rate on sm_90: widening through cvt.f16x2.e4m3x2 and fp32
// made decode attention conversion-bound, no faster than a 16-bit cache). Each byte goes to the
// top of a 16-bit lane (sign in place); its 7 exponent-mantissa bits are shifted under T's
// exponent field, which leaves the value 2^-(bias_T - 7) times too small (2^-120 for bf16,
// 2^-8 for fp16), subnormals included; one multiply by that power of two is exact. E4M3's NaN
// (0x7f) is not preserved: the cache never holds one (writes saturate).
template <typename T>
__device__ __forceinline__ uint2 widen_fp8x4(uint32_t x) {
  constexpr bool kHalf = std::is_same_v<T, __half>;
  using T2 = std::conditional_t<kHalf, __half2, __nv_bfloat162>;
  // fp16: sign | (exponent-mantissa << 7), times 2^8; bf16: << 4, times 2^120.
  constexpr int kShift = kHalf ? 1 : 4;
  constexpr uint32_t kBits = kHalf ? 0x3f803f80u : 0x07f007f0u;
  constexpr uint32_t kScale = kHalf ? 0x5c005c00u : 0x7b807b80u;
  const uint32_t lo = __byte_perm(x, 0u, 0x1404u);  // lanes: byte 0 << 8, byte 1 << 8
  const uint32_t hi = __byte_perm(x, 0u, 0x3424u);  // lanes: byte 2 << 8, byte 3 << 8
  const uint32_t in[2] = {(lo & 0x80008000u) | ((lo >> kShift) & kBits),
                          (hi & 0x80008000u) | ((hi >> kShift) & kBits)};
  T2 scale, v[2];
  memcpy(&scale, &kScale, 4);
  memcpy(v, in, 8);
  v[0] = __hmul2(v[0], scale);
  v[1] = __hmul2(v[1], scale);
  uint2 r;
  memcpy(&r, v, 8);
  return r;
}

// Four E4M3 bytes (x's bytes 0..3) widened exactly to two fp16 pairs: lo gets bytes 0, 1 (byte 0
// in the low half), hi bytes 2, 3. One cvt per pair.
__device__ __forceinline__ void fp8x4_to_half2x2(uint32_t x, uint32_t& lo, uint32_t& hi) {
  asm("{\n"
      "  .reg .b16 l, h;\n"
      "  mov.b32 {l, h}, %2;\n"
      "  cvt.rn.f16x2.e4m3x2 %0, l;\n"
      "  cvt.rn.f16x2.e4m3x2 %1, h;\n"
      "}\n"
      : "=r"(lo), "=r"(hi)
      : "r"(x));
}

// A packed pair of T as a packed fp16 pair: rounded, and clamped to fp16's finite range (a bf16
// query beyond +-65504 would otherwise become inf and the row NaN).
template <typename T>
__device__ __forceinline__ uint32_t to_half2_bits(uint32_t pair) {
  if constexpr (std::is_same_v<T, __half>) {
    return pair;
  } else {
    __nv_bfloat162 v;
    memcpy(&v, &pair, 4);
    float2 f = __bfloat1622float2(v);
    f.x = fminf(fmaxf(f.x, -65504.0f), 65504.0f);
    f.y = fminf(fmaxf(f.y, -65504.0f), 65504.0f);
    const __half2 h = __float22half2_rn(f);
    uint32_t r;
    memcpy(&r, &h, 4);
    return r;
  }
}

// BYTES (2, 4, 8 or 16) of shared memory at addr into out[0..]: one load (2 bytes: the low half
// of out[0], the high half zero).
template <int BYTES>
__device__ __forceinline__ void lds(uint32_t addr, uint32_t* out) {
  if constexpr (BYTES == 16) {
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(out[0]), "=r"(out[1]), "=r"(out[2]), "=r"(out[3])
                 : "r"(addr)
                 : "memory");
  } else if constexpr (BYTES == 8) {
    asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];\n"
                 : "=r"(out[0]), "=r"(out[1])
                 : "r"(addr)
                 : "memory");
  } else if constexpr (BYTES == 4) {
    asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(out[0]) : "r"(addr) : "memory");
  } else {
    static_assert(BYTES == 2, "lds takes 2, 4, 8 or 16 bytes");
    uint16_t v;
    asm volatile("ld.shared.u16 %0, [%1];\n" : "=h"(v) : "r"(addr) : "memory");
    out[0] = v;
  }
}

// Keys per split for a sequence that reads `keys` keys (its context, or with a window the keys
// from its first query's window start on): spread over all num_splits CTAs, rounded up to whole
// 64-key tiles (never more than split_size, since num_splits * split_size covers every context).
// Decided on the device from the actual lengths, so a CUDA graph captured with a fixed
// num_splits still spreads a short context over several CTAs.
__device__ __forceinline__ int seq_split_size(const Params& p, int keys) {
  const int per = (keys + p.num_splits - 1) / p.num_splits;
  return max(kSplitAlign, (per + kSplitAlign - 1) / kSplitAlign * kSplitAlign);
}

// Splits a sequence reading `keys` keys uses: ceil(keys / seq_split_size) (1 without split-K).
__device__ __forceinline__ int splits_used(const Params& p, int keys) {
  if (p.num_splits <= 1) return 1;
  const int per = seq_split_size(p, keys);
  return min(p.num_splits, (keys + per - 1) / per);
}

// ---------------------------------------------------------------------------------------------
// Fragment layouts (PTX m16n8k16, 16-bit inputs; gid = lane / 4, tig = lane % 4):
//   A 16x16: a0 (row gid, cols 2tig..+1), a1 (row gid+8, same cols), a2 (row gid, cols
//            8+2tig..+1), a3 (row gid+8, cols 8+2tig..+1)
//   B 16x8:  b0 (k 2tig..+1, n gid), b1 (k 8+2tig..+1, n gid)
//   C 16x8:  c0,c1 (row gid, cols 2tig..+1), c2,c3 (row gid+8, same cols)
// ldmatrix.x4: lanes 8j..8j+7 give the row addresses of matrix j, register j receives it.

// ROPE (decode, AttentionRope): q, k and v come raw from p.qkv; the kernel applies the head norms
// and the rotation (rope_math.cuh, rope_and_cache's bits) to its rows' q, into shared memory after
// the stages (kRopeQBytes), and the warp whose keys hold the step's own key computes its k and v,
// stores them in the cache and into that tile's stage (no copy of them from the cache).
template <int HD>
constexpr size_t kRopeQBytes = static_cast<size_t>(16 * (HD + 8)) * 2;

template <typename T, int HD, bool FP8, bool DECODE, bool ROPE = false>
__global__ void __launch_bounds__(kThreads, (Config<HD, FP8, DECODE>::kMinCtasPerSm))
    paged_attention_kernel(const __grid_constant__ Params p) {
  block_trace::Mark mark;
  // The sequences' lengths and block tables are the host's (copied before the step's kernels),
  // so everything up to the first read of q or the cache runs before the wait, while the kernel
  // before (RoPE, which writes them) finishes.
  dev::pdl_launch_dependents();
  using C = Config<HD, FP8, DECODE>;
  using Ops = HalfOps<T>;
  constexpr int kBlockN = C::kBlockN;
  constexpr int kStages = C::kStages;
  constexpr int kStride = C::kStride;
  constexpr bool kQInSmem = C::kQInSmem;
  constexpr int kQkSteps = HD / 16;      // k-steps of S = Q K^T
  constexpr int kSTiles = kBlockN / 8;   // n-tiles of S
  constexpr int kOTiles = HD / 8;        // n-tiles of O
  constexpr int kChunksPerRow = HD / 8;  // 16-byte chunks per Q row
  constexpr uint32_t kStageBytes = static_cast<uint32_t>(C::kStageTileBytes);
  static_assert((kRowsPerCta * kChunksPerRow) % kThreads == 0, "Q load must split evenly");
  static_assert(!ROPE || (DECODE && !FP8 && (HD == 64 || HD == 128)),
                "the rope runs in the 16-bit decode instance, head_dim 64 or 128");

  const int seq = blockIdx.y;
  const int ctx = p.context_lens[seq];
  if (ctx <= 0) return;  // padding sequence
  const int q_start = p.cu_query_lens[seq];
  const int qlen = p.cu_query_lens[seq + 1] - q_start;
  const int group = p.group;
  const int rows_valid = qlen * group;
  // Row tiles in reverse: under the causal mask the last rows of a prompt see the most keys,
  // so starting them first keeps a long tail of big CTAs from finishing the grid alone.
  const int tile_row0 = static_cast<int>(gridDim.x - 1 - blockIdx.x) * kRowsPerCta;
  if (tile_row0 >= rows_valid) return;
  const int kv_head = static_cast<int>(blockIdx.z) / p.num_splits;
  const int split = static_cast<int>(blockIdx.z) % p.num_splits;
  const int first_pos = ctx - qlen;  // position of the sequence's first query token
  // The sequence's rows read keys [seq_begin, ctx): with a window, the keys before its first
  // query's window are never loaded, and the splits share only the keys that are read.
  const int seq_begin = window_start(p, first_pos);
  const int n_used = splits_used(p, ctx - seq_begin);
  if (split >= n_used) return;
  const bool direct = n_used == 1;  // write `out`, no workspace

  const int per_split = p.num_splits > 1 ? seq_split_size(p, ctx - seq_begin) : ctx;
  const int split_begin = p.num_splits > 1 ? seq_begin + split * per_split : 0;
  const int split_end = p.num_splits > 1 ? min(ctx, split_begin + per_split) : ctx;
  const int last_row = min(tile_row0 + kRowsPerCta - 1, rows_valid - 1);
  // Keys [kv_begin, kv_end) are visible to at least one row of this CTA: from its first row's
  // window start to its last row's position.
  const int kv_begin = max(split_begin, window_start(p, first_pos + tile_row0 / group));
  const int kv_end = min(split_end, first_pos + last_row / group + 1);
  const int n_tiles = kv_end > kv_begin ? (kv_end - kv_begin + kBlockN - 1) / kBlockN : 0;

  const int warp = static_cast<int>(threadIdx.x) / 32;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int gid = lane >> 2;
  const int tig = lane & 3;
  // Split keys: every warp holds the CTA's (at most 16) rows and takes its own 16 keys of each
  // tile; the warps' partial softmax states are merged at the end. Otherwise each warp takes 16
  // rows and every key.
  const bool split_keys = C::kCanSplitKeys && (DECODE || rows_valid - tile_row0 <= 16);
  const int warp_row0 = split_keys ? tile_row0 : tile_row0 + warp * 16;
  const bool warp_active = warp_row0 < rows_valid;
  const int warp_last = min(warp_row0 + 15, rows_valid - 1);
  // Largest key any row of the warp may see, and the smallest key limit (below it no masking).
  const int warp_max_lim = min(first_pos + warp_last / group, kv_end - 1);
  const int warp_min_lim = min(first_pos + warp_row0 / group, kv_end - 1);
  // The window's starts of the warp's first and last rows: no row sees a key below the first,
  // every row sees the keys from the last on (up to its limit), so no masking there.
  const int warp_min_lo = window_start(p, first_pos + warp_row0 / group);
  const int warp_max_lo = window_start(p, first_pos + warp_last / group);

  // This thread's two rows (gid and gid + 8 of the warp's 16).
  int64_t row_index[2];  // (q row) * num_heads + head, or -1 past the sequence's rows
  int row_lim[2];        // last key the row may see (-1: none)
  int row_lo[2];         // first key the row may see (its window's start)
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = warp_row0 + gid + 8 * r;
    if (row < rows_valid) {
      const int token = row / group;
      const int head = kv_head * group + row % group;
      row_index[r] = static_cast<int64_t>(q_start + token) * p.num_heads + head;
      row_lim[r] = min(first_pos + token, kv_end - 1);
      row_lo[r] = window_start(p, first_pos + token);
    } else {
      row_index[r] = -1;
      row_lim[r] = -1;
      row_lo[r] = 0;
    }
  }

  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* smem = reinterpret_cast<T*>(smem_raw);
  const uint32_t smem_base = smem_u32(smem);
  // K stage s at smem + s * kStageBytes, V stage s at smem + (kStages + s) * kStageBytes, then
  // (FP8) the widened K and V tiles, then Q.
  const uint32_t sq_base = smem_base + static_cast<uint32_t>(C::kQOffset);
  const uint32_t sk_wide = smem_base + static_cast<uint32_t>(C::kStagesBytes);

  const T* q = static_cast<const T*>(p.q);
  const int32_t* table = p.block_tables + seq * p.block_table_stride;

  // K/V rows move in 16-byte chunks: 8 elements of a 16-bit cache, 16 of an FP8 one; a stage
  // row is kStride elements (16-bit) or HD bytes (FP8) apart.
  constexpr int kKvElemBytes = FP8 ? 1 : static_cast<int>(sizeof(T));
  constexpr int kKvChunks = HD * kKvElemBytes / 16;  // per K/V row
  constexpr int kKvPerThread = (kBlockN * kKvChunks + kThreads - 1) / kThreads;
  constexpr int kStageRowBytes = FP8 ? C::kRawStride : kStride * static_cast<int>(sizeof(T));
  // Byte offset of chunk `chunk` of row `row` in a stage (FP8 rows are swizzled, Config).
  auto stage_offset = [](int row, int chunk) {
    return static_cast<uint32_t>(row * kStageRowBytes + ((chunk ^ C::raw_swizzle(row)) * 16));
  };

  // FP8 split keys (decode) computes from registers: each lane reads its K and V bytes of the
  // stage directly and widens them with cvt.rn.f16x2.e4m3x2, so there is no widened tile and no
  // barrier around one, and the MMAs are fp16 (E4M3 is exact in fp16; Q is rounded to fp16, P
  // is kept in fp16). The head dimension is permuted (a dot product does not care about the
  // order of its terms): k-step kk of S = Q K^T takes the lane's bytes [4s, 4s + 4) of its K load
  // i (kk = i * kKStepsPerLoad + s), i.e. head dims k_dim(kk) + {0, 1} (b0) and + {2, 3} (b1), and
  // Q's A fragments take the same dims. O's n-tile j, column n is head dim n * (HD / 8) + j, so a
  // lane's V bytes of a key are HD / 8 consecutive ones (o_dim undoes it when O is written).
  constexpr bool kRegs = FP8 && C::kCanSplitKeys;
  constexpr int kKLoadBytes = HD / 4 < 16 ? HD / 4 : 16;  // K bytes per lane, key and load
  constexpr int kKLoads = HD / 4 / kKLoadBytes;
  constexpr int kKStepsPerLoad = kKLoadBytes / 4;
  constexpr int kVBytes = HD / 8;  // V bytes per lane and key
  constexpr int kVWords = kVBytes < 4 ? 1 : kVBytes / 4;
  auto k_dim = [&](int kk) {
    return kKLoadBytes * (4 * (kk / kKStepsPerLoad) + tig) + 4 * (kk % kKStepsPerLoad);
  };
  const bool regs_path = kRegs && split_keys;
  auto o_dim = [&](int j, int e) {
    return regs_path ? (2 * tig + e) * (HD / 8) + j : 8 * j + 2 * tig + e;
  };

  // f(std::true_type{}) when the CTA splits keys between its warps (split_keys), else
  // f(std::false_type{}): each instance compiles only the paths it can take.
  auto by_split_keys = [&](auto&& f) {
    if constexpr (DECODE) {
      f(std::true_type{});
    } else if constexpr (C::kCanSplitKeys) {
      if (split_keys) {
        f(std::true_type{});
      } else {
        f(std::false_type{});
      }
    } else {
      f(std::false_type{});
    }
  };
  // f(row, chunk) for this thread's chunks of a K or V tile (split keys: each warp its own 16
  // rows; rows: the CTA's threads over the tile).
  auto for_my_kv_chunks = [&](auto split_c, auto&& f) {
    if constexpr (decltype(split_c)::value) {
      constexpr int kWarpChunks = 16 * kKvChunks;
      constexpr int kPerLane = (kWarpChunks + 31) / 32;
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) {
        const int c = lane + i * 32;
        if (kPerLane * 32 != kWarpChunks && c >= kWarpChunks) break;
        f(warp * 16 + c / kKvChunks, c % kKvChunks);
      }
    } else {
#pragma unroll
      for (int i = 0; i < kKvPerThread; ++i) {
        const int c = static_cast<int>(threadIdx.x) + i * kThreads;
        if (kKvPerThread * kThreads != kBlockN * kKvChunks && c >= kBlockN * kKvChunks) break;
        f(c / kKvChunks, c % kKvChunks);
      }
    }
  };
  // Copies of tile `tile`'s K and V rows into stage `stage`: every key (kAllKeys; past kv_end
  // zeros), those before the step's own (kOldKeys: the cache as earlier steps left it, and the
  // zeros), or the step's own keys [first_pos, kv_end) (kNewKeys: the kernel before writes them).
  auto load_kv_keys = [&](auto split_c, int tile, int stage, int which) {
    const int n0 = kv_begin + tile * kBlockN;
    const uint32_t k_dst = smem_base + stage * kStageBytes;
    const uint32_t v_dst = smem_base + (kStages + stage) * kStageBytes;
    const auto* k_bytes = static_cast<const char*>(p.k_cache);
    const auto* v_bytes = static_cast<const char*>(p.v_cache);
    for_my_kv_chunks(split_c, [&](int row, int chunk) {
      const int key = n0 + row;
      const bool is_new = key >= first_pos && key < kv_end;
      if ((which == kOldKeys && is_new) || (which == kNewKeys && !is_new)) return;
      if (ROPE && is_new) return;  // put_new_key writes it
      const uint32_t off = stage_offset(row, chunk);
      if (key < kv_end) {
        const int64_t slot = paged_slot(p, table, key);
        const int64_t src = (slot * p.num_kv_heads + kv_head) * HD * kKvElemBytes + chunk * 16;
        cp_async_16(k_dst + off, k_bytes + src, true);
        cp_async_16(v_dst + off, v_bytes + src, true);
      } else {
        cp_async_16(k_dst + off, k_bytes, false);
        cp_async_16(v_dst + off, v_bytes, false);
      }
    });
  };
  // The first stages' keys from earlier steps stream in while the kernel before finishes (they
  // are committed with the step's own keys after the wait, run_tiles' first group).
  auto early_kv = [&](auto split_c) {
#pragma unroll
    for (int st = 0; st < kStages - 1; ++st) {
      if (st < n_tiles) load_kv_keys(split_c, st, st, kOldKeys);
    }
  };
  if (n_tiles > 0) by_split_keys(early_kv);
  constexpr int kP = HD >= 64 ? HD / 64 : 1;  // rotation pairs a lane holds (ROPE: HD 64, 128)
  constexpr int kHalf = HD / 2;
  const int i0 = lane * kP;  // the lane's first pair (i0 + i, i0 + kHalf + i); v: 2 i0 + [0, 2kP)
  // ROPE: the rotation tables at the sequence's position and the head norms' weights (the
  // model's constants; the position is the host's context length) before the wait.
  float cs[kP] = {}, sn[kP] = {}, qw1[kP] = {}, qw2[kP] = {}, kw1[kP] = {}, kw2[kP] = {};
  const bool norm = ROPE && p.rope.q_norm != nullptr;
  if constexpr (ROPE) {
    const int pos = ctx - 1;  // the one query token's position
    if (pos < p.rope.max_position) {
#pragma unroll
      for (int i = 0; i < kP; ++i) {
        cs[i] = p.rope.cos[static_cast<int64_t>(pos) * kHalf + i0 + i];
        sn[i] = p.rope.sin[static_cast<int64_t>(pos) * kHalf + i0 + i];
      }
    }
    if (norm) {
#pragma unroll
      for (int i = 0; i < kP; ++i) {
        qw1[i] = dev::to_float(static_cast<const T*>(p.rope.q_norm)[i0 + i]);
        qw2[i] = dev::to_float(static_cast<const T*>(p.rope.q_norm)[i0 + kHalf + i]);
        kw1[i] = dev::to_float(static_cast<const T*>(p.rope.k_norm)[i0 + i]);
        kw2[i] = dev::to_float(static_cast<const T*>(p.rope.k_norm)[i0 + kHalf + i]);
      }
    }
  }
  dev::pdl_wait();  // q and the cache are written by the kernel before
  mark.wait_returned();
  // ROPE: the rows' q normed and rotated into sq; the step's own key and value (the warp whose
  // keys hold it) into knew / vnew and the cache.
  T* sq = reinterpret_cast<T*>(smem_raw + C::kSmemBytes);  // [16][kStride], ROPE only
  T knew[2 * kP], vnew[2 * kP];
  const int new_off = ctx - 1 - kv_begin;  // the step's key, from the CTA's first key
  const bool own_new = ROPE && new_off >= 0 && ctx - 1 < kv_end && warp == new_off % kBlockN / 16;
  // The lane's k and v of the step's key into a K row and a V row (the cache's or a stage's).
  auto store_new_kv = [&](T* k_row, T* v_row) {
#pragma unroll
    for (int i = 0; i < kP; ++i) {
      k_row[i0 + i] = knew[i];
      k_row[i0 + kHalf + i] = knew[kP + i];
      v_row[2 * i0 + 2 * i] = vnew[2 * i];
      v_row[2 * i0 + 2 * i + 1] = vnew[2 * i + 1];
    }
  };
  if constexpr (ROPE) {
    const T* row = static_cast<const T*>(p.qkv) +
                   static_cast<int64_t>(q_start) * (p.num_heads + 2 * p.num_kv_heads) * HD;
    // Every raw value this warp needs asked for at once (one round trip to L2): its q rows (rr =
    // warp + kWarps j), and (the owning warp) the step's k and v.
    constexpr int kRowsPerWarp = 16 / kWarps;
    float q1[kRowsPerWarp][kP], q2[kRowsPerWarp][kP], k1[kP], k2[kP];
#pragma unroll
    for (int j = 0; j < kRowsPerWarp; ++j) {
      const int r = tile_row0 + warp + kWarps * j;
      const T* src = row + (kv_head * group + r % group) * HD;
#pragma unroll
      for (int i = 0; i < kP; ++i) {
        q1[j][i] = r < rows_valid ? dev::to_float(src[i0 + i]) : 0.0f;
        q2[j][i] = r < rows_valid ? dev::to_float(src[i0 + kHalf + i]) : 0.0f;
      }
    }
    if (own_new) {
      const T* ksrc = row + (p.num_heads + kv_head) * HD;
      const T* vsrc = row + (p.num_heads + p.num_kv_heads + kv_head) * HD + 2 * i0;
#pragma unroll
      for (int i = 0; i < kP; ++i) {
        k1[i] = dev::to_float(ksrc[i0 + i]);
        k2[i] = dev::to_float(ksrc[i0 + kHalf + i]);
        vnew[2 * i] = vsrc[2 * i];
        vnew[2 * i + 1] = vsrc[2 * i + 1];
      }
    }
    // rope_and_cache_kernel's arithmetic on a head's pairs.
    auto roped = [&](float(&f1)[kP], float(&f2)[kP], const float(&w1)[kP], const float(&w2)[kP],
                     float(&lo)[kP], float(&hi)[kP]) {
      if (norm) rope::head_norm<T, kP>(f1, f2, w1, w2, HD, p.rope.eps, p.rope.norm_unit_offset);
      rope::rotate<T, kP>(f1, f2, cs, sn, lo, hi);
    };
#pragma unroll
    for (int j = 0; j < kRowsPerWarp; ++j) {
      const int rr = warp + kWarps * j;
      if (tile_row0 + rr >= rows_valid) break;  // the same for the whole warp
      float lo[kP], hi[kP];
      roped(q1[j], q2[j], qw1, qw2, lo, hi);
#pragma unroll
      for (int i = 0; i < kP; ++i) {
        sq[rr * kStride + i0 + i] = dev::from_float<T>(lo[i]);
        sq[rr * kStride + i0 + kHalf + i] = dev::from_float<T>(hi[i]);
      }
    }
    if (own_new) {
      float lo[kP], hi[kP];
      roped(k1, k2, kw1, kw2, lo, hi);
#pragma unroll
      for (int i = 0; i < kP; ++i) {
        knew[i] = dev::from_float<T>(lo[i]);
        knew[kP + i] = dev::from_float<T>(hi[i]);
      }
      const int64_t base = (paged_slot(p, table, ctx - 1) * p.num_kv_heads + kv_head) * HD;
      store_new_kv(static_cast<T*>(p.k_store) + base, static_cast<T*>(p.v_store) + base);
    }
    __syncthreads();  // sq is read by every warp
  }
  mark.at(0);  // q normed and rotated, the step's k and v stored
  // ROPE: the step's key and value into stage `stage` once tile `tile` (the one holding them)
  // is being loaded there (only the warp that owns those keys reads them).
  auto put_new_key = [&](int tile, int stage) {
    if constexpr (ROPE) {
      if (!own_new || tile != new_off / kBlockN) return;
      const int row = (new_off % kBlockN) * kStride;
      store_new_kv(reinterpret_cast<T*>(smem_raw + stage * kStageBytes) + row,
                   reinterpret_cast<T*>(smem_raw + (kStages + stage) * kStageBytes) + row);
    }
  };
  // Q fragments in registers (head_dim <= 128): rows past the sequence are zero.
  uint32_t q_frag[kQInSmem ? 1 : kQkSteps][4];
  if constexpr (!kQInSmem) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const uint32_t* src = nullptr;
      if (row_index[r] >= 0) {
        src = ROPE ? reinterpret_cast<const uint32_t*>(sq + (warp_row0 + gid + 8 * r - tile_row0) *
                                                                kStride)
                   : reinterpret_cast<const uint32_t*>(q + row_index[r] * HD);
      }
#pragma unroll
      for (int kk = 0; kk < kQkSteps; ++kk) {
        if (regs_path) {
          q_frag[kk][r] = src != nullptr ? to_half2_bits<T>(src[k_dim(kk) / 2]) : 0u;
          q_frag[kk][2 + r] = src != nullptr ? to_half2_bits<T>(src[k_dim(kk) / 2 + 1]) : 0u;
        } else {
          q_frag[kk][r] = src != nullptr ? src[(kk * 16 + 2 * tig) / 2] : 0u;
          q_frag[kk][2 + r] = src != nullptr ? src[(kk * 16 + 8 + 2 * tig) / 2] : 0u;
        }
      }
    }
  } else {
    q_frag[0][0] = q_frag[0][1] = q_frag[0][2] = q_frag[0][3] = 0u;
  }

  float o[kOTiles][4];
#pragma unroll
  for (int j = 0; j < kOTiles; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
  float m[2] = {neg_inf(), neg_inf()};  // running max of the row's log2-domain scores
  float l[2] = {0.0f, 0.0f};            // this thread's part of the row's denominator

  if (n_tiles > 0 && kQInSmem) {
#pragma unroll
    for (int i = 0; i < kRowsPerCta * kChunksPerRow / kThreads; ++i) {
      const int c = static_cast<int>(threadIdx.x) + i * kThreads;
      const int row = c / kChunksPerRow;
      const int chunk = c % kChunksPerRow;
      const int prow = tile_row0 + row;
      const uint32_t dst = sq_base + static_cast<uint32_t>((row * kStride + chunk * 8) * sizeof(T));
      if (prow < rows_valid) {
        const int64_t index = static_cast<int64_t>(q_start + prow / group) * p.num_heads +
                              kv_head * group + prow % group;
        cp_async_16(dst, q + index * HD + chunk * 8, true);
      } else {
        cp_async_16(dst, q, false);
      }
    }
  }

  // Online softmax over one tile's scores s (NT n-tiles, this warp's rows) whose first key is
  // `key0`: scales into the log2 domain, soft-caps, masks (causal and window), updates m, l and
  // O, and returns P rounded to the MMA input type (Ops) as the A fragments of P V.
  auto softmax = [&](auto ops, auto nt, float(&s)[decltype(nt)::value][4], int key0,
                     uint32_t(&pa)[decltype(nt)::value / 2][4]) {
    using POps = decltype(ops);
    constexpr int NT = decltype(nt)::value;
    const bool need_mask = key0 + NT * 8 - 1 > warp_min_lim || key0 < warp_max_lo;
#pragma unroll
    for (int j = 0; j < NT; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float x = soft_cap_log2(p, s[j][e] * p.scale_log2);
        if (need_mask) {
          const int key = key0 + j * 8 + 2 * tig + (e & 1);
          if (key > row_lim[e >> 1] || key < row_lo[e >> 1]) x = neg_inf();
        }
        s[j][e] = x;
      }
    }
    // The 4 lanes of a quad hold the same two rows.
    float mx[2] = {m[0], m[1]};
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      mx[0] = fmaxf(mx[0], fmaxf(s[j][0], s[j][1]));
      mx[1] = fmaxf(mx[1], fmaxf(s[j][2], s[j][3]));
    }
    float alpha[2];
    float m_use[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
      // A row with no visible key so far keeps m = -inf; use 0 so -inf - m_use stays -inf.
      m_use[r] = mx[r] == neg_inf() ? 0.0f : mx[r];
      alpha[r] = fast_exp2(m[r] - m_use[r]);
      m[r] = mx[r];
    }
    float row_sum[2] = {0.0f, 0.0f};
#pragma unroll
    for (int j = 0; j < NT; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        s[j][e] = fast_exp2(s[j][e] - m_use[e >> 1]);
        row_sum[e >> 1] += s[j][e];
      }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) l[r] = l[r] * alpha[r] + row_sum[r];
    // Once the running max settles (most tiles of a long context), O needs no rescaling.
    if (__any_sync(0xffffffffu, alpha[0] != 1.0f || alpha[1] != 1.0f)) {
#pragma unroll
      for (int j = 0; j < kOTiles; ++j) {
        o[j][0] *= alpha[0];
        o[j][1] *= alpha[0];
        o[j][2] *= alpha[1];
        o[j][3] *= alpha[1];
      }
    }
    // P's C fragments of n-tiles 2kk, 2kk+1 are the A fragment of k-step kk of P V.
#pragma unroll
    for (int kk = 0; kk < NT / 2; ++kk) {
      pa[kk][0] = POps::pack(s[2 * kk][0], s[2 * kk][1]);
      pa[kk][1] = POps::pack(s[2 * kk][2], s[2 * kk][3]);
      pa[kk][2] = POps::pack(s[2 * kk + 1][0], s[2 * kk + 1][1]);
      pa[kk][3] = POps::pack(s[2 * kk + 1][2], s[2 * kk + 1][3]);
    }
  };

  // One tile's S = Q K^T, online softmax and O += P V for this warp's rows, over the NT * 8 keys
  // starting `key_off` into the tile (NT = kSTiles: the whole tile; 2: a split-keys warp's 16),
  // K and V read through ldmatrix from 16-bit tiles at sk / sv. `active`: whether this warp
  // computes (the hook runs in every thread either way: it may hold barriers); `between` runs
  // after S and the softmax, before P V reads `sv` (FP8 prefill widens V there, into the memory
  // K was widened into).
  auto compute_tile = [&](auto nt, int n0, int key_off, uint32_t sk, uint32_t sv, bool active,
                          auto between) {
    constexpr int NT = decltype(nt)::value;
    uint32_t pa[NT / 2][4];  // P, rounded to T: the A fragments of P V
    if (active) {
      // S = Q K^T. K tile [key][d] is B (col-major 16x8): one ldmatrix.x4 gives b0/b1 of two
      // n-tiles: matrices (keys +0, d +0), (keys +0, d +8), (keys +8, d +0), (keys +8, d +8).
      float s[NT][4];
#pragma unroll
      for (int j = 0; j < NT; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
      const int k_row = (lane & 7) + ((lane >> 4) << 3);
      const int k_col = ((lane >> 3) & 1) << 3;
#pragma unroll
      for (int kk = 0; kk < kQkSteps; ++kk) {
        uint32_t a[4];
        if constexpr (kQInSmem) {
          // A matrices: (rows +0, d +0), (rows +8, d +0), (rows +0, d +8), (rows +8, d +8).
          const int q_row = warp * 16 + (lane & 7) + (((lane >> 3) & 1) << 3);
          const int q_col = kk * 16 + ((lane >> 4) << 3);
          ldmatrix_x4(sq_base + static_cast<uint32_t>((q_row * kStride + q_col) * sizeof(T)), a);
        } else {
          a[0] = q_frag[kk][0];
          a[1] = q_frag[kk][1];
          a[2] = q_frag[kk][2];
          a[3] = q_frag[kk][3];
        }
#pragma unroll
        for (int j = 0; j < NT / 2; ++j) {
          uint32_t b[4];
          const int row = key_off + j * 16 + k_row;
          const int col = kk * 16 + k_col;
          ldmatrix_x4(sk + static_cast<uint32_t>((row * kStride + col) * sizeof(T)), b);
          Ops::mma(s[2 * j], a, b[0], b[1]);
          Ops::mma(s[2 * j + 1], a, b[2], b[3]);
        }
      }
      softmax(Ops{}, nt, s, n0 + key_off, pa);
    }
    between();
    if (active) {
      // O += P V. V tile [key][d] is B (16 keys x 8 d), read transposed: matrices
      // (keys +0, d +0), (keys +8, d +0), (keys +0, d +8), (keys +8, d +8).
      const int v_row = (lane & 7) + (((lane >> 3) & 1) << 3);
      const int v_col = (lane >> 4) << 3;
#pragma unroll
      for (int kk = 0; kk < NT / 2; ++kk) {
#pragma unroll
        for (int j = 0; j < HD / 16; ++j) {
          uint32_t b[4];
          const int row = key_off + kk * 16 + v_row;
          const int col = j * 16 + v_col;
          ldmatrix_x4_trans(sv + static_cast<uint32_t>((row * kStride + col) * sizeof(T)), b);
          Ops::mma(o[2 * j], pa[kk], b[0], b[1]);
          Ops::mma(o[2 * j + 1], pa[kk], b[2], b[3]);
        }
      }
    }
  };

  // FP8 split keys: the warp's 16 keys at `key_off` of the raw stages k_raw / v_raw, K and V
  // read into registers (kRegs above); fp16 MMAs.
  auto compute_tile_regs = [&](int n0, int key_off, uint32_t k_raw, uint32_t v_raw) {
    if constexpr (kRegs) {
      using HOps = HalfOps<__half>;
      // S = Q K^T: n-tile j's column n is key key_off + 8 j + n, read by the lanes with gid n.
      uint32_t kw[2][kKLoads][4];
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int row = key_off + 8 * j + gid;
#pragma unroll
        for (int i = 0; i < kKLoads; ++i) {
          const int byte = kKLoadBytes * (4 * i + tig);
          lds<kKLoadBytes>(k_raw + stage_offset(row, byte / 16) + byte % 16, kw[j][i]);
        }
      }
      float s[2][4];
#pragma unroll
      for (int j = 0; j < 2; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
#pragma unroll
      for (int kk = 0; kk < kQkSteps; ++kk) {
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          uint32_t b0, b1;
          fp8x4_to_half2x2(kw[j][kk / kKStepsPerLoad][kk % kKStepsPerLoad], b0, b1);
          HOps::mma(s[j], q_frag[kk], b0, b1);
        }
      }
      uint32_t pa[1][4];
      softmax(HOps{}, std::integral_constant<int, 2>{}, s, n0 + key_off, pa);

      // O += P V: B's k is the key (2 tig, 2 tig + 1 for b0, + 8 for b1), its n the head dim
      // n * (HD / 8) + j of O's n-tile j: a lane reads HD / 8 bytes of each of its four keys and
      // pairs the keys' bytes (prmt) before widening.
      uint32_t vw[4][kVWords];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const int row = key_off + 2 * tig + (k & 1) + 8 * (k >> 1);
        if constexpr (kVBytes >= 16) {
#pragma unroll
          for (int c = 0; c < kVBytes / 16; ++c) {
            lds<16>(v_raw + stage_offset(row, gid * (kVBytes / 16) + c), &vw[k][4 * c]);
          }
        } else {
          const int byte = gid * kVBytes;
          lds<kVBytes>(v_raw + stage_offset(row, byte / 16) + byte % 16, vw[k]);
        }
      }
#pragma unroll
      for (int w = 0; w < kVWords; ++w) {
#pragma unroll
        for (int half = 0; half < (kVBytes >= 4 ? 2 : 1); ++half) {
          const uint32_t sel = half == 0 ? 0x5140u : 0x7362u;
          uint32_t b0[2], b1[2];  // n-tiles 4 w + 2 half + {0, 1}
          fp8x4_to_half2x2(__byte_perm(vw[0][w], vw[1][w], sel), b0[0], b0[1]);
          fp8x4_to_half2x2(__byte_perm(vw[2][w], vw[3][w], sel), b1[0], b1[1]);
#pragma unroll
          for (int e = 0; e < 2; ++e) HOps::mma(o[4 * w + 2 * half + e], pa[0], b0[e], b1[e]);
        }
      }
    }
  };

  // FP8 prefill: widens one stage tile (K or V bytes at `raw`) into the 16-bit tile at
  // sk_wide, 16 elements per 16-byte chunk.
  auto widen_tile = [&](uint32_t raw_base) {
#pragma unroll
    for (int i = 0; i < kKvPerThread; ++i) {
      const int c = static_cast<int>(threadIdx.x) + i * kThreads;
      if (kKvPerThread * kThreads != kBlockN * kKvChunks && c >= kBlockN * kKvChunks) break;
      const int row = c / kKvChunks;
      const int chunk = c % kKvChunks;
      uint4 bytes;
      asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                   : "=r"(bytes.x), "=r"(bytes.y), "=r"(bytes.z), "=r"(bytes.w)
                   : "r"(raw_base + stage_offset(row, chunk))
                   : "memory");
      const uint2 a = widen_fp8x4<T>(bytes.x);
      const uint2 b = widen_fp8x4<T>(bytes.y);
      const uint2 c2 = widen_fp8x4<T>(bytes.z);
      const uint2 d = widen_fp8x4<T>(bytes.w);
      const uint32_t dst =
          sk_wide + static_cast<uint32_t>((row * kStride + chunk * 16) * sizeof(T));
      asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(dst), "r"(a.x), "r"(a.y),
                   "r"(b.x), "r"(b.y)
                   : "memory");
      asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(dst + 16u), "r"(c2.x),
                   "r"(c2.y), "r"(d.x), "r"(d.y)
                   : "memory");
    }
  };

  // The key loop, compiled once per mode: split keys (kSplit: each warp loads, waits for and
  // reads only its own 16 rows of every tile, so the warps sync with __syncwarp and run apart)
  // or rows (the CTA loads each tile together, __syncthreads).
  auto run_tiles = [&](auto split_c) {
    constexpr bool kSplit = decltype(split_c)::value;
    auto sync_tile = [] {
      if constexpr (kSplit) {
        __syncwarp();
      } else {
        __syncthreads();
      }
    };
    auto load_kv = [&](int tile, int stage) { load_kv_keys(split_c, tile, stage, kAllKeys); };

    if (n_tiles > 0) {
      // Group s holds tile s (Q joins group 0); a group may be empty, which keeps the count of
      // groups the main loop waits on the same for every tile. The keys before the kernel
      // before's were asked for before the wait (early_kv): they join group 0.
#pragma unroll
      for (int st = 0; st < kStages - 1; ++st) {
        if (st < n_tiles) {
          load_kv_keys(split_c, st, st, kNewKeys);
          put_new_key(st, st);
        }
        cp_async_commit();
      }
    }

    for (int t = 0; t < n_tiles; ++t) {
      // Tile t + kStages - 1 goes into the stage computed in iteration t - 1 (free since that
      // iteration's closing sync); then wait until at most kStages - 1 groups are pending,
      // i.e. tile t has landed.
      const int next = t + kStages - 1;
      if (next < n_tiles) {
        load_kv(next, next % kStages);
        put_new_key(next, next % kStages);
      }
      cp_async_commit();
      cp_async_wait<kStages - 1>();
      sync_tile();

      const int n0 = kv_begin + t * kBlockN;
      const int stage = t % kStages;
      const uint32_t k_stage = smem_base + stage * kStageBytes;
      const uint32_t v_stage = smem_base + (kStages + stage) * kStageBytes;
      // Whether this warp's keys of the tile (its 16, or all) reach its rows' windows.
      const bool keys_seen =
          kSplit ? n0 + warp * 16 <= warp_max_lim && n0 + warp * 16 + 15 >= warp_min_lo
                 : n0 <= warp_max_lim && n0 + kBlockN - 1 >= warp_min_lo;
      if constexpr (kSplit && kRegs) {
        if (keys_seen) compute_tile_regs(n0, warp * 16, k_stage, v_stage);
      } else {
        // FP8: K is widened now, V after S and the softmax, both into sk_wide, which the MMAs
        // read.
        auto between = [&] {
          if constexpr (FP8) {
            sync_tile();  // every reader of the widened K is done
            widen_tile(v_stage);
            sync_tile();
          }
        };
        if constexpr (FP8) {
          widen_tile(k_stage);
          sync_tile();
        }
        const uint32_t sk = FP8 ? sk_wide : k_stage;
        const uint32_t sv = FP8 ? sk_wide : v_stage;
        if constexpr (kSplit) {
          compute_tile(std::integral_constant<int, 2>{}, n0, warp * 16, sk, sv, keys_seen, between);
        } else {
          compute_tile(std::integral_constant<int, kSTiles>{}, n0, 0, sk, sv,
                       warp_active && keys_seen, between);
        }
      }
      sync_tile();  // the next iteration's prefetch overwrites this stage
    }
  };
  by_split_keys(run_tiles);
  cp_async_wait<0>();  // no copy may still target shared memory (only empty groups remain)

  // Full row denominators.
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
  }

  if constexpr (C::kCanSplitKeys) {
    if (split_keys) {
      // Merge the warps' states into warp 0: warps 1.. leave O, m and l in the tiles' memory
      // (free once every warp is past its last tile: the barrier below the loop's), warp 0
      // rescales everything to the common max.
      __syncthreads();
      // The fragment layout is the same in every warp, so each thread reads its own positions.
      constexpr int kMs = C::kMergeStride;
      float* red_o = reinterpret_cast<float*>(smem_raw);  // [kWarps - 1][16][kMs]
      float* red_ml = red_o + (kWarps - 1) * 16 * kMs;    // [kWarps - 1][16][2]
      if (warp > 0) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int row = gid + 8 * r;
          float* dst = red_o + ((warp - 1) * 16 + row) * kMs;
#pragma unroll
          for (int j = 0; j < kOTiles; ++j) {
            *reinterpret_cast<float2*>(dst + j * 8 + 2 * tig) =
                make_float2(o[j][2 * r], o[j][2 * r + 1]);
          }
          if (tig == 0) {
            red_ml[((warp - 1) * 16 + row) * 2] = m[r];
            red_ml[((warp - 1) * 16 + row) * 2 + 1] = l[r];
          }
        }
      }
      __syncthreads();
      if (warp > 0) return;
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = gid + 8 * r;
        float mw[kWarps - 1];
        float mx = m[r];
#pragma unroll
        for (int w = 0; w < kWarps - 1; ++w) {
          mw[w] = red_ml[(w * 16 + row) * 2];
          mx = fmaxf(mx, mw[w]);
        }
        const float m_use = mx == neg_inf() ? 0.0f : mx;
        const float own = fast_exp2(m[r] - m_use);
        l[r] *= own;
#pragma unroll
        for (int j = 0; j < kOTiles; ++j) {
          o[j][2 * r] *= own;
          o[j][2 * r + 1] *= own;
        }
#pragma unroll
        for (int w = 0; w < kWarps - 1; ++w) {
          const float f = fast_exp2(mw[w] - m_use);
          l[r] += red_ml[(w * 16 + row) * 2 + 1] * f;
          const float* src = red_o + (w * 16 + row) * kMs;
#pragma unroll
          for (int j = 0; j < kOTiles; ++j) {
            const float2 v = *reinterpret_cast<const float2*>(src + j * 8 + 2 * tig);
            o[j][2 * r] += v.x * f;
            o[j][2 * r + 1] += v.y * f;
          }
        }
        m[r] = mx;
      }
    }
  }
  mark.at(1);  // the keys' scores, softmax and values done, the warps' parts merged
  if (!warp_active) return;

  // f(x, y, d) for each pair of row r's O values that sit at adjacent head dims d, d + 1.
  auto for_o_pairs = [&](int r, auto&& f) {
    if (kRegs && regs_path) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
#pragma unroll
        for (int j = 0; j < kOTiles; j += 2) f(o[j][2 * r + e], o[j + 1][2 * r + e], o_dim(j, e));
      }
    } else {
#pragma unroll
      for (int j = 0; j < kOTiles; ++j) f(o[j][2 * r], o[j][2 * r + 1], o_dim(j, 0));
    }
  };
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (row_index[r] < 0) continue;
    const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
    if (direct) {
      T* dst = static_cast<T*>(p.out) + row_index[r] * HD;
      for_o_pairs(r, [&](float x, float y, int d) {
        *reinterpret_cast<uint32_t*>(dst + d) = Ops::pack(x * inv, y * inv);
      });
    } else {
      const int64_t ws_row = static_cast<int64_t>(split) * p.total_q * p.num_heads + row_index[r];
      float* dst = p.ws_o + ws_row * HD;
      for_o_pairs(r, [&](float x, float y, int d) {
        *reinterpret_cast<float2*>(dst + d) = make_float2(x * inv, y * inv);
      });
      if (tig == 0) p.ws_lse[ws_row] = l[r] > 0.0f ? (m[r] + __log2f(l[r])) * kLn2 : neg_inf();
    }
  }
  mark.end(block_trace::Kernel::kAttention);
}

// Merges the splits of every (query token, head) row of sequences that used more than one.
// Grid (ceil(max_query_len * num_heads / rows per CTA), num_seqs); head_dim / 4 threads per
// row, 4 consecutive elements each.
template <typename T, int HD>
__global__ void __launch_bounds__(kCombineThreads)
    attention_combine_kernel(const __grid_constant__ Params p) {
  block_trace::Mark mark;
  dev::pdl_launch_dependents();
  constexpr int kThreadsPerRow = HD / 4;
  constexpr int kRowsPerCtaCombine = kCombineThreads / kThreadsPerRow;
  const int seq = blockIdx.y;
  const int ctx = p.context_lens[seq];
  const int q_start = p.cu_query_lens[seq];
  const int qlen = p.cu_query_lens[seq + 1] - q_start;
  // The partial results are the kernel before's (the lengths the host's). Every block waits, also
  // one with nothing to merge: this grid must not complete before the attention kernel, whose
  // `out` the kernel after it reads once this one is complete.
  dev::pdl_wait();
  mark.wait_returned();
  if (ctx <= 0) return;
  const int n_used = splits_used(p, ctx - window_start(p, ctx - qlen));
  if (n_used <= 1) return;  // the attention kernel wrote `out` itself
  const int row = static_cast<int>(blockIdx.x) * kRowsPerCtaCombine +
                  static_cast<int>(threadIdx.x) / kThreadsPerRow;
  const int token = row / p.num_heads;
  if (token >= qlen) return;
  const int head = row % p.num_heads;
  const int64_t index = static_cast<int64_t>(q_start + token) * p.num_heads + head;
  const int64_t split_stride = p.total_q * p.num_heads;
  const int d = (static_cast<int>(threadIdx.x) % kThreadsPerRow) * 4;
  auto lse_of = [&](int s) { return p.ws_lse[s * split_stride + index]; };
  auto o_of = [&](int s) {
    return *reinterpret_cast<const float4*>(p.ws_o + (s * split_stride + index) * HD + d);
  };
  float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  float weight_sum = 0.0f;
  // Adds split s's O weighted by exp(its lse - the max) (a split that saw no key of this row
  // has lse -inf and O 0: skipped), in split order.
  auto add = [&](float lse, float4 v, float lse_max) {
    if (lse == neg_inf()) return;
    const float w = expf(lse - lse_max);
    acc.x += w * v.x;
    acc.y += w * v.y;
    acc.z += w * v.z;
    acc.w += w * v.w;
    weight_sum += w;
  };
  if (n_used <= kCombineAtOnce) {
    // Every split's lse and O asked for at once: one round trip to L2 instead of two.
    float lse[kCombineAtOnce];
    float4 v[kCombineAtOnce];
#pragma unroll
    for (int s = 0; s < kCombineAtOnce; ++s) {
      if (s < n_used) {
        lse[s] = lse_of(s);
        v[s] = o_of(s);
      }
    }
    float lse_max = neg_inf();
#pragma unroll
    for (int s = 0; s < kCombineAtOnce; ++s) {
      if (s < n_used) lse_max = fmaxf(lse_max, lse[s]);
    }
    if (lse_max != neg_inf()) {
#pragma unroll
      for (int s = 0; s < kCombineAtOnce; ++s) {
        if (s < n_used) add(lse[s], v[s], lse_max);
      }
    }
  } else {
    float lse_max = neg_inf();
    for (int s = 0; s < n_used; ++s) lse_max = fmaxf(lse_max, lse_of(s));
    if (lse_max != neg_inf()) {
      for (int s = 0; s < n_used; ++s) add(lse_of(s), o_of(s), lse_max);
    }
  }
  const float inv = weight_sum > 0.0f ? 1.0f / weight_sum : 0.0f;
  uint2 packed;
  packed.x = HalfOps<T>::pack(acc.x * inv, acc.y * inv);
  packed.y = HalfOps<T>::pack(acc.z * inv, acc.w * inv);
  *reinterpret_cast<uint2*>(static_cast<T*>(p.out) + index * HD + d) = packed;
  mark.end(block_trace::Kernel::kCombine);
}

// ---------------------------------------------------------------------------------------------
// The general kernel: any even head size up to kMaxHeadDim that the tensor-core kernel has no
// instance for (e.g. 80, 96, 192, or sizes not a multiple of 8). One warp per (query token,
// head) row, lane l holding elements l + 32 e (e < EPL) of q and of the output; keys one at a
// time from the row's window start (a warp-sum dot product, the soft-cap, an online softmax in
// the log2 domain, fp32 throughout). Slower
// than the tile kernel but exact to the same tolerance; no split-K (it ignores num_splits).
// Grid (ceil(max_query_len * num_heads / kGenericWarps), num_seqs), kGenericWarps warps.
constexpr int kMaxHeadDim = 1024;
constexpr int kGenericWarps = 4;

// KV: the cache's element type, T or __nv_fp8_e4m3.
template <typename T, typename KV, int EPL>
__global__ void __launch_bounds__(kGenericWarps * 32)
    paged_attention_generic_kernel(const __grid_constant__ Params p, int head_dim) {
  dev::pdl_wait();  // q and the cache are written by the kernel before
  dev::pdl_launch_dependents();
  const int warp = static_cast<int>(threadIdx.x) / 32;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int seq = blockIdx.y;
  const int ctx = p.context_lens[seq];
  if (ctx <= 0) return;  // padding sequence
  const int q_start = p.cu_query_lens[seq];
  const int qlen = p.cu_query_lens[seq + 1] - q_start;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kGenericWarps + warp;
  if (row >= static_cast<int64_t>(qlen) * p.num_heads) return;
  const int token = static_cast<int>(row / p.num_heads);
  const int head = static_cast<int>(row % p.num_heads);
  const int kv_head = head / p.group;
  const int last_key = min(ctx - 1, ctx - qlen + token);  // causal: the row's own position
  const int first_key = window_start(p, last_key);
  const int64_t index = static_cast<int64_t>(q_start + token) * p.num_heads + head;
  const T* q = static_cast<const T*>(p.q) + index * head_dim;
  const KV* k_cache = static_cast<const KV*>(p.k_cache);
  const KV* v_cache = static_cast<const KV*>(p.v_cache);
  const int32_t* table = p.block_tables + seq * p.block_table_stride;

  float qv[EPL], o[EPL];
#pragma unroll
  for (int e = 0; e < EPL; ++e) {
    const int d = lane + 32 * e;
    qv[e] = d < head_dim ? dev::to_float(q[d]) * p.scale_log2 : 0.0f;
    o[e] = 0.0f;
  }
  float m = neg_inf(), l = 0.0f;
  for (int key = first_key; key <= last_key; ++key) {
    const int64_t slot = paged_slot(p, table, key);
    const int64_t base = (slot * p.num_kv_heads + kv_head) * head_dim;
    float dot = 0.0f;
#pragma unroll
    for (int e = 0; e < EPL; ++e) {
      const int d = lane + 32 * e;
      if (d < head_dim) dot += qv[e] * dev::to_float(k_cache[base + d]);
    }
    const float s = soft_cap_log2(p, dev::warp_sum(dot));
    const float m_new = fmaxf(m, s);
    const float alpha = fast_exp2(m - m_new);  // 0 while m is -inf
    const float pe = fast_exp2(s - m_new);
    l = l * alpha + pe;
#pragma unroll
    for (int e = 0; e < EPL; ++e) {
      const int d = lane + 32 * e;
      const float v = d < head_dim ? dev::to_float(v_cache[base + d]) : 0.0f;
      o[e] = o[e] * alpha + pe * v;
    }
    m = m_new;
  }
  const float inv = l > 0.0f ? 1.0f / l : 0.0f;
  T* out = static_cast<T*>(p.out) + index * head_dim;
#pragma unroll
  for (int e = 0; e < EPL; ++e) {
    const int d = lane + 32 * e;
    if (d < head_dim) out[d] = dev::from_float<T>(o[e] * inv);
  }
}

template <typename T, int EPL>
Status launch_generic(const Params& params, const AttentionArgs& args, cudaStream_t stream) {
  const int64_t rows = static_cast<int64_t>(args.max_query_len) * args.num_heads;
  const dim3 grid(static_cast<unsigned>((rows + kGenericWarps - 1) / kGenericWarps),
                  static_cast<unsigned>(args.num_seqs));
  if (args.kv_cache_dtype == KvCacheDtype::kFp8E4M3) {
    launch_pdl(paged_attention_generic_kernel<T, __nv_fp8_e4m3, EPL>, grid, kGenericWarps * 32, 0,
               stream, params, args.head_dim);
  } else {
    launch_pdl(paged_attention_generic_kernel<T, T, EPL>, grid, kGenericWarps * 32, 0, stream,
               params, args.head_dim);
  }
  return launch_status("paged_attention (general head size)");
}

template <typename T>
Status dispatch_generic(const Params& params, const AttentionArgs& args, cudaStream_t stream) {
  const int hd = args.head_dim;
  if (hd <= 32) return launch_generic<T, 1>(params, args, stream);
  if (hd <= 64) return launch_generic<T, 2>(params, args, stream);
  if (hd <= 128) return launch_generic<T, 4>(params, args, stream);
  if (hd <= 256) return launch_generic<T, 8>(params, args, stream);
  if (hd <= 512) return launch_generic<T, 16>(params, args, stream);
  return launch_generic<T, 32>(params, args, stream);
}

// The main kernel's instance DECODE (Config) on `grid`.
template <typename T, int HD, bool FP8, bool DECODE, bool ROPE = false>
Status launch_main(const Params& params, dim3 grid, cudaStream_t stream) {
  using C = Config<HD, FP8, DECODE>;
  auto* kernel = paged_attention_kernel<T, HD, FP8, DECODE, ROPE>;
  constexpr size_t kSmem = C::kSmemBytes + (ROPE ? kRopeQBytes<HD> : 0);
  if constexpr (kSmem > 48 * 1024) {
    // Per launch rather than once: the attribute is per device, and it is a host-side call
    // that is legal during stream capture.
    TESSERA_CUDA_RETURN_IF_ERROR(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             static_cast<int>(kSmem)),
        "paged_attention: raising the dynamic shared memory limit");
  }
  launch_pdl(kernel, grid, kThreads, kSmem, stream, params);
  return launch_status("paged_attention");
}

// Whether a decode launch of `ctas` CTAs takes the DECODE instance (Config). With an FP8 cache
// that instance runs three CTAs per SM instead of two, each 1.3x as long (so 1.15x the work per
// SM), which wins unless its partial last wave costs more: waves x 1.3 against waves of two.
// Measured on the H200 (132 SMs), three vs two per SM: 384 CTAs 77 vs 113 us, 512 CTAs 56 vs
// 50 us, 2048 CTAs 235 vs 266 us.
bool take_decode_instance(bool fp8, int64_t ctas) {
  if (!fp8) return true;  // the same occupancy either way
  const int64_t sms = current_sm_count();
  if (sms <= 0) return true;
  const int64_t waves3 = (ctas + 3 * sms - 1) / (3 * sms);
  const int64_t waves2 = (ctas + 2 * sms - 1) / (2 * sms);
  return static_cast<double>(waves3) * 1.3 <= static_cast<double>(waves2);
}

template <typename T, int HD, bool FP8>
Status launch(const Params& params, const AttentionArgs& args, cudaStream_t stream) {
  const int64_t rows = static_cast<int64_t>(args.max_query_len) * params.group;
  const dim3 grid(static_cast<unsigned>((rows + kRowsPerCta - 1) / kRowsPerCta),
                  static_cast<unsigned>(args.num_seqs),
                  static_cast<unsigned>(args.num_kv_heads * args.num_splits));
  if constexpr (Config<HD, FP8>::kCanSplitKeys) {
    const int64_t ctas = static_cast<int64_t>(grid.y) * grid.z;
    if (rows <= 16 && take_decode_instance(FP8, ctas)) {
      if constexpr (!FP8 && (HD == 64 || HD == 128)) {
        if (params.qkv != nullptr) {
          TESSERA_RETURN_IF_ERROR((launch_main<T, HD, FP8, true, true>(params, grid, stream)));
        } else {
          TESSERA_RETURN_IF_ERROR((launch_main<T, HD, FP8, true>(params, grid, stream)));
        }
      } else {
        TESSERA_RETURN_IF_ERROR((launch_main<T, HD, FP8, true>(params, grid, stream)));
      }
    } else {
      TESSERA_RETURN_IF_ERROR((launch_main<T, HD, FP8, false>(params, grid, stream)));
    }
  } else {
    TESSERA_RETURN_IF_ERROR((launch_main<T, HD, FP8, false>(params, grid, stream)));
  }
  if (args.num_splits > 1) {
    constexpr int kRows = kCombineThreads / (HD / 4);
    const int64_t combine_rows = static_cast<int64_t>(args.max_query_len) * args.num_heads;
    const dim3 combine_grid(static_cast<unsigned>((combine_rows + kRows - 1) / kRows),
                            static_cast<unsigned>(args.num_seqs));
    launch_pdl(attention_combine_kernel<T, HD>, combine_grid, kCombineThreads, 0, stream, params);
    TESSERA_RETURN_IF_ERROR(launch_status("paged_attention combine"));
  }
  return Status::ok();
}

template <typename T>
Status dispatch_head_dim(const Params& params, const AttentionArgs& args, cudaStream_t stream) {
  const bool fp8 = args.kv_cache_dtype == KvCacheDtype::kFp8E4M3;
  switch (args.head_dim) {
    case 16:
      return fp8 ? launch<T, 16, true>(params, args, stream)
                 : launch<T, 16, false>(params, args, stream);
    case 32:
      return fp8 ? launch<T, 32, true>(params, args, stream)
                 : launch<T, 32, false>(params, args, stream);
    case 64:
      return fp8 ? launch<T, 64, true>(params, args, stream)
                 : launch<T, 64, false>(params, args, stream);
    case 128:
      return fp8 ? launch<T, 128, true>(params, args, stream)
                 : launch<T, 128, false>(params, args, stream);
    case 256:
      return fp8 ? launch<T, 256, true>(params, args, stream)
                 : launch<T, 256, false>(params, args, stream);
    default:
      return dispatch_generic<T>(params, args, stream);
  }
}

// Whether an average sequence of the launch fills one of the Hopper kernel's 128-row tiles
// (rows = query tokens x group). Steps that mix a prefill chunk with many decodes stay on the tile
// kernel, whose decode CTAs split keys instead of idling 124 of 128 rows.
bool prefill_heavy(const AttentionArgs& a) {
  const int64_t group = a.num_heads / a.num_kv_heads;
  const int64_t total = a.total_q > 0 ? a.total_q : a.max_query_len;
  return total * group >= 128 * static_cast<int64_t>(a.num_seqs);
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

Status check_args(const AttentionArgs& a) {
  auto bad = [](const std::string& m) { return invalid_argument("paged_attention: " + m); };
  if (!is_half_type(a.dtype)) return bad("dtype must be BF16 or F16");
  if (a.q == nullptr || a.out == nullptr || a.k_cache == nullptr || a.v_cache == nullptr ||
      a.cu_query_lens == nullptr || a.context_lens == nullptr || a.block_tables == nullptr) {
    return bad("null pointer argument");
  }
  if (!aligned16(a.q) || !aligned16(a.out) || !aligned16(a.k_cache) || !aligned16(a.v_cache)) {
    return bad("q, out, k_cache and v_cache must be 16-byte aligned");
  }
  if (a.q == a.out) return bad("out must not overlap q");
  TESSERA_RETURN_IF_ERROR(check_attention_scoring(a.scoring, "paged_attention: "));
  if (!(a.scoring.scale > 0.0f)) return bad("scale must be positive");
  if (a.head_dim < 2 || a.head_dim % 2 != 0 || a.head_dim > kMaxHeadDim) {
    return bad("head_dim " + std::to_string(a.head_dim) + " is not an even number from 2 to " +
               std::to_string(kMaxHeadDim));
  }
  if (a.num_heads <= 0 || a.num_kv_heads <= 0 || a.num_heads % a.num_kv_heads != 0) {
    return bad("num_heads " + std::to_string(a.num_heads) + " is not a positive multiple of " +
               "num_kv_heads " + std::to_string(a.num_kv_heads));
  }
  if (a.block_size < 1 || a.block_size > 256) {
    return bad("block_size " + std::to_string(a.block_size) + " is outside [1, 256]");
  }
  if (a.num_blocks <= 0) return bad("num_blocks must be positive");
  if (a.block_table_stride <= 0) return bad("block_table_stride must be positive");
  if (a.num_seqs < 0 || a.max_query_len < 0) return bad("negative num_seqs or max_query_len");
  if (a.num_seqs > 65535) return bad("more than 65535 sequences");
  const int64_t group = a.num_heads / a.num_kv_heads;
  if (static_cast<int64_t>(a.max_query_len) * group > (int64_t{1} << 30) ||
      static_cast<int64_t>(a.max_query_len) * a.num_heads > (int64_t{1} << 30)) {
    return bad("max_query_len * num_heads is too large");
  }
  if (a.num_splits < 1) return bad("num_splits must be at least 1");
  if (static_cast<int64_t>(a.num_kv_heads) * a.num_splits > 65535) {
    return bad("num_kv_heads * num_splits exceeds 65535");
  }
  if (a.num_splits > 1) {
    if (a.workspace == nullptr || !aligned16(a.workspace)) {
      return bad("split-K needs a 16-byte aligned workspace");
    }
    if (a.split_size <= 0 || a.split_size % kSplitAlign != 0) {
      return bad("split_size " + std::to_string(a.split_size) + " is not a positive multiple of " +
                 std::to_string(kSplitAlign));
    }
    if (a.total_q <= 0) return bad("split-K needs total_q (rows of q)");
  }
  return Status::ok();
}

}  // namespace

Expected<AttentionKernel> parse_attention_kernel(std::string_view name) {
  if (name == "auto") return AttentionKernel::kAuto;
  if (name == "tiles") return AttentionKernel::kTiles;
  if (name == "hopper") return AttentionKernel::kHopper;
  return invalid_argument("attention backend '" + std::string(name) +
                          "' is not one of auto, tiles, hopper");
}

size_t attention_workspace_bytes(int64_t total_q, int num_heads, int head_dim, int num_splits) {
  if (num_splits <= 1 || total_q <= 0 || num_heads <= 0 || head_dim <= 0) return 0;
  return static_cast<size_t>(num_splits) * static_cast<size_t>(total_q) *
         static_cast<size_t>(num_heads) * (static_cast<size_t>(head_dim) + 1) * sizeof(float);
}

SplitPlan plan_attention_splits(int num_seqs, int num_kv_heads, int64_t max_context, int num_sms) {
  SplitPlan plan;
  if (num_seqs <= 0 || num_kv_heads <= 0 || max_context <= kMinSplitSize || num_sms <= 0) {
    return plan;
  }
  const int64_t ctas = static_cast<int64_t>(num_seqs) * num_kv_heads;
  // About two CTAs per SM at full context (a short context uses fewer, see seq_split_size).
  // Splitting batches that already fill the GPU was measured slower (batch 64: 35 vs 26 us).
  const int64_t target = 2 * static_cast<int64_t>(num_sms);
  if (ctas >= target) return plan;
  int64_t splits = (target + ctas - 1) / ctas;
  splits = std::min<int64_t>(splits, (max_context + kMinSplitSize - 1) / kMinSplitSize);
  splits = std::min<int64_t>(splits, kMaxPlannedSplits);
  if (splits <= 1) return plan;
  int64_t split_size = (max_context + splits - 1) / splits;
  split_size = (split_size + kSplitAlign - 1) / kSplitAlign * kSplitAlign;
  split_size = std::max<int64_t>(split_size, kMinSplitSize);
  splits = (max_context + split_size - 1) / split_size;
  if (splits <= 1) return plan;
  plan.num_splits = static_cast<int>(splits);
  plan.split_size = static_cast<int>(split_size);
  return plan;
}

bool attention_rope_applies(const AttentionArgs& args) {
  return args.max_query_len == 1 && args.kv_cache_dtype != KvCacheDtype::kFp8E4M3 &&
         (args.head_dim == 64 || args.head_dim == 128) && args.num_kv_heads > 0 &&
         args.num_heads % args.num_kv_heads == 0 && args.num_heads / args.num_kv_heads <= 16 &&
         args.kernel != AttentionKernel::kHopper;
}

Status paged_attention(const AttentionArgs& args, cudaStream_t stream) {
  TESSERA_RETURN_IF_ERROR(check_args(args));
  if (args.rope.qkv != nullptr) {
    const RopeConstants& r = args.rope.constants;
    if (!attention_rope_applies(args)) {
      return invalid_argument(
          "paged_attention: the rope inside the attention takes one query token per sequence, a "
          "16-bit cache, head_dim 64 or 128 and at most 16 query heads per KV head (got "
          "max_query_len " +
          std::to_string(args.max_query_len) + ", head_dim " + std::to_string(args.head_dim) +
          "; check attention_rope_applies first, or run rope_and_cache and leave rope.qkv null)");
    }
    if (r.cos == nullptr || r.sin == nullptr || r.max_position <= 0 ||
        (r.q_norm == nullptr) != (r.k_norm == nullptr)) {
      return invalid_argument(
          "paged_attention: the rope needs its cos / sin tables, max_position > 0, and both head "
          "norms or neither (got cos " +
          std::string(r.cos != nullptr ? "set" : "null") + ", max_position " +
          std::to_string(r.max_position) + ", q_norm " + (r.q_norm != nullptr ? "set" : "null") +
          ", k_norm " + (r.k_norm != nullptr ? "set" : "null") + ")");
    }
  }
  const bool hopper = hopper_prefill_applies(args);
  if (args.kernel == AttentionKernel::kHopper && !hopper) {
    return invalid_argument(
        "paged_attention: the Hopper prefill kernel does not apply (it takes head_dim 128, a "
        "16-bit cache and at most 65535 128-row tiles per sequence; got head_dim " +
        std::to_string(args.head_dim) + ", " +
        (args.kv_cache_dtype == KvCacheDtype::kFp8E4M3 ? "an FP8" : "a 16-bit") + " cache, " +
        std::to_string(args.max_query_len) + " query tokens x " +
        std::to_string(args.num_heads / args.num_kv_heads) +
        " heads per KV head); leave the kernel on auto to use the one that applies");
  }
  if (args.num_seqs == 0 || args.max_query_len == 0) return Status::ok();

  Params params{};
  params.q = args.q;
  params.out = args.out;
  params.k_cache = args.k_cache;
  params.v_cache = args.v_cache;
  params.cu_query_lens = args.cu_query_lens;
  params.context_lens = args.context_lens;
  params.block_tables = args.block_tables;
  params.block_table_stride = args.block_table_stride;
  params.block_size = args.block_size;
  params.block_div = BlockDivisor::make(args.block_size);
  params.num_heads = args.num_heads;
  params.num_kv_heads = args.num_kv_heads;
  params.group = args.num_heads / args.num_kv_heads;
  params.scale_log2 = args.scoring.scale * kLog2e;
  if (args.scoring.softcap > 0.0f) {
    params.softcap_log2 = args.scoring.softcap * kLog2e;
    params.inv_softcap_log2 = 1.0f / params.softcap_log2;
  }
  // A window of 2^30 keys or more covers every context the kernels take: full attention.
  params.window =
      args.scoring.window < (int64_t{1} << 30) ? static_cast<int>(args.scoring.window) : 0;
  params.num_splits = args.num_splits;
  params.split_size = args.num_splits > 1 ? args.split_size : 0;
  params.total_q = args.total_q;
  if (args.rope.qkv != nullptr) {
    params.qkv = args.rope.qkv;
    params.rope = args.rope.constants;
    // The kernel stores the step's keys: the caller's cache, which AttentionArgs types const
    // for every other launch.
    params.k_store = const_cast<void*>(args.k_cache);
    params.v_store = const_cast<void*>(args.v_cache);
  }
  if (args.num_splits > 1) {
    params.ws_o = static_cast<float*>(args.workspace);
    params.ws_lse =
        params.ws_o + static_cast<size_t>(args.num_splits) * static_cast<size_t>(args.total_q) *
                          static_cast<size_t>(args.num_heads) * static_cast<size_t>(args.head_dim);
  }
  if (args.kernel == AttentionKernel::kHopper ||
      (args.kernel == AttentionKernel::kAuto && hopper && prefill_heavy(args))) {
    return hopper_prefill(params, args, stream);
  }
  if (args.dtype == DType::kBF16) return dispatch_head_dim<__nv_bfloat16>(params, args, stream);
  return dispatch_head_dim<__half>(params, args, stream);
}

namespace block_trace {
TESSERA_BLOCK_TRACE_ATTACH(attention)
}  // namespace block_trace

}  // namespace tessera::cuda
