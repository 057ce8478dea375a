#include "kernels/cpu/moe.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>

#include "kernels/cpu/activation.h"
#include "kernels/cpu/linear.h"
#include "kernels/cpu/op_util.h"

namespace tessera::cpu {

namespace {

// y = down(silu(gate(x)) * up(x)) for the rows of x.
Status expert_mlp(CpuContext& ctx, const MoeExpert& e, std::span<const float> x,
                  std::vector<float>& y) {
  const int64_t hidden = e.gate.shape.at(1), inter = e.gate.shape.at(0);
  const int64_t n = static_cast<int64_t>(x.size()) / hidden;
  std::vector<float> gate(static_cast<size_t>(n * inter)), up(gate.size());
  TESSERA_RETURN_IF_ERROR(linear(ctx, x, e.gate, nullptr, gate));
  TESSERA_RETURN_IF_ERROR(linear(ctx, x, e.up, nullptr, up));
  TESSERA_RETURN_IF_ERROR(silu_mul(ctx, gate, up, gate));
  y.assign(static_cast<size_t>(n * hidden), 0.0f);
  return linear(ctx, gate, e.down, nullptr, y);
}

Status check_layer(const MoeLayer& l, int64_t hidden) {
  TESSERA_RETURN_IF_ERROR(detail::check_matrix(l.router, "moe: router"));
  const int64_t experts = l.router.shape[0];
  const int64_t held = static_cast<int64_t>(l.experts.size());
  if (l.router.shape[1] != hidden || l.expert_begin < 0 || held < 1 ||
      l.expert_begin + held > experts) {
    return invalid_argument("moe: router " + l.router.describe() + " needs hidden " +
                            std::to_string(hidden) + " and experts " +
                            std::to_string(l.expert_begin) + ".." +
                            std::to_string(l.expert_begin + held - 1) + " among its rows");
  }
  if (l.top_k < 1 || l.top_k > experts) {
    return invalid_argument("moe: top_k " + std::to_string(l.top_k) + " is not in [1, " +
                            std::to_string(experts) + "]");
  }
  auto check_expert = [hidden](const MoeExpert& e) -> Status {
    TESSERA_RETURN_IF_ERROR(detail::check_matrix(e.gate, "moe: expert gate"));
    const int64_t inter = e.gate.shape[0];
    TESSERA_RETURN_IF_ERROR(detail::check_view(e.gate, {inter, hidden}, "moe: expert gate"));
    TESSERA_RETURN_IF_ERROR(detail::check_view(e.up, {inter, hidden}, "moe: expert up"));
    return detail::check_view(e.down, {hidden, inter}, "moe: expert down");
  };
  for (const MoeExpert& e : l.experts) TESSERA_RETURN_IF_ERROR(check_expert(e));
  if (l.shared.gate.data != nullptr) {
    TESSERA_RETURN_IF_ERROR(check_expert(l.shared));
    TESSERA_RETURN_IF_ERROR(detail::check_view(l.shared_gate, {1, hidden}, "moe: shared gate"));
  }
  return Status::ok();
}

}  // namespace

Expected<MoeRoute> moe_route(CpuContext& ctx, const MoeLayer& layer, std::span<const float> x) {
  TESSERA_RETURN_IF_ERROR(detail::check_matrix(layer.router, "moe: router"));
  const int64_t E = layer.router.shape[0], H = layer.router.shape[1], K = layer.top_k;
  if (H <= 0 || x.size() % static_cast<size_t>(H) != 0) {
    return invalid_argument("moe: x has " + std::to_string(x.size()) +
                            " elements, not a multiple of hidden " + std::to_string(H));
  }
  if (K < 1 || K > E) {
    return invalid_argument("moe: top_k " + std::to_string(K) + " is not in [1, " +
                            std::to_string(E) + "]");
  }
  const int64_t T = static_cast<int64_t>(x.size()) / H;
  std::vector<float> logits(static_cast<size_t>(T * E));
  TESSERA_RETURN_IF_ERROR(linear(ctx, x, layer.router, nullptr, logits));
  MoeRoute r;
  r.expert.resize(static_cast<size_t>(T * K));
  r.weight.resize(static_cast<size_t>(T * K));
  std::vector<float> probs(static_cast<size_t>(E));
  std::vector<int32_t> order(static_cast<size_t>(E));
  for (int64_t t = 0; t < T; ++t) {
    // torch.softmax in fp32: exp(l - max) / Σ exp(l - max).
    const float* l = logits.data() + t * E;
    const float mx = *std::max_element(l, l + E);
    float sum = 0.0f;
    for (int64_t e = 0; e < E; ++e) sum += probs[e] = std::exp(l[e] - mx);
    for (int64_t e = 0; e < E; ++e) probs[e] /= sum;
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + K, order.end(), [&](int32_t a, int32_t b) {
      return probs[a] > probs[b] || (probs[a] == probs[b] && a < b);
    });
    float top = 0.0f;
    for (int64_t k = 0; k < K; ++k) top += probs[order[k]];
    for (int64_t k = 0; k < K; ++k) {
      r.expert[t * K + k] = order[k];
      r.weight[t * K + k] = layer.renormalize ? probs[order[k]] / top : probs[order[k]];
    }
  }
  return r;
}

Status moe_experts(CpuContext& ctx, const MoeLayer& layer, std::span<const float> x,
                   const MoeRoute& route, std::span<float> y) {
  TESSERA_RETURN_IF_ERROR(detail::check_matrix(layer.router, "moe: router"));
  const int64_t H = layer.router.shape[1], K = layer.top_k;
  TESSERA_RETURN_IF_ERROR(check_layer(layer, H));
  if (x.size() % static_cast<size_t>(H) != 0) {
    return invalid_argument("moe: x has " + std::to_string(x.size()) +
                            " elements, not a multiple of hidden " + std::to_string(H));
  }
  const int64_t T = static_cast<int64_t>(x.size()) / H;
  TESSERA_RETURN_IF_ERROR(
      detail::check_size(y.size(), T * H, "moe: y", "[tokens, " + std::to_string(H) + "]"));
  if (static_cast<int64_t>(route.expert.size()) != T * K ||
      static_cast<int64_t>(route.weight.size()) != T * K) {
    return invalid_argument("moe: a route of " + std::to_string(route.expert.size()) +
                            " slots for " + std::to_string(T) + " tokens of top_k " +
                            std::to_string(K));
  }
  const int64_t E = static_cast<int64_t>(layer.experts.size()), first = layer.expert_begin;
  // The (token, weight) pairs of each expert held here, in token order.
  std::vector<std::vector<std::pair<int64_t, float>>> chosen(static_cast<size_t>(E));
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t k = 0; k < K; ++k) {
      const int64_t e = route.expert[t * K + k] - first;
      if (e >= 0 && e < E) chosen[static_cast<size_t>(e)].push_back({t, route.weight[t * K + k]});
    }
  }
  std::fill(y.begin(), y.end(), 0.0f);
  std::vector<float> rows, out;
  for (int64_t e = 0; e < E; ++e) {
    const auto& tokens = chosen[static_cast<size_t>(e)];
    if (tokens.empty()) continue;
    rows.resize(tokens.size() * static_cast<size_t>(H));
    for (size_t i = 0; i < tokens.size(); ++i) {
      std::copy_n(x.begin() + tokens[i].first * H, H, rows.begin() + static_cast<int64_t>(i) * H);
    }
    TESSERA_RETURN_IF_ERROR(expert_mlp(ctx, layer.experts[static_cast<size_t>(e)], rows, out));
    for (size_t i = 0; i < tokens.size(); ++i) {
      float* dst = y.data() + tokens[i].first * H;
      const float* src = out.data() + static_cast<int64_t>(i) * H;
      const float w = tokens[i].second;
      for (int64_t h = 0; h < H; ++h) dst[h] += src[h] * w;
    }
  }
  return Status::ok();
}

Status moe_shared(CpuContext& ctx, const MoeLayer& layer, std::span<const float> x,
                  std::span<float> y) {
  if (layer.shared.gate.data == nullptr) return Status::ok();
  const int64_t H = layer.router.shape.at(1);
  const int64_t T = static_cast<int64_t>(x.size()) / H;
  TESSERA_RETURN_IF_ERROR(detail::check_size(y.size(), static_cast<int64_t>(x.size()), "moe: y",
                                             "[tokens, " + std::to_string(H) + "]"));
  std::vector<float> out;
  TESSERA_RETURN_IF_ERROR(expert_mlp(ctx, layer.shared, x, out));
  std::vector<float> gate(static_cast<size_t>(T));
  TESSERA_RETURN_IF_ERROR(linear(ctx, x, layer.shared_gate, nullptr, gate));
  for (int64_t t = 0; t < T; ++t) {
    const float g = 1.0f / (1.0f + std::exp(-gate[t]));  // torch.sigmoid
    for (int64_t h = 0; h < H; ++h) y[t * H + h] += g * out[t * H + h];
  }
  return Status::ok();
}

Status moe(CpuContext& ctx, const MoeLayer& layer, std::span<const float> x, std::span<float> y,
           std::vector<int64_t>* routed) {
  TESSERA_RETURN_IF_ERROR(detail::check_matrix(layer.router, "moe: router"));
  const int64_t H = layer.router.shape[1];
  TESSERA_RETURN_IF_ERROR(check_layer(layer, H));
  TESSERA_RETURN_IF_ERROR(detail::check_size(y.size(), static_cast<int64_t>(x.size()), "moe: y",
                                             "[tokens, " + std::to_string(H) + "]"));
  TESSERA_ASSIGN_OR_RETURN(MoeRoute route, moe_route(ctx, layer, x));
  if (routed != nullptr) {
    routed->resize(static_cast<size_t>(layer.router.shape[0]), 0);
    for (int32_t e : route.expert) ++(*routed)[static_cast<size_t>(e)];
  }
  TESSERA_RETURN_IF_ERROR(moe_experts(ctx, layer, x, route, y));
  return moe_shared(ctx, layer, x, y);
}

}  // namespace tessera::cpu
