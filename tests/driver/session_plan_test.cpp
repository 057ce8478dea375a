// The plan a model session runs (driver/model_session.h): the planner's choice and placement for
// the engine arguments, the one-GPU sharing that --collectives ipc allows, and its printout.
#include <gtest/gtest.h>

#include <optional>

#include "driver/model_session.h"
#include "driver/plan/plan_command.h"

namespace tessera {
namespace {

ModelConfig tiny() {
  ModelConfig c;
  c.arch = Architecture::kLlama;
  c.model_type = "llama";
  c.vocab_size = 1000;
  c.hidden_size = 64;
  c.intermediate_size = 176;
  c.num_layers = 4;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 16;
  c.max_position_embeddings = 2048;
  c.torch_dtype = DType::kBF16;
  return c;
}

// -tp `tp` (0 = auto) and, when given, -pp `pp`.
EngineSpec args(int64_t tp, std::optional<int64_t> pp = std::nullopt) {
  EngineSpec a;
  a.model = "/nonexistent";
  a.tensor_parallel_size = ParallelSize{tp};
  if (pp) a.pipeline_parallel_size = ParallelSize{*pp};
  return a;
}

TEST(SessionPlanTest, TwoRanksShareOneGpuOnlyWithIpcCollectives) {
  auto nodes = synthetic_nodes(1, 1, 80ull << 30);
  EngineSpec a = args(2);
  auto refused = plan_session(tiny(), a, nodes);
  ASSERT_FALSE(refused);
  EXPECT_EQ(refused.status().code(), Code::kResourceExhausted) << refused.status().to_string();

  a.collectives = Collectives::kIpc;
  auto shared = plan_session(tiny(), a, nodes);
  ASSERT_TRUE(shared) << shared.status().to_string();
  ASSERT_EQ(shared->placement.ranks.size(), 2u);
  EXPECT_EQ(shared->placement.ranks[0].gpu, 0);
  EXPECT_EQ(shared->placement.ranks[1].gpu, 0);
  EXPECT_EQ(shared->plan.tp, 2);
  EXPECT_EQ(plan_summary(*shared), "plan: stage 0: node-0 gpu0 gpu0 [X]\n");
  // The load takes its lengths from the plan: resolved as any plan's (the model's context by
  // default, --max-model-len when given), never 0.
  EXPECT_EQ(shared->engine.max_model_len, 2048);
  EXPECT_GT(shared->engine.max_num_batched_tokens, 0);
  EXPECT_TRUE(check_resolved(shared->engine).is_ok());
  EXPECT_EQ(shared->engine.device, Device::kCuda);
  // Each rank is sized to its half of the GPU, as the actors divide it (gpu_shares), and the
  // plan prints with both (`tessera doctor --model -tp 2 --collectives ipc` crashed printing a
  // shared plan that had no sizes, on the H200).
  ASSERT_EQ(shared->memory.ranks.size(), 2u);
  for (const RankMemory& r : shared->memory.ranks) {
    EXPECT_EQ(r.total, 40ull << 30);
    EXPECT_LE(r.budget, static_cast<uint64_t>(0.9 * (40ull << 30)));
    EXPECT_GT(r.kv_tokens, 0);
  }
  const std::string text = render_cluster_plan(tiny(), *shared);
  const size_t ranks = text.find("Ranks:");
  ASSERT_NE(ranks, std::string::npos) << text;
  size_t rows = 0;  // a row per rank, each on gpu0 of node-0
  for (size_t at = text.find("node-0 gpu0 ", ranks); at != std::string::npos;
       at = text.find("node-0 gpu0 ", at + 1)) {
    ++rows;
  }
  EXPECT_EQ(rows, 2u) << text;
  EXPECT_NE(text.find("shared by 2 ranks"), std::string::npos) << text;
  EXPECT_NE(text.find("Fits."), std::string::npos) << text;
  a.max_model_len = 512;
  auto capped = plan_session(tiny(), a, nodes);
  ASSERT_TRUE(capped) << capped.status().to_string();
  EXPECT_EQ(capped->engine.max_model_len, 512);
  a.max_model_len = 4096;  // beyond the model's 2048
  EXPECT_FALSE(plan_session(tiny(), a, nodes));
}

TEST(SessionPlanTest, PlansAreThePlannersAndPrintEveryStage) {
  auto nodes = synthetic_nodes(2, 2, 80ull << 30);
  auto plan = plan_session(tiny(), args(2, 2), nodes);
  ASSERT_TRUE(plan) << plan.status().to_string();
  EXPECT_EQ(plan->placement.ranks.size(), 4u);
  const std::string text = plan_summary(*plan);
  EXPECT_NE(text.find("plan: stage 0: "), std::string::npos) << text;
  EXPECT_NE(text.find("plan: stage 1: "), std::string::npos) << text;
  auto chosen = plan_session(tiny(), args(0), nodes);
  ASSERT_TRUE(chosen) << chosen.status().to_string();
  EXPECT_NE(plan_summary(*chosen).find("plan: -tp auto"), std::string::npos)
      << plan_summary(*chosen);
  auto bad = plan_session(tiny(), args(3), nodes);
  ASSERT_FALSE(bad);
  EXPECT_NE(bad.status().message().find("attention heads do not split over 3 ranks"),
            std::string::npos)
      << bad.status().to_string();
}

}  // namespace
}  // namespace tessera
