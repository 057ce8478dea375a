// The model shapes `tessera make-model` writes (internal to driver/make_model): a tiny test shape
// per architecture, each exercising its peculiarity, and real published models' shapes.
#pragma once

#include <cstdint>
#include <span>

#include "common/checkpoint/model_config.h"

namespace tessera::model_shapes {

// One preset: config.json's figures (build_config in make_model.cpp writes the keys).
struct Shape {
  const char* name;
  Architecture arch;
  const char* source;  // the published config.json this copies ("" for tiny)
  int64_t vocab;       // 0: the tokenizer's size
  int64_t hidden, intermediate, layers, heads, kv_heads;
  int64_t head_dim;  // 0: hidden / heads
  int64_t max_positions;
  double rms_norm_eps, rope_theta;
  double llama3_rope_factor;  // 0: no rope_scaling; else llama3 with low 1, high 4, orig 8192
  bool tie;
  int64_t sliding_window;  // 0: none (null)
  // Mixture of experts (Mixtral, Qwen2-MoE, Qwen3-MoE); experts 0 for dense models.
  int64_t experts = 0, top_k = 0;
  int64_t moe_intermediate = 0;     // Qwen's moe_intermediate_size (Mixtral: intermediate)
  int64_t shared_intermediate = 0;  // Qwen2-MoE's shared expert
  bool norm_topk_prob = false;      // Qwen (Mixtral always renormalises)
  int64_t dense_layer = -1;         // Qwen: mlp_only_layers = [dense_layer] (-1: [])
  // Gemma 2 / Gemma 3 / Phi-3 (zero for the others):
  double attn_softcap = 0, final_softcap = 0;  // Gemma's soft-capping (0: null)
  int64_t query_pre_attn_scalar = 0;           // Gemma
  int64_t window_pattern = 0;          // Gemma 3's sliding_window_pattern (every n-th layer global)
  bool layer_types = false;            // write layer_types out (transformers 5 does)
  double rope_local_theta = 0;         // Gemma 3's rope_local_base_freq
  double linear_rope_factor = 0;       // Gemma 3's global layers: rope_scaling linear
  int64_t original_max_positions = 0;  // Phi-3's original_max_position_embeddings
  double partial_rotary = 0;           // Phi-3's partial_rotary_factor (0: 1.0)
  bool longrope = false;               // Phi-3: LongRoPE with made-up short / long factors (tiny)
  // Phi-3: LongRoPE with these factors (head_dim / 2 each; empty: none, or the made-up ones).
  std::span<const double> short_factor = {}, long_factor = {};
};

// Every preset, tiny ones first ("tiny" once per architecture).
std::span<const Shape> shapes();

}  // namespace tessera::model_shapes
