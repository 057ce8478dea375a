// Normalizers of tokenizer.json ("normalizer"): the text transforms run before pre-tokenizing,
// on each piece of text between added tokens.
//
// Supported types: NFC, Prepend, Replace (String or Regex pattern) and Sequence of them; any
// other type fails to load, naming it.
#pragma once

#include <memory>
#include <string>

#include <nlohmann/json_fwd.hpp>

#include "common/status.h"

namespace tessera::tokenizer {

class Normalizer {
 public:
  virtual ~Normalizer() = default;
  // Rewrites `text` (well-formed UTF-8) in place. Thread-safe.
  virtual void normalize(std::string& text) const = 0;
};

// Builds the normalizer that `spec` (the "normalizer" value of tokenizer.json) describes;
// nullptr for JSON null (no normalizer). INVALID_ARGUMENT naming an unsupported type or a bad
// field. May throw nlohmann::json::exception on a malformed structure (the loader reports it).
Expected<std::unique_ptr<Normalizer>> make_normalizer(const nlohmann::json& spec);

}  // namespace tessera::tokenizer
