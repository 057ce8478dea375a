// The parameter count `tessera bench` divides bandwidth and FLOPs by, against the count
// transformers reports for the same shapes (parameters without the input embedding, measured
// on the H200 run of 2026-11-30: bench/results/2026-11-30-h200-llama3-8b-latency.json).
#include <gtest/gtest.h>

#include "driver/bench.h"

namespace tessera {
namespace {

ModelConfig llama3_8b() {
  ModelConfig c;
  c.vocab_size = 128256;
  c.hidden_size = 4096;
  c.intermediate_size = 14336;
  c.num_layers = 32;
  c.num_heads = 32;
  c.num_kv_heads = 8;
  c.head_dim = 128;
  return c;
}

TEST(BenchTest, MatmulParametersMatchTransformersCount) {
  // transformers: 8,030,261,248 parameters, 525,336,576 of them the input embedding.
  EXPECT_EQ(matmul_parameters(llama3_8b()), 8030261248 - 525336576);
}

TEST(BenchTest, TiedEmbeddingsAreReadOnceAsTheLmHead) {
  ModelConfig c = llama3_8b();
  const int64_t untied = matmul_parameters(c);
  c.tie_word_embeddings = true;
  EXPECT_EQ(matmul_parameters(c), untied);  // lm_head is the embedding, read once either way
}

TEST(BenchTest, BiasesAndQkNormsAreCounted) {
  ModelConfig c = llama3_8b();
  const int64_t base = matmul_parameters(c);
  c.attention_bias = true;
  EXPECT_EQ(matmul_parameters(c), base + 32 * (4096 + 2 * 1024));
  c.o_proj_bias = true;
  EXPECT_EQ(matmul_parameters(c), base + 32 * (4096 + 2 * 1024 + 4096));
  c.attention_bias = c.o_proj_bias = false;
  c.qk_norm = true;
  EXPECT_EQ(matmul_parameters(c), base + 32 * 2 * 128);
}

// An MoE model counts what a token reads: Qwen3-30B-A3B's router, 8 of 128 experts and its
// attention per layer ("A3B": 3.3B activated parameters with the embedding, 3.04B without).
TEST(BenchTest, MoeModelsCountTheActiveParameters) {
  ModelConfig c;
  c.vocab_size = 151936;
  c.hidden_size = 2048;
  c.intermediate_size = 6144;
  c.num_layers = 48;
  c.num_heads = 32;
  c.num_kv_heads = 4;
  c.head_dim = 128;
  c.qk_norm = true;
  c.moe.num_experts = 128;
  c.moe.top_k = 8;
  c.moe.expert_intermediate = 768;
  const int64_t attention = 2048 * (4096 + 1024) + 4096 * 2048 + 2 * 2048 + 2 * 128;
  const int64_t experts = 128 * 2048 + 8 * 3 * 2048 * 768;
  EXPECT_EQ(matmul_parameters(c), 48 * (attention + experts) + 2048 + 151936 * 2048);
  // A shared expert and its gate (Qwen2-MoE), and a dense layer (mlp_only_layers).
  const int64_t base = matmul_parameters(c);
  c.moe.shared_intermediate = 512;
  EXPECT_EQ(matmul_parameters(c), base + 48 * (3 * 2048 * 512 + 2048));
  c.moe.shared_intermediate = 0;
  c.moe.mlp_only_layers = {0};
  EXPECT_EQ(matmul_parameters(c), base - experts + 3 * 2048 * 6144);
}

}  // namespace
}  // namespace tessera
