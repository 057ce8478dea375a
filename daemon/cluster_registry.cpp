#include "daemon/cluster_registry.h"

#include <capnp/membrane.h>
#include <capnp/schema.h>
#include <spdlog/spdlog.h>

#include <chrono>
#include <tuple>

#include "common/sha256.h"

#include "protocol/rpc.h"

namespace tessera {

namespace {

uint64_t wall_ms() {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                   std::chrono::system_clock::now().time_since_epoch())
                                   .count());
}

}  // namespace

struct ClusterRegistry::Member {
  kj::Own<capnp::MallocMessageBuilder> message = kj::heap<capnp::MallocMessageBuilder>();
  proto::NodeInfo::Builder info{nullptr};
  proto::Node::Client node{nullptr};
  bool alive = true;
  bool local = false;    // the head's own node: no session, no heartbeats
  uint64_t session = 0;  // generation of the registration that is current
  std::string secret;    // the node secret its id is bound to
  kj::TimePoint last_beat = kj::origin<kj::TimePoint>();
  kj::Maybe<kj::TimePoint> lost_since;  // its connection dropped; waiting for it to come back

  // "second (n-3f2a9c0d1e)", or the id alone for a node without a name.
  std::string label() const {
    auto r = info.asReader();
    std::string id = r.getNodeId().cStr();
    return r.getName().size() == 0 ? id : std::string(r.getName().cStr()) + " (" + id + ")";
  }
};

namespace {

uint16_t method_ordinal(capnp::InterfaceSchema schema, kj::StringPtr name) {
  return schema.getMethodByName(name).getOrdinal();
}

// Turns away the calls that would start an actor on a draining node: Node.openLease, and
// Lease.spawnActor on the leases it hands out (the membrane wraps them too). Every other call,
// and every capability passed either way (an owner's ActorWatcher), goes by unchanged.
class DrainGuard final : public capnp::MembranePolicy, public kj::Refcounted {
 public:
  DrainGuard(ClusterRegistry& registry, std::weak_ptr<int> registry_alive, std::string node_id)
      : registry_(registry),
        registry_alive_(std::move(registry_alive)),
        node_id_(std::move(node_id)) {}

  kj::Maybe<capnp::Capability::Client> inboundCall(uint64_t interface_id, uint16_t method_id,
                                                   capnp::Capability::Client) override {
    static const uint16_t open_lease =
        method_ordinal(capnp::Schema::from<proto::Node>(), "openLease");
    static const uint16_t spawn_actor =
        method_ordinal(capnp::Schema::from<proto::Lease>(), "spawnActor");
    const bool starts_actor =
        (interface_id == capnp::typeId<proto::Node>() && method_id == open_lease) ||
        (interface_id == capnp::typeId<proto::Lease>() && method_id == spawn_actor);
    if (!starts_actor || registry_alive_.expired()) return nullptr;
    Status admitted = registry_.admits_actors(node_id_);
    if (admitted) return nullptr;
    // The call fails with this error; the capability itself stays usable.
    return capnp::Capability::Client(capnp::newBrokenCap(kj::Exception(
        kj::Exception::Type::FAILED, __FILE__, __LINE__, kj::str(admitted.to_string().c_str()))));
  }
  kj::Maybe<capnp::Capability::Client> outboundCall(uint64_t, uint16_t,
                                                    capnp::Capability::Client) override {
    return nullptr;
  }
  kj::Own<capnp::MembranePolicy> addRef() override { return kj::addRef(*this); }

 private:
  ClusterRegistry& registry_;
  std::weak_ptr<int> registry_alive_;
  std::string node_id_;
};

}  // namespace

// A node's membership. Released when the node's connection drops.
class SessionImpl final : public proto::NodeSession::Server {
 public:
  SessionImpl(ClusterRegistry& registry, std::weak_ptr<int> registry_alive, std::string node_id,
              uint64_t session)
      : registry_(registry),
        registry_alive_(std::move(registry_alive)),
        node_id_(std::move(node_id)),
        session_(session) {}
  ~SessionImpl() noexcept(false) {
    if (!registry_alive_.expired()) registry_.session_lost(node_id_, session_);
  }

 protected:
  kj::Promise<void> heartbeat(HeartbeatContext context) override {
    registry_.heartbeat(node_id_, session_, context.getParams().getUsage());
    return kj::READY_NOW;
  }
  kj::Promise<void> leave(LeaveContext context) override {
    std::string reason = context.getParams().getReason().cStr();
    registry_.mark_dead(node_id_, session_, reason.empty() ? "it left the cluster" : reason);
    return kj::READY_NOW;
  }

 private:
  ClusterRegistry& registry_;
  std::weak_ptr<int> registry_alive_;
  std::string node_id_;
  uint64_t session_;
};

class SubscriptionImpl final : public proto::Subscription::Server {
 public:
  SubscriptionImpl(ClusterRegistry& registry, std::weak_ptr<int> alive, uint64_t id)
      : registry_(registry), alive_(std::move(alive)), id_(id) {}
  ~SubscriptionImpl() noexcept(false) {
    if (!alive_.expired()) registry_.unsubscribe(id_);
  }

 private:
  ClusterRegistry& registry_;
  std::weak_ptr<int> alive_;
  uint64_t id_;
};

class ClusterImpl final : public proto::Cluster::Server {
 public:
  ClusterImpl(ClusterRegistry& registry, std::weak_ptr<int> alive)
      : registry_(registry), alive_(std::move(alive)) {}

 protected:
  kj::Promise<void> registerNode(RegisterNodeContext context) override {
    auto p = context.getParams();
    auto secret = p.getNodeSecret();
    auto reg = registry_.register_node(
        p.getInfo(), p.getNode(),
        std::string(reinterpret_cast<const char*>(secret.begin()), secret.size()));
    auto r = context.getResults();
    r.setNodeId(reg.node_id);
    r.setSession(kj::mv(reg.session));
    r.setHeartbeatMs(registry_.config().heartbeat_ms);
    r.setMissedBeats(registry_.config().missed_beats);
    return kj::READY_NOW;
  }
  kj::Promise<void> listNodes(ListNodesContext context) override {
    registry_.fill_nodes(context.getParams().getIncludeDead(), context.getResults());
    return kj::READY_NOW;
  }
  kj::Promise<void> subscribe(SubscribeContext context) override {
    uint64_t id = registry_.subscribe(context.getParams().getListener());
    context.getResults().setSubscription(kj::heap<SubscriptionImpl>(registry_, alive_, id));
    return kj::READY_NOW;
  }
  kj::Promise<void> drainNode(DrainNodeContext context) override {
    auto p = context.getParams();
    context.getResults().setNode(registry_.drain(p.getNode().cStr(), p.getUndo()));
    return kj::READY_NOW;
  }
  kj::Promise<void> stopCluster(StopClusterContext context) override {
    // The caller proved the cluster token before it got this capability (protocol/rpc.h).
    std::string reason = context.getParams().getReason().cStr();
    if (reason.size() > 200) reason.resize(200);
    if (reason.empty()) reason = "tessera stop --all";
    if (!registry_.stop_handler()) {
      rpc::throw_status(failed_precondition("this head cannot be stopped remotely"));
    }
    spdlog::info("stopping the cluster: {}", reason);
    std::weak_ptr<int> alive = alive_;
    return registry_.stop_members(reason, 5 * kj::SECONDS)
        .then([this, alive, reason, context](std::vector<std::string> ids) mutable {
          if (alive.expired()) return;
          auto out =
              context.getResults().initStopped(static_cast<unsigned>(registry_.stopped_size(ids)));
          registry_.fill_stopped(ids, out);
          // The daemon lets this reply leave before it tears connections down.
          registry_.stop_handler()(reason);
        });
  }

 private:
  ClusterRegistry& registry_;
  std::weak_ptr<int> alive_;
};

// ---------------------------------------------------------------------------------------------

ClusterRegistry::ClusterRegistry(kj::AsyncIoContext& io, RegistryConfig config)
    : io_(io), config_(config), tasks_(*this) {
  last_check_ = io_.provider->getTimer().now();
  tasks_.add(check_loop());
}

ClusterRegistry::~ClusterRegistry() { alive_.reset(); }

void ClusterRegistry::taskFailed(kj::Exception&& exception) {
  spdlog::warn("cluster registry task failed: {}", exception.getDescription().cStr());
}

proto::Cluster::Client ClusterRegistry::client() { return kj::heap<ClusterImpl>(*this, alive_); }

void ClusterRegistry::add_local_node(proto::NodeInfo::Reader info, proto::Node::Client node) {
  auto m = std::make_unique<Member>();
  m->message->setRoot(info);
  m->info = m->message->getRoot<proto::NodeInfo>();
  m->info.setAlive(true);
  m->node = kj::mv(node);
  m->local = true;
  m->last_beat = io_.provider->getTimer().now();
  std::string id = info.getNodeId().cStr();
  members_[id] = std::move(m);
  spdlog::info("head node {} is a member of its own cluster", id);
}

ClusterRegistry::Registered ClusterRegistry::register_node(proto::NodeInfo::Reader info,
                                                           proto::Node::Client node,
                                                           const std::string& secret) {
  std::string id = info.getNodeId().cStr();
  if (id.empty()) rpc::throw_status(invalid_argument("registerNode: empty nodeId"));
  if (secret.size() < 16) {
    rpc::throw_status(invalid_argument("registerNode: node " + id + " sent no node secret"));
  }
  auto found = members_.find(id);
  if (found != members_.end() && found->second->local) {
    rpc::throw_status(Status(Code::kAlreadyExists, "node id " + id + " is the head's own"));
  }
  bool was_alive = false;
  if (found != members_.end()) {
    if (!constant_time_equal(found->second->secret, secret)) {
      spdlog::warn("refused a registration as node {} from {}: the id belongs to another daemon",
                   id, info.getAddress().cStr());
      rpc::throw_status(Status(Code::kPermissionDenied,
                               "node id " + id +
                                   " is registered by another daemon; a node id cannot be "
                                   "taken over (restart the daemon for a fresh id)"));
    }
    was_alive = found->second->alive;
  }
  // A drain outlives the node's connection: a member that reconnects stays drained.
  const bool draining = found != members_.end() && found->second->info.getDraining();
  auto m = std::make_unique<Member>();
  m->message->setRoot(info);
  m->info = m->message->getRoot<proto::NodeInfo>();
  m->info.setAlive(true);
  m->info.setDeathReason("");
  m->info.setDraining(draining);
  m->info.setLastHeartbeatMs(wall_ms());
  m->node = kj::mv(node);
  m->session = next_id_++;
  m->secret = secret;
  m->last_beat = io_.provider->getTimer().now();
  uint64_t session = m->session;
  auto& slot = members_[id];
  bool again = slot != nullptr;
  slot = std::move(m);
  auto res = info.getResources();
  if (was_alive) {
    // Its old connection is gone or going; the node itself never left.
    spdlog::info("node {} ({}) reconnected from {}", id, info.getName().cStr(),
                 info.getAddress().cStr());
  } else {
    spdlog::info("node {} ({}) {}registered from {}: {} CPUs, {} GPU(s)", id, info.getName().cStr(),
                 again ? "re-" : "", info.getAddress().cStr(), res.getCpus(), res.getGpus().size());
    notify(true, *slot);
  }
  return {id, kj::heap<SessionImpl>(*this, alive_, id, session)};
}

void ClusterRegistry::heartbeat(const std::string& node_id, uint64_t session,
                                proto::NodeUsage::Reader usage) {
  auto it = members_.find(node_id);
  if (it == members_.end() || it->second->session != session) {
    rpc::throw_status(failed_precondition("node " + node_id +
                                          " has a newer registration; this session is stale"));
  }
  Member& m = *it->second;
  if (!m.alive) {
    rpc::throw_status(failed_precondition("node " + node_id + " was marked dead (" +
                                          std::string(m.info.getDeathReason().cStr()) +
                                          "); register again"));
  }
  m.last_beat = io_.provider->getTimer().now();
  m.info.setLastHeartbeatMs(wall_ms());
  auto res = m.info.getResources();
  res.setMemoryAvailable(usage.getMemoryAvailable());
  auto used = usage.getGpuMemoryUsed();
  auto gpus = res.getGpus();
  for (unsigned i = 0; i < used.size() && i < gpus.size(); ++i) gpus[i].setMemoryUsed(used[i]);
}

void ClusterRegistry::mark_dead(const std::string& node_id, uint64_t session,
                                const std::string& reason) {
  auto it = members_.find(node_id);
  if (it == members_.end() || it->second->session != session || !it->second->alive) return;
  Member& m = *it->second;
  m.alive = false;
  m.info.setAlive(false);
  m.info.setDeathReason(reason);
  m.node = nullptr;  // let go of the connection
  spdlog::warn("node {} ({}) is dead: {}", node_id, m.info.getName().cStr(), reason);
  notify(false, m);
}

void ClusterRegistry::session_lost(const std::string& node_id, uint64_t session) {
  auto it = members_.find(node_id);
  if (it == members_.end() || it->second->session != session || !it->second->alive) return;
  if (it->second->lost_since == nullptr) {
    it->second->lost_since = io_.provider->getTimer().now();
    spdlog::info(
        "node {}: its connection to the head dropped; waiting up to {} ms for it to "
        "reconnect",
        node_id, config_.heartbeat_ms * config_.missed_beats);
  }
}

void ClusterRegistry::fill_nodes(bool include_dead, proto::Cluster::ListNodesResults::Builder out) {
  std::vector<Member*> chosen;
  // The head first, then the others by registration.
  for (auto& [id, m] : members_) {
    if (m->local)
      chosen.insert(chosen.begin(), m.get());
    else if (m->alive || include_dead)
      chosen.push_back(m.get());
  }
  auto list = out.initNodes(static_cast<unsigned>(chosen.size()));
  for (size_t i = 0; i < chosen.size(); ++i) {
    auto e = list[static_cast<unsigned>(i)];
    e.setInfo(chosen[i]->info.asReader());
    if (chosen[i]->alive) {
      e.setNode(guarded(chosen[i]->info.getNodeId().cStr(), chosen[i]->node));
    }
  }
}

proto::NodeInfo::Reader ClusterRegistry::drain(const std::string& node, bool undo) {
  if (node.empty()) rpc::throw_status(invalid_argument("drainNode: no node id or name given"));
  Member* found = nullptr;
  auto by_id = members_.find(node);
  if (by_id != members_.end() && by_id->second->alive) found = by_id->second.get();
  std::vector<Member*> named;
  std::string live;
  for (auto& [id, m] : members_) {
    if (!m->alive) continue;
    live += (live.empty() ? "" : ", ") + m->label();
    if (node == m->info.getName().cStr()) named.push_back(m.get());
  }
  if (found == nullptr && named.size() > 1) {
    std::string ids;
    for (Member* m : named)
      ids += (ids.empty() ? "" : ", ") + std::string(m->info.getNodeId().cStr());
    rpc::throw_status(invalid_argument("node name " + node + " is shared by " +
                                       std::to_string(named.size()) + " live nodes (" + ids +
                                       "): pass the node id"));
  }
  if (found == nullptr && named.size() == 1) found = named.front();
  if (found == nullptr) {
    std::string why = "no live node has the id or name " + node;
    if (by_id != members_.end()) {
      why = "node " + by_id->second->label() + " is dead (" +
            std::string(by_id->second->info.getDeathReason().cStr()) + ")";
    }
    rpc::throw_status(not_found(why + "; the live nodes: " + live));
  }
  const bool was = found->info.getDraining();
  found->info.setDraining(!undo);
  if (was != !undo) {
    if (undo) {
      spdlog::info("node {} is no longer draining: new actors may go there again", found->label());
    } else {
      spdlog::info("node {} is draining: no new actors go there", found->label());
    }
  }
  return found->info.asReader();
}

Status ClusterRegistry::admits_actors(const std::string& node_id) const {
  auto it = members_.find(node_id);
  if (it == members_.end() || !it->second->info.getDraining()) return Status::ok();
  const std::string name = it->second->info.getName().cStr();
  return failed_precondition("node " + it->second->label() +
                             " is draining: no new actors go there (`tessera drain " +
                             (name.empty() ? node_id : name) + " --undo` takes it back)");
}

proto::Node::Client ClusterRegistry::guarded(const std::string& node_id, proto::Node::Client node) {
  return capnp::membrane(kj::mv(node), kj::refcounted<DrainGuard>(*this, alive_, node_id));
}

kj::Promise<std::vector<std::string>> ClusterRegistry::stop_members(const std::string& reason,
                                                                    kj::Duration timeout) {
  auto& timer = io_.provider->getTimer();
  kj::Vector<kj::Promise<std::string>> calls;
  for (auto& [id, m] : members_) {
    if (!m->alive || m->local) continue;
    auto req = m->node.shutdownRequest();
    req.setReason(reason);
    std::string node_id = id, label = m->label();
    calls.add(timer.timeoutAfter(timeout, req.send().ignoreResult())
                  .then(
                      [node_id, label]() {
                        spdlog::info("node {} accepted the shutdown request", label);
                        return node_id;
                      },
                      [label](kj::Exception&& e) {
                        spdlog::warn("could not stop node {}: {}", label,
                                     rpc::to_status(e).message());
                        return std::string();
                      }));
  }
  auto deadline = timer.now() + 2 * timeout;
  std::weak_ptr<int> alive = alive_;
  return kj::joinPromises(calls.releaseAsArray())
      .then([this, alive, deadline](kj::Array<std::string> answered) {
        std::vector<std::string> ids;
        for (auto& id : answered) {
          if (!id.empty()) ids.push_back(id);
        }
        if (alive.expired()) return kj::Promise<std::vector<std::string>>(ids);
        return wait_gone(ids, deadline).then([ids]() { return ids; });
      });
}

kj::Promise<void> ClusterRegistry::wait_gone(std::vector<std::string> ids, kj::TimePoint deadline) {
  auto& timer = io_.provider->getTimer();
  bool all_gone = true;
  for (const auto& id : ids) {
    auto it = members_.find(id);
    if (it != members_.end() && it->second->alive && it->second->lost_since == nullptr) {
      all_gone = false;
    }
  }
  if (all_gone || timer.now() >= deadline) return kj::READY_NOW;
  std::weak_ptr<int> alive = alive_;
  return timer.afterDelay(20 * kj::MILLISECONDS)
      .then([this, alive, ids = std::move(ids), deadline]() mutable -> kj::Promise<void> {
        if (alive.expired()) return kj::READY_NOW;
        return wait_gone(std::move(ids), deadline);
      });
}

size_t ClusterRegistry::stopped_size(const std::vector<std::string>& ids) const {
  size_t n = 0;
  for (const auto& id : ids) n += members_.count(id);
  for (const auto& [id, m] : members_) n += m->local ? 1 : 0;
  return n;
}

void ClusterRegistry::fill_stopped(const std::vector<std::string>& ids,
                                   capnp::List<proto::NodeInfo>::Builder out) {
  unsigned i = 0;
  for (const auto& id : ids) {
    auto it = members_.find(id);
    if (it != members_.end() && i < out.size())
      out.setWithCaveats(i++, it->second->info.asReader());
  }
  for (const auto& [id, m] : members_) {
    if (m->local && i < out.size()) out.setWithCaveats(i++, m->info.asReader());
  }
}

uint64_t ClusterRegistry::subscribe(proto::ClusterListener::Client listener) {
  uint64_t id = next_id_++;
  listeners_.emplace(id, kj::mv(listener));
  return id;
}

void ClusterRegistry::unsubscribe(uint64_t id) { listeners_.erase(id); }

size_t ClusterRegistry::alive_count() const {
  size_t n = 0;
  for (auto& [id, m] : members_) n += m->alive ? 1 : 0;
  return n;
}

void ClusterRegistry::notify(bool added, const Member& member) {
  for (auto& [id, listener] : listeners_) {
    uint64_t lid = id;
    kj::Promise<void> sent = nullptr;
    if (added) {
      auto req = listener.nodeAddedRequest();
      req.setNode(member.info.asReader());
      sent = req.send().ignoreResult();
    } else {
      auto req = listener.nodeDeadRequest();
      req.setNode(member.info.asReader());
      sent = req.send().ignoreResult();
    }
    tasks_.add(sent.catch_([this, lid](kj::Exception&& e) {
      spdlog::info("dropping cluster subscriber {}: {}", lid, e.getDescription().cStr());
      listeners_.erase(lid);
    }));
  }
}

kj::Promise<void> ClusterRegistry::check_loop() {
  auto& timer = io_.provider->getTimer();
  return timer.afterDelay(config_.heartbeat_ms * kj::MILLISECONDS).then([this]() {
    auto now = io_.provider->getTimer().now();
    auto limit = config_.heartbeat_ms * config_.missed_beats * kj::MILLISECONDS;
    auto late_by = now - last_check_ - config_.heartbeat_ms * kj::MILLISECONDS;
    last_check_ = now;
    if (late_by * 2 > limit) {
      // The head did not run for a while (stopped, or its machine froze): nobody could reach it,
      // so silence says nothing about the members. Give every one a fresh window.
      spdlog::warn(
          "the head was paused for about {} ms; giving every member {} ms to be heard "
          "from before judging it",
          late_by / kj::MILLISECONDS, limit / kj::MILLISECONDS);
      for (auto& [id, m] : members_) {
        m->last_beat = now;
        if (m->lost_since != nullptr) m->lost_since = now;
      }
    }
    std::vector<std::tuple<std::string, uint64_t, std::string>> dead;
    for (auto& [id, m] : members_) {
      if (!m->alive || m->local) continue;
      KJ_IF_MAYBE (since, m->lost_since) {
        if (now - *since > limit) {
          dead.emplace_back(id, m->session,
                            "its connection to the head was lost and it did not reconnect within " +
                                std::to_string(limit / kj::MILLISECONDS) + " ms");
        }
      } else if (now - m->last_beat > limit) {
        dead.emplace_back(id, m->session,
                          "missed " + std::to_string(config_.missed_beats) +
                              " heartbeats (none for " +
                              std::to_string((now - m->last_beat) / kj::MILLISECONDS) + " ms)");
      }
    }
    for (auto& [id, session, reason] : dead) mark_dead(id, session, reason);
    // Forget dead members beyond the last 100.
    size_t dead_count = 0;
    for (auto it = members_.begin(); it != members_.end();) {
      if (!it->second->alive && ++dead_count > 100)
        it = members_.erase(it);
      else
        ++it;
    }
    return check_loop();
  });
}

}  // namespace tessera
