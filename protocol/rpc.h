// Cap'n Proto RPC plumbing shared by the daemon, the actors and the driver.
//
// Every endpoint serves a proto::Gateway as its bootstrap capability. A peer says hello with its
// protocol version, checks the server's proof of the endpoint's secret, then proves it knows the
// secret itself (protocol/auth.h, protocol/gateway.capnp); only then does it get the endpoint's
// capabilities. Errors travel as Cap'n Proto exceptions whose description is "CODE: message"
// (Status::to_string); to_status() turns them back into a Status on the calling side, so no
// exception leaves this layer's callers.
#pragma once

#include <capnp/rpc-twoparty.h>
#include <kj/async-io.h>
#include <kj/async.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <unordered_map>

#include "common/status.h"
#include "protocol/gateway.capnp.h"

namespace tessera::rpc {

inline constexpr uint32_t kProtocolVersion = proto::PROTOCOL_VERSION;

// Human name of a role: "head", "node daemon", "actor".
const char* role_name(proto::Role role);
// What guards a role's port: "cluster token" for daemons, "actor key" for actors.
const char* secret_name(proto::Role role);

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

// What one server lets each peer use. Every limit is an error the peer sees, never a crash.
struct ServerLimits {
  // Connections open at once, authenticated or not. Beyond it a new peer's hello fails with
  // RESOURCE_EXHAUSTED naming the limit, and the connection is closed.
  uint32_t max_connections = 512;
  // The largest Cap'n Proto message an authenticated peer may send (bigger ones close its
  // connection).
  uint64_t max_message_bytes = 64ull << 20;
  // Bytes of a connection's calls still running before the server stops reading from it.
  uint64_t max_inflight_bytes = 256ull << 20;
  // A peer that has not authenticated by then is disconnected.
  uint32_t handshake_timeout_ms = 10000;
  // The largest message a peer may send before it has proved the secret (the bootstrap, hello
  // and authenticate messages of a real handshake take well under 1 KiB). A frame that declares
  // more closes the connection before its body is read, so an unauthenticated peer costs at
  // most this much memory, not max_message_bytes.
  uint64_t max_unauthenticated_message_bytes = 16ull << 10;
  // Connections from one IP address that have not authenticated yet. A new connection from an
  // address already at the limit is closed before anything is read from it (logged,
  // rate-limited); authenticated connections do not count. 0 = no limit.
  uint32_t max_unauthenticated_per_address = 16;
};

// What a server is, and what it hands to a peer that proved its secret.
struct Endpoint {
  proto::Role role = proto::Role::NODE;
  std::string server_id;  // node id or actor id
  std::string secret;     // the cluster token (daemons) or the actor key (actors)
  // Sets the capabilities of an authenticated peer.
  std::function<void(proto::Handshake::AuthenticateResults::Builder)> grant;
};

// Accepts TCP connections and gives each its own two-party RpcSystem whose bootstrap is an
// authenticating Gateway for `endpoint`. A connection that sends garbage, fails the handshake
// or drops is logged (naming the peer's address) and closed; the server goes on. Until a peer
// has authenticated it may send only small messages, and each address may hold only a few such
// connections (ServerLimits), so unauthenticated peers cannot make the server buffer much.
// Accept errors (EMFILE, ENFILE, ENOBUFS, ...) back off and retry: the server keeps accepting
// once descriptors free up.
class RpcServer final : private kj::TaskSet::ErrorHandler {
 public:
  // Binds `address` ("10.0.0.1:6380", "127.0.0.1:0"). Fails with UNAVAILABLE naming the address
  // when the port is in use or the host is not local.
  static Expected<kj::Own<RpcServer>> listen(kj::AsyncIoContext& io, const std::string& address,
                                             Endpoint endpoint, std::string label,
                                             ServerLimits limits = {});
  ~RpcServer();

  // The bound port (useful with port 0).
  uint16_t port() const { return port_; }
  // Connections currently open.
  size_t connections() const { return connections_; }

  struct Counters {
    uint64_t accepted = 0;
    uint64_t authenticated = 0;
    uint64_t refused = 0;        // wrong or missing secret, wrong version, over the limit
    uint64_t accept_errors = 0;  // failed accept() calls (out of descriptors, ...)
    // The largest message (bytes, framing included) the server read from a peer that had not
    // authenticated yet (refused bigger ones are never read, so they do not count).
    uint64_t largest_unauthenticated_message = 0;
  };
  const Counters& counters() const { return counters_; }

  RpcServer(kj::AsyncIoContext& io, kj::Own<kj::ConnectionReceiver> listener, Endpoint endpoint,
            std::string label, ServerLimits limits);

  struct ConnectionState;  // per connection: peer address, handshake progress

  // Serves one already-connected stream exactly as an accepted connection (limits, handshake,
  // logging). The accept loop uses it; tests and fuzzers hand it in-memory pipes.
  void serve(kj::Own<kj::AsyncIoStream> stream);

 private:
  kj::Promise<void> accept_loop();
  kj::Promise<void> accept_failed(kj::Exception&& e);
  void taskFailed(kj::Exception&& exception) override;
  void log_refusal(const std::string& line);
  // Gives back the slot an unauthenticated connection from `host` held.
  void release_unauthenticated(const std::string& host);

  kj::AsyncIoContext& io_;
  kj::Own<kj::ConnectionReceiver> listener_;
  std::shared_ptr<const Endpoint> endpoint_;  // shared with each connection's gateway
  std::string label_;
  ServerLimits limits_;
  uint16_t port_ = 0;
  size_t connections_ = 0;
  Counters counters_;
  uint32_t accept_backoff_ms_ = 0;  // 0 while accept() works
  uint64_t refusal_window_start_ms_ = 0;
  uint32_t refusals_in_window_ = 0;
  uint32_t refusals_suppressed_ = 0;
  // Connections not yet authenticated, per peer IP address (see ServerLimits).
  std::unordered_map<std::string, uint32_t> unauthenticated_by_host_;
  std::shared_ptr<int> alive_ = std::make_shared<int>(0);  // expires with the server
  kj::TaskSet tasks_;
};

// One client connection to a Tessera endpoint, after a successful handshake.
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

// Connects to `address` ("host:port") as `peer`, checks the version and runs the handshake with
// `secret` (the cluster token for a daemon, the actor key for an actor). Resolves to an error
// Status (never throws): UNAVAILABLE when nothing answers, DEADLINE_EXCEEDED after `timeout`,
// FAILED_PRECONDITION on a version mismatch or when the peer is not a Tessera endpoint,
// PERMISSION_DENIED when the server refuses the secret or cannot prove it knows it.
kj::Promise<Expected<kj::Own<Connection>>> connect(kj::AsyncIoContext& io,
                                                   const std::string& address,
                                                   const std::string& peer,
                                                   const std::string& secret,
                                                   kj::Duration timeout = 10 * kj::SECONDS,
                                                   uint32_t version = kProtocolVersion);

// Splits "host:port". Fails on a missing or out-of-range port.
Expected<std::pair<std::string, uint16_t>> split_host_port(const std::string& address);

}  // namespace tessera::rpc
