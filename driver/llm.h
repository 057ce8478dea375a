// vLLM's offline API in C++: an LLM over a model (placed on the cluster or an embedded local
// node, as `tessera generate` does) and generate(prompts, SamplingParams) -> one result per
// prompt, in order. The same engine as the server: continuous batching, chunked prefill,
// prefix caching, preemption.
//
//   tessera::EngineArgs args;
//   args.model = "/models/Llama-3.1-8B-Instruct";
//   auto llm = tessera::LLM::open(args);                      // Expected<unique_ptr<LLM>>
//   tessera::SamplingParams params;
//   params.temperature = 0.8f;
//   auto results = (*llm)->generate({"Hello, my name is"}, params);
//   std::cout << (*results)[0].text;
//
// driver/examples/offline_inference.cpp is the whole program.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "driver/model_session.h"

namespace tessera {

struct GenerationResult {
  std::vector<int32_t> prompt_token_ids;
  std::string text;
  std::vector<int32_t> token_ids;
  std::vector<TokenLogprobs> logprobs;  // when params.logprobs >= 0
  FinishReason finish_reason = FinishReason::kNone;  // kStop or kLength
  std::variant<std::monostate, int32_t, std::string> stop_reason;  // RequestOutput's
  size_t cached_tokens = 0;  // prompt tokens found in the prefix cache
  // When the call queued it, when its first token and its last output came.
  std::chrono::steady_clock::time_point arrival;
  std::optional<std::chrono::steady_clock::time_point> first_token;
  std::chrono::steady_clock::time_point finished;
};

class LLM {
 public:
  // Validates the arguments, starts (or joins) the cluster, places and loads the model.
  static Expected<std::unique_ptr<LLM>> open(const EngineArgs& args,
                                             const std::string& owner = "tessera LLM");

  // Each prompt's completion, in the prompts' order. Prompts are tokenized as transformers'
  // tokenizer(prompt) does (special tokens added as the tokenizer's config says).
  // `on_output` (optional) sees every output as it is produced: the prompt's index and the
  // engine's output (a text delta and new tokens), for streaming. INVALID_ARGUMENT for bad
  // parameters or a prompt that does not fit; a failed step fails the call naming the cause.
  Expected<std::vector<GenerationResult>> generate(
      const std::vector<std::string>& prompts, const SamplingParams& params,
      const std::function<void(size_t, const RequestOutput&)>& on_output = nullptr);
  Expected<std::vector<GenerationResult>> generate(
      const std::vector<std::vector<int32_t>>& prompt_token_ids, const SamplingParams& params,
      const std::function<void(size_t, const RequestOutput&)>& on_output = nullptr);

  // The same for requests made already (Request::make against session().model()).
  Expected<std::vector<GenerationResult>> generate(
      std::vector<Request> requests,
      const std::function<void(size_t, const RequestOutput&)>& on_output = nullptr);
  ModelSession& session() { return *session_; }

  // Asked between engine steps while generate() runs: a non-OK status aborts the call's
  // requests (none of them stays queued) and generate() returns it. How a caller's Ctrl-C ends
  // a call (the Python module asks the interpreter whether a signal came). Null: never asked.
  void set_interrupt(std::function<Status()> check) { interrupt_ = std::move(check); }

 private:
  LLM() = default;
  std::unique_ptr<ModelSession> session_;
  std::function<Status()> interrupt_;
};

}  // namespace tessera
