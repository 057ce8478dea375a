#include "actors/model/cpu_model.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "actors/model/layer_loop.h"
#include "actors/model/moe_dispatch.h"
#include "actors/model/rope_spec.h"
#include "kernels/cpu/activation.h"
#include "kernels/cpu/embedding.h"
#include "kernels/cpu/linear.h"
#include "kernels/cpu/paged_attention.h"
#include "kernels/cpu/rms_norm.h"

namespace tessera {

CpuModel::CpuModel(const ModelConfig& config, LayerPlan plan, ModelWeights weights,
                   StageComms comms, const EngineSpec& engine, int threads)
    : config_(config),
      plan_(std::move(plan)),
      weights_(std::move(weights)),
      comms_(comms),
      ctx_(threads),
      engine_(engine) {}

Expected<std::unique_ptr<CpuModel>> CpuModel::create(const ModelConfig& config, LayerPlan plan,
                                                     ModelWeights weights, StageComms comms,
                                                     int64_t kv_blocks, const EngineSpec& engine,
                                                     int threads) {
  std::unique_ptr<CpuModel> m(
      new CpuModel(config, std::move(plan), std::move(weights), comms, engine, threads));
  m->fit_blocks_ = kv_blocks;
  TESSERA_ASSIGN_OR_RETURN(auto rope,
                           cpu::RopeTable::create(rope_spec(config, false), engine.max_model_len));
  m->rope_ = std::make_unique<cpu::RopeTable>(std::move(rope));
  if (config.rope_local_theta > 0) {
    TESSERA_ASSIGN_OR_RETURN(auto local,
                             cpu::RopeTable::create(rope_spec(config, true), engine.max_model_len));
    m->rope_local_ = std::make_unique<cpu::RopeTable>(std::move(local));
  }
  fold_norm_unit_offset(config, &m->weights_);
  TESSERA_ASSIGN_OR_RETURN(m->quant_, resolve_quantization(engine.quantization, config.quant));
  if (config.moe.enabled() && m->quant_.method != QuantMethod::kNone) {
    return invalid_argument("--quantization " + m->quant_.describe() +
                            ": mixture-of-experts models run unquantized for now");
  }
  TESSERA_RETURN_IF_ERROR(m->dequantize_linears());
  m->bind_moe();
  return m;
}

void CpuModel::bind_moe() {
  moe_.resize(weights_.layers.size());
  for (size_t i = 0; i < weights_.layers.size(); ++i) {
    const LayerWeights& l = weights_.layers[i];
    if (!l.moe()) continue;
    cpu::MoeLayer& m = moe_[i];
    m.router = l.router;
    for (const LayerWeights::Expert& e : l.experts) m.experts.push_back({e.gate, e.up, e.down});
    m.expert_begin = plan_.expert_begin;
    m.top_k = config_.moe.top_k;
    m.renormalize = config_.moe.norm_topk_prob;
    m.shared = {l.shared.gate, l.shared.up, l.shared.down};
    m.shared_gate = l.shared_expert_gate;
  }
  // The routings are counted once: by every rank under expert parallelism (each routes its share
  // of the tokens), by tp rank 0 otherwise (every rank routes every token alike).
  if (plan_.parallel.expert_parallel || plan_.parallel.tp_rank == 0) {
    for (size_t i = 0; i < moe_.size(); ++i) {
      if (moe_[i].router.data == nullptr) continue;
      load_.num_experts = config_.moe.num_experts;
      load_.layers.push_back(plan_.layer_begin + static_cast<int64_t>(i));
    }
    load_.tokens.assign(load_.layers.size() * static_cast<size_t>(load_.num_experts), 0);
  }
}

ExpertLoad CpuModel::expert_load() const {
  std::lock_guard<std::mutex> lock(load_mu_);
  return load_;
}

void CpuModel::count_routings(int64_t layer, const std::vector<int64_t>& routed) {
  if (load_.empty() || routed.empty()) return;
  std::lock_guard<std::mutex> lock(load_mu_);
  const auto at =
      std::lower_bound(load_.layers.begin(), load_.layers.end(), plan_.layer_begin + layer);
  if (at == load_.layers.end()) return;
  const size_t row = static_cast<size_t>(at - load_.layers.begin());
  const size_t E = static_cast<size_t>(load_.num_experts);
  for (size_t e = 0; e < E && e < routed.size(); ++e) {
    load_.tokens[row * E + e] += static_cast<uint64_t>(routed[e]);
  }
}

Status CpuModel::dequantize_linears() {
  if (quant_.method == QuantMethod::kNone) return Status::ok();
  for (size_t i = 0; i < weights_.layers.size(); ++i) {
    const std::string layer = layer_tensor_name(plan_.layer_begin + static_cast<int64_t>(i), "");
    for (auto& [name, lw] : weights_.layers[i].linears()) {
      const std::string module = layer + name;
      if (quant_.online && quant_.quantizes(module)) {
        // Online FP8: the plain weight as its FP8 bytes and scale, then as the checkpoint's.
        Fp8Weight q = quantize_fp8(lw->weight);
        std::vector<uint8_t>& bytes = weights_.owned.emplace_back(std::move(q.data));
        std::vector<uint8_t>& scale = weights_.owned.emplace_back(sizeof(float));
        std::memcpy(scale.data(), &q.scale, sizeof(float));
        lw->weight = TensorView{bytes.data(), DType::kF8E4M3, lw->weight.shape};
        lw->weight_scale = TensorView{scale.data(), DType::kF32, {1}};
        lw->method = QuantMethod::kFp8;
      }
      if (lw->method == QuantMethod::kNone) continue;
      const int64_t out = lw->out_features(quant_), in = lw->in_features(quant_);
      TESSERA_ASSIGN_OR_RETURN(std::vector<float> w, dequantize(*lw, quant_, module));
      std::vector<uint8_t>& storage = weights_.owned.emplace_back(w.size() * sizeof(float));
      std::memcpy(storage.data(), w.data(), storage.size());
      lw->weight = TensorView{storage.data(), DType::kF32, {out, in}};
    }
  }
  spdlog::info("cpu backend: {} linear layers dequantized to F32 (the reference of the kernels)",
               quant_.describe());
  return Status::ok();
}

Status CpuModel::init_cache(int64_t blocks) {
  if (blocks < 1 || blocks > fit_blocks_) {
    return invalid_argument("init_cache: " + std::to_string(blocks) + " KV blocks asked, " +
                            std::to_string(fit_blocks_) + " fit");
  }
  cpu::KvCacheShape shape;
  shape.num_layers = plan_.num_layers();
  shape.num_blocks = blocks;
  shape.block_size = engine_.block_size;
  shape.num_kv_heads = plan_.kv_heads;
  shape.head_dim = config_.head_dim;
  shape.dtype = engine_.kv_cache_dtype;
  TESSERA_ASSIGN_OR_RETURN(auto cache, cpu::PagedKvCache::create(shape));
  cache_ = std::make_unique<cpu::PagedKvCache>(std::move(cache));
  return Status::ok();
}

ModelInfo CpuModel::info() const {
  ModelInfo i;
  i.architecture = architecture_name(config_.arch);
  i.vocab_size = config_.vocab_size;
  i.num_layers = config_.num_layers;
  i.layer_begin = plan_.layer_begin;
  i.layer_end = plan_.layer_end;
  i.kv_blocks = cache_ ? cache_->shape().num_blocks : fit_blocks_;
  i.block_size = engine_.block_size;
  i.max_model_len = engine_.max_model_len;
  i.weight_bytes = weights_.bytes;
  i.kv_cache_bytes =
      cache_ ? static_cast<uint64_t>(cache_->shape().num_slots() * cache_->shape().token_elems() *
                                     2 * plan_.num_layers() * sizeof(float))
             : 0;
  i.backend = "cpu";
  i.dtype = dtype_name(DType::kF32);
  i.kv_cache_dtype = kv_cache_storage_name(engine_.kv_cache_dtype, DType::kF32);
  i.quantization = quant_.describe();
  return i;
}

// One forward pass: the step's flattened tokens and attention metadata, the activation buffers,
// and the operations layer_loop.h calls.
class CpuModel::Step {
 public:
  Step(CpuModel& m, std::span<const ForwardSeq> batch) : m_(m), batch_(batch) {}

  // The batch is a StepBatch's (requests.h): its positions, block tables and tokens were
  // checked when the request table made it.
  Status prepare() {
    const int64_t bs = m_.engine_.block_size;
    tables_.resize(batch_.size());
    attn_.resize(batch_.size());
    for (size_t s = 0; s < batch_.size(); ++s) {
      const ForwardSeq& seq = batch_[s];
      const int64_t end = seq.start_position + static_cast<int64_t>(seq.tokens.size());
      tables_[s].assign(seq.block_table.begin(), seq.block_table.end());
      for (size_t i = 0; i < seq.tokens.size(); ++i) {
        const int64_t pos = seq.start_position + static_cast<int64_t>(i);
        ids_.push_back(seq.tokens[i]);
        positions_.push_back(pos);
        slots_.push_back(static_cast<int64_t>(seq.block_table[pos / bs]) * bs + pos % bs);
      }
      attn_[s] = {tables_[s], static_cast<int64_t>(seq.tokens.size()), end};
      if (seq.want_logits) logit_rows_.push_back(static_cast<int64_t>(ids_.size()) - 1);
    }
    const ModelConfig& c = m_.config_;
    const LayerPlan& p = m_.plan_;
    const int64_t T = static_cast<int64_t>(ids_.size());
    H_ = c.hidden_size;
    q_dim_ = p.heads * c.head_dim;
    kv_dim_ = p.kv_heads * c.head_dim;
    residual_.assign(T * H_, 0.0f);
    proj_.assign(T * H_, 0.0f);
    hidden_.assign(T * H_, 0.0f);
    q_.assign(T * q_dim_, 0.0f);
    attn_out_.assign(T * q_dim_, 0.0f);
    k_.assign(T * kv_dim_, 0.0f);
    v_.assign(T * kv_dim_, 0.0f);
    gate_.assign(T * p.intermediate, 0.0f);
    up_.assign(T * p.intermediate, 0.0f);
    act_.assign(T * p.intermediate, 0.0f);
    return Status::ok();
  }

  std::vector<float> take_logits() { return std::move(logits_); }

  // ---- the operations of layer_loop.h ----

  Status embed() {
    TESSERA_RETURN_IF_ERROR(lookup());
    // Gemma: times sqrt(hidden_size) in the model's dtype (fp32 here), as its normalizer.
    const float scale = static_cast<float>(m_.config_.embed_scale);
    if (scale != 1.0f) {
      for (float& x : residual_) x *= scale;
    }
    return Status::ok();
  }

  // embed()'s lookup: residual = this rank's embedding rows of the step's ids.
  Status lookup() {
    const LayerPlan& p = m_.plan_;
    if (p.parallel.tp_size == 1) return cpu::embedding(m_.ctx_, m_.weights_.embed, ids_, residual_);
    // Vocabulary-parallel: this rank looks up the ids in its rows; the others stay zero and the
    // tensor-parallel all-reduce completes every row.
    std::vector<int32_t> local;
    std::vector<size_t> where;
    for (size_t i = 0; i < ids_.size(); ++i) {
      const int64_t id = ids_[i] - p.vocab_begin;
      if (id >= 0 && id < p.vocab_rows) {
        local.push_back(static_cast<int32_t>(id));
        where.push_back(i);
      }
    }
    std::vector<float> rows(local.size() * H_);
    TESSERA_RETURN_IF_ERROR(cpu::embedding(m_.ctx_, m_.weights_.embed, local, rows));
    for (size_t j = 0; j < where.size(); ++j) {
      std::copy_n(rows.begin() + static_cast<int64_t>(j) * H_, H_,
                  residual_.begin() + static_cast<int64_t>(where[j]) * H_);
    }
    return Status::ok();
  }

  Status recv_hidden() {
    return m_.comms_.pp->recv(residual_.data(), static_cast<int64_t>(residual_.size() * 4),
                              m_.plan_.parallel.pp_rank - 1, nullptr);
  }
  Status send_hidden() {
    return m_.comms_.pp->send(residual_.data(), static_cast<int64_t>(residual_.size() * 4),
                              m_.plan_.parallel.pp_rank + 1, nullptr);
  }

  Status all_reduce(Activation which) {
    std::vector<float>& buf = which == Activation::kResidual ? residual_ : proj_;
    return m_.comms_.tp->all_reduce_sum(buf.data(), static_cast<int64_t>(buf.size()), DType::kF32,
                                        nullptr);
  }

  Status add_residual() {
    TESSERA_RETURN_IF_ERROR(post_ff_norm(m_.plan_.num_layers() - 1));
    for (size_t i = 0; i < residual_.size(); ++i) residual_[i] += proj_[i];
    return Status::ok();
  }

  Status input_norm(int64_t i, bool add) {
    const LayerWeights& w = layer(i);
    const double eps = m_.config_.rms_norm_eps;
    if (!add) return cpu::rms_norm(m_.ctx_, residual_, w.input_norm, eps, hidden_);
    TESSERA_RETURN_IF_ERROR(post_ff_norm(i - 1));
    return cpu::add_rms_norm(m_.ctx_, proj_, residual_, w.input_norm, eps, hidden_);
  }

  Status qkv(int64_t i) {
    const LayerWeights& w = layer(i);
    const float in = shared_input_scale({&w.q_proj, &w.k_proj, &w.v_proj});
    TESSERA_RETURN_IF_ERROR(linear(hidden_, w.q_proj, in, bias(w.q_bias), q_));
    TESSERA_RETURN_IF_ERROR(linear(hidden_, w.k_proj, in, bias(w.k_bias), k_));
    return linear(hidden_, w.v_proj, in, bias(w.v_bias), v_);
  }

  Status rope_cache(int64_t i) {
    const LayerWeights& w = layer(i);
    if (m_.config_.qk_norm) {
      const double eps = m_.config_.rms_norm_eps;
      TESSERA_RETURN_IF_ERROR(cpu::rms_norm_per_head(m_.ctx_, q_, w.q_norm, eps));
      TESSERA_RETURN_IF_ERROR(cpu::rms_norm_per_head(m_.ctx_, k_, w.k_norm, eps));
    }
    const bool local = m_.rope_local_ && m_.config_.local_rope(m_.plan_.layer_begin + i);
    TESSERA_RETURN_IF_ERROR(
        cpu::apply_rope(m_.ctx_, local ? *m_.rope_local_ : *m_.rope_, positions_, q_, k_));
    return m_.cache_->write(i, k_, v_, slots_);
  }

  Status attention(int64_t i) {
    const AttentionScoring scoring = m_.config_.attention_scoring(m_.plan_.layer_begin + i);
    return cpu::paged_attention(m_.ctx_, *m_.cache_, i, q_, attn_, scoring, attn_out_);
  }

  Status o_proj(int64_t i) {
    const LayerWeights& w = layer(i);
    return linear(attn_out_, w.o_proj, shared_input_scale({&w.o_proj}), bias(w.o_bias), proj_);
  }

  Status post_norm(int64_t i) {
    const double eps = m_.config_.rms_norm_eps;
    if (!m_.config_.sandwich_norms) {
      return cpu::add_rms_norm(m_.ctx_, proj_, residual_, layer(i).post_norm, eps, hidden_);
    }
    // Gemma: the attention output is normalised before the residual add; the MLP reads
    // pre_feedforward_layernorm.
    TESSERA_RETURN_IF_ERROR(cpu::rms_norm(m_.ctx_, proj_, layer(i).post_norm, eps, proj_));
    return cpu::add_rms_norm(m_.ctx_, proj_, residual_, layer(i).pre_ff_norm, eps, hidden_);
  }

  // Gemma: layer i's MLP output (proj, all-reduced) through post_feedforward_layernorm before
  // it joins the residual stream; nothing for other models.
  Status post_ff_norm(int64_t i) {
    if (!m_.config_.sandwich_norms) return Status::ok();
    return cpu::rms_norm(m_.ctx_, proj_, layer(i).post_ff_norm, m_.config_.rms_norm_eps, proj_);
  }

  Status mlp(int64_t i) {
    const cpu::MoeLayer& moe = m_.moe_[static_cast<size_t>(i)];
    if (moe.router.data != nullptr) {
      std::vector<int64_t> routed;
      std::vector<int64_t>* count = m_.load_.empty() ? nullptr : &routed;
      if (m_.plan_.parallel.expert_parallel && m_.comms_.tp != nullptr) {
        TESSERA_RETURN_IF_ERROR(moe_expert_parallel(m_.ctx_, moe, m_.config_.moe.num_experts,
                                                    *m_.comms_.tp, hidden_, proj_, count));
      } else {
        TESSERA_RETURN_IF_ERROR(cpu::moe(m_.ctx_, moe, hidden_, proj_, count));
      }
      m_.count_routings(i, routed);
      return Status::ok();
    }
    const LayerWeights& w = layer(i);
    const float in = shared_input_scale({&w.gate_proj, &w.up_proj});
    TESSERA_RETURN_IF_ERROR(linear(hidden_, w.gate_proj, in, nullptr, gate_));
    TESSERA_RETURN_IF_ERROR(linear(hidden_, w.up_proj, in, nullptr, up_));
    if (m_.config_.activation == MlpActivation::kGeluTanh) {
      TESSERA_RETURN_IF_ERROR(cpu::gelu_tanh_mul(m_.ctx_, gate_, up_, act_));
    } else {
      TESSERA_RETURN_IF_ERROR(cpu::silu_mul(m_.ctx_, gate_, up_, act_));
    }
    return linear(act_, w.down_proj, shared_input_scale({&w.down_proj}), nullptr, proj_);
  }

  Status logits() {
    const ModelConfig& c = m_.config_;
    const LayerPlan& p = m_.plan_;
    TESSERA_RETURN_IF_ERROR(post_ff_norm(p.num_layers() - 1));
    TESSERA_RETURN_IF_ERROR(cpu::add_rms_norm(m_.ctx_, proj_, residual_, m_.weights_.final_norm,
                                              c.rms_norm_eps, hidden_));
    // Only the rows whose next token is sampled go through lm_head.
    const int64_t R = static_cast<int64_t>(logit_rows_.size());
    std::vector<float>& rows = m_.lm_rows_;
    rows.resize(R * H_);
    for (int64_t r = 0; r < R; ++r) {
      std::copy_n(hidden_.begin() + logit_rows_[r] * H_, H_, rows.begin() + r * H_);
    }
    if (R == 0) return Status::ok();
    const int64_t Vs = p.vocab_shard;
    std::vector<float>& shard = m_.lm_shard_;
    shard.assign(R * Vs, -std::numeric_limits<float>::infinity());
    if (p.vocab_rows > 0) {
      std::vector<float>& mine = m_.lm_mine_;
      mine.resize(R * p.vocab_rows);
      TESSERA_RETURN_IF_ERROR(cpu::linear(m_.ctx_, rows, m_.weights_.lm_head, nullptr, mine));
      if (c.final_logit_softcapping > 0) {
        // Gemma's final soft-cap, as transformers: logits / cap, tanh, * cap (fp32).
        const float cap = static_cast<float>(c.final_logit_softcapping);
        for (float& x : mine) x = std::tanh(x / cap) * cap;
      }
      for (int64_t r = 0; r < R; ++r) {
        std::copy_n(mine.begin() + r * p.vocab_rows, p.vocab_rows, shard.begin() + r * Vs);
      }
    }
    const int64_t V = c.vocab_size;
    logits_.assign(R * V, 0.0f);
    if (p.parallel.tp_size == 1) {
      for (int64_t r = 0; r < R; ++r)
        std::copy_n(shard.begin() + r * Vs, V, logits_.begin() + r * V);
      return Status::ok();
    }
    // Vocabulary-parallel: gather every rank's slice [T][R][Vs] and lay the rows out whole.
    const int64_t T = p.parallel.tp_size;
    std::vector<float>& all = m_.lm_gathered_;
    all.resize(T * R * Vs);
    TESSERA_RETURN_IF_ERROR(
        m_.comms_.tp->all_gather(shard.data(), R * Vs, DType::kF32, all.data(), nullptr));
    for (int64_t t = 0; t < T; ++t) {
      const int64_t begin = t * Vs;
      const int64_t n = std::clamp<int64_t>(V - begin, 0, Vs);
      for (int64_t r = 0; r < R; ++r) {
        std::copy_n(all.begin() + (t * R + r) * Vs, n, logits_.begin() + r * V + begin);
      }
    }
    return Status::ok();
  }

 private:
  const LayerWeights& layer(int64_t i) const { return m_.weights_.layers[static_cast<size_t>(i)]; }
  static const TensorView* bias(const TensorView& t) { return t.data != nullptr ? &t : nullptr; }

  // y = x · wᵀ (+ bias) with w dequantized; an FP8 layer's (W8A8) input is rounded to FP8
  // first, per token (input_scale 0) or with the static scale its fused group shares
  // (shared_input_scale), as the GPU's FP8 GEMM reads it.
  Status linear(std::span<const float> x, const LinearWeight& w, float input_scale,
                const TensorView* b, std::span<float> y) {
    const Fp8Activations act = m_.quant_.activations;
    if (w.method != QuantMethod::kFp8 || act == Fp8Activations::kNone) {
      return cpu::linear(m_.ctx_, x, w.weight, b, y);
    }
    scratch_.assign(x.begin(), x.end());
    const int64_t cols = w.weight.shape.at(1);
    fake_quantize_fp8_activations(scratch_, static_cast<int64_t>(scratch_.size()) / cols, cols,
                                  act == Fp8Activations::kStatic ? input_scale : 0.f);
    return cpu::linear(m_.ctx_, scratch_, w.weight, b, y);
  }

  CpuModel& m_;
  std::span<const ForwardSeq> batch_;
  std::vector<int32_t> ids_;
  std::vector<int64_t> positions_, slots_, logit_rows_;
  std::vector<std::vector<int32_t>> tables_;
  std::vector<cpu::AttentionSeq> attn_;
  int64_t H_ = 0, q_dim_ = 0, kv_dim_ = 0;
  std::vector<float> residual_, proj_, hidden_, q_, k_, v_, attn_out_, gate_, up_, act_, logits_;
  std::vector<float> scratch_;  // an FP8 layer's rounded input
};

Expected<std::vector<float>> CpuModel::forward(std::span<const ForwardSeq> batch) {
  if (!cache_) return failed_precondition("the KV cache is not allocated yet (init_cache)");
  Step step(*this, batch);
  TESSERA_RETURN_IF_ERROR(step.prepare());
  TESSERA_RETURN_IF_ERROR(run_stage(step, plan_));
  if (!load_.empty()) {
    std::lock_guard<std::mutex> lock(load_mu_);
    ++load_.steps;
  }
  return step.take_logits();
}

Status CpuModel::launch(const StepBatch& batch, bool want_logits) {
  if (launched_.size() >= 2) {
    return failed_precondition("two steps are running on this rank already");
  }
  const std::span<const TokenFill> fills = batch.fills();
  std::vector<ForwardSeq> filled(batch.seqs().begin(), batch.seqs().end());
  std::vector<int32_t> tokens(fills.size());
  if (!fills.empty()) {
    // The samples of the launch before: this rank's, or with tensor parallelism rank 0's,
    // gathered (every rank of the step has the same fills, so all take part).
    size_t count = 0;
    for (const TokenFill& f : fills) count = std::max(count, f.row + 1);
    std::vector<int32_t> source(count, 0);
    const bool have = last_tokens_.size() >= count;
    if (have) std::copy_n(last_tokens_.begin(), count, source.begin());
    if (comms_.tp != nullptr) {
      std::vector<int32_t> gathered(count * static_cast<size_t>(comms_.tp->size()));
      // Bits copied as they are (a gather does no arithmetic on them).
      TESSERA_RETURN_IF_ERROR(comms_.tp->all_gather(source.data(), static_cast<int64_t>(count),
                                                    DType::kF32, gathered.data(), nullptr));
      source.assign(gathered.begin(), gathered.begin() + static_cast<ptrdiff_t>(count));
    } else if (!have) {
      return failed_precondition("a token to fill from a sample that the step before has not got");
    }
    for (size_t i = 0; i < fills.size(); ++i) {
      const TokenFill& f = fills[i];
      tokens[i] = source[f.row];
      filled[f.seq].tokens = std::span<const int32_t>(&tokens[i], 1);
    }
  }
  Launch l;
  TESSERA_ASSIGN_OR_RETURN(l.samples,
                           run_step(filled, batch.rows(), want_logits ? &l.logits : nullptr));
  last_tokens_.clear();
  for (const SampleResult& r : l.samples) last_tokens_.push_back(r.token);
  launched_.push_back(std::move(l));
  return Status::ok();
}

namespace {

// Appends a step's logits to the caller's (`to` may be null: not wanted), moving them when `to`
// is empty, as it is for every step's first: no vocabulary-sized copy.
void append_logits(std::vector<float>* to, std::vector<float>&& from) {
  if (to == nullptr) return;
  if (to->empty()) {
    *to = std::move(from);
  } else {
    to->insert(to->end(), from.begin(), from.end());
  }
}

}  // namespace

Expected<std::vector<SampleResult>> CpuModel::collect(std::vector<float>* logits) {
  if (launched_.empty()) return failed_precondition("no step is running on this rank");
  Launch l = std::move(launched_.front());
  launched_.pop_front();
  append_logits(logits, std::move(l.logits));
  return std::move(l.samples);
}

Expected<std::vector<SampleResult>> CpuModel::run_step(std::span<const ForwardSeq> batch,
                                                       std::span<const SampleRequest> rows,
                                                       std::vector<float>* logits) {
  TESSERA_ASSIGN_OR_RETURN(std::vector<float> all, forward(batch));
  std::vector<SampleResult> out;
  const bool samples = plan_.last_stage && plan_.parallel.tp_rank == 0;
  if (!samples) return out;
  const int64_t vocab = config_.vocab_size;
  for (size_t r = 0; r < rows.size(); ++r) {
    const SampleRequest& q = rows[r];
    auto it = samplers_.find(q.request_id);
    if (it == samplers_.end()) {
      SamplingParams params = q.state->sampling;
      params.seed = q.state->seed;
      cpu::Sampler sampler = cpu::Sampler::create(params);
      it = samplers_.emplace(q.request_id, std::move(sampler)).first;
    }
    // Only the penalties read the history (which holds a placeholder while a step that samples
    // its last token runs: such steps are not launched ahead with a penalty on).
    const bool history = q.state->sampling.penalised();
    TESSERA_ASSIGN_OR_RETURN(
        SampleResult result,
        it->second.sample(all.data() + r * vocab, vocab,
                          history ? q.state->prompt() : std::span<const int32_t>{},
                          history ? q.state->output() : std::span<const int32_t>{}));
    out.push_back(std::move(result));
  }
  append_logits(logits, std::move(all));
  return out;
}

}  // namespace tessera
