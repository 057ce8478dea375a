// The RPC plumbing on its own: handshake, version mismatch, garbage, port in use, refusals.
#include "protocol/rpc.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

namespace tessera::rpc {
namespace {

class TestGateway final : public proto::Gateway::Server {
 public:
  int hellos = 0;

 protected:
  kj::Promise<void> hello(HelloContext context) override {
    ++hellos;
    require_version(context.getParams().getVersion(), context.getParams().getPeer(),
                    proto::Role::NODE);
    context.getResults().setVersion(kProtocolVersion);
    context.getResults().setRole(proto::Role::NODE);
    context.getResults().setServerId("n-test");
    return kj::READY_NOW;
  }
};

class RpcTest : public ::testing::Test {
 protected:
  // kj types have throwing destructors; gtest fixtures must not: hold them behind unique_ptr.
  struct Env {
    kj::AsyncIoContext io = kj::setupAsyncIo();
    kj::Own<RpcServer> server;
  };

  void SetUp() override {
    auto gw = kj::heap<TestGateway>();
    gateway_ = gw.get();
    auto server = RpcServer::listen(io_, "127.0.0.1:0", kj::mv(gw), "test");
    ASSERT_TRUE(server) << server.status().to_string();
    env_->server = kj::mv(*server);
    server_ = env_->server.get();
    address_ = "127.0.0.1:" + std::to_string(server_->port());
  }

  std::unique_ptr<Env> env_ = std::make_unique<Env>();
  kj::AsyncIoContext& io_ = env_->io;
  TestGateway* gateway_ = nullptr;
  RpcServer* server_ = nullptr;
  std::string address_;
};

TEST_F(RpcTest, HelloReturnsRoleAndId) {
  auto conn = connect(io_, address_, "unit test").wait(io_.waitScope);
  ASSERT_TRUE(conn) << conn.status().to_string();
  EXPECT_EQ((*conn)->role, proto::Role::NODE);
  EXPECT_EQ((*conn)->server_id, "n-test");
  EXPECT_EQ(gateway_->hellos, 1);
}

TEST_F(RpcTest, VersionMismatchIsAnErrorNamingBothVersions) {
  auto conn = connect(io_, address_, "old driver", 5 * kj::SECONDS, kProtocolVersion + 1)
                  .wait(io_.waitScope);
  ASSERT_FALSE(conn);
  EXPECT_EQ(conn.status().code(), Code::kFailedPrecondition);
  std::string m = conn.status().message();
  EXPECT_NE(m.find("old driver speaks Tessera protocol v" + std::to_string(kProtocolVersion + 1)),
            std::string::npos)
      << m;
  EXPECT_NE(m.find("this node daemon speaks v" + std::to_string(kProtocolVersion)),
            std::string::npos)
      << m;
}

TEST_F(RpcTest, ClientChecksTheServersVersionToo) {
  Status st = check_server_version(kProtocolVersion + 3, proto::Role::HEAD, "10.0.0.1:6380");
  EXPECT_EQ(st.code(), Code::kFailedPrecondition);
  EXPECT_NE(st.message().find("head at 10.0.0.1:6380 speaks Tessera protocol v"), std::string::npos)
      << st.message();
  EXPECT_TRUE(check_server_version(kProtocolVersion, proto::Role::HEAD, "x").is_ok());
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
  auto conn = connect(io_, address_, "after garbage").wait(io_.waitScope);
  EXPECT_TRUE(conn) << conn.status().to_string();
}

TEST_F(RpcTest, PortInUseNamesTheAddress) {
  auto second = RpcServer::listen(io_, address_, kj::heap<TestGateway>(), "second");
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
  auto conn = connect(io_, dead, "test").wait(io_.waitScope);
  ASSERT_FALSE(conn);
  EXPECT_EQ(conn.status().code(), Code::kUnavailable);
  EXPECT_NE(conn.status().message().find("connection refused"), std::string::npos)
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
