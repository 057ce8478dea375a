// GPU-vs-CPU tests of the CUDA elementwise ops (kernels/cuda/elementwise.h). Inputs are random
// values already rounded to bf16/fp16; the reference is the kernels/cpu op run in fp32 on those
// same values. The GPU rounds intermediates to the dtype as transformers does, so results are
// compared with a bound of a few units of the dtype's resolution (ulp) at the magnitude involved;
// copies and conversions are compared bit for bit, and RoPE without qk-norm against an exact
// emulation of transformers' bf16/fp16 rounding chain.
//
// These tests need a GPU (run by scripts/gpu-check); without one every test fails.
#include "kernels/cuda/elementwise.h"

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <numeric>
#include <optional>
#include <random>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/status.h"
#include "common/tensor.h"
#include "kernels/cpu/activation.h"
#include "kernels/cpu/cpu_context.h"
#include "kernels/cpu/embedding.h"
#include "kernels/cpu/rms_norm.h"
#include "kernels/cpu/rope.h"
#include "kernels/cuda/cuda_util.h"
#include "tests/kernels/test_util.h"

namespace tessera::cuda {
namespace {

// ---- helpers ----

#define TESSERA_REQUIRE_GPU()                                                                     \
  do {                                                                                            \
    int tessera_num_devices_ = 0;                                                                 \
    const cudaError_t tessera_err_ = cudaGetDeviceCount(&tessera_num_devices_);                   \
    if (tessera_err_ != cudaSuccess || tessera_num_devices_ == 0) {                               \
      FAIL() << "no usable CUDA device (cudaGetDeviceCount: " << cudaGetErrorString(tessera_err_) \
             << ", " << tessera_num_devices_                                                      \
             << " devices): the CUDA kernel tests only run on a GPU machine (scripts/gpu-check)"; \
    }                                                                                             \
  } while (0)

constexpr DType kHalfTypes[] = {DType::kBF16, DType::kF16};

// CUDA runtime failures in the test harness itself throw (gtest reports them as failures).
void check_cuda(cudaError_t err, const std::string& what) {
  if (err != cudaSuccess) throw std::runtime_error(what + ": " + cudaGetErrorString(err));
}

void sync() { check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize"); }

DeviceBuffer alloc(size_t bytes) {
  Expected<DeviceBuffer> b = DeviceBuffer::allocate(std::max<size_t>(bytes, 1), "test buffer");
  if (!b.has_value()) throw std::runtime_error(b.status().to_string());
  return std::move(b).value();
}

template <typename T>
void upload_to(void* dst, const std::vector<T>& v) {
  check_cuda(cudaMemcpy(dst, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice), "upload");
}

template <typename T>
DeviceBuffer upload(const std::vector<T>& v) {
  DeviceBuffer b = alloc(v.size() * sizeof(T));
  upload_to(b.get(), v);
  return b;
}

template <typename T>
std::vector<T> download(const void* src, size_t n) {
  sync();
  std::vector<T> v(n);
  check_cuda(cudaMemcpy(v.data(), src, n * sizeof(T), cudaMemcpyDeviceToHost), "download");
  return v;
}

uint16_t to_bits(DType d, float f) {
  return d == DType::kBF16 ? float_to_bf16(f) : float_to_f16(f);
}
float from_bits(DType d, uint16_t h) {
  return d == DType::kBF16 ? bf16_to_float(h) : f16_to_float(h);
}
float round_to(DType d, float f) { return from_bits(d, to_bits(d, f)); }

std::vector<float> from_bits(DType d, const std::vector<uint16_t>& bits) {
  std::vector<float> v(bits.size());
  for (size_t i = 0; i < bits.size(); ++i) v[i] = from_bits(d, bits[i]);
  return v;
}

// A bf16/fp16 tensor on the host: the stored bits and the values they hold.
struct HalfTensor {
  DType dtype = DType::kBF16;
  std::vector<uint16_t> bits;
  std::vector<float> values;
};

// n values uniform in [lo, hi), rounded to the dtype, none zero.
HalfTensor random_half(DType d, size_t n, uint32_t seed, float lo = -1.0f, float hi = 1.0f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  HalfTensor t{d, std::vector<uint16_t>(n), std::vector<float>(n)};
  for (size_t i = 0; i < n; ++i) {
    uint16_t h;
    do {
      h = to_bits(d, dist(rng));
    } while ((h & 0x7fffu) == 0);
    t.bits[i] = h;
    t.values[i] = from_bits(d, h);
  }
  return t;
}

TensorView view_1d(const HalfTensor& t) {
  return {t.bits.data(), t.dtype, {static_cast<int64_t>(t.bits.size())}};
}

// Spacing of the dtype's representable values at |v| (subnormal spacing below the normal range).
double ulp(DType d, double v) {
  const int fraction_bits = d == DType::kBF16 ? 7 : 10;
  const int min_exp = d == DType::kBF16 ? -126 : -14;
  v = std::fabs(v);
  int e = min_exp;
  if (v >= std::ldexp(1.0, min_exp)) {
    std::frexp(v, &e);  // v = m * 2^e, m in [0.5, 1)
    e -= 1;
  }
  return std::ldexp(1.0, e - fraction_bits);
}

// |got[i] - ref[i]| <= bound[i] for every i (test_util's check, fp32 references).
void expect_within(const std::vector<float>& got, const std::vector<float>& ref,
                   const std::vector<double>& bound, const std::string& what) {
  cpu::testing::expect_near_all(got, cpu::testing::to_double(ref), bound, what);
}

// The common bound: |got - ref| <= ulps * ulp(|ref|) + abs.
void expect_within_ulps(const std::vector<float>& got, const std::vector<float>& ref, DType d,
                        double ulps, double abs, const std::string& what) {
  std::vector<double> bound(ref.size());
  for (size_t i = 0; i < ref.size(); ++i) bound[i] = ulps * ulp(d, ref[i]) + abs;
  expect_within(got, ref, bound, what);
}

void expect_bits_equal(const std::vector<uint16_t>& got, const std::vector<uint16_t>& want,
                       const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  int failures = 0;
  for (size_t i = 0; i < got.size() && failures < 5; ++i) {
    if (got[i] != want[i]) {
      ++failures;
      ADD_FAILURE() << what << "[" << i << "]: got bits 0x" << std::hex << got[i] << ", expected 0x"
                    << want[i] << std::dec;
    }
  }
}

std::string label(DType d, const std::string& rest) {
  return std::string(dtype_name(d)) + " " + rest;
}

constexpr uint16_t kSentinel = 0x5a5a;  // fills outputs that must stay untouched
constexpr uint8_t kFp8Sentinel = 0x5a;  // the same, in an FP8 cache

// ---- embedding / gather_rows ----

TEST(CudaEmbedding, MatchesCpuBitForBit) {
  TESSERA_REQUIRE_GPU();
  cpu::CpuContext ctx(1);
  for (DType d : kHalfTypes) {
    for (int64_t hidden : {64, 100, 4096, 7}) {
      // offset 1 misaligns table and out (the 2-byte path); 0 is the 16-byte path when it fits.
      for (int64_t offset : {0, 1}) {
        const int64_t vocab = 300, n = 9;
        const HalfTensor table = random_half(d, vocab * hidden, 11 + hidden);
        std::vector<int32_t> ids(n);
        std::mt19937 rng(5);
        for (int32_t& id : ids) id = static_cast<int32_t>(rng() % vocab);
        ids[3] = vocab - 1;
        ids[4] = 0;
        std::vector<float> ref(n * hidden);
        ASSERT_TRUE(cpu::embedding(ctx, {table.bits.data(), d, {vocab, hidden}}, ids, ref).is_ok());

        DeviceBuffer d_table = alloc((vocab * hidden + offset) * 2);
        check_cuda(cudaMemcpy(static_cast<uint16_t*>(d_table.get()) + offset, table.bits.data(),
                              table.bits.size() * 2, cudaMemcpyHostToDevice),
                   "upload table");
        DeviceBuffer d_ids = upload(ids);
        DeviceBuffer d_out = alloc((n * hidden + offset) * 2);
        uint16_t* out = static_cast<uint16_t*>(d_out.get()) + offset;
        ASSERT_TRUE(embedding(d, d_ids.as<int32_t>(), n,
                              static_cast<uint16_t*>(d_table.get()) + offset, vocab, hidden, out,
                              nullptr)
                        .is_ok());
        const std::vector<float> got = from_bits(d, download<uint16_t>(out, n * hidden));
        expect_within_ulps(got, ref, d, 0.0, 0.0,
                           label(d, "embedding hidden " + std::to_string(hidden) + " offset " +
                                        std::to_string(offset)));
      }
    }
  }
}

TEST(CudaEmbedding, ClampsOutOfRangeIds) {
  TESSERA_REQUIRE_GPU();
  const int64_t vocab = 50, hidden = 64;
  const HalfTensor table = random_half(DType::kBF16, vocab * hidden, 3);
  const std::vector<int32_t> ids = {-5, static_cast<int32_t>(vocab) + 3,
                                    std::numeric_limits<int32_t>::max(), 7};
  const std::vector<int64_t> want_rows = {0, vocab - 1, vocab - 1, 7};
  DeviceBuffer d_table = upload(table.bits), d_ids = upload(ids);
  DeviceBuffer d_out = alloc(ids.size() * hidden * 2);
  ASSERT_TRUE(embedding(DType::kBF16, d_ids.as<int32_t>(), static_cast<int64_t>(ids.size()),
                        d_table.get(), vocab, hidden, d_out.get(), nullptr)
                  .is_ok());
  const std::vector<uint16_t> got = download<uint16_t>(d_out.get(), ids.size() * hidden);
  for (size_t t = 0; t < ids.size(); ++t) {
    const std::vector<uint16_t> row(got.begin() + t * hidden, got.begin() + (t + 1) * hidden);
    const std::vector<uint16_t> want(table.bits.begin() + want_rows[t] * hidden,
                                     table.bits.begin() + (want_rows[t] + 1) * hidden);
    expect_bits_equal(row, want, "embedding id " + std::to_string(ids[t]));
  }
}

TEST(CudaGatherRows, MatchesHostGather) {
  TESSERA_REQUIRE_GPU();
  for (DType d : {DType::kF32, DType::kBF16, DType::kF16}) {
    for (int64_t width : {1, 3, 64, 100, 4096}) {
      const int64_t src_rows = 13;
      const size_t esize = dtype_size(d);
      std::vector<uint8_t> src(src_rows * width * esize);
      std::mt19937 rng(static_cast<uint32_t>(width));
      for (uint8_t& b : src) b = static_cast<uint8_t>(rng());
      const std::vector<int32_t> rows = {12, 0, 5, 5, 7};
      DeviceBuffer d_src = upload(src), d_rows = upload(rows);
      DeviceBuffer d_dst = alloc(rows.size() * width * esize);
      ASSERT_TRUE(gather_rows(d, d_src.get(), src_rows, d_rows.as<int32_t>(),
                              static_cast<int64_t>(rows.size()), width, d_dst.get(), nullptr)
                      .is_ok());
      const std::vector<uint8_t> got = download<uint8_t>(d_dst.get(), rows.size() * width * esize);
      std::vector<uint8_t> want;
      for (int32_t r : rows) {
        want.insert(want.end(), src.begin() + r * width * esize,
                    src.begin() + (r + 1) * width * esize);
      }
      EXPECT_TRUE(got == want) << dtype_name(d) << " gather_rows width " << width;
    }
  }
}

// ---- rms_norm / add_rms_norm ----

// hidden sizes covering every launch path: the scalar fallback (100, and 40000 > the vector
// path's limit) and 1, 2, 4 and 8 vectors per thread (4096, 5120/8192, 12288, 20480).
constexpr int64_t kNormSizes[] = {64, 100, 4096, 5120, 8192, 12288, 20480, 40000};

// RMSNorm: out = round(w * round(x * rsqrt(mean(x^2) + eps))) vs the fp32 reference: the two
// roundings give <= 1.5 ulp; bound 2 ulp(|ref|).
constexpr double kNormUlps = 2.0;
constexpr double kNormAbs = 1e-6;

TEST(CudaRmsNorm, MatchesCpu) {
  TESSERA_REQUIRE_GPU();
  cpu::CpuContext ctx(1);
  const float eps = 1e-5f;
  for (DType d : kHalfTypes) {
    for (int64_t hidden : kNormSizes) {
      for (int64_t rows : {1, 5}) {
        for (bool in_place : {false, true}) {
          const std::string what =
              label(d, "rms_norm hidden " + std::to_string(hidden) + " rows " +
                           std::to_string(rows) + (in_place ? " in place" : ""));
          const HalfTensor x = random_half(d, rows * hidden, 100 + hidden + rows, -3.0f, 3.0f);
          const HalfTensor w = random_half(d, hidden, 7 + hidden, -2.0f, 2.0f);
          std::vector<float> ref(x.values.size());
          ASSERT_TRUE(cpu::rms_norm(ctx, x.values, view_1d(w), eps, ref).is_ok());

          DeviceBuffer d_x = upload(x.bits), d_w = upload(w.bits);
          DeviceBuffer d_out = alloc(x.bits.size() * 2);
          void* out = in_place ? d_x.get() : d_out.get();
          ASSERT_TRUE(rms_norm(d, d_x.get(), d_w.get(), rows, hidden, eps, out, nullptr).is_ok());
          expect_within_ulps(from_bits(d, download<uint16_t>(out, x.bits.size())), ref, d,
                             kNormUlps, kNormAbs, what);
        }
      }
    }
  }
}

TEST(CudaAddRmsNorm, MatchesCpu) {
  TESSERA_REQUIRE_GPU();
  cpu::CpuContext ctx(1);
  const float eps = 1e-6f;
  for (DType d : kHalfTypes) {
    for (int64_t hidden : kNormSizes) {
      for (int64_t rows : {1, 4}) {
        for (bool out_is_x : {false, true}) {
          const std::string what =
              label(d, "add_rms_norm hidden " + std::to_string(hidden) + " rows " +
                           std::to_string(rows) + (out_is_x ? " out=x" : ""));
          const HalfTensor x = random_half(d, rows * hidden, 200 + hidden + rows, -2.0f, 2.0f);
          const HalfTensor res = random_half(d, rows * hidden, 300 + hidden, -4.0f, 4.0f);
          const HalfTensor w = random_half(d, hidden, 9 + hidden, 0.25f, 1.5f);
          std::vector<float> ref_res = res.values;
          std::vector<float> unused(x.values.size());
          ASSERT_TRUE(cpu::add_rms_norm(ctx, x.values, ref_res, view_1d(w), eps, unused).is_ok());
          // residual: round(residual + x), exactly: the fp32 sum rounded once to the dtype.
          std::vector<uint16_t> want_res(ref_res.size());
          std::vector<float> rounded_res(ref_res.size());
          for (size_t i = 0; i < ref_res.size(); ++i) {
            want_res[i] = to_bits(d, ref_res[i]);
            rounded_res[i] = from_bits(d, want_res[i]);
          }
          // out: the RMSNorm of the rounded residual, as the model sees it.
          std::vector<float> ref_out(x.values.size());
          ASSERT_TRUE(cpu::rms_norm(ctx, rounded_res, view_1d(w), eps, ref_out).is_ok());

          DeviceBuffer d_x = upload(x.bits), d_res = upload(res.bits), d_w = upload(w.bits);
          DeviceBuffer d_out = alloc(x.bits.size() * 2);
          void* out = out_is_x ? d_x.get() : d_out.get();
          ASSERT_TRUE(
              add_rms_norm(d, d_x.get(), d_res.get(), d_w.get(), rows, hidden, eps, out, nullptr)
                  .is_ok());
          expect_bits_equal(download<uint16_t>(d_res.get(), res.bits.size()), want_res,
                            what + " residual");
          expect_within_ulps(from_bits(d, download<uint16_t>(out, x.bits.size())), ref_out, d,
                             kNormUlps, kNormAbs, what + " out");
        }
      }
    }
  }
}

// Gemma's sandwich: norm_add_rms_norm gives the bits of rms_norm(x -> x) then add_rms_norm
// (residual and out), for both norm forms, widths on the one-kernel path (V = 1..8) and one that
// is not (hidden % 8 != 0: the two kernels).
TEST(CudaNormAddRmsNorm, EqualsRmsNormThenAddRmsNorm) {
  TESSERA_REQUIRE_GPU();
  const float eps = 1e-6f;
  for (DType d : kHalfTypes) {
    for (bool unit : {false, true}) {
      for (int64_t hidden : {int64_t{64}, int64_t{2304}, int64_t{3584}, int64_t{16384},
                             int64_t{32768}, int64_t{100}}) {
        for (int64_t rows : {1, 5}) {
          const std::string what =
              label(d, "norm_add_rms_norm hidden " + std::to_string(hidden) + " rows " +
                           std::to_string(rows) + (unit ? " unit offset" : ""));
          const HalfTensor x = random_half(d, rows * hidden, 70 + hidden + rows, -3.0f, 3.0f);
          const HalfTensor res = random_half(d, rows * hidden, 80 + hidden, -4.0f, 4.0f);
          const HalfTensor wx = random_half(d, hidden, 11 + hidden, -0.5f, 1.5f);
          const HalfTensor w = random_half(d, hidden, 13 + hidden, -0.5f, 1.5f);
          DeviceBuffer wx_d = upload(wx.bits), w_d = upload(w.bits);
          // The two kernels.
          DeviceBuffer x1 = upload(x.bits), res1 = upload(res.bits),
                       out1 = alloc(x.bits.size() * 2);
          ASSERT_TRUE(rms_norm(d, x1.get(), wx_d.get(), rows, hidden, eps, x1.get(), nullptr, unit)
                          .is_ok());
          ASSERT_TRUE(add_rms_norm(d, x1.get(), res1.get(), w_d.get(), rows, hidden, eps,
                                   out1.get(), nullptr, unit)
                          .is_ok());
          // The fused one.
          DeviceBuffer x2 = upload(x.bits), res2 = upload(res.bits),
                       out2 = alloc(x.bits.size() * 2);
          ASSERT_TRUE(norm_add_rms_norm(d, x2.get(), wx_d.get(), res2.get(), w_d.get(), rows,
                                        hidden, eps, out2.get(), nullptr, unit)
                          .is_ok());
          expect_bits_equal(download<uint16_t>(res2.get(), res.bits.size()),
                            download<uint16_t>(res1.get(), res.bits.size()), what + " residual");
          expect_bits_equal(download<uint16_t>(out2.get(), x.bits.size()),
                            download<uint16_t>(out1.get(), x.bits.size()), what + " out");
        }
      }
    }
  }
  DeviceBuffer a = alloc(64), b = alloc(64), w = alloc(64);
  EXPECT_FALSE(norm_add_rms_norm(DType::kBF16, a.get(), w.get(), a.get(), w.get(), 1, 16, eps,
                                 b.get(), nullptr)
                   .is_ok());  // residual aliasing x
  EXPECT_FALSE(norm_add_rms_norm(DType::kBF16, a.get(), nullptr, b.get(), w.get(), 1, 16, eps,
                                 b.get(), nullptr)
                   .is_ok());  // no x_weight
}

// ---- rope_and_cache ----

struct RopeCase {
  int64_t num_heads;
  int64_t num_kv_heads;
  int64_t head_dim;
  bool qk_norm;
  bool llama3;
};

std::string describe(const RopeCase& c) {
  return "heads " + std::to_string(c.num_heads) + "/" + std::to_string(c.num_kv_heads) +
         " head_dim " + std::to_string(c.head_dim) + (c.qk_norm ? " qk_norm" : "") +
         (c.llama3 ? " llama3" : "");
}

// Inputs, the GPU's outputs and the CPU reference of one rope_and_cache run.
struct RopeRun {
  RopeCase c;
  DType dtype;
  int64_t num_tokens, num_blocks, block_size, max_position;
  std::vector<int32_t> positions;
  std::vector<int64_t> slots;
  HalfTensor qkv, q_norm, k_norm;
  std::optional<cpu::RopeTable> table;
  std::vector<uint16_t> q_out, k_cache, v_cache;  // from the GPU (sentinel-filled before)
  std::vector<uint8_t> k_fp8, v_fp8;              // instead of k_cache / v_cache, fp8 runs
  std::vector<float> pre_q, pre_k;                // reference after qk-norm, before RoPE
  std::vector<float> ref_q, ref_k;                // reference after RoPE
  Status status;

  int64_t row() const { return (c.num_heads + 2 * c.num_kv_heads) * c.head_dim; }
  int64_t token_kv() const { return c.num_kv_heads * c.head_dim; }
};

RopeRun run_rope(DType d, const RopeCase& c, std::vector<int32_t> positions,
                 std::vector<int64_t> slots, int64_t num_blocks, int64_t block_size,
                 int64_t max_position, uint32_t seed, bool fp8_cache = false,
                 bool unit_offset = false) {
  RopeRun r;
  r.c = c;
  r.dtype = d;
  r.num_tokens = static_cast<int64_t>(positions.size());
  r.num_blocks = num_blocks;
  r.block_size = block_size;
  r.max_position = max_position;
  r.positions = std::move(positions);
  r.slots = std::move(slots);
  const int64_t n = r.num_tokens, hd = c.head_dim;
  const float eps = 1e-6f;
  r.qkv = random_half(d, n * r.row(), seed, -2.0f, 2.0f);
  if (c.qk_norm) {
    r.q_norm = random_half(d, hd, seed + 1, 0.5f, 1.5f);
    r.k_norm = random_half(d, hd, seed + 2, 0.5f, 1.5f);
  }
  std::optional<cpu::Llama3RopeScaling> scaling;
  if (c.llama3) scaling = cpu::Llama3RopeScaling{};
  Expected<cpu::RopeTable> table =
      cpu::RopeTable::create(hd, c.llama3 ? 500000.0 : 1000000.0, max_position, scaling);
  if (!table.has_value()) throw std::runtime_error(table.status().to_string());
  r.table.emplace(std::move(table).value());

  // CPU reference: split, per-head norm, RoPE, all in fp32 on the rounded inputs.
  cpu::CpuContext ctx(1);
  r.pre_q.resize(n * c.num_heads * hd);
  r.pre_k.resize(n * c.num_kv_heads * hd);
  for (int64_t t = 0; t < n; ++t) {
    const float* row = r.qkv.values.data() + t * r.row();
    std::copy(row, row + c.num_heads * hd, r.pre_q.begin() + t * c.num_heads * hd);
    std::copy(row + c.num_heads * hd, row + (c.num_heads + c.num_kv_heads) * hd,
              r.pre_k.begin() + t * c.num_kv_heads * hd);
  }
  if (c.qk_norm) {
    // unit_offset (Gemma 3): the reference's weights are 1 + w in fp32 (fold_norm_unit_offset).
    std::vector<float> qw = r.q_norm.values, kw = r.k_norm.values;
    if (unit_offset) {
      for (float& w : qw) w += 1.0f;
      for (float& w : kw) w += 1.0f;
    }
    const TensorView qv{qw.data(), DType::kF32, {hd}}, kv{kw.data(), DType::kF32, {hd}};
    if (!cpu::rms_norm_per_head(ctx, r.pre_q, qv, eps).is_ok() ||
        !cpu::rms_norm_per_head(ctx, r.pre_k, kv, eps).is_ok()) {
      throw std::runtime_error("cpu rms_norm_per_head failed");
    }
  }
  r.ref_q = r.pre_q;
  r.ref_k = r.pre_k;
  // (A position outside the table is skipped by the GPU; clamp it here so the reference runs.)
  std::vector<int64_t> pos64(r.positions.begin(), r.positions.end());
  for (int64_t& p : pos64) p = std::clamp<int64_t>(p, 0, max_position - 1);
  const Status rope_st = cpu::apply_rope(ctx, *r.table, pos64, r.ref_q, r.ref_k);
  if (!rope_st.is_ok()) throw std::runtime_error(rope_st.to_string());

  // GPU.
  const int64_t half = hd / 2;
  const std::vector<float> cos_table(r.table->cos(0), r.table->cos(0) + max_position * half);
  const std::vector<float> sin_table(r.table->sin(0), r.table->sin(0) + max_position * half);
  const size_t cache_elems = num_blocks * block_size * r.token_kv();
  const size_t q_elems = n * c.num_heads * hd;
  DeviceBuffer d_qkv = upload(r.qkv.bits), d_cos = upload(cos_table), d_sin = upload(sin_table);
  DeviceBuffer d_pos = upload(r.positions), d_slots = upload(r.slots);
  DeviceBuffer d_qn, d_kn;
  if (c.qk_norm) {
    d_qn = upload(r.q_norm.bits);
    d_kn = upload(r.k_norm.bits);
  }
  DeviceBuffer d_q = upload(std::vector<uint16_t>(q_elems, kSentinel));
  DeviceBuffer d_k = fp8_cache ? upload(std::vector<uint8_t>(cache_elems, kFp8Sentinel))
                               : upload(std::vector<uint16_t>(cache_elems, kSentinel));
  DeviceBuffer d_v = fp8_cache ? upload(std::vector<uint8_t>(cache_elems, kFp8Sentinel))
                               : upload(std::vector<uint16_t>(cache_elems, kSentinel));
  RopeCacheArgs a;
  a.dtype = d;
  a.kv_cache_dtype = fp8_cache ? KvCacheDtype::kFp8E4M3 : KvCacheDtype::kAuto;
  a.qkv = d_qkv.get();
  a.constants.q_norm = d_qn.get();
  a.constants.k_norm = d_kn.get();
  a.constants.norm_unit_offset = unit_offset;
  a.constants.eps = eps;
  a.constants.cos = d_cos.as<float>();
  a.constants.sin = d_sin.as<float>();
  a.constants.max_position = max_position;
  a.positions = d_pos.as<int32_t>();
  a.slots = d_slots.as<int64_t>();
  a.num_tokens = n;
  a.num_heads = c.num_heads;
  a.num_kv_heads = c.num_kv_heads;
  a.head_dim = hd;
  a.q_out = d_q.get();
  a.k_cache = d_k.get();
  a.v_cache = d_v.get();
  a.num_blocks = num_blocks;
  a.block_size = block_size;
  r.status = rope_and_cache(a, nullptr);
  r.q_out = download<uint16_t>(d_q.get(), q_elems);
  if (fp8_cache) {
    r.k_fp8 = download<uint8_t>(d_k.get(), cache_elems);
    r.v_fp8 = download<uint8_t>(d_v.get(), cache_elems);
  } else {
    r.k_cache = download<uint16_t>(d_k.get(), cache_elems);
    r.v_cache = download<uint16_t>(d_v.get(), cache_elems);
  }
  return r;
}

// Bound for one rotated element vs the fp32 reference. With m = |x_i| + |x_partner| (the
// reference's pre-rotation values), the rounding of cos/sin, of both products and of the sum
// cost <= 0.5 ulp(ref) + 2 ulp(m); qk-norm's rounded inputs (<= 1.5 ulp each) add <= 2.1 ulp(m).
double rope_bound(DType d, bool qk_norm, float ref, float x, float partner) {
  const double m = std::fabs(static_cast<double>(x)) + std::fabs(static_cast<double>(partner));
  return 1.0 * ulp(d, ref) + (qk_norm ? 5.0 : 3.0) * ulp(d, m) + 1e-6;
}

// Checks q_out, the k/v cache slots written and that every other slot kept its sentinel.
void check_rope(const RopeRun& r) {
  const std::string what = label(r.dtype, "rope_and_cache " + describe(r.c));
  ASSERT_TRUE(r.status.is_ok()) << what << ": " << r.status.to_string();
  const int64_t hd = r.c.head_dim, half = hd / 2;
  auto partner = [&](int64_t i) { return (i % hd) < half ? i + half : i - half; };
  auto bounds = [&](const std::vector<float>& ref, const std::vector<float>& pre, int64_t begin,
                    int64_t count) {
    std::vector<double> b(count);
    for (int64_t i = 0; i < count; ++i) {
      const int64_t e = begin + i;
      b[i] = rope_bound(r.dtype, r.c.qk_norm, ref[e], pre[e], pre[partner(e)]);
    }
    return b;
  };
  // q: every token (slot or not).
  expect_within(from_bits(r.dtype, r.q_out), r.ref_q,
                bounds(r.ref_q, r.pre_q, 0, static_cast<int64_t>(r.ref_q.size())), what + " q");

  const int64_t kv = r.token_kv();
  std::vector<bool> written(r.num_blocks * r.block_size, false);
  for (int64_t t = 0; t < r.num_tokens; ++t) {
    const int64_t slot = r.slots[t];
    if (slot < 0) continue;
    written[slot] = true;
    const std::vector<uint16_t> k_bits(r.k_cache.begin() + slot * kv,
                                       r.k_cache.begin() + (slot + 1) * kv);
    const std::vector<float> ref_k(r.ref_k.begin() + t * kv, r.ref_k.begin() + (t + 1) * kv);
    expect_within(from_bits(r.dtype, k_bits), ref_k, bounds(r.ref_k, r.pre_k, t * kv, kv),
                  what + " k of token " + std::to_string(t) + " at slot " + std::to_string(slot));
    // v: copied unchanged from the qkv row.
    const auto v_src = r.qkv.bits.begin() + t * r.row() + (r.c.num_heads + r.c.num_kv_heads) * hd;
    expect_bits_equal(
        std::vector<uint16_t>(r.v_cache.begin() + slot * kv, r.v_cache.begin() + (slot + 1) * kv),
        std::vector<uint16_t>(v_src, v_src + kv),
        what + " v of token " + std::to_string(t) + " at slot " + std::to_string(slot));
  }
  for (size_t s = 0; s < written.size(); ++s) {
    if (written[s]) continue;
    for (int64_t i = 0; i < kv; ++i) {
      if (r.k_cache[s * kv + i] != kSentinel || r.v_cache[s * kv + i] != kSentinel) {
        ADD_FAILURE() << what << ": slot " << s << " was not written to but changed";
        break;
      }
    }
  }
}

const RopeCase kRopeCases[] = {
    {32, 8, 128, false, true},  // Llama 3 8B
    {32, 8, 128, true, false},  // Qwen3-style qk-norm
    {4, 2, 16, false, false},
    {4, 2, 16, true, true},
    {4, 2, 32, false, true},
    {4, 2, 32, true, false},
    {4, 2, 80, true, false},
    {2, 1, 256, true, true},
    {8, 8, 64, false, false},
    {6, 2, 6, false, true},
    {2, 1, 320, true, false},
    {2, 1, 1024, false, true},
    // half % P != 0 (P = a lane's pairs): the kernel reads and writes element by element.
    {4, 2, 66, true, false},
    {4, 2, 66, false, true},
    {2, 1, 196, false, false},
};

TEST(CudaRopeAndCache, MatchesCpu) {
  TESSERA_REQUIRE_GPU();
  for (DType d : kHalfTypes) {
    for (const RopeCase& c : kRopeCases) {
      // 7 tokens at random positions (one at 0, one at the last), two of them not stored.
      const int64_t max_position = 3000, num_blocks = 4, block_size = 4;
      std::mt19937 rng(static_cast<uint32_t>(c.head_dim * 31 + c.num_heads));
      std::vector<int32_t> positions(7);
      for (int32_t& p : positions) p = static_cast<int32_t>(rng() % max_position);
      positions[0] = 0;
      positions[5] = max_position - 1;
      std::vector<int64_t> slots(num_blocks * block_size);
      std::iota(slots.begin(), slots.end(), 0);
      std::shuffle(slots.begin(), slots.end(), rng);
      slots.resize(positions.size());
      slots[2] = -1;
      slots[6] = -1;
      const RopeRun r = run_rope(d, c, positions, slots, num_blocks, block_size, max_position,
                                 static_cast<uint32_t>(c.head_dim + c.num_kv_heads));
      check_rope(r);
    }
  }
}

// Without qk-norm every step is a correctly rounded fp32 op followed by a rounding to the dtype
// (the products of two dtype values are exact in fp32), so the GPU must reproduce transformers'
// q * cos + rotate_half(q) * sin in bf16/fp16 bit for bit.
TEST(CudaRopeAndCache, BitExactTransformersRounding) {
  TESSERA_REQUIRE_GPU();
  for (DType d : kHalfTypes) {
    for (const RopeCase& c : {RopeCase{32, 8, 128, false, true}, RopeCase{4, 2, 16, false, false},
                              RopeCase{4, 2, 80, false, false}, RopeCase{4, 2, 66, false, false}}) {
      const std::vector<int32_t> positions = {0, 1, 17, 1000, 4095};
      const std::vector<int64_t> slots = {0, 1, 2, 3, 4};
      const RopeRun r = run_rope(d, c, positions, slots, 2, 4, 4096, 77);
      ASSERT_TRUE(r.status.is_ok()) << r.status.to_string();
      const int64_t hd = c.head_dim, half = hd / 2;
      std::vector<uint16_t> want_q(r.q_out.size()), got_k, want_k;
      for (int64_t t = 0; t < r.num_tokens; ++t) {
        const float* cs = r.table->cos(positions[t]);
        const float* sn = r.table->sin(positions[t]);
        const float* row = r.qkv.values.data() + t * r.row();
        auto rotate = [&](const float* x, uint16_t* out) {
          for (int64_t i = 0; i < half; ++i) {
            const float cr = round_to(d, cs[i]), sr = round_to(d, sn[i]);
            const float a = x[i], b = x[i + half];
            out[i] = to_bits(d, round_to(d, a * cr) + round_to(d, -b * sr));
            out[i + half] = to_bits(d, round_to(d, b * cr) + round_to(d, a * sr));
          }
        };
        for (int64_t h = 0; h < c.num_heads; ++h)
          rotate(row + h * hd, want_q.data() + (t * c.num_heads + h) * hd);
        std::vector<uint16_t> k(r.token_kv());
        for (int64_t h = 0; h < c.num_kv_heads; ++h)
          rotate(row + (c.num_heads + h) * hd, k.data() + h * hd);
        want_k.insert(want_k.end(), k.begin(), k.end());
        got_k.insert(got_k.end(), r.k_cache.begin() + slots[t] * r.token_kv(),
                     r.k_cache.begin() + (slots[t] + 1) * r.token_kv());
      }
      expect_bits_equal(r.q_out, want_q, label(d, describe(c) + " q"));
      expect_bits_equal(got_k, want_k, label(d, describe(c) + " k"));
    }
  }
}

// K/V land in exactly slot = block_id * block_size + offset, for tokens spread over blocks in any
// order; -1 and out-of-range slots store nothing (their q is still written), and every other
// slot keeps its previous contents. A position outside the table skips the token entirely.
TEST(CudaRopeAndCache, WritesExactlyTheGivenSlots) {
  TESSERA_REQUIRE_GPU();
  for (DType d : kHalfTypes) {
    const RopeCase c{4, 2, 32, false, false};
    const int64_t num_blocks = 3, block_size = 16, max_position = 64;
    const std::vector<int32_t> positions = {5, 6, 7, 8, 9, 10, 64};
    const std::vector<int64_t> slots = {17, -1, 0, 47, 31, 48, 3};
    const RopeRun r = run_rope(d, c, positions, slots, num_blocks, block_size, max_position, 5);
    ASSERT_TRUE(r.status.is_ok()) << r.status.to_string();
    const int64_t kv = r.token_kv(), q_row = c.num_heads * c.head_dim;
    for (int64_t s = 0; s < num_blocks * block_size; ++s) {
      const auto at = std::find(slots.begin(), slots.end() - 2, s);  // the stored tokens
      const bool stored = at != slots.end() - 2;
      const int64_t t = at - slots.begin();
      for (int64_t i = 0; i < kv; ++i) {
        const uint16_t kb = r.k_cache[s * kv + i], vb = r.v_cache[s * kv + i];
        if (!stored) {
          ASSERT_EQ(kb, kSentinel) << label(d, "k slot ") << s << " changed";
          ASSERT_EQ(vb, kSentinel) << label(d, "v slot ") << s << " changed";
        } else {
          ASSERT_EQ(vb, r.qkv.bits[t * r.row() + (c.num_heads + c.num_kv_heads) * c.head_dim + i])
              << label(d, "v slot ") << s << " should hold token " << t;
          ASSERT_NE(kb, kSentinel) << label(d, "k slot ") << s << " was not written";
        }
      }
    }
    for (int64_t t = 0; t < 6; ++t) {  // q of tokens 1 (slot -1) and 5 (slot 48) written too
      for (int64_t i = 0; i < q_row; ++i) ASSERT_NE(r.q_out[t * q_row + i], kSentinel) << t;
    }
    for (int64_t i = 0; i < q_row; ++i) ASSERT_EQ(r.q_out[6 * q_row + i], kSentinel);
  }
}

// An FP8 cache (--kv-cache-dtype fp8) holds exactly the E4M3 rounding (nearest even,
// saturating; common/tensor.h's, which the CPU backend uses) of what a 16-bit cache holds, for
// k after RoPE (and qk-norm) and for v; q is unchanged; other slots keep their bytes.
TEST(CudaRopeAndCache, Fp8CacheHoldsTheE4M3RoundingOfTheDtypeValues) {
  TESSERA_REQUIRE_GPU();
  for (DType d : kHalfTypes) {
    for (const RopeCase& c : {RopeCase{32, 8, 128, false, true}, RopeCase{4, 2, 80, true, false},
                              RopeCase{2, 1, 256, true, true}, RopeCase{6, 2, 6, false, true}}) {
      const std::vector<int32_t> positions = {0, 3, 17, 1000, 4095, 9};
      const std::vector<int64_t> slots = {5, 0, -1, 2, 7, 3};
      const RopeRun wide = run_rope(d, c, positions, slots, 2, 4, 4096, 91);
      const RopeRun fp8 = run_rope(d, c, positions, slots, 2, 4, 4096, 91, true);
      ASSERT_TRUE(wide.status.is_ok()) << wide.status.to_string();
      ASSERT_TRUE(fp8.status.is_ok()) << fp8.status.to_string();
      expect_bits_equal(fp8.q_out, wide.q_out, label(d, describe(c) + " fp8 run's q"));
      const int64_t kv = wide.token_kv();
      int64_t saturated_or_rounded = 0;
      for (int64_t s = 0; s < 8; ++s) {
        const bool stored = std::find(slots.begin(), slots.end(), s) != slots.end();
        for (int64_t i = 0; i < kv; ++i) {
          const size_t e = static_cast<size_t>(s * kv + i);
          if (!stored) {
            ASSERT_EQ(fp8.k_fp8[e], kFp8Sentinel) << label(d, describe(c)) << " slot " << s;
            ASSERT_EQ(fp8.v_fp8[e], kFp8Sentinel) << label(d, describe(c)) << " slot " << s;
            continue;
          }
          const float kw = from_bits(d, wide.k_cache[e]);
          const float vw = from_bits(d, wide.v_cache[e]);
          ASSERT_EQ(fp8.k_fp8[e], float_to_fp8_e4m3(kw))
              << label(d, describe(c)) << " k slot " << s << " elem " << i << " value " << kw;
          ASSERT_EQ(fp8.v_fp8[e], float_to_fp8_e4m3(vw))
              << label(d, describe(c)) << " v slot " << s << " elem " << i << " value " << vw;
          saturated_or_rounded += fp8_e4m3_to_float(fp8.k_fp8[e]) != kw;
        }
      }
      EXPECT_GT(saturated_or_rounded, 0) << "no k value needed rounding: the test is vacuous";
    }
  }
}

// ---- silu_mul ----

// out = round(round(silu(g)) * u): <= 1.5 ulp from the fp32 reference; bound 2 ulp(|ref|).
constexpr double kSiluUlps = 2.0;
constexpr double kSiluAbs = 1e-7;

TEST(CudaSiluMul, MatchesCpu) {
  TESSERA_REQUIRE_GPU();
  cpu::CpuContext ctx(1);
  for (DType d : kHalfTypes) {
    for (int64_t inter : {64, 100, 4096, 14336}) {
      for (int64_t rows : {1, 3, 9}) {   // 9: two full groups of four rows and one more
        for (int64_t offset : {0, 1}) {  // 1: misaligned buffers (the scalar path)
          const std::string what =
              label(d, "silu_mul inter " + std::to_string(inter) + " rows " + std::to_string(rows) +
                           " offset " + std::to_string(offset));
          HalfTensor gu = random_half(d, rows * 2 * inter, 40 + inter + rows, -2.0f, 2.0f);
          const HalfTensor gate = random_half(d, rows * inter, 50 + inter, -10.0f, 10.0f);
          for (int64_t r = 0; r < rows; ++r) {  // gates over a wider range than the ups
            for (int64_t i = 0; i < inter; ++i) {
              gu.bits[r * 2 * inter + i] = gate.bits[r * inter + i];
              gu.values[r * 2 * inter + i] = gate.values[r * inter + i];
            }
          }
          std::vector<float> ref(rows * inter);
          ASSERT_TRUE(cpu::silu_mul_fused(ctx, gu.values, inter, ref).is_ok());

          DeviceBuffer d_gu = alloc((gu.bits.size() + offset) * 2);
          upload_to(static_cast<uint16_t*>(d_gu.get()) + offset, gu.bits);
          DeviceBuffer d_out = alloc((ref.size() + offset) * 2);
          uint16_t* out = static_cast<uint16_t*>(d_out.get()) + offset;
          ASSERT_TRUE(
              silu_mul(d, static_cast<uint16_t*>(d_gu.get()) + offset, rows, inter, out, nullptr)
                  .is_ok());
          expect_within_ulps(from_bits(d, download<uint16_t>(out, ref.size())), ref, d, kSiluUlps,
                             kSiluAbs, what);
        }
      }
    }
  }
}

// add_bias: each element once rounded, out + bias[column], bit for bit.
TEST(CudaAddBias, RoundsOutPlusBiasOnce) {
  TESSERA_REQUIRE_GPU();
  for (DType d : kHalfTypes) {
    for (auto [rows, cols] : {std::pair<int64_t, int64_t>{1, 8}, {7, 4096 + 3}, {300, 64}}) {
      const HalfTensor out = random_half(d, rows * cols, 60 + rows, -4.0f, 4.0f);
      const HalfTensor bias = random_half(d, cols, 61 + cols, -1.0f, 1.0f);
      std::vector<uint16_t> want(out.bits.size());
      for (int64_t i = 0; i < rows * cols; ++i) {
        want[i] = to_bits(d, out.values[i] + bias.values[i % cols]);
      }
      DeviceBuffer d_out = alloc(out.bits.size() * 2);
      upload_to(static_cast<uint16_t*>(d_out.get()), out.bits);
      DeviceBuffer d_bias = alloc(bias.bits.size() * 2);
      upload_to(static_cast<uint16_t*>(d_bias.get()), bias.bits);
      ASSERT_TRUE(add_bias(d, d_out.get(), d_bias.get(), rows, cols, nullptr).is_ok());
      EXPECT_EQ(download<uint16_t>(d_out.get(), want.size()), want)
          << label(d, "add_bias " + std::to_string(rows) + " x " + std::to_string(cols));
    }
  }
  EXPECT_FALSE(add_bias(DType::kF32, nullptr, nullptr, 1, 1, nullptr).is_ok());
  EXPECT_FALSE(add_bias(DType::kBF16, nullptr, nullptr, 1, 1, nullptr).is_ok());
}

// More rows than the grid covers at once (4 rows a thread, 65535 CTAs down): the row loop.
TEST(CudaSiluMul, RowsPastOneGrid) {
  TESSERA_REQUIRE_GPU();
  cpu::CpuContext ctx(1);
  const DType d = DType::kBF16;
  const int64_t inter = 8, rows = 4 * 65535 + 5;
  const HalfTensor gu = random_half(d, rows * 2 * inter, 7, -6.0f, 6.0f);
  std::vector<float> ref(rows * inter);
  ASSERT_TRUE(cpu::silu_mul_fused(ctx, gu.values, inter, ref).is_ok());
  DeviceBuffer d_gu = alloc(gu.bits.size() * 2);
  upload_to(static_cast<uint16_t*>(d_gu.get()), gu.bits);
  DeviceBuffer d_out = alloc(ref.size() * 2);
  ASSERT_TRUE(silu_mul(d, d_gu.get(), rows, inter, d_out.get(), nullptr).is_ok());
  expect_within_ulps(from_bits(d, download<uint16_t>(d_out.get(), ref.size())), ref, d, kSiluUlps,
                     kSiluAbs, "silu_mul rows " + std::to_string(rows));
}

// ---- convert ----

// What the weight upload did on the host before the GPU converted: TensorView::at decodes the
// element (any stored dtype), float_to_bf16 / float_to_f16 encode it (fp32: its bits).
std::vector<uint8_t> host_convert(DType from, const std::vector<uint8_t>& src, DType to) {
  const size_t n = src.size() / dtype_size(from), esize = dtype_size(to);
  TensorView view{src.data(), from, {static_cast<int64_t>(n)}};
  std::vector<uint8_t> out(n * esize);
  for (size_t i = 0; i < n; ++i) {
    const float f = view.at(static_cast<int64_t>(i));
    if (to == DType::kF32) {
      std::memcpy(out.data() + 4 * i, &f, 4);
    } else {
      const uint16_t h = to == DType::kBF16 ? float_to_bf16(f) : float_to_f16(f);
      std::memcpy(out.data() + 2 * i, &h, 2);
    }
  }
  return out;
}

// The stored bits of element i, as hex.
std::string hex_bits(DType d, const std::vector<uint8_t>& v, size_t i) {
  const size_t es = dtype_size(d);
  uint32_t b = 0;
  std::memcpy(&b, v.data() + i * es, es);  // little-endian: the element's value
  char text[16];
  std::snprintf(text, sizeof(text), "0x%0*x", static_cast<int>(2 * es), b);
  return text;
}

// fp32 bit patterns for convert: specials (infinities, NaNs with payloads and signs, signalling
// NaNs), zeros, the largest and smallest floats, every boundary of float_to_f16 (overflow at
// 0x477ff000, subnormal results below 0x38800000, zero below 0x33000000) and its neighbours,
// every upper half-word with the low half-words that decide bf16 and fp16 rounding (ties, one
// either side, all ones), a stride through all 2^32 patterns and random values.
std::vector<uint32_t> f32_patterns() {
  std::vector<uint32_t> p = {0x00000000u, 0x80000000u, 0x7f800000u, 0xff800000u, 0x7fc00000u,
                             0xffc00000u, 0x7f800001u, 0xff800001u, 0x7fbfffffu, 0x7fc00001u,
                             0x7fffffffu, 0xffffffffu, 0x7f7fffffu, 0xff7fffffu, 0x00000001u,
                             0x80000001u, 0x007fffffu, 0x00800000u, 0x3f800000u, 0xbf800000u};
  for (uint32_t edge : {0x477ff000u, 0x477fe000u, 0x47800000u, 0x38800000u, 0x33000000u,
                        0x33800000u, 0x387fe000u, 0x38000000u, 0x7f7f8000u, 0x7f7fffffu}) {
    for (uint32_t d = 0; d < 64; ++d) {
      for (uint32_t sign : {0u, 0x80000000u}) {
        p.push_back(sign | (edge + d));
        p.push_back(sign | (edge - d));
      }
    }
  }
  for (uint32_t hi = 0; hi < 65536; ++hi) {
    for (uint32_t lo : {0x0000u, 0x0001u, 0x0fffu, 0x1000u, 0x1001u, 0x1fffu, 0x2000u, 0x3000u,
                        0x7fffu, 0x8000u, 0x8001u, 0xf000u, 0xffffu}) {
      p.push_back(hi << 16 | lo);
    }
  }
  for (uint64_t b = 0; b < (1ull << 32); b += 1021) p.push_back(static_cast<uint32_t>(b));
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> mant(-1.0f, 1.0f);
  std::uniform_int_distribution<int> expo(-40, 40);
  for (int i = 0; i < 100000; ++i) {
    const float f = std::ldexp(mant(rng), expo(rng));
    uint32_t b;
    std::memcpy(&b, &f, 4);
    p.push_back(b);
  }
  return p;
}

// Every 16-bit pattern of bf16 and fp16, every E4M3 byte, and several million fp32 patterns,
// converted to each of fp32, fp16 and bf16: bit for bit what the host functions give (the weight
// upload's conversion moved from them to the GPU), NaNs included. 5 million elements is also
// past the kernel's 8192 x 256 threads: its grid-stride loop runs.
TEST(CudaConvert, MatchesTheHostConversionBitForBit) {
  TESSERA_REQUIRE_GPU();
  const std::vector<uint32_t> f32 = f32_patterns();
  std::vector<uint8_t> f32_bytes(f32.size() * 4);
  std::memcpy(f32_bytes.data(), f32.data(), f32_bytes.size());
  std::vector<uint8_t> half_bytes(65536 * 2);
  for (uint32_t b = 0; b < 65536; ++b) {
    const uint16_t h = static_cast<uint16_t>(b);
    std::memcpy(half_bytes.data() + 2 * b, &h, 2);
  }
  std::vector<uint8_t> fp8_bytes(256);
  std::iota(fp8_bytes.begin(), fp8_bytes.end(), uint8_t{0});

  for (DType from : {DType::kF32, DType::kF16, DType::kBF16, DType::kF8E4M3}) {
    for (DType to : {DType::kF32, DType::kF16, DType::kBF16}) {
      const std::vector<uint8_t>& src = from == DType::kF32      ? f32_bytes
                                        : from == DType::kF8E4M3 ? fp8_bytes
                                                                 : half_bytes;
      const size_t n = src.size() / dtype_size(from);
      const std::vector<uint8_t> want = host_convert(from, src, to);
      DeviceBuffer d_src = upload(src);
      DeviceBuffer d_dst = alloc(want.size());
      ASSERT_TRUE(
          convert(from, d_src.get(), to, d_dst.get(), static_cast<int64_t>(n), nullptr).is_ok());
      const std::vector<uint8_t> got = download<uint8_t>(d_dst.get(), want.size());
      const size_t esize = dtype_size(to);
      size_t failures = 0;
      for (size_t i = 0; i < n; ++i) {
        if (std::memcmp(got.data() + i * esize, want.data() + i * esize, esize) == 0) continue;
        if (++failures <= 5) {
          ADD_FAILURE() << "convert " << dtype_name(from) << " -> " << dtype_name(to) << " of "
                        << hex_bits(from, src, i) << " (element " << i << "): got "
                        << hex_bits(to, got, i) << ", the host gives " << hex_bits(to, want, i);
        }
      }
      EXPECT_EQ(failures, 0u) << dtype_name(from) << " -> " << dtype_name(to) << " of " << n;
    }
  }
}

// The weight upload converts chunks into the middle of its allocation: a destination at any
// element offset, an odd count, and nothing written outside [dst, dst + n).
TEST(CudaConvert, WritesExactlyItsElementsAtAnyOffset) {
  TESSERA_REQUIRE_GPU();
  const int64_t n = 1001, pad = 64;
  std::vector<float> values(n);
  for (int64_t i = 0; i < n; ++i) values[i] = 0.37f * static_cast<float>(i - 500);
  DeviceBuffer d_src = upload(values);
  for (DType to : {DType::kF16, DType::kBF16, DType::kF32}) {
    const size_t es = dtype_size(to);
    for (int64_t offset : {int64_t{0}, int64_t{1}, int64_t{3}}) {
      DeviceBuffer d_dst = upload(std::vector<uint8_t>((n + 2 * pad) * es, 0xa5));
      char* at = d_dst.as<char>() + static_cast<size_t>(pad + offset) * es;
      ASSERT_TRUE(convert(DType::kF32, d_src.get(), to, at, n, nullptr).is_ok());
      const std::vector<uint8_t> got = download<uint8_t>(d_dst.get(), (n + 2 * pad) * es);
      std::vector<uint8_t> src_bytes(n * 4);
      std::memcpy(src_bytes.data(), values.data(), src_bytes.size());
      const std::vector<uint8_t> want = host_convert(DType::kF32, src_bytes, to);
      const size_t begin = static_cast<size_t>(pad + offset) * es, end = begin + n * es;
      EXPECT_EQ(std::memcmp(got.data() + begin, want.data(), want.size()), 0)
          << dtype_name(to) << " at offset " << offset;
      for (size_t b = 0; b < got.size(); ++b) {
        if (b >= begin && b < end) continue;
        ASSERT_EQ(got[b], 0xa5) << "byte " << b << " outside the destination was written ("
                                << dtype_name(to) << ", offset " << offset << ")";
      }
    }
  }
}

// ---- argument checks and graph capture ----

// Every bad argument is INVALID_ARGUMENT, reported before anything is launched: the output keeps
// its sentinel and no CUDA error is pending.
TEST(CudaElementwise, BadArgumentsAreInvalidArgumentWithoutLaunching) {
  TESSERA_REQUIRE_GPU();
  const int64_t rows = 2, hidden = 64;
  DeviceBuffer x = upload(std::vector<uint16_t>(rows * hidden * 2, 0x3f80));
  DeviceBuffer res = upload(std::vector<uint16_t>(rows * hidden, 0x3f80));
  DeviceBuffer w = upload(std::vector<uint16_t>(hidden * 2, 0x3f80));
  DeviceBuffer out = upload(std::vector<uint16_t>(rows * hidden * 4, kSentinel));
  DeviceBuffer ids = upload(std::vector<int32_t>{0, 1});
  DeviceBuffer slots = upload(std::vector<int64_t>{0, 1});
  DeviceBuffer trig = upload(std::vector<float>(16 * 128, 0.5f));
  const DType bf16 = DType::kBF16;
  auto expect_invalid = [&](const Status& st, const std::string& what) {
    EXPECT_EQ(st.code(), Code::kInvalidArgument) << what << ": " << st.to_string();
    EXPECT_FALSE(st.message().empty()) << what;
  };

  expect_invalid(embedding(bf16, ids.as<int32_t>(), -1, w.get(), 2, hidden, out.get(), nullptr),
                 "embedding num_tokens -1");
  expect_invalid(embedding(bf16, ids.as<int32_t>(), 2, w.get(), 0, hidden, out.get(), nullptr),
                 "embedding vocab 0");
  expect_invalid(embedding(bf16, ids.as<int32_t>(), 2, w.get(), 2, 0, out.get(), nullptr),
                 "embedding hidden 0");
  expect_invalid(embedding(bf16, nullptr, 2, w.get(), 2, hidden, out.get(), nullptr),
                 "embedding ids null");
  expect_invalid(gather_rows(bf16, x.get(), 0, ids.as<int32_t>(), 2, hidden, out.get(), nullptr),
                 "gather_rows src_rows 0");
  expect_invalid(gather_rows(bf16, x.get(), 2, ids.as<int32_t>(), 2, hidden, nullptr, nullptr),
                 "gather_rows dst null");
  expect_invalid(rms_norm(DType::kF32, x.get(), w.get(), rows, hidden, 1e-6f, out.get(), nullptr),
                 "rms_norm F32");
  expect_invalid(rms_norm(bf16, x.get(), w.get(), -1, hidden, 1e-6f, out.get(), nullptr),
                 "rms_norm rows -1");
  expect_invalid(rms_norm(bf16, x.get(), w.get(), rows, 0, 1e-6f, out.get(), nullptr),
                 "rms_norm hidden 0");
  expect_invalid(rms_norm(bf16, x.get(), nullptr, rows, hidden, 1e-6f, out.get(), nullptr),
                 "rms_norm weight null");
  expect_invalid(
      add_rms_norm(bf16, x.get(), res.get(), w.get(), rows, 0, 1e-6f, out.get(), nullptr),
      "add_rms_norm hidden 0");
  expect_invalid(
      add_rms_norm(bf16, x.get(), nullptr, w.get(), rows, hidden, 1e-6f, out.get(), nullptr),
      "add_rms_norm residual null");
  expect_invalid(
      add_rms_norm(bf16, x.get(), out.get(), w.get(), rows, hidden, 1e-6f, out.get(), nullptr),
      "add_rms_norm residual aliases out");
  expect_invalid(silu_mul(DType::kF32, x.get(), rows, hidden, out.get(), nullptr), "silu_mul F32");
  expect_invalid(silu_mul(bf16, x.get(), rows, 0, out.get(), nullptr), "silu_mul inter 0");
  expect_invalid(silu_mul(bf16, x.get(), -3, hidden, out.get(), nullptr), "silu_mul rows -3");
  expect_invalid(convert(bf16, x.get(), DType::kF16, out.get(), -1, nullptr), "convert n -1");
  expect_invalid(convert(static_cast<DType>(7), x.get(), DType::kF16, out.get(), 4, nullptr),
                 "convert unknown dtype");
  expect_invalid(convert(DType::kI32, x.get(), DType::kF16, out.get(), 4, nullptr),
                 "convert from I32");
  expect_invalid(convert(bf16, x.get(), DType::kF8E4M3, out.get(), 4, nullptr),
                 "convert to F8_E4M3");

  RopeCacheArgs good;
  good.dtype = bf16;
  good.qkv = x.get();
  good.constants.cos = trig.as<float>();
  good.constants.sin = trig.as<float>();
  good.constants.max_position = 16;
  good.positions = ids.as<int32_t>();
  good.slots = slots.as<int64_t>();
  good.num_tokens = 1;
  good.num_heads = 1;
  good.num_kv_heads = 1;
  good.head_dim = 16;
  good.q_out = out.get();
  good.k_cache = out.get();
  good.v_cache = res.get();
  good.num_blocks = 1;
  good.block_size = 4;
  auto bad = [&](auto edit, const std::string& what) {
    RopeCacheArgs a = good;
    edit(a);
    expect_invalid(rope_and_cache(a, nullptr), "rope_and_cache " + what);
  };
  bad([](RopeCacheArgs& a) { a.dtype = DType::kF32; }, "dtype F32");
  bad([](RopeCacheArgs& a) { a.head_dim = 15; }, "odd head_dim");
  bad([](RopeCacheArgs& a) { a.head_dim = 1026; }, "head_dim 1026");
  bad([](RopeCacheArgs& a) { a.head_dim = 0; }, "head_dim 0");
  bad([](RopeCacheArgs& a) { a.num_heads = 0; }, "num_heads 0");
  bad([](RopeCacheArgs& a) { a.num_kv_heads = -1; }, "num_kv_heads -1");
  bad([](RopeCacheArgs& a) { a.num_tokens = -1; }, "num_tokens -1");
  bad([](RopeCacheArgs& a) { a.constants.max_position = 0; }, "max_position 0");
  bad([](RopeCacheArgs& a) { a.num_blocks = 0; }, "num_blocks 0");
  bad([](RopeCacheArgs& a) { a.block_size = 0; }, "block_size 0");
  bad([&](RopeCacheArgs& a) { a.constants.q_norm = w.get(); }, "q_norm without k_norm");
  bad([](RopeCacheArgs& a) { a.constants.cos = nullptr; }, "cos null");
  bad([](RopeCacheArgs& a) { a.slots = nullptr; }, "slots null");

  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  const std::vector<uint16_t> after = download<uint16_t>(out.get(), rows * hidden * 4);
  EXPECT_TRUE(std::all_of(after.begin(), after.end(), [](uint16_t b) { return b == kSentinel; }))
      << "a rejected call wrote its output";

  // Empty work is fine and launches nothing.
  EXPECT_TRUE(rms_norm(bf16, nullptr, nullptr, 0, hidden, 1e-6f, nullptr, nullptr).is_ok());
  EXPECT_TRUE(silu_mul(bf16, nullptr, 0, hidden, nullptr, nullptr).is_ok());
  EXPECT_TRUE(convert(bf16, nullptr, DType::kF32, nullptr, 0, nullptr).is_ok());
  RopeCacheArgs empty = good;
  empty.num_tokens = 0;
  EXPECT_TRUE(rope_and_cache(empty, nullptr).is_ok());
}

// The ops can be captured into a CUDA graph (no allocation or synchronisation inside) and the
// replay computes what a direct launch does.
TEST(CudaElementwise, CapturesIntoACudaGraph) {
  TESSERA_REQUIRE_GPU();
  const DType d = DType::kBF16;
  const int64_t rows = 3, hidden = 4096, inter = 1024;
  const HalfTensor x = random_half(d, rows * hidden, 1), w = random_half(d, hidden, 2);
  const HalfTensor gu = random_half(d, rows * 2 * inter, 3, -4.0f, 4.0f);
  DeviceBuffer d_x = upload(x.bits), d_w = upload(w.bits), d_gu = upload(gu.bits);
  DeviceBuffer d_norm_direct = alloc(x.bits.size() * 2), d_norm_graph = alloc(x.bits.size() * 2);
  DeviceBuffer d_act_direct = alloc(rows * inter * 2), d_act_graph = alloc(rows * inter * 2);
  ASSERT_TRUE(
      rms_norm(d, d_x.get(), d_w.get(), rows, hidden, 1e-5f, d_norm_direct.get(), nullptr).is_ok());
  ASSERT_TRUE(silu_mul(d, d_gu.get(), rows, inter, d_act_direct.get(), nullptr).is_ok());
  sync();

  cudaStream_t stream;
  check_cuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  check_cuda(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), "begin capture");
  const Status st1 =
      rms_norm(d, d_x.get(), d_w.get(), rows, hidden, 1e-5f, d_norm_graph.get(), stream);
  const Status st2 = silu_mul(d, d_gu.get(), rows, inter, d_act_graph.get(), stream);
  cudaGraph_t graph = nullptr;
  const cudaError_t end = cudaStreamEndCapture(stream, &graph);
  EXPECT_TRUE(st1.is_ok()) << st1.to_string();
  EXPECT_TRUE(st2.is_ok()) << st2.to_string();
  check_cuda(end, "end capture");
  cudaGraphExec_t exec = nullptr;
  check_cuda(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
  check_cuda(cudaGraphLaunch(exec, stream), "graph launch");
  check_cuda(cudaStreamSynchronize(stream), "stream sync");
  EXPECT_TRUE(download<uint16_t>(d_norm_graph.get(), x.bits.size()) ==
              download<uint16_t>(d_norm_direct.get(), x.bits.size()));
  EXPECT_TRUE(download<uint16_t>(d_act_graph.get(), rows * inter) ==
              download<uint16_t>(d_act_direct.get(), rows * inter));
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

// The kernels start while the one before them finishes (programmatic dependent launch) and must
// wait for its writes: eight rounds of residual += d (add_residual) then out_i =
// rms_norm(residual), back to back on a stream and in a graph, give the bits of the same ops run
// one at a time with the device idle between them.
// fill_uniform (--load-format dummy's weights) against its formula on the host: bit for bit
// in fp32 and after bf16 / fp16 rounding; the values span [-scale, scale).
TEST(CudaElementwise, FillUniformIsItsFormula) {
  TESSERA_REQUIRE_GPU();
  const int64_t n = 3 * 8192 * 256 + 77;  // past one grid-stride pass
  const uint64_t seed = 0x7e55e4a;
  const float scale = 1e-3f;
  auto expected = [&](int64_t i) {
    uint64_t z = seed + static_cast<uint64_t>(i) + 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return scale * (static_cast<float>(z >> 40) * (2.0f / 16777216.0f) - 1.0f);
  };
  for (DType d : {DType::kF32, DType::kBF16, DType::kF16}) {
    SCOPED_TRACE(dtype_name(d));
    auto buf = DeviceBuffer::allocate(n * dtype_size(d), "fill");
    ASSERT_TRUE(buf);
    ASSERT_TRUE(fill_uniform(d, buf->get(), n, seed, scale, nullptr).is_ok());
    std::vector<uint8_t> host(n * dtype_size(d));
    check_cuda(cudaMemcpy(host.data(), buf->get(), host.size(), cudaMemcpyDeviceToHost), "copy");
    float lo = 1, hi = -1;
    for (int64_t i = 0; i < n; ++i) {
      float got = 0, want = expected(i);
      if (d == DType::kF32) {
        std::memcpy(&got, host.data() + 4 * i, 4);
      } else {
        uint16_t bits = 0;
        std::memcpy(&bits, host.data() + 2 * i, 2);
        got = d == DType::kBF16 ? bf16_to_float(bits) : f16_to_float(bits);
        want = d == DType::kBF16 ? bf16_to_float(float_to_bf16(want))
                                 : f16_to_float(float_to_f16(want));
      }
      ASSERT_EQ(got, want) << "element " << i;
      lo = std::min(lo, got);
      hi = std::max(hi, got);
    }
    EXPECT_LT(lo, -0.99f * scale);
    EXPECT_GT(hi, 0.99f * scale);
  }
}

TEST(CudaElementwise, ChainedKernelsSeeTheWritesOfTheOneBefore) {
  TESSERA_REQUIRE_GPU();
  const DType d = DType::kBF16;
  const int64_t rows = 64, hidden = 4096, n = rows * hidden;
  constexpr int kRounds = 8;
  const HalfTensor x = random_half(d, n, 11), delta = random_half(d, n, 12, -0.25f, 0.25f);
  const HalfTensor w = random_half(d, hidden, 13, 0.5f, 1.5f);
  DeviceBuffer d_delta = upload(delta.bits), d_w = upload(w.bits);
  // One run's buffers: x from its starting values, and the eight outputs.
  struct Run {
    DeviceBuffer x;
    std::vector<DeviceBuffer> outs;
  };
  auto make_run = [&] {
    Run r{upload(x.bits), {}};
    for (int i = 0; i < kRounds; ++i) r.outs.push_back(alloc(n * 2));
    return r;
  };
  auto enqueue = [&](Run& r, cudaStream_t stream, bool one_at_a_time) {
    for (int i = 0; i < kRounds; ++i) {
      EXPECT_TRUE(add_residual(d, d_delta.get(), r.x.get(), n, stream).is_ok());
      if (one_at_a_time) sync();
      EXPECT_TRUE(
          rms_norm(d, r.x.get(), d_w.get(), rows, hidden, 1e-5f, r.outs[i].get(), stream).is_ok());
      if (one_at_a_time) sync();
    }
  };
  auto bits = [&](const Run& r) {
    std::vector<std::vector<uint16_t>> b;
    for (const DeviceBuffer& o : r.outs) b.push_back(download<uint16_t>(o.get(), n));
    return b;
  };
  Run alone = make_run();
  enqueue(alone, nullptr, true);
  const auto want = bits(alone);

  cudaStream_t stream;
  check_cuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  Run streamed = make_run();
  enqueue(streamed, stream, false);
  check_cuda(cudaStreamSynchronize(stream), "stream sync");
  EXPECT_TRUE(bits(streamed) == want) << "back to back on a stream";

  Run graphed = make_run();
  check_cuda(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), "begin capture");
  enqueue(graphed, stream, false);
  cudaGraph_t graph = nullptr;
  check_cuda(cudaStreamEndCapture(stream, &graph), "end capture");
  cudaGraphExec_t exec = nullptr;
  check_cuda(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
  check_cuda(cudaGraphLaunch(exec, stream), "graph launch");
  check_cuda(cudaStreamSynchronize(stream), "stream sync");
  EXPECT_TRUE(bits(graphed) == want) << "in a graph";
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

// ---- Gemma / Phi-3: gelu_tanh_mul, scale_embedding, softcap_logits, partial rotary ----

// gelu_tanh_mul against cpu::gelu_tanh_mul on the same rounded gate/up: round(round(gelu(g)) * u)
// is <= 1.5 ulp from the fp32 reference (tanhf vs std::tanh differ by a few fp32 ulps, far below
// a bf16/fp16 ulp), both the vector path and the misaligned scalar one.
TEST(CudaGeluTanhMul, MatchesCpu) {
  TESSERA_REQUIRE_GPU();
  cpu::CpuContext ctx(1);
  for (DType d : kHalfTypes) {
    for (int64_t inter : {64, 100, 176, 14336}) {
      for (int64_t rows : {1, 3, 9}) {
        for (int64_t offset : {0, 1}) {
          const std::string what =
              label(d, "gelu_tanh_mul inter " + std::to_string(inter) + " rows " +
                           std::to_string(rows) + " offset " + std::to_string(offset));
          const HalfTensor gu = random_half(d, rows * 2 * inter, 70 + inter + rows, -6.0f, 6.0f);
          std::vector<float> gate(rows * inter), up(rows * inter), ref(rows * inter);
          for (int64_t r = 0; r < rows; ++r) {
            for (int64_t i = 0; i < inter; ++i) {
              gate[r * inter + i] = gu.values[r * 2 * inter + i];
              up[r * inter + i] = gu.values[r * 2 * inter + inter + i];
            }
          }
          ASSERT_TRUE(cpu::gelu_tanh_mul(ctx, gate, up, ref).is_ok());
          DeviceBuffer d_gu = alloc((gu.bits.size() + offset) * 2);
          upload_to(static_cast<uint16_t*>(d_gu.get()) + offset, gu.bits);
          DeviceBuffer d_out = alloc((ref.size() + offset) * 2);
          uint16_t* out = static_cast<uint16_t*>(d_out.get()) + offset;
          ASSERT_TRUE(gelu_tanh_mul(d, static_cast<uint16_t*>(d_gu.get()) + offset, rows, inter,
                                    out, nullptr)
                          .is_ok());
          expect_within_ulps(from_bits(d, download<uint16_t>(out, ref.size())), ref, d, kSiluUlps,
                             kSiluAbs, what);
        }
      }
    }
  }
  int16_t dummy = 0;
  EXPECT_FALSE(gelu_tanh_mul(DType::kF32, &dummy, 1, 1, &dummy, nullptr).is_ok());
  EXPECT_FALSE(gelu_tanh_mul(DType::kBF16, &dummy, 1, 0, &dummy, nullptr).is_ok());
  EXPECT_TRUE(gelu_tanh_mul(DType::kBF16, nullptr, 0, 8, nullptr, nullptr).is_ok());
}

// Gemma's normalizer: x * round(sqrt(hidden)) rounded once, bit for bit (transformers multiplies
// by a tensor of the activations' dtype). sqrt(640) = 25.298 and sqrt(3840) = 61.97 are not
// representable: a kernel that kept the fp32 scale differs on many elements.
TEST(CudaScaleEmbedding, RoundsTheScaleThenTheProduct) {
  TESSERA_REQUIRE_GPU();
  for (DType d : kHalfTypes) {
    for (int64_t hidden : {64, 640, 2304, 3840}) {
      const float scale = static_cast<float>(std::sqrt(static_cast<double>(hidden)));
      const float s = from_bits(d, to_bits(d, scale));
      const int64_t n = 7 * hidden + 3;
      const HalfTensor x = random_half(d, n, 80 + hidden, -0.1f, 0.1f);
      std::vector<uint16_t> want(n);
      for (int64_t i = 0; i < n; ++i) want[i] = to_bits(d, x.values[i] * s);
      DeviceBuffer d_x = upload(x.bits);
      ASSERT_TRUE(scale_embedding(d, d_x.get(), n, scale, nullptr).is_ok());
      expect_bits_equal(download<uint16_t>(d_x.get(), want.size()), want,
                        label(d, "scale_embedding hidden " + std::to_string(hidden)));
    }
  }
  EXPECT_FALSE(scale_embedding(DType::kF32, nullptr, 1, 2.0f, nullptr).is_ok());
  EXPECT_FALSE(scale_embedding(DType::kBF16, nullptr, 1, 2.0f, nullptr).is_ok());
}

// Gemma 2's final soft-cap on fp32 logits: tanh(x / cap) * cap as the CPU backend computes it
// (std::tanh there, tanhf here: within a few fp32 ulps of cap).
TEST(CudaSoftcapLogits, MatchesTheCpuFormula) {
  TESSERA_REQUIRE_GPU();
  const float cap = 30.0f;
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> dist(-200.0f, 200.0f);
  std::vector<float> x(100003);
  for (float& v : x) v = dist(rng);
  x[0] = 0.0f;
  x[1] = 1e6f;
  x[2] = -1e6f;
  DeviceBuffer d_x = upload(x);
  const int64_t n = static_cast<int64_t>(x.size());
  ASSERT_TRUE(softcap_logits(d_x.as<float>(), n, cap, nullptr).is_ok());
  const std::vector<float> got = download<float>(d_x.get(), x.size());
  size_t bad = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const float want = std::tanh(x[i] / cap) * cap;
    if (std::fabs(got[i] - want) > 4e-6f * cap && bad++ < 5) {
      ADD_FAILURE() << "softcap_logits(" << x[i] << "): got " << got[i] << ", want " << want;
    }
  }
  EXPECT_EQ(bad, 0u);
  EXPECT_FALSE(softcap_logits(d_x.as<float>(), 4, 0.0f, nullptr).is_ok());
}

// Partial rotary embeddings (Phi-3's partial_rotary_factor; the tiny Phi-3 rotates 12 of 16):
// the first rotary_dim dimensions of each q/k head rotate with rotate_half over rotary_dim, the
// rest are stored as projected. The want is transformers' bf16/fp16 chain on the same table
// (cos/sin rounded, each product and the sum rounded), bit for bit; v is the projection's bits.
TEST(CudaRopeAndCache, PartialRotaryIsTransformersRoundingBitForBit) {
  TESSERA_REQUIRE_GPU();
  struct Case {
    int64_t heads, kv_heads, head_dim, rotary_dim;
  };
  for (DType d : kHalfTypes) {
    for (Case c : {Case{4, 2, 16, 12}, Case{32, 32, 96, 64}, Case{8, 2, 128, 32}}) {
      const std::string what =
          label(d, "partial rope heads " + std::to_string(c.heads) + "/" +
                       std::to_string(c.kv_heads) + " head_dim " + std::to_string(c.head_dim) +
                       " rotary_dim " + std::to_string(c.rotary_dim));
      const int64_t hd = c.head_dim, rh = c.rotary_dim / 2, max_pos = 600, bs = 16, blocks = 8;
      cpu::RopeSpec spec;
      spec.head_dim = hd;
      spec.rotary_dim = c.rotary_dim;
      spec.theta = 10000.0;
      Expected<cpu::RopeTable> table = cpu::RopeTable::create(spec, max_pos);
      ASSERT_TRUE(table.has_value()) << table.status().to_string();
      const std::vector<int32_t> positions = {0, 1, 5, 130, 599, 42, 77};
      const std::vector<int64_t> slots = {3, -1, 17, 0, 127, 64, 65};
      const int64_t n = static_cast<int64_t>(positions.size());
      const int64_t row = (c.heads + 2 * c.kv_heads) * hd, kv = c.kv_heads * hd;
      const HalfTensor qkv = random_half(d, n * row, 90 + hd, -2.0f, 2.0f);
      auto rnd = [&](float x) { return from_bits(d, to_bits(d, x)); };
      // want(head at `src`, position) for element e of the head.
      auto want_elem = [&](const float* src, int64_t pos, int64_t e) -> uint16_t {
        if (e >= c.rotary_dim) return to_bits(d, src[e]);
        const int64_t i = e < rh ? e : e - rh;
        const float cs = rnd(table->cos(pos)[i]), sn = rnd(table->sin(pos)[i]);
        const float other = e < rh ? -src[e + rh] : src[e - rh];
        return to_bits(d, rnd(src[e] * cs) + rnd(other * sn));
      };
      const std::vector<float> cos_t(table->cos(0), table->cos(0) + max_pos * rh);
      const std::vector<float> sin_t(table->sin(0), table->sin(0) + max_pos * rh);
      DeviceBuffer d_qkv = upload(qkv.bits), d_cos = upload(cos_t), d_sin = upload(sin_t);
      DeviceBuffer d_pos = upload(positions), d_slots = upload(slots);
      DeviceBuffer d_q = upload(std::vector<uint16_t>(n * c.heads * hd, kSentinel));
      DeviceBuffer d_k = upload(std::vector<uint16_t>(blocks * bs * kv, kSentinel));
      DeviceBuffer d_v = upload(std::vector<uint16_t>(blocks * bs * kv, kSentinel));
      RopeCacheArgs a;
      a.dtype = d;
      a.qkv = d_qkv.get();
      a.constants.cos = d_cos.as<float>();
      a.constants.sin = d_sin.as<float>();
      a.constants.max_position = max_pos;
      a.positions = d_pos.as<int32_t>();
      a.slots = d_slots.as<int64_t>();
      a.num_tokens = n;
      a.num_heads = c.heads;
      a.num_kv_heads = c.kv_heads;
      a.head_dim = hd;
      a.rotary_dim = c.rotary_dim;
      a.q_out = d_q.get();
      a.k_cache = d_k.get();
      a.v_cache = d_v.get();
      a.num_blocks = blocks;
      a.block_size = bs;
      ASSERT_TRUE(rope_and_cache(a, nullptr).is_ok()) << what;
      const std::vector<uint16_t> q = download<uint16_t>(d_q.get(), n * c.heads * hd);
      const std::vector<uint16_t> k = download<uint16_t>(d_k.get(), blocks * bs * kv);
      const std::vector<uint16_t> v = download<uint16_t>(d_v.get(), blocks * bs * kv);
      std::vector<uint16_t> want_q(q.size()), want_k(k.size(), kSentinel);
      std::vector<uint16_t> want_v(v.size(), kSentinel);
      for (int64_t t = 0; t < n; ++t) {
        const float* r = qkv.values.data() + t * row;
        for (int64_t h = 0; h < c.heads; ++h) {
          for (int64_t e = 0; e < hd; ++e) {
            want_q[(t * c.heads + h) * hd + e] = want_elem(r + h * hd, positions[t], e);
          }
        }
        if (slots[t] < 0) continue;
        for (int64_t h = 0; h < c.kv_heads; ++h) {
          for (int64_t e = 0; e < hd; ++e) {
            const int64_t at = slots[t] * kv + h * hd + e;
            want_k[at] = want_elem(r + (c.heads + h) * hd, positions[t], e);
            want_v[at] = qkv.bits[t * row + (c.heads + c.kv_heads + h) * hd + e];
          }
        }
      }
      expect_bits_equal(q, want_q, what + " q");
      expect_bits_equal(k, want_k, what + " k cache (rotated part, pass-through, untouched slots)");
      expect_bits_equal(v, want_v, what + " v cache");
      // Bad rotary_dim, and q/k norms with a partial rotation, are refused before any launch.
      RopeCacheArgs bad = a;
      bad.rotary_dim = c.rotary_dim + 1;
      EXPECT_FALSE(rope_and_cache(bad, nullptr).is_ok()) << what << " odd rotary_dim";
      bad.rotary_dim = hd + 2;
      EXPECT_FALSE(rope_and_cache(bad, nullptr).is_ok()) << what << " rotary_dim > head_dim";
      bad = a;
      bad.constants.q_norm = bad.constants.k_norm = d_qkv.get();
      EXPECT_FALSE(rope_and_cache(bad, nullptr).is_ok()) << what << " qk norm";
    }
  }
}

// Gemma's RMSNorm (unit_offset): out = round(h * rsqrt(mean(h^2) + eps) * (1 + w)) in fp32, one
// rounding, against the CPU backend's norm with the weight folded to 1 + w in fp32 (what its
// loader does): <= 0.5 ulp plus fp32 noise; bound 1 ulp. The Llama-rounding kernel on the same
// inputs (w folded and rounded to the dtype) is printed beside it, not bounded.
TEST(CudaRmsNorm, UnitOffsetIsGemmasRounding) {
  TESSERA_REQUIRE_GPU();
  cpu::CpuContext ctx(1);
  const float eps = 1e-6f;
  for (DType d : kHalfTypes) {
    for (int64_t hidden : {64, 100, 2304, 3840, 40000}) {
      for (bool add : {false, true}) {
        const int64_t rows = 3;
        const std::string what =
            label(d, std::string(add ? "add_" : "") + "rms_norm unit offset hidden " +
                         std::to_string(hidden));
        const HalfTensor x = random_half(d, rows * hidden, 400 + hidden, -3.0f, 3.0f);
        const HalfTensor res = random_half(d, rows * hidden, 500 + hidden, -4.0f, 4.0f);
        const HalfTensor w = random_half(d, hidden, 600 + hidden, -0.5f, 0.5f);
        std::vector<float> folded = w.values;
        for (float& v : folded) v += 1.0f;
        const TensorView fw{folded.data(), DType::kF32, {hidden}};
        // The normed input: x, or round(residual + x).
        std::vector<float> h = x.values;
        if (add) {
          for (size_t i = 0; i < h.size(); ++i) h[i] = round_to(d, res.values[i] + x.values[i]);
        }
        std::vector<float> ref(h.size());
        ASSERT_TRUE(cpu::rms_norm(ctx, h, fw, eps, ref).is_ok());
        DeviceBuffer d_x = upload(x.bits), d_res = upload(res.bits), d_w = upload(w.bits);
        DeviceBuffer d_out = alloc(x.bits.size() * 2);
        const Status st =
            add ? add_rms_norm(d, d_x.get(), d_res.get(), d_w.get(), rows, hidden, eps, d_out.get(),
                               nullptr, /*unit_offset=*/true)
                : rms_norm(d, d_x.get(), d_w.get(), rows, hidden, eps, d_out.get(), nullptr,
                           /*unit_offset=*/true);
        ASSERT_TRUE(st.is_ok()) << what << ": " << st.to_string();
        expect_within_ulps(from_bits(d, download<uint16_t>(d_out.get(), ref.size())), ref, d, 1.0,
                           kNormAbs, what);
        if (add) {
          std::vector<uint16_t> want_res(h.size());
          for (size_t i = 0; i < h.size(); ++i) want_res[i] = to_bits(d, h[i]);
          expect_bits_equal(download<uint16_t>(d_res.get(), want_res.size()), want_res,
                            what + " residual");
        }
      }
    }
  }
}

// Gemma 3's q_norm / k_norm (norm_unit_offset) inside rope_and_cache, against the CPU's per-head
// norm with 1 + w weights, then RoPE; the bound is the qk-norm one of CudaRopeAndCache.MatchesCpu.
TEST(CudaRopeAndCache, UnitOffsetQkNormMatchesCpu) {
  TESSERA_REQUIRE_GPU();
  for (DType d : kHalfTypes) {
    for (const RopeCase& c : {RopeCase{16, 8, 256, true, false}, RopeCase{4, 2, 32, true, false},
                              RopeCase{4, 2, 66, true, false}}) {
      std::vector<int32_t> positions = {0, 3, 17, 250, 511};
      std::vector<int64_t> slots = {0, 5, 9, -1, 31};
      const RopeRun r = run_rope(d, c, positions, slots, 4, 8, 512, 1234 + c.head_dim,
                                 /*fp8_cache=*/false, /*unit_offset=*/true);
      check_rope(r);
    }
  }
}

}  // namespace
}  // namespace tessera::cuda
