// The W4A16 kernels against the CPU's reading of the checkpoint formats (common/checkpoint's
// quantize_linear writes AWQ / GPTQ tensors, its dequantize is the oracle).
//
// Round trip: w4_dequantize of the repacked layer must equal, bit for bit, the CPU's weight
// w = (q - z) * s held in the run dtype the way the kernels compute it: Wd = round((q - z) *
// round(s)) (one rounding of the exact product for fp16, whose scales are exact; for bf16 the
// fp16 scale is rounded to bf16 first). q - z is recovered from dequantize as w / s (exact).
//
// Linear: y = w4_linear(x) for x in U(-1, 1) rounded to the dtype, against two double-precision
// references: ya = x . W^T with dequantize's exact W, and yd = x . Wd^T with the weight the
// kernels multiply (the round trip checks Wd; the m = 1 kernel's Wd is (q - z) * round(s) without
// the rounding to the dtype, quant_gemm.h's w4_decode_kernel). Per output element, with K = in,
// S = sum_i |x_i Wd_i| and A = 2^-20 sqrt(K) S:
//   |y - yd| <= u |yd| + 2 A   u = 2^-8 (bf16) / 2^-11 (fp16): the one rounding of the fp32
//                              result to the output dtype (half an ulp, relative);
//                              A: fp32 accumulation in a different order (tensor-core k16 steps,
//                              split-K partials, cuBLASLt tiles), a random walk of sqrt(K)
//                              roundings of partial sums <= S, allowed 4x the 2^-22 that
//                              gemm_test allows cuBLASLt alone.
//   |y - ya| <= u |yd| + 2 A + E,   E = sum_i |x_i| |Wd_i - W_i|: the rounding of the dequantized
//                              weight to the dtype, exactly as large as it is for this x (a
//                              bound by the triangle inequality; about 2^-9 (fp16) or 2^-6 (bf16)
//                              of S, so the first check is the sharp one).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "common/checkpoint/quantization.h"
#include "common/status.h"
#include "common/tensor.h"
#include "kernels/cuda/cuda_util.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/quant_gemm.h"

namespace tessera::cuda {
namespace {

bool has_cuda_device() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

#define REQUIRE_CUDA_DEVICE() \
  if (!has_cuda_device()) FAIL() << "no CUDA device: these tests run only on a GPU machine"

uint16_t to_half_bits(float f, DType d) {
  return d == DType::kBF16 ? float_to_bf16(f) : float_to_f16(f);
}
float from_half_bits(uint16_t h, DType d) {
  return d == DType::kBF16 ? bf16_to_float(h) : f16_to_float(h);
}
float round_to(float f, DType d) { return from_half_bits(to_half_bits(f, d), d); }

// U(-1, 1) from a counter-based hash.
struct Uniform {
  uint64_t state;
  float operator()() {
    uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return static_cast<float>(z >> 40) * (2.0f / 16777216.0f) - 1.0f;
  }
};

// fn(begin, end) over [0, n) on the machine's cores.
template <typename Fn>
void parallel_for(int64_t n, Fn fn) {
  const int64_t threads = std::clamp<int64_t>(std::thread::hardware_concurrency(), 1, 32);
  std::vector<std::thread> pool;
  const int64_t per = (n + threads - 1) / threads;
  for (int64_t begin = 0; begin < n; begin += per) {
    pool.emplace_back(fn, begin, std::min(n, begin + per));
  }
  for (std::thread& t : pool) t.join();
}

DeviceBuffer device_alloc(size_t bytes, const char* what) {
  auto buf = DeviceBuffer::allocate(bytes, what);
  EXPECT_TRUE(buf.has_value()) << buf.status().to_string();
  return buf.has_value() ? std::move(buf).value() : DeviceBuffer();
}

DeviceBuffer upload(const void* data, size_t bytes, const char* what) {
  DeviceBuffer buf = device_alloc(bytes, what);
  if (buf.get() != nullptr) {
    EXPECT_EQ(cudaMemcpy(buf.get(), data, bytes, cudaMemcpyHostToDevice), cudaSuccess);
  }
  return buf;
}

std::vector<uint16_t> download_bits(const void* p, size_t count) {
  std::vector<uint16_t> bits(count);
  EXPECT_EQ(cudaMemcpy(bits.data(), p, count * 2, cudaMemcpyDeviceToHost), cudaSuccess);
  return bits;
}

QuantConfig awq(int64_t group) {
  QuantConfig q;
  q.method = QuantMethod::kAwq;
  q.bits = 4;
  q.group_size = group;
  return q;
}

// group 0: one group.
QuantConfig gptq(int64_t group, bool sym, bool desc_act, bool zero_offset = true) {
  QuantConfig q;
  q.method = QuantMethod::kGptq;
  q.bits = 4;
  q.group_size = group;
  q.sym = sym;
  q.desc_act = desc_act;
  q.zero_offset = zero_offset;
  return q;
}

// A layer quantized on the CPU: the checkpoint's tensors, uploaded as they are, and the
// oracle's weight.
struct QuantLayer {
  QuantConfig q;
  int64_t out = 0, in = 0;
  std::vector<QuantizedPart> parts;
  std::vector<float> w;           // dequantize(): [out, in]
  std::vector<int32_t> group_of;  // input -> scale group
  DeviceBuffer qweight, qzeros, scales;

  const QuantizedPart& part(const std::string& suffix) const {
    for (const QuantizedPart& p : parts) {
      if (p.suffix == suffix) return p;
    }
    ADD_FAILURE() << "no part " << suffix;
    return parts.front();
  }
  std::string name() const {
    return q.describe() +
           (q.method == QuantMethod::kGptq
                ? std::string(q.sym ? " sym" : " asym") + (q.desc_act ? " desc_act" : "") +
                      (q.zero_offset ? "" : " v2")
                : "") +
           " [" + std::to_string(out) + ", " + std::to_string(in) + "]";
  }
  // The fp16 scale of weight (o, i), as a float.
  float scale(int64_t o, int64_t i) const {
    const auto* s = reinterpret_cast<const uint16_t*>(part("scales").bytes.data());
    return f16_to_float(s[group_of[static_cast<size_t>(i)] * out + o]);
  }
};

std::unique_ptr<QuantLayer> make_layer(const QuantConfig& q, int64_t out, int64_t in,
                                       uint64_t seed) {
  auto l = std::make_unique<QuantLayer>();
  l->q = q;
  l->out = out;
  l->in = in;
  std::vector<float> w(static_cast<size_t>(out * in));
  // Weights of a few sizes, so groups get scales of different magnitudes.
  parallel_for(out, [&](int64_t first, int64_t last) {
    for (int64_t o = first; o < last; ++o) {
      Uniform u{seed * 1000003 + static_cast<uint64_t>(o)};
      const float row_scale = 0.02f + 0.1f * static_cast<float>(o % 7);
      for (int64_t i = 0; i < in; ++i) w[o * in + i] = row_scale * u();
    }
  });
  l->parts = quantize_linear(w, out, in, q, seed);
  LinearWeight lw;
  lw.method = q.method;
  for (const QuantizedPart& p : l->parts) {
    TensorView v{p.bytes.data(), p.dtype, p.shape};
    if (p.suffix == "qweight") lw.qweight = v;
    if (p.suffix == "qzeros") lw.qzeros = v;
    if (p.suffix == "scales") lw.scales = v;
    if (p.suffix == "g_idx") lw.g_idx = v;
  }
  auto deq = dequantize(lw, q, "test");
  EXPECT_TRUE(deq.has_value()) << deq.status().to_string();
  if (deq.has_value()) l->w = std::move(deq).value();
  const int64_t group = q.group(in);
  l->group_of.resize(static_cast<size_t>(in));
  for (int64_t i = 0; i < in; ++i) {
    l->group_of[static_cast<size_t>(i)] = static_cast<int32_t>(i / group);
  }
  if (q.method == QuantMethod::kGptq) {
    const auto& g = l->part("g_idx").bytes;
    std::memcpy(l->group_of.data(), g.data(), g.size());
  }
  const QuantizedPart& qw = l->part("qweight");
  const QuantizedPart& qz = l->part("qzeros");
  const QuantizedPart& sc = l->part("scales");
  l->qweight = upload(qw.bytes.data(), qw.bytes.size(), "qweight");
  l->qzeros = upload(qz.bytes.data(), qz.bytes.size(), "qzeros");
  l->scales = upload(sc.bytes.data(), sc.bytes.size(), "scales");
  return l;
}

// The layer repacked for `dtype` into `dst` (allocated here).
Expected<W4Layer> repack(const QuantLayer& l, DType dtype, DeviceBuffer* dst) {
  const int64_t group = l.q.group(l.in);
  *dst = device_alloc(w4_bytes(l.out, l.in, group), "repacked layer");
  Expected<W4Layer> layer = invalid_argument("unreachable");
  if (l.q.method == QuantMethod::kAwq) {
    AwqTensors t;
    t.out = l.out;
    t.in = l.in;
    t.group = group;
    t.qweight = l.qweight.as<int32_t>();
    t.qzeros = l.qzeros.as<int32_t>();
    t.scales = l.scales.get();
    layer = repack_awq(t, dtype, dst->get(), dst->bytes(), nullptr);
  } else {
    const auto& g = l.part("g_idx").bytes;
    GptqTensors t;
    t.out = l.out;
    t.in = l.in;
    t.group = group;
    t.qweight = l.qweight.as<int32_t>();
    t.qzeros = l.qzeros.as<int32_t>();
    t.scales = l.scales.get();
    t.g_idx = std::span<const int32_t>(reinterpret_cast<const int32_t*>(g.data()), g.size() / 4);
    t.zero_offset = l.q.zero_offset;
    layer = repack_gptq(t, dtype, dst->get(), dst->bytes(), nullptr);
  }
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  return layer;
}

// The weight the kernels multiply (file comment): round((q - z) * round(s)) in dtype, or with
// `exact`, (q - z) * round(s) unrounded (the m = 1 kernel's, exact in a float).
std::vector<float> kernel_weight(const QuantLayer& l, DType dtype, bool exact = false) {
  std::vector<float> wd(l.w.size());
  parallel_for(l.out, [&](int64_t first, int64_t last) {
    for (int64_t o = first; o < last; ++o) {
      for (int64_t i = 0; i < l.in; ++i) {
        const size_t at = static_cast<size_t>(o * l.in + i);
        const float s = l.scale(o, i);
        const float n = std::nearbyint(l.w[at] / s);  // q - z, exact in [-16, 15]
        const float product = n * round_to(s, dtype);
        wd[at] = exact ? product : round_to(product, dtype);
      }
    }
  });
  return wd;
}

// x [m, in] in U(-1, 1), rounded to dtype: the bits and their values.
struct Input {
  std::vector<uint16_t> bits;
  std::vector<float> values;
};
Input make_input(int64_t m, int64_t in, DType dtype, uint64_t seed) {
  Input x;
  x.bits.resize(static_cast<size_t>(m * in));
  x.values.resize(x.bits.size());
  Uniform u{seed};
  for (size_t i = 0; i < x.bits.size(); ++i) {
    x.bits[i] = to_half_bits(u(), dtype);
    x.values[i] = from_half_bits(x.bits[i], dtype);
  }
  return x;
}

// Checks y [m, out] against the file comment's two bounds; reports the worst element of each.
void expect_close(const QuantLayer& l, const std::vector<float>& wd, const Input& x, int64_t m,
                  DType dtype, const std::vector<float>& y, const std::string& what) {
  const int64_t out = l.out, in = l.in;
  const double u = dtype == DType::kBF16 ? std::ldexp(1.0, -8) : std::ldexp(1.0, -11);
  const double acc_scale = std::ldexp(1.0, -20) * std::sqrt(static_cast<double>(in));
  std::vector<double> ratio_d(static_cast<size_t>(m * out)), ratio_a(ratio_d.size());
  std::vector<double> ref_d(ratio_d.size()), ref_a(ratio_d.size());
  parallel_for(out, [&](int64_t first, int64_t last) {
    for (int64_t o = first; o < last; ++o) {
      const float* w = l.w.data() + o * in;
      const float* d = wd.data() + o * in;
      for (int64_t r = 0; r < m; ++r) {
        const float* xr = x.values.data() + r * in;
        double ya = 0, yd = 0, s = 0, e = 0;
        for (int64_t i = 0; i < in; ++i) {
          const double xi = xr[i];
          ya += xi * w[i];
          yd += xi * d[i];
          s += std::fabs(xi * d[i]);
          e += std::fabs(xi) * std::fabs(static_cast<double>(d[i]) - w[i]);
        }
        const size_t at = static_cast<size_t>(r * out + o);
        const double tol_d = u * std::fabs(yd) + 2 * acc_scale * s;
        const double err_d = std::fabs(y[at] - yd), err_a = std::fabs(y[at] - ya);
        ratio_d[at] = std::isfinite(err_d) ? err_d / tol_d : 1e30;
        ratio_a[at] = std::isfinite(err_a) ? err_a / (tol_d + e) : 1e30;
        ref_d[at] = yd;
        ref_a[at] = ya;
      }
    }
  });
  for (const auto* ratios : {&ratio_d, &ratio_a}) {
    const auto worst = std::max_element(ratios->begin(), ratios->end());
    const size_t at = static_cast<size_t>(worst - ratios->begin());
    const size_t bad = static_cast<size_t>(
        std::count_if(ratios->begin(), ratios->end(), [](double r) { return r > 1; }));
    EXPECT_EQ(bad, 0u) << what << (ratios == &ratio_d ? " vs the dtype weight" : " vs dequantize")
                       << ": " << bad << " of " << ratios->size() << " out of tolerance; worst ["
                       << at / out << ", " << at % out << "]: gpu " << y[at] << " ref "
                       << (ratios == &ratio_d ? ref_d[at] : ref_a[at])
                       << " (error / tolerance = " << *worst << ")";
  }
}

std::unique_ptr<Gemm> make_gemm() {
  auto g = Gemm::create(32u << 20, /*autotune=*/false);
  EXPECT_TRUE(g.has_value()) << g.status().to_string();
  return g.has_value() ? std::move(g).value() : nullptr;
}

// A zeroed workspace for the layer and m rows.
DeviceBuffer make_workspace(int64_t out, int64_t in, int64_t max_m) {
  DeviceBuffer ws = device_alloc(w4_workspace_bytes(out, in, max_m), "workspace");
  if (ws.get() != nullptr) {
    EXPECT_EQ(cudaMemset(ws.get(), 0, ws.bytes()), cudaSuccess);
  }
  return ws;
}

// The split-K counters (the workspace's first 32 KiB) are all zero again.
void expect_counters_zero(const DeviceBuffer& ws, const std::string& what) {
  std::vector<int32_t> c(8192);
  ASSERT_EQ(cudaMemcpy(c.data(), ws.get(), c.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(std::count(c.begin(), c.end(), 0), static_cast<long>(c.size()))
      << what << ": split-K counters left non-zero";
}

// Runs w4_linear eagerly for each m and checks it against the references.
void check_linear(const QuantLayer& l, DType dtype, std::span<const int64_t> ms, Gemm& gemm) {
  DeviceBuffer dst;
  auto layer = repack(l, dtype, &dst);
  ASSERT_TRUE(layer.has_value()) << l.name() << ": " << layer.status().to_string();
  const std::vector<float> wd = kernel_weight(l, dtype);
  const std::vector<float> wd_exact = kernel_weight(l, dtype, /*exact=*/true);
  const int64_t max_m = *std::max_element(ms.begin(), ms.end());
  DeviceBuffer ws = make_workspace(l.out, l.in, max_m);
  for (int64_t m : ms) {
    const std::string what = l.name() + " " + dtype_name(dtype) + " m=" + std::to_string(m);
    const Input x = make_input(m, l.in, dtype, 17 * static_cast<uint64_t>(m) + l.in);
    DeviceBuffer xd = upload(x.bits.data(), x.bits.size() * 2, "x");
    DeviceBuffer yd = device_alloc(static_cast<size_t>(m * l.out) * 2, "y");
    ASSERT_EQ(cudaMemset(yd.get(), 0xff, yd.bytes()), cudaSuccess);  // NaN if left unwritten
    Status st = w4_linear(*layer, xd.get(), m, yd.get(), ws.get(), ws.bytes(), &gemm, nullptr);
    ASSERT_TRUE(st.is_ok()) << what << ": " << st.to_string();
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess) << what;
    const std::vector<uint16_t> bits = download_bits(yd.get(), static_cast<size_t>(m * l.out));
    std::vector<float> y(bits.size());
    for (size_t i = 0; i < bits.size(); ++i) y[i] = from_half_bits(bits[i], dtype);
    const bool gemv = w4_decode_kernel(l.out, l.in, m) == W4DecodeKernel::kGemv;
    expect_close(l, gemv ? wd_exact : wd, x, m, dtype, y, what + (gemv ? " (gemv)" : ""));
    expect_counters_zero(ws, what);
  }
}

int64_t ceil_div_u(uint64_t a, uint64_t b) { return static_cast<int64_t>((a + b - 1) / b); }

// Every n-tile count of the fused kernel (m <= 8, 16, 32, 64) and both sides of the switch to
// the prefill path.
const int64_t kAllMs[] = {1, 2, 7, 16, 24, 33, 64, 65, 200};

std::vector<QuantConfig> all_configs() {
  return {awq(32),
          awq(64),
          awq(128),
          gptq(128, /*sym=*/true, /*desc_act=*/false),
          gptq(128, /*sym=*/true, /*desc_act=*/true),
          gptq(128, /*sym=*/false, /*desc_act=*/false),
          gptq(64, /*sym=*/false, /*desc_act=*/true),
          gptq(32, /*sym=*/false, /*desc_act=*/true, /*zero_offset=*/false),
          gptq(0, /*sym=*/false, /*desc_act=*/true)};  // one group
}

// ---- repack round trip

void check_round_trip(const QuantLayer& l, DType dtype) {
  DeviceBuffer dst;
  auto layer = repack(l, dtype, &dst);
  ASSERT_TRUE(layer.has_value()) << l.name() << ": " << layer.status().to_string();
  const bool act_order = l.q.method == QuantMethod::kGptq && l.q.desc_act && l.q.group(l.in) < l.in;
  EXPECT_EQ(layer->perm != nullptr, act_order) << l.name();
  DeviceBuffer w = device_alloc(static_cast<size_t>(l.out * l.in) * 2, "dequantized");
  Status st = w4_dequantize(*layer, w.get(), nullptr);
  ASSERT_TRUE(st.is_ok()) << st.to_string();
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<uint16_t> bits = download_bits(w.get(), static_cast<size_t>(l.out * l.in));
  const std::vector<float> wd = kernel_weight(l, dtype);
  size_t bad = 0, first_bad = 0;
  for (size_t k = 0; k < bits.size(); ++k) {
    if (from_half_bits(bits[k], dtype) != wd[k]) {
      if (bad++ == 0) first_bad = k;
    }
  }
  EXPECT_EQ(bad, 0u) << l.name() << " " << dtype_name(dtype) << ": " << bad
                     << " weights differ; first [" << first_bad / l.in << ", " << first_bad % l.in
                     << "]: gpu " << from_half_bits(bits[first_bad], dtype) << " expected "
                     << wd[first_bad] << " (dequantize " << l.w[first_bad] << ")";
  // kernel_weight's premise: every dequantized weight is an integer times its scale.
  size_t not_integer = 0;
  for (int64_t o = 0; o < l.out; ++o) {
    for (int64_t i = 0; i < l.in; i += 7) {
      const float s = l.scale(o, i), v = l.w[static_cast<size_t>(o * l.in + i)];
      if (std::nearbyint(v / s) * s != v) ++not_integer;
    }
  }
  EXPECT_EQ(not_integer, 0u) << l.name();
}

TEST(W4RepackTest, RoundTripMatchesDequantize) {
  REQUIRE_CUDA_DEVICE();
  const int64_t shapes[][2] = {{192, 512}, {320, 1408}, {1024, 4096}};
  uint64_t seed = 1;
  for (const QuantConfig& q : all_configs()) {
    for (const auto& [out, in] : shapes) {
      auto l = make_layer(q, out, in, seed++);
      for (DType dt : {DType::kBF16, DType::kF16}) check_round_trip(*l, dt);
    }
  }
}

// ---- w4_linear against the CPU

// Every format on two small non-square shapes (192 x 512 splits each tile over several CTAs,
// 320 x 1408 has 22 input units and groups of 32 / 64 / 128), every m of both paths.
TEST(W4LinearTest, EveryFormatSmallShapes) {
  REQUIRE_CUDA_DEVICE();
  auto gemm = make_gemm();
  ASSERT_NE(gemm, nullptr);
  const int64_t shapes[][2] = {{192, 512}, {320, 1408}};
  uint64_t seed = 100;
  for (const QuantConfig& q : all_configs()) {
    for (const auto& [out, in] : shapes) {
      auto l = make_layer(q, out, in, seed++);
      for (DType dt : {DType::kBF16, DType::kF16}) check_linear(*l, dt, kAllMs, *gemm);
    }
  }
}

// Llama-sized layers: 4096 x 4096 (q / o projection), 4096 x 1792 (down_proj at TP 8: in =
// 14336 / 8), 1024 x 14336 (a long input: 224 units per tile).
TEST(W4LinearTest, LlamaShapes) {
  REQUIRE_CUDA_DEVICE();
  auto gemm = make_gemm();
  ASSERT_NE(gemm, nullptr);
  const QuantConfig configs[] = {awq(128), gptq(128, /*sym=*/false, /*desc_act=*/true)};
  uint64_t seed = 200;
  for (const QuantConfig& q : configs) {
    for (const auto& [out, in] : {std::pair<int64_t, int64_t>{4096, 4096}, {4096, 1792}}) {
      auto l = make_layer(q, out, in, seed++);
      for (DType dt : {DType::kBF16, DType::kF16}) check_linear(*l, dt, kAllMs, *gemm);
    }
  }
  auto l = make_layer(gptq(128, /*sym=*/true, /*desc_act=*/false), 1024, 14336, seed++);
  const int64_t ms[] = {1, 7, 64, 65};
  check_linear(*l, DType::kBF16, ms, *gemm);
}

// m = 1 on both sides of the kernels' split (w4_gemv_kernel up to 32 M weights, the fused
// kernel's one-row instance above): 8192 x 4224 (34.6 M) takes the one-row fused kernel, with
// group 128 and with group 32 (a unit over two groups); 16384 x 1024 and 32768 x 512 take the
// gemv kernel with fewer K-slices per strip than the small layers above (launch_gemv picks them
// by the GPU's resident CTAs); in = 49216 is too long for the gemv's shared memory. Run with
// TESSERA_W4_DECODE=fused and =gemv (scripts/gpu-check does), each kernel takes every case.
TEST(W4LinearTest, OneTokenBothKernels) {
  REQUIRE_CUDA_DEVICE();
  auto gemm = make_gemm();
  ASSERT_NE(gemm, nullptr);
  const int64_t ms[] = {1};
  uint64_t seed = 250;
  struct Case {
    QuantConfig q;
    int64_t out, in;
  };
  const Case cases[] = {{awq(128), 8192, 4224},
                        {gptq(32, /*sym=*/false, /*desc_act=*/false), 8192, 4224},
                        {awq(128), 16384, 1024},
                        {gptq(64, /*sym=*/true, /*desc_act=*/true), 32768, 512},
                        {awq(64), 128, 49216}};
  for (const Case& c : cases) {
    auto l = make_layer(c.q, c.out, c.in, seed++);
    for (DType dt : {DType::kBF16, DType::kF16}) check_linear(*l, dt, ms, *gemm);
  }
  EXPECT_EQ(w4_decode_kernel(128, 49216, 1), W4DecodeKernel::kFused);
  EXPECT_EQ(w4_decode_kernel(4096, 4096, 2), W4DecodeKernel::kFused);
  EXPECT_EQ(w4_decode_kernel(4096, 4096, kW4FusedMaxM + 1), W4DecodeKernel::kDequantGemm);
}

// A wide, short layer (600 tiles of 2 units): CTAs take several tiles, writing whole ones
// directly and sharing the tiles at their ends, and stages cross tile boundaries.
TEST(W4LinearTest, ManyTilesPerCta) {
  REQUIRE_CUDA_DEVICE();
  auto gemm = make_gemm();
  ASSERT_NE(gemm, nullptr);
  const int64_t ms[] = {1, 7, 16, 24, 64, 65};
  const QuantConfig configs[] = {awq(64), gptq(32, /*sym=*/false, /*desc_act=*/true)};
  uint64_t seed = 300;
  for (const QuantConfig& q : configs) {
    auto l = make_layer(q, 38400, 128, seed++);
    for (DType dt : {DType::kBF16, DType::kF16}) check_linear(*l, dt, ms, *gemm);
  }
}

// x one element into its buffer (2-byte aligned): the fused and gemv paths copy it first.
TEST(W4LinearTest, MisalignedInput) {
  REQUIRE_CUDA_DEVICE();
  auto l = make_layer(awq(64), 256, 1024, 7);
  const DType dt = DType::kBF16;
  DeviceBuffer dst;
  auto layer = repack(*l, dt, &dst);
  ASSERT_TRUE(layer.has_value()) << layer.status().to_string();
  const std::vector<float> wd = kernel_weight(*l, dt);
  const std::vector<float> wd_exact = kernel_weight(*l, dt, /*exact=*/true);
  DeviceBuffer ws = make_workspace(l->out, l->in, 64);
  for (int64_t m : {1, 5, 20, 40}) {
    const Input x = make_input(m, l->in, dt, 3 + m);
    std::vector<uint16_t> shifted(x.bits.size() + 1, 0);
    std::copy(x.bits.begin(), x.bits.end(), shifted.begin() + 1);
    DeviceBuffer xd = upload(shifted.data(), shifted.size() * 2, "x");
    DeviceBuffer yd = device_alloc(static_cast<size_t>(m * l->out) * 2, "y");
    const auto* x_at = static_cast<const uint16_t*>(xd.get()) + 1;
    Status st = w4_linear(*layer, x_at, m, yd.get(), ws.get(), ws.bytes(), nullptr, nullptr);
    ASSERT_TRUE(st.is_ok()) << st.to_string();
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const auto bits = download_bits(yd.get(), static_cast<size_t>(m * l->out));
    std::vector<float> y(bits.size());
    for (size_t i = 0; i < bits.size(); ++i) y[i] = from_half_bits(bits[i], dt);
    const bool gemv = w4_decode_kernel(l->out, l->in, m) == W4DecodeKernel::kGemv;
    expect_close(*l, gemv ? wd_exact : wd, x, m, dt, y, "misaligned x m=" + std::to_string(m));
  }
}

// w4_linear captured in a CUDA graph on a non-default stream (the fused path with an act-order
// permutation at m = 1 and 16, the prefill path at m = 100): replays give the eager outputs,
// bit for bit (the fused kernel's split-K adds in a fixed order).
TEST(W4LinearTest, GraphCapture) {
  REQUIRE_CUDA_DEVICE();
  auto gemm = make_gemm();
  ASSERT_NE(gemm, nullptr);
  auto l = make_layer(gptq(128, /*sym=*/false, /*desc_act=*/true), 1024, 4096, 11);
  const DType dt = DType::kF16;
  DeviceBuffer dst;
  auto layer = repack(*l, dt, &dst);
  ASSERT_TRUE(layer.has_value()) << layer.status().to_string();
  ASSERT_NE(layer->perm, nullptr);
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  const int64_t ms[] = {1, 16, 100};
  DeviceBuffer ws = make_workspace(l->out, l->in, 100);
  std::vector<DeviceBuffer> xs, ys;
  std::vector<std::vector<uint16_t>> eager;
  for (int64_t m : ms) {
    const Input x = make_input(m, l->in, dt, 5 * m);
    xs.push_back(upload(x.bits.data(), x.bits.size() * 2, "x"));
    ys.push_back(device_alloc(static_cast<size_t>(m * l->out) * 2, "y"));
    Status st = w4_linear(*layer, xs.back().get(), m, ys.back().get(), ws.get(), ws.bytes(),
                          gemm.get(), stream);
    ASSERT_TRUE(st.is_ok()) << st.to_string();
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    eager.push_back(download_bits(ys.back().get(), static_cast<size_t>(m * l->out)));
  }

  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), cudaSuccess);
  std::vector<Status> captured;
  for (size_t k = 0; k < std::size(ms); ++k) {
    captured.push_back(w4_linear(*layer, xs[k].get(), ms[k], ys[k].get(), ws.get(), ws.bytes(),
                                 gemm.get(), stream));
  }
  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  for (const Status& st : captured) ASSERT_TRUE(st.is_ok()) << st.to_string();
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  for (int replay = 0; replay < 3; ++replay) {
    for (DeviceBuffer& y : ys) {
      ASSERT_EQ(cudaMemsetAsync(y.get(), 0, y.bytes(), stream), cudaSuccess);
    }
    ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    for (size_t k = 0; k < std::size(ms); ++k) {
      EXPECT_EQ(download_bits(ys[k].get(), eager[k].size()), eager[k])
          << "replay " << replay << " m=" << ms[k];
    }
  }
  expect_counters_zero(ws, "graph replays");
  EXPECT_EQ(cudaGraphExecDestroy(exec), cudaSuccess);
  EXPECT_EQ(cudaGraphDestroy(graph), cudaSuccess);
  EXPECT_EQ(cudaStreamDestroy(stream), cudaSuccess);
}

// ---- bad arguments

TEST(W4RepackTest, InvalidArguments) {
  REQUIRE_CUDA_DEVICE();
  auto l = make_layer(gptq(64, /*sym=*/false, /*desc_act=*/true), 128, 256, 3);
  DeviceBuffer dst = device_alloc(w4_bytes(128, 256, 64), "dst");
  const auto& g = l->part("g_idx").bytes;
  std::vector<int32_t> g_idx(g.size() / 4);
  std::memcpy(g_idx.data(), g.data(), g.size());
  GptqTensors good;
  good.out = 128;
  good.in = 256;
  good.group = 64;
  good.qweight = l->qweight.as<int32_t>();
  good.qzeros = l->qzeros.as<int32_t>();
  good.scales = l->scales.get();
  good.g_idx = g_idx;
  auto expect_invalid = [&](const GptqTensors& t, DType dt, void* d, uint64_t bytes,
                            const std::string& needle) {
    auto r = repack_gptq(t, dt, d, bytes, nullptr);
    ASSERT_FALSE(r.has_value()) << needle;
    EXPECT_EQ(r.status().code(), Code::kInvalidArgument) << r.status().to_string();
    EXPECT_NE(r.status().message().find(needle), std::string::npos) << r.status().to_string();
  };
  GptqTensors t = good;
  t.group = 96;
  expect_invalid(t, DType::kBF16, dst.get(), dst.bytes(), "group = 96");
  t = good;
  t.group = 16;
  expect_invalid(t, DType::kBF16, dst.get(), dst.bytes(), "group = 16");
  t = good;
  t.out = 100;
  expect_invalid(t, DType::kBF16, dst.get(), dst.bytes(), "out = 100");
  t = good;
  t.in = 200;
  expect_invalid(t, DType::kBF16, dst.get(), dst.bytes(), "in = 200");
  t = good;
  t.qweight = nullptr;
  expect_invalid(t, DType::kBF16, dst.get(), dst.bytes(), "qweight is null");
  t = good;
  t.scales = nullptr;
  expect_invalid(t, DType::kBF16, dst.get(), dst.bytes(), "scales is null");
  expect_invalid(good, DType::kF32, dst.get(), dst.bytes(), "F32");
  expect_invalid(good, DType::kBF16, nullptr, dst.bytes(), "dst is null");
  expect_invalid(good, DType::kBF16, dst.get(), dst.bytes() - 1, "w4_bytes");
  t = good;
  t.g_idx = std::span<const int32_t>(g_idx).first(100);
  expect_invalid(t, DType::kBF16, dst.get(), dst.bytes(), "g_idx has 100 entries");
  std::vector<int32_t> bad = g_idx;
  bad[5] = 4;
  t = good;
  t.g_idx = bad;
  expect_invalid(t, DType::kBF16, dst.get(), dst.bytes(), "g_idx[5] is 4");
  bad = g_idx;
  bad[5] = (bad[5] + 1) % 4;  // one group one input short, another one over
  t.g_idx = bad;
  expect_invalid(t, DType::kBF16, dst.get(), dst.bytes(), "expected 64");
  AwqTensors a{128, 256, 64, nullptr, l->qzeros.as<int32_t>(), l->scales.get()};
  auto r = repack_awq(a, DType::kF16, dst.get(), dst.bytes(), nullptr);
  ASSERT_FALSE(r.has_value());
  EXPECT_EQ(r.status().code(), Code::kInvalidArgument);
  // The corrected arguments work.
  EXPECT_TRUE(repack_gptq(good, DType::kBF16, dst.get(), dst.bytes(), nullptr).has_value());
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

TEST(W4LinearTest, InvalidArguments) {
  REQUIRE_CUDA_DEVICE();
  auto gemm = make_gemm();
  ASSERT_NE(gemm, nullptr);
  auto l = make_layer(awq(128), 128, 256, 4);
  DeviceBuffer dst;
  auto layer = repack(*l, DType::kBF16, &dst);
  ASSERT_TRUE(layer.has_value()) << layer.status().to_string();
  DeviceBuffer ws = make_workspace(128, 256, 65);
  DeviceBuffer x = device_alloc(65 * 256 * 2, "x"), y = device_alloc(65 * 128 * 2, "y");
  auto expect_invalid = [&](const W4Layer& lay, const void* xv, int64_t m, void* yv, void* wv,
                            uint64_t wbytes, Gemm* g, const std::string& needle) {
    Status st = w4_linear(lay, xv, m, yv, wv, wbytes, g, nullptr);
    EXPECT_EQ(st.code(), Code::kInvalidArgument) << needle << ": " << st.to_string();
    EXPECT_NE(st.message().find(needle), std::string::npos) << st.to_string();
  };
  const W4Layer good = *layer;
  W4Layer bad = good;
  bad.group = 96;
  expect_invalid(bad, x.get(), 1, y.get(), ws.get(), ws.bytes(), nullptr, "group = 96");
  bad = good;
  bad.out = 96;
  expect_invalid(bad, x.get(), 1, y.get(), ws.get(), ws.bytes(), nullptr, "out = 96");
  bad = good;
  bad.in = 250;
  expect_invalid(bad, x.get(), 1, y.get(), ws.get(), ws.bytes(), nullptr, "in = 250");
  bad = good;
  bad.dtype = DType::kF32;
  expect_invalid(bad, x.get(), 1, y.get(), ws.get(), ws.bytes(), nullptr, "F32");
  bad = good;
  bad.qweight = nullptr;
  expect_invalid(bad, x.get(), 1, y.get(), ws.get(), ws.bytes(), nullptr, "qweight is null");
  bad = good;
  bad.zeros = nullptr;
  expect_invalid(bad, x.get(), 1, y.get(), ws.get(), ws.bytes(), nullptr, "zeros is null");
  expect_invalid(good, nullptr, 1, y.get(), ws.get(), ws.bytes(), nullptr, "x is null");
  expect_invalid(good, x.get(), 1, nullptr, ws.get(), ws.bytes(), nullptr, "y is null");
  expect_invalid(good, x.get(), 1, y.get(), nullptr, ws.bytes(), nullptr, "workspace is null");
  expect_invalid(good, x.get(), 0, y.get(), ws.get(), ws.bytes(), nullptr, "m = 0");
  expect_invalid(good, x.get(), 1, y.get(), ws.get(), 1024, nullptr, "w4_workspace_bytes");
  expect_invalid(good, x.get(), 65, y.get(), ws.get(), ws.bytes(), nullptr, "needs a Gemm");
  expect_invalid(good, x.get(), 1, y.get(), static_cast<uint8_t*>(ws.get()) + 4, ws.bytes() - 4,
                 nullptr, "16-byte aligned");
  // The same arguments, corrected, work.
  EXPECT_TRUE(w4_linear(good, x.get(), 1, y.get(), ws.get(), ws.bytes(), nullptr, nullptr).is_ok());
  EXPECT_TRUE(
      w4_linear(good, x.get(), 65, y.get(), ws.get(), ws.bytes(), gemm.get(), nullptr).is_ok());
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(check_w4_shape(4096, 4096, 4096).code(), Code::kOk);  // one group
  EXPECT_EQ(check_w4_shape(64, 448, 64).code(), Code::kOk);
  EXPECT_EQ(check_w4_shape(64, 448, 128).code(), Code::kInvalidArgument);
}

// ---- decode speed (reported, not asserted: a shared GPU's timing is no test)

// Llama-3-8B / 70B-sized layers from random int4 tensors, m = 1, 16 and 128 (the prefill path,
// printed beside a bf16 GEMM of the same shape): time per call and the bandwidth of the int4
// weight, scale and zero bytes (H200: ~4.8 TB/s peak, ~4.3
// TB/s for a device copy). Calls are replayed from a CUDA graph (no launch overhead) and cycle
// through copies of the layer that together exceed the 60 MB L2, so weights come from HBM.
TEST(W4LinearTest, DecodeBandwidth) {
  REQUIRE_CUDA_DEVICE();
  constexpr int64_t kPrefillM = 128;  // a short prompt: the dequantize + cuBLASLt path
  auto gemm = make_gemm();
  ASSERT_NE(gemm, nullptr);
  const int64_t shapes[][2] = {{4096, 4096}, {6144, 4096},  {28672, 4096}, {4096, 14336},
                               {8192, 8192}, {57344, 8192}, {8192, 28672}, {1024, 4096}};
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  cudaEvent_t start = nullptr, stop = nullptr;
  ASSERT_EQ(cudaEventCreate(&start), cudaSuccess);
  ASSERT_EQ(cudaEventCreate(&stop), cudaSuccess);
  for (const auto& [out, in] : shapes) {
    const int64_t group = 128;
    std::mt19937 rng(static_cast<uint32_t>(out + in));
    std::vector<int32_t> qw(static_cast<size_t>(in * out / 8)),
        qz(static_cast<size_t>(in / group * out / 8));
    for (int32_t& v : qw) v = static_cast<int32_t>(rng());
    for (int32_t& v : qz) v = static_cast<int32_t>(rng());
    std::vector<uint16_t> sc(static_cast<size_t>(in / group * out), float_to_f16(0.01f));
    DeviceBuffer dqw = upload(qw.data(), qw.size() * 4, "qweight");
    DeviceBuffer dqz = upload(qz.data(), qz.size() * 4, "qzeros");
    DeviceBuffer dsc = upload(sc.data(), sc.size() * 2, "scales");
    const uint64_t layer_bytes = w4_bytes(out, in, group);
    const int64_t copies = std::clamp<int64_t>(ceil_div_u(256u << 20, layer_bytes), 1, 32);
    std::vector<DeviceBuffer> dsts;
    std::vector<W4Layer> layers;
    for (int64_t c = 0; c < copies; ++c) {
      dsts.push_back(device_alloc(layer_bytes, "layer"));
      const AwqTensors t{out, in, group, dqw.as<int32_t>(), dqz.as<int32_t>(), dsc.get()};
      auto layer = repack_awq(t, DType::kBF16, dsts.back().get(), layer_bytes, stream);
      ASSERT_TRUE(layer.has_value()) << layer.status().to_string();
      layers.push_back(*layer);
    }
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    DeviceBuffer ws = make_workspace(out, in, kPrefillM);
    const Input x = make_input(kPrefillM, in, DType::kBF16, 9);
    DeviceBuffer xd = upload(x.bits.data(), x.bits.size() * 2, "x");
    DeviceBuffer yd = device_alloc(static_cast<size_t>(kPrefillM * out) * 2, "y");
    // The time per call of `call(i)`, replayed from a graph of max(copies, 20) calls.
    auto time_calls = [&](const std::function<Status(int64_t)>& call) -> double {
      const int64_t calls = std::max<int64_t>(copies, 20);
      EXPECT_TRUE(call(0).is_ok());  // eager first: plans and attributes outside the capture
      EXPECT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), cudaSuccess);
      for (int64_t i = 0; i < calls; ++i) {
        Status st = call(i);
        EXPECT_TRUE(st.is_ok()) << st.to_string();
      }
      cudaGraph_t graph = nullptr;
      EXPECT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
      cudaGraphExec_t exec = nullptr;
      EXPECT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
      EXPECT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);  // warm-up
      constexpr int kReplays = 5;
      EXPECT_EQ(cudaEventRecord(start, stream), cudaSuccess);
      for (int r = 0; r < kReplays; ++r) EXPECT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
      EXPECT_EQ(cudaEventRecord(stop, stream), cudaSuccess);
      EXPECT_EQ(cudaEventSynchronize(stop), cudaSuccess);
      float ms = 0;
      EXPECT_EQ(cudaEventElapsedTime(&ms, start, stop), cudaSuccess);
      EXPECT_EQ(cudaGraphExecDestroy(exec), cudaSuccess);
      EXPECT_EQ(cudaGraphDestroy(graph), cudaSuccess);
      return 1000.0 * ms / static_cast<double>(kReplays * calls);
    };
    for (int64_t m : {int64_t{1}, int64_t{16}, int64_t{64}, kPrefillM}) {
      const double us = time_calls([&](int64_t i) {
        return w4_linear(layers[static_cast<size_t>(i % copies)], xd.get(), m, yd.get(), ws.get(),
                         ws.bytes(), gemm.get(), stream);
      });
      const double bytes = static_cast<double>(out * in / 2 + (in / group) * out * 3);
      std::printf("w4_linear m=%-3lld [%6lld x %6lld]: %8.2f us, %7.1f GB/s (%s)\n",
                  static_cast<long long>(m), static_cast<long long>(out),
                  static_cast<long long>(in), us, bytes / us / 1e3,
                  w4_decode_kernel(out, in, m) == W4DecodeKernel::kGemv    ? "gemv"
                  : w4_decode_kernel(out, in, m) == W4DecodeKernel::kFused ? "fused"
                                                                           : "dequantize + gemm");
    }
    // The prefill path's first half alone: the dequantize kernel's bytes (int4 in, bf16 out).
    DeviceBuffer wd = device_alloc(static_cast<size_t>(out * in) * 2, "dequantized weight");
    const double dq_us = time_calls([&](int64_t i) {
      return w4_dequantize(layers[static_cast<size_t>(i % copies)], wd.get(), stream);
    });
    std::printf("w4_dequantize  [%6lld x %6lld]: %8.2f us, %7.1f GB/s\n",
                static_cast<long long>(out), static_cast<long long>(in), dq_us,
                static_cast<double>(out * in / 2 + out * in * 2) / dq_us / 1e3);
    // The prefill path's cost beside a bf16 layer's GEMM alone (the same cuBLASLt call; one
    // weight, so a layer under 60 MB is read from L2 there).
    DeviceBuffer wb = device_alloc(static_cast<size_t>(out * in) * 2, "bf16 weight");
    ASSERT_EQ(cudaMemset(wb.get(), 0, wb.bytes()), cudaSuccess);
    for (int64_t m : {int64_t{64}, kPrefillM}) {  // batch-64 decode's and the prefill's m
      const GemmShape shape{m, out, in, DType::kBF16, DType::kBF16, false};
      const double gemm_us = time_calls([&](int64_t) {
        return gemm->linear(shape, xd.get(), wb.get(), nullptr, yd.get(), stream);
      });
      std::printf("bf16 gemm m=%-3lld [%6lld x %6lld]: %8.2f us\n", static_cast<long long>(m),
                  static_cast<long long>(out), static_cast<long long>(in), gemm_us);
    }
    expect_counters_zero(ws, "bandwidth runs");
  }
  EXPECT_EQ(cudaEventDestroy(start), cudaSuccess);
  EXPECT_EQ(cudaEventDestroy(stop), cudaSuccess);
  EXPECT_EQ(cudaStreamDestroy(stream), cudaSuccess);
}

}  // namespace
}  // namespace tessera::cuda
