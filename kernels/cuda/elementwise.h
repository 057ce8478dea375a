// The CUDA model's memory-bound ops, each the GPU twin of a kernels/cpu op and rounded the way
// Hugging Face transformers rounds in bf16/fp16 (so greedy tokens track transformers):
// every intermediate that transformers materialises as a bf16/fp16 tensor is rounded to that
// type here too, with fp32 arithmetic in between.
//
// All pointers are device pointers; `dtype` (kBF16 or kF16; embedding and gather_rows, which only
// copy, also take kF32) is the element type of every activation/weight buffer named `void*`.
// Launches go on `stream` and are graph-capturable (no allocation, no synchronisation). Bad sizes
// are INVALID_ARGUMENT before anything is launched; a launch failure is INTERNAL naming the kernel.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/kv_cache_dtype.h"
#include "common/status.h"
#include "common/tensor.h"
#include "kernels/cuda/rope.h"

namespace tessera::cuda {

// out[t, :] = table[ids[t], :]   (cpu::embedding)
//   ids:   [num_tokens] int32, each in [0, vocab) (the caller validates; out-of-range ids are
//          clamped into [0, vocab - 1], never read out of bounds)
//   table: [vocab, hidden] dtype
//   out:   [num_tokens, hidden] dtype
Status embedding(DType dtype, const int32_t* ids, int64_t num_tokens, const void* table,
                 int64_t vocab, int64_t hidden, void* out, cudaStream_t stream);

// The vocabulary-parallel embedding of one tensor-parallel rank: out[t, :] = table[ids[t] -
// first_id, :] for ids in [first_id, first_id + rows), zeros for every other id (another rank
// holds it; the group's all-reduce completes the row).
//   ids:   [num_tokens] int32
//   table: [rows, hidden] dtype (this rank's rows of the vocabulary)
//   out:   [num_tokens, hidden] dtype
Status embedding_shard(DType dtype, const int32_t* ids, int64_t num_tokens, const void* table,
                       int64_t first_id, int64_t rows, int64_t hidden, void* out,
                       cudaStream_t stream);

// residual += x, rounded to the dtype once (what add_rms_norm writes to residual), for the
// residual stream a pipeline stage hands to the next.
//   x, residual: [n] dtype (kBF16 / kF16)
Status add_residual(DType dtype, const void* x, void* residual, int64_t n, cudaStream_t stream);

// dst[r, :] = src[rows[r], :]  (picks the rows whose logits are needed)
//   rows: [num_rows] int32 in [0, src_rows) (clamped like embedding's ids);
//   src: [src_rows, width];  dst: [num_rows, width]
Status gather_rows(DType dtype, const void* src, int64_t src_rows, const int32_t* rows,
                   int64_t num_rows, int64_t width, void* dst, cudaStream_t stream);

// out = RMSNorm(x) * weight, as transformers' LlamaRMSNorm:
//   h = float(x); h *= rsqrt(mean(h^2) + eps); out = round(weight * round(h))
// unit_offset (Gemma's RMSNorm, ModelConfig::norm_unit_offset: the checkpoint stores w and the
// norm scales by 1 + w), as transformers' GemmaRMSNorm: out = round(h * (1 + float(weight))),
// all in fp32 and rounded once.
//   x, out: [rows, hidden] dtype (may alias);  weight: [hidden] dtype
Status rms_norm(DType dtype, const void* x, const void* weight, int64_t rows, int64_t hidden,
                float eps, void* out, cudaStream_t stream, bool unit_offset = false);

// Fused residual add + RMSNorm (the decoder layer's "residual = residual + h; h = norm(residual)"):
//   residual = round(residual + x)     (in place)
//   out = rms_norm(residual) * weight  (as above, unit_offset too)
//   x: [rows, hidden];  residual: [rows, hidden] in/out;  weight: [hidden];  out: [rows, hidden]
//   x and out may alias; residual aliases neither.
Status add_rms_norm(DType dtype, const void* x, void* residual, const void* weight, int64_t rows,
                    int64_t hidden, float eps, void* out, cudaStream_t stream,
                    bool unit_offset = false);

// residual += round(RMSNorm(x) * x_weight); out = RMSNorm(residual) * weight: Gemma's
// post-attention (post-feed-forward) norm of the addend, the residual add and the next norm in
// one kernel, with the bits of rms_norm(x, x_weight -> x) followed by add_rms_norm (unit_offset
// for both norms). x, residual and out are three buffers; x may be overwritten (the normed addend:
// rows whose width or alignment the one-kernel path does not take run the two kernels).
Status norm_add_rms_norm(DType dtype, void* x, const void* x_weight, void* residual,
                         const void* weight, int64_t rows, int64_t hidden, float eps, void* out,
                         cudaStream_t stream, bool unit_offset = false);

// The attention block's per-token prologue, fused: split the qkv projection, optionally
// RMSNorm each q and k head (Qwen3's q_norm / k_norm), rotate q and k (RoPE, rotate_half
// convention, cos/sin rounded to dtype and each product and sum rounded to dtype, as
// transformers' apply_rotary_pos_emb in bf16), write q to q_out and k, v into the paged cache.
//   qkv:       [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim] dtype: q | k | v
//   constants (RopeConstants, rope.h): q_norm, k_norm [head_dim] dtype or both null (no qk
//              norm), their eps; cos, sin [max_position, rotary_dim / 2] fp32 (cpu::RopeTable's
//              tables, copied to the GPU)
//   rotary_dim: 0 (= head_dim), or even < head_dim: only the first rotary_dim dimensions of each
//              q and k head rotate (rotate_half over them; Phi-3's partial_rotary_factor), the
//              rest are stored as projected; no q/k norms then
//   positions: [num_tokens] int32 in [0, max_position) (a token whose position is outside is
//              skipped entirely: no q_out row, no cache write; never a read past the tables)
//   slots:     [num_tokens] int64: block_id * block_size + offset, or -1 = do not store (q_out
//              is still written); a slot outside [0, num_blocks * block_size) stores nothing
//   q_out:     [num_tokens, num_heads, head_dim] dtype
//   k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim] dtype (one layer)
// head_dim: even, <= 256. q_norm/k_norm use the rms_norm rounding: round(w * round(h * rsqrt)),
// or with norm_unit_offset (Gemma 3's q_norm / k_norm) round((1 + w) * h * rsqrt) in fp32.
// Only qkv may be the output of the kernel launched just before on the stream: the norms, the
// tables, positions and slots are read before the kernel waits for it (launch_pdl).
struct RopeCacheArgs {
  DType dtype = DType::kBF16;
  // kFp8E4M3: k and v are stored as E4M3 bytes, rounded from their dtype values (nearest even,
  // saturating at +-448).
  KvCacheDtype kv_cache_dtype = KvCacheDtype::kAuto;
  const void* qkv = nullptr;
  RopeConstants constants;  // the layer's head norms and rotation tables
  const int32_t* positions = nullptr;
  const int64_t* slots = nullptr;
  int64_t num_tokens = 0;
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  int64_t rotary_dim = 0;
  void* q_out = nullptr;
  void* k_cache = nullptr;
  void* v_cache = nullptr;
  int64_t num_blocks = 0;
  int64_t block_size = 0;
};
Status rope_and_cache(const RopeCacheArgs& args, cudaStream_t stream);

// out = round(round(silu(gate)) * up), gate | up side by side in one row (the fused gate_up
// projection), as transformers' act_fn(gate_proj(x)) * up_proj(x):
//   gate_up: [rows, 2 * inter] dtype (gate = columns [0, inter), up = [inter, 2 * inter))
//   out:     [rows, inter] dtype
Status silu_mul(DType dtype, const void* gate_up, int64_t rows, int64_t inter, void* out,
                cudaStream_t stream);

// out = round(round(gelu_tanh(gate)) * up), laid out and rounded as silu_mul: Gemma's GeGLU
// (hidden_activation gelu_pytorch_tanh), torch's gelu(approximate="tanh") in fp32
// (cpu::gelu_tanh_mul's formula), the result rounded to dtype as transformers' act_fn output.
//   gate_up: [rows, 2 * inter] dtype;  out: [rows, inter] dtype
Status gelu_tanh_mul(DType dtype, const void* gate_up, int64_t rows, int64_t inter, void* out,
                     cudaStream_t stream);

// x[i] = round(x[i] * round(scale)): Gemma's embedding normalizer. transformers multiplies the
// embeddings by torch.tensor(hidden_size ** 0.5, dtype=hidden_states.dtype), so the scale is
// rounded to dtype before the product (sqrt(2304) = 48 is exact; sqrt(640) is not).
//   x: [n] dtype (kBF16 / kF16)
Status scale_embedding(DType dtype, void* x, int64_t n, float scale, cudaStream_t stream);

// logits[i] = tanh(logits[i] / cap) * cap in fp32: Gemma 2's final_logit_softcapping, on the
// fp32 logits as the CPU backend (transformers does it on the lm_head output in the run dtype,
// then the logits are upcast; here they are fp32 from the GEMM already).
//   logits: [n] fp32;  cap > 0
Status softcap_logits(float* logits, int64_t n, float cap, cudaStream_t stream);

// Holds the stream for `ns` nanoseconds (one thread polling the GPU's global timer): a gate
// behind which the host enqueues a whole step before any of it runs, so that events between
// its kernels time the kernels and not the host's launches (actors/model/step_timer.h).
Status spin(int64_t ns, cudaStream_t stream);

// out[r, c] = round(out[r, c] + bias[c]): the bias of a linear layer whose GEMM does not add it
// (the int4 kernels).
//   out: [rows, cols] dtype;  bias: [cols] dtype
Status add_bias(DType dtype, void* out, const void* bias, int64_t rows, int64_t cols,
                cudaStream_t stream);

// dst[i] = src[i] converted from `from` to `to`, bit for bit what the host does with
// common/tensor.h: encode(TensorView::at(i)), encode = float_to_bf16 / float_to_f16 (round to
// nearest even, fp16 overflow to inf, subnormals rounded, their NaN encodings) or the fp32 bits.
// A same-dtype call goes through the same decode and encode (a 16-bit NaN may come back quieted).
//   src: [n] of `from`: kF32, kF16, kBF16 or kF8E4M3
//   dst: [n] of `to`: kF32, kF16 or kBF16 (must not overlap src)
// Any alignment of the element type. The weight upload's converter (actors/model/cuda_weights.cpp).
Status convert(DType from, const void* src, DType to, void* dst, int64_t n, cudaStream_t stream);

// dst[i] = round(scale * u(seed + i)), u(c) = the top 24 bits of splitmix64(c) as a value in
// [-1, 1) (c = seed + i, wrapping): seeded random weights without a host tensor, as vLLM's
// --load-format dummy initialises every parameter (uniform in +-1e-3).
//   dst: [n] of dtype kF32, kF16 or kBF16
Status fill_uniform(DType dtype, void* dst, int64_t n, uint64_t seed, float scale,
                    cudaStream_t stream);

}  // namespace tessera::cuda
