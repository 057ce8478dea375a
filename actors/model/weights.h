// One rank's share of a checkpoint, bound to the layer structure every supported architecture
// shares. The LayerPlan (common/checkpoint/layer_plan.h) says which tensors and which slices;
// this binds them: row slices are views into the mmapped checkpoint, column slices (row-parallel
// layers under tensor parallelism) are copied out once. Architectures differ only in which
// optional tensors exist (Qwen2's q/k/v biases, Qwen3's q_norm/k_norm, a tied lm_head).
#pragma once

#include <cstdint>
#include <deque>
#include <string>
#include <vector>

#include "common/checkpoint/layer_plan.h"
#include "common/checkpoint/model_config.h"
#include "common/checkpoint/quantization.h"
#include "common/checkpoint/safetensors.h"
#include "common/status.h"
#include "common/tensor.h"

namespace tessera {

// A layer's tensors on this rank (shapes are the rank's slices; data == null when absent). The
// linear layers are as the checkpoint stores them (plain, or a quantized format's tensors);
// the shapes below are their [out, in].
struct LayerWeights {
  TensorView input_norm;  // [hidden]
  LinearWeight q_proj;    // [heads * head_dim, hidden]       (this rank's heads)
  LinearWeight k_proj;    // [kv_heads * head_dim, hidden]
  LinearWeight v_proj;    // [kv_heads * head_dim, hidden]
  LinearWeight o_proj;    // [hidden, heads * head_dim]       (its columns)
  TensorView q_bias;      // [heads * head_dim]               (attention_bias only)
  TensorView k_bias;      // [kv_heads * head_dim]
  TensorView v_bias;      // [kv_heads * head_dim]
  TensorView o_bias;      // [hidden]                         (tp rank 0, o_proj_bias only)
  TensorView q_norm;      // [head_dim]                       (qk_norm only)
  TensorView k_norm;      // [head_dim]
  TensorView post_norm;   // [hidden]
  LinearWeight gate_proj;  // [intermediate, hidden]          (this rank's rows)
  LinearWeight up_proj;    // [intermediate, hidden]
  LinearWeight down_proj;  // [hidden, intermediate]          (its columns)
  // A mixture-of-experts layer instead of the dense MLP (gate/up/down_proj absent then):
  struct Expert {
    TensorView gate;  // [moe_intermediate, hidden]   (this rank's rows)
    TensorView up;    // [moe_intermediate, hidden]
    TensorView down;  // [hidden, moe_intermediate]   (its columns)
  };
  TensorView router;              // [experts, hidden]      (replicated)
  std::vector<Expert> experts;    // every expert's slice; empty: a dense layer
  Expert shared;                  // Qwen2-MoE's shared expert ([shared_intermediate, ...]);
                                  // data == null when the model has none
  TensorView shared_expert_gate;  // [1, hidden]            (replicated, with `shared`)

  bool moe() const { return !experts.empty(); }
  // The seven linear layers with their names ("self_attn.q_proj"), in checkpoint order (an MoE
  // layer's experts are not among them: MoE checkpoints are not quantized).
  std::vector<std::pair<const char*, LinearWeight*>> linears();
};

struct ModelWeights {
  TensorView embed;       // [vocab_rows, hidden] this rank's vocabulary rows (first stage; a
                          // tied last stage too), else data == null
  std::vector<LayerWeights> layers;  // this stage's layers, layers[i] = layer layer_begin + i
  TensorView final_norm;  // [hidden] (last stage)
  TensorView lm_head;     // [vocab_rows, hidden] (last stage; the embedding when tied)
  uint64_t bytes = 0;     // all bound tensors, a tied lm_head counted once
  std::deque<std::vector<uint8_t>> owned;  // storage of the copied slices (stable addresses)
};

// The Hugging Face name of a layer tensor: "model.layers.3.self_attn.q_proj.weight".
std::string layer_tensor_name(int64_t layer, const std::string& suffix);

// Checks the checkpoint against the whole model (every tensor expected_weights() names, with its
// shape and, for a quantized format's tensors, its dtype; a tensor the checkpoint has but the
// config does not use is an error too: the config would be from another model, or the
// quantization_config from another export) and binds `plan`'s slices. Errors name the tensor,
// its file and both shapes.
Expected<ModelWeights> bind_weights(const Checkpoint& checkpoint, const ModelConfig& config,
                                    const LayerPlan& plan);

}  // namespace tessera
