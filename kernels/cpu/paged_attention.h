// Causal attention of a batch of sequences over the paged KV cache: prefill, chunked prefill and
// decode in one call (vLLM's "varlen" form), with grouped-query attention.
#pragma once

#include <cstdint>
#include <span>

#include "common/status.h"
#include "kernels/cpu/cpu_context.h"
#include "kernels/cpu/paged_kv_cache.h"

namespace tessera::cpu {

// One sequence of the batch.
struct AttentionSeq {
  // Block ids holding the sequence's tokens in order: token p sits in block_table[p / block_size]
  // at offset p % block_size. Must cover context_len tokens; ids in [0, num_blocks).
  std::span<const int32_t> block_table;
  // New query tokens of this step (their rows are consecutive in q / out), 0 <= query_len <=
  // context_len: == context_len for a prefill, < for a chunk of a chunked prefill, 1 to decode.
  int64_t query_len = 0;
  // Tokens of the sequence in the cache, the new ones included (already written with
  // PagedKvCache::write).
  int64_t context_len = 0;
};

// out = softmax(q . K^T * scale + causal mask) . V per sequence and head. Scores are fp32 dot
// products, the softmax is max-subtracted with fp32 exp, and the denominators and weighted sums
// of V are accumulated in double (so long contexts do not drift) and rounded once. Query j
// (0-based) of a sequence sits at position context_len - query_len + j and attends to cache
// positions 0 ..= that position. Query head h reads kv head h / (num_heads / num_kv_heads) (GQA;
// repeat_kv in transformers).
//   cache/layer: the layer's K/V in the paged cache
//   q:     [total_q, num_heads, head_dim] fp32, total_q = sum of query_len (rows in seq order);
//          num_heads = q.size() / (total_q * head_dim), a multiple of num_kv_heads
//   seqs:  [num_seqs]
//   scale: usually 1 / sqrt(head_dim); applied to q . k before the mask, as transformers' eager
//          attention does
//   out:   [total_q, num_heads, head_dim] fp32, must not overlap q
// Bad sizes, block tables or lengths are INVALID_ARGUMENT, reported before anything is written.
Status paged_attention(CpuContext& ctx, const PagedKvCache& cache, int64_t layer,
                       std::span<const float> q, std::span<const AttentionSeq> seqs, float scale,
                       std::span<float> out);

}  // namespace tessera::cpu
