#include "common/tensor.h"

#include <cmath>
#include <cstring>
#include <limits>

namespace tessera {

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return "F32";
    case DType::kF16:
      return "F16";
    case DType::kBF16:
      return "BF16";
    case DType::kI32:
      return "I32";
    case DType::kF8E4M3:
      return "F8_E4M3";
  }
  return "?";
}

size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kF32:
    case DType::kI32:
      return 4;
    case DType::kF16:
    case DType::kBF16:
      return 2;
    case DType::kF8E4M3:
      return 1;
  }
  return 4;
}

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string TensorView::describe() const {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + "] " + dtype_name(dtype);
}

float TensorView::at(int64_t i) const {
  switch (dtype) {
    case DType::kF32:
      return static_cast<const float*>(data)[i];
    case DType::kF16:
      return f16_to_float(static_cast<const uint16_t*>(data)[i]);
    case DType::kBF16:
      return bf16_to_float(static_cast<const uint16_t*>(data)[i]);
    case DType::kI32:
      return static_cast<float>(static_cast<const int32_t*>(data)[i]);
    case DType::kF8E4M3:
      return fp8_e4m3_to_float(static_cast<const uint8_t*>(data)[i]);
  }
  return 0.f;
}

void TensorView::row_to_float(int64_t r, float* out) const {
  const int64_t cols = shape.at(1);
  const int64_t base = r * cols;
  switch (dtype) {
    case DType::kF32:
      std::memcpy(out, static_cast<const float*>(data) + base, cols * sizeof(float));
      return;
    case DType::kF16: {
      const auto* p = static_cast<const uint16_t*>(data) + base;
      for (int64_t c = 0; c < cols; ++c) out[c] = f16_to_float(p[c]);
      return;
    }
    case DType::kBF16: {
      const auto* p = static_cast<const uint16_t*>(data) + base;
      for (int64_t c = 0; c < cols; ++c) out[c] = bf16_to_float(p[c]);
      return;
    }
    case DType::kI32:
    case DType::kF8E4M3:
      for (int64_t c = 0; c < cols; ++c) out[c] = at(base + c);
      return;
  }
}

float f16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      exp = 127 - 15 + 1;
      while ((mant & 0x400u) == 0) {
        mant <<= 1;
        --exp;
      }
      mant &= 0x3ffu;
      bits = sign | (exp << 23) | (mant << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

uint16_t float_to_f16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t abs = bits & 0x7fffffffu;
  if (abs > 0x7f800000u) return sign | 0x7e00u;   // NaN
  if (abs >= 0x477ff000u) return sign | 0x7c00u;  // overflow → inf (incl. rounding)
  if (abs < 0x38800000u) {                        // subnormal or zero
    if (abs < 0x33000000u) return sign;           // rounds to zero
    const uint32_t exp = abs >> 23;
    const uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126 - exp;  // 14..24
    uint32_t half = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1);
    const uint32_t halfway = 1u << (shift - 1);
    if (rem > halfway || (rem == halfway && (half & 1u))) ++half;
    return sign | static_cast<uint16_t>(half);
  }
  uint32_t h = ((abs >> 13) - ((127 - 15) << 10));
  const uint32_t rem = abs & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;
  return sign | static_cast<uint16_t>(h);
}

uint8_t float_to_fp8_e4m3(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  const auto sign = static_cast<uint8_t>((bits >> 24) & 0x80u);
  if (std::isnan(f)) return static_cast<uint8_t>(sign | 0x7f);
  const float a = std::fabs(f);
  if (a >= 448.0f) return static_cast<uint8_t>(sign | 0x7e);  // saturate (also +-inf)
  if (a < 0.015625f) {
    // Subnormal range, steps of 2^-9; nearbyint rounds half to even. 8 * 2^-9 = 2^-6 is the
    // smallest normal, whose encoding (exponent 1, mantissa 0) is 8 as well.
    return static_cast<uint8_t>(sign | static_cast<int>(std::nearbyint(a * 512.0f)));
  }
  int e = 0;
  const float fr = std::frexp(a, &e);  // a = fr * 2^e, fr in [0.5, 1)
  // Mantissa in eighths of 2^(e-1): q in [8, 16]; 16 carries into the next binade.
  int q = static_cast<int>(std::nearbyint(fr * 16.0f));
  int exp = e - 1 + 7;
  if (q == 16) {
    q = 8;
    ++exp;
  }
  return static_cast<uint8_t>(sign | (exp << 3) | (q - 8));
}

float fp8_e4m3_to_float(uint8_t v) {
  const int exp = (v >> 3) & 0xf;
  const int man = v & 7;
  float a;
  if (exp == 15 && man == 7) {
    a = std::numeric_limits<float>::quiet_NaN();
  } else if (exp == 0) {
    a = std::ldexp(static_cast<float>(man), -9);
  } else {
    a = std::ldexp(static_cast<float>(8 + man), exp - 7 - 3);
  }
  return (v & 0x80) ? -a : a;
}

}  // namespace tessera
