// The MoE kernels (kernels/cuda/moe.h) against the CPU reference (kernels/cpu/moe.h) on random
// inputs: token counts 1, 7, 64, 300; top-k 1, 2, 4, 8; 8, 60 and 128 experts; uneven routing
// with an expert no token picks; with and without Qwen2-MoE's shared expert; both paths (GEMV
// and grouped GEMM), and both captured in a CUDA graph.
//
// Tolerances. Routing from the same fp32 logits: identical experts, weights within 1e-6
// relative (the GPU sums the softmax's exponentials in another order). The layer: the GPU rounds
// every intermediate (gate, up, silu, product, expert output, weighted rows, their sum) to bf16
// as transformers does, the CPU keeps fp32, so outputs differ by a few bf16 ulps of the row's
// magnitude: max |diff| <= 3e-2 x max |ref| and mean |diff| <= 4e-3 x max |ref|. A token whose
// router logits, rounded to bf16 on the GPU (the gate Linear's bf16 output, as transformers)
// and fp32 on the CPU, pick different experts is left out of the comparison; it must be a
// near-tie (the logits within bf16 rounding), and at least 80% of tokens must agree.
#include "kernels/cuda/moe.h"

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <set>
#include <string>
#include <vector>

#include "common/status.h"
#include "common/tensor.h"
#include "kernels/cpu/cpu_context.h"
#include "kernels/cpu/moe.h"
#include "kernels/cuda/cuda_util.h"
#include "kernels/cuda/elementwise.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/gemv.h"

namespace tessera::cuda {
namespace {

bool has_cuda_device() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

#define REQUIRE_CUDA_DEVICE() \
  if (!has_cuda_device()) FAIL() << "no CUDA device: these tests run only on a GPU machine"

struct Uniform {
  uint64_t state;
  float operator()() {  // [-1, 1)
    uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return static_cast<float>(z >> 40) * (2.0f / 16777216.0f) - 1.0f;
  }
};

float round_bf16(float f) { return bf16_to_float(float_to_bf16(f)); }

// A bf16 tensor on the device and its values as fp32 on the host.
struct Tensor {
  std::vector<float> values;
  DeviceBuffer dev;
};

Tensor upload_bf16(std::vector<float> values) {
  Tensor t;
  std::vector<uint16_t> bits(values.size());
  for (size_t i = 0; i < values.size(); ++i) {
    bits[i] = float_to_bf16(values[i]);
    values[i] = bf16_to_float(bits[i]);
  }
  t.values = std::move(values);
  auto buf = DeviceBuffer::allocate(std::max<size_t>(bits.size() * 2, 256), "test tensor");
  EXPECT_TRUE(buf.has_value());
  if (!buf) return t;
  t.dev = std::move(buf).value();
  EXPECT_EQ(cudaMemcpy(t.dev.get(), bits.data(), bits.size() * 2, cudaMemcpyHostToDevice),
            cudaSuccess);
  return t;
}

std::vector<float> random_values(size_t n, uint64_t seed, float scale, float offset = 0.0f) {
  Uniform u{seed};
  std::vector<float> v(n);
  for (float& x : v) x = offset + scale * u();
  return v;
}

template <typename T>
DeviceBuffer device_copy(const std::vector<T>& host) {
  auto buf = DeviceBuffer::allocate(std::max<size_t>(host.size() * sizeof(T), 256), "test");
  EXPECT_TRUE(buf.has_value());
  if (!buf) return {};
  EXPECT_EQ(cudaMemcpy(buf->get(), host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice),
            cudaSuccess);
  return std::move(buf).value();
}

template <typename T>
std::vector<T> host_copy(const void* dev, size_t n) {
  std::vector<T> out(n);
  EXPECT_EQ(cudaMemcpy(out.data(), dev, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
  return out;
}

std::vector<float> host_bf16(const void* dev, size_t n) {
  std::vector<uint16_t> bits = host_copy<uint16_t>(dev, n);
  std::vector<float> out(n);
  for (size_t i = 0; i < n; ++i) out[i] = bf16_to_float(bits[i]);
  return out;
}

// ---- routing ----

struct RouteCase {
  int64_t tokens, experts, top_k;
  bool renormalize;
};

TEST(MoeRouteTest, MatchesTheCpuRouterOnTheSameLogits) {
  REQUIRE_CUDA_DEVICE();
  cpu::CpuContext ctx(1);
  const RouteCase cases[] = {{1, 8, 2, true},     {7, 8, 1, true},      {64, 60, 4, false},
                             {300, 128, 8, true}, {300, 128, 8, false}, {64, 8, 8, true}};
  for (const RouteCase& c : cases) {
    SCOPED_TRACE("tokens " + std::to_string(c.tokens) + ", experts " + std::to_string(c.experts) +
                 ", top_k " + std::to_string(c.top_k));
    std::vector<float> logits = random_values(c.tokens * c.experts, 11 + c.tokens, 4.0f);
    // Ties: token 0 has every logit equal (lowest indices first), the last one pairs of equal
    // logits.
    std::fill_n(logits.begin(), c.experts, 0.5f);
    for (int64_t e = 1; e < c.experts; e += 2) {
      logits[(c.tokens - 1) * c.experts + e] = logits[(c.tokens - 1) * c.experts + e - 1];
    }
    // The CPU router computes x · routerᵀ: with an identity router its logits are x exactly.
    std::vector<float> identity(c.experts * c.experts, 0.0f);
    for (int64_t e = 0; e < c.experts; ++e) identity[e * c.experts + e] = 1.0f;
    cpu::MoeLayer layer;
    layer.router = TensorView{identity.data(), DType::kF32, {c.experts, c.experts}};
    layer.top_k = c.top_k;
    layer.renormalize = c.renormalize;
    layer.experts.resize(static_cast<size_t>(c.experts));
    DeviceBuffer d_logits = device_copy(logits);
    // kBF16: the GPU rounds the logits to bf16 first (the gate Linear's bf16 output), which
    // makes many exact ties at this scale: the CPU is given the rounded logits.
    for (DType dt : {DType::kF32, DType::kBF16}) {
      SCOPED_TRACE(dtype_name(dt));
      std::vector<float> cpu_logits = logits;
      if (dt == DType::kBF16) {
        for (float& v : cpu_logits) v = round_bf16(v);
      }
      auto ref = cpu::moe_route(ctx, layer, cpu_logits);
      ASSERT_TRUE(ref) << ref.status().to_string();
      auto d_ids = DeviceBuffer::allocate(c.tokens * c.top_k * 4, "ids");
      auto d_w = DeviceBuffer::allocate(c.tokens * c.top_k * 4, "weights");
      ASSERT_TRUE(d_ids && d_w);
      Status st = moe_route(d_logits.as<float>(), dt, c.tokens, c.experts, c.top_k, c.renormalize,
                            d_ids->as<int32_t>(), d_w->as<float>(), nullptr);
      ASSERT_TRUE(st.is_ok()) << st.to_string();
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      const auto ids = host_copy<int32_t>(d_ids->get(), c.tokens * c.top_k);
      const auto w = host_copy<float>(d_w->get(), c.tokens * c.top_k);
      for (int64_t i = 0; i < c.tokens * c.top_k; ++i) {
        ASSERT_EQ(ids[i], ref->expert[i]) << "slot " << i;
        EXPECT_NEAR(w[i], ref->weight[i], 1e-6f * std::max(1.0f, ref->weight[i])) << "slot " << i;
      }
    }
  }
}

TEST(MoeRouteTest, RefusesBadShapes) {
  EXPECT_FALSE(moe_route(nullptr, DType::kF32, 1, 8, 9, true, nullptr, nullptr, nullptr).is_ok());
  EXPECT_FALSE(moe_route(nullptr, DType::kF32, 1, 8, 0, true, nullptr, nullptr, nullptr).is_ok());
  EXPECT_FALSE(
      moe_route(nullptr, DType::kF32, 1, 5000, 2, true, nullptr, nullptr, nullptr).is_ok());
}

// ---- permutation ----

TEST(MoePermuteTest, SortsPairsByExpertWithCountsOffsetsAndTiles) {
  REQUIRE_CUDA_DEVICE();
  struct Case {
    int64_t tokens, top_k, experts, expert_begin, local;
  };
  // Uneven: expert 0 takes most pairs (several 64-row tiles), the last expert none; and an
  // expert-parallel rank holding experts [2, 5).
  for (const Case c : {Case{300, 2, 8, 0, 8}, Case{1, 8, 128, 0, 128}, Case{64, 4, 60, 0, 60},
                       Case{300, 2, 8, 2, 3}}) {
    SCOPED_TRACE("tokens " + std::to_string(c.tokens) + ", top_k " + std::to_string(c.top_k));
    const int64_t P = c.tokens * c.top_k;
    std::vector<int32_t> ids(P);
    Uniform u{7};
    for (int64_t t = 0; t < c.tokens; ++t) {
      std::set<int32_t> used;
      for (int64_t k = 0; k < c.top_k; ++k) {
        int32_t e;
        do {
          const float r = 0.5f * (u() + 1.0f);
          e = k == 0 && r < 0.8f ? 0 : static_cast<int32_t>(r * (c.experts - 1)) % (c.experts - 1);
        } while (used.count(e) != 0);
        used.insert(e);
        ids[t * c.top_k + k] = e;
      }
    }
    DeviceBuffer d_ids = device_copy(ids);
    auto off = DeviceBuffer::allocate((c.local + 1) * 4, "offsets");
    auto tiles = DeviceBuffer::allocate((c.local + 1) * 4, "tiles");
    auto rows = DeviceBuffer::allocate(P * 4, "rows");
    auto pos = DeviceBuffer::allocate(P * 4, "pos");
    ASSERT_TRUE(off && tiles && rows && pos);
    MoePermutation perm{off->as<int32_t>(), tiles->as<int32_t>(), rows->as<int32_t>(),
                        pos->as<int32_t>()};
    Status st =
        moe_permute(d_ids.as<int32_t>(), c.tokens, c.top_k, c.expert_begin, c.local, perm, nullptr);
    ASSERT_TRUE(st.is_ok()) << st.to_string();
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const auto h_off = host_copy<int32_t>(off->get(), c.local + 1);
    const auto h_tiles = host_copy<int32_t>(tiles->get(), c.local + 1);
    const auto h_rows = host_copy<int32_t>(rows->get(), P);
    const auto h_pos = host_copy<int32_t>(pos->get(), P);
    std::vector<int32_t> count(c.local, 0);
    for (int32_t e : ids) {
      if (e >= c.expert_begin && e < c.expert_begin + c.local) ++count[e - c.expert_begin];
    }
    int32_t at = 0, tile = 0;
    for (int64_t e = 0; e < c.local; ++e) {
      EXPECT_EQ(h_off[e], at) << "expert " << e;
      EXPECT_EQ(h_tiles[e], tile) << "expert " << e;
      at += count[e];
      tile += (count[e] + 63) / 64;
    }
    EXPECT_EQ(h_off[c.local], at);
    EXPECT_EQ(h_tiles[c.local], tile);
    if (c.local == 8) {
      EXPECT_EQ(count[7], 0) << "the last expert should have no token";
    }
    std::vector<int> seen(at, 0);
    for (int64_t i = 0; i < P; ++i) {
      const int64_t e = ids[i] - c.expert_begin;
      if (e < 0 || e >= c.local) {
        EXPECT_EQ(h_pos[i], -1) << "pair " << i;
        continue;
      }
      const int32_t p = h_pos[i];
      ASSERT_GE(p, h_off[e]);
      ASSERT_LT(p, h_off[e + 1]);
      EXPECT_EQ(h_rows[p], i / c.top_k);
      ++seen[p];
    }
    for (int32_t p = 0; p < at; ++p) EXPECT_EQ(seen[p], 1) << "sorted row " << p;
  }
}

// ---- the whole layer ----

struct LayerCase {
  const char* name;
  int64_t tokens, experts, top_k, hidden, inter, shared_inter;
  bool renormalize;
  bool skewed;  // x > 0, expert 0 always chosen, the last expert never
};

struct Layer {
  LayerCase c;
  Tensor x, router, gate_up, down, sh_gate_up, sh_down, sh_gate;
  std::vector<std::vector<float>> gate, up, down_e;  // per expert, host fp32 (bf16 values)
};

Layer make_layer(const LayerCase& c) {
  Layer l;
  l.c = c;
  const int64_t H = c.hidden, I = c.inter, E = c.experts, Is = c.shared_inter;
  const float xs = 1.0f, ws = 1.0f / std::sqrt(static_cast<float>(H));
  l.x = upload_bf16(c.skewed ? random_values(c.tokens * H, 1, 0.45f, 0.55f)
                             : random_values(c.tokens * H, 1, xs));
  std::vector<float> router = random_values(E * H, 2, 2.0f * ws);
  if (c.skewed) {
    for (int64_t h = 0; h < H; ++h) {
      router[h] = 0.5f;                 // expert 0: a large positive logit for every x > 0
      router[(E - 1) * H + h] = -0.5f;  // the last expert: a large negative one
    }
  }
  l.router = upload_bf16(router);
  std::vector<float> gu = random_values(E * 2 * I * H, 3, ws);
  std::vector<float> dn = random_values(E * H * I, 4, 1.0f / std::sqrt(static_cast<float>(I)));
  l.gate_up = upload_bf16(gu);
  l.down = upload_bf16(dn);
  for (int64_t e = 0; e < E; ++e) {
    const float* g = l.gate_up.values.data() + e * 2 * I * H;
    l.gate.emplace_back(g, g + I * H);
    l.up.emplace_back(g + I * H, g + 2 * I * H);
    const float* d = l.down.values.data() + e * H * I;
    l.down_e.emplace_back(d, d + H * I);
  }
  if (Is > 0) {
    l.sh_gate_up = upload_bf16(random_values(2 * Is * H, 5, ws));
    l.sh_down = upload_bf16(random_values(H * Is, 6, 1.0f / std::sqrt(static_cast<float>(Is))));
    l.sh_gate = upload_bf16(random_values(H, 7, ws));
  }
  return l;
}

cpu::MoeLayer cpu_layer(const Layer& l) {
  const int64_t H = l.c.hidden, I = l.c.inter, Is = l.c.shared_inter;
  cpu::MoeLayer m;
  m.router = TensorView{l.router.values.data(), DType::kF32, {l.c.experts, H}};
  for (int64_t e = 0; e < l.c.experts; ++e) {
    m.experts.push_back({TensorView{l.gate[e].data(), DType::kF32, {I, H}},
                         TensorView{l.up[e].data(), DType::kF32, {I, H}},
                         TensorView{l.down_e[e].data(), DType::kF32, {H, I}}});
  }
  m.top_k = l.c.top_k;
  m.renormalize = l.c.renormalize;
  if (Is > 0) {
    const float* g = l.sh_gate_up.values.data();
    m.shared = {TensorView{g, DType::kF32, {Is, H}}, TensorView{g + Is * H, DType::kF32, {Is, H}},
                TensorView{l.sh_down.values.data(), DType::kF32, {H, Is}}};
    m.shared_gate = TensorView{l.sh_gate.values.data(), DType::kF32, {1, H}};
  }
  return m;
}

MoeArgs gpu_args(const Layer& l, MoePath path, const DeviceBuffer& ws, const DeviceBuffer& out) {
  MoeArgs a;
  a.dtype = DType::kBF16;
  a.tokens = l.c.tokens;
  a.num_experts = l.c.experts;
  a.top_k = l.c.top_k;
  a.renormalize = l.c.renormalize;
  a.path = path;
  a.x = l.x.dev.get();
  a.router = l.router.dev.get();
  a.experts.gate_up = l.gate_up.dev.get();
  a.experts.down = l.down.dev.get();
  a.experts.local_experts = l.c.experts;
  a.experts.hidden = l.c.hidden;
  a.experts.inter = l.c.inter;
  if (l.c.shared_inter > 0) {
    a.shared_gate_up = l.sh_gate_up.dev.get();
    a.shared_down = l.sh_down.dev.get();
    a.shared_expert_gate = l.sh_gate.dev.get();
    a.shared_inter = l.c.shared_inter;
  }
  a.workspace = ws.get();
  a.workspace_bytes = ws.bytes();
  a.out = out.get();
  return a;
}

// Tokens whose GPU route (cuBLAS logits) differs from the CPU's: a near-tie, left out.
std::vector<bool> route_agrees(const Layer& l, Gemm& gemm, const cpu::MoeRoute& ref) {
  const int64_t T = l.c.tokens, E = l.c.experts, K = l.c.top_k;
  auto logits = DeviceBuffer::allocate(T * E * 4, "logits");
  auto ids = DeviceBuffer::allocate(T * K * 4, "ids");
  auto w = DeviceBuffer::allocate(T * K * 4, "w");
  std::vector<bool> agree(T, false);
  if (!logits || !ids || !w) return agree;
  EXPECT_TRUE(gemm.linear(GemmShape{T, E, l.c.hidden, DType::kBF16, DType::kF32, false},
                          l.x.dev.get(), l.router.dev.get(), nullptr, logits->get(), nullptr)
                  .is_ok());
  EXPECT_TRUE(moe_route(logits->as<float>(), DType::kBF16, T, E, K, l.c.renormalize,
                        ids->as<int32_t>(), w->as<float>(), nullptr)
                  .is_ok());
  const auto h = host_copy<int32_t>(ids->get(), T * K);
  const int64_t H = l.c.hidden;
  for (int64_t t = 0; t < T; ++t) {
    agree[t] = std::equal(h.begin() + t * K, h.begin() + (t + 1) * K, ref.expert.begin() + t * K);
    if (agree[t]) continue;
    // A difference must be a near-tie: each expert only the GPU chose has an fp32 logit within
    // bf16 rounding (of the logit, and of the activations feeding it) of the CPU's k-th.
    std::vector<float> logit(E);
    for (int64_t e = 0; e < E; ++e) {
      double s = 0;
      for (int64_t i = 0; i < H; ++i) s += l.x.values[t * H + i] * l.router.values[e * H + i];
      logit[e] = static_cast<float>(s);
    }
    float kth = INFINITY;
    for (int64_t k = 0; k < K; ++k) kth = std::min(kth, logit[ref.expert[t * K + k]]);
    for (int64_t k = 0; k < K; ++k) {
      const int32_t e = h[t * K + k];
      if (std::find(ref.expert.begin() + t * K, ref.expert.begin() + (t + 1) * K, e) !=
          ref.expert.begin() + (t + 1) * K) {
        continue;
      }
      EXPECT_LE(std::fabs(logit[e] - kth), 0.01f + std::fabs(kth) / 128)
          << "token " << t << ": the GPU chose expert " << e << " (logit " << logit[e]
          << "), not a near-tie with the CPU's k-th logit " << kth;
    }
  }
  return agree;
}

// moe_count_experts adds each real row's routings to its local experts: a row marked -1 (a
// decode graph's padding) and experts outside the range are not counted; counts accumulate.
TEST(MoeCountTest, CountsTheLocalRoutingsOfRealRows) {
  REQUIRE_CUDA_DEVICE();
  const int64_t tokens = 300, top_k = 3, experts = 10, begin = 2, local = 5;
  std::vector<int32_t> ids(tokens * top_k);
  std::vector<int64_t> rows(tokens);
  for (int64_t t = 0; t < tokens; ++t) {
    rows[t] = t % 7 == 3 ? -1 : t * 16;
    for (int64_t k = 0; k < top_k; ++k)
      ids[t * top_k + k] = static_cast<int32_t>((t * 5 + k * 3) % experts);
  }
  std::vector<unsigned long long> want(experts, 0);
  for (int64_t t = 0; t < tokens; ++t) {
    if (rows[t] < 0) continue;
    for (int64_t k = 0; k < top_k; ++k) {
      const int32_t e = ids[t * top_k + k];
      if (e >= begin && e < begin + local) want[e] += 2;  // counted twice below
    }
  }
  auto d_ids = DeviceBuffer::allocate(ids.size() * 4, "ids");
  auto d_rows = DeviceBuffer::allocate(rows.size() * 8, "rows");
  auto d_counts = DeviceBuffer::allocate(experts * 8, "counts");
  ASSERT_TRUE(d_ids && d_rows && d_counts);
  ASSERT_EQ(cudaMemcpy(d_ids->get(), ids.data(), ids.size() * 4, cudaMemcpyHostToDevice),
            cudaSuccess);
  ASSERT_EQ(cudaMemcpy(d_rows->get(), rows.data(), rows.size() * 8, cudaMemcpyHostToDevice),
            cudaSuccess);
  ASSERT_EQ(cudaMemset(d_counts->get(), 0, experts * 8), cudaSuccess);
  auto* counts = static_cast<unsigned long long*>(d_counts->get());
  const MoeCount count{counts, static_cast<const int64_t*>(d_rows->get()), begin, local};
  for (int i = 0; i < 2; ++i) {
    ASSERT_TRUE(
        moe_count_experts(static_cast<const int32_t*>(d_ids->get()), tokens, top_k, count, nullptr)
            .is_ok());
  }
  std::vector<unsigned long long> got(experts);
  ASSERT_EQ(cudaMemcpy(got.data(), counts, experts * 8, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(got, want);
  EXPECT_FALSE(moe_count_experts(nullptr, 1, 2, MoeCount{nullptr, nullptr, 0, 4}, nullptr).is_ok());
  EXPECT_FALSE(moe_count_experts(nullptr, 1, 2, MoeCount{counts, nullptr, -1, 4}, nullptr).is_ok());
}

// moe_route with a MoeCount counts what moe_count_experts counts on the ids it writes (the MoE
// layer's routing kernel does both in one launch): live rows only, local experts only.
TEST(MoeCountTest, TheRoutingKernelCountsAsCountExperts) {
  REQUIRE_CUDA_DEVICE();
  for (const int64_t experts : {int64_t{10}, int64_t{128}, int64_t{300}}) {
    const int64_t tokens = 257, top_k = 4, begin = experts / 5, local = experts / 2;
    const std::vector<float> logits = random_values(tokens * experts, 31 + experts, 3.0f);
    std::vector<int64_t> rows(tokens);
    for (int64_t t = 0; t < tokens; ++t) rows[t] = t % 5 == 1 ? -1 : t;
    auto d_logits = DeviceBuffer::allocate(logits.size() * 4, "logits");
    auto d_rows = DeviceBuffer::allocate(rows.size() * 8, "rows");
    auto d_ids = DeviceBuffer::allocate(tokens * top_k * 4, "ids");
    auto d_w = DeviceBuffer::allocate(tokens * top_k * 4, "weights");
    auto d_fused = DeviceBuffer::allocate(experts * 8, "counts");
    auto d_alone = DeviceBuffer::allocate(experts * 8, "counts");
    ASSERT_TRUE(d_logits && d_rows && d_ids && d_w && d_fused && d_alone);
    ASSERT_EQ(cudaMemcpy(d_logits->get(), logits.data(), logits.size() * 4, cudaMemcpyHostToDevice),
              cudaSuccess);
    ASSERT_EQ(cudaMemcpy(d_rows->get(), rows.data(), rows.size() * 8, cudaMemcpyHostToDevice),
              cudaSuccess);
    ASSERT_EQ(cudaMemset(d_fused->get(), 0, experts * 8), cudaSuccess);
    ASSERT_EQ(cudaMemset(d_alone->get(), 0, experts * 8), cudaSuccess);
    const auto* r = static_cast<const int64_t*>(d_rows->get());
    auto* ids = static_cast<int32_t*>(d_ids->get());
    const MoeCount fused{static_cast<unsigned long long*>(d_fused->get()), r, begin, local};
    const MoeCount alone{static_cast<unsigned long long*>(d_alone->get()), r, begin, local};
    ASSERT_TRUE(moe_route(d_logits->as<float>(), DType::kBF16, tokens, experts, top_k, true, ids,
                          d_w->as<float>(), nullptr, fused)
                    .is_ok());
    ASSERT_TRUE(moe_count_experts(ids, tokens, top_k, alone, nullptr).is_ok());
    std::vector<int32_t> h_ids(tokens * top_k);
    std::vector<unsigned long long> got(experts), want(experts, 0), by_kernel(experts);
    ASSERT_EQ(cudaMemcpy(h_ids.data(), ids, h_ids.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(got.data(), d_fused->get(), experts * 8, cudaMemcpyDeviceToHost),
              cudaSuccess);
    ASSERT_EQ(cudaMemcpy(by_kernel.data(), d_alone->get(), experts * 8, cudaMemcpyDeviceToHost),
              cudaSuccess);
    for (int64_t t = 0; t < tokens; ++t) {
      if (rows[t] < 0) continue;
      for (int64_t k = 0; k < top_k; ++k) {
        const int32_t e = h_ids[t * top_k + k];
        if (e >= begin && e < begin + local) ++want[e];
      }
    }
    EXPECT_EQ(got, want) << experts << " experts";
    EXPECT_EQ(by_kernel, want) << experts << " experts";
    EXPECT_GT(std::accumulate(want.begin(), want.end(), 0ull), 0ull);
  }
}

class MoeLayerTest : public ::testing::TestWithParam<LayerCase> {};

TEST_P(MoeLayerTest, BothPathsTrackTheCpuReference) {
  REQUIRE_CUDA_DEVICE();
  const LayerCase& c = GetParam();
  const Layer l = make_layer(c);
  cpu::CpuContext ctx(2);
  const cpu::MoeLayer ref_layer = cpu_layer(l);
  std::vector<float> ref(c.tokens * c.hidden);
  ASSERT_TRUE(cpu::moe(ctx, ref_layer, l.x.values, ref).is_ok());
  auto route = cpu::moe_route(ctx, ref_layer, l.x.values);
  ASSERT_TRUE(route);
  if (c.skewed) {
    for (int64_t t = 0; t < c.tokens; ++t) {
      EXPECT_EQ(route->expert[t * c.top_k], 0);
      for (int64_t k = 0; k < c.top_k; ++k)
        EXPECT_NE(route->expert[t * c.top_k + k], c.experts - 1);
    }
  }
  auto gemm = Gemm::create();
  ASSERT_TRUE(gemm);
  const std::vector<bool> agree = route_agrees(l, **gemm, *route);
  const int64_t agreeing = std::count(agree.begin(), agree.end(), true);
  // route_agrees asserts that every token routed differently is a near-tie (the GPU's expert
  // within bf16 rounding of the CPU's k-th logit): that is the check. With 128 experts, 7 tokens
  // and bf16 logits, two near-ties among 7 happen (seen on the H200); a count bound would only
  // measure luck. At least half must agree, so the output comparison below is not vacuous.
  EXPECT_GE(agreeing, (c.tokens + 1) / 2) << "near-ties";
  float max_ref = 0.0f;
  for (float v : ref) max_ref = std::max(max_ref, std::fabs(v));
  ASSERT_GT(max_ref, 0.0f);
  const uint64_t ws_bytes = moe_workspace_bytes(DType::kBF16, c.tokens, c.experts, c.top_k,
                                                c.experts, c.hidden, c.inter, c.shared_inter);
  auto ws = DeviceBuffer::allocate(ws_bytes, "workspace");
  auto out = DeviceBuffer::allocate(c.tokens * c.hidden * 2, "out");
  ASSERT_TRUE(ws && out);
  for (MoePath path : {MoePath::kGemv, MoePath::kGrouped}) {
    const char* name = path == MoePath::kGemv ? "gemv" : "grouped";
    SCOPED_TRACE(name);
    ASSERT_EQ(cudaMemset(out->get(), 0xff, out->bytes()), cudaSuccess);  // NaNs if unwritten
    Status st = moe_forward(gpu_args(l, path, *ws, *out), **gemm, nullptr);
    ASSERT_TRUE(st.is_ok()) << st.to_string();
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const std::vector<float> got = host_bf16(out->get(), c.tokens * c.hidden);
    double max_diff = 0, sum_diff = 0;
    int64_t n = 0;
    for (int64_t t = 0; t < c.tokens; ++t) {
      if (!agree[t]) continue;
      for (int64_t h = 0; h < c.hidden; ++h) {
        const double d = std::fabs(got[t * c.hidden + h] - ref[t * c.hidden + h]);
        ASSERT_TRUE(std::isfinite(got[t * c.hidden + h])) << "token " << t << " h " << h;
        max_diff = std::max(max_diff, d);
        sum_diff += d;
        ++n;
      }
    }
    std::printf("[moe] %s %s: max |diff| %.3e, mean %.3e (max |ref| %.3f), %lld/%lld tokens\n",
                c.name, name, max_diff, sum_diff / std::max<int64_t>(n, 1), max_ref,
                static_cast<long long>(agreeing), static_cast<long long>(c.tokens));
    EXPECT_LE(max_diff, 3e-2 * max_ref);
    EXPECT_LE(sum_diff / std::max<int64_t>(n, 1), 4e-3 * max_ref);
  }
}

// Both paths, captured in a CUDA graph and replayed on new inputs, give the eager bits: no host
// synchronisation and no host-side dependence on the routing.
TEST_P(MoeLayerTest, CapturedInACudaGraphGivesTheEagerBits) {
  REQUIRE_CUDA_DEVICE();
  const LayerCase& c = GetParam();
  Layer l = make_layer(c);
  auto gemm = Gemm::create();
  ASSERT_TRUE(gemm);
  auto ws =
      DeviceBuffer::allocate(moe_workspace_bytes(DType::kBF16, c.tokens, c.experts, c.top_k,
                                                 c.experts, c.hidden, c.inter, c.shared_inter),
                             "workspace");
  auto out = DeviceBuffer::allocate(c.tokens * c.hidden * 2, "out");
  ASSERT_TRUE(ws && out);
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  for (MoePath path : {MoePath::kGemv, MoePath::kGrouped}) {
    SCOPED_TRACE(path == MoePath::kGemv ? "gemv" : "grouped");
    const MoeArgs a = gpu_args(l, path, *ws, *out);
    // Eager once (the GEMMs choose their algorithms), then capture.
    ASSERT_TRUE(moe_forward(a, **gemm, stream).is_ok());
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
    Status st = moe_forward(a, **gemm, stream);
    ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
    ASSERT_TRUE(st.is_ok()) << st.to_string();
    ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
    // New inputs (so new routes) in place, then the graph against eager.
    std::vector<float> x2 = random_values(c.tokens * c.hidden, 99, 1.0f);
    Tensor t2 = upload_bf16(x2);
    ASSERT_EQ(
        cudaMemcpy(l.x.dev.get(), t2.dev.get(), c.tokens * c.hidden * 2, cudaMemcpyDeviceToDevice),
        cudaSuccess);
    ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    const auto graph_out = host_copy<uint16_t>(out->get(), c.tokens * c.hidden);
    ASSERT_TRUE(moe_forward(a, **gemm, stream).is_ok());
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    const auto eager_out = host_copy<uint16_t>(out->get(), c.tokens * c.hidden);
    EXPECT_EQ(graph_out, eager_out);
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    l = make_layer(c);  // the original inputs for the next path
  }
  cudaStreamDestroy(stream);
}

// MoeArgs::norm (batch-1 decode): the layer's residual add and RMSNorm run in the router's GEMV.
// out, the residual and x (the normed row) have the bits of add_rms_norm then moe_forward.
TEST(MoeNormTest, TheNormInTheRouterGivesAddRmsNormsBits) {
  REQUIRE_CUDA_DEVICE();
  auto gemm = Gemm::create();
  ASSERT_TRUE(gemm);
  auto arrivals = DeviceBuffer::allocate(4, "arrivals");
  ASSERT_TRUE(arrivals);
  ASSERT_EQ(cudaMemset(arrivals->get(), 0, 4), cudaSuccess);
  for (const LayerCase& c :
       {LayerCase{"t1_e8_k2", 1, 8, 2, 64, 48, 0, true, false},
        LayerCase{"t1_e8_k4_qwen3_widths", 1, 8, 4, 2048, 768, 0, true, false}}) {
    SCOPED_TRACE(c.name);
    const Layer l = make_layer(c);
    const int64_t H = c.hidden;
    const Tensor proj = upload_bf16(random_values(H, 71, 1.0f));
    const Tensor residual = upload_bf16(random_values(H, 72, 1.0f));
    const Tensor norm_w = upload_bf16(random_values(H, 73, 0.5f, 1.0f));
    auto ws = DeviceBuffer::allocate(
        moe_workspace_bytes(DType::kBF16, 1, c.experts, c.top_k, c.experts, H, c.inter, 0), "ws");
    ASSERT_TRUE(ws);
    struct Run {
      std::vector<uint16_t> out, residual, x;
    };
    const auto run = [&](bool fused) {
      Run r;
      auto res = DeviceBuffer::allocate(H * 2, "residual");
      auto x = DeviceBuffer::allocate(H * 2, "x");
      auto out = DeviceBuffer::allocate(H * 2, "out");
      EXPECT_TRUE(res && x && out);
      if (!(res && x && out)) return r;
      EXPECT_EQ(cudaMemcpy(res->get(), residual.dev.get(), H * 2, cudaMemcpyDeviceToDevice),
                cudaSuccess);
      EXPECT_EQ(cudaMemset(x->get(), 0xff, H * 2), cudaSuccess);
      EXPECT_EQ(cudaMemset(out->get(), 0xff, H * 2), cudaSuccess);
      MoeArgs a = gpu_args(l, MoePath::kAuto, *ws, *out);
      a.x = x->get();
      const GemvAddRmsNorm norm{proj.dev.get(), res->get(), norm_w.dev.get(),
                                1e-6f,          x->get(),   arrivals->as<int32_t>()};
      if (fused) {
        a.norm = &norm;
      } else {
        EXPECT_TRUE(add_rms_norm(DType::kBF16, proj.dev.get(), res->get(), norm_w.dev.get(), 1, H,
                                 1e-6f, x->get(), nullptr)
                        .is_ok());
      }
      const Status st = moe_forward(a, **gemm, nullptr);
      EXPECT_TRUE(st.is_ok()) << st.to_string();
      EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      r.out = host_copy<uint16_t>(out->get(), H);
      r.residual = host_copy<uint16_t>(res->get(), H);
      r.x = host_copy<uint16_t>(x->get(), H);
      return r;
    };
    const Run want = run(false), got = run(true);
    EXPECT_EQ(got.residual, want.residual);
    EXPECT_EQ(got.x, want.x);
    EXPECT_EQ(got.out, want.out);
    EXPECT_EQ(host_copy<int32_t>(arrivals->get(), 1), std::vector<int32_t>{0});
  }
}

// Every tile of the GEMV path's kernels (moe.h's MoeGemvTiles) gives the default tiles' bits:
// a lane sums the same elements in the same order whatever the outputs per warp and the pieces
// in flight. On the layer's own routing (router GEMM and moe_route), without a shared expert.
TEST_P(MoeLayerTest, EveryGemvTileGivesTheDefaultBits) {
  REQUIRE_CUDA_DEVICE();
  const LayerCase& c = GetParam();
  const Layer l = make_layer(c);
  const int64_t T = c.tokens, E = c.experts, K = c.top_k, H = c.hidden, I = c.inter;
  auto gemm = Gemm::create();
  ASSERT_TRUE(gemm);
  auto logits = DeviceBuffer::allocate(T * E * 4, "logits");
  auto ids = DeviceBuffer::allocate(T * K * 4, "ids");
  auto weights = DeviceBuffer::allocate(T * K * 4, "weights");
  auto act = DeviceBuffer::allocate(T * K * I * 2, "act");
  auto out = DeviceBuffer::allocate(T * H * 2, "out");
  ASSERT_TRUE(logits && ids && weights && act && out);
  ASSERT_TRUE((*gemm)
                  ->linear(GemmShape{T, E, H, DType::kBF16, DType::kF32, false}, l.x.dev.get(),
                           l.router.dev.get(), nullptr, logits->get(), nullptr)
                  .is_ok());
  ASSERT_TRUE(moe_route(logits->as<float>(), DType::kBF16, T, E, K, c.renormalize,
                        ids->as<int32_t>(), weights->as<float>(), nullptr)
                  .is_ok());
  MoeExperts w;
  w.gate_up = l.gate_up.dev.get();
  w.down = l.down.dev.get();
  w.local_experts = E;
  w.hidden = H;
  w.inter = I;
  const auto run = [&](const MoeGemvTiles& t) {
    EXPECT_EQ(cudaMemset(act->get(), 0xff, act->bytes()), cudaSuccess);
    EXPECT_EQ(cudaMemset(out->get(), 0xff, out->bytes()), cudaSuccess);
    Status st = moe_gemv_gate_up(DType::kBF16, l.x.dev.get(), ids->as<int32_t>(), T, K, w,
                                 act->get(), nullptr, t);
    EXPECT_TRUE(st.is_ok()) << st.to_string();
    st = moe_gemv_down_combine(DType::kBF16, act->get(), ids->as<int32_t>(), weights->as<float>(),
                               T, K, w, nullptr, nullptr, nullptr, out->get(), nullptr, t);
    EXPECT_TRUE(st.is_ok()) << st.to_string();
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    return std::pair{host_copy<uint16_t>(act->get(), T * K * I),
                     host_copy<uint16_t>(out->get(), T * H)};
  };
  const auto [want_act, want_out] = run(MoeGemvTiles{});
  for (const auto& [outs, unroll] : {std::pair{2, 2}, {2, 4}, {1, 4}, {1, 8}}) {
    SCOPED_TRACE("gate_up " + std::to_string(outs) + "x" + std::to_string(unroll));
    MoeGemvTiles t;
    t.gate_up_outs = outs;
    t.gate_up_unroll = unroll;
    const auto [got_act, got_out] = run(t);
    EXPECT_EQ(got_act, want_act);
    EXPECT_EQ(got_out, want_out);
  }
  for (const auto& [rows, unroll] : {std::pair{8, 1}, {8, 3}, {4, 1}, {4, 3}}) {
    SCOPED_TRACE("down " + std::to_string(rows) + "x" + std::to_string(unroll));
    MoeGemvTiles t;
    t.down_rows = rows;
    t.down_unroll = unroll;
    const auto [got_act, got_out] = run(t);
    EXPECT_EQ(got_out, want_out);
  }
  MoeGemvTiles bad;
  bad.down_rows = 5;
  EXPECT_FALSE(moe_gemv_down_combine(DType::kBF16, act->get(), ids->as<int32_t>(),
                                     weights->as<float>(), T, K, w, nullptr, nullptr, nullptr,
                                     out->get(), nullptr, bad)
                   .is_ok());
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, MoeLayerTest,
    ::testing::Values(LayerCase{"t1_e8_k2", 1, 8, 2, 64, 48, 0, true, false},
                      LayerCase{"t7_e8_k1_shared", 7, 8, 1, 200, 48, 96, false, false},
                      LayerCase{"t64_e60_k4_shared", 64, 60, 4, 128, 96, 64, false, false},
                      LayerCase{"t300_e128_k8", 300, 128, 8, 128, 64, 0, true, false},
                      LayerCase{"t300_e8_k2_skewed", 300, 8, 2, 256, 176, 0, true, true},
                      LayerCase{"t1_e8_k4_qwen3_widths", 1, 8, 4, 2048, 768, 0, true, false},
                      LayerCase{"t7_e128_k8", 7, 128, 8, 256, 96, 0, true, false},
                      LayerCase{"t64_e8_k8", 64, 8, 8, 64, 40, 0, true, false}),
    [](const ::testing::TestParamInfo<LayerCase>& info) { return std::string(info.param.name); });

// A figure, not a bound: a Qwen3-30B-A3B layer's experts (128 of 768 x 2048, top 8) at decode
// batch 1, 2, 4, 8 through the GEMV path: the bytes of the experts chosen (each read once) over
// the time of the layer's routing + expert kernels, against the device-to-device copy rate. A
// batch-1 step should read top_k experts, not all 128: a time near 128/8 x the figure's would say
// otherwise.
TEST(MoeLayerTest, DecodeBandwidthAtQwen3MoeWidths) {
  REQUIRE_CUDA_DEVICE();
  const int64_t E = 128, K = 8, H = 2048, I = 768;
  const int64_t expert_bytes = 3 * H * I * 2;
  auto gate_up = DeviceBuffer::allocate(E * 2 * I * H * 2, "gate_up");
  auto down = DeviceBuffer::allocate(E * H * I * 2, "down");
  auto router = DeviceBuffer::allocate(E * H * 2, "router");
  auto x = DeviceBuffer::allocate(8 * H * 2, "x");
  auto out = DeviceBuffer::allocate(8 * H * 2, "out");
  auto ws = DeviceBuffer::allocate(moe_workspace_bytes(DType::kBF16, 8, E, K, E, H, I, 0), "ws");
  ASSERT_TRUE(gate_up && down && router && x && out && ws);
  // Random values made on the device (fill_uniform); the router's scale spreads the routing.
  ASSERT_TRUE(fill_uniform(DType::kBF16, gate_up->get(), E * 2 * I * H, 1, 0.02f, nullptr).is_ok());
  ASSERT_TRUE(fill_uniform(DType::kBF16, down->get(), E * H * I, 2, 0.02f, nullptr).is_ok());
  ASSERT_TRUE(fill_uniform(DType::kBF16, router->get(), E * H, 3, 0.05f, nullptr).is_ok());
  ASSERT_TRUE(fill_uniform(DType::kBF16, x->get(), 8 * H, 4, 1.0f, nullptr).is_ok());
  auto gemm = Gemm::create();
  ASSERT_TRUE(gemm);
  cudaEvent_t start, stop;
  ASSERT_EQ(cudaEventCreate(&start), cudaSuccess);
  ASSERT_EQ(cudaEventCreate(&stop), cudaSuccess);
  // The copy rate: 1 GiB device to device.
  auto a = DeviceBuffer::allocate(1ull << 30, "copy"), b = DeviceBuffer::allocate(1ull << 30, "c");
  ASSERT_TRUE(a && b);
  cudaMemcpy(b->get(), a->get(), 1ull << 30, cudaMemcpyDeviceToDevice);
  cudaEventRecord(start);
  for (int i = 0; i < 5; ++i) cudaMemcpy(b->get(), a->get(), 1ull << 30, cudaMemcpyDeviceToDevice);
  cudaEventRecord(stop);
  cudaEventSynchronize(stop);
  float copy_ms = 0;
  cudaEventElapsedTime(&copy_ms, start, stop);
  const double copy_gbs = 2.0 * 5 * (1ull << 30) / (copy_ms * 1e-3) / 1e9;  // read + write
  for (int64_t T : {1, 2, 4, 8}) {
    MoeArgs args;
    args.dtype = DType::kBF16;
    args.tokens = T;
    args.num_experts = E;
    args.top_k = K;
    args.x = x->get();
    args.router = router->get();
    args.experts = MoeExperts{gate_up->get(), down->get(), 0, E, H, I};
    args.workspace = ws->get();
    args.workspace_bytes = ws->bytes();
    args.out = out->get();
    ASSERT_TRUE(moe_forward(args, **gemm, nullptr).is_ok());
    // Distinct experts the step chose: what it must read.
    std::vector<int32_t> ids(T * K);
    auto logits = DeviceBuffer::allocate(T * E * 4, "logits");
    auto d_ids = DeviceBuffer::allocate(T * K * 4, "ids"),
         d_w = DeviceBuffer::allocate(T * K * 4, "w");
    ASSERT_TRUE(logits && d_ids && d_w);
    ASSERT_TRUE((*gemm)
                    ->linear(GemmShape{T, E, H, DType::kBF16, DType::kF32, false}, x->get(),
                             router->get(), nullptr, logits->get(), nullptr)
                    .is_ok());
    ASSERT_TRUE(moe_route(logits->as<float>(), DType::kBF16, T, E, K, true, d_ids->as<int32_t>(),
                          d_w->as<float>(), nullptr)
                    .is_ok());
    ids = host_copy<int32_t>(d_ids->get(), T * K);
    const std::set<int32_t> distinct(ids.begin(), ids.end());
    constexpr int kIters = 50;
    cudaEventRecord(start);
    for (int i = 0; i < kIters; ++i) ASSERT_TRUE(moe_forward(args, **gemm, nullptr).is_ok());
    cudaEventRecord(stop);
    ASSERT_EQ(cudaEventSynchronize(stop), cudaSuccess);
    float ms = 0;
    cudaEventElapsedTime(&ms, start, stop);
    const double us = 1e3 * ms / kIters;
    const double bytes = static_cast<double>(distinct.size() * expert_bytes + E * H * 2);
    std::printf(
        "[moe] decode batch %lld: %.1f us a layer, %zu experts (%.1f MB) -> %.0f GB/s = %.2f of "
        "the copy rate %.0f GB/s\n",
        static_cast<long long>(T), us, distinct.size(), bytes / 1e6, bytes / (us * 1e-6) / 1e9,
        bytes / (us * 1e-6) / 1e9 / copy_gbs, copy_gbs);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
}

TEST(MoeLayerTest, RefusesShapesTheKernelsDoNotTake) {
  MoeExperts w;
  w.gate_up = w.down = reinterpret_cast<void*>(256);
  w.local_experts = 8;
  w.hidden = 60;  // not a multiple of 8
  w.inter = 48;
  MoePermutation perm;
  Status st = moe_grouped_gate_up(DType::kBF16, nullptr, w, perm, 16, nullptr, nullptr);
  EXPECT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("hidden 60"), std::string::npos) << st.message();
  w.hidden = 64;
  EXPECT_FALSE(moe_gemv_down_combine(DType::kF32, nullptr, nullptr, nullptr, 1, 2, w, nullptr,
                                     nullptr, nullptr, nullptr, nullptr)
                   .is_ok());
}

}  // namespace
}  // namespace tessera::cuda
