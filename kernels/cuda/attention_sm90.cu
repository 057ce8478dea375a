// Paged causal prefill attention for Hopper (sm_90a), FlashAttention-3 style: warpgroup MMAs
// (wgmma) reading K and V straight from shared memory, a producer warpgroup that streams the
// paged K/V tiles while two consumer warpgroups compute, and mbarriers between them.
//
// A CTA owns 128 packed rows of one KV head of one sequence (row R = token R / G, query head
// kv_head * G + R % G, as in attention.cu) and walks the keys its rows can see (from the tile
// holding its first row's sliding-window start, 0 without a window, to its last row's position)
// in tiles of 128, K and V each kStages deep:
//   warpgroup 0 (producer): cp.async gathers of each tile's 128 keys through the block table
//     (16-byte chunks, zero-filled past the context) into the 128-byte-swizzled layout wgmma
//     reads, then cp.async.mbarrier.arrive on the tile's "full" barrier; it reuses a stage once
//     the consumers' 8 warps have arrived on its "empty" barrier. TMA would need 16-token boxes
//     per cache block and a tensor map per layer; cp.async takes any block size and zero-fills.
//   warpgroups 1, 2 (consumers, 64 rows each): S = Q K^T with wgmma.m64n128k16 (Q and K from
//     shared memory, fp32 accumulators), the soft-cap if any, the causal mask on the diagonal
//     tiles (and the window's on its first ones), an online
//     softmax in the log2 domain, P rounded to the input dtype and kept in registers as the A
//     operand of O += P V (wgmma with V "MN-major" from the same swizzled tile layout). S of
//     tile j runs on the tensor cores while P V of tile j - 1 is queued behind it and the
//     softmax of tile j follows on the ALUs; the two warpgroups take turns to issue (ping-pong).
// setmaxnreg gives the producer 56 registers and the consumers 224. CTAs are launched longest
// first (the causal tiles at the end of a sequence see the most keys).
// On the H200, 4096 causal tokens of Llama-3-8B (32 heads / 8 KV heads) take 271 us per layer
// (507 TFLOP/s) against the tile kernel's 638 (kernel_bench). What it took: the producer must
// never wait on a block-table read (entries are read two tiles ahead) nor on its own shared-
// memory loads (a thread's 16 key offsets are contiguous); it was the bottleneck twice (ncu:
// the consumers waited for K in 30% of the samples at 415 us).
//
// Shared-memory tiles (each from a 1024-byte aligned address): a tile of `n` rows x 128
// elements is two columns of 64 elements, [column][row][128 bytes]; the 16-byte chunk c of a row
// r sits at chunk c ^ (r % 8) of its 128 bytes (the 128-byte swizzle). K-major descriptors (Q,
// K): stride byte offset 1024 (8 rows), k steps of 16 elements add 32 bytes within a column.
// V as the B operand of P V is MN-major: leading byte offset = one column (n rows x 128 bytes),
// stride byte offset 1024 (8 keys), k steps of 16 keys add 2048 bytes.
#include "kernels/cuda/attention_sm90.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "kernels/cuda/attention_common.cuh"
#include "kernels/cuda/cuda_util.h"
#include "kernels/cuda/device_math.cuh"

namespace tessera::cuda {
namespace attn {
namespace {

constexpr int kHeadDim = 128;
constexpr int kTileRows = 128;  // query rows per CTA: two consumer warpgroups x 64
constexpr int kTileKeys = 128;  // keys per K / V tile
constexpr int kStages = 2;
// Warpgroup 0 loads, warpgroups 1 and 2 compute; setmaxnreg moves registers from the producer
// to the consumers: 56 + 2 x 224 <= 512 per thread of each SM quarter (a quarter holds one warp
// of each warpgroup). One producer warp alone was too slow to issue the copies (2x the time).
constexpr int kThreads = 384;
constexpr int kConsumerWarps = 8;
constexpr int kProducerThreads = 128;
constexpr int kProducerRegisters = 56;
constexpr int kConsumerRegisters = 224;
constexpr int kRowBytes = 128;                         // 64 elements: one swizzled row of a column
constexpr int kKvColumnBytes = kTileKeys * kRowBytes;  // 16 KiB
constexpr int kKvTileBytes = 2 * kKvColumnBytes;
constexpr int kQColumnBytes = 64 * kRowBytes;  // a consumer warpgroup's 64 rows
constexpr int kQBytes = 2 * kQColumnBytes;
// Offsets from the 1024-byte aligned base: Q of both warpgroups, K stages, V stages, barriers
// (K full, K empty, V full, V empty; kStages each).
constexpr int kKOffset = 2 * kQBytes;
constexpr int kVOffset = kKOffset + kStages * kKvTileBytes;
constexpr int kBarOffset = kVOffset + kStages * kKvTileBytes;
constexpr int kOffsetTable = kBarOffset + 4 * kStages * 8;  // the producer's key offsets
constexpr int kSmemBytes = kOffsetTable + kStages * kTileKeys * 8 + 1024;  // + alignment slack
static_assert(kSmemBytes <= 227 * 1024, "Hopper allows 227 KiB of shared memory per CTA");

// ---- PTX wrappers: mbarriers, proxy fences, setmaxnreg, wgmma ----

__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n"
      "}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Arrives on `bar` once every cp.async this thread issued before has landed.
__device__ __forceinline__ void cp_async_arrive(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
// Orders this thread's generic-proxy view of shared memory (cp.async, st.shared) with the async
// proxy that wgmma reads through.
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
__device__ __forceinline__ void named_barrier(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
template <int N>
__device__ __forceinline__ void set_max_registers_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void set_max_registers_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}
__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Keeps the compiler from moving reads or writes of an accumulator across the asynchronous MMAs.
__device__ __forceinline__ void fence_registers(float (&d)[64]) {
#pragma unroll
  for (int i = 0; i < 64; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
// The same for the A fragments an MMA reads asynchronously: their registers stay untouched until
// the MMA is awaited.
__device__ __forceinline__ void fence_registers(uint32_t (&a)[8][4]) {
#pragma unroll
  for (int i = 0; i < 8; ++i) {
#pragma unroll
    for (int j = 0; j < 4; ++j) asm volatile("" : "+r"(a[i][j])::"memory");
  }
}

// A shared-memory matrix descriptor with the 128-byte swizzle: start address, leading and stride
// byte offsets, each in 16-byte units.
__device__ __forceinline__ uint64_t smem_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  return static_cast<uint64_t>((addr & 0x3FFFFu) >> 4) | (static_cast<uint64_t>(lbo >> 4) << 16) |
         (static_cast<uint64_t>(sbo >> 4) << 32) | (uint64_t{1} << 62);
}

// Byte offset of 16-byte chunk `chunk` (0..15) of row `row` in a swizzled tile whose 64-element
// columns are `column_bytes` apart.
__device__ __forceinline__ uint32_t swizzled(int row, int chunk, int column_bytes) {
  return static_cast<uint32_t>((chunk >> 3) * column_bytes + row * kRowBytes +
                               (((chunk & 7) ^ (row & 7)) << 4));
}

// wgmma.m64n128k16 with fp32 accumulators d (the m16n8 C layout per warp, 16 n-chunks of 8):
// ss reads A (K-major) and B (K-major) from shared memory; rs takes A from registers (the m16n8k16
// A fragment per warp) and B MN-major (transposed). accumulate == 0 overwrites d.
#define TESSERA_WGMMA_D_REGS                                                                    \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, " \
  "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, "  \
  "%38, "                                                                                       \
  "%39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, "  \
  "%57, "                                                                                       \
  "%58, %59, %60, %61, %62, %63}"
#define TESSERA_WGMMA_D_OPERANDS(d)                                                               \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
      "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]),    \
      "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]),  \
      "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]),  \
      "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]),  \
      "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]),  \
      "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]),  \
      "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]),  \
      "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])

template <typename T>
struct Wgmma;

#define TESSERA_DEFINE_WGMMA(T, PTX_TYPE)                                                       \
  template <>                                                                                   \
  struct Wgmma<T> {                                                                             \
    static __device__ __forceinline__ void ss(float (&d)[64], uint64_t desc_a, uint64_t desc_b, \
                                              int accumulate) {                                 \
      asm volatile(                                                                             \
          "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"                                          \
          "wgmma.mma_async.sync.aligned.m64n128k16.f32." PTX_TYPE "." PTX_TYPE                  \
          " " TESSERA_WGMMA_D_REGS ", %64, %65, p, 1, 1, 0, 0;\n}\n"                            \
          : TESSERA_WGMMA_D_OPERANDS(d)                                                         \
          : "l"(desc_a), "l"(desc_b), "r"(accumulate));                                         \
    }                                                                                           \
    static __device__ __forceinline__ void rs(float (&d)[64], const uint32_t (&a)[4],           \
                                              uint64_t desc_b, int accumulate) {                \
      asm volatile(                                                                             \
          "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"                                          \
          "wgmma.mma_async.sync.aligned.m64n128k16.f32." PTX_TYPE "." PTX_TYPE                  \
          " " TESSERA_WGMMA_D_REGS ", {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"              \
          : TESSERA_WGMMA_D_OPERANDS(d)                                                         \
          : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate));          \
    }                                                                                           \
  };

TESSERA_DEFINE_WGMMA(__nv_bfloat16, "bf16")
TESSERA_DEFINE_WGMMA(__half, "f16")

#undef TESSERA_DEFINE_WGMMA
#undef TESSERA_WGMMA_D_OPERANDS
#undef TESSERA_WGMMA_D_REGS

template <typename T>
__global__ void __launch_bounds__(kThreads, 1)
    hopper_prefill_kernel(const __grid_constant__ Params p) {
  extern __shared__ uint8_t smem_raw[];
  const uint32_t base = (smem_u32(smem_raw) + 1023u) & ~1023u;
  const uint32_t bars = base + kBarOffset;
  auto k_full = [&](int s) { return bars + 8u * s; };
  auto k_empty = [&](int s) { return bars + 8u * (kStages + s); };
  auto v_full = [&](int s) { return bars + 8u * (2 * kStages + s); };
  auto v_empty = [&](int s) { return bars + 8u * (3 * kStages + s); };

  dev::pdl_wait();  // q and the cache are written by the kernels before
  dev::pdl_launch_dependents();

  const int kv_head = blockIdx.x;
  const int seq = blockIdx.y;
  const int tile = static_cast<int>(gridDim.z - 1 - blockIdx.z);  // longest tiles first
  const int ctx = p.context_lens[seq];
  const int q_start = p.cu_query_lens[seq];
  const int q_len = p.cu_query_lens[seq + 1] - q_start;
  const int rows = q_len * p.group;
  const int row0 = tile * kTileRows;
  if (ctx <= 0 || row0 >= rows) return;  // padding, or past this sequence's rows: whole CTA
  const int q_pos0 = ctx - q_len;        // position of the sequence's first query token
  const int last_token = min(q_len - 1, (row0 + kTileRows - 1) / p.group);
  const int first_pos = q_pos0 + row0 / p.group;  // the CTA's earliest row position
  // Key tiles tile0 .. tile0 + n_tiles - 1 (keys tile * 128 ..): from the one holding the first
  // row's window start (0 without a window; earlier tiles are not loaded) to the last row's.
  const int kv_lo = window_start(p, first_pos);  // keys below it are neither read nor looked up
  const int tile0 = kv_lo / kTileKeys;
  const int n_tiles = (q_pos0 + last_token + 1 + kTileKeys - 1) / kTileKeys - tile0;
  // The last row's window start: from it on no key is below any row's window.
  const int last_lo = window_start(p, q_pos0 + last_token);

  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(k_full(s), kProducerThreads);
      mbar_init(v_full(s), kProducerThreads);
      mbar_init(k_empty(s), kConsumerWarps);
      mbar_init(v_empty(s), kConsumerWarps);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  const int warp_id = static_cast<int>(threadIdx.x) >> 5;
  const int lane = static_cast<int>(threadIdx.x) & 31;
  if (warp_id < 4) {
    // ---- producer warpgroup: K and V tiles through the block table ----
    set_max_registers_dec<kProducerRegisters>();
    const int t = static_cast<int>(threadIdx.x);
    const int32_t* table = p.block_tables + static_cast<int64_t>(seq) * p.block_table_stride;
    int64_t* offsets =
        reinterpret_cast<int64_t*>(smem_raw + (base - smem_u32(smem_raw)) + kOffsetTable);
    const int chunk = t & 15;      // this thread's 16-byte chunk of every key it copies
    const int row_first = t >> 4;  // and its keys: row_first + 8 i
    const T* k_chunk = static_cast<const T*>(p.k_cache) + chunk * 8;
    const T* v_chunk = static_cast<const T*>(p.v_cache) + chunk * 8;
    const int64_t slot_elems = static_cast<int64_t>(p.num_kv_heads) * kHeadDim;
    const int64_t head_elems = static_cast<int64_t>(kv_head) * kHeadDim;
    // Thread t looks up key (tile0 + j) * 128 + t of each tile j: its block-table entry is read
    // two tiles ahead and turned into the element offset of the key's head one tile ahead, in a
    // per-tile table the threads share. (Used as soon as read, the entry's L2 latency delayed
    // each tile's copies: the consumers then waited for K a third of the time.)
    // Keys before kv_lo (the first tile's, with a window) are skipped like those past the
    // context: their blocks may have been freed, their table entries hold anything.
    auto block_of = [&](int j) -> int32_t {
      const int key = (tile0 + j) * kTileKeys + t;
      return j < n_tiles && key >= kv_lo && key < ctx ? table[p.block_div.divide(key)] : 0;
    };
    auto offset_of = [&](int j, int32_t block) -> int64_t {
      const int key = (tile0 + j) * kTileKeys + t;
      if (key < kv_lo || key >= ctx) return 0;
      const int in_block = key - p.block_div.divide(key) * p.block_size;
      return (static_cast<int64_t>(block) * p.block_size + in_block) * slot_elems + head_elems;
    };
    // The table holds key r's offset at (r % 8) * 16 + r / 8, so that a thread's 16 keys
    // (row_first + 8 i) are 128 contiguous bytes, read in 8 loads. Keys past the context (rows >=
    // valid) or before kv_lo (rows < skip) are zero-filled, reading nothing.
    auto load = [&](const T* cache_chunk, uint32_t dst, const int64_t* tile_offsets, int skip,
                    int valid) {
      const int4* mine = reinterpret_cast<const int4*>(tile_offsets + row_first * 16);
#pragma unroll
      for (int i2 = 0; i2 < kTileKeys / 16; ++i2) {
        const int4 pair = mine[i2];
        const int64_t off[2] = {static_cast<int64_t>(static_cast<uint32_t>(pair.x)) |
                                    (static_cast<int64_t>(pair.y) << 32),
                                static_cast<int64_t>(static_cast<uint32_t>(pair.z)) |
                                    (static_cast<int64_t>(pair.w) << 32)};
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int row = row_first + 8 * (2 * i2 + h);
          cp_async_16(dst + swizzled(row, chunk, kKvColumnBytes), cache_chunk + off[h],
                      row >= skip && row < valid);
        }
      }
    };
    int32_t block_next = block_of(0);
    int32_t block_after = block_of(1);
    for (int j = 0; j < n_tiles; ++j) {
      const int s = j % kStages;
      const int use = j / kStages;
      int64_t* tile_offsets = offsets + s * kTileKeys;
      tile_offsets[(t & 7) * 16 + (t >> 3)] = offset_of(j, block_next);
      block_next = block_after;
      block_after = block_of(j + 2);       // awaited only in the next iteration
      named_barrier(3, kProducerThreads);  // the table of tile j is complete (and j - 2's read)
      const int valid = ctx - (tile0 + j) * kTileKeys;
      const int skip = kv_lo - (tile0 + j) * kTileKeys;  // > 0 in the first tile only
      if (use > 0) mbar_wait(k_empty(s), (use - 1) & 1);
      load(k_chunk, base + kKOffset + s * kKvTileBytes, tile_offsets, skip, valid);
      cp_async_arrive(k_full(s));
      if (use > 0) mbar_wait(v_empty(s), (use - 1) & 1);
      load(v_chunk, base + kVOffset + s * kKvTileBytes, tile_offsets, skip, valid);
      cp_async_arrive(v_full(s));
    }
    cp_async_wait<0>();  // nothing in flight when the thread exits
    return;
  }

  // ---- consumers: two warpgroups of 64 rows ----
  set_max_registers_inc<kConsumerRegisters>();
  const int cw = (warp_id >> 2) - 1;
  const int ct = static_cast<int>(threadIdx.x) & 127;
  const int warp = warp_id & 3;  // within the warpgroup
  const int gid = lane >> 2;
  const int tig = lane & 3;
  const uint32_t q_smem = base + cw * kQBytes;

  {  // Q: this warpgroup's 64 rows, zero past the sequence's rows
    const T* q = static_cast<const T*>(p.q);
    const int chunk = ct & 15;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int r = (ct >> 4) + 8 * i;
      const int row = row0 + 64 * cw + r;
      const bool valid = row < rows;
      const T* src = q;
      if (valid) {
        const int token = row / p.group;
        const int head = kv_head * p.group + row % p.group;
        src += (static_cast<int64_t>(q_start + token) * p.num_heads + head) * kHeadDim + chunk * 8;
      }
      cp_async_16(q_smem + swizzled(r, chunk, kQColumnBytes), src, valid);
    }
    cp_async_commit();
    cp_async_wait<0>();
    fence_proxy_async();
    named_barrier(1 + cw, 128);
  }

  // This thread's two rows (gid and gid + 8 of its warp's 16) and their positions; rows past the
  // sequence's take its last position (computed, never stored).
  const int row_lo = row0 + 64 * cw + 16 * warp + gid;
  int pos[2];
  int lo[2];  // the rows' window starts
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    pos[h] = q_pos0 + min((row_lo + 8 * h) / p.group, q_len - 1);
    lo[h] = window_start(p, pos[h]);
  }
  // The soft-cap on raw scores: s -> cap_out * tanh(s * cap_in) is c tanh(s scale / c) / scale,
  // so that the softmax below still scales by scale_log2.
  const bool capped = p.softcap_log2 > 0.0f;
  const float cap_in = p.scale_log2 * p.inv_softcap_log2;
  const float cap_out = capped ? p.softcap_log2 / p.scale_log2 : 0.0f;

  float o[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) o[i] = 0.0f;
  float m[2] = {neg_inf(), neg_inf()};
  float l[2] = {0.0f, 0.0f};
  float sc[64];
  uint32_t pa[8][4];

  // S = Q K^T of tile j into sc (issued, not awaited).
  auto issue_qk = [&](int j) {
    const int s = j % kStages;
    const uint32_t k_tile = base + kKOffset + s * kKvTileBytes;
    mbar_wait(k_full(s), (j / kStages) & 1);
    fence_proxy_async();
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kHeadDim / 16; ++kk) {
      const uint32_t step = (kk & 3) * 32u;  // 16 elements within a 64-element column
      Wgmma<T>::ss(sc, smem_desc(q_smem + (kk >> 2) * kQColumnBytes + step, 16, 1024),
                   smem_desc(k_tile + (kk >> 2) * kKvColumnBytes + step, 16, 1024), kk > 0);
    }
    wgmma_commit();
  };
  // O += P V of tile j (issued, not awaited).
  auto issue_pv = [&](int j) {
    const int s = j % kStages;
    const uint32_t v_tile = base + kVOffset + s * kKvTileBytes;
    mbar_wait(v_full(s), (j / kStages) & 1);
    fence_proxy_async();
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kTileKeys / 16; ++kk) {
      Wgmma<T>::rs(o, pa[kk], smem_desc(v_tile + kk * 16 * kRowBytes, kKvColumnBytes, 1024), 1);
    }
    wgmma_commit();
  };
  auto release = [&](uint32_t bar) {
    __syncwarp();
    if (lane == 0) mbar_arrive(bar);
  };
  // Soft-caps and masks tile j's scores, turns them into P (exp2 against the new row maxima) and
  // returns the factors by which O and l must shrink.
  auto softmax = [&](int j, float(&alpha)[2], float(&sum)[2]) {
    const int key0 = (tile0 + j) * kTileKeys;
    if (capped) {
#pragma unroll
      for (int i = 0; i < 64; ++i) sc[i] = cap_out * tanhf(sc[i] * cap_in);
    }
    // Some key past some row's position, or before some row's window start.
    if (key0 + kTileKeys - 1 > first_pos || key0 < last_lo) {
#pragma unroll
      for (int i = 0; i < 16; ++i) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int key = key0 + 8 * i + 2 * tig + e;
          if (key > pos[0] || key < lo[0]) sc[4 * i + e] = neg_inf();
          if (key > pos[1] || key < lo[1]) sc[4 * i + 2 + e] = neg_inf();
        }
      }
    }
    // Without a window every row sees key 0 in tile 0, so its max is finite from then on; with
    // one a row may see no key of its first tiles: its max stays -inf (m_use 0 below) until its
    // window starts.
    float mx[2] = {m[0], m[1]};
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      mx[0] = fmaxf(mx[0], fmaxf(sc[4 * i], sc[4 * i + 1]));
      mx[1] = fmaxf(mx[1], fmaxf(sc[4 * i + 2], sc[4 * i + 3]));
    }
    float shift[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
      const float m_use = mx[h] == neg_inf() ? 0.0f : mx[h];
      alpha[h] = fast_exp2((m[h] - m_use) * p.scale_log2);  // 0 while m is -inf
      shift[h] = m_use * p.scale_log2;
      m[h] = mx[h];
      sum[h] = 0.0f;
    }
#pragma unroll
    for (int i = 0; i < 16; ++i) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        sc[4 * i + e] = fast_exp2(fmaf(sc[4 * i + e], p.scale_log2, -shift[e >> 1]));
        sum[e >> 1] += sc[4 * i + e];
      }
    }
  };
  auto rescale_and_pack = [&](const float(&alpha)[2], const float(&sum)[2]) {
#pragma unroll
    for (int h = 0; h < 2; ++h) l[h] = l[h] * alpha[h] + sum[h];
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      o[4 * i] *= alpha[0];
      o[4 * i + 1] *= alpha[0];
      o[4 * i + 2] *= alpha[1];
      o[4 * i + 3] *= alpha[1];
    }
#pragma unroll
    for (int kk = 0; kk < 8; ++kk) {  // P as the A fragments of the 8 k-steps of 16 keys
      pa[kk][0] = HalfOps<T>::pack(sc[8 * kk], sc[8 * kk + 1]);
      pa[kk][1] = HalfOps<T>::pack(sc[8 * kk + 2], sc[8 * kk + 3]);
      pa[kk][2] = HalfOps<T>::pack(sc[8 * kk + 4], sc[8 * kk + 5]);
      pa[kk][3] = HalfOps<T>::pack(sc[8 * kk + 6], sc[8 * kk + 7]);
    }
  };

  // Ping-pong: the two warpgroups take turns to issue their MMAs (named barriers 4 and 5, FA3's
  // "warp scheduler barrier"), so that one's softmax runs while the other's MMAs occupy the
  // tensor cores. Each issues n_tiles + 1 rounds; warpgroup 0 goes first, and warpgroup 1 does
  // not signal after its last round (nobody waits for it).
  const int rounds = n_tiles + 1;
  int round = 0;
  auto my_turn = [&] { named_barrier(4 + cw, 256); };
  auto your_turn = [&] {
    if (cw == 0 || round + 1 < rounds) named_barrier_arrive(4 + (1 - cw), 256);
    ++round;
  };
  if (cw == 1) named_barrier_arrive(4, 256);

  // Tile 0, then each tile's S = Q K^T runs on the tensor cores while the previous tile's P V
  // is issued behind it and this tile's softmax runs on the ALUs.
  float alpha[2], sum[2];
  my_turn();
  issue_qk(0);
  your_turn();
  wgmma_wait<0>();
  fence_registers(sc);
  release(k_empty(0));
  softmax(0, alpha, sum);
  rescale_and_pack(alpha, sum);
  for (int j = 1; j < n_tiles; ++j) {
    fence_registers(o);
    fence_registers(pa);
    my_turn();
    issue_qk(j);
    issue_pv(j - 1);
    your_turn();
    wgmma_wait<1>();  // S of tile j
    fence_registers(sc);
    release(k_empty(j % kStages));
    softmax(j, alpha, sum);
    wgmma_wait<0>();  // O += P V of tile j - 1
    fence_registers(o);
    fence_registers(pa);
    release(v_empty((j - 1) % kStages));
    rescale_and_pack(alpha, sum);
  }
  fence_registers(o);
  fence_registers(pa);
  my_turn();
  issue_pv(n_tiles - 1);
  your_turn();
  wgmma_wait<0>();
  fence_registers(o);
  fence_registers(pa);
  release(v_empty((n_tiles - 1) % kStages));

  // out = O / l, rounded once.
  T* out = static_cast<T*>(p.out);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
    const int row = row_lo + 8 * h;
    if (row >= rows) continue;
    const float inv = 1.0f / l[h];
    const int token = row / p.group;
    const int head = kv_head * p.group + row % p.group;
    T* dst = out + (static_cast<int64_t>(q_start + token) * p.num_heads + head) * kHeadDim;
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      const uint32_t v = HalfOps<T>::pack(o[4 * i + 2 * h] * inv, o[4 * i + 2 * h + 1] * inv);
      *reinterpret_cast<uint32_t*>(dst + 8 * i + 2 * tig) = v;
    }
  }
}

int64_t row_tiles(const AttentionArgs& a) {
  const int64_t group = a.num_heads / a.num_kv_heads;
  return (static_cast<int64_t>(a.max_query_len) * group + kTileRows - 1) / kTileRows;
}

}  // namespace

Status hopper_prefill(const Params& p, const AttentionArgs& a, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(a.num_kv_heads), static_cast<unsigned>(a.num_seqs),
                  static_cast<unsigned>(row_tiles(a)));
  auto* kernel = a.dtype == DType::kBF16 ? hopper_prefill_kernel<__nv_bfloat16>
                                         : hopper_prefill_kernel<__half>;
  TESSERA_CUDA_RETURN_IF_ERROR(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes),
      "paged_attention (Hopper prefill): raising the dynamic shared memory limit");
  launch_pdl(kernel, grid, kThreads, kSmemBytes, stream, p);
  return launch_status("paged_attention (Hopper prefill)");
}

}  // namespace attn

bool hopper_prefill_applies(const AttentionArgs& a) {
  if (a.head_dim != attn::kHeadDim || a.kv_cache_dtype == KvCacheDtype::kFp8E4M3) return false;
  if (a.dtype != DType::kBF16 && a.dtype != DType::kF16) return false;
  if (a.num_kv_heads <= 0 || a.num_heads % a.num_kv_heads != 0) return false;
  const int64_t tiles = attn::row_tiles(a);
  return tiles >= 1 && tiles <= 65535;
}

}  // namespace tessera::cuda
