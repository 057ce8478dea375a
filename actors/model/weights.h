// A checkpoint's tensors bound to the layer structure every supported architecture shares.
// Architectures differ only in which optional tensors exist (Qwen2's q/k/v biases, Qwen3's
// q_norm/k_norm, an lm_head absent when tied): one weight-name map, no class per model.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/checkpoint/model_config.h"
#include "common/checkpoint/safetensors.h"
#include "common/status.h"
#include "common/tensor.h"

namespace tessera {

struct LayerWeights {
  TensorView input_norm;  // [hidden]
  TensorView q_proj;      // [heads * head_dim, hidden]
  TensorView k_proj;      // [kv_heads * head_dim, hidden]
  TensorView v_proj;      // [kv_heads * head_dim, hidden]
  TensorView o_proj;      // [hidden, heads * head_dim]
  TensorView q_bias;      // [heads * head_dim]      (attention_bias only; else data == null)
  TensorView k_bias;      // [kv_heads * head_dim]   (attention_bias only)
  TensorView v_bias;      // [kv_heads * head_dim]   (attention_bias only)
  TensorView o_bias;      // [hidden]                (o_proj_bias only: Llama/Qwen3 with bias)
  TensorView q_norm;      // [head_dim]              (qk_norm only)
  TensorView k_norm;      // [head_dim]              (qk_norm only)
  TensorView post_norm;   // [hidden]
  TensorView gate_proj;   // [intermediate, hidden]
  TensorView up_proj;     // [intermediate, hidden]
  TensorView down_proj;   // [hidden, intermediate]
};

struct ModelWeights {
  TensorView embed;  // [vocab, hidden]
  std::vector<LayerWeights> layers;
  TensorView final_norm;  // [hidden]
  TensorView lm_head;     // [vocab, hidden] (the embedding when tied)
  uint64_t bytes = 0;     // all bound tensors, the tied lm_head counted once
};

// The Hugging Face name of each tensor: "model.layers.3.self_attn.q_proj.weight", ...
std::string layer_tensor_name(int64_t layer, const std::string& suffix);

// Binds every tensor the config implies, checking shapes. Errors name the tensor, its file and
// both shapes; a tensor the checkpoint has but the config does not use is reported too (a
// mismatched config would otherwise be silently wrong).
Expected<ModelWeights> bind_weights(const Checkpoint& checkpoint, const ModelConfig& config);

}  // namespace tessera
