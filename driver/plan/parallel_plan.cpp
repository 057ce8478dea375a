#include "driver/plan/parallel_plan.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

namespace tessera {

namespace {

constexpr uint64_t kMiB = 1ull << 20;
constexpr uint64_t kGemmWorkspace = 32 * kMiB;  // cuBLASLt workspace
constexpr uint64_t kCudaContext = 512 * kMiB;   // context + library handles, before loading
constexpr uint64_t kGraphReserve = 512 * kMiB;  // CUDA graphs (cuda_model.cpp kGraphReserve)
constexpr uint64_t kCommReserve = 256 * kMiB;   // NCCL / custom all-reduce buffers

}  // namespace

std::string format_gib(uint64_t bytes) {
  char buf[48];
  std::snprintf(buf, sizeof(buf), "%.2f GiB", static_cast<double>(bytes) / (1ull << 30));
  return buf;
}

std::string format_count(int64_t n) {
  const std::string digits = std::to_string(n < 0 ? -n : n);
  std::string out = n < 0 ? "-" : "";
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out.push_back(',');
    out.push_back(digits[i]);
  }
  return out;
}

const char* run_dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kBF16:
      return "bfloat16";
    case DType::kF16:
      return "float16";
    case DType::kF32:
    case DType::kI32:
    case DType::kF8E4M3:
      break;
  }
  return "float32";
}

// ---- the plan --------------------------------------------------------------------------------

uint64_t model_weight_bytes(const ModelConfig& config, DType dtype, const QuantConfig& run) {
  LayerPlan whole;  // every tensor whole
  for (const WeightSpec& w : expected_weights(config)) {
    whole.weights.push_back(WeightShard{w, 0, 0});
    whole.weights.back().spec.split = Split::kNone;
  }
  return whole.weight_bytes(dtype, run);
}

Expected<ParallelPlan> make_parallel_plan(const ModelConfig& c, const ParallelConfig& parallel,
                                          DType dtype, const QuantConfig& run) {
  const int64_t tp = parallel.tp_size;
  const int64_t pp = parallel.pp_size;
  TESSERA_RETURN_IF_ERROR(check_tensor_parallel(c, tp, parallel.expert_parallel));
  if (pp < 1) return invalid_argument("-pp must be at least 1, got " + std::to_string(pp));
  ParallelPlan plan;
  plan.tp = tp;
  plan.pp = pp;
  plan.world = tp * pp;
  plan.dtype = dtype;
  plan.kv_replicas = c.num_kv_heads % tp == 0 ? 1 : tp / c.num_kv_heads;
  const uint64_t es = dtype_size(dtype);
  for (int s = 0; s < parallel.pp_size; ++s) {
    for (int t = 0; t < parallel.tp_size; ++t) {
      ParallelConfig at = parallel;
      at.tp_rank = t;
      at.pp_rank = s;
      RankPlan r;
      TESSERA_ASSIGN_OR_RETURN(r.shard, LayerPlan::make(c, at));
      const LayerPlan& lp = r.shard;
      int64_t vocab_tensors = 0;
      for (const WeightShard& w : lp.weights) {
        if (w.spec.split == Split::kVocab) ++vocab_tensors;
      }
      r.padding_bytes =
          static_cast<uint64_t>(vocab_tensors * (lp.vocab_shard - lp.vocab_rows) * c.hidden_size) *
          es;
      r.weight_bytes = lp.weight_bytes(dtype, run) + r.padding_bytes;
      r.kv_elems_per_token = 2 * lp.num_layers() * lp.kv_heads * c.head_dim;
      if (t == 0) {
        plan.stage_layers.push_back(lp.num_layers());
        plan.padded_vocab = lp.vocab_padded;
      }
      plan.ranks.push_back(std::move(r));
    }
  }
  return plan;
}

bool RankPlan::embedding() const {
  return std::any_of(shard.weights.begin(), shard.weights.end(),
                     [](const WeightShard& w) { return w.spec.kind == WeightKind::kEmbed; });
}

std::string describe_kv_heads(const ModelConfig& c, const ParallelPlan& plan) {
  const std::string tp = std::to_string(plan.tp);
  if (plan.kv_replicas == 1) {
    return "KV heads: " + std::to_string(c.num_kv_heads) + " split over -tp " + tp + ", " +
           std::to_string(c.num_kv_heads / plan.tp) + " per rank";
  }
  std::string out = "KV heads: " + std::to_string(c.num_kv_heads) + " replicated over -tp " + tp +
                    ", each on " + std::to_string(plan.kv_replicas) + " ranks:";
  for (int64_t h = 0; h < c.num_kv_heads; ++h) {
    const int64_t first = h * plan.kv_replicas;
    out += (h ? ", " : " ") + std::string("KV head ") + std::to_string(h) + " on TP ranks " +
           std::to_string(first) + "-" + std::to_string(first + plan.kv_replicas - 1);
  }
  return out;
}

// ---- memory ----------------------------------------------------------------------------------

MemoryPlan estimate_memory(const ModelConfig& c, const ParallelPlan& plan,
                           const std::vector<std::optional<GpuMemory>>& gpus,
                           const EngineSpec& options) {
  TESSERA_CHECK(gpus.size() == plan.ranks.size(), "one GPU (or nullopt) per rank");
  MemoryPlan out;
  out.engine = options;
  const uint64_t max_tokens =
      static_cast<uint64_t>(std::max(options.max_num_batched_tokens, options.max_num_seqs));
  // The run's quantization, as the actors resolve it (a flag that contradicts the checkpoint is
  // refused before any plan is sized; counted as plain here).
  const Expected<QuantConfig> resolved = resolve_quantization(options.quantization, c.quant);
  const QuantConfig quant = resolved ? *resolved : QuantConfig{};
  out.kv_tokens = -1;
  for (size_t i = 0; i < plan.ranks.size(); ++i) {
    const RankPlan& r = plan.ranks[i];
    RankMemory m;
    m.weights = r.weight_bytes;
    m.kv_bytes_per_token = static_cast<uint64_t>(r.kv_elems_per_token) *
                           kv_cache_element_size(options.kv_cache_dtype, plan.dtype);
    if (!gpus[i]) {
      m.gpu = false;
      m.kv_tokens = options.max_model_len;
      m.kv_bytes = m.kv_bytes_per_token * static_cast<uint64_t>(m.kv_tokens);
    } else {
      m.total = gpus[i]->total;
      m.in_use = gpus[i]->used;
      // vLLM's rule, as the actor applies it: utilization x total for this rank, whoever else
      // uses the GPU, as long as they leave that much free (two replicas at 0.45 share one).
      m.budget = std::min<uint64_t>(
          static_cast<uint64_t>(options.gpu_memory_utilization * static_cast<double>(m.total)),
          m.total - std::min(m.in_use, m.total));
      // What the CUDA backend allocates for steps (logits on the last stage, workspaces).
      m.activations =
          r.shard.activation_bytes(c, quant, plan.dtype, static_cast<int64_t>(max_tokens),
                                   options.max_num_seqs) +
          kGemmWorkspace + kCudaContext;
      if (!options.enforce_eager) m.activations += kGraphReserve;
      if (plan.world > 1) m.activations += kCommReserve;
      const uint64_t committed = m.weights + m.activations;
      const uint64_t block_bytes = m.kv_bytes_per_token * static_cast<uint64_t>(options.block_size);
      if (m.budget > committed && block_bytes > 0) {
        const uint64_t blocks = (m.budget - committed) / block_bytes;
        m.kv_bytes = blocks * block_bytes;
        m.kv_tokens = static_cast<int64_t>(blocks) * options.block_size;
      }
    }
    if (out.kv_tokens < 0 || m.kv_tokens < out.kv_tokens) {
      out.kv_tokens = m.kv_tokens;
      out.limiting_rank = static_cast<int64_t>(i);
    }
    out.ranks.push_back(m);
  }
  if (out.kv_tokens < 0) out.kv_tokens = 0;
  out.max_concurrency =
      static_cast<double>(out.kv_tokens) / static_cast<double>(options.max_model_len);
  out.sequence_tokens = c.kv_tokens_per_sequence(options.max_model_len, options.block_size);
  out.fits = out.kv_tokens >= out.sequence_tokens;
  return out;
}

Status memory_status(const MemoryPlan& plan, const std::vector<std::string>& rank_labels) {
  if (plan.fits) return Status::ok();
  const size_t r = static_cast<size_t>(plan.limiting_rank);
  const RankMemory& m = plan.ranks.at(r);
  const EngineSpec& o = plan.engine;
  const std::string who =
      "rank " + std::to_string(r) + (r < rank_labels.size() ? " (" + rank_labels[r] + ")" : "");
  const uint64_t committed = m.weights + m.activations;
  const uint64_t need_kv = m.kv_bytes_per_token * static_cast<uint64_t>(plan.sequence_tokens);
  char util[32];
  std::snprintf(util, sizeof(util), "%.2f", o.gpu_memory_utilization);
  std::string msg = "the model does not fit: on " + who + ", --gpu-memory-utilization " + util +
                    " of " + format_gib(m.total) + " allows " + format_gib(m.budget) +
                    (m.in_use > 0 ? " (" + format_gib(m.in_use) + " already in use)" : "") +
                    "; weights take " + format_gib(m.weights) + " and activations (estimated) " +
                    format_gib(m.activations);
  const std::string len = std::to_string(o.max_model_len);
  if (committed >= m.budget) {
    msg += ": together " + format_gib(committed - m.budget) +
           " more than it allows before any KV cache (one sequence of --max-model-len " + len +
           " needs " + format_gib(need_kv) + " more). ";
  } else {
    msg += ", leaving " + format_gib(m.budget - committed) + " = " + std::to_string(m.kv_tokens) +
           " KV tokens, but one sequence of --max-model-len " + len + " needs " +
           std::to_string(plan.sequence_tokens) + " tokens (" + format_gib(need_kv) + "). ";
  }
  std::vector<std::string> fixes;
  if (m.kv_tokens >= o.block_size) {
    fixes.push_back("lower --max-model-len to " + std::to_string(plan.kv_tokens));
  }
  const double need_util = static_cast<double>(committed + need_kv) /
                           static_cast<double>(std::max<uint64_t>(m.total, 1));
  const double free_util = static_cast<double>(m.total - std::min(m.in_use, m.total)) /
                           static_cast<double>(std::max<uint64_t>(m.total, 1));
  if (need_util <= free_util) {
    std::snprintf(util, sizeof(util), "%.2f", std::ceil(need_util * 100.0) / 100.0);
    fixes.push_back("raise --gpu-memory-utilization to " + std::string(util));
  }
  fixes.push_back("spread the model over more GPUs (raise -tp or -pp)");
  for (size_t i = 0; i < fixes.size(); ++i) {
    msg += (i == 0 ? "Fix: " : i + 1 == fixes.size() ? " or " : ", ") + fixes[i];
  }
  return resource_exhausted(msg);
}

}  // namespace tessera
