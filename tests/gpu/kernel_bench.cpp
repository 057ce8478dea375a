// Times each CUDA op of a Llama-3-8B decode step (and the 4096-token prefill's attention) in
// isolation: every op is captured 50 times back to back into a CUDA graph and the replay is
// timed, so the figure includes the per-node cost a decode graph pays. Prints one line per op
// and the per-step sum (x 32 layers). A benchmark, not a test: run by hand or from gpu-check.
//   kernel_bench [--batch 1] [--context 256] [--max-model-len 8192] [--zeros] [--window W]
//                [--gemv-tiles]
// --gemv-tiles (with --batch 1) also times every batch-1 linear of four models through cuBLASLt
// and each GEMV tile, the weights from HBM (time_gemv_tiles).
// --window W also times the decode attention with a sliding window of W keys (Gemma's local
// layers, Mistral): the K/V bytes it reads against the full context's.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/cuda/attention.h"
#include "kernels/cuda/elementwise.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/gemv.h"
#include "kernels/cuda/sampling.h"
#include "tests/gpu/bench_util.h"

namespace tessera::cuda {
namespace {

using bench::check;

// Buffers hold random bf16 values in [-1, 1), or zeros under --zeros (bench_util.h says why that
// matters).
bool g_zeros = false;

void* dalloc(size_t bytes) { return bench::dalloc(bytes, g_zeros); }

// Microseconds per call of `op`, captured `reps` times into one graph.
double time_op(cudaStream_t st, const std::function<Status()>& op, int reps = 50) {
  check(op(), "warm-up");
  check(cudaStreamSynchronize(st), "warm-up sync");
  cudaGraph_t g;
  cudaGraphExec_t ge;
  check(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal), "capture");
  for (int i = 0; i < reps; ++i) check(op(), "captured op");
  check(cudaStreamEndCapture(st, &g), "end capture");
  check(cudaGraphInstantiate(&ge, g, 0), "instantiate");
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  check(cudaGraphLaunch(ge, st), "launch");
  cudaEventRecord(a, st);
  for (int i = 0; i < 5; ++i) check(cudaGraphLaunch(ge, st), "launch");
  cudaEventRecord(b, st);
  check(cudaEventSynchronize(b), "sync");
  float ms = 0;
  cudaEventElapsedTime(&ms, a, b);
  cudaGraphExecDestroy(ge);
  cudaGraphDestroy(g);
  return ms * 1000.0 / (5.0 * reps);
}

// Llama-3-8B's shape, and the KV cache's block size.
constexpr int64_t H = 4096, I = 14336, V = 128256, heads = 32, kvh = 8, hd = 128;
constexpr int64_t qkv_n = (heads + 2 * kvh) * hd;
constexpr DType bf = DType::kBF16;
constexpr int64_t bs = 16;

struct Args {
  int64_t B = 1, ctx = 256, max_len = 8192;
  int64_t window = 0;       // --window: also time a sliding-window decode
  bool gemv_tiles = false;  // --gemv-tiles: the GEMV tile table (batch 1)
};

// The flags into `args` (--zeros into g_zeros); false after naming an unknown one.
bool parse_args(int argc, char** argv, Args& args) {
  for (int i = 1; i < argc; ++i) {
    const bool has_value = i + 1 < argc;
    if (!std::strcmp(argv[i], "--gemv-tiles")) {
      args.gemv_tiles = true;
    } else if (!std::strcmp(argv[i], "--zeros")) {
      g_zeros = true;
    } else if (has_value && !std::strcmp(argv[i], "--batch")) {
      args.B = std::atoll(argv[++i]);
    } else if (has_value && !std::strcmp(argv[i], "--context")) {
      args.ctx = std::atoll(argv[++i]);
    } else if (has_value && !std::strcmp(argv[i], "--max-model-len")) {
      args.max_len = std::atoll(argv[++i]);
    } else if (has_value && !std::strcmp(argv[i], "--window")) {
      args.window = std::atoll(argv[++i]);
    } else {
      std::fprintf(stderr, "kernel_bench: unknown argument %s\n", argv[i]);
      return false;
    }
  }
  return true;
}

int32_t* up(const std::vector<int32_t>& v) {
  void* p = dalloc(v.size() * 4);
  cudaMemcpy(p, v.data(), v.size() * 4, cudaMemcpyHostToDevice);
  return static_cast<int32_t*>(p);
}

// Every device buffer the decode ops use: activations of max(B, 4096) tokens, one layer's
// weights and the lm_head, the paged KV cache with its block tables (every sequence at
// context `ctx`), positions, slots, RoPE tables and the split attention's workspace.
struct Buffers {
  void *x, *y, *w_qkv, *w_o, *w_gu, *w_d, *w_lm, *logits, *norm_w, *resid;
  int64_t blocks_per_seq, num_blocks;
  void *kc, *vc;
  int32_t *d_tables, *d_cu, *d_ctx, *d_pos;
  int64_t* d_slots;
  float *cosb, *sinb;
  SplitPlan sp;
  void* ws;
};

Buffers allocate_buffers(const Args& args, const cudaDeviceProp& prop) {
  const int64_t B = args.B, ctx = args.ctx, max_len = args.max_len;
  Buffers b;
  const int64_t T = std::max<int64_t>(B, 4096);
  b.x = dalloc(T * I * 2 * 2);
  b.y = dalloc(T * I * 2 * 2);
  b.w_qkv = dalloc(qkv_n * H * 2);
  b.w_o = dalloc(H * H * 2);
  b.w_gu = dalloc(2 * I * H * 2);
  b.w_d = dalloc(H * I * 2);
  b.w_lm = dalloc(V * H * 2);
  b.logits = dalloc(B * V * 4);
  b.norm_w = dalloc(H * 2);
  b.resid = dalloc(T * H * 2);
  b.blocks_per_seq = (max_len + bs - 1) / bs;
  b.num_blocks = std::max<int64_t>(B * b.blocks_per_seq, 4096 / bs + 1);
  b.kc = dalloc(b.num_blocks * bs * kvh * hd * 2);
  b.vc = dalloc(b.num_blocks * bs * kvh * hd * 2);
  std::vector<int32_t> tables(B * b.blocks_per_seq), cu(B + 1), ctxs(B, static_cast<int32_t>(ctx));
  for (int64_t i = 0; i < B * b.blocks_per_seq; ++i) {
    tables[i] = static_cast<int32_t>(i % b.num_blocks);
  }
  for (int64_t i = 0; i <= B; ++i) cu[i] = static_cast<int32_t>(i);
  b.d_tables = up(tables);
  b.d_cu = up(cu);
  b.d_ctx = up(ctxs);
  std::vector<int32_t> pos(T, static_cast<int32_t>(ctx - 1));
  b.d_pos = up(pos);
  std::vector<int64_t> slots(T, -1);
  b.d_slots = static_cast<int64_t*>(dalloc(T * 8));
  cudaMemcpy(b.d_slots, slots.data(), T * 8, cudaMemcpyHostToDevice);
  b.cosb = static_cast<float*>(dalloc(max_len * hd / 2 * 4));
  b.sinb = static_cast<float*>(dalloc(max_len * hd / 2 * 4));
  b.sp = plan_attention_splits(static_cast<int>(B), kvh, max_len, prop.multiProcessorCount);
  b.ws = dalloc(std::max<size_t>(256, attention_workspace_bytes(B, heads, hd, b.sp.num_splits)));
  return b;
}

struct Row {
  std::string name;
  double us;
  int per_step;
};
// A linear layer (cuBLASLt), also reported as a fraction of the copy bandwidth.
struct Linear {
  std::string name;
  int64_t n, k;
  const void* w;
  DType out;
  int per_step;
  double us = 0;
};

// The decode step's linear layers, timed: a row each in `rows`. Returns them with their times.
std::vector<Linear> time_linears(cudaStream_t st, Gemm& gemm, const Args& args, const Buffers& b,
                                 std::vector<Row>& rows) {
  const int64_t B = args.B;
  std::vector<Linear> linears = {{"qkv", qkv_n, H, b.w_qkv, bf, 32},
                                 {"o", H, H, b.w_o, bf, 32},
                                 {"gate_up", 2 * I, H, b.w_gu, bf, 32},
                                 {"down", H, I, b.w_d, bf, 32},
                                 {"lm_head fp32", V, H, b.w_lm, DType::kF32, 1}};
  for (Linear& l : linears) {
    l.us = time_op(st, [&] {
      return gemm.linear({B, l.n, l.k, bf, l.out, false}, b.x, l.w, nullptr,
                         l.out == bf ? b.y : b.logits, st);
    });
    rows.push_back({"gemm " + l.name + " [" + std::to_string(B) + " x " + std::to_string(l.n) +
                        " x " + std::to_string(l.k) + "]",
                    l.us, l.per_step});
  }
  return linears;
}

// The decode step's other ops, timed: norms, RoPE with the cache write, SiLU, and attention
// with its planned splits and without; a row each in `rows` (the attention rows last). Returns
// the decode attention's arguments.
AttentionArgs time_decode_ops(cudaStream_t st, const Args& args, const Buffers& b,
                              std::vector<Row>& rows) {
  const int64_t B = args.B, ctx = args.ctx, max_len = args.max_len;
  rows.push_back(
      {"rms_norm",
       time_op(st, [&] { return rms_norm(bf, b.resid, b.norm_w, B, H, 1e-5f, b.y, st); }), 1});
  rows.push_back(
      {"add_rms_norm",
       time_op(st, [&] { return add_rms_norm(bf, b.x, b.resid, b.norm_w, B, H, 1e-5f, b.y, st); }),
       64});
  RopeCacheArgs r;
  r.dtype = bf;
  r.qkv = b.x;
  r.constants.cos = b.cosb;
  r.constants.sin = b.sinb;
  r.constants.max_position = max_len;
  r.positions = b.d_pos;
  r.slots = b.d_slots;
  r.num_tokens = B;
  r.num_heads = heads;
  r.num_kv_heads = kvh;
  r.head_dim = hd;
  r.q_out = b.y;
  r.k_cache = b.kc;
  r.v_cache = b.vc;
  r.num_blocks = b.num_blocks;
  r.block_size = bs;
  rows.push_back({"rope_and_cache", time_op(st, [&] { return rope_and_cache(r, st); }), 32});
  rows.push_back({"silu_mul", time_op(st, [&] { return silu_mul(bf, b.x, B, I, b.y, st); }), 32});
  AttentionArgs a;
  a.dtype = bf;
  a.q = b.x;
  a.out = b.y;
  a.k_cache = b.kc;
  a.v_cache = b.vc;
  a.num_blocks = b.num_blocks;
  a.block_size = bs;
  a.cu_query_lens = b.d_cu;
  a.context_lens = b.d_ctx;
  a.block_tables = b.d_tables;
  a.block_table_stride = static_cast<int>(b.blocks_per_seq);
  a.num_seqs = static_cast<int>(B);
  a.max_query_len = 1;
  a.num_heads = heads;
  a.num_kv_heads = kvh;
  a.head_dim = hd;
  a.scoring.scale = 1.0f / std::sqrt(128.0f);
  a.num_splits = b.sp.num_splits;
  a.split_size = b.sp.split_size;
  a.workspace = b.sp.num_splits > 1 ? b.ws : nullptr;
  a.total_q = B;
  rows.push_back({"attention decode ctx " + std::to_string(ctx) + " (" +
                      std::to_string(b.sp.num_splits) + " splits of " +
                      std::to_string(b.sp.split_size) + ")",
                  time_op(st, [&] { return paged_attention(a, st); }), 32});
  AttentionArgs a1 = a;
  a1.num_splits = 1;
  a1.split_size = 0;
  a1.workspace = nullptr;
  rows.push_back(
      {"attention decode, no split", time_op(st, [&] { return paged_attention(a1, st); }), 0});
  return a;
}

// Decode attention is bound by its K/V reads: compares them, and the linear layers' weight
// reads, with the device-to-device copy bandwidth in the same run (bench_util.h); then times the
// decode over an FP8 cache against the same bandwidth. `rows` ends with time_decode_ops's two
// attention rows.
void report_bandwidth(cudaStream_t st, const Args& args, const AttentionArgs& a,
                      const std::vector<Row>& rows, const std::vector<Linear>& linears) {
  const int64_t B = args.B, ctx = args.ctx;
  const double kv_bytes = static_cast<double>(B) * ctx * kvh * hd * 2 * 2;
  const double copy_bw = bench::copy_bandwidth(st);  // GB/s
  const double attn_us = rows[rows.size() - 2].us;
  const double attn_bw = kv_bytes / attn_us / 1e3;
  std::printf(
      "copy bandwidth %.0f GB/s; attention decode reads %.1f MB of K/V in %.1f us = "
      "%.0f GB/s = %.2f of the copy bandwidth (no split: %.2f)\n",
      copy_bw, kv_bytes / 1e6, attn_us, attn_bw, attn_bw / copy_bw,
      kv_bytes / rows.back().us / 1e3 / copy_bw);
  for (const Linear& l : linears) {
    const double gbs = static_cast<double>(l.n * l.k * 2) / l.us / 1e3;
    std::printf("gemm %-12s [%ld x %ld x %ld]: %.2f us = %.0f GB/s = %.2f of the copy bandwidth\n",
                l.name.c_str(), static_cast<long>(B), static_cast<long>(l.n),
                static_cast<long>(l.k), l.us, gbs, gbs / copy_bw);
  }
  // The same decode over an FP8 (E4M3) cache (--kv-cache-dtype fp8): half the bytes. The cache
  // buffers are reused as bytes (their values do not change the timing).
  AttentionArgs a8 = a;
  a8.kv_cache_dtype = KvCacheDtype::kFp8E4M3;
  const double fp8_us = time_op(st, [&] { return paged_attention(a8, st); });
  std::printf(
      "attention decode, fp8 KV cache: %.1f us (%.2fx the bf16 cache) = %.0f GB/s = %.2f of the "
      "copy bandwidth\n",
      fp8_us, attn_us / fp8_us, kv_bytes / 2 / fp8_us / 1e3, kv_bytes / 2 / fp8_us / 1e3 / copy_bw);
  if (args.window > 0) {
    // A sliding window: the kernel reads only the window's keys (whole blocks before it are
    // skipped), so its bytes are min(window, context) keys' per sequence.
    AttentionArgs aw = a;
    aw.scoring.window = args.window;
    const double w_us = time_op(st, [&] { return paged_attention(aw, st); });
    const double w_bytes = static_cast<double>(B) * std::min(args.window, ctx) * kvh * hd * 2 * 2;
    std::printf(
        "attention decode, window %ld of context %ld: reads %.1f MB of K/V (full context %.1f MB) "
        "in %.1f us (full %.1f us) = %.0f GB/s = %.2f of the copy bandwidth\n",
        static_cast<long>(args.window), static_cast<long>(ctx), w_bytes / 1e6, kv_bytes / 1e6, w_us,
        attn_us, w_bytes / w_us / 1e3, w_bytes / w_us / 1e3 / copy_bw);
  }
}

// Batch-1 linears of real models' widths: cuBLASLt and each tile of the GEMV kernel
// (gemv.h's GemvTile) side by side, with the tile gemv_tile() takes (Gemm::linear takes the GEMV
// for every batch-1 shape). Each call reads another copy of the weights (at least 512 MB between
// two reads of one copy), so L2 (50 MB) holds none of them: the figures are HBM reads, as in a
// step.
void time_gemv_tiles(cudaStream_t st, Gemm& gemm, double copy_bw) {
  struct Shape {
    const char* name;
    int64_t n, k;
    DType out;
  };
  const Shape shapes[] = {{"Qwen3-30B-A3B router", 128, 2048, DType::kF32},
                          {"Qwen3-30B-A3B o", 2048, 4096, bf},
                          {"Qwen3-30B-A3B qkv", 5120, 2048, bf},
                          {"Gemma 2 9B o", 3584, 4096, bf},
                          {"Llama-3-8B o", H, H, bf},
                          {"Llama-3-8B qkv", qkv_n, H, bf},
                          {"Gemma 2 9B qkv", 8192, 3584, bf},
                          {"Llama-3-8B down", H, I, bf},
                          {"Gemma 2 9B down", 3584, 14336, bf},
                          {"Llama-3-8B gate_up", 2 * I, H, bf},
                          {"Gemma 2 9B gate_up", 28672, 3584, bf},
                          {"Qwen3-30B-A3B lm_head", 151936, 2048, DType::kF32},
                          {"Gemma 2 9B lm_head (llama3 vocab)", V, 3584, DType::kF32},
                          {"Llama-3-8B lm_head", V, H, DType::kF32},
                          {"Gemma 2 9B lm_head", 256000, 3584, DType::kF32},
                          {"Llama-3-70B qkv", 10240, 8192, bf},
                          {"Llama-3-70B down", 8192, 28672, bf},
                          {"Llama-3-70B gate_up", 57344, 8192, bf},
                          {"Llama-3-70B lm_head", V, 8192, DType::kF32}};
  const std::vector<GemvTile> tiles = gemv_tiles();
  auto tile_name = [](const GemvTile& t) {
    char buf[32];
    if (t.slices == 1) {
      std::snprintf(buf, sizeof buf, "%dx%d", t.rows, t.depth);
    } else {
      std::snprintf(buf, sizeof buf, "%dx%dx%d", t.rows, t.depth, t.slices);
    }
    return std::string(buf);
  };
  int64_t most = 0;
  for (const Shape& s : shapes) most = std::max(most, s.n * s.k * 2);
  const int64_t pool_bytes = std::max<int64_t>(2 * most, int64_t{1} << 30);
  char* pool = static_cast<char*>(dalloc(static_cast<size_t>(pool_bytes)));
  void* x = dalloc(64 * 1024 * 2);
  void* y = dalloc(256000 * 4);
  std::printf(
      "batch-1 linears, weights from HBM: us and fraction of the copy bandwidth; gemv RxD = %s\n",
      "rows per group x 512-byte chunks in flight per row [x warps splitting k]");
  for (const Shape& s : shapes) {
    const int64_t bytes = s.n * s.k * 2, stride = (bytes + 255) / 256 * 256;
    const int64_t copies = std::max<int64_t>(1, pool_bytes / stride);
    int64_t call = 0;
    auto weights = [&] { return pool + (call++ % copies) * stride; };
    const auto frac = [&](double us) { return static_cast<double>(bytes) / us / 1e3 / copy_bw; };
    const double lt_us = time_op(st, [&] {
      return gemm.linear_cublaslt({1, s.n, s.k, bf, s.out, false}, x, weights(), nullptr, y, st);
    });
    const GemvTile chosen = gemv_tile(s.n, s.k);
    std::printf("  %-34s [1 x %6ld x %5ld] %7.1f MB, gemv takes %s: cuBLASLt %7.2f us (%.2f)",
                s.name, static_cast<long>(s.n), static_cast<long>(s.k), bytes / 1e6,
                tile_name(chosen).c_str(), lt_us, frac(lt_us));
    double best = lt_us;
    GemvTile best_tile{0, 0};
    for (const GemvTile& t : tiles) {
      const double us = time_op(
          st, [&] { return gemv_with(t, 1, s.n, s.k, bf, s.out, x, weights(), nullptr, y, st); });
      std::printf(", %s %.2f (%.2f)", tile_name(t).c_str(), us, frac(us));
      if (us < best) {
        best = us;
        best_tile = t;
      }
    }
    std::printf("; best %s %.2f us\n",
                best_tile.rows == 0 ? "linear" : tile_name(best_tile).c_str(), best);
  }
  cudaFree(pool);
  cudaFree(x);
  cudaFree(y);
}

// The decode ops' table: a line per row and the per-step sum.
void print_rows(const cudaDeviceProp& prop, const Args& args, const std::vector<Row>& rows) {
  double total = 0;
  std::printf("Llama-3-8B decode ops on %s, batch %ld, context %ld, max-model-len %ld, %s\n",
              prop.name, static_cast<long>(args.B), static_cast<long>(args.ctx),
              static_cast<long>(args.max_len),
              g_zeros ? "buffers of zeros" : "random bf16 buffers");
  for (const Row& row : rows) {
    std::printf("%-58s %9.2f us  x%-3d = %8.1f us\n", row.name.c_str(), row.us, row.per_step,
                row.us * row.per_step);
    total += row.us * row.per_step;
  }
  std::printf("%-58s %9s        = %8.1f us per step\n", "sum", "", total);
}

// Prefill at 4096 tokens (one sequence, causal): attention with each kernel and over an FP8
// cache, and the layer's GEMMs. `a` is the decode attention's arguments.
void time_prefill(cudaStream_t st, Gemm& gemm, const AttentionArgs& a, const Buffers& b) {
  std::vector<int32_t> cu1 = {0, 4096}, ctx1 = {4096};
  std::vector<int32_t> t1(4096 / bs);
  for (int64_t i = 0; i < 4096 / bs; ++i) t1[i] = static_cast<int32_t>(i);
  AttentionArgs p = a;
  p.cu_query_lens = up(cu1);
  p.context_lens = up(ctx1);
  p.block_tables = up(t1);
  p.block_table_stride = 4096 / bs;
  p.num_seqs = 1;
  p.max_query_len = 4096;
  p.num_splits = 1;
  p.split_size = 0;
  p.workspace = nullptr;
  p.total_q = 4096;
  const double flops = 4.0 * heads * hd * 4096.0 * 4096.0 / 2.0;
  // The tile kernel (mma.sync) and the Hopper kernel (wgmma, warp-specialized) side by side.
  for (auto [kernel, name] : {std::pair{AttentionKernel::kTiles, "tile kernel"},
                              std::pair{AttentionKernel::kHopper, "Hopper kernel"}}) {
    AttentionArgs pk = p;
    pk.kernel = kernel;
    const double us = time_op(
        st, [&] { return paged_attention(pk, st); }, 5);
    std::printf(
        "attention prefill 4096 causal, %s: %.1f us per layer = %.0f TFLOP/s (x32 = %.1f ms)\n",
        name, us, flops / us / 1e6, us * 32 / 1000);
  }
  AttentionArgs p8 = p;
  p8.kv_cache_dtype = KvCacheDtype::kFp8E4M3;
  const double us8 = time_op(
      st, [&] { return paged_attention(p8, st); }, 5);
  std::printf("attention prefill 4096 causal, fp8 KV cache: %.1f us per layer = %.0f TFLOP/s\n",
              us8, flops / us8 / 1e6);
  for (const auto& layer :
       {std::tuple{qkv_n, H, b.w_qkv}, {H, H, b.w_o}, {2 * I, H, b.w_gu}, {H, I, b.w_d}}) {
    // Plain copies, not structured bindings: clang does not capture those in a lambda.
    const int64_t n = std::get<0>(layer), k = std::get<1>(layer);
    const void* w = std::get<2>(layer);
    const double t = time_op(
        st,
        [&, n, k, w] {
          return gemm.linear({4096, n, k, bf, bf, false}, b.x, w, nullptr, b.y, st);
        },
        5);
    std::printf("gemm prefill [4096 x %ld x %ld]: %.1f us = %.0f TFLOP/s\n", static_cast<long>(n),
                static_cast<long>(k), t, 2.0 * 4096 * n * k / t / 1e6);
  }
}

int run(int argc, char** argv) {
  Args args;
  if (!parse_args(argc, argv, args)) return 2;
  cudaStream_t st;
  cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking);
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  auto gemm = Gemm::create();
  check(gemm.status(), "gemm");
  const Buffers b = allocate_buffers(args, prop);
  std::vector<Row> rows;
  const std::vector<Linear> linears = time_linears(st, *gemm.value(), args, b, rows);
  const AttentionArgs a = time_decode_ops(st, args, b, rows);
  report_bandwidth(st, args, a, rows, linears);
  auto sampler = GpuSampler::create(static_cast<int>(args.B), V, 20, st);
  check(sampler.status(), "sampler");
  rows.push_back({"argmax",
                  time_op(st,
                          [&] {
                            return sampler.value()->argmax(
                                static_cast<float*>(b.logits), static_cast<int>(args.B),
                                static_cast<int32_t*>(static_cast<void*>(b.d_pos)), st);
                          }),
                  1});
  print_rows(prop, args, rows);
  if (args.gemv_tiles && args.B == 1) time_gemv_tiles(st, *gemm.value(), bench::copy_bandwidth(st));
  time_prefill(st, *gemm.value(), a, b);
  return 0;
}

}  // namespace
}  // namespace tessera::cuda

int main(int argc, char** argv) { return tessera::cuda::run(argc, argv); }
