// End-to-end: real `tessera` daemons and `tessera-actor` processes, driven through the CLI and
// the driver library over real RPC.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <thread>

#include "common/shm_ring.h"
#include "common/shm_segment.h"
#include "driver/client.h"
#include "tests/integration/test_cluster.h"

namespace tessera {
namespace {

using namespace std::chrono_literals;
using testing::process_alive;
using testing::TestCluster;
using testing::wait_until;

// Forks a child that runs `body` (returning its exit code) and waits for it. The body runs on a
// fresh thread: the fork copies this thread's kj event loop, which the child must not reuse.
int run_in_child(const std::function<int()>& body, std::chrono::seconds timeout = 30s) {
  pid_t pid = ::fork();
  if (pid == 0) {
    int code = 99;
    std::thread t([&] { code = body(); });
    t.join();
    _exit(code);
  }
  int status = 0;
  auto deadline = std::chrono::steady_clock::now() + timeout;
  while (::waitpid(pid, &status, WNOHANG) == 0) {
    if (std::chrono::steady_clock::now() > deadline) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      return -1;
    }
    std::this_thread::sleep_for(5ms);
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

class ClusterTest : public ::testing::Test {
 protected:
  void SetUp() override {
    head_ = cluster_.start_head({"--object-store-memory", std::to_string(4 << 20)});
    ASSERT_FALSE(head_.empty()) << cluster_.last().out << cluster_.last().err;
  }

  std::unique_ptr<ClusterClient> connect() {
    auto c = ClusterClient::connect(loop_, head_, cluster_.token());
    EXPECT_TRUE(c) << c.status().to_string();
    return c ? std::move(*c) : nullptr;
  }

  TestCluster cluster_;
  std::string head_;
  EventLoop loop_;
};

TEST_F(ClusterTest, HeadAndSecondDaemonRegisterAndShowInStatus) {
  std::string member = cluster_.start_member("second");
  ASSERT_FALSE(member.empty()) << cluster_.last().out << cluster_.last().err;
  auto cluster = connect();
  auto nodes = cluster->nodes();
  ASSERT_TRUE(nodes) << nodes.status().to_string();
  ASSERT_EQ(nodes->size(), 2u);
  EXPECT_TRUE((*nodes)[0].is_head);
  EXPECT_EQ((*nodes)[1].node_id, member);
  EXPECT_EQ((*nodes)[1].name, "second");
  EXPECT_NE((*nodes)[0].address, (*nodes)[1].address);
  EXPECT_GE((*nodes)[1].resources.cpus, 1u);
  EXPECT_GT((*nodes)[1].resources.memory_total, 0u);

  auto text = cluster_.tessera({"status", "--temp-dir", cluster_.root()});
  ASSERT_EQ(text.exit_code, 0) << text.err;
  EXPECT_NE(text.out.find(member), std::string::npos) << text.out;
  EXPECT_NE(text.out.find("[head]"), std::string::npos) << text.out;
  EXPECT_NE(text.out.find("2 node(s) alive"), std::string::npos) << text.out;

  // The token from the environment, as a driver on another machine would pass it.
  auto json = cluster_.tessera({"status", "--address", head_, "--json"}, 60s,
                               {"TESSERA_CLUSTER_TOKEN=" + cluster_.token()});
  ASSERT_EQ(json.exit_code, 0) << json.err;
  auto j = nlohmann::json::parse(json.out);
  ASSERT_EQ(j["nodes"].size(), 2u);
  EXPECT_EQ(j["nodes"][1]["node_id"], member);
}

TEST_F(ClusterTest, ActorsSpawnOnBothNodesAndAnswerDirectly) {
  std::string member = cluster_.start_member("second");
  ASSERT_FALSE(member.empty());
  auto cluster = connect();
  auto nodes = cluster->nodes();
  ASSERT_TRUE(nodes);
  std::vector<std::unique_ptr<LeaseHandle>> leases;
  std::vector<ActorView> actors;
  for (const auto& n : *nodes) {
    auto node = cluster->node(n.node_id);
    ASSERT_TRUE(node) << node.status().to_string();
    auto lease = node->open_lease("test-driver");
    ASSERT_TRUE(lease) << lease.status().to_string();
    auto actor = (*lease)->spawn({.env = {{"TESSERA_JOB", "e2e"}}, .name = "worker-" + n.name});
    ASSERT_TRUE(actor) << actor.status().to_string();
    EXPECT_EQ(actor->state, "ready");
    EXPECT_EQ(actor->node_id, n.node_id);
    EXPECT_TRUE(process_alive(actor->pid));
    actors.push_back(*actor);
    leases.push_back(std::move(*lease));
  }
  for (const auto& a : actors) {
    auto handle = ActorHandle::connect(loop_, a.address, a.key);
    ASSERT_TRUE(handle) << handle.status().to_string();
    auto health = (*handle)->health();
    ASSERT_TRUE(health) << health.status().to_string();
    EXPECT_EQ(health->actor_id, a.actor_id);
    EXPECT_EQ(health->pid, a.pid);
    EXPECT_EQ(health->visible_devices, "");  // a CPU actor sees no GPU
    EXPECT_EQ(health->backend, "cpu");
  }
  auto text = cluster_.tessera({"status", "--temp-dir", cluster_.root()});
  ASSERT_EQ(text.exit_code, 0);
  for (const auto& a : actors) EXPECT_NE(text.out.find(a.actor_id), std::string::npos) << text.out;
  EXPECT_NE(text.out.find("test-driver"), std::string::npos);

  // A shutdown through the actor's own handle is reported as a clean exit.
  auto handle = ActorHandle::connect(loop_, actors[0].address, actors[0].key);
  ASSERT_TRUE(handle);
  ASSERT_TRUE((*handle)->shutdown().is_ok());
  auto death = leases[0]->wait_for_death(actors[0].actor_id, 10s);
  ASSERT_TRUE(death) << death.status().to_string();
  EXPECT_EQ(death->exit_code, 0);
}

TEST_F(ClusterTest, SigkilledActorIsReportedWithItsSignal) {
  auto cluster = connect();
  auto node = cluster->head_node();
  auto lease = node.open_lease("test-driver");
  ASSERT_TRUE(lease);
  auto actor = (*lease)->spawn({});
  ASSERT_TRUE(actor) << actor.status().to_string();
  ASSERT_EQ(::kill(actor->pid, SIGKILL), 0);
  auto death = (*lease)->wait_for_death(actor->actor_id, 10s);
  ASSERT_TRUE(death) << death.status().to_string();
  EXPECT_EQ(death->term_signal, SIGKILL);
  EXPECT_EQ(death->state, "dead");
  EXPECT_NE(death->death_reason.find("SIGKILL"), std::string::npos) << death->death_reason;
  auto listed = node.actors();
  ASSERT_TRUE(listed);
  bool found = false;
  for (const auto& a : *listed) {
    if (a.actor_id == actor->actor_id) {
      found = true;
      EXPECT_EQ(a.state, "dead");
      EXPECT_EQ(a.term_signal, SIGKILL);
    }
  }
  EXPECT_TRUE(found);
  // The daemon keeps serving: a new actor starts fine.
  auto again = (*lease)->spawn({});
  ASSERT_TRUE(again) << again.status().to_string();
}

TEST_F(ClusterTest, HeadNoticesStoppedAndFrozenDaemons) {
  std::vector<std::string> dead;
  std::vector<std::string> added;
  auto cluster = connect();
  auto sub = cluster->subscribe(
      [&](const NodeView& n) { added.push_back(n.node_id); },
      [&](const NodeView& n) { dead.push_back(n.node_id + ": " + n.death_reason); });
  ASSERT_TRUE(sub);
  std::string a = cluster_.start_member("stopped");
  std::string b = cluster_.start_member("frozen");
  ASSERT_FALSE(a.empty());
  ASSERT_FALSE(b.empty());

  // A graceful stop: the daemon tells the head it leaves.
  ASSERT_EQ(::kill(cluster_.daemon_pid(a), SIGTERM), 0);
  loop_.run_for(10s, [&] { return !dead.empty(); });
  ASSERT_EQ(dead.size(), 1u);
  EXPECT_EQ(dead[0].rfind(a, 0), 0u) << dead[0];
  EXPECT_NE(dead[0].find("stopped"), std::string::npos) << dead[0];

  // A frozen daemon keeps its connection but stops beating: dead after 5 missed beats.
  int frozen_pid = cluster_.daemon_pid(b);
  ASSERT_GT(frozen_pid, 0);
  ASSERT_EQ(::kill(frozen_pid, SIGSTOP), 0);
  loop_.run_for(10s, [&] { return dead.size() >= 2; });
  ::kill(frozen_pid, SIGCONT);
  ASSERT_EQ(dead.size(), 2u);
  EXPECT_NE(dead[1].find("missed 5 heartbeats"), std::string::npos) << dead[1];

  // Thawed, it learns it was declared dead and registers again.
  added.clear();
  loop_.run_for(10s, [&] { return !added.empty(); });
  ASSERT_EQ(added.size(), 1u);
  EXPECT_EQ(added[0], b);
  auto nodes = cluster->nodes();
  ASSERT_TRUE(nodes);
  EXPECT_EQ(nodes->size(), 2u);  // head + the thawed one
}

TEST_F(ClusterTest, OwnerThatDisconnectsLeavesNoActorBehind) {
  int pipefd[2];
  ASSERT_EQ(::pipe(pipefd), 0);
  std::string head = head_;
  std::string token = cluster_.token();
  int code = run_in_child([&]() {
    ::close(pipefd[0]);
    EventLoop loop;
    auto cluster = ClusterClient::connect(loop, head, token);
    if (!cluster) return 10;
    auto lease = (*cluster)->head_node().open_lease("short-lived-owner");
    if (!lease) return 11;
    int pids[2];
    for (int& pid : pids) {
      auto actor = (*lease)->spawn({});
      if (!actor) return 12;
      pid = actor->pid;
    }
    if (::write(pipefd[1], pids, sizeof(pids)) != sizeof(pids)) return 13;
    return 0;  // exits without closing anything: the OS drops the connection
  });
  ::close(pipefd[1]);
  ASSERT_EQ(code, 0);
  int pids[2] = {0, 0};
  ASSERT_EQ(::read(pipefd[0], pids, sizeof(pids)), static_cast<ssize_t>(sizeof(pids)));
  ::close(pipefd[0]);
  for (int pid : pids) {
    EXPECT_TRUE(wait_until([&] { return !process_alive(pid); }, 10s)) << "actor " << pid;
  }
  auto cluster = connect();
  auto node = cluster->head_node();
  auto actors = node.actors();
  ASSERT_TRUE(actors);
  for (const auto& a : *actors) EXPECT_EQ(a.state, "dead") << a.actor_id;
}

TEST_F(ClusterTest, LeaseWhoseTtlLapsesLosesItsActors) {
  auto cluster = connect();
  auto lease = cluster->head_node().open_lease("ttl-owner", /*ttl_ms=*/300);
  ASSERT_TRUE(lease);
  auto actor = (*lease)->spawn({});
  ASSERT_TRUE(actor) << actor.status().to_string();
  // Renewals keep it alive well past the TTL...
  loop_.run_for(900ms);
  EXPECT_TRUE(process_alive(actor->pid));
  // ...and without them it lapses.
  (*lease)->stop_renewing();
  auto death = (*lease)->wait_for_death(actor->actor_id, 10s);
  ASSERT_TRUE(death) << death.status().to_string();
  // The daemon sends SIGTERM; the actor handles it and exits cleanly.
  EXPECT_EQ(death->exit_code, 0) << death->death_reason;
  Status st = (*lease)->renew();
  EXPECT_EQ(st.code(), Code::kFailedPrecondition) << st.to_string();
  EXPECT_NE(st.message().find("TTL"), std::string::npos) << st.message();
}

TEST_F(ClusterTest, ObjectStorePassesDataAcrossProcesses) {
  auto cluster = connect();
  auto node = cluster->head_node();
  auto lease = node.open_lease("writer");
  ASSERT_TRUE(lease);
  const size_t size = 1 << 20;
  auto segment = (*lease)->create_object("weights-0", size);
  ASSERT_TRUE(segment) << segment.status().to_string();
  {
    auto mapped = ShmSegment::open(*segment, /*writable=*/true);
    ASSERT_TRUE(mapped) << mapped.status().to_string();
    auto* p = static_cast<uint8_t*>(mapped->data());
    for (size_t i = 0; i < size; ++i) p[i] = static_cast<uint8_t>((i * 131) ^ (i >> 9));
  }
  ASSERT_TRUE((*lease)->seal_object("weights-0").is_ok());
  auto ref = (*lease)->get_object("weights-0");
  ASSERT_TRUE(ref) << ref.status().to_string();
  ASSERT_EQ(ref->second, size);
  // Another process the writer hands the segment name to maps it and checks every byte.
  std::string name = ref->first;
  pid_t reader = ::fork();
  if (reader == 0) {
    auto m = ShmSegment::open(name, /*writable=*/false);
    if (!m || m->size() != size) _exit(13);
    const auto* p = static_cast<const uint8_t*>(m->data());
    for (size_t i = 0; i < size; ++i) {
      if (p[i] != static_cast<uint8_t>((i * 131) ^ (i >> 9))) _exit(14);
    }
    _exit(0);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(reader, &status, 0), reader);
  EXPECT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
  ASSERT_TRUE((*lease)->release_object("weights-0").is_ok());

  // Capacity: the head was started with 4 MiB.
  auto big = (*lease)->create_object("too-big", 8 << 20);
  ASSERT_FALSE(big);
  EXPECT_EQ(big.status().code(), Code::kResourceExhausted);
  EXPECT_NE(big.status().message().find("object store full"), std::string::npos)
      << big.status().message();
  auto store = node.object_store();
  ASSERT_TRUE(store);
  EXPECT_EQ(store->objects, 1u);
  EXPECT_EQ(store->capacity, 4u << 20);
  ASSERT_TRUE((*lease)->delete_object("weights-0").is_ok());
  EXPECT_FALSE(std::filesystem::exists("/dev/shm" + *segment));
}

TEST_F(ClusterTest, BroadcastRingFromTheDaemonReachesReadersInOtherProcesses) {
  auto cluster = connect();
  auto lease = cluster->head_node().open_lease("driver");
  ASSERT_TRUE(lease);
  auto segment = (*lease)->create_ring("steps", 256, 4, 2);
  ASSERT_TRUE(segment) << segment.status().to_string();
  constexpr int kMessages = 200;
  std::vector<pid_t> readers;
  for (uint32_t r = 0; r < 2; ++r) {
    pid_t pid = ::fork();
    if (pid == 0) {
      auto ring = ShmRing::open(*segment);
      if (!ring) _exit(10);
      auto reader = ring->reader(r);
      if (!reader) _exit(11);
      for (int i = 0; i < kMessages; ++i) {
        auto msg = reader->read(10s);
        if (!msg) _exit(12);
        std::string text(reinterpret_cast<const char*>(msg->data()), msg->size());
        if (text != "step " + std::to_string(i)) _exit(13);
      }
      _exit(0);
    }
    readers.push_back(pid);
  }
  auto ring = ShmRing::open(*segment);
  ASSERT_TRUE(ring) << ring.status().to_string();
  auto writer = ring->writer();
  ASSERT_TRUE(writer) << writer.status().to_string();
  for (int i = 0; i < kMessages; ++i) {
    std::string text = "step " + std::to_string(i);
    ASSERT_TRUE(writer->write(std::as_bytes(std::span(text.data(), text.size())), 10s).is_ok());
  }
  for (pid_t pid : readers) {
    int status = 0;
    ASSERT_EQ(::waitpid(pid, &status, 0), pid);
    EXPECT_EQ(WEXITSTATUS(status), 0);
  }
  // The ring is the lease's: it is unlinked when the lease goes.
  lease->reset();
  EXPECT_TRUE(wait_until(
      [&] {
        loop_.run_for(10ms);
        return !std::filesystem::exists("/dev/shm" + *segment);
      },
      10s));
}

// ---- Bad input: each a clear error, and the daemon keeps serving --------------------------

TEST_F(ClusterTest, UnreachableHeadIsAClearErrorAndNonZeroExit) {
  auto r = cluster_.tessera({"start", "--address", "127.0.0.1:1", "--temp-dir", cluster_.root()});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("cannot reach 127.0.0.1:1"), std::string::npos) << r.err;
  auto s = cluster_.tessera({"status", "--address", "127.0.0.1:1", "--temp-dir", cluster_.root()});
  EXPECT_EQ(s.exit_code, 1);
  EXPECT_NE(s.err.find("connection refused"), std::string::npos) << s.err;
}

TEST_F(ClusterTest, PortInUseIsAClearErrorAndNonZeroExit) {
  std::string port = head_.substr(head_.rfind(':') + 1);
  auto r = cluster_.tessera(
      {"start", "--head", "--port", port, "--temp-dir", cluster_.root() + "/other"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("already in use"), std::string::npos) << r.err;
  EXPECT_TRUE(connect() != nullptr);  // the first head is unharmed
}

TEST_F(ClusterTest, ProtocolVersionMismatchNamesBothVersions) {
  auto conn = rpc::connect(loop_.io(), head_, "test", cluster_.token(), 5 * kj::SECONDS,
                           rpc::kProtocolVersion + 7)
                  .wait(loop_.wait_scope());
  ASSERT_FALSE(conn);
  EXPECT_EQ(conn.status().code(), Code::kFailedPrecondition);
  std::string v_them = "v" + std::to_string(rpc::kProtocolVersion + 7);
  std::string v_us = "v" + std::to_string(rpc::kProtocolVersion);
  EXPECT_NE(conn.status().message().find(v_them), std::string::npos) << conn.status().message();
  EXPECT_NE(conn.status().message().find(v_us), std::string::npos) << conn.status().message();
  EXPECT_TRUE(connect() != nullptr);
}

TEST_F(ClusterTest, GarbageOnTheRpcPortIsDroppedAndTheDaemonKeepsServing) {
  auto parsed = rpc::split_host_port(head_);
  ASSERT_TRUE(parsed);
  std::mt19937 rng(42);
  for (int round = 0; round < 5; ++round) {
    int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(parsed->second);
    ::inet_pton(AF_INET, parsed->first.c_str(), &addr.sin_addr);
    ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    std::vector<uint32_t> junk(4096);
    for (auto& w : junk) w = rng();
    if (round == 0) junk[0] = 0xffffffffu;  // an absurd segment count
    ssize_t ignored = ::send(fd, junk.data(), junk.size() * 4, MSG_NOSIGNAL);
    (void)ignored;
    ::close(fd);
  }
  auto cluster = connect();
  ASSERT_TRUE(cluster);
  EXPECT_TRUE(cluster->nodes());
  auto text = cluster_.tessera(
      {"status", "--address", head_, "--cluster-token-file", cluster_.root() + "/cluster_token"});
  EXPECT_EQ(text.exit_code, 0) << text.err;
}

TEST_F(ClusterTest, AnActorThatFailsToStartIsAClearError) {
  auto cluster = connect();
  auto lease = cluster->head_node().open_lease("driver");
  ASSERT_TRUE(lease);
  auto bad_gpu = (*lease)->spawn({.gpus = {7}});
  ASSERT_FALSE(bad_gpu);
  EXPECT_EQ(bad_gpu.status().code(), Code::kInvalidArgument);
  auto ok = (*lease)->spawn({});
  EXPECT_TRUE(ok) << ok.status().to_string();

  // A node whose operator installed a broken actor: the error has its exit and its log.
  TestCluster broken;
  std::string dir = broken.root() + "/bin";
  std::filesystem::create_directories(dir);
  {
    std::ofstream script(dir + "/tessera-actor");
    script << "#!/bin/sh\necho 'fake actor: cannot open the GPU' >&2\nexit 3\n";
  }
  std::filesystem::permissions(dir + "/tessera-actor", std::filesystem::perms::owner_all);
  std::string head = broken.start_head({"--actor-bin-dir", dir});
  ASSERT_FALSE(head.empty()) << broken.last().err;
  auto c = ClusterClient::connect(loop_, head, broken.token());
  ASSERT_TRUE(c) << c.status().to_string();
  auto l = (*c)->head_node().open_lease("driver");
  ASSERT_TRUE(l);
  auto failing = (*l)->spawn({});
  ASSERT_FALSE(failing);
  EXPECT_NE(failing.status().message().find("exited with code 3 before serving"), std::string::npos)
      << failing.status().message();
  EXPECT_NE(failing.status().message().find("fake actor: cannot open the GPU"), std::string::npos)
      << failing.status().message();
}

TEST(ClusterCliTest, UsageErrorsExitWithTwo) {
  TestCluster cluster;
  auto both = cluster.tessera(
      {"start", "--head", "--address", "127.0.0.1:6380", "--temp-dir", cluster.root()});
  EXPECT_EQ(both.exit_code, 2);
  EXPECT_NE(both.err.find("exactly one of --head"), std::string::npos) << both.err;
  auto none = cluster.tessera({"status", "--temp-dir", cluster.root()});
  EXPECT_EQ(none.exit_code, 1);
  EXPECT_NE(none.err.find("tessera start --head"), std::string::npos) << none.err;
  auto stop = cluster.tessera({"stop", "--temp-dir", cluster.root()});
  EXPECT_EQ(stop.exit_code, 0);
  EXPECT_NE(stop.out.find("No Tessera daemons"), std::string::npos);
}

// The fake NVML library (tests/daemon): the build's path, unless $TESSERA_TEST_DIR says where
// the test binaries were copied.
std::string fake_nvml() {
  const char* dir = std::getenv("TESSERA_TEST_DIR");
  return dir != nullptr ? std::string(dir) + "/libtessera_fake_nvml.so"
                        : std::string(TESSERA_FAKE_NVML_PATH);
}

// Two daemons on one host as two nodes of one GPU each, on the fake NVML's two GPUs: the head
// is given GPU 0 with --gpus, the member GPU 1 through CUDA_VISIBLE_DEVICES (as Ray reads it).
// Each node offers only its own GPU, spawns an actor on it (CUDA_VISIBLE_DEVICES = its NVML
// index) and refuses the other's; a list naming no GPU of the machine fails the start, naming
// the entry.
TEST(GpuSubsetTest, TwoDaemonsOnOneHostOfferOneGpuEach) {
  TestCluster cluster;
  const std::string nvml = fake_nvml();
  ASSERT_FALSE(cluster.start_head({"--nvml-library", nvml, "--gpus", "0"}).empty())
      << cluster.last().out << cluster.last().err;
  auto member =
      cluster.tessera({"start", "--address", cluster.head_address(), "--temp-dir", cluster.root(),
                       "--node-name", "second", "--nvml-library", nvml},
                      60s, {"TESSERA_TMPDIR=" + cluster.root(), "CUDA_VISIBLE_DEVICES=1"});
  ASSERT_EQ(member.exit_code, 0) << member.out << member.err;
  EventLoop loop;
  auto client = ClusterClient::connect(loop, cluster.head_address(), cluster.token());
  ASSERT_TRUE(client) << client.status().to_string();
  auto nodes = (*client)->nodes();
  ASSERT_TRUE(nodes) << nodes.status().to_string();
  ASSERT_EQ(nodes->size(), 2u);
  std::vector<std::unique_ptr<LeaseHandle>> leases;
  for (uint32_t i = 0; i < 2; ++i) {
    const NodeResources& res = (*nodes)[i].resources;
    ASSERT_EQ(res.gpus.size(), 1u) << (*nodes)[i].name;
    EXPECT_EQ(res.gpus[0].index, i);
    ASSERT_EQ(res.links.size(), 1u);
    auto node = (*client)->node((*nodes)[i].node_id);
    ASSERT_TRUE(node) << node.status().to_string();
    auto lease = node->open_lease("gpu-subset");
    ASSERT_TRUE(lease) << lease.status().to_string();
    auto refused = (*lease)->spawn({.gpus = {1 - i}, .name = "the-other-gpu"});
    ASSERT_FALSE(refused);
    EXPECT_NE(refused.status().message().find("offers GPU(s) " + std::to_string(i)),
              std::string::npos)
        << refused.status().to_string();
    auto actor = (*lease)->spawn({.gpus = {i}, .name = "gpu" + std::to_string(i)});
    ASSERT_TRUE(actor) << actor.status().to_string();
    auto handle = ActorHandle::connect(loop, actor->address, actor->key);
    ASSERT_TRUE(handle) << handle.status().to_string();
    auto health = (*handle)->health();
    ASSERT_TRUE(health) << health.status().to_string();
    EXPECT_EQ(health->visible_devices, std::to_string(i));
    leases.push_back(std::move(*lease));
  }
  TestCluster other;
  auto bad = other.tessera({"start", "--head", "--port", "0", "--temp-dir", other.root(),
                            "--nvml-library", nvml, "--gpus", "0,5"},
                           60s, {"TESSERA_TMPDIR=" + other.root()});
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE((bad.out + bad.err).find("entry '5' names no GPU"), std::string::npos)
      << bad.out << bad.err;
}

}  // namespace
}  // namespace tessera
