// `tessera status` rendering, on a synthetic two-node cluster with two NVLinked GPUs.
#include "driver/status.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

namespace tessera {
namespace {

ClusterStatus sample() {
  ClusterStatus s;
  s.head_address = "10.0.0.1:6380";
  s.head_id = "n-head";
  NodeStatus head;
  head.node.node_id = "n-head";
  head.node.name = "gpu-box";
  head.node.address = "10.0.0.1:6380";
  head.node.is_head = true;
  head.node.alive = true;
  head.node.pid = 100;
  head.node.resources.cpus = 16;
  head.node.resources.memory_total = 128ull << 30;
  head.node.resources.memory_available = 100ull << 30;
  head.node.resources.driver_version = "580.159.04";
  for (uint32_t i = 0; i < 2; ++i) {
    head.node.resources.gpus.push_back({i, "NVIDIA H200", "GPU-" + std::to_string(i),
                                        "00000000:1" + std::to_string(i) + ":00.0", 143771ull << 20,
                                        1ull << 30});
  }
  head.node.resources.links = {
      {LinkKind::kSelf, 0}, {LinkKind::kNvlink, 18}, {LinkKind::kNvlink, 18}, {LinkKind::kSelf, 0}};
  ActorView a;
  a.actor_id = "a-0001";
  a.owner = "llm-driver";
  a.pid = 4242;
  a.gpus = {1};
  a.state = "ready";
  a.address = "10.0.0.1:40001";
  head.actors.push_back(a);
  ActorView dead = a;
  dead.actor_id = "a-0002";
  dead.state = "dead";
  dead.term_signal = 9;
  dead.death_reason = "killed by signal 9 (SIGKILL)";
  head.actors.push_back(dead);
  s.nodes.push_back(head);
  NodeStatus gone;
  gone.node.node_id = "n-gone";
  gone.node.name = "cpu-box";
  gone.node.alive = false;
  gone.node.death_reason = "missed 5 heartbeats (none for 5100 ms)";
  s.nodes.push_back(gone);
  return s;
}

TEST(StatusRenderTest, TextShowsNodesGpusLinksAndActors) {
  std::string text = render_status(sample());
  EXPECT_NE(text.find("1 node(s) alive, 1 dead"), std::string::npos) << text;
  EXPECT_NE(text.find("Node n-head (gpu-box) [head]"), std::string::npos) << text;
  EXPECT_NE(text.find("GPU1  NVIDIA H200"), std::string::npos) << text;
  EXPECT_NE(text.find("NV18"), std::string::npos) << text;
  EXPECT_NE(text.find("a-0001"), std::string::npos) << text;
  EXPECT_NE(text.find("llm-driver"), std::string::npos) << text;
  EXPECT_NE(text.find("killed by signal 9 (SIGKILL)"), std::string::npos) << text;
  EXPECT_NE(text.find("died: missed 5 heartbeats"), std::string::npos) << text;
}

TEST(StatusRenderTest, JsonCarriesTheSameFacts) {
  auto j = nlohmann::json::parse(render_status_json(sample()));
  ASSERT_EQ(j["nodes"].size(), 2u);
  EXPECT_EQ(j["nodes"][0]["gpus"].size(), 2u);
  EXPECT_EQ(j["nodes"][0]["links"][0][1], "NV18");
  EXPECT_EQ(j["nodes"][0]["links"][1][1], "X");
  EXPECT_EQ(j["nodes"][0]["actors"][1]["term_signal"], 9);
  EXPECT_FALSE(j["nodes"][1]["alive"]);
}

}  // namespace
}  // namespace tessera
