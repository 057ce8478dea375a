#include "kernels/cpu/paged_attention.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "kernels/cpu/op_util.h"

namespace tessera::cpu {

namespace {

Status check_seqs(const KvCacheShape& shape, std::span<const AttentionSeq> seqs, int64_t window,
                  int64_t* total_q) {
  *total_q = 0;
  for (size_t s = 0; s < seqs.size(); ++s) {
    const AttentionSeq& seq = seqs[s];
    const std::string where = "paged_attention: sequence " + std::to_string(s) + ": ";
    if (seq.context_len < 0 || seq.query_len < 0 || seq.query_len > seq.context_len) {
      return invalid_argument(where + "need 0 <= query_len <= context_len, got query_len " +
                              std::to_string(seq.query_len) + ", context_len " +
                              std::to_string(seq.context_len));
    }
    const int64_t blocks = (seq.context_len + shape.block_size - 1) / shape.block_size;
    if (static_cast<int64_t>(seq.block_table.size()) < blocks) {
      return invalid_argument(where + "block table has " + std::to_string(seq.block_table.size()) +
                              " blocks, context_len " + std::to_string(seq.context_len) +
                              " needs " + std::to_string(blocks));
    }
    // Blocks wholly before the first query's window are not read: their entries are not checked.
    const int64_t first_read =
        attention_window_start(seq.context_len - seq.query_len, window) / shape.block_size;
    for (int64_t b = seq.query_len > 0 ? first_read : blocks; b < blocks; ++b) {
      const int32_t id = seq.block_table[b];
      if (id < 0 || id >= shape.num_blocks) {
        return invalid_argument(where + "block id " + std::to_string(id) + " at index " +
                                std::to_string(b) + " is outside [0, " +
                                std::to_string(shape.num_blocks) + ")");
      }
    }
    *total_q += seq.query_len;
  }
  return Status::ok();
}

// One work item: a query token of a sequence.
struct QueryRow {
  const AttentionSeq* seq;
  int64_t row;       // row in q / out
  int64_t position;  // its position in the sequence; attends to start ..= position
  int64_t start;     // attention_window_start(position, window)
};

}  // namespace

Status paged_attention(CpuContext& ctx, const PagedKvCache& cache, int64_t layer,
                       std::span<const float> q, std::span<const AttentionSeq> seqs,
                       const AttentionScoring& scoring, std::span<float> out) {
  const KvCacheShape& shape = cache.shape();
  if (layer < 0 || layer >= shape.num_layers) {
    return invalid_argument("paged_attention: layer " + std::to_string(layer) + " is outside [0, " +
                            std::to_string(shape.num_layers) + ")");
  }
  TESSERA_RETURN_IF_ERROR(check_attention_scoring(scoring, "paged_attention: "));
  int64_t total_q = 0;
  TESSERA_RETURN_IF_ERROR(check_seqs(shape, seqs, scoring.window, &total_q));
  const int64_t hd = shape.head_dim;
  const int64_t kv_heads = shape.num_kv_heads;
  if (total_q == 0) {
    if (!q.empty() || !out.empty()) return invalid_argument("paged_attention: no query tokens");
    return Status::ok();
  }
  if (q.size() % static_cast<size_t>(total_q * hd) != 0) {
    return invalid_argument("paged_attention: q has " + std::to_string(q.size()) +
                            " elements, not a multiple of total_q * head_dim = " +
                            std::to_string(total_q) + " * " + std::to_string(hd));
  }
  const int64_t heads = static_cast<int64_t>(q.size()) / (total_q * hd);
  if (heads % kv_heads != 0) {
    return invalid_argument("paged_attention: " + std::to_string(heads) +
                            " query heads is not a multiple of " + std::to_string(kv_heads) +
                            " kv heads");
  }
  if (out.size() != q.size()) return invalid_argument("paged_attention: out and q differ in size");
  const int64_t group = heads / kv_heads;

  std::vector<QueryRow> rows;
  rows.reserve(static_cast<size_t>(total_q));
  int64_t max_keys = 0;  // keys the widest row reads
  for (const AttentionSeq& seq : seqs) {
    const int64_t first = seq.context_len - seq.query_len;
    for (int64_t j = 0; j < seq.query_len; ++j) {
      const int64_t pos = first + j;
      const int64_t start = attention_window_start(pos, scoring.window);
      rows.push_back({&seq, static_cast<int64_t>(rows.size()), pos, start});
      max_keys = std::max(max_keys, pos + 1 - start);
    }
  }
  const float scale = scoring.scale;
  const float cap = scoring.softcap;

  // Work items: (query token, kv head); the `group` query heads that share a kv head are done
  // together so each K/V row is loaded once for all of them.
  const int64_t items = total_q * kv_heads;
  const int64_t item_work = std::max<int64_t>(1, group * max_keys * hd * 2);
  const int64_t grain = std::max<int64_t>(1, detail::kParallelWork / item_work);
  ctx.parallel_for(items, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(static_cast<size_t>(group * max_keys));
    // The softmax denominators and the weighted sums of V are accumulated in double: over long
    // contexts a sequential fp32 sum would drift more than the kernels tested against this.
    std::vector<double> acc(static_cast<size_t>(group * hd));
    std::vector<double> sum(static_cast<size_t>(group));
    // One item over a 100k-token context is tens of milliseconds: tick per item there, per
    // many items over short ones.
    ProgressTicker ticker(ctx);
    for (int64_t item = begin; item < end; ++item) {
      const QueryRow& r = rows[item / kv_heads];
      const int64_t kvh = item % kv_heads;
      const int64_t start = r.start;  // scores[i] is position start + i
      const int64_t len = r.position + 1 - start;
      const std::span<const int32_t> table = r.seq->block_table;
      const float* qh = q.data() + (r.row * heads + kvh * group) * hd;  // `group` heads
      for (int64_t i = 0; i < len; ++i) {
        const int64_t p = start + i;
        const float* k =
            cache.key(layer, table[p / shape.block_size], p % shape.block_size) + kvh * hd;
        for (int64_t g = 0; g < group; ++g) {
          float x = detail::dot(qh + g * hd, k, hd) * scale;
          if (cap > 0.0f) x = std::tanh(x / cap) * cap;
          scores[g * len + i] = x;
        }
      }
      for (int64_t g = 0; g < group; ++g) {  // exp(s - max): every weight is in (0, 1]
        float* s = scores.data() + g * len;
        const float m = *std::max_element(s, s + len);
        double total = 0.0;
        for (int64_t p = 0; p < len; ++p) {
          s[p] = std::exp(s[p] - m);
          total += s[p];
        }
        sum[g] = total;
      }
      std::fill(acc.begin(), acc.end(), 0.0);
      for (int64_t i = 0; i < len; ++i) {
        const int64_t p = start + i;
        const float* v =
            cache.value(layer, table[p / shape.block_size], p % shape.block_size) + kvh * hd;
        for (int64_t g = 0; g < group; ++g) {
          const double w = scores[g * len + i];
          double* a = acc.data() + g * hd;
          for (int64_t d = 0; d < hd; ++d) a[d] += w * v[d];
        }
      }
      float* o = out.data() + (r.row * heads + kvh * group) * hd;
      for (int64_t g = 0; g < group; ++g) {
        for (int64_t d = 0; d < hd; ++d)
          o[g * hd + d] = static_cast<float>(acc[g * hd + d] / sum[g]);
      }
      ticker.done(len * group * hd * 2);
    }
  });
  return Status::ok();
}

}  // namespace tessera::cpu
