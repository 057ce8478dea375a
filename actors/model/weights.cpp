#include "actors/model/weights.h"

#include <set>

namespace tessera {

std::string layer_tensor_name(int64_t layer, const std::string& suffix) {
  return "model.layers." + std::to_string(layer) + "." + suffix;
}

Expected<ModelWeights> bind_weights(const Checkpoint& ckpt, const ModelConfig& c) {
  const int64_t hidden = c.hidden_size;
  const int64_t q_out = c.num_heads * c.head_dim;
  const int64_t kv_out = c.num_kv_heads * c.head_dim;
  std::set<std::string> used;
  ModelWeights w;
  auto bind = [&](const std::string& name, std::vector<int64_t> shape, TensorView& out) -> Status {
    auto t = ckpt.require(name, shape);
    if (!t) return t.status();
    out = *t;
    used.insert(name);
    w.bytes += out.bytes();
    return Status::ok();
  };
  TESSERA_RETURN_IF_ERROR(bind("model.embed_tokens.weight", {c.vocab_size, hidden}, w.embed));
  w.layers.resize(static_cast<size_t>(c.num_layers));
  for (int64_t i = 0; i < c.num_layers; ++i) {
    LayerWeights& l = w.layers[static_cast<size_t>(i)];
    auto n = [&](const char* suffix) { return layer_tensor_name(i, suffix); };
    TESSERA_RETURN_IF_ERROR(bind(n("input_layernorm.weight"), {hidden}, l.input_norm));
    TESSERA_RETURN_IF_ERROR(bind(n("self_attn.q_proj.weight"), {q_out, hidden}, l.q_proj));
    TESSERA_RETURN_IF_ERROR(bind(n("self_attn.k_proj.weight"), {kv_out, hidden}, l.k_proj));
    TESSERA_RETURN_IF_ERROR(bind(n("self_attn.v_proj.weight"), {kv_out, hidden}, l.v_proj));
    TESSERA_RETURN_IF_ERROR(bind(n("self_attn.o_proj.weight"), {hidden, q_out}, l.o_proj));
    if (c.attention_bias) {
      TESSERA_RETURN_IF_ERROR(bind(n("self_attn.q_proj.bias"), {q_out}, l.q_bias));
      TESSERA_RETURN_IF_ERROR(bind(n("self_attn.k_proj.bias"), {kv_out}, l.k_bias));
      TESSERA_RETURN_IF_ERROR(bind(n("self_attn.v_proj.bias"), {kv_out}, l.v_bias));
    }
    if (c.o_proj_bias) {
      TESSERA_RETURN_IF_ERROR(bind(n("self_attn.o_proj.bias"), {hidden}, l.o_bias));
    }
    if (c.qk_norm) {
      TESSERA_RETURN_IF_ERROR(bind(n("self_attn.q_norm.weight"), {c.head_dim}, l.q_norm));
      TESSERA_RETURN_IF_ERROR(bind(n("self_attn.k_norm.weight"), {c.head_dim}, l.k_norm));
    }
    TESSERA_RETURN_IF_ERROR(bind(n("post_attention_layernorm.weight"), {hidden}, l.post_norm));
    TESSERA_RETURN_IF_ERROR(
        bind(n("mlp.gate_proj.weight"), {c.intermediate_size, hidden}, l.gate_proj));
    TESSERA_RETURN_IF_ERROR(
        bind(n("mlp.up_proj.weight"), {c.intermediate_size, hidden}, l.up_proj));
    TESSERA_RETURN_IF_ERROR(
        bind(n("mlp.down_proj.weight"), {hidden, c.intermediate_size}, l.down_proj));
  }
  TESSERA_RETURN_IF_ERROR(bind("model.norm.weight", {hidden}, w.final_norm));
  if (c.tie_word_embeddings) {
    w.lm_head = w.embed;
  } else {
    TESSERA_RETURN_IF_ERROR(bind("lm_head.weight", {c.vocab_size, hidden}, w.lm_head));
  }
  // Tensors nobody uses mean the config and the checkpoint disagree.
  std::vector<std::string> unused;
  for (const auto& name : ckpt.names()) {
    if (!used.count(name) && name.find("rotary_emb.inv_freq") == std::string::npos) {
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
  return w;
}

}  // namespace tessera
