#include "kernels/cpu/moe.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "tests/kernels/test_util.h"

namespace tessera::cpu {
namespace {

using testing::expect_close_all;
using testing::random_floats;

// A dense fp32 matrix [rows, cols] and its view.
struct Matrix {
  int64_t rows = 0, cols = 0;
  std::vector<float> v;
  TensorView view() const { return {v.data(), DType::kF32, {rows, cols}}; }
  double at(int64_t r, int64_t c) const { return v[static_cast<size_t>(r * cols + c)]; }
  // Rows [begin, end).
  Matrix rows_of(int64_t begin, int64_t end) const {
    return {end - begin, cols, {v.begin() + begin * cols, v.begin() + end * cols}};
  }
  // Columns [begin, end).
  Matrix cols_of(int64_t begin, int64_t end) const {
    Matrix m{rows, end - begin, {}};
    for (int64_t r = 0; r < rows; ++r) {
      m.v.insert(m.v.end(), v.begin() + r * cols + begin, v.begin() + r * cols + end);
    }
    return m;
  }
};

Matrix random_matrix(int64_t rows, int64_t cols, uint32_t seed, float scale) {
  return {rows, cols, random_floats(static_cast<size_t>(rows * cols), seed, -scale, scale)};
}

struct Expert {
  Matrix gate, up, down;
  Expert slice(int tp, int rank) const {
    const int64_t n = gate.rows / tp;
    return {gate.rows_of(rank * n, (rank + 1) * n), up.rows_of(rank * n, (rank + 1) * n),
            down.cols_of(rank * n, (rank + 1) * n)};
  }
};

// The weights of an MoE layer, owned, and the views cpu::moe reads.
struct Model {
  int64_t hidden = 0;
  Matrix router;
  std::vector<Expert> experts;
  bool has_shared = false;
  Expert shared;
  Matrix shared_gate;
  int64_t top_k = 2;
  bool renormalize = true;

  MoeLayer layer() const {
    MoeLayer l;
    l.router = router.view();
    for (const Expert& e : experts)
      l.experts.push_back({e.gate.view(), e.up.view(), e.down.view()});
    l.top_k = top_k;
    l.renormalize = renormalize;
    if (has_shared) {
      l.shared = {shared.gate.view(), shared.up.view(), shared.down.view()};
      l.shared_gate = shared_gate.view();
    }
    return l;
  }
  // Tensor-parallel rank `rank` of `tp`: every expert's slice, the router replicated.
  Model shard(int tp, int rank) const {
    Model m = *this;
    for (Expert& e : m.experts) e = e.slice(tp, rank);
    if (has_shared) m.shared = shared.slice(tp, rank);
    return m;
  }
};

Model make_model(int64_t hidden, int64_t experts, int64_t inter, int64_t top_k, bool renormalize,
                 int64_t shared_inter, uint32_t seed) {
  Model m;
  m.hidden = hidden;
  m.top_k = top_k;
  m.renormalize = renormalize;
  // Router rows of scale 1/sqrt(hidden) * 3: logits spread over several units, so the top-k
  // choice is far from ties.
  m.router = random_matrix(experts, hidden, seed, 3.0f / std::sqrt(float(hidden)));
  const float s_in = 1.7f / std::sqrt(float(hidden)), s_out = 1.7f / std::sqrt(float(inter));
  for (int64_t e = 0; e < experts; ++e) {
    const uint32_t k = seed + 10 * static_cast<uint32_t>(e + 1);
    m.experts.push_back({random_matrix(inter, hidden, k, s_in),
                         random_matrix(inter, hidden, k + 1, s_in),
                         random_matrix(hidden, inter, k + 2, s_out)});
  }
  if (shared_inter > 0) {
    m.has_shared = true;
    m.shared = {
        random_matrix(shared_inter, hidden, seed + 7, s_in),
        random_matrix(shared_inter, hidden, seed + 8, s_in),
        random_matrix(hidden, shared_inter, seed + 9, 1.7f / std::sqrt(float(shared_inter)))};
    m.shared_gate = random_matrix(1, hidden, seed + 11, s_in);
  }
  return m;
}

// The expert MLP of one token in double: down(silu(gate x) * up x).
std::vector<double> expert_ref(const Expert& e, const float* x, int64_t hidden) {
  std::vector<double> act(static_cast<size_t>(e.gate.rows));
  for (int64_t i = 0; i < e.gate.rows; ++i) {
    double g = 0, u = 0;
    for (int64_t h = 0; h < hidden; ++h) {
      g += e.gate.at(i, h) * x[h];
      u += e.up.at(i, h) * x[h];
    }
    act[static_cast<size_t>(i)] = g / (1 + std::exp(-g)) * u;
  }
  std::vector<double> y(static_cast<size_t>(hidden));
  for (int64_t h = 0; h < hidden; ++h) {
    for (int64_t i = 0; i < e.gate.rows; ++i) y[static_cast<size_t>(h)] += e.down.at(h, i) * act[i];
  }
  return y;
}

// transformers' SparseMoeBlock, token by token, in double.
std::vector<double> reference(const Model& m, const std::vector<float>& x) {
  const int64_t H = m.hidden, E = static_cast<int64_t>(m.experts.size());
  const int64_t T = static_cast<int64_t>(x.size()) / H;
  std::vector<double> y(x.size());
  for (int64_t t = 0; t < T; ++t) {
    const float* xt = x.data() + t * H;
    std::vector<double> p(static_cast<size_t>(E));
    for (int64_t e = 0; e < E; ++e) {
      for (int64_t h = 0; h < H; ++h) p[e] += m.router.at(e, h) * xt[h];
    }
    const double mx = *std::max_element(p.begin(), p.end());
    double sum = 0;
    for (double& v : p) sum += v = std::exp(v - mx);
    for (double& v : p) v /= sum;
    std::vector<int64_t> order(static_cast<size_t>(E));
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return p[a] > p[b]; });
    double top = 0;
    for (int64_t k = 0; k < m.top_k; ++k) top += p[order[k]];
    for (int64_t k = 0; k < m.top_k; ++k) {
      const double w = m.renormalize ? p[order[k]] / top : p[order[k]];
      std::vector<double> o = expert_ref(m.experts[order[k]], xt, H);
      for (int64_t h = 0; h < H; ++h) y[t * H + h] += w * o[h];
    }
    if (m.has_shared) {
      double g = 0;
      for (int64_t h = 0; h < H; ++h) g += m.shared_gate.at(0, h) * xt[h];
      const double s = 1 / (1 + std::exp(-g));
      std::vector<double> o = expert_ref(m.shared, xt, H);
      for (int64_t h = 0; h < H; ++h) y[t * H + h] += s * o[h];
    }
  }
  return y;
}

// fp32 against double over sums of at most a few hundred O(1) terms: 1e-5 relative plus 1e-6
// absolute (outputs near zero) is far above rounding (~1e-6) and far below a wrong expert or
// weight (differences of O(0.1)).
constexpr double kRtol = 1e-5, kAtol = 1e-6;

struct Case {
  int64_t experts, inter, top_k;
  bool renormalize;
  int64_t shared_inter;
  int64_t tokens;
};

TEST(MoeTest, MatchesTransformersPerTokenReference) {
  CpuContext ctx(2);
  const int64_t H = 32;
  for (const Case& c : {Case{4, 24, 2, true, 0, 9},      // Mixtral
                        Case{4, 24, 2, false, 40, 9},    // Qwen2-MoE: shared expert, no renorm
                        Case{8, 16, 3, true, 0, 17},     // Qwen3-MoE with norm_topk_prob
                        Case{8, 16, 3, false, 0, 17},    // ... without
                        Case{4, 24, 1, false, 0, 5},     // top-1
                        Case{4, 24, 4, true, 24, 1}}) {  // every expert, one token
    const Model m = make_model(H, c.experts, c.inter, c.top_k, c.renormalize, c.shared_inter,
                               static_cast<uint32_t>(100 * c.experts + c.top_k));
    const std::vector<float> x = random_floats(static_cast<size_t>(c.tokens * H), 7, -2.0f, 2.0f);
    std::vector<float> y(x.size());
    ASSERT_TRUE(moe(ctx, m.layer(), x, y).is_ok());
    expect_close_all(y, reference(m, x), kRtol, kAtol,
                     "experts " + std::to_string(c.experts) + " top " + std::to_string(c.top_k) +
                         (c.renormalize ? " renorm" : "") + (c.shared_inter ? " shared" : ""));
  }
}

TEST(MoeTest, RouteRenormalisesTopK) {
  CpuContext ctx(1);
  const int64_t H = 16;
  for (bool renorm : {true, false}) {
    const Model m = make_model(H, 6, 8, 2, renorm, 0, 5);
    const std::vector<float> x = random_floats(static_cast<size_t>(4 * H), 9);
    auto r = moe_route(ctx, m.layer(), x);
    ASSERT_TRUE(r.has_value()) << r.status().to_string();
    for (int64_t t = 0; t < 4; ++t) {
      const float sum = r->weight[t * 2] + r->weight[t * 2 + 1];
      EXPECT_GE(r->weight[t * 2], r->weight[t * 2 + 1]) << "highest first";
      EXPECT_NE(r->expert[t * 2], r->expert[t * 2 + 1]);
      if (renorm) {
        EXPECT_NEAR(sum, 1.0f, 1e-6);
      } else {
        EXPECT_LT(sum, 1.0f) << "two of six probabilities";
      }
    }
  }
}

// Tensor parallelism: each rank's partial sums (every expert's rows of gate/up and columns of
// down, the router replicated) add up to the whole layer's output.
TEST(MoeTest, TensorParallelShardsSumToTheWhole) {
  CpuContext ctx(2);
  const int64_t H = 32, T = 11;
  const Model m = make_model(H, 4, 24, 2, false, 40, 77);
  const std::vector<float> x = random_floats(static_cast<size_t>(T * H), 3, -2.0f, 2.0f);
  std::vector<float> whole(x.size());
  ASSERT_TRUE(moe(ctx, m.layer(), x, whole).is_ok());
  for (int tp : {2, 4}) {
    std::vector<double> sum(x.size());
    for (int rank = 0; rank < tp; ++rank) {
      const Model shard = m.shard(tp, rank);
      ASSERT_EQ(shard.experts[0].gate.rows, 24 / tp);
      std::vector<float> part(x.size());
      ASSERT_TRUE(moe(ctx, shard.layer(), x, part).is_ok());
      for (size_t i = 0; i < part.size(); ++i) sum[i] += part[i];
    }
    expect_close_all(whole, sum, kRtol, kAtol, "tp " + std::to_string(tp));
  }
}

TEST(MoeTest, BadLayersAreRefused) {
  CpuContext ctx(1);
  const int64_t H = 16;
  Model m = make_model(H, 4, 8, 2, true, 0, 1);
  const std::vector<float> x = random_floats(static_cast<size_t>(2 * H), 2);
  std::vector<float> y(x.size());
  m.top_k = 5;
  Status st = moe(ctx, m.layer(), x, y);
  EXPECT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("top_k 5"), std::string::npos) << st.message();
  m.top_k = 2;
  // A layer may hold some of the router's experts (expert parallelism), not more than it has
  // rows for.
  MoeLayer l = m.layer();
  l.expert_begin = 1;
  st = moe(ctx, l, x, y);
  EXPECT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("experts 1..4 among its rows"), std::string::npos) << st.message();
  l.expert_begin = 0;
  l.experts.clear();
  EXPECT_FALSE(moe(ctx, l, x, y).is_ok());
}

// Expert parallelism's pieces: the experts split over two "ranks" (each holding half, the slots
// of the other's experts skipped) add up to the whole layer, and so does a route computed once
// and passed to moe_experts, plus the shared expert.
TEST(MoeTest, ExpertsSplitIntoRangesAddUpToTheLayer) {
  CpuContext ctx(1);
  const int64_t H = 16, T = 5;
  Model m = make_model(H, 4, 8, 2, true, 12, 3);
  const std::vector<float> x = random_floats(static_cast<size_t>(T * H), 4);
  std::vector<float> whole(x.size());
  ASSERT_TRUE(moe(ctx, m.layer(), x, whole));
  MoeLayer all = m.layer();
  auto route = moe_route(ctx, all, x);
  ASSERT_TRUE(route) << route.status().message();
  std::vector<float> sum(x.size(), 0.0f), part(x.size());
  for (int64_t first : {0, 2}) {
    MoeLayer half = all;
    half.expert_begin = first;
    half.experts.assign(all.experts.begin() + first, all.experts.begin() + first + 2);
    ASSERT_TRUE(moe_experts(ctx, half, x, *route, part));
    for (size_t i = 0; i < sum.size(); ++i) sum[i] += part[i];
  }
  ASSERT_TRUE(moe_shared(ctx, all, x, sum));
  for (size_t i = 0; i < sum.size(); ++i) EXPECT_NEAR(sum[i], whole[i], 1e-5f) << i;
}

}  // namespace
}  // namespace tessera::cpu
