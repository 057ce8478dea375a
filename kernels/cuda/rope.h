// A layer's rotary-embedding constants, one type for every kernel that applies the rope:
// rope_and_cache (elementwise.h, RopeCacheArgs) and the decode attention that applies it itself
// (attention.h, AttentionRope). Plain data: the kernels take it by value.
#pragma once

#include <cstdint>

namespace tessera::cuda {

struct RopeConstants {
  // Qwen3's q_norm / k_norm, [head_dim] of the model's dtype each (an RMSNorm over each head
  // before the rotation), or both null: no head norms.
  const void* q_norm = nullptr;
  const void* k_norm = nullptr;
  bool norm_unit_offset = false;  // q_norm / k_norm hold w of Gemma's 1 + w
  float eps = 1e-6f;
  // The rotation: [max_position, rotary_dim / 2] fp32 each (cos and sin of position x the
  // inverse frequencies, any scaling applied).
  const float* cos = nullptr;
  const float* sin = nullptr;
  int64_t max_position = 0;
};

}  // namespace tessera::cuda
