// The device scratch of one MoE layer's step (kernels/cuda/moe.cu), carved from one workspace in
// this order, each piece 256-byte aligned: the router's logits, the chosen experts' ids and
// weights, each routing's position and row, the per-expert offsets and tile counts, the experts'
// activations and outputs, and the shared expert's gate_up, activation and output. In common so
// that the planner counts the bytes the CUDA backend allocates (LayerPlan::moe_workspace_bytes).
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/tensor.h"

namespace tessera {

struct MoeCarve {
  size_t logits = 0, ids = 0, weights = 0, pos = 0, rows = 0, offsets = 0, tiles = 0, act = 0,
         y = 0, sh_gate_up = 0, sh_act = 0, sh_out = 0;
  size_t bytes = 0;  // the whole workspace

  // T tokens, E experts (El of them on this rank), top-K routing, hidden H, expert width I,
  // shared expert width Is (0: none), activations in `dtype`.
  static MoeCarve make(DType dtype, int64_t T, int64_t E, int64_t K, int64_t El, int64_t H,
                       int64_t I, int64_t Is) {
    const size_t es = dtype_size(dtype);
    MoeCarve c;
    size_t at = 0;
    auto take = [&at](size_t bytes) {
      const size_t o = at;
      at = (at + bytes + 255) / 256 * 256;
      return o;
    };
    const auto P = static_cast<size_t>(T * K);
    const auto t = static_cast<size_t>(T);
    c.logits = take(sizeof(float) * t * static_cast<size_t>(E));
    c.ids = take(sizeof(int32_t) * P);
    c.weights = take(sizeof(float) * P);
    c.pos = take(sizeof(int32_t) * P);
    c.rows = take(sizeof(int32_t) * P);
    c.offsets = take(sizeof(int32_t) * static_cast<size_t>(El + 1));
    c.tiles = take(sizeof(int32_t) * static_cast<size_t>(El + 1));
    c.act = take(es * P * static_cast<size_t>(I));
    c.y = take(es * P * static_cast<size_t>(H));
    c.sh_gate_up = take(es * t * 2 * static_cast<size_t>(Is));
    c.sh_act = take(es * t * static_cast<size_t>(Is));
    c.sh_out = take(Is > 0 ? es * t * static_cast<size_t>(H) : 0);
    c.bytes = at;
    return c;
  }
};

}  // namespace tessera
