// Plain tensor views shared by the checkpoint reader, the CPU kernels and the model: a pointer,
// a dtype and a shape. Views never own memory (the mmap'd checkpoint, the KV cache or an
// activation buffer does).
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace tessera {

// kF32, kF16 and kBF16 are what models compute in; kI32 (packed int4/int8 weights, GPTQ's
// g_idx) and kF8E4M3 (FP8 weights) are how quantized checkpoints store theirs.
enum class DType : uint8_t { kF32, kF16, kBF16, kI32, kF8E4M3 };

// "F32", "F16", "BF16", "I32", "F8_E4M3" (the safetensors spellings).
const char* dtype_name(DType dtype);
size_t dtype_size(DType dtype);

// Read-only view of a dense, row-major tensor.
struct TensorView {
  const void* data = nullptr;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;

  int64_t numel() const;
  int64_t dim(size_t i) const { return shape.at(i); }
  size_t bytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype); }
  // "[4096, 128256] BF16"
  std::string describe() const;
  // Element i converted to float (any dtype; an I32 element as its integer value).
  float at(int64_t i) const;
  // Row r of a 2-D tensor, converted to float into out[0..shape[1]).
  void row_to_float(int64_t r, float* out) const;
};

inline float bf16_to_float(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// Round-to-nearest-even, as torch does; NaN stays NaN.
inline uint16_t float_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
  uint32_t rounding = 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + rounding) >> 16);
}

float f16_to_float(uint16_t h);
uint16_t float_to_f16(float f);

// FP8 E4M3 (OCP / NVIDIA "fn": bias 7, no infinities, 0x7f / 0xff NaN, largest finite 448):
// round to nearest even, saturating finite values at +-448 as CUDA's
// __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3) does; NaN stays NaN.
uint8_t float_to_fp8_e4m3(float f);
// Exact: every E4M3 value is a float.
float fp8_e4m3_to_float(uint8_t v);

}  // namespace tessera
