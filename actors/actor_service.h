// The actor process's RPC face: the Gateway (hello) and proto::Actor.
#pragma once

#include <kj/async.h>

#include <atomic>
#include <chrono>
#include <string>

#include "actors/cuda_probe.h"
#include "actors/model/model_runner.h"
#include "protocol/rpc.h"

namespace tessera {

struct ActorIdentity {
  std::string actor_id;
  std::string node_id;
};

class ActorService {
 public:
  ActorService(ActorIdentity identity, CudaProbe probe);

  // What this actor's RPC server is: an ACTOR endpoint guarded by `key` (the secret its daemon
  // gave it), granting the Actor capability to a peer that proves the key.
  rpc::Endpoint endpoint(const std::string& key);

  // Resolves when a shutdown RPC arrives.
  kj::Promise<void> on_shutdown();
  void request_shutdown();

  void fill_health(proto::ActorHealth::Builder out) const;
  const ActorIdentity& identity() const { return identity_; }

  // How long the step now running has run, 0 when none runs. Thread-safe (the heartbeat
  // thread reads it).
  std::chrono::milliseconds busy_for() const;
  void step_started();
  void step_finished();

  // The model this actor runs (null until loadModel succeeds).
  ModelRunner* runner() { return runner_.get(); }
  void set_runner(std::unique_ptr<ModelRunner> runner) { runner_ = std::move(runner); }

 private:
  ActorIdentity identity_;
  CudaProbe probe_;
  std::unique_ptr<ModelRunner> runner_;
  std::chrono::steady_clock::time_point started_ = std::chrono::steady_clock::now();
  std::atomic<int64_t> step_started_ns_{0};  // steady clock; 0 = no step runs
  kj::ForkedPromise<void> shutdown_;
  kj::Own<kj::PromiseFulfiller<void>> shutdown_fulfiller_;
};

}  // namespace tessera
