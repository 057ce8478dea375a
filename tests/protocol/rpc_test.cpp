// The RPC plumbing on its own: handshake, version mismatch, garbage, port in use, refusals.
#include "protocol/rpc.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <thread>
#include <vector>

namespace tessera::rpc {
namespace {

const std::string kToken = "0123456789abcdef-test-token";

// A plain TCP connection to the server, from `source` (another loopback address stands for
// another machine).
int raw_connect(uint16_t port, const char* source = nullptr) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (source != nullptr) {
    sockaddr_in from{};
    from.sin_family = AF_INET;
    ::inet_pton(AF_INET, source, &from.sin_addr);
    if (::bind(fd, reinterpret_cast<sockaddr*>(&from), sizeof(from)) != 0) {
      ::close(fd);
      return -1;
    }
  }
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  ::inet_pton(AF_INET, "127.0.0.1", &addr.sin_addr);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

class RpcTest : public ::testing::Test {
 protected:
  // kj types have throwing destructors; gtest fixtures must not: hold them behind unique_ptr.
  struct Env {
    kj::AsyncIoContext io = kj::setupAsyncIo();
    kj::Own<RpcServer> server;
  };

  void SetUp() override { start({}); }

  void start(ServerLimits limits) {
    env_->server = nullptr;
    Endpoint e;
    e.role = proto::Role::NODE;
    e.server_id = "n-test";
    e.secret = kToken;
    e.grant = [this](proto::Handshake::AuthenticateResults::Builder) { ++grants_; };
    auto server = RpcServer::listen(io_, "127.0.0.1:0", std::move(e), "test", limits);
    ASSERT_TRUE(server) << server.status().to_string();
    env_->server = kj::mv(*server);
    server_ = env_->server.get();
    address_ = "127.0.0.1:" + std::to_string(server_->port());
  }

  Expected<kj::Own<Connection>> dial(const std::string& token,
                                     const std::string& peer = "unit test",
                                     uint32_t version = kProtocolVersion) {
    return connect(io_, address_, peer, token, 5 * kj::SECONDS, version).wait(io_.waitScope);
  }

  // Runs the loop until `fd` is closed by the server (bounded); true if it was.
  bool closed_by_server(int fd, int max_ms = 2000) {
    for (int i = 0; i < max_ms / 5; ++i) {
      io_.provider->getTimer().afterDelay(5 * kj::MILLISECONDS).wait(io_.waitScope);
      char buf[256];
      ssize_t n = ::recv(fd, buf, sizeof(buf), MSG_DONTWAIT);
      if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK)) return true;
    }
    return false;
  }

  std::unique_ptr<Env> env_ = std::make_unique<Env>();
  kj::AsyncIoContext& io_ = env_->io;
  RpcServer* server_ = nullptr;
  std::string address_;
  int grants_ = 0;
};

TEST_F(RpcTest, TheRightTokenGetsTheCapabilities) {
  auto conn = dial(kToken);
  ASSERT_TRUE(conn) << conn.status().to_string();
  EXPECT_EQ((*conn)->role, proto::Role::NODE);
  EXPECT_EQ((*conn)->server_id, "n-test");
  EXPECT_EQ(grants_, 1);
  EXPECT_EQ(server_->counters().authenticated, 1u);
  EXPECT_EQ(server_->counters().refused, 0u);
}

TEST_F(RpcTest, AWrongTokenIsRefusedBeforeAnyCapability) {
  auto conn = dial("another-cluster-token-0000");
  ASSERT_FALSE(conn);
  EXPECT_EQ(conn.status().code(), Code::kPermissionDenied);
  EXPECT_NE(conn.status().message().find("node daemon at " + address_ +
                                         " refused this connection: wrong cluster token"),
            std::string::npos)
      << conn.status().message();
  EXPECT_NE(conn.status().message().find("--cluster-token-file"), std::string::npos);
  EXPECT_EQ(grants_, 0);
  EXPECT_EQ(server_->counters().refused, 1u);
  auto ok = dial(kToken);  // the server goes on
  EXPECT_TRUE(ok) << ok.status().to_string();
}

TEST_F(RpcTest, NoTokenIsRefusedToo) {
  auto conn = dial("");
  ASSERT_FALSE(conn);
  EXPECT_EQ(conn.status().code(), Code::kPermissionDenied);
  EXPECT_NE(conn.status().message().find("no cluster token was given"), std::string::npos)
      << conn.status().message();
  EXPECT_EQ(grants_, 0);
}

TEST_F(RpcTest, AServerThatDoesNotKnowTheTokenIsNotTrusted) {
  // A client of another cluster reaching this server: both sides see the mismatch, and the
  // client never takes capabilities from a server that could not prove the token.
  Endpoint rogue;
  rogue.role = proto::Role::HEAD;
  rogue.server_id = "n-rogue";
  rogue.secret = "rogue-server-token-12345";
  bool granted = false;
  rogue.grant = [&](proto::Handshake::AuthenticateResults::Builder) { granted = true; };
  auto server = RpcServer::listen(io_, "127.0.0.1:0", std::move(rogue), "rogue");
  ASSERT_TRUE(server);
  auto conn = connect(io_, "127.0.0.1:" + std::to_string((*server)->port()), "driver", kToken,
                      5 * kj::SECONDS)
                  .wait(io_.waitScope);
  ASSERT_FALSE(conn);
  EXPECT_EQ(conn.status().code(), Code::kPermissionDenied);
  EXPECT_FALSE(granted);
  EXPECT_EQ((*server)->counters().refused, 1u);
}

TEST_F(RpcTest, VersionMismatchIsAnErrorNamingBothVersions) {
  auto conn = dial(kToken, "old driver", kProtocolVersion + 1);
  ASSERT_FALSE(conn);
  EXPECT_EQ(conn.status().code(), Code::kFailedPrecondition);
  std::string m = conn.status().message();
  EXPECT_NE(m.find("old driver speaks Tessera protocol v" + std::to_string(kProtocolVersion + 1)),
            std::string::npos)
      << m;
  EXPECT_NE(m.find("this node daemon speaks v" + std::to_string(kProtocolVersion)),
            std::string::npos)
      << m;
  EXPECT_EQ(grants_, 0);
}

TEST_F(RpcTest, ClientChecksTheServersVersionToo) {
  Status st = check_server_version(kProtocolVersion + 3, proto::Role::HEAD, "10.0.0.1:6380");
  EXPECT_EQ(st.code(), Code::kFailedPrecondition);
  EXPECT_NE(st.message().find("head at 10.0.0.1:6380 speaks Tessera protocol v"), std::string::npos)
      << st.message();
  EXPECT_TRUE(check_server_version(kProtocolVersion, proto::Role::HEAD, "x").is_ok());
}

TEST_F(RpcTest, ConnectionsOverTheLimitAreToldSo) {
  ServerLimits limits;
  limits.max_connections = 2;
  start(limits);
  int a = raw_connect(server_->port());
  int b = raw_connect(server_->port());
  ASSERT_GE(a, 0);
  ASSERT_GE(b, 0);
  io_.provider->getTimer().afterDelay(50 * kj::MILLISECONDS).wait(io_.waitScope);
  auto conn = dial(kToken);
  ASSERT_FALSE(conn);
  EXPECT_EQ(conn.status().code(), Code::kResourceExhausted);
  EXPECT_NE(conn.status().message().find("its limit (--max-connections 2)"), std::string::npos)
      << conn.status().message();
  ::close(a);
  ::close(b);
  io_.provider->getTimer().afterDelay(50 * kj::MILLISECONDS).wait(io_.waitScope);
  auto again = dial(kToken);
  EXPECT_TRUE(again) << again.status().to_string();
}

TEST_F(RpcTest, APeerThatNeverAuthenticatesIsDisconnected) {
  ServerLimits limits;
  limits.handshake_timeout_ms = 200;
  start(limits);
  int fd = raw_connect(server_->port());
  ASSERT_GE(fd, 0);
  EXPECT_TRUE(closed_by_server(fd, 3000)) << "an idle unauthenticated connection stayed open";
  ::close(fd);
  EXPECT_EQ(server_->connections(), 0u);
}

TEST_F(RpcTest, AMessageOverTheSizeLimitClosesOnlyThatConnection) {
  ServerLimits limits;
  limits.max_message_bytes = 64 << 10;
  start(limits);
  auto conn = dial(kToken, std::string(1 << 20, 'x'));  // a 1 MiB name in the hello
  ASSERT_FALSE(conn);
  EXPECT_EQ(grants_, 0);
  auto ok = dial(kToken);
  EXPECT_TRUE(ok) << ok.status().to_string();
}

// The first word of a Cap'n Proto stream frame: the segment count - 1, then the first
// segment's size in words (little-endian).
std::string frame_header(uint32_t more_segments, uint32_t first_words) {
  std::string out(8, '\0');
  for (int i = 0; i < 4; ++i) {
    out[i] = static_cast<char>((more_segments >> (8 * i)) & 0xff);
    out[4 + i] = static_cast<char>((first_words >> (8 * i)) & 0xff);
  }
  return out;
}

// Writes `bytes` to `end` while the server's loop runs; true if the server took them all within
// `ms`, false if it refused them (closed its end) or had not read them by then.
bool server_reads(kj::AsyncIoContext& io, kj::AsyncIoStream& end, const std::string& bytes,
                  int ms = 2000) {
  auto wrote = end.write(bytes.data(), bytes.size())
                   .then([]() { return true; }, [](kj::Exception&&) { return false; });
  auto late =
      io.provider->getTimer().afterDelay(ms * kj::MILLISECONDS).then([]() { return false; });
  return wrote.exclusiveJoin(kj::mv(late)).wait(io.waitScope);
}

TEST_F(RpcTest, ABigFrameBeforeTheHandshakeIsRefusedUnread) {
  // A frame header declaring 64 MiB, then 1 MiB of it: the server must not buffer it (before
  // the limit it read whole frames of up to max_message_bytes from anyone).
  for (const std::string& header :
       {frame_header(0, (64u << 20) / 8 - 1),
        // Three segments (the table: two more sizes, no padding), 32 MiB each.
        frame_header(2, (32u << 20) / 8) + frame_header((32u << 20) / 8, (32u << 20) / 8)}) {
    const uint64_t refused_before = server_->counters().refused;
    auto pipe = kj::newTwoWayPipe();
    server_->serve(kj::mv(pipe.ends[1]));
    EXPECT_EQ(server_->connections(), 1u);
    EXPECT_TRUE(server_reads(io_, *pipe.ends[0], header));
    EXPECT_FALSE(server_reads(io_, *pipe.ends[0], std::string(1 << 20, 'x')))
        << "the server read the body of a 64 MiB frame from a peer that never authenticated";
    EXPECT_EQ(server_->counters().refused, refused_before + 1);
    // Nothing that big was ever read.
    EXPECT_LT(server_->counters().largest_unauthenticated_message, 16u << 10);
    // The connection is gone shortly after.
    for (int i = 0; i < 100 && server_->connections() > 0; ++i) {
      io_.provider->getTimer().afterDelay(10 * kj::MILLISECONDS).wait(io_.waitScope);
    }
    EXPECT_EQ(server_->connections(), 0u);
  }
  // Too many segments is refused the same way.
  auto pipe = kj::newTwoWayPipe();
  server_->serve(kj::mv(pipe.ends[1]));
  EXPECT_TRUE(server_reads(io_, *pipe.ends[0], frame_header(0xffffffffu, 0)));
  EXPECT_FALSE(server_reads(io_, *pipe.ends[0], std::string(1 << 20, 'x')));
  auto ok = dial(kToken);
  EXPECT_TRUE(ok) << ok.status().to_string();
}

TEST_F(RpcTest, OnlySmallMessagesBeforeTheHandshakeAnyUpToTheLimitAfterIt) {
  ServerLimits limits;
  limits.max_message_bytes = 4 << 20;
  start(limits);
  // A hello with a 32 KiB name is within max_message_bytes but not before authentication.
  auto big_hello = dial(kToken, std::string(32 << 10, 'x'));
  ASSERT_FALSE(big_hello);
  EXPECT_EQ(grants_, 0);
  EXPECT_EQ(server_->counters().refused, 1u);
  // A real handshake fits with a wide margin: what it needs is measured here (on a fresh server,
  // so the refused hello above does not count).
  start(limits);
  auto conn = dial(kToken, "node daemon n-0123456789");
  ASSERT_TRUE(conn) << conn.status().to_string();
  EXPECT_EQ(grants_, 1);
  const uint64_t handshake = server_->counters().largest_unauthenticated_message;
  EXPECT_GT(handshake, 0u);
  EXPECT_LT(handshake, 1024u);
  std::printf("largest message of a real handshake before authentication: %llu bytes\n",
              static_cast<unsigned long long>(handshake));
  // Once authenticated, a message of 3 MiB (here a hello with a 3 MiB name) is fine.
  auto hello = (*conn)->gateway.helloRequest();
  hello.setVersion(kProtocolVersion);
  std::string name(3 << 20, 'n');
  hello.setPeer(name.c_str());
  std::string nonce(32, 'c');
  hello.setClientNonce(kj::arrayPtr(reinterpret_cast<const kj::byte*>(nonce.data()), 32));
  auto answered = kj::runCatchingExceptions([&]() { hello.send().wait(io_.waitScope); });
  EXPECT_TRUE(answered == nullptr) << "an authenticated peer's 3 MiB message was refused";
  // Above max_message_bytes it is still refused.
  auto too_big = (*conn)->gateway.helloRequest();
  too_big.setVersion(kProtocolVersion);
  std::string huge(5 << 20, 'n');
  too_big.setPeer(huge.c_str());
  too_big.setClientNonce(kj::arrayPtr(reinterpret_cast<const kj::byte*>(nonce.data()), 32));
  EXPECT_TRUE(kj::runCatchingExceptions([&]() { too_big.send().wait(io_.waitScope); }) != nullptr);
}

TEST_F(RpcTest, UnauthenticatedConnectionsPerAddressAreCapped) {
  ServerLimits limits;
  limits.max_unauthenticated_per_address = 3;
  start(limits);
  // Authenticated connections do not count: five at once from one address.
  std::vector<kj::Own<Connection>> drivers;
  for (int i = 0; i < 5; ++i) {
    auto conn = dial(kToken);
    ASSERT_TRUE(conn) << i << ": " << conn.status().to_string();
    drivers.push_back(kj::mv(*conn));
  }
  // Three idle connections that never authenticate: the fourth from that address is closed at
  // once, long before the handshake deadline; another address is still served.
  std::vector<int> idle;
  for (int i = 0; i < 3; ++i) idle.push_back(raw_connect(server_->port()));
  io_.provider->getTimer().afterDelay(50 * kj::MILLISECONDS).wait(io_.waitScope);
  int fourth = raw_connect(server_->port());
  ASSERT_GE(fourth, 0);
  EXPECT_TRUE(closed_by_server(fourth, 1000));
  ::close(fourth);
  for (int fd : idle) EXPECT_FALSE(closed_by_server(fd, 20));
  int other = raw_connect(server_->port(), "127.0.0.2");
  if (other >= 0) {
    EXPECT_FALSE(closed_by_server(other, 200)) << "another address was refused too";
    ::close(other);
  }
  // A client from the full address is told what may have happened.
  auto refused = dial(kToken);
  ASSERT_FALSE(refused);
  EXPECT_NE(refused.status().message().find("too many connections that have not authenticated"),
            std::string::npos)
      << refused.status().message();
  EXPECT_EQ(server_->counters().refused, 2u);
  // When they go, the address is served again.
  for (int fd : idle) ::close(fd);
  io_.provider->getTimer().afterDelay(50 * kj::MILLISECONDS).wait(io_.waitScope);
  auto again = dial(kToken);
  EXPECT_TRUE(again) << again.status().to_string();
}

TEST_F(RpcTest, GarbageBytesCloseOnlyThatConnection) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(server_->port());
  ::inet_pton(AF_INET, "127.0.0.1", &addr.sin_addr);
  ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  const char junk[] = "GET / HTTP/1.1\r\nHost: tessera\r\n\r\n\xff\xff\xff\xff garbage";
  ASSERT_GT(::send(fd, junk, sizeof(junk), MSG_NOSIGNAL), 0);
  // The server may answer with an Abort message; then it must close the connection. Run the
  // server's loop while reading until EOF (bounded).
  bool closed = false;
  for (int i = 0; i < 400 && !closed; ++i) {
    io_.provider->getTimer().afterDelay(5 * kj::MILLISECONDS).wait(io_.waitScope);
    char buf[256];
    ssize_t n = ::recv(fd, buf, sizeof(buf), MSG_DONTWAIT);
    closed = n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK);
  }
  EXPECT_TRUE(closed) << "the server kept a connection that sent garbage";
  ::close(fd);
  auto conn = dial(kToken, "after garbage");
  EXPECT_TRUE(conn) << conn.status().to_string();
}

TEST_F(RpcTest, PortInUseNamesTheAddress) {
  Endpoint e;
  e.secret = kToken;
  e.grant = [](proto::Handshake::AuthenticateResults::Builder) {};
  auto second = RpcServer::listen(io_, address_, std::move(e), "second");
  ASSERT_FALSE(second);
  EXPECT_EQ(second.status().code(), Code::kUnavailable);
  EXPECT_NE(second.status().message().find(address_), std::string::npos);
  EXPECT_NE(second.status().message().find("already in use"), std::string::npos)
      << second.status().message();
}

TEST_F(RpcTest, RefusedConnectionSaysSo) {
  // Bind and close a socket to find a port nobody listens on.
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  ::inet_pton(AF_INET, "127.0.0.1", &addr.sin_addr);
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  socklen_t len = sizeof(addr);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  ::close(fd);
  std::string dead = "127.0.0.1:" + std::to_string(ntohs(addr.sin_port));
  auto conn = connect(io_, dead, "test", kToken).wait(io_.waitScope);
  ASSERT_FALSE(conn);
  EXPECT_EQ(conn.status().code(), Code::kUnavailable);
  EXPECT_NE(conn.status().message().find("connection refused"), std::string::npos)
      << conn.status().message();
}

// A TCP server on loopback that is not Tessera: it answers every connection with `reply` (or
// nothing) and closes it after `hold_ms`.
class ForeignServer {
 public:
  ForeignServer(std::string reply, int hold_ms) {
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    ::inet_pton(AF_INET, "127.0.0.1", &addr.sin_addr);
    ::bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
    ::listen(fd_, 4);
    socklen_t len = sizeof(addr);
    ::getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len);
    port_ = ntohs(addr.sin_port);
    thread_ = std::thread([this, reply, hold_ms] {
      int c = ::accept(fd_, nullptr, nullptr);
      if (c < 0) return;
      char buf[512];
      ssize_t ignored = ::recv(c, buf, sizeof(buf), 0);
      (void)ignored;
      if (!reply.empty()) ignored = ::send(c, reply.data(), reply.size(), MSG_NOSIGNAL);
      std::this_thread::sleep_for(std::chrono::milliseconds(hold_ms));
      ::close(c);
    });
  }
  ~ForeignServer() {
    ::shutdown(fd_, SHUT_RDWR);
    thread_.join();
    ::close(fd_);
  }
  std::string address() const { return "127.0.0.1:" + std::to_string(port_); }

 private:
  int fd_ = -1;
  uint16_t port_ = 0;
  std::thread thread_;
};

TEST(ForeignPeerTest, AnHttpServerIsNotATesseraDaemon) {
  auto io = kj::setupAsyncIo();
  ForeignServer http("HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n", 0);
  auto conn = connect(io, http.address(), "driver", kToken, 3 * kj::SECONDS).wait(io.waitScope);
  ASSERT_FALSE(conn);
  EXPECT_EQ(conn.status().code(), Code::kFailedPrecondition);
  EXPECT_NE(conn.status().message().find("not a Tessera daemon at " + http.address()),
            std::string::npos)
      << conn.status().message();
}

TEST(ForeignPeerTest, ASilentServerIsATimeoutThatSaysSo) {
  auto io = kj::setupAsyncIo();
  ForeignServer silent("", 1500);
  auto conn =
      connect(io, silent.address(), "driver", kToken, 500 * kj::MILLISECONDS).wait(io.waitScope);
  ASSERT_FALSE(conn);
  EXPECT_EQ(conn.status().code(), Code::kDeadlineExceeded);
  EXPECT_NE(conn.status().message().find("accepted the connection but did not answer"),
            std::string::npos)
      << conn.status().message();
}

TEST(SplitHostPortTest, ParsesAndRejects) {
  auto ok = split_host_port("10.0.0.1:6380");
  ASSERT_TRUE(ok);
  EXPECT_EQ(ok->first, "10.0.0.1");
  EXPECT_EQ(ok->second, 6380);
  auto v6 = split_host_port("[::1]:80");
  ASSERT_TRUE(v6);
  EXPECT_EQ(v6->first, "::1");
  EXPECT_FALSE(split_host_port("10.0.0.1"));
  EXPECT_FALSE(split_host_port("10.0.0.1:"));
  EXPECT_FALSE(split_host_port("host:65536"));
  EXPECT_FALSE(split_host_port("host:12ab"));
}

TEST(StatusOverRpcTest, CodeSurvivesTheWire) {
  kj::Exception e(kj::Exception::Type::FAILED, __FILE__, __LINE__,
                  kj::str("remote exception: NOT_FOUND: no actor a-1"));
  Status st = to_status(e);
  EXPECT_EQ(st.code(), Code::kNotFound);
  EXPECT_EQ(st.message(), "no actor a-1");
  kj::Exception d(kj::Exception::Type::DISCONNECTED, __FILE__, __LINE__, kj::str("peer gone"));
  EXPECT_EQ(to_status(d).code(), Code::kUnavailable);
}

}  // namespace
}  // namespace tessera::rpc
