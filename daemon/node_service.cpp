#include "daemon/node_service.h"

#include <spdlog/spdlog.h>
#include <sys/resource.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <memory>

#include "common/shm_ring.h"
#include "common/shm_segment.h"
#include "daemon/proto_convert.h"
#include "protocol/rpc.h"

namespace tessera {

namespace {

uint64_t now_ms() {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                   std::chrono::system_clock::now().time_since_epoch())
                                   .count());
}

void fill_actor_list(const std::vector<ActorRecord>& records, const std::string& node_id,
                     capnp::List<proto::ActorInfo>::Builder out) {
  for (size_t i = 0; i < records.size(); ++i) {
    to_proto(records[i], node_id, out[static_cast<unsigned>(i)]);
  }
}

bool valid_ring_name(const std::string& name) {
  if (name.empty() || name.size() > 48) return false;
  for (char c : name) {
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == '.')) {
      return false;
    }
  }
  return true;
}

}  // namespace

// ---- Lease -------------------------------------------------------------------------------

class LeaseImpl final : public proto::Lease::Server {
 public:
  LeaseImpl(NodeService& node, std::string key, std::string owner, uint32_t ttl_ms,
            proto::ActorWatcher::Client watcher, bool has_watcher)
      : node_(node),
        key_(std::move(key)),
        owner_(std::move(owner)),
        ttl_ms_(ttl_ms),
        watcher_(kj::mv(watcher)),
        has_watcher_(has_watcher),
        ttl_task_(nullptr) {
    node_.add_lease(key_, this);
    if (ttl_ms_ > 0) {
      deadline_ = node_.io().provider->getTimer().now() + ttl_ms_ * kj::MILLISECONDS;
      ttl_task_ = watch_ttl().eagerlyEvaluate(nullptr);
    }
    spdlog::info("lease {} opened by {}{}", key_, owner_,
                 ttl_ms_ ? " (TTL " + std::to_string(ttl_ms_) + " ms)" : std::string());
  }

  ~LeaseImpl() noexcept(false) {
    if (!ended_) end("the owner disconnected or dropped its lease");
    node_.remove_lease(key_);
  }

  // Called by NodeService when one of this lease's actors dies.
  void actor_died(const ActorRecord& record) {
    if (!has_watcher_) return;
    auto req = watcher_.actorDiedRequest();
    to_proto(record, node_.identity().node_id, req.initActor());
    auto key = key_;
    detached_.add(req.send().ignoreResult().catch_([key](kj::Exception&& e) {
      spdlog::debug("lease {}: watcher not reachable: {}", key, e.getDescription().cStr());
    }));
  }

 protected:
  kj::Promise<void> spawnActor(SpawnActorContext context) override {
    require_live();
    auto spec = context.getParams().getSpec();
    ActorSpawnRequest request;
    for (auto g : spec.getGpus()) request.gpus.push_back(g);
    for (auto e : spec.getEnv()) request.env.emplace_back(e.getName().cStr(), e.getValue().cStr());
    request.name = spec.getName().cStr();
    request.ready_timeout_ms = spec.getReadyTimeoutMs();
    return node_.actors()
        .spawn(key_, owner_, request)
        .then([this, context](Expected<SpawnedActor>&& spawned) mutable {
          if (!spawned) rpc::throw_status(spawned.status());
          auto results = context.getResults();
          to_proto(spawned->record, node_.identity().node_id, results.initInfo());
          results.setKey(kj::arrayPtr(reinterpret_cast<const kj::byte*>(spawned->key.data()),
                                      spawned->key.size()));
        });
  }

  kj::Promise<void> killActor(KillActorContext context) override {
    require_live();
    auto p = context.getParams();
    Status st = node_.actors().kill(p.getActorId().cStr(), p.getForce(), key_);
    if (!st) rpc::throw_status(st);
    return kj::READY_NOW;
  }

  kj::Promise<void> renew(RenewContext context) override {
    require_live();
    if (ttl_ms_ > 0) {
      deadline_ = node_.io().provider->getTimer().now() + ttl_ms_ * kj::MILLISECONDS;
    }
    context.getResults().setTtlMs(ttl_ms_);
    return kj::READY_NOW;
  }

  kj::Promise<void> listActors(ListActorsContext context) override {
    require_live();
    auto records = node_.actors().list_owner(key_);
    fill_actor_list(records, node_.identity().node_id,
                    context.getResults().initActors(static_cast<unsigned>(records.size())));
    return kj::READY_NOW;
  }

  kj::Promise<void> createObject(CreateObjectContext context) override {
    require_live();
    auto p = context.getParams();
    auto segment = node_.objects().create(key_, p.getId().cStr(), p.getSize());
    if (!segment) rpc::throw_status(segment.status());
    context.getResults().setSegment(*segment);
    return kj::READY_NOW;
  }

  kj::Promise<void> sealObject(SealObjectContext context) override {
    require_live();
    Status st = node_.objects().seal(key_, context.getParams().getId().cStr());
    if (!st) rpc::throw_status(st);
    return kj::READY_NOW;
  }

  kj::Promise<void> getObject(GetObjectContext context) override {
    require_live();
    std::string id = context.getParams().getId().cStr();
    uint32_t timeout_ms = context.getParams().getTimeoutMs();
    auto now = node_.objects().get(key_, id);
    if (now || now.status().code() != Code::kFailedPrecondition || timeout_ms == 0) {
      if (!now) rpc::throw_status(now.status());
      context.getResults().setSegment(now->segment);
      context.getResults().setSize(now->size);
      return kj::READY_NOW;
    }
    // Not sealed yet: wait for the seal (or the object's removal), bounded by the timeout.
    auto paf = kj::newPromiseAndFulfiller<Status>();
    auto fulfiller = std::make_shared<kj::Own<kj::PromiseFulfiller<Status>>>(kj::mv(paf.fulfiller));
    auto waiter = node_.objects().on_sealed(id, [fulfiller](Status st) {
      if ((*fulfiller)->isWaiting()) (*fulfiller)->fulfill(kj::mv(st));
    });
    return node_.io()
        .provider->getTimer()
        .timeoutAfter(timeout_ms * kj::MILLISECONDS, kj::mv(paf.promise))
        .then(
            [this, id, context](Status st) mutable {
              if (!st) rpc::throw_status(st);
              auto ref = node_.objects().get(key_, id);
              if (!ref) rpc::throw_status(ref.status());
              context.getResults().setSegment(ref->segment);
              context.getResults().setSize(ref->size);
            },
            [this, id, timeout_ms, waiter](kj::Exception&&) {
              node_.objects().cancel_seal_waiter(waiter);
              rpc::throw_status(deadline_exceeded("object '" + id + "' was not sealed within " +
                                                  std::to_string(timeout_ms) + " ms"));
            });
  }

  kj::Promise<void> releaseObject(ReleaseObjectContext context) override {
    require_live();
    Status st = node_.objects().release(key_, context.getParams().getId().cStr());
    if (!st) rpc::throw_status(st);
    return kj::READY_NOW;
  }

  kj::Promise<void> deleteObject(DeleteObjectContext context) override {
    require_live();
    Status st = node_.objects().remove(key_, context.getParams().getId().cStr());
    if (!st) rpc::throw_status(st);
    return kj::READY_NOW;
  }

  kj::Promise<void> createRing(CreateRingContext context) override {
    require_live();
    auto p = context.getParams();
    std::string name = p.getName().cStr();
    if (!valid_ring_name(name)) {
      rpc::throw_status(
          invalid_argument("ring name '" + name + "' must be 1-48 characters of [A-Za-z0-9._-]"));
    }
    if (rings_.count(name)) {
      rpc::throw_status(
          Status(Code::kAlreadyExists, "this lease already has a ring '" + name + "'"));
    }
    auto bytes = BroadcastRing::layout_bytes(p.getSlotBytes(), p.getSlots(), p.getReaders());
    if (!bytes) rpc::throw_status(bytes.status());
    // Rings live in the lease's own name space: two leases may both have a ring "steps".
    std::string segment_name =
        node_.identity().shm_prefix + "ring-" + key_.substr(0, key_.find('/')) + "-" + name;
    Status room = node_.objects().reserve(key_, *bytes, "ring '" + name + "'");
    if (!room) rpc::throw_status(room);
    auto segment = ShmSegment::create(segment_name, *bytes);
    if (!segment) {
      node_.objects().unreserve(key_, *bytes);
      rpc::throw_status(segment.status());
    }
    Status st = BroadcastRing::format(segment->data(), segment->size(), p.getSlotBytes(),
                                      p.getSlots(), p.getReaders());
    if (!st) {
      node_.objects().unreserve(key_, *bytes);
      rpc::throw_status(st);
    }
    spdlog::info("lease {}: ring {} ({} slots x {} bytes, {} readers)", key_, segment_name,
                 p.getSlots(), p.getSlotBytes(), p.getReaders());
    rings_.emplace(name, std::move(*segment));
    context.getResults().setSegment(segment_name);
    return kj::READY_NOW;
  }

 private:
  void require_live() {
    if (ended_) {
      rpc::throw_status(failed_precondition("lease " + key_ + " has ended (" + end_reason_ +
                                            "); open a new lease"));
    }
  }

  kj::Promise<void> watch_ttl() {
    auto& timer = node_.io().provider->getTimer();
    return timer.atTime(deadline_).then([this]() -> kj::Promise<void> {
      if (node_.io().provider->getTimer().now() < deadline_) return watch_ttl();
      end("its TTL of " + std::to_string(ttl_ms_) + " ms lapsed without a renew");
      return kj::READY_NOW;
    });
  }

  void end(const std::string& why) {
    ended_ = true;
    end_reason_ = why;
    spdlog::info("lease {} of {} ended: {}", key_, owner_, why);
    node_.end_lease(key_, why);
    for (auto& [name, seg] : rings_) {
      spdlog::info("lease {}: unlinking ring {}", key_, seg.name());
      node_.objects().unreserve(key_, seg.size());
    }
    rings_.clear();
  }

  NodeService& node_;
  std::string key_;
  std::string owner_;
  uint32_t ttl_ms_;
  proto::ActorWatcher::Client watcher_;
  bool has_watcher_;
  kj::TimePoint deadline_ = kj::origin<kj::TimePoint>();
  kj::Promise<void> ttl_task_;
  bool ended_ = false;
  std::string end_reason_;
  std::map<std::string, ShmSegment> rings_;
  class LogErrors : public kj::TaskSet::ErrorHandler {
    void taskFailed(kj::Exception&& e) override {
      spdlog::debug("lease task failed: {}", e.getDescription().cStr());
    }
  } log_errors_;
  kj::TaskSet detached_{log_errors_};
};

// ---- Node ---------------------------------------------------------------------------------

struct PeerResult {
  std::string address;
  bool reachable = false;
  double connect_ms = 0;
  std::string error;
};

// A TCP connect to `address` ("host:port"), bounded by `timeout_ms`; never rejects.
kj::Promise<PeerResult> reach(kj::AsyncIoContext& io, const std::string& address,
                              uint32_t timeout_ms) {
  auto start = std::chrono::steady_clock::now();
  auto elapsed_ms = [start] {
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
        .count();
  };
  auto connect = io.provider->getNetwork()
                     .parseAddress(address)
                     .then([](kj::Own<kj::NetworkAddress> a) {
                       auto connecting = a->connect();
                       return connecting.attach(kj::mv(a));
                     })
                     .then([](kj::Own<kj::AsyncIoStream>) {});
  return io.provider->getTimer()
      .timeoutAfter(timeout_ms * kj::MILLISECONDS, kj::mv(connect))
      .then(
          [address, elapsed_ms]() {
            return PeerResult{address, true, elapsed_ms(), ""};
          },
          [address, elapsed_ms](kj::Exception&& e) {
            return PeerResult{address, false, elapsed_ms(), rpc::to_status(e).message()};
          });
}

// Free bytes of the file system holding `path` for an unprivileged user (statvfs f_bavail).
Expected<std::pair<uint64_t, uint64_t>> space_of(const std::string& path) {
  struct statvfs s {};
  if (::statvfs(path.c_str(), &s) != 0) {
    return not_found("cannot read the file system of " + path + ": " + std::strerror(errno));
  }
  return std::make_pair(static_cast<uint64_t>(s.f_blocks) * s.f_frsize,
                        static_cast<uint64_t>(s.f_bavail) * s.f_frsize);
}

class NodeImpl final : public proto::Node::Server {
 public:
  explicit NodeImpl(NodeService& node) : node_(node) {}

 protected:
  kj::Promise<void> info(InfoContext context) override {
    node_.fill_info(context.getResults().initInfo());
    return kj::READY_NOW;
  }

  kj::Promise<void> openLease(OpenLeaseContext context) override {
    auto p = context.getParams();
    std::string owner = p.getOwner().cStr();
    if (owner.empty()) owner = "anonymous";
    std::string key = random_id("l-") + "/" + owner;
    bool has_watcher = p.hasWatcher();
    proto::ActorWatcher::Client watcher =
        has_watcher ? p.getWatcher() : proto::ActorWatcher::Client(nullptr);
    context.getResults().setLease(
        kj::heap<LeaseImpl>(node_, key, owner, p.getTtlMs(), kj::mv(watcher), has_watcher));
    return kj::READY_NOW;
  }

  kj::Promise<void> listActors(ListActorsContext context) override {
    auto records = node_.actors().list();
    fill_actor_list(records, node_.identity().node_id,
                    context.getResults().initActors(static_cast<unsigned>(records.size())));
    return kj::READY_NOW;
  }

  kj::Promise<void> doctor(DoctorContext context) override {
    auto request = context.getParams().getRequest();
    std::vector<std::string> peers;
    for (auto p : request.getPeers()) peers.emplace_back(p.cStr());
    if (peers.size() > 1024) rpc::throw_status(invalid_argument("more than 1024 peers"));
    uint32_t timeout_ms = std::clamp<uint32_t>(request.getConnectTimeoutMs(), 100, 30000);
    std::string disk_path = request.getDiskPath().cStr();
    kj::Vector<kj::Promise<PeerResult>> reaches;
    for (auto& p : peers) reaches.add(reach(node_.io(), p, timeout_ms));
    return kj::joinPromises(reaches.releaseAsArray())
        .then([this, context, disk_path](kj::Array<PeerResult> results) mutable {
          auto out = context.getResults().initCheck();
          node_.fill_node_check(disk_path, out);
          auto list = out.initPeers(static_cast<unsigned>(results.size()));
          for (size_t i = 0; i < results.size(); ++i) {
            auto b = list[static_cast<unsigned>(i)];
            b.setAddress(results[i].address);
            b.setReachable(results[i].reachable);
            b.setConnectMs(results[i].connect_ms);
            b.setError(results[i].error);
          }
        });
  }

  kj::Promise<void> shutdown(ShutdownContext context) override {
    // The caller proved the cluster token before it got this capability (protocol/rpc.h).
    std::string reason = context.getParams().getReason().cStr();
    if (reason.empty()) reason = "a shutdown request";
    if (reason.size() > 200) reason.resize(200);
    if (!node_.shutdown_handler()) {
      rpc::throw_status(failed_precondition("this node cannot be stopped remotely"));
    }
    spdlog::info("shutdown requested over RPC: {}", reason);
    // The daemon replies first: it tears connections down only after a short delay.
    node_.shutdown_handler()(reason);
    return kj::READY_NOW;
  }

  kj::Promise<void> shmSegments(ShmSegmentsContext context) override {
    auto objects = node_.objects().list();
    auto results = context.getResults();
    auto list = results.initSegments(static_cast<unsigned>(objects.size()));
    for (size_t i = 0; i < objects.size(); ++i) {
      auto b = list[static_cast<unsigned>(i)];
      b.setName(objects[i].segment);
      b.setKind(proto::SegmentKind::OBJECT);
      b.setId(objects[i].id);
      b.setBytes(objects[i].bytes);
      b.setRefs(objects[i].refs);
      b.setSealed(objects[i].sealed);
      b.setOwner(objects[i].owner);
    }
    auto stats = node_.objects().stats();
    auto s = results.initStats();
    s.setCapacity(stats.capacity);
    s.setUsed(stats.used);
    s.setObjects(static_cast<uint32_t>(stats.objects));
    s.setLeaseCapacity(stats.owner_capacity);
    return kj::READY_NOW;
  }

 private:
  NodeService& node_;
};

// ---- NodeService ----------------------------------------------------------------------------

NodeService::NodeService(kj::AsyncIoContext& io, NodeIdentity identity, ActorSupervisor& actors,
                         ObjectStore& objects, std::function<NodeResources()> read_resources)
    : io_(io),
      identity_(std::move(identity)),
      actors_(actors),
      objects_(objects),
      read_resources_(std::move(read_resources)) {
  actors_.set_death_handler([this](const ActorRecord& r) { on_actor_death(r); });
}

NodeService::~NodeService() { actors_.set_death_handler(nullptr); }

proto::Node::Client NodeService::client() { return kj::heap<NodeImpl>(*this); }

void NodeService::fill_info(proto::NodeInfo::Builder out) {
  out.setNodeId(identity_.node_id);
  out.setName(identity_.name);
  out.setAddress(identity_.address);
  out.setIsHead(identity_.is_head);
  to_proto(read_resources_(), out.initResources());
  out.setStartedAtMs(identity_.started_at_ms);
  out.setAlive(true);
  out.setLastHeartbeatMs(now_ms());
  out.setSessionDir(identity_.session_dir);
  out.setPid(::getpid());
}

void NodeService::fill_node_check(const std::string& disk_path, proto::NodeCheck::Builder out) {
  out.setWallClockMs(now_ms());
  const std::string shm = "/dev/shm";
  out.setShmPath(shm);
  if (auto space = space_of(shm)) {
    out.setShmTotal(space->first);
    out.setShmFree(space->second);
  }
  struct rlimit files {};
  if (::getrlimit(RLIMIT_NOFILE, &files) == 0) {
    out.setNofileSoft(files.rlim_cur == RLIM_INFINITY ? UINT64_MAX : files.rlim_cur);
    out.setNofileHard(files.rlim_max == RLIM_INFINITY ? UINT64_MAX : files.rlim_max);
  }
  const std::string disk = disk_path.empty() ? identity_.session_dir : disk_path;
  out.setDiskPath(disk);
  if (auto space = space_of(disk)) {
    out.setDiskFree(space->second);
  } else {
    out.setDiskError(space.status().message());
  }
  std::vector<std::pair<std::string, std::string>> nccl;
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    std::string entry = *e;
    if (entry.rfind("NCCL_", 0) != 0) continue;
    auto eq = entry.find('=');
    if (eq == std::string::npos) continue;
    nccl.emplace_back(entry.substr(0, eq), entry.substr(eq + 1));
  }
  std::sort(nccl.begin(), nccl.end());
  auto env = out.initNcclEnv(static_cast<unsigned>(nccl.size()));
  for (size_t i = 0; i < nccl.size(); ++i) {
    env[static_cast<unsigned>(i)].setName(nccl[i].first);
    env[static_cast<unsigned>(i)].setValue(nccl[i].second);
  }
  const std::string actor = actors_.config().bin_dir + "/tessera-actor";
  out.setActorBinary(actor);
  if (::access(actor.c_str(), X_OK) != 0) {
    out.setActorBinaryError(std::string("cannot execute it: ") + std::strerror(errno));
  }
}

void NodeService::add_lease(const std::string& key, LeaseImpl* lease) { leases_[key] = lease; }

void NodeService::remove_lease(const std::string& key) { leases_.erase(key); }

void NodeService::end_lease(const std::string& key, const std::string& why) {
  actors_.kill_owner(key, why);
  objects_.release_all(key);
}

void NodeService::on_actor_death(const ActorRecord& record) {
  auto it = leases_.find(record.owner);
  if (it != leases_.end()) it->second->actor_died(record);
}

}  // namespace tessera
