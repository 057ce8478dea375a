// Times each CUDA op of a Qwen3-30B-A3B decode layer (hidden 2048, 128 experts of width 768,
// top 8, 32 query / 4 KV heads of 128) in isolation, and the whole MoE block, against the copy
// bandwidth measured in the same run. Every op is captured 48 times back to back into a CUDA
// graph (the model's 48 layers) and the replay is timed; each capture reads the weights of the
// next of kLayers distinct layers, so the experts come from HBM as in a real step, not from the
// 50 MB L2. Prints a line per op with its bytes and fraction of the copy bandwidth, and the
// per-step sum. A benchmark, not a test: gpu-check runs it.
//   moe_bench [--batch 1] [--context 256] [--max-model-len 4096]
#include <cuda_profiler_api.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "kernels/cuda/attention.h"
#include "kernels/cuda/block_trace.h"
#include "kernels/cuda/elementwise.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/gemv.h"
#include "kernels/cuda/moe.h"
#include "tests/gpu/bench_util.h"

namespace tessera::cuda {
namespace {

using bench::check;
using bench::dalloc;

constexpr int kSteps = 48;  // layers per decode step
constexpr int kLayers = 6;  // distinct weight sets the captures cycle through (> L2)
constexpr int64_t H = 2048, I = 768, E = 128, K = 8, heads = 32, kvh = 4, hd = 128;
constexpr int64_t V = 151936, bs = 16;
constexpr DType bf = DType::kBF16;

// Microseconds per call of `op(layer)`, captured kSteps times (layer 0, 1, ... mod kLayers).
double time_op(cudaStream_t st, const std::function<Status(int)>& op) {
  check(op(0), "warm-up");
  check(cudaStreamSynchronize(st), "warm-up sync");
  cudaGraph_t g;
  cudaGraphExec_t ge;
  check(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal), "capture");
  for (int i = 0; i < kSteps; ++i) check(op(i % kLayers), "captured op");
  check(cudaStreamEndCapture(st, &g), "end capture");
  check(cudaGraphInstantiate(&ge, g, 0), "instantiate");
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  check(cudaGraphLaunch(ge, st), "launch");
  cudaEventRecord(a, st);
  constexpr int kReplays = 10;
  for (int i = 0; i < kReplays; ++i) check(cudaGraphLaunch(ge, st), "launch");
  cudaEventRecord(b, st);
  check(cudaEventSynchronize(b), "sync");
  float ms = 0;
  cudaEventElapsedTime(&ms, a, b);
  cudaGraphExecDestroy(ge);
  cudaGraphDestroy(g);
  return ms * 1000.0 / (kReplays * kSteps);
}

// The per-block records of the kernels run between start() and write() (block_trace.h).
class BlockRecorder {
 public:
  BlockRecorder() = default;
  BlockRecorder(const BlockRecorder&) = delete;
  BlockRecorder& operator=(const BlockRecorder&) = delete;
  ~BlockRecorder() {
    if (buf_.records != nullptr) {
      block_trace::attach({});
      cudaFree(buf_.records);
      cudaFree(buf_.next);
    }
  }
  bool on() const { return buf_.records != nullptr; }
  void start() {
    using block_trace::kCounterStride;
    using block_trace::kMaxSms;
    buf_.per_sm = kPerSm;
    check(cudaMalloc(&buf_.records, kMaxSms * kPerSm * sizeof(block_trace::Record)), "cudaMalloc");
    check(cudaMalloc(&buf_.next, kMaxSms * kCounterStride * sizeof(unsigned long long)),
          "cudaMalloc");
    check(cudaMemset(buf_.next, 0, kMaxSms * kCounterStride * sizeof(unsigned long long)),
          "memset");
    if (block_trace::attach(buf_) == cudaErrorNotSupported) {
      std::fprintf(stderr,
                   "moe_bench: MOE_BENCH_BLOCKS needs a build with -DTESSERA_BLOCK_TRACE=ON\n");
      std::exit(2);
    }
  }
  void write(const char* path) {
    using block_trace::kCounterStride;
    using block_trace::kMaxSms;
    check(cudaDeviceSynchronize(), "sync");
    check(block_trace::attach({}), "detach");
    std::vector<unsigned long long> counts(kMaxSms * kCounterStride);
    check(cudaMemcpy(counts.data(), buf_.next, counts.size() * sizeof(unsigned long long),
                     cudaMemcpyDeviceToHost),
          "copy");
    std::vector<block_trace::Record> rec(kMaxSms * kPerSm);
    check(cudaMemcpy(rec.data(), buf_.records, rec.size() * sizeof(block_trace::Record),
                     cudaMemcpyDeviceToHost),
          "copy");
    std::FILE* f = std::fopen(path, "w");
    if (f == nullptr) {
      std::fprintf(stderr, "moe_bench: cannot write %s\n", path);
      std::exit(2);
    }
    std::fprintf(f, "kernel,sm,block,start,waited,end,at0,at1\n");
    unsigned long long n = 0, dropped = 0;
    for (unsigned sm = 0; sm < kMaxSms; ++sm) {
      const unsigned long long count = counts[sm * kCounterStride];
      dropped += count > kPerSm ? count - kPerSm : 0;
      for (unsigned long long i = 0; i < std::min(count, kPerSm); ++i, ++n) {
        const block_trace::Record& r = rec[sm * kPerSm + i];
        std::fprintf(
            f, "%u,%u,%u,%llu,%llu,%llu,%llu,%llu\n", r.kernel_sm & 0xffffu, r.kernel_sm >> 16,
            r.block, static_cast<unsigned long long>(r.start),
            static_cast<unsigned long long>(r.waited), static_cast<unsigned long long>(r.end),
            static_cast<unsigned long long>(r.at[0]), static_cast<unsigned long long>(r.at[1]));
      }
    }
    std::fclose(f);
    std::fprintf(stderr, "moe_bench: %llu block records in %s (%llu past the buffer)\n", n, path,
                 dropped);
  }

 private:
  static constexpr unsigned long long kPerSm = 16384;  // a chain's 12 x 48 layers take ~5000
  block_trace::Buffer buf_;
};

struct Layer {
  void *qkv, *o, *router, *gate_up, *down, *norm, *q_norm, *k_norm;
};

struct Row {
  std::string name;
  double us;
  double bytes;  // weight (and K/V) bytes one call reads; 0: not counted
  int per_step;
};

int run(int argc, char** argv) {
  int64_t B = 1, ctx = 256, max_len = 4096;
  for (int i = 1; i < argc; ++i) {
    const bool has_value = i + 1 < argc;
    if (has_value && !std::strcmp(argv[i], "--batch")) {
      B = std::atoll(argv[++i]);
    } else if (has_value && !std::strcmp(argv[i], "--context")) {
      ctx = std::atoll(argv[++i]);
    } else if (has_value && !std::strcmp(argv[i], "--max-model-len")) {
      max_len = std::atoll(argv[++i]);  // the attention's split plan is made for it
    } else {
      std::fprintf(stderr, "moe_bench: unknown argument %s\n", argv[i]);
      return 2;
    }
  }
  if (B < 1 || B * K > 4096 || ctx < 1 || ctx > 32768 || max_len < ctx) {
    std::fprintf(stderr,
                 "moe_bench: --batch in [1, 512], --context in [1, 32768], --max-model-len >= "
                 "--context\n");
    return 2;
  }
  cudaStream_t st;
  cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking);
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  auto gemm_or = Gemm::create();
  check(gemm_or.status(), "gemm");
  Gemm& gemm = *gemm_or.value();
  const int64_t qkv_n = (heads + 2 * kvh) * hd;
  std::vector<Layer> layers(kLayers);
  for (Layer& l : layers) {
    l.qkv = dalloc(qkv_n * H * 2);
    l.o = dalloc(H * heads * hd * 2);
    l.router = dalloc(E * H * 2);
    l.gate_up = dalloc(E * 2 * I * H * 2);
    l.down = dalloc(E * H * I * 2);
    l.norm = dalloc(H * 2);
    l.q_norm = dalloc(hd * 2);
    l.k_norm = dalloc(hd * 2);
  }
  void* lm_head = dalloc(V * H * 2);
  void* x = dalloc(B * H * 2);
  void* resid = dalloc(B * H * 2);
  void* y = dalloc(B * std::max(qkv_n, H) * 2);
  void* q = dalloc(B * heads * hd * 2);
  void* attn = dalloc(B * heads * hd * 2);
  void* logits = dalloc(B * V * 4);
  const int64_t blocks_per_seq = (ctx + bs - 1) / bs, num_blocks = B * blocks_per_seq;
  void* kc = dalloc(num_blocks * bs * kvh * hd * 2);
  void* vc = dalloc(num_blocks * bs * kvh * hd * 2);
  std::vector<int32_t> tables(B * blocks_per_seq), cu(B + 1), ctxs(B, static_cast<int32_t>(ctx)),
      pos(B, static_cast<int32_t>(ctx - 1));
  for (int64_t i = 0; i < B * blocks_per_seq; ++i) tables[i] = static_cast<int32_t>(i);
  for (int64_t i = 0; i <= B; ++i) cu[i] = static_cast<int32_t>(i);
  auto up = [](const std::vector<int32_t>& v) {
    void* p = nullptr;
    check(cudaMalloc(&p, v.size() * 4), "cudaMalloc");
    check(cudaMemcpy(p, v.data(), v.size() * 4, cudaMemcpyHostToDevice), "upload");
    return static_cast<int32_t*>(p);
  };
  int32_t *d_tables = up(tables), *d_cu = up(cu), *d_ctx = up(ctxs), *d_pos = up(pos);
  std::vector<int64_t> slots(B);
  for (int64_t b = 0; b < B; ++b) slots[b] = b * blocks_per_seq * bs + ctx - 1;
  int64_t* d_slots = nullptr;
  check(cudaMalloc(&d_slots, B * 8), "cudaMalloc");
  check(cudaMemcpy(d_slots, slots.data(), B * 8, cudaMemcpyHostToDevice), "upload");
  std::vector<float> cs(ctx * hd / 2, 1.0f);
  float *cosb = nullptr, *sinb = nullptr;
  check(cudaMalloc(&cosb, cs.size() * 4), "cudaMalloc");
  check(cudaMalloc(&sinb, cs.size() * 4), "cudaMalloc");
  check(cudaMemcpy(cosb, cs.data(), cs.size() * 4, cudaMemcpyHostToDevice), "upload");
  check(cudaMemcpy(sinb, cs.data(), cs.size() * 4, cudaMemcpyHostToDevice), "upload");
  const SplitPlan sp =
      plan_attention_splits(static_cast<int>(B), kvh, max_len, prop.multiProcessorCount);
  void* attn_ws = dalloc(
      std::max<size_t>(256, attention_workspace_bytes(B, heads, hd, std::max(sp.num_splits, 4))));
  const uint64_t moe_ws_bytes = moe_workspace_bytes(bf, B, E, K, E, H, I, 0);
  void* moe_ws = dalloc(moe_ws_bytes);
  // The MoE workspace's first regions (moe.cu's Carve): logits, ids, weights.
  const size_t align = 256;
  auto al = [&](size_t n) { return (n + align - 1) / align * align; };
  auto* r_logits = static_cast<float*>(moe_ws);
  auto* r_ids = reinterpret_cast<int32_t*>(static_cast<char*>(moe_ws) + al(4 * B * E));
  auto* r_weights =
      reinterpret_cast<float*>(static_cast<char*>(moe_ws) + al(4 * B * E) + al(4 * B * K));
  void* act = dalloc(B * K * I * 2);
  void* out = dalloc(B * H * 2);

  auto experts = [&](int l) {
    MoeExperts w;
    w.gate_up = layers[l].gate_up;
    w.down = layers[l].down;
    w.local_experts = E;
    w.hidden = H;
    w.inter = I;
    return w;
  };
  const double wb = 2.0;  // bytes per weight
  std::vector<Row> rows;
  rows.push_back({"add_rms_norm",
                  time_op(st,
                          [&](int l) {
                            return add_rms_norm(bf, y, resid, layers[l].norm, B, H, 1e-6f, x, st);
                          }),
                  0, 2});
  rows.push_back(
      {"gemm qkv",
       time_op(st,
               [&](int l) {
                 return gemm.linear({B, qkv_n, H, bf, bf, false}, x, layers[l].qkv, nullptr, y, st);
               }),
       wb * qkv_n * H, 1});
  RopeCacheArgs r;
  r.dtype = bf;
  r.qkv = y;
  r.constants.cos = cosb;
  r.constants.sin = sinb;
  r.constants.max_position = ctx;
  r.positions = d_pos;
  r.slots = d_slots;
  r.num_tokens = B;
  r.num_heads = heads;
  r.num_kv_heads = kvh;
  r.head_dim = hd;
  r.q_out = q;
  r.k_cache = kc;
  r.v_cache = vc;
  r.num_blocks = num_blocks;
  r.block_size = bs;
  rows.push_back({"rope_and_cache (q/k norms)",
                  time_op(st,
                          [&](int l) {
                            RopeCacheArgs rl = r;
                            rl.constants.q_norm = layers[l].q_norm;
                            rl.constants.k_norm = layers[l].k_norm;
                            return rope_and_cache(rl, st);
                          }),
                  0, 1});
  AttentionArgs a;
  a.dtype = bf;
  a.q = q;
  a.out = attn;
  a.k_cache = kc;
  a.v_cache = vc;
  a.num_blocks = num_blocks;
  a.block_size = bs;
  a.cu_query_lens = d_cu;
  a.context_lens = d_ctx;
  a.block_tables = d_tables;
  a.block_table_stride = static_cast<int>(blocks_per_seq);
  a.num_seqs = static_cast<int>(B);
  a.max_query_len = 1;
  a.num_heads = heads;
  a.num_kv_heads = kvh;
  a.head_dim = hd;
  a.scoring.scale = 1.0f / std::sqrt(128.0f);
  a.num_splits = sp.num_splits;
  a.split_size = sp.split_size;
  a.workspace = sp.num_splits > 1 ? attn_ws : nullptr;
  a.total_q = B;
  rows.push_back({"attention decode ctx " + std::to_string(ctx),
                  time_op(st, [&](int) { return paged_attention(a, st); }),
                  2.0 * B * ctx * kvh * hd * 2, 1});
  rows.push_back({"gemm o",
                  time_op(st,
                          [&](int l) {
                            return gemm.linear({B, H, heads * hd, bf, bf, false}, attn, layers[l].o,
                                               nullptr, y, st);
                          }),
                  wb * H * heads * hd, 1});
  const size_t moe_rows_at = rows.size();
  rows.push_back({"moe router gemm (fp32 out)",
                  time_op(st,
                          [&](int l) {
                            return gemm.linear({B, E, H, bf, DType::kF32, false}, x,
                                               layers[l].router, nullptr, r_logits, st);
                          }),
                  wb * E * H, 1});
  rows.push_back(
      {"moe route (softmax, top-k)",
       time_op(st,
               [&](int) { return moe_route(r_logits, bf, B, E, K, true, r_ids, r_weights, st); }),
       0, 1});
  // The GEMV's bytes: the distinct experts the batch picked (read once from HBM each).
  std::vector<int32_t> ids(B * K);
  check(cudaMemcpy(ids.data(), r_ids, ids.size() * 4, cudaMemcpyDeviceToHost), "ids");
  std::sort(ids.begin(), ids.end());
  const double distinct = static_cast<double>(std::unique(ids.begin(), ids.end()) - ids.begin());
  rows.push_back(
      {"moe gemv gate_up",
       time_op(st,
               [&](int l) { return moe_gemv_gate_up(bf, x, r_ids, B, K, experts(l), act, st); }),
       wb * distinct * 2 * I * H, 1});
  rows.push_back({"moe gemv down + combine",
                  time_op(st,
                          [&](int l) {
                            return moe_gemv_down_combine(bf, act, r_ids, r_weights, B, K,
                                                         experts(l), nullptr, nullptr, nullptr, out,
                                                         st);
                          }),
                  wb * distinct * H * I, 1});
  const size_t moe_rows_end = rows.size();
  // The GEMV path's other tiles (moe.h's MoeGemvTiles), each on the same weights and routing.
  std::printf("moe gemv tiles (us, fraction of the copy bandwidth measured below):\n");
  std::vector<std::pair<std::string, double>> tile_rows;
  for (auto [outs, unroll] : {std::pair{2, 1}, {2, 2}, {2, 4}, {1, 4}, {1, 8}}) {
    MoeGemvTiles t;
    t.gate_up_outs = outs;
    t.gate_up_unroll = unroll;
    tile_rows.emplace_back(
        "moe gemv gate_up " + std::to_string(outs) + "x" + std::to_string(unroll),
        time_op(st, [&](int l) {
          return moe_gemv_gate_up(bf, x, r_ids, B, K, experts(l), act, st, t);
        }));
  }
  for (auto [down_rows, unroll] : {std::pair{8, 1}, {8, 2}, {8, 3}, {4, 1}, {4, 3}}) {
    MoeGemvTiles t;
    t.down_rows = down_rows;
    t.down_unroll = unroll;
    tile_rows.emplace_back(
        "moe gemv down " + std::to_string(down_rows) + "x" + std::to_string(unroll),
        time_op(st, [&](int l) {
          return moe_gemv_down_combine(bf, act, r_ids, r_weights, B, K, experts(l), nullptr,
                                       nullptr, nullptr, out, st, t);
        }));
  }
  MoeArgs m;
  m.dtype = bf;
  m.tokens = B;
  m.num_experts = E;
  m.top_k = K;
  m.renormalize = true;
  m.x = x;
  m.workspace = moe_ws;
  m.workspace_bytes = moe_ws_bytes;
  m.out = out;
  const double moe_us = time_op(st, [&](int l) {
    MoeArgs ml = m;
    ml.router = layers[l].router;
    ml.experts = experts(l);
    return moe_forward(ml, gemm, st);
  });
  // The whole block with other tiles: in a chain each kernel waits for the one before, so a tile
  // faster alone need not make the block faster.
  for (auto [gu, dn] : {std::pair{std::pair{2, 4}, std::pair{8, 2}},
                        {{2, 4}, {8, 1}},
                        {{2, 1}, {8, 2}},
                        {{2, 2}, {8, 3}},
                        {{1, 8}, {8, 2}}}) {
    MoeGemvTiles t;
    t.gate_up_outs = gu.first;
    t.gate_up_unroll = gu.second;
    t.down_rows = dn.first;
    t.down_unroll = dn.second;
    const double us = time_op(st, [&](int l) {
      MoeArgs ml = m;
      ml.router = layers[l].router;
      ml.experts = experts(l);
      ml.gemv_tiles = t;
      return moe_forward(ml, gemm, st);
    });
    tile_rows.emplace_back("moe_forward whole, gate_up " + std::to_string(gu.first) + "x" +
                               std::to_string(gu.second) + ", down " + std::to_string(dn.first) +
                               "x" + std::to_string(dn.second),
                           us);
  }
  // The layer as the model runs it: every op in order, each reading what the one before wrote
  // (so launches that overlap the kernel before show here, not in the rows above).
  const double chain_us = time_op(st, [&](int l) {
    const Layer& w = layers[l];
    Status s = add_rms_norm(bf, out, resid, w.norm, B, H, 1e-6f, x, st);
    if (s.is_ok()) s = gemm.linear({B, qkv_n, H, bf, bf, false}, x, w.qkv, nullptr, y, st);
    RopeCacheArgs rl = r;
    rl.constants.q_norm = w.q_norm;
    rl.constants.k_norm = w.k_norm;
    if (s.is_ok()) s = rope_and_cache(rl, st);
    if (s.is_ok()) s = paged_attention(a, st);
    if (s.is_ok()) {
      s = gemm.linear({B, H, heads * hd, bf, bf, false}, attn, w.o, nullptr, y, st);
    }
    if (s.is_ok()) s = add_rms_norm(bf, y, resid, w.norm, B, H, 1e-6f, x, st);
    if (!s.is_ok()) return s;
    MoeArgs ml = m;
    ml.router = w.router;
    ml.experts = experts(l);
    return moe_forward(ml, gemm, st);
  });
  // Batch 1: the layer exactly as the CUDA model runs it (the input norm in qkv's GEMV, the
  // post-attention norm in the router's, the rope inside the attention, the MoE block's four
  // kernels), then the same chain with
  // one op left out (its cost in the chain: the launch and the wait it adds, not only its time
  // alone) and with other GEMV / MoE tiles.
  struct Chain {
    std::string name;
    bool qkv = true, rope = true, attention = true, o = true, router = true, route = true,
         gate_up = true, down = true;
    GemvTile qkv_tile, o_tile, router_tile;
    MoeGemvTiles moe;
    int attn_splits = 0;      // 0: the planned split (sp); 1: none
    bool rope_inside = true;  // the attention applies the rope (AttentionRope), as the model does
  };
  std::vector<std::pair<std::string, double>> chain_rows;
  if (B == 1) {
    void* proj = dalloc(H * 2);
    int32_t* arrivals = nullptr;
    check(cudaMalloc(&arrivals, 4), "cudaMalloc");
    check(cudaMemset(arrivals, 0, 4), "memset");
    Chain model;
    model.name = "model";
    model.qkv_tile = gemv_norm_tile(qkv_n, H);
    model.o_tile = gemv_tile(H, heads * hd);
    model.router_tile = gemv_norm_tile(E, H);
    std::vector<Chain> chains{model};
    auto without = [&](const char* what, bool Chain::*field) {
      Chain c = model;
      c.name = std::string("without ") + what;
      c.*field = false;
      chains.push_back(c);
    };
    without("qkv", &Chain::qkv);
    without("attention (and its rope)", &Chain::attention);
    without("o", &Chain::o);
    without("router", &Chain::router);
    without("route", &Chain::route);
    without("gate_up", &Chain::gate_up);
    without("down", &Chain::down);
    {
      Chain c = model;
      c.name = "without router, route";
      c.router = c.route = false;
      chains.push_back(c);
      c = model;
      c.name = "only qkv, o, gate_up, down";
      c.rope = c.attention = c.router = c.route = false;
      chains.push_back(c);
    }
    auto tile_name = [](const GemvTile& t) {
      return std::to_string(t.rows) + "x" + std::to_string(t.depth) + "x" +
             std::to_string(t.slices);
    };
    for (GemvTile t : {GemvTile{2, 2, 1}, GemvTile{2, 4, 2}, GemvTile{4, 2, 2}, GemvTile{2, 2, 4},
                       GemvTile{2, 2, 8}, GemvTile{4, 2, 4}}) {
      Chain c = model;
      c.name = "o " + tile_name(t);
      c.o_tile = t;
      chains.push_back(c);
    }
    for (GemvTile t : {GemvTile{4, 2, 2}, GemvTile{2, 2, 2}, GemvTile{4, 2, 4}}) {
      Chain c = model;
      c.name = "qkv " + tile_name(t) +
               (gemv_add_rms_norm_one_wave_with(t, qkv_n, H, bf, bf) ? "" : " (not one wave)");
      c.qkv_tile = t;
      chains.push_back(c);
    }
    for (GemvTile t : {GemvTile{2, 2, 1}, GemvTile{2, 2, 8}}) {
      Chain c = model;
      c.name = "router " + tile_name(t);
      c.router_tile = t;
      chains.push_back(c);
    }
    for (int splits : {1, 2}) {
      Chain c = model;
      c.name = "attention " + std::to_string(splits) + " split" + (splits > 1 ? "s" : "");
      c.attn_splits = splits;
      chains.push_back(c);
    }
    {
      Chain c = model;
      c.name = "rope kernel before the attention";
      c.rope_inside = false;
      chains.push_back(c);
    }
    for (auto [gu, dn] : {std::pair{std::pair{2, 2}, std::pair{8, 2}},
                          {{2, 4}, {8, 2}},
                          {{2, 4}, {8, 3}},
                          {{2, 1}, {8, 3}}}) {
      Chain c = model;
      c.moe.gate_up_outs = gu.first;
      c.moe.gate_up_unroll = gu.second;
      c.moe.down_rows = dn.first;
      c.moe.down_unroll = dn.second;
      c.name = "moe gate_up " + std::to_string(gu.first) + "x" + std::to_string(gu.second) +
               ", down " + std::to_string(dn.first) + "x" + std::to_string(dn.second);
      chains.push_back(c);
    }
    // The model's chain once more, last: how far a row drifts from the first by its place alone
    // (on an H100 the model's kernels as the last row read 0.29 us below to 0.18 us above the
    // first: records 2026-12-07-h100-down-8x3-and-row-drift and -resident-qkv).
    Chain again = model;
    again.name = "the model again (the rows' drift)";
    chains.push_back(again);
    // MOE_BENCH_PROFILE=1: the model's chain (its capture and replays) between
    // cudaProfilerStart and Stop, for `nsys profile --capture-range=cudaProfilerApi` (a timeline
    // of that chain alone; scripts/bench/chain_trace.py reads it).
    const bool profile = std::getenv("MOE_BENCH_PROFILE") != nullptr;
    // MOE_BENCH_BLOCKS=FILE: the model chain's blocks (a build with TESSERA_BLOCK_TRACE) into
    // FILE, a CSV scripts/bench/block_trace.py reads.
    const char* blocks_csv = std::getenv("MOE_BENCH_BLOCKS");
    for (const Chain& c : chains) {
      const bool traced = profile && &c == &chains.front();
      if (traced) check(cudaProfilerStart(), "cudaProfilerStart");
      BlockRecorder blocks;
      if (blocks_csv != nullptr && &c == &chains.front()) blocks.start();
      const double us = time_op(st, [&](int l) {
        const Layer& w = layers[l];
        const GemvAddRmsNorm in_norm{out, resid, w.norm, 1e-6f, x, arrivals};
        const GemvAddRmsNorm post_norm{proj, resid, w.norm, 1e-6f, x, arrivals};
        Status s;
        if (c.qkv) {
          s = gemv_add_rms_norm_with(c.qkv_tile, qkv_n, H, bf, bf, in_norm, w.qkv, nullptr, y, st);
        }
        RopeCacheArgs rl = r;
        rl.constants.q_norm = w.q_norm;
        rl.constants.k_norm = w.k_norm;
        if (s.is_ok() && c.rope && !c.rope_inside) s = rope_and_cache(rl, st);
        AttentionArgs al = a;
        if (c.attn_splits != 0) {
          al.num_splits = c.attn_splits;
          al.split_size =
              c.attn_splits > 1
                  ? static_cast<int>((max_len + c.attn_splits - 1) / c.attn_splits + 63) / 64 * 64
                  : 0;
          al.workspace = c.attn_splits > 1 ? attn_ws : nullptr;
        }
        if (c.rope_inside) {
          al.rope.qkv = rl.qkv;
          al.rope.constants = rl.constants;
        }
        if (s.is_ok() && c.attention) s = paged_attention(al, st);
        if (s.is_ok() && c.o) {
          s = gemv_with(c.o_tile, 1, H, heads * hd, bf, bf, attn, w.o, nullptr, proj, st);
        }
        if (s.is_ok() && c.router) {
          s = gemv_add_rms_norm_with(c.router_tile, E, H, bf, DType::kF32, post_norm, w.router,
                                     nullptr, r_logits, st);
        }
        if (s.is_ok() && c.route) s = moe_route(r_logits, bf, 1, E, K, true, r_ids, r_weights, st);
        if (s.is_ok() && c.gate_up) {
          s = moe_gemv_gate_up(bf, x, r_ids, 1, K, experts(l), act, st, c.moe);
        }
        if (s.is_ok() && c.down) {
          s = moe_gemv_down_combine(bf, act, r_ids, r_weights, 1, K, experts(l), x, nullptr,
                                    nullptr, out, st, c.moe);
        }
        return s;
      });
      if (traced) check(cudaProfilerStop(), "cudaProfilerStop");
      if (blocks.on()) blocks.write(blocks_csv);
      chain_rows.emplace_back(c.name, us);
    }
  }
  const double lm_us = time_op(st, [&](int) {
    return gemm.linear({B, V, H, bf, DType::kF32, false}, x, lm_head, nullptr, logits, st);
  });
  const double bw = bench::copy_bandwidth(st);
  std::printf("Qwen3-30B-A3B decode ops on %s, batch %ld, context %ld; copy bandwidth %.0f GB/s\n",
              prop.name, static_cast<long>(B), static_cast<long>(ctx), bw);
  double total = 0, bytes = 0;
  for (const Row& row : rows) {
    const double gbs = row.bytes / row.us / 1e3;
    std::printf("%-34s %8.2f us x%d", row.name.c_str(), row.us, row.per_step);
    if (row.bytes > 0) {
      std::printf("  %7.2f MB %6.0f GB/s = %.2f of copy", row.bytes / 1e6, gbs, gbs / bw);
    }
    std::printf("\n");
    total += row.us * row.per_step;
    bytes += row.bytes * row.per_step;
  }
  for (const auto& [name, us] : tile_rows) {
    const bool whole = name.find("whole") != std::string::npos;
    const double b = wb * distinct *
                     (whole                                       ? 3
                      : name.find("gate_up") != std::string::npos ? 2
                                                                  : 1) *
                     I * H;
    std::printf("%-34s %8.2f us = %.2f of copy\n", name.c_str(), us, b / us / 1e3 / bw);
  }
  double moe_parts = 0, moe_bytes = 0;
  for (size_t i = moe_rows_at; i < moe_rows_end; ++i) {
    moe_parts += rows[i].us;
    moe_bytes += rows[i].bytes;
  }
  std::printf("%-34s %8.2f us (its ops one by one: %.2f us); %.1f MB = %.2f of copy\n",
              "moe_forward whole", moe_us, moe_parts, moe_bytes / 1e6,
              moe_bytes / moe_us / 1e3 / bw);
  const double layer_us = total - moe_parts + moe_us;
  const double lm_bytes = wb * V * H;
  const double step_us = layer_us * kSteps + lm_us;
  const double step_bytes = bytes * kSteps + lm_bytes;
  std::printf("%-34s %8.2f us = %.2f of copy\n", "lm_head (fp32 out)", lm_us,
              lm_bytes / lm_us / 1e3 / bw);
  std::printf(
      "layer %.2f us x %d + lm_head = %.1f us per step (%.0f tok/s per sequence); %.2f GB read "
      "= %.2f of the copy bandwidth's roofline\n",
      layer_us, kSteps, step_us, 1e6 / step_us, step_bytes / 1e9, step_bytes / step_us / 1e3 / bw);
  if (!chain_rows.empty()) {
    const double base = chain_rows.front().second;
    std::printf("the model's layer chained (batch 1), and variants (us a layer, - the model's):\n");
    for (const auto& [name, us] : chain_rows) {
      std::printf("  chain %-40s %8.2f us  %+7.2f\n", name.c_str(), us, us - base);
    }
  }
  const double chain_step_us = chain_us * kSteps + lm_us;
  std::printf(
      "layer chained %.2f us x %d + lm_head = %.1f us per step (%.0f tok/s per sequence) = %.2f "
      "of the copy bandwidth's roofline\n",
      chain_us, kSteps, chain_step_us, 1e6 / chain_step_us, step_bytes / chain_step_us / 1e3 / bw);
  return 0;
}

}  // namespace
}  // namespace tessera::cuda

int main(int argc, char** argv) { return tessera::cuda::run(argc, argv); }
