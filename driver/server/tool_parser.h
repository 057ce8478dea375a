// Tool calls in model output, vLLM's "hermes" parser (`--enable-auto-tool-choice
// --tool-call-parser hermes`): Hermes, Qwen2.5/Qwen3 and others write each call as
//   <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>
// The text before the first call is the message's content; each call becomes an OpenAI
// tool_calls entry (arguments as a JSON string). A block whose JSON does not parse stays text.
#pragma once

#include <optional>
#include <string>
#include <vector>

namespace tessera::server {

struct ToolCall {
  std::string id;  // "chatcmpl-tool-<hex>"
  std::string name;
  std::string arguments;  // JSON text
};

struct ToolOutput {
  std::optional<std::string> content;  // null when there is nothing but calls
  std::vector<ToolCall> calls;
};

// The whole output at once (non-streaming responses).
ToolOutput parse_hermes(const std::string& text);

// The same, as text arrives: push() returns the content that is certainly not part of a call
// (text that could be the start of "<tool_call>" is held back) and the calls completed by this
// piece; finish() returns what is held back (an unfinished block is text).
class HermesStream {
 public:
  struct Delta {
    std::string content;
    std::vector<ToolCall> calls;
  };
  Delta push(const std::string& text);
  Delta finish();
  int calls() const { return calls_; }

 private:
  std::string pending_;  // unemitted text: a possible tag start, or an open block
  bool in_block_ = false;
  bool seen_call_ = false;  // after the first call, text between calls is dropped, as vLLM does
  int calls_ = 0;
};

}  // namespace tessera::server
