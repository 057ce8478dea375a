// Causal attention of a batch of sequences over the paged KV cache: prefill, chunked prefill and
// decode in one call (vLLM's "varlen" form), with grouped-query attention.
#pragma once

#include <cstdint>
#include <span>

#include "common/attention_scoring.h"
#include "common/status.h"
#include "kernels/cpu/cpu_context.h"
#include "kernels/cpu/paged_kv_cache.h"

namespace tessera::cpu {

// One sequence of the batch.
struct AttentionSeq {
  // Block ids holding the sequence's tokens in order: token p sits in block_table[p / block_size]
  // at offset p % block_size. Must cover context_len tokens; ids in [0, num_blocks) for every
  // block a query reads. With a sliding window the entries of blocks wholly before the first
  // query's window are never read (the engine may have freed them) and may hold anything.
  std::span<const int32_t> block_table;
  // New query tokens of this step (their rows are consecutive in q / out), 0 <= query_len <=
  // context_len: == context_len for a prefill, < for a chunk of a chunked prefill, 1 to decode.
  int64_t query_len = 0;
  // Tokens of the sequence in the cache, the new ones included (already written with
  // PagedKvCache::write).
  int64_t context_len = 0;
};

// out = softmax(mask(cap(q . K^T * scale))) . V per sequence and head, cap being the logit
// soft-cap (c * tanh(s / c), when scoring.softcap = c > 0) and mask the causal mask, narrowed to
// the last scoring.window positions when the window is > 0. Scores are fp32 dot products, the
// softmax is max-subtracted with fp32 exp, and the denominators and weighted sums of V are
// accumulated in double (so long contexts do not drift) and rounded once. Query j (0-based) of a
// sequence sits at position p = context_len - query_len + j and attends to cache positions
// attention_window_start(p, window) ..= p; keys before that are not read. Query head h reads kv
// head h / (num_heads / num_kv_heads) (GQA; repeat_kv in transformers).
//   cache/layer: the layer's K/V in the paged cache
//   q:       [total_q, num_heads, head_dim] fp32, total_q = sum of query_len (rows in seq order);
//            num_heads = q.size() / (total_q * head_dim), a multiple of num_kv_heads
//   seqs:    [num_seqs]
//   scoring: scale (usually 1 / sqrt(head_dim), applied to q . k before the soft-cap and the
//            mask, as transformers' eager attention does), softcap (0 = off), window (0 = full)
//   out:     [total_q, num_heads, head_dim] fp32, must not overlap q
// Bad sizes, block tables, lengths or scoring are INVALID_ARGUMENT, reported before anything is
// written.
Status paged_attention(CpuContext& ctx, const PagedKvCache& cache, int64_t layer,
                       std::span<const float> q, std::span<const AttentionSeq> seqs,
                       const AttentionScoring& scoring, std::span<float> out);

}  // namespace tessera::cpu
