#include "driver/client.h"

#include <spdlog/spdlog.h>

#include <optional>

namespace tessera {

// ---- EventLoop --------------------------------------------------------------------------------

struct EventLoop::Impl {
  kj::AsyncIoContext io = kj::setupAsyncIo();
};

EventLoop::EventLoop() : impl_(std::make_unique<Impl>()) {}
EventLoop::~EventLoop() = default;
kj::AsyncIoContext& EventLoop::io() { return impl_->io; }
kj::WaitScope& EventLoop::wait_scope() { return impl_->io.waitScope; }

void EventLoop::run_for(std::chrono::milliseconds duration, const std::function<bool()>& done) {
  auto deadline = std::chrono::steady_clock::now() + duration;
  auto& timer = impl_->io.provider->getTimer();
  while (std::chrono::steady_clock::now() < deadline) {
    if (done && done()) return;
    // Wake at least every 10 ms to re-check `done`.
    timer.afterDelay(10 * kj::MILLISECONDS).wait(impl_->io.waitScope);
    impl_->io.waitScope.poll();
  }
}

namespace {

constexpr kj::Duration kCallTimeout = 30 * kj::SECONDS;

template <typename T>
Expected<T> await(EventLoop& loop, kj::Promise<T>&& promise, const char* what,
                  kj::Duration timeout = kCallTimeout) {
  return wait_for(loop, kj::mv(promise), what, timeout);
}

Status await_void(EventLoop& loop, kj::Promise<void>&& promise, const char* what,
                  kj::Duration timeout = kCallTimeout) {
  auto r = await(loop, promise.then([]() { return true; }), what, timeout);
  return r.status();
}

LinkKind link_kind(proto::LinkKind k) {
  switch (k) {
    case proto::LinkKind::SELF:
      return LinkKind::kSelf;
    case proto::LinkKind::NVLINK:
      return LinkKind::kNvlink;
    case proto::LinkKind::PIX:
      return LinkKind::kPix;
    case proto::LinkKind::PXB:
      return LinkKind::kPxb;
    case proto::LinkKind::PHB:
      return LinkKind::kPhb;
    case proto::LinkKind::NODE:
      return LinkKind::kNode;
    case proto::LinkKind::SYS:
      return LinkKind::kSys;
    case proto::LinkKind::UNKNOWN:
      return LinkKind::kUnknown;
  }
  return LinkKind::kUnknown;
}

GpuDevice gpu_device(proto::GpuInfo::Reader g) {
  GpuDevice d;
  d.index = g.getIndex();
  d.name = g.getName().cStr();
  d.uuid = g.getUuid().cStr();
  d.pci_bus_id = g.getPciBusId().cStr();
  d.memory_total = g.getMemoryTotal();
  d.memory_used = g.getMemoryUsed();
  return d;
}

const char* state_name(proto::ActorState s) {
  switch (s) {
    case proto::ActorState::STARTING:
      return "starting";
    case proto::ActorState::READY:
      return "ready";
    case proto::ActorState::DEAD:
      return "dead";
  }
  return "unknown";
}

}  // namespace

NodeView node_view(proto::NodeInfo::Reader info) {
  NodeView v;
  v.node_id = info.getNodeId().cStr();
  v.name = info.getName().cStr();
  v.address = info.getAddress().cStr();
  v.is_head = info.getIsHead();
  v.alive = info.getAlive();
  v.draining = info.getDraining();
  v.death_reason = info.getDeathReason().cStr();
  v.started_at_ms = info.getStartedAtMs();
  v.last_heartbeat_ms = info.getLastHeartbeatMs();
  v.session_dir = info.getSessionDir().cStr();
  v.pid = info.getPid();
  auto r = info.getResources();
  v.resources.hostname = r.getHostname().cStr();
  v.resources.cpus = r.getCpus();
  v.resources.memory_total = r.getMemoryTotal();
  v.resources.memory_available = r.getMemoryAvailable();
  for (auto g : r.getGpus()) v.resources.gpus.push_back(gpu_device(g));
  for (auto l : r.getLinks()) v.resources.links.push_back({link_kind(l.getKind()), l.getNvlinks()});
  v.resources.driver_version = r.getDriverVersion().cStr();
  v.resources.cuda_version = r.getCudaVersion().cStr();
  v.resources.gpu_note = r.getGpuNote().cStr();
  return v;
}

ActorView actor_view(proto::ActorInfo::Reader a) {
  ActorView v;
  v.actor_id = a.getActorId().cStr();
  v.node_id = a.getNodeId().cStr();
  v.owner = a.getOwner().cStr();
  v.name = a.getName().cStr();
  v.pid = a.getPid();
  for (auto g : a.getGpus()) v.gpus.push_back(g);
  v.state = state_name(a.getState());
  v.address = a.getAddress().cStr();
  v.binary = a.getBinary().cStr();
  v.log_path = a.getLogPath().cStr();
  v.exit_code = a.getExitCode();
  v.term_signal = a.getTermSignal();
  v.death_reason = a.getDeathReason().cStr();
  v.last_log_line = a.getLastLogLine().cStr();
  v.hung = a.getHung();
  return v;
}

std::string describe_death(const ActorView& a, bool with_log) {
  std::string where;
  if (a.gpus.empty()) {
    where = "CPU";
  } else {
    where = a.gpus.size() == 1 ? "GPU " : "GPUs ";
    for (size_t i = 0; i < a.gpus.size(); ++i) where += (i ? "," : "") + std::to_string(a.gpus[i]);
  }
  std::string out = "actor " + a.actor_id + " (" + where + " on node " + a.node_id + ") ";
  if (a.hung) {
    out += "stopped answering: it " + a.death_reason;
  } else {
    if (a.death_reason.empty()) {
      out += "died";
    } else {
      out += (a.death_reason.rfind("killed", 0) == 0 ? "was " : "") + a.death_reason;
    }
    if (a.term_signal == 0 && !a.last_log_line.empty()) out += " after: " + a.last_log_line;
  }
  if (with_log && !a.log_path.empty()) out += "; its log: " + a.log_path;
  return out;
}

// ---- NodeHandle ---------------------------------------------------------------------------------

NodeHandle::NodeHandle(EventLoop& loop, proto::Node::Client node)
    : loop_(loop), node_(kj::mv(node)) {}

Expected<NodeView> NodeHandle::info() {
  auto r = await(
      loop_, node_.infoRequest().send().then([](auto&& resp) { return node_view(resp.getInfo()); }),
      "node info");
  return r;
}

Expected<std::vector<ActorView>> NodeHandle::actors() {
  return await(loop_, node_.listActorsRequest().send().then([](auto&& resp) {
    std::vector<ActorView> out;
    for (auto a : resp.getActors()) out.push_back(actor_view(a));
    return out;
  }),
               "list actors");
}

Expected<NodeCheckView> NodeHandle::check(const std::vector<std::string>& peers,
                                          const std::string& disk_path, uint32_t connect_timeout_ms,
                                          std::chrono::milliseconds timeout) {
  auto req = node_.doctorRequest();
  auto r = req.initRequest();
  auto list = r.initPeers(static_cast<unsigned>(peers.size()));
  for (size_t i = 0; i < peers.size(); ++i) list.set(static_cast<unsigned>(i), peers[i]);
  r.setDiskPath(disk_path);
  r.setConnectTimeoutMs(connect_timeout_ms);
  return await(loop_, req.send().then([](auto&& resp) {
    auto c = resp.getCheck();
    NodeCheckView v;
    v.wall_clock_ms = c.getWallClockMs();
    v.shm_path = c.getShmPath().cStr();
    v.shm_total = c.getShmTotal();
    v.shm_free = c.getShmFree();
    v.nofile_soft = c.getNofileSoft();
    v.nofile_hard = c.getNofileHard();
    v.disk_path = c.getDiskPath().cStr();
    v.disk_free = c.getDiskFree();
    v.disk_error = c.getDiskError().cStr();
    for (auto e : c.getNcclEnv()) v.nccl_env.emplace_back(e.getName().cStr(), e.getValue().cStr());
    for (auto p : c.getPeers()) {
      v.peers.push_back(
          {p.getAddress().cStr(), p.getReachable(), p.getConnectMs(), p.getError().cStr()});
    }
    v.actor_binary = c.getActorBinary().cStr();
    v.actor_binary_error = c.getActorBinaryError().cStr();
    return v;
  }),
               "doctor check", timeout.count() * kj::MILLISECONDS);
}

Expected<ObjectStoreView> NodeHandle::object_store() {
  return await(loop_, node_.shmSegmentsRequest().send().then([](auto&& resp) {
    ObjectStoreView v;
    v.capacity = resp.getStats().getCapacity();
    v.used = resp.getStats().getUsed();
    v.objects = resp.getStats().getObjects();
    for (auto s : resp.getSegments()) {
      SegmentView sv;
      sv.name = s.getName().cStr();
      sv.kind = s.getKind() == proto::SegmentKind::RING ? "ring" : "object";
      sv.id = s.getId().cStr();
      sv.bytes = s.getBytes();
      sv.refs = s.getRefs();
      sv.sealed = s.getSealed();
      sv.owner = s.getOwner().cStr();
      v.segments.push_back(sv);
    }
    return v;
  }),
               "list shared memory");
}

// ---- LeaseHandle --------------------------------------------------------------------------------

struct LeaseHandle::State {
  std::vector<ActorView> deaths;
  bool renewing = true;
};

namespace {

class WatcherImpl final : public proto::ActorWatcher::Server {
 public:
  explicit WatcherImpl(std::shared_ptr<LeaseHandle::State> state) : state_(std::move(state)) {}

 protected:
  kj::Promise<void> actorDied(ActorDiedContext context) override {
    state_->deaths.push_back(actor_view(context.getParams().getActor()));
    return kj::READY_NOW;
  }

 private:
  std::shared_ptr<LeaseHandle::State> state_;
};

kj::Promise<void> renew_loop(kj::Timer& timer, proto::Lease::Client lease, uint32_t ttl_ms,
                             std::weak_ptr<LeaseHandle::State> state) {
  return timer.afterDelay(std::max<uint32_t>(ttl_ms / 3, 1) * kj::MILLISECONDS)
      .then([&timer, lease, ttl_ms, state]() mutable -> kj::Promise<void> {
        auto s = state.lock();
        if (!s || !s->renewing) return kj::READY_NOW;
        return lease.renewRequest().send().ignoreResult().then(
            [&timer, lease, ttl_ms, state]() mutable {
              return renew_loop(timer, lease, ttl_ms, state);
            });
      });
}

}  // namespace

Expected<std::unique_ptr<LeaseHandle>> NodeHandle::open_lease(const std::string& owner,
                                                              uint32_t ttl_ms) {
  auto state = std::make_shared<LeaseHandle::State>();
  auto req = node_.openLeaseRequest();
  req.setOwner(owner);
  req.setTtlMs(ttl_ms);
  req.setWatcher(kj::heap<WatcherImpl>(state));
  auto lease =
      await(loop_, req.send().then([](auto&& resp) { return resp.getLease(); }), "open lease");
  if (!lease) return lease.status();
  auto handle = std::make_unique<LeaseHandle>(loop_, kj::mv(*lease), ttl_ms, std::move(state));
  return handle;
}

LeaseHandle::LeaseHandle(EventLoop& loop, proto::Lease::Client lease, uint32_t ttl_ms,
                         std::shared_ptr<State> state)
    : loop_(loop), lease_(kj::mv(lease)), state_(std::move(state)) {
  if (ttl_ms > 0) {
    renewing_ = renew_loop(loop.io().provider->getTimer(), lease_, ttl_ms, state_)
                    .eagerlyEvaluate([](kj::Exception&& e) {
                      spdlog::warn("lease renewal failed: {}", e.getDescription().cStr());
                    });
  }
}

LeaseHandle::~LeaseHandle() { state_->renewing = false; }

void LeaseHandle::stop_renewing() { state_->renewing = false; }

Expected<ActorView> LeaseHandle::spawn(const SpawnOptions& o) {
  auto req = lease_.spawnActorRequest();
  auto spec = req.initSpec();
  auto gpus = spec.initGpus(static_cast<unsigned>(o.gpus.size()));
  for (size_t i = 0; i < o.gpus.size(); ++i) gpus.set(static_cast<unsigned>(i), o.gpus[i]);
  auto env = spec.initEnv(static_cast<unsigned>(o.env.size()));
  for (size_t i = 0; i < o.env.size(); ++i) {
    env[static_cast<unsigned>(i)].setName(o.env[i].first);
    env[static_cast<unsigned>(i)].setValue(o.env[i].second);
  }
  spec.setName(o.name);
  spec.setReadyTimeoutMs(o.ready_timeout_ms);
  kj::Duration timeout =
      (o.ready_timeout_ms ? o.ready_timeout_ms : 30000) * kj::MILLISECONDS + 30 * kj::SECONDS;
  return await(loop_, req.send().then([](auto&& resp) {
    ActorView v = actor_view(resp.getInfo());
    auto key = resp.getKey();
    v.key.assign(reinterpret_cast<const char*>(key.begin()), key.size());
    return v;
  }),
               "spawn actor", timeout);
}

Status LeaseHandle::kill(const std::string& actor_id, bool force) {
  auto req = lease_.killActorRequest();
  req.setActorId(actor_id);
  req.setForce(force);
  return await_void(loop_, req.send().ignoreResult(), "kill actor");
}

Expected<std::vector<ActorView>> LeaseHandle::actors() {
  return await(loop_, lease_.listActorsRequest().send().then([](auto&& resp) {
    std::vector<ActorView> out;
    for (auto a : resp.getActors()) out.push_back(actor_view(a));
    return out;
  }),
               "list lease actors");
}

Status LeaseHandle::renew() {
  return await_void(loop_, lease_.renewRequest().send().ignoreResult(), "renew lease");
}

Expected<std::string> LeaseHandle::create_object(const std::string& id, uint64_t size) {
  auto req = lease_.createObjectRequest();
  req.setId(id);
  req.setSize(size);
  return await(loop_, req.send().then([](auto&& r) { return std::string(r.getSegment().cStr()); }),
               "create object");
}

Status LeaseHandle::seal_object(const std::string& id) {
  auto req = lease_.sealObjectRequest();
  req.setId(id);
  return await_void(loop_, req.send().ignoreResult(), "seal object");
}

Expected<std::pair<std::string, uint64_t>> LeaseHandle::get_object(const std::string& id,
                                                                   uint32_t timeout_ms) {
  auto req = lease_.getObjectRequest();
  req.setId(id);
  req.setTimeoutMs(timeout_ms);
  return await(loop_, req.send().then([](auto&& r) {
    return std::make_pair(std::string(r.getSegment().cStr()), r.getSize());
  }),
               "get object", timeout_ms * kj::MILLISECONDS + kCallTimeout);
}

Status LeaseHandle::release_object(const std::string& id) {
  auto req = lease_.releaseObjectRequest();
  req.setId(id);
  return await_void(loop_, req.send().ignoreResult(), "release object");
}

Status LeaseHandle::delete_object(const std::string& id) {
  auto req = lease_.deleteObjectRequest();
  req.setId(id);
  return await_void(loop_, req.send().ignoreResult(), "delete object");
}

Expected<std::string> LeaseHandle::create_ring(const std::string& name, uint32_t slot_bytes,
                                               uint32_t slots, uint32_t readers) {
  auto req = lease_.createRingRequest();
  req.setName(name);
  req.setSlotBytes(slot_bytes);
  req.setSlots(slots);
  req.setReaders(readers);
  return await(loop_, req.send().then([](auto&& r) { return std::string(r.getSegment().cStr()); }),
               "create ring");
}

const std::vector<ActorView>& LeaseHandle::deaths() const { return state_->deaths; }

Expected<ActorView> LeaseHandle::wait_for_death(const std::string& actor_id,
                                                std::chrono::milliseconds timeout) {
  auto find = [&]() -> const ActorView* {
    for (const auto& d : state_->deaths) {
      if (d.actor_id == actor_id) return &d;
    }
    return nullptr;
  };
  loop_.run_for(timeout, [&]() { return find() != nullptr; });
  if (const ActorView* d = find()) return *d;
  return deadline_exceeded("actor " + actor_id + " was not reported dead within " +
                           std::to_string(timeout.count()) + " ms");
}

// ---- ClusterClient ------------------------------------------------------------------------------

ClusterClient::ClusterClient(EventLoop& loop, kj::Own<rpc::Connection> conn)
    : loop_(loop), conn_(kj::mv(conn)) {}
ClusterClient::~ClusterClient() = default;

Expected<std::unique_ptr<ClusterClient>> ClusterClient::connect(EventLoop& loop,
                                                                const std::string& address,
                                                                const std::string& token,
                                                                std::chrono::milliseconds timeout) {
  auto conn = rpc::connect(loop.io(), address, "driver", token, timeout.count() * kj::MILLISECONDS)
                  .wait(loop.wait_scope());
  if (!conn) return conn.status();
  if ((*conn)->role != proto::Role::HEAD) {
    return failed_precondition(address + " is a " + rpc::role_name((*conn)->role) +
                               ", not a head; pass the head's address");
  }
  return std::make_unique<ClusterClient>(loop, kj::mv(*conn));
}

Expected<std::vector<NodeView>> ClusterClient::nodes(bool include_dead) {
  auto req = conn_->cluster.listNodesRequest();
  req.setIncludeDead(include_dead);
  return await(loop_, req.send().then([](auto&& resp) {
    std::vector<NodeView> out;
    for (auto e : resp.getNodes()) out.push_back(node_view(e.getInfo()));
    return out;
  }),
               "list nodes");
}

Expected<NodeHandle> ClusterClient::node(const std::string& node_id) {
  auto req = conn_->cluster.listNodesRequest();
  auto found =
      await(loop_, req.send().then([node_id](auto&& resp) -> kj::Maybe<proto::Node::Client> {
        for (auto e : resp.getNodes()) {
          if (node_id == e.getInfo().getNodeId().cStr() && e.getInfo().getAlive()) {
            return e.getNode();
          }
        }
        return nullptr;
      }),
            "find node");
  if (!found) return found.status();
  KJ_IF_MAYBE (n, *found) {
    return NodeHandle(loop_, *n);
  }
  return not_found("no live node " + node_id + " in the cluster at " + conn_->address);
}

NodeHandle ClusterClient::head_node() { return NodeHandle(loop_, conn_->node); }

Expected<NodeView> ClusterClient::drain(const std::string& node, bool undo) {
  auto req = conn_->cluster.drainNodeRequest();
  req.setNode(node);
  req.setUndo(undo);
  return await(loop_, req.send().then([](auto&& resp) { return node_view(resp.getNode()); }),
               undo ? "undo drain" : "drain node");
}

namespace {

class ListenerImpl final : public proto::ClusterListener::Server {
 public:
  ListenerImpl(std::function<void(const NodeView&)> added,
               std::function<void(const NodeView&)> dead)
      : added_(std::move(added)), dead_(std::move(dead)) {}

 protected:
  kj::Promise<void> nodeAdded(NodeAddedContext context) override {
    if (added_) added_(node_view(context.getParams().getNode()));
    return kj::READY_NOW;
  }
  kj::Promise<void> nodeDead(NodeDeadContext context) override {
    if (dead_) dead_(node_view(context.getParams().getNode()));
    return kj::READY_NOW;
  }

 private:
  std::function<void(const NodeView&)> added_;
  std::function<void(const NodeView&)> dead_;
};

}  // namespace

Expected<std::unique_ptr<ClusterClient::Subscription>> ClusterClient::subscribe(
    std::function<void(const NodeView&)> on_added, std::function<void(const NodeView&)> on_dead) {
  auto req = conn_->cluster.subscribeRequest();
  req.setListener(kj::heap<ListenerImpl>(std::move(on_added), std::move(on_dead)));
  auto sub =
      await(loop_, req.send().then([](auto&& r) { return r.getSubscription(); }), "subscribe");
  if (!sub) return sub.status();
  auto out = std::make_unique<Subscription>();
  out->handle = kj::mv(*sub);
  return out;
}

// ---- ActorHandle --------------------------------------------------------------------------------

ActorHandle::ActorHandle(EventLoop& loop, kj::Own<rpc::Connection> conn)
    : loop_(loop), conn_(kj::mv(conn)) {}
ActorHandle::~ActorHandle() = default;

Expected<std::unique_ptr<ActorHandle>> ActorHandle::connect(EventLoop& loop,
                                                            const std::string& address,
                                                            const std::string& key,
                                                            std::chrono::milliseconds timeout) {
  auto conn = rpc::connect(loop.io(), address, "driver", key, timeout.count() * kj::MILLISECONDS)
                  .wait(loop.wait_scope());
  if (!conn) return conn.status();
  if ((*conn)->role != proto::Role::ACTOR) {
    return failed_precondition(address + " is a " + rpc::role_name((*conn)->role) +
                               ", not an actor");
  }
  return std::make_unique<ActorHandle>(loop, kj::mv(*conn));
}

Expected<ActorHealthView> ActorHandle::health() {
  return await(loop_, conn_->actor.healthRequest().send().then([](auto&& resp) {
    auto h = resp.getHealth();
    ActorHealthView v;
    v.actor_id = h.getActorId().cStr();
    v.pid = h.getPid();
    v.uptime_ms = h.getUptimeMs();
    v.backend = h.getBackend().cStr();
    v.visible_devices = h.getVisibleDevices().cStr();
    for (auto d : h.getDevices()) v.devices.push_back(gpu_device(d));
    v.nccl_version = h.getNcclVersion().cStr();
    v.note = h.getNote().cStr();
    return v;
  }),
               "actor health");
}

Status ActorHandle::shutdown() {
  return await_void(loop_, conn_->actor.shutdownRequest().send().ignoreResult(), "actor shutdown");
}

}  // namespace tessera
