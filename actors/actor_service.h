// The actor process's RPC face (proto::Actor) and its model: the collective groups it joins
// (actors/comm/rank_comms.h), the model shard it loads (actors/model/model_runner.h), and where
// its steps come from — RPC execute calls, or (local actors) the driver's shared-memory step
// ring, read by a step thread that writes each result to this actor's output ring.
#pragma once

#include <kj/async.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <thread>

#include "actors/comm/comm_check.h"
#include "actors/comm/rank_comms.h"
#include "actors/cuda_probe.h"
#include "actors/model/model_runner.h"
#include "common/load_spec.h"
#include "protocol/rpc.h"

namespace tessera {

struct ActorIdentity {
  std::string actor_id;
  std::string node_id;
  std::string host;  // the address this actor listens on (its collective endpoint too)
};

class ActorService {
 public:
  ActorService(ActorIdentity identity, CudaProbe probe);
  ~ActorService();

  // What this actor's RPC server is: an ACTOR endpoint guarded by `key` (the secret its daemon
  // gave it), granting the Actor capability to a peer that proves the key.
  rpc::Endpoint endpoint(const std::string& key);

  // Resolves when a shutdown RPC arrives.
  kj::Promise<void> on_shutdown();
  void request_shutdown();

  void fill_health(proto::ActorHealth::Builder out) const;
  const ActorIdentity& identity() const { return identity_; }

  // The RPC methods' work (each returns a Status the RPC layer turns into an error).
  // The tcp endpoint's address, the NCCL id, the IPC buffers' handle (each when there is one).
  struct PreparedComm {
    std::string address, nccl_id, ipc_handle;
  };
  Expected<PreparedComm> prepare_comm(const std::string& backend, uint64_t buffer_bytes,
                                      int tp_rank, int tp_size);
  // Loads on a thread of its own (joining the collective groups, then the weights): this
  // actor's loop keeps answering health and loadProgress calls meanwhile. Resolves on the loop.
  kj::Promise<Expected<ModelInfo>> load_model(LoadSpec spec);
  // `tessera doctor`: joins the groups `spec` names (as load_model would, bounded by its init
  // timeout) and all-reduces `bytes` `iterations` times through each group of several ranks
  // (tensor-parallel, then pipeline), checking every sum. Uses the actor's collectives up: a
  // model cannot be loaded after it.
  struct GroupCheck {
    std::string group;  // "tensor-parallel" or "pipeline"
    int ranks = 0;
    comm::CommCheckResult result;
  };
  kj::Promise<Expected<std::vector<GroupCheck>>> comm_check(LoadSpec spec, uint64_t bytes,
                                                            int iterations);
  // Weight bytes in place and in all while a load runs (and after it).
  std::pair<uint64_t, uint64_t> load_progress() const;
  Expected<ModelInfo> init_cache(int64_t blocks);
  Expected<StepOutput> execute(const StepInput& step);

  // How long the step now running has run, 0 when none runs. Thread-safe (the heartbeat
  // thread reads it).
  std::chrono::milliseconds busy_for() const;
  // The loaded model's progress count (ModelRunner::progress; 0 before a model is loaded): it
  // moves while a step's forward pass makes progress. Thread-safe (the heartbeat thread's
  // StepWatchdog samples it).
  uint64_t step_progress() const;
  // The loaded model's expert routings (ModelRunner::expert_load; empty before a model loads
  // and for a dense one). Thread-safe.
  ExpertLoad expert_load() const;
  // Steps finished (handed back, or failed) since the start. Thread-safe.
  uint64_t steps_done() const { return steps_done_.load(std::memory_order_relaxed); }

  // Stops the step thread (if any) and waits for it.
  void stop_steps();

 private:
  void step_started();
  void step_finished();
  void step_loop();

  ActorIdentity identity_;
  CudaProbe probe_;
  std::unique_ptr<comm::RankComms> comms_;
  std::unique_ptr<ModelRunner> runner_;
  // runner_ once loaded, published for step_progress() on other threads (runner_ itself is
  // the loop's); cleared before runner_ goes.
  std::atomic<const ModelRunner*> loaded_{nullptr};
  LoadSpec spec_;
  std::chrono::steady_clock::time_point started_ = std::chrono::steady_clock::now();
  std::atomic<int64_t> step_started_ns_{0};  // steady clock; 0 = no step runs
  std::atomic<uint64_t> steps_done_{0};
  std::atomic<bool> stopping_{false};
  std::thread step_thread_;
  std::thread load_thread_;  // runs while a loadModel call is in flight
  // The end of the last load (join, keep the runner), held here rather than by the call: a
  // caller that goes away mid-load (the driver died, the call was cancelled) must not leave
  // load_thread_ unjoined and the actor refusing every later load as "still loading".
  kj::Maybe<kj::ForkedPromise<Expected<ModelInfo>>> load_done_;
  // The same for a collective check, which also runs on load_thread_.
  kj::Maybe<kj::ForkedPromise<Expected<std::vector<GroupCheck>>>> check_done_;
  bool comms_used_ = false;  // a collective check joined comms_: no model may load
  kj::ForkedPromise<void> shutdown_;
  kj::Own<kj::PromiseFulfiller<void>> shutdown_fulfiller_;
};

}  // namespace tessera
