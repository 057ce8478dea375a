// Helpers shared by the CPU op tests: seeded random inputs and element-by-element comparison
// against float64 references.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "common/tensor.h"

namespace tessera::cpu::testing {

// n values uniform in [lo, hi), none exactly zero (zeros hide missing terms).
inline std::vector<float> random_floats(size_t n, uint32_t seed, float lo = -1.0f,
                                        float hi = 1.0f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) {
    do {
      x = dist(rng);
    } while (x == 0.0f);
  }
  return v;
}

// A weight tensor stored in `dtype`, with its values as the kernel will see them (rounded to
// the dtype) kept in fp64 for the reference.
struct Weight {
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  std::vector<float> f32;      // storage when dtype == kF32
  std::vector<uint16_t> half;  // storage when dtype is kF16 / kBF16
  std::vector<double> value;   // the exact values the storage holds

  TensorView view() const {
    return {dtype == DType::kF32 ? static_cast<const void*>(f32.data()) : half.data(), dtype,
            shape};
  }
};

inline Weight make_weight(DType dtype, std::vector<int64_t> shape, uint32_t seed, float lo = -1.0f,
                          float hi = 1.0f) {
  Weight w;
  w.dtype = dtype;
  w.shape = std::move(shape);
  int64_t n = 1;
  for (int64_t d : w.shape) n *= d;
  std::vector<float> src = random_floats(static_cast<size_t>(n), seed, lo, hi);
  w.value.resize(src.size());
  if (dtype == DType::kF32) {
    w.f32 = src;
    for (size_t i = 0; i < src.size(); ++i) w.value[i] = src[i];
  } else {
    w.half.resize(src.size());
    for (size_t i = 0; i < src.size(); ++i) {
      uint16_t h = dtype == DType::kBF16 ? float_to_bf16(src[i]) : float_to_f16(src[i]);
      if ((h & 0x7fffu) == 0) h = dtype == DType::kBF16 ? float_to_bf16(lo) : float_to_f16(lo);
      w.half[i] = h;
      w.value[i] = dtype == DType::kBF16 ? bf16_to_float(h) : f16_to_float(h);
    }
  }
  return w;
}

inline std::vector<double> to_double(const std::vector<float>& v) {
  return std::vector<double>(v.begin(), v.end());
}

// Every element: |actual[i] - expected[i]| <= atol[i] (a per-element bound, see each caller for
// why). Stops after a few reported failures.
inline void expect_near_all(const std::vector<float>& actual, const std::vector<double>& expected,
                            const std::vector<double>& atol, const std::string& what) {
  ASSERT_EQ(actual.size(), expected.size()) << what;
  ASSERT_EQ(atol.size(), expected.size()) << what;
  int failures = 0;
  for (size_t i = 0; i < actual.size() && failures < 5; ++i) {
    const double err = std::abs(static_cast<double>(actual[i]) - expected[i]);
    if (!(err <= atol[i])) {
      ++failures;
      ADD_FAILURE() << what << "[" << i << "]: got " << actual[i] << ", expected " << expected[i]
                    << " (error " << err << " > bound " << atol[i] << ")";
    }
  }
}

// The same with a relative bound: |actual - expected| <= rtol * |expected| + atol.
inline void expect_close_all(const std::vector<float>& actual, const std::vector<double>& expected,
                             double rtol, double atol, const std::string& what) {
  std::vector<double> bound(expected.size());
  for (size_t i = 0; i < expected.size(); ++i) bound[i] = rtol * std::abs(expected[i]) + atol;
  expect_near_all(actual, expected, bound, what);
}

inline const char* dtype_label(DType d) { return dtype_name(d); }

}  // namespace tessera::cpu::testing
