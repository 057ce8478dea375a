// RMSNorm as Hugging Face's LlamaRMSNorm / Qwen3RMSNorm compute it in fp32:
//   out = weight * (x * rsqrt(mean(x^2) + eps))
// (eps is cast to fp32, as torch does when adding a Python float to an fp32 tensor). Rows are
// independent; `out` may alias `x` (each row is read completely before it is written).
#pragma once

#include <cstdint>
#include <span>

#include "common/status.h"
#include "common/tensor.h"
#include "kernels/cpu/cpu_context.h"

namespace tessera::cpu {

// out[r, :] = rmsnorm(x[r, :]) * weight for every row r.
//   x:      [n, d] fp32 (n = x.size() / d)
//   weight: [d], F32 / F16 / BF16
//   out:    [n, d] fp32, may alias x
Status rms_norm(CpuContext& ctx, std::span<const float> x, const TensorView& weight, double eps,
                std::span<float> out);

// The fused residual form vLLM uses between sub-layers:
//   residual += x;  out = rmsnorm(residual) * weight
//   x:        [n, d] fp32 (the sub-layer output)
//   residual: [n, d] fp32, updated in place (the running hidden state)
//   weight:   [d], F32 / F16 / BF16
//   out:      [n, d] fp32, may alias x (not residual)
Status add_rms_norm(CpuContext& ctx, std::span<const float> x, std::span<float> residual,
                    const TensorView& weight, double eps, std::span<float> out);

// Per-head RMSNorm in place (Qwen3's q_norm / k_norm, applied before RoPE): every head vector
// of x is normalised over head_dim and scaled by weight.
//   x:      [n, heads, head_dim] fp32, in place
//   weight: [head_dim], F32 / F16 / BF16
Status rms_norm_per_head(CpuContext& ctx, std::span<float> x, const TensorView& weight, double eps);

}  // namespace tessera::cpu
