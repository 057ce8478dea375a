// A dense layer in Hugging Face's nn.Linear layout: y = x . W^T + b.
#pragma once

#include <cstdint>
#include <span>

#include "common/status.h"
#include "common/tensor.h"
#include "kernels/cpu/cpu_context.h"

namespace tessera::cpu {

// y[t, o] = sum_i x[t, i] * W[o, i] (+ bias[o]), fp32 math.
//   x:      [n, in] fp32 (n = x.size() / in)
//   weight: [out, in], F32 / F16 / BF16 (the checkpoint tensor as mapped, converted on the fly)
//   bias:   [out], F32 / F16 / BF16, or nullptr for none
//   y:      [n, out] fp32, must not overlap x
// Output rows are processed four at a time (a tile) against every token, so W is read once per
// call: fp32 weights in place, bf16 widened in registers when n <= 4, otherwise (and for fp16)
// the tile is converted once into an fp32 scratch. Tiles are spread over the context's threads
// when n * in * out is large. Each y element is one fp32 dot product in a fixed lane order
// (detail::dot), so results do not depend on the thread count or the path taken.
Status linear(CpuContext& ctx, std::span<const float> x, const TensorView& weight,
              const TensorView* bias, std::span<float> y);

}  // namespace tessera::cpu
