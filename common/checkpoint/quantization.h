// Quantized checkpoints: the formats the public tools write, read exactly as they write them.
//
//   AWQ "GEMM" (AutoAWQ's WQLinear_GEMM; quant_method "awq", version "gemm"):
//     <linear>.qweight  I32 [in, out / 8]   eight 4-bit weights per int32, along the output
//                                           features, in AWQ's order: nibble i (bits 4i..4i+3)
//                                           of packed column c holds output c * 8 + kAwqOrder[i]
//     <linear>.qzeros   I32 [in / group, out / 8]   the zero points, packed the same way
//     <linear>.scales   F16 [in / group, out]
//     w[o][i] = (q[i][o] - z[i / group][o]) * s[i / group][o]
//   GPTQ (AutoGPTQ / GPTQModel; quant_method "gptq", checkpoint_format "gptq"):
//     <linear>.qweight  I32 [in / (32 / bits), out]   along the input features, in order:
//                                                     bits b*i.. of row r hold input r * p + i
//     <linear>.qzeros   I32 [groups, out / (32 / bits)]   along the output features, in order;
//                                                     stored as zero - 1 ("gptq"; "gptq_v2"
//                                                     stores the zero itself)
//     <linear>.scales   F16 [groups, out]
//     <linear>.g_idx    I32 [in]   the group of each input feature: i / group without
//                                  desc_act, any permutation's groups with it
//     w[o][i] = (q[i][o] - z[g_idx[i]][o]) * s[g_idx[i]][o]; sym: z = 2^(bits-1)
//   FP8 W8A8 (quant_method "fp8", vLLM's / AutoFP8's; or "compressed-tensors" float-quantized,
//   llm-compressor's *-FP8 checkpoints):
//     <linear>.weight        F8_E4M3 [out, in]
//     <linear>.weight_scale  F32/BF16/F16: [] or [1] per tensor, [out, 1] or [out] per channel
//     <linear>.input_scale   [] or [1]: a static activation scale (absent: dynamic per token)
//     w[o][i] = fp8(weight[o][i]) * scale (per tensor) or * scale[o] (per channel); the
//     activations are quantized too: x = fp8(x / a) * a, with a = max|x of the token| / 448
//     (dynamic) or the static input_scale.
//   --quantization fp8 on a plain checkpoint quantizes each linear at load (vLLM's online FP8):
//     per tensor, scale = max|w| / 448.
// Only the linear layers of the decoder (q, k, v, o, gate, up, down) are quantized; embeddings,
// norms and lm_head stay plain (a checkpoint that quantizes lm_head is refused).
#pragma once

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "common/tensor.h"

namespace tessera {

// --quantization (vLLM's names) and a checkpoint's method. awq_marlin and gptq_marlin name the
// same formats as awq and gptq (vLLM picks its kernel by them; Tessera's int4 kernels are one
// family): they parse to kAwq and kGptq.
enum class QuantMethod : uint8_t { kAuto, kNone, kAwq, kGptq, kFp8 };

// "auto" (the flag's default: the checkpoint's), "none", "awq", "awq_marlin", "gptq",
// "gptq_marlin", "fp8"; INVALID_ARGUMENT naming the flag and the choices otherwise.
Expected<QuantMethod> parse_quant_method(std::string_view text);
const char* quant_method_name(QuantMethod method);  // "auto", "none", "awq", "gptq", "fp8"

// FP8 weight scales: one per tensor, or one per output feature.
enum class Fp8Scale : uint8_t { kTensor, kChannel };
// FP8 activations: quantized per token with a scale from each token's largest value (dynamic),
// with the checkpoint's input_scale (static), or not at all (weight-only FP8, W8A16).
enum class Fp8Activations : uint8_t { kDynamic, kStatic, kNone };

// How a checkpoint's linear layers are stored: config.json's quantization_config, or what
// --quantization fp8 makes of a plain checkpoint at load.
struct QuantConfig {
  QuantMethod method = QuantMethod::kNone;  // kNone, kAwq, kGptq or kFp8
  // awq / gptq
  int bits = 0;             // 4 (gptq: 4 or 8); fp8: 8
  int64_t group_size = 0;   // input features per scale; gptq's -1 (one group) is stored as 0
  bool desc_act = false;    // gptq: g_idx is a permutation's groups
  bool sym = false;         // gptq: every zero is 2^(bits-1)
  bool zero_offset = true;  // gptq: qzeros hold zero - 1 (checkpoint_format "gptq")
  // fp8
  Fp8Scale weight_scale = Fp8Scale::kTensor;
  Fp8Activations activations = Fp8Activations::kDynamic;  // kStatic: input_scale tensors
  bool online = false;  // a plain checkpoint quantized at load
  // Linear modules left plain ("model.layers.0.mlp.down_proj"): AWQ's modules_to_not_convert,
  // fp8's ignored_layers, compressed-tensors' ignore (regular expressions after "re:").
  std::vector<std::string> ignored;
  std::string describe() const;  // "awq (4-bit, group 128)", for logs and errors

  // False when `module` (the linear's name without ".weight") is in `ignored`.
  bool quantizes(const std::string& module) const;
  // Output features packed into one int32 of qweight's / qzeros' last dimension (awq: 8;
  // gptq's qzeros: 32 / bits), and input features per int32 row of gptq's qweight.
  int64_t pack_factor() const { return bits > 0 ? 32 / bits : 1; }
  // Input features per scale group: group_size, or `in_features` for one group.
  int64_t group(int64_t in_features) const { return group_size > 0 ? group_size : in_features; }

  friend bool operator==(const QuantConfig&, const QuantConfig&) = default;
};

// config.json's "quantization_config" object (`file` names it in errors). Refused with a clear
// error naming the field: an unknown quant_method, AWQ other than version "gemm" or without
// zero points, bits other than 4 (awq) or 4/8 (gptq), a group size other than -1, 32, 64 or
// 128, a quantized lm_head, FP8 block scales (weight_block_size), compressed-tensors other than
// 8-bit float weights.
Expected<QuantConfig> parse_quantization_config(const std::string& json_text,
                                                const std::string& file);

// The device memory of the CUDA backend's FP8 GEMM at most, whatever the shapes (its cuBLASLt
// workspace and epilogue scratch: kernels/cuda/fp8_linear.h's Fp8Gemm::kMaxDeviceBytes).
inline constexpr uint64_t kFp8GemmDeviceBytes = 96ull << 20;

// The quantization a run uses: the checkpoint's (`checkpoint`, kNone for a plain one) as
// --quantization `flag` asks. kAuto takes the checkpoint's; a flag naming the checkpoint's
// method agrees; kFp8 on a plain checkpoint is online FP8; anything else (awq on a plain or a
// gptq checkpoint, none on a quantized one) is INVALID_ARGUMENT naming both.
Expected<QuantConfig> resolve_quantization(QuantMethod flag, const QuantConfig& checkpoint);

// The quantization_config object that describes `q` as its exporter writes it (AutoAWQ's, GPTQ's,
// "fp8" for per-tensor FP8, compressed-tensors for per-channel): parse_quantization_config reads
// it back as `q`. Precondition: q.method is kAwq, kGptq or kFp8 (not online).
std::string quantization_config_json(const QuantConfig& q);

// ---- packing (make-model writes with these; the readers' tests round-trip them)

// AWQ's nibble order: nibble i of a packed int32 holds output feature 8c + kAwqOrder[i].
inline constexpr int kAwqOrder[8] = {0, 2, 4, 6, 1, 3, 5, 7};

// `q` [rows, cols] (values < 16) packed along cols in AWQ's order: [rows, cols / 8].
std::vector<int32_t> pack_awq(std::span<const uint8_t> q, int64_t rows, int64_t cols);
std::vector<uint8_t> unpack_awq(std::span<const int32_t> packed, int64_t rows, int64_t cols);
// `q` [rows, cols] (values < 2^bits) packed along rows, in order: [rows / (32 / bits), cols].
std::vector<int32_t> pack_rows(std::span<const uint8_t> q, int64_t rows, int64_t cols, int bits);
std::vector<uint8_t> unpack_rows(std::span<const int32_t> packed, int64_t rows, int64_t cols,
                                 int bits);
// `q` [rows, cols] packed along cols, in order: [rows, cols / (32 / bits)] (GPTQ's qzeros).
std::vector<int32_t> pack_cols(std::span<const uint8_t> q, int64_t rows, int64_t cols, int bits);
std::vector<uint8_t> unpack_cols(std::span<const int32_t> packed, int64_t rows, int64_t cols,
                                 int bits);

// ---- one linear layer (this rank's shard)

// A linear layer's tensors as the checkpoint stores them (data == null when absent). Plain:
// `weight` [out, in] in F32/F16/BF16. AWQ/GPTQ: qweight, qzeros, scales (and GPTQ's g_idx).
// FP8: weight (F8_E4M3), weight_scale and, when static, input_scale.
struct LinearWeight {
  TensorView weight;
  TensorView qweight;
  TensorView qzeros;
  TensorView scales;
  TensorView g_idx;
  TensorView weight_scale;
  TensorView input_scale;
  QuantMethod method = QuantMethod::kNone;  // kNone: plain `weight`

  bool present() const { return weight.data != nullptr || qweight.data != nullptr; }
  // [out, in] of the layer (this rank's shard).
  int64_t out_features(const QuantConfig& q) const;
  int64_t in_features(const QuantConfig& q) const;
  uint64_t bytes() const;  // every tensor it holds
};

// The layer's weight as [out, in] floats: the exact value of each dequantized weight (the
// CPU backend's oracle). INVALID_ARGUMENT, naming `name`, when a tensor is missing or a shape
// or dtype does not fit the others, or a zero / g_idx value is out of range.
Expected<std::vector<float>> dequantize(const LinearWeight& w, const QuantConfig& q,
                                        const std::string& name);

// One tensor of a quantized linear layer as an exporter writes it.
struct QuantizedPart {
  std::string suffix;  // "qweight", "qzeros", "scales", "g_idx", "weight", "weight_scale", ...
  DType dtype = DType::kI32;
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;
};

// `w` [out, in] quantized as `q`'s exporter stores it (make-model's writer): AWQ and asymmetric
// GPTQ by each group's min and max, symmetric GPTQ by its largest magnitude (scales rounded to
// F16 before the weights are rounded to them), GPTQ's desc_act with g_idx from a permutation
// drawn from `seed`; FP8 per tensor or channel by the largest magnitude, a static input_scale of
// 8 / 448. Precondition: the shapes fit q (whole groups, whole int32s).
// OK when a linear layer `name` of [out, in] can be stored as `q`: whole int32s along its packed
// dimensions, whole groups along its inputs; INVALID_ARGUMENT naming the layer and numbers.
Status check_linear_shape(const QuantConfig& q, int64_t out, int64_t in, const std::string& name);

std::vector<QuantizedPart> quantize_linear(std::span<const float> w, int64_t out, int64_t in,
                                           const QuantConfig& q, uint64_t seed);
// The same, the weights asked for by rows: rows(first, last, dst) writes rows [first, last) of
// w to dst ([last - first, in]), from several threads at once (disjoint rows). AWQ and GPTQ
// never hold more than a block of rows per thread (make-model's 70B layers).
using WeightRows = std::function<void(int64_t first, int64_t last, float* dst)>;
std::vector<QuantizedPart> quantize_linear(const WeightRows& rows, int64_t out, int64_t in,
                                           const QuantConfig& q, uint64_t seed);

// FP8 of a plain [out, in] weight, per tensor (online FP8): the E4M3 bytes and the scale.
struct Fp8Weight {
  std::vector<uint8_t> data;
  float scale = 1.f;
};
Fp8Weight quantize_fp8(const TensorView& weight);

// An FP8 checkpoint's weight_scale of `w` as one scale per output feature (a per-tensor scale
// repeated), each positive and finite; INVALID_ARGUMENT naming `name`'s tensor otherwise (the
// weight not F8_E4M3 [out, in], the scale missing, shaped otherwise, or not a positive finite
// number). dequantize (the CPU) and the GPU's upload both read the scales through it.
Expected<std::vector<float>> fp8_weight_scales(const LinearWeight& w, const QuantConfig& q,
                                               const std::string& name);

// The static input scale of layers that share one input (q, k, v; gate, up): the largest of
// theirs, as vLLM's fused layers take it, so the one rounded input serves them all; 0 when none
// has one (dynamic).
float shared_input_scale(std::initializer_list<const LinearWeight*> layers);

// W8A8's activation rounding on the CPU: each row of x [rows, cols] becomes fp8(x / a) * a,
// a = `input_scale` when > 0 (static), else max|row| / 448 (dynamic per token). Under tensor
// parallelism a row-parallel layer's rank rounds its share of the row (vLLM's W8A8 does too).
void fake_quantize_fp8_activations(std::span<float> x, int64_t rows, int64_t cols,
                                   float input_scale);

}  // namespace tessera
