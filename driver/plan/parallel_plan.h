// Tensor x pipeline parallel plans: the whole T x P picture of a model (every rank's layers,
// heads, MLP columns, vocabulary rows and weight bytes) and how much of each GPU that leaves for
// the KV cache. Pure arithmetic on a ModelConfig: no cluster, no files, no GPU.
//
// Each rank's share comes from common/checkpoint/layer_plan.h (LayerPlan::make), the one table
// the actors load from, so what is planned here is what runs. In short (vLLM's rules):
//   - q/k/v, gate/up are column-parallel, o_proj and down_proj row-parallel; norms replicated;
//     o_proj's bias is held by TP rank 0 only;
//   - KV heads split when num_kv_heads % T == 0; when T > num_kv_heads and T % num_kv_heads == 0
//     each rank keeps one KV head and T / num_kv_heads consecutive ranks share it (vLLM's
//     num_kv_head_replicas); anything else is refused;
//   - the embedding and lm_head are vocab-parallel: the vocabulary is padded up to a multiple of
//     T and rank t holds rows [t*V'/T, (t+1)*V'/T), the padding rows (zeros) on the last ranks;
//   - layers go over the P stages evenly, the first num_layers % P stages one layer more (vLLM
//     instead gives the remainder to the stages before the last: layer_plan.h's choice is kept so
//     the plan matches what loads), or as --pipeline-layer-partition says; stage 0 holds the
//     embedding, the last stage the final norm and lm_head (with tied embeddings, the embedding
//     again: it is the lm_head).
// Rank numbering: rank = pp_rank * T + tp_rank, so a TP group is a run of T consecutive ranks.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "common/checkpoint/layer_plan.h"
#include "common/checkpoint/model_config.h"
#include "common/engine_spec.h"
#include "common/kv_cache_dtype.h"
#include "common/load_spec.h"
#include "common/status.h"
#include "common/tensor.h"

namespace tessera {

// What one rank holds and computes: its LayerPlan (its place, layers, heads, KV heads, MLP
// columns, vocabulary rows and tensors; ranges half-open in the full model) and what the planner
// adds to it.
struct RankPlan {
  LayerPlan shard;  // LayerPlan::make's, for this rank's shard.parallel
  // The bytes its tensors take on the device in the run dtype: LayerPlan::weight_bytes (the
  // shards as the checkpoint holds them, a tied embedding once) plus the zero padding rows of the
  // vocab-parallel tensors it holds.
  uint64_t weight_bytes = 0;
  uint64_t padding_bytes = 0;      // of which vocab padding
  int64_t kv_elems_per_token = 0;  // 2 (K, V) x its layers x kv_heads x head_dim

  int64_t rank() const { return shard.parallel.rank(); }  // pp_rank * T + tp_rank
  // Holds model.embed_tokens: stage 0 and, with tied embeddings, the last stage (its lm_head).
  bool embedding() const;
};

struct ParallelPlan {
  int64_t tp = 1;                     // T
  int64_t pp = 1;                     // P
  int64_t world = 1;                  // T * P
  DType dtype = DType::kBF16;         // the run dtype: weights and KV cache
  int64_t kv_replicas = 1;            // ranks sharing each KV head (1 = KV heads split)
  int64_t padded_vocab = 0;           // vocab_size rounded up to a multiple of T
  std::vector<int64_t> stage_layers;  // layers per stage, P entries
  std::vector<RankPlan> ranks;        // world entries; ranks[r].rank() == r

  // Precondition: pp_rank < pp, tp_rank < tp.
  const RankPlan& at(int64_t pp_rank, int64_t tp_rank) const {
    return ranks[static_cast<size_t>(pp_rank * tp + tp_rank)];
  }
};

// check_tensor_parallel and valid_tensor_parallel_sizes: common/checkpoint/layer_plan.h.

// The plan for `parallel`'s tp_size x pp_size (and layer_partition; its tp_rank and pp_rank
// are not read) with weights and KV cache in `dtype` (packed tensors as stored; linear layers
// in FP8 when `run` quantizes at load). Errors: check_tensor_parallel's, then LayerPlan::make's
// (more stages than layers, a partition that does not add up: INVALID_ARGUMENT naming the flag
// and the numbers).
Expected<ParallelPlan> make_parallel_plan(const ModelConfig& config, const ParallelConfig& parallel,
                                          DType dtype, const QuantConfig& run = {});

// Bytes of every tensor of the checkpoint, each once and unpadded: float tensors in `dtype`,
// packed ones as stored, linear layers in FP8 when `run` quantizes at load.
uint64_t model_weight_bytes(const ModelConfig& config, DType dtype, const QuantConfig& run = {});

// "KV heads: 8 split over -tp 2, 4 per rank" or "KV heads: 2 replicated over -tp 4: KV head 0 on
// TP ranks 0-1, KV head 1 on TP ranks 2-3".
std::string describe_kv_heads(const ModelConfig& config, const ParallelPlan& plan);

// The run dtype: resolve_dtype (common/checkpoint/layer_plan.h), as the actors resolve it.

// "bfloat16", "float16", "float32".
const char* run_dtype_name(DType dtype);

// ---- memory -------------------------------------------------------------------------------

// What a GPU has: total bytes and bytes already in use by anything (other processes).
struct GpuMemory {
  uint64_t total = 0;
  uint64_t used = 0;
};

// One rank's memory. GPU ranks: budget = utilization x total, or what others leave free when
// that is less (vLLM's per-instance rule: two replicas at 0.45 share a GPU); weights +
// activations come off it and the KV cache gets the rest, in whole blocks.
struct RankMemory {
  bool gpu = true;  // false: a CPU rank, sized per sequence (kv_tokens = max_model_len)
  uint64_t total = 0;
  uint64_t budget = 0;
  uint64_t in_use = 0;
  uint64_t weights = 0;
  // Estimate: activation buffers for max(max_num_batched_tokens, max_num_seqs) tokens of this
  // rank's shard widths, fp32 logits for max_num_seqs rows on the last stage (twice under TP,
  // as the backend allocates them), the quantized and MoE layers' workspaces
  // (LayerPlan::quantized_workspace_bytes, moe_workspace_bytes), fixed buffers
  // (64 MiB), the GEMM workspace (32 MiB), the CUDA context (512 MiB), CUDA graphs (512 MiB
  // unless enforce_eager) and communicator buffers (256 MiB when world > 1). The actor measures
  // the real figure with a profiling step; this is what planning can know ahead.
  uint64_t activations = 0;
  uint64_t kv_bytes_per_token = 0;  // kv_elems_per_token x the --kv-cache-dtype's size
  uint64_t kv_bytes = 0;            // what the KV cache gets (0 when nothing is left)
  int64_t kv_tokens = 0;            // kv_bytes / kv_bytes_per_token, down to whole blocks
};

struct MemoryPlan {
  EngineSpec engine;              // what it was sized for (resolve_lengths: lengths filled in)
  std::vector<RankMemory> ranks;  // index = rank
  int64_t kv_tokens = 0;          // the least over the ranks: every sequence lives on all of them
  int64_t limiting_rank = 0;      // the rank with that least
  double max_concurrency = 0;     // kv_tokens / max_model_len
  int64_t sequence_tokens = 0;    // what one sequence holds at once (kv_tokens_per_sequence)
  bool fits = false;              // every rank holds one sequence: kv_tokens >= sequence_tokens
};

// Sizes every rank. `gpus[r]` is rank r's GPU; nullopt = a CPU rank. Precondition: `engine`
// came from resolve_lengths, gpus.size() == plan.world.
MemoryPlan estimate_memory(const ModelConfig& config, const ParallelPlan& plan,
                           const std::vector<std::optional<GpuMemory>>& gpus,
                           const EngineSpec& engine);

// OK when plan.fits; else RESOURCE_EXHAUSTED naming the limiting rank (`rank_labels[r]`, e.g.
// "node-a GPU1", when given), its budget and where it goes, the tokens one sequence needs, and
// the flags that would help: a lower --max-model-len (the largest that fits), a higher
// --gpu-memory-utilization (the value that fits, when <= 1), more GPUs (-tp / -pp).
Status memory_status(const MemoryPlan& plan, const std::vector<std::string>& rank_labels = {});

// "12.34 GiB".
std::string format_gib(uint64_t bytes);
// "1,903,856".
std::string format_count(int64_t n);

}  // namespace tessera
