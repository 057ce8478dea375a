#include "kernels/cpu/linear.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "kernels/cpu/op_util.h"

namespace tessera::cpu {

namespace {

constexpr int64_t kTileRows = 4;

using detail::load4;
using detail::reduce8;
using detail::v4f;

// Eight weights [i, i + 8) as two fp32 vectors, from fp32 or (widened in registers) bf16.
inline void load8(const float* p, v4f* lo, v4f* hi) {
  *lo = load4(p);
  *hi = load4(p + 4);
}
inline void load8(const uint16_t* p, v4f* lo, v4f* hi) {
  typedef uint16_t v8u16 __attribute__((vector_size(16)));
  typedef uint32_t v4u32 __attribute__((vector_size(16)));
  v8u16 h;
  std::memcpy(&h, p, sizeof(h));
  const v4u32 a = __builtin_convertvector(__builtin_shufflevector(h, h, 0, 1, 2, 3), v4u32) << 16;
  const v4u32 b = __builtin_convertvector(__builtin_shufflevector(h, h, 4, 5, 6, 7), v4u32) << 16;
  std::memcpy(lo, &a, sizeof(a));
  std::memcpy(hi, &b, sizeof(b));
}
inline float scalar(float v) { return v; }
inline float scalar(uint16_t v) { return bf16_to_float(v); }

// x . w[r] for the 4 rows r of length `in`, sharing the loads of x and keeping the eight
// accumulators in registers. The lane order is exactly detail::dot's and bf16 widening is
// exact, so every path (fp32 tile, raw bf16, single row) gives the same bits. Returned as a
// vector, not through an array: a per-tile array in memory cost a frame allocation per call
// under ASan's use-after-return checks (most of a small model's step in the sanitizer suites).
template <typename W>
inline v4f dot4(const float* x, const W* w, int64_t in) {
  const W* w0 = w;
  const W* w1 = w + in;
  const W* w2 = w + 2 * in;
  const W* w3 = w + 3 * in;
  v4f a0 = {}, b0 = {}, a1 = {}, b1 = {}, a2 = {}, b2 = {}, a3 = {}, b3 = {};
  int64_t i = 0;
  for (; i + 8 <= in; i += 8) {
    const v4f xa = load4(x + i);
    const v4f xb = load4(x + i + 4);
    v4f lo, hi;
    load8(w0 + i, &lo, &hi);
    a0 += xa * lo;
    b0 += xb * hi;
    load8(w1 + i, &lo, &hi);
    a1 += xa * lo;
    b1 += xb * hi;
    load8(w2 + i, &lo, &hi);
    a2 += xa * lo;
    b2 += xb * hi;
    load8(w3 + i, &lo, &hi);
    a3 += xa * lo;
    b3 += xb * hi;
  }
  float s0 = reduce8(a0, b0), s1 = reduce8(a1, b1), s2 = reduce8(a2, b2), s3 = reduce8(a3, b3);
  for (; i < in; ++i) {
    s0 += x[i] * scalar(w0[i]);
    s1 += x[i] * scalar(w1[i]);
    s2 += x[i] * scalar(w2[i]);
    s3 += x[i] * scalar(w3[i]);
  }
  return v4f{s0, s1, s2, s3};
}

// One row, same lane order.
template <typename W>
inline float dot1(const float* x, const W* w, int64_t in) {
  v4f a = {}, b = {};
  int64_t i = 0;
  for (; i + 8 <= in; i += 8) {
    v4f lo, hi;
    load8(w + i, &lo, &hi);
    a += load4(x + i) * lo;
    b += load4(x + i + 4) * hi;
  }
  float s = reduce8(a, b);
  for (; i < in; ++i) s += x[i] * scalar(w[i]);
  return s;
}

// y[:, o0 .. o0 + rows) for all n tokens from rows of W in the layout of `w`.
template <typename W>
void tile_times_tokens(const float* x, int64_t n, int64_t in, const W* w, int64_t rows,
                       const float* bias, float* y, int64_t out_f, int64_t o0) {
  static_assert(kTileRows == 4, "dot4 computes a tile");
  for (int64_t t = 0; t < n; ++t) {
    const float* xt = x + t * in;
    v4f acc = {};
    if (rows == kTileRows) {
      acc = dot4(xt, w, in);
    } else {
      for (int64_t r = 0; r < rows; ++r) acc[r] = dot1(xt, w + r * in, in);
    }
    float* yt = y + t * out_f + o0;
    for (int64_t r = 0; r < rows; ++r) yt[r] = bias == nullptr ? acc[r] : acc[r] + bias[o0 + r];
  }
}

}  // namespace

Status linear(CpuContext& ctx, std::span<const float> x, const TensorView& weight,
              const TensorView* bias, std::span<float> y) {
  TESSERA_RETURN_IF_ERROR(detail::check_matrix(weight, "linear weight"));
  const int64_t out_f = weight.dim(0);
  const int64_t in_f = weight.dim(1);
  if (x.size() % static_cast<size_t>(in_f) != 0) {
    return invalid_argument("linear x: " + std::to_string(x.size()) +
                            " elements is not a whole number of rows of " + std::to_string(in_f) +
                            " (weight " + weight.describe() + ")");
  }
  const int64_t n = static_cast<int64_t>(x.size()) / in_f;
  TESSERA_RETURN_IF_ERROR(
      detail::check_size(y.size(), n * out_f, "linear y",
                         "[" + std::to_string(n) + ", " + std::to_string(out_f) + "]"));
  std::vector<float> b;
  if (bias != nullptr) {
    TESSERA_RETURN_IF_ERROR(detail::check_view(*bias, {out_f}, "linear bias"));
    b = detail::to_float(*bias);
  }
  if (n == 0) return Status::ok();

  const int64_t num_tiles = (out_f + kTileRows - 1) / kTileRows;
  const int64_t tile_work = kTileRows * in_f * n;
  const int64_t grain = std::max<int64_t>(1, detail::kParallelWork / tile_work);
  // fp32 weights are used in place; bf16 ones are widened in registers while there are few
  // tokens to amortise a conversion over, otherwise (and for fp16) a tile of rows is converted
  // once into an fp32 scratch and reused for every token.
  const bool raw_f32 = weight.dtype == DType::kF32;
  const bool raw_bf16 = weight.dtype == DType::kBF16 && n <= 4;
  const float* bias_f32 = b.empty() ? nullptr : b.data();
  ctx.parallel_for(num_tiles, grain, [&](int64_t tile_begin, int64_t tile_end) {
    std::vector<float> scratch;
    if (!raw_f32 && !raw_bf16) scratch.resize(static_cast<size_t>(kTileRows * in_f));
    ProgressTicker ticker(ctx);  // a range of tiles over 16k tokens can take seconds
    for (int64_t tile = tile_begin; tile < tile_end; ++tile) {
      const int64_t o0 = tile * kTileRows;
      const int64_t rows = std::min(kTileRows, out_f - o0);
      if (raw_f32) {
        const float* w = static_cast<const float*>(weight.data) + o0 * in_f;
        tile_times_tokens(x.data(), n, in_f, w, rows, bias_f32, y.data(), out_f, o0);
      } else if (raw_bf16) {
        const uint16_t* w = static_cast<const uint16_t*>(weight.data) + o0 * in_f;
        tile_times_tokens(x.data(), n, in_f, w, rows, bias_f32, y.data(), out_f, o0);
      } else {
        detail::to_float(weight, o0 * in_f, rows * in_f, scratch.data());
        tile_times_tokens(x.data(), n, in_f, scratch.data(), rows, bias_f32, y.data(), out_f, o0);
      }
      ticker.done(tile_work);
    }
  });
  return Status::ok();
}

}  // namespace tessera::cpu
