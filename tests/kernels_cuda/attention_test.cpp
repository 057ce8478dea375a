// cuda::paged_attention against cpu::paged_attention on the same (rounded) bf16/fp16 inputs.
//
// Inputs: q ~ U(-3, 3) (scores of std about 1 at scale 1/sqrt(head_dim), so the softmax is
// neither flat nor one-hot), K, V ~ U(-1, 1), all rounded to the dtype first; the reference sees
// exactly the rounded values. Cache slots that hold no token of any sequence, and a block that
// pads every block table, are NaN: a kernel reading past a sequence's tokens turns its output
// NaN and fails. With a sliding window, the table entries of the blocks wholly before a
// sequence's first query's window name that NaN block too: a kernel must skip them (decode reads
// only the window), not mask them (a masked NaN V still makes NaN).
//
// Tolerance per output element: |gpu - ref| <= rtol * |ref| + atol, with
//   bf16: rtol 2^-7, atol 4e-3; fp16: rtol 2^-9, atol 1e-3.
// The GPU rounds the softmax weights P to the dtype before the P.V MMA: a relative error <= u
// (2^-8 bf16, 2^-11 fp16) on each weight, at most u * max|v| = u on the output; atol covers it
// (bf16: 3.9e-3 worst case). The output is rounded once (u * |ref|, rtol covers it with a 2-4x
// margin). Scores and sums in fp32 (CPU: denominators in double) differ by ~1e-6.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <numeric>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "common/status.h"
#include "common/tensor.h"
#include "kernels/cpu/cpu_context.h"
#include "kernels/cpu/paged_attention.h"
#include "kernels/cpu/paged_kv_cache.h"
#include "kernels/cuda/attention.h"
#include "kernels/cuda/cuda_util.h"
#include "kernels/cuda/elementwise.h"

namespace tessera::cuda {
namespace {

bool has_cuda_device() {
  int n = 0;
  const bool ok = cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
  cudaGetLastError();
  return ok;
}

#define REQUIRE_CUDA_DEVICE() \
  if (!has_cuda_device())     \
  FAIL() << "no CUDA device: the CUDA kernel tests run only on a GPU machine (scripts/gpu-check)"

constexpr uint16_t kSentinel = 0x1234;  // pre-filled into out; rows that must stay unwritten

uint16_t to_half_bits(float f, DType d) {
  return d == DType::kBF16 ? float_to_bf16(f) : float_to_f16(f);
}
float from_half_bits(uint16_t h, DType d) {
  return d == DType::kBF16 ? bf16_to_float(h) : f16_to_float(h);
}
uint16_t nan_bits(DType d) { return d == DType::kBF16 ? 0x7FC0 : 0x7E00; }

struct Shape {
  DType dtype = DType::kBF16;
  int num_heads = 8;
  int num_kv_heads = 2;
  int head_dim = 64;
  int block_size = 16;
  bool fp8 = false;  // an E4M3 cache (the reference reads the same values widened)
  int window = 0;    // AttentionScoring::window (0 = full)
  float softcap = 0.0f;  // AttentionScoring::softcap (0 = off)
};

// A batch on the host: the cache (NaN where no sequence's token lives), block tables and q.
struct Problem {
  Shape shape;
  std::vector<int> query_lens;  // rows of q per sequence (padding sequences keep theirs)
  std::vector<int> capacity;    // tokens each block table covers
  int num_blocks = 0;
  int table_stride = 0;
  std::vector<int32_t> block_tables;  // [num_seqs, table_stride]
  std::vector<uint16_t> k, v;         // [num_blocks, block_size, num_kv_heads, head_dim]
  std::vector<uint8_t> k8, v8;        // the same values as E4M3 bytes (shape.fp8)
  std::vector<uint16_t> q;            // [total_q, num_heads, head_dim]
  std::vector<int> cu_query_lens;
  int64_t total_q = 0;

  int num_seqs() const { return static_cast<int>(query_lens.size()); }
  int64_t token_elems() const { return int64_t{shape.num_kv_heads} * shape.head_dim; }
  int64_t row_elems() const { return int64_t{shape.num_heads} * shape.head_dim; }
  float scale() const { return 1.0f / std::sqrt(static_cast<float>(shape.head_dim)); }
  AttentionScoring scoring() const {
    return {.scale = scale(), .softcap = shape.softcap, .window = shape.window};
  }
};

Problem make_problem(const Shape& shape, std::vector<int> query_lens, std::vector<int> capacity,
                     uint32_t seed) {
  Problem p;
  p.shape = shape;
  p.query_lens = std::move(query_lens);
  p.capacity = std::move(capacity);
  const int bs = shape.block_size;
  const int n = p.num_seqs();
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);

  int max_blocks = 0;
  int total_blocks = 0;
  for (int s = 0; s < n; ++s) {
    const int blocks = (p.capacity[s] + bs - 1) / bs;
    max_blocks = std::max(max_blocks, blocks);
    total_blocks += blocks;
  }
  p.num_blocks = total_blocks + 2;  // + a NaN block padding the tables + one never referenced
  p.table_stride = max_blocks + 1;
  std::vector<int32_t> ids(static_cast<size_t>(p.num_blocks));
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  const int32_t poison_block = ids.back();

  const int64_t te = p.token_elems();
  p.k.assign(static_cast<size_t>(p.num_blocks) * bs * te, nan_bits(shape.dtype));
  p.v = p.k;
  p.block_tables.assign(static_cast<size_t>(n) * p.table_stride, poison_block);
  size_t next = 0;
  for (int s = 0; s < n; ++s) {
    const int blocks = (p.capacity[s] + bs - 1) / bs;
    for (int b = 0; b < blocks; ++b) p.block_tables[s * p.table_stride + b] = ids[next++];
    for (int t = 0; t < p.capacity[s]; ++t) {
      const int64_t slot = int64_t{p.block_tables[s * p.table_stride + t / bs]} * bs + t % bs;
      for (int64_t e = 0; e < te; ++e) {
        p.k[slot * te + e] = to_half_bits(unit(rng), shape.dtype);
        p.v[slot * te + e] = to_half_bits(unit(rng), shape.dtype);
      }
    }
  }
  // Blocks wholly before the window of a sequence's first query (capacity - query_len): freed by
  // the engine; their entries name the NaN block.
  for (int s = 0; s < n && shape.window > 0; ++s) {
    const int first = std::max(0, p.capacity[s] - p.query_lens[s] - shape.window + 1);
    for (int b = 0; b < first / bs; ++b) p.block_tables[s * p.table_stride + b] = poison_block;
  }
  if (shape.fp8) {
    // Values in (-1, 1) span E4M3's normals and subnormals; every E4M3 value is exact in bf16
    // and fp16, so the reference sees exactly what the GPU reads.
    p.k8.resize(p.k.size());
    p.v8.resize(p.v.size());
    for (size_t i = 0; i < p.k.size(); ++i) {
      p.k8[i] = float_to_fp8_e4m3(from_half_bits(p.k[i], shape.dtype));
      p.v8[i] = float_to_fp8_e4m3(from_half_bits(p.v[i], shape.dtype));
      p.k[i] = to_half_bits(fp8_e4m3_to_float(p.k8[i]), shape.dtype);
      p.v[i] = to_half_bits(fp8_e4m3_to_float(p.v8[i]), shape.dtype);
    }
  }

  p.cu_query_lens.assign(1, 0);
  for (int s = 0; s < n; ++s) p.cu_query_lens.push_back(p.cu_query_lens.back() + p.query_lens[s]);
  p.total_q = p.cu_query_lens.back();
  p.q.resize(static_cast<size_t>(p.total_q * p.row_elems()));
  for (auto& x : p.q) x = to_half_bits(3.0f * unit(rng), shape.dtype);
  return p;
}

// cpu::paged_attention over the sequences with context_len > 0; [total_q, heads, head_dim],
// rows of padding sequences left 0.
std::vector<float> reference(const Problem& p, const std::vector<int>& context_lens) {
  const Shape& sh = p.shape;
  cpu::KvCacheShape cs;
  cs.num_layers = 1;
  cs.num_blocks = p.num_blocks;
  cs.block_size = sh.block_size;
  cs.num_kv_heads = sh.num_kv_heads;
  cs.head_dim = sh.head_dim;
  auto cache = cpu::PagedKvCache::create(cs);
  EXPECT_TRUE(cache.has_value()) << cache.status().to_string();
  if (!cache.has_value()) return {};
  std::vector<float> kf(p.k.size()), vf(p.v.size());
  for (size_t i = 0; i < p.k.size(); ++i) {
    kf[i] = from_half_bits(p.k[i], sh.dtype);
    vf[i] = from_half_bits(p.v[i], sh.dtype);
  }
  std::vector<int64_t> slots(static_cast<size_t>(cs.num_slots()));
  std::iota(slots.begin(), slots.end(), int64_t{0});
  const Status ws = cache->write(0, kf, vf, slots);
  EXPECT_TRUE(ws.is_ok()) << ws.to_string();

  std::vector<cpu::AttentionSeq> seqs;
  std::vector<float> q_ref;
  std::vector<int64_t> rows;  // q row of each reference row
  for (int s = 0; s < p.num_seqs(); ++s) {
    if (context_lens[s] == 0) continue;
    cpu::AttentionSeq seq;
    seq.block_table = std::span<const int32_t>(p.block_tables.data() + s * p.table_stride,
                                               static_cast<size_t>(p.table_stride));
    seq.query_len = p.query_lens[s];
    seq.context_len = context_lens[s];
    seqs.push_back(seq);
    for (int j = 0; j < p.query_lens[s]; ++j) {
      const int64_t row = p.cu_query_lens[s] + j;
      rows.push_back(row);
      for (int64_t e = 0; e < p.row_elems(); ++e) {
        q_ref.push_back(from_half_bits(p.q[row * p.row_elems() + e], sh.dtype));
      }
    }
  }
  std::vector<float> out_ref(q_ref.size());
  cpu::CpuContext ctx(0);
  const Status st = cpu::paged_attention(ctx, *cache, 0, q_ref, seqs, p.scoring(), out_ref);
  EXPECT_TRUE(st.is_ok()) << st.to_string();
  std::vector<float> out(static_cast<size_t>(p.total_q * p.row_elems()), 0.0f);
  for (size_t i = 0; i < rows.size(); ++i) {
    std::copy_n(out_ref.begin() + static_cast<int64_t>(i) * p.row_elems(), p.row_elems(),
                out.begin() + rows[i] * p.row_elems());
  }
  return out;
}

// The problem's device copy.
struct DeviceProblem {
  DeviceBuffer k, v, q, out, tables, cu, ctx, workspace;
};

template <typename T>
void upload(DeviceBuffer* buf, const std::vector<T>& host, const char* what) {
  auto b = DeviceBuffer::allocate(std::max<size_t>(host.size() * sizeof(T), 16), what);
  ASSERT_TRUE(b.has_value()) << b.status().to_string();
  *buf = std::move(b).value();
  if (!host.empty()) {
    ASSERT_EQ(cudaMemcpy(buf->get(), host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice),
              cudaSuccess);
  }
}

void upload_problem(const Problem& p, DeviceProblem* d) {
  if (p.shape.fp8) {
    upload(&d->k, p.k8, "k cache");
    upload(&d->v, p.v8, "v cache");
  } else {
    upload(&d->k, p.k, "k cache");
    upload(&d->v, p.v, "v cache");
  }
  upload(&d->q, p.q, "q");
  upload(&d->tables, p.block_tables, "block tables");
  upload(&d->cu, p.cu_query_lens, "cu_query_lens");
  upload(&d->out, std::vector<uint16_t>(p.q.size(), kSentinel), "out");
}

AttentionArgs make_args(const Problem& p, const DeviceProblem& d, int num_splits, int split_size) {
  AttentionArgs a;
  a.dtype = p.shape.dtype;
  a.kv_cache_dtype = p.shape.fp8 ? KvCacheDtype::kFp8E4M3 : KvCacheDtype::kAuto;
  a.q = d.q.get();
  a.out = d.out.get();
  a.k_cache = d.k.get();
  a.v_cache = d.v.get();
  a.num_blocks = p.num_blocks;
  a.block_size = p.shape.block_size;
  a.cu_query_lens = d.cu.as<int32_t>();
  a.context_lens = d.ctx.as<int32_t>();
  a.block_tables = d.tables.as<int32_t>();
  a.block_table_stride = p.table_stride;
  a.num_seqs = p.num_seqs();
  a.max_query_len = *std::max_element(p.query_lens.begin(), p.query_lens.end());
  a.num_heads = p.shape.num_heads;
  a.num_kv_heads = p.shape.num_kv_heads;
  a.head_dim = p.shape.head_dim;
  a.scoring = p.scoring();
  a.num_splits = num_splits;
  a.split_size = split_size;
  a.workspace = d.workspace.get();
  a.total_q = p.total_q;
  return a;
}

void download(const DeviceBuffer& buf, size_t count, std::vector<uint16_t>* out) {
  out->resize(count);
  ASSERT_EQ(cudaMemcpy(out->data(), buf.get(), count * sizeof(uint16_t), cudaMemcpyDeviceToHost),
            cudaSuccess);
}

// Runs the GPU kernel once on a fresh copy of the problem; `out` gets its output bits.
void run_gpu(const Problem& p, const std::vector<int>& context_lens, int num_splits, int split_size,
             std::vector<uint16_t>* out, AttentionKernel kernel = AttentionKernel::kTiles) {
  DeviceProblem d;
  ASSERT_NO_FATAL_FAILURE(upload_problem(p, &d));
  ASSERT_NO_FATAL_FAILURE(upload(&d.ctx, context_lens, "context_lens"));
  const size_t ws =
      attention_workspace_bytes(p.total_q, p.shape.num_heads, p.shape.head_dim, num_splits);
  if (num_splits > 1) {
    ASSERT_GT(ws, 0u);
  }
  if (ws > 0) {
    // Garbage (NaN) in the workspace must not leak into the output.
    ASSERT_NO_FATAL_FAILURE(upload(&d.workspace, std::vector<uint32_t>(ws / 4, 0x7fc00000u), "ws"));
  }
  AttentionArgs args = make_args(p, d, num_splits, split_size);
  args.kernel = kernel;
  const Status st = paged_attention(args, nullptr);
  ASSERT_TRUE(st.is_ok()) << st.to_string();
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  ASSERT_NO_FATAL_FAILURE(download(d.out, p.q.size(), out));
}

// Every row of a live sequence within tolerance of ref; rows of padding sequences unwritten.
// Returns the mean absolute error over the live rows.
double expect_matches(const Problem& p, const std::vector<int>& context_lens,
                      const std::vector<uint16_t>& gpu, const std::vector<float>& ref,
                      const std::string& what) {
  const bool bf16 = p.shape.dtype == DType::kBF16;
  const double rtol = bf16 ? 1.0 / 128 : 1.0 / 512;
  const double atol = bf16 ? 4e-3 : 1e-3;
  int64_t bad = 0;
  double worst = 0.0;
  double sum = 0.0;
  int64_t count = 0;
  std::string first;
  for (int s = 0; s < p.num_seqs(); ++s) {
    for (int64_t row = p.cu_query_lens[s]; row < p.cu_query_lens[s + 1]; ++row) {
      for (int64_t e = 0; e < p.row_elems(); ++e) {
        const size_t i = static_cast<size_t>(row * p.row_elems() + e);
        if (context_lens[s] == 0) {
          if (gpu[i] != kSentinel) {
            if (bad++ == 0)
              first = "padding sequence " + std::to_string(s) + " row " + std::to_string(row) +
                      " was written";
          }
          continue;
        }
        const double g = from_half_bits(gpu[i], p.shape.dtype);
        const double r = ref[i];
        const double err = std::fabs(g - r);
        const double tol = rtol * std::fabs(r) + atol;
        if (!(err <= tol)) {
          if (bad++ == 0) {
            first = "seq " + std::to_string(s) + " row " + std::to_string(row) + " head " +
                    std::to_string(e / p.shape.head_dim) + " d " +
                    std::to_string(e % p.shape.head_dim) + ": gpu " + std::to_string(g) + " ref " +
                    std::to_string(r);
          }
        }
        if (!(err <= worst)) worst = err;
        sum += err;
        ++count;
      }
    }
  }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " elements out of tolerance, first: " << first
                    << ", worst abs error " << worst;
  return count > 0 ? sum / static_cast<double>(count) : 0.0;
}

bool hopper_applies(const Problem& p) {
  AttentionArgs a;
  a.dtype = p.shape.dtype;
  a.kv_cache_dtype = p.shape.fp8 ? KvCacheDtype::kFp8E4M3 : KvCacheDtype::kAuto;
  a.num_heads = p.shape.num_heads;
  a.num_kv_heads = p.shape.num_kv_heads;
  a.head_dim = p.shape.head_dim;
  a.max_query_len = *std::max_element(p.query_lens.begin(), p.query_lens.end());
  return hopper_prefill_applies(a);
}

// Checks the tile kernel with num_splits 1 and with each given {num_splits, split_size}, and the
// Hopper prefill kernel (which ignores splits) where it applies, whatever the query lengths.
void check_problem(const Problem& p, const std::vector<int>& context_lens,
                   const std::vector<SplitPlan>& splits, const std::string& what) {
  const std::vector<float> ref = reference(p, context_lens);
  ASSERT_FALSE(ref.empty());
  std::vector<uint16_t> base;
  ASSERT_NO_FATAL_FAILURE(run_gpu(p, context_lens, 1, 0, &base));
  expect_matches(p, context_lens, base, ref, what + " (no split)");
  if (hopper_applies(p)) {
    std::vector<uint16_t> hopper;
    ASSERT_NO_FATAL_FAILURE(run_gpu(p, context_lens, 1, 0, &hopper, AttentionKernel::kHopper));
    expect_matches(p, context_lens, hopper, ref, what + " (Hopper prefill kernel)");
  }
  for (const SplitPlan& sp : splits) {
    std::vector<uint16_t> out;
    ASSERT_NO_FATAL_FAILURE(run_gpu(p, context_lens, sp.num_splits, sp.split_size, &out));
    const std::string tag = what + " (" + std::to_string(sp.num_splits) + " splits of " +
                            std::to_string(sp.split_size) + ")";
    expect_matches(p, context_lens, out, ref, tag);
  }
}

std::string describe(const Shape& s) {
  return std::string(dtype_name(s.dtype)) + (s.fp8 ? " fp8 cache" : "") + " heads " +
         std::to_string(s.num_heads) + "/" + std::to_string(s.num_kv_heads) + " head_dim " +
         std::to_string(s.head_dim) + " block " + std::to_string(s.block_size) +
         (s.window > 0 ? " window " + std::to_string(s.window) : "") +
         (s.softcap > 0 ? " softcap " + std::to_string(s.softcap) : "");
}

TEST(CudaPagedAttention, DecodeBatchMatchesCpu) {
  REQUIRE_CUDA_DEVICE();
  const std::vector<int> ctx = {1, 15, 16, 17, 63, 64, 65, 300, 2049};
  const std::vector<int> ones(ctx.size(), 1);
  for (DType dtype : {DType::kBF16, DType::kF16}) {
    for (int block_size : {16, 8, 32}) {
      Shape sh;
      sh.dtype = dtype;
      sh.num_heads = 8;
      sh.num_kv_heads = 2;
      sh.head_dim = 128;
      sh.block_size = block_size;
      const Problem p = make_problem(sh, ones, ctx, 11 + block_size);
      // 9 splits of 256 cover 2049 exactly; 12 leaves splits past every sequence's end; 2 of
      // 1088 gives long splits.
      check_problem(p, ctx, {{9, 256}, {12, 256}, {2, 1088}}, "decode " + describe(sh));
    }
  }
}

// The decode attention with the rotary embedding inside it (AttentionRope) gives rope_and_cache
// followed by paged_attention's bits: the output and every byte of both caches (the step's k and
// v stored at their slots), for bf16 and fp16, head_dim 64 and 128, groups 1 to 16, with the
// head norms, Gemma's 1 + w and none, split keys or not, the step's key in its split's first tile
// or a later one (a 300-key split streams five), and a padding sequence (context 0: nothing
// written).
TEST(CudaPagedAttention, RopeInsideTheDecodeAttentionGivesRopeThenAttentionsBits) {
  REQUIRE_CUDA_DEVICE();
  struct Case {
    DType dtype;
    int heads, kv_heads, head_dim;
    bool norm, unit_offset;
    int num_splits, split_size;
  };
  const Case cases[] = {{DType::kBF16, 32, 4, 128, true, false, 16, 256},
                        {DType::kBF16, 32, 4, 128, true, false, 1, 0},
                        {DType::kBF16, 16, 16, 64, false, false, 4, 768},
                        {DType::kF16, 16, 1, 128, true, true, 3, 1024},
                        {DType::kBF16, 8, 2, 64, true, false, 2, 1536}};
  const std::vector<int> ctx = {300, 1, 0, 64, 65, 2049};
  const std::vector<int> capacity = {300, 1, 16, 64, 65, 2049};
  const std::vector<int> ones(ctx.size(), 1);
  const int max_position = 4096;
  uint32_t seed = 5;
  for (const Case& c : cases) {
    Shape sh;
    sh.dtype = c.dtype;
    sh.num_heads = c.heads;
    sh.num_kv_heads = c.kv_heads;
    sh.head_dim = c.head_dim;
    const Problem p = make_problem(sh, ones, capacity, seed++);
    const int S = p.num_seqs(), hd = c.head_dim, half = hd / 2;
    const int64_t row = int64_t{c.heads + 2 * c.kv_heads} * hd;
    std::mt19937 rng(seed++);
    std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
    std::vector<uint16_t> qkv(static_cast<size_t>(S * row)), q_norm(hd), k_norm(hd);
    for (auto& x : qkv) x = to_half_bits(2.0f * unit(rng), c.dtype);
    for (auto& x : q_norm) x = to_half_bits(1.0f + 0.5f * unit(rng), c.dtype);
    for (auto& x : k_norm) x = to_half_bits(1.0f + 0.5f * unit(rng), c.dtype);
    std::vector<float> cos(static_cast<size_t>(max_position) * half), sin(cos.size());
    for (int pos = 0; pos < max_position; ++pos) {
      for (int i = 0; i < half; ++i) {
        const double angle = pos * std::pow(10000.0, -2.0 * i / hd);
        cos[pos * half + i] = static_cast<float>(std::cos(angle));
        sin[pos * half + i] = static_cast<float>(std::sin(angle));
      }
    }
    std::vector<int32_t> positions(S);
    std::vector<int64_t> slots(S);
    for (int s = 0; s < S; ++s) {
      positions[s] = std::max(ctx[s] - 1, 0);
      slots[s] = ctx[s] == 0
                     ? -1
                     : int64_t{p.block_tables[s * p.table_stride + (ctx[s] - 1) / sh.block_size]} *
                               sh.block_size +
                           (ctx[s] - 1) % sh.block_size;
    }
    DeviceBuffer d_qkv, d_qn, d_kn, d_cos, d_sin, d_pos, d_slots;
    ASSERT_NO_FATAL_FAILURE(upload(&d_qkv, qkv, "qkv"));
    ASSERT_NO_FATAL_FAILURE(upload(&d_qn, q_norm, "q_norm"));
    ASSERT_NO_FATAL_FAILURE(upload(&d_kn, k_norm, "k_norm"));
    ASSERT_NO_FATAL_FAILURE(upload(&d_cos, cos, "cos"));
    ASSERT_NO_FATAL_FAILURE(upload(&d_sin, sin, "sin"));
    ASSERT_NO_FATAL_FAILURE(upload(&d_pos, positions, "positions"));
    ASSERT_NO_FATAL_FAILURE(upload(&d_slots, slots, "slots"));
    const std::string what = describe(sh) + (c.norm ? (c.unit_offset ? " 1+w" : " norm") : "") +
                             ", " + std::to_string(c.num_splits) + " splits";

    // Either way on a fresh copy of the problem: out, then both caches.
    auto run = [&](bool inside, std::vector<uint16_t>* out, std::vector<uint16_t>* k,
                   std::vector<uint16_t>* v) {
      DeviceProblem d;
      ASSERT_NO_FATAL_FAILURE(upload_problem(p, &d));
      ASSERT_NO_FATAL_FAILURE(upload(&d.ctx, ctx, "context_lens"));
      const size_t ws = attention_workspace_bytes(p.total_q, c.heads, hd, c.num_splits);
      if (ws > 0) {
        ASSERT_NO_FATAL_FAILURE(upload(&d.workspace, std::vector<uint32_t>(ws / 4), "ws"));
      }
      AttentionArgs a = make_args(p, d, c.num_splits, c.split_size);
      if (inside) {
        a.rope.qkv = d_qkv.get();
        a.rope.constants.q_norm = c.norm ? d_qn.get() : nullptr;
        a.rope.constants.k_norm = c.norm ? d_kn.get() : nullptr;
        a.rope.constants.norm_unit_offset = c.unit_offset;
        a.rope.constants.cos = d_cos.as<float>();
        a.rope.constants.sin = d_sin.as<float>();
        a.rope.constants.max_position = max_position;
        ASSERT_TRUE(attention_rope_applies(a)) << what;
      } else {
        RopeCacheArgs r;
        r.dtype = c.dtype;
        r.qkv = d_qkv.get();
        r.constants.q_norm = c.norm ? d_qn.get() : nullptr;
        r.constants.k_norm = c.norm ? d_kn.get() : nullptr;
        r.constants.norm_unit_offset = c.unit_offset;
        r.constants.cos = d_cos.as<float>();
        r.constants.sin = d_sin.as<float>();
        r.constants.max_position = max_position;
        r.positions = d_pos.as<int32_t>();
        r.slots = d_slots.as<int64_t>();
        r.num_tokens = S;
        r.num_heads = c.heads;
        r.num_kv_heads = c.kv_heads;
        r.head_dim = hd;
        r.q_out = d.q.get();
        r.k_cache = d.k.get();
        r.v_cache = d.v.get();
        r.num_blocks = p.num_blocks;
        r.block_size = sh.block_size;
        const Status rs = rope_and_cache(r, nullptr);
        ASSERT_TRUE(rs.is_ok()) << rs.to_string();
      }
      const Status st = paged_attention(a, nullptr);
      ASSERT_TRUE(st.is_ok()) << what << ": " << st.to_string();
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess) << what;
      ASSERT_NO_FATAL_FAILURE(download(d.out, p.q.size(), out));
      ASSERT_NO_FATAL_FAILURE(download(d.k, p.k.size(), k));
      ASSERT_NO_FATAL_FAILURE(download(d.v, p.v.size(), v));
    };
    std::vector<uint16_t> out_a, k_a, v_a, out_b, k_b, v_b;
    ASSERT_NO_FATAL_FAILURE(run(false, &out_a, &k_a, &v_a));
    ASSERT_NO_FATAL_FAILURE(run(true, &out_b, &k_b, &v_b));
    auto first_diff = [](const std::vector<uint16_t>& x, const std::vector<uint16_t>& y) {
      for (size_t i = 0; i < x.size(); ++i) {
        if (x[i] != y[i]) return static_cast<int64_t>(i);
      }
      return int64_t{-1};
    };
    EXPECT_EQ(first_diff(out_a, out_b), -1) << what << ": output (element index)";
    EXPECT_EQ(first_diff(k_a, k_b), -1) << what << ": k cache (element index)";
    EXPECT_EQ(first_diff(v_a, v_b), -1) << what << ": v cache (element index)";
    // The rope wrote the step's keys: the cache differs from the problem's at those slots.
    EXPECT_NE(first_diff(k_a, p.k), -1) << what;
  }
}

// AttentionRope applies to one-token decode on a 16-bit cache at head_dim 64 / 128 with at most
// 16 query heads a KV head, and nowhere else (paged_attention refuses it there, naming why).
TEST(CudaPagedAttention, RopeInsideTheAttentionAppliesOnlyToOneTokenDecode) {
  AttentionArgs a;
  a.max_query_len = 2;
  a.head_dim = 128;
  a.num_heads = 8;
  a.num_kv_heads = 2;
  EXPECT_FALSE(attention_rope_applies(a));  // a prefill chunk
  a.max_query_len = 1;
  EXPECT_TRUE(attention_rope_applies(a));
  a.head_dim = 96;
  EXPECT_FALSE(attention_rope_applies(a));
  a.head_dim = 128;
  a.kv_cache_dtype = KvCacheDtype::kFp8E4M3;
  EXPECT_FALSE(attention_rope_applies(a));
  a.kv_cache_dtype = KvCacheDtype::kAuto;
  a.num_heads = 64;  // 32 query heads a KV head
  EXPECT_FALSE(attention_rope_applies(a));
}

TEST(CudaPagedAttention, DecodeOtherBlockSizesAndGroups) {
  REQUIRE_CUDA_DEVICE();
  const std::vector<int> ctx = {1, 17, 255, 256, 257, 700};
  const std::vector<int> ones(ctx.size(), 1);
  for (int block_size : {1, 64, 256}) {
    for (int group : {1, 8}) {
      Shape sh;
      sh.num_kv_heads = 2;
      sh.num_heads = 2 * group;
      sh.head_dim = 64;
      sh.block_size = block_size;
      const Problem p = make_problem(sh, ones, ctx, 23 + block_size + group);
      check_problem(p, ctx, {{3, 256}}, "decode " + describe(sh));
    }
  }
}

TEST(CudaPagedAttention, PrefillAcrossGroupsAndHeadDims) {
  REQUIRE_CUDA_DEVICE();
  const std::vector<int> lens = {1, 7, 64, 100, 257};
  for (int head_dim : {16, 32, 64, 128}) {
    for (int group : {1, 2, 4, 8}) {
      Shape sh;
      sh.num_kv_heads = 2;
      sh.num_heads = 2 * group;
      sh.head_dim = head_dim;
      sh.block_size = 16;
      const Problem p = make_problem(sh, lens, lens, 100 + head_dim + group);
      check_problem(p, lens, {{2, 256}, {5, 64}}, "prefill " + describe(sh));
    }
  }
}

TEST(CudaPagedAttention, PrefillF16) {
  REQUIRE_CUDA_DEVICE();
  const std::vector<int> lens = {3, 64, 129, 200};
  for (int head_dim : {64, 128}) {
    Shape sh;
    sh.dtype = DType::kF16;
    sh.num_heads = 8;
    sh.num_kv_heads = 2;
    sh.head_dim = head_dim;
    sh.block_size = 32;
    const Problem p = make_problem(sh, lens, lens, 300 + head_dim);
    check_problem(p, lens, {{4, 64}}, "prefill " + describe(sh));
  }
}

TEST(CudaPagedAttention, ChunkedPrefill) {
  REQUIRE_CUDA_DEVICE();
  // query_len < context_len: the chunk's tokens sit at the end of the context.
  const std::vector<int> qlen = {37, 64, 1, 200, 5};
  const std::vector<int> ctx = {100, 300, 70, 513, 5};
  for (int block_size : {8, 32}) {
    for (int group : {3, 4}) {
      Shape sh;
      sh.num_kv_heads = 2;
      sh.num_heads = 2 * group;
      sh.head_dim = 64;
      sh.block_size = block_size;
      const Problem p = make_problem(sh, qlen, ctx, 400 + block_size + group);
      check_problem(p, ctx, {{3, 192}, {9, 64}}, "chunked prefill " + describe(sh));
    }
  }
}

// The Hopper prefill kernel (head_dim 128): long prompts crossing its 128-row and 128-key tiles,
// chunked prefill (context > query), GQA ratios 1 to 8 and 5, block sizes that do not divide a
// tile (1, 7) or span several (256), both dtypes, a padding sequence, and what kAuto picks.
TEST(CudaPagedAttention, HopperPrefillMatchesCpu) {
  REQUIRE_CUDA_DEVICE();
  const std::vector<int> qlen = {300, 1, 129, 31, 128, 700, 9};
  const std::vector<int> ctx = {300, 1, 400, 31, 1153, 700, 0};
  int i = 0;
  for (int group : {1, 4, 5, 8}) {
    for (int block_size : {16, 1, 7, 256}) {
      if ((group + block_size) % 2 == 1 && block_size != 16) continue;  // a spread of pairs
      Shape sh;
      sh.dtype = i % 2 ? DType::kF16 : DType::kBF16;
      sh.num_kv_heads = 2;
      sh.num_heads = 2 * group;
      sh.head_dim = 128;
      sh.block_size = block_size;
      const Problem p = make_problem(sh, qlen, ctx, 900 + i);
      ASSERT_TRUE(hopper_applies(p));
      const std::vector<float> ref = reference(p, ctx);
      ASSERT_FALSE(ref.empty());
      std::vector<uint16_t> out;
      ASSERT_NO_FATAL_FAILURE(run_gpu(p, ctx, 1, 0, &out, AttentionKernel::kHopper));
      const double hopper_err = expect_matches(p, ctx, out, ref, "Hopper prefill " + describe(sh));
      // As exact as the tile kernel: the same rounding steps (fp32 scores and sums, P rounded
      // to the dtype, one output rounding) in another order, so a mean error within a few
      // percent of the tile kernel's; 1.25x allows for that and fails on a real loss.
      std::vector<uint16_t> tiles;
      ASSERT_NO_FATAL_FAILURE(run_gpu(p, ctx, 1, 0, &tiles, AttentionKernel::kTiles));
      const double tiles_err = expect_matches(p, ctx, tiles, ref, "tiles " + describe(sh));
      std::printf("%s: mean abs error vs the CPU oracle: Hopper %.3g, tiles %.3g\n",
                  describe(sh).c_str(), hopper_err, tiles_err);
      EXPECT_LE(hopper_err, 1.25 * tiles_err) << describe(sh);
      // kAuto takes the Hopper kernel for this prefill-heavy batch: the same bits.
      std::vector<uint16_t> autopick;
      ASSERT_NO_FATAL_FAILURE(run_gpu(p, ctx, 1, 0, &autopick, AttentionKernel::kAuto));
      EXPECT_EQ(autopick, out) << describe(sh);
      ++i;
    }
  }
  EXPECT_GE(i, 8);
}

TEST(CudaPagedAttention, HeadDim256) {
  REQUIRE_CUDA_DEVICE();
  for (DType dtype : {DType::kBF16, DType::kF16}) {
    Shape sh;
    sh.dtype = dtype;
    sh.num_heads = 4;
    sh.num_kv_heads = 1;
    sh.head_dim = 256;
    sh.block_size = 16;
    {
      const std::vector<int> qlen = {1, 40, 150};
      const std::vector<int> ctx = {33, 40, 300};
      const Problem p = make_problem(sh, qlen, ctx, 500);
      check_problem(p, ctx, {{2, 256}, {5, 64}}, "head_dim 256 prefill " + describe(sh));
    }
    {
      const std::vector<int> ctx = {1, 31, 32, 33, 64, 1000};
      const Problem p = make_problem(sh, std::vector<int>(ctx.size(), 1), ctx, 501);
      check_problem(p, ctx, {{4, 256}}, "head_dim 256 decode " + describe(sh));
    }
  }
}

// Head sizes without a tile-kernel instance run on the general kernel: decode, prefill and
// chunked prefill, GQA ratios 1, 3 and 5, both dtypes; split plans are accepted and ignored.
TEST(CudaPagedAttention, AnyEvenHeadDimMatchesCpu) {
  REQUIRE_CUDA_DEVICE();
  const std::vector<int> qlen = {1, 1, 37, 5, 1};
  const std::vector<int> ctx = {1, 300, 100, 5, 1100};
  int i = 0;
  for (int head_dim : {2, 6, 24, 40, 48, 80, 96, 112, 192, 320, 1024}) {
    const int group = std::vector<int>{1, 3, 5}[i % 3];
    Shape sh;
    sh.dtype = i % 2 ? DType::kF16 : DType::kBF16;
    sh.num_kv_heads = 2;
    sh.num_heads = 2 * group;
    sh.head_dim = head_dim;
    sh.block_size = 16;
    const Problem p = make_problem(sh, qlen, ctx, 800 + i);
    check_problem(p, ctx, {{3, 448}}, "general kernel " + describe(sh));
    ++i;
  }
}

// An E4M3 cache (--kv-cache-dtype fp8): decode (split and not), prefill and chunked prefill,
// every tile-kernel head size and two general ones, GQA 1/4/8, both dtypes, block sizes 16
// and 7, against the CPU attention over the same (widened) values.
TEST(CudaPagedAttention, Fp8CacheMatchesCpu) {
  REQUIRE_CUDA_DEVICE();
  const std::vector<int> qlen = {1, 1, 1, 37, 200, 5, 1};
  const std::vector<int> ctx = {1, 63, 2049, 100, 200, 5, 700};
  int i = 0;
  for (int head_dim : {128, 64, 256, 16, 32, 80, 6}) {
    const int group = std::vector<int>{4, 1, 8}[i % 3];
    Shape sh;
    sh.dtype = i % 2 ? DType::kF16 : DType::kBF16;
    sh.num_kv_heads = 2;
    sh.num_heads = 2 * group;
    sh.head_dim = head_dim;
    sh.block_size = i % 3 == 2 ? 7 : 16;
    sh.fp8 = true;
    const Problem p = make_problem(sh, qlen, ctx, 900 + i);
    check_problem(p, ctx, {{4, 576}, {9, 256}}, describe(sh));
    ++i;
  }
}

// FP8 decode at batch sizes that take each of the two kernel instances (attention.cu's
// take_decode_instance: 3 CTAs per SM, or 2 when a partial last wave of three costs more, as
// 3 or 64 sequences x 8 KV heads do on 132 SMs; 200 x 8 takes three), unsplit and split, and
// every tile head size at the large batch.
TEST(CudaPagedAttention, Fp8DecodeEveryBatchSizeMatchesCpu) {
  REQUIRE_CUDA_DEVICE();
  const std::vector<std::pair<int, int>> cases = {{3, 128},  {64, 128}, {200, 128},
                                                  {200, 64}, {200, 32}, {200, 16}};
  for (const auto& [batch, head_dim] : cases) {
    Shape sh;
    sh.dtype = batch % 2 ? DType::kF16 : DType::kBF16;
    sh.num_heads = head_dim == 64 ? 8 : 32;  // GQA 1 once, 4 otherwise
    sh.num_kv_heads = 8;
    sh.head_dim = head_dim;
    sh.fp8 = true;
    std::vector<int> ctx;
    for (int i = 0; i < batch; ++i) ctx.push_back(1 + (i * 37) % 300);
    const std::vector<int> ones(ctx.size(), 1);
    const Problem p = make_problem(sh, ones, ctx, 1000 + batch);
    check_problem(p, ctx, {{2, 192}}, describe(sh) + " batch " + std::to_string(batch));
  }
}

// E4M3's subnormals (|x| < 2^-6, codes 1..7) widen exactly: a cache holding nothing else
// gives outputs ~1e-3 that a flushed widening would turn into zeros, so the bound here is
// relative to the outputs, not the usual absolute floor.
TEST(CudaPagedAttention, Fp8SubnormalsWidenExactly) {
  REQUIRE_CUDA_DEVICE();
  for (DType dtype : {DType::kBF16, DType::kF16}) {
    Shape sh;
    sh.dtype = dtype;
    sh.head_dim = 128;
    sh.fp8 = true;
    const std::vector<int> qlen = {1, 3}, ctx = {300, 40};
    Problem p = make_problem(sh, qlen, ctx, 77);
    std::mt19937 rng(5);
    for (size_t i = 0; i < p.k8.size(); ++i) {
      if (std::isnan(from_half_bits(p.k[i], dtype))) continue;  // the unreferenced poison
      p.k8[i] = static_cast<uint8_t>((rng() & 0x80u) | (1u + rng() % 7u));
      p.v8[i] = static_cast<uint8_t>((rng() & 0x80u) | (1u + rng() % 7u));
      p.k[i] = to_half_bits(fp8_e4m3_to_float(p.k8[i]), dtype);
      p.v[i] = to_half_bits(fp8_e4m3_to_float(p.v8[i]), dtype);
    }
    const std::vector<float> ref = reference(p, ctx);
    std::vector<uint16_t> out;
    ASSERT_NO_FATAL_FAILURE(run_gpu(p, ctx, 1, 0, &out));
    double max_ref = 0, max_err = 0;
    for (size_t i = 0; i < ref.size(); ++i) {
      max_ref = std::max(max_ref, std::fabs(static_cast<double>(ref[i])));
      max_err =
          std::max(max_err, std::fabs(static_cast<double>(from_half_bits(out[i], dtype)) - ref[i]));
    }
    EXPECT_GT(max_ref, 1e-3);
    EXPECT_LE(max_err, 0.02 * max_ref) << dtype_name(dtype) << ": max |out| " << max_ref;
  }
}

TEST(CudaPagedAttention, PaddingSequencesAreNotWritten) {
  REQUIRE_CUDA_DEVICE();
  // context_len 0 marks padding; its rows of q / out exist but must keep the sentinel.
  Shape sh;
  sh.num_heads = 8;
  sh.num_kv_heads = 2;
  sh.head_dim = 64;
  const std::vector<int> qlen = {1, 1, 3, 1, 1};
  const std::vector<int> capacity = {50, 16, 20, 16, 300};
  const std::vector<int> ctx = {50, 0, 20, 0, 300};
  const Problem p = make_problem(sh, qlen, capacity, 600);
  check_problem(p, ctx, {{2, 256}, {5, 64}}, "padding");
}

TEST(CudaPagedAttention, GraphReplayWithChangingContextLengths) {
  REQUIRE_CUDA_DEVICE();
  // One capture with a fixed split-K plan, replayed with other context lengths (the decode
  // graph of the model): each sequence must use ceil(context_len / split_size) splits.
  Shape sh;
  sh.num_heads = 16;
  sh.num_kv_heads = 4;
  sh.head_dim = 128;
  const std::vector<int> capacity = {2048, 2048, 2048, 2048};
  const Problem p = make_problem(sh, {1, 1, 1, 1}, capacity, 700);
  const std::vector<std::vector<int>> replays = {
      {2048, 300, 1, 1000}, {17, 2047, 256, 257}, {0, 64, 2048, 0}};
  DeviceProblem d;
  ASSERT_NO_FATAL_FAILURE(upload_problem(p, &d));
  ASSERT_NO_FATAL_FAILURE(upload(&d.ctx, replays[0], "context_lens"));
  const int num_splits = 8;
  const int split_size = 256;
  const size_t ws = attention_workspace_bytes(p.total_q, sh.num_heads, sh.head_dim, num_splits);
  ASSERT_NO_FATAL_FAILURE(upload(&d.workspace, std::vector<uint8_t>(ws, 0xff), "workspace"));

  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  const Status st = paged_attention(make_args(p, d, num_splits, split_size), stream);
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  ASSERT_TRUE(st.is_ok()) << st.to_string();
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);

  for (size_t r = 0; r < replays.size(); ++r) {
    const std::vector<int>& ctx = replays[r];
    ASSERT_EQ(cudaMemcpy(d.ctx.get(), ctx.data(), ctx.size() * sizeof(int), cudaMemcpyHostToDevice),
              cudaSuccess);
    const std::vector<uint16_t> sentinel(p.q.size(), kSentinel);
    ASSERT_EQ(cudaMemcpy(d.out.get(), sentinel.data(), sentinel.size() * 2, cudaMemcpyHostToDevice),
              cudaSuccess);
    ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    std::vector<uint16_t> out;
    ASSERT_NO_FATAL_FAILURE(download(d.out, p.q.size(), &out));
    expect_matches(p, ctx, out, reference(p, ctx), "graph replay " + std::to_string(r));
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

// Sliding-window decode: windows of 1 key, ending inside a block, on a block edge, spanning
// tiles and wider than every context, against contexts around the 64-key tile edges, unsplit and
// split (the splits share only the window's keys). The blocks before each window are NaN.
TEST(CudaPagedAttention, SlidingWindowDecodeMatchesCpu) {
  REQUIRE_CUDA_DEVICE();
  const std::vector<int> ctx = {1, 15, 16, 17, 63, 64, 65, 300, 2049};
  const std::vector<int> ones(ctx.size(), 1);
  int i = 0;
  for (int window : {1, 16, 17, 100, 4096}) {
    for (int head_dim : {128, 64, 80}) {
      Shape sh;
      sh.dtype = i % 2 ? DType::kF16 : DType::kBF16;
      sh.num_heads = 8;
      sh.num_kv_heads = 2;
      sh.head_dim = head_dim;
      sh.block_size = i % 3 == 1 ? 7 : 16;
      sh.window = window;
      const Problem p = make_problem(sh, ones, ctx, 1100 + i);
      check_problem(p, ctx, {{9, 256}, {12, 256}, {2, 1088}}, "decode " + describe(sh));
      ++i;
    }
  }
}

// Sliding-window prefill and chunked prefill (chunks whose queries' windows start in earlier
// chunks' blocks): every tile head size, a general one, GQA 1 to 8, the Hopper kernel at head_dim
// 128 (check_problem runs it where it applies), windows smaller than, equal to and larger than
// its 128-key tiles.
TEST(CudaPagedAttention, SlidingWindowPrefillMatchesCpu) {
  REQUIRE_CUDA_DEVICE();
  const std::vector<int> qlen = {37, 64, 1, 200, 5, 300, 129};
  const std::vector<int> ctx = {100, 300, 70, 513, 5, 300, 1153};
  int i = 0;
  for (int window : {1, 5, 64, 100, 128, 129, 700}) {
    for (int head_dim : {128, 64, 16, 256, 96}) {
      if ((window + head_dim + i) % 2 == 1 && head_dim != 128) continue;  // a spread of pairs
      Shape sh;
      sh.dtype = i % 2 ? DType::kF16 : DType::kBF16;
      const int group = std::vector<int>{1, 4, 8, 3}[i % 4];
      sh.num_kv_heads = 2;
      sh.num_heads = 2 * group;
      sh.head_dim = head_dim;
      sh.block_size = std::vector<int>{16, 7, 32, 1}[i % 4];
      sh.window = window;
      const Problem p = make_problem(sh, qlen, ctx, 1200 + i);
      check_problem(p, ctx, {{3, 192}, {9, 64}}, "windowed prefill " + describe(sh));
      ++i;
    }
  }
  EXPECT_GE(i, 10);
}

// The Hopper prefill kernel forced with windows that start mid-tile, with block sizes that do
// not divide its tiles, next to the tile kernel on the same problem.
TEST(CudaPagedAttention, SlidingWindowHopperPrefillMatchesCpu) {
  REQUIRE_CUDA_DEVICE();
  const std::vector<int> qlen = {300, 1, 129, 31, 128, 700, 9};
  const std::vector<int> ctx = {300, 1, 400, 31, 1153, 700, 0};
  int i = 0;
  for (int window : {1, 77, 128, 300}) {
    for (int block_size : {16, 7}) {
      Shape sh;
      sh.dtype = i % 2 ? DType::kF16 : DType::kBF16;
      sh.num_kv_heads = 2;
      sh.num_heads = 8;
      sh.head_dim = 128;
      sh.block_size = block_size;
      sh.window = window;
      sh.softcap = i % 3 == 2 ? 4.0f : 0.0f;
      const Problem p = make_problem(sh, qlen, ctx, 1300 + i);
      ASSERT_TRUE(hopper_applies(p));
      const std::vector<float> ref = reference(p, ctx);
      ASSERT_FALSE(ref.empty());
      std::vector<uint16_t> out;
      ASSERT_NO_FATAL_FAILURE(run_gpu(p, ctx, 1, 0, &out, AttentionKernel::kHopper));
      expect_matches(p, ctx, out, ref, "Hopper prefill " + describe(sh));
      ++i;
    }
  }
}

// The attention logit soft-cap (Gemma 2: c tanh(s / c) before the mask), with and without a
// window, on every kernel: tiles (prefill, decode, split), the general head sizes, an FP8 cache
// (decode from registers and widened prefill), Hopper prefill (head_dim 128). q ~ U(-3, 3)
// gives scores of std ~1: c = 1 squashes most of them, c = 30 few.
TEST(CudaPagedAttention, SoftcapMatchesCpu) {
  REQUIRE_CUDA_DEVICE();
  const std::vector<int> qlen = {1, 1, 37, 200, 1, 5};
  const std::vector<int> ctx = {1, 300, 100, 200, 2049, 5};
  int i = 0;
  for (float cap : {1.0f, 30.0f}) {
    for (int window : {0, 50}) {
      for (int head_dim : {128, 64, 256, 80}) {
        Shape sh;
        sh.dtype = i % 2 ? DType::kF16 : DType::kBF16;
        sh.num_kv_heads = 2;
        sh.num_heads = 2 * std::vector<int>{4, 1, 8}[i % 3];
        sh.head_dim = head_dim;
        sh.block_size = 16;
        sh.fp8 = i % 4 == 3;
        sh.window = window;
        sh.softcap = cap;
        const Problem p = make_problem(sh, qlen, ctx, 1400 + i);
        check_problem(p, ctx, {{4, 576}, {9, 256}}, "softcap " + describe(sh));
        ++i;
      }
    }
  }
}

// A window on an FP8 cache: decode at both kernel instances' batch sizes and prefill.
TEST(CudaPagedAttention, SlidingWindowFp8MatchesCpu) {
  REQUIRE_CUDA_DEVICE();
  int i = 0;
  for (int head_dim : {128, 64, 256}) {
    Shape sh;
    sh.dtype = i % 2 ? DType::kF16 : DType::kBF16;
    sh.num_heads = 32;
    sh.num_kv_heads = 8;
    sh.head_dim = head_dim;
    sh.fp8 = true;
    sh.window = 70;
    std::vector<int> ctx, qlen;
    for (int s = 0; s < 200; ++s) {
      ctx.push_back(1 + (s * 37) % 900);
      qlen.push_back(s % 50 == 7 ? std::min(ctx.back(), 90) : 1);
    }
    const Problem p = make_problem(sh, qlen, ctx, 1500 + i);
    check_problem(p, ctx, {{2, 512}, {5, 192}}, "windowed fp8 " + describe(sh));
    ++i;
  }
}

// One decode graph captured with a window and a split plan, replayed with other context
// lengths: each sequence spreads only its window's keys over the splits.
TEST(CudaPagedAttention, SlidingWindowGraphReplay) {
  REQUIRE_CUDA_DEVICE();
  Shape sh;
  sh.num_heads = 16;
  sh.num_kv_heads = 4;
  sh.head_dim = 128;
  const std::vector<int> capacity = {2048, 2048, 2048, 2048};
  // Made without a window (no NaN blocks: the replays move the windows anywhere), run with one.
  Problem p = make_problem(sh, {1, 1, 1, 1}, capacity, 1600);
  p.shape.window = 300;
  const std::vector<std::vector<int>> replays = {
      {2048, 300, 1, 1000}, {17, 2047, 256, 301}, {0, 64, 2048, 0}};
  DeviceProblem d;
  ASSERT_NO_FATAL_FAILURE(upload_problem(p, &d));
  ASSERT_NO_FATAL_FAILURE(upload(&d.ctx, replays[0], "context_lens"));
  const int num_splits = 8;
  const int split_size = 256;
  const size_t ws = attention_workspace_bytes(p.total_q, sh.num_heads, sh.head_dim, num_splits);
  ASSERT_NO_FATAL_FAILURE(upload(&d.workspace, std::vector<uint8_t>(ws, 0xff), "workspace"));

  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  const Status st = paged_attention(make_args(p, d, num_splits, split_size), stream);
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  ASSERT_TRUE(st.is_ok()) << st.to_string();
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  for (size_t r = 0; r < replays.size(); ++r) {
    const std::vector<int>& ctx = replays[r];
    ASSERT_EQ(cudaMemcpy(d.ctx.get(), ctx.data(), ctx.size() * sizeof(int), cudaMemcpyHostToDevice),
              cudaSuccess);
    const std::vector<uint16_t> sentinel(p.q.size(), kSentinel);
    ASSERT_EQ(cudaMemcpy(d.out.get(), sentinel.data(), sentinel.size() * 2, cudaMemcpyHostToDevice),
              cudaSuccess);
    ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    std::vector<uint16_t> out;
    ASSERT_NO_FATAL_FAILURE(download(d.out, p.q.size(), &out));
    expect_matches(p, ctx, out, reference(p, ctx), "windowed graph replay " + std::to_string(r));
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

TEST(CudaPagedAttention, InvalidArguments) {
  REQUIRE_CUDA_DEVICE();
  Shape sh;
  const Problem p = make_problem(sh, {2, 1}, {5, 9}, 800);
  DeviceProblem d;
  ASSERT_NO_FATAL_FAILURE(upload_problem(p, &d));
  ASSERT_NO_FATAL_FAILURE(upload(&d.ctx, std::vector<int>{5, 9}, "context_lens"));
  const AttentionArgs good = make_args(p, d, 1, 0);
  {
    const Status st = paged_attention(good, nullptr);
    ASSERT_TRUE(st.is_ok()) << st.to_string();
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  }
  auto expect_invalid = [&](const char* what, auto mutate) {
    AttentionArgs a = good;
    mutate(a);
    const Status st = paged_attention(a, nullptr);
    EXPECT_EQ(st.code(), Code::kInvalidArgument) << what << ": " << st.to_string();
  };
  expect_invalid("f32 dtype", [](AttentionArgs& a) { a.dtype = DType::kF32; });
  expect_invalid("null q", [](AttentionArgs& a) { a.q = nullptr; });
  expect_invalid("null out", [](AttentionArgs& a) { a.out = nullptr; });
  expect_invalid("null k_cache", [](AttentionArgs& a) { a.k_cache = nullptr; });
  expect_invalid("null block_tables", [](AttentionArgs& a) { a.block_tables = nullptr; });
  expect_invalid("null context_lens", [](AttentionArgs& a) { a.context_lens = nullptr; });
  expect_invalid("null cu_query_lens", [](AttentionArgs& a) { a.cu_query_lens = nullptr; });
  expect_invalid("head_dim 47", [](AttentionArgs& a) { a.head_dim = 47; });
  expect_invalid("head_dim 0", [](AttentionArgs& a) { a.head_dim = 0; });
  expect_invalid("head_dim 1026", [](AttentionArgs& a) { a.head_dim = 1026; });
  expect_invalid("heads 6 / kv 4", [](AttentionArgs& a) {
    a.num_heads = 6;
    a.num_kv_heads = 4;
  });
  expect_invalid("kv heads 0", [](AttentionArgs& a) { a.num_kv_heads = 0; });
  expect_invalid("block_size 0", [](AttentionArgs& a) { a.block_size = 0; });
  expect_invalid("block_size 257", [](AttentionArgs& a) { a.block_size = 257; });
  expect_invalid("misaligned q",
                 [](AttentionArgs& a) { a.q = static_cast<const uint16_t*>(a.q) + 1; });
  expect_invalid("splits without workspace", [](AttentionArgs& a) {
    a.num_splits = 2;
    a.split_size = 64;
    a.workspace = nullptr;
  });
  DeviceBuffer ws;
  ASSERT_NO_FATAL_FAILURE(upload(
      &ws, std::vector<uint8_t>(attention_workspace_bytes(p.total_q, 8, 64, 2), 0), "workspace"));
  expect_invalid("split_size 100", [&](AttentionArgs& a) {
    a.num_splits = 2;
    a.split_size = 100;
    a.workspace = ws.get();
  });
  expect_invalid("split_size 0", [&](AttentionArgs& a) {
    a.num_splits = 2;
    a.split_size = 0;
    a.workspace = ws.get();
  });
  expect_invalid("num_splits 0", [](AttentionArgs& a) { a.num_splits = 0; });
  expect_invalid("scale 0", [](AttentionArgs& a) { a.scoring.scale = 0.0f; });
  expect_invalid("scale -1", [](AttentionArgs& a) { a.scoring.scale = -1.0f; });
  expect_invalid("scale NaN", [](AttentionArgs& a) { a.scoring.scale = NAN; });
  expect_invalid("softcap -1", [](AttentionArgs& a) { a.scoring.softcap = -1.0f; });
  expect_invalid("softcap inf", [](AttentionArgs& a) { a.scoring.softcap = INFINITY; });
  expect_invalid("window -1", [](AttentionArgs& a) { a.scoring.window = -1; });
  // The Hopper kernel forced where it does not apply (head_dim 64 here; an FP8 cache).
  expect_invalid("Hopper kernel, head_dim 64",
                 [](AttentionArgs& a) { a.kernel = AttentionKernel::kHopper; });
  expect_invalid("Hopper kernel, fp8 cache", [](AttentionArgs& a) {
    a.kernel = AttentionKernel::kHopper;
    a.head_dim = 128;
    a.num_heads = 4;
    a.kv_cache_dtype = KvCacheDtype::kFp8E4M3;
  });
  // The rejected calls launched nothing: out still holds the first (good) call's result.
  std::vector<uint16_t> out;
  ASSERT_NO_FATAL_FAILURE(download(d.out, p.q.size(), &out));
  expect_matches(p, {5, 9}, out, reference(p, {5, 9}), "after invalid calls");
}

TEST(CudaPagedAttention, ParseAttentionKernel) {
  EXPECT_EQ(parse_attention_kernel("auto").value(), AttentionKernel::kAuto);
  EXPECT_EQ(parse_attention_kernel("tiles").value(), AttentionKernel::kTiles);
  EXPECT_EQ(parse_attention_kernel("hopper").value(), AttentionKernel::kHopper);
  for (const char* bad : {"", "Hopper", "flash", "tiles "}) {
    const auto k = parse_attention_kernel(bad);
    ASSERT_FALSE(k.has_value()) << bad;
    EXPECT_EQ(k.status().code(), Code::kInvalidArgument);
    EXPECT_NE(k.status().to_string().find("auto, tiles, hopper"), std::string::npos);
  }
}

TEST(CudaPagedAttention, WorkspaceAndSplitPlan) {
  REQUIRE_CUDA_DEVICE();
  EXPECT_EQ(attention_workspace_bytes(10, 8, 128, 1), 0u);
  EXPECT_EQ(attention_workspace_bytes(10, 8, 128, 4), size_t{4} * 10 * 8 * 129 * 4);
  // Big batches fill the GPU without splitting; short contexts are never split.
  EXPECT_EQ(plan_attention_splits(256, 8, 4096, 132).num_splits, 1);
  EXPECT_EQ(plan_attention_splits(1, 8, 256, 132).num_splits, 1);
  for (int seqs : {1, 2, 7, 16, 33}) {
    for (int64_t max_context : {int64_t{257}, int64_t{2048}, int64_t{4097}, int64_t{131072}}) {
      const SplitPlan plan = plan_attention_splits(seqs, 8, max_context, 132);
      ASSERT_GE(plan.num_splits, 1);
      if (plan.num_splits == 1) continue;
      EXPECT_EQ(plan.split_size % 64, 0) << seqs << " " << max_context;
      EXPECT_GE(plan.split_size, 256) << seqs << " " << max_context;
      EXPECT_GE(int64_t{plan.num_splits} * plan.split_size, max_context);
      EXPECT_LT(int64_t{plan.num_splits - 1} * plan.split_size, max_context);
      EXPECT_LE(plan.num_splits, 64);
      EXPECT_LE(int64_t{seqs} * 8 * (plan.num_splits - 1), 2 * 132) << seqs << " " << max_context;
    }
  }
}

}  // namespace
}  // namespace tessera::cuda
