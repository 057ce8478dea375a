// `tessera generate`: one prompt, end to end through a daemon and an actor process.
#pragma once

#include <string>

#include "driver/engine/sequence.h"

namespace tessera {

struct GenerateOptions {
  std::string model;  // Hugging Face model directory
  std::string prompt;
  std::string address;  // a cluster's head; "" = start a local node for this command
  SamplingOptions sampling;
  std::string dtype = "auto";
  uint32_t max_model_len = 0;  // 0 = the model's max_position_embeddings
  bool json = false;           // print one JSON object (ids, text, logprobs) instead of text
};

// Runs the command; returns the process exit code (0 ok, 1 failed). Text streams to stdout as
// it is generated; a summary line goes to stderr.
int generate_command(const GenerateOptions& options);

}  // namespace tessera
