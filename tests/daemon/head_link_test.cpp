// A member daemon's link to its head, against a real head in this process: the cluster registry
// served by an RpcServer on 127.0.0.1, as Daemon::start makes it. Joining, heartbeats, leaving,
// refusals (wrong token, not a head, nothing there, no answer, a taken node id), and re-joining
// after the head goes away and comes back on the same port. Everything runs on one event loop.
#include "daemon/head_link.h"

#include <capnp/message.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "daemon/actor_supervisor.h"
#include "daemon/cluster_registry.h"
#include "daemon/node_service.h"
#include "daemon/object_store.h"

namespace tessera {
namespace {

const std::string kToken = "0123456789abcdef-head-link-test";
const std::string kSecret = "node-secret-0123456789abcdef";
// Heartbeats every 50 ms; 10 missed (500 ms) make a node dead, and make the link give up on a
// heartbeat. Short enough for fast tests, long enough for a loaded sanitizer run.
const RegistryConfig kRegistry{50, 10};

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// A head: the registry, granted to peers that prove the token, on `port` (0 = any).
struct Head {
  std::unique_ptr<ClusterRegistry> registry;
  kj::Own<rpc::RpcServer> server;
  std::string address;

  Head(kj::AsyncIoContext& io, uint16_t port, const std::string& token = kToken,
       proto::Role role = proto::Role::HEAD)
      : registry(std::make_unique<ClusterRegistry>(io, kRegistry)) {
    rpc::Endpoint e;
    e.role = role;
    e.server_id = "n-head";
    e.secret = token;
    ClusterRegistry* r = registry.get();
    const bool grant_cluster = role == proto::Role::HEAD;
    e.grant = [r, grant_cluster](proto::Handshake::AuthenticateResults::Builder out) {
      if (grant_cluster) out.setCluster(r->client());
    };
    auto listening =
        rpc::RpcServer::listen(io, "127.0.0.1:" + std::to_string(port), std::move(e), "test head");
    EXPECT_TRUE(listening) << listening.status().to_string();
    if (listening) {
      server = kj::mv(*listening);
      address = "127.0.0.1:" + std::to_string(server->port());
    }
  }
  ~Head() {
    server = nullptr;  // connections first: their sessions call back into the registry
    registry.reset();
  }

  // The registry's members (alive only, or the dead too), as `tessera status` lists them.
  struct Listed {
    std::string node_id;
    std::string address;
    bool alive = false;
    std::string death_reason;
    uint64_t memory_available = 0;
  };
  std::vector<Listed> members(bool include_dead = false) const {
    capnp::MallocMessageBuilder msg;
    auto list = msg.initRoot<proto::Cluster::ListNodesResults>();
    registry->fill_nodes(include_dead, list);
    std::vector<Listed> out;
    for (auto n : list.getNodes()) {
      auto info = n.getInfo();
      out.push_back({info.getNodeId().cStr(), info.getAddress().cStr(), info.getAlive(),
                     info.getDeathReason().cStr(), info.getResources().getMemoryAvailable()});
    }
    return out;
  }
};

// A member daemon's node service (no actors are started) and its link to the head.
struct Member {
  ObjectStore objects;
  ActorSupervisor actors;
  uint64_t memory_available = 1000;  // what the node reports; heartbeats carry it
  NodeService node;
  std::unique_ptr<HeadLink> link;

  Member(kj::AsyncIoContext& io, const std::string& head_address, const std::string& token = kToken,
         const std::string& node_id = "n-member", const std::string& secret = kSecret)
      : objects(ObjectStoreOptions{"/tessera-hl-" + std::to_string(::getpid()) + "-obj-", 1 << 20,
                                   0, 16}),
        actors(io, supervisor_config(node_id)),
        node(io, identity(node_id), actors, objects,
             [this] {
               NodeResources r;
               r.cpus = 2;
               r.memory_total = 4096;
               r.memory_available = memory_available;
               return r;
             }),
        link(std::make_unique<HeadLink>(io, head_address, "node daemon " + node_id, token,
                                        secret)) {}
  ~Member() { link.reset(); }  // before the node it points at

  static SupervisorConfig supervisor_config(const std::string& node_id) {
    SupervisorConfig c;
    c.node_id = node_id;
    c.bin_dir = "/nonexistent-head-link-test";
    c.log_dir = "/tmp";
    c.listen_host = "127.0.0.1";
    c.health_timeout_ms = 0;
    return c;
  }
  static NodeIdentity identity(const std::string& node_id) {
    NodeIdentity id;
    id.node_id = node_id;
    id.name = "member";
    id.address = "127.0.0.1:7001";
    id.shm_prefix = "/tessera-hl-" + std::to_string(::getpid()) + "-";
    return id;
  }
};

class HeadLinkTest : public ::testing::Test {
 protected:
  // Runs the loop until `done` (checked every 5 ms) or `max_ms` pass; whether it came true.
  bool run_until(const std::function<bool()>& done, int max_ms = 10000) {
    for (int waited = 0; waited < max_ms; waited += 5) {
      if (done()) return true;
      io_.provider->getTimer().afterDelay(5 * kj::MILLISECONDS).wait(io_.waitScope);
    }
    return done();
  }
  void run_for(int ms) { io_.provider->getTimer().afterDelay(ms * kj::MILLISECONDS).wait(ws()); }
  kj::WaitScope& ws() { return io_.waitScope; }

  Status join(Member& m) {
    Status st = m.link->connect(2 * kj::SECONDS).wait(ws());
    if (!st) return st;
    return m.link->register_and_beat(m.node).wait(ws());
  }

  // kj types have throwing destructors: the loop lives behind a pointer, destroyed last.
  std::unique_ptr<kj::AsyncIoContext> loop_ =
      std::make_unique<kj::AsyncIoContext>(kj::setupAsyncIo());
  kj::AsyncIoContext& io_ = *loop_;
};

TEST_F(HeadLinkTest, JoinsRegistersAndHeartbeats) {
  Head head(io_, 0);
  Member m(io_, head.address);
  EXPECT_FALSE(m.link->registered());
  ASSERT_TRUE(m.link->connect(2 * kj::SECONDS).wait(ws()));
  EXPECT_EQ(m.link->local_ip(), "127.0.0.1");
  EXPECT_FALSE(m.link->registered());
  EXPECT_EQ(head.registry->alive_count(), 0u);

  Status st = m.link->register_and_beat(m.node).wait(ws());
  ASSERT_TRUE(st) << st.to_string();
  EXPECT_TRUE(m.link->registered());
  auto members = head.members();
  ASSERT_EQ(members.size(), 1u);
  EXPECT_EQ(members[0].node_id, "n-member");
  EXPECT_EQ(members[0].address, "127.0.0.1:7001");
  EXPECT_EQ(members[0].memory_available, 1000u);

  // Heartbeats carry the node's usage to the head.
  m.memory_available = 777;
  EXPECT_TRUE(run_until([&] {
    auto now = head.members();
    return now.size() == 1 && now[0].memory_available == 777u;
  }));
  // And keep it alive well past the dead-node window (500 ms).
  run_for(700);
  EXPECT_EQ(head.registry->alive_count(), 1u);
  EXPECT_TRUE(m.link->registered());
}

TEST_F(HeadLinkTest, AWrongTokenIsRefusedBeforeJoining) {
  Head head(io_, 0);
  Member m(io_, head.address, "another-cluster-token-0000");
  Status st = m.link->connect(2 * kj::SECONDS).wait(ws());
  ASSERT_FALSE(st);
  EXPECT_EQ(st.code(), Code::kPermissionDenied);
  EXPECT_TRUE(contains(st.message(), "cannot join the cluster: ")) << st.message();
  EXPECT_TRUE(contains(st.message(), "wrong cluster token")) << st.message();
  EXPECT_EQ(head.server->counters().refused, 1u);
  EXPECT_EQ(head.server->counters().authenticated, 0u);
  EXPECT_EQ(head.registry->alive_count(), 0u);
  EXPECT_FALSE(m.link->registered());
}

TEST_F(HeadLinkTest, ANodeDaemonIsNotAHead) {
  Head node_daemon(io_, 0, kToken, proto::Role::NODE);
  Member m(io_, node_daemon.address);
  Status st = m.link->connect(2 * kj::SECONDS).wait(ws());
  ASSERT_FALSE(st);
  EXPECT_EQ(st.code(), Code::kFailedPrecondition);
  EXPECT_EQ(st.message(), "cannot join the cluster: " + node_daemon.address +
                              " is a node daemon, not a head; pass the head's address to "
                              "--address");
}

TEST_F(HeadLinkTest, NothingListeningIsUnavailable) {
  std::string address;
  {
    Head gone(io_, 0);
    address = gone.address;
  }
  Member m(io_, address);
  Status st = m.link->connect(2 * kj::SECONDS).wait(ws());
  ASSERT_FALSE(st);
  EXPECT_EQ(st.code(), Code::kUnavailable);
  EXPECT_TRUE(contains(st.message(), "cannot join the cluster: cannot reach " + address))
      << st.message();
}

TEST_F(HeadLinkTest, AHeadThatNeverAnswersTimesOut) {
  // A port that accepts connections (the kernel's backlog) but never reads from them.
  auto addr = io_.provider->getNetwork().parseAddress("127.0.0.1", 0).wait(ws());
  kj::Own<kj::ConnectionReceiver> silent = addr->listen();
  const std::string address = "127.0.0.1:" + std::to_string(silent->getPort());
  Member m(io_, address);
  Status st = m.link->connect(200 * kj::MILLISECONDS).wait(ws());
  ASSERT_FALSE(st);
  EXPECT_EQ(st.code(), Code::kDeadlineExceeded);
  EXPECT_TRUE(contains(st.message(), "cannot join the cluster: ")) << st.message();
  EXPECT_TRUE(contains(st.message(), "200 ms")) << st.message();
}

TEST_F(HeadLinkTest, ANodeIdRegisteredByAnotherDaemonCannotBeTakenOver) {
  Head head(io_, 0);
  Member first(io_, head.address);
  ASSERT_TRUE(join(first));
  Member impostor(io_, head.address, kToken, "n-member", "another-secret-0123456789");
  ASSERT_TRUE(impostor.link->connect(2 * kj::SECONDS).wait(ws()));
  Status st = impostor.link->register_and_beat(impostor.node).wait(ws());
  ASSERT_FALSE(st);
  EXPECT_EQ(st.code(), Code::kPermissionDenied);
  EXPECT_TRUE(contains(st.message(), "cannot register with head " + head.address +
                                         ": node id "
                                         "n-member is registered by another daemon"))
      << st.message();
  EXPECT_FALSE(impostor.link->registered());
  EXPECT_TRUE(first.link->registered());
  EXPECT_EQ(head.registry->alive_count(), 1u);
}

TEST_F(HeadLinkTest, LeavingMarksTheNodeDeadAndStopsHeartbeats) {
  Head head(io_, 0);
  Member m(io_, head.address);
  ASSERT_TRUE(join(m));
  m.link->leave("the test is over", 2 * kj::SECONDS).wait(ws());
  EXPECT_EQ(head.registry->alive_count(), 0u);
  auto all = head.members(/*include_dead=*/true);
  ASSERT_EQ(all.size(), 1u);
  EXPECT_FALSE(all[0].alive);
  EXPECT_EQ(all[0].death_reason, "the test is over");
  // No heartbeat brings it back, nor does the link register again.
  run_for(300);
  EXPECT_EQ(head.registry->alive_count(), 0u);
}

TEST_F(HeadLinkTest, RegistersAgainWhenTheHeadComesBackOnItsPort) {
  auto head = std::make_unique<Head>(io_, 0);
  const uint16_t port = head->server->port();
  Member m(io_, head->address);
  ASSERT_TRUE(join(m));
  ASSERT_EQ(head->registry->alive_count(), 1u);

  head.reset();  // the head goes away: its connections close
  EXPECT_TRUE(run_until([&] { return !m.link->registered(); }))
      << "the failed heartbeat did not drop the registration";

  // A new head (a fresh registry) on the same address: the link reconnects (its first retry
  // is 500 ms after the failure) and registers with it on its own.
  head = std::make_unique<Head>(io_, port);
  ASSERT_TRUE(head->server);
  EXPECT_TRUE(run_until([&] { return m.link->registered(); }));
  auto members = head->members();
  ASSERT_EQ(members.size(), 1u);
  EXPECT_EQ(members[0].node_id, "n-member");
  EXPECT_TRUE(members[0].alive);
  // And heartbeats to the new head keep it there.
  m.memory_available = 555;
  EXPECT_TRUE(run_until([&] {
    auto now = head->members();
    return now.size() == 1 && now[0].memory_available == 555u;
  }));
  EXPECT_EQ(head->registry->alive_count(), 1u);
}

TEST_F(HeadLinkTest, AHeadBackWithAnotherTokenIsRefusedAndTheLinkKeepsTrying) {
  auto head = std::make_unique<Head>(io_, 0);
  const uint16_t port = head->server->port();
  Member m(io_, head->address);
  ASSERT_TRUE(join(m));
  head.reset();
  ASSERT_TRUE(run_until([&] { return !m.link->registered(); }));
  // Another cluster's head on the address: the rejoin is refused at the handshake, nothing is
  // registered, and the link goes on retrying (with a longer delay) instead of giving up.
  head = std::make_unique<Head>(io_, port, "another-cluster-token-0000");
  ASSERT_TRUE(head->server);
  EXPECT_TRUE(run_until([&] { return head->server->counters().refused >= 1; }));
  EXPECT_EQ(head->server->counters().authenticated, 0u);
  EXPECT_EQ(head->registry->alive_count(), 0u);
  EXPECT_FALSE(m.link->registered());
}

}  // namespace
}  // namespace tessera
