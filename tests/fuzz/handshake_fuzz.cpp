// Fuzzes what a peer can send to any Tessera port before it has proved the secret: Cap'n Proto
// framing, the Bootstrap, Gateway.hello and Handshake.authenticate, and whatever else a peer
// may try on that connection. The input is the peer's whole byte stream, fed through an
// in-memory pipe to a real RpcServer (the daemons' and actors' server, with its limits) until
// the server has nothing left to do. Nothing may crash, and no input may get the capabilities:
// the proofs need the token, which no input knows.
#include <cstddef>
#include <cstdint>

#include <kj/async-io.h>

#include "protocol/rpc.h"
#include "tests/fuzz/fuzz_util.h"

namespace {

struct Server {
  kj::AsyncIoContext io = kj::setupAsyncIo();
  kj::Own<tessera::rpc::RpcServer> rpc;
  int granted = 0;

  Server() {
    tessera::rpc::Endpoint e;
    e.role = tessera::proto::Role::HEAD;
    e.server_id = "n-fuzz";
    e.secret = "fuzz-cluster-token-0123456789";
    e.grant = [this](tessera::proto::Handshake::AuthenticateResults::Builder) { ++granted; };
    tessera::rpc::ServerLimits limits;
    limits.max_message_bytes = 1 << 20;
    auto server = tessera::rpc::RpcServer::listen(io, "127.0.0.1:0", std::move(e), "fuzz", limits);
    FUZZ_CHECK(server.has_value());
    rpc = kj::mv(*server);
  }
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static Server* server = new Server();  // one for the whole run, like a long-lived daemon
  auto& io = server->io;
  auto pipe = kj::newTwoWayPipe();
  server->rpc->serve(kj::mv(pipe.ends[1]));
  auto& peer = *pipe.ends[0];
  auto sent = peer.write(data, size)
                  .then([&peer]() { peer.shutdownWrite(); })
                  .eagerlyEvaluate([](kj::Exception&&) {});  // the server may close first
  // The server's answers are read and dropped, so it never blocks on a full pipe.
  auto buffer = kj::heapArray<kj::byte>(4096);
  struct Drain {
    static kj::Promise<void> loop(kj::AsyncIoStream& in, kj::ArrayPtr<kj::byte> buf) {
      return in.tryRead(buf.begin(), 1, buf.size()).then([&in, buf](size_t n) -> kj::Promise<void> {
        if (n == 0) return kj::READY_NOW;
        return loop(in, buf);
      });
    }
  };
  auto drained = Drain::loop(peer, buffer).eagerlyEvaluate([](kj::Exception&&) {});
  io.waitScope.poll();
  // The peer hangs up; the server must let the connection go.
  {
    auto drop = kj::mv(sent);
    auto drop2 = kj::mv(drained);
  }
  pipe.ends[0] = nullptr;
  io.waitScope.poll();
  FUZZ_CHECK(server->granted == 0);
  FUZZ_CHECK(server->rpc->connections() == 0);  // every connection ends with its peer
  return 0;
}
