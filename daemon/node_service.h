// The node daemon's RPC face: proto::Node and the leases owners hold on it.
//
// A lease is the unit of ownership. Actors, ring segments and object references made through a
// lease die with it: when the owner disconnects (Cap'n Proto drops the capability), or a lease
// with a TTL is not renewed in time, its actors get SIGTERM (SIGKILL after a grace period), its
// rings are unlinked and its object references released. Deaths of a lease's actors are pushed
// to the owner's ActorWatcher.
//
// Single-threaded: lives on the daemon's kj event loop.
#pragma once

#include <kj/async-io.h>

#include <functional>
#include <map>
#include <memory>
#include <string>

#include "daemon/actor_supervisor.h"
#include "daemon/object_store.h"
#include "daemon/resources.h"
#include "protocol/node.capnp.h"

namespace tessera {

struct NodeIdentity {
  std::string node_id;
  std::string name;
  std::string address;  // "host:port" served
  bool is_head = false;
  uint64_t started_at_ms = 0;
  std::string session_dir;
  std::string shm_prefix;  // "/tessera-<pid>-<start>-": every segment of this daemon starts so
};

class LeaseImpl;

class NodeService {
 public:
  NodeService(kj::AsyncIoContext& io, NodeIdentity identity, ActorSupervisor& actors,
              ObjectStore& objects, std::function<NodeResources()> read_resources);
  ~NodeService();
  NodeService(const NodeService&) = delete;
  NodeService& operator=(const NodeService&) = delete;

  // A new capability on this node (each call makes a new server object sharing this state).
  proto::Node::Client client();

  // Fills `out` with identity and fresh resource readings.
  void fill_info(proto::NodeInfo::Builder out);
  // `tessera doctor`'s readings of this node, but for the peers (NodeImpl::doctor adds them):
  // clock, /dev/shm, RLIMIT_NOFILE, free space where `disk_path` is (the session folder when
  // empty), the NCCL_* variables, the actor binary.
  void fill_node_check(const std::string& disk_path, proto::NodeCheck::Builder out);

  const NodeIdentity& identity() const { return identity_; }
  void set_address(const std::string& address) { identity_.address = address; }
  NodeResources resources() const { return read_resources_(); }
  ActorSupervisor& actors() { return actors_; }
  ObjectStore& objects() { return objects_; }
  kj::AsyncIoContext& io() { return io_; }
  size_t lease_count() const { return leases_.size(); }
  // What Node.shutdown runs (the daemon's graceful stop, the SIGTERM path); unset, shutdown
  // fails with FAILED_PRECONDITION.
  void set_shutdown_handler(std::function<void(const std::string& why)> handler) {
    shutdown_ = std::move(handler);
  }
  const std::function<void(const std::string&)>& shutdown_handler() const { return shutdown_; }

  // Lease bookkeeping, called by LeaseImpl.
  void add_lease(const std::string& key, LeaseImpl* lease);
  // Kills the lease's actors and releases its objects; deaths are still reported to its
  // watcher until remove_lease.
  void end_lease(const std::string& key, const std::string& why);
  void remove_lease(const std::string& key);

 private:
  void on_actor_death(const ActorRecord& record);

  kj::AsyncIoContext& io_;
  NodeIdentity identity_;
  ActorSupervisor& actors_;
  ObjectStore& objects_;
  std::function<NodeResources()> read_resources_;
  std::map<std::string, LeaseImpl*> leases_;
  std::function<void(const std::string&)> shutdown_;
};

}  // namespace tessera
