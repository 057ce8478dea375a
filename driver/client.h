// The driver's client library: blocking calls into a Tessera cluster from one thread.
//
//   tessera::EventLoop loop;
//   auto token = tessera::auth::resolve_cluster_token("", root);   // protocol/auth.h
//   auto cluster = tessera::ClusterClient::connect(loop, "10.0.0.1:6380", *token);
//   for (auto& node : cluster->nodes()) ...
//   auto lease = node.open_lease("my-driver", /*ttl_ms=*/0);
//   auto actor = lease->spawn({.gpus = {0}});
//   auto handle = tessera::ActorHandle::connect(loop, actor->address, actor->key);
//   auto health = handle->health();
//
// Every call returns Expected/Status: no exception leaves this library. Calls block the calling
// thread while running the loop, so asynchronous events (actor deaths, cluster events, lease
// renewals) are processed during any call, or by loop.run_for(). Everything here belongs to
// the thread that made the EventLoop.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/node_resources.h"
#include "common/status.h"
#include "protocol/rpc.h"

namespace tessera {

class EventLoop {
 public:
  EventLoop();
  ~EventLoop();
  EventLoop(const EventLoop&) = delete;
  EventLoop& operator=(const EventLoop&) = delete;

  kj::AsyncIoContext& io();
  kj::WaitScope& wait_scope();
  // Processes events for `duration` (or until `done` returns true, checked after each event).
  void run_for(std::chrono::milliseconds duration, const std::function<bool()>& done = nullptr);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Waits on the loop for `promise`, bounded by `timeout`; any exception (local or remote) becomes
// a Status prefixed with `what`. Every blocking call of this library goes through it.
template <typename T>
Expected<T> wait_for(EventLoop& loop, kj::Promise<T>&& promise, const char* what,
                     kj::Duration timeout = 30 * kj::SECONDS) {
  std::optional<T> result;
  auto bounded = loop.io().provider->getTimer().timeoutAfter(timeout, kj::mv(promise));
  KJ_IF_MAYBE (e, kj::runCatchingExceptions(
                      [&]() { result.emplace(bounded.wait(loop.wait_scope())); })) {
    Status st = rpc::to_status(*e);
    if (st.message().find("operation timed out") != std::string::npos) {
      return deadline_exceeded(std::string(what) + ": no answer within " +
                               std::to_string(timeout / kj::SECONDS) + " s");
    }
    return st.with_context(what);
  }
  return std::move(*result);
}

struct NodeView {
  std::string node_id;
  std::string name;
  std::string address;
  bool is_head = false;
  bool alive = false;
  // Marked by `tessera drain` (as the head lists it: NodeHandle::info(), which the node answers
  // itself, leaves it false): no new actors go there.
  bool draining = false;
  std::string death_reason;
  uint64_t started_at_ms = 0;
  uint64_t last_heartbeat_ms = 0;
  std::string session_dir;
  int pid = 0;
  NodeResources resources;

  // Alive and not draining: placement may put new ranks there.
  bool takes_actors() const { return alive && !draining; }
};

struct ActorView {
  std::string actor_id;
  std::string node_id;
  std::string owner;
  std::string name;
  int pid = -1;
  std::vector<uint32_t> gpus;
  std::string state;  // "starting", "ready", "dead"
  std::string address;
  std::string binary;
  std::string log_path;
  int exit_code = -1;
  int term_signal = 0;
  std::string death_reason;
  std::string last_log_line;  // when dead: the last line of its log
  bool hung = false;          // when dead: killed by its daemon after its heartbeat stopped
  std::string key;            // the actor's RPC secret: set only in LeaseHandle::spawn's result
};

// One line for a person about how an actor died: "actor a-1f2e (GPU 1 on node n-3f2a) was
// killed by signal 9 (SIGKILL); its log: PATH", "... exited with code 3 after: <last log
// line>; its log: PATH", "... stopped answering: ...". Without `with_log`, no path: what a
// remote client is told (paths of the server's machine stay in its own log).
std::string describe_death(const ActorView& actor, bool with_log = true);

struct SegmentView {
  std::string name;
  std::string kind;  // "object" or "ring"
  std::string id;
  uint64_t bytes = 0;
  uint32_t refs = 0;
  bool sealed = false;
  std::string owner;
};

struct ObjectStoreView {
  uint64_t capacity = 0;
  uint64_t used = 0;
  uint32_t objects = 0;
  std::vector<SegmentView> segments;
};

// What to start: always the node's own tessera-actor.
struct SpawnOptions {
  std::vector<uint32_t> gpus;
  std::vector<std::pair<std::string, std::string>> env;
  std::string name;
  uint32_t ready_timeout_ms = 0;
};

// A node's answers to `tessera doctor` (proto NodeCheck; driver/doctor.h judges them).
struct NodeCheckView {
  uint64_t wall_clock_ms = 0;
  std::string shm_path;
  uint64_t shm_total = 0, shm_free = 0;
  uint64_t nofile_soft = 0, nofile_hard = 0;
  std::string disk_path;
  uint64_t disk_free = 0;
  std::string disk_error;
  std::vector<std::pair<std::string, std::string>> nccl_env;
  struct Peer {
    std::string address;
    bool reachable = false;
    double connect_ms = 0;
    std::string error;
  };
  std::vector<Peer> peers;
  std::string actor_binary, actor_binary_error;
};

class LeaseHandle;

// A node daemon, reached directly or through the head.
class NodeHandle {
 public:
  NodeHandle(EventLoop& loop, proto::Node::Client node);

  Expected<NodeView> info();
  Expected<std::vector<ActorView>> actors();
  Expected<ObjectStoreView> object_store();
  // The node's doctor readings; it tries a TCP connect to each of `peers` ("host:port") within
  // `connect_timeout_ms`. The call itself gives up after `timeout`.
  Expected<NodeCheckView> check(const std::vector<std::string>& peers, const std::string& disk_path,
                                uint32_t connect_timeout_ms, std::chrono::milliseconds timeout);
  // ttl_ms = 0: the lease lives as long as this process's connection. With a TTL, the handle
  // renews it every ttl/3 while the loop runs.
  Expected<std::unique_ptr<LeaseHandle>> open_lease(const std::string& owner, uint32_t ttl_ms = 0);

  proto::Node::Client& capability() { return node_; }

 private:
  EventLoop& loop_;
  proto::Node::Client node_;
};

// An owner's hold on a node: what it spawns dies with it.
class LeaseHandle {
 public:
  struct State;
  LeaseHandle(EventLoop& loop, proto::Lease::Client lease, uint32_t ttl_ms,
              std::shared_ptr<State> state);
  ~LeaseHandle();

  // The actor, serving, with its key (pass it to ActorHandle::connect).
  Expected<ActorView> spawn(const SpawnOptions& options);
  Status kill(const std::string& actor_id, bool force = false);
  Expected<std::vector<ActorView>> actors();
  Status renew();

  Expected<std::string> create_object(const std::string& id, uint64_t size);
  Status seal_object(const std::string& id);
  Expected<std::pair<std::string, uint64_t>> get_object(const std::string& id,
                                                        uint32_t timeout_ms = 0);
  Status release_object(const std::string& id);
  Status delete_object(const std::string& id);
  Expected<std::string> create_ring(const std::string& name, uint32_t slot_bytes, uint32_t slots,
                                    uint32_t readers);

  // Deaths of this lease's actors reported so far (oldest first).
  const std::vector<ActorView>& deaths() const;
  // Runs the loop until `actor_id` is reported dead or `timeout` passes.
  Expected<ActorView> wait_for_death(const std::string& actor_id,
                                     std::chrono::milliseconds timeout);
  // Stops renewing (a TTL lease then lapses) and lets the lease go when this handle dies.
  void stop_renewing();

 private:
  EventLoop& loop_;
  proto::Lease::Client lease_;
  std::shared_ptr<State> state_;
  kj::Promise<void> renewing_{nullptr};
};

// The cluster, through its head.
class ClusterClient {
 public:
  // Connects and runs the handshake with the cluster token. Fails when nothing answers, the
  // peer is not a head, speaks another protocol version, or refuses the token.
  static Expected<std::unique_ptr<ClusterClient>> connect(
      EventLoop& loop, const std::string& address, const std::string& token,
      std::chrono::milliseconds timeout = std::chrono::seconds(10));

  Expected<std::vector<NodeView>> nodes(bool include_dead = false);
  // A handle to a live node by id (calls go through the head).
  Expected<NodeHandle> node(const std::string& node_id);
  // The head's own node.
  NodeHandle head_node();

  // `tessera drain`: marks the live node whose id or name is `node` draining (`undo`: clears the
  // mark) and returns it as the head now lists it. While it drains, planning skips it and the
  // head refuses to open leases or spawn actors there (FAILED_PRECONDITION); running actors stay.
  // NOT_FOUND naming `node` and listing the live nodes when there is no such node.
  Expected<NodeView> drain(const std::string& node, bool undo = false);

  // Calls `on_added` / `on_dead` as nodes join or die, while the loop runs; the subscription
  // ends when the returned object is destroyed.
  struct Subscription;
  Expected<std::unique_ptr<Subscription>> subscribe(std::function<void(const NodeView&)> on_added,
                                                    std::function<void(const NodeView&)> on_dead);

  const std::string& address() const { return conn_->address; }
  const std::string& head_id() const { return conn_->server_id; }
  // Resolves when the connection to the head drops (the head died, stopped or was cut off).
  kj::Promise<void> on_disconnect() { return conn_->on_disconnect(); }

  ClusterClient(EventLoop& loop, kj::Own<rpc::Connection> conn);
  ~ClusterClient();

 private:
  EventLoop& loop_;
  kj::Own<rpc::Connection> conn_;
};

struct ClusterClient::Subscription {
  proto::Subscription::Client handle{nullptr};
};

struct ActorHealthView {
  std::string actor_id;
  int pid = 0;
  uint64_t uptime_ms = 0;
  std::string backend;
  std::string visible_devices;
  std::vector<GpuDevice> devices;
  std::string nccl_version;
  std::string note;
};

// A direct connection to an actor process, authenticated with the actor's key.
class ActorHandle {
 public:
  static Expected<std::unique_ptr<ActorHandle>> connect(
      EventLoop& loop, const std::string& address, const std::string& key,
      std::chrono::milliseconds timeout = std::chrono::seconds(10));
  Expected<ActorHealthView> health();
  Status shutdown();
  // The actor's capability, for calls this class does not wrap (load, execute).
  proto::Actor::Client& capability() { return conn_->actor; }
  // Resolves when the connection to the actor drops (the process died, or its socket closed).
  kj::Promise<void> on_disconnect() { return conn_->on_disconnect(); }

  ActorHandle(EventLoop& loop, kj::Own<rpc::Connection> conn);
  ~ActorHandle();

 private:
  EventLoop& loop_;
  kj::Own<rpc::Connection> conn_;
};

// Conversions from the wire (also used by the CLI).
NodeView node_view(proto::NodeInfo::Reader info);
ActorView actor_view(proto::ActorInfo::Reader info);

}  // namespace tessera
