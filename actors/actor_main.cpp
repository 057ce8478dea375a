// tessera-actor: one worker process per GPU (or a CPU worker), spawned by a node daemon.
//
//   tessera-actor --actor-id a-1f2e --node-id n-3f2a --listen 10.0.0.2:0 --ready-fd 3
//       --key-fd 4 --heartbeat-fd 5 --step-timeout-ms 120000
//
// It reads its key (the secret every peer must prove, see protocol/auth.h) from the key fd (or,
// run by hand, from $TESSERA_ACTOR_KEY), binds its RPC port, writes "READY <port>\n" to the
// ready fd, and serves until a shutdown RPC, SIGTERM or SIGINT. A thread writes a byte to the
// heartbeat fd every 200 ms while the process runs and no step has gone longer than the step
// timeout without progress (its forward pass ticking, actors/step_watchdog.h), so its daemon can
// tell a stopped or stuck actor from a busy one, and a long step from a stuck one. Logs go to
// stderr, which the daemon points at the actor's log file.
#include <fcntl.h>
#include <signal.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <kj/async-unix.h>
#include <CLI/CLI.hpp>
#include <atomic>
#include <cstdlib>
#include <string>
#include <thread>

#include "actors/actor_service.h"
#include "actors/heap_trim.h"
#include "actors/step_watchdog.h"
#include "common/logging.h"
#include "protocol/auth.h"
#include "protocol/rpc.h"

namespace {

// The key from `fd` (read to EOF), else from $TESSERA_ACTOR_KEY (then removed from the
// environment so nothing this process starts inherits it).
tessera::Expected<std::string> read_key(int fd) {
  std::string text;
  if (fd >= 0) {
    char buf[512];
    ssize_t n;
    while ((n = ::read(fd, buf, sizeof(buf))) != 0) {
      if (n < 0) {
        if (errno == EINTR) continue;
        return tessera::internal_error(std::string("cannot read the key fd: ") +
                                       std::strerror(errno));
      }
      text.append(buf, static_cast<size_t>(n));
      if (text.size() > 4096) break;
    }
    ::close(fd);
  } else if (const char* env = std::getenv("TESSERA_ACTOR_KEY"); env != nullptr) {
    text = env;
    ::unsetenv("TESSERA_ACTOR_KEY");
  } else {
    return tessera::invalid_argument(
        "no key: tessera-actor is started by a node daemon (which passes --key-fd); to run it "
        "by hand set TESSERA_ACTOR_KEY");
  }
  auto key = tessera::auth::check_secret(std::move(text), "the actor key");
  if (!key) return key.status();
  return key;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Tessera actor process (started by a node daemon)"};
  tessera::ActorIdentity identity;
  std::string listen = "127.0.0.1:0";
  int ready_fd = -1;
  int key_fd = -1;
  int heartbeat_fd = -1;
  uint32_t step_timeout_ms = 0;
  std::string log_level;
  app.add_option("--actor-id", identity.actor_id, "this actor's id")->required();
  app.add_option("--node-id", identity.node_id, "the node daemon's id");
  app.add_option("--listen", listen, "HOST:PORT to serve RPC on (port 0 = any)");
  app.add_option("--ready-fd", ready_fd, "fd to write \"READY <port>\" to once serving");
  app.add_option("--key-fd", key_fd, "fd to read this actor's key from");
  app.add_option("--heartbeat-fd", heartbeat_fd, "fd to write heartbeats to");
  app.add_option("--step-timeout-ms", step_timeout_ms,
                 "stop the heartbeat when a step makes no progress for this long (0 = never)");
  app.add_option("--log-level", log_level, "trace|debug|info|warn|error");
  CLI11_PARSE(app, argc, argv);

  if (auto st = tessera::init_logging({"actor", "", log_level}); !st) {
    std::fprintf(stderr, "tessera-actor: %s\n", st.message().c_str());
    return 2;
  }
  auto key = read_key(key_fd);
  if (!key) {
    spdlog::error("cannot start: {}", key.status().message());
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
  identity.host = listen.substr(0, listen.rfind(':'));
  tessera::ActorService service(identity, probe);
  auto server = tessera::rpc::RpcServer::listen(io, listen, service.endpoint(*key),
                                                "actor " + identity.actor_id);
  if (!server) {
    spdlog::error("cannot serve: {}", server.status().message());
    return 1;
  }

  // The heartbeat: a byte every 200 ms while this process runs and its steps make progress. The
  // same thread gives the heap's free memory back when the actor goes idle (heap_trim.h).
  std::atomic<bool> stopping{false};
  std::thread heartbeat;
  if (heartbeat_fd >= 0) {
    ::fcntl(heartbeat_fd, F_SETFL, ::fcntl(heartbeat_fd, F_GETFL) | O_NONBLOCK);
    heartbeat = std::thread([&]() {
      tessera::StepWatchdog watchdog{std::chrono::milliseconds(step_timeout_ms)};
      tessera::HeapTrimSchedule trim{std::chrono::seconds(2)};
      while (!stopping.load()) {
        const auto busy = service.busy_for();
        const auto now = std::chrono::steady_clock::now();
        auto r = watchdog.observe(busy, service.step_progress(), now);
        if (r.newly_stuck) {
          spdlog::error(
              "a step has made no progress for {} ms (it has run {} ms), longer than the step "
              "timeout ({} ms): stuck (a hung collective or peer, a deadlock); stopping the "
              "heartbeat so the daemon restarts this actor",
              r.stalled.count(), r.busy.count(), step_timeout_ms);
        }
        if (r.newly_long) {
          spdlog::warn(
              "a step has run for {} ms, past the step timeout ({} ms), and is still making "
              "progress: long, not stuck, so the heartbeat goes on (a smaller "
              "--max-num-batched-tokens makes shorter prefill steps)",
              r.busy.count(), step_timeout_ms);
        }
        if (trim.due(busy, service.steps_done(), now)) {
          auto t = tessera::trim_heap();
          const uint64_t freed = t.rss_before > t.rss_after ? t.rss_before - t.rss_after : 0;
          spdlog::log(freed >= (16u << 20) ? spdlog::level::info : spdlog::level::debug,
                      "idle after {} steps: returned {} MiB of freed heap to the system (RSS {} "
                      "-> {} MiB)",
                      service.steps_done(), freed >> 20, t.rss_before >> 20, t.rss_after >> 20);
        }
        if (!r.stuck) {
          char beat = '.';
          ssize_t ignored = ::write(heartbeat_fd, &beat, 1);  // a full pipe: the daemon is slow
          (void)ignored;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(200));
      }
    });
  }

  spdlog::info("actor {} of node {} serving on port {}", identity.actor_id, identity.node_id,
               (*server)->port());
  if (ready_fd >= 0) {
    std::string line = "READY " + std::to_string((*server)->port()) + "\n";
    if (::write(ready_fd, line.data(), line.size()) != static_cast<ssize_t>(line.size())) {
      spdlog::error("cannot report readiness on fd {}: {}", ready_fd, std::strerror(errno));
      stopping = true;
      if (heartbeat.joinable()) heartbeat.join();
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
  service.stop_steps();
  stopping = true;
  if (heartbeat.joinable()) heartbeat.join();
  return 0;
}
