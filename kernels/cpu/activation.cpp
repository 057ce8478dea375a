#include "kernels/cpu/activation.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "kernels/cpu/op_util.h"

namespace tessera::cpu {

namespace {

inline float silu(float x) { return x / (1.0f + std::exp(-x)); }

// torch's GeluTanh kernel: kBeta = M_SQRT2 * M_2_SQRTPI * 0.5, kKappa = 0.044715, in fp32.
inline float gelu_tanh(float x) {
  const float beta = static_cast<float>(M_SQRT2 * M_2_SQRTPI * 0.5);
  const float kappa = 0.044715f;
  const float inner = beta * (x + kappa * (x * x * x));
  return 0.5f * x * (1.0f + std::tanh(inner));
}

}  // namespace

Status silu_mul(CpuContext& ctx, std::span<const float> gate, std::span<const float> up,
                std::span<float> out) {
  if (gate.size() != up.size() || out.size() != gate.size()) {
    return invalid_argument("silu_mul: gate, up and out must have the same size (got " +
                            std::to_string(gate.size()) + ", " + std::to_string(up.size()) + ", " +
                            std::to_string(out.size()) + ")");
  }
  const int64_t n = static_cast<int64_t>(gate.size());
  // exp costs about ten multiply-adds.
  ctx.parallel_for(n, detail::kParallelWork / 10, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) out[i] = silu(gate[i]) * up[i];
  });
  return Status::ok();
}

Status gelu_tanh_mul(CpuContext& ctx, std::span<const float> gate, std::span<const float> up,
                     std::span<float> out) {
  if (gate.size() != up.size() || out.size() != gate.size()) {
    return invalid_argument("gelu_tanh_mul: gate, up and out must have the same size (got " +
                            std::to_string(gate.size()) + ", " + std::to_string(up.size()) + ", " +
                            std::to_string(out.size()) + ")");
  }
  const int64_t n = static_cast<int64_t>(gate.size());
  ctx.parallel_for(n, detail::kParallelWork / 10, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) out[i] = gelu_tanh(gate[i]) * up[i];
  });
  return Status::ok();
}

Status silu_mul_fused(CpuContext& ctx, std::span<const float> gate_up, int64_t inter,
                      std::span<float> out) {
  if (inter <= 0 || out.size() % static_cast<size_t>(inter) != 0 ||
      gate_up.size() != 2 * out.size()) {
    return invalid_argument(
        "silu_mul_fused: need gate_up [n, 2 * inter] and out [n, inter] with "
        "inter = " +
        std::to_string(inter) + ", got " + std::to_string(gate_up.size()) + " and " +
        std::to_string(out.size()) + " elements");
  }
  const int64_t n = static_cast<int64_t>(out.size()) / inter;
  const int64_t grain = std::max<int64_t>(1, detail::kParallelWork / (10 * inter));
  ctx.parallel_for(n, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* g = gate_up.data() + r * 2 * inter;
      const float* u = g + inter;
      float* o = out.data() + r * inter;
      for (int64_t i = 0; i < inter; ++i) o[i] = silu(g[i]) * u[i];
    }
  });
  return Status::ok();
}

}  // namespace tessera::cpu
