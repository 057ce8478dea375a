// The forward pass of one rank, spelled once for every backend and every parallel layout:
//
//   first stage:  residual = embed(ids)                  [TP: vocabulary slices, all-reduced]
//   other stages: residual = recv from the stage before
//   per layer:    hidden = rms_norm(residual (+= proj)) · input_norm
//                 q, k, v = hidden · {q,k,v}_projᵀ (+ biases)     this rank's heads
//                 q, k = q/k norms, RoPE; k, v → paged KV cache
//                 attn = paged_attention(q, cache)
//                 proj = attn · o_projᵀ (+ bias)                  TP: partial sums, all-reduced
//                 hidden = rms_norm(residual += proj) · post_norm
//                 proj = (silu(hidden · gateᵀ) * (hidden · upᵀ)) · downᵀ   TP: all-reduced
//                        (an MoE layer: the routed experts' weighted sum, the same all-reduce)
//   last stage:   logits = rms_norm(residual += proj) · final_norm · lm_headᵀ   (sampled rows;
//                 TP: vocabulary slices, all-gathered)
//   other stages: send residual += proj to the stage after
// Gemma (ModelConfig::sandwich_norms): the embedding is scaled by sqrt(hidden), proj passes its
// post-attention / post-feed-forward norm before each `residual += proj` (after the all-reduce),
// and the MLP reads pre_feedforward_layernorm: the backend's ops do it, the loop is the same.
//
// `Ops` is a backend's operations over its own activation buffers for the current step (the cpu
// backend: host fp32; the cuda backend: device bf16/fp16 on its stream, so the whole call can be
// captured in a CUDA graph). Each returns a Status:
//   embed()                        residual = this rank's embedding rows of the step's ids
//   recv_hidden() / send_hidden()  the residual stream from / to the neighbouring stage
//   input_norm(i, add)             [residual += proj when add]; hidden = norm(residual)
//   qkv(i), rope_cache(i), attention(i), o_proj(i)
//   post_norm(i)                   residual += proj; hidden = norm(residual)
//   mlp(i)                         proj = MLP(hidden), or the MoE block in an MoE layer
//   all_reduce(buffer)             sum over the tensor-parallel group (no-op at tp_size 1)
//   add_residual()                 residual += proj
//   logits()                       final norm, lm_head, vocabulary all-gather
// where i is the stage-local layer index (0 .. plan.num_layers() - 1).
#pragma once

#include "common/checkpoint/layer_plan.h"
#include "common/status.h"

namespace tessera {

enum class Activation { kResidual, kProj };

template <class Ops>
Status run_stage(Ops& ops, const LayerPlan& plan) {
  const bool tp = plan.parallel.tp_size > 1;
  if (plan.first_stage) {
    TESSERA_RETURN_IF_ERROR(ops.embed());
    if (tp) TESSERA_RETURN_IF_ERROR(ops.all_reduce(Activation::kResidual));
  } else {
    TESSERA_RETURN_IF_ERROR(ops.recv_hidden());
  }
  for (int64_t i = 0; i < plan.num_layers(); ++i) {
    TESSERA_RETURN_IF_ERROR(ops.input_norm(i, /*add=*/i > 0));
    TESSERA_RETURN_IF_ERROR(ops.qkv(i));
    TESSERA_RETURN_IF_ERROR(ops.rope_cache(i));
    TESSERA_RETURN_IF_ERROR(ops.attention(i));
    TESSERA_RETURN_IF_ERROR(ops.o_proj(i));
    if (tp) TESSERA_RETURN_IF_ERROR(ops.all_reduce(Activation::kProj));
    TESSERA_RETURN_IF_ERROR(ops.post_norm(i));
    TESSERA_RETURN_IF_ERROR(ops.mlp(i));
    if (tp) TESSERA_RETURN_IF_ERROR(ops.all_reduce(Activation::kProj));
  }
  if (plan.last_stage) return ops.logits();
  TESSERA_RETURN_IF_ERROR(ops.add_residual());
  return ops.send_hidden();
}

}  // namespace tessera
