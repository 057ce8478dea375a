// Rotary position embedding, as Hugging Face transformers computes it for Llama / Mistral /
// Qwen2 / Qwen3: the non-interleaved ("rotate_half", NeoX) convention over the whole head,
//   q' = q * cos + rotate_half(q) * sin,   rotate_half([a, b]) = [-b, a],
// with cos/sin = cos/sin(inv_freq[i] * position) repeated for both halves of the head.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "common/status.h"
#include "kernels/cpu/cpu_context.h"

namespace tessera::cpu {

// rope_scaling of type "llama3" (Llama 3.1+), the fields of config.json's rope_scaling.
struct Llama3RopeScaling {
  double factor = 8.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int64_t original_max_position_embeddings = 8192;
};

// cos/sin for every position in [0, max_position), computed once. The arithmetic follows
// transformers step by step in fp32 so that the table is within 1e-6 of its cos/sin:
//   inv_freq[i] = 1 / theta^(2i / head_dim)       (fp32: exponent fp32, pow rounded to fp32)
//   llama3:  wavelen = 2pi / inv_freq; low-frequency (wavelen > orig / low_freq_factor) -> /factor;
//            medium -> (1 - s) * inv_freq / factor + s * inv_freq with
//            s = (orig / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
//            (transformers' _compute_llama3_parameters, each op rounded to fp32)
//   freq = inv_freq[i] * position                 (an fp32 product, as inv_freq @ position_ids)
//   cos/sin(freq)                                 (rounded to fp32 from a double evaluation)
// Memory: max_position * head_dim * 4 bytes (cos and sin for head_dim / 2 frequencies each).
class RopeTable {
 public:
  // head_dim: even, > 0; theta: rope_theta > 0; max_position: > 0 (positions must stay below
  // it). Errors are INVALID_ARGUMENT.
  static Expected<RopeTable> create(int64_t head_dim, double theta, int64_t max_position,
                                    std::optional<Llama3RopeScaling> scaling = std::nullopt);

  int64_t head_dim() const { return head_dim_; }
  int64_t max_position() const { return max_position_; }
  // [head_dim / 2] fp32, after any scaling.
  std::span<const float> inv_freq() const { return inv_freq_; }
  // [head_dim / 2] fp32 for one position in [0, max_position) (unchecked: a precondition).
  const float* cos(int64_t position) const { return cos_.data() + position * half(); }
  const float* sin(int64_t position) const { return sin_.data() + position * half(); }

 private:
  RopeTable() = default;
  int64_t half() const { return head_dim_ / 2; }

  int64_t head_dim_ = 0;
  int64_t max_position_ = 0;
  std::vector<float> inv_freq_;  // [head_dim / 2]
  std::vector<float> cos_;       // [max_position, head_dim / 2]
  std::vector<float> sin_;       // [max_position, head_dim / 2]
};

// Rotates q and k in place for their token positions.
//   positions: [n] int64, each in [0, table.max_position())
//   q:         [n, num_heads, head_dim] fp32, in place (num_heads = q.size() / (n * head_dim))
//   k:         [n, num_kv_heads, head_dim] fp32, in place (may be empty to rotate only q)
// Errors (bad sizes, a position out of the table) are reported before anything is modified.
Status apply_rope(CpuContext& ctx, const RopeTable& table, std::span<const int64_t> positions,
                  std::span<float> q, std::span<float> k);

}  // namespace tessera::cpu
