// The engines behind one endpoint: `tessera serve -dp N` runs N replicas of the model's T x P
// plan, each an AsyncEngine (its own worker group, scheduler and KV cache), and a Router picks
// the replica of each request (router.h). One replica is the plain server.
//
// Placement: the replicas are started one after another on one cluster (the --address one, else
// a local node started here for all of them), so each plan sees the GPUs the ones before hold
// as busy and CPU replicas go to the nodes with the fewest actors: replicas spread over GPUs
// and nodes. Loading is therefore sequential for now.
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

#include "driver/local_node.h"
#include "driver/server/async_engine.h"
#include "driver/server/metrics.h"
#include "driver/server/router.h"

namespace tessera::server {

// -dp and --router, as `serve` takes them.
struct ReplicaOptions {
  int64_t data_parallel_size = 1;  // replicas, >= 1
  RouterPolicy router = RouterPolicy::kPrefix;
};

// One replica as /metrics shows it.
struct ReplicaView {
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
  // the replica). INVALID_ARGUMENT for a data_parallel_size < 1.
  static Expected<std::unique_ptr<ReplicaSet>> start(const EngineArgs& args,
                                                     const ReplicaOptions& options,
                                                     const std::string& owner);
  // Over engines started already (tests: AsyncEngines over fake hosts); not empty.
  static std::unique_ptr<ReplicaSet> over(std::vector<std::unique_ptr<AsyncEngine>> engines,
                                          RouterPolicy policy);
  static constexpr std::chrono::milliseconds kMonitorPeriod{100};
  // Stops every replica (their unfinished requests end with kAbort), then the local node.
  ~ReplicaSet();

  // Routes the request and queues it there; its outputs go to `sink`. UNAVAILABLE naming the
  // replicas when none is healthy.
  Expected<uint64_t> add(Request request, AsyncEngine::Sink sink);
  // Ends a request (its client went away); unknown or finished ids are ignored.
  void abort(uint64_t id);

  bool healthy() const;
  // Each unhealthy replica and why ("replica 1: ...; replica 2: ...").
  std::string unhealthy_reason() const;
  // The replicas' stats summed (counters and gauges; kv_cache_usage over all their blocks).
  EngineStats stats() const;
  std::vector<ReplicaView> replicas() const;
  // How long routing decisions took (seconds), for /metrics.
  Histogram routing_times() const;
  size_t size() const { return engines_.size(); }
  RouterPolicy policy() const { return router_.policy(); }

  // Replica 0's session and model (they are the same model, tokenizer and plan shape).
  const ModelSession& session() const { return engines_.front()->session(); }
  const ModelInfo& loaded() const { return engines_.front()->loaded(); }
  double load_seconds() const { return load_seconds_; }

 private:
  ReplicaSet(RouterPolicy policy, size_t replicas, const ModelInfo& model);

  struct Routed {
    size_t replica = 0;
    uint64_t engine_id = 0;
    uint64_t prompt_tokens = 0;
    bool started = false;            // it produced output: it stays where it is
    uint32_t attempt = 0;            // outputs of an earlier attempt (moved away) are dropped
    std::optional<Request> request;  // kept until it starts, to route it again
    // The caller's; shared so that an output (one per token) hands it out without a copy.
    std::shared_ptr<const AsyncEngine::Sink> sink;
    std::vector<bool> tried;         // replicas it failed on or was moved from
  };
  // Routes request `id` (its `request`) to a routable replica it has not tried and queues it
  // there; `lock` holds mu_ and is released around the replica's add().
  Status dispatch(std::unique_lock<std::mutex>& lock, uint64_t id);
  // An output of attempt `attempt` of request `id`, on the replica's engine thread.
  void on_output(uint64_t id, uint32_t attempt, RequestOutput out);
  // Takes a request off its replica's load.
  void unbook(Routed& r);
  // The monitor: moves the unstarted requests of replicas that turned unhealthy.
  void monitor();
  void move_unstarted(size_t replica);

  std::unique_ptr<LocalNode> local_;  // the node all replicas share, when there is no --address
  std::vector<std::unique_ptr<AsyncEngine>> engines_;
  double load_seconds_ = 0;

  mutable std::mutex mu_;  // the router, the loads and the routed requests
  Router router_;
  std::vector<ReplicaLoad> load_;
  std::vector<uint64_t> routed_count_, matched_tokens_;
  std::unordered_map<uint64_t, Routed> routed_;  // by our id
  Histogram routing_{{1e-6, 2e-6, 5e-6, 1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 1e-2}};
  uint64_t next_id_ = 1;
  std::condition_variable stop_cv_;
  bool stopping_ = false;
  std::thread monitor_;  // with more than one replica
};

}  // namespace tessera::server
