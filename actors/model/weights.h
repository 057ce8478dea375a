// One rank's share of a checkpoint, bound to the layer structure every supported architecture
// shares. The LayerPlan (common/checkpoint/layer_plan.h) says which tensors and which slices;
// this binds them: row slices are views into the mmapped checkpoint, column slices (row-parallel
// layers under tensor parallelism) are copied out once. Architectures differ only in which
// optional tensors exist (Qwen2's q/k/v biases, Qwen3's and Gemma 3's q_norm/k_norm, Gemma's
// pre/post feed-forward norms, a tied lm_head); Phi-3's fused qkv_proj / gate_up_proj bind as
// row views of their parts (q_proj ... up_proj below).
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
  TensorView post_norm;   // [hidden]                         (post_attention_layernorm)

  // Gemma's norms around the MLP (ModelConfig::sandwich_norms only):
  TensorView pre_ff_norm;   // [hidden] pre_feedforward_layernorm
  TensorView post_ff_norm;  // [hidden] post_feedforward_layernorm

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
  // This rank's experts, LayerPlan::expert_begin onwards: every expert's slice, or (expert
  // parallel) whole experts of its range; empty: a dense layer.
  std::vector<Expert> experts;
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
  // --load-format dummy: no tensor is bound (every view null); the GPU backend initialises each
  // weight randomly in place (CudaWeights::upload).
  bool dummy = false;
};

// The weights of --load-format dummy for `plan`: layers sized, each MoE layer's experts too,
// no tensor bound.
ModelWeights dummy_weights(const ModelConfig& config, const LayerPlan& plan);

// The Hugging Face name of a layer tensor: "model.layers.3.self_attn.q_proj.weight".
std::string layer_tensor_name(int64_t layer, const std::string& suffix);

// Gemma's norms scale by (1 + weight) (ModelConfig::norm_unit_offset): replaces every norm
// view of `weights` (the layers' input/post/pre-ff/post-ff and q/k norms, the final norm) by F32
// 1 + w, rounded as Gemma2RMSNorm's fp32 (1.0 + weight.float()), so a plain RMSNorm computes the
// same. Does nothing for other models.
void fold_norm_unit_offset(const ModelConfig& config, ModelWeights* weights);

// Checks the checkpoint against the whole model (every tensor expected_weights() names, with its
// shape and, for a quantized format's tensors, its dtype; a tensor the checkpoint has but the
// config does not use is an error too: the config would be from another model, or the
// quantization_config from another export) and binds `plan`'s slices. Errors name the tensor,
// its file and both shapes.
Expected<ModelWeights> bind_weights(const Checkpoint& checkpoint, const ModelConfig& config,
                                    const LayerPlan& plan);

}  // namespace tessera
