#include "daemon/daemon.h"

#include <signal.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include "daemon/actor_supervisor.h"
#include "daemon/cluster_registry.h"
#include "daemon/head_link.h"
#include "daemon/node_service.h"
#include "daemon/object_store.h"
#include "daemon/process.h"
#include "daemon/resources.h"
#include "protocol/rpc.h"

namespace tessera {

struct Daemon::Impl {
  Impl(kj::AsyncIoContext& io, DaemonConfig config) : io(io), config(std::move(config)) {}

  kj::AsyncIoContext& io;
  DaemonConfig config;
  NodeIdentity identity;
  std::unique_ptr<ResourceMonitor> monitor;
  std::unique_ptr<ObjectStore> objects;
  std::unique_ptr<ActorSupervisor> actors;
  std::unique_ptr<NodeService> node;
  std::unique_ptr<ClusterRegistry> registry;
  std::unique_ptr<HeadLink> head_link;
  kj::Own<rpc::RpcServer> server;
  kj::Own<kj::PromiseFulfiller<std::string>> shutdown_fulfiller;
  kj::Maybe<kj::ForkedPromise<std::string>> shutdown_promise;
};

namespace {

// The bootstrap capability: hello first, then the daemon's capabilities.
class GatewayImpl final : public proto::Gateway::Server {
 public:
  explicit GatewayImpl(Daemon::Impl& d) : d_(d) {}

 protected:
  kj::Promise<void> hello(HelloContext context) override {
    auto p = context.getParams();
    proto::Role role = d_.config.head ? proto::Role::HEAD : proto::Role::NODE;
    rpc::require_version(p.getVersion(), p.getPeer(), role);
    auto r = context.getResults();
    r.setVersion(rpc::kProtocolVersion);
    r.setRole(role);
    r.setServerId(d_.identity.node_id);
    r.setNode(d_.node->client());
    if (d_.registry) r.setCluster(d_.registry->client());
    return kj::READY_NOW;
  }

 private:
  Daemon::Impl& d_;
};

std::string hostname() {
  char buf[256] = {0};
  if (::gethostname(buf, sizeof(buf) - 1) != 0) return "localhost";
  return buf;
}

}  // namespace

Daemon::Daemon(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Daemon::~Daemon() {
  if (!impl_) return;
  // Reverse order of dependence: connections first (their leases end), then the rest.
  impl_->server = nullptr;
  impl_->head_link.reset();
  impl_->registry.reset();
  impl_->node.reset();
  impl_->actors.reset();   // kills what is left
  impl_->objects.reset();  // unlinks segments
}

std::string Daemon::address() const { return impl_->identity.address; }
std::string Daemon::node_id() const { return impl_->identity.node_id; }

Expected<std::unique_ptr<Daemon>> Daemon::start(kj::AsyncIoContext& io, DaemonConfig config) {
  auto impl = std::make_unique<Impl>(io, std::move(config));
  Impl& d = *impl;
  const DaemonConfig& c = d.config;
  d.identity.node_id = c.node_id.empty() ? random_id("n-", 10) : c.node_id;
  d.identity.name = c.node_name.empty() ? hostname() : c.node_name;
  d.identity.is_head = c.head;
  d.identity.started_at_ms = unix_ms();
  d.identity.session_dir = c.session_dir;
  d.identity.shm_prefix = "/tessera-" + d.identity.node_id.substr(2) + "-";

  d.monitor = std::make_unique<ResourceMonitor>(c.nvml_library);
  NodeResources res = d.monitor->snapshot();
  if (res.gpus.empty()) {
    spdlog::info("resources: {} CPUs, {} MiB memory, no GPUs ({})", res.cpus,
                 res.memory_total >> 20, res.gpu_note.empty() ? "none found" : res.gpu_note);
  } else {
    spdlog::info("resources: {} CPUs, {} MiB memory, {} GPU(s) [{}], driver {}", res.cpus,
                 res.memory_total >> 20, res.gpus.size(), res.gpus[0].name, res.driver_version);
    spdlog::info("GPU links:\n{}", format_link_matrix(res));
  }

  std::string node_ip = c.node_ip;
  if (!c.head) {
    if (c.head_address.empty()) {
      return invalid_argument("a member daemon needs --address HEAD:PORT");
    }
    // Join first: the address the head sees us on is the one other nodes can reach.
    d.head_link =
        std::make_unique<HeadLink>(io, c.head_address, "node daemon " + d.identity.node_id);
    Status st = d.head_link->connect(c.join_timeout_ms * kj::MILLISECONDS).wait(io.waitScope);
    if (!st) return st;
    if (node_ip.empty()) node_ip = d.head_link->local_ip();
  }
  if (node_ip.empty()) node_ip = detect_node_ip();

  d.objects = std::make_unique<ObjectStore>(d.identity.shm_prefix + "obj-", c.object_store_bytes);
  SupervisorConfig sup;
  sup.node_id = d.identity.node_id;
  sup.bin_dir = c.bin_dir.empty() ? self_exe_dir() : c.bin_dir;
  sup.log_dir = c.session_dir + "/logs";
  sup.listen_host = node_ip;
  sup.gpu_count = static_cast<uint32_t>(res.gpus.size());
  sup.kill_grace_ms = c.kill_grace_ms;
  d.actors = std::make_unique<ActorSupervisor>(io, sup);
  auto* monitor = d.monitor.get();
  auto* self = &d;
  d.node = std::make_unique<NodeService>(
      io, d.identity, *d.actors, *d.objects, [monitor]() { return monitor->snapshot(); },
      [self]() {
        if (self->shutdown_fulfiller && self->shutdown_fulfiller->isWaiting()) {
          self->shutdown_fulfiller->fulfill(std::string("a shutdown RPC"));
        }
      });

  auto paf = kj::newPromiseAndFulfiller<std::string>();
  d.shutdown_fulfiller = kj::mv(paf.fulfiller);
  d.shutdown_promise = paf.promise.fork();

  auto server = rpc::RpcServer::listen(io, c.bind_host + ":" + std::to_string(c.port),
                                       kj::heap<GatewayImpl>(d), c.head ? "head" : "node daemon");
  if (!server) return server.status();
  d.server = kj::mv(*server);
  d.identity.address = node_ip + ":" + std::to_string(d.server->port());
  d.node->set_address(d.identity.address);

  if (c.head) {
    d.registry =
        std::make_unique<ClusterRegistry>(io, RegistryConfig{c.heartbeat_ms, c.missed_beats});
    capnp::MallocMessageBuilder msg;
    auto info = msg.initRoot<proto::NodeInfo>();
    d.node->fill_info(info);
    d.registry->add_local_node(info.asReader(), d.node->client());
    spdlog::info("head {} ({}) serving at {}", d.identity.node_id, d.identity.name,
                 d.identity.address);
  } else {
    Status st = d.head_link->register_and_beat(*d.node).wait(io.waitScope);
    if (!st) return st;
    spdlog::info("node {} ({}) serving at {}, member of {}", d.identity.node_id, d.identity.name,
                 d.identity.address, c.head_address);
  }
  return std::unique_ptr<Daemon>(new Daemon(std::move(impl)));
}

void Daemon::shutdown(const std::string& why) {
  if (impl_->shutdown_fulfiller && impl_->shutdown_fulfiller->isWaiting()) {
    impl_->shutdown_fulfiller->fulfill(std::string(why));
  }
}

kj::Promise<void> Daemon::run() {
  Impl& d = *impl_;
  auto on_signal = [](const char* name) { return [name](siginfo_t) { return std::string(name); }; };
  kj::Promise<std::string> stop = KJ_ASSERT_NONNULL(d.shutdown_promise).addBranch();
  stop = stop.exclusiveJoin(d.io.unixEventPort.onSignal(SIGTERM).then(on_signal("SIGTERM")))
             .exclusiveJoin(d.io.unixEventPort.onSignal(SIGINT).then(on_signal("SIGINT")));
  return stop
      .then([&d](std::string why) -> kj::Promise<std::string> {
        // Let the reply to a shutdown RPC leave before connections are torn down.
        return d.io.provider->getTimer().afterDelay(50 * kj::MILLISECONDS).then([why]() {
          return why;
        });
      })
      .then([&d](std::string why) -> kj::Promise<void> {
        spdlog::info("shutting down ({}): {} actor(s), {} lease(s)", why, d.actors->live_count(),
                     d.node->lease_count());
        if (d.head_link) {
          return d.head_link->leave("its daemon was stopped (" + why + ")", 2 * kj::SECONDS);
        }
        return kj::READY_NOW;
      })
      .then([&d]() { d.actors->kill_all_now(); });
}

}  // namespace tessera
