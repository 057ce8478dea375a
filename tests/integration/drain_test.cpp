// `tessera drain`, end to end: a real head and member daemon, the CLI and the driver library over
// real RPC. The head records the mark, lists it, `status`, `topo` and `plan` show and honour it,
// and the head refuses new leases and actors on a draining node.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "driver/client.h"
#include "driver/drain.h"
#include "tests/integration/test_cluster.h"

namespace tessera {
namespace {

using namespace std::chrono_literals;
using testing::BackgroundProcess;
using testing::bin;
using testing::CommandResult;
using testing::process_alive;
using testing::TestCluster;

// A model's config.json: all `tessera plan` reads of a model.
constexpr const char* kTinyLlamaConfig = R"({
  "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
  "intermediate_size": 176, "num_hidden_layers": 4, "num_attention_heads": 4,
  "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 1000, "max_position_embeddings": 512,
  "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "torch_dtype": "float32",
  "tie_word_embeddings": false
})";

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

class DrainTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // Nothing here tests death detection: a member starved for 500 ms on a loaded machine (ctest
    // -j8 on two cores) was marked dead, which broke the lease held through the head ("Peer
    // disconnected"). 3 s of silence before that.
    head_ = cluster_.start_head({"--missed-heartbeats", "30"});
    ASSERT_FALSE(head_.empty()) << cluster_.last().out << cluster_.last().err;
    member_ = cluster_.start_member("second");
    ASSERT_FALSE(member_.empty()) << cluster_.last().out << cluster_.last().err;
    auto c = ClusterClient::connect(loop_, head_, cluster_.token());
    ASSERT_TRUE(c) << c.status().to_string();
    client_ = std::move(*c);
  }

  CommandResult tessera(std::vector<std::string> args) {
    args.insert(args.end(), {"--temp-dir", cluster_.root()});
    return cluster_.tessera(args);
  }

  // The member as the head lists it.
  NodeView member() {
    auto nodes = client_->nodes();
    EXPECT_TRUE(nodes) << nodes.status().to_string();
    for (const NodeView& n : nodes ? *nodes : std::vector<NodeView>{}) {
      if (n.node_id == member_) return n;
    }
    ADD_FAILURE() << "the head does not list " << member_;
    return {};
  }

  TestCluster cluster_;
  std::string head_;
  std::string member_;
  EventLoop loop_;
  std::unique_ptr<ClusterClient> client_;
};

TEST_F(DrainTest, StatusTopoAndPlanShowAndHonourTheMark) {
  const std::string model = cluster_.root() + "/model";
  std::filesystem::create_directories(model);
  std::ofstream(model + "/config.json") << kTinyLlamaConfig;
  auto plan = [&]() { return tessera({"plan", "--model", model, "--device", "cpu", "-pp", "2"}); };
  CommandResult before = plan();
  ASSERT_EQ(before.exit_code, 0) << before.err << before.out;
  EXPECT_TRUE(contains(before.out, "stage 1: second 1 CPU actor")) << before.out;

  CommandResult drained = tessera({"drain", "second"});
  ASSERT_EQ(drained.exit_code, 0) << drained.err;
  EXPECT_EQ(drained.out, "node second (" + member_ +
                             ") is draining: no new actors go there; 0 actors still run on it\n");
  EXPECT_TRUE(member().draining);
  EXPECT_TRUE(member().alive);

  CommandResult text = tessera({"status"});
  ASSERT_EQ(text.exit_code, 0) << text.err;
  EXPECT_TRUE(contains(text.out, "2 node(s) alive (1 draining)")) << text.out;
  EXPECT_TRUE(contains(text.out, "Node " + member_ + " (second)")) << text.out;
  EXPECT_TRUE(contains(text.out, "  draining  pid ")) << text.out;
  EXPECT_TRUE(contains(text.out, "`tessera drain second --undo` takes it back")) << text.out;
  CommandResult json = tessera({"status", "--json"});
  ASSERT_EQ(json.exit_code, 0) << json.err;
  auto j = nlohmann::json::parse(json.out);
  ASSERT_EQ(j["nodes"].size(), 2u);
  for (const auto& n : j["nodes"]) {
    EXPECT_EQ(n["draining"].get<bool>(), n["node_id"] == member_) << n.dump();
  }
  CommandResult topo = tessera({"topo", "--json"});
  ASSERT_EQ(topo.exit_code, 0) << topo.err;
  EXPECT_TRUE(contains(topo.out, "\"draining\": true")) << topo.out;

  // Both stages go to the head now.
  CommandResult avoided = plan();
  ASSERT_EQ(avoided.exit_code, 0) << avoided.err << avoided.out;
  EXPECT_TRUE(contains(avoided.out, "1 draining (not used)")) << avoided.out;
  EXPECT_FALSE(contains(avoided.out, "second 1 CPU actor")) << avoided.out;

  CommandResult undone = tessera({"drain", member_, "--undo"});  // by id this time
  ASSERT_EQ(undone.exit_code, 0) << undone.err;
  EXPECT_TRUE(contains(undone.out, "node second (" + member_ + ") is no longer draining"))
      << undone.out;
  EXPECT_FALSE(member().draining);
  text = tessera({"status"});
  EXPECT_FALSE(contains(text.out, "draining")) << text.out;
  CommandResult after = plan();
  ASSERT_EQ(after.exit_code, 0) << after.err;
  EXPECT_TRUE(contains(after.out, "stage 1: second 1 CPU actor")) << after.out;
}

TEST_F(DrainTest, TheHeadRefusesNewLeasesAndActorsOnADrainingNode) {
  auto node = client_->node(member_);
  ASSERT_TRUE(node) << node.status().to_string();
  auto lease = node->open_lease("drain-test");
  ASSERT_TRUE(lease) << lease.status().to_string();
  auto running = (*lease)->spawn({.name = "before-the-drain"});
  ASSERT_TRUE(running) << running.status().to_string();

  auto marked = client_->drain("second");
  ASSERT_TRUE(marked) << marked.status().to_string();
  EXPECT_TRUE(marked->draining);
  EXPECT_EQ(marked->node_id, member_);

  // A lease opened before the drain spawns no more; a new lease is not opened.
  auto refused = (*lease)->spawn({});
  ASSERT_FALSE(refused);
  EXPECT_EQ(refused.status().code(), Code::kFailedPrecondition) << refused.status().to_string();
  EXPECT_TRUE(contains(refused.status().message(), "node second (" + member_ + ") is draining"))
      << refused.status().message();
  EXPECT_TRUE(contains(refused.status().message(), "`tessera drain second --undo`"))
      << refused.status().message();
  auto again = client_->node(member_);
  ASSERT_TRUE(again) << again.status().to_string();
  auto no_lease = again->open_lease("latecomer");
  ASSERT_FALSE(no_lease);
  EXPECT_EQ(no_lease.status().code(), Code::kFailedPrecondition);
  // What runs there is left alone, and the lease still answers.
  EXPECT_TRUE(process_alive(running->pid));
  auto listed = (*lease)->actors();
  ASSERT_TRUE(listed) << listed.status().to_string();
  EXPECT_EQ(listed->size(), 1u);

  // The CLI counts it, and --wait gives up after its time naming the actor's owner.
  CommandResult counted = tessera({"drain", "second"});
  ASSERT_EQ(counted.exit_code, 0) << counted.err;
  EXPECT_TRUE(contains(counted.out, "1 actor still runs on it")) << counted.out;
  CommandResult timed_out = tessera({"drain", "second", "--wait", "1"});
  EXPECT_EQ(timed_out.exit_code, 1) << timed_out.out;
  EXPECT_TRUE(contains(timed_out.err,
                       "node second still runs 1 actor after 1 s (owned by "
                       "drain-test)"))
      << timed_out.err;

  // The library's wait reports progress while it waits.
  std::vector<size_t> progress;
  DrainWait brief{.timeout = 1s, .poll = 100ms, .progress_every = 300ms};
  brief.progress = [&](const std::vector<ActorView>& live, std::chrono::seconds) {
    progress.push_back(live.size());
  };
  auto gave_up = wait_drained(loop_, *client_, member_, brief);
  ASSERT_FALSE(gave_up);
  EXPECT_EQ(gave_up.status().code(), Code::kDeadlineExceeded);
  EXPECT_GE(progress.size(), 2u);
  for (size_t n : progress) EXPECT_EQ(n, 1u);

  // --wait returns once the owner lets its actor go.
  BackgroundProcess waiting(
      {bin("tessera"), "drain", "second", "--wait", "60", "--temp-dir", cluster_.root()});
  loop_.run_for(1500ms);
  ASSERT_TRUE((*lease)->kill(running->actor_id).is_ok());
  ASSERT_TRUE((*lease)->wait_for_death(running->actor_id, 10s));
  const int status = waiting.wait(30s);
  ASSERT_TRUE(WIFEXITED(status)) << status << waiting.out() << waiting.err();
  EXPECT_EQ(WEXITSTATUS(status), 0) << waiting.err();
  EXPECT_TRUE(contains(waiting.out(),
                       "node second drained: no actors left; stop its daemon with "
                       "`tessera stop` on that machine"))
      << waiting.out();

  // The head's own node, as the handshake hands it out, is guarded too.
  ASSERT_TRUE(client_->drain(client_->head_id()));
  auto head_lease = client_->head_node().open_lease("drain-test");
  ASSERT_FALSE(head_lease);
  EXPECT_EQ(head_lease.status().code(), Code::kFailedPrecondition);
  ASSERT_TRUE(client_->drain(client_->head_id(), /*undo=*/true));
  EXPECT_TRUE(client_->head_node().open_lease("drain-test"));

  // Undone, the old lease spawns again.
  ASSERT_TRUE(client_->drain(member_, /*undo=*/true));
  auto spawned = (*lease)->spawn({});
  EXPECT_TRUE(spawned) << spawned.status().to_string();
}

// A member that loses the head for a while (frozen past its heartbeats here) and registers
// again is still drained: the mark is the head's, not the connection's.
TEST_F(DrainTest, TheMarkSurvivesTheMemberRegisteringAgain) {
  ASSERT_TRUE(client_->drain("second"));
  const int pid = cluster_.daemon_pid(member_);
  ASSERT_GT(pid, 0);
  auto state = [&]() {
    auto nodes = client_->nodes(/*include_dead=*/true);
    for (const NodeView& n : nodes ? *nodes : std::vector<NodeView>{}) {
      if (n.node_id == member_) return n;
    }
    return NodeView{};
  };
  ASSERT_EQ(::kill(pid, SIGSTOP), 0);
  loop_.run_for(10s, [&] { return !state().alive; });
  ::kill(pid, SIGCONT);
  ASSERT_FALSE(state().alive) << "5 missed heartbeats of 100 ms mark it dead";
  loop_.run_for(10s, [&] { return state().alive; });
  const NodeView back = state();
  ASSERT_TRUE(back.alive);
  EXPECT_TRUE(back.draining);
  auto node = client_->node(member_);
  ASSERT_TRUE(node) << node.status().to_string();
  EXPECT_EQ(node->open_lease("after-the-freeze").status().code(), Code::kFailedPrecondition);
}

TEST_F(DrainTest, UnknownNodesWrongTokensAndAnEmptyNode) {
  CommandResult unknown = tessera({"drain", "no-such-node"});
  EXPECT_EQ(unknown.exit_code, 1);
  EXPECT_TRUE(contains(unknown.err, "no live node has the id or name no-such-node")) << unknown.err;
  EXPECT_TRUE(contains(unknown.err, "second (" + member_ + ")")) << unknown.err;
  EXPECT_TRUE(contains(unknown.err, client_->head_id())) << unknown.err;

  // Without the cluster token nothing is handed out, drainNode included.
  const std::string bad = cluster_.root() + "/wrong_token";
  std::ofstream(bad) << "guessed-token-0123456789abcdef\n";
  std::filesystem::permissions(
      bad, std::filesystem::perms::owner_read | std::filesystem::perms::owner_write);
  CommandResult intruder =
      cluster_.tessera({"drain", "second", "--address", head_, "--cluster-token-file", bad});
  EXPECT_EQ(intruder.exit_code, 1);
  EXPECT_TRUE(contains(intruder.err, "wrong cluster token")) << intruder.err;
  EXPECT_FALSE(member().draining);

  // --undo and --wait do not go together.
  EXPECT_EQ(tessera({"drain", "second", "--undo", "--wait"}).exit_code, 2);

  // Nothing runs there: --wait returns at once.
  const auto start = std::chrono::steady_clock::now();
  CommandResult empty = tessera({"drain", "second", "--wait"});
  ASSERT_EQ(empty.exit_code, 0) << empty.err;
  EXPECT_LT(std::chrono::steady_clock::now() - start, 10s);
  EXPECT_TRUE(contains(empty.out, "node second drained: no actors left")) << empty.out;
  EXPECT_TRUE(member().draining);
}

}  // namespace
}  // namespace tessera
