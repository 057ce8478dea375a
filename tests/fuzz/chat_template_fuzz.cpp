// Fuzzes the chat template parser and renderer (ChatTemplate::parse and render_json). The input
// is the Jinja source, optionally followed by a NUL and the messages as JSON, and by another NUL
// and the extra context (e.g. {"enable_thinking": false}). Without messages, a short
// conversation is rendered. Every render is bounded by RenderLimits, so an input may fail but
// must neither crash nor throw.
#include <cstddef>
#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

#include "driver/chat/chat_template.h"
#include "tests/fuzz/fuzz_util.h"

namespace {

using nlohmann::ordered_json;

const ordered_json& default_messages() {
  static const ordered_json messages = ordered_json::parse(R"([
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello.", "reasoning_content": "greet back"},
    {"role": "user", "content": [{"type": "text", "text": "2+2?"}]}
  ])");
  return messages;
}

// `text` as JSON, or nullopt when it is not.
std::optional<ordered_json> parse_json(std::string_view text) {
  ordered_json j = ordered_json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return std::nullopt;
  return j;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace tessera;
  auto parts = fuzz::split_input(data, size, 3);
  auto tmpl = chat::ChatTemplate::parse(std::string(parts[0]), "<s>", "</s>");
  if (!tmpl) {
    FUZZ_CHECK(!tmpl.status().message().empty());
    return 0;
  }
  ordered_json messages = default_messages();
  if (parts.size() >= 2) {
    if (auto j = parse_json(parts[1])) messages = std::move(*j);
  }
  ordered_json extra;
  if (parts.size() >= 3) {
    if (auto j = parse_json(parts[2])) extra = std::move(*j);
  }
  for (bool add_generation_prompt : {false, true}) {
    Expected<std::string> out = tmpl->render_json(messages, add_generation_prompt, extra);
    if (!out) FUZZ_CHECK(!out.status().message().empty());
  }
  return 0;
}
