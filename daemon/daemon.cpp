#include "daemon/daemon.h"

#include <signal.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include "common/session.h"
#include "common/sha256.h"
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
  std::string bind_address;
};

namespace {

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
std::string Daemon::bind_address() const { return impl_->bind_address; }

namespace {

// How far the bound address reaches, for the start-up line.
std::string exposure(const std::string& bind_host) {
  if (is_loopback_host(bind_host)) {
    return "loopback only: other machines cannot reach it; pass --node-ip ADDRESS to serve a "
           "multi-machine cluster";
  }
  if (bind_host == "0.0.0.0" || bind_host == "::" || bind_host == "[::]") {
    return "all interfaces: anyone who can reach this machine can connect, and only the cluster "
           "token keeps them out";
  }
  return "interface " + bind_host + ": reachable from that network; peers need the cluster token";
}

}  // namespace

Expected<std::unique_ptr<Daemon>> Daemon::start(kj::AsyncIoContext& io, DaemonConfig config) {
  auto impl = std::make_unique<Impl>(io, std::move(config));
  Impl& d = *impl;
  const DaemonConfig& c = d.config;
  d.identity.node_id = c.node_id.empty() ? random_id("n-", 10) : c.node_id;
  d.identity.name = c.node_name.empty() ? hostname() : c.node_name;
  d.identity.is_head = c.head;
  d.identity.started_at_ms = unix_ms();
  d.identity.session_dir = c.session_dir;
  d.identity.shm_prefix = shm_prefix_for_this_process();
  if (c.cluster_token.empty()) return invalid_argument("a daemon needs a cluster token");
  TESSERA_ASSIGN_OR_RETURN(std::string node_secret, random_bytes(32));

  d.monitor = std::make_unique<ResourceMonitor>(c.nvml_library);
  if (c.gpus.has_value()) {
    // --gpus is checked strictly; CUDA_VISIBLE_DEVICES is read as CUDA reads it (it ends at
    // an entry that names no GPU: "-1", or a GPU of another machine's numbering).
    const size_t found = d.monitor->resources().gpus.size();
    std::string stopped;
    TESSERA_RETURN_IF_ERROR(d.monitor->keep_gpus(*c.gpus, c.gpus_exact ? nullptr : &stopped));
    const char* from = c.gpus_exact ? "--gpus" : "CUDA_VISIBLE_DEVICES";
    spdlog::info("offering {} of this machine's {} GPU(s): '{}' ({})",
                 d.monitor->resources().gpus.size(), found, *c.gpus, from);
    if (!stopped.empty()) {
      spdlog::warn("{} ends there, as CUDA reads it: {}; pass --gpus to name GPUs exactly", from,
                   stopped);
    }
  }
  NodeResources res = d.monitor->snapshot();
  if (res.gpus.empty()) {
    spdlog::info("resources: {} CPUs, {} MiB memory, no GPUs ({})", res.cpus,
                 res.memory_total >> 20, res.gpu_note.empty() ? "none found" : res.gpu_note);
  } else {
    spdlog::info("resources: {} CPUs, {} MiB memory, {} GPU(s) [{}], driver {}", res.cpus,
                 res.memory_total >> 20, res.gpus.size(), res.gpus[0].name, res.driver_version);
    spdlog::info("GPU links:\n{}", format_link_matrix(res));
  }

  std::string bind_host = !c.bind_host.empty() ? c.bind_host : c.node_ip;
  if (!c.head) {
    if (c.head_address.empty()) {
      return invalid_argument("a member daemon needs --address HEAD:PORT");
    }
    // Join first: the address the head sees us on is the one other nodes can reach.
    d.head_link = std::make_unique<HeadLink>(
        io, c.head_address, "node daemon " + d.identity.node_id, c.cluster_token, node_secret);
    Status st = d.head_link->connect(c.join_timeout_ms * kj::MILLISECONDS).wait(io.waitScope);
    if (!st) return st;
    if (bind_host.empty()) bind_host = d.head_link->local_ip();
  }
  if (bind_host.empty()) bind_host = "127.0.0.1";  // a single-machine start stays private
  std::string node_ip = c.node_ip;
  if (node_ip.empty()) {
    node_ip = (bind_host == "0.0.0.0" || bind_host == "::") ? detect_node_ip() : bind_host;
  }

  ObjectStoreOptions store;
  store.segment_prefix = d.identity.shm_prefix + "obj-";
  store.capacity_bytes = c.object_store_bytes;
  store.owner_capacity_bytes = c.shm_per_lease_bytes;
  TESSERA_RETURN_IF_ERROR(ObjectStore::validate(store));
  d.objects = std::make_unique<ObjectStore>(store);
  SupervisorConfig sup;
  sup.node_id = d.identity.node_id;
  sup.bin_dir = c.bin_dir.empty() ? self_exe_dir() : c.bin_dir;
  sup.log_dir = c.session_dir + "/logs";
  sup.listen_host = node_ip;
  for (const GpuDevice& g : res.gpus) sup.gpus.push_back(g.index);
  sup.kill_grace_ms = c.kill_grace_ms;
  sup.max_actors = c.max_actors;
  sup.health_timeout_ms = c.actor_health_timeout_ms;
  sup.step_timeout_ms = c.actor_step_timeout_ms;
  sup.job_env_allow.insert(sup.job_env_allow.end(), c.actor_env_allow.begin(),
                           c.actor_env_allow.end());
  d.actors = std::make_unique<ActorSupervisor>(io, sup);
  auto* monitor = d.monitor.get();
  d.node = std::make_unique<NodeService>(io, d.identity, *d.actors, *d.objects,
                                         [monitor]() { return monitor->snapshot(); });

  auto paf = kj::newPromiseAndFulfiller<std::string>();
  d.shutdown_fulfiller = kj::mv(paf.fulfiller);
  d.shutdown_promise = paf.promise.fork();
  // Node.shutdown and Cluster.stopCluster (`tessera stop --all`) stop the daemon the way
  // SIGTERM does: run() lets the reply leave, leaves the cluster, reaps the actors.
  auto* stopping = &d;
  auto stop = [stopping](const std::string& why) {
    if (stopping->shutdown_fulfiller && stopping->shutdown_fulfiller->isWaiting()) {
      stopping->shutdown_fulfiller->fulfill(std::string(why));
    }
  };
  d.node->set_shutdown_handler(stop);

  if (c.head) {
    d.registry =
        std::make_unique<ClusterRegistry>(io, RegistryConfig{c.heartbeat_ms, c.missed_beats});
    d.registry->set_stop_handler(stop);
  }
  rpc::Endpoint endpoint;
  endpoint.role = c.head ? proto::Role::HEAD : proto::Role::NODE;
  endpoint.server_id = d.identity.node_id;
  endpoint.secret = c.cluster_token;
  auto* self = &d;
  endpoint.grant = [self](proto::Handshake::AuthenticateResults::Builder out) {
    if (self->registry) {
      // The head's own node, refusing new actors while it drains (`tessera drain`).
      out.setNode(self->registry->guarded(self->identity.node_id, self->node->client()));
      out.setCluster(self->registry->client());
    } else {
      out.setNode(self->node->client());
    }
  };
  std::string host_part =
      bind_host.find(':') != std::string::npos ? "[" + bind_host + "]" : bind_host;
  auto server =
      rpc::RpcServer::listen(io, host_part + ":" + std::to_string(c.port), std::move(endpoint),
                             c.head ? "head" : "node daemon", c.limits);
  if (!server) return server.status();
  d.server = kj::mv(*server);
  d.bind_address = host_part + ":" + std::to_string(d.server->port());
  d.identity.address = node_ip + ":" + std::to_string(d.server->port());
  d.node->set_address(d.identity.address);

  if (c.head) {
    capnp::MallocMessageBuilder msg;
    auto info = msg.initRoot<proto::NodeInfo>();
    d.node->fill_info(info);
    d.registry->add_local_node(info.asReader(), d.node->client());
    spdlog::info("head {} ({}) serving at {} ({})", d.identity.node_id, d.identity.name,
                 d.identity.address, exposure(bind_host));
  } else {
    Status st = d.head_link->register_and_beat(*d.node).wait(io.waitScope);
    if (!st) return st;
    spdlog::info("node {} ({}) serving at {}, member of {} ({})", d.identity.node_id,
                 d.identity.name, d.identity.address, c.head_address, exposure(bind_host));
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
