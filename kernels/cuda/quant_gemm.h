// W4A16 linear layers for sm_90a: int4 weights (AWQ and 4-bit GPTQ checkpoints) against bf16 /
// fp16 activations, fp32 accumulation.
//
//   y[m, out] = x[m, in] . W^T,   W[o][i] = (q[o][i] - z[g][o]) * s[g][o],   g = group of i
//
// A checkpoint's tensors (common/checkpoint/quantization.h describes them) are uploaded as they
// are and repacked once on the GPU (repack_awq / repack_gptq) into the layout the kernels read
// (W4Layer below). w4_linear then takes one of two paths:
//   m <= kW4FusedMaxM (decode): one fused kernel streams the int4 weights once, dequantizes them
//     in registers and feeds mma.sync tensor-core tiles; its CTAs split the layer's (64-output x
//     64-input) units evenly (stream-K), so a 4096 x 4096 layer keeps every SM busy at m = 1.
//     For m = 1 and a layer of up to 32 M weights, a kernel without shared staging or cross-CTA
//     sums (warps stream 16-output strips into registers) does the same in less latency.
//   m > kW4FusedMaxM (prefill): the weights are dequantized into the workspace as [out, in] in
//     the run dtype and the given cuBLASLt Gemm multiplies.
// The fused kernel and the prefill path see the same dequantized weight: round((q - z) *
// round(s)) in the run dtype (s is the checkpoint's fp16 scale, rounded to bf16 for a bf16 run),
// then fp32 sums of its products; the m = 1 kernel skips the weight's rounding (w4_decode_kernel).
//
// Shapes: out and in multiples of 64 (kW4Tile), group 32, 64, 128 or in ("one group"), in a
// multiple of group. Every Llama / Qwen projection at tensor-parallel splits 1, 2, 4 and 8 fits
// (e.g. Qwen2-7B's 18944 / 8 = 2368 = 37 * 64, its k/v 512 / 8 = 64). Other shapes are
// INVALID_ARGUMENT naming the value.
//
// All pointers are device pointers unless a comment says host. Work is enqueued on `stream`;
// w4_linear allocates nothing, never synchronizes and reads nothing back, so it can be captured
// in a CUDA graph. Launch failures are INTERNAL naming the kernel.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <span>

#include "common/status.h"
#include "common/tensor.h"
#include "kernels/cuda/gemm.h"

namespace tessera::cuda {

// out and in are multiples of this (the kernels' tile of outputs and of inputs).
inline constexpr int64_t kW4Tile = 64;
// Rows of x up to which w4_linear takes the fused kernel; above, dequantize + cuBLASLt.
inline constexpr int64_t kW4FusedMaxM = 64;

// One repacked int4 linear layer on the device (this rank's shard). The buffers live in one
// region of w4_bytes(out, in, group) bytes that repack_* fills; the struct only points into it.
//
//   qweight: out * in / 8 uint32 words, in (64 x 64) units ordered [out / 64][in / 64] (one
//            unit = 512 words = 2 KiB, a contiguous stream for the fused kernel). Inside a unit,
//            [warp 4][lane 32][step 4]: the 16 outputs 16 * warp.. and the 16 inputs 16 * step..
//            form one m16n8k16 A operand (outputs as rows, inputs as columns), and word
//            [warp][lane][step] holds the 8 weights that lane owns in it. With r = lane / 4,
//            c = 2 * (lane % 4), nibble p (bits 4p..4p+3) of the word is the weight
//              p = 0: (r, c)      p = 4: (r, c + 1)        -> A register a0 = {p0, p4}
//              p = 1: (r + 8, c)  p = 5: (r + 8, c + 1)    -> a1 = {p1, p5}
//              p = 2: (r, c + 8)  p = 6: (r, c + 9)        -> a2 = {p2, p6}
//              p = 3: (r + 8, c + 8)  p = 7: (r + 8, c + 9) -> a3 = {p3, p7}
//            so (word >> 4p) & 0x000f000f puts the pair of register a_p in the two 16-bit halves.
//   scales:  [out / 64][in / group][64] in `dtype` (the checkpoint's fp16 scale, rounded)
//   zeros:   [out / 64][in / group][64] uint8: the zero point z itself, 0..16 (GPTQ's stored
//            z - 1 already undone)
//   perm:    [in] int32 or null. GPTQ act-order: column j of the repacked weights is input
//            perm[j] (inputs sorted by group), and w4_linear multiplies x[:, perm].
struct W4Layer {
  int64_t out = 0;
  int64_t in = 0;
  int64_t group = 0;           // 32, 64, 128, or in
  DType dtype = DType::kBF16;  // kBF16 or kF16: scales', and x's and y's in w4_linear
  const uint32_t* qweight = nullptr;
  const void* scales = nullptr;
  const uint8_t* zeros = nullptr;
  const int32_t* perm = nullptr;
};

// OK when a layer [out, in] with `group` fits the kernels (see the file comment);
// INVALID_ARGUMENT naming the offending value otherwise.
Status check_w4_shape(int64_t out, int64_t in, int64_t group);

// Device bytes of a repacked layer (qweight, scales, zeros and room for perm, each 256-byte
// aligned). Precondition: check_w4_shape is OK.
uint64_t w4_bytes(int64_t out, int64_t in, int64_t group);

// An AWQ "GEMM" layer's tensors as the checkpoint stores them, on the device.
struct AwqTensors {
  int64_t out = 0;
  int64_t in = 0;
  int64_t group = 0;                 // the group size (AWQ has no "one group")
  const int32_t* qweight = nullptr;  // I32 [in, out / 8], AWQ's nibble order (kAwqOrder)
  const int32_t* qzeros = nullptr;   // I32 [in / group, out / 8], the same order
  const void* scales = nullptr;      // F16 [in / group, out]
};

// A 4-bit GPTQ layer's tensors as the checkpoint stores them: on the device, except g_idx.
struct GptqTensors {
  int64_t out = 0;
  int64_t in = 0;
  int64_t group = 0;                 // the group size, or in for one group (group_size -1)
  const int32_t* qweight = nullptr;  // I32 [in / 8, out], packed along the inputs, in order
  const int32_t* qzeros = nullptr;   // I32 [in / group, out / 8], packed along the outputs
  const void* scales = nullptr;      // F16 [in / group, out]
  // Host [in]: the group of each input, or empty for i / group. Each group must hold exactly
  // `group` inputs (what GPTQ writes, with or without act-order).
  std::span<const int32_t> g_idx;
  bool zero_offset = true;  // qzeros store z - 1 (checkpoint_format "gptq"; false: "gptq_v2")
};

// Repacks a checkpoint's layer into `dst` (device, 16-byte aligned, dst_bytes >=
// w4_bytes(out, in, group)) for a run in `dtype` (kBF16 or kF16), and returns the layer that
// points into dst. GPU kernels do the work (a 70B model repacks in seconds); repack_gptq also
// sorts g_idx on the host when it is not i / group (act-order) and copies the permutation to
// dst. w4_linear reads the weights before it waits for the kernel before it (launch_pdl), so
// synchronize `stream` (as a model's load does) before the first w4_linear.
// INVALID_ARGUMENT: shapes (check_w4_shape), a null pointer, a small or misaligned dst, dtype,
// a g_idx of the wrong size, out of range or with groups of other sizes.
Expected<W4Layer> repack_awq(const AwqTensors& t, DType dtype, void* dst, uint64_t dst_bytes,
                             cudaStream_t stream);
Expected<W4Layer> repack_gptq(const GptqTensors& t, DType dtype, void* dst, uint64_t dst_bytes,
                              cudaStream_t stream);

// The layer's weight as the kernels use it: w [out, in] row-major in layer.dtype, in the
// checkpoint's input order (perm undone), each value round((q - z) * s) in the dtype. The
// prefill path of w4_linear, and the tests' round trip against the CPU's dequantize.
// w must be 16-byte aligned.
Status w4_dequantize(const W4Layer& layer, void* w, cudaStream_t stream);

// Workspace bytes w4_linear needs for this layer and any m <= max_m: a fixed 32 KiB of split-K
// counters, then max(the fused path's act-order / alignment copy of x and its split-K partial
// sums, the prefill path's [out, in] dequantized weight when max_m > kW4FusedMaxM). Layers may
// share one workspace (take the largest) as long as their calls are ordered on one stream.
uint64_t w4_workspace_bytes(int64_t out, int64_t in, int64_t max_m);

// The kernel w4_linear runs for a layer [out, in] and m rows: for m = 1 and a layer of up to
// 32 Mi weights (in <= 48 Ki) the gemv kernel, which multiplies the exact (q - z) by x and
// applies the scale to fp32 sums of 32 products, so its result is x . ((q - z) s) with s in the
// dtype but no weight rounded; the fused kernel for the rest of m <= kW4FusedMaxM, dequantize +
// cuBLASLt above. The fused kernel and the dequantize path multiply the rounded weight of
// w4_dequantize. TESSERA_W4_DECODE=fused|gemv in the environment forces m = 1's kernel (the
// gemv where in allows) to compare them.
enum class W4DecodeKernel : uint8_t { kGemv, kFused, kDequantGemm };
W4DecodeKernel w4_decode_kernel(int64_t out, int64_t in, int64_t m);

// y = x . W^T for the layer (see the file comment for the two paths).
//   x:  [m, in] layer.dtype (any alignment; a 16-byte aligned x is read in place)
//   y:  [m, out] layer.dtype; must not overlap x or the workspace
//   workspace: w4_workspace_bytes(out, in, >= m) bytes, 16-byte aligned, ZEROED ONCE before its
//       first use (cudaMemset): the fused kernel's split-K counters live in its first 32 KiB and
//       every call leaves them zero again. One workspace per stream.
//   gemm: the stream's cuBLASLt Gemm, used when m > kW4FusedMaxM (may be null otherwise)
// m >= 1. INVALID_ARGUMENT naming the value: a bad layer (shape, dtype, null or misaligned
// buffer), m < 1, a null x / y / workspace, a small workspace, no gemm for m > kW4FusedMaxM.
Status w4_linear(const W4Layer& layer, const void* x, int64_t m, void* y, void* workspace,
                 uint64_t workspace_bytes, Gemm* gemm, cudaStream_t stream);

}  // namespace tessera::cuda
