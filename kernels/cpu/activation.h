// The gated activation of the Llama-family MLP: down(silu(gate(x)) * up(x)) needs
// silu(gate) * up between the projections (Gemma: gelu_tanh(gate) * up).
#pragma once

#include <cstdint>
#include <span>

#include "common/status.h"
#include "kernels/cpu/cpu_context.h"

namespace tessera::cpu {

// out[r, i] = silu(gate[r, i]) * up[r, i] with silu(x) = x / (1 + exp(-x)) in fp32 (torch's
// formula; exp(-x) overflowing to inf gives -0, as in torch).
//   gate, up, out: [n, inter] fp32, all the same size; out may alias gate or up
Status silu_mul(CpuContext& ctx, std::span<const float> gate, std::span<const float> up,
                std::span<float> out);

// out[r, i] = gelu_tanh(gate[r, i]) * up[r, i]: Gemma's GeGLU (hidden_activation
// gelu_pytorch_tanh), torch's gelu(approximate="tanh") in fp32 as its CPU kernel spells it:
//   0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x^3)))
//   gate, up, out: [n, inter] fp32, all the same size; out may alias gate or up
Status gelu_tanh_mul(CpuContext& ctx, std::span<const float> gate, std::span<const float> up,
                     std::span<float> out);

// The same from a fused gate_up projection (vLLM's merged gate_up_proj): row r of gate_up is
// [gate[r, 0..inter) | up[r, 0..inter)].
//   gate_up: [n, 2 * inter] fp32
//   out:     [n, inter] fp32 (n = out.size() / inter), must not overlap gate_up
Status silu_mul_fused(CpuContext& ctx, std::span<const float> gate_up, int64_t inter,
                      std::span<float> out);

}  // namespace tessera::cpu
