// `tessera generate`: prompts, end to end through a daemon and an actor process. Several
// prompts are batched together (continuous batching), each with the same sampling options.
// With -dp N (or auto) the prompts are spread over N replicas of the model's plan (a ReplicaSet,
// its router picking each prompt's replica), as vLLM's LLM(data_parallel_size=N) does; -dp 1 is
// the one engine of LLM.
#pragma once

#include <string>
#include <vector>

#include "driver/engine/sequence.h"
#include "driver/model_session.h"
#include "driver/server/replica_set.h"

namespace CLI {
class App;
}

namespace tessera {

struct GenerateOptions {
  EngineArgs engine;
  std::vector<std::string> prompts;
  std::string input;   // --input: JSONL of {"prompt"} or {"prompt_token_ids"}, instead of prompts
  std::string output;  // --output: JSONL results, a line per prompt in order (else stdout)
  SamplingParams sampling;
  bool json = false;  // print one JSON object per prompt (ids, text, logprobs) instead of text
  server::ReplicaOptions replicas;  // -dp and --router
};

// Adds `generate` to `app` with its flags bound to `options` (the engine flags, -dp and --router,
// the prompts and the sampling flags; --max-tokens defaults to 64 here). The caller runs
// generate_command when the subcommand was parsed.
CLI::App* add_generate_subcommand(CLI::App& app, GenerateOptions& options);

// Runs the command; returns the process exit code (0 ok, 1 failed). With one prompt and no
// --json, text streams to stdout as it is generated; a summary line goes to stderr, and with
// replicas a line per replica after it: the requests and tokens it ran.
int generate_command(const GenerateOptions& options);

}  // namespace tessera
