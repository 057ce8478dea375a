// The engines behind one endpoint: `tessera serve -dp N|auto` runs N replicas of the model's
// T x P plan, each an AsyncEngine (its own worker group, scheduler and KV cache), and a Router
// picks the replica of each request (router.h). One replica is the plain server.
//
// Placement: the replicas are started one after another on one cluster (the --address one, else
// a local node started here for all of them), so each plan sees the GPUs the ones before hold
// (busy, or shared when their free memory holds another --gpu-memory-utilization) and CPU
// replicas go to the nodes with the fewest actors: replicas spread over GPUs and nodes.
//
// Membership: with a cluster, the set follows it while serving. A replica whose node drains
// (`tessera drain NODE`) takes no new requests, finishes those it holds, and is then removed
// (its actors stop). While fewer replicas serve than -dp asks (a drained one gone; auto: one
// more fits on a node that joined), one more is placed and loaded in the background, and the
// router sends it requests once it is ready.
//
// Each replica recovers from its own actors' deaths (async_engine.h); while one is unhealthy
// the router skips it, and the service is healthy while any replica is. The requests a replica
// holds that have not produced anything yet do not wait for it: when it turns unhealthy (a
// monitor looks every kMonitorPeriod) they are aborted there and routed to a healthy replica,
// and one that fails there unstarted because the replica gave up is routed again too. A request
// that has streamed tokens fails with the cause (its KV cache is gone). No request is lost or
// duplicated: outputs of an attempt that was moved are dropped.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include <CLI/CLI.hpp>

#include "driver/local_node.h"
#include "driver/plan/placement.h"
#include "driver/server/async_engine.h"
#include "driver/server/metrics.h"
#include "driver/server/router.h"

namespace tessera::server {

// -dp and --router, as `serve`, `generate` and `bench throughput` take them.
struct ReplicaOptions {
  ParallelSize data_parallel_size;  // replicas, or auto: as many as fit, and more as nodes join
  RouterPolicy router = RouterPolicy::kPrefix;
};
// Binds -dp/--data-parallel-size and --router to `options`.
void add_replica_options(CLI::App* cmd, ReplicaOptions& options);

// Where a replica is in its life.
enum class ReplicaState : uint8_t {
  kServing,   // the router sends it requests (while healthy)
  kDraining,  // its node is draining (`tessera drain`): no new requests; removed when idle
  kRemoved,   // taken out of service: its actors stopped
};
const char* replica_state_name(ReplicaState state);  // "serving", "draining", "removed"

// One replica as /metrics shows it.
struct ReplicaView {
  ReplicaState state = ReplicaState::kServing;
  std::string note;                // why it is draining or was removed
  std::vector<std::string> nodes;  // the node ids its ranks run on
  bool healthy = false;
  std::string unhealthy_reason;
  uint64_t routed = 0;                 // requests routed to it since start
  uint64_t outstanding = 0;            // of which not finished
  uint64_t prefix_matched_tokens = 0;  // prompt tokens the router found in its mirror
  EngineStats stats;
};

class ReplicaSet {
 public:
  // Starts the replicas (one after another; the first failure stops and is returned, naming
  // the replica; -dp auto: as many as fit, at least one). With a cluster (--address, or -dp
  // other than 1) the set then follows the cluster's membership (membership()).
  static Expected<std::unique_ptr<ReplicaSet>> start(const EngineArgs& args,
                                                     const ReplicaOptions& options,
                                                     const std::string& owner);
  // Over engines started already (tests: AsyncEngines over fake hosts); not empty. No
  // membership: tests call attach() and drain() themselves.
  static std::unique_ptr<ReplicaSet> over(std::vector<std::unique_ptr<AsyncEngine>> engines,
                                          RouterPolicy policy);
  static constexpr std::chrono::milliseconds kMonitorPeriod{100};
  static constexpr std::chrono::milliseconds kMembershipPeriod{1000};
  // Stops every replica (their unfinished requests end with kAbort), then the local node.
  ~ReplicaSet();

  // Routes the request and queues it there; its outputs go to `sink`, with request_id the id
  // returned here. UNAVAILABLE naming the replicas when none is healthy.
  Expected<uint64_t> add(Request request, AsyncEngine::Sink sink);
  // Ends a request (its client went away); unknown or finished ids are ignored.
  void abort(uint64_t id);

  // A replica that is ready joins: the router sends it requests from now on. Its index.
  size_t attach(std::unique_ptr<AsyncEngine> engine);
  // Stops routing to a serving replica (`why`: "node b is draining") while another serves (with
  // none, it keeps taking requests); the monitor removes it (its actors stop) once its
  // requests have finished. False when it is not serving.
  bool drain(size_t replica, const std::string& why);

  bool healthy() const;
  // Each replica that does not serve and why ("replica 1: <its engine's reason>; replica 2:
  // draining (node b is draining); replica 3: removed (...)").
  std::string unhealthy_reason() const;
  // The replicas' stats summed (counters and gauges; kv_cache_usage over all their blocks).
  EngineStats stats() const;
  std::vector<ReplicaView> replicas() const;
  // How long routing decisions took (seconds), for /metrics.
  Histogram routing_times() const;
  // Replicas ever attached, removed ones included (indices are never reused).
  size_t size() const;
  // Serving or draining replicas.
  size_t active() const;
  // More than one replica may run (-dp other than 1): /metrics shows them one by one.
  bool data_parallel() const { return data_parallel_; }
  RouterPolicy policy() const { return router_.policy(); }

  // Replica 0's session and model (they are the same model, tokenizer and plan shape; a
  // removed replica keeps its session until the set is destroyed).
  const ModelSession& session() const { return first_->session(); }
  const ModelInfo& loaded() const { return first_->loaded(); }
  double load_seconds() const { return load_seconds_; }

 private:
  ReplicaSet(RouterPolicy policy, const ModelInfo& model);

  struct Replica {
    std::unique_ptr<AsyncEngine> engine;  // kept until the set is destroyed (removed: retired)
    ReplicaState state = ReplicaState::kServing;
    std::string note;
    uint64_t routed = 0, matched_tokens = 0;
  };
  struct Routed {
    size_t replica = 0;
    uint64_t engine_id = 0;
    uint64_t prompt_tokens = 0;
    bool started = false;            // it produced output: it stays where it is
    uint32_t attempt = 0;            // outputs of an earlier attempt (moved away) are dropped
    std::optional<Request> request;  // kept until it starts, to route it again
    // The caller's; shared so that an output (one per token) hands it out without a copy.
    std::shared_ptr<const AsyncEngine::Sink> sink;
    std::vector<bool> tried;  // replicas it failed on or was moved from
  };
  // The replica's engine; under mu_ (engines live as long as the set, so the pointer may be
  // used after the lock is released).
  AsyncEngine* engine(size_t replica) const { return replicas_[replica].engine.get(); }
  // Routes request `id` (its `request`) to a routable replica it has not tried and queues it
  // there; `lock` holds mu_ and is released around the replica's add().
  Status dispatch(std::unique_lock<std::mutex>& lock, uint64_t id);
  // An output of attempt `attempt` of request `id`, on the replica's engine thread.
  void on_output(uint64_t id, uint32_t attempt, RequestOutput out);
  // Takes a request off its replica's load.
  void unbook(Routed& r);
  // The monitor: moves the unstarted requests of replicas that turned unhealthy, removes the
  // drained replicas that are idle.
  void monitor();
  void move_unstarted(size_t replica);
  void remove_idle_drained();

  // Membership (with a cluster): every kMembershipPeriod, the cluster's nodes: replicas on a
  // draining node drain; while fewer replicas serve than -dp asks (auto: while one more fits,
  // on nodes no replica uses), one more is placed, loaded in the background and attached when
  // ready. Runs on its own thread, with its own event loop.
  void membership();
  // Whether one more replica fits on `nodes` now; else why not.
  Status room_for_replica(const std::vector<ClusterNode>& nodes) const;

  std::unique_ptr<LocalNode> local_;  // the node all replicas share, when there is no --address
  EngineArgs args_;                   // what each replica starts with (address and token set)
  ReplicaOptions options_;
  std::string owner_;
  bool data_parallel_ = false;
  AsyncEngine* first_ = nullptr;  // replica 0's engine
  double load_seconds_ = 0;

  mutable std::mutex mu_;  // the replicas, the router, the loads and the routed requests
  std::vector<Replica> replicas_;
  Router router_;
  std::vector<ReplicaLoad> load_;
  std::unordered_map<uint64_t, Routed> routed_;  // by our id
  Histogram routing_{{1e-6, 2e-6, 5e-6, 1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 1e-2}};
  uint64_t next_id_ = 1;
  std::condition_variable stop_cv_;
  bool stopping_ = false;
  std::thread monitor_;     // with more than one replica, or membership
  std::thread membership_;  // with a cluster
  std::thread loading_;     // a replica loading in the background (membership's)
  bool loading_busy_ = false;
  std::chrono::steady_clock::time_point grow_after_;  // no background load before
};

}  // namespace tessera::server
