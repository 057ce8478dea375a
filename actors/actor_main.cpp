// tessera-actor: one worker process per GPU (or a CPU worker), spawned by a node daemon.
//
//   tessera-actor --actor-id a-1f2e --node-id n-3f2a --listen 10.0.0.2:0 --ready-fd 3
//
// It binds its RPC port, writes "READY <port>\n" to the ready fd, and serves until a shutdown
// RPC, SIGTERM or SIGINT. Logs go to stderr, which the daemon points at the actor's log file.
#include <signal.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <kj/async-unix.h>
#include <CLI/CLI.hpp>
#include <string>

#include "actors/actor_service.h"
#include "common/logging.h"
#include "protocol/rpc.h"

int main(int argc, char** argv) {
  CLI::App app{"Tessera actor process (started by a node daemon)"};
  tessera::ActorIdentity identity;
  std::string listen = "127.0.0.1:0";
  int ready_fd = -1;
  std::string log_level;
  app.add_option("--actor-id", identity.actor_id, "this actor's id")->required();
  app.add_option("--node-id", identity.node_id, "the node daemon's id");
  app.add_option("--listen", listen, "HOST:PORT to serve RPC on (port 0 = any)");
  app.add_option("--ready-fd", ready_fd, "fd to write \"READY <port>\" to once serving");
  app.add_option("--log-level", log_level, "trace|debug|info|warn|error");
  app.allow_extras();
  CLI11_PARSE(app, argc, argv);

  if (auto st = tessera::init_logging({"actor", "", log_level}); !st) {
    std::fprintf(stderr, "tessera-actor: %s\n", st.message().c_str());
    return 2;
  }
  kj::UnixEventPort::captureSignal(SIGTERM);
  kj::UnixEventPort::captureSignal(SIGINT);
  ::signal(SIGPIPE, SIG_IGN);

  tessera::CudaProbe probe = tessera::probe_cuda();
  if (probe.available) {
    for (const auto& d : probe.devices) {
      spdlog::info("CUDA device {}: {} (sm_{}{}, {} SMs, {} MiB, {}), NCCL {}", d.ordinal, d.name,
                   d.sm_major, d.sm_minor, d.multiprocessors, d.memory_total >> 20, d.pci_bus_id,
                   probe.nccl_version);
    }
  } else {
    spdlog::info("CPU backend: {}", probe.note);
  }

  auto io = kj::setupAsyncIo();
  tessera::ActorService service(identity, probe);
  auto server =
      tessera::rpc::RpcServer::listen(io, listen, service.gateway(), "actor " + identity.actor_id);
  if (!server) {
    spdlog::error("cannot serve: {}", server.status().message());
    return 1;
  }
  spdlog::info("actor {} of node {} serving on port {}", identity.actor_id, identity.node_id,
               (*server)->port());
  if (ready_fd >= 0) {
    std::string line = "READY " + std::to_string((*server)->port()) + "\n";
    if (::write(ready_fd, line.data(), line.size()) != static_cast<ssize_t>(line.size())) {
      spdlog::error("cannot report readiness on fd {}: {}", ready_fd, std::strerror(errno));
      return 1;
    }
    ::close(ready_fd);
  }
  auto why = service.on_shutdown()
                 .then([]() { return std::string("a shutdown RPC"); })
                 .exclusiveJoin(io.unixEventPort.onSignal(SIGTERM).then(
                     [](siginfo_t) { return std::string("SIGTERM"); }))
                 .exclusiveJoin(io.unixEventPort.onSignal(SIGINT).then(
                     [](siginfo_t) { return std::string("SIGINT"); }))
                 .wait(io.waitScope);
  spdlog::info("actor {} exiting ({})", identity.actor_id, why);
  // Let the reply to a shutdown RPC reach the caller before the process goes.
  io.provider->getTimer().afterDelay(50 * kj::MILLISECONDS).wait(io.waitScope);
  return 0;
}
