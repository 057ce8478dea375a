// Post-processors of tokenizer.json ("post_processor"): add the special tokens of a single
// sequence (encode with add_special_tokens) as Hugging Face tokenizers does.
//
// Supported types: TemplateProcessing (its "single" template), ByteLevel (ids unchanged: it only
// trims offsets, which Tessera does not produce) and Sequence of them; any other type fails to
// load, naming it.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "common/status.h"

namespace tessera::tokenizer {

class PostProcessor {
 public:
  virtual ~PostProcessor() = default;
  // Wraps the ids of one encoded sequence. Thread-safe.
  virtual void process(std::vector<int32_t>& ids, bool add_special_tokens) const = 0;
  // The id a processed sequence starts with whatever the text (e.g. <s>), if any.
  virtual std::optional<int32_t> leading_special() const { return std::nullopt; }
};

// Builds the post-processor that `spec` (the "post_processor" value of tokenizer.json)
// describes; nullptr for JSON null. INVALID_ARGUMENT naming an unsupported type or a template
// that names an unknown special token. May throw nlohmann::json::exception on a malformed
// structure.
Expected<std::unique_ptr<PostProcessor>> make_post_processor(const nlohmann::json& spec);

}  // namespace tessera::tokenizer
