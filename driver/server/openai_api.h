// The OpenAI API's JSON, turned into what the engine runs and back: request bodies of
// /v1/completions and /v1/chat/completions (and vLLM's extra fields) into prompts and one
// SamplingParams; engine outputs into response objects and stream chunks; every failure into an
// OpenAI-style error body with an HTTP status. No I/O here: the HTTP server (serve.cpp) and the
// tests call these directly.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/checkpoint/model_config.h"
#include "common/load_spec.h"
#include "common/sampling_params.h"
#include "driver/engine/request.h"
#include "driver/engine/sequence.h"

namespace tessera {

class Tokenizer;
namespace chat {
class ChatTemplate;
}

namespace server {

// An error as the client sees it: {"error": {"message", "type", "param", "code"}} with `status`.
struct ApiError {
  int status = 400;
  std::string message;
  std::string type = "BadRequestError";  // NotFoundError, AuthenticationError, InternalServerError
  std::string param;                     // the offending field, when there is one
};
std::string error_body(const ApiError& e);
ApiError bad_request(std::string message, std::string param = {});

// What the server knows about the model it serves.
struct ServedModel {
  std::vector<std::string> names;  // --served-model-name (first is the one responses carry)
  std::string root;                // the model directory
  // As loaded (AsyncEngine::loaded()): vocab_size and max_model_len judge every request.
  ModelInfo info;
  GenerationDefaults defaults;  // generation_config.json (--generation-config auto)
  const Tokenizer* tokenizer = nullptr;
  const chat::ChatTemplate* chat_template = nullptr;  // null: chat requests are refused
  int64_t created = 0;                                // unix seconds the server started
  // --enable-auto-tool-choice --tool-call-parser hermes: tool calls in the output become
  // tool_calls (tool_parser.h); empty: a request with tools and tool_choice auto is refused.
  std::string tool_call_parser;
};

// A parsed request: the prompts (a completions request may carry several), each sampled `n`
// times, with one SamplingParams.
struct ApiRequest {
  bool chat = false;
  std::string model;  // as the response names it
  // One per prompt, made by parse_request (request.h): each prompt with `sampling`, valid for
  // the served model.
  std::vector<Request> requests;
  std::vector<std::string> prompt_texts;  // for echo (decoded when the prompt was token ids)
  SamplingParams sampling;
  int n = 1;
  bool stream = false;
  bool include_usage = false;  // stream_options.include_usage
  bool echo = false;
  bool chat_logprobs = false;  // chat: "logprobs": true (top_logprobs gives how many)
  bool parse_tools = false;    // chat with tools and tool_choice auto: parse tool calls
};

// Parses a request body. `chat` selects /v1/chat/completions. Errors are 400s naming the field
// (or 404 for an unknown model). The prompt must leave room in max_model_len.
// An ordered_json, parsed from the client's text: the chat template prints messages, tools and
// chat_template_kwargs (tojson) in the order their keys arrived, as vLLM and transformers do
// (a nlohmann::json converts implicitly, but with its keys sorted).
std::optional<ApiError> parse_request(const nlohmann::ordered_json& body, bool chat,
                                      const ServedModel& model, ApiRequest& out);

// One choice's result so far.
struct ChoiceResult {
  std::string text;
  std::vector<int32_t> tokens;
  std::vector<TokenLogprobs> logprobs;
  FinishReason finish_reason = FinishReason::kNone;  // kNone while running
  size_t prompt_tokens = 0;
  size_t cached_tokens = 0;
};

// The whole (non-streaming) response; choices are by prompt then by n. `created`: unix seconds
// the request arrived (as every chunk of a stream carries), not the model's `created`.
nlohmann::json completion_response(const ApiRequest& req, const std::string& id,
                                   const std::vector<ChoiceResult>& choices, int64_t created,
                                   const ServedModel& model);
// One stream chunk with `delta_text` / new tokens for choice `index`. `finish_reason` is the wire
// name on its last chunk ("stop", "length", "abort", "tool_calls"), "" (null) before. `first`
// (chat): the chunk carries the assistant role.
nlohmann::json stream_chunk(const ApiRequest& req, const std::string& id, int index,
                            const std::string& delta_text,
                            const std::vector<TokenLogprobs>& new_logprobs,
                            std::string_view finish_reason, bool first, int64_t created,
                            const ServedModel& model);
// A chunk carrying tool calls completed in a stream (indexes from `first_index`).
struct ToolCall;
nlohmann::json tool_call_chunk(const ApiRequest& req, const std::string& id, int index,
                               const std::vector<ToolCall>& calls, int first_index,
                               int64_t created);

// The usage chunk that ends a stream with include_usage: no choices.
nlohmann::json usage_chunk(const ApiRequest& req, const std::string& id,
                           const std::vector<ChoiceResult>& choices, int64_t created);
nlohmann::json usage_json(const std::vector<ChoiceResult>& choices, int n);

// GET /v1/models.
nlohmann::json models_response(const ServedModel& model);

// The API's finish_reason of a finished choice: "length" or "abort" (finish_reason_name), else
// "stop" (a failed request is answered with an error, never with a finish_reason).
std::string api_finish_reason(FinishReason reason);

}  // namespace server
}  // namespace tessera
