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

// Parameters a forward pass multiplies by (all weights but the input embedding; a tied
// lm_head counted once), from the config.
int64_t matmul_parameters(const ModelConfig& config);

}  // namespace tessera
