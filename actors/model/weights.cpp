#include "actors/model/weights.h"

#include <cstring>
#include <set>

namespace tessera {

std::string layer_tensor_name(int64_t layer, const std::string& suffix) {
  return "model.layers." + std::to_string(layer) + "." + suffix;
}

namespace {

// `shard` of `full` as a view: a row range is a view into the checkpoint, a column range is
// copied into `owned`.
TensorView slice(const TensorView& full, const WeightShard& shard,
                 std::deque<std::vector<uint8_t>>& owned) {
  TensorView v = full;
  const size_t es = dtype_size(full.dtype);
  switch (shard.spec.split) {
    case Split::kNone:
      return v;
    case Split::kRows:
    case Split::kVocab: {
      int64_t row_elems = 1;
      for (size_t d = 1; d < full.shape.size(); ++d) row_elems *= full.shape[d];
      v.data = static_cast<const char*>(full.data) + shard.begin * row_elems * es;
      v.shape[0] = shard.end - shard.begin;
      return v;
    }
    case Split::kColumns: {
      const int64_t rows = full.shape[0], cols = full.shape[1];
      const int64_t n = shard.end - shard.begin;
      if (n == cols) return v;  // tp_size 1: the whole tensor, no copy
      std::vector<uint8_t>& buf = owned.emplace_back(static_cast<size_t>(rows * n) * es);
      const char* src = static_cast<const char*>(full.data);
      for (int64_t r = 0; r < rows; ++r) {
        std::memcpy(buf.data() + static_cast<size_t>(r * n) * es,
                    src + static_cast<size_t>(r * cols + shard.begin) * es,
                    static_cast<size_t>(n) * es);
      }
      v.data = buf.data();
      v.shape[1] = n;
      return v;
    }
  }
  return v;
}

}  // namespace

Expected<ModelWeights> bind_weights(const Checkpoint& ckpt, const ModelConfig& c,
                                    const LayerPlan& plan) {
  // The checkpoint as a whole must be this model's.
  std::set<std::string> expected;
  for (const WeightSpec& w : expected_weights(c)) {
    TESSERA_RETURN_IF_ERROR(ckpt.require(w.name, w.shape).status());
    expected.insert(w.name);
  }
  std::vector<std::string> unused;
  for (const auto& name : ckpt.names()) {
    if (!expected.count(name) && name.find("rotary_emb.inv_freq") == std::string::npos) {
      unused.push_back(name);
    }
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
    switch (s.spec.kind) {
      case WeightKind::kQ: l.q_proj = v; break;
      case WeightKind::kK: l.k_proj = v; break;
      case WeightKind::kV: l.v_proj = v; break;
      case WeightKind::kO: l.o_proj = v; break;
      case WeightKind::kQBias: l.q_bias = v; break;
      case WeightKind::kKBias: l.k_bias = v; break;
      case WeightKind::kVBias: l.v_bias = v; break;
      case WeightKind::kOBias: l.o_bias = v; break;
      case WeightKind::kQNorm: l.q_norm = v; break;
      case WeightKind::kKNorm: l.k_norm = v; break;
      case WeightKind::kGate: l.gate_proj = v; break;
      case WeightKind::kUp: l.up_proj = v; break;
      case WeightKind::kDown: l.down_proj = v; break;
      case WeightKind::kInputNorm: l.input_norm = v; break;
      case WeightKind::kPostNorm: l.post_norm = v; break;
      default: break;
    }
  }
  if (plan.last_stage && c.tie_word_embeddings) w.lm_head = w.embed;
  return w;
}

}  // namespace tessera
