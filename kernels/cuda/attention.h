// Causal attention over the paged KV cache on the GPU, for prefill, chunked prefill and decode
// in one call (the varlen form of cpu::paged_attention, its oracle), written for Hopper
// (sm_90a) with bf16/fp16 tensor-core MMAs and fp32 softmax / accumulation.
//
// Work decomposition (FlashAttention-2 style, with GQA packing): a CTA owns one KV head of one
// sequence and a tile of 64 "rows", a row being (query token, query head of that KV head's
// group), so K/V tiles loaded once serve the whole group; a CTA of at most 16 rows (decode with
// group size <= 16) spreads each tile's keys over its 4 warps instead. Keys are walked in tiles
// of 64 with an online softmax. For long contexts the keys can
// be split across CTAs (flash-decoding): each split writes a partial output and its log-sum-exp
// to `workspace`, and a combine kernel merges them.
//
// Launch: grid (ceil(max_query_len * G / 64), num_seqs, num_kv_heads * num_splits), 128 threads
// (4 warps x 16 rows), G = num_heads / num_kv_heads. Keys per tile: 64 (32 for head_dim 256).
// K/V tiles stream through shared memory in a cp.async pipeline 3 tiles deep (2 at head_dim
// 256); dynamic shared memory is 2 * stages * tile_keys * (head_dim + 8) * 2 bytes
// (+ 64 * (256 + 8) * 2 for Q at head_dim 256).
// An FP8 (E4M3) cache streams its tiles as bytes (head_dim per key, five stages up to head_dim
// 128, three at 256); each tile's K, then its V, is widened exactly into one 16-bit tile before
// the MMAs read it: dynamic shared memory is 2 * stages * tile_keys * head_dim
// + tile_keys * (head_dim + 8) * 2 bytes (+ Q at head_dim 256).
// Other head sizes (any even one up to 1024: 80, 96, 192, ...) run on a general kernel, a warp
// per (token, head) row and one key at a time, without split-K: slower, equally exact.
// Prefill-heavy launches at head_dim 128 with a 16-bit cache take the Hopper kernel instead
// (attention_sm90.cu: wgmma, a producer warpgroup, 128-row x 128-key tiles; AttentionKernel).
// Precision: scores, softmax and O accumulate in fp32; the softmax weights P are rounded to the
// input dtype before the P.V MMA (as FlashAttention does); the output is rounded once.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "common/attention_scoring.h"
#include "common/kv_cache_dtype.h"
#include "common/status.h"
#include "common/tensor.h"
#include "kernels/cuda/rope.h"

namespace tessera::cuda {

// Which kernel runs a launch. kAuto: the Hopper prefill kernel where it applies and the launch
// is prefill-heavy (hopper_prefill_applies and, on average, a sequence's rows fill one of its
// 128-row tiles: total_q * group >= 128 * num_seqs), the tile kernel otherwise (it also serves
// decode, FP8 caches and the head sizes the Hopper kernel does not take). kTiles and kHopper
// force one (tests and benchmarks compare them); kHopper where it does not apply is
// INVALID_ARGUMENT.
enum class AttentionKernel { kAuto, kTiles, kHopper };

// "auto", "tiles" or "hopper" (TESSERA_ATTENTION_BACKEND, read by the CUDA model: like vLLM's
// VLLM_ATTENTION_BACKEND, for comparing the kernels end to end); INVALID_ARGUMENT otherwise.
Expected<AttentionKernel> parse_attention_kernel(std::string_view name);

// Decode with the rotary embedding inside the attention (rope_and_cache's work, its bits): the
// kernel reads q, k and v as projected from `qkv` ([tokens, (num_heads + 2 num_kv_heads) *
// head_dim], the q|k|v GEMV's output), applies the q/k head norms (when given) and the rotation at
// each sequence's position context_len - 1, and stores the step's k and v in the cache itself,
// so no rope_and_cache launch comes before it. Only where attention_rope_applies() (one query
// token per sequence, a 16-bit cache, head_dim 64 or 128, the rotation over the whole head).
struct AttentionRope {
  const void* qkv = nullptr;  // null: off (q is rope_and_cache's q_out)
  RopeConstants constants;    // the layer's, as rope_and_cache takes them
};

struct AttentionArgs {
  AttentionKernel kernel = AttentionKernel::kAuto;
  DType dtype = DType::kBF16;  // of q and out (and the cache unless it is FP8): kBF16 or kF16
  // kFp8E4M3: k_cache / v_cache hold E4M3 bytes (scale 1), widened exactly: to `dtype` in
  // shared memory before the MMAs (prefill), or to fp16 in registers (decode, whose MMAs are
  // fp16 then, with q rounded to fp16).
  KvCacheDtype kv_cache_dtype = KvCacheDtype::kAuto;
  // q, out, k_cache, v_cache and workspace must be 16-byte aligned (cudaMalloc'd buffers are).
  // [total_q, num_heads, head_dim]; total_q = cu_query_lens[num_seqs]
  const void* q = nullptr;
  void* out = nullptr;  // [total_q, num_heads, head_dim]; must not overlap q
  // One layer's cache: [num_blocks, block_size, num_kv_heads, head_dim]
  const void* k_cache = nullptr;
  const void* v_cache = nullptr;
  int64_t num_blocks = 0;
  int block_size = 0;  // the engine's (EngineSpec::block_size), in [1, 256]; required
  // Per sequence (device memory):
  //   cu_query_lens: [num_seqs + 1] int32 prefix sums of the query lengths (rows of q / out)
  //   context_lens:  [num_seqs] int32, tokens in the cache including the new ones; a sequence
  //                  with context_len 0 is padding: skipped, its output rows left unwritten
  //   block_tables:  [num_seqs, block_table_stride] int32 block ids
  // Query token j of sequence s sits at position p = context_len - query_len + j and attends to
  // positions attention_window_start(p, scoring.window) ..= p. With a window, the block-table
  // entries of blocks wholly before the window of the sequence's first query are never read
  // (the engine may have freed those blocks): decode reads only the window's blocks.
  // The three are read before the kernel waits for the one launched before it on the stream
  // (launch_pdl): they must not be that kernel's output (the model copies them from the host).
  const int32_t* cu_query_lens = nullptr;
  const int32_t* context_lens = nullptr;
  const int32_t* block_tables = nullptr;
  int block_table_stride = 0;
  int num_seqs = 0;
  int max_query_len = 0;  // >= every query_len in the batch (sizes the grid)
  int num_heads = 0;
  int num_kv_heads = 0;  // divides num_heads
  int head_dim = 0;      // even, 2 .. 1024; 16, 32, 64, 128 and 256 take the tile kernel
  // scale (usually 1 / sqrt(head_dim); > 0), the logit soft-cap (0 = off: c tanh(s / c) on the
  // scaled score before the mask) and the sliding window (0 = full), as cpu::paged_attention.
  AttentionScoring scoring;
  // Split-K: num_splits CTAs per sequence and KV head share its keys. split_size (a multiple of
  // 64) is the capacity: num_splits * split_size >= every context_len. On the device each
  // sequence spreads the keys its queries read (its whole context, or from its first query's
  // window start on with a window) over the splits in whole 64-key tiles (ceil(keys /
  // num_splits) rounded up to 64), so a CUDA graph captured with one num_splits still cuts a
  // 256-token context 4 ways and an 8k one 32 ways; a sequence that needs a single split writes
  // `out` directly. With num_splits == 1 there is no workspace and no combine, and split_size is
  // ignored.
  int num_splits = 1;
  int split_size = 0;
  // attention_workspace_bytes(total_q, num_heads, head_dim, num_splits), fp32:
  //   [num_splits][total_q][num_heads][head_dim] partial outputs (each normalized by its split's
  //   own softmax denominator), then [num_splits][total_q][num_heads] their natural-log
  //   log-sum-exps (-inf for a split that saw no key of that row).
  void* workspace = nullptr;
  int64_t total_q = 0;  // rows of q (>= cu_query_lens[num_seqs]); sizes the workspace indexing
  // With rope.qkv set, q is ignored and the step's keys are stored into k_cache / v_cache by the
  // kernel (AttentionRope).
  AttentionRope rope;
};

// Whether `args` (its rope.qkv aside) can take AttentionRope: max_query_len 1, a 16-bit cache,
// head_dim 64 or 128, at most 16 query heads per KV head.
bool attention_rope_applies(const AttentionArgs& args);

// Whether the Hopper prefill kernel (sm_90a: wgmma, a producer warpgroup streaming 128-key K/V
// tiles through an mbarrier pipeline, two consumer warpgroups of 64 rows each) can run `args`:
// head_dim 128, a 16-bit cache, and at most 65535 128-row tiles per sequence. It ignores split-K
// (each CTA walks all its keys and writes `out`).
bool hopper_prefill_applies(const AttentionArgs& args);

// Bytes of workspace a split-K launch needs: num_splits * total_q * num_heads * (head_dim + 1)
// * 4 (0 when num_splits <= 1).
size_t attention_workspace_bytes(int64_t total_q, int num_heads, int head_dim, int num_splits);

// Picks a split for decode-like batches: with ctas = num_seqs * num_kv_heads, splits =
// ceil(2 * num_sms / ctas) capped at ceil(max_context / 256) and at 64; split_size =
// ceil(max_context / splits) rounded up to a multiple of 64, and num_splits = ceil(max_context /
// split_size), so num_splits * split_size >= max_context. {1, 0} (no split) when ctas already
// fill 2 * num_sms or max_context <= 256. Used by the model at graph-capture time with
// max_context = max_model_len. Returns {num_splits, split_size}.
struct SplitPlan {
  int num_splits = 1;
  int split_size = 0;
};
SplitPlan plan_attention_splits(int num_seqs, int num_kv_heads, int64_t max_context, int num_sms);

// out = softmax(mask(cap(q . K^T * scale))) . V per sequence and head, the mask causal and
// narrowed to the window (see cpu::paged_attention). Every kernel (tiles, decode, split-K, the
// general head sizes, Hopper prefill) skips the key tiles wholly outside a CTA's rows' windows.
// Launches on `stream` (one kernel, two with split-K), graph-capturable: no allocation, no
// synchronization. INVALID_ARGUMENT for unsupported shapes, null or misaligned pointers, a bad
// scoring (check_attention_scoring, or a scale <= 0), or a split-K launch without workspace /
// with a split_size that is not a positive multiple of 64.
Status paged_attention(const AttentionArgs& args, cudaStream_t stream);

}  // namespace tessera::cuda
