#include "common/checkpoint/layer_plan.h"

#include <algorithm>
#include <tuple>

#include "common/checkpoint/moe_carve.h"
#include "common/load_spec.h"

namespace tessera {

const char* fused_group(WeightKind kind) {
  switch (kind) {
    case WeightKind::kQ:
    case WeightKind::kK:
    case WeightKind::kV:
    case WeightKind::kQBias:
    case WeightKind::kKBias:
    case WeightKind::kVBias:
    case WeightKind::kQKV:
      return "qkv";
    case WeightKind::kGate:
    case WeightKind::kUp:
    case WeightKind::kGateUp:
      return "gate_up";
    default:
      return "";
  }
}

namespace {

// A tensor of a linear layer: `split` cuts dimension `dim` in units of `unit` features.
WeightSpec linear_part(std::string name, std::vector<int64_t> shape, WeightKind kind, int64_t layer,
                       Split split, WeightPart part, std::optional<DType> dtype, int dim,
                       int64_t unit) {
  WeightSpec w{std::move(name), std::move(shape), WeightRole::kLinear, kind, layer, split};
  w.part = part;
  w.dtype = dtype;
  w.dim = dim;
  w.unit = unit;
  return w;
}

// The tensors of linear layer `module` ([out_f, in_f]) as `q` stores them; `split` is the
// layer's (kRows: column-parallel, kColumns: row-parallel).
void push_linear(std::vector<WeightSpec>& out, const QuantConfig& q, const std::string& module,
                 int64_t out_f, int64_t in_f, WeightKind kind, int64_t layer, Split split) {
  const bool rows = split == Split::kRows;
  const auto part = [&](const char* suffix, std::vector<int64_t> shape, WeightPart p,
                        std::optional<DType> dtype, Split s, int dim, int64_t unit) {
    out.push_back(
        linear_part(module + suffix, std::move(shape), kind, layer, s, p, dtype, dim, unit));
  };
  const Split none = Split::kNone;
  if (!q.quantizes(module) || q.online) {
    part(".weight", {out_f, in_f}, WeightPart::kWeight, std::nullopt, split, rows ? 0 : 1, 1);
    return;
  }
  const int64_t g = q.group(in_f);
  const int64_t groups = (in_f + g - 1) / g;
  const int64_t pack = q.pack_factor();
  switch (q.method) {
    case QuantMethod::kAwq:
      part(".qweight", {in_f, out_f / 8}, WeightPart::kQWeight, DType::kI32, split, rows ? 1 : 0,
           rows ? 8 : 1);
      part(".qzeros", {groups, out_f / 8}, WeightPart::kQZeros, DType::kI32, split, rows ? 1 : 0,
           rows ? 8 : g);
      part(".scales", {groups, out_f}, WeightPart::kScales, std::nullopt, split, rows ? 1 : 0,
           rows ? 1 : g);
      return;
    case QuantMethod::kGptq: {
      // A row-parallel layer's scales and zeros split by group, unless the groups are a
      // permutation's (desc_act) or one: then every rank keeps them all (vLLM's rule).
      const bool by_group = rows || (q.group_size > 0 && !q.desc_act);
      part(".qweight", {in_f / pack, out_f}, WeightPart::kQWeight, DType::kI32, split, rows ? 1 : 0,
           rows ? 1 : pack);
      part(".qzeros", {groups, out_f / pack}, WeightPart::kQZeros, DType::kI32,
           by_group ? split : none, rows ? 1 : 0, rows ? pack : g);
      part(".scales", {groups, out_f}, WeightPart::kScales, std::nullopt, by_group ? split : none,
           rows ? 1 : 0, rows ? 1 : g);
      part(".g_idx", {in_f}, WeightPart::kGIdx, DType::kI32, rows ? none : split, 0, 1);
      return;
    }
    case QuantMethod::kFp8: {
      part(".weight", {out_f, in_f}, WeightPart::kWeight, DType::kF8E4M3, split, rows ? 0 : 1, 1);
      const bool channel = q.weight_scale == Fp8Scale::kChannel;
      out.push_back(linear_part(module + ".weight_scale",
                                channel ? std::vector<int64_t>{out_f, 1} : std::vector<int64_t>{1},
                                kind, layer, channel && rows ? split : none,
                                WeightPart::kWeightScale, std::nullopt, 0, 1));
      out.back().any_scale_shape = true;
      if (q.activations == Fp8Activations::kStatic) {
        out.push_back(linear_part(module + ".input_scale", {1}, kind, layer, none,
                                  WeightPart::kInputScale, std::nullopt, 0, 1));
        out.back().any_scale_shape = true;
      }
      return;
    }
    default:
      part(".weight", {out_f, in_f}, WeightPart::kWeight, std::nullopt, split, rows ? 0 : 1, 1);
      return;
  }
}

// The tensors of MoE layer `layer` (prefix `p`, "model.layers.N."), as transformers names them.
void push_moe(std::vector<WeightSpec>& out, const ModelConfig& c, const std::string& p,
              int64_t layer) {
  const int64_t h = c.hidden_size, e_inter = c.moe.expert_intermediate;
  auto linear = [&](const std::string& name, int64_t out_f, int64_t in_f, WeightKind kind,
                    Split split, int64_t expert) {
    WeightSpec w{p + name + ".weight", {out_f, in_f}, WeightRole::kLinear, kind, layer, split};
    w.dim = split == Split::kColumns ? 1 : 0;
    w.expert = expert;
    out.push_back(std::move(w));
  };
  const bool mixtral = c.arch == Architecture::kMixtral;
  const std::string block = mixtral ? "block_sparse_moe." : "mlp.";
  linear(block + "gate", c.moe.num_experts, h, WeightKind::kRouter, Split::kNone, -1);
  for (int64_t e = 0; e < c.moe.num_experts; ++e) {
    const std::string x = block + "experts." + std::to_string(e) + ".";
    linear(x + (mixtral ? "w1" : "gate_proj"), e_inter, h, WeightKind::kExpertGate, Split::kRows,
           e);
    linear(x + (mixtral ? "w2" : "down_proj"), h, e_inter, WeightKind::kExpertDown, Split::kColumns,
           e);
    linear(x + (mixtral ? "w3" : "up_proj"), e_inter, h, WeightKind::kExpertUp, Split::kRows, e);
  }
  if (c.moe.shared_intermediate > 0) {
    const int64_t s = c.moe.shared_intermediate;
    linear("mlp.shared_expert.gate_proj", s, h, WeightKind::kSharedGate, Split::kRows, -1);
    linear("mlp.shared_expert.up_proj", s, h, WeightKind::kSharedUp, Split::kRows, -1);
    linear("mlp.shared_expert.down_proj", h, s, WeightKind::kSharedDown, Split::kColumns, -1);
    linear("mlp.shared_expert_gate", 1, h, WeightKind::kSharedExpertGate, Split::kNone, -1);
  }
}

}  // namespace

std::vector<WeightSpec> expected_weights(const ModelConfig& c) {
  const int64_t h = c.hidden_size;
  const int64_t q_out = c.num_heads * c.head_dim;
  const int64_t kv_out = c.num_kv_heads * c.head_dim;
  std::vector<WeightSpec> out;
  out.reserve(4 + static_cast<size_t>(c.num_layers) * 16);
  out.push_back({"model.embed_tokens.weight",
                 {c.vocab_size, h},
                 WeightRole::kEmbedding,
                 WeightKind::kEmbed,
                 -1,
                 Split::kVocab});
  for (int64_t i = 0; i < c.num_layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    auto linear = [&](const std::string& name, int64_t out_f, int64_t in_f, WeightKind kind,
                      Split split, bool bias, WeightKind bias_kind) {
      push_linear(out, c.quant, p + name, out_f, in_f, kind, i, split);
      if (bias) {
        // A column-parallel layer's bias splits with its rows; a row-parallel one's is whole
        // (rank 0 adds it).
        out.push_back({p + name + ".bias",
                       {out_f},
                       WeightRole::kBias,
                       bias_kind,
                       i,
                       split == Split::kRows ? Split::kRows : Split::kNone});
      }
    };
    auto norm = [&](const std::string& name, int64_t n, WeightKind kind) {
      out.push_back({p + name, {n}, WeightRole::kNorm, kind, i, Split::kNone});
    };
    if (c.fused_projections) {
      linear("self_attn.qkv_proj", q_out + 2 * kv_out, h, WeightKind::kQKV, Split::kRows, false,
             WeightKind::kQKV);
    } else {
      linear("self_attn.q_proj", q_out, h, WeightKind::kQ, Split::kRows, c.attention_bias,
             WeightKind::kQBias);
      linear("self_attn.k_proj", kv_out, h, WeightKind::kK, Split::kRows, c.attention_bias,
             WeightKind::kKBias);
      linear("self_attn.v_proj", kv_out, h, WeightKind::kV, Split::kRows, c.attention_bias,
             WeightKind::kVBias);
    }
    linear("self_attn.o_proj", h, q_out, WeightKind::kO, Split::kColumns, c.o_proj_bias,
           WeightKind::kOBias);
    if (c.qk_norm) {
      norm("self_attn.q_norm.weight", c.head_dim, WeightKind::kQNorm);
      norm("self_attn.k_norm.weight", c.head_dim, WeightKind::kKNorm);
    }
    if (c.moe.sparse_layer(i)) {
      push_moe(out, c, p, i);
    } else if (c.fused_projections) {
      linear("mlp.gate_up_proj", 2 * c.intermediate_size, h, WeightKind::kGateUp, Split::kRows,
             false, WeightKind::kGateUp);
      linear("mlp.down_proj", h, c.intermediate_size, WeightKind::kDown, Split::kColumns, false,
             WeightKind::kDown);
    } else {
      linear("mlp.gate_proj", c.intermediate_size, h, WeightKind::kGate, Split::kRows, false,
             WeightKind::kGate);
      linear("mlp.up_proj", c.intermediate_size, h, WeightKind::kUp, Split::kRows, false,
             WeightKind::kUp);
      linear("mlp.down_proj", h, c.intermediate_size, WeightKind::kDown, Split::kColumns, false,
             WeightKind::kDown);
    }
    norm("input_layernorm.weight", h, WeightKind::kInputNorm);
    norm("post_attention_layernorm.weight", h, WeightKind::kPostNorm);
    if (c.sandwich_norms) {
      norm("pre_feedforward_layernorm.weight", h, WeightKind::kPreFfNorm);
      norm("post_feedforward_layernorm.weight", h, WeightKind::kPostFfNorm);
    }
  }
  out.push_back(
      {"model.norm.weight", {h}, WeightRole::kNorm, WeightKind::kFinalNorm, -1, Split::kNone});
  if (!c.tie_word_embeddings) {
    out.push_back({"lm_head.weight",
                   {c.vocab_size, h},
                   WeightRole::kLinear,
                   WeightKind::kLmHead,
                   -1,
                   Split::kVocab});
  }
  return out;
}

std::vector<int64_t> WeightShard::shape() const {
  std::vector<int64_t> s = spec.shape;
  if (spec.split != Split::kNone) s[static_cast<size_t>(spec.dim)] = (end - begin) / spec.unit;
  return s;
}

uint64_t LayerPlan::quantized_workspace_bytes(const ModelConfig& c, const QuantConfig& quant,
                                              DType dtype, int64_t max_tokens) const {
  const auto H = static_cast<uint64_t>(c.hidden_size);
  const auto qkv = static_cast<uint64_t>(qkv_rows(c));
  const auto attn = static_cast<uint64_t>(heads * c.head_dim);
  const auto I = static_cast<uint64_t>(intermediate);
  if (quant.method == QuantMethod::kNone) return 0;
  if (quant.method == QuantMethod::kFp8) {
    return static_cast<uint64_t>(max_tokens) * (std::max({H, attn, I}) + 4) + kFp8GemmDeviceBytes;
  }
  return std::max({qkv * H, 2 * I * H, attn * H}) * dtype_size(dtype);
}

uint64_t LayerPlan::moe_workspace_bytes(const ModelConfig& c, DType dtype,
                                        int64_t max_tokens) const {
  if (!c.moe.enabled()) return 0;
  return MoeCarve::make(dtype, max_tokens, c.moe.num_experts, c.moe.top_k, experts, c.hidden_size,
                        moe_intermediate, shared_intermediate)
      .bytes;
}

StepBuffers LayerPlan::step_buffers(const ModelConfig& c, DType dtype, int64_t max_tokens,
                                    int64_t max_seqs) const {
  const auto es = static_cast<uint64_t>(dtype_size(dtype));
  const auto T = static_cast<uint64_t>(max_tokens), S = static_cast<uint64_t>(max_seqs);
  const auto H = static_cast<uint64_t>(c.hidden_size);
  const auto q_dim = static_cast<uint64_t>(heads * c.head_dim);
  const auto qkv_dim = static_cast<uint64_t>(qkv_rows(c));
  const auto I = static_cast<uint64_t>(intermediate);
  const auto tp = static_cast<uint64_t>(parallel.tp_size);
  StepBuffers b;
  b.residual = b.hidden = b.proj = T * H * es;
  b.qkv = T * qkv_dim * es;
  b.q = b.attn = T * q_dim * es;
  b.gate_up = T * 2 * I * es;
  b.act = T * I * es;
  if (last_stage) {
    b.logit_rows = S * H * es;
    b.logits = S * static_cast<uint64_t>(c.vocab_size) * sizeof(float);
    if (tp > 1) b.shard_logits = tp * S * static_cast<uint64_t>(vocab_shard) * sizeof(float);
  }
  if (tp > 1) b.sampled_tokens = (1 + tp) * S * sizeof(int32_t);
  return b;
}

uint64_t LayerPlan::activation_bytes(const ModelConfig& c, const QuantConfig& quant, DType dtype,
                                     int64_t max_tokens, int64_t max_seqs) const {
  return step_buffers(c, dtype, max_tokens, max_seqs).total() +
         quantized_workspace_bytes(c, quant, dtype, max_tokens) +
         moe_workspace_bytes(c, dtype, max_tokens) + kActivationSlackBytes;
}

uint64_t LayerPlan::weight_bytes(DType dtype, const QuantConfig& run) const {
  uint64_t total = 0;
  for (const WeightShard& w : weights) {
    int64_t n = 1;
    for (int64_t d : w.shape()) n *= d;
    size_t es = w.spec.dtype ? dtype_size(*w.spec.dtype) : dtype_size(dtype);
    if (run.online && w.spec.layer >= 0 && w.spec.role == WeightRole::kLinear &&
        run.quantizes(w.spec.name.substr(0, w.spec.name.rfind('.')))) {
      es = 1;  // FP8 at load (and one F32 scale)
      total += 4;
    }
    total += static_cast<uint64_t>(n) * es;
  }
  return total;
}

Expected<std::vector<std::pair<int64_t, int64_t>>> stage_layers(
    int64_t num_layers, int pp_size, const std::vector<int64_t>& partition) {
  std::vector<std::pair<int64_t, int64_t>> out;
  if (pp_size < 1) {
    return invalid_argument("--pipeline-parallel-size must be at least 1, got " +
                            std::to_string(pp_size));
  }
  if (pp_size > num_layers) {
    return invalid_argument("--pipeline-parallel-size " + std::to_string(pp_size) +
                            " is more than the model's " + std::to_string(num_layers) +
                            " layers: every stage needs at least one");
  }
  if (!partition.empty()) {
    if (static_cast<int>(partition.size()) != pp_size) {
      return invalid_argument("--pipeline-layer-partition has " + std::to_string(partition.size()) +
                              " stages, but "
                              "--pipeline-parallel-size is " +
                              std::to_string(pp_size));
    }
    int64_t at = 0;
    for (int64_t n : partition) {
      if (n < 1) {
        return invalid_argument(
            "--pipeline-layer-partition: every stage needs at least one "
            "layer, got " +
            std::to_string(n));
      }
      out.emplace_back(at, at + n);
      at += n;
    }
    if (at != num_layers) {
      return invalid_argument("--pipeline-layer-partition adds up to " + std::to_string(at) +
                              " layers, the model has " + std::to_string(num_layers));
    }
    return out;
  }
  const int64_t base = num_layers / pp_size;
  const int64_t extra = num_layers % pp_size;
  int64_t at = 0;
  for (int s = 0; s < pp_size; ++s) {
    const int64_t n = base + (s < extra ? 1 : 0);
    out.emplace_back(at, at + n);
    at += n;
  }
  return out;
}

namespace {

// A quantized checkpoint's packed tensors split only at whole int32s and, along a row-parallel
// layer's inputs, at whole scale groups.
std::string quantized_tp_problem(const ModelConfig& c, int64_t tp) {
  const QuantConfig& q = c.quant;
  if (q.method != QuantMethod::kAwq && q.method != QuantMethod::kGptq) return "";
  if (tp == 1) return "";
  const int64_t kv_rows = (c.num_kv_heads % tp == 0 ? c.num_kv_heads / tp : 1) * c.head_dim;
  const int64_t pack = q.method == QuantMethod::kAwq ? 8 : q.pack_factor();
  const std::pair<const char*, int64_t> outputs[] = {
      {"q_proj", c.num_heads * c.head_dim / tp},
      {"k_proj / v_proj", kv_rows},
      {"gate_proj / up_proj", c.intermediate_size / tp}};
  for (const auto& [name, n] : outputs) {
    if (n % pack != 0) {
      return "-tp " + std::to_string(tp) + " splits " + q.describe() + " packed weights: " + name +
             " would hold " + std::to_string(n) + " output features per rank, not a " +
             "multiple of the " + std::to_string(pack) + " packed in each int32";
    }
  }
  const std::pair<const char*, int64_t> inputs[] = {{"o_proj", c.num_heads * c.head_dim / tp},
                                                    {"down_proj", c.intermediate_size / tp}};
  const bool by_group = q.group_size > 0 && (q.method == QuantMethod::kAwq || !q.desc_act);
  const int64_t unit = q.method == QuantMethod::kGptq ? q.pack_factor() : 1;
  for (const auto& [name, n] : inputs) {
    if (by_group && n % q.group_size != 0) {
      return "-tp " + std::to_string(tp) + " splits a quantization group: " + name +
             " would hold " + std::to_string(n) + " input features per rank, not a multiple " +
             "of the group size " + std::to_string(q.group_size);
    }
    if (n % unit != 0) {
      return "-tp " + std::to_string(tp) + " splits " + q.describe() + " packed weights: " + name +
             " would hold " + std::to_string(n) + " input features per rank, not a " +
             "multiple of the " + std::to_string(unit) + " packed in each int32";
    }
  }
  return "";
}

std::string tp_problem(const ModelConfig& c, int64_t tp, bool expert_parallel) {
  if (tp < 1) return "-tp must be at least 1, got " + std::to_string(tp);
  if (c.num_heads % tp != 0) {
    return "-tp " + std::to_string(tp) + ": the model's " + std::to_string(c.num_heads) +
           " attention heads do not split over " + std::to_string(tp) + " ranks (" +
           std::to_string(c.num_heads) + " % " + std::to_string(tp) + " = " +
           std::to_string(c.num_heads % tp) + ")";
  }
  const int64_t kv = c.num_kv_heads;
  if (kv % tp != 0 && !(tp > kv && tp % kv == 0)) {
    return "-tp " + std::to_string(tp) + ": the model's " + std::to_string(kv) +
           " KV heads neither split over " + std::to_string(tp) + " ranks (" + std::to_string(kv) +
           " % " + std::to_string(tp) + " = " + std::to_string(kv % tp) +
           ") nor replicate evenly (" + std::to_string(tp) + " is not a multiple of " +
           std::to_string(kv) + ")";
  }
  auto width_problem = [tp](const char* field, int64_t n) -> std::string {
    if (n % tp == 0) return "";
    return "-tp " + std::to_string(tp) + ": " + field + " " + std::to_string(n) +
           " does not split over " + std::to_string(tp) + " ranks (" + std::to_string(n) + " % " +
           std::to_string(tp) + " = " + std::to_string(n % tp) + ")";
  };
  bool dense = !c.moe.enabled();
  for (int64_t i = 0; i < c.num_layers && !dense; ++i) dense = !c.moe.sparse_layer(i);
  std::string problem = dense ? width_problem("intermediate_size", c.intermediate_size) : "";
  if (problem.empty() && expert_parallel) {
    if (!c.moe.enabled()) {
      return std::string("--enable-expert-parallel: ") + architecture_name(c.arch) +
             " has no experts (it is not a mixture-of-experts model)";
    }
    if (c.moe.num_experts < tp) {
      return "--enable-expert-parallel with -tp " + std::to_string(tp) + ": the model's " +
             std::to_string(c.moe.num_experts) + " experts leave a rank without one (use -tp " +
             std::to_string(c.moe.num_experts) + " or less, or split each expert without it)";
    }
  } else if (problem.empty() && c.moe.enabled()) {
    // Whole experts under expert parallelism; each expert's slice otherwise.
    problem = width_problem(
        c.arch == Architecture::kMixtral ? "intermediate_size" : "moe_intermediate_size",
        c.moe.expert_intermediate);
  }
  // The shared expert is split over the ranks either way.
  if (problem.empty() && c.moe.shared_intermediate > 0) {
    problem = width_problem("shared_expert_intermediate_size", c.moe.shared_intermediate);
  }
  if (!problem.empty()) return problem;
  return quantized_tp_problem(c, tp);
}

}  // namespace

std::vector<int64_t> valid_tensor_parallel_sizes(const ModelConfig& config, int64_t max,
                                                 bool expert_parallel) {
  std::vector<int64_t> out;
  for (int64_t t = 1; t <= max; ++t) {
    if (tp_problem(config, t, expert_parallel).empty()) out.push_back(t);
  }
  return out;
}

Status check_tensor_parallel(const ModelConfig& config, int64_t tp, bool expert_parallel) {
  std::string problem = tp_problem(config, tp, expert_parallel);
  if (problem.empty()) return Status::ok();
  if (expert_parallel && !config.moe.enabled()) return invalid_argument(problem);
  std::string valid;
  for (int64_t t : valid_tensor_parallel_sizes(config, config.num_heads, expert_parallel)) {
    valid += (valid.empty() ? "" : ", ") + std::to_string(t);
  }
  return invalid_argument(problem + "; valid -tp values for this model: " + valid);
}

namespace {

// A fused tensor's parts on this rank (Phi-3): each part (q, k, v; gate, up) sliced as its own
// column-parallel layer would be, at the part's offset in the fused rows.
void push_fused_parts(LayerPlan& plan, const ModelConfig& c, const WeightSpec& w) {
  auto part = [&](WeightKind kind, int64_t offset, int64_t begin, int64_t end) {
    WeightShard s{w, offset + begin, offset + end};
    s.spec.kind = kind;
    plan.weights.push_back(std::move(s));
  };
  const int64_t hd = c.head_dim;
  if (w.kind == WeightKind::kQKV) {
    const int64_t q_out = c.num_heads * hd, kv_out = c.num_kv_heads * hd;
    const int64_t kv_begin = plan.kv_head_begin * hd, kv_end = kv_begin + plan.kv_heads * hd;
    part(WeightKind::kQ, 0, plan.head_begin * hd, (plan.head_begin + plan.heads) * hd);
    part(WeightKind::kK, q_out, kv_begin, kv_end);
    part(WeightKind::kV, q_out + kv_out, kv_begin, kv_end);
    return;
  }
  const int64_t begin = plan.intermediate_begin, end = begin + plan.intermediate;
  part(WeightKind::kGate, 0, begin, end);
  part(WeightKind::kUp, c.intermediate_size, begin, end);
}

}  // namespace

std::pair<int64_t, int64_t> expert_range(int64_t num_experts, int64_t tp, int64_t tp_rank) {
  const int64_t base = num_experts / tp, extra = num_experts % tp;
  return {tp_rank * base + std::min(tp_rank, extra), base + (tp_rank < extra ? 1 : 0)};
}

Expected<LayerPlan> LayerPlan::make(const ModelConfig& c, const ParallelConfig& p) {
  const int64_t T = p.tp_size;
  TESSERA_RETURN_IF_ERROR(check_tensor_parallel(c, T, p.expert_parallel));
  if (p.tp_rank < 0 || p.tp_rank >= T || p.pp_rank < 0 || p.pp_rank >= p.pp_size) {
    return invalid_argument("rank (tp " + std::to_string(p.tp_rank) + ", pp " +
                            std::to_string(p.pp_rank) + ") is outside " + std::to_string(T) +
                            " x " + std::to_string(p.pp_size));
  }
  TESSERA_ASSIGN_OR_RETURN(auto stages, stage_layers(c.num_layers, p.pp_size, p.layer_partition));
  LayerPlan plan;
  plan.parallel = p;
  plan.layer_begin = stages[static_cast<size_t>(p.pp_rank)].first;
  plan.layer_end = stages[static_cast<size_t>(p.pp_rank)].second;
  plan.first_stage = p.pp_rank == 0;
  plan.last_stage = p.pp_rank == p.pp_size - 1;
  plan.heads = c.num_heads / T;
  plan.head_begin = p.tp_rank * plan.heads;
  if (c.num_kv_heads % T == 0) {
    plan.kv_heads = c.num_kv_heads / T;
    plan.kv_head_begin = p.tp_rank * plan.kv_heads;
  } else {
    // Replicated: this rank's query heads all read one KV head.
    plan.kv_heads = 1;
    plan.kv_head_begin = plan.head_begin / (c.num_heads / c.num_kv_heads);
  }
  plan.intermediate = c.intermediate_size / T;
  plan.intermediate_begin = p.tp_rank * plan.intermediate;
  if (p.expert_parallel) {
    plan.moe_intermediate = c.moe.expert_intermediate;
    std::tie(plan.expert_begin, plan.experts) = expert_range(c.moe.num_experts, T, p.tp_rank);
  } else {
    plan.moe_intermediate = c.moe.expert_intermediate / T;
    plan.moe_intermediate_begin = p.tp_rank * plan.moe_intermediate;
    plan.experts = c.moe.num_experts;
  }
  plan.shared_intermediate = c.moe.shared_intermediate / T;
  plan.shared_intermediate_begin = p.tp_rank * plan.shared_intermediate;
  plan.vocab_padded = (c.vocab_size + T - 1) / T * T;
  plan.vocab_shard = plan.vocab_padded / T;
  plan.vocab_begin = p.tp_rank * plan.vocab_shard;
  plan.vocab_rows = std::clamp<int64_t>(c.vocab_size - plan.vocab_begin, 0, plan.vocab_shard);
  plan.o_bias = c.o_proj_bias && p.tp_rank == 0;

  const int64_t hd = c.head_dim;
  for (const WeightSpec& w : expected_weights(c)) {
    const bool layer_here = w.layer >= plan.layer_begin && w.layer < plan.layer_end;
    bool here = false;
    switch (w.kind) {
      case WeightKind::kEmbed:
        // A tied lm_head reads the embedding too: the last stage needs it then.
        here = plan.first_stage || (plan.last_stage && c.tie_word_embeddings);
        break;
      case WeightKind::kFinalNorm:
      case WeightKind::kLmHead:
        here = plan.last_stage;
        break;
      case WeightKind::kOBias:
        here = layer_here && plan.o_bias;
        break;
      case WeightKind::kExpertGate:
      case WeightKind::kExpertUp:
      case WeightKind::kExpertDown:
        here = layer_here && w.expert >= plan.expert_begin &&
               w.expert < plan.expert_begin + plan.experts;
        break;
      default:
        here = layer_here;
        break;
    }
    if (!here) continue;
    if (w.kind == WeightKind::kQKV || w.kind == WeightKind::kGateUp) {
      push_fused_parts(plan, c, w);
      continue;
    }
    WeightShard s{w, 0, 0};
    switch (w.kind) {
      case WeightKind::kQ:
      case WeightKind::kQBias:
        s.begin = plan.head_begin * hd;
        s.end = (plan.head_begin + plan.heads) * hd;
        break;
      case WeightKind::kK:
      case WeightKind::kV:
      case WeightKind::kKBias:
      case WeightKind::kVBias:
        s.begin = plan.kv_head_begin * hd;
        s.end = (plan.kv_head_begin + plan.kv_heads) * hd;
        break;
      case WeightKind::kO:
        s.begin = plan.head_begin * hd;
        s.end = (plan.head_begin + plan.heads) * hd;
        break;
      case WeightKind::kGate:
      case WeightKind::kUp:
      case WeightKind::kDown:
        s.begin = plan.intermediate_begin;
        s.end = plan.intermediate_begin + plan.intermediate;
        break;
      case WeightKind::kExpertGate:
      case WeightKind::kExpertUp:
      case WeightKind::kExpertDown:
        s.begin = plan.moe_intermediate_begin;
        s.end = plan.moe_intermediate_begin + plan.moe_intermediate;
        break;
      case WeightKind::kSharedGate:
      case WeightKind::kSharedUp:
      case WeightKind::kSharedDown:
        s.begin = plan.shared_intermediate_begin;
        s.end = plan.shared_intermediate_begin + plan.shared_intermediate;
        break;
      case WeightKind::kEmbed:
      case WeightKind::kLmHead:
        s.begin = std::min(plan.vocab_begin, c.vocab_size);
        s.end = s.begin + plan.vocab_rows;
        break;
      default:
        s.end = w.shape.empty() ? 0 : w.shape[0];
        break;
    }
    plan.weights.push_back(std::move(s));
  }
  return plan;
}

Expected<DType> resolve_dtype(const std::string& name, DType checkpoint_dtype, bool gpu) {
  if (name == "auto" || name.empty()) {
    if (gpu && checkpoint_dtype == DType::kF32) return DType::kBF16;
    return checkpoint_dtype;
  }
  if (name == "bfloat16") return DType::kBF16;
  if (name == "float16" || name == "half") return DType::kF16;
  if (name == "float32" || name == "float") {
    if (gpu) {
      return invalid_argument(
          "--dtype float32 is supported on the cpu backend only: use --dtype bfloat16 or "
          "float16 on the GPU, or --device cpu");
    }
    return DType::kF32;
  }
  return invalid_argument("--dtype '" + name +
                          "' is not one of auto, bfloat16, float16 (half), float32 (float)");
}

}  // namespace tessera
