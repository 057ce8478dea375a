// The single weight table of a model and each rank's share of it under tensor x pipeline
// parallelism. Everything that names, checks, shards, binds or uploads a checkpoint tensor
// reads this table: make-model writes expected_weights(), the actors bind and upload
// LayerPlan::weights, the planner sizes ranks with it. Adding an architecture's tensor is one
// row here.
//
// Sharding follows Megatron / vLLM:
//   - column-parallel (split the output rows): q, k, v (and their biases), gate, up; a fused
//     qkv_proj / gate_up_proj (Phi-3) part by part, each rank holding its rows of every part;
//   - row-parallel (split the input columns): o_proj, down_proj — each rank's output is a partial
//     sum that the tensor-parallel group all-reduces; o_proj's bias is added by tp rank 0 only;
//   - vocab-parallel: embedding and lm_head rows, the vocabulary padded to a multiple of T; the
//     embedding is all-reduced (each rank looks up the ids in its range), the logits all-gathered;
//   - replicated: the norms;
//   - mixture of experts (vLLM's TP MoE): every rank holds every expert's slice, each expert's
//     gate/up split by rows and down by columns like the dense MLP, the shared expert likewise;
//     the router and the shared expert's gate are replicated; an MoE layer's output is a partial
//     sum all-reduced where the dense MLP's down projection is.
// KV heads are split when T divides them; when T > kv heads (and kv heads divide T) each rank
// keeps the one KV head its query heads read, and T / kv_heads ranks share it (vLLM's rule).
// Layers go to pipeline stages evenly (the first stages take the remainder) or as
// --pipeline-layer-partition says; stage 0 holds the embedding, the last stage the final norm
// and lm_head.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "common/checkpoint/model_config.h"
#include "common/status.h"

namespace tessera {

// How make-model initialises a tensor.
enum class WeightRole { kEmbedding, kLinear, kBias, kNorm };

// Which tensor of the architecture a checkpoint tensor is.
// clang-format off
enum class WeightKind : uint8_t {
  kEmbed, kQ, kK, kV, kO, kQBias, kKBias, kVBias, kOBias, kQNorm, kKNorm,
  kGate, kUp, kDown, kInputNorm, kPostNorm, kFinalNorm, kLmHead,
  // Mixture of experts: the router ([experts, hidden]), an expert's projections (WeightSpec::
  // expert says which), the shared expert's (Qwen2-MoE) and its sigmoid gate ([1, hidden]).
  kRouter, kExpertGate, kExpertUp, kExpertDown, kSharedGate, kSharedUp, kSharedDown,
  kSharedExpertGate,
  // Gemma's norms around the MLP (pre_feedforward_layernorm, post_feedforward_layernorm).
  kPreFfNorm, kPostFfNorm,
  // Phi-3's fused checkpoint tensors: self_attn.qkv_proj ([q | k | v] rows) and mlp.gate_up_proj
  // ([gate | up] rows). A rank's LayerPlan holds them as shards of kinds kQ, kK, kV and kGate,
  // kUp, each [begin, end) rows of the fused tensor (vLLM's QKVParallelLinear /
  // MergedColumnParallelLinear: every part column-split on its own).
  kQKV, kGateUp,
};
// clang-format on

// How a tensor is divided among the tensor-parallel ranks: which features of its layer each
// rank holds (WeightSpec::dim and unit say where they are in a packed tensor).
enum class Split : uint8_t {
  kNone,     // every rank holds all of it
  kRows,     // the output features: column-parallel layers
  kColumns,  // the input features: row-parallel layers
  kVocab,    // the vocabulary (embedding, lm_head rows)
};

// Which tensor of a linear layer: a plain checkpoint stores `weight`; a quantized one the
// tensors its format names (common/checkpoint/quantization.h).
enum class WeightPart : uint8_t {
  kWeight,
  kQWeight,
  kQZeros,
  kScales,
  kGIdx,
  kWeightScale,
  kInputScale,
};

// One tensor of a Hugging Face checkpoint: its exact HF name and shape (linear weights are
// [out_features, in_features], as nn.Linear stores them), what it is and how it shards.
struct WeightSpec {
  std::string name;
  std::vector<int64_t> shape;
  WeightRole role = WeightRole::kLinear;  // how make-model initialises it
  WeightKind kind = WeightKind::kEmbed;
  int64_t layer = -1;  // -1 for model-wide tensors
  Split split = Split::kNone;
  int64_t expert = -1;  // kExpert*: the expert's index
  WeightPart part = WeightPart::kWeight;
  // The dtype the format fixes (I32 for packed ints and g_idx, F8_E4M3 for FP8 weights); unset:
  // any float dtype (the checkpoint's).
  std::optional<DType> dtype;
  // Where `split` cuts: features [begin, end) of the layer are indices [begin / unit,
  // end / unit) of dimension `dim` (a packed tensor holds 32 / bits features per int32, a
  // scale one group's).
  int dim = 0;
  int64_t unit = 1;
  // The per-tensor / per-channel scales of FP8 checkpoints come as [], [1], [out] or [out, 1]:
  // only the element count (shape's) is checked.
  bool any_scale_shape = false;
};

// The GEMM a tensor is fused into when uploaded to a GPU: "qkv" (q, k, v and their biases stacked
// along the output dimension), "gate_up", or "" (on its own).
const char* fused_group(WeightKind kind);

// Every tensor a Hugging Face checkpoint of `config` holds, in the model's state_dict order:
// model.embed_tokens.weight; per layer self_attn.{q,k,v,o}_proj.weight (+ .bias where the config
// has biases), self_attn.{q,k}_norm.weight (qk_norm), mlp.{gate,up,down}_proj.weight,
// input_layernorm.weight, post_attention_layernorm.weight; model.norm.weight; lm_head.weight
// unless tie_word_embeddings. An MoE layer (config.moe.sparse_layer) has instead of the dense
// MLP Mixtral's block_sparse_moe.gate.weight and block_sparse_moe.experts.N.{w1,w2,w3}.weight
// (gate, down, up), or Qwen's mlp.gate.weight, mlp.experts.N.{gate,up,down}_proj.weight and
// (Qwen2-MoE) mlp.shared_expert.{gate,up,down}_proj.weight, mlp.shared_expert_gate.weight. A
// quantized checkpoint (config.quant) stores each linear layer it quantizes as its format's tensors
// instead of .weight (qweight, qzeros, scales, g_idx; or an FP8 weight with weight_scale and
// input_scale). Precondition: `config` passed parse_model_config's validation.
std::vector<WeightSpec> expected_weights(const ModelConfig& config);

// Where a rank sits: rank = pp_rank * tp_size + tp_rank.
struct ParallelConfig {
  int tp_size = 1;
  int pp_size = 1;
  int tp_rank = 0;
  int pp_rank = 0;
  std::vector<int64_t> layer_partition;  // layers per stage; empty = even
  // --enable-expert-parallel: each tensor-parallel rank holds whole experts of every MoE layer
  // (the expert-parallel group is the tensor-parallel group, vLLM's EP without data
  // parallelism) instead of every expert's slice; tokens reach their experts by all-to-all.
  // Always the EngineSpec's enable_expert_parallel (EngineSpec::shape()).
  bool expert_parallel = false;

  int rank() const { return pp_rank * tp_size + tp_rank; }
  int world_size() const { return tp_size * pp_size; }
};

// OK when `tp` splits the model: attention heads divisible by tp, KV heads split or replicated
// evenly (see the file comment), intermediate_size divisible by tp (when a dense layer exists),
// an MoE model's moe_intermediate_size and shared_expert_intermediate_size too; for a quantized
// checkpoint every rank's share of a packed dimension whole int32s, and of a row-parallel layer's
// inputs whole scale groups (vLLM's rules). INVALID_ARGUMENT otherwise, naming the numbers and the
// valid -tp values for the model.
// With `expert_parallel` the experts are not split, so their widths need not divide; the model
// must have experts, at least `tp` of them.
Status check_tensor_parallel(const ModelConfig& config, int64_t tp, bool expert_parallel = false);

// The -tp values check_tensor_parallel accepts, ascending, up to `max`.
std::vector<int64_t> valid_tensor_parallel_sizes(const ModelConfig& config, int64_t max,
                                                 bool expert_parallel = false);

// The experts rank `tp_rank` of `tp` holds whole under expert parallelism: [first, first + n).
std::pair<int64_t, int64_t> expert_range(int64_t num_experts, int64_t tp, int64_t tp_rank);

// One rank's slice of one tensor: [begin, end) along the tensor's split dimension (the whole
// tensor for Split::kNone). A part of a fused tensor (kQKV, kGateUp) is a shard of the part's
// kind (spec.kind kQ, kK, kV, kGate, kUp; spec.name and shape the fused tensor's) whose [begin,
// end) are rows of the fused tensor. For Split::kVocab, rows past the real vocabulary (padding)
// are not in the checkpoint: `end` stops at the vocabulary and the rank pads.
struct WeightShard {
  WeightSpec spec;
  int64_t begin = 0;
  int64_t end = 0;
  // The slice's shape: spec.shape with the split dimension cut to end - begin.
  std::vector<int64_t> shape() const;
};

// The bytes of one rank's step buffers, as the CUDA backend allocates them
// (CudaModel::allocate_buffers sizes each from here) and the planner counts them: residual,
// hidden and proj [tokens][hidden], q|k|v [tokens][qkv], q and attention output [tokens][q],
// gate|up [tokens][2 x intermediate] and the MLP activation [tokens][intermediate] in the run
// dtype; on the last stage the logit rows [seqs][hidden] and fp32 logits [seqs][vocab], under TP
// the vocabulary-parallel logits [tp][seqs][vocab_shard] fp32; under TP the sampled tokens
// [(1 + tp) x seqs] int32.
struct StepBuffers {
  uint64_t residual = 0, hidden = 0, qkv = 0, q = 0, attn = 0, proj = 0, gate_up = 0, act = 0;
  uint64_t logit_rows = 0, logits = 0, shard_logits = 0, sampled_tokens = 0;
  uint64_t total() const {
    return residual + hidden + qkv + q + attn + proj + gate_up + act + logit_rows + logits +
           shard_logits + sampled_tokens;
  }
};

struct LayerPlan {
  ParallelConfig parallel;
  int64_t layer_begin = 0;  // this stage's layers: [layer_begin, layer_end)
  int64_t layer_end = 0;
  bool first_stage = true;  // holds the embedding
  bool last_stage = true;   // holds the final norm and lm_head
  int64_t heads = 0;        // query heads on this rank
  int64_t head_begin = 0;   // the first of them (model numbering)
  int64_t kv_heads = 0;     // KV heads on this rank
  int64_t kv_head_begin = 0;
  int64_t intermediate = 0;  // MLP width on this rank
  int64_t intermediate_begin = 0;
  int64_t moe_intermediate = 0;  // each expert's MLP width on this rank (MoE models)
  int64_t moe_intermediate_begin = 0;
  // The experts of each MoE layer on this rank: [expert_begin, expert_begin + experts). All of
  // them (sliced) without expert parallelism; with it, whole experts, num_experts / tp_size per
  // rank and the first num_experts % tp_size ranks one more (vLLM's linear placement).
  int64_t expert_begin = 0;
  int64_t experts = 0;
  int64_t shared_intermediate = 0;  // the shared expert's width on this rank (Qwen2-MoE)
  int64_t shared_intermediate_begin = 0;
  int64_t vocab_padded = 0;  // the vocabulary rounded up to a multiple of tp_size
  int64_t vocab_shard = 0;   // vocab_padded / tp_size: rows of embedding / lm_head per rank
  int64_t vocab_begin = 0;   // this rank's first vocabulary row
  int64_t vocab_rows = 0;    // of those, rows that exist (the rest is padding)
  bool o_bias = false;       // this rank adds o_proj's bias (tp rank 0 of a model that has one)
  std::vector<WeightShard> weights;  // this rank's tensors, in expected_weights() order

  int64_t num_layers() const { return layer_end - layer_begin; }
  // Bytes of this rank's shards, float tensors in `dtype`, packed ones as stored, linear
  // layers FP8-quantized at load when `run` is online FP8 (embedding and lm_head counted once
  // when tied).
  uint64_t weight_bytes(DType dtype, const QuantConfig& run = {}) const;
  // The device workspace of this rank's quantized linear layers beside the step buffers, as the
  // CUDA backend allocates it for steps of up to `max_tokens` tokens, `quant` being the run's
  // (resolve_quantization): int4 (AWQ, GPTQ) — a prefill dequantizes the largest layer (q|k|v,
  // gate|up or o) into it in `dtype`; FP8 — the quantized input rows and their scales, and the
  // FP8 GEMM's own memory (kFp8GemmDeviceBytes); 0 for plain weights. The planner's estimate
  // and the backend's fit check both count this.
  uint64_t quantized_workspace_bytes(const ModelConfig& config, const QuantConfig& quant,
                                     DType dtype, int64_t max_tokens) const;
  // The MoE layers' device scratch for steps of up to `max_tokens` tokens in `dtype`
  // (common/checkpoint/moe_carve.h), 0 for a dense model: counted by the planner's estimate and
  // allocated by the CUDA backend.
  uint64_t moe_workspace_bytes(const ModelConfig& config, DType dtype, int64_t max_tokens) const;
  // This rank's step buffers for steps of up to `max_tokens` tokens and `max_seqs` sequences.
  StepBuffers step_buffers(const ModelConfig& config, DType dtype, int64_t max_tokens,
                           int64_t max_seqs) const;
  // What the CUDA backend allocates for steps beside the weights and the KV cache: the step
  // buffers, the quantized and MoE workspaces and kActivationSlackBytes of small buffers (step
  // metadata, attention splits). Counted by the planner's estimate and the backend's fit check.
  static constexpr uint64_t kActivationSlackBytes = 64ull << 20;
  uint64_t activation_bytes(const ModelConfig& config, const QuantConfig& quant, DType dtype,
                            int64_t max_tokens, int64_t max_seqs) const;
  // Rows of this rank's q|k|v projection: (heads + 2 kv_heads) x head_dim.
  int64_t qkv_rows(const ModelConfig& config) const {
    return (heads + 2 * kv_heads) * config.head_dim;
  }

  // The plan of one rank. INVALID_ARGUMENT, naming the numbers and what would work, when the
  // model cannot be split so (heads not divisible by tp_size, KV heads neither divisible by nor
  // dividing it, intermediate size not divisible, more stages than layers, a partition that
  // does not add up to the layers).
  static Expected<LayerPlan> make(const ModelConfig& config, const ParallelConfig& parallel);
};

// The layers of each pipeline stage: [begin, end) pairs. Even by default, the first
// num_layers % pp_size stages one layer more; `partition` (layers per stage) when given.
Expected<std::vector<std::pair<int64_t, int64_t>>> stage_layers(
    int64_t num_layers, int pp_size, const std::vector<int64_t>& partition);

// The dtype the model runs in ("auto" = the checkpoint's; a float32 checkpoint runs in
// bfloat16 on the GPU), INVALID_ARGUMENT for an unknown name.
Expected<DType> resolve_dtype(const std::string& name, DType checkpoint_dtype, bool gpu);

}  // namespace tessera
