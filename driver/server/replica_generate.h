// Offline generation over replicas: `tessera generate -dp N` and `tessera bench throughput -dp N`,
// as vLLM's LLM(data_parallel_size=N).generate. Every request is added to the ReplicaSet at once
// (its router spreads them over the replicas); their outputs, which come on the replicas' engine
// threads, are handed to the calling thread, and the call returns when every request has ended.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

#include "driver/llm.h"
#include "driver/server/replica_set.h"

namespace tessera::server {

// What one replica ran during one call.
struct ReplicaRun {
  uint64_t requests = 0;       // routed to it (one moved off an unhealthy replica counts twice)
  uint64_t prompt_tokens = 0;  // of its requests that produced a first token there
  uint64_t output_tokens = 0;  // the tokens it generated
};

struct ReplicaGeneration {
  std::vector<GenerationResult> results;  // one per request, in the requests' order
  std::vector<ReplicaRun> replicas;       // one per replica, in the set's order
};

// Runs `requests` (made against replicas.loaded(): request.h) over `replicas` and returns their
// results in order, and what each replica ran. `on_output` (optional) sees every output on the
// calling thread, with its request's index, as LLM::generate's does. A request refused (no
// healthy replica) or failed ends the call with its status, naming the request, after the other
// requests were aborted and ended: nothing of the call stays queued.
Expected<ReplicaGeneration> generate_on_replicas(
    ReplicaSet& replicas, std::vector<Request> requests,
    const std::function<void(size_t, const RequestOutput&)>& on_output = nullptr);

}  // namespace tessera::server
