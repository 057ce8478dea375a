// Writes the seed corpora of the RPC fuzzers (not run by CI; its output is committed):
//   corpus/handshake/   what real clients send a server: a full handshake with the right token,
//                       one with a wrong token, one with an old protocol version;
//   corpus/daemon_rpc/  one well-formed call to each method of Node, Lease, Cluster and
//                       NodeSession, in daemon_rpc_fuzz's record format.
//   make_rpc_seeds <tests/fuzz/corpus>
#include <capnp/serialize.h>
#include <kj/async-io.h>

#include <cstdio>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "protocol/rpc.h"

namespace {

using namespace tessera;

void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
  std::printf("%s (%zu bytes)\n", path.c_str(), bytes.size());
}

// Copies `from` to `to` until EOF, appending what passes to `record` (if not null).
kj::Promise<void> pump(kj::AsyncIoStream& from, kj::AsyncIoStream& to, std::string* record,
                       kj::ArrayPtr<kj::byte> buf) {
  return from.tryRead(buf.begin(), 1, buf.size())
      .then([&from, &to, record, buf](size_t n) -> kj::Promise<void> {
        if (n == 0) {
          to.shutdownWrite();
          return kj::READY_NOW;
        }
        if (record != nullptr) record->append(reinterpret_cast<const char*>(buf.begin()), n);
        return to.write(buf.begin(), n).then([&from, &to, record, buf]() {
          return pump(from, to, record, buf);
        });
      });
}

// The bytes a client sends during connect() to a server with `server_token`.
std::string record_handshake(const std::string& client_token, uint32_t version) {
  auto io = kj::setupAsyncIo();
  rpc::Endpoint e;
  e.role = proto::Role::HEAD;
  e.server_id = "n-seed";
  e.secret = "seed-cluster-token-0123456789";
  e.grant = [](proto::Handshake::AuthenticateResults::Builder) {};
  auto server = rpc::RpcServer::listen(io, "127.0.0.1:0", std::move(e), "seed");
  // Client -> listener on a port of our own -> recorded pump -> server pipe.
  auto listener =
      io.provider->getNetwork().parseAddress("127.0.0.1:0").wait(io.waitScope)->listen();
  std::string address = "127.0.0.1:" + std::to_string(listener->getPort());
  auto to_server = kj::newTwoWayPipe();
  (*server)->serve(kj::mv(to_server.ends[1]));
  std::string recorded;
  auto b1 = kj::heapArray<kj::byte>(4096), b2 = kj::heapArray<kj::byte>(4096);
  kj::Own<kj::AsyncIoStream> accepted;
  auto relay = listener->accept().then([&](kj::Own<kj::AsyncIoStream> s) {
    accepted = kj::mv(s);
    return pump(*accepted, *to_server.ends[0], &recorded, b1)
        .exclusiveJoin(pump(*to_server.ends[0], *accepted, nullptr, b2));
  });
  auto relayed = relay.eagerlyEvaluate([](kj::Exception&&) {});
  auto conn = rpc::connect(io, address, "driver", client_token, 5 * kj::SECONDS, version)
                  .wait(io.waitScope);
  io.provider->getTimer().afterDelay(50 * kj::MILLISECONDS).wait(io.waitScope);
  return recorded;
}

template <typename Params>
std::string record(uint8_t target, uint8_t method,
                   const std::function<void(typename Params::Builder)>& fill) {
  capnp::MallocMessageBuilder message;
  fill(message.initRoot<Params>());
  auto words = capnp::messageToFlatArray(message);
  auto bytes = words.asBytes();
  std::string out;
  out += static_cast<char>(target);
  out += static_cast<char>(method);
  out += static_cast<char>(bytes.size() & 0xff);
  out += static_cast<char>((bytes.size() >> 8) & 0xff);
  out.append(reinterpret_cast<const char*>(bytes.begin()), bytes.size());
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: make_rpc_seeds <tests/fuzz/corpus>\n");
    return 2;
  }
  std::string dir = argv[1];
  write_file(dir + "/handshake/right_token", record_handshake("seed-cluster-token-0123456789", 2));
  write_file(dir + "/handshake/wrong_token", record_handshake("other-cluster-token-000000", 2));
  write_file(dir + "/handshake/old_version", record_handshake("seed-cluster-token-0123456789", 1));

  using proto::Cluster;
  using proto::Lease;
  using proto::Node;
  using proto::NodeSession;
  std::string d = dir + "/daemon_rpc/";
  write_file(d + "node_info", record<Node::InfoParams>(0, 0, [](auto) {}));
  write_file(d + "node_open_lease", record<Node::OpenLeaseParams>(0, 1, [](auto p) {
               p.setOwner("driver");
               p.setTtlMs(1000);
             }));
  write_file(d + "node_list_actors", record<Node::ListActorsParams>(0, 2, [](auto) {}));
  write_file(d + "node_shm_segments", record<Node::ShmSegmentsParams>(0, 3, [](auto) {}));
  write_file(d + "lease_spawn", record<Lease::SpawnActorParams>(1, 0, [](auto p) {
               auto spec = p.initSpec();
               spec.initGpus(1).set(0, 1);
               auto env = spec.initEnv(2);
               env[0].setName("NCCL_DEBUG");
               env[0].setValue("INFO");
               env[1].setName("LD_PRELOAD");
               env[1].setValue("/tmp/x.so");
               spec.setName("worker");
               spec.setReadyTimeoutMs(100);
             }));
  write_file(d + "lease_kill", record<Lease::KillActorParams>(1, 1, [](auto p) {
               p.setActorId("a-00000000");
               p.setForce(true);
             }));
  write_file(d + "lease_renew", record<Lease::RenewParams>(1, 2, [](auto) {}));
  write_file(d + "lease_list", record<Lease::ListActorsParams>(1, 3, [](auto) {}));
  std::string objects;
  objects += record<Lease::CreateObjectParams>(1, 4, [](auto p) {
    p.setId("weights.0");
    p.setSize(4096);
  });
  objects += record<Lease::SealObjectParams>(1, 5, [](auto p) { p.setId("weights.0"); });
  objects += record<Lease::GetObjectParams>(1, 6, [](auto p) {
    p.setId("weights.0");
    p.setTimeoutMs(10);
  });
  objects += record<Lease::ReleaseObjectParams>(1, 7, [](auto p) { p.setId("weights.0"); });
  objects += record<Lease::DeleteObjectParams>(1, 8, [](auto p) { p.setId("weights.0"); });
  write_file(d + "lease_objects", objects);
  write_file(d + "lease_ring", record<Lease::CreateRingParams>(1, 9, [](auto p) {
               p.setName("steps");
               p.setSlotBytes(4096);
               p.setSlots(4);
               p.setReaders(2);
             }));
  write_file(d + "cluster_register", record<Cluster::RegisterNodeParams>(2, 0, [](auto p) {
               auto info = p.initInfo();
               info.setNodeId("n-member");
               info.setName("member");
               info.setAddress("10.0.0.2:4000");
               std::string secret(32, 'z');
               p.setNodeSecret(
                   kj::arrayPtr(reinterpret_cast<const kj::byte*>(secret.data()), secret.size()));
             }));
  write_file(d + "cluster_list",
             record<Cluster::ListNodesParams>(2, 1, [](auto p) { p.setIncludeDead(true); }));
  write_file(d + "cluster_subscribe", record<Cluster::SubscribeParams>(2, 2, [](auto) {}));
  write_file(d + "session_heartbeat", record<NodeSession::HeartbeatParams>(3, 0, [](auto p) {
               auto usage = p.initUsage();
               usage.setMemoryAvailable(1 << 30);
               usage.initGpuMemoryUsed(2).set(1, 12345);
               usage.setActors(3);
             }));
  write_file(d + "session_leave",
             record<NodeSession::LeaveParams>(3, 1, [](auto p) { p.setReason("bye"); }));
  return 0;
}
