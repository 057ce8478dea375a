// Fuzzes every RPC method a node daemon serves to an authenticated peer: Node, Lease, Cluster
// and NodeSession, with fuzzed parameters, against the daemon's real service objects (object
// store with real shared memory, actor supervisor, cluster registry). Nothing may crash, no
// call may leave the store inconsistent, and no actor process may start (the supervisor's bin
// dir has no tessera-actor in it, and nothing from the wire can name another program).
//
// The input is a sequence of calls: [target u8][method u8][length u16 little-endian][params],
// params being a flat Cap'n Proto message (read with small limits; a message that does not
// parse is skipped). Targets: 0 Node, 1 Lease (opened by the harness), 2 Cluster, 3 NodeSession
// (registered by the harness). tests/fuzz/make_rpc_seeds.cpp writes one seed per method.
#include <unistd.h>

#include <capnp/serialize.h>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>

#include "daemon/actor_supervisor.h"
#include "daemon/cluster_registry.h"
#include "daemon/node_service.h"
#include "daemon/object_store.h"
#include "tests/fuzz/fuzz_util.h"

namespace {

using namespace tessera;

struct Daemon {
  kj::AsyncIoContext& io;
  ObjectStore objects;
  ActorSupervisor actors;
  NodeService node;
  ClusterRegistry registry;

  explicit Daemon(kj::AsyncIoContext& io)
      : io(io),
        objects(ObjectStoreOptions{"/tessera-fuzz-" + std::to_string(::getpid()) + "-obj-", 4 << 20,
                                   2 << 20, 64}),
        actors(io, supervisor_config()),
        node(io, identity(), actors, objects, [] { return NodeResources{}; }),
        registry(io, RegistryConfig{1000, 5}) {}

  static SupervisorConfig supervisor_config() {
    SupervisorConfig c;
    c.node_id = "n-fuzz";
    c.bin_dir = "/nonexistent-fuzz-bin";
    c.log_dir = "/tmp";
    c.listen_host = "127.0.0.1";
    c.gpus = {0, 1};
    c.health_timeout_ms = 0;
    return c;
  }
  static NodeIdentity identity() {
    NodeIdentity id;
    id.node_id = "n-fuzz";
    id.name = "fuzz";
    id.address = "127.0.0.1:1";
    id.is_head = true;
    id.shm_prefix = "/tessera-fuzz-" + std::to_string(::getpid()) + "-";
    return id;
  }
};

// Runs the loop until the call settles or nothing is left to do (waits bounded by the timer
// are cut short: the harness does not sleep).
void settle(kj::AsyncIoContext& io, capnp::RemotePromise<capnp::AnyPointer>&& call) {
  auto done = call.ignoreResult().eagerlyEvaluate([](kj::Exception&&) {});
  io.waitScope.poll();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static kj::AsyncIoContext* io = new kj::AsyncIoContext(kj::setupAsyncIo());
  // One daemon for the whole run, as a long-lived daemon serves peer after peer (calls still
  // waiting on a timer when an input ends keep their lease until then, as on a real daemon).
  static Daemon* daemon = new Daemon(*io);
  {
    proto::Node::Client node = daemon->node.client();
    proto::Cluster::Client cluster = daemon->registry.client();
    auto open = node.openLeaseRequest();
    open.setOwner("fuzz");
    proto::Lease::Client lease = open.send().getLease();
    auto reg = cluster.registerNodeRequest();
    reg.initInfo().setNodeId("n-member");
    std::string secret(32, 's');
    reg.setNodeSecret(kj::arrayPtr(reinterpret_cast<const kj::byte*>(secret.data()), 32));
    reg.setNode(node);
    proto::NodeSession::Client session = reg.send().getSession();
    io->waitScope.poll();

    size_t at = 0;
    while (at + 4 <= size) {
      const uint8_t target = data[at] % 4;
      const uint16_t method = data[at + 1];
      size_t length = data[at + 2] | (size_t{data[at + 3]} << 8);
      at += 4;
      length = std::min(length, size - at);
      // A flat message needs aligned words.
      auto words = kj::heapArray<capnp::word>((length + 7) / 8);
      std::memset(words.begin(), 0, words.size() * sizeof(capnp::word));
      std::memcpy(words.begin(), data + at, length);
      at += length;
      capnp::ReaderOptions limits;
      limits.traversalLimitInWords = 1 << 16;
      limits.nestingLimit = 16;
      KJ_IF_MAYBE (e, kj::runCatchingExceptions([&]() {
                     capnp::FlatArrayMessageReader message(words, limits);
                     auto params = message.getRoot<capnp::AnyPointer>();
                     capnp::Capability::Client* to = nullptr;
                     uint64_t interface = 0;
                     switch (target) {
                       case 0:
                         to = &node;
                         interface = capnp::typeId<proto::Node>();
                         break;
                       case 1:
                         to = &lease;
                         interface = capnp::typeId<proto::Lease>();
                         break;
                       case 2:
                         to = &cluster;
                         interface = capnp::typeId<proto::Cluster>();
                         break;
                       default:
                         to = &session;
                         interface = capnp::typeId<proto::NodeSession>();
                         break;
                     }
                     auto req = to->typelessRequest(interface, method, nullptr);
                     req.set(params);
                     settle(*io, req.send());
                   })) {
        (void)e;  // an unparsable message or a refused call: both are fine answers
      }
      auto stats = daemon->objects.stats();
      FUZZ_CHECK(stats.used <= stats.capacity);
      FUZZ_CHECK(daemon->actors.live_count() == 0);
    }
    // The peer goes away: its lease ends, releasing what it held.
    node = nullptr;
    lease = nullptr;
    cluster = nullptr;
    session = nullptr;
    io->waitScope.poll();
  }
  io->waitScope.poll();
  return 0;
}
