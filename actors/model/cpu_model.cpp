#include "actors/model/cpu_model.h"

#include <cmath>

#include "kernels/cpu/activation.h"
#include "kernels/cpu/embedding.h"
#include "kernels/cpu/linear.h"
#include "kernels/cpu/paged_attention.h"
#include "kernels/cpu/rms_norm.h"

namespace tessera {

CpuModel::CpuModel(const ModelConfig& config, ModelWeights weights, int threads)
    : config_(config), weights_(std::move(weights)), ctx_(threads) {}

Expected<std::unique_ptr<CpuModel>> CpuModel::create(const ModelConfig& config,
                                                     ModelWeights weights, int64_t kv_blocks,
                                                     int64_t block_size, int64_t max_model_len,
                                                     int threads) {
  if (max_model_len <= 0 || max_model_len > config.max_position_embeddings) {
    return invalid_argument("max-model-len " + std::to_string(max_model_len) + " must be in [1, " +
                            std::to_string(config.max_position_embeddings) +
                            "] (the model's max_position_embeddings)");
  }
  if (config.sliding_window && *config.sliding_window < max_model_len) {
    return invalid_argument("this model uses sliding-window attention (window " +
                            std::to_string(*config.sliding_window) +
                            "), which is not implemented yet: use --max-model-len " +
                            std::to_string(*config.sliding_window) + " or less");
  }
  std::unique_ptr<CpuModel> m(new CpuModel(config, std::move(weights), threads));
  m->max_model_len_ = max_model_len;
  cpu::KvCacheShape shape;
  shape.num_layers = config.num_layers;
  shape.num_blocks = kv_blocks;
  shape.block_size = block_size;
  shape.num_kv_heads = config.num_kv_heads;
  shape.head_dim = config.head_dim;
  auto cache = cpu::PagedKvCache::create(shape);
  if (!cache) return cache.status();
  m->cache_ = std::make_unique<cpu::PagedKvCache>(std::move(*cache));
  std::optional<cpu::Llama3RopeScaling> scaling;
  if (config.rope_scaling.type == "llama3") {
    scaling = cpu::Llama3RopeScaling{
        config.rope_scaling.factor, config.rope_scaling.low_freq_factor,
        config.rope_scaling.high_freq_factor, config.rope_scaling.original_max_position_embeddings};
  }
  auto rope = cpu::RopeTable::create(config.head_dim, config.rope_theta, max_model_len, scaling);
  if (!rope) return rope.status();
  m->rope_ = std::make_unique<cpu::RopeTable>(std::move(*rope));
  return m;
}

Expected<std::vector<float>> CpuModel::forward(std::span<const ForwardSeq> batch) {
  const ModelConfig& c = config_;
  const int64_t H = c.hidden_size;
  const int64_t hd = c.head_dim;
  const int64_t q_dim = c.num_heads * hd;
  const int64_t kv_dim = c.num_kv_heads * hd;
  const int64_t I = c.intermediate_size;
  const int64_t bs = cache_->shape().block_size;

  // Flatten the batch: ids, positions, cache slots; attention metadata per sequence.
  std::vector<int32_t> ids;
  std::vector<int64_t> positions;
  std::vector<int64_t> slots;
  std::vector<std::vector<int32_t>> tables(batch.size());
  std::vector<cpu::AttentionSeq> attn(batch.size());
  std::vector<int64_t> logit_rows;
  for (size_t s = 0; s < batch.size(); ++s) {
    const ForwardSeq& seq = batch[s];
    if (seq.tokens.empty()) return invalid_argument("a sequence in the batch has no tokens");
    const int64_t end = seq.start_position + static_cast<int64_t>(seq.tokens.size());
    if (seq.start_position < 0 || end > max_model_len_) {
      return invalid_argument("positions up to " + std::to_string(end) + " exceed max-model-len " +
                              std::to_string(max_model_len_));
    }
    if (static_cast<int64_t>(seq.block_table.size()) * bs < end) {
      return invalid_argument("the block table holds " +
                              std::to_string(seq.block_table.size() * bs) +
                              " tokens, the sequence needs " + std::to_string(end));
    }
    for (uint32_t b : seq.block_table) {
      if (static_cast<int64_t>(b) >= cache_->shape().num_blocks) {
        return invalid_argument("block " + std::to_string(b) + " is outside the KV cache (" +
                                std::to_string(cache_->shape().num_blocks) + " blocks)");
      }
      tables[s].push_back(static_cast<int32_t>(b));
    }
    for (size_t i = 0; i < seq.tokens.size(); ++i) {
      const int64_t pos = seq.start_position + static_cast<int64_t>(i);
      ids.push_back(seq.tokens[i]);
      positions.push_back(pos);
      slots.push_back(static_cast<int64_t>(seq.block_table[pos / bs]) * bs + pos % bs);
    }
    attn[s] = {tables[s], static_cast<int64_t>(seq.tokens.size()), end};
    if (seq.want_logits) logit_rows.push_back(static_cast<int64_t>(ids.size()) - 1);
  }
  const int64_t T = static_cast<int64_t>(ids.size());

  std::vector<float> residual(T * H), normed(T * H), attn_out(T * q_dim), proj(T * H);
  std::vector<float> q(T * q_dim), k(T * kv_dim), v(T * kv_dim);
  std::vector<float> gate(T * I), up(T * I), act(T * I);
  auto bias = [](const TensorView& t) -> const TensorView* {
    return t.data != nullptr ? &t : nullptr;
  };
  TESSERA_RETURN_IF_ERROR(cpu::embedding(ctx_, weights_.embed, ids, residual));
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  for (int64_t layer = 0; layer < c.num_layers; ++layer) {
    const LayerWeights& w = weights_.layers[static_cast<size_t>(layer)];
    if (layer == 0) {
      TESSERA_RETURN_IF_ERROR(cpu::rms_norm(ctx_, residual, w.input_norm, c.rms_norm_eps, normed));
    } else {
      // residual += previous MLP output; normed = input_norm(residual)
      TESSERA_RETURN_IF_ERROR(
          cpu::add_rms_norm(ctx_, proj, residual, w.input_norm, c.rms_norm_eps, normed));
    }
    TESSERA_RETURN_IF_ERROR(cpu::linear(ctx_, normed, w.q_proj, bias(w.q_bias), q));
    TESSERA_RETURN_IF_ERROR(cpu::linear(ctx_, normed, w.k_proj, bias(w.k_bias), k));
    TESSERA_RETURN_IF_ERROR(cpu::linear(ctx_, normed, w.v_proj, bias(w.v_bias), v));
    if (c.qk_norm) {
      TESSERA_RETURN_IF_ERROR(cpu::rms_norm_per_head(ctx_, q, w.q_norm, c.rms_norm_eps));
      TESSERA_RETURN_IF_ERROR(cpu::rms_norm_per_head(ctx_, k, w.k_norm, c.rms_norm_eps));
    }
    TESSERA_RETURN_IF_ERROR(cpu::apply_rope(ctx_, *rope_, positions, q, k));
    TESSERA_RETURN_IF_ERROR(cache_->write(layer, k, v, slots));
    TESSERA_RETURN_IF_ERROR(cpu::paged_attention(ctx_, *cache_, layer, q, attn, scale, attn_out));
    TESSERA_RETURN_IF_ERROR(cpu::linear(ctx_, attn_out, w.o_proj, bias(w.o_bias), proj));
    // residual += attention output; normed = post_attention_norm(residual)
    TESSERA_RETURN_IF_ERROR(
        cpu::add_rms_norm(ctx_, proj, residual, w.post_norm, c.rms_norm_eps, normed));
    TESSERA_RETURN_IF_ERROR(cpu::linear(ctx_, normed, w.gate_proj, nullptr, gate));
    TESSERA_RETURN_IF_ERROR(cpu::linear(ctx_, normed, w.up_proj, nullptr, up));
    TESSERA_RETURN_IF_ERROR(cpu::silu_mul(ctx_, gate, up, act));
    TESSERA_RETURN_IF_ERROR(cpu::linear(ctx_, act, w.down_proj, nullptr, proj));
  }
  TESSERA_RETURN_IF_ERROR(
      cpu::add_rms_norm(ctx_, proj, residual, weights_.final_norm, c.rms_norm_eps, normed));
  // Only the rows whose next token is sampled go through lm_head.
  const int64_t R = static_cast<int64_t>(logit_rows.size());
  std::vector<float> rows(R * H);
  for (int64_t r = 0; r < R; ++r) {
    std::copy_n(normed.begin() + logit_rows[r] * H, H, rows.begin() + r * H);
  }
  std::vector<float> logits(R * c.vocab_size);
  if (R > 0) TESSERA_RETURN_IF_ERROR(cpu::linear(ctx_, rows, weights_.lm_head, nullptr, logits));
  return logits;
}

}  // namespace tessera
