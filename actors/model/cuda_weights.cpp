#include "actors/model/cuda_weights.h"

#include <algorithm>
#include <cstring>
#include <string>

#include "actors/model/load_progress.h"

namespace tessera {

namespace {

constexpr size_t kAlign = 256;
constexpr size_t kMiB = 1ull << 20;

size_t align_up(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

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
      load_progress().bytes_done += static_cast<uint64_t>(count) * esize;
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

// Offsets of every region of one rank's weights in one allocation.
struct Layout {
  struct LayerOffsets {
    size_t input_norm, post_norm, qkv, qkv_bias, o, o_bias, q_norm, k_norm, gate_up, down;
  };
  size_t embed = SIZE_MAX, final_norm = SIZE_MAX, lm_head = SIZE_MAX;
  std::vector<LayerOffsets> layers;
  size_t bytes = 0;

  static Layout make(const ModelConfig& c, const LayerPlan& p, DType dtype) {
    const size_t es = dtype_size(dtype);
    const int64_t H = c.hidden_size, hd = c.head_dim;
    const int64_t q_dim = p.heads * hd, kv_dim = p.kv_heads * hd;
    Layout l;
    auto take = [&](int64_t elems) {
      size_t o = l.bytes;
      l.bytes = align_up(l.bytes + static_cast<size_t>(elems) * es);
      return o;
    };
    const bool tied = c.tie_word_embeddings;
    if (p.first_stage || (p.last_stage && tied)) l.embed = take(p.vocab_shard * H);
    if (p.last_stage) {
      l.final_norm = take(H);
      l.lm_head = tied ? l.embed : take(p.vocab_shard * H);
    }
    for (int64_t i = 0; i < p.num_layers(); ++i) {
      LayerOffsets o{};
      o.input_norm = take(H);
      o.post_norm = take(H);
      o.qkv = take((q_dim + 2 * kv_dim) * H);
      o.qkv_bias = c.attention_bias ? take(q_dim + 2 * kv_dim) : SIZE_MAX;
      o.o = take(H * q_dim);
      o.o_bias = p.o_bias ? take(H) : SIZE_MAX;
      o.q_norm = c.qk_norm ? take(hd) : SIZE_MAX;
      o.k_norm = c.qk_norm ? take(hd) : SIZE_MAX;
      o.gate_up = take(2 * p.intermediate * H);
      o.down = take(H * p.intermediate);
      l.layers.push_back(o);
    }
    return l;
  }
};

}  // namespace

uint64_t CudaWeights::bytes_needed(const ModelConfig& config, const LayerPlan& plan, DType dtype) {
  return Layout::make(config, plan, dtype).bytes;
}

Expected<std::unique_ptr<CudaWeights>> CudaWeights::upload(const ModelConfig& c, const LayerPlan& p,
                                                           const ModelWeights& w, DType dt,
                                                           cudaStream_t stream) {
  const Layout lo = Layout::make(c, p, dt);
  const size_t es = dtype_size(dt);
  const int64_t H = c.hidden_size, hd = c.head_dim;
  const int64_t q_dim = p.heads * hd, kv_dim = p.kv_heads * hd;
  std::unique_ptr<CudaWeights> d(new CudaWeights());
  TESSERA_ASSIGN_OR_RETURN(d->storage_, cuda::DeviceBuffer::allocate(lo.bytes, "the weights"));
  char* base = d->storage_.as<char>();
  // Padding rows (a vocabulary slice past the end of the vocabulary) stay zero.
  TESSERA_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(base, 0, lo.bytes, stream), "clearing the weights");
  TESSERA_ASSIGN_OR_RETURN(auto up, Uploader::create(stream));
  load_progress().start(lo.bytes);
  auto put = [&](const TensorView& t, size_t offset, const std::string& name) -> Status {
    if (t.data == nullptr) return internal_error("no host tensor bound for " + name);
    return up->upload(t, dt, base + offset, name);
  };
  if (lo.embed != SIZE_MAX) {
    TESSERA_RETURN_IF_ERROR(put(w.embed, lo.embed, "model.embed_tokens.weight"));
    d->embed_ = base + lo.embed;
  }
  if (p.last_stage) {
    TESSERA_RETURN_IF_ERROR(put(w.final_norm, lo.final_norm, "model.norm.weight"));
    if (!c.tie_word_embeddings)
      TESSERA_RETURN_IF_ERROR(put(w.lm_head, lo.lm_head, "lm_head.weight"));
    d->final_norm_ = base + lo.final_norm;
    d->lm_head_ = base + lo.lm_head;
  }
  d->layers_.resize(lo.layers.size());
  for (size_t i = 0; i < lo.layers.size(); ++i) {
    const LayerWeights& l = w.layers[i];
    const Layout::LayerOffsets& o = lo.layers[i];
    CudaLayer& x = d->layers_[i];
    const std::string n =
        "model.layers." + std::to_string(p.layer_begin + static_cast<int64_t>(i)) + ".";
    TESSERA_RETURN_IF_ERROR(put(l.input_norm, o.input_norm, n + "input_layernorm.weight"));
    TESSERA_RETURN_IF_ERROR(put(l.post_norm, o.post_norm, n + "post_attention_layernorm.weight"));
    // q | k | v stacked along the output dimension: one GEMM computes all three.
    TESSERA_RETURN_IF_ERROR(put(l.q_proj.weight, o.qkv, n + "self_attn.q_proj.weight"));
    TESSERA_RETURN_IF_ERROR(
        put(l.k_proj.weight, o.qkv + q_dim * H * es, n + "self_attn.k_proj.weight"));
    TESSERA_RETURN_IF_ERROR(
        put(l.v_proj.weight, o.qkv + (q_dim + kv_dim) * H * es, n + "self_attn.v_proj.weight"));
    if (o.qkv_bias != SIZE_MAX) {
      TESSERA_RETURN_IF_ERROR(put(l.q_bias, o.qkv_bias, n + "self_attn.q_proj.bias"));
      TESSERA_RETURN_IF_ERROR(put(l.k_bias, o.qkv_bias + q_dim * es, n + "self_attn.k_proj.bias"));
      TESSERA_RETURN_IF_ERROR(
          put(l.v_bias, o.qkv_bias + (q_dim + kv_dim) * es, n + "self_attn.v_proj.bias"));
      x.qkv_bias = base + o.qkv_bias;
    }
    TESSERA_RETURN_IF_ERROR(put(l.o_proj.weight, o.o, n + "self_attn.o_proj.weight"));
    if (o.o_bias != SIZE_MAX) {
      TESSERA_RETURN_IF_ERROR(put(l.o_bias, o.o_bias, n + "self_attn.o_proj.bias"));
      x.o_bias = base + o.o_bias;
    }
    if (o.q_norm != SIZE_MAX) {
      TESSERA_RETURN_IF_ERROR(put(l.q_norm, o.q_norm, n + "self_attn.q_norm.weight"));
      TESSERA_RETURN_IF_ERROR(put(l.k_norm, o.k_norm, n + "self_attn.k_norm.weight"));
      x.q_norm = base + o.q_norm;
      x.k_norm = base + o.k_norm;
    }
    // gate | up stacked: one GEMM, silu_mul reads both halves of each row.
    TESSERA_RETURN_IF_ERROR(put(l.gate_proj.weight, o.gate_up, n + "mlp.gate_proj.weight"));
    TESSERA_RETURN_IF_ERROR(
        put(l.up_proj.weight, o.gate_up + p.intermediate * H * es, n + "mlp.up_proj.weight"));
    TESSERA_RETURN_IF_ERROR(put(l.down_proj.weight, o.down, n + "mlp.down_proj.weight"));
    x.input_norm = base + o.input_norm;
    x.post_norm = base + o.post_norm;
    x.qkv = base + o.qkv;
    x.o = base + o.o;
    x.gate_up = base + o.gate_up;
    x.down = base + o.down;
  }
  TESSERA_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream), "uploading the weights");
  return d;
}

}  // namespace tessera
