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

}  // namespace
}  // namespace tessera
