// The FP8 W8A8 kernels (kernels/cuda/fp8_linear.h) against the CPU's reading of the format
// (common/checkpoint/quantization.h, the CPU backend's oracle).
//
// Quantizers, bit for bit: the E4M3 bytes and fp32 row scales of quantize_fp8_rows equal the
// CPU's (a = static or max|row| / 448, fp8(x / a)) for the same bf16/fp16 rows, and those are
// what fake_quantize_fp8_activations rounds each value to (fp8(x / a) * a). The fused
// rms_norm_fp8 and silu_mul_fp8 equal the plain GPU rms_norm / add_rms_norm / silu_mul followed by
// the CPU's quantization of their output (the fused kernels quantize what the plain ones would
// have written); the fused norm is also checked against a double-precision RMSNorm within the
// E4M3 rounding (half a step: 2^-4 relative) plus two bf16 roundings. The online weight
// quantizer equals quantize_fp8 bit for bit (bytes and scale).
//
// GEMM: Fp8Gemm on both paths (cuBLASLt's outer-vector scaling and the fp32 output + epilogue)
// against a double-precision sum over the dequantized values (fp8 * a[m]) (fp8 * s[n]) + bias.
// Per output, with S = sum_k |x_k w_k| a s:
//   |y - ref| <= u |ref| + 2^-13 S
// u = 2^-8 (bf16) / 2^-11 (fp16): the one rounding of the output; 2^-13 S: the accumulation.
// Hopper's FP8 tensor-core instructions add into their accumulator keeping ~14 bits (DeepSeek-V3
// measured it; cuBLASLt without fast accumulation promotes the partial sums to fp32 between
// instructions), so each product is accurate to 2^-14 of a partial sum <= S, and the sum to
// 2^-13 S at worst. A wrong row, column or scale errs by about |ref| ~ S / sqrt(k), >= 2^-6 S
// for these k: far outside. The worst ratio to the bound is printed.
//
// The small-m kernel (m <= kFp8GemvMaxM, Fp8GemvTest): against the same double-precision sum,
// for every m up to the limit, tiny, odd (n = 48, k = 272: part of a 512-byte chunk) and Llama
// shapes, an lm_head-wide n and k = 32768, with random per-output scales. It sums in fp32 FMAs,
// so only the order of fp32 additions differs from the exact sum: each output within
//   |y - ref| <= u |ref| + 1e-5 S
// (the one output rounding, and fp32 sums of up to k / 32 products per lane, then a tree: errors
// of order sqrt(k) 2^-24 S, far below 1e-5 S). The same inputs through cuBLASLt agree with it
// within the two bounds; replayed from a CUDA graph it is bit for bit the eager call (no atomics).
// DecodeBandwidth times it beside cuBLASLt's FP8 path and a bf16 GEMM on Llama-3-8B's layers at
// m = 1 and prints the weights' GB/s (it asserts only correctness).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "common/checkpoint/quantization.h"
#include "common/status.h"
#include "common/tensor.h"
#include "kernels/cuda/cuda_util.h"
#include "kernels/cuda/elementwise.h"
#include "kernels/cuda/fp8_linear.h"
#include "kernels/cuda/gemm.h"

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

DeviceBuffer alloc(size_t bytes) {
  auto buf = DeviceBuffer::allocate(std::max<size_t>(bytes, 256), "test buffer");
  EXPECT_TRUE(buf.has_value()) << buf.status().to_string();
  return buf.has_value() ? std::move(buf).value() : DeviceBuffer();
}

template <typename T>
DeviceBuffer upload(const std::vector<T>& v) {
  DeviceBuffer b = alloc(v.size() * sizeof(T));
  if (b.get() != nullptr) {
    EXPECT_EQ(cudaMemcpy(b.get(), v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice),
              cudaSuccess);
  }
  return b;
}

template <typename T>
std::vector<T> download(const void* p, size_t count) {
  std::vector<T> v(count);
  EXPECT_EQ(cudaMemcpy(v.data(), p, count * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
  return v;
}

// Rows of `cols` values in the dtype (bits), rows of different magnitudes; row 1 all zero (its
// dynamic scale is 1) when there are more than 2 rows, and a few large values (saturation with a
// small static scale).
std::vector<uint16_t> make_rows(int64_t rows, int64_t cols, DType d, uint64_t seed) {
  std::vector<uint16_t> x(static_cast<size_t>(rows * cols));
  Uniform u{seed};
  for (int64_t r = 0; r < rows; ++r) {
    const float mag = r == 1 && rows > 2 ? 0.0f : std::ldexp(1.0f, static_cast<int>(r % 9) - 4);
    for (int64_t c = 0; c < cols; ++c) {
      float v = mag * u();
      if ((r * cols + c) % 997 == 5) v *= 40.0f;
      x[static_cast<size_t>(r * cols + c)] = to_half_bits(v, d);
    }
  }
  return x;
}

// The CPU's quantization of rows of dtype values: bytes and scales (the oracle), checked against
// fake_quantize_fp8_activations on the way.
struct Quantized {
  std::vector<uint8_t> q;
  std::vector<float> scales;
};

Quantized cpu_quantize(const std::vector<uint16_t>& bits, int64_t rows, int64_t cols, DType d,
                       float static_scale) {
  Quantized out;
  out.q.resize(bits.size());
  out.scales.resize(static_cast<size_t>(rows));
  std::vector<float> x(bits.size());
  for (size_t i = 0; i < bits.size(); ++i) x[i] = from_half_bits(bits[i], d);
  std::vector<float> faked = x;
  fake_quantize_fp8_activations(faked, rows, cols, static_scale);
  for (int64_t r = 0; r < rows; ++r) {
    float a = static_scale;
    if (!(a > 0)) {
      float amax = 0.f;
      for (int64_t c = 0; c < cols; ++c) amax = std::max(amax, std::fabs(x[r * cols + c]));
      a = amax > 0 ? amax / 448.0f : 1.0f;
    }
    out.scales[static_cast<size_t>(r)] = a;
    for (int64_t c = 0; c < cols; ++c) {
      const size_t i = static_cast<size_t>(r * cols + c);
      out.q[i] = float_to_fp8_e4m3(x[i] / a);
      EXPECT_EQ(fp8_e4m3_to_float(out.q[i]) * a, faked[i]) << "row " << r << " col " << c;
    }
  }
  return out;
}

// The GPU's bytes and scales against the CPU's, bit for bit.
void expect_same(const Quantized& want, const void* q, const void* scales,
                 const std::string& what) {
  const auto got_q = download<uint8_t>(q, want.q.size());
  const auto got_s = download<float>(scales, want.scales.size());
  size_t bad = 0, first = 0;
  for (size_t i = 0; i < want.q.size(); ++i) {
    if (got_q[i] != want.q[i] && bad++ == 0) first = i;
  }
  EXPECT_EQ(bad, 0u) << what << ": " << bad << " differing E4M3 bytes, first at " << first
                     << " (gpu 0x" << std::hex << int{got_q[first]} << ", cpu 0x"
                     << int{want.q[first]} << std::dec << ")";
  for (size_t r = 0; r < want.scales.size(); ++r) {
    EXPECT_EQ(std::memcmp(&got_s[r], &want.scales[r], 4), 0)
        << what << ": row " << r << " scale gpu " << got_s[r] << " cpu " << want.scales[r];
  }
}

const char* name(DType d) { return d == DType::kBF16 ? "bf16" : "f16"; }

TEST(Fp8Quantize, RowsEqualTheCpusRoundingBitForBit) {
  REQUIRE_CUDA_DEVICE();
  for (DType d : {DType::kBF16, DType::kF16}) {
    for (int64_t rows : {1, 3, 16, 100}) {
      for (int64_t cols : {8, 64, 136, 4096}) {
        for (float st : {0.0f, 0.002f}) {
          const std::string what = std::string(name(d)) + " " + std::to_string(rows) + "x" +
                                   std::to_string(cols) + " static " + std::to_string(st);
          const auto x = make_rows(rows, cols, d, static_cast<uint64_t>(rows * 7 + cols));
          DeviceBuffer dx = upload(x);
          DeviceBuffer dq = alloc(x.size()), ds = alloc(rows * 4);
          Status s = quantize_fp8_rows(d, dx.get(), rows, cols, st, dq.as<uint8_t>(),
                                       ds.as<float>(), nullptr);
          ASSERT_TRUE(s.is_ok()) << s.to_string();
          ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
          expect_same(cpu_quantize(x, rows, cols, d, st), dq.get(), ds.get(), what);
        }
      }
    }
  }
}

TEST(Fp8Quantize, RefusesWidthsThatAreNotVectorsAndBadScales) {
  REQUIRE_CUDA_DEVICE();
  DeviceBuffer x = alloc(4096), q = alloc(4096), s = alloc(256);
  EXPECT_FALSE(
      quantize_fp8_rows(DType::kBF16, x.get(), 2, 12, 0.f, q.as<uint8_t>(), s.as<float>(), nullptr)
          .is_ok());
  EXPECT_FALSE(
      quantize_fp8_rows(DType::kBF16, x.get(), 2, 16, -1.f, q.as<uint8_t>(), s.as<float>(), nullptr)
          .is_ok());
  EXPECT_FALSE(
      quantize_fp8_rows(DType::kF32, x.get(), 2, 16, 0.f, q.as<uint8_t>(), s.as<float>(), nullptr)
          .is_ok());
}

// rms_norm_fp8 (and with a residual, add_rms_norm's) = the plain GPU norm, then the CPU's
// quantization of its output; the residual it writes = add_rms_norm's. Hidden sizes cover the
// norm kernel's 1, 2, 4 and 8 vectors per thread.
TEST(Fp8Quantize, FusedRmsNormEqualsRmsNormThenQuantization) {
  REQUIRE_CUDA_DEVICE();
  for (DType d : {DType::kBF16, DType::kF16}) {
    for (int64_t hidden : {64, 1000, 4096, 8192, 16384, 20480}) {
      for (int64_t rows : {1, 3, 100}) {
        for (bool add : {false, true}) {
          for (float st : {0.0f, 0.01f}) {
            const std::string what = std::string(name(d)) + " hidden " + std::to_string(hidden) +
                                     " rows " + std::to_string(rows) + (add ? " add" : "") +
                                     " static " + std::to_string(st);
            const auto x = make_rows(rows, hidden, d, static_cast<uint64_t>(hidden + rows));
            const auto res = make_rows(rows, hidden, d, static_cast<uint64_t>(hidden * 3 + 1));
            std::vector<uint16_t> w(static_cast<size_t>(hidden));
            Uniform u{static_cast<uint64_t>(hidden)};
            for (auto& v : w) v = to_half_bits(1.0f + 0.5f * u(), d);
            DeviceBuffer dx = upload(x), dw = upload(w), dres1 = upload(res), dres2 = upload(res);
            DeviceBuffer dout = alloc(x.size() * 2), dq = alloc(x.size()), ds = alloc(rows * 4);
            const float eps = 1e-5f;
            Status s =
                add ? add_rms_norm(d, dx.get(), dres1.get(), dw.get(), rows, hidden, eps,
                                   dout.get(), nullptr)
                    : rms_norm(d, dx.get(), dw.get(), rows, hidden, eps, dout.get(), nullptr);
            ASSERT_TRUE(s.is_ok()) << s.to_string();
            s = rms_norm_fp8(d, dx.get(), add ? dres2.get() : nullptr, dw.get(), rows, hidden, eps,
                             st, dq.as<uint8_t>(), ds.as<float>(), nullptr);
            ASSERT_TRUE(s.is_ok()) << s.to_string();
            ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
            const auto normed = download<uint16_t>(dout.get(), x.size());
            const Quantized want = cpu_quantize(normed, rows, hidden, d, st);
            expect_same(want, dq.get(), ds.get(), what);
            if (add) {
              EXPECT_EQ(download<uint16_t>(dres1.get(), x.size()),
                        download<uint16_t>(dres2.get(), x.size()))
                  << what << ": residual";
            }
            // Against a double-precision RMSNorm of the (rounded) input: E4M3's half step
            // (2^-4 relative; 2^-10 a below its normals) and two dtype roundings. Dynamic
            // scales only (a static one saturates this input's outliers, as it should).
            if (st > 0) continue;
            const auto h = add ? download<uint16_t>(dres2.get(), x.size()) : x;
            const double u_dt = d == DType::kBF16 ? 1.0 / 256 : 1.0 / 2048;
            double worst = 0;
            for (int64_t r = 0; r < rows; ++r) {
              double ss = 0;
              for (int64_t c = 0; c < hidden; ++c) {
                const double v = from_half_bits(h[r * hidden + c], d);
                ss += v * v;
              }
              const double inv = 1.0 / std::sqrt(ss / hidden + eps);
              const double a = want.scales[r];
              for (int64_t c = 0; c < hidden; ++c) {
                const double ref =
                    from_half_bits(h[r * hidden + c], d) * inv * from_half_bits(w[c], d);
                const double got = fp8_e4m3_to_float(want.q[r * hidden + c]) * a;
                const double bound = (1.0 / 16 + 3 * u_dt) * std::fabs(ref) + a / 1024;
                worst = std::max(worst, std::fabs(got - ref) / bound);
              }
            }
            EXPECT_LE(worst, 1.0) << what << " vs the double-precision norm";
          }
        }
      }
    }
  }
}

TEST(Fp8Quantize, FusedSiluMulEqualsSiluMulThenQuantization) {
  REQUIRE_CUDA_DEVICE();
  for (DType d : {DType::kBF16, DType::kF16}) {
    for (int64_t inter : {16, 176, 14336, 28672, 40000}) {
      for (int64_t rows : {1, 3, 100}) {
        for (float st : {0.0f, 0.003f}) {
          const std::string what = std::string(name(d)) + " inter " + std::to_string(inter) +
                                   " rows " + std::to_string(rows) + " static " +
                                   std::to_string(st);
          const auto gu = make_rows(rows, 2 * inter, d, static_cast<uint64_t>(inter + rows));
          DeviceBuffer dgu = upload(gu), dout = alloc(rows * inter * 2);
          DeviceBuffer dq = alloc(rows * inter), ds = alloc(rows * 4);
          Status s = silu_mul(d, dgu.get(), rows, inter, dout.get(), nullptr);
          ASSERT_TRUE(s.is_ok()) << s.to_string();
          s = silu_mul_fp8(d, dgu.get(), rows, inter, st, dq.as<uint8_t>(), ds.as<float>(),
                           nullptr);
          ASSERT_TRUE(s.is_ok()) << s.to_string();
          ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
          const auto act = download<uint16_t>(dout.get(), static_cast<size_t>(rows * inter));
          expect_same(cpu_quantize(act, rows, inter, d, st), dq.get(), ds.get(), what);
        }
      }
    }
  }
}

// --quantization fp8 at load: quantize_fp8's bytes and scale, from each stored dtype, for an
// all-zero weight (scale 1) too.
TEST(Fp8Quantize, OnlineWeightQuantizerEqualsQuantizeFp8) {
  REQUIRE_CUDA_DEVICE();
  DeviceBuffer amax = alloc(4);
  for (DType d : {DType::kF32, DType::kF16, DType::kBF16}) {
    for (auto [out, in] : {std::pair<int64_t, int64_t>{48, 64}, {1024, 4096}, {3, 5}}) {
      for (bool zero : {false, true}) {
        const size_t n = static_cast<size_t>(out * in);
        std::vector<uint8_t> bytes(n * dtype_size(d));
        Uniform u{static_cast<uint64_t>(out * 31 + in)};
        for (size_t i = 0; i < n; ++i) {
          float v = zero ? 0.0f : 0.05f * u() * (i % 1013 == 7 ? 30.0f : 1.0f);
          if (d == DType::kF32) {
            std::memcpy(bytes.data() + i * 4, &v, 4);
          } else {
            const uint16_t h = to_half_bits(v, d);
            std::memcpy(bytes.data() + i * 2, &h, 2);
          }
        }
        const TensorView view{bytes.data(), d, {out, in}};
        const Fp8Weight want = quantize_fp8(view);
        DeviceBuffer dw = upload(bytes), dq = alloc(n), ds = alloc(out * 4);
        Status s = quantize_fp8_weight(d, dw.get(), out, in, dq.as<uint8_t>(), ds.as<float>(),
                                       amax.as<uint32_t>(), nullptr);
        ASSERT_TRUE(s.is_ok()) << s.to_string();
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        const std::string what = std::string(dtype_name(d)) + " [" + std::to_string(out) + ", " +
                                 std::to_string(in) + "]" + (zero ? " zero" : "");
        EXPECT_EQ(download<uint8_t>(dq.get(), n), want.data) << what;
        for (float got : download<float>(ds.get(), static_cast<size_t>(out))) {
          EXPECT_EQ(std::memcmp(&got, &want.scale, 4), 0)
              << what << ": scale " << got << " vs " << want.scale;
        }
      }
    }
  }
}

// ---- the GEMM ----

struct GemmCase {
  int64_t m, n, k;
  bool per_channel, bias;
  DType d;
};

// Runs one case through `g` and checks it against the double-precision reference.
void check_gemm(Fp8Gemm& g, const GemmCase& c, uint64_t seed) {
  const std::string what =
      std::string(fp8_gemm_path_name(g.path())) + " " + name(c.d) + " m=" + std::to_string(c.m) +
      " n=" + std::to_string(c.n) + " k=" + std::to_string(c.k) +
      (c.per_channel ? " per-channel" : " per-tensor") + (c.bias ? " +bias" : "");
  Uniform u{seed};
  std::vector<uint8_t> xq(static_cast<size_t>(c.m * c.k)), wq(static_cast<size_t>(c.n * c.k));
  std::vector<float> a(static_cast<size_t>(c.m)), s(static_cast<size_t>(c.n));
  for (auto& v : xq) v = float_to_fp8_e4m3(300.0f * u());
  for (auto& v : wq) v = float_to_fp8_e4m3(400.0f * u());
  for (int64_t i = 0; i < c.m; ++i) a[i] = (0.5f + std::fabs(u())) / 448.0f;
  const float tensor_scale = (0.2f + std::fabs(u())) / 448.0f;
  for (int64_t i = 0; i < c.n; ++i) {
    s[i] = c.per_channel ? (0.1f + std::fabs(u())) / 448.0f : tensor_scale;
  }
  std::vector<uint16_t> bias(static_cast<size_t>(c.n));
  for (auto& v : bias) v = to_half_bits(0.5f * u(), c.d);
  DeviceBuffer dx = upload(xq), dw = upload(wq), da = upload(a), ds = upload(s);
  DeviceBuffer db = upload(bias), dout = alloc(c.m * c.n * 2);
  Fp8GemmArgs args;
  args.m = c.m;
  args.n = c.n;
  args.k = c.k;
  args.out_dtype = c.d;
  args.x = dx.as<uint8_t>();
  args.x_scales = da.as<float>();
  args.w = dw.as<uint8_t>();
  args.w_scales = ds.as<float>();
  args.bias = c.bias ? db.get() : nullptr;
  args.out = dout.get();
  args.small_m_kernel = false;  // cuBLASLt at m = 1 and 3 too: the Fp8GemvTest cases test the other
  Status st = g.linear(args, nullptr);
  ASSERT_TRUE(st.is_ok()) << what << ": " << st.to_string();
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess) << what;
  const auto got = download<uint16_t>(dout.get(), static_cast<size_t>(c.m * c.n));
  const double unit = c.d == DType::kBF16 ? 1.0 / 256 : 1.0 / 2048;
  // The scaled operands once (exact in double), then each output's dot product and its bound,
  // the outputs spread over the host's cores (m = 100 x 1024 x 4096 is 0.4 G products).
  std::vector<double> xs(xq.size()), ws(wq.size());
  for (size_t i = 0; i < xq.size(); ++i) {
    xs[i] = static_cast<double>(fp8_e4m3_to_float(xq[i])) * a[i / static_cast<size_t>(c.k)];
  }
  for (size_t i = 0; i < wq.size(); ++i) {
    ws[i] = static_cast<double>(fp8_e4m3_to_float(wq[i])) * s[i / static_cast<size_t>(c.k)];
  }
  std::vector<double> ratios(static_cast<size_t>(c.m * c.n));
  auto rows = [&](int64_t first, int64_t last) {
    for (int64_t at = first; at < last; ++at) {
      const int64_t m = at / c.n, n = at % c.n;
      double ref = 0, abs_sum = 0;
      for (int64_t k = 0; k < c.k; ++k) {
        const double t = xs[m * c.k + k] * ws[n * c.k + k];
        ref += t;
        abs_sum += std::fabs(t);
      }
      if (c.bias) ref += from_half_bits(bias[n], c.d);
      const double y = from_half_bits(got[at], c.d);
      const double bound = unit * std::fabs(ref) + std::ldexp(abs_sum, -13) + 1e-30;
      const double ratio = std::fabs(y - ref) / bound;
      ratios[at] = std::isnan(ratio) ? 1e30 : ratio;
    }
  };
  const int64_t total = c.m * c.n;
  const int64_t threads = std::clamp<int64_t>(std::thread::hardware_concurrency(), 1, 32);
  std::vector<std::thread> pool;
  for (int64_t t = 0; t < threads; ++t) {
    pool.emplace_back(rows, total * t / threads, total * (t + 1) / threads);
  }
  for (auto& t : pool) t.join();
  const auto worst_it = std::max_element(ratios.begin(), ratios.end());
  const double worst = *worst_it;
  const int64_t worst_at = worst_it - ratios.begin();
  EXPECT_LE(worst, 1.0) << what << ": worst at [" << worst_at / c.n << ", " << worst_at % c.n
                        << "]";
  if (c.m == 100 && c.k == 4096)
    std::printf("[fp8 gemm] %s: worst |y - ref| / bound %.3f\n", what.c_str(), worst);
}

std::vector<GemmCase> gemm_cases() {
  std::vector<GemmCase> cases;
  for (DType d : {DType::kBF16, DType::kF16}) {
    for (int64_t m : {1, 3, 16, 100}) {
      for (auto [n, k] :
           {std::pair<int64_t, int64_t>{16, 16}, {96, 160}, {352, 64}, {1024, 4096}}) {
        for (bool per_channel : {false, true}) {
          for (bool bias : {false, true}) cases.push_back({m, n, k, per_channel, bias, d});
        }
      }
    }
  }
  return cases;
}

void run_gemm_cases(Fp8GemmPath path, int64_t max_n) {
  for (DType d : {DType::kBF16, DType::kF16}) {
    auto g = Fp8Gemm::create(path, 100, max_n, d, nullptr);
    ASSERT_TRUE(g) << fp8_gemm_path_name(path) << ": " << g.status().to_string();
    EXPECT_EQ((*g)->path(), path);
    uint64_t seed = 1;
    for (const GemmCase& c : gemm_cases()) {
      if (c.d == d) check_gemm(**g, c, seed++);
    }
  }
}

TEST(Fp8GemmTest, EpilogueTracksTheDequantizedProduct) {
  REQUIRE_CUDA_DEVICE();
  run_gemm_cases(Fp8GemmPath::kEpilogue, 4096);
}

// max_n of a million: the fp32 scratch holds 16 rows, so m = 100 runs in 7 chunks.
TEST(Fp8GemmTest, EpilogueInChunksOfRows) {
  REQUIRE_CUDA_DEVICE();
  run_gemm_cases(Fp8GemmPath::kEpilogue, 1 << 20);
}

// cuBLASLt's outer-vector scaling where this cuBLASLt has it (auto's probe passes); where it
// does not (CUDA 13.0 on the H200: the heuristic answers CUBLAS_STATUS_INVALID_VALUE), auto
// falls back to the epilogue with the reason, and forcing outer-vector is a clear
// FAILED_PRECONDITION naming it.
TEST(Fp8GemmTest, OuterVectorTracksTheDequantizedProduct) {
  REQUIRE_CUDA_DEVICE();
  auto probe = Fp8Gemm::create(Fp8GemmPath::kAuto, 16, 64, DType::kBF16, nullptr);
  ASSERT_TRUE(probe) << probe.status().to_string();
  std::printf("[fp8 gemm] auto picks %s%s%s\n", fp8_gemm_path_name((*probe)->path()),
              (*probe)->probe_failure().empty() ? "" : ": ", (*probe)->probe_failure().c_str());
  if ((*probe)->path() == Fp8GemmPath::kEpilogue) {
    EXPECT_FALSE((*probe)->probe_failure().empty());
    auto forced = Fp8Gemm::create(Fp8GemmPath::kOuterVector, 16, 64, DType::kBF16, nullptr);
    ASSERT_FALSE(forced);
    EXPECT_EQ(forced.status().code(), Code::kFailedPrecondition);
    EXPECT_NE(forced.status().to_string().find("outer-vector"), std::string::npos)
        << forced.status().to_string();
    return;
  }
  EXPECT_EQ((*probe)->path(), Fp8GemmPath::kOuterVector);
  run_gemm_cases(Fp8GemmPath::kOuterVector, 4096);
}

TEST(Fp8GemmTest, RefusesShapesAndPointersItCannotTake) {
  REQUIRE_CUDA_DEVICE();
  auto g = Fp8Gemm::create(Fp8GemmPath::kEpilogue, 16, 64, DType::kBF16, nullptr);
  ASSERT_TRUE(g) << g.status().to_string();
  DeviceBuffer buf = alloc(1 << 16);
  Fp8GemmArgs a;
  a.m = 2;
  a.n = 32;
  a.k = 24;  // not a multiple of 16
  a.x = a.w = buf.as<uint8_t>();
  a.x_scales = a.w_scales = buf.as<float>();
  a.out = buf.as<char>() + 8192;
  EXPECT_EQ((*g)->linear(a, nullptr).code(), Code::kInvalidArgument);
  a.k = 32;
  a.x = buf.as<uint8_t>() + 8;  // not 16-byte aligned
  EXPECT_EQ((*g)->linear(a, nullptr).code(), Code::kInvalidArgument);
  EXPECT_FALSE(parse_fp8_gemm_path("fast"));
  EXPECT_EQ(*parse_fp8_gemm_path("epilogue"), Fp8GemmPath::kEpilogue);
}

// ---- the small-m kernel ----

// Runs fn(first, last) over [0, total) split between the host's cores.
void parallel_for(int64_t total, const std::function<void(int64_t, int64_t)>& fn) {
  const int64_t threads = std::clamp<int64_t>(std::thread::hardware_concurrency(), 1, 32);
  std::vector<std::thread> pool;
  for (int64_t t = 0; t < threads; ++t) {
    pool.emplace_back(fn, total * t / threads, total * (t + 1) / threads);
  }
  for (auto& t : pool) t.join();
}

// Random E4M3 bytes over every finite code (zero and magnitudes 2^-9 .. 448, both signs: the
// subnormals too); the NaN codes 0x7f / 0xff become +-448 (0x7e / 0xfe).
std::vector<uint8_t> random_e4m3(int64_t count, uint64_t seed) {
  std::vector<uint8_t> v(static_cast<size_t>(count));
  parallel_for((count + 7) / 8, [&](int64_t first, int64_t last) {
    for (int64_t i = first; i < last; ++i) {
      uint64_t z = (seed + static_cast<uint64_t>(i)) * 0x9E3779B97F4A7C15ull;
      z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
      z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
      z ^= z >> 31;
      for (int64_t b = 0; b < 8 && i * 8 + b < count; ++b) {
        uint8_t byte = static_cast<uint8_t>(z >> (8 * b));
        if ((byte & 0x7f) == 0x7f) byte ^= 1;
        v[static_cast<size_t>(i * 8 + b)] = byte;
      }
    }
  });
  return v;
}

// E4M3 operands on both sides: rows of x [rows, k] with their scales (`rows` x or w).
struct Fp8Operand {
  int64_t rows = 0, k = 0;
  std::vector<uint8_t> q;
  std::vector<float> scales;
  DeviceBuffer dq, dscales;
};

Fp8Operand make_operand(int64_t rows, int64_t k, float min_scale, uint64_t seed) {
  Fp8Operand o;
  o.rows = rows;
  o.k = k;
  o.q = random_e4m3(rows * k, seed);
  Uniform u{seed ^ 0x5555};
  o.scales.resize(static_cast<size_t>(rows));
  for (float& s : o.scales) s = (min_scale + std::fabs(u())) / 448.0f;
  o.dq = upload(o.q);
  o.dscales = upload(o.scales);
  return o;
}

// The exact dot products of x's and w's rows (E4M3 products are exact in double; a sum of k of
// them errs by k 2^-53 at most) and the sums of their magnitudes, unscaled: [x.rows, w.rows].
struct Dots {
  std::vector<double> dot, abs;
};

Dots exact_dots(const Fp8Operand& x, const Fp8Operand& w) {
  double value[256];
  for (int b = 0; b < 256; ++b) value[b] = fp8_e4m3_to_float(static_cast<uint8_t>(b));
  Dots d;
  d.dot.resize(static_cast<size_t>(x.rows * w.rows));
  d.abs.resize(d.dot.size());
  parallel_for(x.rows * w.rows, [&](int64_t first, int64_t last) {
    for (int64_t at = first; at < last; ++at) {
      const uint8_t* xr = x.q.data() + (at / w.rows) * x.k;
      const uint8_t* wr = w.q.data() + (at % w.rows) * w.k;
      double dot = 0, abs = 0;
      for (int64_t k = 0; k < x.k; ++k) {
        const double t = value[xr[k]] * value[wr[k]];
        dot += t;
        abs += std::fabs(t);
      }
      d.dot[static_cast<size_t>(at)] = dot;
      d.abs[static_cast<size_t>(at)] = abs;
    }
  });
  return d;
}

struct Fp8Run {
  DType d = DType::kBF16;
  const DeviceBuffer* bias = nullptr;  // [n] of d, or null
  bool small_m = true;                 // Fp8GemmArgs::small_m_kernel
};

Fp8GemmArgs fp8_args(const Fp8Operand& x, const Fp8Operand& w, const Fp8Run& r, void* out) {
  Fp8GemmArgs a;
  a.m = x.rows;
  a.n = w.rows;
  a.k = w.k;
  a.out_dtype = r.d;
  a.x = x.dq.as<uint8_t>();
  a.x_scales = x.dscales.as<float>();
  a.w = w.dq.as<uint8_t>();
  a.w_scales = w.dscales.as<float>();
  a.bias = r.bias != nullptr ? r.bias->get() : nullptr;
  a.out = out;
  a.small_m_kernel = r.small_m;
  return a;
}

// out = linear(x, w) through `g`, eagerly; the output's bits.
std::vector<uint16_t> run_fp8(Fp8Gemm& g, const Fp8Operand& x, const Fp8Operand& w,
                              const Fp8Run& r) {
  DeviceBuffer out = alloc(static_cast<size_t>(x.rows * w.rows) * 2);
  Status st = g.linear(fp8_args(x, w, r, out.get()), nullptr);
  EXPECT_TRUE(st.is_ok()) << st.to_string();
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  return download<uint16_t>(out.get(), static_cast<size_t>(x.rows * w.rows));
}

// The reference of output `at` (= t * n + j) in double, and the bound on an fp32 sum of its
// products in units of S (`acc`) plus the output's rounding: u |ref| (and half a subnormal step).
struct Reference {
  const Fp8Operand& x;
  const Fp8Operand& w;
  const Dots& dots;
  DType d;
  const std::vector<uint16_t>* bias;  // host bits, or null
  double value(int64_t at) const {
    const int64_t t = at / w.rows, j = at % w.rows;
    const double scale =
        static_cast<double>(x.scales[static_cast<size_t>(t)]) * w.scales[static_cast<size_t>(j)];
    const double b = bias != nullptr ? from_half_bits((*bias)[static_cast<size_t>(j)], d) : 0.0;
    return dots.dot[static_cast<size_t>(at)] * scale + b;
  }
  double bound(int64_t at, double acc) const {
    const int64_t t = at / w.rows, j = at % w.rows;
    const double s_abs = dots.abs[static_cast<size_t>(at)] * x.scales[static_cast<size_t>(t)] *
                         w.scales[static_cast<size_t>(j)];
    const double unit = d == DType::kBF16 ? 1.0 / 256 : 1.0 / 2048;
    const double tiny = d == DType::kBF16 ? 0x1p-133 : 0x1p-25;
    return unit * std::fabs(value(at)) + acc * s_abs + tiny;
  }
};

// The worst |y - ref| / bound over the outputs, and where.
std::pair<double, int64_t> worst_error(const Reference& ref, const std::vector<uint16_t>& got,
                                       double acc) {
  std::vector<double> ratio(got.size());
  parallel_for(static_cast<int64_t>(got.size()), [&](int64_t first, int64_t last) {
    for (int64_t at = first; at < last; ++at) {
      const double y = from_half_bits(got[static_cast<size_t>(at)], ref.d);
      const double r = std::fabs(y - ref.value(at)) / ref.bound(at, acc);
      ratio[static_cast<size_t>(at)] = std::isnan(r) ? 1e30 : r;
    }
  });
  const auto it = std::max_element(ratio.begin(), ratio.end());
  return {*it, it - ratio.begin()};
}

constexpr double kGemvAcc = 1e-5;         // the small-m kernel's fp32 sums, in units of S
// cuBLASLt's FP8 tensor-core sums (file comment). Twice the file comment's 2^-13: with inputs
// over every finite E4M3 code (subnormals to 448) an f16 output at k = 272 erred by 1.06 of it
// on the H200, the partial sums' ~14 kept bits being a bound, not a guarantee per rounding.
constexpr double kCublasLtAcc = 0x1p-12;

std::vector<uint16_t> random_bias(int64_t n, DType d, uint64_t seed) {
  std::vector<uint16_t> bias(static_cast<size_t>(n));
  Uniform u{seed};
  for (auto& v : bias) v = to_half_bits(0.5f * u(), d);
  return bias;
}

std::string shape_name(int64_t m, int64_t n, int64_t k, DType d, bool bias) {
  return std::string(name(d)) + " m=" + std::to_string(m) + " n=" + std::to_string(n) +
         " k=" + std::to_string(k) + (bias ? " +bias" : "");
}

// Every m up to kFp8GemvMaxM, both dtypes, with and without a bias, against the exact sum.
void check_gemv_shape(Fp8Gemm& g, int64_t n, int64_t k, uint64_t seed) {
  const Fp8Operand w = make_operand(n, k, 0.1f, seed);
  double worst = 0;
  for (int64_t m = 1; m <= kFp8GemvMaxM; ++m) {
    const Fp8Operand x = make_operand(m, k, 0.5f, seed * 31 + static_cast<uint64_t>(m));
    const Dots dots = exact_dots(x, w);
    for (DType d : {DType::kBF16, DType::kF16}) {
      const std::vector<uint16_t> bias = random_bias(n, d, seed + 7);
      const DeviceBuffer dbias = upload(bias);
      for (bool with_bias : {false, true}) {
        const Fp8Run run{d, with_bias ? &dbias : nullptr, true};
        const auto got = run_fp8(g, x, w, run);
        const Reference ref{x, w, dots, d, with_bias ? &bias : nullptr};
        const auto [ratio, at] = worst_error(ref, got, kGemvAcc);
        EXPECT_LE(ratio, 1.0) << shape_name(m, n, k, d, with_bias) << ": worst at [" << at / n
                              << ", " << at % n << "]: " << from_half_bits(got[at], d) << " vs "
                              << ref.value(at);
        worst = std::max(worst, ratio);
      }
    }
  }
  std::printf("[fp8 gemv] n=%lld k=%lld: worst |y - ref| / bound %.3f\n", static_cast<long long>(n),
              static_cast<long long>(k), worst);
}

TEST(Fp8GemvTest, TracksTheExactProductAtEveryM) {
  REQUIRE_CUDA_DEVICE();
  auto g = Fp8Gemm::create(Fp8GemmPath::kAuto, 16, 4096, DType::kBF16, nullptr);
  ASSERT_TRUE(g) << g.status().to_string();
  // Tiny, odd (k = 272: lanes past k in the only chunk; n = 48: a CTA with idle warps), several
  // chunks and K-slices, Llama-3's 8B and 70B-like layers, k = 32768, an lm_head-wide n.
  const int64_t shapes[][2] = {{16, 16},      {48, 272},     {96, 1040},   {352, 64},
                               {1024, 4096},  {1024, 14336}, {6144, 4096}, {28672, 4096},
                               {4096, 14336}, {256, 32768},  {128256, 64}};
  uint64_t seed = 11;
  for (const auto& [n, k] : shapes) check_gemv_shape(**g, n, k, seed++);
}

// The small-m kernel and cuBLASLt (the path create() picked) on the same inputs: each within its
// bound of the exact sum, so within the two bounds' sum of each other. The kernel is
// deterministic: a graph replay of the call gives the eager call's bits.
TEST(Fp8GemvTest, AgreesWithCublasLtAndReplaysBitForBit) {
  REQUIRE_CUDA_DEVICE();
  auto g = Fp8Gemm::create(Fp8GemmPath::kAuto, 16, 1 << 15, DType::kBF16, nullptr);
  ASSERT_TRUE(g) << g.status().to_string();
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  const int64_t shapes[][2] = {{48, 272}, {1024, 4096}, {6144, 4096}, {4096, 14336}};
  uint64_t seed = 101;
  for (const auto& [n, k] : shapes) {
    const Fp8Operand w = make_operand(n, k, 0.1f, seed++);
    for (int64_t m = 1; m <= kFp8GemvMaxM; ++m) {
      const Fp8Operand x = make_operand(m, k, 0.5f, seed++);
      const Dots dots = exact_dots(x, w);
      const DType d = m % 2 == 1 ? DType::kBF16 : DType::kF16;
      const bool with_bias = m >= 3;
      const std::vector<uint16_t> bias = random_bias(n, d, seed);
      const DeviceBuffer dbias = upload(bias);
      const std::string what = shape_name(m, n, k, d, with_bias);
      const Fp8Run gemv{d, with_bias ? &dbias : nullptr, true};
      Fp8Run lt = gemv;
      lt.small_m = false;
      const auto y_gemv = run_fp8(**g, x, w, gemv), y_lt = run_fp8(**g, x, w, lt);
      const Reference ref{x, w, dots, d, with_bias ? &bias : nullptr};
      int64_t same = 0, bad = 0;
      for (int64_t at = 0; at < m * n; ++at) {
        const double a = from_half_bits(y_gemv[at], d), b = from_half_bits(y_lt[at], d);
        same += y_gemv[at] == y_lt[at];
        bad += std::fabs(a - b) > ref.bound(at, kGemvAcc) + ref.bound(at, kCublasLtAcc);
      }
      EXPECT_EQ(bad, 0) << what << ": outputs apart by more than the two bounds";
      EXPECT_LE(worst_error(ref, y_lt, kCublasLtAcc).first, 1.0) << what << " (cuBLASLt)";
      std::printf("[fp8 gemv] %s: %.1f%% of the outputs equal cuBLASLt's bit for bit\n",
                  what.c_str(), 100.0 * static_cast<double>(same) / static_cast<double>(m * n));
      // The same call captured into a graph and replayed twice.
      DeviceBuffer out = alloc(static_cast<size_t>(m * n) * 2);
      ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), cudaSuccess);
      Status st = (*g)->linear(fp8_args(x, w, gemv, out.get()), stream);
      cudaGraph_t graph = nullptr;
      ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
      ASSERT_TRUE(st.is_ok()) << what << ": " << st.to_string();
      cudaGraphExec_t exec = nullptr;
      ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
      for (int replay = 0; replay < 2; ++replay) {
        ASSERT_EQ(cudaMemsetAsync(out.get(), 0xff, out.bytes(), stream), cudaSuccess);
        ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
        ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
        EXPECT_EQ(download<uint16_t>(out.get(), static_cast<size_t>(m * n)), y_gemv)
            << what << ": graph replay " << replay;
      }
      EXPECT_EQ(cudaGraphExecDestroy(exec), cudaSuccess);
      EXPECT_EQ(cudaGraphDestroy(graph), cudaSuccess);
    }
  }
  EXPECT_EQ(cudaStreamDestroy(stream), cudaSuccess);
}

// The time per call of call(i) in microseconds: `calls` calls captured into a graph (after an
// eager first one: a cuBLASLt shape is planned outside the capture), one warm-up replay, then
// five timed.
double time_graph(cudaStream_t stream, int64_t calls, const std::function<Status(int64_t)>& call) {
  Status first = call(0);
  EXPECT_TRUE(first.is_ok()) << first.to_string();
  EXPECT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), cudaSuccess);
  for (int64_t i = 0; i < calls; ++i) {
    Status st = call(i);
    EXPECT_TRUE(st.is_ok()) << st.to_string();
  }
  cudaGraph_t graph = nullptr;
  EXPECT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  cudaGraphExec_t exec = nullptr;
  EXPECT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  EXPECT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
  cudaEvent_t start = nullptr, stop = nullptr;
  EXPECT_EQ(cudaEventCreate(&start), cudaSuccess);
  EXPECT_EQ(cudaEventCreate(&stop), cudaSuccess);
  constexpr int kReplays = 5;
  EXPECT_EQ(cudaEventRecord(start, stream), cudaSuccess);
  for (int r = 0; r < kReplays; ++r) EXPECT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
  EXPECT_EQ(cudaEventRecord(stop, stream), cudaSuccess);
  EXPECT_EQ(cudaEventSynchronize(stop), cudaSuccess);
  float ms = 0;
  EXPECT_EQ(cudaEventElapsedTime(&ms, start, stop), cudaSuccess);
  EXPECT_EQ(cudaEventDestroy(start), cudaSuccess);
  EXPECT_EQ(cudaEventDestroy(stop), cudaSuccess);
  EXPECT_EQ(cudaGraphExecDestroy(exec), cudaSuccess);
  EXPECT_EQ(cudaGraphDestroy(graph), cudaSuccess);
  return 1000.0 * ms / static_cast<double>(kReplays * calls);
}

// Copies of `bytes` at `src` (the first is src itself) so that a graph cycling through them
// reads ~256 MB, far beyond the L2: the weights come from HBM, as a model's layers do.
std::vector<const void*> weight_copies(const void* src, uint64_t bytes,
                                       std::vector<DeviceBuffer>& keep) {
  const auto copies = std::clamp<uint64_t>(((256ull << 20) + bytes - 1) / bytes, 1, 32);
  std::vector<const void*> ptrs{src};
  for (uint64_t c = 1; c < copies; ++c) {
    keep.push_back(alloc(bytes));
    EXPECT_EQ(cudaMemcpy(keep.back().get(), src, bytes, cudaMemcpyDeviceToDevice), cudaSuccess);
    ptrs.push_back(keep.back().get());
  }
  return ptrs;
}

// Llama-3-8B's layers at m = 1 (decode): the small-m kernel, cuBLASLt's FP8 path (on the same
// Fp8Gemm) and a bf16 GEMM of the same shape, each as GB/s of the weight bytes it reads (n k
// for FP8, 2 n k for bf16). Asserts only that both FP8 paths meet their bounds here.
TEST(Fp8GemvTest, DecodeBandwidth) {
  REQUIRE_CUDA_DEVICE();
  auto g = Fp8Gemm::create(Fp8GemmPath::kAuto, 16, 1 << 15, DType::kBF16, nullptr);
  ASSERT_TRUE(g) << g.status().to_string();
  auto bf16 = Gemm::create();
  ASSERT_TRUE(bf16) << bf16.status().to_string();
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  const int64_t shapes[][2] = {{6144, 4096}, {4096, 4096}, {28672, 4096}, {4096, 14336}};
  uint64_t seed = 1001;
  for (const auto& [n, k] : shapes) {
    const Fp8Operand w = make_operand(n, k, 0.1f, seed++), x = make_operand(1, k, 0.5f, seed++);
    const Dots dots = exact_dots(x, w);
    const Reference ref{x, w, dots, DType::kBF16, nullptr};
    const std::string what = shape_name(1, n, k, DType::kBF16, false);
    const Fp8Run gemv{DType::kBF16, nullptr, true}, lt{DType::kBF16, nullptr, false};
    EXPECT_LE(worst_error(ref, run_fp8(**g, x, w, gemv), kGemvAcc).first, 1.0) << what;
    EXPECT_LE(worst_error(ref, run_fp8(**g, x, w, lt), kCublasLtAcc).first, 1.0) << what;

    std::vector<DeviceBuffer> keep;
    const auto fp8_w = weight_copies(w.dq.get(), static_cast<uint64_t>(n * k), keep);
    DeviceBuffer out = alloc(static_cast<size_t>(n) * 2);
    auto fp8_call = [&](const Fp8Run& run) {
      return [&, run](int64_t i) {
        Fp8GemmArgs a = fp8_args(x, w, run, out.get());
        a.w = static_cast<const uint8_t*>(fp8_w[static_cast<size_t>(i) % fp8_w.size()]);
        return (*g)->linear(a, stream);
      };
    };
    const auto calls = std::max<int64_t>(static_cast<int64_t>(fp8_w.size()), 20);
    const double us_gemv = time_graph(stream, calls, fp8_call(gemv));
    const double us_lt = time_graph(stream, calls, fp8_call(lt));

    DeviceBuffer wb = alloc(static_cast<size_t>(n * k) * 2), xb = alloc(static_cast<size_t>(k) * 2);
    ASSERT_EQ(cudaMemset(wb.get(), 0, wb.bytes()), cudaSuccess);
    ASSERT_EQ(cudaMemset(xb.get(), 0, xb.bytes()), cudaSuccess);
    const auto bf16_w = weight_copies(wb.get(), static_cast<uint64_t>(n * k) * 2, keep);
    const GemmShape shape{1, n, k, DType::kBF16, DType::kBF16, false};
    const double us_bf16 = time_graph(
        stream, std::max<int64_t>(static_cast<int64_t>(bf16_w.size()), 20), [&](int64_t i) {
          return (*bf16)->linear(shape, xb.get(), bf16_w[static_cast<size_t>(i) % bf16_w.size()],
                                 nullptr, out.get(), stream);
        });
    const double bytes = static_cast<double>(n * k);
    std::printf(
        "[fp8 gemv] m=1 [%6lld x %6lld]: gemv %7.2f us %7.1f GB/s | cuBLASLt fp8 (%s) %7.2f us "
        "%7.1f GB/s | bf16 %7.2f us %7.1f GB/s | gemv %.2fx cuBLASLt fp8, %.2fx bf16\n",
        static_cast<long long>(n), static_cast<long long>(k), us_gemv, bytes / us_gemv / 1e3,
        fp8_gemm_path_name((*g)->path()), us_lt, bytes / us_lt / 1e3, us_bf16,
        2 * bytes / us_bf16 / 1e3, us_lt / us_gemv, us_bf16 / us_gemv);
  }
  EXPECT_EQ(cudaStreamDestroy(stream), cudaSuccess);
}

}  // namespace
}  // namespace tessera::cuda
