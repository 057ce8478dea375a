// cuBLASLt GEMMs against cpu::linear on the same (rounded) bf16/fp16 inputs.
//
// Tolerance per output element, with S = K/4 + 4*sqrt(K) + 1 a bound on sum_k |x_k||w_nk| +
// |bias| for inputs in U(-1, 1) (its mean is K/4, its standard deviation 0.22*sqrt(K)):
//   accumulation: both sides sum K products in fp32 in different orders (tensor-core tiles and
//     split-K on the GPU, eight lanes on the CPU); each side's rounding error is about
//     sqrt(K) * 2^-24 * S as a random walk, allowed 2^-22 * sqrt(K) * S.
//   output rounding: the GPU rounds its fp32 result once into the output type: 2^-8 |ref| for
//     bf16 (a full ulp: its fp32 value differs slightly from ref), 2^-11 |ref| for fp16,
//     2^-20 |ref| for fp32; the accumulation term is doubled for the 16-bit outputs.
//   bias into a 16-bit output: cuBLASLt's bias epilogue may round x.w into the output type before
//     it adds the bias and rounds again (7 of the 8 candidates for m=7 n=33 k=40 on an H100 do,
//     bit for bit), one more rounding of |x.w| <= |ref| + |bias| <= |ref| + 1: allowed the same
//     relative error of |ref| + 1. Where the bias cancels most of x.w this is many ulps of ref.
// Inputs: x, w (and bias) are drawn from U(-1, 1) and rounded to the input dtype first, and the
// reference sees exactly those rounded values.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <tuple>
#include <vector>

#include "common/status.h"
#include "common/tensor.h"
#include "kernels/cpu/cpu_context.h"
#include "kernels/cpu/linear.h"
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

uint16_t to_half_bits(float f, DType d) {
  return d == DType::kBF16 ? float_to_bf16(f) : float_to_f16(f);
}
float from_half_bits(uint16_t h, DType d) {
  return d == DType::kBF16 ? bf16_to_float(h) : f16_to_float(h);
}

// U(-1, 1) from a counter-based hash (fast enough for a 0.5 G-element vocab weight).
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

// A host matrix rounded to a 16-bit dtype, its device copy, and (optionally) its fp32 values.
struct Operand {
  DType dtype = DType::kBF16;
  std::vector<uint16_t> bits;
  std::vector<float> values;  // filled only when keep_floats
  DeviceBuffer dev;
};

void make_operand(Operand* op, int64_t count, DType dtype, uint64_t seed, bool keep_floats) {
  op->dtype = dtype;
  op->bits.resize(static_cast<size_t>(count));
  Uniform u{seed};
  for (auto& b : op->bits) b = to_half_bits(u(), dtype);
  op->values.clear();
  if (keep_floats) {
    op->values.resize(op->bits.size());
    for (size_t i = 0; i < op->bits.size(); ++i) op->values[i] = from_half_bits(op->bits[i], dtype);
  }
  auto buf = DeviceBuffer::allocate(op->bits.size() * 2 + 64, "test operand");
  ASSERT_TRUE(buf.has_value()) << buf.status().to_string();
  op->dev = std::move(buf).value();
  ASSERT_EQ(cudaMemcpy(op->dev.get(), op->bits.data(), op->bits.size() * 2, cudaMemcpyHostToDevice),
            cudaSuccess);
}

// cpu::linear on the first m*k values at `x`, the weight's bits and the bias bits (or null).
std::vector<float> reference(const GemmShape& s, const float* x, const Operand& w,
                             const uint16_t* bias_bits) {
  static cpu::CpuContext ctx;
  std::vector<float> y(static_cast<size_t>(s.m * s.n));
  const TensorView wv{w.bits.data(), w.dtype, {s.n, s.k}};
  const TensorView bv{bias_bits, w.dtype, {s.n}};
  Status st = cpu::linear(ctx, std::span<const float>(x, static_cast<size_t>(s.m * s.k)), wv,
                          bias_bits != nullptr ? &bv : nullptr, y);
  EXPECT_TRUE(st.is_ok()) << st.to_string();
  return y;
}
std::vector<float> reference(const GemmShape& s, const Operand& x, const Operand& w,
                             const Operand* bias) {
  return reference(s, x.values.data(), w, bias != nullptr ? bias->bits.data() : nullptr);
}

// Device output [m, n] of dtype s.out as floats.
std::vector<float> download(const GemmShape& s, const void* out) {
  const size_t count = static_cast<size_t>(s.m * s.n);
  std::vector<float> result(count);
  if (s.out == DType::kF32) {
    EXPECT_EQ(cudaMemcpy(result.data(), out, count * 4, cudaMemcpyDeviceToHost), cudaSuccess);
    return result;
  }
  std::vector<uint16_t> bits(count);
  EXPECT_EQ(cudaMemcpy(bits.data(), out, count * 2, cudaMemcpyDeviceToHost), cudaSuccess);
  for (size_t i = 0; i < count; ++i) result[i] = from_half_bits(bits[i], s.out);
  return result;
}

// Compares every element against the tolerance in the file comment; reports the worst.
void expect_close(const GemmShape& s, const std::vector<float>& gpu, const std::vector<float>& ref,
                  const std::string& what) {
  ASSERT_EQ(gpu.size(), ref.size());
  const double k = static_cast<double>(s.k);
  const double sum_abs = k / 4 + 4 * std::sqrt(k) + 1;
  const double acc = std::ldexp(1.0, -22) * std::sqrt(k) * sum_abs;
  const double rel = s.out == DType::kBF16  ? std::ldexp(1.0, -8)
                     : s.out == DType::kF16 ? std::ldexp(1.0, -11)
                                            : std::ldexp(1.0, -20);
  const double abs_tol = s.out == DType::kF32 ? acc : 2 * acc;
  const bool rounds_product = s.bias && s.out != DType::kF32;
  size_t bad = 0, worst = 0;
  double worst_ratio = 0;
  for (size_t i = 0; i < gpu.size(); ++i) {
    const double err = std::fabs(static_cast<double>(gpu[i]) - ref[i]);
    const double rounded = rounds_product ? std::fabs(ref[i]) + 1 : 0;  // |x.w| at most
    const double tol = rel * (std::fabs(ref[i]) + rounded) + abs_tol;
    const double ratio = std::isfinite(err) ? err / tol : 1e30;
    if (ratio > 1) ++bad;
    if (ratio > worst_ratio) {
      worst_ratio = ratio;
      worst = i;
    }
  }
  EXPECT_EQ(bad, 0u) << what << ": " << bad << " of " << gpu.size()
                     << " elements out of tolerance; worst at [" << worst / s.n << ", "
                     << worst % s.n << "]: gpu " << gpu[worst] << " ref " << ref[worst]
                     << " (error / tolerance = " << worst_ratio << ")";
}

std::string name(const GemmShape& s) {
  return "m=" + std::to_string(s.m) + " n=" + std::to_string(s.n) + " k=" + std::to_string(s.k) +
         " " + dtype_name(s.in) + "->" + dtype_name(s.out) + (s.bias ? " +bias" : "");
}

DeviceBuffer alloc_out(const GemmShape& s, size_t extra = 64) {
  auto buf =
      DeviceBuffer::allocate(static_cast<size_t>(s.m * s.n) * dtype_size(s.out) + extra, "out");
  EXPECT_TRUE(buf.has_value()) << buf.status().to_string();
  return buf.has_value() ? std::move(buf).value() : DeviceBuffer();
}

// Runs one GEMM eagerly on `stream` and checks it against the reference.
void check_linear(Gemm& gemm, const GemmShape& s, const Operand& x, const Operand& w,
                  const Operand* bias, cudaStream_t stream = nullptr) {
  DeviceBuffer out = alloc_out(s);
  ASSERT_NE(out.get(), nullptr);
  Status st =
      gemm.linear(s, x.dev.get(), w.dev.get(), bias ? bias->dev.get() : nullptr, out.get(), stream);
  ASSERT_TRUE(st.is_ok()) << name(s) << ": " << st.to_string();
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  expect_close(s, download(s, out.get()), reference(s, x, w, bias), name(s));
}

std::unique_ptr<Gemm> make_gemm(size_t workspace = 32u << 20, bool autotune = true) {
  auto g = Gemm::create(workspace, autotune);
  EXPECT_TRUE(g.has_value()) << g.status().to_string();
  return g.has_value() ? std::move(g).value() : nullptr;
}

// Decode-like and prefill-like shapes of Llama-3-8B's projections, both input dtypes, with and
// without a bias (the bias on M = 3 and M = 64).
TEST(GemmTest, LlamaShapes) {
  REQUIRE_CUDA_DEVICE();
  auto gemm = make_gemm(32u << 20, /*autotune=*/false);  // the model's default
  ASSERT_NE(gemm, nullptr);
  const int64_t nk[][2] = {{4096, 4096}, {6144, 4096}, {28672, 4096}, {4096, 14336}};
  const int64_t ms[] = {1, 3, 8, 64};
  size_t planned = 0;
  for (DType dt : {DType::kBF16, DType::kF16}) {
    for (const auto& [n, k] : nk) {
      Operand w, bias;
      make_operand(&w, n * k, dt, 1000 + n + k, false);
      make_operand(&bias, n, dt, 7 + n, false);
      for (int64_t m : ms) {
        Operand x;
        make_operand(&x, m * k, dt, 31 * m + k, true);
        const bool with_bias = m == 3 || m == 64;
        GemmShape s{m, n, k, dt, dt, with_bias};
        check_linear(*gemm, s, x, w, with_bias ? &bias : nullptr);
        planned += !gemv_takes(m, n, k, dt, dt, x.dev.get(), w.dev.get());
      }
    }
  }
  // M = 1 of every weight took the GEMV (kernels/cuda/gemv.h): no plan.
  EXPECT_EQ(planned, 2u * 4u * 3u);
  EXPECT_EQ(gemm->cached_shapes(), planned);
}

// The lm_head: a 128256-word vocabulary with fp32 logits.
TEST(GemmTest, VocabLogitsF32) {
  REQUIRE_CUDA_DEVICE();
  auto gemm = make_gemm();
  ASSERT_NE(gemm, nullptr);
  const int64_t n = 128256, k = 4096;
  Operand w;
  make_operand(&w, n * k, DType::kBF16, 99, false);
  for (int64_t m : {1, 5}) {
    Operand x;
    make_operand(&x, m * k, DType::kBF16, 5 + m, true);
    check_linear(*gemm, GemmShape{m, n, k, DType::kBF16, DType::kF32, false}, x, w, nullptr);
  }
}

// x [m, k], w [n, k] and a bias [n] of dtype `in`, seeded by their shape.
std::tuple<Operand, Operand, Operand> seeded_operands(int64_t m, int64_t n, int64_t k, DType in) {
  std::tuple<Operand, Operand, Operand> ops;
  make_operand(&std::get<0>(ops), m * k, in, 11 + m * k, true);
  make_operand(&std::get<1>(ops), n * k, in, 13 + n * k, false);
  make_operand(&std::get<2>(ops), n, in, 17 + n, false);
  return ops;
}

// Small, odd shapes for every dtype combination, bias on and off. K = 40 keeps rows 16-byte
// aligned (80 bytes); K = 36 (72-byte rows) and K = 9 (18-byte rows) do not, so cuBLASLt must
// pick kernels that accept those leading dimensions.
TEST(GemmTest, SmallOddShapes) {
  REQUIRE_CUDA_DEVICE();
  auto gemm = make_gemm();
  ASSERT_NE(gemm, nullptr);
  const int64_t shapes[][3] = {{7, 33, 40}, {7, 33, 36}, {5, 17, 9}, {1, 1, 1}, {130, 70, 200}};
  for (DType in : {DType::kBF16, DType::kF16}) {
    for (const auto& [m, n, k] : shapes) {
      const auto [x, w, bias] = seeded_operands(m, n, k, in);
      check_linear(*gemm, GemmShape{m, n, k, in, in, false}, x, w, nullptr);
      check_linear(*gemm, GemmShape{m, n, k, in, in, true}, x, w, &bias);
      check_linear(*gemm, GemmShape{m, n, k, in, DType::kF32, false}, x, w, nullptr);
    }
  }
}

// Every algorithm autotune may pick (the heuristic's candidates, each run by index) is within
// the tolerance, on the odd shapes and on decode- and prefill-sized ones: with autotune on, the
// fastest of them is taken, and which one that is can change from run to run.
TEST(GemmTest, EveryCandidateAlgorithmIsWithinTolerance) {
  REQUIRE_CUDA_DEVICE();
  auto gemm = make_gemm();
  ASSERT_NE(gemm, nullptr);
  const int64_t shapes[][3] = {{7, 33, 40},    {5, 17, 9},      {1, 1, 1},
                               {130, 70, 200}, {8, 4096, 4096}, {64, 1024, 4096}};
  int runs = 0;
  for (DType in : {DType::kBF16, DType::kF16}) {
    for (const auto& [m, n, k] : shapes) {
      const auto [x, w, bias] = seeded_operands(m, n, k, in);
      for (const GemmShape& s :
           {GemmShape{m, n, k, in, in, false}, GemmShape{m, n, k, in, in, true},
            GemmShape{m, n, k, in, DType::kF32, false}}) {
        const std::vector<float> ref = reference(s, x, w, s.bias ? &bias : nullptr);
        for (int i = 0, count = 1; i < count; ++i) {
          DeviceBuffer out = alloc_out(s);
          ASSERT_NE(out.get(), nullptr);
          std::string config;
          Expected<int> got = gemm->linear_candidate(s, i, x.dev.get(), w.dev.get(),
                                                     s.bias ? bias.dev.get() : nullptr, out.get(),
                                                     nullptr, &config);
          ASSERT_TRUE(got.has_value()) << name(s) << ": " << got.status().to_string();
          count = *got;
          ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
          const std::vector<float> gpu = download(s, out.get());
          const std::string what = name(s) + ", candidate " + std::to_string(i) + " of " +
                                   std::to_string(count) + " (" + config + ")";
          expect_close(s, gpu, ref, what);
          ++runs;
        }
        const Expected<int> past =
            gemm->linear_candidate(s, 99, x.dev.get(), w.dev.get(),
                                   s.bias ? bias.dev.get() : nullptr, alloc_out(s).get(), nullptr);
        EXPECT_FALSE(past.has_value()) << name(s);
      }
    }
  }
  EXPECT_GT(runs, 2 * 6 * 3);  // some shape had more than one candidate
}

// Pointers aligned to only 2 bytes (an x, an out, a bias taken one element into a buffer) get a
// plan of their own among the kernels that accept them; the aligned plan stays as it was.
TEST(GemmTest, MisalignedPointers) {
  REQUIRE_CUDA_DEVICE();
  auto gemm = make_gemm();
  ASSERT_NE(gemm, nullptr);
  const GemmShape s{8, 4096, 4096, DType::kBF16, DType::kBF16, true};
  Operand x, w, bias;
  make_operand(&x, s.m * s.k + 1, DType::kBF16, 1, true);
  make_operand(&w, s.n * s.k, DType::kBF16, 2, false);
  make_operand(&bias, s.n + 1, DType::kBF16, 3, false);
  check_linear(*gemm, s, x, w, &bias);
  EXPECT_EQ(gemm->cached_shapes(), 1u);

  // x, bias and out one element into their buffers.
  const auto* x_shifted = static_cast<const uint16_t*>(x.dev.get()) + 1;
  const auto* bias_shifted = static_cast<const uint16_t*>(bias.dev.get()) + 1;
  DeviceBuffer out = alloc_out(s);
  ASSERT_NE(out.get(), nullptr);
  auto* out_shifted = static_cast<uint16_t*>(out.get()) + 1;
  Status st = gemm->linear(s, x_shifted, w.dev.get(), bias_shifted, out_shifted, nullptr);
  ASSERT_TRUE(st.is_ok()) << st.to_string();
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  expect_close(s, download(s, out_shifted),
               reference(s, x.values.data() + 1, w, bias.bits.data() + 1), "misaligned " + name(s));
  EXPECT_EQ(gemm->cached_shapes(), 2u);

  check_linear(*gemm, s, x, w, &bias);  // the aligned plan again
  EXPECT_EQ(gemm->cached_shapes(), 2u);
}

// Repeated calls reuse the plan; a new shape (or the same one with a bias) adds one.
TEST(GemmTest, PlanCache) {
  REQUIRE_CUDA_DEVICE();
  auto gemm = make_gemm();
  ASSERT_NE(gemm, nullptr);
  EXPECT_EQ(gemm->cached_shapes(), 0u);
  const int64_t n = 1024, k = 512;
  Operand x, w, bias;
  make_operand(&x, 16 * k, DType::kBF16, 1, true);
  make_operand(&w, n * k, DType::kBF16, 2, false);
  make_operand(&bias, n, DType::kBF16, 3, false);
  const GemmShape a{16, n, k, DType::kBF16, DType::kBF16, false};
  for (int i = 0; i < 3; ++i) check_linear(*gemm, a, x, w, nullptr);
  EXPECT_EQ(gemm->cached_shapes(), 1u);
  const GemmShape b{5, n, k, DType::kBF16, DType::kBF16, false};
  check_linear(*gemm, b, x, w, nullptr);
  EXPECT_EQ(gemm->cached_shapes(), 2u);
  const GemmShape a_bias{16, n, k, DType::kBF16, DType::kBF16, true};
  check_linear(*gemm, a_bias, x, w, &bias);
  check_linear(*gemm, a_bias, x, w, &bias);
  EXPECT_EQ(gemm->cached_shapes(), 3u);
  check_linear(*gemm, a, x, w, nullptr);
  EXPECT_EQ(gemm->cached_shapes(), 3u);
  // A decode shape the GEMV takes: computed, no plan.
  const GemmShape c{1, n, k, DType::kBF16, DType::kBF16, false};
  ASSERT_TRUE(gemv_takes(c.m, c.n, c.k, c.in, c.out, x.dev.get(), w.dev.get()));
  check_linear(*gemm, c, x, w, nullptr);
  EXPECT_EQ(gemm->cached_shapes(), 3u);
}

// Without a workspace only the kernels that need none are candidates.
TEST(GemmTest, NoWorkspace) {
  REQUIRE_CUDA_DEVICE();
  auto gemm = make_gemm(0);
  ASSERT_NE(gemm, nullptr);
  const GemmShape s{1, 4096, 14336, DType::kBF16, DType::kBF16, false};
  Operand x, w;
  make_operand(&x, s.m * s.k, DType::kBF16, 4, true);
  make_operand(&w, s.n * s.k, DType::kBF16, 5, false);
  check_linear(*gemm, s, x, w, nullptr);
}

// linear() captured into a CUDA graph on a non-default stream: an already planned (timed) shape
// and a new one (heuristic's first choice, cached untimed); replaying the graph computes both.
// The next eager call of the new shape times it and keeps the one plan.
TEST(GemmTest, GraphCapture) {
  REQUIRE_CUDA_DEVICE();
  auto gemm = make_gemm();
  ASSERT_NE(gemm, nullptr);
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);

  const int64_t n = 6144, k = 4096;
  Operand x, w, bias;
  make_operand(&x, 8 * k, DType::kBF16, 21, true);
  make_operand(&w, n * k, DType::kBF16, 22, false);
  make_operand(&bias, n, DType::kBF16, 23, false);
  const GemmShape planned{8, n, k, DType::kBF16, DType::kBF16, false};
  const GemmShape fresh{3, n, k, DType::kBF16, DType::kF32, false};
  const GemmShape fresh_bias{2, n, k, DType::kBF16, DType::kBF16, true};
  check_linear(*gemm, planned, x, w, nullptr, stream);
  ASSERT_EQ(gemm->cached_shapes(), 1u);

  DeviceBuffer out_planned = alloc_out(planned), out_fresh = alloc_out(fresh),
               out_bias = alloc_out(fresh_bias);
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), cudaSuccess);
  Status s1 = gemm->linear(planned, x.dev.get(), w.dev.get(), nullptr, out_planned.get(), stream);
  Status s2 = gemm->linear(fresh, x.dev.get(), w.dev.get(), nullptr, out_fresh.get(), stream);
  Status s3 =
      gemm->linear(fresh_bias, x.dev.get(), w.dev.get(), bias.dev.get(), out_bias.get(), stream);
  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  ASSERT_TRUE(s1.is_ok()) << s1.to_string();
  ASSERT_TRUE(s2.is_ok()) << s2.to_string();
  ASSERT_TRUE(s3.is_ok()) << s3.to_string();
  EXPECT_EQ(gemm->cached_shapes(), 3u);

  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  for (DeviceBuffer* b : {&out_planned, &out_fresh, &out_bias}) {
    ASSERT_EQ(cudaMemsetAsync(b->get(), 0, b->bytes(), stream), cudaSuccess);
  }
  for (int replay = 0; replay < 2; ++replay) {
    ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
  }
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  expect_close(planned, download(planned, out_planned.get()), reference(planned, x, w, nullptr),
               "replayed " + name(planned));
  expect_close(fresh, download(fresh, out_fresh.get()), reference(fresh, x, w, nullptr),
               "replayed " + name(fresh));
  expect_close(fresh_bias, download(fresh_bias, out_bias.get()), reference(fresh_bias, x, w, &bias),
               "replayed " + name(fresh_bias));

  // Eager calls of the shapes first seen in the capture: timed now, same plans.
  check_linear(*gemm, fresh, x, w, nullptr, stream);
  check_linear(*gemm, fresh_bias, x, w, &bias, stream);
  EXPECT_EQ(gemm->cached_shapes(), 3u);
  // The graph still replays correctly after the retiming.
  ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  expect_close(fresh, download(fresh, out_fresh.get()), reference(fresh, x, w, nullptr),
               "replayed again " + name(fresh));

  EXPECT_EQ(cudaGraphExecDestroy(exec), cudaSuccess);
  EXPECT_EQ(cudaGraphDestroy(graph), cudaSuccess);
  EXPECT_EQ(cudaStreamDestroy(stream), cudaSuccess);
}

// The decode shapes Gemm::linear hands to the GEMV (kernels/cuda/gemv.h): Qwen3-30B-A3B's o,
// qkv and router, Llama's o, an odd width and depths that leave the 2-chunk loop a tail,
// with a bias and fp32 out, both dtypes; against the CPU reference.
TEST(GemvTest, DecodeShapesTrackTheReference) {
  REQUIRE_CUDA_DEVICE();
  auto gemm = make_gemm();
  ASSERT_NE(gemm, nullptr);
  const int64_t nk[][2] = {{2048, 4096}, {5120, 2048}, {128, 2048}, {4096, 4096},
                           {33, 40},     {1000, 1032}, {7, 2056}};
  for (DType dt : {DType::kBF16, DType::kF16}) {
    for (const auto& [n, k] : nk) {
      Operand w, bias;
      make_operand(&w, n * k, dt, 500 + n + k, false);
      make_operand(&bias, n, dt, 9 + n, false);
      for (int64_t m = 1; m <= kGemvMaxRows; ++m) {
        Operand x;
        make_operand(&x, m * k, dt, 77 * m + k, true);
        ASSERT_TRUE(gemv_takes(m, n, k, dt, dt, x.dev.get(), w.dev.get()));
        check_linear(*gemm, GemmShape{m, n, k, dt, dt, false}, x, w, nullptr);
        check_linear(*gemm, GemmShape{m, n, k, dt, dt, true}, x, w, &bias);
        check_linear(*gemm, GemmShape{m, n, k, dt, DType::kF32, false}, x, w, nullptr);
      }
    }
  }
  EXPECT_EQ(gemm->cached_shapes(), 0u);  // none went to cuBLASLt
}

// Every tile gemv_with() runs matches the CPU reference, and every tile of one slice count gives
// the same bits (a lane's slice is the same chunks in the same order whatever the rows and the
// chunks in flight; the slices add in one order), gemv's among them. Shapes with a tail past the
// deepest tile's loop, a row count no tile divides, k shorter than the slices' chunks, fp32 out
// and a bias; and the tiles it has no kernel for are refused, naming those it has.
TEST(GemvTest, EveryTileGivesItsSliceCountsBits) {
  REQUIRE_CUDA_DEVICE();
  // {1500, 3080}: gemv_tile's 4x4x4 with a row count it does not divide and chunks past its loop.
  const int64_t nk[][2] = {{5120, 2048}, {2048, 4096}, {1500, 3080}, {1000, 1032},
                           {7, 2056},    {333, 4104},  {128, 2048},  {65, 512}};
  const std::vector<GemvTile> tiles = gemv_tiles();
  for (DType dt : {DType::kBF16, DType::kF16}) {
    for (const auto& [n, k] : nk) {
      Operand w, x, bias;
      make_operand(&w, n * k, dt, 600 + n + k, false);
      make_operand(&x, k, dt, 31 + k, true);
      make_operand(&bias, n, dt, 5 + n, false);
      for (DType out : {dt, DType::kF32}) {
        const GemmShape s{1, n, k, dt, out, out == dt};
        DeviceBuffer got = alloc_out(s);
        const void* b = out == dt ? bias.dev.get() : nullptr;
        const std::vector<float> want = reference(s, x, w, out == dt ? &bias : nullptr);
        const size_t bytes = static_cast<size_t>(n) * dtype_size(out);
        std::map<int, std::vector<char>> first_of_slices;  // slices -> the first tile's bits
        ASSERT_EQ(cudaMemset(got.get(), 0xff, bytes), cudaSuccess);
        ASSERT_TRUE(
            gemv(1, n, k, dt, out, x.dev.get(), w.dev.get(), b, got.get(), nullptr).is_ok());
        std::vector<char>& gemv_bits = first_of_slices[gemv_tile(n, k).slices];
        gemv_bits.resize(bytes);
        ASSERT_EQ(cudaMemcpy(gemv_bits.data(), got.get(), bytes, cudaMemcpyDeviceToHost),
                  cudaSuccess);
        for (const GemvTile& t : tiles) {
          SCOPED_TRACE(std::to_string(t.rows) + "x" + std::to_string(t.depth) + "x" +
                       std::to_string(t.slices) + " " + name(s));
          ASSERT_EQ(cudaMemset(got.get(), 0xff, bytes), cudaSuccess);
          Status st =
              gemv_with(t, 1, n, k, dt, out, x.dev.get(), w.dev.get(), b, got.get(), nullptr);
          ASSERT_TRUE(st.is_ok()) << st.to_string();
          std::vector<char> mine(bytes);
          ASSERT_EQ(cudaMemcpy(mine.data(), got.get(), bytes, cudaMemcpyDeviceToHost), cudaSuccess);
          expect_close(s, download(s, got.get()), want, name(s));
          auto [at, fresh] = first_of_slices.emplace(t.slices, mine);
          if (!fresh) {
            EXPECT_EQ(mine, at->second);
          }
        }
      }
    }
  }
  auto* p = reinterpret_cast<const void*>(uintptr_t{256});
  for (const GemvTile& bad :
       {GemvTile{3, 2}, GemvTile{1, 8}, GemvTile{2, 2, 3}, GemvTile{2, 2, 16}}) {
    const Status st = gemv_with(bad, 1, 64, 64, DType::kBF16, DType::kBF16, p, p, nullptr,
                                const_cast<void*>(p), nullptr);
    EXPECT_FALSE(st.is_ok());
    EXPECT_NE(st.to_string().find("2x2x1"), std::string::npos) << st.to_string();
  }
}

// What it refuses goes to cuBLASLt: two rows, a depth not a multiple of 8, fp32 in, a misaligned
// x.
TEST(GemvTest, TakesOnlyItsShapes) {
  auto* p = reinterpret_cast<const void*>(uintptr_t{256});
  const DType bf = DType::kBF16;
  EXPECT_TRUE(gemv_takes(1, 2048, 4096, bf, bf, p, p));
  EXPECT_TRUE(gemv_takes(1, 128, 2048, bf, DType::kF32, p, p));
  EXPECT_FALSE(gemv_takes(2, 2048, 4096, bf, bf, p, p));
  EXPECT_FALSE(gemv_takes(1, 2048, 4092, bf, bf, p, p));
  EXPECT_TRUE(gemv_takes(1, 128256, 8192, bf, DType::kF32, p, p));  // 2.1 GB: any width
  EXPECT_FALSE(gemv_takes(1, 2048, 4096, DType::kF32, DType::kF32, p, p));
  EXPECT_FALSE(gemv_takes(1, 2048, 4096, bf, bf, static_cast<const char*>(p) + 2, p));
  EXPECT_FALSE(
      gemv(1, 2048, 4096, DType::kF32, DType::kF32, p, p, nullptr, nullptr, nullptr).is_ok());
}

// A chain of GEMVs captured in a graph, each reading what the one before wrote: the early
// start (programmatic dependent launch) must still wait for its input. y1 = x · w1ᵀ,
// y2 = y1 · w2ᵀ, y3 = y2 · w3ᵀ, replayed twice; each against the reference of its GPU input.
// gemv_add_rms_norm gives add_rms_norm + gemv's bits: the residual sum, the normed row and the
// output, at widths whose norm kernel runs 32 .. 512 threads with 1 or 2 vectors each (k 64 ..
// 8192), on the tile gemv_norm_tile picks and three split-K tiles, bf16 and fp16, out in the dtype
// (with and without a bias) and fp32 (a router's logits); captured in a graph and replayed twice
// (the arrivals counter goes back to 0 each time).
TEST(GemvTest, AddRmsNormInTheGemvGivesTheTwoKernelsBits) {
  REQUIRE_CUDA_DEVICE();
  const int64_t nk[][2] = {{40, 64},   {5120, 2048}, {2048, 4096}, {1000, 3584},
                           {96, 5120}, {8192, 1024}, {300, 8192}};
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  auto arrivals = DeviceBuffer::allocate(4, "arrivals");
  ASSERT_TRUE(arrivals);
  ASSERT_EQ(cudaMemset(arrivals->get(), 0, 4), cudaSuccess);
  for (DType dt : {DType::kBF16, DType::kF16}) {
    for (const auto& [n, k] : nk) {
      for (const auto& [out, with_bias] :
           {std::pair{dt, false}, {dt, true}, {DType::kF32, false}}) {
        SCOPED_TRACE(std::string(dtype_name(dt)) + "->" + dtype_name(out) + " n " +
                     std::to_string(n) + " k " + std::to_string(k) + (with_bias ? " bias" : ""));
        Operand w, proj, residual, weight, bias;
        make_operand(&w, n * k, dt, 900 + n + k, false);
        make_operand(&proj, k, dt, 41 + k, false);
        make_operand(&residual, k, dt, 77 + k, false);
        make_operand(&weight, k, dt, 13 + k, false);
        make_operand(&bias, n, dt, 5 + n, false);
        const void* b = with_bias ? bias.dev.get() : nullptr;
        const size_t row = static_cast<size_t>(k) * 2;
        const size_t outb = static_cast<size_t>(n) * dtype_size(out);
        for (const GemvTile& tile :
             {gemv_norm_tile(n, k), GemvTile{2, 2, 4}, GemvTile{4, 2, 2}, GemvTile{2, 2, 8}}) {
          SCOPED_TRACE(std::to_string(tile.rows) + "x" + std::to_string(tile.depth) + "x" +
                       std::to_string(tile.slices));
          // The two kernels.
          auto res1 = DeviceBuffer::allocate(row, "residual");
          auto normed1 = DeviceBuffer::allocate(row, "normed");
          auto out1 = DeviceBuffer::allocate(outb, "out");
          ASSERT_TRUE(res1 && normed1 && out1);
          ASSERT_EQ(cudaMemcpy(res1->get(), residual.dev.get(), row, cudaMemcpyDeviceToDevice),
                    cudaSuccess);
          ASSERT_TRUE(add_rms_norm(dt, proj.dev.get(), res1->get(), weight.dev.get(), 1, k, 1e-5f,
                                   normed1->get(), stream)
                          .is_ok());
          ASSERT_TRUE(
              gemv_with(tile, 1, n, k, dt, out, normed1->get(), w.dev.get(), b, out1->get(), stream)
                  .is_ok());
          // The one kernel, twice through a graph from the same inputs.
          auto res2 = DeviceBuffer::allocate(row, "residual");
          auto normed2 = DeviceBuffer::allocate(row, "normed");
          auto out2 = DeviceBuffer::allocate(outb, "out");
          ASSERT_TRUE(res2 && normed2 && out2);
          const GemvAddRmsNorm a{proj.dev.get(), res2->get(),    weight.dev.get(),
                                 1e-5f,          normed2->get(), arrivals->as<int32_t>()};
          ASSERT_TRUE(gemv_add_rms_norm_takes(n, k, dt, out, a, w.dev.get()));
          cudaGraph_t graph = nullptr;
          cudaGraphExec_t exec = nullptr;
          ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
          const Status st =
              gemv_add_rms_norm_with(tile, n, k, dt, out, a, w.dev.get(), b, out2->get(), stream);
          ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
          ASSERT_TRUE(st.is_ok()) << st.to_string();
          ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
          for (int replay = 0; replay < 2; ++replay) {
            ASSERT_EQ(cudaMemcpy(res2->get(), residual.dev.get(), row, cudaMemcpyDeviceToDevice),
                      cudaSuccess);
            for (DeviceBuffer* d : {&*normed2, &*out2}) {
              ASSERT_EQ(cudaMemset(d->get(), 0xff, d->bytes()), cudaSuccess);
            }
            ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
            ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
            for (const auto& [want, got, bytes] : {std::tuple{&*res1, &*res2, row},
                                                   {&*normed1, &*normed2, row},
                                                   {&*out1, &*out2, outb}}) {
              std::vector<char> h1(bytes), h2(bytes);
              ASSERT_EQ(cudaMemcpy(h1.data(), want->get(), bytes, cudaMemcpyDeviceToHost),
                        cudaSuccess);
              ASSERT_EQ(cudaMemcpy(h2.data(), got->get(), bytes, cudaMemcpyDeviceToHost),
                        cudaSuccess);
              EXPECT_EQ(h1, h2) << "replay " << replay;
            }
            int32_t left = -1;
            ASSERT_EQ(cudaMemcpy(&left, arrivals->get(), 4, cudaMemcpyDeviceToHost), cudaSuccess);
            EXPECT_EQ(left, 0) << "the arrivals counter was left set";
          }
          cudaGraphExecDestroy(exec);
          cudaGraphDestroy(graph);
        }
      }
    }
  }
  // Refused: no counter, normed over proj.
  Operand w, x;
  make_operand(&w, 64 * 64, DType::kBF16, 1, false);
  make_operand(&x, 4 * 64, DType::kBF16, 2, false);
  GemvAddRmsNorm a;
  a.proj = x.dev.get();
  a.residual = static_cast<char*>(x.dev.get()) + 128;
  a.weight = static_cast<char*>(x.dev.get()) + 256;
  a.normed = static_cast<char*>(x.dev.get()) + 384;
  EXPECT_FALSE(gemv_add_rms_norm_takes(64, 64, DType::kBF16, DType::kBF16, a, w.dev.get()));
  a.arrivals = arrivals->as<int32_t>();
  EXPECT_TRUE(gemv_add_rms_norm_takes(64, 64, DType::kBF16, DType::kBF16, a, w.dev.get()));
  a.normed = x.dev.get();
  EXPECT_FALSE(gemv_add_rms_norm(64, 64, DType::kBF16, DType::kBF16, a, w.dev.get(), nullptr,
                                 static_cast<char*>(x.dev.get()) + 256, nullptr)
                   .is_ok());
  cudaStreamDestroy(stream);
}

// The model fuses the norm into a GEMV only when its grid is one wave: a router's 128 rows are,
// a grid of a million rows is not, the answer falls from yes to no once as n grows (the grid
// only grows with n), and a shape gemv does not take is never one.
TEST(GemvTest, OneWaveOfTheNormsGemvGrowsWithTheGrid) {
  REQUIRE_CUDA_DEVICE();
  EXPECT_TRUE(gemv_add_rms_norm_one_wave(128, 2048, DType::kBF16, DType::kF32));
  EXPECT_FALSE(gemv_add_rms_norm_one_wave(int64_t{1} << 20, 4096, DType::kBF16, DType::kBF16));
  EXPECT_FALSE(gemv_add_rms_norm_one_wave(128, 2047, DType::kBF16, DType::kBF16));
  EXPECT_FALSE(gemv_add_rms_norm_one_wave(128, 2048, DType::kF32, DType::kF32));
  // A tile with no kernel is never one wave (and does not divide by its slice count).
  EXPECT_FALSE(gemv_add_rms_norm_one_wave_with({2, 2, 0}, 128, 2048, DType::kBF16, DType::kF32));
  EXPECT_FALSE(gemv_add_rms_norm_one_wave_with({2, 2, 3}, 128, 2048, DType::kBF16, DType::kF32));
  EXPECT_TRUE(gemv_add_rms_norm_one_wave_with({2, 2, 4}, 128, 2048, DType::kBF16, DType::kF32));
  for (const int64_t k : {2048, 4096}) {
    int changes = 0;
    bool before = true;
    for (int64_t n = 256; n <= 65536; n += 256) {
      const bool now = gemv_add_rms_norm_one_wave(n, k, DType::kBF16, DType::kBF16);
      EXPECT_EQ(now, gemv_add_rms_norm_one_wave(n, k, DType::kBF16, DType::kBF16));  // cached
      changes += now != before;
      before = now;
    }
    EXPECT_EQ(changes, 1) << "k " << k;
  }
}

TEST(GemvTest, ChainedInAGraphEachWaitsForItsInput) {
  REQUIRE_CUDA_DEVICE();
  auto gemm = make_gemm();
  ASSERT_NE(gemm, nullptr);
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  const int64_t m = 1, d = 4096;
  const DType bf = DType::kBF16;
  Operand x, w[3];
  make_operand(&x, m * d, bf, 5, true);
  for (int i = 0; i < 3; ++i) make_operand(&w[i], d * d, bf, 60 + i, false);
  const GemmShape s{m, d, d, bf, bf, false};
  DeviceBuffer y[3] = {alloc_out(s), alloc_out(s), alloc_out(s)};
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), cudaSuccess);
  const void* in = x.dev.get();
  Status st = Status::ok();
  for (int i = 0; i < 3 && st.is_ok(); ++i) {
    st = gemm->linear(s, in, w[i].dev.get(), nullptr, y[i].get(), stream);
    in = y[i].get();
  }
  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  ASSERT_TRUE(st.is_ok()) << st.to_string();
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  for (int replay = 0; replay < 2; ++replay) {
    for (DeviceBuffer& b : y)
      ASSERT_EQ(cudaMemsetAsync(b.get(), 0, b.bytes(), stream), cudaSuccess);
    ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    std::vector<float> input = x.values;
    for (int i = 0; i < 3; ++i) {
      // The values grow ~20x a link, so the bound is relative to the largest: a link that read
      // its input before it was written (zeros here) is off by the whole output.
      const std::vector<float> got = download(s, y[i].get());
      const std::vector<float> ref = reference(s, input.data(), w[i], nullptr);
      double err = 0, top = 0;
      for (size_t j = 0; j < ref.size(); ++j) {
        err = std::max(err, std::fabs(static_cast<double>(got[j]) - ref[j]));
        top = std::max(top, std::fabs(static_cast<double>(ref[j])));
      }
      EXPECT_LE(err, std::ldexp(top, -7))
          << "replay " << replay << " link " << i << ": max |error| " << err << " of " << top;
      input = got;
    }
  }
  EXPECT_EQ(cudaGraphExecDestroy(exec), cudaSuccess);
  EXPECT_EQ(cudaGraphDestroy(graph), cudaSuccess);
  EXPECT_EQ(cudaStreamDestroy(stream), cudaSuccess);
}

TEST(GemmTest, InvalidArguments) {
  REQUIRE_CUDA_DEVICE();
  auto gemm = make_gemm();
  ASSERT_NE(gemm, nullptr);
  const int64_t m = 4, n = 64, k = 32;
  Operand x, w, bias;
  make_operand(&x, m * k, DType::kBF16, 1, true);
  make_operand(&w, n * k, DType::kBF16, 2, false);
  make_operand(&bias, n, DType::kBF16, 3, false);
  DeviceBuffer out = alloc_out(GemmShape{m, n, k, DType::kBF16, DType::kF32, false});
  const void* xp = x.dev.get();
  const void* wp = w.dev.get();
  const void* bp = bias.dev.get();
  void* op = out.get();
  const GemmShape good{m, n, k, DType::kBF16, DType::kBF16, false};

  auto expect_invalid = [&](GemmShape s, const void* xv, const void* wv, const void* bv, void* ov,
                            const char* what) {
    Status st = gemm->linear(s, xv, wv, bv, ov, nullptr);
    EXPECT_EQ(st.code(), Code::kInvalidArgument) << what << ": " << st.to_string();
  };
  GemmShape s = good;
  s.in = DType::kF32;
  s.out = DType::kF32;
  expect_invalid(s, xp, wp, nullptr, op, "f32 inputs");
  s = good;
  s.out = DType::kF16;
  expect_invalid(s, xp, wp, nullptr, op, "bf16 -> f16");
  s = good;
  s.m = 0;
  expect_invalid(s, xp, wp, nullptr, op, "m = 0");
  s = good;
  s.k = -1;
  expect_invalid(s, xp, wp, nullptr, op, "k < 0");
  expect_invalid(good, nullptr, wp, nullptr, op, "null x");
  expect_invalid(good, xp, nullptr, nullptr, op, "null w");
  expect_invalid(good, xp, wp, nullptr, nullptr, "null out");
  expect_invalid(good, xp, wp, bp, op, "bias pointer without shape.bias");
  s = good;
  s.bias = true;
  expect_invalid(s, xp, wp, nullptr, op, "shape.bias without a pointer");
  s.out = DType::kF32;
  expect_invalid(s, xp, wp, bp, op, "bias with f32 output");
  expect_invalid(good, xp, wp, nullptr, const_cast<void*>(xp), "out aliasing x");
  EXPECT_EQ(gemm->cached_shapes(), 0u);

  // The same arguments, corrected, work.
  Status st = gemm->linear(good, xp, wp, nullptr, op, nullptr);
  EXPECT_TRUE(st.is_ok()) << st.to_string();
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

}  // namespace
}  // namespace tessera::cuda
