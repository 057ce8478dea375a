// The mixture-of-experts MLP of Mixtral, Qwen2-MoE and Qwen3-MoE, as transformers' *SparseMoeBlock
// computes it, on one tensor-parallel rank's slices of the experts:
//   probs   = softmax(x · routerᵀ) in fp32                     (router: no bias)
//   top     = the top_k experts of each token (ties: the lower index), weights = their probs,
//             divided by their sum when `renormalize` (Mixtral always; Qwen norm_topk_prob)
//   y       = Σ_top weight · down_e(silu(gate_e(x)) * up_e(x))
//           + sigmoid(x · shared_gateᵀ) · down_s(silu(gate_s(x)) * up_s(x))   (Qwen2-MoE)
// Tokens are grouped by expert, and only the chosen experts run (transformers' loop over the
// experts' one-hot mask; the sum is taken in expert order, as its index_add_ does). Under tensor
// parallelism each rank holds every expert's rows of gate/up and columns of down, so y is this
// rank's partial sum (the router and the shared gate are replicated, so every rank routes alike);
// the caller all-reduces it as it does the dense MLP's down projection.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "common/status.h"
#include "common/tensor.h"
#include "kernels/cpu/cpu_context.h"

namespace tessera::cpu {

// One expert's projections (nn.Linear layout, F32 / F16 / BF16), this rank's slices.
struct MoeExpert {
  TensorView gate;  // [inter, hidden]
  TensorView up;    // [inter, hidden]
  TensorView down;  // [hidden, inter]
};

struct MoeLayer {
  TensorView router;               // [experts, hidden]: every expert of the model
  std::vector<MoeExpert> experts;  // the ones held here, the same inter each: all of them, or
                                   // (expert parallel) experts[i] is expert expert_begin + i
  int64_t expert_begin = 0;
  int64_t top_k = 0;               // 1 .. experts
  bool renormalize = true;
  MoeExpert shared;        // data == null: no shared expert
  TensorView shared_gate;  // [1, hidden] (with `shared`)
};

// The routing of each token: top_k (expert, weight) pairs, highest probability first.
struct MoeRoute {
  std::vector<int32_t> expert;  // [tokens, top_k]
  std::vector<float> weight;    // [tokens, top_k]
};
//   x: [tokens, hidden] fp32
Expected<MoeRoute> moe_route(CpuContext& ctx, const MoeLayer& layer, std::span<const float> x);

//   x: [tokens, hidden] fp32;  y: [tokens, hidden] fp32 (overwritten), must not overlap x
// `routed`, when given, gains each expert's routings (router rows entries).
Status moe(CpuContext& ctx, const MoeLayer& layer, std::span<const float> x, std::span<float> y,
           std::vector<int64_t>* routed = nullptr);

// moe()'s parts, for expert parallelism, where the routed rows travel to the rank holding their
// experts and back:
//   moe_experts: y[t] = Σ weight · expert(x[t]) over the slots of row t (route: [tokens, top_k],
//     expert ids of the model) whose expert this layer holds (others are skipped; an id < 0 is an
//     empty slot), in expert order as moe() sums; y overwritten.
//   moe_shared: y += Qwen2-MoE's gated shared expert of x (nothing when the layer has none).
Status moe_experts(CpuContext& ctx, const MoeLayer& layer, std::span<const float> x,
                   const MoeRoute& route, std::span<float> y);
Status moe_shared(CpuContext& ctx, const MoeLayer& layer, std::span<const float> x,
                  std::span<float> y);

}  // namespace tessera::cpu
