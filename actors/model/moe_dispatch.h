// Expert parallelism's MoE layer on the cpu backend (--enable-expert-parallel): each
// tensor-parallel rank holds whole experts (LayerPlan::expert_begin, experts), so a token's
// hidden state travels to the ranks holding its experts and their outputs travel back.
//
// Every rank enters with the same x (the tensor-parallel group's hidden states are replicated)
// and takes its own contiguous share of the tokens (rank r: rows [T r / R, T (r + 1) / R)):
//   1. routes them (the router is replicated, so any rank would choose alike);
//   2. dispatch: one all-to-all sends each such row once to each rank that holds one of its
//      experts, with the slots (expert id, weight) meant for that rank (DeepEP's per-rank
//      de-duplication: a row goes to a rank once however many of its experts live there);
//   3. the receiving rank runs its experts on what arrived (cpu::moe_experts), and the combine
//      all-to-all returns one weighted partial sum per row;
//   4. the rank adds the partial sums of its rows, in rank order, into y at those rows, and
//      leaves the other rows zero.
// y is then in the same partial-sum form as tensor-parallel MoE (plus the shared expert's
// tensor-parallel slice), so the caller's all-reduce, the one the dense MLP has, completes it.
// Traffic per rank and layer: about 2 x (T / R) x min(top_k, R) x hidden x 4 bytes each way,
// besides the all-reduce.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "actors/comm/communicator.h"
#include "common/status.h"
#include "kernels/cpu/cpu_context.h"
#include "kernels/cpu/moe.h"

namespace tessera {

// `layer` holds this rank's experts; `num_experts` is the model's. x, y: [tokens, hidden] fp32
// (y overwritten). `routed`, when given, gains the slots of this rank's share of the tokens per
// expert (num_experts entries): summed over the ranks, every token's top_k once.
Status moe_expert_parallel(cpu::CpuContext& ctx, const cpu::MoeLayer& layer, int64_t num_experts,
                           comm::Communicator& group, std::span<const float> x, std::span<float> y,
                           std::vector<int64_t>* routed = nullptr);

}  // namespace tessera
