// The CUDA backend against the fp32 CPU backend (its oracle) on the tiny checkpoints of every
// architecture, plus the properties the runtime promises on the GPU: CUDA graphs give the same
// bits as eager mode, chunked prefill matches a one-chunk prefill, a seeded request samples the
// same tokens in any batch, split-K decode over long contexts matches the CPU, and a model that
// does not fit is refused with the figures. Run by scripts/gpu-check on the GPU machine.
//
// Tolerance vs the CPU backend: the GPU computes in bf16 (every activation rounded to bf16, as
// transformers does in bf16) while the CPU keeps fp32, so logits differ by the bf16 rounding of
// activations propagated through 4 layers: about 2^-8 relative per op. The bound used is
// 0.05 x max|logit| + 2e-3 (measured values are printed and go in the issue note).
#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <numeric>

#include "actors/model/model_runner.h"
#include "driver/make_model/make_model.h"
#include "tests/model/launch_ahead.h"

namespace tessera {
namespace {

std::string source_dir() {
  const char* env = std::getenv("TESSERA_SOURCE_DIR");
  return env != nullptr ? env : TESSERA_SOURCE_DIR;
}

void require_gpu() {
  int n = 0;
  ASSERT_TRUE(cudaGetDeviceCount(&n) == cudaSuccess && n > 0)
      << "no CUDA device: these tests run on the GPU machine (scripts/gpu-check)";
}

std::string tokenizer_for(const std::string& arch) {
  return arch == "qwen2" || arch == "qwen3" ? "qwen3" : arch == "mistral" ? "llama2" : "llama3";
}

// Makes the tiny checkpoint of `arch` once per process.
std::string tiny_model(const std::string& arch) {
  static std::map<std::string, std::string> made;
  if (made.count(arch)) return made[arch];
  std::string dir = std::filesystem::temp_directory_path() /
                    ("tessera-gpu-" + arch + "-" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  MakeModelOptions o;
  o.arch = arch;
  o.preset = "tiny";
  o.tokenizer_dir = source_dir() + "/tests/assets/tokenizers/" + tokenizer_for(arch);
  o.seed = 1234;
  o.dtype = "bf16";
  o.out = dir;
  Status st = make_model(o);
  EXPECT_TRUE(st.is_ok()) << st.to_string();
  made[arch] = dir;
  return dir;
}

// One rank's spec, resolved as the driver resolves it for `device` ("cpu" or "cuda").
LoadSpec spec_for(const std::string& dir, const std::string& device) {
  EngineSpec e;
  e.model = dir;
  e.max_model_len = 2048;
  e.return_logits = true;
  e.gpu_memory_utilization = 0.15;
  e.max_num_seqs = 16;
  auto s = load_spec_for_rank(e, ParallelConfig{}, device == "cpu" ? Device::kCpu : Device::kCuda);
  EXPECT_TRUE(s) << s.status().to_string();
  return s ? *s : LoadSpec{};
}

// Loads one rank (no parallelism) and allocates every KV block that fits.
std::unique_ptr<ModelRunner> load(const LoadSpec& spec) {
  auto r = ModelRunner::load(spec, {});
  EXPECT_TRUE(r) << r.status().to_string();
  if (!r) return nullptr;
  Status st = (*r)->init_cache((*r)->info().kv_blocks);
  EXPECT_TRUE(st.is_ok()) << st.to_string();
  return st.is_ok() ? std::move(*r) : nullptr;
}

// One sequence of a step, as the driver sends it: the whole block table with the first step.
SeqStep seq(uint64_t request, std::vector<int32_t> tokens, int64_t start, bool first,
            int64_t prompt_len, const std::vector<uint32_t>& blocks, const SamplingParams& p,
            bool sample = true) {
  SeqStep s;
  s.request_id = request;
  s.tokens = std::move(tokens);
  s.start_position = start;
  if (first) s.new_blocks = blocks;
  s.sample = sample;
  s.first = first;
  s.prompt_len = prompt_len;
  s.sampling = p;
  return s;
}

Expected<StepOutput> run(ModelRunner& r, std::vector<SeqStep> seqs, std::vector<float>* logits,
                         std::vector<uint64_t> finished = {}) {
  StepInput in;
  in.seqs = std::move(seqs);
  in.finished = std::move(finished);
  auto out = r.execute(in);
  if (out && logits != nullptr)
    logits->insert(logits->end(), out->logits.begin(), out->logits.end());
  return out;
}

std::vector<int32_t> prompt_ids(int64_t n, int32_t salt) {
  std::vector<int32_t> ids(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i)
    ids[i] = static_cast<int32_t>(100 + (i * 7919 + salt * 104729) % 20000);
  return ids;
}

std::vector<uint32_t> blocks_for(int seq, int64_t tokens, int64_t stride = 128) {
  std::vector<uint32_t> t;
  for (int64_t b = 0; b * 16 < tokens; ++b) t.push_back(static_cast<uint32_t>(seq * stride + b));
  return t;
}

SamplingParams greedy() {
  SamplingParams p;
  p.temperature = 0.0f;
  return p;
}

// Greedy generation of several prompts as one batch (prefill in one step, then batched decode),
// the tokens the runner sampled fed back. Returns per prompt the generated ids; appends every
// step's logits to *logits.
std::vector<std::vector<int32_t>> generate(ModelRunner& r,
                                           const std::vector<std::vector<int32_t>>& prompts,
                                           int steps, std::vector<float>* logits,
                                           const std::vector<SamplingParams>& params = {}) {
  std::vector<std::vector<int32_t>> out(prompts.size());
  std::vector<SeqStep> seqs;
  for (size_t i = 0; i < prompts.size(); ++i) {
    const int64_t n = static_cast<int64_t>(prompts[i].size());
    seqs.push_back(seq(1000 + i, prompts[i], 0, true, n, blocks_for(static_cast<int>(i), n + steps),
                       params.empty() ? greedy() : params[i]));
  }
  for (int step = 0; step < steps; ++step) {
    auto res = run(r, seqs, logits);
    EXPECT_TRUE(res) << res.status().to_string();
    if (!res) return out;
    for (size_t i = 0; i < seqs.size(); ++i) {
      const int32_t tok = res->outputs[i].sample.token;
      out[i].push_back(tok);
      seqs[i].start_position += static_cast<int64_t>(seqs[i].tokens.size());
      seqs[i].tokens = {tok};
      seqs[i].first = false;
      seqs[i].new_blocks.clear();
    }
  }
  std::vector<uint64_t> done;
  for (const auto& s : seqs) done.push_back(s.request_id);
  (void)run(r, {}, nullptr, done);
  return out;
}

// Runs a prompt through both backends with the CPU's tokens fed to both (teacher forcing), so
// every step's logits are comparable. Returns {max |diff|, max |cpu logit|, argmax agreements,
// steps}.
struct Compare {
  double max_diff = 0, max_ref = 0;
  int agree = 0, steps = 0;
};

Compare teacher_forced(ModelRunner& cpu, ModelRunner& gpu, const std::vector<int32_t>& prompt,
                       int steps) {
  Compare c;
  const int64_t vocab = cpu.config().vocab_size;
  const int64_t n = static_cast<int64_t>(prompt.size());
  SeqStep s = seq(7, prompt, 0, true, n, blocks_for(0, n + steps), greedy());
  for (int step = 0; step < steps; ++step) {
    std::vector<float> lc, lg;
    auto rc = run(cpu, {s}, &lc);
    auto rg = run(gpu, {s}, &lg);
    EXPECT_TRUE(rc && rg);
    if (!rc || !rg) return c;
    EXPECT_EQ(lc.size(), static_cast<size_t>(vocab));
    EXPECT_EQ(lg.size(), static_cast<size_t>(vocab));
    for (int64_t v = 0; v < vocab; ++v) {
      c.max_diff = std::max(c.max_diff, static_cast<double>(std::fabs(lc[v] - lg[v])));
      c.max_ref = std::max(c.max_ref, static_cast<double>(std::fabs(lc[v])));
    }
    c.agree += rc->outputs[0].sample.token == rg->outputs[0].sample.token;
    ++c.steps;
    s.start_position += static_cast<int64_t>(s.tokens.size());
    s.tokens = {rc->outputs[0].sample.token};
    s.first = false;
    s.new_blocks.clear();
  }
  (void)run(cpu, {}, nullptr, {7});
  (void)run(gpu, {}, nullptr, {7});
  return c;
}

class CudaParityTest : public ::testing::TestWithParam<std::string> {};

TEST_P(CudaParityTest, LogitsTrackTheFp32CpuBackend) {
  require_gpu();
  const std::string dir = tiny_model(GetParam());
  auto cpu = load(spec_for(dir, "cpu"));
  auto gpu = load(spec_for(dir, "cuda"));
  ASSERT_TRUE(cpu && gpu);
  EXPECT_EQ(gpu->info().backend, "cuda");
  EXPECT_EQ(gpu->info().dtype, "BF16");
  EXPECT_GT(gpu->info().kv_blocks, 2048 / 16);
  Compare c = teacher_forced(*cpu, *gpu, prompt_ids(37, 1), 24);
  std::printf(
      "[parity] %s: max |logit diff| GPU bf16 vs CPU fp32 = %.3e (max |logit| %.3f, "
      "relative %.2e), greedy agreement %d/%d\n",
      GetParam().c_str(), c.max_diff, c.max_ref, c.max_diff / c.max_ref, c.agree, c.steps);
  EXPECT_LE(c.max_diff, 0.05 * c.max_ref + 2e-3);
  EXPECT_GE(c.agree, c.steps - 2);
}

TEST_P(CudaParityTest, LongContextSplitKDecodeTracksTheCpu) {
  require_gpu();
  const std::string dir = tiny_model(GetParam());
  auto cpu = load(spec_for(dir, "cpu"));
  auto gpu = load(spec_for(dir, "cuda"));
  ASSERT_TRUE(cpu && gpu);
  Compare c = teacher_forced(*cpu, *gpu, prompt_ids(1500, 2), 6);
  std::printf("[parity] %s, 1500-token context: max |logit diff| = %.3e (max |logit| %.3f)\n",
              GetParam().c_str(), c.max_diff, c.max_ref);
  EXPECT_LE(c.max_diff, 0.05 * c.max_ref + 2e-3);
}

// --kv-cache-dtype fp8: both backends round K/V to E4M3 the same way and the cache holds twice
// the blocks in the same budget. The GPU rounds bf16 K/V, the CPU fp32 ones, so ~1 value in 30
// lands on the neighbouring E4M3 code (1/8 apart): the bound is twice the bf16-vs-fp32 one,
// which a wrong layout or conversion (errors of the logits' own size) still fails by far. The
// drift fp8 adds over a 16-bit cache is printed (no bound: it is the format's, not ours).
TEST_P(CudaParityTest, Fp8KvCacheTracksTheCpuBackendsFp8Cache) {
  require_gpu();
  const std::string dir = tiny_model(GetParam());
  LoadSpec cpu_spec = spec_for(dir, "cpu"), gpu_spec = spec_for(dir, "cuda");
  cpu_spec.engine.kv_cache_dtype = gpu_spec.engine.kv_cache_dtype = KvCacheDtype::kFp8E4M3;
  auto cpu = load(cpu_spec);
  auto gpu = load(gpu_spec);
  auto gpu_bf16 = load(spec_for(dir, "cuda"));
  ASSERT_TRUE(cpu && gpu && gpu_bf16);
  EXPECT_EQ(gpu->info().kv_cache_dtype, "F8_E4M3");
  EXPECT_EQ(cpu->info().kv_cache_dtype, "F8_E4M3");
  EXPECT_EQ(gpu_bf16->info().kv_cache_dtype, "BF16");
  const double ratio =
      static_cast<double>(gpu->info().kv_blocks) / static_cast<double>(gpu_bf16->info().kv_blocks);
  EXPECT_NEAR(ratio, 2.0, 0.05) << gpu->info().kv_blocks << " vs " << gpu_bf16->info().kv_blocks;
  for (int64_t len : {37, 1500}) {
    const Compare c = teacher_forced(*cpu, *gpu, prompt_ids(len, 3), len > 100 ? 6 : 24);
    const Compare drift = teacher_forced(*cpu, *gpu_bf16, prompt_ids(len, 3), len > 100 ? 6 : 24);
    std::printf(
        "[parity] %s, %lld tokens, fp8 KV cache: GPU vs CPU (both fp8) max |logit diff| %.3e "
        "(max |logit| %.3f), greedy %d/%d; GPU bf16 cache vs CPU fp8 cache %.3e\n",
        GetParam().c_str(), static_cast<long long>(len), c.max_diff, c.max_ref, c.agree, c.steps,
        drift.max_diff);
    EXPECT_LE(c.max_diff, 0.1 * c.max_ref + 2e-3);
    EXPECT_GE(c.agree, c.steps * 2 / 3);
  }
}

INSTANTIATE_TEST_SUITE_P(Architectures, CudaParityTest,
                         ::testing::Values("llama", "mistral", "qwen2", "qwen3"));

// Shapes no preset has, each with a tiny checkpoint of its own: head sizes the tile attention
// kernel has no instance for (80, 24, 48, 6, 320), GQA ratios 2, 3, 5 and none, and vocabulary
// sizes that are odd or just past the tokenizer's. The CUDA backend must load every model the
// CPU backend loads and track it (eager and with graphs), short and long contexts.
struct OddShape {
  const char* name;
  const char* arch;
  int64_t hidden, heads, kv_heads, head_dim, intermediate, extra_vocab;
};

class CudaOddShapeTest : public ::testing::TestWithParam<OddShape> {};

TEST_P(CudaOddShapeTest, TracksTheFp32CpuBackend) {
  require_gpu();
  const OddShape& sh = GetParam();
  std::string dir = std::filesystem::temp_directory_path() /
                    (std::string("tessera-gpu-odd-") + sh.name + "-" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  MakeModelOptions o;
  o.arch = sh.arch;
  o.preset = "tiny";
  o.tokenizer_dir = source_dir() + "/tests/assets/tokenizers/" + tokenizer_for(sh.arch);
  o.seed = 77;
  o.dtype = "bf16";
  o.out = dir;
  o.overrides.hidden_size = sh.hidden;
  o.overrides.num_heads = sh.heads;
  o.overrides.num_kv_heads = sh.kv_heads;
  o.overrides.head_dim = sh.head_dim;
  o.overrides.intermediate_size = sh.intermediate;
  o.overrides.num_layers = 2;
  if (sh.extra_vocab > 0) {
    // The tokenizer's size plus a few padding rows (as real checkpoints pad their vocabulary).
    auto cfg = make_model_config_json(o);
    ASSERT_TRUE(cfg) << cfg.status().to_string();
    o.overrides.vocab_size =
        nlohmann::json::parse(*cfg)["vocab_size"].get<int64_t>() + sh.extra_vocab;
  }
  Status st = make_model(o);
  ASSERT_TRUE(st.is_ok()) << st.to_string();
  auto cpu = load(spec_for(dir, "cpu"));
  ASSERT_TRUE(cpu);
  for (bool eager : {true, false}) {
    LoadSpec gs = spec_for(dir, "cuda");
    gs.engine.enforce_eager = eager;
    auto gpu = load(gs);
    ASSERT_TRUE(gpu) << sh.name;
    for (int64_t len : {int64_t{37}, int64_t{700}}) {
      Compare c = teacher_forced(*cpu, *gpu, prompt_ids(len, 3), 8);
      std::printf(
          "[odd shape] %s (%s, head_dim %ld, heads %ld/%ld, vocab %ld), %s, %ld-token "
          "prompt: max |logit diff| %.3e (max |logit| %.3f), greedy agreement %d/%d\n",
          sh.name, sh.arch, static_cast<long>(cpu->config().head_dim), static_cast<long>(sh.heads),
          static_cast<long>(sh.kv_heads), static_cast<long>(cpu->config().vocab_size),
          eager ? "eager" : "graphs", static_cast<long>(len), c.max_diff, c.max_ref, c.agree,
          c.steps);
      EXPECT_EQ(c.steps, 8) << sh.name;
      EXPECT_LE(c.max_diff, 0.05 * c.max_ref + 2e-3) << sh.name << " prompt " << len;
      EXPECT_GE(c.agree, c.steps - 2) << sh.name << " prompt " << len;
    }
  }
  std::filesystem::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, CudaOddShapeTest,
    ::testing::Values(OddShape{"hd80_gqa2_vocab_plus3", "llama", 160, 2, 1, 80, 200, 3},
                      OddShape{"hd24_gqa3", "qwen3", 72, 6, 2, 24, 136, 0},
                      OddShape{"hd48_gqa5_vocab_plus1", "mistral", 96, 5, 1, 48, 160, 1},
                      OddShape{"hd6_no_gqa", "qwen2", 42, 7, 7, 0, 90, 0},
                      OddShape{"hd320_mqa", "qwen3", 64, 2, 1, 320, 96, 5}),
    [](const ::testing::TestParamInfo<OddShape>& info) { return std::string(info.param.name); });

TEST(CudaModelTest, GraphsGiveTheSameBitsAsEagerMode) {
  require_gpu();
  const std::string dir = tiny_model("llama");
  std::vector<std::vector<int32_t>> prompts = {prompt_ids(5, 3), prompt_ids(40, 4),
                                               prompt_ids(17, 5)};
  std::vector<float> eager_logits, graph_logits;
  std::vector<std::vector<int32_t>> eager_tokens, graph_tokens;
  {
    LoadSpec s = spec_for(dir, "cuda");
    s.engine.enforce_eager = true;
    auto r = load(s);
    ASSERT_TRUE(r);
    eager_tokens = generate(*r, prompts, 24, &eager_logits);
  }
  {
    auto r = load(spec_for(dir, "cuda"));
    ASSERT_TRUE(r);
    graph_tokens = generate(*r, prompts, 24, &graph_logits);
  }
  EXPECT_EQ(eager_tokens, graph_tokens);
  ASSERT_EQ(eager_logits.size(), graph_logits.size());
  size_t differing = 0;
  for (size_t i = 0; i < eager_logits.size(); ++i) differing += eager_logits[i] != graph_logits[i];
  EXPECT_EQ(differing, 0u) << "logits differ between CUDA graphs and eager mode";
}

TEST(CudaModelTest, ChunkedPrefillMatchesOneChunk) {
  require_gpu();
  auto r = load(spec_for(tiny_model("qwen3"), "cuda"));
  ASSERT_TRUE(r);
  const std::vector<int32_t> prompt = prompt_ids(100, 6);
  std::vector<float> whole, chunked;
  ASSERT_TRUE(run(*r, {seq(1, prompt, 0, true, 100, blocks_for(0, 100), greedy())}, &whole));
  ASSERT_TRUE(run(*r, {}, nullptr, {1}));
  for (int64_t start : {0, 37, 64}) {
    const int64_t end = start == 64 ? 100 : start == 37 ? 64 : 37;
    ASSERT_TRUE(run(*r,
                    {seq(2, {prompt.begin() + start, prompt.begin() + end}, start, start == 0, 100,
                         blocks_for(1, 100), greedy(), end == 100)},
                    &chunked));
  }
  ASSERT_EQ(whole.size(), chunked.size());
  double max_diff = 0, max_ref = 0;
  for (size_t i = 0; i < whole.size(); ++i) {
    max_diff = std::max(max_diff, static_cast<double>(std::fabs(whole[i] - chunked[i])));
    max_ref = std::max(max_ref, static_cast<double>(std::fabs(whole[i])));
  }
  std::printf("[chunked] max |logit diff| one chunk vs three = %.3e\n", max_diff);
  EXPECT_LE(max_diff, 0.02 * max_ref + 1e-3);
}

TEST(CudaModelTest, SeededSamplingDoesNotDependOnTheBatch) {
  require_gpu();
  auto r = load(spec_for(tiny_model("mistral"), "cuda"));
  ASSERT_TRUE(r);
  SamplingParams p;
  p.temperature = 0.8f;
  p.top_p = 0.9f;
  p.top_k = 50;
  p.seed = 42;
  SamplingParams other = p;
  other.seed = 7;
  auto alone = generate(*r, {prompt_ids(12, 7)}, 16, nullptr, {p});
  auto batched = generate(*r, {prompt_ids(30, 8), prompt_ids(12, 7)}, 16, nullptr, {other, p});
  EXPECT_EQ(alone[0], batched[1]);
  auto again = generate(*r, {prompt_ids(12, 7)}, 16, nullptr, {p});
  EXPECT_EQ(alone[0], again[0]);
}

// Async scheduling on the GPU: each decode step launched while the one before runs, its tokens
// filled in on the device from that step's samples, gives the tokens of one step at a time —
// greedy, and seeded sampling (whose draw counts the request's tokens, placeholder included) —
// through the decode graphs and in eager mode.
TEST(CudaModelTest, LaunchingAheadGivesTheTokensOfOneStepAtATime) {
  require_gpu();
  for (bool eager : {false, true}) {
    LoadSpec spec = spec_for(tiny_model("llama"), "cuda");
    spec.engine.return_logits = false;  // logits keep steps one at a time
    spec.engine.enforce_eager = eager;
    auto r = load(spec);
    ASSERT_TRUE(r);
    SamplingParams s = greedy();
    s.temperature = 0.9f;
    s.top_p = 0.95f;
    s.seed = 11;
    SamplingParams t = s;
    t.seed = 12;
    const std::vector<std::vector<int32_t>> prompts = {prompt_ids(9, 1), prompt_ids(33, 2),
                                                       prompt_ids(17, 3)};
    for (const auto& params : {std::vector<SamplingParams>{greedy(), greedy(), greedy()},
                               std::vector<SamplingParams>{s, greedy(), t}}) {
      auto one = testing::generate_steps(*r, prompts, 24, params, false);
      auto ahead = testing::generate_steps(*r, prompts, 24, params, true);
      ASSERT_EQ(one.size(), 3u);
      EXPECT_EQ(one[0].size(), 24u);
      EXPECT_EQ(one, ahead) << (eager ? "eager" : "graphs");
    }
  }
}

TEST(CudaModelTest, RefusesAModelThatDoesNotFitWithTheFigures) {
  require_gpu();
  LoadSpec s = spec_for(tiny_model("llama"), "cuda");
  s.engine.gpu_memory_utilization = 0.0005;  // ~70 MiB of an H200
  auto r = ModelRunner::load(s, {});
  ASSERT_FALSE(r);
  std::printf("[memory] %s\n", r.status().to_string().c_str());
  EXPECT_NE(r.status().message().find("--gpu-memory-utilization"), std::string::npos);
  s.engine.gpu_memory_utilization = 1.5;
  r = ModelRunner::load(s, {});
  ASSERT_FALSE(r);
  EXPECT_EQ(r.status().code(), Code::kInvalidArgument);
  // float32 on the GPU is refused where the spec is resolved, before any actor.
  EngineSpec f32;
  f32.model = tiny_model("llama");
  f32.dtype = "float32";
  auto refused = load_spec_for_rank(f32, ParallelConfig{}, Device::kCuda);
  ASSERT_FALSE(refused);
  EXPECT_NE(refused.status().message().find("cpu backend only"), std::string::npos);
}

}  // namespace
}  // namespace tessera
