// `tessera bench serve`: vLLM's benchmark_serving, against a running OpenAI-compatible server
// (ours or any other). --num-prompts streamed /v1/completions requests of --input-len random
// prompt token ids (or the prompts of --dataset-path, as `bench throughput` reads them), each
// asking --output-len tokens, sent at a Poisson --request-rate (inf: all at once) and at most
// --max-concurrency at a time. Measures per request the time to first token, the time per output
// token after it, the gaps between streamed tokens and the end-to-end latency, and reports
// their mean and p50/p90/p99, request and token throughput, and goodput under the --goodput
// SLOs (ttft:MS tpot:MS e2el:MS). --output-json writes every figure with the command.
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace tessera::server {

struct BenchServeOptions {
  std::string base_url = "http://127.0.0.1:8000";
  std::string endpoint = "/v1/completions";
  std::string model;    // empty: the first model /v1/models lists
  std::string api_key;  // empty: $TESSERA_API_KEY, then $OPENAI_API_KEY, then none
  uint32_t num_prompts = 1000;
  uint32_t input_len = 1024;
  uint32_t output_len = 128;
  std::string dataset_path;
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

}  // namespace tessera::server
