// The actor process's RPC face: the Gateway (hello) and proto::Actor.
#pragma once

#include <kj/async.h>

#include <chrono>
#include <string>

#include "actors/cuda_probe.h"
#include "actors/model/model_runner.h"
#include "protocol/gateway.capnp.h"

namespace tessera {

struct ActorIdentity {
  std::string actor_id;
  std::string node_id;
};

class ActorService {
 public:
  ActorService(ActorIdentity identity, CudaProbe probe);

  // The bootstrap capability for this actor's RPC server.
  proto::Gateway::Client gateway();

  // Resolves when a shutdown RPC arrives.
  kj::Promise<void> on_shutdown();
  void request_shutdown();

  void fill_health(proto::ActorHealth::Builder out) const;
  const ActorIdentity& identity() const { return identity_; }

  // The model this actor runs (null until loadModel succeeds).
  ModelRunner* runner() { return runner_.get(); }
  void set_runner(std::unique_ptr<ModelRunner> runner) { runner_ = std::move(runner); }

 private:
  ActorIdentity identity_;
  CudaProbe probe_;
  std::unique_ptr<ModelRunner> runner_;
  std::chrono::steady_clock::time_point started_ = std::chrono::steady_clock::now();
  kj::ForkedPromise<void> shutdown_;
  kj::Own<kj::PromiseFulfiller<void>> shutdown_fulfiller_;
};

}  // namespace tessera
