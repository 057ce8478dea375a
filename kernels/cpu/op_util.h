// Helpers shared by the CPU ops (not an op): argument checks that produce clear Status
// messages, dtype conversion of weight views, and the fp32 dot product every op uses.
#pragma once

#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <span>
#include <string>
#include <vector>

#include "common/status.h"
#include "common/tensor.h"

namespace tessera::cpu::detail {

// OK when `view` has data and exactly `shape` ("<what>: expected [4096, 128] (any dtype), got
// [4096, 64] BF16" otherwise).
Status check_view(const TensorView& view, std::initializer_list<int64_t> shape, const char* what);
// OK when `view` is 2-D with data.
Status check_matrix(const TensorView& view, const char* what);
// OK when span.size() == expected ("<what>: expected 512 elements ([4, 128]), got 500").
Status check_size(size_t actual, int64_t expected, const char* what, const std::string& shape);

// out[0, count) = elements [begin, begin + count) of `view` (flattened), converted to fp32.
void to_float(const TensorView& view, int64_t begin, int64_t count, float* out);
// The whole view as fp32 (for small tensors: norm weights, biases).
std::vector<float> to_float(const TensorView& view);

// IEEE half -> fp32, exact for every input (zero, subnormal, inf, NaN payload), branch-light so
// the per-row weight conversion loops stay fast. Same results as common's f16_to_float.
inline float half_to_float(uint16_t h) {
  constexpr uint32_t kShiftedExp = 0x7c00u << 13;
  uint32_t o = static_cast<uint32_t>(h & 0x7fffu) << 13;
  const uint32_t exp = o & kShiftedExp;
  o += (127u - 15u) << 23;
  if (exp == kShiftedExp) {
    o += (128u - 16u) << 23;  // inf / NaN
  } else if (exp == 0) {      // zero / subnormal: renormalise through the fp32 unit
    o += 1u << 23;
    float f;
    std::memcpy(&f, &o, sizeof(f));
    f -= 6.103515625e-05f;  // 2^-14
    std::memcpy(&o, &f, sizeof(f));
  }
  o |= static_cast<uint32_t>(h & 0x8000u) << 16;
  float f;
  std::memcpy(&f, &o, sizeof(f));
  return f;
}

// Work below this many multiply-adds runs on the calling thread: waking the pool costs a few
// microseconds, about what one core does in this many.
inline constexpr int64_t kParallelWork = 1 << 15;

// The fp32 dot product every op uses, in a fixed order independent of threading: 8 interleaved
// lanes (two 4-wide vectors, which GCC/Clang lower to SSE or wider without changing the
// arithmetic), reduced by reduce8, then the tail in order.
typedef float v4f __attribute__((vector_size(16)));

inline v4f load4(const float* p) {
  v4f v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline float reduce8(v4f q0, v4f q1) {
  const v4f v = q0 + q1;
  return (v[0] + v[2]) + (v[1] + v[3]);
}

inline float dot(const float* a, const float* b, int64_t n) {
  v4f q0 = {}, q1 = {};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    q0 += load4(a + i) * load4(b + i);
    q1 += load4(a + i + 4) * load4(b + i + 4);
  }
  float s = reduce8(q0, q1);
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

}  // namespace tessera::cpu::detail
