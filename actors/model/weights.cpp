#include "actors/model/weights.h"

#include <cstring>
#include <set>

namespace tessera {

std::string layer_tensor_name(int64_t layer, const std::string& suffix) {
  return "model.layers." + std::to_string(layer) + "." + suffix;
}

namespace {

// `shard` of `full` as a view: a range of dimension 0 is a view into the checkpoint, a range of
// dimension 1 is copied into `owned`.
TensorView slice(const TensorView& full, const WeightShard& shard,
                 std::deque<std::vector<uint8_t>>& owned) {
  TensorView v = full;
  if (shard.spec.split == Split::kNone) return v;
  const size_t es = dtype_size(full.dtype);
  const int64_t begin = shard.begin / shard.spec.unit;
  const int64_t n = (shard.end - shard.begin) / shard.spec.unit;
  if (shard.spec.dim == 0) {
    int64_t row_elems = 1;
    for (size_t d = 1; d < full.shape.size(); ++d) row_elems *= full.shape[d];
    v.data = static_cast<const char*>(full.data) + begin * row_elems * es;
    v.shape[0] = n;
    return v;
  }
  const int64_t rows = full.shape[0], cols = full.shape[1];
  if (n == cols) return v;  // tp_size 1: the whole tensor, no copy
  std::vector<uint8_t>& buf = owned.emplace_back(static_cast<size_t>(rows * n) * es);
  const char* src = static_cast<const char*>(full.data);
  for (int64_t r = 0; r < rows; ++r) {
    std::memcpy(buf.data() + static_cast<size_t>(r * n) * es,
                src + static_cast<size_t>(r * cols + begin) * es, static_cast<size_t>(n) * es);
  }
  v.data = buf.data();
  v.shape[1] = n;
  return v;
}

// A row-parallel GPTQ layer's g_idx shard, numbered in its rank's scale groups: the scales
// were split by group, so group g of the model is group g - first of the shard.
TensorView local_groups(const TensorView& g_idx, const WeightShard& shard, int64_t group,
                        std::deque<std::vector<uint8_t>>& owned) {
  const int64_t first = shard.begin / group;
  if (first == 0) return g_idx;
  std::vector<uint8_t>& buf = owned.emplace_back(g_idx.bytes());
  const auto* src = static_cast<const int32_t*>(g_idx.data);
  auto* dst = reinterpret_cast<int32_t*>(buf.data());
  for (int64_t i = 0; i < g_idx.numel(); ++i) dst[i] = src[i] - static_cast<int32_t>(first);
  TensorView v = g_idx;
  v.data = buf.data();
  return v;
}

// The checkpoint tensor `w` as the table says: shape (FP8 scales: element count) and dtype.
Status check_tensor(const Checkpoint& ckpt, const WeightSpec& w) {
  if (!w.any_scale_shape) {
    TESSERA_ASSIGN_OR_RETURN(TensorView t, ckpt.require(w.name, w.shape));
    const bool is_float =
        t.dtype == DType::kF32 || t.dtype == DType::kF16 || t.dtype == DType::kBF16;
    if (w.dtype ? t.dtype == *w.dtype : is_float) return Status::ok();
    const SafetensorsFile* file = ckpt.file_of(w.name);
    return invalid_argument(w.name + (file ? " in " + file->path() : std::string()) + " is " +
                            t.describe() + ", expected " +
                            (w.dtype ? dtype_name(*w.dtype) : "a float dtype (F32, F16, BF16)") +
                            " as its format stores it");
  }
  TESSERA_ASSIGN_OR_RETURN(TensorView t, ckpt.tensor(w.name));
  int64_t want = 1;
  for (int64_t d : w.shape) want *= d;
  if (t.numel() != want || t.shape.size() > 2 ||
      (t.dtype != DType::kF32 && t.dtype != DType::kF16 && t.dtype != DType::kBF16)) {
    const SafetensorsFile* file = ckpt.file_of(w.name);
    return invalid_argument(w.name + (file ? " in " + file->path() : std::string()) + " is " +
                            t.describe() + ", expected " + std::to_string(want) +
                            " float scale(s)" + (want > 1 ? " (one per output feature)" : ""));
  }
  return Status::ok();
}

LinearWeight* linear_of(LayerWeights& l, WeightKind kind) {
  switch (kind) {
    case WeightKind::kQ:
      return &l.q_proj;
    case WeightKind::kK:
      return &l.k_proj;
    case WeightKind::kV:
      return &l.v_proj;
    case WeightKind::kO:
      return &l.o_proj;
    case WeightKind::kGate:
      return &l.gate_proj;
    case WeightKind::kUp:
      return &l.up_proj;
    case WeightKind::kDown:
      return &l.down_proj;
    default:
      return nullptr;
  }
}

// Where an MoE tensor binds (null for the other kinds); sizes the layer's experts (the plan's:
// expert_begin onwards, `experts` of them) on first use.
TensorView* moe_tensor(LayerWeights& l, const WeightSpec& w, const LayerPlan& plan) {
  auto expert = [&]() -> LayerWeights::Expert& {
    if (l.experts.empty()) l.experts.resize(static_cast<size_t>(plan.experts));
    return l.experts[static_cast<size_t>(w.expert - plan.expert_begin)];
  };
  switch (w.kind) {
    case WeightKind::kRouter:
      return &l.router;
    case WeightKind::kExpertGate:
      return &expert().gate;
    case WeightKind::kExpertUp:
      return &expert().up;
    case WeightKind::kExpertDown:
      return &expert().down;
    case WeightKind::kSharedGate:
      return &l.shared.gate;
    case WeightKind::kSharedUp:
      return &l.shared.up;
    case WeightKind::kSharedDown:
      return &l.shared.down;
    case WeightKind::kSharedExpertGate:
      return &l.shared_expert_gate;
    default:
      return nullptr;
  }
}

TensorView& part_of(LinearWeight& w, WeightPart part) {
  switch (part) {
    case WeightPart::kQWeight:
      return w.qweight;
    case WeightPart::kQZeros:
      return w.qzeros;
    case WeightPart::kScales:
      return w.scales;
    case WeightPart::kGIdx:
      return w.g_idx;
    case WeightPart::kWeightScale:
      return w.weight_scale;
    case WeightPart::kInputScale:
      return w.input_scale;
    case WeightPart::kWeight:
      break;
  }
  return w.weight;
}

}  // namespace

std::vector<std::pair<const char*, LinearWeight*>> LayerWeights::linears() {
  return {{"self_attn.q_proj", &q_proj}, {"self_attn.k_proj", &k_proj},
          {"self_attn.v_proj", &v_proj}, {"self_attn.o_proj", &o_proj},
          {"mlp.gate_proj", &gate_proj}, {"mlp.up_proj", &up_proj},
          {"mlp.down_proj", &down_proj}};
}

void fold_norm_unit_offset(const ModelConfig& config, ModelWeights* w) {
  if (!config.norm_unit_offset) return;
  auto fold = [w](TensorView& norm) {
    if (norm.data == nullptr) return;
    std::vector<uint8_t>& buf = w->owned.emplace_back(static_cast<size_t>(norm.numel()) * 4);
    auto* out = reinterpret_cast<float*>(buf.data());
    for (int64_t i = 0; i < norm.numel(); ++i) out[i] = 1.0f + norm.at(i);
    norm = TensorView{buf.data(), DType::kF32, norm.shape};
  };
  for (LayerWeights& l : w->layers) {
    for (TensorView* n :
         {&l.input_norm, &l.post_norm, &l.pre_ff_norm, &l.post_ff_norm, &l.q_norm, &l.k_norm}) {
      fold(*n);
    }
  }
  fold(w->final_norm);
}

ModelWeights dummy_weights(const ModelConfig& config, const LayerPlan& plan) {
  ModelWeights w;
  w.dummy = true;
  w.layers.resize(static_cast<size_t>(plan.num_layers()));
  for (int64_t i = 0; i < plan.num_layers(); ++i) {
    if (config.moe.enabled() && config.moe.sparse_layer(plan.layer_begin + i)) {
      w.layers[static_cast<size_t>(i)].experts.resize(static_cast<size_t>(plan.experts));
    }
  }
  return w;
}

Expected<ModelWeights> bind_weights(const Checkpoint& ckpt, const ModelConfig& c,
                                    const LayerPlan& plan) {
  // The checkpoint as a whole must be this model's, stored as its config says.
  const std::vector<WeightSpec> table = expected_weights(c);
  std::set<std::string> expected;
  for (const WeightSpec& w : table) expected.insert(w.name);
  std::vector<std::string> unused;
  for (const auto& name : ckpt.names()) {
    if (!expected.count(name) && name.find("rotary_emb.inv_freq") == std::string::npos) {
      unused.push_back(name);
    }
  }
  // A quantized tensor the config does not expect: the checkpoint is not what config.json says.
  for (const std::string& name : unused) {
    for (const char* part : {".qweight", ".qzeros", ".weight_scale", ".g_idx", ".scales"}) {
      const size_t n = std::strlen(part);
      if (name.size() > n && name.compare(name.size() - n, n, part) == 0) {
        const SafetensorsFile* file = ckpt.file_of(name);
        return invalid_argument(
            name + (file ? " in " + file->path() : std::string()) +
            " is a quantized tensor, but config.json's quantization_config " +
            (c.quant.method == QuantMethod::kNone ? "is missing" : "says " + c.quant.describe()) +
            ": a quantized checkpoint is read only with the quantization_config it was exported "
            "with");
      }
    }
  }
  for (const WeightSpec& w : table) {
    Status st = check_tensor(ckpt, w);
    if (!st.is_ok() && w.expert >= 0 && st.code() == Code::kNotFound) {
      // A missing expert: the config may count more experts than the checkpoint has.
      return not_found(st.message() + "; expert " + std::to_string(w.expert) + " of layer " +
                       std::to_string(w.layer) + " (config.json: " +
                       std::to_string(c.moe.num_experts) + " experts per MoE layer)");
    }
    TESSERA_RETURN_IF_ERROR(st);
  }
  if (!unused.empty()) {
    const SafetensorsFile* file = ckpt.file_of(unused.front());
    std::string list;
    for (size_t i = 0; i < unused.size() && i < 5; ++i) list += (i ? ", " : "") + unused[i];
    return invalid_argument(
        std::to_string(unused.size()) + " tensor(s) in the checkpoint are not used by a " +
        architecture_name(c.arch) + " with this config.json (" + list +
        (file ? " in " + file->path() : std::string()) + "); is config.json from another model?");
  }
  ModelWeights w;
  w.layers.resize(static_cast<size_t>(plan.num_layers()));
  for (const WeightShard& s : plan.weights) {
    TESSERA_ASSIGN_OR_RETURN(TensorView full, ckpt.tensor(s.spec.name));
    TensorView v = slice(full, s, w.owned);
    if (s.spec.part == WeightPart::kGIdx && s.spec.split == Split::kColumns &&
        c.quant.group_size > 0 && !c.quant.desc_act) {
      v = local_groups(v, s, c.quant.group_size, w.owned);
    }
    w.bytes += v.bytes();
    if (s.spec.layer < 0) {
      switch (s.spec.kind) {
        case WeightKind::kEmbed:
          w.embed = v;
          break;
        case WeightKind::kFinalNorm:
          w.final_norm = v;
          break;
        case WeightKind::kLmHead:
          w.lm_head = v;
          break;
        default:
          break;
      }
      continue;
    }
    LayerWeights& l = w.layers[static_cast<size_t>(s.spec.layer - plan.layer_begin)];
    if (TensorView* moe = moe_tensor(l, s.spec, plan)) {
      *moe = v;
      continue;
    }
    if (LinearWeight* lw =
            s.spec.role == WeightRole::kLinear ? linear_of(l, s.spec.kind) : nullptr) {
      part_of(*lw, s.spec.part) = v;
      if (s.spec.part == WeightPart::kQWeight) lw->method = c.quant.method;
      if (s.spec.part == WeightPart::kWeight && v.dtype == DType::kF8E4M3) {
        lw->method = QuantMethod::kFp8;
      }
      continue;
    }
    switch (s.spec.kind) {
      case WeightKind::kQBias: l.q_bias = v; break;
      case WeightKind::kKBias: l.k_bias = v; break;
      case WeightKind::kVBias: l.v_bias = v; break;
      case WeightKind::kOBias: l.o_bias = v; break;
      case WeightKind::kQNorm: l.q_norm = v; break;
      case WeightKind::kKNorm:
        l.k_norm = v;
        break;
      case WeightKind::kInputNorm: l.input_norm = v; break;
      case WeightKind::kPostNorm: l.post_norm = v; break;
      case WeightKind::kPreFfNorm:
        l.pre_ff_norm = v;
        break;
      case WeightKind::kPostFfNorm:
        l.post_ff_norm = v;
        break;
      default: break;
    }
  }
  if (plan.last_stage && c.tie_word_embeddings) w.lm_head = w.embed;
  return w;
}

}  // namespace tessera
