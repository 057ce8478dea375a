// The server's Prometheus metrics: vLLM's names (so dashboards built for vLLM work), the engine's
// gauges and counters (EngineStats) and the latency histograms the HTTP side observes.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "driver/engine/engine.h"

namespace tessera::server {

struct ReplicaView;  // replica_set.h

struct Histogram {
  std::vector<double> bounds;    // upper bounds, ascending
  std::vector<uint64_t> counts;  // per bucket (not cumulative); the last is +Inf
  double sum = 0;
  uint64_t count = 0;
  explicit Histogram(std::vector<double> b);
  void observe(double v);
};

// vLLM's buckets; the server touches it on its I/O thread only.
struct Metrics {
  Histogram ttft{{0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1,  0.25,  0.5,   0.75,
                  1.0,   2.5,   5.0,  7.5,  10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0}};
  Histogram itl{{0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                 10.0, 20.0, 40.0, 80.0}};
  Histogram e2e{{0.3,  0.5,  0.8,  1.0,  1.5,   2.0,   2.5,   5.0,   10.0,   15.0,  20.0,
                 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0}};
  std::map<std::string, uint64_t> finished;  // by finished_reason
  std::map<int, uint64_t> http_responses;    // by status
};

// The Prometheus text exposition (version 0.0.4) of `m` and `s`, labelled with `model`.
std::string prometheus(const Metrics& m, const EngineStats& s, const std::string& model);

// With -dp (`data_parallel`): each replica's state, routed requests, load, prefix matches
// and engine gauges, labelled replica="i" (tessera: names; vLLM has no per-replica metrics);
// tessera:replica_info{replica,state,nodes} 1 says where it runs and whether it serves, drains
// or was removed. `routing`: the router's decision times, in seconds. "" without -dp.
std::string replica_prometheus(bool data_parallel, const std::vector<ReplicaView>& replicas,
                               const Histogram& routing, const std::string& model);

// One server-sent event carrying `data` ("data: ...\n\n").
std::string sse_event(const std::string& data);

}  // namespace tessera::server
