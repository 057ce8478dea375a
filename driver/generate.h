// `tessera generate`: prompts, end to end through a daemon and an actor process. Several
// prompts are batched together (continuous batching), each with the same sampling options.
#pragma once

#include <string>
#include <vector>

#include "driver/engine/sequence.h"
#include "driver/model_session.h"

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
};

// Adds `generate` to `app` with its flags bound to `options` (the engine flags, the prompts and
// the sampling flags; --max-tokens defaults to 64 here). The caller runs generate_command when
// the subcommand was parsed.
CLI::App* add_generate_subcommand(CLI::App& app, GenerateOptions& options);

// Runs the command; returns the process exit code (0 ok, 1 failed). With one prompt and no
// --json, text streams to stdout as it is generated; a summary line goes to stderr.
int generate_command(const GenerateOptions& options);

}  // namespace tessera
