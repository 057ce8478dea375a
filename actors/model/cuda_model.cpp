#include "actors/model/cuda_model.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "actors/model/layer_loop.h"
#include "actors/model/rope_spec.h"
#include "kernels/cpu/rope.h"
#include "kernels/cuda/attention.h"
#include "kernels/cuda/elementwise.h"
#include "kernels/cuda/gemv.h"
#include "kernels/cuda/moe.h"

namespace tessera {

namespace {

constexpr uint64_t kGiB = 1ull << 30;
constexpr uint64_t kMiB = 1ull << 20;
constexpr size_t kAlign = 256;
constexpr uint64_t kGraphReserve = 512 * kMiB;

size_t align_up(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }
double gib(uint64_t b) { return static_cast<double>(b) / static_cast<double>(kGiB); }

// Offsets of the step metadata inside one device block (and its pinned mirror). Two layouts share
// the block: every step's (capacity max_tokens), then, at `base`, decode's (one token a sequence,
// capacity max_num_seqs) with the per-sequence arrays first and the block tables last, so that a
// decode step's metadata is one short span: one copy to the device instead of eight (each a
// few microseconds of the step's critical path).
struct MetaLayout {
  size_t ids = 0, positions = 0, slots = 0, cu_q = 0, ctx = 0, logit_rows = 0, tables = 0,
         fills = 0, bytes = 0;
  size_t base = 0;      // of this layout in the block
  bool decode = false;  // the decode layout (CudaModel::stage copies it at once)
  static MetaLayout make(int64_t tokens, int64_t seqs, int64_t blocks_per_seq) {
    MetaLayout m;
    size_t at = 0;
    auto take = [&](size_t bytes) {
      size_t o = at;
      at = align_up(at + bytes);
      return o;
    };
    m.slots = take(sizeof(int64_t) * tokens);
    m.ids = take(sizeof(int32_t) * tokens);
    m.positions = take(sizeof(int32_t) * tokens);
    m.cu_q = take(sizeof(int32_t) * (seqs + 1));
    m.ctx = take(sizeof(int32_t) * seqs);
    m.logit_rows = take(sizeof(int32_t) * seqs);
    m.tables = take(sizeof(int32_t) * seqs * blocks_per_seq);
    m.fills = take(sizeof(int32_t) * 2 * seqs);  // (token, sampler row) pairs
    m.bytes = at;
    return m;
  }
  // The layout a step's kernels read: decode's (after every step's) or every step's.
  static MetaLayout of(bool decode, int64_t max_tokens, int64_t max_seqs, int64_t blocks_per_seq) {
    const MetaLayout all = make(max_tokens, max_seqs, blocks_per_seq);
    if (!decode) return all;
    MetaLayout m;
    m.base = all.bytes;
    m.decode = true;
    size_t at = 0;
    auto take = [&](size_t bytes, size_t align) {
      size_t o = (at + align - 1) / align * align;
      at = o + bytes;
      return o;
    };
    m.cu_q = take(sizeof(int32_t) * (max_seqs + 1), 4);
    m.ctx = take(sizeof(int32_t) * max_seqs, 4);
    m.logit_rows = take(sizeof(int32_t) * max_seqs, 4);
    m.fills = take(sizeof(int32_t) * 2 * max_seqs, 4);
    m.ids = take(sizeof(int32_t) * max_seqs, 4);
    m.positions = take(sizeof(int32_t) * max_seqs, 4);
    m.slots = take(sizeof(int64_t) * max_seqs, 8);
    m.tables = take(sizeof(int32_t) * max_seqs * blocks_per_seq, kAlign);
    m.bytes = align_up(at);
    return m;
  }
  // Both layouts' bytes: the block's size.
  static size_t block_bytes(int64_t max_tokens, int64_t max_seqs, int64_t blocks_per_seq) {
    const MetaLayout d = of(true, max_tokens, max_seqs, blocks_per_seq);
    return d.base + d.bytes;
  }
};

// Bytes [offset, offset + bytes) of a step's host image `h` to the device image `d`.
Status copy_meta(const char* h, char* d, size_t offset, size_t bytes, cudaStream_t stream) {
  if (bytes == 0) return Status::ok();
  TESSERA_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(d + offset, h + offset, bytes, cudaMemcpyHostToDevice, stream),
      "copying the step metadata");
  return Status::ok();
}

// The block tables' first table_width columns of S rows: only the columns some sequence uses (a
// long max-model-len makes the rows long: 8,192 blocks at 131,072 tokens, 16 MB for 512
// sequences, against 256 KB used).
Status copy_tables(const MetaLayout& m, int64_t S, int64_t table_width, size_t pitch, const char* h,
                   char* d, cudaStream_t stream) {
  if (S <= 0) return Status::ok();
  TESSERA_CUDA_RETURN_IF_ERROR(
      cudaMemcpy2DAsync(d + m.tables, pitch, h + m.tables, pitch,
                        sizeof(int32_t) * static_cast<size_t>(table_width), static_cast<size_t>(S),
                        cudaMemcpyHostToDevice, stream),
      "copying the block tables");
  return Status::ok();
}

// A step's host image `h` to the device `d` in every step's layout: only the used prefix of
// each array (t tokens, S sequences, r logit rows, `fills` pairs; capacity max_tokens), the
// block tables' first table_width columns.
Status copy_every_array(const MetaLayout& m, int64_t t, int64_t S, int64_t r, int64_t fills,
                        int64_t table_width, size_t pitch, const char* h, char* d,
                        cudaStream_t stream) {
  auto copy = [&](size_t offset, size_t bytes) { return copy_meta(h, d, offset, bytes, stream); };
  TESSERA_RETURN_IF_ERROR(copy(m.slots, sizeof(int64_t) * t));
  TESSERA_RETURN_IF_ERROR(copy(m.ids, sizeof(int32_t) * t));
  TESSERA_RETURN_IF_ERROR(copy(m.positions, sizeof(int32_t) * t));
  TESSERA_RETURN_IF_ERROR(copy(m.cu_q, sizeof(int32_t) * (S + 1)));
  TESSERA_RETURN_IF_ERROR(copy(m.ctx, sizeof(int32_t) * S));
  TESSERA_RETURN_IF_ERROR(copy(m.logit_rows, sizeof(int32_t) * r));
  TESSERA_RETURN_IF_ERROR(copy_tables(m, S, table_width, pitch, h, d, stream));
  return copy(m.fills, sizeof(int32_t) * 2 * fills);
}

}  // namespace

struct CudaModel::Graph {
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  ~Graph() {
    if (exec != nullptr) cudaGraphExecDestroy(exec);
    if (graph != nullptr) cudaGraphDestroy(graph);
  }
};

struct CudaModel::StepPlan {
  int64_t tokens = 0;  // rows of the activations (padded for decode)
  int64_t seqs = 0;    // sequences (padded for decode)
  int64_t rows = 0;    // logit rows computed
  int64_t real_rows = 0;
  int64_t fills = 0;  // tokens the sampler fills in (async scheduling)
  int max_query_len = 0;
  int num_splits = 1;
  int split_size = 0;
  bool decode_meta = false;  // the metadata in MetaLayout's decode layout
};

CudaModel::CudaModel(const ModelConfig& config, const LayerPlan& plan, StageComms comms,
                     const EngineSpec& engine, int gpu_shares)
    : config_(config),
      plan_(plan),
      comms_(comms),
      engine_(engine),
      dtype_(run_dtype(engine)),
      gpu_shares_(std::max(gpu_shares, 1)),
      step_timer_(StepTimer::from_env()) {}

std::string CudaModel::utilization_text() const {
  std::string text = fmt::format("--gpu-memory-utilization {:.2f}", engine_.gpu_memory_utilization);
  if (gpu_shares_ > 1) {
    text += fmt::format(" (of the GPU, shared by {} ranks: this rank's share is {:.2f})",
                        gpu_shares_, engine_.gpu_memory_utilization / gpu_shares_);
  }
  return text;
}

CudaModel::~CudaModel() {
  graphs_.clear();
  if (stream_ != nullptr) cudaStreamSynchronize(stream_);
  for (void* host : meta_host_) {
    if (host != nullptr) cudaFreeHost(host);
  }
  sampler_.reset();
  gemm_.reset();
  fp8_gemm_.reset();
  weights_.reset();
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
}

std::vector<int64_t> CudaModel::graph_sizes() const {
  std::vector<int64_t> out;
  for (const auto& [size, g] : graphs_) out.push_back(size);
  return out;
}

Status CudaModel::allocate_buffers() {
  const ModelConfig& c = config_;
  const LayerPlan& p = plan_;
  const int64_t T = max_tokens_, S = engine_.max_num_seqs;
  const int64_t q_dim = p.heads * c.head_dim;
  uint64_t total = 0;
  auto alloc = [&](cuda::DeviceBuffer& b, size_t bytes, const char* what) -> Status {
    TESSERA_ASSIGN_OR_RETURN(b, cuda::DeviceBuffer::allocate(std::max<size_t>(bytes, 256), what));
    total += bytes;
    return Status::ok();
  };
  const StepBuffers sb = p.step_buffers(c, dtype_, T, S);
  TESSERA_RETURN_IF_ERROR(alloc(residual_, sb.residual, "the residual stream"));
  TESSERA_RETURN_IF_ERROR(alloc(hidden_, sb.hidden, "normed activations"));
  TESSERA_RETURN_IF_ERROR(alloc(qkv_, sb.qkv, "q/k/v activations"));
  TESSERA_RETURN_IF_ERROR(alloc(q_, sb.q, "rotated queries"));
  TESSERA_RETURN_IF_ERROR(alloc(attn_, sb.attn, "attention output"));
  TESSERA_RETURN_IF_ERROR(alloc(proj_, sb.proj, "projection output"));
  TESSERA_RETURN_IF_ERROR(alloc(gate_up_, sb.gate_up, "gate/up"));
  TESSERA_RETURN_IF_ERROR(alloc(act_, sb.act, "MLP activations"));
  if (sb.logits > 0) {
    TESSERA_RETURN_IF_ERROR(alloc(rows_, sb.logit_rows, "logit rows"));
    TESSERA_RETURN_IF_ERROR(alloc(logits_, sb.logits, "logits"));
  }
  if (sb.shard_logits > 0) {
    TESSERA_RETURN_IF_ERROR(alloc(shard_logits_, sb.shard_logits, "vocabulary-parallel logits"));
  }
  if (sb.sampled_tokens > 0) {  // async scheduling: the sampled tokens, packed and gathered
    TESSERA_RETURN_IF_ERROR(alloc(sampled_tokens_, sb.sampled_tokens, "sampled tokens"));
  }
  int max_splits = 1;
  for (int64_t b = 1; b <= S; b *= 2) {
    max_splits = std::max(
        max_splits, cuda::plan_attention_splits(static_cast<int>(b), static_cast<int>(p.kv_heads),
                                                engine_.max_model_len, num_sms_)
                        .num_splits);
  }
  const size_t ws = cuda::attention_workspace_bytes(S, static_cast<int>(p.heads),
                                                    static_cast<int>(c.head_dim), max_splits);
  TESSERA_RETURN_IF_ERROR(alloc(attn_workspace_, ws, "split-K attention"));
  TESSERA_RETURN_IF_ERROR(alloc(norm_arrivals_, sizeof(int32_t), "the fused norm's counter"));
  TESSERA_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(norm_arrivals_.get(), 0, sizeof(int32_t), stream_),
                               "clearing the fused norm's counter");
  if (const uint64_t w4 = weights_->w4_workspace_bytes(T); w4 > 0) {
    // The int4 layers' split-K counters start zero and every call leaves them so; the prefill
    // path dequantizes a layer's weight here.
    TESSERA_RETURN_IF_ERROR(alloc(w4_workspace_, w4, "int4 GEMM workspace"));
    TESSERA_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(w4_workspace_.get(), 0, w4, stream_),
                                 "clearing the int4 GEMM workspace");
  }
  if (weights_->any_fp8()) {
    const int64_t widest = std::max({c.hidden_size, q_dim, p.intermediate});
    TESSERA_RETURN_IF_ERROR(alloc(fp8_act_, T * widest, "FP8 layer inputs"));
    TESSERA_RETURN_IF_ERROR(alloc(fp8_scales_, T * sizeof(float), "FP8 row scales"));
  }
  if (const uint64_t moe = p.moe_workspace_bytes(c, dtype_, T); moe > 0) {
    TESSERA_RETURN_IF_ERROR(alloc(moe_workspace_, moe, "mixture-of-experts workspace"));
    // The expert balance is counted once: by every rank under expert parallelism (each counts
    // its own experts), by tp rank 0 otherwise (every rank routes every token alike); the CPU
    // backend's rule.
    if (p.parallel.expert_parallel || p.parallel.tp_rank == 0) {
      for (int64_t i = 0; i < p.num_layers(); ++i) {
        if (c.moe.sparse_layer(p.layer_begin + i)) counted_layers_.push_back(p.layer_begin + i);
      }
      const uint64_t bytes = sizeof(unsigned long long) * counted_layers_.size() *
                             static_cast<uint64_t>(c.moe.num_experts);
      TESSERA_RETURN_IF_ERROR(alloc(expert_counts_, bytes, "expert counts"));
    }
  }
  const size_t meta_bytes = MetaLayout::block_bytes(T, S, max_blocks_per_seq_);
  TESSERA_RETURN_IF_ERROR(alloc(meta_, meta_bytes, "step metadata"));
  for (void*& host : meta_host_) {
    TESSERA_CUDA_RETURN_IF_ERROR(cudaHostAlloc(&host, meta_bytes, cudaHostAllocDefault),
                                 "allocating pinned step metadata");
    std::memset(host, 0, meta_bytes);
  }
  // The RoPE tables, computed on the host exactly as the CPU backend does (rope_spec.h: llama3,
  // linear or Phi-3's LongRoPE scaling, whose table holds the short factors' angles below
  // original_max_position_embeddings and the long factors' from there, times attention_factor),
  // and Gemma 3's sliding layers' own table.
  const int64_t rotary = c.rotary_dim != 0 ? c.rotary_dim : c.head_dim;
  const size_t table = static_cast<size_t>(engine_.max_model_len * rotary / 2) * 4;
  auto upload_rope = [&](bool local, cuda::DeviceBuffer& cos, cuda::DeviceBuffer& sin) -> Status {
    TESSERA_ASSIGN_OR_RETURN(cpu::RopeTable rope,
                             cpu::RopeTable::create(rope_spec(c, local), engine_.max_model_len));
    TESSERA_RETURN_IF_ERROR(alloc(cos, table, "RoPE cos table"));
    TESSERA_RETURN_IF_ERROR(alloc(sin, table, "RoPE sin table"));
    TESSERA_CUDA_RETURN_IF_ERROR(cudaMemcpy(cos.get(), rope.cos(0), table, cudaMemcpyHostToDevice),
                                 "RoPE table");
    TESSERA_CUDA_RETURN_IF_ERROR(cudaMemcpy(sin.get(), rope.sin(0), table, cudaMemcpyHostToDevice),
                                 "RoPE table");
    return Status::ok();
  };
  TESSERA_RETURN_IF_ERROR(upload_rope(false, rope_cos_, rope_sin_));
  if (c.rope_local_theta > 0) {
    TESSERA_RETURN_IF_ERROR(upload_rope(true, rope_local_cos_, rope_local_sin_));
  }
  memory_.activations += total;
  return Status::ok();
}

Status CudaModel::create_fp8_gemm() {
  if (!weights_->any_fp8()) return Status::ok();
  // TESSERA_FP8_GEMM=outer-vector|epilogue forces how the GEMM applies the row and output scales
  // (default auto: cuBLASLt's outer-vector scaling when its probe passes, else the epilogue).
  cuda::Fp8GemmPath path = cuda::Fp8GemmPath::kAuto;
  if (const char* env = std::getenv("TESSERA_FP8_GEMM"); env != nullptr) {
    auto parsed = cuda::parse_fp8_gemm_path(env);
    if (!parsed) {
      return invalid_argument("TESSERA_FP8_GEMM: " + parsed.status().message() +
                              "; set one of those or unset it");
    }
    path = *parsed;
  }
  int64_t max_n = 16;
  for (int64_t i = 0; i < plan_.num_layers(); ++i) {
    const CudaLayer& l = weights_->layer(i);
    for (const CudaLinear* lin : {&l.qkv, &l.o, &l.gate_up, &l.down}) {
      if (lin->is_fp8()) max_n = std::max(max_n, lin->fp8.out);
    }
  }
  TESSERA_ASSIGN_OR_RETURN(fp8_gemm_,
                           cuda::Fp8Gemm::create(path, max_tokens_, max_n, dtype_, stream_));
  memory_.activations += fp8_gemm_->device_bytes();
  const std::string& why = fp8_gemm_->probe_failure();
  spdlog::info("FP8 GEMM: {}{}{}", cuda::fp8_gemm_path_name(fp8_gemm_->path()),
               why.empty() ? "" : " (cuBLASLt's outer-vector scaling did not pass its probe: ",
               why.empty() ? "" : why + ")");
  return Status::ok();
}

uint64_t CudaModel::kv_block_bytes_per_layer() const {
  return static_cast<uint64_t>(engine_.block_size * plan_.kv_heads * config_.head_dim) *
         kv_cache_element_size(engine_.kv_cache_dtype, dtype_);
}

Status CudaModel::allocate_kv_cache(int64_t blocks) {
  const size_t per_layer = static_cast<size_t>(blocks) * kv_block_bytes_per_layer();
  const size_t stride = align_up(per_layer);
  const int64_t L = plan_.num_layers();
  TESSERA_ASSIGN_OR_RETURN(kv_storage_,
                           cuda::DeviceBuffer::allocate(stride * 2 * L, "the KV cache"));
  TESSERA_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(kv_storage_.get(), 0, kv_storage_.bytes(), stream_),
                               "clearing the KV cache");
  k_cache_.assign(L, nullptr);
  v_cache_.assign(L, nullptr);
  for (int64_t l = 0; l < L; ++l) {
    k_cache_[l] = kv_storage_.as<char>() + stride * (2 * l);
    v_cache_[l] = kv_storage_.as<char>() + stride * (2 * l + 1);
  }
  kv_blocks_ = blocks;
  return Status::ok();
}

// The batch is a StepBatch's (requests.h; or the profiling step's own), checked when it was
// made: its sequences, positions, block tables, tokens and fills are within this model's
// bounds (max_num_seqs, max_tokens_, max_blocks_per_seq_, the KV cache, the vocabulary).
Expected<CudaModel::StepPlan> CudaModel::stage(std::span<const ForwardSeq> batch, int64_t pad_to,
                                               std::span<const TokenFill> fills) {
  const int64_t bs = engine_.block_size;
  const int64_t S_real = static_cast<int64_t>(batch.size());
  const int64_t S = std::max(pad_to, S_real);
  // Decode steps (padded to a graph's size) use the decode layout, which the graphs read.
  const MetaLayout m =
      MetaLayout::of(pad_to > 0, max_tokens_, engine_.max_num_seqs, max_blocks_per_seq_);
  // The two host images in turn: the copies of the step before may not have run yet.
  char* h = static_cast<char*>(meta_host_[meta_turn_]) + m.base;
  meta_turn_ ^= 1;
  std::vector<int32_t> fill_row(static_cast<size_t>(S_real), -1);
  for (const TokenFill& f : fills) fill_row[f.seq] = static_cast<int32_t>(f.row);
  auto* fill_pairs = reinterpret_cast<int32_t*>(h + m.fills);
  auto* ids = reinterpret_cast<int32_t*>(h + m.ids);
  auto* pos = reinterpret_cast<int32_t*>(h + m.positions);
  auto* slots = reinterpret_cast<int64_t*>(h + m.slots);
  auto* cu_q = reinterpret_cast<int32_t*>(h + m.cu_q);
  auto* ctx = reinterpret_cast<int32_t*>(h + m.ctx);
  auto* lrows = reinterpret_cast<int32_t*>(h + m.logit_rows);
  auto* tables = reinterpret_cast<int32_t*>(h + m.tables);
  StepPlan plan;
  int64_t t = 0, r = 0;
  int64_t table_width = 1;  // the longest block table of the step (rows keep their fixed stride)
  cu_q[0] = 0;
  for (int64_t s = 0; s < S_real; ++s) {
    const ForwardSeq& seq = batch[s];
    const int64_t n = static_cast<int64_t>(seq.tokens.size());
    const int64_t end = seq.start_position + n;
    const int64_t nb = static_cast<int64_t>(seq.block_table.size());
    table_width = std::max(table_width, nb);
    for (int64_t b = 0; b < nb; ++b) {
      tables[s * max_blocks_per_seq_ + b] = static_cast<int32_t>(seq.block_table[b]);
    }
    for (int64_t i = 0; i < n; ++i) {
      int32_t id = seq.tokens[i];
      if (fill_row[s] >= 0) {  // the sampler writes it in on the device
        fill_pairs[2 * plan.fills] = static_cast<int32_t>(t);
        fill_pairs[2 * plan.fills + 1] = fill_row[s];
        ++plan.fills;
        id = 0;
      }
      const int64_t p = seq.start_position + i;
      ids[t] = id;
      pos[t] = static_cast<int32_t>(p);
      slots[t] = static_cast<int64_t>(seq.block_table[p / bs]) * bs + p % bs;
      ++t;
    }
    cu_q[s + 1] = static_cast<int32_t>(t);
    ctx[s] = static_cast<int32_t>(end);
    plan.max_query_len = std::max<int>(plan.max_query_len, static_cast<int>(n));
    if (seq.want_logits) lrows[r++] = static_cast<int32_t>(t - 1);
  }
  plan.real_rows = r;
  // Decode padding: one dummy token per missing sequence, nothing stored, nothing attended.
  for (int64_t s = S_real; s < S; ++s) {
    ids[t] = 0;
    pos[t] = 0;
    slots[t] = -1;
    ++t;
    cu_q[s + 1] = static_cast<int32_t>(t);
    ctx[s] = 0;
    lrows[r++] = static_cast<int32_t>(t - 1);
    plan.max_query_len = std::max(plan.max_query_len, 1);
  }
  plan.tokens = t;
  plan.seqs = S;
  plan.rows = r;
  plan.decode_meta = m.decode;
  char* d = meta_.as<char>() + m.base;
  auto copy = [&](size_t offset, size_t bytes) { return copy_meta(h, d, offset, bytes, stream_); };
  const size_t pitch = sizeof(int32_t) * static_cast<size_t>(max_blocks_per_seq_);
  if (m.decode) {
    // The per-sequence arrays (unused tails included: a few KB) and the block tables in one copy,
    // or two where the tables' rows are long (a long max-model-len) and several are used.
    const size_t tables_span =
        S > 0 ? static_cast<size_t>(S - 1) * pitch + sizeof(int32_t) * table_width : 0;
    if (tables_span <= 64 * 1024) {
      TESSERA_RETURN_IF_ERROR(copy(0, m.tables + tables_span));
    } else {
      TESSERA_RETURN_IF_ERROR(copy(0, m.tables));
      TESSERA_RETURN_IF_ERROR(copy_tables(m, S, table_width, pitch, h, d, stream_));
    }
  } else {
    TESSERA_RETURN_IF_ERROR(copy_every_array(m, plan.tokens, plan.seqs, plan.rows, plan.fills,
                                             table_width, pitch, h, d, stream_));
  }
  if (plan.fills > 0) {
    TESSERA_RETURN_IF_ERROR(fill_sampled_tokens(plan, d + m.ids, d + m.fills));
  }
  return plan;
}

// The tokens sampled in the step before, written into the step's ids at the fill pairs.
Status CudaModel::fill_sampled_tokens(const StepPlan& plan, char* ids, char* fills) {
  // The samples of the step before: the sampler's own, or with tensor parallelism its rank's,
  // gathered (every rank fills the same tokens: the same step has the same fills everywhere).
  int stride = 1;
  const int32_t* tokens = sampler_ != nullptr ? sampler_->tokens(&stride) : nullptr;
  if (comms_.tp != nullptr) {
    const int64_t S_max = engine_.max_num_seqs;
    int32_t* packed = sampled_tokens_.as<int32_t>();
    int32_t* gathered = packed + S_max;
    if (tokens != nullptr) {
      TESSERA_RETURN_IF_ERROR(
          cuda::pack_tokens(tokens, stride, static_cast<int>(S_max), packed, stream_));
    } else {
      TESSERA_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(packed, 0, sizeof(int32_t) * S_max, stream_),
                                   "sampled tokens");
    }
    // Bits copied as they are (a gather does no arithmetic on them).
    TESSERA_RETURN_IF_ERROR(comms_.tp->all_gather(packed, S_max, DType::kF32, gathered, stream_));
    const int sampler_rank = 0;  // the last stage's tensor-parallel rank 0 samples
    tokens = gathered + sampler_rank * S_max;
    stride = 1;
  }
  if (tokens == nullptr) {
    return failed_precondition(
        "a step takes sampled tokens on a rank with no sampler and no "
        "tensor-parallel peer that has one");
  }
  TESSERA_RETURN_IF_ERROR(cuda::fill_tokens(reinterpret_cast<int32_t*>(ids),
                                            reinterpret_cast<int32_t*>(fills),
                                            static_cast<int>(plan.fills), tokens, stride, stream_));
  return Status::ok();
}

// layer_loop.h's operations over the model's device buffers, on its stream.
class CudaModel::Ops {
 public:
  Ops(CudaModel& m, const StepPlan& plan, StepTimer* timer) : m_(m), plan_(plan), timer_(timer) {
    const ModelConfig& c = m.config_;
    const LayerPlan& p = m.plan_;
    dt_ = m.dtype_;
    T_ = plan.tokens;
    H_ = c.hidden_size;
    eps_ = static_cast<float>(c.rms_norm_eps);
    unit_ = c.norm_unit_offset;
    st_ = m.stream_;
    const MetaLayout ml = MetaLayout::of(plan.decode_meta, m.max_tokens_, m.engine_.max_num_seqs,
                                         m.max_blocks_per_seq_);
    char* meta = m.meta_.as<char>() + ml.base;
    ids_ = reinterpret_cast<const int32_t*>(meta + ml.ids);
    slots_ = reinterpret_cast<const int64_t*>(meta + ml.slots);
    lrows_ = reinterpret_cast<const int32_t*>(meta + ml.logit_rows);
    a_.kernel = m.attention_kernel_;
    a_.dtype = dt_;
    a_.kv_cache_dtype = m.engine_.kv_cache_dtype;
    a_.q = m.q_.get();
    a_.out = m.attn_.get();
    a_.num_blocks = m.kv_blocks_;
    a_.block_size = static_cast<int>(m.engine_.block_size);
    a_.cu_query_lens = reinterpret_cast<const int32_t*>(meta + ml.cu_q);
    a_.context_lens = reinterpret_cast<const int32_t*>(meta + ml.ctx);
    a_.block_tables = reinterpret_cast<const int32_t*>(meta + ml.tables);
    a_.block_table_stride = static_cast<int>(m.max_blocks_per_seq_);
    a_.num_seqs = static_cast<int>(plan.seqs);
    a_.max_query_len = plan.max_query_len;
    a_.num_heads = static_cast<int>(p.heads);
    a_.num_kv_heads = static_cast<int>(p.kv_heads);
    a_.head_dim = static_cast<int>(c.head_dim);
    a_.num_splits = plan.num_splits;
    a_.split_size = plan.split_size;
    a_.workspace = plan.num_splits > 1 ? m.attn_workspace_.get() : nullptr;
    a_.total_q = T_;
    r_.dtype = dt_;
    r_.kv_cache_dtype = m.engine_.kv_cache_dtype;
    r_.qkv = m.qkv_.get();
    r_.constants.eps = eps_;
    r_.constants.norm_unit_offset = c.norm_unit_offset;
    r_.constants.cos = m.rope_cos_.as<float>();
    r_.constants.sin = m.rope_sin_.as<float>();
    r_.constants.max_position = m.engine_.max_model_len;
    r_.positions = reinterpret_cast<const int32_t*>(meta + ml.positions);
    r_.slots = reinterpret_cast<const int64_t*>(meta + ml.slots);
    r_.num_tokens = T_;
    r_.num_heads = p.heads;
    r_.num_kv_heads = p.kv_heads;
    r_.head_dim = c.head_dim;
    r_.rotary_dim = c.rotary_dim;
    r_.q_out = m.q_.get();
    r_.num_blocks = m.kv_blocks_;
    r_.block_size = m.engine_.block_size;
  }

  Status embed() {
    const LayerPlan& p = m_.plan_;
    if (p.parallel.tp_size == 1) {
      TESSERA_RETURN_IF_ERROR(cuda::embedding(dt_, ids_, T_, m_.weights_->embed(),
                                              m_.config_.vocab_size, H_, m_.residual_.get(), st_));
    } else {
      TESSERA_RETURN_IF_ERROR(cuda::embedding_shard(dt_, ids_, T_, m_.weights_->embed(),
                                                    p.vocab_begin, p.vocab_rows, H_,
                                                    m_.residual_.get(), st_));
    }
    // Gemma: times sqrt(hidden_size) rounded to the dtype, as transformers' normalizer (before
    // the tensor-parallel all-reduce, as the CPU backend: the other ranks' rows are zeros).
    const float scale = static_cast<float>(m_.config_.embed_scale);
    if (scale == 1.0f) return Status::ok();
    return cuda::scale_embedding(dt_, m_.residual_.get(), T_ * H_, scale, st_);
  }

  Status recv_hidden() {
    return m_.comms_.pp->recv(m_.residual_.get(), bytes(T_ * H_), m_.plan_.parallel.pp_rank - 1,
                              st_);
  }
  Status send_hidden() {
    return m_.comms_.pp->send(m_.residual_.get(), bytes(T_ * H_), m_.plan_.parallel.pp_rank + 1,
                              st_);
  }

  // The tensor-parallel all-reduce of proj waits for the op after it where the group fuses it
  // with that op's "residual += proj; hidden = RMSNorm(residual)" (Communicator::
  // fuses_add_rms_norm: the custom all-reduce, one kernel, the same bits): post_norm, the next
  // layer's input_norm or the final norm take it (reduce_add_rms_norm); an op that cannot
  // (an FP8 norm, a stage boundary) all-reduces first (reduce_proj). Gemma's sandwich norms
  // normalise proj before the add: never deferred.
  Status all_reduce(Activation which) {
    if (which == Activation::kProj && !unit_ && !m_.config_.sandwich_norms &&
        m_.comms_.tp->fuses_add_rms_norm(T_, H_, dt_)) {
      proj_unreduced_ = true;
      return Status::ok();
    }
    void* buf = which == Activation::kResidual ? m_.residual_.get() : m_.proj_.get();
    return m_.comms_.tp->all_reduce_sum(buf, T_ * H_, dt_, st_);
  }
  Status reduce_proj() {
    if (!proj_unreduced_) return Status::ok();
    proj_unreduced_ = false;
    return m_.comms_.tp->all_reduce_sum(m_.proj_.get(), T_ * H_, dt_, st_);
  }
  // residual += the all-reduce of proj; hidden = RMSNorm(residual) * weight, in one kernel.
  Status reduce_add_rms_norm(const void* weight) {
    proj_unreduced_ = false;
    comm::Communicator::AddRmsNorm n;
    n.residual = m_.residual_.get();
    n.weight = weight;
    n.out = m_.hidden_.get();
    n.rows = T_;
    n.hidden = H_;
    n.eps = eps_;
    return m_.comms_.tp->all_reduce_add_rms_norm(m_.proj_.get(), n, dt_, st_);
  }

  Status add_residual() {
    // residual += proj; the normed output lands in hidden, unused: a stage boundary.
    TESSERA_RETURN_IF_ERROR(reduce_proj());
    TESSERA_RETURN_IF_ERROR(post_ff_norm(m_.plan_.num_layers() - 1));
    return cuda::add_residual(dt_, m_.proj_.get(), m_.residual_.get(), T_ * H_, st_);
  }

  Status input_norm(int64_t i, bool add) {
    const CudaLayer& w = m_.weights_->layer(i);
    if (proj_unreduced_) {  // all_reduce left proj to this norm
      if (!w.qkv.is_fp8()) return reduce_add_rms_norm(w.input_norm);
      TESSERA_RETURN_IF_ERROR(reduce_proj());
    }
    // Batch-1 decode of a 16-bit q|k|v: the add and the norm run in qkv's GEMV (below).
    norm_in_qkv_ = add && fused_norm_qkv(i);
    if (norm_in_qkv_) return Status::ok();
    if (add && m_.config_.sandwich_norms && !w.qkv.is_fp8()) {
      // Gemma: layer i - 1's post_feedforward_layernorm of proj, the add and this norm, fused.
      return cuda::norm_add_rms_norm(dt_, m_.proj_.get(), m_.weights_->layer(i - 1).post_ff_norm,
                                     m_.residual_.get(), w.input_norm, T_, H_, eps_,
                                     m_.hidden_.get(), st_, unit_);
    }
    if (add) TESSERA_RETURN_IF_ERROR(post_ff_norm(i - 1));
    if (w.qkv.is_fp8()) {  // the normed row goes to q|k|v as FP8
      void* x = add ? m_.proj_.get() : m_.residual_.get();
      return cuda::rms_norm_fp8(dt_, x, add ? m_.residual_.get() : nullptr, w.input_norm, T_, H_,
                                eps_, w.qkv.fp8.input_scale, fp8_act(), fp8_scales(), st_);
    }
    if (!add) {
      return cuda::rms_norm(dt_, m_.residual_.get(), w.input_norm, T_, H_, eps_, m_.hidden_.get(),
                            st_, unit_);
    }
    return cuda::add_rms_norm(dt_, m_.proj_.get(), m_.residual_.get(), w.input_norm, T_, H_, eps_,
                              m_.hidden_.get(), st_, unit_);
  }

  Status qkv(int64_t i) {
    const CudaLayer& w = m_.weights_->layer(i);
    const int64_t n = m_.plan_.qkv_rows(m_.config_);
    if (norm_in_qkv_) {
      norm_in_qkv_ = false;
      return cuda::gemv_add_rms_norm(n, H_, dt_, dt_, norm_args(w.input_norm), w.qkv.w, w.qkv_bias,
                                     m_.qkv_.get(), st_);
    }
    return linear(w.qkv, T_, n, H_, m_.hidden_.get(), w.qkv_bias, m_.qkv_.get());
  }

  // input_norm(i, add = true) then qkv(i), and post_norm(i) then the MLP's first GEMV (gate_up, or
  // an MoE layer's router), as one kernel each: what add_rms_norm and the GEMV compute, the same
  // bits (gemv.h), for one row, plain RMSNorm (not Gemma's), 16-bit weights and a GEMV of one
  // wave of blocks (gemv_add_rms_norm_one_wave).
  cuda::GemvAddRmsNorm norm_args(const void* norm_weight) const {
    cuda::GemvAddRmsNorm a;
    a.proj = m_.proj_.get();
    a.residual = m_.residual_.get();
    a.weight = norm_weight;
    a.eps = eps_;
    a.normed = m_.hidden_.get();
    a.arrivals = m_.norm_arrivals_.as<int32_t>();
    return a;
  }
  bool fused_norm_qkv(int64_t i) const {
    const CudaLayer& w = m_.weights_->layer(i);
    const int64_t n = m_.plan_.qkv_rows(m_.config_);
    return T_ == 1 && !unit_ && !m_.config_.sandwich_norms && !w.qkv.is_fp8() && !w.qkv.int4() &&
           cuda::gemv_add_rms_norm_takes(n, H_, dt_, dt_, norm_args(w.input_norm), w.qkv.w) &&
           cuda::gemv_add_rms_norm_one_wave(n, H_, dt_, dt_);
  }
  bool fused_norm_mlp(int64_t i) const {
    const CudaLayer& w = m_.weights_->layer(i);
    if (T_ != 1 || unit_ || m_.config_.sandwich_norms) return false;
    if (w.moe()) {  // the router's GEMV (fp32 logits); a shared expert reads hidden before it
      const int64_t e = m_.config_.moe.num_experts;
      return w.shared_gate_up == nullptr &&
             cuda::gemv_add_rms_norm_takes(e, H_, dt_, DType::kF32, norm_args(w.post_norm),
                                           w.router) &&
             cuda::gemv_add_rms_norm_one_wave(e, H_, dt_, DType::kF32);
    }
    const int64_t n = 2 * m_.plan_.intermediate;
    return !w.gate_up.is_fp8() && !w.gate_up.int4() &&
           cuda::gemv_add_rms_norm_takes(n, H_, dt_, dt_, norm_args(w.post_norm), w.gate_up.w) &&
           cuda::gemv_add_rms_norm_one_wave(n, H_, dt_, dt_);
  }

  // Decode (one token a sequence): rope_and_cache's work runs inside the attention kernel
  // (cuda::AttentionRope), one launch fewer a layer. TESSERA_ROPE_IN_ATTENTION=0 turns it off.
  bool rope_in_attention() const {
    static const bool on = [] {
      const char* env = std::getenv("TESSERA_ROPE_IN_ATTENTION");
      return env == nullptr || std::string(env) != "0";
    }();
    return on && (r_.rotary_dim == 0 || r_.rotary_dim == r_.head_dim) &&
           cuda::attention_rope_applies(a_);
  }

  Status rope_cache(int64_t i) {
    const CudaLayer& w = m_.weights_->layer(i);
    r_.constants.q_norm = w.q_norm;
    r_.constants.k_norm = w.k_norm;
    r_.k_cache = m_.k_cache_[i];
    r_.v_cache = m_.v_cache_[i];
    // Gemma 3's sliding layers rotate with their own table (rope_local_theta, no scaling).
    const bool local =
        m_.rope_local_cos_.get() != nullptr && m_.config_.local_rope(m_.plan_.layer_begin + i);
    r_.constants.cos = local ? m_.rope_local_cos_.as<float>() : m_.rope_cos_.as<float>();
    r_.constants.sin = local ? m_.rope_local_sin_.as<float>() : m_.rope_sin_.as<float>();
    if (rope_in_attention()) return Status::ok();  // attention(i) does it
    return cuda::rope_and_cache(r_, st_);
  }

  Status attention(int64_t i) {
    a_.scoring = m_.config_.attention_scoring(m_.plan_.layer_begin + i);  // global layer index
    a_.k_cache = m_.k_cache_[i];
    a_.v_cache = m_.v_cache_[i];
    a_.rope = {};
    if (rope_in_attention()) {  // rope_cache(i) left layer i's tables and norms in r_
      a_.rope.qkv = r_.qkv;
      a_.rope.constants = r_.constants;
    }
    return cuda::paged_attention(a_, st_);
  }

  Status o_proj(int64_t i) {
    const CudaLayer& w = m_.weights_->layer(i);
    if (w.o.is_fp8()) {
      TESSERA_RETURN_IF_ERROR(cuda::quantize_fp8_rows(
          dt_, m_.attn_.get(), T_, w.o.fp8.in, w.o.fp8.input_scale, fp8_act(), fp8_scales(), st_));
    }
    return linear(w.o, T_, H_, m_.plan_.heads * m_.config_.head_dim, m_.attn_.get(), w.o_bias,
                  m_.proj_.get());
  }

  Status post_norm(int64_t i) {
    const CudaLayer& w = m_.weights_->layer(i);
    if (proj_unreduced_) {  // all_reduce left proj to this norm
      if (!w.gate_up.is_fp8()) return reduce_add_rms_norm(w.post_norm);
      TESSERA_RETURN_IF_ERROR(reduce_proj());
    }
    // Batch-1 decode: the add and the norm run in the MLP's first GEMV (fused_norm_mlp).
    norm_in_mlp_ = fused_norm_mlp(i);
    if (norm_in_mlp_) return Status::ok();
    const void* mlp_norm = w.post_norm;
    if (m_.config_.sandwich_norms && !w.gate_up.is_fp8()) {
      // Gemma: post_attention_layernorm of proj, the residual add and pre_feedforward_layernorm
      // in one kernel.
      return cuda::norm_add_rms_norm(dt_, m_.proj_.get(), w.post_norm, m_.residual_.get(),
                                     w.pre_ff_norm, T_, H_, eps_, m_.hidden_.get(), st_, unit_);
    }
    if (m_.config_.sandwich_norms) {
      // Gemma: the attention output is normalised (post_attention_layernorm) before the
      // residual add; the MLP reads pre_feedforward_layernorm.
      TESSERA_RETURN_IF_ERROR(cuda::rms_norm(dt_, m_.proj_.get(), w.post_norm, T_, H_, eps_,
                                             m_.proj_.get(), st_, unit_));
      mark("post_attn_norm");
      mlp_norm = w.pre_ff_norm;
    }
    if (w.gate_up.is_fp8()) {  // the normed row goes to gate|up as FP8
      return cuda::rms_norm_fp8(dt_, m_.proj_.get(), m_.residual_.get(), mlp_norm, T_, H_, eps_,
                                w.gate_up.fp8.input_scale, fp8_act(), fp8_scales(), st_);
    }
    return cuda::add_rms_norm(dt_, m_.proj_.get(), m_.residual_.get(), mlp_norm, T_, H_, eps_,
                              m_.hidden_.get(), st_, unit_);
  }

  // Gemma: layer i's MLP output (proj, all-reduced) through post_feedforward_layernorm before
  // it joins the residual stream; nothing for other models.
  Status post_ff_norm(int64_t i) {
    if (!m_.config_.sandwich_norms) return Status::ok();
    TESSERA_RETURN_IF_ERROR(cuda::rms_norm(dt_, m_.proj_.get(), m_.weights_->layer(i).post_ff_norm,
                                           T_, H_, eps_, m_.proj_.get(), st_, unit_));
    mark("post_ff_norm");
    return Status::ok();
  }

  Status mlp(int64_t i) {
    const CudaLayer& w = m_.weights_->layer(i);
    if (w.moe()) return moe(i, w);
    const int64_t I = m_.plan_.intermediate;
    if (norm_in_mlp_) {
      norm_in_mlp_ = false;
      TESSERA_RETURN_IF_ERROR(cuda::gemv_add_rms_norm(2 * I, H_, dt_, dt_, norm_args(w.post_norm),
                                                      w.gate_up.w, nullptr, m_.gate_up_.get(),
                                                      st_));
    } else {
      TESSERA_RETURN_IF_ERROR(
          linear(w.gate_up, T_, 2 * I, H_, m_.hidden_.get(), nullptr, m_.gate_up_.get()));
    }
    mark("gate_up");
    if (w.down.is_fp8()) {  // the activation goes to down as FP8
      TESSERA_RETURN_IF_ERROR(cuda::silu_mul_fp8(
          dt_, m_.gate_up_.get(), T_, I, w.down.fp8.input_scale, fp8_act(), fp8_scales(), st_));
    } else if (m_.config_.activation == MlpActivation::kGeluTanh) {  // Gemma's GeGLU
      TESSERA_RETURN_IF_ERROR(
          cuda::gelu_tanh_mul(dt_, m_.gate_up_.get(), T_, I, m_.act_.get(), st_));
    } else {
      TESSERA_RETURN_IF_ERROR(cuda::silu_mul(dt_, m_.gate_up_.get(), T_, I, m_.act_.get(), st_));
    }
    mark("activation");
    return linear(w.down, T_, H_, I, m_.act_.get(), nullptr, m_.proj_.get());
  }

  // proj = the MoE block of hidden (kernels/cuda/moe.h): this rank's partial sum, all-reduced
  // by the layer loop as the dense MLP's is.
  Status moe(int64_t i, const CudaLayer& w) {
    const LayerPlan& p = m_.plan_;
    const MoeConfig& moe = m_.config_.moe;
    cuda::MoeArgs a;
    a.dtype = dt_;
    a.tokens = T_;
    a.num_experts = moe.num_experts;
    a.top_k = moe.top_k;
    a.renormalize = moe.norm_topk_prob;
    a.x = m_.hidden_.get();
    a.router = w.router;
    cuda::GemvAddRmsNorm norm;
    if (norm_in_mlp_) {  // the router's GEMV computes hidden (moe.h: MoeArgs::norm)
      norm_in_mlp_ = false;
      norm = norm_args(w.post_norm);
      a.norm = &norm;
    }
    a.experts.gate_up = w.experts_gate_up;
    a.experts.down = w.experts_down;
    a.experts.expert_begin = p.expert_begin;
    a.experts.local_experts = p.experts;
    a.experts.hidden = H_;
    a.experts.inter = p.moe_intermediate;
    a.shared_gate_up = w.shared_gate_up;
    a.shared_down = w.shared_down;
    a.shared_expert_gate = w.shared_expert_gate;
    a.shared_inter = p.shared_intermediate;
    a.workspace = m_.moe_workspace_.get();
    a.workspace_bytes = m_.moe_workspace_.bytes();
    a.out = m_.proj_.get();
    if (!m_.counted_layers_.empty()) {
      const auto at = std::lower_bound(m_.counted_layers_.begin(), m_.counted_layers_.end(),
                                       m_.plan_.layer_begin + i);
      a.expert_counts = m_.expert_counts_.as<unsigned long long>() +
                        (at - m_.counted_layers_.begin()) * moe.num_experts;
      a.count_rows = slots_;  // padding rows (slot -1) are not counted
    }
    return cuda::moe_forward(a, *m_.gemm_, st_);
  }

  Status logits() {
    const LayerPlan& p = m_.plan_;
    if (m_.config_.sandwich_norms) {  // Gemma: the last post_feedforward_layernorm fused in
      TESSERA_RETURN_IF_ERROR(cuda::norm_add_rms_norm(
          dt_, m_.proj_.get(), m_.weights_->layer(p.num_layers() - 1).post_ff_norm,
          m_.residual_.get(), m_.weights_->final_norm(), T_, H_, eps_, m_.hidden_.get(), st_,
          unit_));
    } else if (proj_unreduced_) {  // all_reduce left proj to the final norm
      TESSERA_RETURN_IF_ERROR(reduce_add_rms_norm(m_.weights_->final_norm()));
    } else {
      TESSERA_RETURN_IF_ERROR(cuda::add_rms_norm(dt_, m_.proj_.get(), m_.residual_.get(),
                                                 m_.weights_->final_norm(), T_, H_, eps_,
                                                 m_.hidden_.get(), st_, unit_));
    }
    mark("final_norm");
    const int64_t R = plan_.rows;
    if (R == 0) return Status::ok();
    TESSERA_RETURN_IF_ERROR(
        cuda::gather_rows(dt_, m_.hidden_.get(), T_, lrows_, R, H_, m_.rows_.get(), st_));
    const int64_t V = m_.config_.vocab_size;
    if (p.parallel.tp_size == 1) {
      TESSERA_RETURN_IF_ERROR(gemm(R, V, H_, m_.rows_.get(), m_.weights_->lm_head(), nullptr,
                                   m_.logits_.get(), DType::kF32));
      mark("lm_head");
      return softcap(m_.logits_.as<float>(), R * V);
    }
    // Vocabulary-parallel: this rank's columns into its slot of [T][R][Vs], all-gathered in
    // place, then laid out whole per row.
    const int64_t Vs = p.vocab_shard;
    const int64_t Tp = p.parallel.tp_size;
    float* all = m_.shard_logits_.as<float>();
    float* mine = all + static_cast<int64_t>(p.parallel.tp_rank) * R * Vs;
    TESSERA_RETURN_IF_ERROR(
        gemm(R, Vs, H_, m_.rows_.get(), m_.weights_->lm_head(), nullptr, mine, DType::kF32));
    TESSERA_RETURN_IF_ERROR(softcap(mine, R * Vs));
    TESSERA_RETURN_IF_ERROR(m_.comms_.tp->all_gather(mine, R * Vs, DType::kF32, all, st_));
    for (int64_t t = 0; t < Tp; ++t) {
      const int64_t n = std::clamp<int64_t>(V - t * Vs, 0, Vs);
      if (n == 0) continue;
      TESSERA_CUDA_RETURN_IF_ERROR(
          cudaMemcpy2DAsync(m_.logits_.as<float>() + t * Vs, V * sizeof(float), all + t * R * Vs,
                            Vs * sizeof(float), n * sizeof(float), R, cudaMemcpyDeviceToDevice,
                            st_),
          "laying out the gathered logits");
    }
    return Status::ok();
  }

 private:
  // TESSERA_PROFILE_STEPS: the work enqueued since the last mark was `op` (within one of the
  // loop's ops: TimedOps marks the rest of it under the op's own name).
  void mark(const char* op) {
    if (timer_ != nullptr) timer_->mark(op, st_);
  }
  int64_t bytes(int64_t elems) const { return elems * static_cast<int64_t>(dtype_size(dt_)); }
  Status gemm(int64_t M, int64_t N, int64_t K, const void* x, const void* w, const void* b,
              void* out, DType out_dt) {
    cuda::GemmShape shape{M, N, K, dt_, out_dt, b != nullptr};
    return m_.gemm_->linear(shape, x, w, b, out, st_);
  }
  // Gemma 2's final soft-cap on the fp32 logits, as the CPU backend (logits / cap, tanh, * cap).
  Status softcap(float* logits, int64_t n) {
    const double cap = m_.config_.final_logit_softcapping;
    if (cap <= 0) return Status::ok();
    return cuda::softcap_logits(logits, n, static_cast<float>(cap), st_);
  }
  uint8_t* fp8_act() const { return m_.fp8_act_.as<uint8_t>(); }
  float* fp8_scales() const { return m_.fp8_scales_.as<float>(); }
  // out[M, N] = x[M, K] · Wᵀ (+ b) for a decoder linear layer: cuBLASLt for a plain weight, the
  // W4A16 kernels for an int4 one (then the bias, which they do not add), the FP8 GEMM for an
  // FP8 one, whose input is x as the op before quantized it into fp8_act / fp8_scales.
  Status linear(const CudaLinear& l, int64_t M, int64_t N, int64_t K, const void* x, const void* b,
                void* out) {
    if (l.is_fp8()) {
      cuda::Fp8GemmArgs a;
      a.m = M;
      a.n = N;
      a.k = K;
      a.out_dtype = dt_;
      a.x = fp8_act();
      a.x_scales = fp8_scales();
      a.w = l.fp8.w;
      a.w_scales = l.fp8.scales;
      a.bias = b;
      a.out = out;
      return m_.fp8_gemm_->linear(a, st_);
    }
    if (!l.int4()) return gemm(M, N, K, x, l.w, b, out, dt_);
    TESSERA_RETURN_IF_ERROR(cuda::w4_linear(l.w4, x, M, out, m_.w4_workspace_.get(),
                                            m_.w4_workspace_.bytes(), m_.gemm_.get(), st_));
    if (b == nullptr) return Status::ok();
    return cuda::add_bias(dt_, out, b, M, N, st_);
  }

  CudaModel& m_;
  const StepPlan& plan_;
  StepTimer* timer_ = nullptr;
  DType dt_ = DType::kBF16;
  bool norm_in_qkv_ = false;  // input_norm left its add and norm to qkv's kernel
  bool norm_in_mlp_ = false;  // post_norm left its add and norm to the MLP's first kernel
  bool proj_unreduced_ = false;  // all_reduce left proj's all-reduce to the norm after it
  int64_t T_ = 0, H_ = 0;
  float eps_ = 1e-6f;
  bool unit_ = false;  // Gemma's norms scale by 1 + w (ModelConfig::norm_unit_offset)
  cudaStream_t st_ = nullptr;
  const int32_t* ids_ = nullptr;
  const int64_t* slots_ = nullptr;  // the step's KV slots (-1: a padding row)
  const int32_t* lrows_ = nullptr;
  cuda::AttentionArgs a_;
  cuda::RopeCacheArgs r_;
};

// layer_loop.h's operations with a StepTimer mark after each (TESSERA_PROFILE_STEPS).
template <class Inner>
class TimedOps {
 public:
  TimedOps(Inner& ops, StepTimer& timer, cudaStream_t stream) : o_(ops), t_(timer), st_(stream) {}
  Status embed() { return done(o_.embed(), "embed"); }
  Status recv_hidden() { return done(o_.recv_hidden(), "recv_hidden"); }
  Status send_hidden() { return done(o_.send_hidden(), "send_hidden"); }
  Status all_reduce(Activation which) { return done(o_.all_reduce(which), "all_reduce"); }
  Status add_residual() { return done(o_.add_residual(), "add_residual"); }
  Status input_norm(int64_t i, bool add) { return done(o_.input_norm(i, add), "input_norm"); }
  Status qkv(int64_t i) { return done(o_.qkv(i), "qkv"); }
  Status rope_cache(int64_t i) { return done(o_.rope_cache(i), "rope_cache"); }
  Status attention(int64_t i) { return done(o_.attention(i), "attention"); }
  Status o_proj(int64_t i) { return done(o_.o_proj(i), "o_proj"); }
  Status post_norm(int64_t i) { return done(o_.post_norm(i), "post_norm"); }
  // A dense layer marks gate_up and its activation itself: the rest is down.
  Status mlp(int64_t i) { return done(o_.mlp(i), "mlp: down or MoE"); }
  Status logits() { return done(o_.logits(), "logits: softcap/gather"); }

 private:
  Status done(Status s, const char* op) {
    if (s.is_ok()) t_.mark(op, st_);
    return s;
  }
  Inner& o_;
  StepTimer& t_;
  cudaStream_t st_;
};

Status CudaModel::run(const StepPlan& plan, StepTimer* timer) {
  Ops ops(*this, plan, timer);
  if (timer == nullptr) return run_stage(ops, plan_);
  TimedOps<Ops> timed(ops, *timer, stream_);
  return run_stage(timed, plan_);
}

Expected<float*> CudaModel::forward(std::span<const ForwardSeq> batch, int64_t* rows,
                                    std::span<const TokenFill> fills) {
  bool decode = !batch.empty() && static_cast<int64_t>(batch.size()) <= engine_.max_num_seqs;
  for (const ForwardSeq& s : batch) decode = decode && s.tokens.size() == 1 && s.want_logits;
  int64_t pad_to = 0;
  if (decode) {
    auto it = std::lower_bound(decode_sizes_.begin(), decode_sizes_.end(),
                               static_cast<int64_t>(batch.size()));
    pad_to = it != decode_sizes_.end() ? *it : static_cast<int64_t>(batch.size());
  }
  TESSERA_ASSIGN_OR_RETURN(StepPlan plan, stage(batch, pad_to, fills));
  if (!counted_layers_.empty()) ++counted_steps_;
  if (decode) {
    cuda::SplitPlan sp =
        cuda::plan_attention_splits(static_cast<int>(plan.seqs), static_cast<int>(plan_.kv_heads),
                                    engine_.max_model_len, num_sms_);
    plan.num_splits = sp.num_splits;
    plan.split_size = sp.split_size;
  }
  auto g = decode ? graphs_.find(plan.seqs) : graphs_.end();
  if (decode && step_timer_ != nullptr) {
    TESSERA_RETURN_IF_ERROR(step_timer_->begin(stream_));
    TESSERA_RETURN_IF_ERROR(run(plan, step_timer_.get()));
    TESSERA_RETURN_IF_ERROR(step_timer_->end(plan.seqs));
  } else if (g != graphs_.end()) {
    TESSERA_CUDA_RETURN_IF_ERROR(
        cudaGraphLaunch(g->second->exec, stream_),
        "launching the decode graph for batch " + std::to_string(plan.seqs));
  } else {
    TESSERA_RETURN_IF_ERROR(run(plan));
  }
  if (!plan_.last_stage) {
    *rows = 0;
    return static_cast<float*>(nullptr);
  }
  *rows = plan.real_rows;
  return logits_.as<float>();
}

Status CudaModel::capture_graphs() {
  for (int64_t size : decode_sizes_) {
    StepPlan plan;
    TESSERA_ASSIGN_OR_RETURN(plan, stage({}, size));
    cuda::SplitPlan sp = cuda::plan_attention_splits(
        static_cast<int>(size), static_cast<int>(plan_.kv_heads), engine_.max_model_len, num_sms_);
    plan.num_splits = sp.num_splits;
    plan.split_size = sp.split_size;
    // Warm-up in eager mode: the GEMMs pick (and time) their algorithms for this batch size,
    // and every rank of the group runs the collectives together.
    TESSERA_RETURN_IF_ERROR(run(plan));
    TESSERA_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_), "warming up decode");
    if (engine_.enforce_eager) continue;
    auto graph = std::make_unique<Graph>();
    TESSERA_CUDA_RETURN_IF_ERROR(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal),
                                 "capturing the decode graph");
    Status captured = run(plan);
    cudaError_t end = cudaStreamEndCapture(stream_, &graph->graph);
    TESSERA_RETURN_IF_ERROR(captured);
    TESSERA_CUDA_RETURN_IF_ERROR(end,
                                 "capturing the decode graph for batch " + std::to_string(size));
    TESSERA_CUDA_RETURN_IF_ERROR(
        cudaGraphInstantiate(&graph->exec, graph->graph, 0),
        "instantiating the decode graph for batch " + std::to_string(size));
    TESSERA_CUDA_RETURN_IF_ERROR(cudaGraphUpload(graph->exec, stream_), "uploading a graph");
    graphs_[size] = std::move(graph);
  }
  TESSERA_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_), "capturing the decode graphs");
  return Status::ok();
}

Status CudaModel::size_kv_cache() {
  const ModelConfig& c = config_;
  const uint64_t block_bytes = 2ull * plan_.num_layers() * kv_block_bytes_per_layer();
  const int64_t min_blocks = (c.kv_tokens_per_sequence(engine_.max_model_len, engine_.block_size) +
                              engine_.block_size - 1) /
                             engine_.block_size;
  // Profiling step: the largest step the scheduler may send, one sequence as long as fits,
  // through a temporary cache. Every rank of the group runs it at once (the same ids).
  size_t free_before = 0, free_after = 0, total = 0;
  TESSERA_CUDA_RETURN_IF_ERROR(cudaMemGetInfo(&free_before, &total), "querying GPU memory");
  {
    const int64_t len = std::min(max_tokens_, engine_.max_model_len);
    const int64_t blocks = (len + engine_.block_size - 1) / engine_.block_size;
    TESSERA_RETURN_IF_ERROR(allocate_kv_cache(blocks));
    std::vector<int32_t> ids(static_cast<size_t>(len), 0);
    for (int64_t i = 0; i < len; ++i) ids[i] = static_cast<int32_t>((i * 7919) % c.vocab_size);
    std::vector<uint32_t> table(static_cast<size_t>(blocks));
    for (int64_t b = 0; b < blocks; ++b) table[b] = static_cast<uint32_t>(b);
    ForwardSeq seq{ids, 0, table, true};
    int64_t rows = 0;
    TESSERA_RETURN_IF_ERROR(forward({&seq, 1}, &rows).status());
    TESSERA_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_), "the profiling step");
    TESSERA_CUDA_RETURN_IF_ERROR(cudaMemGetInfo(&free_after, &total), "querying GPU memory");
    const uint64_t temp_kv = kv_storage_.bytes();
    memory_.profile_peak =
        free_before > free_after + temp_kv ? free_before - free_after - temp_kv : 0;
    kv_storage_.reset();
    kv_blocks_ = 0;
  }
  TESSERA_CUDA_RETURN_IF_ERROR(cudaMemGetInfo(&free_after, &total), "querying GPU memory");
  // This rank's own use: what it took since it started (its context is in used_at_start).
  const uint64_t own = free_at_start_ - free_after + memory_.profile_peak;
  memory_.graph_reserve = engine_.enforce_eager ? 0 : kGraphReserve;
  const uint64_t committed = own + memory_.graph_reserve;
  uint64_t room = memory_.budget > committed ? memory_.budget - committed : 0;
  // Whatever the budget says, the cache must fit in what is really free.
  const uint64_t free_now = free_after > memory_.graph_reserve + memory_.profile_peak
                                ? free_after - memory_.graph_reserve - memory_.profile_peak
                                : 0;
  room = std::min(room, free_now);
  const int64_t fit_blocks = static_cast<int64_t>(room / block_bytes);
  if (fit_blocks < min_blocks) {
    const int64_t fit_len = fit_blocks * engine_.block_size;
    std::string msg =
        "the KV cache does not fit on " + memory_.device_name + ": " +
        fmt::format(
            "{} allows this rank {:.2f} GiB, of which weights take "
            "{:.2f} GiB, activations {:.2f} GiB and CUDA graphs {:.2f} GiB ({:.2f} GiB free on "
            "the GPU), leaving {} KV blocks ({} tokens); ",
            utilization_text(), gib(memory_.budget), gib(memory_.weights),
            gib(memory_.activations + memory_.profile_peak), gib(memory_.graph_reserve),
            gib(free_after), fit_blocks, fit_len);
    msg += "one sequence of --max-model-len " + std::to_string(engine_.max_model_len) + " needs " +
           std::to_string(min_blocks) + " blocks. ";
    msg +=
        fit_len >= 16 ? "Lower --max-model-len to " + std::to_string(fit_len) + " or less, " : "";
    msg +=
        "raise --gpu-memory-utilization, spread the model over more GPUs "
        "(--tensor-parallel-size, --pipeline-parallel-size) or use a quantized checkpoint "
        "(--quantization awq|gptq)";
    return resource_exhausted(msg);
  }
  memory_.fit_blocks = fit_blocks;
  return Status::ok();
}

ExpertLoad CudaModel::expert_load() const {
  ExpertLoad load;
  if (counted_layers_.empty()) return load;
  const size_t n = counted_layers_.size() * static_cast<size_t>(config_.moe.num_experts);
  std::vector<unsigned long long> counts(n, 0);
  // A snapshot while steps may run: each count only grows (atomic adds on the device).
  if (cudaSetDevice(0) != cudaSuccess ||
      cudaMemcpy(counts.data(), expert_counts_.get(), n * sizeof(unsigned long long),
                 cudaMemcpyDeviceToHost) != cudaSuccess) {
    spdlog::warn("could not read the expert counts from the GPU: {}",
                 cudaGetErrorString(cudaGetLastError()));
    return load;
  }
  load.num_experts = config_.moe.num_experts;
  load.layers = counted_layers_;
  load.tokens.assign(counts.begin(), counts.end());
  load.steps = counted_steps_.load();
  return load;
}

Status CudaModel::init_cache(int64_t blocks) {
  if (blocks < 1 || blocks > memory_.fit_blocks) {
    return invalid_argument("init_cache: " + std::to_string(blocks) + " KV blocks asked, " +
                            std::to_string(memory_.fit_blocks) + " fit");
  }
  TESSERA_RETURN_IF_ERROR(allocate_kv_cache(blocks));
  memory_.kv_cache = kv_storage_.bytes();
  memory_.kv_blocks = blocks;
  const int64_t tokens = blocks * engine_.block_size;
  spdlog::info("# GPU blocks: {} ({} tokens; max concurrency {:.2f}x at max-model-len {})", blocks,
               tokens, static_cast<double>(tokens) / static_cast<double>(engine_.max_model_len),
               engine_.max_model_len);
  size_t free_a = 0, free_b = 0, total = 0;
  cudaMemGetInfo(&free_a, &total);
  TESSERA_RETURN_IF_ERROR(capture_graphs());
  if (expert_counts_.bytes() > 0) {  // the profiling and warm-up steps routed dummy tokens
    TESSERA_CUDA_RETURN_IF_ERROR(
        cudaMemsetAsync(expert_counts_.get(), 0, expert_counts_.bytes(), stream_),
        "clearing the expert counts");
    TESSERA_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_), "clearing the expert counts");
    counted_steps_ = 0;
  }
  cudaMemGetInfo(&free_b, &total);
  memory_.graphs = free_a > free_b ? free_a - free_b : 0;
  const GpuMemoryReport& r = memory_;
  spdlog::info(
      "GPU ({}, {:.1f} GiB): weights {:.2f} GiB, activations {:.2f} GiB, CUDA graphs {:.0f} "
      "MiB ({} sizes{}), KV cache {:.2f} GiB; this rank uses {:.2f} GiB of its {:.2f} GiB budget "
      "({})",
      r.device_name, gib(r.total), gib(r.weights), gib(r.activations + r.profile_peak),
      static_cast<double>(r.graphs) / kMiB, graphs_.size(),
      engine_.enforce_eager ? ", --enforce-eager" : "", gib(r.kv_cache),
      gib(free_at_start_ - free_b), gib(r.budget), utilization_text());
  if (r.graphs > r.graph_reserve && !engine_.enforce_eager) {
    spdlog::warn("CUDA graphs took {:.0f} MiB, more than the {:.0f} MiB reserved for them",
                 static_cast<double>(r.graphs) / kMiB, static_cast<double>(r.graph_reserve) / kMiB);
  }
  return Status::ok();
}

Expected<std::unique_ptr<CudaModel>> CudaModel::create(const ModelConfig& config,
                                                       const LayerPlan& plan,
                                                       const ModelWeights& host_weights,
                                                       StageComms comms, const EngineSpec& engine,
                                                       int gpu_shares) {
  TESSERA_RETURN_IF_ERROR(check_resolved(engine));
  TESSERA_ASSIGN_OR_RETURN(const QuantConfig quant,
                           resolve_quantization(engine.quantization, config.quant));
  const bool fp8 = quant.method == QuantMethod::kFp8;
  if ((quant.method == QuantMethod::kGptq && quant.bits != 4) ||
      (fp8 && quant.activations == Fp8Activations::kNone)) {
    return failed_precondition("the CUDA backend does not run " + quant.describe() +
                               " weights yet: run this model with --device cpu (the reference), "
                               "or an AWQ / 4-bit GPTQ / FP8 W8A8 checkpoint on the GPU");
  }
  if (fp8 && config.hidden_size > 32768) {  // cuda::rms_norm_fp8's bound
    return invalid_argument("hidden_size " + std::to_string(config.hidden_size) +
                            " is above the CUDA backend's FP8 norm's 32768: use --device cpu");
  }
  if (config.moe.enabled() && quant.method != QuantMethod::kNone) {
    return failed_precondition(std::string(architecture_name(config.arch)) +
                               ": the CUDA backend runs mixture-of-experts models unquantized "
                               "for now (" +
                               quant.describe() + " asked): use a bf16/fp16 checkpoint");
  }
  if (config.moe.enabled() &&
      (config.hidden_size % 8 != 0 || plan.moe_intermediate % 8 != 0 || plan.experts > 4096 ||
       config.moe.num_experts > 4096 || config.moe.top_k > 32)) {
    // kernels/cuda/moe.h's bounds: 16-byte rows, the router's and the combine's shared memory.
    return invalid_argument(
        "the CUDA backend's MoE kernels need hidden_size (" + std::to_string(config.hidden_size) +
        ") and each expert's width on a rank (moe_intermediate_size / -tp = " +
        std::to_string(plan.moe_intermediate) + ") multiples of 8, at most 4096 experts and " +
        "num_experts_per_tok <= 32: use --device cpu or another -tp");
  }
  const DType dtype = run_dtype(engine);
  if (!cuda::is_half_type(dtype)) {
    return invalid_argument("the CUDA backend runs in bfloat16 or float16, not " +
                            std::string(dtype_name(dtype)));
  }
  if (config.rotary_dim != 0 && config.rotary_dim != config.head_dim && config.qk_norm) {
    // cuda::rope_and_cache's partial-rotary path has no per-head norms (no such model yet).
    return invalid_argument("partial rotary embeddings (rotary_dim " +
                            std::to_string(config.rotary_dim) + " of head_dim " +
                            std::to_string(config.head_dim) +
                            ") with q/k norms are not on the CUDA backend: use --device cpu");
  }
  if ((config.activation == MlpActivation::kGeluTanh || config.norm_unit_offset) && fp8) {
    // The FP8 path fuses the activation (cuda::silu_mul_fp8: silu only) and the norms
    // (cuda::rms_norm_fp8: Llama's weight, not Gemma's 1 + w) with the quantization.
    return failed_precondition(std::string(architecture_name(config.arch)) +
                               ": the CUDA backend runs Gemma's GeGLU and (1 + w) norms in "
                               "bf16/fp16, not FP8, for now: use --device cpu for FP8");
  }
  if (config.head_dim > 1024) {  // cuda::paged_attention's and rope_and_cache's bound
    return invalid_argument("head_dim " + std::to_string(config.head_dim) +
                            " is above the CUDA backend's 1024 (no released model has one): use "
                            "--device cpu");
  }
  std::unique_ptr<CudaModel> m(new CudaModel(config, plan, comms, engine, gpu_shares));
  TESSERA_CUDA_RETURN_IF_ERROR(cudaSetDevice(0), "selecting GPU 0");
  TESSERA_CUDA_RETURN_IF_ERROR(cudaFree(nullptr), "creating the CUDA context");
  cudaDeviceProp prop{};
  TESSERA_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, 0), "querying GPU 0");
  m->num_sms_ = prop.multiProcessorCount;
  m->memory_.device_name = prop.name;
  size_t free0 = 0, total = 0;
  TESSERA_CUDA_RETURN_IF_ERROR(cudaMemGetInfo(&free0, &total), "querying GPU memory");
  m->free_at_start_ = free0;
  m->memory_.total = total;
  m->memory_.budget = static_cast<uint64_t>(engine.gpu_memory_utilization *
                                            static_cast<double>(total) / m->gpu_shares_);
  m->memory_.used_at_start = total - free0;
  m->max_tokens_ = std::max(engine.max_num_batched_tokens, engine.max_num_seqs);
  m->max_blocks_per_seq_ = (engine.max_model_len + engine.block_size - 1) / engine.block_size;
  // Would the weights and activations fit at all? Check before touching the GPU's memory.
  {
    TESSERA_ASSIGN_OR_RETURN(const uint64_t weights,
                             CudaWeights::bytes_needed(config, plan, quant, dtype));
    // Step buffers, quantized and MoE workspaces, as the planner counts them.
    const uint64_t activations =
        plan.activation_bytes(config, quant, dtype, m->max_tokens_, engine.max_num_seqs);
    const uint64_t min_kv = static_cast<uint64_t>(m->max_blocks_per_seq_) * 2 * plan.num_layers() *
                            m->kv_block_bytes_per_layer();
    // While the weights load, a checkpoint in another dtype crosses through device staging,
    // freed before the activations are allocated: the peak is the larger of the two.
    const uint64_t staging = CudaWeights::kConvertStagingBytes;
    const uint64_t need = weights + std::max(activations + min_kv, staging);
    const uint64_t available = std::min<uint64_t>(m->memory_.budget, free0);
    if (need > available) {
      const std::string load_peak =
          staging > activations + min_kv
              ? fmt::format(
                    " (the load's {} MiB of dtype-conversion staging, more than "
                    "activations and KV cache, counts instead)",
                    staging / kMiB)
              : "";
      return resource_exhausted(fmt::format(
          "the model does not fit on {}: this rank's weights {:.2f} GiB + activations for "
          "--max-num-batched-tokens {} {:.2f} GiB + the KV cache of one --max-model-len {} "
          "sequence {:.2f} GiB = {:.2f} GiB{}, but {} allows {:.2f} "
          "GiB ({:.2f} GiB are free: {:.2f} GiB are in use by others). Lower --max-model-len or "
          "--max-num-batched-tokens, raise --gpu-memory-utilization, spread the model over more "
          "GPUs (--tensor-parallel-size, --pipeline-parallel-size) or use a quantized checkpoint "
          "(--quantization awq|gptq)",
          prop.name, gib(weights), m->max_tokens_, gib(activations), engine.max_model_len,
          gib(min_kv), gib(need), load_peak, m->utilization_text(), gib(m->memory_.budget),
          gib(free0), gib(m->memory_.used_at_start)));
    }
  }
  TESSERA_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&m->stream_, cudaStreamNonBlocking),
                               "creating the model's stream");
  TESSERA_ASSIGN_OR_RETURN(
      m->weights_, CudaWeights::upload(config, plan, host_weights, quant, dtype, m->stream_));
  m->memory_.weights = m->weights_->bytes();
  // TESSERA_GEMM_AUTOTUNE=1 times cuBLASLt's candidates per shape (the default takes the
  // heuristic's first choice: reproducible across runs).
  const char* tune = std::getenv("TESSERA_GEMM_AUTOTUNE");
  // TESSERA_ATTENTION_BACKEND=tiles|hopper forces an attention kernel (default auto: the
  // Hopper kernel for prefill-heavy steps where it applies, the tile kernel otherwise).
  if (const char* backend = std::getenv("TESSERA_ATTENTION_BACKEND"); backend != nullptr) {
    auto kernel = cuda::parse_attention_kernel(backend);
    if (!kernel.has_value()) {
      return invalid_argument("TESSERA_ATTENTION_BACKEND: " + kernel.status().message() +
                              "; set one of those or unset it");
    }
    m->attention_kernel_ = kernel.value();
  }
  TESSERA_ASSIGN_OR_RETURN(
      m->gemm_, cuda::Gemm::create(32u << 20, tune != nullptr && std::string(tune) == "1"));
  m->memory_.activations += 32 * kMiB;  // the GEMM workspace
  TESSERA_RETURN_IF_ERROR(m->create_fp8_gemm());
  if (plan.last_stage && plan.parallel.tp_rank == 0) {
    TESSERA_ASSIGN_OR_RETURN(m->sampler_,
                             cuda::GpuSampler::create(static_cast<int>(engine.max_num_seqs),
                                                      config.vocab_size, kMaxLogprobs, m->stream_));
  }
  TESSERA_RETURN_IF_ERROR(m->allocate_buffers());
  // Decode batch sizes: 1, 2, 4, 8, then multiples of 8, and max_num_seqs itself.
  for (int64_t b : {1, 2, 4}) {
    if (b <= engine.max_num_seqs) m->decode_sizes_.push_back(b);
  }
  for (int64_t b = 8; b <= engine.max_num_seqs; b += 8) m->decode_sizes_.push_back(b);
  if (m->decode_sizes_.back() != engine.max_num_seqs) {
    m->decode_sizes_.push_back(engine.max_num_seqs);
  }
  TESSERA_RETURN_IF_ERROR(m->size_kv_cache());
  return m;
}

}  // namespace tessera
