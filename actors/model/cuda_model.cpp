#include "actors/model/cuda_model.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "kernels/cpu/rope.h"
#include "kernels/cuda/attention.h"
#include "kernels/cuda/elementwise.h"

namespace tessera {

namespace {

constexpr uint64_t kGiB = 1ull << 30;
constexpr uint64_t kMiB = 1ull << 20;
constexpr size_t kAlign = 256;
constexpr uint64_t kGraphReserve = 512 * kMiB;

size_t align_up(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }
double gib(uint64_t b) { return static_cast<double>(b) / static_cast<double>(kGiB); }

// Converts n elements of `src` (any dtype) into `dst` (kBF16 or kF16) on the host.
void convert_host(const TensorView& src, int64_t first, int64_t n, DType to, uint16_t* dst) {
  for (int64_t i = 0; i < n; ++i) {
    float f = src.at(first + i);
    dst[i] = to == DType::kBF16 ? float_to_bf16(f) : float_to_f16(f);
  }
}

// Copies host tensors into device memory through two pinned staging chunks, converting the
// dtype on the way when it differs.
class Uploader {
 public:
  static constexpr size_t kChunk = 64 * kMiB;

  static Expected<std::unique_ptr<Uploader>> create(cudaStream_t stream) {
    auto u = std::unique_ptr<Uploader>(new Uploader());
    u->stream_ = stream;
    for (int i = 0; i < 2; ++i) {
      TESSERA_CUDA_RETURN_IF_ERROR(cudaHostAlloc(&u->staging_[i], kChunk, cudaHostAllocDefault),
                                   "allocating pinned staging memory for the weights");
      TESSERA_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&u->done_[i], cudaEventDisableTiming),
                                   "creating an upload event");
    }
    return u;
  }
  ~Uploader() {
    cudaStreamSynchronize(stream_);
    for (int i = 0; i < 2; ++i) {
      if (staging_[i] != nullptr) cudaFreeHost(staging_[i]);
      if (done_[i] != nullptr) cudaEventDestroy(done_[i]);
    }
  }

  // Writes `src` (converted to `to`) at device address `dst`.
  Status upload(const TensorView& src, DType to, void* dst, const std::string& name) {
    const size_t esize = dtype_size(to);
    const int64_t n = src.numel();
    const int64_t per_chunk = static_cast<int64_t>(kChunk / esize);
    for (int64_t first = 0; first < n; first += per_chunk) {
      const int64_t count = std::min(per_chunk, n - first);
      const int slot = next_++ % 2;
      TESSERA_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(done_[slot]), "uploading " + name);
      if (src.dtype == to) {
        std::memcpy(staging_[slot], static_cast<const char*>(src.data) + first * esize,
                    static_cast<size_t>(count) * esize);
      } else {
        convert_host(src, first, count, to, static_cast<uint16_t*>(staging_[slot]));
      }
      TESSERA_CUDA_RETURN_IF_ERROR(
          cudaMemcpyAsync(static_cast<char*>(dst) + first * esize, staging_[slot],
                          static_cast<size_t>(count) * esize, cudaMemcpyHostToDevice, stream_),
          "uploading " + name);
      TESSERA_CUDA_RETURN_IF_ERROR(cudaEventRecord(done_[slot], stream_), "uploading " + name);
    }
    return Status::ok();
  }

 private:
  Uploader() = default;
  cudaStream_t stream_ = nullptr;
  void* staging_[2] = {nullptr, nullptr};
  cudaEvent_t done_[2] = {nullptr, nullptr};
  int next_ = 0;
};

// Offsets of the step metadata inside one device block (and its pinned mirror).
struct MetaLayout {
  size_t ids = 0, positions = 0, slots = 0, cu_q = 0, ctx = 0, logit_rows = 0, tables = 0,
         bytes = 0;
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
    m.bytes = at;
    return m;
  }
};

}  // namespace

struct CudaModel::Layer {
  const void* input_norm = nullptr;
  const void* post_norm = nullptr;
  const void* qkv = nullptr;       // [q_dim + 2 kv_dim, hidden]
  const void* qkv_bias = nullptr;  // [q_dim + 2 kv_dim] or null
  const void* o = nullptr;         // [hidden, q_dim]
  const void* o_bias = nullptr;    // [hidden] or null
  const void* q_norm = nullptr;    // [head_dim] or null
  const void* k_norm = nullptr;
  const void* gate_up = nullptr;  // [2 inter, hidden]
  const void* down = nullptr;     // [hidden, inter]
};

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
  int max_query_len = 0;
  int num_splits = 1;
  int split_size = 0;
  bool decode = false;
};

CudaModel::CudaModel(const ModelConfig& config, const CudaModelOptions& options)
    : config_(config), options_(options) {}

CudaModel::~CudaModel() {
  graphs_.clear();
  if (stream_ != nullptr) cudaStreamSynchronize(stream_);
  if (meta_host_ != nullptr) cudaFreeHost(meta_host_);
  sampler_.reset();
  gemm_.reset();
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
}

std::vector<int64_t> CudaModel::graph_sizes() const {
  std::vector<int64_t> out;
  for (const auto& [size, g] : graphs_) out.push_back(size);
  return out;
}

namespace {

int64_t qkv_rows(const ModelConfig& c) { return (c.num_heads + 2 * c.num_kv_heads) * c.head_dim; }

}  // namespace

Status CudaModel::upload_weights(const ModelWeights& w) {
  const ModelConfig& c = config_;
  const DType dt = options_.dtype;
  const size_t es = dtype_size(dt);
  const int64_t H = c.hidden_size, I = c.intermediate_size;
  const int64_t q_dim = c.num_heads * c.head_dim, kv_dim = c.num_kv_heads * c.head_dim;
  const bool tied = w.lm_head.data == w.embed.data;

  // Layout pass: offsets of every region in one allocation.
  size_t at = 0;
  auto take = [&](int64_t elems) {
    size_t o = at;
    at = align_up(at + static_cast<size_t>(elems) * es);
    return o;
  };
  struct LayerOffsets {
    size_t input_norm, post_norm, qkv, qkv_bias, o, o_bias, q_norm, k_norm, gate_up, down;
  };
  std::vector<LayerOffsets> lo(w.layers.size());
  const size_t embed_off = take(c.vocab_size * H);
  const size_t final_norm_off = take(H);
  const size_t lm_head_off = tied ? embed_off : take(c.vocab_size * H);
  for (size_t i = 0; i < w.layers.size(); ++i) {
    const LayerWeights& l = w.layers[i];
    LayerOffsets& o = lo[i];
    o.input_norm = take(H);
    o.post_norm = take(H);
    o.qkv = take(qkv_rows(c) * H);
    o.qkv_bias = l.q_bias.data ? take(qkv_rows(c)) : SIZE_MAX;
    o.o = take(H * q_dim);
    o.o_bias = l.o_bias.data ? take(H) : SIZE_MAX;
    o.q_norm = l.q_norm.data ? take(c.head_dim) : SIZE_MAX;
    o.k_norm = l.k_norm.data ? take(c.head_dim) : SIZE_MAX;
    o.gate_up = take(2 * I * H);
    o.down = take(H * I);
  }
  TESSERA_ASSIGN_OR_RETURN(weight_storage_, cuda::DeviceBuffer::allocate(at, "the weights"));
  memory_.weights = at;
  char* base = weight_storage_.as<char>();
  TESSERA_ASSIGN_OR_RETURN(auto up, Uploader::create(stream_));
  auto put = [&](const TensorView& t, size_t offset, const std::string& name) {
    return up->upload(t, dt, base + offset, name);
  };
  TESSERA_RETURN_IF_ERROR(put(w.embed, embed_off, "model.embed_tokens.weight"));
  TESSERA_RETURN_IF_ERROR(put(w.final_norm, final_norm_off, "model.norm.weight"));
  if (!tied) TESSERA_RETURN_IF_ERROR(put(w.lm_head, lm_head_off, "lm_head.weight"));
  embed_ = base + embed_off;
  final_norm_ = base + final_norm_off;
  lm_head_ = base + lm_head_off;
  layers_.resize(w.layers.size());
  for (size_t i = 0; i < w.layers.size(); ++i) {
    const LayerWeights& l = w.layers[i];
    const LayerOffsets& o = lo[i];
    Layer& d = layers_[i];
    const std::string p = "model.layers." + std::to_string(i) + ".";
    TESSERA_RETURN_IF_ERROR(put(l.input_norm, o.input_norm, p + "input_layernorm.weight"));
    TESSERA_RETURN_IF_ERROR(put(l.post_norm, o.post_norm, p + "post_attention_layernorm.weight"));
    // q | k | v stacked along the output dimension: one GEMM computes all three.
    TESSERA_RETURN_IF_ERROR(put(l.q_proj, o.qkv, p + "self_attn.q_proj.weight"));
    TESSERA_RETURN_IF_ERROR(put(l.k_proj, o.qkv + q_dim * H * es, p + "self_attn.k_proj.weight"));
    TESSERA_RETURN_IF_ERROR(
        put(l.v_proj, o.qkv + (q_dim + kv_dim) * H * es, p + "self_attn.v_proj.weight"));
    if (o.qkv_bias != SIZE_MAX) {
      TESSERA_RETURN_IF_ERROR(put(l.q_bias, o.qkv_bias, p + "self_attn.q_proj.bias"));
      TESSERA_RETURN_IF_ERROR(put(l.k_bias, o.qkv_bias + q_dim * es, p + "self_attn.k_proj.bias"));
      TESSERA_RETURN_IF_ERROR(
          put(l.v_bias, o.qkv_bias + (q_dim + kv_dim) * es, p + "self_attn.v_proj.bias"));
      d.qkv_bias = base + o.qkv_bias;
    }
    TESSERA_RETURN_IF_ERROR(put(l.o_proj, o.o, p + "self_attn.o_proj.weight"));
    if (o.o_bias != SIZE_MAX) {
      TESSERA_RETURN_IF_ERROR(put(l.o_bias, o.o_bias, p + "self_attn.o_proj.bias"));
      d.o_bias = base + o.o_bias;
    }
    if (o.q_norm != SIZE_MAX) {
      TESSERA_RETURN_IF_ERROR(put(l.q_norm, o.q_norm, p + "self_attn.q_norm.weight"));
      TESSERA_RETURN_IF_ERROR(put(l.k_norm, o.k_norm, p + "self_attn.k_norm.weight"));
      d.q_norm = base + o.q_norm;
      d.k_norm = base + o.k_norm;
    }
    // gate | up stacked: one GEMM, silu_mul reads both halves of each row.
    TESSERA_RETURN_IF_ERROR(put(l.gate_proj, o.gate_up, p + "mlp.gate_proj.weight"));
    TESSERA_RETURN_IF_ERROR(put(l.up_proj, o.gate_up + I * H * es, p + "mlp.up_proj.weight"));
    TESSERA_RETURN_IF_ERROR(put(l.down_proj, o.down, p + "mlp.down_proj.weight"));
    d.input_norm = base + o.input_norm;
    d.post_norm = base + o.post_norm;
    d.qkv = base + o.qkv;
    d.o = base + o.o;
    d.gate_up = base + o.gate_up;
    d.down = base + o.down;
  }
  TESSERA_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_), "uploading the weights");
  return Status::ok();
}

Status CudaModel::allocate_buffers() {
  const ModelConfig& c = config_;
  const size_t es = dtype_size(options_.dtype);
  const int64_t T = max_tokens_, S = options_.max_num_seqs;
  const int64_t q_dim = c.num_heads * c.head_dim;
  uint64_t total = 0;
  auto alloc = [&](cuda::DeviceBuffer& b, size_t bytes, const char* what) -> Status {
    TESSERA_ASSIGN_OR_RETURN(b, cuda::DeviceBuffer::allocate(bytes, what));
    total += bytes;
    return Status::ok();
  };
  TESSERA_RETURN_IF_ERROR(alloc(residual_, T * c.hidden_size * es, "the residual stream"));
  TESSERA_RETURN_IF_ERROR(alloc(hidden_, T * c.hidden_size * es, "normed activations"));
  TESSERA_RETURN_IF_ERROR(alloc(qkv_, T * qkv_rows(c) * es, "q/k/v activations"));
  TESSERA_RETURN_IF_ERROR(alloc(q_, T * q_dim * es, "rotated queries"));
  TESSERA_RETURN_IF_ERROR(alloc(attn_, T * q_dim * es, "attention output"));
  TESSERA_RETURN_IF_ERROR(alloc(proj_, T * c.hidden_size * es, "projection output"));
  TESSERA_RETURN_IF_ERROR(alloc(gate_up_, T * 2 * c.intermediate_size * es, "gate/up"));
  TESSERA_RETURN_IF_ERROR(alloc(act_, T * c.intermediate_size * es, "MLP activations"));
  TESSERA_RETURN_IF_ERROR(alloc(rows_, S * c.hidden_size * es, "logit rows"));
  TESSERA_RETURN_IF_ERROR(alloc(logits_, S * c.vocab_size * sizeof(float), "logits"));
  const cuda::SplitPlan widest = cuda::plan_attention_splits(1, static_cast<int>(c.num_kv_heads),
                                                             options_.max_model_len, num_sms_);
  int max_splits = widest.num_splits;
  for (int64_t b = 2; b <= S; b *= 2) {
    max_splits = std::max(max_splits, cuda::plan_attention_splits(static_cast<int>(b),
                                                                  static_cast<int>(c.num_kv_heads),
                                                                  options_.max_model_len, num_sms_)
                                          .num_splits);
  }
  const size_t ws = cuda::attention_workspace_bytes(S, static_cast<int>(c.num_heads),
                                                    static_cast<int>(c.head_dim), max_splits);
  TESSERA_RETURN_IF_ERROR(alloc(attn_workspace_, std::max<size_t>(ws, 256), "split-K attention"));
  MetaLayout m = MetaLayout::make(T, S, max_blocks_per_seq_);
  meta_bytes_ = m.bytes;
  TESSERA_RETURN_IF_ERROR(alloc(meta_, m.bytes, "step metadata"));
  TESSERA_CUDA_RETURN_IF_ERROR(cudaHostAlloc(&meta_host_, m.bytes, cudaHostAllocDefault),
                               "allocating pinned step metadata");
  std::memset(meta_host_, 0, m.bytes);
  // The RoPE tables, computed on the host exactly as the CPU backend does.
  std::optional<cpu::Llama3RopeScaling> scaling;
  if (c.rope_scaling.type == "llama3") {
    scaling = cpu::Llama3RopeScaling{c.rope_scaling.factor, c.rope_scaling.low_freq_factor,
                                     c.rope_scaling.high_freq_factor,
                                     c.rope_scaling.original_max_position_embeddings};
  }
  TESSERA_ASSIGN_OR_RETURN(
      cpu::RopeTable rope,
      cpu::RopeTable::create(c.head_dim, c.rope_theta, options_.max_model_len, scaling));
  const size_t table = static_cast<size_t>(options_.max_model_len * c.head_dim / 2) * 4;
  TESSERA_RETURN_IF_ERROR(alloc(rope_cos_, table, "RoPE cos table"));
  TESSERA_RETURN_IF_ERROR(alloc(rope_sin_, table, "RoPE sin table"));
  TESSERA_CUDA_RETURN_IF_ERROR(
      cudaMemcpy(rope_cos_.get(), rope.cos(0), table, cudaMemcpyHostToDevice), "RoPE table");
  TESSERA_CUDA_RETURN_IF_ERROR(
      cudaMemcpy(rope_sin_.get(), rope.sin(0), table, cudaMemcpyHostToDevice), "RoPE table");
  memory_.activations += total;
  return Status::ok();
}

Status CudaModel::allocate_kv_cache(int64_t blocks) {
  const ModelConfig& c = config_;
  const size_t per_layer =
      static_cast<size_t>(blocks * options_.block_size * c.num_kv_heads * c.head_dim) *
      dtype_size(options_.dtype);
  const size_t stride = align_up(per_layer);
  TESSERA_ASSIGN_OR_RETURN(kv_storage_,
                           cuda::DeviceBuffer::allocate(stride * 2 * c.num_layers, "the KV cache"));
  TESSERA_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(kv_storage_.get(), 0, kv_storage_.bytes(), stream_),
                               "clearing the KV cache");
  k_cache_.assign(c.num_layers, nullptr);
  v_cache_.assign(c.num_layers, nullptr);
  for (int64_t l = 0; l < c.num_layers; ++l) {
    k_cache_[l] = kv_storage_.as<char>() + stride * (2 * l);
    v_cache_[l] = kv_storage_.as<char>() + stride * (2 * l + 1);
  }
  kv_blocks_ = blocks;
  return Status::ok();
}

Expected<CudaModel::StepPlan> CudaModel::stage(std::span<const ForwardSeq> batch, int64_t pad_to) {
  const ModelConfig& c = config_;
  const int64_t bs = options_.block_size;
  const int64_t S_real = static_cast<int64_t>(batch.size());
  const int64_t S = std::max(pad_to, S_real);
  if (S > options_.max_num_seqs) {
    return invalid_argument("the step has " + std::to_string(S) + " sequences, more than " +
                            "max-num-seqs " + std::to_string(options_.max_num_seqs));
  }
  MetaLayout m = MetaLayout::make(max_tokens_, options_.max_num_seqs, max_blocks_per_seq_);
  char* h = static_cast<char*>(meta_host_);
  auto* ids = reinterpret_cast<int32_t*>(h + m.ids);
  auto* pos = reinterpret_cast<int32_t*>(h + m.positions);
  auto* slots = reinterpret_cast<int64_t*>(h + m.slots);
  auto* cu_q = reinterpret_cast<int32_t*>(h + m.cu_q);
  auto* ctx = reinterpret_cast<int32_t*>(h + m.ctx);
  auto* lrows = reinterpret_cast<int32_t*>(h + m.logit_rows);
  auto* tables = reinterpret_cast<int32_t*>(h + m.tables);
  StepPlan plan;
  int64_t t = 0, r = 0;
  cu_q[0] = 0;
  for (int64_t s = 0; s < S_real; ++s) {
    const ForwardSeq& seq = batch[s];
    const int64_t n = static_cast<int64_t>(seq.tokens.size());
    if (n == 0) return invalid_argument("a sequence in the batch has no tokens");
    const int64_t end = seq.start_position + n;
    if (seq.start_position < 0 || end > options_.max_model_len) {
      return invalid_argument("positions up to " + std::to_string(end) + " exceed max-model-len " +
                              std::to_string(options_.max_model_len));
    }
    const int64_t nb = static_cast<int64_t>(seq.block_table.size());
    if (nb * bs < end) {
      return invalid_argument("the block table holds " + std::to_string(nb * bs) +
                              " tokens, the sequence needs " + std::to_string(end));
    }
    if (nb > max_blocks_per_seq_) {
      return invalid_argument("the block table has " + std::to_string(nb) + " blocks, more than " +
                              std::to_string(max_blocks_per_seq_) + " (max-model-len)");
    }
    if (t + n > max_tokens_) {
      return invalid_argument("the step has more than " + std::to_string(max_tokens_) +
                              " tokens (max-num-batched-tokens)");
    }
    for (int64_t b = 0; b < nb; ++b) {
      if (static_cast<int64_t>(seq.block_table[b]) >= kv_blocks_) {
        return invalid_argument("block " + std::to_string(seq.block_table[b]) +
                                " is outside the KV cache (" + std::to_string(kv_blocks_) +
                                " blocks)");
      }
      tables[s * max_blocks_per_seq_ + b] = static_cast<int32_t>(seq.block_table[b]);
    }
    for (int64_t i = 0; i < n; ++i) {
      const int32_t id = seq.tokens[i];
      if (id < 0 || id >= c.vocab_size) {
        return invalid_argument("token id " + std::to_string(id) + " is outside the vocabulary (" +
                                std::to_string(c.vocab_size) + ")");
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
  // Copy only the used prefix of each array (the device layout is fixed for the graphs).
  char* d = meta_.as<char>();
  auto copy = [&](size_t offset, size_t bytes) -> Status {
    if (bytes == 0) return Status::ok();
    TESSERA_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(d + offset, h + offset, bytes, cudaMemcpyHostToDevice, stream_),
        "copying the step metadata");
    return Status::ok();
  };
  TESSERA_RETURN_IF_ERROR(copy(m.slots, sizeof(int64_t) * t));
  TESSERA_RETURN_IF_ERROR(copy(m.ids, sizeof(int32_t) * t));
  TESSERA_RETURN_IF_ERROR(copy(m.positions, sizeof(int32_t) * t));
  TESSERA_RETURN_IF_ERROR(copy(m.cu_q, sizeof(int32_t) * (S + 1)));
  TESSERA_RETURN_IF_ERROR(copy(m.ctx, sizeof(int32_t) * S));
  TESSERA_RETURN_IF_ERROR(copy(m.logit_rows, sizeof(int32_t) * r));
  TESSERA_RETURN_IF_ERROR(copy(m.tables, sizeof(int32_t) * S * max_blocks_per_seq_));
  return plan;
}

Status CudaModel::run_layers(const StepPlan& plan) {
  const ModelConfig& c = config_;
  const DType dt = options_.dtype;
  const int64_t T = plan.tokens;
  const int64_t H = c.hidden_size, I = c.intermediate_size;
  const int64_t q_dim = c.num_heads * c.head_dim;
  const float eps = static_cast<float>(c.rms_norm_eps);
  MetaLayout m = MetaLayout::make(max_tokens_, options_.max_num_seqs, max_blocks_per_seq_);
  char* meta = meta_.as<char>();
  const auto* ids = reinterpret_cast<const int32_t*>(meta + m.ids);
  const auto* pos = reinterpret_cast<const int32_t*>(meta + m.positions);
  const auto* slots = reinterpret_cast<const int64_t*>(meta + m.slots);
  const auto* cu_q = reinterpret_cast<const int32_t*>(meta + m.cu_q);
  const auto* ctx = reinterpret_cast<const int32_t*>(meta + m.ctx);
  const auto* lrows = reinterpret_cast<const int32_t*>(meta + m.logit_rows);
  const auto* tables = reinterpret_cast<const int32_t*>(meta + m.tables);
  cudaStream_t st = stream_;
  auto gemm = [&](int64_t M, int64_t N, int64_t K, const void* x, const void* w, const void* b,
                  void* out, DType out_dt) {
    cuda::GemmShape shape{M, N, K, dt, out_dt, b != nullptr};
    return gemm_->linear(shape, x, w, b, out, st);
  };

  TESSERA_RETURN_IF_ERROR(
      cuda::embedding(dt, ids, T, embed_, c.vocab_size, H, residual_.get(), st));
  cuda::AttentionArgs a;
  a.dtype = dt;
  a.q = q_.get();
  a.out = attn_.get();
  a.num_blocks = kv_blocks_;
  a.block_size = static_cast<int>(options_.block_size);
  a.cu_query_lens = cu_q;
  a.context_lens = ctx;
  a.block_tables = tables;
  a.block_table_stride = static_cast<int>(max_blocks_per_seq_);
  a.num_seqs = static_cast<int>(plan.seqs);
  a.max_query_len = plan.max_query_len;
  a.num_heads = static_cast<int>(c.num_heads);
  a.num_kv_heads = static_cast<int>(c.num_kv_heads);
  a.head_dim = static_cast<int>(c.head_dim);
  a.scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
  a.num_splits = plan.num_splits;
  a.split_size = plan.split_size;
  a.workspace = plan.num_splits > 1 ? attn_workspace_.get() : nullptr;
  a.total_q = T;
  cuda::RopeCacheArgs r;
  r.dtype = dt;
  r.qkv = qkv_.get();
  r.eps = eps;
  r.cos = rope_cos_.as<float>();
  r.sin = rope_sin_.as<float>();
  r.max_position = options_.max_model_len;
  r.positions = pos;
  r.slots = slots;
  r.num_tokens = T;
  r.num_heads = c.num_heads;
  r.num_kv_heads = c.num_kv_heads;
  r.head_dim = c.head_dim;
  r.q_out = q_.get();
  r.num_blocks = kv_blocks_;
  r.block_size = options_.block_size;

  for (int64_t l = 0; l < c.num_layers; ++l) {
    const Layer& w = layers_[static_cast<size_t>(l)];
    if (l == 0) {
      TESSERA_RETURN_IF_ERROR(
          cuda::rms_norm(dt, residual_.get(), w.input_norm, T, H, eps, hidden_.get(), st));
    } else {
      TESSERA_RETURN_IF_ERROR(cuda::add_rms_norm(dt, proj_.get(), residual_.get(), w.input_norm, T,
                                                 H, eps, hidden_.get(), st));
    }
    TESSERA_RETURN_IF_ERROR(
        gemm(T, qkv_rows(c), H, hidden_.get(), w.qkv, w.qkv_bias, qkv_.get(), dt));
    r.q_norm = w.q_norm;
    r.k_norm = w.k_norm;
    r.k_cache = k_cache_[l];
    r.v_cache = v_cache_[l];
    TESSERA_RETURN_IF_ERROR(cuda::rope_and_cache(r, st));
    a.k_cache = k_cache_[l];
    a.v_cache = v_cache_[l];
    TESSERA_RETURN_IF_ERROR(cuda::paged_attention(a, st));
    TESSERA_RETURN_IF_ERROR(gemm(T, H, q_dim, attn_.get(), w.o, w.o_bias, proj_.get(), dt));
    TESSERA_RETURN_IF_ERROR(cuda::add_rms_norm(dt, proj_.get(), residual_.get(), w.post_norm, T, H,
                                               eps, hidden_.get(), st));
    TESSERA_RETURN_IF_ERROR(
        gemm(T, 2 * I, H, hidden_.get(), w.gate_up, nullptr, gate_up_.get(), dt));
    TESSERA_RETURN_IF_ERROR(cuda::silu_mul(dt, gate_up_.get(), T, I, act_.get(), st));
    TESSERA_RETURN_IF_ERROR(gemm(T, H, I, act_.get(), w.down, nullptr, proj_.get(), dt));
  }
  TESSERA_RETURN_IF_ERROR(cuda::add_rms_norm(dt, proj_.get(), residual_.get(), final_norm_, T, H,
                                             eps, hidden_.get(), st));
  if (plan.rows == 0) return Status::ok();
  TESSERA_RETURN_IF_ERROR(
      cuda::gather_rows(dt, hidden_.get(), T, lrows, plan.rows, H, rows_.get(), st));
  return gemm(plan.rows, c.vocab_size, H, rows_.get(), lm_head_, nullptr, logits_.get(),
              DType::kF32);
}

Expected<float*> CudaModel::forward(std::span<const ForwardSeq> batch, int64_t* rows) {
  bool decode = !batch.empty() && static_cast<int64_t>(batch.size()) <= options_.max_num_seqs;
  for (const ForwardSeq& s : batch) decode = decode && s.tokens.size() == 1 && s.want_logits;
  int64_t pad_to = 0;
  if (decode) {
    auto it = std::lower_bound(decode_sizes_.begin(), decode_sizes_.end(),
                               static_cast<int64_t>(batch.size()));
    pad_to = it != decode_sizes_.end() ? *it : static_cast<int64_t>(batch.size());
  }
  TESSERA_ASSIGN_OR_RETURN(StepPlan plan, stage(batch, pad_to));
  if (decode) {
    cuda::SplitPlan sp = cuda::plan_attention_splits(static_cast<int>(plan.seqs),
                                                     static_cast<int>(config_.num_kv_heads),
                                                     options_.max_model_len, num_sms_);
    plan.num_splits = sp.num_splits;
    plan.split_size = sp.split_size;
  }
  auto g = decode ? graphs_.find(plan.seqs) : graphs_.end();
  if (g != graphs_.end()) {
    TESSERA_CUDA_RETURN_IF_ERROR(
        cudaGraphLaunch(g->second->exec, stream_),
        "launching the decode graph for batch " + std::to_string(plan.seqs));
  } else {
    TESSERA_RETURN_IF_ERROR(run_layers(plan));
  }
  *rows = plan.real_rows;
  return logits_.as<float>();
}

Status CudaModel::capture_graphs() {
  for (int64_t size : decode_sizes_) {
    StepPlan plan;
    TESSERA_ASSIGN_OR_RETURN(plan, stage({}, size));
    cuda::SplitPlan sp =
        cuda::plan_attention_splits(static_cast<int>(size), static_cast<int>(config_.num_kv_heads),
                                    options_.max_model_len, num_sms_);
    plan.num_splits = sp.num_splits;
    plan.split_size = sp.split_size;
    // Warm-up in eager mode: the GEMMs pick (and time) their algorithms for this batch size.
    TESSERA_RETURN_IF_ERROR(run_layers(plan));
    TESSERA_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_), "warming up decode");
    if (options_.enforce_eager) continue;
    auto graph = std::make_unique<Graph>();
    TESSERA_CUDA_RETURN_IF_ERROR(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal),
                                 "capturing the decode graph");
    Status captured = run_layers(plan);
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
  const uint64_t block_bytes = 2ull * c.num_layers * options_.block_size * c.num_kv_heads *
                               c.head_dim * dtype_size(options_.dtype);
  const int64_t min_blocks =
      (options_.max_model_len + options_.block_size - 1) / options_.block_size;
  // Profiling step: the largest step the scheduler may send, one sequence as long as fits,
  // through a temporary cache.
  size_t free_before = 0, free_after = 0, total = 0;
  TESSERA_CUDA_RETURN_IF_ERROR(cudaMemGetInfo(&free_before, &total), "querying GPU memory");
  {
    const int64_t len = std::min(max_tokens_, options_.max_model_len);
    const int64_t blocks = (len + options_.block_size - 1) / options_.block_size;
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
  }
  TESSERA_CUDA_RETURN_IF_ERROR(cudaMemGetInfo(&free_after, &total), "querying GPU memory");
  const uint64_t used_now = total - free_after + memory_.profile_peak;
  memory_.graph_reserve = options_.enforce_eager ? 0 : kGraphReserve;
  const uint64_t committed = used_now + memory_.graph_reserve;
  const int64_t fit_blocks = memory_.budget > committed
                                 ? static_cast<int64_t>((memory_.budget - committed) / block_bytes)
                                 : 0;
  int64_t blocks = options_.kv_blocks > 0 ? options_.kv_blocks : fit_blocks;
  if (blocks > fit_blocks || blocks < min_blocks) {
    const int64_t fit_len = fit_blocks * options_.block_size;
    std::string msg =
        "the KV cache does not fit on " + memory_.device_name + ": " +
        fmt::format(
            "--gpu-memory-utilization {:.2f} allows {:.2f} GiB, of which weights take "
            "{:.2f} GiB, activations {:.2f} GiB, CUDA graphs {:.2f} GiB and other "
            "use {:.2f} GiB, leaving {} KV blocks ({} tokens); ",
            options_.gpu_memory_utilization, gib(memory_.budget), gib(memory_.weights),
            gib(memory_.activations + memory_.profile_peak), gib(memory_.graph_reserve),
            gib(used_now - memory_.weights - memory_.activations - memory_.profile_peak),
            fit_blocks, fit_len);
    if (blocks > fit_blocks && blocks >= min_blocks) {
      msg += "--num-gpu-blocks-override " + std::to_string(blocks) + " asks for more";
    } else {
      msg += "one sequence of --max-model-len " + std::to_string(options_.max_model_len) +
             " needs " + std::to_string(min_blocks) + " blocks. ";
      msg +=
          fit_len >= 16 ? "Lower --max-model-len to " + std::to_string(fit_len) + " or less, " : "";
      msg +=
          "raise --gpu-memory-utilization, spread the model over more GPUs "
          "(--tensor-parallel-size) or use a quantized checkpoint (--quantization awq|gptq)";
    }
    return resource_exhausted(msg);
  }
  TESSERA_RETURN_IF_ERROR(allocate_kv_cache(blocks));
  memory_.kv_cache = kv_storage_.bytes();
  memory_.kv_blocks = blocks;
  const int64_t tokens = blocks * options_.block_size;
  spdlog::info("# GPU blocks: {} ({} tokens; max concurrency {:.2f}x at max-model-len {})", blocks,
               tokens, static_cast<double>(tokens) / static_cast<double>(options_.max_model_len),
               options_.max_model_len);
  return Status::ok();
}

Expected<std::unique_ptr<CudaModel>> CudaModel::create(const ModelConfig& config,
                                                       const ModelWeights& host_weights,
                                                       const CudaModelOptions& options) {
  if (!cuda::is_half_type(options.dtype)) {
    return invalid_argument("the CUDA backend runs in bfloat16 or float16, not " +
                            std::string(dtype_name(options.dtype)));
  }
  if (options.gpu_memory_utilization <= 0.0 || options.gpu_memory_utilization > 1.0) {
    return invalid_argument("--gpu-memory-utilization must be in (0, 1], got " +
                            std::to_string(options.gpu_memory_utilization));
  }
  if (options.max_num_seqs < 1 || options.block_size < 1 || options.max_model_len < 1) {
    return invalid_argument("max-num-seqs, block size and max-model-len must be positive");
  }
  if (config.sliding_window && *config.sliding_window < options.max_model_len) {
    return invalid_argument("this model uses sliding-window attention (window " +
                            std::to_string(*config.sliding_window) +
                            "), which is not implemented yet: use --max-model-len " +
                            std::to_string(*config.sliding_window) + " or less");
  }
  std::unique_ptr<CudaModel> m(new CudaModel(config, options));
  TESSERA_CUDA_RETURN_IF_ERROR(cudaSetDevice(0), "selecting GPU 0");
  TESSERA_CUDA_RETURN_IF_ERROR(cudaFree(nullptr), "creating the CUDA context");
  cudaDeviceProp prop{};
  TESSERA_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, 0), "querying GPU 0");
  m->num_sms_ = prop.multiProcessorCount;
  m->memory_.device_name = prop.name;
  size_t free0 = 0, total = 0;
  TESSERA_CUDA_RETURN_IF_ERROR(cudaMemGetInfo(&free0, &total), "querying GPU memory");
  m->memory_.total = total;
  m->memory_.budget = static_cast<uint64_t>(options.gpu_memory_utilization * total);
  m->memory_.used_at_start = total - free0;
  if (m->memory_.used_at_start >= m->memory_.budget) {
    return resource_exhausted(fmt::format(
        "{} has {:.2f} GiB of {:.2f} GiB in use before loading (other processes); "
        "--gpu-memory-utilization {:.2f} caps this actor's GPU at {:.2f} GiB in total: free the "
        "GPU or raise --gpu-memory-utilization",
        prop.name, gib(m->memory_.used_at_start), gib(total), options.gpu_memory_utilization,
        gib(m->memory_.budget)));
  }
  m->max_tokens_ = std::max(options.max_num_batched_tokens, options.max_num_seqs);
  m->max_blocks_per_seq_ = (options.max_model_len + options.block_size - 1) / options.block_size;
  // Would the weights and activations fit at all? Check before touching the GPU's memory.
  {
    const size_t es = dtype_size(options.dtype);
    const uint64_t weights =
        static_cast<uint64_t>(host_weights.bytes /
                              std::max<size_t>(1, dtype_size(host_weights.embed.dtype))) *
        es;
    const uint64_t per_token =
        (4 * config.hidden_size + 2 * qkv_rows(config) + 3 * config.intermediate_size) * es;
    const uint64_t activations =
        m->max_tokens_ * per_token + options.max_num_seqs * config.vocab_size * 4 + 64 * kMiB;
    const uint64_t min_kv = static_cast<uint64_t>(m->max_blocks_per_seq_) * 2 * config.num_layers *
                            options.block_size * config.num_kv_heads * config.head_dim * es;
    const uint64_t need = m->memory_.used_at_start + weights + activations + min_kv;
    if (need > m->memory_.budget) {
      return resource_exhausted(fmt::format(
          "the model does not fit on {}: weights {:.2f} GiB + activations for "
          "--max-num-batched-tokens {} {:.2f} GiB + the KV cache of one --max-model-len {} "
          "sequence {:.2f} GiB + {:.2f} GiB already in use = {:.2f} GiB, but "
          "--gpu-memory-utilization {:.2f} allows {:.2f} GiB. Lower --max-model-len or "
          "--max-num-batched-tokens, raise --gpu-memory-utilization, spread the model over more "
          "GPUs (--tensor-parallel-size) or use a quantized checkpoint (--quantization awq|gptq)",
          prop.name, gib(weights), m->max_tokens_, gib(activations), options.max_model_len,
          gib(min_kv), gib(m->memory_.used_at_start), gib(need), options.gpu_memory_utilization,
          gib(m->memory_.budget)));
    }
  }
  TESSERA_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&m->stream_, cudaStreamNonBlocking),
                               "creating the model's stream");
  TESSERA_RETURN_IF_ERROR(m->upload_weights(host_weights));
  // TESSERA_GEMM_AUTOTUNE=1 times cuBLASLt's candidates per shape (the default takes the
  // heuristic's first choice: reproducible across runs).
  const char* tune = std::getenv("TESSERA_GEMM_AUTOTUNE");
  TESSERA_ASSIGN_OR_RETURN(
      m->gemm_, cuda::Gemm::create(32u << 20, tune != nullptr && std::string(tune) == "1"));
  m->memory_.activations += 32 * kMiB;  // the GEMM workspace
  TESSERA_ASSIGN_OR_RETURN(m->sampler_,
                           cuda::GpuSampler::create(static_cast<int>(options.max_num_seqs),
                                                    config.vocab_size, 20, m->stream_));
  TESSERA_RETURN_IF_ERROR(m->allocate_buffers());
  // Decode batch sizes: 1, 2, 4, 8, then multiples of 8, and max_num_seqs itself.
  for (int64_t b : {1, 2, 4}) {
    if (b <= options.max_num_seqs) m->decode_sizes_.push_back(b);
  }
  for (int64_t b = 8; b <= options.max_num_seqs; b += 8) m->decode_sizes_.push_back(b);
  if (m->decode_sizes_.back() != options.max_num_seqs) {
    m->decode_sizes_.push_back(options.max_num_seqs);
  }
  TESSERA_RETURN_IF_ERROR(m->size_kv_cache());
  size_t free_a = 0, free_b = 0;
  cudaMemGetInfo(&free_a, &total);
  TESSERA_RETURN_IF_ERROR(m->capture_graphs());
  cudaMemGetInfo(&free_b, &total);
  m->memory_.graphs = free_a > free_b ? free_a - free_b : 0;
  const GpuMemoryReport& r = m->memory_;
  spdlog::info(
      "GPU 0 ({}, {:.1f} GiB): weights {:.2f} GiB, activations {:.2f} GiB, CUDA graphs {:.0f} "
      "MiB ({} sizes{}), KV cache {:.2f} GiB; {:.2f} GiB in use of the {:.2f} GiB budget "
      "(--gpu-memory-utilization {:.2f})",
      r.device_name, gib(r.total), gib(r.weights), gib(r.activations + r.profile_peak),
      static_cast<double>(r.graphs) / kMiB, m->graphs_.size(),
      options.enforce_eager ? ", --enforce-eager" : "", gib(r.kv_cache), gib(r.total - free_b),
      gib(r.budget), options.gpu_memory_utilization);
  if (r.graphs > r.graph_reserve && !options.enforce_eager) {
    spdlog::warn("CUDA graphs took {:.0f} MiB, more than the {:.0f} MiB reserved for them",
                 static_cast<double>(r.graphs) / kMiB, static_cast<double>(r.graph_reserve) / kMiB);
  }
  return m;
}

}  // namespace tessera
