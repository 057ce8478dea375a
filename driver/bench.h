// `tessera bench latency`: vLLM's benchmark_latency. One batch of --batch-size requests of
// --input-len random prompt tokens, each generating --output-len tokens (EOS ignored, sampled at
// temperature 1, seeded), run --num-iters-warmup times unmeasured and --num-iters times
// measured; reports the mean end-to-end latency of the batch and its 10/25/50/75/90/99th
// percentiles. --output-json writes every iteration's latency with the machine and command.
#pragma once

#include <cstdio>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <vector>

#include "driver/model_session.h"
#include "driver/server/replica_set.h"

namespace tessera {

// Adds the `bench` group to `app`: it takes exactly one of the benchmarks below (each added by
// its add_bench_*_subcommand) or `bench serve` (driver/server/bench_serve.h). Each of those
// binds its flags to its options; the caller sets their command_line and runs the
// bench_*_command of the one that was parsed.
CLI::App* add_bench_subcommand(CLI::App& app);

struct BenchLatencyOptions {
  EngineArgs engine;
  uint32_t input_len = 32;
  uint32_t output_len = 128;
  uint32_t batch_size = 8;
  uint32_t num_iters_warmup = 10;
  uint32_t num_iters = 30;
  uint64_t seed = 0;
  std::string output_json;
  bool json = false;         // --json: the results as JSON on stdout, the human lines on stderr
  std::string command_line;  // recorded in the JSON
};
CLI::App* add_bench_latency_subcommand(CLI::App& bench, BenchLatencyOptions& options);
int bench_latency_command(const BenchLatencyOptions& options);

// `tessera bench report`: Tessera's multi-part report of one model on one actor, in one process
// so the model loads once: batch-1 decode (TTFT, tokens/s and where a decode step's time goes),
// one long prefill (tokens/s and TFLOP/s) and a large-batch decode (tokens/s). Greedy, EOS
// ignored, random prompt ids (seeded), no detokenization. Results print as a table and, with
// --output-json, as JSON (machine, command and every measured iteration) for bench/results/,
// which scripts/bench/report.py sets beside transformers' figures.
struct BenchReportOptions {
  EngineArgs engine;
  uint32_t input_len = 128;
  uint32_t output_len = 256;
  uint32_t num_iters = 3;
  uint32_t num_iters_warmup = 1;
  uint32_t prefill_len = 4096;  // 0 = skip the prefill scenario
  uint32_t prefill_iters = 5;
  uint32_t batch_size = 64;  // the large-batch decode scenario; 0 = skip
  uint32_t batch_iters = 2;
  uint64_t seed = 0;
  std::string output_json;
  bool json = false;         // --json: the results as JSON on stdout, the human lines on stderr
  std::string command_line;  // recorded in the JSON
};
CLI::App* add_bench_report_subcommand(CLI::App& bench, BenchReportOptions& options);
int bench_report_command(const BenchReportOptions& options);

// `tessera bench throughput`: vLLM's benchmark_throughput, offline. --num-prompts requests of
// --input-len random prompt tokens (or the prompts of --dataset-path, JSONL lines with "prompt"
// text or "prompt_token_ids", and optionally "output_len") each generating --output-len tokens
// (EOS ignored), all added at once to one engine, detokenized as vLLM's LLM.generate does.
// Reports requests/s and input/output/total tokens/s, and where the wall time went: the GPU's
// forward passes (summed over steps) against the whole, the rest being host work the GPU waited
// for. --output-json writes every figure with the machine and command. With -dp N (or auto) the
// requests are all added at once to N replicas of the plan (vLLM's --data-parallel-size): the
// report has the totals and rates, the replicas' count ("data_parallel_size" in the JSON) and
// the requests, input and output tokens each one ran ("replicas"), not the step time split.
struct BenchThroughputOptions {
  EngineArgs engine;
  server::ReplicaOptions replicas;  // -dp and --router
  uint32_t num_prompts = 1000;
  uint32_t input_len = 1024;
  uint32_t output_len = 128;
  std::string dataset_path;
  uint64_t seed = 0;
  std::string output_json;
  bool json = false;         // --json: the results as JSON on stdout, the human lines on stderr
  std::string command_line;  // recorded in the JSON
};
CLI::App* add_bench_throughput_subcommand(CLI::App& bench, BenchThroughputOptions& options);
int bench_throughput_command(const BenchThroughputOptions& options);

// `tessera bench control-plane`: the cost of the step channel alone. Loads the model as any
// command does (e.g. -tp 2 on the CPU backend), then sends --num-steps empty steps (no sequences:
// the actors apply them and answer at once) one at a time, each collected before the next, and
// reports the round trip driver -> every rank -> driver (p50/p90/p99, mean) and the actors' own
// share. --transport ring: local ranks read steps from the node's shared-memory ring and answer
// on their output rings; rpc: every step is an execute RPC (what a rank on another node gets).
struct BenchControlPlaneOptions {
  EngineArgs engine;
  std::string transport = "ring";  // ring | rpc
  uint32_t num_steps = 10000;
  uint32_t num_warmup = 200;
  std::string output_json;
  bool json = false;         // --json: the results as JSON on stdout, the human lines on stderr
  std::string command_line;  // recorded in the JSON
};
CLI::App* add_bench_control_plane_subcommand(CLI::App& bench,
                                             BenchControlPlaneOptions& options);
int bench_control_plane_command(const BenchControlPlaneOptions& options);

// One request of a benchmark: token ids, or text for the engine (or server) to tokenize.
struct BenchPrompt {
  std::vector<int32_t> ids;  // empty when `text` is the prompt
  std::string text;
  uint32_t output_len = 0;
};
// `n` prompts of `input_len` random ids (ordinary tokens of the low vocabulary: 100 .. 31999,
// below `vocab`), seeded, each asking `output_len` tokens.
std::vector<BenchPrompt> random_bench_prompts(uint32_t n, uint32_t input_len, uint32_t output_len,
                                              uint64_t seed, int64_t vocab = 32000);
// The first `limit` prompts of a JSONL dataset: each line {"prompt": "text"} or
// {"prompt_token_ids": [ids below `vocab`]}, optionally with "output_len" (else
// `output_len`); blank lines skipped. Errors name the file and line.
Expected<std::vector<BenchPrompt>> read_bench_dataset(const std::string& path, uint32_t limit,
                                                      uint32_t output_len, int64_t vocab);

// The q-th percentile (0..100) of `v`, interpolated linearly between ranks as numpy does
// (q = 50 is the median); 0 for no values.
double percentile(std::vector<double> v, double q);

// Adds --output-json FILE and --json (the result on stdout, the text on stderr) to a bench.
void add_bench_output_options(CLI::App* cmd, std::string& output_json, bool& json);

// Writes a bench result as indented JSON to `path` and says so on `say_to`.
Status write_json(const std::string& path, const nlohmann::json& j, FILE* say_to = stdout);
// Where a bench prints: its human-readable lines and tables on stdout, or on stderr with --json,
// which keeps stdout for the result's JSON (finish() prints it).
class BenchOutput {
 public:
  explicit BenchOutput(bool json) : json_(json), text_(json ? stderr : stdout) {}
  void say(const char* format, ...) const __attribute__((format(printf, 2, 3)));
  // Rows of cells as aligned columns, two spaces apart, indented two; `align` has an 'l' or 'r'
  // per column (left for names and units, right for numbers; missing letters are 'r', and the
  // first column defaults to 'l').
  void table(const std::vector<std::vector<std::string>>& rows,
             const std::string& align = "l") const;
  // --output-json to its file, and with --json the JSON on stdout.
  Status finish(const std::string& output_json, const nlohmann::json& j) const;
  FILE* text() const { return text_; }

 private:
  bool json_;
  FILE* text_;
};

// Parameters a forward pass multiplies one token by (all weights but the input embedding; a
// tied lm_head counted once; an MoE layer's router, top_k experts and shared expert: the active
// parameters), from the config.
int64_t matmul_parameters(const ModelConfig& config);

}  // namespace tessera
