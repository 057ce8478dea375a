// How one attention layer turns q . k into softmax weights: the one value type the CPU kernel
// (kernels/cpu/paged_attention.h), the CUDA kernels (kernels/cuda/attention.h) and the models
// share, so a layer's scale, logit soft-cap and sliding window are said once.
#pragma once

#include <cmath>
#include <cstdint>
#include <string>

#include "common/status.h"

namespace tessera {

struct AttentionScoring {
  // Multiplies q . k: 1 / sqrt(head_dim) for most models, query_pre_attn_scalar^-0.5 for Gemma.
  float scale = 0.0f;
  // Attention logit soft-cap (Gemma 2's attn_logit_softcapping): 0 = off; c > 0 replaces the
  // scaled score s by c * tanh(s / c) before the mask and the softmax, as transformers'
  // eager_attention_forward of Gemma 2 does.
  float softcap = 0.0f;
  // Sliding window (ModelConfig::attention_window): 0 = full causal attention; w > 0 = a query at
  // position p attends to positions max(0, p - w + 1) ..= p, w keys at most (transformers'
  // sliding_window_overlay: kv_idx > q_idx - w).
  int64_t window = 0;
};

// The first position a query at `position` attends to under `window` (0 = full: 0).
inline int64_t attention_window_start(int64_t position, int64_t window) {
  return window > 0 && position >= window ? position - window + 1 : 0;
}

// INVALID_ARGUMENT (prefixed with `where`) unless scale is finite and non-zero, softcap is finite
// and >= 0, and window >= 0.
inline Status check_attention_scoring(const AttentionScoring& s, const std::string& where) {
  if (!std::isfinite(s.scale) || s.scale == 0.0f) {
    return invalid_argument(where + "attention scale " + std::to_string(s.scale) +
                            " must be finite and non-zero");
  }
  if (!std::isfinite(s.softcap) || s.softcap < 0.0f) {
    return invalid_argument(where + "attention softcap " + std::to_string(s.softcap) +
                            " must be finite and >= 0 (0 = off)");
  }
  if (s.window < 0) {
    return invalid_argument(where + "attention window " + std::to_string(s.window) +
                            " must be >= 0 (0 = full attention)");
  }
  return Status::ok();
}

}  // namespace tessera
