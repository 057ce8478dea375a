// `tessera bench latency`: the figures vLLM's benchmark_latency reports, for one model on one
// actor, in one process so the model loads once: batch-1 decode (TTFT and tokens/s), one long
// prefill (tokens/s and TFLOP/s) and a large-batch decode (tokens/s). Greedy, EOS ignored,
// random prompt ids (seeded), no detokenization. Results print as a table and, with
// --output-json, as JSON (machine, command and every measured iteration) for bench/results/.
#pragma once

#include <string>

#include "driver/model_session.h"

namespace tessera {

struct BenchLatencyOptions {
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
  std::string command_line;  // recorded in the JSON
};

int bench_latency_command(const BenchLatencyOptions& options);

// `tessera bench throughput`: vLLM's benchmark_throughput, offline. --num-prompts requests of
// --input-len random prompt tokens (or the prompts of --dataset-path, JSONL lines with "prompt"
// text or "prompt_token_ids", and optionally "output_len") each generating --output-len tokens
// (EOS ignored), all added at once to one engine, detokenized as vLLM's LLM.generate does.
// Reports requests/s and input/output/total tokens/s, and where the wall time went: the GPU's
// forward passes (summed over steps) against the whole, the rest being host work the GPU waited
// for. --output-json writes every figure with the machine and command.
struct BenchThroughputOptions {
  EngineArgs engine;
  uint32_t num_prompts = 1000;
  uint32_t input_len = 1024;
  uint32_t output_len = 128;
  std::string dataset_path;
  uint64_t seed = 0;
  std::string output_json;
  std::string command_line;  // recorded in the JSON
};
int bench_throughput_command(const BenchThroughputOptions& options);

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

// Parameters a forward pass multiplies by (all weights but the input embedding; a tied
// lm_head counted once), from the config.
int64_t matmul_parameters(const ModelConfig& config);

}  // namespace tessera
