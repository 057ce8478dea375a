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

// The stacked linear layers of a decoder layer: their parts' names and output sizes.
struct LinearGroup {
  const char* name;  // for messages: "qkv", "o", "gate_up", "down"
  std::vector<std::pair<std::string, int64_t>> parts;  // module suffix, outputs on this rank
  int64_t in = 0;                                      // inputs on this rank
};

std::vector<LinearGroup> linear_groups(const ModelConfig& c, const LayerPlan& p) {
  const int64_t H = c.hidden_size, hd = c.head_dim;
  const int64_t q_dim = p.heads * hd, kv_dim = p.kv_heads * hd, I = p.intermediate;
  return {
      {"qkv",
       {{"self_attn.q_proj", q_dim}, {"self_attn.k_proj", kv_dim}, {"self_attn.v_proj", kv_dim}},
       H},
      {"o", {{"self_attn.o_proj", H}}, q_dim},
      {"gate_up", {{"mlp.gate_proj", I}, {"mlp.up_proj", I}}, H},
      {"down", {{"mlp.down_proj", H}}, I}};
}

// Whether the group's layers are int4 (AWQ or 4-bit GPTQ) in this checkpoint; an error when its
// parts disagree (one quantized, one not: they could not share a GEMM).
Expected<bool> int4_group(const QuantConfig& q, int64_t layer, const LinearGroup& g) {
  const bool format =
      q.method == QuantMethod::kAwq || (q.method == QuantMethod::kGptq && q.bits == 4);
  if (!format) return false;
  const bool first = q.quantizes(layer_tensor_name(layer, g.parts.front().first));
  for (const auto& [name, out] : g.parts) {
    if (q.quantizes(layer_tensor_name(layer, name)) != first) {
      return invalid_argument("layer " + std::to_string(layer) + ": " + q.describe() +
                              " quantizes some of its " + g.name +
                              " projections and not others; the GPU stacks them into one GEMM "
                              "(run this checkpoint with --device cpu)");
    }
  }
  return first;
}

// Where one stacked linear layer lives in the allocation: a plain weight, or an int4 layer's
// arrays (kernels/cuda/quant_gemm.h's W4Layer).
struct LinearOffsets {
  size_t w = SIZE_MAX;
  bool int4 = false;
  int64_t out = 0, in = 0, group = 0;
  size_t qweight = SIZE_MAX, scales = SIZE_MAX, zeros = SIZE_MAX, perm = SIZE_MAX;
};

// Offsets of every region of one rank's weights in one allocation.
struct Layout {
  struct LayerOffsets {
    size_t input_norm, post_norm, qkv_bias, o_bias, q_norm, k_norm;
    LinearOffsets qkv, o, gate_up, down;
  };
  size_t embed = SIZE_MAX, final_norm = SIZE_MAX, lm_head = SIZE_MAX;
  std::vector<LayerOffsets> layers;
  size_t bytes = 0;

  static Expected<Layout> make(const ModelConfig& c, const LayerPlan& p, DType dtype) {
    const size_t es = dtype_size(dtype);
    const int64_t H = c.hidden_size, hd = c.head_dim;
    const int64_t q_dim = p.heads * hd, kv_dim = p.kv_heads * hd;
    Layout l;
    auto take_bytes = [&](size_t n) {
      size_t o = l.bytes;
      l.bytes = align_up(l.bytes + n);
      return o;
    };
    auto take = [&](int64_t elems) { return take_bytes(static_cast<size_t>(elems) * es); };
    auto linear = [&](int64_t layer, const LinearGroup& g) -> Expected<LinearOffsets> {
      LinearOffsets o;
      o.in = g.in;
      for (const auto& part : g.parts) o.out += part.second;
      TESSERA_ASSIGN_OR_RETURN(o.int4, int4_group(c.quant, layer, g));
      if (!o.int4) {
        o.w = take(o.out * o.in);
        return o;
      }
      o.group = c.quant.group(o.in);
      // Each part is repacked on its own: each must fit the kernels' tiles.
      for (const auto& [name, out] : g.parts) {
        TESSERA_RETURN_IF_ERROR(
            cuda::check_w4_shape(out, o.in, o.group)
                .with_context(layer_tensor_name(layer, name) +
                              " on the GPU's int4 kernels (--device cpu runs any shape)"));
      }
      const int64_t groups = o.in / o.group;
      o.qweight = take_bytes(static_cast<size_t>(o.out * o.in / 2));
      o.scales = take(o.out * groups);
      o.zeros = take_bytes(static_cast<size_t>(o.out * groups));
      if (c.quant.method == QuantMethod::kGptq && c.quant.desc_act) {
        o.perm = take_bytes(static_cast<size_t>(o.in) * 4);
      }
      return o;
    };
    const bool tied = c.tie_word_embeddings;
    if (p.first_stage || (p.last_stage && tied)) l.embed = take(p.vocab_shard * H);
    if (p.last_stage) {
      l.final_norm = take(H);
      l.lm_head = tied ? l.embed : take(p.vocab_shard * H);
    }
    const std::vector<LinearGroup> groups = linear_groups(c, p);
    for (int64_t i = 0; i < p.num_layers(); ++i) {
      const int64_t layer = p.layer_begin + i;
      LayerOffsets o{};
      o.input_norm = take(H);
      o.post_norm = take(H);
      TESSERA_ASSIGN_OR_RETURN(o.qkv, linear(layer, groups[0]));
      o.qkv_bias = c.attention_bias ? take(q_dim + 2 * kv_dim) : SIZE_MAX;
      TESSERA_ASSIGN_OR_RETURN(o.o, linear(layer, groups[1]));
      o.o_bias = p.o_bias ? take(H) : SIZE_MAX;
      o.q_norm = c.qk_norm ? take(hd) : SIZE_MAX;
      o.k_norm = c.qk_norm ? take(hd) : SIZE_MAX;
      TESSERA_ASSIGN_OR_RETURN(o.gate_up, linear(layer, groups[2]));
      TESSERA_ASSIGN_OR_RETURN(o.down, linear(layer, groups[3]));
      l.layers.push_back(o);
    }
    return l;
  }
};

// Device scratch for one int4 layer at a time: its checkpoint tensors as stored, and the
// repacked layer before it is copied to its place in the stack.
class Int4Scratch {
 public:
  // A device region of at least `bytes` (grown as layers need; reused).
  Expected<char*> region(int k, size_t bytes, const char* what) {
    cuda::DeviceBuffer& b = buffers_[k];
    if (b.bytes() < bytes) {
      b.reset();
      TESSERA_ASSIGN_OR_RETURN(b, cuda::DeviceBuffer::allocate(align_up(bytes), what));
    }
    return b.as<char>();
  }

 private:
  cuda::DeviceBuffer buffers_[4];
};

// Uploads the parts of one stacked int4 layer (q, k, v; gate, up; o; down) as the checkpoint
// stores them, repacks each on the GPU and copies it after the parts before it.
Expected<cuda::W4Layer> upload_int4(
    Uploader& up, Int4Scratch& scratch, const ModelConfig& c, const LinearOffsets& o, char* base,
    DType dt, const std::vector<std::pair<std::string, const LinearWeight*>>& parts,
    cudaStream_t stream) {
  const QuantConfig& q = c.quant;
  const int64_t groups = o.in / o.group;
  const size_t es = dtype_size(dt);
  int64_t out_at = 0;
  std::span<const int32_t> first_g_idx;
  for (const auto& [name, lw] : parts) {
    const int64_t out = lw->out_features(q);
    if (lw->in_features(q) != o.in || lw->scales.shape.at(0) != groups) {
      return invalid_argument(
          name + ": " + std::to_string(lw->scales.shape.at(0)) + " scale groups for " +
          std::to_string(o.in) + " inputs on this rank; the GPU's int4 kernels need the rank's " +
          "own groups (GPTQ act-order split along the inputs by -tp runs on --device cpu)");
    }
    TESSERA_ASSIGN_OR_RETURN(char* raw_q, scratch.region(0, lw->qweight.bytes(), "int4 upload"));
    TESSERA_ASSIGN_OR_RETURN(char* raw_z, scratch.region(1, lw->qzeros.bytes(), "int4 upload"));
    TESSERA_ASSIGN_OR_RETURN(char* raw_s, scratch.region(2, lw->scales.numel() * 2, "int4 upload"));
    TESSERA_RETURN_IF_ERROR(up.upload(lw->qweight, DType::kI32, raw_q, name + ".qweight"));
    TESSERA_RETURN_IF_ERROR(up.upload(lw->qzeros, DType::kI32, raw_z, name + ".qzeros"));
    TESSERA_RETURN_IF_ERROR(up.upload(lw->scales, DType::kF16, raw_s, name + ".scales"));
    const uint64_t packed = cuda::w4_bytes(out, o.in, o.group);
    TESSERA_ASSIGN_OR_RETURN(char* tmp, scratch.region(3, packed, "int4 repacking"));
    Expected<cuda::W4Layer> layer = internal_error("no format");
    if (q.method == QuantMethod::kAwq) {
      cuda::AwqTensors t{out,
                         o.in,
                         o.group,
                         reinterpret_cast<const int32_t*>(raw_q),
                         reinterpret_cast<const int32_t*>(raw_z),
                         raw_s};
      layer = cuda::repack_awq(t, dt, tmp, packed, stream);
    } else {
      cuda::GptqTensors t;
      t.out = out;
      t.in = o.in;
      t.group = o.group;
      t.qweight = reinterpret_cast<const int32_t*>(raw_q);
      t.qzeros = reinterpret_cast<const int32_t*>(raw_z);
      t.scales = raw_s;
      t.g_idx = std::span<const int32_t>(static_cast<const int32_t*>(lw->g_idx.data),
                                         static_cast<size_t>(lw->g_idx.numel()));
      t.zero_offset = q.zero_offset;
      if (out_at == 0) {
        first_g_idx = t.g_idx;
      } else if (!std::equal(t.g_idx.begin(), t.g_idx.end(), first_g_idx.begin(),
                             first_g_idx.end())) {
        return invalid_argument(name + ".g_idx differs from " + parts.front().first +
                                "'s: layers that share an input must share its act-order (GPTQ "
                                "computes both from the same activations)");
      }
      layer = cuda::repack_gptq(t, dt, tmp, packed, stream);
    }
    if (!layer) return layer.status().with_context(name);
    auto copy = [&](size_t dst, const void* src, size_t bytes) {
      return cudaMemcpyAsync(base + dst, src, bytes, cudaMemcpyDeviceToDevice, stream);
    };
    TESSERA_CUDA_RETURN_IF_ERROR(copy(o.qweight + static_cast<size_t>(out_at * o.in / 2),
                                      layer->qweight, static_cast<size_t>(out * o.in / 2)),
                                 "stacking " + name);
    TESSERA_CUDA_RETURN_IF_ERROR(copy(o.scales + static_cast<size_t>(out_at * groups) * es,
                                      layer->scales, static_cast<size_t>(out * groups) * es),
                                 "stacking " + name);
    TESSERA_CUDA_RETURN_IF_ERROR(copy(o.zeros + static_cast<size_t>(out_at * groups), layer->zeros,
                                      static_cast<size_t>(out * groups)),
                                 "stacking " + name);
    if (out_at == 0 && o.perm != SIZE_MAX && layer->perm != nullptr) {
      TESSERA_CUDA_RETURN_IF_ERROR(copy(o.perm, layer->perm, static_cast<size_t>(o.in) * 4),
                                   "stacking " + name);
    }
    // The scratch is the next part's: its copies must be done.
    TESSERA_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream), "repacking " + name);
    out_at += out;
  }
  cuda::W4Layer w;
  w.out = o.out;
  w.in = o.in;
  w.group = o.group;
  w.dtype = dt;
  w.qweight = reinterpret_cast<const uint32_t*>(base + o.qweight);
  w.scales = base + o.scales;
  w.zeros = reinterpret_cast<const uint8_t*>(base + o.zeros);
  // Act-order: the stack's inputs in q's order (the parts share it); none when it was i / group.
  w.perm = o.perm != SIZE_MAX ? reinterpret_cast<const int32_t*>(base + o.perm) : nullptr;
  return w;
}

}  // namespace

Expected<uint64_t> CudaWeights::bytes_needed(const ModelConfig& config, const LayerPlan& plan,
                                             DType dtype) {
  TESSERA_ASSIGN_OR_RETURN(Layout lo, Layout::make(config, plan, dtype));
  return lo.bytes;
}

uint64_t CudaWeights::w4_workspace_bytes(int64_t max_m) const {
  uint64_t need = 0;
  for (const CudaLayer& l : layers_) {
    for (const CudaLinear* lin : {&l.qkv, &l.o, &l.gate_up, &l.down}) {
      if (lin->int4())
        need = std::max(need, cuda::w4_workspace_bytes(lin->w4.out, lin->w4.in, max_m));
    }
  }
  return need;
}

Expected<std::unique_ptr<CudaWeights>> CudaWeights::upload(const ModelConfig& c, const LayerPlan& p,
                                                           const ModelWeights& w, DType dt,
                                                           cudaStream_t stream) {
  TESSERA_ASSIGN_OR_RETURN(const Layout lo, Layout::make(c, p, dt));
  const size_t es = dtype_size(dt);
  const int64_t q_dim = p.heads * c.head_dim, kv_dim = p.kv_heads * c.head_dim;
  std::unique_ptr<CudaWeights> d(new CudaWeights());
  TESSERA_ASSIGN_OR_RETURN(d->storage_, cuda::DeviceBuffer::allocate(lo.bytes, "the weights"));
  char* base = d->storage_.as<char>();
  // Padding rows (a vocabulary slice past the end of the vocabulary) stay zero.
  TESSERA_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(base, 0, lo.bytes, stream), "clearing the weights");
  TESSERA_ASSIGN_OR_RETURN(auto up, Uploader::create(stream));
  Int4Scratch scratch;
  load_progress().start(lo.bytes);
  auto put = [&](const TensorView& t, size_t offset, const std::string& name) -> Status {
    if (t.data == nullptr) return internal_error("no host tensor bound for " + name);
    return up->upload(t, dt, base + offset, name);
  };
  // One stacked linear layer: plain parts one after another along the outputs, or int4 parts
  // repacked and stacked the same way.
  auto linear = [&](const LinearOffsets& o, const std::string& prefix,
                    const std::vector<std::pair<std::string, const LinearWeight*>>& parts)
      -> Expected<CudaLinear> {
    CudaLinear lin;
    if (o.int4) {
      std::vector<std::pair<std::string, const LinearWeight*>> named;
      for (const auto& [suffix, lw] : parts) named.emplace_back(prefix + suffix, lw);
      TESSERA_ASSIGN_OR_RETURN(lin.w4, upload_int4(*up, scratch, c, o, base, dt, named, stream));
      return lin;
    }
    size_t at = o.w;
    for (const auto& [suffix, lw] : parts) {
      TESSERA_RETURN_IF_ERROR(put(lw->weight, at, prefix + suffix + ".weight"));
      at += static_cast<size_t>(lw->weight.numel()) * es;
    }
    lin.w = base + o.w;
    return lin;
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
    const std::string n = layer_tensor_name(p.layer_begin + static_cast<int64_t>(i), "");
    TESSERA_RETURN_IF_ERROR(put(l.input_norm, o.input_norm, n + "input_layernorm.weight"));
    TESSERA_RETURN_IF_ERROR(put(l.post_norm, o.post_norm, n + "post_attention_layernorm.weight"));
    // q | k | v stacked along the output dimension: one GEMM computes all three.
    TESSERA_ASSIGN_OR_RETURN(x.qkv, linear(o.qkv, n,
                                           {{"self_attn.q_proj", &l.q_proj},
                                            {"self_attn.k_proj", &l.k_proj},
                                            {"self_attn.v_proj", &l.v_proj}}));
    if (o.qkv_bias != SIZE_MAX) {
      TESSERA_RETURN_IF_ERROR(put(l.q_bias, o.qkv_bias, n + "self_attn.q_proj.bias"));
      TESSERA_RETURN_IF_ERROR(put(l.k_bias, o.qkv_bias + q_dim * es, n + "self_attn.k_proj.bias"));
      TESSERA_RETURN_IF_ERROR(
          put(l.v_bias, o.qkv_bias + (q_dim + kv_dim) * es, n + "self_attn.v_proj.bias"));
      x.qkv_bias = base + o.qkv_bias;
    }
    TESSERA_ASSIGN_OR_RETURN(x.o, linear(o.o, n, {{"self_attn.o_proj", &l.o_proj}}));
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
    TESSERA_ASSIGN_OR_RETURN(
        x.gate_up,
        linear(o.gate_up, n, {{"mlp.gate_proj", &l.gate_proj}, {"mlp.up_proj", &l.up_proj}}));
    TESSERA_ASSIGN_OR_RETURN(x.down, linear(o.down, n, {{"mlp.down_proj", &l.down_proj}}));
    x.input_norm = base + o.input_norm;
    x.post_norm = base + o.post_norm;
  }
  TESSERA_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream), "uploading the weights");
  return d;
}

}  // namespace tessera
