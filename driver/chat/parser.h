// Parses Jinja template source into a syntax tree (the subset chat templates use: see
// chat_template.h for the list).
#pragma once

#include <memory>
#include <string_view>

#include "common/status.h"
#include "driver/chat/ast.h"

namespace tessera::chat::jinja {

// Deepest nesting of expressions, and of blocks, a template may have; deeper ones are a
// syntax error (the parser and the evaluator recurse over them).
inline constexpr int kMaxSyntaxDepth = 100;

// Parses `source` (raw template text; newlines are normalized here). A syntax error, an
// unknown tag, filter or test come back as INVALID_ARGUMENT "line L, column C: message".
Expected<std::shared_ptr<const Template>> parse_template(std::string_view source);

}  // namespace tessera::chat::jinja
