#include "kernels/cpu/rms_norm.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "kernels/cpu/op_util.h"

namespace tessera::cpu {

namespace {

// Checks weight is [d] and returns d (or 0 with *status set).
int64_t norm_dim(const TensorView& weight, Status* status) {
  if (weight.data == nullptr || weight.shape.size() != 1 || weight.shape[0] <= 0) {
    *status = invalid_argument("rms_norm weight: expected a non-empty 1-D tensor, got " +
                               weight.describe());
    return 0;
  }
  return weight.shape[0];
}

Status check_rows(size_t size, int64_t d, const char* what) {
  if (size % static_cast<size_t>(d) != 0) {
    return invalid_argument(std::string(what) + ": " + std::to_string(size) +
                            " elements is not a whole number of rows of " + std::to_string(d));
  }
  return Status::ok();
}

// out = w * (x * rsqrt(mean(x^2) + eps)) for one row. The sum of squares is accumulated in
// double and rounded once to fp32: torch's fp32 reduction is within a few ulps of that exact
// value, and a sequential fp32 sum over 8192 elements would not be.
inline void norm_row(const float* x, const float* w, int64_t d, float eps, float* out) {
  double sum = 0.0;
  for (int64_t i = 0; i < d; ++i) sum += static_cast<double>(x[i]) * x[i];
  const float variance = static_cast<float>(sum / static_cast<double>(d));
  const float inv = 1.0f / std::sqrt(variance + eps);
  for (int64_t i = 0; i < d; ++i) out[i] = w[i] * (x[i] * inv);
}

}  // namespace

Status rms_norm(CpuContext& ctx, std::span<const float> x, const TensorView& weight, double eps,
                std::span<float> out) {
  Status st;
  const int64_t d = norm_dim(weight, &st);
  TESSERA_RETURN_IF_ERROR(st);
  TESSERA_RETURN_IF_ERROR(check_rows(x.size(), d, "rms_norm x"));
  TESSERA_RETURN_IF_ERROR(check_rows(out.size(), d, "rms_norm out"));
  if (out.size() != x.size()) return invalid_argument("rms_norm: out and x differ in size");
  const int64_t n = static_cast<int64_t>(x.size()) / d;
  const std::vector<float> w = detail::to_float(weight);
  const float eps32 = static_cast<float>(eps);
  ctx.parallel_for(n, std::max<int64_t>(1, detail::kParallelWork / d), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r)
      norm_row(x.data() + r * d, w.data(), d, eps32, out.data() + r * d);
  });
  return Status::ok();
}

Status add_rms_norm(CpuContext& ctx, std::span<const float> x, std::span<float> residual,
                    const TensorView& weight, double eps, std::span<float> out) {
  Status st;
  const int64_t d = norm_dim(weight, &st);
  TESSERA_RETURN_IF_ERROR(st);
  TESSERA_RETURN_IF_ERROR(check_rows(x.size(), d, "add_rms_norm x"));
  if (residual.size() != x.size() || out.size() != x.size()) {
    return invalid_argument("add_rms_norm: x, residual and out must have the same size");
  }
  const int64_t n = static_cast<int64_t>(x.size()) / d;
  const std::vector<float> w = detail::to_float(weight);
  const float eps32 = static_cast<float>(eps);
  ctx.parallel_for(n, std::max<int64_t>(1, detail::kParallelWork / d), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      float* res = residual.data() + r * d;
      const float* xr = x.data() + r * d;
      for (int64_t i = 0; i < d; ++i) res[i] += xr[i];
      norm_row(res, w.data(), d, eps32, out.data() + r * d);
    }
  });
  return Status::ok();
}

Status rms_norm_per_head(CpuContext& ctx, std::span<float> x, const TensorView& weight,
                         double eps) {
  return rms_norm(ctx, x, weight, eps, x);
}

}  // namespace tessera::cpu
