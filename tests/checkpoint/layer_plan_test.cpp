// LayerPlan::make on its own, on a small model whose numbers can be checked by hand: each rank's
// heads, KV heads (split and replicated), MLP slice and vocabulary shard, the o_proj bias, the
// [begin, end) of every weight shard, the layers of each pipeline stage and what the first and
// last stages hold, and the refusals with the numbers they name. (tests/plan covers the same
// rules through the parallel planner, on real model shapes.)
#include "common/checkpoint/layer_plan.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace tessera {
namespace {

// 8 query heads, 2 KV heads of 8 dims, hidden 64, MLP 96, 5 layers, an odd vocabulary.
ModelConfig small() {
  ModelConfig c;
  c.arch = Architecture::kLlama;
  c.model_type = "llama";
  c.vocab_size = 1001;
  c.hidden_size = 64;
  c.intermediate_size = 96;
  c.num_layers = 5;
  c.num_heads = 8;
  c.num_kv_heads = 2;
  c.head_dim = 8;
  c.max_position_embeddings = 256;
  return c;
}

ParallelConfig rank(int tp_size, int tp_rank, int pp_size = 1, int pp_rank = 0,
                    std::vector<int64_t> partition = {}) {
  ParallelConfig p;
  p.tp_size = tp_size;
  p.tp_rank = tp_rank;
  p.pp_size = pp_size;
  p.pp_rank = pp_rank;
  p.layer_partition = std::move(partition);
  return p;
}

LayerPlan must_make(const ModelConfig& c, const ParallelConfig& p) {
  Expected<LayerPlan> plan = LayerPlan::make(c, p);
  EXPECT_TRUE(plan) << plan.status().message();
  return plan ? *plan : LayerPlan{};
}

// The message LayerPlan::make refuses `p` with ("" when it does not).
std::string refusal(const ModelConfig& c, const ParallelConfig& p) {
  Expected<LayerPlan> plan = LayerPlan::make(c, p);
  if (plan) return "";
  EXPECT_EQ(plan.status().code(), Code::kInvalidArgument);
  return plan.status().message();
}

const WeightShard* find(const LayerPlan& plan, const std::string& name) {
  for (const WeightShard& w : plan.weights) {
    if (w.spec.name == name) return &w;
  }
  return nullptr;
}

// {begin, end} of the named shard; {-1, -1} when the rank does not hold it.
std::pair<int64_t, int64_t> range(const LayerPlan& plan, const std::string& name) {
  const WeightShard* w = find(plan, name);
  return w == nullptr ? std::pair<int64_t, int64_t>{-1, -1}
                      : std::pair<int64_t, int64_t>{w->begin, w->end};
}

std::vector<int64_t> shape(const LayerPlan& plan, const std::string& name) {
  const WeightShard* w = find(plan, name);
  return w == nullptr ? std::vector<int64_t>{} : w->shape();
}

using Range = std::pair<int64_t, int64_t>;
using Shape = std::vector<int64_t>;
const std::string kL1 = "model.layers.1.";

// ---- tensor parallel --------------------------------------------------------------------------

TEST(LayerPlanTest, OneRankHoldsEveryTensorWhole) {
  ModelConfig c = small();
  c.attention_bias = true;
  c.o_proj_bias = true;
  c.qk_norm = true;
  LayerPlan p = must_make(c, rank(1, 0));
  std::vector<WeightSpec> all = expected_weights(c);
  ASSERT_EQ(p.weights.size(), all.size());
  for (size_t i = 0; i < all.size(); ++i) {
    EXPECT_EQ(p.weights[i].spec.name, all[i].name);
    EXPECT_EQ(p.weights[i].shape(), all[i].shape) << all[i].name;
    EXPECT_EQ(p.weights[i].begin, 0) << all[i].name;
  }
  EXPECT_EQ(p.heads, 8);
  EXPECT_EQ(p.kv_heads, 2);
  EXPECT_EQ(p.intermediate, 96);
  EXPECT_EQ(p.vocab_padded, 1001);
  EXPECT_EQ(p.vocab_rows, 1001);
  EXPECT_TRUE(p.o_bias);
  EXPECT_TRUE(p.first_stage && p.last_stage);
  EXPECT_EQ(p.layer_begin, 0);
  EXPECT_EQ(p.layer_end, 5);
}

TEST(LayerPlanTest, TwoRanksSplitHeadsKvHeadsAndTheMlp) {
  ModelConfig c = small();
  c.qk_norm = true;
  LayerPlan p = must_make(c, rank(2, 1));
  EXPECT_EQ(p.heads, 4);
  EXPECT_EQ(p.head_begin, 4);
  EXPECT_EQ(p.kv_heads, 1);
  EXPECT_EQ(p.kv_head_begin, 1);
  EXPECT_EQ(p.intermediate, 48);
  EXPECT_EQ(p.intermediate_begin, 48);
  // Column-parallel: output rows of this rank's heads (8 dims each) and MLP slice.
  EXPECT_EQ(range(p, kL1 + "self_attn.q_proj.weight"), (Range{32, 64}));
  EXPECT_EQ(shape(p, kL1 + "self_attn.q_proj.weight"), (Shape{32, 64}));
  EXPECT_EQ(range(p, kL1 + "self_attn.k_proj.weight"), (Range{8, 16}));
  EXPECT_EQ(shape(p, kL1 + "self_attn.v_proj.weight"), (Shape{8, 64}));
  EXPECT_EQ(range(p, kL1 + "mlp.gate_proj.weight"), (Range{48, 96}));
  EXPECT_EQ(shape(p, kL1 + "mlp.up_proj.weight"), (Shape{48, 64}));
  // Row-parallel: input columns.
  EXPECT_EQ(range(p, kL1 + "self_attn.o_proj.weight"), (Range{32, 64}));
  EXPECT_EQ(shape(p, kL1 + "self_attn.o_proj.weight"), (Shape{64, 32}));
  EXPECT_EQ(range(p, kL1 + "mlp.down_proj.weight"), (Range{48, 96}));
  EXPECT_EQ(shape(p, kL1 + "mlp.down_proj.weight"), (Shape{64, 48}));
  // Replicated: whole.
  EXPECT_EQ(range(p, kL1 + "input_layernorm.weight"), (Range{0, 64}));
  EXPECT_EQ(range(p, kL1 + "self_attn.q_norm.weight"), (Range{0, 8}));
  EXPECT_EQ(shape(p, "model.norm.weight"), (Shape{64}));
}

TEST(LayerPlanTest, KvHeadsAreReplicatedToTheRanksWhoseQueryHeadsReadThem) {
  const ModelConfig c = small();  // 8 query heads in 2 groups of 4, one group per KV head
  std::vector<int64_t> tp4, tp8;
  for (int r = 0; r < 4; ++r) {
    LayerPlan p = must_make(c, rank(4, r));
    EXPECT_EQ(p.heads, 2);
    EXPECT_EQ(p.kv_heads, 1);
    EXPECT_EQ(p.head_begin / 4, p.kv_head_begin);
    EXPECT_EQ(range(p, kL1 + "self_attn.k_proj.weight"),
              (Range{p.kv_head_begin * 8, p.kv_head_begin * 8 + 8}));
    EXPECT_EQ(range(p, kL1 + "self_attn.q_proj.weight"), (Range{16 * r, 16 * r + 16}));
    tp4.push_back(p.kv_head_begin);
  }
  for (int r = 0; r < 8; ++r) tp8.push_back(must_make(c, rank(8, r)).kv_head_begin);
  EXPECT_EQ(tp4, (std::vector<int64_t>{0, 0, 1, 1}));
  EXPECT_EQ(tp8, (std::vector<int64_t>{0, 0, 0, 0, 1, 1, 1, 1}));
  // One KV head (multi-query): every rank keeps it.
  ModelConfig mqa = small();
  mqa.num_kv_heads = 1;
  for (int r = 0; r < 4; ++r) {
    LayerPlan p = must_make(mqa, rank(4, r));
    EXPECT_EQ(p.kv_heads, 1);
    EXPECT_EQ(p.kv_head_begin, 0);
    EXPECT_EQ(range(p, kL1 + "self_attn.v_proj.weight"), (Range{0, 8}));
  }
}

TEST(LayerPlanTest, BiasesSplitWithTheirRowsAndOnlyTpRankZeroAddsTheOProjBias) {
  ModelConfig c = small();
  c.attention_bias = true;
  c.o_proj_bias = true;
  LayerPlan r0 = must_make(c, rank(2, 0));
  LayerPlan r1 = must_make(c, rank(2, 1));
  EXPECT_TRUE(r0.o_bias);
  EXPECT_FALSE(r1.o_bias);
  EXPECT_EQ(range(r0, kL1 + "self_attn.o_proj.bias"), (Range{0, 64}));  // whole, on rank 0
  EXPECT_EQ(find(r1, kL1 + "self_attn.o_proj.bias"), nullptr);
  EXPECT_EQ(range(r1, kL1 + "self_attn.q_proj.bias"), (Range{32, 64}));
  EXPECT_EQ(shape(r1, kL1 + "self_attn.q_proj.bias"), (Shape{32}));
  EXPECT_EQ(range(r1, kL1 + "self_attn.k_proj.bias"), (Range{8, 16}));
  EXPECT_EQ(range(r1, kL1 + "self_attn.v_proj.bias"), (Range{8, 16}));
  // The two ranks differ by exactly the o_proj biases of the 5 layers.
  EXPECT_EQ(r0.weights.size(), r1.weights.size() + 5);
  // Qwen2-style: q/k/v biases, no o_proj bias, so no rank adds one.
  c.o_proj_bias = false;
  EXPECT_FALSE(must_make(c, rank(2, 0)).o_bias);
  EXPECT_EQ(find(must_make(c, rank(2, 0)), kL1 + "self_attn.o_proj.bias"), nullptr);
}

TEST(LayerPlanTest, TheVocabularyIsPaddedAndTheLastRanksHoldThePadding) {
  const ModelConfig c = small();  // 1001 tokens over 4 ranks: 1004 rows, 251 per rank
  std::vector<Range> embed, lm_head;
  for (int r = 0; r < 4; ++r) {
    LayerPlan p = must_make(c, rank(4, r));
    EXPECT_EQ(p.vocab_padded, 1004);
    EXPECT_EQ(p.vocab_shard, 251);
    EXPECT_EQ(p.vocab_begin, 251 * r);
    EXPECT_EQ(p.vocab_rows, r < 3 ? 251 : 248);
    embed.push_back(range(p, "model.embed_tokens.weight"));
    lm_head.push_back(range(p, "lm_head.weight"));
  }
  // The checkpoint rows each rank reads: the padding is not in the checkpoint.
  const std::vector<Range> rows = {{0, 251}, {251, 502}, {502, 753}, {753, 1001}};
  EXPECT_EQ(embed, rows);
  EXPECT_EQ(lm_head, rows);
  EXPECT_EQ(shape(must_make(c, rank(4, 3)), "lm_head.weight"), (Shape{248, 64}));

  // A vocabulary smaller than the ranks: ranks past it hold padding only, an empty slice that
  // starts at the vocabulary's end.
  ModelConfig tiny = small();
  tiny.vocab_size = 5;
  std::vector<int64_t> held;
  for (int r = 0; r < 8; ++r) {
    LayerPlan p = must_make(tiny, rank(8, r));
    EXPECT_EQ(p.vocab_padded, 8);
    EXPECT_EQ(p.vocab_shard, 1);
    held.push_back(p.vocab_rows);
    const Range e = range(p, "model.embed_tokens.weight");
    EXPECT_EQ(e.first, std::min<int64_t>(r, 5)) << "rank " << r;
    EXPECT_EQ(e.second - e.first, p.vocab_rows) << "rank " << r;
  }
  EXPECT_EQ(held, (std::vector<int64_t>{1, 1, 1, 1, 1, 0, 0, 0}));
}

TEST(LayerPlanTest, WeightBytesAreTheShardsAddedUp) {
  const ModelConfig c = small();
  // Per layer at -tp 2: q 32x64, k and v 8x64, o 64x32, gate and up 48x64, down 64x48, two
  // norms of 64.
  const uint64_t layer = 32 * 64 + 2 * 8 * 64 + 64 * 32 + 3 * 48 * 64 + 2 * 64;
  // Rank 0 reads vocabulary rows [0, 501), rank 1 [501, 1001): embedding and lm_head each.
  EXPECT_EQ(must_make(c, rank(2, 0)).weight_bytes(DType::kBF16),
            2 * (5 * layer + 2 * 501 * 64 + 64));
  EXPECT_EQ(must_make(c, rank(2, 1)).weight_bytes(DType::kF32),
            4 * (5 * layer + 2 * 500 * 64 + 64));
  // Tied: the embedding is the lm_head, counted once.
  ModelConfig tied = c;
  tied.tie_word_embeddings = true;
  EXPECT_EQ(must_make(tied, rank(2, 1)).weight_bytes(DType::kBF16),
            2 * (5 * layer + 500 * 64 + 64));
}

// ---- pipeline parallel ------------------------------------------------------------------------

std::vector<Range> stages_of(const ModelConfig& c, int pp, std::vector<int64_t> partition = {}) {
  std::vector<Range> out;
  for (int s = 0; s < pp; ++s) {
    LayerPlan p = must_make(c, rank(1, 0, pp, s, partition));
    EXPECT_EQ(p.first_stage, s == 0);
    EXPECT_EQ(p.last_stage, s == pp - 1);
    // Exactly the stage's layers' tensors.
    for (const WeightShard& w : p.weights) {
      if (w.spec.layer < 0) continue;
      EXPECT_GE(w.spec.layer, p.layer_begin) << w.spec.name;
      EXPECT_LT(w.spec.layer, p.layer_end) << w.spec.name;
    }
    EXPECT_NE(find(p, "model.layers." + std::to_string(p.layer_begin) + ".mlp.down_proj.weight"),
              nullptr);
    out.emplace_back(p.layer_begin, p.layer_end);
  }
  return out;
}

TEST(LayerPlanTest, LayersSplitEvenlyWithTheRemainderOnTheFirstStages) {
  const ModelConfig c = small();
  EXPECT_EQ(stages_of(c, 1), (std::vector<Range>{{0, 5}}));
  EXPECT_EQ(stages_of(c, 2), (std::vector<Range>{{0, 3}, {3, 5}}));
  EXPECT_EQ(stages_of(c, 3), (std::vector<Range>{{0, 2}, {2, 4}, {4, 5}}));
  EXPECT_EQ(stages_of(c, 5), (std::vector<Range>{{0, 1}, {1, 2}, {2, 3}, {3, 4}, {4, 5}}));
  EXPECT_EQ(must_make(c, rank(1, 0, 3, 1)).num_layers(), 2);
}

TEST(LayerPlanTest, AnExplicitPartitionIsFollowed) {
  const ModelConfig c = small();
  EXPECT_EQ(stages_of(c, 3, {1, 3, 1}), (std::vector<Range>{{0, 1}, {1, 4}, {4, 5}}));
  EXPECT_EQ(stages_of(c, 2, {4, 1}), (std::vector<Range>{{0, 4}, {4, 5}}));
}

TEST(LayerPlanTest, TheFirstStageHoldsTheEmbeddingTheLastTheNormAndLmHead) {
  ModelConfig c = small();
  LayerPlan first = must_make(c, rank(2, 1, 3, 0));
  LayerPlan middle = must_make(c, rank(2, 1, 3, 1));
  LayerPlan last = must_make(c, rank(2, 1, 3, 2));
  EXPECT_EQ(range(first, "model.embed_tokens.weight"), (Range{501, 1001}));
  EXPECT_EQ(find(first, "model.norm.weight"), nullptr);
  EXPECT_EQ(find(first, "lm_head.weight"), nullptr);
  for (const WeightShard& w : middle.weights) EXPECT_GE(w.spec.layer, 0) << w.spec.name;
  EXPECT_EQ(find(last, "model.embed_tokens.weight"), nullptr);
  EXPECT_EQ(range(last, "lm_head.weight"), (Range{501, 1001}));
  EXPECT_EQ(range(last, "model.norm.weight"), (Range{0, 64}));
  // Tied embeddings: the last stage reads the embedding as its lm_head; there is no lm_head.
  c.tie_word_embeddings = true;
  LayerPlan tied_last = must_make(c, rank(2, 1, 3, 2));
  EXPECT_EQ(range(tied_last, "model.embed_tokens.weight"), (Range{501, 1001}));
  EXPECT_EQ(find(tied_last, "lm_head.weight"), nullptr);
  EXPECT_EQ(find(must_make(c, rank(2, 1, 3, 1)), "model.embed_tokens.weight"), nullptr);
}

// ---- refusals ---------------------------------------------------------------------------------

TEST(LayerPlanTest, BadPartitionsAreRefusedNamingTheNumbers) {
  const ModelConfig c = small();
  EXPECT_EQ(refusal(c, rank(1, 0, 3, 0, {2, 2, 2})),
            "--pipeline-layer-partition adds up to 6 layers, the model has 5");
  EXPECT_EQ(refusal(c, rank(1, 0, 3, 0, {2, 3})),
            "--pipeline-layer-partition has 2 stages, but --pipeline-parallel-size is 3");
  EXPECT_EQ(refusal(c, rank(1, 0, 3, 2, {3, 2, 0})),
            "--pipeline-layer-partition: every stage needs at least one layer, got 0");
  EXPECT_EQ(refusal(c, rank(1, 0, 2, 0, {6, -1})),
            "--pipeline-layer-partition: every stage needs at least one layer, got -1");
  EXPECT_EQ(refusal(c, rank(1, 0, 6, 0)),
            "--pipeline-parallel-size 6 is more than the model's 5 layers: every stage needs at "
            "least one");
  Expected<std::vector<std::pair<int64_t, int64_t>>> none = stage_layers(5, 0, {});
  ASSERT_FALSE(none);
  EXPECT_EQ(none.status().message(), "--pipeline-parallel-size must be at least 1, got 0");
}

TEST(LayerPlanTest, RanksOutsideTheGridAreRefused) {
  const ModelConfig c = small();
  EXPECT_EQ(refusal(c, rank(2, 2)), "rank (tp 2, pp 0) is outside 2 x 1");
  EXPECT_EQ(refusal(c, rank(2, 0, 2, 2)), "rank (tp 0, pp 2) is outside 2 x 2");
  EXPECT_EQ(refusal(c, rank(2, -1)), "rank (tp -1, pp 0) is outside 2 x 1");
}

TEST(LayerPlanTest, ATpThatDoesNotSplitTheModelIsRefusedWithTheValidOnes) {
  const ModelConfig c = small();
  EXPECT_EQ(refusal(c, rank(3, 0)),
            "-tp 3: the model's 8 attention heads do not split over 3 ranks (8 % 3 = 2); valid "
            "-tp values for this model: 1, 2, 4, 8");
  EXPECT_EQ(refusal(c, rank(0, 0)),
            "-tp must be at least 1, got 0; valid -tp values for this model: 1, 2, 4, 8");

  // 3 KV heads over 12 query heads: 2 and 4 ranks neither split nor replicate them.
  ModelConfig odd_kv = small();
  odd_kv.num_heads = 12;
  odd_kv.num_kv_heads = 3;
  Status st = check_tensor_parallel(odd_kv, 4);
  ASSERT_FALSE(st);
  EXPECT_EQ(st.code(), Code::kInvalidArgument);
  EXPECT_EQ(st.message(),
            "-tp 4: the model's 3 KV heads neither split over 4 ranks (3 % 4 = 3) nor replicate "
            "evenly (4 is not a multiple of 3); valid -tp values for this model: 1, 3, 6, 12");
  EXPECT_EQ(valid_tensor_parallel_sizes(odd_kv, 24), (std::vector<int64_t>{1, 3, 6, 12}));
  EXPECT_TRUE(check_tensor_parallel(odd_kv, 6));  // 6 ranks, each pair sharing a KV head
  LayerPlan six = must_make(odd_kv, rank(6, 5));
  EXPECT_EQ(six.heads, 2);
  EXPECT_EQ(six.kv_heads, 1);
  EXPECT_EQ(six.kv_head_begin, 2);

  ModelConfig mlp = small();
  mlp.intermediate_size = 100;
  EXPECT_EQ(check_tensor_parallel(mlp, 8).message(),
            "-tp 8: intermediate_size 100 does not split over 8 ranks (100 % 8 = 4); valid -tp "
            "values for this model: 1, 2, 4");
  EXPECT_EQ(valid_tensor_parallel_sizes(mlp, 8), (std::vector<int64_t>{1, 2, 4}));
  EXPECT_EQ(valid_tensor_parallel_sizes(c, 2), (std::vector<int64_t>{1, 2}));  // capped at max
  EXPECT_TRUE(valid_tensor_parallel_sizes(c, 0).empty());
}

TEST(LayerPlanTest, FusedGroups) {
  for (WeightKind k : {WeightKind::kQ, WeightKind::kK, WeightKind::kV, WeightKind::kQBias,
                       WeightKind::kKBias, WeightKind::kVBias}) {
    EXPECT_STREQ(fused_group(k), "qkv");
  }
  EXPECT_STREQ(fused_group(WeightKind::kGate), "gate_up");
  EXPECT_STREQ(fused_group(WeightKind::kUp), "gate_up");
  for (WeightKind k : {WeightKind::kO, WeightKind::kOBias, WeightKind::kDown, WeightKind::kEmbed,
                       WeightKind::kLmHead, WeightKind::kInputNorm, WeightKind::kQNorm}) {
    EXPECT_STREQ(fused_group(k), "");
  }
}

// ---- quantized checkpoints -------------------------------------------------------------------

// A Llama whose widths split into AWQ / GPTQ groups of 32 at tp 2 but not 4: q 256 wide,
// intermediate 192 (96 per rank at tp 2: three groups; 48 at tp 4: not whole groups).
ModelConfig quantized(QuantMethod method, bool desc_act = false) {
  ModelConfig c = small();
  c.hidden_size = 256;
  c.num_heads = 8;
  c.num_kv_heads = 4;
  c.head_dim = 32;
  c.intermediate_size = 192;
  c.quant.method = method;
  c.quant.bits = method == QuantMethod::kFp8 ? 8 : 4;
  c.quant.group_size = method == QuantMethod::kFp8 ? 0 : 32;
  c.quant.desc_act = desc_act;
  c.quant.sym = method == QuantMethod::kGptq;
  return c;
}

const WeightSpec* spec(const std::vector<WeightSpec>& table, const std::string& name) {
  for (const WeightSpec& w : table) {
    if (w.name == name) return &w;
  }
  return nullptr;
}

TEST(LayerPlanTest, QuantizedTablesNameEachFormatsTensors) {
  const std::string q = "model.layers.0.self_attn.q_proj.";
  const std::string down = "model.layers.0.mlp.down_proj.";
  auto awq = expected_weights(quantized(QuantMethod::kAwq));
  EXPECT_EQ(spec(awq, q + "weight"), nullptr) << "a quantized layer has no plain weight";
  ASSERT_NE(spec(awq, q + "qweight"), nullptr);
  EXPECT_EQ(spec(awq, q + "qweight")->shape, (std::vector<int64_t>{256, 256 / 8}));
  EXPECT_EQ(spec(awq, q + "qzeros")->shape, (std::vector<int64_t>{256 / 32, 256 / 8}));
  EXPECT_EQ(spec(awq, q + "scales")->shape, (std::vector<int64_t>{256 / 32, 256}));
  EXPECT_EQ(spec(awq, q + "qweight")->dtype, DType::kI32);
  EXPECT_FALSE(spec(awq, q + "scales")->dtype.has_value());
  EXPECT_EQ(spec(awq, down + "qweight")->shape, (std::vector<int64_t>{192, 256 / 8}));
  // Embedding, norms and lm_head stay plain.
  EXPECT_NE(spec(awq, "lm_head.weight"), nullptr);
  EXPECT_NE(spec(awq, "model.layers.0.input_layernorm.weight"), nullptr);

  auto gptq = expected_weights(quantized(QuantMethod::kGptq));
  EXPECT_EQ(spec(gptq, q + "qweight")->shape, (std::vector<int64_t>{256 / 8, 256}));
  EXPECT_EQ(spec(gptq, q + "qzeros")->shape, (std::vector<int64_t>{256 / 32, 256 / 8}));
  EXPECT_EQ(spec(gptq, q + "g_idx")->shape, (std::vector<int64_t>{256}));

  auto fp8 = expected_weights(quantized(QuantMethod::kFp8));
  EXPECT_EQ(spec(fp8, q + "weight")->dtype, DType::kF8E4M3);
  EXPECT_TRUE(spec(fp8, q + "weight_scale")->any_scale_shape);
  EXPECT_EQ(spec(fp8, q + "input_scale"), nullptr) << "dynamic activations have no scale";

  // A module left unquantized keeps its plain weight.
  ModelConfig mixed = quantized(QuantMethod::kAwq);
  mixed.quant.ignored = {"model.layers.0.mlp.down_proj"};
  auto m = expected_weights(mixed);
  EXPECT_NE(spec(m, down + "weight"), nullptr);
  EXPECT_EQ(spec(m, down + "qweight"), nullptr);
  EXPECT_NE(spec(m, "model.layers.1.mlp.down_proj.qweight"), nullptr);
}

TEST(LayerPlanTest, PackedShardsCutWholeInt32sAndGroups) {
  const ModelConfig c = quantized(QuantMethod::kAwq);
  const LayerPlan r1 = must_make(c, rank(2, 1));
  auto shape = [&](const LayerPlan& p, const std::string& n) {
    const WeightShard* s = find(p, n);
    return s ? s->shape() : std::vector<int64_t>{};
  };
  const std::string l = "model.layers.0.";
  // Column-parallel q (its output features split): AWQ packs 8 outputs per int32.
  EXPECT_EQ(shape(r1, l + "self_attn.q_proj.qweight"), (std::vector<int64_t>{256, 128 / 8}));
  EXPECT_EQ(shape(r1, l + "self_attn.q_proj.scales"), (std::vector<int64_t>{8, 128}));
  // Row-parallel down (its inputs split): scales and zeros by group.
  EXPECT_EQ(shape(r1, l + "mlp.down_proj.qweight"), (std::vector<int64_t>{96, 256 / 8}));
  EXPECT_EQ(shape(r1, l + "mlp.down_proj.qzeros"), (std::vector<int64_t>{3, 256 / 8}));
  EXPECT_EQ(find(r1, l + "mlp.down_proj.qzeros")->begin, 96);

  // GPTQ: qweight packs inputs; desc_act keeps a row-parallel layer's scales and zeros whole.
  const LayerPlan g = must_make(quantized(QuantMethod::kGptq), rank(2, 1));
  EXPECT_EQ(shape(g, l + "mlp.down_proj.qweight"), (std::vector<int64_t>{96 / 8, 256}));
  EXPECT_EQ(shape(g, l + "mlp.down_proj.scales"), (std::vector<int64_t>{3, 256}));
  EXPECT_EQ(shape(g, l + "mlp.down_proj.g_idx"), (std::vector<int64_t>{96}));
  EXPECT_EQ(shape(g, l + "self_attn.q_proj.g_idx"), (std::vector<int64_t>{256}));
  const LayerPlan d = must_make(quantized(QuantMethod::kGptq, true), rank(2, 1));
  EXPECT_EQ(shape(d, l + "mlp.down_proj.scales"), (std::vector<int64_t>{6, 256}));
  EXPECT_EQ(shape(d, l + "mlp.down_proj.qzeros"), (std::vector<int64_t>{6, 256 / 8}));
}

TEST(LayerPlanTest, ATensorParallelSizeThatSplitsAGroupIsRefusedWithTheValidOnes) {
  const ModelConfig c = quantized(QuantMethod::kAwq);
  EXPECT_EQ(valid_tensor_parallel_sizes(c, 8), (std::vector<int64_t>{1, 2}));
  const std::string why = refusal(c, rank(4, 0));
  EXPECT_NE(why.find("-tp 4 splits a quantization group"), std::string::npos) << why;
  EXPECT_NE(why.find("48 input features per rank"), std::string::npos) << why;
  EXPECT_NE(why.find("valid -tp values for this model: 1, 2"), std::string::npos) << why;
  // desc_act: GPTQ's row-parallel groups are not split, so only the int32 packing binds.
  EXPECT_EQ(valid_tensor_parallel_sizes(quantized(QuantMethod::kGptq, true), 8),
            (std::vector<int64_t>{1, 2, 4, 8}));
  // FP8 splits like the plain model.
  ModelConfig plain = quantized(QuantMethod::kFp8);
  plain.quant = QuantConfig{};
  EXPECT_EQ(valid_tensor_parallel_sizes(plain, 8), (std::vector<int64_t>{1, 2, 4, 8}));
  EXPECT_EQ(valid_tensor_parallel_sizes(quantized(QuantMethod::kFp8), 8),
            valid_tensor_parallel_sizes(plain, 8));
}
// ---- mixture of experts -----------------------------------------------------------------------

// small() as a Qwen2-MoE: 4 experts of width 40, a shared expert of 24, layer 2 dense (96).
ModelConfig small_moe() {
  ModelConfig c = small();
  c.arch = Architecture::kQwen2Moe;
  c.model_type = "qwen2_moe";
  c.moe.num_experts = 4;
  c.moe.top_k = 2;
  c.moe.expert_intermediate = 40;
  c.moe.shared_intermediate = 24;
  c.moe.mlp_only_layers = {2};
  return c;
}

// vLLM's TP MoE: every rank holds every expert's slice (gate/up rows, down columns), the router
// and the shared expert's gate whole; a dense layer among them splits as before.
TEST(LayerPlanTest, EveryRankHoldsEveryExpertsSlice) {
  const ModelConfig c = small_moe();
  LayerPlan p = must_make(c, rank(2, 1));
  EXPECT_EQ(p.moe_intermediate, 20);
  EXPECT_EQ(p.moe_intermediate_begin, 20);
  EXPECT_EQ(p.shared_intermediate, 12);
  EXPECT_EQ(p.shared_intermediate_begin, 12);
  for (int e = 0; e < 4; ++e) {
    const std::string x = kL1 + "mlp.experts." + std::to_string(e) + ".";
    EXPECT_EQ(range(p, x + "gate_proj.weight"), (Range{20, 40}));
    EXPECT_EQ(shape(p, x + "gate_proj.weight"), (Shape{20, 64}));
    EXPECT_EQ(shape(p, x + "up_proj.weight"), (Shape{20, 64}));
    EXPECT_EQ(range(p, x + "down_proj.weight"), (Range{20, 40}));
    EXPECT_EQ(shape(p, x + "down_proj.weight"), (Shape{64, 20}));
  }
  EXPECT_EQ(shape(p, kL1 + "mlp.gate.weight"), (Shape{4, 64}));
  EXPECT_EQ(find(p, kL1 + "mlp.gate.weight")->spec.split, Split::kNone);
  EXPECT_EQ(shape(p, kL1 + "mlp.shared_expert.gate_proj.weight"), (Shape{12, 64}));
  EXPECT_EQ(shape(p, kL1 + "mlp.shared_expert.down_proj.weight"), (Shape{64, 12}));
  EXPECT_EQ(shape(p, kL1 + "mlp.shared_expert_gate.weight"), (Shape{1, 64}));
  EXPECT_EQ(find(p, kL1 + "mlp.gate_proj.weight"), nullptr) << "an MoE layer has no dense MLP";
  const std::string l2 = "model.layers.2.";
  EXPECT_EQ(shape(p, l2 + "mlp.gate_proj.weight"), (Shape{48, 64}));
  EXPECT_EQ(shape(p, l2 + "mlp.down_proj.weight"), (Shape{64, 48}));
  EXPECT_EQ(find(p, l2 + "mlp.gate.weight"), nullptr);
  EXPECT_EQ(find(p, l2 + "mlp.experts.0.up_proj.weight"), nullptr);
  // The shards' bytes: each rank holds half of every expert, all of the router.
  const uint64_t whole = must_make(c, rank(1, 0)).weight_bytes(DType::kBF16);
  const uint64_t half =
      p.weight_bytes(DType::kBF16) + must_make(c, rank(2, 0)).weight_bytes(DType::kBF16);
  uint64_t replicated = 0;  // norms and routers, held twice
  for (const WeightShard& w : p.weights) {
    if (w.spec.split != Split::kNone) continue;
    int64_t n = 1;
    for (int64_t d : w.shape()) n *= d;
    replicated += static_cast<uint64_t>(n) * 2;
  }
  EXPECT_EQ(half, whole + replicated);
  // Every expert's bytes are in the whole model's: 4 experts x 3 x 40 x 64 per MoE layer.
  ModelConfig dense = c;
  dense.moe = MoeConfig{};
  const uint64_t dense_bytes = must_make(dense, rank(1, 0)).weight_bytes(DType::kBF16);
  const uint64_t moe_layer = (4 * 3 * 40 * 64 + 4 * 64 + 3 * 24 * 64 + 64) * 2;
  const uint64_t mlp_layer = 3 * 96 * 64 * 2;
  EXPECT_EQ(whole, dense_bytes + 4 * (moe_layer - mlp_layer));
}

// --enable-expert-parallel: whole experts per rank (vLLM's linear placement, the first ranks one
// more when they do not divide), each expert uncut, the router whole everywhere, the shared
// expert still split; the bytes of the ranks add up to the model's (plus what is replicated).
TEST(LayerPlanTest, ExpertParallelRanksHoldWholeExperts) {
  ModelConfig c = small_moe();
  c.moe.num_experts = 5;
  c.moe.expert_intermediate = 42;  // splits over no -tp but 1 and 2: whole experts need not
  auto ep = [](int tp, int r) {
    ParallelConfig p = rank(tp, r);
    p.expert_parallel = true;
    return p;
  };
  EXPECT_EQ(expert_range(5, 2, 0), (std::pair<int64_t, int64_t>{0, 3}));
  EXPECT_EQ(expert_range(5, 2, 1), (std::pair<int64_t, int64_t>{3, 2}));
  EXPECT_EQ(expert_range(5, 4, 3), (std::pair<int64_t, int64_t>{4, 1}));
  uint64_t sum = 0;
  for (int r = 0; r < 4; ++r) {
    LayerPlan p = must_make(c, ep(4, r));
    EXPECT_EQ(p.moe_intermediate, 42);
    EXPECT_EQ(p.shared_intermediate, 6);
    auto [first, n] = expert_range(5, 4, r);
    EXPECT_EQ(p.expert_begin, first);
    EXPECT_EQ(p.experts, n);
    for (int e = 0; e < 5; ++e) {
      const std::string x = kL1 + "mlp.experts." + std::to_string(e) + ".";
      if (e >= first && e < first + n) {
        EXPECT_EQ(shape(p, x + "gate_proj.weight"), (Shape{42, 64})) << "rank " << r;
        EXPECT_EQ(shape(p, x + "down_proj.weight"), (Shape{64, 42})) << "rank " << r;
      } else {
        EXPECT_EQ(find(p, x + "up_proj.weight"), nullptr) << "rank " << r << " expert " << e;
      }
    }
    EXPECT_EQ(shape(p, kL1 + "mlp.gate.weight"), (Shape{5, 64}));
    EXPECT_EQ(shape(p, kL1 + "mlp.shared_expert.gate_proj.weight"), (Shape{6, 64}));
    sum += p.weight_bytes(DType::kBF16);
  }
  LayerPlan one = must_make(c, ep(1, 0));
  EXPECT_EQ(one.experts, 5);
  EXPECT_GT(sum, one.weight_bytes(DType::kBF16)) << "the router and norms are replicated";
  // Without expert parallelism the same widths are refused at -tp 4.
  EXPECT_NE(refusal(c, rank(4, 0)).find("moe_intermediate_size 42"), std::string::npos);
  // More ranks than experts, and a dense model, are refused naming why.
  EXPECT_NE(refusal(c, ep(8, 0)).find("the model's 5 experts leave a rank without one"),
            std::string::npos)
      << refusal(c, ep(8, 0));
  EXPECT_NE(refusal(small(), ep(2, 0))
                .find("--enable-expert-parallel: LlamaForCausalLM has no "
                      "experts"),
            std::string::npos)
      << refusal(small(), ep(2, 0));
}

TEST(LayerPlanTest, ATpThatDoesNotSplitTheExpertsIsRefusedNamingTheField) {
  ModelConfig c = small_moe();
  c.moe.expert_intermediate = 42;
  EXPECT_NE(refusal(c, rank(4, 0)).find("moe_intermediate_size 42 does not split over 4 ranks"),
            std::string::npos)
      << refusal(c, rank(4, 0));
  EXPECT_EQ(refusal(c, rank(2, 0)), "");
  c.moe.expert_intermediate = 40;
  c.moe.shared_intermediate = 26;
  EXPECT_NE(refusal(c, rank(4, 0)).find("shared_expert_intermediate_size 26"), std::string::npos)
      << refusal(c, rank(4, 0));
  // Mixtral's experts are intermediate_size wide; with no dense layer only they count.
  c = small_moe();
  c.arch = Architecture::kMixtral;
  c.moe.shared_intermediate = 0;
  c.moe.mlp_only_layers.clear();
  c.intermediate_size = c.moe.expert_intermediate = 36;
  EXPECT_NE(refusal(c, rank(8, 0)).find("intermediate_size 36 does not split over 8 ranks"),
            std::string::npos)
      << refusal(c, rank(8, 0));
  // A Qwen MoE model's dense intermediate_size matters only when a layer is dense.
  c = small_moe();
  c.moe.mlp_only_layers.clear();
  c.intermediate_size = 98;
  EXPECT_EQ(refusal(c, rank(4, 0)), "");
  c.moe.mlp_only_layers = {0};
  EXPECT_NE(refusal(c, rank(4, 0)).find("intermediate_size 98"), std::string::npos);
}

// Phi-3's fused qkv_proj / gate_up_proj: each rank holds its rows of every part, as vLLM's
// QKVParallelLinear / MergedColumnParallelLinear (q, k, v and gate, up each column-split).
TEST(LayerPlanTest, FusedProjectionsSplitPartByPart) {
  ModelConfig c = small();  // 8 heads, 2 KV heads of 8 dims, MLP 96
  c.arch = Architecture::kPhi3;
  c.fused_projections = true;
  const std::vector<WeightSpec> all = expected_weights(c);
  auto spec = [&](const std::string& name) -> const WeightSpec* {
    for (const WeightSpec& w : all) {
      if (w.name == name) return &w;
    }
    return nullptr;
  };
  ASSERT_NE(spec("model.layers.0.self_attn.qkv_proj.weight"), nullptr);
  EXPECT_EQ(spec("model.layers.0.self_attn.qkv_proj.weight")->shape,
            (std::vector<int64_t>{64 + 2 * 16, 64}));
  EXPECT_EQ(spec("model.layers.0.mlp.gate_up_proj.weight")->shape,
            (std::vector<int64_t>{2 * 96, 64}));
  EXPECT_EQ(spec("model.layers.0.self_attn.q_proj.weight"), nullptr);
  EXPECT_STREQ(fused_group(WeightKind::kQKV), "qkv");
  EXPECT_STREQ(fused_group(WeightKind::kGateUp), "gate_up");
  // The parts of layer 0 on a rank: kind -> [begin, end) rows of the fused tensor.
  auto parts = [](const LayerPlan& plan, const std::string& name) {
    std::vector<std::tuple<WeightKind, int64_t, int64_t>> out;
    for (const WeightShard& w : plan.weights) {
      if (w.spec.name == name) out.emplace_back(w.spec.kind, w.begin, w.end);
    }
    return out;
  };
  using P = std::tuple<WeightKind, int64_t, int64_t>;
  const std::string qkv = "model.layers.0.self_attn.qkv_proj.weight";
  const std::string gu = "model.layers.0.mlp.gate_up_proj.weight";
  LayerPlan one = must_make(c, rank(1, 0));
  EXPECT_EQ(parts(one, qkv),
            (std::vector<P>{
                {WeightKind::kQ, 0, 64}, {WeightKind::kK, 64, 80}, {WeightKind::kV, 80, 96}}));
  // tp 2, rank 1: query heads 4..7, KV head 1, MLP rows 48..95 of each part.
  LayerPlan r1 = must_make(c, rank(2, 1));
  EXPECT_EQ(parts(r1, qkv),
            (std::vector<P>{
                {WeightKind::kQ, 32, 64}, {WeightKind::kK, 72, 80}, {WeightKind::kV, 88, 96}}));
  EXPECT_EQ(parts(r1, gu),
            (std::vector<P>{{WeightKind::kGate, 48, 96}, {WeightKind::kUp, 144, 192}}));
  for (const WeightShard& w : r1.weights) {
    if (w.spec.name == qkv && w.spec.kind == WeightKind::kQ) {
      EXPECT_EQ(w.shape(), (std::vector<int64_t>{32, 64}));
    }
  }
  // tp 4 > 2 KV heads: ranks 0, 1 share KV head 0; ranks 2, 3 KV head 1.
  LayerPlan r3 = must_make(c, rank(4, 3));
  EXPECT_EQ(parts(r3, qkv),
            (std::vector<P>{
                {WeightKind::kQ, 48, 64}, {WeightKind::kK, 72, 80}, {WeightKind::kV, 88, 96}}));
  // The shards add up to the fused tensor's bytes at every tp.
  for (int tp : {1, 2, 4}) {
    uint64_t bytes = 0;
    for (int r = 0; r < tp; ++r) bytes += must_make(c, rank(tp, r)).weight_bytes(DType::kF32);
    EXPECT_GE(bytes, one.weight_bytes(DType::kF32)) << tp;
  }
}

}  // namespace
}  // namespace tessera
