// A compiled PCRE2 regular expression (UTF + UCP, JIT when available), shared by threads.
//
// Hugging Face tokenizers runs its split patterns with Oniguruma; PCRE2 is also a backtracking
// engine with leftmost-first alternation and Unicode properties, so the Llama 3 / Qwen / GPT-2
// patterns (\p{L}, \p{N}, (?i:...), lookahead) match the same pieces.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/status.h"

namespace tessera::tokenizer {

class Regex {
 public:
  // Compiles `pattern` (UTF-8, PCRE2 syntax). INVALID_ARGUMENT naming the offset of the error
  // if it does not compile.
  static Expected<Regex> compile(std::string_view pattern);
  // A pattern matching `literal` exactly.
  static Expected<Regex> literal(std::string_view literal);

  Regex(Regex&&) noexcept;
  Regex& operator=(Regex&&) noexcept;
  ~Regex();

  // Byte ranges [begin, end) of the successive non-overlapping, non-empty matches in `text`,
  // left to right (after an empty match the search resumes one character later). `text` must be
  // well-formed UTF-8. Thread-safe.
  std::vector<std::pair<size_t, size_t>> find_all(std::string_view text) const;

  const std::string& pattern() const { return pattern_; }

 private:
  struct Code;
  explicit Regex(std::unique_ptr<Code> code, std::string pattern);
  std::unique_ptr<Code> code_;
  std::string pattern_;
};

}  // namespace tessera::tokenizer
