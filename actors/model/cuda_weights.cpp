#include "actors/model/cuda_weights.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include "actors/model/load_progress.h"
#include "kernels/cuda/elementwise.h"

namespace tessera {

namespace {

constexpr size_t kAlign = 256;
constexpr size_t kMiB = 1ull << 20;

size_t align_up(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

// Copies host tensors into device memory through two pinned staging chunks: the host copies
// chunk k + 1 into one while chunk k crosses to the GPU from the other. A tensor stored in
// another dtype crosses as stored, into one of two device staging chunks, and cuda::convert
// writes it in the destination dtype at its place (bit for bit common/tensor.h's conversion the
// host ran before: ~250 MB/s on one core, where the copy runs at the link's speed). The device
// chunks are allocated with the first tensor that needs them and freed with the Uploader;
// CudaWeights::kConvertStagingBytes counts them in the memory check.
class Uploader {
 public:
  static constexpr size_t kChunk = 64 * kMiB;
  static_assert(2 * kChunk == CudaWeights::kConvertStagingBytes);

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

  // Writes `src` (converted to `to`) at device address `dst`. A conversion takes an F32, F16,
  // BF16 or F8_E4M3 tensor to F32, F16 or BF16 (cuda::convert's dtypes).
  Status upload(const TensorView& src, DType to, void* dst, const std::string& name) {
    const bool convert = src.dtype != to;
    if (convert) TESSERA_RETURN_IF_ERROR(prepare_conversion(src.dtype, to, name));
    // Each chunk fills a staging slot with the stored elements; `dst` takes them in `to`.
    const size_t in_size = dtype_size(src.dtype), out_size = dtype_size(to);
    const int64_t n = src.numel();
    const int64_t per_chunk = static_cast<int64_t>(kChunk / in_size);
    for (int64_t first = 0; first < n; first += per_chunk) {
      const int64_t count = std::min(per_chunk, n - first);
      const size_t in_bytes = static_cast<size_t>(count) * in_size;
      const int slot = next_++ % 2;
      // The slot's last chunk has crossed (and been converted): its host and device staging
      // are free again.
      TESSERA_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(done_[slot]), "uploading " + name);
      std::memcpy(staging_[slot], static_cast<const char*>(src.data) + first * in_size, in_bytes);
      char* out = static_cast<char*>(dst) + first * out_size;
      void* landing = convert ? device_staging_[slot].get() : out;
      TESSERA_CUDA_RETURN_IF_ERROR(
          cudaMemcpyAsync(landing, staging_[slot], in_bytes, cudaMemcpyHostToDevice, stream_),
          "uploading " + name);
      if (convert) {
        TESSERA_RETURN_IF_ERROR(cuda::convert(src.dtype, landing, to, out, count, stream_)
                                    .with_context("converting " + name));
      }
      TESSERA_CUDA_RETURN_IF_ERROR(cudaEventRecord(done_[slot], stream_), "uploading " + name);
      load_progress().bytes_done += static_cast<uint64_t>(count) * out_size;
    }
    return Status::ok();
  }

 private:
  Uploader() = default;

  // Checks that the GPU converts `from` to `to` and allocates the device staging (once).
  Status prepare_conversion(DType from, DType to, const std::string& name) {
    const bool from_ok = from == DType::kF32 || from == DType::kF16 || from == DType::kBF16 ||
                         from == DType::kF8E4M3;
    const bool to_ok = to == DType::kF32 || to == DType::kF16 || to == DType::kBF16;
    if (!from_ok || !to_ok) {
      return internal_error(name + " is " + dtype_name(from) + ": the weight upload does not " +
                            "convert it to " + dtype_name(to));
    }
    for (cuda::DeviceBuffer& b : device_staging_) {
      if (b.get() != nullptr) continue;
      TESSERA_ASSIGN_OR_RETURN(
          b, cuda::DeviceBuffer::allocate(kChunk, "device staging to convert the weights' dtype"));
    }
    return Status::ok();
  }

  cudaStream_t stream_ = nullptr;
  void* staging_[2] = {nullptr, nullptr};
  cudaEvent_t done_[2] = {nullptr, nullptr};
  // Destroyed after ~Uploader's synchronisation: no conversion is still reading them.
  cuda::DeviceBuffer device_staging_[2];
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

// Whether the group's layers are quantized (`format`: the method's layers run on the GPU's
// kernels for it); an error when its parts disagree (one quantized, one not: they could not share
// a GEMM).
Expected<bool> quantized_group(const QuantConfig& q, bool format, int64_t layer,
                               const LinearGroup& g) {
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

// Whether the group's layers are int4 (AWQ or 4-bit GPTQ) in this checkpoint.
Expected<bool> int4_group(const QuantConfig& q, int64_t layer, const LinearGroup& g) {
  const bool format =
      q.method == QuantMethod::kAwq || (q.method == QuantMethod::kGptq && q.bits == 4);
  return quantized_group(q, format, layer, g);
}

// Whether the group's layers are FP8 (a checkpoint's, or quantized at load).
Expected<bool> fp8_group(const QuantConfig& q, int64_t layer, const LinearGroup& g) {
  return quantized_group(q, q.method == QuantMethod::kFp8, layer, g);
}

// Where one stacked linear layer lives in the allocation: a plain weight, an int4 layer's
// arrays (kernels/cuda/quant_gemm.h's W4Layer), or an FP8 layer's E4M3 weight (at w) and its
// fp32 scale per output.
struct LinearOffsets {
  size_t w = SIZE_MAX;
  bool int4 = false;
  bool fp8 = false;
  size_t fp8_scales = SIZE_MAX;
  int64_t out = 0, in = 0, group = 0;
  size_t qweight = SIZE_MAX, scales = SIZE_MAX, zeros = SIZE_MAX, perm = SIZE_MAX;
};

// Offsets of every region of one rank's weights in one allocation.
struct Layout {
  struct LayerOffsets {
    size_t input_norm, post_norm, pre_ff_norm, post_ff_norm, qkv_bias, o_bias, q_norm, k_norm;
    LinearOffsets qkv, o, gate_up, down;
    // An MoE layer's tensors (router == SIZE_MAX: a dense layer).
    size_t router, experts_gate_up, experts_down, shared_gate_up, shared_down, shared_gate;
  };
  size_t embed = SIZE_MAX, final_norm = SIZE_MAX, lm_head = SIZE_MAX;
  std::vector<LayerOffsets> layers;
  size_t bytes = 0;

  static Expected<Layout> make(const ModelConfig& c, const LayerPlan& p, const QuantConfig& q,
                               DType dtype) {
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
      TESSERA_ASSIGN_OR_RETURN(o.int4, int4_group(q, layer, g));
      TESSERA_ASSIGN_OR_RETURN(o.fp8, fp8_group(q, layer, g));
      if (o.fp8) {
        // cuBLASLt's FP8 GEMM reads 16-byte rows of x and w and writes rows of the output.
        if (o.out % 16 != 0 || o.in % 16 != 0) {
          return invalid_argument(
              "layer " + std::to_string(layer) + "'s " + g.name + " projection is [" +
              std::to_string(o.out) + ", " + std::to_string(o.in) + "] on this rank: the GPU's " +
              "FP8 GEMM needs both multiples of 16 (--device cpu runs any shape)");
        }
        o.w = take_bytes(static_cast<size_t>(o.out * o.in));
        o.fp8_scales = take_bytes(static_cast<size_t>(o.out) * sizeof(float));
        return o;
      }
      if (!o.int4) {
        o.w = take(o.out * o.in);
        return o;
      }
      o.group = q.group(o.in);
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
      if (q.method == QuantMethod::kGptq && q.desc_act) {
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
      o.pre_ff_norm = c.sandwich_norms ? take(H) : SIZE_MAX;
      o.post_ff_norm = c.sandwich_norms ? take(H) : SIZE_MAX;
      TESSERA_ASSIGN_OR_RETURN(o.qkv, linear(layer, groups[0]));
      o.qkv_bias = c.attention_bias ? take(q_dim + 2 * kv_dim) : SIZE_MAX;
      TESSERA_ASSIGN_OR_RETURN(o.o, linear(layer, groups[1]));
      o.o_bias = p.o_bias ? take(H) : SIZE_MAX;
      o.q_norm = c.qk_norm ? take(hd) : SIZE_MAX;
      o.k_norm = c.qk_norm ? take(hd) : SIZE_MAX;
      o.router = o.experts_gate_up = o.experts_down = SIZE_MAX;
      o.shared_gate_up = o.shared_down = o.shared_gate = SIZE_MAX;
      if (c.moe.enabled() && c.moe.sparse_layer(layer)) {
        // Every local expert's gate | up, then every expert's down: one stacked array each,
        // the grouped GEMM's layout (kernels/cuda/moe.h).
        const int64_t E = p.experts, I = p.moe_intermediate, Is = p.shared_intermediate;
        o.router = take(c.moe.num_experts * H);
        o.experts_gate_up = take(E * 2 * I * H);
        o.experts_down = take(E * H * I);
        if (Is > 0) {
          o.shared_gate_up = take(2 * Is * H);
          o.shared_down = take(H * Is);
          o.shared_gate = take(H);
        }
      } else {
        TESSERA_ASSIGN_OR_RETURN(o.gate_up, linear(layer, groups[2]));
        TESSERA_ASSIGN_OR_RETURN(o.down, linear(layer, groups[3]));
      }
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

// ---- FP8 layers ----

using NamedLinears = std::vector<std::pair<std::string, const LinearWeight*>>;

// Device scratch of online FP8: one plain part as stored (grown as parts need), and the
// quantizer's max.
class Fp8Scratch {
 public:
  Expected<void*> weight(size_t bytes, cudaStream_t stream) {
    if (weight_.bytes() < bytes) {
      // The last part's quantizer may still read the old buffer.
      TESSERA_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream), "growing the FP8 scratch");
      weight_.reset();
      TESSERA_ASSIGN_OR_RETURN(weight_,
                               cuda::DeviceBuffer::allocate(align_up(bytes), "online FP8 scratch"));
    }
    return weight_.get();
  }
  Expected<uint32_t*> amax() {
    if (amax_.get() == nullptr) {
      TESSERA_ASSIGN_OR_RETURN(amax_, cuda::DeviceBuffer::allocate(kAlign, "online FP8 max"));
    }
    return amax_.as<uint32_t>();
  }

 private:
  cuda::DeviceBuffer weight_, amax_;
};

// The device scratch online FP8 takes while it loads: the largest plain part it quantizes, in
// the checkpoint's declared dtype, and the quantizer's max (0 without online FP8).
uint64_t online_fp8_scratch_bytes(const ModelConfig& c, const LayerPlan& p, const QuantConfig& q) {
  if (q.method != QuantMethod::kFp8 || !q.online) return 0;
  int64_t largest = 0;
  for (const LinearGroup& g : linear_groups(c, p)) {
    for (const auto& part : g.parts) largest = std::max(largest, part.second * g.in);
  }
  const size_t es = std::max<size_t>(dtype_size(c.torch_dtype), 2);
  return align_up(static_cast<size_t>(largest) * es) + kAlign;
}

// The static input scale of layers that share one input: the largest of their parts' (the CPU's
// shared_input_scale); 0 (dynamic per token) when the activations are dynamic or none has one.
Expected<float> fp8_input_scale(const QuantConfig& q, const NamedLinears& parts) {
  float scale = 0.f;
  if (q.activations != Fp8Activations::kStatic) return scale;
  for (const auto& [name, lw] : parts) {
    const float s = shared_input_scale({lw});
    if (!std::isfinite(s)) {
      return invalid_argument(name + ".input_scale holds " + std::to_string(s) +
                              ", not a finite scale");
    }
    scale = std::max(scale, s);
  }
  return scale;
}

// Uploads the parts of one stacked FP8 layer one after another along the outputs: a checkpoint's
// E4M3 weights as stored and their scales expanded per output, or (online) each plain weight
// into the scratch as stored and quantized from there into its place.
Expected<cuda::Fp8Layer> upload_fp8(Uploader& up, Fp8Scratch& scratch, const QuantConfig& q,
                                    const LinearOffsets& o, char* base, const NamedLinears& parts,
                                    cudaStream_t stream) {
  int64_t out_at = 0;
  for (const auto& [name, lw] : parts) {
    const TensorView& t = lw->weight;
    const DType want = q.online ? t.dtype : DType::kF8E4M3;
    const bool dtype_ok =
        q.online ? (t.dtype == DType::kF32 || t.dtype == DType::kF16 || t.dtype == DType::kBF16)
                 : t.dtype == DType::kF8E4M3;
    if (t.data == nullptr || t.shape.size() != 2 || t.shape[1] != o.in || !dtype_ok ||
        out_at + t.shape[0] > o.out) {
      return invalid_argument(
          name + ".weight is " + (t.data == nullptr ? std::string("missing") : t.describe()) +
          ": the GPU's FP8 layer takes " + (q.online ? "an F32, F16 or BF16" : "an F8_E4M3") +
          " [out, " + std::to_string(o.in) + "] matrix here");
    }
    const int64_t out = t.shape[0];
    auto* q8 = reinterpret_cast<uint8_t*>(base + o.w) + out_at * o.in;
    auto* scales = reinterpret_cast<float*>(base + o.fp8_scales) + out_at;
    if (q.online) {
      TESSERA_ASSIGN_OR_RETURN(void* plain, scratch.weight(t.bytes(), stream));
      TESSERA_ASSIGN_OR_RETURN(uint32_t * amax, scratch.amax());
      TESSERA_RETURN_IF_ERROR(up.upload(t, want, plain, name + ".weight"));
      TESSERA_RETURN_IF_ERROR(
          cuda::quantize_fp8_weight(t.dtype, plain, out, o.in, q8, scales, amax, stream)
              .with_context("quantizing " + name + ".weight to FP8 at load"));
    } else {
      TESSERA_RETURN_IF_ERROR(up.upload(t, want, q8, name + ".weight"));
      TESSERA_ASSIGN_OR_RETURN(std::vector<float> s, fp8_weight_scales(*lw, q, name));
      const TensorView view{s.data(), DType::kF32, {out}};
      // The staging copies `s` before upload returns.
      TESSERA_RETURN_IF_ERROR(up.upload(view, DType::kF32, scales, name + ".weight_scale"));
    }
    out_at += out;
  }
  if (out_at != o.out) {
    return invalid_argument(parts.front().first + ": the stacked FP8 parts have " +
                            std::to_string(out_at) + " outputs on this rank, not " +
                            std::to_string(o.out));
  }
  cuda::Fp8Layer l;
  l.out = o.out;
  l.in = o.in;
  l.w = reinterpret_cast<const uint8_t*>(base + o.w);
  l.scales = reinterpret_cast<const float*>(base + o.fp8_scales);
  TESSERA_ASSIGN_OR_RETURN(l.input_scale, fp8_input_scale(q, parts));
  return l;
}

// --load-format dummy for a quantized layer, on the region the dummy fill made (uniform bits):
// int4 weights keep the fill's bits as their nibbles, with zero points 8 and the fill's scales
// (+-1e-3 in the run dtype) and no act-order; FP8 weights are all 0.5 (E4M3 0x30: the fill's
// bytes would hold NaNs) with the fill's bytes as fp32 scales (two run-dtype values each: about
// +-1e-3, either sign). The kernels run as on a checkpoint; the numbers mean nothing.
Status dummy_quantized(const QuantConfig& q, const LinearOffsets& o, char* base, DType dt,
                       CudaLinear& lin, cudaStream_t stream) {
  if (o.int4) {
    const int64_t groups = o.in / o.group;
    TESSERA_CUDA_RETURN_IF_ERROR(
        cudaMemsetAsync(base + o.zeros, 8, static_cast<size_t>(o.out * groups), stream),
        "dummy int4 zero points");
    lin.w4.out = o.out;
    lin.w4.in = o.in;
    lin.w4.group = o.group;
    lin.w4.dtype = dt;
    lin.w4.qweight = reinterpret_cast<const uint32_t*>(base + o.qweight);
    lin.w4.scales = base + o.scales;
    lin.w4.zeros = reinterpret_cast<const uint8_t*>(base + o.zeros);
    lin.w4.perm = nullptr;
    return Status::ok();
  }
  TESSERA_CUDA_RETURN_IF_ERROR(
      cudaMemsetAsync(base + o.w, 0x30, static_cast<size_t>(o.out * o.in), stream),
      "dummy FP8 weights");
  lin.fp8.out = o.out;
  lin.fp8.in = o.in;
  lin.fp8.w = reinterpret_cast<const uint8_t*>(base + o.w);
  lin.fp8.scales = reinterpret_cast<const float*>(base + o.fp8_scales);
  lin.fp8.input_scale = q.activations == Fp8Activations::kStatic ? 1.0f : 0.0f;
  return Status::ok();
}

}  // namespace

Expected<uint64_t> CudaWeights::bytes_needed(const ModelConfig& config, const LayerPlan& plan,
                                             const QuantConfig& quant, DType dtype) {
  TESSERA_ASSIGN_OR_RETURN(Layout lo, Layout::make(config, plan, quant, dtype));
  return lo.bytes + online_fp8_scratch_bytes(config, plan, quant);
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
                                                           const ModelWeights& w,
                                                           const QuantConfig& quant, DType dt,
                                                           cudaStream_t stream) {
  TESSERA_ASSIGN_OR_RETURN(const Layout lo, Layout::make(c, p, quant, dt));
  const size_t es = dtype_size(dt);
  const int64_t q_dim = p.heads * c.head_dim, kv_dim = p.kv_heads * c.head_dim;
  std::unique_ptr<CudaWeights> d(new CudaWeights());
  TESSERA_ASSIGN_OR_RETURN(d->storage_, cuda::DeviceBuffer::allocate(lo.bytes, "the weights"));
  char* base = d->storage_.as<char>();
  // Padding rows (a vocabulary slice past the end of the vocabulary) stay zero.
  TESSERA_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(base, 0, lo.bytes, stream), "clearing the weights");
  TESSERA_ASSIGN_OR_RETURN(auto up, Uploader::create(stream));
  Int4Scratch scratch;
  Fp8Scratch fp8_scratch;
  load_progress().start(lo.bytes);
  if (w.dummy) {
    // --load-format dummy: every weight uniform in +-1e-3 (vLLM's dummy init), made in place;
    // the puts below only set the pointers.
    const int64_t n = static_cast<int64_t>(lo.bytes / es);
    TESSERA_RETURN_IF_ERROR(cuda::fill_uniform(dt, base, n, 0x7e55e4a, 1e-3f, stream)
                                .with_context("initialising the dummy weights"));
    load_progress().bytes_done += lo.bytes;
  }
  auto put = [&](const TensorView& t, size_t offset, const std::string& name) -> Status {
    if (w.dummy) return Status::ok();
    if (t.data == nullptr) return internal_error("no host tensor bound for " + name);
    return up->upload(t, dt, base + offset, name);
  };
  // One stacked linear layer: plain parts one after another along the outputs, or int4 / FP8
  // parts uploaded (repacked, quantized) and stacked the same way.
  auto linear = [&](const LinearOffsets& o, const std::string& prefix,
                    const std::vector<std::pair<std::string, const LinearWeight*>>& parts)
      -> Expected<CudaLinear> {
    CudaLinear lin;
    if (w.dummy && (o.int4 || o.fp8)) {
      TESSERA_RETURN_IF_ERROR(
          dummy_quantized(quant, o, base, dt, lin, stream).with_context(prefix));
      d->any_fp8_ = d->any_fp8_ || o.fp8;
      return lin;
    }
    NamedLinears named;
    for (const auto& [suffix, lw] : parts) named.emplace_back(prefix + suffix, lw);
    if (o.int4) {
      TESSERA_ASSIGN_OR_RETURN(lin.w4, upload_int4(*up, scratch, c, o, base, dt, named, stream));
      return lin;
    }
    if (o.fp8) {
      TESSERA_ASSIGN_OR_RETURN(lin.fp8,
                               upload_fp8(*up, fp8_scratch, quant, o, base, named, stream));
      d->any_fp8_ = true;
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
  // An MoE layer: the router, each local expert's gate | up and down into the stacked arrays,
  // the shared expert's gate | up, down and gate.
  auto upload_moe = [&](const LayerWeights& l, const Layout::LayerOffsets& o, const LayerPlan& plan,
                        const std::string& n, CudaLayer& x) -> Status {
    const std::string mlp = c.arch == Architecture::kMixtral ? "block_sparse_moe." : "mlp.";
    TESSERA_RETURN_IF_ERROR(put(l.router, o.router, n + mlp + "gate.weight"));
    if (static_cast<int64_t>(l.experts.size()) != plan.experts) {
      return internal_error(n + mlp + "experts: " + std::to_string(l.experts.size()) +
                            " bound, the plan holds " + std::to_string(plan.experts));
    }
    const size_t part = static_cast<size_t>(plan.moe_intermediate * c.hidden_size) * es;
    for (size_t e = 0; e < l.experts.size(); ++e) {
      const LayerWeights::Expert& ex = l.experts[e];
      const std::string name =
          n + mlp + "experts." + std::to_string(plan.expert_begin + static_cast<int64_t>(e));
      TESSERA_RETURN_IF_ERROR(put(ex.gate, o.experts_gate_up + 2 * e * part, name + ".gate"));
      TESSERA_RETURN_IF_ERROR(put(ex.up, o.experts_gate_up + (2 * e + 1) * part, name + ".up"));
      TESSERA_RETURN_IF_ERROR(put(ex.down, o.experts_down + e * part, name + ".down"));
    }
    x.router = base + o.router;
    x.experts_gate_up = base + o.experts_gate_up;
    x.experts_down = base + o.experts_down;
    if (o.shared_gate_up != SIZE_MAX) {
      const std::string s = n + "mlp.shared_expert.";
      const size_t half = static_cast<size_t>(plan.shared_intermediate * c.hidden_size) * es;
      TESSERA_RETURN_IF_ERROR(put(l.shared.gate, o.shared_gate_up, s + "gate_proj.weight"));
      TESSERA_RETURN_IF_ERROR(put(l.shared.up, o.shared_gate_up + half, s + "up_proj.weight"));
      TESSERA_RETURN_IF_ERROR(put(l.shared.down, o.shared_down, s + "down_proj.weight"));
      TESSERA_RETURN_IF_ERROR(
          put(l.shared_expert_gate, o.shared_gate, n + "mlp.shared_expert_gate.weight"));
      x.shared_gate_up = base + o.shared_gate_up;
      x.shared_down = base + o.shared_down;
      x.shared_expert_gate = base + o.shared_gate;
    }
    return Status::ok();
  };
  d->layers_.resize(lo.layers.size());
  for (size_t i = 0; i < lo.layers.size(); ++i) {
    const LayerWeights& l = w.layers[i];
    const Layout::LayerOffsets& o = lo.layers[i];
    CudaLayer& x = d->layers_[i];
    const std::string n = layer_tensor_name(p.layer_begin + static_cast<int64_t>(i), "");
    TESSERA_RETURN_IF_ERROR(put(l.input_norm, o.input_norm, n + "input_layernorm.weight"));
    TESSERA_RETURN_IF_ERROR(put(l.post_norm, o.post_norm, n + "post_attention_layernorm.weight"));
    if (o.pre_ff_norm != SIZE_MAX) {
      TESSERA_RETURN_IF_ERROR(
          put(l.pre_ff_norm, o.pre_ff_norm, n + "pre_feedforward_layernorm.weight"));
      TESSERA_RETURN_IF_ERROR(
          put(l.post_ff_norm, o.post_ff_norm, n + "post_feedforward_layernorm.weight"));
      x.pre_ff_norm = base + o.pre_ff_norm;
      x.post_ff_norm = base + o.post_ff_norm;
    }
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
    x.input_norm = base + o.input_norm;
    x.post_norm = base + o.post_norm;
    if (o.router != SIZE_MAX) {
      TESSERA_RETURN_IF_ERROR(upload_moe(l, o, p, n, x));
      continue;
    }
    // gate | up stacked: one GEMM, silu_mul reads both halves of each row.
    TESSERA_ASSIGN_OR_RETURN(
        x.gate_up,
        linear(o.gate_up, n, {{"mlp.gate_proj", &l.gate_proj}, {"mlp.up_proj", &l.up_proj}}));
    TESSERA_ASSIGN_OR_RETURN(x.down, linear(o.down, n, {{"mlp.down_proj", &l.down_proj}}));
  }
  TESSERA_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream), "uploading the weights");
  return d;
}

}  // namespace tessera
