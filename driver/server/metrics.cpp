#include "driver/server/metrics.h"

#include "driver/server/replica_set.h"

#include <sstream>

namespace tessera::server {

Histogram::Histogram(std::vector<double> b) : bounds(std::move(b)), counts(bounds.size() + 1) {}

void Histogram::observe(double v) {
  size_t i = 0;
  while (i < bounds.size() && v > bounds[i]) ++i;
  counts[i]++;
  sum += v;
  count++;
}

namespace {

// One histogram in the exposition format, labelled with the model.
void write_histogram(std::ostream& o, const char* name, const char* help, const Histogram& h,
                     const std::string& model) {
  const std::string label = "{model_name=\"" + model + "\"}";
  o << "# HELP " << name << ' ' << help << "\n# TYPE " << name << " histogram\n";
  uint64_t cumulative = 0;
  for (size_t i = 0; i < h.bounds.size(); ++i) {
    cumulative += h.counts[i];
    o << name << "_bucket{le=\"" << h.bounds[i] << "\",model_name=\"" << model << "\"} "
      << cumulative << '\n';
  }
  cumulative += h.counts.back();
  o << name << "_bucket{le=\"+Inf\",model_name=\"" << model << "\"} " << cumulative << '\n';
  o << name << "_sum" << label << ' ' << h.sum << '\n';
  o << name << "_count" << label << ' ' << h.count << '\n';
}

}  // namespace

std::string sse_event(const std::string& data) { return "data: " + data + "\n\n"; }

std::string prometheus(const Metrics& m, const EngineStats& s, const std::string& model) {
  std::ostringstream o;
  const std::string label = "{model_name=\"" + model + "\"}";
  auto gauge = [&](const char* name, const char* help, double v) {
    o << "# HELP " << name << ' ' << help << "\n# TYPE " << name << " gauge\n"
      << name << label << ' ' << v << '\n';
  };
  auto counter = [&](const char* name, const char* help, double v) {
    o << "# HELP " << name << ' ' << help << "\n# TYPE " << name << " counter\n"
      << name << label << ' ' << v << '\n';
  };
  auto histogram = [&](const char* name, const char* help, const Histogram& h) {
    write_histogram(o, name, help, h, model);
  };
  gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
        static_cast<double>(s.running));
  gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
        static_cast<double>(s.waiting));
  gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", s.kv_cache_usage);
  counter("vllm:prefix_cache_queries_total", "Prefix cache queries, in terms of tokens.",
          static_cast<double>(s.prefix_cache_queries));
  counter("vllm:prefix_cache_hits_total", "Prefix cache hits, in terms of tokens.",
          static_cast<double>(s.prefix_cache_hits));
  counter("vllm:prompt_tokens_total", "Number of prefill tokens processed.",
          static_cast<double>(s.prompt_tokens));
  counter("vllm:generation_tokens_total", "Number of generation tokens processed.",
          static_cast<double>(s.generation_tokens));
  counter("vllm:num_preemptions_total", "Cumulative number of preemptions from the engine.",
          static_cast<double>(s.preemptions));
  counter("tessera:engine_restarts_total",
          "Worker-group restarts that brought the model back after an actor or node died.",
          static_cast<double>(s.restarts));
  counter("tessera:engine_restart_failures_total", "Worker-group restarts that failed.",
          static_cast<double>(s.restart_failures));
  counter("tessera:requests_failed_by_restarts_total",
          "Requests failed, not rerun, because the group died each time they ran.",
          static_cast<double>(s.requests_failed_by_restarts));
  o << "# HELP vllm:request_success_total Count of successfully processed requests.\n"
    << "# TYPE vllm:request_success_total counter\n";
  for (const auto& [reason, n] : m.finished) {
    o << "vllm:request_success_total{finished_reason=\"" << reason << "\",model_name=\"" << model
      << "\"} " << n << '\n';
  }
  histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
            m.ttft);
  histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
            m.itl);
  histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
            m.e2e);
  o << "# HELP tessera:http_responses_total HTTP responses by status.\n"
    << "# TYPE tessera:http_responses_total counter\n";
  for (const auto& [status, n] : m.http_responses) {
    o << "tessera:http_responses_total{status=\"" << status << "\"} " << n << '\n';
  }
  return o.str();
}

}  // namespace tessera::server

namespace tessera::server {

std::string replica_prometheus(bool data_parallel, const std::vector<ReplicaView>& replicas,
                               const Histogram& routing, const std::string& model) {
  if (!data_parallel) return "";
  std::ostringstream o;
  o << "# HELP tessera:replica_info The replica's state (serving, draining, removed) and the "
       "nodes it runs on\n# TYPE tessera:replica_info gauge\n";
  for (size_t i = 0; i < replicas.size(); ++i) {
    std::string nodes;
    for (const std::string& n : replicas[i].nodes) nodes += (nodes.empty() ? "" : ",") + n;
    o << "tessera:replica_info{model_name=\"" << model << "\",replica=\"" << i << "\",state=\""
      << replica_state_name(replicas[i].state) << "\",nodes=\"" << nodes << "\"} 1\n";
  }
  write_histogram(o, "tessera:router_decision_seconds", "Time the router takes to pick a replica",
                  routing, model);
  struct Series {
    const char* name;
    const char* type;
    const char* help;
    double (*value)(const ReplicaView&);
  };
  static const Series kSeries[] = {
      {"tessera:replica_healthy", "gauge", "1 while the replica takes requests",
       [](const ReplicaView& r) { return r.healthy ? 1.0 : 0.0; }},
      {"tessera:replica_requests_routed", "counter", "Requests the router sent to the replica",
       [](const ReplicaView& r) { return static_cast<double>(r.routed); }},
      {"tessera:replica_requests_outstanding", "gauge", "Routed to it and not finished",
       [](const ReplicaView& r) { return static_cast<double>(r.outstanding); }},
      {"tessera:replica_prefix_matched_tokens", "counter",
       "Prompt tokens the router found in the replica's mirrored prefix cache",
       [](const ReplicaView& r) { return static_cast<double>(r.prefix_matched_tokens); }},
      {"tessera:replica_num_requests_running", "gauge", "Requests running in the replica",
       [](const ReplicaView& r) { return static_cast<double>(r.stats.running); }},
      {"tessera:replica_num_requests_waiting", "gauge", "Requests waiting in the replica",
       [](const ReplicaView& r) { return static_cast<double>(r.stats.waiting); }},
      {"tessera:replica_kv_cache_usage_perc", "gauge", "The replica's KV cache usage (0-1)",
       [](const ReplicaView& r) { return r.stats.kv_cache_usage; }},
      {"tessera:replica_prefix_cache_hits", "counter", "Prompt tokens found in its prefix cache",
       [](const ReplicaView& r) { return static_cast<double>(r.stats.prefix_cache_hits); }},
      {"tessera:replica_prefix_cache_queries", "counter", "Prompt tokens looked up in it",
       [](const ReplicaView& r) { return static_cast<double>(r.stats.prefix_cache_queries); }},
  };
  for (const Series& s : kSeries) {
    o << "# HELP " << s.name << ' ' << s.help << "\n# TYPE " << s.name << ' ' << s.type << '\n';
    for (size_t i = 0; i < replicas.size(); ++i) {
      o << s.name << "{model_name=\"" << model << "\",replica=\"" << i << "\"} "
        << s.value(replicas[i]) << '\n';
    }
  }
  return o.str();
}

}  // namespace tessera::server
