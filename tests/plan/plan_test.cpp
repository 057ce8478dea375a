// Tensor x pipeline plans on real model shapes, memory sizing, placement on synthetic clusters,
// -tp/-pp auto, the printed plan and topology, and the -tp/-pp spellings.
#include <gtest/gtest.h>

#include <CLI/CLI.hpp>
#include <map>
#include <set>

#include "driver/plan/parallel_plan.h"
#include "driver/plan/placement.h"
#include "driver/plan/plan_command.h"

namespace tessera {
namespace {

constexpr uint64_t kGiB = 1ull << 30;

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

ModelConfig llama3_8b() {
  ModelConfig c;
  c.arch = Architecture::kLlama;
  c.model_type = "llama";
  c.vocab_size = 128256;
  c.hidden_size = 4096;
  c.intermediate_size = 14336;
  c.num_layers = 32;
  c.num_heads = 32;
  c.num_kv_heads = 8;
  c.head_dim = 128;
  c.max_position_embeddings = 8192;
  return c;
}

ModelConfig qwen3_8b() {
  ModelConfig c;
  c.arch = Architecture::kQwen3;
  c.model_type = "qwen3";
  c.vocab_size = 151936;
  c.hidden_size = 4096;
  c.intermediate_size = 12288;
  c.num_layers = 36;
  c.num_heads = 32;
  c.num_kv_heads = 8;
  c.head_dim = 128;
  c.qk_norm = true;
  c.max_position_embeddings = 40960;
  return c;
}

ModelConfig llama3_70b() {
  ModelConfig c = llama3_8b();
  c.hidden_size = 8192;
  c.intermediate_size = 28672;
  c.num_layers = 80;
  c.num_heads = 64;
  return c;
}

// A small GQA model with 2 KV heads.
ModelConfig two_kv_heads() {
  ModelConfig c = llama3_8b();
  c.hidden_size = 1024;
  c.intermediate_size = 4096;
  c.num_layers = 4;
  c.num_heads = 8;
  c.num_kv_heads = 2;
  c.vocab_size = 1000;
  return c;
}

ParallelConfig shape(int tp, int pp, std::vector<int64_t> partition = {}) {
  ParallelConfig p;
  p.tp_size = tp;
  p.pp_size = pp;
  p.layer_partition = std::move(partition);
  return p;
}

ParallelPlan must_plan(const ModelConfig& c, int tp, int pp, DType dtype = DType::kBF16) {
  auto plan = make_parallel_plan(c, shape(tp, pp), dtype);
  EXPECT_TRUE(plan) << plan.status().message();
  return plan ? *plan : ParallelPlan{};
}

// ---- validation -----------------------------------------------------------------------------

TEST(ParallelPlanTest, HeadsMustDivideAndTheErrorListsValidSizes) {
  auto plan = make_parallel_plan(llama3_8b(), shape(3, 1), DType::kBF16);
  ASSERT_FALSE(plan);
  EXPECT_EQ(plan.status().code(), Code::kInvalidArgument);
  const std::string m = plan.status().message();
  EXPECT_TRUE(contains(m, "-tp 3: the model's 32 attention heads do not split over 3 ranks")) << m;
  EXPECT_TRUE(contains(m, "valid -tp values for this model: 1, 2, 4, 8, 16, 32")) << m;
}

TEST(ParallelPlanTest, KvHeadsThatNeitherSplitNorReplicateAreRefused) {
  ModelConfig c = llama3_8b();
  c.num_heads = 48;
  c.num_kv_heads = 12;
  c.intermediate_size = 12288;
  Status st = check_tensor_parallel(c, 8);  // 48 % 8 == 0, but 12 % 8 != 0 and 8 < 12
  ASSERT_FALSE(st);
  EXPECT_TRUE(contains(st.message(), "12 KV heads neither split over 8 ranks")) << st.message();
  EXPECT_TRUE(contains(st.message(), "valid -tp values for this model: 1, 2, 3, 4, 6, 12, 24, 48"))
      << st.message();
  st = check_tensor_parallel(c, 16);  // 48 % 16 == 0, 16 > 12 but 16 % 12 != 0
  ASSERT_FALSE(st);
  EXPECT_TRUE(contains(st.message(), "16 is not a multiple of 12")) << st.message();
}

TEST(ParallelPlanTest, IntermediateSizeMustDivide) {
  ModelConfig c = llama3_8b();
  c.intermediate_size = 11000;
  Status st = check_tensor_parallel(c, 16);
  ASSERT_FALSE(st);
  EXPECT_TRUE(contains(st.message(),
                       "intermediate_size 11000 does not split over 16 ranks "
                       "(11000 % 16 = 8)"))
      << st.message();
  EXPECT_EQ(valid_tensor_parallel_sizes(c, 64), (std::vector<int64_t>{1, 2, 4, 8}));
}

TEST(ParallelPlanTest, KvHeadsSplitWhenTheyDivide) {
  ParallelPlan p = must_plan(llama3_8b(), 4, 1);
  EXPECT_EQ(p.kv_replicas, 1);
  for (const RankPlan& r : p.ranks) {
    EXPECT_EQ(r.shard.heads, 8);
    EXPECT_EQ(r.shard.head_begin, 8 * r.shard.parallel.tp_rank);
    EXPECT_EQ(r.shard.kv_heads, 2);
    EXPECT_EQ(r.shard.kv_head_begin, 2 * r.shard.parallel.tp_rank);
  }
  EXPECT_EQ(describe_kv_heads(llama3_8b(), p), "KV heads: 8 split over -tp 4, 2 per rank");
}

TEST(ParallelPlanTest, TwoKvHeadsOverFourRanksAreEachOnTwoRanks) {
  ModelConfig c = two_kv_heads();
  ParallelPlan p = must_plan(c, 4, 1);
  EXPECT_EQ(p.kv_replicas, 2);
  std::vector<int64_t> kv_head;
  for (const RankPlan& r : p.ranks) {
    EXPECT_EQ(r.shard.kv_heads, 1);
    EXPECT_EQ(r.shard.heads, 2);
    kv_head.push_back(r.shard.kv_head_begin);
  }
  EXPECT_EQ(kv_head, (std::vector<int64_t>{0, 0, 1, 1}));
  EXPECT_EQ(describe_kv_heads(c, p),
            "KV heads: 2 replicated over -tp 4, each on 2 ranks: KV head 0 on TP ranks 0-1, KV "
            "head 1 on TP ranks 2-3");
  // Each rank's KV cache holds its one head: 2 (K, V) x 4 layers x 1 head x 128 x 2 bytes.
  EXPECT_EQ(p.ranks[0].kv_elems_per_token, 2 * 4 * 1 * 128);
}

TEST(ParallelPlanTest, EightKvHeadsOverSixteenRanksReplicateAsVllmDoes) {
  // T = 16 > 8 KV heads and 16 % 8 == 0: each rank keeps one KV head, two ranks share it.
  ParallelPlan p = must_plan(llama3_8b(), 16, 1);
  EXPECT_EQ(p.kv_replicas, 2);
  for (const RankPlan& r : p.ranks) {
    EXPECT_EQ(r.shard.kv_heads, 1);
    EXPECT_EQ(r.shard.kv_head_begin, r.shard.parallel.tp_rank / 2);
    // The query heads it computes read that KV head (GQA group of 4 query heads).
    EXPECT_EQ(r.shard.head_begin / 4, r.shard.kv_head_begin);
  }
}

// ---- layers over stages -----------------------------------------------------------------------

std::vector<int64_t> stage_layers_of(const ModelConfig& c, int tp, int pp,
                                     std::vector<int64_t> partition = {}) {
  auto plan = make_parallel_plan(c, shape(tp, pp, std::move(partition)), DType::kBF16);
  EXPECT_TRUE(plan) << plan.status().message();
  if (!plan) return {};
  // Ranges are contiguous and cover the model.
  int64_t next = 0;
  for (int64_t s = 0; s < plan->pp; ++s) {
    for (int64_t t = 0; t < plan->tp; ++t) {
      EXPECT_EQ(plan->at(s, t).shard.layer_begin, next);
      EXPECT_EQ(plan->at(s, t).shard.num_layers(), plan->stage_layers[static_cast<size_t>(s)]);
    }
    next += plan->stage_layers[static_cast<size_t>(s)];
  }
  EXPECT_EQ(next, c.num_layers);
  return plan->stage_layers;
}

TEST(ParallelPlanTest, LayersSplitEvenlyWithTheRemainderOnTheFirstStages) {
  const ModelConfig c = llama3_8b();
  EXPECT_EQ(stage_layers_of(c, 1, 1), (std::vector<int64_t>{32}));
  EXPECT_EQ(stage_layers_of(c, 2, 2), (std::vector<int64_t>{16, 16}));
  EXPECT_EQ(stage_layers_of(c, 1, 3), (std::vector<int64_t>{11, 11, 10}));
  EXPECT_EQ(stage_layers_of(c, 1, 5), (std::vector<int64_t>{7, 7, 6, 6, 6}));
  EXPECT_EQ(stage_layers_of(qwen3_8b(), 2, 5), (std::vector<int64_t>{8, 7, 7, 7, 7}));
}

TEST(ParallelPlanTest, ExplicitLayerPartition) {
  ModelConfig c = llama3_8b();
  EXPECT_EQ(stage_layers_of(c, 2, 3, {10, 12, 10}), (std::vector<int64_t>{10, 12, 10}));
  // The stage with more layers has more weights and more KV per token.
  ParallelPlan p = *make_parallel_plan(c, shape(1, 3, {10, 12, 10}), DType::kBF16);
  EXPECT_GT(p.ranks[1].kv_elems_per_token, p.ranks[2].kv_elems_per_token);
  EXPECT_EQ(p.ranks[1].kv_elems_per_token, 2 * 12 * 8 * 128);
}

TEST(ParallelPlanTest, BadLayerPartitionsAreRefused) {
  ModelConfig c = llama3_8b();
  auto sum = make_parallel_plan(c, shape(1, 3, {10, 12, 11}), DType::kBF16);
  ASSERT_FALSE(sum);
  EXPECT_TRUE(contains(sum.status().message(), "33")) << sum.status().message();
  EXPECT_TRUE(contains(sum.status().message(), "32")) << sum.status().message();
  auto zero = make_parallel_plan(c, shape(1, 3, {16, 16, 0}), DType::kBF16);
  ASSERT_FALSE(zero);
  EXPECT_TRUE(contains(zero.status().message(), "at least one")) << zero.status().message();
  auto count = make_parallel_plan(c, shape(1, 4, {16, 16}), DType::kBF16);
  ASSERT_FALSE(count);
  EXPECT_TRUE(contains(count.status().message(), "--pipeline-layer-partition"))
      << count.status().message();
  auto too_many = make_parallel_plan(c, shape(1, 33), DType::kBF16);
  ASSERT_FALSE(too_many);
  EXPECT_TRUE(contains(too_many.status().message(), "32 layers")) << too_many.status().message();
}

// ---- vocabulary -------------------------------------------------------------------------------

TEST(ParallelPlanTest, VocabIsPaddedToAMultipleOfTp) {
  ModelConfig c = llama3_8b();
  c.vocab_size = 32003;
  ParallelPlan p = must_plan(c, 4, 1);
  EXPECT_EQ(p.padded_vocab, 32004);
  std::vector<std::pair<int64_t, int64_t>> ranges;
  for (const RankPlan& r : p.ranks) {
    ranges.push_back({r.shard.vocab_begin, r.shard.vocab_begin + r.shard.vocab_shard});
  }
  EXPECT_EQ(ranges, (std::vector<std::pair<int64_t, int64_t>>{
                        {0, 8001}, {8001, 16002}, {16002, 24003}, {24003, 32004}}));
  // Only the last rank holds padding: one row in the embedding and one in lm_head.
  EXPECT_EQ(p.ranks[3].padding_bytes, 2u * 4096 * 2);
  EXPECT_EQ(p.ranks[0].padding_bytes, 0u);
  EXPECT_EQ(must_plan(llama3_8b(), 8, 1).padded_vocab, 128256);  // 128256 = 8 x 16032
}

// ---- weight bytes -----------------------------------------------------------------------------

// Parameters of a Llama/Qwen-shaped config, by formula (independent of expected_weights).
uint64_t params(const ModelConfig& c) {
  const uint64_t h = c.hidden_size, hd = c.head_dim, i = c.intermediate_size;
  const uint64_t q = c.num_heads * hd, kv = c.num_kv_heads * hd;
  uint64_t layer = q * h + 2 * kv * h + h * q + 3 * h * i + 2 * h;
  if (c.qk_norm) layer += 2 * hd;
  if (c.attention_bias) layer += q + 2 * kv;
  if (c.o_proj_bias) layer += h;
  return static_cast<uint64_t>(c.vocab_size) * h * (c.tie_word_embeddings ? 1 : 2) +
         c.num_layers * layer + h;
}

// Qwen3-30B-A3B: 128 experts of width 768 in each of 48 layers, top 8.
ModelConfig qwen3_30b_a3b() {
  ModelConfig c = qwen3_8b();
  c.arch = Architecture::kQwen3Moe;
  c.model_type = "qwen3_moe";
  c.hidden_size = 2048;
  c.intermediate_size = 6144;
  c.num_layers = 48;
  c.num_kv_heads = 4;
  c.moe.num_experts = 128;
  c.moe.top_k = 8;
  c.moe.expert_intermediate = 768;
  c.moe.norm_topk_prob = true;
  return c;
}

// The planner counts every expert's bytes (all are held, whichever tokens choose): the whole
// model is 30.5B parameters, and each of -tp 4's ranks a quarter of the experts' widths.
TEST(ParallelPlanTest, MixtureOfExpertsWeightsCountEveryExpert) {
  const ModelConfig c = qwen3_30b_a3b();
  const uint64_t expert = 3ull * 768 * 2048 * 2;  // one expert's bf16 bytes
  const uint64_t all = model_weight_bytes(c, DType::kBF16);
  EXPECT_GT(all, 48 * 128 * expert);
  EXPECT_NEAR(static_cast<double>(all) / 2, 30.53e9, 0.02e9);
  ParallelPlan p = must_plan(c, 4, 1);
  for (const RankPlan& r : p.ranks) {
    EXPECT_EQ(r.shard.moe_intermediate, 192);
    EXPECT_GT(r.weight_bytes, 48 * 128 * expert / 4);
    EXPECT_LT(r.weight_bytes, all / 4 + all / 40);
  }
}

TEST(ParallelPlanTest, WholeModelBytesMatchThePublishedParameterCounts) {
  EXPECT_EQ(params(llama3_8b()), 8030261248u);
  EXPECT_EQ(params(qwen3_8b()), 8190735360u);
  EXPECT_EQ(params(llama3_70b()), 70553706496u);
  EXPECT_EQ(model_weight_bytes(llama3_8b(), DType::kBF16), 2 * 8030261248u);
  EXPECT_EQ(model_weight_bytes(qwen3_8b(), DType::kBF16), 2 * 8190735360u);
  EXPECT_EQ(model_weight_bytes(llama3_70b(), DType::kF32), 4 * 70553706496u);
}

// Quantized weights count as stored: AWQ int4 with group 128 holds per linear parameter half a
// byte of weight, 1/256 of zeros (4 bits per 128 inputs) and 1/64 of scales (fp16 per 128
// inputs); embedding, lm_head and norms stay bf16. Online FP8: a byte per linear parameter
// and an F32 scale per layer.
TEST(ParallelPlanTest, QuantizedWeightsCountAsStored) {
  ModelConfig awq = llama3_8b();
  awq.quant.method = QuantMethod::kAwq;
  awq.quant.bits = 4;
  awq.quant.group_size = 128;
  const uint64_t linear = 4096ull * (4096 + 1024 + 1024 + 4096) + 3ull * 4096 * 14336;
  const uint64_t plain = 2ull * 128256 * 4096 * 2 + 32ull * 2 * 4096 * 2 + 4096 * 2;
  EXPECT_EQ(model_weight_bytes(awq, DType::kBF16), 32 * (linear * 133 / 256) + plain);
  QuantConfig online;
  online.method = QuantMethod::kFp8;
  online.bits = 8;
  online.online = true;
  EXPECT_EQ(model_weight_bytes(llama3_8b(), DType::kBF16, online),
            32 * (linear + 7 * 4) + plain);
  // The ranks of a plan hold it too: TP 2's two ranks split the packed linear layers.
  ParallelConfig tp2;
  tp2.tp_size = 2;
  auto p = make_parallel_plan(awq, tp2, DType::kBF16);
  ASSERT_TRUE(p) << p.status().to_string();
  EXPECT_EQ(p->ranks[0].weight_bytes - p->ranks[0].padding_bytes,
            16 * (linear * 133 / 256) + plain / 2 + 32 * 2 * 4096 + 4096);
  // Qwen2.5-72B's MLP (29568 = 231 groups of 128) splits into no ranks of whole groups, which
  // is why Qwen's AWQ export pads it to 29696 (232 groups): that one splits 8 ways.
  ModelConfig qwen72 = llama3_70b();
  qwen72.intermediate_size = 29568;
  qwen72.quant = awq.quant;
  ParallelConfig tp8;
  tp8.tp_size = 8;
  auto refused = make_parallel_plan(qwen72, tp8, DType::kF16);
  ASSERT_FALSE(refused);
  EXPECT_NE(refused.status().message().find("-tp 8 splits a quantization group: down_proj"),
            std::string::npos)
      << refused.status().message();
  EXPECT_TRUE(refused.status().message().ends_with("valid -tp values for this model: 1"))
      << refused.status().message();
  qwen72.intermediate_size = 29696;
  EXPECT_TRUE(make_parallel_plan(qwen72, tp8, DType::kF16));
}

// What the ranks hold together, exactly: every tensor once, plus
//   - the replicated tensors (input/post-attention norms, q/k norms, the final norm) T - 1 more
//     times (each rank of a stage holds them whole);
//   - with replicated KV heads, k_proj and v_proj (and their biases) kv_replicas - 1 more times;
//   - the vocabulary padding rows of every vocab-parallel tensor set (embedding, lm_head);
//   - with tied embeddings over P > 1 stages, the embedding a second time (the last stage's
//     lm_head), padded.
// The o_proj bias is held by TP rank 0 only, so it counts once.
uint64_t expected_sum(const ModelConfig& c, const ParallelPlan& p) {
  const uint64_t h = c.hidden_size, hd = c.head_dim;
  const uint64_t t = p.tp;
  uint64_t replicated = c.num_layers * (2 * h + (c.qk_norm ? 2 * hd : 0)) + h;
  uint64_t kv =
      c.num_layers * 2 * (c.num_kv_heads * hd * h + (c.attention_bias ? c.num_kv_heads * hd : 0));
  uint64_t vocab_sets = c.tie_word_embeddings ? (p.pp > 1 ? 2 : 1) : 2;
  uint64_t padding = static_cast<uint64_t>(p.padded_vocab - c.vocab_size) * h * vocab_sets;
  uint64_t tied_copy = c.tie_word_embeddings && p.pp > 1 ? c.vocab_size * h : 0;
  return (params(c) + (t - 1) * replicated + (p.kv_replicas - 1) * kv + padding + tied_copy) *
         dtype_size(p.dtype);
}

TEST(ParallelPlanTest, RankWeightBytesAddUpToTheModelForRealShapes) {
  struct Case {
    const char* name;
    ModelConfig config;
  };
  ModelConfig tied = qwen3_8b();
  tied.tie_word_embeddings = true;
  tied.vocab_size = 151935;  // odd: padding on every T > 1
  ModelConfig biased = llama3_8b();
  biased.attention_bias = true;
  biased.o_proj_bias = true;
  std::vector<Case> cases = {{"llama3-8b", llama3_8b()},
                             {"qwen3-8b", qwen3_8b()},
                             {"70b", llama3_70b()},
                             {"tied-odd-vocab", tied},
                             {"biases", biased}};
  for (const Case& k : cases) {
    for (int tp : {1, 2, 4, 8, 16}) {
      for (int pp : {1, 2, 3, 4}) {
        auto plan = make_parallel_plan(k.config, shape(tp, pp), DType::kBF16);
        ASSERT_TRUE(plan) << k.name << " tp " << tp << " pp " << pp << ": "
                          << plan.status().message();
        uint64_t sum = 0;
        for (const RankPlan& r : plan->ranks) sum += r.weight_bytes;
        EXPECT_EQ(sum, expected_sum(k.config, *plan)) << k.name << " tp " << tp << " pp " << pp;
        // TP ranks of one stage hold the same bytes up to the o_proj bias and vocab padding.
        for (const RankPlan& r : plan->ranks) {
          const RankPlan& first = plan->at(r.shard.parallel.pp_rank, 0);
          const uint64_t o_bias = k.config.o_proj_bias ? r.shard.num_layers() * 4096u * 2 : 0;
          EXPECT_EQ(r.weight_bytes + (r.shard.parallel.tp_rank == 0 ? 0 : o_bias),
                    first.weight_bytes)
              << k.name << " rank " << r.rank();
        }
      }
    }
  }
}

TEST(ParallelPlanTest, Llama3_8bTp2RankBytesByHand) {
  ParallelPlan p = must_plan(llama3_8b(), 2, 1);
  // Per rank: embedding and lm_head 64128 x 4096 each; per layer q 2048x4096, k and v 512x4096,
  // o 4096x2048, gate/up 7168x4096, down 4096x7168, two norms of 4096; the final norm.
  const uint64_t layer =
      2048ull * 4096 + 2 * 512 * 4096 + 4096 * 2048 + 3 * 7168ull * 4096 + 2 * 4096;
  const uint64_t elements = 2 * 64128ull * 4096 + 32 * layer + 4096;
  EXPECT_EQ(p.ranks[0].weight_bytes, 2 * elements);
  EXPECT_EQ(p.ranks[1].weight_bytes, 2 * elements);
  EXPECT_EQ(p.ranks[0].kv_elems_per_token, 2 * 32 * 4 * 128);
  EXPECT_TRUE(p.ranks[0].embedding() && p.ranks[0].shard.last_stage);
}

TEST(ParallelPlanTest, PipelineStagesHoldEmbeddingFirstAndLmHeadLast) {
  ModelConfig c = qwen3_8b();
  ParallelPlan p = must_plan(c, 1, 3);
  EXPECT_TRUE(p.ranks[0].embedding());
  EXPECT_FALSE(p.ranks[0].shard.last_stage);
  EXPECT_FALSE(p.ranks[1].embedding() || p.ranks[1].shard.last_stage);
  EXPECT_TRUE(p.ranks[2].shard.last_stage);
  EXPECT_FALSE(p.ranks[2].embedding());
  c.tie_word_embeddings = true;
  ParallelPlan tied = must_plan(c, 1, 3);
  EXPECT_TRUE(tied.ranks[2].embedding());  // the tied lm_head is the embedding
}

// ---- memory -----------------------------------------------------------------------------------

// An engine spec as given for model "/m" (validate() wants a model).
EngineSpec model_spec() {
  EngineSpec e;
  e.model = "/m";
  return e;
}

// What the planner sizes memory with: the spec checked, its lengths resolved for `c`.
Expected<EngineSpec> resolve_memory(const ModelConfig& c, const EngineSpec& o) {
  TESSERA_RETURN_IF_ERROR(validate(o));
  return resolve_lengths(o, c);
}

EngineSpec resolved(const ModelConfig& c, EngineSpec o = model_spec()) {
  auto r = resolve_memory(c, o);
  EXPECT_TRUE(r) << r.status().message();
  return r ? *r : o;
}

std::vector<std::optional<GpuMemory>> gpus(size_t n, uint64_t total, uint64_t used = 0) {
  return std::vector<std::optional<GpuMemory>>(n, GpuMemory{total, used});
}

// vLLM's default context is the model's whole max_position_embeddings (Llama 3.1: 131072), not
// a cap; the batch-token budget stays at 16384.
TEST(MemoryPlanTest, DefaultContextIsTheModels) {
  ModelConfig c = llama3_8b();
  c.max_position_embeddings = 131072;
  EngineSpec o = resolved(c);
  EXPECT_EQ(o.max_model_len, 131072);
  EXPECT_EQ(o.max_num_batched_tokens, 16384);
  EngineSpec lower = model_spec();
  lower.max_model_len = 4096;
  auto r = resolve_memory(c, lower);
  ASSERT_TRUE(r) << r.status().to_string();
  EXPECT_EQ(r->max_model_len, 4096);
}

TEST(MemoryPlanTest, Llama3_8bOnOneGpu) {
  const ModelConfig c = llama3_8b();
  ParallelPlan p = must_plan(c, 1, 1);
  EngineSpec o = resolved(c);
  EXPECT_EQ(o.max_model_len, 8192);
  EXPECT_EQ(o.max_num_batched_tokens, 8192);
  MemoryPlan m = estimate_memory(c, p, gpus(1, 80 * kGiB), o);
  const RankMemory& r = m.ranks[0];
  EXPECT_EQ(r.weights, 2 * 8030261248u);
  // The CUDA backend's step buffers (LayerPlan::step_buffers): 8192 tokens x (3 x 4096 hidden
  // + 48 x 128 q|k|v + 2 x 32 x 128 q and attention + 3 x 14336 gate|up and activation) x 2
  // bytes, 256 logit rows of 4096 bf16 and fp32 logits for 256 x 128256; + 64 + 32 + 512 MiB
  // fixed + 512 MiB of CUDA graphs.
  EXPECT_EQ(r.activations, 8192ull * 139264 + 256ull * 4096 * 2 + 256ull * 128256 * 4 +
                               (608ull << 20) + (512ull << 20));
  EXPECT_EQ(r.budget, static_cast<uint64_t>(0.9 * 80 * kGiB));
  EXPECT_EQ(r.kv_bytes_per_token, 131072u);
  const uint64_t blocks = (r.budget - r.weights - r.activations) / (16 * 131072);
  EXPECT_EQ(r.kv_tokens, static_cast<int64_t>(blocks * 16));
  EXPECT_EQ(m.kv_tokens, r.kv_tokens);
  EXPECT_TRUE(m.fits);
  EXPECT_NEAR(m.max_concurrency, static_cast<double>(r.kv_tokens) / 8192, 1e-9);
  EXPECT_TRUE(memory_status(m));
}

// Quantized layers take a workspace the backend allocates beside the step buffers: int4 — a
// prefill dequantizes the largest layer (gate|up: 2 x 14336 x 4096) into it in bf16; FP8 (here
// online, --quantization fp8 on the bf16 checkpoint) — the quantized rows of 8192 tokens with
// their scales, and the FP8 GEMM's memory. The plan's activations count it, so its KV figure is
// the one the rank will find.
TEST(MemoryPlanTest, QuantizedLayersCountTheirWorkspace) {
  const ModelConfig plain = llama3_8b();
  const EngineSpec o = resolved(plain);
  const MemoryPlan base = estimate_memory(plain, must_plan(plain, 1, 1), gpus(1, 80 * kGiB), o);
  ModelConfig awq = plain;
  awq.quant.method = QuantMethod::kAwq;
  awq.quant.bits = 4;
  awq.quant.group_size = 128;
  const MemoryPlan int4 = estimate_memory(awq, must_plan(awq, 1, 1), gpus(1, 80 * kGiB), o);
  EXPECT_EQ(int4.ranks[0].activations, base.ranks[0].activations + 2ull * 14336 * 4096 * 2);
  EXPECT_LT(int4.ranks[0].weights, base.ranks[0].weights / 2);  // bf16 embedding and lm_head
  EngineSpec online = o;
  online.quantization = QuantMethod::kFp8;
  const MemoryPlan fp8 = estimate_memory(plain, must_plan(plain, 1, 1), gpus(1, 80 * kGiB), online);
  EXPECT_EQ(fp8.ranks[0].activations,
            base.ranks[0].activations + 8192ull * (14336 + 4) + kFp8GemmDeviceBytes);
  // At -tp 2 each rank dequantizes its half of gate|up.
  const MemoryPlan tp2 = estimate_memory(awq, must_plan(awq, 2, 1), gpus(2, 80 * kGiB), o);
  const MemoryPlan base2 = estimate_memory(plain, must_plan(plain, 2, 1), gpus(2, 80 * kGiB), o);
  EXPECT_EQ(tp2.ranks[1].activations, base2.ranks[1].activations + 2ull * 7168 * 4096 * 2);
}

// A mixture of experts' layers carve a workspace per step (router logits, routings, the chosen
// experts' activations and outputs: common/checkpoint/moe_carve.h); the plan counts it, and the
// last stage's logits twice under TP, as the CUDA backend allocates them.
TEST(MemoryPlanTest, MoeWorkspaceAndTensorParallelLogitsAreCounted) {
  const ModelConfig moe = qwen3_30b_a3b();
  ModelConfig dense = moe;
  dense.moe = {};
  const EngineSpec o = resolved(moe);
  const auto tokens = std::max(o.max_num_batched_tokens, o.max_num_seqs);
  const ParallelPlan p = must_plan(moe, 1, 1);
  const MemoryPlan with = estimate_memory(moe, p, gpus(1, 80 * kGiB), o);
  const MemoryPlan without = estimate_memory(dense, p, gpus(1, 80 * kGiB), o);
  const uint64_t ws = p.ranks[0].shard.moe_workspace_bytes(moe, DType::kBF16, tokens);
  // T x 8 routings of the 768-wide experts' activations and 2048-wide outputs in bf16, at least.
  EXPECT_GE(ws, static_cast<uint64_t>(tokens) * 8 * (768 + 2048) * 2);
  EXPECT_EQ(with.ranks[0].activations, without.ranks[0].activations + ws);
  EXPECT_EQ(p.ranks[0].shard.moe_workspace_bytes(dense, DType::kBF16, tokens), 0u);

  const ModelConfig c = llama3_8b();
  const EngineSpec e = resolved(c);
  const MemoryPlan one = estimate_memory(c, must_plan(c, 1, 1), gpus(1, 80 * kGiB), e);
  const MemoryPlan two = estimate_memory(c, must_plan(c, 2, 1), gpus(2, 80 * kGiB), e);
  const uint64_t logits = static_cast<uint64_t>(e.max_num_seqs) * 128256 * 4;
  const uint64_t rows = static_cast<uint64_t>(e.max_num_seqs) * 4096 * 2;  // bf16 logit rows
  EXPECT_EQ(one.ranks[0].activations,
            8192ull * 139264 + rows + logits + (608ull << 20) + (512ull << 20));
  // -tp 2: 8192 tokens x (3 x 4096 + 24 x 128 + 2 x 16 x 128 + 3 x 7168) x 2 bytes, the logits
  // twice (whole, and 2 x 64128 vocabulary-parallel columns), the sampled tokens ((1 + 2) x 256
  // int32), the same fixed buffers and graphs, and the communicator's 256 MiB.
  EXPECT_EQ(two.ranks[0].activations, 8192ull * 81920 + rows + 2 * logits +
                                          3ull * e.max_num_seqs * 4 + (608ull << 20) +
                                          (512ull << 20) + (256ull << 20));
  // The planner's step buffers are the ones the backend allocates, field by field.
  const StepBuffers b = must_plan(c, 2, 1).ranks[0].shard.step_buffers(c, DType::kBF16, 8192, 256);
  EXPECT_EQ(b.qkv, 8192ull * 24 * 128 * 2);
  EXPECT_EQ(b.q, 8192ull * 16 * 128 * 2);
  EXPECT_EQ(b.gate_up, 8192ull * 2 * 7168 * 2);
  EXPECT_EQ(b.shard_logits, 2ull * 256 * 64128 * 4);
  EXPECT_EQ(b.sampled_tokens, 3ull * 256 * 4);
}

TEST(MemoryPlanTest, MoreTensorParallelRanksMeanMoreKvTokens) {
  const ModelConfig c = llama3_8b();
  EngineSpec o = resolved(c);
  MemoryPlan one = estimate_memory(c, must_plan(c, 1, 1), gpus(1, 80 * kGiB), o);
  MemoryPlan two = estimate_memory(c, must_plan(c, 2, 1), gpus(2, 80 * kGiB), o);
  EXPECT_EQ(two.ranks[0].kv_bytes_per_token, 65536u);
  EXPECT_GT(two.kv_tokens, 2 * one.kv_tokens);
}

// --kv-cache-dtype fp8: one byte per cached element, so twice the tokens in the same room.
TEST(MemoryPlanTest, Fp8KvCacheHoldsTwiceTheTokens) {
  const ModelConfig c = llama3_8b();
  EngineSpec o = resolved(c);
  const MemoryPlan bf16 = estimate_memory(c, must_plan(c, 1, 1), gpus(1, 80 * kGiB), o);
  o.kv_cache_dtype = KvCacheDtype::kFp8E4M3;
  const MemoryPlan fp8 = estimate_memory(c, must_plan(c, 1, 1), gpus(1, 80 * kGiB), o);
  EXPECT_EQ(fp8.ranks[0].kv_bytes_per_token, 65536u);
  EXPECT_EQ(fp8.ranks[0].activations, bf16.ranks[0].activations);
  const uint64_t room = fp8.ranks[0].budget - fp8.ranks[0].weights - fp8.ranks[0].activations;
  EXPECT_EQ(fp8.kv_tokens, static_cast<int64_t>(room / (16 * 65536) * 16));
  EXPECT_NEAR(static_cast<double>(fp8.kv_tokens) / static_cast<double>(bf16.kv_tokens), 2.0, 1e-3);
}

TEST(MemoryPlanTest, TheLimitingRankDecides) {
  const ModelConfig c = llama3_8b();
  EngineSpec o = resolved(c);
  auto g = gpus(2, 80 * kGiB);
  g[1]->used = 40 * kGiB;  // another process holds half of GPU 1
  MemoryPlan m = estimate_memory(c, must_plan(c, 1, 2), g, o);
  EXPECT_EQ(m.limiting_rank, 1);
  EXPECT_EQ(m.kv_tokens, m.ranks[1].kv_tokens);
  EXPECT_LT(m.ranks[1].kv_tokens, m.ranks[0].kv_tokens);
}

TEST(MemoryPlanTest, WeightsThatDoNotFitSayToSpreadTheModel) {
  const ModelConfig c = llama3_70b();
  MemoryPlan m = estimate_memory(c, must_plan(c, 1, 1), gpus(1, 80 * kGiB), resolved(c));
  EXPECT_FALSE(m.fits);
  Status st = memory_status(m, {"node-a gpu0"});
  ASSERT_FALSE(st);
  EXPECT_EQ(st.code(), Code::kResourceExhausted);
  const std::string& msg = st.message();
  EXPECT_TRUE(contains(msg, "rank 0 (node-a gpu0)")) << msg;
  EXPECT_TRUE(contains(msg, "weights take 131.42 GiB")) << msg;
  EXPECT_TRUE(contains(msg, "before any KV cache")) << msg;
  EXPECT_TRUE(contains(msg, "raise -tp or -pp")) << msg;
  EXPECT_FALSE(contains(msg, "lower --max-model-len")) << msg;  // would not help
  EXPECT_FALSE(contains(msg, "raise --gpu-memory-utilization")) << msg;
}

TEST(MemoryPlanTest, ShortOfKvSaysWhichMaxModelLenAndUtilizationFit) {
  const ModelConfig c = llama3_8b();
  MemoryPlan m = estimate_memory(c, must_plan(c, 1, 1), gpus(1, 20 * kGiB), resolved(c));
  ASSERT_FALSE(m.fits);
  ASSERT_GT(m.kv_tokens, 0);
  Status st = memory_status(m);
  const std::string& msg = st.message();
  EXPECT_TRUE(contains(msg, "lower --max-model-len to " + std::to_string(m.kv_tokens))) << msg;
  EXPECT_TRUE(contains(msg, "raise --gpu-memory-utilization to 0.9")) << msg;
  EXPECT_TRUE(contains(msg, "one sequence of --max-model-len 8192 needs 8192 tokens")) << msg;
}

TEST(MemoryPlanTest, FlagsAreChecked) {
  const ModelConfig c = llama3_8b();
  EngineSpec o = model_spec();
  o.max_model_len = 9000;
  auto r = resolve_memory(c, o);
  ASSERT_FALSE(r);
  EXPECT_TRUE(contains(r.status().message(), "max_position_embeddings (8192)"));
  o = model_spec();
  o.gpu_memory_utilization = 1.5;
  r = resolve_memory(c, o);
  ASSERT_FALSE(r);
  EXPECT_TRUE(contains(r.status().message(), "--gpu-memory-utilization must be in (0, 1]"));
}

// When every layer slides, one sequence holds its window plus two blocks at once, not its whole
// context: a long --max-model-len that would not fit with full attention fits with the window.
TEST(MemoryPlanTest, AWindowedModelNeedsItsWindowNotItsContext) {
  ModelConfig c = llama3_8b();
  c.max_position_embeddings = 131072;
  const MemoryPlan full = estimate_memory(c, must_plan(c, 1, 1), gpus(1, 24 * kGiB), resolved(c));
  ASSERT_GT(full.kv_tokens, 8192);
  ASSERT_LT(full.kv_tokens, 131072);
  EXPECT_EQ(full.sequence_tokens, 131072);
  EXPECT_FALSE(full.fits);
  c.sliding_window = 4096;  // every layer
  EXPECT_EQ(c.kv_tokens_per_sequence(131072, 16), 4096 + 32);
  EXPECT_EQ(c.kv_tokens_per_sequence(1000, 16), 1000);  // shorter than the window
  const MemoryPlan win = estimate_memory(c, must_plan(c, 1, 1), gpus(1, 24 * kGiB), resolved(c));
  EXPECT_EQ(win.kv_tokens, full.kv_tokens);
  EXPECT_EQ(win.sequence_tokens, 4096 + 32);
  EXPECT_TRUE(win.fits);
  EXPECT_TRUE(memory_status(win).is_ok());
  // Too small even for the window: the message names what one sequence needs.
  const MemoryPlan tiny =
      estimate_memory(c, must_plan(c, 1, 1), gpus(1, 20 * kGiB + kGiB * 6 / 10), resolved(c));
  ASSERT_GT(tiny.kv_tokens, 0);
  ASSERT_LT(tiny.kv_tokens, 4096 + 32);
  EXPECT_FALSE(tiny.fits);
  EXPECT_TRUE(contains(memory_status(tiny).message(),
                       "one sequence of --max-model-len 131072 needs 4128 tokens"))
      << memory_status(tiny).message();
}

// A sliding window no longer caps the context; a capped cache (--num-gpu-blocks-override) must
// hold one sequence unless every layer slides (then a sequence holds only its window's blocks).
TEST(MemoryPlanTest, SlidingWindowsAndACappedCache) {
  ModelConfig c = llama3_8b();
  c.sliding_window = 4096;  // every layer: Mistral v0.1's window
  EngineSpec o = resolved(c);
  EXPECT_EQ(o.max_model_len, 8192);
  o = model_spec();
  o.num_gpu_blocks_override = 64;  // 1024 tokens
  auto r = resolve_memory(c, o);
  ASSERT_TRUE(r) << r.status().to_string();
  c.sliding_window.reset();
  r = resolve_memory(c, o);
  ASSERT_FALSE(r);
  EXPECT_TRUE(contains(r.status().message(), "--num-gpu-blocks-override 64 holds 1024 tokens"))
      << r.status().message();
}

TEST(MemoryPlanTest, DtypeFollowsTheActor) {
  EXPECT_EQ(*resolve_dtype("auto", DType::kF32, true), DType::kBF16);
  EXPECT_EQ(*resolve_dtype("auto", DType::kF32, false), DType::kF32);
  EXPECT_EQ(*resolve_dtype("half", DType::kBF16, true), DType::kF16);
  EXPECT_FALSE(resolve_dtype("float32", DType::kBF16, true));
  EXPECT_FALSE(resolve_dtype("int8", DType::kBF16, true));
}

// ---- synthetic clusters -----------------------------------------------------------------------

// A node with `n` GPUs of `memory` bytes; link(a, b) for a != b.
ClusterNode make_node(const std::string& name, size_t n, uint64_t memory,
                      const std::function<GpuLink(size_t, size_t)>& link,
                      std::vector<uint32_t> busy = {}) {
  ClusterNode c;
  c.node.node_id = "n-" + name;
  c.node.name = name;
  c.node.alive = true;
  c.node.resources.cpus = 32;
  for (size_t i = 0; i < n; ++i) {
    GpuDevice g;
    g.index = static_cast<uint32_t>(i);
    g.name = "NVIDIA H100";
    g.memory_total = memory;
    c.node.resources.gpus.push_back(g);
  }
  for (size_t a = 0; a < n; ++a) {
    for (size_t b = 0; b < n; ++b) {
      c.node.resources.links.push_back(a == b ? GpuLink{LinkKind::kSelf, 0} : link(a, b));
    }
  }
  c.busy_gpus = std::move(busy);
  return c;
}

GpuLink nv18(size_t, size_t) { return {LinkKind::kNvlink, 18}; }
// NVLink only within the pairs 0-1 and 2-3; PHB across.
GpuLink pairs(size_t a, size_t b) {
  return a / 2 == b / 2 ? GpuLink{LinkKind::kNvlink, 4} : GpuLink{LinkKind::kPhb, 0};
}

std::vector<std::pair<std::string, int64_t>> where(const Placement& p) {
  std::vector<std::pair<std::string, int64_t>> out;
  for (const PlacedRank& r : p.ranks) out.push_back({r.node_name, r.gpu});
  return out;
}

TEST(PlacementTest, EightGpusOnNvSwitch) {
  std::vector<ClusterNode> nodes = {make_node("node-a", 8, 80 * kGiB, nv18)};
  auto p = place_ranks(8, 1, nodes);
  ASSERT_TRUE(p) << p.status().message();
  EXPECT_TRUE(p->warnings.empty());
  EXPECT_EQ(format_stages(*p, 8, 1),
            "stage 0: node-a gpu0 gpu1 gpu2 gpu3 gpu4 gpu5 gpu6 gpu7 [NV18]\n");
  auto q = place_ranks(2, 4, nodes);
  ASSERT_TRUE(q);
  EXPECT_EQ(format_stages(*q, 2, 4),
            "stage 0: node-a gpu0 gpu1 [NV18]\nstage 1: node-a gpu2 gpu3 [NV18]\n"
            "stage 2: node-a gpu4 gpu5 [NV18]\nstage 3: node-a gpu6 gpu7 [NV18]\n");
  EXPECT_EQ(nvlink_islands(nodes[0].node.resources),
            (std::vector<std::vector<uint32_t>>{{0, 1, 2, 3, 4, 5, 6, 7}}));
}

TEST(PlacementTest, NvlinkPairsKeepTpGroupsOnAPair) {
  std::vector<ClusterNode> nodes = {make_node("node-a", 4, 80 * kGiB, pairs)};
  EXPECT_EQ(nvlink_islands(nodes[0].node.resources),
            (std::vector<std::vector<uint32_t>>{{0, 1}, {2, 3}}));
  auto tp2 = place_ranks(2, 2, nodes);
  ASSERT_TRUE(tp2);
  EXPECT_TRUE(tp2->warnings.empty());
  EXPECT_EQ(format_stages(*tp2, 2, 2),
            "stage 0: node-a gpu0 gpu1 [NV4]\nstage 1: node-a gpu2 gpu3 [NV4]\n");
  // With gpu0 busy, a TP group of 2 takes the free pair, not 1-2 across PHB.
  nodes[0].busy_gpus = {0};
  auto busy = place_ranks(2, 1, nodes);
  ASSERT_TRUE(busy);
  EXPECT_EQ(where(*busy),
            (std::vector<std::pair<std::string, int64_t>>{{"node-a", 2}, {"node-a", 3}}));
}

TEST(PlacementTest, GroupsAreChosenTogetherNotGreedily) {
  // NVLink 0-1 (NV2), 0-2 (NV4), 2-3 (NV2), PHB elsewhere. Taking the strongest pair 0-2 first
  // would leave 1-3 on PHB; 0-1 and 2-3 keep both groups on NVLink.
  auto link = [](size_t a, size_t b) {
    const std::set<std::pair<size_t, size_t>> nv2 = {{0, 1}, {2, 3}};
    auto key = std::make_pair(std::min(a, b), std::max(a, b));
    if (key == std::make_pair(size_t{0}, size_t{2})) return GpuLink{LinkKind::kNvlink, 4};
    if (nv2.count(key)) return GpuLink{LinkKind::kNvlink, 2};
    return GpuLink{LinkKind::kPhb, 0};
  };
  std::vector<ClusterNode> nodes = {make_node("node-a", 4, 80 * kGiB, link)};
  auto p = place_ranks(2, 2, nodes);
  ASSERT_TRUE(p);
  EXPECT_EQ(format_stages(*p, 2, 2),
            "stage 0: node-a gpu0 gpu1 [NV2]\nstage 1: node-a gpu2 gpu3 [NV2]\n");
  // One group alone takes the strongest pair.
  auto one = place_ranks(2, 1, nodes);
  ASSERT_TRUE(one);
  EXPECT_EQ(format_stages(*one, 2, 1), "stage 0: node-a gpu0 gpu2 [NV4]\n");
}

TEST(PlacementTest, TpAcrossPcieWarnsAndSuggestsTp2Pp2) {
  std::vector<ClusterNode> nodes = {make_node("node-a", 4, 80 * kGiB, pairs)};
  EngineSpec req = model_spec();
  req.tensor_parallel_size = ParallelSize{4};
  req.pipeline_parallel_size = ParallelSize{1};
  auto cp = plan_on_cluster(llama3_8b(), req, nodes);
  ASSERT_TRUE(cp) << cp.status().message();
  ASSERT_EQ(cp->placement.warnings.size(), 1u);
  const std::string& w = cp->placement.warnings[0];
  EXPECT_TRUE(contains(w,
                       "stage 0's tensor-parallel group (node-a gpu0 gpu1 gpu2 gpu3) is not one "
                       "NVLink island: gpu1-gpu2 are joined by PHB, so its all-reduces cross "
                       "PCIe through the CPU's host bridge"))
      << w;
  ASSERT_TRUE(cp->better);
  EXPECT_EQ(cp->better->tp_size, 2);
  EXPECT_EQ(cp->better->pp_size, 2);
  ASSERT_EQ(cp->warnings.size(), 2u);
  EXPECT_TRUE(contains(cp->warnings[1],
                       "better: -tp 2 -pp 2 keeps every tensor-parallel group "
                       "on NVLink (stage 0: node-a gpu0 gpu1 [NV4]; stage 1: "
                       "node-a gpu2 gpu3 [NV4])"))
      << cp->warnings[1];
  const std::string text = render_cluster_plan(llama3_8b(), *cp);
  EXPECT_TRUE(contains(text, "  stage 0: node-a gpu0 gpu1 gpu2 gpu3 [PHB]\n")) << text;
  EXPECT_TRUE(contains(text, "warning: stage 0's tensor-parallel group")) << text;
  EXPECT_TRUE(contains(text, "\nbetter: -tp 2 -pp 2")) << text;
  EXPECT_TRUE(cp->fit);
}

TEST(PlacementTest, TwoNodesOfTwoGpusPutStagesOnNodesAndTpInside) {
  std::vector<ClusterNode> nodes = {make_node("node-a", 2, 80 * kGiB, nv18),
                                    make_node("node-b", 2, 80 * kGiB, nv18)};
  auto p = place_ranks(2, 2, nodes);
  ASSERT_TRUE(p) << p.status().message();
  EXPECT_TRUE(p->warnings.empty());
  EXPECT_EQ(format_stages(*p, 2, 2),
            "stage 0: node-a gpu0 gpu1 [NV18]\nstage 1: node-b gpu0 gpu1 [NV18]\n");
  // T = 4 cannot stay on a node: the group spans both, and says so.
  auto wide = place_ranks(4, 1, nodes);
  ASSERT_TRUE(wide);
  EXPECT_EQ(format_stages(*wide, 4, 1), "stage 0: node-a gpu0 gpu1 + node-b gpu0 gpu1 [network]\n");
  ASSERT_EQ(wide->warnings.size(), 1u);
  EXPECT_TRUE(contains(wide->warnings[0], "spans nodes node-a and node-b")) << wide->warnings[0];
}

TEST(PlacementTest, NodesWithTheMostFreeGpusComeFirst) {
  std::vector<ClusterNode> nodes = {make_node("small", 2, 80 * kGiB, nv18),
                                    make_node("big", 4, 80 * kGiB, nv18)};
  auto p = place_ranks(2, 3, nodes);
  ASSERT_TRUE(p);
  EXPECT_EQ(format_stages(*p, 2, 3),
            "stage 0: big gpu0 gpu1 [NV18]\nstage 1: big gpu2 gpu3 [NV18]\n"
            "stage 2: small gpu0 gpu1 [NV18]\n");
  // One node holds everything when it can.
  auto q = place_ranks(2, 2, nodes);
  ASSERT_TRUE(q);
  EXPECT_EQ(format_stages(*q, 2, 2),
            "stage 0: big gpu0 gpu1 [NV18]\nstage 1: big gpu2 gpu3 [NV18]\n");
}

TEST(PlacementTest, BusyGpusAreSkipped) {
  std::vector<ClusterNode> nodes = {make_node("node-a", 8, 80 * kGiB, nv18, {0, 1, 2})};
  auto p = place_ranks(4, 1, nodes);
  ASSERT_TRUE(p);
  EXPECT_EQ(format_stages(*p, 4, 1), "stage 0: node-a gpu3 gpu4 gpu5 gpu6 [NV18]\n");
  nodes[0].busy_gpus = {0, 1, 2, 3, 4, 5};
  auto full = place_ranks(4, 1, nodes);
  ASSERT_FALSE(full);
  EXPECT_EQ(full.status().code(), Code::kResourceExhausted);
  EXPECT_TRUE(contains(full.status().message(),
                       "-tp 4 -pp 1 needs 4 GPUs but the cluster has 2 free (node-a: 2 of 8 "
                       "free (busy: gpu0 (80.00 GiB free) gpu1 (80.00 GiB free)"))
      << full.status().message();
  // Short of GPUs, the message says how ranks can share them.
  EXPECT_TRUE(contains(full.status().message(), "--collectives ipc")) << full.status().message();
  // Dead nodes do not count.
  nodes.push_back(make_node("gone", 8, 80 * kGiB, nv18));
  nodes.back().node.alive = false;
  EXPECT_FALSE(place_ranks(4, 1, nodes));
}

// -tp 2 on a one-GPU machine (a tutorial's line on a workstation): the error names the way to
// run it anyway, two ranks on the one GPU through CUDA IPC.
TEST(PlacementTest, TooFewGpusNamesTheWayToShareOne) {
  auto p = place_ranks(2, 1, {make_node("box", 1, 80 * kGiB, nv18)});
  ASSERT_FALSE(p);
  EXPECT_EQ(p.status().code(), Code::kResourceExhausted);
  const std::string m = p.status().message();
  EXPECT_TRUE(contains(m, "-tp 2 -pp 1 needs 2 GPUs but the cluster has 1 free (box: 1 of 1 free)"))
      << m;
  EXPECT_TRUE(contains(m, "--collectives ipc (ranks share a GPU through CUDA IPC")) << m;
  // The planner passes it on.
  EngineSpec spec = model_spec();
  spec.tensor_parallel_size = ParallelSize{2};
  auto cp = plan_on_cluster(llama3_8b(), spec, {make_node("box", 1, 80 * kGiB, nv18)});
  ASSERT_FALSE(cp);
  EXPECT_TRUE(contains(cp.status().message(), "--collectives ipc")) << cp.status().message();
  // CPU ranks are not short of GPUs.
  spec.device = Device::kCpu;
  EXPECT_TRUE(plan_on_cluster(llama3_8b(), spec, {make_node("box", 1, 80 * kGiB, nv18)}));
}

// --dtype half / float16 / bfloat16 on CPU ranks: they compute in float32, and the plan says so
// (the driver logs its warnings) rather than run float32 silently.
TEST(PlacementTest, AHalfDtypeOnCpuRanksSaysTheyComputeInFloat32) {
  const std::vector<ClusterNode> cpu = synthetic_nodes(1, 0, 0);
  for (const std::string dtype : {"half", "float16", "bfloat16"}) {
    EngineSpec spec = model_spec();
    spec.dtype = dtype;
    auto cp = plan_on_cluster(llama3_8b(), spec, cpu);
    ASSERT_TRUE(cp) << cp.status().message();
    ASSERT_EQ(cp->warnings.size(), 1u) << dtype;
    EXPECT_EQ(
        cp->warnings[0].rfind("--dtype " + dtype + ": the CPU backend computes in float32", 0), 0u)
        << cp->warnings[0];
    EXPECT_TRUE(contains(render_cluster_plan(llama3_8b(), *cp), "warning: --dtype " + dtype))
        << dtype;
  }
  // No note where the dtype is what runs: float32 or auto on the CPU, half on a GPU.
  for (const std::string dtype : {"float32", "auto"}) {
    EngineSpec spec = model_spec();
    spec.dtype = dtype;
    auto cp = plan_on_cluster(llama3_8b(), spec, cpu);
    ASSERT_TRUE(cp) << cp.status().message();
    EXPECT_TRUE(cp->warnings.empty()) << dtype << ": " << cp->warnings[0];
  }
  EngineSpec gpu = model_spec();
  gpu.dtype = "half";
  auto cp = plan_on_cluster(llama3_8b(), gpu, synthetic_nodes(1, 1, 80 * kGiB));
  ASSERT_TRUE(cp) << cp.status().message();
  EXPECT_TRUE(cp->warnings.empty()) << cp->warnings[0];
}

TEST(PlacementTest, CpuOnlyClusterSpreadsStagesAndKeepsTpGroupsTogether) {
  ClusterNode a = make_node("cpu-a", 0, 0, nv18);
  ClusterNode b = make_node("cpu-b", 0, 0, nv18);
  a.node.resources.cpus = 8;
  b.node.resources.cpus = 16;
  auto p = place_ranks(2, 2, {a, b});
  ASSERT_TRUE(p) << p.status().message();
  EXPECT_TRUE(p->cpu);
  EXPECT_EQ(where(*p), (std::vector<std::pair<std::string, int64_t>>{
                           {"cpu-b", -1}, {"cpu-b", -1}, {"cpu-a", -1}, {"cpu-a", -1}}));
  EXPECT_TRUE(p->warnings.empty());
  EXPECT_EQ(format_stages(*p, 2, 2), "stage 0: cpu-b 2 CPU actors\nstage 1: cpu-a 2 CPU actors\n");
  // More stages than nodes: consecutive runs.
  auto q = place_ranks(1, 4, {a, b});
  ASSERT_TRUE(q);
  EXPECT_EQ(where(*q), (std::vector<std::pair<std::string, int64_t>>{
                           {"cpu-b", -1}, {"cpu-b", -1}, {"cpu-a", -1}, {"cpu-a", -1}}));
  EngineSpec req = model_spec();
  auto cp = plan_on_cluster(llama3_8b(), req, {a, b});
  ASSERT_TRUE(cp) << cp.status().message();
  EXPECT_TRUE(cp->fit);
  EXPECT_TRUE(contains(render_cluster_plan(llama3_8b(), *cp), "stage 0: cpu-b 1 CPU actor\n"));
  EXPECT_TRUE(cp->warnings.empty());
  // A node that cannot hold its ranks' weights says so.
  b.node.resources.memory_available = 8 * kGiB;
  cp = plan_on_cluster(llama3_8b(), req, {a, b});
  ASSERT_TRUE(cp);
  ASSERT_EQ(cp->warnings.size(), 1u);
  EXPECT_TRUE(contains(cp->warnings[0],
                       "node cpu-b: its CPU ranks need 15.96 GiB for weights and "
                       "KV cache but it has 8.00 GiB of memory available"))
      << cp->warnings[0];
}

TEST(PlacementTest, TopologyCountsNvlinkGroupsOnFreeGpus) {
  ClusterNode n = make_node("node-a", 4, 80 * kGiB, pairs);
  std::vector<NvlinkGroups> sizes = nvlink_tp_sizes(n.node.resources);
  ASSERT_EQ(sizes.size(), 2u);
  EXPECT_EQ(sizes[0].tp, 1);
  EXPECT_EQ(sizes[0].groups, 4);
  EXPECT_EQ(sizes[1].tp, 2);
  EXPECT_EQ(sizes[1].groups, 2);
  sizes = nvlink_tp_sizes(n.node.resources, {1});
  ASSERT_EQ(sizes.size(), 2u);
  EXPECT_EQ(sizes[1].groups, 1);
  const std::string text = render_topology("10.0.0.1:6380", {n});
  EXPECT_TRUE(contains(text, "  NVLink islands: gpu0 gpu1 | gpu2 gpu3\n")) << text;
  EXPECT_TRUE(contains(text, "  TP sizes on NVLink: 1 (4 groups), 2 (2 groups)\n")) << text;
  EXPECT_TRUE(contains(text, "  GPU0  X     NV4   PHB   PHB\n")) << text;
}

TEST(PlacementTest, TopologyJsonRoundTrips) {
  std::vector<ClusterNode> nodes = {make_node("node-a", 4, 80 * kGiB, pairs, {3}),
                                    make_node("cpu-b", 0, 0, nv18)};
  std::string json = topology_json("10.0.0.1:6380", nodes);
  auto back = parse_topology_json(json, "cluster.json");
  ASSERT_TRUE(back) << back.status().message();
  ASSERT_EQ(back->size(), 2u);
  const NodeResources& r = (*back)[0].node.resources;
  EXPECT_EQ((*back)[0].node.name, "node-a");
  EXPECT_EQ((*back)[0].busy_gpus, (std::vector<uint32_t>{3}));
  ASSERT_EQ(r.gpus.size(), 4u);
  EXPECT_EQ(r.gpus[2].memory_total, 80 * kGiB);
  EXPECT_EQ(format_link_matrix(r), format_link_matrix(nodes[0].node.resources));
  EXPECT_TRUE((*back)[1].node.resources.gpus.empty());
  auto bad = parse_topology_json(
      "{\"nodes\": [{\"gpus\": [{\"index\": 0, \"memory_total\": 1}],"
      " \"links\": [[\"NVX\"]]}]}",
      "c.json");
  ASSERT_FALSE(bad);
  EXPECT_TRUE(contains(bad.status().message(), "c.json: nodes[0]")) << bad.status().message();
  EXPECT_FALSE(parse_topology_json("[]", "c.json"));
}

// ---- -tp / -pp auto ---------------------------------------------------------------------------

EngineSpec auto_request() {
  EngineSpec req = model_spec();
  req.tensor_parallel_size = ParallelSize::automatic();
  req.pipeline_parallel_size = ParallelSize::automatic();
  return req;
}

TEST(AutoPlanTest, SmallModelTakesOneGpu) {
  std::vector<ClusterNode> nodes = {make_node("node-a", 8, 141 * kGiB, nv18)};
  auto cp = plan_on_cluster(llama3_8b(), auto_request(), nodes);
  ASSERT_TRUE(cp) << cp.status().message();
  EXPECT_EQ(cp->plan.tp, 1);
  EXPECT_EQ(cp->plan.pp, 1);
  EXPECT_TRUE(contains(cp->choice, "-tp auto -pp auto: chose -tp 1 -pp 1")) << cp->choice;
}

TEST(AutoPlanTest, SeventyBOnEightNvlinkGpusPrefersTpOverPp) {
  std::vector<ClusterNode> nodes = {make_node("node-a", 8, 80 * kGiB, nv18)};
  auto cp = plan_on_cluster(llama3_70b(), auto_request(), nodes);
  ASSERT_TRUE(cp) << cp.status().message();
  EXPECT_EQ(cp->plan.tp, 4);
  EXPECT_EQ(cp->plan.pp, 1);
  EXPECT_TRUE(cp->fit);
  EXPECT_GE(cp->memory.kv_tokens, kAutoMinSequences * 8192);
  // The line says why: T = 2 leaves too little KV room, and the group is on NVLink.
  EXPECT_TRUE(contains(cp->choice, "chose -tp 4 -pp 1")) << cp->choice;
  EXPECT_TRUE(contains(cp->choice, "(-tp 2 -pp 1: KV room for ")) << cp->choice;
  EXPECT_TRUE(contains(cp->choice, "TP groups on NVLink (NV18)")) << cp->choice;
}

TEST(AutoPlanTest, NvlinkPairsChooseTp2Pp2OverTp4) {
  std::vector<ClusterNode> nodes = {make_node("node-a", 4, 80 * kGiB, pairs)};
  auto cp = plan_on_cluster(llama3_70b(), auto_request(), nodes);
  ASSERT_TRUE(cp) << cp.status().message();
  EXPECT_EQ(cp->plan.tp, 2);
  EXPECT_EQ(cp->plan.pp, 2);
  EXPECT_TRUE(cp->warnings.empty());
}

TEST(AutoPlanTest, FixedTpWithAutoPp) {
  std::vector<ClusterNode> nodes = {make_node("node-a", 2, 80 * kGiB, nv18),
                                    make_node("node-b", 2, 80 * kGiB, nv18)};
  EngineSpec req = model_spec();
  req.tensor_parallel_size = ParallelSize{2};
  req.pipeline_parallel_size = ParallelSize::automatic();
  auto cp = plan_on_cluster(llama3_70b(), req, nodes);
  ASSERT_TRUE(cp) << cp.status().message();
  EXPECT_EQ(cp->plan.tp, 2);
  EXPECT_EQ(cp->plan.pp, 2);
  EXPECT_TRUE(contains(cp->choice, "-pp auto: chose -tp 2 -pp 2")) << cp->choice;
  EXPECT_EQ(format_stages(cp->placement, 2, 2),
            "stage 0: node-a gpu0 gpu1 [NV18]\nstage 1: node-b gpu0 gpu1 [NV18]\n");
}

TEST(AutoPlanTest, NothingFitsSaysSo) {
  std::vector<ClusterNode> nodes = {make_node("node-a", 1, 24 * kGiB, nv18)};
  auto cp = plan_on_cluster(llama3_70b(), auto_request(), nodes);
  ASSERT_TRUE(cp) << cp.status().message();
  EXPECT_FALSE(cp->fit);
  EXPECT_TRUE(contains(cp->choice, "no plan on this cluster fits")) << cp->choice;
  EXPECT_TRUE(contains(cp->fit.message(), "no -tp/-pp fits on this cluster's 1 free GPUs"))
      << cp->fit.message();
}

TEST(AutoPlanTest, AFixedPlanThatDoesNotFitNamesOneThatDoes) {
  std::vector<ClusterNode> nodes = {make_node("node-a", 8, 80 * kGiB, nv18)};
  EngineSpec req = model_spec();  // -tp 1 -pp 1
  auto cp = plan_on_cluster(llama3_70b(), req, nodes);
  ASSERT_TRUE(cp);
  ASSERT_FALSE(cp->fit);
  EXPECT_TRUE(contains(cp->fit.message(), "rank 0 (node-a gpu0)")) << cp->fit.message();
  EXPECT_TRUE(contains(cp->fit.message(), "; on this cluster -tp 2 -pp 1 fits ("))
      << cp->fit.message();
}

// ---- the printed plan -------------------------------------------------------------------------

TEST(RenderTest, Llama3_8bTp2) {
  std::vector<ClusterNode> nodes = synthetic_nodes(1, 2, 141 * kGiB);
  EngineSpec req = model_spec();
  req.tensor_parallel_size = ParallelSize{2};
  auto cp = plan_on_cluster(llama3_8b(), req, nodes);
  ASSERT_TRUE(cp) << cp.status().message();
  const std::string text = render_cluster_plan(llama3_8b(), *cp);
  EXPECT_TRUE(contains(text,
                       "Model: LlamaForCausalLM, 32 layers, hidden 4096, 32 heads (8 KV, "
                       "head_dim 128), intermediate 14336, vocab 128256; weights 14.96 GiB "
                       "in bfloat16\n"))
      << text;
  EXPECT_TRUE(contains(text, "Plan: -tp 2 -pp 1 = 2 ranks\n")) << text;
  EXPECT_TRUE(contains(text, "  layers per stage: 32 (0-31)\n")) << text;
  EXPECT_TRUE(contains(text, "KV heads: 8 split over -tp 2, 4 per rank")) << text;
  EXPECT_TRUE(contains(text, "  vocab: 128256 (no padding), 64128 rows per rank\n")) << text;
  EXPECT_TRUE(contains(text, "  stage 0: node-0 gpu0 gpu1 [NV18]\n")) << text;
  EXPECT_TRUE(contains(text, "max concurrency")) << text;
  EXPECT_TRUE(contains(text, "Fits.\n")) << text;
  EXPECT_FALSE(contains(text, "warning")) << text;
}

// Qwen3-30B-A3B on 4 GPUs with --enable-expert-parallel: each rank holds 32 whole experts of each
// of the 48 layers (a quarter of the experts' bytes, as the split experts would be), the plan
// says which; without the flag every rank holds a quarter of each expert.
TEST(RenderTest, ExpertParallelShowsWhichExpertsLiveWhere) {
  std::vector<ClusterNode> nodes = synthetic_nodes(1, 4, 141 * kGiB);
  EngineSpec req = model_spec();
  req.tensor_parallel_size = ParallelSize{4};
  req.enable_expert_parallel = true;
  auto cp = plan_on_cluster(qwen3_30b_a3b(), req, nodes);
  ASSERT_TRUE(cp) << cp.status().message();
  const uint64_t expert = 3ull * 768 * 2048 * 2;  // one expert's bf16 bytes
  for (const RankPlan& r : cp->plan.ranks) {
    EXPECT_TRUE(r.shard.parallel.expert_parallel);
    EXPECT_EQ(r.shard.experts, 32);
    EXPECT_EQ(r.shard.expert_begin, 32 * r.shard.parallel.tp_rank);
    EXPECT_EQ(r.shard.moe_intermediate, 768);
    EXPECT_GT(r.weight_bytes, 48 * 32 * expert);
  }
  std::string text = render_cluster_plan(qwen3_30b_a3b(), *cp);
  EXPECT_TRUE(contains(text,
                       "  experts: 128 per MoE layer (48 of 48 layers), top 8 per token; "
                       "expert parallel"))
      << text;
  EXPECT_TRUE(contains(text, "expert weights")) << text;
  EXPECT_TRUE(contains(text, " 96-127 ")) << text;
  EXPECT_TRUE(contains(text, format_gib(48 * 32 * expert))) << text;
  req.enable_expert_parallel = false;
  cp = plan_on_cluster(qwen3_30b_a3b(), req, nodes);
  ASSERT_TRUE(cp) << cp.status().message();
  text = render_cluster_plan(qwen3_30b_a3b(), *cp);
  EXPECT_TRUE(contains(text,
                       "each expert split over the 4 tensor-parallel ranks (moe "
                       "intermediate 192 per rank"))
      << text;
  EXPECT_TRUE(contains(text, "0-127 (1/4 each)")) << text;
  // A dense model with the flag is refused naming it.
  req.enable_expert_parallel = true;
  auto dense = plan_on_cluster(llama3_8b(), req, nodes);
  ASSERT_FALSE(dense);
  EXPECT_TRUE(contains(dense.status().message(),
                       "--enable-expert-parallel: LlamaForCausalLM has "
                       "no experts"))
      << dense.status().message();
}

// ---- flags ------------------------------------------------------------------------------------

TEST(FlagsTest, ShortSpellingsAreRewritten) {
  const char* argv[] = {"tessera", "plan", "-tp", "2", "-pp=4", "--model", "m", "--", "-tp"};
  ParallelFlagArgv fixed(9, argv);
  ASSERT_EQ(fixed.argc(), 9);
  EXPECT_STREQ(fixed.argv()[2], "--tensor-parallel-size");
  EXPECT_STREQ(fixed.argv()[4], "--pipeline-parallel-size=4");
  EXPECT_STREQ(fixed.argv()[8], "-tp");  // after "--": left alone
}

// vLLM's positional model: the first word after a model command becomes --model, after
// tessera's own flags too; other commands and a --model given as a flag are left alone.
TEST(FlagsTest, APositionalModelBecomesTheModelFlag) {
  using Args = std::vector<std::string>;
  EXPECT_EQ(positional_model_argv({"tessera", "serve", "/m", "-tp", "2"}),
            (Args{"tessera", "serve", "--model", "/m", "-tp", "2"}));
  EXPECT_EQ(positional_model_argv({"tessera", "--log-level", "info", "generate", "/m"}),
            (Args{"tessera", "--log-level", "info", "generate", "--model", "/m"}));
  EXPECT_EQ(positional_model_argv({"tessera", "--log-level=info", "plan", "/m"}),
            (Args{"tessera", "--log-level=info", "plan", "--model", "/m"}));
  EXPECT_EQ(positional_model_argv({"tessera", "bench", "latency", "/m", "--batch-size", "1"}),
            (Args{"tessera", "bench", "latency", "--model", "/m", "--batch-size", "1"}));
  for (const Args& same :
       {Args{"tessera", "serve", "--model", "/m"}, Args{"tessera", "serve"},
        Args{"tessera", "bench", "serve", "--model", "tiny"}, Args{"tessera", "bench", "latency"},
        Args{"tessera", "status"}, Args{"tessera", "make-model", "--out", "x"}}) {
    EXPECT_EQ(positional_model_argv(same), same) << same[1];
  }
}

// Parses `args` (after "x plan") into a fresh spec through the flags every model command has.
struct Parsed {
  EngineSpec spec;
  std::string error;  // CLI11's message when the flags were refused
  std::string trust_note;  // trust_remote_code_note of the parsed command line
};
Parsed parse_model_flags(std::vector<const char*> args) {
  CLI::App app;
  Parsed out;
  auto* cmd = app.add_subcommand("plan");
  add_model_options(cmd, out.spec);
  args.insert(args.begin(), {"x", "plan", "--model", "/m"});
  ParallelFlagArgv fixed(static_cast<int>(args.size()), args.data());
  try {
    app.parse(fixed.argc(), fixed.argv());
  } catch (const CLI::ParseError& e) {
    out.error = e.what();
  }
  out.trust_note = trust_remote_code_note(app);
  return out;
}

// The model flags of a vLLM tutorial's line, --trust-remote-code among them: taken, and the
// one that changes nothing here gets its note.
TEST(FlagsTest, TheTutorialsModelFlagsAreTaken) {
  Parsed p = parse_model_flags({"--tensor-parallel-size", "4", "--dtype", "half",
                                "--gpu-memory-utilization", "0.9", "--max-model-len", "32768",
                                "--quantization", "awq", "--trust-remote-code"});
  ASSERT_EQ(p.error, "");
  EXPECT_EQ(p.spec.tp(), 4);
  EXPECT_EQ(p.spec.dtype, "half");
  EXPECT_EQ(p.spec.max_model_len, 32768);
  EXPECT_EQ(p.spec.quantization, QuantMethod::kAwq);
  EXPECT_TRUE(validate(p.spec));
  EXPECT_EQ(p.trust_note.rfind("--trust-remote-code: Tessera executes no code from the model "
                               "directory",
                               0),
            0u)
      << p.trust_note;
  EXPECT_EQ(parse_model_flags({"-tp", "4"}).trust_note, "");
}

TEST(FlagsTest, ParallelSizesAreParsedAtTheFlag) {
  Parsed p =
      parse_model_flags({"-tp", "auto", "-pp", "3", "--pipeline-layer-partition", "10,12,10"});
  ASSERT_EQ(p.error, "");
  EXPECT_TRUE(p.spec.tensor_parallel_size.is_auto());
  EXPECT_EQ(p.spec.pp(), 3);
  EXPECT_EQ(p.spec.pipeline_layer_partition, (std::vector<int64_t>{10, 12, 10}));
  EXPECT_TRUE(contains(parse_model_flags({"-tp", "0"}).error,
                       "-tp/--tensor-parallel-size must be a positive integer or auto, got '0'"));
  EXPECT_TRUE(contains(parse_model_flags({"-tp", "2000"}).error, "at most 1024"));
  EXPECT_TRUE(contains(parse_model_flags({"--pipeline-layer-partition", "10,,12"}).error,
                       "each entry must be a layer count >= 1, got ''"));
  // Without -pp, the partition says how many stages; without either, one.
  Parsed only_partition = parse_model_flags({"--pipeline-layer-partition", "10,12,10"});
  EXPECT_EQ(only_partition.spec.tp(), 1);
  EXPECT_EQ(only_partition.spec.pp(), 3);
  EXPECT_EQ(parse_model_flags({}).spec.pp(), 1);
}

// --load-format (vLLM's): auto by default, dummy for weights made on the GPU; others refused.
TEST(FlagsTest, LoadFormatParses) {
  EXPECT_EQ(parse_model_flags({}).spec.load_format, LoadFormat::kAuto);
  Parsed dummy = parse_model_flags({"--load-format", "dummy"});
  ASSERT_EQ(dummy.error, "");
  EXPECT_EQ(dummy.spec.load_format, LoadFormat::kDummy);
  EXPECT_EQ(*parse_load_format(load_format_name(LoadFormat::kDummy)), LoadFormat::kDummy);
  EXPECT_TRUE(contains(parse_model_flags({"--load-format", "pt"}).error,
                       "--load-format 'pt' is not one of auto, dummy"));
}

TEST(FlagsTest, ModelFlagsParseIntoOneSpecAndAreValidatedOnce) {
  Parsed p = parse_model_flags({"-tp", "2", "-pp=3", "--dtype", "float16", "--device", "cpu",
                                "--max-model-len", "4096", "--gpu-memory-utilization", "0.5",
                                "--max-num-seqs", "8", "--max-num-batched-tokens", "64",
                                "--block-size", "32", "--enforce-eager", "--kv-cache-dtype",
                                "fp8"});
  ASSERT_EQ(p.error, "");
  const EngineSpec& spec = p.spec;
  EXPECT_EQ(spec.model, "/m");
  EXPECT_EQ(spec.tp(), 2);
  EXPECT_EQ(spec.pp(), 3);
  EXPECT_EQ(spec.dtype, "float16");
  EXPECT_EQ(spec.device, Device::kCpu);
  EXPECT_EQ(spec.max_model_len, 4096);
  EXPECT_DOUBLE_EQ(spec.gpu_memory_utilization, 0.5);
  EXPECT_EQ(spec.max_num_seqs, 8);
  EXPECT_EQ(spec.max_num_batched_tokens, 64);
  EXPECT_EQ(spec.block_size, 32);
  EXPECT_TRUE(spec.enforce_eager);
  EXPECT_EQ(spec.kv_cache_dtype, KvCacheDtype::kFp8E4M3);
  EXPECT_TRUE(validate(spec));
  EXPECT_FALSE(spec.resolved);
  EXPECT_TRUE(contains(parse_model_flags({"--device", "tpu"}).error, "--device 'tpu'"));

  // One validator: what the engine refuses, the planner refuses with the same words.
  EngineSpec bad = spec;
  bad.max_num_seqs = 0;
  auto st = validate(bad);
  ASSERT_FALSE(st);
  auto planned = plan_on_cluster(llama3_8b(), bad, synthetic_nodes(1, 2, 80 * kGiB));
  ASSERT_FALSE(planned);
  EXPECT_EQ(planned.status().message(), st.message());
  bad = spec;
  bad.max_num_batched_tokens = 8;
  EXPECT_TRUE(contains(validate(bad).message(), "--max-num-batched-tokens must be at least 16"));
  bad = spec;
  bad.block_size = 0;
  EXPECT_TRUE(contains(validate(bad).message(), "--block-size must be between 1 and 256"));
  bad = spec;
  bad.dtype = "int3";
  EXPECT_TRUE(contains(validate(bad).message(), "--dtype 'int3'"));
}

TEST(FlagsTest, ThePlanResolvesTheSpecOnce) {
  PlanOptions o;
  o.engine.model = "/m";
  o.engine.tensor_parallel_size = ParallelSize{2};
  o.engine.max_model_len = 4096;
  o.engine.gpu_memory_utilization = 0.8;
  o.engine.block_size = 32;
  auto cp = plan_on_cluster(llama3_8b(), o.engine, synthetic_nodes(2, 1, 80 * kGiB));
  ASSERT_TRUE(cp) << cp.status().message();
  EXPECT_EQ(cp->memory.engine.max_model_len, 4096);
  EXPECT_EQ(cp->memory.ranks[0].budget, static_cast<uint64_t>(0.8 * 80 * kGiB));
  // The plan's spec is the one the actors get: every value concrete.
  const EngineSpec& e = cp->engine;
  EXPECT_TRUE(check_resolved(e).is_ok()) << check_resolved(e).to_string();
  EXPECT_EQ(e.device, Device::kCuda);
  EXPECT_EQ(e.dtype, "bfloat16");
  EXPECT_EQ(e.tp(), 2);
  EXPECT_EQ(e.pp(), 1);
  EXPECT_EQ(e.pipeline_layer_partition, (std::vector<int64_t>{32}));
  EXPECT_EQ(e.max_model_len, 4096);
  EXPECT_EQ(e.max_num_batched_tokens, 4096);
  EXPECT_EQ(e.block_size, 32);
  EXPECT_FALSE(check_resolved(o.engine).is_ok());  // as given, it is not
  // Two one-GPU nodes: the TP group spans them, and -tp 1 -pp 2 is the better plan.
  EXPECT_EQ(format_stages(cp->placement, 2, 1), "stage 0: node-0 gpu0 + node-1 gpu0 [network]\n");
  ASSERT_TRUE(cp->better);
  EXPECT_EQ(cp->better->tp_size, 1);
  EXPECT_EQ(cp->better->pp_size, 2);
}

}  // namespace
}  // namespace tessera

namespace tessera {
namespace {

// -dp: each replica is planned where the ones before left room: on two one-GPU nodes, two
// replicas go one per node and a third does not fit, saying how many did and why; CPU replicas
// go to the node with the fewest actors.
TEST(PlacementTest, ReplicasArePlacedWhereTheOnesBeforeLeftRoom) {
  const std::vector<ClusterNode> two = {make_node("a", 1, 141 * kGiB, nv18),
                                        make_node("b", 1, 141 * kGiB, nv18)};
  EngineSpec spec = model_spec();
  ReplicaPlans r = plan_replicas(llama3_8b(), spec, two, 2);
  ASSERT_EQ(r.plans.size(), 2u);
  EXPECT_TRUE(r.failure.is_ok());
  EXPECT_EQ(r.fitting(), 2u);
  EXPECT_NE(r.plans[0].placement.ranks[0].node_id, r.plans[1].placement.ranks[0].node_id);

  r = plan_replicas(llama3_8b(), spec, two, 3);
  EXPECT_EQ(r.fitting(), 2u);
  ASSERT_FALSE(r.failure.is_ok());
  EXPECT_TRUE(contains(r.failure.message(), "0 of 1 free (busy: gpu0 (14.10 GiB free))"))
      << r.failure.message();

  spec.device = Device::kCpu;
  r = plan_replicas(llama3_8b(), spec, synthetic_nodes(3, 0, 0), 3);
  ASSERT_EQ(r.fitting(), 3u);
  std::set<std::string> nodes;
  for (const ClusterPlan& p : r.plans) nodes.insert(p.placement.ranks[0].node_id);
  EXPECT_EQ(nodes.size(), 3u);
}

}  // namespace
}  // namespace tessera

namespace tessera {
namespace {

// Two replicas at --gpu-memory-utilization 0.45 share one H200 (vLLM's per-instance rule: the
// second sees the first's budget in use and 0.55 free); at the default 0.9 the second does not
// fit, and the message names the busy GPU. -dp auto plans as many as fit: 2 at 0.45 (3 would
// need 1.35 of it), 1 at 0.9; CPU replicas one per node.
TEST(PlacementTest, ReplicasShareAGpuWhenItsFreeMemoryHoldsTheirBudget) {
  const std::vector<ClusterNode> one = {make_node("a", 1, 141 * kGiB, nv18)};
  EngineSpec spec = model_spec();
  spec.gpu_memory_utilization = 0.45;
  ReplicaPlans r = plan_replicas(llama3_8b(), spec, one, 2);
  ASSERT_EQ(r.fitting(), 2u) << r.failure.message();
  EXPECT_EQ(r.plans[1].placement.ranks[0].gpu, 0);
  // The second replica's budget is its 0.45, not less: the first's memory is not charged to it.
  EXPECT_EQ(r.plans[1].memory.ranks[0].budget, r.plans[0].memory.ranks[0].budget);

  r = plan_replicas(llama3_8b(), spec, one, 0);  // auto
  EXPECT_EQ(r.fitting(), 2u);
  EXPECT_TRUE(r.failure.is_ok());

  spec.gpu_memory_utilization = 0.9;
  r = plan_replicas(llama3_8b(), spec, one, 2);
  EXPECT_EQ(r.fitting(), 1u);
  EXPECT_TRUE(contains(r.failure.message(), "busy: gpu0")) << r.failure.message();
  r = plan_replicas(llama3_8b(), spec, one, 0);
  EXPECT_EQ(r.fitting(), 1u);
  EXPECT_TRUE(r.failure.is_ok());

  // A GPU another process fills is not shared: 100 of 141 GiB used leaves less than 0.45.
  std::vector<ClusterNode> used = one;
  used[0].busy_gpus = {0};
  used[0].node.resources.gpus[0].memory_used = 100 * kGiB;
  spec.gpu_memory_utilization = 0.45;
  auto refused = plan_on_cluster(llama3_8b(), spec, used);
  ASSERT_FALSE(refused);
  EXPECT_TRUE(contains(refused.status().message(), "busy: gpu0")) << refused.status().message();

  spec.device = Device::kCpu;
  r = plan_replicas(llama3_8b(), spec, synthetic_nodes(3, 0, 0), 0);
  EXPECT_EQ(r.fitting(), 3u);
}

}  // namespace
}  // namespace tessera

// ---- draining nodes (`tessera drain`) ------------------------------------------------------

namespace tessera {
namespace {

TEST(DrainPlacementTest, ADrainingNodeTakesNoRanks) {
  std::vector<ClusterNode> nodes = {make_node("node-a", 2, 80 * kGiB, nv18),
                                    make_node("node-b", 4, 80 * kGiB, nv18)};
  auto before = place_ranks(2, 2, nodes);
  ASSERT_TRUE(before) << before.status().message();
  EXPECT_EQ(format_stages(*before, 2, 2),
            "stage 0: node-b gpu0 gpu1 [NV18]\nstage 1: node-b gpu2 gpu3 [NV18]\n");

  nodes[1].node.draining = true;
  EXPECT_FALSE(nodes[1].node.takes_actors());
  auto p = place_ranks(2, 1, nodes);
  ASSERT_TRUE(p) << p.status().message();
  EXPECT_EQ(format_stages(*p, 2, 1), "stage 0: node-a gpu0 gpu1 [NV18]\n");
  // Its GPUs do not count, and the error says why they are missing.
  auto short_of_gpus = place_ranks(2, 2, nodes);
  ASSERT_FALSE(short_of_gpus);
  EXPECT_EQ(short_of_gpus.status().code(), Code::kResourceExhausted);
  EXPECT_TRUE(contains(short_of_gpus.status().message(),
                       "needs 4 GPUs but the cluster has 2 free (node-a: 2 of 2 free; draining, "
                       "so not used: node-b)"))
      << short_of_gpus.status().message();
  // Every node draining: nowhere to go, and the error names them.
  nodes[0].node.draining = true;
  auto nowhere = place_ranks(1, 1, nodes);
  ASSERT_FALSE(nowhere);
  EXPECT_EQ(nowhere.status().code(), Code::kFailedPrecondition);
  EXPECT_TRUE(contains(nowhere.status().message(), "draining: node-a, node-b"))
      << nowhere.status().message();
}

TEST(DrainPlacementTest, PlansSkipDrainingNodesForGpusAndCpuRanks) {
  // -tp auto counts only the free GPUs of nodes that take actors.
  std::vector<ClusterNode> nodes = {make_node("small", 1, 141 * kGiB, nv18),
                                    make_node("big", 8, 141 * kGiB, nv18)};
  nodes[1].node.draining = true;
  EngineSpec req = model_spec();
  req.tensor_parallel_size = ParallelSize::automatic();
  auto cp = plan_on_cluster(llama3_8b(), req, nodes);
  ASSERT_TRUE(cp) << cp.status().message();
  EXPECT_EQ(cp->plan.tp, 1);
  for (const PlacedRank& r : cp->placement.ranks) EXPECT_EQ(r.node_name, "small");

  // A draining GPU node leaves a cluster of CPU nodes: --device auto plans CPU ranks.
  std::vector<ClusterNode> mixed = {make_node("gpu-node", 2, 80 * kGiB, nv18),
                                    make_node("cpu-node", 0, 0, nv18)};
  mixed[0].node.draining = true;
  cp = plan_on_cluster(llama3_8b(), model_spec(), mixed);
  ASSERT_TRUE(cp) << cp.status().message();
  EXPECT_TRUE(cp->placement.cpu);
  for (const PlacedRank& r : cp->placement.ranks) EXPECT_EQ(r.node_name, "cpu-node");

  // CPU ranks spread over the nodes that take actors only.
  std::vector<ClusterNode> cpus = synthetic_nodes(3, 0, 0);
  cpus[1].node.draining = true;
  auto spread = place_ranks(1, 3, cpus);
  ASSERT_TRUE(spread) << spread.status().message();
  for (const PlacedRank& r : spread->ranks) EXPECT_NE(r.node_name, "node-1");
}

TEST(DrainPlacementTest, TheMarkTravelsThroughStatusAndTopologyJson) {
  ClusterStatus status;
  NodeStatus ns;
  ns.node = make_node("node-a", 1, 80 * kGiB, nv18).node;
  ns.node.draining = true;
  status.nodes.push_back(ns);
  std::vector<ClusterNode> nodes = cluster_nodes(status);
  ASSERT_EQ(nodes.size(), 1u);
  EXPECT_TRUE(nodes[0].node.draining);
  EXPECT_TRUE(contains(render_topology("10.0.0.1:6380", nodes), "[draining: no new ranks]"));
  auto back = parse_topology_json(topology_json("10.0.0.1:6380", nodes), "cluster.json");
  ASSERT_TRUE(back) << back.status().message();
  ASSERT_EQ(back->size(), 1u);
  EXPECT_TRUE((*back)[0].node.draining);
  // A file without the field (an older `topo --json`) means not draining.
  auto old = parse_topology_json("{\"nodes\": [{\"name\": \"x\", \"cpus\": 4}]}", "old.json");
  ASSERT_TRUE(old) << old.status().message();
  EXPECT_FALSE((*old)[0].node.draining);
}

}  // namespace
}  // namespace tessera
