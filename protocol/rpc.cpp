#include "protocol/rpc.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <spdlog/spdlog.h>
#include <sys/socket.h>

#include <capnp/rpc.h>
#include <capnp/serialize-async.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>

#include "common/sha256.h"
#include "protocol/auth.h"

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

const char* secret_name(proto::Role role) {
  return role == proto::Role::ACTOR ? "actor key" : "cluster token";
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

// Where a connection comes from: "10.0.0.2:51234" for the logs, and the IP address alone
// ("10.0.0.2"; "" for a peer without one, such as an in-memory pipe) for per-address limits.
struct PeerAddress {
  std::string name;
  std::string host;
};

PeerAddress peer_address(kj::AsyncIoStream& stream) {
  sockaddr_storage addr{};
  uint len = sizeof(addr);
  try {
    stream.getpeername(reinterpret_cast<sockaddr*>(&addr), &len);
  } catch (...) {
    return {"unknown peer", ""};
  }
  char host[INET6_ADDRSTRLEN] = {0};
  if (addr.ss_family == AF_INET) {
    auto* in = reinterpret_cast<sockaddr_in*>(&addr);
    inet_ntop(AF_INET, &in->sin_addr, host, sizeof(host));
    return {std::string(host) + ":" + std::to_string(ntohs(in->sin_port)), host};
  }
  if (addr.ss_family == AF_INET6) {
    auto* in6 = reinterpret_cast<sockaddr_in6*>(&addr);
    inet_ntop(AF_INET6, &in6->sin6_addr, host, sizeof(host));
    return {"[" + std::string(host) + "]:" + std::to_string(ntohs(in6->sin6_port)), host};
  }
  return {"local peer", ""};
}

// "16 KiB", "64.0 MiB": a byte count for log lines.
std::string human_bytes(uint64_t bytes) {
  if (bytes < (1u << 10)) return std::to_string(bytes) + " bytes";
  if (bytes < (1u << 20) && bytes % 1024 == 0) return std::to_string(bytes >> 10) + " KiB";
  char text[32];
  if (bytes < (1u << 20)) {
    std::snprintf(text, sizeof(text), "%.1f KiB", static_cast<double>(bytes) / 1024.0);
  } else {
    std::snprintf(text, sizeof(text), "%.1f MiB", static_cast<double>(bytes) / (1024.0 * 1024.0));
  }
  return text;
}

uint64_t steady_ms() {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                   std::chrono::steady_clock::now().time_since_epoch())
                                   .count());
}

// A name a peer gave itself, cut short and without control characters, for log lines.
std::string printable(kj::StringPtr text) {
  std::string out;
  for (char c : text) {
    if (out.size() >= 64) {
      out += "...";
      break;
    }
    out += (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) ? '?' : c;
  }
  return out;
}

}  // namespace

// Per connection, shared by its gateway and handshake objects (which Cap'n Proto may keep a
// little longer than the connection itself).
struct RpcServer::ConnectionState {
  std::string peer_address;
  std::string host;     // the peer's IP address ("" when it has none)
  std::string refused;  // non-empty: every hello fails with this (the server is full)
  bool authenticated = false;
  bool holds_address_slot = false;  // counted in the server's unauthenticated_by_host_
  uint32_t hellos = 0;
  std::shared_ptr<const Endpoint> endpoint;
  RpcServer* server = nullptr;
  std::weak_ptr<int> server_alive;
  kj::Own<kj::PromiseFulfiller<void>> close;  // fulfil: close the connection shortly

  void close_soon() {
    if (close && close->isWaiting()) close->fulfill();
  }
  // The connection authenticated or ended: it no longer counts against its address.
  void release_address_slot() {
    if (!holds_address_slot) return;
    holds_address_slot = false;
    if (!server_alive.expired()) server->release_unauthenticated(host);
  }
  void on_authenticated() {
    authenticated = true;
    release_address_slot();
    if (!server_alive.expired()) ++server->counters_.authenticated;
  }
  // Records a frame of `bytes` sent before authentication.
  void saw_unauthenticated_message(uint64_t bytes) {
    if (server_alive.expired()) return;
    auto& largest = server->counters_.largest_unauthenticated_message;
    largest = std::max(largest, bytes);
  }
  // Logs a refused peer (rate-limited by the server), schedules the close, and throws `why`.
  [[noreturn]] void refuse(const Status& why, const std::string& claimed_name) {
    if (!server_alive.expired()) {
      ++server->counters_.refused;
      server->log_refusal("refused " + peer_address +
                          (claimed_name.empty() ? "" : " (says it is '" + claimed_name + "')") +
                          ": " + why.message());
    }
    close_soon();
    throw_status(why);
  }
};

namespace {

class HandshakeImpl final : public proto::Handshake::Server {
 public:
  HandshakeImpl(std::shared_ptr<RpcServer::ConnectionState> state, std::string peer,
                std::string client_nonce, std::string server_nonce)
      : state_(std::move(state)),
        peer_(std::move(peer)),
        client_nonce_(std::move(client_nonce)),
        server_nonce_(std::move(server_nonce)) {}

 protected:
  kj::Promise<void> authenticate(AuthenticateContext context) override {
    const Endpoint& e = *state_->endpoint;
    const std::string what = secret_name(e.role);
    if (used_ || state_->authenticated) {
      state_->refuse(Status(Code::kPermissionDenied, "a handshake may be answered only once"),
                     printable(peer_));
    }
    used_ = true;
    auto proof = context.getParams().getProof();
    std::string given(reinterpret_cast<const char*>(proof.begin()), proof.size());
    std::string hint = e.role == proto::Role::ACTOR
                           ? "; only the lease that spawned actor " + e.server_id + " holds its key"
                           : "; pass the cluster's token with --cluster-token-file PATH or "
                             "TESSERA_CLUSTER_TOKEN";
    if (given.empty()) {
      state_->refuse(Status(Code::kPermissionDenied, "no " + what + " was given" + hint),
                     printable(peer_));
    }
    std::string expected = auth::client_proof(e.secret, peer_, server_nonce_, client_nonce_);
    if (!constant_time_equal(given, expected)) {
      state_->refuse(Status(Code::kPermissionDenied, "wrong " + what + hint), printable(peer_));
    }
    state_->on_authenticated();
    e.grant(context.getResults());
    return kj::READY_NOW;
  }

 private:
  std::shared_ptr<RpcServer::ConnectionState> state_;
  std::string peer_;
  std::string client_nonce_;
  std::string server_nonce_;
  bool used_ = false;
};

// Constant-time equality of a Data field and a string.
bool equal_bytes(capnp::Data::Reader data, const std::string& bytes) {
  return constant_time_equal(
      std::string_view(reinterpret_cast<const char*>(data.begin()), data.size()), bytes);
}

class AuthGateway final : public proto::Gateway::Server {
 public:
  explicit AuthGateway(std::shared_ptr<RpcServer::ConnectionState> state)
      : state_(std::move(state)) {}

 protected:
  kj::Promise<void> hello(HelloContext context) override {
    auto p = context.getParams();
    const Endpoint& e = *state_->endpoint;
    std::string peer = p.getPeer().cStr();
    if (!state_->refused.empty()) {
      state_->refuse(Status(Code::kResourceExhausted, state_->refused), printable(p.getPeer()));
    }
    if (++state_->hellos > 3) {
      state_->refuse(Status(Code::kPermissionDenied, "too many hellos on one connection"),
                     printable(p.getPeer()));
    }
    if (p.getVersion() != kProtocolVersion) {
      try {
        require_version(p.getVersion(), p.getPeer(), e.role);
      } catch (const kj::Exception& ex) {
        state_->refuse(to_status(ex), printable(p.getPeer()));
      }
    }
    if (p.getClientNonce().size() != auth::kNonceBytes) {
      state_->refuse(invalid_argument("hello needs a " + std::to_string(auth::kNonceBytes) +
                                      "-byte client nonce"),
                     printable(p.getPeer()));
    }
    auto nonce = auth::make_nonce();
    if (!nonce) throw_status(nonce.status());
    auto c = p.getClientNonce();
    std::string client_nonce(reinterpret_cast<const char*>(c.begin()), c.size());
    auto r = context.getResults();
    r.setVersion(kProtocolVersion);
    r.setRole(e.role);
    r.setServerId(e.server_id);
    r.setServerNonce(kj::arrayPtr(reinterpret_cast<const kj::byte*>(nonce->data()), nonce->size()));
    std::string proof = auth::server_proof(e.secret, e.role, e.server_id, client_nonce, *nonce);
    r.setServerProof(kj::arrayPtr(reinterpret_cast<const kj::byte*>(proof.data()), proof.size()));
    r.setHandshake(kj::heap<HandshakeImpl>(state_, std::move(peer), std::move(client_nonce),
                                           std::move(*nonce)));
    return kj::READY_NOW;
  }

 private:
  std::shared_ptr<RpcServer::ConnectionState> state_;
};

// The message stream of an accepted connection, between the socket and TwoPartyVatNetwork.
// Until the peer has authenticated, every read runs with a traversal limit of `limit` bytes
// instead of max_message_bytes. Cap'n Proto's reader checks a frame's declared size against that
// limit as soon as it has the frame's header (capnp/serialize-async.c++), before it allocates
// the frame or reads its body: a bigger frame is refused unread, the refusal is logged, and the
// connection is closed. Once the peer has authenticated, the reader's own options apply.
// Writes go straight to the socket's message stream. Owned by ServerConnection, next to the
// socket and the AsyncIoMessageStream it wraps, and declared before the network that uses it.
class HandshakeLimitedStream final : public capnp::MessageStream {
 public:
  HandshakeLimitedStream(capnp::MessageStream& inner,
                         std::shared_ptr<RpcServer::ConnectionState> state, uint64_t limit)
      : inner_(inner), state_(std::move(state)), limit_(limit) {}

  kj::Promise<kj::Maybe<capnp::MessageReaderAndFds>> tryReadMessage(
      kj::ArrayPtr<kj::AutoCloseFd> fd_space, capnp::ReaderOptions options,
      kj::ArrayPtr<capnp::word> scratch) override {
    if (state_->authenticated) return inner_.tryReadMessage(fd_space, options, scratch);
    options.traversalLimitInWords =
        std::min<uint64_t>(options.traversalLimitInWords, limit_ / sizeof(capnp::word));
    return inner_.tryReadMessage(fd_space, options, scratch)
        .then(
            [state = state_](kj::Maybe<capnp::MessageReaderAndFds>&& message) {
              KJ_IF_MAYBE (m, message) state->saw_unauthenticated_message(message_bytes(*m->reader));
              return kj::mv(message);
            },
            [state = state_, limit = limit_](
                kj::Exception&& e) -> kj::Maybe<capnp::MessageReaderAndFds> {
              std::string why = e.getDescription().cStr();
              if (why.find("Message is too large") != std::string::npos ||
                  why.find("too many segments") != std::string::npos) {
                state->refuse(resource_exhausted(
                                  std::string(why.find("segments") != std::string::npos
                                                  ? "a message with too many segments"
                                                  : "a message over " + human_bytes(limit)) +
                                  " before the handshake; until a peer has proved the " +
                                  secret_name(state->endpoint->role) + " it may send at most " +
                                  human_bytes(limit) + " at a time"),
                              "");
              }
              kj::throwFatalException(kj::mv(e));
            });
  }
  kj::Promise<void> writeMessage(kj::ArrayPtr<const int> fds,
                                 kj::ArrayPtr<const kj::ArrayPtr<const capnp::word>> segments)
      override {
    return inner_.writeMessage(fds, segments);
  }
  kj::Promise<void> writeMessages(
      kj::ArrayPtr<kj::ArrayPtr<const kj::ArrayPtr<const capnp::word>>> messages) override {
    return inner_.writeMessages(messages);
  }
  kj::Maybe<int> getSendBufferSize() override { return inner_.getSendBufferSize(); }
  kj::Promise<void> end() override { return inner_.end(); }

 private:
  static uint64_t message_bytes(capnp::MessageReader& reader) {
    uint64_t words = 0;
    uint segments = 0;
    for (;; ++segments) {
      auto segment = reader.getSegment(segments);
      if (segment == nullptr) break;
      words += segment.size();
    }
    // The frame: its first word, the segment table (padded to a word), then the segments.
    const uint64_t table = segments <= 1 ? 0 : ((segments & ~1u) * 4);
    return 8 + table + words * sizeof(capnp::word);
  }

  capnp::MessageStream& inner_;
  std::shared_ptr<RpcServer::ConnectionState> state_;
  uint64_t limit_;
};

// One accepted connection: the stream, its vat network and its RPC system.
struct ServerConnection {
  ServerConnection(kj::Own<kj::AsyncIoStream>&& s,
                   std::shared_ptr<RpcServer::ConnectionState> state, const ServerLimits& limits)
      : stream(kj::mv(s)),
        messages(*stream),
        limited(messages, state,
                std::min(limits.max_unauthenticated_message_bytes, limits.max_message_bytes)),
        network(limited, capnp::rpc::twoparty::Side::SERVER, reader_options(limits)),
        rpc(capnp::makeRpcServer(network, kj::heap<AuthGateway>(std::move(state)))) {
    rpc.setFlowLimit(static_cast<size_t>(limits.max_inflight_bytes / sizeof(capnp::word)));
  }
  static capnp::ReaderOptions reader_options(const ServerLimits& limits) {
    capnp::ReaderOptions o;
    o.traversalLimitInWords = limits.max_message_bytes / sizeof(capnp::word);
    o.nestingLimit = 64;
    return o;
  }
  // Destroyed in reverse order: the RPC system, the network, then the streams it used.
  kj::Own<kj::AsyncIoStream> stream;
  capnp::AsyncIoMessageStream messages;
  HandshakeLimitedStream limited;
  capnp::TwoPartyVatNetwork network;
  capnp::RpcSystem<capnp::rpc::twoparty::VatId> rpc;
};

}  // namespace

RpcServer::RpcServer(kj::AsyncIoContext& io, kj::Own<kj::ConnectionReceiver> listener,
                     Endpoint endpoint, std::string label, ServerLimits limits)
    : io_(io),
      listener_(kj::mv(listener)),
      endpoint_(std::make_shared<const Endpoint>(std::move(endpoint))),
      label_(std::move(label)),
      limits_(limits),
      port_(static_cast<uint16_t>(listener_->getPort())),
      tasks_(*this) {
  tasks_.add(accept_loop());
}

RpcServer::~RpcServer() { alive_.reset(); }

Expected<kj::Own<RpcServer>> RpcServer::listen(kj::AsyncIoContext& io, const std::string& address,
                                               Endpoint endpoint, std::string label,
                                               ServerLimits limits) {
  auto parsed = split_host_port(address);
  if (!parsed) return parsed.status();
  if (endpoint.secret.size() < auth::kMinSecretLength ||
      endpoint.secret.size() > auth::kMaxSecretLength) {
    return invalid_argument("cannot serve " + address + " with a " + secret_name(endpoint.role) +
                            " of " + std::to_string(endpoint.secret.size()) +
                            " characters; it needs " + std::to_string(auth::kMinSecretLength) +
                            " to " + std::to_string(auth::kMaxSecretLength));
  }
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
  return kj::heap<RpcServer>(io, kj::mv(listener), std::move(endpoint), std::move(label), limits);
}

void RpcServer::log_refusal(const std::string& line) {
  // At most 20 lines a minute: a flood of bad peers must not fill the disk with logs.
  uint64_t now = steady_ms();
  if (now - refusal_window_start_ms_ >= 60000) {
    if (refusals_suppressed_ > 0) {
      spdlog::warn("{}: {} more refused connection(s) in the last minute were not logged", label_,
                   refusals_suppressed_);
    }
    refusal_window_start_ms_ = now;
    refusals_in_window_ = 0;
    refusals_suppressed_ = 0;
  }
  if (++refusals_in_window_ <= 20) {
    spdlog::warn("{}: {}", label_, line);
  } else {
    ++refusals_suppressed_;
  }
}

kj::Promise<void> RpcServer::accept_loop() {
  // accept() may throw before it returns a promise (EMFILE from accept4): evalNow turns that
  // into a rejected promise, which the error branch handles like any other.
  return kj::evalNow([this]() { return listener_->accept(); })
      .then(
          [this](kj::Own<kj::AsyncIoStream>&& stream) {
            if (accept_backoff_ms_ > 0) {
              spdlog::info("{}: accepting connections again", label_);
              accept_backoff_ms_ = 0;
            }
            serve(kj::mv(stream));
            return accept_loop();
          },
          [this](kj::Exception&& e) { return accept_failed(kj::mv(e)); });
}

kj::Promise<void> RpcServer::accept_failed(kj::Exception&& e) {
  ++counters_.accept_errors;
  std::string why = e.getDescription().cStr();
  if (accept_backoff_ms_ == 0) {
    const bool fds = why.find("EMFILE") != std::string::npos ||
                     why.find("ENFILE") != std::string::npos ||
                     why.find("Too many open files") != std::string::npos;
    spdlog::error("{}: cannot accept connections: {}{}; retrying with back-off until it can",
                  label_, why,
                  fds ? " (out of file descriptors: raise `ulimit -n` or --max-connections "
                        "lower)"
                      : "");
    accept_backoff_ms_ = 5;
  } else {
    accept_backoff_ms_ = std::min<uint32_t>(accept_backoff_ms_ * 2, 500);
  }
  return io_.provider->getTimer().afterDelay(accept_backoff_ms_ * kj::MILLISECONDS).then([this]() {
    return accept_loop();
  });
}

void RpcServer::release_unauthenticated(const std::string& host) {
  auto it = unauthenticated_by_host_.find(host);
  if (it == unauthenticated_by_host_.end()) return;
  if (--it->second == 0) unauthenticated_by_host_.erase(it);
}

void RpcServer::serve(kj::Own<kj::AsyncIoStream> stream) {
  ++counters_.accepted;
  PeerAddress from = peer_address(*stream);
  const std::string& peer = from.name;
  // Far over the limit: not even a reply (each refused peer costs a descriptor while it lasts).
  if (connections_ >= size_t{limits_.max_connections} + 64) {
    ++counters_.refused;
    log_refusal("dropped " + peer + ": " + std::to_string(connections_) +
                " connections are open (--max-connections " +
                std::to_string(limits_.max_connections) + ")");
    return;
  }
  // One address may not hold every slot with connections that never authenticate: beyond its
  // share it is closed before anything is read.
  auto counted = unauthenticated_by_host_.find(from.host);
  const uint32_t pending = counted == unauthenticated_by_host_.end() ? 0 : counted->second;
  if (!from.host.empty() && limits_.max_unauthenticated_per_address > 0 &&
      pending >= limits_.max_unauthenticated_per_address) {
    ++counters_.refused;
    log_refusal("dropped " + peer + " before reading from it: " + std::to_string(pending) +
                " connections from " + from.host +
                " have not authenticated yet, the limit per address; they authenticate or time "
                "out within " +
                std::to_string(limits_.handshake_timeout_ms) + " ms");
    return;
  }
  auto state = std::make_shared<ConnectionState>();
  state->peer_address = peer;
  state->host = from.host;
  if (!from.host.empty()) {
    ++unauthenticated_by_host_[from.host];
    state->holds_address_slot = true;
  }
  state->endpoint = endpoint_;
  state->server = this;
  state->server_alive = alive_;
  uint32_t deadline_ms = limits_.handshake_timeout_ms;
  if (connections_ >= limits_.max_connections) {
    state->refused = std::string(role_name(endpoint_->role)) + " " + endpoint_->server_id +
                     " has " + std::to_string(connections_) + " connections open, its limit " +
                     "(--max-connections " + std::to_string(limits_.max_connections) +
                     "); close idle clients or raise the limit";
    deadline_ms = std::min<uint32_t>(deadline_ms, 2000);
  }
  auto close = kj::newPromiseAndFulfiller<void>();
  state->close = kj::mv(close.fulfiller);
  spdlog::debug("{}: connection from {}", label_, peer);
  auto conn = kj::heap<ServerConnection>(kj::mv(stream), state, limits_);
  ++connections_;
  auto& timer = io_.provider->getTimer();
  // Closed when the peer goes, shortly after a refusal (so the error reaches it), or when it
  // has not authenticated in time.
  auto refused =
      close.promise.then([&timer]() { return timer.afterDelay(100 * kj::MILLISECONDS); });
  auto deadline =
      timer.afterDelay(deadline_ms * kj::MILLISECONDS).then([this, state]() -> kj::Promise<void> {
        if (state->authenticated) return kj::NEVER_DONE;
        if (state->refused.empty()) {
          log_refusal("closed " + state->peer_address + ": no handshake within " +
                      std::to_string(limits_.handshake_timeout_ms) + " ms");
        }
        return kj::READY_NOW;
      });
  auto done =
      conn->network.onDisconnect().exclusiveJoin(kj::mv(refused)).exclusiveJoin(kj::mv(deadline));
  tasks_.add(done.attach(kj::mv(conn))
                 .then(
                     [this, peer, state]() {
                       --connections_;
                       state->release_address_slot();
                       spdlog::debug("{}: {} disconnected", label_, peer);
                     },
                     [this, peer, state](kj::Exception&& e) {
                       --connections_;
                       state->release_address_slot();
                       spdlog::warn("{}: dropped connection from {}: {}", label_, peer,
                                    e.getDescription().cStr());
                     }));
}

void RpcServer::taskFailed(kj::Exception&& exception) {
  spdlog::warn("{}: connection task failed: {}", label_, exception.getDescription().cStr());
}

namespace {

// What a failed connect() attempt means, for a person.
Status describe_connect_failure(const kj::Exception& e, const std::string& address,
                                kj::Duration timeout, bool reached, bool answered) {
  Status st = to_status(e);
  std::string why = st.message();
  if (why.find("ECONNREFUSED") != std::string::npos ||
      why.find("onnection refused") != std::string::npos) {
    return unavailable("cannot reach " + address +
                       ": connection refused (is a tessera daemon running there?)");
  }
  if (why.find("operation timed out") != std::string::npos) {
    std::string ms = std::to_string(timeout / kj::MILLISECONDS);
    if (reached) {
      return deadline_exceeded("no answer from " + address + " within " + ms +
                               " ms: it accepted the connection but did not answer Tessera's "
                               "hello (is it a Tessera daemon, and not stopped?)");
    }
    return deadline_exceeded("cannot reach " + address + ": no answer within " + ms + " ms");
  }
  if (st.code() == Code::kFailedPrecondition || st.code() == Code::kPermissionDenied ||
      st.code() == Code::kResourceExhausted || st.code() == Code::kInvalidArgument) {
    return st;
  }
  if (reached && !answered && st.code() == Code::kUnavailable) {
    // Closed without a word: what a daemon does to an address with too many connections that
    // have not authenticated yet, and what many other servers do to a stranger.
    return failed_precondition(
        "not a Tessera daemon at " + address +
        ", or it refused this connection: it closed it before answering Tessera's hello (a "
        "daemon does that when this address has too many connections that have not "
        "authenticated yet; its log says so) (" +
        why + ")");
  }
  if (reached && !answered) {
    return failed_precondition("not a Tessera daemon at " + address +
                               ": it does not speak Tessera's RPC protocol (" + why + ")");
  }
  return Status(st.code() == Code::kInternal ? Code::kUnavailable : st.code(),
                "cannot reach " + address + ": " + why);
}

}  // namespace

kj::Promise<Expected<kj::Own<Connection>>> connect(kj::AsyncIoContext& io,
                                                   const std::string& address,
                                                   const std::string& peer,
                                                   const std::string& secret, kj::Duration timeout,
                                                   uint32_t version) {
  using Result = Expected<kj::Own<Connection>>;
  auto parsed = split_host_port(address);
  if (!parsed) return Result(parsed.status());
  auto client_nonce = auth::make_nonce();
  if (!client_nonce) return Result(client_nonce.status());
  auto conn = kj::heap<Connection>();
  conn->address = address;
  // Progress markers, for the error message: TCP connected / the peer answered in Cap'n Proto.
  auto progress = std::make_shared<std::pair<bool, bool>>(false, false);
  auto& timer = io.provider->getTimer();
  auto attempt =
      io.provider->getNetwork()
          .parseAddress(kj::StringPtr(address.c_str()))
          .then([](kj::Own<kj::NetworkAddress>&& addr) {
            auto p = addr->connect();
            return p.attach(kj::mv(addr));
          })
          .then([conn = conn.get(), version, peer, nonce = *client_nonce,
                 progress](kj::Own<kj::AsyncIoStream>&& stream) mutable {
            progress->first = true;
            conn->stream = kj::mv(stream);
            conn->client = kj::heap<capnp::TwoPartyClient>(*conn->stream);
            conn->gateway = conn->client->bootstrap().castAs<proto::Gateway>();
            auto req = conn->gateway.helloRequest();
            req.setVersion(version);
            req.setPeer(peer.c_str());
            req.setClientNonce(
                kj::arrayPtr(reinterpret_cast<const kj::byte*>(nonce.data()), nonce.size()));
            return req.send();
          })
          .then(
              [conn = conn.get(), address, peer, secret, nonce = *client_nonce, progress](
                  capnp::Response<proto::Gateway::HelloResults>&& r) mutable -> kj::Promise<void> {
                progress->second = true;
                Status st = check_server_version(r.getVersion(), r.getRole(), address);
                if (!st) throw_status(st);
                conn->role = r.getRole();
                conn->server_id = r.getServerId().cStr();
                auto server_nonce_data = r.getServerNonce();
                std::string server_nonce(reinterpret_cast<const char*>(server_nonce_data.begin()),
                                         server_nonce_data.size());
                std::string what = secret_name(conn->role);
                // The server's proof is checked, but our own proof goes out either way: a server
                // with another token then refuses it and logs the attempt, so both sides see the
                // mismatch. (A proof is bound to both nonces: it is worthless anywhere else.)
                bool server_knows =
                    secret.empty() ||
                    equal_bytes(r.getServerProof(),
                                auth::server_proof(secret, conn->role, conn->server_id, nonce,
                                                   server_nonce));
                auto req = r.getHandshake().authenticateRequest();
                if (!secret.empty()) {
                  std::string proof = auth::client_proof(secret, peer, server_nonce, nonce);
                  req.setProof(
                      kj::arrayPtr(reinterpret_cast<const kj::byte*>(proof.data()), proof.size()));
                }
                return req.send().then(
                    [conn, address, server_knows,
                     what](capnp::Response<proto::Handshake::AuthenticateResults>&& a) {
                      if (!server_knows) {
                        // Never take capabilities from a server that could not prove the secret.
                        throw_status(Status(Code::kPermissionDenied,
                                            "the " + std::string(role_name(conn->role)) + " at " +
                                                address + " could not prove it knows this " + what +
                                                ": it belongs to another cluster, or the " + what +
                                                " given here is wrong"));
                      }
                      conn->has_cluster = a.hasCluster();
                      conn->has_node = a.hasNode();
                      conn->has_actor = a.hasActor();
                      if (conn->has_cluster) conn->cluster = a.getCluster();
                      if (conn->has_node) conn->node = a.getNode();
                      if (conn->has_actor) conn->actor = a.getActor();
                    },
                    [conn, address](kj::Exception&& e) {
                      Status st = to_status(e);
                      throw_status(Status(
                          st.code(), "the " + std::string(role_name(conn->role)) + " at " +
                                         address + " refused this connection: " + st.message()));
                    });
              });
  return timer.timeoutAfter(timeout, kj::mv(attempt))
      .then([conn = kj::mv(conn)]() mutable -> Result { return Result(kj::mv(conn)); },
            [address, timeout, progress](kj::Exception&& e) -> Result {
              return describe_connect_failure(e, address, timeout, progress->first,
                                              progress->second);
            });
}

}  // namespace tessera::rpc
