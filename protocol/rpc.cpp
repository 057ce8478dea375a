#include "protocol/rpc.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <spdlog/spdlog.h>
#include <sys/socket.h>

#include <capnp/rpc.h>

namespace tessera::rpc {

const char* role_name(proto::Role role) {
  switch (role) {
    case proto::Role::HEAD:
      return "head";
    case proto::Role::NODE:
      return "node daemon";
    case proto::Role::ACTOR:
      return "actor";
  }
  return "peer";
}

void throw_status(const Status& status) {
  kj::Exception::Type type = kj::Exception::Type::FAILED;
  if (status.code() == Code::kUnavailable) type = kj::Exception::Type::DISCONNECTED;
  if (status.code() == Code::kResourceExhausted) type = kj::Exception::Type::OVERLOADED;
  kj::throwFatalException(
      kj::Exception(type, __FILE__, __LINE__, kj::str(status.to_string().c_str())));
}

Status to_status(const kj::Exception& e) {
  std::string text(e.getDescription().cStr());
  for (const char* prefix : {"remote exception: ", "(remote) "}) {
    while (text.rfind(prefix, 0) == 0) text.erase(0, std::string(prefix).size());
  }
  for (Code code : {Code::kInvalidArgument, Code::kNotFound, Code::kAlreadyExists,
                    Code::kUnavailable, Code::kDeadlineExceeded, Code::kResourceExhausted,
                    Code::kFailedPrecondition, Code::kPermissionDenied, Code::kInternal}) {
    std::string name = std::string(code_name(code)) + ": ";
    if (text.rfind(name, 0) == 0) return Status(code, text.substr(name.size()));
  }
  switch (e.getType()) {
    case kj::Exception::Type::DISCONNECTED:
      return unavailable(text);
    case kj::Exception::Type::OVERLOADED:
      return resource_exhausted(text);
    default:
      return internal_error(text);
  }
}

void require_version(uint32_t peer_version, kj::StringPtr peer, proto::Role our_role) {
  if (peer_version == kProtocolVersion) return;
  throw_status(failed_precondition(
      "protocol version mismatch: " + std::string(peer.cStr()) + " speaks Tessera protocol v" +
      std::to_string(peer_version) + ", this " + role_name(our_role) + " speaks v" +
      std::to_string(kProtocolVersion) + "; run the same Tessera release everywhere"));
}

Status check_server_version(uint32_t server_version, proto::Role server_role,
                            const std::string& address) {
  if (server_version == kProtocolVersion) return Status::ok();
  return failed_precondition(
      "protocol version mismatch: the " + std::string(role_name(server_role)) + " at " + address +
      " speaks Tessera protocol v" + std::to_string(server_version) + ", this program speaks v" +
      std::to_string(kProtocolVersion) + "; run the same Tessera release everywhere");
}

Expected<std::pair<std::string, uint16_t>> split_host_port(const std::string& address) {
  auto colon = address.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == address.size()) {
    return invalid_argument("address '" + address + "' is not HOST:PORT");
  }
  std::string host = address.substr(0, colon);
  std::string port_text = address.substr(colon + 1);
  if (host.size() > 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  unsigned long port = 0;
  for (char c : port_text) {
    if (c < '0' || c > '9') return invalid_argument("address '" + address + "': bad port");
    port = port * 10 + static_cast<unsigned long>(c - '0');
    if (port > 65535) return invalid_argument("address '" + address + "': port above 65535");
  }
  return std::make_pair(host, static_cast<uint16_t>(port));
}

namespace {

std::string peer_name(kj::AsyncIoStream& stream) {
  sockaddr_storage addr{};
  uint len = sizeof(addr);
  try {
    stream.getpeername(reinterpret_cast<sockaddr*>(&addr), &len);
  } catch (...) {
    return "unknown peer";
  }
  char host[INET6_ADDRSTRLEN] = {0};
  if (addr.ss_family == AF_INET) {
    auto* in = reinterpret_cast<sockaddr_in*>(&addr);
    inet_ntop(AF_INET, &in->sin_addr, host, sizeof(host));
    return std::string(host) + ":" + std::to_string(ntohs(in->sin_port));
  }
  if (addr.ss_family == AF_INET6) {
    auto* in6 = reinterpret_cast<sockaddr_in6*>(&addr);
    inet_ntop(AF_INET6, &in6->sin6_addr, host, sizeof(host));
    return "[" + std::string(host) + "]:" + std::to_string(ntohs(in6->sin6_port));
  }
  return "local peer";
}

// One accepted connection: the stream, its vat network and its RPC system.
struct ServerConnection {
  ServerConnection(kj::Own<kj::AsyncIoStream>&& s, proto::Gateway::Client gateway)
      : stream(kj::mv(s)),
        network(*stream, capnp::rpc::twoparty::Side::SERVER),
        rpc(capnp::makeRpcServer(network, kj::mv(gateway))) {}
  kj::Own<kj::AsyncIoStream> stream;
  capnp::TwoPartyVatNetwork network;
  capnp::RpcSystem<capnp::rpc::twoparty::VatId> rpc;
};

}  // namespace

RpcServer::RpcServer(kj::Own<kj::ConnectionReceiver> listener, proto::Gateway::Client gateway,
                     std::string label)
    : listener_(kj::mv(listener)),
      gateway_(kj::mv(gateway)),
      label_(std::move(label)),
      port_(static_cast<uint16_t>(listener_->getPort())),
      tasks_(*this) {
  tasks_.add(accept_loop());
}

RpcServer::~RpcServer() = default;

Expected<kj::Own<RpcServer>> RpcServer::listen(kj::AsyncIoContext& io, const std::string& address,
                                               proto::Gateway::Client gateway, std::string label) {
  auto parsed = split_host_port(address);
  if (!parsed) return parsed.status();
  kj::Own<kj::ConnectionReceiver> listener;
  KJ_IF_MAYBE (e, kj::runCatchingExceptions([&]() {
                 auto addr = io.provider->getNetwork()
                                 .parseAddress(kj::StringPtr(address.c_str()))
                                 .wait(io.waitScope);
                 listener = addr->listen();
               })) {
    std::string why = e->getDescription().cStr();
    if (why.find("EADDRINUSE") != std::string::npos ||
        why.find("ddress already in use") != std::string::npos) {
      return unavailable("cannot listen on " + address +
                         ": the port is already in use (is another tessera daemon running? "
                         "`tessera status`, or pick another --port)");
    }
    return unavailable("cannot listen on " + address + ": " + why);
  }
  return kj::heap<RpcServer>(kj::mv(listener), kj::mv(gateway), std::move(label));
}

kj::Promise<void> RpcServer::accept_loop() {
  return listener_->accept().then([this](kj::Own<kj::AsyncIoStream>&& stream) {
    std::string peer = peer_name(*stream);
    spdlog::debug("{}: connection from {}", label_, peer);
    auto conn = kj::heap<ServerConnection>(kj::mv(stream), gateway_);
    ++connections_;
    auto done = conn->network.onDisconnect();
    tasks_.add(done.attach(kj::mv(conn))
                   .then(
                       [this, peer]() {
                         --connections_;
                         spdlog::debug("{}: {} disconnected", label_, peer);
                       },
                       [this, peer](kj::Exception&& e) {
                         --connections_;
                         spdlog::warn("{}: dropped connection from {}: {}", label_, peer,
                                      e.getDescription().cStr());
                       }));
    return accept_loop();
  });
}

void RpcServer::taskFailed(kj::Exception&& exception) {
  spdlog::warn("{}: connection task failed: {}", label_, exception.getDescription().cStr());
}

kj::Promise<Expected<kj::Own<Connection>>> connect(kj::AsyncIoContext& io,
                                                   const std::string& address,
                                                   const std::string& peer, kj::Duration timeout,
                                                   uint32_t version) {
  using Result = Expected<kj::Own<Connection>>;
  auto parsed = split_host_port(address);
  if (!parsed) return Result(parsed.status());
  auto conn = kj::heap<Connection>();
  conn->address = address;
  auto& timer = io.provider->getTimer();
  auto attempt =
      io.provider->getNetwork()
          .parseAddress(kj::StringPtr(address.c_str()))
          .then([](kj::Own<kj::NetworkAddress>&& addr) {
            auto p = addr->connect();
            return p.attach(kj::mv(addr));
          })
          .then([conn = conn.get(), version, peer](kj::Own<kj::AsyncIoStream>&& stream) mutable {
            conn->stream = kj::mv(stream);
            conn->client = kj::heap<capnp::TwoPartyClient>(*conn->stream);
            conn->gateway = conn->client->bootstrap().castAs<proto::Gateway>();
            auto req = conn->gateway.helloRequest();
            req.setVersion(version);
            req.setPeer(peer.c_str());
            return req.send();
          })
          .then([conn = kj::mv(conn),
                 address](capnp::Response<proto::Gateway::HelloResults>&& r) mutable -> Result {
            Status st = check_server_version(r.getVersion(), r.getRole(), address);
            if (!st) return st;
            conn->role = r.getRole();
            conn->server_id = r.getServerId().cStr();
            conn->has_cluster = r.hasCluster();
            conn->has_node = r.hasNode();
            conn->has_actor = r.hasActor();
            if (conn->has_cluster) conn->cluster = r.getCluster();
            if (conn->has_node) conn->node = r.getNode();
            if (conn->has_actor) conn->actor = r.getActor();
            return Result(kj::mv(conn));
          });
  return timer.timeoutAfter(timeout, kj::mv(attempt))
      .catch_([address, timeout](kj::Exception&& e) -> Result {
        Status st = to_status(e);
        std::string why = st.message();
        if (why.find("ECONNREFUSED") != std::string::npos ||
            why.find("onnection refused") != std::string::npos) {
          return unavailable("cannot reach " + address +
                             ": connection refused (is a tessera daemon running there?)");
        }
        if (why.find("timed out") != std::string::npos ||
            e.getType() == kj::Exception::Type::OVERLOADED) {
          return deadline_exceeded("cannot reach " + address + ": no answer within " +
                                   std::to_string(timeout / kj::MILLISECONDS) + " ms");
        }
        if (st.code() == Code::kFailedPrecondition) return st;
        return Status(st.code() == Code::kInternal ? Code::kUnavailable : st.code(),
                      "cannot reach " + address + ": " + why);
      });
}

}  // namespace tessera::rpc
