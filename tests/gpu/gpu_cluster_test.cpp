// GPU machine checks (run by scripts/gpu-check, not by ctest: CI has no GPU).
//
// A head and a second daemon on one GPU machine; one actor per GPU spread over both daemons.
// Each actor must see exactly the GPU it was given: its CUDA device's UUID and memory equal
// what the daemon's NVML discovery reported for that GPU index.
#include <gtest/gtest.h>

#include "driver/client.h"
#include "tests/integration/test_cluster.h"

namespace tessera {
namespace {

using namespace std::chrono_literals;

TEST(GpuClusterTest, EachActorSeesExactlyItsGpu) {
  testing::TestCluster cluster;
  std::string head = cluster.start_head();
  ASSERT_FALSE(head.empty()) << cluster.last().out << cluster.last().err;
  std::string member = cluster.start_member("second");
  ASSERT_FALSE(member.empty()) << cluster.last().out << cluster.last().err;

  EventLoop loop;
  auto client = ClusterClient::connect(loop, head, cluster.token());
  ASSERT_TRUE(client) << client.status().to_string();
  auto nodes = (*client)->nodes();
  ASSERT_TRUE(nodes);
  ASSERT_EQ(nodes->size(), 2u);
  const NodeResources& res = (*nodes)[0].resources;
  ASSERT_GT(res.gpus.size(), 0u) << "no GPUs: " << res.gpu_note;
  std::cout << "GPU links on " << (*nodes)[0].name << ":\n" << format_link_matrix(res);

  // GPU i goes to node i % 2: both daemons spawn GPU actors.
  std::vector<std::unique_ptr<LeaseHandle>> leases;
  for (const auto& n : *nodes) {
    auto node = (*client)->node(n.node_id);
    ASSERT_TRUE(node) << node.status().to_string();
    auto lease = node->open_lease("gpu-check");
    ASSERT_TRUE(lease) << lease.status().to_string();
    leases.push_back(std::move(*lease));
  }
  for (size_t i = 0; i < res.gpus.size(); ++i) {
    auto actor = leases[i % 2]->spawn({.gpus = {static_cast<uint32_t>(i)},
                                       .env = {{"NCCL_NVLS_ENABLE", "0"}},
                                       .name = "gpu" + std::to_string(i)});
    ASSERT_TRUE(actor) << actor.status().to_string();
    auto handle = ActorHandle::connect(loop, actor->address, actor->key);
    ASSERT_TRUE(handle) << handle.status().to_string();
    auto health = (*handle)->health();
    ASSERT_TRUE(health) << health.status().to_string();
    std::cout << "actor " << actor->actor_id << " on node " << actor->node_id << ": backend "
              << health->backend << ", CUDA_VISIBLE_DEVICES=" << health->visible_devices
              << ", NCCL " << health->nccl_version;
    for (const auto& d : health->devices) {
      std::cout << ", device " << d.name << " " << d.uuid << " " << (d.memory_total >> 20)
                << " MiB";
    }
    std::cout << "\n";
    EXPECT_EQ(health->backend, "cuda") << health->note;
    EXPECT_EQ(health->visible_devices, std::to_string(i));
    ASSERT_EQ(health->devices.size(), 1u);
    EXPECT_EQ(health->devices[0].uuid, res.gpus[i].uuid);
    EXPECT_EQ(health->devices[0].name, res.gpus[i].name);
    // cudaMemGetInfo's total can be a little under NVML's (the driver's own reserve).
    EXPECT_LE(health->devices[0].memory_total, res.gpus[i].memory_total);
    EXPECT_GT(health->devices[0].memory_total, res.gpus[i].memory_total / 10 * 9);
    EXPECT_FALSE(health->nccl_version.empty());
  }
  auto status = cluster.tessera({"status", "--temp-dir", cluster.root()});
  std::cout << status.out;
  EXPECT_EQ(status.exit_code, 0);
}

}  // namespace
}  // namespace tessera
