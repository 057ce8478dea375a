// `tessera bench serve`: vLLM's benchmark_serving, against a running OpenAI-compatible server
// (ours or any other). --num-prompts streamed /v1/completions requests from a dataset
// (--dataset-name: random prompt ids, vLLM's prefix_repetition, or the prompts of
// --dataset-path), sent at a Poisson --request-rate (inf: all at once) and at most
// --max-concurrency at a time. Measures per request the time to first token, the time per output
// token after it, the gaps between streamed tokens and the end-to-end latency, and reports
// their mean and p50/p90/p99, request and token throughput, and goodput under the --goodput
// SLOs (ttft:MS tpot:MS e2el:MS): the requests/s that met all of them, as vLLM counts it.
// Around the run it reads the server's /metrics: the prefix cache's hit rate over the run and,
// behind a -dp router, the requests each replica got (counters of the whole server: other
// clients' requests during the run count too). --output-json writes every figure with the
// workload ("dataset", "dataset_params", "request_rate", "seed"), the machine, the commit
// ($TESSERA_COMMIT, else the checkout's HEAD) and the command; the server's figures
// ("prefix_cache_hit_rate", "replica_requests_routed", "replica_max_share", ...) are null when
// its /metrics have none ("server_metrics_error" says why), "server_metrics" names whose they
// are ("tessera", or "vllm" for another server with vLLM's counters).
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "common/status.h"
#include "driver/bench.h"

namespace tessera::server {

// Where the requests come from (--dataset-name).
enum class BenchServeDataset {
  kRandom,            // --input-len random ids each (the default without --dataset-path)
  kPrefixRepetition,  // vLLM's: shared random prefixes, each request's own random suffix
  kCustom,            // the JSONL of --dataset-path (the default with it)
};
// "random", "prefix_repetition", "custom".
const char* bench_serve_dataset_name(BenchServeDataset d);

// vLLM's --prefix-repetition-* flags, with its defaults.
struct PrefixRepetitionOptions {
  uint32_t prefix_len = 256;  // tokens of each shared prefix
  uint32_t suffix_len = 256;  // tokens after it, each request's own
  uint32_t num_prefixes = 10;
  uint32_t output_len = 128;  // tokens each request asks
};

struct BenchServeOptions {
  std::string base_url = "http://127.0.0.1:8000";
  std::string endpoint = "/v1/completions";
  std::string model;    // empty: the first model /v1/models lists
  std::string api_key;  // empty: $TESSERA_API_KEY, then $OPENAI_API_KEY, then none
  uint32_t num_prompts = 1000;
  std::optional<BenchServeDataset> dataset;  // unset: custom with --dataset-path, else random
  uint32_t input_len = 1024;                 // random
  uint32_t output_len = 128;                 // random, and custom lines without "output_len"
  std::string dataset_path;                  // custom
  PrefixRepetitionOptions prefix_repetition;
  double request_rate = 0;       // requests/s, Poisson arrivals; 0 = all at once (vLLM's inf)
  uint32_t max_concurrency = 0;  // 0 = no limit
  bool ignore_eos = false;
  std::optional<double> temperature;  // unset: the server's default
  uint64_t seed = 0;
  std::vector<std::string> goodput;  // "ttft:500" "tpot:50" "e2el:2000" (milliseconds)
  std::string output_json;
  bool json = false;  // --json: the results as JSON on stdout, the text on stderr
  std::string command_line;
};

CLI::App* add_bench_serve_subcommand(CLI::App& bench, BenchServeOptions& options);
int bench_serve_command(const BenchServeOptions& options);

// The dataset the options name (an unset --dataset-name resolved), after checking its flags:
// an error names the flag (--dataset-path without custom, custom without it, zero lengths,
// fewer prompts than prefixes).
Expected<BenchServeDataset> bench_serve_dataset(const BenchServeOptions& options);

// The requests of a run, in the order they are sent: bench_serve_dataset's, made from
// --seed. Errors name the flag (or the dataset file and line).
Expected<std::vector<BenchPrompt>> bench_serve_prompts(const BenchServeOptions& options);

// vLLM's prefix_repetition dataset: `num_prompts` requests of p.prefix_len + p.suffix_len
// random ids (random_bench_prompts' ids), each asking p.output_len tokens. Prefix k is shared
// by num_prompts / num_prefixes of them (the first num_prompts % num_prefixes prefixes by one
// more: vLLM drops those requests, we send exactly num_prompts), each with a suffix of its own;
// the order shuffled so that the repeats of a prefix arrive spread over the run. The same
// `seed`, the same prompts in the same order. Errors name the --prefix-repetition-* flag.
Expected<std::vector<BenchPrompt>> prefix_repetition_prompts(uint32_t num_prompts,
                                                             const PrefixRepetitionOptions& p,
                                                             uint64_t seed);

// What bench serve reads of a server's /metrics (Prometheus text): counters summed over their
// label sets, per replica where labelled replica="i". Cumulative since the server started.
struct ServerCounters {
  bool tessera = false;               // tessera:* series present: our server
  double prefix_cache_queries = 0;    // vllm:prefix_cache_queries_total, in prompt tokens
  double prefix_cache_hits = 0;       // vllm:prefix_cache_hits_total, of which found cached
  std::map<uint32_t, double> routed;  // tessera:replica_requests_routed, by replica (-dp)
  std::map<uint32_t, double> replica_queries, replica_hits;  // tessera:replica_prefix_cache_*
  double router_decisions = 0;         // tessera:router_decision_seconds_count
  double router_decision_seconds = 0;  // its _sum
};
// The counters of a /metrics text; an error when it has no vllm:prefix_cache_queries_total and
// vllm:prefix_cache_hits_total (not our server's, nor vLLM's).
Expected<ServerCounters> parse_server_metrics(const std::string& text);

// The server's side of a run: the change of its counters from `before` to `after`. Optional
// figures are unset where the server has nothing to say (no queries; no replicas).
struct ServerCacheFigures {
  double prefix_cache_queries = 0, prefix_cache_hits = 0;  // prompt tokens
  std::optional<double> prefix_cache_hit_rate;             // hits / queries; unset: no queries
  std::vector<double> replica_requests_routed;             // by replica index; empty without -dp
  std::optional<double> replica_max_share;                 // the most one replica got / all routed
  std::vector<std::optional<double>> replica_prefix_cache_hit_rate;  // by replica index
  std::optional<double> router_decision_mean_ms;                     // over the run's decisions
};
// An error when a counter went back (the server restarted in between).
Expected<ServerCacheFigures> server_cache_figures(const ServerCounters& before,
                                                  const ServerCounters& after);

}  // namespace tessera::server
