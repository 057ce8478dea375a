// Helpers for the chat template tests.
#pragma once

#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "driver/chat/evaluator.h"
#include "driver/chat/parser.h"
#include "driver/chat/value.h"

namespace tessera::chat::jinja::testing {

// Renders `source` with the keys of `vars` (a JSON object) as its variables. Returns the text,
// "PARSE ERROR: <message>" or "ERROR: <message>".
inline std::string render(std::string_view source,
                          const nlohmann::ordered_json& vars = nlohmann::ordered_json::object(),
                          const RenderLimits& limits = {}) {
  auto parsed = parse_template(source);
  if (!parsed) return "PARSE ERROR: " + parsed.status().message();
  std::vector<std::pair<std::string, Value>> context;
  for (auto it = vars.begin(); it != vars.end(); ++it) {
    context.emplace_back(it.key(), from_json(it.value()));
  }
  try {
    return render_template(**parsed, context, limits);
  } catch (const RenderError& e) {
    return std::string("ERROR: ") + e.what();
  }
}

}  // namespace tessera::chat::jinja::testing
