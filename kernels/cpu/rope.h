// Rotary position embedding, as Hugging Face transformers computes it for Llama / Mistral /
// Qwen2 / Qwen3 / Gemma / Phi-3: the non-interleaved ("rotate_half", NeoX) convention over the
// first rotary_dim dimensions of each head (all of it unless partial_rotary_factor < 1),
//   q' = q * cos + rotate_half(q) * sin,   rotate_half([a, b]) = [-b, a],
// with cos/sin = cos/sin(inv_freq[i] * position) repeated for both halves of the rotated part;
// the rest of the head passes through.
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

// Phi-3's LongRoPE ("longrope", formerly "su"): inv_freq[i] = 1 / (factor[i] * theta^(2i /
// rotary_dim)), short_factor for positions below original_max_position_embeddings and
// long_factor from there, cos and sin multiplied by attention_factor (transformers'
// _compute_longrope_parameters). transformers picks the factors by the length of the whole
// forward call (every position long once a sequence passes the boundary); with a KV cache the
// keys already written keep theirs, so here a position's own index decides (vLLM likewise reads
// one table past the boundary): identical up to the boundary.
struct LongRopeScaling {
  std::vector<double> short_factor, long_factor;  // [rotary_dim / 2] each
  int64_t original_max_position_embeddings = 4096;
  double attention_factor = 1.0;
};

// One RoPE: a layer type's (Gemma 3's local layers have their own theta and no scaling).
struct RopeSpec {
  int64_t head_dim = 0;
  int64_t rotary_dim = 0;  // dimensions rotated at the head's start; 0: head_dim
  double theta = 10000.0;
  std::optional<Llama3RopeScaling> llama3;
  double linear_factor = 1.0;  // rope_type linear: inv_freq / factor (Gemma 3's global layers)
  std::optional<LongRopeScaling> longrope;
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
// Memory: max_position * rotary_dim * 4 bytes (cos and sin for head_dim / 2 frequencies each).
class RopeTable {
 public:
  // head_dim: even, > 0; theta: rope_theta > 0; max_position: > 0 (positions must stay below
  // it). Errors are INVALID_ARGUMENT.
  static Expected<RopeTable> create(int64_t head_dim, double theta, int64_t max_position,
                                    std::optional<Llama3RopeScaling> scaling = std::nullopt);
  // Any RopeSpec: rotary_dim even, in (0, head_dim]; linear_factor > 0; longrope factor lists of
  // rotary_dim / 2 positive entries. The linear factor divides inv_freq in fp32 as transformers'
  // `inv_freq / factor`; longrope's cos/sin are fp32 products with (float) attention_factor.
  static Expected<RopeTable> create(const RopeSpec& spec, int64_t max_position);

  int64_t head_dim() const { return head_dim_; }
  int64_t rotary_dim() const { return 2 * half(); }
  int64_t max_position() const { return max_position_; }
  // [rotary_dim / 2] fp32, after any scaling (longrope: the short factors').
  std::span<const float> inv_freq() const { return inv_freq_; }
  // [rotary_dim / 2] fp32 for one position in [0, max_position) (unchecked: a precondition).
  const float* cos(int64_t position) const { return cos_.data() + position * half(); }
  const float* sin(int64_t position) const { return sin_.data() + position * half(); }

 private:
  RopeTable() = default;
  int64_t half() const { return rotary_dim_ / 2; }

  int64_t head_dim_ = 0;
  int64_t rotary_dim_ = 0;
  int64_t max_position_ = 0;
  std::vector<float> inv_freq_;  // [rotary_dim / 2]
  std::vector<float> cos_;       // [max_position, rotary_dim / 2]
  std::vector<float> sin_;       // [max_position, rotary_dim / 2]
};

// Rotates q and k in place for their token positions.
//   positions: [n] int64, each in [0, table.max_position())
//   q:         [n, num_heads, head_dim] fp32, in place (num_heads = q.size() / (n * head_dim))
//   k:         [n, num_kv_heads, head_dim] fp32, in place (may be empty to rotate only q)
// Errors (bad sizes, a position out of the table) are reported before anything is modified.
Status apply_rope(CpuContext& ctx, const RopeTable& table, std::span<const int64_t> positions,
                  std::span<float> q, std::span<float> k);

}  // namespace tessera::cpu
