// The mixture-of-experts MLP of Mixtral, Qwen2-MoE and Qwen3-MoE on the GPU, on one tensor-
// parallel rank's slices of the experts; kernels/cpu/moe.h (transformers' *SparseMoeBlock) is
// the oracle. Two paths, chosen per call from the host-known token count, both without a host
// synchronisation (so a decode step is captured whole in a CUDA graph):
//
//   grouped (prefill-sized):
//     logits  = x · routerᵀ                    cuBLASLt, fp32 out (rounded to the run dtype, as the
//                                              gate Linear's output is)
//     route   softmax (fp32), top-k, renormalise  one warp per token        -> ids, weights
//     permute counts per expert, offsets by prefix sum, each (token, slot) its row in the
//             expert-sorted order, and each expert's first 64-row tile      one block
//     gate_up for every expert in ONE launch: row p of the sorted order reads x[token of p]
//             (the gather is fused into the GEMM's loads), tensor cores (mma.sync m16n8k16,
//             bf16/fp16 in, fp32 accumulate), SiLU-and-mul in the epilogue  -> act [P, inter]
//     down    the same grouped GEMM over act                               -> y   [P, hidden]
//     combine out[t] = Σ_k weight · y[row of (t, k)] (+ sigmoid(x·shared_gateᵀ) · shared(x))
//   GEMV (decode-sized: tokens · top_k <= kMoeGemvMaxPairs): no permutation; each (token, slot)
//     pair reads only its own expert's rows, so a batch-1 step reads top_k experts from HBM;
//     the down projection and the combine are one kernel (no y rows), and the routing's,
//     gate_up's and down's launches overlap the kernel before (programmatic dependent launch).
//
// Rounding follows transformers in bf16/fp16: the gate and up outputs, silu(gate), the product,
// the down output, each routing weight and each product weight · y are rounded to the run dtype,
// and the weighted rows are summed in expert order in the run dtype (index_add_ into a bf16
// tensor); the shared expert's output and its gate likewise. Under tensor parallelism `out` is
// this rank's partial sum (the router is replicated, so every rank routes alike), all-reduced by
// the caller where the dense MLP's down projection is. With expert parallelism (the rank holds
// whole experts [expert_begin, expert_begin + local_experts)) slots routed elsewhere add nothing
// here; their rank adds them, and the same all-reduce sums the ranks.
//
// Ties in the router: equal probabilities are taken lowest expert index first (the CPU
// reference's order; torch.topk does not specify one, and random weights never tie).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/status.h"
#include "common/tensor.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/gemv.h"

namespace tessera::cuda {

// The decode path's bound: steps with at most this many (token, slot) pairs take the GEMV path.
inline constexpr int64_t kMoeGemvMaxPairs = 64;
// Rows of one tile of the grouped GEMM (each expert's rows start a new tile).
inline constexpr int64_t kMoeTileRows = 64;

enum class MoePath { kAuto, kGrouped, kGemv };

// Expert balance: counts[e] += the number of (token, slot) pairs routed to expert e, for the
// tokens t with rows[t] >= 0 (rows null: every token) and the local experts [expert_begin,
// expert_begin + local_experts) only. Atomic adds on the device: graph-capturable, no host
// synchronisation.
struct MoeCount {
  unsigned long long* counts = nullptr;  // [num_experts] (global expert index); null: none
  // [tokens] or null; the host's (copied before the step's kernels: the routing reads it before
  // its PDL wait); a row < 0 is not counted.
  const int64_t* rows = nullptr;
  int64_t expert_begin = 0;
  int64_t local_experts = 0;
};

// Router: probs = softmax(logits rounded to logits_dtype) in fp32; the top_k of each token,
// highest first (ties: lower index); weights = their probs, divided by their sum when
// `renormalize`. logits_dtype kBF16 / kF16: the gate Linear's output as a tensor of the run
// dtype (transformers), kF32: as given.
//   logits:  [tokens, experts] fp32
//   ids:     [tokens, top_k] int32 (out);  weights: [tokens, top_k] fp32 (out)
// experts <= 4096, top_k in [1, min(experts, 32)]. A token with NaN logits gets index `experts`
// (no expert: every path skips it) in the slots no real probability fills.
// With count.counts set, the routings are also counted as moe_count_experts does (in the same
// kernel: a decode step's MoE layer has one launch less).
Status moe_route(const float* logits, DType logits_dtype, int64_t tokens, int64_t experts,
                 int64_t top_k, bool renormalize, int32_t* ids, float* weights, cudaStream_t stream,
                 const MoeCount& count = MoeCount{});

// counts the routings of `ids` (moe_route's: [tokens, top_k] int32) into count.counts.
Status moe_count_experts(const int32_t* ids, int64_t tokens, int64_t top_k, const MoeCount& count,
                         cudaStream_t stream);

// Sorting of the (token, slot) pairs by expert, for this rank's experts [expert_begin,
// expert_begin + local_experts). All device arrays; written by moe_permute.
struct MoePermutation {
  int32_t* offsets = nullptr;  // [local_experts + 1]: expert e's rows are [offsets[e], [e + 1])
  int32_t* tiles = nullptr;    // [local_experts + 1]: expert e's kMoeTileRows-row tiles start at
                               // tiles[e]; tiles[local_experts] tiles in all
  int32_t* rows = nullptr;     // [tokens * top_k]: the token of each sorted row (first offsets[E])
  int32_t* pos = nullptr;      // [tokens * top_k]: the sorted row of pair (t, k); -1: not local
};
//   ids: [tokens, top_k] int32 (moe_route's). Rows of one expert come in no fixed order (each
//   row's result does not depend on its neighbours, so outputs are deterministic). local_experts
//   <= 4096.
Status moe_permute(const int32_t* ids, int64_t tokens, int64_t top_k, int64_t expert_begin,
                   int64_t local_experts, const MoePermutation& perm, cudaStream_t stream);

// One layer's expert weights on this rank, stacked, in the run dtype.
struct MoeExperts {
  const void* gate_up = nullptr;  // [local_experts][2 * inter][hidden]: gate rows, then up rows
  const void* down = nullptr;     // [local_experts][hidden][inter]
  int64_t expert_begin = 0;
  int64_t local_experts = 0;
  int64_t hidden = 0;  // multiple of 8
  int64_t inter = 0;   // this rank's width of each expert, multiple of 8
};

// act[p] = round(round(silu(g)) * u) with g | u = round(x[rows[p]] · gate_upᵀ of p's expert):
// the grouped GEMM over every local expert in one launch (max_rows: tokens * top_k, bounds the
// grid; the real row counts are read on the device).
//   x: [tokens, hidden] dtype;  act: [max_rows, inter] dtype (rows past offsets[E] untouched)
Status moe_grouped_gate_up(DType dtype, const void* x, const MoeExperts& w,
                           const MoePermutation& perm, int64_t max_rows, void* act,
                           cudaStream_t stream);
// y[p] = round(act[p] · downᵀ of p's expert), one launch.
//   act: [max_rows, inter] dtype;  y: [max_rows, hidden] dtype
Status moe_grouped_down(DType dtype, const void* act, const MoeExperts& w,
                        const MoePermutation& perm, int64_t max_rows, void* y, cudaStream_t stream);

// The GEMV path's tiles: gate_up's outputs per warp (each a gate and an up row) and the 16-byte
// pieces of each row a lane loads before it uses the first; down's rows of one expert per warp
// and its pieces likewise. moe_forward takes MoeArgs::gemv_tiles (the defaults: moe.cu says
// why); moe_bench compares the others (gate_up 2x1, 2x2, 2x4, 1x4, 1x8; down 8x1, 8x2,
// 8x3, 4x1, 4x3). Every tile gives the same bits.
struct MoeGemvTiles {
  int gate_up_outs = 2;
  int gate_up_unroll = 1;
  int down_rows = 8;
  int down_unroll = 2;
};

// The decode path. gate_up: pair p = t * top_k + k computes with expert ids[p] only (a pair
// whose expert is not local is skipped).
//   x: [tokens, hidden];  ids: [tokens, top_k];  act: [tokens * top_k, inter]  (dtype)
Status moe_gemv_gate_up(DType dtype, const void* x, const int32_t* ids, int64_t tokens,
                        int64_t top_k, const MoeExperts& w, void* act, cudaStream_t stream,
                        const MoeGemvTiles& tiles = {});
// down fused with the combine: out[t] = what moe_combine gives for y[t * top_k + k] =
// round(act[t * top_k + k] · down of expert ids[t, k]ᵀ), without storing y. It reads `ids` and
// `weights` before the kernel launched before it on the stream has finished: that kernel must
// be moe_gemv_gate_up (which waits for every earlier kernel before it lets this one start), and
// the ids must come from a kernel before that.
//   act: [tokens * top_k, inter];  x, shared_gate, shared_out, out: as moe_combine's
Status moe_gemv_down_combine(DType dtype, const void* act, const int32_t* ids, const float* weights,
                             int64_t tokens, int64_t top_k, const MoeExperts& w, const void* x,
                             const void* shared_gate, const void* shared_out, void* out,
                             cudaStream_t stream, const MoeGemvTiles& tiles = {});

// out[t] = Σ over t's local slots in expert order of round(round(w) · y[row]) summed in dtype,
// then (shared_out non-null) + round(round(sigmoid(round(x[t] · shared_gate))) · shared_out[t]).
//   y: [*, hidden] dtype, row of pair (t, k) = pos[t * top_k + k] (pos null: t * top_k + k)
//   ids, weights: [tokens, top_k];  x: [tokens, hidden] dtype (read with shared_out only)
//   shared_gate: [hidden] dtype;  shared_out: [tokens, hidden] dtype or null;
//   out: [tokens, hidden] dtype, must not overlap y, x or shared_out
Status moe_combine(DType dtype, const void* y, const int32_t* pos, const int32_t* ids,
                   const float* weights, int64_t tokens, int64_t top_k, int64_t hidden,
                   int64_t expert_begin, int64_t local_experts, const void* x,
                   const void* shared_gate, const void* shared_out, void* out, cudaStream_t stream);

// A whole MoE layer.
struct MoeArgs {
  DType dtype = DType::kBF16;
  int64_t tokens = 0;
  int64_t num_experts = 0;  // the router's rows (all experts of the model)
  int64_t top_k = 0;
  bool renormalize = true;
  MoePath path = MoePath::kAuto;
  MoeGemvTiles gemv_tiles;       // the GEMV path's tiles (moe_bench compares them; same bits)
  const void* x = nullptr;       // [tokens, hidden] dtype (the normed activations)
  const void* router = nullptr;  // [num_experts, hidden] dtype
  // Batch-1 decode without a shared expert: the layer's "residual += proj; x = rms_norm" runs in
  // the router's GEMV (gemv_add_rms_norm, whose normed row is x); null: x is given.
  const GemvAddRmsNorm* norm = nullptr;
  MoeExperts experts;
  // Qwen2-MoE's shared expert (null: none): a dense MLP run through `gemm`.
  const void* shared_gate_up = nullptr;      // [2 * shared_inter, hidden] dtype
  const void* shared_down = nullptr;         // [hidden, shared_inter] dtype
  const void* shared_expert_gate = nullptr;  // [hidden] dtype
  int64_t shared_inter = 0;
  void* workspace = nullptr;  // moe_workspace_bytes(...) of device memory
  uint64_t workspace_bytes = 0;
  void* out = nullptr;  // [tokens, hidden] dtype
  // Expert balance (null: not counted): counts[e] += the routings of rows whose count_rows
  // value is >= 0 to each local expert e (moe_count_experts, after the router).
  unsigned long long* expert_counts = nullptr;  // [num_experts]
  const int64_t* count_rows = nullptr;          // [tokens] (the step's KV slots: padding is -1)
};

// Device scratch moe_forward needs for up to `max_tokens` tokens.
uint64_t moe_workspace_bytes(DType dtype, int64_t max_tokens, int64_t num_experts, int64_t top_k,
                             int64_t local_experts, int64_t hidden, int64_t inter,
                             int64_t shared_inter);

// The layer: route, then the GEMV or grouped path (MoeArgs::path; kAuto: GEMV when tokens *
// top_k <= kMoeGemvMaxPairs), the shared expert, the combine. INVALID_ARGUMENT for shapes the
// kernels do not take (named), a workspace too small.
Status moe_forward(const MoeArgs& args, Gemm& gemm, cudaStream_t stream);

}  // namespace tessera::cuda
