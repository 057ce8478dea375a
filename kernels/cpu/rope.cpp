#include "kernels/cpu/rope.h"

#include <algorithm>
#include <cmath>
#include <numbers>
#include <string>

#include "kernels/cpu/op_util.h"

namespace tessera::cpu {

namespace {

// transformers' _compute_llama3_parameters, one fp32 rounding per torch op. Python scalars are
// cast to fp32 when combined with an fp32 tensor, and `scalar / tensor` is evaluated by torch
// as tensor.reciprocal() * scalar.
float llama3_inv_freq(float inv_freq, const Llama3RopeScaling& s) {
  const float factor = static_cast<float>(s.factor);
  const double old_context = static_cast<double>(s.original_max_position_embeddings);
  const float low_freq_wavelen = static_cast<float>(old_context / s.low_freq_factor);
  const float high_freq_wavelen = static_cast<float>(old_context / s.high_freq_factor);
  const float wavelen = (1.0f / inv_freq) * static_cast<float>(2.0 * std::numbers::pi);
  float out = wavelen > low_freq_wavelen ? inv_freq / factor : inv_freq;
  const bool medium = !(wavelen < high_freq_wavelen) && !(wavelen > low_freq_wavelen);
  if (medium) {
    const float smooth = ((1.0f / wavelen) * static_cast<float>(old_context) -
                          static_cast<float>(s.low_freq_factor)) /
                         static_cast<float>(s.high_freq_factor - s.low_freq_factor);
    out = (1.0f - smooth) * out / factor + smooth * out;
  }
  return out;
}

}  // namespace

Expected<RopeTable> RopeTable::create(int64_t head_dim, double theta, int64_t max_position,
                                      std::optional<Llama3RopeScaling> scaling) {
  RopeSpec spec;
  spec.head_dim = head_dim;
  spec.theta = theta;
  spec.llama3 = scaling;
  return create(spec, max_position);
}

Expected<RopeTable> RopeTable::create(const RopeSpec& spec, int64_t max_position) {
  const int64_t head_dim = spec.head_dim;
  const double theta = spec.theta;
  const std::optional<Llama3RopeScaling>& scaling = spec.llama3;
  const int64_t rotary_dim = spec.rotary_dim == 0 ? head_dim : spec.rotary_dim;
  if (head_dim <= 0 || head_dim % 2 != 0) {
    return invalid_argument("rope: head_dim must be even and positive, got " +
                            std::to_string(head_dim));
  }
  if (rotary_dim <= 0 || rotary_dim % 2 != 0 || rotary_dim > head_dim) {
    return invalid_argument("rope: rotary_dim must be even, in (0, head_dim " +
                            std::to_string(head_dim) + "], got " + std::to_string(rotary_dim));
  }
  if (!(spec.linear_factor > 0.0) || !std::isfinite(spec.linear_factor)) {
    return invalid_argument("rope: the linear factor must be positive, got " +
                            std::to_string(spec.linear_factor));
  }
  if (spec.longrope) {
    const LongRopeScaling& l = *spec.longrope;
    const size_t n = static_cast<size_t>(rotary_dim / 2);
    bool ok = l.short_factor.size() == n && l.long_factor.size() == n &&
              l.original_max_position_embeddings > 0 && l.attention_factor > 0.0;
    for (double f : l.short_factor) ok = ok && f > 0.0;
    for (double f : l.long_factor) ok = ok && f > 0.0;
    if (!ok) {
      return invalid_argument("rope: longrope needs short_factor and long_factor of " +
                              std::to_string(n) + " (rotary_dim / 2) positive entries, " +
                              "original_max_position_embeddings > 0 and attention_factor > 0");
    }
  }
  if (!(theta > 0.0) || !std::isfinite(theta)) {
    return invalid_argument("rope: theta must be positive, got " + std::to_string(theta));
  }
  if (max_position <= 0) {
    return invalid_argument("rope: max_position must be positive, got " +
                            std::to_string(max_position));
  }
  if (scaling) {
    const Llama3RopeScaling& s = *scaling;
    if (!(s.factor > 0.0) || !(s.low_freq_factor > 0.0) ||
        !(s.high_freq_factor > s.low_freq_factor) || s.original_max_position_embeddings <= 0) {
      return invalid_argument(
          "rope: llama3 scaling needs factor > 0, 0 < low_freq_factor < high_freq_factor and "
          "original_max_position_embeddings > 0");
    }
  }
  RopeTable t;
  t.head_dim_ = head_dim;
  t.rotary_dim_ = rotary_dim;
  t.max_position_ = max_position;
  const int64_t half = rotary_dim / 2;
  const float base = static_cast<float>(theta);
  // arange(0, dim, 2).float() / dim, then base ** that (fp32 result); longrope multiplies it by
  // its factor (fp32) before the reciprocal.
  auto inv_freqs = [&](const std::vector<double>* factors) {
    std::vector<float> inv(static_cast<size_t>(half));
    for (int64_t i = 0; i < half; ++i) {
      const float exponent = static_cast<float>(2 * i) / static_cast<float>(rotary_dim);
      float p = static_cast<float>(std::pow(static_cast<double>(base), exponent));
      if (factors != nullptr) p = static_cast<float>((*factors)[static_cast<size_t>(i)]) * p;
      float f = 1.0f / p;
      if (scaling) f = llama3_inv_freq(f, *scaling);
      if (spec.linear_factor != 1.0) f = f / static_cast<float>(spec.linear_factor);
      inv[static_cast<size_t>(i)] = f;
    }
    return inv;
  };
  const LongRopeScaling* lr = spec.longrope ? &*spec.longrope : nullptr;
  t.inv_freq_ = inv_freqs(lr ? &lr->short_factor : nullptr);
  const std::vector<float> long_inv = lr ? inv_freqs(&lr->long_factor) : std::vector<float>();
  const float attention = lr ? static_cast<float>(lr->attention_factor) : 1.0f;
  t.cos_.resize(static_cast<size_t>(max_position * half));
  t.sin_.resize(static_cast<size_t>(max_position * half));
  for (int64_t pos = 0; pos < max_position; ++pos) {
    const float fpos = static_cast<float>(pos);
    const bool long_pos = lr != nullptr && pos >= lr->original_max_position_embeddings;
    const std::vector<float>& inv = long_pos ? long_inv : t.inv_freq_;
    for (int64_t i = 0; i < half; ++i) {
      const double freq = static_cast<double>(inv[i] * fpos);  // fp32 product
      float c = static_cast<float>(std::cos(freq));
      float s = static_cast<float>(std::sin(freq));
      if (lr != nullptr) {  // emb.cos() * attention_scaling, in fp32
        c *= attention;
        s *= attention;
      }
      t.cos_[pos * half + i] = c;
      t.sin_[pos * half + i] = s;
    }
  }
  return t;
}

Status apply_rope(CpuContext& ctx, const RopeTable& table, std::span<const int64_t> positions,
                  std::span<float> q, std::span<float> k) {
  const int64_t n = static_cast<int64_t>(positions.size());
  const int64_t hd = table.head_dim();
  const int64_t half = table.rotary_dim() / 2;  // the rotated part's halves; the rest passes
  if (n == 0) {
    if (!q.empty() || !k.empty())
      return invalid_argument("apply_rope: q/k given without positions");
    return Status::ok();
  }
  const int64_t row = n * hd;
  if (q.size() % static_cast<size_t>(row) != 0 || k.size() % static_cast<size_t>(row) != 0) {
    return invalid_argument("apply_rope: q has " + std::to_string(q.size()) + " and k " +
                            std::to_string(k.size()) +
                            " elements, not multiples of n * head_dim = " + std::to_string(n) +
                            " * " + std::to_string(hd));
  }
  for (int64_t t = 0; t < n; ++t) {
    if (positions[t] < 0 || positions[t] >= table.max_position()) {
      return invalid_argument("apply_rope: position " + std::to_string(positions[t]) +
                              " at index " + std::to_string(t) + " is outside the table [0, " +
                              std::to_string(table.max_position()) + ")");
    }
  }
  const int64_t q_heads = static_cast<int64_t>(q.size()) / row;
  const int64_t k_heads = static_cast<int64_t>(k.size()) / row;
  // q * cos + rotate_half(q) * sin, each product rounded before the sum as torch does.
  auto rotate = [half](float* x, const float* c, const float* s) {
    for (int64_t i = 0; i < half; ++i) {
      const float a = x[i];
      const float b = x[i + half];
      x[i] = a * c[i] - b * s[i];
      x[i + half] = b * c[i] + a * s[i];
    }
  };
  const int64_t grain = std::max<int64_t>(1, detail::kParallelWork / ((q_heads + k_heads) * hd));
  ctx.parallel_for(n, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = table.cos(positions[t]);
      const float* s = table.sin(positions[t]);
      for (int64_t h = 0; h < q_heads; ++h) rotate(q.data() + (t * q_heads + h) * hd, c, s);
      for (int64_t h = 0; h < k_heads; ++h) rotate(k.data() + (t * k_heads + h) * hd, c, s);
    }
  });
  return Status::ok();
}

}  // namespace tessera::cpu
