// Cap'n Proto RPC plumbing shared by the daemon, the actors and the driver.
//
// Every endpoint serves a proto::Gateway as its bootstrap capability; a peer calls
// Gateway.hello with its protocol version and gets the endpoint's capabilities back. Errors
// travel as Cap'n Proto exceptions whose description is "CODE: message" (Status::to_string);
// to_status() turns them back into a Status on the calling side, so no exception leaves this
// layer's callers.
#pragma once

#include <capnp/rpc-twoparty.h>
#include <kj/async-io.h>
#include <kj/async.h>

#include <cstdint>
#include <functional>
#include <string>

#include "common/status.h"
#include "protocol/gateway.capnp.h"

namespace tessera::rpc {

inline constexpr uint32_t kProtocolVersion = proto::PROTOCOL_VERSION;

// Human name of a role: "head", "node daemon", "actor".
const char* role_name(proto::Role role);

// Throws (inside an RPC method) an exception that to_status() maps back to `status`.
[[noreturn]] void throw_status(const Status& status);

// Runs `fn` and returns its Status, catching any kj exception (local or remote).
Status to_status(const kj::Exception& e);

// Server side of the handshake: throws FAILED_PRECONDITION naming both versions when the
// peer's version is not ours.
void require_version(uint32_t peer_version, kj::StringPtr peer, proto::Role our_role);

// Client side of the handshake: the same check on the version the server answered.
Status check_server_version(uint32_t server_version, proto::Role server_role,
                            const std::string& address);

// Accepts TCP connections and gives each its own two-party RpcSystem with `gateway` as the
// bootstrap. A connection that sends garbage or drops is logged and closed; the server goes on.
class RpcServer final : private kj::TaskSet::ErrorHandler {
 public:
  // Binds `address` ("0.0.0.0:6380", "127.0.0.1:0"). Fails with UNAVAILABLE naming the address
  // when the port is in use or the host is not local.
  static Expected<kj::Own<RpcServer>> listen(kj::AsyncIoContext& io, const std::string& address,
                                             proto::Gateway::Client gateway, std::string label);
  ~RpcServer();

  // The bound port (useful with port 0).
  uint16_t port() const { return port_; }
  // Connections currently open.
  size_t connections() const { return connections_; }

  RpcServer(kj::Own<kj::ConnectionReceiver> listener, proto::Gateway::Client gateway,
            std::string label);

 private:
  kj::Promise<void> accept_loop();
  void taskFailed(kj::Exception&& exception) override;

  kj::Own<kj::ConnectionReceiver> listener_;
  proto::Gateway::Client gateway_;
  std::string label_;
  uint16_t port_ = 0;
  size_t connections_ = 0;
  kj::TaskSet tasks_;
};

// One client connection to a Tessera endpoint, after a successful hello.
struct Connection {
  kj::Own<kj::AsyncIoStream> stream;
  kj::Own<capnp::TwoPartyClient> client;
  proto::Gateway::Client gateway{nullptr};
  proto::Role role = proto::Role::NODE;
  std::string server_id;
  std::string address;
  proto::Cluster::Client cluster{nullptr};  // set when role == HEAD
  proto::Node::Client node{nullptr};        // set for HEAD and NODE
  proto::Actor::Client actor{nullptr};      // set for ACTOR
  bool has_cluster = false;
  bool has_node = false;
  bool has_actor = false;

  // Resolves when the peer disconnects.
  kj::Promise<void> on_disconnect() { return client->onDisconnect(); }
};

// Connects to `address` ("host:port"), says hello as `peer` and checks the version.
// Resolves to an error Status (never throws): UNAVAILABLE when nothing answers within
// `timeout`, FAILED_PRECONDITION on a version mismatch.
kj::Promise<Expected<kj::Own<Connection>>> connect(kj::AsyncIoContext& io,
                                                   const std::string& address,
                                                   const std::string& peer,
                                                   kj::Duration timeout = 10 * kj::SECONDS,
                                                   uint32_t version = kProtocolVersion);

// Splits "host:port". Fails on a missing or out-of-range port.
Expected<std::pair<std::string, uint16_t>> split_host_port(const std::string& address);

}  // namespace tessera::rpc
