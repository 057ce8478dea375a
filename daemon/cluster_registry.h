// The head's cluster registry: which nodes are members, their last heartbeat, and who wants
// to hear about changes.
//
// A node registers with its NodeInfo, its Node capability and its node secret, and gets a
// NodeSession back. It is marked dead when it leaves, when it misses `missed_beats` heartbeats
// in a row, or when its connection drops and it does not register again within that same
// window (a member whose heartbeat to a slow head timed out reconnects and keeps its place);
// subscribers hear nodeAdded / nodeDead. A dead node's session refuses further heartbeats, so
// the node registers again. An id is bound to the secret it first registered with: no other
// connection can take it over. If the head itself was paused (SIGSTOP, a VM freeze) it gives
// every member a fresh window instead of declaring them dead unheard.
//
// A node can be marked draining (`tessera drain`): the mark is listed with it (NodeInfo.draining)
// and kept when it re-registers, and every Node capability the registry hands out (guarded())
// then refuses openLease, and spawnActor on its leases, so no new actor starts there; what runs
// there is left alone. The mark lives as long as the head: a restarted head forgets it.
//
// Single-threaded: lives on the head daemon's kj event loop.
#pragma once

#include <capnp/message.h>
#include <kj/async-io.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "common/status.h"
#include "daemon/node_defaults.h"
#include "protocol/cluster.capnp.h"

namespace tessera {

struct RegistryConfig {
  uint32_t heartbeat_ms = node_defaults::kHeartbeatMs;  // nodes beat this often
  uint32_t missed_beats = node_defaults::kMissedBeats;  // missing this many in a row: dead
};

class ClusterRegistry final : private kj::TaskSet::ErrorHandler {
 public:
  ClusterRegistry(kj::AsyncIoContext& io, RegistryConfig config);
  ~ClusterRegistry();
  ClusterRegistry(const ClusterRegistry&) = delete;
  ClusterRegistry& operator=(const ClusterRegistry&) = delete;

  // A new capability to the registry.
  proto::Cluster::Client client();

  // Registers the head's own node (no session: it lives as long as the registry).
  void add_local_node(proto::NodeInfo::Reader info, proto::Node::Client node);

  // Implementation of the RPC methods (used by the server objects).
  struct Registered {
    std::string node_id;
    proto::NodeSession::Client session;
  };
  Registered register_node(proto::NodeInfo::Reader info, proto::Node::Client node,
                           const std::string& secret);
  void heartbeat(const std::string& node_id, uint64_t session, proto::NodeUsage::Reader usage);
  void mark_dead(const std::string& node_id, uint64_t session, const std::string& reason);
  // The session's connection dropped: dead unless it registers again within the window.
  void session_lost(const std::string& node_id, uint64_t session);
  void fill_nodes(bool include_dead, proto::Cluster::ListNodesResults::Builder out);
  // Marks the live node whose id, else whose name, is `node` draining (`undo`: clears the mark)
  // and returns its info, valid until the registry next changes. NOT_FOUND (thrown as an RPC
  // error) naming `node` and listing the live nodes when none matches; INVALID_ARGUMENT when a
  // name fits several nodes, listing their ids.
  proto::NodeInfo::Reader drain(const std::string& node, bool undo);
  // OK, or FAILED_PRECONDITION naming the node of this id and saying that it drains (and how to
  // take it back) when it is marked draining.
  Status admits_actors(const std::string& node_id) const;
  // `node`, the capability of the node `node_id`, wrapped (a Cap'n Proto membrane, which also
  // wraps the leases it returns) so that openLease and Lease.spawnActor fail with
  // FAILED_PRECONDITION while that node is marked draining. Every other call passes through.
  proto::Node::Client guarded(const std::string& node_id, proto::Node::Client node);
  uint64_t subscribe(proto::ClusterListener::Client listener);
  void unsubscribe(uint64_t id);

  // `tessera stop --all`: asks every live member to shut down (Node.shutdown, each bounded by
  // `timeout`) and waits, up to `timeout` more, for them to leave or drop their connection.
  // Resolves to the ids of the members that took the request; never rejects.
  kj::Promise<std::vector<std::string>> stop_members(const std::string& reason,
                                                     kj::Duration timeout);
  // Fills `out` with the infos of `ids` (members still known) and then the head's own node.
  void fill_stopped(const std::vector<std::string>& ids, capnp::List<proto::NodeInfo>::Builder out);
  size_t stopped_size(const std::vector<std::string>& ids) const;
  // How the head stops itself after stopCluster has replied (the daemon's graceful stop).
  void set_stop_handler(std::function<void(const std::string& why)> handler) {
    stop_handler_ = std::move(handler);
  }
  const std::function<void(const std::string&)>& stop_handler() const { return stop_handler_; }

  const RegistryConfig& config() const { return config_; }
  size_t alive_count() const;

 private:
  struct Member;
  kj::Promise<void> check_loop();
  kj::Promise<void> wait_gone(std::vector<std::string> ids, kj::TimePoint deadline);
  void notify(bool added, const Member& member);
  void taskFailed(kj::Exception&& exception) override;

  kj::AsyncIoContext& io_;
  RegistryConfig config_;
  std::map<std::string, std::unique_ptr<Member>> members_;
  std::map<uint64_t, proto::ClusterListener::Client> listeners_;
  std::function<void(const std::string&)> stop_handler_;
  uint64_t next_id_ = 1;
  kj::TimePoint last_check_ = kj::origin<kj::TimePoint>();
  // Expires with the registry: sessions and subscriptions released later must not call back.
  std::shared_ptr<int> alive_ = std::make_shared<int>(0);
  kj::TaskSet tasks_;
};

}  // namespace tessera
