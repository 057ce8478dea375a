// The RoPE a model's attention layers use, as both backends build their tables from it.
#pragma once

#include "common/checkpoint/model_config.h"
#include "kernels/cpu/rope.h"

namespace tessera {

// The RoPE of `config`'s global layers, or (local) of Gemma 3's sliding layers: rope_local_theta,
// no scaling (transformers' rotary_emb_local).
inline cpu::RopeSpec rope_spec(const ModelConfig& config, bool local) {
  cpu::RopeSpec spec;
  spec.head_dim = config.head_dim;
  spec.rotary_dim = config.rotary_dim;
  spec.theta = local ? config.rope_local_theta : config.rope_theta;
  if (local) return spec;
  const RopeScaling& r = config.rope_scaling;
  if (r.type == "llama3") {
    spec.llama3 = cpu::Llama3RopeScaling{r.factor, r.low_freq_factor, r.high_freq_factor,
                                         r.original_max_position_embeddings};
  } else if (r.type == "linear") {
    spec.linear_factor = r.factor;
  } else if (r.type == "longrope") {
    spec.longrope = cpu::LongRopeScaling{r.short_factor, r.long_factor,
                                         r.original_max_position_embeddings, r.attention_factor};
  }
  return spec;
}

}  // namespace tessera
