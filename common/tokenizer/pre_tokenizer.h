// Pre-tokenizers of tokenizer.json ("pre_tokenizer"): split normalized text into the pieces the
// model tokenizes one at a time (and, for ByteLevel, map bytes to the GPT-2 alphabet).
//
// Supported types: Split (String or Regex pattern, every SplitDelimiterBehavior, invert),
// ByteLevel (add_prefix_space, use_regex), Metaspace (replacement, prepend_scheme, split) and
// Sequence of them; any other type fails to load, naming it.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "common/status.h"

namespace tessera::tokenizer {

// One piece of text on its way to the model.
struct PreToken {
  std::string text;
  // True if the piece starts at the beginning of the input text (offset 0 in the original):
  // Metaspace's prepend_scheme "first" prepends only there.
  bool at_start = false;
};

class PreTokenizer {
 public:
  virtual ~PreTokenizer() = default;
  // Replaces `pieces` by their sub-pieces, in order; empty pieces are dropped. Thread-safe.
  virtual void pre_tokenize(std::vector<PreToken>& pieces) const = 0;
};

// Builds the pre-tokenizer that `spec` (the "pre_tokenizer" value of tokenizer.json) describes;
// nullptr for JSON null. INVALID_ARGUMENT naming an unsupported type, behavior or a regex that
// does not compile. May throw nlohmann::json::exception on a malformed structure.
Expected<std::unique_ptr<PreTokenizer>> make_pre_tokenizer(const nlohmann::json& spec);

// Appends the GPT-2 byte-level form of `bytes` (each byte mapped to its char) to `out`.
void append_byte_level(std::string_view bytes, std::string& out);

}  // namespace tessera::tokenizer
