// Splits a Jinja template into tokens, the way Jinja's lexer does under transformers'
// settings: trim_blocks (the first newline after a block or comment tag is dropped),
// lstrip_blocks (spaces and tabs before a block or comment tag on its own line are dropped),
// and the '-' / '+' markers on tags ({%- ... -%}, {{- ... -}}, {#- ... -#}, {%+ ... +%}).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace tessera::chat::jinja {

enum class TokenType {
  kData,           // literal template text (comments and raw markers are gone)
  kVariableBegin,  // {{
  kVariableEnd,    // }}
  kBlockBegin,     // {%
  kBlockEnd,       // %}
  kName,
  kString,  // value: the decoded literal
  kInteger,
  kFloat,
  kOperator,  // value: "+", "//", "==", "(", ...
  kEnd,       // end of template
};

struct Token {
  TokenType type = TokenType::kEnd;
  std::string value;
  int64_t int_value = 0;
  double float_value = 0;
  size_t offset = 0;  // byte offset in the normalized source
};

// A template that cannot be parsed, at `offset` of the normalized source.
struct SyntaxError {
  size_t offset = 0;
  std::string message;
};

// Jinja's view of the source: "\r\n" and "\r" become "\n", and one trailing newline is
// dropped (keep_trailing_newline=False).
std::string normalize_source(std::string_view source);

// Tokens of normalized source, ending with kEnd. Throws SyntaxError.
std::vector<Token> tokenize(std::string_view source);

// 1-based line and column (counted in characters) of `offset` in `source`.
std::pair<int, int> line_column(std::string_view source, size_t offset);

}  // namespace tessera::chat::jinja
